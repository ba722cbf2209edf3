"""averaging.averager, the shell that joins matchmaking to the round, over the in-memory swarm of
tests/fake_swarm.py under trio's autojump clock: its settings, the role it declares from the NAT
layer's verdict, the wait for that verdict, a step's checks, observers, notes and withdrawal, strict
and lenient partial rounds, the split it picks, the match key, and the streams it serves or refuses.
The same steps over real sockets are tests/test_averaging.py's; the round alone, tests/test_allreduce.py's."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import torch
import trio
from libp2p.abc import INetStream
from multiaddr import Multiaddr

from averaging import allreduce, averager as averager_module
from averaging.allreduce import PROTOCOL, AllreduceConfig, RoundReport
from averaging.averager import ADAPTIVE_GAIN, Averager, AveragerConfig, RoundObserver
from averaging.bandwidth import BandwidthConfig
from averaging.compression import Compression
from averaging.errors import AveragingError, MatchmakingError, PartialAverageError
from averaging.group import Group, Member, Role
from averaging.load_balancing import balance
from averaging.matchmaking import MatchmakingConfig
from averaging.moshpit import GridPosition, MoshpitConfig
from averaging.partition import Schema
from averaging.proto import averaging_pb2 as pb
from averaging.staging import HostVector
from averaging.wire import frame
from p2p.errors import ConfigError
from p2p.hooks import ExternalAddresses, Reachability

from .fake_swarm import FakeSwarm, fake_swarms
from .kit import all_at_once, numbered_peer_id

pytestmark = pytest.mark.timeout(60)

NOBODY = b"a round nobody starts"
RELAYED = Multiaddr("/ip4/81.2.69.7/tcp/4001/p2p/12D3KooWGzYKm7Xg3wWzVuSSt3xN4gC4ZmtVUHvBsXcxW3kGZnR5/p2p-circuit")


def settings(n: int = 2, **overrides: object) -> AveragerConfig:
    values: dict[str, object] = {
        "prefix": "run",
        "matchmaking": MatchmakingConfig(target_size=n, min_size=n, timeout=5.0, gather_time=0.3, poll_interval=0.05),
        "allreduce": AllreduceConfig(chunk_elements=8, stall_timeout=1.0, timeout=10.0),
    }
    values.update(overrides)
    return AveragerConfig(**values)  # type: ignore[arg-type]


class Heard(RoundObserver):
    def __init__(self) -> None:
        self.heard: list[tuple[object, ...]] = []

    def matchmade(self, seconds: float, group_size: int) -> None:
        self.heard.append(("matchmade", seconds, group_size))

    def matchmaking_failed(self, seconds: float, reason: str) -> None:
        self.heard.append(("failed", seconds, reason))

    def averaged(self, report: RoundReport) -> None:
        self.heard.append(("averaged", report.complete))


async def steps(averagers: Sequence[Averager], data: Sequence[list[torch.Tensor]], weights: Sequence[float],
                **kwargs: Any) -> list[RoundReport | BaseException]:
    """Each averager's step (or its error), all at once."""
    return await all_at_once([partial(a.step, d, w, **kwargs) for a, d, w in zip(averagers, data, weights)],
                             (AveragingError, MatchmakingError, ValueError))


# ---------------------------------------------------------------------- settings and role


def test_the_settings_their_defaults_and_bounds() -> None:
    d = AveragerConfig()
    assert (d.prefix, d.auxiliary, d.reduces, d.relayed_reduces, d.adaptive, d.compute, d.moshpit, d.join_wait,
            d.reachability_wait) == ("dedloc", False, True, False, True, 0.0, None, 10.0, 15.0)
    assert (d.matchmaking, d.allreduce, d.bandwidth) == (MatchmakingConfig(), AllreduceConfig(), BandwidthConfig())
    for fine in ({"prefix": "x" * 128}, {"compute": 0.0}, {"reachability_wait": 0.0}, {"join_wait": 0.001},
                 {"auxiliary": True}, {"reduces": False},
                 {"moshpit": MoshpitConfig(4), "matchmaking": MatchmakingConfig(target_size=4)}):
        AveragerConfig(**fine).validate()
    bad: list[tuple[dict[str, object], str]] = [
        ({"prefix": ""}, r"prefix must be 1\.\.128 characters"),
        ({"prefix": "x" * 129}, r"prefix must be 1\.\.128 characters"),
        ({"auxiliary": True, "reduces": False},
         "an auxiliary peer only reduces: reduces=False leaves it nothing to do"),
        ({"moshpit": MoshpitConfig(4), "matchmaking": MatchmakingConfig(target_size=5)},
         r"with Moshpit groups of 4, matchmaking.target_size must be the same \(it is 5\)"),
        ({"compute": float("nan")}, "compute must be finite and >= 0"),
        ({"compute": -1.0}, "compute must be finite and >= 0"),
        ({"join_wait": 0.0}, "join_wait must be > 0 and reachability_wait >= 0"),
        ({"reachability_wait": -0.1}, "join_wait must be > 0 and reachability_wait >= 0"),
        ({"matchmaking": MatchmakingConfig(min_size=0)}, r"need 1 <= min_size <= target_size"),
        ({"allreduce": AllreduceConfig(max_chunks_ahead=0)}, "max_chunks_ahead must be at least 1"),
        ({"bandwidth": BandwidthConfig(probe_every=-1)}, r"probe_every must be >= 0 \(0: never probe\)"),
        ({"moshpit": MoshpitConfig(0), "matchmaking": MatchmakingConfig(target_size=0)}, ".+"),
    ]
    for values, why in bad:
        with pytest.raises(ConfigError, match=f"^{why}$"):
            AveragerConfig(**values).validate()  # type: ignore[arg-type]


