"""Group formation as a state table: looking, leading, following, fixed (sans-I/O).

:class:`Formation` is one peer's formation of one group: the rules of
:mod:`averaging.matchmaking`'s docstring, as transitions on events, with the
time passed in. It reads no DHT, calls no peer and waits for nothing: the
:class:`~averaging.matchmaking.Matchmaker` performs each :data:`Action` it
returns (read the declarations, ask a leader, wait, fix the group) and feeds
back what came of it. The ``avg.join`` handler asks :meth:`Formation.on_join`
what to answer a peer that asks us.

======================  ===========================================  ============================  =====================
phase                   event                                        condition                     next phase, action
======================  ===========================================  ============================  =====================
LOOKING                 declarations read                            no leader may be picked       LOOKING, Sleep(poll)
LOOKING                 declarations read                            the best leader is us         LEADING, (tick)
LOOKING                 declarations read                            the best leader is another    FOLLOWING, AskToJoin
LOOKING                 timer (slept)                                before the deadline           LOOKING, Read
LOOKING                 timer (slept), past the deadline                                           FAILED, Fail
FOLLOWING               join answered: joined                                                      FIXED, Done(group)
FOLLOWING               join answered: redirected to L               before the deadline           LOOKING, Read (L not skipped)
FOLLOWING               join answered: redirected to L               past the deadline             FAILED, Fail
FOLLOWING               join answered: refused (or the call broke    (skipped two polls)           LOOKING, Sleep(poll/2)
                        mid-way)
FOLLOWING               join answered: unreachable (no stream        (skipped while its            LOOKING, Sleep(poll/2)
                        could be opened)                             declaration lives)
LEADING                 tick                                         ready                         FIXED, Fix(members)
LEADING                 tick                                         deadline, a group possible    FIXED, Fix(members)
LEADING                 tick                                         deadline, no group            FAILED, Fail
LEADING                 tick                                         otherwise                     LEADING, AwaitJoins
LEADING                 woken (a join, or poll passed)               full with a reducer, or past  LEADING, (tick)
                                                                     the deadline
LEADING                 woken                                        otherwise                     LEADING, Read
LEADING                 declarations read                            a better leader L             LOOKING, HandOver(L)
LOOKING                 handed over                                  (as a timer)                  Read (L not skipped) / Fail
LEADING                 declarations read                            we still lead                 LEADING, (tick)
======================  ===========================================  ============================  =====================

Ready: a member that may reduce is in the group, and it has its capacity
(``target`` members, or up to ``min_size - 1`` more when the declarations last
read would leave that few behind, or all of the declared when those outside
our group could form none without us: :meth:`Formation.capacity`), or ``min_size``
once ``gather_time`` passed since we began leading (and, over ``target``, since
the group had ``target``).
"Refused" and "unreachable" leaders are skipped: refusals for two poll
intervals (a peer that was not leading a moment ago may lead now), an
unreachable leader while the declaration we saw lives (a killed leader's
declaration outlives it). A join whose call broke mid-way counts as refused, not
unreachable: the connection dropped while the leader held the join, and the
leader, live, would otherwise lead alone beside us until the deadline.

Joins asked of us (:meth:`Formation.on_join`):

=====================  ===================================  ===========================
phase                  condition                            answer
=====================  ===================================  ===========================
(any)                  another schema, or not forming       Reject("not matching now")
(between rounds)       the next formation begins within a   answered by it (the shell holds
                       poll interval                        the join; else Reject as above)
LOOKING                first ask                            Defer (answer once we know)
LOOKING                asked again                          Reject("not leading")
FOLLOWING              -                                    Redirect(our leader)
LEADING                the group is fixed or at capacity    Reject("group full")
LEADING                otherwise                            Admit (answer when it closes)
closed (after Admit)   in the group it closed with          Accept(group)
closed (after Admit)   it closed handing over to L          Redirect(L)
closed (after Admit)   otherwise                            Reject("the group formed without you")
LEADING (after Admit)  its call ended before the lead        (dropped from the followers:
                       closed (cancelled, connection lost)  :meth:`on_follower_gone`)
=====================  ===================================  ===========================
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from libp2p.peer.id import ID

from .group import Group, Member


class Phase(StrEnum):
    LOOKING = "looking"
    LEADING = "leading"
    FOLLOWING = "following"
    FIXED = "fixed"
    FAILED = "failed"


@dataclass(frozen=True)
class FormationRules:
    """The settings the table reads (:class:`~averaging.matchmaking.MatchmakingConfig`'s, and this
    formation's target)."""

    target: int
    min_size: int
    gather_time: float
    poll_interval: float
    #: take up to ``min_size - 1`` more than ``target`` rather than leave that few alone
    #: (:meth:`Formation.capacity`); off where the caller said how many come: that group is fixed at once
    absorb_remainder: bool = True


# ---------------------------------------------------------------------------- what came of a join we asked


@dataclass(frozen=True)
class Joined:
    group: Group


@dataclass(frozen=True)
class Redirected:
    leader: ID


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Unreachable:
    reason: str


JoinOutcome = Joined | Redirected | Refused | Unreachable


# ---------------------------------------------------------------------------- actions for the shell


@dataclass(frozen=True)
class Read:
    """Read the live declarations, then :meth:`Formation.on_declarations`."""


@dataclass(frozen=True)
class Sleep:
    """Wait ``seconds``, then :meth:`Formation.on_timer`."""

    seconds: float


@dataclass(frozen=True)
class AskToJoin:
    """Ask ``leader`` to join its group (at its declared addresses), then :meth:`Formation.on_join_answered`."""

    leader: Member


@dataclass(frozen=True)
class AwaitJoins:
    """Leading: wait for a join, at most ``seconds``, then :meth:`Formation.on_woken`."""

    seconds: float


@dataclass(frozen=True)
class HandOver:
    """Leading no longer: tell the waiting followers to go to ``leader``; then read again."""

    leader: ID


@dataclass(frozen=True)
class Fix:
    """Fix the group of ``members`` (sorted by peer id; we are among them), then :meth:`Formation.fixed`."""

    members: tuple[Member, ...]


@dataclass(frozen=True)
class Done:
    group: Group


@dataclass(frozen=True)
class Fail:
    """No group by the deadline."""


Action = Read | Sleep | AskToJoin | AwaitJoins | HandOver | Fix | Done | Fail


# ---------------------------------------------------------------------------- answers to a join asked of us


@dataclass(frozen=True)
class Defer:
    """We are between two reads: answer once we lead or follow (:meth:`Formation.on_join` again)."""


@dataclass(frozen=True)
class Admit:
    """A follower now: answer with :func:`answer_admitted` once the lead closed."""


@dataclass(frozen=True)
class Accept:
    group: Group


@dataclass(frozen=True)
class Redirect:
    leader: ID


@dataclass(frozen=True)
class Reject:
    reason: str


JoinAnswer = Defer | Admit | Accept | Redirect | Reject


#: While a formation lasts, a declaration that some replica took is stored again this often (s).
REDECLARE_INTERVAL = 5.0
#: ... and one that no replica took yet, at the next poll, but not sooner than this (s), then
#: twice as long after each store that failed again (up to :data:`REDECLARE_INTERVAL`).
REDECLARE_RETRY_MIN = 1.0


def redeclare_after(stored: bool, poll_interval: float, failed: int = 1) -> float:
    """Seconds until the shell stores our declaration again, while the formation lasts.

    ``stored``: whether some store of this declaration reached a replica; ``failed``: how many
    stores of it in a row reached none. One that reached none (every replica's reply past the
    store's timeout) left us invisible: nobody could pick us, and we led alone until the
    deadline; it is tried again at the next poll, no sooner than a second and twice as long
    after each further failure (a loaded swarm is not loaded more), up to the interval below.
    One that did is stored again every :data:`REDECLARE_INTERVAL`: a store made while the swarm
    was loaded kept only the replicas that answered in time, not the key's closest servers, and
    the readers' lookups, once the load passed, asked those closest ones and never found it. The
    record is the same (same expiration), so a replica already holding it answers "stale".
    Sixteen Moshpit peers in one process beside three CPU hogs: 14 of 16 first stores reached no
    replica, reads found 1-2 of each cell's 4 for the whole 60 s, and 4 of 5 runs failed.
    """
    if stored:
        return REDECLARE_INTERVAL
    return min(REDECLARE_INTERVAL, max(REDECLARE_RETRY_MIN, poll_interval) * 2.0 ** max(0, failed - 1))


@dataclass(frozen=True)
class Declaring:
    """What :func:`redeclare_after` reads of our declaration's stores while a formation lasts, kept
    alike by the Matchmaker and the simulator's twin: whether one reached a replica, and how many in a
    row reached none. The formation's first store is ``Declaring().then(took)``."""

    stored: bool = False
    failed: int = 0

    def then(self, took: bool) -> Declaring:
        """After a store that some replica took (``took``) or none did."""
        return Declaring(self.stored or took, 0 if took else self.failed + 1)

    def wait(self, poll_interval: float) -> float:
        """Seconds until the next store (:func:`redeclare_after`)."""
        return redeclare_after(self.stored, poll_interval, self.failed)


def leader_rank(member: Member) -> tuple[int, bytes]:
    """Lower leads: peers that reduce and are directly reachable, then the other directly
    reachable ones, then relayed ones; then by peer id.

    A peer's role says what its addresses cannot: a peer behind a NAT also lists its LAN
    address, so "not only relayed addresses" let a symmetric-NAT peer (a sender, reached only
    through a relay) lead whenever its id sorted first, and every join went through the relay.
    """
    relayed_only = all("p2p-circuit" in str(a) for a in member.addrs)
    tier = 2 if relayed_only else 0 if member.role.reduces else 1
    return (tier, member.peer_id.to_bytes())


@dataclass
class Formation:
    """One peer's formation of one group, from its declaration ``me`` until ``deadline``."""

    me: Member
    rules: FormationRules
    deadline: float
    #: leaders we could not reach, with the expiration of the declaration they had then: skipped
    #: until they declare anew (the matchmaker's, kept across formations)
    unreachable: dict[ID, float] = field(default_factory=dict)
    phase: Phase = Phase.LOOKING
    #: leaders that turned us away, and until when we skip them
    refused: dict[ID, float] = field(default_factory=dict)
    #: the leader we ask (FOLLOWING), with its declaration
    following: Member | None = None
    #: LEADING: since when, and the followers admitted
    leading_since: float = 0.0
    followers: dict[ID, Member] = field(default_factory=dict)
    #: the leader our followers were handed over to (their answer), while they wait
    redirect: ID | None = None
    group: Group | None = None
    #: what the last read before leading or following showed (for the failure message)
    last_seen: int = 0
    reducers_seen: bool = False
    #: LEADING: the peers known to be declared (the last read's, our followers, and whoever asked
    #: to join since: its declaration may not have reached the replicas we read)
    declared: dict[ID, Member] = field(default_factory=dict)
    #: LEADING: when the group first had ``target`` members (a wait for stranded peers counts from it)
    full_since: float | None = None

    # ------------------------------------------------------------------ looking and following

    def start(self, now: float) -> Action:
        return Read() if now < self.deadline else self._fail()

    def on_declarations(self, candidates: Iterable[Member], now: float) -> Action:
        """The live declarations under our key with our schema (ourselves included)."""
        # a leader we could not reach is skipped while the declaration we saw then lives (a killed
        # leader's outlives it, and drew followers, and leaders handing theirs over, back to it)
        candidates = [m for m in candidates
                      if m.peer_id == self.me.peer_id or self.unreachable.get(m.peer_id) != m.expiration]
        if self.phase is Phase.LEADING:
            return self._check_leader(candidates, now)
        self.last_seen = len(candidates)
        self.reducers_seen = self.reducers_seen or any(m.role.reduces for m in candidates)
        leaders = sorted((m for m in candidates if m.accepts_joins and self._may_lead(m, now)), key=leader_rank)
        if not leaders:
            return Sleep(self.rules.poll_interval)
        leader = leaders[0]
        if leader.peer_id == self.me.peer_id:
            self.phase = Phase.LEADING
            self.leading_since = now
            self.followers = {}
            self.redirect = None
            self.declared = {m.peer_id: m for m in candidates}
            self.full_since = None
            return self.on_tick(now)
        self.phase = Phase.FOLLOWING
        self.following = leader
        return AskToJoin(leader)

    def _may_lead(self, member: Member, now: float) -> bool:
        """Not skipped: we are always our own candidate; a leader that refused us is skipped for a while."""
        return member.peer_id == self.me.peer_id or self.refused.get(member.peer_id, 0.0) <= now

    def on_timer(self, now: float) -> Action:
        """A :class:`Sleep` ended."""
        return Read() if now < self.deadline else self._fail()

    def on_join_answered(self, outcome: JoinOutcome, now: float) -> Action:
        """What the leader we asked answered (or that it could not be asked)."""
        assert self.phase is Phase.FOLLOWING and self.following is not None
        leader = self.following
        self.following = None
        if isinstance(outcome, Joined):
            self.phase = Phase.FIXED
            self.group = outcome.group
            return Done(outcome.group)
        self.phase = Phase.LOOKING
        self.refused[leader.peer_id] = now + 2 * self.rules.poll_interval
        if isinstance(outcome, Redirected):
            self.refused.pop(outcome.leader, None)
            return Read() if now < self.deadline else self._fail()
        if isinstance(outcome, Unreachable):
            self.unreachable[leader.peer_id] = leader.expiration
        return Sleep(self.rules.poll_interval / 2)

    # ------------------------------------------------------------------ leading

    def capacity(self) -> int:
        """How many members our group takes: ``target``, or more where the peers known to be
        declared would leave some behind who cannot form a group of their own.

        * Up to ``min_size - 1`` more when the declared would leave that few behind. The scale
          simulation (bench/scale.py) found every peer left without a group at 1,000 peers in a
          Moshpit cell of m + 1: ten formed a full group and the eleventh failed alone each round.
        * Every declared peer when those outside our group are *stranded*: none of them can lead
          (accepts joins) or none may reduce, so only our group can take them. In the same
          simulation, most of the peers still left without a group were two or three senders
          (behind NATs, reached through relays) of a cell of 12 or 13 whose leader filled its group
          of ten with others, and the senders, who can neither lead nor reduce, failed at the deadline.
        """
        target = self.rules.target
        declared = len(self.declared)
        if not self.rules.absorb_remainder or declared <= target:
            return target
        if not self._others_could_form():
            return declared
        left = declared % target
        return target + left if left < self.rules.min_size else target

    def _others_could_form(self) -> bool:
        """Whether the declared peers outside our group could form a group without us: enough of
        them, one that accepts joins (to lead) and one that may reduce."""
        me = self.me.peer_id
        outside = [m for m in self.declared.values() if m.peer_id != me and m.peer_id not in self.followers]
        return (len(outside) >= self.rules.min_size and any(m.accepts_joins for m in outside)
                and any(m.role.reduces for m in outside))

    def ready(self, now: float) -> bool:
        """A member that may reduce is in, and the group is at capacity, or at ``min_size`` once
        ``gather_time`` passed since we began leading; over ``target`` (so waiting for peers only
        we can take), once ``gather_time`` passed since it was full too."""
        size = 1 + len(self.followers)
        if not self._reducer() or size < self.rules.min_size:
            return False
        if size >= self.capacity():
            return True
        if size >= self.rules.target and self.full_since is not None and now - self.full_since < self.rules.gather_time:
            return False
        return now - self.leading_since >= self.rules.gather_time

    def _note_full(self, now: float) -> None:
        if self.full_since is None and 1 + len(self.followers) >= self.rules.target:
            self.full_since = now

    def on_tick(self, now: float) -> Action:
        """Leading: fix the group if it is ready (or the deadline came with one possible), else wait."""
        assert self.phase is Phase.LEADING
        self._note_full(now)
        if self.ready(now):
            return self._fix()
        if now >= self.deadline:
            if 1 + len(self.followers) >= self.rules.min_size and self._reducer():
                return self._fix()
            return self._fail()
        return AwaitJoins(min(self.rules.poll_interval, self.deadline - now))

    def on_woken(self, now: float) -> Action:
        """Leading: a join arrived or the wait ended: a full group with a member that may reduce is
        fixed, else the declarations are read again (is there a better leader now?).

        A group full of senders reads too: two trainers that may not reduce filled their group of
        two and waited there for the deadline, never reading again, while the auxiliary peer that
        came to reduce for them led alone beside them (the auxiliary test, delayed updates, 1 run
        in 10 under load: the trainers' round began before the auxiliary's report said its step).
        """
        assert self.phase is Phase.LEADING
        self._note_full(now)
        if (1 + len(self.followers) >= self.capacity() and self._reducer()) or now >= self.deadline:
            return self.on_tick(now)
        return Read()

    def _check_leader(self, candidates: list[Member], now: float) -> Action:
        self.declared = {**{m.peer_id: m for m in candidates}, **self.followers, self.me.peer_id: self.me}
        others = sorted((m for m in candidates if m.accepts_joins), key=leader_rank)
        if others and others[0].peer_id != self.me.peer_id:
            # hand the followers over rather than split the swarm, and follow them there even if
            # that leader turned us away a moment ago (else we lead alone till the deadline)
            self.phase = Phase.LOOKING
            self.redirect = others[0].peer_id
            self.refused.pop(others[0].peer_id, None)
            return HandOver(others[0].peer_id)
        return self.on_tick(now)

    def _fix(self) -> Fix:
        members = sorted([self.me, *list(self.followers.values())[: self.capacity() - 1]],
                         key=lambda m: m.peer_id.to_bytes())
        return Fix(tuple(members))

    def fixed(self, group: Group) -> Done:
        """The shell built the group of a :class:`Fix` (with its random id)."""
        self.phase = Phase.FIXED
        self.group = group
        return Done(group)

    def _reducer(self) -> bool:
        return self.me.role.reduces or any(m.role.reduces for m in self.followers.values())

    def _fail(self) -> Fail:
        self.phase = Phase.FAILED
        return Fail()

    # ------------------------------------------------------------------ joins asked of us

    def on_join(self, member: Member, *, asked_again: bool = False) -> JoinAnswer:
        """What to answer ``member`` (already checked to be the caller's own declaration)."""
        if member.schema != self.me.schema or self.phase is Phase.FAILED:
            return Reject("not matching now")
        if self.phase is Phase.LOOKING:
            if not asked_again:
                # Between two reads of the declarations we pick a leader within moments (often
                # ourselves: the joiner picked us). Answering "not leading" at once made the joiner
                # skip us for a while, and it missed the group we formed a moment later.
                return Defer()
            return Reject("not leading")
        if self.phase is Phase.FOLLOWING:
            assert self.following is not None
            return Redirect(self.following.peer_id)
        if self.phase is Phase.LEADING:
            self.declared[member.peer_id] = member
        if self.phase is Phase.FIXED or 1 + len(self.followers) >= self.capacity():
            return Reject("group full")
        self.followers[member.peer_id] = member
        return Admit()

    def on_follower_gone(self, member: Member) -> None:
        """The join call of a follower we admitted ended before the group was fixed (it was
        cancelled, or its connection dropped): it is no follower any more, unless it has joined
        again since (a new declaration of it stands)."""
        if self.phase is Phase.LEADING and self.followers.get(member.peer_id) is member:
            del self.followers[member.peer_id]

    def failure(self, key: str, timeout: float) -> str:
        """Why no group formed (the :class:`~averaging.errors.MatchmakingError`'s message)."""
        return (f"no group of at least {self.rules.min_size} formed under {key!r} within {timeout:.0f} s "
                f"({self.last_seen} matching peers declared"
                + ("" if self.me.accepts_joins or self.last_seen > 1 else "; this peer cannot lead and no other can")
                + ("" if self.reducers_seen or self.last_seen == 0 else "; none of them may reduce a part (all "
                   "senders: client mode, relayed, or reduces=False)") + ")")


def answer_admitted(member: Member, group: Group | None, redirect: ID | None) -> JoinAnswer:
    """The answer to a follower we admitted, once that lead closed: with the group it closed with,
    or the leader it handed its followers over to."""
    if group is not None and group.index_of(member.peer_id) is not None:
        return Accept(group)
    if group is None and redirect is not None:
        return Redirect(redirect)
    return Reject("the group formed without you")


__all__ = ["Accept", "Action", "Admit", "AskToJoin", "AwaitJoins", "Declaring", "Defer", "Done", "Fail", "Fix",
           "Formation",
           "FormationRules", "HandOver", "JoinAnswer", "JoinOutcome", "Joined", "Phase", "Read", "Redirect",
           "Redirected", "Refused", "Reject", "Sleep", "Unreachable", "answer_admitted", "leader_rank",
           "redeclare_after"]
