"""nat.port_mapping against the real thing, miniupnpd in namespaces (the UDP exchange against loopback
fakes: tests/test_port_mapping_common.py; the wire formats without sockets:
tests/test_port_mapping_codecs.py; probing, choosing, renewing and deleting with the I/O scripted:
tests/test_map_port.py; UPnP's discovery, HTTP and mapper against loopback fakes: tests/test_upnp.py).

The end-to-end tests build their own router/client/outside namespaces
(tests/miniupnpd_lab.py): every packet, discovery included, stays inside them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from nat import port_mapping as pm
from tests import miniupnpd_lab
from tests.miniupnpd_lab import CLIENT_IP, WAN_IP, router_lab
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
