"""Connection set-up on a delayed path: dedloc and js-libp2p, both ways, in one run.

    sudo .venv/bin/python bench/wan.py [--rounds 5] [--delay-ms 50] [--loss-pct 0] [--json OUT]

Two public hosts of the NAT lab (nat/lab.py), each behind an access link of
--delay-ms one-way (netem where the kernel has it, else the lab's userspace
wire), so a round trip between them is 4 x delay (200 ms at the lab's
default). Host A listens with a dedloc node (bench/wan_peer.py) and a
js-libp2p node (interop/js/relay.mjs: TCP, Noise, Yamux, identify, ping);
host B dials each of them, --rounds times, from a dedloc node and from a
js-libp2p node (interop/js/peer.mjs): dedloc->dedloc, dedloc->js, js->dedloc
and js->js. Every round is a fresh connection (the last one is closed first)
and measures, from the dial's start:

* connected: the dialer holds a connection it can open streams on;
* first pong: a ping stream opened on it has its echo back.

Then the NAT path, dedloc only (the js peer here runs no DCUtR): a relay
(``dedloc relay``, --delay-ms / 2 one-way, as the NAT matrix's) and two peers
behind endpoint-independent NATs running the whole network layer; B dials A's
circuit address, --rounds times, each round a fresh process, identity and port
(bench/wan_peer.py nat-dial), and measures the relayed connection, its first
pong, and the time until the hole punch made it direct.

Both are printed in seconds and in round trips of the path (the nominal
4 x delay; the warm ping RTT is printed beside it), min / median over the
rounds. js's times come from its own clock around each command (peer.mjs's
elapsed_ms), so the driver's pipes are not counted.

Needs root (namespaces), node 22 and interop/node_modules (``make interop-deps``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "interop"))
sys.path.insert(0, str(REPO / "bench"))

from harness import Worker, json_result, open_worker, start_relay, tail  # noqa: E402
from jspeer import JsPeer, js_unavailable_reason, open_js_peer, open_js_relay  # noqa: E402
from nat.lab import Host, Lab, NatKind  # noqa: E402

PREFIX = "dwan"
PY = sys.executable
WORKER = str(REPO / "bench" / "wan_peer.py")
DEDLOC_PORT, JS_PORT = 4001, 4002
#: Looks globally routed, so the NAT layer treats it as public (the lab's default, 198.18/15, is
#: a benchmarking range it rightly ignores); it never leaves the namespaces.
PUBLIC_NET = "11.0.0.0/15"


async def dedloc_listener(host: Host, *args: str) -> Worker:
    """A wan_peer.py listener (``listen PORT`` unless told); what it announced is its ``hello``. It serves
    until its stdin closes."""
    return await open_worker("the dedloc listener", [PY, WORKER, *(args or ("listen", str(DEDLOC_PORT)))],
                             log=None, ready_timeout=60, spawn=host.spawn)


async def relay_on(host: Host) -> tuple[trio.Process, str]:
    """``dedloc relay`` on a lab host, on port 4001 of every interface, and its address there."""
    return await start_relay(listen=(f"/ip4/0.0.0.0/tcp/{DEDLOC_PORT}",), announce=host.ip, allow_private=False,
                             spawn=host.spawn)


async def nat_rounds(lab: Lab, args: argparse.Namespace) -> list[dict[str, float]]:
    """Relayed connection, first pong and time to direct between two peers behind EIM NATs."""
    loss = args.loss_pct or None
    relay_host = await lab.public_host("relay", delay_ms=args.delay_ms / 2, loss_pct=loss)
    a = await lab.peer("na", NatKind.EIM_PRESERVING, listen_port=DEDLOC_PORT, delay_ms=args.delay_ms, loss_pct=loss)
    b = await lab.peer("nb", NatKind.EIM_PRESERVING, listen_port=DEDLOC_PORT, delay_ms=args.delay_ms, loss_pct=loss)
    _, relay = await relay_on(relay_host)
    listener = await dedloc_listener(a, "nat-listen", relay, str(DEDLOC_PORT))
    rows = []
    try:
        for i in range(args.rounds):
            rc, out, err = await b.run([PY, WORKER, "nat-dial", relay, listener.hello["circuit"],
                                        str(DEDLOC_PORT + 10 + i)], timeout=120)
            rows.append(json_result(out, err, rc, what=f"nat-dial round {i}", timeout=120))
    finally:
        assert listener.proc.stdin is not None
        await listener.proc.stdin.aclose()
    return rows


async def dedloc_dials(host: Host, addr: str, rounds: int) -> list[dict[str, float]]:
    result = await host.run([PY, WORKER, "dial", addr, str(rounds)], timeout=60 + 20 * rounds)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if len(rows) != rounds:
        raise RuntimeError(f"dedloc dialer: {len(rows)} of {rounds} rounds; stderr: {tail(result.stderr)}")
    return rows


async def js_dials(js: JsPeer, addr: str, peer_id: str, rounds: int) -> list[dict[str, float]]:
    rows = []
    for _ in range(rounds):
        dial = await js.dial(addr, timeout=30)
        ping = await js.ping(peer_id=peer_id, timeout=30)  # a stream on the connection just made
        connected = dial["elapsed_ms"] / 1e3
        rows.append({"connected_s": connected, "first_pong_s": connected + ping["elapsed_ms"] / 1e3})
        await js.hangup(peer_id, timeout=30)
        await trio.sleep(0.5)  # js-libp2p rate-limits inbound connections per address (5/s)
    return rows


def lab_prefix(lab: Lab) -> str:
    """The multiaddr prefix of the lab's internet (its /15 public net: the first two octets)."""
    first, second = lab.public_net.split("/")[0].split(".")[:2]
    return f"/ip4/{first}.{second}."


