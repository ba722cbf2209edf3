"""PowerSGD: over real peers on loopback (low-rank averages, error feedback, what stays whole), and
in process over a stand-in averager (the arithmetic of one step, the seed, the phases, a failed round)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import pytest
import torch
import trio

from averaging.allreduce import PartOutcome, RoundReport
from averaging.averager import Averager
from averaging.errors import PartialAverageError
from averaging.group import Group
from averaging.powersgd import PURPOSE, PowerSGD, PowerSGDConfig, PowerSGDReport
from p2p.errors import ConfigError

from .kit import open_peers
from .test_averaging import config, public, weighted_mean
from .test_formation import member

pytestmark = pytest.mark.timeout(120)

N, M, RANK = 96, 160, 4


def decaying_spectrum(decay: float) -> torch.Tensor:
    """A full-rank N x M matrix with singular values decay**i, as gradients tend to have."""
    u = torch.linalg.qr(torch.randn(N, N)).Q
    v = torch.linalg.qr(torch.randn(M, N)).Q
    spectrum: torch.Tensor = u @ torch.diag(torch.tensor([decay**i for i in range(N)])) @ v.t()
    return spectrum


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
                buffers = [c.errors[0] for c in compressors]
                assert buffers[0] is not None and buffers[1] is not None
                mean_error = (buffers[0].double() + buffers[1].double()) / 2
                assert torch.allclose(k * exact - applied, mean_error, atol=1e-3)  # nothing lost, nothing doubled
        assert deficits[0] > 0.5  # one rank-4 step misses most of the sum of two such matrices
        assert deficits[-1] < 0.5 * deficits[0], deficits


# ---- in process: a stand-in for the averager -------------------------------------------------------------------

GROUP_ID = bytes(range(1, 17))


class StandIn:
    """What PowerSGD asks of an :class:`Averager`, alone in its group: ``matchmake`` gives a group of
    one with ``group_id``, ``average_in`` leaves the tensors as they are (the average of one) and
    reports ``sent`` and ``received`` bytes, or raises in ``fail_phase``. Every call is recorded."""

    def __init__(self, group_id: bytes = GROUP_ID, *, fail_phase: int | None = None, partial_phase: int | None = None,
                 sent: int = 100, received: int = 1000) -> None:
        self.group_id = group_id
        self.fail_phase = fail_phase
        self.partial_phase = partial_phase
        self.sent, self.received = sent, received
        self.calls: list[tuple[str, object, float, list[tuple[int, ...]]]] = []

    async def matchmake(self, tensors: Sequence[torch.Tensor], weight: float = 1.0, *, purpose: str = "") -> Group:
        self.calls.append(("matchmake", purpose, weight, [tuple(t.shape) for t in tensors]))
        return Group(self.group_id, (member(1),), 0)

    async def average_in(self, group: Group, tensors: Sequence[torch.Tensor], weight: float = 1.0, *,
                         phase: int = 0) -> RoundReport:
        assert group.group_id == self.group_id
        self.calls.append(("average_in", phase, weight, [tuple(t.shape) for t in tensors]))
        if phase == self.fail_phase:
            for t in tensors:  # what a real round must not leave behind: this stand-in checks PowerSGD copes
                t.mul_(3.0)
            raise PartialAverageError("a member left mid-round", None)
        elements = sum(t.numel() for t in tensors)
        done = 0 if phase == self.partial_phase else 1
        part = PartOutcome(0, member(1).peer_id, elements, chunks=1, averaged_chunks=done,
                           bytes_sent=self.sent + phase, bytes_received=self.received + phase)
        return RoundReport(group.group_id, [member(1).peer_id], 0, (1.0,), [part])


def over(stand_in: StandIn, shapes: Sequence[tuple[int, ...]], **config: float) -> PowerSGD:
    return PowerSGD(cast(Averager, stand_in), shapes, PowerSGDConfig(**config))  # type: ignore[arg-type]


def one_power_iteration(m: torch.Tensor, rank: int, group_id: bytes) -> torch.Tensor:
    """The docstring's step for a group of one: Q seeded by the group id's first 8 bytes (big-endian),
    P = M Q orthonormalised, Q = M^T P, the result P Q^T."""
    generator = torch.Generator().manual_seed(int.from_bytes(group_id[:8], "big"))
    q = torch.randn(m.shape[1], rank, generator=generator)
    p: torch.Tensor = torch.linalg.qr(m @ q).Q
    return p @ (m.t() @ p).t()


def test_the_settings_and_their_bounds() -> None:
    assert (PowerSGDConfig().rank, PowerSGDConfig().max_ratio) == (4, 0.5)
    PowerSGDConfig(rank=1, max_ratio=1.0).validate()
    PowerSGDConfig(max_ratio=1e-9).validate()
    cases: list[tuple[dict[str, float], str]] = [
        ({"rank": 0}, r"^rank must be >= 1$"), ({"rank": -3}, "rank"),
        ({"max_ratio": 0.0}, r"^max_ratio must be in \(0, 1\]$"), ({"max_ratio": 1.01}, "max_ratio"),
        ({"max_ratio": -0.5}, "max_ratio")]
    for bad, words in cases:
        with pytest.raises(ConfigError, match=words):
            PowerSGDConfig(**bad).validate()  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=words):
            over(StandIn(), [(N, M)], **bad)  # refused when made, not at the first step


def test_which_shapes_go_as_factors_and_at_what_rank() -> None:
    shapes = [(16, 16), (16, 15), (3, 50), (50, 3), (100, 100), (64, 3, 3, 3), (160,), (1, 400), (6, 6)]
    compressor = over(StandIn(), shapes)
    # (16, 16) at rank 4: the factors hold 4 * 32 = 128 values, exactly half of 256: compressed;
    # a conv kernel is a 64 x 27 matrix; a bias is flat; (6, 6)'s factors would be bigger than it
    assert compressor.compressed == [True, False, False, False, True, True, False, False, False]
    assert [compressor.rank_of(i) for i in range(len(shapes))] == [4, 4, 3, 3, 4, 4, 1, 1, 4]
    assert [None if e is None else tuple(e.shape) for e in compressor.errors] == [
        (16, 16), None, None, None, (100, 100), (64, 27), None, None, None]
    assert all(e is None or not e.any() for e in compressor.errors)
    assert over(StandIn(), [(16, 15)], max_ratio=1.0).compressed == [True]
    assert over(StandIn(), [(16, 16)], rank=5).compressed == [False]
    assert over(StandIn(), [(400, 1)], rank=1, max_ratio=1.0).compressed == [False]  # 401 values for 400


async def test_one_step_is_one_power_iteration_with_error_feedback() -> None:
    torch.manual_seed(5)
    stand_in = StandIn()
    compressor = over(stand_in, [(N, M), (M,), (8, 4, 5)], rank=RANK)
    matrix, bias, kernel = torch.randn(N, M), torch.randn(M), torch.randn(8, 4, 5)
    grads = [matrix.clone(), bias.clone(), kernel.clone()]
    report = await compressor.step(grads, weight=2.5)

    approx = one_power_iteration(matrix, RANK, GROUP_ID)
    assert torch.allclose(grads[0], approx, atol=1e-5)
    assert compressor.errors[0] is not None and torch.allclose(compressor.errors[0], matrix - approx, atol=1e-5)
    # what goes is the projection on a rank-r column space: what stays behind is orthogonal to it
    assert torch.linalg.matrix_rank(grads[0]).item() == RANK
    assert (approx.t() @ compressor.errors[0]).abs().max().item() < 1e-3
    assert torch.equal(grads[1], bias) and torch.equal(grads[2], kernel)  # whole, and the average of one
    assert compressor.errors[1] is None and compressor.errors[2] is None

    assert stand_in.calls == [
        ("matchmake", PURPOSE, 2.5, [(N, RANK), (M,), (8, 4, 5)]),  # P first, then the tensors that go whole
        ("average_in", 0, 2.5, [(N, RANK), (M,), (8, 4, 5)]),
        ("average_in", 1, 2.5, [(M, RANK)]),
    ]
    assert report.compressed == 1
    assert report.plain_bytes == 4 * (N * M + M + 8 * 4 * 5)
    assert [r.group_id for r in report.phases] == [GROUP_ID, GROUP_ID]
    assert (report.bytes_sent, report.bytes_received) == (100 + 101, 1000 + 1001)
    assert report.complete


async def test_the_start_is_seeded_by_the_first_eight_bytes_of_the_group_id() -> None:
    torch.manual_seed(6)
    matrix = torch.randn(N, M)

    async def applied(group_id: bytes) -> torch.Tensor:
        grads = [matrix.clone()]
        await over(StandIn(group_id), [(N, M)], rank=RANK).step(grads)
        return grads[0]

    first = await applied(GROUP_ID)
    torch.manual_seed(99)  # the global generator plays no part
    assert torch.equal(await applied(GROUP_ID[:8] + bytes(8)), first)
    # (torch's CPU generator keeps the low 32 bits of a seed: of the 8 bytes, the last 4 count)
    for changed in (4, 7):
        other = GROUP_ID[:changed] + bytes([99]) + GROUP_ID[changed + 1:]
        assert not torch.allclose(await applied(other), first, atol=1e-3), changed


async def test_what_one_step_leaves_out_the_next_one_sends() -> None:
    """Over steps, the applied sum plus the error buffer is exactly the sum of the gradients."""
    torch.manual_seed(7)
    compressor = over(StandIn(), [(N, M)], rank=RANK)
    total, applied = torch.zeros(N, M, dtype=torch.float64), torch.zeros(N, M, dtype=torch.float64)
    for _ in range(3):
        g = torch.randn(N, M)
        total += g.double()
        grads = [g.clone()]
        await compressor.step(grads)
        applied += grads[0].double()
        error = compressor.errors[0]
        assert error is not None and error.abs().max().item() > 0.1
        assert torch.allclose(applied + error.double(), total, atol=1e-4)
    # the second step started from its gradient plus what the first left behind, not from the gradient alone
    second = over(StandIn(), [(N, M)], rank=RANK)
    grads = [torch.ones(N, M)]
    await second.step(grads)
    left = second.errors[0]
    assert left is not None
    grads = [torch.zeros(N, M)]
    await second.step(grads)
    assert torch.allclose(grads[0], one_power_iteration(left, RANK, GROUP_ID), atol=1e-5)


@pytest.mark.parametrize("phase", [0, 1])
async def test_a_failed_phase_leaves_gradients_and_error_buffers_as_they_were(phase: int) -> None:
    torch.manual_seed(8)
    compressor = over(StandIn(), [(N, M), (M,)], rank=RANK)
    await compressor.step([torch.randn(N, M), torch.randn(M)])  # a first step leaves an error buffer
    before = compressor.errors[0]
    assert before is not None
    kept = before.clone()
    compressor.averager = cast(Averager, StandIn(fail_phase=phase))
    grads = [torch.randn(N, M), torch.randn(M)]
    originals = [g.clone() for g in grads]
    with pytest.raises(PartialAverageError):
        await compressor.step(grads)
    assert all(torch.equal(g, o) for g, o in zip(grads, originals))
    assert compressor.errors[0] is not None and torch.equal(compressor.errors[0], kept)


async def test_a_step_s_weight_is_one_unless_given() -> None:
    stand_in = StandIn()
    await over(stand_in, [(N, M)], rank=RANK).step([torch.randn(N, M)])
    assert [weight for _, _, weight, _ in stand_in.calls] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("phase", [0, 1])
async def test_the_report_is_complete_only_when_both_phases_are(phase: int) -> None:
    report = await over(StandIn(partial_phase=phase), [(N, M)], rank=RANK).step([torch.randn(N, M)])
    assert not report.complete
    assert report.phases[phase].complete is False and report.phases[1 - phase].complete


async def test_bad_gradients_are_refused_before_matchmaking() -> None:
    stand_in = StandIn()
    compressor = over(stand_in, [(N, M), (M,)])
    compressor.errors[0] = torch.ones(N, M)
    with pytest.raises(ValueError, match=r"^gradient shapes \[\(96, 160\)\] are not the ones PowerSGD was made for "
                                         r"\[\(96, 160\), \(160,\)\]"):
        await compressor.step([torch.zeros(N, M)])
    with pytest.raises(ValueError, match="^PowerSGD averages float32 gradients$"):
        await compressor.step([torch.zeros(N, M), torch.zeros(M, dtype=torch.float64)])
    with pytest.raises(ValueError, match="^the gradients hold NaN or Inf; refusing to average them$"):
        await compressor.step([torch.zeros(N, M), torch.full((M,), math.inf)])
    with pytest.raises(ValueError, match="NaN or Inf"):
        await compressor.step([torch.full((N, M), math.nan), torch.zeros(M)])
    assert stand_in.calls == []
    assert compressor.errors[0] is not None and torch.equal(compressor.errors[0], torch.ones(N, M))
