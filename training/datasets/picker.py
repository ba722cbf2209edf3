"""Which piece to ask of which seeder, and which seeders to talk to (pure: ``now`` is passed in).

:class:`PiecePicker` is a download's piece state, as the best swarms keep it:

* **rarest first**: of the pieces a seeder offers that we lack and asked
  nobody for, the one the fewest seeders hold (ties broken at random, so
  downloaders spread over different pieces and have something to trade);
  within that, shards in the caller's priority order (a trainer wants its
  first shard whole before the rest);
* a shard's **leaves** (its piece hashes, checked against the root) are asked
  for before any of its pieces, of a seeder that holds some of it;
* a **pipeline** of requests per seeder, so a far seeder's round trip is not
  paid per piece: about ``queue_seconds`` of what it delivered lately (at
  least one piece, at most ``pipeline``), so a slow seeder is not queued
  pieces a fast one would bring sooner;
* an **endgame**: once every missing piece is asked of someone, a seeder with
  nothing new to give is asked for pieces already in flight elsewhere that are
  late (asked more than ``endgame_patience`` of its own piece times ago; at most
  ``endgame_duplicates`` requests a piece), so the last pieces do not wait on
  the slowest seeder, and a duplicate's upload is spent only where it saves
  time; the first copy wins;
* a seeder that sends a **bad piece** is banned for the dataset, with the
  reason, and everything asked of it goes back to the others; one that fails
  otherwise (gone, timed out, does not have it) costs only time: its requests go
  back; one that does not hold a piece it advertised is asked nothing more of
  that shard (its file changed: it stopped seeding all of it), and after
  ``max_failures`` such shards in a row it rests ``backoff`` seconds.

:class:`SeederTable` is who to talk to: the seeders the tracker named, which
are connected, which failed (retried after a backoff that doubles), which are
reached only through a relay (left until a hole punch makes them direct,
unless relayed bulk data is allowed) and which are banned.

Tested in milliseconds without a socket (``tests/test_picker.py``); the
shell that performs these decisions is :mod:`.fetch`.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from libp2p.peer.id import ID

#: The "piece" index that stands for a shard's leaves.
LEAVES = -1
#: (shard number in the download, piece index or LEAVES)
PieceKey = tuple[int, int]


@dataclass(frozen=True)
class PickerConfig:
    #: the most requests in flight to one seeder
    pipeline: int = 8
    #: requests in flight to a seeder before its rate is known, and the fewest after: one waiting behind the
    #: one being sent, so the seeder's link never idles between our pieces
    pipeline_start: int = 2
    #: a seeder is asked for about this many seconds of its measured rate at once (at least one piece):
    #: a slow seeder is not queued pieces that a fast one would bring sooner
    queue_seconds: float = 3.0
    #: the window over which a seeder's rate is measured
    rate_window: float = 10.0
    #: requests in flight for one piece in the endgame
    endgame_duplicates: int = 2
    #: in the endgame a piece is asked of a second seeder only once its first request is late: older than
    #: this many times what the second seeder takes for a piece at its measured rate (at least a second),
    #: since a duplicate costs a whole piece of somebody's upload
    endgame_patience: float = 2.0
    #: ... or at once, when no more than this many pieces are missing (the classic endgame: a few pieces'
    #: worth of duplicates, against a last piece that waits on the slowest stream)
    endgame_pieces: int = 4
    #: shards in a row a seeder said it did not hold (not bad pieces) before it rests
    max_failures: int = 3
    #: how long it rests
    backoff: float = 10.0


@dataclass
class _Seeder:
    #: pieces it holds (and the LEAVES key of every shard it holds some of)
    keys: set[PieceKey] = field(default_factory=set)
    in_flight: set[PieceKey] = field(default_factory=set)
    failures: int = 0
    resting_until: float = 0.0
    banned: str | None = None
    #: (time, bytes) of what it delivered lately
    recent: deque[tuple[float, int]] = field(default_factory=deque)
    first_asked: float | None = None


class PiecePicker:
    """One download's pieces: what we hold, who holds what, what is asked of whom."""

    def __init__(self, pieces: Sequence[int], held: Iterable[PieceKey] = (), *, leaves_known: Iterable[int] = (),
                 priority: Sequence[int] | None = None, config: PickerConfig | None = None,
                 rng: random.Random | None = None, piece_size: int = 1 << 20) -> None:
        self.pieces = list(pieces)
        self.config = config or PickerConfig()
        self.rng = rng or random.Random()
        self.piece_size = piece_size
        self.priority = list(priority) if priority is not None else [0] * len(self.pieces)
        known = set(leaves_known)
        held = set(held)
        self.missing: set[PieceKey] = {(s, i) for s, n in enumerate(self.pieces) for i in range(n)} - held
        for s, n in enumerate(self.pieces):
            if s not in known and any((s, i) in self.missing for i in range(n)):
                self.missing.add((s, LEAVES))
        #: missing and asked of nobody
        self.unasked: set[PieceKey] = set(self.missing)
        self.requested: dict[PieceKey, set[ID]] = {}
        #: when each piece in flight was first asked for
        self.asked_at: dict[PieceKey, float] = {}
        self.seeders: dict[ID, _Seeder] = {}
        #: seeders (not banned) holding each piece
        self.avail: dict[PieceKey, int] = {}
        # a random rank per piece breaks ties between equally rare pieces the same way for every
        # seeder of this download, and differently on every downloader
        self._tie = {key: self.rng.random() for key in self.missing}

    # ------------------------------------------------------------------ what seeders hold

    def _seeder(self, peer: ID) -> _Seeder:
        return self.seeders.setdefault(peer, _Seeder())

    def _count(self, keys: Iterable[PieceKey], delta: int) -> None:
        for k in keys:
            n = self.avail.get(k, 0) + delta
            if n > 0:
                self.avail[k] = n
            else:
                self.avail.pop(k, None)

    def update(self, peer: ID, shard: int, pieces: Iterable[int] | None) -> None:
        """``peer`` holds these pieces of ``shard`` (None: all of them)."""
        if not 0 <= shard < len(self.pieces):
            return
        n = self.pieces[shard]
        held = set(range(n)) if pieces is None else {i for i in pieces if 0 <= i < n}
        seeder = self._seeder(peer)
        new = {(shard, i) for i in held} | ({(shard, LEAVES)} if held else set())
        old = {k for k in seeder.keys if k[0] == shard}
        if new == old:
            return
        seeder.keys -= old
        seeder.keys |= new
        if seeder.banned is None:
            self._count(old - new, -1)
            self._count(new - old, +1)

    def _usable(self, seeder: _Seeder, now: float) -> bool:
        return seeder.banned is None and seeder.resting_until <= now

    def availability(self, key: PieceKey, now: float) -> int:
        """Seeders that hold ``key`` and may be asked now."""
        return sum(1 for s in self.seeders.values() if self._usable(s, now) and key in s.keys)

    def _rate(self, seeder: _Seeder, now: float) -> float | None:
        """Bytes a second ``seeder`` delivered over the last ``rate_window`` (None: nothing yet)."""
        c = self.config
        while seeder.recent and seeder.recent[0][0] < now - c.rate_window:
            seeder.recent.popleft()
        if not seeder.recent or seeder.first_asked is None:
            return None
        span = max(1.0, min(c.rate_window, now - seeder.first_asked))
        return sum(size for _, size in seeder.recent) / span

    def limit(self, peer: ID, now: float) -> int:
        """Requests that may be in flight to ``peer`` now: ``queue_seconds`` of its measured rate, at least
        ``pipeline_start`` (one piece being sent and one waiting), at most ``pipeline``."""
        seeder = self.seeders.get(peer)
        if seeder is None:
            return 0
        c = self.config
        rate = self._rate(seeder, now)
        if rate is None:
            return min(c.pipeline, c.pipeline_start)
        return max(1, min(c.pipeline, math.ceil(rate * c.queue_seconds / self.piece_size)))

    # ------------------------------------------------------------------ picking

    def _ready(self, key: PieceKey) -> bool:
        return key[1] == LEAVES or (key[0], LEAVES) not in self.missing

    def pick(self, peer: ID, now: float) -> PieceKey | None:
        """The next thing to ask of ``peer``, or None (its pipeline is full, it has nothing we need, or it
        may not be asked now)."""
        seeder = self.seeders.get(peer)
        if seeder is None or not self._usable(seeder, now) or len(seeder.in_flight) >= self.limit(peer, now):
            return None
        fresh = [k for k in seeder.keys & self.unasked if self._ready(k)]
        if fresh:
            avail, prio, tie = self.avail, self.priority, self._tie
            key = min(fresh, key=lambda k: (k[1] != LEAVES, prio[k[0]], avail[k], tie[k]))  # it holds k: avail >= 1
            self.unasked.discard(key)
        else:
            if self.unasked:
                return None  # pieces nobody was asked for remain: no endgame yet
            rate = self._rate(seeder, now)
            patience = max(1.0, self.config.endgame_patience * self.piece_size / rate) if rate else 1.0
            if len(self.missing) <= self.config.endgame_pieces:
                patience = 0.0
            doubled = [k for k in seeder.keys & self.missing if k not in seeder.in_flight and self._ready(k)
                       and len(self.requested.get(k, ())) < self.config.endgame_duplicates
                       and now - self.asked_at[k] >= patience]
            if not doubled:
                return None
            key = min(doubled, key=lambda k: (len(self.requested.get(k, ())), self.priority[k[0]], self._tie[k]))
        if key not in self.requested:
            self.asked_at[key] = now
        self.requested.setdefault(key, set()).add(peer)
        seeder.in_flight.add(key)
        if seeder.first_asked is None:
            seeder.first_asked = now
        return key

    @property
    def endgame(self) -> bool:
        return bool(self.missing) and not self.unasked

    # ------------------------------------------------------------------ outcomes

    def _release(self, peer: ID, key: PieceKey) -> None:
        seeder = self.seeders.get(peer)
        if seeder is not None:
            seeder.in_flight.discard(key)
        askers = self.requested.get(key)
        if askers is not None:
            askers.discard(peer)
            if not askers:
                del self.requested[key]
                self.asked_at.pop(key, None)
                if key in self.missing:
                    self.unasked.add(key)

    def received(self, peer: ID, key: PieceKey, now: float, size: int = 0) -> bool:
        """A verified piece (or leaves) of ``size`` bytes from ``peer``; False if we already had it (an
        endgame duplicate: the first copy already took it out of every seeder's requests)."""
        seeder = self.seeders.get(peer)
        if seeder is not None:
            seeder.failures = 0
            if size:
                seeder.recent.append((now, size))
        if key not in self.missing:
            return False
        self.missing.discard(key)
        self.unasked.discard(key)
        self.asked_at.pop(key, None)
        for other in self.requested.pop(key, set()):
            if other in self.seeders:
                self.seeders[other].in_flight.discard(key)
        return True

    def failed(self, peer: ID, key: PieceKey, now: float) -> None:
        """``peer`` answered that it does not hold ``key`` (a piece or leaves it advertised): asked of
        others again, and nothing of that shard asked of it until it says it holds some again.

        A holder only loses a piece when its file changed on disk, and then it stops seeding the whole
        shard: asked piece by piece, a creator whose one shard changed answered "not held" to the
        first requests in a row and rested ``backoff`` seconds for it, its other shards unasked (a
        CI run's fetch then took everything from a slower seeder). The answers to what was already
        in flight of that shard are no new failures; ``max_failures`` shards in a row, and it rests.
        """
        self._release(peer, key)
        seeder = self.seeders.get(peer)
        if seeder is None or key not in seeder.keys:
            return  # an answer about a shard already dropped (or of a seeder gone)
        gone = {k for k in seeder.keys if k[0] == key[0]}
        seeder.keys -= gone
        if seeder.banned is None:
            self._count(gone, -1)
        seeder.failures += 1
        if seeder.failures >= self.config.max_failures:
            seeder.resting_until = now + self.config.backoff
            seeder.failures = 0

    def returned(self, peer: ID, key: PieceKey) -> None:
        """A request answered with nothing we can use yet (a piece before its shard's leaves): asked again,
        of anyone, ``peer`` included, at no cost to it."""
        self._release(peer, key)

    def lost(self, peer: ID) -> None:
        """``peer`` is gone (its connection died): everything asked of it goes back; what it held is forgotten
        (a banned one stays banned)."""
        seeder = self.seeders.get(peer)
        if seeder is None:
            return
        for key in list(seeder.in_flight):
            self._release(peer, key)
        if seeder.banned is None:
            self._count(seeder.keys, -1)
            del self.seeders[peer]
        else:
            seeder.keys.clear()

    def ban(self, peer: ID, reason: str) -> None:
        """``peer`` sent a bad piece: never asked again for this dataset."""
        seeder = self._seeder(peer)
        for key in list(seeder.in_flight):
            self._release(peer, key)
        if seeder.banned is None:
            self._count(seeder.keys, -1)
        seeder.banned = reason

    def banned(self) -> dict[ID, str]:
        return {p: s.banned for p, s in self.seeders.items() if s.banned is not None}

    def is_banned(self, peer: ID) -> bool:
        s = self.seeders.get(peer)
        return s is not None and s.banned is not None

    # ------------------------------------------------------------------ where we stand

    @property
    def complete(self) -> bool:
        return not self.missing

    def shard_complete(self, shard: int) -> bool:
        return not any((shard, i) in self.missing for i in range(LEAVES, self.pieces[shard]))

    def holds(self, key: PieceKey) -> bool:
        return key not in self.missing


