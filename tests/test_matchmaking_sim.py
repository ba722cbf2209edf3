"""averaging/sim/matchmaking.py, Moshpit's matchmaking played on the simulator's clock, at a few peers
and one step at a time: each peer's declaration, a join's way to a leader and back (held, deferred,
admitted, refused, to a peer gone), the group every member holds, the declaration withdrawn, round
after round on the grid, and the summary's figures. Fast, so that ``make mutate`` runs it for every
mutant of the module (the same code at 150 peers: tests/test_averaging_sim.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from averaging.formation import (Accept, JoinAnswer, Joined, JoinOutcome, Phase, Redirect, Redirected, Refused, Reject,
                                 Unreachable, leader_rank)
from averaging.group import Group, Member, Role
from averaging.matchmaking import MatchmakingConfig, declared_members
from averaging.moshpit import GridPosition
from averaging.sim.matchmaking import SCHEMA, MatchmakingSim, Outcome, SimMatchmaker, _outcome, summary
from p2p.dht.records import DHTKey, DHTRecord, ValueWithExpiration
from p2p.sim.dht import DHTSim, DHTSimConfig, SimPeer, Stored
from p2p.sim.network import Kind

from .kit import numbered_peer_id

pytestmark = pytest.mark.timeout(60)

CONFIG = MatchmakingConfig(target_size=4, min_size=2, gather_time=2.0, timeout=20.0)


def world(config: MatchmakingConfig = CONFIG, *, peers: int = 40, seed: int = 3) -> MatchmakingSim:
    sim = DHTSim(DHTSimConfig(peers=peers, seed=seed, warm=True, churn=False))
    sim.run(10)
    return MatchmakingSim(sim, config)


def of_kind(w: MatchmakingSim, kind: Kind, n: int) -> list[SimMatchmaker]:
    chosen = sorted((m for m in w.peers.values() if m.peer.kind is kind), key=lambda m: m.peer.index)
    assert len(chosen) >= n
    return chosen[:n]


def member(n: int, role: Role = Role.FULL) -> Member:
    return Member(numbered_peer_id(n), (Multiaddr(f"/ip4/10.0.0.{n}/tcp/4001"),), role, SCHEMA)


# ---------------------------------------------------------------------- pure parts


def test_an_accept_naming_us_is_joined_at_our_place_and_one_without_us_refused() -> None:
    members = (member(1), member(2), member(3))
    group = Group(b"g" * 16, members, 0)
    assert _outcome(Accept(group), numbered_peer_id(3)) == Joined(Group(b"g" * 16, members, 2))
    assert _outcome(Accept(group), numbered_peer_id(9)) == Refused("a group without us")
    assert _outcome(Redirect(numbered_peer_id(2)), numbered_peer_id(3)) == Redirected(numbered_peer_id(2))
    assert _outcome(Reject("full"), numbered_peer_id(3)) == Refused("full")


def test_the_summary_gives_times_of_those_grouped_and_the_share_left_alone() -> None:
    members = (member(1), member(2), member(3))
    outcomes = [Outcome(i, float(i + 1), Group(b"g" * 16, members[: 2 + i % 2], 0)) for i in range(30)]
    outcomes += [Outcome(30 + i, 0.5, None) for i in range(10)]  # the quick ones got nothing: not counted in times
    figures = summary(outcomes)
    assert figures == {"peers": 40.0, "formed_p50_s": 15.5, "formed_p95_s": 29.0, "formed_max_s": 30.0,
                       "without_group": 0.25, "group_size_mean": 2.5}
    small = summary([Outcome(0, 3.0, Group(b"g" * 16, members, 1)), Outcome(1, 1.0, Group(b"g" * 16, members, 2))])
    assert (small["formed_p50_s"], small["formed_p95_s"], small["formed_max_s"]) == (2.0, 3.0, 3.0)
    nobody = summary([Outcome(0, 1.0, None)])
    assert nobody["without_group"] == 1.0 and nobody["group_size_mean"] == 0.0
    assert all(math.isnan(nobody[k]) for k in ("formed_p50_s", "formed_p95_s", "formed_max_s"))
    empty = summary([])
    assert (empty["peers"], empty["without_group"], empty["group_size_mean"]) == (0.0, 0.0, 0.0)


# ---------------------------------------------------------------------- the peers


def test_public_peers_match_as_full_members_and_those_behind_nats_as_senders_through_a_relay() -> None:
    w = world()
    assert set(w.peers) == {p.peer_id for p in w.sim.peers if p.alive and p.kind is not Kind.SILENT}
    assert any(p.kind is Kind.SILENT for p in w.sim.peers)  # some were left out
    public, behind = of_kind(w, Kind.PUBLIC, 1)[0], of_kind(w, Kind.UNREACHABLE, 1)[0]
    assert public.me == Member(public.peer.peer_id, (public.peer.addr,), Role.FULL, SCHEMA, 10e6, 10e6, 1.0, True)
    assert behind.me == Member(behind.peer.peer_id, (Multiaddr("/ip4/11.255.0.1/tcp/4001/p2p-circuit"),),
                               Role.SENDER, SCHEMA, 10e6, 10e6, 1.0, False)
    assert (public.formation, public.lead, public.unreachable, public.deferred, public.held) == (None, None, {}, [], [])
    assert (w.group_id(), w.group_id()) == ((1).to_bytes(16, "big"), (2).to_bytes(16, "big"))


def test_a_bad_config_is_refused_when_the_world_is_made() -> None:
    sim = DHTSim(DHTSimConfig(peers=10, seed=1, warm=True, churn=False))
    with pytest.raises(Exception, match="min_size"):
        MatchmakingSim(sim, MatchmakingConfig(target_size=4, min_size=5))


# ---------------------------------------------------------------------- a round


def run_round(w: MatchmakingSim, cells: dict[ID, str], spread: float = 1.0, until: float = 40.0) -> list[Outcome]:
    finished: list[list[Outcome]] = []
    w.round(cells, spread, finished.append)
    w.sim.run(w.sim.now + until)
    assert len(finished) == 1  # once, when the last peer is done
    return finished[0]


def read_cell(w: MatchmakingSim, reader: SimMatchmaker, cell: str) -> ValueWithExpiration | None:
    got: list[ValueWithExpiration | None] = []
    w.sim.read(reader.peer, DHTKey.encode(f"sim.matchmaking.{cell}"), lambda s, value, stalled: got.append(value),
               latest=True)
    w.sim.run(w.sim.now + 10)
    assert len(got) == 1
    return got[0]


def test_peers_under_one_key_form_one_group_that_each_holds_and_then_withdraw_their_declarations() -> None:
    w = world()
    peers = of_kind(w, Kind.PUBLIC, 3) + of_kind(w, Kind.UNREACHABLE, 1)
    began, began_wall = w.sim.now, w.sim.wall()
    outcomes = run_round(w, {m.peer.peer_id: "c0" for m in peers}, until=12.0)  # read before they expire
    assert sorted(o.peer for o in outcomes) == sorted(m.peer.index for m in peers)
    groups = {o.group.group_id: o.group.members for o in outcomes if o.group is not None}
    assert len(groups) == 1 and len(next(iter(groups.values()))) == 4  # everybody, in one group
    for o in outcomes:
        assert o.group is not None and o.group.members[o.group.my_index].peer_id == w.sim.peers[o.peer].peer_id
        assert 0 < o.seconds < CONFIG.timeout and o.seconds <= w.sim.now - began
    members = next(iter(groups.values()))
    assert [m.peer_id.to_bytes() for m in members] == sorted(m.peer_id.to_bytes() for m in members)
    for m in members:  # each as it declared itself: its capacity, and a declaration that outlives the round
        assert (m.schema, m.upload, m.download, m.compute) == (SCHEMA, 10e6, 10e6, 1.0)
        assert began_wall + CONFIG.timeout + 5.0 <= m.expiration <= began_wall + 1.0 + CONFIG.timeout + 5.0
    assert {m.peer_id: m.role for m in members} == {m.peer.peer_id: m.me.role for m in peers}
    assert all(m.formation is None and m.lead is None and not m.deferred and not m.held for m in peers)
    # the declarations were there while they matched, and are withdrawn now
    value = read_cell(w, peers[0], "c0")
    assert value is not None and isinstance(value.value, dict) and len(value.value) == 4
    assert all(entry.value == b"" for entry in value.value.values())
    assert declared_members(value, peers[0].me, w.sim.wall()) == [peers[0].me]


def test_a_peer_alone_under_its_key_fails_at_the_deadline_and_its_declaration_stays() -> None:
    w = world()
    alone = of_kind(w, Kind.PUBLIC, 1)[0]
    began, began_wall = w.sim.now, w.sim.wall()
    outcomes = run_round(w, {alone.peer.peer_id: "lonely"}, spread=0.0, until=CONFIG.timeout + 1.5)
    assert [(o.peer, o.group) for o in outcomes] == [(alone.peer.index, None)]
    assert outcomes[0].seconds == pytest.approx(CONFIG.timeout, abs=1e-6)  # its last wait cut at the deadline
    assert w.sim.now - began >= outcomes[0].seconds
    value = read_cell(w, alone, "lonely")  # not withdrawn: it expires by itself
    assert value is not None and isinstance(value.value, dict)
    [entry] = value.value.values()
    assert entry.value != b"" and entry.expiration == pytest.approx(began_wall + CONFIG.timeout + 5.0, rel=0, abs=1e-6)


def test_a_formation_stores_its_declaration_again_as_the_matchmaker_does_until_it_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At the next poll while no replica took it, every 5 s once one did, a later store that none took
    too (averaging.formation.redeclare_after); never once the formation ended."""
    w = world()
    alone = of_kind(w, Kind.PUBLIC, 1)[0]
    real_store = w.sim.store
    stores: list[list[float]] = []  # each store of its declaration: [began, ended]

    def store(peer: SimPeer, record: DHTRecord, finished: Callable[[Stored], None], **kw: bool) -> None:
        if peer is alone.peer and record.value:
            lost = len(stores) in (0, 2)  # the first and the third reach no replica
            stores.append([w.sim.now])

            def done(result: Stored) -> None:
                stores[-1].append(w.sim.now)
                finished(Stored(result.seconds, result.lookup_s, [], result.stalled) if lost else result)
            real_store(peer, record, done, **kw)
        else:
            real_store(peer, record, finished, **kw)

    monkeypatch.setattr(w.sim, "store", store)
    began = w.sim.now
    run_round(w, {alone.peer.peer_id: "lonely"}, spread=0.0, until=CONFIG.timeout + 10)
    gaps = [round(b[0] - a[1], 6) for a, b in zip(stores, stores[1:])]
    assert len(stores) >= 4 and stores[0][0] == began and all(t[0] < began + CONFIG.timeout for t in stores)
    assert gaps[0] == max(1.0, CONFIG.poll_interval)  # lost: again at the next poll (1 s at least)
    assert gaps[1:] == [5.0] * (len(stores) - 2)  # then every 5 s, one took it (a later loss too)


