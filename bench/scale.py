"""Internet scale, simulated on the project's own code: the DHT at thousands of peers.

    .venv/bin/python bench/scale.py [--peers 1000,3000,10000] [--stores 100] [--gets 300]
        [--settle 900] [--join 600] [--seed 0] [--rules dedloc,kad-dht-2022] [--crawl 300] [--no-compare]
        [--survive 7200] [--shared-group-share 0.05] [--shared-groups 1]
        [--lookups-per-hour 20] [--jobs 2] [--json OUT]

Each size runs :class:`p2p.sim.dht.DHTSim` (the DHT's routing table, lookups, traversal,
serving rules and record store, driven by a virtual clock over the network model of
``p2p/sim/network.py``, calibrated to the IPFS measurements in ``p2p/sim/calibration.py``):
the peers join over ``--join`` seconds through four bootstrap peers, sessions end and
new peers replace them (churn), and after ``--settle`` simulated seconds the bench

* measures the routing tables as RFM19's crawl did (unreachable entries in bucket 0 and in
  the non-full buckets, peers that know all / fewer than 18 of their 20 closest), beside
  the crawl's figures: the calibration check (within 5 points); with ``--crawl S`` the tables
  are read over S simulated seconds, each at its own moment, as the crawl read them;
* stores ``--stores`` records (replicas = 20, as IPFS's provider records) from random live
  peers and counts how many of the 20 closest live servers took each;
* reads each back ``--gets`` times in all (first copy, as an IPFS content lookup) from random
  live peers: p50 / p95 / mean seconds beside IPFS's 0.62 s mean;
* counts the *stalled* lookups: a get, or a store's lookup, that waited for one query until
  that query's timeout (3 s), which is what one silent peer among the closest did to every
  lookup before the reply timer; and, apart, those that took 3 s or more in all (lost
  messages and slow peers one after another).

With compare on (the default) the smallest size runs a second time with lookups that wait
for every reply (``DHTSimConfig.reply_timer=False``: the DHT before the fix), so the table
shows what the simulation found. Simulated seconds cost CPU seconds; each size prints both.

With ``--survive S`` the smallest size also keeps ``--stores`` records (a day's expiration)
through S simulated seconds of churn, twice: with the DHT's replication (hand-over to a server
new to a replica's table, republish under the Kademlia paper's rule) and without (records stay
where their store put them). Every 10 minutes it counts the holders among the current 20
closest live servers; at the end it reads each record back, and reports the copies of a
record sent per hour by hand-overs and by every store.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from averaging.matchmaking import MatchmakingConfig  # noqa: E402
from averaging.moshpit import GridPosition, expected_rounds, rounds_to_average  # noqa: E402
from averaging.sim.matchmaking import MatchmakingSim, Outcome, summary  # noqa: E402
from averaging.sim.moshpit import Grouping, MoshpitSimConfig, Positions, simulate  # noqa: E402
from p2p.dht.records import DHTRecord  # noqa: E402
from p2p.errors import ConfigError  # noqa: E402
from p2p.dht.routing import DHTID  # noqa: E402
from p2p.sim import calibration as cal  # noqa: E402
from p2p.sim.dht import DHTSim, DHTSimConfig, Rules, SimPeer, Stored, make_record  # noqa: E402
from p2p.sim.network import NetworkModel  # noqa: E402

#: The issue's goals for the same operations.
GOAL_LOOKUP_P50_S = 0.3
GOAL_LOOKUP_P95_S = 1.0
GOAL_REPLICAS = 19


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def network_model(args: argparse.Namespace) -> NetworkModel:
    """The simulated internet the flags describe (its ConfigError names a bad setting)."""
    return NetworkModel(shared_group_share=args.shared_group_share, shared_groups=args.shared_groups)


def dht_at(peers: int, args: argparse.Namespace, *, reply_timer: bool = True, rules: Rules = Rules.DEDLOC) -> dict[str, Any]:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    model = network_model(args)
    sim = DHTSim(DHTSimConfig(peers=peers, seed=args.seed, join_spread_s=args.join, reply_timer=reply_timer,
                              warm=not args.cold, rules=rules, lookups_per_hour=args.lookups_per_hour),
                 model.calibrate(args.seed))
    sim.run(args.settle)
    health = sim.crawl(args.crawl, sample=args.sample)
    rng = random.Random(args.seed + 7)
    stores: list[tuple[bytes, Stored]] = []
    records = [make_record(rng, sim.wall()) for _ in range(args.stores)]
    timeout = sim.config.dht.rpc_timeout

    def online() -> SimPeer:  # a peer online when its operation starts (churn goes on meanwhile)
        while not (peer := rng.choice(sim.peers)).alive:
            pass
        return peer

    for i, record in enumerate(records):  # a store every 0.2 s
        sim.engine.at(i * 0.2, lambda r=record: sim.store(online(), r, lambda done: stores.append((r.key, done))))
    gets: list[tuple[float, bool, bool]] = []
    for i in range(args.gets):  # gets of what was stored 10 s earlier at least, ten a second
        record = records[i % len(records)]
        sim.engine.at(10.0 + (i % len(records)) * 0.2 + (i // len(records)) * 0.05,
                      lambda r=record: sim.get(online(), r.key, lambda *done: gets.append(done)))
    sim.run(sim.now + 10.0 + args.stores * 0.2 + sim.config.dht.op_timeout)
    servers = sim.live_servers()
    replicas = [sum(t.peer_id in done.holders for t in sim.closest(int(DHTID.from_key(key)), 20, servers))
                for key, done in stores]
    lookups = [s for s, _, _ in gets]
    return {
        "peers": peers,
        "start": "cold" if args.cold else "warm",
        "rules": rules.value,
        "reply_timer": reply_timer,
        "shared_group_share": args.shared_group_share,
        "shared_groups": args.shared_groups,
        "lookups_per_hour": args.lookups_per_hour,
        "health": health,
        "lookup_p50_s": percentile(lookups, 0.5),
        "lookup_p95_s": percentile(lookups, 0.95),
        "lookup_mean_s": statistics.fmean(lookups) if lookups else float("nan"),
        "found": sum(f for _, f, _ in gets) / max(1, len(gets)),
        "gets": len(gets),
        "store_p50_s": percentile([d.seconds for _, d in stores], 0.5),
        "store_replicas_median": statistics.median(replicas) if replicas else float("nan"),
        "store_replicas_mean": statistics.fmean(replicas) if replicas else float("nan"),
        "store_replicas_p5": percentile([float(r) for r in replicas], 0.05),
        "stores": len(stores),
        # lookups that waited for a query until its timeout (what one silent peer did to every lookup)
        "stalled_lookups": sum(stalled for _, _, stalled in gets) + sum(d.stalled for _, d in stores),
        # and lookups that took that long in all, through lost messages and slow peers one after another
        "lookups_over_timeout": sum(s >= timeout for s in lookups) + sum(d.lookup_s >= timeout for _, d in stores),
        "calls": sim.calls,
        "timeouts": sim.timeouts,
        "simulated_s": sim.now,
        "cpu_s": time.process_time() - cpu0,
        "wall_s": time.perf_counter() - wall0,
    }


def survival(peers: int, args: argparse.Namespace, *, replication: bool) -> dict[str, Any]:
    """``--survive``: records kept through churn, with or without the DHT's replication."""
    cpu0 = time.process_time()
    sim = DHTSim(DHTSimConfig(peers=peers, seed=args.seed, warm=True, replication=replication))
    sim.run(args.settle)
    rng = random.Random(args.seed + 11)
    records = [DHTRecord.make(f"kept-{rng.getrandbits(64):016x}", b"v" * 64, sim.wall() + 86400)
               for _ in range(args.stores)]

    def online() -> SimPeer:
        while not (peer := rng.choice(sim.peers)).alive:
            pass
        return peer

    for i, record in enumerate(records):
        sim.engine.at(i * 0.2, lambda r=record: sim.store(online(), r, lambda _: None))
    sim.run(sim.now + args.stores * 0.2 + sim.config.dht.op_timeout)
    handed, copies, start = sim.handed_over, sim.copies_sent, sim.now
    snapshots: list[dict[str, float]] = []
    while True:
        servers = sim.live_servers()
        held = [sim.holders(r.key, servers) for r in records]
        snapshots.append({"t_s": sim.now - start, "mean": statistics.fmean(held),
                          "p5": percentile([float(h) for h in held], 0.05), "min": float(min(held))})
        if sim.now - start >= args.survive:
            break
        sim.run(sim.now + min(600.0, args.survive - (sim.now - start)))
    hours = (sim.now - start) / 3600
    reads: list[bool] = []
    for record in records:
        sim.get(online(), record.key, lambda _, found, __: reads.append(found))
    sim.run(sim.now + sim.config.dht.op_timeout)
    return {"peers": peers, "replication": replication, "records": len(records), "seconds": sim.now - start,
            "snapshots": snapshots, "found": sum(reads) / max(1, len(reads)),
            "handed_over_per_record_hour": (sim.handed_over - handed) / len(records) / hours,
            "copies_per_record_hour": (sim.copies_sent - copies) / len(records) / hours,
            "cpu_s": time.process_time() - cpu0}


