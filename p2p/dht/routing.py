"""Kademlia routing, sans-I/O: ids and distances, the k-bucket table, and the lookup state machine.

Nothing here touches sockets, trio or clocks: callers pass ``now`` and feed
replies in, so the logic is tested deterministically and the I/O layer (RPC
handlers, pings, refresh timers) stays a thin shell around it.

The table is meant for DHT *servers* only: the I/O layer adds a peer after it
answered a DHT request over a connection we could also have dialled, never a
peer that is merely a client (behind NAT, relayed), so that nobody routes
lookups at peers that cannot be reached.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import heapq
import ipaddress
import math
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache

from libp2p.peer.id import ID
from multiaddr import Multiaddr

ID_BITS = 256


class DHTID(int):
    """A point of the 256-bit Kademlia key space; peers and keys live in the same space.

    Why sha256 and 256 bits: libp2p peer ids of Ed25519 keys are *identity*
    multihashes (a fixed prefix followed by the public key), so their raw bits
    are far from uniform; hashing makes positions uniform and not choosable
    (an attacker must grind keys to land next to a target). sha256 over the
    peer id bytes is also what the libp2p Kademlia spec uses, and 256 bits
    costs nothing over 160 with Python ints.
    """

    @classmethod
    def from_key(cls, key: bytes) -> DHTID:
        # Not cached: a key is hashed once per operation or request, and most keys are written once
        # (a relay's visitors' records filled the peers' cache with keys never seen again).
        return cls(_sha256_int(bytes(key)))

    @classmethod
    def from_peer(cls, peer_id: ID) -> DHTID:
        return cls(_peer_hash(peer_id.to_bytes()))

    def xor_distance(self, other: int) -> int:
        return int(self) ^ int(other)

    def bucket_index(self, other: int) -> int:
        """Index of the bucket ``other`` falls into as seen from ``self``: 255 is the far half.

        ``floor(log2(distance))``; -1 for ``other == self`` (it belongs in no bucket).
        """
        return (int(self) ^ int(other)).bit_length() - 1

    def __repr__(self) -> str:
        return f"DHTID({int(self):064x})"


def _sha256_int(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


#: Peer ids' hashes, cached because the same peers are hashed again and again (every reply lists
#: them); ~310 bytes an entry, ~10 MB full: 32,768 peers is three times the largest swarm simulated.
_peer_hash = lru_cache(maxsize=32768)(_sha256_int)


def ip_group(addr: Multiaddr | str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The diversity group of an address: its /24 (IPv4) or /48 (IPv6), or None when exempt.

    Groups bound how much of the table one operator (one subnet) can take over
    cheaply. Pass the *observed* remote address of the connection, not what the
    peer claims. Non-global addresses (loopback, private, link-local, CGNAT)
    return None and are not limited, so LAN and single-host test clusters work;
    so do DNS names and relayed addresses, which cannot be grouped without I/O.
    """
    if isinstance(addr, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return _ip_group(addr)
    if isinstance(addr, str) and not addr.startswith("/"):
        return _ip_group(ipaddress.ip_address(addr))
    return _multiaddr_group((Multiaddr(addr) if isinstance(addr, str) else addr).to_bytes())


@lru_cache(maxsize=32768)
def _multiaddr_group(raw: bytes) -> str | None:
    # Cached by the address's bytes: every new contact's observed address is grouped, and
    # parsing a multiaddr is ~90 us (most of admitting a contact, at scale). ~200 bytes an
    # entry; a public node sees a new address (a new port) at nearly every inbound connection.
    parts = list(Multiaddr(raw).items())
    if any(proto.name == "p2p-circuit" for proto, _ in parts):
        return None  # observed at its relay's address (which comes first): not the peer's own
    ip = next((ipaddress.ip_address(str(value)) for proto, value in parts if proto.name in ("ip4", "ip6")), None)
    return None if ip is None else _ip_group(ip)


def _ip_group(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_global:
        return None
    prefix = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """A peer as lookups see it. ``dht_id`` is always derived from ``peer_id``, never taken on trust."""

    peer_id: ID
    addrs: tuple[Multiaddr, ...] = ()
    dht_id: DHTID = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dht_id", DHTID.from_peer(self.peer_id))


@dataclass(slots=True)
class Contact:
    """A routing-table entry: the peer plus what the table needs to manage it."""

    peer_id: ID
    dht_id: DHTID
    addrs: tuple[Multiaddr, ...]
    ip_group: str | None
    last_seen: float
    failures: int = 0
    #: When it last answered a call of ours, or joined the table answering; -inf for a caller that
    #: has not answered yet: a peer that only calls us proves it is alive, not that we can reach it
    #: (:meth:`RoutingTable.unanswered` lists it ``new_after`` seconds after it joined, so a
    #: maintenance pass checks it unless one of our calls heard it answer first).
    answered: float = 0.0
    #: When it joined the table.
    added: float = 0.0

    @property
    def info(self) -> PeerInfo:
        return PeerInfo(self.peer_id, self.addrs)


class AddStatus(enum.Enum):
    ADDED = "added"
    UPDATED = "updated"
    CACHED = "replacement-cached"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class AddResult:
    """What ``add`` did. On CACHED, ``ping_candidate`` is the bucket's least-recently-seen
    questionable contact (see :meth:`RoutingTable.is_good`; None when all are good): the I/O layer pings it and calls ``mark_failed`` if it is dead, which (after
    enough failures) evicts it and promotes the newcomer from the replacement cache."""

    status: AddStatus
    reason: str | None = None
    ping_candidate: Contact | None = None


@dataclass(slots=True)
class _Bucket:
    # Plain dicts (insertion-ordered), not OrderedDict: iterating an OrderedDict looks every key
    # up again, and py-libp2p's ID hashes in Python. :meth:`RoutingTable.nearest` reads buckets
    # for every reply; with the tuples of states below, the simulator at 1,000 peers took 18%
    # less CPU (35.2 s to 29.0 s, the same results).
    contacts: dict[ID, Contact] = field(default_factory=dict)  # least recently seen first
    replacements: dict[ID, Contact] = field(default_factory=dict)  # most recent last
    groups: Counter[str] = field(default_factory=Counter)
    last_touched: float | None = None


class RoutingTable:
    """Kademlia k-buckets as a flat array of 256, indexed by ``floor(log2(xor distance))``.

    Why flat rather than split-on-own-bucket: the buckets are the same ranges of
    the key space except close to our own id, where the split tree keeps one
    big bucket that a flat array splits further; those near buckets are almost
    always under-full anyway, so the flat array holds at least as many close
    contacts, needs no tree, and bucket lookup is one ``bit_length``.

    Full buckets follow Kademlia's rule of preferring old live contacts (long
    uptime predicts more uptime, and flooding newcomers cannot push them out):
    newcomers wait in a bounded replacement cache, and the least recently seen
    contact not known good (:meth:`is_good`) is pinged to make room. Diversity: at most
    ``max_per_ip_group`` contacts of one IP group per bucket and
    ``max_per_ip_group_total`` in the whole table.
    """

    def __init__(
        self,
        local: DHTID,
        *,
        k: int = 20,
        max_per_ip_group: int = 2,
        max_per_ip_group_total: int = 10,
        replacement_cache_size: int | None = None,
        max_failures: int = 3,
        good_for: float = 900.0,
        rng: random.Random | None = None,
    ) -> None:
        self.local = local
        self.k = k
        self.max_per_ip_group = max_per_ip_group
        self.max_per_ip_group_total = max_per_ip_group_total
        self.replacement_cache_size = k if replacement_cache_size is None else replacement_cache_size
        self.max_failures = max_failures
        self.good_for = good_for
        self._rng = rng or random.Random()
        self._buckets = [_Bucket() for _ in range(ID_BITS)]
        self._where: dict[ID, int] = {}  # peer -> bucket index, for contacts only
        self._lowest = ID_BITS  # the lowest non-empty bucket (ID_BITS: none)
        self._groups: Counter[str] = Counter()

    def bucket_of(self, dht_id: int) -> int:
        return self.local.bucket_index(dht_id)

    def add(
        self,
        peer_id: ID,
        dht_id: DHTID | None = None,
        addrs: Iterable[Multiaddr] = (),
        ip_group: str | None = None,
        *,
        now: float,
        answered: bool = True,
        ping: bool = True,
    ) -> AddResult:
        """Insert or refresh a contact seen alive at ``now``: it answered a call of ours
        (``answered``), or called us. A given ``dht_id`` is checked, not trusted. ``ping=False``:
        a caller that will not ping a full bucket's questionable contact spares the search for
        it (the simulator's warm start fills millions of replacement caches)."""
        derived = DHTID.from_peer(peer_id)
        if dht_id is not None and dht_id != derived:
            return AddResult(AddStatus.REJECTED, "dht id does not match peer id")
        if derived == self.local:
            return AddResult(AddStatus.REJECTED, "local id")
        index = self.bucket_of(derived)
        bucket = self._buckets[index]
        bucket.last_touched = now
        existing = bucket.contacts.get(peer_id)
        if existing is not None:  # keeps the group it was admitted under
            existing.addrs = tuple(addrs) or existing.addrs
            self.mark_seen(peer_id, now, answered=answered)
            return AddResult(AddStatus.UPDATED)
        if ip_group is not None:
            if bucket.groups[ip_group] >= self.max_per_ip_group:
                return AddResult(AddStatus.REJECTED, f"ip group {ip_group} limit reached in bucket {index}")
            if self._groups[ip_group] >= self.max_per_ip_group_total:
                return AddResult(AddStatus.REJECTED, f"ip group {ip_group} limit reached in table")
        contact = Contact(peer_id, derived, tuple(addrs), ip_group, now, answered=now if answered else -math.inf,
                          added=now)
        if len(bucket.contacts) < self.k:
            self._insert(index, contact)
            return AddResult(AddStatus.ADDED)
        if self.replacement_cache_size <= 0:
            return AddResult(AddStatus.REJECTED, "bucket full")
        bucket.replacements.pop(peer_id, None)
        bucket.replacements[peer_id] = contact
        while len(bucket.replacements) > self.replacement_cache_size:
            del bucket.replacements[next(iter(bucket.replacements))]  # the oldest
        if not ping:
            return AddResult(AddStatus.CACHED, "bucket full")
        questionable = next((c for c in bucket.contacts.values() if not self.is_good(c, now)), None)
        return AddResult(AddStatus.CACHED, "bucket full", questionable)

    def is_good(self, contact: Contact, now: float) -> bool:
        """BEP 5's good node: it has answered a call of ours, and answered or called us within
        ``good_for`` (15 minutes there). A full bucket pings only its questionable contacts when a
        newcomer arrives: pinging the oldest on every arrival was a quarter of the calls of 100
        real peers joining (tests/test_dht_churn.py), almost all to contacts that had just answered."""
        return contact.answered > -math.inf and now - contact.last_seen < self.good_for

    def _insert(self, index: int, contact: Contact) -> None:
        bucket = self._buckets[index]
        bucket.replacements.pop(contact.peer_id, None)
        bucket.contacts[contact.peer_id] = contact
        self._where[contact.peer_id] = index
        self._lowest = min(self._lowest, index)
        if contact.ip_group is not None:
            bucket.groups[contact.ip_group] += 1
            self._groups[contact.ip_group] += 1

    def remove(self, peer_id: ID) -> Contact | None:
        """Drop a contact (or cached replacement); returns the replacement promoted in its place, if any.

        The most recently seen replacement that still fits the diversity limits is promoted.
        """
        index = self._where.pop(peer_id, None)
        if index is None:
            bucket = self._buckets[self.bucket_of(DHTID.from_peer(peer_id))]
            bucket.replacements.pop(peer_id, None)
            return None
        bucket = self._buckets[index]
        gone = bucket.contacts.pop(peer_id)
        if gone.ip_group is not None:
            bucket.groups[gone.ip_group] -= 1
            self._groups[gone.ip_group] -= 1
        for candidate in reversed(list(bucket.replacements.values())):
            group = candidate.ip_group
            if group is None or (
                bucket.groups[group] < self.max_per_ip_group and self._groups[group] < self.max_per_ip_group_total
            ):
                del bucket.replacements[candidate.peer_id]
                self._insert(index, candidate)
                return candidate
        if not bucket.contacts and index == self._lowest:
            self._lowest = next((i for i in range(index + 1, ID_BITS) if self._buckets[i].contacts), ID_BITS)
        return None

    def mark_seen(self, peer_id: ID, now: float, *, answered: bool = True) -> None:
        """The peer answered a call of ours (``answered``), or called us: it becomes the most
        recently seen of its bucket, and its failures are forgiven (Kademlia's rule: a busy peer
        on a loaded machine misses a timeout and still calls). Only an answer moves ``answered``:
        a peer that calls us and never answers (silent, or unreachable) is caught by the check of
        quiet contacts (:meth:`unanswered`)."""
        index = self._where.get(peer_id)
        if index is None:
            return
        bucket = self._buckets[index]
        contact = bucket.contacts[peer_id]
        contact.last_seen, contact.failures = now, 0
        if answered:
            contact.answered = now
        bucket.contacts[peer_id] = bucket.contacts.pop(peer_id)  # to the end: most recently seen
        bucket.last_touched = now

    def mark_failed(self, peer_id: ID) -> bool:
        """The peer did not answer; after ``max_failures`` in a row it is evicted. Returns whether it was."""
        index = self._where.get(peer_id)
        if index is None:
            return False
        contact = self._buckets[index].contacts[peer_id]
        contact.failures += 1
        if contact.failures < self.max_failures:
            return False
        self.remove(peer_id)
        return True

    def touch(self, target: int, now: float) -> None:
        """A lookup for ``target`` was done: its bucket counts as refreshed."""
        index = self.bucket_of(target)
        if index >= 0:
            self._buckets[index].last_touched = now

    def nearest(self, target: int, count: int | None = None, exclude: Iterable[ID] = ()) -> list[Contact]:
        """The ``count`` (default k) contacts closest to ``target`` by XOR distance, closest first.

        Buckets are read in order of distance, each wholly closer than the next, so a call ranks
        one or two buckets, not the table. With ``d = target ^ local`` and ``h`` its top bit (the
        bucket ``target`` falls in): bucket ``h``'s contacts are all closer than ``2**h``; those
        of a bucket ``b < h`` are within ``[2**h, 2**(h+1))`` with bit ``b`` of their distance
        the opposite of ``d``'s, so walking ``b`` down from ``h - 1`` the buckets where ``d`` has a
        1 come first (nearest first) and those where it has a 0 last (farthest first); each
        bucket above ``h`` is farther than the one below it.
        """
        skip = set(exclude)
        t = int(target)
        wanted = self.k if count is None else count
        n = wanted + len(skip)  # the nearest without ``skip`` are among the nearest ``len(skip)`` more
        out: list[Contact] = []
        for bucket in self._in_order(t ^ int(self.local)):
            if not bucket.contacts:
                continue
            contacts = list(bucket.contacts.values())
            want = n - len(out)
            if len(contacts) <= want:
                contacts.sort(key=lambda c: c.dht_id ^ t)
                out.extend(contacts)
            else:
                out.extend(heapq.nsmallest(want, contacts, key=lambda c: c.dht_id ^ t))
            if len(out) >= n:
                break
        # excluded afterwards, not contact by contact: one or two ids (the caller), where testing
        # every contact of the buckets read was a tenth of the simulator's CPU
        return [c for c in out if c.peer_id not in skip][:wanted] if skip else out

    def _in_order(self, d: int) -> Iterator[_Bucket]:
        """The buckets nearest first for a target at distance ``d`` from us (see :meth:`nearest`)."""
        buckets, lowest, h = self._buckets, self._lowest, d.bit_length() - 1
        if h >= 0:
            yield buckets[h]
            for b in range(h - 1, lowest - 1, -1):
                if d >> b & 1:
                    yield buckets[b]
            for b in range(lowest, h):
                if not d >> b & 1:
                    yield buckets[b]
        for b in range(max(h + 1, lowest), ID_BITS):
            yield buckets[b]

    def unanswered(self, now: float, after: float, new_after: float = 0.0) -> list[Contact]:
        """Contacts that have not answered a call of ours for ``after`` seconds, longest first:
        ping them, and drop those that do not answer. Lookups rarely ask the contacts of the
        near buckets, so without this a peer that left stays there (and is handed to others).

        A caller that has never answered is listed first, ``new_after`` seconds after it joined:
        a silent peer that calls (it accepts connections and never answers) was handed to every
        lookup near it for the whole ``after``, and lookups met two or three of them one after
        another (bench/scale.py). The short wait spares the ping when one of our own calls hears
        it answer meanwhile."""
        quiet = [c for b in self._buckets for c in b.contacts.values()
                 if (now - c.added >= new_after if c.answered == -math.inf else now - c.answered >= after)]
        return sorted(quiet, key=lambda c: (c.answered, c.added))

    def stale_buckets(self, now: float, refresh_interval: float) -> list[DHTID]:
        """One random id inside each bucket not touched for ``refresh_interval``: look them up.

        Only buckets from the far end down to one below the closest non-empty bucket
        are considered: closer ones are expected empty (they hold a 2^-(256-i) share
        of the network), and looking up an id there is the same as a self-lookup.
        An empty table returns nothing: that is bootstrap's job, not refresh's.
        """
        if not self._where:
            return []
        lowest = max(0, self._lowest - 1)
        out: list[DHTID] = []
        for i in range(lowest, ID_BITS):
            touched = self._buckets[i].last_touched
            if touched is None or now - touched >= refresh_interval:
                out.append(self.random_id_in_bucket(i))
        return out

    def random_id_in_bucket(self, index: int) -> DHTID:
        return DHTID(int(self.local) ^ ((1 << index) | self._rng.getrandbits(index)))

    def bucket(self, index: int) -> list[Contact]:
        return list(self._buckets[index].contacts.values())

    def replacements(self, index: int) -> list[Contact]:
        return list(self._buckets[index].replacements.values())

    def get(self, peer_id: ID) -> Contact | None:
        index = self._where.get(peer_id)
        return None if index is None else self._buckets[index].contacts[peer_id]

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[Contact]:
        for bucket in self._buckets:
            yield from bucket.contacts.values()


class _State(enum.Enum):
    NEW = 0
    IN_FLIGHT = 1
    RESPONDED = 2
    FAILED = 3
    #: asked, no answer yet, and past the caller's short timeout: its slot is free and the lookup
    #: no longer waits for it, but a late answer is still taken
    SLOW = 4


# Tuples, not sets: ``in`` then compares by identity, where a set calls Enum's pure-Python __hash__.
_LIVE = (_State.NEW, _State.IN_FLIGHT, _State.RESPONDED)
_ANSWERED = (_State.RESPONDED,)
_ASKED = (_State.IN_FLIGHT, _State.SLOW)


@dataclass(slots=True)
class _Candidate:
    info: PeerInfo
    distance: int
    state: _State = _State.NEW


class Lookup:
    """An iterative parallel Kademlia lookup, sans-I/O.

    Drive it with ``next_queries()`` (send FIND_NODE to each peer it returns),
    ``on_response`` / ``on_failure`` (feed back replies or timeouts), until ``done``.
    Queries go to the closest not-yet-queried candidates among the k closest
    non-failed ones, at most ``alpha`` in flight; it ends when those k closest
    have all answered (or there is no one left to ask). ``result()`` is the k
    closest that answered.

    A peer that has not answered within the caller's short timeout is reported with
    ``on_slow``: it gives up its slot and the lookup stops waiting for it (as a failed
    one), but the call goes on to the RPC timeout and a late answer is still taken.
    Without this a silent peer (one that accepts the connection and never answers)
    among the k closest held every lookup that met it for the whole RPC timeout
    (libtorrent's DHT has the same short timeout for the same reason).

    Defences against lying peers: no peer is ever queried twice; a reply may add
    at most ``k`` new candidates (later entries are dropped), and its references to
    the replying peer itself, to us, and to excluded peers are ignored; replies
    from peers we did not ask are ignored; ids are derived from peer ids
    (``PeerInfo``), so a liar cannot place fake contacts near the target
    without grinding keys. Fake far-away contacts only cost queries that fail,
    and can never displace the honest closer peers once those are known.

    Candidates are kept sorted by distance, so each step reads the first k live ones
    instead of ranking them all (at ten thousand peers, ranking was most of a lookup's CPU).
    """

    def __init__(
        self,
        target: int,
        k: int,
        alpha: int,
        seeds: Iterable[PeerInfo],
        *,
        local: int | None = None,
        exclude: Iterable[ID] = (),
    ) -> None:
        self.target = DHTID(target)
        self.k, self.alpha = k, alpha
        self._local = local
        self._excluded = set(exclude)
        self._by_peer: dict[ID, _Candidate] = {}
        self._sorted: list[_Candidate] = []  # by distance to the target, closest first
        self._stopped = False
        self.in_flight = 0
        self.queries = 0
        self._add_candidates(seeds, limit=None)

    def _add_candidates(self, peers: Iterable[PeerInfo], limit: int | None) -> int:
        """New candidates, at most ``limit``: never ourselves, an excluded peer or one already known
        (the peer answering is one: it was queried)."""
        added = 0
        t = int(self.target)
        for peer in peers:
            if limit is not None and added >= limit:
                break
            pid = peer.peer_id
            if pid in self._excluded or pid in self._by_peer or peer.dht_id == self._local:
                continue
            candidate = _Candidate(peer, int(peer.dht_id) ^ t)
            self._by_peer[pid] = candidate
            bisect.insort(self._sorted, candidate, key=_distance)
            added += 1
        return added

    def _closest(self, states: tuple[_State, ...]) -> list[_Candidate]:
        """The (up to) k closest candidates in one of ``states``, closest first."""
        out: list[_Candidate] = []
        for candidate in self._sorted:
            if candidate.state in states:
                out.append(candidate)
                if len(out) == self.k:
                    break
        return out

    def _closest_live(self) -> list[_Candidate]:
        return self._closest(_LIVE)

    def next_queries(self) -> list[PeerInfo]:
        """Peers to query now (marked in flight); empty when alpha are already in flight or done."""
        if self._stopped:
            return []
        budget = self.alpha - self.in_flight
        out: list[PeerInfo] = []
        for candidate in self._closest_live():
            if budget <= 0:
                break
            if candidate.state is _State.NEW:
                candidate.state = _State.IN_FLIGHT
                out.append(candidate.info)
                budget -= 1
        self.in_flight += len(out)
        self.queries += len(out)
        return out

    def on_response(self, peer: ID, closer_peers: Iterable[PeerInfo]) -> int:
        """``peer`` answered with ``closer_peers``; returns how many new candidates were taken."""
        candidate = self._by_peer.get(peer)
        if self._stopped or candidate is None or candidate.state not in _ASKED:
            return 0  # unsolicited, a late duplicate, or after stop()
        if candidate.state is _State.IN_FLIGHT:
            self.in_flight -= 1
        candidate.state = _State.RESPONDED
        return self._add_candidates(closer_peers, limit=self.k)

    def on_slow(self, peer: ID) -> None:
        """``peer`` is past the short timeout: free its slot and stop waiting for it (its call goes on)."""
        candidate = self._by_peer.get(peer)
        if candidate is not None and candidate.state is _State.IN_FLIGHT:
            candidate.state = _State.SLOW
            self.in_flight -= 1

    def on_failure(self, peer: ID) -> None:
        """``peer`` timed out or errored; it is dropped from the result and never retried."""
        candidate = self._by_peer.get(peer)
        if candidate is not None and candidate.state in _ASKED:
            if candidate.state is _State.IN_FLIGHT:
                self.in_flight -= 1
            candidate.state = _State.FAILED

    def stop(self) -> None:
        """End early (e.g. a value lookup found its value); in-flight replies are then ignored."""
        self._stopped = True

    @property
    def done(self) -> bool:
        if self._stopped:
            return True
        return all(c.state is _State.RESPONDED for c in self._closest_live())

    def result(self) -> list[PeerInfo]:
        """The (up to) k closest peers that answered, closest first."""
        return [c.info for c in self._closest(_ANSWERED)]


def _distance(candidate: _Candidate) -> int:
    return candidate.distance
