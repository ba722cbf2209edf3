"""Bulk throughput of Node streams vs a plain trio TCP socket pair, on loopback.

    .venv/bin/python bench/throughput.py [--mib 256] [--streams 4] [--chunk-kib 256]

The receiving end runs in its own process (as a real peer would), the sender
here. Three paths are measured in the same run, each as a ratio to raw TCP:

- raw: a plain trio TCP socket pair (``send_all`` / ``receive_some``);
- sealed: the same sockets carrying dedloc's Noise record layer alone
  (:class:`p2p.noise.NoiseCodec`, ChaCha20-Poly1305, no muxer, no libp2p).
  This is the ceiling for any spec-exact libp2p Noise in this process model:
  each side must run the cipher over every byte on its one core;
- node: two Nodes, TCP + Noise + Yamux through py-libp2p's swarm;
- relayed (one stream): the same Nodes through a circuit relay v2 hop, with
  the relay being ``dedloc relay`` in a third process (``--no-relay`` skips it).

Every case writes ``--chunk-kib`` chunks and the raw receiver reads that much
at a time.

Each one-stream case also reports the CPU each side spent per MB (the sender's
process time, the receiver's from /proc): the busier side bounds the rate, and
it shows which side a change helped. ``cpu_ratio_node_to_sealed_1`` is the
node's rate against the sealed one's by that measure (the network layer issue's
goal: >= 0.8). On a shared machine both measures swing between runs: repeat
and compare medians.

Wire format of one transfer (both paths): 8-byte big-endian length, the bytes,
then the receiver answers with the 8-byte count it got.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import struct
import subprocess
from collections import deque
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p import Node, NodeConfig  # noqa: E402
from nat.circuit import RelayClient  # noqa: E402
from nat.lab import cpu_seconds  # noqa: E402
from p2p.noise import NoiseCodec, NoiseConfig  # noqa: E402
from harness import first_json, python_argv, start_relay  # noqa: E402
from transfer import PROTOCOL, sink, source, tcp_sink  # noqa: E402


async def _sink(read, write) -> None:
    await sink(read, write, CHUNK)


async def _source(read, write, total: int) -> None:
    await source(read, write, total, CHUNK)

CHUNK = 256 * 1024
#: Fixed keys for the sealed case: it measures the record layer, not a handshake.
KEY_A, KEY_B = bytes(range(32)), bytes(range(32, 64))
SEALED_READ = 1024 * 1024


def _sealed(stream: trio.SocketStream, codec: NoiseCodec):
    """read/write functions carrying plaintext through ``codec`` over ``stream``."""
    pending: deque[bytes] = deque()

    async def read(n: int) -> bytes:
        while not pending:
            data = await stream.receive_some(SEALED_READ)
            if not data:
                return b""
            pending.extend(codec.feed(data))
        piece = pending.popleft()
        if len(piece) > n:
            pending.appendleft(piece[n:])
            piece = piece[:n]
        return piece

    async def write(data: bytes) -> None:
        await stream.send_all(codec.encrypt(data))

    return read, write


# ---------------------------------------------------------------- receiver process


async def serve(relay: str | None, noise: NoiseConfig) -> None:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)

    async def on_tcp(stream: trio.SocketStream) -> None:
        await tcp_sink(stream, CHUNK)

    async def on_sealed(stream: trio.SocketStream) -> None:
        read, write = _sealed(stream, NoiseCodec(KEY_B, KEY_A))
        try:
            await _sink(read, write)
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, struct.error):
            return

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, on_tcp, 0, host="127.0.0.1"))
        tcp_port = listeners[0].socket.getsockname()[1]
        listeners = await nursery.start(functools.partial(trio.serve_tcp, on_sealed, 0, host="127.0.0.1"))
        sealed_port = listeners[0].socket.getsockname()[1]
        async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], noise=noise)) as node:

            async def on_stream(stream) -> None:
                await _sink(stream.read, stream.write)
                await stream.close()

            node.set_stream_handler(PROTOCOL, on_stream)
            circuit = None
            if relay:
                client = RelayClient(node)
                client.install()
                relay_id = await node.connect(relay)
                reservation = await client.reserve(relay_id)
                circuit = f"{reservation.circuit_addrs[0]}/p2p/{node.peer_id}"
            print(
                json.dumps({"tcp_port": tcp_port, "sealed_port": sealed_port, "node": str(node.addrs[0]), "circuit": circuit}),
                flush=True,
            )
            await trio.sleep_forever()


# ---------------------------------------------------------------- sender


async def bench(total_mib: int, streams: int, relayed: bool, noise: NoiseConfig) -> dict[str, float]:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    total = total_mib * 1024 * 1024
    results: dict[str, float] = {}
    relay_args: list[str] = []
    relay_proc = None
    if relayed:
        # The relay is a third process: `dedloc relay`, as people run it.
        relay_proc, relay = await start_relay()
        relay_args = ["--relay", relay]
    proc = await trio.lowlevel.open_process(python_argv(
        [sys.executable, __file__, "--serve", "--chunk-kib", str(CHUNK // 1024), *relay_args,
         *(["--crypto-threads", str(noise.crypto_threads)] if noise.crypto_threads is not None else [])]),
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )
    try:
        info = await first_json(proc, "receiver")

        async def raw_tcp(size: int) -> None:
            sock = await trio.open_tcp_stream("127.0.0.1", info["tcp_port"])
            async with sock:
                await _source(sock.receive_some, sock.send_all, size)

        async def sealed_tcp(size: int) -> None:
            sock = await trio.open_tcp_stream("127.0.0.1", info["sealed_port"])
            async with sock:
                await _source(*_sealed(sock, NoiseCodec(KEY_A, KEY_B)), size)

        async def timed(label: str, run) -> None:
            started, sent_cpu, received_cpu = time.perf_counter(), time.process_time(), cpu_seconds(proc.pid)
            with trio.fail_after(600):
                await run()
            results[label] = total / (time.perf_counter() - started) / 1e6
            # CPU per MB on each side: the busier side bounds the rate (each has a core of its own here)
            results[f"{label}_cpu_send_us_per_mb"] = (time.process_time() - sent_cpu) / total * 1e12
            results[f"{label}_cpu_recv_us_per_mb"] = (cpu_seconds(proc.pid) - received_cpu) / total * 1e12

        async def parallel(make, n: int) -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(make, total // n)

        await raw_tcp(1024 * 1024)  # warm up
        await timed("tcp_1", lambda: raw_tcp(total))
        await timed(f"tcp_{streams}", lambda: parallel(raw_tcp, streams))
        await sealed_tcp(1024 * 1024)  # warm up
        await timed("sealed_1", lambda: sealed_tcp(total))
        await timed(f"sealed_{streams}", lambda: parallel(sealed_tcp, streams))

        async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], noise=noise)) as node:
            peer = await node.connect(info["node"])

            async def node_stream(size: int) -> None:
                stream = await node.new_stream(peer, PROTOCOL)
                await _source(stream.read, stream.write, size)
                await stream.close()

            await node_stream(1024 * 1024)  # warm up
            await timed("node_1", lambda: node_stream(total))
            await timed(f"node_{streams}", lambda: parallel(node_stream, streams))

        if info["circuit"]:
            async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], noise=noise)) as node:
                RelayClient(node).install()
                peer = await node.connect(info["circuit"])

                async def relayed_stream(size: int) -> None:
                    stream = await node.new_stream(peer, PROTOCOL)
                    await _source(stream.read, stream.write, size)
                    await stream.close()

                await relayed_stream(1024 * 1024)  # warm up
                await timed("relayed_1", lambda: relayed_stream(total))
    finally:
        for p in (proc, relay_proc):
            if p is not None:
                p.terminate()
                with trio.move_on_after(5):
                    await p.wait()
    return results


def main() -> None:
    global CHUNK
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="MiB per measurement (default: %(default)s)")
    parser.add_argument("--streams", type=int, default=4, help="parallel streams in the multi-stream case")
    parser.add_argument("--chunk-kib", type=int, default=CHUNK // 1024, help="write size (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--no-relay", action="store_true", help="skip the relayed case")
    parser.add_argument("--crypto-threads", type=int, default=None,
                        help="NoiseConfig.crypto_threads of both nodes (default: chosen by the cores)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--relay", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    CHUNK = args.chunk_kib * 1024
    if args.serve:
        trio.run(serve, args.relay, NoiseConfig(crypto_threads=args.crypto_threads))
        return
    r = trio.run(bench, args.mib, args.streams, not args.no_relay, NoiseConfig(crypto_threads=args.crypto_threads))
    n = args.streams
    for path in ("sealed", "node"):
        for k in (1, n):
            r[f"ratio_{path}_{k}"] = r[f"{path}_{k}"] / r[f"tcp_{k}"]
    if "relayed_1" in r:
        r["ratio_relayed_1"] = r["relayed_1"] / r["tcp_1"]
    # the node's rate against the sealed one's in CPU: the busier side's CPU per MB, sealed over node
    busiest = {case: max(r[f"{case}_cpu_send_us_per_mb"], r[f"{case}_cpu_recv_us_per_mb"]) for case in ("sealed_1", "node_1")}
    r["cpu_ratio_node_to_sealed_1"] = busiest["sealed_1"] / busiest["node_1"] if busiest["node_1"] else float("nan")
    if args.json:
        print(json.dumps(r))
        return
    print(f"loopback bulk throughput, {args.mib} MiB per case, {args.chunk_kib} KiB writes, receiver in another process")
    print(f"{'case':<30}{'raw trio TCP':>13}{'sealed TCP':>20}{'Node':>20}")
    for k, label in ((1, "1 stream"), (n, f"{n} streams, one connection")):
        cells = [f"{r[f'tcp_{k}']:>8.0f} MB/s"]
        cells += [f"{r[f'{p}_{k}']:>8.0f} MB/s ({r[f'ratio_{p}_{k}']:.2f})" for p in ("sealed", "node")]
        print(f"{label:<30}{cells[0]:>13}{cells[1]:>20}{cells[2]:>20}")
    if "relayed_1" in r:
        cell = f"{r['relayed_1']:>8.0f} MB/s ({r['ratio_relayed_1']:.2f})"
        print(f"{'1 stream through a relay':<30}{'':>13}{'':>20}{cell:>20}")
    print("ratios to raw TCP in parentheses; sealed = Noise record layer alone, the ceiling for Noise here")
    for case in ("tcp_1", "sealed_1", "node_1"):
        print(f"  {case:9} CPU per MB: sender {r[f'{case}_cpu_send_us_per_mb']:5.0f} us, "
              f"receiver {r[f'{case}_cpu_recv_us_per_mb']:5.0f} us")
    print(f"  node / sealed by the busier side's CPU per MB: {r['cpu_ratio_node_to_sealed_1']:.2f}")
    print("(the relay is `dedloc relay` in a third process: each byte is decrypted and re-encrypted there)")
    print("(raw and sealed TCP with several streams use one socket per stream)")


if __name__ == "__main__":
    main()
