"""nat.port_mapping's wire formats and parsers, without sockets: NAT-PMP (RFC 6886), PCP (RFC 6887),
SSDP, the IGD device description, SOAP and HTTP, the default gateway from /proc/net/route.

Pure and fast (no namespaces, no sockets), so that ``make mutate`` can run them for every mutant of
``nat/port_mapping/natpmp.py``, ``pcp.py`` and ``upnp.py``; tests/test_port_mapping.py has the I/O,
against loopback fakes and against miniupnpd in namespaces, and tests/test_upnp.py UPnP's, against
loopback fakes.
"""

from __future__ import annotations

import random
import struct

import pytest

from nat import port_mapping as pm
from nat.port_mapping import MalformedResponse, MappingRefused
from p2p.errors import ConfigError, DedlocError


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


def test_natpmp_requests_name_what_is_wrong_and_use_the_whole_unsigned_ranges() -> None:
    with pytest.raises(ConfigError, match=r"^internal port must be a port number 1-65535, not 0$"):
        pm.natpmp_map_request("TCP", 0, 0, 60)
    with pytest.raises(ConfigError, match=r"^suggested external port must be a port number 1-65535, not 70000$"):
        pm.natpmp_map_request("TCP", 1, 70000, 60)
    with pytest.raises(ConfigError, match=r"^lifetime must fit 32 bits, not 4294967296$"):
        pm.natpmp_map_request("TCP", 1, 1, 2**32)
    # ports past 32767 and a lifetime past 2**31 are unsigned on the wire (RFC 6886 3.3)
    assert pm.natpmp_map_request("UDP", 65535, 40000, 2**32 - 1) == bytes.fromhex("0001 0000 ffff 9c40 ffffffff")
    mapping = pm.decode_natpmp_response(bytes.fromhex("0082 0000 ffffffff ffff 9c40 ffffffff"))
    assert mapping == pm.NatPmpMapping(2**32 - 1, "TCP", 65535, 40000, 2**32 - 1)
    # an address reply with bytes after the address: the address is its 4 bytes
    address = pm.decode_natpmp_response(bytes.fromhex("0080 0000 00000001 0b162101 00000000"))
    assert address == pm.NatPmpAddress(1, "11.22.33.1")


def test_natpmp_refusals_say_whose_code_and_why_whole() -> None:
    with pytest.raises(MappingRefused) as info:
        pm.decode_natpmp_response(bytes.fromhex("0280 0001 00000000") + bytes(16))
    assert (info.value.method, info.value.code) == ("natpmp", 1)
    assert info.value.reason == "unsupported version: the gateway speaks PCP only (answered version 2)"
    with pytest.raises(MappingRefused) as info:
        pm.decode_natpmp_response(bytes.fromhex("0080 0063 00000005"))
    assert (info.value.code, info.value.reason) == (99, "unknown result code")
    # a version-2 *request* (no response bit: an echo) is garbage, not a PCP-only gateway
    with pytest.raises(MalformedResponse, match="^natpmp: reply has version 2, not 0$"):
        pm.decode_natpmp_response(bytes.fromhex("0201 0001 00000000") + bytes(16))
    # an odd request opcode (UDP's) echoed back is a request too
    with pytest.raises(MalformedResponse, match="^natpmp: opcode 1 is a request, not a response$"):
        pm.decode_natpmp_response(bytes.fromhex("0001 0000 0fa1 0fa1 00001c20"))