PUBLIC = ExternalAddresses(Reachability.PUBLIC, judged=True)
PRIVATE = ExternalAddresses(Reachability.PRIVATE, judged=True)


@pytest.mark.parametrize("external, overrides, role, accepts", [
    (ExternalAddresses(), {}, Role.FULL, True),  # nothing judges reachability: taken at its word
    (PUBLIC, {}, Role.FULL, True),
    (ExternalAddresses(Reachability.UNKNOWN, judged=True), {}, Role.SENDER, False),
    (PRIVATE, {}, Role.SENDER, False),
    (replace(PRIVATE, relayed=(RELAYED,)), {}, Role.SENDER, True),  # reached through its relay, reduces nothing
    (replace(PRIVATE, relayed=(RELAYED,)), {"relayed_reduces": True}, Role.FULL, True),
    (PRIVATE, {"relayed_reduces": True}, Role.SENDER, False),
    (PUBLIC, {"reduces": False}, Role.SENDER, True),
    (PUBLIC, {"auxiliary": True}, Role.AUXILIARY, True),
    (replace(PRIVATE, relayed=(RELAYED,)), {"auxiliary": True}, Role.AUXILIARY, True),
])
async def test_the_role_follows_the_nat_layer_s_verdict(external: ExternalAddresses, overrides: dict[str, object],
                                                         role: Role, accepts: bool) -> None:
    async with fake_swarms(1) as (swarm,):
        swarm.external = external
        averager = Averager(swarm, settings(2, **overrides))
        assert averager.role() == (role, accepts)
        swarm.addrs = []  # nothing to dial: nobody can join us, whatever the verdict
        assert averager.role() == (role, False)


async def test_an_auxiliary_peer_nobody_can_reach_is_refused() -> None:
    async with fake_swarms(1) as (swarm,):
        swarm.external = PRIVATE
        with pytest.raises(AveragingError, match=r"^an auxiliary peer must be reachable \(public or relayed\) to reduce$"):
            Averager(swarm, settings(auxiliary=True)).role()


@pytest.mark.parametrize("external, verdict_at, waited", [
    (ExternalAddresses(Reachability.UNKNOWN, judged=True), None, 15.0),  # no verdict: the whole wait
    (ExternalAddresses(Reachability.UNKNOWN, judged=True), 2.0, 2.0),  # until the verdict
    (ExternalAddresses(), None, 0.0),  # nothing will judge: no wait
    (PRIVATE, None, 0.0),
])
async def test_a_step_waits_for_the_first_verdict_on_reachability(
        autojump_clock: trio.abc.Clock, external: ExternalAddresses, verdict_at: float | None, waited: float) -> None:
    async with fake_swarms(1) as (swarm,):
        swarm.external = external
        async with Averager.open(swarm, settings()) as averager:
            async with trio.open_nursery() as nursery:
                async def verdict() -> None:
                    assert verdict_at is not None
                    await trio.sleep(verdict_at - 0.5)
                    for observer in swarm.observers:
                        observer.external_changed(swarm.external)  # a change that is no verdict yet
                    await trio.sleep(0.5)
                    swarm.external = PUBLIC
                    for observer in swarm.observers:
                        observer.external_changed(PUBLIC)

                if verdict_at is not None:
                    nursery.start_soon(verdict)
                start = trio.current_time()
                await averager.settled()
                assert trio.current_time() - start == pytest.approx(waited)
        assert swarm.observers == []  # the averager stops listening when closed


