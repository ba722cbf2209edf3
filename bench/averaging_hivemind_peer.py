"""One hivemind 1.1.12 averaging peer per process, driven by bench/averaging.py over JSON lines.

    .venv-hivemind/bin/python bench/averaging_hivemind_peer.py --listen MADDR [--initial-peers MADDR ...]
        [--boot] [--peers N] [--elements E] [--down MBIT] [--role full|sender|aux] [--split adaptive|equal]

Runs in .venv-hivemind (bench/setup_hivemind.sh) and speaks the protocol of
bench/averaging_peer.py. A round is hivemind's ``DecentralizedAverager.step``
with ``require_trigger=True``: once its group formed the worker says
``{"stage": "grouped"}`` and starts the all-reduce on the driver's ``go``, so
``allreduce_s`` is the all-reduce alone with every member starting together
(matchmaking, at least ``--gather-time``, is in ``step_s``). hivemind reports
no partial rounds, so ``complete`` is always true when it returns: the
driver's error check is what finds a partial average.

``--down`` is passed as hivemind's ``bandwidth=`` (the one figure its load
balancing takes); ``equal`` passes none, which gives equal parts. Its
networking is confined as in bench/dht_hivemind_peer.py: no IPFS, UPnP,
AutoNAT or relays; it listens on ``--listen`` only (loopback or a lab
namespace). Only stdout carries the protocol: fd 1 goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from averaging_data import max_error, tensor_of, tree_uss_mib, weight_of, worker_parser  # noqa: E402


def take_stdout() -> TextIO:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def send(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def commands() -> Any:
    for line in sys.stdin:
        line = line.strip()
        if line:
            yield json.loads(line)


def one_round(averager: Any, me: str, cmd: dict[str, Any], args: argparse.Namespace, out: TextIO,
              inbox: Any) -> dict[str, Any]:
    from hivemind.averaging.control import AveragingStage

    seed = int(cmd["seed"])
    sends = args.role != "aux"
    reply: dict[str, Any] = {"id": cmd["id"], "ok": False, "complete": False, "error": None}
    started = time.perf_counter()
    with averager.get_tensors() as tensors:
        tensors[0].copy_(tensor_of(me, seed, args.elements) if sends else 0)
    # No require_trigger: with it, 4 peers in the namespace lab never formed a group (the leader stayed
    # LOOKING_FOR_GROUP while its followers waited for the trigger). The all-reduce is timed from the
    # moment the step's stage turns RUNNING_ALLREDUCE, polled every millisecond.
    control = averager.step(weight=weight_of(me, seed) if sends else None, timeout=args.timeout,
                            allow_retries=False, wait=False)
    send(out, {"id": cmd["id"], "stage": "grouped"})  # the driver's protocol: it answers "go"
    go = next(inbox, None)
    if go is None or go.get("op") != "go":
        control.cancel()
        reply["error"] = f"expected go, got {go}"
        return reply
    deadline = time.monotonic() + 2 * args.timeout
    t0 = None
    while not control.done() and time.monotonic() < deadline:
        if t0 is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
            t0 = time.perf_counter()
        time.sleep(0.001)
    try:
        gathered = control.result(timeout=args.timeout)
    except Exception as exc:  # hivemind raises several kinds; report them all
        reply.update(error=f"{type(exc).__name__}: {exc}", step_s=time.perf_counter() - started)
        return reply
    if t0 is None:
        t0 = started  # finished between two polls: count the whole step
    done = time.perf_counter()
    reply.update(step_s=done - started, allreduce_s=done - t0)
    if gathered is None:
        reply["error"] = "step returned None (no group or failed all-reduce)"
        return reply
    reply.update(ok=True, complete=True, members=len(gathered))
    if sends:
        auxiliary = set(cmd.get("aux", []))
        with averager.get_tensors() as tensors:
            result = tensors[0].clone()
        reply["max_err"] = min(max_error(result, [str(p) for p in gathered if str(p) not in auxiliary], seed), 1e30)
    return reply


def main() -> None:
    parser = worker_parser(__doc__)
    args = parser.parse_args()
    out = take_stdout()

    import torch
    from hivemind import DHT, DecentralizedAverager

    torch.set_num_threads(1)  # as the dedloc worker: several peers share this machine's cores

    dht = DHT(initial_peers=args.initial_peers or None, start=True, host_maddrs=[args.listen], use_ipfs=False,
              nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
    try:
        me = str(dht.peer_id)
        addrs = [str(a) for a in dht.get_visible_maddrs()]
        if args.boot:
            send(out, {"ready": True, "addrs": addrs, "peer_id": me})
            for cmd in commands():
                if cmd.get("op") == "quit":
                    break
            return
        bandwidth = args.down if args.split == "adaptive" and args.down > 0 else None
        averager = DecentralizedAverager(
            [torch.zeros(args.elements)], dht, start=True, prefix="bench", target_group_size=args.peers,
            min_group_size=args.min_size or args.peers, min_matchmaking_time=args.gather_time,
            request_timeout=min(3.0, args.gather_time / 2),  # hivemind: below min_matchmaking_time, or deadlocks
            allreduce_timeout=args.timeout, sender_timeout=args.stall_timeout,
            reducer_timeout=args.stall_timeout * 2, bandwidth=bandwidth, auxiliary=args.role == "aux",
            client_mode=args.role == "sender",
        )
        try:
            send(out, {"ready": True, "addrs": addrs, "peer_id": me})
            inbox = commands()
            for cmd in inbox:
                if cmd.get("op") == "quit":
                    break
                if cmd.get("op") == "round":
                    reply = one_round(averager, me, cmd, args, out, inbox)
                    reply["uss_mib"] = tree_uss_mib()  # with its Go daemon, a child process
                    send(out, reply)
        finally:
            averager.shutdown()
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
