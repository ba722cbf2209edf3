"""Circuit relay v2 on loopback: reservations, relayed connections, the relay's limits, bad input."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import trio
from libp2p.abc import INetConn, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.peer.envelope import Envelope, make_unsigned, unmarshal_envelope
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from nat.circuit import (
    HOP_PROTOCOL,
    STOP_PROTOCOL,
    VOUCHER_DOMAIN,
    VOUCHER_PAYLOAD_TYPE,
    CircuitConnection,
    Limit,
    RelayClient,
    RelayClientConfig,
    RelayError,
    Reservation,
    _voucher_ok,
    describe_status,
)
from nat.proto import circuit_pb2 as pb
from nat.relay import (
    BRIDGE_READ,
    RelayAdmission,
    RelayConfig,
    RelayService,
    Refusal,
    _kind,
    _remote_ip,
    _Slot,
    advertises_through,
)
from p2p.addresses import is_relayed_conn
from p2p.wire import read_message, write_message
from p2p import Node
from p2p.dialer import live_connection
from p2p.errors import ConfigError, DialError, StreamOpenError
from p2p.hooks import Registration
from p2p.resources import Rate, ResourceLimitExceeded
from p2p.resources import Scope as ResourceScope
from p2p.varint import encode_varint

from .conftest import open_nodes
from .kit import End, ends, log_lines, random_peer_id, read_to_end, wait_until

SINK = "/dedloc/test/checksum/1.0.0"
#: A well-formed peer id (an identity multihash of 36 bytes) of nobody here.
ID_BYTES = b"\x00\x24" + bytes(36)


@dataclass
class Peer:
    node: Node
    client: RelayClient


@dataclass
class Net:
    relay: Node
    service: RelayService
    peers: list[Peer]

    @property
    def circuit(self) -> Multiaddr:
        """How to reach a peer through the relay (``…/p2p/R/p2p-circuit``)."""
        return Multiaddr(f"{self.relay.addrs[0]}/p2p-circuit")


@asynccontextmanager
async def relay_net(n: int = 2, config: RelayConfig | None = None) -> AsyncIterator[Net]:
    """A relay and ``n`` peers connected to it, each with a relay client and a checksum sink."""
    async with open_nodes(n + 1) as (relay, *nodes):
        service = RelayService(relay, config)
        service.install()
        peers = []
        for node in nodes:
            client = RelayClient(node)
            client.install()
            node.set_stream_handler(SINK, _checksum_sink)
            await node.connect(relay.addrs[0])
            peers.append(Peer(node, client))
        yield Net(relay, service, peers)


async def _read_exactly(stream: INetStream, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = await stream.read(n - len(data))
        if not chunk:
            raise EOFError(f"stream ended after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


async def _checksum_sink(stream: INetStream) -> None:
    """Read everything, answer its sha256, then send a payload of the requested size with its sha256."""
    size = int.from_bytes(await _read_exactly(stream, 8), "big")
    received = await read_to_end(stream)
    payload = os.urandom(size)
    await stream.write(hashlib.sha256(received).digest() + hashlib.sha256(payload).digest() + payload)
    await stream.close()


async def transfer(conn: INetConn, node: Node, up: int, down: int) -> None:
    """Send ``up`` bytes over ``conn`` and get ``down`` back, both checked by sha256."""
    stream = await node.new_stream_on(conn, SINK)
    sent = os.urandom(up)

    async def send() -> None:
        await stream.write(down.to_bytes(8, "big"))
        for i in range(0, len(sent), 1 << 16):
            await stream.write(sent[i : i + (1 << 16)])
        await stream.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        echoed = await _read_exactly(stream, 32)
        digest = await _read_exactly(stream, 32)
        payload = await read_to_end(stream)
    assert echoed == hashlib.sha256(sent).digest(), "data sent through the circuit arrived altered"
    assert len(payload) == down and hashlib.sha256(payload).digest() == digest, "data received through the circuit is altered"


def _padded(message: pb.HopMessage, size: int) -> pb.HopMessage:
    """A valid message made ``size`` bytes longer by an unknown field (which decoders keep)."""
    padded = type(message)()
    padded.MergeFromString(message.SerializeToString() + b"\x7a" + encode_varint(size) + bytes(size))
    return padded


def frame(message: pb.HopMessage | pb.StopMessage) -> bytes:
    body = message.SerializeToString()
    return encode_varint(len(body)) + body


# ---------------------------------------------------------------------- reservations


async def test_reservation_round_trip_and_voucher():
    async with relay_net(1) as net:
        (b,) = net.peers
        rsvp = await b.client.reserve(net.relay.peer_id)
        assert rsvp.relay == net.relay.peer_id
        assert rsvp.expire > time.time()
        assert rsvp.addrs and all(str(a).endswith(f"/p2p/{net.relay.peer_id}") for a in rsvp.addrs)
        assert rsvp.voucher_ok
        assert all(str(a).endswith(f"/p2p/{net.relay.peer_id}/p2p-circuit") for a in rsvp.circuit_addrs)
        assert b.client.reservations[net.relay.peer_id] is rsvp
        assert net.service.metrics()["reservations"] == 1

        # The voucher itself: signed by the relay, naming the relay, the peer and the expiry.
        expire = int(rsvp.expire)
        voucher = net.service._voucher(b.node.peer_id, expire)
        relay, peer = net.relay.peer_id, b.node.peer_id
        assert _voucher_ok(voucher, relay, peer, expire)
        assert not _voucher_ok(voucher, relay, peer, expire + 1)  # another expiry
        assert not _voucher_ok(voucher, peer, peer, expire)  # another relay
        assert not _voucher_ok(voucher, relay, relay, expire)  # another peer
        assert not _voucher_ok(b"garbage", relay, peer, expire)
        envelope = unmarshal_envelope(voucher)
        signature = bytearray(envelope.signature)
        signature[5] ^= 0x01
        envelope.signature = bytes(signature)
        assert not _voucher_ok(envelope.marshal_envelope(), relay, peer, expire)
        # A payload that says something else, under the original signature.
        envelope = unmarshal_envelope(voucher)
        forged = pb.Voucher.FromString(envelope.raw_payload)
        forged.peer = relay.to_bytes()
        envelope.raw_payload = forged.SerializeToString()
        assert not _voucher_ok(envelope.marshal_envelope(), relay, relay, expire)
        # A voucher that says the right things but that another key signed.
        async with open_nodes(1) as (other,):
            payload = pb.Voucher(relay=relay.to_bytes(), peer=peer.to_bytes(), expiration=expire).SerializeToString()
            key = other.host.get_private_key()
            signature = key.sign(make_unsigned(VOUCHER_DOMAIN, VOUCHER_PAYLOAD_TYPE, payload))
            impostor = Envelope(key.get_public_key(), VOUCHER_PAYLOAD_TYPE, payload, signature).marshal_envelope()
        assert not _voucher_ok(impostor, relay, peer, expire)


async def test_relayed_connection_carries_checksummed_data_both_ways():
    async with relay_net(2) as net:
        a, b = net.peers
        await b.client.reserve(net.relay.peer_id)
        conn = await a.client.dial(net.circuit, b.node.peer_id)
        assert is_relayed_conn(conn)
        assert a.node.connected_peers().count(b.node.peer_id) == 1
        with trio.fail_after(30):
            await transfer(conn, a.node, 1 << 20, 1 << 20)
        # The receiving side sees a relayed connection too, labelled with the right relay.
        inbound = [c for c in b.node.network.get_connections(a.node.peer_id) if is_relayed_conn(c)]
        assert inbound
        assert f"/p2p/{net.relay.peer_id}/p2p-circuit" in str(inbound[0].get_transport_addresses()[0])
        assert a.client.metrics()["relayed_out"] == 1 and b.client.metrics()["relayed_in"] == 1
        stats = net.service.metrics()
        assert stats["circuits"] == 1 and stats["circuits_total"] == 1
        assert stats["bytes_relayed"] >= 2 << 20


async def test_connect_to_peer_without_reservation():
    async with relay_net(2) as net:
        a, b = net.peers
        with pytest.raises(RelayError) as info:
            await a.client.dial(net.circuit, b.node.peer_id)
        assert info.value.status == pb.NO_RESERVATION and "NO_RESERVATION" in str(info.value)
        assert b.node.peer_id not in a.node.connected_peers()
        assert net.service.stats.refused["no reservation"] == 1
        # A peer gone (or never reserved) is everyday on a public relay, not a limit hit: it is not
        # one of the node's refusals, whose bursts are the operator's ERROR line.
        assert net.relay.resources.refusal_counts() == {}


async def test_reservation_refused_when_relay_is_full():
    async with relay_net(3, RelayConfig(max_reservations=2)) as net:
        a, b, c = net.peers
        await a.client.reserve(net.relay.peer_id)
        await b.client.reserve(net.relay.peer_id)
        with pytest.raises(RelayError) as info:
            await c.client.reserve(net.relay.peer_id)
        assert info.value.status == pb.RESERVATION_REFUSED and "RESERVATION_REFUSED" in str(info.value)
        assert net.relay.peer_id not in c.client.reservations
        assert c.client.metrics()["reservation_failures"] == 1
        assert net.service.stats.refused == {"too many reservations": 1}
        assert net.relay.resources.refusal_counts() == {"service.relay.too_many_reservations": 1}
        # A peer that holds a slot may refresh it while the relay is full.
        await a.client.reserve(net.relay.peer_id)
        assert net.service.metrics()["reservations"] == 2


async def fill_with_a_silent_holder(net: Net) -> list[float]:
    """The relay's two slots taken by peers 0 and 1, peer 0 never answering identify; when it was asked."""
    silent, a = net.peers[:2]
    asked: list[float] = []

    async def never_answers(stream: INetStream) -> None:
        asked.append(time.monotonic())
        await trio.sleep(5)

    silent.node.host.set_stream_handler(IDENTIFY_PROTOCOL, never_answers)
    await silent.client.reserve(net.relay.peer_id)
    await a.client.reserve(net.relay.peer_id)
    return asked


