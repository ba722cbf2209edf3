"""training.optimizer, the shell of collaborative training, piece by piece under trio's autojump clock.

The swarm is the in-memory one (tests/fake_swarm.py): the other peers are only their progress
reports, published by the test, and the averager is a script (:class:`Script`) that finds the
groups the test gives it, writes their average into the work and returns their reports; state
downloads are real (tests/fake_swarm.py's streams) or a recorder where the test says what a source
gives. What is checked is the optimizer's side: which rounds it asks for (purpose, weight,
expected size, the tensors), what it applies, what it reports to the word, what it publishes, and
when it takes a state. The same steps between real averagers are tests/test_training.py's (real
sockets) and tests/test_fake_swarm.py's.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from libp2p.peer.id import ID

from averaging import AllreduceConfig, AveragerConfig, MatchmakingConfig
from averaging.allreduce import PartOutcome, RoundReport
from averaging.errors import MatchmakingError
from averaging.group import Role
from p2p.errors import ConfigError
from training import optimizer as optimizer_module
from training.optimizer import CollaborativeOptimizer, StepReport, TrainingConfig, _no_part_lost
from averaging.partition import Schema
from training.accumulator import GradientAccumulator
from training.policy import Rules, Trainer
from training.progress import GlobalProgress, LocalProgress, ProgressTracker
from training.state import STATE_PROTOCOL, StateDownloadError, TrainingState

from .fake_swarm import FakeSwarm, fake_swarms
from .kit import log_lines

RUN = "run"
TARGET = 8
LOG = "training.optimizer"


def config(**overrides: Any) -> TrainingConfig:
    overrides.setdefault("matchmaking", MatchmakingConfig(target_size=8, min_size=2, gather_time=1.0, timeout=5.0))
    overrides.setdefault("target_batch_size", TARGET)
    return TrainingConfig(run_id=RUN, **overrides)


def linear() -> torch.nn.Linear:
    """Three parameters: a weight of two ones and a bias of zero."""
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.0)
    return model


def values(model: torch.nn.Module) -> list[float]:
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def backward(model: torch.nn.Module, g: float) -> None:
    """A batch whose mean gradient is ``g`` everywhere."""
    for p in model.parameters():
        p.grad = torch.full_like(p, g)


# ---------------------------------------------------------------------------- the scripted averager

HANG = "hang"


@dataclass
class Found:
    """A group the script's matchmake finds after ``took`` s: average_in writes ``average`` into the
    work when ``accept`` takes the report (as the averager does), and returns ``report``."""

    report: RoundReport
    average: float | None = None
    took: float = 0.0


@dataclass
class Call:
    purpose: str
    weight: float
    expected: int | None
    work: list[torch.Tensor]
    strict: bool | None = None
    accept: Any = None
    weight_in: float | None = None


Outcome = Found | MatchmakingError | str | Callable[[], Awaitable[Any]]


class Script:
    """The averager as the optimizer calls it: each matchmake takes the next outcome (a callable is
    awaited first and its result taken; HANG looks forever)."""

    def __init__(self, *outcomes: Outcome, role: Role = Role.FULL, reachable: bool = True) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[Call] = []
        self._role = role
        self.reachable = reachable
        self.config: AveragerConfig | None = None

    def role(self) -> tuple[Role, bool]:
        return self._role, self.reachable

    async def matchmake(self, tensors: Sequence[torch.Tensor], weight: float = 1.0, *, purpose: str = "",
                        expected: int | None = None) -> Found:
        self.calls.append(Call(purpose, weight, expected, [t.clone() for t in tensors]))
        outcome: Any = self.outcomes.pop(0) if self.outcomes else HANG
        if callable(outcome):
            outcome = await outcome()
        if isinstance(outcome, MatchmakingError):
            raise outcome
        if outcome == HANG:
            await trio.sleep_forever()
        assert isinstance(outcome, Found)
        await trio.sleep(outcome.took)
        return outcome

    async def average_in(self, group: Found, tensors: Sequence[torch.Tensor], weight: float = 1.0, *,
                         strict: bool = True, phase: int = 0, accept: Any = None) -> RoundReport:
        call = self.calls[-1]
        call.strict, call.accept, call.weight_in = strict, accept, weight
        if group.average is not None and (accept is None or accept(group.report)):
            for t in tensors:
                t.fill_(group.average)
        return group.report


def ids(n: int) -> list[ID]:
    return [ID(bytes([0, 4, 1, 2, 3, i])) for i in range(n)]


def round_report(members: int, lost: Sequence[int] = (), reducers: Sequence[int] | None = None) -> RoundReport:
    """A round of ``members`` with one part each (reduced by ``reducers[i]``, default member i); the
    parts in ``lost`` came back not averaged."""
    who = ids(members)
    reducers = list(range(members)) if reducers is None else list(reducers)
    parts = [PartOutcome(i, who[r], 3, 1, averaged_chunks=0 if i in lost else 1, returned_chunks=1,
                         not_averaged="its reducer left" if i in lost else "") for i, r in enumerate(reducers)]
    return RoundReport(b"g", who, 0, tuple(1 / members for _ in range(members)), parts)


def complete(members: int) -> str:
    return f"group of {members}: every part averaged over every sender"


@dataclass
class Harness:
    opt: CollaborativeOptimizer
    model: torch.nn.Linear
    peers: list[FakeSwarm]
    script: Script
    downloads: list[tuple[list[ID], int]] = field(default_factory=list)

    @property
    def me(self) -> FakeSwarm:
        return self.peers[0]


def patch_averager(monkeypatch: pytest.MonkeyPatch, script: Script) -> None:
    """Every optimizer opened in this test gets ``script`` for its averager."""

    @asynccontextmanager
    async def open_averager(peer: FakeSwarm, averager_config: AveragerConfig) -> AsyncIterator[Script]:
        script.config = averager_config
        yield script

    monkeypatch.setattr(optimizer_module, "Averager", SimpleNamespace(open=open_averager))


@dataclass(frozen=True)
class Said:
    """Peer number ``peer``'s progress report (at ``step`` with ``samples``), published before the optimizer opens."""

    peer: int
    step: int
    samples: int
    client: bool = False
    sender: bool = False
    previous: int = 0
    #: a saved state at ``step`` (a backbone's), trusted by the optimizer under test
    archive: bool = False


