"""nat.port_mapping.mapping under the autojump clock: which port is mapped, the gateway asked, the
methods probed in parallel and tried in order, the mapping renewed, moved, retried and deleted.

The router here is :class:`Router`: it stands in for the three methods' I/O (PCP's ANNOUNCE,
NAT-PMP's external address, UPnP's discovery, and each method's mapper), answering after the delays
and with the grants and failures a test scripts. Each method's wire format and I/O are tested
apart (test_port_mapping_codecs, test_upnp, test_port_mapping), and the whole against a real
miniupnpd in test_port_mapping's lab.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from multiaddr import Multiaddr

from nat.port_mapping import mapping as mp
from nat.port_mapping.common import MappingRefused, Method, PortMappingError, PortMappingUnavailable, Protocol, _Grant
from nat.port_mapping.upnp import IgdService, UpnpGateway
from p2p.errors import ConfigError

GATEWAY, LOCAL, UPNP_LOCAL = "192.168.1.1", "192.168.1.20", "192.168.1.21"
WAN, WAN_UPNP = "203.0.113.7", "203.0.113.8"
IGD = UpnpGateway("http://192.168.1.1:5000/rootDesc.xml", IgdService("urn:wan", "http://192.168.1.1:5000/ctl"), UPNP_LOCAL)

Clock = trio.testing.MockClock

#: a scripted step: seconds to wait, then the value to give or the error to raise (None: wait forever)
Step = tuple[float | None, object]


class Mapper:
    """One method's mapper as a router would answer it: ``grants`` in turn (the last one again)."""

    def __init__(self, router: Router, method: Method, made_with: tuple[object, ...]) -> None:
        self.router, self.method, self.made_with = router, method, made_with
        self.maps: list[tuple[float, int, int]] = []
        self.unmaps: list[float] = []
        router.mappers.append(self)

    async def map(self, external_port: int, lifetime: int) -> _Grant:
        self.maps.append((trio.current_time(), external_port, lifetime))
        steps = self.router.grants[self.method]
        step = steps.pop(0) if len(steps) > 1 else steps[0]
        grant = await self.router.after(step)
        assert isinstance(grant, _Grant)
        return grant

    async def unmap(self) -> None:
        self.unmaps.append(trio.current_time())
        await self.router.after(self.router.unmap)


class Router:
    """The gateway and its three methods: what each discovery answers, and what its mapper grants."""

    def __init__(self) -> None:
        self.default: str | None = GATEWAY
        self.local = LOCAL
        self.unreachable: OSError | None = None
        self.answers: dict[str, Step] = {"pcp": (0.01, None), "natpmp": (0.02, WAN), "upnp": (0.5, (IGD, WAN_UPNP))}
        self.grants: dict[str, list[Step]] = {m: [(0.01, _Grant(WAN, 4001, 3600))] for m in ("pcp", "natpmp", "upnp")}
        self.unmap: Step = (0.01, None)
        self.asked: list[tuple[object, ...]] = []
        self.mappers: list[Mapper] = []

    async def after(self, step: Step) -> object:
        delay, value = step
        if delay is None:
            await trio.sleep_forever()
        await trio.sleep(delay or 0)
        if isinstance(value, BaseException):
            raise value
        return value

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        router = self

        def towards(host: str) -> str:
            self.asked.append(("route", host))
            if self.unreachable is not None:
                raise self.unreachable
            return self.local

        async def pcp(gateway: str, client_ip: str) -> None:
            self.asked.append(("pcp", gateway, client_ip))
            await self.after(self.answers["pcp"])

        async def natpmp(gateway: str) -> object:
            self.asked.append(("natpmp", gateway))
            return await self.after(self.answers["natpmp"])

        async def upnp(gateway: str, local_ip: str, *, timeout: float) -> object:
            self.asked.append(("upnp", gateway, local_ip, timeout))
            return await self.after(self.answers["upnp"])

        class Pcp(Mapper):
            def __init__(self, *args: object) -> None:
                super().__init__(router, "pcp", args)

        class NatPmp(Mapper):
            def __init__(self, *args: object) -> None:
                super().__init__(router, "natpmp", args)

        class Upnp(Mapper):
            def __init__(self, gateway: UpnpGateway, *args: object, call_timeout: float) -> None:
                super().__init__(router, "upnp", (gateway, *args, call_timeout))
                self.gateway = gateway

        monkeypatch.setattr(mp, "default_gateway", lambda: self.default)
        monkeypatch.setattr(mp, "local_address_towards", towards)
        monkeypatch.setattr(mp, "pcp_announce", pcp)
        monkeypatch.setattr(mp, "natpmp_external_address", natpmp)
        monkeypatch.setattr(mp, "discover_upnp", upnp)
        monkeypatch.setattr(mp, "_PcpMapper", Pcp)
        monkeypatch.setattr(mp, "_NatPmpMapper", NatPmp)
        monkeypatch.setattr(mp, "_UpnpMapper", Upnp)


