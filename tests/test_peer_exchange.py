import logging
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import events as ev
from p2p.peer_exchange import (DIAL_TIMEOUT, GREET_METHOD, MAX_ADDRS_PER_PEER, MAX_BACKOFF, MAX_GREETING, MAX_PEERS,
                               PEERS_METHOD, PeerExchange, next_wait)
from p2p.proto.peer_exchange_pb2 import Ack, Greeting, PeerRecord, PeersRequest, PeersResponse
from p2p.rpc import RpcError

from .conftest import open_nodes
from .kit import closed_port, log_lines, random_peer_id, wait_until


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


# ---------------------------------------------------------------------- what an answer holds


def tcp(port: int) -> Multiaddr:
    return Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")


async def known_to(hub, *peers) -> None:  # type: ignore[no-untyped-def]
    """Wait until ``hub`` identified each of ``peers`` (their listen addresses are what it shares)."""
    await wait_until(lambda: all(hub.known_addrs(p.peer_id) for p in peers))


async def test_an_answer_holds_at_most_the_askers_limit_and_the_servers_own() -> None:
    async with open_nodes(5) as (hub, *others):
        PeerExchange(hub, max_peers=3).serve()
        for other in others:
            await other.connect(hub.addrs[0])
        await known_to(hub, *others)
        asker = others[0]

        async def answer(limit: int) -> list[bytes]:
            response = await asker.rpc.call(hub.peer_id, PEERS_METHOD, PeersRequest(limit=limit), PeersResponse)
            return [bytes(r.peer_id) for r in response.peers]

        assert len(await answer(0)) == 3  # no limit asked: the server's own (3 of the 3 others)
        assert len(await answer(2)) == 2
        assert len(await answer(50)) == 3  # never more than the server's own
        # a different one of the three each time, by chance: all 30 alike would happen once in 3^29
        assert len({peer for _ in range(30) for peer in await answer(1)}) > 1
        assert len(await PeerExchange(asker, max_peers=1).ask(hub.peer_id)) == 1  # the asker's limit goes in the request


async def test_a_peer_is_shared_with_its_best_eight_addresses_and_not_at_all_without_one(monkeypatch) -> None:
    async with open_nodes(4) as (hub, many, none, asker):
        PeerExchange(hub).serve()
        for node in (many, none, asker):
            await node.connect(hub.addrs[0])
        await known_to(hub, many, none)
        hub.add_addrs(many.peer_id, [tcp(20_000 + i) for i in range(12)])
        known = hub.known_addrs
        monkeypatch.setattr(hub, "known_addrs", lambda pid: [] if pid == none.peer_id else known(pid))
        response = await asker.rpc.call(hub.peer_id, PEERS_METHOD, PeersRequest(), PeersResponse)
        records = {ID(r.peer_id): r for r in response.peers}
        assert set(records) == {many.peer_id}
        assert len(records[many.peer_id].addrs) == MAX_ADDRS_PER_PEER


async def lying(liar, records: list[PeerRecord]) -> list[int]:  # type: ignore[no-untyped-def]
    """Make ``liar`` answer ``px.peers`` with ``records``; the limits it was asked for, in order."""
    limits: list[int] = []

    async def lie(request: PeersRequest, ctx) -> PeersResponse:  # type: ignore[no-untyped-def]
        limits.append(request.limit)
        return PeersResponse(peers=records)

    liar.rpc.add_unary(PEERS_METHOD, PeersRequest, lie)
    return limits


async def test_the_asker_keeps_its_limit_of_records_and_eight_addresses_each() -> None:
    many = [tcp(30_000 + i).to_bytes() for i in range(MAX_ADDRS_PER_PEER + 4)]
    async with open_nodes(2) as (liar, asker):
        wide = random_peer_id()
        records = [PeerRecord(peer_id=wide.to_bytes(), addrs=many)]
        records += [PeerRecord(peer_id=random_peer_id().to_bytes(), addrs=[tcp(40_000 + i).to_bytes()]) for i in range(99)]
        limits = await lying(liar, records)
        await asker.connect(liar.addrs[0])
        found = await PeerExchange(asker).ask(liar.peer_id)
        assert len(found) == MAX_PEERS and limits == [MAX_PEERS]
        assert found[0] == (wide, [Multiaddr(a) for a in many[:MAX_ADDRS_PER_PEER]])
        found = await PeerExchange(asker, max_peers=5).ask(liar.peer_id)
        assert len(found) == 5 and limits[-1] == 5


