"""UPnP IGD's I/O against loopback fakes: SSDP discovery, the description and SOAP over HTTP, the mapper.

A fake router listens on loopback addresses only: SSDP on a UDP port of the gateway's address (and
the "group", another loopback address on the same port, as the multicast search's target: no test
sends a packet off loopback), its description and control URL over HTTP. The wire formats
alone: tests/test_port_mapping_codecs.py; the real thing, against miniupnpd in namespaces:
tests/test_port_mapping.py.

These run in real time (a UDP answer in virtual time could be jumped past); the tests that bound
it are marked ``realtime``, with bounds far from what they measure.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import pytest
import trio

from nat import port_mapping as pm
from nat.port_mapping import MalformedResponse, MappingRefused, PortMappingError
from p2p.errors import ConfigError
from tests.test_port_mapping_codecs import (EXTERNAL_IP_REPLY, SERVICE, SoapCall, _description, _fault, _service,
                                            _soap_reply)

from .kit import log_lines

#: the router, and our own address (a search sent to "no address" reaches 127.0.0.1: not the router)
GATEWAY = "127.0.0.4"
LOCAL = "127.0.0.1"
#: the "multicast group" of these tests, and another device on the LAN that answers there
GROUP = "127.0.0.2"
DEVICE = "127.0.0.3"
IGD = "urn:schemas-upnp-org:device:InternetGatewayDevice:1"


def ssdp_answer(location: str, *, st: str = IGD, server: str = "MiniUPnPd/2.3.1") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nST: {st}\r\nUSN: uuid:x::{st}\r\nSERVER: {server}\r\nLOCATION: {location}\r\n\r\n"
            ).encode()


@dataclass
class Ssdp:
    """SSDP responders on one port: the gateway's address, the group's, and what each answers to the
    n-th search it gets (a list of (delay, datagram)); ``heard`` is every search, by address."""

    port: int = 0
    gateway: Callable[[int, bytes], list[tuple[float, bytes]]] = lambda n, search: []
    group: Callable[[int, bytes], list[tuple[float, bytes]]] = lambda n, search: []
    heard: dict[str, list[bytes]] = field(default_factory=lambda: {GATEWAY: [], GROUP: []})


@asynccontextmanager
async def ssdp_responders(ssdp: Ssdp) -> AsyncIterator[Ssdp]:
    """The gateway's socket, then the group's on the same port (the group's answers come from
    another device's address, as a LAN device answers a multicast search)."""
    gw = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    grp = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    device = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    with gw, grp, device:
        await gw.bind((GATEWAY, 0))
        ssdp.port = gw.getsockname()[1]
        await grp.bind((GROUP, ssdp.port))
        await device.bind((DEVICE, 0))

        async def serve(sock: trio.socket.SocketType, where: str, answer: Callable[[int, bytes], list[tuple[float, bytes]]],
                        sender: trio.socket.SocketType, nursery: trio.Nursery) -> None:
            while True:
                data, peer = await sock.recvfrom(65536)
                ssdp.heard[where].append(data)
                for delay, reply in answer(len(ssdp.heard[where]), data):
                    nursery.start_soon(send_later, sender, delay, reply, peer)

        async def send_later(sock: trio.socket.SocketType, delay: float, reply: bytes, peer: tuple[str, int]) -> None:
            await trio.sleep(delay)
            await sock.sendto(reply, peer)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, gw, GATEWAY, lambda n, d: ssdp.gateway(n, d), gw, nursery)
            nursery.start_soon(serve, grp, GROUP, lambda n, d: ssdp.group(n, d), device, nursery)
            yield ssdp
            nursery.cancel_scope.cancel()


async def search(ssdp: Ssdp, timeout: float) -> tuple[list[tuple[str, pm.SsdpResponse]], float]:
    started = trio.current_time()
    found = await pm.ssdp_search(GATEWAY, LOCAL, timeout=timeout, port=ssdp.port, group=GROUP)
    return found, trio.current_time() - started


ROUNDS = len(pm.IGD_SEARCH_TARGETS)


