"""DHT benchmark on loopback: store/get latency and success, serially and under churn.

    .venv/bin/python bench/dht.py [--systems dedloc,hivemind] [--peers 32] [--keys 64]
        [--churn-keys 256] [--concurrency 8] [--kill-fraction 0.25] [--seed 0] [--latest] [--json OUT]

Each system runs as one worker process per peer that speaks JSON lines
(see bench/dht_hivemind_peer.py for the protocol):
  dedloc    sys.executable bench/dht_peer.py
  hivemind  .venv-hivemind/bin/python bench/dht_hivemind_peer.py   (bench/setup_hivemind.sh)
so the driver needs only the stdlib and trio. Systems run one after another,
never together (the machine has 2 cores), on the same seeded workload:

  startup  peer 0, then all the others at once bootstrapping from it;
           first spawn to all ready.
  serial   --keys stores one at a time from random peers, then a get of every
           stored key from a random peer other than the one that stored it.
  churn    --churn-keys stores with --concurrency in flight, then SIGKILL
           --kill-fraction of the peers, then at once a get of every churn key
           from random surviving peers, --concurrency in flight.

A get succeeds only if it returns exactly the stored value; latency percentiles
are over successful ops (the worker's own timing of the DHT call), and
timeouts/errors count as failures. Peer 0 is never killed: it is the one
address every peer was given, so sparing it keeps the churn about losing
replicas rather than about rejoining, and keeps the killed set the same for
every system.

Each worker runs in its own session (process group), and its whole group is
SIGKILLed at the end or on any error or Ctrl-C, since a hivemind peer leaves
a DHT process and a p2pd daemon behind it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from harness import HIVEMIND_PYTHON, kill_group

REPO = Path(__file__).resolve().parent.parent
OP_TIMEOUT_S = 10.0  # the worker's own limit per op
REPLY_SLACK_S = 5.0  # extra the driver waits for a reply before calling it lost
FIRST_READY_TIMEOUT_S = 120.0
ALL_READY_TIMEOUT_S = 300.0
QUIT_TIMEOUT_S = 15.0
TTL_S = 600
PHASES = ("serial", "churn")
OPS = ("store", "get")

# Process groups of every worker ever started and not yet reaped: killed on exit whatever happens.
LIVE_GROUPS: set[int] = set()


@dataclass(frozen=True)
class System:
    """How to start one worker of a DHT implementation, and why it may be unavailable."""

    name: str
    argv: list[str]
    needs: list[Path]
    missing_hint: str

    def unavailable(self) -> str | None:
        for path in self.needs:
            if not path.exists():
                return f"{path.relative_to(REPO)} is missing: {self.missing_hint}"
        return None


SYSTEMS: dict[str, System] = {
    "dedloc": System(
        "dedloc",
        [sys.executable, "bench/dht_peer.py"],
        [REPO / "bench/dht_peer.py"],
        "the dedloc DHT worker has not been written yet",
    ),
    "hivemind": System(
        "hivemind",
        [".venv-hivemind/bin/python", "bench/dht_hivemind_peer.py"],
        [HIVEMIND_PYTHON, REPO / "bench/dht_hivemind_peer.py"],
        "run bench/setup_hivemind.sh first",
    ),
}


# ---------------------------------------------------------------- workload


@dataclass(frozen=True)
class Op:
    op: str  # "store" | "get"
    peer: int
    key: str
    value: str  # stored value; for a get, the value it must return
    latest: bool = False  # gets: ask every replica and merge, instead of taking the first copy


@dataclass(frozen=True)
class Workload:
    """Every random choice, made up front from the seed so all systems see the same run."""

    serial_stores: list[Op]
    serial_gets: list[Op]
    churn_stores: list[Op]
    killed: list[int]
    churn_gets: list[Op]


def make_workload(peers: int, keys: int, churn_keys: int, kill_fraction: float, seed: int,
                  latest: bool = False) -> Workload:
    rng = random.Random(seed)

    def stores(prefix: str, n: int) -> list[Op]:
        return [Op("store", rng.randrange(peers), f"{prefix}-{i}", rng.randbytes(16).hex()) for i in range(n)]

    def gets(stored: list[Op], alive: list[int]) -> list[Op]:
        order = rng.sample(stored, len(stored))
        out = []
        for s in order:
            others = [p for p in alive if p != s.peer] or alive
            out.append(Op("get", rng.choice(others), s.key, s.value, latest))
        return out

    serial_stores = stores("k", keys)
    serial_gets = gets(serial_stores, list(range(peers)))
    churn_stores = stores("c", churn_keys)
    n_kill = min(peers - 1, round(kill_fraction * peers))
    killed = sorted(rng.sample(range(1, peers), n_kill))
    survivors = [p for p in range(peers) if p not in killed]
    churn_gets = gets(churn_stores, survivors)
    return Workload(serial_stores, serial_gets, churn_stores, killed, churn_gets)


# ---------------------------------------------------------------- workers


class WorkerDied(Exception):
    pass


@dataclass
class Worker:
    """One peer process: sends commands, matches replies to them by id."""

    index: int
    proc: trio.Process
    log_path: Path
    addrs: list[str] = field(default_factory=list)
    startup_s: float | None = None
    ready: trio.Event = field(default_factory=trio.Event)
    exited: bool = False
    pending: dict[int, trio.MemorySendChannel[dict[str, Any]]] = field(default_factory=dict)
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    next_id: int = 0

    async def read_loop(self) -> None:
        """Parse stdout lines until EOF; then fail whatever is still waiting."""
        assert self.proc.stdout is not None
        buf = b""
        try:
            while True:
                chunk = await self.proc.stdout.receive_some(65536)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    self._dispatch(raw)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.exited = True
            self.ready.set()
            for channel in self.pending.values():
                channel.send_nowait({"ok": False, "ms": None, "value": None, "error": "worker exited"})
            self.pending.clear()

    def _dispatch(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
        except json.JSONDecodeError:
            print(f"  peer {self.index}: ignoring non-JSON stdout line {raw[:200]!r}", file=sys.stderr)
            return
        if msg.get("ready"):
            self.addrs = list(msg.get("addrs", []))
            self.startup_s = msg.get("startup_s")
            self.ready.set()
        elif (channel := self.pending.pop(msg.get("id"), None)) is not None:
            channel.send_nowait(msg)

    async def request(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send one command and wait for its reply, or fail after the worker's timeout plus slack."""
        if self.exited:
            return {"ok": False, "ms": None, "value": None, "error": "worker exited"}
        self.next_id += 1
        op_id = self.next_id
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self.pending[op_id] = send
        try:
            async with self.send_lock:
                assert self.proc.stdin is not None
                await self.proc.stdin.send_all((json.dumps({"id": op_id, **cmd}) + "\n").encode())
            with trio.move_on_after(OP_TIMEOUT_S + REPLY_SLACK_S):
                return await receive.receive()
            return {"ok": False, "ms": None, "value": None, "error": "no reply"}
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return {"ok": False, "ms": None, "value": None, "error": "worker exited"}
        finally:
            self.pending.pop(op_id, None)

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (its DHT child and daemon too)."""
        kill_group(self.proc.pid)


async def spawn(system: System, index: int, initial: list[str], seed: int, log_dir: Path, nursery: trio.Nursery) -> Worker:
    log_path = log_dir / f"{system.name}-{index:03d}.log"
    argv = [*system.argv, "--seed", str(seed)]
    if initial:
        argv += ["--initial-peers", *initial]
    with open(log_path, "wb") as log:
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO, start_new_session=True
        )
    LIVE_GROUPS.add(proc.pid)  # with start_new_session the pid is the group id
    worker = Worker(index, proc, log_path)
    nursery.start_soon(worker.read_loop)
    return worker


async def shutdown(workers: list[Worker], graceful: bool) -> None:
    """Ask every worker to quit (after a clean run), wait a little, then SIGKILL all groups.

    On errors and Ctrl-C it goes straight to SIGKILL: workers still starting up
    would not read the quit command before they were ready.
    """
    with trio.CancelScope(shield=True):
        if graceful:
            with trio.move_on_after(QUIT_TIMEOUT_S):
                async with trio.open_nursery() as nursery:
                    for w in workers:
                        nursery.start_soon(_quit_one, w)
        for w in workers:
            w.kill()
            with trio.move_on_after(5):
                await w.proc.wait()
            LIVE_GROUPS.discard(w.proc.pid)


async def _quit_one(worker: Worker) -> None:
    try:
        if worker.proc.returncode is None and worker.proc.stdin is not None:
            await worker.proc.stdin.send_all(b'{"op": "quit"}\n')
            await worker.proc.stdin.aclose()
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
        pass
    await worker.proc.wait()


# ---------------------------------------------------------------- phases


@dataclass
class Outcome:
    ok: bool
    ms: float | None  # the worker's own timing of the DHT call
    rtt_ms: float  # as seen by the driver: adds pipes, JSON and scheduling on a busy machine
    error: str | None


async def run_op(worker: Worker, op: Op) -> Outcome:
    started = time.perf_counter()
    if op.op == "store":
        reply = await worker.request({"op": "store", "key": op.key, "value": op.value, "ttl": TTL_S})
        ok = bool(reply.get("ok"))
    else:
        reply = await worker.request({"op": "get", "key": op.key, "latest": op.latest})
        ok = bool(reply.get("ok")) and reply.get("value") == op.value
    error = reply.get("error")
    if not ok and error is None:
        error = "wrong value" if op.op == "get" and reply.get("value") is not None else "not found"
    ms = reply.get("ms")
    rtt_ms = (time.perf_counter() - started) * 1e3
    return Outcome(ok, float(ms) if ms is not None else None, rtt_ms, error)


async def run_ops(workers: list[Worker], ops: list[Op], concurrency: int) -> list[Outcome]:
    """Run ops in order with at most `concurrency` in flight."""
    results: list[Outcome | None] = [None] * len(ops)
    limiter = trio.Semaphore(concurrency)

    async def one(i: int, op: Op) -> None:
        try:
            results[i] = await run_op(workers[op.peer], op)
        finally:
            limiter.release()

    async with trio.open_nursery() as nursery:
        for i, op in enumerate(ops):
            await limiter.acquire()
            nursery.start_soon(one, i, op)
    return [r for r in results if r is not None]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no data."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    good = [o.ms for o in outcomes if o.ok and o.ms is not None]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error or "?"] = errors.get(o.error or "?", 0) + 1
    return {
        "n": len(outcomes),
        "ok": sum(o.ok for o in outcomes),
        "p50_ms": percentile(good, 50),
        "p99_ms": percentile(good, 99),
        "rtt_p50_ms": percentile([o.rtt_ms for o in outcomes if o.ok], 50),
        "wall_s": round(wall_s, 3),
        "errors": errors,
    }


async def timed(workers: list[Worker], ops: list[Op], concurrency: int) -> dict[str, Any]:
    started = time.perf_counter()
    outcomes = await run_ops(workers, ops, concurrency)
    return summarize(outcomes, time.perf_counter() - started)


async def bench_system(system: System, workload: Workload, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Start the swarm, run both phases, and always take every process down again."""
    workers: list[Worker] = []
    result: dict[str, Any] = {}
    graceful = False
    async with trio.open_nursery() as nursery:
        try:
            t0 = time.perf_counter()
            first = await spawn(system, 0, [], args.seed * 1000, log_dir, nursery)
            workers.append(first)
            with trio.move_on_after(FIRST_READY_TIMEOUT_S):
                await first.ready.wait()
            if not first.addrs:
                raise RuntimeError(f"peer 0 did not become ready (log: {first.log_path})")
            print(f"  peer 0 ready after {time.perf_counter() - t0:.1f} s; starting {args.peers - 1} more", file=sys.stderr)
            for i in range(1, args.peers):
                workers.append(await spawn(system, i, first.addrs, args.seed * 1000 + i, log_dir, nursery))
            with trio.move_on_after(ALL_READY_TIMEOUT_S):
                for w in workers:
                    await w.ready.wait()
            not_ready = [w for w in workers if not w.addrs]
            if not_ready:
                logs = ", ".join(str(w.log_path) for w in not_ready[:3])
                raise RuntimeError(f"{len(not_ready)} peers did not become ready (logs: {logs} ...)")
            result["startup_s"] = round(time.perf_counter() - t0, 3)
            result["worker_startup_s_p50"] = percentile([w.startup_s or 0.0 for w in workers], 50)
            print(f"  all {args.peers} peers ready in {result['startup_s']:.1f} s", file=sys.stderr)

            result["serial"] = {
                "store": await timed(workers, workload.serial_stores, 1),
                "get": await timed(workers, workload.serial_gets, 1),
            }
            print("  serial phase done", file=sys.stderr)
            churn_store = await timed(workers, workload.churn_stores, args.concurrency)
            for i in workload.killed:
                workers[i].kill()
            churn_get = await timed(workers, workload.churn_gets, args.concurrency)
            result["churn"] = {"store": churn_store, "get": churn_get}
            result["killed"] = workload.killed
            print(f"  churn phase done ({len(workload.killed)} peers killed)", file=sys.stderr)
            graceful = True
        finally:
            await shutdown(workers, graceful)
            nursery.cancel_scope.cancel()
    return result


