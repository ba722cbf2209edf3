"""What the connection manager costs and saves: a DHT swarm on loopback with it and without it.

    .venv/bin/python bench/conn_manager.py [--peers 40] [--low 8] [--high 12] [--grace 5] [--rounds 4]
        [--concurrency 8] [--json OUT]

Each mode runs in a process of its own (its memory is its own): ``--peers`` DHT servers in one trio
loop, each meeting peers by peer exchange (every second, as ``nat.Peer``'s do), join one after
another through the first, then ``--rounds`` rounds in which every peer stores
one record and reads five others' (random keys, ``--concurrency`` gets under way at once across
the swarm: all at once, 200 lookups in one process would measure its one core, not the swarm). Printed per mode: the
connections each peer holds after joining and after the last round (median, max), the process's
open sockets and resident memory, the gets that found their value and their latency (p50, p95),
how many connections were trimmed, and how long the swarm took to close. ``off`` is the node as it
was (every connection kept until a side leaves), ``on`` the connection manager at ``--low`` /
``--high`` (scaled down from its defaults of 160 / 192, which a swarm this size never reaches) with a
``--grace`` of seconds and a look every second. The ratios are on/off.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from collections import Counter
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _spread(values: list[int]) -> dict[str, float]:
    return {"median": statistics.median(values), "max": max(values)}


async def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import trio

    from p2p import Node, NodeConfig
    from p2p.conn_manager import ConnManagerConfig
    from p2p.dht import DHT, DHTConfig
    from p2p.peer_exchange import PeerExchange

    manager = ConnManagerConfig(low_water=args.low, high_water=args.high, grace_period=args.grace, silence_period=1.0,
                                enabled=args.mode == "on")
    rng = random.Random(args.seed)
    out: dict[str, Any] = {"mode": args.mode, "peers": args.peers}
    started = time.perf_counter()
    stack = AsyncExitStack()
    async with stack:
        dhts: list[DHT] = []
        for _ in range(args.peers):
            initial = [str(dhts[0].node.addrs[0])] if dhts else []
            node = await stack.enter_async_context(Node.open(NodeConfig(
                listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial, connections=manager)))
            await stack.enter_async_context(PeerExchange.open(node, interval=1.0))
            dhts.append(await stack.enter_async_context(DHT.open(node, DHTConfig(mode="server"))))
        outcomes: Counter[str] = Counter()
        for d in dhts:
            d.observe_queries(lambda kind, seconds, outcome: outcomes.update([f"{kind}.{outcome}"]))
        out["join_s"] = round(time.perf_counter() - started, 1)
        out["after_join"] = _spread([len(d.node.connections()) for d in dhts])
        await trio.sleep(args.grace + 2.0)  # past the grace, and a look or two
        latencies: list[float] = []
        # a few gets at a time: 200 at once in one process measure its one core, not the swarm
        limiter = trio.CapacityLimiter(args.concurrency)
        found = asked = 0
        for r in range(args.rounds):
            now = time.time()
            for i, d in enumerate(dhts):
                await d.store(f"r{r}-k{i}", b"v" * 64, now + 600)

            async def get(d: DHT, key: str) -> None:
                nonlocal found, asked
                async with limiter:
                    t = time.perf_counter()
                    value = await d.get(key)
                    latencies.append(time.perf_counter() - t)
                asked += 1
                found += value is not None

            async with trio.open_nursery() as nursery:
                for d in dhts:
                    for _ in range(5):
                        nursery.start_soon(get, d, f"r{r}-k{rng.randrange(args.peers)}")
            await trio.sleep(2.0)
        out["after_rounds"] = _spread([len(d.node.connections()) for d in dhts])
        out["sockets"] = _sockets()
        out["rss_mib"] = round(_rss_mib(), 1)
        out["gets"] = asked
        out["found"] = found
        latencies.sort()
        out["get_p50_ms"] = round(1000 * latencies[len(latencies) // 2], 1)
        out["get_p95_ms"] = round(1000 * latencies[int(len(latencies) * 0.95)], 1)
        out["trimmed"] = sum(d.node.trimmed for d in dhts)
        out["table"] = _spread([len(d.table) for d in dhts])
        out["queries"] = dict(sorted(outcomes.items()))
        closing = time.perf_counter()
    out["close_s"] = round(time.perf_counter() - closing, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", type=int, default=40)
    p.add_argument("--low", type=int, default=8)
    p.add_argument("--high", type=int, default=12)
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8, help="gets under way at once, across the swarm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--mode", choices=("on", "off"), default=None, help=argparse.SUPPRESS)  # a worker's
    args = p.parse_args()
    if args.mode is not None:
        import trio

        print(json.dumps(trio.run(_worker, args)))
        return
    runs = {}
    for mode in ("off", "on"):
        argv = [sys.executable, __file__, "--mode", mode, *sys.argv[1:]]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            sys.exit(f"the {mode} run failed:\n{result.stderr[-3000:]}")
        runs[mode] = json.loads(result.stdout.strip().splitlines()[-1])
    off, on = runs["off"], runs["on"]
    print(f"{args.peers} DHT peers on loopback, {args.rounds} rounds of a store and 5 gets each; "
          f"the manager at {args.low}/{args.high}, grace {args.grace:g} s")
    print("| mode | conns/peer joined (median, max) | after the rounds | sockets | RSS MiB | found | get p50 / p95 ms | "
          "trimmed | close s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in (off, on):
        print(f"| {r['mode']} | {r['after_join']['median']:g}, {r['after_join']['max']} | "
              f"{r['after_rounds']['median']:g}, {r['after_rounds']['max']} | {r['sockets']} | {r['rss_mib']} | "
              f"{r['found']}/{r['gets']} | {r['get_p50_ms']} / {r['get_p95_ms']} | {r['trimmed']} | {r['close_s']} |")
    ratios = {"sockets": on["sockets"] / off["sockets"], "rss": on["rss_mib"] / off["rss_mib"],
              "get_p50": on["get_p50_ms"] / off["get_p50_ms"], "get_p95": on["get_p95_ms"] / off["get_p95_ms"]}
    print("on/off: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    for r in (off, on):
        print(f"{r['mode']}: routing tables {r['table']['median']:g} (max {r['table']['max']}); queries {r['queries']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"off": off, "on": on, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
