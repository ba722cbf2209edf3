"""What sealing on worker threads costs and frees, on this machine: the facts behind
``p2p.noise.crypto_threads_for`` and ``NoiseConfig.offload_bytes``.

    .venv/bin/python bench/noise_threads.py [--sizes 256,1024,4096] [--threads 0,1,2,4] [--writes 100] [--json OUT]

In one process, with nothing else running: for each write size (KiB) and number of crypto threads,
``--writes`` writes sealed through a :class:`p2p.noise.CryptoPool` one after another (as one
connection's writes go, under its send lock), best of 5 rounds. Printed per case: the latency of
one write (what a connection's writes wait, in series) and the CPU the event loop's own thread
spent per write (``time.thread_time``: what the loop is left to do while the threads seal; with 0
threads it is the whole seal). A thread pays where the loop's CPU per write falls by more than the
rest of the node needs the core for; a connection's rate is bounded by size / latency.
Nothing is sent anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p.noise import MAX_MESSAGE, CryptoPool, NoiseCodec, NoiseConfig, process_cores  # noqa: E402


async def case(size: int, threads: int, writes: int) -> dict[str, float]:
    pool = CryptoPool(NoiseConfig(crypto_threads=threads, offload_bytes=MAX_MESSAGE))
    codec = NoiseCodec(bytes(32), bytes(range(32)))
    data = os.urandom(size)
    best: dict[str, float] = {}
    for _ in range(5):
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(writes):
            sealing = codec.plan_seal(data)
            await pool.run(sealing.seal, sealing.count, sealing.size)
        wall, cpu = (time.perf_counter() - wall) / writes, (time.thread_time() - cpu) / writes
        if not best or wall < best["latency_us"] / 1e6:
            best = {"latency_us": wall * 1e6, "loop_cpu_us": cpu * 1e6, "mb_per_s": size / wall / 1e6}
    return best


async def run(args: argparse.Namespace) -> dict[str, object]:
    cases = []
    for kib in (int(x) for x in args.sizes.split(",")):
        for threads in (int(x) for x in args.threads.split(",")):
            figures = await case(kib * 1024, threads, args.writes)
            cases.append({"kib": kib, "threads": threads, **figures})
            print(f"{kib:6d} KiB, {threads} threads: {figures['latency_us']:7.0f} us a write "
                  f"({figures['mb_per_s']:5.0f} MB/s in series), loop CPU {figures['loop_cpu_us']:6.0f} us a write",
                  flush=True)
    cores = process_cores()
    results = {"cores": cores, "chosen_threads": NoiseConfig().threads(), "cases": cases}
    print(f"{cores} cores to use; a node here chooses {results['chosen_threads']} crypto threads")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,1024,4096", help="write sizes, KiB")
    p.add_argument("--threads", default="0,1,2,4")
    p.add_argument("--writes", type=int, default=100)
    p.add_argument("--json", type=Path, help="write every figure here")
    trio.run(run, p.parse_args())


if __name__ == "__main__":
    main()
