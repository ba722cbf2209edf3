"""Noise for libp2p connections: py-libp2p's XX handshake, our own record layer.

Why not py-libp2p's session: it moves ~45 MB/s on a 2-core machine, and
ChaCha20-Poly1305 is not the reason (``cryptography`` does 2 GB/s here). The
time goes to Python layering per 64 KiB message: a length read, a body read,
the ``noise`` package's wrappers, a ``BytesIO`` re-buffer, a lock per read.
The handshake runs once per connection and is spec-correct and interop-tested,
so it stays py-libp2p's; once it is done we take the two cipher keys and run
the transport phase here.

:class:`NoiseCodec` is the record layer with no I/O (h11 style): ``encrypt``
seals any amount of plaintext into one buffer of back-to-back messages, ready
for a single ``send``; ``feed`` opens every complete message one socket read
brought. Each comes in two halves for the threads: ``plan_seal`` takes a
write's nonces in wire order and returns a :class:`Sealing`, ``take`` frames a
read's messages into an :class:`Opening`, and either is then run in ranges.
:class:`NoiseSession` is the I/O edge, an ``ISecureConn`` for py-libp2p's
upgrader; its :class:`CryptoPool` (:class:`NoiseConfig`) runs the batches on
the loop, or for big ones on worker threads where the cores allow.

Wire format (libp2p noise spec, transport phase): each message is a 2-byte
big-endian length, then ChaCha20-Poly1305 ciphertext and its 16-byte tag, at
most 65535 bytes in all; the nonce is the message counter, 64-bit
little-endian after 4 zero bytes; there is no associated data.
"""

from __future__ import annotations

import os
import struct
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from libp2p.abc import IRawConnection, ISecureConn, ISecureTransport
from libp2p.connection_types import ConnectionType
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.peer.id import ID
from libp2p.security.base_session import BaseSession
from libp2p.crypto.keys import PublicKey
from libp2p.security.noise.exceptions import (
    HandshakeHasNotFinished,
    InvalidSignature,
    NoiseStateError,
    PeerIDMismatchesPubkey,
)
from libp2p.security.noise.io import NoiseHandshakeReadWriter
from libp2p.security.noise.messages import NoiseExtensions, NoiseHandshakePayload, verify_handshake_payload_sig
from libp2p.security.noise.patterns import PatternXX
from libp2p.security.noise.transport import PROTOCOL_ID
from libp2p.security.noise.transport import Transport as HandshakeTransport
from multiaddr import Multiaddr

from .errors import ConfigError, RemoteProtocolError
from .trio_util import Mutex

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "MAX_MESSAGE",
    "MAX_PLAINTEXT",
    "PROTOCOL_ID",
    "CryptoPool",
    "Handshaken",
    "NoiseCodec",
    "NoiseConfig",
    "NoiseError",
    "NoiseSession",
    "NoiseTransport",
    "Opening",
    "Sealing",
    "crypto_threads_for",
    "pieces",
    "process_cores",
    "spans",
    "usable_cores",
]

#: Largest transport message, length prefix excluded (the prefix is 2 bytes).
MAX_MESSAGE = 65535
TAG_SIZE = 16
#: Most plaintext one message carries.
MAX_PLAINTEXT = MAX_MESSAGE - TAG_SIZE
#: A part this big starts a Noise message of its own (:func:`_cut`).
OWN_MESSAGE = 16 * 1024
#: Bytes asked of the socket per read: several messages, so one wake-up opens many.
READ_SIZE = 1024 * 1024

_LENGTH = struct.Struct(">H")
_NONCE = struct.Struct("<4xQ")
#: cgroup v2's CPU quota of this process's group (read by :func:`process_cores`)
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
#: The spec reserves nonce 2^64-1; a connection must end before reaching it.
_NONCE_LIMIT = 2**64 - 1


