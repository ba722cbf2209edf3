"""The mixture-of-experts layer (training/moe/layer.py).

Its calls' waiting rule (``_call_all``: k_min, the wait after it, the deadline, the report) runs
on a scripted client under the autojump clock, where every answer's time is exact. The layer
itself runs over the in-memory swarm with real expert servers (tests/moe_swarm.py) and the real
client: its output and its gradients are checked against the same mixture computed here with
autograd, whole and with experts that failed, came late or answered rows of the wrong shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from libp2p.peer.id import ID

from p2p.errors import ConfigError
from training.moe import ClientConfig, Expert, ExpertBackend, ExpertCallError, ExpertClient, MoEConfig, MoEError
from training.moe import RemoteMixtureOfExperts
from training.moe.layer import CallReport, _call_all, _exchanges, _Job, _plan
from training.moe.beam_search import Beam
from training.moe.client import CallStats
from training.moe.protocol import Kind, KindValue

from .kit import log_lines, numbered_peer_id
from .moe_swarm import HID, HangingDHT, swarm

A, B, C = (numbered_peer_id(i) for i in range(3))


# ---------------------------------------------------------------------- the waiting rule, on the autojump clock


@dataclass
class Asked:
    uids: list[str]
    kind: KindValue
    at: float
    timeout: float
    tensors: list[list[torch.Tensor]]


class Scripted:
    """What ``_call_all`` uses of an :class:`ExpertClient`: ``config.max_rows`` and ``call_many``, which
    answers after its server's delay: each expert's rows doubled, or the expert's scripted failure."""

    def __init__(self, delays: dict[ID, float], failing: Sequence[str] = (), max_rows: int = 4096) -> None:
        self.config = SimpleNamespace(max_rows=max_rows)
        self.delays = delays
        self.failing = set(failing)
        self.asked: list[Asked] = []

    async def call_many(self, experts: Sequence[Expert], kind: KindValue, tensors: Sequence[Sequence[torch.Tensor]],
                        *, timeout: float) -> list[list[torch.Tensor] | ExpertCallError]:
        self.asked.append(Asked([e.uid for e in experts], kind, trio.current_time(), timeout,
                                [list(t) for t in tensors]))
        await trio.sleep(self.delays[experts[0].peer_id])
        return [ExpertCallError(f"expert {e.uid}: broke") if e.uid in self.failing else [t[0] * 2]
                for e, t in zip(experts, tensors)]


def job(uid: str, server: ID, rows: list[int]) -> _Job:
    return _Job(Expert(uid, server), torch.tensor(rows), torch.zeros(len(rows), dtype=torch.int64))


X = torch.arange(12.0).view(4, 3)


async def call_all(client: Scripted, jobs: list[_Job], samples: int, *, k_min: int = 1, timeout: float = 10.0,
                   after_k_min: float = 0.5) -> tuple[CallReport, float]:
    """``_call_all`` for a forward of X's first ``samples`` rows: its report and the seconds it took."""
    report = CallReport(samples=samples)
    started = trio.current_time()
    await _call_all(client, jobs, Kind.FORWARD, lambda j: [X[j.rows]], samples, k_min, timeout,  # type: ignore[arg-type]
                    after_k_min, report)
    return report, trio.current_time() - started


async def test_every_call_answered_ends_the_wait_at_the_last_answer(autojump_clock: trio.abc.Clock) -> None:
    client = Scripted({A: 1.0, B: 2.0})
    jobs = [job("e.0", A, [0, 1]), job("e.1", B, [1, 2])]
    report, took = await call_all(client, jobs, 3, after_k_min=5.0)
    assert took == 2.0  # not held for after_k_min, nor to the timeout
    assert report == CallReport(samples=3, asked=2, answered=2, failed=[], late=0, below_k_min=0, calls_s=2.0)
    assert [j.result.tolist() if j.result is not None else None for j in jobs] == [(X[[0, 1]] * 2).tolist(),
                                                                                  (X[[1, 2]] * 2).tolist()]
    # one exchange per server, all at once, each given what is left of the timeout, with its rows
    assert sorted((a.uids, a.kind, a.at, a.timeout) for a in client.asked) == [(["e.0"], Kind.FORWARD, 0.0, 10.0),
                                                                         (["e.1"], Kind.FORWARD, 0.0, 10.0)]
    assert torch.equal(next(a for a in client.asked if a.uids == ["e.1"]).tensors[0][0], X[[1, 2]])


