"""What ``--metrics HOST:PORT`` serves for a running :class:`nat.Peer`: ``/metrics`` and the live page.

* ``/metrics``: every Prometheus family of the node (:mod:`p2p.metrics`), the NAT
  layer (:mod:`nat.metrics`), the process (the client's ``process_*``), and
  whatever the layers above register in :attr:`Dashboard.registry` (averaging,
  training).
* ``/``: the live page (``nat/web/``: static files shipped in the package,
  nothing from a CDN), which reads ``/api/status`` every few seconds.
* ``/api/status``: one JSON object: this node, the peers connected to it with
  what it knows of their NAT (a relay slot here means a peer behind NAT; the
  AutoNAT server's last dial-back says public or unreachable), direct and
  relayed links, the hole-punch funnel and a history of it, the resource
  manager's usage against its limits, and each section a layer above added to
  :attr:`Dashboard.sections` (training adds ``run``).

A relay sees the peers connected to it, not the links between others: the page
says whose view it shows.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest

from p2p.addresses import is_relayed
from p2p.dialer import remote_addr
from p2p.http import HttpServer, Response, parse_endpoint
from p2p.metrics import DHTMetrics, NodeMetrics

from .metrics import NatMetrics
from .peer import Peer

#: Seconds between two samples of the page's history; samples kept (an hour).
HISTORY_INTERVAL = 5.0
HISTORY_LENGTH = 720
#: Peers listed on the page at most (the rest are counted).
MAX_LISTED_PEERS = 500

#: The page's files: name -> content type.
ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}


@dataclass(frozen=True)
class Sample:
    """One point of the page's history."""

    time: float
    direct: int
    relayed: int
    punch_attempts: int
    punch_successes: int
    punch_failures: int
    circuits: int


