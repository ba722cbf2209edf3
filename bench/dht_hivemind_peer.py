"""One hivemind DHT peer per process, driven by bench/dht.py over JSON lines.

    .venv-hivemind/bin/python bench/dht_hivemind_peer.py [--initial-peers MADDR ...] [--seed N]

Runs in the separate .venv-hivemind (bench/setup_hivemind.sh) because hivemind
pins protobuf and friends that conflict with the project venv. It speaks the
same protocol as bench/dht_peer.py (the dedloc worker), so the driver can
treat both alike:

  stdout, once:  {"ready": true, "addrs": [...], "startup_s": S}
  stdin, lines:  {"id": 7, "op": "store", "key": K, "value": HEX, "ttl": 600}
                 {"id": 8, "op": "get", "key": K, "latest": false}
                 {"op": "quit"}
  stdout, lines: {"id": 7, "ok": true, "ms": 12.3, "value": HEX|null, "error": null|TEXT}

Commands run concurrently (one thread each, waiting on hivemind's MPFuture),
since the driver keeps several in flight. Only stdout carries the protocol:
fd 1 is redirected to stderr so that hivemind, p2pd and any stray print
cannot corrupt it.

Networking is confined to loopback: hivemind's daemon would otherwise map
ports over UPnP/NAT-PMP, run AutoNAT dial-backs and use relays; all are off,
there is no IPFS bootstrap, and it listens on 127.0.0.1 only. Everything
else is hivemind's default.
"""

from __future__ import annotations

import time

_T0 = time.time()  # fallback for the process start time, taken before the slow imports

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from concurrent.futures import TimeoutError as FutureTimeout  # noqa: E402
from typing import Any, TextIO  # noqa: E402

OP_TIMEOUT_S = 10.0
LOOPBACK_LISTEN = ["/ip4/127.0.0.1/tcp/0"]

# Options of hivemind.P2P.create that could send packets off this machine.
NETWORK_KWARGS: dict[str, Any] = {
    "host_maddrs": LOOPBACK_LISTEN,  # listen on loopback only, so only loopback is announced
    "use_ipfs": False,  # no public IPFS bootstrap nodes
    "nat_port_map": False,  # no UPnP / NAT-PMP on the gateway
    "auto_nat": False,  # no AutoNAT dial-backs to observed addresses
    "use_relay": False,  # no circuit relay (client or service)
    "use_auto_relay": False,  # no relay discovery
}


def process_start_epoch() -> float:
    """Wall-clock time this process was started (from /proc), so startup_s includes the interpreter."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 overall; fields[0] is field 3
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _T0


def take_stdout() -> TextIO:
    """Keep the real stdout for the protocol and point fd 1 (and sys.stdout) at stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


class Peer:
    """Owns the hivemind DHT and answers commands, one thread per command."""

    def __init__(self, dht: Any, out: TextIO) -> None:
        from hivemind.utils import get_dht_time

        self.dht = dht
        self.now = get_dht_time  # expirations are in hivemind's DHT time
        self.out = out
        self.out_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="op")

    def send(self, message: dict[str, Any]) -> None:
        with self.out_lock:
            self.out.write(json.dumps(message) + "\n")
            self.out.flush()

    def handle(self, cmd: dict[str, Any]) -> None:
        """Run one store/get and reply; never raises (errors become ok=false)."""
        op = cmd.get("op")
        value: str | None = None
        error: str | None = None
        ok = False
        started = time.perf_counter()
        try:
            if op == "store":
                future = self.dht.store(
                    cmd["key"], cmd["value"], self.now() + float(cmd.get("ttl", 600)), return_future=True
                )
                ok = bool(future.result(timeout=OP_TIMEOUT_S))
                if not ok:
                    error = "store not acknowledged"
            elif op == "get":
                future = self.dht.get(cmd["key"], latest=bool(cmd.get("latest", False)), return_future=True)
                found = future.result(timeout=OP_TIMEOUT_S)
                ok = True
                value = None if found is None else found.value
            else:
                error = f"unknown op {op!r}"
        except FutureTimeout:
            ok, error = False, "timeout"
        except Exception as exc:  # report, keep serving
            ok, error = False, f"{type(exc).__name__}: {exc}"
        ms = (time.perf_counter() - started) * 1e3
        self.send({"id": cmd.get("id"), "ok": ok, "ms": round(ms, 3), "value": value, "error": error})

    def serve(self, lines: TextIO) -> None:
        """Dispatch commands until quit or EOF, then wait (bounded) for those in flight."""
        for line in lines:
            line = line.strip()
            if not line:
                continue
            try:
                cmd = json.loads(line)
            except json.JSONDecodeError:
                print(f"bad command line: {line!r}", file=sys.stderr)
                continue
            if cmd.get("op") == "quit":
                break
            self.pool.submit(self.handle, cmd)
        self.pool.shutdown(wait=True, cancel_futures=True)  # each op is bounded by OP_TIMEOUT_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR")
    parser.add_argument("--seed", type=int, default=None, help="makes the DHT node id deterministic")
    args = parser.parse_args()

    started = process_start_epoch()
    out = take_stdout()

    from hivemind import DHT
    from hivemind.dht.routing import DHTID

    kwargs: dict[str, Any] = dict(NETWORK_KWARGS)
    if args.seed is not None:
        kwargs["node_id"] = DHTID.generate(source=f"dht-bench-{args.seed}")
    dht = DHT(initial_peers=args.initial_peers or None, start=True, **kwargs)
    try:
        addrs = [str(a) for a in dht.get_visible_maddrs()]
        loopback = [a for a in addrs if a.startswith("/ip4/127.")]
        if loopback != addrs:
            print(f"ignoring non-loopback addrs: {sorted(set(addrs) - set(loopback))}", file=sys.stderr)
        peer = Peer(dht, out)
        peer.send({"ready": True, "addrs": loopback, "startup_s": round(time.time() - started, 3)})
        peer.serve(sys.stdin)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