async def test_once_each_sample_has_k_min_answers_the_rest_get_after_k_min(autojump_clock: trio.abc.Clock) -> None:
    client = Scripted({A: 1.0, B: 30.0})
    jobs = [job("e.0", A, [0, 1]), job("e.1", B, [0, 1])]
    report, took = await call_all(client, jobs, 2, after_k_min=0.5)
    assert took == 1.5
    assert report == CallReport(samples=2, asked=2, answered=1, late=1, below_k_min=0, calls_s=1.5)
    assert jobs[1].result is None


async def test_a_sample_needs_k_min_answers_or_as_many_as_it_was_routed(autojump_clock: trio.abc.Clock) -> None:
    # sample 0 has three experts and needs k_min=2; sample 1 has one and needs it; sample 2 none (below k_min)
    client = Scripted({A: 1.0, B: 2.0, C: 30.0})
    jobs = [job("e.0", A, [0, 1]), job("e.1", B, [0]), job("e.2", C, [0])]
    report, took = await call_all(client, jobs, 3, k_min=2, after_k_min=0.25)
    assert took == 2.25
    assert (report.answered, report.late, report.below_k_min) == (2, 1, 1)
    # one answer short of k_min at the first: the wait goes on
    client = Scripted({A: 1.0, B: 30.0})
    report, took = await call_all(client, [job("e.0", A, [0, 1]), job("e.1", B, [1])], 2, k_min=2, timeout=4.0)
    assert took == 4.0
    assert (report.answered, report.late, report.below_k_min) == (1, 1, 1)


async def test_the_timeout_ends_the_wait_and_counts_who_was_late(autojump_clock: trio.abc.Clock) -> None:
    client = Scripted({A: 1.0, B: 30.0})
    report, took = await call_all(client, [job("e.0", A, [0, 1]), job("e.1", B, [0, 1])], 2, k_min=2, timeout=5.0)
    assert took == 5.0
    assert report == CallReport(samples=2, asked=2, answered=1, late=1, below_k_min=2, calls_s=5.0)
    # a deadline already past: nothing waited for, every call late (each still asked, with a timeout above 0)
    client = Scripted({A: 1.0})
    report, took = await call_all(client, [job("e.0", A, [0])], 1, timeout=-3.0)
    assert took == 0.0
    assert (report.asked, report.answered, report.late, report.below_k_min) == (1, 0, 1, 1)
    assert [a.timeout for a in client.asked] == [1e-3]


async def test_a_failed_call_is_reported_and_is_not_an_answer(autojump_clock: trio.abc.Clock) -> None:
    client = Scripted({A: 1.0, B: 2.0}, failing=["e.1"])
    jobs = [job("e.0", A, [0]), job("e.1", B, [1])]
    report, took = await call_all(client, jobs, 2, after_k_min=5.0)
    assert took == 2.0  # every call came back: no wait for after_k_min
    assert report == CallReport(samples=2, asked=2, answered=1, failed=["expert e.1: broke"], late=0,
                                below_k_min=1, calls_s=2.0)
    assert jobs[1].result is None


async def test_calls_go_in_one_exchange_per_server_of_at_most_max_rows(autojump_clock: trio.abc.Clock) -> None:
    client = Scripted({A: 1.0, B: 1.0}, max_rows=3)
    jobs = [job("e.0", A, [0, 1]), job("e.1", A, [2]), job("e.2", A, [3]), job("e.3", B, [0])]
    report, _ = await call_all(client, jobs, 4)
    assert sorted(a.uids for a in client.asked) == [["e.0", "e.1"], ["e.2"], ["e.3"]]
    assert report.asked == 4 and report.answered == 4