def test_natpmp_exchanges_take_only_the_answer_to_their_own_request() -> None:
    address = bytes.fromhex("0080 0000 00000e10") + bytes([11, 22, 33, 1])
    tcp = bytes.fromhex("0082 0000 00000005 0fa1 1389 00001c20")
    assert pm.natpmp_address_reply(address) == pm.NatPmpAddress(3600, "11.22.33.1")
    for other in (tcp, b"", b"\x00", bytes.fromhex("0081 0000 00000005 0fa1 1389 00001c20")):
        assert pm.natpmp_address_reply(other) is None
    with pytest.raises(MappingRefused):  # a refusal of ours is an answer: it ends the exchange
        pm.natpmp_address_reply(bytes.fromhex("0080 0003 00000005"))
    assert pm.natpmp_map_reply(tcp, "TCP", 4001) == pm.NatPmpMapping(5, "TCP", 4001, 5001, 7200)
    assert pm.natpmp_map_reply(tcp, "TCP", 4002) is None  # another port's mapping
    assert pm.natpmp_map_reply(tcp, "UDP", 4001) is None  # another protocol's
    assert pm.natpmp_map_reply(address, "TCP", 4001) is None
    assert pm.natpmp_map_reply(b"\x00", "TCP", 4001) is None and pm.natpmp_map_reply(b"", "UDP", 4001) is None
    # two bytes that claim to answer this very request: garbage, said so (the exchange keeps the error for
    # its final message and waits on)
    for request, claim in ((pm.natpmp_address_reply, b"\x00\x80"), (lambda d: pm.natpmp_map_reply(d, "TCP", 4001), b"\x00\x82")):
        with pytest.raises(MalformedResponse, match="shorter than the 8-byte header"):
            request(claim)
    udp = bytes.fromhex("0081 0000 00000005 0fa1 0fa1 00000000")
    assert pm.natpmp_map_reply(udp, "UDP", 4001) == pm.NatPmpMapping(5, "UDP", 4001, 4001, 0)
    with pytest.raises(MappingRefused, match="out of resources"):
        pm.natpmp_map_reply(bytes.fromhex("0082 0004 00000005"), "TCP", 4001)


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


def test_pcp_requests_name_what_is_wrong_and_use_the_whole_unsigned_ranges() -> None:
    with pytest.raises(ConfigError, match=r"^a PCP mapping nonce is 12 bytes$"):
        pm.pcp_map_request(b"short", "TCP", 4001, 0, 60, "10.0.0.2")
    with pytest.raises(ConfigError, match=r"^internal port must be a port number 1-65535, not 0$"):
        pm.pcp_map_request(NONCE, "TCP", 0, 0, 60, "10.0.0.2")
    with pytest.raises(ConfigError, match=r"^suggested external port must be a port number 1-65535, not -1$"):
        pm.pcp_map_request(NONCE, "TCP", 1, -1, 60, "10.0.0.2")
    with pytest.raises(ConfigError, match=r"^PCP address must be an IPv4 address, not 'not-an-ip'$"):
        pm.pcp_announce_request("not-an-ip")
    with pytest.raises(ConfigError, match=r"^lifetime must fit 32 bits, not 4294967296$"):
        pm.pcp_map_request(NONCE, "TCP", 4001, 0, 2**32, "10.0.0.2")
    request = pm.pcp_map_request(NONCE, "TCP", 65535, 40000, 2**32 - 1, "10.0.0.2")
    assert struct.unpack_from("!I", request, 4)[0] == 2**32 - 1 and struct.unpack_from("!HH", request, 40) == (65535, 40000)


def _pcp_reply(opcode: int, result: int, body: bytes = b"", version: int = 2) -> bytes:
    return struct.pack("!BBBBII", version, 0x80 | opcode, 0, result, 7200, 42) + bytes(12) + body


def test_pcp_refusals_say_whose_code_and_why_whole() -> None:
    with pytest.raises(MappingRefused) as info:  # a NAT-PMP-only gateway's 4-byte answer is enough
        pm.decode_pcp_response(bytes.fromhex("0081 0001"))
    assert (info.value.method, info.value.code) == ("pcp", 1)
    assert info.value.reason == "the gateway speaks NAT-PMP only (answered version 0)"
    with pytest.raises(MappingRefused) as info:  # its code is read from bytes 2-3, unsigned
        pm.decode_pcp_response(bytes.fromhex("0081 8003 00000000"))
    assert info.value.code == 0x8003
    with pytest.raises(MappingRefused) as info:
        pm.decode_pcp_response(_pcp_map_response(result=1, version=1))
    assert (info.value.method, info.value.code) == ("pcp", 1)
    assert info.value.reason == "unsupported version (the gateway speaks PCP version 1)"
    with pytest.raises(MappingRefused) as info:
        pm.decode_pcp_response(_pcp_map_response(result=99))
    assert info.value.reason == "unknown result code"
    # a 3-byte version-0 packet is too short to be NAT-PMP's refusal; an echoed version-0 request is no refusal
    with pytest.raises(MalformedResponse, match="shorter than the 24-byte header"):
        pm.decode_pcp_response(bytes.fromhex("008100"))
    with pytest.raises(MalformedResponse, match="^pcp: opcode 1 is a request, not a response$"):
        pm.decode_pcp_response(bytes([0, 1]) + _pcp_reply(0, 0)[2:])
    # PCP's largest message is still one
    largest = _pcp_reply(0, 0) + bytes(pm.pcp.MAX_PCP_MESSAGE - 24)
    assert pm.decode_pcp_response(largest) == pm.PcpAnnounce(42)


