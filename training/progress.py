"""The swarm's training progress, over the DHT: which global step, and how many samples toward it.

Every peer publishes a :class:`LocalProgress` under ``<run id>.progress`` in a
subkey only it may write (signed), expiring ``expiration`` seconds after the
report; everyone reads them all and folds them with :func:`global_progress`
(pure: the rules live there, the DHT I/O in :class:`ProgressTracker`).

The rules keep one peer's word from steering the run (hivemind takes the
largest epoch any peer reports, so a single peer can move everyone):

* a report from the future, with negative counts or a non-finite rate is
  dropped; a peer's samples count at most ``target`` (one peer's claim never
  exceeds a whole global batch);
* the global step is the highest step that at least ``quorum`` peers report
  (at least :data:`QUORUM` of them once the swarm has that many, so a lone
  peer claiming step 10**9 moves nobody; a swarm of one trains alone);
* the step is ready once the samples toward it reach ``target`` and come from
  at least ``quorum`` peers: no single peer can trigger a step by itself;
* our own latest report counts even when the DHT did not return it (a peer
  never reads a swarm without itself; a peer alone still reaches its target);
* a report that one read missed still counts until it expires (:func:`merge_reports`):
  a partial read is not a smaller swarm;
* an auxiliary peer (no samples of its own; it only helps average) follows
  the step and has no vote in it: it counts only in the group size a round
  waits for;
* an *archive* (a backbone's saved state: ``archive`` set, its step the
  checkpoint's) is no peer of the run: no samples, no vote, no group. A
  trainer believes only the archives it trusts (its caller names them: the
  run's backbones), and only when the swarm is behind one by more than a step,
  every live peer (this one too): then that archive's step is the global step
  and it the source. Every trainer gone, the next one to join takes the run
  on from the backbone's checkpoint rather than from scratch (DeDLOC 3.1:
  backbone peers store the checkpoints; one of them is always up). During a
  run the backbone saves the state some live peer holds, so it is never ahead
  of all of them by two steps;
* a peer that stops publishes a last report that says it *left*
  (:meth:`ProgressTracker.leave`; hivemind stores None in its place). It
  replaces the peer's earlier reports wherever they are kept (it is the
  newest), so the peer stops counting at once, not when its last report
  expires a minute later: its samples no longer fill the swarm's batch, its
  vote no longer holds the step, it is no longer a source of state, and a
  trainer who joins a swarm that every other trainer has left takes the run up
  from the backbone's archive at once (the archive counts only when every live
  peer is behind it). A peer that comes back reports anew, later, and counts
  again. The last word keeps the step the peer reached: an observer (the
  backbone: its page, its metrics) reads a run every trainer left at the
  highest of those steps, and later at the step it last read, not at step 0.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from nat import Swarm
from p2p.dht.records import DHTKey, owned, owner_of
from p2p.errors import DedlocError
from p2p.untrusted import decode_addrs

from .proto import training_pb2 as pb

log = logging.getLogger(__name__)

#: Peers that must agree on a step (or contribute to one) once the swarm has that many.
QUORUM = 2
#: Addresses a report carries at most.
MAX_ADDRS = 16
#: Reports this far in the future (clock skew) are still believed.
MAX_CLOCK_SKEW = 30.0


@dataclass(frozen=True)
class LocalProgress:
    """One peer's report: the step it accumulates for, and how far it got."""

    peer_id: ID
    step: int
    samples: int
    samples_per_second: float
    time: float
    client: bool = False
    #: the mean loss of this peer's recent batches, where its caller gives it
    loss: float | None = None
    #: where it can be reached (to download its state)
    addrs: tuple[Multiaddr, ...] = ()
    #: it only helps average: no samples, no vote on the step, no state to serve
    auxiliary: bool = False
    #: it never reduces a part (client mode, relayed): peers that all are cannot form a group
    sender: bool = False
    #: the samples it brought to the round of ``step - 1`` (its final count there: the report of
    #: the next step replaces that step's, maybe before anyone read its last count)
    previous: int = 0
    #: a saved state at ``step`` (a backbone's checkpoint), not a trainer (the module docstring)
    archive: bool = False
    #: its last word: it has left the run, and its earlier reports no longer count
    left: bool = False

    @property
    def serves_state(self) -> bool:
        """Whether others can download its training state: it can be dialed (not a client) and
        has a state of its own (not auxiliary)."""
        return not self.client and not self.auxiliary

    def to_wire(self) -> bytes:
        return pb.Progress(step=self.step, samples=self.samples, samples_per_second=self.samples_per_second,
                           time=self.time, client=self.client, loss=self.loss,
                           addrs=[a.to_bytes() for a in self.addrs[:MAX_ADDRS]],
                           auxiliary=self.auxiliary, sender=self.sender, previous=self.previous,
                           archive=self.archive, left=self.left).SerializeToString()

    @classmethod
    def from_wire(cls, peer_id: ID, data: bytes) -> LocalProgress:
        """Parse a peer's report; ValueError when it is not one."""
        msg = pb.Progress()
        try:
            msg.ParseFromString(data)
        except Exception as e:  # protobuf's DecodeError and friends
            raise ValueError(f"not a progress report: {e}") from None
        loss = msg.loss if msg.HasField("loss") and math.isfinite(msg.loss) else None
        addrs = tuple(decode_addrs(msg.addrs, limit=MAX_ADDRS))
        return cls(peer_id, msg.step, msg.samples, msg.samples_per_second, msg.time, msg.client, loss, addrs,
                   msg.auxiliary, msg.sender, msg.previous, msg.archive, msg.left)


