"""Matchmaking at a thousand peers: Moshpit's groups formed over the simulated DHT.

Each peer runs the project's :class:`averaging.formation.Formation` (the state table the
:class:`averaging.matchmaking.Matchmaker` drives) and this module plays the Matchmaker's part
on the simulator's clock: the declaration stored under the cell's key (and again while the
formation lasts), the reads of every declaration there (``latest``), the ``avg.join`` calls to a
leader and a leader's answers (deferred, admitted until the lead closes, redirected), the group
fixed, the declaration withdrawn. DHT traffic goes through :class:`p2p.sim.dht.DHTSim` (the DHT's
own code over the modelled network); a join is one request and its answer over the same model
(through a relay for a peer behind a NAT: two legs). What is measured: how long each peer takes to
get a group, and how many get none by the matchmaking deadline.

Simplifications, each on the side of fewer messages than the real thing: declarations are
stored with plain subkeys (the simulated peers have no keys to sign ``[owner:...]`` ones), and
a leader's followers are answered as soon as the lead closes (the Matchmaker's ANSWER_WAIT
and ANSWER_FLUSH are milliseconds).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.dht.records import DHTKey, DHTRecord, ValueWithExpiration
from p2p.sim.dht import DHTSim, SimPeer, Stored
from p2p.sim.network import Kind

from ..formation import (Accept, Action, Admit, AskToJoin, AwaitJoins, Declaring, Defer, Done, Fail, Fix,
                         Formation, FormationRules, HandOver, JoinAnswer, Joined, JoinOutcome, Phase, Read, Redirect,
                         Redirected, Refused, Reject, Sleep, Unreachable, answer_admitted)
from ..group import Group, Member, Role
from ..matchmaking import MatchmakingConfig, declared_members, forget_expired
from ..moshpit import GridPosition

SCHEMA = b"moshpit-sim"


@dataclass
class _Lead:
    """A stretch of leading: the admitted followers waiting for their answer."""

    waiting: list[tuple[Member, Callable[[JoinAnswer], None]]] = field(default_factory=list)
    #: the generation of the AwaitJoins under way (None: not waiting); a join ends the wait at once
    awaiting: int | None = None
    generations: int = 0


@dataclass
class Outcome:
    peer: int
    seconds: float
    group: Group | None


class SimMatchmaker:
    """One peer's matchmaking on the simulator (a callback twin of :class:`Matchmaker`)."""

    def __init__(self, world: MatchmakingSim, peer: SimPeer) -> None:
        self.world, self.peer = world, peer
        role = Role.FULL if peer.kind is Kind.PUBLIC else Role.SENDER
        addr = peer.addr if peer.kind is Kind.PUBLIC else Multiaddr("/ip4/11.255.0.1/tcp/4001/p2p-circuit")
        self.me = Member(peer.peer_id, (addr,), role, SCHEMA, 10e6, 10e6, 1.0, peer.kind is Kind.PUBLIC)
        self.formation: Formation | None = None
        self.lead: _Lead | None = None
        self.unreachable: dict[ID, float] = {}
        self.deferred: list[tuple[Member, Callable[[JoinAnswer], None], Formation]] = []
        #: joins asked between two formations, held for a poll interval (as the Matchmaker holds them)
        self.held: list[tuple[Member, Callable[[JoinAnswer], None]]] = []
        self.key = b""
        self.started = 0.0
        self._done: Callable[[Outcome], None] = lambda _: None

    # ------------------------------------------------------------------ looking for a group

    def form_group(self, cell: str, done: Callable[[Outcome], None]) -> None:
        world, cfg = self.world, self.world.config
        self.started = world.sim.now
        self.key = DHTKey.encode(f"{world.prefix}.matchmaking.{cell}")
        declared = Member(self.me.peer_id, self.me.addrs, self.me.role, SCHEMA, self.me.upload, self.me.download,
                          self.me.compute, self.me.accepts_joins, world.sim.wall() + cfg.timeout + 5.0)
        record = DHTRecord(self.key, declared.to_wire().SerializeToString(), declared.expiration,
                           DHTKey.encode(self.peer.peer_id.to_bytes()))
        rules = FormationRules(cfg.target_size, cfg.min_size, cfg.gather_time, cfg.poll_interval)
        self._done = done

        def stored(result: Stored) -> None:
            formation = self.formation = Formation(declared, rules, self.started + cfg.timeout, self.unreachable)
            held, self.held = self.held, []
            for member, reply in held:  # asked between two rounds: this formation answers them
                self._answer(member, reply, asked_again=False)
            self._keep_declared(record, formation, Declaring().then(bool(result.holders)))
            self._perform(formation.start(world.sim.now))

        world.sim.store(self.peer, record, stored)

    def _keep_declared(self, record: DHTRecord, formation: Formation, declaring: Declaring) -> None:
        """Store the declaration again while ``formation`` lasts, when the Matchmaker would
        (:func:`averaging.formation.redeclare_after`)."""
        sim = self.world.sim

        def again() -> None:
            if self.formation is formation:
                sim.store(self.peer, record, lambda result: self._keep_declared(
                    record, formation, declaring.then(bool(result.holders))))

        sim.engine.at(declaring.wait(self.world.config.poll_interval), again)

    def _perform(self, action: Action) -> None:
        formation, sim = self.formation, self.world.sim
        assert formation is not None
        if isinstance(action, Read):
            def read(_: float, value: ValueWithExpiration | None, __: bool) -> None:
                led = formation.phase is Phase.LEADING
                nxt = formation.on_declarations(self._candidates(value), sim.now)
                if formation.phase is Phase.LEADING and not led:
                    self.lead = _Lead()
                self._step(nxt)
            sim.read(self.peer, self.key, read, latest=True)
        elif isinstance(action, Sleep):
            sim.engine.at(action.seconds, lambda: self._step(formation.on_timer(sim.now)))
        elif isinstance(action, AskToJoin):
            self.world.join(self, action.leader, lambda outcome: self._step(formation.on_join_answered(outcome, sim.now)))
        elif isinstance(action, AwaitJoins):
            lead = self.lead
            assert lead is not None
            lead.generations += 1
            lead.awaiting = lead.generations
            sim.engine.at(max(0.0, action.seconds), self._wake, lead, lead.awaiting)
        elif isinstance(action, HandOver):
            self._close_lead(None, action.leader)
            self._step(formation.on_timer(sim.now))
        elif isinstance(action, Fix):
            members = action.members
            group = Group(self.world.group_id(), members, [m.peer_id for m in members].index(self.me.peer_id))
            nxt = formation.fixed(group)
            self._close_lead(group, None)
            self._step(nxt)
        elif isinstance(action, Done):
            self._finish(action.group)
        elif isinstance(action, Fail):
            self._finish(None)

    def _step(self, action: Action) -> None:
        """The next action, after answering the joins deferred until this formation moved."""
        if self.deferred:
            waiting, self.deferred = self.deferred, []
            for member, reply, formation in waiting:
                if self.formation is not formation or formation.phase is not Phase.LOOKING:
                    self._answer(member, reply, asked_again=True)
                else:
                    self.deferred.append((member, reply, formation))
        self._perform(action)

    def _finish(self, group: Group | None) -> None:
        self.formation = None
        self._close_lead(None, None)
        for member, reply, _ in self.deferred:
            reply(Reject("not matching now"))
        self.deferred = []
        sim = self.world.sim
        if group is not None:  # withdraw the declaration in the background, as the averager does
            empty = DHTRecord(self.key, b"", sim.wall() + self.world.config.timeout + 5.001,
                              DHTKey.encode(self.peer.peer_id.to_bytes()))
            sim.store(self.peer, empty, lambda _: None)
        self._done(Outcome(self.peer.index, sim.now - self.started, group))

    def _close_lead(self, group: Group | None, redirect: ID | None) -> None:
        lead, self.lead = self.lead, None
        if lead is not None:
            for member, reply in lead.waiting:
                reply(answer_admitted(member, group, redirect))

    def _candidates(self, found: ValueWithExpiration | None) -> list[Member]:
        """What the Matchmaker takes from a read of the cell's key (its own functions)."""
        assert self.formation is not None
        now = self.world.sim.wall()
        forget_expired(self.unreachable, now)
        return declared_members(found, self.formation.me, now)

    # ------------------------------------------------------------------ answering joins

    def on_join(self, member: Member, reply: Callable[[JoinAnswer], None]) -> None:
        self._answer(member, reply, asked_again=False)

    def _answer(self, member: Member, reply: Callable[[JoinAnswer], None], *, asked_again: bool) -> None:
        formation = self.formation
        if formation is None:  # (a join asked again always meets its formation: _finish answers the rest)
            self.held.append((member, reply))

            def not_now() -> None:  # no formation began within a poll interval
                for i, (_, r) in enumerate(self.held):
                    if r is reply:
                        del self.held[i]
                        reply(Reject("not matching now"))
                        return
            self.world.sim.engine.at(self.world.config.poll_interval, not_now)
            return
        answer = formation.on_join(member, asked_again=asked_again)
        if isinstance(answer, Defer):
            self.deferred.append((member, reply, formation))

            def again() -> None:  # within a poll interval at the latest
                for i, (m, r, f) in enumerate(self.deferred):
                    if r is reply:
                        del self.deferred[i]
                        self._answer(m, r, asked_again=True)
                        return
            self.world.sim.engine.at(self.world.config.poll_interval, again)
            return
        if isinstance(answer, Admit):
            lead = self.lead
            assert lead is not None
            lead.waiting.append((member, reply))
            if lead.awaiting is not None:  # the leader's wait ends at once
                self.world.sim.engine.at(0.0, self._wake, lead, lead.awaiting)
            return
        reply(answer)

    def _wake(self, lead: _Lead, generation: int) -> None:
        """The end of an AwaitJoins (its timer, or a join), once."""
        formation = self.formation
        if self.lead is lead and lead.awaiting == generation and formation is not None:
            lead.awaiting = None
            self._step(formation.on_woken(self.world.sim.now))


