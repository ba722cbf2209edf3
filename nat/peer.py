"""One object for the whole network layer: ``async with Peer.open(config) as peer``.

A volunteer's machine, a public relay and an app that embeds dedloc all need
the same start-up order, and getting it wrong is silent (a DHT opened before
the NAT layer sees no reachability; a bootstrap before the NAT layer loses the
observations of our mapping). :class:`Peer` does it once:

1. the :class:`p2p.Node` (listening, not yet dialing);
2. :class:`nat.traversal.NatService` (AutoNAT, relay client and service,
   autorelay, hole punching, port mapping), so it sees the first connections;
3. bootstrap to the initial peers, from the listen port;
4. peer exchange (serving, and meeting peers when asked to);
5. the DHT, which serves once the NAT layer judged us reachable (``auto``);
6. relay discovery over the DHT (``nat/relay_discovery.py``): a relay advertises
   itself there, and autorelay looks there when its connections offer too few.

and closes them in reverse. Layers above (the averager, the collaborative
optimizer) take it as their argument, as hivemind's take its DHT, through the
narrow interface it implements (:class:`nat.swarm.Swarm`: RPC, stream handlers,
new streams, addresses, reachability, events, the DHT's get and store).
Presets cover the roles people run: :meth:`PeerConfig.relay`,
:meth:`PeerConfig.peer` and :meth:`PeerConfig.client`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import Node, NodeConfig
from p2p.addresses import is_relayed
from p2p.dht import DHT, DHTConfig
from p2p.dht.events import DHTMode
from p2p.errors import ConfigError, DedlocError
from p2p.auth import ISSUE_PROTOCOL, AuthConfig, AuthError, Authenticator, pass_expiration
from p2p.authority import DEFAULT_LIFETIME, Authority, request_pass
from p2p.events import Event
from p2p.hooks import ExternalAddresses, Metrics, Reachability, Registration, SwarmObserver
from p2p.node import StreamHandler
from p2p.peer_exchange import PeerExchange
from p2p.proto import auth_pb2 as pb
from p2p.rpc import Rpc
from p2p.trio_util import start_cancellable

from .autorelay import AutoRelayConfig
from .port_mapping import PortMappingConfig
from .relay import RelayConfig
from .relay_discovery import advertise_once, find_relays
from .traversal import NatConfig, NatService

log = logging.getLogger(__name__)

#: Where a public relay listens: the port people write into their configs.
RELAY_LISTEN = ["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001"]
#: Where a volunteer listens: any port (the NAT layer finds out how others reach it).
PEER_LISTEN = ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"]
#: An outbound-only client listens only so that the swarm's machinery has a socket; nobody dials it.
CLIENT_LISTEN = ["/ip4/0.0.0.0/tcp/0"]


@dataclass
class AuthSettings:
    """How this peer takes part in an authenticated run: the authority it trusts, and either the
    authority's files (it *is* the authority: it signs its own pass and everyone's) or a user's
    name and secret to ask for passes with."""

    #: The authority's Ed25519 public key (hex in the command line's ``--authority``).
    authority: bytes | None = None
    username: str | None = None
    secret: bytes | None = None
    #: Where passes are issued (a full multiaddr); default: the first initial peer.
    server: str | None = None
    #: This node serves the authority from these files (``dedloc authority``).
    authority_dir: Path | None = None
    lifetime: float = DEFAULT_LIFETIME
    recheck_interval: float = 5.0

    def validate(self, initial_peers: Sequence[str]) -> None:
        if self.authority_dir is not None:
            return
        if self.authority is None or len(self.authority) != 32:
            raise ConfigError("an authenticated run needs the authority's key (--authority: 64 hex digits)")
        if not self.username or self.secret is None:
            raise ConfigError("an authenticated run needs --username and --secret-file (from `dedloc authority add`)")
        if self.server is None and not initial_peers:
            raise ConfigError("where are passes issued? give --auth-server or an initial peer")


@dataclass
class PeerConfig:
    """Every layer's settings in one object; the defaults are a volunteer's (``dedloc peer``)."""

    node: NodeConfig = field(default_factory=lambda: NodeConfig(listen=list(PEER_LISTEN)))
    nat: NatConfig = field(default_factory=NatConfig)
    #: None: no DHT (a bare relay for a private swarm, say).
    dht: DHTConfig | None = field(default_factory=DHTConfig)
    #: Meet the peers our peers know every this many seconds (None: only answer others).
    exchange_interval: float | None = 5.0
    #: Sent to every peer met (the demo's chatter).
    greeting: str | None = None
    #: A closed run (``p2p/auth.py``): None, an open swarm.
    auth: AuthSettings | None = None

    def validate(self) -> None:
        self.node.validate()
        self.nat.validate()
        if self.auth is not None:
            self.auth.validate(self.node.initial_peers)
        if self.dht is not None:
            self.dht.validate()
        if self.exchange_interval is not None and self.exchange_interval <= 0:
            raise ConfigError(f"exchange_interval must be positive, got {self.exchange_interval}")

    @classmethod
    def peer(cls, initial_peers: Sequence[str], *, identity_path: Path | None = None,
             listen: Sequence[str] = PEER_LISTEN, bootstrap_timeout: float = 30.0) -> PeerConfig:
        """A volunteer: joins through ``initial_peers``, finds out its reachability, reserves relay
        slots and punches holes when behind NAT, serves the DHT once reachable."""
        return cls(
            node=NodeConfig(identity_path=identity_path, listen=list(listen), initial_peers=list(initial_peers),
                            bootstrap_timeout=bootstrap_timeout),
            dht=DHTConfig(mode=DHTMode.AUTO, bootstrap_timeout=bootstrap_timeout),
        )

    @classmethod
    def relay(cls, *, identity_path: Path | None = None, listen: Sequence[str] = RELAY_LISTEN,
              announce: Sequence[str] = (), initial_peers: Sequence[str] = (),
              limits: RelayConfig | None = None) -> PeerConfig:
        """A public relay and bootstrap node: circuit relay v2 with ``limits``, AutoNAT server, DHT server
        from the start, no relay slots of its own."""
        return cls(
            node=NodeConfig(identity_path=identity_path, listen=list(listen), announce=list(announce),
                            initial_peers=list(initial_peers)),
            nat=NatConfig(relay_service=True, relay=limits or RelayConfig(),
                          autorelay=AutoRelayConfig(enabled=False)),
            dht=DHTConfig(mode=DHTMode.SERVER),
            exchange_interval=None,
        )

    @classmethod
    def loopback(cls, *, relay: bool = False, initial_peers: Sequence[str] = (), listen: str = "/ip4/127.0.0.1/tcp/0",
                 dht: DHTMode | None = None, exchange: bool = True, bootstrap_timeout: float = 10.0,
                 **nat: Any) -> PeerConfig:
        """A swarm on one machine (tests, benchmarks, the demo's loopback mode) or in a lab's network
        namespaces (``listen`` on ``/ip4/0.0.0.0/tcp/0`` there): private addresses count as reachable,
        no router is asked. ``relay``: the swarm's relay and DHT bootstrap; ``dht``: the DHT's mode
        (a server for the relay, AUTO for the others); ``exchange``: meet peers' peers every second
        (never for the relay). ``nat``: further :class:`NatConfig` settings, over these."""
        settings: dict[str, Any] = {"allow_private": True, "port_mapping": PortMappingConfig(enabled=False),
                                    "relay_service": relay, "autorelay": AutoRelayConfig(enabled=not relay)}
        return cls(
            node=NodeConfig(listen=[listen], initial_peers=list(initial_peers), bootstrap_timeout=bootstrap_timeout,
                            dial_timeout=5.0),
            nat=NatConfig(**{**settings, **nat}),
            dht=DHTConfig(mode=dht or (DHTMode.SERVER if relay else DHTMode.AUTO), bootstrap_timeout=bootstrap_timeout),
            exchange_interval=1.0 if exchange and not relay else None,
        )

    @classmethod
    def client(cls, initial_peers: Sequence[str], *, timeout: float = 30.0) -> PeerConfig:
        """Outbound only (a script, a monitor, a peer behind a firewall it cannot change): no relay slots,
        no port mapping, no AutoNAT service, a DHT client; it can still dial peers through relays."""
        return cls(
            node=NodeConfig(listen=list(CLIENT_LISTEN), initial_peers=list(initial_peers),
                            bootstrap_timeout=timeout, dial_timeout=min(10.0, timeout)),
            nat=NatConfig(autonat_server=False, autorelay=AutoRelayConfig(enabled=False),
                          port_mapping=PortMappingConfig(enabled=False)),
            dht=DHTConfig(mode=DHTMode.CLIENT, bootstrap_timeout=timeout),
            exchange_interval=None,
        )


class Peer:
    """A running member of the swarm: its Node, NAT layer, peer exchange and DHT. Open it with :meth:`open`."""

    def __init__(self, node: Node, nat: NatService, exchange: PeerExchange, dht: DHT | None) -> None:
        self.node = node
        self.nat = nat
        self.exchange = exchange
        self._dht = dht

    @classmethod
    @asynccontextmanager
    async def open(cls, config: PeerConfig | None = None, *,
                   on_listening: Callable[[Node], None] | None = None) -> AsyncIterator[Peer]:
        """Start every layer in order, and stop them all, in reverse, when the block ends.

        ``on_listening`` is called with the Node once it listens, before anything
        dials: subscribe to its events there to follow start-up (the CLI does).

        Raises :class:`p2p.ConfigError` for unusable settings, :class:`p2p.BootstrapError`
        when no initial peer answered, and :class:`p2p.dht.DHTBootstrapError` when none
        of them runs a DHT server.
        """
        config = config or PeerConfig()
        config.validate()
        async with AsyncExitStack() as stack:
            node = await stack.enter_async_context(Node.open(config.node, bootstrap=False))
            if on_listening is not None:
                on_listening(node)
            nat = await stack.enter_async_context(NatService.attach(node, config.nat))
            if config.auth is not None:
                nursery = await stack.enter_async_context(trio.open_nursery())
                stack.callback(nursery.cancel_scope.cancel)
                stack.enter_context(await _authenticate(node, config.auth, config.node.initial_peers, nursery))
            if config.node.initial_peers:
                await node.bootstrap()
            exchange = await stack.enter_async_context(
                PeerExchange.open(node, greeting=config.greeting, interval=config.exchange_interval))
            dht = None if config.dht is None else await stack.enter_async_context(DHT.open(node, config.dht))
            peer = cls(node, nat, exchange, dht)
            discovery = config.nat.relay_discovery
            if dht is not None:
                nursery = await stack.enter_async_context(trio.open_nursery())
                stack.callback(nursery.cancel_scope.cancel)  # runs first on the way out
                if discovery.lookup and nat.config.autorelay.enabled:
                    nat.autorelay.use_peer_source(lambda exclude: find_relays(dht, exclude=exclude))
                    stack.callback(nat.autorelay.use_peer_source, None)
                if discovery.advertise and nat.relay_service is not None:
                    nursery.start_soon(peer._advertise_relay, discovery.ttl)
            yield peer

    @property
    def authenticator(self) -> Authenticator | None:
        """An authenticated run's gate and passes (None in an open swarm)."""
        return self.node.authenticator

    async def _advertise_relay(self, ttl: float) -> None:
        """Keep our relay record in the DHT while we have a direct address AutoNAT did not refute."""
        while True:
            addrs = [a for a in self.node.addrs if not is_relayed(a)]
            stored = False
            if addrs and self.nat.reachability != Reachability.PRIVATE:
                try:
                    stored = await advertise_once(self.dht, addrs, ttl)
                except DedlocError as e:
                    log.info("relay advertisement not stored: %s", e)
            await trio.sleep(ttl / 3 if stored else min(5.0, ttl / 3))

    @property
    def dht(self) -> DHT:
        """The DHT (:class:`p2p.ConfigError` if this peer was opened without one)."""
        if self._dht is None:
            raise ConfigError("this peer runs no DHT (PeerConfig.dht is None)")
        return self._dht

    @property
    def peer_id(self) -> ID:
        return self.node.peer_id

    @property
    def addrs(self) -> list[Multiaddr]:
        """Where others reach us, best first: confirmed direct addresses, then relayed ones."""
        return self.node.addrs

    # ---------------------------------------------------------------- the Swarm interface (nat/swarm.py)

    @property
    def rpc(self) -> Rpc:
        return self.node.rpc

    @property
    def external(self) -> ExternalAddresses:
        return self.node.external

    async def new_stream(self, peer_id: ID, protocol: str) -> INetStream:
        return await self.node.new_stream(peer_id, protocol)

    def set_stream_handler(self, protocol: str, handler: StreamHandler, *, hands_on: bool = False) -> Registration:
        return self.node.set_stream_handler(protocol, handler, hands_on=hands_on)

    def add_addrs(self, peer_id: ID, addrs: Sequence[Multiaddr]) -> None:
        self.node.add_addrs(peer_id, addrs)

    def observe(self, observer: SwarmObserver) -> Registration:
        return self.node.observe(observer)

    def protect(self, peer_id: ID, tag: str) -> Registration:
        return self.node.protect(peer_id, tag)

    def emit(self, event: Event) -> None:
        self.node.emit(event)

    # ---------------------------------------------------------------- beyond the Swarm interface

    @property
    def public_key(self) -> bytes:
        """Our identity's public key, libp2p's protobuf encoding (what signatures are checked against)."""
        return bytes(self.node.key_pair.public_key.serialize())

    def sign(self, data: bytes) -> bytes:
        """``data`` signed with our identity key (Ed25519): an app's own signed objects (datasets' entries)
        carry it with :attr:`public_key`, and anyone checks them against our peer id."""
        return bytes(self.node.key_pair.private_key.sign(data))

    def path_to(self, peer_id: ID) -> str:
        """``direct``, ``relayed`` or ``none``: how we are connected to ``peer_id`` now."""
        return self.node.path_to(peer_id)

    def metrics(self) -> Metrics:
        """Every layer's metrics in the one flat shape: the NAT funnel, what peers take of this node
        under ``resources.`` (admission, streams, bytes in flight, the relay's slots, refusals by
        scope and reason) and the limits under ``limits.``, then the DHT's under ``dht.``."""
        out: Metrics = {"peer_id": str(self.node.peer_id), "peers": len(self.node.connected_peers()), **self.nat.metrics()}
        out.update({f"resources.{k}": v for k, v in self.node.resources.usage().items()})
        out.update({f"limits.{k}": v for k, v in self.node.resources.limits().items()})
        out.update({f"connections.{k}": v for k, v in self.node.connection_metrics().items()})
        out.update({f"peer_store.{k}": v for k, v in self.node.peer_store_metrics().items()})
        if self._dht is not None:
            out.update({f"dht.{k}": v for k, v in self._dht.metrics().items()})
        return out


async def _authenticate(node: Node, settings: AuthSettings, initial_peers: Sequence[str],
                        nursery: trio.Nursery) -> Registration:
    """Get our pass (sign it, as the authority; else ask the authority's node), install the
    authenticator, and keep the pass renewed (at two thirds of its life) in ``nursery``."""
    authority: Authority | None = None
    if settings.authority_dir is not None:
        authority = Authority.from_dir(settings.authority_dir, lifetime=settings.lifetime)
        authority.allow = lambda peer: node.resources.allow("auth.issue", peer, trio.current_time())
        key = authority.public_key
        username = "authority"
    else:
        assert settings.authority is not None and settings.username is not None and settings.secret is not None
        key, username = settings.authority, settings.username
    server = settings.server or (initial_peers[0] if initial_peers else None)

    async def fetch() -> pb.AccessPass:
        if authority is not None:
            return authority.sign(username, node.peer_id, time.time())
        assert server is not None and settings.secret is not None
        peer_id = await node.connect(server, from_listen_port=True)
        return await request_pass(node, peer_id, username, settings.secret)

    try:
        first = await fetch()
    except (AuthError, DedlocError, trio.TooSlowError) as e:
        raise AuthError(f"could not get an access pass from {server}: {e}") from e
    config = AuthConfig(authority=key, recheck_interval=settings.recheck_interval,
                        revoked=authority.check.revoked() if authority is not None else frozenset())
    authenticator = Authenticator(node, config, first)
    stack = ExitStack()
    stack.enter_context(node.authenticate(authenticator))
    if authority is not None:
        stack.enter_context(node.set_stream_handler(ISSUE_PROTOCOL, authority.handle))

    async def renew() -> None:
        while True:
            expiration = pass_expiration(authenticator.my_pass)
            await trio.sleep(max(1.0, (expiration - time.time()) * 2 / 3))
            try:
                await authenticator.renew(await fetch())
            except (AuthError, DedlocError, trio.TooSlowError) as e:
                log.error("could not renew our access pass (it expires in %.0f s): %s", expiration - time.time(), e)
                await trio.sleep(10.0)
            if authority is not None:
                authenticator.revoke(authority.check.revoked())

    stack.callback(start_cancellable(nursery, renew).cancel)
    return Registration(stack.close)


__all__ = ["AuthSettings", "CLIENT_LISTEN", "PEER_LISTEN", "Peer", "PeerConfig", "RELAY_LISTEN"]