def survival_table(runs: list[dict[str, Any]]) -> str:
    shown = [i for i, snap in enumerate(runs[0]["snapshots"])
             if snap["t_s"] % 1800 < 1 or i == len(runs[0]["snapshots"]) - 1]  # each half hour, and the end
    lines = [f"records kept through churn ({runs[0]['peers']} peers, {runs[0]['records']} records, "
             f"{runs[0]['seconds'] / 3600:.1f} h): holders among the current 20 closest live servers, "
             "mean / p5 / min", "",
             "| replication | " + " | ".join(f"{runs[0]['snapshots'][i]['t_s'] / 60:.0f} min" for i in shown)
             + " | found at the end | hand-over copies / record / h | all copies / record / h | CPU |",
             "|---|" + "---|" * (len(shown) + 4)]
    for r in runs:
        cells = " | ".join(f"{r['snapshots'][i]['mean']:.1f} / {r['snapshots'][i]['p5']:g} / {r['snapshots'][i]['min']:g}"
                           for i in shown)
        lines.append(f"| {'on' if r['replication'] else 'off'} | {cells} | {100 * r['found']:.0f}% "
                     f"| {r['handed_over_per_record_hour']:.0f} | {r['copies_per_record_hour']:.0f} "
                     f"| {r['cpu_s']:.0f} s |")
    return "\n".join(lines)


