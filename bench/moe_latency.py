"""DMoE throughput under latency (Learning@home Fig. 4), in the NAT lab's namespaces, in one run.

    sudo .venv/bin/python bench/moe_latency.py [--delays 0,50,100,200] [--seconds 20] [--json OUT]

The same mixture of 16 ffn experts (hidden 256, k 4 of a 4x4 grid, batches of 32: see
bench/moe_latency_peer.py) trained (a) in one process, and (b) as DMoE: a lab host "experts" runs
a bootstrap node (`dedloc relay`) and two `dedloc serve-experts` (8 experts each), a host
"trainer" runs an asynchronous trainer (--concurrency batches in flight, up to --streams calls
in flight per server); the path between them has --delays one-way (the experts host's access
link; the lab's userspace wire where the kernel has no netem), a fresh lab for each delay. The
zero-delay run goes through the same wire (``--zero-delay-path``): the wire is a Python process
that moves every packet (0.09-0.10 of a core in a run here, printed), and a plain veth at 0 ms
would charge that CPU to the delayed runs alone.
Printed: samples/s of each setup and the ratio of each delay's to the zero-delay DMoE's, per batch
where its time went, per exchange the wait for one of a server's slots and the exchange itself.
The goal (issue "Decentralized mixture-of-experts"): at 200 ms DMoE keeps >= 80% of its zero-delay
throughput; ``--json OUT`` writes it as ``latency.ratio_200ms_to_0ms``. Needs root (namespaces).
Nothing leaves the lab.

What a far path needs, measured here (docs/OPERATORS.md, "Far peers"): TCP buffers that hold a
round trip of data (Linux's default most send buffer, 4 MiB, held the trainer's connection to
~7 MB/s at 400 ms: request bodies waited 0.3-0.6 s in its socket; --tcp-buffer-mib 0 shows it), and
enough batches and streams in flight to cover the round trip (Little's law: 64 streams of ~1 s
exchanges cap a server at ~64 exchanges/s). The two servers run one torch thread each: with
torch's default (every core) two servers, the trainer and the wire on two cores spun in each
other's way and the zero-delay figure fell by half. ``--raw`` replaces the trainer's torch threads
with trio tasks making the same exchanges (the stack alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "bench"))

from nat.lab import Host, Lab, netns_unavailable_reason  # noqa: E402
from harness import json_result, python_argv, run_json  # noqa: E402
from wan import relay_on  # noqa: E402  (`dedloc relay` on a lab host, on port 4001)

PY = sys.executable
WORKER = str(REPO / "bench" / "moe_latency_peer.py")
#: Looks globally routed (bench/wan.py's choice); it never leaves the namespaces.
PUBLIC_NET = "11.0.0.0/15"


async def worker(host: Host | None, argv: list[str], timeout: float) -> dict[str, Any]:
    """bench/moe_latency_peer.py run to its end, here or on a lab host: its JSON result."""
    command = [PY, WORKER, *argv]
    if host is None:
        return await trio.to_thread.run_sync(lambda: run_json(command, timeout=timeout, what="the trainer"))
    rc, out, err = await host.run(python_argv(command), timeout=timeout)
    return json_result(out, err, rc, what="the trainer", timeout=timeout)


async def tcp_counters(ns: str) -> dict[str, int]:
    """The namespace's TCP segments sent and retransmitted (a long path's throughput is its loss's)."""
    done = await trio.run_process(["ip", "netns", "exec", ns, "nstat", "-az", "TcpOutSegs", "TcpRetransSegs"],
                                  capture_stdout=True, check=False)
    out = {}
    for line in done.stdout.decode().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("Tcp") and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