# ---------------------------------------------------------------- report


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_report(results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'system':<10} {'phase':<7} {'op':<6} {'p50 ms':>9} {'p99 ms':>9} {'success':>17}")
    for name, r in results.items():
        if "error" in r or "skipped" in r:
            print(f"{name:<10} {r.get('error') or r.get('skipped')}")
            continue
        for phase in PHASES:
            for op in OPS:
                s = r[phase][op]
                rate = f"{s['ok']}/{s['n']} ({100 * s['ok'] / max(s['n'], 1):.1f}%)"
                print(f"{name:<10} {phase:<7} {op:<6} {fmt_ms(s['p50_ms']):>9} {fmt_ms(s['p99_ms']):>9} {rate:>17}")
                if s["errors"]:
                    print(f"{'':<25}failures: {s['errors']}")
        print(f"{name:<10} startup {r['startup_s']:.1f} s (first spawn to all ready)")
    h, d = results.get("hivemind", {}), results.get("dedloc", {})
    if "startup_s" in h and "startup_s" in d:
        print("\nhivemind / dedloc (> 1 means dedloc is faster)")
        for phase in PHASES:
            for op in OPS:
                for metric in ("p50_ms", "p99_ms"):
                    hv, dv = h[phase][op][metric], d[phase][op][metric]
                    ratio = f"{hv / dv:.2f}x" if hv and dv else "-"
                    print(f"  {phase:<7} {op:<6} {metric[:3]:<4} {ratio:>8}")
        print(f"  startup             {h['startup_s'] / d['startup_s']:>8.2f}x")


