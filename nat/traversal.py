"""NAT traversal for one Node, composed: reachability, relays, hole punching, port mapping, client mode.

Each protocol is its own behaviour with its own config (relay, AutoNAT,
DCUtR); this module runs them together the way a volunteer needs with no
flags about NAT:

1. learn observed addresses (identify from peers we dialed from our listen
   port) and classify the NAT's mapping from what several observers saw;
2. ask AutoNAT servers to dial our candidate addresses; advertise only public
   addresses that a dial-back confirmed (private ones stay, for LANs);
3. if none is confirmed: ask the router for a port mapping (UPnP / NAT-PMP /
   PCP), reserve slots on relays among the peers we know (:mod:`.autorelay`)
   and advertise the ``/p2p-circuit`` addresses;
4. upgrade relayed connections to direct ones (DCUtR) when a peer reaches us
   through a relay;
5. with neither a confirmed address nor a relay: client mode, dialing out
   only, and say so.

:meth:`NatService.metrics` is the funnel (reservations, dial-backs, punch
attempts and successes, time to direct, relayed vs direct bytes).

What the facts mean (reachability, the mapping class, the mode) is decided by
pure functions in :mod:`.reachability`; this module gathers the facts and
runs every task in its own nursery, which :meth:`NatService.attach` owns: on
exit the tasks end, the protocol handlers and the circuit dialer are removed,
and the Node's external view is reset.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import Node
from p2p.addresses import ip_family, is_relayed, is_relayed_conn, reachable_tcp, without_peer_id
from p2p.dialer import live_connection, remote_addr
from p2p.errors import ConfigError, DedlocError
from p2p.resources import Rate, default_rates
from p2p.hooks import (
    ConnectionInfo,
    Direction,
    ExternalAddresses,
    Metrics,
    PathKind,
    Reachability,
    SwarmObserver,
)

from . import events as nev
from .autonat import DIAL_REQUEST, AutoNATClient, AutoNATConfig, AutoNATError, AutoNATServer
from .autorelay import AutoRelay, AutoRelayConfig
from .circuit import HOP_PROTOCOL, RelayClient, RelayClientConfig
from .holepunch import HolePunchConfig, HolePuncher, PunchResult
from .port_mapping import PortMappingConfig, PortMappingUnavailable, map_port, mappable_port
from .reachability import (AddressVerdicts, MappingKind, NatMode, ServerBudget, classify_mapping, judge_reachability,
                           plan_probes, select_mode, server_judges)
from .relay import RelayConfig, RelayService
from .relay_discovery import RelayDiscoveryConfig

log = logging.getLogger(__name__)

#: Seconds between identify runs to the same peer (protocols and how it sees us change rarely).
IDENTIFY_EVERY = 60.0


@dataclass
class NatConfig:
    """How a node deals with NATs. The defaults are for a volunteer's machine."""

    #: Serve circuit relay v2 to others (``dedloc relay`` turns it on; any public peer may).
    relay_service: bool = False
    relay: RelayConfig = field(default_factory=RelayConfig)
    relay_client: RelayClientConfig = field(default_factory=RelayClientConfig)
    #: Answer AutoNAT dial-requests.
    autonat_server: bool = True
    autonat: AutoNATConfig = field(default_factory=AutoNATConfig)
    hole_punch: HolePunchConfig = field(default_factory=HolePunchConfig)
    autorelay: AutoRelayConfig = field(default_factory=AutoRelayConfig)
    #: Relays advertised in and looked up from the DHT (the composed :class:`nat.Peer` runs both).
    relay_discovery: RelayDiscoveryConfig = field(default_factory=RelayDiscoveryConfig)
    port_mapping: PortMappingConfig = field(default_factory=PortMappingConfig)
    #: Re-check reachability this often (seconds), and sooner when the network changes.
    recheck_interval: float = 300.0
    #: An AutoNAT answer is trusted this long, then the address is asked again (a confirmed address can
    #: be lost: a new IP from the ISP, a router that forgot its mapping); a stale answer still counts
    #: until a fresh one comes, or for three times this long (go-libp2p: an hour, and three).
    verdict_ttl: float = 3600.0
    #: Servers that must fail to reach an address before it counts as unreachable (at most: all we have).
    min_failures: int = 3
    #: AutoNAT servers asked per check.
    servers_per_check: int = 4
    #: How often we ask one AutoNAT server: what a server lets one peer ask (``p2p/resources.py``'s
    #: ``autonat`` rate, 12 a minute and 4 at once), so that a host with many addresses is never
    #: refused or logged as a flood; addresses over it wait for the next check.
    server_pace: Rate = field(default_factory=lambda: default_rates()["autonat"])
    #: Treat private addresses like public ones (LAN swarms, tests on one machine).
    allow_private: bool = False
    #: The address family every peer of the swarm can dial: a confirmed address of it makes us public
    #: (DHT server, relay slots dropped). A peer confirmed only in the other family advertises that
    #: address and keeps its relay slots. "ip6" only for a swarm with no IPv4 at all.
    public_family: str = "ip4"

    def validate(self) -> None:
        self.relay.validate()
        self.relay_client.validate()
        self.autonat.validate()
        self.hole_punch.validate()
        self.autorelay.validate()
        self.relay_discovery.validate()
        self.port_mapping.validate()
        if self.min_failures < 1 or self.servers_per_check < 1:
            raise ConfigError("min_failures and servers_per_check must be at least 1")
        if self.recheck_interval <= 0 or self.verdict_ttl <= 0:
            raise ConfigError("recheck_interval and verdict_ttl must be positive")
        if self.public_family not in ("ip4", "ip6"):
            raise ConfigError(f"public_family must be 'ip4' or 'ip6', not {self.public_family!r}")
        self.server_pace.validate("server_pace")

    def resolved(self) -> NatConfig:
        """A copy with ``allow_private`` passed down to the protocols that dial; the caller's stays as it was."""
        if not self.allow_private:
            return self
        return replace(self, autonat=replace(self.autonat, allow_private=True),
                       hole_punch=replace(self.hole_punch, allow_private=True))


