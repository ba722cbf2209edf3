"""One dedloc training peer per process, driven by bench/training.py: a CollaborativeOptimizer on the bench MLP.

    .venv/bin/python bench/training_peer.py --index I --initial-peers MADDR [--steps N] [--target T] ...

Prints one JSON line (bench/training_data.Measure) when it took ``--steps``
global steps after the warm-up step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import trio

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# bench/training.py (the driver) would shadow the training package: the project root comes first
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH] + [str(BENCH)]

from nat import Peer, PeerConfig  # noqa: E402
from training import CollaborativeOptimizer, TrainingConfig  # noqa: E402
from averaging import MatchmakingConfig  # noqa: E402

from training_data import Measure, batch, model, worker_parser  # noqa: E402


async def main() -> None:
    args = worker_parser(__doc__ or "").parse_args()
    torch.set_num_threads(1)
    net = model(args.width)
    data = torch.Generator().manual_seed(args.index)
    config = PeerConfig.peer(args.initial_peers, listen=[args.listen], identity_path=None)
    config.nat.allow_private = True
    training = TrainingConfig(run_id="bench", target_batch_size=args.target,
                              matchmaking=MatchmakingConfig(target_size=max(2, args.peers), min_size=2,
                                                            gather_time=args.matchmaking_time, timeout=args.timeout))
    measure = Measure()
    with trio.fail_after(args.timeout * 4):
        async with Peer.open(config) as peer, CollaborativeOptimizer.open(
                peer, torch.optim.SGD(net.parameters(), lr=0.01), training) as opt:
            while opt.progress is None or opt.progress.peers < args.peers:
                await trio.sleep(0.2)  # the whole swarm first: a peer alone steps without averaging
            while opt.local_step < 1 + args.steps:
                x, y = batch(data, args.batch)
                t0 = time.perf_counter()
                loss = await trio.to_thread.run_sync(lambda: _forward_backward(net, x, y))
                t1 = time.perf_counter()
                report = await opt.step(len(x))
                if measure.started is not None:
                    measure.compute += t1 - t0
                    measure.samples += len(x)
                    measure.losses.append(loss)
                    if report is not None:
                        measure.step_calls.append(time.perf_counter() - t1)
                if report is not None and opt.local_step == 1:
                    measure.begin()  # the warm-up step is done: measure from here
            print(json.dumps(measure.result(args.steps)), flush=True)
            # stay until the others are done too (a peer that left could be waited for)
            await trio.sleep(3)


def _forward_backward(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = torch.nn.functional.mse_loss(net(x), y)
    loss.backward()
    return float(loss.detach())


if __name__ == "__main__":
    trio.run(main)
