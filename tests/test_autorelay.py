"""nat.autorelay's AutoRelay on a desk: a node and a relay client stood in for (who is connected, what a
dial reaches, which relays give a slot), under trio's MockClock; which relays it asks, when, and what
it emits and logs. The relays and NATs themselves: tests/test_traversal.py, between real nodes."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from nat import events as nev
from nat.autorelay import AutoRelay, AutoRelayConfig
from nat.circuit import Limit, RelayError, Reservation
from p2p.errors import ConfigError, DialError

from .kit import numbered_peer_id as pid


ME = pid(0)


@dataclass
class Conn:
    is_closed: bool = False


@dataclass
class Network:
    conns: dict[ID, list[Conn]] = field(default_factory=dict)

    def get_connections(self, peer_id: ID) -> list[Conn]:
        return self.conns.get(peer_id, [])


@dataclass
class Desk:
    """The node (``network``, ``connected_peers``, ``connect``, ``emit``) and the relay client
    (``reservations``, ``reserve``, ``drop``) AutoRelay is given."""

    peer_id: ID = ME
    network: Network = field(default_factory=Network)
    #: peers a dial reaches (a connection appears), after ``dial_s``
    reachable: set[ID] = field(default_factory=set)
    dial_s: float = 0.0
    #: relays that refuse a reservation (RelayError)
    refusing: set[ID] = field(default_factory=set)
    #: a reservation's life, in seconds
    ttl: float = 3600.0
    reservations: dict[ID, Reservation] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)
    dials: list[tuple[Any, float, bool]] = field(default_factory=list)
    asked: list[ID] = field(default_factory=list)
    dropped: list[ID] = field(default_factory=list)

    # the node
    def connected_peers(self) -> list[ID]:
        return [p for p, cs in self.network.conns.items() if any(not c.is_closed for c in cs)]

    async def connect(self, target: ID | list[Multiaddr], *, timeout: float, from_listen_port: bool) -> None:
        self.dials.append((target, timeout, from_listen_port))
        peer = target if isinstance(target, ID) else ID.from_base58(str(target[0]).rsplit("/p2p/", 1)[1])
        await trio.sleep(self.dial_s)
        if peer not in self.reachable:
            raise DialError(f"{peer} is down")
        self.connect_now(peer)

    def connect_now(self, *peers: ID) -> None:
        for peer in peers:
            self.network.conns[peer] = [Conn()]

    def disconnect(self, peer: ID) -> None:
        for conn in self.network.conns.pop(peer, []):
            conn.is_closed = True

    def emit(self, event: Any) -> None:
        self.events.append(event)

    # the relay client
    async def reserve(self, relay: ID) -> Reservation:
        self.asked.append(relay)
        await trio.sleep(0)
        if relay in self.refusing:
            raise RelayError("RESERVATION_REFUSED: no slots", 200)
        now = time.time()
        rsvp = Reservation(relay, now + self.ttl, [Multiaddr("/ip4/81.2.69.1/tcp/4001")], Limit(), reserved_at=now)
        self.reservations[relay] = rsvp
        return rsvp

    def drop(self, relay: ID) -> None:
        self.dropped.append(relay)
        self.reservations.pop(relay, None)

    def expire(self, relay: ID, at: float, *, life: float | None = None) -> None:
        """``relay``'s slot ends at ``at`` (a slot of ``life`` seconds, if given)."""
        rsvp = replace(self.reservations[relay], expire=at)
        self.reservations[relay] = rsvp if life is None else replace(rsvp, reserved_at=at - life)

    def kinds(self) -> list[tuple[str, ID]]:
        return [(e.event, e.relay) for e in self.events]


@dataclass
class Run:
    desk: Desk
    auto: AutoRelay
    relays: set[ID]
    wanted: list[bool]
    passes: list[float]
    changes: list[float]

    async def settle(self, seconds: float = 0.0) -> None:
        await trio.sleep(seconds)
        await trio.testing.wait_all_tasks_blocked()


