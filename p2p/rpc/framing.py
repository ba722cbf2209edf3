"""RPC frames to bytes and back, with no I/O, so every edge case is testable alone.

A frame on the wire is an unsigned-varint length (the libp2p convention) and
then a serialized :class:`rpc_pb2.Frame`. Two things keep this fast on large
messages, which is what averaging sends:

* a message frame is built by hand (tag 2, length, payload): protobuf would
  copy the payload into the envelope only to copy it out again, and the
  receiving side has the matching shortcut in :func:`parse_frame`;
* :class:`FrameDecoder` checks a frame's declared length against the limit as
  soon as the prefix is read (even half of it), and a large body is filled into
  a buffer of exactly its size and handed out as a view, without resizing or
  copying it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from ..varint import VarintOverLimit, VarintTooLong, decode_varint, encode_varint
from . import rpc_pb2
from .errors import InvalidMessageError, MessageTooLargeError

#: Field 2 (``message``), wire type 2 (length-delimited).
MESSAGE_TAG = 0x12
#: Most bytes a message frame adds to its payload inside the length prefix: tag + varint.
FRAME_OVERHEAD = 11
#: Longest error text sent, so that an error frame always fits any sane limit.
MAX_ERROR_TEXT = 1024
#: Bodies at least this long are filled into their own buffer instead of the shared one.
_FILL_THRESHOLD = 64 * 1024
_MESSAGE_TAG_BYTE = bytes((MESSAGE_TAG,))


@dataclass(frozen=True, slots=True)
class Payload:
    """A message frame: one serialized request or response, type unknown here."""

    data: bytes | memoryview


Decoded = Payload | rpc_pb2.Call | rpc_pb2.Error | rpc_pb2.End

M = TypeVar("M", bound=ProtoMessage)


def parse_message(message_type: type[M], data: bytes | bytearray | memoryview, what: str) -> M:
    """Parse ``data`` as ``message_type``; :class:`InvalidMessageError` names ``what`` if it is not one."""
    try:
        # upb parses any buffer without copying it first; the stubs only say bytes.
        return message_type.FromString(data)  # type: ignore[arg-type]
    except DecodeError as e:
        raise InvalidMessageError(f"{what} is not a valid {message_type.__name__}: {e}") from None


def encode_frame(frame: rpc_pb2.Frame) -> bytes:
    body = frame.SerializeToString()
    return encode_varint(len(body)) + body


def encode_call(method: str, deadline_ms: int) -> bytes:
    deadline_ms = min(max(deadline_ms, 1), 0xFFFFFFFF)
    return encode_frame(rpc_pb2.Frame(call=rpc_pb2.Call(method=method, deadline_ms=deadline_ms)))


def message_header(size: int) -> bytes:
    """What goes before a payload of ``size`` bytes to make it a message frame."""
    inner = encode_varint(size)
    return encode_varint(1 + len(inner) + size) + _MESSAGE_TAG_BYTE + inner


def encode_message(payload: bytes) -> bytes:
    return message_header(len(payload)) + payload


def encode_error(code: int, message: str) -> bytes:
    if len(message) > MAX_ERROR_TEXT:
        message = message[: MAX_ERROR_TEXT - 3] + "..."
    return encode_frame(rpc_pb2.Frame(error=rpc_pb2.Error(code=code, message=message)))


END_FRAME = encode_frame(rpc_pb2.Frame(end=rpc_pb2.End()))


def parse_frame(body: bytes | bytearray | memoryview) -> Decoded:
    """Decode one frame body (without its length prefix).

    A body that holds exactly one ``message`` field is sliced, not parsed: the
    payload comes out as a view of ``body``, which must therefore not change.
    """
    if len(body) >= 2 and body[0] == MESSAGE_TAG:
        try:
            header = decode_varint(body, 1)
        except VarintTooLong:
            header = None  # not a well-formed message frame: protobuf's parse says what it is
        if header is not None and header[0] + header[1] == len(body):
            return Payload(memoryview(body)[header[1] :])
    frame = parse_message(rpc_pb2.Frame, body, "frame")
    kind = frame.WhichOneof("body")
    if kind == "message":
        return Payload(frame.message)
    if kind == "call":
        return frame.call
    if kind == "error":
        return frame.error
    if kind == "end":
        return frame.end
    raise InvalidMessageError("frame with no body")


@dataclass(slots=True)
class _Filling:
    """A large frame's body, filled in place as it arrives."""

    body: bytearray
    #: bytes of it that have arrived
    filled: int
    #: its length prefix's size (counted as buffered until the frame is out)
    prefix: int


class FrameDecoder:
    """Turns a byte stream into frames, incrementally: :meth:`feed`, then :meth:`next` until None.

    Raises :class:`MessageTooLargeError` for a length over the limit (before its
    body is buffered) and :class:`InvalidMessageError` for bytes that are not a
    frame; after either, the stream is unusable and the decoder must be dropped.
    """

    def __init__(self, max_message_size: int):
        if max_message_size <= 0:
            raise ValueError(f"max_message_size must be positive, got {max_message_size}")
        self.max_message_size = max_message_size
        self._max_frame = max_message_size + FRAME_OVERHEAD
        self._buf = bytearray()
        self._filling: _Filling | None = None

    @property
    def buffered(self) -> int:
        """Bytes received that are not yet part of a complete frame."""
        filling = self._filling
        if filling is not None:
            return len(self._buf) + filling.prefix + filling.filled
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        filling = self._filling
        if filling is not None:
            body = filling.body
            room = len(body) - filling.filled
            if len(data) <= room:
                body[filling.filled : filling.filled + len(data)] = data
                filling.filled += len(data)
                return
            view = memoryview(data)
            body[filling.filled :] = view[:room]
            filling.filled += room
            data = view[room:]
        self._buf += data

    def next(self) -> Decoded | None:
        filling = self._filling
        if filling is not None:
            if filling.filled < len(filling.body):
                return None
            self._filling = None
            return self._checked(parse_frame(filling.body))

        buf = self._buf
        end = len(buf)
        try:
            decoded = decode_varint(buf, limit=self._max_frame)
        except VarintOverLimit as e:
            raise MessageTooLargeError(
                f"frame of {'' if e.complete else 'at least '}{e.value} bytes announced, over the "
                f"limit of {self._max_frame} (max_message_size {self.max_message_size} + envelope)"
            ) from None
        except VarintTooLong:
            raise InvalidMessageError("frame length prefix longer than 10 bytes") from None
        if decoded is None:
            return None
        size, pos = decoded
        if size == 0:
            raise InvalidMessageError("empty frame")
        stop = pos + size
        if stop <= end:
            frame = buf[pos:stop]
            del buf[:stop]  # O(1) from the front of a bytearray
            return self._checked(parse_frame(frame))
        if size >= _FILL_THRESHOLD:
            body = bytearray(size)
            with memoryview(buf) as view:
                body[: end - pos] = view[pos:end]
            self._filling = _Filling(body, end - pos, pos)
            buf.clear()
        return None

    def _checked(self, decoded: Decoded) -> Decoded:
        if isinstance(decoded, Payload) and len(decoded.data) > self.max_message_size:
            raise MessageTooLargeError(
                f"message of {len(decoded.data)} bytes is over the limit of {self.max_message_size}"
            )
        return decoded
