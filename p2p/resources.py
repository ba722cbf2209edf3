"""One resource manager: what every protocol of a node may take, per peer and in all.

A public node meets peers that open streams, send requests and fill windows as
fast as they can. Each protocol used to keep its own caps, or none. Here, as in
go-libp2p's resource manager, the Node, the relay, AutoNAT, DCUtR, the DHT and
RPC (and later averaging) acquire through one object what they use:

* **connections** per peer (inbound, after the handshake; admission before the
  handshake is ``p2p/admission.py``, which this manager owns);
* **inbound streams** in all, per peer, per protocol and per peer and protocol
  (the muxer's own cap per connection, ``YamuxConfig.max_inbound_streams``, is
  checked first, by RST, before a stream reaches any handler);
* **in-flight bytes** (receive windows grown beyond yamux's initial 256 KiB: what a
  peer may have sent that we hold unread) per peer and in all. A refusal here
  never fails anything: the window stays small and the sender slows down;
* **request rates** per peer for each service (token buckets): ``streams`` (streams
  opened: yamux refuses one over the rate with RST before any task or negotiation
  costs anything), ``dht``, ``rpc``
  (every other RPC method), ``identify``, ``autonat``, ``dcutr``,
  ``relay.reserve`` and ``relay.connect``; and per IP address for AutoNAT (requests
  from one address, dial-backs to one address: it cannot be made an amplifier);
* the caps services keep themselves (the relay's reservations per address):
  their refusals are counted here too, by :meth:`ResourceManager.refuse`.

Every refusal is a :class:`ResourceLimitExceeded` that names the limit, counted
by scope and reason, and the refusing protocol tells the peer in its own words
where it has any (an RPC error code, a relay status, a multistream reply before
the handshake). :meth:`ResourceManager.limits` and :meth:`ResourceManager.usage`
are what ``dedloc status`` prints.

Sans-I/O: no clock of its own (times are passed in), no tasks.

Defaults beside go-libp2p's (``limit_defaults.go``, base limits before scaling
with the machine): per peer 8 connections, 256 inbound streams, 64 MiB of memory;
per protocol 512 inbound streams (2048 with scaling) and 64 per peer; in all
1024+ inbound streams and 1/8 of the machine's memory. We take its per-peer
numbers, and larger system ones because one relay serves thousands of peers.
go-libp2p has no request rates in the manager (its DHT and relay keep their own);
ours are generous for honest use (the DHT bench's busiest peer sends < 100
requests a second to one other) and bound what one connection can make us do.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from enum import StrEnum

from .admission import Admission, AdmissionConfig
from .errors import ConfigError, DedlocError
from .hooks import Registration


class Scope(StrEnum):
    """Where a limit applies (go-libp2p's scopes, less transient and service)."""

    SYSTEM = "system"
    PEER = "peer"
    PROTOCOL = "protocol"
    PEER_PROTOCOL = "peer_protocol"
    SERVICE = "service"


#: How every limit's refusal begins: the message of :class:`ResourceLimitExceeded`, which a refused
#: opener reads as the reason of its :class:`p2p.multistream.PeerRefused` (see ``over_a_limit``).
OVER_THE_LIMIT = "over the limit of"


def over_a_limit(reason: str) -> bool:
    """Whether a refusal's reason is one of these limits (busy, not broken: retry later or elsewhere)."""
    return reason.startswith(OVER_THE_LIMIT)


class ResourceLimitExceeded(DedlocError):
    """A peer (or all peers together) is over a limit: which one is in the message and fields."""

    def __init__(self, scope: Scope, resource: str, limit: float, *, what: str = "") -> None:
        self.scope = scope
        self.resource = resource
        self.limit = limit
        where = {Scope.SYSTEM: "in all", Scope.PEER: "per peer", Scope.PROTOCOL: f"for {what}",
                 Scope.PEER_PROTOCOL: f"per peer for {what}", Scope.SERVICE: what}[scope]
        super().__init__(f"{OVER_THE_LIMIT} {limit:g} {resource} {where}".rstrip())

    @property
    def reason(self) -> str:
        """The counter's key: ``scope.resource`` (``peer.streams``, ``service.dht_rate``)."""
        return f"{self.scope.value}.{self.resource.replace(' ', '_')}"


@dataclass
class Rate:
    """A token bucket: ``per_second`` on average, ``burst`` at once."""

    per_second: float
    burst: int

    def validate(self, name: str) -> None:
        if not self.per_second > 0 or self.burst < 1:
            raise ConfigError(f"rate {name} needs per_second > 0 and burst >= 1, got {self}")

    def refill(self, tokens: float, elapsed: float) -> float:
        """A bucket's ``tokens`` after ``elapsed`` seconds of refilling: never more than ``burst``."""
        return min(float(self.burst), tokens + elapsed * self.per_second)


def default_rates() -> dict[str, Rate]:
    return {
        "streams": Rate(200.0, 500),  # inbound streams opened per peer (yamux refuses over it with RST)
        "dht": Rate(200.0, 400),
        "rpc": Rate(500.0, 1000),
        "identify": Rate(2.0, 8),
        "autonat": Rate(0.2, 4),  # 12 a minute; the old AutoNATConfig.per_peer_per_minute
        "autonat.address": Rate(1.0, 16),  # requests from one IP, whatever the peer ids
        "autonat.dial_back": Rate(0.2, 4),  # dial-backs to an IP not the requester's, whoever pays
        "dcutr": Rate(1.0, 4),
        "relay.reserve": Rate(0.5, 4),
        "relay.connect": Rate(10.0, 32),
        "auth.issue": Rate(0.2, 4),  # pass requests to an authority (each a challenge and an HMAC check)
    }


def default_max_memory() -> int:
    """1/8 of the machine's memory (go-libp2p's fraction), at least 128 MiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return max(128 << 20, total // 8)


@dataclass
class ResourceConfig:
    """Every limit of a node in one place (0 for a cap: no limit). ``dedloc status`` shows them."""

    #: Inbound connections before the handshake: per address and subnet, the deadline.
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    #: Inbound connections one authenticated peer may hold at once (go-libp2p: 8).
    max_connections_per_peer: int = 8
    #: Inbound streams open at once: in all, per peer, per protocol, per peer and protocol.
    max_inbound_streams: int = 16384
    max_inbound_streams_per_peer: int = 256
    max_inbound_streams_per_protocol: int = 4096
    max_inbound_streams_per_peer_protocol: int = 128
    #: Bytes peers may have in flight to us beyond yamux's initial windows: in all, per peer.
    max_memory: int = field(default_factory=default_max_memory)
    max_memory_per_peer: int = 128 << 20
    #: Requests per peer per service (token buckets); a service not named here is not limited.
    rates: dict[str, Rate] = field(default_factory=default_rates)
    #: Peers whose buckets are kept (the least recently used go first beyond this).
    max_tracked_peers: int = 65536
    #: Seconds between the node's checks for limits hit: each limit hit since the last check is
    #: logged at ERROR once, by name, with its count (kubo #9001: limit hits were invisible at WARN).
    alarm_interval: float = 5.0

    def validate(self) -> None:
        self.admission.validate()
        for name in ("max_connections_per_peer", "max_inbound_streams", "max_inbound_streams_per_peer",
                     "max_inbound_streams_per_protocol", "max_inbound_streams_per_peer_protocol",
                     "max_memory", "max_memory_per_peer"):
            if getattr(self, name) < 0:
                raise ConfigError(f"resources {name} must be >= 0, got {getattr(self, name)}")
        if self.max_tracked_peers < 1:
            raise ConfigError("resources max_tracked_peers must be at least 1")
        if not 0 < self.alarm_interval <= 60:
            raise ConfigError(f"resources alarm_interval must be in (0, 60] seconds, got {self.alarm_interval}")
        for service, rate in self.rates.items():
            rate.validate(service)


@dataclass(eq=False)
class StreamGrant:
    """One inbound stream counted against its peer and protocol; give it back with
    :meth:`ResourceManager.close_stream` (once: a second close is a no-op)."""

    peer: str
    protocol: str
    open: bool = True


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class MemoryAccount:
    """One connection's share of in-flight bytes, charged to its peer and to the system:
    what the muxer asks before it grows a receive window (see ``p2p/yamux.py``)."""

    manager: ResourceManager
    peer: str
    held: int = 0

    def reserve(self, wanted: int) -> int:
        """Up to ``wanted`` bytes, as many as the peer's and the system's budget allow (0: none)."""
        granted = self.manager._reserve_memory(self.peer, wanted)
        self.held += granted
        return granted

    def release(self, amount: int) -> None:
        """Give back up to ``amount`` bytes (never more than held; a negative amount gives back nothing)."""
        amount = max(0, min(amount, self.held))
        self.held -= amount
        self.manager._release_memory(self.peer, amount)

    def close(self) -> None:
        """The connection ended: everything it held goes back."""
        self.release(self.held)


@dataclass
class ResourceManager:
    """The counts, the limits and the refusals of one node (no I/O)."""

    config: ResourceConfig = field(default_factory=ResourceConfig)
    admission: Admission = field(init=False)
    refused: Counter[str] = field(default_factory=Counter)
    _connections: Counter[str] = field(default_factory=Counter)
    _streams: Counter[str] = field(default_factory=Counter)
    _protocol_streams: Counter[str] = field(default_factory=Counter)
    _peer_protocol_streams: Counter[tuple[str, str]] = field(default_factory=Counter)
    inbound_streams: int = 0
    _memory: Counter[str] = field(default_factory=Counter)
    memory: int = 0
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)
    _services: dict[str, Callable[[], Mapping[str, int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.admission = Admission(self.config.admission)

    # ------------------------------------------------------------------ refusals

    def refuse(self, error: ResourceLimitExceeded) -> ResourceLimitExceeded:
        """Count a refusal (any service's: the relay counts its own caps here) and return it to raise."""
        self.refused[error.reason] += 1
        return error

    def count_refusal(self, service: str, reason: str) -> None:
        """Count a refusal by a service's own cap (the relay's reservations per address), by reason."""
        self.refused[f"service.{service}.{reason.replace(' ', '_')}"] += 1

    def refusal_counts(self) -> Counter[str]:
        """Every refusal so far by limit name: ours (``peer.streams``, ``service.dht_rate``, ``service.relay.*``)
        and admission's before the handshake (``admission.handshaking_per_subnet``)."""
        out = Counter(self.refused)
        out.update({f"admission.{reason}": n for reason, n in self.admission.refused.items()})
        return out

    def _check(self, cap: int, used: int, scope: Scope, resource: str, what: str = "") -> None:
        if cap and used >= cap:
            raise self.refuse(ResourceLimitExceeded(scope, resource, cap, what=what))

    # ------------------------------------------------------------------ connections

    def open_connection(self, peer: str) -> None:
        """An inbound connection from ``peer`` authenticated; raises if it is one too many."""
        self._check(self.config.max_connections_per_peer, self._connections[peer], Scope.PEER, "connections")
        self._connections[peer] += 1

    def close_connection(self, peer: str) -> None:
        self._connections[peer] -= 1
        if self._connections[peer] <= 0:
            del self._connections[peer]

    # ------------------------------------------------------------------ streams

    def open_stream(self, peer: str, protocol: str) -> StreamGrant:
        """An inbound stream of ``protocol`` from ``peer``, acquired while its protocol is
        negotiated (``p2p/libp2p_host._Multiselect``: a refusal, not the protocol's echo, is
        then the answer the peer reads); raises (counted) if it is one too many."""
        c = self.config
        self._check(c.max_inbound_streams, self.inbound_streams, Scope.SYSTEM, "inbound streams")
        self._check(c.max_inbound_streams_per_protocol, self._protocol_streams[protocol], Scope.PROTOCOL,
                    "inbound streams", protocol)
        self._check(c.max_inbound_streams_per_peer, self._streams[peer], Scope.PEER, "inbound streams")
        self._check(c.max_inbound_streams_per_peer_protocol, self._peer_protocol_streams[(peer, protocol)],
                    Scope.PEER_PROTOCOL, "inbound streams", protocol)
        self.inbound_streams += 1
        self._protocol_streams[protocol] += 1
        self._streams[peer] += 1
        self._peer_protocol_streams[(peer, protocol)] += 1
        return StreamGrant(peer, protocol)

    def close_stream(self, grant: StreamGrant) -> None:
        if not grant.open:
            return
        grant.open = False
        self.inbound_streams -= 1
        _decrement(self._protocol_streams, grant.protocol)
        _decrement(self._streams, grant.peer)
        _decrement(self._peer_protocol_streams, (grant.peer, grant.protocol))

    # ------------------------------------------------------------------ memory

    def memory_account(self, peer: str) -> MemoryAccount:
        return MemoryAccount(self, peer)

    def _reserve_memory(self, peer: str, wanted: int) -> int:
        c = self.config
        granted = wanted
        if c.max_memory:
            granted = min(granted, c.max_memory - self.memory)
        if c.max_memory_per_peer:
            granted = min(granted, c.max_memory_per_peer - self._memory[peer])
        if granted < wanted:
            scope = Scope.SYSTEM if c.max_memory and self.memory + wanted > c.max_memory else Scope.PEER
            limit = c.max_memory if scope is Scope.SYSTEM else c.max_memory_per_peer
            self.refuse(ResourceLimitExceeded(scope, "bytes in flight", limit))
        granted = max(0, granted)
        if granted:
            self.memory += granted
            self._memory[peer] += granted
        elif not self._memory[peer]:
            del self._memory[peer]
        return granted

    def _release_memory(self, peer: str, amount: int) -> None:
        if amount <= 0:
            return
        self.memory -= amount
        self._memory[peer] -= amount
        if self._memory[peer] <= 0:
            del self._memory[peer]

    # ------------------------------------------------------------------ request rates

    def allow(self, service: str, peer: str, now: float) -> None:
        """One request of ``service`` from ``peer`` at ``now``: raises when over its rate.
        ``peer`` is any key the rate applies to: a peer id, or an IP address for
        ``autonat.address`` and ``autonat.dial_back``."""
        rate = self.config.rates.get(service)
        if rate is None:
            return
        key = (service, peer)
        bucket = self._buckets.pop(key, None)  # re-inserted last: the dict is in least-recently-used order
        if bucket is None:
            bucket = _Bucket(float(rate.burst), now)
            self._forget_full_buckets(now)
            while len(self._buckets) >= self.config.max_tracked_peers:
                del self._buckets[next(iter(self._buckets))]
        bucket.tokens = rate.refill(bucket.tokens, now - bucket.at)
        bucket.at = now
        self._buckets[key] = bucket
        if bucket.tokens < 1.0 - 1e-9:
            raise self.refuse(ResourceLimitExceeded(Scope.SERVICE, f"{service} requests a second per peer",
                                                    rate.per_second))
        bucket.tokens -= 1.0

    def _forget_full_buckets(self, now: float, at_most: int = 2) -> None:
        """Drop up to ``at_most`` of the least recently used buckets that have refilled to their
        burst: such a bucket is what a fresh one would be, so forgetting it changes no verdict, and the
        map holds the peers of the last refill time, not every peer ever seen (a relay's visitors
        left three buckets each, kept up to ``max_tracked_peers``)."""
        for _ in range(at_most):
            oldest = next(iter(self._buckets.items()), None)
            if oldest is None:
                return
            (service, _peer), bucket = oldest
            rate = self.config.rates.get(service)
            if rate is not None and rate.refill(bucket.tokens, now - bucket.at) < rate.burst:
                return
            del self._buckets[oldest[0]]

    def stream_open_refusal(self, peer: str, now: float) -> str | None:
        """The ``streams`` rate as yamux asks it: None to admit a stream, else the limit, in words."""
        try:
            self.allow("streams", peer, now)
        except ResourceLimitExceeded as e:
            return str(e)
        return None

    # ------------------------------------------------------------------ reporting

    def register_service(self, name: str, usage: Callable[[], Mapping[str, int]]) -> Registration:
        """Show a service's own counts (the relay's reservations) in :meth:`usage` until it is removed."""
        self._services[name] = usage

        def undo() -> None:
            if self._services.get(name) is usage:
                del self._services[name]

        return Registration(undo)

    def limits(self) -> dict[str, float]:
        c = self.config
        a = c.admission
        out: dict[str, float] = {
            "handshaking": a.max_handshaking, "handshaking_per_address": a.max_handshaking_per_address,
            "handshaking_per_subnet": a.max_handshaking_per_subnet, "handshake_timeout_s": a.handshake_timeout,
            "inbound_connections": a.max_connections, "inbound_connections_per_address": a.max_connections_per_address,
            "inbound_connections_per_subnet": a.max_connections_per_subnet,
            "connections_per_peer": c.max_connections_per_peer,
            "inbound_streams": c.max_inbound_streams, "inbound_streams_per_peer": c.max_inbound_streams_per_peer,
            "inbound_streams_per_protocol": c.max_inbound_streams_per_protocol,
            "inbound_streams_per_peer_protocol": c.max_inbound_streams_per_peer_protocol,
            "memory_bytes": c.max_memory, "memory_bytes_per_peer": c.max_memory_per_peer,
        }
        for service, rate in sorted(c.rates.items()):
            out[f"rate.{service}_per_s"] = rate.per_second
            out[f"rate.{service}_burst"] = rate.burst
        return out

    def usage(self) -> dict[str, int]:
        out = {f"admission.{k}": v for k, v in self.admission.metrics().items()}
        out.update({
            "peers_connected_in": len(self._connections), "inbound_streams": self.inbound_streams,
            "memory_bytes": self.memory,
            "busiest_peer_streams": max(self._streams.values(), default=0),
            "busiest_peer_memory_bytes": max(self._memory.values(), default=0),
        })
        out.update({f"streams.{protocol}": n for protocol, n in sorted(self._protocol_streams.items())})
        for name, usage in sorted(self._services.items()):
            out.update({f"{name}.{k}": v for k, v in usage().items()})
        out.update({f"refused.{reason}": n for reason, n in sorted(self.refused.items())})
        return out


def limits_hit(before: Mapping[str, int], after: Mapping[str, int]) -> list[tuple[str, int]]:
    """The limits hit between two :meth:`ResourceManager.refusal_counts`, with how often, by name."""
    return sorted((name, n - before.get(name, 0)) for name, n in after.items() if n > before.get(name, 0))


def _decrement(counter: Counter[Any], key: Any) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


__all__ = ["MemoryAccount", "Rate", "ResourceConfig", "ResourceLimitExceeded", "ResourceManager", "Scope",
           "StreamGrant", "default_max_memory", "default_rates", "limits_hit"]
