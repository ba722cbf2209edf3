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
brought. :class:`NoiseSession` is the I/O edge, an ``ISecureConn`` for
py-libp2p's upgrader.

Wire format (libp2p noise spec, transport phase): each message is a 2-byte
big-endian length, then ChaCha20-Poly1305 ciphertext and its 16-byte tag, at
most 65535 bytes in all; the nonce is the message counter, 64-bit
little-endian after 4 zero bytes; there is no associated data.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
from libp2p.security.noise.io import NoiseHandshakeReadWriter, NoiseTransportReadWriter
from libp2p.security.noise.messages import NoiseExtensions, NoiseHandshakePayload, verify_handshake_payload_sig
from libp2p.security.noise.patterns import PatternXX
from libp2p.security.noise.transport import PROTOCOL_ID
from libp2p.security.noise.transport import Transport as HandshakeTransport
from libp2p.security.secure_session import SecureSession
from multiaddr import Multiaddr

from .errors import RemoteProtocolError
from .trio_util import Mutex

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "MAX_MESSAGE",
    "MAX_PLAINTEXT",
    "PROTOCOL_ID",
    "NoiseCodec",
    "NoiseError",
    "NoiseSession",
    "NoiseTransport",
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
#: stream muxers read from a peer's handshake payload, at most
MAX_MUXERS = 16

