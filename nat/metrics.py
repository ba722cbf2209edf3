"""Prometheus families of the NAT layer, with go-libp2p's names: ``libp2p_holepunch_*``,
``libp2p_relaysvc_*``, ``libp2p_autonat_*``; and ``dedloc_nat_*`` for what go-libp2p has no family for
(our mode, relay slots held, bytes by path).

All of it is read at scrape time from the counters the services keep anyway
(:class:`nat.holepunch.HolePunchStats`, :class:`nat.relay.RelayStats`, the AutoNAT
server's counts): a scrape costs the node nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from p2p.hooks import Metrics, Reachability

from .traversal import NatService

#: go-libp2p's ``network.Reachability`` values, as its ``reachability_status`` gauge has them.
REACHABILITY_CODES = {Reachability.UNKNOWN: 0, Reachability.PUBLIC: 1, Reachability.PRIVATE: 2}


class NatMetrics(Collector):
    """Every NAT family of one :class:`NatService` (register it in the process's registry)."""

    def __init__(self, nat: NatService) -> None:
        self._nat = nat

    def collect(self) -> Iterator[Metric]:
        m = self._nat.metrics()  # once a scrape: it walks every connection (and sweeps the relay's slots)
        yield from self._holepunch()
        yield from self._autonat(m)
        if self._nat.relay_service is not None:
            yield from self._relay_service()
        yield from self._dedloc(m)

    def _holepunch(self) -> Iterator[Metric]:
        stats = self._nat.puncher.stats
        dials = CounterMetricFamily("libp2p_holepunch_direct_dials", "Direct Dials Total", labels=["outcome"])
        for outcome in ("success", "failed"):
            dials.add_metric([outcome], stats.direct_dials[outcome])  # a Counter: 0 when none
        yield dials
        outcomes = CounterMetricFamily("libp2p_holepunch_outcomes", "Hole Punch Outcomes",
                                       labels=["side", "num_attempts", "outcome"])
        for (side, attempts, outcome), n in sorted(stats.outcomes.items()):
            outcomes.add_metric([side, str(attempts), outcome], n)
        yield outcomes

    def _autonat(self, m: Metrics) -> Iterator[Metric]:
        nat = self._nat
        status = GaugeMetricFamily("libp2p_autonat_reachability_status",
                                   "Current node reachability (0 unknown, 1 public, 2 private)")
        status.add_metric([], REACHABILITY_CODES[nat.reachability])  # every value has its code
        yield status
        confirmed = GaugeMetricFamily("libp2p_autonat_reachability_status_confidence",
                                      "Addresses a nonce-checked dial-back confirmed (our confidence in public)")
        confirmed.add_metric([], len(nat.confirmed))
        yield confirmed
        received = CounterMetricFamily("libp2p_autonat_received_dial_response", "Count of dial responses for client",
                                       labels=["response_status"])
        received.add_metric(["OK"], m.get("dial_backs", 0))  # type: ignore[arg-type]
        received.add_metric(["E_DIAL_REFUSED"], m.get("autonat_refused", 0))  # type: ignore[arg-type]
        received.add_metric(["E_REQUEST_REJECTED"], m.get("autonat_rejected", 0))  # type: ignore[arg-type]
        yield received
        server = nat.autonat_server
        if server is None:
            return
        c = server.counts
        responses = CounterMetricFamily("libp2p_autonat_outgoing_dial_response", "Count of dial responses for server",
                                        labels=["response_status"])
        responses.add_metric(["OK"], c["dial_back_ok"])
        responses.add_metric(["E_DIAL_ERROR"], c["dial_backs"] - c["dial_back_ok"])
        responses.add_metric(["E_DIAL_REFUSED"], c["refused"])
        responses.add_metric(["E_REQUEST_REJECTED"], c["rejected"])
        yield responses
        refused = CounterMetricFamily("libp2p_autonat_outgoing_dial_refused", "Count of dial requests refused by server",
                                      labels=["refusal_reason"])
        refused.add_metric(["rate_limited"], c["rejected"])
        refused.add_metric(["no_valid_address"], c["refused"])
        yield refused

    def _relay_service(self) -> Iterator[Metric]:
        relay = self._nat.relay_service
        assert relay is not None  # its expired slots were swept by the NAT layer's metrics() in collect
        s = relay.stats
        up = GaugeMetricFamily("libp2p_relaysvc_status", "Relay Status")
        up.add_metric([], 1)
        yield up
        reservations = CounterMetricFamily("libp2p_relaysvc_reservations", "Relay Reservation Request",
                                           labels=["type"])
        for kind in ("opened", "renewed"):
            reservations.add_metric([kind], s.reservation_types[kind])
        yield reservations
        for kind, family in (("reservation", "reservation"), ("connection", "connection")):
            responses = CounterMetricFamily(f"libp2p_relaysvc_{family}_request_response_status",
                                            f"Relay {kind.capitalize()} Request Status", labels=["status"])
            rejections = CounterMetricFamily(f"libp2p_relaysvc_{family}_rejections",
                                             f"Relay {kind.capitalize()} Rejected Reason", labels=["reason"])
            for (k, status), n in sorted(s.responses.items()):
                if k == kind:
                    responses.add_metric([status], n)
            for (k, reason), n in sorted(s.rejections.items()):
                if k == kind:
                    rejections.add_metric([reason.replace(" ", "_")], n)
            yield responses
            yield rejections
        circuits = relay.admission.circuit_count
        connections = CounterMetricFamily("libp2p_relaysvc_connections", "Relay Connection Total", labels=["type"])
        connections.add_metric(["opened"], s.circuits_total)
        connections.add_metric(["closed"], max(0, s.circuits_total - circuits))
        yield connections
        data = CounterMetricFamily("libp2p_relaysvc_data_transferred_bytes", "Bytes Transferred Total")
        data.add_metric([], s.bytes_relayed)
        yield data
        held = GaugeMetricFamily("dedloc_relaysvc_slots", "Relay slots in use, against their limits",
                                 labels=["kind", "value"])
        held.add_metric(["reservations", "used"], len(relay.admission.slots))
        held.add_metric(["reservations", "limit"], relay.config.max_reservations)
        held.add_metric(["circuits", "used"], circuits)
        held.add_metric(["circuits", "limit"], relay.config.max_circuits)
        yield held
        limits = CounterMetricFamily("dedloc_relaysvc_circuits_cut", "Circuits reset at a limit", labels=["limit"])
        for limit in ("data", "duration"):
            limits.add_metric([limit], s.limits_hit[limit])
        yield limits
        reclaimed = CounterMetricFamily("dedloc_relaysvc_reservations_reclaimed",
                                        "Slots taken back, when full, from holders that no longer advertise them")
        reclaimed.add_metric([], s.reclaimed)
        yield reclaimed

    def _dedloc(self, m: Metrics) -> Iterator[Metric]:
        nat = self._nat
        mode = GaugeMetricFamily("dedloc_nat_mode", "1 for the NAT layer's current mode", labels=["mode"])
        mode.add_metric([str(nat.mode)], 1)
        yield mode
        mapping = GaugeMetricFamily("dedloc_nat_mapping", "1 for the NAT mapping kind we observe", labels=["mapping"])
        mapping.add_metric([str(nat.mapping)], 1)
        yield mapping
        slots = GaugeMetricFamily("dedloc_nat_relay_reservations", "Relay slots we hold on others")
        slots.add_metric([], len(nat.relay_client.reservations))
        yield slots
        moved = CounterMetricFamily("dedloc_nat_connection_bytes", "Bytes moved on open connections, by path",
                                    labels=["path"])
        moved.add_metric(["direct"], float(m["bytes_direct"]))  # type: ignore[arg-type]
        moved.add_metric(["relayed"], float(m["bytes_relayed"]))  # type: ignore[arg-type]
        yield moved


__all__ = ["NatMetrics", "REACHABILITY_CODES"]
