"""Datasets from the swarm: dedloc and libtorrent 2.1.1 moving the same dataset on the same shaped NAT lab.

    sudo .venv/bin/python bench/datasets.py [--peers 16] [--seeders 2] [--mbytes 200] [--nat-peers 4]
        [--peer-up 10] [--peer-down 50] [--seeder-up 100] [--delay-ms 0] [--systems dedloc,libtorrent]
        [--faults corrupt,kill] [--training] [--json OUT]

The setup (issue "Datasets from the swarm"): --peers peers on home links (--peer-up / --peer-down Mbit,
tc tbf on their access links, nat/lab.py), the first --nat-peers of them behind NATs of different kinds
(port-preserving cone, port-changing cone, symmetric, double NAT), fetch a --mbytes dataset (--shards
text files) from --seeders seeders with --seeder-up Mbit. All peers ask at once (a flash crowd); each
reports when its last piece was written, timed from the command (the manifest's lookup included).

The bound is Kumar and Ross's for P2P file distribution: no schedule finishes every peer sooner than
max(F/u_s, F/d_min, N·F/(u_s + Σu_i)), where F is the dataset's size, u_s the seeders' upload, d_min
the slowest download and Σu_i the peers' uploads. Printed per system: every peer's completion time
(sorted), the last and the median peer, each against the bound, and dedloc's last peer against
libtorrent's.

Systems, one after another on the same lab and the same files, every process new for each run:
  dedloc      bench/datasets_peer.py: `dedloc peer` (AutoNAT, relay slots, hole punching) with Datasets;
              a relay/bootstrap node on a public host; the first seeder creates the dataset, the second
              joins it (its files checked, nothing fetched).
  libtorrent  bench/datasets_libtorrent_peer.py in .venv-libtorrent (bench/setup_libtorrent.sh):
              the first seeder makes a .torrent of the same directory, with the same piece size; every
              peer is told the public peers' and seeders' addresses (what a tracker would say).
Faults (dedloc): `corrupt` (the second seeder flips a byte of every piece it serves: every peer must
complete with 0 bad bytes and name it), `kill` (the second seeder is SIGKILLed when the crowd holds
half of what it wants: every peer must still complete). --training: on loopback, the time from a
fresh trainer's start to its first global step with --data swarm:NAME against the same with the data
on its disk (a relay, a seeder and a trainer already running).

Root is needed for the lab (network namespaces); nothing leaves loopback or the namespaces it makes.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nat.lab import Lab, NatKind, Shape, cleanup_stale  # noqa: E402
from harness import Worker, open_worker  # noqa: E402

PREFIX = "dldata"
WORK = Path(os.environ.get("DEDLOC_BENCH_DATA", "/var/tmp/dedloc-bench-datasets"))
LIBTORRENT_PY = REPO / ".venv-libtorrent" / "bin" / "python"
READY_TIMEOUT_S = 120.0
PORT = 4001
NAT_KINDS = (NatKind.EIM_PRESERVING, NatKind.EIM_CHANGING, NatKind.SYMMETRIC, NatKind.DOUBLE)
NAME = "corpus"


# ---------------------------------------------------------------------- the dataset

def make_dataset(mbytes: int, shards: int) -> tuple[Path, dict[str, str]]:
    """``mbytes`` MB of text lines in ``shards`` files (generated once, kept): the directory and each file's
    sha256."""
    src = WORK / f"src-{mbytes}-{shards}" / NAME
    digests: dict[str, str] = {}
    size = mbytes * 1_000_000 // shards
    rng = random.Random(0)
    src.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        path = src / f"part-{i:03d}.txt"
        if not path.exists() or path.stat().st_size != size:
            raw = base64.b64encode(rng.randbytes(size * 3 // 4 + 3))[:size]
            lines = b"\n".join(raw[j:j + 99] for j in range(0, len(raw), 100))
            tmp = path.with_suffix(".partial")
            tmp.write_bytes((lines + b"\n" * size)[:size])
            tmp.replace(path)
        digests[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return src, digests


def check_files(directory: Path, digests: dict[str, str]) -> tuple[int, int]:
    """(files missing or wrong, bytes in wrong files)."""
    bad = wrong_bytes = 0
    for name, digest in digests.items():
        path = directory / name
        if not path.exists():
            bad += 1
            continue
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            bad += 1
            wrong_bytes += len(data)
    return bad, wrong_bytes


# ---------------------------------------------------------------------- workers

@dataclass
class Topology:
    lab: Lab
    boot: Any
    seeders: list[Any]
    peers: list[Any]


async def build(lab: Lab, args: argparse.Namespace) -> Topology:
    boot = await lab.public_host("boot", delay_ms=args.delay_ms)
    seeders = [await lab.public_host(f"seed{i}", delay_ms=args.delay_ms,
                                     shape=Shape(args.seeder_up, args.seeder_up)) for i in range(args.seeders)]
    peers = []
    for i in range(args.peers):
        kind = NAT_KINDS[i % len(NAT_KINDS)] if i < args.nat_peers else NatKind.PUBLIC
        peers.append(await lab.peer(f"p{i:02d}", kind, listen_port=PORT, delay_ms=args.delay_ms,
                                    shape=Shape(args.peer_up, args.peer_down)))
    return Topology(lab, boot, seeders, peers)


@dataclass
class Run:
    system: str
    scenario: str
    times: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    bad_files: int = 0
    bad_bytes: int = 0
    wall_s: float = 0.0
    killed_at: float | None = None
    #: (seconds since the crowd asked, bytes the peers held in all), every second
    timeline: list[tuple[float, int]] = field(default_factory=list)
    seeder_ids: list[str] = field(default_factory=list)

    @property
    def completed(self) -> int:
        return len(self.times)


async def spawn(host: Any, name: str, argv: list[str], log_dir: Path) -> Worker:
    return await open_worker(name, argv, log=log_dir / f"{name}.log", ready_timeout=READY_TIMEOUT_S, spawn=host.spawn)


async def one_run(top: Topology, args: argparse.Namespace, system: str, scenario: str, src: Path,
                  digests: dict[str, str]) -> Run:
    run = Run(system, scenario)
    root = WORK / f"run-{system}-{scenario}"
    shutil.rmtree(root, ignore_errors=True)
    logs = root / "logs"
    logs.mkdir(parents=True)
    total = sum((src / n).stat().st_size for n in digests)
    workers: list[Worker] = []
    try:
        seeders: list[Worker] = []
        peers: list[Worker] = []
        if system == "dedloc":
            script = [sys.executable, str(REPO / "bench" / "datasets_peer.py"), "--piece-kib", str(args.piece_kib)]
            boot = await spawn(top.boot, "boot", [*script, "--boot", "--listen", f"/ip4/{top.boot.ip}/tcp/{PORT}"],
                               logs)
            workers.append(boot)
            boot_addr = f"/ip4/{top.boot.ip}/tcp/{PORT}/p2p/{boot.peer_id}"

            async def start(host: Any, name: str) -> Worker:
                w = await spawn(host, name, [*script, "--listen", f"/ip4/{host.ip}/tcp/{PORT}",
                                             "--initial-peers", boot_addr], logs)
                workers.append(w)
                return w
        else:
            script = [str(LIBTORRENT_PY), str(REPO / "bench" / "datasets_libtorrent_peer.py"),
                      "--piece-kib", str(args.piece_kib)]

            async def start(host: Any, name: str) -> Worker:
                w = await spawn(host, name, [*script, "--listen", host.ip, "--port", str(PORT)], logs)
                workers.append(w)
                return w

        async with trio.open_nursery() as nursery:
            async def add(host: Any, name: str, into: list[Worker]) -> None:
                into.append(await start(host, name))

            for i, host in enumerate(top.seeders):
                nursery.start_soon(add, host, f"seed{i}", seeders)
            for i, host in enumerate(top.peers):
                nursery.start_soon(add, host, f"p{i:02d}", peers)
        seeders.sort(key=lambda w: w.name)
        peers.sort(key=lambda w: w.name)
        run.seeder_ids = [w.peer_id for w in seeders]
        torrent = root / f"{NAME}.torrent"
        for i, w in enumerate(seeders):  # the seeders' copies: hard links of the source files
            target = root / w.name / NAME
            target.mkdir(parents=True)
            for name in digests:
                os.link(src / name, target / name)
            if i == 0 or system == "libtorrent":
                await w.send({"op": "seed", "name": NAME, "dir": str(target), "torrent": str(torrent)})
            else:  # dedloc's second seeder joins the first one's dataset (its files checked)
                await w.send({"op": "get", "name": NAME, "dir": str(target)})
            while (reply := await w.receive(300))["op"] not in ("seeding", "done", "error"):
                pass
            if reply["op"] == "error":
                raise RuntimeError(f"{w.name}: {reply['error']}")
        if scenario == "corrupt":
            await seeders[-1].send({"op": "corrupt"})
            await seeders[-1].receive(30)
        if system == "dedloc":
            await trio.sleep(3.0)  # the second seeder's tracker record is out (it refreshes every 2 s at most)
        public = [[h.public_ip, PORT] for h in [*top.seeders, *top.peers] if h.kind is NatKind.PUBLIC]
        started = time.monotonic()
        for i, w in enumerate(peers):
            await w.send({"op": "get", "name": NAME, "dir": str(root / w.name / NAME), "torrent": str(torrent),
                          "peers": [p for p in public if p != [top.peers[i].public_ip, PORT]]})
        held: dict[str, int] = {}

        async def follow(w: Worker) -> None:
            while True:
                reply = await w.receive(args.timeout)
                if reply["op"] == "progress":
                    held[w.name] = int(reply["held"])
                    continue
                if reply["op"] == "started":
                    run.replies.setdefault(w.name, {})["started_s"] = reply["t"]
                    continue
                if reply["op"] == "done":
                    run.times[w.name] = float(reply["seconds"])
                    run.replies[w.name] = {**run.replies.get(w.name, {}), **reply}
                    held[w.name] = total
                else:
                    run.errors[w.name] = str(reply.get("error"))
                return

        with trio.move_on_after(args.timeout):
            async with trio.open_nursery() as nursery:
                for w in peers:
                    nursery.start_soon(follow, w)
                async def sample() -> None:
                    while True:
                        run.timeline.append((round(time.monotonic() - started, 1), sum(held.values())))
                        await trio.sleep(1.0)

                nursery.start_soon(sample)
                if scenario == "kill":
                    while sum(held.values()) < total * len(peers) / 2:
                        await trio.sleep(0.2)
                    seeders[-1].kill()
                    run.killed_at = time.monotonic() - started
                while len(run.times) + len(run.errors) < len(peers):
                    await trio.sleep(0.2)
                nursery.cancel_scope.cancel()
        run.wall_s = time.monotonic() - started
        for w in peers:
            bad, wrong = check_files(root / w.name / NAME, digests)
            run.bad_files += bad
            run.bad_bytes += wrong
        for w in peers:
            if w.name not in run.times and w.name not in run.errors:
                run.errors[w.name] = f"not complete within {args.timeout:g} s ({held.get(w.name, 0)} bytes)"
    finally:
        with trio.CancelScope(shield=True):
            for w in workers:
                if w.proc.returncode is None:
                    try:
                        await w.send({"op": "quit"})
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            with trio.move_on_after(10):
                for w in workers:
                    await w.proc.wait()
            for w in workers:
                w.kill()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return run


# ---------------------------------------------------------------------- training from the swarm

async def training_start(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds from a fresh trainer's start to its first global step: --data swarm:NAME, then its disk, taking
    turns --training-repeats times (where the swarm's next global step falls makes each figure noisy)."""
    from training.corpus import prepare

    dedloc = [sys.executable, "-m", "training.commands"]
    root = WORK / "training"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    prepared = prepare(root / "example")
    loop = ["--listen", "/ip4/127.0.0.1/tcp/0", "--ephemeral", "--allow-private", "--json"]
    out: dict[str, list[float]] = {"swarm": [], "disk": []}
    procs: list[trio.Process] = []

    async def start(argv: list[str], name: str) -> trio.Process:
        log = open(root / f"{name}.log", "ab")
        p = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        log.close()
        procs.append(p)
        return p

    async def events(p: trio.Process) -> Any:
        from p2p.trio_util import read_lines

        assert p.stdout is not None
        async for line in read_lines(p.stdout):
            try:
                yield json.loads(line)
            except ValueError:
                continue

    try:
        relay = await start([*dedloc, "relay", "--json", "--ephemeral", "--listen", "/ip4/127.0.0.1/tcp/0"], "relay")
        with trio.fail_after(60):
            async for e in events(relay):
                if e.get("event") == "listening":
                    boot = ["--initial-peers", e["addrs"][0]]
                    break
        seeder = await start([*dedloc, "dataset", "create", NAME, str(prepared.corpus[0].parent), *boot, *loop],
                             "seeder")
        with trio.fail_after(60):
            async for e in events(seeder):
                if e.get("event") == "dataset_published":
                    break
        train = [*dedloc, "train", *boot, *loop, "--tokenizer", str(prepared.tokenizer), "--target-batch-size", "32",
                 "--batch-size", "8", "--run-id", "datasets-bench"]
        await start([*train, "--workdir", str(root / "first"), "--data", *map(str, prepared.corpus)], "first")
        for i in range(args.training_repeats):
            for kind, data in (("swarm", [f"swarm:{NAME}"]), ("disk", list(map(str, prepared.corpus)))):
                t0 = time.monotonic()
                p = await start([*train, "--workdir", str(root / f"{kind}-{i}"), "--data", *data], f"{kind}-{i}")
                with trio.fail_after(args.timeout):
                    async for e in events(p):
                        if e.get("event") == "global_step":
                            out[kind].append(time.monotonic() - t0)
                            break
                p.terminate()
                await p.wait()
    finally:
        with trio.CancelScope(shield=True):
            for p in procs:
                if p.returncode is None:
                    p.terminate()
            with trio.move_on_after(10):
                for p in procs:
                    await p.wait()
            for p in procs:
                if p.returncode is None:
                    p.kill()
    return out