def test_exchanges_fill_up_to_max_rows_exactly() -> None:
    two, one = job("e.0", A, [0, 1]), job("e.1", A, [2])
    assert [[j.expert.uid for j in g] for g in _exchanges([two, one], 3)] == [["e.0", "e.1"]]
    assert [[j.expert.uid for j in g] for g in _exchanges([two, one], 2)] == [["e.0"], ["e.1"]]
    # each new exchange counts its rows from none
    assert [[j.expert.uid for j in g] for g in _exchanges([two, one, job("e.2", A, [3])], 2)] == [["e.0"],
                                                                                              ["e.1", "e.2"]]
    # a job larger than max_rows on its own is one exchange (the plan never makes one: see below)
    assert [[j.expert.uid for j in g] for g in _exchanges([one, two], 1)] == [["e.1"], ["e.0"]]
    assert _exchanges([], 4) == []


def test_the_plan_routes_each_sample_to_its_experts_in_jobs_of_max_rows() -> None:
    e, f = Expert("e.0", A), Expert("e.1", B)
    beams = [[Beam(2.0, (0,), [e]), Beam(1.0, (1,), [f])], [Beam(2.0, (1,), [f])], [Beam(1.0, (0,), [e])]]
    plan = [(j.expert.uid, j.rows.tolist(), j.slots.tolist()) for j in _plan(beams, 4)]
    assert plan == [("e.0", [0, 2], [0, 0]), ("e.1", [0, 1], [1, 0])]
    plan = [(j.expert.uid, j.rows.tolist(), j.slots.tolist()) for j in _plan(beams * 2, 2)]
    assert plan == [("e.0", [0, 2], [0, 0]), ("e.0", [3, 5], [0, 0]),
                    ("e.1", [0, 1], [1, 0]), ("e.1", [3, 4], [1, 0])]
    assert _plan([[], []], 4) == []


# ---------------------------------------------------------------------- settings


def test_the_settings_and_what_they_refuse() -> None:
    assert MoEConfig() == MoEConfig(k_best=4, k_min=1, beam_size=None, forward_timeout=10.0, backward_timeout=20.0,
                                    timeout_after_k_min=1.0, cache_ttl=15.0)
    MoEConfig(k_best=2, k_min=2, beam_size=2, timeout_after_k_min=0.0).validate()
    refused = [
        ("MoE: want 1 <= k_min <= k_best, got k_min=0, k_best=4", MoEConfig(k_min=0)),
        ("MoE: want 1 <= k_min <= k_best, got k_min=3, k_best=2", MoEConfig(k_best=2, k_min=3)),
        ("MoE: beam_size must be at least k_best", MoEConfig(k_best=3, beam_size=2)),
        ("MoE: forward_timeout must be positive, got 0.0", MoEConfig(forward_timeout=0.0)),
        ("MoE: backward_timeout must be positive, got -1.0", MoEConfig(backward_timeout=-1.0)),
        ("MoE: cache_ttl must be positive, got nan", MoEConfig(cache_ttl=float("nan"))),
        ("MoE: timeout_after_k_min must be >= 0", MoEConfig(timeout_after_k_min=-0.1)),
        ("MoE: timeout_after_k_min must be >= 0", MoEConfig(timeout_after_k_min=float("nan"))),
    ]
    for message, config in refused:
        with pytest.raises(ConfigError) as caught:
            config.validate()
        assert str(caught.value) == message


# ---------------------------------------------------------------------- the layer, over the in-memory swarm


