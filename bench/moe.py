"""Decentralized mixture-of-experts against hivemind.moe 1.1.12, on loopback, in one run.

    .venv/bin/python bench/moe.py [--experts 64,256] [--repeats 2] [--searches 40] [--json OUT]

For each grid size, each side's worker (bench/moe_peer.py for dedloc, bench/moe_hivemind_peer.py in
.venv-hivemind for hivemind; see their docstrings) runs --repeats times, alternating, each a fresh
process: 20 expert servers declare the grid, the 10% of experts on 2 of them are dead (those
servers stopped; their records stay), and a client measures beam search (batch 16, k 4, random
gate scores) cold and warm; then expert calls per second (forward and backward of 64 rows through
RemoteExpert, 4 caller threads, ffn experts of hidden 256 and nop experts: the serving stack alone)
and a call to a server that dies in the middle of it.

dedloc's worker settles its garbage collector once its peers are up, as the commands do
(p2p/collector.py; ``--gc default`` for CPython's own), and reports the collections it saw while
measuring.

Printed: min / median over the repeats of every figure, and dedloc / hivemind. The goals
(issue "Decentralized mixture-of-experts"): search p99 below hivemind's with dead experts present;
no call past its timeout; calls/s at least hivemind's. ``--json OUT`` writes ``dedloc.search_p99_ms``,
``hivemind.search_p99_ms`` (the largest grid's cold p99, median of the repeats), ``dedloc.calls_per_s``,
``hivemind.calls_per_s`` (ffn), ``dedloc.calls_past_timeout`` (summed) and every case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # imported by path too (tests), not only run
from harness import PYTHON, ROOT, hivemind_python, run_json  # noqa: E402

WORKERS: dict[str, tuple[Callable[[], Path], Path]] = {
    "dedloc": (lambda: PYTHON, ROOT / "bench" / "moe_peer.py"),
    "hivemind": (hivemind_python, ROOT / "bench" / "moe_hivemind_peer.py")}


def run_worker(system: str, experts: int, args: argparse.Namespace, expert_cls: str) -> dict[str, Any]:
    python, script = WORKERS[system]
    command: list[str | Path] = [python(), script, "--experts", str(experts), "--servers", str(args.servers),
               "--searches", str(args.searches), "--seconds", str(args.seconds), "--expert-cls", expert_cls]
    if system == "dedloc":
        command += ["--gc", args.gc]
    return run_json(command, timeout=args.timeout, what=f"{system} worker ({experts} experts, {expert_cls})")


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="64,256", help="grid sizes (squares): comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--servers", type=int, default=20, help="expert servers declaring the grid (10%% of them dead)")
    p.add_argument("--searches", type=int, default=40)
    p.add_argument("--seconds", type=float, default=5.0, help="length of each calls/s measurement")
    p.add_argument("--systems", default="dedloc,hivemind")
    p.add_argument("--timeout", type=float, default=300.0, help="longest one worker may run")
    p.add_argument("--gc", choices=("settle", "default"), default="settle",
                   help="dedloc's collector: settle (the commands' policy, p2p/collector.py) or CPython's default")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    systems = args.systems.split(",")
    sizes = [int(x) for x in args.experts.split(",")]
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {s: {n: [] for n in sizes} for s in systems}
    nop: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    failures: list[str] = []
    for repeat in range(args.repeats):
        for n in sizes:
            for system in systems:
                cls = "nop" if n == sizes[0] else "ffn"  # the calls part: nop with the first grid, ffn with the others
                try:
                    result = run_worker(system, n, args, cls)
                except RuntimeError as e:  # reported, and that run left out (never silently)
                    print(f"[{repeat + 1}/{args.repeats}] {system:8s} {n:4d} experts: FAILED: {e}", flush=True)
                    failures.append(f"{system} {n} experts {cls}: {str(e)[:300]}")
                    continue
                (nop[system] if cls == "nop" else runs[system][n]).append(result)
                if cls == "nop":
                    runs[system][n].append({k: v for k, v in result.items() if k not in ("calls", "calls_per_s")})
                print(f"[{repeat + 1}/{args.repeats}] {system:8s} {n:4d} experts: search cold p50/p99 "
                      f"{result['search']['cold_p50_ms']:.1f}/{result['search']['cold_p99_ms']:.1f} ms, warm "
                      f"{result['search']['warm_p50_ms']:.2f}/{result['search']['warm_p99_ms']:.2f} ms, found "
                      f"{result['search']['found_per_search']:.0f}/{result['search']['wanted_per_search']}; "
                      f"{cls} calls {result['calls']['calls_per_s']:.0f}/s ({result['calls']['samples_per_s']:.0f} "
                      f"samples/s); faults {result['faults']}", flush=True)
    report: dict[str, Any] = {"cases": {}, "failed_runs": failures}
    if failures:
        print(f"\n{len(failures)} worker run(s) failed and are left out: " + "; ".join(failures))
    print("\n== beam search (ms; min / median over the repeats), dedloc / hivemind ==")
    for n in sizes:
        case: dict[str, Any] = {}
        for system in systems:
            rs = runs[system][n]
            case[system] = {key: spread([r["search"][key] for r in rs])
                            for key in ("cold_p50_ms", "cold_p99_ms", "warm_p50_ms", "warm_p99_ms")}
            case[system]["found_per_search"] = statistics.mean(r["search"]["found_per_search"] for r in rs)
        report["cases"][f"{n}_experts"] = case
        for key in ("cold_p50_ms", "cold_p99_ms", "warm_p50_ms", "warm_p99_ms"):
            cells = "  ".join(f"{s} {case[s][key]['min']:8.2f} / {case[s][key]['median']:8.2f}" for s in systems)
            versus = (f"  ratio {shown(ratio(case['dedloc'][key]['median'], case['hivemind'][key]['median']), 3)}"
                      if len(systems) == 2 else "")
            print(f"{n:4d} experts {key:12s} {cells}{versus}")
    print("\n== expert calls (forward or backward of 64 rows, 4 callers) per second ==")
    calls: dict[str, Any] = {}
    for system in systems:
        ffn = [r["calls"]["calls_per_s"] for n in sizes[1:] for r in runs[system][n]]
        calls[system] = {"ffn": spread(ffn) if ffn else None,
                         "nop": spread([r["calls"]["calls_per_s"] for r in nop[system]])}
        ffn_cell = (f"{calls[system]['ffn']['min']:7.1f} / {calls[system]['ffn']['median']:7.1f}" if ffn else
                    "    n/a (ffn calls run on every grid but the first: give two --experts sizes)")
        print(f"{system:8s} ffn {ffn_cell}   "
              f"nop {calls[system]['nop']['min']:7.1f} / {calls[system]['nop']['median']:7.1f}")
    report["calls"] = calls
    for system in systems:
        every = nop[system] + [r for n in sizes[1:] for r in runs[system][n]]  # each worker run once
        report[system] = {
            "search_p99_ms": statistics.median(r["search"]["cold_p99_ms"] for r in runs[system][sizes[-1]]),
            "warm_search_p99_ms": statistics.median(r["search"]["warm_p99_ms"] for r in runs[system][sizes[-1]]),
            "calls_per_s": calls[system]["ffn"]["median"] if calls[system]["ffn"] else None,
            "nop_calls_per_s": calls[system]["nop"]["median"],
            "faults": [r["faults"] for r in every],
        }
        if system == "dedloc":
            report[system]["calls_past_timeout"] = sum(r["calls_past_timeout"] for r in every)
            report[system]["gc"] = [r["gc"] for r in every]
            longest = spread([r["gc"]["full_max_s"] * 1e3 for r in every])
            print(f"dedloc's garbage collector ({args.gc}) while measuring: longest full collection "
                  f"{longest['min']:.0f} / {longest['median']:.0f} ms, "
                  f"{statistics.median(r['gc']['full_collections'] for r in every):.0f} full collections a run, "
                  f"peak RSS {statistics.median(r['gc']['max_rss_mib'] for r in every):.0f} MiB")
    if len(systems) == 2:
        d, h = report["dedloc"], report["hivemind"]
        report["ratios"] = {key: ratio(d[figure], h[figure]) for key, figure in (
            ("search_p99", "search_p99_ms"), ("warm_search_p99", "warm_search_p99_ms"),
            ("calls_per_s", "calls_per_s"), ("nop_calls_per_s", "nop_calls_per_s"))}
        print(f"\nsearch p99 ({sizes[-1]} experts, cold): dedloc {d['search_p99_ms']:.1f} ms, hivemind "
              f"{h['search_p99_ms']:.1f} ms: ratio {shown(report['ratios']['search_p99'], 3)} (goal < 1)")
        print(f"calls/s (ffn): ratio {shown(report['ratios']['calls_per_s'], 2)} (goal >= 1); nop: "
              f"{shown(report['ratios']['nop_calls_per_s'], 2)}")
        print(f"dedloc calls past their timeout: {d['calls_past_timeout']} (goal 0); hivemind's RemoteExpert has "
              f"no timeout: a server killed mid-call: {[f['killed_mid_call'] for f in h['faults']]}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0 (a figure this run did not measure)."""
    return None if a is None or not b else a / b


def shown(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
