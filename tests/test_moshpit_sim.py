"""averaging.sim.moshpit at a few peers, each rule alone: the full grid's positions, groups per key
and at random, a group's average, a failed group's round (strict: nobody changes) and its move on
the grid, the counts of a run. tests/test_averaging_sim.py runs it at a thousand peers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from averaging.moshpit import GridPosition
from averaging.sim import moshpit as sim
from averaging.sim.moshpit import Grouping, MoshpitRun, MoshpitSimConfig, Positions, simulate


def full(**overrides: object) -> MoshpitSimConfig:
    """Eight peers on a full 2 x 2 x 2 grid."""
    settings: dict[str, object] = {"peers": 8, "group_size": 2, "dims": 3, "positions": Positions.FULL, "rounds": 4,
                                   "width": 3}
    settings.update(overrides)
    return MoshpitSimConfig(**settings)  # type: ignore[arg-type]


def test_the_defaults() -> None:
    config = MoshpitSimConfig()
    assert (config.peers, config.group_size, config.dims, config.failure_rate, config.rounds) == (1000, 10, 3, 0.0, 30)
    assert (config.grouping, config.positions, config.width, config.seed, config.advance_after_failure) == (
        Grouping.GRID, Positions.PEER_IDS, 16, 0, True)
    assert (Grouping.GRID.value, Grouping.RANDOM.value) == ("grid", "random")
    assert (Positions.PEER_IDS.value, Positions.FULL.value) == ("peer-ids", "full")


def test_the_first_round_under_a_threshold_and_never_round_zero() -> None:
    run = MoshpitRun(MoshpitSimConfig(), [1.0, 0.5, 0.1, 0.1, 0.01], 0, 0, 0)
    assert run.rounds_to(1.0) == 1  # round 0 is the start, at 1.0 by definition
    assert run.rounds_to(0.1) == 2  # at most the threshold
    assert run.rounds_to(0.05) == 4
    assert run.rounds_to(0.001) is None


def test_digits_of_a_number_in_a_base_highest_first() -> None:
    assert sim._digits(5, 2, 3) == (1, 0, 1)
    assert sim._digits(7, 10, 2) == (0, 7)
    assert sim._digits(123, 10, 2) == (2, 3)  # only the lowest ``count``
    assert sim._digits(9, 3, 0) == ()


def test_a_full_grid_needs_m_to_the_d_peers_and_says_so() -> None:
    with pytest.raises(ValueError, match=r"^a full grid needs peers = group_size \*\* dims \(2 \*\* 3 != 9\)$"):
        simulate(full(peers=9))


def test_a_full_grid_averages_exactly_in_d_rounds_with_every_peer_in_a_group() -> None:
    run = simulate(full())
    assert len(run.distance) == 5 and run.distance[0] == 1.0
    assert run.distance[1] > run.distance[2] > 1e-3 and run.distance[3] < 1e-25
    assert (run.groups, run.alone, run.failed_groups) == (4 * 4, 0, 0)
    assert run.rounds_to(1e-20) == 3
    assert run.config == full()


def test_a_group_takes_its_members_mean() -> None:
    one = simulate(full(peers=2, group_size=2, dims=1, rounds=1, width=5))  # one cell: everyone, once
    assert one.distance == [1.0, 0.0] and one.groups == 1


def test_the_distance_is_to_the_mean_of_all_and_relative_to_the_start() -> None:
    run = simulate(full(rounds=1, seed=5))
    values = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mean = values.mean(0)
    start = float(((values - mean) ** 2).sum())
    # round 1 on the full grid: peers 2k and 2k + 1 (the same first digits) meet
    values = values.reshape(4, 2, 3).mean(1, keepdim=True).expand(4, 2, 3).reshape(8, 3)
    assert run.distance[1] == pytest.approx(float(((values - mean) ** 2).sum()) / start)


def test_a_run_is_a_function_of_its_seed() -> None:
    config = MoshpitSimConfig(peers=40, group_size=4, dims=3, rounds=5, seed=3, failure_rate=0.1)
    assert simulate(config) == simulate(config)
    assert simulate(config).distance != simulate(replace(config, seed=4)).distance


def test_every_group_failing_changes_nobody_and_each_is_counted() -> None:
    run = simulate(full(failure_rate=1.0))
    assert run.distance == [1.0] * 5
    assert run.failed_groups == run.groups == 16


def test_a_member_fails_with_the_failure_rate() -> None:
    never = simulate(full(failure_rate=0.0, rounds=3))
    assert never.failed_groups == 0
    some = simulate(MoshpitSimConfig(peers=200, group_size=4, dims=2, rounds=10, failure_rate=0.05, width=2))
    # a group of g fails with 1 - 0.95 ** g: about a sixth of groups of four
    assert 0.08 < some.failed_groups / some.groups < 0.3


def test_a_failed_group_moves_on_the_grid_unless_told_to_stay() -> None:
    # Every group fails: staying, the same groups meet again every round; moving, they follow the
    # grid as if they had averaged. Cells of PEER_IDS positions hold uneven numbers, so the peers
    # left alone differ between the two.
    config = MoshpitSimConfig(peers=60, group_size=3, dims=3, rounds=6, failure_rate=1.0, width=2, seed=1)
    staying = simulate(replace(config, advance_after_failure=False))
    first = simulate(replace(config, advance_after_failure=False, rounds=1))
    assert staying.alone == 6 * first.alone and staying.groups == 6 * first.groups
    moving = simulate(config)
    assert (moving.alone, moving.groups) != (staying.alone, staying.groups)


def test_a_failed_group_that_stays_leaves_the_round_s_other_groups_to_average() -> None:
    for seed in range(6):
        run = simulate(full(rounds=1, failure_rate=0.3, advance_after_failure=False, seed=seed))
        assert run.groups == 4 and 0 < run.failed_groups < 4 and 0 < run.distance[1] < 1


def test_random_groups_are_a_shuffle_cut_into_groups_of_m() -> None:
    config = MoshpitSimConfig(peers=7, group_size=3, grouping=Grouping.RANDOM)
    rng = random.Random(9)
    groups = sim._groups(config, [], rng)
    order = list(range(7))
    random.Random(9).shuffle(order)
    assert groups == [order[0:3], order[3:6], order[6:7]]


def test_random_groups_leave_the_remainder_alone_each_round() -> None:
    run = simulate(MoshpitSimConfig(peers=7, group_size=3, grouping=Grouping.RANDOM, rounds=4, width=2))
    assert (run.groups, run.alone) == (2 * 4, 1 * 4)


def test_grid_groups_are_the_peers_of_each_key_cut_into_groups_of_m() -> None:
    config = MoshpitSimConfig(peers=7, group_size=2, dims=3)
    keys = [(0, 0), (0, 1), (0, 0), (1, 1), (0, 0), (0, 1), (1, 0)]
    grid = [GridPosition(2, k) for k in keys]
    groups = sim._groups(config, grid, random.Random(2))
    by_key = {(0, 0): [0, 2, 4], (0, 1): [1, 5], (1, 1): [3], (1, 0): [6]}
    expected: list[list[int]] = []
    rng = random.Random(2)
    for peers in by_key.values():  # keys in the order their first peer comes, each shuffled
        rng.shuffle(peers)
        expected.extend(peers[i:i + 2] for i in range(0, len(peers), 2))
    assert groups == expected
    assert sorted(len(g) for g in groups) == [1, 1, 1, 2, 2]


def test_peers_by_their_ids_first_keys_and_those_alone_under_theirs_are_counted() -> None:
    config = MoshpitSimConfig(peers=9, group_size=2, dims=3, rounds=1, width=2, seed=6)
    rng = random.Random(6)
    counts: dict[str, int] = {}
    for _ in range(9):
        key = GridPosition.initial(2, 3, rng.randbytes(32)).key
        counts[key] = counts.get(key, 0) + 1
    run = simulate(config)
    assert (run.groups, run.alone) == (sum(c // 2 for c in counts.values()), sum(c % 2 for c in counts.values()))
    assert run.alone > 0


def test_members_move_on_the_grid_by_their_place_in_the_id_order_and_the_group_id(monkeypatch: pytest.MonkeyPatch) -> None:
    moves: list[tuple[tuple[int, ...], int, bytes]] = []
    advance = GridPosition.advance

    def spy(self: GridPosition, index_in_group: int, salt: bytes = b"") -> None:
        moves.append((self.digits, index_in_group, salt))
        advance(self, index_in_group, salt)

    monkeypatch.setattr(GridPosition, "advance", spy)
    simulate(full(rounds=2))
    rng = random.Random(0)
    ids = [rng.randbytes(32) for _ in range(8)]
    expected = []
    for cell in range(4):  # round 1: peers 2k and 2k + 1 share the cell of k's digits
        low, high = sorted((2 * cell, 2 * cell + 1), key=lambda peer: ids[peer])
        group_id = f"0:{low}".encode()
        expected += [(sim._digits(cell, 2, 2), 0, group_id), (sim._digits(cell, 2, 2), 1, group_id)]
    assert moves[:8] == expected
    assert len(moves) == 16 and all(salt.startswith(b"1:") for _, _, salt in moves[8:])
    assert sorted(index for _, index, _ in moves[8:]) == [0] * 4 + [1] * 4


def test_random_groups_never_move_on_a_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    moved: list[int] = []
    monkeypatch.setattr(GridPosition, "advance", lambda self, index, salt=b"": moved.append(index))
    simulate(MoshpitSimConfig(peers=12, group_size=3, grouping=Grouping.RANDOM, rounds=2, width=2))
    assert moved == []
