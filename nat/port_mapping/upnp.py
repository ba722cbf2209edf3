"""UPnP IGD: HTTP/1.1, SSDP, the device description and SOAP as pure functions; discovery and calls over trio; its mapper."""

from __future__ import annotations

import ipaddress
import logging
import math
import random
import re
import socket as stdsocket
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit
from xml.sax.saxutils import escape

import trio

from p2p.errors import ConfigError

from .common import IGD_SEARCH_TARGETS, MAX_HTTP_HEAD, MAX_SSDP_DATAGRAM, MAX_UPNP_LEASE, MAX_XML, MalformedResponse, MappingRefused, Method, PortMappingError, Protocol, SSDP_GROUP, SSDP_PORT, SSDP_TTL, WAN_SERVICE_TYPES, _Grant, _Mapper, _describe, _ipv4, local_address_towards

log = logging.getLogger(__name__)


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


async def ssdp_search(gateway: str, local_ip: str, *, timeout: float, port: int = SSDP_PORT,
                      group: str = SSDP_GROUP) -> list[tuple[str, SsdpResponse]]:
    """M-SEARCH for Internet gateways; returns (responder, answer), the gateway's first.

    Searches go unicast to the gateway and to the SSDP group on the interface
    holding ``local_ip``, with TTL 2 and no loopback. Ends early once the
    gateway answered; a second round after 0.5 s covers a lost datagram.
    ``port`` and ``group`` are SSDP's; tests name a loopback port and address
    instead (no test sends a packet off loopback, multicast included).
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
                    ((gateway, port), ssdp_search_request(st, host=f"{gateway}:{port}", mx=None)),
                    ((group, port), ssdp_search_request(st, host=f"{group}:{port}")),
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


async def discover_upnp(gateway: str, local_ip: str, *, timeout: float, ssdp_port: int = SSDP_PORT,
                        ssdp_group: str = SSDP_GROUP) -> tuple[UpnpGateway, str]:
    """Find the gateway's WAN connection service and read its external address.

    Returns the gateway and that address: GetExternalIPAddress proves the
    control URL works before anything relies on it. ``ssdp_port`` and
    ``ssdp_group``: as :func:`ssdp_search`'s.
    """
    problems: list[str] = []
    with trio.move_on_after(timeout):
        answers = await ssdp_search(gateway, local_ip, timeout=min(2.0, timeout), port=ssdp_port, group=ssdp_group)
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
