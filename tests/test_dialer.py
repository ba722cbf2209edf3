"""p2p/dialer.py against a stand-in of py-libp2p's swarm, in virtual time: which address is dialed
when, what wins, what is cancelled or closed, and what every failure reports.

The swarm's ``dial_addr`` here follows a script (each address answers after so many seconds, with a
connection or an error, or never), so a stagger of 0.25 s or a timeout of 10 s is measured exactly
(``autojump_clock``) and a test takes milliseconds. The real dials, over loopback sockets, are
``tests/test_node.py``'s; the punch's simultaneous open, ``tests/test_holepunch.py``'s and the NAT
lab's.
"""

from __future__ import annotations

import errno
import itertools
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import dialer
from p2p.dialer import (_describe, _Replay, address_labels, backoff_delays, classify_dial_error, dial,
                        dial_simultaneous, live_connection, remote_addr, source_port_taken)
from p2p.errors import DialError

from .kit import random_peer_id

PEER = random_peer_id()
RELAY = random_peer_id()
OTHER_RELAY = random_peer_id()

PUBLIC = Multiaddr("/ip4/1.2.3.4/tcp/4001")
PUBLIC6 = Multiaddr("/ip6/2a00:1450::1/tcp/4001")
PRIVATE = Multiaddr("/ip4/10.0.0.7/tcp/4001")
LOOPBACK = Multiaddr("/ip4/127.0.0.1/tcp/4001")
UNSPECIFIED = Multiaddr("/ip4/0.0.0.0/tcp/4001")
CIRCUIT = Multiaddr(f"/ip4/5.6.7.8/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}")
CIRCUIT_ALSO = Multiaddr(f"/ip6/2a00:1450::2/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}")
CIRCUIT_OTHER = Multiaddr(f"/ip4/5.6.7.9/tcp/4001/p2p/{OTHER_RELAY}/p2p-circuit/p2p/{PEER}")
SOURCE = ("0.0.0.0", 4001)


class Conn:
    """A connection as the dialer sees it; its close takes a checkpoint, as a real one does."""

    def __init__(self, addr: Multiaddr, *, closed: bool = False) -> None:
        self.addr = addr
        self.is_closed = closed

    async def close(self) -> None:
        await trio.sleep(0.01)
        self.is_closed = True

    def get_transport_addresses(self) -> list[Multiaddr]:
        return [self.addr]


@dataclass
class Answer:
    """How one address answers a dial: after ``after`` seconds (or when ``gate`` is set), with ``error``
    raised or a connection."""

    after: float
    error: BaseException | None = None
    gate: trio.Event | None = None


@dataclass
class Network:
    """py-libp2p's swarm as :func:`p2p.dialer.dial` uses it. An address not in ``script`` never answers.
    ``dials`` records (address, source, seconds since the test began) per dial, ``cancelled`` the
    addresses whose dial was cut, ``made`` every connection handed out."""

    script: dict[str, Answer] = field(default_factory=dict)
    #: per (address, source): an answer that overrides ``script``'s for that source only
    by_source: dict[tuple[str, Any], Answer] = field(default_factory=dict)
    connections: dict[ID, list[Any]] = field(default_factory=dict)
    dials: list[tuple[str, Any, float]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    made: list[Conn] = field(default_factory=list)
    base: float = field(default_factory=trio.current_time)

    def get_connections(self, peer_id: ID) -> list[Any]:
        return self.connections.get(peer_id, [])

    async def dial_addr(self, addr: Multiaddr, peer_id: ID, source: Any = None) -> Conn:
        assert peer_id == PEER and "/p2p/" not in str(addr)  # the transport part only, as a transport takes it
        self.dials.append((str(addr), source, trio.current_time() - self.base))
        answer = self.by_source.get((str(addr), source), self.script.get(str(addr)))
        try:
            if answer is None:
                await trio.sleep_forever()
            assert answer is not None
            await (trio.sleep(answer.after) if answer.gate is None else answer.gate.wait())
        except trio.Cancelled:
            self.cancelled.append(str(addr))
            raise
        if answer.error is not None:
            raise answer.error
        conn = Conn(addr)
        self.made.append(conn)
        return conn

    def started(self) -> list[tuple[str, float]]:
        return [(addr, round(at, 6)) for addr, _, at in self.dials]


def refused(after: float = 0.0) -> Answer:
    return Answer(after, ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))


