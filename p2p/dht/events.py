"""The DHT's event records and modes (same base and ``--json`` lines as :mod:`p2p.events`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ..events import Event


class DHTMode(StrEnum):
    """``server`` serves others; ``client`` only queries them; ``auto`` serves while reachable."""

    AUTO = "auto"
    SERVER = "server"
    CLIENT = "client"


@dataclass
class DHTJoined(Event):
    """The DHT finished bootstrapping: ``peers`` servers are in its routing table."""

    mode: DHTMode
    peers: int
    elapsed: float
    event: str = field(init=False, default="dht_joined")


@dataclass
class DHTModeChanged(Event):
    """The DHT now serves others (``server``) or only queries them (``client``), and why."""

    mode: DHTMode
    reason: str
    event: str = field(init=False, default="dht_mode")


@dataclass
class DHTIsolated(Event):
    """The routing table ran empty; the DHT re-bootstraps from its initial peers."""

    initial_peers: int
    event: str = field(init=False, default="dht_isolated")
