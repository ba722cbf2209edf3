"""Ask the home router to forward our listen port: PCP, NAT-PMP or UPnP IGD.

Why: a volunteer behind a home NAT cannot be dialled, so every byte to it goes
through a relay or waits for hole punching. Many home routers (miniupnpd in
OpenWrt and many vendor firmwares, Apple base stations, FRITZ!Box) will forward
a port on request; with a forward the node is directly reachable and serves
others at full speed. :func:`map_port` asks, keeps the forward alive while the
``async with`` block runs, and removes it on exit.

Three protocols, because routers speak different subsets:

* PCP (RFC 6887) MAP, the successor of NAT-PMP: one UDP exchange with port 5351,
  a nonce that makes the mapping ours alone.
* NAT-PMP (RFC 6886): the same port, the older and more widespread message set.
* UPnP IGD: SSDP discovery, the device description over HTTP, then SOAP calls to
  the WANIPConnection/WANPPPConnection control URL.

Layout: each wire format is pure functions (``*_request`` builds bytes,
``decode_*``/``parse_*`` turn bytes into values or raise) tested without
sockets; thin trio I/O below them; :func:`probe` and :func:`map_port` on top.

What may leave the host: UDP to the default gateway (or the one given) on port
5351, SSDP M-SEARCH unicast to it and multicast to 239.255.255.250 with
``IP_MULTICAST_TTL`` 2 from the interface facing it, and HTTP to the address
that answered the search. Nothing else: LOCATION and control URLs must be IP
literals of the host that answered, so a forged SSDP reply cannot send us
anywhere. Every read is capped (:data:`MAX_XML` for bodies) and every wait has a
timeout.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import random
import re
import secrets
import socket as stdsocket
import struct
import sys
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar, cast
from urllib.parse import urljoin, urlsplit
from xml.sax.saxutils import escape

import trio

from p2p.errors import ConfigError, DedlocError
from p2p.trio_util import unwrap_single_group

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


# ---------------------------------------------------------------------- NAT-PMP (RFC 6886), sans-I/O

NATPMP_RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized or refused (port mapping switched off on the router?)",
    3: "network failure (the router has no external address yet?)",
    4: "out of resources (the router has no free port or mapping slot)",
    5: "unsupported opcode",
}
_NATPMP_OPCODES: dict[Protocol, int] = {"UDP": 1, "TCP": 2}


@dataclass(frozen=True)
class NatPmpAddress:
    """Answer to the external address request."""

    epoch: int
    external_ip: str


@dataclass(frozen=True)
class NatPmpMapping:
    """Answer to a map request; ``lifetime`` 0 confirms a deletion."""

    epoch: int
    protocol: Protocol
    internal_port: int
    external_port: int
    lifetime: int


def natpmp_address_request() -> bytes:
    """Version 0, opcode 0: "what is your external address?"."""
    return b"\x00\x00"


def natpmp_map_request(protocol: Protocol, internal_port: int, external_port: int, lifetime: int) -> bytes:
    """Map ``internal_port``; ``external_port`` is only a suggestion, 0 for "any"."""
    _check_port(internal_port, "internal port")
    _check_port(external_port, "suggested external port", allow_zero=True)
    if not 0 <= lifetime < 2**32:
        raise ConfigError(f"lifetime must fit 32 bits, not {lifetime}")
    return struct.pack("!BBHHHI", 0, _NATPMP_OPCODES[protocol], 0, internal_port, external_port, lifetime)


def natpmp_delete_request(protocol: Protocol, internal_port: int) -> bytes:
    """RFC 6886 section 3.4: lifetime 0 and suggested external port 0 delete a mapping."""
    return natpmp_map_request(protocol, internal_port, 0, 0)


def decode_natpmp_response(data: bytes) -> NatPmpAddress | NatPmpMapping:
    """Decode a NAT-PMP response; a non-zero result code raises :class:`MappingRefused`.

    The result code is checked before the length: gateways answer errors with
    just the 8-byte header (miniupnpd does).
    """
    if len(data) < 8:
        raise MalformedResponse(f"natpmp: {len(data)}-byte reply, shorter than the 8-byte header")
    version, opcode, result, epoch = struct.unpack_from("!BBHI", data)
    if version == PCP_VERSION and opcode & 0x80:
        raise MappingRefused("natpmp", 1, "unsupported version: the gateway speaks PCP only (answered version 2)")
    if version != 0:
        raise MalformedResponse(f"natpmp: reply has version {version}, not 0")
    if not opcode & 0x80:
        raise MalformedResponse(f"natpmp: opcode {opcode} is a request, not a response")
    if result != 0:
        raise MappingRefused("natpmp", result, NATPMP_RESULTS.get(result, "unknown result code"))
    op = opcode & 0x7F
    if op == 0:
        if len(data) < 12:
            raise MalformedResponse(f"natpmp: {len(data)}-byte address reply, expected 12")
        return NatPmpAddress(epoch, stdsocket.inet_ntoa(data[8:12]))
    if op in (1, 2):
        if len(data) < 16:
            raise MalformedResponse(f"natpmp: {len(data)}-byte mapping reply, expected 16")
        internal, external, lifetime = struct.unpack_from("!HHI", data, 8)
        return NatPmpMapping(epoch, "UDP" if op == 1 else "TCP", internal, external, lifetime)
    raise MalformedResponse(f"natpmp: unknown response opcode {opcode}")


def natpmp_retransmit_delays() -> list[float]:
    """RFC 6886 section 3.1: 250 ms, doubling, nine tries (64 s in all; callers bound it)."""
    return [0.25 * 2**i for i in range(9)]


# ---------------------------------------------------------------------- PCP (RFC 6887), sans-I/O

PCP_OPCODE_ANNOUNCE = 0
PCP_OPCODE_MAP = 1
PCP_RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized (mapping switched off, or not allowed for this host or port)",
    3: "malformed request",
    4: "unsupported opcode",
    5: "unsupported option",
    6: "malformed option",
    7: "network failure (the router has no external address yet?)",
    8: "no resources (the router has no free port or mapping slot)",
    9: "unsupported protocol",
    10: "user exceeded quota",
    11: "cannot provide the external port or address asked for",
    12: "address mismatch (another NAT between us and the PCP server)",
    13: "excessive remote peers",
}
_IP_PROTOCOLS: dict[Protocol, int] = {"TCP": 6, "UDP": 17}
_PCP_HEADER = struct.Struct("!BBBBII12x")  # version, R|opcode, reserved, result, lifetime, epoch
_PCP_MAP = struct.Struct("!12sB3xHH16s")  # nonce, protocol, internal port, external port, external IP


@dataclass(frozen=True)
class PcpAnnounce:
    """Answer to ANNOUNCE: the server speaks PCP; ``epoch`` is its uptime as it counts it."""

    epoch: int


@dataclass(frozen=True)
class PcpMapping:
    """Answer to MAP; ``lifetime`` 0 confirms a deletion."""

    epoch: int
    lifetime: int
    nonce: bytes
    protocol: Protocol
    internal_port: int
    external_port: int
    external_ip: str


def _mapped(ip: str) -> bytes:
    """IPv4 as the IPv4-mapped IPv6 address PCP carries (``::ffff:a.b.c.d``)."""
    return b"\x00" * 10 + b"\xff\xff" + _ipv4(ip, "PCP address").packed


def _unmapped(raw: bytes) -> str:
    address = ipaddress.IPv6Address(raw)
    return str(address.ipv4_mapped) if address.ipv4_mapped is not None else str(address)


def _pcp_request_header(opcode: int, lifetime: int, client_ip: str) -> bytes:
    if not 0 <= lifetime < 2**32:
        raise ConfigError(f"lifetime must fit 32 bits, not {lifetime}")
    return struct.pack("!BBHI", PCP_VERSION, opcode, 0, lifetime) + _mapped(client_ip)


def pcp_announce_request(client_ip: str) -> bytes:
    """ANNOUNCE (RFC 6887 section 14.1): a side-effect-free "do you speak PCP?"."""
    return _pcp_request_header(PCP_OPCODE_ANNOUNCE, 0, client_ip)


def pcp_map_request(
    nonce: bytes,
    protocol: Protocol,
    internal_port: int,
    external_port: int,
    lifetime: int,
    client_ip: str,
    external_ip: str = "0.0.0.0",
) -> bytes:
    """MAP ``internal_port``; lifetime 0 with the same nonce deletes the mapping.

    ``client_ip`` must be our source address as the server sees it, or it answers
    ADDRESS_MISMATCH; the external port and address are suggestions (0 for any).
    """
    if len(nonce) != 12:
        raise ConfigError("a PCP mapping nonce is 12 bytes")
    _check_port(internal_port, "internal port")
    _check_port(external_port, "suggested external port", allow_zero=True)
    body = _PCP_MAP.pack(nonce, _IP_PROTOCOLS[protocol], internal_port, external_port, _mapped(external_ip))
    return _pcp_request_header(PCP_OPCODE_MAP, lifetime, client_ip) + body


def decode_pcp_response(data: bytes) -> PcpAnnounce | PcpMapping:
    """Decode a PCP response; a non-zero result code raises :class:`MappingRefused`.

    A NAT-PMP-only gateway answers a PCP request with a NAT-PMP "unsupported
    version" (version byte 0): that is a refusal too, saying which one it is.
    """
    if len(data) > MAX_PCP_MESSAGE:
        raise MalformedResponse(f"pcp: {len(data)}-byte reply, longer than PCP allows ({MAX_PCP_MESSAGE})")
    if len(data) >= 4 and data[0] == 0 and data[1] & 0x80:
        result = struct.unpack_from("!H", data, 2)[0]
        raise MappingRefused("pcp", result, "the gateway speaks NAT-PMP only (answered version 0)")
    if len(data) < _PCP_HEADER.size:
        raise MalformedResponse(f"pcp: {len(data)}-byte reply, shorter than the 24-byte header")
    version, r_opcode, _, result, lifetime, epoch = _PCP_HEADER.unpack_from(data)
    if not r_opcode & 0x80:
        raise MalformedResponse(f"pcp: opcode {r_opcode} is a request, not a response")
    if result == 1 and version != PCP_VERSION:
        raise MappingRefused("pcp", result, f"unsupported version (the gateway speaks PCP version {version})")
    if version != PCP_VERSION:
        raise MalformedResponse(f"pcp: reply has version {version}, not {PCP_VERSION}")
    if result != 0:
        raise MappingRefused("pcp", result, PCP_RESULTS.get(result, "unknown result code"))
    opcode = r_opcode & 0x7F
    if opcode == PCP_OPCODE_ANNOUNCE:
        return PcpAnnounce(epoch)
    if opcode == PCP_OPCODE_MAP:
        if len(data) < _PCP_HEADER.size + _PCP_MAP.size:
            raise MalformedResponse(f"pcp: {len(data)}-byte MAP reply, expected at least 60")
        nonce, proto, internal, external, ext_ip = _PCP_MAP.unpack_from(data, _PCP_HEADER.size)
        names = {v: k for k, v in _IP_PROTOCOLS.items()}
        if proto not in names:
            raise MalformedResponse(f"pcp: MAP reply for IP protocol {proto}, not TCP or UDP")
        return PcpMapping(epoch, lifetime, nonce, names[proto], internal, external, _unmapped(ext_ip))
    raise MalformedResponse(f"pcp: unexpected response opcode {opcode}")


def pcp_retransmit_delays(rng: random.Random | None = None) -> list[float]:
    """RFC 6887 section 8.1.1: 3 s, doubling, each +-10 % (callers bound the total)."""
    rng = rng or random.Random()
    return [3.0 * 2**i * (1 + rng.uniform(-0.1, 0.1)) for i in range(8)]


# ---------------------------------------------------------------------- HTTP/1.1, sans-I/O


@dataclass(frozen=True)
class HttpResponse:
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes


def http_request(method: str, url: str, *, headers: Sequence[tuple[str, str]] = (), body: bytes = b"") -> bytes:
    """A one-shot HTTP/1.1 request (``Connection: close``: one request per connection)."""
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    for line in lines:
        if "\r" in line or "\n" in line:
            raise ConfigError(f"line break in an HTTP header: {line!r}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def parse_http_response(buf: bytes, *, eof: bool, max_body: int = MAX_XML) -> HttpResponse | None:
    """The response in ``buf`` if complete, None if more bytes are needed.

    Content-Length, chunked and close-delimited bodies; raises
    :class:`MalformedResponse` on garbage, a header over :data:`MAX_HTTP_HEAD`, a
    body over ``max_body``, or a connection closed (``eof``) mid-message.
    """
    end = buf.find(b"\r\n\r\n")
    if end < 0 or end > MAX_HTTP_HEAD:
        if end > MAX_HTTP_HEAD or len(buf) > MAX_HTTP_HEAD:
            raise MalformedResponse(f"HTTP header longer than {MAX_HTTP_HEAD} bytes")
        if eof:
            raise MalformedResponse("connection closed before the HTTP header ended")
        return None
    lines = buf[:end].decode("latin-1").split("\r\n")
    match = re.fullmatch(r"HTTP/1\.[01] (\d{3})(?: (.*))?", lines[0])
    if not match:
        raise MalformedResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status, reason = int(match[1]), match[2] or ""
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise MalformedResponse(f"malformed HTTP header line {line[:80]!r}")
        key = name.lower()
        if key in headers and key in ("content-length", "transfer-encoding"):
            raise MalformedResponse(f"HTTP header {name} given twice")
        headers[key] = value.strip()
    rest = buf[end + 4 :]
    if 100 <= status < 200:
        return parse_http_response(rest, eof=eof, max_body=max_body)  # 100 Continue and friends
    if status in (204, 304):
        return HttpResponse(status, reason, headers, b"")
    if "transfer-encoding" in headers:
        if headers["transfer-encoding"].lower() != "chunked":
            raise MalformedResponse(f"unsupported Transfer-Encoding {headers['transfer-encoding']!r}")
        body = _dechunk(rest, eof=eof, max_body=max_body)
        return None if body is None else HttpResponse(status, reason, headers, body)
    if "content-length" in headers:
        text = headers["content-length"]
        if not text.isdigit() or len(text) > 12:
            raise MalformedResponse(f"bad Content-Length {text[:20]!r}")
        length = int(text)
        if length > max_body:
            raise MalformedResponse(f"HTTP body of {length} bytes, more than the {max_body} allowed")
        if len(rest) < length:
            if eof:
                raise MalformedResponse(f"connection closed after {len(rest)} of {length} body bytes")
            return None
        return HttpResponse(status, reason, headers, rest[:length])
    if len(rest) > max_body:
        raise MalformedResponse(f"HTTP body longer than the {max_body} bytes allowed")
    return HttpResponse(status, reason, headers, rest) if eof else None


def _dechunk(data: bytes, *, eof: bool, max_body: int) -> bytes | None:
    body = bytearray()
    pos = 0
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            if len(data) - pos > 1024:
                raise MalformedResponse("chunk size line too long")
            break
        size_text = data[pos:line_end].split(b";", 1)[0].strip()
        if not size_text or len(size_text) > 8 or not re.fullmatch(rb"[0-9a-fA-F]+", size_text):
            raise MalformedResponse(f"bad chunk size {size_text[:20]!r}")
        size = int(size_text, 16)
        if len(body) + size > max_body:
            raise MalformedResponse(f"chunked HTTP body longer than the {max_body} bytes allowed")
        start = line_end + 2
        if size == 0:
            # Trailer fields, then an empty line.
            while True:
                trailer_end = data.find(b"\r\n", start)
                if trailer_end < 0:
                    if len(data) - start > MAX_HTTP_HEAD:
                        raise MalformedResponse("HTTP trailer too long")
                    break
                if trailer_end == start:
                    return bytes(body)
                start = trailer_end + 2
            break
        if len(data) < start + size + 2:
            break
        if data[start + size : start + size + 2] != b"\r\n":
            raise MalformedResponse("chunk not followed by CRLF")
        body += data[start : start + size]
        pos = start + size + 2
    if eof:
        raise MalformedResponse("connection closed in the middle of a chunked body")
    return None


# ---------------------------------------------------------------------- SSDP and the device description, sans-I/O


@dataclass(frozen=True)
class SsdpResponse:
    location: str
    st: str
    usn: str
    server: str


def ssdp_search_request(st: str, *, host: str = f"{SSDP_GROUP}:{SSDP_PORT}", mx: int | None = 1) -> bytes:
    """An M-SEARCH for ``st``; unicast searches (UDA 1.1) carry no MX."""
    lines = ["M-SEARCH * HTTP/1.1", f"HOST: {host}", 'MAN: "ssdp:discover"', f"ST: {st}"]
    if mx is not None:
        lines.append(f"MX: {mx}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


def parse_ssdp_response(data: bytes) -> SsdpResponse:
    """Parse an M-SEARCH answer; raises :class:`MalformedResponse` for anything else."""
    if len(data) > MAX_SSDP_DATAGRAM:
        raise MalformedResponse(f"SSDP reply of {len(data)} bytes, more than {MAX_SSDP_DATAGRAM}")
    text = data.decode("latin-1")
    head, _, _ = text.partition("\r\n\r\n")
    lines = head.split("\r\n")
    if not re.fullmatch(r"HTTP/1\.[01] 200(?: .*)?", lines[0]):
        raise MalformedResponse(f"not an SSDP search answer: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    location = headers.get("location", "")
    if not location:
        raise MalformedResponse("SSDP answer without LOCATION")
    if urlsplit(location).scheme != "http":
        raise MalformedResponse(f"SSDP LOCATION is not an http URL: {location[:80]!r}")
    return SsdpResponse(location, headers.get("st", ""), headers.get("usn", ""), headers.get("server", ""))


@dataclass(frozen=True)
class IgdService:
    """A WAN connection service of an Internet gateway: where to send SOAP, and in whose namespace."""

    service_type: str
    control_url: str


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def parse_xml(body: bytes) -> ET.Element:
    """Parse a capped, DTD-free XML document.

    UPnP documents never need a DTD; refusing one rules out entity expansion
    (billion laughs) and external entities before expat sees them.
    """
    if len(body) > MAX_XML:
        raise MalformedResponse(f"XML document of {len(body)} bytes, more than the {MAX_XML} allowed")
    if re.search(rb"<!\s*(DOCTYPE|ENTITY)", body, re.IGNORECASE):
        raise MalformedResponse("XML with a DTD or entity declaration refused")
    try:
        return ET.fromstring(body)
    except ET.ParseError as e:
        raise MalformedResponse(f"XML does not parse: {e}") from None


def _child_text(element: ET.Element, name: str) -> str:
    for child in element:
        if _local(child.tag) == name:
            return (child.text or "").strip()
    return ""


def _same_host_http_url(url: str, host: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise MalformedResponse(f"{what} is not an http URL: {url[:120]!r}")
    try:
        ipaddress.IPv4Address(parts.hostname)
    except ValueError:
        raise MalformedResponse(f"{what} names a host, not an IPv4 address: {url[:120]!r}") from None
    if parts.hostname != host:
        raise MalformedResponse(f"{what} points at {parts.hostname}, not the device at {host}")
    try:
        _ = parts.port
    except ValueError:
        raise MalformedResponse(f"{what} has a bad port: {url[:120]!r}") from None
    return url


def parse_device_description(body: bytes, location: str) -> list[IgdService]:
    """The WAN connection services in a device description, best first.

    Control URLs are resolved against URLBase (UPnP 1.0) or the description's
    own URL, and must stay on the same host as ``location``.
    """
    root = parse_xml(body)
    base = location
    for element in root.iter():
        if _local(element.tag) == "URLBase" and (element.text or "").strip():
            base = (element.text or "").strip()
            break
    host = urlsplit(location).hostname or ""
    found: dict[str, IgdService] = {}
    for element in root.iter():
        if _local(element.tag) != "service":
            continue
        service_type = _child_text(element, "serviceType")
        control = _child_text(element, "controlURL")
        if service_type in WAN_SERVICE_TYPES and control and service_type not in found:
            url = _same_host_http_url(urljoin(base, control), host, "controlURL")
            found[service_type] = IgdService(service_type, url)
    if not found:
        raise MalformedResponse("device description lists no WANIPConnection or WANPPPConnection service")
    return [found[t] for t in WAN_SERVICE_TYPES if t in found]


# ---------------------------------------------------------------------- SOAP, sans-I/O

UPNP_ERRORS = {
    401: "Invalid Action",
    402: "Invalid Args",
    501: "Action Failed",
    606: "Action not authorized",
    714: "NoSuchEntryInArray",
    715: "WildCardNotPermittedInSrcIP",
    716: "WildCardNotPermittedInExtPort",
    718: "ConflictInMappingEntry",
    724: "SamePortValuesRequired",
    725: "OnlyPermanentLeasesSupported",
    726: "RemoteHostOnlySupportsWildcard",
    727: "ExternalPortOnlySupportsWildcard",
    728: "NoPortMapsAvailable",
    729: "ConflictWithOtherMechanisms",
    732: "WildCardNotPermittedInIntPort",
}
_SERVICE_TYPE = re.compile(r"urn:[A-Za-z0-9.-]+:service:[A-Za-z0-9.-]+:\d+")


def soap_envelope(service_type: str, action: str, args: Sequence[tuple[str, str]]) -> bytes:
    """The SOAP body for ``action``; values are escaped, the namespace checked."""
    if not _SERVICE_TYPE.fullmatch(service_type):
        raise ConfigError(f"not a UPnP service type: {service_type[:80]!r}")
    if not re.fullmatch(r"[A-Za-z]+", action):
        raise ConfigError(f"not a SOAP action name: {action!r}")
    params = "".join(f"<{name}>{escape(value)}</{name}>" for name, value in args)
    return (
        '<?xml version="1.0"?>\r\n'
        '<s:Envelope xmlns:s="http://schemas.xmlsoap.org/soap/envelope/" '
        's:encodingStyle="http://schemas.xmlsoap.org/soap/encoding/">'
        f'<s:Body><u:{action} xmlns:u="{service_type}">{params}</u:{action}></s:Body></s:Envelope>'
    ).encode("utf-8")


def parse_soap_fault(body: bytes) -> MappingRefused | None:
    """The UPnP error in a SOAP fault, or None when ``body`` holds no fault."""
    root = parse_xml(body)
    fault = next((e for e in root.iter() if _local(e.tag) == "Fault"), None)
    if fault is None:
        return None
    upnp_error = next((e for e in fault.iter() if _local(e.tag) == "UPnPError"), None)
    if upnp_error is None:
        return MappingRefused("upnp", 0, _child_text(fault, "faultstring") or "SOAP fault without a UPnP error")
    code_text = _child_text(upnp_error, "errorCode")
    if not code_text.isdigit():
        raise MalformedResponse(f"SOAP fault with a bad errorCode {code_text[:20]!r}")
    code = int(code_text)
    description = _child_text(upnp_error, "errorDescription") or UPNP_ERRORS.get(code, "unknown error")
    return MappingRefused("upnp", code, description)


def decode_soap_response(status: int, body: bytes, action: str) -> dict[str, str]:
    """The output arguments of ``action``; a fault raises :class:`MappingRefused`."""
    try:
        fault = parse_soap_fault(body)
    except MalformedResponse:
        if status != 200:
            raise MalformedResponse(f"upnp: HTTP {status} from the control URL, body unreadable") from None
        raise
    if fault is not None:
        raise fault
    if status != 200:
        raise MalformedResponse(f"upnp: HTTP {status} from the control URL for {action}")
    root = parse_xml(body)
    response = next((e for e in root.iter() if _local(e.tag) == f"{action}Response"), None)
    if response is None:
        raise MalformedResponse(f"upnp: SOAP reply without {action}Response")
    return {_local(child.tag): (child.text or "").strip() for child in response}


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
    unreachable ends the wait at once. The caller bounds the total time too.
    """
    last_error: MalformedResponse | None = None
    with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as sock:
        await sock.connect((gateway, port))
        for delay in delays:
            try:
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