@dataclass(frozen=True)
class GlobalProgress:
    """The run as the reports show it."""

    #: the global step under way (the highest one a quorum reports)
    step: int
    #: samples accumulated toward it, over every peer at that step (each capped at ``target``)
    samples: int
    target: int
    #: peers reporting that step, and all live peers
    peers_at_step: int
    peers: int
    #: the swarm's throughput (sum of the live peers' rates)
    samples_per_second: float
    #: contributing peers (samples > 0) at that step
    contributors: int
    quorum: int
    #: when the reports were read (unix seconds)
    time: float
    #: peers at the step or past it that can serve their state (not clients), freshest report first
    sources: tuple[ID, ...] = ()
    #: peers at the step or one behind it (finishing the last one: they will be at it in a moment)
    peers_near_step: int = 0
    #: the mean of the live peers' reported losses (None when none reports one)
    loss: float | None = None
    #: auxiliary peers following the step (not among ``peers``): they join its round
    auxiliaries: int = 0

    @property
    def expected(self) -> int:
        """The group size a step's round should wait for (up to its gather time)."""
        return max(self.peers_at_step, self.peers_near_step) + self.auxiliaries

    @property
    def ready(self) -> bool:
        """Enough samples, from enough peers, for the step to happen."""
        return self.samples >= self.target and self.contributors >= self.quorum

    @property
    def eta(self) -> float:
        """Seconds until ``target`` at the swarm's current rate (inf when nobody computes)."""
        left = max(0, self.target - self.samples)
        if left == 0:
            return 0.0
        return left / self.samples_per_second if self.samples_per_second > 0 else math.inf


def valid(report: LocalProgress, now: float, expiration: float) -> bool:
    """Whether a report is believable at all (not its counts' size: those are capped)."""
    return (report.step >= 0 and report.samples >= 0 and report.previous >= 0 and math.isfinite(report.samples_per_second)
            and report.samples_per_second >= 0 and math.isfinite(report.time)
            and now - expiration <= report.time <= now + MAX_CLOCK_SKEW)


def merge_reports(known: Iterable[LocalProgress], read: Iterable[LocalProgress], now: float,
                  expiration: float) -> list[LocalProgress]:
    """The live reports after a read: each peer's newest of those known before and those read.

    A read can miss reports that are still live: a replica that did not answer in time, or, while
    the DHT forms, a traversal that reached only our own copy. In the GPU bench's synchronous run
    on a loaded CPU (1 run in about 12), a peer read the other's report once, then for three steps
    only its own or nothing. Each such read, folded alone, is a swarm of one whose quorum is 1: the
    peer stepped alone three times while the other waited, then took its state, and no round was
    measured. The DHT keeps a report until it expires whether a read finds it or not, so one kept
    until then is what a luckier read would have returned.

    A peer's report that it *left* is kept like any other: it is its newest, so it replaces what
    was known of the peer, and a later read that finds only an older copy (a replica that missed
    the last store) does not bring the peer back. Those who read drop it: :func:`present`.
    """
    newest: dict[ID, LocalProgress] = {}
    for r in (*known, *read):
        if valid(r, now, expiration) and (r.peer_id not in newest or  # at one time, its last word wins
                                          (r.time, r.left) > (newest[r.peer_id].time, newest[r.peer_id].left)):
            newest[r.peer_id] = r
    return list(newest.values())


def present(reports: Iterable[LocalProgress]) -> list[LocalProgress]:
    """The reports of the peers still in the run (not those whose last word is that they left)."""
    return [r for r in reports if not r.left]


