"""Group formation over the DHT: declare, pick the leader everyone picks, join it.

Every peer that wants to average under a run prefix stores a
:class:`~averaging.group.Member` declaration in the DHT under
``<prefix>.matchmaking``, in a subkey only it may write (signed), expiring
with its matchmaking deadline, and stores it again while it looks
(:func:`~averaging.formation.redeclare_after`: a store under load can reach no
replica, or replicas no later read asks). Then, until the deadline:

1. it reads all live declarations with its own match key (tensor schema and
   round settings); peers that declared something else are never matched;
2. it picks the leader: among the declared peers that accept joins (others
   can dial them), the one with the lowest (tier, peer id): reducers before
   senders before peers with relayed addresses only (:func:`leader_rank`),
   skipping those that turned it away this time;
3. if that is itself, it leads: it accepts joins (the ``avg.join`` RPC) until
   the group has ``target_size`` members (up to ``min_size - 1`` more when the
   declarations it read would leave that few alone, too few for a group; all of
   them when those left could form no group without it: none can lead, or none
   may reduce), or has ``min_size`` and ``gather_time`` passed; then it fixes the group (members sorted by peer id,
   a random group id) and answers every waiting join with it;
4. otherwise it asks the leader to join and waits for the group (or a
   redirect to another leader, or a refusal, after which it looks again).

A group needs at least one member that may reduce; a leader waits for one.

Peers that see the same declarations pick the same leader; when views differ
for a moment, a leader that learns of a better one hands its followers over
(REDIRECT). Only the members in the group take part in the round: a reducer
refuses streams from anyone else. A client-mode peer never leads; if nobody
that accepts joins is there, matchmaking ends with a clear error at the
deadline. The caller's tensors are never touched here.

The rules are a state table, :mod:`averaging.formation` (pure: looking, leading,
following, fixed; time passed in). :class:`Matchmaker` is its shell: it
declares, reads the DHT, calls leaders, serves ``avg.join`` and waits, as the
table's actions say.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID

from nat import Swarm
from p2p.dht import ValueWithExpiration, owned
from p2p.errors import ConfigError, DedlocError
from p2p.hooks import Registration
from p2p.rpc import CallContext, PeerUnreachableError
from p2p.trio_util import unwrap_single_group
from p2p.untrusted import decode_peer_id

from .errors import AllreduceProtocolError, MatchmakingError
from .formation import (Accept, Action, Admit, AskToJoin, AwaitJoins, Declaring, Defer, Done, Fail, Fix,
                        Formation, FormationRules, HandOver, JoinAnswer, Joined, JoinOutcome, Phase, Read, Redirect,
                        Redirected, Refused, Reject, Sleep, Unreachable, answer_admitted, leader_rank)
from .group import Group, Member
from .proto import averaging_pb2 as pb

log = logging.getLogger(__name__)

JOIN_METHOD = "avg.join"


@dataclass(frozen=True)
class MatchmakingConfig:
    """``target_size``: members wanted (a group takes up to ``min_size - 1`` more rather than leave
    that few alone, and every declared peer that no other group could take); ``min_size``: fewest to start with;
    ``gather_time``: how long a leader waits for more once ``min_size`` joined;
    ``timeout``: the matchmaking deadline; ``poll_interval``: how often the
    DHT is read again while looking for a leader."""

    target_size: int = 16
    min_size: int = 2
    gather_time: float = 3.0
    timeout: float = 30.0
    poll_interval: float = 0.5

    def validate(self) -> None:
        if not 1 <= self.min_size <= self.target_size:
            raise ConfigError("need 1 <= min_size <= target_size")
        if not (self.timeout > 0 and self.gather_time >= 0 and self.poll_interval > 0):
            raise ConfigError("matchmaking times must be positive")


#: How long a leader that fixed its group waits for its followers' join calls to be answered.
ANSWER_WAIT = 0.2
#: Then how long it lets the RPC layer write those answers before its own CPU-bound start.
ANSWER_FLUSH = 0.005


class _Lead:
    """One stretch of leading, as the shell sees it: the followers waiting in ``avg.join`` and how
    the lead closed (its group, or the leader the followers were handed over to)."""

    def __init__(self) -> None:
        self.changed = trio.Event()
        self.closed = trio.Event()
        self.group: Group | None = None
        self.redirect: ID | None = None
        #: followers whose join call has not been answered yet
        self.waiting = 0
        self.answered = trio.Event()

    def poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def close(self, group: Group | None, redirect: ID | None) -> None:
        if not self.closed.is_set():
            self.group, self.redirect = group, redirect
            self.closed.set()


class Matchmaker:
    """Forms groups for one run prefix on one peer; registered on its RPC while open."""

    def __init__(self, peer: Swarm, prefix: str, config: MatchmakingConfig,
                 clock: Callable[[], float] = time.time) -> None:
        config.validate()
        self.peer = peer
        self.prefix = prefix
        self.config = config
        self.clock = clock
        self.key = f"{prefix}.matchmaking"
        self._key = self.key  # the key of the formation under way (a Moshpit cell's, or the run's)
        self._declared: tuple[str, float] | None = None  # the key and expiration of our last declaration
        #: the formation under way (None between rounds), and the lead while it leads
        self._formation: Formation | None = None
        self._lead: _Lead | None = None
        self._moved = trio.Event()  # set (and replaced) whenever the formation changes phase
        #: peers we could not reach, with the expiration of the declaration they had then: skipped until
        #: they declare anew. A killed leader's declaration outlives it; retried every second, it drew
        #: its would-be followers (and leaders handing theirs over) back to it until the deadline.
        self._unreachable: dict[ID, float] = {}

    # ------------------------------------------------------------------ lifecycle

    def install(self) -> Registration:
        """Serve ``avg.join`` until the registration is removed."""
        rpc = self.peer.rpc
        rpc.add_unary(f"{JOIN_METHOD}.{self.prefix}", pb.JoinRequest, self._on_join)
        return Registration(lambda: rpc.remove(f"{JOIN_METHOD}.{self.prefix}"))

    # ------------------------------------------------------------------ looking for a group

    async def form_group(self, me: Member, cell: str = "", *, expected: int | None = None) -> Group:
        """A group containing ``me``, or :class:`MatchmakingError` at the deadline.

        ``cell``: meet only peers declared under the same one (a Moshpit group
        key, :mod:`averaging.moshpit`); '' is the whole run. ``expected``: how many
        peers the caller knows will come (a training step's): a group this size
        is fixed at once, without waiting out ``gather_time`` (clamped to
        ``min_size..target_size``).
        """
        target = self.config.target_size if expected is None else \
            max(self.config.min_size, min(self.config.target_size, expected))
        deadline = trio.current_time() + self.config.timeout
        key = self._key = f"{self.key}.{cell}" if cell else self.key
        declared = Member(me.peer_id, me.addrs, me.role, me.schema, me.upload, me.download, me.compute,
                          me.accepts_joins, self.clock() + self.config.timeout + 5.0)
        self._declared = (key, declared.expiration)
        stored = await self._store(key, declared)
        rules = FormationRules(target, self.config.min_size, self.config.gather_time, self.config.poll_interval,
                               absorb_remainder=expected is None)
        formation = self._formation = Formation(declared, rules, deadline, self._unreachable)
        self._move()  # a join held between two rounds is answered by this formation now
        try:
            with unwrap_single_group():  # a MatchmakingError reaches the caller as itself
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._keep_declared, key, declared, stored)
                    try:
                        return await self._form(formation, key)
                    finally:
                        nursery.cancel_scope.cancel()
        finally:
            self._formation = None
            self._close_lead(None, None)
            self._move()

    async def _form(self, formation: Formation, key: str) -> Group:
        action = formation.start(trio.current_time())
        while True:
            action = await self._perform(formation, action)
            self._move()
            if isinstance(action, Done):
                return action.group
            if isinstance(action, Fail):
                raise MatchmakingError(formation.failure(key, self.config.timeout))

    async def _store(self, key: str, declared: Member) -> bool:
        """Store our declaration under ``key``: whether some replica took it (:meth:`p2p.dht.DHT.store`)."""
        return await self.peer.dht.store(key, declared.to_wire().SerializeToString(), declared.expiration,
                                         subkey=owned("member", declared.peer_id),
                                         timeout=min(10.0, self.config.timeout))

    async def _keep_declared(self, key: str, declared: Member, stored: bool) -> None:
        """Store our declaration again while the formation lasts (:func:`~averaging.formation.redeclare_after`
        says when and why); cancelled when it ends. A failed store is only logged: the next one may pass."""
        declaring = Declaring().then(stored)
        while True:
            await trio.sleep(declaring.wait(self.config.poll_interval))
            took = False
            try:
                took = await self._store(key, declared)
            except (DedlocError, trio.TooSlowError) as e:
                log.debug("could not store our declaration again: %s", e)
            declaring = declaring.then(took)

    async def _perform(self, formation: Formation, action: Action) -> Action:
        """Do what the table said; the table's next action."""
        log.debug("matchmaking %s: %s", formation.phase, action)
        if isinstance(action, Read):
            candidates = await self._candidates(formation)
            led = formation.phase is Phase.LEADING
            action = formation.on_declarations(candidates, trio.current_time())
            if formation.phase is Phase.LEADING and not led:
                self._lead = _Lead()
            return action
        if isinstance(action, Sleep):
            await trio.sleep(action.seconds)
            return formation.on_timer(trio.current_time())
        if isinstance(action, AskToJoin):
            outcome = await self._join(formation, action.leader)
            return formation.on_join_answered(outcome, trio.current_time())
        if isinstance(action, AwaitJoins):
            assert self._lead is not None
            with trio.move_on_after(max(0.0, action.seconds)):
                await self._lead.changed.wait()
            return formation.on_woken(trio.current_time())
        if isinstance(action, HandOver):
            log.debug("handing %d followers over to %s", len(formation.followers), action.leader)
            self._close_lead(None, action.leader)
            return formation.on_timer(trio.current_time())
        if isinstance(action, Fix):
            return await self._fix_group(formation, action.members)
        return action  # Done, Fail: the loop ends (form_group's finally closes a lead)

    def _close_lead(self, group: Group | None, redirect: ID | None) -> None:
        if self._lead is not None:
            self._lead.close(group, redirect)
            self._lead = None

    def take_declaration(self) -> tuple[str, float] | None:
        """The key and expiration of our last declaration, once (then None): what :meth:`withdraw` takes."""
        declared, self._declared = self._declared, None
        return declared

    async def withdraw(self, declared: tuple[str, float] | None, timeout: float = 5.0) -> None:
        """Replace the declaration ``declared`` with an empty one, so nobody tries to join a peer that has its group.

        A DHT entry cannot be shortened (the newer expiration wins), so the
        empty value goes in with an expiration just after the declaration's;
        readers skip it, and a newer declaration (a later round) outlives it.
        Best effort: a failure only leaves a stale entry that expires by itself.
        """
        if declared is None:
            return
        key, expiration = declared
        try:
            await self.peer.dht.store(key, b"", expiration + 0.001, subkey=owned("member", self.peer.peer_id),
                                      timeout=timeout)
        except (DedlocError, trio.TooSlowError) as e:
            log.debug("could not withdraw the declaration under %s: %s", key, e)

    def _move(self) -> None:
        self._moved.set()
        self._moved = trio.Event()

    async def _candidates(self, formation: Formation) -> list[Member]:
        """Live declarations under this formation's key with our match key, ourselves included."""
        found = await self.peer.dht.get(self._key, latest=True,
                                        timeout=max(0.5, min(5.0, formation.deadline - trio.current_time())))
        now = self.clock()
        forget_expired(self._unreachable, now)
        return declared_members(found, formation.me, now)

    async def _join(self, formation: Formation, declared: Member) -> JoinOutcome:
        """Ask the leader ``declared`` to let us join (at its declared addresses: a relayed leader is
        known nowhere else)."""
        leader = declared.peer_id
        self.peer.add_addrs(leader, list(declared.addrs))
        try:
            response = await self.peer.rpc.call(
                leader, f"{JOIN_METHOD}.{self.prefix}",
                pb.JoinRequest(prefix=self.prefix, declaration=formation.me.to_wire()), pb.JoinResponse,
                timeout=max(0.5, formation.deadline - trio.current_time()))
        except DedlocError as e:
            log.debug("join %s failed: %s", leader, e)
            if isinstance(e, (PeerUnreachableError, ConnectionError)):  # gone, or never reached
                return Unreachable(str(e))
            # A call that broke mid-way (the connection dropped while the leader held our join)
            # says nothing of whether the leader can be reached: asked again after the pause.
            return Refused(str(e))
        log.debug("join %s: %s %s", leader, pb.JoinResponse.Status.Name(response.status), response.reason)
        if response.status == pb.JoinResponse.ACCEPTED:
            try:
                return Joined(Group.from_wire(response.group, formation.me.peer_id))
            except AllreduceProtocolError as e:
                log.warning("leader %s sent an unusable group: %s", leader, e)
                return Refused(f"an unusable group: {e}")
        if response.status == pb.JoinResponse.REDIRECT:
            redirect = decode_peer_id(bytes(response.leader))  # ID() itself takes any bytes
            return Refused("a redirect to no peer") if redirect is None else Redirected(redirect)
        return Refused(response.reason)

    # ------------------------------------------------------------------ leading

    async def _fix_group(self, formation: Formation, members: tuple[Member, ...]) -> Done:
        """Fix the group and answer the followers before the leader goes on.

        The leader's next steps (flattening, the load-balancing LP) are CPU
        work without checkpoints: answering after them started every follower's
        round 50-70 ms after the leader's (4 peers, 40 MB).
        """
        group = Group(os.urandom(16), members, [m.peer_id for m in members].index(formation.me.peer_id))
        done = formation.fixed(group)
        lead = self._lead
        self._close_lead(group, None)
        if lead is not None:
            with trio.move_on_after(ANSWER_WAIT):
                while lead.waiting:
                    await lead.answered.wait()
        # The RPC layer writes the answers over several checkpoints; a few
        # milliseconds of this loop let it finish before the leader computes.
        await trio.sleep(ANSWER_FLUSH)
        log.debug("fixed group %s of %d", group.group_id.hex()[:8], len(members))
        return done

    async def _on_join(self, request: pb.JoinRequest, ctx: CallContext) -> pb.JoinResponse:
        try:
            member = Member.from_wire(request.declaration)
        except AllreduceProtocolError as e:
            return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason=str(e))
        if member.peer_id != ctx.peer_id:
            return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason="a declaration of another peer")
        if self._formation is None:
            # Between two rounds (our declaration for the next one may already be read, or the last
            # one's not yet withdrawn): wait a poll interval for our next formation. Turned away
            # at once, the joiner skipped us for two polls and led alone, and the group we formed
            # a moment later left it out for the round (the reliability bench: one peer of six
            # failing its step now and then, the other five averaging).
            with trio.move_on_after(self.config.poll_interval):
                while self._formation is None:
                    await self._moved.wait()
        formation = self._formation
        answer: JoinAnswer = Reject("not matching now") if formation is None else formation.on_join(member)
        if isinstance(answer, Defer):
            # answer once we lead or follow (within a poll interval)
            with trio.move_on_after(self.config.poll_interval):
                while self._formation is formation and formation is not None and formation.phase is Phase.LOOKING:
                    await self._moved.wait()
            formation = self._formation
            answer = Reject("not matching now") if formation is None else formation.on_join(member, asked_again=True)
        if isinstance(answer, Admit):
            lead = self._lead
            assert lead is not None
            lead.poke()
            lead.waiting += 1
            try:
                await lead.closed.wait()
            finally:
                lead.waiting -= 1
                if not lead.waiting:
                    lead.answered.set()
                if not lead.closed.is_set() and formation is not None:
                    # the call broke (the joiner cancelled, its connection dropped) before the group
                    # was fixed: a group fixed with it would wait for it and end partial
                    formation.on_follower_gone(member)
            answer = answer_admitted(member, lead.group, lead.redirect)
        return _response(answer)


