"""nat/holepunch.py on a desk: both sides of DCUtR, driven through whole upgrades in virtual time.

Each side's Node is a :class:`PunchDesk`: its connections, the peer addresses it knows, what
identify tells it, and its dials, which follow a script per address (connects after so many
seconds, refused, or never answers). The CONNECT/SYNC exchange runs over in-memory streams into the
other side's handler, a relayed round trip as long as the test says. So a round's timing (the
punch half a round trip after SYNC, the listener wait of two) and every retry's are measured
exactly (``autojump_clock``), and a mutation of the module is judged in milliseconds.

The same module over real sockets and a real relay: ``tests/test_holepunch.py``; through NATs:
``tests/test_nat_matrix.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

import nat.holepunch
from nat.holepunch import (MAX_PUNCH_ADDRS, PROTOCOL, HolePunchConfig, HolePuncher, PunchMethod, PunchResult,
                           RetrySchedule)
from nat.proto import holepunch_pb2 as pb
from p2p.errors import ConfigError
from p2p.hooks import Registration
from p2p.resources import ResourceLimitExceeded
from p2p.resources import Scope as ResourceScope
from p2p.varint import encode_varint
from p2p.wire import read_message, write_message

from .kit import End, ends, log_lines, random_peer_id

PING = "/ipfs/ping/1.0.0"
RELAY = random_peer_id()
#: public addresses: A's, B's, and more
A_ADDR = Multiaddr("/ip4/81.2.69.1/tcp/4001")
A_ADDR2 = Multiaddr("/ip4/81.2.69.2/tcp/4001")
B_ADDR = Multiaddr("/ip4/89.160.20.1/tcp/4001")
B_ADDR2 = Multiaddr("/ip4/89.160.20.2/tcp/4001")
PRIVATE = Multiaddr("/ip4/192.168.1.5/tcp/4001")
OVER_RATE = ResourceLimitExceeded(ResourceScope.SERVICE, "requests a second", 2, what="dcutr")
MANY = [Multiaddr(f"/ip4/1.2.{i // 200}.{i % 200 + 1}/tcp/{4001 + i}") for i in range(40)]


class Link:
    """A connection: relayed or direct by its address; ``carries``: a ping on it comes back."""

    def __init__(self, addr: Multiaddr, peer: ID, *, carries: bool = True) -> None:
        self.addr = addr
        self.muxed_conn = SimpleNamespace(peer_id=peer)
        self.carries = carries
        self.is_closed = False
        self.streams: list[object] = []
        self.closed_at: float | None = None

    def get_transport_addresses(self) -> list[Multiaddr]:
        return [self.addr]

    def get_streams(self) -> list[object]:
        return self.streams

    async def close(self) -> None:
        await trio.sleep(0)  # a checkpoint, as a real close has: where a cancellation would cut it
        self.is_closed = True
        self.closed_at = trio.current_time()


@dataclass
class Reach:
    """How a dial of one address goes: a connection after ``after`` seconds (or once ``gate`` is set),
    ``error`` raised, or (``after`` None) no answer ever. ``carries``: the connection passes a ping;
    ``relayed``: the swarm handed back a relayed connection."""

    after: float | None = 0.0
    error: BaseException | None = None
    carries: bool = True
    relayed: bool = False
    gate: trio.Event | None = None


class PunchDesk:
    """What HolePuncher needs of a Node, on a desk (see the module docstring)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.peer_id = random_peer_id()
        self.nursery = nursery
        self.other: PunchDesk | None = None
        self.conns: dict[ID, list[Link]] = {}
        self.store: dict[ID, list[Multiaddr]] = {}
        #: what identify of us tells the other side (our listen addresses)
        self.advertised: list[Multiaddr] = []
        #: how identify of the other side goes: seconds it takes, or an error
        self.identify_after = 0.0
        self.identify_error: BaseException | None = None
        self.identified: list[tuple[ID, float, float]] = []
        self.handlers: dict[str, Callable[[Any], Awaitable[None]]] = {}
        #: our dials by address (without peer id); an address not here is refused
        self.reach: dict[str, Reach] = {}
        #: (how, address, source or listener_after, time) per dial
        self.dials: list[tuple[str, str, Any, float]] = []
        self.made: list[Link] = []
        #: seconds before the other side's DCUtR handler starts (a relayed round trip, as seen by the dialer)
        self.relay_delay = 0.0
        self.refuse_dcutr: BaseException | None = None
        self.ends: list[End] = []
        #: the ping streams' far ends, and what the pinged side read
        self.pinged: list[bytes] = []
        #: the resource manager's rate checks asked: (service, peer, time)
        self.asked: list[tuple[str, str, float]] = []
        self.resources = SimpleNamespace(allow=self._allow)
        self.network = SimpleNamespace(get_connections=lambda peer: [c for c in self.conns.get(peer, []) if not c.is_closed],
                                       dial_addr=self._dial_addr, desk=self)

    # -------------------------------------------------------------- Node's surface

    def set_stream_handler(self, protocol: str, handler: Callable[[Any], Awaitable[None]]) -> Registration:
        self.handlers[protocol] = handler
        return Registration(lambda: self.handlers.pop(protocol))

    def known_addrs(self, peer: ID) -> list[Multiaddr]:
        assert self.other is not None and peer == self.other.peer_id
        return list(self.store.get(peer, []))

    def listen_source(self, addr: Multiaddr) -> tuple[str, int]:
        """Our listen socket of the address's family (a port of each address, to tell them apart)."""
        return ("0.0.0.0", int(addr.value_for_protocol("tcp")))

    async def identify(self, peer: ID, *, timeout: float) -> None:
        self.identified.append((peer, timeout, trio.current_time()))
        with trio.fail_after(timeout):
            await trio.sleep(self.identify_after)
        if self.identify_error is not None:
            raise self.identify_error
        assert self.other is not None and peer == self.other.peer_id
        self.store[peer] = list(self.other.advertised)

    async def new_stream_on(self, conn: Link, protocol: str, *, lazy: bool = False) -> End:
        assert self.other is not None
        other = self.other
        mine, theirs = ends(self.peer_id, other.peer_id)
        self.ends.append(mine)
        if protocol == PING:
            if conn.carries:
                self.nursery.start_soon(other._echo, theirs)
            return mine
        assert protocol == PROTOCOL and lazy and conn.addr.value_for_protocol("p2p") is not None

        async def serve() -> None:
            await trio.sleep(self.relay_delay)
            await other.handlers[PROTOCOL](theirs)

        self.nursery.start_soon(serve)
        return mine

    async def _echo(self, stream: End) -> None:
        """The ping's far side, echoing what it reads in halves (a read may return part of a ping)."""
        while data := await stream.read(64):
            self.pinged.append(data)
            half = len(data) // 2
            await stream.write(data[:half])
            await trio.sleep(0.001)
            await stream.write(data[half:])

    def _allow(self, service: str, peer: str, now: float) -> None:
        self.asked.append((service, peer, now))
        if self.refuse_dcutr is not None:
            raise self.refuse_dcutr

    # -------------------------------------------------------------- dials

    async def dial(self, how: str, addr: Multiaddr, peer: ID, extra: Any) -> Link:
        assert self.other is not None and peer == self.other.peer_id and "/p2p/" not in str(addr)
        self.dials.append((how, str(addr), extra, trio.current_time()))
        reach = self.reach.get(str(addr), Reach(0.0, ConnectionRefusedError("refused (desk)")))
        if reach.after is None:
            await trio.sleep_forever()
        assert reach.after is not None
        await (trio.sleep(reach.after) if reach.gate is None else reach.gate.wait())
        if reach.error is not None:
            raise reach.error
        link = Link(Multiaddr(f"/ip4/198.51.100.9/tcp/4001/p2p/{RELAY}/p2p-circuit") if reach.relayed else addr,
                    peer, carries=reach.carries)
        self.made.append(link)
        self.conns.setdefault(peer, []).append(link)
        return link

    async def _dial_addr(self, addr: Multiaddr, peer: ID, source: Any = None) -> Link:
        return await self.dial("dial", addr, peer, source)