class Slow(torch.nn.Module):
    """A module that takes ``seconds`` per forward once armed (the server runs it in a worker thread)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        out: torch.Tensor = self.inner(x)
        return out


def expert(uid: str, out: int = HID) -> ExpertBackend:
    """A linear expert that the server does not change (lr 0): the mixture computed here uses it as it is."""
    torch.manual_seed(sum(map(ord, uid)))
    module = Slow(torch.nn.Sequential(torch.nn.Linear(HID, out), torch.nn.Tanh()))
    return ExpertBackend(uid, module, torch.optim.SGD(module.parameters(), lr=0.0), (HID,))


def slow_down(backend: ExpertBackend, seconds: float) -> None:
    assert isinstance(backend.module, Slow)
    backend.module.seconds = seconds


def experts(uids: Sequence[str]) -> list[ExpertBackend]:
    return [expert(u) for u in uids]


def grid(rows: Sequence[int], columns: int) -> list[str]:
    return [f"ffn.{a}.{b}" for a in rows for b in range(columns)]


def modules(sw: Any) -> dict[str, torch.nn.Module]:
    return {uid: b.module for server in sw.servers for uid, b in server.backends.items()}


def mixture(layer: RemoteMixtureOfExperts, experts_: dict[str, torch.nn.Module], x: torch.Tensor,
            answering: set[str], *, constant: frozenset[str] = frozenset()) -> tuple[torch.Tensor, set[str]]:
    """The layer's output computed here, and the experts chosen: each sample's ``k_best`` experts by
    score among ``experts_`` (the exact best: the tests' beams cover the grid), mixed by the softmax of
    the scores of those ``answering``; the outputs of those in ``constant`` take no gradient."""
    rows, cols = layer.grid_size
    g = layer.gate(x)
    chosen: set[str] = set()
    out = []
    for i in range(x.shape[0]):
        scores = {f"ffn.{a}.{b}": g[i, a] + g[i, rows + b] for a in range(rows) for b in range(cols)
                  if f"ffn.{a}.{b}" in experts_}
        best = sorted(scores, key=lambda u: float(scores[u].detach()), reverse=True)[:layer.config.k_best]
        chosen.update(best)
        alive = [u for u in best if u in answering]
        weights = torch.softmax(torch.stack([scores[u] for u in alive]), dim=0)
        values = [experts_[u](x[i:i + 1])[0] for u in alive]
        values = [v.detach() if u in constant else v for u, v in zip(alive, values)]
        out.append(sum(w * v for w, v in zip(weights, values)))
    return torch.stack(out), chosen


def gradients(layer: RemoteMixtureOfExperts, x: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of x and the gate, taken and cleared."""
    assert x.grad is not None and layer.gate.weight.grad is not None and layer.gate.bias.grad is not None
    out = [x.grad.clone(), layer.gate.weight.grad.clone(), layer.gate.bias.grad.clone()]
    x.grad = None
    layer.zero_grad()
    return out


def close(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.allclose(p, q, atol=1e-5) for p, q in zip(a, b))


def layer_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return log_lines(caplog, "training.moe.layer", "")


def layer_of(client: ExpertClient, grid_size: tuple[int, int], **config: Any) -> RemoteMixtureOfExperts:
    torch.manual_seed(3)
    return RemoteMixtureOfExperts(client, in_features=HID, grid_size=grid_size, uid_prefix="ffn",
                                  config=MoEConfig(**config))


def fixed_scores(layer: RemoteMixtureOfExperts, scores: Sequence[float]) -> None:
    """Every sample scores the grid's coordinates alike: ``scores`` (the gate's bias)."""
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.bias.copy_(torch.tensor(scores))


async def test_the_mix_and_its_gradients_are_the_mixture_computed_here() -> None:
    async with swarm(experts(grid([0, 1], 3)), experts(grid([2, 3], 3))) as sw, \
            ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (4, 3), k_best=4, beam_size=12)
        x = torch.randn(16, HID, requires_grad=True)
        upstream = torch.randn(16, HID)

        def step() -> torch.Tensor:
            y: torch.Tensor = layer(x)
            torch.autograd.backward((y * upstream).sum())
            return y.detach()

        y = await client.run(step)
        got = gradients(layer, x)
        every = modules(sw)
        want, chosen = mixture(layer, every, x, set(every))
        torch.autograd.backward((want * upstream).sum())
        assert torch.allclose(y, want.detach(), atol=1e-5), float((y - want).abs().max())
        assert close(got, gradients(layer, x))
        report = layer.last_report
        assert report is not None and 0 < report.search_s < 5 and 0 < report.calls_s < 5
        assert (report.samples, report.asked, report.answered, report.failed, report.late, report.below_k_min) \
            == (16, len(chosen), len(chosen), [], 0, 0)
        back = layer.last_backward
        assert back is not None and (back.samples, back.asked, back.answered, back.failed, back.late) \
            == (16, len(chosen), len(chosen), [], 0)
        assert {u for s in sw.servers for u, b in s.backends.items() if b.backwards} == chosen


