"""Moshpit at a thousand peers (averaging/sim/moshpit.py): the project's grid code, its rule for a
failed round, and the baseline of random groups; bench/scale.py prints the whole table."""

from __future__ import annotations

from collections import defaultdict

import pytest
from libp2p.peer.id import ID

from averaging.matchmaking import MatchmakingConfig
from averaging.moshpit import GridPosition, rounds_to_average
from averaging.sim.matchmaking import MatchmakingSim, Outcome, summary
from averaging.sim.moshpit import Grouping, MoshpitSimConfig, Positions, simulate
from p2p.sim.dht import DHTSim, DHTSimConfig
from p2p.sim.network import Kind


def test_a_full_grid_reaches_the_exact_average_in_d_rounds_and_random_groups_do_not() -> None:
    full = simulate(MoshpitSimConfig(peers=1000, group_size=10, dims=3, positions=Positions.FULL, rounds=4))
    assert rounds_to_average(1000, 10) == 3
    assert full.distance[2] > 1e-4 and full.distance[3] < 1e-25  # exact at round d = 3, not before
    assert full.rounds_to(1e-6) == 3 and full.alone == 0 and full.groups == 4 * 100
    random_groups = simulate(MoshpitSimConfig(peers=1000, group_size=10, grouping=Grouping.RANDOM, rounds=8))
    assert random_groups.distance[3] > 1e-4  # about ten times closer per round, never exact
    assert random_groups.rounds_to(1e-6) == 7
    with pytest.raises(ValueError, match="full grid"):
        simulate(MoshpitSimConfig(peers=999, positions=Positions.FULL))


def test_a_group_that_failed_moves_on_with_the_grid_and_nobody_is_left_alone() -> None:
    settings = dict(peers=1000, group_size=10, dims=3, positions=Positions.FULL, failure_rate=0.001, rounds=12)
    moving = simulate(MoshpitSimConfig(**settings))  # type: ignore[arg-type]
    staying = simulate(MoshpitSimConfig(**settings, advance_after_failure=False))  # type: ignore[arg-type]
    assert moving.failed_groups > 0 and moving.alone == 0
    assert staying.alone > 100  # out of phase: alone under their old key
    assert moving.rounds_to(1e-6) is not None and staying.rounds_to(1e-6) is not None
    assert moving.rounds_to(1e-6) < staying.rounds_to(1e-6)  # type: ignore[operator]
    # never farther (but for rounding, once the distance is down at 1e-34)
    assert all(b <= a * (1 + 1e-9) + 1e-30 for a, b in zip(moving.distance, moving.distance[1:]))


def test_first_keys_from_peer_ids_fill_cells_unevenly() -> None:
    run = simulate(MoshpitSimConfig(peers=1000, group_size=10, dims=3, rounds=6))
    assert run.groups > 6 * 100  # cells over m split into more groups
    assert run.alone > 0 and run.distance[3] > 1e-4  # not exact in d rounds


@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
def test_matchmaking_over_the_simulated_dht_forms_whole_groups_under_each_key() -> None:
    sim = DHTSim(DHTSimConfig(peers=150, seed=12, warm=True, churn=False))
    sim.run(20)
    world = MatchmakingSim(sim, MatchmakingConfig(target_size=5, min_size=2, gather_time=2.0, timeout=30.0))
    cells = {pid: GridPosition.initial(5, 3, pid.to_bytes()).key for pid in world.peers}
    outcomes: list[Outcome] = []
    world.round(cells, 1.0, outcomes.extend)
    sim.run(sim.now + 60)
    assert len(outcomes) == len(world.peers) > 100
    formed = [o for o in outcomes if o.group is not None]
    assert len(formed) >= 0.85 * len(outcomes)
    views: dict[bytes, set[tuple[bytes, ...]]] = defaultdict(set)
    reported: dict[bytes, int] = defaultdict(int)
    for o in formed:
        assert o.group is not None
        members = tuple(m.peer_id.to_bytes() for m in o.group.members)
        views[o.group.group_id].add(members)
        reported[o.group.group_id] += 1
        assert o.group.members[o.group.my_index].peer_id == sim.peers[o.peer].peer_id
        assert len({cells[m.peer_id] for m in o.group.members}) == 1  # one cell's peers
        assert 2 <= o.group.size <= 5 + 1 and any(m.role.reduces for m in o.group.members)  # + min_size - 1
    assert all(len(v) == 1 for v in views.values())  # every member holds the same group
    assert all(reported[g] == len(next(iter(v))) for g, v in views.items())  # and each of them got it
    figures = summary(outcomes)
    assert figures["formed_p95_s"] < 30 and 0 <= figures["without_group"] <= 0.15