# ---------------------------------------------------------------------- SSDP


@pytest.mark.realtime  # bounds a search's real time, far from it
async def test_a_search_goes_to_the_gateway_and_the_group_and_ends_when_the_gateway_answers() -> None:
    location = f"http://{GATEWAY}:5000/rootDesc.xml"
    ssdp = Ssdp(gateway=lambda n, search: [(0.05, ssdp_answer(location))] if n == 1 else [],
                group=lambda n, search: [(0.0, ssdp_answer(f"http://{DEVICE}:80/d.xml"))] if n == 1 else [])
    async with ssdp_responders(ssdp):
        found, took = await search(ssdp, timeout=5.0)
    assert [(sender, answer.location) for sender, answer in found] == [
        (GATEWAY, location), (DEVICE, f"http://{DEVICE}:80/d.xml")]  # the gateway's first, though it came second
    assert found[0][1] == pm.SsdpResponse(location, IGD, f"uuid:x::{IGD}", "MiniUPnPd/2.3.1")
    assert took < 2.5  # not the timeout: the gateway answered
    # one search of each target to each, in the first round only (the gateway answered before the second)
    assert ssdp.heard[GATEWAY] == [pm.ssdp_search_request(st, host=f"{GATEWAY}:{ssdp.port}", mx=None)
                                   for st in pm.IGD_SEARCH_TARGETS]
    assert ssdp.heard[GROUP] == [pm.ssdp_search_request(st, host=f"{GROUP}:{ssdp.port}") for st in pm.IGD_SEARCH_TARGETS]


@pytest.mark.realtime  # bounds a search's real time, far from it
async def test_a_search_is_sent_again_once_after_half_a_second() -> None:
    """A datagram lost: the first round goes unanswered, the second (0.5 s later) is answered; no third."""
    location = f"http://{GATEWAY}:5000/rootDesc.xml"
    ssdp = Ssdp(gateway=lambda n, search: [(0.0, ssdp_answer(location))] if n == ROUNDS + 1 else [])
    async with ssdp_responders(ssdp):
        found, took = await search(ssdp, timeout=5.0)
    assert [sender for sender, _ in found] == [GATEWAY] and 0.5 <= took < 2.5
    assert len(ssdp.heard[GATEWAY]) == 2 * ROUNDS
    ssdp = Ssdp()
    async with ssdp_responders(ssdp):
        found, took = await search(ssdp, timeout=1.5)
    assert found == [] and took == pytest.approx(1.5, abs=0.5)
    assert len(ssdp.heard[GATEWAY]) == len(ssdp.heard[GROUP]) == 2 * ROUNDS  # two rounds, however long the wait


