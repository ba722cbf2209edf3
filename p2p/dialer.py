"""Dialing one peer over several addresses, fast.

Why not ``host.connect``: py-libp2p 0.8.1's ``Swarm.dial_peer`` staggers its
addresses with ``trio.move_on_after(0.25)`` around an event that is set only when
a dial *fails*, so a dial that succeeds still waits out the whole 250 ms before
``connect`` returns (measured: 252 ms per connection on loopback, 9 ms without).
It also drops relayed and loopback addresses. This module ranks the addresses
itself (:func:`p2p.addresses.rank_for_dial`) and runs a happy-eyeballs race that
returns on the first success, calling the swarm's per-address ``dial_addr``,
which has no such stall. ``tests/test_dialer.py`` pins the behaviour.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import trio
from libp2p.abc import INetConn, INetworkService
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from .addresses import is_relayed, rank_for_dial, without_peer_id
from .errors import DialError
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
    timeout: float = 10.0,
    circuit: CircuitDialer | None = None,
    source: Callable[[Multiaddr], tuple[str, int] | None] | None = None,
) -> tuple[INetConn, Multiaddr]:
    """Connect to ``peer_id`` trying ``addrs`` best-first; the first success wins.

    Each address gets ``stagger`` seconds of head start before the next one is
    started in parallel, and a failure starts the next one at once. Losing
    attempts are cancelled. Relayed addresses rank last and go to ``circuit``
    (skipped without one). ``source`` picks the local (ip, port) to dial from
    (our listen port, so that the peer observes our NAT's mapping of it).
    Raises :class:`DialError` listing every failure.
    """
    existing = live_connection(network, peer_id)
    if existing is not None:
        return existing, remote_addr(existing)
    ranked = [a for a in rank_for_dial(addrs) if circuit is not None or not is_relayed(a)]
    if not ranked:
        raise DialError(f"no dialable address known for {peer_id}", [(str(a), "relayed (needs a relay client)") for a in addrs])

    failures: list[tuple[str, str]] = []
    winner: list[tuple[INetConn, Multiaddr]] = []

    async def attempt(addr: Multiaddr, failed: trio.Event, cancel: trio.CancelScope) -> None:
        try:
            if is_relayed(addr) and circuit is not None:
                conn = await circuit(addr, peer_id)
            else:
                bind = source(addr) if source is not None else None
                conn = await network.dial_addr(without_peer_id(addr), peer_id, source=bind)
        except Exception as e:  # every failure is reported, none is fatal alone
            failures.append((str(addr), _describe(e)))
            failed.set()
            return
        if winner:  # lost a photo finish: keep the first connection only
            await finish_quietly(conn.close, timeout=2)
            return
        winner.append((conn, addr))
        cancel.cancel()

    with trio.move_on_after(timeout) as deadline:
        async with trio.open_nursery() as nursery:
            for addr in ranked:
                failed = trio.Event()
                nursery.start_soon(attempt, addr, failed, nursery.cancel_scope)
                with trio.move_on_after(stagger):
                    await failed.wait()
    if winner:
        return winner[0]
    if deadline.cancelled_caught:
        pending = {str(a) for a in ranked} - {f[0] for f in failures}
        failures.extend((a, f"timed out after {timeout:g}s") for a in sorted(pending))
    raise DialError(f"could not connect to {peer_id}", failures)


def backoff_delays(initial: float, maximum: float) -> Iterator[float]:
    """Exponential backoff with a cap: initial, 2*initial, ... maximum, maximum, ..."""
    delay = initial
    while True:
        yield delay
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

