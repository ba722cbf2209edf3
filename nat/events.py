"""Event records of the NAT layer, alongside :mod:`p2p.events` (same base, same ``--json`` lines)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2p.events import Event


@dataclass
class ReachabilityChanged(Event):
    """What AutoNAT concluded: ``public`` (some address confirmed), ``private`` or ``unknown``."""

    reachability: str
    mapping: str
    confirmed: list[str]
    event: str = field(init=False, default="reachability")


@dataclass
class RelayReserved(Event):
    relay: str
    expire: float
    addrs: list[str]
    event: str = field(init=False, default="relay_reserved")


@dataclass
class RelayLost(Event):
    relay: str
    reason: str
    event: str = field(init=False, default="relay_lost")


@dataclass
class HolePunched(Event):
    """The outcome of upgrading a relayed connection: ``method`` is reversal, punch or none."""

    peer_id: str
    success: bool
    method: str
    attempts: int
    elapsed: float
    addr: str | None = None
    event: str = field(init=False, default="hole_punch")


@dataclass
class ModeChanged(Event):
    """``public``, ``relayed`` (reachable through relays) or ``client`` (dials out only)."""

    mode: str
    reason: str
    event: str = field(init=False, default="nat_mode")


@dataclass
class NatStatus(Event):
    """The funnel: reservations, dial-backs, punch attempts and successes, bytes by path."""

    metrics: dict[str, Any]
    event: str = field(init=False, default="nat_status")
