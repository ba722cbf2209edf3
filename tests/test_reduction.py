"""averaging/reduction.py, exactly: one part's chunks averaged over its senders (mutation-tested)."""

from __future__ import annotations

import math

import pytest
import torch

from averaging.compression import Region
from averaging.proto import averaging_pb2 as pb
from averaging.reduction import ChunkRejected, PartReduction
from averaging.robust import CenteredClipConfig

RAW = pb.CODEC_FLOAT32
SPANS = [Region(0, 2, RAW), Region(2, 6, RAW)]


def reduction(*senders: int, robust: CenteredClipConfig | None = None) -> PartReduction:
    return PartReduction(SPANS, senders, robust=robust)


@pytest.mark.parametrize("weight", [math.inf, math.nan, -1.0])
def test_a_weight_must_be_finite_and_not_negative(weight: float) -> None:
    r = reduction(0)
    with pytest.raises(ChunkRejected, match=f"^member 0 declared weight {weight}; it must be finite and >= 0$"):
        r.set_weight(0, weight)
    r.set_weight(0, 0.0)
    assert r.weights == {0: 0.0}
    with pytest.raises(ChunkRejected, match="^member 9 is not a sender of this part$"):
        r.set_weight(9, 1.0)


def test_each_broken_chunk_is_refused_saying_how() -> None:
    r = reduction(0, 1)
    with pytest.raises(ChunkRejected, match="^chunk 0 from member 9, which is not a sender of this part$"):
        r.add(9, 0, torch.zeros(2))
    with pytest.raises(ChunkRejected, match="^chunk 0 from member 0 before its weight$"):
        r.add(0, 0, torch.zeros(2))
    r.set_weight(0, 1.0)
    with pytest.raises(ChunkRejected, match=r"^member 0 sent chunk 1, expected chunk 0 \(a gap\)$"):
        r.add(0, 1, torch.zeros(4))
    with pytest.raises(ChunkRejected, match="^member 0 sent 3 values in chunk 1, expected 4$"):
        r.add(0, 0, torch.zeros(2))
        r.add(0, 1, torch.zeros(3))
    with pytest.raises(ChunkRejected, match=r"^member 0 sent chunk 0, expected chunk 1 \(a repeat\)$"):
        r.add(0, 0, torch.zeros(2))
    r.add(0, 1, torch.zeros(4))
    with pytest.raises(ChunkRejected, match="^member 0 sent chunk 2, the part has 2$"):
        r.add(0, 2, torch.zeros(1))
    r.drop(1, "it went away")
    with pytest.raises(ChunkRejected, match=r"^chunk 0 from member 1, which was dropped \(it went away\)$"):
        r.add(1, 0, torch.zeros(2))


def test_a_chunk_is_the_weighted_mean_and_a_weight_of_zero_is_in_it_with_nothing() -> None:
    r = reduction(0, 1, 2)
    for sender, weight in ((0, 1.0), (1, 3.0), (2, 0.0)):
        r.set_weight(sender, weight)
    assert r.add(0, 0, torch.tensor([1.0, 1.0])) == []
    assert r.add(2, 0, torch.tensor([100.0, 100.0])) == []
    (final,) = r.add(1, 0, torch.tensor([5.0, 9.0], dtype=torch.float64))
    assert final.index == 0 and final.values is not None and final.values.tolist() == [4.0, 7.0]
    assert final.values.dtype == torch.float32 and final.contributors == frozenset({0, 1, 2}) and final.notes == []
    assert not r.done


def test_non_finite_values_are_refused_and_noted_and_the_rest_averaged() -> None:
    r = reduction(0, 1)
    r.set_weight(0, 1.0)
    r.set_weight(1, 1.0)
    r.add(0, 0, torch.tensor([2.0, 4.0]))
    (final,) = r.add(1, 0, torch.tensor([math.nan, 0.0]))
    assert final.values is not None and final.values.tolist() == [2.0, 4.0]
    assert final.contributors == frozenset({0}) and final.notes == ["member 1: non-finite values refused"]


