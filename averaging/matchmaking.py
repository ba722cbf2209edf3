"""Group formation over the DHT: declare, pick the leader everyone picks, join it.

Every peer that wants to average under a run prefix stores a
:class:`~averaging.group.Member` declaration in the DHT under
``<prefix>.matchmaking``, in a subkey only it may write (signed), expiring
with its matchmaking deadline. Then, until the deadline:

1. it reads all live declarations with its own match key (tensor schema and
   round settings); peers that declared something else are never matched;
2. it picks the leader: among the declared peers that accept joins (others
   can dial them), the one with the lowest (tier, peer id): reducers before
   senders before peers with relayed addresses only (:func:`leader_rank`),
   skipping those that turned it away this time;
3. if that is itself, it leads: it accepts joins (the ``avg.join`` RPC) until
   the group has ``target_size`` members, or has ``min_size`` and
   ``gather_time`` passed; then it fixes the group (members sorted by peer id,
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
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID

from nat import Peer
from p2p.dht import owned
from p2p.errors import DedlocError
from p2p.rpc import CallContext, PeerDisconnectedError

from .errors import AllreduceProtocolError, MatchmakingError
from .group import Group, Member
from .proto import averaging_pb2 as pb

log = logging.getLogger(__name__)

JOIN_METHOD = "avg.join"


@dataclass(frozen=True)
class MatchmakingConfig:
    """``target_size``: members wanted; ``min_size``: fewest to start with;
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
            raise ValueError("need 1 <= min_size <= target_size")
        if not (self.timeout > 0 and self.gather_time >= 0 and self.poll_interval > 0):
            raise ValueError("matchmaking times must be positive")


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


#: How long a leader that fixed its group waits for its followers' join calls to be answered.
ANSWER_WAIT = 0.2
#: Then how long it lets the RPC layer write those answers before its own CPU-bound start.
ANSWER_FLUSH = 0.005


class _Lead:
    """What this peer holds while it leads: the followers waiting in ``avg.join``."""

    def __init__(self) -> None:
        self.followers: dict[ID, Member] = {}
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


