"""averaging.allreduce, one round on its own: rounds over the in-memory swarm of tests/fake_swarm.py
(no matchmaking, no averager), and the test itself as the other end of a stream where a peer must
misbehave: a reducer that answers garbage, stalls or never answers, a sender that cuts the vector
otherwise, stalls, repeats itself or never comes. What each member's report says of it, down to the
words. Whole averaging runs over real sockets are tests/test_averaging.py's; the reduction rules,
tests/test_averaging_core.py's."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import torch
import trio
from libp2p.abc import INetStream
from multiaddr import Multiaddr

from averaging import allreduce
from averaging.allreduce import (PROTOCOL, AllreduceConfig, AllreduceRound, PartOutcome, RoundPlan, RoundReport,
                                 _Counter, _describe, _innermost, _write_chunk, check_weight)
from averaging.errors import AllreduceProtocolError
from averaging.group import Group, Member, Role, contributors_bits
from averaging.load_balancing import equal_fractions
from averaging.partition import Schema
from averaging.proto import averaging_pb2 as pb
from averaging.robust import CenteredClipConfig
from averaging.staging import BufferPool, HostVector
from averaging.tensor_stream import JOIN_LIMIT
from averaging.wire import FrameReader, frame
from p2p.errors import ConfigError, StreamBrokenError

from .fake_swarm import FakeSwarm, fake_swarms
from .kit import all_at_once, numbered_peer_id, wait_until

pytestmark = pytest.mark.timeout(60)

ADDR = Multiaddr("/ip4/81.2.69.7/tcp/4001")
GROUP_ID = b"round one"
F32 = pb.CODEC_FLOAT32
#: 32 values in chunks of 8: with two members, a part of 16 values and two chunks each
NUMEL = 32


def config(**kw: float) -> AllreduceConfig:
    settings: dict[str, float] = {"chunk_elements": 8, "stall_timeout": 1.0, "timeout": 10.0}
    settings.update(kw)
    return AllreduceConfig(**settings)  # type: ignore[arg-type]


def group_of(swarms: Sequence[FakeSwarm], me: int, roles: Sequence[Role] = ()) -> Group:
    return Group(GROUP_ID, tuple(Member(s.peer_id, (ADDR,), roles[i] if roles else Role.FULL, b"s")
                                 for i, s in enumerate(swarms)), me)


def plan_of(group: Group, cfg: AllreduceConfig, numel: int = NUMEL) -> tuple[RoundPlan, tuple[float, ...]]:
    fractions = equal_fractions([m.capacity for m in group.members])
    return RoundPlan.make(Schema.of([torch.zeros(numel)]), fractions, cfg, group), fractions


def round_for(swarms: Sequence[FakeSwarm], me: int, values: torch.Tensor | None, weight: float = 1.0, *,
              cfg: AllreduceConfig | None = None, roles: Sequence[Role] = (),
              pool: BufferPool | None = None) -> AllreduceRound:
    cfg = cfg or config()
    group = group_of(swarms, me, roles)
    plan, fractions = plan_of(group, cfg, NUMEL if values is None else values.numel())
    vector = None if values is None else HostVector([values], pool or BufferPool())
    return AllreduceRound(swarms[me], group, plan, vector, weight, cfg, fractions, pool)


def serve(swarm: FakeSwarm, round_: AllreduceRound, refused: list[str] | None = None) -> None:
    """``round_`` serves the senders' streams to ``swarm``, as the averager's handler does."""

    async def handler(stream: INetStream) -> None:
        reader = FrameReader(stream)
        header = await reader.message(pb.PartHeader, "part header")
        sender = round_.group.index_of(stream.muxed_conn.peer_id)
        assert sender is not None and bytes(header.group_id) == GROUP_ID
        try:
            await round_.serve(stream, reader, sender, header)
        except AllreduceProtocolError as e:
            if refused is not None:
                refused.append(str(e))
            await stream.reset()

    swarm.set_stream_handler(PROTOCOL, handler)


async def run_all(rounds: Sequence[AllreduceRound]) -> list[RoundReport]:
    """Each round's report, all run at once."""
    return [r for r in await all_at_once([r.run for r in rounds]) if isinstance(r, RoundReport)]


def vector_values(round_: AllreduceRound) -> torch.Tensor:
    assert isinstance(round_.values, HostVector)
    return round_.values.result


def chunk_frame(index: int, values: torch.Tensor | None, contributors: Sequence[int] = (), size: int = 2, *,
                note: str = "", nbytes: int | None = None, codec: int = F32) -> bytes:
    payload = b"" if values is None else values.to(torch.float32).numpy().tobytes()
    head = pb.ChunkHeader(index=index, codec=codec, nbytes=len(payload) if nbytes is None else nbytes,  # type: ignore[arg-type]
                          contributors=contributors_bits(list(contributors), size) if size else b"", note=note)
    return frame(head) + payload


async def read_chunk(reader: FrameReader) -> tuple[pb.ChunkHeader, torch.Tensor]:
    head = await reader.message(pb.ChunkHeader, "chunk header")
    payload = await reader.exactly(head.nbytes)
    return head, torch.frombuffer(bytearray(payload), dtype=torch.float32) if payload else torch.zeros(0)


# ---------------------------------------------------------------------- settings and the pure parts


