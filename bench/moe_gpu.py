"""One expert server on a GPU: dedloc's against hivemind.moe 1.1.12's Server, same device, same experts, one run.

    .venv/bin/python bench/moe_gpu.py [--device cuda] [--experts 16] [--hidden 1024] [--batches 64,1024]
        [--clients 8] [--callers 4] [--seconds 15] [--repeats 1] [--server-processes 1,4] [--json OUT]
    .venv/bin/python bench/moe_gpu.py --device cpu --hidden 256 --batches 64 --clients 2 --seconds 3   (a CPU)

For each batch size, each side (alternating, --repeats times): a server process hosting --experts ffn
experts of --hidden on --device with Adam (dedloc: bench/moe_gpu_peer.py's ExpertServer; hivemind:
bench/moe_gpu_hivemind_peer.py's Server.create, in .venv-hivemind), then --clients client processes
of --callers threads each, every thread running forward and backward of --batch rows through
RemoteExpert to the experts in turn. The clients warm up, wait for one start signal, call for
--seconds and report how many forward+backward pairs they finished. Printed: samples/s (pairs x
batch / seconds, all clients together), pairs/s, the GPU's mean utilization (nvidia-smi, every 0.5 s)
and dedloc / hivemind. This is hivemind's own benchmark_throughput.py setup (16 ffn experts of hidden
1024, clients on the same host; it published 28,581 samples/s with 128 clients x batch 2048 on a
GTX 1080 Ti), scaled to one machine's cores. hivemind's Server serves from 8 handler processes per
expert (its num_handlers default: 128 here) beside its Go daemon; ``--server-processes 1,4`` runs
dedloc's both as one process and as 4 (`serve-experts --processes 4`: a peer each, every 4th expert,
the clients calling each expert at its own process), each case named apart ("dedloc", "dedloc x4").

``--json OUT`` writes ``cases`` (per batch: each variant's samples/s min/median, ``ratio`` for
one-process dedloc over hivemind and ``ratios`` for every dedloc variant) and ``dedloc.samples_per_s`` /
``dedloc x4.samples_per_s`` / ``hivemind.samples_per_s`` (the largest batch's medians). Where each
side's packages come from: ``--python-dedloc``/``--python-hivemind`` and ``--path-dedloc``/``--path-hivemind``
(prepended to PYTHONPATH; a GPU machine with no venvs). Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"dedloc": ROOT / "bench" / "moe_gpu_peer.py", "hivemind": ROOT / "bench" / "moe_gpu_hivemind_peer.py"}
sys.path.insert(0, str(ROOT / "bench"))

from gpu_training import GpuSampler  # noqa: E402
from harness import HIVEMIND_PYTHON, Spawned, stop_all  # noqa: E402


class Side:
    """One system's processes for one case; all of them killed on the way out (their own sessions:
    hivemind's p2pd daemons and server processes too)."""

    def __init__(self, system: str, args: argparse.Namespace) -> None:
        self.system, self.args = system, args
        self.workers: list[Spawned] = []
        path = getattr(args, f"path_{system}")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        if path:
            self.env["PYTHONPATH"] = path + os.pathsep + self.env.get("PYTHONPATH", "")
        self.python = getattr(args, f"python_{system}")

    def start(self, what: str, *extra: str) -> Spawned:
        worker = Spawned([self.python, SCRIPTS[self.system], *extra], what=f"{self.system} {what}", env=self.env,
                         stdin=subprocess.PIPE, keep_stderr=True)
        self.workers.append(worker)
        return worker

    def __enter__(self) -> Side:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all(self.workers, grace=0)


def label(system: str, processes: int) -> str:
    """A variant's name in the output: "dedloc", "dedloc x4" (its server in 4 processes), "hivemind"."""
    return system if processes == 1 else f"{system} x{processes}"


def run_case(system: str, batch: int, args: argparse.Namespace, processes: int = 1) -> dict[str, Any]:
    with Side(system, args) as side:
        servers = [side.start(f"server {i}", "--serve", "--device", args.device, "--experts", str(args.experts),
                              "--hidden", str(args.hidden), "--max-batch", str(args.max_batch),
                              "--expert-cls", args.expert_cls,
                              *(["--shard", f"{i}/{processes}"] if processes > 1 else []),
                              *(["--threads", str(args.server_threads)] if system == "dedloc" else []))
                   for i in range(processes)]
        deadline = time.monotonic() + args.timeout
        wheres = [server.wait_for(None, deadline - time.monotonic()) for server in servers]
        where = wheres[0] if processes == 1 else wheres
        clients = [side.start(f"client {i}", "--client", json.dumps(where), "--experts", str(args.experts), "--hidden",
                              str(args.hidden), "--batch", str(batch), "--callers", str(args.callers),
                              "--seconds", str(args.seconds), "--index", str(i)) for i in range(args.clients)]
        deadline = time.monotonic() + args.timeout
        for client in clients:  # warmed up
            client.wait_for(None, deadline - time.monotonic())
        with GpuSampler() as gpu:
            for client in clients:  # the start signal
                client.send("go")
            deadline = time.monotonic() + args.seconds + args.timeout
            results = [c.wait_for(None, deadline - time.monotonic()) for c in clients]
        pairs = sum(r["pairs"] for r in results)
        elapsed = max(r["elapsed_s"] for r in results)
        return {"samples_per_s": pairs * batch / elapsed, "pairs_per_s": pairs / elapsed,
                "failed": sum(r.get("failed", 0) for r in results), "gpu_util_mean": gpu.mean,
                "device": wheres[0].get("device_name", args.device), "server_processes": processes,
                "module": wheres[0].get("module", args.expert_cls)}