async def test_a_full_relay_reclaims_unadvertised_slots_and_asks_a_silent_holder_once():
    """Full: the holders are asked (identify) whether they advertise an address through the relay.
    These bare nodes advertise none, so a newcomer gets the slot of one; a holder that does not answer
    in time keeps its slot and is not asked again for reclaim_recheck, however many newcomers come."""
    config = RelayConfig(max_reservations=2, reclaim_grace=0.0, reclaim_timeout=0.5)
    async with relay_net(4, config) as net:
        silent, a, b, c = net.peers
        asked = await fill_with_a_silent_holder(net)
        await b.client.reserve(net.relay.peer_id)  # a's slot is taken back, the silent one's kept
        assert set(net.service.admission.slots) == {silent.node.peer_id, b.node.peer_id}
        assert net.service.stats.reclaimed == 1 and len(asked) == 1
        await c.client.reserve(net.relay.peer_id)  # b's slot now; the silent holder is not asked again
        assert set(net.service.admission.slots) == {silent.node.peer_id, c.node.peer_id}
        assert net.service.stats.reclaimed == 2 and len(asked) == 1
        assert net.service.metrics()["reclaimed"] == 2


async def test_newcomers_at_once_share_one_reclaim():
    """Two newcomers ask a full relay at the same moment: the holders are asked once, not once per
    newcomer, and the one slot freed goes to one of them."""
    config = RelayConfig(max_reservations=2, reclaim_grace=0.0, reclaim_timeout=0.5)
    async with relay_net(4, config) as net:
        silent, a, b, c = net.peers
        asked = await fill_with_a_silent_holder(net)
        refused: list[RelayError] = []

        async def newcomer(peer: Peer) -> None:
            try:
                await peer.client.reserve(net.relay.peer_id)
            except RelayError as e:
                refused.append(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(newcomer, b)
            nursery.start_soon(newcomer, c)
        assert len(asked) == 1 and net.service.stats.reclaimed == 1
        assert len(refused) == 1 and refused[0].status == pb.RESERVATION_REFUSED
        assert len(net.service.admission.slots) == 2 and silent.node.peer_id in net.service.admission.slots


async def test_reservations_per_ip_are_limited():
    async with relay_net(3, RelayConfig(max_reservations_per_ip=2)) as net:
        a, b, c = net.peers
        # All three come from 127.0.0.1 (and the relay does see that address, not "unknown").
        (conn,) = net.relay.network.get_connections(a.node.peer_id)
        assert _remote_ip(SimpleNamespace(muxed_conn=conn.muxed_conn)) == "127.0.0.1"  # type: ignore[arg-type]
        await a.client.reserve(net.relay.peer_id)
        await b.client.reserve(net.relay.peer_id)
        with pytest.raises(RelayError) as info:
            await c.client.reserve(net.relay.peer_id)
        assert info.value.status == pb.RESERVATION_REFUSED
        assert net.service.stats.refused == {"too many reservations from one IP": 1}


async def test_circuits_per_peer_are_limited():
    async with relay_net(3, RelayConfig(max_circuits_per_peer=1)) as net:
        a, b, c = net.peers
        await b.client.reserve(net.relay.peer_id)
        first = await a.client.dial(net.circuit, b.node.peer_id)
        with pytest.raises(RelayError) as info:  # b already has its one circuit
            await c.client.dial(net.circuit, b.node.peer_id)
        assert info.value.status == pb.RESOURCE_LIMIT_EXCEEDED and "RESOURCE_LIMIT_EXCEEDED" in str(info.value)
        assert net.service.stats.refused == {"too many circuits for a peer": 1}
        assert not first.is_closed
        # Once the first circuit is gone, the slot is free again.
        await first.close()
        await wait_until(lambda: net.service.metrics()["circuits"] == 0)
        conn = await c.client.dial(net.circuit, b.node.peer_id)
        with trio.fail_after(30):
            await transfer(conn, c.node, 1000, 1000)


async def test_circuits_over_the_connect_rate_are_refused_and_counted_once():
    async with relay_net(3) as net:
        a, b, c = net.peers
        net.relay.resources.config.rates["relay.connect"] = Rate(0.01, 1)
        await b.client.reserve(net.relay.peer_id)
        first = await a.client.dial(net.circuit, b.node.peer_id)
        with pytest.raises(RelayError, match="RESOURCE_LIMIT_EXCEEDED .over one of the relay's limits") as info:
            await a.client.dial(net.circuit, b.node.peer_id)  # a's second within its burst of 1
        assert info.value.status == pb.RESOURCE_LIMIT_EXCEEDED
        assert net.relay.resources.refused == {"service.relay.connect_requests_a_second_per_peer": 1}
        assert net.service.stats.refused == {"relay.connect rate": 1}
        await c.client.dial(net.circuit, b.node.peer_id)  # another peer has its own bucket
        assert not first.is_closed


async def test_total_circuits_are_limited():
    async with relay_net(4, RelayConfig(max_circuits=1)) as net:
        a, b, c, d = net.peers
        await b.client.reserve(net.relay.peer_id)
        await d.client.reserve(net.relay.peer_id)
        await a.client.dial(net.circuit, b.node.peer_id)
        with pytest.raises(RelayError) as info:
            await c.client.dial(net.circuit, d.node.peer_id)
        assert info.value.status == pb.RESOURCE_LIMIT_EXCEEDED
        assert net.service.stats.refused == {"too many circuits": 1}


async def test_data_limit_resets_the_circuit_and_relay_keeps_serving():
    limit = 64 * 1024
    async with relay_net(3, RelayConfig(circuit_data=limit)) as net:
        a, b, c = net.peers
        await b.client.reserve(net.relay.peer_id)
        conn = await a.client.dial(net.circuit, b.node.peer_id)
        with pytest.raises(Exception) as info, trio.fail_after(30):
            await transfer(conn, a.node, 1 << 20, 0)
        assert not isinstance(info.value, (AssertionError, trio.TooSlowError)), info.value
        # The relay cut it: both ends lose the relayed connection, the slot is released.
        await wait_until(lambda: not [x for x in a.node.network.get_connections(b.node.peer_id) if not x.is_closed])
        await wait_until(lambda: net.service.metrics()["circuits"] == 0)
        stats = net.service.metrics()
        assert stats["circuits_total"] == 1
        assert {k: v for k, v in stats.items() if k.startswith("limits_hit.")} == {"limits_hit.data": 1}
        assert stats["bytes_relayed"] <= 2 * limit
        # b's reservation survives, and the relay serves new circuits (within the limit).
        conn = await c.client.dial(net.circuit, b.node.peer_id)
        with trio.fail_after(30):
            await transfer(conn, c.node, 4000, 4000)
        assert net.service.metrics()["circuits_total"] == 2


async def test_duration_limit_resets_an_idle_circuit():
    async with relay_net(3, RelayConfig(circuit_duration=1)) as net:
        a, b, c = net.peers
        await b.client.reserve(net.relay.peer_id)
        conn = await a.client.dial(net.circuit, b.node.peer_id)
        assert not conn.is_closed
        # Nobody closes it: only the relay's 1 s limit can end it.
        await wait_until(lambda: conn.is_closed and net.service.metrics()["circuits"] == 0)
        assert {k: v for k, v in net.service.metrics().items() if k.startswith("limits_hit.")} == {"limits_hit.duration": 1}
        await wait_until(lambda: not [x for x in b.node.network.get_connections(a.node.peer_id) if not x.is_closed])
        # The relay still works for others: a fresh reservation and a fresh circuit.
        await c.client.reserve(net.relay.peer_id)
        conn = await a.client.dial(net.circuit, c.node.peer_id)
        assert is_relayed_conn(conn)


async def test_reservation_ends_when_the_peer_disconnects():
    async with relay_net(2) as net:
        a, b = net.peers
        await b.client.reserve(net.relay.peer_id)
        assert net.service.metrics()["reservations"] == 1
        await b.node.disconnect(net.relay.peer_id)
        await wait_until(lambda: live_connection(net.relay.network, b.node.peer_id) is None)
        with pytest.raises(RelayError) as info:
            await a.client.dial(net.circuit, b.node.peer_id)
        assert info.value.status == pb.NO_RESERVATION
        assert net.service.metrics()["reservations"] == 0


async def test_the_connection_manager_keeps_slot_holders_circuit_ends_and_our_relays():
    """Each side protects what the slot needs (p2p/conn_manager.py): the relay its holders and a
    circuit's two ends while it runs, the holder the relay; each protection ends with its reason."""
    async with relay_net(2) as net:
        a, b = net.peers
        await b.client.reserve(net.relay.peer_id)
        assert net.relay.conn_tags.protections(b.node.peer_id) == ["relay slot holder"]
        assert b.node.conn_tags.protections(net.relay.peer_id) == ["our relay slot"]
        await b.client.reserve(net.relay.peer_id)  # a refresh protects nothing twice
        b.client.drop(net.relay.peer_id)
        assert b.node.conn_tags.protections(net.relay.peer_id) == []
        await b.client.reserve(net.relay.peer_id)
        conn = await a.client.dial(net.circuit, b.node.peer_id)
        assert net.relay.conn_tags.protections(a.node.peer_id) == ["relay circuit"]
        assert net.relay.conn_tags.protections(b.node.peer_id) == ["relay circuit", "relay slot holder"]
        await conn.close()
        await wait_until(lambda: net.relay.conn_tags.protections(a.node.peer_id) == [])
        await b.node.disconnect(net.relay.peer_id)
        await wait_until(lambda: live_connection(net.relay.network, b.node.peer_id) is None)
        assert net.service.metrics()["reservations"] == 0  # swept: and its protection with it
        assert net.relay.conn_tags.protections(b.node.peer_id) == []


async def test_target_that_refuses_stop_gives_connection_failed():
    async with relay_net(2) as net:
        a, b = net.peers
        await b.client.reserve(net.relay.peer_id)
        b.client.drop(net.relay.peer_id)  # b forgets it: it must refuse a STOP from that relay now
        with pytest.raises(RelayError) as info:
            await a.client.dial(net.circuit, b.node.peer_id)
        assert info.value.status == pb.CONNECTION_FAILED
        assert b.node.peer_id not in a.node.connected_peers()
        assert b.client.metrics()["relayed_in"] == 0


# ---------------------------------------------------------------------- what peers may not do


async def test_hop_over_a_relayed_connection_is_refused():
    async with relay_net(2) as net:
        a, b = net.peers
        RelayService(b.node).install()  # b would relay, but not over a relayed connection
        await b.client.reserve(net.relay.peer_id)
        conn = await a.client.dial(net.circuit, b.node.peer_id)
        assert [c for c in a.node.network.get_connections(b.node.peer_id)] == [conn]
        with pytest.raises(RelayError) as info:
            await a.client.reserve(b.node.peer_id)
        assert info.value.status == pb.PERMISSION_DENIED
        stream = await a.node.new_stream_on(conn, HOP_PROTOCOL)
        await write_message(stream, pb.HopMessage(type=pb.HopMessage.CONNECT, peer=pb.Peer(id=net.relay.peer_id.to_bytes())))
        with trio.fail_after(15):
            reply = await read_message(stream, pb.HopMessage)
        assert reply.type == pb.HopMessage.STATUS and reply.status == pb.PERMISSION_DENIED


async def test_stop_from_a_relay_without_reservation_is_refused():
    async with relay_net(2) as net:
        a, b = net.peers
        # a is a "relay" b holds no reservation with, and b is directly connected to it.
        await a.node.connect(b.node.addrs[0])
        stream = await a.node.new_stream(b.node.peer_id, STOP_PROTOCOL)
        await write_message(stream, pb.StopMessage(type=pb.StopMessage.CONNECT, peer=pb.Peer(id=net.relay.peer_id.to_bytes())))
        with trio.fail_after(15):
            reply = await read_message(stream, pb.StopMessage)
            assert reply.type == pb.StopMessage.STATUS and reply.status == pb.PERMISSION_DENIED
            assert await read_to_end(stream) == b""
        assert b.client.metrics()["relayed_in"] == 0
        assert [c for c in b.node.network.get_connections(a.node.peer_id) if is_relayed_conn(c)] == []


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(frame(pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.OK)), id="status-not-connect"),
        pytest.param(frame(pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.OK, peer=pb.Peer(id=ID_BYTES))), id="status-with-peer"),
        pytest.param(frame(pb.StopMessage(type=pb.StopMessage.CONNECT)), id="connect-without-peer"),
        pytest.param(frame(pb.StopMessage(type=pb.StopMessage.CONNECT, peer=pb.Peer(id=b"not a multihash"))), id="bad-peer-id"),
        pytest.param(encode_varint(5000) + bytes(100), id="oversized"),
        pytest.param(b"\x05\xff\xff\xff\xff\xff", id="garbled"),
    ],
)
async def test_forged_stop_messages_are_refused(raw):
    async with relay_net(2) as net:
        a, b = net.peers
        await b.client.reserve(net.relay.peer_id)
        # Pretend to be the relay: a STOP stream straight from the relay's node.
        stream = await net.relay.new_stream(b.node.peer_id, STOP_PROTOCOL)
        await stream.write(raw)
        with trio.fail_after(15):
            try:
                reply = await read_message(stream, pb.StopMessage)
            except Exception:
                reply = None
        assert reply is None or reply.status != pb.OK
        assert b.client.metrics()["relayed_in"] == 0
        assert [c for c in b.node.network.get_connections(net.relay.peer_id) if is_relayed_conn(c)] == []
        # b still accepts a genuine circuit.
        conn = await a.client.dial(net.circuit, b.node.peer_id)
        with trio.fail_after(30):
            await transfer(conn, a.node, 1000, 1000)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        pytest.param(frame(_padded(pb.HopMessage(type=pb.HopMessage.RESERVE), 5000)), pb.MALFORMED_MESSAGE, id="reserve-over-4KiB"),
        pytest.param(b"\xff" * 12, pb.MALFORMED_MESSAGE, id="endless-varint"),
        pytest.param(b"\x06\xff\xff\xff\xff\xff\xff", pb.MALFORMED_MESSAGE, id="garbled-protobuf"),
        pytest.param(encode_varint(100) + bytes(10), pb.MALFORMED_MESSAGE, id="truncated"),
        pytest.param(frame(pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.OK)), pb.UNEXPECTED_MESSAGE, id="status-as-request"),
        pytest.param(frame(pb.HopMessage(type=pb.HopMessage.CONNECT)), pb.MALFORMED_MESSAGE, id="connect-without-peer"),
        pytest.param(
            frame(pb.HopMessage(type=pb.HopMessage.CONNECT, peer=pb.Peer(id=b"\x12\x20" + b"x" * 5))),
            pb.MALFORMED_MESSAGE,
            id="peer-id-not-a-multihash",
        ),
    ],
)
async def test_forged_hop_messages_are_refused_and_relay_keeps_serving(raw, status):
    async with relay_net(2) as net:
        a, b = net.peers
        stream = await a.node.new_stream(net.relay.peer_id, HOP_PROTOCOL)
        await stream.write(raw)
        if raw.startswith(encode_varint(100)):
            await stream.close()  # a truncated message: the rest never comes
        with trio.fail_after(15):  # (the relay's own deadline is 10 s)
            reply = await read_message(stream, pb.HopMessage)
            assert reply.type == pb.HopMessage.STATUS and reply.status == status
            assert await read_to_end(stream) == b""  # and the stream ends there
        assert net.service.metrics()["reservations"] == 0
        assert sum(net.service.stats.refused.values()) == 1
        # The relay serves normal requests afterwards, to the same peer and to others.
        await a.client.reserve(net.relay.peer_id)
        await b.client.reserve(net.relay.peer_id)
        conn = await b.client.dial(net.circuit, a.node.peer_id)
        with trio.fail_after(30):
            await transfer(conn, b.node, 1000, 1000)