@pytest.fixture
def router(monkeypatch: pytest.MonkeyPatch) -> Router:
    r = Router()
    r.install(monkeypatch)
    return r


@asynccontextmanager
async def mapped(**kwargs: object) -> AsyncIterator[mp.PortMapping]:
    async with mp.map_port(4001, **kwargs) as mapping:  # type: ignore[arg-type]
        yield mapping


# ---------------------------------------------------------------------- which port


def test_the_port_to_map_is_one_a_router_could_reach() -> None:
    def port(*addrs: str) -> int | None:
        return mp.mappable_port([Multiaddr(a) for a in addrs])

    assert port("/ip4/127.0.0.1/tcp/4001") is None
    assert port("/ip4/127.0.0.5/tcp/4001", "/ip6/::1/tcp/4002") is None
    assert port() is None
    assert port("/ip4/127.0.0.1/tcp/4001", "/ip4/0.0.0.0/tcp/4003") == 4003
    assert port("/ip6/::1/tcp/4002", "/ip4/192.168.1.20/tcp/4004", "/ip4/0.0.0.0/tcp/4005") == 4004
    assert port("/ip6/::/tcp/4006") == 4006
    assert port("/ip4/192.168.1.20/udp/4007", "/dns4/example.org/tcp/4008") is None  # no TCP port, no IP


# ---------------------------------------------------------------------- the gateway


async def test_with_no_gateway_given_the_default_route_s_is_asked(router: Router, autojump_clock: Clock) -> None:
    support = await mp.probe()
    assert (support.gateway, support.local_ip) == (GATEWAY, LOCAL)
    assert ("route", GATEWAY) in router.asked


async def test_with_no_default_route_there_is_nothing_to_ask(router: Router, autojump_clock: Clock) -> None:
    router.default = None
    with pytest.raises(PortMappingUnavailable, match="^no IPv4 default route: no gateway to ask for a port mapping$"):
        await mp.probe()
    with pytest.raises(PortMappingUnavailable, match="^no IPv4 default route"):
        async with mapped():
            pass
    assert router.asked == []


async def test_a_gateway_given_is_asked_and_must_be_an_ipv4_address(router: Router, autojump_clock: Clock) -> None:
    router.default = None
    assert (await mp.probe(gateway="10.0.0.1")).gateway == "10.0.0.1"
    assert router.asked[0] == ("route", "10.0.0.1")
    with pytest.raises(ConfigError, match="^gateway must be an IPv4 address, not 'router.lan'$"):
        await mp.probe(gateway="router.lan")


async def test_a_gateway_out_of_reach_is_said_with_the_reason(router: Router, autojump_clock: Clock) -> None:
    router.unreachable = OSError(101, "Network is unreachable")
    with pytest.raises(PortMappingUnavailable,
                       match=f"^cannot reach the gateway {GATEWAY}: Network is unreachable$") as raised:
        await mp.probe()
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


async def test_a_host_with_a_public_address_has_no_nat_to_map_through(router: Router, autojump_clock: Clock) -> None:
    router.local = "1.2.3.4"
    with pytest.raises(PortMappingUnavailable,
                       match="^this host has the public address 1.2.3.4: there is no NAT to map through$"):
        await mp.probe()
    router.local = "100.64.0.2"  # carrier-grade NAT's shared space is no public address
    assert (await mp.probe()).local_ip == "100.64.0.2"


# ---------------------------------------------------------------------- probe


