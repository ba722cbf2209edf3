"""NatService on loopback: autorelay, reachability, client mode, hostile identify answers, metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio
from libp2p.abc import INetStream
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.identity.identify.pb.identify_pb2 import Identify
from multiaddr import Multiaddr

from nat import events as nev
from nat.port_mapping import PortMappingConfig
from nat.autonat import DIAL_REQUEST
from nat.holepunch import HolePuncher
from nat.circuit import HOP_PROTOCOL
from p2p.addresses import is_relayed_conn
from nat.proto import autonat_v2_pb2 as apb
from nat.proto import circuit_pb2 as cpb
from nat.reachability import MappingKind
from nat.relay import RelayConfig
from nat.traversal import NatConfig, NatService
from p2p.wire import read_message, write_message
from p2p import Node
from p2p import events as ev
from p2p.addresses import is_relayed, peer_id_of, without_peer_id
from p2p.node import MAX_LISTEN_ADDRS
from p2p.varint import encode_varint

from .conftest import loopback_config
from .kit import record_events, wait_until

FUNNEL = {
    "mode",
    "reachability",
    "mapping",
    "confirmed",
    "reservations",
    "reservations_made",
    "reservation_failures",
    "dial_backs",
    "punch_attempts",
    "punch_successes",
    "punch_first_try",
    "reversals",
    "punch_failures",
    "time_to_direct",
    "bytes_direct",
    "bytes_relayed",
}


def nat_config(**overrides: Any) -> NatConfig:
    overrides.setdefault("port_mapping", PortMappingConfig(enabled=False))  # no router to ask on loopback
    return NatConfig(**overrides)


@asynccontextmanager
async def nat_node(config: NatConfig | None = None, *,
                   listen: list[str] | None = None) -> AsyncIterator[tuple[Node, NatService, list[ev.Event]]]:
    """A node with the NAT layer, and the events it emitted (recorded from the start).

    Recorded as they are emitted (:func:`tests.kit.record_events`), not read from a channel: a
    test that saw a state change reads its event at once (a channel delivers it a moment
    later, and a loaded machine made such reads fail).
    """
    async with Node.open(loopback_config() if listen is None else loopback_config(listen=listen)) as node:
        seen = record_events(node)
        async with NatService.attach(node, config or nat_config()) as nat:
            yield node, nat, seen


def of_type(seen: list[ev.Event], kind: type) -> list[Any]:
    return [e for e in seen if isinstance(e, kind)]


def circuit_addrs(node: Node) -> list[Multiaddr]:
    return [a for a in node.addrs if is_relayed(a)]


# ---------------------------------------------------------------------- autorelay


async def test_peer_behind_a_relay_reserves_advertises_and_is_reachable_by_id():
    async with AsyncExitStack() as stack:
        relay, relay_nat, _ = await stack.enter_async_context(nat_node(nat_config(relay_service=True, autonat_server=False)))
        b, b_nat, b_seen = await stack.enter_async_context(nat_node())
        await b.connect(relay.addrs[0])
        await wait_until(lambda: circuit_addrs(b))
        # the circuit address comes with the reservation, the event and the mode a moment after it
        await wait_until(lambda: of_type(b_seen, nev.RelayReserved)
                         and any(e.mode == "relayed" for e in of_type(b_seen, nev.ModeChanged)))
        (reserved,) = of_type(b_seen, nev.RelayReserved)
        assert reserved.relay == str(relay.peer_id) and reserved.expire > 0
        # its line says where and until when, not "expire=1.8e+09"
        held = time.strftime("%H:%M:%S", time.localtime(reserved.expire))
        assert reserved.human() == (f"relay slot on {relay.peer_id}: reachable at {reserved.addrs[0]} "
                                    f"(held until {held}, renewed before then)")
        (circuit,) = circuit_addrs(b)
        assert str(circuit) == f"{without_peer_id(relay.addrs[0])}/p2p/{relay.peer_id}/p2p-circuit/p2p/{b.peer_id}"
        assert reserved.addrs == [str(circuit).rsplit("/p2p/", 1)[0]]
        assert b_nat.mode == "relayed" and b_nat.reachability != "public"
        assert any(isinstance(e, nev.ModeChanged) and e.mode == "relayed" for e in b_seen)
        assert relay_nat.metrics()["relay.reservations"] == 1

        # A third peer that knows only b's relayed address connects through the relay, and then by id alone.
        c, c_nat, _ = await stack.enter_async_context(nat_node())
        await c.connect(circuit)
        assert is_relayed_conn(c.network.get_connections(b.peer_id)[0])
        info = await c.identify(b.peer_id)  # b tells c its addresses, the relayed one included
        relayed = [a for a in info.listen_addrs if is_relayed(a)]
        assert relayed == [Multiaddr(str(circuit).rsplit("/p2p/", 1)[0])]
        await c.disconnect(b.peer_id)
        await wait_until(lambda: not c.network.get_connections(b.peer_id))
        store = c.host.get_peerstore()
        store.clear_addrs(b.peer_id)
        store.add_addrs(b.peer_id, relayed, 600)
        assert await c.connect(b.peer_id) == b.peer_id
        assert is_relayed_conn(c.network.get_connections(b.peer_id)[0])
        assert await c.ping(b.peer_id) > 0
        assert b_nat.metrics()["bytes_relayed"] > 0


async def test_a_relay_back_within_the_minute_is_reserved_on_at_once():
    """The relay restarts (or the link drops) and b reaches it again: b identifies it anew and reserves
    at once, not at autorelay's next poll (5 s) as when the last identify (under a minute old) stood."""
    async with AsyncExitStack() as stack:
        relay, relay_nat, _ = await stack.enter_async_context(nat_node(nat_config(relay_service=True, autonat_server=False)))
        b, b_nat, b_seen = await stack.enter_async_context(nat_node())
        await b.connect(relay.addrs[0])
        await wait_until(lambda: b_nat.relay_client.reservations)
        await b.disconnect(relay.peer_id)
        await wait_until(lambda: not b_nat.relay_client.reservations and of_type(b_seen, nev.RelayLost))
        await trio.sleep(0.2)  # autorelay's pass after the loss is over: it sleeps until its next poll
        await b.connect(relay.addrs[0])
        back = trio.current_time()
        await wait_until(lambda: b_nat.relay_client.reservations, timeout=10)
        assert trio.current_time() - back < 2.0
        assert len(of_type(b_seen, nev.RelayReserved)) == 2