# ---------------------------------------------------------------------- a relay that misbehaves


def _fake_relay(node: Node, answer: bytes | None) -> list[bytes]:
    """Serve HOP with a canned answer (None: reset the stream); return what requests came."""
    seen: list[bytes] = []

    async def handler(stream: INetStream) -> None:
        msg = await read_message(stream, pb.HopMessage)
        seen.append(msg.SerializeToString())
        if answer is None:
            await stream.reset()
            return
        await stream.write(answer)
        await stream.close()

    node.set_stream_handler(HOP_PROTOCOL, handler)
    return seen


@pytest.mark.parametrize(
    ("answer", "status", "words"),
    [
        (frame(pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.RESERVATION_REFUSED)), pb.RESERVATION_REFUSED, "RESERVATION_REFUSED"),
        (frame(pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.PERMISSION_DENIED)), pb.PERMISSION_DENIED, "PERMISSION_DENIED"),
        (frame(pb.HopMessage(type=pb.HopMessage.STATUS, status=77)), 77, "77"),
        (frame(pb.HopMessage(type=pb.HopMessage.RESERVE)), pb.UNUSED, "refused"),
        (None, 0, "failed"),
        (b"\x04\xff\xff\xff\xff", 0, "garbled"),
        (encode_varint(1 << 20), 0, "limit"),
        (b"", 0, "ended"),
        (
            frame(pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.OK, reservation=pb.Reservation(expire=int(time.time()) - 10))),
            0,
            "already expired",
        ),
    ],
    ids=["refused", "denied", "unknown-status", "not-a-status", "reset", "garbled", "oversized", "silent-close", "expired"],
)
async def test_client_facing_a_relay_that_refuses_or_drops(answer, status, words):
    async with open_nodes(2) as (relay, b):
        seen = _fake_relay(relay, answer)
        client = RelayClient(b, RelayClientConfig(timeout=5))
        client.install()
        await b.connect(relay.addrs[0])
        with pytest.raises(RelayError) as info:
            await client.reserve(relay.peer_id)
        assert info.value.status == status
        assert words in str(info.value)
        assert client.reservations == {}
        assert len(seen) == 1 and pb.HopMessage.FromString(seen[0]).type == pb.HopMessage.RESERVE
        # b is fine: it can still talk to the relay.
        assert await b.ping(relay.peer_id) > 0


