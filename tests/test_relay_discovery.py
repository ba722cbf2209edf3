"""Relays found through the DHT (``nat/relay_discovery.py``): real Peers on loopback, and hostile records."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from typing import Any

import trio
from multiaddr import Multiaddr

from nat import Peer, PeerConfig
from nat import events as nev
from nat.autorelay import AutoRelayConfig
from nat.port_mapping import PortMappingConfig
from nat.proto import circuit_pb2 as pb
from nat.relay_discovery import MAX_RELAY_ADDRS, RELAYS_KEY, RelayDiscoveryConfig, parse_relays, relay_record
from nat.traversal import NatConfig
from p2p.dht import DHTConfig
from p2p.dht.events import DHTMode
from p2p.dht.records import ValueWithExpiration, owned
from p2p.identity import new_identity, peer_id_of

from .conftest import loopback_config
from .kit import record_events, wait_until


def config(*, initial: list[str], dht: DHTMode, relay: bool = False, lookup: bool = True) -> PeerConfig:
    """127.0.0.1 does not count as reachable here (``allow_private`` off): a peer stays not-public
    and wants relay slots, as behind a NAT."""
    return PeerConfig(
        node=loopback_config(initial_peers=initial),
        nat=NatConfig(port_mapping=PortMappingConfig(enabled=False), relay_service=relay,
                      autorelay=AutoRelayConfig(enabled=not relay, poll_interval=0.5, peer_source_interval=0.5),
                      relay_discovery=RelayDiscoveryConfig(lookup=lookup)),
        dht=DHTConfig(mode=dht, bootstrap_timeout=10.0),
        exchange_interval=None,  # no peer exchange: nobody introduces the relay
    )


async def test_the_only_relay_is_learned_from_the_dht() -> None:
    """A bootstrap node that is no relay, a relay that is no DHT server (so no lookup of ours
    meets it) and no peer exchange: the peer learns the relay from its DHT record, dials it and
    holds a slot there; the same peer with lookups off never finds it."""
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(Peer.open(config(initial=[], dht=DHTMode.SERVER)))
        initial = [str(boot.addrs[0])]
        relay = await stack.enter_async_context(Peer.open(config(initial=initial, dht=DHTMode.CLIENT, relay=True)))
        await wait_until(lambda: boot.dht.storage.get(RELAYS_KEY, time.time()), 15, what="the relay's record")

        blind = await stack.enter_async_context(Peer.open(config(initial=initial, dht=DHTMode.AUTO, lookup=False)))
        seen: list[Any] = []  # recorded from the start: a subscription after open could miss the reservation
        peer = await stack.enter_async_context(Peer.open(config(initial=initial, dht=DHTMode.AUTO),
                                                         on_listening=lambda node: seen.extend([record_events(node)])))
        events = seen[0]
        reserved = await wait_until(lambda: [e for e in events if isinstance(e, nev.RelayReserved)], 20,
                                    what="a reservation")
        assert reserved[0].relay == relay.peer_id
        assert peer.metrics()["relays_discovered"] == 1 and peer.metrics()["reservations"] == 1
        assert any(str(a).endswith(f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{peer.peer_id}") for a in peer.addrs)
        # without the lookup the relay stays unknown (four of its lookup intervals later)
        await trio.sleep(2.0)
        assert blind.metrics()["reservations"] == 0 and relay.peer_id not in blind.node.connected_peers()


def test_relay_records_from_strangers_are_checked() -> None:
    """Entries whose owner is not the id inside, garbage, circuits and excess addresses are dropped."""
    honest, forged, garbage = (peer_id_of(new_identity()) for _ in range(3))
    addrs = [Multiaddr(f"/ip4/10.0.0.{i}/tcp/4001") for i in range(1, MAX_RELAY_ADDRS + 4)]
    circuit = Multiaddr(f"/ip4/10.0.0.1/tcp/4001/p2p/{honest}/p2p-circuit")
    entries = {
        owned("relay", honest): relay_record(honest, [circuit, *addrs]),
        owned("relay", forged): relay_record(honest, addrs[:1]),  # forged's entry claims to be honest
        owned("relay", garbage): b"\xff\x00not a protobuf",
        "unowned": relay_record(honest, addrs[:1]),
        owned("relay", peer_id_of(new_identity())): pb.Peer(id=b"\x01\x02", addrs=[b"junk"]).SerializeToString(),
    }
    found = ValueWithExpiration({k: ValueWithExpiration(v, time.time() + 60) for k, v in entries.items()}, time.time() + 60)
    relays = parse_relays(found)
    assert [(r, len(a)) for r, a in relays] == [(honest, MAX_RELAY_ADDRS)]
    assert circuit not in relays[0][1] and relays[0][1][0] == addrs[0]
    assert parse_relays(found, exclude={honest}) == []
    assert parse_relays(None) == [] and parse_relays(ValueWithExpiration(b"plain", time.time() + 60)) == []