def forget_expired(unreachable: dict[ID, float], now: float) -> None:
    """Drop the unreachable leaders whose declaration (as seen then) has expired: they may be back."""
    for peer, expiration in list(unreachable.items()):
        if expiration <= now:
            del unreachable[peer]


def declared_members(found: ValueWithExpiration | None, me: Member, now: float) -> list[Member]:
    """The live declarations in a read of a formation's key that share ``me``'s match key, ``me``
    included: withdrawn (empty) entries skipped, and a peer's garbage costs it only its entry."""
    members: dict[ID, Member] = {me.peer_id: me}
    if found is not None and isinstance(found.value, dict):
        for entry in found.value.values():
            if not isinstance(entry.value, bytes) or not entry.value:
                continue  # not ours to read, or withdrawn
            try:
                msg = pb.Declaration()
                msg.ParseFromString(entry.value)
                member = Member.from_wire(msg)
            except Exception as e:
                log.debug("skipping a malformed declaration: %r", e)
                continue
            if member.schema == me.schema and member.expiration > now:
                members.setdefault(member.peer_id, member)
    return list(members.values())


def _response(answer: JoinAnswer) -> pb.JoinResponse:
    if isinstance(answer, Accept):
        return pb.JoinResponse(status=pb.JoinResponse.ACCEPTED, group=answer.group.to_wire())
    if isinstance(answer, Redirect):
        return pb.JoinResponse(status=pb.JoinResponse.REDIRECT, leader=answer.leader.to_bytes())
    assert isinstance(answer, Reject)
    return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason=answer.reason)