async def natpmp_external_address(gateway: str, *, port: int = PMP_PORT) -> str:
    """The gateway's external IPv4 address, asked over NAT-PMP."""

    def accept(data: bytes) -> NatPmpAddress | None:
        reply = decode_natpmp_response(data) if len(data) >= 2 and data[1] == 128 else None
        return reply if isinstance(reply, NatPmpAddress) else None

    reply = await _udp_exchange(gateway, natpmp_address_request(), accept, natpmp_retransmit_delays(), what="natpmp", port=port)
    return reply.external_ip


async def natpmp_map(
    gateway: str, protocol: Protocol, internal_port: int, external_port: int, lifetime: int, *, port: int = PMP_PORT
) -> NatPmpMapping:
    """Ask for (lifetime > 0) or delete (lifetime 0) a NAT-PMP mapping of ``internal_port``."""
    request = natpmp_map_request(protocol, internal_port, external_port, lifetime)

    def accept(data: bytes) -> NatPmpMapping | None:
        if len(data) < 2 or data[1] != 128 + _NATPMP_OPCODES[protocol]:
            return None
        reply = decode_natpmp_response(data)
        return reply if isinstance(reply, NatPmpMapping) and reply.internal_port == internal_port else None

    return await _udp_exchange(gateway, request, accept, natpmp_retransmit_delays(), what="natpmp", port=port)