# ---------------------------------------------------------------------- steps


async def test_a_step_averages_tells_its_observers_and_withdraws_its_declaration(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    data = [[torch.arange(32, dtype=torch.float32)], [torch.full((32,), 100.0)]]
    heard = [Heard(), Heard()]
    solved = balance
    monkeypatch.setattr(averager_module, "balance", lambda capacities, size: replace(solved(capacities, size),
                                                                                      solve_seconds=0.0123456))
    async with fake_swarms(2) as swarms:
        async with Averager.open(swarms[0], settings()) as a0, Averager.open(swarms[1], settings()) as a1:
            registrations = [a.observe(h) for a, h in zip((a0, a1), heard)]
            reports = await steps([a0, a1], data, [1.0, 3.0])
            await trio.sleep(1)  # the withdrawal runs in the background
            registrations[1].remove()
            again = await steps([a0, a1], data, [1.0, 3.0])
        assert swarms[0].handlers.get(PROTOCOL) is None  # closed: no more rounds served
    exact = (torch.arange(32, dtype=torch.float32) + 300) / 4
    for report in reports:
        assert isinstance(report, RoundReport) and report.complete
        assert report.notes[0] == "a probe round: senders ran free of lockstep to measure the links"  # rates unknown
        assert report.notes[1:] == ["load balancing solved in 12.3 ms"]
    assert all(isinstance(r, RoundReport) and r.complete for r in again)
    assert all(torch.allclose(d[0], exact) for d in data)  # averaged twice: the same average
    for h in heard:
        assert [e[0] for e in h.heard][:2] == ["matchmade", "averaged"] and h.heard[1] == ("averaged", True)
        assert h.heard[0][2] == 2 and 0 <= float(h.heard[0][1]) < 1.0  # type: ignore[arg-type]
    assert len(heard[0].heard) == 4 and len(heard[1].heard) == 2  # the second stopped listening
    records = swarms[0].dht._data["run.matchmaking"]
    assert sorted(value for value, _ in records.values()) == [b"", b""]  # both withdrawn after their group formed


async def test_a_step_checks_its_tensors_and_weight_before_it_declares_anything(autojump_clock: trio.abc.Clock) -> None:
    async with fake_swarms(1) as (swarm,):
        async with Averager.open(swarm, settings()) as averager:
            with pytest.raises(ValueError, match=r"^the tensors hold NaN or Inf; refusing to average them$"):
                await averager.step([torch.tensor([1.0, float("nan")])])
            with pytest.raises(ValueError, match=r"^weight must be finite and >= 0, not -1.0$"):
                await averager.step([torch.zeros(2)], -1.0)
            with pytest.raises(ValueError, match=r"^the tensors hold NaN or Inf"):
                await averager.average_in(Group(b"g", (Member(swarm.peer_id, (), Role.FULL, b"s"),), 0),
                                          [torch.tensor([float("inf")])])
        assert swarm.dht._data == {}


async def test_an_auxiliary_peer_averages_others_tensors_without_values_of_its_own(
        autojump_clock: trio.abc.Clock) -> None:
    data = [[torch.zeros(16)], [torch.full((16,), 4.0)], [torch.full((16,), float("nan"))]]  # the auxiliary's ignored
    async with fake_swarms(3) as swarms:
        configs = [settings(3), settings(3), settings(3, auxiliary=True)]
        async with Averager.open(swarms[0], configs[0]) as a0, Averager.open(swarms[1], configs[1]) as a1, \
                Averager.open(swarms[2], configs[2]) as a2:
            reports = await steps([a0, a1, a2], data, [1.0, 1.0, 1.0])
    assert all(isinstance(r, RoundReport) and r.complete for r in reports), reports
    assert torch.equal(data[0][0], torch.full((16,), 2.0)) and torch.equal(data[1][0], torch.full((16,), 2.0))
    assert data[2][0].isnan().all()  # an auxiliary's tensors only give the shape


async def test_no_group_is_a_matchmaking_error_heard_and_counted(autojump_clock: trio.abc.Clock) -> None:
    heard = Heard()
    async with fake_swarms(1) as (swarm,):
        async with Averager.open(swarm, settings()) as averager:
            averager.observe(heard)
            await trio.sleep(100)  # the clock is not at 0: a time taken is a difference
            with pytest.raises(MatchmakingError):
                await averager.step([torch.zeros(4)])
    assert heard.heard == [("failed", pytest.approx(5.0, abs=0.5), "MatchmakingError")]
    assert averager.failure_rate.value == 1.0


@pytest.mark.parametrize("strict, accept, written", [(True, None, False), (None, None, False), (False, None, True),
                                                     (False, False, False), (False, True, True)])
async def test_a_partial_round_raises_when_strict_and_is_written_only_when_lenient_and_accepted(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, strict: bool | None, accept: bool | None,
        written: bool) -> None:
    """Member 1 sends its values to member 0's part but never answers for its own: member 0's part is
    averaged, its part 1 keeps member 0's values."""
    own = torch.arange(32, dtype=torch.float32)
    data, other = [own.clone()], [torch.full((32,), 100.0)]
    caplog.set_level(logging.WARNING, "averaging.averager")
    seen: list[RoundReport] = []

    def judge(report: RoundReport) -> bool:
        seen.append(report)
        return bool(accept)

    async def hold(stream: INetStream) -> None:
        await trio.sleep_forever()

    async with fake_swarms(2) as swarms:
        async with Averager.open(swarms[0], settings()) as a0, Averager.open(swarms[1], settings()) as a1:
            group = await form(a0, a1)
            swarms[1].set_stream_handler(PROTOCOL, hold)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: a1.average_in(group[1], other, 3.0, strict=False))
                lenient = {} if strict is None else {"strict": strict}  # None: the default, strict
                try:
                    report = await a0.average_in(group[0], data, accept=None if accept is None else judge,
                                                 **lenient)
                except PartialAverageError as e:
                    assert strict is not False and isinstance(e.report, RoundReport)
                    assert str(e) == e.report.summary()
                    report = e.report
                else:
                    assert strict is False
    assert not report.complete and report.parts[0].complete and a0.failure_rate.value == 0.0  # nobody left out
    assert seen == ([report] if accept is not None else [])
    averaged = torch.cat([(own[:16] + 300) / 4, own[16:]])  # member 0's weight the default 1, member 1's 3
    assert torch.equal(data[0], averaged if written else own)
    logged = [r.getMessage() for r in caplog.records if r.name == "averaging.averager"]
    assert f"averaging round {report.group_id.hex()[:8]}: {report.summary()}" in logged and len(logged) == 2  # and a1's


