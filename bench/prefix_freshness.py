"""Does a first-copy read see every server of a prefix? The MoE beam search's reads, simulated.

    .venv/bin/python bench/prefix_freshness.py [--peers 1000] [--servers 16] [--join-every 10]
        [--reads-per-s 4] [--replicas 5] [--seed 0] [--json OUT]

The beam search (training/moe/beam_search.py) reads each uid prefix as a first copy: the read
stops at the first peer that holds the prefix's dictionary, whose subkeys are the servers that
declared under it. Merging every replica's copy instead cost cold searches 2.5-5x on loopback.
The risk of the first copy: a read that found the prefix past a peer that lacked it left a copy
there (``DHT._cache``), a snapshot that the servers' later declarations, sent to the replicas,
never update; a reader whose lookup met it first missed every server declared since. The DHT
now leaves such copies of plain values only (:func:`p2p.dht.replication.path_copy`).

This runs :class:`p2p.sim.dht.DHTSim` (the DHT's own routing, traversal and store on the
calibrated network model, a static network at steady state) with ``--servers`` expert servers
joining one every ``--join-every`` seconds, each declaring its subkey under one prefix key as
``ExpertServer`` does (every 30 s, living 90 s); meanwhile random peers read the prefix,
``--reads-per-s``, four ways in four runs of the same network: first copy as the DHT reads now,
first copy as it read before (copies of dictionaries left on the path too), first copy leaving
no copies, and merged (``latest``). Printed for each: the reads that missed a server declared at
least 5 s before the read began, and how many servers they missed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p.dht import DHTConfig  # noqa: E402
from p2p.dht.records import DHTKey, DHTRecord, ValueWithExpiration  # noqa: E402
from p2p.sim.dht import DHTSim, DHTSimConfig, SimPeer  # noqa: E402

#: ExpertServer's defaults (training/moe/server.py ServerConfig)
UPDATE_PERIOD_S = 90.0 / 3
EXPIRATION_S = 90.0
#: a server counts as declared once its first store has been done this long
SETTLED_S = 5.0
MODES = ("first copy, the DHT now", "first copy, as before", "first copy, no path copies", "merged (latest)")


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    cpu0 = time.process_time()
    sim = DHTSim(DHTSimConfig(peers=args.peers, seed=args.seed, warm=True, churn=False,
                              dht=DHTConfig(replicas=args.replicas)))
    sim.run(60.0)
    rng = random.Random(args.seed + 5)
    key = DHTKey.encode("ffn.0")
    live = [p for p in sim.peers if p.alive]
    servers = rng.sample([p for p in live if p.answers], args.servers)
    declared: dict[int, float] = {}  # server -> when its first store was done
    start = sim.now

    def declare(i: int) -> None:
        record = DHTRecord.make("ffn.0", b"expert", sim.wall() + EXPIRATION_S, subkey=f"{i}")

        def stored(_: Any) -> None:
            declared.setdefault(i, sim.now)
        sim.store(servers[i], record, stored)
        sim.engine.at(UPDATE_PERIOD_S, declare, i)

    for i in range(args.servers):
        sim.engine.at(i * args.join_every, declare, i)
    reads: list[tuple[int, int]] = []  # (servers expected, of them missed)
    duration = args.servers * args.join_every + 60.0

    def read() -> None:
        began = sim.now
        expected = {i for i, t in declared.items() if t <= began - SETTLED_S}
        reader: SimPeer = rng.choice(live)

        def finished(_s: float, value: ValueWithExpiration | None, _stalled: bool) -> None:
            seen = set(value.value) if value is not None and isinstance(value.value, dict) else set()
            got = {int(k) for k in seen}  # type: ignore[call-overload]
            if expected:
                reads.append((len(expected), len(expected - got)))
        sim.read(reader, key, finished, latest=mode == MODES[3], leave_copy=mode in MODES[:2],
                 copy_dictionaries=mode == MODES[1])

    n = int(duration * args.reads_per_s)
    for j in range(n):
        sim.engine.at(5.0 + j / args.reads_per_s, read)
    sim.run(start + duration + 10.0 + sim.config.dht.op_timeout)
    missed = [m for _, m in reads if m]
    return {"mode": mode, "reads": len(reads), "reads_missing": len(missed),
            "share_missing": len(missed) / max(1, len(reads)),
            "mean_missed_when_missing": statistics.fmean(missed) if missed else 0.0,
            "max_missed": max(missed, default=0), "copies_sent": sim.copies_sent,
            "cpu_s": time.process_time() - cpu0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=1000)
    p.add_argument("--servers", type=int, default=16, help="expert servers declaring under the prefix")
    p.add_argument("--join-every", type=float, default=10.0, help="seconds between two servers' first declarations")
    p.add_argument("--reads-per-s", type=float, default=4.0)
    p.add_argument("--replicas", type=int, default=DHTConfig().replicas)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.servers < 1 or args.peers < args.servers * 2 or args.join_every <= 0 or args.reads_per_s <= 0:
        p.error("want --servers >= 1, --peers >= 2x --servers, --join-every and --reads-per-s > 0")
    results = []
    for mode in MODES:
        r = run(mode, args)
        results.append(r)
        print(f"{mode:28s} {r['reads']:5d} reads: {r['reads_missing']:4d} ({r['share_missing']:.1%}) missed a "
              f"declared server (mean {r['mean_missed_when_missing']:.1f}, max {r['max_missed']} of "
              f"{args.servers}); {r['cpu_s']:.0f} s CPU", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"peers": args.peers, "servers": args.servers, "replicas": args.replicas,
                                         "runs": results}, indent=1))


if __name__ == "__main__":
    main()