async def test_an_input_without_gradient_still_trains_the_experts_and_the_gate() -> None:
    """The mixture as a model's first layer: x takes no gradient, the experts and the gate do."""
    async with swarm(experts(grid([0], 2))) as sw, ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (1, 2), k_best=2)
        x = torch.randn(3, HID)
        await client.run(lambda: torch.autograd.backward(layer(x).sum()))
        assert x.grad is None and layer.gate.weight.grad is not None
        assert layer.last_backward is not None and layer.last_backward.answered == 2
        assert all(b.backwards == 1 for b in sw.servers[0].backends.values())


async def test_a_dead_servers_experts_drop_out_of_the_mix_and_of_the_backward(
        caplog: pytest.LogCaptureFixture) -> None:
    async with swarm(experts(grid([0, 1], 2)), experts(grid([2, 3], 2))) as sw, \
            ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (4, 2), k_best=6, beam_size=8)
        x = torch.randn(8, HID, requires_grad=True)
        await client.run(lambda: layer(x))  # the search's cache holds both servers' experts
        sw.kill(1)
        every = modules(sw)
        with caplog.at_level(logging.INFO, "training.moe.layer"):
            y = await client.run(lambda: layer(x))
        await client.run(lambda: torch.autograd.backward(y.sum()))
        got = gradients(layer, x)
        live = set(sw.servers[0].backends)
        want, chosen = mixture(layer, every, x, live)
        torch.autograd.backward(want.sum())
        assert torch.allclose(y, want, atol=1e-5) and close(got, gradients(layer, x))
        report, back = layer.last_report, layer.last_backward
        assert report is not None and back is not None
        dead = chosen - live
        assert (report.asked, report.answered, report.late, report.below_k_min) == (len(chosen), len(chosen & live),
                                                                                     0, 0)
        assert sorted(f.split("@")[0] for f in report.failed) == sorted(f"expert {u}" for u in dead)
        assert layer_lines(caplog) == [f"MoE forward: 0 samples under k_min=1; {len(dead)} of {len(chosen)} calls "
                                       f"failed, 0 late"]
        # only the experts that answered are asked for their gradients
        assert (back.asked, back.answered, back.failed) == (len(chosen & live), len(chosen & live), [])


async def test_experts_gone_before_the_backward_are_left_out_of_the_gradient_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    async with swarm(experts(grid([0, 1], 2)), experts(grid([2, 3], 2))) as sw, \
            ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (4, 2), k_best=8)
        x = torch.randn(8, HID, requires_grad=True)
        y = await client.run(lambda: layer(x))
        sw.kill(1)
        every = modules(sw)
        with caplog.at_level(logging.WARNING, "training.moe.layer"):
            await client.run(lambda: torch.autograd.backward(y.sum()))
        got = gradients(layer, x)
        dead = frozenset(sw.servers[1].backends)
        want, chosen = mixture(layer, every, x, set(every), constant=dead)
        torch.autograd.backward(want.sum())
        assert close(got, gradients(layer, x))
        back = layer.last_backward
        assert back is not None
        gone = len(chosen & dead)
        assert (back.asked, back.answered, len(back.failed), back.late) == (len(chosen), len(chosen) - gone, gone, 0)
        assert gone == 4 and len(chosen) == 8
        assert layer_lines(caplog) == ["MoE backward: 4 of 8 experts did not answer (their gradients are left out): "
                                       f"4 failed ({'; '.join(back.failed[:3])}), 0 late"]


async def test_an_expert_too_slow_for_the_backward_is_left_out_of_the_gradient_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    async with swarm([expert("ffn.0.0")], [expert("ffn.1.0")]) as sw, ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (2, 1), k_best=2, backward_timeout=0.5)
        x = torch.randn(2, HID, requires_grad=True)
        y = await client.run(lambda: layer(x))
        slow_down(sw.servers[1].backends["ffn.1.0"], 1.0)  # the server's backward runs the forward again
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, "training.moe.layer"):
            await client.run(lambda: torch.autograd.backward(y.sum()))
        assert time.monotonic() - started < 0.9
        got = gradients(layer, x)
        every = modules(sw)
        slow_down(sw.servers[1].backends["ffn.1.0"], 0.0)
        want, _ = mixture(layer, every, x, set(every), constant=frozenset({"ffn.1.0"}))
        torch.autograd.backward(want.sum())
        assert close(got, gradients(layer, x))
        back = layer.last_backward
        assert back is not None and (back.asked, back.answered, back.failed, back.late) == (2, 1, [], 1)
        assert layer_lines(caplog) == ["MoE backward: 1 of 2 experts did not answer (their gradients are left out): "
                                       "0 failed, 1 late"]


