"""Framing of the all-reduce data streams: ``uvarint(len) protobuf`` headers, then raw payloads.

A reader buffers what the stream returns and hands out exact byte counts; it
never reads more than a frame asks for past what the stream already gave.
Header lengths are checked before the header is read. A stream reset (or its
connection ended) under a read is :class:`p2p.errors.StreamBrokenError`, an
``OSError`` like every other broken transport, not py-libp2p's bare
``StreamReset``, which is neither an OSError nor a DedlocError.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import trio
from google.protobuf.message import DecodeError, Message
from libp2p.network.stream.exceptions import StreamError

from p2p.errors import StreamBrokenError, describe
from p2p.varint import VarintTooLong, decode_varint, encode_varint

from .errors import AllreduceProtocolError

M = TypeVar("M", bound=Message)

READ_SIZE = 1 << 20
MAX_HEADER = 4096
MID_FRAME = "the peer closed the stream mid-frame"


class ByteStream(Protocol):
    async def read(self, n: int) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


class TruncatedStreamError(AllreduceProtocolError, EOFError):
    """The stream ended in the middle of a frame."""


class FrameReader:
    def __init__(self, stream: ByteStream) -> None:
        self.stream = stream
        self._buf = bytearray()
        self.bytes_read = 0
        self._watch: tuple[trio.CancelScope, float] | None = None

    def watch(self, scope: trio.CancelScope, patience: float) -> None:
        """Push ``scope``'s deadline ``patience`` s past every read that brings bytes.

        A stall is a peer that sends nothing, not one that sends slowly: with
        15 senders sharing a 20 Mbit link, a 512 KiB chunk can take longer than
        the stall timeout while its bytes keep coming.
        """
        self._watch = (scope, patience)

    async def _next(self, n: int) -> bytes:
        """The stream's next bytes, at most ``n`` and :data:`READ_SIZE` (``b""`` at its end), counted,
        and pushing the watchdog if they are any."""
        try:
            data = await self.stream.read(min(n, READ_SIZE))
        except EOFError:
            return b""
        except StreamError as e:  # py-libp2p's StreamReset and kin; its StreamEOF is an EOFError, above
            raise StreamBrokenError(f"the stream broke after {self.bytes_read} bytes: {describe(e)}") from e
        if data:
            self.bytes_read += len(data)
            if self._watch is not None:
                scope, patience = self._watch
                scope.deadline = trio.current_time() + patience
        return data

    async def _more(self) -> None:
        data = await self._next(READ_SIZE)
        if not data:
            raise TruncatedStreamError(MID_FRAME)
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes read from the stream and not consumed yet."""
        return len(self._buf)

    async def at_eof(self) -> bool:
        """True if the stream ended cleanly here (between frames)."""
        if self._buf:
            return False
        try:
            await self._more()
        except TruncatedStreamError:
            return True
        return False

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes: what is buffered first, then the stream's (``b""`` at its end). A reader
        is itself a stream, so a raw message after a frame (a tensor message) reads from it, and
        nothing the frame's read brought in past the frame is lost."""
        if self._buf:
            out = bytes(self._buf[:n])
            del self._buf[: len(out)]
            return out
        return await self._next(n)

    async def readinto(self, view: memoryview) -> None:
        """Fill ``view`` exactly: what is buffered first, then straight from the stream's reads.

        A chunk's payload goes from the bytes the muxer returns into the
        caller's buffer in one copy (:meth:`exactly` would copy it twice more).
        """
        filled = min(len(self._buf), len(view))
        if filled:
            view[:filled] = self._buf[:filled]
            del self._buf[:filled]
        while filled < len(view):
            want = len(view) - filled
            data = await self._next(want)
            if not data:
                raise TruncatedStreamError(MID_FRAME)
            self._buf += data[want:]  # a stream that returned more than asked: keep the rest
            data = data[:want]
            view[filled:filled + len(data)] = data
            filled += len(data)

    async def exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            await self._more()
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def message(self, kind: type[M], what: str, *, max_size: int = MAX_HEADER) -> M:
        while True:
            try:
                decoded = decode_varint(self._buf)
            except VarintTooLong:
                raise AllreduceProtocolError(f"{what}: malformed length prefix") from None
            if decoded is not None:
                break
            await self._more()
        length, pos = decoded
        if length > max_size:
            raise AllreduceProtocolError(f"{what} of {length} bytes, more than {max_size}")
        del self._buf[:pos]
        raw = await self.exactly(length)
        msg = kind()
        try:
            msg.ParseFromString(raw)
        except DecodeError as e:
            raise AllreduceProtocolError(f"{what} does not parse: {e}") from e
        return msg


def frame(header: Message) -> bytes:
    raw = header.SerializeToString()
    return encode_varint(len(raw)) + raw