def global_progress(reports: Iterable[LocalProgress], target: int, now: float, *, expiration: float = 60.0,
                    local_step: int | None = None, own: LocalProgress | None = None,
                    archives: Iterable[LocalProgress] = (), seen: int = 0) -> GlobalProgress:
    """Fold the live reports into the run's progress (the rules are in the module docstring).

    ``reports`` may hold the last words of peers that left (each peer's newest report counts, as
    :func:`merge_reports` keeps them): they no longer count, but an observer's read of a swarm
    they all left stays at the step they left it at. ``own``: this peer's latest report, counted
    when the DHT did not give it back (not stored yet, or no replica answered) or gave back an
    older one: a peer never reads a swarm without itself, nor itself as it was, and a peer alone
    still reaches its target. ``local_step``: our step, when we train and have not reported yet:
    an empty swarm reads as that step, nothing done (a trainer that joins a run its trainers left
    goes on from its own step, or from an archive ahead of it, never from a step nobody holds).
    Without one we only observe (a backbone; an auxiliary peer, which follows the step and holds
    none), and an empty swarm reads as the highest step a trainer left it at, or ``seen`` (the
    step we last read: the last words expire too), whichever is higher: a run every trainer left
    stays where they left it, not back at step 0.
    ``archives``: the reports of the archives this peer trusts (an archive among ``reports`` is
    nobody's word).
    """
    everyone = {r.peer_id: r for r in reports if valid(r, now, expiration) and not r.archive}
    if own is not None and not own.archive and valid(own, now, expiration) and (
            own.peer_id not in everyone or own.time >= everyone[own.peer_id].time):
        everyone[own.peer_id] = own  # the reads keep an older copy of ours until its expiry
    departed = [r.step for r in everyone.values() if r.left and not r.auxiliary]
    everyone = {r.peer_id: r for r in present(everyone.values())}  # their newest word: they left
    live = {k: r for k, r in everyone.items() if not r.auxiliary}  # the peers that train (and vote)
    n = len(live)
    quorum = min(QUORUM, max(n, 1))
    steps = sorted((r.step for r in live.values()), reverse=True)
    if not live:  # nobody trains: a trainer reads its own step, an observer the run where it was last seen
        steps = [local_step if local_step is not None else max([*departed, seen])]
    # the highest step that at least `quorum` peers report (every peer at a higher step also counts:
    # it went through this one); there are that many steps whenever there is one (quorum <= peers)
    step = steps[quorum - 1] if steps else 0
    kept = [a for a in archives if a.archive and not a.client and not a.left and valid(a, now, expiration)]
    best = max((a.step for a in kept), default=-1)
    behind = best > (steps[0] if steps else 0) + 1  # every live peer, by more than a step
    if behind:
        step = best
    at_step = [r for r in live.values() if r.step == step]
    samples = sum(min(r.samples, target) for r in at_step)
    rate = sum(min(r.samples_per_second, 1e12) for r in live.values())
    contributors = sum(1 for r in at_step if r.samples > 0)
    holders = kept if behind else [r for r in live.values() if r.serves_state]
    sources = tuple(r.peer_id for r in sorted(holders, key=lambda r: -r.time) if r.step >= step)
    near = sum(1 for r in live.values() if step - 1 <= r.step <= step)
    losses = [r.loss for r in live.values() if r.loss is not None and math.isfinite(r.loss)]
    loss = sum(losses) / len(losses) if losses else None
    auxiliaries = sum(1 for r in everyone.values() if r.auxiliary and step - 1 <= r.step <= step)
    return GlobalProgress(step, samples, target, len(at_step), n, rate, contributors, quorum, now, sources, near,
                          loss, auxiliaries)


