"""Circuit relay v2, client side: reservations, accepting relayed connections, dialing through relays.

Why not py-libp2p's: its ``host.connect`` refuses ``/p2p-circuit`` addresses,
its receiving side labels circuits with the wrong relay id, and its read path
retries with sleeps. The protocol itself is small (libp2p/specs
relay/circuit-v2.md): a HOP stream to the relay carries RESERVE or CONNECT;
the relay opens a STOP stream to the target; after one STATUS:OK each way,
both streams *are* the connection, which we upgrade (Noise + Yamux) like TCP.

A relayed connection is just another connection in py-libp2p's swarm, so
streams, identify and RPC work over it unchanged, and the Node's dialer uses
:meth:`RelayClient.dial` for any ``/p2p-circuit`` address.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetConn, INetStream, IRawConnection
from libp2p.connection_types import ConnectionType
from libp2p.peer.envelope import make_unsigned, unmarshal_envelope
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import Node
from p2p.addresses import Scope, is_relayed, peer_id_of, scope_of, split_circuit, with_peer_id, without_peer_id
from p2p.conn_manager import KeptPeers
from p2p.errors import ConfigError, DedlocError, DialError, RemoteProtocolError
from p2p.hooks import Metrics, Registration
from p2p.trio_util import finish_quietly
from p2p.untrusted import decode_addrs, require_peer_id
from p2p.wire import MAX_ADDRS, read_message, write_message

from .proto import circuit_pb2 as pb

log = logging.getLogger(__name__)

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
STOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/stop"
VOUCHER_DOMAIN = "libp2p-relay-rsvp"
VOUCHER_PAYLOAD_TYPE = b"\x03\x02"

STATUS_NAMES = {v: k for k, v in pb.Status.items()}
#: What a relay's refusal means, for the refused peer's error message (the spec sends a code, no text).
STATUS_TEXTS: dict[int, str] = {
    pb.RESERVATION_REFUSED: "no reservation slot free, in all or for your address",
    pb.RESOURCE_LIMIT_EXCEEDED: "over one of the relay's limits (circuits in all or per peer, or a request rate)",
    pb.PERMISSION_DENIED: "not allowed",
    pb.NO_RESERVATION: "the target holds no reservation on this relay",
    pb.CONNECTION_FAILED: "the relay could not reach the target",
}


def describe_status(status: int) -> str:
    name = STATUS_NAMES.get(status, str(status))  # type: ignore[call-overload]
    text = STATUS_TEXTS.get(status)
    return f"{name} ({text})" if text else name


class RelayError(DedlocError):
    """A relay refused or failed a request; ``status`` is the spec's code (0 when none came)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limit:
    """What a relay allows one relayed connection: seconds and bytes per direction (0: no limit)."""

    duration: int = 0
    data: int = 0

    @classmethod
    def from_pb(cls, limit: pb.Limit) -> Limit:
        return cls(duration=limit.duration, data=limit.data)


@dataclass(frozen=True)
class Reservation:
    """A slot on a relay: others reach us at ``<relay addr>/p2p-circuit/p2p/<us>`` until ``expire``."""

    relay: ID
    expire: float
    addrs: list[Multiaddr]
    limit: Limit
    voucher_ok: bool = False
    reserved_at: float = field(default_factory=time.time)

    @property
    def circuit_addrs(self) -> list[Multiaddr]:
        """Our addresses through this relay, without our own /p2p suffix (the host adds it)."""
        return [Multiaddr(f"{with_peer_id(without_peer_id(a), self.relay)}/p2p-circuit") for a in self.addrs]


class CircuitConnection(IRawConnection):
    """A relayed stream seen as a raw connection, ready for Noise + Yamux on top.

    ``read`` returns ``b""`` at the end, as a socket would; the address is the
    circuit address, so everything above knows the connection is relayed.
    """

    def __init__(self, stream: INetStream, *, initiator: bool, relay_addr: Multiaddr,
                 answer: Callable[[], Awaitable[None]] | None = None) -> None:
        self.stream = stream
        self.is_initiator = initiator
        self._addr = relay_addr
        #: The relay's answer to a CONNECT written without waiting for it (see
        #: :meth:`RelayClient.dial`): read and checked in front of the first bytes.
        self._answer = answer
        #: Why the relay refused, once the answer said so.
        self.refusal: RelayError | None = None

    async def read(self, n: int | None = None) -> bytes:
        if self._answer is not None:
            answer, self._answer = self._answer, None
            try:
                await answer()
            except RelayError as e:
                self.refusal = e
                raise
        try:
            return await self.stream.read(n)
        except EOFError:
            return b""

    async def write(self, data: bytes) -> None:
        await self.stream.write(data)

    async def close(self) -> None:
        try:
            await self.stream.close()
        except Exception:
            await self.stream.reset()

    def get_remote_address(self) -> tuple[str, int] | None:
        return None

    def get_transport_addresses(self) -> list[Multiaddr]:
        return [self._addr]

    def get_connection_type(self) -> ConnectionType:
        return ConnectionType.RELAYED


