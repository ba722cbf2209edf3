"""dedloc's side of bench/moe.py: one process, a swarm of expert servers on loopback, one JSON line out.

    .venv/bin/python bench/moe_peer.py --experts 64 [--servers 20] [--dead 0.1] [--searches 40]
        [--hidden 256] [--batch 64] [--seconds 5] [--callers 4]

1. Search: a bootstrap node and --servers server peers declare --experts experts on a square grid
   (8x8 for 64, 16x16 for 256); the servers holding --dead of the experts then stop (their records
   stay in the DHT until they expire). A client peer runs --searches beam searches (batch 16, k 4,
   random gate scores): cold (a new searcher each time, on a client whose DHT keeps no copies: every
   prefix read over the network) and warm (one searcher, its cache of live prefixes).
2. Calls: one server peer (its own process, as hivemind's Server) hosts 4 --expert-cls experts of --hidden; --callers threads each run forward and
   backward of --batch rows through RemoteExpert for --seconds.
3. Faults: calls with a 0.5 s timeout to an expert that never answers (a server process of its own),
   the last one killed (SIGKILL) in the middle of the call: how many ended past their timeout (+0.25 s).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import torch
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from libp2p.peer.id import ID  # noqa: E402
from multiaddr import Multiaddr  # noqa: E402

from nat import Peer, PeerConfig  # noqa: E402
from p2p.collector import PauseRecorder, settle  # noqa: E402
from p2p.dht import DHTConfig, DHTMode  # noqa: E402
from training.moe import (ClientConfig, Expert, ExpertBackend, ExpertCallError, ExpertClient,  # noqa: E402
                          ExpertServer, RemoteExpert, ServerConfig)
from training.moe.beam_search import BeamSearcher  # noqa: E402
from training.moe.experts import FeedforwardBlock, Identity  # noqa: E402
from training.moe.grid import ExpertUid  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from harness import first_json, python_argv  # noqa: E402
from moe_common import assignment, parser, percentile, search_figures  # noqa: E402

SLACK = 0.25


def config(boot: list[str], server: bool = False, cache: bool = True) -> PeerConfig:
    """A loopback peer (PeerConfig.loopback) without autorelay or peer exchange: nothing but the bench's work."""
    c = PeerConfig.loopback(initial_peers=boot)
    c.nat.autorelay.enabled = False
    c.dht = DHTConfig(mode=DHTMode.SERVER if server else DHTMode.CLIENT, bootstrap_timeout=20.0, cache=cache)
    c.exchange_interval = None
    return c


