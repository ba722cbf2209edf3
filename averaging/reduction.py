"""A reducer's bookkeeping for its part, without I/O: chunks in, averages out.

The all-reduce feeds it every chunk it reads (from the streams of the other
senders, and its own values directly) and every sender it gives up on; it
answers with the chunks whose average is now final, in any order. A chunk is
final once every sender still expected has delivered it. Its average is the
weighted mean of the contributions that were accepted; which members those
were travels back with it, so nobody has to guess whether a chunk is whole.

What it refuses, and how:

* a chunk from a peer that is not an expected sender, out of order (every
  sender delivers 0, 1, 2 ... with no gap or repeat), or of the wrong length:
  :class:`ChunkRejected`; the caller drops that sender (its earlier chunks
  stay in, the later ones are averaged without it);
* non-finite values: that contribution is left out of that chunk and named
  in the chunk's notes; the sender stays in for the next chunks.

A sender of weight 0 adds nothing and is a contributor all the same (its
values are in the average, with weight 0); a chunk whose senders all weigh 0
has no average.

With ``robust`` (opt-in, :mod:`averaging.robust`), a chunk's average is
CenteredClip's instead of the mean: each sender's values are kept until the
chunk is final, and senders whose pull was clipped hard are named in the
chunk's notes (``member 3 clipped x0.004``), which reach every member.

Memory: one float32 accumulator per chunk in flight, at most the part (with
``robust``, one copy per sender of each chunk in flight).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from . import serial
from .compression import Region
from .errors import AllreduceProtocolError
from .robust import CenteredClipConfig, centered_clip


class ChunkRejected(AllreduceProtocolError):
    """A sender's chunk breaks the protocol; the sender is dropped from the rest of the part."""


@dataclass
class FinalChunk:
    """A chunk whose average is decided. ``values`` is None when nobody's contribution was accepted."""

    index: int
    values: torch.Tensor | None
    contributors: frozenset[int]
    notes: list[str]


@dataclass
class _Pending:
    total: torch.Tensor | None = None
    weight: float = 0.0
    delivered: set[int] = field(default_factory=set)
    contributors: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    #: with robust aggregation: each contributor's values (kept until the chunk is final)
    rows: dict[int, torch.Tensor] = field(default_factory=dict)


class PartReduction:
    """Averages the chunks of one part over the expected senders (member indexes)."""

    def __init__(self, spans: Sequence[Region], senders: Iterable[int], *,
                 robust: CenteredClipConfig | None = None) -> None:
        self.spans = list(spans)
        self.robust = robust
        self.expected = set(senders)
        self.weights: dict[int, float] = {}
        self._next: dict[int, int] = {s: 0 for s in self.expected}
        self._pending: dict[int, _Pending] = {}
        self._final: set[int] = set()
        self.dropped: dict[int, str] = {}

    @property
    def done(self) -> bool:
        return len(self._final) == len(self.spans)

    def set_weight(self, sender: int, weight: float) -> None:
        if sender not in self.expected:
            raise ChunkRejected(f"member {sender} is not a sender of this part")
        if not (weight >= 0.0 and weight < float("inf")):
            raise ChunkRejected(f"member {sender} declared weight {weight}; it must be finite and >= 0")
        self.weights[sender] = weight

    def add(self, sender: int, index: int, values: torch.Tensor) -> list[FinalChunk]:
        """One chunk from ``sender``; returns the chunks this made final."""
        if sender not in self.expected:
            why = f"was dropped ({self.dropped[sender]})" if sender in self.dropped else "is not a sender of this part"
            raise ChunkRejected(f"chunk {index} from member {sender}, which {why}")
        if sender not in self.weights:
            raise ChunkRejected(f"chunk {index} from member {sender} before its weight")
        want = self._next[sender]
        if index != want:
            raise ChunkRejected(f"member {sender} sent chunk {index}, expected chunk {want} "
                                f"({'a repeat' if index < want else 'a gap'})")
        if index >= len(self.spans):
            raise ChunkRejected(f"member {sender} sent chunk {index}, the part has {len(self.spans)}")
        span = self.spans[index]
        if values.numel() != span.end - span.start:
            raise ChunkRejected(f"member {sender} sent {values.numel()} values in chunk {index}, "
                                f"expected {span.end - span.start}")
        self._next[sender] = index + 1
        pending = self._pending.setdefault(index, _Pending())
        pending.delivered.add(sender)
        weight = self.weights[sender]
        if not serial.finite(values):
            pending.notes.append(f"member {sender}: non-finite values refused")
        else:
            if weight > 0 and self.robust is not None:
                pending.rows[sender] = serial.copied(values)
                pending.weight += weight
            elif weight > 0:
                if pending.total is None:
                    pending.total = serial.scaled(values, weight)
                else:
                    serial.add_scaled_(pending.total, values, weight)
                pending.weight += weight
            # A sender of weight 0 (a trainer with no samples yet) is in the average with nothing to
            # add: counting it out would report an exact average as partial.
            pending.contributors.add(sender)
        return self._settle([index])

    def drop(self, sender: int, reason: str) -> list[FinalChunk]:
        """Stop waiting for ``sender``; returns the chunks that were waiting only for it."""
        if sender not in self.expected:
            return []
        self.expected.discard(sender)
        self.dropped[sender] = reason
        missing = [i for i in range(self._next.get(sender, 0), len(self.spans)) if i not in self._final]
        for i in missing:
            self._pending.setdefault(i, _Pending()).notes.append(f"member {sender} left out: {reason}")
        return self._settle(missing)

    def _settle(self, indexes: Iterable[int]) -> list[FinalChunk]:
        final = []
        for i in sorted(indexes):
            pending = self._pending.get(i)
            if i in self._final or pending is None or not self.expected <= pending.delivered:
                continue
            del self._pending[i]
            self._final.add(i)
            values = None
            if pending.rows and self.robust is not None:
                values = self._clip(pending)
            elif pending.total is not None and pending.weight > 0:
                values = serial.divide_(pending.total, pending.weight)
            final.append(FinalChunk(i, values, frozenset(pending.contributors if values is not None else ()),
                                    pending.notes))
        return final

    def _clip(self, pending: _Pending) -> torch.Tensor:
        assert self.robust is not None
        senders = sorted(pending.rows)
        result = centered_clip(torch.stack([pending.rows[s] for s in senders]),
                               torch.tensor([self.weights[s] for s in senders], dtype=torch.float64), self.robust)
        for s, scale in zip(senders, result.scales.tolist()):
            if scale < self.robust.flag_below:
                pending.notes.append(f"member {s} clipped x{scale:.3g}")
        pending.rows.clear()
        return result.center
