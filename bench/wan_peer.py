"""One dedloc peer of bench/wan.py, inside a lab namespace; JSON lines on stdout.

    wan_peer.py listen PORT            -> {"ready": true, "peer_id": ...}, then serves until stdin closes
    wan_peer.py dial ADDR ROUNDS       -> per round {"connected_s": .., "first_pong_s": ..}
    wan_peer.py nat-listen RELAY PORT  -> {"peer_id": .., "circuit": ..} once it holds a slot on RELAY,
                                          then serves until stdin closes
    wan_peer.py nat-dial RELAY CIRCUIT PORT
                                       -> {"relayed_s": .., "first_pong_s": .., "direct_s": ..}

Each dial round opens a fresh connection (the previous one is closed first, on
both sides), so every round pays the whole upgrade. The nat- modes run the
whole network layer (``nat.Peer``, what ``dedloc peer`` runs) behind the lab's
NATs; a nat-dial process makes one round with a fresh identity and port, so
nothing of an earlier round (a known address, a NAT mapping) helps the next.
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

from nat import Peer, PeerConfig  # noqa: E402
from nat.port_mapping import PortMappingConfig  # noqa: E402
from p2p import Node, NodeConfig  # noqa: E402
from p2p.addresses import is_relayed  # noqa: E402


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def listen(port: int) -> None:
    async with Node.open(NodeConfig(listen=[f"/ip4/0.0.0.0/tcp/{port}"])) as node:
        say(ready=True, peer_id=node.peer_id.to_base58())
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


def nat_config(relay: str, port: int) -> PeerConfig:
    config = PeerConfig.peer([relay], listen=[f"/ip4/0.0.0.0/tcp/{port}"])
    config.nat.port_mapping = PortMappingConfig(enabled=False)  # the lab's routers answer none
    config.exchange_interval = None
    return config


async def nat_listen(relay: str, port: int) -> None:
    async with Peer.open(nat_config(relay, port)) as peer:
        with trio.fail_after(60):
            while not (circuits := [a for a in peer.addrs if is_relayed(a)]):
                await trio.sleep(0.05)
        say(ready=True, peer_id=peer.peer_id.to_base58(), circuit=str(circuits[0]))
        stdin = trio.lowlevel.FdStream(0)
        while await stdin.receive_some(1024):
            pass


async def nat_dial(relay: str, circuit: str, port: int) -> None:
    async with Peer.open(nat_config(relay, port)) as peer:
        with trio.move_on_after(30):  # our public address (from the relay's identify) is what we offer in DCUtR
            while not peer.nat.punch_addrs():
                await trio.sleep(0.05)
        if not peer.nat.punch_addrs():
            raise SystemExit(f"no public address of ours observed in 30 s: {peer.metrics()}, "
                             f"observed {peer.node.observed_addrs()}, addrs {peer.node.addrs}")
        with trio.fail_after(30):
            started = time.perf_counter()
            target = await peer.node.connect(Multiaddr(circuit))
            relayed = time.perf_counter()
            await peer.node.ping(target)
            pong = time.perf_counter()
            while peer.nat.path_to(target) != "direct":  # the peer behind the relay leads the upgrade
                await trio.sleep(0.005)
            direct = time.perf_counter()
        say(relayed_s=relayed - started, first_pong_s=pong - started, direct_s=direct - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("listen").add_argument("port", type=int)
    dial_args = sub.add_parser("dial")
    dial_args.add_argument("addr")
    dial_args.add_argument("rounds", type=int)
    nat_listen_args = sub.add_parser("nat-listen")
    nat_listen_args.add_argument("relay")
    nat_listen_args.add_argument("port", type=int)
    nat_dial_args = sub.add_parser("nat-dial")
    for name in ("relay", "circuit"):
        nat_dial_args.add_argument(name)
    nat_dial_args.add_argument("port", type=int)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    if args.mode == "listen":
        trio.run(listen, args.port)
    elif args.mode == "dial":
        trio.run(dial, args.addr, args.rounds)
    elif args.mode == "nat-listen":
        trio.run(nat_listen, args.relay, args.port)
    else:
        trio.run(nat_dial, args.relay, args.circuit, args.port)


if __name__ == "__main__":
    main()