async def test_a_wider_beam_finds_the_best_experts_of_a_sparse_grid() -> None:
    async with swarm(experts(["ffn.0.0", "ffn.1.0", "ffn.2.3"])) as sw, ExpertClient.open(sw.client) as client:
        served = sw.servers[0].backends
        x = torch.randn(2, HID)
        found: dict[int | None, set[str]] = {}
        for beam in (None, 3):
            layer = layer_of(client, (3, 4), k_best=2, beam_size=beam)
            fixed_scores(layer, [3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 5.0])
            before = {u: b.forwards for u, b in served.items()}
            await client.run(lambda: layer(x))
            found[beam] = {u for u, b in served.items() if b.forwards > before[u]}
        # the best two are ffn.2.3 (1 + 5) and ffn.0.0 (3); a beam of two keeps rows 0 and 1 only
        assert found == {None: {"ffn.0.0", "ffn.1.0"}, 3: {"ffn.0.0", "ffn.2.3"}}


async def test_an_expert_answering_rows_of_another_shape_is_dropped_and_banned() -> None:
    """The shape most answers have is the layer's, whichever came first: one misconfigured expert
    (here the best scored, so the first answer) is left out, not every other."""
    async with swarm([expert("ffn.0.0", out=HID + 1)], experts(["ffn.0.1", "ffn.0.2"])) as sw, \
            ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (1, 3), k_best=3)
        fixed_scores(layer, [0.0, 3.0, 2.0, 1.0])
        x = torch.randn(3, HID, requires_grad=True)
        y = await client.run(lambda: layer(x))
        every = modules(sw)
        want, _ = mixture(layer, every, x, {"ffn.0.1", "ffn.0.2"})
        assert torch.allclose(y, want, atol=1e-5)  # the weight on the two left
        report = layer.last_report
        assert report is not None and report.answered == 3
        odd, good = sw.peers[0].peer_id, sw.peers[1].peer_id
        assert report.failed == [f"expert ffn.0.0@{str(odd)[-8:]}: rows of [{HID + 1}], most answers [{HID}]"]
        assert client.banned("ffn.0.0", odd) and not client.banned("ffn.0.1", good)
        assert client.stats.reasons == report.failed
        await client.run(lambda: torch.autograd.backward(y.sum()))
        assert layer.last_backward is not None and layer.last_backward.asked == 2
        # the next search leaves it out
        await client.run(lambda: layer(x))
        assert layer.last_report is not None and layer.last_report.asked == 2 and not layer.last_report.failed


async def test_of_two_shapes_as_common_the_first_answers_is_kept() -> None:
    async with swarm([expert("ffn.0.0")], [expert("ffn.0.1", out=HID + 1)]) as sw, \
            ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (1, 2), k_best=2)
        fixed_scores(layer, [0.0, 2.0, 1.0])  # ffn.0.0 first
        x = torch.randn(3, HID)
        y = await client.run(lambda: layer(x))
        assert torch.allclose(y, sw.servers[0].backends["ffn.0.0"].module(x), atol=1e-5)
        assert layer.last_report is not None and layer.last_report.failed == [
            f"expert ffn.0.1@{str(sw.peers[1].peer_id)[-8:]}: rows of [{HID + 1}], most answers [{HID}]"]


async def test_no_answer_for_any_sample_is_an_error_naming_the_failures() -> None:
    async with swarm(experts(grid([0], 4))) as sw, ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (1, 4), k_best=4)
        await client.run(lambda: layer(torch.randn(2, HID)))
        sw.kill(0)
        with pytest.raises(MoEError) as caught:
            await client.run(lambda: layer(torch.randn(2, HID)))
        report = layer.last_report
        assert report is not None and len(report.failed) == 4
        assert str(caught.value) == f"no expert answered for any of 2 samples (4 asked: " \
                                    f"{'; '.join(report.failed[:3])})"