# ---------------------------------------------------------------------- report

def bound(args: argparse.Namespace, total: int) -> float:
    f = total * 8 / 1e6  # Mbit
    us = args.seeders * args.seeder_up
    return max(f / us, f / args.peer_down, args.peers * f / (us + args.peers * args.peer_up))


def summary(run: Run, b: float) -> dict[str, Any]:
    times = sorted(run.times.values())
    last = times[-1] if len(times) == len(run.times) + len(run.errors) and times else float("inf")
    if run.errors:
        last = float("inf")
    med = statistics.median(times) if times else float("inf")
    banned: dict[str, int] = {}
    for r in run.replies.values():
        for peer in r.get("banned", {}):
            banned[peer] = banned.get(peer, 0) + 1
    from_seeders = sum(n for r in run.replies.values() for p, n in r.get("sources", {}).items() if p in run.seeder_ids)
    received = sum(n for r in run.replies.values() for n in r.get("sources", {}).values())
    # the swarm's download rate, 5 s at a time, against what its uploads allow
    rates = []
    for (t0, b0), (t1, b1) in zip(run.timeline[::5], run.timeline[5::5]):
        rates.append(round((b1 - b0) * 8 / 1e6 / max(t1 - t0, 1e-9)))
    def phase(key: str) -> list[float]:
        return sorted(round(float(r[key]), 2) for r in run.replies.values() if r.get(key) is not None)

    return {"manifest_s": phase("started_s"), "first_seeder_s": phase("first_seeder_s"),
            "first_piece_s": phase("first_piece_s"), "from_seeders_share": from_seeders / received if received else None, "swarm_mbit_per_5s": rates,
            "last_peer_s": last, "median_peer_s": med, "last_over_bound": last / b, "median_over_bound": med / b,
            "completed": run.completed, "errors": run.errors, "bad_files": run.bad_files,
            "bad_bytes_delivered": run.bad_bytes, "times": {k: round(v, 2) for k, v in sorted(run.times.items())},
            "banned_by": banned, "killed_at_s": run.killed_at,
            "duplicates": sum(int(r.get("duplicates", 0)) for r in run.replies.values()),
            "relayed_peers": {k: r.get("relayed_peers") for k, r in run.replies.items() if r.get("relayed_peers")}}