async def form(*averagers: Averager) -> list[Group]:
    """The group each averager forms for 32 values, all at once."""
    return [g for g in await all_at_once([partial(a.matchmake, [torch.zeros(32)]) for a in averagers])
            if isinstance(g, Group)]


# ---------------------------------------------------------------------- the split and the match key


def member(i: int, rate: float = 0.0, role: Role = Role.FULL) -> Member:
    return Member(numbered_peer_id(i), (), role, b"s", rate, rate)


async def test_the_split_is_the_lp_s_only_for_a_clear_gain(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    schema = Schema.of([torch.zeros(1000)])
    async with fake_swarms(1) as (swarm,):
        averager = Averager(swarm, settings())
        even = Group(b"g", (member(1, 1e6), member(2, 1e6), member(3, 1e6)), 0)
        assert averager.fractions(even, schema) == pytest.approx((1 / 3, 1 / 3, 1 / 3))
        assert averager.last_balance is not None  # solved, and no better than equal parts
        slow = Group(b"g", (member(1, 1e6), member(2, 1e6), member(3, 1e4)), 0)
        lp = averager.fractions(slow, schema)
        assert averager.last_balance is not None and lp == averager.last_balance.fractions and lp[2] < 0.1
        assert Averager(swarm, settings(adaptive=False)).fractions(slow, schema) == (1 / 3, 1 / 3, 1 / 3)

        # the LP's split only when its round is predicted at most ADAPTIVE_GAIN of the equal one's
        sizes: list[int] = []
        for lp_seconds, chosen in ((ADAPTIVE_GAIN * 10.0, "lp"), (ADAPTIVE_GAIN * 10.0 + 0.01, "equal")):
            def split_seconds(caps: object, fractions: Sequence[float], size: int, s: float = lp_seconds) -> float:
                sizes.append(size)
                return 10.0 if tuple(fractions) == (1 / 3,) * 3 else s

            monkeypatch.setattr(averager_module, "split_seconds", split_seconds)
            assert averager.fractions(slow, schema) == (lp if chosen == "lp" else (1 / 3,) * 3)
        assert set(sizes) == {4000}  # the float32 vector's bytes

        solved = balance

        def timed(capacities: Sequence[object], vector_bytes: int) -> object:
            assert vector_bytes == 4000
            return replace(solved(capacities, vector_bytes), solve_seconds=1.2345)  # type: ignore[arg-type]

        monkeypatch.setattr(averager_module, "balance", timed)
        averager.fractions(slow, schema)
        assert averager.last_balance is not None and averager.last_balance.solve_seconds == 1.2345

        def fails(*args: object) -> object:
            raise ValueError("the LP is infeasible")

        monkeypatch.setattr(averager_module, "balance", fails)
        caplog.set_level(logging.WARNING, "averaging.averager")
        assert averager.fractions(slow, schema) == (1 / 3, 1 / 3, 1 / 3) and averager.last_balance is None
        assert [r.getMessage() for r in caplog.records] == ["load balancing failed (the LP is infeasible); splitting equally"]
        sender = Group(b"g", (member(1, 1e6), member(2, 1e6, Role.SENDER)), 0)
        assert Averager(swarm, settings(adaptive=False)).fractions(sender, schema) == (1.0, 0.0)


async def test_peers_match_only_with_the_same_tensors_settings_and_purpose() -> None:
    tensors = Schema.of([torch.zeros(4, 4), torch.zeros(3)])
    async with fake_swarms(1) as (swarm,):
        def key(schema: Schema = tensors, purpose: str = "", **overrides: object) -> bytes:
            return Averager(swarm, settings(4, **overrides))._match_key(schema, purpose)

        grid = Averager(swarm, settings(4, moshpit=MoshpitConfig(4)))
        assert grid.grid is not None
        keys = [key(), key(Schema.of([torch.zeros(16), torch.zeros(3)])), key(purpose="step 7"),
                key(allreduce=AllreduceConfig(chunk_elements=16)),
                key(allreduce=AllreduceConfig(chunk_elements=8, compression=Compression.FLOAT16)),
                key(allreduce=AllreduceConfig(chunk_elements=8, min_compress_elements=1)),
                key(adaptive=False), key(moshpit=MoshpitConfig(4)), key(moshpit=MoshpitConfig(4, dims=3)),
                grid._match_key(tensors, "")]
        assert len(set(keys)) == len(keys) - 1 and keys[-1] == keys[-3]  # one grid position: the same key
        assert all(len(k) == 16 for k in keys)
        # what a round does not depend on leaves the key alone
        assert key() == key(allreduce=AllreduceConfig(chunk_elements=8, stall_timeout=99.0)) == key(compute=5.0)
        grid.grid.advance(0, b"a group")
        assert grid._match_key(tensors, "") != keys[-1]  # the next cell


# ---------------------------------------------------------------------- the streams it serves


async def test_streams_that_belong_to_no_round_of_ours_are_refused_by_name(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    """During a round of members 0 and 1 (member 1 holds member 0's stream, so the round lasts 2 s):
    garbage, a round nobody starts, a stranger, a member's second stream."""
    caplog.set_level(logging.INFO, "averaging.averager")
    resets: list[str] = []

    async def opened(frm: FakeSwarm, to: FakeSwarm, data: bytes) -> None:
        stream = await frm.new_stream(to.peer_id, PROTOCOL)
        await stream.write(data)
        try:
            await stream.read(1)
        except Exception as e:  # the fake's StreamReset
            resets.append(type(e).__name__)

    async def hold(stream: INetStream) -> None:
        await trio.sleep_forever()

    async with fake_swarms(3) as (s0, s1, stranger):
        async with Averager.open(s0, settings(join_wait=3.0)) as a0, Averager.open(s1, settings()) as a1:
            group = await form(a0, a1)
            s1.set_stream_handler(PROTOCOL, hold)
            head = frame(pb.PartHeader(group_id=group[0].group_id, part=0, start=0, end=16, weight=1.0,
                                       chunk_elements=8))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(opened, stranger, s0, b"\xff" * 11)
                nursery.start_soon(opened, stranger, s0, frame(pb.PartHeader(group_id=NOBODY)))
                nursery.start_soon(opened, stranger, s0, frame(pb.PartHeader(group_id=NOBODY)))  # both wait, both go
                nursery.start_soon(opened, stranger, s0, b"")  # no header at all
                nursery.start_soon(lambda: a1.average_in(group[1], [torch.zeros(32)], strict=False))
                nursery.start_soon(lambda: a0.average_in(group[0], [torch.zeros(32)], strict=False))
                await trio.sleep(0.5)  # the round is under way, member 1's own stream served
                nursery.start_soon(opened, stranger, s0, head)
                nursery.start_soon(opened, s1, s0, head)
            assert a0._rounds == {} and a0._round_started == {}  # nothing left behind
    logged = sorted(r.getMessage() for r in caplog.records if r.name == "averaging.averager"
                    and not r.getMessage().startswith("averaging round"))
    gid = group[0].group_id.hex()[:8]
    assert logged == sorted([
        f"refused an all-reduce stream from {stranger.peer_id}: AllreduceProtocolError: part header: malformed length prefix",
        f"refused an all-reduce stream from {stranger.peer_id}: no round {NOBODY.hex()[:8]} here within 3 s",
        f"refused an all-reduce stream from {stranger.peer_id}: no round {NOBODY.hex()[:8]} here within 3 s",
        f"refused an all-reduce stream from {stranger.peer_id}: no part header within 3 s",
        f"refused an all-reduce stream from {stranger.peer_id}: not a member of group {gid}",
        f"member {s1.peer_id} broke the all-reduce protocol: member 1 may not send part 0 here (or sent it twice)",
    ])
    assert resets == ["StreamReset"] * 6


@pytest.mark.parametrize("whole", [True, False])
async def test_a_moshpit_step_moves_on_the_grid_whether_or_not_its_round_was_whole(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, whole: bool) -> None:
    async def hold(stream: INetStream) -> None:
        await trio.sleep_forever()

    salts: list[list[bytes]] = [[], []]
    async with fake_swarms(2) as swarms:
        cfg = settings(2, moshpit=MoshpitConfig(2, dims=2, initial=(0,)))
        async with Averager.open(swarms[0], cfg) as a0, Averager.open(swarms[1], cfg) as a1:
            for grid, salted in zip((a0.grid, a1.grid), salts):
                assert grid is not None

                def advance(index: int, salt: bytes = b"", grid: GridPosition = grid, salted: list[bytes] = salted,
                            original: Any = grid.advance) -> None:
                    salted.append(salt)
                    original(index, salt)

                monkeypatch.setattr(grid, "advance", advance)
            before = [a.grid.key for a in (a0, a1) if a.grid is not None]
            if not whole:
                swarms[1].set_stream_handler(PROTOCOL, hold)  # a1 never answers for its part
            reports = await steps([a0, a1], [[torch.zeros(8)], [torch.ones(8)]], [1.0, 1.0])
            after = [a.grid.key for a in (a0, a1) if a.grid is not None]
    assert before == ["0", "0"] and sorted(after) == ["0", "1"]  # the group's members go to distinct cells
    for key, r, salted in zip(after, reports, salts):
        if whole:
            assert isinstance(r, RoundReport) and r.notes[-1] == f"moshpit: next group key {key!r}"
        else:
            assert isinstance(r, PartialAverageError) and isinstance(r.report, RoundReport)  # raised, and moved on
            r = r.report
        assert salted == [r.group_id]  # turned by the group's id (a phase-0 round's own)


def rounds_made(monkeypatch: pytest.MonkeyPatch) -> list[allreduce.AllreduceRound]:
    """Every round the averager makes from here on (their plans and settings, read afterwards)."""
    made: list[allreduce.AllreduceRound] = []

    class Recorded(allreduce.AllreduceRound):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(averager_module, "AllreduceRound", Recorded)
    return made


@pytest.mark.parametrize("adaptive, probe_every, probe", [(True, 1, True), (True, 0, False), (False, 1, False)])
async def test_a_probe_round_runs_free_of_lockstep_and_is_measured_as_one(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, adaptive: bool, probe_every: int,
        probe: bool) -> None:
    """Rates declared (so only ``probe_every`` makes a probe): a probe's senders may send every chunk
    ahead; its transfers go to the estimator as a probe's. Without ``adaptive`` nothing probes."""
    made = rounds_made(monkeypatch)
    observed: list[tuple[int, int, bool]] = []
    cfg = settings(adaptive=adaptive, bandwidth=BandwidthConfig(upload=1e6, download=1e6, probe_every=probe_every),
                   allreduce=AllreduceConfig(chunk_elements=8, stall_timeout=1.0, timeout=10.0, max_chunks_ahead=1))
    async with fake_swarms(2) as swarms:
        async with Averager.open(swarms[0], cfg) as a0, Averager.open(swarms[1], cfg) as a1:
            monkeypatch.setattr(a0.bandwidth, "observe", lambda up, down, probe=False:
                                observed.append((len(up), len(down), probe)))
            reports = await steps([a0, a1], [[torch.zeros(64)], [torch.ones(64)]], [1.0, 1.0])
            await steps([a0, a1], [[torch.zeros(16)], [torch.ones(16)]], [1.0, 1.0])  # parts of one chunk
            phased = await a0.average_in(Group(b"alone", (Member(swarms[0].peer_id, (), Role.FULL, b"s"),), 0),
                                         [torch.zeros(4)], phase=2)
    assert [r.config.max_chunks_ahead for r in made[:2]] == [4 if probe else 1] * 2  # parts of 32: four chunks
    assert [r.config.max_chunks_ahead for r in made[2:4]] == [1, 1]  # parts of 8: one chunk, one ahead
    assert observed[0] == (2, 2, probe)  # a send and a write-back out, an answer and a sender's chunks in
    for r in reports:
        assert isinstance(r, RoundReport) and r.complete
        assert ("a probe round: senders ran free of lockstep to measure the links" in r.notes) == probe
        assert any(n.startswith("load balancing solved in ") for n in r.notes) == adaptive
    assert phased.group_id == Group(b"alone", (Member(swarms[0].peer_id, (), Role.FULL, b"s"),), 0).for_phase(2).group_id


@pytest.mark.parametrize("moshpit", [False, True])
async def test_a_step_declares_what_it_is_and_forms_and_averages_with_what_it_was_given(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, moshpit: bool) -> None:
    """What ``matchmake`` hands the matchmaker (the member: its rates, compute, match key; the cell; the
    expected size), the group that comes back averaged under its own id, the grid moved by that id,
    the default weight of 1, and the bookkeeping a round leaves: its fractions, its protections, its
    buffers, the time to form it."""
    formed: list[tuple[Member, str, int | None, Group]] = []
    grids = {"moshpit": MoshpitConfig(2, dims=2, initial=(0,))} if moshpit else {}
    cfg = settings(3, compute=7.0, bandwidth=BandwidthConfig(upload=2e6, download=3e6),
                   matchmaking=MatchmakingConfig(target_size=2 if moshpit else 3, min_size=2, timeout=60.0,
                                                 gather_time=30.0, poll_interval=0.05), **grids)
    schema = Schema.of([torch.zeros(16)])
    async with fake_swarms(2) as swarms:
        async with Averager.open(swarms[0], cfg) as a0, Averager.open(swarms[1], cfg) as a1:
            for averager in (a0, a1):
                form_group = averager.matchmaker.form_group

                async def recorded(me: Member, cell: str = "", *, expected: int | None = None,
                                   form_group: Any = form_group) -> Group:
                    group: Group = await form_group(me, cell, expected=expected)
                    formed.append((me, cell, expected, group))
                    return group

                monkeypatch.setattr(averager.matchmaker, "form_group", recorded)
            heard = Heard()
            a0.observe(heard)
            advanced: list[tuple[int, bytes]] = []
            if a0.grid is not None:
                advance = a0.grid.advance

                def recorded_advance(index: int, salt: bytes = b"") -> None:
                    advanced.append((index, salt))
                    advance(index, salt)

                monkeypatch.setattr(a0.grid, "advance", recorded_advance)
            await trio.sleep(100)
            cells = [a.grid.key if a.grid is not None else "" for a in (a0, a1)]
            key = a0._match_key(schema, "step 7")  # before the grid moves
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: a1.step([torch.full((16,), 4.0)], 3.0, purpose="step 7", expected=2))
                first = await a0.step(data := [torch.zeros(16)], purpose="step 7", expected=2)
            assert trio.current_time() - start < 5  # two expected: fixed at once, not after 30 s of gathering
            assert torch.equal(data[0], torch.full((16,), 3.0))  # weights 1 (the default) and 3
            assert swarms[0].protections_made == [(swarms[1].peer_id, "averaging round")] and not +swarms[0].protected
            assert a0._buffers._free[("host", torch.uint8)]  # the streams' buffers went back to the averager's pool
            if not moshpit:  # (a Moshpit group's members are in other cells now)
                plain = await all_at_once([partial(a.step, [torch.zeros(16)]) for a in (a0, a1)])
                assert all(isinstance(r, RoundReport) for r in plain)
                await form(a0, a1)
                plain_keys = [a0._match_key(Schema.of([torch.zeros(n)]), "") for n in (16, 16, 32, 32)]  # form's 32
                assert [(f[0].schema, f[2]) for f in formed[2:]] == [(k, None) for k in plain_keys]
    me, cell, expected, group = next(f for f in formed if f[0].peer_id == swarms[0].peer_id)
    assert (me.role, me.schema, me.upload, me.download, me.compute, me.accepts_joins, me.addrs) == \
        (Role.FULL, key, 2e6, 3e6, 7.0, True, tuple(swarms[0].addrs))
    assert (cell, expected) == (cells[0], 2)
    assert first.group_id == group.group_id and first.fractions == (0.5, 0.5)  # phase 0: the group's own id
    assert heard.heard[0][:1] == ("matchmade",) and float(heard.heard[0][1]) < 5  # type: ignore[arg-type]
    if moshpit:
        assert a0.grid is not None and advanced == [(group.my_index, group.group_id)]
        turned = GridPosition(2, (0,))
        turned.advance(group.my_index, group.group_id)
        assert a0.grid.key == turned.key  # turned by the group's id, which every member holds


async def test_peers_of_another_purpose_never_meet(autojump_clock: trio.abc.Clock) -> None:
    async with fake_swarms(2) as swarms:
        async with Averager.open(swarms[0], settings()) as a0, Averager.open(swarms[1], settings()) as a1:
            apart = await steps([a0, a1], [[torch.zeros(4)], [torch.ones(4)]], [1.0, 1.0], purpose="x")
            assert all(isinstance(r, RoundReport) for r in apart)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: steps([a1], [[torch.ones(4)]], [1.0], purpose="other"))
                with pytest.raises(MatchmakingError):
                    await a0.step([torch.zeros(4)], purpose="x")