async def test_a_relay_that_restarts_is_dialed_again_and_reserved_on_by_a_peer_with_other_connections(tmp_path):
    """b lost its slot when the relay restarted, but keeps a connection to c: it is not cut off, so it
    does not rejoin initial peers, and no peer source names relays here. The relay that held its slot
    is dialed again (the Node's backoff pacing it) and b reserves there once it is back."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        listen = f"/ip4/127.0.0.1/tcp/{sock.getsockname()[1]}"
    relay_config = loopback_config(identity_path=tmp_path / "relay.key", listen=[listen])

    async def relay_life(leave: trio.Event, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with Node.open(relay_config) as relay, \
                NatService.attach(relay, nat_config(relay_service=True, autonat_server=False)):
            task_status.started(relay.addrs[0])
            await leave.wait()

    async with AsyncExitStack() as stack:
        b, b_nat, b_seen = await stack.enter_async_context(nat_node())
        c, _, _ = await stack.enter_async_context(nat_node())
        async with trio.open_nursery() as nursery:
            first = trio.Event()
            relay_addr = await nursery.start(relay_life, first)
            await b.connect(relay_addr)
            await b.connect(c.addrs[0])
            await wait_until(lambda: b_nat.relay_client.reservations)
            first.set()
            await wait_until(lambda: of_type(b_seen, nev.RelayLost), timeout=15)
            await trio.sleep(1.0)  # down a while: b's dial of it fails, and waits out its backoff
            assert b.has_connection(c.peer_id) and not b.has_connection(peer_id_of(relay_addr))
            second = trio.Event()
            await nursery.start(relay_life, second)
            await wait_until(lambda: b_nat.relay_client.reservations, timeout=20)
            assert len(of_type(b_seen, nev.RelayReserved)) == 2
            second.set()


async def test_a_node_that_listens_nowhere_is_reachable_only_through_its_relay_slot():
    """``listen=[]`` (``dedloc peer --no-listen``): behind a NAT that maps nothing. It dials out, AutoNAT finds
    no address to confirm, it reserves a slot, advertises only the circuit, and others reach it there."""
    async with AsyncExitStack() as stack:
        relay, _, _ = await stack.enter_async_context(nat_node(nat_config(relay_service=True, allow_private=True)))
        b, b_nat, _ = await stack.enter_async_context(nat_node(listen=[]))
        assert b.listen_addrs == [] and b.addrs == []
        await b.connect(relay.addrs[0])
        await wait_until(lambda: b.addrs)
        assert all(is_relayed(a) for a in b.addrs) and b_nat.mode == "relayed"
        await wait_until(lambda: b_nat.reachability == "private")  # the AutoNAT server had nothing to dial back
        c, _, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        await c.connect(b.addrs)
        (conn,) = c.network.get_connections(b.peer_id)
        assert is_relayed_conn(conn)
        assert await c.ping(b.peer_id) > 0
        assert not is_relayed_conn(b.network.get_connections(relay.peer_id)[0])  # it dialed out directly


async def c_reaches_b_through_b_s_relay_slot(stack: AsyncExitStack) -> tuple[Node, Node, NatService, list[ev.Event]]:
    """A relay, b with no listen socket holding a slot on it, and c (listening, its verdict not in yet)
    connected to b through the slot: (b, c, c's NAT layer, b's events)."""
    relay, _, _ = await stack.enter_async_context(nat_node(nat_config(relay_service=True, allow_private=True)))
    b, _, b_seen = await stack.enter_async_context(nat_node(nat_config(allow_private=True), listen=[]))
    await b.connect(relay.addrs[0])
    await wait_until(lambda: b.addrs)
    c, c_nat, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
    await c.connect(b.addrs)
    return b, c, c_nat, b_seen


async def test_a_peer_reached_through_its_relay_slot_dials_the_caller_directly_when_it_can():
    """c reaches b (no listen socket) through b's relay slot, before c's own verdict: b's upgrade
    reverses the connection (dials c's address) in its first round. Its first reversal runs before
    identify has told b c's addresses; it then went on to punch, whose dial to a listening c failed its
    security handshake round after round (b dialed as the responder: mended, the next test), and the
    connection stayed relayed (seen in a CI run of the loopback demo: no averaged step in 45 s)."""
    async with AsyncExitStack() as stack:
        b, c, c_nat, b_seen = await c_reaches_b_through_b_s_relay_slot(stack)
        assert c_nat.reachability == "unknown"
        await wait_until(lambda: [e for e in of_type(b_seen, nev.HolePunched) if e.success], timeout=10)
        (punched,) = of_type(b_seen, nev.HolePunched)
        assert punched.method == "reversal" and punched.peer_id == c.peer_id and punched.elapsed < 3.0
        assert any(not is_relayed_conn(x) for x in b.network.get_connections(c.peer_id))


async def test_a_peer_without_a_listen_socket_punches_through_to_a_listening_one(monkeypatch):
    """The same pair with no reversal to fall back on: b's punch has no listen port to dial from, so no
    simultaneous open can happen and what its SYN reaches is c's listener, which b must speak to first.
    b dialed as the handshake's responder instead: both waited, every round (3 rounds, 15 s, relayed)."""
    monkeypatch.setattr(HolePuncher, "_reverse_targets", lambda self, peer: [])
    async with AsyncExitStack() as stack:
        b, c, _, b_seen = await c_reaches_b_through_b_s_relay_slot(stack)
        await wait_until(lambda: of_type(b_seen, nev.HolePunched), timeout=30)
        (punched,) = of_type(b_seen, nev.HolePunched)
        assert punched.success and punched.method == "punch" and punched.attempts == 1, punched
        assert any(not is_relayed_conn(x) for x in b.network.get_connections(c.peer_id))


async def test_a_full_relay_takes_back_slots_from_peers_that_went_public_and_they_renew_when_back(monkeypatch):
    """Peers reserve before their verdict (a NATed one is reachable at once), so two that went public
    hold both slots of a relay, advertising neither. A peer that listens nowhere still gets a slot: the
    full relay asks the holders (identify) and frees those not advertised. A holder that stops being
    public renews its slot at once, rather than advertise one the relay took back."""
    back_to_private: set[str] = set()
    wants = NatService._wants_relays
    monkeypatch.setattr(NatService, "_wants_relays",
                        lambda self: str(self.node.peer_id) in back_to_private or wants(self))
    async with AsyncExitStack() as stack:
        relay, relay_nat, _ = await stack.enter_async_context(nat_node(nat_config(
            relay_service=True, autonat_server=False, relay=RelayConfig(max_reservations=2, reclaim_grace=0.0))))
        server, _, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        holders = []
        for _ in range(2):
            p, p_nat, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
            await p.connect(relay.addrs[0])  # the relay judges nobody: the slot comes first
            await wait_until(lambda: p_nat.relay_client.reservations)
            await p.connect(server.addrs[0])
            holders.append((p, p_nat))
        await wait_until(lambda: all(n.mode == "public" for _, n in holders))
        assert relay_nat.relay_service is not None and set(relay_nat.relay_service.admission.slots) == {p.peer_id for p, _ in holders}
        assert all(not circuit_addrs(p) for p, _ in holders)

        b, b_nat, _ = await stack.enter_async_context(nat_node(listen=[]))
        await b.connect(relay.addrs[0])
        await wait_until(lambda: circuit_addrs(b))
        assert b_nat.mode == "relayed"
        assert relay_nat.metrics()["relay.reclaimed"] == 2
        assert set(relay_nat.relay_service.admission.slots) == {b.peer_id}

        # one holder is no longer public: its autorelay renews the slot it still thinks it has
        p, p_nat = holders[0]
        back_to_private.add(str(p.peer_id))
        p_nat.autorelay.wake()
        await wait_until(lambda: p.peer_id in relay_nat.relay_service.admission.slots)


async def test_a_public_peer_forgets_the_slots_that_expired_unrenewed():
    """A peer that reserved before its verdict and then went public renews nothing; once a slot's time
    is up no relay holds it, and the peer's status stops counting it."""
    async with AsyncExitStack() as stack:
        relay, _, _ = await stack.enter_async_context(nat_node(nat_config(
            relay_service=True, autonat_server=False, relay=RelayConfig(reservation_ttl=3))))
        server, _, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        p, p_nat, seen = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        await p.connect(relay.addrs[0])  # the relay judges nobody: the slot comes first
        await wait_until(lambda: p_nat.relay_client.reservations)
        await p.connect(server.addrs[0])
        await wait_until(lambda: p_nat.mode == "public")
        await wait_until(lambda: not p_nat.relay_client.reservations, 15, what="the expired slot forgotten")
        assert p_nat.metrics()["reservations"] == 0
        assert any("expired while we were public" in e.reason for e in of_type(seen, nev.RelayLost))


async def test_relay_loss_is_reported_and_its_address_withdrawn():
    async with AsyncExitStack() as stack:
        b, b_nat, b_seen = await stack.enter_async_context(nat_node())
        async with nat_node(nat_config(relay_service=True, autonat_server=False)) as (relay, _, _):
            await b.connect(relay.addrs[0])
            await wait_until(lambda: circuit_addrs(b))
        await wait_until(lambda: of_type(b_seen, nev.RelayLost))
        (lost,) = of_type(b_seen, nev.RelayLost)
        assert lost.relay == str(relay.peer_id)
        assert circuit_addrs(b) == []
        assert b_nat.relay_client.reservations == {}
        assert b_nat.metrics()["reservations"] == 0


# ---------------------------------------------------------------------- reachability


async def test_autonat_confirms_the_listen_address_and_the_peer_goes_public():
    async with AsyncExitStack() as stack:
        server, server_nat, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True, relay_service=True)))
        b, b_nat, b_seen = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        await b.connect(server.addrs[0])  # from an ephemeral port: the server observes that one
        await wait_until(lambda: b_nat.reachability == "public")
        listen = without_peer_id(b.addrs[0])
        assert b_nat.confirmed == [listen]
        changed = of_type(b_seen, nev.ReachabilityChanged)
        assert changed[-1].reachability == "public" and changed[-1].confirmed == [str(listen)]
        await wait_until(lambda: b_nat.mode == "public")
        assert of_type(b_seen, nev.ModeChanged)[-1].mode == "public"
        # What the server observed (the ephemeral port: nothing listens there) is neither asked
        # about nor advertised: each such address cost three dial-backs that time out behind a NAT.
        (observed,) = b.observed_addrs()
        assert observed != listen and observed not in b_nat._candidates() and not b_nat.verdicts.failures(observed)
        assert observed not in b_nat.confirmed
        assert [without_peer_id(a) for a in b.addrs] == [listen]  # no circuit either, being public
        metrics = b_nat.metrics()
        assert metrics["dial_backs"] == 1 and metrics["confirmed"] == [str(listen)]  # the listen address alone
        assert server_nat.metrics()["autonat_server.dial_back_ok"] >= 1