def taken() -> OSError:
    """What py-libp2p raises when our own socket still holds the (source, destination) pair."""
    try:
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
    except OSError as e:
        try:
            raise RuntimeError("failed to open connection") from e
        except RuntimeError as outer:
            return outer


# ---------------------------------------------------------------------- which address, when


async def test_a_live_connection_is_returned_without_a_dial(autojump_clock: object) -> None:
    net = Network()
    live = Conn(PUBLIC6)
    net.connections[PEER] = [Conn(PRIVATE, closed=True), live]
    assert live_connection(net, PEER) is live  # type: ignore[arg-type]
    assert await dial(net, PEER, [PUBLIC]) == (live, PUBLIC6)  # type: ignore[arg-type]
    assert net.dials == []
    net.connections[PEER] = [Conn(PRIVATE, closed=True)]
    assert live_connection(net, PEER) is None  # type: ignore[arg-type]
    silent = SimpleNamespace()  # a connection that does not say whether it is closed counts as live
    net.connections[PEER] = [silent]
    assert live_connection(net, PEER) is silent  # type: ignore[arg-type]


async def test_addresses_go_best_first_each_with_its_head_start(autojump_clock: object) -> None:
    """Public before private before loopback, IPv4 before IPv6, relayed last; one dial started per
    ``stagger`` while the earlier ones hang; the first to connect wins and the rest are cut."""
    net = Network({str(LOOPBACK): Answer(0.05)})

    async def circuit(addr: Multiaddr, peer: ID) -> Any:
        await trio.sleep_forever()

    conn, addr = await dial(net, PEER, [CIRCUIT, LOOPBACK, PRIVATE, PUBLIC6, PUBLIC, PUBLIC],  # type: ignore[arg-type]
                            stagger=0.25, circuit=circuit)
    assert addr == LOOPBACK and conn is net.made[0] and not conn.is_closed
    assert net.started() == [(str(PUBLIC), 0.0), (str(PUBLIC6), 0.25), (str(PRIVATE), 0.5), (str(LOOPBACK), 0.75)]
    assert trio.current_time() - net.base == pytest.approx(0.8)
    assert sorted(net.cancelled) == sorted([str(PUBLIC), str(PUBLIC6), str(PRIVATE)])


async def test_by_default_each_address_gets_a_quarter_second_and_all_ten_seconds(autojump_clock: object) -> None:
    net = Network()
    with pytest.raises(DialError) as info:
        await dial(net, PEER, [PUBLIC, PRIVATE])  # type: ignore[arg-type]
    assert net.started() == [(str(PUBLIC), 0.0), (str(PRIVATE), 0.25)]
    assert trio.current_time() - net.base == pytest.approx(10.0)
    assert info.value.attempts == [(str(PUBLIC), "timed out after 10s"), (str(PRIVATE), "timed out after 10s")]


async def test_a_failure_starts_the_next_address_at_once(autojump_clock: object) -> None:
    net = Network({str(PUBLIC): refused(0.1), str(PUBLIC6): refused(0.0), str(PRIVATE): Answer(0.2)})
    conn, addr = await dial(net, PEER, [PRIVATE, PUBLIC6, PUBLIC], stagger=60.0)  # type: ignore[arg-type]
    assert addr == PRIVATE
    assert net.started() == [(str(PUBLIC), 0.0), (str(PUBLIC6), 0.1), (str(PRIVATE), 0.1)]


