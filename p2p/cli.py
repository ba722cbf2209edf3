"""The ``dedloc`` command's machinery, and the commands that need only this layer (``id``, ``dht``).

The entry point lives in the highest layer that has commands (``nat/cli.py``
today, which adds ``relay``, ``peer``, ``status``, ``ping`` and ``demo``): each
command sits in the highest layer it imports, so this module imports nothing
above ``p2p``.

Every long-running command prints human-readable lines, or with ``--json`` one
JSON object per line for each event (``docs/CLI.md`` lists them), so monitoring
can follow a node without parsing prose.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from . import events as ev
from .config import NodeConfig
from .dht import DHT, DHTConfig, DHTMode
from .errors import DedlocError
from .identity import default_identity_path, load_or_create_identity, peer_id_of
from .node import Node
from .trio_util import unwrap_single_group

DESCRIPTION = """\
dedloc: train neural networks together over the internet, peer to peer.

Start with `dedloc demo` to see a small swarm run on this machine. To join a
real swarm, ask its operator for a bootstrap address and run
`dedloc peer --initial-peers <address>`. To host one, run `dedloc relay` on a
machine with a public IP and give people the address it prints.
"""



#: Lines that may wait unwritten while the output is not read, before new ones are dropped.
MAX_QUEUED_LINES = 10_000
#: How long a command's last lines may take to be written once it ends.
FLUSH_TIMEOUT = 5.0


class Output:
    """Writes events as JSON lines or as short human-readable lines.

    While a command runs (:meth:`writing`), lines are queued and one task writes them
    through a worker thread: a reader that stops reading (a full pipe, a terminal
    paused with Ctrl-S) stalls that thread, never the node. A relay whose output
    nobody read used to freeze on a full pipe (docs/FLOOD.md). Beyond
    :data:`MAX_QUEUED_LINES` unwritten lines, new ones are dropped and counted
    (:attr:`dropped`), and the count is written as soon as the output moves again.
    Outside :meth:`writing` (errors before or after the run) a line is written at once.
    """

    def __init__(self, json_mode: bool, stream: Any = None, *, max_queued: int = MAX_QUEUED_LINES):
        self.json_mode = json_mode
        self.stream = stream or sys.stdout
        self.max_queued = max_queued
        #: Lines dropped because the output was not read (in all).
        self.dropped = 0
        self._unreported = 0
        self._queue: deque[str] | None = None
        self._queued = trio.Event()
        self._writing = False  # a batch is in the worker thread
        self._closed = False  # the reader is gone: nothing more is written

    def event(self, event: ev.Event) -> None:
        if self.json_mode:
            self._line(event.to_json())
        else:
            text = human(event)
            if text:
                self._line(text)

    def info(self, text: str, **fields: Any) -> None:
        """A one-off result (``dedloc id``): prose for people, an object for scripts."""
        self._line(json.dumps(fields) if self.json_mode else text)

    def _line(self, text: str) -> None:
        if self._queue is None:
            print(text, file=self.stream, flush=True)
        elif self._closed:
            self.dropped += 1
        elif len(self._queue) >= self.max_queued:
            self.dropped += 1
            self._unreported += 1
        else:
            self._queue.append(text)
            self._queued.set()

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """Queue lines while the block runs, written by a task of their own; at the end,
        what is left gets :data:`FLUSH_TIMEOUT` seconds to be written."""
        self._queue = deque()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop)
                try:
                    yield
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(FLUSH_TIMEOUT):
                        while not self._closed and (self._queue or self._unreported or self._writing):
                            await trio.sleep(0.01)
                    nursery.cancel_scope.cancel()
        finally:
            self._queue = None

    async def _write_loop(self) -> None:
        assert self._queue is not None
        queue = self._queue
        while True:
            await self._queued.wait()
            self._queued = trio.Event()
            lines = list(queue)
            queue.clear()
            if self._unreported:
                notice = ev.Error(message=f"{self._unreported} output line(s) dropped: the output was not read")
                lines.append(notice.to_json() if self.json_mode else human(notice))
                self._unreported = 0
            if not lines:
                continue
            self._writing = True
            try:
                # the one thread of the CLI: a blocked write must not block the loop
                await trio.to_thread.run_sync(  # type: ignore[call-arg]  # (trio-typing's stubs, via libp2p, are older)
                    self._write_blocking, "\n".join(lines) + "\n", abandon_on_cancel=True)
            except OSError as e:  # the reader is gone (a closed pipe): the node goes on without output
                logging.getLogger(__name__).warning("the output is closed (%s): events are no longer printed", e)
                self.dropped += len(lines)
                self._close_output()
                return
            finally:
                self._writing = False
            if queue or self._unreported:
                self._queued.set()

    def _write_blocking(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _close_output(self) -> None:
        """Stop writing; later lines are dropped. Python's own flush of stdout at exit would
        fail on the closed pipe too: stdout then points at /dev/null (the ``signal``
        module's advice for SIGPIPE)."""
        assert self._queue is not None
        self._closed = True
        self.dropped += len(self._queue)
        self._queue.clear()
        if self.stream is sys.stdout:
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)