@asynccontextmanager
async def scripted(monkeypatch: pytest.MonkeyPatch, script: Script, n: int = 2, *,
                   said: Sequence[Said] = (),
                   state: TrainingState | StateDownloadError | None = None,
                   optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                   scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                   scaler: torch.amp.GradScaler | None = None, model: torch.nn.Linear | None = None,
                   **overrides: Any) -> AsyncIterator[Harness]:
    """An optimizer on the first of ``n`` peers with ``script`` for its averager, opened once the others
    have ``said`` their progress; with ``state``, downloads are recorded and give it (or raise it)."""

    patch_averager(monkeypatch, script)
    async with fake_swarms(n) as peers:
        await trio.sleep(5)  # the clock is well past 0: a sum where a difference belongs shows
        for r in said:
            await say(peers[r.peer], r.step, r.samples, previous=r.previous, client=r.client, sender=r.sender,
                      archive=r.archive)
        overrides.setdefault("trusted_archives", tuple(peers[r.peer].peer_id for r in said if r.archive))
        model = model or linear()
        opt_ = (optimizer or (lambda m: torch.optim.SGD(m.parameters(), lr=1.0)))(model)
        downloads: list[tuple[list[ID], int]] = []
        if state is not None:
            async def download(peer: FakeSwarm, run_id: str, sources: Sequence[ID], wanted: int,
                               params: Sequence[torch.Tensor]) -> TrainingState:
                assert peer is peers[0] and run_id == RUN and list(params) == list(model.parameters())
                downloads.append((list(sources), wanted))
                if isinstance(state, StateDownloadError):
                    raise state
                return state

            monkeypatch.setattr(optimizer_module, "download_state", download)
        async with CollaborativeOptimizer.open(peers[0], opt_, config(**overrides),
                                               scheduler=None if scheduler is None else scheduler(opt_),
                                               scaler=scaler) as opt:
            yield Harness(opt, model, peers, script, downloads)


async def say(peer: FakeSwarm, step: int, samples: int, *, rate: float = 1.0, previous: int = 0,
              **kw: Any) -> None:
    """``peer`` publishes its progress: at ``step`` with ``samples``."""
    assert await ProgressTracker(peer, RUN, TARGET, **kw).report(step, samples, rate, previous=previous)


async def leave(peer: FakeSwarm, step: int | None = None) -> None:
    """``peer`` publishes that it left the run (at ``step``)."""
    assert await ProgressTracker(peer, RUN, TARGET).leave(step=step)


async def reports(peer: FakeSwarm) -> dict[ID, LocalProgress]:
    tracker = ProgressTracker(peer, RUN, TARGET)
    await tracker.fetch()
    return {r.peer_id: r for r in tracker.reports}


def state_at(step: int, params: list[float], pending: list[float] | None = None, source: str = "them"
             ) -> TrainingState:
    sgd = torch.optim.SGD(linear().parameters(), lr=1.0)
    shaped = [torch.tensor([params[:2]]), torch.tensor(params[2:])]
    return TrainingState(step, shaped, None if pending is None else [torch.tensor([pending[:2]]),
                                                                     torch.tensor(pending[2:])],
                         sgd.state_dict(), None, source=source)


def progress(step: int, samples: int, *, peers: int = 2, at_step: int = 2, contributors: int = 2,
             sources: tuple[ID, ...] = ()) -> GlobalProgress:
    return GlobalProgress(step, samples, TARGET, at_step, peers, 1.0, contributors, 2, 0.0, sources, at_step)


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize(("overrides", "message"), [
    ({"run_id": ""}, "run_id must be 1..100 characters"),
    ({"run_id": "r" * 101}, "run_id must be 1..100 characters"),
    ({"target_batch_size": 0}, "target_batch_size must be positive"),
    ({"report_interval": 0.0}, "report_interval must be > 0 and below progress_expiration"),
    ({"report_interval": 5.0, "progress_expiration": 5.0}, "report_interval must be > 0 and below progress_expiration"),
    ({"reread_interval": -0.1}, "reread_interval must be >= 0, got -0.1"),
    ({"reread_interval": math.nan}, "reread_interval must be >= 0, got nan"),
    ({"retries": -1}, "retries and average_state_every must be >= 0, download_retry and rejoin_after > 0"),
    ({"download_retry": 0.0}, "retries and average_state_every must be >= 0, download_retry and rejoin_after > 0"),
    ({"rejoin_after": 0.0}, "retries and average_state_every must be >= 0, download_retry and rejoin_after > 0"),
    ({"average_state_every": -1}, "retries and average_state_every must be >= 0, download_retry and rejoin_after > 0"),
    ({"max_state_uploads": 0}, "max_state_uploads must be >= 1, got 0"),
    ({"max_grad_norm": 0.0}, "max_grad_norm must be a positive number"),
    ({"max_grad_norm": math.inf}, "max_grad_norm must be a positive number"),
    ({"max_grad_norm": math.nan}, "max_grad_norm must be a positive number"),
    ({"allreduce": AllreduceConfig(timeout=0.0)}, "timeouts must be positive"),
])
def test_a_setting_out_of_range_is_refused_by_name(overrides: dict[str, Any], message: str) -> None:
    fields = {"run_id": RUN, "target_batch_size": TARGET, **overrides}
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        TrainingConfig(**fields).validate()


def test_settings_at_their_edges_are_taken() -> None:
    TrainingConfig(run_id="r" * 100, target_batch_size=1, report_interval=1e-3, progress_expiration=2e-3,
                   reread_interval=0.0, retries=0, download_retry=1e-3, rejoin_after=1e-3, average_state_every=0,
                   max_state_uploads=1, max_grad_norm=1e-9).validate()


def test_the_rules_and_the_averager_s_settings_come_from_the_run_s() -> None:
    matchmaking = MatchmakingConfig(target_size=3, min_size=2)
    allreduce = AllreduceConfig(timeout=7.0)
    cfg = TrainingConfig(run_id="r1", target_batch_size=4, delay_updates=True, rejoin_after=7.0, reread_interval=0.3,
                         report_interval=0.2, matchmaking=matchmaking, allreduce=allreduce,
                         averager=AveragerConfig(prefix="ignored", auxiliary=True))
    assert cfg.rules() == Rules(delay_updates=True, rejoin_after=7.0, reread_interval=0.2)
    assert replace(cfg, reread_interval=0.1).rules().reread_interval == 0.1
    averager = cfg.averager_config()
    assert (averager.prefix, averager.matchmaking, averager.allreduce, averager.auxiliary) == (
        "r1.grads", matchmaking, allreduce, True)


def test_no_part_lost_means_every_part_came_back() -> None:
    assert _no_part_lost(round_report(3))
    assert not _no_part_lost(round_report(3, lost=[2]))


# ---------------------------------------------------------------------------- opening


