"""Who reduces how much: DeDLOC's linear program (Appendix B, eq. 5 and 6), solved with HiGHS.

Inputs per member ``i`` (bytes/s and samples/s): upload ``u_i``, download
``d_i``, compute ``s_i``, and optional pairwise limits ``t_ij``. Variables:
``a_ij`` (rate of i sending its part-j values to reducer j), ``g_ij`` (rate of
reducer i returning averages to j), ``c_i`` in [0, 1] (i contributes values),
and ``xi``, the rate at which the slowest receiver gets the whole vector::

    max xi
    s.t. xi <= sum_i s_i c_i / B                      (only with a batch size B)
         xi <= sum_j g_ji / P                         for every receiver i
         g_ij <= r_i                                  for all i, j
         r_i  <= a_ki + (1 - c_k) D                   for all i, k (senders)
         sum_{j != i} (a_ji + g_ji) <= d_i            for all i
         sum_{j != i} (a_ij + g_ij) <= u_i            for all i
         a_ij + g_ij <= t_ij                          where t_ij is known

``r_i`` replaces the paper's n^3 constraints ``g_ij <= a_ki + (1 - c_k) d_i``
by 2n^2 equivalent ones (the same feasible set for ``g``). Transfers within one
peer (``a_ii``, ``g_ii``) cost no bandwidth. Roles fix variables: a sender-only
peer (client mode, relayed) has ``a_ki = g_ij = 0``; an auxiliary peer sends
nothing and needs no average (``c_i = 0``, no receiver constraint). Without
a batch size the compute term is left out and ``c_i`` is 1 for every peer
with tensors. Fractions follow eq. 6: ``fraction_i ∝ min_j g_ij`` over the
receivers ``j``.

``c_i`` is the paper's binary indicator relaxed to [0, 1]. The relaxation is
not exact: where the optimum leaves some ``c_k`` fractional, the compute term
counts part of peer k's samples while (4) already lets the others stop
waiting for it. As the paper reads it, a peer contributes only at
``c_k = 1`` (:attr:`Balance.contributes`), and ``xi`` is then an upper bound.
The averager does not pass a batch size (it splits the vector; who computes
is the trainer's role), so its rounds never meet this.

Every member solves the same problem from the same inputs (the group's
declarations, in group order) with the same deterministic method (HiGHS dual
simplex), so they agree on the partition without another message; the
all-reduce headers carry each part's bounds, so a disagreement fails loudly.
Unknown bandwidths (0) are taken as the largest known one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, csr_matrix

#: Used for unknown bandwidths when no member knows its own.
DEFAULT_BANDWIDTH = 100e6 / 8


@dataclass(frozen=True)
class Capacity:
    """What one member brings: bytes/s both ways, samples/s, and what it may do."""

    upload: float = 0.0
    download: float = 0.0
    compute: float = 0.0
    sends: bool = True      # has tensors of its own (False for an auxiliary peer)
    reduces: bool = True    # may reduce a part (False for client-mode and relayed peers)


@dataclass(frozen=True)
class Balance:
    """The solution: one fraction per member, the predicted rate, and the solve time."""

    fractions: tuple[float, ...]
    rounds_per_second: float  # xi: how often the slowest receiver could get the whole vector
    contributes: tuple[bool, ...]
    solve_seconds: float

    @property
    def predicted_seconds(self) -> float:
        """The round time the LP predicts at the declared bandwidths."""
        return 1.0 / self.rounds_per_second if self.rounds_per_second > 0 else math.inf


def equal_fractions(capacities: Sequence[Capacity]) -> tuple[float, ...]:
    """Equal shares among the members that may reduce (the plain butterfly)."""
    reducers = sum(1 for c in capacities if c.reduces)
    if reducers == 0:
        raise ValueError("no member may reduce")
    return tuple((1.0 / reducers) if c.reduces else 0.0 for c in capacities)


def split_seconds(capacities: Sequence[Capacity], fractions: Sequence[float], vector_bytes: int) -> float:
    """The round time a split would take on full-duplex links: the busiest link's bytes over its rate.

    Member i moves (1 - f_i) S each way as a sender (when it has tensors) and
    f_i S times the other senders each way as a reducer. Used to compare
    splits on the same figures (the LP's against the equal one), not to
    predict a round: latency, pair limits and compute are left out.
    """
    up = _filled([c.upload for c in capacities])
    down = _filled([c.download for c in capacities])
    senders = sum(1 for c in capacities if c.sends)
    worst = 0.0
    for c, f, u, d in zip(capacities, fractions, up, down):
        load = vector_bytes * ((1.0 - f if c.sends else 0.0) + f * (senders - (1 if c.sends else 0)))
        worst = max(worst, load / u, load / d)
    return worst


def _filled(values: list[float]) -> list[float]:
    known = [v for v in values if v > 0 and math.isfinite(v)]
    fallback = max(known) if known else DEFAULT_BANDWIDTH
    return [v if v > 0 and math.isfinite(v) else fallback for v in values]


def _sparse(rows: Sequence[tuple[dict[int, float], float]], width: int) -> csr_matrix:
    r = [i for i, (coefs, _) in enumerate(rows) for _ in coefs]
    c = [col for coefs, _ in rows for col in coefs]
    v = [value for coefs, _ in rows for value in coefs.values()]
    return coo_matrix((np.array(v), (np.array(r), np.array(c))), shape=(len(rows), width)).tocsr()


def balance(capacities: Sequence[Capacity], vector_bytes: int, *,
            pair_limits: Sequence[Sequence[float]] | None = None,
            batch_size: float | None = None) -> Balance:
    """Solve eq. 5 for these members and return eq. 6's fractions."""
    started = time.perf_counter()
    n = len(capacities)
    if n == 0:
        raise ValueError("no members")
    if not any(c.reduces for c in capacities):
        raise ValueError("no member may reduce")
    # Members with tensors both send them and need the average back.
    receivers = senders = [i for i in range(n) if capacities[i].sends]
    if not senders:  # nobody has tensors: nothing to average (and nothing bounds the LP)
        return Balance(equal_fractions(capacities), math.inf, (False,) * n, time.perf_counter() - started)
    if len(senders) == 1 and capacities[senders[0]].reduces:
        # One member has tensors and may reduce them: it averages its own vector and nothing crosses a
        # link (the LP is unbounded there: a transfer within one peer costs no bandwidth).
        alone = tuple(i == senders[0] for i in range(n))
        return Balance(tuple(float(x) for x in alone), math.inf, alone, time.perf_counter() - started)
    up = _filled([c.upload for c in capacities])
    down = _filled([c.download for c in capacities])
    big = 4.0 * max(max(up), max(down))  # D in r_i <= a_ki + (1 - c_k) D: never binding when c_k = 0
    size = float(max(vector_bytes, 1))
    use_compute = batch_size is not None and batch_size > 0

    # variable layout: a (n*n), g (n*n), r (n), c (n), xi
    def a(i: int, j: int) -> int:
        return i * n + j

    def g(i: int, j: int) -> int:
        return n * n + i * n + j

    def r(i: int) -> int:
        return 2 * n * n + i

    def c(i: int) -> int:
        return 2 * n * n + n + i

    xi = 2 * n * n + 2 * n
    nvar = xi + 1
    rows: list[tuple[dict[int, float], float]] = []
    if use_compute:
        assert batch_size is not None
        rows.append(({xi: 1.0, **{c(i): -capacities[i].compute / batch_size for i in range(n)}}, 0.0))
    for i in receivers:
        rows.append(({xi: 1.0, **{g(j, i): -1.0 / size for j in range(n)}}, 0.0))
    for i in range(n):
        for j in range(n):
            rows.append(({g(i, j): 1.0, r(i): -1.0}, 0.0))
        for k in senders:
            rows.append(({r(i): 1.0, a(k, i): -1.0, c(k): big}, big))
        rows.append(({**{a(j, i): 1.0 for j in range(n) if j != i}, **{g(j, i): 1.0 for j in range(n) if j != i}},
                     down[i]))
        rows.append(({**{a(i, j): 1.0 for j in range(n) if j != i}, **{g(i, j): 1.0 for j in range(n) if j != i}},
                     up[i]))
    if pair_limits is not None:
        for i in range(n):
            for j in range(n):
                t = pair_limits[i][j]
                if i != j and t > 0 and math.isfinite(t):
                    rows.append(({a(i, j): 1.0, g(i, j): 1.0}, t))

    bounds: list[tuple[float, float | None]] = [(0.0, None)] * nvar
    for i in range(n):
        for j in range(n):
            if not capacities[j].reduces or not capacities[i].sends:
                bounds[a(i, j)] = (0.0, 0.0)
            if not capacities[i].reduces or not capacities[j].sends:
                bounds[g(i, j)] = (0.0, 0.0)
        if not capacities[i].reduces:
            bounds[r(i)] = (0.0, 0.0)
        if not capacities[i].sends:
            bounds[c(i)] = (0.0, 0.0)
        elif use_compute:
            bounds[c(i)] = (0.0, 1.0)
        else:
            bounds[c(i)] = (1.0, 1.0)

    matrix = _sparse(rows, nvar)
    rhs = np.array([limit for _, limit in rows])
    objective = np.zeros(nvar)
    objective[xi] = -1.0
    first = linprog(objective, A_ub=cast(Any, matrix), b_ub=rhs, bounds=bounds, method="highs-ds")
    if first.status != 0 or first.x is None:
        raise ValueError(f"load balancing LP failed: {first.message}")
    best = float(first.x[xi])
    # Eq. 5 often has many optima (any split that keeps the slowest link busy
    # is one), and its g_ij need not be tight. Among the optima, take one whose
    # eq. 6 throughputs m_i = min_j g_ij are as large as possible together.
    bounds[xi] = (best * (1 - 1e-6), None)
    # m_i <= g_ij for every receiver j: m_i is eq. 6's min_j g_ij; maximize their sum.
    extra = [({nvar + i: 1.0, g(i, j): -1.0}, 0.0) for i in range(n) for j in receivers]
    wide = _sparse(rows + extra, nvar + n)
    objective = np.zeros(nvar + n)
    objective[nvar:] = -1.0
    second = linprog(objective, A_ub=cast(Any, wide), b_ub=np.concatenate([rhs, np.zeros(len(extra))]),
                     bounds=bounds + [(0.0, None)] * n, method="highs-ds")
    x = second.x if second.status == 0 and second.x is not None else first.x
    throughput = []
    for i in range(n):
        if not capacities[i].reduces:
            throughput.append(0.0)
            continue
        throughput.append(max(0.0, min(x[g(i, j)] for j in receivers)))  # receivers: at least one sender
    if pair_limits is None:
        # Swapping two members with equal capacities maps an optimum onto an
        # optimum, and the optima form a convex set: so their mean is optimal
        # too. Take it, so equal peers get equal shares instead of a vertex's
        # all-or-nothing.
        classes: dict[tuple[float, float, float, bool, bool], list[int]] = {}
        for i, cap in enumerate(capacities):
            classes.setdefault((up[i], down[i], cap.compute, cap.sends, cap.reduces), []).append(i)
        for members in classes.values():
            mean = sum(throughput[i] for i in members) / len(members)
            for i in members:
                throughput[i] = mean
    total = sum(throughput)
    if total <= 0:
        fractions = equal_fractions(capacities)
    else:
        fractions = tuple(float(t / total) for t in throughput)
    # A share too small to matter only adds a stream: drop shares under 0.1%.
    fractions = tuple(f if f >= 1e-3 else 0.0 for f in fractions)
    norm = sum(fractions)
    fractions = tuple(float(f / norm) for f in fractions)
    contributes = tuple(bool(capacities[i].sends and x[c(i)] >= 1.0 - 1e-6) for i in range(n))  # c_k = 1
    return Balance(fractions, best, contributes, time.perf_counter() - started)
