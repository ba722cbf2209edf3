"""p2p/hooks.py: a registration's handle undoes it once (by hand or at the end of a ``with``), and a
set of observers hears every notice in order, each isolated from the others: one that raises is
logged with what it was told, removed for good, and the rest still hear (the Node's and the DHT's
use of them: tests/test_node.py, tests/test_dht.py)."""

from __future__ import annotations

import logging

import pytest

from p2p.hooks import ExternalAddresses, Observers, Reachability, Registration, SwarmObserver


def test_a_registration_is_undone_once_by_hand_or_by_its_block() -> None:
    undone: list[str] = []
    handle = Registration(lambda: undone.append("a"))
    handle.remove()
    handle.remove()
    assert undone == ["a"]
    with Registration(lambda: undone.append("b")) as inner:
        assert isinstance(inner, Registration) and undone == ["a"]
    assert undone == ["a", "b"]
    with pytest.raises(KeyError):
        with Registration(lambda: undone.append("c")):
            raise KeyError("the block failed")
    assert undone == ["a", "b", "c"]  # undone all the same, and the error goes on


def test_observers_hear_every_notice_in_registration_order_until_each_is_removed() -> None:
    heard: list[tuple[str, int]] = []
    observers: Observers[str] = Observers("things")
    first, second = observers.add("first"), observers.add("second")
    assert len(observers) == 2
    observers.notify(lambda name: heard.append((name, 1)), "one")
    first.remove()
    observers.notify(lambda name: heard.append((name, 2)), "two")
    first.remove()  # again: nothing
    second.remove()
    observers.notify(lambda name: heard.append((name, 3)), "three")
    assert heard == [("first", 1), ("second", 1), ("second", 2)] and len(observers) == 0


def test_an_observer_that_raises_is_logged_with_what_it_was_told_removed_and_the_rest_still_hear(
        caplog: pytest.LogCaptureFixture) -> None:
    heard: list[str] = []
    observers: Observers[str] = Observers("the swarm")

    def call(name: str) -> None:
        if name == "broken":
            raise RuntimeError("its bug")
        heard.append(name)

    for name in ("before", "broken", "after"):
        observers.add(name)
    with caplog.at_level(logging.ERROR, logger="p2p.hooks"):
        observers.notify(call, "a connection opened")
    assert heard == ["before", "after"] and len(observers) == 2
    [record] = [r for r in caplog.records if r.name == "p2p.hooks"]
    assert record.getMessage() == ("an observer of the swarm ('broken') failed on a connection opened; "
                                   "it is removed, the others still hear")
    assert record.exc_info is not None and str(record.exc_info[1]) == "its bug"
    observers.notify(call, "again")
    assert heard == ["before", "after", "before", "after"]


def test_an_observer_may_remove_itself_or_raise_after_removing_itself_while_it_is_told() -> None:
    observers: Observers[str] = Observers("things")
    handles: dict[str, Registration] = {}
    heard: list[str] = []

    def call(name: str) -> None:
        heard.append(name)
        handles[name].remove()
        if name == "b":
            raise RuntimeError("after leaving")

    for name in ("a", "b", "c"):
        handles[name] = observers.add(name)
    observers.notify(call, "once")
    assert heard == ["a", "b", "c"] and len(observers) == 0


def test_a_bare_observer_hears_everything_and_does_nothing_and_nothing_is_judged_at_first() -> None:
    observer = SwarmObserver()
    external = ExternalAddresses()
    assert (external.reachability, external.confirmed, external.refuted, external.relayed, external.judged) == (
        Reachability.UNKNOWN, (), (), (), False)
    observer.external_changed(external)  # nothing to override: no error
    assert [str(r) for r in Reachability] == ["public", "private", "unknown"]