async def test_a_bad_setting_fails_before_anything_opens(autojump_clock: trio.abc.Clock,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    script = Script()
    patch_averager(monkeypatch, script)
    async with fake_swarms(1) as peers:
        with pytest.raises(ConfigError, match="target_batch_size must be positive"):
            async with CollaborativeOptimizer.open(peers[0], torch.optim.SGD(linear().parameters(), lr=1.0),
                                                   config(target_batch_size=0)):
                pass  # pragma: no cover
    assert script.config is None


async def test_opening_serves_the_state_publishes_and_closing_stops_serving(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(), progress_expiration=90.0) as h:
        assert h.script.config is not None and h.script.config.prefix == f"{RUN}.grads"
        assert STATE_PROTOCOL in h.me.handlers
        mine = (await reports(h.peers[1]))[h.me.peer_id]
        assert (mine.step, mine.samples, mine.previous, mine.client, mine.sender, mine.auxiliary) == (
            0, 0, 0, False, False, False)
        assert h.opt.tracker.expiration == 90.0
        assert (h.opt._trainer().fresh, h.opt._trainer().reported_samples) == (True, 0)
        assert (h.opt.local_step, h.opt.state_rounds, h.opt.downloads, h.opt.last_download) == (0, 0, 0, None)
        assert h.opt.progress is not None and h.opt.progress.peers == 1
        assert h.opt.params == list(h.model.parameters())
    assert STATE_PROTOCOL not in h.me.handlers


async def test_only_parameters_that_train_are_averaged_and_stepped(autojump_clock: trio.abc.Clock,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(), 1) as h:
        h.model.bias.requires_grad_(False)
        opt = CollaborativeOptimizer(h.me, torch.optim.SGD(h.model.parameters(), lr=1.0), config(), h.script)  # type: ignore[arg-type]
        assert opt.params == [h.model.weight]


async def test_a_client_that_never_reduces_says_so_in_its_reports(autojump_clock: trio.abc.Clock,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(role=Role.SENDER, reachable=False)) as h:
        mine = (await reports(h.peers[1]))[h.me.peer_id]
        assert (mine.client, mine.sender) == (True, True)
        assert (h.opt.tracker.client, h.opt.tracker.sender) == (True, True)


async def test_progress_is_published_every_report_interval(autojump_clock: trio.abc.Clock,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(), report_interval=0.5) as h:
        await trio.sleep(0.1)
        before = h.me.dht.stores
        await trio.sleep(2.0)
        assert h.me.dht.stores - before == 4


# ---------------------------------------------------------------------------- the caller's batches


async def test_a_step_refuses_a_batch_of_no_samples_and_an_auxiliary_peer(autojump_clock: trio.abc.Clock,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script()) as h:
        with pytest.raises(ValueError, match="^batch_size must be positive, not 0$"):
            await h.opt.step(0)
        assert h.opt.samples == 0
        with pytest.raises(RuntimeError, match=r"^assist\(\) is for an auxiliary peer \(AveragerConfig\(auxiliary=True\)\)$"):
            await h.opt.assist()
    async with scripted(monkeypatch, Script(), averager=AveragerConfig(auxiliary=True)) as h:
        with pytest.raises(RuntimeError, match=r"^an auxiliary peer trains nothing: call assist\(\), not step\(\)$"):
            await h.opt.step(1)


async def test_the_published_loss_is_the_recent_batches_mean_weighted_by_their_samples(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(), target_batch_size=10_000) as h:
        assert h.opt.loss is None
        backward(h.model, 1.0)
        await h.opt.step(1, loss=4.0)
        backward(h.model, 1.0)
        await h.opt.step(3, loss=8.0)
        backward(h.model, 1.0)
        await h.opt.step(2, loss=math.nan)  # no loss from a batch that gave none
        backward(h.model, 1.0)
        await h.opt.step(2)
        assert h.opt.loss == 7.0
        await h.opt._sync()
        assert (await reports(h.peers[1]))[h.me.peer_id].loss == 7.0
        for _ in range(optimizer_module.LOSS_WINDOW):
            backward(h.model, 1.0)
            await h.opt.step(1, loss=1.0)
        assert h.opt.loss == 1.0  # only the last LOSS_WINDOW batches count


async def test_the_rate_is_this_step_s_samples_over_its_time_and_bad_batches_are_dropped(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(), target_batch_size=10_000) as h:
        assert h.opt.samples_per_second == 0.0
        await trio.sleep(3)
        backward(h.model, 1.0)
        await h.opt.step(6)
        assert h.opt.samples_per_second == 2.0
        await trio.sleep(3)
        backward(h.model, math.nan)
        await h.opt.step(6)
        assert (h.opt.samples, h.opt.dropped_batches, h.opt.overflows, h.opt.samples_per_second) == (6, 1, 0, 2.0)
        h.opt._since = trio.current_time()
        backward(h.model, 1.0)
        await h.opt.step(2)
        assert h.opt.samples_per_second == 0.0  # no time went by: no rate, no division by zero
        await trio.sleep(0.5)
        backward(h.model, 1.0)
        await h.opt.step(2)
        assert h.opt.samples_per_second == 20.0


async def test_the_policy_reads_the_trainer_as_it_is(autojump_clock: trio.abc.Clock,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(role=Role.SENDER)) as h:
        opt = h.opt
        assert opt._trainer() == Trainer(me=h.me.peer_id, step=0, samples=0, reported_samples=0, fresh=True,
                                         missed_at=None, pending=False, stuck_since=None, next_download=0.0,
                                         reduces=False)
        backward(h.model, 1.0)
        await opt.step(3)
        opt._reported_samples, opt._fresh, opt._missed_at, opt._stuck_since, opt._next_download = 2, False, 3.0, 4.0, 9.0
        assert opt._trainer() == Trainer(me=h.me.peer_id, step=0, samples=3, reported_samples=2, fresh=False,
                                         missed_at=3.0, pending=False, stuck_since=4.0, next_download=9.0,
                                         reduces=False)
        opt._pending = (0, [], trio.Event(), [])
        assert opt._trainer().pending
        opt._pending = None


async def test_while_our_samples_count_in_full_the_swarm_is_read_at_most_every_reread_interval(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(), report_interval=100.0, reread_interval=1.0,
                        progress_expiration=1000.0) as h:
        await say(h.peers[1], 0, 0)
        await h.opt._sync()
        backward(h.model, 1.0)
        assert await h.opt.step(TARGET) is None  # read: our samples completed the count; no quorum
        stores = h.me.dht.stores
        for _ in range(3):
            backward(h.model, 1.0)
            assert await h.opt.step(1) is None
        assert h.me.dht.stores == stores  # nothing our samples could add: no read
        await trio.sleep(0.5)
        backward(h.model, 1.0)
        await h.opt.step(1)
        assert h.me.dht.stores == stores  # not before reread_interval (1 s here)
        await trio.sleep(0.5)
        backward(h.model, 1.0)
        await h.opt.step(1)
        assert h.me.dht.stores == stores + 1


# ---------------------------------------------------------------------------- a synchronous step


async def test_a_peer_alone_steps_on_its_own_mean_gradient(autojump_clock: trio.abc.Clock,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(), 1) as h:
        backward(h.model, 1.0)
        assert await h.opt.step(4) is None
        assert h.opt.samples == 4
        backward(h.model, 3.0)
        report = await h.opt.step(4)
        assert report == StepReport(0, TARGET, TARGET, 1, False, True, "alone: the local gradient", 0.0, solo=True)
        assert values(h.model) == [-1.0, -1.0, -2.0]  # minus the mean gradient, 2
        assert all(p.grad is None for p in h.model.parameters())
        assert h.script.calls == []
        assert (h.opt.local_step, h.opt.samples, h.opt.state_rounds) == (1, 0, 0)
        mine = (await reports(h.me))[h.me.peer_id]
        assert (mine.step, mine.samples, mine.previous) == (1, 0, TARGET)  # published at once


async def test_peers_average_their_mean_gradients_weighted_by_samples_then_step(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 0, 4)]

    script = Script(Found(round_report(2), average=5.0, took=1.5))
    async with scripted(monkeypatch, script, said=said) as h:
        backward(h.model, 2.0)
        report = await h.opt.step(4)
        assert report == StepReport(0, TARGET, 4, 2, True, True, complete(2), 1.5)
        (call,) = script.calls
        assert (call.purpose, call.weight, call.expected, call.strict, call.weight_in) == ("grads:0:0", 4.0, 2, False,
                                                                                          4.0)
        assert call.accept is _no_part_lost
        assert [t.tolist() for t in call.work] == [[[2.0, 2.0]], [2.0]]
        assert values(h.model) == [-4.0, -4.0, -5.0]
        assert (h.opt.local_step, h.opt._brought, h.opt.state_rounds) == (1, 4, 0)
        mine = (await reports(h.peers[1]))[h.me.peer_id]
        assert (mine.step, mine.samples, mine.previous) == (1, 0, 4)