def test_a_cell_of_one_more_than_the_target_leaves_nobody_alone() -> None:
    """What bench/scale.py found at 1,000 peers: a cell of m + 1 peers formed a full group of m
    and left one alone each round (min_size 2). In cells of 6 with a target of 5, every peer gets a
    group now; before, one peer in six (~17%) had none."""
    sim = DHTSim(DHTSimConfig(peers=150, seed=12, warm=True, churn=False))
    sim.run(20)
    world = MatchmakingSim(sim, MatchmakingConfig(target_size=5, min_size=2, gather_time=2.0, timeout=30.0))
    cells = {pid: f"cell{i // 6}" for i, pid in enumerate(sorted(world.peers, key=lambda p: p.to_bytes()))}
    cells = {pid: key for pid, key in cells.items() if sum(k == key for k in cells.values()) == 6}
    outcomes: list[Outcome] = []
    world.round(cells, 1.0, outcomes.extend)
    sim.run(sim.now + 60)
    assert len(outcomes) == len(cells) >= 96
    assert summary(outcomes)["without_group"] <= 0.03
    assert max(o.group.size for o in outcomes if o.group is not None) == 6


@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
def test_matchmaking_round_after_round_moves_each_peer_on_the_grid_by_its_index() -> None:
    """bench/scale.py's --matchmaking-rounds: every peer matches round after round (a training run's
    steps, one every period), each round under the key its grid gives it after the last one."""
    sim = DHTSim(DHTSimConfig(peers=150, seed=12, warm=True, churn=False))
    sim.run(20)
    world = MatchmakingSim(sim, MatchmakingConfig(target_size=5, min_size=2, gather_time=2.0, timeout=15.0))
    grid = {pid: GridPosition.initial(5, 3, pid.to_bytes()) for pid in world.peers}
    first = {pid: g.key for pid, g in grid.items()}
    per_round: list[list[Outcome]] = []
    world.rounds(grid, 3, 1.0, 16.0, per_round.extend)
    sim.run(sim.now + 2 * 16 + 17)  # the last round's deadline, and its answers
    assert [len(r) for r in per_round] == [len(world.peers)] * 3
    by_peer: dict[ID, list[Outcome]] = {sim.peers[o.peer].peer_id: [] for o in per_round[0]}
    for r in per_round:
        for o in r:
            by_peer[sim.peers[o.peer].peer_id].append(o)
    always = 0
    for pid, (a, b, c) in by_peer.items():
        if a.group and b.group and c.group:
            always += 1
            expected = GridPosition(5, tuple(int(x) for x in first[pid].split(".")))
            for o in (a, b, c):
                assert o.group is not None
                expected.advance(o.group.my_index, o.group.group_id)
            assert grid[pid].digits == expected.digits  # each round's index, turned by its group's offset
        elif not (a.group or b.group or c.group):
            assert grid[pid].key == first[pid]  # without a group it stays where it was
    assert always >= 0.8 * len(by_peer)
    for r in per_round:
        assert summary(r)["without_group"] <= 0.15
        views: dict[bytes, set[tuple[bytes, ...]]] = defaultdict(set)
        for o in r:
            if o.group is not None:
                views[o.group.group_id].add(tuple(m.peer_id.to_bytes() for m in o.group.members))
        assert all(len(v) == 1 for v in views.values())  # one group, one membership, within a round


def test_senders_a_full_group_would_leave_behind_join_it() -> None:
    """What bench/scale.py found after the cells of m + 1: cells of 12 or 13 (m = 10) left two or
    three senders behind NATs, who can neither lead nor reduce, without a group. Here cells of two
    public peers and four behind NATs, target 4: the leader's group fills with three of the other
    five, and the two left are both senders in six cells of ten: 8 of 48 peers without a group before,
    2 now (a leader that had not read them yet fixed its group at the target)."""
    sim = DHTSim(DHTSimConfig(peers=150, seed=12, warm=True, churn=False))
    sim.run(20)
    world = MatchmakingSim(sim, MatchmakingConfig(target_size=4, min_size=2, gather_time=2.0, timeout=30.0))
    public = sorted((p for p in world.peers if world.peers[p].peer.kind is Kind.PUBLIC), key=lambda p: p.to_bytes())
    behind = sorted((p for p in world.peers if world.peers[p].peer.kind is Kind.UNREACHABLE), key=lambda p: p.to_bytes())
    n = min(len(public) // 2, len(behind) // 4)
    cells = {pid: f"cell{i // 2}" for i, pid in enumerate(public[: 2 * n])}
    cells.update({pid: f"cell{i // 4}" for i, pid in enumerate(behind[: 4 * n])})
    outcomes: list[Outcome] = []
    world.round(cells, 1.0, outcomes.extend)
    sim.run(sim.now + 60)
    assert n >= 8 and len(outcomes) == 6 * n
    assert summary(outcomes)["without_group"] <= 0.07
    assert max(o.group.size for o in outcomes if o.group is not None) >= 5  # over the target: the senders came