def summary(rows: list[dict[str, float]], key: str, rtt: float) -> dict[str, float]:
    values = [r[key] for r in rows]
    return {"min_s": min(values), "median_s": statistics.median(values),
            "min_rtt": min(values) / rtt, "median_rtt": statistics.median(values) / rtt}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    reason = js_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"bench/wan.py needs js-libp2p: {reason}")
    rtt = 4 * args.delay_ms / 1e3
    results: dict[str, Any] = {"delay_ms": args.delay_ms, "loss_pct": args.loss_pct, "nominal_rtt_s": rtt}
    async with Lab(prefix=PREFIX, public_net=PUBLIC_NET) as lab:
        loss = args.loss_pct or None
        a = await lab.public_host("a", delay_ms=args.delay_ms, loss_pct=loss)
        b = await lab.public_host("b", delay_ms=args.delay_ms, loss_pct=loss)
        results["mechanism"] = lab.mechanism
        listener = await dedloc_listener(a)
        dedloc_id = listener.peer_id
        dedloc_addr = f"/ip4/{a.ip}/tcp/{DEDLOC_PORT}/p2p/{dedloc_id}"
        try:
            async with open_js_relay(a.spawn, ["--port", str(JS_PORT)]) as js_listener, \
                    open_js_peer(spawn=b.spawn, env={"JSPEER_LAB_PREFIX": lab_prefix(lab)}) as js_dialer:
                js_id = js_listener.peer_id
                js_addr = f"/ip4/{a.ip}/tcp/{JS_PORT}/p2p/{js_id}"
                pairs = {
                    "dedloc->dedloc": lambda: dedloc_dials(b, dedloc_addr, args.rounds),
                    "dedloc->js": lambda: dedloc_dials(b, js_addr, args.rounds),
                    "js->dedloc": lambda: js_dials(js_dialer, dedloc_addr, dedloc_id, args.rounds),
                    "js->js": lambda: js_dials(js_dialer, js_addr, js_id, args.rounds),
                }
                for name, measure in pairs.items():
                    rows = await measure()
                    results[name] = {"connected": summary(rows, "connected_s", rtt),
                                     "first_pong": summary(rows, "first_pong_s", rtt), "rounds": rows}
                    print(f"  {name:16} connected {results[name]['connected']['median_rtt']:.1f} RTT, "
                          f"first pong {results[name]['first_pong']['median_rtt']:.1f} RTT", flush=True)
        finally:
            assert listener.proc.stdin is not None
            await listener.proc.stdin.aclose()
        rows = await nat_rounds(lab, args)
        results["nat"] = {key: summary(rows, f"{key}_s", rtt) for key in ("relayed", "first_pong", "direct")}
        results["nat"]["rounds"] = rows
        # The network-layer issue's goal, 1.5 s at the lab's 200 ms RTT: 7.5 round trips at any delay.
        results["nat"]["direct_goal_s"] = DIRECT_GOAL_RTT * rtt
        results["nat"]["direct_within_goal"] = results["nat"]["direct"]["median_s"] <= DIRECT_GOAL_RTT * rtt
        print(f"  behind NATs      relayed {results['nat']['relayed']['median_s']:.2f} s, "
              f"direct {results['nat']['direct']['median_s']:.2f} s", flush=True)
    return results


#: Relayed start to direct, in round trips between the peers (1.5 s at the lab's 200 ms).
DIRECT_GOAL_RTT = 7.5


def table(results: dict[str, Any]) -> str:
    rtt = results["nominal_rtt_s"]
    lines = [f"path: {results['delay_ms']:g} ms one-way per access link ({rtt * 1e3:.0f} ms RTT, "
             f"{results['loss_pct']:g}% loss, by {results['mechanism']}); min / median of "
             f"{len(results['dedloc->dedloc']['rounds'])} rounds",
             "| dialer -> listener | connected (s) | connected (RTT) | first pong (s) | first pong (RTT) |",
             "|---|---|---|---|---|"]
    for name in ("dedloc->dedloc", "dedloc->js", "js->dedloc", "js->js"):
        c, p = results[name]["connected"], results[name]["first_pong"]
        lines.append(f"| {name} | {c['min_s']:.3f} / {c['median_s']:.3f} | {c['min_rtt']:.1f} / {c['median_rtt']:.1f} "
                     f"| {p['min_s']:.3f} / {p['median_s']:.3f} | {p['min_rtt']:.1f} / {p['median_rtt']:.1f} |")
    nat = results["nat"]
    lines += ["", f"dedloc behind two endpoint-independent NATs, through a relay ({results['delay_ms'] / 2:g} ms one-way "
              f"to the core), min / median of {len(nat['rounds'])} rounds",
              "| from the dial's start | seconds | RTT (peer to peer) |", "|---|---|---|"]
    for key, label in (("relayed", "relayed connection"), ("first_pong", "first pong (relayed)"),
                       ("direct", "direct (hole punch done)")):
        lines.append(f"| {label} | {nat[key]['min_s']:.3f} / {nat[key]['median_s']:.3f} "
                     f"| {nat[key]['min_rtt']:.1f} / {nat[key]['median_rtt']:.1f} |")
    lines.append(f"direct at the median {nat['direct']['median_s']:.3f} s, goal <= {nat['direct_goal_s']:.2f} s "
                 f"({DIRECT_GOAL_RTT:g} RTT): {'met' if nat['direct_within_goal'] else 'NOT met'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay of each access link")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="loss per direction on each access link")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 100:
        parser.error("--rounds must be 1..100")
    results = trio.run(run, args)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
