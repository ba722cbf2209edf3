import pytest
import trio
from multiaddr import Multiaddr

from p2p import events as ev
from p2p.peer_exchange import MAX_BACKOFF, PeerExchange, next_wait
from p2p.proto.peer_exchange_pb2 import PeerRecord, PeersRequest, PeersResponse

from .conftest import open_nodes
from .kit import wait_until


async def test_newcomer_meets_the_swarm_through_one_peer():
    async with open_nodes(4) as (hub, a, b, newcomer):
        for node in (hub, a, b, newcomer):
            PeerExchange(node).serve()
        await a.connect(hub.addrs[0])
        await b.connect(hub.addrs[0])
        await newcomer.connect(hub.addrs[0])
        # the hub must have identified a and b to know their listen addresses
        await wait_until(lambda: all(p in hub.host.get_peerstore().peer_ids() and hub.host.get_peerstore().addrs(p) for p in (a.peer_id, b.peer_id)))
        found = await PeerExchange(newcomer).ask(hub.peer_id)
        assert {pid for pid, _ in found} == {a.peer_id, b.peer_id}  # never the asker itself
        assert await PeerExchange(newcomer).exchange_once() == 2
        assert {a.peer_id, b.peer_id, hub.peer_id} <= set(newcomer.connected_peers())


async def test_a_newcomer_meets_only_as_many_peers_as_its_connection_manager_keeps():
    """Meeting is bounded by the low water: past it, a peer met would be trimmed and dialed again each
    round, and a big swarm's peers would each dial all the others."""
    from p2p import Node
    from p2p.conn_manager import ConnManagerConfig

    from .conftest import loopback_config

    keeps = ConnManagerConfig(low_water=3, high_water=8, grace_period=60.0)
    async with open_nodes(6) as (hub, *others), Node.open(loopback_config(connections=keeps)) as newcomer:
        for node in (hub, *others):
            PeerExchange(node).serve()
        for other in others:
            await other.connect(hub.addrs[0])
        store = hub.host.get_peerstore()
        await wait_until(lambda: all(o.peer_id in store.peer_ids() and store.addrs(o.peer_id) for o in others))
        await newcomer.connect(hub.addrs[0])
        exchange = PeerExchange(newcomer)
        assert exchange.wants_more()
        assert await exchange.exchange_once() == 2  # the hub, and two of the five it knows
        assert len(newcomer.connected_peers()) == 3 and not exchange.wants_more()
        assert await exchange.exchange_once() == 0


async def test_greeting_arrives_as_message_event():
    async with open_nodes(2) as (a, b):
        PeerExchange(a).serve()
        await b.connect(a.addrs[0])
        async with a.events() as events:
            await PeerExchange(b).greet(a.peer_id, "hi " + "x" * 1000)
            with trio.fail_after(10):
                async for event in events:
                    if isinstance(event, ev.Message):
                        break
        assert event.peer_id == str(b.peer_id) and event.text.startswith("hi ") and len(event.text) == 280


async def test_lying_peer_cannot_break_the_asker():
    """Garbage records, too many records, ourselves: all dropped, nothing raised."""
    async with open_nodes(2) as (liar, asker):
        junk = [PeerRecord(peer_id=b"\x00garbage", addrs=[b"\xff\xff"]) for _ in range(500)]
        junk.append(PeerRecord(peer_id=asker.peer_id.to_bytes(), addrs=[asker.addrs[0].to_bytes()]))

        async def lie(request: PeersRequest, ctx) -> PeersResponse:
            return PeersResponse(peers=junk)

        liar.rpc.add_unary("px.peers", PeersRequest, lie)
        await asker.connect(liar.addrs[0])
        assert await PeerExchange(asker).ask(liar.peer_id) == []
        assert await PeerExchange(asker).exchange_once() == 0
        assert await asker.ping(liar.peer_id) > 0


async def test_a_peer_reachable_only_through_its_relay_is_shared_with_its_relayed_address():
    """Two peers behind NATs that map nothing meet only through a relay slot: the exchange must
    pass that address on (after the direct ones), or they never connect (seen in the NAT lab demo)."""
    async with open_nodes(3) as (hub, a, newcomer):
        PeerExchange(hub).serve()
        await a.connect(hub.addrs[0])
        await newcomer.connect(hub.addrs[0])
        await wait_until(lambda: bool(hub.known_addrs(a.peer_id)))
        circuit = Multiaddr(f"/ip4/127.0.0.1/tcp/1/p2p/{hub.peer_id}/p2p-circuit")
        hub.add_addrs(a.peer_id, [circuit])
        found = dict(await PeerExchange(newcomer).ask(hub.peer_id))
        addrs = [str(x) for x in found[a.peer_id]]
        assert str(circuit) in addrs and addrs[-1] == str(circuit), addrs  # relayed last
        assert any("p2p-circuit" not in x for x in addrs)


def test_the_rounds_slow_down_while_quiet_up_to_sixteen_intervals() -> None:
    assert [next_wait(0.5, q) for q in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert next_wait(5.0, 10_000) == 5.0 * MAX_BACKOFF


async def test_a_meshed_swarm_asks_less_and_still_greets_a_newcomer_at_once() -> None:
    """Three nodes that all know each other: each used to ask each other every interval forever. Their
    rounds slow down; yet a fourth node that connects to one of them is greeted within an interval,
    not after the long wait (the demo's swarm forms by those greetings)."""
    interval = 0.2
    async with open_nodes(4) as (a, b, c, newcomer):
        asked = 0
        exchanges = [PeerExchange(n, greeting=f"hello from {i}") for i, n in enumerate((a, b, c))]
        for exchange in exchanges:
            exchange.serve()
        PeerExchange(newcomer).serve()

        async def counting(request: PeersRequest, ctx) -> PeersResponse:  # type: ignore[no-untyped-def]
            nonlocal asked
            asked += 1
            return await exchanges[0]._handle_peers(request, ctx)

        a.rpc.remove("px.peers")
        a.rpc.add_unary("px.peers", PeersRequest, counting)
        rounds = 0
        first_round = exchanges[0]._exchange

        async def counted_round() -> tuple[int, int]:
            nonlocal rounds
            result = await first_round()
            rounds += 1
            return result

        exchanges[0]._exchange = counted_round  # type: ignore[method-assign]
        await b.connect(a.addrs[0])
        await c.connect(a.addrs[0])
        async with trio.open_nursery() as nursery:
            for exchange in exchanges:
                nursery.start_soon(exchange.run, interval)
            await wait_until(lambda: len(b.connected_peers()) == 2 and len(c.connected_peers()) == 2)
            await trio.sleep(2.0)  # quiet rounds: the waits grow to 8 x 0.2 s and more
            asked = 0
            await trio.sleep(4.0)
            # every 0.2 s, b and c would have asked a 40 times in 4 s; slowed down, a few times each
            assert asked <= 8, asked
            seen_rounds = rounds
            await wait_until(lambda: rounds > seen_rounds)  # a's round just ended: its next is >= 1.6 s away
            async with newcomer.events() as events:
                await newcomer.connect(a.addrs[0])
                with trio.fail_after(1.5):  # within an interval or two (0.2 s), not the 3.2 s wait
                    async for event in events:
                        if isinstance(event, ev.Message) and event.text == "hello from 0":
                            break
            nursery.cancel_scope.cancel()
