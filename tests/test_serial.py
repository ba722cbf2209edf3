"""averaging/serial.py: a round's per-chunk ops run on pieces small enough that torch opens no
parallel region (on an H200 host's 16 cores each region cost ~8 ms inside a training process, and a
740 MB round took 27-51 s: docs/AVERAGING.md), with the values one whole op gives."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from averaging import serial
from averaging.compression import Region, decode, encode
from averaging.proto import averaging_pb2 as pb
from averaging.reduction import PartReduction
from averaging.staging import BufferPool, DeviceVector, HostVector

P = serial.PIECE


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads on this thread, for the block (serial.whole reads them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Every test here as a process with several intra-op threads (torch's default where cores are
    several), whatever the machine running the suite has."""
    with intra_op_threads(2):
        yield
SIZES = [0, 1, P - 1, P, P + 1, 3 * P + 17]

#: torch calls that compute over their tensors' values (not views, sizes, allocations)
COMPUTE = {"mul", "add_", "div_", "copy_", "sum", "isfinite", "clamp", "to", "all", "__mul__", "__truediv__",
           "__add__", "__iadd__", "__imul__", "__itruediv__", "__setitem__", "div", "add", "__sub__", "min", "max",
           "round_", "clamp_", "pad", "cat", "where"}


class Sizes(TorchFunctionMode):
    """Every computing torch call's largest tensor operand (in values)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in COMPUTE:
            tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
            self.calls.append((name, max((t.numel() for t in tensors), default=0)))
        return func(*args, **kwargs)


@contextmanager
def sizes() -> Iterator[Sizes]:
    with Sizes() as mode:
        yield mode


def assert_serial(mode: Sizes) -> None:
    assert mode.calls, "nothing computed: the check would prove nothing"
    over = [(name, n) for name, n in mode.calls if n > P]
    assert not over, f"ops on more than {P} values (a parallel region each): {over[:5]}"


@pytest.mark.parametrize("n", SIZES)
def test_each_op_gives_what_one_whole_op_gives(n: int) -> None:
    torch.manual_seed(n)
    values, total = torch.randn(n), torch.randn(n)
    assert torch.equal(serial.scaled(values, 2.5), values * 2.5)
    mine = total.clone()
    serial.add_scaled_(mine, values, 0.75)
    assert torch.equal(mine, total.clone().add_(values, alpha=0.75))
    mine = total.clone()
    assert serial.divide_(mine, 3.0) is mine and torch.equal(mine, total / 3.0)
    dst = torch.empty(n)
    serial.copy_(dst, values)
    assert torch.equal(dst, values)
    half = values.to(torch.float16)
    assert serial.copied(half).dtype == torch.float32 and torch.equal(serial.copied(half), half.float())


@pytest.mark.parametrize("where", [0, P - 1, P, 2 * P + 5, 3 * P + 16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finite_finds_a_bad_value_in_any_piece(where: int, bad: float) -> None:
    values = torch.randn(3 * P + 17)
    assert serial.finite(values)
    values[where] = bad
    assert not serial.finite(values)


def test_finite_values_whose_sum_overflows_are_finite() -> None:
    values = torch.full((2 * P + 3,), 3e38)  # each piece's sum overflows: the exact check decides
    assert serial.finite(values)
    values[-1] = float("nan")
    assert not serial.finite(values)


def test_a_reduction_adds_and_divides_in_pieces_and_gets_the_weighted_mean() -> None:
    n = 4 * P + 100
    spans = [Region(0, n, pb.CODEC_FLOAT32)]
    reduction = PartReduction(spans, {0, 1, 2})
    rows = [torch.randn(n) for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    for sender, w in enumerate(weights):
        reduction.set_weight(sender, w)
    finals = []
    with sizes() as mode:
        for sender, row in enumerate(rows):
            finals += reduction.add(sender, 0, row)
    assert_serial(mode)
    assert len(finals) == 1 and finals[0].values is not None
    expected = sum(w * r for w, r in zip(weights, rows)) / sum(weights)
    assert torch.allclose(finals[0].values, expected, atol=1e-6)


def test_a_non_finite_contribution_is_refused_in_pieces() -> None:
    n = 2 * P + 1
    reduction = PartReduction([Region(0, n, pb.CODEC_FLOAT32)], {0, 1})
    reduction.set_weight(0, 1.0)
    reduction.set_weight(1, 1.0)
    bad = torch.ones(n)
    bad[-1] = float("nan")
    with sizes() as mode:
        assert reduction.add(0, 0, bad) == []
        final, = reduction.add(1, 0, torch.full((n,), 3.0))
    assert_serial(mode)
    assert final.contributors == {1} and torch.equal(final.values, torch.full((n,), 3.0))


@pytest.mark.parametrize("vector", ["host", "device"])
def test_averages_are_written_back_in_pieces(vector: str) -> None:
    n = 3 * P + 7
    tensors = [torch.zeros(n)]
    span = Region(0, n, pb.CODEC_FLOAT32)
    pool = BufferPool()
    flat = HostVector(tensors, pool) if vector == "host" else DeviceVector(tensors, [[span]], pool)
    values = torch.arange(n, dtype=torch.float32)
    with sizes() as mode:
        flat.write(span, values)
    if vector == "device":  # its last copy, staging buffer to device, is a DMA on a GPU: no CPU op to split
        assert mode.calls[-1] == ("copy_", n)
        mode.calls.pop()
    assert_serial(mode)
    assert torch.equal(flat.result, values)


def test_float16_chunks_are_encoded_and_decoded_in_pieces() -> None:
    values = torch.randn(2 * P + 9) * 1e5  # beyond float16's range too: saturated, not inf
    with sizes() as mode:
        payload = encode(values, pb.CODEC_FLOAT16)
        back = decode(bytearray(payload), pb.CODEC_FLOAT16, values.numel())
    assert_serial(mode)
    expected = values.clamp(-65504.0, 65504.0).to(torch.float16).float()
    assert torch.equal(back, expected)


def test_a_piece_is_no_larger_than_aten_s_grain_size() -> None:
    """ATen opens a parallel region for an op on more than at::internal::GRAIN_SIZE (32,768) values
    (ATen/Parallel.h): a larger PIECE would bring the regions back, which no CPU test here can time."""
    assert serial.PIECE == 32 * 1024


@pytest.mark.parametrize("n", SIZES)
def test_pieces_cover_a_chunk_in_order_none_over_a_piece(n: int) -> None:
    slices = serial.pieces(torch.empty(n))
    covered = [i for piece in slices for i in range(n)[piece]]
    assert covered == list(range(n)), slices
    assert all(piece.stop - piece.start <= P for piece in slices) and len(slices) == max(1, -(-n // P))


def test_off_the_host_a_chunk_is_one_piece() -> None:
    """A GPU's kernels open no OpenMP region: pieces there would only add kernel launches (the meta
    device stands in for one: not the host)."""
    assert serial.pieces(torch.empty(3 * P, device="meta")) == [slice(0, 3 * P)]
    assert serial.pieces(torch.empty(3 * P)) != [slice(0, 3 * P)]


def test_with_one_intra_op_thread_each_op_is_whole() -> None:
    """One thread opens no parallel region: pieces would only add calls (5-8% of a 400 MB round on the
    2-core machine, whose bench peers run one thread)."""
    values, total = torch.randn(3 * P), torch.zeros(3 * P)
    with intra_op_threads(1), sizes() as mode:
        serial.add_scaled_(total, values, 2.0)
        assert serial.finite(values)
    assert [n for _, n in mode.calls if n] and all(n == 3 * P for _, n in mode.calls if n > 1), mode.calls
    assert torch.equal(total, values * 2.0)


@pytest.mark.parametrize("n", [P + 1, 2 * P, 3 * P + 1000])
def test_uint8_chunks_are_coded_in_pieces_to_the_same_bytes(n: int) -> None:
    """A piece is whole blocks of the 8-bit codec, so the pieces' bytes are the whole chunk's bytes."""
    torch.manual_seed(n)
    values = torch.randn(n) * torch.linspace(0.1, 10.0, n)
    with intra_op_threads(1):  # one op each: the reference
        whole = bytes(encode(values, pb.CODEC_UINT8))
        expected = decode(bytearray(whole), pb.CODEC_UINT8, n)
    with sizes() as mode:
        payload = bytes(encode(values, pb.CODEC_UINT8))
        back = decode(bytearray(payload), pb.CODEC_UINT8, n)
    assert_serial(mode)
    assert payload == whole and torch.equal(back, expected)
    assert (back - values).abs().max() <= (values.max() - values.min()) / 255


def test_new_chunks_are_float32_whatever_torch_s_default_dtype() -> None:
    """A caller may set torch's default dtype to float64; a round's values stay float32 (the wire's)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for n in (P - 1, 2 * P + 1):
            values = torch.ones(n, dtype=torch.float32)
            assert serial.scaled(values, 2.0).dtype == serial.copied(values).dtype == torch.float32
    finally:
        torch.set_default_dtype(before)


def test_a_finite_chunk_is_checked_by_one_sum_not_an_isfinite_pass() -> None:
    """averaging/finite.py's point: a finite sum proves every value finite, at a sum's speed (31 GB/s on
    one core against isfinite().all()'s 1.2): the exact pass runs only where the sum is not finite.
    Integer and empty tensors cost nothing at all."""
    from averaging.finite import all_finite, tensor_finite

    x = torch.randn(10_000)
    half = torch.full((100,), 60000.0, dtype=torch.float16)  # its float16 sum would overflow; float32's does not
    with sizes() as mode:
        assert tensor_finite(x) and tensor_finite(half) and all_finite([x, half, x[:10]])
    full = [(name, n) for name, n in mode.calls if name == "isfinite" and n > 3]
    assert mode.calls and not full, mode.calls
    # a model's gradients: one fused pass (2-norms), not a sum each; large values too (1e15: their squares
    # are finite, where a higher power's would overflow and send them to the exact pass)
    many = [torch.randn(7) for _ in range(200)] + [torch.full((7,), 1e15)]
    with sizes() as mode:
        assert all_finite(many)
    assert len(mode.calls) < 5, mode.calls
    with sizes() as mode:
        assert tensor_finite(torch.arange(10)) and tensor_finite(torch.empty(0))
        assert all_finite([torch.arange(10), torch.empty(0)])
    assert mode.calls == []
    y = x.clone()
    y[5] = float("nan")
    with sizes() as mode:
        assert not tensor_finite(y)
    assert ("isfinite", 10_000) in mode.calls  # a sum that is not finite: the exact pass decides