class ProgressTracker:  # pragma: no mutate block (the DHT I/O: its tests are swarms, test_training)
    """Publishes this peer's progress and reads the swarm's, for one run.

    I/O only: what the reports mean is :func:`global_progress`'s.
    """

    def __init__(self, peer: Swarm, run_id: str, target: int, *, expiration: float = 60.0,
                 clock: Callable[[], float] = time.time, client: bool = False, auxiliary: bool = False,
                 sender: bool = False, archive: bool = False, trusted: Iterable[ID] = ()) -> None:
        if target <= 0:
            raise ValueError("the target batch size must be positive")
        self.peer = peer
        self.key = f"{run_id}.progress"
        self.target = target
        self.expiration = expiration
        self.clock = clock
        self.client = client
        self.auxiliary = auxiliary
        self.sender = sender
        #: we publish a saved state, not a trainer's progress (a backbone: the module docstring)
        self.archive = archive
        #: the archives whose reports we believe (the run's backbones)
        self.trusted = frozenset(trusted)
        #: our latest report, as we published it (or tried to)
        self.own: LocalProgress | None = None
        self.last: GlobalProgress | None = None
        #: the live, believable reports of the last read (``last`` is their fold), archives apart, of
        #: the peers still in the run
        self.reports: list[LocalProgress] = []
        #: the live reports of the trusted archives still served
        self.archives: list[LocalProgress] = []
        #: what :func:`merge_reports` keeps, the last words of peers that left included (they
        #: outweigh an older copy a later read may return)
        self._known: list[LocalProgress] = []
        self._known_archives: list[LocalProgress] = []

    async def report(self, step: int, samples: int, samples_per_second: float, *, loss: float | None = None,
                     previous: int = 0, timeout: float = 10.0) -> bool:
        """Publish our progress (best effort: False when no replica took it); ``previous``: the samples
        we brought to the round of ``step - 1``."""
        if loss is not None and not math.isfinite(loss):
            loss = None
        return await self._publish(LocalProgress(self.peer.peer_id, step, samples, samples_per_second, self.clock(),
                                                 self.client, loss, tuple(self.peer.addrs), self.auxiliary,
                                                 self.sender, previous, self.archive), timeout)

    async def leave(self, *, step: int | None = None, timeout: float = 5.0) -> bool:
        """Publish that we left the run (best effort: False when no replica took it), in place of our
        report: others stop counting us at once rather than when that report expires. It keeps the
        step we left the run at, and nothing more: ``step``, where the caller knows it (a trainer
        that took a step since its last report is past that report's step), else our last report's.
        An observer's read of a run every trainer left stays at the highest such step."""
        if step is None:
            step = self.own.step if self.own is not None else 0
        return await self._publish(LocalProgress(self.peer.peer_id, step, 0, 0.0, self.clock(), self.client,
                                                 archive=self.archive, left=True), timeout)

    async def _publish(self, mine: LocalProgress, timeout: float) -> bool:
        self.own = mine
        try:
            return await self.peer.dht.store(self.key, mine.to_wire(), mine.time + self.expiration,
                                             subkey=owned("progress", self.peer.peer_id), timeout=timeout)
        except (DedlocError, trio.TooSlowError) as e:
            log.debug("could not publish our %s: %s", "last word" if mine.left else "progress", e)
            return False

    async def fetch(self, *, local_step: int | None = None, timeout: float = 10.0) -> GlobalProgress:
        """Read every live report and fold them (:func:`global_progress`: an empty swarm reads as
        ``local_step``, our step when we train; without one we only observe, and it reads as the step
        its trainers left it at, or the step we last read)."""
        reports: list[LocalProgress] = []
        try:
            found = await self.peer.dht.get(self.key, latest=True, timeout=timeout)
        except (DedlocError, trio.TooSlowError) as e:
            log.debug("could not read the progress: %s", e)
            found = None
        if found is not None and isinstance(found.value, dict):
            for subkey, entry in found.value.items():
                if not isinstance(entry.value, bytes):
                    continue
                try:  # the DHT stored only what the subkey's owner signed
                    owner = owner_of(DHTKey.encode(subkey))
                    if owner is not None:
                        reports.append(LocalProgress.from_wire(owner, entry.value))
                except Exception as e:  # a stranger's garbage costs it only its entry
                    log.debug("skipping a malformed progress report: %r", e)
        now = self.clock()
        archives = [r for r in reports if r.archive and r.peer_id in self.trusted]
        reports = [r for r in reports if not r.archive]
        self._known_archives = merge_reports(self._known_archives, archives, now, self.expiration)
        self.archives = present(self._known_archives)
        self._known = merge_reports(self._known, reports, now, self.expiration)
        merged = present(self._known)
        kept = {r.peer_id for r in merged} - {r.peer_id for r in reports}
        if kept:  # by peer: the read may also hold expired or repeated entries
            log.debug("the progress read missed %d live reports of earlier reads; they count until they expire",
                      len(kept))
        self.reports = merged
        self.last = global_progress(self._known, self.target, now, expiration=self.expiration,
                                    local_step=local_step, own=self.own, archives=self.archives,
                                    seen=self.last.step if self.last is not None else 0)
        return self.last


__all__ = ["GlobalProgress", "LocalProgress", "ProgressTracker", "global_progress", "merge_reports", "present"]
