"""One dedloc peer of bench/wan.py, inside a lab namespace; JSON lines on stdout.

    wan_peer.py listen PORT            -> {"peer_id": ...}, then serves until stdin closes
    wan_peer.py dial ADDR ROUNDS       -> per round {"connected_s": .., "first_pong_s": ..}

Each dial round opens a fresh connection (the previous one is closed first, on
both sides), so every round pays the whole upgrade.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from multiaddr import Multiaddr  # noqa: E402

from p2p import Node, NodeConfig  # noqa: E402


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def listen(port: int) -> None:
    async with Node.open(NodeConfig(listen=[f"/ip4/0.0.0.0/tcp/{port}"])) as node:
        say(peer_id=node.peer_id.to_base58())
        stdin = trio.lowlevel.FdStream(0)
        while await stdin.receive_some(1024):  # until the driver closes our stdin
            pass


async def dial(addr: str, rounds: int) -> None:
    target = Multiaddr(addr)
    async with Node.open(NodeConfig(listen=["/ip4/0.0.0.0/tcp/0"])) as node:
        for _ in range(rounds):
            with trio.fail_after(30):
                started = time.perf_counter()
                peer = await node.connect(target)
                connected = time.perf_counter()
                await node.ping(peer)
                pong = time.perf_counter()
                say(connected_s=connected - started, first_pong_s=pong - started)
                await node.disconnect(peer)
                while peer in node.connected_peers():
                    await trio.sleep(0.01)
            await trio.sleep(0.3)  # the listener notices the close too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("listen").add_argument("port", type=int)
    dial_args = sub.add_parser("dial")
    dial_args.add_argument("addr")
    dial_args.add_argument("rounds", type=int)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    if args.mode == "listen":
        trio.run(listen, args.port)
    else:
        trio.run(dial, args.addr, args.rounds)


if __name__ == "__main__":
    main()
