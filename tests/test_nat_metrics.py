"""nat/metrics.py: every NAT family, scraped from a stand-in of the NAT service whose counters all
differ, so that each name, help text, label and value is checked to the byte against what it
was fed (the same families from a real relay and peers: tests/test_metrics.py's swarm)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from nat.holepunch import HolePunchStats
from nat.metrics import REACHABILITY_CODES, NatMetrics
from nat.reachability import MappingKind, NatMode
from nat.relay import RelayStats
from p2p.hooks import Reachability


def scrape(nat: Any) -> str:
    registry = CollectorRegistry()
    registry.register(NatMetrics(nat))
    return generate_latest(registry).decode()


def relay_node(**changes: Any) -> SimpleNamespace:
    """A relay that is also an AutoNAT server, behind a NAT that changes ports, holding 4 slots."""
    punches = HolePunchStats(direct_dials=Counter({"success": 3, "failed": 4}), outcomes=Counter({
        ("receiver", 1, "success"): 5, ("initiator", 2, "failed"): 6, ("initiator", 1, "no_suitable_address"): 7}))
    served = RelayStats(reclaimed=11, circuits_total=12, bytes_relayed=13,
                        limits_hit=Counter({"data": 14, "duration": 15}),
                        reservation_types=Counter({"opened": 16, "renewed": 17}),
                        responses=Counter({("reservation", "OK"): 18, ("connection", "OK"): 19,
                                           ("connection", "NO_RESERVATION"): 20}),
                        rejections=Counter({("reservation", "per peer limit"): 21, ("connection", "ip limit"): 22}))
    relay = SimpleNamespace(stats=served, admission=SimpleNamespace(circuit_count=5, slots={1: 0, 2: 0}),
                            config=SimpleNamespace(max_reservations=128, max_circuits=16))
    server = SimpleNamespace(counts={"dial_back_ok": 23, "dial_backs": 30, "refused": 24, "rejected": 25})
    node = SimpleNamespace(
        puncher=SimpleNamespace(stats=punches), reachability=Reachability.PRIVATE, confirmed=["a", "b", "c"],
        autonat_server=server, relay_service=relay, mode=NatMode.RELAYED, mapping=MappingKind.INDEPENDENT_CHANGED,
        relay_client=SimpleNamespace(reservations={1: 1, 2: 2, 3: 3, 4: 4}),
        metrics=lambda: {"dial_backs": 26, "autonat_refused": 27, "autonat_rejected": 28, "bytes_direct": 29,
                         "bytes_relayed": 31})
    for name, value in changes.items():
        setattr(node, name, value)
    return node


def test_a_relay_s_scrape_is_every_family_with_go_libp2p_s_names_and_the_counts_it_was_fed() -> None:
    assert scrape(relay_node()) == (
        "# HELP libp2p_holepunch_direct_dials_total Direct Dials Total\n"
        "# TYPE libp2p_holepunch_direct_dials_total counter\n"
        'libp2p_holepunch_direct_dials_total{outcome="success"} 3.0\n'
        'libp2p_holepunch_direct_dials_total{outcome="failed"} 4.0\n'
        "# HELP libp2p_holepunch_outcomes_total Hole Punch Outcomes\n"
        "# TYPE libp2p_holepunch_outcomes_total counter\n"
        'libp2p_holepunch_outcomes_total{num_attempts="1",outcome="no_suitable_address",side="initiator"} 7.0\n'
        'libp2p_holepunch_outcomes_total{num_attempts="2",outcome="failed",side="initiator"} 6.0\n'
        'libp2p_holepunch_outcomes_total{num_attempts="1",outcome="success",side="receiver"} 5.0\n'
        "# HELP libp2p_autonat_reachability_status Current node reachability (0 unknown, 1 public, 2 private)\n"
        "# TYPE libp2p_autonat_reachability_status gauge\n"
        "libp2p_autonat_reachability_status 2.0\n"
        "# HELP libp2p_autonat_reachability_status_confidence Addresses a nonce-checked dial-back "
        "confirmed (our confidence in public)\n"
        "# TYPE libp2p_autonat_reachability_status_confidence gauge\n"
        "libp2p_autonat_reachability_status_confidence 3.0\n"
        "# HELP libp2p_autonat_received_dial_response_total Count of dial responses for client\n"
        "# TYPE libp2p_autonat_received_dial_response_total counter\n"
        'libp2p_autonat_received_dial_response_total{response_status="OK"} 26.0\n'
        'libp2p_autonat_received_dial_response_total{response_status="E_DIAL_REFUSED"} 27.0\n'
        'libp2p_autonat_received_dial_response_total{response_status="E_REQUEST_REJECTED"} 28.0\n'
        "# HELP libp2p_autonat_outgoing_dial_response_total Count of dial responses for server\n"
        "# TYPE libp2p_autonat_outgoing_dial_response_total counter\n"
        'libp2p_autonat_outgoing_dial_response_total{response_status="OK"} 23.0\n'
        'libp2p_autonat_outgoing_dial_response_total{response_status="E_DIAL_ERROR"} 7.0\n'
        'libp2p_autonat_outgoing_dial_response_total{response_status="E_DIAL_REFUSED"} 24.0\n'
        'libp2p_autonat_outgoing_dial_response_total{response_status="E_REQUEST_REJECTED"} 25.0\n'
        "# HELP libp2p_autonat_outgoing_dial_refused_total Count of dial requests refused by server\n"
        "# TYPE libp2p_autonat_outgoing_dial_refused_total counter\n"
        'libp2p_autonat_outgoing_dial_refused_total{refusal_reason="rate_limited"} 25.0\n'
        'libp2p_autonat_outgoing_dial_refused_total{refusal_reason="no_valid_address"} 24.0\n'
        "# HELP libp2p_relaysvc_status Relay Status\n"
        "# TYPE libp2p_relaysvc_status gauge\n"
        "libp2p_relaysvc_status 1.0\n"
        "# HELP libp2p_relaysvc_reservations_total Relay Reservation Request\n"
        "# TYPE libp2p_relaysvc_reservations_total counter\n"
        'libp2p_relaysvc_reservations_total{type="opened"} 16.0\n'
        'libp2p_relaysvc_reservations_total{type="renewed"} 17.0\n'
        "# HELP libp2p_relaysvc_reservation_request_response_status_total Relay Reservation Request Status\n"
        "# TYPE libp2p_relaysvc_reservation_request_response_status_total counter\n"
        'libp2p_relaysvc_reservation_request_response_status_total{status="OK"} 18.0\n'
        "# HELP libp2p_relaysvc_reservation_rejections_total Relay Reservation Rejected Reason\n"
        "# TYPE libp2p_relaysvc_reservation_rejections_total counter\n"
        'libp2p_relaysvc_reservation_rejections_total{reason="per_peer_limit"} 21.0\n'
        "# HELP libp2p_relaysvc_connection_request_response_status_total Relay Connection Request Status\n"
        "# TYPE libp2p_relaysvc_connection_request_response_status_total counter\n"
        'libp2p_relaysvc_connection_request_response_status_total{status="NO_RESERVATION"} 20.0\n'
        'libp2p_relaysvc_connection_request_response_status_total{status="OK"} 19.0\n'
        "# HELP libp2p_relaysvc_connection_rejections_total Relay Connection Rejected Reason\n"
        "# TYPE libp2p_relaysvc_connection_rejections_total counter\n"
        'libp2p_relaysvc_connection_rejections_total{reason="ip_limit"} 22.0\n'
        "# HELP libp2p_relaysvc_connections_total Relay Connection Total\n"
        "# TYPE libp2p_relaysvc_connections_total counter\n"
        'libp2p_relaysvc_connections_total{type="opened"} 12.0\n'
        'libp2p_relaysvc_connections_total{type="closed"} 7.0\n'
        "# HELP libp2p_relaysvc_data_transferred_bytes_total Bytes Transferred Total\n"
        "# TYPE libp2p_relaysvc_data_transferred_bytes_total counter\n"
        "libp2p_relaysvc_data_transferred_bytes_total 13.0\n"
        "# HELP dedloc_relaysvc_slots Relay slots in use, against their limits\n"
        "# TYPE dedloc_relaysvc_slots gauge\n"
        'dedloc_relaysvc_slots{kind="reservations",value="used"} 2.0\n'
        'dedloc_relaysvc_slots{kind="reservations",value="limit"} 128.0\n'
        'dedloc_relaysvc_slots{kind="circuits",value="used"} 5.0\n'
        'dedloc_relaysvc_slots{kind="circuits",value="limit"} 16.0\n'
        "# HELP dedloc_relaysvc_circuits_cut_total Circuits reset at a limit\n"
        "# TYPE dedloc_relaysvc_circuits_cut_total counter\n"
        'dedloc_relaysvc_circuits_cut_total{limit="data"} 14.0\n'
        'dedloc_relaysvc_circuits_cut_total{limit="duration"} 15.0\n'
        "# HELP dedloc_relaysvc_reservations_reclaimed_total Slots taken back, when full, "
        "from holders that no longer advertise them\n"
        "# TYPE dedloc_relaysvc_reservations_reclaimed_total counter\n"
        "dedloc_relaysvc_reservations_reclaimed_total 11.0\n"
        "# HELP dedloc_nat_mode 1 for the NAT layer's current mode\n"
        "# TYPE dedloc_nat_mode gauge\n"
        'dedloc_nat_mode{mode="relayed"} 1.0\n'
        "# HELP dedloc_nat_mapping 1 for the NAT mapping kind we observe\n"
        "# TYPE dedloc_nat_mapping gauge\n"
        'dedloc_nat_mapping{mapping="endpoint-independent, port changed"} 1.0\n'
        "# HELP dedloc_nat_relay_reservations Relay slots we hold on others\n"
        "# TYPE dedloc_nat_relay_reservations gauge\n"
        "dedloc_nat_relay_reservations 4.0\n"
        "# HELP dedloc_nat_connection_bytes_total Bytes moved on open connections, by path\n"
        "# TYPE dedloc_nat_connection_bytes_total counter\n"
        'dedloc_nat_connection_bytes_total{path="direct"} 29.0\n'
        'dedloc_nat_connection_bytes_total{path="relayed"} 31.0\n'
    )


def test_a_plain_peer_has_no_relay_or_server_families_and_counts_nothing_yet_as_zero() -> None:
    node = relay_node(puncher=SimpleNamespace(stats=HolePunchStats()), autonat_server=None, relay_service=None,
                      reachability=Reachability.UNKNOWN, confirmed=[], mode=NatMode.STARTING,
                      mapping=MappingKind.UNKNOWN, relay_client=SimpleNamespace(reservations={}),
                      metrics=lambda: {"bytes_direct": 0, "bytes_relayed": 0})
    text = scrape(node)
    assert "relaysvc" not in text and "outgoing_dial" not in text
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples == [
        'libp2p_holepunch_direct_dials_total{outcome="success"} 0.0',
        'libp2p_holepunch_direct_dials_total{outcome="failed"} 0.0',
        "libp2p_autonat_reachability_status 0.0",
        "libp2p_autonat_reachability_status_confidence 0.0",
        'libp2p_autonat_received_dial_response_total{response_status="OK"} 0.0',
        'libp2p_autonat_received_dial_response_total{response_status="E_DIAL_REFUSED"} 0.0',
        'libp2p_autonat_received_dial_response_total{response_status="E_REQUEST_REJECTED"} 0.0',
        'dedloc_nat_mode{mode="starting"} 1.0',
        'dedloc_nat_mapping{mapping="unknown"} 1.0',
        "dedloc_nat_relay_reservations 0.0",
        'dedloc_nat_connection_bytes_total{path="direct"} 0.0',
        'dedloc_nat_connection_bytes_total{path="relayed"} 0.0',
    ]


@pytest.mark.parametrize("reachability, code", [(Reachability.UNKNOWN, 0), (Reachability.PUBLIC, 1),
                                                (Reachability.PRIVATE, 2)])
def test_reachability_is_go_libp2p_s_code(reachability: Reachability, code: int) -> None:
    assert REACHABILITY_CODES[reachability] == code
    assert f"\nlibp2p_autonat_reachability_status {code}.0\n" in scrape(relay_node(reachability=reachability))


def test_a_relay_that_counts_fewer_circuits_ever_than_open_says_none_closed_not_a_negative() -> None:
    node = relay_node()
    node.relay_service.admission.circuit_count = 20  # past circuits_total (12): the counts are read apart
    assert '\nlibp2p_relaysvc_connections_total{type="closed"} 0.0\n' in scrape(node)


def test_a_fresh_relay_counts_each_kind_and_limit_as_zero_and_answers_nothing_yet() -> None:
    relay = SimpleNamespace(stats=RelayStats(), admission=SimpleNamespace(circuit_count=0, slots={}),
                            config=SimpleNamespace(max_reservations=128, max_circuits=16))
    samples = [line for line in scrape(relay_node(relay_service=relay)).splitlines()
               if line.startswith(("libp2p_relaysvc", "dedloc_relaysvc"))]
    assert samples == [
        "libp2p_relaysvc_status 1.0",
        'libp2p_relaysvc_reservations_total{type="opened"} 0.0',
        'libp2p_relaysvc_reservations_total{type="renewed"} 0.0',
        'libp2p_relaysvc_connections_total{type="opened"} 0.0',
        'libp2p_relaysvc_connections_total{type="closed"} 0.0',
        "libp2p_relaysvc_data_transferred_bytes_total 0.0",
        'dedloc_relaysvc_slots{kind="reservations",value="used"} 0.0',
        'dedloc_relaysvc_slots{kind="reservations",value="limit"} 128.0',
        'dedloc_relaysvc_slots{kind="circuits",value="used"} 0.0',
        'dedloc_relaysvc_slots{kind="circuits",value="limit"} 16.0',
        'dedloc_relaysvc_circuits_cut_total{limit="data"} 0.0',
        'dedloc_relaysvc_circuits_cut_total{limit="duration"} 0.0',
        "dedloc_relaysvc_reservations_reclaimed_total 0.0",
    ]
