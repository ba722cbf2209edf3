"""What both training bench workers share: the model, the data, the measure (stdlib + torch only).

The model is a plain MLP (no transformers, so hivemind's venv runs the very
same one); every peer draws its own synthetic batches of a fixed regression
task. A worker trains until ``--steps`` global steps after a warm-up step and
prints one JSON line: its samples, wall time and compute time (forward and
backward) over the measured steps, and how long each ``step()`` call that
began a global step took.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch


def model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 1))


def batch(generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 256, generator=generator)
    return x, x[:, :8].sum(dim=1, keepdim=True).sin()


def worker_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    p.add_argument("--steps", type=int, default=10, help="measured global steps (after one warm-up step)")
    p.add_argument("--target", type=int, default=1024, help="global batch")
    p.add_argument("--batch", type=int, default=32, help="local batch")
    p.add_argument("--width", type=int, default=1024, help="MLP width (width^2 + 257 width parameters)")
    p.add_argument("--peers", type=int, default=4, help="peers in the run")
    p.add_argument("--matchmaking-time", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=120.0)
    return p


@dataclass
class Measure:
    """A worker's account: compute (forward + backward) against wall time, from the warm-up step on."""

    started: float | None = None
    compute: float = 0.0
    samples: int = 0
    step_calls: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def begin(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def result(self, steps: int) -> dict[str, Any]:
        wall = time.perf_counter() - (self.started or time.perf_counter())
        return {"steps": steps, "wall": wall, "compute": self.compute, "samples": self.samples,
                "step_calls": self.step_calls, "loss_first": self.losses[0] if self.losses else None,
                "loss_last": self.losses[-1] if self.losses else None}
