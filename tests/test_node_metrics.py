"""p2p/metrics.py: the Node's and the DHT's families, scraped from stand-ins whose counts all differ,
so that each name, help text, label and value is checked to the byte against what it was fed;
go-libp2p's labels of a connection, a limit and a refusal; a connection's counters and lifetime,
a dial's handshake latency and a DHT query, each as it happens; and ``install`` undone whole (the
same families from a real 3-node swarm: tests/test_metrics.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from multiaddr import Multiaddr
from prometheus_client import CollectorRegistry, generate_latest

from p2p import metrics
from p2p.events import Event, PeerConnected, Ping
from p2p.hooks import ConnectionInfo, Direction, Observers, PathKind
from p2p.metrics import (DHTMetrics, NodeMetrics, _NodeCollector, blocked_labels, connection_labels, limit_labels,
                         resource_families)

from .kit import numbered_peer_id


def scrape(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def resources() -> SimpleNamespace:
    usage = {"admission.inbound": 3, "admission.handshaking": 4, "inbound_streams": 5, "streams./dht/1": 6,
             "streams./avg/1": 7, "memory_bytes": 8, "busiest_peer_memory_bytes": 9}
    return SimpleNamespace(
        usage=lambda: usage, refusal_counts=lambda: {"peer.inbound_streams": 10, "admission.handshaking_total": 11},
        limits=lambda: {"memory_bytes": 12, "inbound_streams_per_peer": 13, "rate.dht_per_s": 14})


def node(**changes: Any) -> SimpleNamespace:
    stand_in = SimpleNamespace(
        resources=resources(), dial_errors={("tcp", "deadline", "ip4"): 15, ("circuit", "other", "ip6"): 16},
        dials_backed_off=17, peers_by_path=lambda: {"direct": 18, "relayed": 19}, trimmed=20,
        conn_tags=SimpleNamespace(protected_count=lambda: 21),
        peer_store_metrics=lambda: {"known": 22, "forgotten": 23})
    for name, value in changes.items():
        setattr(stand_in, name, value)
    return stand_in


def dht(**changes: Any) -> SimpleNamespace:
    stand_in = SimpleNamespace(
        metrics=lambda: {"routing_table": 24, "keys": 25, "cached_keys": 26, "own_records": 27, "bytes": 28},
        server=True, served={"find": 29, "store": 30})
    for name, value in changes.items():
        setattr(stand_in, name, value)
    return stand_in


# ---------------------------------------------------------------------- read at scrape time


def test_a_node_s_scrape_is_every_family_with_go_libp2p_s_names_and_the_counts_it_was_fed() -> None:
    registry = CollectorRegistry()
    registry.register(_NodeCollector(node()))  # type: ignore[arg-type]
    assert scrape(registry) == (
        "# HELP libp2p_rcmgr_connections Number of Connections\n"
        "# TYPE libp2p_rcmgr_connections gauge\n"
        'libp2p_rcmgr_connections{dir="inbound",scope="system"} 3.0\n'
        'libp2p_rcmgr_connections{dir="inbound",scope="transient"} 4.0\n'
        "# HELP libp2p_rcmgr_streams Number of Streams\n"
        "# TYPE libp2p_rcmgr_streams gauge\n"
        'libp2p_rcmgr_streams{dir="inbound",protocol="",scope="system"} 5.0\n'
        'libp2p_rcmgr_streams{dir="inbound",protocol="/dht/1",scope="protocol"} 6.0\n'
        'libp2p_rcmgr_streams{dir="inbound",protocol="/avg/1",scope="protocol"} 7.0\n'
        "# HELP libp2p_rcmgr_memory Amount of memory reserved as reported to the Resource Manager\n"
        "# TYPE libp2p_rcmgr_memory gauge\n"
        'libp2p_rcmgr_memory{protocol="",scope="system"} 8.0\n'
        'libp2p_rcmgr_memory{protocol="",scope="peer"} 9.0\n'
        "# HELP libp2p_rcmgr_blocked_resources Number of blocked resources\n"
        "# TYPE libp2p_rcmgr_blocked_resources gauge\n"
        'libp2p_rcmgr_blocked_resources{dir="inbound",resource="handshaking_total",scope="transient"} 11.0\n'
        'libp2p_rcmgr_blocked_resources{dir="inbound",resource="inbound_streams",scope="peer"} 10.0\n'
        "# HELP libp2p_rcmgr_limit Resource manager limits\n"
        "# TYPE libp2p_rcmgr_limit gauge\n"
        'libp2p_rcmgr_limit{resource="memory_bytes",scope="system"} 12.0\n'
        'libp2p_rcmgr_limit{resource="inbound_streams",scope="peer"} 13.0\n'
        'libp2p_rcmgr_limit{resource="dht_per_s",scope="service"} 14.0\n'
        "# HELP libp2p_swarm_dial_errors_total Dial Error\n"
        "# TYPE libp2p_swarm_dial_errors_total counter\n"
        'libp2p_swarm_dial_errors_total{error="other",ip_version="ip6",transport="circuit"} 16.0\n'
        'libp2p_swarm_dial_errors_total{error="deadline",ip_version="ip4",transport="tcp"} 15.0\n'
        "# HELP dedloc_swarm_dials_backed_off_total Dials not made: every address of the peer failed lately "
        "and waits out its backoff\n"
        "# TYPE dedloc_swarm_dials_backed_off_total counter\n"
        "dedloc_swarm_dials_backed_off_total 17.0\n"
        "# HELP dedloc_swarm_peers Peers with at least one open connection, by path\n"
        "# TYPE dedloc_swarm_peers gauge\n"
        'dedloc_swarm_peers{path="direct"} 18.0\n'
        'dedloc_swarm_peers{path="relayed"} 19.0\n'
        "# HELP dedloc_connmgr_trimmed_total Connections the connection manager closed (over its high water, "
        "of least use)\n"
        "# TYPE dedloc_connmgr_trimmed_total counter\n"
        "dedloc_connmgr_trimmed_total 20.0\n"
        "# HELP dedloc_connmgr_protected_peers Peers a service keeps connected (a relay slot, an averaging "
        "round)\n"
        "# TYPE dedloc_connmgr_protected_peers gauge\n"
        "dedloc_connmgr_protected_peers 21.0\n"
        "# HELP dedloc_peerstore_peers Peers the peer store holds (addresses, keys, protocols)\n"
        "# TYPE dedloc_peerstore_peers gauge\n"
        "dedloc_peerstore_peers 22.0\n"
        "# HELP dedloc_peerstore_forgotten_total Peers the peer store forgot (over its bound: without "
        "addresses, expired, least recently heard of first)\n"
        "# TYPE dedloc_peerstore_forgotten_total counter\n"
        "dedloc_peerstore_forgotten_total 23.0\n"
    )


def test_a_dht_s_scrape_is_its_table_and_store_with_the_counts_it_was_fed() -> None:
    registry = CollectorRegistry()
    registry.register(DHTMetrics(dht(), CollectorRegistry()))  # type: ignore[arg-type]
    assert scrape(registry) == (
        "# HELP dedloc_dht_server 1 while this peer serves the DHT, 0 while only a client\n"
        "# TYPE dedloc_dht_server gauge\n"
        "dedloc_dht_server 1.0\n"
        "# HELP dedloc_dht_routing_table_peers Peers in the routing table\n"
        "# TYPE dedloc_dht_routing_table_peers gauge\n"
        "dedloc_dht_routing_table_peers 24.0\n"
        "# HELP dedloc_dht_records Records stored for others, by kind\n"
        "# TYPE dedloc_dht_records gauge\n"
        'dedloc_dht_records{kind="stored"} 25.0\n'
        'dedloc_dht_records{kind="cached"} 26.0\n'
        'dedloc_dht_records{kind="own"} 27.0\n'
        "# HELP dedloc_dht_stored_bytes Bytes of records stored for others\n"
        "# TYPE dedloc_dht_stored_bytes gauge\n"
        "dedloc_dht_stored_bytes 28.0\n"
        "# HELP dedloc_dht_inbound_requests_total DHT requests served, by type\n"
        "# TYPE dedloc_dht_inbound_requests_total counter\n"
        'dedloc_dht_inbound_requests_total{type="find"} 29.0\n'
        'dedloc_dht_inbound_requests_total{type="store"} 30.0\n'
    )


def test_a_dht_client_shows_0_and_a_request_type_never_served_0() -> None:
    registry = CollectorRegistry()
    registry.register(DHTMetrics(dht(server=False, served={}), CollectorRegistry()))  # type: ignore[arg-type]
    text = scrape(registry)
    assert "\ndedloc_dht_server 0.0\n" in text
    assert 'dedloc_dht_inbound_requests_total{type="find"} 0.0\n' in text
    assert 'dedloc_dht_inbound_requests_total{type="store"} 0.0\n' in text


def test_a_resource_manager_with_nothing_in_use_shows_zeros_and_no_protocol_or_refusal() -> None:
    idle = SimpleNamespace(usage=dict, refusal_counts=dict, limits=dict)
    samples = [(s.name, s.labels, s.value) for family in resource_families(idle)  # type: ignore[arg-type]
               for s in family.samples]
    assert samples == [
        ("libp2p_rcmgr_connections", {"dir": "inbound", "scope": "system"}, 0),
        ("libp2p_rcmgr_connections", {"dir": "inbound", "scope": "transient"}, 0),
        ("libp2p_rcmgr_streams", {"dir": "inbound", "scope": "system", "protocol": ""}, 0),
        ("libp2p_rcmgr_memory", {"scope": "system", "protocol": ""}, 0),
        ("libp2p_rcmgr_memory", {"scope": "peer", "protocol": ""}, 0),
    ]


# ---------------------------------------------------------------------- go-libp2p's labels


@pytest.mark.parametrize("name, labels", [
    ("inbound_streams_per_peer_protocol", ("peer_protocol", "inbound_streams")),
    ("inbound_streams_per_protocol", ("protocol", "inbound_streams")),
    ("inbound_streams_per_peer", ("peer", "inbound_streams")),
    ("connections_per_peer", ("peer", "connections")),
    ("handshaking_per_address", ("transient", "handshaking_per_address")),
    ("connections_per_address", ("transient", "connections_per_address")),
    ("connections_per_subnet", ("transient", "connections_per_subnet")),
    ("handshaking_total", ("transient", "handshaking_total")),
    ("rate.dht_per_s", ("service", "dht_per_s")),
    ("rate.handshakes_per_peer", ("service", "handshakes_per_peer")),
    ("memory_bytes", ("system", "memory_bytes")),
])
def test_a_limit_s_scope_and_resource_follow_go_libp2p(name: str, labels: tuple[str, str]) -> None:
    assert limit_labels(name) == labels


@pytest.mark.parametrize("reason, labels", [
    ("admission.handshaking_total", ("transient", "handshaking_total")),
    ("peer.inbound_streams", ("peer", "inbound_streams")),
    ("protocol.streams.x", ("protocol", "streams.x")),
    ("memory", ("memory", "memory")),
])
def test_a_refusal_s_scope_and_resource_follow_go_libp2p(reason: str, labels: tuple[str, str]) -> None:
    assert blocked_labels(reason) == labels


def info(addr: str, direction: Direction = Direction.INBOUND, conn: object | None = None) -> ConnectionInfo:
    return ConnectionInfo(numbered_peer_id(1), Multiaddr(addr), direction, PathKind.DIRECT,
                          conn if conn is not None else object())  # type: ignore[arg-type]


def test_a_connection_s_labels_are_go_libp2p_s_with_a_relayed_one_on_circuit() -> None:
    assert connection_labels(info("/ip4/10.0.0.1/tcp/4001")) == (
        "inbound", "tcp", "/noise", "/yamux/1.0.0", "false", "ip4")
    assert connection_labels(info("/ip6/::1/tcp/1/p2p/" + str(numbered_peer_id(2)) + "/p2p-circuit",
                                  Direction.OUTBOUND)) == ("outbound", "circuit", "/noise", "/yamux/1.0.0", "false", "ip6")


# ---------------------------------------------------------------------- as it happens


def test_connections_are_counted_by_labels_and_their_lifetime_observed_once_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(metrics, "time", SimpleNamespace(monotonic=lambda: now[0]))
    registry = CollectorRegistry()
    watcher = NodeMetrics(node(), registry)  # type: ignore[arg-type]
    tcp = ("inbound", "tcp", "/noise", "/yamux/1.0.0", "false", "ip4")
    names = dict(zip(("dir", "transport", "security", "muxer", "early_muxer", "ip_version"), tcp))
    a, b = info("/ip4/10.0.0.1/tcp/1"), info("/ip4/10.0.0.2/tcp/1")
    watcher.connection_opened(a)
    now[0] = 103.0
    watcher.connection_opened(b)
    assert registry.get_sample_value("libp2p_swarm_connections_opened_total", names) == 2
    now[0] = 110.0
    watcher.connection_closed(a)  # open 10 s
    watcher.connection_closed(info("/ip4/10.0.0.3/tcp/1"))  # never seen open: counted, no lifetime
    assert registry.get_sample_value("libp2p_swarm_connections_closed_total", names) == 2
    assert registry.get_sample_value("libp2p_swarm_connection_duration_seconds_count", names) == 1
    assert registry.get_sample_value("libp2p_swarm_connection_duration_seconds_sum", names) == 10.0
    assert registry.get_sample_value("libp2p_swarm_connection_duration_seconds_bucket", {**names, "le": "5.0"}) == 0
    assert registry.get_sample_value("libp2p_swarm_connection_duration_seconds_bucket", {**names, "le": "15.0"}) == 1
    now[0] = 200.0
    watcher.connection_closed(b)  # open 97 s, and a's entry is gone: closing it again observes nothing
    watcher.connection_closed(a)
    assert registry.get_sample_value("libp2p_swarm_connection_duration_seconds_count", names) == 2
    assert registry.get_sample_value("libp2p_swarm_connection_duration_seconds_sum", names) == 107.0


def test_the_families_are_registered_under_go_libp2p_s_names_with_their_buckets() -> None:
    registry = CollectorRegistry()
    NodeMetrics(node(), registry)  # type: ignore[arg-type]
    text = scrape(registry)
    for line in ("# HELP libp2p_swarm_connections_opened_total Connections Opened",
                 "# HELP libp2p_swarm_connections_closed_total Connections Closed",
                 "# HELP libp2p_swarm_connection_duration_seconds Duration of a Connection",
                 "# HELP libp2p_swarm_handshake_latency_seconds Duration of the libp2p Handshake "
                 "(our dials: TCP connect, Noise, Yamux)"):
        assert line + "\n" in text
    assert metrics.LATENCY_BUCKETS == (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                       10.0, 30.0)
    assert metrics.DURATION_BUCKETS == (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)


def feeding(given: list[Event]) -> Callable[[], AbstractAsyncContextManager[trio.MemoryReceiveChannel[Event]]]:
    """A node's ``events``: a subscription that hands over ``given`` and ends."""
    @asynccontextmanager
    async def events() -> AsyncIterator[trio.MemoryReceiveChannel[Event]]:
        send, receive = trio.open_memory_channel[Event](len(given))
        for event in given:
            send.send_nowait(event)
        send.close()
        yield receive
    return events


