"""The garbage collector's policy for a long-running peer, and a recorder of its pauses.

CPython's cyclic collector stops the whole process, trio's loop included, for as long as a
collection traverses its generation. A full (generation 2) collection traverses every tracked
object alive, and a peer's heap is mostly what start-up built and never frees: torch and its
modules, the imported packages, protobuf descriptors, the peer's own tables. Measured in
``bench/moe.py``'s worker (20 expert servers, the DHT and torch in one process): a full
collection about every 1.2 s, each 0.07-0.79 s and growing with the heap, which every task saw
at once: calls past their 0.5 s timeout and beam searches with a 0.5 s p99. The garbage those
collections found was small (0-920 objects; most of the pause was the traversal).

:func:`settle` is the remedy CPython documents for it (``gc.freeze``, Python 3.7+: "allows a
program to avoid ... the overhead of collecting objects that will never be freed"): once a
process has started, collect once, then move everything alive to the permanent generation,
which no collection traverses. Later full collections traverse only what was made since.
Frozen objects are still freed by reference counting; only a cycle among them would stay, and
start-up's cycles are the ones just collected. The commands call it once their peer is up
(``nat.cli.run_peer``: relay, peer, average, train, backbone, serve-experts);
code that embeds the layer owns its process and decides for itself (this is process-wide, so
the library never does it on its own).

:class:`PauseRecorder` times every collection (``gc.callbacks``) for benches and for operators.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any


def settle() -> int:
    """Collect what start-up left, then freeze everything alive (see the module docstring).
    Returns how many objects are now frozen. Call it once the process's long-lived state exists
    (its peer open, its models built); calling it again freezes what was made since."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass
class Pauses:
    """Collections seen by a :class:`PauseRecorder`: their count and pauses, by generation."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    #: each full collection's pause, in order (bounded: the first 10,000)
    full: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, float | int]:
        """A bench's JSON: full collections, their longest and total pause, and every collection's total."""
        return {"full_collections": self.count[2], "full_max_s": round(self.longest[2], 4),
                "full_total_s": round(self.seconds[2], 3), "all_total_s": round(sum(self.seconds), 3),
                "longest_s": round(max(self.longest), 4), "collections": sum(self.count)}


class PauseRecorder:
    """``with PauseRecorder() as pauses:`` times every collection in this process meanwhile."""

    def __init__(self) -> None:
        self.pauses = Pauses()
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        took = time.perf_counter() - self._started
        self._started = None
        generation = int(info.get("generation", 2))
        p = self.pauses
        p.count[generation] += 1
        p.seconds[generation] += took
        p.longest[generation] = max(p.longest[generation], took)
        if generation == 2 and len(p.full) < 10_000:
            p.full.append(took)

    def __enter__(self) -> Pauses:
        gc.callbacks.append(self._callback)
        return self.pauses

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        gc.callbacks.remove(self._callback)


__all__ = ["PauseRecorder", "Pauses", "settle"]