def test_the_settings_their_defaults_and_bounds() -> None:
    d = AllreduceConfig()
    assert (d.chunk_elements, d.chunk_seconds, d.min_chunk_elements, d.max_chunk_elements, d.min_compress_elements,
            d.stall_timeout, d.timeout, d.max_chunks_ahead, d.robust) == \
        (None, 0.01, 32 * 1024, 1024 * 1024, 16 * 1024, 15.0, 120.0, 4, None)
    d.validate()
    for edge in ({"chunk_elements": 1 << 24}, {"chunk_elements": 1}, {"max_chunks_ahead": 1},
                 {"min_chunk_elements": 64, "max_chunk_elements": 64}, {"stall_timeout": 0.5, "timeout": 0.5}):
        AllreduceConfig(**edge).validate()
    bad: list[tuple[dict[str, object], str]] = [
        ({"max_chunks_ahead": 0}, "max_chunks_ahead must be at least 1"),
        ({"min_chunk_elements": 65, "max_chunk_elements": 64}, "min_chunk_elements must not exceed max_chunk_elements"),
        ({"chunk_seconds": 0.0}, "chunk_seconds must be positive"),
        ({"stall_timeout": 0.0}, "timeouts must be positive"),
        ({"timeout": 0.0}, "timeouts must be positive"),
        ({"robust": CenteredClipConfig(iterations=0)}, "iterations must be in 1 .. 1000, got 0"),
    ]
    for name in ("chunk_elements", "min_chunk_elements", "max_chunk_elements"):
        bad += [({name: 0}, f"{name} must be in 1 .. 16 Mi"), ({name: (1 << 24) + 1}, f"{name} must be in 1 .. 16 Mi")]
    for settings, why in bad:
        with pytest.raises(ConfigError, match=f"^{why}$"):
            AllreduceConfig(**settings).validate()  # type: ignore[arg-type]


def test_a_weight_must_be_finite_and_not_negative() -> None:
    check_weight(0.0)
    check_weight(2.5)
    for weight in (-0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match=rf"^weight must be finite and >= 0, not {weight}$"):
            check_weight(weight)


async def test_a_round_refuses_a_sender_without_values_or_a_bad_weight(autojump_clock: trio.abc.Clock) -> None:
    async with fake_swarms(2) as swarms:
        with pytest.raises(ValueError, match="^a sending member needs values$"):
            round_for(swarms, 0, None)
        with pytest.raises(ValueError, match="^weight must be finite and >= 0, not -1.0$"):
            round_for(swarms, 0, torch.zeros(NUMEL), -1.0)
        auxiliary = round_for(swarms, 0, None, roles=[Role.AUXILIARY, Role.FULL])  # reduces only: no values
        assert list(auxiliary.outcomes) == [0]


def test_the_innermost_error_is_the_one_named() -> None:
    error = ValueError("bad chunk")
    nested = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [error, KeyError("x")]), OSError()])
    assert _innermost(nested) is error and _innermost(error) is error
    assert _describe(nested) == "ValueError: bad chunk"


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))


@pytest.mark.parametrize("size, writes", [(0, 1), (JOIN_LIMIT - 1, 1), (JOIN_LIMIT, 2)])
async def test_a_chunk_goes_in_one_write_when_small_and_without_a_copy_when_large(size: int, writes: int) -> None:
    stream = Recorder()
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    await _write_chunk(stream, b"head", memoryview(payload))  # type: ignore[arg-type]
    assert len(stream.writes) == writes and b"".join(stream.writes) == b"head" + payload
    if writes == 2:
        assert stream.writes[0] == b"head"