FAILURE_RATES = (0.0, 0.001, 0.002, 0.004)
CASES = (("grid, first keys from peer ids", Grouping.GRID, Positions.PEER_IDS),
         ("grid, full (each cell m peers)", Grouping.GRID, Positions.FULL),
         ("random groups of m", Grouping.RANDOM, Positions.PEER_IDS))


def moshpit(args: argparse.Namespace) -> dict[str, Any]:
    """The distance to the global average per round, per failure rate and case, and matchmaking."""
    n, m, d = args.moshpit_peers, args.group_size, args.dims
    out: dict[str, Any] = {"peers": n, "group_size": m, "dims": d, "exact_rounds": rounds_to_average(n, m), "cases": []}
    for rate in FAILURE_RATES:
        for name, grouping, positions in CASES:
            if positions is Positions.FULL and m ** d != n:
                continue
            run = simulate(MoshpitSimConfig(peers=n, group_size=m, dims=d, failure_rate=rate, rounds=args.moshpit_rounds,
                                            grouping=grouping, positions=positions, seed=args.seed))
            out["cases"].append({"case": name, "failure_rate": rate, "rounds_to_1e-6": run.rounds_to(1e-6),
                                 "distance": run.distance, "failed_groups": run.failed_groups, "groups": run.groups,
                                 "alone": run.alone, "expected_rounds": expected_rounds(n, m, rate)})
    if not args.no_matchmaking:
        cpu0 = time.process_time()
        sim = DHTSim(DHTSimConfig(peers=n, seed=args.seed, warm=True, churn=False))
        sim.run(60.0)
        world = MatchmakingSim(sim, MatchmakingConfig(target_size=m, min_size=2, gather_time=3.0, timeout=30.0))
        per_round: list[list[Outcome]] = []
        grid = {pid: GridPosition.initial(m, d, pid.to_bytes()) for pid in world.peers}
        world.rounds(grid, args.matchmaking_rounds, 2.0, args.matchmaking_period, per_round.extend)
        # the last round begins at most (R - 1) periods in (or a 30 s round and its spread later,
        # per round, when rounds run long), and ends within 60 s: one round ran 60 s before
        sim.run(sim.now + (args.matchmaking_rounds - 1) * max(35.0, args.matchmaking_period) + 60.0)
        outcomes = [o for r in per_round for o in r]
        out["matchmaking"] = {**summary(outcomes), "rounds": args.matchmaking_rounds,
                              "period_s": args.matchmaking_period, "cpu_s": time.process_time() - cpu0,
                              "per_round": [summary(r) for r in per_round]}
    return out