async def test_a_local_address_holds_the_next_back_only_stagger_local(autojump_clock: object) -> None:
    """A NATed peer's LAN address answers nobody outside: its head start is ``stagger_local``; a public
    one keeps the whole ``stagger``."""
    net = Network({str(CIRCUIT): Answer(0.0)})

    async def circuit(addr: Multiaddr, peer: ID) -> Any:
        net.dials.append((str(addr), None, trio.current_time() - net.base))
        return Conn(addr)

    _, addr = await dial(net, PEER, [LOOPBACK, PRIVATE, PUBLIC, CIRCUIT], stagger=1.0, stagger_local=0.1,  # type: ignore[arg-type]
                         circuit=circuit)
    assert addr == CIRCUIT
    assert net.started() == [(str(PUBLIC), 0.0), (str(PRIVATE), 1.0), (str(LOOPBACK), 1.1), (str(CIRCUIT), 1.2)]


async def test_without_stagger_local_a_local_address_gets_the_whole_stagger(autojump_clock: object) -> None:
    net = Network({str(PUBLIC): Answer(5.0)})
    _, addr = await dial(net, PEER, [PRIVATE, LOOPBACK, PUBLIC], stagger=1.0)  # type: ignore[arg-type]
    assert addr == PUBLIC
    assert net.started() == [(str(PUBLIC), 0.0), (str(PRIVATE), 1.0), (str(LOOPBACK), 2.0)]


async def test_the_loser_of_a_photo_finish_is_closed(autojump_clock: object) -> None:
    """Two dials connect at the same moment (both resumed in one batch): the first is kept, the second
    closed, although the nursery it closes in is being cancelled (a close takes a checkpoint, where
    the cancellation would stop it half done and leave a connection nobody holds)."""
    both = trio.Event()
    net = Network({str(PUBLIC): Answer(0, gate=both), str(PUBLIC6): Answer(0, gate=both)})


    async def connect_both() -> None:
        await trio.sleep(1.0)
        both.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(connect_both)
        conn, addr = await dial(net, PEER, [PUBLIC, PUBLIC6], stagger=0.25)  # type: ignore[arg-type]
    assert len(net.made) == 2
    (loser,) = [c for c in net.made if c is not conn]
    assert loser.is_closed and not conn.is_closed
    assert addr == conn.addr


async def test_a_losers_close_that_hangs_holds_the_dial_two_seconds_at_most(autojump_clock: object) -> None:
    both = trio.Event()
    net = Network({str(PUBLIC): Answer(0, gate=both), str(PUBLIC6): Answer(0, gate=both)})

    async def hang() -> None:
        await trio.sleep_forever()

    async def connect_both() -> None:
        await trio.sleep(1.0)
        both.set()

    original = net.dial_addr

    async def dial_addr(addr: Multiaddr, peer_id: ID, source: Any = None) -> Conn:
        conn = await original(addr, peer_id, source)
        conn.close = hang  # type: ignore[method-assign]
        return conn

    net.dial_addr = dial_addr  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(connect_both)
        await dial(net, PEER, [PUBLIC, PUBLIC6], stagger=0.25)  # type: ignore[arg-type]
    assert trio.current_time() - net.base == pytest.approx(3.0)


# ---------------------------------------------------------------------- relayed addresses


async def test_relayed_addresses_go_to_the_circuit_dialer_and_are_skipped_without_one(autojump_clock: object) -> None:
    net = Network({str(PUBLIC): refused()})
    asked: list[tuple[Multiaddr, ID]] = []

    async def circuit(addr: Multiaddr, peer: ID) -> Any:
        asked.append((addr, peer))
        return Conn(addr)

    conn, addr = await dial(net, PEER, [CIRCUIT, PUBLIC], circuit=circuit)  # type: ignore[arg-type]
    assert addr == CIRCUIT and asked == [(CIRCUIT, PEER)] and conn.addr == CIRCUIT
    with pytest.raises(DialError) as info:
        await dial(Network({str(PUBLIC): refused()}), PEER, [CIRCUIT, PUBLIC])  # type: ignore[arg-type]
    assert info.value.attempts == [(str(PUBLIC), "[Errno 111] Connection refused")]


async def test_nothing_dialable_says_why_per_address(autojump_clock: object) -> None:
    net = Network()
    with pytest.raises(DialError, match=f"^no dialable address known for {PEER}") as info:
        await dial(net, PEER, [UNSPECIFIED, CIRCUIT])  # type: ignore[arg-type]
    assert info.value.attempts == [(str(UNSPECIFIED), "unspecified (0.0.0.0 or ::): no address to dial"),
                                   (str(CIRCUIT), "relayed (needs a relay client)")]
    assert net.dials == []


