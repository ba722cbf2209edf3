"""Self-tests of the NAT testbed (nat/lab.py): the network physics NAT traversal relies on.

Plain Python sockets inside the namespaces, no dedloc code. One lab for the
module (built once, in a sync fixture: pytest-trio runs each test in its own
trio.run, so an async module-scoped fixture is not possible); the cleanup tests
build their own small labs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import pytest
import trio

from nat.lab import Host, Ipv6, Lab, NatKind, NetlabTimeout, Shape, cleanup_stale, netem_unavailable_reason
from p2p.errors import ConfigError

from .kit import requires_root_netns

pytestmark = requires_root_netns

PREFIX = "dltest"
RELAY_DELAY_MS = 25.0
PEER_DELAY_MS = 50.0
ECHO_PORTS = (7001, 7002)  # TCP and UDP "what address do you see" servers on relay and srv2
STEP = 15.0  # per-step timeout (s) for anything run in the lab

# A tiny tool run in the namespaces with `python -S -c` (stdlib only, fast start).
# Every mode prints one JSON object on stdout.
HELPER = r"""
import json, socket, sys, threading, time

def out(**kw):
    print(json.dumps(kw), flush=True)

def reuse(s):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)

def read_line(s):
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(256)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()

def serve(ports):
    # Answers each TCP connection and UDP datagram with the source "ip port" it saw.
    # The server closes first, so TIME_WAIT stays here and clients can reuse their port.
    def tcp(port):
        srv = socket.socket()
        reuse(srv)
        srv.bind(("0.0.0.0", port))
        srv.listen(128)
        while True:
            c, (ip, p) = srv.accept()
            try:
                c.sendall(f"{ip} {p}\n".encode())
            except OSError:
                pass
            c.close()
    def udp(port):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("0.0.0.0", port))
        while True:
            _, (ip, p) = s.recvfrom(2048)
            s.sendto(f"{ip} {p}\n".encode(), (ip, p))
    for port in ports:
        threading.Thread(target=tcp, args=(port,), daemon=True).start()
        threading.Thread(target=udp, args=(port,), daemon=True).start()
    threading.Event().wait()

def connect(host, port, bind, timeout):
    s = socket.socket()
    reuse(s)
    if bind:
        s.bind(("0.0.0.0", bind))
    s.settimeout(timeout)
    t0 = time.monotonic()
    try:
        s.connect((host, port))
    except OSError as e:
        return out(ok=False, error=repr(e))
    connect_s = time.monotonic() - t0
    local = s.getsockname()[1]
    try:
        seen = read_line(s)
    except OSError as e:
        return out(ok=False, error=repr(e))
    out(ok=True, seen=seen, local_port=local, connect_s=connect_s)

def udp(host, port, bind, tries, timeout):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    reuse(s)
    s.bind(("0.0.0.0", bind))
    s.settimeout(timeout)
    for _ in range(tries):
        s.sendto(b"?", (host, port))
        try:
            data, _ = s.recvfrom(2048)
        except OSError:
            continue
        return out(ok=True, seen=data.decode().strip())
    out(ok=False, error="no reply")

def simopen(bind, host, port, deadline, name):
    # Both ends run this at about the same time: TCP simultaneous open through the NATs.
    end = time.monotonic() + deadline
    attempts, last = 0, None
    while time.monotonic() < end:
        attempts += 1
        s = socket.socket()
        reuse(s)
        s.bind(("0.0.0.0", bind))
        s.settimeout(max(0.2, min(3.0, end - time.monotonic())))
        try:
            s.connect((host, port))
            s.sendall(name.encode() + b"\n")
            s.settimeout(5)
            got = read_line(s)
            return out(ok=True, got=got, attempts=attempts)
        except OSError as e:
            last = repr(e)
            s.close()
            time.sleep(0.2)
    out(ok=False, error=last, attempts=attempts)

