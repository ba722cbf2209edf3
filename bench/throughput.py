"""Bulk throughput of Node streams vs a plain trio TCP socket pair, on loopback.

    .venv/bin/python bench/throughput.py [--mib 64] [--streams 4]

The receiving end runs in its own process (as a real peer would), the sender
here; both the Node path (TCP + Noise + Yamux) and the raw TCP baseline are
measured in the same run, and the ratio is printed. It only reports: the speed
target belongs to the data-plane work.

Wire format of one transfer (both paths): 8-byte big-endian length, the bytes,
then the receiver answers with the 8-byte count it got.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p import Node, NodeConfig  # noqa: E402

PROTOCOL = "/dedloc/bench/sink/1.0.0"
CHUNK = 256 * 1024
HEADER = struct.Struct(">Q")


async def _read_exactly(read, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await read(n - len(buf))
        if not chunk:
            raise EOFError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def _sink(read, write) -> None:
    (total,) = HEADER.unpack(await _read_exactly(read, HEADER.size))
    got = 0
    while got < total:
        chunk = await read(min(CHUNK, total - got))
        if not chunk:
            break
        got += len(chunk)
    await write(HEADER.pack(got))


async def _source(read, write, total: int) -> None:
    payload = os.urandom(CHUNK)
    await write(HEADER.pack(total))
    sent = 0
    while sent < total:
        n = min(CHUNK, total - sent)
        await write(payload if n == CHUNK else payload[:n])
        sent += n
    (got,) = HEADER.unpack(await _read_exactly(read, HEADER.size))
    if got != total:
        raise RuntimeError(f"receiver got {got} of {total} bytes")


# ---------------------------------------------------------------- receiver process


async def serve() -> None:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)

    async def on_tcp(stream: trio.SocketStream) -> None:
        async def read(n: int) -> bytes:
            return await stream.receive_some(n)

        while True:
            try:
                await _sink(read, stream.send_all)
            except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, struct.error):
                return

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, on_tcp, 0, host="127.0.0.1"))
        tcp_port = listeners[0].socket.getsockname()[1]
        async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])) as node:

            async def on_stream(stream) -> None:
                await _sink(stream.read, stream.write)
                await stream.close()

            node.set_stream_handler(PROTOCOL, on_stream)
            print(json.dumps({"tcp_port": tcp_port, "node": str(node.addrs[0])}), flush=True)
            await trio.sleep_forever()


# ---------------------------------------------------------------- sender


async def bench(total_mib: int, streams: int) -> dict[str, float]:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    total = total_mib * 1024 * 1024
    results: dict[str, float] = {}
    proc = await trio.lowlevel.open_process(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None
        with trio.fail_after(60):
            line = b""
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                if not chunk:
                    raise RuntimeError("receiver process died")
                line += chunk
        info = json.loads(line)

        async def raw_tcp(size: int) -> None:
            sock = await trio.open_tcp_stream("127.0.0.1", info["tcp_port"])
            async with sock:
                await _source(sock.receive_some, sock.send_all, size)

        async def timed(label: str, run) -> None:
            started = time.perf_counter()
            with trio.fail_after(600):
                await run()
            results[label] = total / (time.perf_counter() - started) / 1e6

        async def parallel(make, n: int) -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(make, total // n)

        await raw_tcp(1024 * 1024)  # warm up
        await timed("tcp_1", lambda: raw_tcp(total))
        await timed(f"tcp_{streams}", lambda: parallel(raw_tcp, streams))

        async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])) as node:
            peer = await node.connect(info["node"])

            async def node_stream(size: int) -> None:
                stream = await node.new_stream(peer, PROTOCOL)
                await _source(stream.read, stream.write, size)
                await stream.close()

            await node_stream(1024 * 1024)  # warm up
            await timed("node_1", lambda: node_stream(total))
            await timed(f"node_{streams}", lambda: parallel(node_stream, streams))
    finally:
        proc.terminate()
        with trio.move_on_after(5):
            await proc.wait()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="MiB per measurement (default: %(default)s)")
    parser.add_argument("--streams", type=int, default=4, help="parallel streams in the multi-stream case")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve)
        return
    r = trio.run(bench, args.mib, args.streams)
    n = args.streams
    ratios = {"ratio_1": r["node_1"] / r["tcp_1"], f"ratio_{n}": r[f"node_{n}"] / r[f"tcp_{n}"]}
    if args.json:
        print(json.dumps({**r, **ratios}))
        return
    print(f"loopback bulk throughput, {args.mib} MiB per case, receiver in another process")
    print(f"{'case':<28}{'raw trio TCP':>14}{'Node (Noise+Yamux)':>20}{'ratio':>8}")
    print(f"{'1 stream':<28}{r['tcp_1']:>10.1f} MB/s{r['node_1']:>15.1f} MB/s{ratios['ratio_1']:>8.3f}")
    print(f"{f'{n} streams, one connection':<28}{r[f'tcp_{n}']:>10.1f} MB/s{r[f'node_{n}']:>15.1f} MB/s{ratios[f'ratio_{n}']:>8.3f}")
    print("(raw TCP with several streams uses one socket per stream)")


if __name__ == "__main__":
    main()