def test_pcp_reply_with_an_ipv6_external_address_keeps_it() -> None:
    body = NONCE + bytes([6, 0, 0, 0]) + struct.pack("!HH", 4001, 5001) + bytes.fromhex("20010db8000000000000000000000001")
    mapping = pm.decode_pcp_response(_pcp_reply(1, 0, body))
    assert isinstance(mapping, pm.PcpMapping) and mapping.external_ip == "2001:db8::1"


def test_pcp_exchanges_take_only_the_answer_about_their_own_mapping() -> None:
    announce = _pcp_reply(0, 0)
    ours = _pcp_map_response()
    assert pm.pcp_announce_reply(announce) == pm.PcpAnnounce(42)
    assert pm.pcp_announce_reply(ours) is None
    with pytest.raises(MalformedResponse):
        pm.pcp_announce_reply(b"\x02\x80")
    assert pm.pcp_map_reply(ours, NONCE, 4001) == pm.PcpMapping(42, 7200, NONCE, "TCP", 4001, 5001, "11.22.33.1")
    assert pm.pcp_map_reply(ours, NONCE, 4002) is None  # another port's
    other = bytes(reversed(NONCE))
    assert pm.pcp_map_reply(_pcp_map_response(nonce=other), NONCE, 4001) is None  # another mapping's
    # another mapping's refusal is not ours: ignored, not raised (checked before decoding)
    assert pm.pcp_map_reply(_pcp_map_response(result=2, nonce=other), NONCE, 4001) is None
    with pytest.raises(MappingRefused, match="not authorized"):
        pm.pcp_map_reply(_pcp_map_response(result=2), NONCE, 4001)
    assert pm.pcp_map_reply(announce, NONCE, 4001) is None  # an answer to another opcode
    assert pm.pcp_map_reply(_pcp_reply(0, 2, NONCE), NONCE, 4001) is None  # even a refusal of another opcode
    assert pm.pcp_map_reply(b"\x02\x80", NONCE, 4001) is None  # two bytes of another opcode's answer
    # another mapping's refusal cut after its nonce (36 bytes) is still not ours
    assert pm.pcp_map_reply(_pcp_map_response(result=2, nonce=other)[:36], NONCE, 4001) is None
    # a NAT-PMP-only gateway's refusal ends the exchange (version 0: no opcode or nonce of PCP's to compare)
    with pytest.raises(MappingRefused, match="NAT-PMP only"):
        pm.pcp_map_reply(bytes.fromhex("0081 0001 00000000"), NONCE, 4001)
    with pytest.raises(MalformedResponse, match="shorter"):  # one byte: no opcode to compare, garbage
        pm.pcp_map_reply(b"\x02", NONCE, 4001)
    # a MAP answer cut before its nonce: garbage, said so
    with pytest.raises(MalformedResponse, match="expected at least 60"):
        pm.pcp_map_reply(ours[:30], NONCE, 4001)
    # the nonce sits at bytes 24-36 of the reply: one that differs only in its last byte is another's
    near = NONCE[:11] + b"\xff"
    assert pm.pcp_map_reply(_pcp_map_response(nonce=near), NONCE, 4001) is None
    assert pm.pcp_map_reply(_pcp_map_response(result=2, nonce=near), NONCE, 4001) is None