def told(observers: Observers[Any]) -> list[object]:
    """Who ``observers`` tell now, in order."""
    heard: list[object] = []
    observers.notify(heard.append, "who is told")
    return heard


def test_install_observes_the_node_and_registers_the_collector_and_its_handle_undoes_both() -> None:
    registry = CollectorRegistry()
    observers: Observers[Any] = Observers("the swarm")  # the Node's own
    watcher = NodeMetrics(node(observe=observers.add), registry)  # type: ignore[arg-type]
    handle = watcher.install()
    assert told(observers) == [watcher] and "dedloc_peerstore_peers 22.0" in scrape(registry)
    handle.remove()
    assert told(observers) == [] and "dedloc_peerstore_peers" not in scrape(registry)
    handle.remove()  # once only


async def test_handshake_latencies_come_from_the_node_s_dial_events_by_transport() -> None:
    registry = CollectorRegistry()
    events = feeding([PeerConnected(numbered_peer_id(1), "/ip4/10.0.0.1/tcp/1", 0.02),
                      Ping(numbered_peer_id(1), 0.5),
                      PeerConnected(numbered_peer_id(2), "/ip6/::1/tcp/1/p2p-circuit", 1.5),
                      PeerConnected(numbered_peer_id(3), "/ip4/10.0.0.3/tcp/1", 0.003)])
    watcher = NodeMetrics(node(events=events), registry)  # type: ignore[arg-type]
    with trio.fail_after(5):
        await watcher.follow_events()  # ends with the events
    tcp = {"transport": "tcp", "security": "/noise", "muxer": "/yamux/1.0.0", "early_muxer": "false",
           "ip_version": "ip4"}
    relayed = {**tcp, "transport": "circuit", "ip_version": "ip6"}
    value: Callable[[str, dict[str, str]], float | None] = registry.get_sample_value
    assert value("libp2p_swarm_handshake_latency_seconds_count", tcp) == 2
    assert value("libp2p_swarm_handshake_latency_seconds_sum", tcp) == pytest.approx(0.023)
    assert value("libp2p_swarm_handshake_latency_seconds_bucket", {**tcp, "le": "0.0025"}) == 0
    assert value("libp2p_swarm_handshake_latency_seconds_bucket", {**tcp, "le": "0.005"}) == 1
    assert value("libp2p_swarm_handshake_latency_seconds_count", relayed) == 1
    assert value("libp2p_swarm_handshake_latency_seconds_sum", relayed) == 1.5


