"""``dedloc serve-experts --processes N``: one grid of experts served by N processes, a peer each.

Why processes: one expert server is one Python process, whose event loop does
every byte of Noise, Yamux and the tensor streams for all of its experts. On a
GPU host that loop is the limit, not the device: on an H100 with 16 cores the
GPU sat 90% idle while one dedloc server reached 0.83-0.87 of hivemind's Server
(docs/MOE.md), and hivemind's serves the same 16 experts from 128 handler
processes (``num_handlers`` = 8 per expert) and a Go daemon. Threads cannot
share that work under the GIL; processes can.

Why a peer each, not one peer id behind many processes: a libp2p connection is
one encrypted, multiplexed byte stream that only one process can read, so N
processes behind one identity would need a daemon in front of them (hivemind's
p2pd) and every byte would cross one more hop. Here each process is a whole
peer: its own identity, port and connections, its own share of the experts on
the same device, declared in the DHT under its own peer id. Callers need nothing
new: a declaration already names the server of each expert, so a trainer's
calls spread over the processes as its gating spreads over the experts.

The decisions are pure functions (training/moe/shards.py: each child's share of
the grid, identity and ports); the I/O is :func:`serve_in_processes`, a trio
nursery with one ``run_process`` per child.
A child that ends stops the others, and the command exits with its status (a
supervisor such as systemd restarts the whole server); Ctrl-C or SIGTERM stops
every child as SIGTERM stops one server: each saves its checkpoints first.
"""

from __future__ import annotations

import argparse
import signal
import sys

import trio

from p2p.output import Output

from ..events import ExpertProcesses, ExpertProcessExited
from .shards import check_processes, child_args, decode_args, encode_args

#: How long a child may take to save its checkpoints and close after SIGTERM before it is killed.
STOP_GRACE_S = 60.0


async def _stop(process: trio.Process) -> None:
    """run_process's cancellation: SIGTERM (a child saves its checkpoints and closes), then SIGKILL
    after :data:`STOP_GRACE_S`."""
    process.terminate()
    with trio.move_on_after(STOP_GRACE_S):
        await process.wait()
        return
    process.kill()


async def serve_in_processes(args: argparse.Namespace, out: Output, experts: int) -> int:
    """Run ``args.processes`` children of ``python -m training.moe.processes``, each serving its
    share of the ``experts`` uids (:func:`.shards.child_args`), until one ends by itself (its exit
    status, or 1: the server is incomplete), or ``--duration``, Ctrl-C or SIGTERM (0)."""
    count = int(args.processes)
    check_processes(count, experts)
    children = [child_args(args, i, count) for i in range(count)]  # every port and path checked before any starts
    status = 0
    out.event(ExpertProcesses(processes=count, experts=experts, pattern=args.expert_pattern))

    duration = getattr(args, "duration", None)
    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.deadline = trio.current_time() + (duration if duration is not None else float("inf"))

        async def child(index: int) -> None:
            nonlocal status
            done = await trio.run_process([sys.executable, "-m", "training.moe.processes"],
                                          stdin=encode_args(children[index]), check=False,
                                          deliver_cancel=_stop, stdout=None, stderr=None)
            if not nursery.cancel_scope.cancel_called:  # ended by itself: the server is incomplete, so stop
                status = done.returncode if done.returncode > 0 else 1
                out.event(ExpertProcessExited(index=index, processes=count, returncode=done.returncode))
                nursery.cancel_scope.cancel()

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()

        nursery.start_soon(stop_on_signal)
        for i in range(count):
            nursery.start_soon(child, i)
    return status


def main() -> int:
    """A child: its options on stdin, then the one-process server (training.moe.cli)."""
    from p2p.commands import run_command
    from p2p.errors import ConfigError

    from .cli import cmd_serve_experts

    try:
        args = decode_args(sys.stdin.buffer.read())
    except ConfigError as e:
        print(f"dedloc: error: {e}", file=sys.stderr)
        return 2
    return run_command(args, cmd_serve_experts)


if __name__ == "__main__":
    sys.exit(main())
