"""Bulk throughput of py-libp2p's own QUIC transport vs a plain trio TCP socket pair, on loopback.

    .venv/bin/python bench/quic.py [--mib 16] [--streams 4] [--json] [QUIC knobs]

Same structure and wire format as bench/throughput.py (8-byte big-endian length,
the bytes, then the receiver answers with the 8-byte count it got). The receiver
is its own process holding a raw trio TCP sink and a plain py-libp2p host
(``new_host(enable_quic=True)`` listening on /ip4/127.0.0.1/udp/0/quic-v1, i.e.
libp2p.transport.quic: aioquic's sans-IO QUIC under py-libp2p's trio wrapper,
TLS 1.3, native QUIC streams); the sender is here. Our p2p.Node is TCP-only and
is not involved. Cases: one stream, and --streams parallel streams on one QUIC
connection; the ratio is against raw TCP measured in the same run. Every wait
runs under trio.fail_after, so a stuck QUIC transfer is reported as FAILED
instead of hanging.

The configuration py-libp2p offers (QUICTransportConfig) can be set from the
command line and applies to both ends: --max-datagram (max_datagram_size, the
UDP payload), --stream-window / --conn-window (the aioquic flow-control
windows), --cc, --initial-rtt.

Results (2-core VM, loopback, --mib 16, py-libp2p 0.8.1 + aioquic 1.7.2; MB/s
for 1 stream / 4 streams on one connection, raw trio TCP ~1.1-3.1 GB/s):

    default config (1200-byte datagrams)     2.6-3.6 / 2.1-3.3   ratio 0.001-0.003
    --max-datagram 1452 (max for 1500 MTU)   3.4-4.3 / 3.2-3.8
    windows x4 / x16, or cubic + 1 ms RTT    2.6-3.2 / 2.1-3.0   (no material change)
    --max-datagram 8192                      18-23   / 18-20     (loopback only)
    --max-datagram 16384                     35-40   / 32-38     (loopback only)
    --max-datagram 20000                     FAILED (bug 6)

Where the time goes (py-spy on both processes, default config): the receiver
is CPU-bound at ~100% of a core for ~3000 datagrams/s (~300 us per 1200-byte
datagram): ~36% aioquic itself (decrypt/parse, building ACK packets,
datagrams_to_send being called 2-3 times per received datagram from the
listener, the per-connection event loop and the stream-data path), ~33% trio
machinery (task switches, trio.Lock acquire/release in the registry and the
stream's read/state locks, cancel scopes of the 0.1 ms/timer polling loop),
~12% the wrapper's own Python, ~6% sendto/recvfrom, ~6% epoll. The sender idles
~50%: it is starved by a collapsed congestion window, because the wrapper sends
datagrams out of packet-number order (see bug 1): ~20% of datagrams reach the
receiver reordered, aioquic's packet-threshold loss detection declares 100-150
packets/s lost and Reno keeps cwnd at 5-10 datagrams (srtt ~1.3 ms). Removing
the reordering (a scratch experiment with a lock around _transmit, not used
here) lets cwnd grow, but then the receiver's per-datagram CPU cost is the
limit and the figure stays ~2.3 MB/s. For scale, aioquic alone (two
QuicConnections in one process, datagrams handed over directly, no trio, no
sockets) does ~18 MB/s with 1200-byte datagrams on one core.

Conclusion: py-libp2p's QUIC cannot be made usable for our data path. With any
datagram size valid on a real network (<= 1452 bytes on a 1500-byte MTU) it
gives 2-4 MB/s whatever the configuration, 0.1-0.3% of raw TCP and far below
"tens of MB/s"; the cost is per datagram in pure Python (aioquic + the trio
wrapper), so no window/congestion knob moves it, and even a perfect wrapper
would be capped by aioquic at roughly 15-35 MB/s for two cores. Tens of MB/s
appear only with 8-16 KiB datagrams, which exist only on loopback (IP
fragmentation or drops on real paths). TCP stays the default data path.

py-libp2p / aioquic bugs hit (paths relative to site-packages):
 1. libp2p/transport/quic/connection.py:1636-1652 QUICConnection._transmit is
    called concurrently (stream.py:371 write, connection.py:538 event loop,
    connection.py:625 client receiver, listener.py:715 routing) and awaits
    sock.sendto() per datagram, so callers interleave and datagrams leave out
    of packet-number order -> spurious losses, cwnd collapse.
 2. libp2p/transport/quic/stream.py:634-641 handle_data_received silently drops
    data once the wrapper's receive buffer exceeds MAX_STREAM_RECEIVE_BUFFER
    (2 MiB). aioquic has already acknowledged it and its flow-control window
    grows whenever the peer's offset passes half the window
    (aioquic/quic/connection.py:4239-4243), not when the app reads, so nothing
    keeps a fast sender within the buffer: a reader that stalls 2 s on a 4 MiB
    transfer receives 2 MiB, then its read times out after 30 s.
 3. libp2p/transport/quic/connection.py:1077 compares the event type name with
    type(events.StreamDataReceived).__name__ ("type"), so the batched
    stream-data path never runs; every event takes the per-event path.
 4. libp2p/transport/quic/transport.py:337 dial()'s error handler reads
    `connection` before it is assigned, so an early dial error (e.g. an
    address without /p2p/) surfaces as UnboundLocalError.
 5. QUICTransportConfig.connection_window / stream_window (config.py:88-89) are
    read nowhere; the windows that reach aioquic are
    CONNECTION_FLOW_CONTROL_WINDOW / STREAM_FLOW_CONTROL_WINDOW (what this
    benchmark sets).
 6. max_datagram_size is validated only from below (config.py:267). aioquic
    writes a STREAM frame's length as a 2-byte varint
    (aioquic/quic/connection.py:4214), so datagrams above ~16.4 KiB produce
    corrupt frames: the peer closes with FRAME_ENCODING_ERROR ("Unknown frame
    type") and the transfer fails with a stream reset.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.transport.quic.config import QUICTransportConfig

from harness import first_json, python_argv  # noqa: E402
from transfer import PROTOCOL as SINK_PROTOCOL  # noqa: E402
from transfer import Read, Write, sink, source, tcp_sink  # noqa: E402

PROTOCOL = TProtocol(SINK_PROTOCOL)
CHUNK = 256 * 1024
LISTEN = "/ip4/127.0.0.1/udp/0/quic-v1"
CASE_TIMEOUT = 120.0  # seconds per measured case
SETUP_TIMEOUT = 60.0  # receiver start, dial, warm-up




async def _sink(read: Read, write: Write) -> None:
    await sink(read, write, CHUNK)


async def _source(read: Read, write: Write, total: int) -> None:
    await source(read, write, total, CHUNK)


def _describe(error: BaseException) -> str:
    """One line for a failure, looking through single-leaf exception groups."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    cause = f" (from {type(error.__cause__).__name__}: {error.__cause__})" if error.__cause__ else ""
    return f"{type(error).__name__}: {error}{cause}"[:300]


