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


@pytest.mark.parametrize(
    "text, message",
    [
        ("  ", "empty address: expected a multiaddr like /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo..."),
        ("127.0.0.1:4001", "address '127.0.0.1:4001' is not a multiaddr: it must start with '/', "
                           "e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo..."),
        ("/ip4/999.1.1.1/tcp/1", "address '/ip4/999.1.1.1/tcp/1' is malformed: base address '999.1.1.1' is not IPv4"),
        ("/ip4/1.2.3.4/tcp", "address '/ip4/1.2.3.4/tcp' is malformed: missing value for protocol: tcp"),
        # the input may hold the library's own separators: the reason is cut by the input, not by them
        ("/ip4/1': 2/tcp/1", 'address "/ip4/1\': 2/tcp/1" is malformed: base address "1\': 2" is not IPv4'),
        (" /garbage/1 (string: x) ", "address '/garbage/1 (string: x)' is malformed: unknown protocol: garbage"),
    ],
)
def test_an_address_error_says_what_is_wrong_once_and_whole(text, message):
    with pytest.raises(AddressError) as caught:
        parse_multiaddr(text)
    assert str(caught.value) == message


def test_a_peer_address_error_names_what_was_asked_for():
    with pytest.raises(AddressError) as caught:
        parse_peer_addr("")
    assert str(caught.value) == "empty peer address: expected a multiaddr like /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo..."
    with pytest.raises(AddressError) as caught:
        parse_peer_addr("/ip4/1.2.3.4/tcp/4001", what="initial peer")
    assert str(caught.value) == (
        "initial peer /ip4/1.2.3.4/tcp/4001 has no /p2p/<peer-id> part; without it the peer cannot be "
        "authenticated. Ask its operator for the full address (`dedloc id` prints it).")
    # a CID that is no peer's key (a dag-pb content id)
    content = Multiaddr("/p2p/bafybeigdyrzt5sfp7udm7hu76uh7y26nf3efuylqabf3oclgtqy55fbzdi")
    with pytest.raises(AddressError, match=r"^address a5032401701220c3\w+ has an invalid peer id '01701220c3\w+'$"):
        peer_id_of(content)


def test_peer_address_needs_peer_id():
    with pytest.raises(AddressError, match="no /p2p/"):
        parse_peer_addr("/ip4/1.2.3.4/tcp/4001")
    addr, pid = parse_peer_addr(f"/ip4/1.2.3.4/tcp/4001/p2p/{PID}")
    assert str(pid) == PID
    assert str(without_peer_id(addr)) == "/ip4/1.2.3.4/tcp/4001"


def test_circuit_address_names_the_target_not_the_relay():
    addr = Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PID}")
    assert str(peer_id_of(addr)) == PID


def test_the_peers_of_addresses_each_once_in_order_those_without_an_id_left_out():
    from p2p.addresses import peer_ids_of

    addrs = [f"/ip4/1.2.3.4/tcp/1/p2p/{PID}", "/ip4/1.2.3.4/tcp/2", f"/ip4/5.6.7.8/tcp/1/p2p/{RELAY}",
             Multiaddr(f"/ip4/9.9.9.9/tcp/1/p2p/{PID}")]
    assert [str(p) for p in peer_ids_of(addrs)] == [PID, RELAY]
    assert peer_ids_of([]) == ()
    with pytest.raises(AddressError, match="^initial peer "):
        peer_ids_of(["/ip4/1.2.3.4/tcp/x"], what="initial peer")
    with pytest.raises(AddressError, match="^address "):
        peer_ids_of(["/ip4/1.2.3.4/tcp/x"])


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


def test_scopes_of_every_kind_of_first_part():
    from p2p.addresses import Scope, scope_of

    expect = {
        "/ip4/8.8.8.8/tcp/1": Scope.PUBLIC, "/ip6/2001:4860::8888/tcp/1": Scope.PUBLIC,
        "/dns/example.org/tcp/1": Scope.PUBLIC, "/dns4/example.org/tcp/1": Scope.PUBLIC,
        "/dns6/example.org/tcp/1": Scope.PUBLIC, "/dnsaddr/example.org": Scope.PUBLIC,
        "/ip4/10.1.2.3/tcp/1": Scope.PRIVATE, "/ip4/100.64.0.1/tcp/1": Scope.PRIVATE,  # CGNAT
        "/ip4/169.254.1.1/tcp/1": Scope.PRIVATE, "/ip6/fe80::1/tcp/1": Scope.PRIVATE,
        "/ip4/0.0.0.0/tcp/1": Scope.PRIVATE, "/ip6/::/tcp/1": Scope.PRIVATE,
        "/ip4/127.0.0.1/tcp/1": Scope.LOOPBACK, "/ip6/::1/tcp/1": Scope.LOOPBACK,
        "/dns4/localhost/tcp/1": Scope.LOOPBACK, "/dns/localhost/tcp/1": Scope.LOOPBACK,
        f"/p2p/{PID}": Scope.UNKNOWN,
    }
    assert {a: scope_of(Multiaddr(a)) for a in expect} == expect