async def test_a_probe_asks_every_method_at_once_and_says_what_each_offers(router: Router, autojump_clock: Clock) -> None:
    start = trio.current_time()
    support = await mp.probe()
    assert trio.current_time() - start == pytest.approx(0.5)  # the slowest answer, not their sum
    assert sorted(router.asked[1:]) == [("natpmp", GATEWAY), ("pcp", GATEWAY, LOCAL), ("upnp", GATEWAY, LOCAL, 3.0)]
    assert support == mp.GatewaySupport(GATEWAY, LOCAL, True, WAN, IGD, WAN_UPNP, {})
    assert support.methods == ("pcp", "natpmp", "upnp")
    assert support.external_ip == WAN  # NAT-PMP's before UPnP's


async def test_a_probe_says_why_each_method_failed(router: Router, autojump_clock: Clock) -> None:
    router.answers = {"pcp": (0.1, MappingRefused("pcp", 5, "UNSUPP_OPCODE")),
                      "natpmp": (0.1, OSError(111, "Connection refused")),
                      "upnp": (None, None)}
    start = trio.current_time()
    support = await mp.probe(timeout=2.0)
    assert trio.current_time() - start == pytest.approx(2.0)
    assert support.failures == {"pcp": str(MappingRefused("pcp", 5, "UNSUPP_OPCODE")).removeprefix("pcp: "),
                                "natpmp": "Connection refused", "upnp": "no answer within 2 s"}
    assert not support.failures["pcp"].startswith("pcp:")
    assert (support.pcp, support.natpmp_external_ip, support.upnp, support.upnp_external_ip) == (False, None, None, None)
    assert support.methods == () and support.external_ip is None


async def test_a_probe_asks_only_the_methods_named(router: Router, autojump_clock: Clock) -> None:
    support = await mp.probe(methods=("upnp",), timeout=1.5)
    assert router.asked[1:] == [("upnp", GATEWAY, LOCAL, 1.5)]
    assert support.methods == ("upnp",) and support.external_ip == WAN_UPNP


def test_gateway_support_lists_methods_in_the_order_tried() -> None:
    def support(pcp: bool, natpmp: str | None, upnp: UpnpGateway | None, upnp_ip: str | None = None) -> mp.GatewaySupport:
        return mp.GatewaySupport(GATEWAY, LOCAL, pcp, natpmp, upnp, upnp_ip, {})

    assert support(False, WAN, IGD).methods == ("natpmp", "upnp")
    assert support(True, None, IGD).methods == ("pcp", "upnp")
    assert support(True, None, None).methods == ("pcp",)
    assert support(False, None, IGD, WAN_UPNP).external_ip == WAN_UPNP


# ---------------------------------------------------------------------- map_port: which method


async def test_the_first_method_offered_maps_and_the_slower_discoveries_are_dropped(router: Router, autojump_clock: Clock) -> None:
    start = trio.current_time()
    async with mapped() as mapping:
        assert trio.current_time() - start == pytest.approx(0.02)  # PCP's answer and its grant, not UPnP's 0.5 s
        assert mapping == mp.PortMapping("pcp", "TCP", LOCAL, 4001, WAN, 4001, GATEWAY, 3600,
                                         expires_at=mapping.expires_at)
        assert mapping.expires_at == pytest.approx(start + 0.02 + 3600)
    (mapper,) = router.mappers
    assert mapper.made_with == (GATEWAY, LOCAL, "TCP", 4001)
    assert [(round(t - start, 6), port, life) for t, port, life in mapper.maps] == [(0.01, 0, 3600)]  # 0: the mapper asks for the internal port


async def test_the_preferred_method_is_waited_for_though_a_later_one_answers_first(router: Router, autojump_clock: Clock) -> None:
    router.answers["pcp"] = (0.3, None)
    async with mapped() as mapping:
        assert mapping.method == "pcp"
    assert [m.method for m in router.mappers] == ["pcp"]


async def test_methods_not_offered_are_passed_over(router: Router, autojump_clock: Clock) -> None:
    router.answers["pcp"] = (0.01, OSError(111, "Connection refused"))
    async with mapped(protocol="UDP", external_port=5000, lifetime=600) as mapping:
        assert (mapping.method, mapping.protocol, mapping.internal_ip) == ("natpmp", "UDP", LOCAL)
    (mapper,) = router.mappers
    assert mapper.made_with == (GATEWAY, "UDP", 4001)
    assert mapper.maps[0][1:] == (5000, 600)


