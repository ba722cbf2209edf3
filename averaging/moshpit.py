"""Moshpit groups (DeDLOC Appendix C; Moshpit SGD): many small all-reduce groups instead of one.

A swarm of n peers averaging in one group fails whenever any one of them
fails, and with hundreds of volunteers most rounds have one. Instead, peers
sit on a grid of m^d cells and average in groups of at most m that change
dimension every round; without failures every peer holds the exact global
average after d = ceil(log_m n) rounds, and a failure costs only its group.

A peer's place is d - 1 digits in base m, its *group key*: peers with the
same key meet (matchmaking under ``<prefix>.matchmaking.<key>``). After a
round (a failed one too: the group's order was agreed when it was fixed, and
a group that kept its key would fall out of the grid's phase) the oldest
digit is dropped and the peer's index in the group is appended, turned by an
offset drawn from the group's id (so that groups under m give out every digit
alike), like hivemind's group bits but in base m. With d = 2 and m = 4, sixteen
peers keyed 0, 1, 2, 3 (four each) average in four groups; each group's members
then carry four distinct digits, so the second round's groups hold one member
of every first-round group: the exact average. Sans-I/O: the averager asks for the key and reports the
group; :func:`optimal_group_size` picks m from n and the observed failure
rate by minimising the expected number of rounds to the global average
(Appendix C, Figure 8), and :class:`FailureRate` observes that rate.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass

from p2p.errors import ConfigError


def rounds_to_average(n: int, m: int) -> int:
    """d = ceil(log_m n): rounds in groups of m until every peer has the global average."""
    if n < 1 or m < 2:
        raise ValueError(f"need n >= 1 and m >= 2 (n={n}, m={m})")
    d, cells = 0, 1
    while cells < n:
        cells *= m
        d += 1
    return max(d, 1)


def expected_rounds(n: int, m: int, failure_rate: float) -> float:
    """Expected rounds until the global average when each peer fails a round with ``failure_rate``.

    Each of the d steps runs ceil(n/m) groups in parallel; a group whose
    member failed redoes its step (success probability q = (1-p)^m), and a
    step is over when its slowest group succeeded: the expected maximum of
    ceil(n/m) geometric variables. Summed exactly while that takes few terms;
    otherwise (groups that nearly always fail) the standard approximation
    H_g / ln(1/(1-q)) + 1/2.
    """
    if not 0.0 <= failure_rate < 1.0:
        raise ValueError(f"failure_rate must be in [0, 1), not {failure_rate}")
    m = max(2, min(m, n))  # groups of more than the swarm are the swarm's one group
    d = rounds_to_average(n, m)
    groups = math.ceil(n / m)
    fail = 1.0 - (1.0 - failure_rate) ** m
    if fail <= 0.0:
        return float(d)
    if fail >= 1.0:
        return math.inf
    rate = -math.log(fail)
    if math.log(1e12 * groups) / rate > 10_000:  # too many terms: approximate
        harmonic = sum(1.0 / i for i in range(1, groups + 1))
        return d * (harmonic / rate + 0.5)
    # E[max of g geometrics] = sum_{k>=0} P(max > k) = sum_k 1 - (1 - fail^k)^g
    total, k = 0.0, 0
    while True:
        tail = 1.0 - (1.0 - fail**k) ** groups
        total += tail
        k += 1
        if tail < 1e-12:
            return d * total


def optimal_group_size(n: int, failure_rate: float, *, max_size: int | None = None) -> int:
    """The m in 2..n (at most ``max_size``) with the fewest expected rounds; ties go to the larger m."""
    if n < 2:
        return 2
    top = min(n, max_size) if max_size else n
    best = min(range(2, top + 1), key=lambda m: (round(expected_rounds(n, m, failure_rate), 9), -m))
    return best


class FailureRate:
    """The share of members that failed a round (left out, or the round failed), over recent rounds."""

    def __init__(self, window: int = 50) -> None:
        self._rounds: deque[tuple[int, int]] = deque(maxlen=window)

    def observe(self, members: int, failed: int) -> None:
        if members > 0:
            self._rounds.append((members, min(failed, members)))

    @property
    def value(self) -> float:
        members = sum(m for m, _ in self._rounds)
        return sum(f for _, f in self._rounds) / members if members else 0.0


@dataclass(frozen=True)
class MoshpitConfig:
    """Moshpit groups: ``group_size`` m, ``dims`` d (m^d cells should hold the swarm), start digits.

    Every peer of a run must use the same m and d (and a release with the same turn of a
    group's indexes, :meth:`GridPosition.advance`: peers that turn them differently still
    group, but no longer meet the peers the grid meant). ``initial``: this peer's
    first d - 1 digits (None: from its peer id). :meth:`for_swarm` picks m
    and d for n peers and a failure rate.
    """

    group_size: int
    dims: int = 2
    initial: tuple[int, ...] | None = None

    def validate(self) -> None:
        if self.group_size < 2 or self.dims < 1:
            raise ConfigError(f"Moshpit needs group_size >= 2 and dims >= 1 ({self.group_size}, {self.dims})")
        if self.initial is not None:
            if len(self.initial) != self.dims - 1:
                raise ConfigError(f"initial must hold dims - 1 = {self.dims - 1} digits, not {self.initial}")
            GridPosition(self.group_size, self.initial)  # range check

    @classmethod
    def for_swarm(cls, n: int, failure_rate: float = 0.0, *, max_size: int | None = None) -> MoshpitConfig:
        """m minimising the expected rounds to the global average, and d = ceil(log_m n)."""
        m = optimal_group_size(n, failure_rate, max_size=max_size)
        return cls(group_size=m, dims=rounds_to_average(max(n, 2), m))


@dataclass
class GridPosition:
    """This peer's group key: d - 1 digits in base m."""

    m: int
    digits: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.m < 2:
            raise ConfigError("the group size m must be at least 2")
        if any(not 0 <= x < self.m for x in self.digits):
            raise ConfigError(f"digits must be in [0, {self.m}): {self.digits}")

    @classmethod
    def initial(cls, m: int, dims: int, seed: bytes) -> GridPosition:
        """A pseudo-random place from ``seed`` (e.g. the peer id): peers spread evenly on average."""
        if dims < 1:
            raise ValueError("dims must be at least 1")
        h = hashlib.sha256(b"moshpit" + seed).digest()
        return cls(m, tuple(h[i] % m for i in range(dims - 1)))

    @property
    def key(self) -> str:
        """The matchmaking key suffix: peers with the same one form a group ('' when d = 1)."""
        return ".".join(str(x) for x in self.digits)

    def advance(self, index_in_group: int, salt: bytes = b"") -> None:
        """After a round: drop the oldest digit, append this peer's index in the group turned by an
        offset of the group's own, drawn from ``salt`` (the group id: every member holds it).

        With the bare index, groups under m (8.6 members of m = 10 on average in the 1,000-peer
        simulation) never gave out the high digits: after two rounds the cells keyed by high indexes
        were nearly empty and their peers met no group (SCALE.md, "Round after round"). Turned, every
        digit is given out about as often. Members of one group still take distinct digits (while it
        is at most m), so a full grid still reaches the exact average in d rounds.
        """
        if not self.digits:
            return
        offset = int.from_bytes(hashlib.sha256(b"moshpit-turn" + salt).digest()[:8], "big") if salt else 0
        self.digits = (*self.digits[1:], (index_in_group + offset) % self.m)
