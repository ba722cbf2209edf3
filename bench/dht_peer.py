"""One process of dedloc DHT peers, driven by JSON lines (bench/dht.py and tests/test_dht_churn.py).

The protocol is the one ``bench/dht_hivemind_peer.py`` speaks, so one driver
runs the same workload on both systems:

* argv: ``--initial-peers MADDR ...``, ``--nodes M`` (peers in this process, default 1).
* stdout, once ready: ``{"ready": true, "addrs": [...], "startup_s": s, "nodes": [{"peer_id", "addrs"}, ...]}``.
* stdin, one command per line, served concurrently:
  ``{"id", "op": "store", "key", "value", "ttl", "node"?}``, ``{"id", "op": "get", "key", "latest", "node"?}``,
  ``{"id", "op": "kill", "node"}`` (close that peer at once, without goodbye), ``{"id", "op": "stats"}``,
  ``{"op": "quit"}``.
* stdout, per command: ``{"id", "ok", "ms", "value", "error"}`` (``ms`` is the operation's own time).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from typing import Any

STARTED = time.perf_counter()

import trio  # noqa: E402  (timed from interpreter start, imports included)

from p2p import Node, NodeConfig  # noqa: E402
from p2p.dht import DHT, DHTConfig  # noqa: E402

OP_TIMEOUT = 10.0
#: Generous: dozens of processes start at once on a small machine.
BOOTSTRAP_TIMEOUT = 60.0


async def _peer(initial: list[str], ready: trio.MemorySendChannel[DHT],
                task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial, bootstrap_timeout=BOOTSTRAP_TIMEOUT)
    with trio.CancelScope() as scope:
        async with Node.open(config) as node, DHT.open(node, DHTConfig(mode="server", bootstrap_timeout=BOOTSTRAP_TIMEOUT)) as dht:
            task_status.started(scope)
            await ready.send(dht)
            await trio.sleep_forever()


async def _serve(args: argparse.Namespace) -> None:
    out = trio.wrap_file(sys.stdout)
    lock = trio.Lock()

    async def reply(obj: dict[str, Any]) -> None:
        async with lock:
            await out.write(json.dumps(obj) + "\n")
            await out.flush()

    async with trio.open_nursery() as nursery:
        send, receive = trio.open_memory_channel[DHT](math.inf)
        scopes: list[trio.CancelScope] = []
        dhts: list[DHT] = []
        for i in range(args.nodes):
            # The rest of this process joins through its first peer: a hundred peers starting
            # at once through one bootstrap node would starve it on a 2-core machine.
            initial = [str(dhts[0].node.addrs[0])] if dhts else args.initial_peers
            scopes.append(await nursery.start(_peer, initial, send))
            dhts.append(await receive.receive())
        nodes = [{"peer_id": str(d.node.peer_id), "addrs": [str(a) for a in d.node.addrs]}
                 for d in dhts]
        await reply({"ready": True, "addrs": nodes[0]["addrs"], "nodes": nodes,
                     "startup_s": time.perf_counter() - STARTED})

        pending = [0]

        async def run(cmd: dict[str, Any]) -> None:
            pending[0] += 1
            try:
                await run_one(cmd)
            finally:
                pending[0] -= 1

        async def run_one(cmd: dict[str, Any]) -> None:
            started = time.perf_counter()
            result: dict[str, Any] = {"id": cmd.get("id"), "ok": False, "value": None, "error": None}
            try:
                dht = dhts[int(cmd.get("node", 0))]
                with trio.fail_after(OP_TIMEOUT):
                    if cmd["op"] == "store":
                        result["ok"] = await dht.store(cmd["key"], cmd["value"].encode(), time.time() + cmd["ttl"])
                    elif cmd["op"] == "get":
                        found = await dht.get(cmd["key"], latest=bool(cmd.get("latest")))
                        result["ok"] = True
                        if found is not None and isinstance(found.value, bytes):
                            result["value"] = found.value.decode()
                    elif cmd["op"] == "kill":
                        scopes[int(cmd["node"])].cancel()
                        result["ok"] = True
                    elif cmd["op"] == "stats":
                        result["ok"], result["value"] = True, [d.metrics() for d in dhts]
                    else:
                        result["error"] = f"unknown op {cmd['op']!r}"
            except trio.TooSlowError:
                result["error"] = "timeout"
            except Exception as e:  # reported to the driver, which counts it as a failure
                result["error"] = f"{type(e).__name__}: {e}"
            result["ms"] = (time.perf_counter() - started) * 1000
            await reply(result)

        stdin = trio.wrap_file(sys.stdin)
        async for line in stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                break
            nursery.start_soon(run, cmd)
        with trio.move_on_after(OP_TIMEOUT + 1):  # answer what was asked before the quit
            while pending[0]:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


def main() -> None:
    # py-libp2p logs every connection refused by a peer that just shut down; the driver counts failures itself.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    trio.run(_serve, parser.parse_args())


if __name__ == "__main__":
    main()
