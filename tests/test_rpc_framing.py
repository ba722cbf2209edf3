"""The RPC codec alone: bytes in, frames out, no streams and no clock."""

from __future__ import annotations

import random

import pytest

from p2p.rpc import InvalidMessageError, MessageTooLargeError, rpc_pb2
from p2p.rpc.framing import (
    END_FRAME,
    FRAME_OVERHEAD,
    MAX_ERROR_TEXT,
    FrameDecoder,
    Payload,
    encode_call,
    encode_error,
    encode_frame,
    encode_message,
    message_header,
    parse_frame,
)
from p2p.varint import encode_varint

LIMIT = 1024 * 1024


def feed(decoder: FrameDecoder, data: bytes, chunk: int | None = None) -> list[object]:
    """Feed ``data`` in pieces of ``chunk`` bytes (all at once if None); every frame out."""
    out: list[object] = []
    step = chunk or max(1, len(data))
    for i in range(0, len(data), step):
        decoder.feed(data[i : i + step])
        while (frame := decoder.next()) is not None:
            out.append(frame)
    return out


def decode_all(data: bytes, *, chunk: int | None = None, limit: int = LIMIT) -> list[object]:
    """Every frame in ``data``, which must end on a frame boundary."""
    decoder = FrameDecoder(limit)
    out = feed(decoder, data, chunk)
    assert decoder.buffered == 0, "bytes left over after the last frame"
    return out


def as_bytes(frame: object) -> bytes:
    assert isinstance(frame, Payload)
    return bytes(frame.data)


def test_hand_built_message_frame_is_what_protobuf_writes() -> None:
    for size in (0, 1, 127, 128, 70_000):
        payload = random.randbytes(size)
        assert encode_message(payload) == encode_frame(rpc_pb2.Frame(message=payload))
        assert message_header(size) + payload == encode_message(payload)


def test_round_trip_of_every_frame_kind() -> None:
    payloads = [b"", b"x", random.randbytes(300), random.randbytes(200_000)]
    stream = (
        encode_call("dht.find", 5000)
        + b"".join(encode_message(p) for p in payloads)
        + encode_error(7, "nope")
        + END_FRAME
    )
    frames = decode_all(stream)
    call, *messages, error, end = frames
    assert isinstance(call, rpc_pb2.Call) and (call.method, call.deadline_ms) == ("dht.find", 5000)
    assert [as_bytes(m) for m in messages] == payloads
    assert isinstance(error, rpc_pb2.Error) and (error.code, error.message) == (7, "nope")
    assert isinstance(end, rpc_pb2.End)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000, 65_536, 100_000])
def test_frames_split_anywhere_decode_the_same(chunk: int) -> None:
    payloads = [random.randbytes(n) for n in (0, 5, 129, 70_000, 3, 300_000, 64 * 1024)]
    stream = encode_call("m", 1) + b"".join(encode_message(p) for p in payloads) + END_FRAME
    frames = decode_all(stream, chunk=chunk)
    assert [as_bytes(f) for f in frames[1:-1]] == payloads
    assert isinstance(frames[-1], rpc_pb2.End)


def test_fed_byte_by_byte_nothing_comes_out_early() -> None:
    frame = encode_message(b"hello world")
    decoder = FrameDecoder(LIMIT)
    for byte in frame[:-1]:
        decoder.feed(bytes([byte]))
        assert decoder.next() is None
    decoder.feed(frame[-1:])
    assert as_bytes(decoder.next()) == b"hello world"
    assert decoder.next() is None


def test_message_at_the_limit_passes_and_one_byte_more_does_not() -> None:
    limit = 4096
    assert as_bytes(decode_all(encode_message(b"a" * limit), limit=limit)[0]) == b"a" * limit
    with pytest.raises(MessageTooLargeError, match=r"^message of 4097 bytes is over the limit of 4096 \(code \d+\)$"):
        decode_all(encode_message(b"a" * (limit + 1)), limit=limit)


def test_oversized_prefix_is_rejected_before_any_body_arrives() -> None:
    decoder = FrameDecoder(1024)
    decoder.feed(encode_varint(1024 + FRAME_OVERHEAD + 1))
    with pytest.raises(MessageTooLargeError, match=r"^frame of 1036 bytes announced, over the limit of 1035 "
                                                   r"\(max_message_size 1024 \+ envelope\) \(code \d+\)$"):
        decoder.next()


def test_oversized_prefix_is_rejected_from_its_first_bytes() -> None:
    # A 4 GiB length: its first three bytes already say "over 1 MiB", so the
    # decoder refuses before the prefix is even complete.
    prefix = encode_varint(2**32 - 1)
    decoder = FrameDecoder(LIMIT)
    decoder.feed(prefix[:3])
    with pytest.raises(MessageTooLargeError, match=r"^frame of at least \d+ bytes announced, over the limit of "
                                                   r"1048587 \(max_message_size 1048576 \+ envelope\) \(code \d+\)$"):
        decoder.next()