@pytest.mark.realtime  # bounds a search's real time, far from it
async def test_a_search_ignores_garbage_other_services_and_repeats(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing from the gateway itself: the search runs to its timeout, keeping each IGD's first answer."""
    here = f"http://{DEVICE}:80/d.xml"
    replies = [(0.0, b"NOTIFY * HTTP/1.1\r\n\r\n"), (0.0, ssdp_answer(f"http://{DEVICE}:81/tv.xml", st="urn:tv")),
               (0.0, ssdp_answer(here)), (0.01, ssdp_answer(here, server="again")),
               (0.02, ssdp_answer(f"http://{DEVICE}:82/d.xml", st=pm.IGD_SEARCH_TARGETS[-1]))]
    ssdp = Ssdp(group=lambda n, search: replies if n == 1 else [])
    async with ssdp_responders(ssdp):
        with caplog.at_level(logging.DEBUG, "nat.port_mapping.upnp"):
            found, took = await search(ssdp, timeout=1.0)
    assert [(sender, answer.location, answer.server) for sender, answer in found] == [
        (DEVICE, here, "MiniUPnPd/2.3.1"), (DEVICE, f"http://{DEVICE}:82/d.xml", "MiniUPnPd/2.3.1")]
    assert took == pytest.approx(1.0, abs=0.4)
    assert log_lines(caplog, "nat.port_mapping.upnp", "ignoring") == [
        f"ignoring an SSDP datagram from {DEVICE}: not an SSDP search answer: 'NOTIFY * HTTP/1.1'"]


async def test_a_search_whose_group_is_unreachable_still_asks_the_gateway(caplog: pytest.LogCaptureFixture) -> None:
    location = f"http://{GATEWAY}:5000/rootDesc.xml"
    ssdp = Ssdp(gateway=lambda n, search: [(0.0, ssdp_answer(location))] if n == 1 else [])
    async with ssdp_responders(ssdp):
        with caplog.at_level(logging.DEBUG, "nat.port_mapping.upnp"):
            found = await pm.ssdp_search(GATEWAY, LOCAL, timeout=5.0, port=ssdp.port, group="255.255.255.255")
    assert [sender for sender, _ in found] == [GATEWAY]
    lines = log_lines(caplog, "nat.port_mapping.upnp", "M-SEARCH to")
    assert lines[0] == f"M-SEARCH to ('255.255.255.255', {ssdp.port}) failed: [Errno 13] Permission denied"


# ---------------------------------------------------------------------- HTTP: the description and SOAP


@dataclass
class Web:
    """The router's HTTP server: ``pages`` by path for GET ((status, body)), ``script(action, args)``
    for each SOAP call (a reply with a Fault goes out as a 500); what it was asked, in order."""

    script: Callable[[str, dict[str, str]], bytes] = lambda action, args: EXTERNAL_IP_REPLY
    pages: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    port: int = 0
    gets: list[str] = field(default_factory=list)
    calls: list[SoapCall] = field(default_factory=list)
    #: each request's line and headers, as sent
    heads: list[list[str]] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"http://{GATEWAY}:{self.port}{path}"


@asynccontextmanager
async def web_server(web: Web) -> AsyncIterator[Web]:
    async def handle(stream: trio.SocketStream) -> None:
        buf = b""
        with trio.move_on_after(5):
            while b"\r\n\r\n" not in buf:
                buf += await stream.receive_some(65536)
            head, _, body = buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            web.heads.append([line.decode() for line in lines])
            method, path, _ = lines[0].decode().split(" ")
            if method == "GET":
                web.gets.append(path)
                status, reply = web.pages.get(path, (404, b"not here"))
            else:
                length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += await stream.receive_some(65536)
                soap_action = next(line for line in lines if line.lower().startswith(b"soapaction"))
                action = soap_action.decode().split("#")[1].strip('"')
                call = next(e for e in pm.parse_xml(body).iter() if e.tag.endswith(action))
                args = {child.tag: child.text or "" for child in call}
                web.calls.append((action, args))
                reply = web.script(action, args)
                status = 500 if b"Fault" in reply else 200
            head = f"HTTP/1.1 {status} X\r\nContent-Type: text/xml\r\nContent-Length: {len(reply)}\r\n\r\n".encode()
            await stream.send_all(head + reply)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host=GATEWAY))
        web.port = listeners[0].socket.getsockname()[1]
        yield web
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def fake_igd(script: Callable[[str, dict[str, str]], bytes]) -> AsyncIterator[tuple[pm.IgdService, list[SoapCall]]]:
    """An IGD control URL on 127.0.0.1: ``script(action, args)`` gives each SOAP reply body (500 if a fault)."""
    async with web_server(Web(script)) as web:
        yield pm.IgdService(SERVICE, web.url("/ctl/IPConn")), web.calls


@asynccontextmanager
async def router(web: Web, *, location: str = "/rootDesc.xml") -> AsyncIterator[tuple[Ssdp, Web]]:
    """The gateway: its SSDP answer points at ``location`` on its web server."""
    async with web_server(web):
        ssdp = Ssdp(gateway=lambda n, search: [(0.0, ssdp_answer(web.url(location)))] if n == 1 else [])
        async with ssdp_responders(ssdp):
            yield ssdp, web


