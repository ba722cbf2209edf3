"""The resource manager's pure decisions (p2p/resources.py): limits, refusals and their counts, memory
budgets, rates, with no socket (tests/test_resources.py holds each limit on loopback). These are the
tests ``make mutate`` runs against the module."""

from __future__ import annotations

import pytest

from p2p.admission import AdmissionConfig
from p2p.errors import ConfigError
from p2p.resources import Rate, ResourceConfig, ResourceLimitExceeded, ResourceManager, Scope


def test_streams_are_capped_per_peer_per_protocol_and_in_all_and_given_back() -> None:
    rm = ResourceManager(ResourceConfig(max_inbound_streams=6, max_inbound_streams_per_peer=3,
                                        max_inbound_streams_per_protocol=4, max_inbound_streams_per_peer_protocol=2))
    a = [rm.open_stream("A", "/x"), rm.open_stream("A", "/x")]
    with pytest.raises(ResourceLimitExceeded, match="over the limit of 2 inbound streams per peer for /x") as e:
        rm.open_stream("A", "/x")
    assert e.value.scope is Scope.PEER_PROTOCOL
    a.append(rm.open_stream("A", "/y"))
    with pytest.raises(ResourceLimitExceeded, match="3 inbound streams per peer"):
        rm.open_stream("A", "/z")
    b = [rm.open_stream("B", "/x"), rm.open_stream("B", "/x")]
    with pytest.raises(ResourceLimitExceeded, match="4 inbound streams for /x"):
        rm.open_stream("C", "/x")
    rm.open_stream("C", "/y")
    with pytest.raises(ResourceLimitExceeded, match="6 inbound streams in all"):
        rm.open_stream("C", "/y")
    assert rm.refused == {"peer_protocol.inbound_streams": 1, "peer.inbound_streams": 1,
                          "protocol.inbound_streams": 1, "system.inbound_streams": 1}
    for grant in a + b:
        rm.close_stream(grant)
        rm.close_stream(grant)  # twice is once
    assert rm.usage()["inbound_streams"] == 1 and rm.open_stream("C", "/x").open


def test_connections_per_peer() -> None:
    rm = ResourceManager(ResourceConfig(max_connections_per_peer=2))
    rm.open_connection("A")
    rm.open_connection("A")
    with pytest.raises(ResourceLimitExceeded, match="2 connections per peer"):
        rm.open_connection("A")
    rm.open_connection("B")
    rm.close_connection("A")
    rm.open_connection("A")
    assert rm.usage()["peers_connected_in"] == 2


def test_memory_is_granted_up_to_the_peer_and_system_budgets() -> None:
    rm = ResourceManager(ResourceConfig(max_memory=1000, max_memory_per_peer=600))
    a, a2, b = rm.memory_account("A"), rm.memory_account("A"), rm.memory_account("B")
    assert a.reserve(400) == 400
    assert a2.reserve(400) == 200  # the peer's 600 in all, over two connections
    assert b.reserve(600) == 400  # the system's 1000
    assert b.reserve(1) == 0
    assert rm.refused["peer.bytes_in_flight"] == 1 and rm.refused["system.bytes_in_flight"] == 2
    a.close()
    assert rm.usage()["memory_bytes"] == 600 and b.reserve(500) == 200  # now the peer's own 600
    a2.release(10_000)  # never more than it holds
    b.close()
    assert rm.usage()["memory_bytes"] == 0 and rm.usage()["busiest_peer_memory_bytes"] == 0


def test_rates_are_token_buckets_per_service_and_peer() -> None:
    rm = ResourceManager(ResourceConfig(rates={"dht": Rate(10.0, 3)}, max_tracked_peers=2))
    for _ in range(3):
        rm.allow("dht", "A", now=100.0)
    with pytest.raises(ResourceLimitExceeded, match="10 dht requests a second per peer"):
        rm.allow("dht", "A", now=100.0)
    for _ in range(3):
        rm.allow("dht", "B", now=100.0)  # another peer has its own bucket (emptied: not full again by 100.2)
    rm.allow("dht", "A", now=100.1)  # 0.1 s refills one
    with pytest.raises(ResourceLimitExceeded):
        rm.allow("dht", "A", now=100.1)
    rm.allow("identify", "A", now=100.1)  # a service without a rate is not limited
    rm.allow("dht", "C", now=100.2)  # a third peer: the least recently used bucket goes
    assert len(rm._buckets) == 2 and rm.refused["service.dht_requests_a_second_per_peer"] == 2


def test_a_bucket_refilled_to_its_burst_is_forgotten_and_one_still_refilling_is_kept() -> None:
    """A full bucket is what a fresh one would be: forgetting it changes no verdict, and the map then
    holds the peers of the last refill time, not every peer ever seen (a relay's visitors left three
    buckets each, up to max_tracked_peers: 65,536)."""
    rm = ResourceManager(ResourceConfig(rates={"dht": Rate(10.0, 3)}))
    for _ in range(3):
        rm.allow("dht", "A", now=100.0)  # A spent its burst
    rm.allow("dht", "B", now=100.1)  # a newcomer: A, one token back of three, is kept
    rm.allow("dht", "A", now=100.1)
    with pytest.raises(ResourceLimitExceeded):
        rm.allow("dht", "A", now=100.1)  # still limited: its bucket was not forgotten
    for i in range(1000):  # visitors a second apart, each full again before the next comes
        rm.allow("dht", f"visitor {i}", now=200.0 + i)
    assert len(rm._buckets) <= 2