async def test_a_record_with_a_bad_address_among_the_first_eight_is_dropped_whole() -> None:
    garbage = b"\xff\xff"
    good = [tcp(50_000 + i).to_bytes() for i in range(MAX_ADDRS_PER_PEER)]
    bad_inside, bad_after, empty, fine = random_peer_id(), random_peer_id(), random_peer_id(), random_peer_id()
    async with open_nodes(2) as (liar, asker):
        await lying(liar, [
            PeerRecord(peer_id=bad_inside.to_bytes(), addrs=[good[0], garbage, good[1]]),
            PeerRecord(peer_id=bad_after.to_bytes(), addrs=[*good, garbage]),  # the ninth is never read
            PeerRecord(peer_id=empty.to_bytes(), addrs=[]),
            PeerRecord(peer_id=fine.to_bytes(), addrs=good[:2]),
        ])
        await asker.connect(liar.addrs[0])
        found = dict(await PeerExchange(asker).ask(liar.peer_id))
        assert set(found) == {bad_after, fine}
        assert len(found[bad_after]) == MAX_ADDRS_PER_PEER and len(found[fine]) == 2


async def test_a_greeting_is_cut_by_the_greeter_too() -> None:
    async with open_nodes(2) as (a, b):
        heard: list[str] = []

        async def listen(request: Greeting, ctx) -> Ack:  # type: ignore[no-untyped-def]
            heard.append(request.text)
            return Ack()

        a.rpc.add_unary(GREET_METHOD, Greeting, listen)
        await b.connect(a.addrs[0])
        await PeerExchange(b).greet(a.peer_id, "y" * 1000)
        assert heard == ["y" * MAX_GREETING]


# ---------------------------------------------------------------------- a round


def logged(caplog: pytest.LogCaptureFixture, start: str) -> list[str]:
    return log_lines(caplog, "p2p.peer_exchange", start)


async def test_a_round_asks_past_a_peer_that_does_not_answer_and_counts_whom_it_could_not_reach(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.DEBUG, logger="p2p.peer_exchange")
    async with open_nodes(5) as (silent, liar, hub, a, b):
        dead = [random_peer_id(), random_peer_id()]
        # b is connected to us already (its record is passed over, not the round), then two that do not answer
        await lying(liar, [PeerRecord(peer_id=b.peer_id.to_bytes(), addrs=[b.addrs[0].to_bytes()]),
                           *(PeerRecord(peer_id=d.to_bytes(), addrs=[tcp(closed_port()).to_bytes()]) for d in dead),
                           PeerRecord(peer_id=b"\x00garbage", addrs=[])])
        PeerExchange(hub).serve()
        await a.connect(hub.addrs[0])
        await known_to(hub, a)
        async with open_nodes(1) as (newcomer,):
            for node in (silent, b, liar, hub):  # the one that serves no exchange first
                await newcomer.connect(node.addrs[0])
            dials: list[float | None] = []
            connect = newcomer.connect

            async def dialing(target, *, timeout=None, **kw):  # type: ignore[no-untyped-def]
                dials.append(timeout)
                return await connect(target, timeout=timeout, **kw)

            monkeypatch.setattr(newcomer, "connect", dialing)
            assert await PeerExchange(newcomer)._exchange() == (1, 2)  # met a; the liar's two dead peers unreached
            assert a.peer_id in newcomer.connected_peers() and not set(dead) & set(newcomer.connected_peers())
            assert dials == [DIAL_TIMEOUT] * 3  # b is not dialed again: the two dead, then a
            assert await PeerExchange(newcomer).exchange_once() == 0  # a is connected already: not dialed again
        assert len(logged(caplog, f"peer exchange with {silent.peer_id} failed: ")) == 2
        assert all(not line.endswith("None") for line in logged(caplog, "peer exchange with "))
        unreached = logged(caplog, "could not reach ")
        assert [line.split(" ")[3] for line in unreached[:2]] == [str(d) for d in dead]
        assert all(f" learnt from {liar.peer_id}: " in line and not line.endswith("None") for line in unreached)
        assert logged(caplog, f"skipping a malformed peer record from {liar.peer_id}")


async def test_each_peer_is_greeted_once_and_one_that_refuses_does_not_stop_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="p2p.peer_exchange")
    async with open_nodes(3) as (rude, kind, greeter):
        greeted: list[ID] = []

        async def listen(request: Greeting, ctx) -> Ack:  # type: ignore[no-untyped-def]
            greeted.append(ctx.peer_id)
            return Ack()

        kind.rpc.add_unary(GREET_METHOD, Greeting, listen)  # rude serves nothing
        await greeter.connect(rude.addrs[0])
        await greeter.connect(kind.addrs[0])
        exchange = PeerExchange(greeter, greeting="hello")
        await exchange._exchange()
        await exchange._exchange()
        assert greeted == [greeter.peer_id]
    (line,) = logged(caplog, f"greeting {rude.peer_id} failed: ")
    assert not line.endswith("None")


