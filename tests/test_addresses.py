import pytest
from multiaddr import Multiaddr

from p2p import AddressError, ConfigError, NodeConfig
from p2p.addresses import parse_multiaddr, parse_peer_addr, peer_id_of, rank_for_dial, without_peer_id

PID = "12D3KooWAo3ri4EzVWfJYX8eEzWhSWFS2AVgeDMWHwctyh9NBviu"
RELAY = "12D3KooWSyYkWiHaigVYnh5V9euFA7LuYUQfHZu3max1DQwxvN1e"


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "empty"),
        ("127.0.0.1:4001", "must start with '/'"),
        ("/ip4/999.1.1.1/tcp/1", "not IPv4"),
        ("/ip4/1.2.3.4/tcp/99999", "range"),
        ("/garbage/1", "unknown protocol"),
        (f"/ip4/1.2.3.4/tcp/1/p2p/notapeer", "CID"),
    ],
)
def test_malformed_multiaddrs_get_clear_errors(text, reason):
    with pytest.raises(AddressError, match=reason):
        parse_multiaddr(text)


def test_peer_address_needs_peer_id():
    with pytest.raises(AddressError, match="no /p2p/"):
        parse_peer_addr("/ip4/1.2.3.4/tcp/4001")
    addr, pid = parse_peer_addr(f"/ip4/1.2.3.4/tcp/4001/p2p/{PID}")
    assert str(pid) == PID
    assert str(without_peer_id(addr)) == "/ip4/1.2.3.4/tcp/4001"


def test_circuit_address_names_the_target_not_the_relay():
    addr = Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PID}")
    assert str(peer_id_of(addr)) == PID


def test_a_peer_id_written_as_a_cid_is_the_same_peer():
    """``/p2p/bafz...`` (a CIDv1, as newer libp2p peers print ids) holds the CID's bytes, not the peer
    id's: read from the bytes alone it is no peer id, so it is read as py-multiaddr renders it."""
    import cid
    from libp2p.peer.id import ID

    v1 = cid.make_cid(1, "libp2p-key", ID.from_base58(PID).to_bytes()).encode("base32").decode()
    assert str(peer_id_of(Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{v1}"))) == PID
    assert without_peer_id(Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{v1}")) == Multiaddr("/ip4/1.2.3.4/tcp/1")


def test_ranking_direct_before_relayed_public_before_private():
    addrs = [
        Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PID}"),
        Multiaddr("/ip4/127.0.0.1/tcp/5"),
        Multiaddr("/ip4/192.168.1.10/tcp/5"),
        Multiaddr("/ip6/2606:4700::1111/tcp/5"),
        Multiaddr("/ip4/8.8.4.4/tcp/5"),
        Multiaddr("/ip4/10.0.0.1/tcp/5"),
    ]
    ranked = [str(a) for a in rank_for_dial(addrs)]
    assert ranked[0] == "/ip4/8.8.4.4/tcp/5"  # public IPv4 first
    assert ranked[1] == "/ip6/2606:4700::1111/tcp/5"
    assert set(ranked[2:4]) == {"/ip4/192.168.1.10/tcp/5", "/ip4/10.0.0.1/tcp/5"}
    assert ranked[4] == "/ip4/127.0.0.1/tcp/5"
    assert "p2p-circuit" in ranked[5]
    assert len(rank_for_dial(addrs + addrs)) == len(addrs)  # duplicates collapse
    # a listen socket's "every address" is no address to dial: a connect to it reaches our own host
    assert rank_for_dial(addrs + [Multiaddr("/ip6/::/tcp/5"), Multiaddr("/ip4/0.0.0.0/tcp/5")]) == rank_for_dial(addrs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"listen": ["/ip4/1.2.3.4/udp/5"]}, "not supported"),
        ({"listen": [], "announce": ["/ip4/1.2.3.4/tcp/5"]}, "no listen address"),
        ({"initial_peers": ["/ip4/1.2.3.4/tcp/5"]}, "no /p2p/"),
        ({"initial_peers": ["nonsense"]}, "not a multiaddr"),
        ({"dial_timeout": 0}, "positive"),
        ({"max_message_size": 10}, "at least"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        NodeConfig(**kwargs).validate()


def test_an_ip6zone_address_from_a_peer_is_dropped_not_misread():
    """py-multiaddr reads /ip6zone/'s value as empty, so the zone's bytes parse as more parts (here a
    public IPv4 that would rank a link-local address first): such an address from a peer is dropped."""
    from p2p.addresses import Scope, scope_of
    from p2p.untrusted import decode_addr, decode_addrs

    zoned = Multiaddr("/ip6zone/eth0/ip6/fe80::1/tcp/4001").to_bytes()
    misread = Multiaddr(zoned)
    assert [p.name for p in misread.protocols()][:2] == ["ip6zone", "ip4"]  # the library's misreading
    assert scope_of(misread) is Scope.PUBLIC  # what it would have made of a link-local address
    assert decode_addr(zoned) is None
    plain = Multiaddr("/ip6/fe80::1/tcp/4001")
    assert decode_addrs([zoned, plain.to_bytes()], limit=4) == [plain]