async def test_upnp_maps_with_its_own_local_address_and_a_call_timeout_within_the_whole(router: Router, autojump_clock: Clock) -> None:
    async with mapped(methods=("upnp",)) as mapping:
        assert (mapping.method, mapping.internal_ip) == ("upnp", UPNP_LOCAL)
    assert router.mappers[0].made_with == (IGD, "TCP", 4001, 5.0)
    async with mapped(methods=("upnp",), timeout=2.0, discovery_timeout=1.0):
        pass
    assert router.mappers[1].made_with == (IGD, "TCP", 4001, 2.0)
    assert router.asked[-1] == ("upnp", GATEWAY, LOCAL, 1.0)


async def test_discovery_is_bounded_by_the_whole_timeout_too(router: Router, autojump_clock: Clock) -> None:
    router.answers["upnp"] = (None, None)
    with pytest.raises(PortMappingUnavailable):
        async with mapped(methods=("upnp",), timeout=1.0, discovery_timeout=3.0):
            pass
    assert router.asked[-1] == ("upnp", GATEWAY, LOCAL, 1.0)


async def test_a_refused_mapping_tries_the_next_method(router: Router, autojump_clock: Clock) -> None:
    router.grants["pcp"] = [(0.01, MappingRefused("pcp", 2, "NOT_AUTHORIZED"))]
    router.grants["natpmp"] = [(0.01, OSError(113, "No route to host"))]
    async with mapped() as mapping:
        assert mapping.method == "upnp"
    assert [m.method for m in router.mappers] == ["pcp", "natpmp", "upnp"]


async def test_when_nothing_maps_each_method_and_why_is_said(router: Router, autojump_clock: Clock) -> None:
    router.answers["pcp"] = (0.01, MappingRefused("pcp", 5, "UNSUPP_OPCODE"))
    router.answers["upnp"] = (0.01, (None, None))
    router.grants["natpmp"] = [(0.01, MappingRefused("natpmp", 2, "not authorized"))]
    with pytest.raises(PortMappingUnavailable) as raised:
        async with mapped(protocol="UDP"):
            pass
    assert raised.value.attempts == [("pcp", str(MappingRefused("pcp", 5, "UNSUPP_OPCODE")).removeprefix("pcp: ")),
                                     ("natpmp", str(MappingRefused("natpmp", 2, "not authorized")).removeprefix("natpmp: ")),
                                     ("upnp", "not offered")]
    assert str(raised.value).startswith(f"the gateway {GATEWAY} made no port mapping for UDP port 4001\n  pcp: ")


async def test_past_the_timeout_the_search_gives_up_and_says_so(router: Router, autojump_clock: Clock) -> None:
    router.answers["pcp"] = (0.01, OSError(111, "Connection refused"))
    router.grants["natpmp"] = [(None, None)]
    start = trio.current_time()
    with pytest.raises(PortMappingUnavailable) as raised:
        async with mapped(timeout=4.0, discovery_timeout=30.0):
            pass
    assert trio.current_time() - start == pytest.approx(4.0 + 0.01)  # and the delete of what may be mapped
    assert raised.value.attempts == [("pcp", "Connection refused"), ("timeout", "gave up after 4 s")]


async def test_each_discovery_has_its_own_timeout_within_the_whole(router: Router, autojump_clock: Clock) -> None:
    router.answers = {"pcp": (0.01, OSError(111, "Connection refused")),
                      "natpmp": (0.01, OSError(111, "Connection refused")), "upnp": (None, None)}
    start = trio.current_time()
    with pytest.raises(PortMappingUnavailable) as raised:
        async with mapped(timeout=4.0, discovery_timeout=1.0):
            pass
    assert trio.current_time() - start == pytest.approx(1.0)
    assert raised.value.attempts == [("pcp", "Connection refused"), ("natpmp", "Connection refused"),
                                     ("upnp", "no answer within 1 s")]


async def test_a_map_request_cut_off_by_the_timeout_is_deleted_all_the_same(router: Router, autojump_clock: Clock) -> None:
    router.grants["pcp"] = [(None, None)]
    router.unmap = (0.5, None)
    start = trio.current_time()
    with pytest.raises(PortMappingUnavailable) as raised:
        async with mapped(timeout=2.0, delete_timeout=1.0):
            pass
    (mapper,) = router.mappers
    assert mapper.unmaps == [pytest.approx(start + 2.0)]
    assert trio.current_time() - start == pytest.approx(2.5)  # the delete ran, shielded from the timeout
    assert raised.value.attempts == [("timeout", "gave up after 2 s")]