class NatService(SwarmObserver):
    """The NAT layer of one Node; open it with :meth:`attach`."""

    def __init__(self, node: Node, config: NatConfig, nursery: trio.Nursery) -> None:
        self.node = node
        self.config = config
        self._nursery = nursery
        self.relay_client = RelayClient(node, config.relay_client)
        self.autonat = AutoNATClient(node, config.autonat)
        self.autonat_server = AutoNATServer(node, config.autonat) if config.autonat_server else None
        self.relay_service = RelayService(node, config.relay) if config.relay_service else None
        self.puncher = HolePuncher(node, self.punch_addrs, config.hole_punch)
        self.autorelay = AutoRelay(node, self.relay_client, config.autorelay,
                                   is_relay=self._is_relay, changed=self._publish)
        self.reachability = Reachability.UNKNOWN
        self.mapping = MappingKind.UNKNOWN
        self.mode = NatMode.STARTING
        self.verdicts = AddressVerdicts(ttl=config.verdict_ttl)
        self._budget = ServerBudget(config.server_pace)
        self._listen_views: dict[ID, Multiaddr] = {}
        self._protocols: dict[ID, set[str]] = {}
        self._identified: dict[ID, float] = {}
        self._mapped: list[Multiaddr] = []
        # The reachability loop's wake-up; it replaces its own, so it never waits on a stale one.
        self._changed = trio.Event()
        self._dial_backs = 0
        #: Checks a server answered without a verdict, by its status (E_DIAL_REFUSED, E_REQUEST_REJECTED).
        self._no_verdict: Counter[str] = Counter()

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    @asynccontextmanager
    async def attach(cls, node: Node, config: NatConfig | None = None) -> AsyncIterator[NatService]:
        """Run NAT traversal for ``node`` for the duration of the block; everything it started ends with it."""
        config = config or NatConfig()
        config.validate()
        async with trio.open_nursery() as nursery:
            service = cls(node, config.resolved(), nursery)
            with ExitStack() as installed:
                installed.enter_context(service.relay_client.install())
                installed.enter_context(service.autonat.install())
                installed.enter_context(service.puncher.install(nursery))
                if service.autonat_server is not None:
                    installed.enter_context(service.autonat_server.install())
                if service.relay_service is not None:
                    installed.enter_context(service.relay_service.install())
                installed.enter_context(node.observe(service))
                installed.callback(node.set_external, ExternalAddresses())
                service._publish()
                for peer in node.connected_peers():
                    nursery.start_soon(service._learn, peer)
                nursery.start_soon(service._reachability_loop)
                nursery.start_soon(service.autorelay.run, service._wants_relays, service._after_relay_pass)
                if config.port_mapping.enabled:
                    nursery.start_soon(service._port_mapping)
                try:
                    yield service
                finally:
                    nursery.cancel_scope.cancel()

    def _notify(self) -> None:
        self._changed.set()
        self.autorelay.wake()

    def _publish(self) -> None:
        """Tell the Node what we concluded: it advertises from this and tells every service."""
        self.node.set_external(ExternalAddresses(
            reachability=self.reachability,
            confirmed=tuple(self.confirmed),
            refuted=tuple(self.verdicts.refuted(self.config.min_failures)),
            relayed=tuple(a for r in self.relay_client.reservations.values() for a in r.circuit_addrs),
            judged=True,
        ))

    # ---------------------------------------------------------------- what the Node tells us

    def connection_opened(self, info: ConnectionInfo) -> None:
        if info.kind == PathKind.RELAYED and info.direction == Direction.INBOUND:
            self._nursery.start_soon(self._upgrade, info.peer_id, trio.current_time())
        elif info.kind == PathKind.DIRECT:
            self._nursery.start_soon(self._learn, info.peer_id)
            if self._is_relay(info.peer_id):
                # A relay we know back (restarted, or the link dropped): reserve at once, not at
                # autorelay's next poll, as when it is identified anew (at most once a minute: a
                # re-identify at every reconnection tripled a 16-peer swarm's CPU).
                self.autorelay.wake()

    def _is_relay(self, peer: ID) -> bool:
        """Whether ``peer`` serves circuit relay v2, as its last identify said."""
        return HOP_PROTOCOL in self._protocols.get(peer, ())

    def connection_closed(self, info: ConnectionInfo) -> None:
        now = trio.current_time()
        if info.kind == PathKind.DIRECT and live_connection(self.node.network, info.peer_id) is None:
            self._listen_views.pop(info.peer_id, None)
            if info.peer_id not in self._identified:  # its identify time forgotten while it was connected
                self._protocols.pop(info.peer_id, None)
            self.autorelay.lost(info.peer_id, "disconnected")
            self._notify()
        self._forget_stale(now)

    def _forget_stale(self, now: float) -> None:
        """Forget the peers that left whose last identify is ``IDENTIFY_EVERY`` old (the dict is in the
        order of identifies: the stale ones come first, a peer just closed among them): met again, they
        are identified again anyway. Within that time a peer back (a relay restarted) is known at once
        by its protocols, with no identify (:meth:`_learn` skips it). Before, both maps kept every peer
        ever met: a relay's visitors grew them by one entry each, for good (``bench/relay_soak.py``)."""
        while self._identified:
            peer, at = next(iter(self._identified.items()))
            if now - at < IDENTIFY_EVERY:
                return
            del self._identified[peer]
            if live_connection(self.node.network, peer) is None:
                self._protocols.pop(peer, None)

    # ---------------------------------------------------------------- addresses

    @property
    def confirmed(self) -> list[Multiaddr]:
        return self.verdicts.confirmed()

    def _public(self, addr: Multiaddr) -> bool:
        return reachable_tcp(addr, allow_private=self.config.allow_private)

    def _candidates(self) -> list[Multiaddr]:
        """Addresses others might reach us at: public interfaces, port mappings, and what observers
        saw of connections that used our listen port (as go-libp2p keys observations by the local
        address they were made on).

        Of a connection from an ephemeral port (a dial that did not bind the listen port) only the
        IP counts: nothing listens on the port an observer saw, so asking AutoNAT servers to dial it
        cannot succeed, and each such address cost three dial-backs that time out (10 s each). Behind
        an endpoint-dependent (symmetric) NAT, what observers saw of the listen port is no address
        either: the NAT made each of them a mapping for that observer only. A
        trainer behind a symmetric NAT that had met its swarm waited 31 s for its verdict, and the
        averager does not declare a role before it: it missed the swarm's first steps."""
        out: list[Multiaddr] = []
        ports = self.node.listen_ports

        def add(addr: Multiaddr) -> None:
            addr = without_peer_id(addr)
            if self._public(addr) and addr not in out:
                out.append(addr)

        for addr in self._mapped:
            add(addr)
        for addr in self.node.addrs:
            add(addr)
        if self.mapping is not MappingKind.DEPENDENT:  # else each observer saw a mapping for it alone
            for addr in self._listen_views.values():
                add(addr)
        for addr in list(self._listen_views.values()) + self.node.observed_addrs():
            items = list(addr.items())
            for port in ports:  # a port-preserving NAT maps our listen port to itself
                add(Multiaddr(f"/{items[0][0].name}/{items[0][1]}/tcp/{port}"))
        return out

    def punch_addrs(self) -> list[Multiaddr]:
        """What we offer in DCUtR: confirmed and observed public addresses of our listen port, and the
        public ones it is bound to even where a dial-back refuted them. A refuted address is one a
        stateful filter keeps unsolicited dials from (a home router's IPv6 firewall), which is what a
        punch opens: both sides dial at once, and each filter lets the other's SYN in as an answer.
        Offering the advertised ones alone, two peers behind such filters punched over IPv6 only
        until their AutoNAT had refuted the address (a lab test failed whenever it was that late)."""
        out = list(self.confirmed)
        for addr in self._candidates() + [without_peer_id(a) for a in self.node.bound_addrs()]:
            if addr not in out and self._public(addr):
                out.append(addr)
        return out

    # ---------------------------------------------------------------- learning about peers

    async def _learn(self, peer: ID) -> None:
        """Identify a peer (at most once a minute): its protocols, and how it sees us."""
        now = trio.current_time()
        if now - self._identified.get(peer, -1e9) < IDENTIFY_EVERY:
            return
        self._identified.pop(peer, None)
        self._identified[peer] = now  # last: the dict stays in the order of identifies (_forget_stale)
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
                    self._nursery.start_soon(self._learn_later, peer)  # soon, not at the next recheck
                    return
                await trio.sleep(0.5 * (attempt + 1))
        self._protocols[peer] = set(info.protocols)
        if info.observed_addr is not None and not is_relayed(info.observed_addr):
            # Only a connection that left from our listen port shows how our NAT maps
            # that port; an ephemeral-port dial would look like endpoint dependence. The
            # connection the answer came over is the one observed: with two to one peer,
            # one from the listen port and one not (a dial retry from a fresh port), asking
            # whether any uses it read the other's mapping as endpoint dependence.
            ports = self.node.listen_ports
            if info.local_addr is not None and info.local_addr[1] in ports:
                self._listen_views[peer] = info.observed_addr
                mapping = classify_mapping(self._listen_views, self.node.addrs, ports, self._public)
                if mapping is not None:
                    self.mapping = mapping
        self._notify()

    async def _learn_later(self, peer: ID) -> None:
        await trio.sleep(5.0)
        if live_connection(self.node.network, peer) is not None:
            await self._learn(peer)

    async def _upgrade(self, peer: ID, opened: float) -> None:
        def report(result: PunchResult) -> None:
            self.node.emit(nev.HolePunched(
                peer_id=peer,
                success=result.conn is not None,
                method=result.method,
                attempts=result.attempts,
                elapsed=result.elapsed,
                addr=None if result.conn is None else str(remote_addr(result.conn)),
            ))

        await self.puncher.keep_upgrading(peer, opened, report)

    # ---------------------------------------------------------------- reachability

    def _servers(self) -> list[ID]:
        return [p for p in self.node.connected_peers() if DIAL_REQUEST in self._protocols.get(p, ())]

    def _judges(self, server: ID, addr: Multiaddr) -> bool:
        """Whether ``server`` can dial ``addr``: see :meth:`_judges_family`."""
        return self._judges_family(server, ip_family(addr))

    def _judges_family(self, server: ID, family: str | None) -> bool:
        """Whether ``server`` can dial addresses of ``family``: see :func:`server_judges`."""
        return server_judges(family, self.node.known_addrs(server), self._public)

    async def _reachability_loop(self) -> None:
        while True:
            self._changed = trio.Event()
            for peer in self.node.connected_peers():
                await self._learn(peer)
            await self._check()
            with trio.move_on_after(self.config.recheck_interval if self.reachability != Reachability.UNKNOWN else 5.0):
                await self._changed.wait()
                await trio.sleep(0.5)  # let a burst of changes settle

    async def _check(self) -> None:
        candidates = self._candidates()
        servers = self._servers()[: self.config.servers_per_check]
        now = trio.current_time()
        self.verdicts.expire(now)
        plan = plan_probes(candidates, servers, self.verdicts, {s: self._budget.available(s, now) for s in servers},
                           self.config.min_failures, now, self._judges)
        if plan:
            async with trio.open_nursery() as nursery:
                for server, addrs in plan.items():
                    nursery.start_soon(self._ask, server, addrs)
        before = self.reachability
        family = self.config.public_family
        judging = sum(1 for s in servers if self._judges_family(s, family))
        self.reachability = judge_reachability(before, self.verdicts, candidates, judging, self.config.min_failures, family)
        self._publish()
        if self.reachability != before:
            self.node.emit(nev.ReachabilityChanged(self.reachability, self.mapping, [str(a) for a in self.confirmed]))
            self.autorelay.wake()  # the relay loop decides on relays (and client mode) from it
        self._update_mode()

    async def _ask(self, server: ID, addrs: list[Multiaddr]) -> None:
        """One request per address (the server dials only the first address it accepts), all at
        once: the plan gives a server no more than its budget, within the requests a server lets one
        peer have open (4). One after the other, a peer behind a symmetric NAT with three addresses
        to refute waited three dial-back timeouts (10 s each, the NAT drops the SYN) for its verdict."""
        async with trio.open_nursery() as nursery:
            for addr in addrs:
                self._budget.spend(server, trio.current_time())
                nursery.start_soon(self._ask_one, server, addr)

    async def _ask_one(self, server: ID, addr: Multiaddr) -> None:
        try:
            result = await self.autonat.check(server, [addr])
        except AutoNATError as e:
            log.debug("AutoNAT via %s: %s", server, e)
            if e.status is not None:
                self._no_verdict[e.status] += 1
            return
        self._dial_backs += 1
        self.verdicts.record(addr, server, result.reachable, trio.current_time())

    # ---------------------------------------------------------------- relays and mode

    def _wants_relays(self) -> bool:
        return self.reachability != Reachability.PUBLIC

    def _after_relay_pass(self) -> None:
        self._update_mode(relays_tried=self.reachability == Reachability.PRIVATE)

    def _update_mode(self, *, relays_tried: bool = False) -> None:
        decided = select_mode(self.reachability, self.confirmed, self.relay_client.reservations, relays_tried=relays_tried)
        if decided is not None and decided[0] != self.mode:
            self.mode, why = decided
            self.node.emit(nev.ModeChanged(mode=self.mode, reason=why))

    # ---------------------------------------------------------------- port mapping

    async def _port_mapping(self) -> None:
        port = mappable_port(self.node.listen_addrs)
        if port is None:
            log.info("no port mapping asked for: no TCP listen address off loopback, none a router could reach")
            return
        try:
            async with map_port(port, config=self.config.port_mapping) as mapping:
                self._mapped = [Multiaddr(f"/ip4/{mapping.external_ip}/tcp/{mapping.external_port}")]
                self._notify()
                await trio.sleep_forever()
        except (PortMappingUnavailable, DedlocError, OSError) as e:
            log.info("no port mapping: %s", e)
        finally:
            self._mapped = []

    def path_to(self, peer: ID) -> str:
        """How we are connected to ``peer`` now: ``direct``, ``relayed`` or ``none`` (:meth:`p2p.Node.path_to`)."""
        return self.node.path_to(peer)

    # ---------------------------------------------------------------- the funnel

    def metrics(self) -> Metrics:
        """The funnel, flat (every service's ``metrics()`` has this shape; the relay's under ``relay.``)."""
        direct = relayed = 0
        for conns in self.node.network.connections.values():
            for conn in conns:
                muxed = conn.muxed_conn
                moved = getattr(muxed, "bytes_sent", 0) + getattr(muxed, "bytes_received", 0)
                if is_relayed_conn(conn):
                    relayed += moved
                else:
                    direct += moved
        client = self.relay_client.metrics()
        out: Metrics = {
            "mode": str(self.mode),
            "reachability": str(self.reachability),
            "mapping": str(self.mapping),
            "confirmed": [str(a) for a in self.confirmed],
            "reservations": len(self.relay_client.reservations),
            "reservations_made": client["reservations"],
            "reservation_failures": client["reservation_failures"],
            "relays_discovered": self.autorelay.discovered,
            "dial_backs": self._dial_backs,
            # asked what it would not dial (no IPv6 there), or over its limits: each a request wasted
            "autonat_refused": self._no_verdict["E_DIAL_REFUSED"],
            "autonat_rejected": self._no_verdict["E_REQUEST_REJECTED"],
            **self.puncher.metrics(),
            "bytes_direct": direct,
            "bytes_relayed": relayed,
        }
        if self.relay_service is not None:
            out.update({f"relay.{k}": v for k, v in self.relay_service.metrics().items()})
        if self.autonat_server is not None:
            out.update({f"autonat_server.{k}": v for k, v in self.autonat_server.metrics().items()})
        return out


__all__ = ["NatConfig", "NatService"]
