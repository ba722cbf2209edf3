"""What bench/moe_peer.py (dedloc) and bench/moe_hivemind_peer.py (hivemind's venv) share: the options,
which server declares which expert, and the search figures. Standard library only (both venvs import it)."""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=64, help="a square grid's size (64: 8x8, 256: 16x16)")
    p.add_argument("--servers", type=int, default=20)
    p.add_argument("--dead", type=float, default=0.1, help="share of the experts whose servers stop")
    p.add_argument("--searches", type=int, default=40)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--callers", type=int, default=4)
    p.add_argument("--expert-cls", choices=("ffn", "nop"), default="ffn", help="the experts called (nop: the stack alone)")
    return p


def server_parser() -> argparse.ArgumentParser:
    """The options of bench/moe_gpu.py's two workers (bench/moe_gpu_peer.py, bench/moe_gpu_hivemind_peer.py)."""
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true", help="be the expert server")
    p.add_argument("--client", metavar="SERVER_JSON", help="be a client of the server that printed this")
    p.add_argument("--device", default="cpu")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--max-batch", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--callers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--expert-cls", choices=("ffn", "nop"), default="ffn",
                   help="--serve: the experts (nop: x * a parameter, the serving stack alone)")
    p.add_argument("--shard", default="0/1", metavar="I/N",
                   help="--serve: host every N-th expert from the I-th (dedloc's serve-experts --processes N)")
    p.add_argument("--threads", type=int, default=4,
                   help="--serve, dedloc: torch's intra-op threads (0: torch's own, one per core)")
    return p


def call_loop(call: Callable[[int], None], first: int, stop_at: float,
              errors: tuple[type[BaseException], ...]) -> tuple[int, int]:
    """``call(turn)`` for turn = first, first + 1, ... until ``stop_at`` (time.perf_counter); how many
    returned and how many raised one of ``errors`` (a bench/moe_gpu.py client thread)."""
    done = failed = 0
    turn = first
    while time.perf_counter() < stop_at:
        try:
            call(turn)
            done += 1
        except errors:
            failed += 1
        turn += 1
    return done, failed


def assignment(args: argparse.Namespace) -> tuple[int, list[tuple[bool, list[tuple[int, int]]]]]:
    """The grid's side and, per server, (dead?, its experts' coordinates): the --dead share of the
    experts on round(--dead x --servers) servers that stop, the rest spread over the others."""
    side = int(round(math.sqrt(args.experts)))
    coords = [(i, j) for i in range(side) for j in range(side)]
    random.Random(0).shuffle(coords)
    n_dead = round(args.dead * len(coords))
    dead_servers = max(1, round(args.dead * args.servers)) if n_dead else 0
    live_servers = args.servers - dead_servers
    dead, live = coords[:n_dead], coords[n_dead:]
    servers = [(True, dead[s::dead_servers]) for s in range(dead_servers)]
    servers += [(False, live[s::live_servers]) for s in range(live_servers)]
    return side, servers


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def search_figures(cold: list[float], warm: list[float], found: list[int]) -> dict[str, object]:
    return {"cold_p50_ms": statistics.median(cold), "cold_p99_ms": percentile(cold, 99),
            "warm_p50_ms": statistics.median(warm), "warm_p99_ms": percentile(warm, 99),
            "found_per_search": statistics.mean(found), "wanted_per_search": 16 * 4,
            "cold_ms": sorted(cold)[-5:], "warm_ms": sorted(warm)[-5:]}