@pytest.mark.parametrize(
    ("answer", "status", "words"),
    [
        (frame(pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.NO_RESERVATION)), pb.NO_RESERVATION, "NO_RESERVATION"),
        (frame(pb.HopMessage(type=pb.HopMessage.RESERVE)), pb.UNUSED, "could not connect"),
        (None, 0, "did not answer"),
        (b"\x04\xff\xff\xff\xff", 0, "garbled"),
        (b"", 0, "did not answer"),
    ],
    ids=["no-reservation", "not-a-status", "reset", "garbled", "silent-close"],
)
async def test_a_dial_whose_connect_the_relay_refuses_or_drops_says_so(answer, status, words):
    """The dialer writes its CONNECT and its handshake without waiting: the relay's answer is
    still what a failed dial reports, not a handshake that broke."""
    async with open_nodes(3) as (relay, a, target):
        seen = _fake_relay(relay, answer)
        client = RelayClient(a, RelayClientConfig(timeout=5))
        await a.connect(relay.addrs[0])
        with trio.fail_after(10), pytest.raises(RelayError) as info:
            await client.dial(Multiaddr(f"{relay.addrs[0]}/p2p-circuit"), target.peer_id)
        assert info.value.status == status and words in str(info.value)
        assert [pb.HopMessage.FromString(m).type for m in seen] == [pb.HopMessage.CONNECT]
        assert await a.ping(relay.peer_id) > 0


async def test_the_dialer_writes_its_handshake_behind_the_connect_before_the_relay_answers():
    """One round trip through the relay saved: the security handshake's first message rides
    with the CONNECT (read here before any answer is sent)."""
    async with open_nodes(3) as (relay, a, target):
        early: list[bytes] = []

        async def handler(stream: INetStream) -> None:
            await read_message(stream, pb.HopMessage)
            with trio.move_on_after(5):
                early.append(await stream.read(1 << 16))
            await stream.write(frame(pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.NO_RESERVATION)))
            await stream.close()

        relay.set_stream_handler(HOP_PROTOCOL, handler)
        client = RelayClient(a, RelayClientConfig(timeout=10))
        await a.connect(relay.addrs[0])
        with trio.fail_after(10), pytest.raises(RelayError, match="NO_RESERVATION"):
            await client.dial(Multiaddr(f"{relay.addrs[0]}/p2p-circuit"), target.peer_id)
        assert early and len(early[0]) >= 32, "no handshake bytes came with the CONNECT"


@pytest.mark.parametrize("accept", [True, False], ids=["accepted", "refused"])
async def test_the_relay_forwards_the_sources_first_bytes_behind_the_stop_before_the_target_answers(accept):
    """The relay's half of the saved round trip: what the source wrote behind its CONNECT
    reaches the target right behind the STOP's CONNECT; the source reads the relay's answer
    before anything from the target, and a refusal ends the circuit with CONNECTION_FAILED."""
    async with relay_net(2) as net:
        a, b = net.peers
        await b.client.reserve(net.relay.peer_id)
        early: list[bytes] = []

        async def stop_handler(stream: INetStream) -> None:
            msg = await read_message(stream, pb.StopMessage)
            assert msg.type == pb.StopMessage.CONNECT
            with trio.move_on_after(5):
                early.append(await stream.read(1 << 16))
            status = pb.OK if accept else pb.PERMISSION_DENIED
            await stream.write(frame(pb.StopMessage(type=pb.StopMessage.STATUS, status=status)) + b"from the target")
            await stream.close()

        b.node.set_stream_handler(STOP_PROTOCOL, stop_handler)
        hop = await a.node.new_stream(net.relay.peer_id, HOP_PROTOCOL)
        await hop.write(frame(pb.HopMessage(type=pb.HopMessage.CONNECT, peer=pb.Peer(id=b.node.peer_id.to_bytes())))
                        + b"hello, early")
        with trio.fail_after(10):
            reply = await read_message(hop, pb.HopMessage)
            rest = await read_to_end(hop)
        assert early == [b"hello, early"]
        if accept:
            assert reply.status == pb.OK and rest == b"from the target"
        else:
            assert reply.status == pb.CONNECTION_FAILED and rest == b""
            await wait_until(lambda: net.service.metrics()["circuits"] == 0, timeout=5)


async def test_reservation_with_forged_voucher_and_foreign_addresses():
    """A relay may lie in its reservation: the voucher is checked, other peers' addresses are dropped."""
    async with open_nodes(3) as (relay, b, other):
        expire = int(time.time()) + 600
        forged = RelayService(other)._voucher(b.peer_id, expire)  # signed by someone else
        addrs = [
            Multiaddr(f"/ip4/127.0.0.1/tcp/4001/p2p/{other.peer_id}").to_bytes(),  # another peer's address
            Multiaddr(f"/ip4/127.0.0.1/tcp/4002/p2p/{relay.peer_id}/p2p-circuit").to_bytes(),  # a circuit
            b"\xff\xfe garbage",
            Multiaddr(f"/ip4/127.0.0.1/tcp/4003/p2p/{relay.peer_id}").to_bytes(),
        ] + [b"junk"] * 200
        answer = frame(
            pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.OK, reservation=pb.Reservation(expire=expire, addrs=addrs, voucher=forged))
        )
        assert len(answer) < 4096
        _fake_relay(relay, answer)
        client = RelayClient(b)
        await b.connect(relay.addrs[0])
        rsvp = await client.reserve(relay.peer_id)
        assert not rsvp.voucher_ok
        assert [str(a) for a in rsvp.addrs] == [f"/ip4/127.0.0.1/tcp/4003/p2p/{relay.peer_id}"]


# ---------------------------------------------------------------------- the relay's parts on a desk (no network)


class RelayDesk:
    """What RelayService and RelayClient need of a Node for the parts tested here: protection, the
    resource manager's refusal count, a stream open (``answer``: our end of a stream the test plays
    the far side of, an error, or None: it never completes) and an upgrader."""

    def __init__(self) -> None:
        key = create_new_key_pair()
        self.peer_id = ID.from_pubkey(key.public_key)
        self.addrs = [Multiaddr("/ip4/198.51.100.1/tcp/4001"), Multiaddr(f"/ip4/198.51.100.2/tcp/4001/p2p/{random_peer_id()}/p2p-circuit")]
        self.counted: list[tuple[str, str]] = []
        #: the resource manager's rate check: (service, peer) asked, and an error to raise
        self.asked: list[tuple[str, str]] = []
        self.over_rate: BaseException | None = None
        self.services: dict[str, Callable[[], object]] = {}
        self.resources = SimpleNamespace(count_refusal=lambda service, reason: self.counted.append((service, reason)),
                                         allow=self._allow, register_service=self._register_service)
        self.handlers: dict[str, object] = {}
        self.handed_on: set[str] = set()
        self.circuit_dialer: object = None
        self.answer: End | BaseException | None = ConnectionError("no network at this desk")
        self.opened: list[tuple[ID, str]] = []
        self.upgraded: list[tuple[CircuitConnection, Multiaddr]] = []
        self.upgrade: Callable[[], object] = lambda: SimpleNamespace(peer_id=None)
        self.host = SimpleNamespace(upgrade_inbound_connection=self._upgrade_inbound_connection,
                                    upgrade_outbound_connection=self._upgrade_outbound_connection,
                                    get_private_key=lambda: key.private_key)
        #: peers with a live connection (what the relay's sweep asks)
        self.live: set[ID] = set()
        self.network = SimpleNamespace(get_connections=lambda peer: [SimpleNamespace(is_closed=False)] * (peer in self.live))
        self.protected: list[ID] = []
        #: holder -> its listen addresses (identify), an error, or None: it never answers
        self.identities: dict[ID, list[Multiaddr] | BaseException | None] = {}
        self.identified: list[tuple[ID, float]] = []
        self.connected: list[object] = []
        self.connect_error: BaseException | None = None
        #: what an outbound upgrade does with the raw circuit: read the relay's answer first, as Noise does
        self.outbound: Callable[[CircuitConnection, ID], Awaitable[object]] | None = None

    async def identify(self, peer: ID, *, timeout: float) -> object:
        self.identified.append((peer, timeout))
        answer = self.identities[peer]
        if answer is None:
            await trio.sleep_forever()
        if isinstance(answer, BaseException):
            raise answer
        return SimpleNamespace(listen_addrs=answer)

    async def connect(self, where: object) -> None:
        self.connected.append(where)
        if self.connect_error is not None:
            raise self.connect_error

    async def _upgrade_outbound_connection(self, raw: CircuitConnection, target: ID) -> object:
        assert self.outbound is not None
        return await self.outbound(raw, target)

    def _allow(self, service: str, peer: str, now: float) -> None:
        self.asked.append((service, peer))
        if self.over_rate is not None:
            raise self.over_rate

    def _register_service(self, name: str, usage: Callable[[], object]) -> Registration:
        self.services[name] = usage
        return Registration(lambda: self.services.pop(name))

    def set_stream_handler(self, protocol: str, handler: object, *, hands_on: bool = False) -> Registration:
        self.handlers[protocol] = handler
        if hands_on:
            self.handed_on.add(protocol)
        return Registration(lambda: self.handlers.pop(protocol))

    def set_circuit_dialer(self, dialer: object) -> Registration:
        self.circuit_dialer = dialer
        return Registration(lambda: setattr(self, "circuit_dialer", None))

    def protect(self, peer: ID, tag: str) -> Registration:
        self.protected.append(peer)
        return Registration(lambda: self.protected.remove(peer))

    async def new_stream(self, peer: ID, protocol: str) -> End:
        self.opened.append((peer, protocol))
        if self.answer is None:
            await trio.sleep_forever()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def _upgrade_inbound_connection(self, raw: CircuitConnection, addr: Multiaddr) -> object:
        self.upgraded.append((raw, addr))
        return self.upgrade()