async def test_a_group_smaller_than_the_step_s_peers_says_how_many_were_there(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 0, 4), Said(2, 0, 4)]

    script = Script(Found(round_report(2), average=5.0))
    async with scripted(monkeypatch, script, 3, said=said) as h:
        backward(h.model, 2.0)
        report = await h.opt.step(4)
        assert report is not None
        assert report.summary == complete(2) + " (3 peers were at this step)"
        assert script.calls[0].expected == 3
        assert report.samples == 12


async def test_a_round_that_lost_a_reducer_is_run_again_among_the_rest(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    said = [Said(1, 0, 4)]

    # four members, parts 1 and 2 both reduced by member 1, who left: three go on
    lost = round_report(4, lost=[1, 2], reducers=[0, 1, 1, 3])
    script = Script(Found(lost, average=9.0), Found(round_report(3), average=5.0))
    async with scripted(monkeypatch, script, said=said) as h:
        backward(h.model, 2.0)
        with caplog.at_level(logging.WARNING, LOG):
            report = await h.opt.step(4)
        assert report == StepReport(0, TARGET, 4, 3, True, True, complete(3), 0.0)
        assert [(c.purpose, c.expected) for c in script.calls] == [("grads:0:0", 2), ("grads:0:1", 3)]
        assert [t.tolist() for t in script.calls[1].work] == [[[2.0, 2.0]], [2.0]]  # the lost round wrote nothing
        assert values(h.model) == [-4.0, -4.0, -5.0]
        assert log_lines(caplog, LOG, "step 0: attempt 1: ") == [
            f"step 0: attempt 1: {lost.summary()}; averaging again among the rest"]


async def test_rounds_that_keep_losing_reducers_leave_the_local_gradient(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 0, 4)]

    first, second = round_report(2, lost=[0, 1]), round_report(3, lost=[2])
    script = Script(Found(first, average=9.0), Found(second, average=9.0))
    async with scripted(monkeypatch, script, said=said, retries=1) as h:
        backward(h.model, 2.0)
        report = await h.opt.step(4)
        assert report == StepReport(0, TARGET, 4, 1, False, False,
                                    f"attempt 2: {second.summary()}; the local gradient alone", 0.0)
        assert [(c.purpose, c.expected) for c in script.calls] == [("grads:0:0", 2), ("grads:0:1", 1)]
        assert values(h.model) == [-1.0, -1.0, -2.0]
    async with scripted(monkeypatch, Script(Found(first, average=9.0)), said=said, retries=0) as h:
        backward(h.model, 2.0)
        report = await h.opt.step(4)
        assert report is not None and report.summary == f"attempt 1: {first.summary()}; the local gradient alone"


async def test_no_group_steps_on_the_local_gradient_and_says_why(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 0, 4)]

    script = Script(MatchmakingError("nobody came"))
    async with scripted(monkeypatch, script, said=said, average_state_every=1) as h:
        backward(h.model, 2.0)
        report = await h.opt.step(4)
        assert report == StepReport(0, TARGET, 4, 1, False, True,
                                    "no group: the local gradient of 4 samples alone (nobody came)", 0.0)
        assert values(h.model) == [-1.0, -1.0, -2.0]
        assert len(script.calls) == 1  # no state round after a step taken alone
        assert h.opt.local_step == 1


