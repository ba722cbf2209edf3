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

Pure: reports and times in, credits out (:class:`Contributions`); the backbone
(``training/cli.py``'s ``Monitor``) feeds it and writes ``contributions.json``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

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

    def max_rate(self, reports: Iterable[LocalProgress]) -> float:
        rates = [r.samples_per_second for r in reports if not r.auxiliary and r.samples_per_second > 0]
        return self.rate_factor * statistics.median(rates) if rates else 0.0

    def observe(self, reports: list[LocalProgress], now: float) -> None:
        """One read of the run's reports at ``now`` (the backbone's clock)."""
        limit = self.max_rate(reports)
        for r in reports:
            if r.auxiliary:
                self.assisted.setdefault(r.peer_id, set()).add(r.step)
                continue
            self.step_seen.setdefault(r.step, now)
            steps = self.claims.setdefault(r.peer_id, {})
            claim = steps.get(r.step)
            if claim is None:
                claim = steps[r.step] = _Claim(seen=self.step_seen[r.step])
                allowance = float(self.slack)  # a first report may carry a batch done before we looked
            else:
                allowance = 0.0
            claim.claimed = max(claim.claimed, r.samples)  # a lower count later never lowers the claim
            allowance += limit * max(0.0, now - claim.seen)
            claim.credited = min(float(claim.claimed), claim.credited + allowance, float(self.target))
            claim.seen = now

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


__all__ = ["Contributions", "RATE_FACTOR", "SLACK"]