def desk_relay(**config: object) -> tuple[RelayService, RelayDesk]:
    desk = RelayDesk()
    return RelayService(desk, RelayConfig(**config)), desk  # type: ignore[arg-type]


async def _accept() -> bool:
    return True


async def test_a_circuit_carries_both_ways_in_reads_of_its_size_and_ends_clean(autojump_clock):
    service, desk = desk_relay(circuit_duration=0)
    a, source = ends(desk.peer_id, random_peer_id())
    b, target = ends(desk.peer_id, random_peer_id())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service._bridge, a, b, _accept)
        await source.write(b"x" * 1000)
        assert await _read_exactly(target, 1000) == b"x" * 1000
        await target.write(b"y" * 500)
        assert await _read_exactly(source, 500) == b"y" * 500
        await trio.sleep(5000)  # no duration limit: idle as long as it likes
        await source.close()
        assert await target.read() == b""
        await target.close()
    assert a.how == ["closed"] and b.how == ["closed"]  # ended by both sides: closed, never reset
    assert service.stats.bytes_relayed == 1500 and not service.stats.limits_hit
    assert set(a.asked) == set(b.asked) == {BRIDGE_READ}


async def test_a_circuit_is_cut_one_byte_past_its_data_limit(autojump_clock, caplog):
    caplog.set_level(logging.DEBUG, "nat.relay")
    service, desk = desk_relay(circuit_data=3000)
    for n in (1, 2):
        a, source = ends(desk.peer_id, random_peer_id())
        b, target = ends(desk.peer_id, random_peer_id())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service._bridge, a, b, _accept)
            await source.write(b"x" * 3000)  # the limit exactly: carried
            assert await _read_exactly(target, 3000) == b"x" * 3000
            await source.write(b"x")
        assert await target.read() == b"" and a.how[-1] == b.how[-1] == "reset"
        assert service.stats.limits_hit == {"data": n} and service.stats.bytes_relayed == 3000 * n
    assert log_lines(caplog, "nat.relay", "circuit ended") == ["circuit ended: _LimitReached('data limit')"] * 2


async def test_a_circuit_is_paced_to_its_bandwidth(autojump_clock):
    service, desk = desk_relay(circuit_bandwidth=1000)
    a, source = ends(desk.peer_id, random_peer_id())
    b, target = ends(desk.peer_id, random_peer_id())
    arrived = []
    await trio.sleep(100)  # (the clock's zero is no special time)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service._bridge, a, b, _accept)
        for _ in range(4):
            await source.write(b"x" * 1000)
            await _read_exactly(target, 1000)
            arrived.append(trio.current_time())
        nursery.cancel_scope.cancel()
    assert arrived == [100.0, 101.0, 102.0, 103.0]  # 1000 bytes a second, from the circuit's start


async def test_a_circuit_is_reset_at_its_duration_and_a_refused_one_at_once(autojump_clock):
    service, desk = desk_relay(circuit_duration=10)
    for n in (1, 2):
        a, source = ends(desk.peer_id, random_peer_id())
        b, target = ends(desk.peer_id, random_peer_id())
        await service._bridge(a, b, _accept)
        assert trio.current_time() == 10.0 * n and a.how == ["reset"] and b.how == ["reset"]
        assert service.stats.limits_hit == {"duration": n}

    async def refuse() -> bool:
        return False

    a, _ = ends(desk.peer_id, random_peer_id())
    b, _ = ends(desk.peer_id, random_peer_id())
    await service._bridge(a, b, refuse)
    assert b.how == ["reset"] and a.how == [] and trio.current_time() == 20.0  # a: closed behind its answer


async def test_the_targets_answer_is_passed_on_or_refused_in_words(autojump_clock, caplog):
    caplog.set_level(logging.INFO, "nat.relay")
    service, desk = desk_relay(connect_timeout=2.0, circuit_duration=60, circuit_data=5000)
    target = random_peer_id()
    for n in (1, 2):
        hop, source = ends(desk.peer_id, random_peer_id())
        stop, theirs = ends(desk.peer_id, target)
        await write_message(theirs, pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.OK))
        assert await service._accepted(hop, stop, target) is True
        answer = await read_message(source, pb.HopMessage)
        assert (answer.type, answer.status, answer.limit.duration, answer.limit.data) == (
            pb.HopMessage.STATUS, pb.OK, 60, 5000)
        assert service.stats.circuits_total == n and service.stats.responses[("connection", "OK")] == n
    # a refusal, an answer that is no answer, silence past connect_timeout (not the wire's 10 s)
    cases = [
        (pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.PERMISSION_DENIED), None),
        (pb.StopMessage(type=pb.StopMessage.CONNECT, status=pb.OK), None),
        (b"", f"STOP to {target} failed: the stream ended before the StopMessage was complete"),
        (None, f"STOP to {target} failed: no complete StopMessage within 2 s"),
    ]
    for n, (reply, words) in enumerate(cases, 1):
        caplog.clear()
        hop, source = ends(desk.peer_id, random_peer_id())
        stop, theirs = ends(desk.peer_id, target)
        if isinstance(reply, pb.StopMessage):
            await write_message(theirs, reply)
        elif reply == b"":
            await theirs.close()
        started = trio.current_time()
        assert await service._accepted(hop, stop, target) is False
        assert trio.current_time() - started == (2.0 if reply is None else 0.0)
        answer = await read_message(source, pb.HopMessage)
        assert (answer.type, answer.status) == (pb.HopMessage.STATUS, pb.CONNECTION_FAILED) and hop.how == ["closed"]
        assert log_lines(caplog, "nat.relay", "STOP to") == ([words] if words else [])
        assert service.stats.refused["target did not accept"] == n
        assert service.stats.rejections[("connection", "target did not accept")] == n
        assert service.stats.responses[("connection", "CONNECTION_FAILED")] == n
    assert service.stats.circuits_total == 2
    # the source gone before its answer: no circuit
    hop, _ = ends(desk.peer_id, random_peer_id())
    hop.refuse = trio.BrokenResourceError("gone")
    stop, theirs = ends(desk.peer_id, target)
    await write_message(theirs, pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.OK))
    assert await service._accepted(hop, stop, target) is False and service.stats.circuits_total == 2


async def test_the_stop_to_a_target_carries_the_source_and_the_limit_or_fails_in_words(autojump_clock, caplog):
    caplog.set_level(logging.INFO, "nat.relay")
    service, desk = desk_relay(connect_timeout=2.0, circuit_duration=60, circuit_data=5000)
    source, target = random_peer_id(), random_peer_id()
    stop, theirs = ends(desk.peer_id, target)
    desk.answer = stop
    assert await service._open_stop(source, target) is stop and desk.opened == [(target, STOP_PROTOCOL)]
    connect = await read_message(theirs, pb.StopMessage)
    # the type on the wire even though CONNECT is its zero value: js-libp2p reads a missing one as no CONNECT
    assert connect.HasField("type") and connect.type == pb.StopMessage.CONNECT and connect.peer.id == source.to_bytes()
    assert (connect.limit.duration, connect.limit.data) == (60, 5000)
    assert await service._open_stop(source, random_peer_id()) is stop  # (the desk answers the same stream)
    desk.answer = ConnectionError("no route")
    assert await service._open_stop(source, target) is None
    assert log_lines(caplog, "nat.relay", "STOP to") == [f"STOP to {target} failed: no route"]
    desk.answer = None
    assert await service._open_stop(source, target) is None and trio.current_time() == 2.0


async def test_every_answer_is_counted_by_kind_status_and_reason(autojump_clock):
    service, desk = desk_relay()
    for n in (1, 2):
        hop, source = ends(desk.peer_id, random_peer_id())
        await service._status(hop, pb.RESOURCE_LIMIT_EXCEEDED, "too many circuits", kind="connection")
        answer = await read_message(source, pb.HopMessage)
        assert (answer.type, answer.status) == (pb.HopMessage.STATUS, pb.RESOURCE_LIMIT_EXCEEDED)
        assert hop.how == ["closed"]
        assert service.stats.responses == {("connection", "RESOURCE_LIMIT_EXCEEDED"): n}
        assert service.stats.rejections == {("connection", "too many circuits"): n}
        assert service.stats.refused == {"too many circuits": n}
        assert desk.counted == [("relay", "too many circuits")] * n  # a limit of the relay's own: the manager counts it
    stats = service.stats
    hop, _ = ends(desk.peer_id, random_peer_id())
    await service._status(hop, pb.RESOURCE_LIMIT_EXCEEDED, "relay.connect rate", counted=True, kind="connection")
    await service._status(hop, pb.MALFORMED_MESSAGE, "malformed")  # no kind: only the refusal
    await service._status(hop, pb.OK, "fine", kind="reservation")  # OK: no refusal
    assert len(desk.counted) == 2 and stats.refused == {"too many circuits": 2, "relay.connect rate": 1, "malformed": 1}
    assert stats.responses[("reservation", "OK")] == 1 and ("", "MALFORMED_MESSAGE") not in stats.responses
    assert set(stats.rejections) == {("connection", "too many circuits"), ("connection", "relay.connect rate")}
    # a source that reads no answer holds the relay 2 s at most
    hop, _ = ends(desk.peer_id, random_peer_id(), lockstep=True)
    started = trio.current_time()
    await service._status(hop, pb.NO_RESERVATION, "no reservation", kind="connection")
    assert trio.current_time() - started == 2.0 and hop.how == ["closed"]
    assert _kind(pb.HopMessage(type=pb.HopMessage.RESERVE)) == "reservation"
    assert _kind(pb.HopMessage(type=pb.HopMessage.CONNECT)) == _kind(pb.HopMessage(type=pb.HopMessage.STATUS)) == "connection"
    # a holder's addresses: a malformed relayed one is skipped, not the end of the look
    relay = random_peer_id()
    assert advertises_through([Multiaddr("/p2p-circuit"), Multiaddr(f"/ip4/198.51.100.7/tcp/1/p2p/{relay}/p2p-circuit")], relay)


