"""Circuit relay v2 on loopback: reservations, relayed connections, the relay's limits, bad input."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import trio
from libp2p.abc import INetConn, INetStream
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.peer.envelope import Envelope, make_unsigned, unmarshal_envelope
from multiaddr import Multiaddr

from nat.circuit import (
    HOP_PROTOCOL,
    STOP_PROTOCOL,
    VOUCHER_DOMAIN,
    VOUCHER_PAYLOAD_TYPE,
    RelayClient,
    RelayClientConfig,
    RelayError,
    _voucher_ok,
)
from nat.proto import circuit_pb2 as pb
from nat.relay import RelayConfig, RelayService, _remote_ip
from p2p.addresses import is_relayed_conn
from p2p.wire import read_message, write_message
from p2p import Node
from p2p.dialer import live_connection
from p2p.resources import Rate
from p2p.varint import encode_varint

from .conftest import open_nodes
from .kit import read_to_end, wait_until

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
