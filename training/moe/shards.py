"""How ``dedloc serve-experts --processes N`` splits one server over N processes (pure functions).

Each process is a whole peer (training/moe/processes.py says why): it hosts its
:func:`shard` of the grid, keeps an identity of its own beside the server's
(:func:`child_identity`), and where the server's ports are fixed, listens and
serves its page on its own (:func:`shifted_port`, :func:`child_metrics`).
:func:`child_args` is the whole plan of one child, checked before any starts;
:func:`encode_args` and :func:`decode_args` carry it to the child on its stdin.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from p2p.addresses import parse_multiaddr
from p2p.errors import ConfigError
from p2p.http import parse_endpoint

T = TypeVar("T")

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
    parse_endpoint(endpoint)  # a malformed one fails here, with the flag's own message
    host, _, port = endpoint.rpartition(":")
    if int(port) == 0:
        return endpoint
    if int(port) + index > 65535:
        raise ConfigError(f"--metrics {endpoint}: process {index} would need port {int(port) + index}")
    return f"{host}:{int(port) + index}"


def child_args(args: argparse.Namespace, index: int, count: int) -> argparse.Namespace:
    """The options of process ``index`` of ``count``: the server's, with its share of the experts, its
    own identity, its own ports where the server's are fixed (listen, announce, metrics: + index), and
    no ``--duration`` (the parent keeps it)."""
    child = argparse.Namespace(**vars(args))
    child.processes = 1
    child.duration = None  # the parent's --duration stops them all, as SIGTERM does: each child's would end one
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
    try:
        message = json.loads(raw)
    except ValueError:
        message = None
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