async def simultaneous(network: Any, addr: Multiaddr, peer: ID, *, source: Any, listener_after: float) -> Link:
    """:func:`p2p.dialer.dial_simultaneous` on a desk."""
    desk: PunchDesk = network.desk
    return await desk.dial("simultaneous", addr, peer, (source, listener_after))


@dataclass
class Pair:
    """A dialed B through a relay: B got the relayed connection inbound and leads."""

    a: PunchDesk
    b: PunchDesk
    pa: HolePuncher
    pb: HolePuncher
    a_offer: list[Multiaddr] = field(default_factory=list)
    b_offer: list[Multiaddr] = field(default_factory=list)

    @property
    def relayed(self) -> Link:
        return self.b.conns[self.a.peer_id][0]

    async def upgrade(self) -> PunchResult:
        return await self.pb.upgrade(self.a.peer_id, self.relayed)  # type: ignore[arg-type]


def pair(nursery: trio.Nursery, **config: Any) -> Pair:
    a, b = PunchDesk(nursery), PunchDesk(nursery)
    a.other, b.other = b, a
    base = {"attempts": 2, "dial_timeout": 5.0, "grace": 2.0}
    pa = HolePuncher(a, lambda: p.a_offer, HolePunchConfig(**{**base, **config}))  # type: ignore[arg-type]
    pb = HolePuncher(b, lambda: p.b_offer, HolePunchConfig(**{**base, **config}))  # type: ignore[arg-type]
    p = Pair(a, b, pa, pb)
    pa.install(nursery)
    pb.install(nursery)
    circuit = f"/ip4/198.51.100.9/tcp/4001/p2p/{RELAY}/p2p-circuit"
    a.conns[b.peer_id] = [Link(Multiaddr(f"{circuit}/p2p/{b.peer_id}"), b.peer_id)]
    b.conns[a.peer_id] = [Link(Multiaddr(circuit), a.peer_id)]
    return p


def punching(nursery: trio.Nursery, reach: Reach, **config: Any) -> Pair:
    """A pair where A offers A_ADDR in the exchange and B's punch dial of it goes as ``reach`` says."""
    p = pair(nursery, **config)
    p.a_offer = [A_ADDR]
    p.b.reach[str(A_ADDR)] = reach
    return p


@pytest.fixture(autouse=True)
def desk_dials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nat.holepunch, "dial_simultaneous", simultaneous)


def frame(message: pb.HolePunch) -> bytes:
    body = message.SerializeToString()
    return encode_varint(len(body)) + body


# ---------------------------------------------------------------------- configuration and metrics


ATTEMPTS = "hole punch attempts must be at least 1"
TIMEOUTS = "hole punch timeouts must be positive"
RETRIES = "hole punch retries must not be negative and retry_poll and retry_idle must be positive"
REIDENTIFY = "hole punch reidentify_after must be positive and reidentify_times not negative"


@pytest.mark.parametrize(("change", "says"), [
    ({"attempts": 0}, ATTEMPTS), ({"dial_timeout": 0}, TIMEOUTS), ({"grace": -1}, TIMEOUTS), ({"drain": -1}, TIMEOUTS),
    ({"retries": -1}, RETRIES), ({"retry_backoff": -1}, RETRIES), ({"retry_poll": 0}, RETRIES), ({"retry_idle": 0}, RETRIES),
    ({"reidentify_after": 0}, REIDENTIFY), ({"reidentify_times": -1}, REIDENTIFY),
])
def test_a_config_out_of_range_is_refused_by_name(change: dict[str, float], says: str) -> None:
    with pytest.raises(ConfigError) as info:
        HolePunchConfig(**change).validate()  # type: ignore[arg-type]
    assert str(info.value) == says
    with pytest.raises(ConfigError):
        HolePuncher(SimpleNamespace(), lambda: [], HolePunchConfig(**change))  # type: ignore[arg-type]


def test_the_edges_of_the_config_are_allowed() -> None:
    HolePunchConfig(attempts=1, grace=0, drain=0, retries=0, retry_backoff=0, reidentify_times=0).validate()
    HolePunchConfig(dial_timeout=0.1, retry_poll=0.1, retry_idle=0.5, reidentify_after=0.1).validate()


def test_the_retry_schedule_after_nothing_to_dial_and_after_a_failed_dial() -> None:
    config = HolePunchConfig(retries=2, retry_backoff=2.0, retry_poll=1.0, retry_idle=30.0, reidentify_after=0.5,
                             reidentify_times=2)
    schedule = RetrySchedule.start(config)
    # nothing to dial at t=10: ask at 10.5, then 11.5, then no more; a change counts at once
    assert schedule.after(True, 10.0)
    assert schedule.wake(10.0) == 10.5 and not schedule.identify_due(10.4) and schedule.identify_due(10.5)
    schedule.identified(10.5)
    assert schedule.next_identify == 11.5 and schedule.wake(10.6) == 11.5
    schedule.identified(11.5)
    assert schedule.next_identify is None and schedule.wake(12.0) == 13.0
    assert schedule.retry_due(10.1, changed=True) == "addresses changed"
    assert schedule.retry_due(39.9, changed=False) is None
    assert schedule.retry_due(40.0, changed=False) == "nothing changed in 30 s"
    schedule.retried()
    # a dial that failed at t=50: a change counts only from 54 (the backoff, doubled by the retry: 4 s)
    assert schedule.after(False, 50.0)
    assert schedule.next_identify is None and not schedule.identify_due(1e9)
    assert schedule.retry_due(53.9, changed=True) is None
    assert schedule.retry_due(54.0, changed=True) == "addresses changed"
    assert schedule.retry_due(109.9, changed=False) is None and schedule.retry_due(110.0, changed=False)
    schedule.retried()
    assert not schedule.after(True, 120.0)  # two retries, all there were