def test_limits_and_usage_name_everything_and_bad_configs_are_refused() -> None:
    rm = ResourceManager()
    rm.register_service("relay", lambda: {"reservations": 3})
    limits, usage = rm.limits(), rm.usage()
    for key in ("handshaking_per_address", "connections_per_peer", "inbound_streams_per_peer_protocol",
                "memory_bytes_per_peer", "rate.dht_per_s", "rate.relay.reserve_burst", "rate.autonat.dial_back_per_s"):
        assert key in limits, key
    assert usage["relay.reservations"] == 3 and "admission.refused.handshaking_per_address" in usage
    assert limits["memory_bytes"] >= 128 << 20
    with pytest.raises(ConfigError):
        ResourceConfig(max_inbound_streams=-1).validate()
    with pytest.raises(ConfigError):
        ResourceConfig(rates={"dht": Rate(0, 1)}).validate()


def test_limits_report_every_cap_by_its_name_and_refusals_are_counted_by_theirs() -> None:
    admission = AdmissionConfig(max_handshaking=11, max_handshaking_per_address=12, max_handshaking_per_subnet=13,
                                handshake_timeout=14.0, max_connections=15, max_connections_per_address=16,
                                max_connections_per_subnet=17)
    rm = ResourceManager(ResourceConfig(admission=admission, max_connections_per_peer=21, max_inbound_streams=22,
                                        max_inbound_streams_per_peer=23, max_inbound_streams_per_protocol=24,
                                        max_inbound_streams_per_peer_protocol=25, max_memory=1 << 20,
                                        max_memory_per_peer=1 << 19, rates={"dht": Rate(5.0, 7)}))
    assert rm.limits() == {
        "handshaking": 11, "handshaking_per_address": 12, "handshaking_per_subnet": 13, "handshake_timeout_s": 14.0,
        "inbound_connections": 15, "inbound_connections_per_address": 16, "inbound_connections_per_subnet": 17,
        "connections_per_peer": 21, "inbound_streams": 22, "inbound_streams_per_peer": 23,
        "inbound_streams_per_protocol": 24, "inbound_streams_per_peer_protocol": 25,
        "memory_bytes": 1 << 20, "memory_bytes_per_peer": 1 << 19, "rate.dht_per_s": 5.0, "rate.dht_burst": 7}
    rm.count_refusal("relay", "reservations per address")
    rm.count_refusal("relay", "reservations per address")
    assert rm.refusal_counts()["service.relay.reservations_per_address"] == 2
    # a service's usage is shown until its undo; an undo of a replaced registration leaves the new one
    undo_old = rm.register_service("relay", lambda: {"reservations": 1})
    rm.register_service("relay", lambda: {"reservations": 2})
    undo_old.remove()
    assert rm.usage()["relay.reservations"] == 2
    undo_new = rm.register_service("relay", lambda: {"reservations": 3})
    undo_new.remove()
    assert "relay.reservations" not in rm.usage()


def test_memory_refusals_name_the_budget_that_was_short() -> None:
    rm = ResourceManager(ResourceConfig(max_memory=1000, max_memory_per_peer=600))
    a, b = rm.memory_account("A"), rm.memory_account("B")
    assert a.reserve(600) == 600  # exactly the peer's budget: nothing refused
    assert rm.refused == {}
    assert b.reserve(400) == 400  # exactly the system's: nothing refused
    assert rm.refused == {}
    assert a.reserve(1) == 0
    assert rm.refused == {"system.bytes_in_flight": 1}
    a.close()
    assert b.reserve(201) == 200  # the peer's 600, with the system's room to spare
    assert rm.refused == {"system.bytes_in_flight": 1, "peer.bytes_in_flight": 1}
    edge = ResourceManager(ResourceConfig(max_memory=1000, max_memory_per_peer=500))
    assert edge.memory_account("B").reserve(400) == 400
    assert edge.memory_account("A").reserve(600) == 500  # the system's budget exactly reached: the peer's was short
    assert edge.refused == {"peer.bytes_in_flight": 1}


