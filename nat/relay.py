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
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetStream
from libp2p.peer.envelope import Envelope, make_unsigned
from libp2p.peer.id import ID

from p2p import Node
from p2p.addresses import is_relayed, with_peer_id, without_peer_id
from p2p.dialer import live_connection
from p2p.errors import ConfigError
from p2p.trio_util import finish_quietly

from .circuit import HOP_PROTOCOL, STOP_PROTOCOL, VOUCHER_DOMAIN, VOUCHER_PAYLOAD_TYPE, is_relayed_conn
from .proto import circuit_pb2 as pb
from .wire import ProtocolViolation, parse_peer_id, read_message, write_message

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

    def validate(self) -> None:
        for name in ("max_reservations", "max_reservations_per_ip", "reservation_ttl", "max_circuits", "max_circuits_per_peer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"relay {name} must be at least 1")
        for name in ("circuit_duration", "circuit_data", "circuit_bandwidth"):
            if getattr(self, name) < 0:
                raise ConfigError(f"relay {name} must not be negative (0 means no limit)")
        if self.connect_timeout <= 0:
            raise ConfigError("relay connect_timeout must be positive")


@dataclass
class _Slot:
    peer: ID
    ip: str
    expire: float


@dataclass
class RelayStats:
    """What a relay has served; ``dedloc relay`` reports it."""

    reservations: int = 0
    circuits: int = 0
    circuits_total: int = 0
    bytes_relayed: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    #: Circuits reset for exceeding a limit, by limit ("data", "duration").
    limits_hit: Counter[str] = field(default_factory=Counter)


class _LimitReached(Exception):
    pass


class RelayService:
    """The HOP side of circuit relay v2, mounted on a Node."""

    def __init__(self, node: Node, config: RelayConfig | None = None) -> None:
        self._node = node
        self.config = config or RelayConfig()
        self.config.validate()
        self._slots: dict[ID, _Slot] = {}
        self._circuits: Counter[ID] = Counter()
        self.stats = RelayStats()

    def install(self) -> None:
        self._node.set_stream_handler(HOP_PROTOCOL, self._on_hop)

    def snapshot(self) -> dict[str, object]:
        self._sweep()
        s = self.stats
        return {
            "reservations": len(self._slots),
            "circuits": sum(self._circuits.values()) // 2,
            "circuits_total": s.circuits_total,
            "bytes_relayed": s.bytes_relayed,
            "refused": dict(s.refused),
            "limits_hit": dict(s.limits_hit),
        }

    @property
    def limit(self) -> pb.Limit:
        return pb.Limit(duration=self.config.circuit_duration, data=self.config.circuit_data)

    # ---------------------------------------------------------------- HOP

    async def _on_hop(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            msg = await read_message(stream, pb.HopMessage)
        except ProtocolViolation as e:
            log.info("bad HOP request from %s: %s", peer, e)
            await self._status(stream, pb.MALFORMED_MESSAGE, "malformed")
            return
        if _over_relayed_connection(stream):
            await self._status(stream, pb.PERMISSION_DENIED, "relayed connection")
            return
        if msg.type == pb.HopMessage.RESERVE:
            await self._reserve(stream, peer)
        elif msg.type == pb.HopMessage.CONNECT:
            await self._connect(stream, peer, msg)
        else:
            await self._status(stream, pb.UNEXPECTED_MESSAGE, "unexpected")

    async def _status(self, stream: INetStream, status: int, reason: str) -> None:
        if status != pb.OK:
            self.stats.refused[reason] += 1
        with trio.move_on_after(2):
            try:
                await write_message(stream, pb.HopMessage(type=pb.HopMessage.STATUS, status=status))  # type: ignore[arg-type]
            except Exception:
                pass
        await finish_quietly(stream.close)

    async def _reserve(self, stream: INetStream, peer: ID) -> None:
        self._sweep()
        ip = _remote_ip(stream)
        if peer not in self._slots:
            if len(self._slots) >= self.config.max_reservations:
                await self._status(stream, pb.RESERVATION_REFUSED, "too many reservations")
                return
            if sum(1 for s in self._slots.values() if s.ip == ip) >= self.config.max_reservations_per_ip:
                await self._status(stream, pb.RESERVATION_REFUSED, "too many reservations from one IP")
                return
        expire = int(time.time()) + self.config.reservation_ttl
        self._slots[peer] = _Slot(peer, ip, expire)
        me = self._node.peer_id
        addrs = [with_peer_id(without_peer_id(a), me).to_bytes() for a in self._node.addrs if not is_relayed(a)]
        reply = pb.HopMessage(
            type=pb.HopMessage.STATUS,
            status=pb.OK,
            reservation=pb.Reservation(expire=expire, addrs=addrs, voucher=self._voucher(peer, expire)),
            limit=self.limit,
        )
        self.stats.reservations += 1
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

    def _sweep(self) -> None:
        """Forget reservations that expired or whose peer disconnected."""
        now = time.time()
        network = self._node.network
        for peer, slot in list(self._slots.items()):
            if slot.expire <= now or live_connection(network, peer) is None:
                del self._slots[peer]

    async def _connect(self, stream: INetStream, source: ID, msg: pb.HopMessage) -> None:
        try:
            if not msg.HasField("peer"):
                raise ProtocolViolation("CONNECT without a peer")
            target = parse_peer_id(msg.peer.id, "CONNECT peer")
        except ProtocolViolation:
            await self._status(stream, pb.MALFORMED_MESSAGE, "malformed")
            return
        self._sweep()
        if target not in self._slots:
            await self._status(stream, pb.NO_RESERVATION, "no reservation")
            return
        cfg = self.config
        if sum(self._circuits.values()) // 2 >= cfg.max_circuits:
            await self._status(stream, pb.RESOURCE_LIMIT_EXCEEDED, "too many circuits")
            return
        if self._circuits[source] >= cfg.max_circuits_per_peer or self._circuits[target] >= cfg.max_circuits_per_peer:
            await self._status(stream, pb.RESOURCE_LIMIT_EXCEEDED, "too many circuits for a peer")
            return
        self._circuits[source] += 1
        self._circuits[target] += 1
        try:
            stop = await self._open_stop(source, target)
            if stop is None:
                await self._status(stream, pb.CONNECTION_FAILED, "target did not accept")
                return
            try:
                await write_message(stream, pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.OK, limit=self.limit))
            except Exception:
                await finish_quietly(stop.reset)
                await finish_quietly(stream.reset)
                return
            self.stats.circuits_total += 1
            await self._bridge(stream, stop)
        finally:
            self._circuits[source] -= 1
            self._circuits[target] -= 1
            self._circuits += Counter()  # drop zero counts

    async def _open_stop(self, source: ID, target: ID) -> INetStream | None:
        stop: INetStream | None = None
        with trio.move_on_after(self.config.connect_timeout):
            try:
                stop = await self._node.new_stream(target, STOP_PROTOCOL)
                await write_message(
                    stop, pb.StopMessage(type=pb.StopMessage.CONNECT, peer=pb.Peer(id=source.to_bytes()), limit=self.limit)
                )
                reply = await read_message(stop, pb.StopMessage, timeout=self.config.connect_timeout)
            except Exception as e:
                log.info("STOP to %s failed: %s", target, e)
            else:
                if reply.type == pb.StopMessage.STATUS and reply.status == pb.OK:
                    return stop
        if stop is not None:
            await finish_quietly(stop.reset)
        return None

    # ---------------------------------------------------------------- bridging

    async def _bridge(self, a: INetStream, b: INetStream) -> None:
        """Copy bytes both ways until both sides end; reset both on a limit or a failure."""
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
                nursery.start_soon(pump, b, a)
        if scope.cancelled_caught:
            self.stats.limits_hit["duration"] += 1
        if failed or scope.cancelled_caught:
            await finish_quietly(a.reset)
            await finish_quietly(b.reset)


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