async def test_the_counter_wakes_its_waiter_only_when_far_enough() -> None:
    counter = _Counter()
    await counter.wait_for(0)  # at once
    woken: list[int] = []

    async def waiter() -> None:
        await counter.wait_for(2)
        woken.append(counter.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        counter.advance(1)
        await trio.testing.wait_all_tasks_blocked()
        assert woken == []
        counter.advance(3)
    assert woken == [3]


def part(index: int, *, chunks: int = 2, averaged: int = 2, partial: int = 0, sent: int = 0, received: int = 0,
         left_out: dict[str, str] | None = None, not_averaged: str = "", clipped: dict[str, float] | None = None,
         ) -> PartOutcome:
    return PartOutcome(index, numbered_peer_id(index), 16, chunks, averaged_chunks=averaged, partial_chunks=partial,
                       bytes_sent=sent, bytes_received=received, left_out=left_out or {}, not_averaged=not_averaged,
                       clipped=clipped or {})


def test_the_plan_sizes_chunks_to_the_slowest_declared_link_unless_told() -> None:
    """Chunks of ``chunk_seconds`` on the slowest link (the lesser of a member's upload and download), at
    most an eighth of the largest part, at least the minimum; the minimum when no group is given."""
    cfg = AllreduceConfig(min_chunk_elements=8, max_chunk_elements=64)
    schema, fractions = Schema.of([torch.zeros(256)]), (0.75, 0.25)  # parts of 192 and 64

    def group(download: float) -> Group:
        return Group(GROUP_ID, (Member(numbered_peer_id(1), (), Role.FULL, b"s", 1e10, 1e10),
                                Member(numbered_peer_id(2), (), Role.FULL, b"s", 1e10, download)), 0)

    fast = RoundPlan.make(schema, fractions, cfg, group(1e10))
    assert (fast.bounds, fast.chunk_elements) == ((0, 192, 256), 16)  # 192 / 8 = 24: 16
    assert [len(spans) for spans in fast.spans] == [12, 4]
    assert RoundPlan.make(schema, fractions, cfg, group(1600.0)).chunk_elements == 8  # 1600 B/s x 10 ms / 4 = 4
    assert RoundPlan.make(schema, fractions, cfg, group(6400.0)).chunk_elements == 16
    assert RoundPlan.make(schema, fractions, cfg).chunk_elements == 8  # no group: nothing known
    assert RoundPlan.make(schema, fractions, replace(cfg, chunk_elements=4), group(1e10)).chunk_elements == 4


def test_a_report_adds_up_its_parts_and_says_what_was_partial() -> None:
    members = [numbered_peer_id(i) for i in range(3)]
    whole = RoundReport(GROUP_ID, members, 0, (0.5, 0.5, 0.0), [part(0, sent=10, received=20), part(1, sent=1, received=2)])
    assert whole.complete and (whole.bytes_sent, whole.bytes_received) == (11, 22)
    assert whole.left_out == {} and whole.clipped == {}
    assert whole.summary() == "group of 3: every part averaged over every sender"
    assert not part(0, averaged=1).complete and not part(0, partial=1).complete and part(0).complete
    clipped = RoundReport(GROUP_ID, members, 0, (0.5, 0.5), [part(0, clipped={"a": 0.5, "b": 0.9}),
                                                             part(1, clipped={"a": 0.25, "c": 1.5})])
    assert clipped.clipped == {"a": 0.25, "b": 0.9, "c": 1.0}  # the least factor; never more than 1
    assert clipped.summary() == ("group of 3: every part averaged over every sender; "
                                 "clipped by robust aggregation: a x0.25, b x0.9, c x1")
    partial = RoundReport(GROUP_ID, members, 0, (0.5, 0.5), [
        part(0, partial=2, left_out={"x": "member 1 left out: gone", "y": "left out"}),
        part(1, averaged=0, not_averaged="could not reach the reducer: DialError: no route"),
        part(2, partial=1), part(3)])
    assert not partial.complete
    assert partial.left_out == {"x": "member 1 left out: gone", "y": "left out"}
    assert partial.summary() == (
        f"group of 3: partial average: part 0 ({members[0]}): 2 chunks without x, y; "
        f"part 1 ({members[1]}): could not reach the reducer: DialError: no route; "
        f"part 2 ({members[2]}): 1 chunks without some senders")


# ---------------------------------------------------------------------- whole rounds


async def test_three_members_average_exactly_and_report_every_byte(autojump_clock: trio.abc.Clock) -> None:
    """Weights 1, 2 and 0 (a trainer with no samples yet is in the average with nothing to add)."""
    torch.manual_seed(3)
    data = [torch.randn(30) for _ in range(3)]
    weights = [1.0, 2.0, 0.0]
    exact = (data[0] + 2 * data[1]) / 3
    pool = BufferPool()
    async with fake_swarms(3) as swarms:
        rounds = [round_for(swarms, i, data[i].clone(), weights[i], pool=pool) for i in range(3)]
        for s, r in zip(swarms, rounds):
            serve(s, r)
        reports = await run_all(rounds)
    plan = rounds[0].plan
    assert plan.bounds == (0, 10, 20, 30) and [len(s) for s in plan.spans] == [2, 2, 2]
    for i, (r, report) in enumerate(zip(rounds, reports)):
        assert torch.allclose(vector_values(r), exact, atol=1e-6)
        assert report.complete and report.notes == [] and 0 < report.elapsed < 5
        assert (report.group_id, report.members, report.my_index, report.fractions) == \
            (GROUP_ID, [s.peer_id for s in swarms], i, (1 / 3, 1 / 3, 1 / 3))
        assert [(p.part, p.reducer, p.elements, p.chunks, p.averaged_chunks, p.partial_chunks) for p in report.parts] == \
            [(j, swarms[j].peer_id, 10, 2, 2, 0) for j in range(3)]
        for p in report.parts:
            if p.part == i:  # its own part never went on the wire
                assert (p.bytes_sent, p.bytes_received) == (0, 0)
                continue
            chunks = [len(frame(pb.ChunkHeader(index=k, codec=F32, nbytes=n * 4))) + n * 4 for k, n in enumerate((8, 2))]
            assert p.bytes_sent == sum(chunks)  # the chunks' headers and payloads (not the part's header)
            back = [len(frame(pb.ChunkHeader(index=k, codec=F32, nbytes=n * 4, contributors=b"\x07"))) + n * 4
                    for k, n in enumerate((8, 2))]
            assert p.bytes_received == sum(back)
        # one clock per stream each way (two sends and their answers, two senders served and answered),
        # each counting what followed its first payload (the last chunk, 2 values): the wait before it is no link's
        assert (len(r.upload), len(r.download)) == (4, 4)
        assert [c.bytes for c in r.upload] == [c.bytes for c in r.download] == [2 * 4] * 4
    assert pool._lent == {} or all(base.numel() == NUMEL - 2 for _, base in pool._lent.values())  # only the vectors lent


async def test_a_sender_sends_and_an_auxiliary_reduces_without_values(autojump_clock: trio.abc.Clock) -> None:
    torch.manual_seed(4)
    data = [torch.randn(NUMEL), torch.randn(NUMEL)]
    roles = [Role.FULL, Role.SENDER, Role.AUXILIARY]
    async with fake_swarms(3) as swarms:
        rounds = [round_for(swarms, 0, data[0].clone(), 3.0, roles=roles),
                  round_for(swarms, 1, data[1].clone(), 1.0, roles=roles),
                  round_for(swarms, 2, None, 5.0, roles=roles)]
        for s, r in zip(swarms, rounds):
            serve(s, r)
        reports = await run_all(rounds)
    assert rounds[0].plan.bounds == (0, 16, 16, 32)  # the sender reduces nothing
    exact = (3 * data[0] + data[1]) / 4
    for r in rounds[:2]:
        assert torch.allclose(vector_values(r), exact, atol=1e-6)
    assert [p.part for p in reports[0].parts] == [0, 2] and [p.part for p in reports[1].parts] == [0, 2]
    assert [p.part for p in reports[2].parts] == [2] and reports[2].parts[0].bytes_sent == 0
    assert all(r.complete for r in reports) and rounds[1].reduction is None


async def test_a_round_of_weightless_senders_averages_nothing_and_says_so(autojump_clock: trio.abc.Clock) -> None:
    data = [torch.arange(NUMEL, dtype=torch.float32) + 100 * i for i in range(2)]
    async with fake_swarms(2) as swarms:
        rounds = [round_for(swarms, i, data[i].clone(), 0.0) for i in range(2)]
        for s, r in zip(swarms, rounds):
            serve(s, r)
        reports = await run_all(rounds)
    ids = [s.peer_id.to_base58() for s in swarms]
    for r, report, values in zip(rounds, reports, data):
        assert torch.equal(vector_values(r), values)  # no weight, no average: each keeps its own
        for p in report.parts:
            assert (p.averaged_chunks, p.returned_chunks, p.partial_chunks) == (0, 2, 2)
            assert p.not_averaged == "2 chunks came back without an average (no sender's values reached it)"
            assert p.left_out == {ids[0]: "left out", ids[1]: "left out"}


async def test_a_member_whose_part_is_empty_reduces_nothing_and_nobody_waits_for_it(
        autojump_clock: trio.abc.Clock) -> None:
    data = [torch.tensor([1.0, 2.0]) * (i + 1) for i in range(3)]  # two values among three members
    async with fake_swarms(3) as swarms:
        rounds = [round_for(swarms, i, data[i].clone(), cfg=config(stall_timeout=5.0)) for i in range(3)]
        for s, r in zip(swarms, rounds):
            serve(s, r)
        start = trio.current_time()
        reports = await run_all(rounds)
        assert trio.current_time() - start < 1.0  # not the 5 s an expected sender is waited for
    (empty,) = [j for j, spans in enumerate(rounds[0].plan.spans) if not spans]
    assert rounds[empty].reduction is None and all(r.complete for r in reports)
    assert all(torch.allclose(vector_values(r), torch.tensor([2.0, 4.0])) for r in rounds)


async def test_receive_buffers_are_the_largest_chunk_and_go_back_to_the_pool(autojump_clock: trio.abc.Clock) -> None:
    """Each round takes one buffer per stream (here one each way) from the averager's pool, as large as
    the largest chunk's payload, and gives it back: a second round reuses them."""
    pools = [BufferPool(), BufferPool()]
    async with fake_swarms(2) as swarms:
        for _ in range(2):
            rounds = [round_for(swarms, i, torch.randn(28), pool=pools[i]) for i in range(2)]  # chunks of 8 and 6
            for s, r in zip(swarms, rounds):
                serve(s, r)
            assert all(r.complete for r in await run_all(rounds))
            for pool in pools:
                assert sorted(b.numel() for b in pool._free[("host", torch.uint8)]) == [32, 32]


# ---------------------------------------------------------------------- a reducer that misbehaves


Script = Callable[[INetStream, FrameReader], Awaitable[None]]


@asynccontextmanager
async def against_a_reducer(script: Script | None, *, cfg: AllreduceConfig | None = None,
                            values: torch.Tensor | None = None, roles: Sequence[Role] = (),
                            ) -> AsyncIterator[tuple[AllreduceRound, list[pb.PartHeader]]]:
    """Member 0 a real round, member 1 the reducer ``script`` plays (None: it does not speak the
    protocol); member 0 serves its own part, to which member 1 sends nothing (it is dropped at the
    stall timeout, or the round's)."""
    headers: list[pb.PartHeader] = []
    async with fake_swarms(2) as swarms:
        round_ = round_for(swarms, 0, torch.arange(NUMEL, dtype=torch.float32) if values is None else values,
                           cfg=cfg, roles=roles)
        serve(swarms[0], round_)
        if script is not None:
            async def handler(stream: INetStream) -> None:
                reader = FrameReader(stream)
                headers.append(await reader.message(pb.PartHeader, "part header"))
                await script(stream, reader)

            swarms[1].set_stream_handler(PROTOCOL, handler)
        yield round_, headers


async def read_chunks(reader: FrameReader, n: int) -> list[torch.Tensor]:
    return [(await read_chunk(reader))[1] for _ in range(n)]


async def how_it_ends(reader: FrameReader, ended: list[str], within: float = 30.0) -> None:
    """Append "eof" (closed), "more" or "reset" (broken) to ``ended``: how the other end left the stream."""
    with trio.move_on_after(within):
        try:
            ended.append("eof" if await reader.at_eof() else "more")
        except (StreamBrokenError, AllreduceProtocolError):
            ended.append("reset")


def answered(*frames: bytes, read: int = 2, ended: list[str] | None = None) -> Script:
    """A reducer that reads ``read`` chunks, writes ``frames``, and notes how the sender then left."""
    async def script(stream: INetStream, reader: FrameReader) -> None:
        await read_chunks(reader, read)
        for f in frames:
            await stream.write(f)
        await how_it_ends(reader, ended if ended is not None else [])
        await trio.sleep_forever()

    return script


MINE = torch.arange(16, 32, dtype=torch.float32)  # member 0's values of part 1


@pytest.mark.parametrize("frames, why", [
    ((chunk_frame(0, None, [0, 1]),), "AllreduceProtocolError: the reducer returned chunk 0 with 0 bytes and 2 contributors"),
    ((chunk_frame(0, MINE[:8], []),), "AllreduceProtocolError: the reducer returned chunk 0 with 32 bytes and 0 contributors"),
    ((chunk_frame(0, torch.full((8,), math.nan), [0, 1]),), "AllreduceProtocolError: the reducer returned non-finite values"),
    ((chunk_frame(0, torch.full((8,), math.inf), [0, 1]),), "AllreduceProtocolError: the reducer returned non-finite values"),
    ((chunk_frame(1, MINE[:8], [0, 1]),), "ChunkRejected: the reducer sent chunk 1 (32 bytes, codec 1); "
                                          "expected chunk 0 (32 bytes, codec 1)"),
    ((chunk_frame(0, MINE[:8], [0, 1], codec=pb.CODEC_FLOAT16, nbytes=32),),
     "ChunkRejected: the reducer sent chunk 0 (32 bytes, codec 2); expected chunk 0 (32 bytes, codec 1)"),
    ((chunk_frame(0, MINE[:4], [0, 1]),), "ChunkRejected: the reducer sent chunk 0 (16 bytes, codec 1); "
                                          "expected chunk 0 (32 bytes, codec 1)"),
    ((chunk_frame(0, MINE[:8], [0, 1], size=9),), "AllreduceProtocolError: contributors of 2 bytes for a group of 2"),
    ((chunk_frame(0, MINE[:8], [0, 1], size=0),), "AllreduceProtocolError: contributors of 0 bytes for a group of 2"),
    ((b"\xff" * 11,), "AllreduceProtocolError: chunk header from the reducer: malformed length prefix"),
])
async def test_a_reducer_s_bad_answer_keeps_own_values_for_the_rest_and_is_named(
        autojump_clock: trio.abc.Clock, frames: tuple[bytes, ...], why: str) -> None:
    ended: list[str] = []
    async with against_a_reducer(answered(*frames, ended=ended)) as (round_, _):
        report = await round_.run()
        await trio.sleep(1)
    p = report.parts[1]
    assert p.not_averaged == f"chunks 0..1 kept own values: {why}" and p.averaged_chunks == 0
    assert torch.equal(vector_values(round_)[16:], MINE)
    assert ended == ["reset"]  # the stream to a reducer that broke the protocol is reset, not closed
    # member 1 sent nothing to member 0's part: dropped at the stall timeout, the part averaged without it
    assert report.parts[0].left_out == {round_.group.members[1].peer_id.to_base58():
                                        "member 1 left out: did not open its stream within 1 s"}
    assert report.summary() == (f"group of 2: partial average: part 0 ({round_.group.members[0].peer_id}): "
                                f"2 chunks without {round_.group.members[1].peer_id.to_base58()}; "
                                f"part 1 ({round_.group.members[1].peer_id}): chunks 0..1 kept own values: {why}")


async def test_good_chunks_then_a_bad_one_keep_the_good_averages(autojump_clock: trio.abc.Clock) -> None:
    values = torch.arange(160, dtype=torch.float32)  # parts of 80: ten chunks each
    good = [chunk_frame(k, values[80 + 8 * k:88 + 8 * k] + 1000, [0, 1]) for k in range(2)]
    script = answered(*good, chunk_frame(0, values[96:104], [0, 1]), read=4)  # four ahead at most
    async with against_a_reducer(script, values=values) as (round_, _):
        report = await round_.run()
    p = report.parts[1]
    assert p.not_averaged.startswith("chunks 2..9 kept own values: ChunkRejected: the reducer sent chunk 0 ")
    assert (p.averaged_chunks, p.returned_chunks, p.partial_chunks) == (2, 2, 0)
    assert torch.equal(vector_values(round_)[80:], torch.cat([values[80:96] + 1000, values[96:]]))
    assert p.bytes_received == len(good[0]) + len(good[1]) + len(good[0])  # what it read, the bad chunk too


async def test_who_was_left_out_and_clipped_is_read_from_the_reducer_s_notes(autojump_clock: trio.abc.Clock) -> None:
    first = "member 1 clipped x0.25; member 0 clipped x2; member 2 clipped x0.1"  # member 2 is no member of a group of 2
    second = "member 10 left out: not in this group; member 1 clipped x0.5; member 1 left out: stalled for 1 s"
    ended: list[str] = []
    script = answered(chunk_frame(0, MINE[:8] * 2, [1], note=first), chunk_frame(1, MINE[8:] * 2, [0], note=second),
                      ended=ended)
    async with against_a_reducer(script) as (round_, _):
        report = await round_.run()
        await trio.sleep(1)
    p = report.parts[1]
    ids = [m.peer_id.to_base58() for m in round_.group.members]
    assert (p.averaged_chunks, p.returned_chunks, p.partial_chunks, p.not_averaged) == (2, 2, 2, "")
    assert p.left_out == {ids[0]: "left out", ids[1]: "member 1 left out: stalled for 1 s"}
    assert p.clipped == {ids[1]: 0.25, ids[0]: 1.0}  # the least factor, never above 1
    assert torch.equal(vector_values(round_)[16:], MINE * 2)
    assert ended == ["eof"]  # a whole exchange ends with a close
    swarm = round_.swarm
    assert isinstance(swarm, FakeSwarm) and swarm.known[round_.group.members[1].peer_id] == [ADDR]  # dialled where declared


async def test_a_sender_stays_at_most_max_chunks_ahead_of_the_averages(autojump_clock: trio.abc.Clock) -> None:
    events: list[int | str] = []

    async def script(stream: INetStream, reader: FrameReader) -> None:
        for _ in range(2):
            for _ in range(3 if not events else 1):
                events.append((await read_chunk(reader))[0].index)
            with trio.move_on_after(5):
                await read_chunk(reader)
                events.append("one too many")
            await stream.write(chunk_frame(len([e for e in events if e == "answered"]), torch.zeros(8), [0, 1]))
            events.append("answered")  # one average back: one chunk more
        await trio.sleep_forever()

    cfg = config(stall_timeout=20.0, timeout=60.0, max_chunks_ahead=3)
    async with against_a_reducer(script, cfg=cfg, values=torch.ones(160)) as (round_, headers):
        start = trio.current_time()
        report = await round_.run()
        assert trio.current_time() - start == pytest.approx(10 + 40)  # the last chunk came at 10 s
    assert events == [0, 1, 2, "answered", 3, "answered"]
    (header,) = headers
    assert (header.group_id, header.part, header.start, header.end, header.weight, header.chunk_elements) == \
        (GROUP_ID, 1, 80, 160, 1.0, 8)
    p = report.parts[1]
    assert p.not_averaged == "chunks 2..9 kept own values: the reducer stalled for 40 s"
    assert report.notes == []


async def test_a_reducer_that_trickles_is_waited_for_twice_the_stall_timeout_after_each_byte(
        autojump_clock: trio.abc.Clock) -> None:
    async def script(stream: INetStream, reader: FrameReader) -> None:
        await read_chunks(reader, 2)
        for byte in chunk_frame(0, MINE[:8], [0, 1])[:5]:
            await trio.sleep(3)  # within the 4 s allowed after each byte
            await stream.write(bytes([byte]))
        await trio.sleep_forever()

    async with against_a_reducer(script, cfg=config(stall_timeout=2.0, timeout=60.0)) as (round_, _):
        start = trio.current_time()
        report = await round_.run()
        assert trio.current_time() - start == pytest.approx(15 + 4)  # the last byte at 15 s, given up 4 s later
    assert report.parts[1].not_averaged == "chunks 0..1 kept own values: the reducer stalled for 4 s"


async def test_the_round_s_timeout_ends_it_with_what_came_back(autojump_clock: trio.abc.Clock) -> None:
    async def script(stream: INetStream, reader: FrameReader) -> None:
        await read_chunks(reader, 3)
        await stream.write(chunk_frame(0, torch.zeros(8), [0, 1]))
        await stream.write(chunk_frame(1, None, []))  # nobody's values reached chunk 1; chunk 2 never comes
        await trio.sleep_forever()

    values = torch.arange(48, dtype=torch.float32)  # parts of 24: three chunks
    async with against_a_reducer(script, cfg=config(stall_timeout=20.0, timeout=3.0), values=values) as (round_, _):
        start = trio.current_time()
        report = await round_.run()
        assert trio.current_time() - start == pytest.approx(3.0)
    assert report.notes == ["round timed out after 3 s"]
    p = report.parts[1]
    assert (p.averaged_chunks, p.returned_chunks) == (1, 2)
    assert p.not_averaged == ("1 chunks not returned in time; "
                              "1 chunks came back without an average (no sender's values reached it)")
    assert report.parts[0].left_out == {round_.group.members[1].peer_id.to_base58():
                                        "member 1 left out: no chunks before the round's timeout"}
    assert report.parts[0].averaged_chunks == 3  # averaged over member 0 alone when the round ended


async def test_a_member_that_only_sends_times_out_with_a_report_too(autojump_clock: trio.abc.Clock) -> None:
    async def script(stream: INetStream, reader: FrameReader) -> None:
        await read_chunks(reader, 4)
        await trio.sleep_forever()

    async with against_a_reducer(script, cfg=config(stall_timeout=20.0, timeout=3.0),
                                 roles=[Role.SENDER, Role.FULL]) as (round_, _):
        report = await round_.run()
    assert round_.reduction is None and report.notes == ["round timed out after 3 s"]
    assert [(p.part, p.not_averaged) for p in report.parts] == [(1, "4 chunks not returned in time")]


async def test_an_unreachable_reducer_is_reported_at_once(autojump_clock: trio.abc.Clock) -> None:
    async with against_a_reducer(None, cfg=config(stall_timeout=0.5)) as (round_, _):
        report = await round_.run()
        peer = round_.group.members[1].peer_id
    assert report.parts[1].not_averaged == ("could not reach the reducer: ProtocolNotSupportedError: "
                                            f"{peer} does not speak {PROTOCOL}")
    assert torch.equal(vector_values(round_)[16:], MINE)


# ---------------------------------------------------------------------- a sender that misbehaves


@asynccontextmanager
async def as_a_sender(cfg: AllreduceConfig | None = None, size: int = 2,
                      ) -> AsyncIterator[tuple[AllreduceRound, list[FakeSwarm], list[str]]]:
    """Member 0 a real round (its part 0 reduced over every member), the others the test's. They serve
    member 0's own sends by holding its streams: member 0's exchanges stay open."""
    refused: list[str] = []
    async with fake_swarms(size) as swarms:
        round_ = round_for(swarms, 0, torch.arange(NUMEL, dtype=torch.float32), cfg=cfg)
        serve(swarms[0], round_, refused)

        async def hold(stream: INetStream) -> None:
            await trio.sleep_forever()

        for other in swarms[1:]:
            other.set_stream_handler(PROTOCOL, hold)
        yield round_, swarms, refused


def part_header(*, part: int = 0, start: int = 0, end: int = 16, weight: float = 1.0, chunk: int = 8) -> bytes:
    return frame(pb.PartHeader(group_id=GROUP_ID, part=part, start=start, end=end, weight=weight, chunk_elements=chunk))


async def reduced_with(cfg: AllreduceConfig, send: Callable[[INetStream], Awaitable[None]],
                       ) -> tuple[RoundReport, AllreduceRound, list[str]]:
    """Member 0's round while member 1 ``send``s on its stream to it; the report's ``elapsed`` is trio's.
    ``send`` is given a second after the round to finish."""
    async with as_a_sender(cfg) as (round_, swarms, refused):
        async with trio.open_nursery() as nursery:
            sent = trio.Event()

            async def sender() -> None:
                stream = await swarms[1].new_stream(swarms[0].peer_id, PROTOCOL)
                await send(stream)
                sent.set()

            nursery.start_soon(sender)
            start = trio.current_time()
            report = await round_.run()
            report.elapsed = trio.current_time() - start
            with trio.move_on_after(1):
                await sent.wait()
            nursery.cancel_scope.cancel()
    return report, round_, refused


@pytest.mark.parametrize("header, cut", [
    (part_header(end=15), "part 0 [0, 15) in chunks of 8"),
    (part_header(start=1), "part 0 [1, 16) in chunks of 8"),
    (part_header(part=1), "part 1 [0, 16) in chunks of 8"),
    (part_header(chunk=16), "part 0 [0, 16) in chunks of 16"),
])
async def test_a_sender_that_cuts_the_vector_otherwise_is_left_out_of_the_part(
        autojump_clock: trio.abc.Clock, header: bytes, cut: str) -> None:
    async def send(stream: INetStream) -> None:
        await stream.write(header)
        await trio.sleep_forever()

    report, round_, refused = await reduced_with(config(timeout=5.0), send)
    why = f"member 1 cut the vector otherwise: {cut}; here part 0 is [0, 16) in chunks of 8"
    assert refused == [why]
    assert report.parts[0].left_out == {round_.group.members[1].peer_id.to_base58(): f"member 1 left out: {why}"}
    assert torch.equal(vector_values(round_)[:16], torch.arange(16, dtype=torch.float32))  # its own values alone
    assert report.elapsed == pytest.approx(2.0)  # member 1's held answer (2 x stall), not the round's timeout


@pytest.mark.parametrize("weight", [math.nan, -1.0, math.inf])
async def test_a_sender_s_bad_weight_leaves_it_out(autojump_clock: trio.abc.Clock, weight: float) -> None:
    async def send(stream: INetStream) -> None:
        await stream.write(part_header(weight=weight))
        await trio.sleep_forever()

    report, round_, refused = await reduced_with(config(timeout=5.0), send)
    why = f"member 1 declared weight {weight}; it must be finite and >= 0"
    assert refused == [why] and report.parts[0].left_out == {
        round_.group.members[1].peer_id.to_base58(): f"member 1 left out: {why}"}


async def test_a_sender_is_averaged_in_and_gets_every_average_back_then_the_end(
        autojump_clock: trio.abc.Clock) -> None:
    got: list[tuple[pb.ChunkHeader, torch.Tensor]] = []
    ended: list[str] = []

    async def send(stream: INetStream) -> None:
        reader = FrameReader(stream)
        await stream.write(part_header(weight=3.0))
        for k in range(2):
            await stream.write(chunk_frame(k, torch.full((8,), 100.0)))
        got.extend([await read_chunk(reader), await read_chunk(reader)])
        await how_it_ends(reader, ended)

    report, round_, refused = await reduced_with(config(timeout=5.0), send)
    assert refused == [] and report.parts[0].complete and report.parts[0].left_out == {}
    exact = (torch.arange(16, dtype=torch.float32) + 300) / 4
    assert torch.allclose(vector_values(round_)[:16], exact)
    for k, (head, values) in enumerate(got):
        assert (head.index, head.codec, head.nbytes, bytes(head.contributors), head.note) == (k, F32, 32, b"\x03", "")
        assert torch.allclose(values, exact[8 * k:8 * k + 8])
    assert ended == ["eof"]  # the reducer closes once every average went back


@pytest.mark.parametrize("behaviour, why", [
    ("stall", "stalled for 1 s"),
    ("repeat", "ChunkRejected: member 1 sent chunk 0 (32 bytes, codec 1); expected chunk 1 (32 bytes, codec 1)"),
    ("empty", "ChunkRejected: member 1 sent chunk 1 (0 bytes, codec 1); expected chunk 1 (32 bytes, codec 1)"),
    ("garbage", "AllreduceProtocolError: chunk header from member 1: malformed length prefix"),
    ("short", "TruncatedStreamError: "),
    ("reset", "StreamBrokenError: the stream broke after "),
])
async def test_a_sender_that_stalls_repeats_or_breaks_is_dropped_after_its_first_chunk(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, behaviour: str, why: str) -> None:
    ended: list[str] = []

    async def send(stream: INetStream) -> None:
        await stream.write(part_header() + chunk_frame(0, torch.full((8,), 100.0)))
        if behaviour == "repeat":
            await stream.write(chunk_frame(0, torch.full((8,), 100.0)))
        elif behaviour == "empty":
            await stream.write(chunk_frame(1, None, nbytes=0))
        elif behaviour == "garbage":
            await stream.write(b"\xff" * 11)
        elif behaviour == "short":
            await stream.write(chunk_frame(1, torch.full((8,), 100.0))[:-4])
            await stream.close()
        elif behaviour == "reset":
            await trio.sleep(0.1)
            await stream.reset()
        reader = FrameReader(stream)
        with trio.move_on_after(10):
            try:
                while True:
                    await read_chunk(reader)  # chunk 0's average may come back first
            except (StreamBrokenError, AllreduceProtocolError):
                ended.append("reset")

    caplog.set_level(logging.INFO, "averaging.allreduce")
    report, round_, refused = await reduced_with(config(timeout=5.0), send)
    member = round_.group.members[1].peer_id.to_base58()
    assert report.parts[0].left_out[member].startswith(f"member 1 left out: {why}")
    assert (report.parts[0].averaged_chunks, report.parts[0].partial_chunks) == (2, 1)
    flat = vector_values(round_)
    assert torch.allclose(flat[:8], (torch.arange(8, dtype=torch.float32) + 100) / 2)  # chunk 0 with member 1
    assert torch.equal(flat[8:16], torch.arange(8, 16, dtype=torch.float32))  # chunk 1 without it
    assert report.elapsed == pytest.approx(2.0) and refused == []
    assert ended == ["reset"]  # its stream is reset at once
    assert [r.getMessage() for r in caplog.records] == []  # a peer's fault: in the report, not the log


async def test_an_unexpected_failure_serving_a_sender_is_logged_and_leaves_it_out(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def decode(*args: object) -> torch.Tensor:
        raise RuntimeError("boom")

    async def send(stream: INetStream) -> None:
        await stream.write(part_header() + chunk_frame(0, torch.full((8,), 100.0)))
        await trio.sleep_forever()

    monkeypatch.setattr(allreduce, "decode", decode)
    caplog.set_level(logging.INFO, "averaging.allreduce")
    report, round_, _ = await reduced_with(config(timeout=5.0), send)
    assert report.parts[0].left_out == {round_.group.members[1].peer_id.to_base58():
                                        "member 1 left out: RuntimeError: boom"}
    assert [r.getMessage() for r in caplog.records] == ["stream from member 1 failed: RuntimeError('boom')"]


async def test_the_notes_that_go_back_are_joined_and_cut_at_a_thousand_characters(
        autojump_clock: trio.abc.Clock) -> None:
    """Seven members cut the vector absurdly (each refusal names their numbers); member 1's answer
    carries every reason, as far as 1000 characters go."""
    absurd = part_header(start=2**63, end=2**64 - 1, chunk=2**32 - 1)
    heads: list[pb.ChunkHeader] = []
    async with as_a_sender(config(timeout=5.0), size=9) as (round_, swarms, refused):
        async with trio.open_nursery() as nursery:
            for other in swarms[2:]:
                stream = await other.new_stream(swarms[0].peer_id, PROTOCOL)
                await stream.write(absurd)
            await wait_until(lambda: len(refused) == 7, 5, what="the seven refused")
            mine = round_.plan.spans[0]
            stream = await swarms[1].new_stream(swarms[0].peer_id, PROTOCOL)
            await stream.write(part_header(end=round_.plan.bounds[1]) +
                               b"".join(chunk_frame(k, torch.zeros(s.end - s.start)) for k, s in enumerate(mine)))

            async def answers() -> None:
                reader = FrameReader(stream)
                heads.extend([(await read_chunk(reader))[0] for _ in mine])

            nursery.start_soon(answers)
            await round_.run()
            await wait_until(lambda: len(heads) == len(mine), 5, what="the answers")
            nursery.cancel_scope.cancel()
    whole = "; ".join(f"member {why.split()[1]} left out: {why}" for why in refused)  # in the order dropped
    assert len(whole) > 1000 and sorted(why.split()[1] for why in refused) == [str(i) for i in range(2, 9)]
    assert [head.note for head in heads] == [whole[:1000]] * len(mine)


async def test_a_second_stream_from_one_sender_is_refused(autojump_clock: trio.abc.Clock) -> None:
    async with as_a_sender(config(timeout=2.0)) as (round_, swarms, refused):
        async with trio.open_nursery() as nursery:
            async def send_twice() -> None:
                for _ in range(2):
                    stream = await swarms[1].new_stream(swarms[0].peer_id, PROTOCOL)
                    await stream.write(part_header())
                    await trio.sleep(0.1)

            nursery.start_soon(send_twice)
            await round_.run()
            nursery.cancel_scope.cancel()
    assert refused == ["member 1 may not send part 0 here (or sent it twice)"]


async def test_a_member_that_is_no_sender_of_the_part_is_refused(autojump_clock: trio.abc.Clock) -> None:
    async with fake_swarms(2) as swarms:
        roles = [Role.FULL, Role.AUXILIARY]
        round_ = round_for(swarms, 0, torch.zeros(NUMEL), roles=roles, cfg=config(timeout=1.0))
        swarms[0].set_stream_handler(PROTOCOL, lambda stream: trio.sleep_forever())
        stream = await swarms[1].new_stream(swarms[0].peer_id, PROTOCOL)
        with pytest.raises(AllreduceProtocolError, match=r"^member 1 may not send part 0 here \(or sent it twice\)$"):
            await round_.serve(stream, FrameReader(stream), 1, pb.PartHeader())
        sender = round_for(swarms, 1, torch.zeros(NUMEL), roles=[Role.FULL, Role.SENDER], cfg=config(timeout=1.0))
        assert sender.reduction is None  # a sender reduces nothing: whoever sends to it is refused
        with pytest.raises(AllreduceProtocolError, match=r"^member 0 may not send part 1 here"):
            await sender.serve(stream, FrameReader(stream), 0, pb.PartHeader())


async def test_a_sender_that_never_comes_is_dropped_at_the_stall_timeout(autojump_clock: trio.abc.Clock) -> None:
    async with as_a_sender(config(stall_timeout=7.0, timeout=60.0)) as (round_, _, _):
        start = trio.current_time()
        with trio.fail_after(60):
            report = await round_.run()
        assert trio.current_time() - start == pytest.approx(14.0)  # its own part at 7, the held answer at 2 x 7
    member = round_.group.members[1].peer_id.to_base58()
    assert report.parts[0].left_out == {member: "member 1 left out: did not open its stream within 7 s"}
    assert report.parts[1].not_averaged == "chunks 0..1 kept own values: the reducer stalled for 14 s"
