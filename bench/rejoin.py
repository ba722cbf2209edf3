"""Peers cut off together come back to their bootstrap node: the herd a restart meets, with and
without the jitter of bootstrap's and rejoin's retries (``NodeConfig.backoff_jitter``).

    .venv/bin/python bench/rejoin.py [--peers 60] [--down 3] [--jitters 0,0.5] [--repeats 2] [--json OUT]

In one process on loopback: a bootstrap node (a fixed identity and port, as a relay's) and
``--peers`` nodes with it as their one initial peer. It closes, stays down ``--down`` seconds and
opens again at the same address; each peer's first connection to it times that peer's return.
Printed per jitter (min/median over ``--repeats``): the most handshakes the restarted node held at
once (its admission's count, sampled every 2 ms: what meets the caps of 256 in all and 8 per
address), the most peers back within one 100 ms window, and the seconds until half and all were back. The bootstrap node's admission caps per address and subnet are lifted to its total (256):
loopback puts every peer on one address, where the internet gives each its own. Nothing leaves
127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import free_port  # noqa: E402

from p2p import Node, NodeConfig  # noqa: E402
from p2p import events as ev  # noqa: E402
from p2p.admission import AdmissionConfig  # noqa: E402
from p2p.resources import ResourceConfig  # noqa: E402

WINDOW = 0.1


async def one_restart(peers: int, down: float, jitter: float, work: Path) -> dict[str, float]:
    admission = AdmissionConfig(max_handshaking_per_address=256, max_handshaking_per_subnet=256)
    boot_config = NodeConfig(listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"], identity_path=work / "boot.key",
                             resources=ResourceConfig(admission=admission))
    async with trio.open_nursery() as nursery:
        leave = trio.Event()

        async def first_life(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            async with Node.open(boot_config) as boot:
                task_status.started(str(boot.addrs[0]))
                await leave.wait()

        initial = await nursery.start(first_life)
        config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=[initial], backoff_jitter=jitter,
                            bootstrap_timeout=60.0)
        async with AsyncExitStack() as stack:
            nodes = [await stack.enter_async_context(Node.open(config)) for _ in range(peers)]
            leave.set()
            with trio.fail_after(30):
                while any(n.connected_peers() for n in nodes):
                    await trio.sleep(0.05)
            await trio.sleep(down)
            async with Node.open(boot_config) as again:
                back_at = trio.current_time()
                returns: dict[str, float] = {}
                peak = 0

                async def sample(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                    nonlocal peak
                    task_status.started()
                    while True:
                        peak = max(peak, len(again.resources.admission.handshaking))
                        await trio.sleep(0.002)

                async with again.events() as events, trio.open_nursery() as sampling:
                    await sampling.start(sample)
                    with trio.move_on_after(60):
                        async for event in events:
                            if isinstance(event, ev.ConnectionOpened):
                                returns.setdefault(str(event.peer_id), trio.current_time() - back_at)
                                if len(returns) == peers:
                                    break
                    sampling.cancel_scope.cancel()
    times = sorted(returns.values())
    burst = max(sum(1 for u in times if t <= u < t + WINDOW) for t in times) if times else 0
    return {"back": len(times), "burst_per_100ms": burst, "peak_handshaking": peak,
            "half_back_s": times[len(times) // 2] if times else float("nan"),
            "all_back_s": times[-1] if len(times) == peers else float("nan")}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=60)
    parser.add_argument("--down", type=float, default=3.0)
    parser.add_argument("--jitters", default="0,0.5")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # its refused dials while the node is down
    figures: dict[str, dict[str, object]] = {}
    for jitter in (float(j) for j in args.jitters.split(",")):
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as work:
                runs.append(await one_restart(args.peers, args.down, jitter, Path(work)))
            print(f"jitter {jitter}: {runs[-1]}", flush=True)
        summary: dict[str, object] = {"runs": runs}
        for key in ("peak_handshaking", "burst_per_100ms", "half_back_s", "all_back_s"):
            values = [float(r[key]) for r in runs]
            summary[key] = {"min": min(values), "median": statistics.median(values)}
        figures[str(jitter)] = summary
        print(f"jitter {jitter}: most handshakes at once {summary['peak_handshaking']}, "
              f"most back in 100 ms {summary['burst_per_100ms']}, half back "
              f"{summary['half_back_s']} s, all back {summary['all_back_s']} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"peers": args.peers, "down_s": args.down, "jitters": figures}, indent=1))


if __name__ == "__main__":
    trio.run(main)
