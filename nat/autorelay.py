"""Autorelay: hold slots on relays while we are not publicly reachable.

Among the peers we are connected to, those that offer the HOP protocol are
relays; we keep up to ``max_relays`` reservations, refresh each before it
expires, and replace relays that vanish or refuse. The loop wakes on any
change (a new connection, a verdict, a lost relay) and otherwise every few
seconds; the composing service decides when slots are wanted. When connected
peers offer too few relays, a *peer source* (go-libp2p's name; the composed
:class:`nat.Peer` plugs in the DHT's relay records, ``nat/relay_discovery.py``)
names more, which are dialed and asked for a slot. A relay that held our slot and went away
(restarted, or the link dropped) is dialed again first, for ``lost_relay_memory`` seconds, the
Node's dial backoff pacing the attempts (``p2p/dial_backoff.py``): before, a peer that was not cut
off from every peer (so not rejoining its initial peers) waited for the peer source, up to 30 s.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import Node
from p2p.addresses import with_peer_id
from p2p.dialer import live_connection
from p2p.errors import ConfigError, DedlocError

from . import events as nev
from .circuit import RelayClient, RelayError, Reservation

log = logging.getLogger(__name__)


@dataclass
class AutoRelayConfig:
    #: Reserve relay slots when not publicly reachable.
    enabled: bool = True
    max_relays: int = 2
    #: Refresh a reservation when less than this (or a quarter of its life) is left, in seconds.
    refresh_before: float = 300.0
    #: Longest sleep between passes when nothing changes, in seconds.
    poll_interval: float = 5.0
    #: Ask the peer source (the DHT) for relays at most this often, in seconds.
    peer_source_interval: float = 30.0
    #: Seconds to reach one relay the peer source named.
    dial_timeout: float = 10.0
    #: How long a relay that held our slot and went away is dialed again (as long as a reservation lasts).
    lost_relay_memory: float = 3600.0

    def validate(self) -> None:
        if self.max_relays < 1:
            raise ConfigError("autorelay max_relays must be at least 1")
        if self.refresh_before <= 0 or self.poll_interval <= 0 or self.peer_source_interval <= 0 \
                or self.dial_timeout <= 0 or self.lost_relay_memory <= 0:
            raise ConfigError("autorelay refresh_before, poll_interval, peer_source_interval, dial_timeout and "
                              "lost_relay_memory must be positive")


#: Candidate relays beyond our connections: given the ids to leave out, (id, addresses) pairs.
PeerSource = Callable[[set[ID]], Awaitable[list[tuple[ID, list[Multiaddr]]]]]


class AutoRelay:
    """Keeps reservations on relays for one Node (run :meth:`run` in the owning service's nursery)."""

    #: where more relays are found (:meth:`use_peer_source`), and when it was last asked (trio's clock)
    _peer_source: PeerSource | None
    _source_asked: float

    def __init__(self, node: Node, client: RelayClient, config: AutoRelayConfig,
                 is_relay: Callable[[ID], bool], changed: Callable[[], None]) -> None:
        self._node = node
        self._client = client
        self.config = config
        self._is_relay = is_relay
        self._changed = changed
        self._wake = trio.Event()
        self.use_peer_source(None)
        #: Relays reached through the peer source (the funnel's ``relays_discovered``).
        self.discovered = 0
        #: Relays that held our slot and went away, and when (dialed again by :meth:`_from_lost`).
        self._lost: dict[ID, float] = {}

    def use_peer_source(self, source: PeerSource | None) -> None:
        """Where to find relays when our connections offer too few (None: nowhere else)."""
        self._peer_source = source
        self._source_asked = -math.inf  # asked at the next pass
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def lost(self, relay: ID, reason: str) -> None:
        """A relay holding our slot went away: withdraw its addresses at once."""
        if relay in self._client.reservations:
            self._client.drop(relay)
            self._lost[relay] = trio.current_time()
            self._node.emit(nev.RelayLost(relay=relay, reason=reason))
            self._changed()

    async def run(self, wanted: Callable[[], bool], after_pass: Callable[[], None]) -> None:
        """Forever: while ``wanted()``, keep reservations; call ``after_pass`` after each pass."""
        was_wanted = True
        while True:
            self._wake = trio.Event()
            want = self.config.enabled and wanted()
            if want:
                # Back from public: every slot is renewed at once. A public peer renews none and
                # advertises none, and a relay that filled up took such slots back (``RelayAdmission.
                # reclaim_candidates``): one kept on trust would be advertised and reach nobody.
                await self._keep(renew_all=not was_wanted)
            else:
                self._forget_expired()
            was_wanted = want
            after_pass()
            with trio.move_on_after(self.config.poll_interval):
                await self._wake.wait()

    def _forget_expired(self) -> None:
        """While we are public, slots are neither renewed nor advertised (a return to private renews them
        all); one past its expiry is held by no relay: forgotten, so that the status counts only slots a
        relay may still hold (before, a public peer reported its first slots for the life of the process)."""
        now = time.time()
        for relay, rsvp in list(self._client.reservations.items()):
            if rsvp.expire <= now:
                self._client.drop(relay)
                self._node.emit(nev.RelayLost(relay=relay, reason="expired while we were public (not renewed)"))
                self._changed()

    def _full(self) -> bool:
        return len(self._client.reservations) >= self.config.max_relays

    async def _keep(self, *, renew_all: bool) -> None:
        client = self._client
        now = time.time()  # reservation expiries are wall-clock times from the relay
        for relay, rsvp in list(client.reservations.items()):
            if live_connection(self._node.network, relay) is None:
                self.lost(relay, "disconnected")
            elif renew_all or rsvp.expire - now < min(self.config.refresh_before, (rsvp.expire - rsvp.reserved_at) / 4):
                await self._reserve(relay, refresh=True)
        for relay in self._node.connected_peers():
            if not self._full() and relay != self._node.peer_id and relay not in client.reservations \
                    and self._is_relay(relay):
                await self._reserve(relay, refresh=False)
        await self._from_lost()
        await self._from_peer_source()

    async def _from_lost(self) -> None:
        """Dial the relays that held our slot and went away, the latest lost first, and reserve again.

        Each pass tries each; an address that failed waits out its backoff in the Node (a relay
        still down costs no packet until then), so a pass every ``poll_interval`` is cheap."""
        client = self._client
        now = trio.current_time()
        for relay, since in sorted(self._lost.items(), key=lambda item: -item[1]):
            if relay in client.reservations or now - since > self.config.lost_relay_memory:
                del self._lost[relay]
                continue
            if self._full():
                return
            if live_connection(self._node.network, relay) is not None:
                continue  # connected: _keep's pass over our connections asks it, once
            if await self._dial_and_reserve(relay, relay, "that held our slot", logging.DEBUG):
                del self._lost[relay]

    async def _from_peer_source(self) -> None:
        """Dial relays the peer source names that we are not connected to, and reserve on them."""
        now = trio.current_time()
        if self._peer_source is None or self._full() or now - self._source_asked < self.config.peer_source_interval:
            return
        self._source_asked = now
        client = self._client
        exclude = {self._node.peer_id, *client.reservations, *self._node.connected_peers()}
        try:
            candidates = await self._peer_source(exclude)
        except Exception as e:  # the DHT not ready, no replica answered: next time
            log.info("no relays from the peer source: %s", e)
            return
        for relay, addrs in candidates:
            if self._full():
                return
            if relay in exclude or live_connection(self._node.network, relay) is not None:
                continue
            if await self._dial_and_reserve([with_peer_id(a, relay) for a in addrs], relay, "from the peer source",
                                            logging.INFO):
                self.discovered += 1

    async def _dial_and_reserve(self, target: ID | list[Multiaddr], relay: ID, which: str, level: int) -> bool:
        """Dial a relay we are not connected to and ask it for a slot; whether we got one. From the
        listen port: a relay is also an observer of our NAT's mapping."""
        try:
            await self._node.connect(target, timeout=self.config.dial_timeout, from_listen_port=True)
        except DedlocError as e:
            log.log(level, "relay %s %s unreachable: %s", relay, which, e)
            return False
        return await self._reserve(relay, refresh=False) is not None

    async def _reserve(self, relay: ID, *, refresh: bool) -> Reservation | None:
        try:
            rsvp = await self._client.reserve(relay)
        except RelayError as e:
            log.info("reservation on %s failed: %s", relay, e)
            if refresh:
                self.lost(relay, str(e))
            return None
        if not refresh:
            self._node.emit(nev.RelayReserved(relay=relay, expire=rsvp.expire, addrs=[str(a) for a in rsvp.circuit_addrs]))
            self._changed()
        return rsvp
