"""One dedloc averaging peer per process, driven by bench/averaging.py over JSON lines.

    .venv/bin/python bench/averaging_peer.py --listen MADDR [--initial-peers MADDR ...] [--boot]
        [--peers N] [--elements E] [--up MBIT] [--down MBIT] [--compute S] [--role full|sender|aux] [--split adaptive|equal]

The protocol (bench/averaging_hivemind_peer.py speaks the same one):

  stdout, once:  {"ready": true, "addrs": [...], "peer_id": ID}
  stdin, lines:  {"op": "round", "id": R, "seed": S}
                 {"op": "go", "id": R}       (hivemind only: start the all-reduce of a formed group)
                 {"op": "quit"}
  stdout, lines: {"id": R, "stage": "grouped"}        (hivemind only: group formed, waiting for "go")
                 {"id": R, "ok": true, "complete": true, "allreduce_s": T, "step_s": T2,
                  "max_err": E, "bytes": B, "summary": TEXT, "error": null|TEXT}

A peer's tensor and weight in round R follow from the seed and its peer id
(bench/averaging_data.py), so every peer rebuilds every member's tensor from
the round report's member list and checks its own result against the exact
weighted average of the members that the report says contributed
(``max_err``; the driver counts a "complete" round whose error is large as a
silently wrong average). With DEDLOC_BENCH_PROFILE=DIR in the environment
each round's step is profiled (cProfile) into DIR. ``--boot`` runs the
relay/bootstrap node only. Only stdout carries the protocol: logging goes to
stderr.
"""

from __future__ import annotations

import argparse
import json
import cProfile
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from averaging_data import max_error, tensor_of, tree_uss_mib, weight_of, worker_parser  # noqa: E402

from averaging import AllreduceConfig, Averager, AveragerConfig, MatchmakingConfig  # noqa: E402
from averaging.bandwidth import BandwidthConfig  # noqa: E402
from averaging.errors import AveragingError  # noqa: E402
from nat import Peer, PeerConfig  # noqa: E402
from nat.autorelay import AutoRelayConfig  # noqa: E402
from p2p.dht.events import DHTMode  # noqa: E402
from p2p.hooks import Reachability  # noqa: E402
from p2p.noise import NoiseConfig  # noqa: E402

MBIT = 1e6 / 8  # bytes per second
READY_WAIT_S = 60.0
#: a folder: each round's averager.step is profiled (cProfile) into it, one file per peer and round
PROFILE = os.environ.get("DEDLOC_BENCH_PROFILE")


def peer_config(listen: str, initial: list[str], boot: bool, crypto_threads: int | None = None) -> PeerConfig:
    config = PeerConfig.loopback(relay=boot, initial_peers=initial, listen=listen, dht=DHTMode.SERVER, exchange=False,
                                 bootstrap_timeout=30.0, autorelay=AutoRelayConfig(enabled=False))
    config.node.noise = NoiseConfig(crypto_threads=crypto_threads)
    return config


