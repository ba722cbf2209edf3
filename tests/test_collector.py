"""The collector's policy for long-running processes (p2p/collector.py)."""

from __future__ import annotations

import gc
import weakref

from p2p.collector import PauseRecorder, settle


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_settle_collects_start_ups_cycles_then_freezes_what_lives() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
    gone = weakref.ref(a)
    del a, b
    kept = [_Node() for _ in range(10_000)]
    try:
        frozen = settle()
        assert gone() is None  # collected before the freeze, not frozen for ever
        assert frozen >= 10_000 and gc.get_freeze_count() == frozen
        assert not any(x is kept[0] for x in gc.get_objects(generation=2))  # no collection traverses it
        with PauseRecorder() as pauses:
            gc.collect()
            gc.collect(0)
        assert pauses.count[2] == 1 and pauses.count[0] == 1 and pauses.full and pauses.full[0] >= 0
        figures = pauses.figures()
        assert figures["full_collections"] == 1 and figures["collections"] == 2
        assert gc.callbacks.count(pauses) == 0 and len([c for c in gc.callbacks if "PauseRecorder" in repr(c)]) == 0
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
