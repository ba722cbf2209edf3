"""The DHT's wire checks alone (p2p/dht/protocol.py), pure: what a peer's addresses, contacts and
queries are cut to before anything uses them, and whose claimed addresses are believed."""

from __future__ import annotations

import hashlib

import pytest
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.dht import protocol as wire
from p2p.dht.proto import dht_pb2 as pb
from p2p.dht.routing import DHTID, Contact, PeerInfo
from p2p.errors import RemoteProtocolError
from p2p.rpc import FIRST_APPLICATION_CODE, RemoteError

from .test_dht_routing import make_ids

RELAY = "/ip4/127.0.0.3/tcp/4001/p2p/12D3KooWFSzsWFHfEVcD7T9fEWyayVQpcmkjNKbNTyyRntvjGfju"


def addr(i: int, ip: str = "127.0.0.1") -> Multiaddr:
    return Multiaddr(f"/ip4/{ip}/tcp/{4000 + i}")


def contact(peer: ID, *addrs: Multiaddr) -> Contact:
    return Contact(peer, DHTID.from_peer(peer), tuple(addrs), None, 0.0)


def test_the_method_names_and_limits() -> None:
    assert (wire.FIND, wire.STORE) == ("dht.find", "dht.store")
    assert (wire.MAX_BATCH, wire.MAX_ADDRS, wire.TARGET_BYTES) == (64, 8, 32)
    assert issubclass(wire.BadDHTRequest, RemoteError)
    assert wire.BadDHTRequest.code == FIRST_APPLICATION_CODE + 100


def test_addresses_are_capped_both_ways_and_garbage_is_dropped() -> None:
    many = [addr(i) for i in range(12)]
    assert wire.encode_addrs(many) == [a.to_bytes() for a in many[:8]]
    assert wire.encode_addrs(iter(many)) == [a.to_bytes() for a in many[:8]]  # any iterable
    assert wire.encode_addrs([]) == []
    raw = [a.to_bytes() for a in many]
    assert wire.decode_addrs(raw) == tuple(many[:8])
    # the cap counts entries read, garbage included: a peer cannot make us parse more by padding
    assert wire.decode_addrs([b"\xff"] * 3 + raw) == tuple(many[:5])
    circuit = Multiaddr(f"{RELAY}/p2p-circuit").to_bytes()
    assert wire.decode_addrs([circuit, raw[0]]) == (Multiaddr(f"{RELAY}/p2p-circuit"), many[0])
    assert wire.decode_addrs([circuit, raw[0]], direct_only=True) == (many[0],)


def test_a_contact_goes_on_the_wire_as_its_id_and_first_addresses() -> None:
    (peer,) = make_ids(1, seed=1)
    entry = wire.peer_entry(contact(peer, *(addr(i) for i in range(10))))
    assert entry.peer_id == peer.to_bytes()
    assert list(entry.addrs) == [addr(i).to_bytes() for i in range(8)]
    assert wire.peer_entry(contact(peer)) == pb.PeerEntry(peer_id=peer.to_bytes())


def test_a_reply_s_peers_are_cut_to_the_limit_and_bad_ids_dropped() -> None:
    peers = make_ids(5, seed=2)
    entries = [pb.PeerEntry(peer_id=p.to_bytes(), addrs=[addr(i).to_bytes()]) for i, p in enumerate(peers)]
    infos = wire.decode_peers(entries, limit=3)
    assert infos == [PeerInfo(p, (addr(i),)) for i, p in enumerate(peers[:3])]
    assert [i.dht_id for i in infos] == [DHTID.from_peer(p) for p in peers[:3]]  # derived, never taken
    assert wire.decode_peers(entries, limit=0) == []
    bad = [pb.PeerEntry(peer_id=b""), pb.PeerEntry(peer_id=b"\x00" * 65), pb.PeerEntry(peer_id=b"\x12\x05ab")]
    # a bad entry takes its place in the limit: at most ``limit`` entries are looked at
    assert wire.decode_peers(bad + entries, limit=4) == [PeerInfo(peers[0], (addr(0),))]
    assert wire.decode_peers(bad + entries, limit=100) == [PeerInfo(p, (addr(i),)) for i, p in enumerate(peers)]
    # a contact's relayed addresses are not taken: nobody dials a peer through a circuit from the DHT
    circuit = Multiaddr(f"{RELAY}/p2p-circuit").to_bytes()
    relayed = pb.PeerEntry(peer_id=peers[0].to_bytes(), addrs=[circuit, addr(7).to_bytes()])
    assert wire.decode_peers([relayed], limit=1) == [PeerInfo(peers[0], (addr(7),))]


def test_a_query_points_at_its_key_s_hash_or_at_its_target() -> None:
    assert wire.query_target(pb.Query(key=b"hello")) == DHTID(int.from_bytes(hashlib.sha256(b"hello").digest(),
                                                                              "big"))
    assert wire.query_target(pb.Query(key=b"hello", target=b"\x01" * 32)) == DHTID.from_key(b"hello")  # key first
    target = (1 << 255) | 12345
    assert wire.query_target(wire.target_query(target)) == target
    assert wire.target_query(target).target == target.to_bytes(32, "big")
    assert wire.target_query(DHTID(7)).target == bytes(31) + b"\x07"
    assert not wire.target_query(7).key
    for size in (0, 31, 33):
        with pytest.raises(RemoteProtocolError, match=f"a query needs a key or a 32-byte target, got {size} bytes"):
            wire.query_target(pb.Query(target=b"\x01" * size))


def test_a_batch_of_up_to_the_limit_is_allowed() -> None:
    wire.check_batch(0, "queries")
    wire.check_batch(64, "queries")
    with pytest.raises(RemoteProtocolError, match="^65 records in one call; the limit is 64$"):
        wire.check_batch(65, "records")


def test_only_addresses_on_the_ip_the_connection_came_from_are_believed() -> None:
    claimed = [addr(1, "127.0.0.7"), addr(2, "127.0.0.8"), addr(3, "127.0.0.7"), Multiaddr("/ip6/::1/tcp/4001")]
    assert wire.same_host(claimed, Multiaddr("/ip4/127.0.0.7/tcp/51000")) == [claimed[0], claimed[2]]
    assert wire.same_host(claimed, Multiaddr("/ip6/::1/tcp/51000")) == [claimed[3]]
    assert wire.same_host(claimed, Multiaddr("/ip4/127.0.0.9/tcp/51000")) == []
    # the first IP counts: a circuit's is its relay's (the DHT passes no observed address for a relayed
    # connection, and takes no relayed claims: serving's checks); an IP past the circuit is not the host's
    assert wire.same_host(claimed, Multiaddr(f"{RELAY}/p2p-circuit")) == []
    assert wire.same_host([addr(1, "127.0.0.3")], Multiaddr(f"{RELAY}/p2p-circuit")) == [addr(1, "127.0.0.3")]
    assert wire.same_host(claimed, Multiaddr("/p2p-circuit/ip4/127.0.0.7/tcp/1")) == []
    assert wire.same_host([Multiaddr("/p2p-circuit/ip4/127.0.0.7/tcp/1")], Multiaddr("/p2p-circuit")) == []
    # an address with no IP at all (a DNS name) is never on the observed host
    assert wire.same_host([Multiaddr("/dns4/example.com/tcp/4001")], addr(1)) == []
    assert wire.same_host([Multiaddr("/dns4/example.com/tcp/4001")], Multiaddr("/dns4/example.com/tcp/1")) == []