async def test_a_host_with_many_addresses_paces_its_checks_to_what_a_server_lets_one_peer_ask():
    """Six listen addresses (a home PC: IPv4, IPv6 and their observed forms) against one server at
    its default rate (4 at once, then one every 5 s): every request fits it, none is refused and
    none is an ERROR line in the server's log; the addresses over the burst wait for a later check."""
    async with AsyncExitStack() as stack:
        server, server_nat, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        listen = [f"/ip4/127.0.0.{i}/tcp/0" for i in range(1, 7)]
        b, b_nat, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True), listen=listen))
        assert len(b_nat._candidates()) >= 6
        await b.connect(server.addrs[0])
        await wait_until(lambda: b_nat.reachability == "public" and b_nat.metrics()["dial_backs"] >= 4)
        await trio.sleep(1.0)  # the length of a negative check: no fifth request within the burst
        assert b_nat.metrics()["dial_backs"] == 4 and b_nat.verdicts.confirmed()
        assert "service.autonat_requests_a_second_per_peer" not in server.resources.refusal_counts()
        assert server_nat.metrics()["autonat_server.requests"] == 4
        # A second server arrives (a check at once): the addresses left go to it alone (two listen
        # addresses, and what the servers observed), the first having no budget left for us yet.
        other, other_nat, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        await b.connect(other.addrs[0])
        await wait_until(lambda: other_nat.metrics()["autonat_server.requests"] >= 2)
        await trio.sleep(1.0)
        assert server_nat.metrics()["autonat_server.requests"] == 4
        assert 2 <= other_nat.metrics()["autonat_server.requests"] <= 4
        assert not server.resources.refusal_counts() and not other.resources.refusal_counts()