def test_a_dropped_sender_is_noted_from_its_next_chunk_and_those_chunks_settle() -> None:
    r = reduction(0, 1)
    r.set_weight(0, 2.0)
    r.set_weight(1, 2.0)
    r.add(1, 0, torch.tensor([1.0, 1.0]))
    assert r.add(0, 0, torch.tensor([3.0, 3.0]))[0].values.tolist() == [2.0, 2.0]  # type: ignore[union-attr]
    r.add(0, 1, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    finals = r.drop(1, "timed out")
    assert r.dropped == {1: "timed out"} and r.done
    assert [f.index for f in finals] == [1] and finals[0].notes == ["member 1 left out: timed out"]
    assert finals[0].values is not None and finals[0].values.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert finals[0].contributors == frozenset({0})
    assert r.drop(1, "again") == [] and r.drop(7, "never a sender") == []


def test_nobody_with_weight_means_no_average_even_robust() -> None:
    for robust in (None, CenteredClipConfig()):
        r = reduction(0, 1, robust=robust)
        r.set_weight(0, 0.0)
        r.set_weight(1, 0.0)
        r.add(0, 0, torch.ones(2))
        (final,) = r.add(1, 0, torch.ones(2))
        assert final.values is None and final.contributors == frozenset()


def test_robust_chunks_are_clipped_float32_and_the_clipped_sender_named() -> None:
    r = reduction(0, 1, 2, robust=CenteredClipConfig(tau=1.0, iterations=1, flag_below=0.5))
    for s in (0, 1, 2):
        r.set_weight(s, 1.0)
    r.add(0, 0, torch.tensor([0.0, 0.0], dtype=torch.float64))
    r.add(1, 0, torch.tensor([1.0, 0.0], dtype=torch.float64))
    (final,) = r.add(2, 0, torch.tensor([100.0, 0.0], dtype=torch.float64))
    assert final.values is not None and final.values.dtype == torch.float32
    assert torch.allclose(final.values, torch.tensor([1.0, 0.0]))  # CenteredClip's center, not the mean 33.7
    assert final.notes == ["member 2 clipped x0.0101"] and final.contributors == frozenset({0, 1, 2})


def test_a_sender_that_leaves_after_a_chunk_is_in_that_chunk_and_noted_only_after_it() -> None:
    r = reduction(0, 1)
    r.set_weight(0, 1.0)
    r.set_weight(1, 1.0)
    r.add(1, 0, torch.tensor([4.0, 4.0]))  # chunk 0 from member 1; member 0's is still to come
    assert r.drop(1, "gone") == []  # chunk 0 waits for member 0; chunk 1 waits for member 0 too
    (first,) = r.add(0, 0, torch.tensor([2.0, 2.0]))
    assert first.notes == [] and first.contributors == frozenset({0, 1}) and first.values.tolist() == [3.0, 3.0]  # type: ignore[union-attr]
    (second,) = r.add(0, 1, torch.ones(4))
    assert second.notes == ["member 1 left out: gone"] and second.contributors == frozenset({0})


def test_values_are_copied_as_float32_whatever_the_caller_does_with_them_after() -> None:
    for robust in (None, CenteredClipConfig()):
        r = reduction(0, 1, robust=robust)
        r.set_weight(0, 1.0)
        r.set_weight(1, 1.0)
        mine = torch.tensor([1.0, 1.0])
        r.add(0, 0, torch.tensor([3.0, 3.0], dtype=torch.float64) if robust is None else mine)
        mine.fill_(1000.0)  # the caller reuses its buffer before the chunk is final
        (final,) = r.add(1, 0, torch.tensor([1.0, 1.0]))
        assert final.values is not None and final.values.dtype == torch.float32
        assert final.values.tolist() == ([2.0, 2.0] if robust is None else [1.0, 1.0])
