"""36 DHT peers in 3 processes; a quarter die mid-run and 12 new ones join: reads still succeed.

Each process is ``bench/dht_peer.py --nodes 12`` (real Nodes on loopback,
driven by JSON lines). Values are stored with the default 5 replicas; then,
while reads are under way, 9 random peers (never the bootstrap peer) are shut
down and a fourth process adds 12 fresh peers. The test prints the success rate
it measured and requires at least 97% (losing all 5 replicas of a key to a
random quarter of the peers has a probability of about 0.1%).
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
# 36 peers, not 100: a small DHT is a full mesh (each join's lookups reach every peer), and a
# connection costs both ends ~20 ms of CPU, so starting n peers costs n^2: 100 took 80 s of CI's two
# cores, 60 took 42 s; at 45 the test took 70 s alone (118 s of CPU) and 141-168 s in CI, at 36 53 s
# (92 s of CPU). The odds of losing a key (all 5 replicas in the quarter that dies) do not depend
# on n: about 0.1%. A DHT keeping one replica reads 77-81% here and fails.
PER_PROCESS = 12
PROCESSES = 3
KEYS = 150
CONCURRENCY = 8


class Worker:
    """One ``bench/dht_peer.py`` process: send a command, await its reply by id."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.nodes: list[dict[str, Any]] = []
        self._waiting: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self._next = 0
        self._writing = trio.Lock()

    @classmethod
    async def start(cls, nursery: trio.Nursery, initial: list[str], nodes: int) -> Worker:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(REPO / "bench" / "dht_peer.py"), "--nodes", str(nodes), "--initial-peers", *initial],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
        worker = cls(process)
        ready = trio.Event()
        nursery.start_soon(worker._read, ready)
        with trio.fail_after(240):
            await ready.wait()
        return worker

    async def _read(self, ready: trio.Event) -> None:
        assert self.process.stdout is not None
        buffer = b""
        async for chunk in self.process.stdout:
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                if message.get("ready"):
                    self.nodes = message["nodes"]
                    ready.set()
                elif message.get("id") in self._waiting:
                    await self._waiting.pop(message["id"]).send(message)

    async def call(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self._next += 1
        command["id"] = self._next
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self._waiting[self._next] = send
        async with self._writing:
            await self.process.stdin.send_all((json.dumps(command) + "\n").encode())
        with trio.fail_after(30):
            return await receive.receive()

    async def quit(self) -> None:
        with trio.move_on_after(15):
            if self.process.stdin is not None:
                try:
                    await self.process.stdin.send_all(b'{"op": "quit"}\n')
                except trio.BrokenResourceError:
                    pass
            await self.process.wait()
        if self.process.returncode is None:
            self.process.kill()


@pytest.mark.realtime  # the whole churn run bounded
async def test_reads_survive_a_quarter_of_the_peers_dying_and_new_ones_joining() -> None:
    rng = random.Random(5)
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        workers: list[Worker] = []
        try:
            first = await Worker.start(nursery, [], PER_PROCESS)
            workers.append(first)
            bootstrap = first.nodes[0]["addrs"]
            workers += await _start_all(nursery, bootstrap, PROCESSES - 1)
            peers = [(w, i) for w in workers for i in range(len(w.nodes))]
            assert len(peers) == PER_PROCESS * PROCESSES
            print(f"\n{len(peers)} peers up in {time.perf_counter() - started:.1f} s")

            values = {f"churn-{i}": f"{rng.getrandbits(64):016x}" for i in range(KEYS)}
            stored = await _run(rng, [("store", k, v) for k, v in values.items()], lambda: peers)
            assert all(r["ok"] for r in stored), [r for r in stored if not r["ok"]][:3]

            doomed = rng.sample(peers[1:], len(peers) // 4)
            alive = list(peers)
            reads = [("get", k, v) for k, v in values.items()] * 2
            rng.shuffle(reads)
            before, during = len(reads) // 4, len(reads) // 4 + 3 * len(reads) // 8
            # a quarter of the reads on the whole swarm; then the quarter dies (every later read comes
            # after: when the reads and the kills raced, a fast run read everything before the first
            # kill, and a DHT keeping one replica passed); 3/8 of the reads while 12 new peers join
            # (they take reads once up); the last 3/8 on the swarm as it is then
            results = await _run(rng, reads[:before], lambda: alive)
            alive[:] = [p for p in peers if p not in doomed]
            for worker, index in doomed:
                await worker.call(op="kill", node=index)
            async with trio.open_nursery() as joining:

                async def join() -> None:
                    newcomers = await Worker.start(nursery, bootstrap, PER_PROCESS)
                    workers.append(newcomers)
                    alive.extend((newcomers, i) for i in range(PER_PROCESS))

                joining.start_soon(join)
                results += await _run(rng, reads[before:during], lambda: alive)
            results += await _run(rng, reads[during:], lambda: alive)
            ok = sum(1 for (_, _, v), r in zip(reads, results) if r["ok"] and r["value"] == v)
            rate = ok / len(reads)
            latencies = sorted(r["ms"] for r in results if r["ok"])
            p50 = latencies[len(latencies) // 2]
            p99 = latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)]
            print(f"\nDHT churn: {len(peers)} peers in {PROCESSES} processes, {len(doomed)} shut down and "
                  f"{PER_PROCESS} joined during the reads; {ok}/{len(reads)} reads returned the stored value "
                  f"({100 * rate:.1f}%), p50 {p50:.1f} ms, p99 {p99:.1f} ms")
            assert rate >= 0.97
        finally:
            with trio.CancelScope(shield=True):
                for worker in workers:
                    await worker.quit()
            nursery.cancel_scope.cancel()


async def _start_all(nursery: trio.Nursery, bootstrap: list[str], count: int) -> list[Worker]:
    started: list[Worker] = []

    async def one() -> None:
        started.append(await Worker.start(nursery, bootstrap, PER_PROCESS))

    async with trio.open_nursery() as group:
        for _ in range(count):
            group.start_soon(one)
    return started


async def _run(rng: random.Random, ops: list[tuple[str, str, str]], peers: Any) -> list[dict[str, Any]]:
    """Run ``ops`` with ``CONCURRENCY`` in flight, each on a random peer of ``peers()`` at that moment."""
    results: list[dict[str, Any]] = [{}] * len(ops)
    limit = trio.Semaphore(CONCURRENCY)

    async def one(i: int, op: str, key: str, value: str) -> None:
        async with limit:
            worker, index = rng.choice(peers())
            if op == "store":
                results[i] = await worker.call(op="store", key=key, value=value, ttl=600, node=index)
            else:
                results[i] = await worker.call(op="get", key=key, latest=False, node=index)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i, (op, key, value) in enumerate(ops):
            nursery.start_soon(one, i, op, key, value)
    assert time.perf_counter() - started < 400
    return results
