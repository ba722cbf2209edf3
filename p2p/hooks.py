"""How services built on a Node hear the swarm: typed, lossless callbacks with handles.

``Node.events()`` is for observers (the CLI, monitoring): a bounded stream
that drops what a slow reader cannot take. Services (NAT traversal, the DHT,
averaging) must not miss a connection or a change of reachability, and must
not parse event strings back, so they register a :class:`SwarmObserver`
instead (rust-libp2p's swarm likewise tells every behaviour about every
connection). Callbacks are synchronous and are called for every change, in
order; one that has I/O to do starts a task in its own service's nursery.

Every registration (an observer, a stream handler, a circuit dialer) returns
a :class:`Registration`: a handle that undoes it, usable as a context manager,
so a service removes what it installed when its block ends.

The Node owns our external view of ourselves (:class:`ExternalAddresses`):
reachability, the addresses a dial-back confirmed or refuted, our relayed
addresses. The NAT layer judges them and tells the Node; everyone else reads
them from the Node and hears one notification when they change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # annotations only: the command line imports these enums without py-libp2p (p2p/lazy.py)
    from libp2p.abc import INetConn
    from libp2p.peer.id import ID
    from multiaddr import Multiaddr

log = logging.getLogger(__name__)
O = TypeVar("O")


class Reachability(StrEnum):
    """Whether others can dial us: ``public`` once a dial-back confirmed an address."""

    PUBLIC = "public"
    PRIVATE = "private"
    UNKNOWN = "unknown"


class Direction(StrEnum):
    INBOUND = "inbound"
    OUTBOUND = "outbound"
    UNKNOWN = "unknown"


class PathKind(StrEnum):
    """A connection's path: straight to the peer, or through a relay (``/p2p-circuit``)."""

    DIRECT = "direct"
    RELAYED = "relayed"


@dataclass(frozen=True)
class ConnectionInfo:
    """One connection opened or closed, as observers are told of it."""

    peer_id: ID
    addr: Multiaddr
    direction: Direction
    kind: PathKind
    conn: INetConn = field(compare=False, repr=False)
    #: (closed ones) a connection manager closed it, ours or the peer's (yamux GoAway 0x1005): the
    #: peer is alive, not worth dialing back to check (``p2p/conn_manager.py``)
    trimmed: bool = False


@dataclass(frozen=True)
class ExternalAddresses:
    """How others can reach us, as judged by the NAT layer (or taken on trust without one).

    ``judged`` is False while nothing on this node checks reachability (a bare
    Node): then ``reachability`` is ``unknown`` and services take their
    configuration at its word (a DHT in ``auto`` mode serves).
    """

    reachability: Reachability = Reachability.UNKNOWN
    #: Addresses a nonce-verified dial-back reached (advertised even when only others see them).
    confirmed: tuple[Multiaddr, ...] = ()
    #: Addresses enough servers failed to reach (withdrawn even if they are our interface's).
    refuted: tuple[Multiaddr, ...] = ()
    #: Our ``/p2p-circuit`` addresses through relays holding a slot for us.
    relayed: tuple[Multiaddr, ...] = ()
    judged: bool = False


class SwarmObserver:
    """Override what you need; every method is called for every change, in order, and must not block."""

    def connection_opened(self, info: ConnectionInfo) -> None:
        """A connection (direct or relayed, either direction) is up and muxed."""

    def connection_closed(self, info: ConnectionInfo) -> None:
        """A connection went away."""

    def external_changed(self, external: ExternalAddresses) -> None:
        """Reachability or our external addresses changed."""


class Registration:
    """Undoes one registration (once); ``with`` undoes it at the end of the block."""

    def __init__(self, undo: Callable[[], None]) -> None:
        self._undo: Callable[[], None] | None = undo

    def remove(self) -> None:
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()


class Observers(Generic[O]):
    """The observers of one thing, each isolated from the others: :meth:`notify` calls every one, and one
    that raises is logged (with what it was told), removed and never called again, while the rest still hear.
    Synchronous and lossless, in registration order."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._observers: list[O] = []

    def add(self, observer: O) -> Registration:
        self._observers.append(observer)

        def undo() -> None:
            if observer in self._observers:
                self._observers.remove(observer)

        return Registration(undo)

    def notify(self, call: Callable[[O], object], event: str) -> None:
        for observer in list(self._observers):
            try:
                call(observer)
            except Exception:
                log.exception("an observer of %s (%r) failed on %s; it is removed, the others still hear",
                              self._what, observer, event)
                if observer in self._observers:
                    self._observers.remove(observer)

    def __len__(self) -> int:
        return len(self._observers)


#: One shape for every service's ``metrics()``: flat dotted names (``refused.too many circuits``)
#: to numbers, text, or lists of them; JSON-ready, and one gauge or counter each for an exporter.
MetricValue = int | float | str | list[float] | list[str]
Metrics = dict[str, MetricValue]