# ---------------------------------------------------------------- py-libp2p QUIC hosts


def quic_config(args: argparse.Namespace) -> QUICTransportConfig:
    """py-libp2p's QUICTransportConfig with the command-line knobs applied."""
    cfg = QUICTransportConfig()
    if args.max_datagram:
        cfg.max_datagram_size = args.max_datagram
    if args.stream_window:
        cfg.STREAM_FLOW_CONTROL_WINDOW = args.stream_window
        # Keep the wrapper's own buffers at least as large as the window, otherwise
        # they, not QUIC flow control, are what gets measured (and the receive
        # buffer drops data when overrun, see bug 2 in the module docstring).
        cfg.MAX_STREAM_RECEIVE_BUFFER = max(cfg.MAX_STREAM_RECEIVE_BUFFER, 2 * args.stream_window)
        cfg.STREAM_SEND_BUFFER_HIGH_WATERMARK = max(cfg.STREAM_SEND_BUFFER_HIGH_WATERMARK, args.stream_window)
    if args.conn_window:
        cfg.CONNECTION_FLOW_CONTROL_WINDOW = args.conn_window
    if args.cc:
        cfg.congestion_control_algorithm = args.cc
    if args.initial_rtt:
        cfg.initial_rtt = args.initial_rtt
    cfg.__post_init__()  # re-run py-libp2p's validation after the edits
    return cfg


def quic_host(cfg: QUICTransportConfig) -> IHost:
    return new_host(
        key_pair=create_new_key_pair(),
        listen_addrs=[multiaddr.Multiaddr(LISTEN)],
        enable_quic=True,
        quic_transport_opt=cfg,
    )


# ---------------------------------------------------------------- receiver process


async def serve(args: argparse.Namespace) -> None:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)

    async def on_tcp(stream: trio.SocketStream) -> None:
        await tcp_sink(stream, CHUNK)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, on_tcp, 0, host="127.0.0.1"))
        tcp_port = listeners[0].socket.getsockname()[1]
        host = quic_host(quic_config(args))
        async with host.run(listen_addrs=[multiaddr.Multiaddr(LISTEN)]):

            async def on_stream(stream: INetStream) -> None:
                try:
                    with trio.fail_after(CASE_TIMEOUT):
                        await _sink(stream.read, stream.write)
                except Exception:
                    pass  # the sender reports the failed case; py-libp2p would let it kill the host
                finally:
                    with trio.move_on_after(5):
                        await stream.close()

            host.set_stream_handler(PROTOCOL, on_stream)
            print(json.dumps({"tcp_port": tcp_port, "quic": str(host.get_addrs()[0])}), flush=True)
            await trio.sleep_forever()


# ---------------------------------------------------------------- sender


