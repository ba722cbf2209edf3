"""NAT traversal for one Node, composed: reachability, relays, hole punching, port mapping, client mode.

Each protocol is its own behaviour with its own config (relay, AutoNAT,
DCUtR); this module runs them together the way a volunteer needs with no
flags about NAT:

1. learn observed addresses (identify from peers we dialed from our listen
   port) and classify the NAT's mapping from what several observers saw;
2. ask AutoNAT servers to dial our candidate addresses; advertise only public
   addresses that a dial-back confirmed (private ones stay, for LANs);
3. if none is confirmed: ask the router for a port mapping (UPnP / NAT-PMP),
   reserve slots on relays among the peers we know (refresh before expiry,
   replace relays that vanish) and advertise the ``/p2p-circuit`` addresses;
4. upgrade relayed connections to direct ones (DCUtR) when a peer reaches us
   through a relay;
5. with neither a confirmed address nor a relay: client mode, dialing out
   only, and say so.

:meth:`NatService.metrics` is the funnel (reservations, dial-backs, punch
attempts and successes, time to direct, relayed vs direct bytes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import Node
from p2p import events as ev
from p2p.addresses import is_relayed, reachable_tcp, without_peer_id
from p2p.dialer import live_connection
from p2p.errors import ConfigError, DedlocError

from . import events as nev
from .autonat import DIAL_REQUEST, AutoNATClient, AutoNATConfig, AutoNATError, AutoNATServer
from .circuit import HOP_PROTOCOL, RelayClient, RelayError, Reservation, is_relayed_conn
from .holepunch import HolePunchConfig, HolePuncher
from .relay import RelayConfig, RelayService

log = logging.getLogger(__name__)

PUBLIC, PRIVATE, UNKNOWN = "public", "private", "unknown"


@dataclass
class NatConfig:
    """How a node deals with NATs. The defaults are for a volunteer's machine."""

    #: Serve circuit relay v2 to others (``dedloc relay`` turns it on; any public peer may).
    relay_service: bool = False
    relay: RelayConfig = field(default_factory=RelayConfig)
    #: Answer AutoNAT dial-requests.
    autonat_server: bool = True
    autonat: AutoNATConfig = field(default_factory=AutoNATConfig)
    hole_punch: HolePunchConfig = field(default_factory=HolePunchConfig)
    #: Reserve relay slots when not publicly reachable.
    autorelay: bool = True
    max_relays: int = 2
    #: Ask the router to forward our port (UPnP IGD / NAT-PMP).
    port_mapping: bool = True
    #: Re-check reachability this often (seconds), and sooner when the network changes.
    recheck_interval: float = 300.0
    #: Servers that must fail to reach an address before it counts as unreachable (at most: all we have).
    min_failures: int = 3
    #: AutoNAT servers asked per check.
    servers_per_check: int = 4
    #: Treat private addresses like public ones (LAN swarms, tests on one machine).
    allow_private: bool = False

    def validate(self) -> None:
        self.relay.validate()
        self.autonat.validate()
        self.hole_punch.validate()
        if self.max_relays < 1 or self.min_failures < 1 or self.servers_per_check < 1:
            raise ConfigError("max_relays, min_failures and servers_per_check must be at least 1")
        if self.recheck_interval <= 0:
            raise ConfigError("recheck_interval must be positive")


@dataclass
class _Verdicts:
    ok: set[ID] = field(default_factory=set)
    failed: set[ID] = field(default_factory=set)


