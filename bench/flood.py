"""A public relay under a connection flood: is the honest client still served?

    .venv/bin/python bench/flood.py [--scenarios idle,stalled,spread,spread-stalled,streams,dht,reservations] [--duration 30] [--json OUT]
    sudo .venv/bin/python bench/flood.py --ipv6 [--scenarios spread,spread-stalled]

Runs ``dedloc relay`` on 127.0.0.1 (its own process, so its memory and CPU are
its own) and, from another address (127.1.0.1), an honest client that every
--interval seconds opens a fresh node, connects, pings and does a DHT get (what
``dedloc ping`` and ``dedloc dht get`` do). First without a flood (the baseline),
then during each flood, from loopback source addresses (127.0.0.0/8 is all
loopback; nothing leaves the machine). Every flood is bounded in count and time:

* ``idle``: 10,000 TCP connections from 127.0.0.2 that send nothing (held open);
* ``stalled``: 1,000 connections from 127.0.0.3 that send the multistream header and
  a ``/noise`` proposal, then stall;
* ``spread``: 8 idle connections from each of 250 addresses (127.0.x.y, 250 /24s);
* ``spread-stalled``: stalled handshakes (as ``stalled``) from 400 addresses, each in its own
  /24, 5 each: 2,000 held at a time, the oldest closed and a new one opened, round after
  round (at most 20,000 in all): every /24 holds its share of a full handshaking table;
* ``streams``: a connected peer (127.0.0.4) opening RPC streams as fast as it can
  (64 at a time, each sending a byte and then nothing; at most 100,000);
* ``dht``: a connected peer (127.0.0.4) sending DHT find requests (a random target
  each, the relay answers with its closest peers) as fast as it can, 32 at a time,
  at most 1,000,000;
* ``reservations``: relay reservations from 1,000 throwaway peer ids on one address
  (127.0.0.5), 8 at a time, each id holding its connection (and slot) until 16 newer
  ones were made.

With ``--ipv6`` (root) the whole run is over IPv6, in a network namespace the bench makes and
deletes, whose loopback takes every address of fd00::/16: the relay on fd00::1, the honest client
in a /48 of its own, and the spread floods from addresses each in its own /48 (admission groups
IPv6 by /56 and /48, as IPv4 by /24).

Reported per scenario: honest successes, median latency against the baseline, the
relay's RSS growth and CPU seconds, whether it stayed up, and its refusals by reason
(``dedloc status``). Goals (issue 15): >= 99% honest success, median latency <= 2x
the baseline, RSS within +64 MiB, no crash.

The honest attempt also reserves a slot on the relay, so the ``reservations`` flood
is measured on what it attacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import harness  # noqa: E402
from google.protobuf.empty_pb2 import Empty  # noqa: E402
from google.protobuf.json_format import MessageToDict  # noqa: E402
from google.protobuf.struct_pb2 import Struct  # noqa: E402

from nat.cli import STATUS_METHOD  # noqa: E402
from p2p import Node, NodeConfig  # noqa: E402
from p2p.dht import DHT, DHTConfig  # noqa: E402
from p2p.dht.events import DHTMode  # noqa: E402
from nat.circuit import RelayClient  # noqa: E402
from nat.lab import cpu_seconds  # noqa: E402
from p2p.dht.proto import dht_pb2  # noqa: E402
from p2p.dht.protocol import FIND  # noqa: E402
from p2p.multistream import encode  # noqa: E402
from p2p.rpc import RPC_PROTOCOL  # noqa: E402

KEY = "flood-bench"
#: `dedloc status` answers callers on loopback only: asked over IPv4 loopback in either mode
LOCAL = "127.0.0.1"
#: --ipv6: the run's namespace routes all of fd00::/16 to its loopback (AnyIP), so any address in it
#: can be a source, each attacker address in a /48 of its own
V6_PREFIX = "fd00::/16"


@dataclasses.dataclass(frozen=True)
class Net:
    """Who is where: the relay, the honest client, the seed and each flood's sources (IPv4 on
    127.0.0.0/8, or with --ipv6 in fd00::/16 inside the run's own namespace)."""

    family: int = socket.AF_INET
    proto: str = "ip4"
    relay: str = "127.0.0.1"
    honest: str = "127.1.0.1"
    idle: str = "127.0.0.2"
    stalled: str = "127.0.0.3"
    attacker: str = "127.0.0.4"
    throwaway: str = "127.0.0.5"

    def listen(self, host: str, port: int = 0) -> str:
        return f"/{self.proto}/{host}/tcp/{port}"

    def spread(self) -> list[str]:
        """250 sources, each in its own /24 (IPv6: /48)."""
        if self.family == socket.AF_INET6:
            return [f"fd00:{i:x}::1" for i in range(0x10, 0x10 + 250)]
        return [f"127.0.{i}.1" for i in range(10, 256)] + [f"127.2.{i}.1" for i in range(4)]

    def spread_stalled(self) -> list[str]:
        """400 sources, each in its own /24 (IPv6: /48), the honest client's not among them."""
        if self.family == socket.AF_INET6:
            return [f"fd00:{i:x}::1" for i in range(0x1000, 0x1000 + 400)]
        return [f"127.0.{i}.1" for i in range(10, 256)] + [f"127.3.{i}.1" for i in range(154)]


