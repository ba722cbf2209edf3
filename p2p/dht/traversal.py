"""Several lookups driven at once, sans-I/O: whom to ask what, and what each reply means.

Every read and write of the DHT is an iterative lookup (:class:`.routing.Lookup`).
Lookups of many keys share their RPCs: each round, the peers that several
lookups want to ask get one ``dht.find`` carrying all their queries. This module
decides those requests and takes their replies (records checked by every rule a
store applies, closer peers bounded by ``k``); the DHT's I/O shell sends them,
and the simulator (``p2p/sim``) delivers them over its modelled network, so both
run the same decisions.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from libp2p.peer.id import ID

from . import protocol as wire
from .proto import dht_pb2 as pb
from .records import DHTError, DHTRecord, LocalStore
from .routing import Lookup, PeerInfo

log = logging.getLogger(__name__)


@dataclass
class Search:
    """One key's (or target's) part of a traversal."""

    lookup: Lookup
    key: bytes | None = None
    #: Stop as soon as any valid record was found (reads that accept any copy).
    first_found: bool = False
    #: Valid records merged with the store's own rules (newest expiration wins, per subkey).
    found: LocalStore | None = None
    holders: set[ID] = field(default_factory=set)
    lacking: list[PeerInfo] = field(default_factory=list)

    def query(self) -> pb.Query:
        """What this search asks a peer: a key's records and closer peers, or closer peers to a target."""
        if self.key is not None:
            return pb.Query(key=self.key, first_copy=self.first_found)
        return wire.target_query(self.lookup.target)


#: Replies whose median says whether round trips are long (:meth:`ReplyTimer.parallelism`).
RECENT_REPLIES = 16


class ReplyTimer:
    """How long a lookup waits for a reply before it asks someone else: TCP's retransmission
    timer (RFC 6298: smoothed reply time plus four deviations, 1 s before the first sample)
    over this peer's ``dht.find`` replies, within ``[floor, ceiling]``. The floor is RFC 6298's
    1 s: with 0.25 s, a loaded machine's replies (CI's, a swarm on one host) passed it, and a
    latest read or a store could end without the replica that was only busy.

    A reply past it is still taken (:meth:`Lookup.on_slow`); the call itself ends at the RPC
    timeout. A fixed short timeout would be too short on a slow link or too long on a fast one.
    """

    def __init__(self, *, floor: float = 1.0, ceiling: float = 3.0, initial: float = 1.0) -> None:
        self.floor, self.ceiling = floor, ceiling
        self._initial = initial
        self._srtt: float | None = None
        self._rttvar = 0.0
        self._recent: deque[float] = deque(maxlen=RECENT_REPLIES)

    def observe(self, seconds: float) -> None:
        """A reply took ``seconds`` from request to answer."""
        self._recent.append(seconds)
        if self._srtt is None:
            self._srtt, self._rttvar = seconds, seconds / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - seconds)
            self._srtt = 0.875 * self._srtt + 0.125 * seconds

    @property
    def typical(self) -> float | None:
        """The median of the last replies' times (None before the first reply)."""
        return statistics.median(self._recent) if self._recent else None

    def parallelism(self, wide: int, near: int, near_rtt: float) -> int:
        """Queries a lookup keeps in flight: ``wide`` hides round trips on the internet; where the
        typical reply comes back within ``near_rtt`` (a LAN, one machine) there are none to hide,
        and every query more only costs the peers CPU, so ``near``. The median of recent replies,
        not the smoothed time: a burst of load (a swarm starting on one machine) must not hold
        the smoothed figure, which forgets slowly, above the line for the next minutes."""
        typical = self.typical
        return near if typical is not None and typical < near_rtt else wide

    @property
    def slow_after(self) -> float:
        """Seconds without a reply after which the asked peer is treated as slow."""
        timeout = self._initial if self._srtt is None else self._srtt + 4 * self._rttvar
        return min(self.ceiling, max(self.floor, timeout))


#: One ``dht.find`` to send: the peer and the searches whose queries it carries (in order).
Request = tuple[PeerInfo, list[Search]]


class Traversal:
    """Drive ``searches`` together: :meth:`requests` says what to send now, :meth:`on_reply`
    takes each reply (None: the call failed), until :attr:`done`.

    ``k`` bounds the closer peers taken from one reply; ``max_records`` the records taken
    from one result (a store's subkey limit: more could never be kept).
    """

    def __init__(self, searches: list[Search], *, k: int, max_records: int) -> None:
        self.searches = searches
        self._k = k
        self._max_records = max_records
        self.in_flight = 0

    @property
    def done(self) -> bool:
        """Every lookup is done, or nothing is in flight and there is no one left to ask."""
        return self.in_flight == 0 or all(s.lookup.done for s in self.searches)

    def requests(self) -> list[Request]:
        """The calls to make now: one per peer (split at the batch limit) with every query for it."""
        wanted: dict[ID, Request] = {}
        for s in self.searches:
            for peer in s.lookup.next_queries():
                wanted.setdefault(peer.peer_id, (peer, []))[1].append(s)
        out: list[Request] = []
        for peer, batch in wanted.values():
            for start in range(0, len(batch), wire.MAX_BATCH):
                out.append((peer, batch[start:start + wire.MAX_BATCH]))
        self.in_flight += len(out)
        return out

    def on_slow(self, peer: PeerInfo, batch: list[Search]) -> None:
        """``peer`` has not answered a request from :meth:`requests` within :attr:`ReplyTimer.slow_after`:
        the searches it carried stop waiting for it (its reply, if it comes, is still taken)."""
        for search in batch:
            search.lookup.on_slow(peer.peer_id)

    def on_reply(self, peer: PeerInfo, batch: list[Search], response: pb.FindResponse | None, now: float) -> None:
        """``peer``'s reply to a request from :meth:`requests` (None: it failed or timed out);
        ``now`` (wall clock) is what records' expirations are checked against."""
        self.in_flight -= 1
        for i, search in enumerate(batch):
            if response is None:
                search.lookup.on_failure(peer.peer_id)
            else:
                self._take(search, peer, response.results[i], now)

    def _take(self, search: Search, peer: PeerInfo, result: pb.FindResult, now: float) -> None:
        held = False
        if search.key is not None and search.found is not None:
            for raw in result.records[: self._max_records]:
                try:
                    rec = DHTRecord.from_pb(raw)
                    if rec.key != search.key:
                        continue  # an answer to a question we did not ask
                    search.found.store(rec, now)  # every rule a store applies, signatures included
                    held = True
                except DHTError as e:
                    log.debug("DHT: dropped a bad record from %s: %s", peer.peer_id, e)
        if held and search.first_found:
            search.holders.add(peer.peer_id)
            search.lookup.on_response(peer.peer_id, ())
            search.lookup.stop()
            return
        search.lookup.on_response(peer.peer_id, wire.decode_peers(result.closer, self._k))
        if held:
            search.holders.add(peer.peer_id)
        elif search.key is not None:
            search.lacking.append(peer)
