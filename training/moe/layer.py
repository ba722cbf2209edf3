"""The decentralized mixture-of-experts layer: gating, beam search, remote calls, renormalised weights.

``RemoteMixtureOfExperts`` is an ordinary ``nn.Module``. For a batch it

1. scores every grid coordinate with a linear gate (product-key gating,
   Learning@home 3.1: d dimensions of size M, one score per coordinate);
2. finds each sample's ``k_best`` live experts by beam search over the DHT
   (:mod:`training.moe.beam_search`; warm searches read the cache only);
3. sends each chosen expert the rows routed to it, all at once, one exchange
   per server carrying the rows of all its chosen experts
   (:meth:`ExpertClient.call_many`); once every sample has ``k_min`` answers
   it waits at most ``timeout_after_k_min`` more for the rest, and never past
   ``forward_timeout`` counted from the start of the search;
4. mixes the answers with the softmax of the answered experts' scores (the
   weights renormalised over those that answered: failed, banned and late
   experts drop out).

Backward sends every answered expert its rows' output gradients (its server
trains it) with the same k_min rule, and sums the input gradients; the gate
learns through the mixing weights. A sample that no expert answered has no
output: the call raises :class:`MoEError` (nothing silent); samples under
``k_min`` and every failure are in :attr:`last_report`, and logged.

Torch calls this in a worker thread (``await client.run(step)``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from p2p.errors import ConfigError

from .beam_search import Beam, BeamSearcher
from .client import ExpertClient
from .protocol import Expert, ExpertCallError, Kind, KindValue, MoEError

log = logging.getLogger(__name__)


@dataclass
class MoEConfig:
    #: Experts per sample.
    k_best: int = 4
    #: Answers per sample after which the layer stops waiting (plus ``timeout_after_k_min``).
    k_min: int = 1
    #: Candidates kept per dimension during the search (at least k_best).
    beam_size: int | None = None
    #: The whole forward, search included, and the whole backward.
    forward_timeout: float = 10.0
    backward_timeout: float = 20.0
    #: How long to wait for the other experts once every sample has k_min answers.
    timeout_after_k_min: float = 1.0
    #: Seconds a read prefix stays in the search cache.
    cache_ttl: float = 15.0

    def validate(self) -> None:
        if not 1 <= self.k_min <= self.k_best:
            raise ConfigError(f"MoE: want 1 <= k_min <= k_best, got k_min={self.k_min}, k_best={self.k_best}")
        if self.beam_size is not None and self.beam_size < self.k_best:
            raise ConfigError("MoE: beam_size must be at least k_best")
        for name in ("forward_timeout", "backward_timeout", "cache_ttl"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"MoE: {name} must be positive, got {getattr(self, name)}")
        if not self.timeout_after_k_min >= 0:
            raise ConfigError("MoE: timeout_after_k_min must be >= 0")


@dataclass
class CallReport:
    """What one forward (or backward) did."""

    samples: int
    asked: int = 0
    answered: int = 0
    failed: list[str] = field(default_factory=list)
    late: int = 0
    #: samples that got fewer than k_min answers
    below_k_min: int = 0
    search_s: float = 0.0
    calls_s: float = 0.0


@dataclass
class _Job:
    expert: Expert
    rows: torch.Tensor        # sample indices (int64)
    slots: torch.Tensor       # which of the sample's k slots
    result: torch.Tensor | None = None


async def _call_all(client: ExpertClient, jobs: list[_Job], kind: KindValue, tensors_of: Any, samples: int,
                    k_min: int, timeout: float, after_k_min: float, report: CallReport) -> None:
    """Every job's call at once, one exchange per server and ``max_rows`` (:meth:`ExpertClient.call_many`), until each
    sample has ``k_min`` answers (+ ``after_k_min``) or ``timeout`` (seconds from now: the caller is a worker
    thread, whose clock is not the loop's); it fills in ``report``'s counts and ``calls_s``."""
    need = torch.zeros(samples, dtype=torch.int64)
    for job in jobs:
        need[job.rows] += 1
    need = need.clamp(max=k_min)
    got = torch.zeros(samples, dtype=torch.int64)
    enough = trio.Event()
    exchanges = _exchanges(jobs, client.config.max_rows)
    pending = len(exchanges)
    started = trio.current_time()
    deadline = started + max(0.0, timeout)

    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.deadline = deadline

        async def one_server(group: list[_Job]) -> None:
            nonlocal pending
            results = await client.call_many([job.expert for job in group], kind,
                                             [tensors_of(job) for job in group],
                                             timeout=max(1e-3, deadline - trio.current_time()))
            for job, result in zip(group, results):
                if isinstance(result, ExpertCallError):
                    report.failed.append(str(result))
                else:
                    job.result = result[0]
                    got[job.rows] += 1
                    report.answered += 1
            pending -= 1
            if pending == 0:
                nursery.cancel_scope.cancel()
            elif not enough.is_set() and bool((got >= need).all()):
                enough.set()

        async def stop_after_k_min() -> None:
            await enough.wait()
            await trio.sleep(after_k_min)
            nursery.cancel_scope.cancel()

        nursery.start_soon(stop_after_k_min)
        report.asked = len(jobs)
        for group in exchanges:
            nursery.start_soon(one_server, group)
    report.late = report.asked - report.answered - len(report.failed)
    report.below_k_min = int((got < need).sum()) + int((need == 0).sum())
    report.calls_s = trio.current_time() - started


class _MoECall(torch.autograd.Function):
    """All the remote calls of one forward, as one differentiable step: x -> (outputs [B, k, ...], answered [B, k])."""

    @staticmethod
    def forward(ctx: Any, layer: RemoteMixtureOfExperts, jobs: list[_Job], deadline: float, _trains: torch.Tensor,
                x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        client, cfg = layer.client, layer.config
        xc = x.detach().cpu()
        report = layer.last_report
        assert report is not None
        client.blocking(_call_all, client, jobs, Kind.FORWARD, lambda job: [xc[job.rows]], x.shape[0],
                        cfg.k_min, deadline - time.monotonic(), cfg.timeout_after_k_min, report)
        answered = [job for job in jobs if job.result is not None]
        if not answered:
            raise MoEError(f"no expert answered for any of {x.shape[0]} samples ({report.asked} asked: "
                           + ("; ".join(report.failed[:3]) or "all too late") + ")")
        # the shape most answers have (the first of equals): one misconfigured expert, first or not, is
        # the one left out, never the others
        shapes = Counter(job.result.shape[1:] for job in answered if job.result is not None)
        out_row = max(shapes, key=shapes.__getitem__)
        outputs = torch.zeros(x.shape[0], cfg.k_best, *out_row)
        mask = torch.zeros(x.shape[0], cfg.k_best, dtype=torch.bool)
        for job in answered:
            assert job.result is not None
            if job.result.shape[1:] != out_row:
                report.failed.append(f"expert {job.expert}: rows of {list(job.result.shape[1:])}, most answers "
                                     f"{list(out_row)}")
                client.blocking_sync(client.ban, job.expert, ExpertCallError(report.failed[-1]))
                job.result = None
                continue
            outputs[job.rows, job.slots] = job.result
            mask[job.rows, job.slots] = True
        ctx.layer, ctx.jobs = layer, [job for job in jobs if job.result is not None]
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(mask)
        return outputs.to(x.device, x.dtype), mask.to(x.device)

    @staticmethod
    def backward(ctx: Any, grad_outputs: torch.Tensor, _grad_mask: Any) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        layer: RemoteMixtureOfExperts = ctx.layer
        cfg, client = layer.config, layer.client
        xc, gc = x.detach().cpu(), grad_outputs.detach().cpu().float()
        jobs = [_Job(job.expert, job.rows, job.slots) for job in ctx.jobs]
        report = CallReport(samples=x.shape[0])
        client.blocking(_call_all, client, jobs, Kind.BACKWARD,
                        lambda job: [xc[job.rows], gc[job.rows, job.slots]], x.shape[0], cfg.k_min,
                        cfg.backward_timeout, cfg.timeout_after_k_min, report)
        layer.last_backward = report
        if report.failed or report.late:
            log.warning("MoE backward: %d of %d experts did not answer (their gradients are left out): %d failed%s, "
                        "%d late", len(report.failed) + report.late, report.asked, len(report.failed),
                        f" ({'; '.join(report.failed[:3])})" if report.failed else "", report.late)
        grad_x = torch.zeros(xc.shape, dtype=torch.float32)
        for job in jobs:
            if job.result is not None:
                grad_x.index_add_(0, job.rows, job.result)
        return None, None, None, None, grad_x.to(x.device, x.dtype) if ctx.needs_input_grad[4] else None


class RemoteMixtureOfExperts(torch.nn.Module):
    """A mixture of the experts declared under ``uid_prefix`` on a grid of ``grid_size`` (see the module)."""

    def __init__(self, client: ExpertClient, *, in_features: int, grid_size: Sequence[int], uid_prefix: str,
                 config: MoEConfig | None = None) -> None:
        super().__init__()
        self.config = config or MoEConfig()
        self.config.validate()
        if not grid_size or any(m < 1 for m in grid_size):
            raise ConfigError(f"MoE: grid_size must be positive sizes, got {list(grid_size)}")
        self.client = client
        self.grid_size = tuple(grid_size)
        self.gate = torch.nn.Linear(in_features, sum(self.grid_size))
        self.searcher = BeamSearcher(client.peer.dht, uid_prefix, self.grid_size, cache_ttl=self.config.cache_ttl,
                                     usable=lambda e: not client.banned(e.uid, e.peer_id),
                                     reachable=lambda p: not client.unreachable(p))
        self.last_report: CallReport | None = None
        self.last_backward: CallReport | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.gate.in_features:
            raise ValueError(f"MoE: input must be [batch, {self.gate.in_features}], got {list(x.shape)}")
        cfg = self.config
        started = time.monotonic()
        deadline = started + cfg.forward_timeout
        grid_scores = self.gate(x).split(self.grid_size, dim=-1)
        report = self.last_report = CallReport(samples=x.shape[0])
        # this is a worker thread: its deadline is on its own clock, and the loop gets what is left of it
        search_timeout = deadline - time.monotonic()
        found = self.client.blocking(self._search, [s.detach() for s in grid_scores], search_timeout)
        report.search_s = time.monotonic() - started
        beams = found or []
        jobs = _plan(beams, self.client.config.max_rows)
        if not jobs:
            raise MoEError(self._nobody_found(found is None, search_timeout))
        coords = torch.zeros(x.shape[0], cfg.k_best, len(self.grid_size), dtype=torch.int64)
        chosen = torch.zeros(x.shape[0], cfg.k_best, dtype=torch.bool)
        for i, sample in enumerate(beams):
            for j, beam in enumerate(sample):
                coords[i, j] = torch.tensor(beam.coords)
                chosen[i, j] = True
        # ``trains`` requires grad, so autograd runs the backward (the experts' training) even when x
        # does not (the mixture as a model's first layer), as hivemind's DUMMY tensor does
        trains = torch.empty(0, requires_grad=True)
        outputs, answered = _MoECall.apply(self, jobs, deadline, trains, x)  # type: ignore[no-untyped-call]
        # an expert's score: the sum of its coordinates' scores (differentiable: the gate learns)
        coords = coords.to(x.device)
        scores = sum(s.gather(1, coords[:, :, d]) for d, s in enumerate(grid_scores))
        alive = answered & chosen.to(x.device)
        missing = ~alive.any(dim=1)
        if bool(missing.any()):
            raise MoEError(f"MoE: no expert answered for {int(missing.sum())} of {x.shape[0]} samples "
                           f"({report.asked} calls, {len(report.failed)} failed, {report.late} late: "
                           + "; ".join(report.failed[:3]) + ")")
        if report.below_k_min or report.failed:
            log.info("MoE forward: %d samples under k_min=%d; %d of %d calls failed, %d late",
                     report.below_k_min, cfg.k_min, len(report.failed), report.asked, report.late)
        weights = torch.softmax(scores.masked_fill(~alive, float("-inf")), dim=1)
        shape = (*weights.shape, *([1] * (outputs.dim() - 2)))
        mixed: torch.Tensor = (weights.view(shape) * outputs).sum(dim=1)
        return mixed

    async def _search(self, grid_scores: list[torch.Tensor], timeout: float) -> list[list[Beam]] | None:
        """The search's beams; None when it ran past ``timeout``."""
        with trio.move_on_after(max(0.0, timeout)):
            return await self.searcher.search(grid_scores, self.config.k_best, self.config.beam_size)
        return None

    async def _first_back(self, experts: set[Expert]) -> float:
        """Seconds until the first of ``experts`` is back in searches (the bans are the loop's)."""
        return min(self.client.ban_left(e) for e in experts)

    def _nobody_found(self, cut: bool, timeout: float) -> str:
        """Why a search found no expert to call, from what it met (a DHT read that failed is not
        "nobody is there", and neither is a grid whose every expert is banned)."""
        where = f"no live expert under {self.searcher.prefix!r} (grid {'x'.join(map(str, self.grid_size))}): "
        outcome = self.searcher.last
        if cut:
            return where + f"the search did not finish within {max(0.0, timeout):.1f} s (forward_timeout)"
        if outcome.left_out:
            latest = self.client.stats.reasons[-1:] or ["none recorded"]
            back = self.client.blocking(self._first_back, outcome.left_out)
            return where + (f"the {len(outcome.left_out)} experts it found are all left out after failed calls "
                            f"(the first is back in searches in {back:.1f} s; the latest failure: {latest[0]})")
        if outcome.unread:
            return where + (f"the DHT read of {outcome.unread} prefixes failed or ran past read_timeout "
                            f"{self.searcher.read_timeout:g} s")
        return where + "no server declares one"


def _plan(beams: list[list[Beam]], max_rows: int) -> list[_Job]:
    """One job per chosen expert and up to ``max_rows`` of its samples: the samples routed to it and
    their slots (a pure function; a larger batch, an evaluation's say, is several jobs)."""
    routed: dict[Expert, tuple[list[int], list[int]]] = {}
    for i, sample in enumerate(beams):
        for j, beam in enumerate(sample):
            expert = beam.experts[0]
            rows, slots = routed.setdefault(expert, ([], []))
            rows.append(i)
            slots.append(j)
    return [_Job(e, torch.tensor(rows[at:at + max_rows]), torch.tensor(slots[at:at + max_rows]))
            for e, (rows, slots) in routed.items() for at in range(0, len(rows), max_rows)]


def _exchanges(jobs: list[_Job], max_rows: int) -> list[list[_Job]]:
    """The jobs in exchanges of one server each, of up to ``max_rows`` rows (a pure function)."""
    out: list[list[_Job]] = []
    by_server: dict[object, list[_Job]] = {}
    for job in jobs:
        by_server.setdefault(job.expert.peer_id, []).append(job)
    for group in by_server.values():
        current: list[_Job] = []
        rows = 0
        for job in group:
            if current and rows + len(job.rows) > max_rows:
                out.append(current)
                current, rows = [], 0
            current.append(job)
            rows += len(job.rows)
        out.append(current)
    return out


__all__ = ["CallReport", "MoEConfig", "RemoteMixtureOfExperts"]
