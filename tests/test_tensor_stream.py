"""Tensor streams: round trips, no copies on the way out, and every kind of bad input."""

from __future__ import annotations

import math
import struct
import sys
from typing import Any

import pytest
import torch
import trio
import trio.testing
from libp2p.abc import INetStream

from averaging.proto import tensor_pb2
from averaging.tensor_stream import (
    MAX_DIMS,
    MAX_INFO_SIZE,
    InvalidTensorDataError,
    InvalidTensorHeaderError,
    NonFiniteTensorError,
    TensorLimitError,
    TensorMismatchError,
    TruncatedTensorStreamError,
    UnsupportedTensorError,
    _Writer,
    receive_tensor,
    receive_tensors,
    send_tensor,
    send_tensors,
    tensors_message,
)
from p2p import Node
from p2p.varint import encode_varint

MiB = 1 << 20
LIMITS: dict[str, Any] = {"max_bytes": 64 * MiB, "max_tensors": 64}


class Pipe:
    """A byte stream in memory, for one task that writes first and reads after.

    Keeps every write as it was given (a memoryview stays one); a read returns at
    most ``max_read`` bytes, and at the end b"" or, with ``raise_eof``, EOFError
    as py-libp2p does.
    """

    def __init__(self, data: bytes = b"", *, max_read: int = 1 << 30, raise_eof: bool = False):
        self.writes: list[bytes] = []
        self._buffer = bytearray(data)
        self.max_read = max_read
        self.raise_eof = raise_eof

    async def write(self, data: bytes) -> None:
        self.writes.append(data)
        self._buffer += data

    async def read(self, n: int) -> bytes:
        assert n > 0
        data = bytes(self._buffer[: min(n, self.max_read)])
        del self._buffer[: len(data)]
        if not data and self.raise_eof:
            raise EOFError("end of stream")
        return data

    @property
    def unread(self) -> bytes:
        return bytes(self._buffer)


def message(*infos: tensor_pb2.TensorInfo, data: bytes = b"") -> bytes:
    """A hand-made message: what a buggy or hostile peer could send."""
    body = tensor_pb2.TensorsHeader(tensors=infos).SerializeToString()
    return encode_varint(len(body)) + body + data


def info(dtype: tensor_pb2.DType.ValueType, shape: list[int], nbytes: int) -> tensor_pb2.TensorInfo:
    return tensor_pb2.TensorInfo(dtype=dtype, shape=shape, nbytes=nbytes)


def assert_same(received: list[torch.Tensor], sent: list[torch.Tensor]) -> None:
    assert len(received) == len(sent)
    for got, want in zip(received, sent):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)


def every_kind() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(2, 3, generator=g),
        torch.randn(5, generator=g).half(),
        torch.randn(4, 4, generator=g).bfloat16(),
        torch.tensor(math.pi, dtype=torch.float64),  # 0-dim
        torch.randint(-(2**62), 2**62, (3, 1, 2), generator=g),
        torch.empty(0, dtype=torch.int32),
        torch.empty(2, 0, 3, dtype=torch.int8),
        torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8),
        torch.tensor([True, False, True, True, False, False]),
        torch.tensor(-7, dtype=torch.int8),
    ]


# ------------------------------------------------------------------ round trips


async def test_round_trip_of_every_dtype_and_shape_through_tiny_reads() -> None:
    sent = every_kind()
    pipe = Pipe(max_read=3)
    await send_tensors(pipe, sent)
    assert_same(await receive_tensors(pipe, **LIMITS), sent)
    assert pipe.unread == b""


async def test_single_tensor_helpers() -> None:
    pipe = Pipe()
    await send_tensor(pipe, torch.tensor(2.5))
    got = await receive_tensor(pipe, max_bytes=4)
    assert got.shape == () and got.item() == 2.5


async def test_empty_message() -> None:
    pipe = Pipe()
    await send_tensors(pipe, [])
    assert pipe.unread == b"\x00"
    assert await receive_tensors(pipe, max_bytes=0, max_tensors=0) == []


