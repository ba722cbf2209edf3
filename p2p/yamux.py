"""Yamux stream multiplexing (``/yamux/1.0.0``), fast enough for gradients.

Why our own: py-libp2p 0.8.1's muxer reads each 12-byte header and each body
with separate awaited reads, takes several locks per frame, polls for window
every 10 ms, and fails writes after a fixed 5 s. Here:

- :class:`FrameParser` turns decrypted bytes into frame callbacks with no I/O
  and no copy of payloads that arrive whole.
- One reader task per connection parses and dispatches; it never awaits a
  write. Frames it must answer with (pong, ACK, RST, window updates) go to a
  queue that a control task sends, so two peers pushing bulk data at each other
  cannot deadlock with both readers stuck writing.
- A stream write sends big frames (up to :attr:`YamuxConfig.max_frame`), each
  in one sealed write, under a connection lock, shielded from cancellation so
  that no frame is ever half-sent; a write stall past ``write_timeout`` fails
  the connection with a clear error instead.
- Receive windows start at the spec's 256 KiB and grow (doubling, as go-yamux
  does) while the reader drains them within a few round trips, up to
  ``max_stream_window`` per stream and ``max_connection_window`` for all streams
  of a connection together: memory stays bounded whatever peers send.

Wire format (hashicorp/yamux spec.md): a 12-byte header, big-endian: version
(0), type (0 data, 1 window update, 2 ping, 3 go away), flags (SYN 1, ACK 2,
FIN 4, RST 8), stream id, length; data frames carry ``length`` bytes after it.
The dialer opens odd stream ids, the listener even ones.
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import trio
from libp2p.abc import IMuxedConn, IMuxedStream, ISecureConn
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.stream_muxer.exceptions import (
    MuxedConnError,
    MuxedConnUnavailable,
    MuxedStreamClosed,
    MuxedStreamEOF,
    MuxedStreamReset,
)
from multiaddr import Multiaddr

from .errors import ConfigError, DedlocError, RemoteProtocolError
from .multistream import refusal
from .noise import NoiseSession
from .trio_util import Mutex

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "INITIAL_WINDOW",
    "PROTOCOL_ID",
    "FrameParser",
    "StreamAbortedError",
    "StreamStalledError",
    "YamuxConfig",
    "YamuxConnection",
    "YamuxError",
    "YamuxProtocolError",
    "YamuxStream",
]

log = logging.getLogger(__name__)

PROTOCOL_ID = TProtocol("/yamux/1.0.0")

HEADER = struct.Struct(">BBHII")
HEADER_SIZE = HEADER.size
TYPE_DATA, TYPE_WINDOW_UPDATE, TYPE_PING, TYPE_GO_AWAY = 0, 1, 2, 3
SYN, ACK, FIN, RST = 1, 2, 4, 8
GO_AWAY_NORMAL, GO_AWAY_PROTOCOL_ERROR, GO_AWAY_INTERNAL_ERROR = 0, 1, 2
#: A connection manager closed the connection (go-libp2p's ``network.ConnGarbageCollected``: the
#: connection error codes of libp2p/specs ride in GoAway's length field; p2p/conn_manager.py).
GO_AWAY_GARBAGE_COLLECTED = 0x1005
#: Every stream starts with this window in both directions (spec).
INITIAL_WINDOW = 256 * 1024
#: A batch of coalesced frames takes no more newcomers past this size (one seal and one write each).
COALESCE_BYTES = 4 * 1024 * 1024
MAX_WINDOW = 2**32 - 1
_MAX_STREAM_ID = 2**32 - 1
#: Bytes asked per read when the secured connection is not ours.
_READ_SIZE = 256 * 1024
#: A received piece at least this big is returned by ``read(n)`` alone rather than joined with the
#: next: the reader calls again instead of a copy of every byte (bulk data arrives in pieces of one
#: Noise message, 64 KiB; joining them into 256 KiB reads cost 30 of the 375 us of CPU per MB the
#: receive side spent, the cipher most of the rest). Small pieces are still gathered, so many small
#: frames cost one call.
WHOLE_PIECE = 16 * 1024
_GO_AWAY_REASONS = {GO_AWAY_NORMAL: "normal", GO_AWAY_PROTOCOL_ERROR: "protocol error", GO_AWAY_INTERNAL_ERROR: "internal error",
                    GO_AWAY_GARBAGE_COLLECTED: "trimmed by its connection manager"}


# ---------------------------------------------------------------------------- errors


class YamuxError(DedlocError, MuxedConnError):
    """The connection ended or failed; the message says why."""


class YamuxProtocolError(YamuxError, RemoteProtocolError):
    """The peer broke the yamux protocol; we answer with GoAway(protocol error) and close."""


class StreamAbortedError(DedlocError, MuxedStreamReset):
    """The stream ended abnormally: reset by either side, or its connection failed."""


class StreamStalledError(StreamAbortedError):
    """A write waited ``write_timeout`` for the peer to grant window: it stopped reading."""


# ---------------------------------------------------------------------------- config


@dataclass
class YamuxConfig:
    """Limits of one yamux connection. The defaults suit tensor traffic on long fat links."""

    #: Largest receive window one stream may grow to (bytes the peer may send unread).
    max_stream_window: int = 16 * 1024 * 1024
    #: Window growth beyond 256 KiB per stream, summed over a connection's streams.
    max_connection_window: int = 64 * 1024 * 1024
    #: Largest data frame we send; bigger means fewer frames, longer holds of the write lock.
    max_frame: int = 1024 * 1024
    #: A frame write (socket full) or a wait for window (peer not reading) longer than this fails.
    write_timeout: float = 30.0
    #: Ping a peer we have heard nothing from for this long...
    keepalive_interval: float = 30.0
    #: ...and close the connection when nothing comes back within this.
    keepalive_timeout: float = 15.0
    #: Inbound streams open at once; more are refused with RST.
    max_inbound_streams: int = 1024
    #: Inbound streams not yet accepted by the application; more are refused with RST.
    accept_backlog: int = 256
    #: Control frames (pongs, window updates, RSTs) queued unsent before the peer counts as flooding.
    max_pending_control: int = 4096

    def validate(self) -> None:
        if not INITIAL_WINDOW <= self.max_stream_window <= MAX_WINDOW:
            raise ConfigError(f"max_stream_window must be between {INITIAL_WINDOW} and {MAX_WINDOW}")
        if self.max_connection_window < 0:
            raise ConfigError("max_connection_window must not be negative")
        if self.max_frame < 1024:
            raise ConfigError("max_frame must be at least 1024 bytes")
        for name in ("write_timeout", "keepalive_interval", "keepalive_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        for name in ("max_inbound_streams", "accept_backlog", "max_pending_control"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")


# ---------------------------------------------------------------------------- sans-I/O framing


class MemoryBudget(Protocol):
    """Where window growth is reserved and given back (``p2p.resources.MemoryAccount``)."""

    def reserve(self, wanted: int) -> int: ...

    def release(self, amount: int) -> None: ...

    def close(self) -> None: ...


class FrameHandler(Protocol):
    def on_header(self, kind: int, flags: int, stream_id: int, length: int) -> None: ...

    def on_data(self, stream_id: int, data: bytes) -> None: ...

    def on_data_end(self, stream_id: int, flags: int) -> None: ...


class FrameParser:
    """Decrypted bytes in, frame callbacks out; no I/O.

    A data frame's body is delivered in pieces as it arrives (a piece that is a
    whole input chunk is passed on without copying); ``on_data_end`` follows
    the last piece, so flags such as FIN apply after the data they came with.
    """

    def __init__(self, handler: FrameHandler) -> None:
        self._handler = handler
        self._head = bytearray()
        #: Bytes of the current data frame's body still to come; its stream and flags (set with it).
        self._left = 0
        self._stream: int
        self._flags: int

    def feed(self, data: bytes) -> None:
        handler = self._handler
        pos, size = 0, len(data)
        while pos < size:
            if self._left:
                take = min(self._left, size - pos)
                handler.on_data(self._stream, data[pos : pos + take])  # all of it: that very object
                pos += take
                self._left -= take
                if not self._left:
                    handler.on_data_end(self._stream, self._flags)
                continue
            if self._head or size - pos < HEADER_SIZE:
                need = HEADER_SIZE - len(self._head)
                self._head += data[pos : pos + need]
                pos = min(size, pos + need)
                if len(self._head) < HEADER_SIZE:
                    return
                version, kind, flags, stream_id, length = HEADER.unpack(self._head)
                self._head = bytearray()
            else:
                version, kind, flags, stream_id, length = HEADER.unpack_from(data, pos)
                pos += HEADER_SIZE
            if version != 0:
                raise YamuxProtocolError(f"unsupported yamux version {version}")
            if kind > TYPE_GO_AWAY:
                raise YamuxProtocolError(f"unknown yamux frame type {kind}")
            handler.on_header(kind, flags, stream_id, length)
            if kind == TYPE_DATA:
                if length:
                    self._left, self._stream, self._flags = length, stream_id, flags
                else:
                    handler.on_data_end(stream_id, flags)


def frame(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    """One 12-byte yamux header."""
    return HEADER.pack(0, kind, flags, stream_id, length)


# ---------------------------------------------------------------------------- streams


class YamuxStream(IMuxedStream):
    """One yamux stream. ``read`` returns what is there (up to ``n``) and raises
    ``MuxedStreamEOF`` after the peer's FIN; ``close`` sends our FIN (reads go
    on); ``reset`` aborts both directions at once and never blocks."""

    muxed_conn: YamuxConnection

    def __init__(self, conn: YamuxConnection, stream_id: int) -> None:
        self.muxed_conn = conn
        self.stream_id = stream_id
        self._buffer: deque[bytes] = deque()
        self._buffered = 0
        self._readable = trio.Event()
        self._writable = trio.Event()
        self._write_lock = Mutex()
        #: What the peer may still send; what we let it have in flight; consumed, not yet re-granted.
        self._recv_window = INITIAL_WINDOW
        self._window_size = INITIAL_WINDOW
        self._unacked = 0
        self._send_window = INITIAL_WINDOW
        self._recv_closed = False
        self._send_closed = False
        self._error: StreamAbortedError | None = None
        #: The connection ended after the peer's FIN: what it sent stays readable, then EOF.
        self._fin_kept = False

    def __repr__(self) -> str:
        return f"<YamuxStream {self.stream_id} to {self.muxed_conn.peer_id}>"

    # ---------------------------------------------------------------- reading

    async def read(self, n: int | None = -1) -> bytes:
        if n == 0:
            return b""
        while not self._buffered:
            if self._error is not None and not self._fin_kept:
                raise self._error
            if self._recv_closed:
                raise MuxedStreamEOF(f"stream {self.stream_id}: the peer closed its side")
            if self._readable.is_set():
                self._readable = trio.Event()
            await self._readable.wait()
        # Data here means no error, or one after the peer's FIN (_abort clears the rest, on_data drops).
        buffer = self._buffer
        first = len(buffer[0])
        if n is not None and WHOLE_PIECE <= first <= n:
            data = buffer.popleft()  # a big piece as it came (one Noise message's): no copy
        elif n is None or n < 0 or n >= self._buffered:
            data = b"".join(buffer)  # one piece: that very object (bytes.join returns it)
            buffer.clear()
        else:
            pieces = []
            got = 0
            while got < n:
                piece = buffer.popleft()
                if got + len(piece) > n:
                    buffer.appendleft(piece[n - got :])
                    piece = piece[: n - got]
                pieces.append(piece)
                got += len(piece)
            data = b"".join(pieces)
        self._buffered -= len(data)
        self._consumed(len(data))
        return data

    def _consumed(self, size: int) -> None:
        """Re-grant window for bytes the application took, doubling it each time.

        Growth happens only as the application reads, so a stream nobody reads
        never grows; one that is read grows to ``max_stream_window`` within a
        few grants, bounded together with its siblings by the connection's
        budget. (go-yamux also requires the grants to come within 4 RTTs; with
        explicit bounds that only slows fast links down, measured here.)
        """
        self._unacked += size
        if self._recv_closed or self._error is not None or self._unacked < self._window_size // 2:
            return
        conn = self.muxed_conn
        delta = self._unacked
        grow = min(self._window_size, conn.config.max_stream_window - self._window_size, conn.window_budget)
        if grow and conn.memory is not None:
            grow = conn.memory.reserve(grow)  # the peer's and the node's budget (p2p/resources.py)
        conn.window_budget -= grow
        self._window_size += grow
        delta += grow
        self._unacked = 0
        self._recv_window += delta
        conn.queue_control(frame(TYPE_WINDOW_UPDATE, 0, self.stream_id, delta))

    # ---------------------------------------------------------------- writing

    async def write(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        conn = self.muxed_conn
        async with self._write_lock:
            while len(view):
                self._check_writable()
                if not self._send_window:
                    await self._wait_for_window()
                    continue
                # Frame writes are shielded; cancellation takes effect between frames.
                await trio.lowlevel.checkpoint_if_cancelled()
                take = min(len(view), self._send_window, conn.config.max_frame)
                self._send_window -= take
                try:
                    await conn.send(frame(TYPE_DATA, 0, self.stream_id, take), view[:take])
                except YamuxError as e:
                    # The stream's own error type, so py-libp2p's NetStream reports a reset.
                    raise StreamAbortedError(f"stream {self.stream_id}: {e}") from e
                view = view[take:]

    def _check_writable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._send_closed:
            raise MuxedStreamClosed(f"stream {self.stream_id} is closed for writing")

    async def _wait_for_window(self) -> None:
        timeout = self.muxed_conn.config.write_timeout
        if self._writable.is_set():
            self._writable = trio.Event()
        with trio.move_on_after(timeout):
            await self._writable.wait()
            return
        error = StreamStalledError(
            f"stream {self.stream_id} to {self.muxed_conn.peer_id}: the peer granted no window "
            f"for {timeout:g} s (it stopped reading); stream reset"
        )
        self._abort(error, send_rst=True)
        raise error

    async def close(self) -> None:
        """Half-close: send FIN. Reading goes on until the peer's FIN."""
        async with self._write_lock:
            if self._send_closed or self._error is not None:
                return
            self._send_closed = True
            try:
                await self.muxed_conn.send(frame(TYPE_WINDOW_UPDATE, FIN, self.stream_id, 0))
            except YamuxError:
                pass  # the connection is gone, and with it the stream
            self._forget_if_done()

    async def close_write(self) -> None:
        await self.close()

    async def reset(self) -> None:
        """Abort both directions; queues the RST and returns without waiting."""
        self._abort(StreamAbortedError(f"stream {self.stream_id} was reset locally"), send_rst=True)

    # ---------------------------------------------------------------- events from the reader

    def on_data(self, data: bytes) -> None:
        if self._error is not None:
            return
        self._buffer.append(data)
        self._buffered += len(data)
        self._readable.set()

    def on_window(self, delta: int) -> None:
        if self._send_window + delta > MAX_WINDOW:
            raise YamuxProtocolError(f"stream {self.stream_id}: window update overflows the 32-bit window")
        self._send_window += delta
        if delta:
            self._writable.set()

    def on_fin(self) -> None:
        self._recv_closed = True
        self._readable.set()
        self._forget_if_done()

    def on_reset(self) -> None:
        self._abort(StreamAbortedError(f"stream {self.stream_id} was reset by {self.muxed_conn.peer_id}"), send_rst=False)

    def _abort(self, error: StreamAbortedError, *, send_rst: bool, keep_received: bool = False) -> None:
        if self._error is not None or (self._send_closed and self._recv_closed):
            return
        self._error = error
        if keep_received and self._recv_closed:
            self._fin_kept = True
        else:
            self._buffer.clear()
            self._buffered = 0
        self._readable.set()
        self._writable.set()
        if send_rst:
            self.muxed_conn.queue_control(frame(TYPE_WINDOW_UPDATE, RST, self.stream_id, 0))
        self.muxed_conn.forget(self)

    def _forget_if_done(self) -> None:
        if self._send_closed and self._recv_closed:
            self.muxed_conn.forget(self)

    # ---------------------------------------------------------------- IMuxedStream odds and ends

    def set_deadline(self, ttl: int) -> None:
        raise NotImplementedError("yamux streams have no deadlines: use trio.fail_after around the call")

    def get_remote_address(self) -> tuple[str, int] | None:
        return self.muxed_conn.get_remote_address()

    async def __aenter__(self) -> YamuxStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


