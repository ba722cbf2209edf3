"""Round-trip latency of a tensor sent to a peer and echoed back, on loopback.

    .venv/bin/python bench/tensor_roundtrip.py [--mib 4] [--rounds 20] [--json]

What an all-reduce step does many times: send a part of the gradients, get
the reduced part back. The echoing peer runs in its own process. Both paths
use the same helpers (:mod:`averaging.tensor_stream`): over a Node stream
(TCP + Noise + Yamux) and over a plain trio TCP socket pair measured in the
same run; the median of ``--rounds`` round trips is printed with the ratio
(raw TCP time / Node time, so 1.0 would mean no cost for security and
multiplexing). A relayed path joins when relays exist (the NAT layer).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from averaging.tensor_stream import receive_tensor, send_tensor  # noqa: E402
from p2p import Node, NodeConfig  # noqa: E402
from harness import first_json, python_argv  # noqa: E402

PROTOCOL = "/dedloc/bench/echo-tensor/1.0.0"
MAX_BYTES = 1 << 30


class _TcpStream:
    """A trio socket with the read/write shape of a libp2p stream."""

    def __init__(self, sock: trio.SocketStream) -> None:
        self._sock = sock

    async def read(self, n: int) -> bytes:
        return await self._sock.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self._sock.send_all(data)


async def _echo(stream) -> None:
    """Echo tensors until the peer ends the stream."""
    out = None
    while True:
        try:
            tensor = await receive_tensor(stream, max_bytes=MAX_BYTES, out=out)
        except Exception:
            return
        out = tensor
        await send_tensor(stream, tensor)


async def serve() -> None:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)

    async def on_tcp(sock: trio.SocketStream) -> None:
        await _echo(_TcpStream(sock))

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, on_tcp, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])) as node:

            async def on_stream(stream) -> None:
                await _echo(stream)
                await stream.close()

            node.set_stream_handler(PROTOCOL, on_stream)
            print(json.dumps({"tcp_port": port, "node": str(node.addrs[0])}), flush=True)
            await trio.sleep_forever()


async def _rounds(stream, tensor: torch.Tensor, rounds: int) -> list[float]:
    back = torch.empty_like(tensor)
    times = []
    for i in range(rounds + 1):
        started = time.perf_counter()
        with trio.fail_after(60):
            await send_tensor(stream, tensor)
            await receive_tensor(stream, max_bytes=MAX_BYTES, out=back)
        if i:  # the first round warms up windows and caches
            times.append(time.perf_counter() - started)
    if not torch.equal(back, tensor):
        raise RuntimeError("the echoed tensor differs from the one sent")
    return times


async def bench(mib: int, rounds: int) -> dict[str, float]:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    tensor = torch.randn(mib * 1024 * 1024 // 4)
    proc = await trio.lowlevel.open_process(
        python_argv([sys.executable, __file__, "--serve"]), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        info = await first_json(proc, "echo")
        sock = await trio.open_tcp_stream("127.0.0.1", info["tcp_port"])
        async with sock:
            tcp = await _rounds(_TcpStream(sock), tensor, rounds)
        async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])) as node:
            peer = await node.connect(info["node"])
            stream = await node.new_stream(peer, PROTOCOL)
            times = await _rounds(stream, tensor, rounds)
            await stream.close()
    finally:
        proc.terminate()
        with trio.move_on_after(5):
            await proc.wait()
    tcp_ms, node_ms = statistics.median(tcp) * 1e3, statistics.median(times) * 1e3
    return {"mib": mib, "tcp_ms": tcp_ms, "node_ms": node_ms, "ratio": tcp_ms / node_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=4, help="tensor size in MiB (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=20, help="round trips measured (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve)
        return
    r = trio.run(bench, args.mib, args.rounds)
    if args.json:
        print(json.dumps(r))
        return
    print(f"{args.mib} MiB float32 tensor, send + echo back, median of {args.rounds} rounds, peer in another process")
    print(f"  raw trio TCP  {r['tcp_ms']:8.2f} ms")
    print(f"  Node          {r['node_ms']:8.2f} ms   ratio (TCP time / Node time) {r['ratio']:.2f}")


if __name__ == "__main__":
    main()
