"""Probing a gateway and holding a mapping: :func:`probe`, :func:`map_port` (renewal, deletion on exit), :class:`PortMappingConfig`."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from multiaddr import Multiaddr

from p2p.addresses import ip_and_tcp_port
from p2p.errors import ConfigError
from p2p.trio_util import unwrap_single_group

from .common import ALL_METHODS, Method, PortMappingError, PortMappingUnavailable, Protocol, _Mapper, _check_port, _describe, _ipv4, default_gateway, local_address_towards
from .natpmp import _NatPmpMapper, natpmp_external_address
from .pcp import _PcpMapper, pcp_announce
from .upnp import UpnpGateway, _UpnpMapper, discover_upnp

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- which port


def mappable_port(listen: Sequence[Multiaddr]) -> int | None:
    """The TCP port of the first listen address a router could forward to: none on loopback.

    A socket bound to 127.0.0.1 (or ``::1``) is out of the router's reach, so a mapping to it could
    not carry one connection; asking for it only sends packets to the LAN's router (PCP, NAT-PMP,
    UPnP's multicast search). The loopback demo's peers did, every start. An unspecified address
    (``0.0.0.0``, ``::``) counts: it listens on the interface facing the router too."""
    for addr in listen:
        found = ip_and_tcp_port(addr)
        if found is not None and not ipaddress.ip_address(found[0]).is_loopback:
            return found[1]
    return None


# ---------------------------------------------------------------------- probe


@dataclass(frozen=True)
class GatewaySupport:
    """What :func:`probe` found: which methods the gateway answers, and why not the others."""

    gateway: str
    local_ip: str
    pcp: bool
    natpmp_external_ip: str | None
    upnp: UpnpGateway | None
    upnp_external_ip: str | None
    failures: dict[str, str]

    @property
    def methods(self) -> tuple[Method, ...]:
        """The methods that answered, in :data:`ALL_METHODS` order."""
        offered = {"pcp": self.pcp, "natpmp": self.natpmp_external_ip is not None, "upnp": self.upnp is not None}
        return tuple(m for m in ALL_METHODS if offered[m])

    @property
    def external_ip(self) -> str | None:
        """The external address the gateway reported, if any method reports one."""
        return self.natpmp_external_ip or self.upnp_external_ip


def _resolve_gateway(gateway: str | None) -> tuple[str, str]:
    if gateway is None:
        gateway = default_gateway()
        if gateway is None:
            raise PortMappingUnavailable("no IPv4 default route: no gateway to ask for a port mapping")
    _ipv4(gateway, "gateway")
    try:
        local_ip = local_address_towards(gateway)
    except OSError as e:
        raise PortMappingUnavailable(f"cannot reach the gateway {gateway}: {_describe(e)}") from None
    if ipaddress.IPv4Address(local_ip).is_global:
        raise PortMappingUnavailable(f"this host has the public address {local_ip}: there is no NAT to map through")
    return gateway, local_ip


class _Discovery:
    """Side-effect-free questions to the gateway, one task per method, each ending at its answer.

    ``done[method]`` is set when that method's question is settled either way,
    so :func:`map_port` can act on the preferred method without waiting for
    the slower ones (SSDP waits for stragglers; PCP answers in a round trip).
    """

    def __init__(self, gateway: str, local_ip: str, timeout: float):
        self.gateway, self.local_ip, self.timeout = gateway, local_ip, timeout
        self.done: dict[Method, trio.Event] = {m: trio.Event() for m in ALL_METHODS}
        self.pcp = False
        self.natpmp_external_ip: str | None = None
        self.upnp: UpnpGateway | None = None
        self.upnp_external_ip: str | None = None
        self.failures: dict[str, str] = {}

    def offers(self, method: Method) -> bool:
        return {"pcp": self.pcp, "natpmp": self.natpmp_external_ip is not None, "upnp": self.upnp is not None}[method]

    async def run(self, method: Method) -> None:
        try:
            with trio.move_on_after(self.timeout) as scope:
                try:
                    await self._ask(method)
                except (PortMappingError, OSError) as e:
                    self.failures[method] = _describe(e, method)
            if scope.cancelled_caught:
                self.failures[method] = f"no answer within {self.timeout:g} s"
        finally:
            self.done[method].set()

    async def _ask(self, method: Method) -> None:
        if method == "pcp":
            await pcp_announce(self.gateway, self.local_ip)
            self.pcp = True
        elif method == "natpmp":
            self.natpmp_external_ip = await natpmp_external_address(self.gateway)
        else:
            self.upnp, self.upnp_external_ip = await discover_upnp(self.gateway, self.local_ip, timeout=self.timeout)

    def support(self) -> GatewaySupport:
        return GatewaySupport(
            self.gateway, self.local_ip, self.pcp, self.natpmp_external_ip, self.upnp, self.upnp_external_ip, dict(self.failures)
        )


async def probe(*, gateway: str | None = None, timeout: float = 3.0, methods: Sequence[Method] = ALL_METHODS) -> GatewaySupport:
    """Ask the gateway, changing nothing, which methods it offers.

    PCP ANNOUNCE, a NAT-PMP external address request and UPnP discovery (with
    GetExternalIPAddress) run in parallel, all within ``timeout``. Raises
    :class:`PortMappingUnavailable` only when there is no gateway to ask.
    """
    discovery = _Discovery(*_resolve_gateway(gateway), timeout)
    async with trio.open_nursery() as nursery:
        for method in methods:
            nursery.start_soon(discovery.run, method)
    return discovery.support()



# ---------------------------------------------------------------------- the mapping a caller holds


@dataclass
class PortMapping:
    """A forward from ``external_ip:external_port`` to our ``internal_port``.

    Kept up to date while its :func:`map_port` block runs: a renewal may move it
    to another external port (the router rebooted and the port was taken), so
    read the attributes when advertising, not once. ``lifetime`` is what the
    gateway granted, 0 for a permanent lease (UPnP routers that allow no other);
    ``error`` is the last renewal failure, None once a renewal succeeds again.
    """

    method: Method
    protocol: Protocol
    internal_ip: str
    internal_port: int
    external_ip: str
    external_port: int
    gateway: str
    lifetime: int
    renewals: int = 0
    error: PortMappingError | None = None
    expires_at: float = float("inf")

    @property
    def multiaddr(self) -> str:
        """The mapping as a multiaddr for advertising (TCP or UDP, no peer id)."""
        return f"/ip4/{self.external_ip}/{self.protocol.lower()}/{self.external_port}"


async def _establish(
    internal_port: int,
    protocol: Protocol,
    lifetime: int,
    gateway: str | None,
    external_port: int,
    methods: Sequence[Method],
    timeout: float,
    discovery_timeout: float,
    delete_timeout: float,
) -> tuple[PortMapping, _Mapper]:
    """Discover in parallel, map with the first method in ``methods`` order that works."""
    attempts: list[tuple[str, str]] = []
    gw, local_ip = _resolve_gateway(gateway)
    result: list[tuple[PortMapping, _Mapper]] = []
    with trio.move_on_after(timeout) as scope:
        discovery = _Discovery(gw, local_ip, min(discovery_timeout, timeout))
        async with trio.open_nursery() as nursery:
            for method in methods:
                nursery.start_soon(discovery.run, method)
            for method in methods:
                await discovery.done[method].wait()
                if not discovery.offers(method):
                    attempts.append((method, discovery.failures.get(method, "not offered")))
                    continue
                mapper: _Mapper
                if method == "pcp":
                    mapper = _PcpMapper(gw, local_ip, protocol, internal_port)
                elif method == "natpmp":
                    mapper = _NatPmpMapper(gw, protocol, internal_port)
                else:
                    assert discovery.upnp is not None
                    mapper = _UpnpMapper(discovery.upnp, protocol, internal_port, call_timeout=min(5.0, timeout))
                try:
                    grant = await mapper.map(external_port, lifetime)
                except (PortMappingError, OSError) as e:
                    attempts.append((method, _describe(e, method)))
                    continue
                except trio.Cancelled:
                    # Timed out or cancelled with a request in flight: the gateway may
                    # have made the mapping all the same. Nobody would delete it.
                    await _unmap_quietly(mapper, delete_timeout)
                    raise
                internal_ip = mapper.gateway.local_ip if isinstance(mapper, _UpnpMapper) else local_ip
                mapping = PortMapping(
                    method, protocol, internal_ip, internal_port, grant.external_ip, grant.external_port, gw, grant.lifetime
                )
                if grant.lifetime:
                    mapping.expires_at = trio.current_time() + grant.lifetime
                result.append((mapping, mapper))
                nursery.cancel_scope.cancel()  # the slower discoveries are moot
                break
    if result:
        return result[0]
    if scope.cancelled_caught:
        attempts.append(("timeout", f"gave up after {timeout:g} s"))
    raise PortMappingUnavailable(f"the gateway {gw} made no port mapping for {protocol} port {internal_port}", attempts)


#: After a failed renewal, try again within this long (and sooner near expiry).
RENEW_RETRY_MAX = 60.0
#: ... and never sooner than this.
RENEW_RETRY_MIN = 1.0


def renewal_retry_delay(expires_at: float, now: float) -> float:
    """How long after a failed renewal to try again: half the time left before expiry, so a lease
    is kept while the gateway answers now and then; once it has expired, as long as it has been
    gone, so the retries space out (doubling) up to :data:`RENEW_RETRY_MAX`. Before, the retries
    after expiry came every second for good: a laptop that left the network its mapping was made
    on logged a warning and sent a packet toward the old gateway each second while it ran."""
    left = expires_at - now
    return max(RENEW_RETRY_MIN, min(RENEW_RETRY_MAX, left / 2 if left > 0 else -left))


async def _keep_renewed(mapper: _Mapper, mapping: PortMapping, lifetime: int, call_timeout: float) -> None:
    """Renew halfway to expiry, like DHCP (RFC 6886 section 3.3); never raises.

    A failure is recorded in ``mapping.error`` and retried (:func:`renewal_retry_delay`): after
    expiry too, since a router that rebooted forgets its mappings but will take a new one.
    """
    while mapping.lifetime:
        now = trio.current_time()
        if mapping.error is None:
            await trio.sleep_until(now + mapping.lifetime / 2)
        else:
            await trio.sleep(renewal_retry_delay(mapping.expires_at, now))
        try:
            with trio.fail_after(call_timeout):
                grant = await mapper.map(mapping.external_port, lifetime)
        except (PortMappingError, OSError, trio.TooSlowError) as e:
            error = e if isinstance(e, PortMappingError) else PortMappingError(f"{mapper.method}: renewal failed: {_describe(e)}")
            log.warning("port mapping renewal failed: %s", error)
            mapping.error = error
            continue
        if grant.external_port != mapping.external_port or grant.external_ip != mapping.external_ip:
            log.info("port mapping moved to %s:%s", grant.external_ip, grant.external_port)
        mapping.external_ip, mapping.external_port, mapping.lifetime = grant.external_ip, grant.external_port, grant.lifetime
        mapping.expires_at = trio.current_time() + grant.lifetime if grant.lifetime else float("inf")
        mapping.renewals += 1
        mapping.error = None


@dataclass
class PortMappingConfig:
    """How the NAT layer asks the router for a forward (its defaults are :func:`map_port`'s)."""

    enabled: bool = True
    #: The gateway to ask (None: the default route's).
    gateway: str | None = None
    methods: tuple[Method, ...] = ALL_METHODS
    #: Lease asked for, in seconds; renewed halfway.
    lifetime: int = 3600
    timeout: float = 10.0
    discovery_timeout: float = 3.0
    delete_timeout: float = 3.0

    def validate(self) -> None:
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        if unknown or not self.methods:
            raise ConfigError(f"port mapping methods must be among {ALL_METHODS}, not {tuple(self.methods)!r}")
        if not 1 <= self.lifetime < 2**32:
            raise ConfigError(f"port mapping lifetime must be at least 1 second, not {self.lifetime}")
        for name in ("timeout", "discovery_timeout", "delete_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"port mapping {name} must be positive")


@asynccontextmanager
async def map_port(
    internal_port: int,
    *,
    protocol: Protocol = "TCP",
    lifetime: int = 3600,
    gateway: str | None = None,
    external_port: int = 0,
    methods: Sequence[Method] = ALL_METHODS,
    timeout: float = 10.0,
    discovery_timeout: float = 3.0,
    delete_timeout: float = 3.0,
    config: PortMappingConfig | None = None,
) -> AsyncIterator[PortMapping]:
    """Forward a port on the home router to ``internal_port`` for the block's duration.

    Asks the gateway (the default route's, unless given) about every method in
    parallel, each within ``discovery_timeout``, and maps with the first of
    ``methods`` in order that it offers, all within ``timeout``; ``external_port``
    is a wish (0: the same as ``internal_port``). The mapping is renewed in the
    background before it expires and deleted on exit (shielded, at most
    ``delete_timeout`` seconds, best effort: a lease ends by itself anyway).

    ``config`` (the NAT layer's :class:`PortMappingConfig`) replaces the
    gateway, methods, lifetime and timeouts given one by one.

    Raises :class:`PortMappingUnavailable`, listing each method and why it
    failed, when no mapping could be made.
    """
    if config is not None:
        config.validate()
        gateway, methods, lifetime = config.gateway, config.methods, config.lifetime
        timeout, discovery_timeout, delete_timeout = config.timeout, config.discovery_timeout, config.delete_timeout
    _check_port(internal_port, "internal port")
    _check_port(external_port, "external port", allow_zero=True)
    if protocol not in ("TCP", "UDP"):
        raise ConfigError(f"protocol must be 'TCP' or 'UDP', not {protocol!r}")
    if not 1 <= lifetime < 2**32:
        raise ConfigError(f"lifetime must be at least 1 second, not {lifetime}")
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown or not methods:
        raise ConfigError(f"methods must be among {ALL_METHODS}, not {tuple(methods)!r}")
    mapping, mapper = await _establish(
        internal_port, protocol, lifetime, gateway, external_port, methods, timeout, discovery_timeout, delete_timeout
    )
    log.info(
        "mapped %s %s:%d -> %s:%d via %s",
        protocol, mapping.external_ip, mapping.external_port, mapping.internal_ip, internal_port, mapping.method,
    )
    try:
        with unwrap_single_group():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_keep_renewed, mapper, mapping, lifetime, timeout)
                try:
                    yield mapping
                finally:
                    nursery.cancel_scope.cancel()
    finally:
        await _unmap_quietly(mapper, delete_timeout)


async def _unmap_quietly(mapper: _Mapper, timeout: float) -> None:
    """Delete a mapping on the way out: shielded, bounded, failures only logged (a lease lapses anyway)."""
    with trio.CancelScope(shield=True), trio.move_on_after(timeout) as scope:
        try:
            await mapper.unmap()
        except (PortMappingError, OSError) as e:
            log.warning("could not delete the %s port mapping: %s", mapper.method, e)
    if scope.cancelled_caught:
        log.warning("deleting the %s port mapping took over %g s; it lapses with its lease", mapper.method, timeout)
