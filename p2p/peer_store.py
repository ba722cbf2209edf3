"""What a node's peer store remembers: its own keys, every peer it is connected to or dialing, and a
bounded number of the others.

The peer store holds what py-libp2p learns of each peer: addresses, public key, protocols. Peers
enter it from every source (identify, each DHT reply's contacts, peer exchange, the tracker), so a
node in a swarm of thousands learns thousands, and peer ids cost nothing to mint: it needs a bound.
py-libp2p 0.8.1 has one, 1,000 peers, and at the bound evicts first the entries that have no
address. Our own entry is one of them (it holds our key pair, never an address), so the
1,001st peer learnt evicted the node's own keys: from then on identify answered no one (it signs
with our public key from the store: peers learnt neither our protocols nor our addresses) and the
relay could not sign a reservation's voucher. A DHT lookup in a swarm of a few thousand peers
learns that many within minutes; a public relay or bootstrap node, over its life, as many.

The rule here, applied by ``p2p/libp2p_host.py``: the entries in ``keep`` (ourselves, connected
and dialing peers) are never forgotten and do not count; of the rest at most ``limit`` stay, and
once over it the store forgets down to ``low`` (so the sort runs once per ``limit - low`` peers
learnt, not once per peer): first those without an address (nothing to dial), then those whose
addresses expired, then the least recently heard of. A forgotten peer that matters comes back
with its addresses: the DHT re-adds a contact's addresses before each call, and the tracker its
reports'. Pure: entries in, peer ids out.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

from libp2p.peer.id import ID

#: Peers remembered besides ourselves and those connected (py-libp2p's bound, 1,000).
KNOWN_PEERS = 1000


@dataclass(frozen=True)
class Entry:
    """One peer store entry, as the rule reads it."""

    peer_id: ID
    has_addrs: bool
    #: Its addresses' time to live ran out (py-libp2p's ``PeerData.is_expired``).
    expired: bool
    #: When its addresses were last added (py-libp2p's ``last_identified``, Unix seconds).
    heard: float


def low_water(limit: int) -> int:
    """Where forgetting stops once the store went over ``limit``: a tenth below it."""
    return limit - max(1, limit // 10)


def to_forget(entries: Iterable[Entry], keep: Container[ID], limit: int) -> list[ID]:
    """The entries to forget now: none while at most ``limit`` are outside ``keep``, else enough of
    them to leave :func:`low_water` ones, without an address first, then expired, then least
    recently heard of."""
    candidates = [e for e in entries if e.peer_id not in keep]
    if len(candidates) <= limit:
        return []
    candidates.sort(key=lambda e: (e.has_addrs, not e.expired, e.heard))
    return [e.peer_id for e in candidates[: len(candidates) - low_water(limit)]]
