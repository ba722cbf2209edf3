"""A GPU volunteer's view: does the swarm keep the GPU computing? One process alone, 2 peers synchronous,
2 peers with delayed parameter updates (DPU), sharing one GPU through a `dedloc relay` on loopback.

    .venv/bin/python bench/gpu_training.py [--device cuda] [--size big] [--target 2048] [--steps 5]
        [--dpu-steps 20] [--json OUT]
    .venv/bin/python bench/gpu_training.py --device cpu --size small --micro 8 --seq 64 --target 256   (on a CPU)

Each peer is bench/gpu_training_peer.py in its own process: a 168 M-parameter
transformer encoder (12 layers, d_model 1024, bf16 autocast, AdamW) on
micro-batches of --micro x --seq tokens, --target samples per global step
(the issue "Averaging at the speed of the wire, and a GPU that never waits
for the swarm"). Printed per setup: the swarm's samples/s, each peer's share
of wall time spent computing, the GPU's utilization (nvidia-smi, sampled
every 0.5 s while the setup runs), the all-reduce's time and MB/s per peer
(the gradients' float32 bytes over the round's time), the compute per
global step against the round (the issue asks for a target batch whose
compute per step is at least twice the round) and the loss of every global
step. DPU runs --dpu-steps steps (at least 20: does its loss fall like the
synchronous run's?).

``--json OUT`` writes ``allreduce_mb_per_s`` (the synchronous run's median
round), ``dpu.compute_fraction`` (the lowest peer's among those that computed:
``peers_without_measured_compute`` counts one that caught up by loading state), ``dpu.ratio_to_alone``
(DPU swarm samples/s over the single process's) and every figure above.
Goals on a GPU host: all-reduce >= 500 MB/s per peer; with DPU each peer
computes >= 90% of its wall time and the swarm reaches >= 0.8x the single
process. Nothing leaves 127.0.0.1; the whole run takes a few minutes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "bench" / "gpu_training_peer.py"
sys.path.insert(0, str(ROOT / "bench"))

from harness import Spawned, spawn_relay, stop_all  # noqa: E402


class GpuSampler:
    """nvidia-smi's utilization.gpu every 0.5 s in a thread, while a setup runs (nothing without nvidia-smi)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if shutil.which("nvidia-smi") is None:
            return
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.samples.append(float(out.split()[0]))
            except (subprocess.SubprocessError, ValueError, IndexError):
                return

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


def peer_args(args: argparse.Namespace, mode: str, steps: int, index: int) -> list[str]:
    return [sys.executable, str(PEER), "--mode", mode, "--device", args.device, "--size", args.size,
            "--micro", str(args.micro), "--seq", str(args.seq), "--target", str(args.target), "--lr", str(args.lr),
            "--steps", str(steps), "--index", str(index), "--peers", "2", "--timeout", str(args.timeout),
            *([] if args.torch_threads is None else ["--torch-threads", str(args.torch_threads)]),
            *(["--probe-memory"] if args.probe_memory and mode != "alone" else [])]


def _worker_failed(error: RuntimeError, workers: list[Spawned]) -> RuntimeError:
    """``error`` with what each worker said on stderr (its last lines) and how it ended: a worker
    that dies must say why in the bench's own failure, not in a stream nobody kept."""
    parts = [str(error)]
    for index, worker in enumerate(workers):
        try:
            worker.process.wait(timeout=5)  # one that closed its output is ending: its exit code
        except subprocess.TimeoutExpired:
            pass
        parts.append(f"-- peer {index}: exit code {worker.process.poll()}; the last of its stderr:\n{worker.said()}")
    return RuntimeError("\n".join(parts))


def run_setup(args: argparse.Namespace, mode: str, steps: int) -> dict[str, Any]:
    spawned: list[Spawned] = []
    try:
        return _run_setup(args, mode, steps, spawned, time.perf_counter())
    finally:
        stop_all(spawned)