async def test_serving_ends_with_its_registration() -> None:
    async with open_nodes(2) as (a, b):
        await b.connect(a.addrs[0])
        with PeerExchange(a).serve():
            assert await PeerExchange(b).ask(a.peer_id) == []
            await PeerExchange(b).greet(a.peer_id, "hi")
        with pytest.raises(RpcError):
            await PeerExchange(b).ask(a.peer_id)
        with pytest.raises(RpcError):
            await PeerExchange(b).greet(a.peer_id, "hi")


class RecordingRpc:
    """Stands in for a node's RPC: records each call's method and timeout, answers an empty reply."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float | None]] = []

    async def call(self, peer, method, request, reply_type, *, timeout):  # type: ignore[no-untyped-def]
        self.calls.append((method, timeout))
        return reply_type()


async def test_asking_and_greeting_wait_ten_seconds_unless_told() -> None:
    rpc = RecordingRpc()
    exchange = PeerExchange(SimpleNamespace(rpc=rpc))  # type: ignore[arg-type]
    peer = random_peer_id()
    await exchange.ask(peer)
    await exchange.greet(peer, "hi")
    await exchange.ask(peer, timeout=2.5)
    await exchange.greet(peer, "hi", timeout=3.5)
    assert rpc.calls == [(PEERS_METHOD, 10.0), (GREET_METHOD, 10.0), (PEERS_METHOD, 2.5), (GREET_METHOD, 3.5)]


async def test_rounds_come_at_the_interval_while_they_meet_or_miss_someone_and_slow_down_when_quiet(
        autojump_clock: trio.testing.MockClock) -> None:
    """The schedule of :meth:`PeerExchange.run` (interval 1 s), its rounds scripted: quiet rounds wait 2, 4,
    8, 16 and 16 intervals; a round that met someone, or could not reach someone it learnt of, or that
    follows a new connection, is followed by one interval; a peer connecting during a long wait brings
    the next round at the next look (every interval)."""
    connected: set[ID] = set()
    node = SimpleNamespace(connected_peers=lambda: list(connected))
    exchange = PeerExchange(node)  # type: ignore[arg-type]
    script = {6: (1, 0), 9: (0, 1)}  # round at t=6 met one; at t=9 one was unreached
    rounds: list[float] = []

    async def scripted() -> tuple[int, int]:
        now = trio.current_time()
        rounds.append(now)
        return script.get(round(now), (0, 0))

    exchange._exchange = scripted  # type: ignore[method-assign]

    async def newcomer() -> None:
        await trio.sleep(13.5)
        connected.add(random_peer_id())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(exchange.run, 1.0)
        nursery.start_soon(newcomer)
        await trio.sleep(61.5)
        nursery.cancel_scope.cancel()
    assert rounds == [0, 2, 6, 7, 9, 10, 12, 14, 15, 17, 21, 29, 45, 61]


async def test_without_a_connection_manager_a_peer_always_wants_more() -> None:
    from p2p import Node
    from p2p.conn_manager import ConnManagerConfig

    from .conftest import loopback_config

    off = ConnManagerConfig(low_water=1, high_water=1, enabled=False)
    async with open_nodes(1) as (other,), Node.open(loopback_config(connections=off)) as node:
        await node.connect(other.addrs[0])
        assert PeerExchange(node).wants_more()


def test_a_negative_count_of_quiet_rounds_waits_one_interval() -> None:
    assert next_wait(2.0, -3) == 2.0


async def test_the_peers_connected_are_greeted_before_the_round_dials_one_that_never_answers() -> None:
    """A dial to a peer learnt of can take its whole timeout (here: a port that takes the connection and
    says nothing): the peers connected already are greeted first, not after it (the demo's public peer
    greeted the swarm 5.5 s late behind such a dial)."""
    async with open_nodes(2) as (greeter, kind), trio.open_nursery() as nursery:
        greeted = trio.Event()

        async def listen(request: Greeting, ctx) -> Ack:  # type: ignore[no-untyped-def]
            greeted.set()
            return Ack()

        kind.rpc.add_unary(GREET_METHOD, Greeting, listen)
        silent = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]  # the kernel accepts; nobody speaks
        port = silent.socket.getsockname()[1]
        await greeter.connect(kind.addrs[0])
        exchange = PeerExchange(greeter, greeting="hello")
        mute = random_peer_id()

        async def ask(peer_id: ID, *, timeout: float = 10.0) -> list[tuple[ID, list[Multiaddr]]]:
            return [(mute, [Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")])]

        exchange.ask = ask  # type: ignore[method-assign]
        round_done = trio.Event()

        async def one_round() -> None:
            await exchange._exchange()
            round_done.set()

        nursery.start_soon(one_round)
        with trio.fail_after(3):
            await greeted.wait()
        assert not round_done.is_set()  # still dialing the silent peer
        nursery.cancel_scope.cancel()
        await silent.aclose()