async def test_non_contiguous_and_grad_tensors_are_sent_as_their_values() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sent = [
        base.T,
        base[:, ::2],
        torch.tensor([1.0, 2.0, 3.0]).expand(4, 3),
        base.bfloat16().T,
        torch.nn.Parameter(torch.ones(3, 2)),
    ]
    assert not any(t.is_contiguous() for t in sent[:4])
    pipe = Pipe()
    await send_tensors(pipe, sent)
    received = await receive_tensors(pipe, **LIMITS)
    assert_same(received, [t.detach().contiguous() for t in sent])
    assert not received[4].requires_grad


async def test_sender_writes_straight_from_tensor_memory() -> None:
    tensor = torch.zeros(4, 65536, dtype=torch.bfloat16)  # 512 KiB
    pipe = Pipe()
    await send_tensors(pipe, [tensor], chunk_size=128 * 1024)
    chunks = pipe.writes[1:]  # after the header
    assert len(chunks) == 4 and all(isinstance(c, memoryview) and len(c) == 128 * 1024 for c in chunks)
    tensor.fill_(1.0)  # the views written are the tensor's own memory, not copies of it
    assert bytes(chunks[3][-2:]) == torch.tensor([1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


async def test_header_and_small_tensors_are_joined_into_one_write() -> None:
    sent = [torch.full((10,), float(i)) for i in range(50)]
    pipe = Pipe()
    await send_tensors(pipe, sent)
    assert len(pipe.writes) == 1
    assert_same(await receive_tensors(pipe, **LIMITS), sent)


async def test_a_message_with_its_prefix_in_one_buffer_reads_like_the_written_one() -> None:
    """tensors_message: a request frame and its tensors as one write (1 MiB chunks would be several)."""
    sent = [*every_kind(), torch.randn(300_000)]
    written = Pipe()
    await send_tensors(written, sent)
    buffer = await tensors_message(sent, prefix=b"REQ")
    assert buffer == b"REQ" + b"".join(bytes(w) for w in written.writes) and len(written.writes) > 1
    pipe = Pipe(buffer, max_read=70_000)
    assert await pipe.read(3) == b"REQ"
    assert_same(await receive_tensors(pipe, **LIMITS), sent)
    assert pipe.unread == b"" and await tensors_message([]) == await _empty()


async def _empty() -> bytes:
    pipe = Pipe()
    await send_tensors(pipe, [])
    return b"".join(bytes(w) for w in pipe.writes)


async def test_8_mib_tensor_through_small_chunks_and_reads() -> None:
    sent = torch.randn(2 * MiB, generator=torch.Generator().manual_seed(1))  # 8 MiB
    chunk = 64 * 1024
    pipe = Pipe(max_read=10_000)
    await send_tensor(pipe, sent, chunk_size=chunk)
    assert len(pipe.writes) == 1 + 8 * MiB // chunk
    assert all(len(w) <= chunk for w in pipe.writes)
    assert torch.equal(await receive_tensor(pipe, max_bytes=8 * MiB), sent)


async def test_receiver_reads_no_further_than_its_message() -> None:
    pipe = Pipe()
    await send_tensors(pipe, [torch.arange(5)])
    await send_tensor(pipe, torch.tensor([True]))
    await pipe.write(b"next")
    assert torch.equal((await receive_tensors(pipe, **LIMITS))[0], torch.arange(5))
    assert torch.equal(await receive_tensor(pipe, max_bytes=1), torch.tensor([True]))
    assert pipe.unread == b"next"


async def test_out_tensors_are_filled_in_place() -> None:
    sent = [torch.randn(3, 4), torch.randn(5)]
    flat = torch.zeros(17)
    out = [flat[:12].view(3, 4), flat[12:]]
    pipe = Pipe(max_read=7)
    await send_tensors(pipe, sent)
    received = await receive_tensors(pipe, out=out, **LIMITS)
    assert received[0] is out[0] and received[1] is out[1]
    assert torch.equal(flat, torch.cat([sent[0].reshape(-1), sent[1]]))
    single = torch.empty(2, dtype=torch.bfloat16)
    await send_tensor(pipe, torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert await receive_tensor(pipe, max_bytes=4, out=single) is single
    assert single.tolist() == [1.5, -2.0]


async def test_concurrent_sender_and_receiver_over_trio_memory_streams() -> None:
    send_stream, receive_stream = trio.testing.memory_stream_one_way_pair()

    class Writer:
        async def write(self, data: bytes) -> None:
            await send_stream.send_all(data)

    class Reader:
        async def read(self, n: int) -> bytes:
            return await receive_stream.receive_some(n)

    sent = every_kind() + [torch.randn(MiB)]
    received: list[torch.Tensor] = []

    async def sender() -> None:
        await send_tensors(Writer(), sent, chunk_size=100_000)
        await send_stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        received = await receive_tensors(Reader(), **LIMITS)
    assert_same(received, sent)
    with pytest.raises(TruncatedTensorStreamError, match="before the message"):
        await receive_tensors(Reader(), **LIMITS)


async def test_non_finite_values_pass_by_default_and_are_refused_on_request() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for bad in (math.nan, math.inf, -math.inf):
            tensor = torch.tensor([1.0, bad, 2.0], dtype=dtype)
            pipe = Pipe()
            await send_tensors(pipe, [tensor, tensor])
            got = await receive_tensors(pipe, **LIMITS)
            torch.testing.assert_close(got, [tensor, tensor], rtol=0, atol=0, equal_nan=True)
            await send_tensors(pipe, [torch.ones(2), tensor])
            with pytest.raises(NonFiniteTensorError, match=r"tensor 1 .* holds 1 NaN or Inf"):
                await receive_tensors(pipe, allow_nonfinite=False, **LIMITS)
    pipe = Pipe()
    await send_tensor(pipe, torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32))  # integers are never refused
    assert (await receive_tensor(pipe, max_bytes=8, allow_nonfinite=False)).tolist() == [-(2**31), 2**31 - 1]


# ------------------------------------------------------------------ bad input from the peer


async def test_header_length_over_the_limit_is_refused_before_reading_it() -> None:
    pipe = Pipe(encode_varint(10**9))  # the header itself never comes
    with pytest.raises(TensorLimitError, match="max_tensors=2"):
        await receive_tensors(pipe, max_bytes=MiB, max_tensors=2)
    with pytest.raises(TensorLimitError, match="at least"):
        await receive_tensors(Pipe(b"\xff" * 11), max_bytes=MiB, max_tensors=2)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (encode_varint(3) + b"\xff\xff\xff", "not a valid TensorsHeader"),
        (message(info(tensor_pb2.DType.ValueType(42), [1], 4)), "unknown dtype code 42"),
        (message(info(tensor_pb2.DTYPE_UNSPECIFIED, [1], 4)), "unknown dtype code 0"),
        (message(info(tensor_pb2.DTYPE_UINT8, [1] * (MAX_DIMS + 1), 1)), "65 dimensions"),
        (message(info(tensor_pb2.DTYPE_FLOAT32, [2, 2], 15)), r"15 bytes, but a float32\[2, 2\] takes 16"),
        (message(info(tensor_pb2.DTYPE_BOOL, [], 0)), "0 bytes, but a bool"),
    ],
)
async def test_invalid_header_is_refused(data: bytes, match: str) -> None:
    with pytest.raises(InvalidTensorHeaderError, match=match):
        await receive_tensors(Pipe(data + b"\x00" * 64), **LIMITS)


