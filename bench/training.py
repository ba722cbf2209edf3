"""Collaborative training, dedloc against hivemind 1.1.12's Optimizer, in one run on loopback (CPU).

    .venv/bin/python bench/training.py [--systems dedloc,hivemind] [--peers 1,4] [--steps 10]
        [--target 1024] [--batch 32] [--width 1024] [--repeats 3] [--json OUT]

Every peer is its own process (dedloc: bench/training_peer.py through a
`dedloc relay`; hivemind: bench/training_hivemind_peer.py in .venv-hivemind,
peer 0 starting the DHT), trains the same MLP (width^2 + 257 width
parameters; 1024: 1.3 M, 5 MB of float32 gradients) on its own synthetic
batches with plain SGD, synchronously (no delayed updates), and measures
from the end of the first (warm-up) global step to the end of ``--steps``
more:

* samples/s of the swarm (all peers' samples over the longest wall time),
  1 peer against N (the 2-core machine shares its cores between the peers,
  so N peers cannot compute N times as fast: the ratio shows what the
  network costs on top);
* the overhead per global step: a peer's wall time minus its compute
  (forward and backward) over the steps, the median peer. That is the time
  from the global batch being reached to the peer's next local batch
  beginning (detecting it, matchmaking, all-reduce, the optimizer step),
  which the issue names, summed per step.

Repeats ``--repeats`` times; prints min / median. Loopback only. A worker
waits for the whole swarm before its first step (hivemind publishes a peer's
progress only once it reported samples: its worker reports one while it
waits, and takes it back).

Measured here (2 cores, shared; `make bench-training`, the defaults; 3 runs,
median):

    system     peers  samples/s  overhead/step min / median
    dedloc         1       2217         0.09 / 0.09 s
    dedloc         4       2859         0.66 / 0.74 s
    hivemind       1       2580         0.08 / 0.12 s
    hivemind       4        484         3.05 / 3.28 s
    4 peers do 1.29x the samples/s of one (dedloc), 0.19x (hivemind);
    overhead per global step with 4 peers: hivemind 4.4x dedloc's

A single worker uses one torch thread, so 4 peers on 2 cores compute more
than one; hivemind's overhead is its matchmaking_time (every round waits it
out) plus its round; dedloc's leader fixes the group once every peer at the
step joined.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from harness import HIVEMIND_PYTHON, Spawned, spawn_relay, stop_all  # noqa: E402
DEDLOC_PY = ROOT / ".venv" / "bin" / "python"
HIVEMIND_PY = HIVEMIND_PYTHON


def worker_args(args: argparse.Namespace, index: int, peers: int) -> list[str]:
    return ["--index", str(index), "--steps", str(args.steps), "--target", str(args.target), "--batch",
            str(args.batch), "--width", str(args.width), "--peers", str(peers), "--matchmaking-time",
            str(args.matchmaking_time)]


def run_once(system: str, peers: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One run of ``peers`` workers; each worker's result."""
    spawned: list[Spawned] = []
    try:
        if system == "dedloc":
            relay, boot = spawn_relay(python=DEDLOC_PY)
            spawned.append(relay)
            workers = [Spawned([DEDLOC_PY, ROOT / "bench" / "training_peer.py", *worker_args(args, i, peers),
                                "--initial-peers", boot], stderr=args.worker_stderr)
                       for i in range(peers)]
        else:
            first = Spawned([HIVEMIND_PY, ROOT / "bench" / "training_hivemind_peer.py", *worker_args(args, 0, peers)],
                            stderr=args.worker_stderr)
            spawned.append(first)
            maddrs = first.wait_for("maddrs", 120)["maddrs"]
            workers = [first] + [Spawned([HIVEMIND_PY, ROOT / "bench" / "training_hivemind_peer.py",
                                          *worker_args(args, i, peers), "--initial-peers", maddrs[0]],
                                         stderr=args.worker_stderr)
                                 for i in range(1, peers)]
        spawned += workers[1:] if system == "hivemind" else workers
        return [w.wait_for("wall", args.timeout) for w in workers]
    finally:
        stop_all(spawned)


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    wall = max(r["wall"] for r in results)
    samples = sum(r["samples"] for r in results)
    overheads = sorted((r["wall"] - r["compute"]) / max(1, r["steps"]) for r in results)
    calls = [c for r in results for c in r["step_calls"]]
    return {"samples_per_s": samples / wall if wall > 0 else 0.0, "overhead_s": statistics.median(overheads),
            "step_call_s": statistics.median(calls) if calls else float("nan"), "wall_s": wall,
            "loss_first": statistics.mean(r["loss_first"] for r in results if r["loss_first"] is not None),
            "loss_last": statistics.mean(r["loss_last"] for r in results if r["loss_last"] is not None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="dedloc,hivemind")
    p.add_argument("--peers", default="1,4", help="peer counts to run")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--target", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--matchmaking-time", type=float, default=3.0,
                   help="hivemind's matchmaking_time; dedloc's gather time (a group of everyone at the step fixes sooner)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    args = p.parse_args()
    args.worker_stderr = None if args.verbose else subprocess.DEVNULL
    systems = [s for s in args.systems.split(",") if s]
    if "hivemind" in systems and not HIVEMIND_PY.exists():
        sys.exit("hivemind is not installed: run bench/setup_hivemind.sh first (it creates .venv-hivemind)")
    table: dict[str, dict[str, Any]] = {}
    for system in systems:
        for peers in [int(n) for n in args.peers.split(",")]:
            runs = []
            for r in range(args.repeats):
                results = run_once(system, peers, args)
                s = summarize(results)
                runs.append(s)
                print(f"  {system} {peers} peer(s) run {r}: {s['samples_per_s']:.0f} samples/s, overhead "
                      f"{s['overhead_s']:.2f} s per global step (step() call {s['step_call_s']:.2f} s), "
                      f"loss {s['loss_first']:.3f} -> {s['loss_last']:.3f}", flush=True)
            key = f"{system}/{peers}"
            table[key] = {
                "samples_per_s": [x["samples_per_s"] for x in runs],
                "overhead_s": [x["overhead_s"] for x in runs],
                "samples_per_s_median": statistics.median(x["samples_per_s"] for x in runs),
                "overhead_s_min": min(x["overhead_s"] for x in runs),
                "overhead_s_median": statistics.median(x["overhead_s"] for x in runs),
            }
    print(f"\n== summary (MLP {args.width}: {args.width ** 2 + 257 * args.width + args.width + 1:,} parameters; "
          f"global batch {args.target}, local {args.batch}; {args.steps} steps after a warm-up; "
          f"{args.repeats} runs; matchmaking time {args.matchmaking_time:g} s) ==")
    print(f"{'system':10} {'peers':>5} {'samples/s (median)':>19} {'overhead/step min / median':>27}")
    for key, row in table.items():
        system, swarm_size = key.split("/")
        print(f"{system:10} {swarm_size:>5} {row['samples_per_s_median']:>19.0f} "
              f"{row['overhead_s_min']:>12.2f} / {row['overhead_s_median']:.2f} s")
    ratios: dict[str, float] = {}
    for system in systems:
        one, many = table.get(f"{system}/1"), [k for k in table if k.startswith(f"{system}/") and k != f"{system}/1"]
        if one and many:
            ratios[f"{system}_scaling"] = table[many[-1]]["samples_per_s_median"] / one["samples_per_s_median"]
            print(f"{system}: {many[-1].split('/')[1]} peers do {ratios[f'{system}_scaling']:.2f}x the samples/s of one")
    for key in table:
        if key.startswith("dedloc/") and key.replace("dedloc", "hivemind") in table and not key.endswith("/1"):
            h = table[key.replace("dedloc", "hivemind")]["overhead_s_median"]
            d = table[key]["overhead_s_median"]
            ratios["hivemind_over_dedloc_overhead"] = h / d if d > 0 else float("inf")
            print(f"overhead per global step, {key.split('/')[1]} peers: dedloc {d:.2f} s, hivemind {h:.2f} s "
                  f"= {ratios['hivemind_over_dedloc_overhead']:.1f}x dedloc's")
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "ratios": ratios, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
