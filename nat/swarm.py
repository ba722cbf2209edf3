"""The one narrow interface through which the upper layers reach the swarm.

Averaging and training need little of the network: who we are and where we are
reached, the RPC endpoint, stream handlers and new streams, the addresses of a
peer learnt from a protocol, our reachability (to pick a role), events, which
peers to keep connected, and the DHT's get and store. :class:`Swarm` says exactly that much, as a
:class:`typing.Protocol`: :class:`nat.Peer` implements it over the real
network, and an in-memory fake can too (``tests/fake_swarm.py`` runs
matchmaking, all-reduce and training over one, without a socket). The upper
layers take a ``Swarm``; only their commands, which start a network, take the
whole :class:`nat.Peer`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from libp2p.abc import INetStream
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.dht.records import KeyLike, ValueWithExpiration
from p2p.events import Event
from p2p.hooks import ExternalAddresses, Registration, SwarmObserver
from p2p.node import StreamHandler
from p2p.rpc import Rpc


class Records(Protocol):
    """The DHT as the upper layers use it (:class:`p2p.dht.DHT` is one)."""

    async def get(self, key: KeyLike, latest: bool = False, *,
                  timeout: float | None = None) -> ValueWithExpiration | None: ...

    async def store(self, key: KeyLike, value: bytes, expiration: float, subkey: KeyLike | None = None,
                    *, timeout: float | None = None) -> bool: ...

    async def get_many(self, keys: Iterable[KeyLike], latest: bool = False, *,
                       timeout: float | None = None) -> dict[KeyLike, ValueWithExpiration | None]: ...


@runtime_checkable
class Swarm(Protocol):
    """What averaging and training use of the network (see the module docstring)."""

    @property
    def peer_id(self) -> ID: ...

    @property
    def addrs(self) -> list[Multiaddr]:
        """Where others reach us, best first."""
        ...

    @property
    def dht(self) -> Records: ...

    @property
    def rpc(self) -> Rpc: ...

    @property
    def external(self) -> ExternalAddresses:
        """Our reachability as the NAT layer judged it."""
        ...

    async def new_stream(self, peer_id: ID, protocol: str) -> INetStream:
        """A stream to ``peer_id`` speaking ``protocol`` (dialing, through a relay if need be)."""
        ...

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> Registration: ...

    def add_addrs(self, peer_id: ID, addrs: Sequence[Multiaddr]) -> None:
        """Remember where a peer is reached (learnt from a protocol: a declaration, a report)."""
        ...

    def observe(self, observer: SwarmObserver) -> Registration: ...

    def protect(self, peer_id: ID, tag: str) -> Registration:
        """Keep the connections to ``peer_id`` open until the handle is removed (the connection
        manager closes others' beyond its high water: ``p2p/conn_manager.py``)."""
        ...

    def emit(self, event: Event) -> None: ...


__all__ = ["Records", "Swarm"]
