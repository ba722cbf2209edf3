"""p2p/untrusted.py: addresses and peer ids from peers, parsed by one rule each: garbage is dropped
(None), never raised, and only a field the protocol requires makes it a protocol error."""

from __future__ import annotations

import pytest
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.errors import RemoteProtocolError
from p2p.untrusted import MAX_ADDR, MAX_PEER_ID, decode_addr, decode_addrs, decode_peer_id, require_peer_id

PEER = "12D3KooWRABMz33n23DbW4GBNCMZ3kGzVoEFw9TKLfr18WViEiiK"
PLAIN = Multiaddr("/ip4/81.2.69.1/tcp/4001")
CIRCUIT = Multiaddr(f"/ip4/81.2.69.2/tcp/4001/p2p/{PEER}/p2p-circuit")


def of_size(size: int) -> bytes:
    """A valid binary multiaddr of exactly ``size`` bytes (ip4/tcp pairs of 8, an ip4 of 5, ws and tls of 2)."""
    parts, left = [], size
    while left >= 8 and left != 9:
        parts.append("/ip4/81.2.69.3/tcp/1")
        left -= 8
    tail = {0: "", 2: "/ws", 4: "/ws/tls", 5: "/ip4/81.2.69.4", 7: "/ip4/81.2.69.4/ws", 9: "/ip4/81.2.69.4/ws/tls"}
    raw = Multiaddr("".join(parts) + tail[left]).to_bytes()
    assert len(raw) == size
    return raw


def test_an_address_is_decoded_and_garbage_is_none() -> None:
    assert decode_addr(PLAIN.to_bytes()) == PLAIN
    assert decode_addr(CIRCUIT.to_bytes()) == CIRCUIT
    assert decode_addr(b"") is None
    assert decode_addr(b"\xff\xff\xff") is None  # an unknown protocol code
    assert decode_addr(PLAIN.to_bytes()[:-1]) is None  # cut inside the port


def test_an_address_of_the_largest_size_is_taken_and_one_byte_more_is_not() -> None:
    assert MAX_ADDR == 512
    assert decode_addr(of_size(MAX_ADDR)) is not None
    assert decode_addr(of_size(MAX_ADDR + 1)) is None


def test_an_interface_zone_is_refused_wherever_it_is() -> None:
    """py-multiaddr 0.2.0 reads /ip6zone/'s value back as empty: the zone's bytes would parse as more parts."""
    zoned = Multiaddr("/ip6zone/eth0/ip6/fe80::1/tcp/1").to_bytes()
    assert decode_addr(zoned) is None
    assert decode_addr(PLAIN.to_bytes() + Multiaddr("/ip6zone/x/ip6/fe80::1").to_bytes()) is None


def test_decode_addrs_keeps_the_valid_ones_in_order_once_each() -> None:
    other = Multiaddr("/ip4/81.2.69.5/udp/4001/quic-v1")
    raw = [PLAIN.to_bytes(), b"garbage", CIRCUIT.to_bytes(), PLAIN.to_bytes(), bytearray(other.to_bytes())]
    assert decode_addrs(raw, limit=10) == [PLAIN, CIRCUIT, other]
    assert decode_addrs(raw, limit=10, direct_only=True) == [PLAIN, other]


def test_decode_addrs_reads_no_more_than_its_limit_counting_the_garbage() -> None:
    raw = [b"garbage", PLAIN.to_bytes(), CIRCUIT.to_bytes()]
    assert decode_addrs(raw, limit=2) == [PLAIN]
    assert decode_addrs(raw, limit=1) == []
    assert decode_addrs(raw, limit=0) == []
    assert decode_addrs(raw, limit=3) == [PLAIN, CIRCUIT]

    def endless():  # a generator: nothing past the limit is even taken from it
        while True:
            yield PLAIN.to_bytes()

    assert decode_addrs(endless(), limit=5) == [PLAIN]


def test_a_peer_id_is_decoded_and_garbage_is_none() -> None:
    peer = ID.from_base58(PEER)
    assert decode_peer_id(peer.to_bytes()) == peer
    assert decode_peer_id(b"") is None
    assert decode_peer_id(b"\x12\x20" + b"x" * 31) is None  # a sha2-256 multihash one byte short
    assert decode_peer_id(bytes([0, MAX_PEER_ID - 2]) + b"k" * (MAX_PEER_ID - 2)) is not None
    assert decode_peer_id(bytes([0, MAX_PEER_ID - 1]) + b"k" * (MAX_PEER_ID - 1)) is None  # 65 bytes


def test_a_required_peer_id_that_is_garbage_is_the_peers_protocol_fault() -> None:
    peer = ID.from_base58(PEER)
    assert require_peer_id(bytearray(peer.to_bytes()), "STOP peer") == peer
    with pytest.raises(RemoteProtocolError, match="^CONNECT peer is not a valid peer id$"):
        require_peer_id(b"\x00", "CONNECT peer")
