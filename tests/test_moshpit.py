"""averaging/moshpit.py: the grid's rounds with peers meeting by key, then its decisions one by one:
the rounds to the global average, their expected number under failures, the group size that minimises
it, the failure rate, the config's checks and a peer's place on the grid (at 1,000 peers:
tests/test_averaging_sim.py)."""

from __future__ import annotations

import hashlib
import math
from collections import Counter

import pytest

from averaging.moshpit import (
    FailureRate,
    GridPosition,
    MoshpitConfig,
    expected_rounds,
    optimal_group_size,
    rounds_to_average,
)
from p2p.errors import ConfigError


def _moshpit_rounds(values: dict[int, float], grid: dict[int, GridPosition], rounds: int,
                    fail: dict[int, set[int]] | None = None) -> dict[int, float]:
    """Simulate Moshpit rounds: peers meet by group key, a group sorted by id averages, then advance."""
    for r in range(rounds):
        cells: dict[str, list[int]] = {}
        for peer in sorted(values):
            cells.setdefault(grid[peer].key, []).append(peer)
        for members in cells.values():
            alive = [p for p in members if p not in (fail or {}).get(r, set())]
            mean = sum(values[p] for p in alive) / len(alive) if alive else 0.0
            for index, p in enumerate(members):
                if p in alive:
                    values[p] = mean
                grid[p].advance(index)
    return values


