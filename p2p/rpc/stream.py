"""The I/O edge: RPC frames over one byte stream, its failures turned into RpcErrors.

Everything above this module sees frames and :mod:`p2p.rpc.errors` only;
everything below is a py-libp2p stream (or, in tests, a trio memory stream),
which can fail with libp2p's, the socket's or trio's exceptions.
"""

from __future__ import annotations

from typing import Protocol

import trio
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from ..errors import cause_of
from ..multistream import PeerRefused
from .errors import PeerDisconnectedError, ResourceLimitError
from .framing import Decoded, FrameDecoder

#: Bytes asked for per read; a muxer returns what it has, up to this.
READ_SIZE = 1 << 20
#: Below this, parts of one write are joined (one muxer frame); above, written one by one (no copy).
JOIN_LIMIT = 64 * 1024
#: Time allowed for the goodbyes of a call (error frame, FIN, RST), even after its deadline.
CLEANUP_TIMEOUT = 2.0

#: What a broken stream raises: py-libp2p's errors, the socket's, trio's.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    BaseLibp2pError,
    OSError,
    EOFError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)
#: What a read may raise for a stream the peer refused or that broke (PeerRefused comes unwrapped now).
_READ_ERRORS: tuple[type[BaseException], ...] = (PeerRefused, *TRANSPORT_ERRORS)


def _refusal(error: BaseException) -> PeerRefused | None:
    """The peer's refusal of the stream (over one of its limits) behind a read's error, if any."""
    return cause_of(error, PeerRefused, 4)


class RpcStream(Protocol):
    """The part of py-libp2p's ``INetStream`` the RPC layer uses.

    ``read`` returns what is available (at most ``n`` bytes) and signals the
    end of the stream by raising ``EOFError`` (libp2p) or returning ``b""``
    (trio); ``close`` ends our direction only, ``reset`` aborts both.
    """

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


class FramedStream:
    """A stream carrying calls, one at a time: whole frames in and out, and its end.

    Writes hold a lock so that frames of concurrent writers never interleave;
    reads are never concurrent (one reader at a time, by construction). A read
    or write cut short by cancellation may have lost or half-sent bytes (yamux
    drops data a cancelled read already took), so it marks the stream
    :attr:`desynced`: fine to end, not to reuse.
    """

    def __init__(self, stream: RpcStream, peer_id: ID, max_message_size: int):
        self.stream = stream
        self.peer_id = peer_id
        self._decoder = FrameDecoder(max_message_size)
        self._write_lock = trio.Lock()
        #: Set when the transport failed under us: the peer is gone, stop talking.
        self.broken: PeerDisconnectedError | None = None
        #: An I/O operation was cancelled halfway: the frame boundaries are lost.
        self.desynced = False
        #: Closed or reset: nothing more will be done with the stream.
        self.done = False

    @property
    def reusable(self) -> bool:
        """Still open and in step with the peer, with nothing unread: ready for another call."""
        return not (self.done or self.desynced or self.broken) and self._decoder.buffered == 0

    async def read_frame(self) -> Decoded | None:
        """The next frame; None when the peer ended its side cleanly between frames."""
        decoder = self._decoder
        while True:
            frame = decoder.next()
            if frame is not None:
                return frame
            data = await self._read()
            if not data:
                if decoder.buffered:
                    raise self._broke(f"{self.peer_id} closed the stream in the middle of a frame")
                return None
            decoder.feed(data)

    async def fill(self) -> bool:
        """Read once into the frame buffer, consuming no frame; False at the peer's end of stream."""
        data = await self._read()
        if data:
            self._decoder.feed(data)
        return bool(data)

    async def _read(self) -> bytes:
        try:
            return await self.stream.read(READ_SIZE)
        except EOFError:
            return b""
        except _READ_ERRORS as e:
            refused = _refusal(e)
            if refused is not None:  # the peer is there; this stream was one too many for it
                self.done = True
                raise ResourceLimitError(str(refused), peer_id=self.peer_id) from e
            raise self._broke(f"stream to {self.peer_id} broke while reading: {e!r}") from e
        except trio.Cancelled:
            self.desynced = True
            raise

    async def write(self, *parts: bytes) -> None:
        """Write ``parts`` back to back, as one write when they are small."""
        async with self._write_lock:
            try:
                if len(parts) == 1:
                    await self.stream.write(parts[0])
                elif sum(map(len, parts)) <= JOIN_LIMIT:
                    await self.stream.write(b"".join(parts))
                else:
                    for part in parts:
                        await self.stream.write(part)
            except TRANSPORT_ERRORS as e:
                raise self._broke(f"stream to {self.peer_id} broke while writing: {e!r}") from e
            except trio.Cancelled:
                self.desynced = True
                raise

    async def drain(self, deadline: float) -> bool:
        """Read and drop whatever the peer still sends; True once it ended its side.

        A server that stops reading early (an error, an oversized request) drains
        instead, so that a client blocked writing a large request gets to finish
        the write and read the error, rather than stall on flow control.
        """
        self.desynced = True
        with trio.move_on_at(deadline):
            while True:
                try:
                    data = await self.stream.read(READ_SIZE)
                except EOFError:
                    return True
                except TRANSPORT_ERRORS:
                    return False
                if not data:
                    return True
        return False

    async def close(self) -> None:
        """End our direction after a call that went well; the caller aborts if this fails."""
        if self.done:
            return
        with trio.move_on_after(CLEANUP_TIMEOUT):
            try:
                await self.stream.close()
            except TRANSPORT_ERRORS:
                return
            self.done = True

    async def abort(self, *, after_close: bool = False) -> None:
        """Reset the stream, unless it was closed (or ``after_close``); works even while cancelled."""
        if self.done and not after_close:
            return
        self.done = True
        with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT):
            try:
                await self.stream.reset()
            except TRANSPORT_ERRORS:
                pass

    def _broke(self, message: str) -> PeerDisconnectedError:
        error = PeerDisconnectedError(message)
        if self.broken is None:
            self.broken = error
        return error