class Matchmaker:
    """Forms groups for one run prefix on one peer; registered on the Peer's RPC while open."""

    def __init__(self, peer: Peer, prefix: str, config: MatchmakingConfig,
                 clock: Callable[[], float] = time.time) -> None:
        config.validate()
        self.peer = peer
        self.prefix = prefix
        self.config = config
        self.clock = clock
        self.key = f"{prefix}.matchmaking"
        self._key = self.key  # the key of the formation under way (a Moshpit cell's, or the run's)
        self._declared: tuple[str, float] | None = None  # the key and expiration of our last declaration
        self._me: Member | None = None
        self._lead: _Lead | None = None
        self._following: ID | None = None
        self._moved = trio.Event()  # set (and replaced) whenever we start or stop leading or following
        self._target = config.target_size  # this formation's target (form_group may lower it)
        #: peers we could not reach, with the expiration of the declaration they had then: skipped until
        #: they declare anew. A killed leader's declaration outlives it; retried every second, it drew
        #: its would-be followers (and leaders handing theirs over) back to it until the deadline.
        self._unreachable: dict[ID, float] = {}

    # ------------------------------------------------------------------ lifecycle

    def install(self) -> Callable[[], None]:
        """Serve ``avg.join``; returns the undo."""
        rpc = self.peer.node.rpc
        rpc.add_unary(f"{JOIN_METHOD}.{self.prefix}", pb.JoinRequest, self._on_join)
        return lambda: rpc.remove(f"{JOIN_METHOD}.{self.prefix}")

    # ------------------------------------------------------------------ looking for a group

    async def form_group(self, me: Member, cell: str = "", *, expected: int | None = None) -> Group:
        """A group containing ``me``, or :class:`MatchmakingError` at the deadline.

        ``cell``: meet only peers declared under the same one (a Moshpit group
        key, :mod:`averaging.moshpit`); '' is the whole run. ``expected``: how many
        peers the caller knows will come (a training step's): a group this size
        is fixed at once, without waiting out ``gather_time`` (clamped to
        ``min_size..target_size``).
        """
        self._target = self.config.target_size if expected is None else \
            max(self.config.min_size, min(self.config.target_size, expected))
        deadline = trio.current_time() + self.config.timeout
        key = self._key = f"{self.key}.{cell}" if cell else self.key
        declared = Member(me.peer_id, me.addrs, me.role, me.schema, me.upload, me.download, me.compute,
                          me.accepts_joins, self.clock() + self.config.timeout + 5.0)
        self._me = declared
        self._declared = (key, declared.expiration)
        dht = self.peer.dht
        await dht.store(key, declared.to_wire().SerializeToString(), declared.expiration,
                        subkey=owned("member", me.peer_id), timeout=min(10.0, self.config.timeout))
        # Leaders that turned us away, and until when we skip them: a peer that
        # was not leading a moment ago may lead now, so refusals expire.
        refused: dict[ID, float] = {}
        last_seen, reducers_seen = 0, False
        try:
            while trio.current_time() < deadline:
                candidates = await self._candidates(deadline)
                last_seen = len(candidates)
                reducers_seen = reducers_seen or any(m.role.reduces for m in candidates)
                now = trio.current_time()
                leaders = sorted((m for m in candidates if m.accepts_joins
                                  and (refused.get(m.peer_id, 0.0) <= now or m.peer_id == me.peer_id)),
                                 key=leader_rank)
                if not leaders:
                    await trio.sleep(self.config.poll_interval)
                    continue
                leader = leaders[0]
                log.debug("%d declared, %d may lead; leader %s%s", len(candidates), len(leaders), leader.peer_id,
                          " (me)" if leader.peer_id == me.peer_id else "")
                if leader.peer_id == me.peer_id:
                    led = await self._lead_until(deadline)
                    if isinstance(led, Group):
                        return led
                    if led is not None:
                        # We handed our followers over to a better leader: follow them there,
                        # even if it turned us away a moment ago (else we lead alone till the deadline).
                        refused.pop(led, None)
                    continue
                outcome = await self._join(leader, deadline)
                if isinstance(outcome, Group):
                    return outcome
                refused[leader.peer_id] = trio.current_time() + 2 * self.config.poll_interval
                if outcome is not None:
                    refused.pop(outcome, None)
                else:
                    await trio.sleep(self.config.poll_interval / 2)
        finally:
            self._me = None
            self._following = None
            self._move()
        raise MatchmakingError(
            f"no group of at least {self.config.min_size} formed under {key!r} within "
            f"{self.config.timeout:.0f} s ({last_seen} matching peers declared"
            + ("" if me.accepts_joins or last_seen > 1 else "; this peer cannot lead and no other can")
            + ("" if reducers_seen or last_seen == 0 else "; none of them may reduce a part (all senders: client "
               "mode, relayed, or reduces=False)") + ")")

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

    async def _candidates(self, deadline: float) -> list[Member]:
        """Live declarations under this formation's key with our match key, ourselves included."""
        assert self._me is not None
        found = await self.peer.dht.get(self._key, latest=True,
                                        timeout=max(0.5, min(5.0, deadline - trio.current_time())))
        now = self.clock()
        for peer, expiration in list(self._unreachable.items()):
            if expiration <= now:
                del self._unreachable[peer]
        members: dict[ID, Member] = {self._me.peer_id: self._me}
        if found is not None and isinstance(found.value, dict):
            for entry in found.value.values():
                if not isinstance(entry.value, bytes) or not entry.value:
                    continue  # not ours to read, or withdrawn
                try:
                    msg = pb.Declaration()
                    msg.ParseFromString(entry.value)
                    member = Member.from_wire(msg)
                except Exception as e:  # a peer's garbage costs it only its entry
                    log.debug("skipping a malformed declaration: %r", e)
                    continue
                if (member.schema == self._me.schema and member.expiration > now
                        and self._unreachable.get(member.peer_id) != member.expiration):
                    members.setdefault(member.peer_id, member)
        return list(members.values())

    async def _join(self, declared: Member, deadline: float) -> Group | ID | None:
        """Ask the leader ``declared``; a Group, the ID of the leader it redirects to, or None when
        refused or unreachable (then skipped while that declaration lives)."""
        assert self._me is not None
        leader = declared.peer_id
        self._following = leader
        self._move()
        # where to reach it: its declaration says (a relayed leader is known nowhere else)
        self.peer.node.add_addrs(leader, list(declared.addrs))
        try:
            response = await self.peer.node.rpc.call(
                leader, f"{JOIN_METHOD}.{self.prefix}",
                pb.JoinRequest(prefix=self.prefix, declaration=self._me.to_wire()), pb.JoinResponse,
                timeout=max(0.5, deadline - trio.current_time()))
        except DedlocError as e:
            log.debug("join %s failed: %s", leader, e)
            if isinstance(e, (PeerDisconnectedError, ConnectionError)):  # gone, or never reached
                self._unreachable[leader] = declared.expiration
            return None
        finally:
            self._following = None
        log.debug("join %s: %s %s", leader, pb.JoinResponse.Status.Name(response.status), response.reason)
        if response.status == pb.JoinResponse.ACCEPTED:
            try:
                return Group.from_wire(response.group, self._me.peer_id)
            except AllreduceProtocolError as e:
                log.warning("leader %s sent an unusable group: %s", leader, e)
                return None
        if response.status == pb.JoinResponse.REDIRECT:
            try:
                return ID(bytes(response.leader))
            except Exception:
                return None
        return None

    # ------------------------------------------------------------------ leading

    async def _lead_until(self, deadline: float) -> Group | ID | None:
        """Lead until the group is set (returned), or a better leader shows up (its ID: our followers
        went there), or the deadline (None)."""
        assert self._me is not None
        lead = self._lead = _Lead()
        self._move()
        started = trio.current_time()
        try:
            while trio.current_time() < deadline:
                size = 1 + len(lead.followers)
                reducer = self._me.role.reduces or any(m.role.reduces for m in lead.followers.values())
                ready = reducer and (size >= self._target or (
                    size >= self.config.min_size and trio.current_time() - started >= self.config.gather_time))
                if ready:
                    return await self._fix_group(lead)
                with trio.move_on_after(min(self.config.poll_interval, max(0.0, deadline - trio.current_time()))):
                    await lead.changed.wait()
                if 1 + len(lead.followers) >= self._target:
                    continue
                # Is there a better leader now (one we did not see before)?
                # Then hand the followers over to it rather than split the swarm.
                others = sorted((m for m in await self._candidates(deadline) if m.accepts_joins), key=leader_rank)
                if others and others[0].peer_id != self._me.peer_id:
                    log.debug("handing %d followers over to %s", len(lead.followers), others[0].peer_id)
                    lead.redirect = others[0].peer_id
                    return lead.redirect
            if 1 + len(lead.followers) >= self.config.min_size and (
                    self._me.role.reduces or any(m.role.reduces for m in lead.followers.values())):
                return await self._fix_group(lead)
            return None
        finally:
            lead.closed.set()
            self._lead = None
            self._move()

    async def _fix_group(self, lead: _Lead) -> Group:
        """Fix the group and answer the followers before the leader goes on.

        The leader's next steps (flattening, the load-balancing LP) are CPU
        work without checkpoints: answering after them started every follower's
        round 50-70 ms after the leader's (4 peers, 40 MB).
        """
        assert self._me is not None
        members = sorted([self._me, *list(lead.followers.values())[: self._target - 1]],
                         key=lambda m: m.peer_id.to_bytes())
        group = Group(os.urandom(16), tuple(members), [m.peer_id for m in members].index(self._me.peer_id))
        lead.group = group
        lead.closed.set()
        with trio.move_on_after(ANSWER_WAIT):
            while lead.waiting:
                await lead.answered.wait()
        # The RPC layer writes the answers over several checkpoints; a few
        # milliseconds of this loop let it finish before the leader computes.
        await trio.sleep(ANSWER_FLUSH)
        log.debug("fixed group %s of %d", group.group_id.hex()[:8], len(members))
        return group

    async def _on_join(self, request: pb.JoinRequest, ctx: CallContext) -> pb.JoinResponse:
        try:
            member = Member.from_wire(request.declaration)
        except AllreduceProtocolError as e:
            return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason=str(e))
        if member.peer_id != ctx.peer_id:
            return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason="a declaration of another peer")
        if self._me is not None and self._lead is None and self._following is None:
            # We are looking too, between two reads of the declarations: we pick a leader within
            # moments (often ourselves: the joiner picked us). Answering "not leading" now made the
            # joiner skip us for a while, and it missed the group we formed a moment later.
            with trio.move_on_after(self.config.poll_interval):
                while self._me is not None and self._lead is None and self._following is None:
                    await self._moved.wait()
        me, lead = self._me, self._lead
        if me is None or member.schema != me.schema:
            return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason="not matching now")
        if lead is None:
            if self._following is not None:
                return pb.JoinResponse(status=pb.JoinResponse.REDIRECT, leader=self._following.to_bytes())
            return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason="not leading")
        if lead.group is not None or 1 + len(lead.followers) >= self._target:
            return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason="group full")
        lead.followers[member.peer_id] = member
        lead.poke()
        lead.waiting += 1
        try:
            await lead.closed.wait()
        finally:
            lead.waiting -= 1
            if not lead.waiting:
                lead.answered.set()
        group = lead.group
        if group is not None and group.index_of(member.peer_id) is not None:
            return pb.JoinResponse(status=pb.JoinResponse.ACCEPTED, group=group.to_wire())
        lead.followers.pop(member.peer_id, None)
        if group is None and lead.redirect is not None:
            return pb.JoinResponse(status=pb.JoinResponse.REDIRECT, leader=lead.redirect.to_bytes())
        return pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason="the group formed without you")