class Dashboard:
    """The registry, the page's sections and its history for one peer; open it with :meth:`serve`."""

    def __init__(self, peer: Peer, *, role: str) -> None:
        self.peer = peer
        self.role = role
        self.started = time.time()
        #: One registry per process (the client's global one is never used).
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.node_metrics = NodeMetrics(peer.node, self.registry)
        self.registry.register(NatMetrics(peer.nat))
        #: Extra sections of ``/api/status``: name -> a function returning JSON-able data.
        self.sections: dict[str, Callable[[], Any]] = {}
        self.history: deque[Sample] = deque(maxlen=HISTORY_LENGTH)
        self.address: tuple[str, int] | None = None
        self._assets = {name: (resources.files("nat.web") / name).read_bytes() for name in ASSETS}

    @classmethod
    @asynccontextmanager
    async def serve(cls, peer: Peer, endpoint: str, *, role: str = "peer") -> AsyncIterator[Dashboard]:
        """Serve ``/metrics``, ``/`` and ``/api/status`` on ``endpoint`` (``HOST:PORT``; :class:`p2p.ConfigError`
        when it is malformed or cannot be bound) for the duration of the block."""
        host, port = parse_endpoint(endpoint)
        dashboard = cls(peer, role=role)
        server = HttpServer({
            "/metrics": dashboard._metrics,
            "/api/status": dashboard._status,
            "/": dashboard._asset("index.html"),
            "/index.html": dashboard._asset("index.html"),
            "/app.js": dashboard._asset("app.js"),
            "/style.css": dashboard._asset("style.css"),
        })
        with dashboard.node_metrics.install():
            registrations = []
            if peer._dht is not None:
                registrations.append(DHTMetrics(peer.dht, dashboard.registry).install())
            try:
                async with trio.open_nursery() as nursery:
                    dashboard.address = await nursery.start(server.serve, host, port)
                    nursery.start_soon(dashboard.node_metrics.follow_events)
                    nursery.start_soon(dashboard._sample_history)
                    try:
                        yield dashboard
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                for r in registrations:
                    r.remove()

    # ---------------------------------------------------------------- routes

    def _metrics(self, query: str) -> Response:
        return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

    def _asset(self, name: str) -> Callable[[str], Response]:
        body, kind = self._assets[name], ASSETS[name]
        return lambda query: Response(200, body, kind)

    def _status(self, query: str) -> Response:
        return Response(200, json.dumps(self.status(), default=str).encode(), "application/json")

    # ---------------------------------------------------------------- the page's data

    async def _sample_history(self) -> None:
        while True:
            self.history.append(self._sample())
            await trio.sleep(HISTORY_INTERVAL)

    def _sample(self) -> Sample:
        links = self._links()
        stats = self.peer.nat.puncher.stats
        relay = self.peer.nat.relay_service
        return Sample(time.time(), links["direct"], links["relayed"], stats.attempts, stats.successes,
                      stats.failures, relay.stats.circuits_total if relay is not None else 0)

    def _links(self) -> dict[str, int]:
        paths = self.peer.node.peers_by_path()
        return {"direct": paths["direct"], "relayed": paths["relayed"]}

    def status(self) -> dict[str, Any]:
        """Everything ``/api/status`` returns (the page's one source)."""
        peer, nat = self.peer, self.peer.nat
        m = peer.metrics()
        out: dict[str, Any] = {
            "time": time.time(),
            "node": {"peer_id": str(peer.peer_id), "role": self.role, "addrs": [str(a) for a in peer.addrs],
                     "mode": str(nat.mode), "reachability": str(nat.reachability), "mapping": str(nat.mapping),
                     "uptime_s": time.time() - self.started},
            "peers": self._peers(),
            "links": self._links(),
            "funnel": {k: m.get(k, 0) for k in ("punch_attempts", "punch_successes", "punch_failures", "reversals",
                                                "punch_retries", "reservations", "relays_discovered")},
            "relay": None if nat.relay_service is None else {
                k[len("relay."):]: v for k, v in m.items() if k.startswith("relay.")},
            "history": [vars(s) for s in self.history],
            "resources": self._resources(),
        }
        if peer._dht is not None:
            out["dht"] = peer.dht.metrics()
        for name, section in self.sections.items():
            out[name] = section()
        return out

    def _peers(self) -> list[dict[str, Any]]:
        nat = self.peer.nat
        slots = nat.relay_service.admission.slots if nat.relay_service is not None else {}
        verdicts = nat.autonat_server.verdicts if nat.autonat_server is not None else {}
        rows = []
        for peer_id in self.peer.node.connected_peers()[:MAX_LISTED_PEERS]:
            conns = [c for c in self.peer.node.network.get_connections(peer_id) if not getattr(c, "is_closed", False)]
            addrs = [remote_addr(c) for c in conns]
            direct = [a for a in addrs if not is_relayed(a)]
            verdict = verdicts.get(peer_id)
            # a dial-back is evidence; a slot may have been reserved before the peer knew it was public
            if verdict == "public":
                kind = "public (dial-back reached it)"
            elif verdict == "unreachable":
                kind = "behind NAT (dial-back failed)"
            elif peer_id in slots:
                kind = "behind NAT (holds a relay slot here)"
            else:
                kind = "unknown"
            rows.append({"peer_id": str(peer_id), "path": nat.path_to(peer_id), "addr": str((direct or addrs)[0]) if addrs else "",
                         "nat": kind, "relay_slot": peer_id in slots, "dial_back": verdict or ""})
        return rows

    def _resources(self) -> list[dict[str, Any]]:
        usage = self.peer.node.resources.usage()
        limits = self.peer.node.resources.limits()
        # (name, used, limit, unit): a unit of "bytes" is shown in MiB/GiB by the page
        pairs = [("inbound connections", usage.get("admission.inbound", 0), limits["inbound_connections"], ""),
                 ("connections handshaking", usage.get("admission.handshaking", 0), limits["handshaking"], ""),
                 ("inbound streams", usage.get("inbound_streams", 0), limits["inbound_streams"], ""),
                 ("memory in flight", usage.get("memory_bytes", 0), limits["memory_bytes"], "bytes")]
        relay = self.peer.nat.relay_service
        if relay is not None:
            pairs += [("relay reservations", len(relay.admission.slots), relay.config.max_reservations, ""),
                      ("relay circuits", relay.admission.circuit_count, relay.config.max_circuits, "")]
        refused = sum(self.peer.node.resources.refusal_counts().values())
        rows: list[dict[str, Any]] = [{"name": name, "used": used, "limit": limit, "unit": unit}
                                      for name, used, limit, unit in pairs]
        rows.append({"name": "refusals so far", "used": refused, "limit": None, "unit": ""})
        return rows


__all__ = ["Dashboard", "Sample"]