# ---------------------------------------------------------------------------- connections



@dataclass(eq=False)
class _Batch:
    """Frames written together by the first of their writers (:meth:`YamuxConnection.send`)."""

    parts: list[Buffer]
    size: int
    done: trio.Event = field(default_factory=trio.Event)
    error: YamuxError | None = None

class YamuxConnection(IMuxedConn):
    """A yamux session over a secured connection, run by :meth:`start` in py-libp2p's swarm."""

    on_close: Callable[[], Awaitable[None]] | None

    def __init__(self, secured_conn: ISecureConn, peer_id: ID, config: YamuxConfig | None = None,
                 memory: MemoryBudget | None = None, admit_stream: Callable[[], str | None] | None = None) -> None:
        self.secured_conn = secured_conn
        #: Asked for each stream the peer opens (the node's stream-open rate): None admits it, a
        #: reason refuses it at once (:meth:`_refuse`), before any task, negotiation or handler
        #: costs anything.
        self.admit_stream = admit_stream
        #: Asked before a receive window grows beyond its initial size (None: only the connection's budget).
        self.memory = memory
        self.peer_id = peer_id
        self.config = config or YamuxConfig()
        self._initiator = secured_conn.is_initiator
        self._next_id = 1 if self._initiator else 2
        self.streams: dict[int, YamuxStream] = {}
        self._inbound = 0
        self._accept_send, self._accept_receive = trio.open_memory_channel[YamuxStream](self.config.accept_backlog)
        self._write_lock = Mutex()
        #: frames waiting for the write under way, to go out together (see :meth:`send`)
        self._batch: _Batch | None = None
        self._control: list[bytes] = []
        self._control_ready = trio.Event()
        self._pings: dict[int, float] = {}
        self._next_ping = 1
        self._nursery: trio.Nursery | None = None
        self._error: YamuxError | None = None
        self._remote_go_away: int | None = None
        #: the GoAway code :meth:`close` sent (None: not closed by us, or not yet)
        self.local_go_away: int | None = None
        #: When the peer last sent anything (trio time; from :meth:`start` on, which sets it).
        self._last_received: float
        self.event_started = trio.Event()
        self.event_closed = trio.Event()
        self.on_close = None
        #: Smoothed round-trip time from yamux pings (seconds); a LAN guess until measured.
        self.rtt = 0.001
        #: Window growth still available to this connection's streams (bytes).
        self.window_budget = self.config.max_connection_window
        self.bytes_sent = 0
        self.bytes_received = 0

    def __repr__(self) -> str:
        return f"<YamuxConnection to {self.peer_id}, {len(self.streams)} streams>"

    # ---------------------------------------------------------------- IMuxedConn

    @property
    def is_initiator(self) -> bool:
        return self._initiator

    @property
    def is_established(self) -> bool:
        return self.event_started.is_set() and self._error is None

    @property
    def is_closed(self) -> bool:
        return self.event_closed.is_set()

    @property
    def remote_go_away(self) -> int | None:
        """The code of the peer's GoAway (None: it sent none)."""
        return self._remote_go_away

    @property
    def error(self) -> YamuxError | None:
        """Why the connection ended (None while it runs)."""
        return self._error

    def get_transport_addresses(self) -> list[Multiaddr]:
        return self.secured_conn.get_transport_addresses()

    def get_connection_type(self) -> ConnectionType:
        return self.secured_conn.get_connection_type()

    def get_remote_address(self) -> tuple[str, int] | None:
        return self.secured_conn.get_remote_address()

    async def start(self) -> None:
        """Run the connection until it closes or fails (py-libp2p runs this as a task)."""
        if self.event_started.is_set():
            return
        self._last_received = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._error is not None:
                    nursery.cancel_scope.cancel()
                nursery.start_soon(self._read_loop)
                nursery.start_soon(self._control_loop)
                nursery.start_soon(self._keepalive_loop)
                self._ping()
                self.event_started.set()
        finally:
            with trio.CancelScope(shield=True):
                await self._finish()

    async def open_stream(self) -> YamuxStream:
        if self._error is not None:
            raise MuxedConnUnavailable(f"connection to {self.peer_id} is closed: {self._error}")
        if self._remote_go_away is not None:
            raise MuxedConnUnavailable(f"{self.peer_id} is going away and accepts no new streams")
        stream_id = self._next_id
        if stream_id > _MAX_STREAM_ID:
            raise MuxedConnUnavailable(f"stream ids to {self.peer_id} exhausted: open a new connection")
        self._next_id += 2
        stream = YamuxStream(self, stream_id)
        self.streams[stream_id] = stream
        # A send that fails fails the connection, and that forgets every stream, this one too.
        await self.send(frame(TYPE_WINDOW_UPDATE, SYN, stream_id, 0))
        return stream

    async def accept_stream(self) -> YamuxStream:
        try:
            return await self._accept_receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            why = self._error or f"{self.peer_id} is going away"  # the two ways the channel closes
            raise MuxedConnUnavailable(f"connection to {self.peer_id} accepts no more streams: {why}") from None

    async def close(self, code: int = GO_AWAY_NORMAL) -> None:
        """Say GoAway with ``code`` (0, or an application's: go-libp2p's connection error codes, such
        as 0x1005 for a connection manager's trim), close the secured connection, end every stream."""
        if self.event_closed.is_set():
            return
        if self._error is None:
            self.local_go_away = code
            # Best effort within 1 s: ``send`` shields its write for write_timeout, so a
            # peer that stopped reading would hold up closing that long.
            with trio.move_on_after(1):
                async with self._write_lock:
                    if self._error is None:
                        try:
                            await self._write((frame(TYPE_GO_AWAY, 0, 0, code),))
                        except Exception:
                            pass
            self._fail(YamuxError(f"connection to {self.peer_id} closed locally"))
        if self._nursery is None:
            await self._finish()
        else:
            with trio.move_on_after(5):
                await self.event_closed.wait()

    # ---------------------------------------------------------------- writing

    async def send(self, *parts: Buffer) -> None:
        """Write one frame (header and body) whole; the connection fails rather than half-send it.

        Frames that come while another write is under way are coalesced: the first of them leads a
        batch that every later one joins, and the leader, once it holds the connection, seals and
        sends the whole batch in one write. Handing the connection from writer to writer cost a
        pass of the scheduler per frame, and a busy peer's loop takes milliseconds a pass: an
        expert client with 240 exchanges in flight spent 300-400 ms waiting to write a 50-byte
        request header (bench/moe_latency.py). Waits are shielded, as the write itself always was,
        and bounded by the writes ahead of them (each fails the connection past ``write_timeout``):
        a frame queued is sent whole, and its caller learns the outcome.
        """
        if self._error is not None:
            raise self._error
        size = sum(len(memoryview(p)) for p in parts)
        if not self._write_lock.locked:
            async with self._write_lock:  # free: taken without a task switch
                await self._send_now(parts)
            self.bytes_sent += size
            return
        batch = self._batch
        with trio.CancelScope(shield=True):
            if batch is not None and batch.size < COALESCE_BYTES:
                batch.parts.extend(parts)
                batch.size += size
                await batch.done.wait()
            else:
                batch = self._batch = _Batch(list(parts), size)
                async with self._write_lock:
                    if self._batch is batch:
                        self._batch = None  # from here on, newcomers start the next batch
                    try:
                        await self._send_now(tuple(batch.parts))
                    except YamuxError as e:
                        batch.error = e
                    finally:
                        batch.done.set()
        if batch.error is not None:
            raise batch.error
        self.bytes_sent += size

    async def _send_now(self, parts: tuple[Buffer, ...]) -> None:
        """Write ``parts`` (holding the write lock) within ``write_timeout``, or fail the connection."""
        if self._error is not None:
            raise self._error
        timeout = self.config.write_timeout
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + timeout
            try:
                await self._write(parts)
            except Exception as e:
                error = YamuxError(f"connection to {self.peer_id} broke while writing: {e!r}")
                self._fail(error)
                raise error from e
        if scope.cancelled_caught:
            error = YamuxError(f"connection to {self.peer_id} stalled: a write took over {timeout:g} s")
            self._fail(error)
            raise error

    async def _write(self, parts: tuple[Buffer, ...]) -> None:
        session = self.secured_conn
        if isinstance(session, NoiseSession):
            await session.write_parts(*parts)
        else:
            await session.write(b"".join(parts))

    def queue_control(self, data: bytes) -> None:
        """Hand a control frame to the control task: the reader must never await a write."""
        if self._error is not None:
            return
        if len(self._control) >= self.config.max_pending_control:
            self._fail(YamuxProtocolError(f"{self.peer_id} makes us queue control frames it does not read"))
            return
        self._control.append(data)
        self._control_ready.set()

    async def _control_loop(self) -> None:
        while True:
            await self._control_ready.wait()
            self._control_ready = trio.Event()
            frames, self._control = self._control, []
            try:
                await self.send(*frames)
            except YamuxError:
                return

    # ---------------------------------------------------------------- reading

    async def _read_loop(self) -> None:
        parser = FrameParser(self)
        session = self.secured_conn
        try:
            while True:
                if isinstance(session, NoiseSession):
                    pieces = await session.read_messages()
                else:
                    data = await session.read(_READ_SIZE)
                    pieces = [data] if data else []
                if not pieces:
                    raise YamuxError(f"{self.peer_id} closed the connection")
                self._last_received = trio.current_time()
                for piece in pieces:
                    self.bytes_received += len(piece)
                    parser.feed(piece)
        except YamuxError as e:
            self._fail(e)
        except Exception as e:
            self._fail(YamuxError(f"connection to {self.peer_id} broke while reading: {e}"))

    def on_header(self, kind: int, flags: int, stream_id: int, length: int) -> None:
        if kind == TYPE_DATA or kind == TYPE_WINDOW_UPDATE:
            stream = self._stream_for(flags, stream_id)
            if stream is None:
                return
            if kind == TYPE_DATA:
                if length > stream._recv_window:
                    raise YamuxProtocolError(
                        f"stream {stream_id}: {self.peer_id} sent a {length}-byte data frame "
                        f"into a window of {stream._recv_window} bytes"
                    )
                if stream._recv_closed:
                    raise YamuxProtocolError(f"stream {stream_id}: {self.peer_id} sent data after its FIN")
                stream._recv_window -= length
            else:
                stream.on_window(length)
                self._apply_flags(stream, flags)
        elif kind == TYPE_PING:
            if stream_id != 0:
                raise YamuxProtocolError(f"ping on stream {stream_id}, not the session")
            if flags & SYN:
                self.queue_control(frame(TYPE_PING, ACK, 0, length))
            elif flags & ACK:
                sent = self._pings.pop(length, None)
                if sent is not None:
                    sample = trio.current_time() - sent
                    self.rtt = sample if self.rtt == 0.001 else 0.875 * self.rtt + 0.125 * sample
        else:  # go away
            self._remote_go_away = length
            reason = _GO_AWAY_REASONS.get(length, f"code {length}")
            log.debug("%s is going away (%s)", self.peer_id, reason)
            self._accept_send.close()

    def on_data(self, stream_id: int, data: bytes) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.on_data(data)

    def on_data_end(self, stream_id: int, flags: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._apply_flags(stream, flags)

    def _apply_flags(self, stream: YamuxStream, flags: int) -> None:
        if flags & RST:
            stream.on_reset()
        elif flags & FIN:
            stream.on_fin()

    def _stream_for(self, flags: int, stream_id: int) -> YamuxStream | None:
        if not flags & SYN:
            # Frames for streams already forgotten (reset, both sides closed) are dropped.
            return self.streams.get(stream_id)
        if stream_id == 0 or (stream_id % 2 == 1) == self._initiator:
            raise YamuxProtocolError(f"{self.peer_id} opened stream {stream_id}, an id that is ours to use")
        if stream_id in self.streams:
            raise YamuxProtocolError(f"{self.peer_id} opened stream {stream_id} twice")
        if self._inbound >= self.config.max_inbound_streams:
            self._refuse(stream_id, f"over the limit of {self.config.max_inbound_streams} inbound streams "
                                    "per connection")
            return None
        if self.admit_stream is not None and (reason := self.admit_stream()) is not None:
            self._refuse(stream_id, reason)
            return None
        stream = YamuxStream(self, stream_id)
        try:
            self._accept_send.send_nowait(stream)
        except trio.WouldBlock:
            self._refuse(stream_id, f"over the limit of {self.config.accept_backlog} streams not yet accepted")
            return None
        except trio.ClosedResourceError:
            self.queue_control(frame(TYPE_WINDOW_UPDATE, RST, stream_id, 0))
            return None
        self.streams[stream_id] = stream
        self._inbound += 1
        self.queue_control(frame(TYPE_WINDOW_UPDATE, ACK, stream_id, 0))
        return stream

    def _refuse(self, stream_id: int, reason: str) -> None:
        """Refuse a stream the peer opened, and say why: where the protocol's echo would be,
        multistream's refusal (:func:`p2p.multistream.refusal`) with FIN, and no RST (a
        reset would discard the reason unread). No stream is kept; what the peer sends on
        it is dropped. A dedloc opener reads the reason as the answer to its proposal and
        resets; any other reads an unexpected answer."""
        message = refusal(reason)
        self.queue_control(frame(TYPE_DATA, ACK | FIN, stream_id, len(message)) + message)

    def forget(self, stream: YamuxStream) -> None:
        """Drop a finished stream from the table and return its window growth to the budget
        (a second call finds nothing more to drop or return)."""
        if self.streams.get(stream.stream_id) is stream:
            del self.streams[stream.stream_id]
            if (stream.stream_id % 2 == 1) != self._initiator:
                self._inbound -= 1
        self.window_budget += stream._window_size - INITIAL_WINDOW
        if self.memory is not None:
            self.memory.release(stream._window_size - INITIAL_WINDOW)
        stream._window_size = INITIAL_WINDOW

    # ---------------------------------------------------------------- liveness

    def _ping(self) -> None:
        opaque = self._next_ping
        self._next_ping = (opaque + 1) & MAX_WINDOW
        self._pings[opaque] = trio.current_time()
        self.queue_control(frame(TYPE_PING, SYN, 0, opaque))

    async def _keepalive_loop(self) -> None:
        interval, timeout = self.config.keepalive_interval, self.config.keepalive_timeout
        while True:
            await trio.sleep(interval)
            if trio.current_time() - self._last_received < interval:
                continue
            asked = trio.current_time()
            self._pings.clear()
            self._ping()
            await trio.sleep(timeout)
            if self._last_received < asked:
                self._fail(YamuxError(f"{self.peer_id} did not answer a keepalive ping within {timeout:g} s"))
                return

    # ---------------------------------------------------------------- ending

    def _fail(self, error: YamuxError) -> None:
        """End the connection for ``error``: every stream fails with it, tasks stop.

        Data of a stream the peer had already finished (FIN) stays readable, then EOF.
        """
        if self._error is not None:
            return
        self._error = error
        aborted = StreamAbortedError(f"connection ended: {error}")
        for stream in list(self.streams.values()):
            stream._abort(aborted, send_rst=False, keep_received=True)
        if self.memory is not None:
            self.memory.close()  # whatever the streams still held: nothing more arrives
        self._accept_send.close()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _finish(self) -> None:
        if self.event_closed.is_set():
            return
        if self._error is None:
            self._fail(YamuxError(f"connection to {self.peer_id} ended"))
        if isinstance(self._error, YamuxProtocolError):
            log.info("closing connection to %s: %s", self.peer_id, self._error)
            with trio.move_on_after(1):
                async with self._write_lock:
                    try:
                        await self._write((frame(TYPE_GO_AWAY, 0, 0, GO_AWAY_PROTOCOL_ERROR),))
                    except Exception:
                        pass
        try:
            await self.secured_conn.close()
        except Exception:
            pass
        self.event_closed.set()
        if self.on_close is not None:
            try:
                await self.on_close()
            except Exception:
                log.debug("on_close hook for %s failed", self.peer_id, exc_info=True)
