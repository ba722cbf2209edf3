"""Prometheus families of the Node and the DHT (``--metrics``; the list is in docs/OPERATORS.md).

What libp2p shares carries go-libp2p's names and labels, so its Grafana boards
work unchanged: ``libp2p_swarm_*`` (connections by direction and transport,
their duration, dial errors, handshake latency) and ``libp2p_rcmgr_*`` (usage,
limits, blocked resources by scope). The DHT's are ``dedloc_dht_*`` (query
durations and outcomes, like rust-libp2p's ``kad_*``), our DHT being hivemind's
protocol, not Kademlia's.

Counts the layers keep anyway (the resource manager's, the DHT's table) are
read at scrape time by a collector; what only an event carries (a connection's
lifetime, a query's duration) goes into a histogram as it happens, through the
layers' lossless hooks (:class:`p2p.hooks.SwarmObserver`,
:meth:`p2p.dht.DHT.observe_queries`). Nothing here runs unless ``--metrics`` is
given, and one :class:`~prometheus_client.CollectorRegistry` per process holds
it all (never the client's global one).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .dht import DHT
from .dialer import address_labels
from .events import PeerConnected
from .hooks import ConnectionInfo, Registration, SwarmObserver
from .node import Node
from .resources import ResourceManager

#: go-libp2p's label values for what every dedloc connection is.
SECURITY = "/noise"
MUXER = "/yamux/1.0.0"

CONNECTION_LABELS = ("dir", "transport", "security", "muxer", "early_muxer", "ip_version")
#: Seconds: from a handshake's milliseconds on loopback to a relayed dial's seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


def connection_labels(info: ConnectionInfo) -> tuple[str, ...]:
    """go-libp2p's labels of a connection: a relayed one's transport is ``circuit``."""
    transport, ip_version = address_labels(str(info.addr))
    return (info.direction.value, transport, SECURITY, MUXER, "false", ip_version)


class NodeMetrics(SwarmObserver):
    """``libp2p_swarm_*`` and ``libp2p_rcmgr_*`` of one Node; :meth:`install` for the block it runs in."""

    def __init__(self, node: Node, registry: CollectorRegistry) -> None:
        self._node = node
        self._registry = registry
        ns = "libp2p_swarm"
        self.opened = Counter("connections_opened", "Connections Opened", CONNECTION_LABELS,
                              namespace=ns, registry=registry)
        self.closed = Counter("connections_closed", "Connections Closed", CONNECTION_LABELS,
                              namespace=ns, registry=registry)
        self.duration = Histogram("connection_duration_seconds", "Duration of a Connection", CONNECTION_LABELS,
                                  namespace=ns, registry=registry, buckets=DURATION_BUCKETS)
        self.handshake = Histogram("handshake_latency_seconds", "Duration of the libp2p Handshake "
                                   "(our dials: TCP connect, Noise, Yamux)", CONNECTION_LABELS[1:],
                                   namespace=ns, registry=registry, buckets=LATENCY_BUCKETS)
        self._open: dict[int, float] = {}
        self._collector = _NodeCollector(node)

    def connection_opened(self, info: ConnectionInfo) -> None:
        self.opened.labels(*connection_labels(info)).inc()
        self._open[id(info.conn)] = time.monotonic()

    def connection_closed(self, info: ConnectionInfo) -> None:
        labels = connection_labels(info)
        self.closed.labels(*labels).inc()
        started = self._open.pop(id(info.conn), None)
        if started is not None:
            self.duration.labels(*labels).observe(time.monotonic() - started)

    def install(self) -> Registration:
        """Observe the node and read its resource manager at scrape time, until the handle is removed."""
        observing = self._node.observe(self)
        self._registry.register(self._collector)

        def undo() -> None:
            observing.remove()
            self._registry.unregister(self._collector)

        return Registration(undo)

    async def follow_events(self) -> None:
        """Handshake latencies from the node's dial events (run in the metrics' nursery)."""
        async with self._node.events() as events:
            async for event in events:
                if isinstance(event, PeerConnected):
                    transport, ip_version = address_labels(event.addr)
                    self.handshake.labels(transport, SECURITY, MUXER, "false", ip_version).observe(event.elapsed)


class _NodeCollector(Collector):
    """Read at scrape time: the resource manager's usage, limits and refusals; dial errors."""

    def __init__(self, node: Node) -> None:
        self._node = node

    def collect(self) -> Iterator[Metric]:
        yield from resource_families(self._node.resources)
        errors = CounterMetricFamily("libp2p_swarm_dial_errors", "Dial Error", labels=["transport", "error", "ip_version"])
        for (transport, error, ip_version), n in sorted(self._node.dial_errors.items()):
            errors.add_metric([transport, error, ip_version], n)
        yield errors
        yield CounterMetricFamily("dedloc_swarm_dials_backed_off", "Dials not made: every address of the peer "
                                  "failed lately and waits out its backoff", value=self._node.dials_backed_off)
        peers = GaugeMetricFamily("dedloc_swarm_peers", "Peers with at least one open connection, by path",
                                  labels=["path"])
        paths = self._node.peers_by_path()
        peers.add_metric(["direct"], paths["direct"])
        peers.add_metric(["relayed"], paths["relayed"])
        yield peers
        yield CounterMetricFamily("dedloc_connmgr_trimmed", "Connections the connection manager closed (over its "
                                  "high water, of least use)", value=self._node.trimmed)
        yield GaugeMetricFamily("dedloc_connmgr_protected_peers", "Peers a service keeps connected (a relay slot, "
                                "an averaging round)", value=self._node.conn_tags.protected_count())
        store = self._node.peer_store_metrics()
        yield GaugeMetricFamily("dedloc_peerstore_peers", "Peers the peer store holds (addresses, keys, protocols)",
                                value=store["known"])
        yield CounterMetricFamily("dedloc_peerstore_forgotten", "Peers the peer store forgot (over its bound: "
                                  "without addresses, expired, least recently heard of first)", value=store["forgotten"])