async def pcp_announce(gateway: str, client_ip: str, *, port: int = PMP_PORT) -> PcpAnnounce:
    """ANNOUNCE: does the gateway speak PCP?"""

    def accept(data: bytes) -> PcpAnnounce | None:
        reply = decode_pcp_response(data)
        return reply if isinstance(reply, PcpAnnounce) else None

    return await _udp_exchange(gateway, pcp_announce_request(client_ip), accept, pcp_retransmit_delays(), what="pcp", port=port)


async def pcp_map(
    gateway: str,
    client_ip: str,
    nonce: bytes,
    protocol: Protocol,
    internal_port: int,
    external_port: int,
    lifetime: int,
    *,
    port: int = PMP_PORT,
) -> PcpMapping:
    """Ask for (lifetime > 0) or delete (lifetime 0, same nonce) a PCP mapping."""
    request = pcp_map_request(nonce, protocol, internal_port, external_port, lifetime, client_ip)

    def accept(data: bytes) -> PcpMapping | None:
        if len(data) >= 2 and data[0] == PCP_VERSION and data[1] != 0x80 | PCP_OPCODE_MAP:
            return None
        if len(data) >= 36 and data[0] == PCP_VERSION and data[24:36] != nonce:
            return None  # a reply about another mapping (another nonce), even a refusal, is not ours
        reply = decode_pcp_response(data)
        if not isinstance(reply, PcpMapping) or reply.nonce != nonce or reply.internal_port != internal_port:
            return None
        return reply

    return await _udp_exchange(gateway, request, accept, pcp_retransmit_delays(), what="pcp", port=port)