async def raise_on_sigterm() -> None:
    """Turn SIGTERM into the KeyboardInterrupt that Ctrl-C gives, inside trio, so cleanup runs."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            raise KeyboardInterrupt


async def run_all(args: argparse.Namespace, systems: list[System]) -> dict[str, dict[str, Any]]:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(raise_on_sigterm)
        results = await run_systems(args, systems)
        nursery.cancel_scope.cancel()
    return results


async def run_systems(args: argparse.Namespace, systems: list[System]) -> dict[str, dict[str, Any]]:
    workload = make_workload(args.peers, args.keys, args.churn_keys, args.kill_fraction, args.seed, args.latest)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="dht-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"worker logs in {log_dir}", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    for system in systems:
        reason = system.unavailable()
        if reason:
            print(f"skipping {system.name}: {reason}", file=sys.stderr)
            results[system.name] = {"skipped": reason}
            continue
        print(f"{system.name}: {args.peers} peers", file=sys.stderr)
        try:
            results[system.name] = await bench_system(system, workload, args, log_dir)
        except RuntimeError as exc:
            print(f"  {system.name} failed: {exc}", file=sys.stderr)
            results[system.name] = {"error": str(exc)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="dedloc,hivemind")
    parser.add_argument("--peers", type=int, default=32)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--churn-keys", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kill-fraction", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latest", action="store_true",
                        help="gets ask every replica and merge (get(key, latest=True)) instead of taking the first copy")
    parser.add_argument("--json", metavar="OUT", help="write all numbers here")
    parser.add_argument("--log-dir", help="worker stderr logs (default: a new temp dir)")
    args = parser.parse_args()
    if args.peers < 2:
        parser.error("--peers must be at least 2")
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {sorted(SYSTEMS)}")

    interrupted = False
    try:
        results = trio.run(run_all, args, [SYSTEMS[n] for n in names])
    except* KeyboardInterrupt:
        interrupted = True
    finally:
        for pgid in list(LIVE_GROUPS):  # whatever escaped the orderly shutdown
            kill_group(pgid)
    if interrupted:
        print("interrupted; all workers killed", file=sys.stderr)
        sys.exit(130)
    print_report(results)
    if args.json:
        config = {k: getattr(args, k) for k in ("peers", "keys", "churn_keys", "concurrency", "kill_fraction", "seed", "latest")}
        Path(args.json).write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
