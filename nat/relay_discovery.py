"""Relays found through the DHT: public relays advertise themselves, autorelay looks them up.

Autorelay reserves on relays among the peers we are connected to. A volunteer
who bootstrapped through one node knows few peers, and a swarm whose relays are
not its bootstrap nodes would leave them without a slot. go-libp2p's autorelay
takes a *peer source* for this (a callback yielding candidate relays, usually
fed from the DHT); ours is one dictionary key in the swarm's DHT:

* a node running the relay service with a direct address, not judged private
  by AutoNAT, stores ``RELAYS_KEY[<owned subkey of its peer id>] = Peer{id, addrs}``
  (``nat/proto/circuit.proto``'s ``Peer``), signed (the owned subkey: nobody
  else can write or withdraw its entry), re-published every third of its TTL;
* autorelay, when it holds fewer slots than it wants and no connected peer
  offers HOP, reads the key (at most once per ``lookup_interval``) and dials the
  relays it did not know, in the order they came back.

A record is untrusted input: its owner must match the id inside, addresses are
parsed with :func:`p2p.untrusted.decode_addrs` (at most ``MAX_RELAY_ADDRS``,
circuits dropped), and a bad entry costs only itself. A false address costs a
dial that authenticates the peer id and fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.addresses import is_relayed, without_peer_id
from p2p.dht import DHT
from p2p.dht.records import DHTKey, ValueWithExpiration, owned, owner_of
from p2p.errors import ConfigError
from p2p.untrusted import decode_addrs, decode_peer_id

from .proto import circuit_pb2 as pb

log = logging.getLogger(__name__)

#: The DHT key every relay of a swarm advertises under (one subkey per relay).
RELAYS_KEY = "dedloc.relays"
#: Addresses kept from one relay's record (a relay has a few: IPv4, IPv6, a port mapping).
MAX_RELAY_ADDRS = 8
#: Relays taken from one lookup.
MAX_CANDIDATES = 16


@dataclass
class RelayDiscoveryConfig:
    #: A node running the relay service advertises itself in the DHT.
    advertise: bool = True
    #: Lifetime of the advertisement in seconds; it is re-published every third of it.
    ttl: float = 600.0
    #: Autorelay looks relays up in the DHT when connected peers offer too few
    #: (at most every ``AutoRelayConfig.peer_source_interval`` seconds).
    lookup: bool = True

    def validate(self) -> None:
        if not self.ttl > 0:
            raise ConfigError("relay discovery ttl must be positive")


def relay_record(peer_id: ID, addrs: list[Multiaddr]) -> bytes:
    """The value a relay stores: its id and direct addresses (without /p2p/)."""
    direct = [without_peer_id(a).to_bytes() for a in addrs if not is_relayed(a)][:MAX_RELAY_ADDRS]
    return pb.Peer(id=peer_id.to_bytes(), addrs=direct).SerializeToString()


def parse_relays(found: ValueWithExpiration | None, *, exclude: Collection[ID] = ()) -> list[tuple[ID, list[Multiaddr]]]:
    """The relays in a lookup's result: entries whose owner is the id inside, with some valid address."""
    if found is None or not isinstance(found.value, dict):
        return []
    out: list[tuple[ID, list[Multiaddr]]] = []
    for subkey, entry in found.value.items():
        if len(out) >= MAX_CANDIDATES:
            break
        if not isinstance(entry.value, bytes) or not entry.value:
            continue
        try:
            msg = pb.Peer.FromString(entry.value)
            owner = owner_of(DHTKey.encode(subkey))
        except Exception as e:  # a stranger's garbage costs it only its entry
            log.debug("skipping a malformed relay record: %r", e)
            continue
        peer_id = decode_peer_id(bytes(msg.id))
        if peer_id is None or owner != peer_id or peer_id in exclude:
            continue
        addrs = decode_addrs(msg.addrs, limit=MAX_RELAY_ADDRS, direct_only=True)
        if addrs:
            out.append((peer_id, addrs))
    return out


async def advertise_once(dht: DHT, addrs: list[Multiaddr], ttl: float) -> bool:
    """Store our relay record for ``ttl`` seconds; whether some replica took it."""
    me = dht.node.peer_id
    return await dht.store(RELAYS_KEY, relay_record(me, addrs), time.time() + ttl, subkey=owned("relay", me))


async def find_relays(dht: DHT, *, exclude: set[ID], timeout: float = 10.0) -> list[tuple[ID, list[Multiaddr]]]:
    """The relays advertised in the DHT, other than ``exclude`` (ourselves, those we hold slots on)."""
    with trio.move_on_after(timeout):
        return parse_relays(await dht.get(RELAYS_KEY, latest=True, timeout=timeout), exclude=exclude)
    return []


__all__ = ["MAX_RELAY_ADDRS", "RELAYS_KEY", "RelayDiscoveryConfig", "advertise_once", "find_relays", "parse_relays",
           "relay_record"]
