"""The step policy: what a trainer does after a batch, as pure functions of state, progress and time.

:func:`decide` takes this peer's local state (:class:`Trainer`), the swarm's
progress (:class:`~training.progress.GlobalProgress`) and the live reports it
was folded from, and the time; it returns one action. The optimizer
(:class:`training.optimizer.CollaborativeOptimizer`) is the shell that reads
the progress, calls it, and performs the action; every rule is here, and is
tested without a network (``tests/test_training_policy.py``), each incident
that shaped it a scenario.

The table, in the order :func:`decide` looks (the first row that holds wins):

=====  ==========================================================  ==========================
row    when                                                        action
=====  ==========================================================  ==========================
begun  delayed updates, no missed round to repair, and the swarm   :class:`JoinBegunRound`
       moved one step past ours or a peer began our step's round
behind the swarm's step is past ours, or we missed a round (and     :class:`CatchUp`
       the miss is not moot: :func:`missed_moot`)
stuck  a peer is ahead and our step has the samples but no quorum  :class:`TakeStateFromAhead`
       for ``rejoin_after`` (at once for a fresh peer); a download
       is allowed now
ready  the swarm is at our step and it is ready                    :class:`AverageStep`
idle   otherwise                                                   :class:`Wait`
=====  ==========================================================  ==========================

The same module holds the rules the shell asks mid-step: how large a group a
round waits for (:func:`expected_group`), when the swarm left a round we are
still looking for (:func:`left_behind`), whether a step without a group was
missed or taken alone (:func:`missed_without_group`), whether to join the
round at once after a download (:func:`join_after_catch_up`), which state to
ask for (:func:`state_wanted`) and which step an auxiliary peer helps with
(:func:`assist_due`). Times are the trainer's clock (monotonic seconds),
passed in; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from libp2p.peer.id import ID

from .progress import GlobalProgress, LocalProgress


@dataclass(frozen=True)
class Rules:
    """The settings the policy reads (from :class:`~training.optimizer.TrainingConfig`)."""

    #: delayed parameter updates (DeDLOC 3.2): a peer moves on to the next step when a round begins
    delay_updates: bool = False
    #: seconds with the samples but no quorum, a peer being ahead, before taking its state
    rejoin_after: float = 10.0
    #: how often a peer whose samples already count in full reads the swarm again after a batch
    reread_interval: float = 0.1


@dataclass(frozen=True)
class Trainer:
    """This peer's local state, as the policy sees it."""

    me: ID
    #: the global step this peer accumulates for, and its samples toward it
    step: int
    samples: int
    #: the samples our last published report said
    reported_samples: int = 0
    #: no step taken and no state downloaded yet
    fresh: bool = True
    #: when a round of ours was missed (the swarm stepped without us; the trainer's clock), until
    #: the swarm's state is taken or the miss turns out moot (:func:`missed_moot`); None: none
    missed_at: float | None = None
    #: with delayed updates: a step's round runs in the background
    pending: bool = False
    #: since when we have had the samples but no quorum while a peer is ahead (None: not stuck)
    stuck_since: float | None = None
    #: no state download before this time (one failed)
    next_download: float = 0.0
    #: this peer may reduce a part of a round (not a sender)
    reduces: bool = True

    @property
    def must_catch_up(self) -> bool:
        """A missed round is to be repaired: take the swarm's state."""
        return self.missed_at is not None


# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Wait:
    """Nothing to do: accumulate the next batch."""


@dataclass(frozen=True)
class AverageStep:
    """Average our step's gradients with ``expected`` peers and apply them. When the round turns
    out missed (the others left it) and ``catch_up_if_missed``, take the swarm's state at once."""

    progress: GlobalProgress
    expected: int
    catch_up_if_missed: bool


@dataclass(frozen=True)
class JoinBegunRound:
    """Delayed updates: the others began our step's round (they moved on as it began); join it."""

    progress: GlobalProgress
    expected: int


@dataclass(frozen=True)
class CatchUp:
    """Download the swarm's state (we are behind, or missed a round), then join its step's round
    if it is gathering (:func:`join_after_catch_up`)."""

    progress: GlobalProgress


@dataclass(frozen=True)
class TakeStateFromAhead:
    """We are stuck at a step without a quorum while peers went on: take the state of the furthest
    (``progress.step`` is theirs, ``progress.sources`` who holds it, freshest first)."""

    progress: GlobalProgress
    behind: int


Action = Wait | AverageStep | JoinBegunRound | CatchUp | TakeStateFromAhead


@dataclass(frozen=True)
class Decision:
    action: Action
    #: the trainer's new ``stuck_since``
    stuck_since: float | None
    #: the trainer's new ``missed_at`` (None once the miss is moot); no default: a row that left
    #: it out would forget a miss
    missed_at: float | None


