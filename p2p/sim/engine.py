"""A discrete-event clock: callbacks at simulated times, run in time order (ties in the order
they were scheduled), so a run is a pure function of its seed. No threads, no I/O, no trio:
ten thousand peers' timers cost a heap entry each."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class Engine:
    """``at(delay, fn, *args)`` schedules; ``run(until)`` calls everything due by ``until``."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._queue: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        #: Callbacks run so far (the run's cost, for the report).
        self.events = 0

    def at(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        if delay < 0:
            raise ValueError(f"cannot schedule {delay:g} s in the past")
        self._seq += 1
        heapq.heappush(self._queue, (self.now + delay, self._seq, fn, args))

    def run(self, until: float) -> None:
        """Run every callback due at or before ``until`` (they may schedule more); the clock ends at ``until``."""
        queue = self._queue
        while queue and queue[0][0] <= until:
            when, _, fn, args = heapq.heappop(queue)
            self.now = when
            self.events += 1
            fn(*args)
        self.now = max(self.now, until)

    def __len__(self) -> int:
        return len(self._queue)