async def test_a_stop_from_a_relay_is_answered_checked_and_upgraded_in_words(autojump_clock, caplog):
    caplog.set_level(logging.INFO, "nat.circuit")
    desk = RelayDesk()
    client = RelayClient(desk, RelayClientConfig(timeout=2.0))  # type: ignore[arg-type]
    relay, source = random_peer_id(), random_peer_id()

    async def stop(message: pb.StopMessage | bytes | None) -> tuple[End, End]:
        mine, theirs = ends(desk.peer_id, relay)
        if isinstance(message, pb.StopMessage):
            await write_message(theirs, message)
        elif message is not None:
            await theirs.write(message)
        await client._on_stop(mine)
        return mine, theirs

    connect = pb.StopMessage(type=pb.StopMessage.CONNECT, peer=pb.Peer(id=source.to_bytes()))
    # not a CONNECT: told so, reset
    mine, theirs = await stop(pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.OK))
    answer = await read_message(theirs, pb.StopMessage)
    assert (answer.type, answer.status) == (pb.StopMessage.STATUS, pb.UNEXPECTED_MESSAGE) and mine.how == ["reset"]
    # a source that is no peer id; silence past the client's timeout
    mine, _ = await stop(pb.StopMessage(type=pb.StopMessage.CONNECT, peer=pb.Peer(id=b"\x00\x01")))
    assert mine.how == ["reset"]
    started = trio.current_time()
    mine, _ = await stop(None)
    assert trio.current_time() - started == 2.0 and mine.how == ["reset"]
    assert log_lines(caplog, "nat.circuit", "bad STOP") == [
        f"bad STOP request from {relay}: {relay} sent a STOP message that is not CONNECT",
        f"bad STOP request from {relay}: STOP CONNECT peer is not a valid peer id",
        f"bad STOP request from {relay}: no complete StopMessage within 2 s"]
    # from a relay we hold no slot on: denied
    mine, theirs = await stop(connect)
    assert (await read_message(theirs, pb.StopMessage)).status == pb.PERMISSION_DENIED and mine.how == ["closed"]
    assert desk.upgraded == []
    # from ours: OK, then the stream is upgraded as an inbound connection from the source, through the relay
    client.reservations[relay] = Reservation(relay, time.time() + 60, [], Limit())
    desk.upgrade = lambda: SimpleNamespace(peer_id=source)
    for n in (1, 2):
        mine, theirs = await stop(connect)
        assert (await read_message(theirs, pb.StopMessage)).status == pb.OK and mine.how == []
        raw, addr = desk.upgraded[-1]
        assert addr == Multiaddr(f"/p2p/{relay}/p2p-circuit/p2p/{source}") and raw.stream is mine
        assert raw.is_initiator is False and raw.get_transport_addresses() == [Multiaddr(f"/p2p/{relay}/p2p-circuit")]
        assert client.counts["relayed_in"] == n
    # an upgrade that fails, and one that proves another peer than the relay named
    caplog.clear()

    def fails() -> object:
        raise RuntimeError("bad handshake")

    desk.upgrade = fails
    mine, _ = await stop(connect)
    assert mine.how == ["reset"]
    closed = []
    other = random_peer_id()

    async def close() -> None:
        closed.append(True)

    desk.upgrade = lambda: SimpleNamespace(peer_id=other, close=close)
    mine, _ = await stop(connect)
    assert closed == [True] and client.counts["relayed_in"] == 2
    assert log_lines(caplog, "nat.circuit", "relayed connection") == [
        f"relayed connection from {source} via {relay} failed to upgrade: bad handshake",
        f"relayed connection via {relay} claimed to be from {source} but is from {other}"]
    client.drop(random_peer_id())  # a relay we hold nothing on: nothing to drop
    client.drop(relay)
    assert client.reservations == {}
    assert describe_status(pb.OK) == "OK" and describe_status(99) == "99"
    assert describe_status(pb.NO_RESERVATION) == "NO_RESERVATION (the target holds no reservation on this relay)"


def test_the_admission_counts_each_circuit_at_both_ends_to_the_limit_and_ages_slots_to_the_second():
    s, t1, t2, t3 = (random_peer_id() for _ in range(4))
    admission = RelayAdmission(RelayConfig(max_circuits_per_peer=2, reclaim_recheck=300.0, reclaim_grace=30.0,
                                           max_reservations=2))
    for p in (t1, t2, t3):
        admission.slots[p] = _Slot(p, "198.51.100.1", 5000.0, since=1000.0)
    assert admission.open_circuit(s, t1) is None and admission.open_circuit(s, t2) is None
    assert admission.circuits == {s: 2, t1: 1, t2: 1} and admission.circuit_count == 2
    assert admission.open_circuit(s, t3) == Refusal(pb.RESOURCE_LIMIT_EXCEEDED, "too many circuits for a peer")
    admission.close_circuit(s, t1)
    assert admission.circuits == {s: 1, t2: 1} and admission.circuit_count == 1
    s2 = random_peer_id()
    assert admission.open_circuit(s2, t2) is None and admission.circuits[t2] == 2
    admission.close_circuit(s2, t2)  # one of the target's two: the other still counts
    assert admission.circuits == {s: 1, t2: 1}
    # a renewal keeps who and where (the address it renews from)
    admission.slots = {t1: _Slot(t1, "198.51.100.1", 5000.0, since=1000.0)}
    assert admission.reserve(t1, "198.51.100.2", 1100.0) == 1100 + 3600
    assert (admission.slots[t1].peer, admission.slots[t1].ip, admission.slots[t1].used_at) == (t1, "198.51.100.2", 1100.0)
    # full: a slot is asked about from exactly reclaim_grace after it was granted, and again exactly
    # reclaim_recheck after its holder last said it uses it
    admission.slots = {t2: _Slot(t2, "198.51.100.3", 9000.0, since=1000.0), t3: _Slot(t3, "198.51.100.4", 9000.0, since=1000.0, used_at=1000.0)}
    assert admission.reclaim_candidates(1029.9, s) == []
    assert admission.reclaim_candidates(1030.0, s) == [t2]
    assert admission.reclaim_candidates(1300.0, s) == [t2, t3]
    # a slot ends at its expiry, to the second
    admission.slots = {t1: _Slot(t1, "198.51.100.1", 1100.0), t2: _Slot(t2, "198.51.100.1", 1100.5)}
    admission.sweep(1100.0, connected=lambda peer: True)
    assert set(admission.slots) == {t2}


async def test_a_connect_is_refused_in_words_and_every_circuit_is_given_back(autojump_clock, caplog):
    caplog.set_level(logging.INFO, "nat.relay")
    service, desk = desk_relay(max_circuits_per_peer=1, connect_timeout=2.0)
    source, target = random_peer_id(), random_peer_id()

    async def connect(msg: pb.HopMessage) -> pb.HopMessage:
        hop, theirs = ends(desk.peer_id, source)
        await service._connect(hop, source, msg)
        return await read_message(theirs, pb.HopMessage)

    to_target = pb.HopMessage(type=pb.HopMessage.CONNECT, peer=pb.Peer(id=target.to_bytes()))
    assert (await connect(pb.HopMessage(type=pb.HopMessage.CONNECT))).status == pb.MALFORMED_MESSAGE
    assert (await connect(pb.HopMessage(type=pb.HopMessage.CONNECT, peer=pb.Peer(id=b"\x00\x01")))).status == pb.MALFORMED_MESSAGE
    assert (await connect(to_target)).status == pb.NO_RESERVATION
    assert service.stats.rejections == {("connection", "malformed"): 2, ("connection", "no reservation"): 1}
    assert log_lines(caplog, "nat.relay", "bad CONNECT") == [f"bad CONNECT from {source}: CONNECT without a peer",
                                                            f"bad CONNECT from {source}: CONNECT peer is not a valid peer id"]
    # reserved, but the target takes no STOP, or answers none: refused, and the circuit given back each
    # time (one per peer is the limit: the next would be refused for it if one were kept)
    desk.live.add(target)
    assert isinstance(service.admission.reserve(target, "198.51.100.1", time.time()), int)
    for _ in range(2):
        assert (await connect(to_target)).status == pb.CONNECTION_FAILED
        assert service.admission.circuits == {}
    stop, theirs = ends(desk.peer_id, target)
    desk.answer = stop
    await theirs.close()
    assert (await connect(to_target)).status == pb.CONNECTION_FAILED and service.admission.circuits == {}
    assert log_lines(caplog, "nat.relay", "STOP to") == [
        f"STOP to {target} failed: no network at this desk", f"STOP to {target} failed: no network at this desk",
        f"STOP to {target} failed: the stream ended before the StopMessage was complete"]
    assert service.stats.rejections[("connection", "target did not accept")] == 3
    # accepted: both ends kept connected while the circuit runs, and let go after
    hop, source_end = ends(desk.peer_id, source)
    stop, target_end = ends(desk.peer_id, target)
    desk.answer = stop
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service._connect, hop, source, to_target)
        assert (await read_message(target_end, pb.StopMessage)).type == pb.StopMessage.CONNECT
        await write_message(target_end, pb.StopMessage(type=pb.StopMessage.STATUS, status=pb.OK))
        assert (await read_message(source_end, pb.HopMessage)).status == pb.OK
        # (the target is kept as a slot holder too)
        assert sorted(map(str, desk.protected)) == sorted(map(str, [source, target, target]))
        assert service.admission.circuits == {source: 1, target: 1}
        await source_end.close()
        await target_end.close()
    assert desk.protected == [target] and service.admission.circuits == {}