# ---------------------------------------------------------------------------- the decision


def needs_read(trainer: Trainer, progress: GlobalProgress | None, since_read: float = math.inf,
               rules: Rules = Rules()) -> bool:
    """Whether the swarm's progress must be read again before deciding (``since_read``: seconds
    since the last read): none read yet, it is of another step, or the step may be complete. Our
    latest samples may complete it at once; once they count in full (a peer's count is capped at
    the target) only the others' can, and the read waits ``rules.reread_interval`` since the last."""
    if progress is None or progress.step != trainer.step:
        return True
    if estimate(trainer, progress) < progress.target:
        return False
    adds = min(trainer.samples, progress.target) > min(trainer.reported_samples, progress.target)
    return adds or since_read >= rules.reread_interval


def estimate(trainer: Trainer, progress: GlobalProgress) -> int:
    """The swarm's samples toward our step, with our latest count instead of our last report's."""
    return progress.samples - min(trainer.reported_samples, progress.target) + min(trainer.samples, progress.target)


def decide(trainer: Trainer, progress: GlobalProgress, reports: Sequence[LocalProgress], now: float,
           rules: Rules) -> Decision:
    """The action after a batch (the table in the module docstring)."""
    if missed_moot(trainer, progress, reports, now, rules):
        trainer = replace(trainer, missed_at=None)
    missed = trainer.missed_at
    if rules.delay_updates and not trainer.must_catch_up and (
            progress.step == trainer.step + 1 or round_began(trainer, progress, reports)):
        # With delayed updates a peer moves on when its round begins: the others just began
        # ours (they apply it when their next step begins). Join it; catching up would drop
        # our samples and download a state that lacks this very step.
        expected = expected_group(trainer.step, progress, reports, trainer.me, rules)
        return Decision(JoinBegunRound(progress, expected), trainer.stuck_since, missed)
    if progress.step > trainer.step or trainer.must_catch_up:
        return Decision(CatchUp(progress), trainer.stuck_since, missed)
    ahead, stuck_since = stuck_ahead(trainer, progress, reports, now, rules)
    if ahead is not None and now >= trainer.next_download:
        return Decision(TakeStateFromAhead(ahead, trainer.step), stuck_since, missed)
    if progress.step == trainer.step and progress.ready:
        expected = expected_group(trainer.step, progress, reports, trainer.me, rules)
        return Decision(AverageStep(progress, expected, catch_up_if_missed=not rules.delay_updates), stuck_since,
                        missed)
    return Decision(Wait(), stuck_since, missed)


def missed_moot(trainer: Trainer, progress: GlobalProgress, reports: Sequence[LocalProgress], now: float,
                rules: Rules) -> bool:
    """Whether a missed round needs no repair after all: ``rejoin_after`` after the miss, the
    swarm's step is still ours and no peer that could serve the state we want (not a client, not
    auxiliary) reports its step. Then nobody holds that state to give: we stay at our step.

    A round is missed when a peer reports a later step, and at first that may be a report that
    came before its partners' (they are a moment behind it): hence the wait. But a client that
    stepped alone before it saw the swarm is ahead for good, and serves nobody; the two peers at
    the step that saw it each missed the round, asked each other for the state past it, and
    refused each other for the rest of the run (the demo in CI, 2026-12-03).
    """
    if trainer.missed_at is None or progress.step > trainer.step or now - trainer.missed_at < rules.rejoin_after:
        return False
    wanted = state_wanted(trainer, progress, rules)
    return not any(r.step >= wanted for r in reports if r.peer_id != trainer.me and r.serves_state)


def round_began(trainer: Trainer, progress: GlobalProgress, reports: Sequence[LocalProgress]) -> bool:
    """With delayed updates: a peer that saw our step ready moved on to the next one as it began
    the step's round, and its samples left our step's count with it: seen from here the step is
    no longer ready (the quorum still reads our step when the swarm is two peers). Its report of
    the next step is the sign to join."""
    return (progress.step == trainer.step and trainer.samples > 0
            and any(r.step == trainer.step + 1 for r in reports if r.peer_id != trainer.me and not r.auxiliary))


