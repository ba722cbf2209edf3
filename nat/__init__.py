"""NAT traversal, and the composed network object: :class:`Peer`.

``async with Peer.open(PeerConfig.peer([...])) as peer`` runs a Node with AutoNAT
v2, circuit relay v2 (client, and service on relays), autorelay, DCUtR hole
punching, port mapping, peer exchange and the DHT, in the right order. Built on
:mod:`p2p` (and only on it). The layers above reach it through :class:`Swarm`,
the narrow interface that :class:`Peer` implements.
"""

from typing import TYPE_CHECKING

from p2p.lazy import exports

if TYPE_CHECKING:
    from .peer import Peer, PeerConfig
    from .reachability import MappingKind, NatMode
    from .swarm import Records, Swarm
    from .traversal import NatConfig, NatService

__all__ = ["MappingKind", "NatConfig", "NatMode", "NatService", "Peer", "PeerConfig", "Records", "Swarm"]

__getattr__, __dir__ = exports(__name__, {
    "Peer": ".peer",
    "PeerConfig": ".peer",
    "MappingKind": ".reachability",
    "NatMode": ".reachability",
    "Records": ".swarm",
    "Swarm": ".swarm",
    "NatConfig": ".traversal",
    "NatService": ".traversal",
})