def _minmed(values: list[float]) -> str:
    return f"{min(values):.1f}/{statistics.median(values):.1f}" if values else "-"


def _mmm(values: list[float]) -> str:
    return f"{min(values):.1f}/{statistics.median(values):.1f}/{max(values):.1f}" if values else "-"


def print_run(name: str, s: dict[str, Any], b: float) -> None:
    times = " ".join(f"{v:.1f}" for v in sorted(s["times"].values()))
    print(f"{name:22s} last {s['last_peer_s']:7.1f} s ({s['last_over_bound']:.2f}x bound)  median "
          f"{s['median_peer_s']:6.1f} s ({s['median_over_bound']:.2f}x)  complete {s['completed']}"
          f"{'  errors: ' + str(s['errors']) if s['errors'] else ''}")
    print(f"{'':22s} per peer: {times}")
    if s["first_piece_s"]:
        print(f"{'':22s} start (s, min/median/max): manifest {_mmm(s['manifest_s'])}, first seeder "
              f"{_mmm(s['first_seeder_s'])}, first piece {_mmm(s['first_piece_s'])}")
    if s["swarm_mbit_per_5s"]:
        print(f"{'':22s} the swarm's download, Mbit/s per 5 s: {' '.join(map(str, s['swarm_mbit_per_5s']))}")
    if s["bad_files"] or s["banned_by"] or s["killed_at_s"] is not None:
        print(f"{'':22s} bad files {s['bad_files']}, bad bytes delivered {s['bad_bytes_delivered']}, banned by "
              f"{s['banned_by']}, killed at {s['killed_at_s']}")