NET4 = Net()
NET6 = Net(socket.AF_INET6, "ip6", "fd00::1", "fd00:ffff:1::1", "fd00:2::2", "fd00:3::3", "fd00:4::4", "fd00:5::5")


async def start_relay(net: Net, port: int) -> tuple[trio.Process, str]:
    """The relay on ``net``'s address (and on 127.0.0.1 for `status`), private addresses not counted
    as reachable, as a public relay runs; faulthandler on, for a hang's stacks."""
    listen = [net.listen(net.relay, port), *([] if net.relay == LOCAL else [f"/ip4/{LOCAL}/tcp/{port}"])]
    return await harness.start_relay(listen=listen, allow_private=False, python_flags=("-X", "faulthandler"))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


#: Seconds each phase of the honest attempts took (connect, ping, reserve, dht), for the JSON.
PHASES: list[dict[str, float]] = []


async def honest_attempt(net: Net, relay: str, relay_id: str, *, timeout: float) -> float | None:
    """Connect, ping, reserve a relay slot and DHT-get from a fresh node; seconds, or None when
    anything failed (the phases' times go to :data:`PHASES`)."""
    started = time.perf_counter()
    phases: dict[str, float] = {}

    def mark(name: str) -> None:
        phases[name] = time.perf_counter() - started - sum(phases.values())

    try:
        with trio.fail_after(timeout):
            config = NodeConfig(listen=[net.listen(net.honest)], dial_timeout=timeout, bootstrap_timeout=timeout)
            async with Node.open(config) as node:
                mark("open")
                await node.connect(relay, from_listen_port=True)
                mark("connect")
                await node.ping(node_id(relay_id))
                mark("ping")
                await RelayClient(node).reserve(node_id(relay_id))
                mark("reserve")
                async with DHT.open(node, DHTConfig(mode=DHTMode.CLIENT, bootstrap_timeout=timeout)) as dht:
                    if await dht.get(KEY, timeout=timeout) is None:
                        return None
                mark("dht")
                served = time.perf_counter() - started
            # the throwaway node's own teardown is not the relay's service: timed apart (py-libp2p's
            # service manager stops some of its tasks at a 0.1 s poll: a third of closes took 102 ms,
            # flood or not, which made medians jump between ~25 and ~125 ms)
            mark("close")
        PHASES.append(phases)
        return served
    except Exception as e:
        phases["error"] = 0.0
        print(f"honest attempt failed: {e!r}"[:300], file=sys.stderr, flush=True)
        PHASES.append(phases)
        return None


def node_id(text: str) -> Any:
    from libp2p.peer.id import ID

    return ID.from_base58(text)


async def honest_loop(net: Net, relay: str, relay_id: str, duration: float, interval: float) -> list[float | None]:
    results: list[float | None] = []
    deadline = trio.current_time() + duration
    while trio.current_time() < deadline:
        began = trio.current_time()
        results.append(await honest_attempt(net, relay, relay_id, timeout=10.0))
        await trio.sleep(max(0.0, interval - (trio.current_time() - began)))
    return results


async def open_idle(net: Net, port: int, source: str, *, payload: bytes = b"") -> trio.SocketStream | None:
    sock = trio.socket.socket(net.family, socket.SOCK_STREAM)
    try:
        await sock.bind((source, 0))
        with trio.fail_after(3):
            await sock.connect((net.relay, port))
        stream = trio.SocketStream(sock)
        if payload:
            await stream.send_all(payload)
        return stream
    except (OSError, trio.TooSlowError, trio.BrokenResourceError):
        sock.close()
        return None