@dataclass
class NoiseConfig:
    """Where a node's connections seal and open their bytes.

    On the event loop, Noise's per-byte work (ChaCha20-Poly1305, ~3 GB/s a core) shares one core
    with everything else the node does, so a peer that sends and receives S bytes at once (an
    all-reduce) does twice the work of one stream's sender or receiver on that core. The cipher
    releases the GIL (two threads seal 1.57x as fast as one on 2 cores), so a host with cores to
    spare seals and opens big writes and reads on worker threads (a very big one split across
    them) while the loop goes on; a 2-core machine keeps it all on the loop, where a thread hop
    would only add its cost (:func:`crypto_threads_for`).
    """

    #: Worker threads for the node's sealing and opening, all connections together; None: chosen by
    #: the cores this process may use (:func:`crypto_threads_for`); 0: all on the event loop.
    crypto_threads: int | None = None
    #: The smallest write or read whose messages leave the loop. A thread hop (``trio.to_thread``)
    #: costs the loop ~90 us of its own CPU on the 2-core machine (``bench/noise_threads.py``): a
    #: 256 KiB seal on a thread left the loop 80 of its 90 us, a 768 KiB one 100 of 263 us, 1 MiB
    #: 101 of 349 us; and a write waits the hop's latency too (768 KiB: 473 us against 263).
    offload_bytes: int = 768 * 1024
    #: A batch goes to several threads only in ranges of at least this many bytes: each range is one
    #: more hop on the loop (1 MiB on 2 threads cost the loop 197 us against 101 on one; 4 MiB on 2
    #: threads took 1.1 ms against 1.7 on one, for 362 us of the loop against 292).
    split_bytes: int = 2 * 1024 * 1024

    def threads(self) -> int:
        """The worker threads to use on this machine (by :func:`process_cores`)."""
        return self.crypto_threads if self.crypto_threads is not None else crypto_threads_for(process_cores())

    def validate(self) -> None:
        if self.crypto_threads is not None and not 0 <= self.crypto_threads <= 64:
            raise ConfigError(f"noise.crypto_threads must be from 0 to 64 (or None: by cores), got {self.crypto_threads}")
        for name in ("offload_bytes", "split_bytes"):
            if getattr(self, name) < MAX_MESSAGE:
                raise ConfigError(f"noise.{name} must be at least one message ({MAX_MESSAGE} bytes), "
                                  f"got {getattr(self, name)}")