async def test_a_full_relay_asks_its_holders_at_once_and_frees_only_the_slots_not_advertised(autojump_clock, caplog):
    caplog.set_level(logging.DEBUG, "nat.relay")
    service, desk = desk_relay(max_reservations=4, reclaim_timeout=3.0, reclaim_checks=8)
    uses, moved_on, errs, silent, newcomer = (random_peer_id() for _ in range(5))
    through = Multiaddr(f"/ip4/198.51.100.7/tcp/1/p2p/{desk.peer_id}/p2p-circuit")
    desk.identities = {uses: [through], moved_on: [Multiaddr("/ip4/198.51.100.8/tcp/1")],
                       errs: RuntimeError("boom"), silent: None}
    for i, holder in enumerate((uses, moved_on, errs, silent)):
        desk.live.add(holder)
        assert isinstance(service.admission.reserve(holder, f"198.51.100.{i}", time.time() - 100), int)
    await service._reclaim(uses)  # a holder renewing: nobody is asked
    assert desk.identified == []
    await service._reclaim(newcomer)
    assert trio.current_time() == 3.0  # the silent one, waited for reclaim_timeout
    assert sorted(desk.identified, key=str) == sorted([(h, 3.0) for h in (uses, moved_on, errs, silent)], key=str)
    assert set(service.admission.slots) == {uses, errs, silent} and service.stats.reclaimed == 1
    assert log_lines(caplog, "nat.relay", "relay: reclaimed") == [
        f"relay: reclaimed the slot of {moved_on} (it no longer advertises an address through us)"]
    assert log_lines(caplog, "nat.relay", "relay: could not ask") == [f"relay: could not ask {errs} about its slot: boom"]


async def test_a_dial_through_a_relay_says_what_failed_and_counts_what_worked(autojump_clock):
    desk = RelayDesk()
    client = RelayClient(desk, RelayClientConfig(timeout=2.0))  # type: ignore[arg-type]
    relay, target = random_peer_id(), random_peer_id()
    via = Multiaddr(f"/ip4/198.51.100.1/tcp/4001/p2p/{relay}/p2p-circuit")
    with pytest.raises(RelayError, match="^will not relay through ourselves$"):
        await client.dial(Multiaddr(f"/p2p/{desk.peer_id}/p2p-circuit"), target)
    with pytest.raises(RelayError, match=f"^/p2p/{relay}/p2p-circuit relays a peer through itself$"):
        await client.dial(Multiaddr(f"/p2p/{relay}/p2p-circuit"), relay)
    desk.connect_error = DialError("refused")
    with pytest.raises(RelayError, match=f"^cannot reach relay {relay}: refused$"):
        await client.dial(via, target)
    desk.connect_error = None
    assert desk.connected == [Multiaddr(f"/ip4/198.51.100.1/tcp/4001/p2p/{relay}")]

    async def handshake(raw: CircuitConnection, peer: ID) -> object:
        assert raw.is_initiator is True and raw.refusal is None and peer == target
        assert raw.get_transport_addresses() == [Multiaddr(f"/p2p/{relay}/p2p-circuit")]
        await raw.write(b"hello")
        if await raw.read(5) != b"hello":
            raise ValueError("no answer")
        return SimpleNamespace(peer_id=peer)

    desk.outbound = handshake
    for n in (1, 2):  # by the relay's id alone: connected by id
        hop, relay_end = ends(desk.peer_id, relay)
        desk.answer = hop
        await write_message(relay_end, pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.OK))
        await relay_end.write(b"hello")
        conn = await client.dial(Multiaddr(f"/p2p/{relay}/p2p-circuit"), target)
        assert conn.peer_id == target and client.counts["relayed_out"] == n  # type: ignore[attr-defined]
        assert desk.opened[-1] == (relay, HOP_PROTOCOL) and desk.connected[-1] == relay
        connect = await read_message(relay_end, pb.HopMessage)
        assert connect.type == pb.HopMessage.CONNECT and connect.peer.id == target.to_bytes()
    # the relay answers nothing: the client's timeout, not the wire's 10 s; a circuit that ends at once
    hop, relay_end = ends(desk.peer_id, relay)
    desk.answer = hop
    started = trio.current_time()
    with pytest.raises(RelayError, match=f"^relayed connection to {target} via {relay} failed to upgrade: $"):
        await client.dial(via, target)
    assert trio.current_time() - started == 2.0 and hop.how == ["reset"]
    hop, relay_end = ends(desk.peer_id, relay)
    desk.answer = hop
    await write_message(relay_end, pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.OK))
    await relay_end.close()
    with pytest.raises(RelayError, match=f"^relayed connection to {target} via {relay} failed to upgrade: no answer$"):
        await client.dial(via, target)
    assert hop.how == ["reset"] and client.counts["relayed_out"] == 2


async def test_a_circuit_connection_ends_as_a_socket_does_and_small_parts_say_what_they_are():
    relay = random_peer_id()
    mine, theirs = ends(random_peer_id(), relay)
    raw = CircuitConnection(mine, initiator=False, relay_addr=Multiaddr(f"/p2p/{relay}/p2p-circuit"))  # type: ignore[arg-type]
    assert raw.refusal is None and raw.is_initiator is False and raw.get_remote_address() is None
    mine.broken = EOFError()
    assert await raw.read(10) == b""
    assert Limit.from_pb(pb.Limit(duration=60, data=5000)) == Limit(duration=60, data=5000)
    assert _remote_ip(SimpleNamespace(muxed_conn=SimpleNamespace())) == "?"  # type: ignore[arg-type]
    # a voucher signed by the relay, saying the right things, but of another payload type: not a voucher
    key = create_new_key_pair()
    relay_id, peer = ID.from_pubkey(key.public_key), random_peer_id()
    payload = pb.Voucher(relay=relay_id.to_bytes(), peer=peer.to_bytes(), expiration=100).SerializeToString()
    for kind, ok in ((VOUCHER_PAYLOAD_TYPE, True), (b"\x03\x01", False)):
        signature = key.private_key.sign(make_unsigned(VOUCHER_DOMAIN, kind, payload))
        envelope = Envelope(key.public_key, kind, payload, signature).marshal_envelope()
        assert _voucher_ok(envelope, relay_id, peer, 100) is ok


def test_the_configs_refuse_what_cannot_work_and_take_their_edges():
    at_least_one = ("max_reservations", "max_reservations_per_ip", "reservation_ttl", "max_circuits", "max_circuits_per_peer")
    for name in at_least_one:
        with pytest.raises(ConfigError, match=f"^relay {name} must be at least 1$"):
            RelayConfig(**{name: 0}).validate()
    for name in ("circuit_duration", "circuit_data", "circuit_bandwidth"):
        with pytest.raises(ConfigError, match=rf"^relay {name} must not be negative \(0 means no limit\)$"):
            RelayConfig(**{name: -1}).validate()
    timing = (r"^relay connect_timeout and reclaim_timeout must be positive, reclaim_recheck and reclaim_grace "
              r"not negative$")
    for bad in ({"connect_timeout": 0.0}, {"reclaim_timeout": 0.0}, {"reclaim_recheck": -0.1}, {"reclaim_grace": -0.1}):
        with pytest.raises(ConfigError, match=timing):
            RelayConfig(**bad).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^relay reclaim_checks must not be negative \(0: never reclaim a slot\)$"):
        RelayConfig(reclaim_checks=-1).validate()
    RelayConfig(connect_timeout=0.5, reclaim_timeout=0.5, reclaim_recheck=0.0, reclaim_grace=0.0, reclaim_checks=0,
                circuit_duration=0, circuit_data=0, circuit_bandwidth=0, **{n: 1 for n in at_least_one}).validate()
    with pytest.raises(ConfigError, match="^relay client timeout must be positive$"):
        RelayClientConfig(timeout=0.0).validate()
    RelayClientConfig(timeout=0.5).validate()


