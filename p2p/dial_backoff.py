"""Which of a peer's addresses not to dial again yet, because they failed lately (sans I/O).

Why: without it every caller that wants a peer dials it, however often its dials failed a moment
ago. A fetcher whose tracker still listed a seeder that had left asked the relay for a circuit to it
16 times in 30 s (the relay answered NO_RESERVATION each time); a DHT lookup that meets a dead contact
spends a dial timeout on it at every query. go-libp2p's swarm keeps a backoff per (peer, address)
for this (``swarm.DialBackoff``); this is the same rule, with its defaults: an address that failed
``tries`` times is left alone for ``base + coef * tries**2`` seconds, at most ``max``, and forgotten
``max`` seconds after that. A successful connection to the peer, either way, clears it all.

The state is a plain table with the time passed in, so it is tested without sockets or sleeps
(``tests/test_dial_backoff.py``); :meth:`p2p.Node.connect` consults it and feeds it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class BackoffConfig:
    """go-libp2p's ``BackoffBase``, ``BackoffCoef`` and ``BackoffMax``; ``max_entries`` bounds the
    table (a DHT reply names peers and addresses of its sender's choosing)."""

    base: float = 5.0
    coef: float = 1.0
    max: float = 300.0
    max_entries: int = 4096

    def validate(self) -> None:
        if self.base < 0 or self.coef < 0 or self.max < self.base:
            raise ConfigError(f"dial backoff needs 0 <= base <= max and coef >= 0, got base={self.base}, "
                              f"coef={self.coef}, max={self.max}")
        if self.max_entries < 1:
            raise ConfigError(f"dial backoff max_entries must be positive, got {self.max_entries}")


@dataclass(frozen=True)
class Held:
    """An address not dialed now: how many times it failed, and for how many seconds more it waits."""

    addr: str
    tries: int
    left: float
    #: why its last dial failed (what the caller would have met, had it dialed)
    last: str = ""

    def reason(self) -> str:
        said = f"backed off for {self.left:.1f} s more after {self.tries} failed dial{'s' if self.tries != 1 else ''}"
        return f"{said} (last: {self.last})" if self.last else said


@dataclass
class _Entry:
    tries: int
    until: float
    last: str


class DialBackoff:
    """Failed dials per (peer, address), and until when each address waits."""

    def __init__(self, config: BackoffConfig | None = None) -> None:
        self.config = config or BackoffConfig()
        #: oldest failure first (a dict keeps the order entries were put in)
        self._entries: dict[tuple[Hashable, str], _Entry] = {}
        self._by_peer: dict[Hashable, set[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def delay(self, tries: int) -> float:
        """How long an address that failed ``tries`` times waits."""
        return min(self.config.max, self.config.base + self.config.coef * tries * tries)

    def split(self, peer: Hashable, addrs: Iterable[str], now: float) -> tuple[list[str], list[Held]]:
        """``addrs`` of ``peer`` as (those to dial now, those held back), each in the order given."""
        free: list[str] = []
        held: list[Held] = []
        for addr in addrs:
            entry = self._entries.get((peer, addr))
            if entry is not None and entry.until > now:
                held.append(Held(addr, entry.tries, entry.until - now, entry.last))
            else:
                free.append(addr)
        return free, held

    def failed(self, peer: Hashable, addr: str, now: float, why: str = "") -> None:
        """A dial of ``addr`` failed at ``now`` (``why``): it waits longer than the last time (within ``max``)."""
        key = (peer, addr)
        entry = self._entries.pop(key, None)  # put back last, where the newest failure goes
        if entry is not None and now >= entry.until + self.config.max:
            entry = None  # failed long ago: a new start, as go-libp2p's cleanup forgets such entries
        tries = entry.tries if entry is not None else 0
        self._entries[key] = _Entry(tries + 1, now + self.delay(tries), why)  # the newest entry is last
        self._by_peer.setdefault(peer, set()).add(addr)
        if len(self._entries) > self.config.max_entries:
            self.expire(now)
            while len(self._entries) > self.config.max_entries:
                self._drop(next(iter(self._entries)))  # the one that failed longest ago

    def clear(self, peer: Hashable) -> None:
        """``peer`` answered (we reached it, or it reached us): its addresses start afresh."""
        for addr in self._by_peer.pop(peer, ()):
            del self._entries[(peer, addr)]

    def expire(self, now: float) -> None:
        """Forget the addresses whose wait ended ``max`` seconds ago or more."""
        for key in [k for k, e in self._entries.items() if now >= e.until + self.config.max]:
            self._drop(key)

    def _drop(self, key: tuple[Hashable, str]) -> None:
        del self._entries[key]
        peer, addr = key
        addrs = self._by_peer[peer]
        addrs.discard(addr)
        if not addrs:
            del self._by_peer[peer]