# ---------------------------------------------------------------------- HTTP and SSDP I/O


async def http_exchange(url: str, request: bytes, *, timeout: float, max_body: int = MAX_XML) -> HttpResponse:
    """Send one request to ``url``'s host (an IPv4 literal) and read the whole, capped, response."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    _ipv4(host, "HTTP host")
    buf = bytearray()
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(request)
                while True:
                    chunk = await stream.receive_some(65536)
                    buf += chunk
                    response = parse_http_response(bytes(buf), eof=not chunk, max_body=max_body)
                    if response is not None:
                        return response
                    if len(buf) > MAX_HTTP_HEAD + 2 * max_body:
                        raise MalformedResponse("HTTP response larger than allowed")
    except trio.TooSlowError:
        raise PortMappingError(f"HTTP to {host}:{port} took longer than {timeout:g} s ({len(buf)} bytes read)") from None
    except trio.BrokenResourceError as e:
        raise PortMappingError(f"HTTP connection to {host}:{port} broke: {_describe(e.__cause__ or e)}") from None


@dataclass(frozen=True)
class UpnpGateway:
    """A UPnP Internet gateway found on the LAN, and our address as it sees us."""

    location: str
    service: IgdService
    local_ip: str
    server: str = ""


async def soap_call(service: IgdService, action: str, args: Sequence[tuple[str, str]], *, timeout: float) -> dict[str, str]:
    """Run one SOAP action on the control URL; faults raise :class:`MappingRefused`."""
    body = soap_envelope(service.service_type, action, args)
    headers = [("Content-Type", 'text/xml; charset="utf-8"'), ("SOAPAction", f'"{service.service_type}#{action}"')]
    request = http_request("POST", service.control_url, headers=headers, body=body)
    response = await http_exchange(service.control_url, request, timeout=timeout)
    return decode_soap_response(response.status, response.body, action)


async def ssdp_search(gateway: str, local_ip: str, *, timeout: float) -> list[tuple[str, SsdpResponse]]:
    """M-SEARCH for Internet gateways; returns (responder, answer), the gateway's first.

    Searches go unicast to the gateway and to the SSDP group on the interface
    holding ``local_ip``, with TTL 2 and no loopback. Ends early once the
    gateway answered; a second round after 0.5 s covers a lost datagram.
    """
    found: list[tuple[str, SsdpResponse]] = []
    seen: set[str] = set()
    with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as sock:
        sock.setsockopt(stdsocket.IPPROTO_IP, stdsocket.IP_MULTICAST_TTL, SSDP_TTL)
        sock.setsockopt(stdsocket.IPPROTO_IP, stdsocket.IP_MULTICAST_LOOP, 0)
        sock.setsockopt(stdsocket.IPPROTO_IP, stdsocket.IP_MULTICAST_IF, stdsocket.inet_aton(local_ip))
        await sock.bind((local_ip, 0))

        async def send_round() -> None:
            for st in IGD_SEARCH_TARGETS:
                for target, msearch in (
                    ((gateway, SSDP_PORT), ssdp_search_request(st, host=f"{gateway}:{SSDP_PORT}", mx=None)),
                    ((SSDP_GROUP, SSDP_PORT), ssdp_search_request(st)),
                ):
                    try:
                        await sock.sendto(msearch, target)
                    except OSError as e:  # no multicast route, say: the unicast search may still work
                        log.debug("M-SEARCH to %s failed: %s", target, e)

        with trio.move_on_after(timeout):
            await send_round()
            resend_at = trio.current_time() + 0.5
            while True:
                with trio.move_on_at(resend_at) as wait:
                    data, (sender, _) = await sock.recvfrom(MAX_SSDP_DATAGRAM + 1)
                if wait.cancelled_caught:
                    await send_round()
                    resend_at = math.inf
                    continue
                try:
                    answer = parse_ssdp_response(data)
                except MalformedResponse as e:
                    log.debug("ignoring an SSDP datagram from %s: %s", sender, e)
                    continue
                if answer.st not in IGD_SEARCH_TARGETS or answer.location in seen:
                    continue
                seen.add(answer.location)
                found.append((sender, answer))
                if sender == gateway:
                    break
    found.sort(key=lambda item: item[0] != gateway)
    return found


async def discover_upnp(gateway: str, local_ip: str, *, timeout: float) -> tuple[UpnpGateway, str]:
    """Find the gateway's WAN connection service and read its external address.

    Returns the gateway and that address: GetExternalIPAddress proves the
    control URL works before anything relies on it.
    """
    problems: list[str] = []
    with trio.move_on_after(timeout):
        answers = await ssdp_search(gateway, local_ip, timeout=min(2.0, timeout))
        if not answers:
            problems.append("no answer to M-SEARCH")
        for sender, answer in answers:
            try:
                location = _same_host_http_url(answer.location, sender, "LOCATION")
                response = await http_exchange(location, http_request("GET", location), timeout=timeout)
                if response.status != 200:
                    raise MalformedResponse(f"HTTP {response.status} for the device description")
                for service in parse_device_description(response.body, location):
                    ours = local_address_towards(urlsplit(service.control_url).hostname or "")
                    try:
                        reply = await soap_call(service, "GetExternalIPAddress", [], timeout=timeout)
                    except (PortMappingError, OSError) as e:
                        problems.append(f"{service.control_url}: {_describe(e)}")
                        continue
                    external = reply.get("NewExternalIPAddress", "")
                    try:
                        _ipv4(external, "external address")
                    except ConfigError:
                        problems.append(f"{service.control_url}: no external address yet ({external!r})")
                        continue
                    return UpnpGateway(location, service, ours, answer.server), external
            except (PortMappingError, OSError) as e:
                problems.append(f"{answer.location}: {_describe(e)}")
    if not problems:
        problems.append(f"no usable answer within {timeout:g} s")
    raise PortMappingError("upnp: " + "; ".join(problems))


def _describe(e: BaseException, method: str = "") -> str:
    """A failure as one line; ``method`` drops the "method: " prefix where a list already names it."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e) or type(e).__name__
    return text.removeprefix(f"{method}: ") if method else text


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