async def flood(net: Net, port: int, scenario: str, held: list[trio.SocketStream], stop: trio.Event) -> int:
    """Open the scenario's connections (bounded), hold them until ``stop``; the number opened."""
    stalled = encode("/multistream/1.0.0", "/noise")
    plan: list[tuple[str, bytes]]
    if scenario == "idle":
        plan = [(net.idle, b"")] * 10_000
    elif scenario == "stalled":
        plan = [(net.stalled, stalled)] * 1_000
    elif scenario == "spread":
        addresses = net.spread()
        plan = [(a, b"") for _ in range(8) for a in addresses]
    elif scenario == "spread-stalled":
        addresses = net.spread_stalled()  # 400 /24s (/48s), 5 stalled handshakes each
        plan = [(a, stalled) for _ in range(50) for a in addresses][:20_000]
    else:
        raise ValueError(scenario)
    keep = 2_000 if scenario == "spread-stalled" else len(plan)
    opened = 0
    for source, payload in plan:
        if stop.is_set():
            break
        if len(held) >= keep:
            await held.pop(0).aclose()
        stream = await open_idle(net, port, source, payload=payload)
        if stream is not None:
            held.append(stream)
            opened += 1
    return opened


NODE_SCENARIOS = ("streams", "dht", "reservations")


async def node_flood(net: Net, relay: str, scenario: str, stop: trio.Event) -> int:
    """A connected attacker (a real node): streams, DHT requests or reservations, as fast as it
    can, until ``stop`` (bounded in count); the number of streams, requests or ids it made."""
    rid = node_id(relay.rsplit("/p2p/", 1)[1])
    made = 0

    async def workers(n: int, one: Any, limit: int) -> None:
        async def worker() -> None:
            nonlocal made
            while not stop.is_set() and made < limit:
                made += 1
                try:
                    await one()
                except Exception:
                    await trio.sleep(0)  # refused or reset: go on with the next
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(worker)

    if scenario in ("streams", "dht"):
        async with Node.open(NodeConfig(listen=[net.listen(net.attacker)])) as node:
            await node.connect(relay)
            held: list[Any] = []

            async def open_stream() -> None:
                with trio.fail_after(10):
                    stream = await node.new_stream(rid, RPC_PROTOCOL)
                    await stream.write(b"\x00")  # the proposal goes with it; then nothing
                held.append(stream)
                if len(held) > 20_000:
                    await held.pop(0).reset()

            async def find() -> None:
                request = dht_pb2.FindRequest(queries=[dht_pb2.Query(target=random.randbytes(32))])
                await node.rpc.call(rid, FIND, request, dht_pb2.FindResult, timeout=10)

            if scenario == "streams":
                await workers(64, open_stream, 100_000)
            else:
                await workers(32, find, 1_000_000)
    else:
        async with trio.open_nursery() as nursery:
            ring: list[trio.Event] = []

            async def throwaway(done: trio.Event) -> None:
                with trio.move_on_after(120):
                    async with Node.open(NodeConfig(listen=[net.listen(net.throwaway)])) as node:
                        try:
                            await node.connect(relay)
                            await RelayClient(node).reserve(rid)
                        except Exception:
                            pass
                        await done.wait()  # hold the connection (and the slot) until 16 newer ids exist

            async def one() -> None:
                done = trio.Event()
                ring.append(done)
                nursery.start_soon(throwaway, done)
                if len(ring) > 16:
                    ring.pop(0).set()
                await trio.sleep(0.02)

            await workers(8, one, 1_000)
            for done in ring:
                done.set()
    return made


