"""The Node: one py-libp2p host that an app opens, uses and closes inside its own trio code.

Everything above (NAT traversal, the DHT, averaging, training) talks to peers
only through a Node: its dialer, its streams and its RPC. The Node owns its
tasks in a nursery that lives exactly as long as the ``async with`` block.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterator, Sequence
from contextlib import ExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import cast

import ifaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetworkService
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError
from libp2p.network.stream.exceptions import StreamError
from multiaddr import Multiaddr

from . import events as ev
from . import multistream
from .admission import Admission
from .addresses import (is_relayed, is_unspecified, parse_multiaddr, parse_peer_addr, rank_for_dial, tcp_port,
                        with_peer_id, without_peer_id)
from .config import NodeConfig
from .conn_manager import Conn, Tags, select_to_close
from .dial_backoff import DialBackoff
from .dialer import CircuitDialer, backoff_delays, classify_dial_error, dial, live_connection, remote_addr
from .errors import (CLOSED_SWARM_HINT, BootstrapError, ConfigError, DedlocError, DialBackoffError, DialError,
                     ProtocolNotSupportedError, StreamOpenError)
from .hooks import ConnectionInfo, Direction, ExternalAddresses, Observers, PathKind, Reachability, Registration, SwarmObserver
from .identify import (MAX_LISTEN_ADDRS, PUSH_CONCURRENCY, PUSH_DELAY, PUSH_PROTOCOL, PeerIdentity, identify,
                       push_identify)
from .identity import held_identity, new_identity, peer_id_of
from .auth import PRE_AUTH, PROTOCOL as AUTH_PROTOCOL, AuthError, Authenticator
from .libp2p_host import (build_host, check_listening, close_connections, close_listeners, identify_message, left_open,
                          set_gate, started)
from .noise import NoiseSession
from .observed import ObservedAddrs
from .proto import auth_pb2 as auth_pb
from .wire import read_message, write_message
from .resources import ResourceLimitExceeded, ResourceManager, limits_hit
from .rpc import RPC_PROTOCOL, Rpc
from .rpc.stream import TRANSPORT_ERRORS
from .trio_util import finish_quietly, unwrap_single_group
from .yamux import GO_AWAY_GARBAGE_COLLECTED

log = logging.getLogger(__name__)

#: How long a closed swarm's Hello may take to arrive and be answered (we have no pass: no verdict waits on it).
AUTH_NOTICE_TIMEOUT = 5.0

StreamHandler = Callable[[INetStream], Awaitable[None]]
PING_SIZE = 32
#: how long a peer may take to answer a stream's protocol proposal (when it is awaited)
NEGOTIATE_TIMEOUT = 10.0
#: How long addresses learnt from a dial or an initial peer stay in the peer store.
ADDR_TTL = 3600
EVENT_BUFFER = 1024
RPC_SWEEP_INTERVAL = 10.0
#: What a push to a peer may fail with: out of time, the connection gone, a broken stream.
PUSH_ERRORS: tuple[type[BaseException], ...] = (trio.TooSlowError, DedlocError, *TRANSPORT_ERRORS)


@dataclass
class _Subscriber:
    send: trio.MemorySendChannel[ev.Event]
    dropped: int = 0


class Node:
    """A running dedloc peer. Create it with :meth:`open`, never directly."""

    def __init__(self, config: NodeConfig, key_pair: KeyPair, host: IHost, nursery: trio.Nursery,
                 resources: ResourceManager | None = None):
        self.config = config
        #: What peers may take: admission before any crypto, then connections, streams, bytes in
        #: flight and request rates (``p2p/resources.py``); its limits and usage are in ``dedloc status``.
        self.resources = resources or ResourceManager(config.resources)
        self.key_pair = key_pair
        self.host = host
        self.peer_id: ID = peer_id_of(key_pair)
        self._nursery = nursery
        self._subscribers: list[_Subscriber] = []
        self._observers: Observers[SwarmObserver] = Observers("the swarm")
        self._observed = ObservedAddrs()
        self._announce = [parse_multiaddr(a, what="announce address") for a in config.announce]
        self._circuit_dialer: CircuitDialer | None = None
        self._external = ExternalAddresses()
        self._auth: Authenticator | None = None
        #: peers that showed us a closed swarm's pass while we had none (``_on_closed_swarm_hello``)
        self.closed_swarm: set[ID] = set()
        #: Failed attempts of our dials, by (transport, error class, ip version): go-libp2p's
        #: ``libp2p_swarm_dial_errors_total`` labels (:func:`p2p.dialer.classify_dial_error`).
        self.dial_errors: Counter[tuple[str, str, str]] = Counter()
        #: Addresses whose dials failed lately, held back for a while (``p2p/dial_backoff.py``).
        self.backoff = DialBackoff(config.dial_backoff)
        #: Draws the jitter of bootstrap's and rejoin's retries: seeded by our peer id, so each
        #: peer keeps its own pace from run to run, and two peers' paces differ.
        self._jitter = random.Random(self.peer_id.to_bytes())
        #: Calls of :meth:`connect` refused at once because every address was held back.
        self.dials_backed_off = 0
        #: The dial under way to each peer: one at a time, later callers wait for it (go-libp2p's dial sync).
        self._dialing: dict[ID, trio.Event] = {}
        self._rejoining = False
        self._closing = False
        #: set when what we advertise or serve may have changed (:meth:`_push_identify`)
        self._push_wanted = trio.Event()
        #: Which peers services asked to keep connected, and what they are worth (:meth:`protect`,
        #: :meth:`value_peers`): what the connection manager reads (``p2p/conn_manager.py``).
        self.conn_tags = Tags()
        self._valuers: list[Callable[[ID], int]] = []
        #: when each open connection opened (trio's clock): its grace period
        self._opened: dict[INetConn, float] = {}
        #: connections the connection manager closed
        self.trimmed = 0
        #: peers the peer store forgot (``p2p/peer_store.py``)
        self.forgotten_peers = 0
        self.rpc = Rpc(self.new_stream, max_message_size=config.max_message_size, default_timeout=config.rpc_timeout,
                       admit=self._admit_call)

    @property
    def admission(self) -> Admission:
        """Inbound connections before any crypto (``p2p/admission.py``), part of :attr:`resources`."""
        return self.resources.admission

    def _admit_call(self, peer_id: ID, method: str) -> None:
        """An RPC call's rate check: the service is the method's first part (``dht.find``: ``dht``);
        methods of a service without a rate of its own count as ``rpc``."""
        service = method.split(".", 1)[0]
        if service not in self.resources.config.rates:
            service = "rpc"
        self.resources.allow(service, str(peer_id), trio.current_time())

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def open(cls, config: NodeConfig | None = None, *, bootstrap: bool = True) -> AsyncIterator[Node]:
        """Start a node, connect it to its initial peers, and close it all on exit.

        With ``bootstrap=False`` the caller runs :meth:`bootstrap` itself (after
        installing services that must see the first connections, say).

        Raises :class:`p2p.ConfigError` for unusable settings, :class:`p2p.IdentityError`
        for a bad identity file or one that another running node holds (one peer id, one node:
        ``identity.held_identity``), :class:`p2p.DedlocError` when a listen address cannot
        be bound, and :class:`p2p.BootstrapError` when initial peers were given and
        none answered within ``config.bootstrap_timeout``.
        """
        config = config or NodeConfig()
        config.validate()
        with held_identity(config.identity_path) if config.identity_path is not None else \
                nullcontext(new_identity()) as key_pair:
            async with cls._open(config, key_pair, bootstrap=bootstrap) as node:
                yield node

    @classmethod
    @asynccontextmanager
    async def _open(cls, config: NodeConfig, key_pair: KeyPair, *, bootstrap: bool) -> AsyncIterator[Node]:
        listen = [parse_multiaddr(a, what="listen address") for a in config.listen]

        holder: list[Node] = []
        resources = ResourceManager(config.resources)
        host = build_host(
            key_pair, listen, yamux=config.yamux, noise_config=config.noise, dial_timeout=config.dial_timeout,
            advertised=lambda candidates: holder[0]._advertised(candidates) if holder else candidates,
            max_addrs=MAX_LISTEN_ADDRS + 8, resources=resources, known_peers=config.known_peers,
            keep=lambda: holder[0]._kept_in_peer_store() if holder else (),
            forgot=lambda n: holder[0]._forgot(n) if holder else None,
        )
        bootstrap_error: BootstrapError | None = None
        listening = False
        try:
            with unwrap_single_group():
                async with host.run(listen), trio.open_nursery() as nursery:
                    listening = True
                    check_listening(host, listen)
                    node = cls(config, key_pair, host, nursery, resources)
                    holder.append(node)
                    await started(host, node._host_addrs, node._connected, node._disconnected,
                                  resources)
                    node.set_stream_handler(RPC_PROTOCOL, node.rpc.handle_stream)
                    node._serve_closed_swarm_notice()
                    nursery.start_soon(node._sweep_idle_rpc_streams)
                    nursery.start_soon(node._log_limits_hit)
                    nursery.start_soon(node._push_identify)
                    if config.connections.enabled:
                        nursery.start_soon(node._trim_connections)
                    try:
                        if bootstrap and config.initial_peers:
                            await node.bootstrap()
                    except BootstrapError as e:
                        bootstrap_error = e
                    else:
                        try:
                            yield node
                        finally:
                            node.emit(ev.Closed(peer_id=node.peer_id))
                            for sub in node._subscribers:
                                sub.send.close()
                    finally:
                        node._closing = True  # the connections that close now are no cut-off
                        nursery.cancel_scope.cancel()
                        await close_listeners(host)
                        await close_connections(node.connections())
        except OSError as e:
            if listening:  # a failure inside the block (a DialError is an OSError too): not ours to rename
                raise
            raise DedlocError(f"cannot listen on {', '.join(map(str, listen))}: {e.strerror or e}") from e
        if bootstrap_error is not None:
            raise bootstrap_error

    async def _sweep_idle_rpc_streams(self) -> None:
        """Close pooled RPC streams to peers we stopped calling (they would linger 60 s)."""
        while True:
            await trio.sleep(RPC_SWEEP_INTERVAL)
            await self.rpc.close_idle_streams()

    # ------------------------------------------------------------------ addresses

    @property
    def addrs(self) -> list[Multiaddr]:
        """Addresses others can dial this node at, best first, each ending in /p2p/<id>."""
        return rank_for_dial(self._host_addrs())

    def _host_addrs(self) -> list[Multiaddr]:
        """What identify advertises: our advertised addresses with our /p2p suffix."""
        out: list[Multiaddr] = []
        for addr in self._advertised(self.listen_addrs):
            full = with_peer_id(without_peer_id(addr), self.peer_id)
            if full not in out:
                out.append(full)
        return out

    @property
    def listen_addrs(self) -> list[Multiaddr]:
        """The sockets this node listens on (unspecified IPs not expanded); none once they close."""
        try:
            return list(self.host.get_transport_addrs())
        except OSError:  # a listener's socket closed under us as the node leaves (close_listeners)
            return []

    def bound_addrs(self) -> list[Multiaddr]:
        """The addresses our listen sockets take connections at: unspecified IPs expanded to this host's
        own, whether or not a dial-back refuted them (:attr:`addrs` leaves refuted ones out). A hole
        punch needs them: a stateful filter that refused a dial-back lets a punch's crossing dials in."""
        return [a for listen in self.listen_addrs for a in _expand_unspecified(listen)]

    def interface_addrs(self, family: str) -> list[Multiaddr]:
        """This host's own IP addresses of ``family`` (``"ip4"`` or ``"ip6"``, as ``/<family>/<ip>/tcp/0``;
        no link-local IPv6), whatever we listen on: which networks a dial from here can reach."""
        unspecified = Multiaddr(f"/{family}/{'0.0.0.0' if family == 'ip4' else '::'}/tcp/0")
        return _expand_unspecified(unspecified)

    @property
    def listen_ports(self) -> set[int]:
        """The TCP ports of :attr:`listen_addrs`: a connection that uses one on our side shows
        observers our NAT's mapping of the port others must reach."""
        return {p for a in self.listen_addrs if (p := tcp_port(a)) is not None}

    def on_listen_port(self, peer_id: ID) -> bool:
        """Whether a live direct connection to ``peer_id`` uses our listen port on our side.

        Then what that peer observes of us is our NAT's mapping of the port others
        must reach (we dialed from it, or it came in through it); a connection from
        an ephemeral port shows only that port's mapping.
        """
        ports = self.listen_ports
        for conn in self.network.get_connections(peer_id):
            session = getattr(conn.muxed_conn, "secured_conn", None)
            local = session.local_address() if isinstance(session, NoiseSession) else None
            if local is not None and local[1] in ports:
                return True
        return False

    def listen_source(self, addr: Multiaddr) -> tuple[str, int] | None:
        """Our TCP listen socket (ip, port) of ``addr``'s family, to dial from."""
        items = list(addr.items())
        if not items:
            return None
        family = items[0][0].name
        for listen in self.listen_addrs:
            parts = list(listen.items())
            if len(parts) >= 2 and parts[0][0].name == family and parts[1][0].name == "tcp":
                return str(parts[0][1]), int(str(parts[1][1]))
        return None

    def observed_addrs(self, min_observers: int = 1) -> list[Multiaddr]:
        """Our addresses as peers report seeing them (identify), seen by enough distinct peers.

        Unconfirmed: a NATed node's observed address is not dialable until
        reachability checks (``nat/``) say so.
        """
        return self._observed.confirmed(min_observers)

    def _advertised(self, candidates: list[Multiaddr]) -> list[Multiaddr]:
        """What we tell peers: ``--announce`` if given; else our interface addresses unless a
        dial-back refuted them (a public relay is reachable before anyone could confirm it),
        the addresses a dial-back confirmed (a NAT's external address, a port mapping), and
        our relayed addresses while we are not public. A family with no interface address says
        nothing (its ``0.0.0.0`` or ``::`` is no address)."""
        if self._announce:
            return list(self._announce)
        external = self._external
        refuted = set(external.refuted)
        out = [a for c in candidates for a in _expand_unspecified(c) if without_peer_id(a) not in refuted]
        out += [a for a in external.confirmed if a not in out]
        if external.reachability != Reachability.PUBLIC:
            out += [a for a in external.relayed if a not in out]
        return out

    # ------------------------------------------------------------------ what services hook into

    @property
    def external(self) -> ExternalAddresses:
        """Reachability and external addresses, as the NAT layer last judged them."""
        return self._external

    @property
    def reachability(self) -> Reachability:
        return self._external.reachability

    def set_external(self, external: ExternalAddresses) -> None:
        """The NAT layer's verdicts (it owns judging them; the Node owns the result).

        Every observer hears of a change once; an identical verdict is no change.
        """
        external = replace(external, confirmed=tuple(dict.fromkeys(map(without_peer_id, external.confirmed))),
                           refuted=tuple(dict.fromkeys(map(without_peer_id, external.refuted))),
                           relayed=tuple(dict.fromkeys(external.relayed)))
        if external != self._external:
            self._external = external
            self._observers.notify(lambda o: o.external_changed(external), "an external change")
            self._push_wanted.set()

    async def _push_identify(self) -> None:
        """Tell the connected peers when what we advertise or serve changes (identify/push).

        A peer learns our addresses and protocols from identify when it connects; a verdict or a
        relay slot that came later (a NATed peer's ``/p2p-circuit`` addresses, a confirmed public
        one), or a protocol served later, reached it only if it asked again: peer exchange handed
        on, and hole punches dialed, what we advertised at connection time. Each change is pushed
        once, :data:`PUSH_DELAY` after it, to the peers that serve the protocol, as go- and
        js-libp2p push on the same occasions (py-libp2p 0.8.1 pushes only when it starts listening).
        """
        pushed = self._identity_now()
        while True:
            await self._push_wanted.wait()
            await trio.sleep(PUSH_DELAY)
            self._push_wanted = trio.Event()
            now = self._identity_now()
            if now == pushed:
                continue
            pushed = now
            message = identify_message(self.host, purpose="push")
            if message is None:  # the node leaving, or a fault of ours (logged): this push skipped
                continue
            # and the peers we have not identified yet: such a peer may have identified us before
            # the change, and would not hear of it (a refusal costs it one stream)
            targets = [p for p in self.connected_peers()
                       if PUSH_PROTOCOL in (known := self._protocols_of(p)) or not known]
            failed: list[ID] = []
            limiter = trio.CapacityLimiter(PUSH_CONCURRENCY)

            async def push(peer: ID) -> None:
                async with limiter:
                    try:
                        await push_identify(self._stream_on_live, peer, message)
                    except PUSH_ERRORS as e:
                        log.debug("identify push to %s failed: %s", peer, e)
                        failed.append(peer)

            async with trio.open_nursery() as pushes:
                for peer in targets:
                    pushes.start_soon(push, peer)
            addrs, protocols = now
            self.emit(ev.IdentifyPushed(addrs=[str(a) for a in rank_for_dial(list(addrs))], protocols=list(protocols),
                                        peers=len(targets) - len(failed), failed=len(failed)))

    def _identity_now(self) -> tuple[tuple[Multiaddr, ...], tuple[str, ...]]:
        """What identify says of us that may change: our advertised addresses and the protocols we serve."""
        return tuple(self._host_addrs()), tuple(sorted(str(p) for p in self.host.get_mux().get_protocols() if p))

    async def _stream_on_live(self, peer_id: ID, protocol: str) -> INetStream:
        """A ``protocol`` stream (proposed lazily) on a connection we hold to ``peer_id``; never a dial."""
        conn = live_connection(self.network, peer_id)
        if conn is None:
            raise DedlocError(f"no connection to {peer_id} any more")
        return await self.new_stream_on(conn, protocol, lazy=True)

    def _protocols_of(self, peer_id: ID) -> list[str]:
        """The protocols ``peer_id`` listed in its identify (none before it answered)."""
        try:
            return [str(p) for p in self.host.get_peerstore().get_protocols(peer_id)]
        except PeerStoreError:
            return []

    def observe(self, observer: SwarmObserver) -> Registration:
        """Tell ``observer`` about every connection and external change until the handle is removed.

        Lossless and typed, unlike :meth:`events` (which is for monitoring and may drop).
        """
        return self._observers.add(observer)

    def set_circuit_dialer(self, dialer: CircuitDialer) -> Registration:
        """Let a relay client dial ``/p2p-circuit`` addresses (the NAT layer installs one)."""
        self._circuit_dialer = dialer

        def undo() -> None:
            if self._circuit_dialer is dialer:
                self._circuit_dialer = None

        return Registration(undo)

    async def _connected(self, conn: INetConn) -> None:
        self._opened[conn] = trio.current_time()
        info = _connection_info(conn)
        self.backoff.clear(info.peer_id)  # it answered, whoever dialed: its addresses start afresh
        self._observers.notify(lambda o: o.connection_opened(info), "a connection opened")
        self.emit(ev.ConnectionOpened(peer_id=info.peer_id, addr=str(info.addr), direction=info.direction, kind=info.kind))

    async def _disconnected(self, conn: INetConn) -> None:
        self._opened.pop(conn, None)
        info = _connection_info(conn)
        self.rpc.forget_peer(info.peer_id)
        self._observers.notify(lambda o: o.connection_closed(info), "a connection closed")
        self.emit(ev.ConnectionClosed(peer_id=info.peer_id, addr=str(info.addr), kind=info.kind, trimmed=info.trimmed))
        if self.config.initial_peers and not self._rejoining and not self._closing:
            self._rejoining = True
            self._nursery.start_soon(self._rejoin)

    async def _rejoin(self) -> None:
        """Cut off from every peer (our relay restarted, the link dropped): dial the initial peers
        again, at :meth:`bootstrap`'s pace, until any connection stands.

        Before, nothing but the DHT's maintenance (every 30 s) went back to them, so a peer reachable
        only through its relay stayed unreachable for up to that long after the relay came back.
        Runs after any connection closes, at most one at a time. Each round first waits (from
        ``initial_backoff``, doubling to ``max_backoff``) and ends the task if a connection stands:
        a peer that dials us back ends it, and one that accepts and closes at once is not dialed in a loop.
        """
        try:
            started: float | None = None
            for delay in self._backoff_delays():
                await trio.sleep(delay)  # also between rounds that reached a peer which closed at once
                if self.connections():
                    return
                if started is None:
                    started = trio.current_time()
                    log.info("cut off from every peer: dialing the %d initial peers again", len(self.config.initial_peers))
                    self.emit(ev.Rejoining(initial_peers=len(self.config.initial_peers)))
                try:
                    await self.bootstrap()
                except BootstrapError as e:
                    log.warning("still cut off from every peer after %.0f s: %s", trio.current_time() - started, e)
        finally:
            self._rejoining = False

    # ------------------------------------------------------------------ the connection manager

    def protect(self, peer_id: ID, tag: str) -> Registration:
        """Keep connections to ``peer_id`` open, whatever the connection manager's count, until the
        handle is removed (a relay holding our slot, an averaging round's members). Protections of
        one peer under one tag count: each handle releases one."""
        self.conn_tags.protect(peer_id, tag)
        return Registration(lambda: self.conn_tags.unprotect(peer_id, tag))

    def value_peers(self, valuer: Callable[[ID], int]) -> Registration:
        """Let ``valuer(peer)`` say what a connected peer is worth: over the high water, the
        connection manager closes the lowest-valued first (the DHT values its routing table's contacts)."""
        self._valuers.append(valuer)
        return Registration(lambda: self._valuers.remove(valuer))

    def connection_metrics(self) -> dict[str, int]:
        """The connection manager's figures (``dedloc status``: ``connections.*``)."""
        c = self.config.connections
        return {"open": len(self.connections()), "trimmed": self.trimmed, "protected_peers": self.conn_tags.protected_count(),
                "low_water": c.low_water if c.enabled else 0, "high_water": c.high_water if c.enabled else 0}

    def _kept_in_peer_store(self) -> set[ID]:
        """The peers the peer store never forgets besides us: connected and dialing ones."""
        return {*self.network.connections, *self._dialing}

    def _forgot(self, n: int) -> None:
        self.forgotten_peers += n

    def peer_store_metrics(self) -> dict[str, int]:
        """The peer store's figures (``dedloc status``: ``peer_store.*``)."""
        return {"known": len(self.host.get_peerstore().peer_ids()), "forgotten": self.forgotten_peers,
                "limit": self.config.known_peers}

    async def _trim_connections(self) -> None:
        """Every ``silence_period``: over the high water, close the connections of least use (:meth:`trim`)."""
        while True:
            await trio.sleep(self.config.connections.silence_period)
            await self.trim()

    async def trim(self) -> int:
        """Close the connections :func:`p2p.conn_manager.select_to_close` picks now; how many it closed."""
        open_now = self.connections()
        if len(open_now) <= self.config.connections.high_water:
            return 0  # the usual case: nothing to read
        conns = [Conn(peer=c.muxed_conn.peer_id, opened=self._opened.get(c, trio.current_time()),
                      busy=self.rpc.in_flight(c.muxed_conn.peer_id) + _streams_at_work(c),
                      inbound=_connection_info(c).direction == Direction.INBOUND, handle=c)
                 for c in open_now]
        peers: set[ID] = {c.muxed_conn.peer_id for c in open_now}
        values: dict[Hashable, int] = {peer: sum(_value_of(valuer, peer) for valuer in self._valuers) for peer in peers}
        chosen = select_to_close(conns, self.conn_tags, trio.current_time(), self.config.connections, values)
        if not chosen:
            return 0
        # GoAway 0x1005 says "trimmed", so that the peer does not dial back to check on us
        await close_connections((cast(INetConn, c.handle) for c in chosen), code=GO_AWAY_GARBAGE_COLLECTED)
        self.trimmed += len(chosen)
        event = ev.ConnectionsTrimmed(closed=len(chosen), peers=len({c.peer for c in chosen}), before=len(conns),
                                      after=len(self.connections()))
        log.info("%s", event.human())
        self.emit(event)
        return len(chosen)

    async def _log_limits_hit(self) -> None:
        """Every ``alarm_interval`` seconds, one ERROR line per limit hit since the last look, naming it
        (a flood of refusals is one line per limit, not one per refusal)."""
        interval = self.resources.config.alarm_interval
        seen = self.resources.refusal_counts()
        while True:
            await trio.sleep(interval)
            now = self.resources.refusal_counts()
            for name, n in limits_hit(seen, now):
                log.error("resource limit hit: %s refused %d time%s in the last %g s (docs/OPERATORS.md: "
                          "what each limit means and how to change it)", name, n, "" if n == 1 else "s", interval)
            seen = now

    # ------------------------------------------------------------------ connections

    async def connect(self, target: str | Multiaddr | ID | Sequence[str | Multiaddr], *, timeout: float | None = None,
                      from_listen_port: bool = False, force: bool = False) -> ID:
        """Make sure a connection to a peer exists; return its peer id.

        ``target`` is a full multiaddr ending in ``/p2p/<id>``, several of one peer
        (they race, best first: what a peer advertises, relayed ones included), or
        a peer id whose addresses are in the peer store. Raises :class:`DialError`
        (with the reason per address) when no address works.

        ``from_listen_port`` dials from our listen port (SO_REUSEPORT), so the peer
        sees our NAT's mapping of the port others must reach us on. Used for
        relays and bootstrap nodes, which do not dial us back at the same moment
        (two peers dialing each other this way would collide in a simultaneous open).

        One dial of a peer runs at a time: a second call waits for the first and dials only if it
        failed. An address whose dial failed lately is not dialed again until its backoff ends
        (:attr:`backoff`); when that holds every address, :class:`DialBackoffError` is raised at once,
        saying for how long. ``force`` dials them anyway (a caller with a retry pace of its own).
        """
        if isinstance(target, ID):
            peer_id, addrs = target, []
        else:
            parsed = [parse_peer_addr(t, what="dial target") for t in ([target] if isinstance(target, (str, Multiaddr)) else target)]
            if not parsed or len({pid for _, pid in parsed}) != 1:
                raise DialError(f"give one or more addresses of one peer, not {[str(a) for a, _ in parsed]}")
            addrs, peer_id = [a for a, _ in parsed], parsed[0][1]
        if peer_id == self.peer_id:
            raise DialError(f"refusing to dial ourselves ({peer_id})")
        limit = timeout or self.config.dial_timeout
        deadline = trio.current_time() + limit  # waiting for another dial of the peer included
        with trio.move_on_at(deadline) as waiting:
            while (under_way := self._dialing.get(peer_id)) is not None:
                await under_way.wait()
        if waiting.cancelled_caught:
            raise DialError(f"could not connect to {peer_id}: another dial of it was still under way after {limit:g}s")
        if live_connection(self.network, peer_id) is not None:
            return peer_id
        candidates = addrs + [with_peer_id(a, peer_id) for a in self.known_addrs(peer_id)]
        if not candidates:
            raise DialError(f"no address known for {peer_id}: give a full multiaddr")
        if not force:
            free, held = self.backoff.split(peer_id, dict.fromkeys(map(str, candidates)), trio.current_time())
            if not free:
                self.dials_backed_off += 1
                raise DialBackoffError(f"not dialing {peer_id}: each of its addresses failed lately",
                                       [(h.addr, h.reason()) for h in held])
            keep = set(free)
            candidates = [a for a in candidates if str(a) in keep]

        # A dial the caller's time cut short did not fail: go-libp2p adds no backoff for a dial whose
        # context ended, only for one whose transport gave up (its dial timeout). A caller with less
        # time than ours (a 2 s probe of a relay on a lossy link) must not hold the address back for
        # the callers that come after it with time enough.
        cut_short = limit < self.config.dial_timeout

        def failed(addr: str, why: str, timed_out: bool) -> None:
            self.dial_errors[classify_dial_error(addr, why)] += 1
            log.debug("dial of %s failed: %s", addr, why)
            if not (timed_out and cut_short):
                self.backoff.failed(peer_id, addr, trio.current_time(), why)

        started = time.perf_counter()
        done = self._dialing[peer_id] = trio.Event()
        try:
            conn, used = await dial(
                self.network,
                peer_id,
                candidates,
                stagger=self.config.dial_stagger,
                stagger_local=self.config.dial_stagger_local,
                timeout=max(0.1, deadline - trio.current_time()),
                circuit=self._circuit_dialer,
                source=self.listen_source if from_listen_port else None,
                on_failure=failed,
                limit=limit,
            )
        finally:
            del self._dialing[peer_id]
            done.set()
        self.add_addrs(peer_id, [used])
        self.emit(ev.PeerConnected(peer_id=peer_id, addr=str(used), elapsed=time.perf_counter() - started))
        return peer_id

    def known_addrs(self, peer_id: ID) -> list[Multiaddr]:
        """The peer store's addresses of a peer (none before dial or identify)."""
        try:
            return list(self.host.get_peerstore().addrs(peer_id))
        except PeerStoreError:
            return []

    def add_addrs(self, peer_id: ID, addrs: Sequence[Multiaddr], ttl: int = ADDR_TTL) -> None:
        """Remember how to dial a peer learnt from a protocol (a DHT reply, a peer exchange).

        At most ``MAX_LISTEN_ADDRS`` + 8 are kept per peer, whatever the source sends.
        """
        if peer_id != self.peer_id and addrs:
            self.host.get_peerstore().add_addrs(peer_id, [without_peer_id(a) for a in addrs], ttl)

    async def disconnect(self, peer_id: ID) -> None:
        await self.host.disconnect(peer_id)

    def connected_peers(self) -> list[ID]:
        return [pid for pid, conns in self.network.connections.items() if conns]

    def path_to(self, peer_id: ID) -> str:
        """How we are connected to ``peer_id`` now: ``direct`` (some direct connection), ``relayed``
        (only through relays) or ``none``."""
        conns = [c for c in self.network.get_connections(peer_id) if not getattr(c, "is_closed", False)]
        if any(not is_relayed(remote_addr(c)) for c in conns):
            return PathKind.DIRECT.value
        return PathKind.RELAYED.value if conns else "none"

    def peers_by_path(self) -> Counter[str]:
        """Connected peers counted by :meth:`path_to` (``direct``, ``relayed``)."""
        return Counter(path for path in map(self.path_to, self.connected_peers()) if path != "none")

    def has_connection(self, peer_id: ID) -> bool:
        return live_connection(self.network, peer_id) is not None

    def connections(self) -> list[INetConn]:
        """Every open connection (a peer may have several: direct and relayed)."""
        return [c for conns in list(self.network.connections.values()) for c in conns
                if not getattr(c, "is_closed", False)]

    # ------------------------------------------------------------------ an authenticated run

    def authenticate(self, authenticator: Authenticator) -> Registration:
        """Make this an authenticated run's node (``p2p/auth.py``) until the handle is removed: every
        connection starts with both passes on ``/dedloc/auth/1.0.0``; other protocols are refused to a
        peer without a valid one, and streams to it fail with :class:`p2p.auth.AuthError`."""
        if self._auth is not None:
            raise ConfigError("this node already has an authenticator")
        self._auth = authenticator
        stack = ExitStack()
        stack.callback(setattr, self, "_auth", None)
        stack.callback(self._serve_closed_swarm_notice)
        stack.enter_context(self.set_stream_handler(AUTH_PROTOCOL, authenticator.handle))
        stack.enter_context(self.observe(authenticator))
        set_gate(self.host, authenticator.inbound)
        stack.callback(set_gate, self.host, None)
        stack.enter_context(authenticator.attach(self._nursery))  # also greets connections already open
        return Registration(stack.close)

    @property
    def authenticator(self) -> Authenticator | None:
        return self._auth

    def _serve_closed_swarm_notice(self) -> None:
        """Without an authenticator, a closed swarm's Hello is heard (it replaces this handler while installed)."""
        self.set_stream_handler(AUTH_PROTOCOL, self._on_closed_swarm_hello)

    async def _on_closed_swarm_hello(self, stream: INetStream) -> None:
        """A peer of a closed swarm showed us its pass and we have none (no authenticator): say so at
        once. We answer a Hello without a pass, so it refuses us now rather than after its verdict
        timeout; it is remembered (:attr:`closed_swarm`), announced (``ClosedSwarm``), and our own streams
        to it fail at once with :class:`AuthError` instead of one refusal at a time."""
        peer = _remote(stream)
        try:
            with trio.move_on_after(AUTH_NOTICE_TIMEOUT):
                await read_message(stream, auth_pb.Hello, timeout=AUTH_NOTICE_TIMEOUT)
                await write_message(stream, auth_pb.Hello(time_ms=int(time.time() * 1000)))
            await finish_quietly(stream.close)
        except Exception:
            await finish_quietly(stream.reset)
        if peer is not None and peer not in self.closed_swarm:
            self.closed_swarm.add(peer)
            log.info("%s runs a closed swarm; %s", peer, CLOSED_SWARM_HINT)
            self.emit(ev.ClosedSwarm(peer_id=peer))

    @property
    def network(self) -> INetworkService:
        return self.host.get_network()

    def _backoff_delays(self) -> Iterator[float]:
        """Bootstrap's and rejoin's pace: ``initial_backoff`` doubling to ``max_backoff``, each delay up
        to ``backoff_jitter`` of it early."""
        return backoff_delays(self.config.initial_backoff, self.config.max_backoff,
                              jitter=self.config.backoff_jitter, rng=self._jitter)

    async def bootstrap(self) -> None:
        """Reach the initial peers; return once one answers, keep trying the rest.

        Raises :class:`BootstrapError` with the reason per peer when none answers
        within ``config.bootstrap_timeout``.
        """
        targets = [parse_peer_addr(a, what="initial peer") for a in self.config.initial_peers]
        reached = trio.Event()
        last_error: dict[str, str] = {}

        async def keep_trying(addr: Multiaddr, deadline: float) -> None:
            for attempt, delay in enumerate(self._backoff_delays()):
                try:
                    # From the listen port, so the peer observes our NAT mapping (the NAT
                    # layer classifies it from such observations). After three failures,
                    # every other attempt from a fresh port: one 4-tuple can be refused for
                    # good (the peer still holds it in TIME_WAIT from an earlier process
                    # that had our port).
                    await self.connect(
                        addr,
                        timeout=min(self.config.dial_timeout, max(0.1, deadline - trio.current_time())),
                        from_listen_port=attempt < 3 or attempt % 2 == 1,
                        force=True,  # this loop is its own backoff
                    )
                    reached.set()
                    return
                except DialError as e:
                    last_error[str(addr)] = "; ".join(why for _, why in e.attempts) or str(e)
                if trio.current_time() + delay >= deadline:
                    return
                await trio.sleep(delay)

        deadline = trio.current_time() + self.config.bootstrap_timeout
        # In the node's nursery, so that the first answer leaves the other dials running: they were
        # cancelled and started again, and a dial cut off after its TCP handshake left its 4-tuple in
        # TIME_WAIT, so the new one from the listen port met EADDRNOTAVAIL (seen in the NAT lab).
        for addr, _ in targets:
            self._nursery.start_soon(keep_trying, addr, deadline)
        with trio.move_on_at(deadline):
            await reached.wait()
        if not reached.is_set():
            raise BootstrapError(
                f"none of the {len(targets)} initial peers could be reached within "
                f"{self.config.bootstrap_timeout:g}s; check the addresses and that the peers are up",
                [(a, last_error.get(a, "no answer")) for a in map(str, (t[0] for t in targets))],
            )

    # ------------------------------------------------------------------ streams

    async def new_stream(self, peer_id: ID, protocol: str | Sequence[str], *, lazy: bool = True) -> INetStream:
        """Open a stream to a peer (dialing it if needed) speaking ``protocol``.

        One protocol is proposed lazily unless ``lazy`` is False: the proposal goes
        with the first bytes written and the stream is returned at once, so a
        request costs one round trip, not three; a peer that does not speak it
        makes the first read raise :class:`ProtocolNotSupportedError`. Several
        protocols (or ``lazy=False``) are negotiated before the stream is returned,
        in one round trip when the peer takes the first.
        """
        protocols = [protocol] if isinstance(protocol, str) else list(protocol)
        if not protocols:
            raise ValueError("new_stream needs at least one protocol")
        for attempt in range(2):
            if live_connection(self.network, peer_id) is None:
                await self.connect(peer_id)
            if self._auth is not None:
                await self._auth.outbound(peer_id, protocols)
            elif peer_id in self.closed_swarm and not all(p in PRE_AUTH for p in protocols):
                raise AuthError(f"{peer_id} runs a closed swarm; {CLOSED_SWARM_HINT}")
            try:
                return await self._open_stream(peer_id, protocols, lazy=lazy and len(protocols) == 1)
            except SwarmException as e:
                # The connection closed between our look and the swarm's (a peer
                # dropping a duplicate after a hole punch, a relay expiring): dial
                # again once, through our own dialer, rather than fail the caller.
                if attempt == 1:
                    raise StreamOpenError(f"could not open a {' or '.join(protocols)} stream to {peer_id}: {e}") from e
        raise AssertionError("unreachable")

    async def _open_stream(self, peer_id: ID, protocols: list[str], *, lazy: bool) -> INetStream:
        """A stream on the swarm's connection to ``peer_id``, its protocol proposed by
        ``p2p/multistream.py`` (py-libp2p's client spends two round trips on it)."""
        stream = await self.network.new_stream(peer_id)  # SwarmException: new_stream dials again
        if lazy:
            # NetStream reads and writes through its muxed stream: the proposal goes in front of it
            setattr(stream, "muxed_stream", multistream.LazySelect(getattr(stream, "muxed_stream"), protocols[0]))
            stream.set_protocol(TProtocol(protocols[0]))
            return stream
        try:
            with trio.fail_after(NEGOTIATE_TIMEOUT):
                chosen = await multistream.select(stream, protocols)
        except multistream.ProtocolRefused as e:
            await finish_quietly(stream.reset)
            raise ProtocolNotSupportedError(f"{peer_id} does not speak {' or '.join(protocols)}") from e
        except (trio.TooSlowError, DedlocError, OSError, EOFError, StreamError) as e:
            await finish_quietly(stream.reset)
            reason = f"no answer within {NEGOTIATE_TIMEOUT:g} s" if isinstance(e, trio.TooSlowError) else str(e) or type(e).__name__
            raise StreamOpenError(f"could not open a {' or '.join(protocols)} stream to {peer_id}: {reason}") from e
        stream.set_protocol(TProtocol(chosen))
        return stream

    async def new_stream_on(self, conn: INetConn, protocol: str, *, timeout: float = 10.0,
                            lazy: bool = False) -> INetStream:
        """Open a ``protocol`` stream on one particular connection (a dial-back, a punched path).

        ``new_stream`` lets the swarm pick among a peer's connections; protocols that
        test a path need theirs. ``lazy``: as in :meth:`new_stream` (by default the
        protocol is confirmed before the stream is returned).
        """
        if self._auth is not None:
            await self._auth.outbound(conn.muxed_conn.peer_id, [protocol])
        stream = await conn.new_stream()
        if lazy:
            setattr(stream, "muxed_stream", multistream.LazySelect(getattr(stream, "muxed_stream"), protocol))
            stream.set_protocol(TProtocol(protocol))
            return stream
        try:
            with trio.fail_after(timeout):
                await multistream.select(stream, [protocol])
        except Exception as e:
            await finish_quietly(stream.reset)
            raise StreamOpenError(f"could not open a {protocol} stream on {remote_addr(conn)}: {e}") from e
        stream.set_protocol(TProtocol(protocol))
        return stream

    def set_stream_handler(self, protocol: str, handler: StreamHandler, *, hands_on: bool = False) -> Registration:
        """Serve ``protocol`` until the handle is removed; a handler that fails resets its stream and nothing else.

        A handler that returns leaving its stream open has it closed (its answer then ends with a
        FIN): the resource manager gives the stream back when the handler returns, so one left open
        would be a stream the peer holds that no limit counts. ``hands_on``: the handler passes its
        stream on to live past it (relay v2's STOP, whose stream becomes a connection), and it stays.
        """

        async def guarded(stream: INetStream) -> None:
            # the stream was acquired from the resource manager while it was negotiated
            # (p2p/libp2p_host._Multiselect), and is given back when this returns
            try:
                await handler(stream)
            except Exception as e:
                log.warning("handler for %s failed: %r", protocol, e)
                self.emit(ev.Error(message=f"handler for {protocol} failed: {e!r}", peer_id=_remote(stream)))
                await finish_quietly(stream.reset)
                return
            if not hands_on and await left_open(stream):
                log.debug("the handler for %s returned leaving its stream open: closed", protocol)
                await finish_quietly(stream.close)

        self.host.set_stream_handler(TProtocol(protocol), guarded)
        self._push_wanted.set()  # a protocol served anew: pushed to the connected peers

        def undo() -> None:
            handlers = self.host.get_mux().handlers  # remove ours only, not a later replacement
            if handlers.get(TProtocol(protocol)) is guarded:
                self.host.remove_stream_handler(TProtocol(protocol))
                self._push_wanted.set()

        return Registration(undo)

    # ------------------------------------------------------------------ ping / identify

    async def ping(self, peer_id: ID, *, timeout: float = 10.0) -> float:
        """Round-trip time to a peer in seconds, over the libp2p ping protocol."""
        try:
            return await self._ping(peer_id, timeout)
        except trio.TooSlowError:
            raise DedlocError(f"{peer_id} did not answer a ping within {timeout:g} s") from None
        except StreamError as e:
            raise DedlocError(f"the ping stream to {peer_id} failed: {e}") from e

    async def _ping(self, peer_id: ID, timeout: float) -> float:
        with trio.fail_after(timeout):
            stream = await self.new_stream(peer_id, PING_PROTOCOL)
            try:
                payload = secrets.token_bytes(PING_SIZE)
                started = time.perf_counter()
                await stream.write(payload)
                echo = b""
                while len(echo) < PING_SIZE:
                    chunk = await stream.read(PING_SIZE - len(echo))
                    if not chunk:
                        raise DialError(f"{peer_id} closed the ping stream")
                    echo += chunk
                rtt = time.perf_counter() - started
                kind = self._path_of(stream)
            finally:
                await finish_quietly(stream.close)
        if echo != payload:
            raise DedlocError(f"{peer_id} answered ping with other bytes")
        self.emit(ev.Ping(peer_id=peer_id, rtt_ms=rtt * 1e3, kind=kind))
        return rtt

    def _path_of(self, stream: INetStream) -> PathKind | None:
        """Whether a stream runs on a direct or a relayed connection (None: its connection is gone)."""
        muxed = getattr(stream, "muxed_conn", None)
        peer = _remote(stream)
        if muxed is None or peer is None:
            return None
        conn = next((c for c in self.network.get_connections(peer) if getattr(c, "muxed_conn", None) is muxed), None)
        return None if conn is None else _connection_info(conn).kind

    async def identify(self, peer_id: ID, *, timeout: float = 10.0) -> PeerIdentity:
        """Ask a peer who it is; see :class:`p2p.identify.PeerIdentity` for the verdicts."""
        if live_connection(self.network, peer_id) is None:
            await self.connect(peer_id)
        info = await identify(self.new_stream, peer_id, timeout=timeout)
        if info.observed_addr is not None:
            self._observed.add(info.observed_addr, peer_id)
        if info.public_key_valid and info.listen_addrs:
            # What it says it listens on (relayed addresses included): how to reach it again.
            self.add_addrs(peer_id, info.listen_addrs[:MAX_LISTEN_ADDRS])
        return info

    # ------------------------------------------------------------------ events

    @asynccontextmanager
    async def events(self) -> AsyncIterator[trio.MemoryReceiveChannel[ev.Event]]:
        """Subscribe to this node's events for the duration of the block.

        A slow subscriber loses events (counted, never blocking the node).
        """
        send, receive = trio.open_memory_channel[ev.Event](EVENT_BUFFER)
        sub = _Subscriber(send)
        self._subscribers.append(sub)
        try:
            async with receive:
                yield receive
        finally:
            self._subscribers.remove(sub)
            send.close()

    def emit(self, event: ev.Event) -> None:
        """Publish an event to every subscriber (services built on the node use it too)."""
        for sub in self._subscribers:
            try:
                sub.send.send_nowait(event)
            except trio.WouldBlock:
                sub.dropped += 1
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass


