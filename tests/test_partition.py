"""averaging/partition.py, exactly: schemas, flattening, part bounds and chunk spans (mutation-tested)."""

from __future__ import annotations

import math

import pytest
import torch

from averaging.compression import Region
from averaging.partition import Schema, SchemaMismatchError, chunk_spans, flatten, part_bounds, unflatten_into
from averaging.proto import averaging_pb2 as pb


def test_a_schema_is_the_dtypes_and_shapes_in_order_and_its_size() -> None:
    schema = Schema.of([torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64), torch.zeros(())])
    assert schema.shapes == ((2, 3), (4,), ())
    assert schema.dtypes == ("torch.float32", "torch.float64", "torch.float32")
    assert schema.numel == 11 and schema.sizes() == [6, 4, 1]


def test_what_cannot_be_averaged_is_refused_by_name() -> None:
    with pytest.raises(SchemaMismatchError, match="^nothing to average: no tensors given$"):
        Schema.of([])
    with pytest.raises(SchemaMismatchError, match="^tensor 1 is a list, not a torch.Tensor$"):
        Schema.of([torch.zeros(1), [1.0]])  # type: ignore[list-item]
    with pytest.raises(SchemaMismatchError, match="^tensor 0 is torch.int64; only floating-point tensors are averaged$"):
        Schema.of([torch.zeros(1, dtype=torch.int64)])


def test_the_fingerprint_differs_with_any_dtype_or_shape() -> None:
    base = Schema.of([torch.zeros(2, 3), torch.zeros(4)])
    assert len(base.fingerprint()) == 16 and base.fingerprint() == Schema.of([torch.ones(2, 3), torch.ones(4)]).fingerprint()
    others = [[torch.zeros(3, 2), torch.zeros(4)], [torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)],
              [torch.zeros(2, 3)], [torch.zeros(2, 3), torch.zeros(4), torch.zeros(1)]]
    prints = {Schema.of(t).fingerprint() for t in others} | {base.fingerprint()}
    assert len(prints) == 5


def test_check_names_the_first_difference() -> None:
    schema = Schema.of([torch.zeros(2, 3), torch.zeros(4)])
    schema.check([torch.ones(2, 3), torch.ones(4)])
    with pytest.raises(SchemaMismatchError, match=r"^got 1 tensors, the round expects 2$"):
        schema.check([torch.zeros(2, 3)])
    with pytest.raises(SchemaMismatchError, match=r"^tensor 1 is torch.float32\[5\], the round expects torch.float32\[4\]$"):
        schema.check([torch.zeros(2, 3), torch.zeros(5)])
    with pytest.raises(SchemaMismatchError,
                       match=r"^tensor 0 is torch.float64\[2, 3\], the round expects torch.float32\[2, 3\]$"):
        schema.check([torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4)])


def test_flatten_copies_into_one_float32_vector_and_unflatten_casts_back() -> None:
    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([0.5, 1.5], dtype=torch.float64)
    flat = flatten([a, b])
    assert flat.dtype == torch.float32 and flat.tolist() == [0, 1, 2, 3, 4, 5, 0.5, 1.5]
    out = torch.full((8,), -1.0)
    assert flatten([a, b], out) is out and out.tolist() == flat.tolist()
    flat.add_(1)
    assert a[0, 0] == 0  # the caller's tensors stay untouched
    x, y = torch.zeros(2, 3), torch.zeros(2, dtype=torch.float64)
    unflatten_into(flat, [x, y])
    assert x.tolist() == [[1, 2, 3], [4, 5, 6]] and y.dtype == torch.float64 and y.tolist() == [1.5, 2.5]


def test_part_bounds_split_by_the_fractions_and_add_up_exactly() -> None:
    assert part_bounds(10, [1, 1]) == [0, 5, 10]
    assert part_bounds(10, [1, 1, 1]) == [0, 3, 7, 10]  # equal shares differ by at most one
    assert part_bounds(10, [3, 1]) == [0, 8, 10]  # 7.5 rounds to 8 (even): only the sum is exact
    assert part_bounds(100, [0.25, 0.0, 0.75]) == [0, 25, 25, 100]  # a share of 0: an empty part
    assert part_bounds(7, [0.0, 1.0]) == [0, 0, 7]
    assert part_bounds(0, [1, 2]) == [0, 0, 0]
    bounds = part_bounds(1_000_003, [0.1] * 7)
    assert bounds[0] == 0 and bounds[-1] == 1_000_003 and all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:]))
    assert max(b2 - b1 for b1, b2 in zip(bounds, bounds[1:])) - min(b2 - b1 for b1, b2 in zip(bounds, bounds[1:])) <= 1


@pytest.mark.parametrize("fractions, message", [
    ([], "^no reducers$"),
    ([1.0, -0.1], r"^fractions must be finite and >= 0: \[1.0, -0.1\]$"),
    ([1.0, math.nan], r"^fractions must be finite and >= 0: \[1.0, nan\]$"),
    ([1.0, math.inf], r"^fractions must be finite and >= 0: \[1.0, inf\]$"),
    ([0.0, 0.0], "^every reducer has share 0$"),
])
def test_part_bounds_refuse_what_splits_nothing(fractions: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        part_bounds(10, fractions)


def test_chunks_never_cross_a_codec_region_and_are_at_most_the_chunk() -> None:
    raw, f16 = pb.CODEC_FLOAT32, pb.CODEC_FLOAT16
    regions = [Region(0, 10, raw), Region(10, 25, f16)]
    assert chunk_spans(3, 22, 4, regions) == [
        Region(3, 7, raw), Region(7, 10, raw), Region(10, 14, f16), Region(14, 18, f16), Region(18, 22, f16)]
    assert chunk_spans(0, 25, 100, regions) == [Region(0, 10, raw), Region(10, 25, f16)]
    assert chunk_spans(12, 12, 4, regions) == []
    assert chunk_spans(0, 1, 1, regions) == [Region(0, 1, raw)]
    with pytest.raises(ValueError, match="^chunk_elements must be positive$"):
        chunk_spans(0, 10, 0, regions)


def test_the_fingerprint_is_pinned_across_versions_and_a_malformed_schema_is_an_error() -> None:
    """Peers running different versions must agree on it: the sha256 of the dtypes and shapes as text."""
    import hashlib

    schema = Schema.of([torch.zeros(2, 3), torch.zeros(4)])
    assert schema.fingerprint() == hashlib.sha256(b"torch.float32[2, 3];torch.float32[4]").digest()[:16]
    broken = Schema(shapes=((1,), (2,)), dtypes=("torch.float32",))
    with pytest.raises(ValueError):
        broken.fingerprint()
    with pytest.raises(ValueError):
        broken.check([torch.zeros(1), torch.zeros(2)])


def test_unflatten_walks_every_tensor_in_turn() -> None:
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    unflatten_into(torch.arange(6.0), [a, b, c])
    assert a.tolist() == [0] and b.tolist() == [1, 2] and c.tolist() == [3, 4, 5]