def test_peers_under_different_keys_never_group_together() -> None:
    w = world()
    peers = of_kind(w, Kind.PUBLIC, 4)
    cells = {m.peer.peer_id: f"c{i % 2}" for i, m in enumerate(peers)}
    outcomes = run_round(w, cells)
    for o in outcomes:
        assert o.group is not None and o.group.size == 2
        assert len({cells[m.peer_id] for m in o.group.members}) == 1
    assert len({o.group.group_id for o in outcomes if o.group}) == 2


def test_a_cell_past_the_target_splits_or_absorbs_but_leaves_nobody_alone() -> None:
    w = world(MatchmakingConfig(target_size=2, min_size=2, gather_time=2.0, timeout=20.0))
    peers = of_kind(w, Kind.PUBLIC, 5)
    outcomes = run_round(w, {m.peer.peer_id: "c" for m in peers})
    sizes = sorted(o.group.size for o in outcomes if o.group is not None)
    assert len(sizes) == 5 and set(sizes) <= {2, 3}  # two groups: 2 + 3 (one absorbed over the target)
    assert len({o.group.group_id for o in outcomes if o.group}) == 2


# ---------------------------------------------------------------------- a join, one at a time


def steady(w: MatchmakingSim, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path alike from now on (a round trip of 0.2 s), nothing lost, no two peers connected."""
    monkeypatch.setattr(w.sim.model, "rtt", lambda a, b: 0.2)
    monkeypatch.setattr(w.sim.model, "one_way", lambda a, b, rng: 0.1)
    for p in w.sim.peers:
        p.connected.clear()


def ask(w: MatchmakingSim, asker: SimMatchmaker, leader: Member) -> list[tuple[float, JoinOutcome]]:
    answers: list[tuple[float, JoinOutcome]] = []
    w.join(asker, leader, lambda outcome: answers.append((w.sim.now, outcome)))
    return answers


def test_a_join_to_a_peer_gone_fails_as_a_dial_does_after_the_rpc_timeout() -> None:
    w = world()
    asker, dead = of_kind(w, Kind.PUBLIC, 2)
    dead.peer.alive = False
    for gone in (member(99), dead.me):  # one never seen, one that left
        began = w.sim.now
        answers = ask(w, asker, gone)
        w.sim.run(w.sim.now + 30)
        [(at, outcome)] = answers
        assert outcome == Unreachable("gone") and at == pytest.approx(began + w.sim.config.dht.rpc_timeout)


def test_a_join_to_a_peer_not_matching_is_held_a_poll_interval_then_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    w = world()
    steady(w, monkeypatch)
    asker, leader = of_kind(w, Kind.PUBLIC, 2)
    began = w.sim.now
    answers = ask(w, asker, leader.me)
    w.sim.run(began + 0.6)  # there (a connection and one way: 0.5 s), not yet refused
    assert answers == [] and len(leader.held) == 1
    w.sim.run(began + 30)
    [(at, outcome)] = answers
    assert outcome == Refused("not matching now") and at == pytest.approx(began + 0.5 + CONFIG.poll_interval + 0.1)
    assert leader.held == []


def test_a_join_held_until_the_leader_starts_is_answered_by_its_formation(monkeypatch: pytest.MonkeyPatch) -> None:
    config = MatchmakingConfig(target_size=4, min_size=2, gather_time=2.0, timeout=20.0, poll_interval=5.0)
    w = world(config)
    steady(w, monkeypatch)
    asker, leader = of_kind(w, Kind.PUBLIC, 2)
    answers = ask(w, asker, leader.me)
    w.sim.run(w.sim.now + 0.6)
    assert len(leader.held) == 1
    done: list[Outcome] = []
    leader.form_group("held", done.append)  # its declaration stored well within the poll interval
    w.sim.run(w.sim.now + config.poll_interval + 30)
    assert not leader.held and len(answers) == 1 and len(done) == 1
    outcome = answers[0][1]
    assert outcome != Refused("not matching now")  # its formation answered, not the poll interval's end
    group = done[0].group
    assert group is not None and isinstance(outcome, Joined) and outcome.group.members == group.members
    assert outcome.group.index_of(asker.peer.peer_id) == outcome.group.my_index


def test_a_join_takes_a_connection_first_and_two_legs_each_way_through_a_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    w = world()
    steady(w, monkeypatch)
    asker, public = of_kind(w, Kind.PUBLIC, 2)
    behind = of_kind(w, Kind.UNREACHABLE, 1)[0]
    for target, legs in ((public, 1), (behind, 2)):
        asker.peer.connected.discard(target.peer.index)  # the DHT's own traffic may have connected them
        target.peer.connected.discard(asker.peer.index)
        for setup in (2 * legs * 0.2, 0.0):  # a connection opened (a round trip per leg, twice), then used
            began = w.sim.now
            answers = ask(w, asker, target.me)
            w.sim.run(w.sim.now + 30)
            [(at, outcome)] = answers
            assert outcome == Refused("not matching now")
            assert at == pytest.approx(began + setup + legs * 0.1 + CONFIG.poll_interval + legs * 0.1)
            assert w.sim.connected(asker.peer, target.peer) and w.sim.connected(target.peer, asker.peer)


# ---------------------------------------------------------------------- rounds on the grid


def spy_starts(w: MatchmakingSim, peers: list[SimMatchmaker]) -> dict[ID, list[tuple[float, str]]]:
    """Each peer's formations as they begin: when, and under which key."""
    starts: dict[ID, list[tuple[float, str]]] = {m.peer.peer_id: [] for m in peers}
    for m in peers:
        form: Callable[[str, Callable[[Outcome], None]], None] = m.form_group

        def spy(cell: str, done: Callable[[Outcome], None], m: SimMatchmaker = m,
                form: Callable[[str, Callable[[Outcome], None]], None] = form) -> None:
            starts[m.peer.peer_id].append((w.sim.now, cell))
            form(cell, done)
        m.form_group = spy  # type: ignore[method-assign]
    return starts


def test_a_round_starts_every_peer_within_the_spread_under_its_own_key() -> None:
    w = world()
    peers = of_kind(w, Kind.PUBLIC, 4)
    starts = spy_starts(w, peers)
    t0 = w.sim.now
    cells = {m.peer.peer_id: f"c{i % 2}" for i, m in enumerate(peers)}
    run_round(w, cells, spread=0.5)
    for pid, [(at, cell)] in starts.items():
        assert t0 <= at <= t0 + 0.5 and cell == cells[pid]
    assert len({at for [(at, _)] in starts.values()}) == 4  # drawn, each its own


def test_rounds_move_each_grouped_peer_on_the_grid_and_start_each_round_a_period_apart() -> None:
    w = world(MatchmakingConfig(target_size=2, min_size=2, gather_time=1.0, timeout=8.0))
    peers = of_kind(w, Kind.PUBLIC, 4)
    initial = {m.peer.peer_id: (i % 2, 0) for i, m in enumerate(peers)}  # two cells of two
    grid = {pid: GridPosition(2, digits) for pid, digits in initial.items()}
    starts = spy_starts(w, peers)
    finished: list[tuple[float, list[int], list[list[Outcome]]]] = []
    t0 = w.sim.now
    w.rounds(grid, 2, 0.5, 12.0, lambda rounds: finished.append((w.sim.now, [len(r) for r in rounds], rounds)))
    w.sim.run(t0 + 12 + 8 + 10)
    [(ended, sizes, per_round)] = finished
    assert sizes == [4, 4]  # called once, when every peer had finished every round
    group_in = [{w.sim.peers[o.peer].peer_id: o.group for o in r} for r in per_round]
    for pid, [(first, first_key), (second, second_key)] in starts.items():
        assert t0 <= first <= t0 + 0.5 and t0 + 12 <= second <= t0 + 12.5 and second <= ended
        expected = GridPosition(2, initial[pid])
        assert first_key == expected.key
        for r in (0, 1):
            group = group_in[r][pid]
            assert group is not None and group.size == 2
            expected.advance(group.my_index, group.group_id)
            if r == 0:
                assert second_key == expected.key  # the second round under the key the first gave it
        assert grid[pid].digits == expected.digits


def test_a_round_that_runs_past_the_period_starts_the_next_at_once() -> None:
    w = world(MatchmakingConfig(target_size=2, min_size=2, gather_time=1.0, timeout=8.0))
    alone = of_kind(w, Kind.PUBLIC, 1)[0]
    grid = {alone.peer.peer_id: GridPosition(2, (0, 0))}
    starts = spy_starts(w, [alone])
    per_round: list[list[list[Outcome]]] = []
    t0 = w.sim.now
    w.rounds(grid, 2, 0.0, 1.0, per_round.append)  # a period of 1 s, a round of 8 s (nobody to group with)
    w.sim.run(t0 + 30)
    [[(first,), (second,)]] = per_round
    assert first.group is None and second.group is None and grid[alone.peer.peer_id].digits == (0, 0)
    [(began, key), (again, key_again)] = starts[alone.peer.peer_id]
    assert began == t0 and again == pytest.approx(t0 + first.seconds) and key == key_again  # at once, in place


# ---------------------------------------------------------------------- joins asked of a peer already matching


def test_a_join_asked_while_the_peer_looks_is_deferred_then_refused_if_it_still_cannot_lead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer behind a NAT (it cannot lead) looks for a leader, poll after poll: a join asked of it
    meanwhile waits a poll interval, is asked again, and is refused ("not leading"), not held to the end."""
    w = world()
    steady(w, monkeypatch)
    sender = of_kind(w, Kind.UNREACHABLE, 1)[0]
    asker = of_kind(w, Kind.PUBLIC, 1)[0]
    sender.form_group("no-leader", lambda outcome: None)
    w.sim.run(w.sim.now + 3)
    assert sender.formation is not None and sender.formation.phase is Phase.LOOKING
    answers: list[tuple[float, JoinAnswer]] = []
    asked = w.sim.now
    sender.on_join(asker.me, lambda answer: answers.append((w.sim.now, answer)))
    assert answers == [] and len(sender.deferred) == 1
    w.sim.run(asked + CONFIG.poll_interval + 0.01)
    [(at, answer)] = answers
    assert answer == Reject("not leading") and at == pytest.approx(asked + CONFIG.poll_interval)
    assert not sender.deferred


def test_joins_deferred_are_each_answered_once_and_the_others_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    w = world()
    steady(w, monkeypatch)
    sender = of_kind(w, Kind.UNREACHABLE, 1)[0]
    askers = of_kind(w, Kind.PUBLIC, 2)
    sender.form_group("no-leader", lambda outcome: None)
    w.sim.run(w.sim.now + 3)
    answers: list[tuple[int, JoinAnswer]] = []
    sender.on_join(askers[0].me, lambda answer: answers.append((0, answer)))
    w.sim.run(w.sim.now + CONFIG.poll_interval / 2)
    sender.on_join(askers[1].me, lambda answer: answers.append((1, answer)))
    w.sim.run(w.sim.now + CONFIG.poll_interval / 2 + 0.01)
    assert answers == [(0, Reject("not leading"))] and len(sender.deferred) == 1
    w.sim.run(w.sim.now + CONFIG.poll_interval / 2)
    assert answers == [(0, Reject("not leading")), (1, Reject("not leading"))] and not sender.deferred


def test_a_join_to_a_leader_waiting_for_joins_wakes_it_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Target 2: the leader fixes its group the moment the join that fills it arrives, not at the
    end of its wait (the follower starts 2.5 s after it: its join comes during a wait, not a read)."""
    w = world(MatchmakingConfig(target_size=2, min_size=2, gather_time=2.0, timeout=20.0))
    steady(w, monkeypatch)
    leader, follower = sorted(of_kind(w, Kind.PUBLIC, 2), key=lambda m: leader_rank(m.me))
    arrivals: list[tuple[float, bool]] = []
    on_join = leader.on_join

    def spy(member: Member, reply: Callable[[JoinAnswer], None]) -> None:
        arrivals.append((w.sim.now, leader.lead is not None and leader.lead.awaiting is not None))
        on_join(member, reply)
    leader.on_join = spy  # type: ignore[method-assign]
    fixed: list[float] = []
    leader.form_group("pair", lambda outcome: fixed.append(w.sim.now))
    w.sim.run(w.sim.now + 2.5)
    follower.form_group("pair", lambda outcome: None)
    w.sim.run(w.sim.now + 20)
    [(arrived, awaiting)] = arrivals
    assert awaiting and fixed == [pytest.approx(arrived)]  # it was waiting, and fixed the group then


def test_a_leader_found_gone_is_remembered_across_formations_until_its_declaration_expires(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = world()
    steady(w, monkeypatch)
    a, b = sorted(of_kind(w, Kind.PUBLIC, 2), key=lambda m: leader_rank(m.me))  # a would lead b
    a.form_group("gone", lambda outcome: None)
    w.sim.run(w.sim.now + 2)  # its declaration stored
    a.peer.alive = False
    declared = a.formation.me if a.formation is not None else None
    assert declared is not None
    outcomes: list[Outcome] = []
    b.form_group("gone", outcomes.append)
    w.sim.run(w.sim.now + CONFIG.timeout + 2)
    assert b.unreachable == {a.peer.peer_id: declared.expiration}  # the matchmaker's, not the formation's alone
    assert [o.group for o in outcomes] == [None]  # it led alone after: nobody else came


def test_a_join_deferred_by_a_formation_whose_store_outlasted_its_timeout_is_refused_at_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the store takes 1.8 s here: past the timeout, within the poll interval the held join waits
    w = world(MatchmakingConfig(target_size=4, min_size=2, gather_time=0.0, timeout=0.05, poll_interval=5.0))
    steady(w, monkeypatch)
    leader, asker = of_kind(w, Kind.PUBLIC, 2)
    answers: list[tuple[float, JoinAnswer]] = []
    began = w.sim.now
    leader.on_join(asker.me, lambda answer: answers.append((w.sim.now, answer)))  # before its formation: held
    outcomes: list[Outcome] = []
    leader.form_group("late", outcomes.append)
    w.sim.run(w.sim.now + 10)
    [(at, answer)] = answers  # deferred by the formation, which failed at once: refused then
    assert answer == Reject("not matching now") and at == pytest.approx(began + outcomes[0].seconds)
    assert [o.group for o in outcomes] == [None] and 1 < outcomes[0].seconds < 5
    assert not leader.deferred and not leader.held


def test_a_leader_that_finds_a_better_one_sends_its_waiting_followers_there_and_follows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """b leads alone, c's join is admitted and waits; then a (a better leader) declares itself: b's
    next read hands its lead over, c is told to go to a, and b joins a's group too."""
    w = world(MatchmakingConfig(target_size=4, min_size=2, gather_time=8.0, timeout=20.0))
    steady(w, monkeypatch)
    a, b, c = sorted(of_kind(w, Kind.PUBLIC, 3), key=lambda m: leader_rank(m.me))
    outcomes: dict[str, list[Outcome]] = {"a": [], "b": []}
    b.form_group("hand-over", outcomes["b"].append)
    w.sim.run(w.sim.now + 3)
    assert b.formation is not None and b.formation.phase is Phase.LEADING and b.lead is not None
    answers: list[tuple[float, JoinAnswer]] = []
    b.on_join(c.me, lambda answer: answers.append((w.sim.now, answer)))
    assert answers == [] and [m for m, _ in b.lead.waiting] == [c.me]  # admitted, waiting for the group
    a.form_group("hand-over", outcomes["a"].append)
    w.sim.run(w.sim.now + 30)
    assert [answer for _, answer in answers] == [Redirect(a.peer.peer_id)]
    [ours], [theirs] = outcomes["a"], outcomes["b"]
    assert ours.group is not None and theirs.group is not None and ours.group.members == theirs.group.members
    assert {m.peer_id for m in ours.group.members} == {a.peer.peer_id, b.peer.peer_id}


def test_a_join_deferred_during_the_first_read_is_answered_the_moment_the_peer_leads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its formation moved (looking → leading): the join deferred meanwhile is admitted then, not
    a poll interval later when it would be asked again."""
    w = world(MatchmakingConfig(target_size=4, min_size=2, gather_time=8.0, timeout=20.0, poll_interval=5.0))
    steady(w, monkeypatch)
    leader, asker = sorted(of_kind(w, Kind.PUBLIC, 2), key=lambda m: leader_rank(m.me))
    leader.form_group("first-read", lambda outcome: None)
    while leader.formation is None:  # stored: its first read is under way
        w.sim.run(w.sim.now + 0.01)
    assert leader.formation.phase is Phase.LOOKING
    leader.on_join(asker.me, lambda answer: None)
    assert len(leader.deferred) == 1
    while leader.formation.phase is Phase.LOOKING:
        w.sim.run(w.sim.now + 0.01)
    assert leader.deferred == [] and leader.lead is not None and [m for m, _ in leader.lead.waiting] == [asker.me]


def test_the_timer_of_a_wait_a_join_ended_does_not_end_the_next_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A join ends the leader's wait at once; that wait's own timer, still set, must find a later
    wait and leave it be: the leader reads again at the end of the new wait, not before."""
    w = world(MatchmakingConfig(target_size=4, min_size=2, gather_time=8.0, timeout=20.0, poll_interval=5.0))
    steady(w, monkeypatch)
    leader, asker = sorted(of_kind(w, Kind.PUBLIC, 2), key=lambda m: leader_rank(m.me))
    reads: list[float] = []
    read = w.sim.read

    def spy(peer: SimPeer, key: bytes, finished: Callable[[float, ValueWithExpiration | None, bool], None],
            **options: bool) -> None:
        if peer is leader.peer:
            reads.append(w.sim.now)
        read(peer, key, finished, **options)
    monkeypatch.setattr(w.sim, "read", spy)
    leader.form_group("waits", lambda outcome: None)
    while leader.lead is None or leader.lead.awaiting is None:
        w.sim.run(w.sim.now + 0.01)
    first_wait = w.sim.now
    w.sim.run(first_wait + 1)
    reads.clear()
    leader.on_join(asker.me, lambda answer: None)  # ends the first wait: a read, then a second wait
    w.sim.run(first_wait + 5 + 0.5)  # past the first wait's timer, within the second wait
    assert reads == [pytest.approx(first_wait + 1)] and leader.lead is not None and leader.lead.awaiting is not None
