"""Group all-reduce benchmark, unshaped loopback (the CPU-bound reference), dedloc only so far.

    .venv/bin/python bench/averaging.py [--peers 4] [--mbytes 40] [--rounds 5] [--json OUT]

Starts a relay/bootstrap Peer and ``--peers`` Peers on 127.0.0.1, all in this
one process (one trio thread: every peer shares one core, which makes this
a pessimistic figure), then runs ``--rounds`` averaging rounds of a
``--mbytes`` MB float32 vector and prints min and median round time (the
all-reduce only; matchmaking is reported apart) and the error against the
average computed in one place.

Still to come (issue "Group all-reduce that adapts to the swarm"): a worker
process per peer, tc tbf shaped namespace links (4 x 100 Mbit,
200/200/40/40), DeDLOC Table 1 setups, the reliability run, and hivemind
1.1.12 side by side (as bench/dht.py does).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from averaging import AllreduceConfig, Averager, AveragerConfig, MatchmakingConfig  # noqa: E402
from nat import NatConfig, Peer, PeerConfig  # noqa: E402
from nat.autorelay import AutoRelayConfig  # noqa: E402
from nat.port_mapping import PortMappingConfig  # noqa: E402
from p2p import NodeConfig  # noqa: E402
from p2p.dht import DHTConfig  # noqa: E402
from p2p.dht.events import DHTMode  # noqa: E402
from p2p.hooks import Reachability  # noqa: E402


def loopback(relay: bool, initial: list[str]) -> PeerConfig:
    return PeerConfig(
        node=NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial, bootstrap_timeout=10.0),
        nat=NatConfig(allow_private=True, port_mapping=PortMappingConfig(enabled=False), relay_service=relay,
                      autorelay=AutoRelayConfig(enabled=False)),
        dht=DHTConfig(mode=DHTMode.SERVER, bootstrap_timeout=10.0),
        exchange_interval=None,
    )


async def main(args: argparse.Namespace) -> dict[str, object]:
    n, elements = args.peers, int(args.mbytes * 1e6 / 4)
    config = AveragerConfig(prefix="bench", matchmaking=MatchmakingConfig(target_size=n, min_size=n, timeout=60.0,
                                                                          gather_time=0.5),
                            allreduce=AllreduceConfig(timeout=300.0, stall_timeout=60.0))
    round_times: list[float] = []
    step_times: list[float] = []
    errors: list[float] = []
    async with AsyncExitStack() as stack:
        relay = await stack.enter_async_context(Peer.open(loopback(True, [])))
        peers = [await stack.enter_async_context(Peer.open(loopback(False, [str(relay.addrs[0])]))) for _ in range(n)]
        with trio.fail_after(60):
            while not all(p.node.reachability is Reachability.PUBLIC for p in peers):
                await trio.sleep(0.05)
        averagers = [await stack.enter_async_context(Averager.open(p, config)) for p in peers]
        for r in range(args.rounds):
            data = [torch.randn(elements) for _ in range(n)]
            exact = torch.stack(data).double().mean(0)
            reports: list[object] = [None] * n
            started = time.perf_counter()

            async def one(i: int) -> None:
                reports[i] = await averagers[i].step([data[i]])

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            step_times.append(time.perf_counter() - started)
            round_times.append(max(rep.elapsed for rep in reports))  # type: ignore[attr-defined]
            errors.append(max((d.double() - exact).abs().max().item() for d in data))
            print(f"round {r}: step {step_times[-1]:.2f} s, all-reduce {round_times[-1]:.2f} s, "
                  f"max error {errors[-1]:.1e}", flush=True)
    result = {
        "unshaped": {
            "peers": n, "mbytes": args.mbytes, "rounds": args.rounds, "peers_in_one_process": True,
            "dedloc_allreduce_min_s": min(round_times), "dedloc_allreduce_median_s": statistics.median(round_times),
            "dedloc_step_min_s": min(step_times), "dedloc_step_median_s": statistics.median(step_times),
            "max_error": max(errors), "hivemind_reference_s": 2.47,
        }
    }
    u = result["unshaped"]
    print(f"unshaped loopback, {n} peers, {args.mbytes:g} MB: all-reduce min {u['dedloc_allreduce_min_s']:.2f} s, "
          f"median {u['dedloc_allreduce_median_s']:.2f} s (step incl. matchmaking: min {u['dedloc_step_min_s']:.2f} s); "
          f"hivemind 1.1.12 measured 2.47 s (its peers in separate processes): "
          f"ratio {u['dedloc_allreduce_median_s'] / 2.47:.2f}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mbytes", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # its failed-dial noise, not ours
    out = trio.run(main, args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