async def test_a_reservation_answers_where_and_how_long_and_is_counted_opened_or_renewed(autojump_clock):
    service, desk = desk_relay(max_reservations=2, max_reservations_per_ip=1, reservation_ttl=600,
                               circuit_duration=60, circuit_data=5000)
    peer = random_peer_id()

    async def reserve(who: ID, ip: str, *, lockstep: bool = False) -> tuple[End, End]:
        hop, theirs = ends(desk.peer_id, who, lockstep=lockstep)
        hop.muxed_conn.get_remote_address = lambda: (ip, 4001)
        desk.live.add(who)
        await service._reserve(hop, who)  # type: ignore[arg-type]
        return hop, theirs

    for n, kind in ((1, "opened"), (2, "renewed")):
        before = int(time.time())
        hop, theirs = await reserve(peer, "198.51.100.5")
        reply = await read_message(theirs, pb.HopMessage)
        assert (reply.type, reply.status) == (pb.HopMessage.STATUS, pb.OK) and hop.how == ["closed"]
        rsvp = reply.reservation
        assert before + 600 <= rsvp.expire <= int(time.time()) + 600
        assert [Multiaddr(a) for a in rsvp.addrs] == [Multiaddr(f"/ip4/198.51.100.1/tcp/4001/p2p/{desk.peer_id}")]
        assert _voucher_ok(rsvp.voucher, desk.peer_id, peer, rsvp.expire)
        assert (reply.limit.duration, reply.limit.data) == (60, 5000)
        assert service.stats.reservations == n and service.stats.reservation_types[kind] == 1
        assert service.stats.responses[("reservation", "OK")] == n
    assert service.admission.slots[peer].ip == "198.51.100.5"
    # one slot per IP here: refused, counted as a reservation's
    hop, theirs = await reserve(random_peer_id(), "198.51.100.5")
    assert (await read_message(theirs, pb.HopMessage)).status == pb.RESERVATION_REFUSED
    assert service.stats.rejections == {("reservation", "too many reservations from one IP"): 1}
    # full and every slot old: a holder renewing asks nobody about theirs
    other = random_peer_id()
    await reserve(other, "198.51.100.6")
    for slot in service.admission.slots.values():
        slot.since -= 1000
    await reserve(other, "198.51.100.6")
    assert desk.identified == []
    # a holder that reads no answer holds the relay 5 s at most
    started = trio.current_time()
    hop, _ = await reserve(other, "198.51.100.6", lockstep=True)
    assert trio.current_time() - started == 5.0 and hop.how == ["closed"]
    assert service.stats.reservation_types == {"opened": 2, "renewed": 3}


async def test_each_hop_request_is_checked_before_it_is_served(autojump_clock, caplog):
    caplog.set_level(logging.INFO, "nat.relay")
    service, desk = desk_relay()
    peer = random_peer_id()

    async def hop(message: pb.HopMessage | bytes, *, relayed: bool = False) -> pb.HopMessage:
        mine, theirs = ends(desk.peer_id, peer)
        mine.muxed_conn.get_remote_address = lambda: ("198.51.100.5", 4001)
        if relayed:
            mine.muxed_conn.get_transport_addresses = lambda: [Multiaddr(f"/p2p/{random_peer_id()}/p2p-circuit")]
        await theirs.write(message if isinstance(message, bytes) else frame(message))
        await service._on_hop(mine)  # type: ignore[arg-type]
        assert mine.how == ["closed"]
        return await read_message(theirs, pb.HopMessage)

    reserve = pb.HopMessage(type=pb.HopMessage.RESERVE)
    connect = pb.HopMessage(type=pb.HopMessage.CONNECT, peer=pb.Peer(id=random_peer_id().to_bytes()))
    assert (await hop(b"\x05garbl")).status == pb.MALFORMED_MESSAGE
    assert len(log_lines(caplog, "nat.relay", "bad HOP")) == 1
    assert len(log_lines(caplog, "nat.relay", f"bad HOP request from {peer}: garbled HopMessage: ")) == 1
    assert (await hop(reserve, relayed=True)).status == pb.PERMISSION_DENIED
    assert (await hop(connect, relayed=True)).status == pb.PERMISSION_DENIED
    assert (await hop(pb.HopMessage(type=pb.HopMessage.STATUS))).status == pb.UNEXPECTED_MESSAGE
    assert desk.asked == []  # none of these reached the rate check
    desk.over_rate = ResourceLimitExceeded(ResourceScope.PEER, "relay.reserve", 5)
    assert (await hop(reserve)).status == pb.RESOURCE_LIMIT_EXCEEDED
    assert (await hop(connect)).status == pb.RESOURCE_LIMIT_EXCEEDED
    assert desk.asked == [("relay.reserve", str(peer)), ("relay.connect", str(peer))] and desk.counted == []
    assert service.stats.refused == {"malformed": 1, "relayed connection": 2, "unexpected": 1,
                                     "relay.reserve rate": 1, "relay.connect rate": 1}
    assert service.stats.rejections == {
        ("reservation", "relayed connection"): 1, ("connection", "relayed connection"): 1,
        ("reservation", "relay.reserve rate"): 1, ("connection", "relay.connect rate"): 1}
    desk.over_rate = None
    assert (await hop(reserve)).status == pb.OK and service.admission.slots[peer].ip == "198.51.100.5"


def test_install_serves_hop_and_shows_the_slots_until_removed():
    service, desk = desk_relay()
    handle = service.install()
    assert set(desk.handlers) == {HOP_PROTOCOL}
    peer = random_peer_id()
    service.admission.reserve(peer, "198.51.100.1", time.time())
    service.admission.circuits.update({peer: 1, random_peer_id(): 1})
    assert desk.services["relay"]() == {"reservations": 1, "circuits": 1}
    handle.remove()
    assert desk.handlers == {} and desk.services == {}
    client = RelayClient(desk)  # type: ignore[arg-type]
    assert client.metrics() == {"reservations": 0, "reservation_failures": 0, "relayed_in": 0, "relayed_out": 0}
    handle = client.install()
    assert set(desk.handlers) == {STOP_PROTOCOL} and desk.circuit_dialer == client.dial
    assert desk.handed_on == {STOP_PROTOCOL}  # STOP's stream becomes the connection: the node leaves it open
    handle.remove()
    assert desk.handlers == {} and desk.circuit_dialer is None


async def test_a_relay_that_asks_for_no_slot_may_be_accepted_when_configured(autojump_clock):
    desk = RelayDesk()
    client = RelayClient(desk, RelayClientConfig(accept_unreserved=True))  # type: ignore[arg-type]
    relay, source = random_peer_id(), random_peer_id()
    desk.upgrade = lambda: SimpleNamespace(peer_id=source)
    mine, theirs = ends(desk.peer_id, relay)
    await write_message(theirs, pb.StopMessage(type=pb.StopMessage.CONNECT, peer=pb.Peer(id=source.to_bytes())))
    await client._on_stop(mine)  # type: ignore[arg-type]
    assert (await read_message(theirs, pb.StopMessage)).status == pb.OK and client.counts["relayed_in"] == 1


async def test_a_reservation_keeps_the_relays_usable_addresses_or_says_what_failed(autojump_clock):
    desk = RelayDesk()
    client = RelayClient(desk, RelayClientConfig(timeout=2.0))  # type: ignore[arg-type]
    relay = random_peer_id()
    reached: list[Multiaddr] = [Multiaddr("/ip4/198.51.100.9/tcp/4001")]
    desk.network = SimpleNamespace(get_connections=lambda peer: [SimpleNamespace(
        get_transport_addresses=lambda: reached)] if peer == relay else [])

    async def reserve(reply: pb.HopMessage | None) -> tuple[End, End, Reservation | RelayError]:
        hop, theirs = ends(desk.peer_id, relay)
        desk.answer = hop
        if reply is not None:
            await write_message(theirs, reply)
        try:
            got: Reservation | RelayError = await client.reserve(relay)
        except RelayError as e:
            got = e
        return hop, theirs, got

    expire = int(time.time()) + 600
    public = Multiaddr(f"/ip4/198.51.100.1/tcp/4001/p2p/{relay}")
    loopback = Multiaddr(f"/ip4/127.0.0.1/tcp/4001/p2p/{relay}")
    ok = pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.OK, limit=pb.Limit(duration=60, data=5000),
                       reservation=pb.Reservation(expire=expire, addrs=[loopback.to_bytes(), public.to_bytes()]))
    hop, theirs, got = await reserve(ok)
    assert isinstance(got, Reservation) and got.addrs == [public] and got.limit == Limit(60, 5000)
    assert got.expire == expire and got.voucher_ok is False and hop.how == ["closed"]
    asked = await read_message(theirs, pb.HopMessage)
    assert asked.HasField("type") and asked.type == pb.HopMessage.RESERVE  # the zero value, written all the same
    reached[:] = [Multiaddr("/ip4/127.0.0.1/tcp/4001")]  # reached over loopback: loopback addresses are kept
    _, _, got = await reserve(ok)
    assert isinstance(got, Reservation) and got.addrs == [loopback, public]
    # no usable address listed, no limit: how we reached it, and no limit
    bare = pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.OK, reservation=pb.Reservation(expire=expire))
    _, _, got = await reserve(bare)
    assert isinstance(got, Reservation) and got.addrs == [Multiaddr(f"/ip4/127.0.0.1/tcp/4001/p2p/{relay}")]
    assert got.limit == Limit() and client.counts["reservations"] == 3 and client.counts["reservation_failures"] == 0
    # and what failed, each counted once (the timeout after the refusal: its count adds to one already there)
    hop, _, got = await reserve(pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.RESERVATION_REFUSED))
    assert str(got) == f"{relay} refused the reservation: RESERVATION_REFUSED (no reservation slot free, in all or for your address)"
    assert hop.how == ["closed"] and client.counts["reservation_failures"] == 1
    started = trio.current_time()
    hop, _, got = await reserve(None)
    assert str(got) == f"reservation on {relay} failed: " and hop.how == ["reset"]
    assert trio.current_time() - started == 2.0 and client.counts["reservation_failures"] == 2
    await reserve(pb.HopMessage(type=pb.HopMessage.STATUS, status=pb.RESERVATION_REFUSED))  # after another failure too
    assert client.counts["reservation_failures"] == 3
    desk.answer = StreamOpenError("protocol not supported")
    with pytest.raises(RelayError, match=f"^{relay} offers no relay service: protocol not supported$"):
        await client.reserve(relay)
    assert client.counts["reservation_failures"] == 4 and client.counts["reservations"] == 3
