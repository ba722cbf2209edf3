"""nat.port_mapping: wire formats without sockets, then the real thing against miniupnpd.

The end-to-end tests build their own router/client/outside namespaces
(tests/miniupnpd_lab.py): every packet, discovery included, stays inside them.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

from nat import port_mapping as pm
from nat.port_mapping import MalformedResponse, MappingRefused
from p2p.errors import ConfigError, DedlocError
from tests import miniupnpd_lab
from tests.miniupnpd_lab import CLIENT_IP, WAN_IP, router_lab

# ---------------------------------------------------------------------- gateway from /proc/net/route

PROC_NET_ROUTE = (
    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
    "wlan0\t00000000\t0101A8C0\t0003\t0\t0\t600\t00000000\t0\t0\t0\n"
    "eth0\t00000000\t0100A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"
    "eth0\t0000A8C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0\n"
    "tun0\t00000000\t00000000\t0001\t0\t0\t50\t00000000\t0\t0\t0\n"
)


def test_default_gateway_lowest_metric_with_gateway_flag() -> None:
    # tun0 has a lower metric but no gateway (RTF_GATEWAY unset): not a router to ask.
    assert pm.parse_default_gateway(PROC_NET_ROUTE, byteorder="little") == "192.168.0.1"
    assert pm.parse_default_gateway(PROC_NET_ROUTE, byteorder="big") == "1.0.168.192"


def test_default_gateway_none_and_garbage() -> None:
    assert pm.parse_default_gateway(PROC_NET_ROUTE.splitlines()[0]) is None
    assert pm.parse_default_gateway("") is None
    assert pm.parse_default_gateway("header\neth0 zz yy 0003 0 0 1 00000000\n") is None


# ---------------------------------------------------------------------- NAT-PMP


def test_natpmp_requests() -> None:
    assert pm.natpmp_address_request() == b"\x00\x00"
    assert pm.natpmp_map_request("TCP", 4001, 4001, 7200) == bytes.fromhex("0002 0000 0fa1 0fa1 00001c20")
    assert pm.natpmp_map_request("UDP", 4001, 0, 60) == bytes.fromhex("0001 0000 0fa1 0000 0000003c")
    # RFC 6886 3.4: deletion = lifetime 0 and suggested external port 0.
    assert pm.natpmp_delete_request("TCP", 4001) == bytes.fromhex("0002 0000 0fa1 0000 00000000")
    with pytest.raises(ConfigError):
        pm.natpmp_map_request("TCP", 0, 0, 60)
    with pytest.raises(ConfigError):
        pm.natpmp_map_request("TCP", 1, 70000, 60)
    with pytest.raises(ConfigError):
        pm.natpmp_map_request("TCP", 1, 1, 2**32)


def test_natpmp_responses() -> None:
    address = pm.decode_natpmp_response(bytes.fromhex("0080 0000 00000e10") + bytes([11, 22, 33, 1]))
    assert address == pm.NatPmpAddress(epoch=3600, external_ip="11.22.33.1")
    mapping = pm.decode_natpmp_response(bytes.fromhex("0082 0000 00000005 0fa1 1389 00001c20"))
    assert mapping == pm.NatPmpMapping(epoch=5, protocol="TCP", internal_port=4001, external_port=5001, lifetime=7200)
    udp = pm.decode_natpmp_response(bytes.fromhex("0081 0000 00000005 0fa1 0fa1 00000000"))
    assert isinstance(udp, pm.NatPmpMapping) and udp.protocol == "UDP" and udp.lifetime == 0


def test_natpmp_result_codes_raise_with_meaning() -> None:
    # miniupnpd answers errors with the bare 8-byte header: the code must still come through.
    with pytest.raises(MappingRefused) as info:
        pm.decode_natpmp_response(bytes.fromhex("0082 0002 00000005"))
    assert info.value.code == 2 and info.value.method == "natpmp" and "not authorized" in str(info.value)
    with pytest.raises(MappingRefused, match="out of resources"):
        pm.decode_natpmp_response(bytes.fromhex("0082 0004 00000005 0fa1 0000 00000000"))
    with pytest.raises(MappingRefused, match="unknown result code"):
        pm.decode_natpmp_response(bytes.fromhex("0080 00ff 00000005"))
    # A PCP-only server answers a version-0 request in PCP format.
    with pytest.raises(MappingRefused, match="PCP only"):
        pm.decode_natpmp_response(bytes.fromhex("0280 0001 00000000") + bytes(16))


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "shorter than the 8-byte header"),
        (bytes.fromhex("0080 0000 0000"), "shorter than the 8-byte header"),
        (bytes.fromhex("0080 0000 00000001 0b16"), "expected 12"),
        (bytes.fromhex("0082 0000 00000001 0fa1"), "expected 16"),
        (bytes.fromhex("0100 0000 00000001 00000000"), "version 1"),
        (bytes.fromhex("0002 0000 0fa1 0fa1 00001c20"), "is a request"),
        (bytes.fromhex("0083 0000 00000001 0fa1 0fa1 00000000"), "unknown response opcode"),
    ],
)
def test_natpmp_garbage_is_a_clear_error(data: bytes, match: str) -> None:
    with pytest.raises(MalformedResponse, match=match):
        pm.decode_natpmp_response(data)


def test_natpmp_retransmit_schedule_is_rfc_6886() -> None:
    delays = pm.natpmp_retransmit_delays()
    assert delays[:4] == [0.25, 0.5, 1.0, 2.0] and len(delays) == 9 and sum(delays) == pytest.approx(127.75)


# ---------------------------------------------------------------------- PCP

NONCE = bytes(range(12))


def test_pcp_map_request_layout() -> None:
    request = pm.pcp_map_request(NONCE, "TCP", 4001, 4002, 7200, "192.168.77.2")
    assert len(request) == 60
    assert request[:4] == bytes([2, 1, 0, 0])
    assert struct.unpack_from("!I", request, 4)[0] == 7200
    assert request[8:24] == bytes(10) + b"\xff\xff" + bytes([192, 168, 77, 2])
    assert request[24:36] == NONCE
    assert request[36] == 6 and request[37:40] == bytes(3)
    assert struct.unpack_from("!HH", request, 40) == (4001, 4002)
    assert request[44:60] == bytes(10) + b"\xff\xff" + bytes(4)  # ::ffff:0.0.0.0 = no preference
    udp = pm.pcp_map_request(NONCE, "UDP", 4001, 0, 0, "10.0.0.2")
    assert udp[36] == 17 and struct.unpack_from("!I", udp, 4)[0] == 0
    with pytest.raises(ConfigError):
        pm.pcp_map_request(b"short", "TCP", 4001, 0, 60, "10.0.0.2")
    with pytest.raises(ConfigError):
        pm.pcp_map_request(NONCE, "TCP", 4001, 0, 60, "not-an-ip")


def test_pcp_announce_request() -> None:
    assert pm.pcp_announce_request("10.0.0.2") == bytes([2, 0, 0, 0]) + bytes(4) + bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 2])


def _pcp_map_response(result: int = 0, *, lifetime: int = 7200, nonce: bytes = NONCE, proto: int = 6, version: int = 2) -> bytes:
    header = struct.pack("!BBBBII", version, 0x81, 0, result, lifetime, 42) + bytes(12)
    body = nonce + bytes([proto, 0, 0, 0]) + struct.pack("!HH", 4001, 5001) + bytes(10) + b"\xff\xff" + bytes([11, 22, 33, 1])
    return header + body


def test_pcp_responses() -> None:
    mapping = pm.decode_pcp_response(_pcp_map_response())
    assert mapping == pm.PcpMapping(42, 7200, NONCE, "TCP", 4001, 5001, "11.22.33.1")
    assert pm.decode_pcp_response(struct.pack("!BBBBII", 2, 0x80, 0, 0, 0, 7) + bytes(12)) == pm.PcpAnnounce(7)


def test_pcp_result_codes_and_version_fallbacks() -> None:
    with pytest.raises(MappingRefused) as info:
        pm.decode_pcp_response(_pcp_map_response(result=2))
    assert info.value.code == 2 and info.value.method == "pcp" and "not authorized" in info.value.reason
    with pytest.raises(MappingRefused, match="address mismatch"):
        pm.decode_pcp_response(_pcp_map_response(result=12))
    # NAT-PMP-only gateway: version 0 "unsupported version", 8 bytes.
    with pytest.raises(MappingRefused, match="NAT-PMP only"):
        pm.decode_pcp_response(bytes.fromhex("0081 0001 00000000"))
    # A server of the old PCP draft (version 1) says which version it speaks.
    with pytest.raises(MappingRefused, match="version 1"):
        pm.decode_pcp_response(_pcp_map_response(result=1, version=1))


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\x02\x81", "shorter than the 24-byte header"),
        (_pcp_map_response()[:40], "expected at least 60"),
        (_pcp_map_response(proto=132), "IP protocol 132"),
        (_pcp_map_response(version=3), "version 3"),
        (bytes([2, 1]) + _pcp_map_response()[2:], "is a request"),
        (bytes([2, 0x83]) + _pcp_map_response()[2:], "unexpected response opcode"),
        (_pcp_map_response() + bytes(1100), "longer than PCP allows"),
    ],
)
def test_pcp_garbage_is_a_clear_error(data: bytes, match: str) -> None:
    with pytest.raises(MalformedResponse, match=match):
        pm.decode_pcp_response(data)


def test_pcp_retransmit_schedule_is_rfc_6887() -> None:
    delays = pm.pcp_retransmit_delays(random.Random(1))
    for i, delay in enumerate(delays):
        assert 0.9 * 3 * 2**i <= delay <= 1.1 * 3 * 2**i


# ---------------------------------------------------------------------- SSDP

SSDP_ANSWER = (
    b"HTTP/1.1 200 OK\r\n"
    b"CACHE-CONTROL: max-age=120\r\n"
    b"ST: urn:schemas-upnp-org:device:InternetGatewayDevice:1\r\n"
    b"USN: uuid:aaaa::urn:schemas-upnp-org:device:InternetGatewayDevice:1\r\n"
    b"EXT:\r\n"
    b"SERVER: Debian/12 UPnP/1.1 MiniUPnPd/2.3.1\r\n"
    b"location: http://192.168.77.1:5000/rootDesc.xml\r\n"
    b"\r\n"
)


def test_ssdp_search_request() -> None:
    multicast = pm.ssdp_search_request("urn:schemas-upnp-org:device:InternetGatewayDevice:1")
    assert multicast.startswith(b"M-SEARCH * HTTP/1.1\r\nHOST: 239.255.255.250:1900\r\n")
    assert b'MAN: "ssdp:discover"\r\n' in multicast and b"MX: 1\r\n" in multicast and multicast.endswith(b"\r\n\r\n")
    unicast = pm.ssdp_search_request("ssdp:all", host="192.168.1.1:1900", mx=None)
    assert b"HOST: 192.168.1.1:1900\r\n" in unicast and b"MX" not in unicast


def test_ssdp_response_parsing() -> None:
    answer = pm.parse_ssdp_response(SSDP_ANSWER)
    assert answer.location == "http://192.168.77.1:5000/rootDesc.xml"  # header names are case-insensitive
    assert answer.st == "urn:schemas-upnp-org:device:InternetGatewayDevice:1"
    assert answer.server.endswith("MiniUPnPd/2.3.1")


@pytest.mark.parametrize(
    "data, match",
    [
        (b"NOTIFY * HTTP/1.1\r\nHOST: 239.255.255.250:1900\r\n\r\n", "not an SSDP search answer"),
        (b"HTTP/1.1 404 Not Found\r\n\r\n", "not an SSDP search answer"),
        (b"HTTP/1.1 200 OK\r\nST: x\r\n\r\n", "without LOCATION"),
        (b"HTTP/1.1 200 OK\r\nLOCATION: https://192.168.1.1/x.xml\r\n\r\n", "not an http URL"),
        (b"HTTP/1.1 200 OK\r\nLOCATION: file:///etc/passwd\r\n\r\n", "not an http URL"),
        (SSDP_ANSWER + b"x" * 9000, "more than"),
        (b"\xff\xfe\x00garbage", "not an SSDP search answer"),
    ],
)
def test_ssdp_garbage_is_a_clear_error(data: bytes, match: str) -> None:
    with pytest.raises(MalformedResponse, match=match):
        pm.parse_ssdp_response(data)


# ---------------------------------------------------------------------- device description

LOCATION = "http://192.168.77.1:5000/rootDesc.xml"


def _description(services: str, *, url_base: str = "") -> bytes:
    base = f"<URLBase>{url_base}</URLBase>" if url_base else ""
    return f"""<?xml version="1.0"?>
