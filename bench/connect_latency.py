"""Connection + first ping latency on loopback: dedloc's dialer vs py-libp2p's host.connect.

    .venv/bin/python bench/connect_latency.py [--rounds 20]

Both paths dial the same listening Node from the same client Node, in one run,
alternating; each round opens a fresh connection, pings once, and disconnects.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from libp2p.peer.peerinfo import info_from_p2p_addr  # noqa: E402

from p2p import Node, NodeConfig  # noqa: E402


async def measure(rounds: int) -> dict[str, float]:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])
    ours: list[float] = []
    theirs: list[float] = []
    first_ping: list[float] = []
    async with Node.open(config) as server, Node.open(config) as client:
        addr = server.addrs[0]
        for _ in range(rounds):
            for label in ("dedloc", "libp2p"):
                started = time.perf_counter()
                with trio.fail_after(30):
                    if label == "dedloc":
                        await client.connect(addr)
                    else:
                        await client.host.connect(info_from_p2p_addr(addr))
                connected = time.perf_counter()
                await client.ping(server.peer_id)
                done = time.perf_counter()
                (ours if label == "dedloc" else theirs).append(connected - started)
                if label == "dedloc":
                    first_ping.append(done - connected)
                await client.disconnect(server.peer_id)
                with trio.fail_after(10):
                    while server.peer_id in client.connected_peers():
                        await trio.sleep(0.01)
    return {
        "dedloc_connect_ms": statistics.median(ours) * 1e3,
        "libp2p_connect_ms": statistics.median(theirs) * 1e3,
        "first_ping_ms": statistics.median(first_ping) * 1e3,
        "speedup": statistics.median(theirs) / statistics.median(ours),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    r = trio.run(measure, args.rounds)
    if args.json:
        print(json.dumps(r))
        return
    print(f"loopback, median of {args.rounds} fresh connections each")
    print(f"  dedloc Node.connect      {r['dedloc_connect_ms']:7.1f} ms  (+ first ping {r['first_ping_ms']:.1f} ms)")
    print(f"  py-libp2p host.connect   {r['libp2p_connect_ms']:7.1f} ms")
    print(f"  speedup                  {r['speedup']:7.1f}x")


if __name__ == "__main__":
    main()
