"""Compression in the group all-reduce: bytes on the wire and the error against the exact average.

    .venv/bin/python bench/compression.py [--peers 3] [--matrices 4] [--dim 1024] [--rank 8] [--steps 5] [--json OUT]

Peers on 127.0.0.1 in one process (a relay/bootstrap node and --peers
averaging peers) average gradient-like tensors: --matrices matrices of
--dim x --dim with decaying singular values (0.97^i, as gradients of dense
layers tend to have) and as many bias vectors, differently per peer. Each
codec runs --steps rounds on the same tensors:

  none, float16, uint8  the chunk codecs (per tensor; the biases stay float32)
  powersgd-rR           PowerSGD of rank R with error feedback (float32 factors)
  powersgd-rR+float16   the same, the factors sent as float16

and prints, per peer and round, the bytes sent plus received, against a plain
float32 round, and two errors relative to the exact weighted average:
``error`` of one round (||avg' - avg|| / ||avg||) and, for PowerSGD,
``deficit`` after --steps rounds of the same gradients (what error feedback
has not yet delivered, ||k avg - sum avg'|| / ||k avg||).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from averaging_peer import peer_config  # noqa: E402

from averaging import AllreduceConfig, Averager, AveragerConfig, Compression, MatchmakingConfig  # noqa: E402
from averaging.powersgd import PowerSGD, PowerSGDConfig  # noqa: E402
from nat import Peer  # noqa: E402
from p2p.hooks import Reachability  # noqa: E402


def gradients(peers: int, matrices: int, dim: int, seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    spectrum = torch.tensor([0.97**i for i in range(dim)])
    out = []
    for _ in range(peers):
        tensors = []
        for _ in range(matrices):
            u = torch.linalg.qr(torch.randn(dim, dim, generator=generator)).Q
            v = torch.linalg.qr(torch.randn(dim, dim, generator=generator)).Q
            tensors.append((u * spectrum) @ v.t())
        tensors += [torch.randn(dim, generator=generator) for _ in range(matrices)]
        out.append(tensors)
    return out


def relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x.double() - y.double()).norm() ** 2) for x, y in zip(a, b))
    den = sum(float(y.double().norm() ** 2) for y in b)
    return (num / den) ** 0.5


async def run_codec(peers: list[Peer], name: str, data: list[list[torch.Tensor]], weights: list[float],
                    exact: list[torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    powersgd = name.startswith("powersgd")
    codec = Compression.FLOAT16 if name.endswith("float16") else Compression.NONE if powersgd else Compression(name)
    config = AveragerConfig(
        prefix=f"bench-{name}",
        matchmaking=MatchmakingConfig(target_size=len(peers), min_size=len(peers), gather_time=0.5, timeout=30.0),
        allreduce=AllreduceConfig(compression=codec, min_compress_elements=4096, timeout=120.0),
        adaptive=False,
    )
    plain_bytes = 4 * sum(t.numel() for t in data[0])
    rows: list[dict[str, float]] = []
    applied = [torch.zeros_like(t, dtype=torch.float64) for t in exact]
    async with AsyncExitStack() as stack:
        averagers = [await stack.enter_async_context(Averager.open(p, config)) for p in peers]
        compressors = [PowerSGD(a, [t.shape for t in data[0]], PowerSGDConfig(rank=args.rank)) for a in averagers]
        for _ in range(args.steps):
            tensors = [[t.clone() for t in d] for d in data]
            moved = [0] * len(peers)
            started = time.perf_counter()

            async def one(i: int) -> None:
                if powersgd:
                    report = await compressors[i].step(tensors[i], weights[i])
                else:
                    report = await averagers[i].step(tensors[i], weights[i])  # type: ignore[assignment]
                moved[i] = report.bytes_sent + report.bytes_received

            async with trio.open_nursery() as nursery:
                for i in range(len(peers)):
                    nursery.start_soon(one, i)
            seconds = time.perf_counter() - started
            for k, t in enumerate(tensors[0]):
                applied[k] += t.double()
            rows.append({"seconds": seconds, "bytes_per_peer": sum(moved) / len(moved),
                         "error": relative(tensors[0], exact)})
    steps = len(rows)
    deficit = relative([a / steps for a in applied], exact)
    result = {
        "bytes_per_peer": min(r["bytes_per_peer"] for r in rows),
        "plain_round_bytes_per_peer": 2 * plain_bytes * (len(peers) - 1) / len(peers),
        "error_min": min(r["error"] for r in rows),
        "error_median": sorted(r["error"] for r in rows)[steps // 2],
        "deficit_after_steps": deficit,
        "seconds_min": min(r["seconds"] for r in rows),
        "seconds_median": sorted(r["seconds"] for r in rows)[steps // 2],
    }
    result["ratio_to_plain"] = result["bytes_per_peer"] / result["plain_round_bytes_per_peer"]
    return result


async def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    data = gradients(args.peers, args.matrices, args.dim, args.seed)
    weights = [1.0 + i for i in range(args.peers)]
    exact = [sum(w * d[k].double() for w, d in zip(weights, data)) / sum(weights) for k in range(len(data[0]))]
    codecs = ["none", "float16", "uint8", f"powersgd-r{args.rank}", f"powersgd-r{args.rank}+float16"]
    out: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(Peer.open(peer_config("/ip4/127.0.0.1/tcp/0", [], True)))
        initial = [str(boot.addrs[0])]
        peers = [await stack.enter_async_context(Peer.open(peer_config("/ip4/127.0.0.1/tcp/0", initial, False)))
                 for _ in range(args.peers)]
        with trio.fail_after(60):
            while not all(p.node.reachability is Reachability.PUBLIC for p in peers):
                await trio.sleep(0.2)
        for name in codecs:
            out[name] = await run_codec(peers, name, data, weights, exact, args)
            r = out[name]
            print(f"{name:<22} {r['bytes_per_peer'] / 1e6:8.2f} MB/peer ({r['ratio_to_plain']:.3f} of plain)  "
                  f"error {r['error_median']:.2e}  deficit after {args.steps} {r['deficit_after_steps']:.2e}  "
                  f"{r['seconds_min']:.2f}/{r['seconds_median']:.2f} s min/median", flush=True)
    return out


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--matrices", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    logging.basicConfig(level=logging.ERROR)  # py-libp2p logs every failed dial of a closed peer's port
    print(f"compression: {arguments.peers} peers on 127.0.0.1, {arguments.matrices} matrices of "
          f"{arguments.dim}x{arguments.dim} (singular values 0.97^i) and {arguments.matrices} biases, "
          f"{arguments.steps} rounds per codec", flush=True)
    results = trio.run(main, arguments)
    if arguments.json:
        arguments.json.write_text(json.dumps({"compression": results}, indent=2))
