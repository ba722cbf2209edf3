"""Whether tensors hold only finite values, at the speed of one summing pass.

``torch.isfinite(t).all()`` builds a bool tensor and scans it: 1.2 GB/s on
one core here, which made it the largest single cost of an unshaped round
(0.2 s of a peer's 0.5 CPU-seconds for 40 MB: the averager's check of the
input, the reducer's of every contribution, the sender's of every average).
A sum runs at 31 GB/s, and NaN and Inf survive it (NaN + x is NaN, Inf + x
is Inf or NaN), so a finite sum proves every value finite. Only a sum that
overflows (values near float32's 3.4e38, or float16's 65504) is not proof
either way; then the exact check decides.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def tensor_finite(values: torch.Tensor) -> bool:
    """True when no value of ``values`` is NaN or +-Inf (any device, any floating dtype)."""
    if values.numel() == 0 or not values.is_floating_point():
        return True
    if bool(torch.isfinite(values.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(values).all())


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every tensor is :func:`tensor_finite`.

    One fused pass per device: ``torch._foreach_norm`` (what ``clip_grad_norm_``
    uses) gives every tensor's 2-norm in float32 from a few kernels, read with
    one ``bool()``. A sum per tensor launched a kernel each: on a GPU a model's
    200 gradients cost 200 launches in the caller's thread (the training
    peer's event loop, after every micro-batch) where this costs a handful,
    and on the CPU the two run at the same speed (3.6 against 3.9 ms for
    17.6 M values over 198 tensors here). A finite norm proves every value
    finite as a finite sum does (squares are never negative: nothing cancels
    an Inf, and NaN spreads); a norm that overflows (values beyond ~1e19) is
    no proof either way, and the exact check decides.
    """
    # per device, and per the dtype the norms are taken in: float32, or float64's own (a norm may
    # not narrow its input)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() and t.is_floating_point():
            groups.setdefault((t.device, torch.float64 if t.dtype == torch.float64 else torch.float32), []).append(t)
    for (_, dtype), group in groups.items():
        norms = torch.stack(torch._foreach_norm(group, dtype=dtype))
        if not bool(torch.isfinite(norms).all()) and not all(bool(torch.isfinite(t).all()) for t in group):
            return False
    return True


__all__ = ["all_finite", "tensor_finite"]
