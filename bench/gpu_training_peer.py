"""One peer of bench/gpu_training.py: a transformer encoder trained alone, or with CollaborativeOptimizer.

    .venv/bin/python bench/gpu_training_peer.py --mode alone|sync|dpu [--device cuda] [--size big|tiny]
        [--micro 32] [--seq 256] [--target 2048] [--steps 5] [--initial-peers MADDR] [--peers 2] [--index I]

Prints one JSON line when it took ``--steps`` global steps after the warm-up
step: samples, wall time, the time it spent computing (forward and backward
of its micro-batches, the device synchronised after each, so the time is the
GPU's), the loss of every global step (the mean over its micro-batches), and
every all-reduce round's time and bytes (the averager's own RoundReport).

The model (``--size big``): token embedding (16384 x 1024) and 12 pre-norm
encoder layers (d_model 1024, 16 heads, feed-forward 4096), 168 M
parameters, bf16 autocast on a GPU, AdamW. The data: a seeded first-order
Markov chain over the vocabulary (4 successors per token, the same on every
peer), 15% of the tokens masked; the loss is cross-entropy on the masked
tokens, which context predicts, so it falls from ln(16384) = 9.7.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH] + [str(BENCH)]

from averaging import MatchmakingConfig, RoundReport  # noqa: E402
from nat import Peer, PeerConfig  # noqa: E402
from training import CollaborativeOptimizer, TrainingConfig  # noqa: E402

SIZES = {"big": dict(vocab=16384, d=1024, layers=12, heads=16, ff=4096),
         "small": dict(vocab=4096, d=256, layers=4, heads=4, ff=1024),
         "tiny": dict(vocab=256, d=64, layers=2, heads=4, ff=128)}
SUCCESSORS = 4
#: a folder: each peer's event loop is profiled (cProfile) during its all-reduce rounds, one file per peer
PROFILE = os.environ.get("DEDLOC_BENCH_PROFILE")


class Encoder(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ff: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab + 1, d)  # + the mask token
        self.position = torch.nn.Parameter(torch.zeros(seq, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.embed(tokens) + self.position)))


class Data:
    """Batches of the Markov language, drawn from a pool of its sentences made once on the device.

    Walking the chain for each batch took a gather per position (~1,000 kernel launches for 32 x 256
    tokens) on the peer's event loop before every micro-batch: the H200 runs of 2026-12-04 had the lone
    process compute only 80% of its wall time, ~8 ms of every 41 ms micro-batch spent making its batch
    or launching it. The walk now runs once over ``pool`` sentences at start, and a batch is the next
    rows of a random order (reshuffled when used up) with fresh masks: three ops. 65,536 sentences are
    more than 20 steps of 2048 samples take, so no sentence repeats within such a run.
    """

    def __init__(self, vocab: int, seq: int, device: torch.device, seed: int, pool: int = 65536) -> None:
        g = torch.Generator().manual_seed(1234)  # the language: the same on every peer
        self.successors = torch.randint(vocab, (vocab, SUCCESSORS), generator=g).to(device)
        self.vocab, self.seq, self.device = vocab, seq, device
        self.g = torch.Generator(device=device).manual_seed(seed)
        tokens = torch.empty(pool, seq, dtype=torch.long, device=device)
        tokens[:, 0] = torch.randint(vocab, (pool,), generator=self.g, device=device)
        choice = torch.randint(SUCCESSORS, (pool, seq), generator=self.g, device=device)
        for t in range(1, seq):
            tokens[:, t] = self.successors[tokens[:, t - 1], choice[:, t]]
        self.sentences = tokens
        self.order = torch.randperm(pool, generator=self.g, device=device)
        self.taken = 0

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.taken + size > len(self.order):
            self.order = torch.randperm(len(self.order), generator=self.g, device=self.device)
            self.taken = 0
        tokens = self.sentences[self.order[self.taken:self.taken + size]]
        self.taken += size
        masked = torch.rand(size, self.seq, generator=self.g, device=self.device) < 0.15
        return tokens.masked_fill(masked, self.vocab), tokens, masked


def compute(net: Encoder, data: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float) -> float:
    """Forward and backward of one micro-batch (gradients summed into .grad, times ``scale``); its loss."""
    x, y, masked = data
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
        logits = net(x)
    loss = torch.nn.functional.cross_entropy(logits[masked].float(), y[masked])
    (loss * scale).backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return float(loss.detach())


class Measure:
    def __init__(self) -> None:
        self.started: float | None = None
        self.samples = 0
        self.compute = 0.0
        self.micro_losses: list[float] = []
        self.step_losses: list[float] = []
        self.micro_times: list[float] = []
        #: micro-batches computed while an all-reduce round was under way (DPU), and while none was
        self.micro_in_round: list[float] = []
        self.micro_quiet: list[float] = []
        self.rounds: list[dict[str, float]] = []
        #: the event loop's time between micro-batches, where the compute thread waits: making each batch,
        #: and opt.step() (a step's bookkeeping, and at a global step its round or, with DPU, the wait for
        #: the previous round and the apply)
        self.data = 0.0
        self.step_calls: list[float] = []
        self.global_steps: list[float] = []

    def end_step(self) -> None:
        if self.micro_losses:
            self.step_losses.append(sum(self.micro_losses) / len(self.micro_losses))
        self.micro_losses = []

    def result(self, **extra: Any) -> dict[str, Any]:
        assert self.started is not None
        return {"wall": time.perf_counter() - self.started, "samples": self.samples, "compute": self.compute,
                "losses": self.step_losses, "rounds": self.rounds, "micro_median_s": _median(self.micro_times),
                "micro_in_round_s": _median(self.micro_in_round), "micro_quiet_s": _median(self.micro_quiet),
                "micro_in_round": len(self.micro_in_round), "data_s": self.data, "step_calls_s": sum(self.step_calls),
                "step_call_median_s": _median(self.step_calls), "global_steps_s": sum(self.global_steps), **extra}


def memory_probe(pool: Any, device: torch.device, chunk: int = 64 * 1024, chunks: int = 64) -> dict[str, Any]:
    """What one CPU op on a round's chunk costs in this process, by where the chunk's memory is: pageable,
    freshly page-locked, and the averager's own page-locked staging buffer (``pool``, its BufferPool).

    The first H200 runs (2026-12-04) had the training peers' event loop spend 2-7 ms per op on a 64 Ki-value
    chunk of their own GPU-staged values (a sum, a multiply), 25x more than on chunks that came from the
    wire, while bench/allreduce_speed.py's peers on the same card did not: this tells memory from process."""
    def timed(flat: torch.Tensor) -> dict[str, float]:
        flat.fill_(1.0)
        views = [flat[i * chunk:(i + 1) * chunk] for i in range(chunks)]
        t0 = time.perf_counter()
        for v in views:
            v.sum(dtype=torch.float32)
        t1 = time.perf_counter()
        for v in views:
            _ = v * 0.5
        t2 = time.perf_counter()
        return {"sum_us": (t1 - t0) / chunks * 1e6, "mul_us": (t2 - t1) / chunks * 1e6,
                "sum_gb_per_s": chunk * chunks * 4 / (t1 - t0) / 1e9}

    n = chunk * chunks
    tiny = torch.ones(16)
    t0 = time.perf_counter()
    for _ in range(chunks):
        tiny.sum()
    # an op on 16 values: what any op costs beyond its memory (dispatch, and the GIL taken back after it)
    out: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "tiny_op_us": (time.perf_counter() - t0) / chunks * 1e6,
                           "pageable": timed(torch.empty(n))}
    if device.type == "cuda":
        out["pinned_fresh"] = timed(torch.empty(n, pin_memory=True))
        staged = pool.take("pinned", torch.float32, n)
        try:
            out["pinned_pool"] = timed(staged)
        finally:
            pool.give("pinned", staged)
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


