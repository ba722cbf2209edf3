"""The connection manager on real Nodes on loopback: over the high water the node closes what its
choice (p2p/conn_manager.py, tests/test_conn_manager.py) picks, keeps what services protect, and
neither side dials the other back to check on a trimmed connection."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import trio
from multiaddr import Multiaddr

from nat.circuit import RelayClient
from nat.relay import RelayService

from p2p import Node
from p2p import events as ev
from p2p.conn_manager import ConnManagerConfig
from p2p.dht import DHT, DHTConfig
from p2p.hooks import ConnectionInfo, SwarmObserver

from .conftest import loopback_config, open_nodes
from .kit import record_events, wait_until

pytestmark = pytest.mark.timeout(60)

#: keep 2, trim over 3, nothing young, a look every 0.2 s
TIGHT = ConnManagerConfig(low_water=2, high_water=3, grace_period=0.0, silence_period=0.2)


class _Closed(SwarmObserver):
    def __init__(self) -> None:
        self.infos: list[ConnectionInfo] = []

    def connection_closed(self, info: ConnectionInfo) -> None:
        self.infos.append(info)


async def test_over_the_high_water_the_node_closes_down_to_the_low_water_and_keeps_the_protected() -> None:
    async with open_nodes(6) as others, Node.open(loopback_config(connections=TIGHT)) as hub:
        seen = record_events(hub)
        told = [_Closed() for _ in others]
        for other, observer in zip(others, told):
            other.observe(observer)
        with hub.protect(others[0].peer_id, "a test"):
            # all six connect before the manager may choose: a look between two connects (every 0.2 s,
            # and a slow machine's connects take longer) trimmed four or five, and five stayed open
            connecting = [hub.protect(other.peer_id, "connecting") for other in others]
            for other in others:
                await hub.connect(other.addrs[0])
            await trio.sleep(0.5)  # looks at six connections, every one protected: none closed
            assert len(hub.connections()) == 6 and hub.trimmed == 0
            for handle in connecting:
                handle.remove()
            # the count comes once the trimmed connections have closed, after they left the swarm's table
            await wait_until(lambda: hub.trimmed > 0, timeout=10)
            assert len(hub.connections()) == 3  # two kept, and the protected one
            assert others[0].peer_id in hub.connected_peers()
            assert hub.trimmed == 3 and hub.connection_metrics()["protected_peers"] == 1
            trims = [e for e in seen if isinstance(e, ev.ConnectionsTrimmed)]
            assert [(t.closed, t.peers, t.before) for t in trims] == [(3, 3, 6)]
            # each trimmed peer heard why (GoAway 0x1005): the contact is alive, not to be checked
            await wait_until(lambda: sum(len(observer.infos) for observer in told) == 3, timeout=5)
            assert all(i.trimmed for observer in told for i in observer.infos)
            closed_here = [e for e in seen if isinstance(e, ev.ConnectionClosed)]
            assert len(closed_here) == 3 and all(e.trimmed for e in closed_here)


async def test_a_young_connection_waits_out_its_grace() -> None:
    grace = ConnManagerConfig(low_water=1, high_water=1, grace_period=30.0, silence_period=0.2)
    async with open_nodes(3) as others, Node.open(loopback_config(connections=grace)) as hub:
        for other in others:
            await hub.connect(other.addrs[0])
        await trio.sleep(1.0)  # five looks
        assert len(hub.connections()) == 3 and hub.trimmed == 0


async def test_a_disabled_manager_never_trims() -> None:
    off = ConnManagerConfig(low_water=1, high_water=1, grace_period=0.0, silence_period=0.2, enabled=False)
    async with open_nodes(3) as others, Node.open(loopback_config(connections=off)) as hub:
        for other in others:
            await hub.connect(other.addrs[0])
        await trio.sleep(1.0)
        assert len(hub.connections()) == 3 and hub.trimmed == 0
        assert hub.connection_metrics() == {"open": 3, "trimmed": 0, "protected_peers": 0, "low_water": 0,
                                            "high_water": 0}


async def test_a_protection_released_lets_the_peer_go() -> None:
    async with open_nodes(4) as others, Node.open(loopback_config(connections=TIGHT)) as hub:
        kept = [hub.protect(o.peer_id, "round") for o in others]
        for other in others:
            await hub.connect(other.addrs[0])
        await trio.sleep(0.6)
        assert len(hub.connections()) == 4
        for registration in kept:
            registration.remove()
        await wait_until(lambda: len(hub.connections()) == 2, timeout=10)


async def test_dht_peers_neither_redial_a_trimmed_contact_nor_lose_it() -> None:
    """Before the GoAway code, a contact whose connection closed was pinged 1 s later: a trim was undone
    at once, by both sides. Now the contacts stay in the tables, unconnected, and the values are found."""
    async with AsyncExitStack() as stack:
        hub_node = await stack.enter_async_context(Node.open(loopback_config(connections=TIGHT)))
        hub = await stack.enter_async_context(DHT.open(hub_node, DHTConfig(mode="server", check_closed_after=0.2)))
        dhts = []
        for _ in range(6):
            node = await stack.enter_async_context(Node.open(loopback_config(initial_peers=[str(hub_node.addrs[0])])))
            dhts.append(await stack.enter_async_context(DHT.open(node, DHTConfig(mode="server", check_closed_after=0.2))))
        await wait_until(lambda: hub_node.trimmed > 0 and len(hub_node.connections()) <= 3, timeout=15)
        table = len(hub.table)
        trimmed = hub_node.trimmed
        await trio.sleep(2.0)  # ten looks of the manager, and far past every check_closed_after
        assert hub_node.trimmed == trimmed and len(hub_node.connections()) <= 3  # nobody dialed back
        assert len(hub.table) == table >= 5
        await dhts[-1].store("key", b"value", time.time() + 60)
        found = await hub.get("key")
        assert found is not None and found.value == b"value"


async def test_routing_table_contacts_are_kept_before_passers_by() -> None:
    """The DHT values its contacts (``value_peers``): the trim closes the node that is no contact first."""
    keep_one = ConnManagerConfig(low_water=1, high_water=1, grace_period=0.0, silence_period=0.2)
    async with AsyncExitStack() as stack:
        hub_node = await stack.enter_async_context(Node.open(loopback_config(connections=keep_one)))
        hub = await stack.enter_async_context(DHT.open(hub_node, DHTConfig(mode="server")))
        plain = await stack.enter_async_context(Node.open(loopback_config()))
        contact_node = await stack.enter_async_context(Node.open(loopback_config(initial_peers=[str(hub_node.addrs[0])])))
        await stack.enter_async_context(DHT.open(contact_node, DHTConfig(mode="server")))
        await wait_until(lambda: contact_node.peer_id in hub.table, timeout=10)
        # the contact connected first: without its value it would go first, the longest unused (and
        # it holds another connection, so that it would not simply rejoin the hub, its initial peer)
        await contact_node.connect(plain.addrs[0])
        await plain.connect(hub_node.addrs[0])
        await wait_until(lambda: hub_node.connected_peers() == [contact_node.peer_id], timeout=10)
        await trio.sleep(0.5)
        assert hub_node.trimmed == 1


async def test_a_relay_over_its_high_water_keeps_its_slot_holder_reachable() -> None:
    """A public relay meets more peers than it keeps: the trim leaves the slot holder connected, so
    that a peer arriving after it still reaches the holder through its slot."""
    async with open_nodes(5) as (holder, *passers), Node.open(loopback_config(connections=TIGHT)) as relay:
        service = RelayService(relay)
        service.install()
        client = RelayClient(holder)
        client.install()
        await holder.connect(relay.addrs[0])
        await client.reserve(relay.peer_id)
        for other in passers:
            await other.connect(relay.addrs[0])
        await wait_until(lambda: relay.trimmed >= 2 and len(relay.connections()) <= 3, timeout=10)
        assert holder.peer_id in relay.connected_peers()
        async with open_nodes(1) as (late,):
            late_client = RelayClient(late)
            late_client.install()
            await late.connect(relay.addrs[0])
            conn = await late_client.dial(Multiaddr(f"{relay.addrs[0]}/p2p-circuit"), holder.peer_id)
            assert conn.muxed_conn.peer_id == holder.peer_id


async def test_a_valuer_that_fails_counts_nothing_and_the_trimming_goes_on() -> None:
    def broken(peer: object) -> int:
        raise RuntimeError("a service's bug")

    async with open_nodes(5) as others, Node.open(loopback_config(connections=TIGHT)) as hub:
        hub.value_peers(broken)
        # all five connect before the manager may choose (CI, 2026-12-03: a look after the fourth
        # trimmed two, and the fifth left three, not over the high water)
        connecting = [hub.protect(other.peer_id, "connecting") for other in others]
        for other in others:
            await hub.connect(other.addrs[0])
        for handle in connecting:
            handle.remove()
        await wait_until(lambda: len(hub.connections()) == 2, timeout=10)
        for other in others[:2]:  # and again, the loop still running
            await hub.connect(other.addrs[0])
        await wait_until(lambda: len(hub.connections()) == 2 and hub.trimmed >= 5, timeout=10)


@pytest.mark.parametrize("direction", ["we call", "they call"])
async def test_a_peer_with_a_call_under_way_either_way_is_kept(direction: str) -> None:
    """Closing a connection under a call cut DHT lookups short (bench/conn_manager.py); a stream
    pooled for the next call is idle, and does not keep its peer."""
    from google.protobuf.wrappers_pb2 import StringValue

    released = trio.Event()

    async def slow(request: StringValue, ctx: object) -> StringValue:
        await released.wait()
        return request

    async with open_nodes(5) as (caller_or_callee, *others), Node.open(loopback_config(connections=TIGHT)) as hub:
        for node in (hub, caller_or_callee):
            node.rpc.add_unary("slow", StringValue, slow)
        # all five connect, and the call is under way, before the manager may choose: a look between
        # two connects on a slow machine (CI, 676f6a2) trimmed at four, the caller among them
        connecting = [hub.protect(node.peer_id, "connecting") for node in (caller_or_callee, *others)]
        for node in (caller_or_callee, *others):
            await hub.connect(node.addrs[0])
        async with trio.open_nursery() as nursery:
            if direction == "we call":
                nursery.start_soon(hub.rpc.call, caller_or_callee.peer_id, "slow", StringValue(value="x"), StringValue)
                await wait_until(lambda: hub.rpc.in_flight(caller_or_callee.peer_id) == 1, timeout=5)
            else:
                nursery.start_soon(caller_or_callee.rpc.call, hub.peer_id, "slow", StringValue(value="x"), StringValue)
                await wait_until(lambda: hub.rpc.in_flight(caller_or_callee.peer_id) == 1, timeout=5)
            assert hub.trimmed == 0
            for handle in connecting:
                handle.remove()
            await wait_until(lambda: hub.trimmed == 2, timeout=10)  # of the four others, two stay
            await trio.sleep(0.6)
            assert caller_or_callee.peer_id in hub.connected_peers() and hub.trimmed == 2
            released.set()
        assert hub.rpc.in_flight(caller_or_callee.peer_id) == 0
        # the call's stream now waits in a pool for the next call: idle, it keeps nobody. One trimmed
        # peer back makes 4, over the high water of 3: the caller counts, so 2 remain (3 if it were
        # still kept). One only: with two reconnects a trim pass between them left 3 (a loaded CI run)
        gone = next(n for n in others if n.peer_id not in hub.connected_peers())
        await hub.connect(gone.addrs[0])
        await wait_until(lambda: len(hub.connections()) == 2, timeout=10)