async def test_behind_a_symmetric_nat_what_observers_saw_of_the_listen_port_is_not_asked_about():
    """An endpoint-dependent NAT gives each destination its own mapping of the listen port: no one
    but that observer can use it, and asking servers to dial each such address cost a peer three
    dial-back timeouts apiece. Only the guess that the NAT kept the listen port is asked about then."""
    async with nat_node(nat_config(allow_private=True)) as (b, b_nat, _):
        port = next(iter(b.listen_ports))
        seen = {f"observer-{i}": Multiaddr(f"/ip4/127.0.0.9/tcp/{40001 + i}") for i in range(2)}
        b_nat._listen_views.update(seen)  # type: ignore[arg-type]  # how two observers saw the listen port
        b_nat.mapping = MappingKind.INDEPENDENT_CHANGED
        assert set(seen.values()) <= set(b_nat._candidates())
        b_nat.mapping = MappingKind.DEPENDENT
        candidates = b_nat._candidates()
        assert not set(seen.values()) & set(candidates)
        assert Multiaddr(f"/ip4/127.0.0.9/tcp/{port}") in candidates


async def test_one_server_is_asked_about_several_addresses_at_once(monkeypatch):
    """Within what a server lets one peer have open (4), the requests go at once: one after the
    other, a peer behind a NAT (every dial-back times out, 10 s) waited three timeouts for its verdict."""
    async with AsyncExitStack() as stack:
        server, server_nat, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        assert server_nat.autonat_server is not None
        open_now, most = [0], [0]

        async def slow_dial_back(peer, target, nonce):  # a NAT that drops the SYN, shortened
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])
            try:
                await trio.sleep(0.5)
            finally:
                open_now[0] -= 1
            return apb.E_DIAL_ERROR

        monkeypatch.setattr(server_nat.autonat_server, "_dial_back", slow_dial_back)
        listen = [f"/ip4/127.0.0.{i}/tcp/0" for i in range(1, 4)]
        b, b_nat, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True), listen=listen))
        await b.connect(server.addrs[0])
        await wait_until(lambda: b_nat.metrics()["dial_backs"] >= 3, timeout=10)
        assert most[0] >= 3


