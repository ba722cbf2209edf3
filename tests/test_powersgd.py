"""PowerSGD over real peers on loopback: low-rank averages, error feedback, and what stays whole."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import trio

from averaging.averager import Averager
from averaging.powersgd import PowerSGD, PowerSGDConfig, PowerSGDReport

from .kit import open_peers
from .test_averaging import config, public, weighted_mean

pytestmark = pytest.mark.timeout(120)

N, M, RANK = 96, 160, 4


def decaying_spectrum(decay: float) -> torch.Tensor:
    """A full-rank N x M matrix with singular values decay**i, as gradients tend to have."""
    u = torch.linalg.qr(torch.randn(N, N)).Q
    v = torch.linalg.qr(torch.randn(M, N)).Q
    return u @ torch.diag(torch.tensor([decay**i for i in range(N)])) @ v.t()


async def step_all(compressors: Sequence[PowerSGD], grads: Sequence[list[torch.Tensor]],
                   weights: Sequence[float]) -> list[PowerSGDReport]:
    reports: list[PowerSGDReport | None] = [None] * len(compressors)

    async def one(i: int) -> None:
        reports[i] = await compressors[i].step(grads[i], weights[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(compressors)):
            nursery.start_soon(one, i)
    assert all(r is not None for r in reports)
    return reports  # type: ignore[return-value]


def test_which_tensors_go_as_factors() -> None:
    compressor = PowerSGD.__new__(PowerSGD)
    compressor.config = PowerSGDConfig(rank=4)
    assert compressor._compresses(torch.Size([96, 160]))
    assert compressor._compresses(torch.Size([64, 3, 3, 3]))  # a conv kernel: 64 x 27
    assert not compressor._compresses(torch.Size([160]))  # flat: a bias
    assert not compressor._compresses(torch.Size([6, 6]))  # the factors would be as big
    with pytest.raises(ValueError):
        PowerSGDConfig(rank=0).validate()


async def test_low_rank_gradients_average_exactly_and_small_ones_stay_whole() -> None:
    """When the average has rank <= r, one power iteration finds it: the result is the exact average."""
    async with open_peers(4) as everyone:
        peers = everyone[1:]
        await public(peers)
        torch.manual_seed(3)
        shared = torch.randn(RANK, M)  # every peer's matrix lies in one rank-r row space
        grads = [[torch.randn(N, RANK) @ shared, torch.randn(M)] for _ in peers]
        weights = [1.0, 2.0, 3.0]
        exact = [weighted_mean(grads, weights, k) for k in range(2)]
        async with Averager.open(peers[0], config(3)) as a0, Averager.open(peers[1], config(3)) as a1, \
                Averager.open(peers[2], config(3)) as a2:
            compressors = [PowerSGD(a, [(N, M), (M,)], PowerSGDConfig(rank=RANK)) for a in (a0, a1, a2)]
            reports = await step_all(compressors, grads, weights)
        for report, g in zip(reports, grads):
            assert report.complete and report.compressed == 1
            # exact up to float32 rounding in the orthogonalisation: relative, not absolute
            # (the error scales with the conditioning of the random start: ~1e-6 here, >1e-4 absolute in one CI run)
            error = ((g[0].double() - exact[0]).norm() / exact[0].norm()).item()
            assert error < 1e-4, error
            assert torch.allclose(g[1].double(), exact[1], atol=1e-6)  # the bias went whole
            # the factors and the bias, not the matrix: about r(n+m)+m of n*m+m values
            assert report.bytes_sent + report.bytes_received < 0.3 * 2 * report.plain_bytes


async def test_error_feedback_catches_up_what_earlier_steps_left_out() -> None:
    """Full-rank gradients lose their tail each step; the error buffers send it later, so the
    applied sum of k steps trails k times the true average by only the last step's error."""
    async with open_peers(3) as everyone:
        peers = everyone[1:]
        await public(peers)
        torch.manual_seed(4)
        gradients = [decaying_spectrum(0.7) for _ in peers]
        exact = weighted_mean([[g] for g in gradients], [1.0, 1.0], 0)
        async with Averager.open(peers[0], config(2)) as a0, Averager.open(peers[1], config(2)) as a1:
            compressors = [PowerSGD(a, [(N, M)], PowerSGDConfig(rank=RANK)) for a in (a0, a1)]
            applied = torch.zeros(N, M, dtype=torch.float64)
            deficits = []
            for k in range(1, 9):
                grads = [[g.clone()] for g in gradients]
                await step_all(compressors, grads, [1.0, 1.0])
                assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5)  # both peers apply the same
                applied += grads[0][0].double()
                deficits.append(((k * exact - applied).norm() / (k * exact).norm()).item())
                mean_error = sum(c.errors[0].double() for c in compressors) / 2  # type: ignore[misc]
                assert torch.allclose(k * exact - applied, mean_error, atol=1e-3)  # nothing lost, nothing doubled
        assert deficits[0] > 0.5  # one rank-4 step misses most of the sum of two such matrices
        assert deficits[-1] < 0.5 * deficits[0], deficits


async def test_bad_gradients_are_refused_before_any_group_forms() -> None:
    async with open_peers(1) as (_, peer):
        async with Averager.open(peer, config(2)) as averager:
            compressor = PowerSGD(averager, [(N, M)])
            with pytest.raises(ValueError, match="shapes"):
                await compressor.step([torch.zeros(M, N)])
            with pytest.raises(ValueError, match="NaN"):
                await compressor.step([torch.full((N, M), float("nan"))])
            assert compressor.errors[0] is not None and not compressor.errors[0].any()