async def status(net: Net, relay: str, relay_id: str) -> dict[str, Any]:
    async with Node.open(NodeConfig(listen=[f"/ip4/{LOCAL}/tcp/0"])) as node:  # status answers loopback only
        port, peer = relay.split("/tcp/", 1)[1].split("/p2p/")
        await node.connect(f"/ip4/{LOCAL}/tcp/{port}/p2p/{peer}")
        reply = await node.rpc.call(node_id(relay_id), STATUS_METHOD, Empty(), Struct, timeout=10)
    return dict(MessageToDict(reply))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    net = NET6 if args.ipv6 else NET4
    proc, relay = await start_relay(net, args.port)
    relay_id = relay.rsplit("/p2p/", 1)[1]
    results: dict[str, Any] = {"relay": relay}
    try:
        async with trio.open_nursery() as nursery:
            # keep reading the relay's events: a full pipe would block its prints, and it with them
            nursery.start_soon(drain, proc)
            await measure(net, args, proc, relay, relay_id, results)
            nursery.cancel_scope.cancel()
    finally:
        # outside the nursery: awaited inside it once cancelled, proc.wait() raised Cancelled over a
        # failed measurement's error, which the nursery then absorbed (the run "passed", rows missing)
        proc.terminate()
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
    return results


async def drain(proc: trio.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.receive_some(65536):
        pass


async def measure(net: Net, args: argparse.Namespace, proc: trio.Process, relay: str, relay_id: str,
                  results: dict[str, Any]) -> None:
    async with Node.open(NodeConfig(listen=[net.listen(net.relay)])) as seed:
        await seed.connect(relay)
        async with DHT.open(seed, DHTConfig(mode=DHTMode.CLIENT)) as dht:
            assert await dht.store(KEY, b"still here", time.time() + 3600)
    await honest_loop(net, relay, relay_id, 2 * args.interval, args.interval)  # warm-up (imports, first connections)
    base = await honest_loop(net, relay, relay_id, args.baseline, args.interval)
    ok = [r for r in base if r is not None]
    baseline = statistics.median(ok) if ok else float("nan")
    results["baseline"] = {"attempts": len(base), "ok": len(ok), "median_s": baseline}
    print(f"baseline: {len(ok)}/{len(base)} honest attempts, median {baseline * 1e3:.0f} ms", flush=True)
    for scenario in args.scenarios.split(","):
        rss0, cpu0 = rss_mib(proc.pid), cpu_seconds(proc.pid)
        before = await status(net, relay, relay_id)
        # the attacker is a process of its own, as a real one would be (not sharing our CPU time)
        attacker = await trio.lowlevel.open_process(
            [sys.executable, __file__, "--attack", scenario, "--port", str(args.port), "--relay", relay,
             "--attacker-nice", str(args.attacker_nice), *(["--ipv6", "--in-netns"] if args.ipv6 else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=str(REPO))
        try:
            await trio.sleep(2.0)  # let the flood build up
            honest = await honest_loop(net, relay, relay_id, args.duration, args.interval)
        finally:
            assert attacker.stdin is not None and attacker.stdout is not None
            await attacker.stdin.aclose()  # it stops opening, reports, closes everything and exits
            with trio.move_on_after(30):
                report = b""
                while chunk := await attacker.stdout.receive_some(4096):
                    report += chunk
                await attacker.wait()
            if attacker.returncode is None:
                attacker.kill()
        opened = [int(json.loads(report or b'{"opened": 0}')["opened"])]
        peak_rss = rss_mib(proc.pid)
        alive = proc.poll() is None
        after = await status(net, relay, relay_id) if alive else {}
        refusals = {k: v - before.get(k, 0) for k, v in after.items()  # this flood's, not the run's
                    if (k.startswith("resources.admission.refused.") or k.startswith("resources.refused."))
                    and isinstance(v, (int, float))}
        good = [r for r in honest if r is not None]
        row = {"attempts": len(honest), "ok": len(good), "success": len(good) / max(1, len(honest)), "latencies_s": honest,
               "median_s": statistics.median(good) if good else None,
               "latency_ratio": statistics.median(good) / baseline if good else None,
               "flood_opened": opened[0] if opened else 0, "rss_growth_mib": peak_rss - rss0,
               "cpu_s": cpu_seconds(proc.pid) - cpu0 if alive else None, "relay_alive": alive,
               "refusals": refusals, "phases": PHASES[-len(honest):]}
        results[scenario] = row
        print(f"{scenario}: {row['ok']}/{row['attempts']} honest ok, latency x{row['latency_ratio'] or 0:.2f}, "
              f"RSS +{row['rss_growth_mib']:.1f} MiB, flood opened {row['flood_opened']}, alive {alive}", flush=True)
        await trio.sleep(args.settle)


async def attack(net: Net, scenario: str, port: int, relay: str, niceness: int) -> None:
    """The attacker process: open the scenario's connections and hold them until stdin closes.

    It runs at the lowest priority (nice 19): on a real relay the attacker's CPU is its own
    machine's, while here it shares 2 cores with the relay and the honest client; at equal
    priority its own work, not the relay's, slows the honest client down (``--attacker-nice 0``
    shows that)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.nice(niceness)
    held: list[trio.SocketStream] = []
    stop = trio.Event()
    opened: list[int] = []
    async with trio.open_nursery() as nursery:

        async def run_flood() -> None:
            if scenario in NODE_SCENARIOS:
                opened.append(await node_flood(net, relay, scenario, stop))
            else:
                opened.append(await flood(net, port, scenario, held, stop))

        nursery.start_soon(run_flood)
        stdin = trio.lowlevel.FdStream(0)
        with trio.move_on_after(600):  # bounded, whatever the driver does
            while await stdin.receive_some(1024):
                pass
        stop.set()
    print(json.dumps({"opened": opened[0] if opened else len(held)}), flush=True)
    for stream in held:
        with trio.move_on_after(0.05):
            await stream.aclose()


def table(results: dict[str, Any]) -> str:
    b = results["baseline"]
    lines = [f"baseline: {b['ok']}/{b['attempts']} honest attempts (connect + ping + relay reservation + DHT get from a fresh node), "
             f"median {b['median_s'] * 1e3:.0f} ms",
             "| flood | honest success | median latency vs baseline | relay RSS growth | relay CPU | relay up | refusals |",
             "|---|---|---|---|---|---|---|"]
    for name, row in results.items():
        if name in ("relay", "baseline"):
            continue
        refused = ", ".join(f"{k.split('refused.', 1)[1]} {int(v)}" for k, v in row["refusals"].items() if v)
        median_ms = (row["median_s"] or float("nan")) * 1e3
        lines.append(f"| {name} ({row['flood_opened']} opened) | {row['ok']}/{row['attempts']} ({row['success']:.0%}) "
                     f"| {median_ms:.0f} ms, x{row['latency_ratio'] or float('nan'):.2f} | +{row['rss_growth_mib']:.1f} MiB "
                     f"| {row['cpu_s'] or 0:.1f} s | {row['relay_alive']} | {refused} |")
    return "\n".join(lines)


def in_a_namespace(argv: list[str]) -> int:
    """Run this bench again inside a network namespace made for it, whose loopback takes every
    address of fd00::/16 (a local route and non-local binds: one address per /48 without adding
    400 of them), and delete the namespace after; its exit status."""
    if os.geteuid() != 0:
        raise SystemExit("bench/flood.py --ipv6 needs root (it makes a network namespace)")
    ns = f"dflood6-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for command in (["ip", "link", "set", "lo", "up"], ["sysctl", "-qw", "net.ipv6.ip_nonlocal_bind=1"],
                        ["ip", "-6", "route", "add", "local", V6_PREFIX, "dev", "lo"]):
            subprocess.run(["ip", "netns", "exec", ns, *command], check=True)
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, __file__, *argv, "--in-netns"],
                              check=False).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="idle,stalled,spread,spread-stalled,streams,dht,reservations")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of honest attempts per flood")
    parser.add_argument("--baseline", type=float, default=20.0, help="seconds of honest attempts without a flood")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between honest attempts")
    parser.add_argument("--settle", type=float, default=10.0, help="pause between floods")
    parser.add_argument("--port", type=int, default=41999)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--attack", choices=["idle", "stalled", "spread", "spread-stalled", *NODE_SCENARIOS],
                        help=argparse.SUPPRESS)
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    parser.add_argument("--ipv6", action="store_true",
                        help="everything over IPv6 in a namespace of the run's own (root): the spread floods from /48s")
    parser.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--attacker-nice", type=int, default=19, metavar="N",
                        help="the attacker process's niceness (19: it takes only the CPU the relay and client leave)")
    args = parser.parse_args()
    if args.ipv6 and not args.in_netns:
        raise SystemExit(in_a_namespace(sys.argv[1:]))
    if args.attack:
        trio.run(attack, NET6 if args.ipv6 else NET4, args.attack, args.port, args.relay, args.attacker_nice)
        return
    if not 1 <= args.duration <= 600 or not 1 <= args.baseline <= 600:
        parser.error("--duration and --baseline must be 1..600 s")
    results = trio.run(run, args)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