class MatchmakingSim:
    """Moshpit matchmaking for every non-silent live peer of a :class:`DHTSim`."""

    def __init__(self, sim: DHTSim, config: MatchmakingConfig, prefix: str = "sim") -> None:
        config.validate()
        self.sim, self.config, self.prefix = sim, config, prefix
        self.peers = {p.peer_id: SimMatchmaker(self, p) for p in sim.peers if p.alive and p.kind is not Kind.SILENT}
        self._groups = 0

    def group_id(self) -> bytes:
        self._groups += 1
        return self._groups.to_bytes(16, "big")

    def join(self, asker: SimMatchmaker, leader: Member, outcome: Callable[[JoinOutcome], None]) -> None:
        """``avg.join``: the request to the leader and its answer back, over the network model."""
        sim = self.sim
        target = self.peers.get(leader.peer_id)
        a = asker.peer
        if target is None or not target.peer.alive:
            sim.engine.at(sim.config.dht.rpc_timeout, outcome, Unreachable("gone"))  # as a failed dial
            return
        b = target.peer
        legs = 2 if b.kind is Kind.UNREACHABLE else 1  # through its relay
        setup = 0.0 if sim.connected(a, b) else 2.0 * legs * sim.model.rtt(a.place, b.place)
        sim.use(a, b)
        there = setup + legs * sim.model.one_way(a.place, b.place, sim.rng)
        member = asker.formation.me if asker.formation is not None else asker.me

        def answered(answer: JoinAnswer) -> None:
            back = legs * sim.model.one_way(b.place, a.place, sim.rng)
            sim.engine.at(back, outcome, _outcome(answer, a.peer_id))

        sim.engine.at(there, target.on_join, member, answered)

    def round(self, cells: dict[ID, str], start_spread_s: float, finished: Callable[[list[Outcome]], None]) -> None:
        """Every peer in ``cells`` starts matchmaking under its cell within ``start_spread_s``."""
        outcomes: list[Outcome] = []
        pending = len(cells)

        def done(outcome: Outcome) -> None:
            nonlocal pending
            outcomes.append(outcome)
            pending -= 1
            if pending == 0:
                finished(outcomes)

        for peer_id, cell in cells.items():
            self.sim.engine.at(self.sim.rng.uniform(0, start_spread_s), self.peers[peer_id].form_group, cell, done)

    def rounds(self, grid: dict[ID, GridPosition], rounds: int, start_spread_s: float, period_s: float,
               finished: Callable[[list[list[Outcome]]], None]) -> None:
        """Every peer in ``grid`` matches ``rounds`` times, each round under its cell's key.

        Round r begins ``r * period_s`` after the first, each peer within ``start_spread_s`` of it
        (a training run's global step: the peers learn together that the swarm reached its batch),
        or as soon as its previous round ended if that is later (its matchmaking ran long). The grid
        advances by the peer's index in its group, turned by the group's offset (it stays where it was without one), as the
        averager's does. So joins meet peers between two of their rounds, which a single round
        (:meth:`round`) shows only for peers that finished for good; with a short period, peers slow
        in one round begin the next late, beside others already in it. ``finished`` gets the
        outcomes round by round.
        """
        per_round: list[list[Outcome]] = [[] for _ in range(rounds)]
        pending = len(grid) * rounds
        sim = self.sim
        t0 = sim.now

        def start(peer_id: ID, r: int) -> None:
            self.peers[peer_id].form_group(grid[peer_id].key, lambda outcome: done(peer_id, r, outcome))

        def done(peer_id: ID, r: int, outcome: Outcome) -> None:
            nonlocal pending
            per_round[r].append(outcome)
            if outcome.group is not None:
                grid[peer_id].advance(outcome.group.my_index, outcome.group.group_id)
            pending -= 1
            if r + 1 < rounds:
                begin = t0 + (r + 1) * period_s + sim.rng.uniform(0, start_spread_s)
                sim.engine.at(max(0.0, begin - sim.now), start, peer_id, r + 1)
            if pending == 0:
                finished(per_round)

        for peer_id in grid:
            sim.engine.at(sim.rng.uniform(0, start_spread_s), start, peer_id, 0)


def _outcome(answer: JoinAnswer, me: ID) -> JoinOutcome:
    if isinstance(answer, Accept):
        index = answer.group.index_of(me)
        if index is None:
            return Refused("a group without us")
        return Joined(Group(answer.group.group_id, answer.group.members, index))
    if isinstance(answer, Redirect):
        return Redirected(answer.leader)
    assert isinstance(answer, Reject)
    return Refused(answer.reason)


def summary(outcomes: list[Outcome]) -> dict[str, float]:
    """Time to a group (p50 / p95 / max over those that got one) and the share left without one."""
    times = sorted(o.seconds for o in outcomes if o.group is not None)
    sizes = [o.group.size for o in outcomes if o.group is not None]
    return {
        "peers": float(len(outcomes)),
        "formed_p50_s": statistics.median(times) if times else float("nan"),
        "formed_p95_s": times[int(0.95 * len(times))] if times else float("nan"),  # an index below len
        "formed_max_s": times[-1] if times else float("nan"),
        "without_group": sum(o.group is None for o in outcomes) / max(1, len(outcomes)),
        "group_size_mean": statistics.fmean(sizes) if sizes else 0.0,
    }
