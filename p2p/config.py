"""Settings of a node, with defaults that suit a volunteer's home machine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .addresses import is_unspecified, parse_multiaddr, parse_peer_addr
from .conn_manager import ConnManagerConfig
from .dial_backoff import BackoffConfig
from .errors import ConfigError
from .noise import NoiseConfig
from .peer_store import KNOWN_PEERS
from .resources import ResourceConfig
from .yamux import YamuxConfig


@dataclass
class NodeConfig:
    """Everything :meth:`p2p.Node.open` needs; validated by :meth:`validate`.

    ``identity_path`` None means a throwaway identity (tests, demos); the CLI
    passes a persistent one so that a peer keeps its id across restarts.
    """

    identity_path: Path | None = None
    #: Empty: no direct inbound connection at all. The node still dials out, and the NAT layer
    #: makes it reachable through relays, like a peer behind a NAT that maps nothing (go-libp2p's
    #: ``NoListenAddrs``; ``dedloc peer --no-listen``).
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"])
    #: Addresses to advertise instead of the listen addresses (e.g. a relay's public IP).
    announce: list[str] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)
    #: Total time to reach at least one initial peer before :class:`BootstrapError`.
    bootstrap_timeout: float = 30.0
    #: First retry delay for an unreachable initial peer; doubles up to ``max_backoff``.
    initial_backoff: float = 0.5
    max_backoff: float = 8.0
    #: Each of those delays comes up to this fraction of it early, at random per peer: peers cut
    #: off together (a relay's restart) otherwise dial back in lockstep, every handshake at once.
    backoff_jitter: float = 0.5
    #: Time for one dial of one peer (all its addresses together).
    dial_timeout: float = 10.0
    #: Head start each address gets before the next one is tried in parallel.
    dial_stagger: float = 0.25
    #: The head start of a private or loopback address: a LAN answers within it, and one that
    #: is not ours (a NATed peer advertises its LAN address too) must not hold back the next,
    #: its relayed address, for the whole stagger (bench: the NAT matrix's relayed connection).
    dial_stagger_local: float = 0.05
    #: How long an address whose dial failed is left alone (``p2p/dial_backoff.py``: go-libp2p's
    #: per-address swarm backoff, 5 s growing to 5 min); bootstrapping and rejoining keep their own pace.
    dial_backoff: BackoffConfig = field(default_factory=BackoffConfig)
    #: Largest single RPC message, in bytes; larger ones are refused before buffering.
    max_message_size: int = 4 * 1024 * 1024
    #: Deadline of RPC calls that set none.
    rpc_timeout: float = 30.0
    #: Stream multiplexing limits: windows, write timeout, keepalive, stream caps.
    yamux: YamuxConfig = field(default_factory=YamuxConfig)
    #: Where connections seal and open their bytes: the event loop, or worker threads on a host with cores to spare.
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    #: Every limit on what peers may take (``p2p/resources.py``): admission before the handshake,
    #: connections, streams and bytes in flight per peer and in all, request rates per service.
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    #: How many connections to keep, and which to close beyond that (``p2p/conn_manager.py``:
    #: go-libp2p's connection manager, 160/192 by default).
    connections: ConnManagerConfig = field(default_factory=ConnManagerConfig)
    #: Peers the peer store remembers besides ourselves and the connected (``p2p/peer_store.py``:
    #: past it, those without an address, expired, or least recently heard of are forgotten).
    known_peers: int = KNOWN_PEERS

    def validate(self) -> None:
        if not self.listen and self.announce:
            raise ConfigError("announce given but no listen address: nothing would answer at the announced address")
        for a in self.listen:
            addr = parse_multiaddr(a, what="listen address")
            names = [p.name for p in addr.protocols()]
            if names[:1] not in (["ip4"], ["ip6"]) or names[1:] != ["tcp"]:
                raise ConfigError(
                    f"listen address {addr} is not supported: use /ip4/<ip>/tcp/<port> "
                    "or /ip6/<ip>/tcp/<port>"
                )
        for a in self.announce:
            if is_unspecified(parse_multiaddr(a, what="announce address")):
                raise ConfigError(f"announce address {a} is unspecified (0.0.0.0 or ::): nobody can dial it; "
                                  "announce the address peers reach this node at (its public IP)")
        for a in self.initial_peers:
            parse_peer_addr(a, what="initial peer")
        for name in ("bootstrap_timeout", "dial_timeout", "rpc_timeout", "initial_backoff", "max_backoff"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.backoff_jitter < 1:
            raise ConfigError(f"backoff_jitter must be in [0, 1), got {self.backoff_jitter}")
        if self.dial_stagger < 0 or self.dial_stagger_local < 0:
            raise ConfigError(f"dial_stagger and dial_stagger_local must be >= 0, got {self.dial_stagger} "
                              f"and {self.dial_stagger_local}")
        self.dial_backoff.validate()
        self.yamux.validate()
        self.noise.validate()
        self.resources.validate()
        self.connections.validate()
        if self.known_peers < 10:
            raise ConfigError(f"known_peers must be at least 10, got {self.known_peers}")
        if self.max_message_size < 1024:
            raise ConfigError(f"max_message_size must be at least 1024 bytes, got {self.max_message_size}")