def moshpit_table(mp: dict[str, Any]) -> str:
    lines = [f"Moshpit, {mp['peers']} peers in groups of m = {mp['group_size']}, d = {mp['dims']} "
             f"(exact in {mp['exact_rounds']} rounds on a full grid without failures): distance to the global "
             "average (mean squared, over the start's) after each round; a group with a failed member keeps "
             "its values (strict step) and moves on the grid", "",
             "| failure rate | case | rounds to 1e-6 | after 1 / 2 / 3 / 4 / 5 rounds | groups failed | alone | "
             "expected rounds (Appendix C) |", "|---|---|---|---|---|---|---|"]
    for c in mp["cases"]:
        after = " / ".join(f"{x:.1e}" for x in c["distance"][1:6])
        lines.append(f"| {100 * c['failure_rate']:.1f}% | {c['case']} | {c['rounds_to_1e-6']} | {after} "
                     f"| {c['failed_groups']} of {c['groups']} | {c['alone']} | {c['expected_rounds']:.2f} |")
    if "matchmaking" in mp:
        g = mp["matchmaking"]
        rounds = int(g.get("rounds", 1))
        who = f"{g['peers'] / rounds:.0f} peers: the live ones that answer"
        if rounds > 1:
            who += f"; {rounds} rounds each, {g['period_s']:g} s apart: {g['peers']:.0f} peer-rounds"
        lines += ["", f"matchmaking over the simulated DHT ({who}; "
                  "declarations under each cell's key, joins to leaders): a group after "
                  f"{g['formed_p50_s']:.1f} s median, {g['formed_p95_s']:.1f} s p95, {g['formed_max_s']:.1f} s at most; "
                  f"{100 * g['without_group']:.2f}% without a group by the 30 s deadline "
                  f"({round(g['without_group'] * g['peers'])} of {g['peers']:.0f}); "
                  f"mean group size {g['group_size_mean']:.1f} ({g['cpu_s']:.0f} s CPU)"]
        if rounds > 1:
            lines.append("without a group, round by round: "
                         + ", ".join(str(round(r["without_group"] * r["peers"])) for r in g["per_round"]))
    return "\n".join(lines)


def calibration_rows(health: dict[str, float]) -> list[tuple[str, float, float]]:
    return [("unreachable among all peers in the tables", health["unreachable_in_tables"], cal.UNREACHABLE_SHARE),
            ("unreachable entries in bucket 0", health["unreachable_in_bucket_0"], cal.UNREACHABLE_IN_BUCKET_0),
            ("unreachable entries in non-full buckets", health["unreachable_in_non_full"], cal.UNREACHABLE_IN_NON_FULL),
            ("peers that know all 20 closest", health["know_all_20_closest"], cal.KNOW_ALL_20_CLOSEST),
            ("peers that know < 18 of 20 closest", health["know_under_18_closest"], cal.KNOW_UNDER_18_CLOSEST)]