async def test_a_confirmed_address_is_asked_again_and_dropped_once_it_is_lost():
    """A port mapping the router forgot, an IP the ISP took back: once its answer is stale (``verdict_ttl``)
    the address is asked again, and when the dial-backs now fail it is no longer confirmed, advertised
    or public. (Before, one confirmation held for the life of the process.)"""
    async with AsyncExitStack() as stack:
        server, server_nat, _ = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        b, b_nat, b_seen = await stack.enter_async_context(
            nat_node(nat_config(allow_private=True, min_failures=1, verdict_ttl=3.0, recheck_interval=0.5)))
        await b.connect(server.addrs[0])
        await wait_until(lambda: b_nat.reachability == "public")
        listen = without_peer_id(b.addrs[0])
        assert b_nat.confirmed == [listen]

        async def never_reachable(stream: INetStream) -> None:  # the mapping is gone
            await read_message(stream, apb.Message)
            response = apb.DialResponse(status=apb.DialResponse.OK, addrIdx=0, dialStatus=apb.E_DIAL_ERROR)
            await write_message(stream, apb.Message(dialResponse=response))
            await stream.close()

        server.set_stream_handler(DIAL_REQUEST, never_reachable)
        # Asked again once stale (3 s), well before the stale answer would be forgotten (9 s).
        await wait_until(lambda: b_nat.reachability == "private", timeout=7.5)
        assert b_nat.confirmed == [] and listen not in [without_peer_id(a) for a in b.addrs]
        assert [e.reachability for e in of_type(b_seen, nev.ReachabilityChanged)][-2:] == ["public", "private"]


