"""Finding the best live experts for a batch: beam search over the DHT's uid prefixes.

Learning@home's Algorithm 1. Gating scores each coordinate of the grid
separately (d dimensions of size M); an expert's score is the sum of its
coordinates' scores. Searching one dimension at a time, keeping the
``beam_size`` best live prefixes per sample, finds the top k among N = M^d
experts with d rounds of DHT reads of at most ``beam_size`` keys per sample
(O(k log N) lookups), and only ever among experts that some server declared.

The rounds of a whole batch read the union of its samples' prefixes in one
``get_many`` (one traversal). The DHT keeps no copy of a dictionary it read
(:func:`p2p.dht.replication.copyable`: one kept for the records' 90 s, lacking
every server that declared under the prefix since, once hid every live expert
of a prefix whose first server had died). Every prefix read is cached here for ``cache_ttl``
seconds (its records live ``expiration`` on the servers, refreshed every
``update_period``), so a warm search reads nothing; a prefix found empty only
``empty_ttl`` (servers that start are found soon); a read that fails or times
out counts as "no live expert there" for the search and is not cached.

A read takes the first copy found, not every replica's merged (``latest``):
that cost cold searches 2.5-5x (bench/moe.py, 256 experts: p50 105 -> 270 ms,
and 530 ms with a tenth of the servers dead) against hivemind's 430 ms. The
first copy is a replica's since reads stopped leaving copies of dictionaries on
their path: such a copy, a snapshot the prefix's writers never update, made
61.6% of first-copy reads miss a server (bench/prefix_freshness.py: 1,000
simulated peers, 16 servers joining one prefix), and none miss one now.

Experts banned after a failed call (``usable``) are left out at the last
dimension; before it, a prefix that only unreachable servers declared
(``reachable``: a call found no connection to them) is passed over, so that a
sample's beams do not end with no expert where another row has live ones.

:func:`select` is the pure step (scores and live prefixes in, beams out);
:class:`BeamSearcher` does the reads.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import trio
from google.protobuf.message import DecodeError
from libp2p.peer.id import ID

from nat.swarm import Records
from p2p.dht.records import KeyLike, ValueWithExpiration
from p2p.untrusted import decode_addrs

from ..proto import moe_pb2 as pb
from .protocol import Expert
from .grid import parse_subkey, prefix_key

log = logging.getLogger(__name__)

#: most addresses taken from one server's declaration
MAX_EXPERT_ADDRS = 16
#: what a prefix key holds: next coordinate -> the servers that declared it (and an expert under it)
Successors = dict[int, list[Expert]]


def parse_successors(found: ValueWithExpiration | None) -> Successors:
    """A prefix key's live subkeys; anything malformed is skipped (a peer may write garbage), and
    of a server's addresses the first :data:`MAX_EXPERT_ADDRS` that parse are kept."""
    out: Successors = {}
    if found is None or not isinstance(found.value, dict):
        return out
    for subkey, entry in found.value.items():
        parsed = parse_subkey(subkey)
        if parsed is None or not isinstance(entry.value, bytes):
            continue
        coord, server = parsed
        try:
            info = pb.ExpertInfo.FromString(entry.value)
        except DecodeError:
            continue
        # an address that does not parse is dropped (py-multiaddr parses bytes lazily: one kept
        # whole failed later, in whoever printed or dialed it), the expert is kept
        addrs = tuple(decode_addrs(info.addrs, limit=MAX_EXPERT_ADDRS))
        out.setdefault(coord, []).append(Expert(info.uid, server, addrs))
    return out


@dataclass(order=True)
class Beam:
    """One candidate prefix of one sample: its coordinates so far and their summed score."""

    score: float
    coords: tuple[int, ...] = field(compare=False)
    experts: list[Expert] = field(compare=False, default_factory=list)


def select(scores: torch.Tensor, beams: Sequence[Beam], successors: Mapping[tuple[int, ...], Successors],
           width: int, usable: Callable[[Expert], bool] | None = None, prefix: str | None = None) -> list[Beam]:
    """One sample's next beams: every live extension of ``beams`` scored with ``scores`` (this
    dimension's scores, shape [M]), the best ``width`` kept. ``usable`` drops servers (banned ones);
    with ``prefix`` (the last dimension), so does a record whose uid is not the coordinates' own."""
    m = scores.shape[0]
    values = scores.tolist()
    out: list[Beam] = []
    for beam in beams:
        for coord, experts in successors.get(beam.coords, {}).items():
            if not 0 <= coord < m:
                continue  # a coordinate outside the grid this layer gates
            coords = (*beam.coords, coord)
            if prefix is not None:
                uid = prefix_key(prefix, coords)
                experts = [e for e in experts if e.uid == uid]
            if usable is not None:
                experts = [e for e in experts if usable(e)]
            if not experts:
                continue
            out.append(Beam(beam.score + values[coord], coords, experts))
    out.sort(reverse=True)
    return out[:width]


