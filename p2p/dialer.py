"""Dialing one peer over several addresses, fast.

Why not ``host.connect``: py-libp2p 0.8.1's ``Swarm.dial_peer`` staggers its
addresses with ``trio.move_on_after(0.25)`` around an event that is set only when
a dial *fails*, so a dial that succeeds still waits out the whole 250 ms before
``connect`` returns (measured: 252 ms per connection on loopback, 9 ms without).
It also drops relayed and loopback addresses. This module ranks the addresses
itself (:func:`p2p.addresses.rank_for_dial`) and runs a happy-eyeballs race that
returns on the first success, calling the swarm's per-address ``dial_addr``,
which has no such stall. ``tests/test_dialer.py`` pins the behaviour, in virtual time.
"""

from __future__ import annotations

import errno
import random
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio
from libp2p.abc import INetConn, INetworkService
from libp2p.io.abc import ReadWriteCloser
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from . import multistream
from .addresses import Scope, is_relayed, is_unspecified, peer_id_of, rank_for_dial, scope_of, split_circuit, without_peer_id
from .errors import AddressError, DialError
from .libp2p_host import tcp_remote_address
from .trio_util import finish_quietly


#: Dials one ``/p2p-circuit`` address (``…/p2p/<relay>/p2p-circuit/p2p/<peer>``): the NAT layer's relay client.
CircuitDialer = Callable[[Multiaddr, ID], Awaitable[INetConn]]


def live_connection(network: INetworkService, peer_id: ID) -> INetConn | None:
    for conn in network.get_connections(peer_id):
        if not getattr(conn, "is_closed", False):
            return conn
    return None


async def dial(
    network: INetworkService,
    peer_id: ID,
    addrs: list[Multiaddr],
    *,
    stagger: float = 0.25,
    stagger_local: float | None = None,
    timeout: float = 10.0,
    circuit: CircuitDialer | None = None,
    source: Callable[[Multiaddr], tuple[str, int] | None] | None = None,
    on_failure: Callable[[str, str, bool], None] | None = None,
    limit: float | None = None,
) -> tuple[INetConn, Multiaddr]:
    """Connect to ``peer_id`` trying ``addrs`` best-first; the first success wins.

    Each address gets ``stagger`` seconds of head start before the next one is
    started in parallel (a private or loopback one ``stagger_local``, when given: the
    LAN address a NATed peer advertises is no address of ours to reach), and a failure
    starts the next one at once. Losing
    attempts are cancelled. Relayed addresses rank last and go to ``circuit``
    (skipped without one). ``source`` picks the local (ip, port) to dial from
    (our listen port, so that the peer observes our NAT's mapping of it).
    ``on_failure(addr, why, timed_out)`` hears of each address tried that failed; ``timed_out`` says
    it was still trying when ``timeout`` ended (it did not fail: the time did). ``limit`` is the
    caller's whole time, which a timed-out address reports (``timeout`` is what was left of it: a
    connect of 0.3 s said "timed out after 0.29s" on a loaded machine).
    Raises :class:`DialError` listing every failure.
    """
    existing = live_connection(network, peer_id)
    if existing is not None:
        return existing, remote_addr(existing)
    ranked = _one_circuit_per_relay(network, [a for a in rank_for_dial(addrs) if circuit is not None or not is_relayed(a)])
    if not ranked:
        raise DialError(f"no dialable address known for {peer_id}",
                        [(str(a), "unspecified (0.0.0.0 or ::): no address to dial" if is_unspecified(a)
                          else "relayed (needs a relay client)") for a in addrs])

    failures: list[tuple[str, str]] = []
    winner: list[tuple[INetConn, Multiaddr]] = []

    def fail(addr: str, why: str, timed_out: bool = False) -> None:
        failures.append((addr, why))
        if on_failure is not None:
            on_failure(addr, why, timed_out)

    async def attempt(addr: Multiaddr, failed: trio.Event, cancel: trio.CancelScope) -> None:
        try:
            if is_relayed(addr) and circuit is not None:
                conn = await circuit(addr, peer_id)
            else:
                bind = source(addr) if source is not None else None
                try:
                    conn = await network.dial_addr(without_peer_id(addr), peer_id, source=bind)
                except Exception as e:
                    if bind is None or not source_port_taken(e):
                        raise
                    # Our own socket still holds this 4-tuple (a dial of the same peer from the
                    # listen port closed a moment ago: TIME_WAIT for a minute). Nothing is wrong
                    # with the peer: dial it from a fresh port, which only loses one observation
                    # of our NAT's mapping of the listen port.
                    conn = await network.dial_addr(without_peer_id(addr), peer_id, source=None)
        except Exception as e:  # every failure is reported, none is fatal alone
            fail(str(addr), _describe(e))
            failed.set()
            return
        if winner:  # lost a photo finish: keep the first connection only
            await finish_quietly(conn.close, timeout=2, shield=True)  # the winner is cancelling us
            return
        winner.append((conn, addr))
        cancel.cancel()

    with trio.move_on_after(timeout) as deadline:
        async with trio.open_nursery() as nursery:
            for addr in ranked:
                failed = trio.Event()
                nursery.start_soon(attempt, addr, failed, nursery.cancel_scope)
                head = stagger
                if stagger_local is not None and scope_of(addr) in (Scope.PRIVATE, Scope.LOOPBACK):
                    head = stagger_local
                with trio.move_on_after(head):
                    await failed.wait()
    if winner:
        return winner[0]
    if deadline.cancelled_caught:
        pending = {str(a) for a in ranked} - {f[0] for f in failures}
        for a in sorted(pending):
            fail(a, f"timed out after {limit if limit is not None else timeout:.2g}s", True)
    raise DialError(f"could not connect to {peer_id}", failures)