def sink(port):
    # One TCP connection, read to EOF: bytes and seconds from first to last byte.
    srv = socket.socket()
    reuse(srv)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    c, _ = srv.accept()
    c.settimeout(30)
    total, first = 0, None
    while True:
        data = c.recv(1 << 16)
        if not data:
            break
        if first is None:
            first = time.monotonic()
        total += len(data)
    out(ok=True, bytes=total, seconds=time.monotonic() - first)

def blast(host, port, size):
    s = socket.create_connection((host, port), timeout=30)
    block = b"x" * (1 << 16)
    left = size
    while left > 0:
        s.sendall(block[:left])
        left -= len(block)
    s.close()
    out(ok=True)

mode, args = sys.argv[1], sys.argv[2:]
if mode == "serve":
    serve([int(p) for p in args])
elif mode == "connect":
    connect(args[0], int(args[1]), int(args[2]), float(args[3]))
elif mode == "udp":
    udp(args[0], int(args[1]), int(args[2]), int(args[3]), float(args[4]))
elif mode == "sink":
    sink(int(args[0]))
elif mode == "blast":
    blast(args[0], int(args[1]), int(args[2]))
elif mode == "simopen":
    simopen(int(args[0]), args[1], int(args[2]), float(args[3]), args[4])
"""

PEERS = {
    "pub": NatKind.PUBLIC,
    "eimp": NatKind.EIM_PRESERVING,
    "eimp2": NatKind.EIM_PRESERVING,
    "eimc": NatKind.EIM_CHANGING,
    "sym": NatKind.SYMMETRIC,
    "dbl": NatKind.DOUBLE,
    "fw": NatKind.FIREWALL,
    "udpb": NatKind.UDP_BLOCKED,
}
ONE_PER_KIND = ["pub", "eimp", "eimc", "sym", "dbl", "fw", "udpb"]


def helper(mode: str, *args: object) -> list[str]:
    return [sys.executable, "-S", "-c", HELPER, mode, *map(str, args)]


async def tool(host: Host, mode: str, *args: object, timeout: float = STEP) -> dict[str, Any]:
    rc, out, err = await host.run(helper(mode, *args), timeout=timeout)
    assert rc == 0 and out.strip(), f"{mode} in {host.name}: rc={rc} {err.strip()}"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


async def gather(calls: dict[str, Callable[[], Awaitable[Any]]]) -> dict[str, Any]:
    results: dict[str, Any] = {}

    async def one(key: str, call: Callable[[], Awaitable[Any]]) -> None:
        results[key] = await call()

    with trio.fail_after(STEP * 2):
        async with trio.open_nursery() as nursery:
            for key, call in calls.items():
                nursery.start_soon(one, key, call)
    return results


def seen(result: dict[str, Any]) -> tuple[str, int]:
    ip, port = result["seen"].split()
    return ip, int(port)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """relay and srv2 (public, echo servers on ECHO_PORTS) and one peer per entry of PEERS."""
    cleanup_stale(PREFIX)  # leftovers of killed runs (labs of live processes are kept)
    lab = Lab(prefix=PREFIX)

    async def build() -> None:
        with trio.fail_after(60):
            await lab.start()
            for name in ("relay", "srv2"):
                server = await lab.public_host(name, delay_ms=RELAY_DELAY_MS)
                await server.spawn(helper("serve", *ECHO_PORTS), stdout=subprocess.DEVNULL)
            for name, kind in PEERS.items():
                await lab.peer(name, kind, listen_port=4001, delay_ms=PEER_DELAY_MS)
            for name in ("relay", "srv2"):
                for port in ECHO_PORTS:
                    await lab.hosts[name].wait_listening(port)
                    await lab.hosts[name].wait_listening(port, udp=True)

    try:
        trio.run(build)
        yield lab
    finally:
        trio.run(lab.close)


async def test_every_peer_reaches_the_relay_from_its_public_address(lab: Lab) -> None:
    relay = lab.hosts["relay"]
    results = await gather(
        {n: partial(tool, lab.hosts[n], "connect", relay.ip, ECHO_PORTS[0], 0, 5) for n in ONE_PER_KIND}
    )
    for name in ONE_PER_KIND:
        host, res = lab.hosts[name], results[name]
        assert res["ok"], (name, res)
        ip, _ = seen(res)
        expected = host.ip if host.kind in (NatKind.PUBLIC, NatKind.FIREWALL) else host.public_ip
        assert ip == expected == host.public_ip, (name, res)
        if host.kind.nat:
            assert host.ip.startswith("10.") and ip != host.ip


async def test_source_port_mapping_from_the_listen_port(lab: Lab) -> None:
    """From a fixed local port (reuseaddr/reuseport, as libp2p dials) to four public endpoints."""
    relay, srv2 = lab.hosts["relay"], lab.hosts["srv2"]
    targets = [(relay.ip, ECHO_PORTS[0]), (srv2.ip, ECHO_PORTS[0]), (relay.ip, ECHO_PORTS[1]), (srv2.ip, ECHO_PORTS[1])]

    async def ports(host: Host) -> list[int]:
        out = []
        for ip, port in targets:  # one after the other: all from the same bound port
            res = await tool(host, "connect", ip, port, host.listen_port, 5)
            assert res["ok"] and res["local_port"] == host.listen_port, (host.name, res)
            out.append(seen(res)[1])
        return out

    results = await gather({n: partial(ports, lab.hosts[n]) for n in ONE_PER_KIND})
    for name in ("pub", "eimp", "dbl", "fw", "udpb"):  # port preserved everywhere
        assert results[name] == [4001] * 4, (name, results[name])
    assert results["eimc"] == [5001] * 4  # same for every destination, but not the local port
    assert lab.hosts["eimc"].public_port == 5001
    sym = results["sym"]
    assert len(set(sym)) > 1 and 4001 not in sym, sym  # endpoint dependent
    assert lab.hosts["sym"].public_port is None


async def test_unsolicited_inbound_only_reaches_public_peers(lab: Lab) -> None:
    srv2 = lab.hosts["srv2"]
    port = 4101  # a listener on every peer; nothing has ever been sent from it
    for name in ONE_PER_KIND:
        await lab.hosts[name].spawn(helper("serve", port), stdout=subprocess.DEVNULL)
    for name in ONE_PER_KIND:
        await lab.hosts[name].wait_listening(port)
    results = await gather(
        {n: partial(tool, srv2, "connect", lab.hosts[n].public_ip, port, 0, 1.5) for n in ONE_PER_KIND}
    )
    for name in ONE_PER_KIND:
        host, res = lab.hosts[name], results[name]
        assert res["ok"] is host.kind.reachable, (name, res)
        if not res["ok"]:  # dropped, not refused: no RST that would spoil a hole punch
            assert "timed out" in res["error"], (name, res)
    assert seen(results["pub"]) == (srv2.ip, seen(results["pub"])[1])


def _dial_port(host: Host) -> int:
    """Where the other side aims: the mapped listen port (a guess, the listen port, for SYMMETRIC)."""
    port = host.public_port or host.listen_port
    assert port is not None
    return port


SIMOPEN_PAIRS = [
    ("eimp", "eimp2", True),
    ("eimp", "fw", True),
    ("eimc", "eimp2", True),
    ("dbl", "fw", True),
    # SYMMETRIC: its SYN leaves from a random port the other side never dialled (so
    # the other NAT drops it), and the other side's SYN to sym's public_ip:listen_port
    # matches no mapping on sym's router (dropped too). Hole punching needs port
    # prediction or a relay there.
    ("sym", "eimp2", False),
]


async def test_tcp_simultaneous_open(lab: Lab) -> None:
    async def punch(a: Host, b: Host, deadline: float) -> tuple[dict[str, Any], dict[str, Any]]:
        res = await gather(
            {
                "a": partial(tool, a, "simopen", a.listen_port, b.public_ip, _dial_port(b), deadline, a.name),
                "b": partial(tool, b, "simopen", b.listen_port, a.public_ip, _dial_port(a), deadline, b.name),
            }
        )
        return res["a"], res["b"]

    results = await gather(
        {
            f"{x}-{y}": partial(punch, lab.hosts[x], lab.hosts[y], 8.0 if ok else 3.0)
            for x, y, ok in SIMOPEN_PAIRS
        }
    )
    for x, y, ok in SIMOPEN_PAIRS:
        ra, rb = results[f"{x}-{y}"]
        if ok:
            assert ra["ok"] and rb["ok"], (x, y, ra, rb)
            assert (ra["got"], rb["got"]) == (y, x)
        else:
            assert not ra["ok"] and not rb["ok"], (x, y, ra, rb)


async def test_udp_passes_except_where_blocked(lab: Lab) -> None:
    """UDP from the listen port (as QUIC would send it) is mapped like TCP, except where it is dropped."""
    relay = lab.hosts["relay"]
    results = await gather(
        {n: partial(tool, lab.hosts[n], "udp", relay.ip, ECHO_PORTS[0], 4001, 3, 0.5) for n in ONE_PER_KIND}
    )
    for name in ONE_PER_KIND:
        host, res = lab.hosts[name], results[name]
        assert res["ok"] is host.kind.udp, (name, res)
        if res["ok"]:
            ip, port = seen(res)
            assert ip == host.public_ip, (name, res)
            if host.public_port is not None:
                assert port == host.public_port, (name, res)
    # TCP still works through the UDP-blocking router
    tcp = await tool(lab.hosts["udpb"], "connect", relay.ip, ECHO_PORTS[0], 0, 5)
    assert tcp["ok"], tcp


async def test_links_have_their_delay_by_netem_or_the_userspace_wire(lab: Lab) -> None:
    """delay_ms means what it says on every kernel: netem where it exists, the wire elsewhere."""
    assert lab.mechanism == ("netem" if netem_unavailable_reason() is None else "wire")
    if lab.mechanism == "wire":
        assert lab.wired_links == 2 + len(PEERS)  # every access link: all have a delay
    relay = lab.hosts["relay"]
    rtt = 2 * (PEER_DELAY_MS + RELAY_DELAY_MS) / 1000  # one-way delay on each of the two access links
    for name in ("pub", "dbl"):
        res = await tool(lab.hosts[name], "connect", relay.ip, ECHO_PORTS[0], 0, 5)
        assert res["ok"], res
        # The handshake takes one RTT; only a generous lower bound, never an upper one.
        assert res["connect_s"] >= 0.8 * rtt, (name, res, rtt)


UDP_COUNT = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(0.5)
got = 0
for i in range(int(sys.argv[3])):
    s.sendto(b"?", (sys.argv[1], int(sys.argv[2])))
    time.sleep(0.002)
try:
    while True:
        s.recvfrom(2048)
        got += 1
except OSError:
    pass
print(got)
"""