class _NatPmpMapper(_Mapper):
    method: Method = "natpmp"

    def __init__(self, gateway: str, protocol: Protocol, internal_port: int):
        self.gateway, self.protocol, self.internal_port = gateway, protocol, internal_port

    async def map(self, external_port: int, lifetime: int) -> _Grant:
        reply = await natpmp_map(self.gateway, self.protocol, self.internal_port, external_port, lifetime)
        address = await natpmp_external_address(self.gateway)
        return _Grant(address, reply.external_port, reply.lifetime)

    async def unmap(self) -> None:
        await natpmp_map(self.gateway, self.protocol, self.internal_port, 0, 0)


class _PcpMapper(_Mapper):
    method: Method = "pcp"

    def __init__(self, gateway: str, local_ip: str, protocol: Protocol, internal_port: int):
        self.gateway, self.local_ip, self.protocol, self.internal_port = gateway, local_ip, protocol, internal_port
        # RFC 6887 section 11.1: the nonce proves, on renewal and deletion, that the mapping is ours.
        self.nonce = secrets.token_bytes(12)
        self.external_port = 0

    async def map(self, external_port: int, lifetime: int) -> _Grant:
        reply = await pcp_map(self.gateway, self.local_ip, self.nonce, self.protocol, self.internal_port, external_port, lifetime)
        self.external_port = reply.external_port
        return _Grant(reply.external_ip, reply.external_port, reply.lifetime)

    async def unmap(self) -> None:
        await pcp_map(self.gateway, self.local_ip, self.nonce, self.protocol, self.internal_port, self.external_port, 0)