class Failing(RoundObserver):
    def __init__(self, fails_on: str) -> None:
        self.fails_on = fails_on

    def matchmade(self, seconds: float, group_size: int) -> None:
        if self.fails_on == "matchmade":
            raise RuntimeError("matchmade")

    def matchmaking_failed(self, seconds: float, reason: str) -> None:
        if self.fails_on == "failed":
            raise RuntimeError("failed")

    def averaged(self, report: RoundReport) -> None:
        if self.fails_on == "averaged":
            raise RuntimeError("averaged")


async def test_an_observer_that_fails_is_named_with_what_it_failed_on_and_dropped(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "p2p.hooks")
    async with fake_swarms(2) as swarms:
        async with Averager.open(swarms[0], settings()) as a0, Averager.open(swarms[1], settings()) as a1:
            for fails_on in ("matchmade", "averaged", "failed"):
                a0.observe(Failing(fails_on))
            assert all(isinstance(r, RoundReport) for r in await steps([a0, a1], [[torch.zeros(4)]] * 2, [1.0, 1.0]))
            with pytest.raises(MatchmakingError):
                await a0.step([torch.zeros(4)])
    failed_on = [re.sub(r"^an observer of the averager's rounds \(.*\) failed on (.*); it is removed.*$", r"\1",
                        r.getMessage()) for r in caplog.records]
    assert failed_on == ["a group formed", "a round averaged", "a failed matchmaking"]