def test_large_frame_body_is_not_copied_into_the_shared_buffer() -> None:
    payload = random.randbytes(500_000)
    frame = encode_message(payload)
    decoder = FrameDecoder(LIMIT)
    decoder.feed(frame[:100])
    assert decoder.next() is None
    assert decoder.buffered == 100
    for i in range(100, len(frame), 4096):
        decoder.feed(frame[i : i + 4096])
    out = decoder.next()
    assert isinstance(out, Payload) and isinstance(out.data, memoryview)
    assert out.data == payload


def test_truncated_stream_leaves_bytes_buffered() -> None:
    decoder = FrameDecoder(LIMIT)
    decoder.feed(encode_message(b"abcdef")[:-2])
    assert decoder.next() is None
    assert decoder.buffered > 0  # the I/O edge turns this into "peer left mid-frame"


def test_truncated_length_prefix_waits_then_overlong_prefix_fails() -> None:
    decoder = FrameDecoder(2**70)
    decoder.feed(b"\x80")
    assert decoder.next() is None
    decoder.feed(b"\x80" * 10)
    with pytest.raises(InvalidMessageError, match=r"^frame length prefix longer than 10 bytes \(code \d+\)$"):
        decoder.next()


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xff\xff\xff",  # not protobuf at all
        b"\x0a\x05ab",  # call field whose length runs past the end
        b"\x1a\x03\x08",  # error field, truncated inside
        b"\x0a\x02\x0a\xff",  # call.method with an impossible length
        b"\x0a\x03\x0a\x01\xff",  # call.method that is not UTF-8
        b"\x12" + b"\xff" * 11,  # the message tag, then a length prefix longer than a varint may be
        b"\x01",  # one byte
    ],
)
def test_garbled_frames_are_invalid(body: bytes) -> None:
    with pytest.raises(InvalidMessageError, match="^frame is not a valid Frame: "):
        decode_all(encode_varint(len(body)) + body)


def test_a_frame_of_only_an_unknown_field_has_no_body() -> None:
    with pytest.raises(InvalidMessageError, match=r"^frame with no body \(code \d+\)$"):
        decode_all(b"\x02\x08\x01")


def test_zero_length_frame_is_invalid() -> None:
    with pytest.raises(InvalidMessageError, match=r"^empty frame \(code \d+\)$"):
        decode_all(b"\x00")


def test_a_decoder_needs_a_positive_limit() -> None:
    with pytest.raises(ValueError, match="^max_message_size must be positive, got 0$"):
        FrameDecoder(0)
    assert as_bytes(decode_all(encode_message(b"a"), limit=1)[0]) == b"a"


def test_an_empty_message_is_sliced_too() -> None:
    out = parse_frame(b"\x12\x00")
    assert isinstance(out, Payload) and isinstance(out.data, memoryview) and out.data == b""


def test_a_body_with_more_than_its_message_is_parsed_by_protobuf() -> None:
    """The shortcut takes a body that is exactly one message field; a message then a call is protobuf's
    to read (its oneof keeps the last field)."""
    body = rpc_pb2.Frame(message=b"ab").SerializeToString() + rpc_pb2.Frame(call=rpc_pb2.Call(method="m")).SerializeToString()
    out = parse_frame(body)
    assert isinstance(out, rpc_pb2.Call) and out.method == "m"


def test_non_canonical_message_frame_still_decodes() -> None:
    # Another implementation may put an unknown field first; only our shortcut
    # is skipped, the frame is still understood.
    body = b"\x28\x01" + rpc_pb2.Frame(message=b"payload").SerializeToString()
    assert as_bytes(decode_all(encode_varint(len(body)) + body)[0]) == b"payload"


def test_parse_frame_slices_message_without_copy() -> None:
    body = bytearray(rpc_pb2.Frame(message=b"xyz").SerializeToString())
    out = parse_frame(body)
    assert isinstance(out, Payload) and isinstance(out.data, memoryview) and out.data.obj is body


def test_error_text_is_bounded() -> None:
    frame = decode_all(encode_error(5, "x" * 100_000))[0]
    assert isinstance(frame, rpc_pb2.Error) and frame.message == "x" * (MAX_ERROR_TEXT - 3) + "..."
    frame = decode_all(encode_error(5, "y" * MAX_ERROR_TEXT))[0]  # as long as allowed: whole
    assert isinstance(frame, rpc_pb2.Error) and frame.message == "y" * MAX_ERROR_TEXT and frame.code == 5


def test_call_deadline_is_clamped_to_the_field() -> None:
    call = decode_all(encode_call("m", 10**12))[0]
    assert isinstance(call, rpc_pb2.Call) and call.deadline_ms == 2**32 - 1
    call = decode_all(encode_call("m", 0))[0]
    assert isinstance(call, rpc_pb2.Call) and call.deadline_ms == 1


def test_random_garbage_raises_only_codec_errors() -> None:
    rng = random.Random(1234)
    outcomes = {"frames": 0, "refused": 0}
    for _ in range(3000):
        blob = rng.randbytes(rng.randrange(1, 64))
        try:
            feed(FrameDecoder(1 << 16), blob, rng.choice([1, 3, 64]))
            outcomes["frames"] += 1  # frames, or a prefix waiting for more bytes
        except (InvalidMessageError, MessageTooLargeError):
            outcomes["refused"] += 1
    assert outcomes["refused"] > 1000
