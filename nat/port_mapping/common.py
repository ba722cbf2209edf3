"""What the three port-mapping protocols share: constants, errors, the gateway and local address, UDP exchanges, the mapper interface."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket as stdsocket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import trio

from p2p.errors import ConfigError, DedlocError


log = logging.getLogger(__name__)

Protocol = Literal["TCP", "UDP"]
Method = Literal["pcp", "natpmp", "upnp"]
#: The order :func:`map_port` tries: PCP and NAT-PMP leases expire by themselves
#: if we vanish; many UPnP routers keep a forward until reboot.
ALL_METHODS: tuple[Method, ...] = ("pcp", "natpmp", "upnp")

#: NAT-PMP and PCP servers listen here (RFC 6886 section 3, RFC 6887 section 19.1).
PMP_PORT = 5351
PCP_VERSION = 2
SSDP_GROUP = "239.255.255.250"
SSDP_PORT = 1900
#: UPnP Device Architecture: TTL 2 by default; never more, so a search stays in the home.
SSDP_TTL = 2
#: Device descriptions, SOAP bodies: a router's are a few KiB.
MAX_XML = 64 * 1024
MAX_HTTP_HEAD = 16 * 1024
MAX_SSDP_DATAGRAM = 8 * 1024
#: RFC 6887 section 7: no PCP message is longer.
MAX_PCP_MESSAGE = 1100
#: IGDv2 caps leases at a week; IGDv1 routers accept it too.
MAX_UPNP_LEASE = 604800

IGD_SEARCH_TARGETS = (
    "urn:schemas-upnp-org:device:InternetGatewayDevice:2",
    "urn:schemas-upnp-org:device:InternetGatewayDevice:1",
    "urn:schemas-upnp-org:service:WANIPConnection:2",
    "urn:schemas-upnp-org:service:WANIPConnection:1",
    "urn:schemas-upnp-org:service:WANPPPConnection:1",
)
#: Best first: IP over PPP (a router listing both usually uses the IP one), v2 over v1.
WAN_SERVICE_TYPES = (
    "urn:schemas-upnp-org:service:WANIPConnection:2",
    "urn:schemas-upnp-org:service:WANIPConnection:1",
    "urn:schemas-upnp-org:service:WANPPPConnection:1",
)


# ---------------------------------------------------------------------- errors


class PortMappingError(DedlocError):
    """A port mapping could not be made, kept or removed."""


class MalformedResponse(PortMappingError, ValueError):
    """A gateway's reply is garbled, truncated, oversized or not what was asked for."""


class MappingRefused(PortMappingError):
    """The gateway understood the request and said no: ``code`` is its result code.

    ``method`` says which protocol's codes those are (PCP, NAT-PMP and UPnP number
    differently); ``reason`` is the code's meaning, with a hint where one helps.
    """

    def __init__(self, method: Method, code: int, reason: str):
        self.method = method
        self.code = code
        self.reason = reason
        super().__init__(f"{method}: the gateway refused (code {code}: {reason})")


class PortMappingUnavailable(PortMappingError):
    """No method produced a mapping; ``attempts`` lists what was tried and why it failed."""

    def __init__(self, message: str, attempts: list[tuple[str, str]] | None = None):
        self.attempts = attempts or []
        detail = "".join(f"\n  {what}: {why}" for what, why in self.attempts)
        super().__init__(message + detail)


# ---------------------------------------------------------------------- gateway and local address


def parse_default_gateway(proc_net_route: str, *, byteorder: str = sys.byteorder) -> str | None:
    """The IPv4 default gateway in a ``/proc/net/route`` text, lowest metric first; None if none.

    The kernel prints addresses as the raw 32-bit word in host byte order, hence
    ``byteorder`` (tests pin it).
    """
    best: tuple[int, str] | None = None
    for line in proc_net_route.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            dest, gw, flags, metric, mask = (int(fields[i], 16) for i in (1, 2, 3, 6, 7))
        except ValueError:
            continue
        rtf_up, rtf_gateway = 0x1, 0x2
        if dest != 0 or mask != 0 or flags & (rtf_up | rtf_gateway) != (rtf_up | rtf_gateway) or gw == 0:
            continue
        address = stdsocket.inet_ntoa(gw.to_bytes(4, cast(Literal["little", "big"], byteorder)))
        if best is None or metric < best[0]:
            best = (metric, address)
    return best[1] if best else None


def default_gateway() -> str | None:
    """The default gateway of this network namespace (procfs: a read that never blocks)."""
    try:
        with open("/proc/net/route", encoding="ascii", errors="replace") as f:
            return parse_default_gateway(f.read())
    except OSError:
        return None


def local_address_towards(host: str) -> str:
    """Our source address for packets to ``host``: connecting a UDP socket sends nothing."""
    with stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM) as s:
        s.connect((host, PMP_PORT))
        return str(s.getsockname()[0])


def _ipv4(text: str, what: str) -> ipaddress.IPv4Address:
    try:
        return ipaddress.IPv4Address(text)
    except ValueError:
        raise ConfigError(f"{what} must be an IPv4 address, not {text!r}") from None


def _check_port(port: int, what: str, *, allow_zero: bool = False) -> None:
    if not isinstance(port, int) or not (0 if allow_zero else 1) <= port <= 65535:
        raise ConfigError(f"{what} must be a port number 1-65535, not {port!r}")



# ---------------------------------------------------------------------- UDP request/response (NAT-PMP, PCP)

T = TypeVar("T")


async def _udp_exchange(
    gateway: str,
    request: bytes,
    accept: Callable[[bytes], T | None],
    delays: Sequence[float],
    *,
    what: str,
    port: int = PMP_PORT,
) -> T:
    """Send ``request`` to the gateway's ``port`` (5351) on a schedule until ``accept`` takes a reply.

    ``accept`` returns None for a reply to some other request (ignored) and
    raises :class:`MappingRefused` for a definitive no. The socket is connected,
    so the kernel drops datagrams from anyone but the gateway and an ICMP port
    unreachable ends the wait at once. The caller bounds the total time too. A gateway with no
    route to it fails at the connect, before anything is sent, with the same clear error.
    """
    last_error: MalformedResponse | None = None
    with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as sock:
        try:
            await sock.connect((gateway, port))
            for delay in delays:
                await sock.send(request)
                with trio.move_on_after(delay):
                    while True:
                        data = await sock.recv(MAX_PCP_MESSAGE + 1)
                        try:
                            result = accept(data)
                        except MalformedResponse as e:
                            last_error = e
                            continue
                        if result is not None:
                            return result
        except ConnectionRefusedError:
            raise PortMappingError(f"{what}: nothing listens on {gateway}:{port} (ICMP port unreachable)") from None
        except OSError as e:
            if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                raise PortMappingError(f"{what}: {gateway} is unreachable ({e.strerror})") from None
            raise
    detail = f" (last reply: {last_error})" if last_error else ""
    raise PortMappingError(f"{what}: no answer from {gateway}:{port} after {len(delays)} tries{detail}")



def _describe(e: BaseException, method: str = "") -> str:
    """A failure as one line; ``method`` drops the "method: " prefix where a list already names it."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e) or type(e).__name__
    return text.removeprefix(f"{method}: ") if method else text


# ---------------------------------------------------------------------- mappers: one per method


@dataclass
class _Grant:
    external_ip: str
    external_port: int
    lifetime: int


class _Mapper:
    method: Method

    async def map(self, external_port: int, lifetime: int) -> _Grant:
        raise NotImplementedError

    async def unmap(self) -> None:
        raise NotImplementedError
