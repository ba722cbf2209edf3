"""The averager: ``await averager.step(tensors, weight)`` averages them with a group of peers.

It takes the composed network object (:class:`nat.Peer`, through the narrow :class:`nat.Swarm`), as hivemind's
averager takes its DHT::

    async with Peer.open(PeerConfig.peer(initial_peers)) as peer:
        async with Averager.open(peer, AveragerConfig(prefix="my-run")) as averager:
            report = await averager.step([grad_a, grad_b], weight=samples)

One step: matchmaking (:mod:`averaging.matchmaking`) gives a group; every
member solves the same load-balancing LP over the members' declared
capacities (or splits equally); the butterfly round
(:mod:`averaging.allreduce`) averages; the result is written back into the
caller's tensors, and the :class:`~averaging.allreduce.RoundReport` says
whether every part of it came back whole. With ``strict=True`` (the
default) a partial round raises :class:`PartialAverageError` and leaves the
tensors as they were; with ``strict=False`` the partly averaged values are
written and the report says which parts kept the caller's own values.

The role comes from the network layer: a publicly reachable peer sends and
reduces; a peer reachable only through a relay, or not at all (client mode),
sends but never reduces (unless ``relayed_reduces``); an auxiliary peer
(``auxiliary=True``) has no tensors and only reduces.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace

import torch
import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamError

from nat import Swarm
from p2p.errors import ConfigError, describe
from p2p.hooks import ExternalAddresses, Observers, Reachability, Registration, SwarmObserver
from p2p.trio_util import finish_quietly

from .allreduce import PROTOCOL, AllreduceConfig, AllreduceRound, RoundPlan, RoundReport, check_weight
from .bandwidth import BandwidthConfig, BandwidthEstimator, is_probe
from .errors import AllreduceProtocolError, AveragingError, MatchmakingError, PartialAverageError
from .finite import all_finite
from .group import Group, Member, Role
from .load_balancing import Balance, balance, equal_fractions, split_seconds
from .matchmaking import Matchmaker, MatchmakingConfig
from .moshpit import FailureRate, GridPosition, MoshpitConfig
from .partition import Schema, unflatten_into
from .staging import BufferPool, DeviceVector, FlatVector, HostVector
from .proto import averaging_pb2 as pb
from .wire import FrameReader

log = logging.getLogger(__name__)

#: the LP's split replaces the equal one only when its round is predicted this much shorter (or better)
ADAPTIVE_GAIN = 0.8


@dataclass(frozen=True)
class AveragerConfig:
    """One run's averaging settings; every peer of the run must use the same ``allreduce`` ones.

    ``bandwidth``: this peer's upload and download are measured from its
    earlier rounds (:mod:`averaging.bandwidth`) unless given there (bytes/s);
    ``compute`` (samples/s, 0: unknown) is declared. Both go into its
    matchmaking record for load balancing. ``adaptive``: solve DeDLOC's LP for
    the split (else equal parts among reducers).
    """

    prefix: str = "dedloc"
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    allreduce: AllreduceConfig = field(default_factory=AllreduceConfig)
    auxiliary: bool = False
    #: False: this peer never reduces a part (DeDLOC's a_i = 0) even when reachable, e.g. to keep its
    #: upload for its own parts; one reducer and every other peer at False is a parameter server.
    reduces: bool = True
    relayed_reduces: bool = False
    adaptive: bool = True
    bandwidth: BandwidthConfig = field(default_factory=BandwidthConfig)
    compute: float = 0.0
    #: average in Moshpit groups of ``moshpit.group_size`` that change every round (None: one group)
    moshpit: MoshpitConfig | None = None
    #: how long a reducer waits for its own copy of a group a sender already streams into
    join_wait: float = 10.0
    #: how long a step waits for the NAT layer's first verdict on reachability (the role follows
    #: from it); a peer that starts averaging at once would otherwise declare itself a sender while
    #: AutoNAT is still asking, and a group of such peers has no reducer
    reachability_wait: float = 15.0

    def validate(self) -> None:
        if not self.prefix or len(self.prefix) > 128:
            raise ConfigError("prefix must be 1..128 characters")
        self.matchmaking.validate()
        self.allreduce.validate()
        if self.auxiliary and not self.reduces:
            raise ConfigError("an auxiliary peer only reduces: reduces=False leaves it nothing to do")
        self.bandwidth.validate()
        if self.moshpit is not None:
            self.moshpit.validate()
            if self.matchmaking.target_size != self.moshpit.group_size:
                raise ConfigError(f"with Moshpit groups of {self.moshpit.group_size}, matchmaking.target_size must be "
                                 f"the same (it is {self.matchmaking.target_size})")
        if not (math.isfinite(self.compute) and self.compute >= 0):
            raise ConfigError("compute must be finite and >= 0")
        if not (self.join_wait > 0 and self.reachability_wait >= 0):
            raise ConfigError("join_wait must be > 0 and reachability_wait >= 0")


def _check_finite(tensors: Sequence[torch.Tensor]) -> None:
    if not all_finite(tensors):
        raise ValueError("the tensors hold NaN or Inf; refusing to average them")


class _ExternalWatch(SwarmObserver):
    """Wakes whoever waits for a change of our reachability or external addresses."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def external_changed(self, external: ExternalAddresses) -> None:
        self._event.set()
        self._event = trio.Event()

    async def changed(self) -> None:
        await self._event.wait()


