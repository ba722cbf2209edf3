"""What a node reports about itself, as plain records that serialise to one JSON line.

Monitoring scripts follow ``dedloc peer --json``; apps subscribe with
:meth:`p2p.Node.events`. Both see the same records, defined once here.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass
class Event:
    """Base record: ``event`` names the kind; ``ts`` is Unix time in seconds."""

    event: str = field(init=False, default="event")
    ts: float = field(init=False, default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=False)


@dataclass
class Listening(Event):
    peer_id: str
    addrs: list[str]
    event: str = field(init=False, default="listening")


@dataclass
class ConnectionOpened(Event):
    peer_id: str
    addr: str
    direction: Literal["inbound", "outbound", "unknown"]
    kind: Literal["direct", "relayed"]
    event: str = field(init=False, default="connection_opened")


@dataclass
class ConnectionClosed(Event):
    peer_id: str
    addr: str
    kind: Literal["direct", "relayed"]
    event: str = field(init=False, default="connection_closed")


@dataclass
class PeerConnected(Event):
    """An initial peer (or a dial target) was reached; ``elapsed`` is dial time in s."""

    peer_id: str
    addr: str
    elapsed: float
    event: str = field(init=False, default="peer_connected")


@dataclass
class Ping(Event):
    peer_id: str
    rtt_ms: float
    event: str = field(init=False, default="ping")


@dataclass
class Message(Event):
    """An application-level message (the demo's chatter, for instance)."""

    peer_id: str
    text: str
    event: str = field(init=False, default="message")


@dataclass
class PeerCount(Event):
    """Periodic status of a long-running node: who it is connected to now."""

    count: int
    peers: list[str]
    event: str = field(init=False, default="peer_count")


@dataclass
class Error(Event):
    message: str
    peer_id: str | None = None
    event: str = field(init=False, default="error")


@dataclass
class Closed(Event):
    peer_id: str
    event: str = field(init=False, default="closed")


@dataclass
class DHTJoined(Event):
    """The DHT finished bootstrapping: ``peers`` servers are in its routing table."""

    mode: str
    peers: int
    elapsed: float
    event: str = field(init=False, default="dht_joined")


@dataclass
class DHTModeChanged(Event):
    """The DHT now serves others (``server``) or only queries them (``client``), and why."""

    mode: str
    reason: str
    event: str = field(init=False, default="dht_mode")


@dataclass
class DHTIsolated(Event):
    """The routing table ran empty; the DHT re-bootstraps from its initial peers."""

    initial_peers: int
    event: str = field(init=False, default="dht_isolated")