def test_the_ip_tcp_and_family_helpers_read_only_what_is_there():
    from p2p.addresses import ip_and_tcp_port, ip_family, reachable_tcp, tcp_port

    assert ip_and_tcp_port(Multiaddr("/ip6/::1/tcp/4001")) == ("::1", 4001)
    assert ip_and_tcp_port(Multiaddr("/ip4/1.2.3.4/tcp/80/p2p/" + PID)) == ("1.2.3.4", 80)
    for other in ("/ip4/1.2.3.4", "/ip4/1.2.3.4/udp/1", "/dns4/example.org/tcp/1", f"/p2p/{PID}"):
        assert ip_and_tcp_port(Multiaddr(other)) is None and tcp_port(Multiaddr(other)) is None
    assert tcp_port(Multiaddr("/ip4/1.2.3.4/tcp/9")) == 9
    assert [ip_family(Multiaddr(a)) for a in ("/ip4/1.2.3.4/tcp/1", "/ip6/::1", "/dns4/example.org/tcp/1")] == [
        "ip4", "ip6", None]
    assert ip_family(Multiaddr(b"")) is None
    assert reachable_tcp(Multiaddr("/ip4/8.8.8.8/tcp/1")) and reachable_tcp(Multiaddr("/ip6/2001:4860::8888/tcp/1"))
    for never in ("/ip4/8.8.8.8/udp/1", "/ip4/8.8.8.8", "/dns4/example.org/tcp/1",
                  f"/ip4/8.8.8.8/tcp/1/p2p/{RELAY}/p2p-circuit"):
        assert not reachable_tcp(Multiaddr(never), allow_private=True)
    assert not reachable_tcp(Multiaddr("/ip4/10.0.0.1/tcp/1"))
    assert reachable_tcp(Multiaddr("/ip4/10.0.0.1/tcp/1"), allow_private=True)


def test_a_circuit_address_splits_into_its_relay_or_says_why_not():
    from libp2p.peer.id import ID

    from p2p.addresses import split_circuit

    over_ws = Multiaddr(f"/ip4/1.2.3.4/tcp/443/ws/p2p/{RELAY}/p2p-circuit/p2p/{PID}")
    assert split_circuit(over_ws) == (Multiaddr(f"/ip4/1.2.3.4/tcp/443/ws/p2p/{RELAY}"), ID.from_base58(RELAY))
    with pytest.raises(AddressError) as caught:
        split_circuit(Multiaddr("/ip4/1.2.3.4/tcp/1"))
    assert str(caught.value) == "/ip4/1.2.3.4/tcp/1 is not a relayed (/p2p-circuit) address"
    for nameless in ("/ip4/1.2.3.4/tcp/1/p2p-circuit", f"/p2p-circuit/p2p/{PID}"):
        with pytest.raises(AddressError) as caught:
            split_circuit(Multiaddr(nameless))
        assert str(caught.value) == (f"relayed address {nameless} does not name its relay "
                                     "(/p2p/<relay> before /p2p-circuit)")


class _Conn:
    """What ``is_relayed_conn`` reads of a connection: its transport addresses, or a failure to say."""

    def __init__(self, *addrs: str, broken: bool = False) -> None:
        self.addrs, self.broken = [Multiaddr(a) for a in addrs], broken

    def get_transport_addresses(self) -> list[Multiaddr]:
        if self.broken:
            raise RuntimeError("closed")
        return self.addrs


def test_a_connection_is_relayed_when_a_transport_address_is_a_circuit():
    from p2p.addresses import is_relayed_conn

    assert is_relayed_conn(_Conn("/ip4/1.2.3.4/tcp/1", f"/p2p/{RELAY}/p2p-circuit"))  # type: ignore[arg-type]
    assert not is_relayed_conn(_Conn("/ip4/1.2.3.4/tcp/1"))  # type: ignore[arg-type]
    assert not is_relayed_conn(_Conn(f"/p2p/{RELAY}/p2p-circuit", broken=True))  # type: ignore[arg-type]
