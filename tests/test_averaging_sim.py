"""Moshpit at a thousand peers (averaging/sim/moshpit.py): the project's grid code, its rule for a
failed round, and the baseline of random groups; bench/scale.py prints the whole table."""

from __future__ import annotations

import pytest

from averaging.moshpit import rounds_to_average
from averaging.sim.moshpit import Grouping, MoshpitSimConfig, Positions, simulate


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
    assert all(b <= a * (1 + 1e-9) for a, b in zip(moving.distance, moving.distance[1:]))  # never farther


def test_first_keys_from_peer_ids_fill_cells_unevenly() -> None:
    run = simulate(MoshpitSimConfig(peers=1000, group_size=10, dims=3, rounds=6))
    assert run.groups > 6 * 100  # cells over m split into more groups
    assert run.alone > 0 and run.distance[3] > 1e-4  # not exact in d rounds