class Lines:
    """JSON lines in (a thread reads stdin: a trio FdStream on a pipe would do too) and out."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    async def receive(self) -> dict[str, Any] | None:
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                return None
            line = line.strip()
            if line:
                result: dict[str, Any] = json.loads(line)
                return result


async def one_round(averager: Averager, cmd: dict[str, Any], args: argparse.Namespace, me: str) -> dict[str, Any]:
    seed = int(cmd["seed"])
    sends = args.role != "aux"
    weight = weight_of(me, seed) if sends else 0.0
    tensors = [tensor_of(me, seed, args.elements) if sends else torch.zeros(args.elements)]
    tensors = [t.to(args.device) for t in tensors]
    reply: dict[str, Any] = {"id": cmd["id"], "ok": False, "complete": False, "error": None}
    started = time.perf_counter()
    cpu0 = time.process_time()
    try:
        # A little longer than the matchmaking deadline, so that the averager's own error
        # (no group, a stalled round) is what gets reported, not this guard's.
        with trio.fail_after(args.timeout + 8):
            profile = cProfile.Profile() if PROFILE else None
            if profile is not None:
                profile.enable()
            report = await averager.step(tensors, weight=weight, strict=False)
            if profile is not None:
                profile.disable()
                profile.dump_stats(f"{PROFILE}/{me[-6:]}-{cmd['id']}.prof")
    except (AveragingError, trio.TooSlowError, ValueError) as exc:
        traceback.print_exc(file=sys.stderr)  # the worker's log has the whole story
        where = f" after {time.perf_counter() - started:.1f} s"
        reply.update(error=f"{type(exc).__name__}: {exc}{where}",
                     step_s=time.perf_counter() - started)
        return reply
    now = time.time()
    reply.update(ok=True, complete=report.complete, step_s=time.perf_counter() - started,
                 wall_start=now - report.elapsed, wall_end=now,
                 allreduce_s=report.elapsed, bytes=report.bytes_sent + report.bytes_received,
                 summary=report.summary(), fractions=list(report.fractions), cpu_s=time.process_time() - cpu0)
    if sends:
        left_out = set(report.left_out)
        auxiliary = set(cmd.get("aux", []))
        contributors = [str(m) for m in report.members if str(m) not in left_out | auxiliary]
        # In a thread: the check is seconds of CPU for 40 MB, and this peer's event
        # loop must keep serving the members still finishing their round.
        err = await trio.to_thread.run_sync(max_error, tensors[0].cpu(), contributors, seed, args.check_stride)
        reply["max_err"] = min(err, 1e30)
    return reply


def tuning(args: argparse.Namespace) -> dict[str, int]:
    """The AllreduceConfig settings given on the command line (the rest keep their defaults)."""
    return {k: v for k in ("chunk_elements", "max_chunks_ahead") if (v := getattr(args, k)) is not None}


async def main(args: argparse.Namespace) -> None:
    lines = Lines(sys.stdout)
    async with Peer.open(peer_config(args.listen, args.initial_peers, args.boot, args.crypto_threads)) as peer:
        me = str(peer.peer_id)
        if args.boot:
            lines.send({"ready": True, "addrs": [str(a) for a in peer.addrs], "peer_id": me})
            while (cmd := await lines.receive()) is not None and cmd.get("op") != "quit":
                pass
            return
        # A long-running peer knows its reachability; wait for the verdict so the
        # first round is not run by peers that do not know yet whether they may lead.
        with trio.move_on_after(READY_WAIT_S):
            while peer.node.reachability is not Reachability.PUBLIC:
                await trio.sleep(0.05)
        config = AveragerConfig(
            prefix="bench",
            matchmaking=MatchmakingConfig(target_size=args.peers, min_size=args.min_size or args.peers,
                                          timeout=args.timeout, gather_time=args.gather_time),
            allreduce=AllreduceConfig(timeout=args.timeout, stall_timeout=args.stall_timeout, **tuning(args)),
            auxiliary=args.role == "aux", reduces=args.role != "sender", adaptive=args.split != "equal",
            bandwidth=(BandwidthConfig() if args.split == "measured"
                       else BandwidthConfig(upload=args.up * MBIT, download=args.down * MBIT)), compute=args.compute,
        )
        async with Averager.open(peer, config) as averager:
            lines.send({"ready": True, "addrs": [str(a) for a in peer.addrs], "peer_id": me,
                        "reachability": peer.node.reachability.name})
            while (cmd := await lines.receive()) is not None:
                if cmd.get("op") == "quit":
                    break
                if cmd.get("op") == "round":
                    reply = await one_round(averager, cmd, args, me)
                    reply["uss_mib"] = tree_uss_mib()
                    lines.send(reply)


if __name__ == "__main__":
    parser = worker_parser(__doc__)
    args = parser.parse_args()
    # Several peers share this machine's cores: torch's intra-op threads would
    # fight over them (a 512 KiB isfinite took 19 ms). One peer per machine,
    # as in real use, has no such contention. The hivemind worker does the same.
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("averaging.matchmaking").setLevel(logging.DEBUG)  # the log file tells why a group did not form
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    trio.run(main, args)