async def test_a_lossy_wire_drops_its_share_each_way() -> None:
    """20% loss on one access link, each direction: about 0.8 * 0.8 of the echoes come back."""
    async with Lab(prefix=PREFIX, netem=False) as lab:
        assert lab.mechanism == "wire"
        lossy = await lab.public_host("lossy", delay_ms=5, loss_pct=20)
        echo = await lab.public_host("echo", delay_ms=0)
        assert lab.wired_links == 1  # the link without delay or loss stays a plain veth
        await echo.spawn(helper("serve", *ECHO_PORTS), stdout=subprocess.DEVNULL)
        await echo.wait_listening(ECHO_PORTS[1], udp=True)
        rc, out, err = await lossy.run([sys.executable, "-c", UDP_COUNT, echo.ip, str(ECHO_PORTS[1]), "400"],
                                       timeout=STEP)
        assert rc == 0, err
        share = int(out.strip()) / 400
        assert 0.5 < share < 0.78, share  # 0.64 expected


async def test_a_link_without_delay_can_go_through_the_wire_and_loses_nothing() -> None:
    """``wire=True``: a zero-delay link through the userspace wire (a bench's baseline that pays the
    wire's hop like its delayed runs); nothing is lost on it."""
    async with Lab(prefix=PREFIX, netem=False) as lab:
        wired = await lab.public_host("wired", delay_ms=0, wire=True)
        echo = await lab.public_host("echo", delay_ms=0)
        assert lab.wired_links == 1
        await echo.spawn(helper("serve", *ECHO_PORTS), stdout=subprocess.DEVNULL)
        await echo.wait_listening(ECHO_PORTS[1], udp=True)
        rc, out, err = await wired.run([sys.executable, "-c", UDP_COUNT, echo.ip, str(ECHO_PORTS[1]), "100"],
                                       timeout=STEP)
        assert rc == 0, err
        assert int(out.strip()) == 100