<root xmlns="urn:schemas-upnp-org:device-1-0"><specVersion><major>1</major><minor>0</minor></specVersion>{base}
<device><deviceType>urn:schemas-upnp-org:device:InternetGatewayDevice:1</deviceType>
<serviceList><service><serviceType>urn:schemas-upnp-org:service:Layer3Forwarding:1</serviceType>
<controlURL>/ctl/L3F</controlURL></service></serviceList>
<deviceList><device><deviceType>urn:schemas-upnp-org:device:WANDevice:1</deviceType>
<deviceList><device><deviceType>urn:schemas-upnp-org:device:WANConnectionDevice:1</deviceType>
<serviceList>{services}</serviceList></device></deviceList></device></deviceList></device></root>""".encode()


def _service(kind: str, control: str) -> str:
    return f"<service><serviceType>urn:schemas-upnp-org:service:{kind}</serviceType><controlURL>{control}</controlURL></service>"


def test_device_description_finds_wan_services_best_first() -> None:
    body = _description(_service("WANPPPConnection:1", "/ctl/PPP") + _service("WANIPConnection:1", "/ctl/IPConn"))
    services = pm.parse_device_description(body, LOCATION)
    assert [s.service_type.rsplit(":", 2)[1] for s in services] == ["WANIPConnection", "WANPPPConnection"]
    assert services[0].control_url == "http://192.168.77.1:5000/ctl/IPConn"
    both = _description(_service("WANIPConnection:1", "/a") + _service("WANIPConnection:2", "/b"))
    v2 = pm.parse_device_description(both, LOCATION)
    assert v2[0] == pm.IgdService("urn:schemas-upnp-org:service:WANIPConnection:2", "http://192.168.77.1:5000/b")


def test_device_description_relative_absolute_and_urlbase() -> None:
    relative_body = _description(_service("WANIPConnection:1", "ctl/x"))
    relative = pm.parse_device_description(relative_body, "http://192.168.77.1:5000/desc/root.xml")
    assert relative[0].control_url == "http://192.168.77.1:5000/desc/ctl/x"
    absolute_body = _description(_service("WANIPConnection:1", "http://192.168.77.1:49000/upnp/ctl"))
    absolute = pm.parse_device_description(absolute_body, LOCATION)
    assert absolute[0].control_url == "http://192.168.77.1:49000/upnp/ctl"
    based = pm.parse_device_description(
        _description(_service("WANIPConnection:1", "/upnp/control/WANIPConn1"), url_base="http://192.168.77.1:49000/"), LOCATION
    )
    assert based[0].control_url == "http://192.168.77.1:49000/upnp/control/WANIPConn1"


def test_device_description_refuses_other_hosts_and_schemes() -> None:
    with pytest.raises(MalformedResponse, match="points at 10.9.9.9"):
        pm.parse_device_description(_description(_service("WANIPConnection:1", "http://10.9.9.9/ctl")), LOCATION)
    with pytest.raises(MalformedResponse, match="names a host"):
        pm.parse_device_description(_description(_service("WANIPConnection:1", "/c"), url_base="http://router.lan/"), LOCATION)
    with pytest.raises(MalformedResponse, match="not an http URL"):
        pm.parse_device_description(_description(_service("WANIPConnection:1", "https://192.168.77.1/c")), LOCATION)


@pytest.mark.parametrize(
    "body, match",
    [
        (_description(_service("Layer3Forwarding:1", "/x")), "no WANIPConnection"),
        (b"<root><device>", "does not parse"),
        (b"", "does not parse"),
        (b"\x00\xff garbage", "does not parse"),
        (b"<root>" + b"<a/>" * 20000 + b"</root>", "more than the 65536 allowed"),
        (
            b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;">]><root>&lol2;</root>',
            "DTD or entity",
        ),
        (b'<!DOCTYPE root SYSTEM "file:///etc/passwd"><root/>', "DTD or entity"),
    ],
)
def test_device_description_garbage_is_a_clear_error(body: bytes, match: str) -> None:
    with pytest.raises(MalformedResponse, match=match):
        pm.parse_device_description(body, LOCATION)


# ---------------------------------------------------------------------- SOAP

SERVICE = "urn:schemas-upnp-org:service:WANIPConnection:1"


def test_soap_envelope_escapes_and_checks() -> None:
    body = pm.soap_envelope(SERVICE, "AddPortMapping", [("NewExternalPort", "4001"), ("NewPortMappingDescription", "a<b&c")])
    assert f'<u:AddPortMapping xmlns:u="{SERVICE}">'.encode() in body
    assert b"<NewPortMappingDescription>a&lt;b&amp;c</NewPortMappingDescription>" in body
    pm.parse_xml(body)  # well-formed
    with pytest.raises(ConfigError):
        pm.soap_envelope('urn:x:service:y:1"><evil', "AddPortMapping", [])


def _soap_reply(inner: str) -> bytes:
    return (
        '<?xml version="1.0"?><s:Envelope xmlns:s="http://schemas.xmlsoap.org/soap/envelope/" '
        f's:encodingStyle="http://schemas.xmlsoap.org/soap/encoding/"><s:Body>{inner}</s:Body></s:Envelope>'
    ).encode()


def _fault(code: str, description: str = "") -> bytes:
    desc = f"<errorDescription>{description}</errorDescription>" if description else ""
    return _soap_reply(
        "<s:Fault><faultcode>s:Client</faultcode><faultstring>UPnPError</faultstring><detail>"
        f'<UPnPError xmlns="urn:schemas-upnp-org:control-1-0"><errorCode>{code}</errorCode>{desc}</UPnPError>'
        "</detail></s:Fault>"
    )


EXTERNAL_IP_REPLY = _soap_reply(
    f'<u:GetExternalIPAddressResponse xmlns:u="{SERVICE}">'
    "<NewExternalIPAddress>11.22.33.1</NewExternalIPAddress></u:GetExternalIPAddressResponse>"
)
SoapCall = tuple[str, dict[str, str]]


def test_soap_response() -> None:
    reply = EXTERNAL_IP_REPLY
    assert pm.decode_soap_response(200, reply, "GetExternalIPAddress") == {"NewExternalIPAddress": "11.22.33.1"}
    empty = _soap_reply(f'<u:AddPortMappingResponse xmlns:u="{SERVICE}"/>')
    assert pm.decode_soap_response(200, empty, "AddPortMapping") == {}
    with pytest.raises(MalformedResponse, match="without DeletePortMappingResponse"):
        pm.decode_soap_response(200, empty, "DeletePortMapping")


def test_soap_faults() -> None:
    conflict = pm.parse_soap_fault(_fault("718", "ConflictInMappingEntry"))
    assert conflict is not None and conflict.code == 718 and conflict.reason == "ConflictInMappingEntry"
    permanent = pm.parse_soap_fault(_fault("725"))  # no description: the table fills in
    assert permanent is not None and permanent.reason == "OnlyPermanentLeasesSupported"
    with pytest.raises(MappingRefused) as info:
        pm.decode_soap_response(500, _fault("606", "Action not authorized"), "AddPortMapping")
    assert info.value.code == 606 and info.value.method == "upnp"
    assert pm.parse_soap_fault(_soap_reply("<u:XResponse xmlns:u='x'/>")) is None
    with pytest.raises(MalformedResponse, match="bad errorCode"):
        pm.parse_soap_fault(_fault("abc"))
    with pytest.raises(MalformedResponse, match="HTTP 500"):
        pm.decode_soap_response(500, b"<html>Internal error", "AddPortMapping")
    with pytest.raises(MalformedResponse, match="HTTP 404"):
        pm.decode_soap_response(404, _soap_reply(""), "AddPortMapping")


# ---------------------------------------------------------------------- HTTP


def test_http_request() -> None:
    request = pm.http_request("POST", "http://192.168.77.1:5000/ctl/IPConn?x=1", headers=[("SOAPAction", '"a#b"')], body=b"xyz")
    assert request.startswith(b"POST /ctl/IPConn?x=1 HTTP/1.1\r\nHost: 192.168.77.1:5000\r\nConnection: close\r\n")
    assert b"Content-Length: 3\r\n" in request and request.endswith(b"\r\n\r\nxyz")
    assert pm.http_request("GET", "http://192.168.77.1/").startswith(b"GET / HTTP/1.1\r\nHost: 192.168.77.1\r\n")
    with pytest.raises(ConfigError):
        pm.http_request("GET", "http://1.2.3.4/", headers=[("X", "a\r\nInjected: yes")])


def test_http_response_content_length_incremental() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/xml\r\nContent-Length: 5\r\n\r\nhello"
    for cut in range(len(raw)):
        assert pm.parse_http_response(raw[:cut], eof=False) is None
    response = pm.parse_http_response(raw, eof=False)
    assert response is not None and response.status == 200 and response.body == b"hello"
    assert response.headers["content-type"] == "text/xml"
    with pytest.raises(MalformedResponse, match="closed after 2 of 5"):
        pm.parse_http_response(raw[:-3], eof=True)


def test_http_response_chunked_and_close_delimited() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n"
    for cut in range(len(chunked)):
        assert pm.parse_http_response(chunked[:cut], eof=False) is None
    response = pm.parse_http_response(chunked, eof=False)
    assert response is not None and response.body == b"hello world"
    with pytest.raises(MalformedResponse, match="middle of a chunked body"):
        pm.parse_http_response(chunked[:-10], eof=True)
    close = b"HTTP/1.0 200 OK\r\nServer: x\r\n\r\nbody until close"
    assert pm.parse_http_response(close, eof=False) is None
    final = pm.parse_http_response(close, eof=True)
    assert final is not None and final.body == b"body until close"
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
    continued = pm.parse_http_response(interim, eof=False)
    assert continued is not None and continued.status == 500


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed HTTP header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "given twice"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n", "more than the 65536 allowed"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "unsupported Transfer-Encoding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100000\r\n", "longer than the 65536"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "not followed by CRLF"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 20000, "header longer than"),
        (b"HTTP/1.1 200 OK\r\n\r\n" + b"a" * 70000, "longer than the 65536"),
    ],
)
def test_http_garbage_is_a_clear_error(raw: bytes, match: str) -> None:
    with pytest.raises(MalformedResponse, match=match):
        pm.parse_http_response(raw, eof=False)


def test_http_header_cut_short() -> None:
    with pytest.raises(MalformedResponse, match="before the HTTP header ended"):
        pm.parse_http_response(b"HTTP/1.1 200 OK\r\nContent-Le", eof=True)


# ---------------------------------------------------------------------- API checks that need no gateway


async def test_map_port_rejects_bad_arguments() -> None:
    for kwargs in ({"lifetime": 0}, {"protocol": "SCTP"}, {"methods": ("igd",)}, {"methods": ()}, {"external_port": 70000}):
        with pytest.raises(ConfigError):
            async with pm.map_port(4001, **kwargs):
                pass
    with pytest.raises(ConfigError):
        async with pm.map_port(0):
            pass
    with pytest.raises(ConfigError):
        async with pm.map_port(4001, gateway="router.lan"):
            pass


def test_errors_are_dedloc_errors() -> None:
    error = pm.PortMappingUnavailable("no mapping", [("pcp", "no answer"), ("upnp", "no answer to M-SEARCH")])
    assert isinstance(error, DedlocError) and "\n  pcp: no answer" in str(error) and error.attempts[1][0] == "upnp"
    assert isinstance(MappingRefused("natpmp", 2, "x"), pm.PortMappingError)
    assert issubclass(MalformedResponse, ValueError)


# ---------------------------------------------------------------------- the I/O layer against loopback fakes
# (UDP and HTTP to 127.0.0.1 only; no discovery, which runs only inside the lab's namespaces)


@asynccontextmanager
async def fake_udp_gateway(answer: Callable[[int, bytes], list[bytes]]) -> AsyncIterator[tuple[int, list[bytes]]]:
    """A UDP server on 127.0.0.1 replying ``answer(n, request)`` to the n-th request."""
    received: list[bytes] = []
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind(("127.0.0.1", 0))

    async def serve() -> None:
        while True:
            data, peer = await sock.recvfrom(2048)
            received.append(data)
            for reply in answer(len(received), data):
                await sock.sendto(reply, peer)

    with sock:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            yield sock.getsockname()[1], received
            nursery.cancel_scope.cancel()


async def test_natpmp_retransmits_and_ignores_strays() -> None:
    good = bytes.fromhex("0082 0000 00000005 0fa1 1389 00000e10")

    def answer(n: int, request: bytes) -> list[bytes]:
        if n == 1:
            return []  # lost: the client must retransmit after 250 ms
        stray = bytes.fromhex("0082 0000 00000005 0fa2 1389 00000e10")  # another internal port
        return [b"garbage", stray, good]

    async with fake_udp_gateway(answer) as (port, received):
        start = trio.current_time()
        with trio.fail_after(3):
            reply = await pm.natpmp_map("127.0.0.1", "TCP", 4001, 4001, 3600, port=port)
        assert reply.external_port == 5001 and reply.lifetime == 3600
        assert len(received) == 2 and received[0] == received[1] == pm.natpmp_map_request("TCP", 4001, 4001, 3600)
        assert trio.current_time() - start >= 0.25


async def test_natpmp_refusal_is_immediate() -> None:
    async with fake_udp_gateway(lambda n, request: [bytes.fromhex("0082 0002 00000005")]) as (port, _):
        with trio.fail_after(1), pytest.raises(MappingRefused, match="not authorized"):
            await pm.natpmp_map("127.0.0.1", "TCP", 4001, 4001, 3600, port=port)


async def test_icmp_port_unreachable_ends_the_wait() -> None:
    with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as closed:
        await closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    # Well before the 64 s retransmission schedule ends (3 s: the kernel rate-limits ICMP
    # globally, so under load a retransmission may have to draw the error).
    with trio.fail_after(3), pytest.raises(pm.PortMappingError, match="ICMP port unreachable"):
        await pm.natpmp_external_address("127.0.0.1", port=port)


async def test_pcp_ignores_replies_with_another_nonce() -> None:
    def answer(n: int, request: bytes) -> list[bytes]:
        nonce = request[24:36]
        wrong = _pcp_map_response(nonce=bytes(12))
        stale_refusal = _pcp_map_response(result=2, nonce=bytes(12))
        right = _pcp_map_response(nonce=nonce)
        return [wrong, stale_refusal, right]

    async with fake_udp_gateway(answer) as (port, received):
        with trio.fail_after(2):
            reply = await pm.pcp_map("127.0.0.1", "127.0.0.1", NONCE, "TCP", 4001, 0, 7200, port=port)
    assert reply.nonce == NONCE and reply.external_ip == "11.22.33.1" and len(received) == 1


@asynccontextmanager
async def fake_igd(script: Callable[[str, dict[str, str]], bytes]) -> AsyncIterator[tuple[pm.IgdService, list[SoapCall]]]:
    """An IGD control URL on 127.0.0.1: ``script(action, args)`` gives each SOAP reply body (500 if a fault)."""
    calls: list[SoapCall] = []

    async def handle(stream: trio.SocketStream) -> None:
        buf = b""
        with trio.move_on_after(5):
            while b"\r\n\r\n" not in buf:
                buf += await stream.receive_some(65536)
            head, _, body = buf.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += await stream.receive_some(65536)
            soap_action = next(line for line in head.split(b"\r\n") if line.lower().startswith(b"soapaction"))
            action = soap_action.decode().split("#")[1].strip('"')
            root = pm.parse_xml(body)
            call = next(e for e in root.iter() if e.tag.endswith(action))
            args = {child.tag: child.text or "" for child in call}
            calls.append((action, args))
            reply = script(action, args)
            status = "500 Internal Server Error" if b"Fault" in reply else "200 OK"
            head = f"HTTP/1.1 {status}\r\nContent-Type: text/xml\r\nContent-Length: {len(reply)}\r\n\r\n".encode()
            await stream.send_all(head + reply)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield pm.IgdService(SERVICE, f"http://127.0.0.1:{port}/ctl/IPConn"), calls
        nursery.cancel_scope.cancel()


async def test_upnp_mapper_handles_permanent_only_and_conflicts() -> None:
    def script(action: str, args: dict[str, str]) -> bytes:
        if action == "GetSpecificPortMappingEntry":
            if args["NewExternalPort"] == "5555":  # someone else's
                return _soap_reply(
                    f'<u:GetSpecificPortMappingEntryResponse xmlns:u="{SERVICE}"><NewInternalPort>80</NewInternalPort>'
                    "<NewInternalClient>127.0.0.9</NewInternalClient></u:GetSpecificPortMappingEntryResponse>"
                )
            return _fault("714", "NoSuchEntryInArray")
        if action == "AddPortMapping":
            if args["NewLeaseDuration"] != "0":
                return _fault("725", "OnlyPermanentLeasesSupported")
            if args["NewExternalPort"] == "4001":
                return _fault("718", "ConflictInMappingEntry")
            return _soap_reply(f'<u:AddPortMappingResponse xmlns:u="{SERVICE}"/>')
        if action == "GetExternalIPAddress":
            return EXTERNAL_IP_REPLY
        return _soap_reply(f'<u:{action}Response xmlns:u="{SERVICE}"/>')

    async with fake_igd(script) as (service, calls):
        gateway = pm.UpnpGateway("http://127.0.0.1/rootDesc.xml", service, "127.0.0.1")
        mapper = pm._UpnpMapper(gateway, "TCP", 4001, call_timeout=5)
        with trio.fail_after(10):
            # 5555 forwards to another host already: not even tried (AddPortMapping would overwrite
            # a mapping of our own host), then 725 makes the lease permanent, then 718 moves the port.
            assert await mapper._taken_by_another(5555)
            assert not await mapper._taken_by_another(4001)
            grant = await mapper.map(0, 3600)
            assert grant.lifetime == 0 and grant.external_ip == "11.22.33.1"
            assert grant.external_port != 4001 and 1024 <= grant.external_port <= 65535
            adds = [args for action, args in calls if action == "AddPortMapping"]
            assert [(a["NewExternalPort"], a["NewLeaseDuration"]) for a in adds[:2]] == [("4001", "3600"), ("4001", "0")]
            assert adds[0]["NewInternalClient"] == "127.0.0.1" and adds[0]["NewPortMappingDescription"] == "dedloc"
            assert adds[0]["NewRemoteHost"] == "" and adds[0]["NewEnabled"] == "1" and adds[0]["NewProtocol"] == "TCP"
            await mapper.unmap()
        delete = {"NewRemoteHost": "", "NewExternalPort": str(grant.external_port), "NewProtocol": "TCP"}
        assert calls[-1] == ("DeletePortMapping", delete)


async def test_upnp_mapper_reports_other_faults() -> None:
    async with fake_igd(lambda action, args: _fault("606", "Action not authorized")) as (service, calls):
        mapper = pm._UpnpMapper(pm.UpnpGateway("http://127.0.0.1/", service, "127.0.0.1"), "TCP", 4001, call_timeout=5)
        with trio.fail_after(10), pytest.raises(MappingRefused, match="606") as info:
            await mapper.map(0, 3600)
        assert info.value.code == 606 and [action for action, _ in calls] == ["GetSpecificPortMappingEntry", "AddPortMapping"]


async def test_http_exchange_bounds_a_silent_server() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/x"
        with pytest.raises(pm.PortMappingError, match="took longer than 0.3 s"):
            await pm.http_exchange(url, pm.http_request("GET", url), timeout=0.3)
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- against a real miniupnpd (tests/miniupnpd_lab.py)

_LAB_UNAVAILABLE = miniupnpd_lab.unavailable_reason()
needs_lab = pytest.mark.skipif(_LAB_UNAVAILABLE is not None, reason=f"miniupnpd lab: {_LAB_UNAVAILABLE}")


@asynccontextmanager
async def lab(tmp_path: Path, *, start_miniupnpd: bool = True) -> AsyncIterator[miniupnpd_lab.Lab]:
    # a miniupnpd that does not start is a failure (its output in the error), never a skip
    async with router_lab(tmp_path, start_miniupnpd=start_miniupnpd) as built:
        yield built


async def _wait_for_renewal(client: miniupnpd_lab.LabClient, *, timeout: float) -> dict[str, object]:
    with trio.fail_after(timeout):
        while True:
            await client.send("status")
            status = await client.event()
            if isinstance(status["renewals"], int) and status["renewals"] >= 1:
                return status
            await trio.sleep(0.5)


@pytest.mark.slow
@needs_lab
@pytest.mark.parametrize("method", ["upnp", "natpmp", "pcp"])
async def test_map_reach_renew_delete_against_miniupnpd(tmp_path: Path, method: str) -> None:
    """The whole life of a mapping through a real router: reachable from outside while held, gone after."""
    async with lab(tmp_path) as router:
        port = 4101
        assert (await router.connect_from_outside(port)).startswith("error")  # nothing forwarded yet
        client = await router.start_client(port, method=method, lifetime=4)
        mapped = await client.event()
        assert mapped["event"] == "mapped", f"{mapped}\n{router.miniupnpd_log()[-4000:]}"
        assert mapped["method"] == method
        assert mapped["external_ip"] == WAN_IP
        assert mapped["internal_ip"] == CLIENT_IP
        external = mapped["external_port"]
        assert isinstance(external, int) and external == port  # miniupnpd grants the same port when free
        assert 2 <= int(str(mapped["lifetime"])) <= 4
        assert f"dnat ip to {CLIENT_IP}:{port}" in await router.router_rules()

        assert await router.connect_from_outside(external) == f"hello from {port}"

        # Half the 4 s lease: renewed in the background, still reachable, still the same port.
        status = await _wait_for_renewal(client, timeout=10)
        assert status["error"] is None and status["external_port"] == external
        assert await router.connect_from_outside(external) == f"hello from {port}"

        assert (await client.finish())["event"] == "deleted"
        assert f"{CLIENT_IP}:{port}" not in await router.router_rules()
        assert (await router.connect_from_outside(external)).startswith("error")


@pytest.mark.slow
@needs_lab
async def test_probe_against_miniupnpd(tmp_path: Path) -> None:
    async with lab(tmp_path) as router:
        result = await router.python_in(router.client, "probe")
        assert result.returncode == 0, result.stderr.decode(errors="replace")
        support = json.loads(result.stdout)
        assert support["methods"] == ["pcp", "natpmp", "upnp"], support
        assert support["gateway"] == miniupnpd_lab.ROUTER_LAN_IP and support["local_ip"] == CLIENT_IP
        assert support["natpmp_external_ip"] == support["upnp_external_ip"] == WAN_IP
        # miniupnpd 2.3.1 offers IGDv2; the v2 service is preferred.
        assert support["upnp_control_url"].startswith(f"http://{miniupnpd_lab.ROUTER_LAN_IP}:{miniupnpd_lab.HTTP_PORT}/")
        assert "WANIPConnection:2" in router.miniupnpd_log()
        assert support["failures"] == {}
        assert "dnat" not in await router.router_rules()  # probing changed nothing


@pytest.mark.slow
@needs_lab
async def test_default_methods_prefer_pcp_and_delete_on_error(tmp_path: Path) -> None:
    async with lab(tmp_path) as router:
        client = await router.start_client(4111)
        mapped = await client.event()
        assert mapped["event"] == "mapped" and mapped["method"] == "pcp" and mapped["external_ip"] == WAN_IP, mapped
        assert await router.connect_from_outside(int(str(mapped["external_port"]))) == "hello from 4111"
        # An error in the block reaches the caller as itself (no ExceptionGroup), and the forward goes.
        assert await client.finish(how="raise") == {"event": "failed", "error": "RuntimeError: asked to"}
        assert "dnat" not in await router.router_rules()


@pytest.mark.slow
@needs_lab
@pytest.mark.parametrize("method", ["upnp", "natpmp", "pcp"])
async def test_taken_external_port_moves_elsewhere(tmp_path: Path, method: str) -> None:
    """Two services of one host wish for the same external port: the second gets another, both work."""
    async with lab(tmp_path) as router:
        first = await router.start_client(4201, method=method, external=4300)
        got_first = await first.event()
        assert got_first["event"] == "mapped" and got_first["external_port"] == 4300, got_first
        second = await router.start_client(4202, method=method, external=4300)
        got_second = await second.event()
        assert got_second["event"] == "mapped", f"{got_second}\n{router.miniupnpd_log()[-3000:]}"
        moved = got_second["external_port"]
        assert isinstance(moved, int) and moved != 4300 and 1024 <= moved <= 65535
        assert await router.connect_from_outside(4300) == "hello from 4201"
        assert await router.connect_from_outside(moved) == "hello from 4202"
        assert (await second.finish())["event"] == "deleted"
        assert (await router.connect_from_outside(moved)).startswith("error")
        assert await router.connect_from_outside(4300) == "hello from 4201"  # deleting ours left theirs alone
        assert (await first.finish())["event"] == "deleted"
        assert "dnat" not in await router.router_rules()


@pytest.mark.slow
@needs_lab
async def test_router_restart_renewal_recovers(tmp_path: Path) -> None:
    """While the router's daemon is down renewals fail and say so; once it is back the mapping is too."""
    async with lab(tmp_path) as router:
        client = await router.start_client(4121, method="natpmp", lifetime=4)
        mapped = await client.event()
        assert mapped["event"] == "mapped", mapped
        await router.stop_miniupnpd()
        with trio.fail_after(10):
            while True:
                await client.send("status")
                status = await client.event()
                if status["error"]:
                    break
                await trio.sleep(0.3)
        assert "ICMP port unreachable" in str(status["error"])
        await router.start_miniupnpd()
        with trio.fail_after(10):
            while True:
                await client.send("status")
                status = await client.event()
                if not status["error"] and int(str(status["renewals"])) >= 1:
                    break
                await trio.sleep(0.3)
        assert await router.connect_from_outside(int(str(status["external_port"]))) == "hello from 4121"
        assert (await client.finish())["event"] == "deleted"