def source_port_taken(error: BaseException) -> bool:
    """Whether a dial from a bound source port failed because that (source, destination) pair is
    in use by one of our own sockets (``EADDRNOTAVAIL`` from ``connect``, ``EADDRINUSE`` from
    ``bind``), however deep py-libp2p wrapped the ``OSError``."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _one_circuit_per_relay(network: INetworkService, addrs: list[Multiaddr]) -> list[Multiaddr]:
    """Drop relayed addresses that go through a relay we already hold a connection to, but the first.

    A peer lists its circuit once per address of its relay (IPv4, IPv6, a LAN one):
    over one relay connection they are the same circuit, and racing them (0.25 s
    apart, less than a relayed handshake takes) asks the relay twice, so the peer
    answers two STOPs and js-libp2p keeps neither whole when one is abandoned.
    Through a relay we are not connected to, each relay address is a real alternative.
    """
    out: list[Multiaddr] = []
    seen: set[ID] = set()
    for addr in addrs:
        if is_relayed(addr):
            try:
                _, relay = split_circuit(addr)
            except AddressError:
                out.append(addr)  # names no relay: the circuit dialer says so, as a failure of this address
                continue
            if live_connection(network, relay) is not None:
                if relay in seen:
                    continue
                seen.add(relay)
        out.append(addr)
    return out


async def dial_simultaneous(network: INetworkService, addr: Multiaddr, peer_id: ID, *,
                            source: tuple[str, int] | None, listener_after: float) -> INetConn:
    """The DCUtR initiator's dial of a hole punch: the security handshake's responder on a
    simultaneous open, its initiator when the address turns out to be a listener.

    On a TCP simultaneous open the two dials merge into one connection, and DCUtR
    gives the roles: the peer that answered CONNECT speaks first, we answer (py-libp2p's
    ``dial_addr_as_responder``). But when our SYN reaches a *listening* socket (the
    peer is public, or port-mapped, and never said so in identify, as js-libp2p does
    until its AutoNAT confirmed an address), the listener waits for us to speak while
    we wait for it: the dial hangs for its whole timeout. So we wait ``listener_after``
    seconds (a couple of the relayed round trips the CONNECT exchange took) for the
    peer's first flight: a dialer's (the multistream header and a proposal) means a
    simultaneous open, and we answer; silence, or a listener's header alone, means a
    listener, and we speak first. Either way the bytes read are replayed to the upgrade.
    """
    transport = network.transport_manager.transport_for_dialing(addr)  # type: ignore[attr-defined]
    dial_with_source = getattr(transport, "dial_with_source", None)
    if source is None:
        # No listen socket of this family to dial from: the peer's SYNs aim at the ports we offered,
        # never at this dial's ephemeral one, so there is no simultaneous open to answer. What our
        # SYN reaches is a listener, and we speak first (as the responder we waited for it while it
        # waited for us: a peer with no listen socket punching a listening one failed every round).
        return await network.dial_addr(addr, peer_id)
    if transport is None or dial_with_source is None:
        return await network.dial_addr_as_responder(addr, peer_id, source=source)
    target = addr if peer_id_of(addr) is not None else addr.encapsulate(Multiaddr(f"/p2p/{peer_id.to_base58()}"))
    try:
        raw = await dial_with_source(target, source)
    except Exception as e:
        raise DialError(f"could not open a connection to {addr}", [(str(addr), _describe(e))]) from e
    first = b""
    try:
        with trio.move_on_after(listener_after):
            while multistream.complete_messages(first) < 2:
                chunk = await raw.read(65536)
                if not chunk:
                    raise DialError(f"{addr} closed the connection at once", [(str(addr), "closed")])
                first += chunk
    except BaseException:
        await finish_quietly(raw.close)
        raise
    tcp_remote_address(getattr(raw, "stream", None))  # IPv6 too: else the punched connection has no address
    addresses = raw.get_transport_addresses()
    if multistream.complete_messages(first) < 2:
        # Silence, or a multistream header alone (py-libp2p's listener sends it unasked):
        # a listener waiting for our proposal. We speak first; what it sent is replayed.
        speaking = RawConnection(_Replay(raw.stream, first), initiator=True, addresses=addresses)
        return await network.upgrade_outbound_raw_conn(speaking, peer_id)
    # Header and a proposal: the peer dialed too and speaks first (a simultaneous open).
    answering = RawConnection(_Replay(raw.stream, first), initiator=False, addresses=addresses)
    muxed = await network.upgrade_inbound_raw_conn(answering, addr)
    if getattr(muxed, "peer_id", None) != peer_id:
        await finish_quietly(muxed.close)
        raise DialError(f"{addr} is not {peer_id}", [(str(addr), f"answered as {getattr(muxed, 'peer_id', None)}")])
    for conn in reversed(network.get_connections(peer_id)):
        if getattr(conn, "muxed_conn", None) is muxed:
            return conn
    raise DialError(f"the punched connection to {peer_id} was not kept", [(str(addr), "not registered")])


class _Replay(ReadWriteCloser):
    """A byte stream that first returns bytes already read from it (the peer's first flight).

    It has no ``stream`` attribute on purpose: the Noise session then reads through
    it rather than from the socket underneath (``p2p/noise.py``'s fast path)."""

    def __init__(self, inner: Any, first: bytes) -> None:
        self._inner = inner
        self._first = first

    async def read(self, n: int | None = None) -> bytes:
        if self._first:
            if n is None or n >= len(self._first):
                out, self._first = self._first, b""
            else:
                out, self._first = self._first[:n], self._first[n:]
            return out
        return bytes(await self._inner.read(n))

    async def write(self, data: bytes) -> None:
        await self._inner.write(data)

    async def close(self) -> None:
        await self._inner.close()

    def get_remote_address(self) -> tuple[str, int] | None:
        return tcp_remote_address(self._inner)  # IPv6 too (py-libp2p's answers None there)


def backoff_delays(initial: float, maximum: float, *, jitter: float = 0.0,
                   rng: random.Random | None = None) -> Iterator[float]:
    """Exponential backoff with a cap: initial, 2*initial, ... maximum, maximum, ...

    With ``jitter``, each delay is cut by up to that fraction of it, drawn from ``rng``: peers
    cut off at one moment (their relay restarted) otherwise dial it back at the same moments,
    all their handshakes at once (go-libp2p's backoffs jitter alike). Cut, never stretched: the
    pace stays at most the one documented.
    """
    if jitter and rng is None:
        raise ValueError("a jittered backoff needs its rng")
    delay = initial
    while True:
        yield delay if rng is None else delay * (1.0 - jitter * rng.random())
        delay = min(maximum, delay * 2)


def remote_addr(conn: INetConn) -> Multiaddr:
    """The remote transport address of a connection (0.0.0.0 when it has none)."""
    try:
        addrs = conn.get_transport_addresses()
        if addrs:
            return addrs[0]
    except Exception:
        pass
    return Multiaddr("/ip4/0.0.0.0/tcp/0")


def address_labels(addr: str) -> tuple[str, str]:
    """(transport, ip_version) of an address, as go-libp2p's swarm metrics label them (a relayed
    address's transport is ``circuit``)."""
    transport = "circuit" if "/p2p-circuit" in addr else "tcp" if "/tcp/" in addr else "other"
    ip_version = "ip6" if addr.startswith("/ip6/") else "ip4" if addr.startswith("/ip4/") else "unknown"
    return transport, ip_version


def classify_dial_error(addr: str, why: str) -> tuple[str, str, str]:
    """(transport, error, ip_version) of one failed dial, as go-libp2p labels ``dial_errors_total``."""
    transport, ip_version = address_labels(addr)
    text = why.lower()
    error = next((label for needle, label in _DIAL_ERRORS if needle in text), "other")
    return transport, error, ip_version


#: Substrings of a failure's text -> go-libp2p's error labels.
_DIAL_ERRORS = (
    ("timed out", "deadline"), ("timeout", "deadline"), ("refused", "connection_refused"),
    ("no route", "no_route"), ("unreachable", "no_route"), ("resource limit", "resource_limit_exceeded"),
    ("over the limit", "resource_limit_exceeded"), ("peer id mismatch", "peer_id_mismatch"),
    ("mismatch", "peer_id_mismatch"), ("noise", "security"), ("yamux", "muxer"), ("reset", "connection_reset"),
    ("relay", "relay"),
)


def _describe(e: BaseException) -> str:
    parts = []
    seen = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = str(cur).strip() or type(cur).__name__
        if text not in parts:
            parts.append(text)
        cur = cur.__cause__ or cur.__context__
    return ": ".join(parts[:3])