async def test_one_circuit_per_relay_we_hold_a_connection_to(autojump_clock: object) -> None:
    """A peer lists its circuit once per address of its relay: over the one connection we hold to the
    relay they are one circuit, asked once; through a relay we are not connected to, each relay
    address is a real alternative; a circuit that names no relay is left for the dialer to refuse."""
    net = Network()
    net.connections[RELAY] = [Conn(PUBLIC)]
    nameless = Multiaddr(f"/ip4/5.6.7.8/tcp/4001/p2p-circuit/p2p/{PEER}")
    other_also = Multiaddr(f"/ip4/5.6.7.10/tcp/4001/p2p/{OTHER_RELAY}/p2p-circuit/p2p/{PEER}")
    kept = dialer._one_circuit_per_relay(net, [PUBLIC, CIRCUIT, nameless, CIRCUIT_ALSO, CIRCUIT_OTHER, other_also])  # type: ignore[arg-type]
    assert kept == [PUBLIC, CIRCUIT, nameless, CIRCUIT_OTHER, other_also]
    asked: list[Multiaddr] = []

    async def circuit(addr: Multiaddr, peer: ID) -> Any:
        asked.append(addr)
        raise ConnectionError("NO_RESERVATION")

    with pytest.raises(DialError):
        await dial(net, PEER, [CIRCUIT_ALSO, CIRCUIT], circuit=circuit)  # type: ignore[arg-type]
    assert asked == [CIRCUIT]  # IPv4 first


# ---------------------------------------------------------------------- where a dial comes from


async def test_a_dial_goes_from_the_source_it_is_given(autojump_clock: object) -> None:
    net = Network({str(PUBLIC): Answer(0.0)})
    await dial(net, PEER, [PUBLIC], source=lambda addr: SOURCE if addr == PUBLIC else None)  # type: ignore[arg-type]
    assert [source for _, source, _ in net.dials] == [SOURCE]


async def test_a_source_port_still_held_by_our_own_socket_is_dialed_again_from_a_fresh_one(autojump_clock: object) -> None:
    net = Network({str(PUBLIC): Answer(0.0)}, by_source={(str(PUBLIC), SOURCE): Answer(0.0, taken())})
    conn, addr = await dial(net, PEER, [PUBLIC], source=lambda addr: SOURCE)  # type: ignore[arg-type]
    assert addr == PUBLIC and [source for _, source, _ in net.dials] == [SOURCE, None]


async def test_other_failures_from_a_source_are_not_dialed_again(autojump_clock: object) -> None:
    net = Network({str(PUBLIC): Answer(0.0)}, by_source={(str(PUBLIC), SOURCE): refused()})
    with pytest.raises(DialError):
        await dial(net, PEER, [PUBLIC], source=lambda addr: SOURCE)  # type: ignore[arg-type]
    assert [source for _, source, _ in net.dials] == [SOURCE]
    # without a source there is nothing to free: a taken pair is the dial's failure
    net = Network({str(PUBLIC): Answer(0.0, taken())})
    with pytest.raises(DialError) as info:
        await dial(net, PEER, [PUBLIC])  # type: ignore[arg-type]
    assert len(net.dials) == 1
    assert info.value.attempts == [(str(PUBLIC), "failed to open connection: [Errno 99] Cannot assign requested address")]


def test_source_port_taken_looks_through_every_wrapping() -> None:
    assert source_port_taken(taken())
    assert source_port_taken(OSError(errno.EADDRINUSE, "Address already in use"))
    assert not source_port_taken(OSError(errno.ECONNREFUSED, "refused"))
    assert not source_port_taken(RuntimeError("no errno"))
    try:  # the context, not only the cause; and a loop in the chain ends
        try:
            raise OSError(errno.EADDRINUSE, "in use")
        except OSError:
            raise ValueError("while binding")
    except ValueError as e:
        assert source_port_taken(e)
    looped_a, looped_b = RuntimeError("a"), RuntimeError("b")
    looped_a.__cause__, looped_b.__cause__ = looped_b, looped_a
    assert not source_port_taken(looped_a)