async def test_no_answer_in_time_for_any_sample_says_all_were_too_late() -> None:
    async with swarm(experts(grid([0], 1))) as sw, ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (1, 1), k_best=1, forward_timeout=0.5)
        await client.run(lambda: layer(torch.randn(2, HID)))
        slow_down(sw.servers[0].backends["ffn.0.0"], 1.0)
        with pytest.raises(MoEError, match=r"^no expert answered for any of 2 samples \(1 asked: all too late\)$"):
            await client.run(lambda: layer(torch.randn(2, HID)))


async def test_a_sample_left_without_an_answer_is_an_error_naming_how_many() -> None:
    async with swarm([expert("ffn.0.0")], experts(grid([1], 4))) as sw, ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (2, 4), k_best=4)
        with torch.no_grad():  # sample 0 prefers row 0 (ffn.0.0, the only one there), sample 1 row 1
            layer.gate.weight.zero_()
            layer.gate.bias.zero_()
            layer.gate.weight[0, 0], layer.gate.weight[1, 0] = 1.0, -1.0
        x = torch.zeros(2, HID)
        x[0, 0], x[1, 0] = 5.0, -5.0
        await client.run(lambda: layer(x))
        sw.kill(1)
        with pytest.raises(MoEError) as caught:
            await client.run(lambda: layer(x))
        report = layer.last_report
        assert report is not None and len(report.failed) == 4
        assert str(caught.value) == f"MoE: no expert answered for 1 of 2 samples (5 calls, 4 failed, 0 late: " \
                                    f"{'; '.join(report.failed[:3])})"


async def test_k_min_answers_end_the_forward_and_the_forward_timeout_bounds_it(
        caplog: pytest.LogCaptureFixture) -> None:
    async with swarm([expert("ffn.0.0")], [expert("ffn.1.0")]) as sw, ExpertClient.open(sw.client) as client:
        fast = sw.servers[0].backends["ffn.0.0"].module
        x = torch.randn(2, HID)
        layer = layer_of(client, (2, 1), k_best=2, k_min=1, timeout_after_k_min=0.2, forward_timeout=5.0)
        await client.run(lambda: layer(x))
        slow_down(sw.servers[1].backends["ffn.1.0"], 1.0)
        started = time.monotonic()
        y = await client.run(lambda: layer(x))
        assert time.monotonic() - started < 0.9
        report = layer.last_report
        assert report is not None and (report.answered, report.late, report.below_k_min) == (1, 1, 0)
        assert torch.allclose(y, fast(x), atol=1e-5)
        # two answers wanted: the wait goes to forward_timeout (search included), and no further
        layer.config.k_min, layer.config.forward_timeout = 2, 0.5
        started = time.monotonic()
        with caplog.at_level(logging.INFO, "training.moe.layer"):
            y = await client.run(lambda: layer(x))
        assert 0.45 < time.monotonic() - started < 0.9
        report = layer.last_report
        assert report is not None and (report.answered, report.late, report.below_k_min) == (1, 1, 2)
        assert layer_lines(caplog) == ["MoE forward: 2 samples under k_min=2; 0 of 2 calls failed, 1 late"]
        assert torch.allclose(y, fast(x), atol=1e-5)


async def test_the_layer_refuses_a_bad_grid_and_a_bad_input() -> None:
    async with swarm() as sw, ExpertClient.open(sw.client) as client:
        for bad in ([], [4, 0], [-1]):
            with pytest.raises(ConfigError, match=rf"^MoE: grid_size must be positive sizes, got {bad}$".replace(
                    "[", r"\[").replace("]", r"\]")):
                RemoteMixtureOfExperts(client, in_features=HID, grid_size=bad, uid_prefix="ffn")
        with pytest.raises(ConfigError, match="^MoE: beam_size must be at least k_best$"):
            layer_of(client, (2, 2), k_best=2, beam_size=1)
        layer = layer_of(client, (2, 3), k_best=2, cache_ttl=4.0)
        assert layer.last_report is None and layer.last_backward is None
        assert (layer.gate.in_features, layer.gate.out_features) == (HID, 5)
        assert (layer.searcher.prefix, layer.searcher.grid_size, layer.searcher.cache_ttl) == ("ffn", (2, 3), 4.0)
        for shape in ((2, HID + 1), (HID,), (1, 2, HID)):
            with pytest.raises(ValueError, match=rf"^MoE: input must be \[batch, {HID}\], got "
                                                 rf"\[{', '.join(map(str, shape))}\]$"):
                await client.run(lambda: layer(torch.zeros(*shape)))