def _run_setup(args: argparse.Namespace, mode: str, steps: int, spawned: list[Spawned], started: float) -> dict[str, Any]:
    keep = not args.verbose  # each worker's stderr: on the terminal with --verbose, else kept for a failure's message
    with GpuSampler() as gpu:
        if mode == "alone":
            workers = [Spawned(peer_args(args, mode, steps, 0), what="peer 0", keep_stderr=keep)]
        else:
            relay, boot = spawn_relay()
            spawned.append(relay)
            workers = [Spawned([*peer_args(args, mode, steps, i), "--initial-peers", boot], what=f"peer {i}",
                               keep_stderr=keep)
                       for i in range(2)]
        spawned += workers
        try:
            results = [w.wait_for("wall", args.timeout) for w in workers]
        except RuntimeError as e:
            raise _worker_failed(e, workers) from None
    wall = max(r["wall"] for r in results)
    rounds = [r for res in results for r in res["rounds"]]
    elapsed = [r["elapsed"] for r in rounds]
    grad_mb = results[0]["grad_mb"]
    # each step's loss over the peers that measured it: a peer that caught up by loading the swarm's state
    # measured none of the steps it skipped (once in CI: DPU's losses came out empty)
    losses = [statistics.mean(x for x in step if x is not None)
              for step in itertools.zip_longest(*(r["losses"] for r in results))]
    out: dict[str, Any] = {
        "samples_per_s": sum(r["samples"] for r in results) / wall,
        "compute_fractions": [r["compute"] / r["wall"] for r in results],
        # the lowest of the peers that computed: a peer that fell behind and loaded the swarm's state
        # (CollaborativeOptimizer's catch-up) may reach the last step having computed nothing
        # measured (once in CI, with 3 steps on a loaded machine); it is counted, not averaged in
        "compute_fraction": min(r["compute"] / r["wall"] for r in ([r for r in results if r["samples"]] or results)),
        "peers_without_measured_compute": sum(1 for r in results if not r["samples"]),
        "compute_per_step_s": statistics.mean(r["compute"] for r in results) / max(1, len(losses)),
        # where the rest of a step's wall went, per peer and step: making batches on the event loop, the
        # optimizer's bookkeeping after each micro-batch, and the global steps themselves (with DPU: the
        # wait for the previous round and its apply; synchronous: the round)
        "data_per_step_s": statistics.mean(r["data_s"] for r in results) / max(1, len(losses)),
        "step_calls_per_step_s": statistics.mean(r["step_calls_s"] for r in results) / max(1, len(losses)),
        "step_call_median_s": statistics.median(r["step_call_median_s"] for r in results),
        "global_step_s": statistics.mean(r["global_steps_s"] for r in results) / max(1, len(losses)),
        "micro_batch_s": statistics.median(r["micro_median_s"] for r in results),
        # the compute thread's time per micro-batch while a round runs beside it (DPU) and while none does
        "micro_in_round_s": statistics.median(r["micro_in_round_s"] for r in results),
        "micro_quiet_s": statistics.median(r["micro_quiet_s"] for r in results),
        "micro_batches_in_round": sum(r["micro_in_round"] for r in results),
        "gpu_utilization": gpu.mean, "losses": losses, "params": results[0]["params"],
        "seconds": time.perf_counter() - started, "rounds": len(rounds),
        "incomplete_rounds": sum(not r["complete"] for r in rounds),
    }
    if any("memory_probe" in r for r in results):
        out["memory_probe"] = [r.get("memory_probe") for r in results]
    if elapsed:
        out["round_s"] = statistics.median(elapsed)
        out["allreduce_mb_per_s"] = grad_mb / out["round_s"]
        out["compute_to_round"] = out["compute_per_step_s"] / out["round_s"]
    return out


def describe(name: str, r: dict[str, Any], alone: dict[str, Any] | None) -> str:
    text = (f"{name:<6} {r['samples_per_s']:8.1f} samples/s"
            + (f" ({r['samples_per_s'] / alone['samples_per_s']:.2f}x alone)" if alone and alone is not r else "")
            + ", computing " + "/".join(f"{f:.0%}" for f in r["compute_fractions"]) + " of wall"
            + (f", GPU {r['gpu_utilization']:.0f}%" if r["gpu_utilization"] is not None else "")
            + f", micro-batch {r['micro_batch_s'] * 1e3:.0f} ms"
            + (f" ({r['micro_quiet_s'] * 1e3:.0f} ms with no round in flight, {r['micro_in_round_s'] * 1e3:.0f} ms "
               f"beside one, {r['micro_batches_in_round']} such)" if r["micro_batches_in_round"] else "")
            + f", compute/step {r['compute_per_step_s']:.2f} s"
            + f"; per step outside compute: batches {r['data_per_step_s']:.2f} s, step() calls "
              f"{r['step_calls_per_step_s']:.2f} s (median {r['step_call_median_s'] * 1e3:.1f} ms), global step "
              f"{r['global_step_s']:.2f} s")
    if "round_s" in r:
        text += (f", round {r['round_s']:.2f} s = {r['allreduce_mb_per_s']:.0f} MB/s per peer "
                 f"(compute/step = {r['compute_to_round']:.1f}x the round; {r['incomplete_rounds']} of "
                 f"{r['rounds']} rounds partial)")
    losses = r["losses"]
    text += f"\n       loss by global step: {' '.join(f'{x:.2f}' for x in losses)}"
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="big", choices=("big", "small", "tiny"))
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--target", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW's learning rate")
    p.add_argument("--steps", type=int, default=5, help="measured global steps, alone and synchronous")
    p.add_argument("--dpu-steps", type=int, default=20, help="measured global steps with delayed updates")
    p.add_argument("--setups", default="alone,sync,dpu")
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--verbose", action="store_true", help="show the peers' stderr")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="each peer's torch intra-op threads (default: 1 on a CPU, torch's own on a GPU)")
    p.add_argument("--probe-memory", action="store_true",
                   help="each peer times CPU ops on pageable and page-locked chunks during a round and after "
                   "(bench/gpu_training_peer.py's memory_probe), in the figures as memory_probe")
    args = p.parse_args()
    results: dict[str, Any] = {"device": args.device, "size": args.size, "micro": args.micro, "seq": args.seq,
                               "target": args.target}
    for mode in args.setups.split(","):
        results[mode] = run_setup(args, mode, args.dpu_steps if mode == "dpu" else args.steps)
        print(describe(mode, results[mode], results.get("alone")), flush=True)
    if "sync" in results and "allreduce_mb_per_s" in results["sync"]:
        results["allreduce_mb_per_s"] = results["sync"]["allreduce_mb_per_s"]
    if "dpu" in results and "alone" in results:
        results["dpu"]["ratio_to_alone"] = results["dpu"]["samples_per_s"] / results["alone"]["samples_per_s"]
    print("\n== summary ==")
    for mode in ("alone", "sync", "dpu"):
        if mode in results:
            print(describe(mode, results[mode], results.get("alone")))
    if "allreduce_mb_per_s" in results:
        print(f"all-reduce: {results['allreduce_mb_per_s']:.0f} MB/s per peer (goal >= 500 on a GPU host)")
    if "dpu" in results:
        d = results["dpu"]
        print(f"DPU: lowest peer computes {d['compute_fraction']:.0%} of its wall time (goal >= 90%)"
              + (f", {d['ratio_to_alone']:.2f}x the single process's samples/s (goal >= 0.8)"
                 if "ratio_to_alone" in d else ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