class _UpnpMapper(_Mapper):
    method: Method = "upnp"
    #: 718 ConflictInMappingEntry: someone holds the port; try this many others.
    PORT_TRIES = 8

    def __init__(self, gateway: UpnpGateway, protocol: Protocol, internal_port: int, *, call_timeout: float):
        self.gateway, self.protocol, self.internal_port = gateway, protocol, internal_port
        self.call_timeout = call_timeout
        self.external_port = 0
        self.permanent_only = False

    async def _add(self, external_port: int, lease: int) -> None:
        args = [
            ("NewRemoteHost", ""),
            ("NewExternalPort", str(external_port)),
            ("NewProtocol", self.protocol),
            ("NewInternalPort", str(self.internal_port)),
            ("NewInternalClient", self.gateway.local_ip),
            ("NewEnabled", "1"),
            ("NewPortMappingDescription", "dedloc"),
            ("NewLeaseDuration", str(lease)),
        ]
        await soap_call(self.gateway.service, "AddPortMapping", args, timeout=self.call_timeout)

    async def _taken_by_another(self, external_port: int) -> bool:
        """Whether ``external_port`` already forwards somewhere else.

        AddPortMapping from the same host *overwrites* an existing mapping of
        that host (IGD spec; miniupnpd does so), so without this check a second
        service here would silently take over the first one's forward.
        Gateways that cannot answer get the benefit of the doubt.
        """
        args = [("NewRemoteHost", ""), ("NewExternalPort", str(external_port)), ("NewProtocol", self.protocol)]
        try:
            entry = await soap_call(self.gateway.service, "GetSpecificPortMappingEntry", args, timeout=self.call_timeout)
        except MappingRefused:  # 714 NoSuchEntryInArray: free; anything else: cannot tell
            return False
        if not entry.get("NewInternalClient"):
            return False
        return (entry["NewInternalClient"], entry.get("NewInternalPort")) != (self.gateway.local_ip, str(self.internal_port))

    async def map(self, external_port: int, lifetime: int) -> _Grant:
        lease = 0 if self.permanent_only else min(lifetime, MAX_UPNP_LEASE)
        candidates = [external_port or self.internal_port]
        candidates += random.sample(range(1024, 65536), self.PORT_TRIES)
        conflicts: list[int] = []
        port_index = 0
        while port_index < len(candidates):
            port = candidates[port_index]
            try:
                if await self._taken_by_another(port):
                    raise MappingRefused("upnp", 718, "ConflictInMappingEntry (held by another client or port)")
                await self._add(port, lease)
            except MappingRefused as e:
                if e.code == 725 and lease != 0:  # OnlyPermanentLeasesSupported: deleted on exit instead
                    self.permanent_only, lease = True, 0
                    continue
                if e.code == 724 and port != self.internal_port:  # SamePortValuesRequired
                    candidates.insert(port_index + 1, self.internal_port)
                elif e.code not in (718, 729):
                    raise
                conflicts.append(port)
                port_index += 1
                continue
            self.external_port = port
            reply = await soap_call(self.gateway.service, "GetExternalIPAddress", [], timeout=self.call_timeout)
            return _Grant(reply.get("NewExternalIPAddress", ""), port, lease)
        raise PortMappingError(f"upnp: every external port tried is taken ({', '.join(map(str, conflicts))})")

    async def unmap(self) -> None:
        if not self.external_port:  # nothing was added (a conflict is not ours to delete)
            return
        args = [("NewRemoteHost", ""), ("NewExternalPort", str(self.external_port)), ("NewProtocol", self.protocol)]
        await soap_call(self.gateway.service, "DeletePortMapping", args, timeout=self.call_timeout)


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


