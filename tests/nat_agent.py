"""A dedloc peer driven by JSON lines on stdin, for tests that run peers inside network namespaces.

    python -m tests.nat_agent --listen /ip4/0.0.0.0/tcp/4001 --relay <relay multiaddr>

It runs a :class:`nat.Peer` with the NAT layer at its defaults (what `dedloc peer`
runs), bootstraps through the relay, and serves a checksum sink. Each
command line gets one JSON answer line; events are not printed. Commands:

    {"cmd": "state"}                       mode, reachability, mapping, addrs, confirmed
    {"cmd": "wait_mode", "timeout": s}     until the NAT layer decided (public, relayed or client)
    {"cmd": "connect", "addrs": [...]}     dial a peer (by its advertised addresses)
    {"cmd": "wait_direct", "peer": id, "timeout": s}   until a direct connection exists (and its remote address)
    {"cmd": "wait_relay_retired", "peer": id}  until no relayed connection to the peer is left
    {"cmd": "send", "peer": id, "mib": n}  push n MiB through a stream, checked by sha256
    {"cmd": "metrics"}                     the funnel
    {"cmd": "wait_mapping", "timeout": s}  until the NAT's mapping is classified

The DHT (off unless asked for; ``--dht MODE`` opens it at start, in the background):

    {"cmd": "dht_open", "mode": "auto", "peers": [[addr, ...], ...], "timeout": s}
                                           connect to each peer (one address list per peer), then open
                                           ``DHT.open(node, DHTConfig(mode=...))``; answers
                                           once it joined (or the error that opening raised)
    {"cmd": "dht_store", "key": k, "value": text, "ttl": s}   -> {"stored": bool}
    {"cmd": "dht_get", "key": k, "latest": bool}              -> {"found": bool, "value": text or {subkey: text}}
    {"cmd": "dht_info"}                    -> {"server": bool, "table": [peer ids], "stats": {...}, "reachability"}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from typing import Any

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.addresses import is_relayed_conn
from nat.peer import Peer, PeerConfig
from nat.traversal import NatConfig, NatService
from p2p import Node, NodeConfig
from p2p.dht import DHT, DHTConfig
from p2p.dialer import live_connection, remote_addr

SINK = "/dedloc/test/sink/1.0.0"


async def sink(stream: Any) -> None:
    """Read a stream to its end, answer its size and sha256 as JSON, close."""
    digest = hashlib.sha256()
    size = 0
    while True:
        try:
            data = await stream.read(1 << 20)
        except EOFError:
            break
        if not data:
            break
        digest.update(data)
        size += len(data)
    await stream.write(json.dumps({"size": size, "sha256": digest.hexdigest()}).encode())
    await stream.close()


async def push_checked(stream: Any, payload: bytes) -> bool:
    """Send ``payload`` to a :func:`sink` stream and whether its answer matches size and sha256."""
    for start in range(0, len(payload), 256 * 1024):
        await stream.write(payload[start : start + 256 * 1024])
    await stream.close()
    answer = b""
    while True:
        try:
            chunk = await stream.read(4096)
        except EOFError:
            break
        if not chunk:
            break
        answer += chunk
    return bool(json.loads(answer) == {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()})


class DHTHolder:
    """The agent's DHT, kept open by a background task for the rest of the agent's life."""

    def __init__(self) -> None:
        self.dht: DHT | None = None
        self.error: str | None = None
        self.started = False
        self.done = trio.Event()  # set once opened, or once opening failed

    async def run(self, node: Node, nat: NatService, mode: str) -> None:
        try:
            config = DHTConfig(mode=mode)  # type: ignore[arg-type]  # checked by DHTConfig.validate
            async with DHT.open(node, config) as dht:  # auto mode follows the NAT layer's verdict through the Node
                self.dht = dht
                self.done.set()
                await trio.sleep_forever()
        except Exception as e:
            logging.getLogger("agent").debug("DHT failed: %r", e)
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.dht = None
            self.done.set()

    def start(self, node: Node, nat: NatService, mode: str, nursery: trio.Nursery) -> None:
        if self.started:
            raise RuntimeError("the DHT was already opened")
        self.started = True
        nursery.start_soon(self.run, node, nat, mode)

    def get(self) -> DHT:
        if self.dht is None:
            raise RuntimeError(self.error or "the DHT is not open (dht_open first)")
        return self.dht


def _dht_info(dht: DHT, nat: NatService) -> dict[str, Any]:
    return {"server": dht.server, "table": [str(c.peer_id) for c in dht.table], "stats": dht.metrics(),
            "reachability": nat.reachability, "mode": nat.mode}


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return {str(_text(k) if isinstance(k, bytes) else k): _text(v.value) for k, v in value.items()}


async def _connect(node: Node, addrs: list[Multiaddr], timeout: float) -> ID:
    """Dial a peer by its advertised addresses (all of the same peer): put them in the peer store, then dial by id."""
    peer = None
    for addr in addrs:
        peer = ID.from_base58(str(addr).rsplit("/p2p/", 1)[1])
        node.host.get_peerstore().add_addrs(peer, [Multiaddr(str(addr).rsplit("/p2p/", 1)[0]) if "p2p-circuit" not in str(addr) else addr], 3600)
    assert peer is not None
    await node.connect(peer, timeout=timeout)
    return peer


def _direct_addr(node: Node, peer: ID) -> str | None:
    """The remote address of a direct connection to ``peer``, if there is one."""
    conn = next((c for c in node.network.get_connections(peer) if not is_relayed_conn(c)), None)
    return None if conn is None else str(remote_addr(conn))


def _direct(node: Node, peer: ID) -> bool:
    return _direct_addr(node, peer) is not None


def _relayed(node: Node, peer: ID) -> bool:
    return any(is_relayed_conn(c) for c in node.network.get_connections(peer))


async def _handle_dht(node: Node, nat: NatService, holder: DHTHolder, nursery: trio.Nursery,
                      request: dict[str, Any]) -> dict[str, Any]:
    cmd = request["cmd"]
    timeout = float(request.get("timeout", 30))
    if cmd == "dht_open":
        with trio.fail_after(timeout):
            for addrs in request.get("peers", []):
                await _connect(node, [Multiaddr(a) for a in addrs], timeout)
            holder.start(node, nat, request.get("mode", "auto"), nursery)
            await holder.done.wait()
        return _dht_info(holder.get(), nat)
    dht = holder.get()
    if cmd == "dht_info":
        return _dht_info(dht, nat)
    if cmd == "dht_store":
        stored = await dht.store(request["key"], request["value"].encode(), time.time() + float(request.get("ttl", 600)),
                                 subkey=request.get("subkey"), timeout=timeout)
        return {"stored": stored}
    if cmd == "dht_get":
        found = await dht.get(request["key"], latest=bool(request.get("latest", False)), timeout=timeout)
        if found is None:
            return {"found": False, "value": None}
        return {"found": True, "value": _text(found.value), "expiration": found.expiration}
    raise ValueError(f"unknown command {cmd!r}")


async def _handle(node: Node, nat: NatService, request: dict[str, Any]) -> dict[str, Any]:
    cmd = request["cmd"]
    if cmd == "state":
        return {"mode": nat.mode, "reachability": nat.reachability, "mapping": nat.mapping, "addrs": [str(a) for a in node.addrs],
                "confirmed": [str(a) for a in nat.confirmed]}
    if cmd == "wait_mode":
        with trio.move_on_after(request.get("timeout", 30)):
            while nat.mode == "starting" or not node.addrs:
                await trio.sleep(0.1)
        return {"mode": nat.mode, "reachability": nat.reachability, "mapping": nat.mapping, "addrs": [str(a) for a in node.addrs]}
    if cmd == "connect":
        started = time.monotonic()
        peer = await _connect(node, [Multiaddr(a) for a in request["addrs"]], request.get("timeout", 20))
        conn = live_connection(node.network, peer)
        kind = "relayed" if conn is not None and is_relayed_conn(conn) else "direct"
        return {"peer": str(peer), "kind": kind, "elapsed": time.monotonic() - started}
    if cmd == "wait_direct":
        peer = ID.from_base58(request["peer"])
        started = time.monotonic()
        with trio.move_on_after(request.get("timeout", 20)):
            while not _direct(node, peer):
                await trio.sleep(0.05)
        return {"direct": _direct(node, peer), "addr": _direct_addr(node, peer), "elapsed": time.monotonic() - started}
    if cmd == "wait_relay_retired":  # DCUtR closes the relayed connection a grace period after the direct one
        peer = ID.from_base58(request["peer"])
        started = time.monotonic()
        with trio.move_on_after(request.get("timeout", 10)):
            while _relayed(node, peer):
                await trio.sleep(0.05)
        return {"retired": not _relayed(node, peer), "elapsed": time.monotonic() - started}
    if cmd == "send":
        peer = ID.from_base58(request["peer"])
        payload = os.urandom(request.get("mib", 1) * 1024 * 1024)
        with trio.fail_after(request.get("timeout", 60)):
            stream = await node.new_stream(peer, SINK)
            path = "relayed" if any(a for a in stream.muxed_conn.get_transport_addresses() if "p2p-circuit" in str(a)) else "direct"
            ok = await push_checked(stream, payload)
        return {"ok": ok, "path": path}
    if cmd == "metrics":
        return nat.metrics()
    if cmd == "wait_mapping":  # until two observers of our listen port classified our NAT
        with trio.move_on_after(request.get("timeout", 20)):
            while nat.mapping == "unknown":
                await trio.sleep(0.1)
        return {"mapping": nat.mapping}
    if cmd == "views":  # debugging: how each observer saw our listen port
        return {str(p): str(a) for p, a in nat._listen_views.items()} | {"on_listen_port": {str(p): node.on_listen_port(p) for p in node.connected_peers()}}
    raise ValueError(f"unknown command {cmd!r}")


async def _dump_tasks_on_signal() -> None:
    """Debugging aid: SIGUSR1 logs where every trio task is waiting."""
    import signal

    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        async for _ in signals:
            def walk(task: Any, depth: int) -> None:
                where = []
                coro = task.coro
                while coro is not None and hasattr(coro, "cr_frame") and coro.cr_frame is not None:
                    where.append(f"{coro.cr_frame.f_code.co_name}:{coro.cr_frame.f_lineno}")
                    coro = coro.cr_await
                logging.getLogger("agent").debug("%s%s %s", "  " * depth, task.name, " > ".join(where))
                for nursery in task.child_nurseries:
                    for child in nursery.child_tasks:
                        walk(child, depth + 1)
            walk(trio.lowlevel.current_root_task(), 0)


async def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(relativeCreated)8.0f %(name)s %(levelname)s %(message)s")
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    # What `dedloc peer` runs (the composed object), with the DHT opened on request instead of at start.
    config = PeerConfig(
        node=NodeConfig(listen=args.listen or ["/ip4/0.0.0.0/tcp/4001"], initial_peers=list(args.relay), dial_timeout=10, bootstrap_timeout=30),
        nat=NatConfig(relay_service=args.serve_relay, recheck_interval=30),
        dht=None,
        exchange_interval=None,
    )
    async with Peer.open(config, on_listening=lambda node: node.set_stream_handler(SINK, sink)) as peer:
        node, nat = peer.node, peer.nat
        holder = DHTHolder()
        async with trio.open_nursery() as nursery:
            if args.verbose:
                nursery.start_soon(_dump_tasks_on_signal)
            if args.dht:
                holder.start(node, nat, args.dht, nursery)
            print(json.dumps({"ready": True, "peer_id": str(node.peer_id)}), flush=True)
            await _serve_commands(node, nat, holder, nursery)
            nursery.cancel_scope.cancel()


async def _serve_commands(node: Node, nat: NatService, holder: DHTHolder, nursery: trio.Nursery) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buffer = b""
    while True:
        chunk = await stdin.receive_some(65536)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            if request["cmd"] == "quit":
                return
            logging.getLogger("agent").debug("command %s", request)
            try:
                if request["cmd"].startswith("dht_"):
                    reply = await _handle_dht(node, nat, holder, nursery, request)
                else:
                    reply = await _handle(node, nat, request)
            except Exception as e:
                reply = {"error": f"{type(e).__name__}: {e}"}
            logging.getLogger("agent").debug("reply %s", str(reply)[:200])
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", action="append", default=[], help="repeatable (default /ip4/0.0.0.0/tcp/4001)")
    parser.add_argument("--relay", action="append", default=[], help="a relay/bootstrap node (repeatable)")
    parser.add_argument("--serve-relay", action="store_true")
    parser.add_argument("--dht", choices=["auto", "server", "client"], default=None,
                        help="open the DHT at start in this mode (else only on dht_open)")
    parser.add_argument("--verbose", action="store_true", help="log dedloc's debug messages to stderr")
    trio.run(main, parser.parse_args())
