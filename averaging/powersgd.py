"""PowerSGD: low-rank gradient averaging with error feedback (Vogels et al., 2019), over an Averager.

Each gradient of at least two dimensions is seen as a matrix M (n x m, the
first dimension by the rest) and sent as two thin factors instead of n*m
values, in two all-reduce phases of one group:

1. ``M <- grad + e`` (e: what earlier steps left unsent, the error feedback);
   ``P = M Q``; phase 0 averages every P and, uncompressed, the tensors that
   are too small or flat to gain (biases, norms);
2. P is orthonormalised (QR); ``Q = M^T P``; phase 1 averages every Q;
3. the average is ``P Q^T``, written into the gradient; ``e <- M - P Q^T``.

Both phases run in one group (``Averager.matchmake`` once, then
``average_in`` with phase 0 and 1): P and Q must be averaged by the same
members, or ``P Q^T`` is no average at all. Q starts each step from a random
matrix seeded by the group id, so every member uses the same one without
another round. (The paper reuses the last step's Q, a warm start; in a swarm
the groups change from step to step, and members whose Q differ would average
meaningless P's. Error feedback makes up for the single power iteration.)

The factors go through the averager's own chunk codec, so float16 or 8-bit
compression stacks on top. :class:`PowerSGDReport` gives the bytes moved
against what a plain float32 round would have moved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2p.errors import ConfigError
from .allreduce import RoundReport
from .averager import Averager
from .finite import all_finite

PURPOSE = "powersgd"


@dataclass(frozen=True)
class PowerSGDConfig:
    """``rank``: columns of the factors. A matrix is compressed only when its factors hold at most
    ``max_ratio`` of its values, r(n + m) <= max_ratio * n * m; the rest travel whole."""

    rank: int = 4
    max_ratio: float = 0.5

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError("rank must be >= 1")
        if not 0 < self.max_ratio <= 1:
            raise ConfigError("max_ratio must be in (0, 1]")


@dataclass
class PowerSGDReport:
    """Both phases' reports, and the bytes against a plain float32 round of the same gradients."""

    phases: tuple[RoundReport, RoundReport]
    compressed: int  # how many tensors went as factors
    plain_bytes: int  # float32 bytes of the gradients: what a plain round sends per peer, roughly

    @property
    def complete(self) -> bool:
        return all(r.complete for r in self.phases)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.phases)

    @property
    def bytes_received(self) -> int:
        return sum(r.bytes_received for r in self.phases)


class PowerSGD:
    """Low-rank averaging of gradients with the shapes given, keeping the error-feedback buffers.

    ``step`` averages gradients in place (the weighted average over the
    group, rank-``r`` for the compressed ones) and returns the report. A
    round that fails or comes back partial raises, leaving the gradients and
    the error buffers as they were, so the step can be retried or skipped.
    """

    def __init__(self, averager: Averager, shapes: Sequence[torch.Size | tuple[int, ...]],
                 config: PowerSGDConfig | None = None) -> None:
        self.averager = averager
        self.config = config or PowerSGDConfig()
        self.config.validate()
        self.shapes = [torch.Size(s) for s in shapes]
        self.compressed = [self._compresses(s) for s in self.shapes]
        self.errors: list[torch.Tensor | None] = [
            torch.zeros(_matrix_shape(s)) if c else None for s, c in zip(self.shapes, self.compressed)]

    def _compresses(self, shape: torch.Size) -> bool:
        if len(shape) < 2:
            return False
        n, m = _matrix_shape(shape)
        return self._rank(shape) * (n + m) <= self.config.max_ratio * n * m

    def _rank(self, shape: torch.Size) -> int:
        return min(self.config.rank, *_matrix_shape(shape))

    def rank_of(self, i: int) -> int:
        return self._rank(self.shapes[i])

    async def step(self, grads: Sequence[torch.Tensor], weight: float = 1.0) -> PowerSGDReport:
        if [g.shape for g in grads] != self.shapes:
            raise ValueError(f"gradient shapes {[tuple(g.shape) for g in grads]} are not the ones PowerSGD was "
                             f"made for {[tuple(s) for s in self.shapes]}")
        if any(g.dtype != torch.float32 for g in grads):
            raise ValueError("PowerSGD averages float32 gradients")
        if not all_finite(grads):
            raise ValueError("the gradients hold NaN or Inf; refusing to average them")
        packed = [i for i, c in enumerate(self.compressed) if c]
        plain = [i for i, c in enumerate(self.compressed) if not c]
        ms: dict[int, torch.Tensor] = {}
        for i in packed:
            error = self.errors[i]
            assert error is not None
            ms[i] = grads[i].detach().reshape(error.shape) + error  # float32: checked above
        # Phase 0 needs Q, and Q needs the group: matchmake on the shapes of phase 0 first.
        ps = {i: torch.zeros(ms[i].shape[0], self.rank_of(i)) for i in packed}
        first = [ps[i] for i in packed] + [grads[i].detach().clone() for i in plain]
        group = await self.averager.matchmake(first, weight, purpose=PURPOSE)
        generator = torch.Generator().manual_seed(int.from_bytes(group.group_id[:8], "big"))
        for i in packed:
            q = torch.randn(ms[i].shape[1], self.rank_of(i), generator=generator)
            torch.matmul(ms[i], q, out=ps[i])
        phase0 = await self.averager.average_in(group, first, weight, phase=0)
        qs = {}
        for i in packed:
            p = torch.linalg.qr(ps[i]).Q
            ps[i] = p
            qs[i] = ms[i].t() @ p
        phase1 = await self.averager.average_in(group, [qs[i] for i in packed], weight, phase=1)
        # Both phases whole: only now are the gradients and the error buffers changed.
        for i in packed:
            approx = ps[i] @ qs[i].t()
            self.errors[i] = ms[i] - approx
            grads[i].detach().copy_(approx.reshape(grads[i].shape))
        for k, i in enumerate(plain):
            grads[i].detach().copy_(first[len(packed) + k])
        plain_bytes = 4 * sum(math.prod(s) for s in self.shapes)
        return PowerSGDReport((phase0, phase1), len(packed), plain_bytes)


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])
