"""The command that averages: ``average``.

Its parser extends the network layer's (``nat/cli.py``: relay, peer, status,
ping; ``p2p/cli.py``: id, dht), and the training layer's extends this one
(``training/cli.py``, where the ``dedloc`` entry point sits). ``average`` is
``dedloc peer`` plus an :class:`~averaging.Averager` that averages a tensor
with the swarm every few seconds: the smallest real use of the averaging
layer, and what ``make demo`` runs before it trains.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import torch
import trio

from nat import Peer
from nat.cli import peer_config, run_peer
from p2p.output import Output
from p2p.errors import ConfigError

from .allreduce import AllreduceConfig, check_weight
from .averager import Averager, AveragerConfig
from .compression import Compression
from .errors import AveragingError
from .events import AverageFailed, Averaged
from .matchmaking import MatchmakingConfig
from .robust import CenteredClipConfig

if TYPE_CHECKING:
    from nat.dashboard import Dashboard


def averager_config(args: argparse.Namespace) -> AveragerConfig:
    return AveragerConfig(
        prefix=args.prefix,
        matchmaking=MatchmakingConfig(target_size=args.group_size, min_size=args.min_size,
                                      gather_time=args.gather_time, timeout=args.match_timeout),
        allreduce=AllreduceConfig(compression=Compression(args.compression), timeout=args.round_timeout,
                                  robust=CenteredClipConfig() if args.centered_clip else None),
        auxiliary=args.auxiliary,
        reduces=not args.no_reduce,
    )


async def average_rounds(peer: Peer, args: argparse.Namespace, dashboard: Dashboard | None = None) -> None:
    """Average a tensor every ``--interval`` seconds; each round's outcome is an event (and, with
    ``--metrics``, in the ``dedloc_averaging_*`` families)."""
    config = averager_config(args)
    generator = torch.Generator().manual_seed(int.from_bytes(peer.peer_id.to_bytes()[-4:], "big"))
    async with Averager.open(peer, config) as averager, observed(averager, dashboard):
        r = 0
        while args.rounds == 0 or r < args.rounds:
            # A fresh tensor each round (like a fresh gradient): a round's result checks on its own.
            tensor = (torch.full((args.size,), args.value) if args.value is not None
                      else torch.randn(args.size, generator=generator))
            before = float(tensor.double().mean())
            try:
                report = await averager.step([tensor], weight=0.0 if args.auxiliary else args.weight, strict=False)
            except AveragingError as e:
                peer.node.emit(AverageFailed(round=r, reason=str(e)))
            else:
                me = report.my_index
                peer.node.emit(Averaged(
                    round=r, members=[m.to_base58() for m in report.members], role=averager.role()[0].value,
                    fraction=report.fractions[me], complete=report.complete, summary=report.summary(),
                    left_out=report.left_out, elapsed=report.elapsed, bytes_sent=report.bytes_sent,
                    bytes_received=report.bytes_received, value=before,
                    mean=float(tensor.double().mean()) if not args.auxiliary else before,
                ))
            r += 1
            await trio.sleep(args.interval)


@asynccontextmanager
async def observed(averager: Averager, dashboard: Dashboard | None) -> AsyncIterator[None]:
    """With ``--metrics``: the averager's rounds in the dashboard's registry for the block."""
    if dashboard is None:
        yield
        return
    from .metrics import AveragingMetrics

    with AveragingMetrics(dashboard.registry).install(averager):
        yield


async def cmd_average(args: argparse.Namespace, out: Output) -> int:
    if not 1 <= args.min_size <= args.group_size:  # in the options' words, before the config's check
        raise ConfigError(f"need 1 <= --min-size <= --group-size, got --min-size {args.min_size} "
                          f"and --group-size {args.group_size}")
    try:
        averager_config(args).validate()  # bad options fail before the peer starts
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.size <= 0:
        raise ConfigError("--size must be positive")
    if args.rounds < 0:
        raise ConfigError("--rounds must be 0 (until --duration) or more")
    try:
        check_weight(args.weight)  # the averager's own check, before the peer starts
    except ValueError as e:
        raise ConfigError(f"--weight: {e}") from None
    if args.value is not None and not math.isfinite(args.value):
        raise ConfigError(f"--value must be a finite number (the averager refuses NaN and Inf), not {args.value}")
    return await run_peer(args, out, config=peer_config(args, relay=False), work=lambda peer, dashboard: average_rounds(peer, args, dashboard))