async def test_the_vector_is_staged_on_the_host_for_cpu_tensors_and_through_the_device_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    staged: list[tuple[object, ...]] = []
    def device_vector(*args: object) -> str:
        staged.append(args)
        return "device"

    monkeypatch.setattr(averager_module, "DeviceVector", device_vector)
    async with fake_swarms(1) as (swarm,):
        averager = Averager(swarm, settings())
        plan, _ = allreduce.RoundPlan.make(Schema.of([torch.zeros(4)]), (1.0,), averager.config.allreduce), None
        host = averager._stage([torch.zeros(4)], plan)
        assert isinstance(host, HostVector) and host.pool is averager._buffers
        tensors = [torch.zeros(4, device="meta")]
        assert averager._stage(tensors, plan) == "device"  # type: ignore[comparison-overlap]
        assert staged == [(tensors, plan.spans, averager._buffers)]


def test_the_match_key_is_stable_across_releases() -> None:
    """Peers of two releases with the same settings must still meet: the key's recipe is pinned."""
    averager = Averager(None, settings())  # type: ignore[arg-type]  # the key reads no network
    schema = Schema.of([torch.zeros(4, 4)])
    assert averager._match_key(schema) == averager._match_key(schema, "") == bytes.fromhex(PINNED_KEY)


PINNED_KEY = "beb3ef42efb9eaaf93743ddd516f938a"  # 2026-12-06


async def test_chunks_follow_the_links_the_group_declared(autojump_clock: trio.abc.Clock,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a fixed ``chunk_elements`` the plan sizes chunks from the group's declarations: 6400 B/s
    declared, 10 ms of it in float32 values is 16 (the minimum here is 8)."""
    made = rounds_made(monkeypatch)
    cfg = settings(bandwidth=BandwidthConfig(upload=6400, download=6400),
                   allreduce=AllreduceConfig(min_chunk_elements=8, max_chunk_elements=64, stall_timeout=1.0))
    async with fake_swarms(2) as swarms:
        async with Averager.open(swarms[0], cfg) as a0, Averager.open(swarms[1], cfg) as a1:
            reports = await steps([a0, a1], [[torch.zeros(256)], [torch.ones(256)]], [1.0, 1.0])
    assert all(isinstance(r, RoundReport) and r.complete for r in reports)
    assert [r.plan.chunk_elements for r in made] == [16, 16]
