"""Large-batch training over the swarm: :class:`CollaborativeOptimizer` wraps any torch optimizer.

hivemind's ``Optimizer`` under the same idea, kept thin: the network layer
(:class:`nat.Peer`) and the averaging layer (:class:`averaging.Averager`) do
the hard work. One training step of the swarm, seen from one peer:

1. after every local backward pass the caller hands over the batch's sample
   count; the gradients (means over the batch) are added to an accumulator
   weighted by it, so the accumulator holds the *sum* of per-sample gradients
   (a batch with NaN/Inf gradients is dropped, and said so);
2. the peer's progress (step, samples) goes to the DHT, and the swarm's comes
   back (:mod:`training.progress`); the step happens once the swarm's samples
   toward it reach ``target_batch_size``;
3. every peer at that step averages ``accumulator / samples`` with weight
   ``samples`` in one group (its match key carries the step number, so peers
   at different steps never meet; a group of every peer at the step forms at
   once): the result is the mean gradient over the whole global batch, the
   gradient of ordinary large-batch training;
4. every peer applies it with the wrapped optimizer (and scheduler), one
   identical step, and moves to the next step number.

What to do after each batch (wait, average this step, join a round the
others began, catch up, take the state of peers ahead) is decided by the pure
step policy (:mod:`training.policy`), from this peer's state, the swarm's
progress and the time; this class is the shell that reads the progress,
performs the action, and holds the torch state. The gradients are summed by
:class:`training.accumulator.GradientAccumulator` (torch only).

Mixed precision: the caller keeps ``torch.amp.autocast`` and a
``torch.amp.GradScaler`` for its backward pass (``scaler.scale(loss).backward()``)
and hands the scaler to :meth:`CollaborativeOptimizer.open`; the accumulator
unscales each batch and keeps the scale as ``GradScaler`` would.

A peer alone in its run steps on its own gradient. A peer whose group did not
form steps on its own gradient too, and the report says so (``averaged=False``).

An auxiliary peer (``AveragerConfig(auxiliary=True)``: a machine without a GPU,
or a well-connected one) trains nothing: it calls :meth:`CollaborativeOptimizer.assist`
in a loop, follows the swarm's step and joins each step's round with weight 0,
reducing a part of the gradients (DeDLOC's c_i = 0). Its parameters are not
kept current; it serves no state.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import trio
from libp2p.peer.id import ID

from averaging import (AllreduceConfig, Averager, AveragerConfig, Group, MatchmakingConfig, MatchmakingError,
                       RoundReport)
from nat import Swarm

from p2p.errors import ConfigError
from p2p.hooks import Registration
from . import policy
from .accumulator import GradientAccumulator
from .policy import AverageStep, CatchUp, JoinBegunRound, Rules, TakeStateFromAhead, Trainer, Wait
from .progress import GlobalProgress, ProgressTracker
from .state import (MAX_UPLOADS, StateDownloadError, StateServer, TrainingState, download_state, load_state,
                    snapshot_of)

log = logging.getLogger(__name__)

#: batches whose losses make the loss a peer publishes
LOSS_WINDOW = 32
#: seconds a peer that stops gives its report that it left (a shielded wait: stopping is not held up long)
LEAVE_TIMEOUT = 5.0


@dataclass(frozen=True)
class TrainingConfig:
    """One run's settings; every peer of the run uses the same ``run_id``, ``target_batch_size``
    and ``allreduce`` settings."""

    run_id: str
    #: samples the whole swarm processes per optimizer step (the global batch)
    target_batch_size: int
    #: group formation for a step's gradients: a group of every peer at the step forms at once;
    #: ``gather_time`` is how long a leader waits for peers it has not heard of yet
    matchmaking: MatchmakingConfig = field(default_factory=lambda: MatchmakingConfig(
        target_size=256, min_size=2, gather_time=3.0, timeout=30.0))
    allreduce: AllreduceConfig = field(default_factory=AllreduceConfig)
    #: the rest of the averager's settings (roles, bandwidth, load balancing); its prefix and
    #: matchmaking/allreduce are replaced by the ones above
    averager: AveragerConfig = field(default_factory=AveragerConfig)
    #: seconds between progress reports (and reads of the swarm's)
    report_interval: float = 0.5
    #: while this peer's samples already count in full toward its step (a whole target's) and
    #: only the others' can complete it, ``step()`` reads (and reports) at most this often, the
    #: report loop besides: a peer of the CPU bench, its batches 4 ms, read and reported after
    #: each one, 1,021 times while the other started 15 s late; a replica takes 1,000 stores a
    #: minute from one peer (``LocalStore.max_stores_per_origin``). Never longer than
    #: ``report_interval``.
    reread_interval: float = 0.1
    #: a peer's progress outlives its last report by this much
    progress_expiration: float = 60.0
    #: clip the averaged gradient to this global norm before the step (None: no clipping)
    max_grad_norm: float | None = None
    #: rounds run again when one lost a reducer (its part of the gradient was averaged nowhere)
    retries: int = 2
    #: seconds before another state download after one failed
    download_retry: float = 5.0
    #: peers this one sends its state to at once; more are refused "busy" and ask the next peer
    #: (peers that join together all ask the freshest one first)
    max_state_uploads: int = MAX_UPLOADS
    #: delayed parameter updates (DeDLOC 3.2): a step's round runs in the background while the
    #: peer computes the next step's gradients, and its average is applied when the next step
    #: begins, so every gradient is exactly one step stale. The caller must compute in a worker
    #: thread (``trio.to_thread.run_sync``) for the round to overlap its compute.
    delay_updates: bool = False
    #: peers that stepped alone before they saw each other (they started together; the DHT was
    #: still forming) end at different steps, and the quorum rule leaves the one behind waiting
    #: for a quorum that never comes. Once it has the samples but not the quorum for this long,
    #: it takes the state of the peer furthest ahead (the most training done). Shorter waits are
    #: the normal moment after a round, when its members reach the next step a little apart. A
    #: peer that never took a step does not wait.
    rejoin_after: float = 10.0
    #: every this many global steps (0: never), right after the step, the peers average their
    #: parameters and the optimizer's floating-point statistics (momentum, Adam's moments) too:
    #: identical steps keep them equal in principle, and this pulls back whatever drifted (a
    #: partial round, a state taken from a peer that then missed a step). hivemind's
    #: ``average_state_every``.
    average_state_every: int = 0
    #: the archives (``dedloc backbone``: the run's checkpoints) this peer trusts: when every live
    #: peer is more than a step behind one, it takes the state there (``training/progress.py``).
    #: Trusted by name, as any of them could serve a state nobody trained: the run's own backbones.
    trusted_archives: tuple[ID, ...] = ()

    def validate(self) -> None:
        if not self.run_id or len(self.run_id) > 100:
            raise ConfigError("run_id must be 1..100 characters")
        if self.target_batch_size <= 0:
            raise ConfigError("target_batch_size must be positive")
        if not (self.report_interval > 0 and self.progress_expiration > self.report_interval):
            raise ConfigError("report_interval must be > 0 and below progress_expiration")
        if not self.reread_interval >= 0:
            raise ConfigError(f"reread_interval must be >= 0, got {self.reread_interval}")
        if self.retries < 0 or self.download_retry <= 0 or self.rejoin_after <= 0 or self.average_state_every < 0:
            raise ConfigError("retries and average_state_every must be >= 0, download_retry and rejoin_after > 0")
        if self.max_state_uploads < 1:
            raise ConfigError(f"max_state_uploads must be >= 1, got {self.max_state_uploads}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ConfigError("max_grad_norm must be a positive number")
        self.averager_config().validate()

    def rules(self) -> Rules:
        """The settings the step policy reads (:mod:`training.policy`)."""
        return Rules(delay_updates=self.delay_updates, rejoin_after=self.rejoin_after,
                     reread_interval=min(self.reread_interval, self.report_interval))

    def averager_config(self) -> AveragerConfig:
        return replace(self.averager, prefix=f"{self.run_id}.grads", matchmaking=self.matchmaking,
                       allreduce=self.allreduce)


@dataclass(frozen=True)
class StepReport:
    """One global step as this peer applied it."""

    #: the step applied (the peer now accumulates for ``step + 1``)
    step: int
    #: samples of the global batch as this peer's view of the progress showed them (0 when, with
    #: delayed updates, it joined a round the others had begun), and this peer's part
    samples: int
    local_samples: int
    #: members of the averaging group (1: this peer alone)
    group_size: int
    #: False: no group formed, the local gradient alone was applied
    averaged: bool
    #: False: some member's gradients are missing from the average (``summary`` says which)
    complete: bool
    summary: str
    #: seconds from the step's trigger to the optimizer step done
    elapsed: float = 0.0
    #: the swarm had left the step when we came to its round: nothing applied, we catch up
    missed: bool = False
    #: no other peer was in the run: the local gradient, as expected (no failure to report)
    solo: bool = False


class CollaborativeOptimizer:
    """A torch optimizer whose steps are the swarm's. Open it with :meth:`open`; call :meth:`step`
    after every backward pass."""

    def __init__(self, peer: Swarm, optimizer: torch.optim.Optimizer, config: TrainingConfig, averager: Averager,
                 scheduler: Any = None, scaler: torch.amp.GradScaler | None = None,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.peer = peer
        self.optimizer = optimizer
        self.config = config
        self.averager = averager
        self.scheduler = scheduler
        #: the policy's clock (rejoin waits, download back-off), the samples/s rate's and the reports'
        #: elapsed times: trio's by default (monotonic; under ``trio.testing.MockClock`` a test's own)
        self.clock = clock
        self.rules = config.rules()
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.accumulator = GradientAccumulator(self.params, scaler)
        #: the global step this peer accumulates for
        self.local_step = 0
        #: rounds that averaged the parameters and optimizer statistics (``average_state_every``)
        self.state_rounds = 0
        self.auxiliary = config.averager.auxiliary
        #: (its ``client`` and ``sender`` are set before each report: reachability is learned after start)
        self.tracker = ProgressTracker(peer, config.run_id, config.target_batch_size,
                                       expiration=config.progress_expiration, auxiliary=self.auxiliary,
                                       trusted=config.trusted_archives)
        #: the last step an auxiliary peer helped average (or tried to)
        self._assisted = -1
        self._reported_samples = 0  # what the last published report said
        self._read_at = -math.inf  # when the swarm's progress was last read (our clock)
        #: the samples this peer brought to the round of ``local_step - 1`` (published with each report,
        #: so that the count it stepped with is read even when the step went by between two reads)
        self._brought = 0
        self._since = clock()  # when this step's accumulation began
        self._rate = 0.0
        #: (loss, samples) of the recent batches whose caller gave a loss
        self._losses: deque[tuple[float, int]] = deque(maxlen=LOSS_WINDOW)
        self._nursery: trio.Nursery | None = None
        #: states downloaded, and when the next attempt may be made after a failed one
        self.downloads = 0
        #: seconds the last state download took, and from which peer
        self.last_download: tuple[float, str] | None = None
        self._next_download = 0.0
        #: when a round of ours missed the swarm's step (our clock): the next call takes the swarm's
        #: state, unless the miss turns out moot (:func:`training.policy.missed_moot`)
        self._missed_at: float | None = None
        #: since when we have had the samples but not the quorum, while a peer is ahead of us
        self._stuck_since: float | None = None
        #: whether this peer took a step or a state yet (a fresh one follows a lone peer at once)
        self._fresh = True
        #: with delayed updates: the step whose round runs in the background, its gradients (averaged
        #: in place), the event set when the round ended, and its report once there
        self._pending: tuple[int, list[torch.Tensor], trio.Event, list[StepReport]] | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, peer: Swarm, optimizer: torch.optim.Optimizer, config: TrainingConfig, *,
                   scheduler: Any = None, scaler: torch.amp.GradScaler | None = None
                   ) -> AsyncIterator[CollaborativeOptimizer]:
        """Join the run for the duration of the block (progress reports run in the background), and
        leave it at the block's end, however it ends: the last report says so (``ProgressTracker.leave``).

        ``scheduler`` is stepped once per global step; ``scaler``: the ``torch.amp.GradScaler``
        the caller scales its losses with (see the module docstring)."""
        config.validate()
        async with Averager.open(peer, config.averager_config()) as averager, trio.open_nursery() as nursery:
            opt = cls(peer, optimizer, config, averager, scheduler, scaler)
            opt._nursery = nursery
            # an auxiliary peer's parameters are not current: it serves no state and needs none
            serving = (StateServer(peer, config.run_id, opt._snapshot,
                                   max_uploads=config.max_state_uploads).install() if not opt.auxiliary
                       else Registration(lambda: None))
            try:
                progress = await opt._sync()
                if opt.auxiliary:  # it helps from the next round on, not with rounds gone by
                    opt.local_step, opt._assisted = progress.step, progress.step - 1
                elif progress.step > opt.local_step:  # a late joiner: start from the swarm's state
                    await opt._catch_up(progress)
                nursery.start_soon(opt._report_loop)
                yield opt
                await opt.finish()
            finally:
                serving.remove()
                nursery.cancel_scope.cancel()  # the reports stop: none may follow our last word
                # however the block ends (a SIGTERM cancels it), the others stop counting us now, not
                # when our last report expires (training/progress.py)
                with trio.CancelScope(shield=True), trio.move_on_after(LEAVE_TIMEOUT):
                    await opt.tracker.leave(step=opt.local_step, timeout=LEAVE_TIMEOUT)

    # ------------------------------------------------------------------ progress

    @property
    def progress(self) -> GlobalProgress | None:
        """The swarm's progress as last read (None before the first read)."""
        return self.tracker.last

    async def _sync(self) -> GlobalProgress:
        """Publish our progress and read the swarm's, now."""
        reported = self.samples
        role, reachable = self.averager.role()  # reachability is learned after start
        self.tracker.client, self.tracker.sender = not reachable, not role.reduces
        await self.tracker.report(self.local_step, reported, self._rate, loss=self.loss, previous=self._brought)
        self._reported_samples = reported
        # an auxiliary peer follows the step and holds none of its own: it reads the run as an observer
        # does, and a run its trainers left is at the step they left it (its --max-steps is reached)
        progress = await self.tracker.fetch(local_step=None if self.auxiliary else self.local_step)
        self._read_at = self.clock()
        return progress

    async def _report_loop(self) -> None:
        while True:
            await self._sync()
            await trio.sleep(self.config.report_interval)

    # ------------------------------------------------------------------ the caller's step

    @property
    def loss(self) -> float | None:
        """The mean loss of this peer's recent batches (as the caller gave them; None without any)."""
        n = sum(k for _, k in self._losses)
        return sum(x * k for x, k in self._losses) / n if n else None

    async def step(self, batch_size: int, loss: float | None = None) -> StepReport | None:
        """Account one local backward pass of ``batch_size`` samples (its gradients are in the
        parameters' ``.grad``, means over the batch); returns the report of a global step when one
        happened (the parameters moved), else None. Gradients are taken and zeroed either way.
        ``loss``, where given, is published with the progress (the swarm's learning curve)."""
        if self.auxiliary:
            raise RuntimeError("an auxiliary peer trains nothing: call assist(), not step()")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, not {batch_size}")
        if loss is not None and math.isfinite(loss):
            self._losses.append((float(loss), batch_size))
        if self.accumulator.add(batch_size):
            elapsed = self.clock() - self._since
            self._rate = self.samples / elapsed if elapsed > 0 else 0.0
        progress = self.tracker.last
        if progress is None or policy.needs_read(self._trainer(), progress, self.clock() - self._read_at, self.rules):
            progress = await self._sync()
        decision = policy.decide(self._trainer(), progress, self.tracker.reports, self.clock(), self.rules)
        self._stuck_since = decision.stuck_since
        if self._missed_at is not None and decision.missed_at is None:
            log.warning("step %d: the round we missed is moot: for %.0f s nobody that could serve a state "
                        "past it said it holds one; going on at this step", self.local_step,
                        self.clock() - self._missed_at)
        self._missed_at = decision.missed_at
        return await self._perform(decision.action)

    async def _perform(self, action: policy.Action) -> StepReport | None:
        """Do what the policy decided; the report of a global step if one happened."""
        if isinstance(action, Wait):
            return None
        if isinstance(action, JoinBegunRound):
            return await self._global_step(action.progress, action.expected)
        if isinstance(action, CatchUp):
            return await self._catch_up_and_join(action.progress)
        if isinstance(action, TakeStateFromAhead):
            log.warning("this peer is at step %d and has no quorum there; %d peer(s) are at step %d "
                        "(they stepped without us, before we saw each other): taking their state",
                        action.behind, len(action.progress.sources), action.progress.step)
            await self._catch_up(action.progress)
            return None
        report = await self._global_step(action.progress, action.expected)
        if report is not None and report.missed and action.catch_up_if_missed:
            # take the swarm's state now: a batch computed first would be dropped with the
            # step, and would make us later still for the next round
            return await self._catch_up_and_join(await self._sync()) or report
        return report

    def _trainer(self) -> Trainer:
        """Our state as the step policy reads it."""
        return Trainer(me=self.peer.peer_id, step=self.local_step, samples=self.samples,
                       reported_samples=self._reported_samples, fresh=self._fresh,
                       missed_at=self._missed_at, pending=self._pending is not None,
                       stuck_since=self._stuck_since, next_download=self._next_download,
                       reduces=self.averager.role()[0].reduces)

    @property
    def samples_per_second(self) -> float:
        """This peer's rate over the step under way (what it publishes)."""
        return self._rate

    @property
    def samples(self) -> int:
        """Our samples toward ``local_step``."""
        return self.accumulator.samples

    @property
    def dropped_batches(self) -> int:
        """Batches refused for NaN/Inf gradients."""
        return self.accumulator.dropped_batches

    @property
    def overflows(self) -> int:
        """Batches dropped because their scaled gradients overflowed (the scale backed off)."""
        return self.accumulator.overflows

    async def _catch_up_and_join(self, progress: GlobalProgress) -> StepReport | None:
        """Take the swarm's state; if the round of the step it brings us to is already gathering,
        join it at once, with none of our samples (:func:`training.policy.join_after_catch_up`)."""
        if not await self._catch_up(progress):
            return None
        now = self.tracker.last
        assert now is not None  # _catch_up read the swarm's progress again
        join = policy.join_after_catch_up(self._trainer(), now, self.tracker.reports, self.rules)
        if join is None:
            return None
        return await self._global_step(join.progress, join.expected)

    # ------------------------------------------------------------------ an auxiliary peer's turn

    async def assist(self) -> StepReport | None:
        """An auxiliary peer's loop body: follow the swarm's step, and when one is due, join its
        round with weight 0 (it reduces a part; its own zeros count for nothing); the report of
        that round, else None after one progress interval. Call it in a loop."""
        if not self.auxiliary:
            raise RuntimeError("assist() is for an auxiliary peer (AveragerConfig(auxiliary=True))")
        progress = await self._sync()
        due = policy.assist_due(progress, self._assisted, self.rules)
        self.local_step = progress.step
        if due is None:
            await trio.sleep(self.config.report_interval)
            return None
        self._assisted = due
        started = self.clock()
        # zeros of the trainers' schema (their accumulator's mean has the parameters' dtypes; the match
        # key holds the dtypes: float32 zeros never met the trainers of a float64 or bfloat16 model)
        work = [torch.zeros(p.shape, dtype=p.dtype) for p in self.params]
        expected = max(2, policy.expected_group(due, progress, self.tracker.reports, self.peer.peer_id, self.rules))
        try:
            report = await self._round(work, 0, f"grads:{due}:0", expected, due)
        except MatchmakingError as e:
            return StepReport(due, progress.samples, 0, 1, False, True, f"no group to help ({e})",
                              self.clock() - started)
        if report is None:
            return StepReport(due, progress.samples, 0, 0, False, True, "the swarm left the step before we found "
                              "its group", self.clock() - started, missed=True)
        return StepReport(due, progress.samples, 0, len(report.members), True, report.complete, report.summary(),
                          self.clock() - started)

    # ------------------------------------------------------------------ the swarm's step

    async def _global_step(self, progress: GlobalProgress, expected: int) -> StepReport | None:
        """Step ``self.local_step`` of the swarm with ``expected`` peers: average, then apply (or,
        with delayed updates, apply the previous step's average and leave this one's round to the
        background)."""
        started = self.clock()
        samples = self.samples
        grads = self.accumulator.mean()
        step = self.local_step
        if not self.config.delay_updates:
            report = await self._average(step, grads, samples, progress, expected)
            if not samples and not report.averaged and not report.missed:
                # nothing of ours to apply alone: zeros would move the parameters apart from the swarm's
                report = replace(report, missed=True, summary=f"no samples of ours and no group ({report.summary})")
            if report.missed:  # the others stepped without us: the next call downloads their state
                log.warning("step %d: %s", step, report.summary)
                self._missed_at = self.clock()
                return report
            self._apply(grads)
            self._next_step(samples)
            await self._sync()  # tell the swarm at once: we left the step
            if report.averaged:
                await self._average_state(report.group_size)
            return replace(report, elapsed=self.clock() - started)
        applied = await self._apply_pending()  # step - 1's, averaged while we computed this one's
        if applied is not None and applied.averaged:  # step - 1's update is in: the state is step's
            await self._average_state(applied.group_size)
        self._next_step(samples)
        assert self._nursery is not None
        done = trio.Event()
        self._pending = (step, grads, done, [])
        self._nursery.start_soon(self._average_into, step, grads, samples, progress, expected, started, done)
        await self._sync()
        return applied

    async def _average_state(self, expected: int) -> None:
        """Every ``average_state_every`` steps: average parameters and optimizer statistics at
        ``local_step`` with the peers that took the same step (those of its round: ``expected``).
        Best effort: a group that does not form leaves the state as it is."""
        every = self.config.average_state_every
        step = self.local_step
        if not every or step % every or expected < 2:
            return
        stats = [v for state in self.optimizer.state.values() for v in state.values()
                 if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]
        tensors = [p.data for p in self.params] + stats
        work = [t.detach().to(device="cpu", dtype=torch.float32, copy=True) for t in tensors]
        try:
            report = await self._round(work, 1, f"state:{step}", expected, step)
        except MatchmakingError as e:
            log.info("state averaging at step %d: no group (%s); the state stays as it is", step, e)
            return
        if report is None:
            return
        with torch.no_grad():
            for t, w in zip(tensors, work):
                t.copy_(w)  # back to the tensor's own dtype
        self.state_rounds += 1

    def _next_step(self, brought: int) -> None:
        """On to the next step, having brought ``brought`` samples to this one's round (0: none of ours)."""
        self._fresh = False
        self._brought = brought
        self.local_step += 1
        self.accumulator.zero()  # (a report follows at once: it sets _reported_samples)
        self._since = self.clock()

    async def _average(self, step: int, grads: list[torch.Tensor], samples: int,
                       progress: GlobalProgress, expected: int) -> StepReport:
        """Average ``grads`` (in place) with the peers at ``step``; the report (elapsed left 0).

        A round that lost a reducer leaves its part un-averaged on every member (each keeps its own
        values there), and the members would step apart: they all see it, and average again among
        themselves (``retries`` times). A sender lost mid-round costs only its own contribution.
        A peer that comes to a step's round after the others left it (they report the next step)
        stops looking and says so (``missed``): it must catch up, not step alone.
        """
        if progress.peers <= 1:
            return StepReport(step, progress.samples, samples, 1, False, True, "alone: the local gradient", solo=True)
        for attempt in range(1 + self.config.retries):
            try:
                # grads take the average only from a round that lost no part: otherwise they stay
                # as they were, for the next attempt (no copy of them is needed, on a GPU or not)
                report = await self._round(grads, samples, f"grads:{step}:{attempt}", expected, step)
            except MatchmakingError as e:
                if policy.missed_without_group(step, self.tracker.reports, self.peer.peer_id):
                    # the others took the step in a group we did not find: our own gradient alone
                    # would set us apart from them for good; take their state instead
                    return StepReport(step, progress.samples, samples, 0, False, False,
                                      f"missed: the swarm took this step in a group we did not find ({e})",
                                      missed=True)
                summary = f"no group: the local gradient of {samples} samples alone ({e})"
                return StepReport(step, progress.samples, samples, 1, False, True, summary)
            if report is None:
                return StepReport(step, progress.samples, samples, 0, False, False,
                                  "missed: the swarm left this step before we found its group", missed=True)
            summary = report.summary()
            lost = [p for p in report.parts if p.not_averaged]
            if not lost:
                if len(report.members) < progress.peers_at_step:
                    summary += f" ({progress.peers_at_step} peers were at this step)"
                return StepReport(step, progress.samples, samples, len(report.members), True, report.complete,
                                  summary)
            expected = max(1, len(report.members) - len({p.reducer for p in lost}))
            summary = f"attempt {attempt + 1}: {summary}"
            log.warning("step %d: %s; averaging again among the rest", step, summary)
        return StepReport(step, progress.samples, samples, 1, False, False, f"{summary}; the local gradient alone")

    async def _round(self, work: list[torch.Tensor], samples: int, purpose: str, expected: int,
                     step: int) -> RoundReport | None:
        """One averaging round, or None if the swarm left ``step`` while we looked for its group.

        Only the search is watched: a round under way always ends by itself (a member that
        finished first already reports the next step while the others still take its average).
        """
        found: list[Group] = []
        failed: list[MatchmakingError] = []
        async with trio.open_nursery() as nursery:

            async def search() -> None:
                try:
                    found.append(await self.averager.matchmake(work, float(samples), purpose=purpose,
                                                               expected=expected))
                except MatchmakingError as e:  # raised below, not wrapped in the nursery's group
                    failed.append(e)
                nursery.cancel_scope.cancel()

            async def watch() -> None:
                while True:
                    await trio.sleep(self.config.report_interval)
                    if policy.left_behind(step, self.tracker.reports, self.peer.peer_id,
                                          self.averager.role()[0].reduces, self.rules):
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(search)
            nursery.start_soon(watch)
        if failed:
            raise failed[0]
        if not found:
            return None
        return await self.averager.average_in(found[0], work, float(samples), strict=False, accept=_no_part_lost)

    async def _average_into(self, step: int, grads: list[torch.Tensor], samples: int, progress: GlobalProgress,
                            expected: int, started: float, done: trio.Event) -> None:
        """The background half of a delayed step: its round; :meth:`_apply_pending` applies it."""
        assert self._pending is not None
        try:
            report = await self._average(step, grads, samples, progress, expected)
            self._pending[3].append(replace(report, elapsed=self.clock() - started))
        finally:
            done.set()

    async def _apply_pending(self) -> StepReport | None:
        """Wait for the delayed step's round (if any) and apply its average; its report."""
        if self._pending is None:
            return None
        step, grads, done, reports = self._pending
        await done.wait()
        self._pending = None
        if reports and reports[0].missed:
            # the others applied step `step` without us: our parameters lack it; take theirs
            log.warning("step %d: %s", step, reports[0].summary)
            self._missed_at = self.clock()
            return reports[0]
        self._apply(grads)
        return reports[0] if reports else None

    # ------------------------------------------------------------------ state

    async def _snapshot(self) -> TrainingState:
        """What we serve: a copy at our step (a delayed step's average travels along, not applied)."""
        if self._pending is None:
            return snapshot_of(self.local_step, self.params, self.optimizer, self.scheduler, None)
        pending = self._pending
        _, grads, done, _ = pending
        with trio.move_on_after(60):
            await done.wait()
        if self._pending is not pending:  # applied meanwhile (a step began): take the state as it is now
            return await self._snapshot()
        if done.is_set():
            return snapshot_of(self.local_step, self.params, self.optimizer, self.scheduler, grads)
        # the round never ended: the state is one update short of our step
        return snapshot_of(self.local_step - 1, self.params, self.optimizer, self.scheduler, None)

    async def _catch_up(self, progress: GlobalProgress) -> bool:
        """Download the swarm's state (we are behind it, or new); whether we have it now."""
        now = self.clock()
        if now < self._next_download:
            return False
        sources = [p for p in progress.sources if p != self.peer.peer_id]
        for report in (*self.tracker.reports, *self.tracker.archives):  # where to reach them: their reports say
            if report.peer_id in progress.sources and report.addrs:
                self.peer.add_addrs(report.peer_id, list(report.addrs))
        wanted = policy.state_wanted(self._trainer(), progress, self.rules)
        began = self.clock()
        try:
            state = await download_state(self.peer, self.config.run_id, sources, wanted, self.params)
            load_state(state, self.params, self.optimizer, self.scheduler)
        except (StateDownloadError, ValueError) as e:
            self._next_download = now + self.config.download_retry
            log.warning("this peer is at step %d and the swarm at %d, and no state could be had: %s",
                        self.local_step, progress.step, e)
            return False
        if state.pending is not None:
            self._apply(state.pending)  # the delayed step the others apply when their next one begins
        dropped = self.samples
        self._pending = None
        self._missed_at = None
        self._stuck_since = None
        self.local_step = state.step - 1
        self._next_step(0)  # (no longer fresh)  # the samples of an old step are dropped, not brought to a round
        self.downloads += 1
        self.last_download = (self.clock() - began, state.source)
        log.info("caught up: downloaded the state at step %d%s", state.step,
                 f" ({dropped} samples of an old step dropped)" if dropped else "")
        await self._sync()
        return True

    async def finish(self) -> StepReport | None:
        """Apply a delayed step still pending (the block's end does it too, unless it raised)."""
        return await self._apply_pending()

    def _apply(self, grads: Sequence[torch.Tensor]) -> None:
        """One optimizer step on ``grads``, the same on every member of the group."""
        for p, g in zip(self.params, grads):
            p.grad = g.to(device=p.device, dtype=p.dtype)
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        for p in self.params:
            p.grad = None


def _no_part_lost(report: RoundReport) -> bool:
    """A round whose every part came back (a sender left out costs only its own contribution)."""
    return not any(p.not_averaged for p in report.parts)


__all__ = ["CollaborativeOptimizer", "StepReport", "TrainingConfig"]