_LENGTH = struct.Struct(">H")
_NONCE = struct.Struct("<4xQ")
#: The spec reserves nonce 2^64-1; a connection must end before reaching it.
_NONCE_LIMIT = 2**64 - 1


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
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(len(v) for v in views)
        if total == 0:
            return bytearray()
        plains = list(_cut(views, MAX_PLAINTEXT))
        count = len(plains)
        # Nonces send_nonce .. send_nonce + count - 1 must all stay below the reserved 2^64-1.
        if self._send_nonce + count > _NONCE_LIMIT:
            raise NoiseError("Noise send nonce exhausted: the connection must be re-established")
        out = bytearray(total + count * (_LENGTH.size + TAG_SIZE))
        window = memoryview(out)
        pos = 0
        nonce = self._send_nonce
        seal = self._send.encrypt_into
        for plain in plains:
            sealed = len(plain) + TAG_SIZE
            _LENGTH.pack_into(out, pos, sealed)
            seal(_NONCE.pack(nonce), plain, None, window[pos + 2 : pos + 2 + sealed])
            nonce += 1
            pos += 2 + sealed
        self._send_nonce = nonce
        return out

    def feed(self, data: Buffer) -> list[bytes]:
        """Take bytes from the wire; return the plaintext of every message they complete."""
        if self._failed is not None:
            raise self._failed
        out: list[bytes] = []
        view = memoryview(data).cast("B")
        partial = self._partial
        if partial:
            # Finish the message the previous read cut, copying only its own bytes.
            if len(partial) < 2:
                need = 2 - len(partial)
                partial += view[:need]
                view = view[need:]
                if len(partial) < 2:
                    return out
            end = 2 + _LENGTH.unpack_from(partial)[0]
            need = end - len(partial)
            partial += view[:need]
            view = view[need:]
            if len(partial) < end:
                return out
            self._partial = bytearray()
            plain = self._open(memoryview(partial)[2:end])
            if plain:
                out.append(plain)
        pos, size = 0, len(view)
        while size - pos >= 2:
            end = pos + 2 + ((view[pos] << 8) | view[pos + 1])
            if end > size:
                break
            plain = self._open(view[pos + 2 : end])
            if plain:
                out.append(plain)
            pos = end
        if pos < size:
            self._partial = bytearray(view[pos:])
        return out

    def _open(self, message: memoryview) -> bytes:
        if len(message) < TAG_SIZE:
            raise self._fail(f"Noise message of {len(message)} bytes is shorter than its {TAG_SIZE}-byte tag")
        nonce = self._recv_nonce
        if nonce >= _NONCE_LIMIT:
            raise self._fail("Noise receive nonce exhausted")
        try:
            plain = self._recv.decrypt(_NONCE.pack(nonce), message, None)
        except InvalidTag:
            raise self._fail(
                f"Noise message #{nonce} failed authentication: garbled or forged ciphertext"
            ) from None
        self._recv_nonce = nonce + 1
        return plain

    def _fail(self, why: str) -> NoiseError:
        self._failed = NoiseError(why)
        self._partial = bytearray()
        return self._failed


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
        rest: list[bytes] = []
        for i, piece in enumerate(pieces):
            view = piece
            while view and not preface.done:
                wanted = preface.wanted
                self._partial += view[:wanted]
                view = view[wanted:]
                if len(self._partial) == wanted:
                    chunk, self._partial = bytes(self._partial), bytearray()
                    try:
                        preface.feed(chunk)
                    except Exception as e:
                        self._broken = e
                        raise
            if preface.done:
                self._preface = None
                rest = ([view] if view else []) + pieces[i + 1:]
                break
        return rest

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
            try:
                pieces = self._codec.feed(data)
            except NoiseError as e:
                self._broken = e
                raise
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
            sealed = self._codec.encrypt(*parts)
            if not sealed:
                return
            with self._breaks_on_failure():
                if self._socket is not None:
                    await self._socket.send_all(memoryview(sealed))
                else:
                    await self.raw.write(cast(bytes, sealed))

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

    The two handshake methods are py-libp2p 0.8.1's, less its debug logging, plus
    keeping the peer's payload: its methods drop it.
    """

    def __init__(self, transport: HandshakeTransport, muxers: Sequence[str]) -> None:
        super().__init__(transport.local_peer, transport.libp2p_privkey, transport.noise_privkey)
        self.muxers = list(muxers)
        self.peer_muxers: list[str] = []

    def make_handshake_payload(self, extensions: NoiseExtensions | None = None) -> NoiseHandshakePayload:
        return super().make_handshake_payload(NoiseExtensions(stream_muxers=self.muxers) if self.muxers else None)

    def agreed_muxer(self, initiator: bool) -> str | None:
        """The muxer both sides listed, the initiator's preference first; None: negotiate it."""
        first, second = (self.muxers, self.peer_muxers) if initiator else (self.peer_muxers, self.muxers)
        return next((m for m in first if m in second), None)

    def _take_payload(self, msg: bytes, handshake_state: Any) -> tuple[NoiseHandshakePayload, PublicKey]:
        """The peer's payload, verified; its muxers kept. (``handshake_state``: the untyped
        ``noise`` package's, taken before the handshake ends: the last message removes it.)"""
        payload = NoiseHandshakePayload.deserialize(msg)
        if handshake_state is None or handshake_state.rs is None:
            raise NoiseStateError("the peer's static key is missing after its payload")
        remote_pubkey = self._get_pubkey_from_noise_keypair(handshake_state.rs)
        if not verify_handshake_payload_sig(payload, remote_pubkey):
            raise InvalidSignature
        if payload.extensions is not None:
            self.peer_muxers = [str(m) for m in payload.extensions.stream_muxers][:MAX_MUXERS]
        return payload, remote_pubkey

    async def handshake_inbound(self, conn: IRawConnection) -> ISecureConn:
        noise_state = self.create_noise_state(prologue=self.prologue)
        noise_state.set_as_responder()
        noise_state.start_handshake()
        handshake_state = noise_state.noise_protocol.handshake_state
        read_writer = NoiseHandshakeReadWriter(conn, noise_state)
        await read_writer.read_msg()  # msg 1
        await read_writer.write_msg(self.make_handshake_payload().serialize())  # msg 2
        payload, remote_pubkey = self._take_payload(await read_writer.read_msg(), handshake_state)  # msg 3
        if not noise_state.handshake_finished:
            raise HandshakeHasNotFinished("handshake is done but it is not marked as finished in `noise_state`")
        return SecureSession(local_peer=self.local_peer, local_private_key=self.libp2p_privkey,
                             remote_peer=ID.from_pubkey(payload.id_pubkey), remote_permanent_pubkey=remote_pubkey,
                             is_initiator=False, conn=NoiseTransportReadWriter(conn, noise_state))

    async def handshake_outbound(self, conn: IRawConnection, remote_peer: ID | None) -> ISecureConn:
        noise_state = self.create_noise_state(prologue=self.prologue)
        read_writer = NoiseHandshakeReadWriter(conn, noise_state)
        noise_state.set_as_initiator()
        noise_state.start_handshake()
        handshake_state = noise_state.noise_protocol.handshake_state
        await read_writer.write_msg(b"")  # msg 1
        payload, remote_pubkey = self._take_payload(await read_writer.read_msg(), handshake_state)  # msg 2
        remote = ID.from_pubkey(payload.id_pubkey)
        if remote_peer is not None and remote != remote_peer:
            raise PeerIDMismatchesPubkey(f"peer id does not correspond to the received pubkey: "
                                         f"remote_peer={remote_peer}, remote_peer_id_from_pubkey={remote}")
        await read_writer.write_msg(self.make_handshake_payload().serialize())  # msg 3
        if not noise_state.handshake_finished:
            raise HandshakeHasNotFinished("handshake is done but it is not marked as finished in `noise_state`")
        return SecureSession(local_peer=self.local_peer, local_private_key=self.libp2p_privkey, remote_peer=remote,
                             remote_permanent_pubkey=remote_pubkey, is_initiator=True,
                             conn=NoiseTransportReadWriter(conn, noise_state))


