"""Prometheus families of averaging (``dedloc_averaging_*``): matchmaking time, group size, round
duration, bytes per part, partial parts by reason. Fed by the averager's lossless
:class:`~averaging.averager.RoundObserver` hook; registered in the ``--metrics`` dashboard's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from p2p.hooks import Registration

from .allreduce import RoundReport
from .averager import Averager, RoundObserver

#: Seconds: a loopback round's tens of milliseconds to a shaped link's minutes.
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
GROUP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
#: Bytes one part moved (sent + received) in a round: 64 KiB .. 4 GiB.
BYTES_BUCKETS = tuple(float(1 << k) for k in range(16, 33, 2))


def partial_reason(not_averaged: str, left_out: dict[str, str]) -> str:
    """A part's reason for being partial, as a label: its reducer gave no average back
    (``reducer_lost``), or the average left some sender out (``sender_left_out``)."""
    return "reducer_lost" if not_averaged else "sender_left_out" if left_out else "chunks_partial"


class AveragingMetrics(RoundObserver):
    """One averager's families in ``registry``; :meth:`install` for the block it runs in."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.matchmaking = Histogram("dedloc_averaging_matchmaking_seconds", "Time to form a group, by outcome",
                                     ["outcome"], registry=registry, buckets=SECONDS_BUCKETS)
        self.group_size = Histogram("dedloc_averaging_group_size", "Members of each group formed",
                                    registry=registry, buckets=GROUP_BUCKETS)
        self.round = Histogram("dedloc_averaging_round_seconds", "All-reduce round duration, by outcome",
                               ["outcome"], registry=registry, buckets=SECONDS_BUCKETS)
        self.rounds = Counter("dedloc_averaging_rounds", "All-reduce rounds, by outcome (complete or partial)",
                              ["outcome"], registry=registry)
        self.part_bytes = Histogram("dedloc_averaging_part_bytes", "Bytes this peer moved for one part of a round",
                                    registry=registry, buckets=BYTES_BUCKETS)
        self.partial_parts = Counter("dedloc_averaging_partial_parts", "Parts averaged partially, by reason",
                                     ["reason"], registry=registry)
        self.bytes = Counter("dedloc_averaging_bytes", "Bytes of averaging payload, by direction",
                             ["direction"], registry=registry)
        self.matchmaking_failures = Counter("dedloc_averaging_matchmaking_failures",
                                            "Matchmakings that formed no group, by error", ["error"], registry=registry)
        for outcome in ("complete", "partial"):
            self.rounds.labels(outcome)

    def install(self, averager: Averager) -> Registration:
        return averager.observe(self)

    def matchmade(self, seconds: float, group_size: int) -> None:
        self.matchmaking.labels("formed").observe(seconds)
        self.group_size.observe(group_size)

    def matchmaking_failed(self, seconds: float, reason: str) -> None:
        self.matchmaking.labels("failed").observe(seconds)
        self.matchmaking_failures.labels(reason).inc()

    def averaged(self, report: RoundReport) -> None:
        outcome = "complete" if report.complete else "partial"
        self.round.labels(outcome).observe(report.elapsed)
        self.rounds.labels(outcome).inc()
        for part in report.parts:
            self.part_bytes.observe(part.bytes_sent + part.bytes_received)
            if not part.complete:
                self.partial_parts.labels(partial_reason(part.not_averaged, part.left_out)).inc()
        self.bytes.labels("sent").inc(report.bytes_sent)
        self.bytes.labels("received").inc(report.bytes_received)


__all__ = ["AveragingMetrics", "partial_reason"]