# ---------------------------------------------------------------------- failures, and the time


async def test_every_failure_is_reported_and_raised_together(autojump_clock: object) -> None:
    heard: list[tuple[str, str, bool]] = []
    net = Network({str(PUBLIC): refused(0.5), str(PRIVATE): Answer(0.1, OSError("no route to host"))})
    with pytest.raises(DialError, match=f"^could not connect to {PEER}") as info:
        await dial(net, PEER, [PRIVATE, PUBLIC], stagger=60.0, on_failure=lambda *a: heard.append(a))  # type: ignore[arg-type]
    assert info.value.attempts == [(str(PUBLIC), "[Errno 111] Connection refused"), (str(PRIVATE), "no route to host")]
    assert heard == [(str(PUBLIC), "[Errno 111] Connection refused", False), (str(PRIVATE), "no route to host", False)]
    assert trio.current_time() - net.base == pytest.approx(0.6)  # the second began at the first's failure


async def test_addresses_still_pending_at_the_timeout_are_reported_as_timed_out(autojump_clock: object) -> None:
    heard: list[tuple[str, str, bool]] = []
    net = Network({str(PUBLIC): refused(0.1)})
    with pytest.raises(DialError) as info:
        await dial(net, PEER, [PUBLIC, PRIVATE, LOOPBACK], stagger=1.0, timeout=1.5,  # type: ignore[arg-type]
                   on_failure=lambda *a: heard.append(a))
    assert trio.current_time() - net.base == pytest.approx(1.5)
    assert info.value.attempts == [(str(PUBLIC), "[Errno 111] Connection refused"),
                                   (str(PRIVATE), "timed out after 1.5s"), (str(LOOPBACK), "timed out after 1.5s")]
    assert heard[1:] == [(str(PRIVATE), "timed out after 1.5s", True), (str(LOOPBACK), "timed out after 1.5s", True)]
    assert net.started() == [(str(PUBLIC), 0.0), (str(PRIVATE), 0.1), (str(LOOPBACK), 1.1)]
    assert sorted(net.cancelled) == sorted([str(PRIVATE), str(LOOPBACK)])


async def test_a_timeout_reports_the_callers_whole_limit(autojump_clock: object) -> None:
    """``timeout`` is what was left of the caller's ``limit``: the report names the limit."""
    net = Network()
    with pytest.raises(DialError) as info:
        await dial(net, PEER, [PUBLIC], timeout=0.29, limit=0.3)  # type: ignore[arg-type]
    assert info.value.attempts == [(str(PUBLIC), "timed out after 0.3s")]


def test_a_failure_is_described_by_its_chain_of_causes() -> None:
    def chain(*texts: str) -> BaseException:
        error: BaseException | None = None
        for text in reversed(texts):
            try:
                raise (RuntimeError(text) if text else TimeoutError()) from error
            except BaseException as e:
                error = e
        assert error is not None
        return error

    assert _describe(chain("dial failed", "noise handshake", "reset by peer", "deeper")) == \
        "dial failed: noise handshake: reset by peer"
    assert _describe(chain("same", "same", "")) == "same: TimeoutError"
    looped = RuntimeError("loop")
    looped.__cause__ = looped
    assert _describe(looped) == "loop"


