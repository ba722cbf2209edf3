"""A round's arithmetic on host chunks, in pieces that torch runs on the calling thread.

ATen runs a CPU op on more than 32 Ki values (``at::internal::GRAIN_SIZE``) in
an OpenMP parallel region that wakes every intra-op thread: one per core
unless the process set fewer. The event loop does a few such ops per chunk
(the finite check, the weighted add, the division, the copies), tens of
thousands per round, each a memory-bound pass that one core does in
microseconds. Where the cores are busy, each region waits for its threads:
in a process training on a GPU beside a second peer on an H200 host's 16
cores, ~8 ms per op with torch's 16 threads against ~20 us with one, and a
740 MB round took 27-51 s where one thread took 2.3 s (the training bench's
``--probe-memory``, 2026-12-04; docs/AVERAGING.md). The averaging bench's
peers, in processes that only average, lost far less to it: 141 MB/s per
peer with 16 threads against 198 with one.

A library must not change its caller's torch threads (a process-wide setting
that the caller's own compute depends on), so the round's per-chunk ops come
here: each runs on pieces of at most :data:`PIECE` values, which ATen runs
serially on the calling thread with the same kernels as one op on the whole
(elementwise, so the same values). A thread of one intra-op thread (as the
benches' peers set) opens no region, and does each op whole. Large one-off ops
(flattening a round's tensors, unflattening its result) keep torch's threads.
"""

from __future__ import annotations

import torch

from .finite import tensor_finite

#: At most this many values per op: ATen's grain size, below which it opens no parallel region.
PIECE = 32 * 1024


def whole(n: int) -> bool:
    """Whether one op on ``n`` values opens no parallel region anyway: few values, or one intra-op
    thread on this thread (``torch.get_num_threads``: its OpenMP setting), where pieces only add calls
    (5-8% of a 400 MB round on the 2-core machine, whose bench peers run one thread)."""
    return n <= PIECE or torch.get_num_threads() == 1


def pieces(values: torch.Tensor) -> list[slice]:
    """The slices of a 1-D tensor that each op here runs on, in order, covering it: one slice of it all
    when one op is :func:`whole` or the tensor is off the host (a GPU's kernels open no OpenMP region),
    else slices of :data:`PIECE` values (the last one shorter). Every op on a round's host chunks
    loops over these, so the one rule lives here."""
    n = values.numel()
    if values.device.type != "cpu" or whole(n):
        return [slice(0, n)]
    return [slice(i, min(i + PIECE, n)) for i in range(0, n, PIECE)]


def finite(values: torch.Tensor) -> bool:
    """:func:`~averaging.finite.tensor_finite` of a 1-D chunk, piece by piece."""
    return all(tensor_finite(values[piece]) for piece in pieces(values))


def scaled(values: torch.Tensor, weight: float) -> torch.Tensor:
    """A new float32 tensor of ``values * weight`` (a 1-D chunk)."""
    out = torch.empty(values.numel(), dtype=torch.float32)
    for piece in pieces(values):
        torch.mul(values[piece], weight, out=out[piece])
    return out


def add_scaled_(total: torch.Tensor, values: torch.Tensor, weight: float) -> None:
    """``total += values * weight`` in place (1-D chunks of one length)."""
    for piece in pieces(total):
        total[piece].add_(values[piece], alpha=weight)


def divide_(total: torch.Tensor, by: float) -> torch.Tensor:
    """``total /= by`` in place; ``total``."""
    for piece in pieces(total):
        total[piece].div_(by)
    return total


def copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` (1-D chunks of one length; the dtype converted as torch's ``copy_`` does)."""
    for piece in pieces(dst):
        dst[piece].copy_(src[piece])


def copied(values: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a 1-D chunk."""
    out = torch.empty(values.numel(), dtype=torch.float32)
    copy_(out, values)
    return out


__all__ = ["PIECE", "add_scaled_", "copied", "copy_", "divide_", "finite", "pieces", "scaled", "whole"]
