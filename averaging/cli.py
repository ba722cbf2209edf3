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
from collections.abc import Sequence

import torch
import trio

from nat import Peer
from nat.cli import build_parser as nat_parser, peer_config, peer_options, run_peer
from p2p.cli import Output
from p2p.errors import ConfigError

from .allreduce import AllreduceConfig
from .averager import Averager, AveragerConfig
from .compression import Compression
from .errors import AveragingError
from .events import AverageFailed, Averaged
from .matchmaking import MatchmakingConfig


def averager_config(args: argparse.Namespace) -> AveragerConfig:
    return AveragerConfig(
        prefix=args.prefix,
        matchmaking=MatchmakingConfig(target_size=args.group_size, min_size=args.min_size,
                                      gather_time=args.gather_time, timeout=args.match_timeout),
        allreduce=AllreduceConfig(compression=Compression(args.compression), timeout=args.round_timeout),
        auxiliary=args.auxiliary,
        reduces=not args.no_reduce,
    )


async def average_rounds(peer: Peer, args: argparse.Namespace) -> None:
    """Average a tensor every ``--interval`` seconds; each round's outcome is an event."""
    config = averager_config(args)
    generator = torch.Generator().manual_seed(int.from_bytes(peer.peer_id.to_bytes()[-4:], "big"))
    async with Averager.open(peer, config) as averager:
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


async def cmd_average(args: argparse.Namespace, out: Output) -> int:
    try:
        averager_config(args).validate()  # bad options fail before the peer starts
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.size <= 0:
        raise ConfigError("--size must be positive")
    return await run_peer(args, out, config=peer_config(args, relay=False), work=lambda peer: average_rounds(peer, args))


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:  # type: ignore[type-arg]
    parser, sub = nat_parser()

    p = sub.add_parser("average", help="join a swarm and average a tensor with it every few seconds",
                       description="Run a peer (as `dedloc peer`) that averages a tensor with the other peers of "
                       "--prefix every --interval seconds: groups form over the DHT, the parts are split by "
                       "DeDLOC's load balancing and averaged by a streamed butterfly all-reduce. Each round "
                       "prints its group, this peer's share, the bytes moved and the result.")
    peer_options(p)
    g = p.add_argument_group("averaging")
    g.add_argument("--prefix", default="dedloc-average", help="the run: only peers with the same prefix average together")
    g.add_argument("--size", type=int, default=1_000_000, metavar="N", help="float32 values in the tensor (default: %(default)s)")
    g.add_argument("--value", type=float, default=None,
                   help="fill the tensor with this value each round (default: random normal values)")
    g.add_argument("--weight", type=float, default=1.0, help="this peer's weight in the average (samples)")
    g.add_argument("--group-size", type=int, default=16, metavar="N", help="largest group (default: %(default)s)")
    g.add_argument("--min-size", type=int, default=2, metavar="N", help="smallest group worth a round (default: %(default)s)")
    g.add_argument("--gather-time", type=float, default=3.0, metavar="SECONDS",
                   help="how long a leader waits for more members (default: %(default)s)")
    g.add_argument("--match-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="give up on a round when no group formed this long (default: %(default)s)")
    g.add_argument("--round-timeout", type=float, default=120.0, metavar="SECONDS", help="longest all-reduce round")
    g.add_argument("--rounds", type=int, default=0, metavar="N", help="stop after N rounds (0: run until --duration)")
    g.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="pause between rounds")
    g.add_argument("--compression", choices=[c.value for c in Compression], default="none")
    g.add_argument("--auxiliary", action="store_true",
                   help="no tensor of its own (weight 0): lend bandwidth by reducing parts for the others")
    g.add_argument("--no-reduce", action="store_true", help="never reduce a part, even when reachable")
    p.set_defaults(func=cmd_average)

    return parser, sub
