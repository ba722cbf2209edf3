"""Admission of inbound connections before any crypto: caps per address and subnet, a handshake deadline.

A public relay meets scanners and scripts first. Before this, py-libp2p 0.8.1's
swarm refused inbound connections with one global cap (its inbound limiter and
its own resource manager, 300 connections): a script holding 500 idle
connections from one address refused honest peers as often as itself (2 of 11
honest pings got through). go-libp2p's answer, followed here: count inbound
connections per IPv4 /32 and /24 and per IPv6 /56 and /48 at accept time, refuse
over the cap before a handshake costs CPU, give a connection that has not
authenticated a deadline, and cap those globally, evicting from the address or
subnet holding the most (never simply the newest: that would let a flood lock
out everyone who comes after it).

This module is the decision, without I/O: :class:`Admission` is told of each
accepted connection (:meth:`Admission.admit`), of its handshake's end
(:meth:`Admission.authenticated`) and of its close (:meth:`Admission.release`);
``p2p/libp2p_host.py`` does the I/O around py-libp2p's accept path. Defaults
beside go-libp2p's: it allows 8 connections per IPv4 /32 and IPv6 /56 and 64 per
/48 (``conn_limiter.go``), authenticated or not. Here the tight caps apply to
connections still handshaking (an honest peer never has more than a few at once);
authenticated ones have generous per-address caps, because one public address
can stand for a whole NAT of volunteers (a university, a carrier-grade NAT).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from .errors import ConfigError


class Refusal(StrEnum):
    """Why an inbound connection was refused (or evicted), as counted in the metrics."""

    HANDSHAKING_PER_ADDRESS = "handshaking_per_address"
    HANDSHAKING_PER_SUBNET = "handshaking_per_subnet"
    HANDSHAKING_TOTAL = "handshaking_total"
    CONNECTIONS_PER_ADDRESS = "connections_per_address"
    CONNECTIONS_PER_SUBNET = "connections_per_subnet"
    CONNECTIONS_TOTAL = "connections_total"
    EVICTED = "evicted"
    HANDSHAKE_DEADLINE = "handshake_deadline"


_TEXTS = {
    Refusal.HANDSHAKING_PER_ADDRESS: "too many connections still handshaking from your address",
    Refusal.HANDSHAKING_PER_SUBNET: "too many connections still handshaking from your subnet",
    Refusal.HANDSHAKING_TOTAL: "too many connections still handshaking",
    Refusal.CONNECTIONS_PER_ADDRESS: "too many connections from your address",
    Refusal.CONNECTIONS_PER_SUBNET: "too many connections from your subnet",
    Refusal.CONNECTIONS_TOTAL: "too many connections",
    Refusal.EVICTED: "evicted: your address or subnet held the most unfinished handshakes, or yours had stalled",
    Refusal.HANDSHAKE_DEADLINE: "the handshake took too long",
}


def is_admission_refusal(reason: str) -> bool:
    """Whether ``reason`` is one of admission's (a connection refused), not a stream's."""
    return reason in _TEXTS


def describe_refusal(reason: str) -> str:
    """What a refusal's reason means, for the refused peer's error message."""
    try:
        return f"{_TEXTS[Refusal(reason)]} ({reason})"
    except ValueError:
        return reason


@dataclass
class AdmissionConfig:
    """Limits on inbound connections, checked at accept time (0 for a cap: no limit)."""

    #: Connections still in their security handshake, from all addresses together.
    max_handshaking: int = 256
    #: ... from one IPv4 address or IPv6 /56, and from one IPv4 /24 or IPv6 /48.
    max_handshaking_per_address: int = 8
    max_handshaking_per_subnet: int = 32
    #: Seconds a connection may take to authenticate (Noise and the muxer: 2 round trips,
    #: 0.6 s across the world, plus a loaded CPU's and a lossy link's slack) before it is closed.
    handshake_timeout: float = 8.0
    #: When the handshaking table is full and no subnet holds more than its share (a flood spread
    #: over many addresses), the oldest handshake yields its place to a newcomer once it has run
    #: this long: an honest handshake finishes in 2 round trips, a stalled one never does.
    stalled_after: float = 1.0
    #: Subnets whose handshakes stalled (evicted, timed out, or closed unfinished) are remembered,
    #: the count halving every this many seconds: a newcomer from a subnet with none may take the
    #: place of a handshake from the subnet with the most, however young (a flood churning the table
    #: faster than ``stalled_after`` keeps every place young; its subnets soon all have stalls, an
    #: honest peer's has none). At most ``max_tracked_subnets`` are remembered.
    stall_memory: float = 60.0
    max_tracked_subnets: int = 65536
    #: Inbound connections in all (handshaking or not).
    max_connections: int = 4096
    #: ... from one IPv4 address or IPv6 /56, and one IPv4 /24 or IPv6 /48.
    max_connections_per_address: int = 128
    max_connections_per_subnet: int = 512
    #: TCP listen backlog (connections the kernel holds before we accept them).
    backlog: int = 1024

    def validate(self) -> None:
        for name in ("max_handshaking", "max_handshaking_per_address", "max_handshaking_per_subnet", "max_connections",
                     "max_connections_per_address", "max_connections_per_subnet", "backlog"):
            if getattr(self, name) < 0:
                raise ConfigError(f"admission {name} must be >= 0, got {getattr(self, name)}")
        if not self.handshake_timeout > 0:
            raise ConfigError(f"admission handshake_timeout must be positive, got {self.handshake_timeout}")
        if not (self.stalled_after > 0 and self.stall_memory > 0):
            raise ConfigError("admission stalled_after and stall_memory must be positive")
        if self.max_tracked_subnets < 1:
            raise ConfigError("admission max_tracked_subnets must be at least 1")
        if self.backlog < 1:
            raise ConfigError("admission backlog must be at least 1")


def prefixes(ip: str) -> tuple[str, str]:
    """The (address, subnet) an inbound connection counts against: /32 and /24 for IPv4,
    /56 and /48 for IPv6 (an IPv6 host usually holds a whole /64 or more)."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if isinstance(addr, ipaddress.IPv4Address):
        return f"{addr}/32", str(ipaddress.ip_network(f"{addr}/24", strict=False))
    return str(ipaddress.ip_network(f"{addr}/56", strict=False)), str(ipaddress.ip_network(f"{addr}/48", strict=False))