async def test_the_search_leaves_out_banned_experts_and_unreachable_servers() -> None:
    async with swarm(experts(grid([0], 2))) as sw, ExpertClient.open(sw.client) as client:
        layer = layer_of(client, (1, 2), k_best=2)
        peer = sw.peers[0].peer_id
        one, other = Expert("ffn.0.0", peer), Expert("ffn.0.1", peer)
        assert layer.searcher.usable is not None and layer.searcher.reachable is not None
        assert layer.searcher.usable(one) and layer.searcher.reachable(peer)
        client.ban(one, ExpertCallError("expert ffn.0.0: broke"))
        assert not layer.searcher.usable(one) and layer.searcher.usable(other) and layer.searcher.reachable(peer)
        client.ban(other, ExpertCallError("expert ffn.0.1: no route", unreachable=True))
        assert not layer.searcher.reachable(peer)


async def test_a_search_that_finds_nobody_says_why() -> None:
    async with swarm(experts(grid([0], 2))) as sw:
        async with ExpertClient.open(sw.client, ClientConfig(ban_time=60.0, overload_ban_time=20.0)) as client:
            where = r"^no live expert under 'ffn' \(grid 1x2\): "
            nobody = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(1, 2), uid_prefix="none",
                                            config=MoEConfig(k_best=2))
            with pytest.raises(MoEError, match=r"^no live expert under 'none' \(grid 1x2\): no server declares one$"):
                await client.run(lambda: nobody(torch.randn(2, HID)))
            layer = layer_of(client, (1, 2), k_best=2, forward_timeout=3.0)
            await client.run(lambda: layer(torch.randn(2, HID)))
            peer = sw.peers[0].peer_id
            # every expert found is banned: how many, when the first is back (the shorter ban), the latest failure
            client.ban(Expert("ffn.0.1", peer), ExpertCallError("expert ffn.0.1: it broke"))
            client.ban(Expert("ffn.0.1", peer), ExpertCallError("expert ffn.0.1: it broke again"))
            client.ban(Expert("ffn.0.0", peer), ExpertCallError("expert ffn.0.0: overloaded", busy=True))
            with pytest.raises(MoEError, match=where + r"the 2 experts it found are all left out after failed calls "
                                                       r"\(the first is back in searches in (19\.\d|20\.0) s; the "
                                                       r"latest failure: expert ffn.0.0: overloaded\)$"):
                await client.run(lambda: layer(torch.randn(2, HID)))
            client.stats = CallStats()  # the counts reset (a metrics reader may): the reason is not made up
            with pytest.raises(MoEError, match=r"\(the first is back in searches in (19\.\d|20\.0) s; the latest "
                                               r"failure: none recorded\)$"):
                await client.run(lambda: layer(torch.randn(2, HID)))


async def test_a_search_whose_reads_fail_or_run_out_of_time_says_so() -> None:
    async with swarm(experts(grid([0], 2))) as sw, ExpertClient.open(sw.client) as client:
        where = r"^no live expert under 'ffn' \(grid 1x2\): "
        layer = layer_of(client, (1, 2), k_best=2, forward_timeout=0.5)
        layer.searcher.dht = HangingDHT()  # type: ignore[assignment]
        layer.searcher.read_timeout = 0.1
        with pytest.raises(MoEError, match=where + r"the DHT read of 1 prefixes failed or ran past read_timeout "
                                                   r"0.1 s$"):
            await client.run(lambda: layer(torch.randn(2, HID)))
        layer.searcher.read_timeout = 5.0
        started = time.monotonic()
        with pytest.raises(MoEError, match=where + r"the search did not finish within (0\.4|0\.5) s \(forward_timeout\)$"):
            await client.run(lambda: layer(torch.randn(2, HID)))
        assert time.monotonic() - started < 0.9