async def test_refused_relay_and_refuted_addresses_end_in_client_mode():
    async with AsyncExitStack() as stack:
        fake = await stack.enter_async_context(Node.open(loopback_config()))
        requests = {"hop": 0, "dial": 0}

        async def refuse_reservations(stream: INetStream) -> None:
            await read_message(stream, cpb.HopMessage)
            requests["hop"] += 1
            await write_message(stream, cpb.HopMessage(type=cpb.HopMessage.STATUS, status=cpb.RESERVATION_REFUSED))
            await stream.close()

        async def never_reachable(stream: INetStream) -> None:
            await read_message(stream, apb.Message)
            requests["dial"] += 1
            response = apb.DialResponse(status=apb.DialResponse.OK, addrIdx=0, dialStatus=apb.E_DIAL_ERROR)
            await write_message(stream, apb.Message(dialResponse=response))
            await stream.close()

        fake.set_stream_handler(HOP_PROTOCOL, refuse_reservations)
        fake.set_stream_handler(DIAL_REQUEST, never_reachable)
        b, b_nat, b_seen = await stack.enter_async_context(nat_node(nat_config(allow_private=True, min_failures=1)))
        listen = without_peer_id(b.addrs[0])
        await b.connect(fake.addrs[0])
        await wait_until(lambda: b_nat.mode == "client" and requests["hop"])
        assert [e.mode for e in of_type(b_seen, nev.ModeChanged)] == ["client"]
        assert b_nat.reachability == "private" and b_nat.confirmed == []
        assert b_nat.relay_client.reservations == {}
        assert listen not in [without_peer_id(a) for a in b.addrs]  # refuted: no longer advertised
        metrics = b_nat.metrics()
        assert metrics["mode"] == "client" and metrics["reservation_failures"] >= 1 and metrics["dial_backs"] >= 1
        # Client mode still dials out.
        assert await b.ping(fake.peer_id) > 0


async def test_an_address_a_dial_back_refuted_is_still_offered_to_a_hole_punch():
    """A stateful filter (a home router's IPv6 firewall) fails every dial-back but lets a punch's
    crossing SYN in: a refuted address leaves what we advertise, not what DCUtR offers. Two peers
    behind such filters punched over IPv6 only while their AutoNAT had not refuted it yet. We listen
    on 127.0.0.2 and meet the server from 127.0.0.1: nothing it observed stands for that address."""
    async with AsyncExitStack() as stack:
        fake = await stack.enter_async_context(Node.open(loopback_config()))

        async def never_reachable(stream: INetStream) -> None:
            await read_message(stream, apb.Message)
            response = apb.DialResponse(status=apb.DialResponse.OK, addrIdx=0, dialStatus=apb.E_DIAL_ERROR)
            await write_message(stream, apb.Message(dialResponse=response))
            await stream.close()

        fake.set_stream_handler(DIAL_REQUEST, never_reachable)
        b, b_nat, _ = await stack.enter_async_context(
            nat_node(nat_config(allow_private=True, min_failures=1), listen=["/ip4/127.0.0.2/tcp/0"]))
        listen = without_peer_id(b.addrs[0])
        await b.connect(fake.addrs[0])
        await wait_until(lambda: b_nat.reachability == "private")
        assert listen not in [without_peer_id(a) for a in b.addrs]  # refuted: no longer advertised
        assert listen not in b_nat._candidates()  # nor asked about again
        assert listen in b_nat.punch_addrs()