def test_dial_failures_carry_go_libp2ps_labels() -> None:
    assert address_labels("/ip4/1.2.3.4/tcp/1") == ("tcp", "ip4")
    assert address_labels("/ip6/::1/tcp/1") == ("tcp", "ip6")
    assert address_labels(str(CIRCUIT)) == ("circuit", "ip4")
    assert address_labels("/dns4/example.com/udp/1/quic-v1") == ("other", "unknown")
    cases = {
        "timed out after 5s": "deadline", "read timeout": "deadline", "Connection REFUSED": "connection_refused",
        "No route to host": "no_route", "network unreachable": "no_route", "resource limit exceeded": "resource_limit_exceeded",
        "over the limit of 4": "resource_limit_exceeded", "peer id mismatch": "peer_id_mismatch",
        "key mismatch": "peer_id_mismatch", "Noise handshake failed": "security", "yamux go away": "muxer",
        "connection reset": "connection_reset", "relay refused: NO_RESERVATION": "connection_refused",
        "relay said NO_RESERVATION": "relay", "something else": "other",
    }
    assert {why: classify_dial_error("/ip4/1.2.3.4/tcp/1", why)[1] for why in cases} == cases
    assert classify_dial_error("/ip6/::1/tcp/1", "refused") == ("tcp", "connection_refused", "ip6")


def test_remote_addr_is_the_transport_address_or_none_at_all() -> None:
    assert remote_addr(Conn(PUBLIC6)) == PUBLIC6  # type: ignore[arg-type]
    nowhere = Multiaddr("/ip4/0.0.0.0/tcp/0")
    assert remote_addr(SimpleNamespace(get_transport_addresses=lambda: [])) == nowhere  # type: ignore[arg-type]

    def broken() -> list[Multiaddr]:
        raise RuntimeError("closed")

    assert remote_addr(SimpleNamespace(get_transport_addresses=broken)) == nowhere  # type: ignore[arg-type]


def test_backoff_doubles_to_its_cap_and_its_jitter_only_cuts() -> None:
    plain = list(itertools.islice(backoff_delays(0.5, 8.0), 7))
    assert plain == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    paces = [list(itertools.islice(backoff_delays(0.5, 8.0, jitter=0.5, rng=random.Random(seed)), 7))
             for seed in range(20)]
    for pace in paces:
        assert all(base / 2 <= d <= base for base, d in zip(plain, pace)), pace
    assert len({round(sum(pace[:5]), 6) for pace in paces}) == 20  # where the fifth retry lands: each its own
    # a spread, not a constant cut: the fifth retries of the 20 spread over more than a second
    assert max(sum(p[:5]) for p in paces) - min(sum(p[:5]) for p in paces) > 1.0
    assert next(backoff_delays(1.0, 4.0, jitter=0.25, rng=random.Random(7))) == 1.0 - 0.25 * random.Random(7).random()
    assert list(itertools.islice(backoff_delays(1.0, 4.0, rng=random.Random(1)), 3)) == [1.0, 2.0, 4.0]  # no jitter: no cut
    with pytest.raises(ValueError, match="^a jittered backoff needs its rng$"):
        next(backoff_delays(0.5, 8.0, jitter=0.5))


# ---------------------------------------------------------------------- the punch's dial


class Raw:
    """A raw TCP connection opened from a source port: what the peer sends first, then silence."""

    def __init__(self, first: list[bytes], *, hang: bool = True) -> None:
        async def after(n: int | None = None) -> bytes:
            self.asked.append(n)
            return b"after"

        #: the socket's stream, which the upgrade reads once the first flight is replayed; its far end,
        #: read from the socket, is cached on it (py-libp2p's own reading knows no IPv6)
        socket = SimpleNamespace(getpeername=lambda: ("2a00:1450::9", 5000))
        self.stream = SimpleNamespace(stream=SimpleNamespace(socket=socket), _cached_remote_address=None,
                                      get_remote_address=lambda: None, read=after)
        self.first = list(first)
        self.hang = hang
        self.closed = False
        #: the sizes reads asked for, of the first flight and then of the stream
        self.asked: list[int | None] = []

    async def read(self, n: int | None = None) -> bytes:
        self.asked.append(n)
        if self.first:
            return self.first.pop(0)
        if self.hang:
            await trio.sleep_forever()
        return b""

    async def close(self) -> None:
        self.closed = True

    def get_transport_addresses(self) -> list[Multiaddr]:
        return [PUBLIC6]


def message(text: str) -> bytes:
    body = text.encode() + b"\n"
    return bytes([len(body)]) + body


HEADER = message("/multistream/1.0.0")
PROPOSAL = message("/noise")


