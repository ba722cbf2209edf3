"""One hivemind 1.1.12 training peer per process: hivemind.Optimizer on the bench MLP, as training_peer.py.

    .venv-hivemind/bin/python bench/training_hivemind_peer.py --index I [--initial-peers MADDR ...] [--steps N] ...

Peer 0 starts the DHT and prints ``{"maddrs": [...]}`` first. Synchronous
hivemind (no delayed updates, no local updates, no compression, state
averaging out of the way), the same model, batches, target and learning
rate as the dedloc worker; ``matchmaking_time`` is ``--matchmaking-time``.
Networking confined as in bench/averaging_hivemind_peer.py: no IPFS, UPnP,
AutoNAT or relays. Only stdout carries the protocol: fd 1 goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from training_data import Measure, batch, model, worker_parser  # noqa: E402


def main() -> None:
    args = worker_parser(__doc__ or "").parse_args()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)
    import hivemind
    from hivemind.compression import NoCompression

    dht = hivemind.DHT(initial_peers=args.initial_peers or None, start=True, host_maddrs=[args.listen],
                       use_ipfs=False, nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
    if args.index == 0:
        proto.write(json.dumps({"maddrs": [str(a) for a in dht.get_visible_maddrs()]}) + "\n")
    net = model(args.width)
    data = torch.Generator().manual_seed(args.index)
    opt = hivemind.Optimizer(
        dht=dht, run_id="bench", params=net.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        batch_size_per_step=args.batch, target_batch_size=args.target, matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.timeout, average_state_every=10**6, use_local_updates=False,
        delay_optimizer_step=False, delay_grad_averaging=False, delay_state_averaging=False,
        grad_compression=NoCompression(), state_averaging_compression=NoCompression(), verbose=False)
    deadline = time.monotonic() + 4 * args.timeout
    # the whole swarm first (a peer alone steps without averaging); hivemind publishes a peer's
    # progress only once it reported samples, so report one to be seen, and take it back after
    while args.peers > 1 and opt.tracker.global_progress.num_peers < args.peers and time.monotonic() < deadline:
        opt.tracker.report_local_progress(opt.local_epoch, 1, update_global_samples=False)
        time.sleep(0.2)
    opt.tracker.report_local_progress(opt.local_epoch, 0, update_global_samples=False)
    measure = Measure()
    while opt.local_epoch < 1 + args.steps and time.monotonic() < deadline:
        x, y = batch(data, args.batch)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        t1 = time.perf_counter()
        epoch = opt.local_epoch
        opt.step()
        opt.zero_grad()
        if measure.started is not None:
            measure.compute += t1 - t0
            measure.samples += len(x)
            measure.losses.append(float(loss.detach()))
            if opt.local_epoch != epoch:
                measure.step_calls.append(time.perf_counter() - t1)
        if opt.local_epoch != epoch and opt.local_epoch == 1:
            measure.begin()
    proto.write(json.dumps(measure.result(opt.local_epoch - 1)) + "\n")
    time.sleep(3)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