def attempt_case(system: str, batch: int, args: argparse.Namespace, processes: int,
                 failures: list[str]) -> dict[str, Any] | None:
    """:func:`run_case`, tried up to ``--attempts`` times: a worker that dies (hivemind's client once did, in
    its daemon's teardown, at 1024 rows on an H200) costs that attempt, not the run's other figures.
    Each failure's message is appended to ``failures``; None when every attempt failed."""
    for _ in range(args.attempts):
        try:
            return run_case(system, batch, args, processes)
        except (RuntimeError, OSError, KeyError, ValueError) as e:
            failures.append(f"{type(e).__name__}: {e}")
    return None


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--expert-cls", choices=("ffn", "nop"), default="ffn",
                   help="ffn (hivemind's benchmark) or nop (x * a parameter: the serving stack alone, both sides)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batches", default="64,1024", help="rows per call: comma-separated")
    p.add_argument("--max-batch", type=int, default=4096, help="most rows in one server batch (both sides)")
    p.add_argument("--clients", type=int, default=8, help="client processes")
    p.add_argument("--callers", type=int, default=4, help="calling threads per client")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0, help="most seconds a server or a client's warm-up may take")
    p.add_argument("--systems", default="dedloc,hivemind")
    p.add_argument("--attempts", type=int, default=2, help="tries per case before it is reported as failed")
    p.add_argument("--server-threads", type=int, default=4,
                   help="dedloc's server: torch's intra-op threads per process (0: torch's own, one per core); "
                   "a training peer lost ~8 ms per op to 16 of them on a busy GPU host (docs/AVERAGING.md)")
    p.add_argument("--server-processes", default="1", metavar="N[,N...]",
                   help="dedloc: its server in N processes, a peer each hosting every N-th expert (serve-experts "
                   "--processes N); a case per N, each named 'dedloc xN' beside 'dedloc' (1)")
    p.add_argument("--python-dedloc", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--python-hivemind", default=str(HIVEMIND_PYTHON))
    p.add_argument("--path-dedloc", default="")
    p.add_argument("--path-hivemind", default="")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    counts = [int(n) for n in args.server_processes.split(",")]
    if any(not 1 <= n <= args.experts for n in counts):
        p.error(f"--server-processes: each count must be 1..--experts ({args.experts})")
    variants = [(s, n) for s in args.systems.split(",") for n in (counts if s == "dedloc" else [1])]
    systems = [label(s, n) for s, n in variants]
    batches = [int(b) for b in args.batches.split(",")]
    cases: dict[str, Any] = {}
    for batch in batches:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        failures: dict[str, list[str]] = {s: [] for s in systems}
        for repeat in range(args.repeats):
            for (name, processes), system in zip(variants, systems):
                if repeat and not runs[system]:  # it failed every attempt at this size: a hang would cost them again
                    print(f"batch {batch:5d} {system:9s} #{repeat + 1}: not tried (every attempt at this size "
                          f"failed)", flush=True)
                    continue
                run = attempt_case(name, batch, args, processes, failures[system])
                if run is None:
                    print(f"batch {batch:5d} {system:9s} #{repeat + 1}: FAILED {args.attempts} times: "
                          f"{failures[system][-1].splitlines()[0]}", flush=True)
                    continue
                runs[system].append(run)
                gpu = "" if run["gpu_util_mean"] is None else f", GPU {run['gpu_util_mean']:.0f}% busy"
                print(f"batch {batch:5d} {system:9s} #{repeat + 1}: {run['samples_per_s']:9.0f} samples/s, "
                      f"{run['pairs_per_s']:7.1f} fwd+bwd/s, {run['failed']} failed{gpu} ({run['device']})", flush=True)
        # a side whose every attempt failed has no figure, and the case says so: the other sides' still stand
        case: dict[str, Any] = {s: {"samples_per_s": spread([r["samples_per_s"] for r in runs[s]]), "runs": runs[s],
                                    "failures": failures[s]} if runs[s] else {"failures": failures[s]}
                                for s in systems}
        measured = [s for s in systems if runs[s]]
        if "hivemind" in measured:
            theirs = case["hivemind"]["samples_per_s"]["median"]
            case["ratios"] = {s: case[s]["samples_per_s"]["median"] / theirs for s in measured if s != "hivemind"}
            if "dedloc" in case["ratios"]:
                case["ratio"] = case["ratios"]["dedloc"]
            for s, ratio in case["ratios"].items():
                print(f"batch {batch:5d}: {s} / hivemind = {ratio:.2f} (medians)", flush=True)
        cases[str(batch)] = case
    result: dict[str, Any] = {"device": args.device, "experts": args.experts, "expert_cls": args.expert_cls,
                              "hidden": args.hidden,
                              "clients": args.clients, "callers": args.callers, "seconds": args.seconds,
                              "cases": cases}
    largest = cases[str(max(batches))]
    for s in systems:
        if "samples_per_s" in largest[s]:
            result[s] = {"samples_per_s": largest[s]["samples_per_s"]["median"]}
    failed = {f"{s} at {b} rows": len(c[s]["failures"]) for b, c in cases.items() for s in systems if c[s]["failures"]}
    if failed:
        result["failed_attempts"] = failed
        print("failed attempts (each retried up to --attempts times): "
              + ", ".join(f"{k}: {v}" for k, v in failed.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if any(not c[s].get("runs") for c in cases.values() for s in systems):
        sys.exit("moe_gpu: a side has no figure for some batch (every attempt failed; see above)")


if __name__ == "__main__":
    main()