def test_moshpit_grid_reaches_the_exact_average_in_log_m_rounds() -> None:
    assert rounds_to_average(16, 4) == 2 and rounds_to_average(17, 4) == 3 and rounds_to_average(8, 2) == 3
    values = {i: float(i * i) for i in range(16)}
    exact = sum(values.values()) / 16
    grid = {i: GridPosition(4, (i // 4,)) for i in range(16)}  # four cells of four
    after_one = _moshpit_rounds(dict(values), {i: GridPosition(4, (i // 4,)) for i in range(16)}, 1)
    assert len(set(after_one.values())) == 4  # one round: each group has its own mean
    result = _moshpit_rounds(values, grid, 2)
    assert all(v == pytest.approx(exact) for v in result.values())
    # three dimensions of two: eight peers, three rounds
    values8 = {i: float(i) for i in range(8)}
    grid8 = {i: GridPosition(2, (i % 2, i // 2 % 2)) for i in range(8)}
    assert all(v == pytest.approx(3.5) for v in _moshpit_rounds(values8, grid8, 3).values())


def test_moshpit_groups_under_m_hand_out_every_digit_alike() -> None:
    """Groups under m (8.6 of m = 10 on average at 1,000 peers) gave out only the low digits: the
    cells keyed by high indexes emptied round after round, and their peers met no group. Each group's
    indexes are now turned by an offset from its id: every digit about as often, members of one group
    on distinct cells, and a full group still a permutation."""
    counts = Counter()
    for g in range(2000):
        size = 6 + g % 4  # groups of 6..9 under m = 10
        digits = []
        for index in range(size):
            position = GridPosition(10, (3, 4))
            position.advance(index, f"group {g}".encode())
            assert position.digits[0] == 4
            digits.append(position.digits[1])
        assert len(set(digits)) == size  # the group's members land on distinct cells
        counts.update(digits)
    mean = sum(counts.values()) / 10
    assert len(counts) == 10 and min(counts.values()) > 0.9 * mean and max(counts.values()) < 1.1 * mean, counts
    full = []
    for index in range(10):
        position = GridPosition(10, (3, 4))
        position.advance(index, b"a full group")
        full.append(position.digits[1])
    assert sorted(full) == list(range(10))
    bare = GridPosition(10, (3, 4))
    bare.advance(7)
    assert bare.digits == (4, 7)  # without a salt: the index, as before


def test_moshpit_with_failures_converges_and_a_failure_stays_in_its_group() -> None:
    values = {i: float(i) for i in range(16)}
    exact = sum(values.values()) / 16
    grid = {i: GridPosition(4, (i // 4,)) for i in range(16)}
    # peer 5 misses round 0: only its group (4..7) is affected that round
    after = _moshpit_rounds(dict(values), {i: GridPosition(4, (i // 4,)) for i in range(16)}, 1, {0: {5}})
    assert after[0] == pytest.approx(1.5) and after[12] == pytest.approx(13.5) and after[5] == 5.0
    result = _moshpit_rounds(values, grid, 8, {0: {5}, 3: {9}})
    spread = max(result.values()) - min(result.values())
    assert spread < 0.05 * (15 - 0) and abs(sum(result.values()) / 16 - exact) < 0.5


def test_moshpit_group_size_minimises_expected_rounds() -> None:
    # no failures: one group of everyone is best (as in all of DeDLOC's experiments)
    assert optimal_group_size(16, 0.0) == 16 and expected_rounds(16, 16, 0.0) == 1.0
    assert expected_rounds(16, 4, 0.0) == 2.0
    # failures make big groups fail often: a large swarm prefers small groups
    assert optimal_group_size(1000, 0.05) < 100
    assert expected_rounds(1000, 1000, 0.05) > expected_rounds(1000, optimal_group_size(1000, 0.05), 0.05)
    assert optimal_group_size(1000, 0.05, max_size=8) <= 8
    config = MoshpitConfig.for_swarm(1000, 0.05)
    assert config.group_size ** config.dims >= 1000
    config.validate()
    with pytest.raises(ValueError):
        MoshpitConfig(group_size=4, dims=2, initial=(4,)).validate()
    with pytest.raises(ValueError):
        expected_rounds(10, 2, 1.0)
    # failure rate: share of members that failed
    rate = FailureRate(window=2)
    rate.observe(4, 1)
    rate.observe(4, 0)
    assert rate.value == pytest.approx(1 / 8)
    rate.observe(4, 0)
    assert rate.value == 0.0
    # positions from the peer id are stable and in range
    a, b = GridPosition.initial(4, 3, b"peer-a"), GridPosition.initial(4, 3, b"peer-a")
    assert a == b and len(a.digits) == 2 and all(0 <= x < 4 for x in a.digits)


@pytest.mark.parametrize(("n", "m", "rounds"), [
    (1, 2, 1), (2, 2, 1), (3, 2, 2), (4, 4, 1), (5, 4, 2), (16, 4, 2), (17, 4, 3), (1000, 2, 10), (1000, 10, 3),
    (1001, 10, 4),
])
def test_rounds_to_average_is_ceil_log_m_n_and_at_least_one(n: int, m: int, rounds: int) -> None:
    assert rounds_to_average(n, m) == rounds


@pytest.mark.parametrize(("n", "m"), [(0, 2), (1, 1), (-3, 4)])
def test_rounds_to_average_refuses_an_empty_swarm_or_groups_under_two(n: int, m: int) -> None:
    with pytest.raises(ValueError, match=rf"^need n >= 1 and m >= 2 \(n={n}, m={m}\)$"):
        rounds_to_average(n, m)


def test_expected_rounds_without_failures_is_the_grid_s_depth() -> None:
    assert expected_rounds(16, 4, 0.0) == 2.0 and expected_rounds(16, 16, 0.0) == 1.0
    assert expected_rounds(1, 7, 0.0) == 1.0  # one peer: one (trivial) round
    assert expected_rounds(10, 50, 0.0) == 1.0  # groups of more than the swarm are the swarm


def test_expected_rounds_is_the_expected_slowest_group_summed_over_the_steps() -> None:
    # one group of 2 at p = 0.5: it succeeds with q = 1/4 a try, a geometric variable of mean 4
    assert expected_rounds(2, 2, 0.5) == pytest.approx(4.0, rel=1e-9)
    # 2 steps of 2 groups of 2 that each fail half the time: E[max of 2 geometrics(1/2)] = 8/3 a step
    assert expected_rounds(4, 2, 1 - math.sqrt(0.5)) == pytest.approx(16 / 3, rel=1e-9)
    # groups larger than the swarm count as the swarm's one group
    assert expected_rounds(10, 50, 0.1) == expected_rounds(10, 10, 0.1)


def test_groups_that_nearly_always_fail_are_approximated_and_certain_failure_is_infinite() -> None:
    fail = 1.0 - 0.8**100  # a group of 100 at p = 0.2 succeeds once in ~5e9 tries
    rate = -math.log(fail)
    assert expected_rounds(100, 100, 0.2) == pytest.approx(1.0 / rate + 0.5, rel=1e-12)
    assert expected_rounds(200, 100, 0.2) == pytest.approx(2 * (1.5 / rate + 0.5), rel=1e-12)  # 2 steps, 2 groups
    assert expected_rounds(100, 100, 0.2) == pytest.approx(1.0 / (1.0 - fail), rel=1e-6)  # what it approximates
    assert expected_rounds(1000, 1000, 0.9) == math.inf  # 0.1 ** 1000: no group of 1000 ever succeeds


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_expected_rounds_refuses_a_failure_rate_outside_zero_to_one(rate: float) -> None:
    with pytest.raises(ValueError, match=rf"^failure_rate must be in \[0, 1\), not {rate}$"):
        expected_rounds(10, 2, rate)


def test_the_optimal_group_size_minimises_expected_rounds_and_ties_go_to_the_larger() -> None:
    assert optimal_group_size(1, 0.0) == 2 and optimal_group_size(0, 0.3) == 2
    assert optimal_group_size(2, 0.0) == 2 and optimal_group_size(16, 0.0) == 16
    assert optimal_group_size(9, 0.0, max_size=8) == 8  # m = 3..8 all take 2 rounds: the larger
    assert optimal_group_size(9, 0.0, max_size=9) == 9
    m = optimal_group_size(1000, 0.05)
    assert 2 <= m < 100
    assert all(expected_rounds(1000, m, 0.05) <= expected_rounds(1000, k, 0.05) for k in range(2, 1001, 7))


def test_the_failure_rate_is_failed_members_over_members_of_the_recent_rounds() -> None:
    rate = FailureRate()
    assert rate.value == 0.0
    rate.observe(0, 3)  # an empty round says nothing
    assert rate.value == 0.0
    rate.observe(4, 9)  # more failed than members: all of them
    assert rate.value == 1.0
    rate.observe(6, 0)
    assert rate.value == pytest.approx(0.4)
    for _ in range(49):
        rate.observe(10, 0)
    assert rate.value == 0.0  # the default window is the last 50 rounds
    one = FailureRate(window=2)
    one.observe(1, 1)  # a group of one that failed counts
    one.observe(0, 0)  # and an empty round takes no place in the window
    one.observe(3, 0)
    assert one.value == pytest.approx(0.25)
    short = FailureRate(window=2)
    for members, failed in ((10, 10), (10, 1), (10, 3)):
        short.observe(members, failed)
    assert short.value == pytest.approx(0.2)


def test_moshpit_config_defaults_and_checks() -> None:
    config = MoshpitConfig(group_size=4)
    assert config.dims == 2 and config.initial is None
    config.validate()
    MoshpitConfig(group_size=2, dims=1).validate()
    MoshpitConfig(group_size=4, dims=3, initial=(0, 3)).validate()
    with pytest.raises(ConfigError, match=r"^Moshpit needs group_size >= 2 and dims >= 1 \(1, 2\)$"):
        MoshpitConfig(group_size=1).validate()
    with pytest.raises(ConfigError, match=r"^Moshpit needs group_size >= 2 and dims >= 1 \(4, 0\)$"):
        MoshpitConfig(group_size=4, dims=0).validate()
    with pytest.raises(ConfigError, match=r"^initial must hold dims - 1 = 2 digits, not \(1,\)$"):
        MoshpitConfig(group_size=4, dims=3, initial=(1,)).validate()
    with pytest.raises(ConfigError, match=r"^digits must be in \[0, 4\): \(0, 4\)$"):
        MoshpitConfig(group_size=4, dims=3, initial=(0, 4)).validate()


@pytest.mark.parametrize(("n", "rate", "max_size", "expected"), [
    (1, 0.0, None, (2, 1)), (2, 0.0, None, (2, 1)), (16, 0.0, None, (16, 1)), (1000, 0.05, 8, (6, 4)),
    (9, 0.0, 8, (8, 2)),
])
def test_moshpit_config_for_a_swarm(n: int, rate: float, max_size: int | None, expected: tuple[int, int]) -> None:
    config = MoshpitConfig.for_swarm(n, rate, max_size=max_size)
    assert (config.group_size, config.dims) == expected and config.initial is None
    config.validate()


def test_moshpit_config_for_a_swarm_without_failures_by_default() -> None:
    assert MoshpitConfig.for_swarm(16) == MoshpitConfig(group_size=16, dims=1)


def test_a_grid_position_refuses_digits_outside_base_m() -> None:
    GridPosition(3, (0, 2))
    GridPosition(2, ())
    with pytest.raises(ConfigError, match="^the group size m must be at least 2$"):
        GridPosition(1, ())
    with pytest.raises(ConfigError, match=r"^digits must be in \[0, 3\): \(0, 3\)$"):
        GridPosition(3, (0, 3))
    with pytest.raises(ConfigError, match=r"^digits must be in \[0, 3\): \(-1,\)$"):
        GridPosition(3, (-1,))


def test_the_initial_place_is_drawn_from_the_seed() -> None:
    digest = hashlib.sha256(b"moshpit" + b"peer-a").digest()
    assert GridPosition.initial(7, 4, b"peer-a") == GridPosition(7, (digest[0] % 7, digest[1] % 7, digest[2] % 7))
    assert GridPosition.initial(7, 1, b"peer-a").digits == ()
    places = {GridPosition.initial(4, 2, bytes([i])).digits for i in range(64)}
    assert places == {(0,), (1,), (2,), (3,)}  # every cell
    with pytest.raises(ValueError, match="^dims must be at least 1$"):
        GridPosition.initial(4, 0, b"peer-a")


def test_the_key_joins_the_digits() -> None:
    assert GridPosition(10, (3, 0, 9)).key == "3.0.9" and GridPosition(10, ()).key == ""


def test_advancing_drops_the_oldest_digit_and_appends_the_turned_index() -> None:
    bare = GridPosition(4, (1, 2))
    bare.advance(3)  # no salt: the index itself
    assert bare.digits == (2, 3)
    for salt in (b"group-1", b"group-2", b"group-3", b"group-4"):
        offset = int.from_bytes(hashlib.sha256(b"moshpit-turn" + salt).digest()[:8], "big")
        turned = GridPosition(7, (1, 2))
        turned.advance(3, salt)
        assert turned.digits == (2, (3 + offset) % 7), salt
    digits = set()
    for index in range(4):  # a group's members take distinct digits
        position = GridPosition(4, (1, 2))
        position.advance(index, b"group-1")
        digits.add(position.digits[-1])
    assert digits == {0, 1, 2, 3}
    alone = GridPosition(4, ())
    alone.advance(2, b"group-1")
    assert alone.digits == ()
