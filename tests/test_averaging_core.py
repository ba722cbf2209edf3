"""The averaging layer's pure parts: partition, codecs, the reduction state machine (the LP: test_load_balancing;
Moshpit's grid: test_moshpit)."""

from __future__ import annotations

import pytest
import torch

from averaging.compression import (
    UINT8_BLOCK,
    Compression,
    Region,
    codec_regions,
    decode,
    encode,
    encode_tensor,
    payload_size,
    wire_codec,
)
from averaging.partition import Schema, SchemaMismatchError, chunk_spans, flatten, part_bounds, unflatten_into
from averaging.proto import averaging_pb2 as pb
from averaging.reduction import ChunkRejected, PartReduction


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
    values = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 10
    # float16: half an ulp relative, and half its subnormal spacing (2**-25) near zero, where the
    # relative bound does not hold (unseeded, a value below 6e-5 failed it in ~4% of runs of n=5000)
    for compression, relative, absolute in ((Compression.NONE, 0.0, 0.0), (Compression.FLOAT16, 2.0**-11, 2.0**-25)):
        codec = wire_codec(compression)
        payload = encode(values, codec)
        assert len(payload) == payload_size(codec, n)
        assert ((decode(payload, codec, n) - values).abs() <= values.abs() * relative + absolute).all()
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


def test_codec_regions_merge_neighbours_of_one_codec_and_compress_from_min_elements_on() -> None:
    regions = codec_regions([1000, 3000, 0, 10, 999, 1000, 2000], Compression.UINT8, min_elements=1000)
    assert regions == [Region(0, 4000, pb.CODEC_UINT8), Region(4000, 5009, pb.CODEC_FLOAT32),
                       Region(5009, 8009, pb.CODEC_UINT8)]
    assert codec_regions([5, 0, 7], Compression.NONE, 0) == [Region(0, 12, pb.CODEC_FLOAT32)]
    assert codec_regions([0, 0], Compression.FLOAT16, 0) == []


