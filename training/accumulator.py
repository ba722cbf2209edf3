"""The gradients of one global step, summed over this peer's batches: torch only, no network.

After each local backward pass, :meth:`GradientAccumulator.add` takes the
parameters' ``.grad`` (means over the batch) and adds them weighted by the
batch's sample count, so the accumulator holds the *sum* of per-sample
gradients; :meth:`GradientAccumulator.mean` divides by the samples for the
round. A batch whose gradients hold NaN or Inf is dropped, and said so.

Mixed precision: with the caller's ``torch.amp.GradScaler`` each batch is
unscaled as it is added; a batch that overflowed is dropped and the scale
backs off, and it grows after ``growth_interval`` clean batches, as
``GradScaler.step``/``update`` would (their own ``step`` never runs here):
only unscaled float32 gradients are averaged, so peers with different scales
(or none) step alike.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from averaging.finite import all_finite

log = logging.getLogger(__name__)


class GradientAccumulator:
    """The sum of per-sample gradients of ``params`` since the last :meth:`zero`."""

    def __init__(self, params: Sequence[torch.Tensor], scaler: torch.amp.GradScaler | None = None) -> None:
        self.params = list(params)
        #: the caller's loss scaler, whose scale we unscale by, back off and grow (None: no mixed precision)
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._sums = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        #: samples added since the last zero()
        self.samples = 0
        #: batches refused for NaN/Inf gradients (overflows included)
        self.dropped_batches = 0
        #: batches dropped because their scaled gradients overflowed (the scale backed off)
        self.overflows = 0
        self._clean_batches = 0  # since the scale last changed

    def add(self, batch_size: int) -> bool:
        """Take the parameters' gradients of one batch of ``batch_size`` samples (and zero them);
        whether they were kept (False: NaN/Inf, dropped)."""
        grads = [p.grad for p in self.params]
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        kept = all_finite([g for g in grads if g is not None])
        if not kept:
            self.dropped_batches += 1
            if self.scaler is not None:
                self._rescale(overflowed=True)
                log.info("dropped a batch of %d samples: its gradients overflowed at loss scale %g "
                         "(the scale backs off to %g)", batch_size, scale, self.scaler.get_scale())
            else:
                log.warning("dropped a batch of %d samples: its gradients hold NaN or Inf (the others are kept)",
                            batch_size)
        else:
            present = [(acc, g.to(acc.dtype)) for acc, g in zip(self._sums, grads) if g is not None]
            if present:
                with torch.no_grad():
                    # one fused add for every parameter: on a GPU a kernel launch per parameter (200 for
                    # the example model) cost the event loop that calls this after every micro-batch
                    torch._foreach_add_([a for a, _ in present], [g for _, g in present],
                                        alpha=float(batch_size) / scale)
            self.samples += batch_size
            if self.scaler is not None:
                self._rescale(overflowed=False)
        for p in self.params:
            p.grad = None
        return kept

    def mean(self) -> list[torch.Tensor]:
        """The mean gradient over the samples added (zeros without any), on the accumulator's device:
        on a GPU it stays there, and the averager stages it to the network itself, chunk by chunk
        without blocking (averaging.staging)."""
        with torch.no_grad():
            return [acc / self.samples if self.samples else torch.zeros_like(acc) for acc in self._sums]

    def zero(self) -> None:
        self.samples = 0
        for acc in self._sums:
            acc.zero_()

    def _rescale(self, *, overflowed: bool) -> None:
        """GradScaler's dynamic loss scale: back off on an overflow, grow after
        ``growth_interval`` clean batches in a row."""
        assert self.scaler is not None
        if self.scaler._scale is None:  # GradScaler's own check is an AssertionError
            raise ValueError("the GradScaler given to the optimizer never scaled a loss: "
                             "use scaler.scale(loss).backward()")
        if overflowed:
            self.overflows += 1
            self._clean_batches = 0
            self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
            return
        self._clean_batches += 1
        if self._clean_batches >= self.scaler.get_growth_interval():
            self._clean_batches = 0
            grown = self.scaler.get_scale() * self.scaler.get_growth_factor()
            if math.isfinite(grown) and grown < torch.finfo(torch.float32).max:
                self.scaler.update(grown)


__all__ = ["GradientAccumulator"]