@dataclass
class Punching:
    """The swarm and transport :func:`dial_simultaneous` uses, recording what it was asked.
    ``answered_as``: the peer the handshake found (None: the connection does not say)."""

    raw: Raw | None = None
    dial_error: BaseException | None = None
    answered_as: ID | None = PEER
    register: bool = True
    upgrades: list[tuple[str, Any, Any]] = field(default_factory=list)
    targets: list[tuple[Multiaddr, Any]] = field(default_factory=list)
    with_source: bool = True
    connections: list[Any] = field(default_factory=list)
    asked: list[Any] = field(default_factory=list)

    @property
    def transport_manager(self) -> Any:
        def transport_for_dialing(addr: Multiaddr) -> Any:
            self.asked.append(("transport", addr))
            return SimpleNamespace(dial_with_source=self.dial_with_source) if self.with_source else SimpleNamespace()

        return SimpleNamespace(transport_for_dialing=transport_for_dialing)

    async def dial_with_source(self, target: Multiaddr, source: Any) -> Raw:
        self.targets.append((target, source))
        if self.dial_error is not None:
            raise self.dial_error
        assert self.raw is not None
        return self.raw

    async def dial_addr(self, addr: Multiaddr, peer_id: ID) -> Any:
        self.upgrades.append(("plain dial", addr, peer_id))
        return "plain"

    async def dial_addr_as_responder(self, addr: Multiaddr, peer_id: ID, source: Any) -> Any:
        self.upgrades.append(("responder dial", addr, (peer_id, source)))
        return "responder"

    async def upgrade_outbound_raw_conn(self, raw: Any, peer_id: ID) -> Any:
        self.upgrades.append(("outbound", raw, peer_id))
        return "outbound"

    async def upgrade_inbound_raw_conn(self, raw: Any, addr: Multiaddr) -> Any:
        self.upgrades.append(("inbound", raw, addr))
        muxed = SimpleNamespace(closed=False)
        if self.answered_as is not None:
            muxed.peer_id = self.answered_as

        async def close() -> None:
            muxed.closed = True

        muxed.close = close
        if self.register:  # the swarm keeps it among the peer's connections, beside others
            self.connections += [SimpleNamespace(muxed_conn=object()), SimpleNamespace(muxed_conn=muxed), SimpleNamespace()]
        return muxed

    def get_connections(self, peer_id: ID) -> list[Any]:
        self.asked.append(("connections", peer_id))
        return self.connections


async def punch(net: Punching, *, listener_after: float = 0.5, source: Any = SOURCE, addr: Multiaddr = PUBLIC) -> Any:
    return await dial_simultaneous(net, addr, PEER, source=source, listener_after=listener_after)  # type: ignore[arg-type]


async def test_a_simultaneous_open_answers_the_peers_first_flight(autojump_clock: object) -> None:
    raw = Raw([HEADER, PROPOSAL + b"noise bytes"])
    net = Punching(raw)
    started = trio.current_time()
    conn = await punch(net)
    assert trio.current_time() == started  # no wait: the peer spoke
    (kind, answering, addr), = net.upgrades
    assert kind == "inbound" and addr == PUBLIC and conn is net.connections[1] and answering.is_initiator is False
    assert answering.get_transport_addresses() == [PUBLIC6]  # the transport's, not read again from the socket
    assert raw.stream._cached_remote_address == ("2a00:1450::9", 5000)  # read from the socket, IPv6 too
    assert raw.asked == [65536, 65536]
    assert await answering.read(3) == HEADER[:3]  # the first flight is replayed to the upgrade, in full
    assert await answering.read(1000) == HEADER[3:] + PROPOSAL + b"noise bytes"
    assert await answering.read(1000) == b"after"
    assert net.targets == [(Multiaddr(f"{PUBLIC}/p2p/{PEER}"), SOURCE)]
    assert net.asked == [("transport", PUBLIC), ("connections", PEER)]


