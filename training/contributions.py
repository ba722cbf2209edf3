"""Who contributed what (DeDLOC I.2): each peer's samples per step, credited only as far as time allows.

Every trainer publishes its progress under its own *owned* subkey of the run's
progress key (``training/progress.py``): the DHT stores a record there only
with the owner's signature, so no peer can raise or lower another's count. What a
peer says of itself is another matter; the backbone credits a claim only as far
as the time it watched makes plausible: between two of its observations of a
peer's count toward a step, the credit grows by at most ``max_rate`` x the time
between them (its own clock, not the report's), where ``max_rate`` is
``rate_factor`` x the median rate the trainers report (a few liars cannot move
the median), and never beyond one global batch. An honest peer's credit follows
its claims (a peer is never faster than a few times the swarm's typical one);
a peer claiming 10^6 samples in a 2 s step is credited what a fast peer does in 2 s.

A peer's report of a step is replaced by its report of the next one as soon as
it steps, so the backbone may never read the count it stepped with (a slow peer
that computes two batches a step would lose half its credit). Each report also
carries ``previous``, the samples the peer brought to the last step's round:
that claim is credited only for the time until the backbone first saw the next
step, so it adds nothing a report read in time could not have.

Pure: reports and times in, credits out (:class:`Contributions`); the backbone
(``training/monitor.py``'s ``Monitor``) feeds it and writes ``contributions.json``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from libp2p.peer.id import ID

from .progress import LocalProgress

#: A peer may be credited up to this many times the median reported rate.
RATE_FACTOR = 3.0
#: Samples a peer may bring at once beyond the rate (one local batch reported with the first report).
SLACK = 256


@dataclass
class _Claim:
    credited: float = 0.0
    claimed: int = 0
    seen: float = 0.0


@dataclass
class Contributions:
    """Credited samples per peer and step, from the progress reports the backbone reads."""

    target: int
    rate_factor: float = RATE_FACTOR
    slack: int = SLACK
    claims: dict[ID, dict[int, _Claim]] = field(default_factory=dict)
    #: When the backbone first saw each step under way (its clock).
    step_seen: dict[int, float] = field(default_factory=dict)
    #: Steps each auxiliary peer reported itself present at.
    assisted: dict[ID, set[int]] = field(default_factory=dict)
    #: Claims toward this step or an earlier one are not credited: a restarted backbone's board
    #: carries them already (:func:`carried`).
    after: int = -1

    def max_rate(self, reports: Iterable[LocalProgress]) -> float:
        rates = [r.samples_per_second for r in reports if not r.auxiliary and r.samples_per_second > 0]
        return self.rate_factor * statistics.median(rates) if rates else 0.0

    def observe(self, reports: list[LocalProgress], now: float) -> None:
        """One read of the run's reports at ``now`` (the backbone's clock)."""
        limit = self.max_rate(reports)
        for r in reports:
            if r.auxiliary:
                if r.step > self.after:
                    self.assisted.setdefault(r.peer_id, set()).add(r.step)
                continue
            self._claim(r.peer_id, r.step, r.samples, now, limit)
        for r in reports:
            if not r.auxiliary and r.previous > 0 and r.step > 0:
                # the count it stepped with: its last report of that step may have been replaced
                # before we read it. Credited only for the time that step was under way (until we
                # saw the next one), so that it adds nothing a report at the step could not have.
                self._claim(r.peer_id, r.step - 1, r.previous, min(now, self.step_seen[r.step]), limit)

    def _claim(self, peer: ID, step: int, samples: int, now: float, limit: float) -> None:
        """A peer's count toward ``step``, observed at ``now`` (the step's first sight, if it is the
        first): credited as far as ``limit`` allows. A step the saved board holds is only seen: the
        claims toward the step before it read when it was first seen."""
        self.step_seen.setdefault(step, now)
        if step <= self.after:
            return
        steps = self.claims.setdefault(peer, {})
        claim = steps.get(step)
        if claim is None:
            claim = steps[step] = _Claim(seen=self.step_seen[step])
            allowance = float(self.slack)  # a first report may carry a batch done before we looked
        else:
            allowance = 0.0
        claim.claimed = max(claim.claimed, samples)  # a lower count later never lowers the claim
        allowance += limit * max(0.0, now - claim.seen)
        claim.credited = min(float(claim.claimed), claim.credited + allowance, float(self.target))
        claim.seen = max(claim.seen, now)

    def leaderboard(self, usernames: dict[ID, str] | None = None) -> dict[str, dict[str, object]]:
        """Peer id -> credited samples, claimed samples, auxiliary steps (and the user, in a closed run)."""
        names = usernames or {}
        out: dict[str, dict[str, object]] = {}
        for peer in sorted(set(self.claims) | set(self.assisted), key=lambda p: p.to_base58()):
            steps = self.claims.get(peer, {})
            row: dict[str, object] = {"samples": int(sum(c.credited for c in steps.values())),
                                      "claimed": sum(c.claimed for c in steps.values()),
                                      "auxiliary_steps": len(self.assisted.get(peer, ()))}
            if peer in names:
                row["username"] = names[peer]
            out[peer.to_base58()] = row
        return out


#: The leaderboard's counts that add up over a run (a restarted backbone adds its new credit to them).
ADDED = ("samples", "claimed", "auxiliary_steps", "bytes_served")
#: The counts every row has, 0 where none was made (the live page reads them).
ROW_COUNTS = ("samples", "claimed", "auxiliary_steps")


def carried(earlier: dict[str, dict[str, Any]], board: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The leaderboard of a backbone that restarted: what its board said before (``earlier``, read back
    from ``contributions.json``: :func:`board_from_json`) plus what it credited since (``board``). The
    counts of :data:`ADDED` add up; what is read afresh (shards added, a username) is taken from
    ``board`` where it has it, else kept. Without it a restart wiped every volunteer's credit."""
    out: dict[str, dict[str, Any]] = {}
    for peer in sorted(set(earlier) | set(board)):
        before, now = earlier.get(peer, {}), board.get(peer, {})
        row = {**before, **now}
        for name in ADDED:  # a saved row may lack one of ROW_COUNTS (a hand-edited value left out)
            if name in row or name in ROW_COUNTS:
                row[name] = before.get(name, 0) + now.get(name, 0)
        out[peer] = row
    return out


