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

Why each child runs in a process group of its own: a terminal's Ctrl-C signals
its whole foreground group, so a child in the parent's group got SIGINT from
the terminal and, while it saved its experts, SIGTERM from its parent, which
killed it mid-save (measured: 2 of 4 checkpoints left as ``.partial``). In a
group of its own only the parent hears the terminal, and each child is told
once. Why the stdin pipe stays open: it is the child's lifeline. A parent killed
where it could not stop its children (SIGKILL, the OOM killer, a closed
terminal's SIGHUP) closes it, and the child, reading EOF, stops as SIGTERM
stops it instead of serving on as an orphan nobody supervises.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from functools import partial

import trio

from p2p.output import Output
from p2p.trio_util import cancel_on_sigterm

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
            async with trio.open_nursery() as running:
                process: trio.Process = await running.start(partial(
                    trio.run_process, [sys.executable, "-m", "training.moe.processes"], stdin=subprocess.PIPE,
                    check=False, deliver_cancel=_stop, stdout=None, stderr=None, process_group=0))
                assert process.stdin is not None
                try:  # its options, one line; the pipe then stays open as its lifeline (the module's docstring)
                    await process.stdin.send_all(encode_args(children[index]) + b"\n")
                except trio.BrokenResourceError:
                    pass  # it has already ended: its status says why
            if not nursery.cancel_scope.cancel_called:  # ended by itself: the server is incomplete, so stop
                returncode = process.returncode
                assert returncode is not None
                status = returncode if returncode > 0 else 1
                out.event(ExpertProcessExited(index=index, processes=count, returncode=returncode))
                nursery.cancel_scope.cancel()

        nursery.start_soon(cancel_on_sigterm, nursery.cancel_scope)
        for i in range(count):
            nursery.start_soon(child, i)
    return status


async def stop_when_orphaned(lifeline: int) -> None:
    """Wait for EOF on ``lifeline`` (the parent's end of the child's stdin closes when it exits, however
    it exits), then stop this process as SIGTERM stops a server: its experts are saved."""
    async with trio.lowlevel.FdStream(os.dup(lifeline)) as stream:
        while await stream.receive_some():
            pass
    os.kill(os.getpid(), signal.SIGTERM)


async def serve_as_child(args: argparse.Namespace, out: Output) -> int:
    """A child: the one-process server (training.moe.cli), stopped if its parent goes."""
    from .cli import cmd_serve_experts

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_when_orphaned, sys.stdin.fileno())
        status = await cmd_serve_experts(args, out)
        nursery.cancel_scope.cancel()
    return status


def main() -> int:
    """A child: its options, one line on stdin (the pipe stays open: :func:`stop_when_orphaned`), then
    :func:`serve_as_child`."""
    from p2p.commands import run_command
    from p2p.errors import ConfigError

    try:
        args = decode_args(sys.stdin.buffer.readline())
    except ConfigError as e:
        print(f"dedloc: error: {e}", file=sys.stderr)
        return 2
    return run_command(args, serve_as_child)


if __name__ == "__main__":
    sys.exit(main())
