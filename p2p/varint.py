"""Unsigned varints (LEB128, as protobuf and every libp2p length prefix use them): the one encoder,
the one decoder of a buffer, and the one reader of a length prefix that arrives a byte at a time.

Sans I/O. Every reader of a length-prefixed stream in the project (RPC frames, protobuf messages on
a stream, tensor headers, multistream-select, the all-reduce streams) uses these, so the edge cases
are decided once: a prefix longer than its maximum is an error, and a declared length over the
reader's limit is refused as soon as the prefix passes it (even half of it: a peer announcing 1 GiB
is refused before it sends the rest), with the value seen so far.
"""

from __future__ import annotations

from .errors import RemoteProtocolError

#: The longest varint of a 64-bit value.
MAX_BYTES = 10
_SMALL = [bytes((i,)) for i in range(0x80)]


class VarintError(RemoteProtocolError):
    """A peer's varint is malformed or over its reader's limit."""


class VarintTooLong(VarintError):
    """More bytes than the reader allows without the varint ending."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        super().__init__(f"varint longer than {max_bytes} bytes")


class VarintOverLimit(VarintError):
    """The value passed the reader's limit: :attr:`value` is it, or (``complete`` False) a lower bound."""

    def __init__(self, value: int, limit: int, complete: bool) -> None:
        self.value, self.limit, self.complete = value, limit, complete
        super().__init__(f"{'' if complete else 'at least '}{value}, over the limit of {limit}")


def encode_varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"varints are unsigned, got {value}")
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(data: bytes | bytearray | memoryview, pos: int = 0, *, limit: int | None = None,
                  max_bytes: int = MAX_BYTES) -> tuple[int, int] | None:
    """The value at ``pos`` and the position after it; None when ``data`` ends inside the varint;
    :class:`VarintOverLimit` over ``limit`` (as soon as the bytes there pass it), :class:`VarintTooLong`
    past ``max_bytes``."""
    end = len(data)
    if pos < end and data[pos] < 0x80:  # one byte, most varints: no reader needed
        first = data[pos]
        if limit is not None and first > limit:
            raise VarintOverLimit(first, limit, complete=True)
        return first, pos + 1
    reader = LengthPrefix(limit, max_bytes)
    while pos < end:
        value = reader.feed(data[pos])
        pos += 1
        if value is not None:
            return value, pos
    return None


class LengthPrefix:
    """One varint read a byte at a time (:meth:`feed`), checked as it comes: over ``limit`` raises
    :class:`VarintOverLimit` at once, past ``max_bytes`` :class:`VarintTooLong`."""

    __slots__ = ("limit", "max_bytes", "_value", "_shift", "_count")

    def __init__(self, limit: int | None = None, max_bytes: int = MAX_BYTES) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self._value = 0
        self._shift = 0
        self._count = 0

    def feed(self, byte: int) -> int | None:
        """The value once ``byte`` ended it, else None (more bytes wanted)."""
        more = byte & 0x80
        self._value |= (byte & 0x7F) << self._shift
        self._count += 1
        if self.limit is not None and self._value > self.limit:
            raise VarintOverLimit(self._value, self.limit, complete=not more)
        if not more:
            return self._value
        if self._count >= self.max_bytes:
            raise VarintTooLong(self.max_bytes)
        self._shift += 7
        return None

    @property
    def started(self) -> bool:
        """Whether any byte of it came (a stream that ends before one ended between messages)."""
        return self._count > 0


__all__ = ["MAX_BYTES", "LengthPrefix", "VarintError", "VarintOverLimit", "VarintTooLong", "decode_varint",
           "encode_varint"]
