"""averaging.matchmaking, the shell around the formation table, over the in-memory swarm of
tests/fake_swarm.py (a real RPC, one shared record store): what is declared where and for how long,
groups formed and refused, the ``avg.join`` server's answers, withdrawal, and the pure helpers that
read declarations. The rules themselves are tests/test_formation.py's; the join call as a follower
sees each answer, tests/test_matchmaking_join.py's."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial

import pytest
import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from averaging.errors import AllreduceProtocolError, MatchmakingError
from averaging.formation import Formation, FormationRules, Joined, JoinOutcome, Phase, Refused, Unreachable
from averaging.group import Group, Member, Role
from averaging.matchmaking import (ANSWER_FLUSH, JOIN_METHOD, Matchmaker, MatchmakingConfig, _Lead, declared_members,
                                   forget_expired)
from averaging.proto import averaging_pb2 as pb
from p2p.dht import ValueWithExpiration, owned
from p2p.errors import ConfigError, DedlocError
from p2p.rpc import CallContext, UnknownMethodError

from .fake_swarm import FakeSwarm, fake_swarms
from .kit import all_at_once, numbered_peer_id, wait_until

pytestmark = pytest.mark.timeout(60)

ADDR = Multiaddr("/ip4/81.2.69.7/tcp/4001")
NOW = 1_000_000.0


def member(peer: ID | FakeSwarm, *, schema: bytes = b"s", expiration: float = NOW + 100, role: Role = Role.FULL,
           leads: bool = True) -> Member:
    peer_id = peer.peer_id if isinstance(peer, FakeSwarm) else peer
    return Member(peer_id, (ADDR,), role, schema, accepts_joins=leads, expiration=expiration)


def config(**kw: float) -> MatchmakingConfig:
    settings: dict[str, float] = {"target_size": 3, "min_size": 2, "gather_time": 0.3, "timeout": 5.0,
                                  "poll_interval": 0.05}
    settings.update(kw)
    return MatchmakingConfig(**settings)  # type: ignore[arg-type]


@contextmanager
def serving(*matchmakers: Matchmaker) -> Iterator[None]:
    """Each matchmaker serves ``avg.join`` for the block."""
    with ExitStack() as stack:
        for matchmaker in matchmakers:
            stack.enter_context(matchmaker.install())
        yield


async def form_all(matchmakers: Sequence[Matchmaker], members: Sequence[Member], *, cells: Sequence[str] = (),
                   expected: int | None = None) -> list[Group | BaseException]:
    """Each matchmaker's group (or error), all looking at once; ``cells``: each one's cell."""
    return await all_at_once([partial(m.form_group, me, cells[i] if cells else "", expected=expected)
                              for i, (m, me) in enumerate(zip(matchmakers, members))], (MatchmakingError, DedlocError))


# ---------------------------------------------------------------------- settings


def test_the_settings_and_their_bounds() -> None:
    default = MatchmakingConfig()
    assert (default.target_size, default.min_size, default.gather_time, default.timeout, default.poll_interval) == \
        (16, 2, 3.0, 30.0, 0.5)
    MatchmakingConfig(target_size=1, min_size=1, gather_time=0.0).validate()
    sizes: list[dict[str, int]] = [{"min_size": 0}, {"min_size": 4, "target_size": 3}]
    for size in sizes:
        with pytest.raises(ConfigError, match=r"^need 1 <= min_size <= target_size$"):
            MatchmakingConfig(**size).validate()
    times: list[dict[str, float]] = [{"timeout": 0.0}, {"gather_time": -0.1}, {"poll_interval": 0.0}]
    for bad in times:
        with pytest.raises(ConfigError, match=r"^matchmaking times must be positive$"):
            MatchmakingConfig(**bad).validate()  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            Matchmaker(None, "run", MatchmakingConfig(**bad))  # type: ignore[arg-type]  # checked when made


# ---------------------------------------------------------------------- the pure helpers


def declaration(m: Member) -> ValueWithExpiration:
    return ValueWithExpiration(m.to_wire().SerializeToString(), m.expiration)


def test_declared_members_are_the_live_ones_of_my_schema_me_first() -> None:
    me = member(numbered_peer_id(5))
    a, b = member(numbered_peer_id(1)), member(numbered_peer_id(2), expiration=NOW + 0.001)
    other_schema, expired = member(numbered_peer_id(3), schema=b"t"), member(numbered_peer_id(4), expiration=NOW)
    mine_declared = member(numbered_peer_id(5), expiration=NOW + 50)  # our own declaration, as read back
    found = ValueWithExpiration({  # garbage first: what follows it is still read
        "garbage": ValueWithExpiration(b"\xff\xff", NOW + 100), "dict": ValueWithExpiration({}, NOW + 100),
        "a": declaration(a), "withdrawn": ValueWithExpiration(b"", NOW + 100), "b": declaration(b),
        "other": declaration(other_schema), "expired": declaration(expired), "me": declaration(mine_declared),
        "a again": declaration(member(numbered_peer_id(1), expiration=NOW + 99)),
    }, NOW + 100)
    assert declared_members(found, me, NOW) == [me, a, b]
    assert declared_members(None, me, NOW) == [me]
    assert declared_members(ValueWithExpiration(b"a plain value", NOW + 1), me, NOW) == [me]


def test_a_malformed_declaration_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "averaging.matchmaking")
    found = ValueWithExpiration({"garbage": ValueWithExpiration(b"\xff\xff", NOW + 100),
                                 "withdrawn": ValueWithExpiration(b"", NOW + 100)}, NOW + 100)
    declared_members(found, member(numbered_peer_id(1)), NOW)  # a withdrawn entry is no malformed one
    (record,) = [r for r in caplog.records if r.name == "averaging.matchmaking"]
    assert record.levelno == logging.DEBUG
    assert re.fullmatch(r"skipping a malformed declaration: \w+Error\(.+\)", record.getMessage()), record.getMessage()


def test_unreachable_leaders_are_forgotten_when_their_declaration_expires() -> None:
    a, b, c = numbered_peer_id(1), numbered_peer_id(2), numbered_peer_id(3)
    unreachable = {a: 10.0, b: 10.5, c: 11.0}
    forget_expired(unreachable, 10.5)
    assert unreachable == {c: 11.0}
    forget_expired(unreachable, 10.999)
    assert unreachable == {c: 11.0}


# ---------------------------------------------------------------------- forming groups


async def test_three_peers_form_one_group_and_declare_where_and_until_when() -> None:
    now = time.time()  # the shared records expire entries by the wall clock; the matchmakers' stands still
    async with fake_swarms(3) as swarms:
        matchmakers = [Matchmaker(s, "run", config(), clock=lambda: now) for s in swarms]
        with serving(*matchmakers):
            groups = await form_all(matchmakers, [member(s) for s in swarms])
    assert all(isinstance(g, Group) for g in groups), groups
    first = groups[0]
    assert isinstance(first, Group) and len(first.group_id) == 16
    ids = sorted((s.peer_id for s in swarms), key=lambda p: p.to_bytes())
    for swarm, group in zip(swarms, groups):
        assert isinstance(group, Group) and group.group_id == first.group_id
        assert [m.peer_id for m in group.members] == ids
        assert group.me.peer_id == swarm.peer_id
    entries = swarms[0].dht._data["run.matchmaking"]
    assert set(entries) == {owned("member", s.peer_id) for s in swarms}
    # declared until the deadline and 5 s more, by the matchmaker's clock
    assert {e for _, e in entries.values()} == {now + 5.0 + 5.0}
    decoded = Member.from_wire(pb.Declaration.FromString(entries[owned("member", swarms[1].peer_id)][0]))
    assert decoded.peer_id == swarms[1].peer_id and decoded.expiration == now + 10.0


async def test_a_cell_meets_only_its_own_and_says_where_it_looked() -> None:
    async with fake_swarms(2) as swarms:
        matchmakers = [Matchmaker(s, "run", config(timeout=0.5)) for s in swarms]
        with serving(*matchmakers):
            results = await form_all(matchmakers[:1], [member(swarms[0])], cells=["3"])
            assert "run.matchmaking.3" in swarms[0].dht._data
            (error,) = results
            assert isinstance(error, MatchmakingError)
            assert str(error).startswith("no group of at least 2 formed under 'run.matchmaking.3' within 0 s (1 matching")
            # the two in different cells never meet
            cells = await form_all(matchmakers, [member(s) for s in swarms], cells=["a", "b"])
            assert all(isinstance(r, MatchmakingError) for r in cells)


@pytest.mark.parametrize("expected, size", [(2, 2), (1, 2), (100, 3)])
async def test_expected_peers_fix_the_group_at_once_within_min_and_target(expected: int, size: int) -> None:
    """A caller that knows how many come (a training step's) does not wait out ``gather_time`` for
    more: the group is fixed when ``expected`` (clamped to min_size..target_size) joined."""
    async with fake_swarms(3) as swarms:
        matchmakers = [Matchmaker(s, "run", config(gather_time=30.0, timeout=60.0)) for s in swarms]
        with serving(*matchmakers):
            start = trio.current_time()
            with trio.fail_after(20):
                groups = await form_all(matchmakers[:size], [member(s) for s in swarms[:size]], expected=expected)
            assert trio.current_time() - start < 10.0  # not the 30 s gather time
    assert all(isinstance(g, Group) and g.size == size for g in groups), groups


async def test_a_lone_peer_fails_at_the_deadline_and_leaves_no_lead_behind(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "averaging.matchmaking")
    async with fake_swarms(1) as (swarm,):
        matchmaker = Matchmaker(swarm, "run", config(timeout=0.4))
        with serving(matchmaker):
            start = trio.current_time()
            with pytest.raises(MatchmakingError, match=r"^no group of at least 2 formed under 'run.matchmaking' "):
                await matchmaker.form_group(member(swarm))
            assert 0.4 <= trio.current_time() - start < 3.0
            assert matchmaker._formation is None and matchmaker._lead is None
    # each step of the table at debug, the first a read of the declarations
    steps = [r.getMessage() for r in caplog.records if r.name == "averaging.matchmaking"]
    assert steps[0] == "matchmaking looking: Read()" and len(steps) > 2


# ---------------------------------------------------------------------- the join server


async def call_join(caller: FakeSwarm, leader: FakeSwarm, declaration: pb.Declaration,
                    prefix: str = "run") -> pb.JoinResponse:
    with trio.fail_after(20):
        return await caller.rpc.call(leader.peer_id, f"{JOIN_METHOD}.{prefix}",
                                     pb.JoinRequest(prefix=prefix, declaration=declaration), pb.JoinResponse,
                                     timeout=15)


async def test_the_join_server_turns_away_garbage_impostors_and_joins_between_rounds() -> None:
    async with fake_swarms(2) as (leader, caller):
        matchmaker = Matchmaker(leader, "run", config(poll_interval=0.3))
        registration = matchmaker.install()
        garbled = pb.Declaration(peer_id=b"\x00\x01")
        with pytest.raises(AllreduceProtocolError) as refused:
            Member.from_wire(garbled)
        answer = await call_join(caller, leader, garbled)
        assert (answer.status, answer.reason) == (pb.JoinResponse.REJECTED, str(refused.value))
        impostor = await call_join(caller, leader, member(numbered_peer_id(9)).to_wire())
        assert (impostor.status, impostor.reason) == (pb.JoinResponse.REJECTED, "a declaration of another peer")
        # no formation under way: it waits a poll interval for one, then turns the caller away
        start = trio.current_time()
        idle = await call_join(caller, leader, member(caller).to_wire())
        assert (idle.status, idle.reason) == (pb.JoinResponse.REJECTED, "not matching now")
        assert 0.3 <= trio.current_time() - start < 2.0
        registration.remove()
        with pytest.raises(UnknownMethodError):
            await call_join(caller, leader, member(caller).to_wire())


async def test_a_join_held_between_two_rounds_is_answered_by_the_next_formation() -> None:
    async with fake_swarms(2) as (leader, follower):
        leading = Matchmaker(leader, "run", config(target_size=2, poll_interval=2.0))
        results: list[pb.JoinResponse] = []

        async def join() -> None:
            results.append(await call_join(follower, leader, member(follower).to_wire()))

        with serving(leading):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(join)
                await trio.sleep(0.2)  # the join waits: no formation yet
                assert not results
                group = await leading.form_group(member(leader))
        (answer,) = results
        assert answer.status == pb.JoinResponse.ACCEPTED
        assert Group.from_wire(answer.group, follower.peer_id).group_id == group.group_id


# ---------------------------------------------------------------------- asking a leader


async def ask_to_join(follower: FakeSwarm, leader: Member, *, within: float = 5.0) -> JoinOutcome:
    """What ``follower``'s matchmaker makes of asking ``leader`` to let it join, ``within`` seconds of
    its matchmaking deadline."""
    formation = Formation(member(follower), FormationRules(3, 2, 1.0, 0.1), trio.current_time() + within)
    return await Matchmaker(follower, "run", config())._join(formation, leader)


async def test_a_leader_that_cannot_be_reached_is_unreachable_and_its_addresses_are_noted() -> None:
    async with fake_swarms(1) as (swarm,):
        gone = member(numbered_peer_id(77))
        outcome = await ask_to_join(swarm, gone)
        assert isinstance(outcome, Unreachable) and "no route" in outcome.reason
        assert swarm.known[gone.peer_id] == [ADDR]


async def test_an_accepted_join_with_an_unusable_group_is_a_refusal(caplog: pytest.LogCaptureFixture) -> None:
    async with fake_swarms(2) as (follower, leader):
        async def answer(request: pb.JoinRequest, ctx: CallContext) -> pb.JoinResponse:
            group = Group(b"g" * 16, (member(leader),), 0)  # a group without the follower
            return pb.JoinResponse(status=pb.JoinResponse.ACCEPTED, group=group.to_wire())

        leader.rpc.add_unary(f"{JOIN_METHOD}.run", pb.JoinRequest, answer)
        outcome = await ask_to_join(follower, member(leader))
        assert isinstance(outcome, Refused) and outcome.reason.startswith("an unusable group: ")
        # logged as a warning, with its leader and why the group is unusable
        (record,) = [r for r in caplog.records if "unusable group" in r.getMessage()]
        reason = outcome.reason.removeprefix("an unusable group: ")
        assert record.levelno == logging.WARNING
        assert record.getMessage() == f"leader {leader.peer_id} sent an unusable group: {reason}"

        async def accept(request: pb.JoinRequest, ctx: CallContext) -> pb.JoinResponse:
            group = Group(b"g" * 16, (member(follower), member(leader)), 0)
            assert request.prefix == "run" and request.declaration == member(follower).to_wire()
            return pb.JoinResponse(status=pb.JoinResponse.ACCEPTED, group=group.to_wire())

        leader.rpc.remove(f"{JOIN_METHOD}.run")
        leader.rpc.add_unary(f"{JOIN_METHOD}.run", pb.JoinRequest, accept)
        joined = await ask_to_join(follower, member(leader))
        assert isinstance(joined, Joined) and joined.group.group_id == b"g" * 16


# ---------------------------------------------------------------------- withdrawal


async def test_a_declaration_is_taken_once_and_withdrawn_with_an_empty_value() -> None:
    now = time.time()
    async with fake_swarms(2) as swarms:
        matchmakers = [Matchmaker(s, "run", config(), clock=lambda: now) for s in swarms]
        with serving(*matchmakers):
            assert all(isinstance(g, Group) for g in await form_all(matchmakers, [member(s) for s in swarms]))
            assert Matchmaker(swarms[0], "run", config()).take_declaration() is None  # none before a first round
            declared = matchmakers[0].take_declaration()
            assert declared == ("run.matchmaking", now + 10.0)
            assert matchmakers[0].take_declaration() is None
            await matchmakers[0].withdraw(declared)
            value, expiration = swarms[0].dht._data["run.matchmaking"][owned("member", swarms[0].peer_id)]
            assert (value, expiration) == (b"", now + 10.001)
            stores = swarms[0].dht.stores
            await matchmakers[0].withdraw(None)
            assert swarms[0].dht.stores == stores


async def test_a_withdrawal_that_fails_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "averaging.matchmaking")
    async with fake_swarms(1) as (swarm,):
        async def failing(*args: object, **kw: object) -> bool:
            raise DedlocError("no replica answered")

        swarm.dht.store = failing  # type: ignore[method-assign]
        await Matchmaker(swarm, "run", config()).withdraw(("run.matchmaking", NOW))
    assert [r.getMessage() for r in caplog.records if r.name == "averaging.matchmaking"] == [
        "could not withdraw the declaration under run.matchmaking: no replica answered"]


# ---------------------------------------------------------------------- what the shell says and waits for


async def test_each_join_s_answer_and_failure_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "averaging.matchmaking")
    async with fake_swarms(2) as (follower, leader):
        async def full(request: pb.JoinRequest, ctx: CallContext) -> pb.JoinResponse:
            return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason="full")

        leader.rpc.add_unary(f"{JOIN_METHOD}.run", pb.JoinRequest, full)
        assert await ask_to_join(follower, member(leader)) == Refused("full")
        gone = member(numbered_peer_id(77))
        outcome = await ask_to_join(follower, gone)
    messages = [r.getMessage() for r in caplog.records if r.name == "averaging.matchmaking"]
    assert messages[0] == f"join {leader.peer_id}: REJECTED full"
    assert isinstance(outcome, Unreachable)
    assert messages[1] == f"join {gone.peer_id} failed: {outcome.reason}"


async def test_a_join_that_broke_midway_is_a_refusal_with_its_words() -> None:
    """Not 'unreachable': the leader was reached, and is asked again after the pause."""
    async with fake_swarms(2) as (follower, leader):
        async def broken(request: pb.JoinRequest, ctx: CallContext) -> pb.JoinResponse:
            raise RuntimeError("the leader's own fault")

        leader.rpc.add_unary(f"{JOIN_METHOD}.run", pb.JoinRequest, broken)
        outcome = await ask_to_join(follower, member(leader))
    assert outcome == Refused(f"avg.join.run failed: RuntimeError: the leader's own fault (code 5 from {leader.peer_id})")


@pytest.mark.parametrize("left, waited", [(3.0, 3.0), (0.1, 0.5)])
async def test_a_join_waits_for_the_leader_until_the_deadline_and_half_a_second_at_least(
        autojump_clock: trio.abc.Clock, left: float, waited: float) -> None:
    async with fake_swarms(2) as (follower, leader):
        async def holds(request: pb.JoinRequest, ctx: CallContext) -> pb.JoinResponse:
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        leader.rpc.add_unary(f"{JOIN_METHOD}.run", pb.JoinRequest, holds)
        await trio.sleep(100)  # not at time 0: the deadline is a time, the call's timeout what is left of it
        start = trio.current_time()
        outcome = await ask_to_join(follower, member(leader), within=left)
        assert isinstance(outcome, Refused)
        assert trio.current_time() - start == pytest.approx(waited, abs=0.01)


async def test_a_withdrawal_has_its_own_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_swarms(1) as (swarm,):
        timeouts: list[object] = []

        async def store(key: str, value: bytes, expiration: float, subkey: object = None, *,
                        timeout: float | None = None) -> bool:
            timeouts.append(timeout)
            return True

        monkeypatch.setattr(swarm.dht, "store", store)
        matchmaker = Matchmaker(swarm, "run", config())
        await matchmaker.withdraw(("run.matchmaking", NOW))
        await matchmaker.withdraw(("run.matchmaking", NOW), timeout=1.5)
    assert timeouts == [5.0, 1.5]


@pytest.mark.parametrize("answered_after, returns_after", [(0.1, 0.1), (None, 0.2)])
async def test_a_leader_that_fixed_its_group_waits_for_its_followers_answers(
        autojump_clock: trio.abc.Clock, answered_after: float | None, returns_after: float,
        caplog: pytest.LogCaptureFixture) -> None:
    """Up to ANSWER_WAIT (0.2 s), then a few ms for the RPC layer to write them (ANSWER_FLUSH), before
    the CPU-bound start of the round."""
    caplog.set_level(logging.DEBUG, "averaging.matchmaking")
    async with fake_swarms(2) as (leader, follower):
        matchmaker = Matchmaker(leader, "run", config())
        formation = Formation(member(leader), FormationRules(3, 2, 1.0, 0.1), trio.current_time() + 5)
        lead = matchmaker._lead = _Lead()
        lead.waiting = 1
        members = tuple(sorted((member(leader), member(follower)), key=lambda m: m.peer_id.to_bytes()))

        async def answer() -> None:
            assert answered_after is not None
            await trio.sleep(answered_after)
            lead.waiting = 0
            lead.answered.set()

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            if answered_after is not None:
                nursery.start_soon(answer)
            done = await matchmaker._fix_group(formation, members)
        assert trio.current_time() - start == pytest.approx(returns_after + ANSWER_FLUSH, abs=1e-6)
        assert lead.closed.is_set() and lead.group == done.group and matchmaker._lead is None
        assert done.group.me.peer_id == leader.peer_id and len(done.group.group_id) == 16
    assert [r.getMessage() for r in caplog.records if r.name == "averaging.matchmaking"] == [
        f"fixed group {done.group.group_id.hex()[:8]} of 2"]


# ---------------------------------------------------------------------- a join that comes while we look


class Looking:
    """A leader-to-be whose formation the test holds in its hands: ``avg.join`` served, the formation
    installed as form_group would (``LOOKING``), and each change announced as form_group does."""

    def __init__(self, leader: FakeSwarm, poll_interval: float) -> None:
        self.matchmaker = Matchmaker(leader, "run", config(poll_interval=poll_interval))
        self.registration = self.matchmaker.install()
        self.formation = Formation(member(leader), FormationRules(3, 2, 1.0, poll_interval), trio.current_time() + 60)
        self.matchmaker._formation = self.formation

    def change(self) -> None:
        self.matchmaker._move()


async def asked_while_looking(autojump_clock: trio.abc.Clock, then: str) -> tuple[pb.JoinResponse, float, ID]:
    """A follower asks to join a peer that is still looking; 1 s later (of a 5 s poll interval) the peer
    ``then`` follows another leader, or ends its formation; or nothing changes."""
    await trio.sleep(100)  # not at time 0: a deadline is a time, not a duration
    async with fake_swarms(2) as (leader, follower):
        looking = Looking(leader, poll_interval=5.0)
        other = numbered_peer_id(42)
        answers: list[tuple[pb.JoinResponse, float]] = []
        start = trio.current_time()

        async def ask() -> None:
            answers.append((await call_join(follower, leader, member(follower).to_wire()), trio.current_time() - start))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.sleep(1.0)
            assert not answers  # held: a peer that looks picks a leader within moments
            if then == "follows":
                looking.formation.phase = Phase.FOLLOWING
                looking.formation.following = member(other)
                looking.change()
            elif then == "ends":
                looking.matchmaker._formation = None
                looking.change()
        looking.registration.remove()
    ((answer, after),) = answers
    return answer, after, other


async def test_a_join_held_while_we_look_is_redirected_as_soon_as_we_follow(autojump_clock: trio.abc.Clock) -> None:
    answer, after, other = await asked_while_looking(autojump_clock, "follows")
    assert (answer.status, answer.leader) == (pb.JoinResponse.REDIRECT, other.to_bytes())
    assert after == pytest.approx(1.0)


async def test_a_join_held_while_we_look_is_turned_away_when_the_formation_ends(
        autojump_clock: trio.abc.Clock) -> None:
    answer, after, _ = await asked_while_looking(autojump_clock, "ends")
    assert (answer.status, answer.reason) == (pb.JoinResponse.REJECTED, "not matching now")
    assert after == pytest.approx(1.0)


async def test_a_join_held_a_whole_poll_interval_while_we_still_look_is_told_we_do_not_lead(
        autojump_clock: trio.abc.Clock) -> None:
    answer, after, _ = await asked_while_looking(autojump_clock, "stays")
    assert (answer.status, answer.reason) == (pb.JoinResponse.REJECTED, "not leading")
    assert after == pytest.approx(5.0)


# ---------------------------------------------------------------------- joins admitted while we lead


class Leading(Looking):
    """A leader whose formation leads (as form_group sets it up on that step): joins are admitted and
    held until the test closes the lead."""

    def __init__(self, leader: FakeSwarm) -> None:
        super().__init__(leader, poll_interval=5.0)
        self.formation.phase = Phase.LEADING
        self.lead = self.matchmaker._lead = _Lead()


async def test_admitted_joins_wait_for_the_group_and_are_answered_by_it() -> None:
    async with fake_swarms(3) as (leader, first, second):
        leading = Leading(leader)
        lead = leading.lead
        answers: dict[ID, pb.JoinResponse] = {}

        async def ask(follower: FakeSwarm) -> None:
            answers[follower.peer_id] = await call_join(follower, leader, member(follower).to_wire())

        async with trio.open_nursery() as nursery:
            woken = lead.changed
            nursery.start_soon(ask, first)
            with trio.fail_after(5):
                await woken.wait()  # each admission wakes the lead (to see whether the group is complete)
            await wait_until(lambda: lead.waiting >= 1, 5, what="the first join admitted")
            nursery.start_soon(ask, second)
            await wait_until(lambda: lead.waiting >= 2, 5, what="the second join admitted")
            assert set(leading.formation.followers) == {first.peer_id, second.peer_id}
            assert not answers and not lead.answered.is_set()
            group = Group(b"G" * 16, tuple(sorted((member(leader), member(first)), key=lambda m: m.peer_id.to_bytes())),
                          0 if leader.peer_id.to_bytes() < first.peer_id.to_bytes() else 1)
            leading.matchmaker._close_lead(group, None)
        assert answers[first.peer_id].status == pb.JoinResponse.ACCEPTED
        assert Group.from_wire(answers[first.peer_id].group, first.peer_id).group_id == b"G" * 16
        assert (answers[second.peer_id].status, answers[second.peer_id].reason) == (
            pb.JoinResponse.REJECTED, "the group formed without you")
        assert lead.waiting == 0 and lead.answered.is_set()
        assert set(leading.formation.followers) == {first.peer_id, second.peer_id}  # the lead closed: kept
        leading.registration.remove()


async def test_admitted_joins_are_handed_over_to_a_better_leader() -> None:
    async with fake_swarms(2) as (leader, follower):
        leading = Leading(leader)
        other = numbered_peer_id(42)
        answers: list[pb.JoinResponse] = []

        async def ask() -> None:
            answers.append(await call_join(follower, leader, member(follower).to_wire()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await wait_until(lambda: leading.lead.waiting >= 1, 5, what="the join admitted")
            leading.matchmaker._close_lead(None, other)
        ((answer,)) = answers
        assert (answer.status, answer.leader) == (pb.JoinResponse.REDIRECT, other.to_bytes())
        leading.registration.remove()


async def test_a_follower_whose_call_ends_before_the_group_is_fixed_is_no_follower() -> None:
    """Its join call broke (cancelled, or its connection dropped): a group fixed with it would wait
    for it and end partial."""
    async with fake_swarms(3) as (leader, gone, staying):
        leading = Leading(leader)
        lead = leading.lead

        broke: list[DedlocError] = []

        async def ask(follower: FakeSwarm) -> None:
            try:
                await call_join(follower, leader, member(follower).to_wire())
            except DedlocError as e:
                broke.append(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, staying)
            nursery.start_soon(ask, gone)
            await wait_until(lambda: lead.waiting >= 2, 5, what="both joins admitted")
            gone.kill()  # its streams reset, its call with them
            await wait_until(lambda: lead.waiting <= 1, 5, what="the broken join's end")
            assert set(leading.formation.followers) == {staying.peer_id}
            assert not lead.answered.is_set()  # one still waits
            leading.matchmaker._close_lead(None, numbered_peer_id(42))
        assert lead.waiting == 0 and lead.answered.is_set()
        assert len(broke) == 1
        leading.registration.remove()


@pytest.mark.parametrize("took, after", [(False, 1.0), (True, 5.0)])
async def test_a_declaration_lost_at_first_is_stored_again_while_the_formation_lasts(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, took: bool, after: float) -> None:
    """The first store of the peer every reader would pick as leader is lost: it reached no replica
    (``took`` False: every reply past the store's timeout), or replicas no later read asks (True: a
    store while the swarm was loaded keeps those that answered in time, not the key's closest). That
    peer then leads and waits for joins, the other sees only itself and leads alone: neither group
    forms before the deadline (16 Moshpit peers in one process beside three CPU hogs failed so, 4 runs
    of 5). Stored again at the next poll (1 s at least) or after 5 s, it is read and joined."""
    async with fake_swarms(2) as swarms:
        hidden = min(swarms, key=lambda s: s.peer_id.to_bytes())  # the leader both would pick
        real_store = swarms[0].dht.store
        stores: list[float] = []

        async def store(key: str, value: bytes, expiration: float, subkey: object = None, *,
                        timeout: float | None = None) -> bool:
            if value and subkey == owned("member", hidden.peer_id):
                stores.append(trio.current_time())
                if len(stores) == 1:
                    return took  # lost
            return await real_store(key, value, expiration, subkey, timeout=timeout)  # type: ignore[arg-type]

        monkeypatch.setattr(swarms[0].dht, "store", store)
        matchmakers = [Matchmaker(s, "run", config(timeout=10.0, target_size=2)) for s in swarms]
        with serving(*matchmakers):
            start = trio.current_time()
            groups = await form_all(matchmakers, [member(s) for s in swarms])
    assert all(isinstance(g, Group) and g.size == 2 for g in groups), groups
    assert [round(t - start, 3) for t in stores] == [0.0, after]  # then formed: stored no more


async def test_a_peer_looking_alone_stores_its_declaration_every_five_seconds_until_its_deadline(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a replica took it, "stale" answers (the replicas hold it already: the same record) do not
    make it a lost store: stored again 5 s later, not at the next poll, and never after the deadline."""
    async with fake_swarms(1) as (swarm,):
        real_store = swarm.dht.store
        stores: list[tuple[float, bool]] = []

        async def store(key: str, value: bytes, expiration: float, subkey: object = None, *,
                        timeout: float | None = None) -> bool:
            took = await real_store(key, value, expiration, subkey, timeout=timeout)  # type: ignore[arg-type]
            stores.append((trio.current_time(), took))
            return took

        monkeypatch.setattr(swarm.dht, "store", store)
        start = trio.current_time()
        with pytest.raises(MatchmakingError):
            await Matchmaker(swarm, "run", config(timeout=12.0)).form_group(member(swarm))
        await trio.sleep(10)
    assert [(round(t - start, 3), took) for t, took in stores] == [(0.0, True), (5.0, False), (10.0, False)]


async def test_a_declaration_no_replica_takes_is_tried_again_less_and_less_often(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every store failing (a loaded swarm): 1, 2, 4, then 5 s apart, not once a second (a store that
    raised counts as failed too, and ends nothing)."""
    async with fake_swarms(1) as (swarm,):
        stores: list[float] = []

        async def store(key: str, value: bytes, expiration: float, subkey: object = None, *,
                        timeout: float | None = None) -> bool:
            stores.append(trio.current_time())
            if len(stores) == 3:
                raise trio.TooSlowError
            return False

        monkeypatch.setattr(swarm.dht, "store", store)
        start = trio.current_time()
        with pytest.raises(MatchmakingError):
            await Matchmaker(swarm, "run", config(timeout=20.0)).form_group(member(swarm))
    assert [round(t - start, 3) for t in stores] == [0.0, 1.0, 3.0, 7.0, 12.0, 17.0]


@pytest.mark.parametrize("timeout, store_timeout", [(0.3, 0.3), (30.0, 10.0)])
async def test_the_declaration_carries_the_member_whole_and_is_stored_within_the_deadline(
        monkeypatch: pytest.MonkeyPatch, timeout: float, store_timeout: float) -> None:
    """What the leader reads to balance the load (bandwidths, compute) is what the caller declared;
    the store takes at most 10 s of the matchmaking deadline."""
    async with fake_swarms(1) as (swarm,):
        stored: list[tuple[bytes, float | None]] = []
        real_store = swarm.dht.store

        async def store(key: str, value: bytes, expiration: float, subkey: object = None, *,
                        timeout: float | None = None) -> bool:
            stored.append((value, timeout))
            return await real_store(key, value, expiration, subkey, timeout=timeout)  # type: ignore[arg-type]

        monkeypatch.setattr(swarm.dht, "store", store)
        me = Member(swarm.peer_id, (ADDR,), Role.SENDER, b"s", upload=12.5, download=50.0, compute=3.0,
                    accepts_joins=False)
        with pytest.raises(MatchmakingError):
            with trio.move_on_after(1.0):
                await Matchmaker(swarm, "run", config(timeout=timeout)).form_group(me)
            raise MatchmakingError("given up by the test")  # a long deadline: not waited out
    ((value, used),) = stored
    assert used == store_timeout
    declared = Member.from_wire(pb.Declaration.FromString(value))
    assert (declared.role, declared.upload, declared.download, declared.compute, declared.accepts_joins) == (
        Role.SENDER, 12.5, 50.0, 3.0, False)


async def test_the_declarations_are_read_whole_within_what_is_left_of_the_deadline(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replica's copy merged (``latest``: a declaration is one subkey among many writers'), in at
    most 5 s and at least 0.5 s; unreachable leaders whose declaration expired are forgotten."""
    await trio.sleep(100)
    async with fake_swarms(1) as (swarm,):
        reads: list[tuple[bool, float | None, float]] = []
        real_get = swarm.dht.get

        async def get(key: str, latest: bool = False, *, timeout: float | None = None) -> ValueWithExpiration | None:
            reads.append((latest, timeout, trio.current_time()))
            return await real_get(key, latest, timeout=timeout)

        monkeypatch.setattr(swarm.dht, "get", get)
        matchmaker = Matchmaker(swarm, "run", config(timeout=8.0, poll_interval=0.5))
        gone, back_later = numbered_peer_id(50), numbered_peer_id(51)
        matchmaker._unreachable.update({gone: time.time() - 1, back_later: time.time() + 1000})
        start = trio.current_time()
        with pytest.raises(MatchmakingError):
            await matchmaker.form_group(member(swarm))
    assert len(reads) > 5 and all(latest for latest, _, _ in reads)
    assert [timeout for _, timeout, _ in reads] == [max(0.5, min(5.0, start + 8.0 - t)) for _, _, t in reads]
    assert reads[0][1] == 5.0 and reads[-1][1] == 0.5
    assert matchmaker._unreachable == {back_later: pytest.approx(time.time() + 1000, abs=10)}


async def test_a_leader_that_refuses_is_asked_again_after_a_pause(autojump_clock: trio.abc.Clock) -> None:
    """A peer that cannot lead keeps asking the one leader there is, each refusal making it skip that
    leader for two poll intervals, until the deadline."""
    await trio.sleep(100)
    async with fake_swarms(2) as (leader, follower):
        asked: list[float] = []

        async def full(request: pb.JoinRequest, ctx: CallContext) -> pb.JoinResponse:
            asked.append(trio.current_time())
            return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason="full")

        leader.rpc.add_unary(f"{JOIN_METHOD}.run", pb.JoinRequest, full)
        declared = member(leader, expiration=time.time() + 100)
        await leader.dht.store("run.matchmaking", declared.to_wire().SerializeToString(), declared.expiration,
                               subkey=owned("member", leader.peer_id))
        matchmaker = Matchmaker(follower, "run", config(timeout=3.0, poll_interval=0.2))
        with pytest.raises(MatchmakingError, match=r"within 3 s \(2 matching peers declared\)$"):
            await matchmaker.form_group(member(follower, leads=False))
    assert len(asked) >= 5
    assert all(later - earlier >= 0.4 - 1e-9 for earlier, later in zip(asked, asked[1:])), asked


async def test_a_leader_that_could_not_be_reached_is_remembered_across_rounds() -> None:
    async with fake_swarms(1) as (swarm,):
        dead = member(numbered_peer_id(0), expiration=time.time() + 100)  # it sorts first: the leader to ask
        await swarm.dht.store("run.matchmaking", dead.to_wire().SerializeToString(), dead.expiration,
                              subkey=owned("member", dead.peer_id))
        matchmaker = Matchmaker(swarm, "run", config(timeout=0.5))
        with pytest.raises(MatchmakingError):
            await matchmaker.form_group(member(swarm))
        assert matchmaker._unreachable == {dead.peer_id: dead.expiration}


async def test_a_group_takes_a_peer_it_would_otherwise_leave_alone() -> None:
    """Three peers, groups of two wanted: one group of three, not two and one left out; a caller that
    says how many come (two) gets a group of two at once."""
    async with fake_swarms(3) as swarms:
        matchmakers = [Matchmaker(s, "run", config(target_size=2, min_size=2, timeout=3.0)) for s in swarms]
        with serving(*matchmakers):
            groups = await form_all(matchmakers, [member(s) for s in swarms])
            assert all(isinstance(g, Group) and g.size == 3 for g in groups), groups
            # the same three, each saying two come: one group of two fixed at once, the third left alone
            start = trio.current_time()
            told = await form_all(matchmakers, [member(s) for s in swarms], expected=2)
            formed = [g for g in told if isinstance(g, Group)]
            assert [g.size for g in formed] == [2, 2] and formed[0].group_id == formed[1].group_id, told
            assert sum(isinstance(g, MatchmakingError) for g in told) == 1, told
            assert trio.current_time() - start < 6.0


async def test_a_leader_that_sees_a_better_one_hands_its_followers_over(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "averaging.matchmaking")
    async with fake_swarms(3) as (best, second, third):
        matchmakers = {s.peer_id: Matchmaker(s, "run", config(target_size=3, min_size=3, timeout=5.0))
                       for s in (best, second, third)}
        with serving(*matchmakers.values()):
            groups: dict[ID, Group] = {}

            async def form(s: FakeSwarm) -> None:
                groups[s.peer_id] = await matchmakers[s.peer_id].form_group(member(s))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(form, second)
                nursery.start_soon(form, third)
                # second leads, third waits in its join
                await wait_until(lambda: (lead := matchmakers[second.peer_id]._lead) is not None and lead.waiting >= 1, 5,
                                 what="third's join held by second")
                nursery.start_soon(form, best)
    assert len({g.group_id for g in groups.values()}) == 1 and len(groups) == 3
    messages = [r.getMessage() for r in caplog.records if r.name == "averaging.matchmaking"]
    assert f"handing 1 followers over to {best.peer_id}" in messages
    assert f"join {second.peer_id}: REDIRECT " in messages
