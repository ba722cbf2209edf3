"""A public relay's life in minutes: thousands of peers come, identify it, reserve a slot and leave.

    .venv/bin/python bench/relay_soak.py [--visitors 3000] [--concurrency 16] [--every 250]
        [--duration 900] [--dht] [--json OUT]

One ``dedloc relay`` (its own process, on loopback, as an operator runs it) and ``--visitors``
peers, each with an identity of its own, made in this process ``--concurrency`` at a time: each
connects, identifies the relay (its public key must check), reserves a slot (the voucher the
relay signs must check) and leaves; with ``--dht`` it also joins the DHT through the relay (the
relay as the bootstrap node: its routing table meets a churn of servers living a second each),
stores a record of its own and reads it back. Every ``--every`` visitors the bench reads the relay's
resident memory (``/proc``) and ``dedloc status`` (its peer store, its open connections).
Printed: the visitors that were served whole, and the first that was not; the relay's RSS and
peer store along the way; its memory growth per 1,000 visitors over the run's second half (a
leak grows linearly, a cache levels off) and its open connections once all have left.

Before ``p2p/peer_store.py`` (py-libp2p 0.8.1's peer store evicting at 1,000 peers, entries without
an address first, the relay's own key pair among them), visitor ~1,000 and every one after it
failed to identify the relay or to get a voucher. Before ``p2p/observed.py`` (every visitor's
peer id kept, under the address it saw the relay at), the relay grew 0.37 MiB per 1,000 visitors
without end (125.5 MiB at 50,000; 107.4 MiB since). Nothing leaves 127.0.0.1; bounded by
``--visitors`` and ``--duration``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import PYTHON, kill_group, python_argv, start_relay  # noqa: E402


def _rss_mib(process: trio.Process) -> float | None:
    """The relay's resident memory; None once it has exited."""
    if process.poll() is not None:
        return None
    with open(f"/proc/{process.pid}/statm") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


async def _status(address: str) -> dict[str, Any]:
    result = await trio.run_process(python_argv([PYTHON, "-m", "training.commands", "status", address, "--json",
                                                 "--timeout", "10"]), capture_stdout=True, capture_stderr=True,
                                    check=False)
    if result.returncode != 0:
        return {"error": result.stderr.decode(errors="replace")[-300:]}
    status: dict[str, Any] = json.loads(result.stdout)
    return status


async def _drain(stream: Any) -> None:
    """Read the relay's event lines (a pipe left full would stall it)."""
    while await stream.receive_some(1 << 16):
        pass