@asynccontextmanager
async def running(desk: Desk, relays: set[ID], *, wanted: bool = True, start: bool = True,
                  **config: Any) -> AsyncIterator[Run]:
    passes: list[float] = []
    changes: list[float] = []
    state = [wanted]
    auto = AutoRelay(desk, desk, AutoRelayConfig(**config), lambda p: p in relays,  # type: ignore[arg-type]
                     lambda: changes.append(trio.current_time()))
    run = Run(desk, auto, relays, state, passes, changes)
    async with trio.open_nursery() as nursery:
        if start:
            nursery.start_soon(auto.run, lambda: state[0], lambda: passes.append(trio.current_time()))
            await run.settle()
        yield run
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize("field_name", ["refresh_before", "poll_interval", "peer_source_interval", "dial_timeout",
                                        "lost_relay_memory"])
def test_every_period_must_be_positive(field_name: str) -> None:
    AutoRelayConfig(**{field_name: 0.001}).validate()
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match="^autorelay refresh_before, poll_interval, peer_source_interval, "
                           "dial_timeout and lost_relay_memory must be positive$"):
            AutoRelayConfig(**{field_name: bad}).validate()


def test_at_least_one_relay() -> None:
    AutoRelayConfig(max_relays=1).validate()
    with pytest.raises(ConfigError, match="^autorelay max_relays must be at least 1$"):
        AutoRelayConfig(max_relays=0).validate()


def test_the_defaults() -> None:
    c = AutoRelayConfig()
    assert (c.enabled, c.max_relays, c.refresh_before, c.poll_interval, c.peer_source_interval, c.dial_timeout,
            c.lost_relay_memory) == (True, 2, 300.0, 5.0, 30.0, 10.0, 3600.0)


# ---------------------------------------------------------------------- connected relays