@pytest.mark.parametrize(
    ("infos", "match"),
    [
        ([info(tensor_pb2.DTYPE_FLOAT32, [1024, 1024], 4 * MiB), info(tensor_pb2.DTYPE_INT8, [1], 1)], "0-1 alone"),
        ([info(tensor_pb2.DTYPE_INT64, [2**40], 2**43)], "dimension of 1099511627776"),
        ([info(tensor_pb2.DTYPE_FLOAT16, [0, 2**62], 0)], "dimension of"),
        ([info(tensor_pb2.DTYPE_UINT8, [1], 1)] * 4, "4 tensors announced, over max_tensors=3"),
    ],
)
async def test_over_the_limits_is_refused_before_allocating(
    infos: list[tensor_pb2.TensorInfo], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_allocation(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("allocated before checking the limits")

    monkeypatch.setattr(torch, "empty", no_allocation)
    with pytest.raises(TensorLimitError, match=match):
        await receive_tensors(Pipe(message(*infos)), max_bytes=4 * MiB, max_tensors=3)


@pytest.mark.parametrize("raise_eof", [False, True])
async def test_stream_ending_early_says_how_far_it_got(raise_eof: bool) -> None:
    full = Pipe()
    await send_tensors(full, [torch.ones(3), torch.ones(100), torch.ones(2)])
    data = full.unread
    header_end = len(data) - 105 * 4
    cases = [
        (b"", "before the message"),
        (b"\x85", "inside the header's length prefix"),
        (data[:5], f"after 4 of the header's {header_end - 1} bytes"),
        (data[: header_end + 12 + 50], "after 50 of the 400 bytes of tensor 1 \\(float32\\[100\\]\\), 62 of 420"),
        (data[:-1], "after 7 of the 8 bytes of tensor 2"),
    ]
    for truncated, match in cases:
        with pytest.raises(TruncatedTensorStreamError, match=match):
            await receive_tensors(Pipe(truncated, raise_eof=raise_eof, max_read=9), **LIMITS)


async def test_bool_bytes_other_than_0_and_1_are_refused() -> None:
    data = message(info(tensor_pb2.DTYPE_BOOL, [3], 3), data=b"\x01\x00\x02")
    with pytest.raises(InvalidTensorDataError, match=r"tensor 0 \(bool\[3\]\) holds bytes other than 0 and 1"):
        await receive_tensors(Pipe(data), **LIMITS)


async def test_tensors_other_than_out_are_refused() -> None:
    sent = [torch.ones(2, 3), torch.ones(4, dtype=torch.int64)]
    cases = [
        ([torch.empty(2, 3)], "sent 2 tensors where out holds 1"),
        ([torch.empty(2, 3), torch.empty(4, dtype=torch.int32)], r"int64\[4\] as tensor 1 where out\[1\] is int32\[4\]"),
        ([torch.empty(3, 2), torch.empty(4, dtype=torch.int64)], r"float32\[2, 3\] as tensor 0 where out\[0\] is"),
    ]
    for out, match in cases:
        pipe = Pipe()
        await send_tensors(pipe, sent)
        with pytest.raises(TensorMismatchError, match=match):
            await receive_tensors(pipe, out=out, **LIMITS)


async def test_receive_tensor_wants_exactly_one() -> None:
    pipe = Pipe()
    await send_tensors(pipe, [])
    with pytest.raises(TensorMismatchError, match="no tensor"):
        await receive_tensor(pipe, max_bytes=MiB)
    await send_tensors(pipe, [torch.ones(1), torch.ones(1)])
    with pytest.raises(TensorLimitError):
        await receive_tensor(pipe, max_bytes=MiB)


# ------------------------------------------------------------------ bad input from the caller


async def test_unusable_out_is_refused_before_reading() -> None:
    pipe = Pipe()
    await send_tensor(pipe, torch.ones(2, 3))
    before = pipe.unread
    for out, match in [
        (torch.empty(3, 2).T, "not contiguous"),
        (torch.empty(2, 3, dtype=torch.complex64), "complex64"),
        (torch.empty(2, 3).to_sparse(), "sparse"),
    ]:
        with pytest.raises(UnsupportedTensorError, match=match):
            await receive_tensor(pipe, max_bytes=MiB, out=out)
        assert pipe.unread == before
    with pytest.raises(ValueError, match="max_bytes"):
        await receive_tensors(pipe, max_bytes=-1, max_tensors=1)


async def test_unsendable_tensors_are_refused_before_writing() -> None:
    for bad, match in [
        (torch.ones(2, dtype=torch.complex64), "complex64, which cannot be sent; supported: float32"),
        (torch.ones(2, dtype=torch.int16), "int16"),
        (torch.ones(2, 2).to_sparse(), "to_dense"),
        ([1.0, 2.0], "list, not a torch.Tensor"),
    ]:
        pipe = Pipe()
        with pytest.raises(UnsupportedTensorError, match=f"tensor 1 .*{match}"):
            await send_tensors(pipe, [torch.ones(1), bad])  # type: ignore[list-item]
        assert pipe.writes == []
    with pytest.raises(ValueError, match="chunk_size"):
        await send_tensors(Pipe(), [torch.ones(1)], chunk_size=0)


# ------------------------------------------------------------------ real peers


async def test_tensors_over_a_real_node_pair(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair
    protocol = "/dedloc/test/tensors/1.0.0"

    async def echo(stream: INetStream) -> None:
        received = await receive_tensors(stream, **LIMITS)
        await send_tensors(stream, received, chunk_size=256 * 1024)
        await stream.close()

    b.set_stream_handler(protocol, echo)
    sent = every_kind() + [torch.randn(1024, 1024, generator=torch.Generator().manual_seed(2))]  # 4 MiB
    stream = await a.new_stream(b.peer_id, [protocol])
    await send_tensors(stream, sent)
    assert_same(await receive_tensors(stream, **LIMITS), sent)
    with pytest.raises(TruncatedTensorStreamError, match="before the message"):
        await receive_tensors(stream, **LIMITS)  # b closed its side
    await stream.close()


# ------------------------------------------------------------------ the exact words, the exact edges


async def test_the_writer_joins_small_pieces_up_to_its_limit_and_writes_big_ones_as_they_are() -> None:
    pipe = Pipe()
    writer = _Writer(pipe, 10)
    big = memoryview(b"B" * 10)
    await writer.write(b"abc")
    await writer.write(b"defg")
    await writer.write(b"hij")  # 3 + 4 + 3 = 10: still one write
    assert pipe.writes == []
    await writer.write(b"k")  # 11 would pass the limit: the ten go first
    assert pipe.writes == [b"abcdefghij"]
    await writer.write(big)  # a piece of the limit itself: the "k" first, then the piece as it is
    assert pipe.writes[1] == b"k" and pipe.writes[2] is big
    one = memoryview(b"solo")
    await writer.write(one)
    await writer.flush()  # a lone piece goes out as it is, not copied
    assert pipe.writes[3] is one
    await writer.flush()  # nothing left: no empty write
    assert len(pipe.writes) == 4
    await writer.write(b"123456789")  # the count started again at 0: 9 fit
    await writer.write(b"0")
    await writer.flush()
    assert pipe.writes[4:] == [b"1234567890"]


async def test_a_chunk_size_of_one_byte_is_allowed() -> None:
    pipe = Pipe()
    await send_tensor(pipe, torch.arange(3, dtype=torch.int8), chunk_size=1)
    assert [bytes(w) for w in pipe.writes[1:]] == [b"\x00", b"\x01", b"\x02"]
    assert torch.equal(await receive_tensor(pipe, max_bytes=3), torch.arange(3, dtype=torch.int8))


async def test_a_big_endian_host_is_refused_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "byteorder", "big")  # what _check_host reads
    said = "^tensors travel little-endian; this big-endian host would have to byte-swap$"
    with pytest.raises(UnsupportedTensorError, match=said):
        await send_tensor(Pipe(), torch.ones(1))
    with pytest.raises(UnsupportedTensorError, match=said):
        await receive_tensor(Pipe(b"\x00"), max_bytes=4)


async def test_an_unsendable_dtype_lists_every_supported_one() -> None:
    with pytest.raises(UnsupportedTensorError, match=(
            r"^tensor 0 has dtype torch.int16, which cannot be sent; supported: float32, float16, bfloat16, "
            r"float64, int64, int32, int8, uint8, bool$")):
        await send_tensor(Pipe(), torch.ones(1, dtype=torch.int16))


async def test_a_stream_that_returns_more_than_asked_is_a_bug_named() -> None:
    class Generous(Pipe):
        async def read(self, n: int) -> bytes:
            return await super().read(n) if n == 1 else b"\x00" * (n + 1)  # the prefix as asked, then more

    body = tensor_pb2.TensorsHeader(tensors=[info(tensor_pb2.DTYPE_UINT8, [4], 4)]).SerializeToString()
    with pytest.raises(RuntimeError, match=(
            rf"^Generous.read\({len(body)}\) returned {len(body) + 1} bytes, more than asked$")):
        await receive_tensors(Generous(encode_varint(len(body))), max_bytes=4, max_tensors=1)


@pytest.mark.parametrize(("data", "said"), [
    (b"", "the stream ended before the message"),
    (b"\x85", "the stream ended inside the header's length prefix"),
])
async def test_the_end_of_the_stream_in_the_header_is_named_exactly(data: bytes, said: str) -> None:
    with pytest.raises(TruncatedTensorStreamError, match=f"^{said}$"):
        await receive_tensors(Pipe(data), **LIMITS)


async def test_the_header_limits_are_named_exactly() -> None:
    limit = 2 * MAX_INFO_SIZE
    with pytest.raises(TensorLimitError, match=(
            f"^header of {limit + 1} bytes announced, over the {limit} that max_tensors=2 allows$")):
        await receive_tensors(Pipe(encode_varint(limit + 1)), max_bytes=MiB, max_tensors=2)
    with pytest.raises(TensorLimitError, match=(
            f"^header of at least 16384 bytes announced, over the {limit} that max_tensors=2 allows$")):
        await receive_tensors(Pipe(b"\x80\x80\x81"), max_bytes=MiB, max_tensors=2)
    with pytest.raises(InvalidTensorHeaderError, match="^header length prefix longer than 10 bytes$"):
        await receive_tensors(Pipe(b"\x80" * 11), max_bytes=MiB, max_tensors=2)


async def test_a_tensor_of_max_dims_dimensions_is_taken() -> None:
    sent = torch.ones([1] * MAX_DIMS)
    pipe = Pipe()
    await send_tensor(pipe, sent)
    assert (await receive_tensor(pipe, max_bytes=4)).shape == sent.shape


async def test_over_max_bytes_says_how_to_allow_it() -> None:
    data = message(info(tensor_pb2.DTYPE_UINT8, [3], 3), info(tensor_pb2.DTYPE_UINT8, [2], 2))
    with pytest.raises(TensorLimitError, match=(
            "^tensors 0-1 alone take 5 bytes, over max_bytes=4; raise it if the peer may send this much$")):
        await receive_tensors(Pipe(data), max_bytes=4, max_tensors=2)


async def test_unusable_out_is_named_exactly() -> None:
    with pytest.raises(UnsupportedTensorError, match=(
            r"^out\[0\] is on cpu, not contiguous: tensors are received in place only into contiguous CPU tensors$")):
        await receive_tensor(Pipe(), max_bytes=MiB, out=torch.empty(3, 2).T)
    with pytest.raises(UnsupportedTensorError, match=(  # contiguous, off the CPU (a GPU's, say)
            r"^out\[0\] is on meta: tensors are received in place only into contiguous CPU tensors$")):
        await receive_tensor(Pipe(), max_bytes=MiB, out=torch.empty(3, device="meta"))
    with pytest.raises(UnsupportedTensorError, match=r"^out\[1\] has dtype torch.int16, which cannot be sent"):
        await receive_tensors(Pipe(), max_bytes=MiB, max_tensors=2,
                              out=[torch.empty(1), torch.empty(1, dtype=torch.int16)])


async def test_a_single_value_is_checked_too() -> None:
    pipe = Pipe()
    await send_tensor(pipe, torch.tensor([math.nan]))
    with pytest.raises(NonFiniteTensorError, match=r"^tensor 0 \(float32\[1\]\) holds 1 NaN or Inf values$"):
        await receive_tensor(pipe, max_bytes=4, allow_nonfinite=False)
    with pytest.raises(InvalidTensorDataError, match="holds bytes other than 0 and 1"):
        await receive_tensor(Pipe(message(info(tensor_pb2.DTYPE_BOOL, [1], 1), data=b"\x07")), max_bytes=1)


async def test_receive_tensor_lets_nan_through_unless_asked_not_to() -> None:
    pipe = Pipe()
    await send_tensor(pipe, torch.tensor([math.inf, 1.0]))
    assert (await receive_tensor(pipe, max_bytes=8)).isinf().tolist() == [True, False]


async def test_receive_tensor_of_no_tensor_is_named_exactly() -> None:
    pipe = Pipe()
    await send_tensors(pipe, [])
    with pytest.raises(TensorMismatchError, match="^the peer sent no tensor where one was expected$"):
        await receive_tensor(pipe, max_bytes=MiB)