async def _keep_renewed(mapper: _Mapper, mapping: PortMapping, lifetime: int, call_timeout: float) -> None:
    """Renew halfway to expiry, like DHCP (RFC 6886 section 3.3); never raises.

    A failure is recorded in ``mapping.error`` and retried: after expiry too,
    since a router that rebooted forgets its mappings but will take a new one.
    """
    while mapping.lifetime:
        now = trio.current_time()
        if mapping.error is None:
            await trio.sleep_until(now + mapping.lifetime / 2)
        else:
            await trio.sleep(max(1.0, min(RENEW_RETRY_MAX, (mapping.expires_at - now) / 2)))
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
) -> AsyncIterator[PortMapping]:
    """Forward a port on the home router to ``internal_port`` for the block's duration.

    Asks the gateway (the default route's, unless given) about every method in
    parallel, each within ``discovery_timeout``, and maps with the first of
    ``methods`` in order that it offers, all within ``timeout``; ``external_port``
    is a wish (0: the same as ``internal_port``). The mapping is renewed in the
    background before it expires and deleted on exit (shielded, at most
    ``delete_timeout`` seconds, best effort: a lease ends by itself anyway).

    Raises :class:`PortMappingUnavailable`, listing each method and why it
    failed, when no mapping could be made.
    """
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