def process_cores() -> int:
    """The cores this process may keep busy: its CPU affinity, capped by a cgroup v2 quota, as a
    container's limit is (:func:`usable_cores` on what the machine says)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open(CGROUP_CPU_MAX) as f:
            cpu_max: str | None = f.read()
    except OSError:
        cpu_max = None
    return usable_cores(affinity, cpu_max)


def usable_cores(affinity: int, cpu_max: str | None) -> int:
    """The cores a process may keep busy: its CPU ``affinity``, capped by a cgroup v2 quota
    (``cpu.max``: ``"QUOTA PERIOD"`` in microseconds, ``"max PERIOD"`` for none), rounded up. A
    container on a 64-core host with a quota of 2 CPUs has 64 cores in its affinity and 2 to use."""
    quota, _, period = (cpu_max or "").strip().partition(" ")
    if quota.isdigit() and period.isdigit() and int(period) > 0:
        return max(1, min(affinity, -(-int(quota) // int(period))))
    return max(1, affinity)


def crypto_threads_for(cores: int) -> int:
    """Crypto worker threads for a process that may use ``cores`` cores: none below 4, then one
    per 4 cores, at most 4.

    Measured on 2 cores (``bench/allreduce_speed.py --crypto-threads``): one thread per node made
    one stream 1,506 -> 820 MB/s and the 2-peer round of 400 MB 0.81 -> 1.10 s (0.87 -> 1.17 s with
    the offload sizes since), the hops and threads taking the cores the loops needed. Above 4 cores the rule is unmeasured: the GPU
    host's run (``bench/gpu_session.sh``) measures it against ``crypto_threads=0``."""
    return min(4, cores // 4)


def pieces(size: int, threads: int, split_bytes: int) -> int:
    """How many threads a batch of ``size`` bytes is split across: one per ``split_bytes``, at most
    ``threads``, at least one."""
    return max(1, min(threads, size // split_bytes))


def spans(count: int, parts: int) -> list[tuple[int, int]]:
    """``range(count)`` in at most ``parts`` contiguous ranges of near-equal length, in order."""
    parts = max(1, min(parts, count))
    return [(count * k // parts, count * (k + 1) // parts) for k in range(parts)]


class CryptoPool:
    """The I/O edge of :class:`NoiseConfig`: runs a batch's ``work(lo, hi)`` over its ``count``
    messages, on the loop when the pool has no threads or the batch is under ``offload_bytes``,
    else on worker threads while the loop goes on: one, or for a big batch one per ``split_bytes``
    (one ``trio.to_thread`` call per range; the node's threads bounded by one limiter, so that
    batches of several connections run side by side). One pool serves a node's connections."""

    def __init__(self, config: NoiseConfig) -> None:
        config.validate()
        self.threads = config.threads()
        self.offload_bytes = config.offload_bytes
        self.split_bytes = config.split_bytes
        self._limiter = trio.CapacityLimiter(self.threads) if self.threads else None
        #: batches that ran on threads (a test's and a bench's view)
        self.offloaded = 0

    async def run(self, work: Callable[[int, int], None], count: int, size: int) -> None:
        if self._limiter is None or size < self.offload_bytes:
            work(0, count)
            return
        self.offloaded += 1
        ranges = spans(count, pieces(size, self.threads, self.split_bytes))
        if len(ranges) == 1:
            await trio.to_thread.run_sync(work, 0, count, limiter=self._limiter)
            return
        async with trio.open_nursery() as nursery:
            for lo, hi in ranges:
                nursery.start_soon(partial(trio.to_thread.run_sync, work, lo, hi, limiter=self._limiter))


class NoiseError(RemoteProtocolError, ConnectionClosedError):
    """The secure channel broke: a forged or garbled message, a truncated stream,
    or nonce exhaustion. The connection is unusable afterwards.

    It is also a libp2p ``ConnectionClosedError``, so py-libp2p code above
    treats it as the connection ending.
    """


class NoiseCodec:
    """The Noise transport phase for one connection, as a state machine with no I/O.

    After the first error it refuses all further input: a Noise channel cannot
    resynchronise, and continuing would decrypt with the wrong nonce.
    """

    def __init__(self, send_key: bytes, recv_key: bytes, *, send_nonce: int = 0, recv_nonce: int = 0) -> None:
        self._send = ChaCha20Poly1305(send_key)
        self._recv = ChaCha20Poly1305(recv_key)
        self._send_nonce = send_nonce
        self._recv_nonce = recv_nonce
        self._partial = bytearray()
        self._failed: NoiseError | None = None

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete incoming message held back (at most 65536)."""
        return len(self._partial)

    def encrypt(self, *parts: Buffer) -> bytearray:
        """Seal ``parts`` (read back to back) into wire messages, in one buffer.

        Parts are cut into messages without joining them first; only a message
        that straddles two parts is assembled (at most ``MAX_PLAINTEXT`` bytes).
        """
        sealing = self.plan_seal(*parts)
        sealing.seal(0, sealing.count)
        return sealing.out

    def plan_seal(self, *parts: Buffer) -> Sealing:
        """:meth:`encrypt` in two halves: the messages' nonces are taken and their lengths written
        now, in wire order; the batch's ``seal`` then fills any ranges of them, on any thread."""
        views = [memoryview(p).cast("B") for p in parts]
        plains = list(_cut(views, MAX_PLAINTEXT))
        count = len(plains)
        # Nonces send_nonce .. send_nonce + count - 1 must all stay below the reserved 2^64-1.
        if self._send_nonce + count > _NONCE_LIMIT:
            raise NoiseError("Noise send nonce exhausted: the connection must be re-established")
        sealing = Sealing(self._send, plains, self._send_nonce)
        self._send_nonce += count
        return sealing

    def feed(self, data: Buffer) -> list[bytes]:
        """Take bytes from the wire; return the plaintext of every message they complete."""
        opening = self.take(data)
        opening.open(0, opening.count)
        return opening.plaintext()

    def take(self, data: Buffer) -> Opening:
        """:meth:`feed` in two halves: the messages ``data`` completes, framed with their nonces
        (an impossible length fails here); the batch's ``open`` then opens any ranges of them, on
        any thread, and ``plaintext`` gives them in order or raises for the first that failed."""
        if self._failed is not None:
            raise self._failed
        messages: list[memoryview] = []
        view = memoryview(data).cast("B")
        partial = self._partial
        if partial:
            # Finish the message the previous read cut, copying only its own bytes.
            if len(partial) < 2:
                need = 2 - len(partial)
                partial += view[:need]
                view = view[need:]
            if len(partial) >= 2:
                end = 2 + _LENGTH.unpack_from(partial)[0]
                need = end - len(partial)
                partial += view[:need]
                view = view[need:]
                if len(partial) == end:
                    self._partial = bytearray()
                    messages.append(self._framed(memoryview(partial)[2:end], self._recv_nonce))
        if not self._partial:
            pos, size = 0, len(view)
            while size - pos >= 2:
                end = pos + 2 + ((view[pos] << 8) | view[pos + 1])
                if end > size:
                    break
                messages.append(self._framed(view[pos + 2 : end], self._recv_nonce + len(messages)))
                pos = end
            self._partial = bytearray(view[pos:])
        opening = Opening(self, self._recv, messages, self._recv_nonce)
        self._recv_nonce += len(messages)
        return opening

    def _framed(self, message: memoryview, nonce: int) -> memoryview:
        """``message`` if it can be one: long enough for its tag, its nonce below the limit."""
        if len(message) < TAG_SIZE:
            raise self._fail(f"Noise message of {len(message)} bytes is shorter than its {TAG_SIZE}-byte tag")
        if nonce >= _NONCE_LIMIT:
            raise self._fail("Noise receive nonce exhausted")
        return message

    def _fail(self, why: str) -> NoiseError:
        self._failed = NoiseError(why)
        self._partial = bytearray()
        return self._failed


class Sealing:
    """One write's messages, planned by :meth:`NoiseCodec.plan_seal`: nonces taken and lengths
    written in ``out``; :meth:`seal` fills a range of them. Ranges touch disjoint bytes of ``out``,
    so threads may seal ranges side by side: the cipher releases the GIL, and one cryptography AEAD
    object serves several threads at once (each call works on a context of its own; 4 threads x 600
    mixed calls on one object gave every byte a lone thread gives)."""

    def __init__(self, cipher: ChaCha20Poly1305, plains: list[bytes | memoryview], first_nonce: int) -> None:
        self._cipher = cipher
        self._plains = plains
        self._first_nonce = first_nonce
        self.count = len(plains)
        self.size = sum(len(p) for p in plains)
        self.out = bytearray(self.size + self.count * (_LENGTH.size + TAG_SIZE))
        self._offsets: list[int] = []
        pos = 0
        for plain in plains:
            self._offsets.append(pos)
            _LENGTH.pack_into(self.out, pos, len(plain) + TAG_SIZE)
            pos += 2 + len(plain) + TAG_SIZE

    def seal(self, lo: int, hi: int) -> None:
        """Seal messages ``lo`` .. ``hi - 1`` into their places in ``out``."""
        window = memoryview(self.out)
        seal = self._cipher.encrypt_into
        for i in range(lo, hi):
            plain, pos = self._plains[i], self._offsets[i] + 2
            seal(_NONCE.pack(self._first_nonce + i), plain, None, window[pos : pos + len(plain) + TAG_SIZE])


class Opening:
    """The messages one read completed, framed by :meth:`NoiseCodec.take`; :meth:`open` opens a
    range of them (any thread, ranges side by side), :meth:`plaintext` gives them in wire order.
    A message that fails authentication fails the codec for good: a Noise channel cannot resynchronise."""

    def __init__(self, codec: NoiseCodec, cipher: ChaCha20Poly1305, messages: list[memoryview],
                 first_nonce: int) -> None:
        self._codec = codec
        self._cipher = cipher
        self._messages = messages
        self._first_nonce = first_nonce
        self.count = len(messages)
        self.size = sum(len(m) for m in messages)
        self._plain: list[bytes | None] = [None] * self.count

    def open(self, lo: int, hi: int) -> None:
        """Open messages ``lo`` .. ``hi - 1``; one that fails its tag is left unopened, and so is the rest of the range."""
        decrypt = self._cipher.decrypt
        for i in range(lo, hi):
            try:
                self._plain[i] = decrypt(_NONCE.pack(self._first_nonce + i), self._messages[i], None)
            except InvalidTag:
                return

    def plaintext(self) -> list[bytes]:
        """Each message's plaintext in order (empty ones left out); raises at the first not opened."""
        out: list[bytes] = []
        for i, plain in enumerate(self._plain):
            if plain is None:
                raise self._codec._fail(f"Noise message #{self._first_nonce + i} failed authentication: "
                                        "garbled or forged ciphertext")
            if plain:
                out.append(plain)
        return out


def _cut(views: list[memoryview], size: int) -> Iterator[bytes | memoryview]:
    """The concatenation of ``views`` in pieces of ``size`` bytes at most.

    A view of ``OWN_MESSAGE`` bytes or more starts a message of its own: what came before it (a
    yamux header, say) is sealed alone rather than joined to its first bytes. That costs 18 bytes
    and one small seal, and saves a copy of up to a message on both sides (here the join, there the
    slice that separates the next header from the data); each whole message of the view is then
    sealed, and opened, in place."""
    pending: list[memoryview] = []
    room = size
    for view in views:
        if pending and len(view) >= OWN_MESSAGE:
            yield pending[0] if len(pending) == 1 else b"".join(pending)
            pending, room = [], size
        while len(view):
            piece = view[:room]
            view = view[room:]
            pending.append(piece)
            room -= len(piece)
            if room == 0:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, room = [], size
    if pending:
        yield pending[0] if len(pending) == 1 else b"".join(pending)


class NoiseSession(BaseSession):
    """A secured connection: the I/O edge of :class:`NoiseCodec` over a raw connection.

    Writes are serialised by a lock taken *before* encrypting, so the nonce
    order is the wire order. A write or read that fails or is cancelled midway
    leaves the channel out of step, so the session marks itself broken and
    every later call raises.
    """

    def __init__(
        self,
        raw: IRawConnection,
        codec: NoiseCodec,
        *,
        local_peer: ID,
        local_key_pair: KeyPair,
        remote_peer: ID,
        is_initiator: bool,
        remote_public_key: object,
        crypto: CryptoPool | None = None,
    ) -> None:
        super().__init__(
            local_peer=local_peer,
            local_private_key=local_key_pair.private_key,
            remote_peer=remote_peer,
            remote_permanent_pubkey=remote_public_key,  # type: ignore[arg-type]
            is_initiator=is_initiator,
        )
        self.raw = raw
        self._socket = _tcp_socket_of(raw)
        self._codec = codec
        #: where this session's sealing and opening run (None given: all on the loop)
        self._crypto = crypto or CryptoPool(NoiseConfig(crypto_threads=0))
        self._plain: deque[bytes] = deque()
        self._send_lock = Mutex()
        self._broken: BaseException | None = None
        self._eof = False
        self._preface: Preface | None = None
        self._partial = bytearray()  # a preface message cut between two reads
        #: the stream muxer agreed on inside the handshake (None: negotiate it)
        self.early_muxer: str | None = None

    # ---------------------------------------------------------------- reading

    def expect_preface(self, preface: Preface) -> None:
        """Give ``preface`` the first bytes the peer sends, before any reader sees them.

        The dialer proposes the muxer without waiting for the answer (one round trip
        less); the answer arrives in front of the muxer's first frames, and a wrong
        one fails the first read.
        """
        self._preface = preface

    async def read_messages(self) -> list[bytes]:
        """Every plaintext piece available, waiting for at least one; ``[]`` at a clean end.

        The muxer's read path: one call per socket read, no re-buffering.
        """
        while True:
            pieces = await self._read_pieces()
            if self._preface is None or not pieces:
                return pieces
            pieces = self._strip_preface(pieces)
            if pieces:
                return pieces

    def _strip_preface(self, pieces: list[bytes]) -> list[bytes]:
        """Feed the expected preface exactly its bytes from the front of ``pieces``; the rest."""
        preface = self._preface
        assert preface is not None
        for i, piece in enumerate(pieces):
            view = piece
            while view and not preface.done:
                wanted = preface.wanted
                take = wanted - len(self._partial)  # a message of the preface may span pieces
                self._partial += view[:take]
                view = view[take:]
                if len(self._partial) == wanted:
                    chunk, self._partial = bytes(self._partial), bytearray()
                    try:
                        preface.feed(chunk)
                    except Exception as e:
                        self._broken = e
                        raise
            if preface.done:
                self._preface = None
                return ([view] if view else []) + pieces[i + 1:]
        return []

    async def _read_pieces(self) -> list[bytes]:
        if self._plain:
            pieces = list(self._plain)
            self._plain.clear()
            return pieces
        while True:
            if self._broken is not None:
                raise NoiseError(f"secure channel already broken: {self._broken}")
            if self._eof:
                return []
            with self._breaks_on_failure():
                if self._socket is not None:
                    data = await self._socket.receive_some(READ_SIZE)
                else:
                    data = await self.raw.read(READ_SIZE)
            if not data:
                self._eof = True
                if self._codec.buffered:
                    raise NoiseError(f"connection closed in the middle of a Noise message ({self._codec.buffered} bytes)")
                return []
            # A garbled message breaks the channel, and so does a cancel once the read's nonces are taken.
            with self._breaks_on_failure():
                opening = self._codec.take(data)
                if not opening.count:
                    continue
                await self._crypto.run(opening.open, opening.count, opening.size)
                pieces = opening.plaintext()
            if pieces:
                return pieces

    async def read(self, n: int | None = None) -> bytes:
        """Up to ``n`` bytes (all available when None), waiting for some; raises at the end."""
        if not self._plain:
            pieces = await self.read_messages()
            if not pieces:
                raise ConnectionClosedError("connection closed")
            self._plain.extend(pieces)
        if n is None or n < 0:
            data = b"".join(self._plain)
            self._plain.clear()
            return data
        out = bytearray()
        while self._plain and len(out) < n:
            piece = self._plain.popleft()
            room = n - len(out)
            if len(piece) > room:
                self._plain.appendleft(piece[room:])
                piece = piece[:room]
            out += piece
        return bytes(out)

    # ---------------------------------------------------------------- writing

    async def write(self, data: bytes) -> None:
        await self.write_parts(data)

    async def write_parts(self, *parts: Buffer) -> None:
        """Send ``parts`` back to back, sealed, in one write to the raw connection."""
        async with self._send_lock:
            if self._broken is not None:
                raise NoiseError(f"secure channel already broken: {self._broken}")
            sealing = self._codec.plan_seal(*parts)
            if not sealing.count:
                return
            with self._breaks_on_failure():  # nonces taken: a write cut short breaks the channel
                await self._crypto.run(sealing.seal, sealing.count, sealing.size)
                if self._socket is not None:
                    await self._socket.send_all(memoryview(sealing.out))
                else:
                    await self.raw.write(cast(bytes, sealing.out))

    @contextmanager
    def _breaks_on_failure(self) -> Iterator[None]:
        """Socket I/O that fails or is cancelled midway leaves the channel out of step: mark it broken."""
        try:
            yield
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._broken = e
            raise NoiseError(f"connection lost: {e}") from e
        except BaseException as e:
            self._broken = e
            raise

    async def close(self) -> None:
        await self.raw.close()

    # ---------------------------------------------------------------- about the connection

    def get_remote_address(self) -> tuple[str, int] | None:
        return self.raw.get_remote_address()

    def local_address(self) -> tuple[str, int] | None:
        """Our end of the TCP connection (None for other transports, e.g. relayed)."""
        if self._socket is None:
            return None
        try:
            name = self._socket.socket.getsockname()
            return str(name[0]), int(name[1])
        except OSError:
            return None

    def get_transport_addresses(self) -> list[Multiaddr]:
        return self.raw.get_transport_addresses()

    def get_connection_type(self) -> ConnectionType:
        return self.raw.get_connection_type()


class Preface(Protocol):
    """Bytes the peer sends first, checked before any reader sees the rest
    (:class:`p2p.multistream.Reply`): ``wanted`` next, ``feed`` them, ``done``."""

    @property
    def done(self) -> bool: ...

    @property
    def wanted(self) -> int: ...

    def feed(self, data: bytes) -> None: ...


def _tcp_socket_of(raw: IRawConnection) -> trio.SocketStream | None:
    """The trio socket under py-libp2p's TCP connection, if that is what ``raw`` is.

    Its wrapper takes a lock per call (a task switch) and swallows writes to a
    closed socket; the session serialises its own I/O, so it talks to the
    socket directly. Other transports (relayed streams) go through ``raw``.
    """
    stream = getattr(getattr(raw, "stream", None), "stream", None)
    return stream if isinstance(stream, trio.SocketStream) else None


class _XX(PatternXX):
    """py-libp2p's XX handshake, with the libp2p spec's inlined muxer negotiation
    (connections/inlined-muxer-negotiation.md): each side lists the stream muxers it
    speaks in its handshake payload's extensions, and the muxer is the first of the
    initiator's list that the responder speaks, with no multistream round after the
    handshake. A peer that lists none (py-libp2p, older releases) gets multistream.

    :meth:`run_inbound` and :meth:`run_outbound` are py-libp2p 0.8.1's ``handshake_inbound`` and
    ``handshake_outbound``, less its debug logging and prologue (we set none), keeping the peer's
    payload (its methods drop it), and returning the keys (:class:`Handshaken`) where its return a
    session of its own, which :class:`NoiseTransport` would only take apart again.
    """

    def __init__(self, transport: HandshakeTransport, muxers: Sequence[str]) -> None:
        super().__init__(transport.local_peer, transport.libp2p_privkey, transport.noise_privkey)
        self.muxers = list(muxers)
        self.peer_muxers: list[str] = []

    def make_handshake_payload(self, extensions: NoiseExtensions | None = None) -> NoiseHandshakePayload:
        return super().make_handshake_payload(NoiseExtensions(stream_muxers=self.muxers) if self.muxers else None)

    def agreed_muxer(self, *, initiator: bool) -> str | None:
        """The muxer both sides listed, the initiator's preference first; None: negotiate it."""
        first, second = (self.muxers, self.peer_muxers) if initiator else (self.peer_muxers, self.muxers)
        return next((m for m in first if m in second), None)

    def _take_payload(self, msg: bytes, handshake_state: Any) -> NoiseHandshakePayload:
        """The peer's payload, verified; its muxers kept. (``handshake_state``: the untyped
        ``noise`` package's, taken before the handshake ends: the last message removes it.)"""
        payload = NoiseHandshakePayload.deserialize(msg)
        if handshake_state is None or handshake_state.rs is None:
            raise NoiseStateError("the peer's static key is missing after its payload")
        if not verify_handshake_payload_sig(payload, self._get_pubkey_from_noise_keypair(handshake_state.rs)):
            raise InvalidSignature
        if payload.extensions is not None:
            # Only those we speak, in the peer's order: the agreement reads no other, and the list
            # stays as short as ours whatever the peer sends (a cut at N entries could make the two
            # sides agree on different muxers).
            self.peer_muxers = [m for m in map(str, payload.extensions.stream_muxers) if m in self.muxers]
        return payload

    async def run_inbound(self, conn: IRawConnection) -> Handshaken:
        """The responder's three messages (py-libp2p 0.8.1's ``handshake_inbound``)."""
        noise_state = self.create_noise_state()
        noise_state.set_as_responder()
        noise_state.start_handshake()
        handshake_state = noise_state.noise_protocol.handshake_state
        read_writer = NoiseHandshakeReadWriter(conn, noise_state)
        await read_writer.read_msg()  # msg 1
        await read_writer.write_msg(self.make_handshake_payload().serialize())  # msg 2
        payload = self._take_payload(await read_writer.read_msg(), handshake_state)  # msg 3
        return Handshaken.of(noise_state, payload.id_pubkey)

    async def run_outbound(self, conn: IRawConnection, remote_peer: ID | None) -> Handshaken:
        """The initiator's three messages (py-libp2p 0.8.1's ``handshake_outbound``): the answer
        must come from ``remote_peer`` (None: from anyone, as an address without a peer id)."""
        noise_state = self.create_noise_state()
        read_writer = NoiseHandshakeReadWriter(conn, noise_state)
        noise_state.set_as_initiator()
        noise_state.start_handshake()
        handshake_state = noise_state.noise_protocol.handshake_state
        await read_writer.write_msg(b"")  # msg 1: the ephemeral key alone, an empty payload
        payload = self._take_payload(await read_writer.read_msg(), handshake_state)  # msg 2
        remote = ID.from_pubkey(payload.id_pubkey)
        if remote_peer is not None and remote != remote_peer:
            raise PeerIDMismatchesPubkey(f"peer id does not correspond to the received pubkey: "
                                         f"remote_peer={remote_peer}, remote_peer_id_from_pubkey={remote}")
        await read_writer.write_msg(self.make_handshake_payload().serialize())  # msg 3
        return Handshaken.of(noise_state, payload.id_pubkey)


@dataclass(frozen=True)
class Handshaken:
    """What a finished handshake leaves the record layer: the transport phase's two keys (the Noise
    spec's Split(), whose cipher states start at nonce 0), and who the peer proved to be.

    ``remote_public_key`` is the peer's identity key, which signed its Noise static key and
    which its peer id names, as go-libp2p's ``RemotePublicKey``; py-libp2p 0.8.1's session gives
    the X25519 static key there instead."""

    send_key: bytes
    recv_key: bytes
    remote_public_key: PublicKey

    @property
    def remote_peer(self) -> ID:
        return ID.from_pubkey(self.remote_public_key)

    @classmethod
    def of(cls, noise_state: Any, remote_public_key: PublicKey) -> Handshaken:
        """From the ``noise`` package's state (untyped), which must have finished the handshake."""
        if not noise_state.handshake_finished:
            raise HandshakeHasNotFinished("handshake is done but it is not marked as finished in `noise_state`")
        protocol = noise_state.noise_protocol
        return cls(bytes(protocol.cipher_state_encrypt.k), bytes(protocol.cipher_state_decrypt.k), remote_public_key)


class NoiseTransport(ISecureTransport):
    """``/noise`` for py-libp2p's upgrader: the XX handshake (:class:`_XX`), then a :class:`NoiseSession`.

    ``muxers``: the stream muxers offered inside the handshake; the one agreed on is the
    session's ``early_muxer`` (None: negotiate one with multistream). ``config``: where the
    sessions seal and open (:class:`NoiseConfig`; None: its defaults, by the machine's cores).
    """

    def __init__(self, key_pair: KeyPair, muxers: Sequence[str] = (), config: NoiseConfig | None = None) -> None:
        self._key_pair = key_pair
        self._handshake = HandshakeTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
        self._muxers = tuple(muxers)
        #: every session's sealing and opening (:class:`NoiseConfig`)
        self.crypto = CryptoPool(config or NoiseConfig())

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        pattern = _XX(self._handshake, self._muxers)
        done = await pattern.run_inbound(conn)
        return self._session(done, conn, is_initiator=False, early_muxer=pattern.agreed_muxer(initiator=False))

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID, *,
                              handshake_over: IRawConnection | None = None) -> ISecureConn:
        """``handshake_over``: what the handshake reads and writes, where it is not ``conn``
        itself (a lazy multistream proposal riding on the first message)."""
        pattern = _XX(self._handshake, self._muxers)
        done = await pattern.run_outbound(handshake_over or conn, peer_id)
        return self._session(done, conn, is_initiator=True, early_muxer=pattern.agreed_muxer(initiator=True))

    def _session(self, done: Handshaken, raw: IRawConnection, *, is_initiator: bool,
                 early_muxer: str | None) -> NoiseSession:
        """Our record layer on ``raw`` with the keys the handshake left. The handshake's reader
        reads exact lengths, so nothing past the handshake is buffered in it."""
        codec = NoiseCodec(done.send_key, done.recv_key)
        session = NoiseSession(
            raw,
            codec,
            local_peer=self._handshake.local_peer,
            local_key_pair=self._key_pair,
            remote_peer=done.remote_peer,
            is_initiator=is_initiator,
            remote_public_key=done.remote_public_key,
            crypto=self.crypto,
        )
        session.early_muxer = early_muxer
        return session
