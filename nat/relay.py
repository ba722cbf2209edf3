"""Circuit relay v2, relay side (the HOP protocol): what ``dedloc relay`` runs for NATed peers.

A public relay is cheap to run only if what it gives away is bounded, so
every resource has an explicit limit (:class:`RelayConfig`): reservations in
total and per IP, circuits in total and per peer, and per circuit a duration,
a byte budget per direction and optionally a bandwidth cap. The defaults suit
tensor traffic (DeDLOC relays carry averaging for peers that cannot punch
through: an hour and 4 GiB per circuit, where libp2p's defaults of 2 minutes
and 128 KiB only suffice for hole-punch coordination).

Per the spec, reservations and circuits are refused over relayed connections,
a reservation lives only while its peer stays connected, and a circuit that
exceeds its limits is reset on both sides.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetStream
from libp2p.peer.envelope import Envelope, make_unsigned
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import Node
from p2p.addresses import is_relayed, is_relayed_conn, split_circuit, with_peer_id, without_peer_id
from p2p.conn_manager import KeptPeers
from p2p.dialer import live_connection
from p2p.errors import AddressError, ConfigError, RemoteProtocolError
from p2p.hooks import Registration
from p2p.resources import ResourceLimitExceeded
from p2p.trio_util import finish_quietly
from p2p.untrusted import require_peer_id
from p2p.wire import read_message, write_message

from .circuit import HOP_PROTOCOL, STOP_PROTOCOL, VOUCHER_DOMAIN, VOUCHER_PAYLOAD_TYPE
from .proto import circuit_pb2 as pb

log = logging.getLogger(__name__)

#: Bytes moved per read while bridging a circuit.
BRIDGE_READ = 256 * 1024


@dataclass
class RelayConfig:
    """Limits of a relay. 0 means no limit for the per-circuit values."""

    max_reservations: int = 256
    max_reservations_per_ip: int = 8
    reservation_ttl: int = 3600
    max_circuits: int = 128
    max_circuits_per_peer: int = 16
    #: Longest life of one relayed connection, in seconds.
    circuit_duration: int = 3600
    #: Bytes one relayed connection may carry in each direction.
    circuit_data: int = 4 * 1024**3
    #: Bytes per second per direction of one relayed connection.
    circuit_bandwidth: int = 0
    #: Time for the target to accept a circuit (STOP exchange).
    connect_timeout: float = 10.0
    #: When every slot is taken: holders asked (identify, at once) whether they still advertise an
    #: address through us, longest held first, and how long each answer lasts. A holder that no
    #: longer does (it became public) gives its slot to the newcomer.
    #: A slot younger than ``reclaim_grace`` seconds is never asked about (its holder may not have
    #: published the address yet).
    reclaim_checks: int = 8
    reclaim_timeout: float = 3.0
    reclaim_recheck: float = 300.0
    reclaim_grace: float = 30.0

    def validate(self) -> None:
        for name in ("max_reservations", "max_reservations_per_ip", "reservation_ttl", "max_circuits", "max_circuits_per_peer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"relay {name} must be at least 1")
        for name in ("circuit_duration", "circuit_data", "circuit_bandwidth"):
            if getattr(self, name) < 0:
                raise ConfigError(f"relay {name} must not be negative (0 means no limit)")
        if self.connect_timeout <= 0 or self.reclaim_timeout <= 0 or self.reclaim_recheck < 0 or self.reclaim_grace < 0:
            raise ConfigError("relay connect_timeout and reclaim_timeout must be positive, reclaim_recheck and "
                              "reclaim_grace not negative")
        if self.reclaim_checks < 0:
            raise ConfigError("relay reclaim_checks must not be negative (0: never reclaim a slot)")


@dataclass
class _Slot:
    peer: ID
    ip: str
    expire: float
    #: when the slot was first granted (renewals keep it), and when its holder last said it uses it
    since: float = 0.0
    used_at: float = -float("inf")


def advertises_through(listen_addrs: Iterable[Multiaddr], relay: ID) -> bool:
    """Whether a peer's advertised addresses include one through ``relay`` (``/p2p/<relay>/p2p-circuit``).

    A peer advertises its relayed addresses only while it is not publicly reachable (``Node._advertised``):
    one that no longer lists ours holds a slot nobody can use it by."""
    for addr in listen_addrs:
        if is_relayed(addr):
            try:
                if split_circuit(addr)[1] == relay:
                    return True
            except AddressError:
                continue
    return False


#: The answers that mean one of the relay's limits was hit (its reservation and circuit caps): the
#: node's resource manager counts these beside its own, and a burst of them is the operator's ERROR
#: line. The others (no reservation for the target, a target that did not accept, a malformed or
#: unexpected message, a request over a relayed connection) are a peer's mistake or a peer gone,
#: everyday on a public relay: the relay's own counters keep them (``refused.*`` in its metrics).
LIMIT_STATUSES = frozenset({pb.RESERVATION_REFUSED, pb.RESOURCE_LIMIT_EXCEEDED})


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: the spec's status code and a reason for the counters."""

    status: int
    reason: str


