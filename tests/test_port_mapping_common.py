"""nat/port_mapping/common.py, what the three port-mapping protocols share: their errors, the default
gateway and our address towards it, the argument checks, and the UDP request/response that NAT-PMP and
PCP run over, against loopback fakes (UDP to 127.0.0.1 only) and, for the errors a loopback cannot
produce (no route to the gateway), a scripted socket. Fast, so that ``make mutate`` runs it for every
mutant of the module (the protocols against a real miniupnpd: tests/test_port_mapping.py).
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from nat import port_mapping as pm
from nat.port_mapping import MalformedResponse, MappingRefused, common
from p2p.errors import ConfigError, DedlocError
from tests.test_port_mapping_codecs import NONCE, _pcp_map_response

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- the UDP exchange against loopback fakes
# (UDP to 127.0.0.1 only)


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


def take(answer: bytes) -> Callable[[bytes], bytes | None]:
    """An ``accept`` that takes ``answer``, calls b"bad" malformed and ignores anything else."""
    def accept(data: bytes) -> bytes | None:
        if data == b"bad":
            raise MalformedResponse(f"garbled: {data!r}")
        return data if data == answer else None
    return accept


async def test_an_exchange_sends_once_per_delay_until_the_answer_and_passes_over_strays() -> None:
    async with fake_udp_gateway(lambda n, request: [] if n < 3 else [b"stray", b"bad", b"yes"]) as (port, received):
        began = trio.current_time()
        with trio.fail_after(5):
            assert await common._udp_exchange("127.0.0.1", b"ask", take(b"yes"), [0.1, 0.1, 5, 5], what="t", port=port) == b"yes"
        assert received == [b"ask"] * 3 and 0.2 <= trio.current_time() - began < 4


async def test_a_garbled_reply_is_passed_over_within_the_same_try() -> None:
    async with fake_udp_gateway(lambda n, request: [b"bad", b"yes"]) as (port, received):
        with trio.fail_after(5):
            assert await common._udp_exchange("127.0.0.1", b"ask", take(b"yes"), [5], what="t", port=port) == b"yes"
        assert received == [b"ask"]


async def test_an_exchange_with_no_answer_says_how_many_tries_and_the_last_garbled_reply() -> None:
    async with fake_udp_gateway(lambda n, request: [b"bad"] if n == 1 else [b"stray"]) as (port, received):
        with pytest.raises(pm.PortMappingError) as failed:
            await common._udp_exchange("127.0.0.1", b"ask", take(b"yes"), [0.05, 0.05, 0.05], what="natpmp", port=port)
        assert str(failed.value) == (f"natpmp: no answer from 127.0.0.1:{port} after 3 tries "
                                     "(last reply: garbled: b'bad')")
        assert len(received) == 3 and failed.value.__cause__ is None
    async with fake_udp_gateway(lambda n, request: []) as (port, received):
        with pytest.raises(pm.PortMappingError) as failed:
            await common._udp_exchange("127.0.0.1", b"ask", take(b"yes"), [0.05], what="pcp", port=port)
        assert str(failed.value) == f"pcp: no answer from 127.0.0.1:{port} after 1 tries" and received == [b"ask"]


async def test_an_exchange_reads_a_reply_one_byte_past_the_largest_pcp_message() -> None:
    longest = b"x" * (common.MAX_PCP_MESSAGE + 1)  # so that a too-long one is seen as such, not cut to fit
    seen: list[int] = []

    def accept(data: bytes) -> bytes:
        seen.append(len(data))
        return data

    async with fake_udp_gateway(lambda n, request: [longest + b"yz"]) as (port, _):
        with trio.fail_after(5):
            assert await common._udp_exchange("127.0.0.1", b"ask", accept, [1], what="t", port=port) == longest
    assert seen == [common.MAX_PCP_MESSAGE + 1]


async def test_a_refusal_ends_the_exchange_at_once() -> None:
    def refuse(data: bytes) -> None:
        raise MappingRefused("pcp", 2, "NOT_AUTHORIZED")

    async with fake_udp_gateway(lambda n, request: [b"no"]) as (port, received):
        with trio.fail_after(1), pytest.raises(MappingRefused):
            await common._udp_exchange("127.0.0.1", b"ask", refuse, [5, 5], what="pcp", port=port)
        assert received == [b"ask"]


class ScriptedSocket:
    """A UDP socket whose connect or send fails as told (a loopback always has a route)."""

    def __init__(self, *, connect: OSError | None = None, send: OSError | None = None) -> None:
        self.connect_error, self.send_error, self.closed = connect, send, False

    def __enter__(self) -> ScriptedSocket:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.closed = True

    async def connect(self, address: tuple[str, int]) -> None:
        if self.connect_error:
            raise self.connect_error

    async def send(self, data: bytes) -> int:
        if self.send_error:
            raise self.send_error
        return len(data)

    async def recv(self, size: int) -> bytes:
        await trio.sleep_forever()
        raise AssertionError


@pytest.mark.parametrize("where", ["connect", "send"])
@pytest.mark.parametrize("code, reason", [(errno.ENETUNREACH, "Network is unreachable"),
                                          (errno.EHOSTUNREACH, "No route to host")])
async def test_a_gateway_out_of_reach_is_said_with_the_reason(monkeypatch: pytest.MonkeyPatch, where: str,
                                                              code: int, reason: str) -> None:
    sock = ScriptedSocket(**{where: OSError(code, reason)})
    monkeypatch.setattr(trio.socket, "socket", lambda *args: sock)
    with pytest.raises(pm.PortMappingError) as failed:
        await common._udp_exchange("10.9.8.7", b"ask", take(b"yes"), [5], what="natpmp")
    assert str(failed.value) == f"natpmp: 10.9.8.7 is unreachable ({reason})" and sock.closed
    assert failed.value.__cause__ is None and failed.value.__suppress_context__


async def test_a_refused_port_is_said_and_other_os_errors_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    sock = ScriptedSocket(send=ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    monkeypatch.setattr(trio.socket, "socket", lambda *args: sock)
    with pytest.raises(pm.PortMappingError) as failed:
        await common._udp_exchange("10.9.8.7", b"ask", take(b"yes"), [5], what="pcp", port=5350)
    assert str(failed.value) == "pcp: nothing listens on 10.9.8.7:5350 (ICMP port unreachable)"
    assert failed.value.__suppress_context__
    denied = PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(trio.socket, "socket", lambda *args: ScriptedSocket(connect=denied))
    with pytest.raises(PermissionError) as passed:
        await common._udp_exchange("10.9.8.7", b"ask", take(b"yes"), [5], what="pcp")
    assert passed.value is denied


async def test_an_exchange_asks_the_gateway_s_port_5351_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, int]] = []

    class Recording(ScriptedSocket):
        async def connect(self, address: tuple[str, int]) -> None:
            asked.append(address)
            raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(trio.socket, "socket", lambda *args: Recording())
    with pytest.raises(pm.PortMappingError):
        await common._udp_exchange("10.9.8.7", b"ask", take(b"yes"), [5], what="pcp")
    assert asked == [("10.9.8.7", 5351)]


# ---------------------------------------------------------------------- the gateway and our address


ROUTES = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n"


def route(dest: str = "00000000", gw: str = "0100A8C0", flags: str = "0003", metric: int | str = 0,
          mask: str = "00000000") -> str:
    return f"eth0\t{dest}\t{gw}\t{flags}\t0\t0\t{metric}\t{mask}\t0\t0\t0\n"


@pytest.mark.parametrize("line", [
    route(dest="0000A8C0"),        # a network, not the default route
    route(mask="00FFFFFF"),        # the same
    route(flags="0001"),           # up, but no gateway: on link
    route(flags="0002"),           # a gateway, but down
    route(gw="00000000"),          # a gateway of 0.0.0.0
    "eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\n",  # seven fields: cut short
    route(metric="x"),             # not a number
])
def test_a_route_that_is_not_an_up_default_route_through_a_gateway_is_passed_over(line: str) -> None:
    assert pm.parse_default_gateway(ROUTES + line, byteorder="little") is None
    assert pm.parse_default_gateway(ROUTES + line + route(gw="0200A8C0"), byteorder="little") == "192.168.0.2"


def test_the_route_right_under_the_header_counts_and_eight_fields_are_enough() -> None:
    assert pm.parse_default_gateway(ROUTES + route(gw="0100A8C0"), byteorder="little") == "192.168.0.1"
    eight = "eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\n"
    assert pm.parse_default_gateway(ROUTES + eight, byteorder="little") == "192.168.0.1"


def test_the_lowest_metric_wins_and_of_equals_the_first_listed() -> None:
    table = ROUTES + route(gw="0100A8C0", metric=5) + route(gw="0200A8C0", metric=3) + route(gw="0300A8C0", metric=3)
    assert pm.parse_default_gateway(table, byteorder="little") == "192.168.0.2"
    assert pm.parse_default_gateway(route(gw="0200A8C0"), byteorder="little") is None  # the first line is the header


def test_the_default_gateway_is_read_from_proc_and_none_where_it_cannot_be(monkeypatch: pytest.MonkeyPatch) -> None:
    with open("/proc/net/route", encoding="ascii") as f:
        assert pm.default_gateway() == pm.parse_default_gateway(f.read())
    opened: list[tuple[Any, ...]] = []

    class Table:
        def __enter__(self) -> Table:
            return self

        def __exit__(self, *exc: Any) -> None:
            pass

        def read(self) -> str:
            return ROUTES + route(gw="0100A8C0")

    def fake_open(*args: Any, **kwargs: Any) -> Table:
        opened.append((*args, kwargs))
        return Table()

    monkeypatch.setattr(common, "open", fake_open, raising=False)
    assert pm.default_gateway() == pm.parse_default_gateway(ROUTES + route(gw="0100A8C0"))
    assert opened == [("/proc/net/route", {"encoding": "ascii", "errors": "replace"})]

    def no_proc(*args: Any, **kwargs: Any) -> Table:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(common, "open", no_proc, raising=False)
    assert pm.default_gateway() is None


def test_our_address_towards_a_host_is_the_one_the_kernel_would_send_from() -> None:
    assert pm.local_address_towards("127.0.0.1") == "127.0.0.1"
    assert pm.local_address_towards("127.3.2.1") == "127.0.0.1"


# ---------------------------------------------------------------------- argument checks, errors and their words


def test_an_ipv4_address_is_parsed_and_anything_else_refused_by_name() -> None:
    assert common._ipv4("192.168.0.1", "gateway") == ipaddress.IPv4Address("192.168.0.1")
    for bad in ("::1", "192.168.0", "router"):
        with pytest.raises(ConfigError) as refused:
            common._ipv4(bad, "gateway")
        assert str(refused.value) == f"gateway must be an IPv4 address, not {bad!r}"
        assert refused.value.__suppress_context__


def test_a_port_is_1_to_65535_or_0_where_allowed() -> None:
    for port in (1, 65535):
        common._check_port(port, "internal port")
    common._check_port(0, "external port", allow_zero=True)
    bad: list[tuple[Any, bool]] = [(0, False), (-1, True), (65536, False), (65536, True), ("80", False), (80.0, False)]
    for port, zero in bad:
        with pytest.raises(ConfigError) as refused:
            common._check_port(port, "internal port", allow_zero=zero)
        assert str(refused.value) == f"internal port must be a port number 1-65535, not {port!r}"


def test_errors_say_whose_and_what() -> None:
    refused = MappingRefused("natpmp", 3, "NETWORK_FAILURE")
    assert (refused.method, refused.code, refused.reason) == ("natpmp", 3, "NETWORK_FAILURE")
    assert str(refused) == "natpmp: the gateway refused (code 3: NETWORK_FAILURE)"
    assert isinstance(refused, pm.PortMappingError) and isinstance(refused, DedlocError)
    assert isinstance(MalformedResponse("x"), ValueError) and isinstance(MalformedResponse("x"), pm.PortMappingError)
    none = pm.PortMappingUnavailable("no mapping")
    assert (str(none), none.attempts) == ("no mapping", [])
    tried = pm.PortMappingUnavailable("no mapping", [("pcp", "no answer"), ("upnp", "refused")])
    assert str(tried) == "no mapping\n  pcp: no answer\n  upnp: refused"
    assert tried.attempts == [("pcp", "no answer"), ("upnp", "refused")]


def test_a_failure_is_described_in_one_line_without_its_method_twice() -> None:
    assert common._describe(OSError(errno.ENETUNREACH, "Network is unreachable")) == "Network is unreachable"
    assert common._describe(OSError("no strerror")) == "no strerror"
    assert common._describe(TimeoutError()) == "TimeoutError"
    assert common._describe(pm.PortMappingError("pcp: no answer"), "pcp") == "no answer"
    assert common._describe(pm.PortMappingError("pcp: no answer"), "upnp") == "pcp: no answer"
    assert common._describe(pm.PortMappingError("pcp: no answer")) == "pcp: no answer"
    assert common._describe(pm.PortMappingError("pcp: pcp: twice"), "pcp") == "pcp: twice"
    assert common._describe(pm.PortMappingError(": odd")) == ": odd"  # no method, nothing dropped


def test_the_numbers_the_rfcs_and_the_upnp_forum_fix() -> None:
    assert (common.PMP_PORT, common.PCP_VERSION, common.MAX_PCP_MESSAGE) == (5351, 2, 1100)
    assert (common.SSDP_GROUP, common.SSDP_PORT, common.SSDP_TTL) == ("239.255.255.250", 1900, 2)
    assert common.MAX_UPNP_LEASE == 7 * 24 * 3600 and common.ALL_METHODS == ("pcp", "natpmp", "upnp")
    assert (common.MAX_XML, common.MAX_HTTP_HEAD, common.MAX_SSDP_DATAGRAM) == (65536, 16384, 8192)
    assert common.WAN_SERVICE_TYPES[0] == "urn:schemas-upnp-org:service:WANIPConnection:2"
    assert set(common.WAN_SERVICE_TYPES) < set(common.IGD_SEARCH_TARGETS)


async def test_a_mapper_is_an_interface_whose_methods_each_protocol_writes() -> None:
    mapper = common._Mapper()
    with pytest.raises(NotImplementedError):
        await mapper.map(4001, 3600)
    with pytest.raises(NotImplementedError):
        await mapper.unmap()