def test_an_unknown_codec_or_a_payload_of_the_wrong_size_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="^unknown codec 99$"):
        payload_size(99, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^unknown codec 99$"):
        encode(torch.zeros(4), 99)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^unknown codec 99$"):
        decode(b"", 99, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"^payload of 7 bytes for 2 values of codec {pb.CODEC_FLOAT32}$"):
        decode(b"\0" * 7, pb.CODEC_FLOAT32, 2)


@pytest.mark.parametrize("codec", [pb.CODEC_FLOAT32, pb.CODEC_FLOAT16, pb.CODEC_UINT8])
def test_a_chunk_is_encoded_on_its_own_device(codec: pb.Codec.ValueType) -> None:
    """On a GPU the codec runs there and only the encoded bytes cross the bus (the meta device stands in
    for one: not the host)."""
    n = 3 * 32 * 1024 + 5
    payload = encode_tensor(torch.empty(n, device="meta"), codec)
    assert payload.device.type == "meta" and payload.dtype == torch.uint8 and payload.numel() == payload_size(codec, n)


def test_a_short_last_block_is_coded_within_its_own_range() -> None:
    """Padding the last block with zeros would widen its range to 0 and its error with it."""
    values = 100.0 + torch.rand(UINT8_BLOCK + 10, generator=torch.Generator().manual_seed(1))
    back = decode(encode(values, pb.CODEC_UINT8), pb.CODEC_UINT8, values.numel())
    last = values[UINT8_BLOCK:]
    assert (back[UINT8_BLOCK:] - last).abs().max() <= (last.max() - last.min()) / 510 + 1e-5


def test_a_constant_block_goes_on_the_wire_with_scale_one_and_comes_back_exact() -> None:
    values = torch.cat([torch.full((UINT8_BLOCK,), 3.5), torch.linspace(-1.0, 1.0, 10)])
    payload = encode(values, pb.CODEC_UINT8)
    heads = torch.frombuffer(bytearray(payload[:16]), dtype=torch.float32).view(2, 2)
    assert heads[0].tolist() == [3.5, 1.0] and heads[1].tolist() == pytest.approx([-1.0, 2.0 / 255])
    assert torch.equal(decode(payload, pb.CODEC_UINT8, values.numel())[:UINT8_BLOCK], values[:UINT8_BLOCK])


@pytest.mark.parametrize("codec", [pb.CODEC_FLOAT32, pb.CODEC_FLOAT16, pb.CODEC_UINT8])
def test_decoded_chunks_are_float32_whatever_torch_s_default_dtype(codec: pb.Codec.ValueType) -> None:
    values = torch.randn(2 * 32 * 1024 + 3, generator=torch.Generator().manual_seed(2))
    payload = bytearray(encode(values, codec))
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert decode(payload, codec, values.numel()).dtype == torch.float32
        assert decode(b"", codec, 0).dtype == torch.float32
    finally:
        torch.set_default_dtype(before)


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
    (final,) = red.add(2, 0, torch.full((4,), 100.0))  # weight 0: delivered, adds nothing, not left out
    assert final.index == 0 and torch.allclose(final.values, torch.full((4,), 3.0))
    assert final.contributors == {0, 1, 2}
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


# ---------------------------------------------------------------- matchmaking

def test_the_leader_is_a_reachable_reducer_before_a_sender_behind_a_nat() -> None:
    """A symmetric-NAT peer lists its LAN address too; its role, not its addresses, keeps it from
    leading (every join would cross the relay)."""
    from libp2p.peer.id import ID
    from multiaddr import Multiaddr

    from averaging.group import Member, Role
    from averaging.formation import leader_rank

    relay = "/ip4/11.0.1.2/tcp/4001/p2p/12D3KooWFSzsWFHfEVcD7T9fEWyayVQpcmkjNKbNTyyRntvjGfju/p2p-circuit"
    low, mid, high = (ID(bytes([0, 36, 8, 1, 18, 32]) + bytes([k]) * 32) for k in (1, 2, 3))
    behind_nat = Member(low, (Multiaddr("/ip4/192.168.1.2/tcp/4001"), Multiaddr(relay)), Role.SENDER, b"s",
                        accepts_joins=True)
    relayed_only = Member(low, (Multiaddr(relay),), Role.FULL, b"s", accepts_joins=True)
    public = Member(high, (Multiaddr("/ip4/11.0.2.2/tcp/4001"),), Role.FULL, b"s", accepts_joins=True)
    other_public = Member(mid, (Multiaddr("/ip4/11.0.3.2/tcp/4001"),), Role.FULL, b"s", accepts_joins=True)
    ranked = sorted([behind_nat, relayed_only, public, other_public], key=leader_rank)
    assert ranked == [other_public, public, behind_nat, relayed_only]


# ---------------------------------------------------------------- the fast data path (issue 32)


def test_finite_checks_catch_nan_and_inf_and_survive_an_overflowing_sum() -> None:
    from averaging.finite import all_finite, tensor_finite

    x = torch.randn(100_000)
    assert tensor_finite(x) and all_finite([x, x[:10], torch.empty(0)])
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[54_321] = bad
        assert not tensor_finite(y) and not all_finite([x, y])
    huge = torch.full((1000,), 3e38)  # the sum overflows, every value is finite: the exact check decides
    assert tensor_finite(huge) and all_finite([huge, x])
    big = torch.full((10,), 1e20)  # all_finite's norm overflows where a sum would not: the exact check decides
    assert all_finite([big]) and not all_finite([big, torch.tensor([1e20, float("nan")])])
    # float64 beside float32 and float16 (its norm is taken in float64: a norm may not narrow its input)
    wide = torch.full((10,), 1e200, dtype=torch.float64)
    assert all_finite([wide, x, x.half()]) and not all_finite([x, torch.tensor([1.0, float("inf")], dtype=torch.float64)])
    half = torch.full((100,), 60000.0, dtype=torch.float16)
    assert tensor_finite(half)
    assert tensor_finite(torch.arange(10))  # integers are never non-finite


def test_chunks_follow_the_slowest_declared_link() -> None:
    from averaging.allreduce import AllreduceConfig, chunk_elements_for

    c = AllreduceConfig()
    mbit = 1e6 / 8
    assert chunk_elements_for([], 10**8, c) == 32 * 1024  # nothing known: the small safe chunk
    assert chunk_elements_for([0.0, 0.0], 10**8, c) == 32 * 1024
    assert chunk_elements_for([100 * mbit] * 4, 10**8, c) == 32 * 1024  # 100 Mbit: 128 KiB, as tuned
    assert chunk_elements_for([1000 * mbit, 100 * mbit], 10**8, c) == 32 * 1024  # the slowest decides
    assert chunk_elements_for([1000 * mbit] * 4, 10**8, c) == 256 * 1024  # 1 Gbit: 1 MiB
    assert chunk_elements_for([1e10] * 4, 10**8, c) == 1024 * 1024  # capped at 4 MiB
    assert chunk_elements_for([1e10] * 4, 2_500_000, c) == 256 * 1024  # and at an eighth of a part
    assert chunk_elements_for([1e10] * 4, 1000, c) == 32 * 1024  # never below the minimum
    assert chunk_elements_for([float("inf"), 1000 * mbit], 10**8, c) == 256 * 1024
    assert chunk_elements_for([0.0, -5.0, 1e10], 10**8, c) == 1024 * 1024  # unknown (or nonsense) rates drag nothing
    assert chunk_elements_for([1.0, 1e10], 10**8, c) == 32 * 1024  # one byte a second is known, and slow
    assert chunk_elements_for([1e10], 8 * 64 * 1024, c) == 64 * 1024  # an eighth of the part exactly
    assert chunk_elements_for([1e10], 8 * 64 * 1024 - 1, c) == 32 * 1024


def test_float32_payloads_are_views_not_copies() -> None:
    values = torch.randn(4096)
    payload = encode(values, pb.CODEC_FLOAT32)
    values[0] = 42.0
    assert torch.frombuffer(bytearray(payload), dtype=torch.float32)[0] == 42.0  # the view sees the tensor
    buffer = bytearray(payload)
    decoded = decode(memoryview(buffer), pb.CODEC_FLOAT32, 4096)
    buffer[:4] = torch.tensor([7.0]).numpy().tobytes()
    assert decoded[0] == 7.0  # decoded in place from a writable buffer
    assert decode(bytes(payload), pb.CODEC_FLOAT32, 4096)[0] == 42.0  # read-only bytes are copied
    for codec in (pb.CODEC_FLOAT16, pb.CODEC_UINT8):
        assert len(encode(values, codec)) == payload_size(codec, 4096)
    assert decode(b"", pb.CODEC_FLOAT32, 0).numel() == 0


def test_flatten_into_a_kept_buffer_and_back() -> None:
    tensors = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.randn(2, dtype=torch.bfloat16)]
    fresh = flatten(tensors)
    buffer = torch.full((fresh.numel(),), float("nan"))
    assert flatten(tensors, buffer) is buffer
    assert torch.equal(buffer, fresh)


