"""Which connections to close when a node holds too many (sans I/O): the connection manager.

Why: a DHT peer connects to every peer its lookups meet, peer exchange dialed every peer it
learnt of, and before this every connection was kept until the other side went away. In a 40-peer
loopback swarm every peer held a connection to all 39 others a second after joining (43 on the
median, some peers twice: ``bench/conn_manager.py``); in a swarm of thousands a volunteer's node
would hold thousands, each a socket (a Linux process may open 1,024 files unless raised), an entry
in the home router's NAT table, memory for its windows and a keepalive ping every 30 s. What it
costs: a lookup that reaches a peer no longer connected dials it again (on loopback, with 8-12 of
40 peers kept, a get's p50 went from 62 to 203 ms; a swarm of up to 160 peers never trims).
go-libp2p trims them with its
basic connection manager (``p2p/net/connmgr``, on by default at 160/192), and hivemind's daemon
runs it too; this is its rule, with its defaults:

* nothing happens until more than ``high_water`` connections are open; then, at most once per
  ``silence_period``, connections are closed until ``low_water`` remain among those that may be
  closed (:func:`select_to_close`);
* a peer whose newest connection is younger than ``grace_period`` is kept (it was just wanted:
  a lookup's answer, a group being formed, a hole punch that just succeeded);
* a *protected* peer is kept (a relay holding our slot, a peer holding a slot on our relay, the
  members of an averaging round: :class:`Tags`);
* a *busy* peer is kept: one with a stream at work on a connection (an RPC call under way either
  way, any other protocol's stream; an RPC stream pooled for the next call is idle). go-libp2p
  only sorts such peers last, but a call cut mid-way fails at its caller (a DHT lookup loses that
  answer, a relayed or averaging stream its bytes); py-libp2p's pruner keeps them too, but counts
  a pooled stream as at work, and so keeps nearly every peer of a DHT;
* the others go lowest value first (values are what services say a peer is worth: a DHT routing
  table's contact is worth more than a peer a lookup passed by), then inbound before outbound,
  then the longest unused (oldest newest connection) first.

Protected, busy and young connections do not count toward ``low_water`` (go-libp2p's rule for
the protected and young): the watermarks bound the connections nobody is using or asked to keep.
A trim closes a connection with yamux GoAway code 0x1005 (go-libp2p's ``ConnGarbageCollected``), so the peer knows it was trimmed, not
cut off, and neither side dials the other back to check it (``p2p/dht/dht.py``'s ``_closed``).

The state is plain data with the time passed in, so it is tested without sockets or sleeps
(``tests/test_conn_manager.py``); :class:`p2p.Node` feeds it and closes what it picks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import ConfigError
from .hooks import Registration

P = TypeVar("P", bound=Hashable)


@dataclass(frozen=True)
class ConnManagerConfig:
    """go-libp2p's ``connmgr.NewConnManager(low, high, WithGracePeriod, WithSilencePeriod)``, its defaults.

    ``enabled=False`` keeps every connection (the behaviour before: a test, or an app that bounds
    its peers itself)."""

    low_water: int = 160
    high_water: int = 192
    grace_period: float = 60.0
    silence_period: float = 10.0
    enabled: bool = True

    def validate(self) -> None:
        if not 0 < self.low_water <= self.high_water:
            raise ConfigError(f"connection manager needs 0 < low_water <= high_water, got low_water={self.low_water}, "
                              f"high_water={self.high_water}")
        if self.grace_period < 0 or self.silence_period <= 0:
            raise ConfigError(f"connection manager needs grace_period >= 0 and silence_period > 0, got "
                              f"grace_period={self.grace_period}, silence_period={self.silence_period}")


@dataclass(frozen=True)
class Conn:
    """What the choice reads of one open connection."""

    peer: Hashable
    #: when it opened (the caller's clock, the one ``now`` is read from)
    opened: float
    #: its streams at work (not those idle, waiting for a next call)
    busy: int
    inbound: bool
    #: the caller's handle (what it closes); never read here
    handle: object = None


class Tags:
    """What services said about peers: protections (counted per tag, so nested protections of one
    peer under one tag need as many releases) and values (per tag; a peer's value is their sum)."""

    def __init__(self) -> None:
        self._protected: dict[Hashable, Counter[str]] = {}
        self._values: dict[Hashable, dict[str, int]] = {}

    def protect(self, peer: Hashable, tag: str) -> None:
        self._protected.setdefault(peer, Counter())[tag] += 1

    def unprotect(self, peer: Hashable, tag: str) -> None:
        """Release one :meth:`protect` of ``peer`` under ``tag`` (one never made is a no-op)."""
        tags = self._protected.get(peer)
        if tags is None or tags[tag] <= 0:
            return
        tags[tag] -= 1
        if tags[tag] == 0:
            del tags[tag]
        if not tags:
            del self._protected[peer]

    def is_protected(self, peer: Hashable) -> bool:
        return peer in self._protected

    def protected_count(self) -> int:
        """How many peers are protected now."""
        return len(self._protected)

    def protections(self, peer: Hashable) -> list[str]:
        """The tags ``peer`` is protected under, sorted (``dedloc status``, a test)."""
        return sorted(self._protected.get(peer, ()))

    def tag(self, peer: Hashable, tag: str, value: int) -> None:
        self._values.setdefault(peer, {})[tag] = value

    def untag(self, peer: Hashable, tag: str) -> None:
        values = self._values.get(peer)
        if values is not None:
            values.pop(tag, None)
            if not values:
                del self._values[peer]

    def value(self, peer: Hashable) -> int:
        return sum(self._values.get(peer, {}).values())

    def __len__(self) -> int:
        """How many peers have a protection or a value."""
        return len(self._protected.keys() | self._values.keys())


class KeptPeers(Generic[P]):
    """Protections held in step with a set of peers that changes (a relay's slot holders, the relays
    holding our slots): :meth:`keep` protects the peers new to the set and releases those gone."""

    def __init__(self, protect: Callable[[P, str], Registration], tag: str) -> None:
        self._protect = protect
        self._tag = tag
        self._held: dict[P, Registration] = {}

    def keep(self, peers: Iterable[P]) -> None:
        """Protect exactly ``peers``: those new now, and no longer those gone."""
        wanted = set(peers)
        for peer in [p for p in self._held if p not in wanted]:
            self._held.pop(peer).remove()
        for peer in wanted - self._held.keys():
            self._held[peer] = self._protect(peer, self._tag)

    def clear(self) -> None:
        self.keep(())


def select_to_close(conns: Sequence[Conn], tags: Tags, now: float, config: ConnManagerConfig,
                    extra_value: dict[Hashable, int] | None = None) -> list[Conn]:
    """The connections to close now, whole peers at a time, in the order to close them.

    None while at most ``high_water`` are open. Else the peers neither protected, busy nor in their
    grace period are the candidates; if their connections number fewer than ``low_water`` nothing is
    closed (the rest are young: closing old ones for them would drop useful connections for ones
    that may not be), otherwise the lowest-ranked peers' connections (module docstring) until
    ``low_water`` candidates' connections remain. ``extra_value``: values computed by the caller
    (a DHT's contacts), added to ``tags``' values.
    """
    if not config.enabled or len(conns) <= config.high_water:
        return []
    by_peer: dict[Hashable, list[Conn]] = {}
    for c in conns:
        by_peer.setdefault(c.peer, []).append(c)
    extra = extra_value or {}
    candidates = [(peer, peer_conns) for peer, peer_conns in by_peer.items()
                  if not tags.is_protected(peer) and not any(c.busy for c in peer_conns)
                  and now - max(c.opened for c in peer_conns) >= config.grace_period]
    count = sum(len(peer_conns) for _, peer_conns in candidates)
    if count < config.low_water:
        return []

    def rank(item: tuple[Hashable, list[Conn]]) -> tuple[int, bool, float]:
        peer, peer_conns = item
        return (tags.value(peer) + extra.get(peer, 0), not any(c.inbound for c in peer_conns),
                max(c.opened for c in peer_conns))

    chosen: list[Conn] = []
    excess = count - config.low_water
    for _, peer_conns in sorted(candidates, key=rank):
        if excess <= 0:
            break
        chosen.extend(peer_conns)
        excess -= len(peer_conns)
    return chosen
