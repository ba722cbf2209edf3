"""One dedloc peer per process for bench/datasets.py, driven over JSON lines.

    .venv/bin/python bench/datasets_peer.py --listen MADDR [--initial-peers MADDR ...] [--boot]

What `dedloc peer` runs (PeerConfig.peer: AutoNAT, relay slots and hole punching behind NAT, the DHT), with
`Datasets` mounted. The protocol (bench/datasets_libtorrent_peer.py speaks the same one):

  stdout, once:  {"ready": true, "peer_id": ID, "addrs": [...]}
  stdin, lines:  {"op": "seed", "name": N, "dir": D}              publish D as dataset N and seed it
                 {"op": "get", "name": N, "dir": D}               fetch N into D, then seed it
                 {"op": "corrupt"}                                 serve every piece with a byte flipped
                 {"op": "quit"}
  stdout, lines: {"op": "seeding", "seconds": T}
                 {"op": "progress", "held": B, "t": T}             every second of a get
                 {"op": "done", "seconds": T, "bytes": B, "sources": {...}, "banned": {...}, "duplicates": N,
                  "relayed_peers": N}
                 {"op": "error", "error": TEXT}

A get's time runs from the command to the last piece written (the manifest's lookup included). Only stdout
carries the protocol: logging goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nat import Peer, PeerConfig  # noqa: E402
from nat.port_mapping import PortMappingConfig  # noqa: E402
from p2p.errors import DedlocError  # noqa: E402
from training.datasets import Datasets, DatasetsConfig  # noqa: E402


def say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def config(args: argparse.Namespace) -> PeerConfig:
    if args.boot:
        return PeerConfig.relay(listen=[args.listen])
    c = PeerConfig.peer(args.initial_peers, listen=[args.listen])
    c.nat.port_mapping = PortMappingConfig(enabled=False)  # the lab's routers answer none
    c.exchange_interval = None
    return c


async def main(args: argparse.Namespace) -> None:
    async with Peer.open(config(args)) as peer, \
            Datasets.open(peer, DatasetsConfig(piece_size=args.piece_kib * 1024)) as datasets:
        say(ready=True, peer_id=str(peer.peer_id), addrs=[str(a) for a in peer.addrs])
        stdin = trio.lowlevel.FdStream(0)
        buffer = b""
        async with trio.open_nursery() as nursery:
            while True:
                data = await stdin.receive_some(65536)
                if not data:
                    break
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    command = json.loads(line)
                    if command["op"] == "quit":
                        nursery.cancel_scope.cancel()
                        return
                    nursery.start_soon(run, peer, datasets, command)
            nursery.cancel_scope.cancel()


async def run(peer: Peer, datasets: Datasets, command: dict[str, Any]) -> None:
    op = command["op"]
    started = time.monotonic()
    try:
        if op == "seed":
            await datasets.create(command["name"], Path(command["dir"]))
            say(op="seeding", seconds=time.monotonic() - started)
        elif op == "corrupt":
            read = datasets._read_piece  # a liar skips its own check of what it sends

            async def corrupt(held: Any, root: bytes, index: int) -> bytes | None:
                data = await read(held, root, index)
                return None if data is None else bytes([data[0] ^ 0xFF]) + data[1:]

            datasets._read_piece = corrupt  # type: ignore[method-assign]
            say(op="corrupting")
        elif op == "get":
            async with trio.open_nursery() as nursery:
                async def progress() -> None:
                    while True:
                        await trio.sleep(1.0)
                        held = sum(h.local.held_bytes for h in datasets.held.values())
                        say(op="progress", held=held, t=time.monotonic() - started)

                nursery.start_soon(progress)
                report = await datasets.get(command["name"], Path(command["dir"]),
                                            on_start=lambda local: say(op="started", t=time.monotonic() - started))
                nursery.cancel_scope.cancel()
            say(op="done", seconds=time.monotonic() - started, bytes=report.bytes,
                sources={str(p): n for p, n in report.sources.items()},
                banned={str(p): why for p, why in report.banned.items()}, duplicates=report.duplicates,
                first_seeder_s=report.first_seeder_s, first_piece_s=report.first_piece_s,
                relayed_peers=peer.node.peers_by_path().get("relayed", 0), served=datasets.bytes_served)
    except (DedlocError, OSError) as e:
        traceback.print_exc(file=sys.stderr)
        say(op="error", error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - started)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", required=True)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--boot", action="store_true", help="the relay/bootstrap node only")
    p.add_argument("--piece-kib", type=int, default=1024)
    return p


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(relativeCreated)8.0f %(name)s %(levelname)s %(message)s")
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    trio.run(main, parser().parse_args())