def test_buffer_pool_lends_the_front_of_the_smallest_buffer_that_fits() -> None:
    from averaging.staging import BufferPool

    pool = BufferPool(keep=2)
    a = pool.take("host", torch.float32, 1000)
    assert a.numel() == 1000
    pool.give("host", a)
    b = pool.take("host", torch.float32, 600)  # the same memory, its front
    assert b.numel() == 600 and b.data_ptr() == a.data_ptr()
    c = pool.take("host", torch.float32, 600)  # b is lent: another buffer
    assert c.data_ptr() != b.data_ptr()
    pool.give("host", b)
    pool.give("host", c)
    assert pool.take("host", torch.float32, 700).data_ptr() == b.data_ptr()  # only b's 1000 fit
    assert pool.take("host", torch.float32, 500).data_ptr() == c.data_ptr()
    assert pool.take("host", torch.uint8, 10).dtype == torch.uint8  # kept apart by dtype
    big = [pool.take("host", torch.float32, n) for n in (10, 20, 30)]
    for t in big:
        pool.give("host", t)
    assert sorted(t.numel() for t in pool._free[("host", torch.float32)]) == [20, 30]  # the largest `keep`


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_vector_stages_a_gpu_through_page_locked_memory() -> None:
    import trio

    from averaging.compression import Region
    from averaging.staging import BufferPool, DeviceVector

    tensors = [torch.randn(5000, device="cuda"), torch.randn(3, 7, device="cuda")]
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    spans = [Region(0, 3000, pb.CODEC_FLOAT32), Region(3000, 5000, pb.CODEC_FLOAT16),
             Region(5000, 5021, pb.CODEC_FLOAT32)]

    async def main() -> None:
        vector = DeviceVector(tensors, [spans], BufferPool())  # one part
        assert vector._out.is_pinned() and vector._back.is_pinned()
        assert bytes(await vector.payload(spans[0])) == flat[:3000].numpy().tobytes()
        assert torch.allclose(await vector.own(spans[1]), flat[3000:5000], atol=1e-2)
        vector.write(spans[0], torch.zeros(3000))
        await vector.finish()
        assert bool((vector.result[:3000] == 0).all()) and torch.equal(vector.result[3000:].cpu(), flat[3000:])

    trio.run(main)


def test_a_chunk_whose_senders_all_weigh_nothing_has_no_average() -> None:
    red = PartReduction(_spans(1), senders=[0, 1])
    red.set_weight(0, 0.0)
    red.set_weight(1, 0.0)
    red.add(0, 0, torch.ones(4))
    (final,) = red.add(1, 0, torch.ones(4))
    assert final.values is None and final.contributors == frozenset()