@dataclass
class RelayClientConfig:
    #: Time for one relay exchange (RESERVE, CONNECT, STOP) and for upgrading the circuit.
    timeout: float = 10.0
    #: Accept relayed connections from relays we hold no slot on (tests; the spec lets a client refuse them).
    accept_unreserved: bool = False

    def validate(self) -> None:
        if self.timeout <= 0:
            raise ConfigError("relay client timeout must be positive")


class RelayClient:
    """Reserve slots on relays, accept connections they relay to us, dial peers through them."""

    def __init__(self, node: Node, config: RelayClientConfig | None = None) -> None:
        self._node = node
        self.config = config or RelayClientConfig()
        self.config.validate()
        self._timeout = self.config.timeout
        self._accept_unreserved = self.config.accept_unreserved
        #: Current reservations by relay.
        self.reservations: dict[ID, Reservation] = {}
        #: the node's connection manager keeps each relay holding our slot connected (the slot
        #: lives only while that connection does)
        self._kept = KeptPeers(node.protect, "our relay slot")
        self.counts: Counter[str] = Counter({"reservations": 0, "reservation_failures": 0, "relayed_in": 0, "relayed_out": 0})

    def install(self) -> Registration:
        """Accept relayed connections and dial ``/p2p-circuit`` addresses, until the handle is removed."""
        handler = self._node.set_stream_handler(STOP_PROTOCOL, self._on_stop, hands_on=True)  # it becomes a connection
        dialer = self._node.set_circuit_dialer(self.dial)

        def undo() -> None:
            handler.remove()
            dialer.remove()
            self._kept.clear()

        return Registration(undo)

    def metrics(self) -> Metrics:
        return dict(self.counts)

    # ---------------------------------------------------------------- reservations

    async def reserve(self, relay: ID) -> Reservation:
        """Reserve (or refresh) a slot on ``relay``, which we must be able to reach."""
        try:
            stream = await self._node.new_stream(relay, HOP_PROTOCOL)
        except DedlocError as e:
            self.counts["reservation_failures"] += 1
            raise RelayError(f"{relay} offers no relay service: {e}") from e
        try:
            with trio.fail_after(self._timeout):
                await write_message(stream, pb.HopMessage(type=pb.HopMessage.RESERVE))
                reply = await read_message(stream, pb.HopMessage, timeout=self._timeout)
        except (RemoteProtocolError, trio.TooSlowError, Exception) as e:
            self.counts["reservation_failures"] += 1
            await finish_quietly(stream.reset)
            raise RelayError(f"reservation on {relay} failed: {e}") from e
        await finish_quietly(stream.close)
        if reply.type != pb.HopMessage.STATUS or reply.status != pb.OK:
            self.counts["reservation_failures"] += 1
            raise RelayError(f"{relay} refused the reservation: {describe_status(reply.status)}", reply.status)
        rsvp = reply.reservation
        expire = float(rsvp.expire)
        if expire <= time.time():
            raise RelayError(f"{relay} granted a reservation that has already expired")
        reached = self._connected_addrs(relay)
        addrs = [a for a in decode_addrs(rsvp.addrs, limit=MAX_ADDRS) if peer_id_of(a) in (None, relay) and not is_relayed(a)]
        if not any(scope_of(a) == Scope.LOOPBACK for a in reached):
            addrs = [a for a in addrs if scope_of(a) != Scope.LOOPBACK]  # useless to anyone else
        if not addrs:  # a relay that lists no usable address: use how we reached it
            addrs = [with_peer_id(a, relay) for a in reached]
        reservation = Reservation(
            relay=relay,
            expire=expire,
            addrs=addrs,
            limit=Limit.from_pb(reply.limit) if reply.HasField("limit") else Limit(),
            voucher_ok=_voucher_ok(rsvp.voucher, relay, self._node.peer_id, rsvp.expire) if rsvp.voucher else False,
        )
        self.reservations[relay] = reservation
        self._kept.keep(self.reservations)
        self.counts["reservations"] += 1
        return reservation

    def drop(self, relay: ID) -> None:
        self.reservations.pop(relay, None)
        self._kept.keep(self.reservations)

    def _connected_addrs(self, relay: ID) -> list[Multiaddr]:
        out: list[Multiaddr] = []
        for conn in self._node.network.get_connections(relay):
            out.extend(a for a in conn.get_transport_addresses() if not is_relayed(a))
        return out

    # ---------------------------------------------------------------- inbound circuits

    async def _on_stop(self, stream: INetStream) -> None:
        relay = stream.muxed_conn.peer_id
        try:
            msg = await read_message(stream, pb.StopMessage, timeout=self._timeout)
            if msg.type != pb.StopMessage.CONNECT or not msg.HasField("peer"):
                await write_message(stream, pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.UNEXPECTED_MESSAGE))
                raise RemoteProtocolError(f"{relay} sent a STOP message that is not CONNECT")
            source = require_peer_id(msg.peer.id, "STOP CONNECT peer")
        except RemoteProtocolError as e:
            log.info("bad STOP request from %s: %s", relay, e)
            await finish_quietly(stream.reset)
            return
        if relay not in self.reservations and not self._accept_unreserved:
            await write_message(stream, pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.PERMISSION_DENIED))
            await finish_quietly(stream.close)
            return
        await write_message(stream, pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.OK))
        circuit = Multiaddr(f"/p2p/{relay}/p2p-circuit/p2p/{source}")
        raw = CircuitConnection(stream, initiator=False, relay_addr=Multiaddr(f"/p2p/{relay}/p2p-circuit"))
        try:
            with trio.fail_after(self._timeout):
                muxed = await self._node.host.upgrade_inbound_connection(raw, circuit)
        except Exception as e:
            log.info("relayed connection from %s via %s failed to upgrade: %s", source, relay, e)
            await finish_quietly(stream.reset)
            return
        if muxed.peer_id != source:
            log.info("relayed connection via %s claimed to be from %s but is from %s", relay, source, muxed.peer_id)
            await muxed.close()
            return
        self.counts["relayed_in"] += 1

    # ---------------------------------------------------------------- outbound circuits

    async def dial(self, addr: Multiaddr, target: ID) -> INetConn:
        """Connect to ``target`` through the relay named in ``addr`` (``…/p2p/R/p2p-circuit``)."""
        relay_addr, relay = split_circuit(addr)
        if relay == self._node.peer_id:
            raise RelayError("will not relay through ourselves")
        if relay == target:
            raise RelayError(f"{addr} relays a peer through itself")
        try:
            if without_peer_id(relay_addr).protocols():
                await self._node.connect(relay_addr)
            else:
                await self._node.connect(relay)
        except DialError as e:
            raise RelayError(f"cannot reach relay {relay}: {e}") from e
        stream = await self._node.new_stream(relay, HOP_PROTOCOL)

        async def answer() -> None:
            try:
                reply = await read_message(stream, pb.HopMessage, timeout=self._timeout)
            except Exception as e:
                raise RelayError(f"relay {relay} did not answer a CONNECT to {target}: {e}") from e
            if reply.type != pb.HopMessage.STATUS or reply.status != pb.OK:
                raise RelayError(f"relay {relay} could not connect us to {target}: {describe_status(reply.status)}",
                                 reply.status)

        # The CONNECT and the security handshake's first message go out together, without
        # waiting for the relay's answer (read in front of the first bytes back): a relay reads
        # the CONNECT and not a byte more (the spec's readers are unbuffered for this), and ours
        # forwards the rest behind its STOP, so the handshake's first round trip rides on the
        # relay's: the dialer holds a relayed connection one round trip through the relay after it
        # asks, not two.
        raw = CircuitConnection(stream, initiator=True, relay_addr=Multiaddr(f"/p2p/{relay}/p2p-circuit"),
                                answer=answer)
        try:
            with trio.fail_after(self._timeout):
                await write_message(stream, pb.HopMessage(type=pb.HopMessage.CONNECT, peer=pb.Peer(id=target.to_bytes())))
                conn = await self._node.host.upgrade_outbound_connection(raw, target)
        except Exception as e:
            await finish_quietly(stream.reset)
            if raw.refusal is not None:
                raise raw.refusal from e
            raise RelayError(f"relayed connection to {target} via {relay} failed to upgrade: {e}") from e
        self.counts["relayed_out"] += 1
        return conn


def _voucher_ok(data: bytes, relay: ID, peer: ID, expire: int) -> bool:
    """Whether a reservation voucher is signed by the relay and says what the reservation says."""
    try:
        envelope = unmarshal_envelope(bytes(data))
        if envelope.payload_type != VOUCHER_PAYLOAD_TYPE:
            return False
        unsigned = make_unsigned(VOUCHER_DOMAIN, envelope.payload_type, envelope.raw_payload)
        if ID.from_pubkey(envelope.public_key) != relay or not envelope.public_key.verify(unsigned, envelope.signature):
            return False
        voucher = pb.Voucher.FromString(envelope.raw_payload)
        return voucher.relay == relay.to_bytes() and voucher.peer == peer.to_bytes() and voucher.expiration == expire
    except Exception:
        return False
