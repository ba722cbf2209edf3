"""Prometheus families of a training run (``dedloc_training_*``): the global step, samples per second,
loss and alive peers as the progress tracker last read them, and this peer's own part when it trains.
Read at scrape time; with ``--metrics`` on ``dedloc train`` (and the averaging families of its
averager) and on ``dedloc backbone``."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .optimizer import CollaborativeOptimizer
from .progress import ProgressTracker


class TrainingMetrics(Collector):
    """The run as ``tracker`` sees it; ``optimizer``: this peer's own step, rate, loss and dropped batches."""

    def __init__(self, tracker: ProgressTracker, optimizer: CollaborativeOptimizer | None = None) -> None:
        self._tracker = tracker
        self._optimizer = optimizer

    def collect(self) -> Iterator[Metric]:
        p = self._tracker.last
        opt = self._optimizer
        step = GaugeMetricFamily("dedloc_training_global_step", "The global step under way (the swarm's)")
        rate = GaugeMetricFamily("dedloc_training_samples_per_second", "Samples per second", labels=["scope"])
        loss = GaugeMetricFamily("dedloc_training_loss", "Mean loss of recent batches", labels=["scope"])
        peers = GaugeMetricFamily("dedloc_training_alive_peers", "Peers reporting progress", labels=["kind"])
        samples = GaugeMetricFamily("dedloc_training_samples", "Samples toward the step under way", labels=["scope"])
        target = GaugeMetricFamily("dedloc_training_target_batch_size", "Samples a global step takes")
        target.add_metric([], self._tracker.target)
        if p is not None:
            step.add_metric([], p.step)
            rate.add_metric(["swarm"], p.samples_per_second)
            if p.loss is not None:
                loss.add_metric(["swarm"], p.loss)
            peers.add_metric(["trainers"], p.peers)
            peers.add_metric(["auxiliaries"], p.auxiliaries)
            samples.add_metric(["swarm"], p.samples)
        yield from (step, target, peers)
        if opt is not None:
            local = GaugeMetricFamily("dedloc_training_local_step", "This peer's step")
            local.add_metric([], opt.local_step)
            yield local
            rate.add_metric(["local"], opt.samples_per_second)
            if opt.loss is not None:
                loss.add_metric(["local"], opt.loss)
            samples.add_metric(["local"], opt.samples)
            dropped = CounterMetricFamily("dedloc_training_dropped_batches", "Local batches dropped, by reason",
                                          labels=["reason"])
            dropped.add_metric(["non_finite"], opt.dropped_batches)
            dropped.add_metric(["overflow"], opt.overflows)
            yield dropped
        yield from (rate, loss, samples)


__all__ = ["TrainingMetrics"]
