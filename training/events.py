"""Event records of the training layer, alongside :mod:`p2p.events` (same base, same ``--json`` lines).

``dedloc train`` prints a :class:`TrainingStatus` every few seconds (a
progress bar toward the next global step, the swarm's and its own samples/s,
loss, peers, time to the step) and a :class:`GlobalStepDone` for every step
of the swarm it took part in; ``dedloc backbone`` prints :class:`Checkpointed`, and
:class:`TakenUp` when it starts where another left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from p2p.events import Event

BAR = 24


def bar(done: float, total: float, width: int = BAR) -> str:
    """``[#######.........]``: the share of ``total`` that is ``done``."""
    share = 0.0 if total <= 0 else min(1.0, max(0.0, done / total))
    filled = round(share * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def count(done: int, total: int) -> str:
    """``128/128``: never more than the whole (a step that overshoots its target shows it full)."""
    return f"{min(done, total)}/{total}"


def _loss(value: float | None) -> str:
    return "?" if value is None or not math.isfinite(value) else f"{value:.3f}"


@dataclass
class TrainingStatus(Event):
    """Where the run stands: the global step under way and how far the swarm got toward it."""

    step: int
    swarm_samples: int
    target: int
    swarm_samples_per_second: float
    samples_per_second: float
    loss: float | None
    swarm_loss: float | None
    peers: int
    eta: float
    local_samples: int
    event: str = field(init=False, default="training_status")

    def human(self) -> str:
        eta = "now" if self.eta <= 0 else ("?" if not math.isfinite(self.eta) else f"~{self.eta:.0f} s")
        return (f"step {self.step} {bar(self.swarm_samples, self.target)} {count(self.swarm_samples, self.target)} "
                f"| swarm {self.swarm_samples_per_second:.0f} samples/s, mine {self.samples_per_second:.0f} "
                f"| loss {_loss(self.loss)} (swarm {_loss(self.swarm_loss)}) | {self.peers} peer"
                f"{'s' if self.peers != 1 else ''} | next step {eta}")


@dataclass
class GlobalStepDone(Event):
    """One global step this peer took part in: its :class:`~training.StepReport` and the loss
    (``averaged``: with others; ``missed``: it caught up instead)."""

    step: int
    samples: int
    local_samples: int
    group_size: int
    averaged: bool
    complete: bool
    summary: str
    elapsed: float
    missed: bool
    #: no other peer was in the run (the local gradient, no failure)
    solo: bool
    loss: float | None
    event: str = field(init=False, default="global_step")

    def human(self) -> str:
        if self.missed:
            return f"step {self.step}: missed ({self.summary}); taking the swarm's state"
        how = (f"averaged with {self.group_size - 1} other{'s' if self.group_size != 2 else ''}" if self.averaged
               else "alone")
        partial = "" if self.complete else f" PARTIAL ({self.summary})"
        return (f"step {self.step} done: {self.samples} samples ({self.local_samples} mine), {how} in "
                f"{self.elapsed:.2f} s, loss {_loss(self.loss)}{partial}")


@dataclass
class StateDownloaded(Event):
    """This peer joined late or fell behind and took the swarm's state."""

    step: int
    #: seconds the download took, and the peer that served it
    seconds: float = 0.0
    source: str = ""
    event: str = field(init=False, default="state_downloaded")

    def human(self) -> str:
        return f"took the swarm's state at step {self.step} from {self.source[-8:]} in {self.seconds:.2f} s"


@dataclass
class Checkpointed(Event):
    """The backbone saved the run's state."""

    step: int
    path: str
    source: str
    event: str = field(init=False, default="checkpointed")

    def human(self) -> str:
        return f"checkpoint of step {self.step} saved to {self.path} (from {self.source[-8:]})"


@dataclass
class TakenUp(Event):
    """A backbone started on a directory another one left: the checkpoint it serves and publishes as the
    run's archive (step -1: none), the step its curve goes on from, the volunteers its board carries."""

    step: int
    path: str
    curve_step: int
    volunteers: int
    event: str = field(init=False, default="taken_up")

    def human(self) -> str:
        saved = f"serving the checkpoint of step {self.step} ({self.path})" if self.step >= 0 else "no checkpoint"
        return (f"taken up from the last backbone: {saved}; the curve goes on from step {self.curve_step}, the "
                f"board of {self.volunteers} volunteer{'' if self.volunteers == 1 else 's'}")


@dataclass
class ExpertsServing(Event):
    """``serve-experts`` (or one child of ``--processes``): its experts are declared and answer calls.
    ``process`` is the child's index, of ``processes``; 0 of 1 for one process."""

    experts: int
    expert_cls: str
    pattern: str
    hidden_dim: int
    device: str
    process: int = 0
    processes: int = 1
    event: str = field(init=False, default="experts_serving")

    def human(self) -> str:
        part = "" if self.processes == 1 else f", process {self.process} of {self.processes}"
        return (f"serving {self.experts} {self.expert_cls} experts ({self.pattern}{part}, hidden {self.hidden_dim}) "
                f"on {self.device}")


@dataclass
class ExpertProcesses(Event):
    """``serve-experts --processes``: the server starts its children, a peer each (their own events follow)."""

    processes: int
    experts: int
    pattern: str
    event: str = field(init=False, default="expert_processes")

    def human(self) -> str:
        each = self.experts // self.processes
        more = "+" if self.experts % self.processes else ""
        return f"serving {self.pattern} in {self.processes} processes (a peer each, {each}{more} experts per process)"


@dataclass
class ExpertProcessExited(Event):
    """A child of ``serve-experts --processes`` ended by itself: the others are stopped, the command fails."""

    index: int
    processes: int
    returncode: int
    event: str = field(init=False, default="expert_process_exited")

    def human(self) -> str:
        return (f"serve-experts: process {self.index} of {self.processes} exited with status {self.returncode}; "
                "stopping the others")
