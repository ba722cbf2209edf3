"""What peers send us about addresses and identities, parsed by one rule each.

Multiaddrs and peer ids arrive from identify, peer exchange, the DHT, relay,
DCUtR and AutoNAT messages. Each is parsed here, once, by one cached function
with one rule, so that the same garbage is refused the same way everywhere and
a flood of repeated addresses costs one parse (py-multiaddr's parsing and
base58 once took a third of a DHT lookup's CPU).

Nothing here raises for bad input: a bad item is dropped (``None``), and the
caller decides whether that is a protocol violation (:func:`require_peer_id`).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from .addresses import CIRCUIT, peer_id_from_bytes
from .errors import RemoteProtocolError

#: Longest peer id accepted: an identity multihash of an Ed25519 key is 38 bytes, sha256 ones 34.
MAX_PEER_ID = 64
#: Longest binary multiaddr accepted (a circuit address with two peer ids is ~120 bytes).
MAX_ADDR = 512
#: Refused in any address from a peer. py-multiaddr 0.2.0 writes /ip6zone/'s value with a length
#: prefix but reads it back as empty (its utf8 codec's size is 0), so the zone's bytes parse as more
#: parts: /ip6zone/eth0/ip6/fe80::1/tcp/1 came back as ip6zone, ip4 101.116.104.48, ip6, tcp, a
#: link-local address with a public IPv4 in front, whatever a peer chose to put in the zone. A
#: zone names an interface of the sender's own host: no use to anyone else.
IP6ZONE = "ip6zone"


@lru_cache(maxsize=16384)
def _decoded(raw: bytes) -> tuple[Multiaddr, bool] | None:
    """A binary multiaddr and whether it is a relay circuit, or None when it does not parse."""
    if not 0 < len(raw) <= MAX_ADDR:
        return None
    try:
        addr = Multiaddr(raw)
        str(addr)  # py-multiaddr parses bytes lazily: force it, so garbage fails here
        names = [p.name for p in addr.protocols()]  # some garbage that prints fails only here
    except Exception:
        return None
    if IP6ZONE in names:
        return None
    return addr, CIRCUIT in names


def decode_addr(raw: bytes) -> Multiaddr | None:
    """A binary multiaddr from a peer, or None when it does not parse."""
    decoded = _decoded(raw)
    return None if decoded is None else decoded[0]


def decode_addrs(raw: Iterable[bytes], *, limit: int, direct_only: bool = False) -> list[Multiaddr]:
    """The valid multiaddrs among the first ``limit`` binary ones; garbage (and circuits, if asked) dropped.

    The circuit verdict is cached with the parse: checking it walked the address's
    protocols, a tenth of a lookup's CPU at ten thousand peers."""
    out: list[Multiaddr] = []
    seen: set[bytes] = set()
    for index, item in enumerate(raw):
        if index >= limit:
            break
        data = bytes(item)
        decoded = _decoded(data)
        if decoded is None or (direct_only and decoded[1]) or data in seen:
            continue
        seen.add(data)
        out.append(decoded[0])
    return out


@lru_cache(maxsize=16384)
def decode_peer_id(raw: bytes) -> ID | None:
    """A binary peer id from a peer, or None: it must be a well-formed multihash of at most 64 bytes
    (:func:`peer_id_from_bytes`)."""
    if not 0 < len(raw) <= MAX_PEER_ID:
        return None
    return peer_id_from_bytes(raw)


def require_peer_id(raw: bytes, what: str) -> ID:
    """:func:`decode_peer_id`, for a field the protocol requires: :class:`RemoteProtocolError` when invalid."""
    peer_id = decode_peer_id(bytes(raw))
    if peer_id is None:
        raise RemoteProtocolError(f"{what} is not a valid peer id")
    return peer_id