class NoiseTransport(ISecureTransport):
    """``/noise`` for py-libp2p's upgrader: the XX handshake (:class:`_XX`), then a :class:`NoiseSession`.

    ``muxers``: the stream muxers offered inside the handshake; the one agreed on is the
    session's ``early_muxer`` (None: negotiate one with multistream).
    """

    def __init__(self, key_pair: KeyPair, muxers: Sequence[str] = ()) -> None:
        self._key_pair = key_pair
        self._handshake = HandshakeTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
        self._muxers = tuple(muxers)

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        pattern = _XX(self._handshake, self._muxers)
        return self._take_over(await pattern.handshake_inbound(conn), conn, pattern.agreed_muxer(False))

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID, *,
                              handshake_over: IRawConnection | None = None) -> ISecureConn:
        """``handshake_over``: what the handshake reads and writes, where it is not ``conn``
        itself (a lazy multistream proposal riding on the first message)."""
        pattern = _XX(self._handshake, self._muxers)
        handshaken = await pattern.handshake_outbound(handshake_over or conn, peer_id)
        return self._take_over(handshaken, conn, pattern.agreed_muxer(True))

    def _take_over(self, handshaken: ISecureConn, raw: IRawConnection, early_muxer: str | None) -> NoiseSession:
        """Move the transport keys out of py-libp2p's session into ours.

        Its reader reads exact lengths, so nothing past the handshake is
        buffered in it; the cipher states hold the keys and the next nonces.
        """
        state = handshaken.conn.noise_state.noise_protocol  # type: ignore[attr-defined]
        send, recv = state.cipher_state_encrypt, state.cipher_state_decrypt
        codec = NoiseCodec(bytes(send.k), bytes(recv.k), send_nonce=send.n, recv_nonce=recv.n)
        session = NoiseSession(
            raw,
            codec,
            local_peer=handshaken.get_local_peer(),
            local_key_pair=self._key_pair,
            remote_peer=handshaken.get_remote_peer(),
            is_initiator=handshaken.is_initiator,
            remote_public_key=handshaken.get_remote_public_key(),
        )
        session.early_muxer = early_muxer
        return session