def _connection_info(conn: INetConn) -> ConnectionInfo:
    addr = remote_addr(conn)
    muxed = conn.muxed_conn
    initiator = getattr(muxed, "is_initiator", None)
    direction = Direction.UNKNOWN if initiator is None else Direction.OUTBOUND if initiator else Direction.INBOUND
    trimmed = GO_AWAY_GARBAGE_COLLECTED in (getattr(muxed, "local_go_away", None), getattr(muxed, "remote_go_away", None))
    return ConnectionInfo(peer_id=muxed.peer_id, addr=addr, direction=direction,
                          kind=PathKind.RELAYED if is_relayed(addr) else PathKind.DIRECT, conn=conn, trimmed=trimmed)


def _streams_at_work(conn: INetConn) -> int:
    """``conn``'s streams other than RPC's (whose calls under way the RPC endpoint counts, and whose
    pooled streams wait idle for the next); one still negotiating its protocol counts."""
    return sum(1 for stream in conn.get_streams() if stream.get_protocol() != RPC_PROTOCOL)


def _value_of(valuer: Callable[[ID], int], peer: ID) -> int:
    """``valuer(peer)``; one that fails counts 0 (logged): a service's bug must not stop the trimming."""
    try:
        return valuer(peer)
    except Exception:
        log.exception("a connection valuer failed for %s; counting 0", peer)
        return 0


def _remote(stream: INetStream) -> ID | None:
    try:
        return stream.muxed_conn.peer_id
    except Exception:
        return None


def _expand_unspecified(addr: Multiaddr) -> list[Multiaddr]:
    """0.0.0.0 / :: listen addresses stand for every local address of that family (none when the host
    has none of that family: the unspecified address itself is no address to give a peer)."""
    if not is_unspecified(addr):
        return [addr]
    items = list(addr.items())
    family6 = items[0][0].name == "ip6"
    rest = "".join(f"/{p.name}/{v}" if v is not None else f"/{p.name}" for p, v in items[1:])
    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if family6 and isinstance(ip.ip, tuple):
                if ip.ip[2]:  # link-local with scope id: not dialable without it
                    continue
                out.append(Multiaddr(f"/ip6/{ip.ip[0]}{rest}"))
            elif not family6 and isinstance(ip.ip, str):
                out.append(Multiaddr(f"/ip4/{ip.ip}{rest}"))
    return out
