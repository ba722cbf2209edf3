"""The collector's policy for long-running processes (p2p/collector.py)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest

from p2p import collector
from p2p.collector import PauseRecorder, Pauses, settle


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_settle_collects_start_ups_cycles_then_freezes_what_lives() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
    gone = weakref.ref(a)
    del a, b
    kept = [_Node() for _ in range(10_000)]
    session = gc.get_freeze_count()  # tests/conftest.py froze what collection built
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
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    if session:
        gc.freeze()  # the session's freeze back, for the worker's later tests


def test_the_recorder_times_each_collection_by_generation_from_start_to_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 10.25, 20.0, 20.5, 30.0, 30.125, 40.0, 40.0625])
    monkeypatch.setattr(collector, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    recorder = PauseRecorder()
    recorder._callback("stop", {"generation": 0})  # a stop without its start (begun before we listened): ignored
    for generation in (2, 0, 2):
        recorder._callback("start", {"generation": generation})
        recorder._callback("stop", {"generation": generation})
    recorder._callback("start", {})
    recorder._callback("stop", {})  # no generation said: counted as a full one
    recorder._callback("stop", {"generation": 1})  # each start is used once
    pauses = recorder.pauses
    assert pauses.count == [1, 0, 3] and pauses.seconds == [0.5, 0.0, 0.4375] and pauses.longest == [0.5, 0.0, 0.25]
    assert pauses.full == [0.25, 0.125, 0.0625]
    assert pauses.figures() == {"full_collections": 3, "full_max_s": 0.25, "full_total_s": 0.438, "all_total_s": 0.938,
                                "longest_s": 0.5, "collections": 4}


def test_figures_round_to_a_tenth_of_a_millisecond_and_a_millisecond() -> None:
    pauses = Pauses(count=[1, 2, 3], seconds=[0.00012, 0.0, 1.23456], longest=[0.00012, 0.0, 0.123456])
    assert pauses.figures() == {"full_collections": 3, "full_max_s": 0.1235, "full_total_s": 1.235,
                                "all_total_s": 1.235, "longest_s": 0.1235, "collections": 6}
    assert Pauses().figures() == {"full_collections": 0, "full_max_s": 0.0, "full_total_s": 0.0, "all_total_s": 0.0,
                                  "longest_s": 0.0, "collections": 0}


def test_the_recorder_keeps_the_first_ten_thousand_full_pauses() -> None:
    recorder = PauseRecorder()
    for _ in range(10_001):
        recorder._callback("start", {"generation": 2})
        recorder._callback("stop", {"generation": 2})
    assert recorder.pauses.count[2] == 10_001 and len(recorder.pauses.full) == 10_000


def test_the_recorder_listens_only_inside_its_block() -> None:
    before = list(gc.callbacks)
    recorder = PauseRecorder()
    with recorder as pauses:
        assert pauses is recorder.pauses and gc.callbacks == [*before, recorder._callback]
        gc.collect(1)
    gc.collect(1)
    assert gc.callbacks == before and pauses.count[1] == 1 and pauses.longest[1] == pauses.seconds[1] > 0