class SeederState(Enum):
    KNOWN = "known"
    CONNECTED = "connected"
    FAILED = "failed"
    RELAYED = "relayed"
    BANNED = "banned"


@dataclass(frozen=True)
class TableConfig:
    #: seeders one download talks to at once
    max_connected: int = 16
    #: first wait before a failed seeder is tried again (doubles, up to ``max_retry``)
    retry: float = 2.0
    max_retry: float = 60.0
    #: a seeder reached only through a relay is looked at again after this (a hole punch may have made it direct)
    relayed_retry: float = 5.0
    #: relayed connections carry bulk data (a relay's circuits are limited: only when asked)
    allow_relayed: bool = False


@dataclass
class _Known:
    state: SeederState = SeederState.KNOWN
    retry_at: float = 0.0
    failures: int = 0
    why: str = ""
    whole: bool = False


class SeederTable:
    """The seeders of one download and what became of each (pure)."""

    def __init__(self, me: ID, config: TableConfig | None = None, rng: random.Random | None = None) -> None:
        self.me = me
        self.config = config or TableConfig()
        self.rng = rng or random.Random()
        self.known: dict[ID, _Known] = {}

    def learn(self, peer: ID, *, whole: bool) -> None:
        """The tracker names ``peer`` as a seeder (``whole``: it holds some shard whole)."""
        if peer == self.me:
            return
        self.known.setdefault(peer, _Known()).whole = whole

    def to_connect(self, now: float) -> list[ID]:
        """Seeders to connect to now: known ones due, up to ``max_connected`` in all; those holding whole shards
        first, the rest at random (every downloader spreads over different seeders)."""
        busy = sum(1 for k in self.known.values() if k.state == SeederState.CONNECTED)
        room = self.config.max_connected - busy
        if room <= 0:
            return []
        due = [p for p, k in self.known.items()
               if k.state in (SeederState.KNOWN, SeederState.FAILED, SeederState.RELAYED) and k.retry_at <= now]
        self.rng.shuffle(due)
        due.sort(key=lambda p: not self.known[p].whole)
        chosen = due[:room]
        for p in chosen:
            self.known[p].state = SeederState.CONNECTED
        return chosen

    def connected(self, peer: ID) -> None:
        k = self.known.setdefault(peer, _Known())
        k.state, k.failures, k.why = SeederState.CONNECTED, 0, ""

    def failed(self, peer: ID, now: float, why: str) -> None:
        k = self.known.setdefault(peer, _Known())
        if k.state == SeederState.BANNED:
            return
        k.failures += 1
        k.state, k.why = SeederState.FAILED, why
        k.retry_at = now + min(self.config.max_retry, self.config.retry * 2 ** (k.failures - 1))

    def relayed(self, peer: ID, now: float) -> None:
        """Reached only through a relay, and relayed bulk data is not allowed: looked at again later."""
        k = self.known.setdefault(peer, _Known())
        k.state, k.why = SeederState.RELAYED, "reached only through a relay"
        k.retry_at = now + self.config.relayed_retry

    def ban(self, peer: ID, why: str) -> None:
        k = self.known.setdefault(peer, _Known())
        k.state, k.why = SeederState.BANNED, why

    def state(self, peer: ID) -> SeederState | None:
        k = self.known.get(peer)
        return None if k is None else k.state

    def count(self, state: SeederState) -> int:
        return sum(1 for k in self.known.values() if k.state == state)


