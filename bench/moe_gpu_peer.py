"""dedloc's side of bench/moe_gpu.py: one expert server, or one client of it (one process each).

    python bench/moe_gpu_peer.py --serve --device cuda --experts 16 --hidden 1024
    python bench/moe_gpu_peer.py --client '<the server's JSON line>' --batch 1024 --callers 4 --seconds 15

--serve: a peer on 127.0.0.1 hosting --experts experts of --expert-cls (ffn: FeedforwardBlock, hivemind's
ffn; nop: the serving stack alone) of --hidden on --device, each with Adam (with --shard I/N, every N-th
of them from the I-th, as process I of `dedloc serve-experts --processes N` does), batched by
ExpertServer up to --max-batch rows; prints its peer id, addresses and uids as one JSON line, then
serves until killed. --client (one server's line, or a JSON list of the lines of a sharded server's
processes): a peer with an ExpertClient; --callers threads each run forward and backward of --batch
rows through RemoteExpert, to the experts in turn. It warms up (one call per expert), prints
``{"ready": ...}``, waits for a line on stdin, calls for --seconds and prints
``{"pairs": ..., "elapsed_s": ..., "failed": ...}``.

``DEDLOC_BENCH_PROFILE=DIR`` (--serve only): the server's event loop runs under cProfile, its
statistics written to DIR/server-<pid>.prof every 2 s (the bench kills the server without notice).
Only the loop's thread is profiled: the batches' torch work runs in a worker thread.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import sys
import time
from pathlib import Path

import torch
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from libp2p.peer.id import ID  # noqa: E402
from multiaddr import Multiaddr  # noqa: E402

from nat import Peer, PeerConfig  # noqa: E402
from p2p.dht import DHTConfig, DHTMode  # noqa: E402
from training.moe import (Expert, ExpertCallError, ExpertClient, ExpertServer, RemoteExpert,  # noqa: E402
                          ServerConfig)
from training.moe.cli import build_backends  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from moe_common import call_loop, server_parser  # noqa: E402


def config(server: bool) -> PeerConfig:
    """A loopback peer (PeerConfig.loopback) without autorelay or peer exchange: nothing but the bench's work."""
    c = PeerConfig.loopback()
    c.nat.autorelay.enabled = False
    c.dht = DHTConfig(mode=DHTMode.SERVER if server else DHTMode.CLIENT)
    c.exchange_interval = None
    return c


async def serve(args: argparse.Namespace) -> None:
    index, count = (int(n) for n in args.shard.split("/"))
    # the experts `serve-experts --expert-pattern ffn.0.[0:E] --processes N` hosts in process I, built by its code
    backends = build_backends(argparse.Namespace(
        expert_pattern=f"ffn.0.[0:{args.experts}]", shard=[index, count], expert_cls=args.expert_cls,
        hidden_dim=args.hidden, lr=1e-4, device=args.device, seed=0, threads=0))
    uids = [str(b.uid) for b in backends]
    server_config = ServerConfig(max_batch_size=args.max_batch, max_request_rows=args.max_batch)
    async with Peer.open(config(server=True)) as peer, ExpertServer.open(peer, backends, server_config):
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
        print(json.dumps({"peer_id": peer.peer_id.to_base58(), "addrs": [str(a) for a in peer.addrs],
                          "device_name": name, "uids": uids, "module": type(backends[0].module).__name__}),
              flush=True)
        if folder := os.environ.get("DEDLOC_BENCH_PROFILE"):
            await profile_loop(Path(folder) / f"server-{os.getpid()}.prof")
        await trio.sleep_forever()


async def profile_loop(path: Path) -> None:
    """Profile this thread (the event loop) from now on, writing the statistics so far every 2 s."""
    profile = cProfile.Profile()
    profile.enable()
    while True:
        await trio.sleep(2.0)
        profile.dump_stats(path)  # stops the profile to take its statistics
        profile.enable()


async def client_main(args: argparse.Namespace) -> None:
    servers = json.loads(args.client)  # one server's line, or a list of them (--shard: each hosts its uids)
    hosts = {uid: (ID.from_base58(s["peer_id"]), tuple(Multiaddr(a) for a in s["addrs"]))
             for s in (servers if isinstance(servers, list) else [servers]) for uid in s["uids"]}
    async with Peer.open(config(server=False)) as peer, ExpertClient.open(peer) as client:
        experts = [RemoteExpert(client, Expert(f"ffn.0.{j}", *hosts[f"ffn.0.{j}"])) for j in range(args.experts)]
        for expert in experts:  # warm-up: the connection, each expert's first batch
            x = torch.randn(args.batch, args.hidden, requires_grad=True)
            await client.run(lambda: expert(x).sum().backward())
        print(json.dumps({"ready": args.index}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        pairs, failed = [0] * args.callers, [0] * args.callers
        stop_at = time.perf_counter() + args.seconds

        def caller(i: int) -> None:
            x = torch.randn(args.batch, args.hidden, requires_grad=True)
            pairs[i], failed[i] = call_loop(lambda turn: experts[turn % len(experts)](x).sum().backward(),
                                            args.index * args.callers + i, stop_at, (ExpertCallError,))

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(args.callers):
                nursery.start_soon(client.run, caller, i)
        print(json.dumps({"pairs": sum(pairs), "failed": sum(failed), "elapsed_s": time.perf_counter() - t0}),
              flush=True)


def main() -> None:
    p = server_parser()
    args = p.parse_args()
    if args.client or args.threads:
        torch.set_num_threads(1 if args.client else args.threads)
    trio.run(serve if args.serve else client_main, args)


if __name__ == "__main__":
    main()