async def test_a_map_request_cancelled_from_outside_is_deleted_and_the_cancel_goes_on(router: Router, autojump_clock: Clock) -> None:
    router.grants["pcp"] = [(None, None)]
    with trio.move_on_after(1.0) as outside:
        async with mapped():
            pass
    assert outside.cancelled_caught
    assert len(router.mappers[0].unmaps) == 1


async def test_a_permanent_lease_never_expires_and_is_never_renewed(router: Router, autojump_clock: Clock) -> None:
    router.grants["pcp"] = [(0.01, _Grant(WAN, 4001, 0))]
    async with mapped() as mapping:
        assert (mapping.lifetime, mapping.expires_at) == (0, math.inf)
        await trio.sleep(10 * 3600)
        assert mapping.renewals == 0
    assert len(router.mappers[0].maps) == 1


# ---------------------------------------------------------------------- map_port: renewal and deletion


async def test_a_lease_is_renewed_halfway_and_keeps_its_port(router: Router, autojump_clock: Clock) -> None:
    router.grants["pcp"] = [(0.0, _Grant(WAN, 4001, 100)), (0.0, _Grant(WAN, 4001, 100))]
    start = trio.current_time()
    async with mapped(lifetime=100) as mapping:
        await trio.sleep(175)
        assert mapping.renewals == 3 and mapping.error is None
        assert mapping.expires_at == pytest.approx(start + 150.01 + 100)
    mapper = router.mappers[0]
    assert [(round(t - start, 6), port, life) for t, port, life in mapper.maps] == [
        (0.01, 0, 100), (50.01, 4001, 100), (100.01, 4001, 100), (150.01, 4001, 100)]
    assert mapper.unmaps == [pytest.approx(start + 175.01)]