def test_the_default_rates_and_memory_budget_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2p.resources import default_max_memory, default_rates

    assert default_rates() == {
        "streams": Rate(200.0, 500), "dht": Rate(200.0, 400), "rpc": Rate(500.0, 1000), "identify": Rate(2.0, 8),
        "autonat": Rate(0.2, 4), "autonat.address": Rate(1.0, 16), "autonat.dial_back": Rate(0.2, 4),
        "dcutr": Rate(1.0, 4), "relay.reserve": Rate(0.5, 4), "relay.connect": Rate(10.0, 32),
        "auth.issue": Rate(0.2, 4)}
    sizes = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 4 << 20}  # 16 GiB: an eighth is 2 GiB
    monkeypatch.setattr("os.sysconf", lambda name: sizes[name])
    assert default_max_memory() == 2 << 30
    sizes["SC_PHYS_PAGES"] = 1 << 16  # 256 MiB: an eighth is under the floor of 128 MiB
    assert default_max_memory() == 128 << 20

    def unknown(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr("os.sysconf", unknown)
    assert default_max_memory() == 1 << 30  # 8 GiB assumed


def test_every_setting_is_checked_by_name() -> None:
    ResourceConfig(max_tracked_peers=1, alarm_interval=60.0, rates={"x": Rate(0.1, 1)}, max_inbound_streams=0).validate()
    for name in ("max_connections_per_peer", "max_inbound_streams", "max_inbound_streams_per_peer",
                 "max_inbound_streams_per_protocol", "max_inbound_streams_per_peer_protocol", "max_memory",
                 "max_memory_per_peer"):
        with pytest.raises(ConfigError, match=f"^resources {name} must be >= 0, got -1$"):
            ResourceConfig(**{name: -1}).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^resources max_tracked_peers must be at least 1$"):
        ResourceConfig(max_tracked_peers=0).validate()
    for bad in (0.0, 60.5):
        with pytest.raises(ConfigError, match=rf"^resources alarm_interval must be in \(0, 60\] seconds, got {bad}$"):
            ResourceConfig(alarm_interval=bad).validate()
    for rate in (Rate(0.0, 1), Rate(1.0, 0)):
        with pytest.raises(ConfigError, match=rf"^rate dht needs per_second > 0 and burst >= 1, got "):
            ResourceConfig(rates={"dht": rate}).validate()
    with pytest.raises(ConfigError, match="^admission backlog must be at least 1$"):
        ResourceConfig(admission=AdmissionConfig(backlog=0)).validate()


def test_limits_hit_between_two_counts_and_the_muxers_stream_rate() -> None:
    from p2p.resources import limits_hit

    assert limits_hit({"a": 1, "b": 2}, {"a": 3, "b": 2, "c": 1}) == [("a", 2), ("c", 1)]
    assert limits_hit({}, {}) == []
    rm = ResourceManager(ResourceConfig(rates={"streams": Rate(1.0, 1)}))
    assert rm.stream_open_refusal("A", 10.0) is None
    assert rm.stream_open_refusal("A", 10.0) == "over the limit of 1 streams requests a second per peer"
    assert rm.stream_open_refusal("B", 10.0) is None  # another peer's bucket
    assert rm.stream_open_refusal("A", 11.0) is None  # a second later: refilled


def test_closing_gives_back_exactly_what_was_held() -> None:
    rm = ResourceManager(ResourceConfig(max_memory=1000, max_memory_per_peer=1000))
    rm.open_connection("A")
    rm.open_connection("A")
    rm.close_connection("A")
    assert rm.usage()["peers_connected_in"] == 1
    rm.close_connection("A")
    assert rm.usage()["peers_connected_in"] == 0 and rm._connections == {}
    grants = [rm.open_stream("A", "/x"), rm.open_stream("A", "/x"), rm.open_stream("B", "/x")]
    assert rm.usage()["busiest_peer_streams"] == 2
    rm.close_stream(grants[0])
    assert rm._streams == {"A": 1, "B": 1} and rm._peer_protocol_streams == {("A", "/x"): 1, ("B", "/x"): 1}
    for g in grants[1:]:
        rm.close_stream(g)
    assert rm._streams == {} and rm._protocol_streams == {} and rm.usage()["busiest_peer_streams"] == 0
    account = rm.memory_account("A")
    assert account.reserve(300) == 300
    account.release(1)
    assert account.held == 299 and rm.memory == 299 and rm._memory == {"A": 299}
    account.release(0)
    account.release(-5)  # nothing: never a negative release
    assert account.held == 299 and rm.memory == 299
    assert account.reserve(1) == 1 and account.held == 300
    account.close()
    assert account.held == 0 and rm.memory == 0 and rm._memory == {}
    usage = ResourceManager().usage()
    assert {k: usage[k] for k in ("peers_connected_in", "inbound_streams", "memory_bytes", "busiest_peer_streams",
                                  "busiest_peer_memory_bytes")} == dict.fromkeys(
        ("peers_connected_in", "inbound_streams", "memory_bytes", "busiest_peer_streams", "busiest_peer_memory_bytes"), 0)
    error = ResourceLimitExceeded(Scope.SERVICE, "relay requests", 2.5, what="")
    assert str(error) == "over the limit of 2.5 relay requests" and error.reason == "service.relay_requests"
    assert str(ResourceLimitExceeded(Scope.PROTOCOL, "inbound streams", 3, what="/p")) == \
        "over the limit of 3 inbound streams for /p"