def test_pcp_retransmit_delays_jitter_both_ways_around_3_s_doubling() -> None:
    class Edge(random.Random):
        def __init__(self, value: float) -> None:
            super().__init__(0)
            self.value = value

        def uniform(self, a: float, b: float) -> float:
            assert (a, b) == (-0.1, 0.1)
            return self.value

    assert pm.pcp_retransmit_delays(Edge(0.1)) == pytest.approx([3.3 * 2**i for i in range(8)])
    assert pm.pcp_retransmit_delays(Edge(-0.1)) == pytest.approx([2.7 * 2**i for i in range(8)])
    fresh = pm.pcp_retransmit_delays()  # its own generator when given none
    assert len(fresh) == 8 and all(0.9 * 3 * 2**i <= d <= 1.1 * 3 * 2**i for i, d in enumerate(fresh))


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


def test_errors_are_dedloc_errors() -> None:
    error = pm.PortMappingUnavailable("no mapping", [("pcp", "no answer"), ("upnp", "no answer to M-SEARCH")])
    assert isinstance(error, DedlocError) and "\n  pcp: no answer" in str(error) and error.attempts[1][0] == "upnp"
    assert isinstance(MappingRefused("natpmp", 2, "x"), pm.PortMappingError)
    assert issubclass(MalformedResponse, ValueError)


# ---------------------------------------------------------------------- HTTP: every edge, every word


def http(raw: bytes, *, eof: bool = False, max_body: int = pm.MAX_XML) -> pm.HttpResponse | None:
    return pm.parse_http_response(raw, eof=eof, max_body=max_body)


def http_error(raw: bytes, *, eof: bool = False, max_body: int = pm.MAX_XML) -> str:
    with pytest.raises(MalformedResponse) as info:
        pm.parse_http_response(raw, eof=eof, max_body=max_body)
    return str(info.value)


