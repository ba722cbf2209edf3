"""The bulk transfer protocol of the interop tests, py side (peer.mjs has the js side).

``/dedloc/interop/bulk/1.0.0``, one stream per transfer:

- client -> server: a 25-byte header: mode (u8: 0 = the server sends after the
  client's EOF, 1 = at once, while it is still receiving), M (u64 BE: bytes
  wanted back), seed (16 bytes); then any number of payload bytes; then EOF
  (the client half-closes).
- server -> client: M bytes of ``keystream(seed)``; then a 72-byte trailer:
  payload bytes it received (u64 BE), their sha256, sha256 of the M bytes it
  sent; then EOF.

``keystream(seed)`` is AES-128-CTR with key = seed and a zero IV over zeros:
deterministic pseudo-random bytes that node and ``cryptography`` both make at
GB/s, so each side can check the other's data without it being sent twice.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import trio
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.network.stream.net_stream import NetStream

PROTOCOL = "/dedloc/interop/bulk/1.0.0"
HEADER = struct.Struct(">BQ16s")
TRAILER = struct.Struct(">Q32s32s")
AFTER_EOF, CONCURRENT = 0, 1
MODES = {"after_eof": AFTER_EOF, "concurrent": CONCURRENT}
MiB = 1024 * 1024
#: Write sizes the py side cycles through: 256 KiB writes and odd ones around
#: every boundary (yamux max frame 1 MiB, Noise message 65535, js chunks 64 KiB).
WRITE_SIZES = (256 * 1024, MiB + 7, 256 * 1024, 7, 65535, 65536 + 1, 256 * 1024 - 1, 3 * MiB + 5)
READ_SIZE = MiB


def keystream(seed: bytes) -> Callable[[int], bytes]:
    """The next ``n`` bytes of AES-128-CTR(seed, IV 0) over zeros, call by call."""
    assert len(seed) == 16
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    zeros = bytes(max(WRITE_SIZES))

    def take(n: int) -> bytes:
        if n <= len(zeros):
            return encryptor.update(zeros[:n])
        return b"".join(encryptor.update(zeros[:size]) for size in chunk_sizes(n, (len(zeros),)))

    return take


def chunk_sizes(total: int, sizes: Sequence[int] = WRITE_SIZES) -> Iterator[int]:
    """``total`` cut into pieces cycling through ``sizes`` (the last one shorter)."""
    i = 0
    while total > 0:
        size = min(total, sizes[i % len(sizes)])
        i += 1
        total -= size
        yield size


def expected_sha256(seed: bytes, n: int) -> str:
    """sha256 (hex) of the first ``n`` bytes of ``keystream(seed)``, computed here independently."""
    take = keystream(seed)
    digest = hashlib.sha256()
    for size in chunk_sizes(n, (4 * MiB,)):
        digest.update(take(size))
    return digest.hexdigest()


async def send_keystream(stream: INetStream, seed: bytes, n: int, sizes: Sequence[int] = WRITE_SIZES) -> str:
    """Write ``n`` bytes of ``keystream(seed)`` in writes of ``sizes``; their sha256 (hex)."""
    take = keystream(seed)
    digest = hashlib.sha256()
    for size in chunk_sizes(n, sizes):
        data = take(size)
        digest.update(data)
        await stream.write(data)
    return digest.hexdigest()


async def read_to_eof(stream: INetStream, on_data: Callable[[bytes], None]) -> None:
    while True:
        try:
            data = await stream.read(READ_SIZE)
        except StreamEOF:
            return
        if not data:
            return
        on_data(data)


async def half_close(stream: INetStream) -> None:
    # NetStream has close_write (yamux FIN, reads go on); INetStream does not
    assert isinstance(stream, NetStream), type(stream)
    await stream.close_write()


@dataclass
class BulkResult:
    """What one side saw of a bulk stream; ``trailer`` is the server's summary (client side only)."""

    sent_bytes: int
    sent_sha256: str
    received_bytes: int
    received_sha256: str
    peer_received_bytes: int | None = None
    peer_received_sha256: str | None = None
    peer_sent_sha256: str | None = None
    mode: int = CONCURRENT


async def bulk_client(
    stream: INetStream,
    *,
    send_bytes: int,
    send_seed: bytes,
    recv_bytes: int,
    recv_seed: bytes,
    mode: int = CONCURRENT,
    sizes: Sequence[int] = WRITE_SIZES,
) -> BulkResult:
    """Run the client side on an open bulk stream: send, half-close, read the reply to EOF."""
    received = hashlib.sha256()
    count = 0
    tail = b""

    def on_data(data: bytes) -> None:
        nonlocal count, tail
        joined = tail + data if tail else data
        cut = max(0, len(joined) - TRAILER.size)
        if cut:
            received.update(joined[:cut])
            count += cut
        tail = bytes(joined[cut:])

    sent: list[str] = []

    async def sender() -> None:
        await stream.write(HEADER.pack(mode, recv_bytes, recv_seed))
        sent.append(await send_keystream(stream, send_seed, send_bytes, sizes))
        await half_close(stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await read_to_eof(stream, on_data)
    await stream.close()
    result = BulkResult(send_bytes, sent[0], count, received.hexdigest(), mode=mode)
    if len(tail) == TRAILER.size:
        n, got_sha, sent_sha = TRAILER.unpack(tail)
        result.peer_received_bytes = n
        result.peer_received_sha256 = got_sha.hex()
        result.peer_sent_sha256 = sent_sha.hex()
    else:  # no trailer: count what came as payload, so that the mismatch shows
        result.received_bytes += len(tail)
        received.update(tail)
        result.received_sha256 = received.hexdigest()
    return result


async def bulk_server(stream: INetStream, served: list[BulkResult] | None = None) -> None:
    """Serve one bulk stream (a stream handler); appends what it saw to ``served``."""
    received = hashlib.sha256()
    count = 0
    header = b""
    parsed: list[tuple[int, int, bytes]] = []
    header_ready = trio.Event()

    def on_data(data: bytes) -> None:
        nonlocal count, header
        if not parsed:
            need = HEADER.size - len(header)
            header += data[:need]
            data = data[need:]
            if len(header) < HEADER.size:
                return
            mode, wanted, seed = HEADER.unpack(header)
            if mode not in (AFTER_EOF, CONCURRENT):
                raise ValueError(f"unknown bulk mode {mode}")
            parsed.append((mode, wanted, seed))
            header_ready.set()
        if data:
            received.update(data)
            count += len(data)

    sent: list[str] = []
    eof = trio.Event()

    async def reader() -> None:
        await read_to_eof(stream, on_data)
        eof.set()
        header_ready.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await header_ready.wait()
        if not parsed:
            raise ValueError(f"bulk stream ended inside its header ({len(header)} bytes)")
        mode, wanted, seed = parsed[0]
        if mode == AFTER_EOF:
            await eof.wait()
        sent.append(await send_keystream(stream, seed, wanted))
        await eof.wait()
    received_sha = received.hexdigest()
    await stream.write(TRAILER.pack(count, bytes.fromhex(received_sha), bytes.fromhex(sent[0])))
    await stream.close()
    if served is not None:
        served.append(BulkResult(wanted, sent[0], count, received_sha, mode=mode))