@pytest.mark.slow
@needs_lab
@pytest.mark.realtime  # nothing answering ends within 8 s
async def test_nothing_answers_says_what_was_tried(tmp_path: Path) -> None:
    """A router without miniupnpd: PortMappingUnavailable names each method and why, within seconds."""
    async with lab(tmp_path, start_miniupnpd=False) as router:
        start = trio.current_time()
        client = await router.start_client(4131)
        failed = await client.event()
        elapsed = trio.current_time() - start
        assert failed["event"] == "failed", failed
        error = str(failed["error"])
        assert error.startswith("PortMappingUnavailable: the gateway 192.168.77.1 made no port mapping for TCP port 4131")
        assert "\n  pcp: nothing listens on 192.168.77.1:5351 (ICMP port unreachable)" in error
        assert "\n  natpmp: nothing listens on 192.168.77.1:5351 (ICMP port unreachable)" in error
        assert "\n  upnp: no answer to M-SEARCH" in error
        assert elapsed < 8  # ~2 s of SSDP listening plus interpreter start-up
        with trio.fail_after(10):
            await client.process.wait()


def test_the_port_to_map_is_one_a_router_could_reach() -> None:
    from multiaddr import Multiaddr

    def port(*addrs: str) -> int | None:
        return pm.mappable_port([Multiaddr(a) for a in addrs])

    assert port("/ip4/127.0.0.1/tcp/4001") is None
    assert port("/ip4/127.0.0.5/tcp/4001", "/ip6/::1/tcp/4002") is None
    assert port() is None
    assert port("/ip4/127.0.0.1/tcp/4001", "/ip4/0.0.0.0/tcp/4003") == 4003
    assert port("/ip6/::1/tcp/4002", "/ip4/192.168.1.20/tcp/4004", "/ip4/0.0.0.0/tcp/4005") == 4004
    assert port("/ip6/::/tcp/4006") == 4006