async def discover(ssdp: Ssdp, timeout: float = 5.0) -> tuple[pm.UpnpGateway, str]:
    return await pm.discover_upnp(GATEWAY, LOCAL, timeout=timeout, ssdp_port=ssdp.port, ssdp_group=GROUP)


def description(*services: tuple[str, str]) -> bytes:
    return _description("".join(_service(kind, control) for kind, control in services))


@pytest.mark.realtime  # bounds the discovery's real time, far from it
async def test_discovery_reads_the_description_and_proves_the_control_url() -> None:
    web = Web(pages={"/rootDesc.xml": (200, description(("WANIPConnection:1", "/ctl/IPConn")))})
    async with router(web) as (ssdp, web):
        started = trio.current_time()
        gateway, external = await discover(ssdp)
        assert trio.current_time() - started < 1.5  # the gateway answered: no waiting out the search's 2 s
    assert ssdp.heard[GROUP] and ssdp.heard[GATEWAY]  # searched at both
    assert external == "11.22.33.1"
    assert web.heads[1] == ["POST /ctl/IPConn HTTP/1.1", f"Host: {GATEWAY}:{web.port}", "Connection: close",
                            'Content-Type: text/xml; charset="utf-8"', f'SOAPAction: "{SERVICE}#GetExternalIPAddress"',
                            f"Content-Length: {len(pm.soap_envelope(SERVICE, 'GetExternalIPAddress', []))}"]
    assert gateway == pm.UpnpGateway(web.url("/rootDesc.xml"), pm.IgdService(SERVICE, web.url("/ctl/IPConn")),
                                     LOCAL, "MiniUPnPd/2.3.1")
    assert web.gets == ["/rootDesc.xml"] and web.calls == [("GetExternalIPAddress", {})]


@pytest.mark.parametrize("first", [_fault("501", "Action Failed"), EXTERNAL_IP_REPLY.replace(b"11.22.33.1", b"")],
                         ids=["fault", "no-address-yet"])
async def test_discovery_goes_on_to_the_next_service_when_one_fails(first: bytes) -> None:
    def script(action: str, args: dict[str, str]) -> bytes:
        return EXTERNAL_IP_REPLY if len(web.calls) == 2 else first

    web = Web(script, pages={"/rootDesc.xml": (200, description(("WANIPConnection:1", "/a"), ("WANPPPConnection:1", "/b")))})
    async with router(web) as (ssdp, web):
        gateway, external = await discover(ssdp)
    assert external == "11.22.33.1" and gateway.service.control_url == web.url("/b")
    assert [action for action, _ in web.calls] == ["GetExternalIPAddress"] * 2


@pytest.mark.parametrize(("pages", "script", "says"), [
    ({}, None, "{root}: HTTP 404 for the device description"),
    ({"/rootDesc.xml": (200, b"<root>")}, None, "{root}: XML does not parse: "),
    ({"/rootDesc.xml": (200, description(("WANIPConnection:1", "/a")))},
     lambda action, args: _fault("501", "Action Failed"), "{a}: upnp: the gateway refused (code 501: Action Failed)"),
    ({"/rootDesc.xml": (200, description(("WANIPConnection:1", "/a")))},
     lambda action, args: _soap_reply(f'<u:GetExternalIPAddressResponse xmlns:u="{SERVICE}"/>'),
     "{a}: no external address yet ('')"),
], ids=["no-description", "garbled-description", "fault", "no-external-address"])
async def test_discovery_that_finds_nothing_usable_says_what_it_tried(pages: dict[str, tuple[int, bytes]],
                                                                    script: Callable[[str, dict[str, str]], bytes] | None,
                                                                    says: str) -> None:
    web = Web(pages=pages) if script is None else Web(script, pages=pages)
    async with router(web) as (ssdp, web):
        with pytest.raises(PortMappingError) as info:
            await discover(ssdp)
    expected = says.format(root=web.url("/rootDesc.xml"), a=web.url("/a"))
    assert str(info.value).startswith("upnp: " + expected)