def test_each_dht_query_is_timed_and_counted_by_type_and_outcome_while_installed() -> None:
    registry = CollectorRegistry()
    queries: Observers[Callable[[str, float, str], None]] = Observers("DHT queries")  # the DHT's own
    watcher = DHTMetrics(dht(observe_queries=queries.add), registry)  # type: ignore[arg-type]
    handle = watcher.install()
    assert len(queries) == 1 and "dedloc_dht_routing_table_peers 24.0" in scrape(registry)
    for kind, seconds, outcome in (("get", 0.2, "ok"), ("get", 0.03, "not_found"), ("store", 2.0, "ok")):
        queries.notify(lambda observer: observer(kind, seconds, outcome), f"a {kind} query")  # as the DHT does
    value = registry.get_sample_value
    assert value("dedloc_dht_queries_total", {"type": "get", "outcome": "ok"}) == 1
    assert value("dedloc_dht_queries_total", {"type": "get", "outcome": "not_found"}) == 1
    assert value("dedloc_dht_queries_total", {"type": "store", "outcome": "ok"}) == 1
    assert value("dedloc_dht_query_duration_seconds_count", {"type": "get"}) == 2
    assert value("dedloc_dht_query_duration_seconds_sum", {"type": "get"}) == pytest.approx(0.23)
    assert value("dedloc_dht_query_duration_seconds_bucket", {"type": "store", "le": "1.0"}) == 0
    assert value("dedloc_dht_query_duration_seconds_bucket", {"type": "store", "le": "2.5"}) == 1
    assert value("dedloc_dht_query_duration_seconds_bucket", {"type": "get", "le": "0.001"}) == 0  # ours, not
    assert value("dedloc_dht_query_duration_seconds_bucket", {"type": "get", "le": "30.0"}) == 2  # the default
    assert "# HELP dedloc_dht_query_duration_seconds Duration of a DHT query this peer made\n" in scrape(registry)
    assert "# HELP dedloc_dht_queries_total DHT queries this peer made, by outcome\n" in scrape(registry)
    handle.remove()
    assert len(queries) == 0 and "dedloc_dht_routing_table_peers" not in scrape(registry)