def limit_labels(name: str) -> tuple[str, str]:
    """A :meth:`ResourceManager.limits` key -> go-libp2p's (scope, resource): limits before the handshake
    are the ``transient`` scope's, per-peer ones the ``peer`` scope's, rates the ``service`` scope's."""
    if name.startswith("rate."):
        return "service", name[len("rate."):]
    if name.startswith("handshak"):
        return "transient", name
    for suffix, scope in (("_per_peer_protocol", "peer_protocol"), ("_per_protocol", "protocol"),
                          ("_per_peer", "peer"), ("_per_address", "transient"), ("_per_subnet", "transient")):
        if name.endswith(suffix):
            return scope, name[: -len(suffix)] if scope != "transient" else name
    return "system", name


def blocked_labels(reason: str) -> tuple[str, str]:
    """A refusal's name (:meth:`ResourceManager.refusal_counts`) -> (scope, resource)."""
    scope, _, resource = reason.partition(".")
    if scope == "admission":
        return "transient", resource
    return scope, resource or scope


def resource_families(resources: ResourceManager) -> Iterable[Metric]:
    usage = resources.usage()
    conns = GaugeMetricFamily("libp2p_rcmgr_connections", "Number of Connections", labels=["dir", "scope"])
    conns.add_metric(["inbound", "system"], usage.get("admission.inbound", 0))
    conns.add_metric(["inbound", "transient"], usage.get("admission.handshaking", 0))
    yield conns
    streams = GaugeMetricFamily("libp2p_rcmgr_streams", "Number of Streams", labels=["dir", "scope", "protocol"])
    streams.add_metric(["inbound", "system", ""], usage.get("inbound_streams", 0))
    for key, n in usage.items():
        if key.startswith("streams."):
            streams.add_metric(["inbound", "protocol", key[len("streams."):]], n)
    yield streams
    memory = GaugeMetricFamily("libp2p_rcmgr_memory", "Amount of memory reserved as reported to the Resource Manager",
                               labels=["scope", "protocol"])
    memory.add_metric(["system", ""], usage.get("memory_bytes", 0))
    memory.add_metric(["peer", ""], usage.get("busiest_peer_memory_bytes", 0))
    yield memory
    blocked = GaugeMetricFamily("libp2p_rcmgr_blocked_resources", "Number of blocked resources",
                                labels=["dir", "scope", "resource"])
    for reason, n in sorted(resources.refusal_counts().items()):
        blocked.add_metric(["inbound", *blocked_labels(reason)], n)
    yield blocked
    limit = GaugeMetricFamily("libp2p_rcmgr_limit", "Resource manager limits", labels=["scope", "resource"])
    for name, value in resources.limits().items():
        limit.add_metric(list(limit_labels(name)), value)
    yield limit


class DHTMetrics(Collector):
    """``dedloc_dht_*``: the table and store read at scrape time, each query's duration and outcome as it ends."""

    def __init__(self, dht: DHT, registry: CollectorRegistry) -> None:
        self._dht = dht
        self._registry = registry
        self.duration = Histogram("dedloc_dht_query_duration_seconds", "Duration of a DHT query this peer made",
                                  ["type"], registry=registry, buckets=LATENCY_BUCKETS)
        self.queries = Counter("dedloc_dht_queries", "DHT queries this peer made, by outcome", ["type", "outcome"],
                               registry=registry)

    def _query(self, kind: str, seconds: float, outcome: str) -> None:
        self.duration.labels(kind).observe(seconds)
        self.queries.labels(kind, outcome).inc()

    def install(self) -> Registration:
        stack = ExitStack()
        stack.enter_context(self._dht.observe_queries(self._query))
        self._registry.register(self)
        stack.callback(self._registry.unregister, self)
        return Registration(stack.close)

    def collect(self) -> Iterator[Metric]:
        m = self._dht.metrics()
        mode = GaugeMetricFamily("dedloc_dht_server", "1 while this peer serves the DHT, 0 while only a client")
        mode.add_metric([], 1 if self._dht.server else 0)
        yield mode
        table = GaugeMetricFamily("dedloc_dht_routing_table_peers", "Peers in the routing table")
        table.add_metric([], float(m["routing_table"]))
        yield table
        records = GaugeMetricFamily("dedloc_dht_records", "Records stored for others, by kind", labels=["kind"])
        records.add_metric(["stored"], float(m["keys"]))
        records.add_metric(["cached"], float(m["cached_keys"]))
        records.add_metric(["own"], float(m["own_records"]))
        yield records
        size = GaugeMetricFamily("dedloc_dht_stored_bytes", "Bytes of records stored for others")
        size.add_metric([], float(m["bytes"]))
        yield size
        served = CounterMetricFamily("dedloc_dht_inbound_requests", "DHT requests served, by type", labels=["type"])
        for kind in ("find", "store"):
            served.add_metric([kind], self._dht.served.get(kind, 0))
        yield served



__all__ = ["DHTMetrics", "NodeMetrics", "blocked_labels", "connection_labels", "limit_labels", "resource_families"]