@dataclass(eq=False)
class Ticket:
    """One admitted connection: where it came from and whether it has authenticated."""

    address: str
    subnet: str
    admitted_at: float
    authenticated: bool = False
    #: Set when the connection must go (evicted to make room): the I/O side closes it.
    evicted: bool = False


@dataclass
class Admission:
    """The counts and the decisions; no I/O, no clock of its own (times are passed in)."""

    config: AdmissionConfig = field(default_factory=AdmissionConfig)
    handshaking: list[Ticket] = field(default_factory=list)
    _hs_address: Counter[str] = field(default_factory=Counter)
    _hs_subnet: Counter[str] = field(default_factory=Counter)
    _address: Counter[str] = field(default_factory=Counter)
    _subnet: Counter[str] = field(default_factory=Counter)
    connections: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    admitted: int = 0
    #: Why the last refused connection was refused (what the listener tells it).
    last_refusal: Refusal | None = None
    #: Stalled handshakes per subnet, decaying (``stall_memory``); the time of the last halving.
    stalls: dict[str, float] = field(default_factory=dict)
    _stalls_halved: float | None = None

    def admit(self, ip: str, now: float) -> tuple[Ticket | None, list[Ticket]]:
        """Admit a connection just accepted from ``ip``: its ticket (None: refused, the reason
        counted in :attr:`refused` and kept in :attr:`last_refusal`) and the handshaking
        tickets evicted to make room."""
        c = self.config
        address, subnet = prefixes(ip)
        self._decay(now)
        checks = (
            (c.max_connections_per_address, self._address[address], Refusal.CONNECTIONS_PER_ADDRESS),
            (c.max_connections_per_subnet, self._subnet[subnet], Refusal.CONNECTIONS_PER_SUBNET),
            (c.max_handshaking_per_address, self._hs_address[address], Refusal.HANDSHAKING_PER_ADDRESS),
            (c.max_handshaking_per_subnet, self._hs_subnet[subnet], Refusal.HANDSHAKING_PER_SUBNET),
        )
        for cap, used, reason in checks:
            if cap and used >= cap:
                self._refuse(reason)
                return None, []
        evicted: list[Ticket] = []
        if c.max_connections and self.connections >= c.max_connections:
            # full of established connections from many addresses: only a handshaking one may yield
            victim = self._victim(subnet, now)
            if victim is None:
                self._refuse(Refusal.CONNECTIONS_TOTAL)
                return None, []
            evicted.append(self._evict(victim))
        if c.max_handshaking and len(self.handshaking) >= c.max_handshaking:
            victim = self._victim(subnet, now)
            if victim is None:
                self._refuse(Refusal.HANDSHAKING_TOTAL)
                return None, evicted
            evicted.append(self._evict(victim))
        ticket = Ticket(address, subnet, now)
        self.handshaking.append(ticket)
        self._hs_address[address] += 1
        self._hs_subnet[subnet] += 1
        self._address[address] += 1
        self._subnet[subnet] += 1
        self.connections += 1
        self.admitted += 1
        return ticket, evicted

    def _refuse(self, reason: Refusal) -> None:
        self.refused[reason] += 1
        self.last_refusal = reason

    def _victim(self, subnet: str, now: float) -> Ticket | None:
        """The handshaking connection to close for a newcomer from ``subnet``: the oldest from the
        subnet holding the most, if that holds more than the newcomer's would with it; else, when
        every subnet holds its share (a flood spread over many /24s or /48s), the oldest handshake
        of all if it has run ``stalled_after`` (it is stalled: an honest one is done by then);
        else None (the table is full of fresh handshakes: the newcomer is the one refused)."""
        if not self._hs_subnet:
            return None
        top, held = max(self._hs_subnet.items(), key=lambda kv: kv[1])
        mine = self._hs_subnet[subnet] + 1
        if top != subnet and held > mine:
            return next(t for t in self.handshaking if t.subnet == top)
        if mine > held:
            return None  # the newcomer's subnet would hold the most: never at others' expense
        if subnet not in self.stalls:
            # a newcomer whose subnet never stalled takes the place of the worst staller's oldest
            worst = max(self.handshaking, key=lambda t: (self.stalls.get(t.subnet, 0.0), -t.admitted_at))
            if self.stalls.get(worst.subnet, 0.0) > 0:
                return worst
        oldest = self.handshaking[0]
        return oldest if now - oldest.admitted_at >= self.config.stalled_after else None

    def _stalled(self, subnet: str) -> None:
        self.stalls[subnet] = self.stalls.get(subnet, 0.0) + 1.0
        if len(self.stalls) > self.config.max_tracked_subnets:
            del self.stalls[min(self.stalls, key=self.stalls.__getitem__)]

    def _decay(self, now: float) -> None:
        if self._stalls_halved is None:
            self._stalls_halved = now
        while now - self._stalls_halved >= self.config.stall_memory:
            self._stalls_halved += self.config.stall_memory
            self.stalls = {k: v / 2 for k, v in self.stalls.items() if v / 2 >= 0.01}

    def _evict(self, ticket: Ticket) -> Ticket:
        ticket.evicted = True
        self.refused[Refusal.EVICTED] += 1
        self._stalled(ticket.subnet)
        self._unhandshake(ticket)
        return ticket

    def _unhandshake(self, ticket: Ticket) -> None:
        if ticket in self.handshaking:
            self.handshaking.remove(ticket)
            self._hs_address[ticket.address] -= 1
            self._hs_subnet[ticket.subnet] -= 1
            if not self._hs_address[ticket.address]:
                del self._hs_address[ticket.address]
            if not self._hs_subnet[ticket.subnet]:
                del self._hs_subnet[ticket.subnet]

    def authenticated(self, ticket: Ticket) -> None:
        """The handshake finished: the connection no longer counts as handshaking."""
        if not ticket.authenticated and not ticket.evicted:
            ticket.authenticated = True
            self._unhandshake(ticket)

    def timed_out(self, ticket: Ticket) -> None:
        """The handshake deadline passed (the I/O side closes the connection)."""
        if not ticket.authenticated:
            self.refused[Refusal.HANDSHAKE_DEADLINE] += 1
            if ticket in self.handshaking:
                self._stalled(ticket.subnet)
                self._unhandshake(ticket)  # counted once: its release finds it gone

    def release(self, ticket: Ticket) -> None:
        """The connection closed, whatever its state (closed unfinished: its subnet stalled once)."""
        if ticket in self.handshaking:
            self._stalled(ticket.subnet)
        self._unhandshake(ticket)
        self._address[ticket.address] -= 1
        self._subnet[ticket.subnet] -= 1
        if not self._address[ticket.address]:
            del self._address[ticket.address]
        if not self._subnet[ticket.subnet]:
            del self._subnet[ticket.subnet]
        self.connections -= 1

    def metrics(self) -> dict[str, int]:
        out = {"inbound": self.connections, "handshaking": len(self.handshaking), "admitted": self.admitted,
               "addresses": len(self._address)}
        out.update({f"refused.{reason.value}": self.refused.get(reason.value, 0) for reason in Refusal})
        return out


__all__ = ["Admission", "AdmissionConfig", "Refusal", "Ticket", "describe_refusal", "prefixes"]