# ---------------------------------------------------------------------- hostile identify


def _hostile_identify(node: Node, listen_addrs: list[bytes], observed: bytes) -> None:
    """Replace the node's identify answer with one listing ``listen_addrs``."""

    async def handler(stream: INetStream) -> None:
        msg = Identify(
            protocol_version="ipfs/0.1.0",
            agent_version="hostile",
            public_key=node.key_pair.public_key.serialize(),
            listen_addrs=listen_addrs,
            observed_addr=observed,
            protocols=[IDENTIFY_PROTOCOL, "/ipfs/ping/1.0.0"],
        )
        body = msg.SerializeToString()
        await stream.write(encode_varint(len(body)) + body)
        await stream.close()

    node.host.set_stream_handler(IDENTIFY_PROTOCOL, handler)


BOGUS = [Multiaddr(f"/ip4/203.0.{i // 250}.{i % 250}/tcp/{1000 + i}").to_bytes() for i in range(400)] + [
    bytes([i % 256, 0xFF, 0x01]) for i in range(400)
]


async def test_peer_with_hundreds_of_bogus_addresses_changes_nothing_for_us():
    async with AsyncExitStack() as stack:
        hostile = await stack.enter_async_context(Node.open(loopback_config()))
        _hostile_identify(hostile, BOGUS, Multiaddr("/ip4/127.0.0.1/tcp/9/p2p-circuit").to_bytes())
        b, b_nat, b_seen = await stack.enter_async_context(nat_node(nat_config(allow_private=True)))
        await b.connect(hostile.addrs[0])
        await b.identify(hostile.peer_id)
        await wait_until(lambda: hostile.peer_id in b_nat._identified)
        # None of it became ours: no candidate, no observed address, nothing advertised.
        assert b_nat._candidates() == [without_peer_id(a) for a in b.addrs]
        assert hostile.peer_id not in b_nat._listen_views  # a relayed "observation" says nothing
        assert all("203.0." not in str(a) for a in b.addrs)
        # And the node works on: the hostile peer answers pings, others connect.
        assert await b.ping(hostile.peer_id) > 0
        async with Node.open(loopback_config()) as other:
            await other.connect(b.addrs[0])
            assert await other.ping(b.peer_id) > 0
        assert FUNNEL <= set(b_nat.metrics())


async def test_peer_store_keeps_at_most_max_listen_addrs_of_a_peer():
    async with Node.open(loopback_config()) as hostile, Node.open(loopback_config()) as b:
        _hostile_identify(hostile, BOGUS, b"")
        await b.connect(hostile.addrs[0])
        await b.identify(hostile.peer_id)
        with trio.move_on_after(2):  # let the automatic identify run too, if it will
            while len(b.known_addrs(hostile.peer_id)) <= MAX_LISTEN_ADDRS + 8:
                await trio.sleep(0.05)
        assert len(b.known_addrs(hostile.peer_id)) <= MAX_LISTEN_ADDRS + 8  # the cap, with room for dialed ones


async def test_identify_skips_garbage_addresses():
    async with Node.open(loopback_config()) as hostile, Node.open(loopback_config()) as b:
        _hostile_identify(hostile, BOGUS[400:] + BOGUS[:400], b"\x05\xff\x01")
        await b.connect(hostile.addrs[0])
        info = await b.identify(hostile.peer_id)
        got = [str(a) for a in info.listen_addrs]  # every one printable: garbage was dropped, not passed on
        assert set(str(Multiaddr(a)) for a in BOGUS[:400]) <= set(got)
        assert len(got) < len(BOGUS)
        assert info.observed_addr is None