def stuck_ahead(trainer: Trainer, progress: GlobalProgress, reports: Sequence[LocalProgress], now: float,
                rules: Rules) -> tuple[GlobalProgress | None, float | None]:
    """The furthest step to take a state from when the quorum rule leaves us stuck (else None),
    and the new ``stuck_since``.

    Stuck: some peer is ahead of our step, and our step (the swarm's by the quorum rule) has
    the samples but not the quorum, for ``rejoin_after`` (at once for a fresh peer). Peers that
    stepped alone before they saw each other (they started together; the DHT was still forming)
    end at different steps, and the one behind would wait for a quorum that never comes.
    """
    others = [r for r in reports if r.peer_id != trainer.me and not r.auxiliary]
    furthest = max((r.step for r in others), default=-1)
    # with delayed updates a peer reports the next step when its round begins: one step
    # ahead is the usual moment of a round, not a sign that it went on without us
    lag = 1 if rules.delay_updates else 0
    stuck = (progress.step == trainer.step < furthest and not trainer.pending
             and ((trainer.fresh and furthest > trainer.step + lag)
                  or (progress.samples >= progress.target and progress.contributors < progress.quorum)))
    if not stuck:
        return None, None
    since = now if trainer.stuck_since is None else trainer.stuck_since
    if not trainer.fresh and now - since < rules.rejoin_after:
        return None, since
    sources = tuple(r.peer_id for r in sorted(others, key=lambda r: -r.time)
                    if r.step >= furthest and r.serves_state)
    return replace(progress, step=furthest, sources=sources), since


# ---------------------------------------------------------------------------- rules asked mid-step


def expected_group(step: int, progress: GlobalProgress, reports: Sequence[LocalProgress], me: ID,
                   rules: Rules) -> int:
    """The group size ``step``'s round waits for (up to the gather time): the peers at the step,
    those finishing the one before, and with delayed updates those that began this round
    already (they moved on to the next step when it began)."""
    lag = 1 if rules.delay_updates else 0
    others = sum(1 for r in reports if r.peer_id != me and step - 1 <= r.step <= step + lag)
    return max(progress.expected if progress.step == step else 0, 1 + others)


def left_behind(step: int, reports: Sequence[LocalProgress], me: ID, reduces: bool, rules: Rules) -> bool:
    """Whether the others left ``step``'s round while we look for its group: some report a later
    step, and none but us could still be in that round (at the step; with delayed updates, at the
    step after it too, since a peer moves on when a round begins and applies it when the next one
    does).

    Peers still at the step count only if a group of them could form: when neither we nor any of
    them may reduce a part (client mode, relayed), no group ever will. Two late peers behind NATs
    once waited out the whole matchmaking timeout for each other while the swarm went on.
    """
    lag = 1 if rules.delay_updates else 0
    theirs = [r for r in reports if r.peer_id != me]
    if not any(r.step > step + lag for r in theirs if not r.auxiliary):
        return False
    still = [r for r in theirs if step <= r.step <= step + lag]
    if not any(not r.auxiliary for r in still):
        return True
    return not reduces and all(r.sender for r in still)


def missed_without_group(step: int, reports: Sequence[LocalProgress], me: ID) -> bool:
    """When no group formed for ``step``: whether the others took the step in a group we did not
    find (then our own gradient alone would set us apart for good: take their state), rather than
    nobody forming one (then we step alone)."""
    return any(r.step > step for r in reports if r.peer_id != me)


def join_after_catch_up(trainer: Trainer, progress: GlobalProgress, reports: Sequence[LocalProgress],
                        rules: Rules) -> AverageStep | None:
    """After a download: join the step's round at once, with none of our samples, if it is
    gathering. A peer that fell behind once stayed behind: it took the state, computed a batch,
    and came to the round as the others left it, step after step (on a slow link each download
    takes about as long as a round gathers). Not with delayed updates (the next batch's call
    joins the begun round)."""
    if rules.delay_updates or progress.step != trainer.step or not progress.ready:
        return None
    return AverageStep(progress, expected_group(trainer.step, progress, reports, trainer.me, rules),
                       catch_up_if_missed=True)


def state_wanted(trainer: Trainer, progress: GlobalProgress, rules: Rules) -> int:
    """The step of the state to download: the swarm's, and after a missed round the one past it
    (with delayed updates our step already is: the missed round is the one before it)."""
    if not trainer.must_catch_up:
        return progress.step
    return max(progress.step, trainer.step + (0 if rules.delay_updates else 1))


def assist_due(progress: GlobalProgress, assisted: int, rules: Rules) -> int | None:
    """The step an auxiliary peer helps average now (None: none). With delayed updates, the step
    the trainers just moved past (its round began as they did; they compute the next one
    meanwhile); else the step once it is ready. Never one it helped with, nor with one peer."""
    step = progress.step
    due = step - 1 if rules.delay_updates and step - 1 > assisted else step if progress.ready else -1
    if due < 0 or due <= assisted or progress.peers < 2:
        return None
    return due


__all__ = ["Action", "AverageStep", "CatchUp", "Decision", "JoinBegunRound", "Rules", "TakeStateFromAhead", "Trainer",
           "Wait", "assist_due", "decide", "estimate", "expected_group", "join_after_catch_up", "left_behind",
           "missed_moot", "missed_without_group", "needs_read", "round_began", "state_wanted", "stuck_ahead"]