class Hang(torch.nn.Module):
    """An expert that never answers (its forward sleeps longer than any caller waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            time.sleep(3.0)
        return x * self.w


async def main() -> None:
    p = parser()
    p.add_argument("--serve", choices=("calls", "hang"), help="(internal) be one server process")
    p.add_argument("--boot", nargs="*", default=[])
    p.add_argument("--gc", choices=("settle", "default"), default="settle",
                   help="settle: the commands' policy (p2p.collector.settle once the peers are up); default: CPython's")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.serve:
        await serve(args)
        return
    side, plan = assignment(args)
    result: dict[str, object] = {"experts": side * side, "servers": len(plan),
                                 "dead_experts": sum(len(c) for dead, c in plan if dead)}
    async with AsyncExitStack() as stack:
        boot_peer = await stack.enter_async_context(Peer.open(config([], server=True)))
        boot = [str(boot_peer.addrs[0])]
        nursery = await stack.enter_async_context(trio.open_nursery())
        setup = time.perf_counter()

        async def host(share: list[ExpertUid], scope: trio.CancelScope, *,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                async with Peer.open(config(boot, server=True)) as peer:
                    backends = [ExpertBackend(str(u), Identity(4), None, (4,)) for u in share]
                    async with ExpertServer.open(peer, backends, ServerConfig(update_period=300, expiration=900)):
                        task_status.started()
                        await trio.sleep_forever()

        dead_scopes = []
        for dead, coords in plan:
            scope = trio.CancelScope()
            await nursery.start(host, [ExpertUid("ffn", c) for c in coords], scope)
            if dead:
                dead_scopes.append(scope)
        for scope in dead_scopes:
            scope.cancel()  # their records stay in the DHT
        await trio.sleep(1.0)
        result["setup_s"] = time.perf_counter() - setup

        client_peer = await stack.enter_async_context(Peer.open(config(boot)))
        client = await stack.enter_async_context(ExpertClient.open(client_peer))
        gen = torch.Generator().manual_seed(1)

        def scores() -> list[torch.Tensor]:
            return [torch.randn(16, side, generator=gen), torch.randn(16, side, generator=gen)]

        async def timed(searcher: BeamSearcher) -> tuple[float, int]:
            t0 = time.perf_counter()
            beams = await searcher.search(scores(), k=4, beam_size=4)
            return (time.perf_counter() - t0) * 1e3, sum(len(b) for b in beams)

        # cold: a client whose DHT keeps no copies of what it read, and a new searcher each time
        cold_peer = await stack.enter_async_context(Peer.open(config(boot, cache=False)))
        cold, warm, found = [], [], []
        await timed(BeamSearcher(cold_peer.dht, "ffn", (side, side)))  # its connections
        if args.gc == "settle":
            settle()
        pauses = stack.enter_context(PauseRecorder())  # from here on: the measured part
        for _ in range(args.searches):
            ms, n = await timed(BeamSearcher(cold_peer.dht, "ffn", (side, side)))
            cold.append(ms)
            found.append(n)
        searcher = BeamSearcher(client_peer.dht, "ffn", (side, side), cache_ttl=300)
        await timed(searcher)
        for _ in range(args.searches):
            warm.append((await timed(searcher))[0])
        result["search"] = search_figures(cold, warm, found)
        result["search_p99_ms"] = percentile(cold, 99)

        # ---- calls per second: one server of 4 experts, in its own process (as hivemind's Server)
        calls_server, calls_at = await serve_in_process("calls", boot, args)
        experts = [RemoteExpert(client, Expert(f"calls.0.{j}", *calls_at)) for j in range(4)]
        stop_at = time.perf_counter() + args.seconds
        steps = [0] * args.callers

        def caller(i: int) -> None:
            x = torch.randn(args.batch, args.hidden, requires_grad=True)
            while time.perf_counter() < stop_at:
                experts[(i + steps[i]) % 4](x).sum().backward()
                steps[i] += 1

        for i in range(args.callers):  # warm-up: the connection, the first batches
            await client.run(lambda: experts[i % 4](torch.randn(2, args.hidden)))
        t0 = time.perf_counter()
        stop_at = t0 + args.seconds
        async with trio.open_nursery() as callers:
            for i in range(args.callers):
                callers.start_soon(client.run, caller, i)
        elapsed = time.perf_counter() - t0
        total = sum(steps)
        result["calls"] = {"forward_backward_per_s": total / elapsed, "calls_per_s": 2 * total / elapsed,
                           "samples_per_s": total * args.batch / elapsed}
        result["calls_per_s"] = 2 * total / elapsed

        calls_server.kill()
        # ---- faults: an expert that never answers (its own process); that process killed mid-call
        past = 0
        ends = []
        hang_server, hang_at = await serve_in_process("hang", boot, args)
        fast = ExpertClient(client_peer, ClientConfig(forward_timeout=0.5, ban_time=0.01), client._token)
        expert = Expert("hang.0.0", *hang_at)
        for attempt in range(10):
            if attempt == 9:
                nursery.start_soon(_kill_after, hang_server, 0.2)  # the server dies in the middle of the call
            t0 = time.perf_counter()
            try:
                await fast.forward(expert, torch.ones(2, 4))
            except ExpertCallError:
                pass
            took = time.perf_counter() - t0
            ends.append(took)
            past += took > 0.5 + SLACK
        result["faults"] = {"calls": len(ends), "timeout_s": 0.5, "max_s": max(ends), "median_s": statistics.median(ends),
                            "each_s": [round(t, 3) for t in ends]}  # in order: the last one's server was killed
        result["calls_past_timeout"] = past
        result["gc"] = {"policy": args.gc, **pauses.figures(),
                        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        nursery.cancel_scope.cancel()
    print(json.dumps(result), flush=True)


async def _kill_after(process: trio.Process, delay: float) -> None:
    await trio.sleep(delay)
    process.kill()  # SIGKILL: a crash, no goodbye


async def serve_in_process(kind: str, boot: list[str], args: argparse.Namespace
                           ) -> tuple[trio.Process, tuple[ID, tuple[Multiaddr, ...]]]:
    """This script with ``--serve KIND``: a server peer in its own process, and where it is."""
    process = await trio.lowlevel.open_process(python_argv(
        [sys.executable, __file__, "--serve", kind, "--boot", *boot, "--hidden", str(args.hidden), "--expert-cls",
         args.expert_cls, "--gc", args.gc]), stdout=subprocess.PIPE)
    info = await first_json(process, f"the {kind} server")
    return process, (ID.from_base58(info["peer_id"]), tuple(Multiaddr(a) for a in info["addrs"]))


async def serve(args: argparse.Namespace) -> None:
    """--serve calls: 4 experts of --expert-cls; --serve hang: one that never answers a batch of 2+ rows."""
    torch.manual_seed(0)
    if args.serve == "calls":
        backends = []
        for j in range(4):
            module = FeedforwardBlock(args.hidden) if args.expert_cls == "ffn" else Identity(args.hidden)
            backends.append(ExpertBackend(f"calls.0.{j}", module, torch.optim.Adam(module.parameters(), 1e-4),
                                          (args.hidden,)))
    else:
        backends = [ExpertBackend("hang.0.0", Hang(), None, (4,))]
    async with Peer.open(config(args.boot, server=True)) as peer, ExpertServer.open(peer, backends):
        if args.gc == "settle":
            settle()
        print(json.dumps({"peer_id": peer.peer_id.to_base58(), "addrs": [str(a) for a in peer.addrs]}), flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main)
