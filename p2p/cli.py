"""The ``dedloc`` command: run a node from a shell, or follow one from a script.

Every long-running command prints human-readable lines, or with ``--json`` one
JSON object per line for each event (``docs/CLI.md`` lists them), so monitoring
can follow a node without parsing prose.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from . import events as ev
from .addresses import parse_peer_addr
from .config import NodeConfig
from .dht import DHT, DHTConfig
from .errors import DedlocError
from .identity import default_identity_path, load_or_create_identity, peer_id_of
from .node import Node
from .peer_exchange import PeerExchange
from .trio_util import unwrap_single_group

DESCRIPTION = """\
dedloc: train neural networks together over the internet, peer to peer.

Start with `dedloc demo` to see a small swarm run on this machine. To join a
real swarm, ask its operator for a bootstrap address and run
`dedloc peer --initial-peers <address>`. To host one, run `dedloc relay` on a
machine with a public IP and give people the address it prints.
"""

RELAY_LISTEN = ["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001"]
STATUS_METHOD = "node.status"
#: RemoteError code for a status request from another machine.
STATUS_REFUSED = 100
PEER_LISTEN = ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"]


class Output:
    """Writes events as JSON lines or as short human-readable lines."""

    def __init__(self, json_mode: bool, stream: Any = None):
        self.json_mode = json_mode
        self.stream = stream or sys.stdout

    def event(self, event: ev.Event) -> None:
        if self.json_mode:
            print(event.to_json(), file=self.stream, flush=True)
        else:
            text = human(event)
            if text:
                print(text, file=self.stream, flush=True)

    def info(self, text: str, **fields: Any) -> None:
        """A one-off result (``dedloc id``): prose for people, an object for scripts."""
        if self.json_mode:
            print(json.dumps(fields), file=self.stream, flush=True)
        else:
            print(text, file=self.stream, flush=True)


def human(event: ev.Event) -> str:
    match event:
        case ev.Listening(peer_id=pid, addrs=addrs):
            lines = [f"peer id {pid}", "listening on (give one of these to others):"]
            lines += [f"  {a}" for a in addrs]
            return "\n".join(lines)
        case ev.PeerConnected(peer_id=pid, addr=addr, elapsed=t):
            return f"connected to {_short(pid)} at {addr} in {t * 1e3:.1f} ms"
        case ev.ConnectionOpened(peer_id=pid, direction=d, kind=k, addr=addr):
            return f"+ {d} {k} connection {_short(pid)} {addr}"
        case ev.ConnectionClosed(peer_id=pid, kind=k):
            return f"- {k} connection closed {_short(pid)}"
        case ev.Ping(peer_id=pid, rtt_ms=rtt):
            return f"ping {_short(pid)}: {rtt:.2f} ms"
        case ev.Message(peer_id=pid, text=text):
            return f"message from {_short(pid)}: {text}"
        case ev.PeerCount(count=n, peers=peers):
            return f"serving {n} peer{'s' if n != 1 else ''}" + (f": {', '.join(map(_short, peers))}" if peers else "")
        case ev.Error(message=msg):
            return f"error: {msg}"
        case ev.Closed():
            return "node stopped"
    # Events of the layers above (the NAT layer's, for one): a generic line.
    fields = {k: v for k, v in event.to_dict().items() if k not in ("event", "ts")}
    if event.event == "nat_status":
        m = fields.get("metrics", {})
        return (
            f"nat: {m.get('mode')}, reachability {m.get('reachability')}, mapping {m.get('mapping')}, "
            f"{m.get('reservations')} relay slot(s), punches {m.get('punch_successes')}/{m.get('punch_attempts')}"
        )
    return f"{event.event.replace('_', ' ')}: " + ", ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, []))


def _short(pid: str | None) -> str:
    return f"…{pid[-8:]}" if pid else "?"


# ---------------------------------------------------------------------- commands


def _config(args: argparse.Namespace, default_listen: list[str]) -> NodeConfig:
    identity = None if getattr(args, "ephemeral", False) else args.identity
    return NodeConfig(
        identity_path=identity,
        listen=args.listen or default_listen,
        announce=args.announce or [],
        initial_peers=getattr(args, "initial_peers", None) or [],
        bootstrap_timeout=getattr(args, "bootstrap_timeout", 30.0),
    )


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


async def _follow(node: Node, out: Output, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with node.events() as events:
        task_status.started()
        async for event in events:
            out.event(event)


async def _serve(
    node: Node, out: Output, duration: float | None, status_every: float, extra_status: Callable[[], None] | None = None
) -> None:
    """Print events and a periodic peer count until ``duration`` (or Ctrl-C)."""

    async def report() -> None:
        while True:
            await trio.sleep(status_every)
            peers = [str(p) for p in node.connected_peers()]
            node.emit(ev.PeerCount(count=len(peers), peers=peers))
            if extra_status is not None:
                extra_status()

    async def stop_on_sigterm(cancel: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                cancel.cancel()

    with trio.move_on_after(duration if duration is not None else float("inf")):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_on_sigterm, nursery.cancel_scope)
            if status_every > 0:
                nursery.start_soon(report)
            await trio.sleep_forever()


def _nat_config(args: argparse.Namespace, *, relay: bool) -> Any:
    # The NAT layer sits above p2p: the CLI is the one place here that imports it (lazily).
    from nat.relay import RelayConfig
    from nat.traversal import NatConfig

    limits = RelayConfig(
        max_reservations=args.max_reservations,
        max_circuits=args.max_circuits,
        circuit_duration=args.circuit_duration,
        circuit_data=args.circuit_data_mib * 1024 * 1024,
        circuit_bandwidth=args.circuit_bandwidth_kib * 1024,
    )
    return NatConfig(
        relay_service=relay or args.serve_relay,
        relay=limits,
        autorelay=not relay,
        port_mapping=not args.no_port_mapping,
        allow_private=args.allow_private,
    )


def _serve_status(node: Node, nat: Any, dht: DHT | None = None) -> None:
    """Answer ``dedloc status``: the funnel, to callers on this machine only."""
    from google.protobuf.empty_pb2 import Empty
    from google.protobuf.struct_pb2 import Struct

    from .addresses import Scope, scope_of
    from .dialer import remote_addr
    from .rpc import RemoteError

    async def status(_: Empty, ctx: Any) -> Struct:
        conns = node.network.get_connections(ctx.peer_id)
        if not conns or any(scope_of(remote_addr(c)) != Scope.LOOPBACK for c in conns):
            raise RemoteError("status is only served to this machine", code=STATUS_REFUSED)
        reply = Struct()
        reply.update({"peer_id": str(node.peer_id), "peers": len(node.connected_peers()), **nat.metrics()})
        if dht is not None:
            reply.update({f"dht_{k}": v for k, v in dht.stats().items()})
        return reply

    node.rpc.add_unary(STATUS_METHOD, Empty, status)


async def _run_node(args: argparse.Namespace, out: Output, *, relay: bool) -> int:
    from nat.events import NatStatus
    from nat.traversal import NatService

    config = _config(args, RELAY_LISTEN if relay else PEER_LISTEN)
    async with trio.open_nursery() as nursery:
        # Follow events from the start, so bootstrap progress is visible.
        async with Node.open(config, bootstrap=False) as node:
            await nursery.start(_follow, node, out)
            async with NatService.attach(node, _nat_config(args, relay=relay)) as nat:
                out.event(ev.Listening(peer_id=str(node.peer_id), addrs=[str(a) for a in node.addrs]))
                if config.initial_peers:
                    await node.bootstrap()
                exchange = PeerExchange(node, greeting=getattr(args, "message", None))
                exchange.serve()
                if not relay:
                    nursery.start_soon(exchange.run, args.exchange_interval)
                # A relay is the swarm's bootstrap: it serves the DHT from the start. A peer
                # serves once AutoNAT confirmed it reachable, and is a client until then.
                dht_config = DHTConfig(mode="server" if relay else args.dht_mode,
                                       bootstrap_timeout=config.bootstrap_timeout)
                async with DHT.open(node, dht_config, reachability=nat) as dht:
                    _serve_status(node, nat, dht)
                    await _serve(node, out, args.duration, args.status_interval,
                                 lambda: node.emit(NatStatus(metrics=nat.metrics())))
        nursery.cancel_scope.cancel()
    return 0


async def cmd_relay(args: argparse.Namespace, out: Output) -> int:
    return await _run_node(args, out, relay=True)


async def cmd_peer(args: argparse.Namespace, out: Output) -> int:
    return await _run_node(args, out, relay=False)


async def cmd_status(args: argparse.Namespace, out: Output) -> int:
    from google.protobuf.empty_pb2 import Empty
    from google.protobuf.json_format import MessageToDict
    from google.protobuf.struct_pb2 import Struct

    config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], dial_timeout=args.timeout)
    async with Node.open(config) as node:
        _, target = parse_peer_addr(args.address, what="node address")
        await node.connect(args.address)
        reply = await node.rpc.call(target, STATUS_METHOD, Empty(), Struct, timeout=args.timeout)
    metrics = MessageToDict(reply)
    if out.json_mode:
        print(json.dumps(metrics), flush=True)
    else:
        for key, value in metrics.items():
            print(f"{key:<22} {value}")
    return 0


async def cmd_dht(args: argparse.Namespace, out: Output) -> int:
    """One store or get against a running swarm, as a short-lived DHT client."""
    config = NodeConfig(listen=args.listen or ["/ip4/0.0.0.0/tcp/0"], initial_peers=args.initial_peers,
                        dial_timeout=args.timeout, bootstrap_timeout=args.timeout)
    async with Node.open(config) as node:
        async with DHT.open(node, DHTConfig(mode="client", bootstrap_timeout=args.timeout)) as dht:
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


async def cmd_ping(args: argparse.Namespace, out: Output) -> int:
    _, target = parse_peer_addr(args.address, what="address to ping")
    config = NodeConfig(listen=args.listen or ["/ip4/0.0.0.0/tcp/0"], dial_timeout=args.timeout)
    async with trio.open_nursery() as nursery:
        async with Node.open(config) as node:
            await nursery.start(_follow, node, out)
            await node.connect(args.address)
            for i in range(args.count):
                if i:
                    await trio.sleep(args.interval)
                await node.ping(target, timeout=args.timeout)
            await trio.sleep(0)  # let the last event reach the printer
        nursery.cancel_scope.cancel()
    return 0


async def cmd_demo(args: argparse.Namespace, out: Output) -> int:
    from .demo import run_demo

    return await run_demo(peers=args.peers, duration=args.duration, out=out)


# ---------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedloc", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: py-libp2p's too)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, *, node: bool = True) -> None:
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

    p = sub.add_parser("id", help="show this machine's peer id, creating the identity on first run",
                       description="Print the peer id of the identity file, creating a new Ed25519 identity if there is none.")
    common(p, node=False)
    p.set_defaults(func=cmd_id)

    def nat_options(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("NAT traversal")
        g.add_argument("--no-port-mapping", action="store_true", help="do not ask the router to forward our port (UPnP / NAT-PMP)")
        g.add_argument("--allow-private", action="store_true",
                       help="treat private addresses as reachable (a swarm inside one LAN)")
        g.add_argument("--serve-relay", action="store_true", help="also relay for NATed peers when publicly reachable")
        g.add_argument("--max-reservations", type=int, default=256, metavar="N", help="relay: peers holding a slot at once")
        g.add_argument("--max-circuits", type=int, default=128, metavar="N", help="relay: relayed connections at once")
        g.add_argument("--circuit-duration", type=int, default=3600, metavar="SECONDS", help="relay: longest relayed connection (0: no limit)")
        g.add_argument("--circuit-data-mib", type=int, default=4096, metavar="MIB", help="relay: bytes per relayed connection and direction (0: no limit)")
        g.add_argument("--circuit-bandwidth-kib", type=int, default=0, metavar="KIB/S", help="relay: bandwidth per relayed connection and direction (0: no limit)")

    p = sub.add_parser("relay", help="run a public relay and bootstrap node that others join through",
                       description="Run a bootstrap node, circuit relay v2 and AutoNAT server on a machine others can reach. "
                       "It prints the addresses to give to peers; peers behind NAT reserve slots on it.")
    common(p)
    nat_options(p)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR", help="other bootstrap nodes to join")
    p.set_defaults(func=cmd_relay)

    p = sub.add_parser("peer", help="join a swarm through one or more initial peers",
                       description="Join a swarm: connect to the initial peers, learn the other peers from them and connect to those.")
    common(p)
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MULTIADDR",
                   help="full addresses of bootstrap nodes, ending in /p2p/<peer-id>")
    p.add_argument("--bootstrap-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="give up if no initial peer answers within this time (default: %(default)s)")
    p.add_argument("--exchange-interval", type=float, default=5.0, metavar="SECONDS",
                   help="how often to ask connected peers for more peers (default: %(default)s)")
    p.add_argument("--message", default=None, metavar="TEXT", help="send this greeting to every peer met")
    p.add_argument("--dht-mode", choices=["auto", "server", "client"], default="auto",
                   help="serve the DHT (server), only use it (client), or serve once reachable (auto, the default)")
    nat_options(p)
    p.set_defaults(func=cmd_peer)

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
    q.add_argument("--ttl", type=float, default=300.0, metavar="SECONDS", help="lifetime of the value (default: %(default)s)")
    q.add_argument("--subkey", default=None, metavar="SUBKEY", help="store under this subkey of a dictionary key")
    dht_common(q)

    p = sub.add_parser("status", help="print the NAT funnel and reachability of a node running on this machine",
                       description="Ask a `dedloc peer` or `dedloc relay` on this machine (give its 127.0.0.1 address) "
                       "for its reachability, relays, hole-punch results and bytes by path.")
    p.add_argument("address", metavar="MULTIADDR", help="the node's loopback address, ending in /p2p/<peer-id>")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("ping", help="measure the round-trip time to a peer",
                       description="Connect to a peer with a throwaway identity and ping it.")
    p.add_argument("address", metavar="MULTIADDR", help="the peer's full address, ending in /p2p/<peer-id>")
    p.add_argument("-c", "--count", type=int, default=4, help="number of pings (default: %(default)s)")
    p.add_argument("-i", "--interval", type=float, default=1.0, metavar="SECONDS", help="time between pings")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="give up on one dial or ping after this long")
    p.add_argument("--listen", action="append", metavar="MULTIADDR", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print one JSON object per line for each event")
    p.set_defaults(func=cmd_ping)

    p = sub.add_parser("demo", help="start a live local swarm on loopback (a bootstrap node and several peers)",
                       description="Start, on 127.0.0.1 only, a bootstrap node and several peers in their own processes; "
                       "they find each other, exchange messages, and everything stops after --duration or on Ctrl-C.")
    p.add_argument("--peers", type=int, default=4, help="number of peers besides the bootstrap node (default: %(default)s)")
    p.add_argument("--duration", type=float, default=20.0, metavar="SECONDS", help="stop after this long (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the nodes' events as JSON lines")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    out = Output(getattr(args, "json", False))
    func: Callable[[argparse.Namespace, Output], Any] = args.func
    try:
        with unwrap_single_group():
            return int(trio.run(func, args, out))
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


if __name__ == "__main__":
    sys.exit(main())