async def bench(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, str]]:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    total = args.mib * 1024 * 1024
    n = args.streams
    results: dict[str, float] = {}  # MB/s per case; 0.0 where the case failed
    errors: dict[str, str] = {}
    proc = await trio.lowlevel.open_process(
        python_argv([sys.executable, __file__, "--serve", *sys.argv[1:]]), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        info = await first_json(proc, "receiver", SETUP_TIMEOUT)

        async def timed(label: str, run: Callable[[], Awaitable[None]]) -> None:
            started = time.perf_counter()
            try:
                with trio.fail_after(CASE_TIMEOUT):
                    await run()
            except Exception as e:  # a stuck or broken case is a result, not a hang
                results[label] = 0.0
                errors[label] = _describe(e)
                return
            results[label] = total / (time.perf_counter() - started) / 1e6

        async def parallel(make: Callable[[int], Awaitable[None]], count: int) -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    nursery.start_soon(make, total // count)

        async def raw_tcp(size: int) -> None:
            sock = await trio.open_tcp_stream("127.0.0.1", info["tcp_port"])
            async with sock:
                await _source(sock.receive_some, sock.send_all, size)

        with trio.fail_after(SETUP_TIMEOUT):
            await raw_tcp(1024 * 1024)  # warm up
        await timed("tcp_1", lambda: raw_tcp(total))
        await timed(f"tcp_{n}", lambda: parallel(raw_tcp, n))

        async def quic_cases() -> None:
            host = quic_host(quic_config(args))
            async with host.run(listen_addrs=[multiaddr.Multiaddr(LISTEN)]):
                peer = info_from_p2p_addr(multiaddr.Multiaddr(info["quic"]))

                async def quic_stream(size: int) -> None:
                    stream = await host.new_stream(peer.peer_id, [PROTOCOL])
                    try:
                        await _source(stream.read, stream.write, size)
                    finally:
                        with trio.move_on_after(5):
                            await stream.close()

                with trio.fail_after(SETUP_TIMEOUT):
                    await host.connect(peer)
                    await quic_stream(1024 * 1024)  # warm up
                await timed("quic_1", lambda: quic_stream(total))
                await timed(f"quic_{n}", lambda: parallel(quic_stream, n))

        try:
            # Outer bound for the whole QUIC part, host start and shutdown included.
            with trio.fail_after(2 * SETUP_TIMEOUT + 2 * CASE_TIMEOUT):
                await quic_cases()
        except Exception as e:  # setup, warm-up or shutdown failed: keep the TCP figures
            results.setdefault("quic_1", 0.0)
            results.setdefault(f"quic_{n}", 0.0)
            errors["quic"] = _describe(e)
    finally:
        proc.terminate()
        with trio.move_on_after(5):
            await proc.wait()
    return results, errors


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\nResults")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=16, help="MiB per measurement (default: %(default)s)")
    parser.add_argument("--streams", type=int, default=4, help="parallel streams in the multi-stream case")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    knobs = parser.add_argument_group("QUICTransportConfig knobs, both ends (default: py-libp2p's defaults)")
    knobs.add_argument("--max-datagram", type=int, help="max_datagram_size, UDP payload bytes (1200)")
    knobs.add_argument("--stream-window", type=int, help="STREAM_FLOW_CONTROL_WINDOW bytes (1 MiB)")
    knobs.add_argument("--conn-window", type=int, help="CONNECTION_FLOW_CONTROL_WINDOW bytes (1.5 MiB)")
    knobs.add_argument("--cc", choices=["reno", "cubic"], help="congestion_control_algorithm (reno)")
    knobs.add_argument("--initial-rtt", type=float, help="initial_rtt seconds (0.1)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve, args)
        return

    r, errors = trio.run(bench, args)
    n = args.streams
    cases = [("1 stream", "1"), (f"{n} streams, one connection", str(n))]
    ratios = {f"ratio_{k}": (r[f"quic_{k}"] / r[f"tcp_{k}"] if r[f"tcp_{k}"] else 0.0) for _, k in cases}
    cfg = quic_config(args)
    config = {
        "max_datagram_size": cfg.max_datagram_size,
        "stream_window": cfg.STREAM_FLOW_CONTROL_WINDOW,
        "conn_window": cfg.CONNECTION_FLOW_CONTROL_WINDOW,
        "cc": cfg.congestion_control_algorithm,
        "initial_rtt": cfg.initial_rtt,
    }
    if args.json:
        print(json.dumps({**r, **ratios, "errors": errors, "quic_config": config}))
        return
    print(f"loopback bulk throughput, {args.mib} MiB per case, receiver in another process")
    print("py-libp2p QUIC config: " + ", ".join(f"{k}={v}" for k, v in config.items()))
    print(f"{'case':<28}{'raw trio TCP':>14}{'py-libp2p QUIC':>20}{'ratio':>8}")
    for name, k in cases:
        print(f"{name:<28}{r[f'tcp_{k}']:>10.1f} MB/s{r[f'quic_{k}']:>15.1f} MB/s{ratios[f'ratio_{k}']:>8.3f}")
    print("(raw TCP with several streams uses one socket per stream)")
    for label, error in errors.items():
        print(f"FAILED {label}: {error}")


if __name__ == "__main__":
    main()
