"""The DHT's wire format and the checks every message from a peer goes through.

Two RPC methods over :mod:`p2p.rpc` (schema: ``p2p/dht/proto/dht.proto``):
``dht.find`` (closest nodes and the records of many keys at once; with no
queries it is a ping) and ``dht.store`` (many records at once). Everything a
peer sends is bounded here (queries and records per call, peers and addresses
per reply) before any of it is used, so a lying or garbled reply costs at most
a few hundred small objects.

Regenerate the checked-in code after editing the schema with ``make proto``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from ..errors import RemoteProtocolError
from ..rpc import FIRST_APPLICATION_CODE, RemoteError
from ..untrusted import decode_addrs as _decode_addrs
from ..untrusted import decode_peer_id
from .proto import dht_pb2 as pb
from .routing import ID_BITS, DHTID, Contact, PeerInfo

FIND = "dht.find"
STORE = "dht.store"

#: Most queries in one FindRequest and records in one StoreRequest.
MAX_BATCH = 64
#: Most addresses kept per peer from a reply or a sender: enough for ip4, ip6 and a few interfaces.
MAX_ADDRS = 8
TARGET_BYTES = ID_BITS // 8


class BadDHTRequest(RemoteError):
    """What a caller gets back for a request that broke the protocol (too many queries, a garbled key)."""

    code = FIRST_APPLICATION_CODE + 100


def encode_addrs(addrs: Iterable[Multiaddr]) -> list[bytes]:
    return [a.to_bytes() for a in list(addrs)[:MAX_ADDRS]]


def decode_addrs(raw: Sequence[bytes], *, direct_only: bool = False) -> tuple[Multiaddr, ...]:
    """At most ``MAX_ADDRS`` addresses (:func:`p2p.untrusted.decode_addrs`: garbage dropped, not fatal)."""
    return tuple(_decode_addrs(raw, limit=MAX_ADDRS, direct_only=direct_only))


def peer_entry(contact: Contact) -> pb.PeerEntry:
    """A contact as replies carry it (the message is shared: a reply's ``extend`` copies it)."""
    return _entry(contact.peer_id, contact.addrs)


@lru_cache(maxsize=32768)
def _entry(peer_id: ID, addrs: tuple[Multiaddr, ...]) -> pb.PeerEntry:
    # Cached: every reply carries k contacts, and a server sends the same ones again and again
    # (encoding them was a tenth of a lookup's CPU at ten thousand peers).
    return pb.PeerEntry(peer_id=peer_id.to_bytes(), addrs=encode_addrs(addrs))


def decode_peers(entries: Sequence[pb.PeerEntry], limit: int) -> list[PeerInfo]:
    """The first ``limit`` well-formed entries of a reply as :class:`PeerInfo` (ids re-derived)."""
    out: list[PeerInfo] = []
    for entry in entries[:limit]:
        info = _peer_info(entry.peer_id, tuple(entry.addrs))
        if info is not None:
            out.append(info)
    return out


@lru_cache(maxsize=32768)
def _peer_info(raw_id: bytes, raw_addrs: tuple[bytes, ...]) -> PeerInfo | None:
    # Cached by the entry's bytes (bounded: a flood of distinct entries only evicts): the same
    # contacts come back in reply after reply, and parsing each was a fifth of a lookup's CPU.
    peer_id = decode_peer_id(raw_id)
    return None if peer_id is None else PeerInfo(peer_id, decode_addrs(raw_addrs, direct_only=True))


def query_target(query: pb.Query) -> DHTID:
    """Where a query points: sha256 of its key, or its explicit 32-byte target."""
    if query.key:
        return DHTID.from_key(query.key)
    if len(query.target) != TARGET_BYTES:
        raise RemoteProtocolError(f"a query needs a key or a {TARGET_BYTES}-byte target, got {len(query.target)} bytes")
    return DHTID(int.from_bytes(query.target, "big"))


def target_query(target: int) -> pb.Query:
    return pb.Query(target=int(target).to_bytes(TARGET_BYTES, "big"))


def check_batch(n: int, what: str) -> None:
    if n > MAX_BATCH:
        raise RemoteProtocolError(f"{n} {what} in one call; the limit is {MAX_BATCH}")


def same_host(addrs: Iterable[Multiaddr], observed: Multiaddr) -> list[Multiaddr]:
    """Claimed listen addresses on the IP the connection really came from.

    Why: a server is put into routing tables with the addresses it claims,
    and other peers will dial them; accepting any IP would let one peer point
    a whole swarm's dials at a victim.
    """
    ip = _ip_of(observed)
    return [a for a in addrs if ip is not None and _ip_of(a) == ip]


def _ip_of(addr: Multiaddr) -> str | None:
    for proto, value in addr.items():
        if proto.name in ("ip4", "ip6"):
            return str(value)
        if proto.name == "p2p-circuit":
            return None
    return None