async def main(args: argparse.Namespace) -> None:
    systems = [s for s in args.systems.split(",") if s]
    faults = [f for f in args.faults.split(",") if f]
    if "libtorrent" in systems and not LIBTORRENT_PY.exists():
        sys.exit("bench/datasets.py: .venv-libtorrent missing: run bench/setup_libtorrent.sh")
    src, digests = make_dataset(args.mbytes, args.shards)
    total = sum((src / n).stat().st_size for n in digests)
    b = bound(args, total)
    print(f"dataset: {total / 1e6:.0f} MB in {len(digests)} files; {args.peers} peers ({args.nat_peers} behind NATs) "
          f"at {args.peer_down:g}/{args.peer_up:g} Mbit down/up, {args.seeders} seeders at {args.seeder_up:g} Mbit up, "
          f"{args.delay_ms:g} ms delay; pieces of {args.piece_kib} KiB")
    capacity = args.seeders * args.seeder_up + args.peers * args.peer_up
    print(f"Kumar-Ross bound: {b:.1f} s (the uploads, {capacity:g} Mbit/s in all, are what limits)")
    result: dict[str, Any] = {"bound_s": b, "setup": vars(args)}
    cleanup_stale(PREFIX)
    if systems or faults:
        async with Lab(prefix=PREFIX, netem=False) as lab:
            top = await build(lab, args)
            runs = [(s, "clean") for s in systems] + [("dedloc", f) for f in faults]
            for system, scenario in runs:
                run = await one_run(top, args, system, scenario, src, digests)
                s = summary(run, b)
                key = system if scenario == "clean" else scenario
                result[key] = s
                print_run(f"{system} ({scenario})", s, b)
    if "dedloc" in result and "libtorrent" in result:
        ratio = result["dedloc"]["last_peer_s"] / result["libtorrent"]["last_peer_s"]
        result["dedloc_over_libtorrent_last"] = ratio
        print(f"dedloc's last peer / libtorrent's: {ratio:.2f} (goal <= 1); dedloc's last peer / bound: "
              f"{result['dedloc']['last_over_bound']:.2f} (goal <= 1.25)")
    if args.training:
        t = await training_start(args)
        result["training"] = {k: {"min": min(v), "median": statistics.median(v), "runs": v} for k, v in t.items() if v}
        print(f"first global step of a fresh trainer (min/median of {args.training_repeats}): "
              f"{_minmed(t['swarm'])} s with --data swarm:{NAME}, "
              f"{_minmed(t['disk'])} s with the data on disk")
    if args.json:
        flat = dict(result)
        for key in ("dedloc", "libtorrent", "corrupt", "kill"):
            if key in result:
                flat[f"{key}.last_peer_s"] = result[key]["last_peer_s"]
        if "corrupt" in result:
            flat["corrupt.bad_bytes_delivered"] = result["corrupt"]["bad_bytes_delivered"]
        if "kill" in result:
            flat["kill.completed"] = result["kill"]["completed"]
        Path(args.json).write_text(json.dumps(flat, indent=2, default=str))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=16)
    p.add_argument("--seeders", type=int, default=2)
    p.add_argument("--nat-peers", type=int, default=4)
    p.add_argument("--mbytes", type=int, default=200)
    p.add_argument("--shards", type=int, default=20)
    p.add_argument("--piece-kib", type=int, default=1024)
    p.add_argument("--peer-up", type=float, default=10.0)
    p.add_argument("--peer-down", type=float, default=50.0)
    p.add_argument("--seeder-up", type=float, default=100.0)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--systems", default="dedloc,libtorrent")
    p.add_argument("--faults", default="corrupt,kill")
    p.add_argument("--training", action="store_true", help="also time a fresh trainer's first step (loopback)")
    p.add_argument("--training-repeats", type=int, default=3, help="how many times each (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--keep", action="store_true", help="keep the peers' files and logs")
    p.add_argument("--json", default=None, metavar="OUT")
    return p


if __name__ == "__main__":
    trio.run(main, parser().parse_args())
