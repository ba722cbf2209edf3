"""Group all-reduce benchmark: dedloc and hivemind 1.1.12 side by side, on shaped namespace links.

    sudo .venv/bin/python bench/averaging.py [--systems dedloc,hivemind]
        [--setups homogeneous,heterogeneous,unshaped,table1,reliability] [--mbytes 40] [--rounds 3]
        [--reliability-rounds 1000] [--json OUT]

Every peer is its own process (bench/averaging_peer.py for dedloc,
bench/averaging_hivemind_peer.py in .venv-hivemind for hivemind, made by
bench/setup_hivemind.sh), speaking JSON lines to this driver, which needs
only the stdlib and trio. Systems run one after another on the same
topology and the same tensors (a peer's tensor and weight follow from the
round's seed and its peer id, bench/averaging_data.py, so each peer checks
its own result against the exact weighted average in float64).

Setups (issue "Group all-reduce that adapts to the swarm"):

  homogeneous    4 peers, each on a full-duplex 100/100 Mbit link (tc tbf,
                 nat/lab.py), --mbytes float32: time / the bandwidth
                 bound 2(n-1)/n * S/B.
  heterogeneous  200/200/40/40 Mbit: equal split and adaptive (dedloc: its
                 LP from the declared rates; hivemind: bandwidth=), and for
                 dedloc measured (nothing declared: the LP on the rates its
                 peers measured in two warm-up rounds), against the ideal
                 max(2(n-1)S/sum(B), S/B_min).
  unshaped       4 peers on 127.0.0.1: the CPU-bound reference.
  table1         DeDLOC Table 1 scaled to this machine (--table1-mbytes,
                 rates below): A 8 fast peers, B 16 slow peers, C = A + B,
                 D = B + one very fast auxiliary peer; plain all-reduce
                 (equal split), parameter server (one reducer, every other
                 peer reduces=False; in D the auxiliary) and ours (the LP).
  reliability    --reliability-peers peers on 127.0.0.1, small tensors,
                 --reliability-rounds rounds; during some rounds a random
                 peer is SIGKILLed (and restarted a few rounds later): the
                 count of complete, partial (reported) and silently wrong
                 rounds (complete, but off the exact average), and of live
                 peers whose step raised (peer_errors: reported, no average).
                 The first --spared peers are never killed: their private
                 memory (USS, with their child processes': hivemind's Go
                 daemon, its forked DHT and averager) after each round gives
                 the soak's growth per 100 rounds after a warm-up of a tenth
                 of the rounds (``memory``).

A round's time is the all-reduce alone, the slowest member's: dedloc's
RoundReport.elapsed; for hivemind, from a common "go" after its group formed
(``require_trigger``) to its result. Matchmaking is reported apart
(``step``). Every number is printed as min/median over --rounds.
Shaped setups run in network namespaces this driver makes (root needed);
nothing leaves loopback or those namespaces.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nat.lab import Lab, Shape, cleanup_stale  # noqa: E402
from harness import HIVEMIND_PYTHON, Worker, open_worker  # noqa: E402

READY_TIMEOUT_S = 120.0
QUIT_TIMEOUT_S = 10.0
LISTEN_PORT = 4001
PREFIX = "dlavg"


@dataclass(frozen=True)
class System:
    name: str
    python: Path
    script: Path

    def unavailable(self) -> str | None:
        if not self.python.exists():
            return f"{self.python.relative_to(REPO)} missing: run bench/setup_hivemind.sh"
        return None


SYSTEMS = {
    "dedloc": System("dedloc", Path(sys.executable), REPO / "bench" / "averaging_peer.py"),
    "hivemind": System("hivemind", HIVEMIND_PYTHON, REPO / "bench" / "averaging_hivemind_peer.py"),
}


@dataclass(frozen=True)
class PeerSpec:
    """One member: its link (0: unshaped), its role (full, sender, aux) and the split (adaptive, equal)."""

    up: float = 0.0
    down: float = 0.0
    role: str = "full"
    split: str = "adaptive"

    @property
    def shape(self) -> Shape | None:
        return Shape(self.up, self.down) if self.up > 0 and self.down > 0 else None


@dataclass
class Swarm:
    """The boot node and the averaging workers of one system on one topology."""

    system: System
    lab: Lab | None
    log_dir: Path
    elements: int
    group: int
    common: list[str] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    boot: Worker | None = None

    async def spawn(self, name: str, spec: PeerSpec, extra: Sequence[str]) -> Worker:
        listen = "/ip4/127.0.0.1/tcp/0"
        argv = [str(self.system.python), str(self.system.script), *extra]
        spawn = None
        if self.lab is not None:
            host = self.lab.hosts.get(name) or await self.lab.public_host(name, delay_ms=0, shape=spec.shape)
            listen = f"/ip4/{host.ip}/tcp/{LISTEN_PORT}"
            spawn = host.spawn
        return await open_worker(name, [*argv, "--listen", listen], log=self.log_dir / f"{self.system.name}-{name}.log",
                                 ready_timeout=READY_TIMEOUT_S, spawn=spawn)

    async def start_boot(self) -> None:
        self.boot = await self.spawn("boot", PeerSpec(), ["--boot"])

    def boot_addr(self) -> str:
        assert self.boot is not None
        good = [a for a in self.boot.addrs if "/tcp/" in a and "/p2p-circuit" not in a]
        if self.lab is not None:
            good = [a for a in good if "/127." not in a] or good
        return good[0] if "/p2p/" in good[0] else f"{good[0]}/p2p/{self.boot.peer_id}"

    def worker_args(self, spec: PeerSpec) -> list[str]:
        initial = [self.boot_addr()]
        if self.system.name == "hivemind":
            # hivemind's Go daemon finds a peer's address only through its own DHT, which did not
            # answer in the lab ("routing: not found": no group ever formed with 4 peers); given
            # every earlier peer's address, each daemon connects to the others at start.
            initial += [w.addrs[0] for w in self.workers if w.addrs]
        return ["--initial-peers", *initial, "--peers", str(self.group), "--elements", str(self.elements),
                "--up", f"{spec.up:g}", "--down", f"{spec.down:g}", "--role", spec.role, "--split", spec.split,
                *self.common]

    async def add(self, name: str, spec: PeerSpec) -> Worker:
        worker = await self.spawn(name, spec, self.worker_args(spec))
        self.workers.append(worker)
        return worker

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            for w in [*self.workers, *([self.boot] if self.boot else [])]:
                if w.proc.returncode is None:
                    try:
                        await w.send({"op": "quit"})
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            with trio.move_on_after(QUIT_TIMEOUT_S):
                for w in [*self.workers, *([self.boot] if self.boot else [])]:
                    await w.proc.wait()
            for w in [*self.workers, *([self.boot] if self.boot else [])]:
                w.kill()


async def run_round(swarm: Swarm, workers: list[Worker], rid: int, seed: int, aux: list[str],
                    timeout: float) -> list[dict[str, Any]]:
    """One round on ``workers``: every reply (a lost worker's as ok=false)."""
    replies: list[dict[str, Any]] = [{} for _ in workers]
    hivemind = swarm.system.name == "hivemind"

    async def one(i: int, w: Worker) -> None:
        try:
            await w.send({"op": "round", "id": rid, "seed": seed, "aux": aux})
            if hivemind:
                await w.receive(timeout + 10)  # grouped (the worker gives up on its group at timeout)
                await grouped.wait_all(i)
                await w.send({"op": "go", "id": rid})
            replies[i] = await w.receive(timeout + 10)
        except (EOFError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                json.JSONDecodeError) as exc:
            replies[i] = {"id": rid, "ok": False, "complete": False, "error": f"{type(exc).__name__}: {exc}"}
            grouped.arrive(i)

    grouped = Barrier(len(workers))
    async with trio.open_nursery() as nursery:
        for i, w in enumerate(workers):
            nursery.start_soon(one, i, w)
    return replies


class Barrier:
    """Every worker's group formed (or it failed): then all get "go" at once."""

    def __init__(self, n: int) -> None:
        self.waiting = set(range(n))
        self.event = trio.Event()

    def arrive(self, i: int) -> None:
        self.waiting.discard(i)
        if not self.waiting:
            self.event.set()

    async def wait_all(self, i: int) -> None:
        self.arrive(i)
        await self.event.wait()


def round_time(replies: list[dict[str, Any]]) -> float | None:
    """The slowest member's all-reduce time, or None when any member failed or was partial."""
    if not all(r.get("ok") and r.get("complete") for r in replies):
        return None
    return max(float(r["allreduce_s"]) for r in replies)


async def timed_rounds(system: System, specs: list[PeerSpec], args: argparse.Namespace, mbytes: float,
                       label: str, lab_needed: bool) -> dict[str, Any]:
    """Start a swarm of ``specs`` and run --rounds rounds: times, errors, failures."""
    elements = int(mbytes * 1e6 / 4)
    times: list[float] = []
    steps: list[float] = []
    errors: list[float] = []
    failures: list[str] = []
    aux_ids: list[str] = []
    async with AsyncExitStack() as stack:
        lab = None
        if lab_needed:
            lab = await stack.enter_async_context(Lab(prefix=PREFIX, netem=False))
        swarm = Swarm(system, lab, args.log_dir, elements, len(specs),
                      common=["--gather-time", str(args.gather_time), "--timeout", str(args.timeout), *tuning(args),
                              *getattr(args, "worker_extra", [])])
        stack.push_async_callback(swarm.close)
        await swarm.start_boot()
        with trio.fail_after(READY_TIMEOUT_S):
            if system.name == "hivemind":  # one by one: each gets the earlier ones' addresses (worker_args)
                for i, spec in enumerate(specs):
                    await swarm.add(f"p{i}", spec)
            else:
                async with trio.open_nursery() as nursery:
                    for i, spec in enumerate(specs):
                        nursery.start_soon(swarm.add, f"p{i}", spec)
        aux_ids = [w.peer_id for w, s in zip(swarm.workers, sorted_specs(swarm, specs)) if s.role == "aux"]
        if lab is not None and args.link_trace:
            await start_link_trace(lab, args.log_dir / f"{system.name}-{label}-links.txt")
        for r in range(args.rounds + args.warmup):
            replies = await run_round(swarm, swarm.workers, r, 1000 + r, aux_ids, args.timeout)
            t = round_time(replies)
            errs = [float(x["max_err"]) for x in replies if "max_err" in x]
            tag = "warm-up " if r < args.warmup else ""
            if t is None:
                bad = [x.get("error") or x.get("summary") for x in replies if not (x.get("ok") and x.get("complete"))]
                failures.append(str(bad[0]))
                print(f"  {label} {system.name} {tag}round {r}: FAILED: {bad[0]}", flush=True)
                continue
            print(f"  {label} {system.name} {tag}round {r}: all-reduce {t:.2f} s, "
                  f"step {max(x['step_s'] for x in replies):.2f} s, max error {max(errs, default=0):.1e}, "
                  f"split {'/'.join(f'{f:.2f}' for f in replies[0].get('fractions', []))}"
                  + (f", start skew {max(x['wall_start'] for x in replies) - min(x['wall_start'] for x in replies):.2f} s"
                     if all('wall_start' in x for x in replies) else "")
                  + (', cpu ' + '/'.join(f"{x['cpu_s']:.1f}" for x in replies) + ' s' if all('cpu_s' in x for x in replies) else ''),
                  flush=True)
            if r >= args.warmup:
                times.append(t)
                steps.append(max(float(x["step_s"]) for x in replies))
                errors.extend(errs)
        if lab is not None and args.link_trace:
            await dump_link_stats(lab, args.log_dir / f"{system.name}-{label}-stats.txt")
    out: dict[str, Any] = {"rounds": len(times), "failures": failures}
    if times:
        out.update(min_s=min(times), median_s=statistics.median(times), step_median_s=statistics.median(steps),
                   max_error=max(errors, default=0.0))
    return out


async def start_link_trace(lab: Lab, path: Path) -> None:
    """Sample every core-side link's byte counters (~10/s) into ``path`` for bench/link_trace.py.

    The core end of a host's link sees the host's upload as rx and its
    download as tx. Bounded (20,000 samples) and killed with the lab.
    """
    addrs = await lab.run_in(lab.core, ["ip", "-o", "-4", "addr", "show"])
    hosts = " ".join(f"{name}={host.ip}" for name, host in lab.hosts.items())
    with open(path, "w") as out:
        out.write(f"H {hosts}\n")
        for line in addrs.stdout.splitlines():
            out.write(f"A {line}\n")
    script = ("for i in $(seq 20000); do echo T $(date +%s.%N); for f in /sys/class/net/l*; do "
              "echo S ${f##*/} $(cat $f/statistics/rx_bytes) $(cat $f/statistics/tx_bytes); done; sleep 0.05; done")
    with open(path, "ab") as out:
        await lab.spawn_in(lab.core, ["sh", "-c", script], stdout=out)


async def dump_link_stats(lab: Lab, path: Path) -> None:
    """Each namespace's qdisc counters (drops) and TCP counters (retransmits, timeouts) into ``path``."""
    with open(path, "w") as out:
        for name, ns in [*((n, h.ns) for n, h in lab.hosts.items()), ("core", lab.core)]:
            for argv in (["tc", "-s", "qdisc", "show"], ["nstat", "-az"]):
                result = await lab.run_in(ns, argv)
                out.write(f"== {name}: {' '.join(argv)}\n{result.stdout}\n")


def sorted_specs(swarm: Swarm, specs: list[PeerSpec]) -> list[PeerSpec]:
    """The spec of each worker in swarm.workers' order (they were added concurrently)."""
    by_name = {f"p{i}": s for i, s in enumerate(specs)}
    return [by_name[w.name] for w in swarm.workers]


def systems_of(args: argparse.Namespace) -> list[System]:
    chosen = []
    for name in args.systems.split(","):
        system = SYSTEMS[name]
        why = system.unavailable()
        if why:
            print(f"skipping {name}: {why}", flush=True)
        else:
            chosen.append(system)
    return chosen


def fmt(x: dict[str, Any]) -> str:
    if "median_s" not in x:
        return f"failed ({len(x['failures'])} rounds): {x['failures'][:1]}"
    return f"min {x['min_s']:.2f} s, median {x['median_s']:.2f} s"


async def homogeneous(args: argparse.Namespace) -> dict[str, Any]:
    n, rate = 4, args.fast_mbit
    bound = 2 * (n - 1) / n * args.mbytes * 1e6 / (rate * 1e6 / 8)
    out: dict[str, Any] = {"peers": n, "mbit": rate, "mbytes": args.mbytes, "bound_s": bound}
    print(f"homogeneous: {n} x {rate:g} Mbit, {args.mbytes:g} MB; bound 2(n-1)/n*S/B = {bound:.2f} s", flush=True)
    for system in systems_of(args):
        res = await timed_rounds(system, [PeerSpec(rate, rate)] * n, args, args.mbytes, "homogeneous", True)
        out[system.name] = res
        if "median_s" in res:
            out[f"{system.name}_ratio_to_bound"] = res["median_s"] / bound
        print(f"homogeneous {system.name}: {fmt(res)}; ratio to bound "
              f"{out.get(f'{system.name}_ratio_to_bound', float('nan')):.2f}", flush=True)
    return out


async def heterogeneous(args: argparse.Namespace) -> dict[str, Any]:
    rates = [200.0, 200.0, 40.0, 40.0]
    n, size = len(rates), args.mbytes * 1e6
    ideal = max(2 * (n - 1) * size / (sum(rates) * 1e6 / 8), size / (min(rates) * 1e6 / 8))
    out: dict[str, Any] = {"mbit": rates, "mbytes": args.mbytes, "ideal_s": ideal}
    print(f"heterogeneous: {'/'.join(f'{r:g}' for r in rates)} Mbit, {args.mbytes:g} MB; ideal {ideal:.2f} s",
          flush=True)
    for system in systems_of(args):
        # measured (dedloc only; hivemind takes declared figures): nothing declared, the LP runs on
        # the rates measured in the warm-up rounds (at least two: the first has no figures yet)
        for mode in ("equal", "adaptive", "measured") if system.name == "dedloc" else ("equal", "adaptive"):
            run_args = argparse.Namespace(**{**vars(args), "warmup": max(args.warmup, 2)}) if mode == "measured" else args
            res = await timed_rounds(system, [PeerSpec(r, r, split=mode) for r in rates], run_args, args.mbytes,
                                     f"heterogeneous/{mode}", True)
            out[f"{system.name}_{mode}"] = res
            if "median_s" in res:
                key = {"equal": "equal_split", "adaptive": "adaptive", "measured": "measured"}[mode]
                out[f"{system.name}_{key}_s"] = res["median_s"]
                out[f"{system.name}_{key}_ratio_to_ideal"] = res["median_s"] / ideal
            print(f"heterogeneous {system.name} {mode}: {fmt(res)}", flush=True)
        eq, ad = out.get(f"{system.name}_equal_split_s"), out.get(f"{system.name}_adaptive_s")
        if eq and ad:
            out[f"{system.name}_adaptive_speedup"] = eq / ad
            print(f"heterogeneous {system.name}: adaptive {ad / ideal:.2f}x the ideal, "
                  f"{eq / ad:.2f}x faster than equal split", flush=True)
    return out


async def unshaped(args: argparse.Namespace) -> dict[str, Any]:
    n = 4
    out: dict[str, Any] = {"peers": n, "mbytes": args.mbytes, "hivemind_issue_reference_s": 2.47}
    print(f"unshaped: {n} peers on 127.0.0.1, {args.mbytes:g} MB", flush=True)
    for system in systems_of(args):
        res = await timed_rounds(system, [PeerSpec()] * n, args, args.mbytes, "unshaped", False)
        out[system.name] = res
        if "median_s" in res:
            out[f"{system.name}_s"] = res["median_s"]
        print(f"unshaped {system.name}: {fmt(res)}", flush=True)
    return out


async def table1(args: argparse.Namespace) -> dict[str, Any]:
    fast, slow, very = args.fast_mbit, args.slow_mbit, args.very_fast_mbit
    setups = {
        "A": [PeerSpec(fast, fast)] * 8,
        "B": [PeerSpec(slow, slow)] * 16,
        "C": [PeerSpec(fast, fast)] * 8 + [PeerSpec(slow, slow)] * 16,
        "D": [PeerSpec(slow, slow)] * 16 + [PeerSpec(very, very, role="aux")],
    }
    print(f"table1: {args.table1_mbytes:g} MB; fast {fast:g}, slow {slow:g}, very fast {very:g} Mbit", flush=True)
    out: dict[str, Any] = {"mbytes": args.table1_mbytes, "fast_mbit": fast, "slow_mbit": slow, "very_fast_mbit": very}
    system = SYSTEMS["dedloc"]
    for name, specs in setups.items():
        if name not in args.table1_setups:
            continue
        row: dict[str, Any] = {}
        for method in ("AR", "PS", "Ours"):
            if method == "AR":  # every member reduces an equal part (D: the auxiliary peer too)
                run = [PeerSpec(s.up, s.down, s.role, "equal") for s in specs]
            elif method == "PS":  # the fastest peer (D: the auxiliary one) reduces everything
                server = max(range(len(specs)), key=lambda i: (specs[i].role == "aux", specs[i].up))
                run = [PeerSpec(s.up, s.down, s.role if i == server else "sender") for i, s in enumerate(specs)]
            else:
                run = list(specs)
            res = await timed_rounds(system, run, args, args.table1_mbytes, f"table1/{name}/{method}", True)
            row[method] = res.get("median_s")
            row[f"{method}_detail"] = res
        out[name] = row
    print(f"\nDeDLOC Table 1, scaled ({args.table1_mbytes:g} MB, all-reduce seconds, median of {args.rounds}):")
    print(f"{'setup':<6}{'AR':>10}{'PS':>10}{'Ours':>10}")
    for name in setups:
        if name in out:
            cells = "".join(f"{out[name][m]:>10.2f}" if out[name][m] else f"{'fail':>10}" for m in ("AR", "PS", "Ours"))
            print(f"{name:<6}{cells}")
    return out


def tuning(args: argparse.Namespace) -> list[str]:
    """dedloc's all-reduce settings given to this driver, passed on to every worker."""
    out: list[str] = []
    for name in ("chunk_elements", "max_chunks_ahead"):
        if getattr(args, name) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


async def reliability(args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of small tensors with peers killed and restarted at random: partial vs silently wrong."""
    rng = random.Random(args.seed)
    n, elements = args.reliability_peers, args.reliability_elements
    out: dict[str, Any] = {}
    for system in systems_of(args):
        counts = {"rounds": 0, "complete": 0, "partial_reported": 0, "silently_wrong": 0, "failed": 0,
                  "kills": 0, "peer_errors": 0, "worst_complete_error": 0.0}
        steps: list[float] = []  # a peer's whole step (matchmaking + all-reduce), per reply
        allreduces: list[float] = []
        started = time.monotonic()
        async with AsyncExitStack() as stack:
            swarm = Swarm(system, None, args.log_dir, elements, n,
                          common=["--gather-time", "0.3", "--timeout", "20", "--stall-timeout", "3",
                                  "--min-size", "2"])
            stack.push_async_callback(swarm.close)
            await swarm.start_boot()
            for i in range(n):
                await swarm.add(f"p{i}", PeerSpec())
            dead: dict[int, int] = {}  # worker index -> round to restart at
            # each process's private memory (with its children's) after every round it answered:
            # a restarted worker starts a new series
            memory: dict[int, list[tuple[int, float]]] = {i: [] for i in range(n)}
            for r in range(args.reliability_rounds):
                if time.monotonic() - started > args.reliability_max_s:
                    print(f"  reliability {system.name}: stopping at the time limit after {r} rounds", flush=True)
                    break
                round_started = time.monotonic()
                for i, at in list(dead.items()):
                    if r >= at:
                        del dead[i]
                        swarm.workers[i] = await swarm.spawn(f"p{i}", PeerSpec(), swarm.worker_args(PeerSpec()))
                        memory[i] = []
                restarted = time.monotonic() - round_started
                live = [i for i in range(n) if i not in dead]
                victim = None
                killable = [i for i in live if i >= args.spared]
                if len(live) > 2 and killable and rng.random() < args.kill_rate:
                    victim = rng.choice(killable)
                replies = await run_reliability_round(swarm, [swarm.workers[i] for i in live], r, victim, rng,
                                                      live, args)
                if victim is not None:
                    counts["kills"] += 1
                    dead[victim] = r + rng.randint(1, 4)
                counts["rounds"] += 1
                for i, x in zip([i for i in live if i != victim], replies):
                    if "uss_mib" in x:
                        memory[i].append((r, float(x["uss_mib"])))
                ok = [x for x in replies if x.get("ok")]
                counts["peer_errors"] += len(replies) - len(ok)  # a live peer's step raised (reported, not silent)
                steps.extend(float(x["step_s"]) for x in ok)
                allreduces.extend(float(x["allreduce_s"]) for x in ok)
                if not ok:
                    counts["failed"] += 1
                for x in ok:
                    err = float(x.get("max_err", 0.0))
                    if x.get("complete") and err > args.tolerance:
                        counts["silently_wrong"] += 1
                        print(f"  SILENTLY WRONG round {r}: error {err:.2e}: {x.get('summary')}", flush=True)
                if ok and all(x.get("complete") for x in ok):
                    counts["complete"] += 1
                    counts["worst_complete_error"] = max(counts["worst_complete_error"],
                                                         max(float(x.get("max_err", 0.0)) for x in ok))
                elif ok:
                    counts["partial_reported"] += 1
                took = time.monotonic() - round_started
                if r % 50 == 0 or took > 3.0:
                    print(f"  reliability {system.name} round {r} ({took:.1f} s, {restarted:.1f} s of it restarting "
                          f"peers{', one killed' if victim is not None else ''}): {counts}", flush=True)
                    for x in replies:
                        if not x.get("ok"):
                            print(f"    a peer failed: {x.get('error')}", flush=True)
        counts["seconds"] = time.monotonic() - started
        if steps:
            counts["step_s_median"] = statistics.median(steps)
            counts["allreduce_s_median"] = statistics.median(allreduces)
        grown = memory_growth(memory, int(counts["rounds"]))
        out[system.name] = {**counts, "memory": grown}
        print(f"reliability {system.name}: {counts}", flush=True)
        print(f"reliability {system.name} memory: { {k: v for k, v in grown.items() if k != 'series'} }", flush=True)
    return out


def memory_growth(memory: dict[int, list[tuple[int, float]]], rounds: int) -> dict[str, Any]:
    """The memory of the workers that lived through the run (hivemind #654: peers' RAM grew with
    every failed round until training stopped): their private MiB after the first tenth of the
    rounds (the warm-up: buffers, caches, the first groups) and at the end, and the slope after
    the warm-up, least squares, in MiB per 100 rounds."""
    warm = max(1, rounds // 10)
    lived = {i: [(r, m) for r, m in series if r >= warm] for i, series in memory.items()
             if series and series[0][0] < warm and series[-1][0] >= rounds - 2}
    slopes, first, last = [], [], []
    kept: dict[str, list[tuple[int, float]]] = {}
    for i, series in lived.items():
        kept[f"p{i}"] = series[:: max(1, len(series) // 40)] + series[-1:]  # ~40 points, and the last
        if len(series) < 3:
            continue
        xs, ys = [float(r) for r, _ in series], [m for _, m in series]
        slopes.append(100 * statistics.linear_regression(xs, ys).slope)  # the rounds differ: never vertical
        first.append(ys[0])
        last.append(ys[-1])
    if not slopes:
        return {"workers": 0}
    return {"workers": len(slopes), "warm_round": warm, "mib_after_warmup_median": round(statistics.median(first), 1),
            "mib_at_end_median": round(statistics.median(last), 1), "mib_at_end_max": round(max(last), 1),
            "mib_per_100_rounds_median": round(statistics.median(slopes), 3),
            "mib_per_100_rounds_max": round(max(slopes), 3), "series": kept}


async def run_reliability_round(swarm: Swarm, workers: list[Worker], r: int, victim: int | None,
                                rng: random.Random, live: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """A round of every live worker; the victim is SIGKILLed a random moment into it."""
    result: list[dict[str, Any]] = []

    async def kill_later() -> None:
        if victim is None:
            return
        await trio.sleep(rng.uniform(0.0, 0.6))
        swarm.workers[victim].kill()

    async def go() -> None:
        result.extend(await run_round(swarm, workers, r, 50_000 + r, [], 30.0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(kill_later)
        nursery.start_soon(go)
    return [x for i, x in zip(live, result) if i != victim]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cleanup_stale(PREFIX)
    results: dict[str, Any] = {}
    for setup in args.setups.split(","):
        results[setup] = await {"homogeneous": homogeneous, "heterogeneous": heterogeneous, "unshaped": unshaped,
                                "table1": table1, "reliability": reliability}[setup](args)
    return results


def summary(results: dict[str, Any]) -> None:
    print("\n== summary ==")
    h = results.get("homogeneous", {})
    for s in ("dedloc", "hivemind"):
        if f"{s}_ratio_to_bound" in h:
            print(f"homogeneous   {s:<9} {h[s]['median_s']:.2f} s = {h[f'{s}_ratio_to_bound']:.2f}x the bound "
                  f"{h['bound_s']:.2f} s")
    he = results.get("heterogeneous", {})
    for s in ("dedloc", "hivemind"):
        if f"{s}_adaptive_s" in he and f"{s}_equal_split_s" in he:
            print(f"heterogeneous {s:<9} equal {he[f'{s}_equal_split_s']:.2f} s, adaptive {he[f'{s}_adaptive_s']:.2f} s"
                  f" = {he[f'{s}_adaptive_ratio_to_ideal']:.2f}x the ideal {he['ideal_s']:.2f} s, "
                  f"{he[f'{s}_adaptive_speedup']:.2f}x faster than equal")
    u = results.get("unshaped", {})
    for s in ("dedloc", "hivemind"):
        if f"{s}_s" in u:
            print(f"unshaped      {s:<9} {u[f'{s}_s']:.2f} s")
    for s, c in results.get("reliability", {}).items():
        memory = {k: v for k, v in c.get("memory", {}).items() if k != "series"}
        print(f"reliability   {s:<9} {({**c, 'memory': memory})}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="dedloc,hivemind")
    parser.add_argument("--setups", default="homogeneous,heterogeneous,unshaped")
    parser.add_argument("--mbytes", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    parser.add_argument("--gather-time", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--fast-mbit", type=float, default=100.0)
    parser.add_argument("--slow-mbit", type=float, default=20.0)
    parser.add_argument("--very-fast-mbit", type=float, default=400.0)
    parser.add_argument("--table1-mbytes", type=float, default=8.0)
    parser.add_argument("--table1-setups", default="ABCD")
    parser.add_argument("--reliability-peers", type=int, default=6)
    parser.add_argument("--reliability-elements", type=int, default=10_000)
    parser.add_argument("--reliability-rounds", type=int, default=1000)
    parser.add_argument("--reliability-max-s", type=float, default=3600.0)
    parser.add_argument("--kill-rate", type=float, default=0.1)
    parser.add_argument("--spared", type=int, default=1,
                        help="reliability: the first N peers are never killed (their memory over the run is measured)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--chunk-elements", type=int, default=None, help="dedloc's AllreduceConfig.chunk_elements")
    parser.add_argument("--max-chunks-ahead", type=int, default=None, help="dedloc's AllreduceConfig.max_chunks_ahead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/dedloc-bench-averaging"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--link-trace", action="store_true",
                        help="shaped setups: sample every link's bytes into --log-dir (read with bench/link_trace.py) "
                             "and dump qdisc and TCP counters after the rounds")
    args = parser.parse_args()
    results = trio.run(main, args)
    summary(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
