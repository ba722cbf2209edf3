"""All-reduce at the speed of the wire? dedloc's group all-reduce against the Node's own data plane
and torch.distributed's gloo, on loopback, in one run.

    .venv/bin/python bench/allreduce_speed.py [--peers 2,4,8] [--mbytes 40,400] [--rounds 3] [--json OUT]

Three measurements, each in processes of their own (one per peer, as in real use):

- data plane: one Node stream's bulk throughput to a Node in another process
  (``bench/throughput.py``: TCP + Noise + Yamux), MB/s; where the nodes seal and open
  on worker threads (``--crypto-threads``, by default chosen by the cores:
  ``p2p.noise.crypto_threads_for``), the faster of the stream with and without them;
- dedloc: N peers (``bench/averaging_peer.py``, unshaped, the driver of
  ``bench/averaging.py``) averaging S MB of float32 through a boot node;
  the round's time is the slowest member's all-reduce (matchmaking apart),
  min/median over ``--rounds`` after one warm-up round; each result is
  checked against the exact weighted average (every ``--check-stride``-th
  value for the 400 MB case);
- gloo: N processes of ``torch.distributed`` (TCP loopback, no encryption,
  the tool a trusted cluster would use) all-reducing the same S MB.

Per peer, "bytes averaged per second" is S / round time: what a peer's
tensors gain per second. The issue's goals ("Averaging at the speed of the
wire"): 2 peers reach >= 0.5 of the data plane (``two_peers.ratio_to_data_plane``,
40 MB), and 4 peers average 40 MB in <= 0.3 s on the 2-core machine
(``four_peers_40mb.seconds``). ``--json OUT`` writes every figure.
Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

from harness import Spawned, free_port, run_json, stop_all  # noqa: E402

from p2p.noise import NoiseConfig  # noqa: E402


def _driver() -> Any:
    """bench/averaging.py as a module (its file name would hide the averaging package if imported plainly)."""
    spec = importlib.util.spec_from_file_location("averaging_bench", BENCH / "averaging.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["averaging_bench"] = module
    spec.loader.exec_module(module)
    return module


def data_plane(mib: int, crypto: list[str]) -> float:
    """One Node stream's throughput to a Node in another process, MB/s (``crypto``: the nodes' ``--crypto-threads``)."""
    result = run_json([sys.executable, BENCH / "throughput.py", "--mib", str(mib), "--streams", "1", "--no-relay",
                       "--json", *crypto], timeout=300, what="bench/throughput.py")
    return float(result["node_1"])


def crypto_args(args: argparse.Namespace) -> list[str]:
    """``--crypto-threads N`` for a worker, when the run sets it (else each process chooses by its cores)."""
    return [] if args.crypto_threads is None else ["--crypto-threads", str(args.crypto_threads)]


def gloo(peers: int, mbytes: float, rounds: int) -> dict[str, float]:
    """``peers`` gloo processes all-reducing ``mbytes`` MB: min/median seconds of the slowest rank."""
    port = free_port()
    ranks = [Spawned([sys.executable, __file__, "--gloo-rank", str(r), "--gloo-world", str(peers),
                      "--gloo-port", str(port), "--gloo-elements", str(int(mbytes * 1e6 / 4)), "--rounds", str(rounds)],
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(peers)]
    try:
        times = [rank.wait_for("times", 600)["times"] for rank in ranks]
    finally:
        stop_all(ranks, grace=5)
    slowest = [max(ts) for ts in zip(*times)]
    return {"min_s": min(slowest), "median_s": statistics.median(slowest)}


def gloo_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=args.gloo_rank,
                            world_size=args.gloo_world, timeout=__import__("datetime").timedelta(seconds=120))
    x = torch.randn(args.gloo_elements)
    dist.all_reduce(x)  # warm-up: connections and buffers
    times = []
    for _ in range(args.rounds):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    dist.destroy_process_group()
    print(json.dumps({"times": times}))


async def dedloc(driver: Any, peers: int, mbytes: float, args: argparse.Namespace) -> dict[str, Any]:
    run_args = argparse.Namespace(
        rounds=args.rounds, warmup=1, gather_time=2.0, timeout=120.0, log_dir=args.log_dir, link_trace=False,
        chunk_elements=None, max_chunks_ahead=None,
        worker_extra=["--check-stride", str(max(1, int(mbytes * 1e6 / 4 / 2_000_000))), *crypto_args(args),
                      "--device", args.device, "--torch-threads", str(args.torch_threads)])
    system = driver.SYSTEMS["dedloc"]
    return dict(await driver.timed_rounds(system, [driver.PeerSpec()] * peers, run_args, mbytes,
                                          f"{peers} peers {mbytes:g} MB", False))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    driver = _driver()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    # The reference is the faster of one stream on the loop and one with the round's crypto threads:
    # a single stream gains nothing from handing its sealing to a thread (nothing else is waiting on its
    # loop), so a slower threaded stream must not lower the bar the round is measured against.
    threads = NoiseConfig(crypto_threads=args.crypto_threads).threads()
    planes = {0: await trio.to_thread.run_sync(data_plane, args.data_plane_mib, ["--crypto-threads", "0"])
              if args.data_plane_mib else float("nan")}
    if threads and args.data_plane_mib:
        planes[threads] = await trio.to_thread.run_sync(data_plane, args.data_plane_mib, ["--crypto-threads", str(threads)])
    plane = max(planes.values())
    print("data plane: one Node stream " + ", ".join(f"{v:.0f} MB/s with {k} crypto threads" for k, v in planes.items())
          + f"; the round's nodes use {threads}", flush=True)
    results: dict[str, Any] = {"data_plane_mb_per_s": plane, "data_plane_by_crypto_threads": planes,
                               "crypto_threads": threads, "cases": []}
    for mbytes in [float(x) for x in args.mbytes.split(",")]:
        for peers in [int(x) for x in args.peers.split(",")]:
            ours = await dedloc(driver, peers, mbytes, args)
            theirs = await trio.to_thread.run_sync(gloo, peers, mbytes, args.rounds) if not args.no_gloo else {}
            case: dict[str, Any] = {"peers": peers, "mbytes": mbytes, "dedloc": ours, "gloo": theirs}
            if "median_s" in ours:
                case["seconds"] = ours["median_s"]
                case["mb_per_s"] = mbytes / ours["median_s"]
                case["ratio_to_data_plane"] = case["mb_per_s"] / plane
                if theirs:
                    case["ratio_to_gloo"] = ours["median_s"] / theirs["median_s"]
            results["cases"].append(case)
            print(line(case), flush=True)
    sizes = [float(x) for x in args.mbytes.split(",")]
    two_mb = 40.0 if 40.0 in sizes else sizes[0]  # the goal's size when measured
    for name, peers, mbytes in (("two_peers", 2, two_mb), ("four_peers_40mb", 4, 40.0)):
        found = [c for c in results["cases"] if c["peers"] == peers and c["mbytes"] == mbytes and "seconds" in c]
        if found:
            results[name] = {k: found[0][k] for k in ("mbytes", "seconds", "mb_per_s", "ratio_to_data_plane")}
    return results


def line(case: dict[str, Any]) -> str:
    ours, theirs = case["dedloc"], case["gloo"]
    head = f"{case['peers']} peers {case['mbytes']:>5g} MB: "
    if "median_s" not in ours:
        return head + f"dedloc FAILED {ours.get('failures')}"
    text = (head + f"dedloc min {ours['min_s']:.3f} / median {ours['median_s']:.3f} s = {case['mb_per_s']:.0f} MB/s "
            f"per peer ({case['ratio_to_data_plane']:.2f} of the data plane), max error {ours['max_error']:.1e}")
    if theirs:
        text += f"; gloo min {theirs['min_s']:.3f} / median {theirs['median_s']:.3f} s ({case['ratio_to_gloo']:.1f}x)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="2,4,8")
    parser.add_argument("--mbytes", default="40,400")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-plane-mib", type=int, default=256, help="0: no data-plane measurement")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--device", default="cpu", help="where each dedloc peer's tensor lives (cuda: staged from the GPU)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="each dedloc peer's torch intra-op threads (0: torch's own, one per core)")
    parser.add_argument("--crypto-threads", type=int, default=None,
                        help="every dedloc node's NoiseConfig.crypto_threads, the data plane's too (default: by the cores)")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/dedloc-bench-allreduce-speed"))
    parser.add_argument("--json", type=Path)
    for name in ("rank", "world", "port", "elements"):
        parser.add_argument(f"--gloo-{name}", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_rank >= 0:
        gloo_rank(args)
        return
    results = trio.run(run, args)
    print("\n== summary (per peer: S / round time; data plane: one Node stream) ==")
    for case in results["cases"]:
        print(line(case))
    for name in ("two_peers", "four_peers_40mb"):
        if name in results:
            r = results[name]
            print(f"{name}: {r['seconds']:.3f} s, {r['ratio_to_data_plane']:.2f} of the data plane")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
