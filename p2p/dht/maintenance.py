"""What the DHT does on its own, sans-I/O: each maintenance pass, and the table's verdict on a peer.

The I/O shell (:class:`.dht.DHT`) runs a pass every ``maintenance_interval`` and acts on every
:meth:`.routing.RoutingTable.add`; the simulator (``p2p/sim/dht.py``) does the same on its
virtual clock. Both ask these functions what to do, so the schedule's decisions (which buckets to refresh,
which contacts to check, whether to republish, whom a new contact makes us call)
and what a join looks up are the same code; only the timers and the calls differ.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from libp2p.peer.id import ID

from .routing import DHTID, AddResult, AddStatus, RoutingTable

#: Stale buckets refreshed per pass: each refresh is a lookup, and a table that was idle for a
#: while (a laptop waking up) has them all stale at once; the rest wait for the next pass.
MAX_REFRESH_PER_PASS = 8


def join_targets(table: RoutingTable) -> list[DHTID]:
    """What a join looks up once an initial peer answered: our own id (our neighbourhood, who then
    know us) and a random id in each of the three farthest buckets (half, a quarter and an eighth
    of the network: the table's far end filled at once rather than at the first refresh)."""
    return [table.local, *(table.random_id_in_bucket(i) for i in (255, 254, 253))]


# A pass is three decisions, each taken when the shell reaches it: the real DHT awaits its refresh
# before it picks the contacts to check, so a quiet contact the refresh heard answer is spared.

def to_refresh(table: RoutingTable, now: float, refresh_interval: float) -> list[DHTID]:
    """A random id in each bucket not looked up for ``refresh_interval`` (at most
    :data:`MAX_REFRESH_PER_PASS`, nearest first: :meth:`RoutingTable.stale_buckets`)."""
    return table.stale_buckets(now, refresh_interval)[:MAX_REFRESH_PER_PASS]


def to_check(table: RoutingTable, now: float, *, check_after: float, check_new_after: float,
             checks: int | None) -> list[ID]:
    """Up to ``checks`` (None: all) contacts to ping and drop if they do not answer: quiet for
    ``check_after``, or callers unchecked for ``check_new_after`` (:meth:`RoutingTable.unanswered`)."""
    quiet = table.unanswered(now, check_after, check_new_after)
    return [c.peer_id for c in (quiet if checks is None else quiet[:checks])]


def check_when_closed(table: RoutingTable, peer: ID, *, connected: bool, checking: Collection[ID],
                      checks: int) -> bool:
    """Whether a connection to ``peer`` that closed calls for a check of it (ping it, drop it if it
    does not answer): it is a contact of ours, no connection to it is left, it is not being checked,
    and fewer than ``checks`` are (a flood of closing connections asks little)."""
    return peer in table and not connected and peer not in checking and len(checking) < checks


def republish_due(now: float, last_republish: float, republish_interval: float | None) -> bool:
    """Whether ``republish_interval`` (None: never) has passed since ``last_republish``."""
    return republish_interval is not None and now - last_republish >= republish_interval


@dataclass(frozen=True)
class AfterAdd:
    """What the table's verdict on a peer asks of us: ``hand_over`` (it is a new contact, and we
    are a server holding records: give it those it is now among the closest for, if we are their
    nearest replica it knows as good), ``ping`` (a full bucket's questionable contact, to be
    pinged and dropped if it does not answer: Kademlia's rule before a newcomer takes its place)."""

    hand_over: bool = False
    ping: ID | None = None


def after_add(result: AddResult, *, server: bool, holds_records: bool, pinging: Collection[ID]) -> AfterAdd:
    """The follow-up of :meth:`RoutingTable.add`'s ``result``; ``pinging``: contacts already being
    pinged (one ping each at a time, however many newcomers wait for its bucket)."""
    if result.status is AddStatus.ADDED:
        return AfterAdd(hand_over=server and holds_records)
    if result.status is AddStatus.CACHED and result.ping_candidate is not None:
        oldest = result.ping_candidate.peer_id
        if oldest not in pinging:
            return AfterAdd(ping=oldest)
    return AfterAdd()
