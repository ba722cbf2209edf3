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

The decisions are pure functions (:func:`shard`, :func:`child_args`); the I/O is
:func:`serve_in_processes`, a trio nursery with one ``run_process`` per child.
A child that ends stops the others, and the command exits with its status (a
supervisor such as systemd restarts the whole server); Ctrl-C or SIGTERM stops
every child as SIGTERM stops one server: each saves its checkpoints first.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import trio

from p2p.addresses import parse_multiaddr
from p2p.errors import ConfigError
from p2p.output import Output

T = TypeVar("T")

#: How long a child may take to save its checkpoints and close after SIGTERM before it is killed.
STOP_GRACE_S = 60.0
#: Most processes of one server (each holds a CUDA context and a node).
MAX_PROCESSES = 64

_TCP_PORT = re.compile(r"/tcp/(\d+)")


def shard(items: Sequence[T], index: int, count: int) -> list[T]:
    """The items process ``index`` of ``count`` serves: every count-th from ``index`` (round robin, so
    that callers who take the experts in turn load every process alike)."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count}")
    return list(items[index::count])


def shifted_port(addr: str, offset: int, *, what: str) -> str:
    """``addr`` with its TCP port moved up by ``offset`` (port 0, a port the OS picks, stays 0; a
    relayed address, whose port is the relay's, stays as it is)."""
    parsed = str(parse_multiaddr(addr, what=what))
    if "/p2p-circuit" in parsed:
        return parsed
    m = _TCP_PORT.search(parsed)
    if m is None or int(m.group(1)) == 0 or offset == 0:
        return parsed
    port = int(m.group(1)) + offset
    if port > 65535:
        raise ConfigError(f"{what} {parsed}: process {offset} would need TCP port {port}; give a lower port")
    return parsed[:m.start(1)] + str(port) + parsed[m.end(1):]


def child_identity(identity: Path, index: int) -> Path:
    """Process 0 keeps the server's identity (one process or many, its first peer id is the same);
    process i > 0 keeps its own beside it: ``identity.key.1``, ..."""
    return identity if index == 0 else identity.with_name(f"{identity.name}.{index}")


def child_metrics(endpoint: str | None, index: int) -> str | None:
    """``--metrics HOST:PORT`` for process ``index``: PORT + index (each child serves its own page)."""
    if not endpoint:
        return endpoint
    from p2p.http import parse_endpoint

    parse_endpoint(endpoint)  # a malformed one fails here, with the flag's own message
    host, _, port = endpoint.rpartition(":")
    if int(port) == 0:
        return endpoint
    if int(port) + index > 65535:
        raise ConfigError(f"--metrics {endpoint}: process {index} would need port {int(port) + index}")
    return f"{host}:{int(port) + index}"


def child_args(args: argparse.Namespace, index: int, count: int) -> argparse.Namespace:
    """The options of process ``index`` of ``count``: the server's, with its share of the experts, its
    own identity, and its own ports where the server's are fixed (listen, announce, metrics: + index)."""
    child = argparse.Namespace(**vars(args))
    child.processes = 1
    child.shard = [index, count]
    child.identity = child_identity(Path(args.identity), index)
    if args.listen:
        child.listen = [shifted_port(a, index, what="--listen") for a in args.listen]
    if getattr(args, "announce", None):
        child.announce = [shifted_port(a, index, what="--announce") for a in args.announce]
    child.metrics = child_metrics(getattr(args, "metrics", None), index)
    return child


def encode_args(args: argparse.Namespace) -> bytes:
    """A child's options as the JSON it reads on stdin (paths as strings, named so that they come back
    as paths)."""
    fields = vars(args)
    paths = sorted(k for k, v in fields.items() if isinstance(v, Path))
    return json.dumps({"options": {k: str(v) if k in paths else v for k, v in fields.items()},
                       "paths": paths}).encode()


def decode_args(raw: bytes) -> argparse.Namespace:
    message = json.loads(raw)
    if not isinstance(message, dict) or not isinstance(message.get("options"), dict):
        raise ConfigError("serve-experts child: its options must come as a JSON object on stdin")
    options = dict(message["options"])
    for name in message.get("paths", []):
        options[name] = Path(options[name])
    return argparse.Namespace(**options)


def check_processes(count: int, experts: int) -> None:
    if not 1 <= count <= MAX_PROCESSES:
        raise ConfigError(f"--processes must be 1..{MAX_PROCESSES}, got {count}")
    if count > experts:
        raise ConfigError(f"--processes {count}: more processes than the {experts} experts of --expert-pattern")


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
    :func:`shard` of ``experts`` uids, until one ends (its exit status) or Ctrl-C / SIGTERM (0)."""
    count = int(args.processes)
    check_processes(count, experts)
    children = [child_args(args, i, count) for i in range(count)]  # every port and path checked before any starts
    status = 0
    out.info(f"serving {args.expert_pattern} in {count} processes (a peer each, {experts // count}"
             f"{'+' if experts % count else ''} experts per process)", event="expert_processes", processes=count,
             experts=experts, pattern=args.expert_pattern)

    async with trio.open_nursery() as nursery:
        async def child(index: int) -> None:
            nonlocal status
            done = await trio.run_process([sys.executable, "-m", "training.moe.processes"],
                                          stdin=encode_args(children[index]), check=False,
                                          deliver_cancel=_stop, stdout=None, stderr=None)
            if not nursery.cancel_scope.cancel_called:  # ended by itself: the server is incomplete, so stop
                status = done.returncode if done.returncode > 0 else 1
                out.info(f"serve-experts: process {index} of {count} exited with status {done.returncode}; "
                         "stopping the others", event="expert_process_exit", index=index,
                         returncode=done.returncode)
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

    from .cli import cmd_serve_experts

    return run_command(decode_args(sys.stdin.buffer.read()), cmd_serve_experts)


if __name__ == "__main__":
    sys.exit(main())