# ---------------------------------------------------------------------- metrics


async def test_metrics_are_the_funnel_and_serialise():
    async with AsyncExitStack() as stack:
        relay, relay_nat, _ = await stack.enter_async_context(nat_node(nat_config(relay_service=True, autonat_server=False)))
        b, b_nat, _ = await stack.enter_async_context(nat_node())
        await b.connect(relay.addrs[0])
        await wait_until(lambda: b_nat.relay_client.reservations)
        metrics = b_nat.metrics()
        assert FUNNEL <= set(metrics)
        assert not any(k.startswith("relay.") for k in metrics) and metrics["autonat_server.requests"] == 0
        assert metrics["reservations"] == 1 and metrics["reservations_made"] == 1 and metrics["bytes_direct"] > 0
        relay_metrics = relay_nat.metrics()
        assert relay_metrics["relay.reservations"] == 1 and not any(k.startswith("autonat_server.") for k in relay_metrics)
        assert nev.NatStatus(metrics=metrics).to_json().startswith('{"event":"nat_status"')


async def test_what_a_node_learnt_of_peers_that_left_is_forgotten_once_their_identify_is_stale(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay's visitors come, are identified and leave: their protocols and identify times are kept
    while a returning peer would not be identified again (``IDENTIFY_EVERY``, 1 s here), then
    forgotten; a peer still connected keeps its protocols however old its identify, until it leaves.
    Before, both maps grew by one entry per peer ever met (``bench/relay_soak.py``)."""
    monkeypatch.setattr("nat.traversal.IDENTIFY_EVERY", 1.0)
    async with nat_node(nat_config(relay_service=True, autonat_server=False)) as (relay, nat, _), \
            Node.open(loopback_config()) as stays:
        await stays.connect(relay.addrs[0])
        await wait_until(lambda: stays.peer_id in nat._protocols, what="the relay identified the peer that stays")
        for _ in range(12):
            async with Node.open(loopback_config()) as visitor:
                await visitor.connect(relay.addrs[0])
                await wait_until(lambda: visitor.peer_id in nat._protocols, what="the relay identified the visitor")
        assert len(nat._protocols) >= 13  # within IDENTIFY_EVERY: a visitor back would be known at once
        # the peer that stays was identified long ago (the reachability pass would identify it again)
        nat._identified = {stays.peer_id: -1e9, **{p: t for p, t in nat._identified.items() if p != stays.peer_id}}
        await trio.sleep(1.1)
        async with Node.open(loopback_config()) as last:  # a close after that forgets the stale ones
            await last.connect(relay.addrs[0])
            await wait_until(lambda: last.peer_id in nat._protocols, what="the relay identified the last visitor")
        await wait_until(lambda: set(nat._protocols) <= {stays.peer_id, last.peer_id}, timeout=5,
                         what="the visitors forgotten")
        assert stays.peer_id in nat._protocols  # connected: kept
        assert set(nat._identified) <= {stays.peer_id, last.peer_id}
        # its identify time went while it was connected (a pass identifies it again): when it leaves
        # before that pass, its close alone forgets its protocols, as no stale identify will
        nat._identified.pop(stays.peer_id, None)
        await stays.disconnect(relay.peer_id)
        await wait_until(lambda: stays.peer_id not in nat._protocols, timeout=5, what="the peer that stayed forgotten")


async def test_a_node_listening_on_loopback_only_asks_no_router_for_a_port_mapping(monkeypatch, caplog):
    """A router cannot forward to 127.0.0.1: a node that listens only there sends nothing to the LAN's
    router (the loopback demo's peers asked it by PCP, NAT-PMP and UPnP's multicast at every start)."""
    import logging

    asked: list[int] = []

    def recording_map_port(port: int, **kwargs: Any) -> Any:
        asked.append(port)
        raise AssertionError("a mapping was asked for")

    monkeypatch.setattr("nat.traversal.map_port", recording_map_port)
    with caplog.at_level(logging.INFO, logger="nat.traversal"):
        async with nat_node(nat_config(port_mapping=PortMappingConfig(enabled=True))):
            await wait_until(lambda: any("no port mapping asked for" in r.getMessage() for r in caplog.records),
                             timeout=5, what="the port mapping task's decision")
    assert asked == []
