"""``--metrics``: every documented Prometheus family scraped from a real 3-node loopback swarm, and a
limit hit showing in the metrics and in one ERROR line (the HTTP server itself: tests/test_http.py)."""

from __future__ import annotations

import logging
import re
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch
import trio
from prometheus_client.parser import text_string_to_metric_families

from averaging.averager import Averager
from averaging.metrics import AveragingMetrics, partial_reason
from nat import Peer
from nat.dashboard import Dashboard
from p2p.dialer import classify_dial_error
from p2p.errors import DialBackoffError, DialError
from p2p.identity import new_identity, peer_id_of
from p2p.metrics import blocked_labels, limit_labels
from p2p.node import Node
from p2p.resources import ResourceConfig, limits_hit
from training.metrics import TrainingMetrics
from training.optimizer import CollaborativeOptimizer, TrainingConfig
from training.progress import ProgressTracker

from .conftest import loopback_config
from .kit import http_get, loopback_peer_config, wait_until
from .test_averaging import config as averager_config, public

pytestmark = pytest.mark.timeout(120)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "OPERATORS.md"

#: Every family docs/OPERATORS.md lists, by the node that shows it in the test's swarm.
SWARM = ["libp2p_swarm_connections_opened_total", "libp2p_swarm_connections_closed_total",
         "libp2p_swarm_connection_duration_seconds", "libp2p_swarm_handshake_latency_seconds",
         "libp2p_swarm_dial_errors_total", "dedloc_swarm_dials_backed_off_total", "dedloc_swarm_peers",
         "dedloc_connmgr_trimmed_total", "dedloc_connmgr_protected_peers", "dedloc_peerstore_peers",
         "dedloc_peerstore_forgotten_total"]
RCMGR = ["libp2p_rcmgr_connections", "libp2p_rcmgr_streams", "libp2p_rcmgr_memory", "libp2p_rcmgr_blocked_resources",
         "libp2p_rcmgr_limit"]
NAT = ["libp2p_holepunch_direct_dials_total", "libp2p_holepunch_outcomes_total", "libp2p_autonat_reachability_status",
       "libp2p_autonat_reachability_status_confidence", "libp2p_autonat_received_dial_response_total",
       "libp2p_autonat_outgoing_dial_response_total", "libp2p_autonat_outgoing_dial_refused_total",
       "dedloc_nat_mode", "dedloc_nat_mapping", "dedloc_nat_relay_reservations", "dedloc_nat_connection_bytes_total"]
RELAY = ["libp2p_relaysvc_status", "libp2p_relaysvc_reservations_total",
         "libp2p_relaysvc_reservation_request_response_status_total", "libp2p_relaysvc_reservation_rejections_total",
         "libp2p_relaysvc_connections_total", "libp2p_relaysvc_connection_request_response_status_total",
         "libp2p_relaysvc_connection_rejections_total", "libp2p_relaysvc_data_transferred_bytes_total",
         "dedloc_relaysvc_slots", "dedloc_relaysvc_circuits_cut_total", "dedloc_relaysvc_reservations_reclaimed_total"]
DHT = ["dedloc_dht_query_duration_seconds", "dedloc_dht_queries_total", "dedloc_dht_server",
       "dedloc_dht_routing_table_peers", "dedloc_dht_records", "dedloc_dht_stored_bytes",
       "dedloc_dht_inbound_requests_total"]
AVERAGING = ["dedloc_averaging_matchmaking_seconds", "dedloc_averaging_group_size", "dedloc_averaging_round_seconds",
             "dedloc_averaging_rounds_total", "dedloc_averaging_part_bytes", "dedloc_averaging_partial_parts_total",
             "dedloc_averaging_bytes_total", "dedloc_averaging_matchmaking_failures_total"]
TRAINING = ["dedloc_training_global_step", "dedloc_training_target_batch_size", "dedloc_training_alive_peers",
            "dedloc_training_samples_per_second", "dedloc_training_loss", "dedloc_training_samples"]
TRAINER = ["dedloc_training_local_step", "dedloc_training_dropped_batches_total"]
PROCESS = ["process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"]


