"""training/metrics.py: the ``dedloc_training_*`` families read at scrape time from a progress
tracker's last reading and this peer's optimizer, checked to the byte (names, help, labels, values,
order), before any reading and without an optimizer too (the same families from a real training
run: tests/test_metrics.py's swarm)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from training.metrics import TrainingMetrics
from training.progress import GlobalProgress


def scrape(tracker: Any, optimizer: Any = None) -> str:
    registry = CollectorRegistry()
    registry.register(TrainingMetrics(tracker, optimizer))
    return generate_latest(registry).decode()


def progress(loss: float | None = 2.5) -> GlobalProgress:
    return GlobalProgress(step=7, samples=300, target=1024, peers_at_step=3, peers=4, samples_per_second=120.5,
                          contributors=3, quorum=1, time=0.0, loss=loss, auxiliaries=2)


def optimizer(loss: float | None = 3.25) -> SimpleNamespace:
    return SimpleNamespace(local_step=6, samples_per_second=40.0, loss=loss, samples=90, dropped_batches=5,
                           overflows=9)


def test_a_trainer_s_scrape_is_the_swarm_s_figures_then_its_own() -> None:
    assert scrape(SimpleNamespace(last=progress(), target=1024), optimizer()) == (
        "# HELP dedloc_training_global_step The global step under way (the swarm's)\n"
        "# TYPE dedloc_training_global_step gauge\n"
        "dedloc_training_global_step 7.0\n"
        "# HELP dedloc_training_target_batch_size Samples a global step takes\n"
        "# TYPE dedloc_training_target_batch_size gauge\n"
        "dedloc_training_target_batch_size 1024.0\n"
        "# HELP dedloc_training_alive_peers Peers reporting progress\n"
        "# TYPE dedloc_training_alive_peers gauge\n"
        'dedloc_training_alive_peers{kind="trainers"} 4.0\n'
        'dedloc_training_alive_peers{kind="auxiliaries"} 2.0\n'
        "# HELP dedloc_training_local_step This peer's step\n"
        "# TYPE dedloc_training_local_step gauge\n"
        "dedloc_training_local_step 6.0\n"
        "# HELP dedloc_training_dropped_batches_total Local batches dropped, by reason\n"
        "# TYPE dedloc_training_dropped_batches_total counter\n"
        'dedloc_training_dropped_batches_total{reason="non_finite"} 5.0\n'
        'dedloc_training_dropped_batches_total{reason="overflow"} 9.0\n'
        "# HELP dedloc_training_samples_per_second Samples per second\n"
        "# TYPE dedloc_training_samples_per_second gauge\n"
        'dedloc_training_samples_per_second{scope="swarm"} 120.5\n'
        'dedloc_training_samples_per_second{scope="local"} 40.0\n'
        "# HELP dedloc_training_loss Mean loss of recent batches\n"
        "# TYPE dedloc_training_loss gauge\n"
        'dedloc_training_loss{scope="swarm"} 2.5\n'
        'dedloc_training_loss{scope="local"} 3.25\n'
        "# HELP dedloc_training_samples Samples toward the step under way\n"
        "# TYPE dedloc_training_samples gauge\n"
        'dedloc_training_samples{scope="swarm"} 300.0\n'
        'dedloc_training_samples{scope="local"} 90.0\n'
    )


def samples(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def test_a_backbone_before_any_reading_shows_only_the_target() -> None:
    assert samples(scrape(SimpleNamespace(last=None, target=512))) == ["dedloc_training_target_batch_size 512.0"]


def test_a_backbone_s_scrape_is_the_swarm_s_figures_without_a_loss_nobody_reported() -> None:
    assert samples(scrape(SimpleNamespace(last=progress(loss=None), target=1024))) == [
        "dedloc_training_global_step 7.0", "dedloc_training_target_batch_size 1024.0",
        'dedloc_training_alive_peers{kind="trainers"} 4.0', 'dedloc_training_alive_peers{kind="auxiliaries"} 2.0',
        'dedloc_training_samples_per_second{scope="swarm"} 120.5', 'dedloc_training_samples{scope="swarm"} 300.0']


def test_a_trainer_without_a_loss_yet_and_before_any_reading_shows_its_own_figures() -> None:
    text = scrape(SimpleNamespace(last=None, target=1024), optimizer(loss=None))
    assert samples(text) == [
        "dedloc_training_target_batch_size 1024.0", "dedloc_training_local_step 6.0",
        'dedloc_training_dropped_batches_total{reason="non_finite"} 5.0',
        'dedloc_training_dropped_batches_total{reason="overflow"} 9.0',
        'dedloc_training_samples_per_second{scope="local"} 40.0', 'dedloc_training_samples{scope="local"} 90.0']