async def test_discovery_refuses_a_description_elsewhere_than_the_device_that_answered() -> None:
    ssdp = Ssdp(gateway=lambda n, search: [(0.0, ssdp_answer(f"http://{DEVICE}:80/rootDesc.xml"))] if n == 1 else [])
    async with ssdp_responders(ssdp):
        with pytest.raises(PortMappingError) as info:
            await discover(ssdp)
    assert str(info.value) == (f"upnp: http://{DEVICE}:80/rootDesc.xml: LOCATION points at {DEVICE}, "
                               f"not the device at {GATEWAY}")


@pytest.mark.realtime  # bounds a search's real time, far from it
async def test_discovery_with_no_answer_or_no_time_says_so() -> None:
    async with ssdp_responders(Ssdp()) as ssdp:
        started = trio.current_time()
        with pytest.raises(PortMappingError) as info:
            await discover(ssdp, timeout=3.0)
        assert str(info.value) == "upnp: no answer to M-SEARCH"
        assert 1.5 <= trio.current_time() - started < 2.9  # the search has 2 s at most of the 3
        with pytest.raises(PortMappingError) as info:  # the search's time is the whole time: nothing said
            await discover(ssdp, timeout=0.3)
        assert str(info.value) == "upnp: no usable answer within 0.3 s"
    web = Web()

    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:  # the description never comes: the whole timeout, then said
        listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host=GATEWAY))
        web.port = listeners[0].socket.getsockname()[1]
        ssdp = Ssdp(gateway=lambda n, search: [(0.0, ssdp_answer(web.url("/d.xml")))] if n == 1 else [])
        async with ssdp_responders(ssdp):
            with pytest.raises(PortMappingError) as info:
                await discover(ssdp, timeout=0.5)
        assert str(info.value) == "upnp: no usable answer within 0.5 s"
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- the mapper


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


def entry(client: str, port: str) -> bytes:
    return _soap_reply(f'<u:GetSpecificPortMappingEntryResponse xmlns:u="{SERVICE}"><NewInternalPort>{port}</NewInternalPort>'
                       f"<NewInternalClient>{client}</NewInternalClient></u:GetSpecificPortMappingEntryResponse>")


async def test_a_port_is_taken_by_another_only_when_it_forwards_elsewhere() -> None:
    answers = {"1": entry("127.0.0.9", "4001"), "2": entry(GATEWAY, "80"), "3": entry(GATEWAY, "4001"),
               "4": entry("", "4001"), "5": _fault("714", "NoSuchEntryInArray"), "6": _fault("501", "Action Failed"),
               "7": _soap_reply(f'<u:GetSpecificPortMappingEntryResponse xmlns:u="{SERVICE}"/>')}
    async with fake_igd(lambda action, args: answers[args["NewExternalPort"]]) as (service, calls):
        mapper = pm._UpnpMapper(pm.UpnpGateway("http://127.0.0.1/", service, GATEWAY), "UDP", 4001, call_timeout=5)
        with trio.fail_after(10):
            taken = [await mapper._taken_by_another(int(port)) for port in sorted(answers)]
    # another host; our host, another port; ours exactly; no client; no such entry; cannot tell (twice)
    assert taken == [True, True, False, False, False, False, False]
    assert calls[0] == ("GetSpecificPortMappingEntry", {"NewRemoteHost": "", "NewExternalPort": "1", "NewProtocol": "UDP"})


def adding(refusal: Callable[[dict[str, str]], bytes | None]) -> Callable[[str, dict[str, str]], bytes]:
    """A gateway where every port is free and AddPortMapping answers ``refusal(args)`` (None: done)."""
    def script(action: str, args: dict[str, str]) -> bytes:
        if action == "GetSpecificPortMappingEntry":
            return _fault("714", "NoSuchEntryInArray")
        if action == "AddPortMapping":
            return refusal(args) or _soap_reply(f'<u:AddPortMappingResponse xmlns:u="{SERVICE}"/>')
        return EXTERNAL_IP_REPLY

    return script


