"""``dedloc serve-experts``: host a grid of preset experts on a peer (hivemind's ``run_server``)."""

from __future__ import annotations

import argparse
import contextlib
import math
from pathlib import Path

import torch
import trio

from nat import Peer
from nat.cli import peer_config, run_peer
from nat.dashboard import Dashboard
from p2p.errors import ConfigError
from p2p.noise import process_cores
from p2p.output import Output

from ..checkpoints import hold_directory
from ..events import ExpertsServing
from .experts import PRESETS, expert_seed
from .grid import ExpertUid, UidError, expand_pattern
from .processes import serve_in_processes
from .shards import shard
from .server import ExpertBackend, ExpertServer, ServerConfig


def expert_uids(args: argparse.Namespace) -> list[ExpertUid]:
    """The uids this process hosts: --expert-pattern's, or a child's :func:`~.shards.shard` of them."""
    try:
        uids = expand_pattern(args.expert_pattern)
    except UidError as e:
        raise ConfigError(str(e)) from None
    place = getattr(args, "shard", None)
    return uids if place is None else shard(uids, *place)


def check_options(args: argparse.Namespace) -> str:
    """The options' errors, before anything starts; the device the experts go on."""
    if args.hidden_dim < 1:
        raise ConfigError("--hidden-dim must be positive")
    if not (args.lr > 0 and math.isfinite(args.lr)):  # an infinite rate ruins the weights at the first update
        raise ConfigError("--lr must be a positive number")
    if args.threads < 0:
        raise ConfigError("--threads must be 0 (the cores this process may use, shared among --processes) or more")
    device: str = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: this torch sees no CUDA device")
    return device


def torch_threads(requested: int, cores: int, processes: int) -> int:
    """torch's CPU threads in one server process: ``requested``, or (0) its share of the ``cores`` this
    process may use (:func:`p2p.noise.process_cores`: a container's quota, not the host's count,
    which is torch's own default) among the server's ``processes``. Threads that outnumber the cores
    spin in each other's way: bench/moe_latency_peer.py's one-process mixture on 2 cores made 779
    samples/s with 2 threads, 267 with 16 and 96 with 64."""
    return requested if requested else max(1, cores // max(1, processes))


def build_backends(args: argparse.Namespace) -> list[ExpertBackend]:
    uids = expert_uids(args)
    device = check_options(args)
    shards = getattr(args, "shard", None)
    torch.set_num_threads(torch_threads(args.threads, process_cores(), shards[1] if shards else 1))
    out = []
    for uid in uids:
        torch.manual_seed(expert_seed(args.seed, str(uid)))  # the same weights in one process or many
        module = PRESETS[args.expert_cls](args.hidden_dim)
        # fused: one kernel for every parameter; a small batch's backward took 2.8 ms with the
        # per-parameter loop and 1.4 ms fused (hidden 256, 8 rows, one CPU thread), most of it the step
        optimizer = torch.optim.Adam(module.parameters(), lr=args.lr, fused=True)
        out.append(ExpertBackend(str(uid), module, optimizer, (args.hidden_dim,), device=device))
    return out


async def cmd_serve_experts(args: argparse.Namespace, out: Output) -> int:
    config = ServerConfig(max_batch_size=args.max_batch_size, min_batch_size=args.min_batch_size,
                          max_wait=args.max_wait,
                          checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
                          update_period=args.update_period, expiration=args.update_period * 3)
    config.validate()
    with contextlib.ExitStack() as held:
        if config.checkpoint_dir is not None and getattr(args, "shard", None) is None:  # a child: its parent holds it
            held.enter_context(hold_directory(config.checkpoint_dir))
        return await _serve_experts(args, out, config)


async def _serve_experts(args: argparse.Namespace, out: Output, config: ServerConfig) -> int:
    if getattr(args, "processes", 1) != 1:
        uids = expert_uids(args)  # a bad pattern or option fails here, before any child starts
        check_options(args)
        return await serve_in_processes(args, out, len(uids))
    backends = build_backends(args)  # a bad pattern or device fails before the peer starts

    async def serve(peer: Peer, dashboard: Dashboard | None) -> None:
        async with ExpertServer.open(peer, backends, config):
            place = getattr(args, "shard", None) or (0, 1)
            out.event(ExpertsServing(experts=len(backends), expert_cls=args.expert_cls, pattern=args.expert_pattern,
                                     hidden_dim=args.hidden_dim, device=str(backends[0].device),
                                     process=place[0], processes=place[1]))
            await trio.sleep_forever()

    return await run_peer(args, out, config=peer_config(args, relay=False), work=serve, role="experts")