async def _visit(relay_addr: str, timeout: float, dht: bool = False) -> str | None:
    """One visitor's whole visit; None when it was served whole, else what went wrong.

    ``dht``: then it also joins the DHT through the relay (a DHT server while it stays: the
    relay's routing table meets churn), stores a record of its own for a minute and reads it back."""
    from multiaddr import Multiaddr

    from nat.circuit import RelayClient
    from p2p import Node, NodeConfig
    from p2p.addresses import peer_id_of
    from p2p.dht import DHT, DHTConfig

    relay = peer_id_of(Multiaddr(relay_addr))
    assert relay is not None
    try:
        with trio.fail_after(timeout):
            async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], dial_timeout=5.0,
                                            initial_peers=[relay_addr] if dht else [])) as node:
                await node.connect(Multiaddr(relay_addr))
                info = await node.identify(relay, timeout=timeout)
                if not info.public_key_valid:
                    return "identify: no valid public key"
                reservation = await RelayClient(node).reserve(relay)
                if not reservation.voucher_ok:
                    return "reservation: no valid voucher"
                if dht:
                    async with DHT.open(node, DHTConfig(bootstrap_timeout=timeout, rpc_timeout=2.0)) as table:
                        key = f"soak/{node.peer_id.to_base58()}"
                        if not await table.store(key, b"here", time.time() + 60, timeout=timeout):
                            return "dht store: no replica took it"
                        found = await table.get(key, timeout=timeout)
                        if found is None or found.value != b"here":
                            return "dht get: not found"
    except Exception as e:  # what a visitor met, counted by kind
        return f"{type(e).__name__}: {str(e)[-300:]}"
    return None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    process, address = await start_relay()
    samples: list[dict[str, Any]] = []
    failures: list[tuple[int, str]] = []
    visit_seconds: list[float] = []
    done = 0
    started = time.perf_counter()
    try:
        async with trio.open_nursery() as nursery:
            assert process.stdout is not None
            nursery.start_soon(_drain, process.stdout)

            async def sample() -> None:
                status = await _status(address)
                samples.append({"visitors": done, "rss_mib": _rss_mib(process),
                                "peer_store": status.get("peer_store.known"),
                                "connections": status.get("connections.open"),
                                "seconds": round(time.perf_counter() - started, 1)})
                print(json.dumps(samples[-1]), flush=True)

            await sample()
            limiter = trio.CapacityLimiter(args.concurrency)

            async def one(index: int) -> None:
                nonlocal done
                async with limiter:
                    t0 = time.perf_counter()
                    problem = await _visit(address, args.timeout, args.dht)
                    visit_seconds.append(time.perf_counter() - t0)
                done += 1
                if problem is not None:
                    failures.append((index, problem))

            with trio.move_on_after(args.duration) as scope:
                for start in range(0, args.visitors, args.every):
                    async with trio.open_nursery() as batch:
                        for index in range(start, min(args.visitors, start + args.every)):
                            batch.start_soon(one, index)
                    await sample()
            await trio.sleep(2)  # the last visitors' connections close
            await sample()
            nursery.cancel_scope.cancel()
    finally:
        exit_code = process.poll()  # before the bench kills it: None if it ran to the end
        kill_group(process.pid)
    # growth over the second half of the run: by then the peer store is at its bound (1,000 peers)
    later = [s for s in samples if s["visitors"] >= done / 2 and s["rss_mib"] is not None]
    growth = None
    if len(later) >= 2 and later[-1]["visitors"] > later[0]["visitors"]:
        span = later[-1]["visitors"] - later[0]["visitors"]
        growth = round((later[-1]["rss_mib"] - later[0]["rss_mib"]) / span * 1000, 2)
    kinds: dict[str, int] = {}
    for _, problem in failures:
        kinds[problem.split(":")[0]] = kinds.get(problem.split(":")[0], 0) + 1
    alive = [s["rss_mib"] for s in samples if s["rss_mib"] is not None]
    return {"visitors": done, "served": done - len(failures), "timed_out": scope.cancelled_caught,
            "relay_exit_code": exit_code,
            "first_failure": min(failures)[0] if failures else None, "failures_by_kind": kinds,
            "failure_examples": sorted(failures)[:3], "rss_growth_mib_per_1000": growth,
            "rss_mib": {"start": alive[0], "max": max(alive), "end": samples[-1]["rss_mib"]} if alive else None,
            "peer_store_max": max((s["peer_store"] or 0) for s in samples),
            "connections_at_end": samples[-1]["connections"],
            "visit_s": {"median": round(statistics.median(visit_seconds), 3),
                        "max": round(max(visit_seconds), 3)} if visit_seconds else None,
            "seconds": round(time.perf_counter() - started, 1), "samples": samples}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--visitors", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=6,
                   help="visitors at once (the relay admits 8 handshakes at a time from one address: all come from 127.0.0.1)")
    p.add_argument("--every", type=int, default=250, help="visitors between two readings of the relay")
    p.add_argument("--timeout", type=float, default=20.0, help="one visit's deadline, seconds")
    p.add_argument("--duration", type=float, default=900.0, help="the whole run's bound, seconds")
    p.add_argument("--dht", action="store_true",
                   help="each visitor also joins the DHT through the relay, stores a record and reads it")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = trio.run(run, args)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