async def test_a_listener_that_stays_silent_or_only_greets_is_spoken_to_first(autojump_clock: object) -> None:
    for first in ([], [HEADER]):
        net = Punching(Raw(list(first)))
        started = trio.current_time()
        assert await punch(net, listener_after=0.7) == "outbound"
        assert trio.current_time() - started == pytest.approx(0.7)
        (kind, speaking, peer), = net.upgrades
        assert kind == "outbound" and peer == PEER and speaking.is_initiator is True
        assert speaking.get_transport_addresses() == [PUBLIC6]
        assert await speaking.read() == (b"".join(first) or b"after")
    # an address that names the peer already is dialed as it is
    net = Punching(Raw([]))
    await punch(net, addr=Multiaddr(f"{PUBLIC}/p2p/{PEER}"))
    assert net.targets == [(Multiaddr(f"{PUBLIC}/p2p/{PEER}"), SOURCE)]


async def test_a_punch_with_no_source_or_no_such_transport_dials_plainly(autojump_clock: object) -> None:
    net = Punching()
    assert await punch(net, source=None) == "plain"
    assert net.upgrades == [("plain dial", PUBLIC, PEER)] and net.targets == []
    net = Punching(with_source=False)
    assert await punch(net) == "responder"
    assert net.upgrades == [("responder dial", PUBLIC, (PEER, SOURCE))]


async def test_a_punch_that_fails_says_so_and_closes_what_it_opened(autojump_clock: object) -> None:
    net = Punching(dial_error=ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    with pytest.raises(DialError, match=f"could not open a connection to {PUBLIC}") as info:
        await punch(net)
    assert info.value.attempts == [(str(PUBLIC), "[Errno 111] Connection refused")]
    raw = Raw([HEADER], hang=False)
    with pytest.raises(DialError, match="closed the connection at once") as info:
        await punch(Punching(raw))
    assert raw.closed and info.value.attempts == [(str(PUBLIC), "closed")]
    raw = Raw([])
    with trio.move_on_after(0.1):  # cancelled while it waits for the first flight: closed too
        await punch(Punching(raw), listener_after=1.0)
    assert raw.closed


async def test_a_punched_connection_to_the_wrong_peer_or_one_not_kept_is_refused(autojump_clock: object) -> None:
    net = Punching(Raw([HEADER + PROPOSAL]), answered_as=RELAY)
    with pytest.raises(DialError, match=f"{PUBLIC} is not {PEER}") as info:
        await punch(net)
    assert info.value.attempts == [(str(PUBLIC), f"answered as {RELAY}")]
    assert net.connections[1].muxed_conn.closed
    net = Punching(Raw([HEADER + PROPOSAL]), answered_as=None)
    with pytest.raises(DialError) as info:
        await punch(net)
    assert info.value.attempts == [(str(PUBLIC), "answered as None")]
    net = Punching(Raw([HEADER + PROPOSAL]), register=False)
    with pytest.raises(DialError, match=f"^the punched connection to {PEER} was not kept") as info:
        await punch(net)
    assert info.value.attempts == [(str(PUBLIC), "not registered")]


async def test_a_replay_hands_out_the_first_flight_then_reads_through() -> None:
    written: list[bytes] = []
    inner = SimpleNamespace(closed=False, _cached_remote_address=("9.9.9.9", 9))

    asked: list[int | None] = []

    async def read(n: int | None = None) -> bytes:
        asked.append(n)
        return bytearray(b"later")

    async def write(data: bytes) -> None:
        written.append(data)

    async def close() -> None:
        inner.closed = True

    inner.read, inner.write, inner.close = read, write, close
    replay = _Replay(inner, b"abcdef")
    assert await replay.read(4) == b"abcd" and await replay.read(2) == b"ef"
    got = await replay.read(10)
    assert got == b"later" and type(got) is bytes and asked == [10]
    replay = _Replay(inner, b"xyz")
    assert await replay.read(3) == b"xyz" and await replay.read(None) == b"later"
    assert await _Replay(inner, b"xyz").read(None) == b"xyz"
    await replay.write(b"out")
    await replay.close()
    assert written == [b"out"] and inner.closed
    assert replay.get_remote_address() == ("9.9.9.9", 9)
    assert not hasattr(replay, "stream")