async def dmoe_at(delay_ms: float, args: argparse.Namespace) -> dict[str, Any]:
    async with Lab(prefix="dmoe", public_net=PUBLIC_NET) as lab:
        experts = await lab.public_host("experts", delay_ms=delay_ms, wire=args.zero_delay_path == "wire")
        trainer = await lab.public_host("trainer", delay_ms=0.0)
        if args.tcp_buffer_mib:
            # a long fat path: Linux's default most send buffer (4 MiB, less its bookkeeping) caps a TCP
            # connection at about that per round trip; an operator of a far peer raises it like this
            top = args.tcp_buffer_mib << 20
            for host in (experts, trainer):
                for knob in (f"net.ipv4.tcp_wmem=4096 16384 {top}", f"net.ipv4.tcp_rmem=4096 131072 {top}"):
                    await trio.run_process(["ip", "netns", "exec", host.ns, "sysctl", "-qw", knob])
        _relay, boot = await relay_on(experts)
        logs = []
        for i, pattern in enumerate(("ffn.[0:4].[0:2]", "ffn.[0:4].[2:4]")):
            log = tempfile.TemporaryFile()
            logs.append(log)
            await experts.spawn(python_argv([
                PY, "-m", "training.commands", "serve-experts", "--expert-pattern", pattern, "--hidden-dim", "256",
                "--initial-peers", boot, "--listen", f"/ip4/0.0.0.0/tcp/{4002 + i}", "--ephemeral", "--device", "cpu",
                "--threads", "1", "--no-port-mapping", "--status-interval", "0",
                "--min-batch-size", str(args.min_batch_size), "--max-wait", str(args.max_wait)]),
                stdout=log, stderr=log, cwd=str(REPO))
        wire_cpu, started = lab.wire_cpu_seconds(), trio.current_time()
        try:
            result = await worker(trainer, ["--initial-peers", boot, "--seconds", str(args.seconds), "--concurrency",
                                            str(args.concurrency), "--streams", str(args.streams), *(["--half"] if args.half else []), *(["--raw"] if args.raw else [])], timeout=args.seconds + 180)
        except RuntimeError as e:
            said = []
            for log in logs:
                log.seek(0)
                said.append(log.read().decode(errors="replace")[-1500:])
            raise RuntimeError(f"{e}\n-- the servers said:\n" + "\n--\n".join(said)) from None
        finally:
            for log in logs:
                log.close()
        result["mechanism"] = lab.mechanism if lab.wired_links or lab.netem else "veth"
        # the wire's share of a core while the trainer ran (its warm-up and set-up included)
        result["wire_cores"] = round((lab.wire_cpu_seconds() - wire_cpu) / (trio.current_time() - started), 3)
        result["tcp"] = {host.name: await tcp_counters(host.ns) for host in (experts, trainer)}
        return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    delays = [float(d) for d in args.delays.split(",")]
    local = await worker(None, ["--local", "--seconds", str(args.seconds)], timeout=args.seconds + 120)
    print(f"one process: {local['samples_per_s']:.0f} samples/s", flush=True)
    results: dict[str, Any] = {"local": local, "dmoe": {}}
    for delay in delays:
        r = await dmoe_at(delay, args)
        results["dmoe"][f"{delay:g}ms"] = r
        print(f"DMoE, {delay:5g} ms one-way ({r['mechanism']}): {r['samples_per_s']:.0f} samples/s, "
              f"{r['failed_batches']} batches failed, {r['call_failures']} of {r['calls']} calls failed; per batch "
              f"{r['mean_batch_s']} s; per exchange: {1e3 * r['slot_wait_s'] / max(1, r['exchanges']):.0f} ms "
              f"waiting for a slot, {1e3 * r['exchange_s'] / max(1, r['exchanges']):.0f} ms in the exchange, "
              f"{r.get('joined', 0)} calls joined others' exchanges; the trainer's loop late by {r.get('loop_lag_ms')} ms; "
              f"the wire used {r['wire_cores']:.2f} of a core; TCP {r['tcp']}", flush=True)
    base = results["dmoe"].get("0ms", {}).get("samples_per_s")
    ratios = {}
    if base:
        for key, r in results["dmoe"].items():
            ratios[f"ratio_{key}_to_0ms"] = r["samples_per_s"] / base
        if local["samples_per_s"]:  # 0 only where no step ended in the window and its grace
            ratios["dmoe_0ms_to_local"] = base / local["samples_per_s"]
    results["latency"] = ratios
    print("\n" + "\n".join(f"{k}: {v:.2f}" for k, v in ratios.items()))
    if "ratio_200ms_to_0ms" in ratios:
        print(f"goal: at 200 ms DMoE keeps >= 0.80 of its zero-delay throughput: {ratios['ratio_200ms_to_0ms']:.2f}")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", default="0,50,100,200", help="one-way delays in ms, comma-separated")
    p.add_argument("--seconds", type=float, default=20.0, help="measured time of each setup (after 5 s of warm-up)")
    p.add_argument("--concurrency", type=int, default=192, help="batches the DMoE trainer keeps in flight")
    p.add_argument("--streams", type=int, default=120,
                   help="the trainer's calls in flight per expert server (a server takes 128 streams per peer)")
    p.add_argument("--half", action="store_true", help="tensors travel as float16 both ways")
    p.add_argument("--raw", action="store_true", help="the trainer makes a batch's exchanges from trio tasks, "
                   "no torch threads (where the time goes)")
    p.add_argument("--tcp-buffer-mib", type=int, default=32,
                   help="raise the lab hosts' most TCP send and receive buffer to this, as docs/OPERATORS.md "
                   "tells the operator of a far peer (0: the kernel's defaults)")
    p.add_argument("--min-batch-size", type=int, default=1,
                   help="the servers' `serve-experts --min-batch-size` (rows a batch waits for; 1: no wait)")
    p.add_argument("--max-wait", type=float, default=0.0, help="the servers' `serve-experts --max-wait` (seconds)")
    p.add_argument("--zero-delay-path", choices=("wire", "veth"), default="wire",
                   help="the experts' link at 0 ms: through the userspace wire like the delayed runs (the "
                   "delay alone differs), or a plain veth (then the delayed runs also pay the wire's CPU)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    reason = netns_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"bench/moe_latency.py needs network namespaces: {reason}")
    results = trio.run(run, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