class Pacer:
    """An upload rate cap: a token bucket of ``rate`` bytes a second holding at most ``burst`` bytes."""

    def __init__(self, rate: float | None, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else (rate or 0.0) / 4
        self._tokens = self.burst
        self._at: float | None = None

    def delay(self, size: int, now: float) -> float:
        """Take ``size`` bytes; how long to wait before sending them (0: at once). The debt is carried, so a
        piece larger than the burst waits its time and the average stays at the rate."""
        if not self.rate:
            return 0.0
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= size
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class UploadSlots:
    """Which answer a seeder sends next: at most ``slots`` pieces go out at once, and when more wait, the one
    whose asker holds the least of the dataset goes first (then the oldest).

    Kumar and Ross's bound is reached only when every peer finishes together: uploads that favour those
    furthest behind keep the crowd together (a peer ahead of the others gets pieces once nobody behind
    it waits). The asker says what it holds (``Request.held_permille``); one that lies to go first only
    takes what an honest peer that far behind would get.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.busy = 0
        self._waiting: list[tuple[int, int]] = []  # (held, ticket)
        self._withdrawn: set[int] = set()
        self._next = 0

    def enter(self, held: int) -> int | None:
        """Ask for a slot: None if granted at once, else a ticket to wait with (see :meth:`leave`)."""
        if self.busy < self.slots and not self.waiting:
            self.busy += 1
            return None
        self._next += 1
        heapq.heappush(self._waiting, (held, self._next))
        return self._next

    @property
    def waiting(self) -> int:
        return len(self._waiting) - len(self._withdrawn)

    def leave(self) -> int | None:
        """A slot is free: the ticket that takes it (None: nobody waits, the slot is idle)."""
        while self._waiting:
            _, ticket = heapq.heappop(self._waiting)
            if ticket in self._withdrawn:
                self._withdrawn.discard(ticket)
                continue
            return ticket
        self.busy -= 1
        return None

    def withdraw(self, ticket: int) -> None:
        """A waiting ask gave up (its stream closed)."""
        if any(t == ticket for _, t in self._waiting):
            self._withdrawn.add(ticket)


__all__ = ["LEAVES", "Pacer", "UploadSlots", "PickerConfig", "PieceKey", "PiecePicker", "SeederState", "SeederTable", "TableConfig"]