def human(event: ev.Event) -> str:
    match event:
        case ev.Listening(peer_id=pid, addrs=addrs):
            if not addrs:
                return f"peer id {pid}\nno direct address (not listening): others reach this node through a relay slot"
            lines = [f"peer id {pid}", "listening on (give one of these to others):"]
            lines += [f"  {a}" for a in addrs]
            return "\n".join(lines)
        case ev.PeerConnected(peer_id=pid, addr=addr, elapsed=t):
            return f"connected to {_short(pid)} at {addr} in {t * 1e3:.1f} ms"
        case ev.ConnectionOpened(peer_id=pid, direction=d, kind=k, addr=addr):
            return f"+ {d} {k} connection {_short(pid)} {addr}"
        case ev.ConnectionClosed(peer_id=pid, kind=k):
            return f"- {k} connection closed {_short(pid)}"
        case ev.Ping(peer_id=pid, rtt_ms=rtt, kind=kind):
            return f"ping {_short(pid)}: {rtt:.2f} ms" + (f" ({kind})" if kind else "")
        case ev.Message(peer_id=pid, text=text):
            return f"message from {_short(pid)}: {text}"
        case ev.PeerCount(count=n, peers=peers):
            return f"serving {n} peer{'s' if n != 1 else ''}" + (f": {', '.join(map(_short, peers))}" if peers else "")
        case ev.Error(message=msg):
            return f"error: {msg}"
        case ev.Closed():
            return "node stopped"
    # Events of the layers above: their own line, else a generic one.
    own = event.human()
    if own is not None:
        return own
    fields = {k: v for k, v in event.to_dict().items() if k not in ("event", "ts")}
    if event.event == "nat_status":
        m = fields.get("metrics", {})
        return (
            f"nat: {m.get('mode')}, reachability {m.get('reachability')}, mapping {m.get('mapping')}, "
            f"{m.get('reservations')} relay slot(s), punches {m.get('punch_successes')}/{m.get('punch_attempts')}"
        )
    return f"{event.event.replace('_', ' ')}: " + ", ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, []))


def _short(pid: object) -> str:
    return f"…{str(pid)[-8:]}" if pid else "?"


# ---------------------------------------------------------------------- commands


async def cmd_id(args: argparse.Namespace, out: Output) -> int:
    key_pair, created = load_or_create_identity(args.identity)
    pid = peer_id_of(key_pair)
    verb = "created" if created else "loaded"
    out.info(
        f"{pid}\n({verb} {args.identity})",
        peer_id=str(pid),
        identity_path=str(args.identity),
        created=created,
    )
    return 0


async def cmd_dht(args: argparse.Namespace, out: Output) -> int:
    """One store or get against a running swarm, as a short-lived DHT client."""
    config = NodeConfig(listen=args.listen or ["/ip4/0.0.0.0/tcp/0"], initial_peers=args.initial_peers,
                        dial_timeout=args.timeout, bootstrap_timeout=args.timeout)
    async with Node.open(config) as node:
        async with DHT.open(node, DHTConfig(mode=DHTMode.CLIENT, bootstrap_timeout=args.timeout)) as dht:
            if args.dht_command == "store":
                expiration = time.time() + args.ttl
                ok = await dht.store(args.key, args.value.encode(), expiration, subkey=args.subkey, timeout=args.timeout)
                out.info(f"stored {args.key!r} until {_when(expiration)}" if ok else
                         f"not stored: no replica took {args.key!r} (unreachable, or it holds a newer value)",
                         key=args.key, stored=ok, expiration=expiration)
                return 0 if ok else 1
            found = await dht.get(args.key, latest=args.latest, timeout=args.timeout)
    if found is None:
        out.info(f"{args.key!r}: not found", key=args.key, found=False)
        return 1
    if isinstance(found.value, bytes):
        out.info(f"{_text(found.value)}  (expires {_when(found.expiration)})", key=args.key, found=True,
                 value=_text(found.value), expiration=found.expiration)
    else:
        entries = {_text(sub) if isinstance(sub, bytes) else str(sub):
                   {"value": _text(v.value) if isinstance(v.value, bytes) else None, "expiration": v.expiration}
                   for sub, v in found.value.items()}
        lines = [f"{sub}: {e['value']}  (expires {_when(float(e['expiration'] or 0))})" for sub, e in entries.items()]
        out.info("\n".join(lines) or "(no subkeys)", key=args.key, found=True, subkeys=entries)
    return 0