def table(results: dict[str, Any]) -> str:
    lines = ["routing-table health (RFM19's measures) beside the IPFS crawl (28 crawls, 2022-04):", "",
             "| measure | " + " | ".join(f"{r['peers']} peers, {r['rules']}" for r in results["dht"]) + " | IPFS |",
             "|---|" + "---|" * (len(results["dht"]) + 1)]
    for i, (name, _, anchor) in enumerate(calibration_rows(results["dht"][0]["health"])):
        cells = [f"{100 * calibration_rows(r['health'])[i][1]:.1f}%" for r in results["dht"]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * anchor:.1f}% |")
    lines += ["", "operations (replicas = 20, 10% silent peers, 26% unreachable, churn):", "",
              "| peers | rules | reply timer | lookup p50 / p95 / mean | found | store p50 | replicas of the 20 closest: median / mean / p5 "
              "| stalled (waited a query's timeout) | took 3 s or more | CPU for simulated |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["dht"] + results.get("before", []):
        lines.append(f"| {r['peers']} | {r['rules']} | {'on' if r['reply_timer'] else 'off (before)'} "
                     f"| {r['lookup_p50_s']:.3f} / {r['lookup_p95_s']:.3f} / {r['lookup_mean_s']:.3f} s "
                     f"| {100 * r['found']:.0f}% | {r['store_p50_s']:.2f} s "
                     f"| {r['store_replicas_median']:g} / {r['store_replicas_mean']:.1f} / {r['store_replicas_p5']:g} "
                     f"| {r['stalled_lookups']} of {r['gets'] + r['stores']} | {r['lookups_over_timeout']} "
                     f"| {r['cpu_s']:.0f} s for {r['simulated_s']:.0f} s |")
    lines += ["", f"goals: lookup p50 <= {GOAL_LOOKUP_P50_S} s, p95 <= {GOAL_LOOKUP_P95_S} s (IPFS mean "
              f"{cal.IPFS_LOOKUP_MEAN_S} s); replicas >= {GOAL_REPLICAS} of 20 (IPFS {cal.IPFS_STORE_HOLDERS_MEAN}); "
              "no stalled lookup"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default="1000,3000,10000", help="sizes, comma-separated")
    p.add_argument("--stores", type=int, default=100)
    p.add_argument("--gets", type=int, default=300)
    p.add_argument("--settle", type=float, default=120.0, help="simulated seconds before measuring")
    p.add_argument("--cold", action="store_true",
                   help="start from joins (every peer within --join s) instead of a network at steady state; "
                        "use --settle 900 with it")
    p.add_argument("--join", type=float, default=600.0, help="with --cold: the peers join within this many seconds")
    p.add_argument("--sample", type=int, default=200, help="peers whose routing tables are measured")
    p.add_argument("--crawl", type=float, default=0.0,
                   help="read the routing tables over this many simulated seconds, as one crawl does (RFM19's "
                        "Nebula: 5-10 min); 0: at one instant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rules", default="dedloc",
                   help="whose routing-table rules, comma-separated: dedloc, kad-dht-2022 (go-libp2p-kad-dht's, "
                        "as the crawl met them: the calibration check)")
    p.add_argument("--shared-group-share", type=float, default=0.0,
                   help="share of peers whose address falls in one of --shared-groups IP groups (many peer IDs "
                        "on one cloud IP or /16): what a table's diversity filter counts together; 0: every peer "
                        "alone in its group (no measurement of the public network's share is at hand)")
    p.add_argument("--shared-groups", type=int, default=1, help="how many shared IP groups (at most 65,536)")
    p.add_argument("--lookups-per-hour", type=float, default=0.0,
                   help="lookups of random keys each peer makes per hour besides its maintenance (a content-routing "
                        "load; no measurement of the public network's rate is at hand); 0: maintenance only")
    p.add_argument("--no-compare", action="store_true", help="skip the run without the reply timer")
    p.add_argument("--moshpit-peers", type=int, default=1000)
    p.add_argument("--group-size", type=int, default=10, help="Moshpit's m")
    p.add_argument("--dims", type=int, default=3, help="Moshpit's d (m ** d cells)")
    p.add_argument("--moshpit-rounds", type=int, default=20)
    p.add_argument("--no-matchmaking", action="store_true", help="skip matchmaking over the simulated DHT")
    p.add_argument("--matchmaking-rounds", type=int, default=1,
                   help="rounds each peer matches, one after another as an averager in a loop does (the grid "
                        "advances by its index in the group, turned by the group's offset)")
    p.add_argument("--matchmaking-period", type=float, default=40.0,
                   help="with --matchmaking-rounds > 1: round r begins r * PERIOD s after the first (each peer within "
                        "2 s of it, or when its previous round ended if later): a training run's global steps")
    p.add_argument("--survive", type=float, default=0.0,
                   help="simulated seconds of churn the smallest size keeps --stores records through, with and "
                        "without the DHT's replication; 0: skip")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes: the runs are independent (default: 2, or 1 on one core)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    try:  # the settings' own checks, before any process starts (each run builds its own model)
        network_model(args)
    except ConfigError as e:
        p.error(str(e))
    sizes = [int(x) for x in args.peers.split(",")]
    results: dict[str, Any] = {"command": " ".join(sys.argv), "dht": []}
    rules = [Rules(x) for x in args.rules.split(",")]
    # Each run is its own seeded simulation: they go to ``--jobs`` processes, biggest first, and
    # the results are the same as one after another (the 10,000 peers take most of one core).
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs: dict[tuple[int, Rules], Future[dict[str, Any]]] = {
            (n, rule): pool.submit(dht_at, n, args, rules=rule) for n in sorted(sizes, reverse=True) for rule in rules}
        before = None if args.no_compare else pool.submit(dht_at, sizes[0], args, reply_timer=False)
        mosh = pool.submit(moshpit, args)
        kept = [pool.submit(survival, sizes[0], args, replication=on) for on in (True, False)] if args.survive else []
        for n in sizes:
            for rule in rules:
                r = runs[n, rule].result()
                results["dht"].append(r)
                print(f"dht: {n} peers, {rule.value}: lookup p50 {r['lookup_p50_s']:.3f} s, "
                      f"p95 {r['lookup_p95_s']:.3f} s; replicas median {r['store_replicas_median']:g}; "
                      f"stalled {r['stalled_lookups']}; {r['cpu_s']:.0f} s CPU", file=sys.stderr, flush=True)
        if before is not None:
            results["before"] = [before.result()]
        results["moshpit"] = mosh.result()
        if kept:
            results["survival"] = [f.result() for f in kept]
    largest = [r for r in results["dht"] if r["rules"] == rules[0].value][-1]
    results["summary"] = {f"dht.{k}": largest[k] for k in
                          ("lookup_p50_s", "lookup_p95_s", "store_replicas_median", "stalled_lookups")}
    results["summary"]["dht.peers"] = largest["peers"]
    worst = [c for c in results["moshpit"]["cases"] if c["case"] == CASES[0][0] and c["failure_rate"] == FAILURE_RATES[-1]]
    results["summary"]["moshpit.rounds_to_1e-6"] = worst[0]["rounds_to_1e-6"] if worst else None
    results["summary"]["moshpit.peers"] = args.moshpit_peers
    if "matchmaking" in results["moshpit"]:
        results["summary"]["moshpit.matchmaking_p50_s"] = results["moshpit"]["matchmaking"]["formed_p50_s"]
        results["summary"]["moshpit.without_group"] = results["moshpit"]["matchmaking"]["without_group"]
    print(table(results))
    print()
    print(moshpit_table(results["moshpit"]))
    if "survival" in results:
        print()
        print(survival_table(results["survival"]))
    if args.json:
        args.json.write_text(json.dumps({**results, **results["summary"]}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
