"""Robust aggregation (CenteredClip at each reducer, opt-in): a quarter of the peers send poisoned
gradients and the result stays near the honest average, while the plain mean does not; the
offenders are named in the round report."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack

import pytest
import torch

from averaging import AllreduceConfig, Averager, RoundReport
from averaging.compression import Region
from averaging.reduction import PartReduction
from averaging.robust import CenteredClipConfig, centered_clip

from .test_averaging import config, step_all
from .fake_swarm import fake_swarms

pytestmark = pytest.mark.timeout(120)

#: The stated bound: the robust aggregate is within half the honest gradients' mean distance from
#: their average (measured: 0.27-0.37 with a quarter of attackers, each pulling at most tau / n).
BOUND = 0.5

Attack = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
ATTACKS: dict[str, Attack] = {
    "scaled x1000": lambda h, g: h * 1000,
    "sign-flipped x10": lambda h, g: -h * 10,
    "random x100": lambda h, g: torch.randn(h.shape, generator=g) * 100,
    "huge (1e30, finite)": lambda h, g: torch.full_like(h, 1e30),
}


def honest_and_poisoned(n: int, d: int, attack: Attack, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(d, generator=g)
    honest = mu + 0.5 * torch.randn(n - n // 4, d, generator=g)
    return honest, attack(honest[: n // 4], g)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_centered_clip_holds_a_quarter_of_poisoned_rows_where_the_mean_does_not(name: str) -> None:
    honest, bad = honest_and_poisoned(8, 4096, ATTACKS[name])
    rows = torch.cat([honest, bad])
    target = honest.double().mean(0)
    spread = float((honest.double() - target).norm(dim=1).mean())
    result = centered_clip(rows, torch.ones(8), CenteredClipConfig())
    assert float((result.center.double() - target).norm()) <= BOUND * spread
    mean_error = float((rows.double().mean(0) - target).norm())
    assert not mean_error <= 5 * spread  # the mean is far off (or not even finite)
    assert (result.scales[: len(honest)] > 0.9).all() and (result.scales[len(honest):] < 0.5).all()


def test_without_attackers_centered_clip_is_close_to_the_mean_and_clips_nobody_hard() -> None:
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 1000, generator=g)
    weights = torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0, 0.0])
    result = centered_clip(rows, weights, CenteredClipConfig())
    mean = (rows.double() * weights.double()[:, None]).sum(0) / weights.sum()
    spread = float((rows.double() - mean).norm(dim=1).mean())
    assert float((result.center.double() - mean).norm()) <= 0.1 * spread
    assert (result.scales >= 0.5).all()
    with pytest.raises(ValueError, match="weights"):
        centered_clip(rows, torch.zeros(6), CenteredClipConfig())
    with pytest.raises(ValueError, match="tau_factor"):
        CenteredClipConfig(tau_factor=0).validate()


def test_a_reducer_names_the_senders_it_clipped() -> None:
    honest, bad = honest_and_poisoned(8, 512, ATTACKS["scaled x1000"])
    rows = torch.cat([honest, bad])
    reduction = PartReduction([Region(0, 512, 0)], range(8), robust=CenteredClipConfig())  # type: ignore[arg-type]
    for s in range(8):
        reduction.set_weight(s, 1.0)
    finals = [f for s in range(8) for f in reduction.add(s, 0, rows[s])]
    (final,) = finals
    assert final.values is not None and final.contributors == frozenset(range(8))
    assert {n.split()[1] for n in final.notes if "clipped" in n} == {"6", "7"}


async def test_a_round_with_robust_aggregation_stays_near_the_honest_average_and_names_the_attackers() -> None:
    n, d = 8, 20_000
    honest, bad = honest_and_poisoned(n, d, ATTACKS["scaled x1000"], seed=5)
    data = [[row.clone()] for row in torch.cat([honest, bad])]
    target = honest.double().mean(0)
    spread = float((honest.double() - target).norm(dim=1).mean())
    cfg = config(n, allreduce=AllreduceConfig(chunk_elements=4096, robust=CenteredClipConfig(), timeout=30.0))
    async with fake_swarms(n) as peers, AsyncExitStack() as stack:
        averagers = [await stack.enter_async_context(Averager.open(p, cfg)) for p in peers]
        reports = await step_all(averagers, data, [1.0] * n)
    assert all(isinstance(r, RoundReport) and r.complete for r in reports), reports
    attackers = {p.peer_id.to_base58() for p in peers[len(honest):]}
    for i in range(len(honest)):
        assert float((data[i][0].double() - target).norm()) <= BOUND * spread
        report = reports[i]
        assert isinstance(report, RoundReport) and set(report.clipped) == attackers
        assert "clipped by robust aggregation" in report.summary()
    # the same round without it: the plain mean is far off
    plain = config(n, allreduce=AllreduceConfig(chunk_elements=4096, timeout=30.0))
    data = [[row.clone()] for row in torch.cat([honest, bad])]
    async with fake_swarms(n) as peers, AsyncExitStack() as stack:
        averagers = [await stack.enter_async_context(Averager.open(p, plain)) for p in peers]
        await step_all(averagers, data, [1.0] * n)
    assert float((data[0][0].double() - target).norm()) > 5 * spread


# ---------------------------------------------------------------------- the pure core, exactly (mutation-tested)


@pytest.mark.parametrize("settings, message", [
    ({"tau": 0.0}, "tau must be positive, got 0.0"),
    ({"tau": -1.0}, "tau must be positive, got -1.0"),
    ({"tau_factor": 0.0}, "tau_factor must be positive, got 0.0"),
    ({"iterations": 0}, r"iterations must be in 1 \.\. 1000, got 0"),
    ({"iterations": 1001}, r"iterations must be in 1 \.\. 1000, got 1001"),
    ({"flag_below": 0.0}, r"flag_below must be in \(0, 1\], got 0.0"),
    ({"flag_below": 1.01}, r"flag_below must be in \(0, 1\], got 1.01"),
])
def test_each_bad_setting_is_refused_with_its_reason(settings: dict[str, float], message: str) -> None:
    from p2p.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{message}$"):
        CenteredClipConfig(**settings).validate()  # type: ignore[arg-type]


def test_the_edges_of_each_setting_are_allowed() -> None:
    for settings in ({"tau": None}, {"tau": 1e-9}, {"tau_factor": 1e-9}, {"iterations": 1}, {"iterations": 1000},
                     {"flag_below": 1.0}, {"flag_below": 1e-9}):
        CenteredClipConfig(**settings).validate()  # type: ignore[arg-type]


def test_shapes_and_weights_are_checked_each_on_its_own() -> None:
    cfg = CenteredClipConfig()
    with pytest.raises(ValueError, match=r"^values must be n x d and weights n, got \(3,\) and \(3,\)$"):
        centered_clip(torch.zeros(3), torch.ones(3), cfg)  # values not 2-d, weights fine
    with pytest.raises(ValueError, match=r"^values must be n x d and weights n, got \(3, 2\) and \(2,\)$"):
        centered_clip(torch.zeros(3, 2), torch.ones(2), cfg)  # values fine, weights the wrong length
    with pytest.raises(ValueError, match="^weights must be >= 0 with a positive sum$"):
        centered_clip(torch.zeros(3, 2), torch.tensor([1.0, -0.5, 1.0]), cfg)
    with pytest.raises(ValueError, match="^weights must be >= 0 with a positive sum$"):
        centered_clip(torch.zeros(3, 2), torch.zeros(3), cfg)


def test_two_contributions_start_from_their_weighted_mean_and_a_large_tau_keeps_it() -> None:
    values = torch.tensor([[0.0, 0.0, 0.0], [4.0, 8.0, 12.0]])
    result = centered_clip(values, torch.tensor([3.0, 1.0]), CenteredClipConfig(tau=1e6, iterations=1))
    assert torch.allclose(result.center, torch.tensor([1.0, 2.0, 3.0]))
    assert result.tau == 1e6 and torch.equal(result.scales, torch.ones(2, dtype=torch.float64))


def test_more_than_two_start_from_the_median_and_clip_a_far_one_to_tau() -> None:
    # 3 rows of 2 columns: the median of rows (not of columns) is the start
    values = torch.tensor([[0.0, 0.0], [1.0, 0.0], [100.0, 0.0]])
    result = centered_clip(values, torch.ones(3), CenteredClipConfig(tau=1.0, iterations=1, flag_below=0.5))
    # from the median (1, 0): row 0 pulls by -1 (distance 1, in full), row 2 by +1 (clipped from 99 to tau = 1)
    assert torch.allclose(result.center, torch.tensor([1.0, 0.0]))
    assert torch.allclose(result.scales, torch.tensor([1.0, 1.0, 1.0 / 99], dtype=torch.float64))
    assert result.tau == 1.0


def test_tau_by_default_is_the_factor_times_the_median_distance() -> None:
    values = torch.tensor([[0.0], [2.0], [3.0], [10.0]])  # median (lower) 2: distances 2, 0, 1, 8 -> median 1
    result = centered_clip(values, torch.ones(4), CenteredClipConfig(tau_factor=2.0, iterations=1))
    assert result.tau == 2.0


def test_equal_contributions_return_their_value_unclipped_and_zero_weights_count_as_unclipped() -> None:
    values = torch.tensor([[5.0, 5.0], [5.0, 5.0], [5.0, 5.0], [123.0, -7.0]])
    result = centered_clip(values, torch.tensor([1.0, 1.0, 1.0, 0.0]), CenteredClipConfig())
    assert torch.equal(result.center, torch.tensor([5.0, 5.0])) and result.tau == 0.0
    assert torch.equal(result.scales, torch.ones(4, dtype=torch.float64))
    clipped = centered_clip(torch.tensor([[0.0], [1.0], [2.0], [50.0]]), torch.tensor([1.0, 1.0, 1.0, 0.0]),
                            CenteredClipConfig(tau=0.5, iterations=3))
    assert float(clipped.scales[3]) == 1.0  # a row of weight 0 takes no part, and is not named
    assert clipped.center.dtype == torch.float32


def test_the_iterations_run_to_the_fixed_point() -> None:
    values = torch.tensor([[0.0], [0.0], [0.0], [1000.0]])
    one = centered_clip(values, torch.ones(4), CenteredClipConfig(tau=1.0, iterations=1))
    many = centered_clip(values, torch.ones(4), CenteredClipConfig(tau=1.0, iterations=30))
    # from the median 0, one step moves by tau/4 toward the outlier; the fixed point c has the three honest
    # rows pulling back 3c and the outlier tau: c = 1/3
    assert float(one.center[0]) == pytest.approx(0.25)
    assert float(many.center[0]) == pytest.approx(1 / 3, abs=1e-4)