async def test_a_gateway_that_wants_the_same_port_gets_it_next() -> None:
    """724 SamePortValuesRequired: the internal port is tried at once, before the random ones."""
    script = adding(lambda args: _fault("724", "SamePortValuesRequired")
                    if args["NewExternalPort"] != args["NewInternalPort"] else None)
    async with fake_igd(script) as (service, calls):
        mapper = pm._UpnpMapper(pm.UpnpGateway("http://127.0.0.1/", service, GATEWAY), "TCP", 4001, call_timeout=5)
        with trio.fail_after(10):
            grant = await mapper.map(6000, 100_000_000)
    adds = [(a["NewExternalPort"], a["NewLeaseDuration"]) for action, a in calls if action == "AddPortMapping"]
    # the lease is capped at IGDv2's week
    assert adds == [("6000", str(pm.MAX_UPNP_LEASE)), ("4001", str(pm.MAX_UPNP_LEASE))]
    assert grant == pm._Grant("11.22.33.1", 4001, pm.MAX_UPNP_LEASE) and mapper.external_port == 4001


async def test_every_port_taken_says_which_and_nothing_is_deleted() -> None:
    def script(action: str, args: dict[str, str]) -> bytes:
        return _fault("729", "ConflictWithOtherMechanisms") if action == "AddPortMapping" else _fault("714")

    async with fake_igd(script) as (service, calls):
        mapper = pm._UpnpMapper(pm.UpnpGateway("http://127.0.0.1/", service, GATEWAY), "TCP", 4001, call_timeout=5)
        with trio.fail_after(20), pytest.raises(PortMappingError) as info:
            await mapper.map(0, 3600)
        ports = [a["NewExternalPort"] for action, a in calls if action == "AddPortMapping"]
        assert len(ports) == 1 + mapper.PORT_TRIES == 9 and ports[0] == "4001"
        assert str(info.value) == f"upnp: every external port tried is taken ({', '.join(ports)})"
        await mapper.unmap()  # nothing was added: nothing to delete
        assert calls[-1][0] == "AddPortMapping"


# ---------------------------------------------------------------------- HTTP


