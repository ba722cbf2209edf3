"""The ``dedloc average`` command's options; the command is in ``averaging/cli.py``, imported only when it runs
(p2p/commands.py), so that no other command imports torch.
"""

from __future__ import annotations

import argparse

from nat.commands import build_parser as nat_parser, peer_options
from p2p.commands import positive_seconds, seconds

#: averaging.compression.Compression's values (that module imports torch; a test holds them equal)
COMPRESSIONS = ("none", "float16", "uint8")


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
    g.add_argument("--gather-time", type=seconds, default=3.0, metavar="SECONDS",
                   help="how long a leader waits for more members (default: %(default)s)")
    g.add_argument("--match-timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="give up on a round when no group formed this long (default: %(default)s)")
    g.add_argument("--round-timeout", type=positive_seconds, default=120.0, metavar="SECONDS", help="longest all-reduce round")
    g.add_argument("--rounds", type=int, default=0, metavar="N", help="stop after N rounds (0: run until --duration)")
    g.add_argument("--interval", type=seconds, default=2.0, metavar="SECONDS", help="pause between rounds")
    g.add_argument("--compression", choices=COMPRESSIONS, default="none")
    g.add_argument("--centered-clip", action="store_true",
                   help="robust aggregation: the parts this peer reduces are CenteredClip's, not the mean, and "
                   "senders whose values were clipped hard are named in the round's report")
    g.add_argument("--auxiliary", action="store_true",
                   help="no tensor of its own (weight 0): lend bandwidth by reducing parts for the others")
    g.add_argument("--no-reduce", action="store_true", help="never reduce a part, even when reachable")
    p.set_defaults(func="averaging.cli:cmd_average")

    return parser, sub
