"""averaging/load_balancing.py: DeDLOC's linear program (eq. 5 and 6) and the split's cost.

Every member of a group solves the same problem and must reach the same split (the all-reduce
headers carry each part's bounds: a disagreement fails the round), so beside the figures derived by
hand, a few optima are pinned here: a release that splits differently would fail every round it
shares with an older one.
"""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from scipy.optimize import linprog

import averaging.load_balancing as lb
from averaging.load_balancing import Capacity, balance, equal_fractions, split_seconds
from averaging.partition import part_bounds

MBIT = 1e6 / 8
S = 40_000_000


def test_equal_peers_get_equal_shares_at_the_bandwidth_bound() -> None:
    result = balance([Capacity(100 * MBIT, 100 * MBIT)] * 4, S)
    assert result.fractions == pytest.approx((0.25,) * 4)
    assert result.predicted_seconds == pytest.approx(2 * 3 / 4 * S / (100 * MBIT), rel=1e-6)


def test_slow_peers_reduce_nothing_and_the_ideal_is_reached() -> None:
    caps = [Capacity(200 * MBIT, 200 * MBIT)] * 2 + [Capacity(40 * MBIT, 40 * MBIT)] * 2
    result = balance(caps, S)
    assert result.fractions == pytest.approx((0.5, 0.5, 0.0, 0.0))
    ideal = max(2 * 3 * S / (480 * MBIT), S / (40 * MBIT))
    assert result.predicted_seconds == pytest.approx(ideal, rel=1e-6)  # 8.0 s


def test_roles_fix_the_shares() -> None:
    caps = [Capacity(100 * MBIT, 100 * MBIT)] * 3 + [Capacity(400 * MBIT, 400 * MBIT, sends=False)]
    result = balance(caps, S)
    assert result.fractions[3] == pytest.approx(1.0)  # an idle fast peer aggregates everything (setup D)
    assert result.contributes == (True, True, True, False)
    senders_only = [Capacity(100 * MBIT, 100 * MBIT, reduces=False)] * 2 + [Capacity(100 * MBIT, 100 * MBIT)] * 2
    result = balance(senders_only, S)
    assert result.fractions[:2] == (0.0, 0.0) and sum(result.fractions) == pytest.approx(1.0)
    assert equal_fractions(senders_only) == (0.0, 0.0, 0.5, 0.5)
    with pytest.raises(ValueError, match="no member may reduce"):
        balance([Capacity(reduces=False)] * 2, S)


def test_pairwise_limits_and_unknown_bandwidths() -> None:
    caps = [Capacity(100 * MBIT, 100 * MBIT)] * 3
    limits = [[0.0] * 3 for _ in range(3)]
    limits[0][1] = limits[1][0] = 5 * MBIT  # a slow path between 0 and 1
    limited = balance(caps, S, pair_limits=limits)
    assert limited.predicted_seconds > balance(caps, S).predicted_seconds
    unknown = balance([Capacity(), Capacity(), Capacity(100 * MBIT, 100 * MBIT)], S)
    assert unknown.fractions == pytest.approx((1 / 3,) * 3, abs=1e-6)