async def test_it_reserves_on_connected_relays_up_to_max_relays(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(pid(1), pid(2), pid(3), pid(4))
    async with running(desk, {pid(2), pid(3), pid(4), ME}) as run:
        assert desk.asked == [pid(2), pid(3)] and set(desk.reservations) == {pid(2), pid(3)}
        assert [type(e) for e in desk.events] == [nev.RelayReserved] * 2
        first = desk.events[0]
        assert first.relay == pid(2) and first.expire == desk.reservations[pid(2)].expire
        assert first.addrs == [f"/ip4/81.2.69.1/tcp/4001/p2p/{pid(2)}/p2p-circuit"]
        assert len(run.changes) == 2 and run.passes == [0.0]
        assert desk.dials == []  # connected already: no dial


async def test_itself_is_never_its_own_relay(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(ME, pid(1))
    async with running(desk, {ME, pid(1)}, max_relays=3):
        assert desk.asked == [pid(1)]


async def test_a_refusal_is_logged_and_the_next_relay_asked(autojump_clock: trio.testing.MockClock,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nat.autorelay")
    desk = Desk(refusing={pid(1)})
    desk.connect_now(pid(1), pid(2))
    async with running(desk, {pid(1), pid(2)}, max_relays=1) as run:
        assert desk.asked == [pid(1), pid(2)] and set(desk.reservations) == {pid(2)}
        assert desk.kinds() == [("relay_reserved", pid(2))] and len(run.changes) == 1
    assert [r.getMessage() for r in caplog.records if r.name == "nat.autorelay"] == [
        f"reservation on {pid(1)} failed: RESERVATION_REFUSED: no slots"]


async def test_it_sleeps_a_poll_interval_and_wakes_at_once_when_told(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    async with running(desk, {pid(1)}, poll_interval=7.0) as run:
        await run.settle(20)
        assert run.passes == [0.0, 7.0, 14.0]
        desk.connect_now(pid(1))
        run.auto.wake()
        await run.settle()
        assert run.passes[-1] == pytest.approx(20.0) and set(desk.reservations) == {pid(1)}


async def test_nothing_is_reserved_while_it_is_not_wanted_or_disabled(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(pid(1))
    async with running(desk, {pid(1)}, wanted=False) as run:
        assert desk.asked == [] and run.passes == [0.0]
        run.wanted[0] = True
        run.auto.wake()
        await run.settle()
        assert desk.asked == [pid(1)]
    desk = Desk()
    desk.connect_now(pid(1))
    async with running(desk, {pid(1)}, enabled=False) as run:
        assert desk.asked == [] and run.passes == [0.0]


# ---------------------------------------------------------------------- refreshing


async def test_a_slot_is_renewed_when_a_quarter_of_its_life_is_left(autojump_clock: trio.testing.MockClock) -> None:
    """refresh_before (300 s) or a quarter of the slot's life, whichever is less: a slot of 400 s is
    renewed with under 100 s left; a slot of 2 hours with under 300 s."""
    desk = Desk()
    desk.connect_now(pid(1), pid(2))
    async with running(desk, {pid(1), pid(2)}) as run:
        now = time.time()
        desk.reservations[pid(1)] = Reservation(pid(1), now + 101, [], Limit(), reserved_at=now - 299)  # life 400
        desk.reservations[pid(2)] = Reservation(pid(2), now + 301, [], Limit(), reserved_at=now - 6899)  # 2 hours
        desk.asked.clear()
        run.auto.wake()
        await run.settle()
        assert desk.asked == []
        desk.expire(pid(1), now + 99)
        desk.expire(pid(2), now + 299)
        run.auto.wake()
        await run.settle()
        assert desk.asked == [pid(1), pid(2)]
        assert desk.kinds() == [("relay_reserved", pid(1)), ("relay_reserved", pid(2))]  # renewals emit nothing new
        assert len(run.changes) == 2


async def test_a_renewal_refused_loses_the_relay(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk(ttl=100)
    desk.connect_now(pid(1))
    async with running(desk, {pid(1)}, max_relays=1) as run:
        desk.refusing.add(pid(1))
        desk.expire(pid(1), time.time() + 10, life=100)
        run.auto.wake()
        await run.settle()
        assert pid(1) not in desk.reservations and desk.dropped == [pid(1)]
        assert desk.kinds()[1:] == [("relay_lost", pid(1))]
        assert desk.events[1].reason == "RESERVATION_REFUSED: no slots"
        assert len(run.changes) == 2


async def test_back_from_public_every_slot_is_renewed_at_once(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(pid(1))
    async with running(desk, {pid(1)}) as run:
        assert desk.asked == [pid(1)]
        run.wanted[0] = False
        run.auto.wake()
        await run.settle()
        run.auto.wake()
        await run.settle()
        assert desk.asked == [pid(1)]
        run.wanted[0] = True
        run.auto.wake()
        await run.settle()
        assert desk.asked == [pid(1), pid(1)]  # renewed although far from its end
        run.auto.wake()
        await run.settle()
        assert desk.asked == [pid(1), pid(1)]  # once


async def test_while_public_an_expired_slot_is_forgotten(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(pid(1), pid(2))
    async with running(desk, {pid(1), pid(2)}) as run:
        run.wanted[0] = False
        now = time.time()
        desk.expire(pid(1), now - 1)
        desk.expire(pid(2), now + 60)
        run.auto.wake()
        await run.settle()
        assert set(desk.reservations) == {pid(2)}
        assert (desk.events[-1].relay, desk.events[-1].reason) == (pid(1), "expired while we were public (not renewed)")
        assert len(run.changes) == 3
        desk.expire(pid(2), time.time())  # at its expiry exactly: gone too
        run.auto.wake()
        await run.settle()
        assert desk.reservations == {}


# ---------------------------------------------------------------------- lost relays


async def test_a_relay_gone_from_our_connections_is_lost_and_dialed_again(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="nat.autorelay")
    desk = Desk()
    desk.connect_now(pid(1))
    async with running(desk, {pid(1)}, max_relays=1, dial_timeout=4.0) as run:
        desk.disconnect(pid(1))
        run.auto.wake()
        await run.settle()
        assert desk.kinds() == [("relay_reserved", pid(1)), ("relay_lost", pid(1))]
        assert desk.events[1].reason == "disconnected"
        assert desk.dials == [(pid(1), 4.0, True)]  # by id, from the listen port: it is down
        said = [r.getMessage() for r in caplog.records if r.name == "nat.autorelay"]
        assert said == [f"relay {pid(1)} that held our slot unreachable: {pid(1)} is down"]
        assert [r.levelno for r in caplog.records if r.name == "nat.autorelay"] == [logging.DEBUG]
        desk.reachable.add(pid(1))
        await run.settle(5)
        assert set(desk.reservations) == {pid(1)} and len(desk.dials) == 2
        assert desk.kinds()[-1] == ("relay_reserved", pid(1))
        await run.settle(30)
        assert len(desk.dials) == 2  # reserved again: no longer among the lost


async def test_the_latest_lost_relay_is_dialed_first(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(pid(1), pid(2))
    async with running(desk, {pid(1), pid(2)}, max_relays=2) as run:
        desk.disconnect(pid(1))
        run.auto.lost(pid(1), "closed")
        await trio.sleep(1)
        desk.disconnect(pid(2))
        run.auto.lost(pid(2), "closed")
        desk.dials.clear()
        desk.reachable |= {pid(1), pid(2)}
        desk.network.conns[pid(3)] = [Conn()]  # not a relay
        run.auto.wake()
        await run.settle()
        assert [d[0] for d in desk.dials] == [pid(2), pid(1)]


async def test_lost_only_counts_for_a_relay_holding_our_slot(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    async with running(desk, set(), start=False) as run:
        run.auto.lost(pid(9), "closed")
        assert desk.events == [] and run.changes == [] and desk.dropped == []


async def test_a_lost_relay_is_forgotten_after_lost_relay_memory(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(pid(1))
    async with running(desk, {pid(1)}, max_relays=1, lost_relay_memory=100.0, poll_interval=10.0) as run:
        await run.settle(55)
        desk.disconnect(pid(1))
        run.auto.lost(pid(1), "closed")  # at 55 s
        run.auto.wake()
        await run.settle(99)
        assert [round(t) for t in run.passes[-10:]] == list(range(55, 155, 10))
        tries = len(desk.dials)
        assert tries == 10  # at 55 s, then every 10 s to 145 s
        await run.settle(30)
        assert len(desk.dials) == tries + 1  # the pass at 155 s (100 s after) still tries; at 165 s it is forgotten


async def test_a_lost_relay_connected_again_is_asked_by_the_connection_pass(
        autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(pid(1))
    async with running(desk, {pid(1)}, max_relays=1) as run:
        desk.disconnect(pid(1))
        run.auto.lost(pid(1), "closed")
        desk.connect_now(pid(1))
        desk.asked.clear()
        run.auto.wake()
        await run.settle()
        assert desk.dials == [] and desk.asked == [pid(1)]


async def test_lost_relays_stop_being_dialed_once_the_slots_are_full(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(pid(1), pid(2))
    async with running(desk, {pid(1), pid(2), pid(3)}, max_relays=2) as run:
        for relay in (pid(1), pid(2)):
            desk.disconnect(relay)
            run.auto.lost(relay, "closed")
            await trio.sleep(1)
        desk.reachable |= {pid(1), pid(2)}
        desk.connect_now(pid(3))
        run.auto.wake()
        await run.settle()
        assert set(desk.reservations) == {pid(3), pid(2)} and [d[0] for d in desk.dials] == [pid(2)]


# ---------------------------------------------------------------------- the peer source


def source(answers: list[list[tuple[ID, list[Multiaddr]]]], asked: list[tuple[float, set[ID]]],
           fail: Exception | None = None) -> Callable[[set[ID]], Any]:
    async def ask(exclude: set[ID]) -> list[tuple[ID, list[Multiaddr]]]:
        asked.append((trio.current_time(), set(exclude)))
        if fail is not None:
            raise fail
        return answers.pop(0) if answers else []

    return ask


def addrs(n: int) -> list[Multiaddr]:
    return [Multiaddr(f"/ip4/81.2.69.{n}/tcp/4001")]


async def test_the_peer_source_fills_what_connections_do_not(autojump_clock: trio.testing.MockClock,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nat.autorelay")
    desk = Desk(reachable={pid(5), pid(6), pid(7)})
    desk.connect_now(pid(1), pid(2))
    asked: list[tuple[float, set[ID]]] = []
    answer = [(pid(1), addrs(1)), (pid(4), addrs(4)), (ME, addrs(9)), (pid(8), addrs(8)), (pid(5), addrs(5)),
              (pid(6), addrs(6)), (pid(7), addrs(7))]
    async with running(desk, {pid(1)}, start=False, max_relays=3, dial_timeout=3.0) as run:
        run.auto.use_peer_source(source([answer], asked))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.auto.run, lambda: True, lambda: None)
            await run.settle()
            nursery.cancel_scope.cancel()
        assert asked == [(0.0, {ME, pid(1), pid(2)})]
        # pid(1) is excluded (reserved), pid(4) and pid(8) are down, pid(5) and pid(6) fill the slots
        assert [d[0] for d in desk.dials] == [[Multiaddr(f"/ip4/81.2.69.{n}/tcp/4001/p2p/{pid(n)}")] for n in (4, 8, 5, 6)]
        assert all(d[1:] == (3.0, True) for d in desk.dials)
        assert set(desk.reservations) == {pid(1), pid(5), pid(6)} and run.auto.discovered == 2
    said = [r.getMessage() for r in caplog.records if r.name == "nat.autorelay"]
    assert said == [f"relay {pid(n)} from the peer source unreachable: {pid(n)} is down" for n in (4, 8)]


async def test_the_peer_source_is_asked_once_a_peer_source_interval(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    asked: list[tuple[float, set[ID]]] = []
    async with running(desk, set(), start=False, poll_interval=4.0, peer_source_interval=10.0) as run:
        run.auto.use_peer_source(source([], asked))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.auto.run, lambda: True, lambda: None)
            await run.settle(25)
            assert [t for t, _ in asked] == [0.0, 12.0, 24.0]
            run.auto.use_peer_source(source([], asked))  # a new source is asked at once
            await run.settle()
            assert [t for t, _ in asked] == [0.0, 12.0, 24.0, 25.0]
            nursery.cancel_scope.cancel()


async def test_a_failing_peer_source_is_logged_and_asked_next_time(autojump_clock: trio.testing.MockClock,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nat.autorelay")
    desk = Desk()
    asked: list[tuple[float, set[ID]]] = []
    async with running(desk, set(), start=False) as run:
        run.auto.use_peer_source(source([], asked, fail=LookupError("no replica answered")))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.auto.run, lambda: True, lambda: None)
            await run.settle(31)
            nursery.cancel_scope.cancel()
    assert [t for t, _ in asked] == [0.0, 30.0]
    said = [r.getMessage() for r in caplog.records if r.name == "nat.autorelay"]
    assert said == ["no relays from the peer source: no replica answered"] * 2


async def test_no_peer_source_is_asked_when_the_slots_are_full(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk()
    desk.connect_now(pid(1))
    asked: list[tuple[float, set[ID]]] = []
    async with running(desk, {pid(1)}, start=False, max_relays=1) as run:
        run.auto.use_peer_source(source([[(pid(2), addrs(2))]], asked))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.auto.run, lambda: True, lambda: None)
            await run.settle(100)
            nursery.cancel_scope.cancel()
    assert asked == [] and desk.dials == []
    run.auto.use_peer_source(None)


async def test_a_candidate_connected_meanwhile_is_not_dialed(autojump_clock: trio.testing.MockClock) -> None:
    desk = Desk(reachable={pid(2), pid(3)}, dial_s=1.0)
    asked: list[tuple[float, set[ID]]] = []
    async with running(desk, set(), start=False, max_relays=3) as run:
        async def ask(exclude: set[ID]) -> list[tuple[ID, list[Multiaddr]]]:
            asked.append((trio.current_time(), exclude))
            desk.connect_now(pid(3))  # connected while the DHT was asked
            return [(pid(2), addrs(2)), (pid(3), addrs(3))]

        run.auto.use_peer_source(ask)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.auto.run, lambda: True, lambda: None)
            await run.settle(4)
            nursery.cancel_scope.cancel()
    assert [d[0] for d in desk.dials] == [[Multiaddr(f"/ip4/81.2.69.2/tcp/4001/p2p/{pid(2)}")]]
    assert set(desk.reservations) == {pid(2)} and run.auto.discovered == 1


async def test_lost_relays_already_reserved_or_connected_are_not_dialed_and_the_others_are(
        autojump_clock: trio.testing.MockClock) -> None:
    """Four relays lost in turn (the latest is dialed first): pid(4) is reserved again through its connection,
    pid(3) is connected but refuses (the connection pass asked it: not dialed), pid(2) and pid(1) are down and
    dialed, each in the same pass."""
    desk = Desk()
    relays = {pid(1), pid(2), pid(3), pid(4)}
    desk.connect_now(*relays)
    async with running(desk, relays, max_relays=4) as run:
        for n in (1, 2, 3, 4):
            desk.disconnect(pid(n))
            run.auto.lost(pid(n), "closed")
            await trio.sleep(1)
        desk.connect_now(pid(3), pid(4))
        desk.refusing.add(pid(3))
        desk.asked.clear()
        run.auto.wake()
        await run.settle()
        assert desk.asked == [pid(3), pid(4)] and set(desk.reservations) == {pid(4)}
        assert [d[0] for d in desk.dials] == [pid(2), pid(1)]


async def test_slots_kept_from_before_a_start_are_not_renewed_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """A restart brings back the slots it kept (nat/circuit.py keeps them on disk): renewed when due, not at
    once (only a return from public renews every slot)."""
    desk = Desk()
    desk.connect_now(pid(1))
    await desk.reserve(pid(1))
    desk.asked.clear()
    async with running(desk, {pid(1)}, max_relays=1) as run:
        await run.settle(20)
        assert desk.asked == [] and desk.events == []


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """autorelay's wall clock (reservation expiries are the relay's unix times), held still."""
    now = [time.time()]
    monkeypatch.setattr("nat.autorelay.time", SimpleNamespace(time=lambda: now[0]))
    return now


async def test_a_slot_is_renewed_only_once_strictly_under_its_margin(
        autojump_clock: trio.testing.MockClock, wall: list[float]) -> None:
    desk = Desk()
    desk.connect_now(pid(1))
    async with running(desk, {pid(1)}, max_relays=1, refresh_before=300.0) as run:
        desk.asked.clear()
        desk.expire(pid(1), wall[0] + 300, life=3600)  # 300 s left: not yet
        run.auto.wake()
        await run.settle()
        assert desk.asked == []
        desk.expire(pid(1), wall[0] + 100, life=400)  # a quarter of 400 s left, exactly: not yet
        run.auto.wake()
        await run.settle()
        assert desk.asked == []
        wall[0] += 0.5
        run.auto.wake()
        await run.settle()
        assert desk.asked == [pid(1)]


async def test_while_public_a_slot_at_its_expiry_exactly_is_forgotten(
        autojump_clock: trio.testing.MockClock, wall: list[float]) -> None:
    desk = Desk()
    desk.connect_now(pid(1), pid(2))
    async with running(desk, {pid(1), pid(2)}, wanted=False) as run:
        for relay in (pid(1), pid(2)):
            await desk.reserve(relay)
        desk.expire(pid(1), wall[0])
        desk.expire(pid(2), wall[0] + 0.001)
        run.auto.wake()
        await run.settle()
        assert set(desk.reservations) == {pid(2)}
