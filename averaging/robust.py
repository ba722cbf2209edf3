"""Robust aggregation at a reducer: CenteredClip (Karimireddy, He and Jaggi, 2021), as BTARD (Gorbunov et
al., 2022) runs it inside the butterfly all-reduce, each reducer on its own part.

A mean follows any one contribution anywhere: one peer that sends its gradient
times 1000 moves the average by hundreds of honest gradients. CenteredClip moves
a center ``v`` toward each contribution by at most ``tau``::

    v <- v + sum_i w_i (x_i - v) min(1, tau / |x_i - v|) / sum_i w_i

a few times, starting from the coordinate-wise median (itself robust to fewer
than half bad contributions). Contributions within ``tau`` of the center count
in full, as in the mean; one far away counts only ``tau`` of its way, however
far it is. ``tau`` is relative by default: ``tau_factor`` times the median
distance of the contributions from the median, so honest contributions (most
of them, near each other) keep their weight and the scale of the gradients
needs no tuning. Contributions scaled by less than ``flag_below`` in the last
iteration are named (the round report's ``clipped``).

Pure torch, no I/O; the reducer (:class:`averaging.reduction.PartReduction`)
keeps each sender's chunk instead of a running sum when it is on (memory: one
chunk per sender in flight, instead of one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2p.errors import ConfigError


@dataclass(frozen=True)
class CenteredClipConfig:
    #: Absolute clipping radius; None: ``tau_factor`` x the median distance from the median.
    tau: float | None = None
    tau_factor: float = 1.0
    iterations: int = 10
    #: A contribution scaled below this (in the last iteration) is named in the report.
    flag_below: float = 0.5

    def validate(self) -> None:
        if self.tau is not None and not self.tau > 0:
            raise ConfigError(f"tau must be positive, got {self.tau}")
        if not self.tau_factor > 0:
            raise ConfigError(f"tau_factor must be positive, got {self.tau_factor}")
        if not 1 <= self.iterations <= 1000:
            raise ConfigError(f"iterations must be in 1 .. 1000, got {self.iterations}")
        if not 0 < self.flag_below <= 1:
            raise ConfigError(f"flag_below must be in (0, 1], got {self.flag_below}")


@dataclass
class ClipResult:
    center: torch.Tensor
    #: Per contribution, the factor its pull was scaled by in the last iteration (1: not clipped).
    scales: torch.Tensor
    tau: float


def centered_clip(values: torch.Tensor, weights: torch.Tensor, config: CenteredClipConfig) -> ClipResult:
    """The CenteredClip aggregate of the rows of ``values`` (n x d) with ``weights`` (n, >= 0, some > 0).
    Computed in float64 (a poisoned row of 1e30 must not overflow the distances)."""
    if values.dim() != 2 or weights.shape != (values.shape[0],):
        raise ValueError(f"values must be n x d and weights n, got {tuple(values.shape)} and {tuple(weights.shape)}")
    x = values.to(torch.float64)
    w = weights.to(torch.float64)
    if not bool((w >= 0).all()) or not float(w.sum()) > 0:
        raise ValueError("weights must be >= 0 with a positive sum")
    keep = w > 0
    x, w = x[keep], w[keep]
    center = x.median(dim=0).values if x.shape[0] > 2 else (x * w[:, None]).sum(0) / w.sum()
    distances = (x - center).norm(dim=1)
    tau = config.tau if config.tau is not None else config.tau_factor * float(distances.median())
    scales = torch.ones_like(w)
    if tau <= 0:  # all (or most) contributions equal: the median is the answer
        full = torch.ones(weights.shape[0], dtype=torch.float64)
        return ClipResult(center.to(values.dtype), full, tau)
    for _ in range(config.iterations):
        delta = x - center
        distances = delta.norm(dim=1)
        scales = torch.clamp(tau / distances.clamp_min(1e-300), max=1.0)
        center = center + (delta * (w * scales)[:, None]).sum(0) / w.sum()
    full = torch.ones(weights.shape[0], dtype=torch.float64)
    full[keep] = scales
    return ClipResult(center.to(values.dtype), full, tau)


__all__ = ["CenteredClipConfig", "ClipResult", "centered_clip"]
