"""Event records of the NAT layer, alongside :mod:`p2p.events` (same base, same ``--json`` lines)."""

from __future__ import annotations

import time
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
    """A slot on ``relay`` until ``expire`` (unix seconds, the relay's clock), renewed before it ends."""

    relay: ID
    expire: float
    addrs: list[str]
    event: str = field(init=False, default="relay_reserved")

    def human(self) -> str:
        until = time.strftime("%H:%M:%S", time.localtime(self.expire))
        where = f": reachable at {self.addrs[0]}" if self.addrs else ""
        return f"relay slot on {self.relay}{where} (held until {until}, renewed before then)"


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

    def human(self) -> str:
        who = f"…{str(self.peer_id)[-8:]}"
        if self.success:
            how = "dialed back" if self.method == "reversal" else f"hole punch, {self.attempts} round{'s' if self.attempts != 1 else ''}"
            return f"direct connection to {who} at {self.addr}, {self.elapsed:.2f} s after the relayed one opened ({how})"
        return (f"no direct connection to {who} after {self.attempts} hole-punch round{'s' if self.attempts != 1 else ''} "
                f"({self.elapsed:.2f} s): staying relayed")


@dataclass
class PingSummary(Event):
    """``dedloc ping``'s last line: the round trips, and whether (and when) the path went direct."""

    peer_id: ID
    pings: int
    rtt_ms_min: float | None
    rtt_ms_median: float | None
    #: Upgrades of the relayed connection this side led (the side it reached leads; a ping client is usually the other).
    punch_attempts: int
    #: Seconds from the relayed connection's start to the direct one (None: it never went direct).
    time_to_direct: float | None
    event: str = field(init=False, default="ping_summary")

    def human(self) -> str:
        line = (f"{self.pings} pings, rtt min {self.rtt_ms_min:.2f} ms, median {self.rtt_ms_median:.2f} ms"
                if self.rtt_ms_min is not None and self.rtt_ms_median is not None else "no pings")
        if self.time_to_direct is not None:
            return line + f"; relayed at first, direct after {self.time_to_direct:.2f} s"
        if self.punch_attempts:
            return line + f"; relayed: {self.punch_attempts} upgrade attempt(s) found no direct path"
        return line


@dataclass
class ModeChanged(Event):
    """``public``, ``relayed`` (reachable through relays) or ``client`` (dials out only)."""

    mode: NatMode
    reason: str
    event: str = field(init=False, default="nat_mode")


@dataclass
class DashboardServing(Event):
    """``--metrics``: where the Prometheus endpoint and the live page listen."""

    metrics: str
    page: str
    event: str = field(init=False, default="dashboard")

    def human(self) -> str:
        return f"metrics at {self.metrics}, live page at {self.page}"


@dataclass
class NatStatus(Event):
    """The funnel: reservations, dial-backs, punch attempts and successes, bytes by path."""

    metrics: Metrics
    event: str = field(init=False, default="nat_status")