# -- IPv6 -------------------------------------------------------------------------

LISTEN6 = """
import socket, sys, time
s = socket.socket(socket.AF_INET6)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::", int(sys.argv[1])))
s.listen()
while True:
    c, peer = s.accept()
    c.sendall((peer[0] + "\\n").encode())
    c.close()
"""
CONNECT6 = """
import socket, sys
s = socket.socket(socket.AF_INET6)
s.settimeout(2)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print(s.recv(100).decode().strip())
except OSError as e:
    print(type(e).__name__, e.errno)
"""


async def test_ipv6_open_firewalled_and_none() -> None:
    """``public_net6``: global IPv6 addresses without translation; OPEN takes new flows in,
    FIREWALLED only replies (the router's filter, as for IPv4), NONE has no route at all."""
    async with Lab(prefix=PREFIX, netem=False, public_net6="2011:dd::/48") as lab:
        relay = await lab.public_host("relay", delay_ms=0)
        open_ = await lab.peer("o", NatKind.EIM_PRESERVING, delay_ms=0, ipv6=Ipv6.OPEN)
        walled = await lab.peer("w", NatKind.SYMMETRIC, delay_ms=0)
        none = await lab.peer("n", NatKind.EIM_PRESERVING, delay_ms=0, ipv6=Ipv6.NONE)
        double = await lab.peer("d", NatKind.DOUBLE, delay_ms=0)
        assert relay.ipv6 is Ipv6.OPEN and walled.ipv6 is Ipv6.FIREWALLED  # the defaults
        assert none.ip6 is None and double.ip6 is None and double.ipv6 is Ipv6.NONE
        assert relay.ip6 and open_.ip6 and walled.ip6
        for host in (relay, open_, walled):
            await host.spawn([sys.executable, "-S", "-c", LISTEN6, "7201"], stdout=subprocess.DEVNULL)
            await host.wait_listening(7201)

        async def connect(src: Host, ip: str) -> str:
            rc, out, err = await src.run([sys.executable, "-S", "-c", CONNECT6, ip, "7201"], timeout=STEP)
            assert rc == 0, err
            return out.strip()

        assert await connect(walled, relay.ip6) == walled.ip6  # out, as is: no NAT on IPv6
        assert await connect(relay, open_.ip6) == relay.ip6  # in, through an open router
        assert await connect(relay, walled.ip6) == "TimeoutError None"  # in, dropped by the filter
        assert await connect(walled, open_.ip6) == walled.ip6
        assert await connect(none, relay.ip6) == "OSError 101"  # ENETUNREACH: no IPv6 route, at once
    with pytest.raises(ConfigError):
        async with Lab(prefix=PREFIX, netem=False) as plain:
            await plain.peer("x", NatKind.EIM_PRESERVING, ipv6=Ipv6.OPEN)


