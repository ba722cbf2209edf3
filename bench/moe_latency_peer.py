"""An asynchronous DMoE trainer for bench/moe_latency.py (or the same model in one process, ``--local``).

    .venv/bin/python bench/moe_latency_peer.py --initial-peers MADDR [--concurrency 64] [--seconds 20]
    .venv/bin/python bench/moe_latency_peer.py --local [--seconds 20]
    .venv/bin/python bench/moe_latency_peer.py --initial-peers MADDR --raw   (the exchanges alone, see raw())

The model: rows of --hidden -> a mixture of the k_best=4 best of 16 ffn experts (grid 4x4, gate
trained with the rest) -> MSE against a fixed random target. With ``--initial-peers`` the experts
are the ones `dedloc serve-experts` hosts (ffn, same hidden), called over the swarm; the trainer is
asynchronous (Learning@home 3.2): --concurrency batches in flight at once, each thread running
forward and backward of its own batch and stepping the shared gate. ``--local``: the same 16 ffn
experts and gate in this process (the mixture computed locally, one loop, torch on every core).
Prints one JSON line: samples/s over --seconds after --warmup seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from pathlib import Path

import torch
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.moe.experts import FeedforwardBlock  # noqa: E402

GRID = (4, 4)
K = 4


class Counter:
    """Samples of the steps that end inside the measured window [start, stop]. Where none ends
    inside it (a swamped machine whose steps outlast a short window: the one-process figure read
    0 samples/s in a CI run of 3 s), the first that ends after it counts, over the time it took, and
    the steps go on up to ``GRACE`` s more for it: a slow figure, never 0 or a division by 0."""

    GRACE = 60.0

    def __init__(self, start: float, stop: float) -> None:
        self.start, self.stop = start, stop
        self.samples = 0
        self.last = stop
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        now = time.perf_counter()
        if now < self.start:
            return
        with self.lock:
            if now <= self.stop or self.samples == 0:
                self.samples += n
                self.last = max(self.stop, now)

    def measuring(self) -> bool:
        """Whether steps should go on: the window is open, or nothing ended in it yet (within GRACE)."""
        now = time.perf_counter()
        return now < self.stop or (self.samples == 0 and now < self.stop + self.GRACE)

    @property
    def rate(self) -> float:
        """Samples per second over the window (or over the time the late step needed)."""
        return self.samples / (self.last - self.start)

    def run(self, step: Callable[[], None], batch: int, errors: tuple[type[Exception], ...] = ()) -> int:
        """``step`` until the measurement ends, counting its samples; how many raised one of ``errors``."""
        failed = 0
        while self.measuring():
            try:
                step()
                self.add(batch)
            except errors:
                failed += 1
        return failed


def stepper(shared: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.nn.Module, torch.Tensor,
                                                                             torch.Tensor], None]:
    """The step of many threads sharing ``shared``'s parameters: each thread computes on a replica of
    its own, loaded from the shared parameters before the step (threads that share tensors an
    optimizer updates in place, or one .grad, break autograd; torch.func.functional_call swaps
    attributes of one module, so it cannot serve threads at once either), then one at a time puts
    its gradients on the shared parameters and steps (Hogwild, the update under a lock). Only the
    local parameters (the gate) are copied: the experts are remote."""
    lock = threading.Lock()

    def step(replica: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
        with lock, torch.no_grad():
            for mine, theirs in zip(replica.parameters(), shared.parameters()):
                mine.copy_(theirs)
        replica.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(replica(x), target).backward()
        with lock:
            for mine, theirs in zip(replica.parameters(), shared.parameters()):
                theirs.grad = mine.grad
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def local(args: argparse.Namespace) -> dict[str, float]:
    """The same mixture in one process: one training loop, torch using every core it may use (a
    container's quota, not the host's count: 64 threads on 2 cores' quota spin in each other's way)."""
    from p2p.noise import process_cores

    torch.set_num_threads(process_cores())
    experts = torch.nn.ModuleList(FeedforwardBlock(args.hidden) for _ in range(GRID[0] * GRID[1]))
    gate = torch.nn.Linear(args.hidden, sum(GRID))
    target = torch.randn(args.batch, args.hidden)
    opt = torch.optim.SGD([*gate.parameters(), *experts.parameters()], lr=1e-3)
    t0 = time.perf_counter()
    counter = Counter(t0 + args.warmup, t0 + args.warmup + args.seconds)

    def step() -> None:
        x = torch.randn(args.batch, args.hidden)
        s0, s1 = gate(x).split(GRID, dim=-1)
        scores = (s0[:, :, None] + s1[:, None, :]).flatten(1)  # [B, 16]: every expert's score
        top, index = scores.topk(K, dim=1)
        weights = torch.softmax(top, dim=1)
        out = torch.zeros_like(x)
        for e in range(len(experts)):
            rows, slot = (index == e).nonzero(as_tuple=True)
            if len(rows):
                out = out.index_add(0, rows, weights[rows, slot, None] * experts[e](x[rows]))
        loss = torch.nn.functional.mse_loss(out, target)
        opt.zero_grad()
        loss.backward()
        opt.step()

    counter.run(step, args.batch)
    return {"samples_per_s": counter.rate}


async def remote(args: argparse.Namespace) -> dict[str, Any]:
    from nat import Peer, PeerConfig
    from nat.autorelay import AutoRelayConfig
    from p2p.dht import DHTMode
    from p2p.collector import settle
    from training.moe import ClientConfig, ExpertClient, MoEConfig, MoEError, RemoteMixtureOfExperts

    torch.set_num_threads(1)
    config = PeerConfig.loopback(initial_peers=args.initial_peers, listen="/ip4/0.0.0.0/tcp/0", dht=DHTMode.CLIENT,
                                 exchange=False, bootstrap_timeout=30.0, autorelay=AutoRelayConfig(enabled=False))
    target = torch.randn(args.batch, args.hidden)
    async with Peer.open(config) as peer, ExpertClient.open(peer, ClientConfig(max_threads=args.concurrency + 4,
                                                                  max_streams_per_server=args.streams,
                                                                  max_idle_streams=args.streams, half=args.half)) \
            as client:
        layer = RemoteMixtureOfExperts(client, in_features=args.hidden, grid_size=GRID, uid_prefix="ffn",
                                       config=MoEConfig(k_best=K, forward_timeout=30.0, backward_timeout=30.0,
                                                        timeout_after_k_min=5.0, cache_ttl=60.0))
        opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
        shared_step = stepper(layer, opt)
        with trio.fail_after(60):
            while True:  # the servers' records first
                try:
                    await client.run(lambda: layer(torch.randn(2, args.hidden)))
                    break
                except MoEError:
                    await trio.sleep(1.0)
        settle()  # as the commands do once their peer is up (p2p/collector.py)
        if args.raw:
            return await raw(client, layer, args)
        t0 = time.perf_counter()
        counter = Counter(t0 + args.warmup, t0 + args.warmup + args.seconds)
        failed = [0]
        times: list[tuple[float, float, float, float]] = []  # per batch: all, search, forward calls, backward calls

        def worker() -> None:
            replica = RemoteMixtureOfExperts(client, in_features=args.hidden, grid_size=GRID, uid_prefix="ffn",
                                             config=layer.config)
            replica.searcher = layer.searcher  # one cache of live experts for every thread
            def step() -> None:
                began = time.perf_counter()
                shared_step(replica, torch.randn(args.batch, args.hidden), target)
                forward, backward = replica.last_report, replica.last_backward
                if forward is not None and backward is not None:
                    times.append((time.perf_counter() - began, forward.search_s, forward.calls_s, backward.calls_s))

            failed[0] += counter.run(step, args.batch, (MoEError,))

        lag: list[float] = []
        async with trio.open_nursery() as nursery:
            for _ in range(args.concurrency):
                nursery.start_soon(client.run, worker)
            nursery.start_soon(loop_lag, counter, lag)
        return figures(counter, client, args, failed[0], lag,
                       dict(zip(("step", "search", "forward_calls", "backward_calls"),
                                (round(sum(t[i] for t in times) / max(1, len(times)), 3) for i in range(4)))))


async def loop_lag(counter: Counter, lag: list[float]) -> None:
    """How late the trio loop wakes a 10 ms sleep while the measurement runs (a busy loop delays every
    step of every exchange by about this)."""
    while time.perf_counter() < counter.stop:
        began = time.perf_counter()
        await trio.sleep(0.01)
        if began >= counter.start:
            lag.append(time.perf_counter() - began - 0.01)


def figures(counter: Counter, client: Any, args: argparse.Namespace, failed_batches: int, lag: list[float],
            mean_batch_s: dict[str, float]) -> dict[str, Any]:
    """What a DMoE run reports: its samples/s and the client's call figures."""
    stats = client.stats
    lag = sorted(lag) or [0.0]
    return {"samples_per_s": counter.rate, "failed_batches": failed_batches,
            "loop_lag_ms": {"median": round(1e3 * lag[len(lag) // 2], 2), "p90": round(1e3 * lag[int(len(lag) * 0.9)], 2)},
            "calls": stats.calls, "call_failures": stats.failures, "exchanges": stats.exchanges, "joined": stats.joined,
            "slot_wait_s": stats.slot_wait_s, "exchange_s": stats.exchange_s, "reasons": stats.reasons[-3:],
            "mean_batch_s": mean_batch_s}


async def raw(client: Any, layer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """--raw: the exchanges a batch makes (forward, then backward, to each server at once, as many
    rows per expert as a batch sends), from --concurrency trio tasks: the stack without torch threads."""
    from training.moe.protocol import Kind

    beams = await layer.searcher.search([torch.randn(1, m) for m in GRID], k=GRID[0] * GRID[1],
                                        beam_size=GRID[0] * GRID[1])
    experts = {e.uid: e for b in beams[0] for e in b.experts}
    by_server: dict[Any, list[Any]] = {}
    for e in experts.values():
        by_server.setdefault(e.peer_id, []).append(e)
    rows = args.batch * K // len(experts)
    x = torch.randn(rows, args.hidden)
    t0 = time.perf_counter()
    counter = Counter(t0 + args.warmup, t0 + args.warmup + args.seconds)

    async def one(group: list[Any], kind: int) -> None:
        tensors = [[x] if kind == Kind.FORWARD else [x, x] for _ in group]
        await client.call_many(group, kind, tensors, timeout=30.0)

    async def task() -> None:
        while counter.measuring():
            for kind in (Kind.FORWARD, Kind.BACKWARD):
                async with trio.open_nursery() as nursery:
                    for group in by_server.values():
                        nursery.start_soon(one, group, kind)
            counter.add(args.batch)

    lag: list[float] = []
    async with trio.open_nursery() as nursery:
        for _ in range(args.concurrency):
            nursery.start_soon(task)
        nursery.start_soon(loop_lag, counter, lag)
    return figures(counter, client, args, 0, lag, {})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local", action="store_true")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--streams", type=int, default=64, help="the client's max_streams_per_server (and idle streams)")
    p.add_argument("--half", action="store_true", help="tensors travel as float16 (the client's half)")
    p.add_argument("--raw", action="store_true", help="the exchanges alone, from trio tasks (see raw())")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=5.0)
    args = p.parse_args()
    result = local(args) if args.local else trio.run(remote, args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