def board_from_json(text: str) -> dict[str, dict[str, Any]]:
    """A saved leaderboard (``contributions.json``) as :func:`carried` takes it: ValueError when it is
    not one; within one, a value of the wrong kind (a hand-edited file) is left out."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not a leaderboard: no object at the top")
    out: dict[str, dict[str, Any]] = {}
    for peer, row in data.items():
        if not isinstance(row, dict):
            continue
        out[peer] = {k: v for k, v in row.items()
                     if (k in ADDED or k == "shards_added") and type(v) is int and v >= 0
                     or k == "username" and isinstance(v, str)}
    return out


#: Bytes a second a seeder may be credited for at most (1 Gbit/s: more than a volunteer's uplink).
MAX_SERVE_RATE = 125e6


@dataclass
class _Served:
    claimed: int = 0
    credited: float = 0.0
    #: when the backbone last read this count (its clock)
    seen: float = 0.0


@dataclass
class DataContributions:
    """Credit for data (Hydra's datasets): bytes each peer served of the run's datasets and shards it added.

    A seeder says what it served in its tracker record (``training/datasets``: ``Seeding.bytes_served``),
    under a subkey it owns, so nobody else can raise or lower its count; what it says of itself is
    credited only as fast as ``max_rate`` allows between two of the backbone's observations (its own
    clock): a peer claiming a terabyte in a minute is credited a minute at 1 Gbit/s. A count that went
    down (the seeder restarted: its count starts again) adds to what was credited before, never
    subtracts. Shards added are the shards of the entries a peer signed that are still in the dataset.
    Pure: records and times in, credits out.
    """

    max_rate: float = MAX_SERVE_RATE
    #: (peer, dataset id) -> what it served of that dataset
    served: dict[tuple[ID, bytes], _Served] = field(default_factory=dict)
    #: (peer, dataset id) -> shards of its entries in the dataset
    shards: dict[tuple[ID, bytes], int] = field(default_factory=dict)
    #: (peer, dataset id) -> credited before its count went down
    _earlier: dict[tuple[ID, bytes], float] = field(default_factory=dict)

    def observe_served(self, dataset: bytes, counts: dict[ID, int], now: float) -> None:
        """One read of a dataset's tracker at ``now``: each seeder's count of bytes served."""
        for peer, count in counts.items():
            key = (peer, dataset)
            s = self.served.get(key)
            if s is None:  # a count met for the first time: credited as it grows from here on
                self.served[key] = _Served(claimed=count, seen=now)
                continue
            if count < s.claimed:  # restarted: what was credited stays
                self._earlier[key] = self._earlier.get(key, 0.0) + s.credited
                s.claimed, s.credited = 0, 0.0
            allowance = self.max_rate * max(0.0, now - s.seen)
            s.credited = min(float(count), s.credited + allowance)
            s.claimed = max(s.claimed, count)
            s.seen = now

    def observe_shards(self, dataset: bytes, authors: dict[ID, int]) -> None:
        """A dataset's shards by the peer that added them (its entries, retracted ones left out)."""
        for key in [k for k in self.shards if k[1] == dataset]:
            del self.shards[key]
        for peer, n in authors.items():
            self.shards[(peer, dataset)] = n

    def leaderboard(self) -> dict[str, dict[str, int]]:
        """Peer id -> bytes served (credited) and shards added, every dataset together."""
        out: dict[str, dict[str, int]] = {}
        for key, s in self.served.items():  # every key of _earlier is one of these
            row = out.setdefault(key[0].to_base58(), {"bytes_served": 0, "shards_added": 0})
            row["bytes_served"] += int(s.credited + self._earlier.get(key, 0.0))
        for (peer, _), n in self.shards.items():
            row = out.setdefault(peer.to_base58(), {"bytes_served": 0, "shards_added": 0})
            row["shards_added"] += n
        return out


__all__ = ["ADDED", "Contributions", "DataContributions", "MAX_SERVE_RATE", "RATE_FACTOR", "SLACK", "board_from_json", "carried"]