def test_no_reidentify_when_turned_off_and_one_when_once() -> None:
    schedule = RetrySchedule.start(HolePunchConfig(reidentify_times=0))
    assert schedule.after(True, 0.0) and schedule.next_identify is None
    schedule = RetrySchedule.start(HolePunchConfig(reidentify_times=1, reidentify_after=0.5))
    assert schedule.after(True, 0.0) and schedule.next_identify == 0.5
    schedule.identified(0.5)
    assert schedule.next_identify is None


async def test_install_serves_dcutr_and_metrics_start_at_zero(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        assert p.a.handlers[PROTOCOL] == p.pa._on_stream
        assert p.pa.metrics() == {"punch_attempts": 0, "punch_successes": 0, "punch_first_try": 0, "reversals": 0,
                                  "punch_failures": 0, "punch_retries": 0, "punch_reidentified": 0,
                                  "time_to_direct": []}
        assert HolePuncher(p.a, lambda: []).config == HolePunchConfig()  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()


def test_the_offer_is_public_tcp_without_peer_ids_at_most_sixteen() -> None:
    desk = SimpleNamespace()
    offer = [PRIVATE, Multiaddr(f"/ip4/1.1.1.1/tcp/1/p2p/{RELAY}/p2p-circuit"), Multiaddr("/ip4/1.1.1.1/udp/1/quic-v1"),
             Multiaddr(f"{A_ADDR}/p2p/{RELAY}")] + MANY
    puncher = HolePuncher(desk, lambda: offer)  # type: ignore[arg-type]
    assert [Multiaddr(x) for x in puncher._offer()] == [A_ADDR] + MANY[:15]
    private = HolePuncher(desk, lambda: offer, HolePunchConfig(allow_private=True))  # type: ignore[arg-type]
    assert [Multiaddr(x) for x in private._offer()][:2] == [PRIVATE, A_ADDR]


# ---------------------------------------------------------------------- reversal: a plain dial back


async def test_a_peer_known_to_listen_publicly_is_dialed_back_and_the_relayed_connection_retired(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, grace=2.0, drain=60.0)
        p.b.store[p.a.peer_id] = [PRIVATE, A_ADDR, A_ADDR2]
        p.b.reach[str(A_ADDR)] = Reach(0.5, OSError("no route"))
        p.b.reach[str(A_ADDR2)] = Reach(0.25)
        relayed = p.relayed
        started = trio.current_time() - 1.0  # the relayed connection opened a second ago
        result = await p.pb.upgrade(p.a.peer_id, relayed, started)  # type: ignore[arg-type]
        assert result.conn is p.b.made[0] and result.method == PunchMethod.REVERSAL
        assert result.attempts == 0 and result.elapsed == pytest.approx(1.75) and not result.nothing_to_dial
        assert [(how, addr) for how, addr, _, _ in p.b.dials] == [("dial", str(A_ADDR)), ("dial", str(A_ADDR2))]
        assert [source for _, _, source, _ in p.b.dials] == [None, None]  # a reversal dials from any port
        s = p.pb.stats
        assert (s.reversals, s.successes, s.failures, s.attempts, s.first_try_successes) == (1, 1, 0, 0, 0)
        assert s.direct_dials == {"success": 1} and s.time_to_direct == [pytest.approx(1.75)] and not s.outcomes
        assert p.b.identified == [] and p.a.ends == []  # no exchange: nothing asked
        # retired after the grace period, once no stream is left on it
        relayed.streams.append(object())
        await trio.sleep(2.0 + 10.0)
        assert not relayed.is_closed
        relayed.streams.clear()
        await trio.sleep(0.3)  # looked at every 0.25 s
        assert relayed.is_closed
        nursery.cancel_scope.cancel()


async def reversed_with_a_stream_open(nursery: trio.Nursery, grace: float) -> tuple[Link, float]:
    """An upgrade by reversal while a stream nobody ends is on the relayed connection: that
    connection, and when the upgrade began."""
    p = pair(nursery, grace=grace, drain=60.0)
    p.b.store[p.a.peer_id] = [A_ADDR]
    p.b.reach[str(A_ADDR)] = Reach(0.0)
    p.relayed.streams.append(object())
    start = trio.current_time()
    assert (await p.upgrade()).conn is not None
    return p.relayed, start


async def test_a_stream_nobody_ends_keeps_the_relayed_connection_for_drain_at_most(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        relayed, start = await reversed_with_a_stream_open(nursery, grace=2.0)
        await trio.sleep(70.0)
        assert relayed.closed_at == pytest.approx(start + 62.0, abs=0.3)
        # a relayed connection that closed by itself ends the wait at once
        relayed, start = await reversed_with_a_stream_open(nursery, grace=1.0)
        await trio.sleep(1.5)
        relayed.is_closed = True
        await trio.sleep(0.3)
        assert relayed.closed_at == pytest.approx(start + 1.5, abs=0.3)
        nursery.cancel_scope.cancel()


async def test_a_reversal_dials_sixteen_of_hundreds_of_addresses_each_for_dial_timeout(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, dial_timeout=3.0, attempts=1)
        many = [Multiaddr(f"/ip4/198.{51 + i // 250}.{i % 250}.7/tcp/{1000 + i}") for i in range(300)]
        p.b.store[p.a.peer_id] = many
        p.a.advertised = many
        for addr in many:
            p.b.reach[str(addr)] = Reach(None)  # filtered: each dial waits out its timeout
        p.a.refuse_dcutr = OVER_RATE
        result = await p.upgrade()
        dialed = [(addr, at) for how, addr, _, at in p.b.dials if how == "dial"]
        # one by one, each for dial_timeout; and the late reversal dials none again (it was dialed)
        assert [addr for addr, _ in dialed] == [str(a) for a in many[:MAX_PUNCH_ADDRS]]
        gaps = [later - earlier for (_, earlier), (_, later) in zip(dialed, dialed[1:])]
        assert gaps == [pytest.approx(3.0)] * (MAX_PUNCH_ADDRS - 1)
        assert result.conn is None and p.pb.stats.direct_dials == {"failed": 1} and result.attempts == 1
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- the punch


async def test_a_punch_exchanges_addresses_and_both_sides_dial_in_time(autojump_clock: object) -> None:
    """B offers its public address and A its own; A dials B's at once (the initiator's plain dial, from
    its listen port) and B dials A's half a relayed round trip after SYNC, as the responder of a
    simultaneous open, waiting two round trips (at least 0.5 s) for A to speak."""
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        p.a_offer = [PRIVATE, A_ADDR]
        p.b_offer = [B_ADDR, PRIVATE]
        p.b.relay_delay = 0.4  # the relayed round trip B measures
        p.b.reach[str(A_ADDR)] = Reach(0.1)
        p.a.reach[str(B_ADDR)] = Reach(None)
        start = trio.current_time()
        result = await p.upgrade()
        assert result.method == PunchMethod.PUNCH and result.attempts == 1 and result.conn is p.b.made[0]
        ((how, addr, (source, listener_after), at),) = p.b.dials
        assert (how, addr, source) == ("simultaneous", str(A_ADDR), ("0.0.0.0", 4001))
        assert listener_after == pytest.approx(0.8)  # twice the round trip
        assert at - start == pytest.approx(0.4 + 0.2)  # SYNC after the round trip, then half of it
        ((how, addr, source, at),) = p.a.dials
        assert (how, addr, source) == ("dial", str(B_ADDR), ("0.0.0.0", 4001))
        assert at - start == pytest.approx(0.4)  # at SYNC
        s = p.pb.stats
        assert (s.attempts, s.successes, s.first_try_successes, s.reversals, s.failures) == (1, 1, 1, 0, 0)
        # the reversal had no address to dial; identify told nothing more, so no late one was dialed
        assert s.outcomes == {("initiator", 1, "success"): 1} and s.direct_dials == {"failed": 1}
        assert [e.finished for e in p.b.ends[:1]] == ["closed"]
        await trio.sleep_until(start + 0.4 + 5.0 - 0.01)  # A's dial hangs: it gives up after dial_timeout
        assert not p.pa.stats.outcomes
        await trio.sleep(0.02)
        assert p.pa.stats.outcomes == {("receiver", 1, "failed"): 1}
        assert [(peer, timeout) for peer, timeout, _ in p.b.identified] == [(p.a.peer_id, 5.0)]
        nursery.cancel_scope.cancel()


async def test_a_fast_round_trip_still_waits_half_a_second_for_the_peer_to_speak(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        p.a_offer = [A_ADDR]
        p.b.relay_delay = 0.1
        p.b.reach[str(A_ADDR)] = Reach(0.0)
        assert (await p.upgrade()).method == PunchMethod.PUNCH
        ((_, _, (_, listener_after), _),) = p.b.dials
        assert listener_after == 0.5
        assert p.pa.stats.outcomes == {("receiver", 1, "no_suitable_address"): 1}  # B offered nothing public
        nursery.cancel_scope.cancel()


async def test_the_first_of_several_punched_connections_wins_and_the_rest_are_cut(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        p.a_offer = [A_ADDR, A_ADDR2, MANY[0]]
        p.b.reach[str(A_ADDR)] = Reach(1.0)
        p.b.reach[str(A_ADDR2)] = Reach(0.2, relayed=True)  # the swarm's relayed connection: no punch
        p.b.reach[str(MANY[0])] = Reach(0.4)
        result = await p.upgrade()
        assert result.conn is not None and result.conn.addr == MANY[0]  # type: ignore[attr-defined]
        assert sorted(addr for _, addr, _, _ in p.b.dials) == sorted(str(a) for a in p.a_offer)
        assert len(p.b.made) == 2  # A_ADDR's dial was cut before it connected
        nursery.cancel_scope.cancel()


async def test_the_loser_of_a_photo_finish_is_closed(autojump_clock: object) -> None:
    """Two punch dials connect in the same moment: one is kept, the other closed, although the
    nursery it closes in is being cancelled (a close cut at its checkpoint would leave a second
    direct connection nobody holds)."""
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        p.a_offer = [A_ADDR, A_ADDR2]
        both = trio.Event()
        p.b.reach[str(A_ADDR)] = p.b.reach[str(A_ADDR2)] = Reach(0.0, gate=both)

        async def connect_both() -> None:
            await trio.sleep(1.0)
            both.set()

        nursery.start_soon(connect_both)
        result = await p.upgrade()
        assert len(p.b.made) == 2 and result.conn in p.b.made
        (loser,) = [link for link in p.b.made if link is not result.conn]
        assert loser.is_closed and not result.conn.is_closed  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()


async def test_a_punched_connection_that_carries_nothing_is_closed_and_the_round_fails(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = punching(nursery, Reach(0.0, carries=False), attempts=2, dial_timeout=2.0)
        start = trio.current_time()
        result = await p.upgrade()
        assert result.conn is None and result.method == PunchMethod.NONE and result.attempts == 2
        assert not result.nothing_to_dial
        assert all(link.is_closed for link in p.b.made) and len(p.b.made) == 2
        assert trio.current_time() - start == pytest.approx(2 * 2.0, abs=0.1)  # each ping waited dial_timeout
        s = p.pb.stats
        assert (s.attempts, s.failures, s.successes) == (2, 1, 0) and s.outcomes == {("initiator", 2, "failed"): 1}
        assert p.relayed.is_closed is False
        nursery.cancel_scope.cancel()


async def test_a_punch_dial_that_hangs_is_given_up_after_dial_timeout(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = punching(nursery, Reach(None), attempts=1, dial_timeout=3.0)
        start = trio.current_time()
        assert (await p.upgrade()).conn is None
        # the punch's dial (3 s); the identify was answered at once and told nothing: no late reversal
        assert trio.current_time() - start == pytest.approx(3.0, abs=0.1)
        nursery.cancel_scope.cancel()


async def test_the_peers_syn_that_came_in_first_is_the_punched_connection(autojump_clock: object) -> None:
    """Our own connect found the address pair taken: the peer's SYN reached our listener first, and
    the punched connection is the inbound one (proven by a ping)."""
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1)
        p.a_offer = [A_ADDR]
        inbound = Link(A_ADDR, p.a.peer_id)
        p.b.conns[p.a.peer_id].append(inbound)
        result = await p.upgrade()  # B's dial of A_ADDR is refused (the pair is taken)
        assert result.conn is inbound and result.method == PunchMethod.PUNCH
        nursery.cancel_scope.cancel()


async def test_a_round_that_finds_a_relayed_connection_only_fails(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1)
        p.a_offer = [A_ADDR]
        p.b.conns[p.a.peer_id].append(Link(Multiaddr(f"/ip4/198.51.100.3/tcp/1/p2p/{RELAY}/p2p-circuit"), p.a.peer_id))
        assert (await p.upgrade()).conn is None
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- the late reversal


async def test_identify_beside_the_first_round_lets_the_reversal_go_direct(autojump_clock: object) -> None:
    """Nothing known of A at first: the upgrade asks A who it is beside the first exchange, and once A
    answered, dials what it heard, beside the punch (which gets nothing from A's empty offer)."""
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        p.a.advertised = [PRIVATE, A_ADDR]
        p.b.identify_after = 0.3
        p.b.reach[str(A_ADDR)] = Reach(0.2)
        start = trio.current_time()
        result = await p.upgrade()
        assert result.method == PunchMethod.REVERSAL and result.attempts == 1 and result.conn is p.b.made[0]
        assert trio.current_time() - start == pytest.approx(0.5)
        assert [(how, addr) for how, addr, _, _ in p.b.dials] == [("dial", str(A_ADDR))]
        s = p.pb.stats
        assert (s.reversals, s.successes, s.first_try_successes, s.failures) == (1, 1, 0, 0)
        assert s.direct_dials == {"failed": 1, "success": 1}
        assert s.outcomes == {("initiator", 1, "failed"): 1}  # the punch itself did not win
        nursery.cancel_scope.cancel()


async def test_the_late_reversal_waits_for_identify_at_most_dial_timeout(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1, dial_timeout=2.0)
        p.b.identify_after = 100.0
        p.b.store[p.a.peer_id] = []
        p.a.advertised = [A_ADDR]
        start = trio.current_time()
        result = await p.upgrade()
        assert result.conn is None and result.nothing_to_dial
        assert trio.current_time() - start == pytest.approx(2.0)
        assert p.pb.stats.direct_dials == {"failed": 1}  # the first reversal only: the late one found nothing
        nursery.cancel_scope.cancel()


async def test_an_identify_that_fails_ends_no_upgrade(autojump_clock: object, caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1)
        p.b.identify_error = ConnectionError("gone (desk)")
        p.a_offer = [A_ADDR]
        p.b.reach[str(A_ADDR)] = Reach(0.0)
        with caplog.at_level(logging.DEBUG, "nat.holepunch"):
            assert (await p.upgrade()).method == PunchMethod.PUNCH
        assert log_lines(caplog, "nat.holepunch", "identify of") == [
            f"identify of {p.a.peer_id} while upgrading failed: gone (desk)"]
        nursery.cancel_scope.cancel()


async def test_a_late_reversal_in_a_later_round_is_a_reversal_not_a_first_try(autojump_clock: object) -> None:
    """The first round fails (A's answer never comes in time) before identify answered; the late
    reversal then runs once, in the second round, and goes direct."""
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=3, dial_timeout=1.0)
        p.b.relay_delay = 5.0  # each exchange times out after 2 dial timeouts
        p.b.identify_after = 0.5
        p.a.advertised = [A_ADDR]
        p.b.reach[str(A_ADDR)] = Reach(0.0)
        result = await p.upgrade()
        assert result.method == PunchMethod.REVERSAL and result.attempts == 1
        assert p.pb.stats.first_try_successes == 0 and p.pb.stats.reversals == 1
        assert [how for how, _, _, _ in p.b.dials] == ["dial"]
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- rounds that fail


@pytest.mark.parametrize(("answer", "offered"), [
    (frame(pb.HolePunch(type=pb.HolePunch.SYNC)), True),
    (encode_varint(5000) + bytes(10), True),
    (frame(pb.HolePunch(type=pb.HolePunch.CONNECT, ObsAddrs=[b"junk", PRIVATE.to_bytes()])), False),
], ids=["sync", "oversized", "nothing-usable"])
async def test_each_bad_answer_fails_its_round(answer: bytes, offered: bool, autojump_clock: object,
                                               caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=3)
        exchanges: list[End] = []

        async def bad(stream: End) -> None:
            exchanges.append(stream)
            await read_message(stream, pb.HolePunch)
            await stream.write(answer)
            await stream.close()

        p.a.handlers[PROTOCOL] = bad
        with caplog.at_level(logging.INFO, "nat.holepunch"):
            result = await p.upgrade()
        assert result.conn is None and result.nothing_to_dial is not offered
        rounds = 3 if offered else 1
        assert len(exchanges) == rounds == result.attempts == p.pb.stats.attempts
        outcome = "failed" if offered else "no_suitable_address"
        assert p.pb.stats.outcomes == {("initiator", rounds, outcome): 1} and p.pb.stats.failures == 1
        assert p.b.dials == []
        if offered:
            assert len(log_lines(caplog, "nat.holepunch", "hole punch round")) == 3
        else:
            assert log_lines(caplog, "nat.holepunch", "hole punch with") == [
                f"hole punch with {p.a.peer_id}: {p.a.peer_id} offered no public address to punch to"]
        nursery.cancel_scope.cancel()


async def test_a_round_whose_answer_never_comes_ends_after_two_dial_timeouts(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=2, dial_timeout=1.5)
        p.b.relay_delay = 100.0
        start = trio.current_time()
        result = await p.upgrade()
        assert result.conn is None and trio.current_time() - start == pytest.approx(2 * 3.0)
        assert all(end.finished == "closed" for end in p.b.ends)
        nursery.cancel_scope.cancel()


async def test_one_upgrade_per_peer_at_a_time(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = punching(nursery, Reach(1.0), attempts=1)
        results: list[PunchResult] = []

        async def first() -> None:
            results.append(await p.upgrade())

        nursery.start_soon(first)
        await trio.sleep(0.5)
        busy = await p.pb.upgrade(p.a.peer_id, p.relayed, trio.current_time() - 2.0)  # type: ignore[arg-type]
        assert busy == PunchResult(None, PunchMethod.NONE, 0, pytest.approx(2.0))  # type: ignore[arg-type]
        await trio.sleep(1.0)
        assert results[0].method == PunchMethod.PUNCH
        assert (await p.upgrade()).attempts == 1  # free again
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- the answering side (A)


async def answer(p: Pair, first: bytes, second: bytes | None = None) -> tuple[pb.HolePunch | None, End]:
    """Drive A's handler directly: ``first``, A's answer, ``second``; A's answer and A's end."""
    mine, theirs = ends(p.b.peer_id, p.a.peer_id)
    p.b.nursery.start_soon(p.pa._on_stream, theirs)
    reply = None
    try:
        await mine.write(first)
        reply = await read_message(mine, pb.HolePunch)
    except Exception:
        return None, theirs
    if second is not None:
        await mine.write(second)
    await trio.sleep(0.01)
    return reply, theirs


def connect(addrs: list[Multiaddr | bytes]) -> bytes:
    return frame(pb.HolePunch(type=pb.HolePunch.CONNECT, ObsAddrs=[a if isinstance(a, bytes) else a.to_bytes() for a in addrs]))


SYNC = frame(pb.HolePunch(type=pb.HolePunch.SYNC))


async def test_the_answering_side_offers_and_dials_what_it_was_offered(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        p.a_offer = [PRIVATE] + MANY
        p.a.reach[str(MANY[5])] = Reach(0.2)
        offered = [b"junk", PRIVATE, Multiaddr(f"/ip4/1.1.1.1/tcp/1/p2p/{RELAY}/p2p-circuit")] + MANY
        reply, theirs = await answer(p, connect(offered), SYNC)
        assert reply is not None and reply.type == pb.HolePunch.CONNECT
        assert [Multiaddr(x) for x in reply.ObsAddrs] == MANY[:MAX_PUNCH_ADDRS]
        await trio.sleep(1.0)
        assert theirs.finished == "closed"
        # among the first sixteen offered, the public TCP ones, all at once, from the listen port
        assert sorted(addr for _, addr, _, _ in p.a.dials) == sorted(str(a) for a in MANY[:MAX_PUNCH_ADDRS - 3])
        assert all(how == "dial" and source == ("0.0.0.0", int(Multiaddr(addr).value_for_protocol("tcp")))
                   for how, addr, source, _ in p.a.dials)
        assert len({at for _, _, _, at in p.a.dials}) == 1
        assert p.pa.stats.outcomes == {("receiver", 1, "success"): 1}
        assert p.a.asked == [("dcutr", str(p.b.peer_id), 0.0)]  # virtual time starts at 0
        nursery.cancel_scope.cancel()


async def test_an_offer_with_nothing_public_is_answered_but_nothing_is_dialed(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        reply, theirs = await answer(p, connect([PRIVATE]), SYNC)
        assert reply is not None and list(reply.ObsAddrs) == []
        assert theirs.finished == "closed" and p.a.dials == []
        assert p.pa.stats.outcomes == {("receiver", 1, "no_suitable_address"): 1}
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("first", "second", "why"), [
    (SYNC, None, "expected CONNECT"),
    (encode_varint(5000) + bytes(10), None, ""),
    (connect([B_ADDR]), connect([B_ADDR]), "expected SYNC"),
    (connect([B_ADDR]), b"\x05\xff\xff\xff\xff\xff", ""),
], ids=["sync-first", "oversized", "connect-twice", "garbled-sync"])
async def test_a_forged_exchange_is_reset_and_nothing_is_dialed(first: bytes, second: bytes | None, why: str,
                                                                autojump_clock: object,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        p.a.reach[str(B_ADDR)] = Reach(0.0)
        with caplog.at_level(logging.INFO, "nat.holepunch"):
            reply, theirs = await answer(p, first, second)
            await trio.sleep(0.1)
        assert (reply is not None) is (second is not None)  # a CONNECT is answered before the second is read
        assert theirs.how == ["reset"] and p.a.dials == [] and not p.pa.stats.outcomes
        (line,) = log_lines(caplog, "nat.holepunch", "bad DCUtR exchange")
        assert line.startswith(f"bad DCUtR exchange with {p.b.peer_id}: ") and line.endswith(why)
        nursery.cancel_scope.cancel()


async def test_an_exchange_over_the_rate_is_reset_before_a_byte_is_read(autojump_clock: object,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        p.a.refuse_dcutr = OVER_RATE
        with caplog.at_level(logging.INFO, "nat.holepunch"):
            reply, theirs = await answer(p, connect([B_ADDR]), SYNC)
        assert reply is None and theirs.how == ["reset"] and theirs.asked == []
        assert log_lines(caplog, "nat.holepunch", "DCUtR from") == [f"DCUtR from {p.b.peer_id} refused: {OVER_RATE}"]
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- upgrading again


async def keep(p: Pair, seconds: float, *, opened: float = 0.0) -> list[tuple[float, PunchResult]]:
    """Run B's keep_upgrading for at most ``seconds``, the relayed connection ``opened`` seconds ago:
    each outcome, with its time since the start."""
    start = trio.current_time()
    heard: list[tuple[float, PunchResult]] = []
    with trio.move_on_after(seconds):
        await p.pb.keep_upgrading(p.a.peer_id, start - opened, lambda r: heard.append((trio.current_time() - start, r)))
    return heard


async def test_nothing_is_upgraded_where_a_direct_connection_is_there_or_none_at_all(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        p.b.conns[p.a.peer_id].append(Link(A_ADDR, p.a.peer_id))
        assert await keep(p, 10) == [] and p.b.dials == [] and p.b.ends == []
        p.b.conns[p.a.peer_id] = []
        assert await keep(p, 10) == []
        nursery.cancel_scope.cancel()


async def test_an_upgrade_with_nothing_to_dial_asks_again_and_runs_as_soon_as_addresses_change(
        autojump_clock: object, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing to dial: the peer is identified again at 0.5 s, 1 s, 2 s... after the failure, and the
    upgrade runs at the first poll that sees its addresses changed (no backoff: nothing was dialed)."""
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1, retry_backoff=10.0, retry_idle=100.0, retry_poll=1.0, reidentify_after=0.5)
        p.b.reach[str(A_ADDR)] = Reach(0.0)

        async def learns_its_address() -> None:
            await trio.sleep(1.2)
            p.a.advertised = [A_ADDR]

        nursery.start_soon(learns_its_address)
        with caplog.at_level(logging.INFO, "nat.holepunch"):
            heard = await keep(p, 50, opened=2.0)
        assert [(round(at, 6), r.conn is None, r.nothing_to_dial, r.method) for at, r in heard] == [
            (0.0, True, True, PunchMethod.NONE), (1.5, False, False, PunchMethod.REVERSAL)]
        # from the relayed connection's start, every time
        assert [r.elapsed for _, r in heard] == [pytest.approx(at + 2.0) for at, _ in heard]
        # identified: beside the first round, then again at 0.5 (nothing yet) and 1.5 s (the address)
        assert [round(at, 6) for _, _, at in p.b.identified] == [0.0, 0.5, 1.5]
        s = p.pb.stats
        assert (s.retries, s.reidentified) == (1, 2) and p.pb.metrics()["punch_reidentified"] == 2
        assert log_lines(caplog, "nat.holepunch", "retrying") == [
            f"retrying the upgrade of the relayed connection to {p.a.peer_id}: addresses changed"]
        nursery.cancel_scope.cancel()


async def test_after_a_failed_dial_a_change_counts_only_after_the_backoff(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1, retry_backoff=4.0, retry_idle=100.0, retry_poll=1.0, dial_timeout=1.0)
        p.a_offer = [A_ADDR]  # punched to, never answers: each round fails after its dial timeout
        p.b.reach[str(A_ADDR)] = Reach(None)
        p.b_offer = [B_ADDR]

        async def our_address_changes() -> None:
            await trio.sleep(2.0)
            p.b_offer = [B_ADDR2]

        nursery.start_soon(our_address_changes)
        heard = await keep(p, 7.5)
        assert p.pb._offer() == [B_ADDR2.to_bytes()]
        assert [round(at, 6) for at, _ in heard] == [1.0, 6.0]  # failed at 1 s; the change counts from 5 s, polled at 6
        assert p.pb.stats.retries == 1 and p.pb.stats.reidentified == 0
        nursery.cancel_scope.cancel()


async def test_without_a_change_the_upgrade_runs_again_after_retry_idle_doubling(autojump_clock: object,
                                                                                 caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        p = punching(nursery, Reach(None), attempts=1, retries=2, retry_backoff=1.0, retry_idle=10.0, retry_poll=1.0, dial_timeout=1.0)
        with caplog.at_level(logging.INFO, "nat.holepunch"):
            heard = await keep(p, 100)
        assert [round(at, 6) for at, _ in heard] == [1.0, 12.0, 33.0]  # then no retry is left
        assert log_lines(caplog, "nat.holepunch", "retrying")[-1].endswith(": nothing changed in 20 s")
        assert p.pb.stats.retries == 2 and p.pb.stats.failures == 3
        nursery.cancel_scope.cancel()


async def test_the_retries_stop_when_the_relayed_connection_closes_or_goes_direct(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = punching(nursery, Reach(None), attempts=1, retry_idle=10.0, dial_timeout=1.0)

        async def closes() -> None:
            await trio.sleep(4.5)
            p.relayed.is_closed = True

        nursery.start_soon(closes)
        start = trio.current_time()
        heard = await keep(p, 100)
        assert len(heard) == 1 and trio.current_time() - start == pytest.approx(5.0)  # seen at the next poll
        q = punching(nursery, Reach(None), attempts=1, retry_idle=10.0, dial_timeout=1.0)

        async def goes_direct() -> None:
            await trio.sleep(5.0)
            q.b.conns[q.a.peer_id].append(Link(A_ADDR, q.a.peer_id))

        nursery.start_soon(goes_direct)
        assert len(await keep(q, 100)) == 1
        nursery.cancel_scope.cancel()


async def test_a_change_is_measured_from_the_last_try_not_the_first(autojump_clock: object) -> None:
    """A change seen by one retry does not count again for the next: the next waits for a new one."""
    async with trio.open_nursery() as nursery:
        p = punching(nursery, Reach(None), attempts=1, retries=3, retry_backoff=1.0, retry_idle=50.0, retry_poll=1.0, dial_timeout=1.0)

        async def changes() -> None:
            await trio.sleep(2.5)
            p.b_offer = [B_ADDR]

        nursery.start_soon(changes)
        heard = await keep(p, 40)
        # seen at the 3 s poll, failed at 4 s; nothing new since: no retry before 4 + 100
        assert [round(at, 6) for at, _ in heard] == [1.0, 4.0]
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- counts, logs, proof


async def test_the_counters_add_up_over_upgrades(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1)
        p.b.store[p.a.peer_id] = [A_ADDR]  # reversals: twice
        p.b.reach[str(A_ADDR)] = Reach(0.0)
        for _ in range(2):
            p.b.conns[p.a.peer_id] = p.b.conns[p.a.peer_id][:1]
            assert (await p.upgrade()).method == PunchMethod.REVERSAL
        s = p.pb.stats
        assert (s.reversals, s.successes, s.direct_dials["success"], len(s.time_to_direct)) == (2, 2, 2, 2)
        q = pair(nursery, attempts=1)  # punches: twice
        q.a_offer = [A_ADDR]
        q.b.reach[str(A_ADDR)] = Reach(0.0)
        for _ in range(2):
            q.b.conns[q.a.peer_id] = q.b.conns[q.a.peer_id][:1]
            assert (await q.upgrade()).method == PunchMethod.PUNCH
        s = q.pb.stats
        assert (s.first_try_successes, s.outcomes[("initiator", 1, "success")], s.direct_dials["failed"]) == (2, 2, 2)
        await trio.sleep(5.0)
        assert q.pa.stats.outcomes == {("receiver", 1, "no_suitable_address"): 2}
        r = pair(nursery, attempts=1)  # late reversals that fail, and answers that dial and fail: twice
        r.a.advertised = [A_ADDR]
        r.b_offer = [B_ADDR]
        for _ in range(2):
            r.b.store.clear()
            result = await r.upgrade()
            assert result.conn is None and result.elapsed == pytest.approx(0.0)
        await trio.sleep(0.1)
        s = r.pb.stats
        assert (s.failures, s.direct_dials["failed"], s.outcomes[("initiator", 1, "no_suitable_address")]) == (2, 4, 2)
        assert r.pa.stats.outcomes == {("receiver", 1, "failed"): 2}
        t = pair(nursery, attempts=1)  # late reversals that work: twice
        t.a.advertised = [A_ADDR]
        t.b.reach[str(A_ADDR)] = Reach(0.0)
        for _ in range(2):
            t.b.store.clear()
            t.b.conns[t.a.peer_id] = t.b.conns[t.a.peer_id][:1]
            assert (await t.upgrade()).method == PunchMethod.REVERSAL
        assert (t.pb.stats.reversals, t.pb.stats.direct_dials["success"]) == (2, 2)
        nursery.cancel_scope.cancel()


async def test_a_failed_upgrade_reports_its_time_from_the_relayed_connections_start(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = punching(nursery, Reach(None), attempts=1, dial_timeout=2.0)
        result = await p.pb.upgrade(p.a.peer_id, p.relayed, trio.current_time() - 3.0)  # type: ignore[arg-type]
        assert result.conn is None and result.elapsed == pytest.approx(5.0)
        nursery.cancel_scope.cancel()


async def test_a_punched_connection_is_proven_by_a_whole_ping_of_32_bytes(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = punching(nursery, Reach(0.0))
        assert (await p.upgrade()).method == PunchMethod.PUNCH
        ping = p.b.ends[-1]
        assert b"".join(p.a.pinged) == bytes(32)
        assert ping.asked == [32, 16] and ping.finished == "closed"  # echoed in halves: read to the last byte
        nursery.cancel_scope.cancel()


async def test_what_an_upgrade_logs(autojump_clock: object, caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=2, dial_timeout=1.0)
        p.b.store[p.a.peer_id] = [A_ADDR2]
        p.b.reach[str(A_ADDR2)] = Reach(0.25, OSError("no route (desk)"))
        p.a_offer = [A_ADDR]
        p.b.reach[str(A_ADDR)] = Reach(0.0, carries=False)
        with caplog.at_level(logging.DEBUG, "nat.holepunch"):
            assert (await p.upgrade()).conn is None
        a = p.a.peer_id
        assert log_lines(caplog, "nat.holepunch", "upgrade to") == [f"upgrade to {a}: reversal found nothing after 0.25 s"]
        # a round whose punched connection carried nothing is no error: no round's failure is logged
        assert log_lines(caplog, "nat.holepunch", "hole punch round") == []
        assert log_lines(caplog, "nat.holepunch", "punched connection") == [
            f"punched connection to {a} at {A_ADDR} does not carry traffic: "] * 2
        caplog.clear()
        p.b.store[p.a.peer_id] = [A_ADDR2]  # (identify told b what a advertises: nothing)
        p.b.reach[str(A_ADDR2)] = Reach(0.0)
        p.a_offer = []
        with caplog.at_level(logging.DEBUG, "nat.holepunch"):
            assert (await p.upgrade()).conn is not None
        assert log_lines(caplog, "nat.holepunch", "upgrade to") == [f"upgrade to {a}: reversal worked after 0.00 s"]
        nursery.cancel_scope.cancel()


async def test_a_round_that_fails_says_why_and_when(autojump_clock: object, caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1)

        async def wrong(stream: End) -> None:
            await read_message(stream, pb.HolePunch)
            await trio.sleep(0.5)
            await write_message(stream, pb.HolePunch(type=pb.HolePunch.SYNC))

        p.a.handlers[PROTOCOL] = wrong
        with caplog.at_level(logging.INFO, "nat.holepunch"):
            await p.pb.upgrade(p.a.peer_id, p.relayed, trio.current_time() - 1.0)  # type: ignore[arg-type]
        assert log_lines(caplog, "nat.holepunch", "hole punch round") == [
            f"hole punch round 1 with {p.a.peer_id} failed after 1.50 s: RemoteProtocolError('expected CONNECT')"]
        nursery.cancel_scope.cancel()


async def test_a_punch_dial_that_fails_says_where_and_why(autojump_clock: object, caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1)
        p.a_offer = [A_ADDR]
        with caplog.at_level(logging.DEBUG, "nat.holepunch"):
            assert (await p.upgrade()).conn is None
        assert log_lines(caplog, "nat.holepunch", "punch dial") == [f"punch dial to {A_ADDR} failed: refused (desk)"]
        nursery.cancel_scope.cancel()


async def test_an_inbound_connection_that_carries_nothing_is_closed_and_said(autojump_clock: object,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1, dial_timeout=1.0)
        p.a_offer = [A_ADDR]
        inbound = Link(A_ADDR2, p.a.peer_id, carries=False)
        p.b.conns[p.a.peer_id].append(inbound)
        with caplog.at_level(logging.INFO, "nat.holepunch"):
            assert (await p.upgrade()).conn is None
        assert inbound.is_closed
        assert log_lines(caplog, "nat.holepunch", "punched connection") == [
            f"punched connection to {p.a.peer_id} at {A_ADDR2} does not carry traffic: "]
        nursery.cancel_scope.cancel()


async def test_without_install_an_upgrade_works_and_retires_nothing(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        p = pair(nursery)
        puncher = HolePuncher(p.b, lambda: [], HolePunchConfig(grace=0.0))  # type: ignore[arg-type]
        p.b.store[p.a.peer_id] = [A_ADDR]
        p.b.reach[str(A_ADDR)] = Reach(0.0)
        assert (await puncher.upgrade(p.a.peer_id, p.relayed)).conn is not None  # type: ignore[arg-type]
        await trio.sleep(100.0)
        assert not p.relayed.is_closed
        nursery.cancel_scope.cancel()


async def test_with_allow_private_private_addresses_are_dialed_offered_and_watched(autojump_clock: object) -> None:
    """LAN swarms and tests: every part that filters addresses lets private ones through."""
    async with trio.open_nursery() as nursery:
        private2 = Multiaddr("/ip4/192.168.1.6/tcp/4002")
        p = pair(nursery, allow_private=True, attempts=1)
        p.b.store[p.a.peer_id] = [PRIVATE]  # the reversal dials it
        assert (await p.upgrade()).conn is None
        p.a_offer = [private2]  # the punch dials it
        p.b_offer = [PRIVATE]  # and the answering side
        p.b.store.clear()
        assert (await p.upgrade()).conn is None
        await trio.sleep(0.1)
        assert [(how, addr) for how, addr, _, _ in p.b.dials] == [
            ("dial", str(PRIVATE)), ("simultaneous", str(private2))]
        assert [(how, addr) for how, addr, _, _ in p.a.dials] == [("dial", str(PRIVATE))]
        # a change among private addresses is a change
        seen = p.pb._addresses(p.a.peer_id)
        p.b.store[p.a.peer_id] = [private2]
        assert p.pb._addresses(p.a.peer_id) != seen
        seen = p.pb._addresses(p.a.peer_id)
        p.b_offer = [private2]
        assert p.pb._addresses(p.a.peer_id) != seen
        nursery.cancel_scope.cancel()


async def test_a_change_of_the_peers_address_brings_a_retry(autojump_clock: object) -> None:
    """The peer moved (its store entry went from one public address to another): tried again at the
    first poll after the backoff, and the new address is dialed back."""
    async with trio.open_nursery() as nursery:
        p = pair(nursery, attempts=1, retry_backoff=1.0, retry_idle=100.0, retry_poll=1.0, dial_timeout=1.0)
        p.b.store[p.a.peer_id] = [A_ADDR]  # refused
        p.a.advertised = [A_ADDR]
        p.b.reach[str(A_ADDR2)] = Reach(0.0)

        async def moves() -> None:
            await trio.sleep(2.5)
            p.b.store[p.a.peer_id] = [A_ADDR2]

        nursery.start_soon(moves)
        heard = await keep(p, 50)
        assert [(round(at, 6), r.method) for at, r in heard] == [(0.0, PunchMethod.NONE), (3.0, PunchMethod.REVERSAL)]
        assert heard[1][1].elapsed == pytest.approx(3.0)
        nursery.cancel_scope.cancel()
