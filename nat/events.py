"""Event records of the NAT layer, alongside :mod:`p2p.events` (same base, same ``--json`` lines)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from libp2p.peer.id import ID

from p2p.events import Event
from p2p.hooks import Metrics, Reachability

if TYPE_CHECKING:
    from .holepunch import PunchMethod
    from .reachability import MappingKind, NatMode


@dataclass
class ReachabilityChanged(Event):
    """What AutoNAT concluded: ``public`` (some address confirmed), ``private`` or ``unknown``."""

    reachability: Reachability
    mapping: MappingKind
    confirmed: list[str]
    event: str = field(init=False, default="reachability")


@dataclass
class RelayReserved(Event):
    relay: ID
    expire: float
    addrs: list[str]
    event: str = field(init=False, default="relay_reserved")


@dataclass
class RelayLost(Event):
    relay: ID
    reason: str
    event: str = field(init=False, default="relay_lost")


@dataclass
class HolePunched(Event):
    """The outcome of upgrading a relayed connection: ``method`` is reversal, punch or none."""

    peer_id: ID
    success: bool
    method: PunchMethod
    attempts: int
    elapsed: float
    addr: str | None = None
    event: str = field(init=False, default="hole_punch")


@dataclass
class ModeChanged(Event):
    """``public``, ``relayed`` (reachable through relays) or ``client`` (dials out only)."""

    mode: NatMode
    reason: str
    event: str = field(init=False, default="nat_mode")


@dataclass
class NatStatus(Event):
    """The funnel: reservations, dial-backs, punch attempts and successes, bytes by path."""

    metrics: Metrics
    event: str = field(init=False, default="nat_status")
