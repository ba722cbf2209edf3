"""The averaging layer's pure parts: partition, codecs, the LP, the reduction state machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from averaging.compression import Compression, codec_regions, decode, encode, payload_size, wire_codec
from averaging.load_balancing import Capacity, balance, equal_fractions
from averaging.partition import Schema, SchemaMismatchError, chunk_spans, flatten, part_bounds, unflatten_into
from averaging.proto import averaging_pb2 as pb
from averaging.reduction import ChunkRejected, PartReduction

MBIT = 1e6 / 8
S = 40_000_000


# ---------------------------------------------------------------- partition

def test_part_bounds_cover_everything_once() -> None:
    for total in (0, 1, 7, 1000, 10**7 + 3):
        for fractions in ([1.0], [0.25] * 4, [0.5, 0.5, 0.0, 0.0], [0.1, 0.0, 0.6, 0.3]):
            bounds = part_bounds(total, fractions)
            assert bounds[0] == 0 and bounds[-1] == total
            assert all(a <= b for a, b in zip(bounds, bounds[1:]))
            for f, a, b in zip(fractions, bounds, bounds[1:]):
                if f == 0:
                    assert a == b
    sizes = [b - a for a, b in zip(part_bounds(1003, [1, 1, 1, 1]), part_bounds(1003, [1, 1, 1, 1])[1:])]
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        part_bounds(10, [0.0, 0.0])
    with pytest.raises(ValueError):
        part_bounds(10, [float("nan"), 1.0])


def test_chunks_never_straddle_codec_regions() -> None:
    regions = codec_regions([10, 100_000, 5, 200_000], Compression.UINT8, min_elements=1000)
    assert [r.codec for r in regions] == [pb.CODEC_FLOAT32, pb.CODEC_UINT8, pb.CODEC_FLOAT32, pb.CODEC_UINT8]
    spans = chunk_spans(0, 300_015, 4096, regions)
    assert spans[0].start == 0 and spans[-1].end == 300_015
    for a, b in zip(spans, spans[1:]):
        assert a.end == b.start
    for span in spans:
        assert span.end - span.start <= 4096
        assert any(r.start <= span.start and span.end <= r.end and r.codec == span.codec for r in regions)


def test_schema_names_the_first_difference_and_flatten_round_trips() -> None:
    a = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64)]
    schema = Schema.of(a)
    assert schema.numel == 17 and len(schema.fingerprint()) == 16
    with pytest.raises(SchemaMismatchError, match=r"tensor 1 is torch.float64\[6\]"):
        schema.check([torch.randn(3, 4), torch.randn(6, dtype=torch.float64)])
    with pytest.raises(SchemaMismatchError, match="got 1 tensors"):
        schema.check([torch.randn(3, 4)])
    with pytest.raises(SchemaMismatchError, match="floating-point"):
        Schema.of([torch.arange(3)])
    assert Schema.of([torch.randn(3, 4)]).fingerprint() != Schema.of([torch.randn(4, 3)]).fingerprint()
    flat = flatten(a)
    out = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.float64)]
    unflatten_into(flat, out)
    assert torch.equal(out[0], a[0]) and torch.allclose(out[1], a[1])


# ---------------------------------------------------------------- codecs

@pytest.mark.parametrize("n", [1, 1000, 1024, 5000])
def test_codecs_round_trip_within_their_bounds(n: int) -> None:
    values = torch.randn(n) * 10
    for compression, relative in ((Compression.NONE, 0.0), (Compression.FLOAT16, 2.0**-11)):
        codec = wire_codec(compression)
        payload = encode(values, codec)
        assert len(payload) == payload_size(codec, n)
        assert ((decode(payload, codec, n) - values).abs() <= values.abs() * relative).all()
    codec = wire_codec(Compression.UINT8)
    payload = encode(values, codec)
    assert len(payload) == payload_size(codec, n)
    assert n < 1024 or len(payload) < 1.01 * n  # a byte per value, plus 8 per block of 1024
    error = (decode(payload, codec, n) - values).abs().max().item()
    assert error <= (values.max() - values.min()).item() / 510 + 1e-5
    with pytest.raises(ValueError):
        decode(payload[:-1], codec, n)


def test_float16_saturates_instead_of_overflowing() -> None:
    values = torch.tensor([1e6, -1e6, 1.0])
    back = decode(encode(values, pb.CODEC_FLOAT16), pb.CODEC_FLOAT16, 3)
    assert torch.isfinite(back).all() and back[0] == 65504


# ---------------------------------------------------------------- load balancing (DeDLOC eq. 5, 6)

def test_equal_peers_get_equal_shares_at_the_bandwidth_bound() -> None:
    result = balance([Capacity(100 * MBIT, 100 * MBIT)] * 4, S)
    assert result.fractions == pytest.approx((0.25,) * 4)
    assert result.predicted_seconds == pytest.approx(2 * 3 / 4 * S / (100 * MBIT), rel=1e-6)


def test_slow_peers_reduce_nothing_and_the_ideal_is_reached() -> None:
    caps = [Capacity(200 * MBIT, 200 * MBIT)] * 2 + [Capacity(40 * MBIT, 40 * MBIT)] * 2
    result = balance(caps, S)
    assert result.fractions == pytest.approx((0.5, 0.5, 0.0, 0.0))
    ideal = max(2 * 3 * S / (480 * MBIT), S / (40 * MBIT))
    assert result.predicted_seconds == pytest.approx(ideal, rel=1e-6)  # 8.0 s


def test_roles_fix_the_shares() -> None:
    caps = [Capacity(100 * MBIT, 100 * MBIT)] * 3 + [Capacity(400 * MBIT, 400 * MBIT, sends=False)]
    result = balance(caps, S)
    assert result.fractions[3] == pytest.approx(1.0)  # an idle fast peer aggregates everything (setup D)
    assert result.contributes == (True, True, True, False)
    senders_only = [Capacity(100 * MBIT, 100 * MBIT, reduces=False)] * 2 + [Capacity(100 * MBIT, 100 * MBIT)] * 2
    result = balance(senders_only, S)
    assert result.fractions[:2] == (0.0, 0.0) and sum(result.fractions) == pytest.approx(1.0)
    assert equal_fractions(senders_only) == (0.0, 0.0, 0.5, 0.5)
    with pytest.raises(ValueError, match="no member may reduce"):
        balance([Capacity(reduces=False)] * 2, S)


def test_pairwise_limits_and_unknown_bandwidths() -> None:
    caps = [Capacity(100 * MBIT, 100 * MBIT)] * 3
    limits = [[0.0] * 3 for _ in range(3)]
    limits[0][1] = limits[1][0] = 5 * MBIT  # a slow path between 0 and 1
    limited = balance(caps, S, pair_limits=limits)
    assert limited.predicted_seconds > balance(caps, S).predicted_seconds
    unknown = balance([Capacity(), Capacity(), Capacity(100 * MBIT, 100 * MBIT)], S)
    assert unknown.fractions == pytest.approx((1 / 3,) * 3, abs=1e-6)


def test_every_member_computes_the_same_partition() -> None:
    """Same inputs, same answer: in this process, again, and in a fresh interpreter."""
    caps = [Capacity(u * MBIT, d * MBIT) for u, d in ((200, 180), (200, 180), (40, 50), (40, 30), (100, 100))]
    first = balance(caps, S).fractions
    assert balance(caps, S).fractions == first
    code = ("from averaging.load_balancing import Capacity, balance\n"
            f"caps = [Capacity(u * {MBIT!r}, d * {MBIT!r}) for u, d in ((200, 180), (200, 180), (40, 50), (40, 30), (100, 100))]\n"
            f"print(repr(balance(caps, {S}).fractions))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == repr(first)
    assert part_bounds(10**7, first) == part_bounds(10**7, eval(out.stdout))


# ---------------------------------------------------------------- reduction

def _spans(n_chunks: int, size: int = 4) -> list:
    regions = codec_regions([n_chunks * size], Compression.NONE, 0)
    return chunk_spans(0, n_chunks * size, size, regions)


def test_weighted_average_per_chunk_once_all_senders_delivered() -> None:
    red = PartReduction(_spans(2), senders=[0, 1, 2])
    for s, w in ((0, 1.0), (1, 2.0), (2, 0.0)):
        red.set_weight(s, w)
    assert red.add(0, 0, torch.full((4,), 1.0)) == []
    assert red.add(1, 0, torch.full((4,), 4.0)) == []
    (final,) = red.add(2, 0, torch.full((4,), 100.0))  # weight 0: delivered, not counted
    assert final.index == 0 and torch.allclose(final.values, torch.full((4,), 3.0))
    assert final.contributors == {0, 1}
    assert not red.done


def test_out_of_order_repeated_short_and_foreign_chunks_are_refused() -> None:
    red = PartReduction(_spans(3), senders=[0, 1])
    red.set_weight(0, 1.0)
    with pytest.raises(ChunkRejected, match="a gap"):
        red.add(0, 1, torch.zeros(4))
    red.add(0, 0, torch.zeros(4))
    with pytest.raises(ChunkRejected, match="a repeat"):
        red.add(0, 0, torch.zeros(4))
    with pytest.raises(ChunkRejected, match="3 values"):
        red.add(0, 1, torch.zeros(3))
    with pytest.raises(ChunkRejected, match="not a sender"):
        red.add(5, 0, torch.zeros(4))
    with pytest.raises(ChunkRejected, match="before its weight"):
        red.add(1, 0, torch.zeros(4))
    with pytest.raises(ChunkRejected, match="weight"):
        red.set_weight(1, float("nan"))


def test_a_dropped_sender_is_left_out_of_what_it_did_not_deliver() -> None:
    red = PartReduction(_spans(3), senders=[0, 1])
    red.set_weight(0, 1.0)
    red.set_weight(1, 1.0)
    red.add(1, 0, torch.full((4,), 2.0))
    (first,) = red.add(0, 0, torch.full((4,), 4.0))
    assert first.contributors == {0, 1} and torch.allclose(first.values, torch.full((4,), 3.0))
    red.add(0, 1, torch.full((4,), 4.0))
    finals = red.drop(1, "stalled")
    assert [f.index for f in finals] == [1]
    assert finals[0].contributors == {0} and torch.allclose(finals[0].values, torch.full((4,), 4.0))
    assert any("member 1 left out: stalled" in n for n in finals[0].notes)
    (last,) = red.add(0, 2, torch.full((4,), 4.0))
    assert last.contributors == {0} and red.done
    with pytest.raises(ChunkRejected, match="dropped"):
        red.add(1, 1, torch.zeros(4))


def test_non_finite_contributions_are_refused_and_named() -> None:
    red = PartReduction(_spans(1), senders=[0, 1])
    red.set_weight(0, 1.0)
    red.set_weight(1, 1.0)
    red.add(0, 0, torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    (final,) = red.add(1, 0, torch.full((4,), 5.0))
    assert final.contributors == {1} and torch.equal(final.values, torch.full((4,), 5.0))
    assert "member 0: non-finite values refused" in final.notes


def test_a_chunk_nobody_contributed_to_is_not_averaged() -> None:
    red = PartReduction(_spans(1), senders=[0])
    red.set_weight(0, 1.0)
    (final,) = red.drop(0, "gone")
    assert final.values is None and final.contributors == frozenset() and red.done
