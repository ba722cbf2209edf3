"""Moshpit averaging at a thousand peers: how far from the exact global average each round leaves
the swarm, with members failing.

What runs is the project's grid (:class:`averaging.moshpit.GridPosition`: the first key from the
peer id, the advance after a round) and the averager's rules around it: peers meet the others
under the same key in groups of at most ``m`` (matchmaking's target size; a key with more
peers forms several groups, one with a single peer forms none), a group's order is its
members' peer ids (:class:`averaging.group.Group`), and a round with a failed member is
partial, so with ``Averager.step``'s default (``strict=True``) nobody in that group changes
its values (DeDLOC's Appendix C: the step is redone), while every member still moves on the
grid with its agreed index (``advance_after_failure``; False: the averager before this was
found, which kept the key). The global mean is therefore kept exactly and the distance to it
can only shrink.

The network is left out on purpose: this is the arithmetic of who averages with whom.
Matchmaking's time at that size runs over the simulated DHT elsewhere.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from enum import StrEnum

import torch

from ..moshpit import GridPosition


class Grouping(StrEnum):
    #: the grid: peers with the same key meet (Moshpit)
    GRID = "grid"
    #: every round, random groups of the same size (the baseline)
    RANDOM = "random"


class Positions(StrEnum):
    #: first keys from the peers' ids (:meth:`GridPosition.initial`): cells hold m on average
    PEER_IDS = "peer-ids"
    #: every cell holds exactly m peers (needs n = m^d): the analysis's full grid
    FULL = "full"


@dataclass(frozen=True)
class MoshpitSimConfig:
    peers: int = 1000
    group_size: int = 10
    dims: int = 3
    #: each member fails a round with this probability (its group's round is then partial)
    failure_rate: float = 0.0
    rounds: int = 30
    grouping: Grouping = Grouping.GRID
    positions: Positions = Positions.PEER_IDS
    #: length of each peer's vector
    width: int = 16
    seed: int = 0
    #: a group whose round failed still moves its members on the grid (they agreed on their
    #: order when the group was fixed); False: they keep their key and try again
    advance_after_failure: bool = True


@dataclass
class MoshpitRun:
    config: MoshpitSimConfig
    #: mean squared distance to the global average after each round, over the one before round 1
    distance: list[float]
    #: rounds whose group had a failed member, and groups formed, summed over the rounds
    failed_groups: int
    groups: int
    #: peers left without a group (alone under their key), summed over the rounds
    alone: int

    def rounds_to(self, threshold: float) -> int | None:
        """The first round after which the distance is at most ``threshold`` (None: not within the run)."""
        return next((r for r, d in enumerate(self.distance) if d <= threshold and r > 0), None)


def simulate(config: MoshpitSimConfig) -> MoshpitRun:
    rng = random.Random(config.seed)
    torch_rng = torch.Generator().manual_seed(config.seed)
    n, m = config.peers, config.group_size
    ids = [rng.randbytes(32) for _ in range(n)]
    if config.positions is Positions.FULL:
        if m ** config.dims != n:
            raise ValueError(f"a full grid needs peers = group_size ** dims ({m} ** {config.dims} != {n})")
        grid = [GridPosition(m, _digits(i // m, m, config.dims - 1)) for i in range(n)]
    else:
        grid = [GridPosition.initial(m, config.dims, peer) for peer in ids]
    values = torch.randn(n, config.width, dtype=torch.float64, generator=torch_rng)
    mean = values.mean(0)
    start = float(((values - mean) ** 2).sum())
    distance = [1.0]
    failed_groups = groups_formed = alone = 0
    for r in range(config.rounds):
        for members in _groups(config, grid, rng):
            if len(members) < 2:
                alone += len(members)
                continue
            groups_formed += 1
            ordered = sorted(members, key=lambda i: ids[i])
            if any(rng.random() < config.failure_rate for _ in members):
                failed_groups += 1  # partial: a strict step changes nobody's values
                if not config.advance_after_failure:
                    continue
            else:
                index = torch.tensor(ordered)
                values[index] = values[index].mean(0)
            if config.grouping is Grouping.GRID:
                group_id = f"{r}:{ordered[0]}".encode()  # the averager's is the group's id: one per group
                for position, peer in enumerate(ordered):
                    grid[peer].advance(position, group_id)
        distance.append(float(((values - mean) ** 2).sum()) / start)
    return MoshpitRun(config, distance, failed_groups, groups_formed, alone)


def _groups(config: MoshpitSimConfig, grid: list[GridPosition], rng: random.Random) -> list[list[int]]:
    """This round's groups: per key (grid) or at random, in join order, at most m each."""
    m = config.group_size
    if config.grouping is Grouping.RANDOM:
        order = list(range(config.peers))
        rng.shuffle(order)
        return [order[i:i + m] for i in range(0, len(order), m)]
    by_key: dict[str, list[int]] = defaultdict(list)
    for peer, position in enumerate(grid):
        by_key[position.key].append(peer)
    out: list[list[int]] = []
    for peers in by_key.values():
        rng.shuffle(peers)  # who reaches the leader first
        out.extend(peers[i:i + m] for i in range(0, len(peers), m))
    return out


def _digits(value: int, base: int, count: int) -> tuple[int, ...]:
    out = []
    for _ in range(count):
        value, digit = divmod(value, base)
        out.append(digit)
    return tuple(reversed(out))
