"""averaging/metrics.py: each ``dedloc_averaging_*`` family fed by the averager's hook, checked by
its samples (names, help, buckets, labels, values), and a part's reason for being partial (the same
families from a real averaging round: tests/test_metrics.py's swarm)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from averaging import metrics
from averaging.allreduce import PartOutcome, RoundReport
from averaging.metrics import AveragingMetrics, partial_reason
from p2p.hooks import Registration

from .kit import numbered_peer_id


def part(n: int, *, sent: int = 0, received: int = 0, averaged: int = 4, partial: int = 0,
         left_out: dict[str, str] | None = None, not_averaged: str = "") -> PartOutcome:
    return PartOutcome(n, numbered_peer_id(n), 100, 4, averaged_chunks=averaged, partial_chunks=partial,
                       bytes_sent=sent, bytes_received=received, left_out=left_out or {}, not_averaged=not_averaged)


def report(*parts: PartOutcome, elapsed: float = 0.3) -> RoundReport:
    return RoundReport(b"g" * 16, [numbered_peer_id(1), numbered_peer_id(2)], 0, (0.5, 0.5), list(parts), elapsed)


def test_a_part_is_partial_for_its_lost_reducer_first_then_a_sender_left_out_else_its_chunks() -> None:
    assert partial_reason("reducer unreachable", {"peer": "stalled"}) == "reducer_lost"
    assert partial_reason("", {"peer": "stalled"}) == "sender_left_out"
    assert partial_reason("", {}) == "chunks_partial"


def test_the_families_are_named_and_described_with_their_buckets_and_both_round_outcomes_at_zero() -> None:
    registry = CollectorRegistry()
    AveragingMetrics(registry)
    text = generate_latest(registry).decode()
    for help_line in (
            "dedloc_averaging_matchmaking_seconds Time to form a group, by outcome",
            "dedloc_averaging_group_size Members of each group formed",
            "dedloc_averaging_round_seconds All-reduce round duration, by outcome",
            "dedloc_averaging_rounds_total All-reduce rounds, by outcome (complete or partial)",
            "dedloc_averaging_part_bytes Bytes this peer moved for one part of a round",
            "dedloc_averaging_partial_parts_total Parts averaged partially, by reason",
            "dedloc_averaging_bytes_total Bytes of averaging payload, by direction",
            "dedloc_averaging_matchmaking_failures_total Matchmakings that formed no group, by error"):
        assert f"# HELP {help_line}\n" in text
    assert 'dedloc_averaging_rounds_total{outcome="complete"} 0.0\n' in text
    assert 'dedloc_averaging_rounds_total{outcome="partial"} 0.0\n' in text
    assert metrics.SECONDS_BUCKETS == (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
    assert metrics.GROUP_BUCKETS == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
    assert metrics.BYTES_BUCKETS == (65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0, 67108864.0,
                                     268435456.0, 1073741824.0, 4294967296.0)
    assert 'dedloc_averaging_part_bytes_bucket{le="4.294967296e+09"} 0.0\n' in text
    assert 'dedloc_averaging_group_size_bucket{le="64.0"} 0.0\n' in text


def test_matchmaking_is_timed_by_outcome_with_the_group_s_size_and_a_failure_s_error() -> None:
    registry = CollectorRegistry()
    watcher = AveragingMetrics(registry)
    watcher.matchmade(0.7, 3)
    watcher.matchmade(0.2, 5)
    watcher.matchmaking_failed(4.0, "timeout")
    value = registry.get_sample_value
    assert value("dedloc_averaging_matchmaking_seconds_count", {"outcome": "formed"}) == 2
    assert value("dedloc_averaging_matchmaking_seconds_sum", {"outcome": "formed"}) == pytest.approx(0.9)
    assert value("dedloc_averaging_matchmaking_seconds_bucket", {"outcome": "formed", "le": "0.25"}) == 1
    assert value("dedloc_averaging_matchmaking_seconds_bucket", {"outcome": "failed", "le": "300.0"}) == 1  # ours
    assert value("dedloc_averaging_matchmaking_seconds_count", {"outcome": "failed"}) == 1
    assert value("dedloc_averaging_matchmaking_seconds_sum", {"outcome": "failed"}) == 4.0
    assert value("dedloc_averaging_group_size_sum") == 8 and value("dedloc_averaging_group_size_count") == 2
    assert value("dedloc_averaging_group_size_bucket", {"le": "3.0"}) == 1
    assert value("dedloc_averaging_matchmaking_failures_total", {"error": "timeout"}) == 1


def test_a_round_is_timed_and_counted_by_outcome_with_each_part_s_bytes_and_the_reason_of_each_partial_one() -> None:
    registry = CollectorRegistry()
    watcher = AveragingMetrics(registry)
    watcher.averaged(report(part(0, sent=100_000, received=30_000), part(1, sent=5, received=7), elapsed=0.3))
    watcher.averaged(report(part(0, sent=1, received=2, averaged=3, not_averaged="reducer gone"),
                            part(1, sent=10, received=20, partial=1, left_out={"x": "stalled"}),
                            part(2, sent=0, received=0, partial=1), elapsed=2.0))
    value = registry.get_sample_value
    assert value("dedloc_averaging_rounds_total", {"outcome": "complete"}) == 1
    assert value("dedloc_averaging_rounds_total", {"outcome": "partial"}) == 1
    assert value("dedloc_averaging_round_seconds_sum", {"outcome": "complete"}) == 0.3
    assert value("dedloc_averaging_round_seconds_sum", {"outcome": "partial"}) == 2.0
    assert value("dedloc_averaging_round_seconds_count", {"outcome": "partial"}) == 1
    assert value("dedloc_averaging_round_seconds_bucket", {"outcome": "partial", "le": "120.0"}) == 1  # ours
    assert value("dedloc_averaging_part_bytes_count") == 5  # one per part, each sent + received
    assert value("dedloc_averaging_part_bytes_sum") == 130_000 + 12 + 3 + 30 + 0
    assert value("dedloc_averaging_part_bytes_bucket", {"le": "65536.0"}) == 4
    assert value("dedloc_averaging_part_bytes_bucket", {"le": "262144.0"}) == 5
    for reason in ("reducer_lost", "sender_left_out", "chunks_partial"):
        assert value("dedloc_averaging_partial_parts_total", {"reason": reason}) == 1
    assert value("dedloc_averaging_bytes_total", {"direction": "sent"}) == 100_005 + 11
    assert value("dedloc_averaging_bytes_total", {"direction": "received"}) == 30_007 + 22


def test_install_is_the_averager_s_observe() -> None:
    observed: list[object] = []

    class Averager:
        def observe(self, observer: object) -> Registration:
            observed.append(observer)
            return Registration(observed.clear)

    watcher = AveragingMetrics(CollectorRegistry())
    with watcher.install(Averager()):  # type: ignore[arg-type]
        assert observed == [watcher]
    assert observed == []
