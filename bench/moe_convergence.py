"""DMoE training under latency and failures against a dense model (Learning@home Fig. 5), in one run.

    .venv/bin/python bench/moe_convergence.py [--trainers 16] [--steps 150] [--json OUT]
    sudo .venv/bin/python bench/moe_convergence.py --delay-ms 50      (the lab: a delayed path)

A bootstrap node and four `dedloc serve-experts` processes host an 8x8 grid of ffn experts
(hidden 64; 6 of the 64, about 10%, on a server of their own); --trainers asynchronous trainers
(bench/moe_convergence_peer.py, each a peer with its own local layers) learn a generated 10-class
problem through them; when half of the samples are done, the server of the 6 is killed (SIGKILL).
Then the dense baseline (the same parameter count in one wide ffn) learns from as many samples.
Printed: trainer 0's held-out accuracy along the way (the curves), the final accuracies and their
gap, how many batches failed. With --delay-ms (root), the servers sit on a lab host whose access
link has that one-way delay and the trainers on another. ``--json OUT`` writes the curves and
``gap`` (dense accuracy minus DMoE's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from harness import python_argv, start_relay  # noqa: E402
from p2p.trio_util import read_lines  # noqa: E402

PY = sys.executable
WORKER = str(REPO / "bench" / "moe_convergence_peer.py")
PATTERNS = ["ffn.0.[0:6]", "ffn.0.[6:8]", "ffn.[1:4].[0:8]", "ffn.[4:8].[0:8]"]  # the first one dies
Spawn = Callable[..., Awaitable[trio.Process]]


async def local_spawn(argv: list[str], **kwargs: Any) -> trio.Process:
    return await trio.lowlevel.open_process(python_argv(argv), cwd=str(REPO), **kwargs)


async def lines_of(process: trio.Process) -> Any:
    assert process.stdout is not None
    async for line in read_lines(process.stdout):
        if line.startswith("{"):
            yield json.loads(line)


async def dmoe_run(args: argparse.Namespace, server_spawn: Spawn, trainer_spawn: Spawn, boot: str,
                   listen: str) -> dict[str, Any]:
    servers = []
    for pattern in PATTERNS:
        servers.append(await server_spawn(
            [PY, "-m", "training.commands", "serve-experts", "--expert-pattern", pattern, "--hidden-dim", "64",
             "--lr", str(args.lr), "--initial-peers", boot, "--listen", listen, "--ephemeral", "--device", "cpu",
             "--no-port-mapping", "--allow-private", "--status-interval", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    total = args.trainers * args.steps * args.batch
    trainers = await trainer_spawn([PY, WORKER, "--initial-peers", boot, "--trainers", str(args.trainers), "--steps",
                                    str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr), "--listen",
                                    listen], stdout=subprocess.PIPE)
    curve: list[dict[str, Any]] = []
    killed_at = None
    done: dict[str, Any] = {}
    with trio.fail_after(args.timeout):
        async for event in lines_of(trainers):
            if event.get("done"):
                done = event
                break
            curve.append(event)
            print(f"  DMoE  {event['samples']:6d} samples: accuracy {event['accuracy']:.3f} "
                  f"({event['failed']} batches failed, {event['s']:.0f} s)", flush=True)
            if killed_at is None and event["samples"] >= total / 2:
                servers[0].kill()
                killed_at = event["samples"]
                print(f"  -- killed the server of {PATTERNS[0]} (6 of 64 experts) at {killed_at} samples", flush=True)
    for process in servers:
        process.kill()
    if not done:
        raise RuntimeError("the trainers ended without a result")
    return {"curve": curve, "final": done, "killed_at_samples": killed_at}


async def dense_run(args: argparse.Namespace) -> dict[str, Any]:
    process = await local_spawn([PY, WORKER, "--dense", "--trainers", str(args.trainers), "--steps", str(args.steps),
                                 "--batch", str(args.batch), "--lr", str(args.lr)], stdout=subprocess.PIPE)
    curve: list[dict[str, Any]] = []
    with trio.fail_after(args.timeout):
        async for event in lines_of(process):
            if event.get("done"):
                return {"curve": curve, "final": event}
            if "samples" in event:
                curve.append(event)
                print(f"  dense {event['samples']:6d} samples: accuracy {event['accuracy']:.3f}", flush=True)
    raise RuntimeError("the dense baseline ended without a result")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"delay_ms": args.delay_ms, "trainers": args.trainers}
    if args.delay_ms:
        from nat.lab import Lab
        from wan import PUBLIC_NET, relay_on

        async with Lab(prefix="dmoec", public_net=PUBLIC_NET) as lab:
            experts = await lab.public_host("experts", delay_ms=args.delay_ms)
            trainers = await lab.public_host("trainers", delay_ms=0.0)
            _relay, boot = await relay_on(experts)

            async def on(host: Any) -> Spawn:
                async def spawn(argv: list[str], **kwargs: Any) -> trio.Process:
                    return await host.spawn(python_argv(argv), cwd=str(REPO), **kwargs)
                return spawn

            results["dmoe"] = await dmoe_run(args, await on(experts), await on(trainers), boot, "/ip4/0.0.0.0/tcp/0")
    else:
        relay, boot = await start_relay(python=Path(PY))
        try:
            results["dmoe"] = await dmoe_run(args, local_spawn, local_spawn, boot, "/ip4/127.0.0.1/tcp/0")
        finally:
            relay.kill()
    results["dense"] = await dense_run(args)
    d, m = results["dense"]["final"], results["dmoe"]["final"]
    results["gap"] = d["accuracy"] - m["accuracy"]
    print(f"\nfinal held-out accuracy: DMoE {m['accuracy']:.3f} ({m['params']} trainable parameters in trainer 0's "
          f"layers, 64 experts remote; {m['failed']} of {args.steps} of trainer 0's batches failed, "
          f"{m['call_failures']} expert calls failed), dense {d['accuracy']:.3f} ({d['params']} parameters): "
          f"gap {results['gap']:+.3f}")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainers", type=int, default=16)
    p.add_argument("--steps", type=int, default=150, help="batches per trainer")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay to the experts (needs root: the lab)")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = trio.run(run, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