class NatService:
    """The NAT layer of one Node; open it with :meth:`attach`."""

    def __init__(self, node: Node, config: NatConfig | None = None) -> None:
        self.node = node
        self.config = config or NatConfig()
        self.config.validate()
        if self.config.allow_private:
            self.config.autonat.allow_private = True
            self.config.hole_punch.allow_private = True
        self.relay_client = RelayClient(node)
        self.autonat = AutoNATClient(node, self.config.autonat)
        self.autonat_server = AutoNATServer(node, self.config.autonat) if self.config.autonat_server else None
        self.relay_service = RelayService(node, self.config.relay) if self.config.relay_service else None
        self.puncher = HolePuncher(node, self.punch_addrs, self.config.hole_punch)
        self.reachability = UNKNOWN
        self.mapping = UNKNOWN
        self.mode = "starting"
        self._verdicts: dict[str, _Verdicts] = {}
        self._listen_views: dict[ID, Multiaddr] = {}
        self._protocols: dict[ID, set[str]] = {}
        self._identified: dict[ID, float] = {}
        self._mapped: list[Multiaddr] = []
        # One wake-up event per loop: each loop replaces its own, so neither waits on a stale one.
        self._changed = trio.Event()
        self._relay_changed = trio.Event()
        self._dial_backs = 0

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    @asynccontextmanager
    async def attach(cls, node: Node, config: NatConfig | None = None) -> AsyncIterator[NatService]:
        service = cls(node, config)
        service._install()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service._watch_connections)
            nursery.start_soon(service._reachability_loop)
            nursery.start_soon(service._relay_loop)
            if service.config.port_mapping:
                nursery.start_soon(service._port_mapping)
            try:
                yield service
            finally:
                nursery.cancel_scope.cancel()
                node.set_address_policy(None)

    def _notify(self) -> None:
        self._changed.set()
        self._relay_changed.set()

    def _install(self) -> None:
        self.relay_client.install()
        self.autonat.install()
        self.puncher.install()
        if self.autonat_server is not None:
            self.autonat_server.install()
        if self.relay_service is not None:
            self.relay_service.install()
        self.node.set_address_policy(self._advertise)

    # ---------------------------------------------------------------- addresses

    @property
    def confirmed(self) -> list[Multiaddr]:
        return [Multiaddr(a) for a, v in self._verdicts.items() if v.ok]

    def _public(self, addr: Multiaddr) -> bool:
        return reachable_tcp(addr, allow_private=self.config.allow_private)

    def _candidates(self) -> list[Multiaddr]:
        """Addresses others might reach us at: public interfaces, what observers saw, port mappings."""
        out: list[Multiaddr] = []
        ports = {p for a in self.node.listen_addrs if (p := _tcp_port(a)) is not None}

        def add(addr: Multiaddr) -> None:
            addr = without_peer_id(addr)
            if self._public(addr) and addr not in out:
                out.append(addr)

        for addr in self._mapped:
            add(addr)
        for addr in self.node.addrs:
            add(addr)
        for addr in list(self._listen_views.values()) + self.node.observed_addrs():
            add(addr)
            items = list(addr.items())
            for port in ports:  # a port-preserving NAT maps our listen port to itself
                add(Multiaddr(f"/{items[0][0].name}/{items[0][1]}/tcp/{port}"))
        return out

    def punch_addrs(self) -> list[Multiaddr]:
        """What we offer in DCUtR: confirmed and observed public addresses of our listen port."""
        return self.confirmed + [a for a in self._candidates() if a not in self.confirmed]

    def _refuted(self, addr: Multiaddr) -> bool:
        verdicts = self._verdicts.get(str(without_peer_id(addr)))
        return verdicts is not None and not verdicts.ok and len(verdicts.failed) >= self.config.min_failures

    def _advertise(self, interface_addrs: list[Multiaddr]) -> list[Multiaddr]:
        """The Node's address policy.

        Our own interface addresses stay unless AutoNAT refuted them (a public
        relay is reachable before anyone could confirm it); addresses only
        others see (a NAT's external address, a port mapping) are advertised
        once a dial-back confirmed them; relay circuits while not public.
        """
        out = [a for a in interface_addrs if not (self._public(a) and self._refuted(a))]
        out += [a for a in self.confirmed if a not in out]
        if self.reachability != PUBLIC:
            for reservation in self.relay_client.reservations.values():
                out += reservation.circuit_addrs
        return out

    # ---------------------------------------------------------------- learning about peers

    async def _learn(self, peer: ID) -> None:
        """Identify a peer (at most once a minute): its protocols, and how it sees us."""
        if time.monotonic() - self._identified.get(peer, -1e9) < 60:
            return
        self._identified[peer] = time.monotonic()
        # py-libp2p identifies every new connection by itself, and js-libp2p resets a
        # second identify stream on a connection while one is open: retry, briefly.
        for attempt in range(3):
            try:
                info = await self.node.identify(peer, timeout=10)
                break
            except Exception as e:
                log.debug("identify %s failed (attempt %d): %s", peer, attempt + 1, e)
                if live_connection(self.node.network, peer) is None:
                    self._identified.pop(peer, None)
                    return
                if attempt == 2:
                    self._identified.pop(peer, None)
                    self.node.spawn(self._learn_later, peer)  # soon, not at the next recheck
                    return
                await trio.sleep(0.5 * (attempt + 1))
        self._protocols[peer] = set(info.protocols)
        if info.observed_addr is not None and not is_relayed(info.observed_addr):
            # Only a connection that left from our listen port shows how our NAT maps
            # that port; an ephemeral-port dial would look like endpoint dependence.
            if self.node.on_listen_port(peer):
                self._listen_views[peer] = info.observed_addr
                self._classify()
        self._notify()

    async def _learn_later(self, peer: ID) -> None:
        await trio.sleep(5.0)
        if live_connection(self.node.network, peer) is not None:
            await self._learn(peer)

    def _classify(self) -> None:
        views = {str(v) for v in self._listen_views.values() if self._public(v)}
        if not views:
            return
        if len(views) > 1:
            self.mapping = "endpoint-dependent"
            return
        mapped = Multiaddr(next(iter(views)))
        port = _tcp_port(mapped)
        listen_ports = {_tcp_port(a) for a in self.node.listen_addrs}
        if any(without_peer_id(a) == mapped for a in self.node.addrs):
            self.mapping = "none"
        elif len(self._listen_views) < 2:
            self.mapping = UNKNOWN
        else:
            self.mapping = "endpoint-independent, port " + ("preserved" if port in listen_ports else "changed")

    async def _watch_connections(self) -> None:
        async with self.node.events() as events:
            for peer in self.node.connected_peers():
                self.node.spawn(self._learn, peer)
            async for event in events:
                if isinstance(event, ev.ConnectionOpened):
                    peer = ID.from_base58(event.peer_id)
                    if event.kind == "relayed" and event.direction == "inbound" and self.config.hole_punch.attempts:
                        self.node.spawn(self._upgrade, peer)
                    elif event.kind == "direct":
                        self.node.spawn(self._learn, peer)
                elif isinstance(event, ev.ConnectionClosed) and event.kind == "direct":
                    peer = ID.from_base58(event.peer_id)
                    if live_connection(self.node.network, peer) is None:
                        self._listen_views.pop(peer, None)
                        if peer in self.relay_client.reservations:
                            self.relay_client.drop(peer)
                            self.node.emit(nev.RelayLost(relay=str(peer), reason="disconnected"))
                            self._notify()

    async def _upgrade(self, peer: ID) -> None:
        relayed = next((c for c in self.node.network.get_connections(peer) if is_relayed_conn(c)), None)
        if relayed is None:
            return
        started = time.monotonic()
        before = self.puncher.metrics.attempts
        direct = await self.puncher.upgrade(peer, relayed, started)
        self.node.emit(
            nev.HolePunched(
                peer_id=str(peer),
                success=direct is not None,
                method="none" if direct is None else ("punch" if self.puncher.metrics.attempts > before else "reversal"),
                attempts=self.puncher.metrics.attempts - before,
                elapsed=time.monotonic() - started,
                addr=None if direct is None else str(direct.get_transport_addresses()[0]),
            )
        )

    # ---------------------------------------------------------------- reachability

    def _servers(self) -> list[ID]:
        return [p for p in self.node.connected_peers() if DIAL_REQUEST in self._protocols.get(p, ())]

    async def _reachability_loop(self) -> None:
        while True:
            self._changed = trio.Event()
            for peer in self.node.connected_peers():
                await self._learn(peer)
            await self._check()
            with trio.move_on_after(self.config.recheck_interval if self.reachability != UNKNOWN else 5.0):
                await self._changed.wait()
                await trio.sleep(0.5)  # let a burst of changes settle

    async def _check(self) -> None:
        candidates = self._candidates()
        servers = self._servers()[: self.config.servers_per_check]
        if servers and candidates:
            async with trio.open_nursery() as nursery:
                for server in servers:
                    nursery.start_soon(self._ask, server, candidates)
        before = self.reachability
        if self.confirmed:
            self.reachability = PUBLIC
        elif servers and (not candidates or all(
            len(self._verdicts.get(str(c), _Verdicts()).failed) >= min(self.config.min_failures, len(servers))
            for c in candidates
        )):
            self.reachability = PRIVATE
        if self.reachability != before:
            self.node.emit(nev.ReachabilityChanged(self.reachability, self.mapping, [str(a) for a in self.confirmed]))
            self._relay_changed.set()  # the relay loop decides on relays (and client mode) from it
        self._update_mode()

    async def _ask(self, server: ID, candidates: list[Multiaddr]) -> None:
        # One request per candidate: the server dials only the first address it accepts.
        for addr in candidates:
            verdicts = self._verdicts.setdefault(str(addr), _Verdicts())
            if server in verdicts.ok or server in verdicts.failed:
                continue
            try:
                result = await self.autonat.check(server, [addr])
            except AutoNATError as e:
                log.debug("AutoNAT via %s: %s", server, e)
                return
            self._dial_backs += 1
            if result.reachable is True:
                verdicts.ok.add(server)
            elif result.reachable is False:
                verdicts.failed.add(server)

    # ---------------------------------------------------------------- relays

    def _relays(self) -> list[ID]:
        return [p for p in self.node.connected_peers() if HOP_PROTOCOL in self._protocols.get(p, ()) and p != self.node.peer_id]

    async def _relay_loop(self) -> None:
        while True:
            self._relay_changed = trio.Event()
            if self.config.autorelay and self.reachability != PUBLIC:
                await self._keep_reservations()
            self._update_mode(relays_tried=self.reachability == PRIVATE)
            with trio.move_on_after(5.0):
                await self._relay_changed.wait()

    async def _keep_reservations(self) -> None:
        client = self.relay_client
        now = time.time()
        for relay, rsvp in list(client.reservations.items()):
            if live_connection(self.node.network, relay) is None:
                client.drop(relay)
                self.node.emit(nev.RelayLost(relay=str(relay), reason="disconnected"))
            elif rsvp.expire - now < min(300.0, (rsvp.expire - rsvp.reserved_at) / 4):
                await self._reserve(relay, refresh=True)
        for relay in self._relays():
            if len(client.reservations) >= self.config.max_relays:
                break
            if relay not in client.reservations:
                await self._reserve(relay, refresh=False)

    async def _reserve(self, relay: ID, *, refresh: bool) -> Reservation | None:
        try:
            rsvp = await self.relay_client.reserve(relay)
        except RelayError as e:
            log.info("reservation on %s failed: %s", relay, e)
            if refresh:
                self.relay_client.drop(relay)
                self.node.emit(nev.RelayLost(relay=str(relay), reason=str(e)))
            return None
        if not refresh:
            self.node.emit(nev.RelayReserved(relay=str(relay), expire=rsvp.expire, addrs=[str(a) for a in rsvp.circuit_addrs]))
        return rsvp

    def _update_mode(self, *, relays_tried: bool = False) -> None:
        """Public, relayed, or client; client only once a pass of the relay loop found no slot."""
        if self.reachability == PUBLIC:
            mode, why = "public", "reachable at " + ", ".join(map(str, self.confirmed))
        elif self.relay_client.reservations:
            mode, why = "relayed", "reachable through " + ", ".join(map(str, self.relay_client.reservations))
        elif self.reachability == PRIVATE and relays_tried:
            mode, why = "client", "not reachable and no relay accepted us: dialing out only"
        else:
            return
        if mode != self.mode:
            self.mode = mode
            self.node.emit(nev.ModeChanged(mode=mode, reason=why))

    # ---------------------------------------------------------------- port mapping

    async def _port_mapping(self) -> None:
        try:
            from .port_mapping import PortMappingUnavailable, map_port
        except ImportError:
            return
        port = next((p for a in self.node.listen_addrs if (p := _tcp_port(a)) is not None), None)
        if port is None:
            return
        try:
            async with map_port(port) as mapping:
                self._mapped = [Multiaddr(f"/ip4/{mapping.external_ip}/tcp/{mapping.external_port}")]
                self._notify()
                await trio.sleep_forever()
        except (PortMappingUnavailable, DedlocError, OSError) as e:
            log.info("no port mapping: %s", e)
        finally:
            self._mapped = []

    # ---------------------------------------------------------------- the funnel

    def metrics(self) -> dict[str, Any]:
        direct = relayed = 0
        for conns in self.node.network.connections.items():
            for conn in conns[1]:
                muxed = conn.muxed_conn
                moved = getattr(muxed, "bytes_sent", 0) + getattr(muxed, "bytes_received", 0)
                if is_relayed_conn(conn):
                    relayed += moved
                else:
                    direct += moved
        punch = self.puncher.metrics
        out: dict[str, Any] = {
            "mode": self.mode,
            "reachability": self.reachability,
            "mapping": self.mapping,
            "confirmed": [str(a) for a in self.confirmed],
            "reservations": len(self.relay_client.reservations),
            "reservations_made": self.relay_client.metrics["reservations"],
            "reservation_failures": self.relay_client.metrics["reservation_failures"],
            "dial_backs": self._dial_backs,
            "punch_attempts": punch.attempts,
            "punch_successes": punch.successes,
            "punch_first_try": punch.first_try_successes,
            "reversals": punch.reversals,
            "punch_failures": punch.failures,
            "time_to_direct": list(punch.time_to_direct),
            "bytes_direct": direct,
            "bytes_relayed": relayed,
        }
        if self.relay_service is not None:
            out["relay_service"] = self.relay_service.snapshot()
        if self.autonat_server is not None:
            out["autonat_server"] = dict(self.autonat_server.metrics)
        return out


def _tcp_port(addr: Multiaddr) -> int | None:
    items = list(addr.items())
    if len(items) > 1 and items[1][0].name == "tcp":
        return int(str(items[1][1]))
    return None


__all__ = ["NatConfig", "NatService", "PUBLIC", "PRIVATE", "UNKNOWN"]
