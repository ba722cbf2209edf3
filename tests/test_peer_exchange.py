import pytest
import trio
from multiaddr import Multiaddr

from p2p import events as ev
from p2p.peer_exchange import PeerExchange
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
