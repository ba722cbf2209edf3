"""dedloc's network layer: a trio-native libp2p Node that apps embed.

Start here::

    from p2p import Node, NodeConfig

    async with Node.open(NodeConfig(initial_peers=[...])) as node:
        peer = await node.connect("/ip4/203.0.113.7/tcp/4001/p2p/12D3Koo...")
        print(await node.ping(peer))
"""

from typing import TYPE_CHECKING

from .lazy import exports

if TYPE_CHECKING:
    from .addresses import parse_multiaddr, parse_peer_addr, rank_for_dial
    from .config import NodeConfig
    from .errors import AddressError, BootstrapError, ConfigError, DedlocError, DialBackoffError, DialError, IdentityError
    from .identify import PeerIdentity
    from .node import Node

__all__ = [
    "AddressError",
    "BootstrapError",
    "ConfigError",
    "DedlocError",
    "DialBackoffError",
    "DialError",
    "IdentityError",
    "Node",
    "NodeConfig",
    "PeerIdentity",
    "parse_multiaddr",
    "parse_peer_addr",
    "rank_for_dial",
]

__getattr__, __dir__ = exports(__name__, {
    "parse_multiaddr": ".addresses",
    "parse_peer_addr": ".addresses",
    "rank_for_dial": ".addresses",
    "NodeConfig": ".config",
    "AddressError": ".errors",
    "BootstrapError": ".errors",
    "ConfigError": ".errors",
    "DedlocError": ".errors",
    "DialBackoffError": ".errors",
    "DialError": ".errors",
    "IdentityError": ".errors",
    "PeerIdentity": ".identify",
    "Node": ".node",
})