def _text(value: bytes) -> str:
    """Values are bytes: show them as text when they are UTF-8, else as hex."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + value.hex()


def _when(expiration: float) -> str:
    return f"{time.strftime('%H:%M:%S', time.localtime(expiration))}, in {expiration - time.time():.0f}s"


# ---------------------------------------------------------------------- parser


def common_options(p: argparse.ArgumentParser, *, node: bool = True) -> None:
    """Options every command shares (``node``: those of a command that runs a node)."""
    p.add_argument("--json", action="store_true", help="print one JSON object per line for each event (see docs/CLI.md)")
    p.add_argument(
        "--identity", type=Path, default=default_identity_path(), metavar="PATH",
        help="identity key file, created on first use with mode 0600 (default: %(default)s)",
    )
    if node:
        p.add_argument("--listen", action="append", metavar="MULTIADDR", help="address to listen on (repeatable)")
        p.add_argument("--announce", action="append", metavar="MULTIADDR",
                       help="address to advertise instead of the listen addresses (repeatable), e.g. a public IP")
        p.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="exit after this long (default: run until Ctrl-C)")
        p.add_argument("--status-interval", type=float, default=10.0, metavar="SECONDS", help="how often to report the peer count (0: never)")
        p.add_argument("--ephemeral", action="store_true", help="use a throwaway identity instead of --identity")


def positive_seconds(text: str) -> float:
    """An argparse type: a duration that must be more than zero (a TTL of -5 s is refused, not sent)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:  # type: ignore[type-arg]
    """The commands of this layer (``id``, ``dht``); upper layers add theirs to the returned subparsers."""
    parser = argparse.ArgumentParser(
        prog="dedloc", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: py-libp2p's too)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("id", help="show this machine's peer id, creating the identity on first run",
                       description="Print the peer id of the identity file, creating a new Ed25519 identity if there is none.")
    common_options(p, node=False)
    p.set_defaults(func=cmd_id)

    p = sub.add_parser("dht", help="store or read a value in a running swarm's DHT (for debugging)",
                       description="Join the swarm as a short-lived DHT client, do one store or get, and leave.")
    dht_sub = p.add_subparsers(dest="dht_command", required=True, metavar="ACTION")

    def dht_common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--initial-peers", nargs="+", required=True, metavar="MULTIADDR",
                       help="full addresses of swarm members (e.g. the relay), ending in /p2p/<peer-id>")
        q.add_argument("--timeout", type=float, default=15.0, metavar="SECONDS", help="give up after this long")
        q.add_argument("--listen", action="append", metavar="MULTIADDR", help=argparse.SUPPRESS)
        q.add_argument("--json", action="store_true", help="print the result as one JSON object")
        q.set_defaults(func=cmd_dht)

    q = dht_sub.add_parser("get", help="print the value under KEY (exit 1 if none)")
    q.add_argument("key", metavar="KEY")
    q.add_argument("--latest", action="store_true", help="ask every replica and merge, instead of taking the first copy")
    dht_common(q)
    q = dht_sub.add_parser("store", help="store VALUE (text) under KEY for --ttl seconds")
    q.add_argument("key", metavar="KEY")
    q.add_argument("value", metavar="VALUE")
    q.add_argument("--ttl", type=positive_seconds, default=300.0, metavar="SECONDS", help="lifetime of the value (default: %(default)s)")
    q.add_argument("--subkey", default=None, metavar="SUBKEY", help="store under this subkey of a dictionary key")
    dht_common(q)

    return parser, sub


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command under trio; errors become one clear line and exit 1."""
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    out = Output(getattr(args, "json", False))
    func: Callable[[argparse.Namespace, Output], Any] = args.func

    async def command() -> int:
        async with out.writing():
            return int(await func(args, out))

    try:
        with unwrap_single_group():
            return trio.run(command)
    except KeyboardInterrupt:
        out.event(ev.Error(message="interrupted"))
        return 130
    except DedlocError as e:
        if out.json_mode:
            out.event(ev.Error(message=str(e)))
        else:
            print(f"dedloc: error: {e}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:  # several failures at once: show each
        for exc in group.exceptions:
            print(f"dedloc: error: {exc!r}", file=sys.stderr)
        return 1


def _setup_logging(verbose: int) -> None:
    logging.basicConfig(level=logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    # py-libp2p logs every failed dial attempt at ERROR; dedloc reports those itself.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL if verbose < 2 else logging.DEBUG)