def test_every_member_computes_the_same_partition() -> None:
    """Same inputs, same answer: in this process, again, and in a fresh interpreter."""
    caps = [Capacity(u * MBIT, d * MBIT) for u, d in ((200, 180), (200, 180), (40, 50), (40, 30), (100, 100))]
    first = balance(caps, S).fractions
    assert balance(caps, S).fractions == first
    code = ("from averaging.load_balancing import Capacity, balance\n"
            f"caps = [Capacity(u * {MBIT!r}, d * {MBIT!r}) for u, d in ((200, 180), (200, 180), (40, 50), (40, 30), (100, 100))]\n"
            f"print(repr(balance(caps, {S}).fractions))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == repr(first)
    assert part_bounds(10**7, first) == part_bounds(10**7, eval(out.stdout))


def test_equal_fractions_go_to_the_reducers_and_one_reducer_takes_all() -> None:
    assert equal_fractions([Capacity(reduces=False), Capacity()]) == (0.0, 1.0)
    with pytest.raises(ValueError, match=r"^no member may reduce$"):
        equal_fractions([Capacity(reduces=False)])


def test_a_group_without_members_or_reducers_is_refused_with_its_reason() -> None:
    with pytest.raises(ValueError, match=r"^no members$"):
        balance([], S)
    with pytest.raises(ValueError, match=r"^no member may reduce$"):
        balance([Capacity(reduces=False)] * 2, S)


def test_a_lone_sender_that_reduces_averages_its_own_vector_and_nothing_crosses_a_link() -> None:
    """With one member holding tensors the LP is unbounded (a transfer within a peer is free): it used
    to fail, the averager logged a warning and split equally, sending half the vector to an auxiliary
    and back."""
    alone = balance([Capacity(MBIT, MBIT)], S)
    assert (alone.fractions, alone.contributes, alone.predicted_seconds) == ((1.0,), (True,), 0.0)
    helped = balance([Capacity(MBIT, MBIT, sends=False), Capacity(MBIT, MBIT), Capacity(MBIT, MBIT, sends=False)], S)
    assert (helped.fractions, helped.contributes) == ((0.0, 1.0, 0.0), (False, True, False))
    # a lone sender that may not reduce (client mode) needs the auxiliary: the LP decides
    relayed = balance([Capacity(8000.0, 8000.0, reduces=False), Capacity(8000.0, 8000.0, sends=False)], 1000)
    assert relayed.fractions == (0.0, 1.0)
    assert relayed.rounds_per_second == pytest.approx(8.0)  # 1000 B up and back over 8000 B/s links


def test_compute_bounds_the_rate_when_a_batch_size_is_given() -> None:
    """xi <= sum_i s_i c_i / B: 10 + 30 samples/s toward a batch of 100 is 0.4 batches/s, far under
    the links' 1000 rounds/s; an auxiliary's compute (it has no samples) does not count."""
    caps = [Capacity(1e6, 1e6, compute=10), Capacity(1e6, 1e6, compute=30)]
    assert balance(caps, 1000, batch_size=100).rounds_per_second == pytest.approx(0.4, rel=1e-9)
    assert balance(caps, 1000, batch_size=0.5).rounds_per_second == pytest.approx(80.0, rel=1e-9)
    assert balance(caps, 1000, batch_size=0).rounds_per_second == pytest.approx(1000.0, rel=1e-9)  # 0: none
    assert balance(caps, 1000).rounds_per_second == pytest.approx(1000.0, rel=1e-9)
    aux = balance([*caps, Capacity(1e6, 1e6, compute=1000, sends=False)], 1000, batch_size=100)
    assert aux.rounds_per_second == pytest.approx(0.4, rel=1e-9) and aux.contributes == (True, True, False)


def test_a_sender_on_a_slow_uplink_is_mostly_left_out_of_the_compute_it_would_hold_up() -> None:
    """c_i in [0, 1] with compute: a 10 B/s uploader's values would hold every round to its link
    (0.01 rounds/s, as without a batch size); leaving it (almost) out keeps the others' 2 x 100 samples/s."""
    caps = [Capacity(1e6, 1e6, compute=100), Capacity(1e6, 1e6, compute=100), Capacity(10, 1e6, compute=1)]
    assert balance(caps, 1000).rounds_per_second == pytest.approx(0.01, rel=1e-9)
    result = balance(caps, 1000, batch_size=2)
    assert 100.0 < result.rounds_per_second < 100.5  # (200 + c_slow) / 2
    assert result.rounds_per_second == pytest.approx(100.49371976751453, rel=1e-6)  # pinned (above)
    assert result.fractions == (0.5, 0.5, 0.0)
    assert result.contributes == (True, True, False)  # c_slow is fractional: not a contributor, as the paper reads it


def test_pair_limits_bind_from_half_a_byte_a_second_and_zero_or_infinity_mean_none() -> None:
    caps = [Capacity(1e6, 1e6)] * 3
    free = balance(caps, 1000)
    assert free.fractions == pytest.approx((1 / 3,) * 3) and free.rounds_per_second == pytest.approx(750.0)
    for none in ([[0.0] * 3] * 3, [[math.inf] * 3] * 3):
        same = balance(caps, 1000, pair_limits=none)
        assert same.rounds_per_second == pytest.approx(750.0) and same.fractions == pytest.approx((1 / 3,) * 3)
    cut = balance(caps, 1000, pair_limits=[[0.0, 0.5, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # 0 and 1 can hardly talk: 2 reduces everything, its 1e6 B/s carrying 2 x 1000 B of the others' a round
    assert cut.fractions == (0.0, 0.0, 1.0)
    assert cut.rounds_per_second == pytest.approx(500.0, rel=1e-5)


def test_a_mixed_group_with_limits_reaches_the_pinned_split() -> None:
    """Roles, unequal links and pair limits together (no symmetry to average over): the second LP's
    choice among eq. 5's optima, pinned."""
    caps = [Capacity(3e6, 2e6), Capacity(1e6, 1e6), Capacity(2e6, 5e6), Capacity(1e6, 1e6, sends=False),
            Capacity(4e6, 4e6, reduces=False)]
    plain = balance(caps, 1000)
    assert plain.fractions == (0.5, 0.0, 0.5, 0.0, 0.0)
    assert plain.rounds_per_second == pytest.approx(1000.0, rel=1e-9)
    assert plain.contributes == (True, True, True, False, True)
    limits = [[0.0, 0.5, 0.0, 0.0, 0.0], [0.0] * 5, [0.0, 0.0, 0.0, 2e5, 0.0], [0.0] * 5, [math.inf, 0.0, 0.0, 0.0, 0.0]]
    limited = balance(caps, 1000, pair_limits=limits)
    assert limited.fractions == pytest.approx((0.0, 0.0, 0.7142864081617842, 0.2857135918382158, 0.0), abs=1e-9)
    assert limited.rounds_per_second == pytest.approx(850.00025, rel=1e-9)


def test_links_below_a_byte_a_second_are_balanced_like_fast_ones() -> None:
    """The LP is scale-free: 0.2 and 0.04 B/s split as 200 and 40 Mbit do (test_slow_peers...)."""
    result = balance([Capacity(0.2, 0.2)] * 2 + [Capacity(0.04, 0.04)] * 2 + [Capacity(0.2, 0.2, reduces=False)], 1)
    assert result.fractions == pytest.approx((0.5, 0.5, 0.0, 0.0, 0.0))  # a sender-only peer reduces nothing
    assert result.rounds_per_second == pytest.approx(0.04, rel=1e-9)


def test_split_seconds_is_the_busiest_link_of_a_split() -> None:
    """Member i moves (1 - f_i) S as a sender and f_i S x (the other senders) as a reducer, each way."""
    aux = Capacity(40, 400, sends=False)
    a, b, c = Capacity(100, 1000), Capacity(1000, 60), Capacity(0, 1000)  # c's upload unknown: the best known
    # loads: aux 0.4 x 3 = 1.2 kB (30 s on its 40 B/s up), a 0.9 + 0.1 x 2 = 1.1 kB (11 s),
    # b 0.8 + 0.4 = 1.2 kB (20 s on its 60 B/s down), c 0.7 + 0.6 = 1.3 kB (1.3 s at 1000 B/s)
    assert split_seconds([aux, a, b, c], [0.4, 0.1, 0.2, 0.3], 1000) == pytest.approx(30.0)
    assert split_seconds([a, b, c, aux], [0.1, 0.2, 0.3, 0.4], 1000) == pytest.approx(30.0)  # any order
    assert split_seconds([b, c], [0.5, 0.5], 1000) == pytest.approx(1000 / 60)
    # an unknown figure is the best known one (not a default), however small or large the known ones
    assert split_seconds([Capacity(0, 1e9), Capacity(1e9, 1e9)], [0.5, 0.5], 1000) == pytest.approx(1e-6)
    assert split_seconds([Capacity(0.5, 1e9), Capacity(1e9, 1e9)], [0.5, 0.5], 1000) == pytest.approx(2000.0)
    assert split_seconds([Capacity(math.inf, 1e9), Capacity(1e9, 1e9)], [0.5, 0.5], 1000) == pytest.approx(1e-6)
    assert split_seconds([Capacity(0, 0), Capacity(0, 0)], [0.5, 0.5], 1000) == pytest.approx(1000 / (100e6 / 8))
    # half a byte a second is a known figure too: the unknown uploader (2 vectors' worth) gets it, not a default
    slow = [Capacity(0.5, 1e9), Capacity(0, 1e9), Capacity(0.5, 1e9)]
    assert split_seconds(slow, [0.0, 1.0, 0.0], 1) == pytest.approx(4.0)


def test_one_fast_peer_and_three_slow_ones_finish_together() -> None:
    """Fast F (100 Mbit) and three slow S (50 Mbit): F moves (1 - f) + 3f vectors each way, an S
    1 - s + 3s with s = (1 - f) / 3; equal times at 100 and 50 give f = 0.7, s = 0.1, and 2.4 vectors
    over F's 100 Mbit: 7.68 s for 40 MB, on every link at once."""
    caps = [Capacity(100 * MBIT, 100 * MBIT)] + [Capacity(50 * MBIT, 50 * MBIT)] * 3
    result = balance(caps, S)
    assert result.fractions == pytest.approx((0.7, 0.1, 0.1, 0.1))
    assert split_seconds(caps, result.fractions, S) == pytest.approx(7.68)
    assert split_seconds(caps, equal_fractions(caps), S) == pytest.approx(1.5 * S / (50 * MBIT))  # 9.6 s
    assert 0.0 <= result.solve_seconds < 10.0


def test_a_group_without_tensors_has_nothing_to_average() -> None:
    aux = [Capacity(MBIT, MBIT, sends=False)] * 2
    result = balance(aux, S)
    assert (result.fractions, result.contributes, result.predicted_seconds) == ((0.5, 0.5), (False, False), 0.0)
    assert 0.0 <= result.solve_seconds < 10.0 and 0.0 <= balance(aux[:1] + [Capacity()], S).solve_seconds < 10.0


def test_a_solver_failure_is_an_error_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """The averager catches it and splits equally (averager.py); the reason is in its log line."""
    def failed(*args: Any, **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(status=2, x=None, message="The problem is infeasible.")

    monkeypatch.setattr(lb, "linprog", failed)
    with pytest.raises(ValueError, match=r"^load balancing LP failed: The problem is infeasible\.$"):
        balance([Capacity(MBIT, MBIT)] * 3, S)

    def stopped(objective: Any, **kwargs: Any) -> SimpleNamespace:  # a point, but not an optimum
        return SimpleNamespace(status=4, x=np.zeros(len(objective)), message="Numerical difficulties.")

    monkeypatch.setattr(lb, "linprog", stopped)
    with pytest.raises(ValueError, match=r"^load balancing LP failed: Numerical difficulties\.$"):
        balance([Capacity(MBIT, MBIT)] * 3, S)


def test_a_second_pass_that_fails_keeps_the_first_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = linprog, []

    def second_stops(objective: Any, **kwargs: Any) -> Any:
        calls.append(objective)
        if len(calls) == 1:
            return real(objective, **kwargs)
        return SimpleNamespace(status=1, x=np.zeros(len(objective)), message="Iteration limit reached.")

    monkeypatch.setattr(lb, "linprog", second_stops)
    result = balance([Capacity(100 * MBIT, 100 * MBIT)] + [Capacity(50 * MBIT, 50 * MBIT)] * 3, S)
    assert len(calls) == 2 and result.fractions == pytest.approx((0.7, 0.1, 0.1, 0.1))


def test_a_solution_that_moves_nothing_falls_back_to_the_equal_split(monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing(objective: Any, **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(status=0, x=np.zeros(len(objective)), message="Optimization terminated successfully.")

    monkeypatch.setattr(lb, "linprog", nothing)
    caps = [Capacity(MBIT, MBIT)] * 2 + [Capacity(MBIT, MBIT, reduces=False)]
    assert balance(caps, S).fractions == equal_fractions(caps) == (0.5, 0.5, 0.0)