def families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Parse the exposition text strictly; family name (counters with their ``_total``) -> samples."""
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if types.get(family.name + "_total") == "counter" or (
            family.type == "counter" and family.name + "_total" in text) else family.name
        out[name] = [(s.name, s.labels, s.value) for s in family.samples]
    return out


def value(fams: dict[str, list[tuple[str, dict[str, str], float]]], name: str, **labels: str) -> float:
    family = name.removesuffix("_count").removesuffix("_sum")
    return sum(v for sample, ls, v in fams[family]
               if sample in (name, name.removesuffix("_total") + "_total") and all(ls.get(k) == x for k, x in labels.items()))


# ---------------------------------------------------------------------- pure parts


def test_labels_follow_go_libp2p() -> None:
    assert limit_labels("inbound_streams_per_peer") == ("peer", "inbound_streams")
    assert limit_labels("inbound_streams_per_peer_protocol") == ("peer_protocol", "inbound_streams")
    assert limit_labels("handshaking_per_subnet") == ("transient", "handshaking_per_subnet")
    assert limit_labels("memory_bytes") == ("system", "memory_bytes")
    assert limit_labels("rate.dht_per_s") == ("service", "dht_per_s")
    assert blocked_labels("admission.handshaking_total") == ("transient", "handshaking_total")
    assert blocked_labels("peer.inbound_streams") == ("peer", "inbound_streams")
    assert classify_dial_error("/ip4/10.0.0.1/tcp/4001/p2p/x", "timed out after 5s") == ("tcp", "deadline", "ip4")
    assert classify_dial_error("/ip6/::1/tcp/1", "[Errno 111] Connection refused") == ("tcp", "connection_refused", "ip6")
    assert classify_dial_error("/ip4/1.2.3.4/tcp/1/p2p/r/p2p-circuit/p2p/x", "NO_RESERVATION")[0] == "circuit"
    assert partial_reason("reducer unreachable", {}) == "reducer_lost"
    assert partial_reason("", {"peer": "stalled"}) == "sender_left_out"


def test_limits_hit_are_the_counts_that_grew() -> None:
    assert limits_hit({"peer.inbound_streams": 3}, {"peer.inbound_streams": 5, "admission.evicted": 1}) == [
        ("admission.evicted", 1), ("peer.inbound_streams", 2)]
    assert limits_hit({"x": 2}, {"x": 2}) == []


# ---------------------------------------------------------------------- a real swarm


async def test_a_three_node_swarm_shows_every_documented_family_with_its_figures() -> None:
    scraped: dict[str, dict[str, list[tuple[str, dict[str, str], float]]]] = {}
    async with AsyncExitStack() as stack:
        # the relay's dashboard first: it sees the peers join
        relay = await stack.enter_async_context(Peer.open(loopback_peer_config(relay=True)))
        d_relay = await stack.enter_async_context(Dashboard.serve(relay, "127.0.0.1:0", role="backbone"))
        boot = [str(relay.addrs[0])]
        a = await stack.enter_async_context(Peer.open(loopback_peer_config(initial_peers=boot)))
        d_a = await stack.enter_async_context(Dashboard.serve(a, "127.0.0.1:0"))
        b = await stack.enter_async_context(Peer.open(loopback_peer_config(initial_peers=boot)))
        d_b = await stack.enter_async_context(Dashboard.serve(b, "127.0.0.1:0"))
        await public([a, b])
        # a dial that works (a handshake to time) and one that cannot (a dial error)
        other = await stack.enter_async_context(Node.open(loopback_config()))
        await a.node.connect(str(other.addrs[0]))
        nowhere = f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id_of(new_identity())}"
        with pytest.raises(DialError):
            await a.node.connect(nowhere, timeout=2)
        with pytest.raises(DialBackoffError):
            await a.node.connect(nowhere, timeout=2)  # not dialed: its address waits out its backoff
        cfg = averager_config(2)
        async with Averager.open(a, cfg) as av_a, Averager.open(b, cfg) as av_b:
            with AveragingMetrics(d_a.registry).install(av_a), AveragingMetrics(d_b.registry).install(av_b):
                async with trio.open_nursery() as nursery:
                    for av, x in ((av_a, 1.0), (av_b, 3.0)):
                        nursery.start_soon(av.step, [torch.full((1000,), x)])
        # a trainer (a real optimizer on a tiny model) and the backbone's tracker of its run
        model = torch.nn.Linear(4, 1)
        run = TrainingConfig(run_id="metrics-run", target_batch_size=1000, report_interval=0.2)
        async with CollaborativeOptimizer.open(a, torch.optim.SGD(model.parameters(), lr=0.1), run) as opt:
            d_a.registry.register(TrainingMetrics(opt.tracker, opt))
            model(torch.ones(8, 4)).sum().backward()
            await opt.step(8, loss=0.5)
            tracker = ProgressTracker(relay, "metrics-run", 1000)
            d_relay.registry.register(TrainingMetrics(tracker))
            for _ in range(100):
                if (await tracker.fetch()).peers == 1 and tracker.reports[0].samples == 8:
                    break
                await trio.sleep(0.2)
            for name, d in (("relay", d_relay), ("a", d_a), ("b", d_b)):
                assert d.address is not None
                status, headers, body = await http_get(d.address, "/metrics")
                assert status == 200 and headers["content-type"].startswith("text/plain; version=")
                scraped[name] = families(body.decode())
    documented = DOCS.read_text()
    every = SWARM + RCMGR + NAT + RELAY + DHT + AVERAGING + TRAINING + TRAINER + PROCESS
    missing_docs = [f for f in every if f"`{f}`" not in documented]
    assert not missing_docs, f"docs/OPERATORS.md does not list {missing_docs}"
    expected = {"relay": SWARM + RCMGR + NAT + RELAY + DHT + TRAINING + PROCESS,
                "a": SWARM + RCMGR + NAT + DHT + AVERAGING + TRAINING + TRAINER + PROCESS,
                "b": SWARM + RCMGR + NAT + DHT + AVERAGING + PROCESS}
    for node, names in expected.items():
        absent = [f for f in names if f not in scraped[node]]
        assert not absent, f"{node}'s scrape lacks {absent}"
    r, fa, fb = scraped["relay"], scraped["a"], scraped["b"]
    # the figures are the swarm's own
    assert value(r, "libp2p_swarm_connections_opened_total", dir="inbound", transport="tcp") >= 2
    assert value(fa, "libp2p_swarm_connections_opened_total", dir="outbound") >= 1
    assert value(fa, "libp2p_swarm_handshake_latency_seconds_count") >= 1
    assert value(fa, "libp2p_swarm_dial_errors_total", transport="tcp", ip_version="ip4") == 1
    assert value(fa, "dedloc_swarm_dials_backed_off_total") == 1
    assert value(fa, "dedloc_connmgr_trimmed_total") == 0  # three peers: far below the high water
    assert value(fa, "dedloc_connmgr_protected_peers") >= 1  # the relay holding a's slot
    assert value(fa, "dedloc_peerstore_peers") >= 2 and value(fa, "dedloc_peerstore_forgotten_total") == 0
    assert value(r, "libp2p_relaysvc_status") == 1
    # a and b reserve a slot while their reachability is unknown: every slot granted was answered OK
    assert value(r, "libp2p_relaysvc_reservations_total", type="opened") >= 1
    assert value(r, "libp2p_relaysvc_reservations_total") == value(
        r, "libp2p_relaysvc_reservation_request_response_status_total", status="OK")
    assert value(r, "libp2p_autonat_outgoing_dial_response_total", response_status="OK") >= 2  # it confirmed a and b
    assert value(fa, "libp2p_autonat_reachability_status") == 1  # public
    assert value(r, "dedloc_dht_server") == 1 and value(r, "dedloc_dht_routing_table_peers") >= 2
    assert value(r, "dedloc_dht_inbound_requests_total", type="store") >= 1
    assert value(fa, "dedloc_dht_queries_total", type="store") >= 1
    for f in (fa, fb):
        assert value(f, "dedloc_averaging_rounds_total", outcome="complete") == 1
        assert value(f, "dedloc_averaging_rounds_total", outcome="partial") == 0
        assert [v for s, ls, v in f["dedloc_averaging_group_size"] if s.endswith("_sum")] == [2.0]
        assert value(f, "dedloc_averaging_bytes_total", direction="sent") > 0
    assert value(fa, "dedloc_training_local_step") == 0 and value(fa, "dedloc_training_samples", scope="local") == 8
    assert value(fa, "dedloc_training_loss", scope="local") == 0.5
    assert value(r, "dedloc_training_alive_peers", kind="trainers") == 1
    assert value(r, "dedloc_training_target_batch_size") == 1000
    assert value(r, "libp2p_rcmgr_limit", scope="system", resource="inbound_connections") == 4096
    assert value(r, "process_resident_memory_bytes") > 0


async def test_a_limit_hit_shows_in_the_metrics_and_in_one_error_line_within_ten_seconds(
        caplog: pytest.LogCaptureFixture) -> None:
    resources = ResourceConfig(max_inbound_streams_per_peer_protocol=1, alarm_interval=1.0)
    caplog.set_level(logging.ERROR, logger="p2p.node")
    async with Node.open(loopback_config(resources=resources)) as server, Node.open(loopback_config()) as client:
        from p2p.metrics import resource_families

        held = trio.Event()

        async def hold(stream: object) -> None:
            await held.wait()

        server.set_stream_handler("/test/hold/1.0.0", hold)
        await client.connect(str(server.addrs[0]))
        first = await client.new_stream(server.peer_id, "/test/hold/1.0.0")
        refused = 0
        for _ in range(5):
            try:
                s = await client.new_stream(server.peer_id, "/test/hold/1.0.0")
                with trio.move_on_after(1):
                    await s.read(1)  # refused: the stream is reset
            except Exception:
                refused += 1
        started = trio.current_time()
        await wait_until(lambda: any("resource limit hit" in r.getMessage() for r in caplog.records), 10)
        assert trio.current_time() - started <= 10
        lines = [r for r in caplog.records if "resource limit hit" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.ERROR
        assert "peer_protocol.inbound_streams" in lines[0].getMessage()
        blocked = {tuple(s.labels.values()): s.value for f in resource_families(server.resources)
                   if f.name == "libp2p_rcmgr_blocked_resources" for s in f.samples}
        assert blocked[("inbound", "peer_protocol", "inbound_streams")] >= 1
        held.set()
        await first.close()