@dataclass
class SearchStats:
    searches: int = 0
    reads: int = 0
    keys_read: int = 0
    cache_hits: int = 0


@dataclass
class SearchOutcome:
    """What the last search met, for an error that says why it found nobody: prefixes whose DHT
    read failed or timed out (not "empty": unknown), and the experts it found but left out
    (``usable`` said no: banned after a failure)."""

    unread: int = 0
    left_out: set[Expert] = field(default_factory=set)


class BeamSearcher:
    """Beam search for one layer's grid ``prefix`` of ``grid_size`` (see the module docstring)."""

    def __init__(self, dht: Records, prefix: str, grid_size: Sequence[int], *, cache_ttl: float = 15.0,
                 empty_ttl: float = 2.0, read_timeout: float = 5.0,
                 usable: Callable[[Expert], bool] | None = None,
                 reachable: Callable[[ID], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dht = dht
        self.prefix = prefix
        self.grid_size = tuple(grid_size)
        self.cache_ttl = cache_ttl
        #: a prefix with no live expert is read again sooner: servers that start are found within this
        self.empty_ttl = min(empty_ttl, cache_ttl)
        self.read_timeout = read_timeout
        self.usable = usable
        #: whether a server can be reached: a prefix only unreachable servers declared is passed over
        #: before the last dimension (its beam would end with no expert)
        self.reachable = reachable
        #: what the cache's ages are measured with (a test's own clock)
        self.clock = clock
        #: prefix coords -> (what it holds, time read)
        self._cache: dict[tuple[int, ...], tuple[Successors, float]] = {}
        self.stats = SearchStats()
        self.last = SearchOutcome()

    async def successors(self, prefixes: Sequence[tuple[int, ...]],
                         outcome: SearchOutcome | None = None) -> dict[tuple[int, ...], Successors]:
        """What each prefix holds: from the cache while fresh, else one ``get_many`` for all the others
        (a prefix whose read failed holds nothing here, and counts in ``outcome.unread``)."""
        now = self.clock()
        out: dict[tuple[int, ...], Successors] = {}
        missing: list[tuple[int, ...]] = []
        for p in dict.fromkeys(prefixes):
            cached = self._cache.get(p)
            if cached is not None and now - cached[1] < (self.cache_ttl if cached[0] else self.empty_ttl):
                out[p] = cached[0]
                self.stats.cache_hits += 1
            else:
                missing.append(p)
        if missing:
            keys = {prefix_key(self.prefix, p): p for p in missing}
            self.stats.reads += 1
            self.stats.keys_read += len(keys)
            found: Mapping[KeyLike, ValueWithExpiration | None] = {}
            with trio.move_on_after(self.read_timeout):
                found = await self.dht.get_many(list(keys), timeout=self.read_timeout)
            now = self.clock()
            if len(self._cache) > 100_000:
                self._cache.clear()  # bounded; a grid this size is re-read
            for key, p in keys.items():
                value = found.get(key)
                out[p] = parse_successors(value)
                if key in found:  # read (present or absent); a timed-out read is not remembered
                    self._cache[p] = (out[p], now)
                elif outcome is not None:
                    outcome.unread += 1
        return out

    async def search(self, grid_scores: Sequence[torch.Tensor], k: int, beam_size: int | None = None) -> list[list[Beam]]:
        """The ``k`` best live experts of every sample, best first: ``grid_scores[i]`` is dimension
        i's scores, shape [batch, grid_size[i]]. A sample may get fewer than k (fewer live)."""
        if len(grid_scores) != len(self.grid_size):
            raise ValueError(f"{len(grid_scores)} score tensors for a {len(self.grid_size)}-dimensional grid")
        batch = grid_scores[0].shape[0]
        width = max(k, beam_size or k)
        scores = [s.detach().float().cpu() for s in grid_scores]
        beams: list[list[Beam]] = [[Beam(0.0, ())] for _ in range(batch)]
        self.stats.searches += 1
        outcome = self.last = SearchOutcome()
        usable = None if self.usable is None else functools.partial(_noting, self.usable, outcome.left_out)
        reaches = self.reachable
        reachable = None if reaches is None else functools.partial(_noting, lambda e: reaches(e.peer_id),
                                                                    outcome.left_out)
        for dim in range(len(self.grid_size)):
            last = dim == len(self.grid_size) - 1
            wanted = [b.coords for sample in beams for b in sample]
            live = await self.successors(wanted, outcome)
            beams = [select(scores[dim][i], beams[i], live, k if last else width,
                            usable if last else reachable, self.prefix if last else None) for i in range(batch)]
        return beams

    def forget(self) -> None:
        self._cache.clear()


def _noting(usable: Callable[[Expert], bool], left_out: set[Expert], expert: Expert) -> bool:
    """``usable(expert)``, noting one it leaves out."""
    if usable(expert):
        return True
    left_out.add(expert)
    return False


__all__ = ["Beam", "BeamSearcher", "SearchOutcome", "SearchStats", "Successors", "parse_successors", "select"]
