"""What the benchmarks share: the bulk-transfer wire format and reading a child's first JSON line.

A transfer is an 8-byte big-endian length, the bytes, then the receiver
answers with the 8-byte count it got. It runs over any pair of ``read(n)`` /
``write(data)`` functions, so the same code measures raw sockets, Nodes and
py-libp2p hosts. Imports nothing of dedloc: a benchmark of py-libp2p alone
(``quic.py``) must not depend on the state of our own data plane.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import trio

PROTOCOL = "/dedloc/bench/sink/1.0.0"
HEADER = struct.Struct(">Q")

Read = Callable[[int], Awaitable[bytes]]
Write = Callable[[bytes], Awaitable[Any]]


async def read_exactly(read: Read, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await read(n - len(buf))
        if not chunk:
            raise EOFError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def sink(read: Read, write: Write, chunk: int) -> None:
    """Receive one transfer, reading ``chunk`` bytes at a time, and answer the count."""
    (total,) = HEADER.unpack(await read_exactly(read, HEADER.size))
    got = 0
    while got < total:
        data = await read(min(chunk, total - got))
        if not data:
            break
        got += len(data)
    await write(HEADER.pack(got))


async def source(read: Read, write: Write, total: int, chunk: int) -> None:
    """Send one transfer of ``total`` bytes in writes of ``chunk``; fail unless all arrived."""
    payload = os.urandom(chunk)
    await write(HEADER.pack(total))
    sent = 0
    while sent < total:
        n = min(chunk, total - sent)
        await write(payload if n == chunk else payload[:n])
        sent += n
    (got,) = HEADER.unpack(await read_exactly(read, HEADER.size))
    if got != total:
        raise RuntimeError(f"receiver got {got} of {total} bytes")


async def tcp_sink(stream: trio.SocketStream, chunk: int) -> None:
    """A raw TCP peer for ``trio.serve_tcp``: answer transfers until the sender hangs up."""

    async def read(n: int) -> bytes:
        return await stream.receive_some(n)

    while True:
        try:
            await sink(read, stream.send_all, chunk)
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, struct.error):
            return
