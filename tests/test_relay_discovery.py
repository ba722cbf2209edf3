"""Relays found through the DHT (``nat/relay_discovery.py``): real Peers on loopback, and hostile records."""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from multiaddr import Multiaddr

from nat import Peer, PeerConfig
from nat import events as nev
from nat.autorelay import AutoRelayConfig
from nat.port_mapping import PortMappingConfig
from nat.proto import circuit_pb2 as pb
from nat.relay_discovery import (MAX_CANDIDATES, MAX_RELAY_ADDRS, RELAYS_KEY, RelayDiscoveryConfig, advertise_once,
                                 find_relays, parse_relays, relay_record)
from nat.traversal import NatConfig
from p2p.dht import DHTConfig
from p2p.dht.events import DHTMode
from p2p.dht.records import ValueWithExpiration, owned
from p2p.errors import ConfigError
from p2p.identity import new_identity, peer_id_of
from p2p.untrusted import decode_peer_id

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


def found_of(entries: dict[Any, Any]) -> ValueWithExpiration:
    """A dictionary key's lookup result holding ``entries`` (subkey -> value), all live a minute more."""
    later = time.time() + 60
    return ValueWithExpiration({k: ValueWithExpiration(v, later) for k, v in entries.items()}, later)


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
    found = found_of(entries)
    relays = parse_relays(found)
    assert [(r, len(a)) for r, a in relays] == [(honest, MAX_RELAY_ADDRS)]
    assert circuit not in relays[0][1] and relays[0][1][0] == addrs[0]
    assert parse_relays(found, exclude={honest}) == []
    assert parse_relays(None) == [] and parse_relays(ValueWithExpiration(b"plain", time.time() + 60)) == []


# ---------------------------------------------------------------------- the record and its reading, alone


def honest_entries(count: int) -> dict[Any, bytes]:
    ids = [peer_id_of(new_identity()) for _ in range(count)]
    return {owned("relay", i): relay_record(i, [Multiaddr(f"/ip4/10.0.1.{n + 1}/tcp/4001")]) for n, i in enumerate(ids)}


def test_the_settings() -> None:
    settings = RelayDiscoveryConfig()
    assert settings.advertise is True and settings.ttl == 600.0 and settings.lookup is True
    settings.validate()
    RelayDiscoveryConfig(ttl=0.5).validate()
    with pytest.raises(ConfigError, match="^relay discovery ttl must be positive$"):
        RelayDiscoveryConfig(ttl=0).validate()


def test_a_relay_record_holds_its_id_and_direct_addresses_without_p2p() -> None:
    me = peer_id_of(new_identity())
    addrs = [Multiaddr(f"/ip4/10.0.0.{i}/tcp/4001/p2p/{me}") for i in range(1, MAX_RELAY_ADDRS + 3)]
    circuit = Multiaddr(f"/ip4/10.9.9.9/tcp/4001/p2p/{me}/p2p-circuit")
    record = pb.Peer.FromString(relay_record(me, [circuit, *addrs]))
    assert record.id == me.to_bytes()
    assert [Multiaddr(a) for a in record.addrs] == [Multiaddr(f"/ip4/10.0.0.{i}/tcp/4001")
                                                     for i in range(1, MAX_RELAY_ADDRS + 1)]


def test_one_lookup_gives_at_most_max_candidates_in_order_and_bad_entries_take_no_place() -> None:
    entries: dict[Any, Any] = {
        owned("relay", peer_id_of(new_identity())): b"",  # withdrawn
        owned("relay", peer_id_of(new_identity())): {"nested": b"x"},  # not bytes
        owned("relay", peer_id_of(new_identity())): b"\xff\x00garbage",
        # made by hand: relay_record itself leaves circuits out
        owned("relay", (circuits_only := peer_id_of(new_identity()))): pb.Peer(
            id=circuits_only.to_bytes(),
            addrs=[Multiaddr(f"/ip4/10.0.0.1/tcp/1/p2p/{circuits_only}/p2p-circuit").to_bytes()]).SerializeToString(),
    }
    honest = honest_entries(MAX_CANDIDATES + 2)
    entries.update(honest)
    relays = parse_relays(found_of(entries))
    want = [pb.Peer.FromString(v).id for v in list(honest.values())[:MAX_CANDIDATES]]
    assert [r.to_bytes() for r, _ in relays] == want
    exactly = parse_relays(found_of(honest_entries(MAX_CANDIDATES)))
    assert len(exactly) == MAX_CANDIDATES


def test_a_malformed_record_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="nat.relay_discovery")
    entries: dict[Any, Any] = {owned("relay", peer_id_of(new_identity())): b"\xff\x00garbage",
                               owned("relay", peer_id_of(new_identity())): b"",  # withdrawn: no garbage
                               owned("relay", peer_id_of(new_identity())): {"nested": b"x"}}  # not even parsed
    assert parse_relays(found_of(entries)) == []
    [skipped] = [m for m in caplog.messages if m.startswith("skipping")]
    assert skipped.startswith("skipping a malformed relay record: DecodeError(")


class FakeDHT:
    """What relay discovery asks of the DHT: its node's id, one store, one read."""

    def __init__(self, found: ValueWithExpiration | None = None, *, hang: bool = False) -> None:
        self.node = SimpleNamespace(peer_id=peer_id_of(new_identity()))
        self.found, self.hang = found, hang
        self.stored: list[tuple[Any, ...]] = []
        self.asked: list[tuple[Any, ...]] = []

    async def store(self, key: str, value: bytes, expiration: float, *, subkey: Any) -> bool:
        self.stored.append((key, value, expiration, subkey))
        return True

    async def get(self, key: str, *, latest: bool, timeout: float) -> ValueWithExpiration | None:
        self.asked.append((key, latest, timeout))
        if self.hang:
            await trio.sleep_forever()
        return self.found


async def test_advertising_stores_our_record_under_our_own_subkey() -> None:
    dht = FakeDHT()
    addrs = [Multiaddr("/ip4/10.0.0.1/tcp/4001")]
    before = time.time()
    assert await advertise_once(dht, addrs, ttl=90.0) is True  # type: ignore[arg-type]
    [(key, value, expiration, subkey)] = dht.stored
    me = dht.node.peer_id
    assert key == RELAYS_KEY and value == relay_record(me, addrs) and subkey == owned("relay", me)
    assert before + 90 <= expiration <= time.time() + 90


async def test_finding_relays_reads_the_latest_and_leaves_out_those_excluded() -> None:
    entries = honest_entries(3)
    dht = FakeDHT(found_of(entries))
    first = decode_peer_id(pb.Peer.FromString(next(iter(entries.values()))).id)
    relays = await find_relays(dht, exclude={first}, timeout=4.0)  # type: ignore[arg-type]
    assert len(relays) == 2 and first not in [r for r, _ in relays]
    assert dht.asked == [(RELAYS_KEY, True, 4.0)]


async def test_finding_relays_gives_up_at_its_timeout(autojump_clock: trio.testing.MockClock) -> None:
    start = trio.current_time()
    assert await find_relays(FakeDHT(hang=True), exclude=set(), timeout=3.0) == []  # type: ignore[arg-type]
    assert trio.current_time() - start == pytest.approx(3.0)
    dht = FakeDHT(None)
    assert await find_relays(dht, exclude=set()) == []  # type: ignore[arg-type]
    assert dht.asked == [(RELAYS_KEY, True, 10.0)]  # the default timeout
