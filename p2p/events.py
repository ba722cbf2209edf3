"""What a node reports about itself, as plain records that serialise to one JSON line.

Monitoring scripts follow ``dedloc peer --json``; apps subscribe with
:meth:`p2p.Node.events`. Both see the same records, defined once here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only; _plain imports it when an event is written
    from libp2p.peer.id import ID

from .hooks import Direction, PathKind


@dataclass
class Event:
    """Base record: ``event`` names the kind; ``ts`` is Unix time in seconds."""

    event: str = field(init=False, default="event")
    ts: float = field(init=False, default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: peer ids as base58 text, enums as their value."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))  # in field order

    def human(self) -> str | None:
        """One line for people, for a layer above to give its events (None: the printer's default)."""
        return None


def _plain(value: Any) -> Any:
    from libp2p.peer.id import ID

    if isinstance(value, ID):
        return value.to_base58()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass
class Listening(Event):
    peer_id: ID
    addrs: list[str]
    event: str = field(init=False, default="listening")


@dataclass
class ConnectionOpened(Event):
    peer_id: ID
    addr: str
    direction: Direction
    kind: PathKind
    event: str = field(init=False, default="connection_opened")


@dataclass
class ConnectionClosed(Event):
    peer_id: ID
    addr: str
    kind: PathKind
    #: closed by a connection manager, ours or the peer's (``p2p/conn_manager.py``)
    trimmed: bool = False
    event: str = field(init=False, default="connection_closed")


@dataclass
class ConnectionsTrimmed(Event):
    """Over the connection manager's high water: the lowest-valued peers' connections were closed."""

    closed: int
    peers: int
    #: connections open before, and after
    before: int
    after: int
    event: str = field(init=False, default="connections_trimmed")

    def human(self) -> str:
        return (f"holding {self.before} connections, over the high water: closed {self.closed} to {self.peers} "
                f"peers of least use ({self.after} open)")


@dataclass
class PeerConnected(Event):
    """An initial peer (or a dial target) was reached; ``elapsed`` is dial time in s."""

    peer_id: ID
    addr: str
    elapsed: float
    event: str = field(init=False, default="peer_connected")


@dataclass
class Ping(Event):
    peer_id: ID
    rtt_ms: float
    #: The path the ping took: ``direct``, or ``relayed`` through a circuit relay (None: unknown).
    kind: PathKind | None = None
    event: str = field(init=False, default="ping")


@dataclass
class Message(Event):
    """An application-level message (the demo's chatter, for instance)."""

    peer_id: ID
    text: str
    event: str = field(init=False, default="message")


@dataclass
class PeerCount(Event):
    """Periodic status of a long-running node: who it is connected to now."""

    count: int
    peers: list[ID]
    event: str = field(init=False, default="peer_count")


@dataclass
class Error(Event):
    message: str
    peer_id: ID | None = None
    event: str = field(init=False, default="error")


@dataclass
class ClosedSwarm(Event):
    """A peer showed us its access pass (``/dedloc/auth/1.0.0``) and we have none: it runs a closed
    swarm and will refuse us (``p2p/auth.py``)."""

    peer_id: ID
    event: str = field(init=False, default="closed_swarm")

    def human(self) -> str:
        return f"{self.peer_id} runs a closed swarm, and this peer has no access pass for it"


@dataclass
class Rejoining(Event):
    """Every connection closed: the node dials its initial peers again until one answers."""

    initial_peers: int
    event: str = field(init=False, default="rejoining")

    def human(self) -> str:
        return f"cut off from every peer: dialing the {self.initial_peers} initial peer{'s' if self.initial_peers != 1 else ''} again"


@dataclass
class IdentifyPushed(Event):
    """What we advertise or serve changed and we told the connected peers that serve identify/push."""

    addrs: list[str]
    protocols: list[str]
    #: peers told, and peers whose push failed (timed out, stream refused)
    peers: int
    failed: int
    event: str = field(init=False, default="identify_pushed")

    def human(self) -> str:
        failed = f" ({self.failed} could not be told)" if self.failed else ""
        return (f"our addresses or protocols changed: told {self.peers} connected "
                f"peer{'s' if self.peers != 1 else ''}{failed}")


@dataclass
class Closed(Event):
    peer_id: ID
    event: str = field(init=False, default="closed")