# -- cleanup ----------------------------------------------------------------------


async def _netns_names() -> set[str]:
    res = await trio.run_process(["ip", "netns", "list"], capture_stdout=True)
    return {line.split()[0] for line in res.stdout.decode().splitlines() if line.strip()}


async def _goodput_mbit(src: Host, dst: Host, size: int, port: int) -> float:
    results: dict[str, Any] = {}

    async def receive() -> None:
        results["sink"] = await tool(dst, "sink", port, timeout=STEP * 2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await dst.wait_listening(port)
        await tool(src, "blast", dst.ip, port, size, timeout=STEP * 2)
    assert results["sink"]["bytes"] == size
    return float(size * 8 / results["sink"]["seconds"] / 1e6)


async def test_shaped_links_run_at_their_rate_in_each_direction() -> None:
    """tc tbf on both ends of an access link: upload and download limited apart (full duplex)."""
    async with Lab(prefix=PREFIX, netem=False) as lab:
        slow = await lab.public_host("slow", delay_ms=0, shape=Shape(up_mbit=20, down_mbit=80))
        fast = await lab.public_host("fast", delay_ms=0)
        up = await _goodput_mbit(slow, fast, 2_500_000, 7101)  # ~1 s at 20 Mbit
        down = await _goodput_mbit(fast, slow, 10_000_000, 7102)  # ~1 s at 80 Mbit
        assert 20 * 0.75 < up < 20 * 1.08, f"upload {up:.1f} Mbit/s, shaped to 20"
        assert 80 * 0.75 < down < 80 * 1.08, f"download {down:.1f} Mbit/s, shaped to 80"
        with pytest.raises(ValueError):
            Shape(up_mbit=0, down_mbit=10)


class Boom(Exception):
    pass


async def test_cleanup_when_the_body_raises() -> None:
    lab = Lab(prefix=PREFIX, netem=False)
    with pytest.raises(Boom):
        async with lab:
            a = await lab.peer("a", NatKind.DOUBLE)
            await lab.public_host("relay")
            proc = await a.spawn(["sleep", "60"])
            assert set(lab.namespaces) <= await _netns_names()
            raise Boom
    assert proc.returncode is not None
    assert not set(lab.namespaces) & await _netns_names()
    assert len(lab.namespaces) == 5  # inet, a, a-r, a-cg, relay


async def test_cleanup_when_cancelled() -> None:
    lab = Lab(prefix=PREFIX, netem=False)
    with trio.CancelScope() as scope:
        async with lab:
            host = await lab.peer("b", NatKind.FIREWALL)
            # a grandchild, not known to the lab as a process: killed via `ip netns pids`
            await host.spawn(["sh", "-c", "sleep 60 & wait"])
            scope.deadline = trio.current_time() + 0.2
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert lab.namespaces and not set(lab.namespaces) & await _netns_names()


@pytest.mark.realtime  # a command that would hang ends within 5 s
async def test_every_command_has_a_timeout() -> None:
    async with Lab(prefix=PREFIX, netem=False) as lab:
        host = await lab.public_host("h")
        t0 = time.monotonic()
        with pytest.raises(NetlabTimeout, match="sleep 30"):
            await host.run(["sleep", "30"], timeout=0.3)
        assert time.monotonic() - t0 < 5
        with pytest.raises(NetlabTimeout):
            await host.wait_listening(9, timeout=0.3)


async def test_cleanup_stale_removes_leftovers_of_dead_runs() -> None:
    dead_pid = 2**22 + 12345  # above the default pid_max, so never alive
    stale = f"{PREFIX}-{dead_pid}-beef-x"
    live = f"{PREFIX}-1-beef-x"  # pid 1 is alive: a concurrent run, left alone
    for ns in (stale, live):
        await trio.run_process(["ip", "netns", "add", ns])
    try:
        removed = await trio.to_thread.run_sync(cleanup_stale, PREFIX)
        names = await _netns_names()
        assert stale in removed and stale not in names
        assert live in names
    finally:
        for ns in (stale, live):
            await trio.run_process(["ip", "netns", "delete", ns], check=False, capture_stderr=True)