def test_http_responses_whole() -> None:
    assert http(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nLocation: http://x:5000/\r\n\r\nhello!") == pm.HttpResponse(
        200, "OK", {"content-length": "5", "location": "http://x:5000/"}, b"hello")  # a value may hold colons
    assert http(b"HTTP/1.1 200\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n") == pm.HttpResponse(
        200, "", {"transfer-encoding": "chunked"}, b"abc")  # no reason phrase
    assert http(b"HTTP/1.0 404 Not Found\r\nX: y\r\n\r\ngone", eof=True) == pm.HttpResponse(404, "Not Found", {"x": "y"}, b"gone")
    for status in (204, 304):  # no body, whatever follows
        assert http(f"HTTP/1.1 {status} Empty\r\nX: y\r\n\r\n".encode()) == pm.HttpResponse(status, "Empty", {"x": "y"}, b"")
    assert http(b"HTTP/1.1 205 Reset Content\r\n\r\n") is None  # 205 is read to the end as others are
    # an interim 1xx, then the response, read with the same end and the same cap
    assert http(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nall", eof=True) == pm.HttpResponse(200, "OK", {}, b"all")
    assert http_error(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nall", max_body=2) == \
        "HTTP body longer than the 2 bytes allowed"


def test_http_caps_at_their_exact_edge() -> None:
    head = b"HTTP/1.1 200 OK\r\nX: "
    exact = head + b"a" * (pm.MAX_HTTP_HEAD - len(head)) + b"\r\n\r\n"  # the header ends at MAX_HTTP_HEAD
    assert http(exact, eof=True) == pm.HttpResponse(200, "OK", {"x": "a" * (pm.MAX_HTTP_HEAD - len(head))}, b"")
    assert http_error(head + b"a" * (pm.MAX_HTTP_HEAD - len(head) + 1) + b"\r\n\r\n") == \
        f"HTTP header longer than {pm.MAX_HTTP_HEAD} bytes"
    unfinished = b"HTTP/1.1 200 OK\r\n" + b"a" * (pm.MAX_HTTP_HEAD - 17)
    assert len(unfinished) == pm.MAX_HTTP_HEAD and http(unfinished) is None
    assert http_error(unfinished + b"a") == f"HTTP header longer than {pm.MAX_HTTP_HEAD} bytes"
    assert http_error(b"HTTP/1.1 200 OK\r\nContent-Le", eof=True) == "connection closed before the HTTP header ended"
    assert http_error(b"\r\n\r\n") == "not an HTTP/1.x status line: ''"
    assert http(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nfour", max_body=4) is not None
    assert http_error(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfive!", max_body=4) == \
        "HTTP body of 5 bytes, more than the 4 allowed"
    assert http(b"HTTP/1.1 200 OK\r\n\r\nfour", eof=True, max_body=4) is not None
    assert http(b"HTTP/1.1 200 OK\r\nContent-Length: 000000000005\r\n\r\nhello") is not None  # 12 digits
    assert http_error(b"HTTP/1.1 200 OK\r\nContent-Length: 0000000000005\r\n\r\nhello") == "bad Content-Length '0000000000005'"
    assert http_error(b"HTTP/1.1 200 OK\r\nContent-Length: 00000000000000000000005\r\n\r\n") == \
        "bad Content-Length '00000000000000000000'"


def test_http_refusals_word_for_word() -> None:
    assert http_error(b"X" * 100 + b"\r\n\r\n") == f"not an HTTP/1.x status line: {'X' * 80!r}"
    assert http_error(b"HTTP/1.1 200 OK\r\n" + b"Y" * 100 + b"\r\n\r\n") == f"malformed HTTP header line {'Y' * 80!r}"
    assert http_error(b"HTTP/1.1 200 OK\r\n X: y\r\n\r\n") == "malformed HTTP header line ' X: y'"
    assert http_error(b"HTTP/1.1 200 OK\r\n: y\r\n\r\n") == "malformed HTTP header line ': y'"
    assert http_error(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n") == \
        "HTTP header transfer-encoding given twice"
    assert http_error(b"HTTP/1.1 200 OK\r\nContent-Length: 5x\r\n\r\n") == "bad Content-Length '5x'"


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_chunks_at_their_exact_edges_and_words() -> None:
    assert http(CHUNKED + b"10\r\n" + b"s" * 16 + b"\r\n0\r\n\r\n").body == b"s" * 16  # type: ignore[union-attr]  # hex
    assert http(CHUNKED + b"a\r\n" + b"x" * 10 + b"\r\nA\r\n" + b"y" * 10 + b"\r\n0\r\n\r\n").body == b"x" * 10 + b"y" * 10  # type: ignore[union-attr]
    assert http(CHUNKED + b"00000003;a=1;b=2\r\nabc\r\n0\r\n\r\n").body == b"abc"  # type: ignore[union-attr]  # 8 digits, 2 extensions
    assert http_error(CHUNKED + b"000000003\r\nabc\r\n0\r\n\r\n") == "bad chunk size b'000000003'"
    assert http_error(CHUNKED + b"\r\nabc") == "bad chunk size b''"
    assert http_error(CHUNKED + b"z" * 30 + b"\r\n") == f"bad chunk size {b'z' * 20!r}"
    assert http(CHUNKED + b"4\r\nfour\r\n0\r\n\r\n", max_body=4) is not None
    assert http_error(CHUNKED + b"5\r\nfive!\r\n0\r\n\r\n", max_body=4) == "chunked HTTP body longer than the 4 bytes allowed"
    # a size line without its end: waited for up to 1,024 bytes, after chunks already read too
    first = CHUNKED + b"5\r\nhello\r\n"
    assert http(first + b"a" * 1024) is None
    assert http_error(first + b"a" * 1025) == "chunk size line too long"
    # trailers: waited for up to MAX_HTTP_HEAD bytes
    last = first + b"0\r\n"
    assert http(last + b"T" * pm.MAX_HTTP_HEAD) is None
    assert http_error(last + b"T" * (pm.MAX_HTTP_HEAD + 1)) == "HTTP trailer too long"
    assert http_error(CHUNKED + b"2\r\nabXY") == "chunk not followed by CRLF"
    for cut in (first + b"5\r\nwor", first, last + b"X: 1\r\n"):  # mid-chunk, between chunks, in the trailer
        assert http(cut) is None
        assert http_error(cut, eof=True) == "connection closed in the middle of a chunked body"


def test_http_requests_word_for_word() -> None:
    assert pm.http_request("GET", "http://192.168.77.1:5000") == \
        b"GET / HTTP/1.1\r\nHost: 192.168.77.1:5000\r\nConnection: close\r\n\r\n"
    assert pm.http_request("POST", "http://192.168.77.1/c") == \
        b"POST /c HTTP/1.1\r\nHost: 192.168.77.1\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    assert pm.http_request("PUT", "http://192.168.77.1/c", body=b"ab").endswith(b"Content-Length: 2\r\n\r\nab")
    assert b"Content-Length" not in pm.http_request("DELETE", "http://192.168.77.1/c")
    for value in ("a\rb", "a\nb"):
        with pytest.raises(ConfigError) as info:
            pm.http_request("GET", "http://1.2.3.4/", headers=[("X", value)])
        assert str(info.value) == f"line break in an HTTP header: {'X: ' + value!r}"


# ---------------------------------------------------------------------- SSDP, XML, SOAP: every edge, every word


def ssdp_error(data: bytes) -> str:
    with pytest.raises(MalformedResponse) as info:
        pm.parse_ssdp_response(data)
    return str(info.value)


def test_ssdp_answers_word_for_word() -> None:
    bare = b"HTTP/1.1 200 OK\r\nLOCATION: http://192.168.1.1:80/d.xml\r\n\r\nST: ignored\r\n\r\n"
    assert pm.parse_ssdp_response(bare) == pm.SsdpResponse("http://192.168.1.1:80/d.xml", "", "", "")
    assert pm.parse_ssdp_response(SSDP_ANSWER + b"x" * (pm.MAX_SSDP_DATAGRAM - len(SSDP_ANSWER))).location.endswith("rootDesc.xml")
    assert ssdp_error(SSDP_ANSWER + b"x" * (pm.MAX_SSDP_DATAGRAM - len(SSDP_ANSWER) + 1)) == \
        f"SSDP reply of {pm.MAX_SSDP_DATAGRAM + 1} bytes, more than {pm.MAX_SSDP_DATAGRAM}"
    assert ssdp_error(b"N" * 100 + b"\r\n\r\n") == f"not an SSDP search answer: {'N' * 80!r}"
    assert ssdp_error(b"HTTP/1.1 200 OK\r\nST: x\r\n\r\n") == "SSDP answer without LOCATION"
    far = "http://" + "h" * 100
    assert ssdp_error(f"HTTP/1.1 200 OK\r\nLOCATION: s{far}\r\n\r\n".encode()) == \
        f"SSDP LOCATION is not an http URL: {('s' + far)[:80]!r}"


def test_xml_refusals_word_for_word() -> None:
    assert pm.parse_xml(b"<a>" + b"x" * (pm.MAX_XML - 7) + b"</a>").text == "x" * (pm.MAX_XML - 7)
    with pytest.raises(MalformedResponse) as info:
        pm.parse_xml(b"<a>" + b"x" * (pm.MAX_XML - 6) + b"</a>")
    assert str(info.value) == f"XML document of {pm.MAX_XML + 1} bytes, more than the {pm.MAX_XML} allowed"
    for dtd in (b'<!doctype root SYSTEM "x"><root/>', b"<!Entity x 'y'><root/>"):
        with pytest.raises(MalformedResponse) as info:
            pm.parse_xml(dtd)
        assert str(info.value) == "XML with a DTD or entity declaration refused"


def test_the_description_and_its_urls_word_for_word() -> None:
    def error(body: bytes, location: str = LOCATION) -> str:
        with pytest.raises(MalformedResponse) as info:
            pm.parse_device_description(body, location)
        return str(info.value)

    long = "x" * 150
    assert error(_description(_service("WANIPConnection:1", f"https://192.168.77.1/{long}"))) == \
        f"controlURL is not an http URL: {f'https://192.168.77.1/{long}'[:120]!r}"
    assert error(_description(_service("WANIPConnection:1", f"http://router.lan/{long}"))) == \
        f"controlURL names a host, not an IPv4 address: {f'http://router.lan/{long}'[:120]!r}"
    assert error(_description(_service("WANIPConnection:1", f"http://192.168.77.1:99999/{long}"))) == \
        f"controlURL has a bad port: {f'http://192.168.77.1:99999/{long}'[:120]!r}"
    assert error(_description(_service("Layer3Forwarding:1", "/x"))) == \
        "device description lists no WANIPConnection or WANPPPConnection service"
    # an empty URLBase is no base; tags in any namespace count by their local name
    for base in (" ", "<empty/>"):
        empty_base = _description(_service("WANIPConnection:1", "/c"), url_base=base)
        if base == "<empty/>":
            empty_base = empty_base.replace(b"<URLBase><empty/></URLBase>", b"<URLBase/>")
        assert pm.parse_device_description(empty_base, LOCATION)[0].control_url == "http://192.168.77.1:5000/c"
    assert error(_description(_service("WANIPConnection:1", "/c")), location="http:///nohost.xml") == \
        "controlURL is not an http URL: 'http:///c'"


def fault(inner: str) -> bytes:
    return _soap_reply(f"<s:Fault><faultcode>s:Client</faultcode>{inner}</s:Fault>")


def test_soap_faults_word_for_word() -> None:
    bare = pm.parse_soap_fault(fault("<faultstring>Not today</faultstring>"))
    assert bare is not None and (bare.method, bare.code, bare.reason) == ("upnp", 0, "Not today")
    assert str(bare) == "upnp: the gateway refused (code 0: Not today)"
    silent = pm.parse_soap_fault(fault(""))
    assert silent is not None and (silent.code, silent.reason) == (0, "SOAP fault without a UPnP error")
    known = pm.parse_soap_fault(_fault("718"))
    assert known is not None and (known.method, known.code, known.reason) == ("upnp", 718, pm.UPNP_ERRORS[718])
    unknown = pm.parse_soap_fault(_fault("799"))
    assert unknown is not None and unknown.reason == "unknown error"
    empty = pm.parse_soap_fault(_fault("718").replace(b"</errorCode>", b"</errorCode><errorDescription/>"))
    assert empty is not None and empty.reason == pm.UPNP_ERRORS[718]  # an empty description is none
    described = pm.parse_soap_fault(_fault("718", "Taken, sorry"))
    assert described is not None and described.reason == "Taken, sorry"
    with pytest.raises(MalformedResponse) as info:
        pm.parse_soap_fault(_fault("x" * 30))
    assert str(info.value) == f"SOAP fault with a bad errorCode {'x' * 20!r}"


def test_soap_envelopes_word_for_word() -> None:
    body = pm.soap_envelope(SERVICE, "AddPortMapping", [("A", "1"), ("B", "2")])
    assert body == (
        '<?xml version="1.0"?>\r\n<s:Envelope xmlns:s="http://schemas.xmlsoap.org/soap/envelope/" '
        's:encodingStyle="http://schemas.xmlsoap.org/soap/encoding/">'
        f'<s:Body><u:AddPortMapping xmlns:u="{SERVICE}"><A>1</A><B>2</B></u:AddPortMapping></s:Body></s:Envelope>'
    ).encode()
    with pytest.raises(ConfigError) as info:
        pm.soap_envelope("urn:x" + "y" * 100, "Add", [])
    assert str(info.value) == f"not a UPnP service type: {('urn:x' + 'y' * 100)[:80]!r}"
    with pytest.raises(ConfigError) as info:
        pm.soap_envelope(SERVICE, "Add Port", [])
    assert str(info.value) == "not a SOAP action name: 'Add Port'"
    assert pm.decode_soap_response(200, EXTERNAL_IP_REPLY.replace(b"11.22.33.1", b""), "GetExternalIPAddress") == \
        {"NewExternalIPAddress": ""}
    with pytest.raises(MalformedResponse) as info:
        pm.decode_soap_response(201, b"<<not xml", "GetExternalIPAddress")
    assert str(info.value) == "upnp: HTTP 201 from the control URL, body unreadable"