@asynccontextmanager
async def raw_http(handler: Callable[[trio.SocketStream], object]) -> AsyncIterator[str]:
    """A TCP server on loopback that runs ``handler`` per connection; its URL."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host=GATEWAY))
        yield f"http://{GATEWAY}:{listeners[0].socket.getsockname()[1]}/x"
        nursery.cancel_scope.cancel()


def replying(*pieces: bytes, close: bool = True) -> Callable[[trio.SocketStream], object]:
    async def handler(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        for piece in pieces:
            await stream.send_all(piece)
            await trio.sleep(0.01)
        if close:
            await stream.aclose()
        else:
            await trio.sleep_forever()

    return handler


async def test_http_reads_a_response_that_comes_in_pieces() -> None:
    chunked = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n", b"0\r\n\r\n"]
    async with raw_http(replying(*chunked, close=False)) as url:
        with trio.fail_after(5):
            response = await pm.http_exchange(url, pm.http_request("GET", url), timeout=5)
    assert (response.status, response.body) == (200, b"hello")
    async with raw_http(replying(b"HTTP/1.0 200 OK\r\n\r\nall of it", b" until the end")) as url:
        with trio.fail_after(5):
            response = await pm.http_exchange(url, pm.http_request("GET", url), timeout=5)
    assert response.body == b"all of it until the end"


async def test_http_refuses_what_is_too_large_or_cut_short() -> None:
    async with raw_http(replying(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 70_000)) as url:
        with trio.fail_after(5), pytest.raises(MalformedResponse, match="HTTP body longer than the 65536 bytes allowed"):
            await pm.http_exchange(url, pm.http_request("GET", url), timeout=5)
    async with raw_http(replying(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 1000, close=False)) as url:
        with trio.fail_after(5), pytest.raises(MalformedResponse, match="HTTP body longer than the 100 bytes allowed"):
            await pm.http_exchange(url, pm.http_request("GET", url), timeout=5, max_body=100)
    async with raw_http(replying(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")) as url:
        with trio.fail_after(5), pytest.raises(MalformedResponse, match="connection closed after 3 of 10 body bytes"):
            await pm.http_exchange(url, pm.http_request("GET", url), timeout=5)


async def test_http_that_keeps_sending_a_header_is_cut_off() -> None:
    """A server that never ends its header: refused once more than the header and two bodies came."""
    async def endless(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        with trio.move_on_after(5):
            await stream.send_all(b"HTTP/1.1 200 OK\r\n")
            while True:
                await stream.send_all(b"X-Filler: " + b"y" * 1000 + b"\r\n")

    async with raw_http(endless) as url:
        with trio.fail_after(5), pytest.raises(MalformedResponse, match="HTTP header longer than"):
            await pm.http_exchange(url, pm.http_request("GET", url), timeout=5)


async def test_http_to_a_name_or_a_closed_port_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="HTTP host must be an IPv4 address, not 'router.lan'"):
        await pm.http_exchange("http://router.lan/x", b"", timeout=1)
    with pytest.raises(ConfigError) as info:
        await pm.http_exchange("http:///x", b"", timeout=1)
    assert str(info.value) == "HTTP host must be an IPv4 address, not ''"
    with trio.socket.socket() as sock:
        await sock.bind((GATEWAY, 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(OSError):
            await pm.http_exchange(f"http://{GATEWAY}:{port}/x", b"", timeout=1)


async def test_http_whose_connection_breaks_says_so() -> None:
    async def reset(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        stream.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        await stream.aclose()  # an RST, not a FIN

    async with raw_http(reset) as url:
        with trio.fail_after(5), pytest.raises(PortMappingError) as info:
            await pm.http_exchange(url, pm.http_request("GET", url), timeout=5)
    port = url.split(":")[2].split("/")[0]
    assert str(info.value) == f"HTTP connection to {GATEWAY}:{port} broke: Connection reset by peer"


async def test_discovery_says_every_problem_it_met() -> None:
    web = Web(lambda action, args: _fault("501", "Action Failed"),
              pages={"/rootDesc.xml": (200, description(("WANIPConnection:1", "/a"), ("WANPPPConnection:1", "/b")))})
    async with router(web) as (ssdp, web):
        with pytest.raises(PortMappingError) as info:
            await discover(ssdp)
    refused = "upnp: the gateway refused (code 501: Action Failed)"
    assert str(info.value) == f"upnp: {web.url('/a')}: {refused}; {web.url('/b')}: {refused}"


async def test_an_oversized_ssdp_answer_is_read_whole_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    """A datagram one byte over the cap is read in full (not cut to a size that parses) and refused."""
    answer = ssdp_answer(f"http://{GATEWAY}:5000/rootDesc.xml")
    big = answer + b"p" * (pm.MAX_SSDP_DATAGRAM + 1 - len(answer))
    ssdp = Ssdp(gateway=lambda n, search: [(0.0, big)] if n == 1 else [])
    async with ssdp_responders(ssdp):
        with caplog.at_level(logging.DEBUG, "nat.port_mapping.upnp"):
            found, _ = await search(ssdp, timeout=0.8)
    assert found == []
    assert log_lines(caplog, "nat.port_mapping.upnp", "ignoring") == [
        f"ignoring an SSDP datagram from {GATEWAY}: SSDP reply of {pm.MAX_SSDP_DATAGRAM + 1} bytes, "
        f"more than {pm.MAX_SSDP_DATAGRAM}"]


async def test_http_without_a_port_goes_to_port_80() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(partial(trio.serve_tcp, silent, 80, host="127.0.0.5"))
        except PermissionError:  # CI runs as root; elsewhere port 80 may be closed to us
            pytest.skip("binding port 80 needs root")
        with pytest.raises(PortMappingError) as info:
            await pm.http_exchange("http://127.0.0.5/d.xml", b"GET", timeout=0.2)
        assert str(info.value) == "HTTP to 127.0.0.5:80 took longer than 0.2 s (0 bytes read)"
        nursery.cancel_scope.cancel()


async def test_http_padded_out_with_chunk_extensions_is_cut_off() -> None:
    """Chunk extensions add to the wire, not to the body: past the header and two bodies' worth, refused."""
    async def padded(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        with trio.move_on_after(5):
            await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(40):
                await stream.send_all(b"1;" + b"e" * 1000 + b"\r\nx\r\n")
                await trio.sleep(0.001)
            await trio.sleep_forever()

    async with raw_http(padded) as url:
        with trio.fail_after(5), pytest.raises(MalformedResponse) as info:
            await pm.http_exchange(url, pm.http_request("GET", url), timeout=5, max_body=100)
    assert str(info.value) == "HTTP response larger than allowed"

    async def just_over(stream: trio.SocketStream) -> None:  # past the header and two bodies, short of three
        await stream.receive_some(65536)
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"1;" + b"e" * 1000 + b"\r\nx\r\n"
        count = (pm.MAX_HTTP_HEAD + 2 * 1000 - len(head)) // len(chunk) + 1
        assert pm.MAX_HTTP_HEAD + 2 * 1000 < len(head) + count * len(chunk) < pm.MAX_HTTP_HEAD + 3 * 1000
        await stream.send_all(head + chunk * count)
        await trio.sleep_forever()

    async with raw_http(just_over) as url:
        with trio.fail_after(5), pytest.raises(MalformedResponse) as info:
            await pm.http_exchange(url, pm.http_request("GET", url), timeout=3, max_body=1000)
    assert str(info.value) == "HTTP response larger than allowed"


async def test_the_random_ports_tried_are_unprivileged_and_each_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[tuple[range, int]] = []

    def sample(population: range, k: int) -> list[int]:
        drawn.append((population, k))
        return [7000 + i for i in range(k)]

    monkeypatch.setattr(pm.upnp.random, "sample", sample)

    def script(action: str, args: dict[str, str]) -> bytes:
        if action == "GetSpecificPortMappingEntry":  # 4001 forwards to another host: a conflict, not even tried
            return entry("127.0.0.9", "22") if args["NewExternalPort"] == "4001" else _fault("714")
        if action == "AddPortMapping":
            return _soap_reply(f'<u:AddPortMappingResponse xmlns:u="{SERVICE}"/>')
        return _soap_reply(f'<u:GetExternalIPAddressResponse xmlns:u="{SERVICE}"/>')  # no address given

    async with fake_igd(script) as (service, calls):
        mapper = pm._UpnpMapper(pm.UpnpGateway("http://127.0.0.1/", service, GATEWAY), "TCP", 4001, call_timeout=5)
        with trio.fail_after(10):
            grant = await mapper.map(0, 1)
    assert drawn == [(range(1024, 65536), mapper.PORT_TRIES)]
    assert [(action, a.get("NewExternalPort")) for action, a in calls] == [
        ("GetSpecificPortMappingEntry", "4001"), ("GetSpecificPortMappingEntry", "7000"), ("AddPortMapping", "7000"),
        ("GetExternalIPAddress", None)]
    assert grant == pm._Grant("", 7000, 1)


async def test_a_permanent_only_gateway_is_remembered_and_a_one_second_lease_is_no_exception() -> None:
    script = adding(lambda args: _fault("725", "OnlyPermanentLeasesSupported") if args["NewLeaseDuration"] != "0" else None)
    async with fake_igd(script) as (service, calls):
        mapper = pm._UpnpMapper(pm.UpnpGateway("http://127.0.0.1/", service, GATEWAY), "TCP", 4001, call_timeout=5)
        with trio.fail_after(10):
            first = await mapper.map(0, 1)  # a lease of 1 s refused as well: permanent
            again = await mapper.map(0, 3600)  # renewed: permanent at once, no second refusal
    leases = [a["NewLeaseDuration"] for action, a in calls if action == "AddPortMapping"]
    assert leases == ["1", "0", "0"] and first.lifetime == again.lifetime == 0 and mapper.permanent_only