async def test_a_renewal_to_another_port_moves_the_mapping_and_says_so(router: Router, autojump_clock: Clock,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    router.grants["pcp"] = [(0.0, _Grant(WAN, 4001, 100)), (0.0, _Grant("203.0.113.9", 4101, 60))]
    caplog.set_level(logging.INFO, "nat.port_mapping.mapping")
    async with mapped(lifetime=100) as mapping:
        await trio.sleep(51)
        assert (mapping.external_ip, mapping.external_port, mapping.lifetime) == ("203.0.113.9", 4101, 60)
        assert mapping.multiaddr == "/ip4/203.0.113.9/tcp/4101"
        await trio.sleep(30)  # the next renewal halfway through the new lease, for the new port
    assert [m[1:] for m in router.mappers[0].maps] == [(0, 100), (4001, 100), (4101, 100)]  # the lease asked for
    assert "port mapping moved to 203.0.113.9:4101" in caplog.messages
    assert "mapped TCP 203.0.113.7:4001 -> 192.168.1.20:4001 via pcp" in caplog.messages


@pytest.mark.parametrize("moved", [("203.0.113.9", 4001), (WAN, 4101), (WAN, 4001)])
async def test_a_move_of_address_or_port_alone_is_said(router: Router, autojump_clock: Clock,
                                                       caplog: pytest.LogCaptureFixture, moved: tuple[str, int]) -> None:
    router.grants["pcp"] = [(0.0, _Grant(WAN, 4001, 100)), (0.0, _Grant(*moved, 100))]
    caplog.set_level(logging.INFO, "nat.port_mapping.mapping")
    async with mapped(lifetime=100) as mapping:
        await trio.sleep(51)
        assert (mapping.external_ip, mapping.external_port, mapping.renewals) == (*moved, 1)
    said = [m for m in caplog.messages if m.startswith("port mapping moved")]
    assert said == ([] if moved == (WAN, 4001) else [f"port mapping moved to {moved[0]}:{moved[1]}"])


async def test_a_renewal_granted_for_good_ends_the_renewals(router: Router,
                                                            autojump_clock: Clock) -> None:
    router.grants["pcp"] = [(0.0, _Grant(WAN, 4001, 100)), (0.0, _Grant(WAN, 4001, 0))]
    async with mapped(lifetime=100) as mapping:
        await trio.sleep(51)
        assert (mapping.lifetime, mapping.expires_at, mapping.renewals) == (0, math.inf, 1)
        await trio.sleep(1000)
    assert len(router.mappers[0].maps) == 2


async def test_a_failed_renewal_is_recorded_and_retried_until_one_succeeds(router: Router,
                                                                          autojump_clock: Clock,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    refused = MappingRefused("natpmp", 3, "network failure")
    grant: Step = (0.0, _Grant(WAN, 4001, 400))
    router.grants["pcp"] = [grant] + [(0.0, refused)] * 18 + [grant]
    start = trio.current_time()
    async with mapped(lifetime=400) as mapping:
        await trio.sleep(200.5)
        assert mapping.error is refused and mapping.renewals == 0
        await trio.sleep(400)
        assert mapping.error is None and mapping.renewals == 1
        assert mapping.expires_at == pytest.approx(start + 572.01 + 400)
    at = [round(t - start, 2) for t, _, _ in router.mappers[0].maps]
    # halfway; then half the time left to expiry (400.01), at most 60 s and at least 1 s; after
    # expiry (a router that rebooted takes a new mapping), as long as it has been gone, up to 60 s
    assert at == [0.01, 200.01, 260.01, 320.01, 360.01, 380.01, 390.01, 395.01, 397.51, 398.76, 399.76,
                  400.76, 401.76, 403.51, 407.01, 414.01, 428.01, 456.01, 512.01, 572.01]
    assert caplog.messages.count(f"port mapping renewal failed: {refused}") == 18


def test_the_retry_delay_after_a_failed_renewal() -> None:
    assert mp.renewal_retry_delay(1000.0, 0.0) == 60.0  # at most
    assert mp.renewal_retry_delay(1000.0, 900.0) == 50.0  # half what is left
    assert mp.renewal_retry_delay(1000.0, 999.0) == 1.0  # at least
    assert mp.renewal_retry_delay(1000.0, 1000.0) == 1.0
    assert mp.renewal_retry_delay(1000.0, 1005.0) == 5.0  # as long as it has been gone
    assert mp.renewal_retry_delay(1000.0, 1100.0) == 60.0
    assert (mp.RENEW_RETRY_MIN, mp.RENEW_RETRY_MAX) == (1.0, 60.0)


async def test_a_renewal_past_the_call_timeout_is_a_failure(router: Router, autojump_clock: Clock) -> None:
    router.grants["pcp"] = [(0.0, _Grant(WAN, 4001, 20)), (None, None)]
    async with mapped(lifetime=20, timeout=3.0) as mapping:
        await trio.sleep(13.5)
        assert mapping.error is not None
        assert str(mapping.error) == "pcp: renewal failed: TooSlowError"
        assert isinstance(mapping.error, PortMappingError)


async def test_an_os_error_in_a_renewal_is_recorded_by_its_reason(router: Router, autojump_clock: Clock) -> None:
    router.grants["pcp"] = [(0.0, _Grant(WAN, 4001, 20)), (0.0, OSError(101, "Network is unreachable"))]
    async with mapped(lifetime=20) as mapping:
        await trio.sleep(10.5)
        assert str(mapping.error) == "pcp: renewal failed: Network is unreachable"


async def test_the_mapping_is_deleted_on_exit_within_the_delete_timeout(router: Router, autojump_clock: Clock,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    router.unmap = (None, None)
    start = trio.current_time()
    async with mapped(delete_timeout=2.5):
        pass
    assert trio.current_time() - start == pytest.approx(0.02 + 2.5)
    assert "deleting the pcp port mapping took over 2.5 s; it lapses with its lease" in caplog.messages
    router.unmap = (0.0, OSError(113, "No route to host"))
    async with mapped():
        pass
    assert "could not delete the pcp port mapping: [Errno 113] No route to host" in caplog.messages


async def test_the_mapping_is_deleted_when_the_block_raises(router: Router, autojump_clock: Clock) -> None:
    with pytest.raises(KeyError):
        async with mapped():
            raise KeyError("the caller's")
    assert len(router.mappers[0].unmaps) == 1


# ---------------------------------------------------------------------- arguments and config


async def test_map_port_refuses_bad_arguments_by_name(router: Router, autojump_clock: Clock) -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"lifetime": 0}, "^lifetime must be at least 1 second, not 0$"),
        ({"lifetime": 2**32}, "^lifetime must be at least 1 second"),
        ({"protocol": "SCTP"}, "^protocol must be 'TCP' or 'UDP', not 'SCTP'$"),
        ({"methods": ("igd",)}, r"^methods must be among \('pcp', 'natpmp', 'upnp'\), not \('igd',\)$"),
        ({"methods": ()}, r"^methods must be among .*, not \(\)$"),
        ({"external_port": 70000}, "^external port must be a port number 1-65535, not 70000$"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ConfigError, match=words):
            async with mapped(**kwargs):
                pass
    with pytest.raises(ConfigError, match="^internal port must be a port number 1-65535, not 0$"):
        async with mp.map_port(0):
            pass
    async with mapped(lifetime=2**32 - 1, external_port=0):
        pass
    assert [a for a in router.asked if a[0] == "route"] == [("route", GATEWAY)]  # only the last asked


def test_port_mapping_config_refuses_bad_settings_by_name() -> None:
    mp.PortMappingConfig().validate()
    mp.PortMappingConfig(lifetime=1, methods=("upnp",)).validate()
    cases: list[tuple[mp.PortMappingConfig, str]] = [
        (mp.PortMappingConfig(methods=("igd",)), r"^port mapping methods must be among .*, not \('igd',\)$"),  # type: ignore[arg-type]
        (mp.PortMappingConfig(methods=()), r"^port mapping methods must be among .*, not \(\)$"),
        (mp.PortMappingConfig(lifetime=0), "^port mapping lifetime must be at least 1 second, not 0$"),
        (mp.PortMappingConfig(lifetime=2**32), "^port mapping lifetime must be at least 1 second"),
        (mp.PortMappingConfig(timeout=0), "^port mapping timeout must be positive$"),
        (mp.PortMappingConfig(discovery_timeout=-1), "^port mapping discovery_timeout must be positive$"),
        (mp.PortMappingConfig(delete_timeout=0), "^port mapping delete_timeout must be positive$"),
    ]
    for config, words in cases:
        with pytest.raises(ConfigError, match=words):
            config.validate()
    default = mp.PortMappingConfig()
    assert (default.enabled, default.gateway, default.methods, default.lifetime) == (True, None, ("pcp", "natpmp", "upnp"), 3600)
    assert (default.timeout, default.discovery_timeout, default.delete_timeout) == (10.0, 3.0, 3.0)


async def test_a_config_replaces_the_settings_given_one_by_one(router: Router, autojump_clock: Clock) -> None:
    config = mp.PortMappingConfig(gateway="10.0.0.1", methods=("upnp",), lifetime=77, timeout=2.0,
                                  discovery_timeout=1.0, delete_timeout=0.5)
    router.unmap = (None, None)
    async with mp.map_port(4001, gateway="10.9.9.9", lifetime=5, methods=("pcp",), timeout=9.0,
                           discovery_timeout=9.0, delete_timeout=9.0, config=config) as mapping:
        assert (mapping.gateway, mapping.method) == ("10.0.0.1", "upnp")
        opened = trio.current_time()
    assert trio.current_time() - opened == pytest.approx(0.5)
    assert router.asked == [("route", "10.0.0.1"), ("upnp", "10.0.0.1", LOCAL, 1.0)]
    assert router.mappers[0].made_with[-1] == 2.0 and router.mappers[0].maps[0][2] == 77
    with pytest.raises(ConfigError, match="^port mapping lifetime"):
        async with mp.map_port(4001, config=mp.PortMappingConfig(lifetime=0)):
            pass


async def test_the_defaults_of_map_port(router: Router, autojump_clock: Clock) -> None:
    router.unmap = (None, None)
    async with mp.map_port(4001) as mapping:
        assert (mapping.protocol, mapping.gateway, mapping.external_port) == ("TCP", GATEWAY, 4001)
        opened = trio.current_time()
    assert trio.current_time() - opened == pytest.approx(3.0)
    assert router.mappers[0].maps[0][1:] == (0, 3600)  # the same external port as the internal, an hour
    assert ("upnp", GATEWAY, LOCAL, 3.0) in router.asked
    router.unmap = (0.0, None)
    router.grants["pcp"] = [(None, None)]
    start = trio.current_time()
    with pytest.raises(PortMappingUnavailable) as raised:
        async with mp.map_port(4001):
            pass
    assert raised.value.attempts == [("timeout", "gave up after 10 s")]
    assert trio.current_time() - start == pytest.approx(10.0)