async def main() -> None:
    args = parser().parse_args()
    device = torch.device(args.device)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    elif device.type == "cpu":
        torch.set_num_threads(1)  # peers share the machine's cores: one each, as in bench/training.py
    torch.manual_seed(0)  # the same initial model on every peer
    size = SIZES[args.size]
    net = Encoder(**size, seq=args.seq).to(device)
    params = sum(p.numel() for p in net.parameters())
    data = Data(size["vocab"], args.seq, device, seed=100 + args.index)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr)
    measure = Measure()
    info = {"params": params, "grad_mb": params * 4 / 1e6, "index": args.index}
    warm = 1  # global steps before measuring: compile, allocate, first round

    rounds_in_flight: list[int] = [0]

    async def micro_batch(scale: float) -> float:
        t_data = time.perf_counter()
        batch = data.batch(args.micro)
        t0 = time.perf_counter()
        if measure.started is not None:
            measure.data += t0 - t_data
        during_round = rounds_in_flight[0] > 0
        loss = await trio.to_thread.run_sync(compute, net, batch, scale)
        if measure.started is not None:
            took = time.perf_counter() - t0
            measure.compute += took
            measure.micro_times.append(took)
            (measure.micro_in_round if during_round or rounds_in_flight[0] else measure.micro_quiet).append(took)
            measure.samples += args.micro
            measure.micro_losses.append(loss)
        return loss

    if args.mode == "alone":
        for step in range(warm + args.steps):
            if step == warm:
                measure.started = time.perf_counter()
            done = 0
            while done < args.target:
                await micro_batch(args.micro / args.target)
                done += args.micro
            t_step = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if measure.started is not None:
                measure.global_steps.append(time.perf_counter() - t_step)
            measure.end_step()
        print(json.dumps(measure.result(**info)), flush=True)
        return

    # DEDLOC_BENCH_PROFILE=DIR: the event loop's time in every all-reduce round (cProfile), into DIR
    profile = cProfile.Profile() if PROFILE else None
    probes: dict[str, Any] = {}  # --probe-memory: memory_probe() 1 s into a measured round, and after the last
    config = PeerConfig.peer(args.initial_peers, listen=["/ip4/127.0.0.1/tcp/0"], identity_path=None)
    config.nat.allow_private = True
    training = TrainingConfig(run_id="gpu-bench", target_batch_size=args.target, delay_updates=args.mode == "dpu",
                              matchmaking=MatchmakingConfig(target_size=args.peers, min_size=2, gather_time=2.0,
                                                            timeout=120.0))
    with trio.fail_after(args.timeout):
        async with Peer.open(config) as peer, CollaborativeOptimizer.open(peer, optimizer, training) as opt:
            average_in = opt.averager.average_in

            async def probe_during_round() -> None:
                await trio.sleep(1.0)
                probes["during_round"] = memory_probe(opt.averager._buffers, device)

            async def timed_average_in(*a: Any, **k: Any) -> RoundReport:
                rounds_in_flight[0] += 1
                if profile is not None:
                    profile.enable()
                try:
                    if args.probe_memory and measure.started is not None and "during_round" not in probes:
                        async with trio.open_nursery() as nursery:  # only then: a nursery wraps what the round raises
                            nursery.start_soon(probe_during_round)
                            report = await average_in(*a, **k)
                            nursery.cancel_scope.cancel()
                    else:
                        report = await average_in(*a, **k)
                finally:
                    rounds_in_flight[0] -= 1
                    if profile is not None:
                        profile.disable()
                if measure.started is not None:
                    measure.rounds.append({"elapsed": report.elapsed, "bytes": report.bytes_sent + report.bytes_received,
                                           "complete": report.complete})
                return report

            opt.averager.average_in = timed_average_in  # type: ignore[method-assign]
            while opt.progress is None or opt.progress.peers < args.peers:
                await trio.sleep(0.2)  # the whole swarm first: a peer alone steps without averaging
            while opt.local_step < warm + args.steps:
                await micro_batch(1.0)
                t_step = time.perf_counter()
                stepped = await opt.step(args.micro) is not None
                if measure.started is not None:
                    (measure.global_steps if stepped else measure.step_calls).append(time.perf_counter() - t_step)
                if stepped:
                    measure.end_step()
                # measured from the first step after the warm-up, however this peer got there: one that fell
                # behind takes the swarm's state (CollaborativeOptimizer's catch-up), and a step reached so
                # returns no report (2 of 8 CPU runs here ended with nothing measured, and failed)
                if opt.local_step >= warm and measure.started is None:
                    measure.started = time.perf_counter()
                    measure.step_losses = []
            await opt.finish()
            if args.probe_memory:
                probes["after_rounds"] = memory_probe(opt.averager._buffers, device)
                info["memory_probe"] = probes
            if profile is not None:
                profile.dump_stats(f"{PROFILE}/training-peer{args.index}-{args.mode}.prof")
            print(json.dumps(measure.result(**info)), flush=True)
            await trio.sleep(3)  # stay until the other is done too


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("alone", "sync", "dpu"), required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", choices=tuple(SIZES), default="big")
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--target", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch's intra-op threads (default: 1 on a CPU, where the peers share the cores; torch's own on a GPU)")
    p.add_argument("--probe-memory", action="store_true", help="measure memory_probe() during a round and after the last")
    return p


if __name__ == "__main__":
    trio.run(main)
