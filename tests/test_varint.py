"""p2p/varint.py, the one varint encoder and decoder every length-prefixed reader uses (RPC frames,
protobuf messages on a stream, tensor headers, multistream-select, the all-reduce streams): bytes in,
values or errors out, no streams."""

from __future__ import annotations

import pytest

from p2p.errors import RemoteProtocolError
from p2p.rpc import rpc_pb2
from p2p.varint import MAX_BYTES, LengthPrefix, VarintError, VarintOverLimit, VarintTooLong, decode_varint, encode_varint


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, 2**31, 2**63, 2**64 - 1])
def test_varint_round_trip(value: int) -> None:
    encoded = encode_varint(value)
    assert decode_varint(encoded) == (value, len(encoded))
    # The same bytes protobuf would write for a uint64 field.
    field = rpc_pb2.Call(deadline_ms=value % 2**32).SerializeToString()
    if value < 2**32 and value:
        assert field == b"\x10" + encoded


@pytest.mark.parametrize(("value", "encoded"), [
    (0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"), (300, b"\xac\x02"),
    (16383, b"\xff\x7f"), (16384, b"\x80\x80\x01"), (2**64 - 1, b"\xff" * 9 + b"\x01"),
])
def test_encode_writes_seven_bits_a_byte_low_first(value: int, encoded: bytes) -> None:
    assert encode_varint(value) == encoded
    assert type(encode_varint(value)) is bytes


def test_varint_rejects_negative_and_overlong() -> None:
    with pytest.raises(ValueError, match="^varints are unsigned, got -1$"):
        encode_varint(-1)
    assert decode_varint(b"\x80\x80") is None  # truncated: wait for more
    assert decode_varint(b"") is None
    with pytest.raises(VarintTooLong, match="^varint longer than 10 bytes$") as info:
        decode_varint(b"\xff" * 11)
    assert info.value.max_bytes == MAX_BYTES == 10
    assert decode_varint(b"\xff" * 9 + b"\x01") == ((1 << 64) - 1, 10)  # the longest there is: 10 bytes
    assert decode_varint(b"\x00\xac\x02", 1) == (300, 3)


def test_decode_reads_from_pos_and_stops_at_the_varints_end() -> None:
    data = b"\x05\xac\x02\x07\x80"
    assert decode_varint(data) == (5, 1)
    assert decode_varint(data, 1) == (300, 3)
    assert decode_varint(data, 3) == (7, 4)
    assert decode_varint(data, 4) is None  # a varint begun, not ended
    assert decode_varint(data, 5) is None  # nothing there yet
    assert decode_varint(memoryview(data), 1) == (300, 3)
    assert decode_varint(bytearray(data), 3) == (7, 4)


def test_decode_applies_its_limit_to_one_byte_varints_too() -> None:
    """The one-byte fast path checks the limit as the reader would."""
    assert decode_varint(b"\x05", limit=5) == (5, 1)
    with pytest.raises(VarintOverLimit, match="^6, over the limit of 5$") as info:
        decode_varint(b"\x06", limit=5)
    assert info.value.complete and info.value.value == 6 and info.value.limit == 5
    assert decode_varint(b"\xac\x02", limit=300) == (300, 2)
    with pytest.raises(VarintOverLimit, match="^301, over the limit of 300$"):
        decode_varint(b"\xad\x02", limit=300)
    with pytest.raises(VarintOverLimit, match="^at least 1001, over the limit of 1000$"):
        decode_varint(b"\xe9\x87", limit=1000)  # 1001 and the prefix goes on: refused before its end


def test_decode_honours_a_shorter_max_bytes() -> None:
    assert decode_varint(b"\x80\x01", max_bytes=2) == (128, 2)
    with pytest.raises(VarintTooLong, match="^varint longer than 2 bytes$"):
        decode_varint(b"\x80\x80\x01", max_bytes=2)
    assert decode_varint(b"\x80\x80\x01", max_bytes=3) == (16384, 3)


def test_a_length_prefix_is_refused_as_soon_as_it_passes_the_limit() -> None:
    """The byte-at-a-time reader: a peer announcing 1 GiB is refused at its first byte over the limit,
    the value seen so far named (a lower bound while the prefix goes on)."""
    prefix = LengthPrefix(1000)
    assert not prefix.started
    assert prefix.feed(0xE8) is None and prefix.started  # 0x68 so far, more to come
    assert prefix.feed(0x07) == 1000  # exactly the limit is allowed
    with pytest.raises(VarintOverLimit, match="^at least 1001, over the limit of 1000$") as info:
        big = LengthPrefix(1000)
        big.feed(0x80 | (1001 & 0x7F))
        big.feed(0x80 | (1001 >> 7))  # 1001 and more to come
    assert info.value.value == 1001 and not info.value.complete
    with pytest.raises(VarintOverLimit, match="^1001, over the limit of 1000$"):
        done = LengthPrefix(1000)
        done.feed(0x80 | (1001 & 0x7F))
        done.feed(1001 >> 7)
    short = LengthPrefix(max_bytes=2)
    assert short.feed(0x80) is None
    with pytest.raises(VarintTooLong, match="^varint longer than 2 bytes$"):
        short.feed(0x80)


def test_a_length_prefix_without_a_limit_takes_ten_bytes_and_no_more() -> None:
    prefix = LengthPrefix()
    assert (prefix.limit, prefix.max_bytes) == (None, MAX_BYTES)
    for _ in range(9):
        assert prefix.feed(0xFF) is None
    assert prefix.feed(0x01) == 2**64 - 1
    endless = LengthPrefix()
    for _ in range(9):
        endless.feed(0x80)
    with pytest.raises(VarintTooLong):
        endless.feed(0x80)


def test_a_length_prefix_shifts_each_byte_seven_bits_further() -> None:
    prefix = LengthPrefix()
    assert prefix.feed(0x81) is None
    assert prefix.feed(0x82) is None
    assert prefix.feed(0x03) == 1 | 2 << 7 | 3 << 14


def test_every_varint_error_is_a_peers_protocol_fault() -> None:
    assert issubclass(VarintTooLong, VarintError) and issubclass(VarintOverLimit, VarintError)
    assert issubclass(VarintError, RemoteProtocolError)