class RoundObserver:
    """Hears every matchmaking and round of an :class:`Averager` (:meth:`Averager.observe`); override what
    you need. Synchronous, in order, never dropped; must not block (the metrics use it)."""

    def matchmade(self, seconds: float, group_size: int) -> None:
        """A group formed after ``seconds`` of matchmaking."""

    def matchmaking_failed(self, seconds: float, reason: str) -> None:
        """No group formed: ``reason`` is the error's class name."""

    def averaged(self, report: RoundReport) -> None:
        """A round ended (complete or partial: ``report`` says)."""


class Averager:
    """Group all-reduce for one run prefix on one peer (a :class:`nat.Swarm`: :class:`nat.Peer`).
    Open it with :meth:`open`."""

    def __init__(self, peer: Swarm, config: AveragerConfig) -> None:
        self.peer = peer
        self.config = config
        self.matchmaker = Matchmaker(peer, config.prefix, config.matchmaking)
        self._rounds: dict[bytes, AllreduceRound] = {}
        #: the rounds' flat vectors and staging buffers, kept for the next round (averaging.staging)
        self._buffers = BufferPool()
        self._round_started: dict[bytes, trio.Event] = {}
        self.last_balance: Balance | None = None
        self._external = _ExternalWatch()
        self._background: trio.Nursery | None = None
        self.bandwidth = BandwidthEstimator(config.bandwidth)
        #: members that failed recent rounds (left out, or no round): for choosing Moshpit's group size
        self.failure_rate = FailureRate()
        self._observers: Observers[RoundObserver] = Observers("the averager's rounds")
        mp = config.moshpit
        self.grid: GridPosition | None = None
        if mp is not None:
            self.grid = (GridPosition(mp.group_size, mp.initial) if mp.initial is not None
                         else GridPosition.initial(mp.group_size, mp.dims, peer.peer_id.to_bytes()))

    @classmethod
    @asynccontextmanager
    async def open(cls, peer: Swarm, config: AveragerConfig | None = None) -> AsyncIterator[Averager]:
        config = config or AveragerConfig()
        config.validate()
        averager = cls(peer, config)
        joins = averager.matchmaker.install()
        registration = peer.set_stream_handler(PROTOCOL, averager._on_stream)
        watching = peer.observe(averager._external)
        try:
            # Background work (withdrawing declarations) lives here, not in a step: a DHT store
            # that waits on a dead node must not hold up the step's return.
            async with trio.open_nursery() as nursery:
                averager._background = nursery
                yield averager
                nursery.cancel_scope.cancel()
        finally:
            averager._background = None
            watching.remove()
            registration.remove()
            joins.remove()

    # ------------------------------------------------------------------ role

    async def settled(self) -> None:
        """Wait (up to ``reachability_wait``) until the NAT layer has judged our reachability."""
        with trio.move_on_after(self.config.reachability_wait):
            while self.peer.external.judged and self.peer.external.reachability is Reachability.UNKNOWN:
                await self._external.changed()

    def role(self) -> tuple[Role, bool]:
        """This peer's role now, and whether it accepts joins (others can dial it)."""
        external = self.peer.external
        if self.config.auxiliary:
            role = Role.AUXILIARY
        elif not self.config.reduces:
            role = Role.SENDER
        elif not external.judged or external.reachability is Reachability.PUBLIC:
            role = Role.FULL
        elif external.relayed and self.config.relayed_reduces:
            role = Role.FULL
        else:
            role = Role.SENDER
        reachable = (not external.judged or external.reachability is Reachability.PUBLIC
                     or bool(external.relayed))
        if role is Role.AUXILIARY and not reachable:
            raise AveragingError("an auxiliary peer must be reachable (public or relayed) to reduce")
        return role, reachable and bool(self.peer.addrs)

    def observe(self, observer: RoundObserver) -> Registration:
        """Tell ``observer`` of every matchmaking and round until the handle is removed."""
        return self._observers.add(observer)

    # ------------------------------------------------------------------ one step

    async def step(self, tensors: Sequence[torch.Tensor], weight: float = 1.0, *,
                   strict: bool = True, purpose: str = "", expected: int | None = None) -> RoundReport:
        """Average ``tensors`` in place with a group; the report of the round.

        ``purpose`` and ``expected`` are :meth:`matchmake`'s. Raises :class:`~averaging.errors.MatchmakingError` when no group formed
        in time and :class:`PartialAverageError` (``strict``) when the round
        was partial; in both cases ``tensors`` are untouched. Non-finite
        values in ``tensors`` raise ValueError before anything is sent.
        """
        group = await self.matchmake(tensors, weight, purpose=purpose, expected=expected)  # checks weight, values
        try:
            report = await self._average(group, tensors, weight, strict=strict, phase=0, checked=True)
        except AveragingError:
            # The group was fixed, so its order is agreed: move on the grid all the same. A group
            # that stayed on its key after a failed round fell out of the grid's phase, and in the
            # 1,000-peer simulation (bench/scale.py) its members then met nobody or the wrong peers:
            # 0.1% of members failing took a full grid from 3 rounds to 1e-6 of the average to 7.
            if self.grid is not None:
                self.grid.advance(group.my_index, group.group_id)
            raise
        if self.grid is not None:
            self.grid.advance(group.my_index, group.group_id)
            report.notes.append(f"moshpit: next group key {self.grid.key!r}")
        return report

    async def matchmake(self, tensors: Sequence[torch.Tensor], weight: float = 1.0, *, purpose: str = "",
                        expected: int | None = None) -> Group:
        """Form a group to average tensors like ``tensors`` (same shapes and dtypes) with.

        :meth:`step` is this and one :meth:`average_in`; a caller that averages
        several times with one group (PowerSGD's two phases) calls them apart.
        ``purpose`` keeps such callers' groups apart from plain steps' (it
        goes into the match key: a training step's number keeps peers at
        different steps apart). ``expected``: the group size the caller knows
        of; a leader fixes a group that size at once instead of waiting out
        ``gather_time``. Checks ``tensors`` and ``weight`` first.
        """
        schema = Schema.of(tensors)
        check_weight(weight)
        await self.settled()
        role, accepts_joins = self.role()
        if role.sends:
            _check_finite(tensors)
        me = Member(self.peer.peer_id, tuple(self.peer.addrs), role, self._match_key(schema, purpose),
                    self.bandwidth.upload, self.bandwidth.download, self.config.compute, accepts_joins)
        cell = self.grid.key if self.grid is not None else ""
        started = trio.current_time()
        try:
            group = await self.matchmaker.form_group(me, cell, expected=expected)
        except MatchmakingError as e:
            self.failure_rate.observe(1, 1)
            failed_after = trio.current_time() - started
            self._observers.notify(lambda o: o.matchmaking_failed(failed_after, type(e).__name__), "a failed matchmaking")
            raise
        took = trio.current_time() - started
        self._observers.notify(lambda o: o.matchmade(took, group.size), "a group formed")
        # Withdraw the declaration in the background: it costs the round nothing.
        if self._background is not None:
            self._background.start_soon(self.matchmaker.withdraw, self.matchmaker.take_declaration())
        return group

    async def average_in(self, group: Group, tensors: Sequence[torch.Tensor], weight: float = 1.0, *,
                         strict: bool = True, phase: int = 0,
                         accept: Callable[[RoundReport], bool] | None = None) -> RoundReport:
        """One all-reduce of ``tensors`` (in place) within ``group``, from :meth:`matchmake`.

        Every member must call it with tensors of one schema and the same
        ``phase``; the phase gives the round its own id, so a group can
        average several times (phases 0, 1, ...). Partial rounds raise
        :class:`PartialAverageError` when ``strict`` (tensors untouched).
        ``accept``: with ``strict=False``, write the result into ``tensors``
        only when it says so (a caller that retries a round keeps its values
        for the retry without copying them first).
        """
        return await self._average(group, tensors, weight, strict=strict, phase=phase, checked=False, accept=accept)

    async def _average(self, group: Group, tensors: Sequence[torch.Tensor], weight: float, *,
                       strict: bool, phase: int, checked: bool,
                       accept: Callable[[RoundReport], bool] | None = None) -> RoundReport:
        """:meth:`average_in`; ``checked``: :meth:`matchmake` already checked ``weight`` and the values."""
        schema = Schema.of(tensors)
        if not checked:
            check_weight(weight)
            if group.me.role.sends:
                _check_finite(tensors)
        round_group = group if phase == 0 else group.for_phase(phase)
        fractions = self.fractions(round_group, schema)
        plan = RoundPlan.make(schema, fractions, self.config.allreduce, round_group)
        vector = self._stage(tensors, plan) if group.me.role.sends else None
        try:
            report = await self._run(round_group, plan, fractions, vector, weight)
            self.failure_rate.observe(group.size, len(report.left_out))
            self._observers.notify(lambda o: o.averaged(report), "a round averaged")
            if vector is not None:
                await vector.finish()
                if report.complete or not strict and (accept is None or accept(report)):
                    unflatten_into(vector.result, tensors)
        finally:
            if vector is not None:
                vector.release()
        if not report.complete:
            log.warning("averaging round %s: %s", report.group_id.hex()[:8], report.summary())
            if strict:
                raise PartialAverageError(report.summary(), report)
        return report

    def _stage(self, tensors: Sequence[torch.Tensor], plan: RoundPlan) -> HostVector | DeviceVector:
        """The round's flat vector: a host copy of CPU tensors, or staged from a GPU (:mod:`averaging.staging`)."""
        if all(t.device.type == "cpu" for t in tensors):
            return HostVector(tensors, self._buffers)
        return DeviceVector(tensors, plan.spans, self._buffers)

    async def _run(self, group: Group, plan: RoundPlan, fractions: tuple[float, ...], vector: FlatVector | None,
                   weight: float) -> RoundReport:
        # A probe round runs its senders free of lockstep so that its transfers
        # measure the links, not the slowest member (averaging.bandwidth).
        probe = self.config.adaptive and is_probe(
            group.group_id, [(m.upload, m.download) for m in group.members], self.config.bandwidth.probe_every)
        allreduce = replace(self.config.allreduce, max_chunks_ahead=max([1, *map(len, plan.spans)])) if probe else self.config.allreduce
        round_ = AllreduceRound(self.peer, group, plan, vector, weight, allreduce, fractions, self._buffers)
        self._rounds[group.group_id] = round_
        self._round_started.setdefault(group.group_id, trio.Event()).set()
        try:
            with ExitStack() as kept:  # no member's connection is trimmed mid-round (p2p/conn_manager.py)
                for member in group.members:
                    if member.peer_id != self.peer.peer_id:
                        kept.enter_context(self.peer.protect(member.peer_id, "averaging round"))
                report = await round_.run()
            self.bandwidth.observe(round_.upload, round_.download, probe=probe)
        finally:
            self._rounds.pop(group.group_id, None)
            self._round_started.pop(group.group_id, None)
        if probe:
            report.notes.append("a probe round: senders ran free of lockstep to measure the links")
        if self.last_balance is not None:
            report.notes.append(f"load balancing solved in {self.last_balance.solve_seconds * 1e3:.1f} ms")
        return report

    def fractions(self, group: Group, schema: Schema) -> tuple[float, ...]:
        """The split of the vector among the members: the LP's, or equal among reducers."""
        capacities = [m.capacity for m in group.members]
        if not self.config.adaptive:
            self.last_balance = None
            return equal_fractions(capacities)
        try:
            self.last_balance = balance(capacities, schema.numel * 4)
        except ValueError as e:
            log.warning("load balancing failed (%s); splitting equally", e)
            self.last_balance = None
            return equal_fractions(capacities)
        # Measured figures are noisy (a CPU-bound round measures the CPU): leave
        # the equal split only for a clear gain, or the noise picks the split.
        equal = equal_fractions(capacities)
        size = schema.numel * 4
        if split_seconds(capacities, self.last_balance.fractions, size) > ADAPTIVE_GAIN * split_seconds(
                capacities, equal, size):
            return equal
        return self.last_balance.fractions

    def _match_key(self, schema: Schema, purpose: str = "") -> bytes:
        """Peers match only with the same tensors, the same round settings and the same purpose."""
        c = self.config.allreduce
        mp = self.config.moshpit
        grid = f"/moshpit{mp.group_size}x{mp.dims}:{self.grid.key if self.grid else ''}" if mp else ""
        settings = (f"{c.chunk_elements}/{c.compression}/{c.min_compress_elements}/{self.config.adaptive}{grid}"
                    f"/{purpose}").encode()
        return hashlib.sha256(schema.fingerprint() + settings).digest()[:16]

    # ------------------------------------------------------------------ reducer side

    async def _on_stream(self, stream: INetStream) -> None:
        reader = FrameReader(stream)
        sender_id = stream.muxed_conn.peer_id
        waited_for = "part header"
        try:
            with trio.fail_after(self.config.join_wait):
                header = await reader.message(pb.PartHeader, "part header")
                group_id = bytes(header.group_id)
                if group_id not in self._rounds:
                    waited_for = f"round {group_id.hex()[:8]} here"
                    started = self._round_started.setdefault(group_id, trio.Event())
                    try:
                        await started.wait()
                    finally:
                        if not started.is_set():
                            self._round_started.pop(group_id, None)
        except (trio.TooSlowError, AllreduceProtocolError, OSError, EOFError, StreamError) as e:  # StreamError: it reset
            why = (f"no {waited_for} within {self.config.join_wait:g} s" if isinstance(e, trio.TooSlowError)
                   else describe(e))
            log.info("refused an all-reduce stream from %s: %s", sender_id, why)
            await finish_quietly(stream.reset)
            return
        round_ = self._rounds.get(group_id)
        sender = None if round_ is None else round_.group.index_of(sender_id)
        if round_ is None or sender is None:
            log.warning("refused an all-reduce stream from %s: not a member of group %s", sender_id, group_id.hex()[:8])
            await finish_quietly(stream.reset)
            return
        try:
            await round_.serve(stream, reader, sender, header)
        except AllreduceProtocolError as e:
            log.warning("member %s broke the all-reduce protocol: %s", sender_id, e)
            await finish_quietly(stream.reset)