class RelayAdmission:
    """Who may hold a slot and open a circuit: the relay's limits, sans I/O (time and liveness passed in)."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.slots: dict[ID, _Slot] = {}
        self.circuits: Counter[ID] = Counter()

    def sweep(self, now: float, connected: Callable[[ID], bool]) -> None:
        """Forget reservations that expired or whose peer disconnected."""
        for peer, slot in list(self.slots.items()):
            if slot.expire <= now or not connected(peer):
                del self.slots[peer]

    def reserve(self, peer: ID, ip: str, now: float) -> Refusal | int:
        """A slot (new or refreshed) until the returned expiry (unix seconds), or the refusal."""
        old = self.slots.get(peer)
        if old is None:
            if len(self.slots) >= self.config.max_reservations:
                return Refusal(pb.RESERVATION_REFUSED, "too many reservations")
            if sum(1 for s in self.slots.values() if s.ip == ip) >= self.config.max_reservations_per_ip:
                return Refusal(pb.RESERVATION_REFUSED, "too many reservations from one IP")
        expire = int(now) + self.config.reservation_ttl
        # a renewal is a holder using its slot (a public peer does not renew)
        self.slots[peer] = _Slot(peer, ip, expire, since=now) if old is None else \
            _Slot(peer, ip, expire, since=old.since, used_at=now)
        return expire

    def reclaim_candidates(self, now: float, newcomer: ID) -> list[ID]:
        """Every slot is taken and ``newcomer`` holds none: the holders to ask whether they still
        use theirs, at most ``reclaim_checks``, longest held first, skipping those that said so (or
        renewed) within ``reclaim_recheck`` seconds and those granted within ``reclaim_grace``.

        Peers reserve before their NAT verdict (a NATed peer is reachable at once), so a public one
        holds a slot it stopped advertising; with no way to give it back in relay v2 but to
        disconnect, a relay's slots filled with public peers within the hour and turned NATed
        newcomers away (3 public peers on a 3-slot relay left a 4th, NATed, reachable by nobody)."""
        if newcomer in self.slots or len(self.slots) < self.config.max_reservations:
            return []
        fresh = [s for s in self.slots.values()
                 if now - s.used_at >= self.config.reclaim_recheck and now - s.since >= self.config.reclaim_grace]
        return [s.peer for s in sorted(fresh, key=lambda s: s.since)][: self.config.reclaim_checks]

    def heard(self, peer: ID, uses: bool, now: float) -> bool:
        """What a holder's addresses said (:func:`advertises_through`): its slot is kept (and not
        asked about again for ``reclaim_recheck``) or reclaimed; whether it was reclaimed."""
        slot = self.slots.get(peer)
        if slot is None:
            return False
        if uses:
            slot.used_at = now
            return False
        del self.slots[peer]
        return True

    def open_circuit(self, source: ID, target: ID) -> Refusal | None:
        """Count a circuit from ``source`` to ``target``, or say why not; :meth:`close_circuit` undoes it."""
        if target not in self.slots:
            return Refusal(pb.NO_RESERVATION, "no reservation")
        if self.circuit_count >= self.config.max_circuits:
            return Refusal(pb.RESOURCE_LIMIT_EXCEEDED, "too many circuits")
        limit = self.config.max_circuits_per_peer
        if self.circuits[source] >= limit or self.circuits[target] >= limit:
            return Refusal(pb.RESOURCE_LIMIT_EXCEEDED, "too many circuits for a peer")
        self.circuits[source] += 1
        self.circuits[target] += 1
        return None

    def close_circuit(self, source: ID, target: ID) -> None:
        self.circuits[source] -= 1
        self.circuits[target] -= 1
        self.circuits += Counter()  # drop zero counts

    @property
    def circuit_count(self) -> int:
        return sum(self.circuits.values()) // 2


@dataclass
class RelayStats:
    """What a relay has served; ``dedloc relay`` reports it."""

    reservations: int = 0
    #: slots taken back from holders that stopped advertising an address through us
    reclaimed: int = 0
    circuits: int = 0
    circuits_total: int = 0
    bytes_relayed: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    #: Circuits reset for exceeding a limit, by limit ("data", "duration").
    limits_hit: Counter[str] = field(default_factory=Counter)
    #: go-libp2p's relaysvc labels: reservations granted (``opened``) or refreshed (``renewed``);
    #: answers by (``reservation``/``connection``, status name); refusals by (same, reason).
    reservation_types: Counter[str] = field(default_factory=Counter)
    responses: Counter[tuple[str, str]] = field(default_factory=Counter)
    rejections: Counter[tuple[str, str]] = field(default_factory=Counter)


class _LimitReached(Exception):
    pass


class RelayService:
    """The HOP side of circuit relay v2, mounted on a Node."""

    def __init__(self, node: Node, config: RelayConfig | None = None) -> None:
        self._node = node
        self.config = config or RelayConfig()
        self.config.validate()
        self.admission = RelayAdmission(self.config)
        self.stats = RelayStats()
        #: set while a reclaim asks the holders (:meth:`_reclaim`)
        self._reclaiming: trio.Event | None = None
        #: the node's connection manager keeps each slot holder connected (:meth:`_keep_holders`)
        self._kept = KeptPeers(node.protect, "relay slot holder")

    def install(self) -> Registration:
        """Serve HOP; the relay's slots show in the node's resource usage (``dedloc status``)."""
        handler = self._node.set_stream_handler(HOP_PROTOCOL, self._on_hop)
        shown = self._node.resources.register_service(
            "relay", lambda: {"reservations": len(self.admission.slots), "circuits": self.admission.circuit_count})

        def undo() -> None:
            handler.remove()
            shown.remove()
            self._kept.clear()

        return Registration(undo)

    def _keep_holders(self) -> None:
        """Protect the slot holders from the node's connection manager (``p2p/conn_manager.py``), and
        only them: a slot lives only while its holder's connection does (a trimmed holder would be
        unreachable until its next reservation). ``max_reservations`` bounds them."""
        self._kept.keep(self.admission.slots)

    def metrics(self) -> dict[str, int | float | str]:
        """Flat name -> value (refusals and limits hit by reason), as every service's ``metrics()``."""
        self._sweep()
        s = self.stats
        out: dict[str, int | float | str] = {
            "reservations": len(self.admission.slots),
            "circuits": self.admission.circuit_count,
            "circuits_total": s.circuits_total,
            "bytes_relayed": s.bytes_relayed,
            "reclaimed": s.reclaimed,
        }
        out.update({f"refused.{reason}": n for reason, n in s.refused.items()})
        out.update({f"limits_hit.{limit}": n for limit, n in s.limits_hit.items()})
        return out

    @property
    def limit(self) -> pb.Limit:
        return pb.Limit(duration=self.config.circuit_duration, data=self.config.circuit_data)

    # ---------------------------------------------------------------- HOP

    async def _on_hop(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            msg = await read_message(stream, pb.HopMessage)
        except RemoteProtocolError as e:
            log.info("bad HOP request from %s: %s", peer, e)
            await self._status(stream, pb.MALFORMED_MESSAGE, "malformed")
            return
        if _over_relayed_connection(stream):
            await self._status(stream, pb.PERMISSION_DENIED, "relayed connection", kind=_kind(msg))
            return
        service = {pb.HopMessage.RESERVE: "relay.reserve", pb.HopMessage.CONNECT: "relay.connect"}.get(msg.type)
        if service is not None:
            try:
                self._node.resources.allow(service, str(peer), trio.current_time())
            except ResourceLimitExceeded:  # counted by the manager already
                await self._status(stream, pb.RESOURCE_LIMIT_EXCEEDED, f"{service} rate", counted=True, kind=_kind(msg))
                return
        if msg.type == pb.HopMessage.RESERVE:
            await self._reserve(stream, peer)
        elif msg.type == pb.HopMessage.CONNECT:
            await self._connect(stream, peer, msg)
        else:
            await self._status(stream, pb.UNEXPECTED_MESSAGE, "unexpected")

    async def _status(self, stream: INetStream, status: int, reason: str, *, counted: bool = False,
                      kind: str = "") -> None:
        if kind:
            self.stats.responses[(kind, pb.Status.Name(status))] += 1  # type: ignore[arg-type]
        if status != pb.OK:
            if kind:
                self.stats.rejections[(kind, reason)] += 1
            self.stats.refused[reason] += 1
            if not counted and status in LIMIT_STATUSES:
                self._node.resources.count_refusal("relay", reason)
        with trio.move_on_after(2):
            try:
                await write_message(stream, pb.HopMessage(type=pb.HopMessage.STATUS, status=status))  # type: ignore[arg-type]
            except Exception:
                pass
        await finish_quietly(stream.close)

    async def _reserve(self, stream: INetStream, peer: ID) -> None:
        self._sweep()
        await self._reclaim(peer)
        renewal = peer in self.admission.slots
        expire = self.admission.reserve(peer, _remote_ip(stream), time.time())
        if isinstance(expire, Refusal):
            await self._status(stream, expire.status, expire.reason, kind="reservation")
            return
        me = self._node.peer_id
        addrs = [with_peer_id(without_peer_id(a), me).to_bytes() for a in self._node.addrs if not is_relayed(a)]
        reply = pb.HopMessage(
            type=pb.HopMessage.STATUS,
            status=pb.OK,
            reservation=pb.Reservation(expire=expire, addrs=addrs, voucher=self._voucher(peer, expire)),
            limit=self.limit,
        )
        self._keep_holders()
        self.stats.reservations += 1
        self.stats.reservation_types["renewed" if renewal else "opened"] += 1
        self.stats.responses[("reservation", "OK")] += 1
        with trio.move_on_after(5):
            try:
                await write_message(stream, reply)
            except Exception:
                pass
        await finish_quietly(stream.close)

    def _voucher(self, peer: ID, expire: int) -> bytes:
        payload = pb.Voucher(relay=self._node.peer_id.to_bytes(), peer=peer.to_bytes(), expiration=expire).SerializeToString()
        key = self._node.host.get_private_key()
        signature = key.sign(make_unsigned(VOUCHER_DOMAIN, VOUCHER_PAYLOAD_TYPE, payload))
        return Envelope(key.get_public_key(), VOUCHER_PAYLOAD_TYPE, payload, signature).marshal_envelope()

    async def _reclaim(self, newcomer: ID) -> None:
        """Full: ask the longest holders at once whether they still advertise an address through us,
        and free the slots of those that do not (:meth:`RelayAdmission.reclaim_candidates`). A holder
        that does not answer in time keeps its slot, and is not asked again for ``reclaim_recheck``
        (a request for a slot costs the relay at most ``reclaim_checks`` questions, each holder one in
        that time, however many newcomers ask). One reclaim runs at a time; requests meanwhile wait for it."""
        if self._reclaiming is not None:
            await self._reclaiming.wait()
            return
        candidates = self.admission.reclaim_candidates(time.time(), newcomer)
        if not candidates:
            return
        self._reclaiming = done = trio.Event()
        me = self._node.peer_id

        async def ask(holder: ID) -> None:
            uses = True
            with trio.move_on_after(self.config.reclaim_timeout):
                try:
                    info = await self._node.identify(holder, timeout=self.config.reclaim_timeout)
                    uses = advertises_through(info.listen_addrs, me)
                except Exception as e:
                    log.debug("relay: could not ask %s about its slot: %s", holder, e)
            if self.admission.heard(holder, uses, time.time()):
                self.stats.reclaimed += 1
                log.info("relay: reclaimed the slot of %s (it no longer advertises an address through us)", holder)

        try:
            async with trio.open_nursery() as nursery:
                for holder in candidates:
                    nursery.start_soon(ask, holder)
        finally:
            self._reclaiming = None
            self._keep_holders()
            done.set()

    def _sweep(self) -> None:
        network = self._node.network
        self.admission.sweep(time.time(), lambda peer: live_connection(network, peer) is not None)
        self._keep_holders()

    async def _connect(self, stream: INetStream, source: ID, msg: pb.HopMessage) -> None:
        try:
            if not msg.HasField("peer"):
                raise RemoteProtocolError("CONNECT without a peer")
            target = require_peer_id(msg.peer.id, "CONNECT peer")
        except RemoteProtocolError as e:
            log.info("bad CONNECT from %s: %s", source, e)
            await self._status(stream, pb.MALFORMED_MESSAGE, "malformed", kind="connection")
            return
        self._sweep()
        refusal = self.admission.open_circuit(source, target)
        if refusal is not None:
            await self._status(stream, refusal.status, refusal.reason, kind="connection")
            return
        try:
            stop = await self._open_stop(source, target)
            if stop is None:
                await self._status(stream, pb.CONNECTION_FAILED, "target did not accept", kind="connection")
                return
            # both ends stay connected while the circuit runs (``max_circuits`` bounds them)
            with self._node.protect(source, "relay circuit"), self._node.protect(target, "relay circuit"):
                await self._bridge(stream, stop, accepted=lambda: self._accepted(stream, stop, target))
        finally:
            self.admission.close_circuit(source, target)

    async def _open_stop(self, source: ID, target: ID) -> INetStream | None:
        """A STOP stream to ``target`` with its CONNECT written (the answer is :meth:`_accepted`'s)."""
        with trio.move_on_after(self.config.connect_timeout):
            try:
                stop = await self._node.new_stream(target, STOP_PROTOCOL)
                await write_message(
                    stop, pb.StopMessage(type=pb.StopMessage.CONNECT, peer=pb.Peer(id=source.to_bytes()), limit=self.limit)
                )
                return stop
            except Exception as e:
                log.info("STOP to %s failed: %s", target, e)
        return None

    async def _accepted(self, hop: INetStream, stop: INetStream, target: ID) -> bool:
        """Read the target's answer to the STOP and pass it to the source: OK (the circuit is
        up) or CONNECTION_FAILED (the HOP stream is then closed)."""
        try:
            reply = await read_message(stop, pb.StopMessage, timeout=self.config.connect_timeout)
            ok = reply.type == pb.StopMessage.STATUS and reply.status == pb.OK
        except Exception as e:
            log.info("STOP to %s failed: %s", target, e)
            ok = False
        if not ok:
            await self._status(hop, pb.CONNECTION_FAILED, "target did not accept", kind="connection")
            return False
        try:
            await write_message(hop, pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.OK, limit=self.limit))
        except Exception:
            return False
        self.stats.circuits_total += 1
        self.stats.responses[("connection", "OK")] += 1
        return True

    # ---------------------------------------------------------------- bridging

    async def _bridge(self, a: INetStream, b: INetStream, accepted: Callable[[], Awaitable[bool]]) -> None:
        """Copy bytes both ways until both sides end; reset both on a limit or a failure.

        ``a``'s bytes go to ``b`` at once, behind the STOP's CONNECT, before ``b`` accepts: a
        source that writes its security handshake's first message with its CONNECT (as ours
        do) saves a round trip through the relay, and a target reads its STOP message and not
        a byte more (the spec's readers are unbuffered for this). ``b``'s bytes go to ``a``
        only once ``accepted`` has answered ``a`` OK, so the source reads its answer first; a
        refusal ends the circuit (``b`` reset, ``a`` closed behind its answer).
        """
        cfg = self.config
        failed = False

        async def pump(src: INetStream, dst: INetStream) -> None:
            nonlocal failed
            budget = cfg.circuit_data or None
            started = trio.current_time()
            sent = 0
            try:
                while True:
                    try:
                        data = await src.read(BRIDGE_READ)
                    except EOFError:
                        data = b""
                    if not data:
                        await dst.close()
                        return
                    if budget is not None:
                        budget -= len(data)
                        if budget < 0:
                            self.stats.limits_hit["data"] += 1
                            raise _LimitReached("data limit")
                    await dst.write(data)
                    sent += len(data)
                    self.stats.bytes_relayed += len(data)
                    if cfg.circuit_bandwidth:
                        ahead = sent / cfg.circuit_bandwidth - (trio.current_time() - started)
                        if ahead > 0:
                            await trio.sleep(ahead)
            except Exception as e:
                log.debug("circuit ended: %r", e)
                failed = True
                nursery.cancel_scope.cancel()

        with trio.move_on_after(cfg.circuit_duration or float("inf")) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, a, b)
                if await accepted():
                    nursery.start_soon(pump, b, a)
                else:
                    nursery.cancel_scope.cancel()
                    await finish_quietly(b.reset)
                    return
        if scope.cancelled_caught:
            self.stats.limits_hit["duration"] += 1
        if failed or scope.cancelled_caught:
            await finish_quietly(a.reset)
            await finish_quietly(b.reset)


def _kind(msg: pb.HopMessage) -> str:
    return "reservation" if msg.type == pb.HopMessage.RESERVE else "connection"


def _over_relayed_connection(stream: INetStream) -> bool:
    try:
        return any(is_relayed(addr) for addr in stream.muxed_conn.get_transport_addresses())
    except Exception:
        return False


def _remote_ip(stream: INetStream) -> str:
    try:
        remote = stream.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
        if remote:
            return str(remote[0])
    except Exception:
        pass
    return "?"


__all__ = ["RelayConfig", "RelayService", "RelayStats", "is_relayed_conn"]