async def test_a_step_the_others_took_in_a_group_we_did_not_find_is_missed_and_repaired(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    harness: list[Harness] = []

    said = [Said(1, 0, 4), Said(2, 0, 4)]

    async def they_stepped() -> MatchmakingError:
        h = harness[0]
        await say(h.peers[1], 1, 0)
        await say(h.peers[2], 1, 0)
        await h.opt._sync()
        return MatchmakingError("nobody came")

    script = Script(they_stepped)
    failed = StateDownloadError("no peer served a usable state (none to ask)")
    async with scripted(monkeypatch, script, 3, said=said, state=failed, download_retry=7.0) as h:
        harness.append(h)
        backward(h.model, 2.0)
        with caplog.at_level(logging.WARNING, LOG):
            report = await h.opt.step(4)
        assert report == StepReport(0, 12, 4, 0, False, False,
                                    "missed: the swarm took this step in a group we did not find (nobody came)",
                                    0.0, missed=True)
        assert values(h.model) == [1.0, 1.0, 0.0]  # nothing applied
        assert h.opt._missed_at == trio.current_time()
        assert h.opt.local_step == 0
        # the state past the missed step, from the others, freshest first
        assert h.downloads == [([h.peers[2].peer_id, h.peers[1].peer_id], 1)]
        assert h.opt._next_download == trio.current_time() + 7.0
        assert log_lines(caplog, LOG, "step 0: missed") == [f"step 0: {report.summary}"]
        assert log_lines(caplog, LOG, "this peer is at step 0") == [
            "this peer is at step 0 and the swarm at 1, and no state could be had: " + str(failed)]
        missed_at = h.opt._missed_at
        await trio.sleep(1)
        backward(h.model, 2.0)
        assert await h.opt.step(4) is None  # no second download before download_retry
        assert len(h.downloads) == 1
        assert h.opt._missed_at == missed_at  # still to be repaired
        assert not await h.opt._catch_up(h.opt.progress)  # type: ignore[arg-type]
        await trio.sleep(6)
        assert await h.opt._catch_up(h.opt.progress) is False  # type: ignore[arg-type]
        assert len(h.downloads) == 2  # download_retry after the failure: allowed again (and failed)


async def test_a_round_the_others_left_stops_the_search_and_takes_their_state(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    harness: list[Harness] = []

    said = [Said(1, 0, 4)]

    async def they_left() -> str:
        await say(harness[0].peers[1], 1, 0)
        return HANG

    script = Script(they_left)
    async with scripted(monkeypatch, script, said=said, state=state_at(1, [7.0, 8.0, 9.0], source="p1"),
                        report_interval=0.5) as h:
        harness.append(h)
        backward(h.model, 2.0)
        with caplog.at_level(logging.INFO, LOG):
            started = trio.current_time()
            report = await h.opt.step(4)
        assert trio.current_time() - started <= 1.0 + 1e-9  # the next report and the watch's next look
        assert report == StepReport(0, TARGET, 4, 0, False, False,
                                    "missed: the swarm left this step before we found its group", 0.0, missed=True)
        assert h.downloads == [([h.peers[1].peer_id], 1)]
        assert h.me.known[h.peers[1].peer_id] == h.peers[1].addrs  # where to reach the source: its report
        assert values(h.model) == [7.0, 8.0, 9.0]
        assert (h.opt.local_step, h.opt.samples, h.opt.downloads, h.opt._missed_at) == (1, 0, 1, None)
        assert h.opt.last_download == (0.0, "p1")
        assert log_lines(caplog, LOG, "caught up") == ["caught up: downloaded the state at step 1 (4 samples of "
                                                         "an old step dropped)"]
        mine = (await reports(h.peers[1]))[h.me.peer_id]
        assert (mine.step, mine.samples, mine.previous) == (1, 0, 0)  # told at once, none brought


async def test_a_peer_with_no_samples_and_no_group_applies_nothing(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(MatchmakingError("nobody came"))) as h:
        report = await h.opt._global_step(progress(0, TARGET), 2)
        assert report == StepReport(0, TARGET, 0, 1, False, True, "no samples of ours and no group (no group: the "
                                    "local gradient of 0 samples alone (nobody came))", 0.0, missed=True)
        assert values(h.model) == [1.0, 1.0, 0.0]
        assert h.opt._missed_at == trio.current_time()
    async with scripted(monkeypatch, Script(Found(round_report(2), average=5.0))) as h:
        report = await h.opt._global_step(progress(0, TARGET), 2)
        assert report is not None and report.averaged and values(h.model) == [-4.0, -4.0, -5.0]


async def test_a_late_joiner_takes_the_swarm_s_state_as_it_opens_then_steps_with_it(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    said = [Said(1, 3, 4), Said(2, 3, 4)]

    script = Script(Found(round_report(3), average=1.0))
    pending = [0.5, 0.5, 0.5]
    with caplog.at_level(logging.INFO, LOG):
        async with scripted(monkeypatch, script, 3, said=said,
                            state=state_at(3, [2.0, 3.0, 4.0], pending=pending)) as h:
            # opening took the state (and applied the pending step it carries)
            assert h.downloads == [([h.peers[2].peer_id, h.peers[1].peer_id], 3)]
            assert values(h.model) == [1.5, 2.5, 3.5]
            assert (h.opt.local_step, h.opt._fresh) == (3, False)
            assert log_lines(caplog, LOG, "caught up") == ["caught up: downloaded the state at step 3"]
            # the step is ready: the call after a batch joins its round
            h.opt._next_download = 0.0
            await say(h.peers[1], 2, 4)  # behind us now: we take no state from it
            await say(h.peers[1], 3, 4)
            backward(h.model, 2.0)
            report = await h.opt.step(2)
            assert report is not None and report.averaged and report.local_samples == 2


async def test_after_a_catch_up_the_ready_round_is_joined_at_once(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 0, 0), Said(2, 0, 0)]

    async with scripted(monkeypatch, Script(Found(round_report(3), average=1.0)), 3, said=said,
                        state=state_at(2, [2.0, 3.0, 4.0])) as h:
        backward(h.model, 1.0)
        await h.opt.step(1)
        await say(h.peers[1], 2, 4)
        await say(h.peers[2], 2, 4)
        report = await h.opt._catch_up_and_join(await h.opt._sync())
        assert report == StepReport(2, TARGET, 0, 3, True, True, complete(3), 0.0)
        (call,) = h.script.calls
        assert (call.purpose, call.weight, call.expected) == ("grads:2:0", 0.0, 3)
        assert [t.tolist() for t in call.work] == [[[0.0, 0.0]], [0.0]]  # none of ours
        assert values(h.model) == [1.0, 2.0, 3.0]
        assert h.opt.local_step == 3
    async with scripted(monkeypatch, Script(), 3, said=said, state=state_at(2, [2.0, 3.0, 4.0])) as h:
        await say(h.peers[1], 2, 0)
        await say(h.peers[2], 2, 0)
        assert await h.opt._catch_up_and_join(await h.opt._sync()) is None  # the round is not ready: wait
        assert h.opt.local_step == 2
        h.opt._next_download = math.inf
        assert await h.opt._catch_up_and_join(progress(5, 0)) is None  # no download allowed: nothing


async def test_a_peer_stuck_without_a_quorum_takes_the_state_of_the_one_furthest_ahead(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    said = [Said(1, 2, 4)]

    async with scripted(monkeypatch, Script(), said=said, state=state_at(2, [2.0, 3.0, 4.0])) as h:
        assert h.opt.local_step == 0  # one peer ahead is no quorum: opening took nothing
        backward(h.model, 1.0)
        with caplog.at_level(logging.WARNING, LOG):
            assert await h.opt.step(1) is None
        assert log_lines(caplog, LOG, "this peer is at step") == [
            "this peer is at step 0 and has no quorum there; 1 peer(s) are at step 2 (they stepped without us, "
            "before we saw each other): taking their state"]
        assert h.downloads == [([h.peers[1].peer_id], 2)]
        assert (h.opt.local_step, values(h.model)) == (2, [2.0, 3.0, 4.0])


async def test_a_missed_round_nobody_can_repair_is_let_go(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    said = [Said(1, 1, 0, client=True)]  # ahead, and serves nobody

    async with scripted(monkeypatch, Script(), said=said, target_batch_size=10_000) as h:
        h.opt._missed_at = trio.current_time()
        await trio.sleep(11)
        backward(h.model, 1.0)
        with caplog.at_level(logging.WARNING, LOG):
            assert await h.opt.step(1) is None
        assert h.opt._missed_at is None
        assert log_lines(caplog, LOG, "step 0: the round") == [
            "step 0: the round we missed is moot: for 11 s nobody that could serve a state past it said it holds "
            "one; going on at this step"]


# ---------------------------------------------------------------------------- applying


async def test_the_step_clips_the_global_norm_and_steps_the_scheduler_once(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    def scheduler(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    async with scripted(monkeypatch, Script(), 1, scheduler=scheduler, max_grad_norm=math.sqrt(3)) as h:
        backward(h.model, 2.0)
        await h.opt.step(TARGET)
        assert values(h.model) == pytest.approx([0.0, 0.0, -1.0], abs=1e-6)  # (2, 2, 2) clipped to norm sqrt(3): ones
        assert h.opt.optimizer.param_groups[0]["lr"] == 0.5
        assert all(p.grad is None for p in h.model.parameters())
    async with scripted(monkeypatch, Script(), 1, max_grad_norm=100.0) as h:
        backward(h.model, 2.0)
        await h.opt.step(TARGET)
        assert values(h.model) == [-1.0, -1.0, -2.0]


# ---------------------------------------------------------------------------- delayed updates


async def test_with_delayed_updates_a_step_s_average_is_applied_when_the_next_step_begins(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 0, 4)]

    script = Script(Found(round_report(2), average=5.0, took=1.0), Found(round_report(2), average=3.0, took=1.0))
    async with scripted(monkeypatch, script, said=said, delay_updates=True) as h:
        backward(h.model, 2.0)
        assert await h.opt.step(4) is None  # step 0's round runs in the background
        assert h.opt.local_step == 1 and h.opt._pending is not None
        assert values(h.model) == [1.0, 1.0, 0.0]
        snapshot = await h.opt._snapshot()  # waits for the round: its average travels along
        assert snapshot.step == 1 and snapshot.pending is not None
        assert [t.tolist() for t in snapshot.pending] == [[[5.0, 5.0]], [5.0]]
        assert values(h.model) == [1.0, 1.0, 0.0]
        await say(h.peers[1], 1, 4)
        backward(h.model, 1.0)
        report = await h.opt.step(4)
        assert report == StepReport(0, TARGET, 4, 2, True, True, complete(2), 1.0)
        assert values(h.model) == [-4.0, -4.0, -5.0]
        last = await h.opt.finish()
        assert [(c.purpose, c.expected, c.weight) for c in script.calls] == [("grads:0:0", 2, 4.0),
                                                                             ("grads:1:0", 2, 4.0)]
        assert last is not None and last.step == 1
        assert values(h.model) == [-7.0, -7.0, -8.0]
        assert await h.opt.finish() is None
        assert (await h.opt._snapshot()).pending is None


async def test_the_block_s_end_applies_the_last_delayed_step(autojump_clock: trio.abc.Clock,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 0, 4)]

    async with scripted(monkeypatch, Script(Found(round_report(2), average=5.0, took=1.0)), said=said,
                        delay_updates=True) as h:
        backward(h.model, 2.0)
        await h.opt.step(4)
    assert values(h.model) == [-4.0, -4.0, -5.0]


async def test_a_delayed_round_the_swarm_left_is_not_applied(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    said = [Said(1, 0, 4)]

    async with scripted(monkeypatch, Script(Found(round_report(2), average=5.0)), said=said,
                        delay_updates=True) as h:
        done = trio.Event()
        done.set()
        missed = StepReport(0, TARGET, 4, 0, False, False, "missed: gone", 0.0, missed=True)
        h.opt._pending = (0, [torch.ones(1, 2), torch.ones(1)], done, [missed])
        with caplog.at_level(logging.WARNING, LOG):
            assert await h.opt._apply_pending() == missed
        assert values(h.model) == [1.0, 1.0, 0.0]
        assert h.opt._missed_at == trio.current_time() and h.opt._pending is None
        assert log_lines(caplog, LOG, "step 0: missed") == ["step 0: missed: gone"]
        h.opt._pending = (0, [torch.ones(1, 2), torch.ones(1)], done, [])
        assert await h.opt._apply_pending() is None  # no report (the round raised): applied all the same
        assert values(h.model) == [0.0, 0.0, -1.0]


async def test_a_snapshot_during_a_round_that_never_ends_is_one_update_short(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(), delay_updates=True) as h:
        h.opt.local_step = 4
        h.opt._pending = (3, [torch.ones(1, 2), torch.ones(1)], trio.Event(), [])
        started = trio.current_time()
        snapshot = await h.opt._snapshot()
        assert trio.current_time() - started == 60
        assert (snapshot.step, snapshot.pending) == (3, None)
        assert snapshot.params[0].tolist() == [[1.0, 1.0]]
        h.opt._pending = None


async def test_a_snapshot_whose_round_was_applied_meanwhile_is_the_state_as_it_is_then(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with scripted(monkeypatch, Script(), delay_updates=True) as h:
        h.opt.local_step = 4
        done = trio.Event()
        h.opt._pending = (3, [torch.ones(1, 2), torch.ones(1)], done, [])
        async with trio.open_nursery() as nursery:
            async def caught_up() -> None:  # as _catch_up does, while the snapshot waits
                await trio.sleep(1)
                h.opt._pending = None
                h.opt.local_step = 5
                with torch.no_grad():
                    h.model.weight.fill_(0.0)
                done.set()

            nursery.start_soon(caught_up)
            snapshot = await h.opt._snapshot()
        assert (snapshot.step, snapshot.pending, snapshot.params[0].tolist()) == (5, None, [[0.0, 0.0]])


# ---------------------------------------------------------------------------- state averaging


async def test_every_k_steps_the_parameters_and_optimizer_statistics_are_averaged(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.5)

    script = Script(Found(round_report(2), average=7.0, took=2.0), Found(round_report(2), average=6.0),
                    MatchmakingError("nobody"), HANG)
    model = linear().double()  # averaged as float32, put back as float64
    async with scripted(monkeypatch, script, optimizer=sgd, model=model, average_state_every=2,
                        report_interval=0.5) as h:
        backward(h.model, 1.0)
        await h.opt.step(TARGET)  # alone: a momentum buffer of ones
        weight_state = h.opt.optimizer.state[h.model.weight]
        # what is not a floating-point tensor with elements is no statistic to average
        weight_state.update(count=3, ids=torch.tensor([1, 2]), scalar=torch.tensor(2.0))
        for expected, at in ((1, 2), (2, 3)):  # a group of one, a step off the period: nothing
            h.opt.local_step = at
            await h.opt._average_state(expected)
        assert script.calls == []
        h.opt.local_step = 4
        await h.opt._average_state(2)
        (call,) = script.calls
        assert (call.purpose, call.weight, call.expected, call.weight_in) == ("state:4", 1.0, 2, 1.0)
        assert [t.tolist() for t in call.work] == [[[0.0, 0.0]], [-1.0], [[1.0, 1.0]], [1.0]]
        assert all(t.dtype == torch.float32 for t in call.work)
        assert values(h.model) == [7.0, 7.0, 7.0]
        assert all(p.dtype == torch.float64 for p in h.model.parameters())
        momenta = [s["momentum_buffer"] for s in h.opt.optimizer.state.values()]
        assert [m.flatten().tolist() for m in momenta] == [[7.0, 7.0], [7.0]]
        assert (weight_state["count"], weight_state["ids"].tolist(), weight_state["scalar"].item()) == (3, [1, 2], 2.0)
        assert h.opt.state_rounds == 1
        h.opt.local_step = 6
        await h.opt._average_state(2)
        assert (h.opt.state_rounds, values(h.model)) == (2, [6.0, 6.0, 6.0])
        h.opt.local_step = 8
        with caplog.at_level(logging.INFO, LOG):
            await h.opt._average_state(2)
        assert script.calls[-1].purpose == "state:8"
        assert log_lines(caplog, LOG, "state averaging") == [
            "state averaging at step 8: no group (nobody); the state stays as it is"]
        await say(h.peers[1], 11, 0)
        h.opt.local_step = 10
        await h.opt._average_state(2)  # the others left the step while we looked: nothing
        assert (h.opt.state_rounds, values(h.model)) == (2, [6.0, 6.0, 6.0])
    async with scripted(monkeypatch, Script(), optimizer=sgd) as h:  # every 0: never
        h.opt.local_step = 4
        await h.opt._average_state(2)
        assert h.script.calls == []


async def test_a_step_s_state_round_follows_an_averaged_step_only(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 0, 4)]

    script = Script(Found(round_report(2), average=5.0), Found(round_report(2), average=0.0))
    async with scripted(monkeypatch, script, said=said, average_state_every=1) as h:
        backward(h.model, 2.0)
        await h.opt.step(4)
        assert [(c.purpose, c.expected) for c in script.calls] == [("grads:0:0", 2), ("state:1", 2)]
        assert values(h.model) == [0.0, 0.0, 0.0]
    script = Script(Found(round_report(2), average=5.0, took=1.0), Found(round_report(2), average=0.0),
                    Found(round_report(2), average=5.0))
    async with scripted(monkeypatch, script, said=said, average_state_every=1, delay_updates=True) as h:
        backward(h.model, 2.0)
        await h.opt.step(4)
        await trio.sleep(2)
        await say(h.peers[1], 1, 4)
        backward(h.model, 2.0)
        await h.opt.step(4)  # applies step 0's average, then the state round of step 1
        assert [c.purpose for c in script.calls][:2] == ["grads:0:0", "state:1"]


# ---------------------------------------------------------------------------- an auxiliary peer


async def test_an_auxiliary_peer_follows_the_swarm_and_helps_each_ready_step_with_weight_zero(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 2, 4), Said(2, 2, 0)]

    async def nobody_in_time() -> MatchmakingError:
        await trio.sleep(2)
        return MatchmakingError("nobody")

    script = Script(Found(round_report(3), took=1.5), nobody_in_time)
    async with scripted(monkeypatch, script, 3, said=said, averager=AveragerConfig(auxiliary=True),
                        report_interval=0.5) as h:
        assert STATE_PROTOCOL not in h.me.handlers  # its parameters are not current: it serves none
        assert (h.opt.local_step, h.opt._assisted) == (2, 1)
        mine = (await reports(h.peers[1]))[h.me.peer_id]
        assert mine.auxiliary
        started = trio.current_time()
        assert await h.opt.assist() is None  # step 2 is not ready
        assert trio.current_time() - started == 0.5
        await say(h.peers[2], 2, 4)
        report = await h.opt.assist()
        assert report == StepReport(2, TARGET, 0, 3, True, True, complete(3), 1.5)
        (call,) = script.calls
        assert (call.purpose, call.weight, call.expected, call.weight_in) == ("grads:2:0", 0.0, 3, 0.0)
        assert [t.tolist() for t in call.work] == [[[0.0, 0.0]], [0.0]]
        assert all(t.dtype == torch.float32 for t in call.work)
        assert await h.opt.assist() is None  # helped with step 2 already
        await say(h.peers[1], 3, 4)
        await say(h.peers[2], 3, 4)
        report = await h.opt.assist()
        assert report == StepReport(3, TARGET, 0, 1, False, True, "no group to help (nobody)", 2.0)
        assert script.calls[-1].expected == 3


async def test_an_auxiliary_peer_the_swarm_left_behind_says_so(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    harness: list[Harness] = []

    said = [Said(1, 0, 4), Said(2, 0, 4)]

    async def they_left() -> str:
        await say(harness[0].peers[1], 1, 0)
        await say(harness[0].peers[2], 1, 0)
        return HANG

    async with scripted(monkeypatch, Script(they_left), 3, said=said, averager=AveragerConfig(auxiliary=True),
                        report_interval=0.5) as h:
        harness.append(h)
        report = await h.opt.assist()
        assert report == StepReport(0, TARGET, 0, 0, False, True, "the swarm left the step before we found its group",
                                    1.0, missed=True)


async def test_an_auxiliary_peer_helps_the_step_just_begun_with_delayed_updates(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 1, 0), Said(2, 1, 0)]

    async with scripted(monkeypatch, Script(Found(round_report(3))), 3, said=said, delay_updates=True,
                        averager=AveragerConfig(auxiliary=True)) as h:
        h.opt._assisted = -1
        report = await h.opt.assist()
        assert report is not None and report.step == 0
        assert h.opt.local_step == 1


# ---------------------------------------------------------------------------- state downloads, for real


async def test_a_late_joiner_downloads_a_peer_s_state_over_the_swarm(autojump_clock: trio.abc.Clock,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(2, 2, 0)]

    async with scripted(monkeypatch, Script(), 3, said=said) as first:
        first.opt.local_step = 2
        with torch.no_grad():
            first.model.weight.fill_(3.0)
        await first.opt._sync()
        other = linear()
        async with CollaborativeOptimizer.open(first.peers[1], torch.optim.SGD(other.parameters(), lr=1.0),
                                               config()) as late:
            assert late.local_step == 2
            assert values(other) == [3.0, 3.0, 0.0]
            assert late.downloads == 1
            assert late.last_download is not None and late.last_download[1] == first.me.peer_id.to_base58()


async def test_an_auxiliary_peer_s_zeros_have_the_trainers_schema(autojump_clock: trio.abc.Clock,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The match key holds the tensors' dtypes: zeros of another dtype than the trainers' gradients
    never meet them (float32 zeros for a float64 or bfloat16 model did not)."""
    said = [Said(1, 0, 4), Said(2, 0, 4)]

    async with scripted(monkeypatch, Script(Found(round_report(3))), 3, said=said, model=linear().double(),
                        averager=AveragerConfig(auxiliary=True)) as h:
        await h.opt.assist()
        trainer = GradientAccumulator(list(linear().double().parameters()))
        assert Schema.of(h.script.calls[0].work) == Schema.of(trainer.mean())
        assert h.script.calls[0].work[0].dtype == torch.float64


async def test_a_trainer_takes_the_run_up_from_a_trusted_archive_it_never_met_at_the_address_its_report_gives(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """An embedding app names the run's backbone (``trusted_archives``) without dialing it first: where to
    reach it is in its archive report, as a trainer's is in its progress report."""
    async with scripted(monkeypatch, Script(), 2, said=[Said(1, 7, 0, archive=True)],
                        state=state_at(7, [7.0, 8.0, 9.0], source="backbone")) as h:
        assert h.downloads == [([h.peers[1].peer_id], 7)]
        assert h.me.known == {h.peers[1].peer_id: h.peers[1].addrs}
        assert h.opt.local_step == 7 and values(h.model) == [7.0, 8.0, 9.0]


async def test_a_trainer_that_stops_says_it_left_and_the_others_stop_counting_it_at_once(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """However its block ends, at its end or cancelled (a SIGTERM cancels the command's work), its last
    report says it left: the others' next read no longer counts it (not a minute later, at its expiry).
    It says at which step: the one it reached, though it stepped since its last report, so that an
    observer (a backbone) reads the run every trainer left at that step."""
    for cancelled in (False, True):
        with trio.CancelScope() as scope:
            async with scripted(monkeypatch, Script(), 2, said=[Said(1, 3, 40)]) as h:
                me, other = h.opt.peer.peer_id, h.peers[1]
                assert me in await reports(other)
                h.opt.local_step = 4  # it took step 3 since it last reported
                if cancelled:
                    scope.cancel()
                    await trio.sleep_forever()
        assert scope.cancelled_caught == cancelled
        assert me not in await reports(other), cancelled
        await leave(other)  # at step 3
        later = [0.0]
        observer = ProgressTracker(other, RUN, TARGET, clock=lambda: time.time() + later[0])
        assert (await observer.fetch()).step == 4, cancelled
        later[0] = 61.0  # the last words expired too: the run stays where the observer last saw it
        assert (await observer.fetch()).step == 4, cancelled


async def test_an_auxiliary_peer_alone_keeps_its_step(autojump_clock: trio.abc.Clock,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 5, 0), Said(2, 5, 0)]

    async with scripted(monkeypatch, Script(), 3, said=said, averager=AveragerConfig(auxiliary=True),
                        report_interval=1.0) as h:
        assert h.opt.local_step == 5
        for trainer in h.peers[1:]:  # the trainers left
            await leave(trainer)
        assert await h.opt.assist() is None
        assert h.opt.local_step == 5 and h.opt.progress is not None and h.opt.progress.step == 5


async def test_an_auxiliary_peer_reads_a_run_its_trainers_left_at_the_step_they_left_it(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """They took the last round without it and left: it is at their last step (`train --auxiliary
    --max-steps N` ends there; it had waited at the step before until it was killed)."""
    said = [Said(1, 11, 0), Said(2, 11, 0)]

    async with scripted(monkeypatch, Script(), 3, said=said, averager=AveragerConfig(auxiliary=True),
                        report_interval=1.0) as h:
        assert h.opt.local_step == 11
        for trainer in h.peers[1:]:
            await leave(trainer, 12)
        assert await h.opt.assist() is None
        assert h.opt.local_step == 12


async def test_with_delayed_updates_an_auxiliary_peer_helps_the_round_just_begun_with_its_members(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 5, 0), Said(2, 9, 0)]

    script = Script(Found(round_report(2)))
    async with scripted(monkeypatch, script, 3, said=said, delay_updates=True,
                        averager=AveragerConfig(auxiliary=True)) as h:
        assert (h.opt.local_step, h.opt._assisted) == (5, 4)
        await say(h.peers[1], 6, 0)  # began step 5's round
        report = await h.opt.assist()
        assert report is not None and report.step == 5
        assert (script.calls[0].purpose, script.calls[0].expected) == ("grads:5:0", 2)


async def test_a_peer_stuck_after_its_first_step_waits_rejoin_after_then_takes_the_state_ahead(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 2, 4)]

    async with scripted(monkeypatch, Script(), said=said, state=state_at(2, [2.0, 3.0, 4.0]),
                        rejoin_after=10.0) as h:
        h.opt._fresh = False  # it stepped before: it waits before it gives its step up
        backward(h.model, 1.0)
        assert await h.opt.step(TARGET) is None
        since = h.opt._stuck_since
        assert since == trio.current_time()
        await trio.sleep(9)
        backward(h.model, 1.0)
        assert await h.opt.step(1) is None
        assert (h.downloads, h.opt._stuck_since) == ([], since)
        await trio.sleep(1)
        backward(h.model, 1.0)
        assert await h.opt.step(1) is None
        assert h.downloads == [([h.peers[1].peer_id], 2)]
        assert (h.opt.local_step, h.opt._stuck_since) == (2, None)


async def test_a_peer_the_swarm_passed_catches_up_on_its_next_batch(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    def scheduler(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    theirs = torch.optim.SGD(linear().parameters(), lr=1.0)
    their_scheduler = torch.optim.lr_scheduler.StepLR(theirs, step_size=1, gamma=0.5)
    for _ in range(3):
        theirs.step()
        their_scheduler.step()
    state = TrainingState(3, [torch.tensor([[2.0, 3.0]]), torch.tensor([4.0])],
                          [torch.ones(1, 2), torch.ones(1)],  # float32, as downloaded, for a float64 model
                          theirs.state_dict(), their_scheduler.state_dict(), source="p1")
    async with scripted(monkeypatch, Script(), 3, state=state, scheduler=scheduler, model=linear().double()) as h:
        await say(h.peers[1], 3, 0)
        await say(h.peers[2], 3, 0, client=True)  # no source: its addresses are not taken
        await trio.sleep(1)  # the report loop reads the swarm
        h.opt._stuck_since = 1.0
        backward(h.model, 1.0)
        assert await h.opt.step(2) is None
        assert h.downloads == [([h.peers[1].peer_id], 3)]
        assert h.me.known == {h.peers[1].peer_id: h.peers[1].addrs}
        # the state, and the pending step it carries, taken at their learning rate (0.5 ** 3)
        assert values(h.model) == [1.875, 2.875, 3.875]
        assert h.model.weight.dtype == torch.float64
        assert h.opt.scheduler.last_epoch == 4  # their scheduler's, stepped with the pending step
        assert (h.opt.local_step, h.opt.samples, h.opt._missed_at) == (3, 0, None)
        assert h.opt._stuck_since is None
        h.opt.local_step = 0
        await h.opt._catch_up(h.opt.progress)
        assert h.opt.downloads == 2


async def test_a_snapshot_carries_the_scheduler_s_state_on_every_path(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    def scheduler(opt: torch.optim.Optimizer) -> Any:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        opt.step()
        sched.step()
        return sched

    async with scripted(monkeypatch, Script(), scheduler=scheduler, delay_updates=True) as h:
        assert (await h.opt._snapshot()).scheduler == h.opt.scheduler.state_dict()
        done = trio.Event()
        done.set()
        h.opt._pending = (0, [torch.ones(1, 2), torch.ones(1)], done, [])
        assert (await h.opt._snapshot()).scheduler == h.opt.scheduler.state_dict()
        h.opt._pending = (0, [torch.ones(1, 2), torch.ones(1)], trio.Event(), [])
        assert (await h.opt._snapshot()).scheduler == h.opt.scheduler.state_dict()
        h.opt._pending = None


async def test_with_delayed_updates_the_call_after_the_others_began_our_round_joins_it(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    said = [Said(1, 1, 0, previous=4)]  # it saw step 0 ready and began its round

    script = Script(Found(round_report(2), average=5.0))
    async with scripted(monkeypatch, script, said=said, delay_updates=True) as h:
        backward(h.model, 2.0)
        assert await h.opt.step(2) is None
        assert h.opt.local_step == 1
        await h.opt.finish()
        assert [(c.purpose, c.expected, c.weight) for c in script.calls] == [("grads:0:0", 2, 2.0)]
        assert values(h.model) == [-4.0, -4.0, -5.0]


async def test_with_delayed_updates_no_group_for_the_round_is_no_miss(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The background round runs after this peer reported the next step: its own report is no sign
    that the others took the step without it."""
    said = [Said(1, 0, 4)]

    async with scripted(monkeypatch, Script(MatchmakingError("nobody came")), said=said,
                        delay_updates=True) as h:
        backward(h.model, 2.0)
        await h.opt.step(4)
        last = await h.opt.finish()
        assert last is not None and not last.missed
        assert last.summary == "no group: the local gradient of 4 samples alone (nobody came)"
        assert values(h.model) == [-1.0, -1.0, -2.0]


async def test_a_peer_that_can_reduce_keeps_looking_while_only_senders_are_left_at_the_step(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    harness: list[Harness] = []

    said = [Said(1, 0, 4), Said(2, 0, 4, sender=True)]

    async def one_moved_on() -> Found:
        await say(harness[0].peers[1], 1, 0)
        return Found(round_report(2), average=5.0, took=3.0)

    async with scripted(monkeypatch, Script(one_moved_on), 3, said=said, report_interval=0.5) as h:
        harness.append(h)
        backward(h.model, 2.0)
        report = await h.opt.step(4)
        assert report is not None and report.averaged  # the sender could still average with us


async def test_a_loss_scaler_s_scale_is_taken_off_each_batch(autojump_clock: trio.abc.Clock,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    async with scripted(monkeypatch, Script(), 1, scaler=scaler) as h:
        backward(h.model, 8.0)  # the scaled gradient of a mean gradient of 2
        await h.opt.step(TARGET)
        assert values(h.model) == [-1.0, -1.0, -2.0]
