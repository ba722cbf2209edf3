"""The commands that run the network layer: relay, peer, status, ping.

Each command lives in the highest layer it imports: ``id`` and ``dht`` need
only ``p2p`` and stay there (``p2p/cli.py``, which also holds the shared
machinery); these run a :class:`nat.Peer`. The ``dedloc`` entry point sits in
the highest layer with commands (``training/cli.py``), whose parser extends
``averaging/cli.py``'s, which extends this one.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import trio
from google.protobuf.empty_pb2 import Empty
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from p2p import events as ev
from p2p.addresses import Scope, parse_peer_addr, scope_of
from p2p.cli import Output, build_parser as p2p_parser, common_options, run
from p2p.admission import AdmissionConfig
from p2p.resources import Rate, ResourceConfig
from p2p.config import NodeConfig
from p2p.errors import ConfigError
from p2p.hooks import PathKind
from p2p.dht.events import DHTMode
from p2p.dialer import remote_addr
from p2p.node import Node
from p2p.rpc import CallContext, RemoteError

from .events import HolePunched, NatStatus, PingSummary
from .peer import PEER_LISTEN, RELAY_LISTEN, Peer, PeerConfig
from .port_mapping import PortMappingConfig
from .relay import RelayConfig

STATUS_METHOD = "node.status"
#: RemoteError code for a status request from another machine.
STATUS_REFUSED = 100


async def _follow(node: Node, out: Output, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with node.events() as events:
        task_status.started()
        async for event in events:
            out.event(event)


async def _serve(duration: float | None, status_every: float, report: Callable[[], None]) -> None:
    """Call ``report`` every ``status_every`` seconds until ``duration`` (or Ctrl-C, or SIGTERM)."""

    async def reporting() -> None:
        while True:
            await trio.sleep(status_every)
            report()

    async def stop_on_sigterm(cancel: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                cancel.cancel()

    with trio.move_on_after(duration if duration is not None else float("inf")):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_on_sigterm, nursery.cancel_scope)
            if status_every > 0:
                nursery.start_soon(reporting)
            await trio.sleep_forever()


def peer_config(args: argparse.Namespace, *, relay: bool) -> PeerConfig:
    """The composed object's config from the command line (the presets, then the flags)."""
    identity = None if args.ephemeral else args.identity
    limits = RelayConfig(
        max_reservations=args.max_reservations,
        max_circuits=args.max_circuits,
        circuit_duration=args.circuit_duration,
        circuit_data=args.circuit_data_mib * 1024 * 1024,
        circuit_bandwidth=args.circuit_bandwidth_kib * 1024,
    )
    if relay:
        config = PeerConfig.relay(identity_path=identity, listen=args.listen or RELAY_LISTEN,
                                  initial_peers=args.initial_peers, limits=limits)
    elif args.client:
        if args.no_listen or args.serve_relay:
            raise ConfigError("--client contradicts --no-listen and --serve-relay: a client dials out only")
        config = PeerConfig.client(args.initial_peers, timeout=args.bootstrap_timeout)
        config.node.listen = args.listen or config.node.listen
        config.greeting = args.message
    else:
        if args.no_listen and args.listen:
            raise ConfigError("--no-listen and --listen contradict each other: give one")
        listen = [] if args.no_listen else args.listen or PEER_LISTEN
        config = PeerConfig.peer(args.initial_peers, identity_path=identity, listen=listen,
                                 bootstrap_timeout=args.bootstrap_timeout)
        config.nat.relay_service, config.nat.relay = args.serve_relay, limits
        assert config.dht is not None
        config.dht.mode = DHTMode(args.dht_mode)
        config.exchange_interval = args.exchange_interval
        config.greeting = args.message
    config.node.announce = args.announce or []
    config.node.resources.admission = AdmissionConfig(
        max_handshaking=args.max_handshaking, max_handshaking_per_address=args.max_handshaking_per_ip,
        max_handshaking_per_subnet=4 * args.max_handshaking_per_ip, handshake_timeout=args.handshake_timeout,
        max_connections=args.max_inbound, max_connections_per_address=args.max_inbound_per_ip,
        max_connections_per_subnet=4 * args.max_inbound_per_ip)
    resources = config.node.resources
    resources.max_connections_per_peer = args.max_connections_per_peer
    resources.max_inbound_streams_per_peer = args.max_streams_per_peer
    resources.max_inbound_streams_per_peer_protocol = max(1, args.max_streams_per_peer // 2)
    resources.max_memory_per_peer = args.max_memory_per_peer_mib << 20
    resources.rates.update(parse_rates(args.rate, known=set(resources.rates)))
    config.nat.allow_private = args.allow_private
    if args.no_port_mapping:
        config.nat.port_mapping = PortMappingConfig(enabled=False)
    return config


def parse_rates(values: list[str], *, known: set[str]) -> dict[str, Rate]:
    """``--rate dht=200/400`` (per second, burst; the burst defaults to twice the rate)."""
    out: dict[str, Rate] = {}
    for value in values:
        service, sep, spec = value.partition("=")
        if not sep or service not in known:
            raise ConfigError(f"--rate {value!r}: expected SERVICE=PER_S[/BURST] with a service among "
                              f"{', '.join(sorted(known))}")
        per_s, _, burst = spec.partition("/")
        try:
            rate = Rate(float(per_s), int(burst) if burst else max(1, int(2 * float(per_s))))
        except ValueError:
            raise ConfigError(f"--rate {value!r}: PER_S must be a number and BURST a whole number") from None
        rate.validate(service)
        out[service] = rate
    return out


def _serve_status(peer: Peer) -> None:
    """Answer ``dedloc status``: every layer's metrics, to callers on this machine only."""

    async def status(_: Empty, ctx: CallContext) -> Struct:
        conns = peer.node.network.get_connections(ctx.peer_id)
        if not conns or any(scope_of(remote_addr(c)) != Scope.LOOPBACK for c in conns):
            raise RemoteError("status is only served to this machine", code=STATUS_REFUSED)
        reply = Struct()
        reply.update(peer.metrics())
        return reply

    peer.node.rpc.add_unary(STATUS_METHOD, Empty, status)


async def run_peer(args: argparse.Namespace, out: Output, *, relay: bool = False, config: PeerConfig | None = None,
                   work: Callable[[Peer], Awaitable[None]] | None = None) -> int:
    """Run a peer (``config``, else one from ``args``) printing its events until ``--duration``, Ctrl-C
    or SIGTERM; ``work`` (what a layer above does with the peer) runs beside it, and the peer stops
    when it returns."""
    config = config or peer_config(args, relay=relay)
    async with trio.open_nursery() as nursery:
        async with Peer.open(config, on_listening=lambda node: _print_listening(node, out, nursery)) as peer:
            _serve_status(peer)

            def report() -> None:
                peers = peer.node.connected_peers()
                peer.node.emit(ev.PeerCount(count=len(peers), peers=peers))
                peer.node.emit(NatStatus(metrics=peer.nat.metrics()))

            async with trio.open_nursery() as inner:

                async def then_stop(job: Callable[[], Awaitable[None]]) -> None:  # whichever ends first stops both
                    await job()
                    inner.cancel_scope.cancel()

                if work is not None:
                    inner.start_soon(then_stop, partial(work, peer))
                inner.start_soon(then_stop, partial(_serve, args.duration, args.status_interval, report))
            await trio.sleep(0)  # let the last event reach the printer
        nursery.cancel_scope.cancel()
    return 0


def _print_listening(node: Node, out: Output, nursery: trio.Nursery) -> None:
    """Print the node's events from its first moment (bootstrap progress included)."""
    nursery.start_soon(_follow, node, out)
    out.event(ev.Listening(peer_id=node.peer_id, addrs=[str(a) for a in node.addrs]))


async def cmd_relay(args: argparse.Namespace, out: Output) -> int:
    return await run_peer(args, out, relay=True)


async def cmd_peer(args: argparse.Namespace, out: Output) -> int:
    return await run_peer(args, out, relay=False)


async def cmd_status(args: argparse.Namespace, out: Output) -> int:
    config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], dial_timeout=args.timeout)
    _, target = parse_peer_addr(args.address, what="node address")
    async with Node.open(config) as node:
        await node.connect(args.address)
        reply = await node.rpc.call(target, STATUS_METHOD, Empty(), Struct, timeout=args.timeout)
    metrics = MessageToDict(reply)
    if out.json_mode:
        print(json.dumps(metrics), flush=True)
    else:
        width = max((len(key) for key in metrics), default=0)
        for key, value in metrics.items():
            print(f"{key:<{width}}  {value}")
    return 0


#: What ``dedloc ping`` prints: the path as it changes and the pings, not the client's own NAT verdicts.
PING_EVENTS = (ev.ConnectionOpened, ev.ConnectionClosed, ev.PeerConnected, ev.Ping, ev.Error, HolePunched)


async def cmd_ping(args: argparse.Namespace, out: Output) -> int:
    """Ping any peer: a direct address, or ``<relay>/p2p-circuit/p2p/<peer>`` for one behind NAT.

    It runs as an outbound-only client with the relay client and hole punching, so a
    connection through a relay turns direct where the NATs allow it; the path is
    reported as it changes (``connection_opened`` with its ``kind``, ``hole_punch``
    with the time to direct) and with every ping. The last line sums it up.
    """
    _, target = parse_peer_addr(args.address, what="address to ping")
    config = PeerConfig.client([], timeout=args.timeout)
    config.dht = None
    config.node.listen = args.listen or config.node.listen
    rtts: list[float] = []
    punched: list[HolePunched] = []
    #: When the first relayed and the first direct connection to the target opened (Unix time).
    opened: dict[str, float] = {}

    async def follow(node: Node, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with node.events() as events:
            task_status.started()
            async for event in events:
                if isinstance(event, PING_EVENTS):
                    out.event(event)
                if isinstance(event, HolePunched) and event.peer_id == target:
                    punched.append(event)
                if isinstance(event, ev.ConnectionOpened) and event.peer_id == target:
                    opened.setdefault(event.kind, event.ts)

    async with trio.open_nursery() as nursery:
        async with Peer.open(config, on_listening=lambda node: nursery.start_soon(follow, node)) as peer:
            await peer.node.connect(args.address)
            for i in range(args.count):
                if i:
                    await trio.sleep(args.interval)
                rtts.append(await peer.node.ping(target, timeout=args.timeout))
            await trio.sleep(0)  # let the last event reach the printer
        nursery.cancel_scope.cancel()
    ordered = sorted(rtts)
    # Either side may have led the upgrade (the one the relayed connection reached does):
    # the connections opened tell the time to direct from both.
    relayed_at, direct_at = opened.get(PathKind.RELAYED), opened.get(PathKind.DIRECT)
    to_direct = direct_at - relayed_at if relayed_at is not None and direct_at is not None and direct_at >= relayed_at else None
    out.event(PingSummary(peer_id=target, pings=len(rtts),
                          rtt_ms_min=ordered[0] * 1e3 if ordered else None,
                          rtt_ms_median=ordered[len(ordered) // 2] * 1e3 if ordered else None,
                          punch_attempts=len(punched), time_to_direct=to_direct))
    return 0


def nat_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("NAT traversal")
    g.add_argument("--no-port-mapping", action="store_true", help="do not ask the router to forward our port (UPnP / NAT-PMP / PCP)")
    g.add_argument("--allow-private", action="store_true",
                   help="treat private addresses as reachable (a swarm inside one LAN)")
    g.add_argument("--serve-relay", action="store_true", help="also relay for NATed peers when publicly reachable")
    g.add_argument("--max-reservations", type=int, default=256, metavar="N", help="relay: peers holding a slot at once")
    g.add_argument("--max-circuits", type=int, default=128, metavar="N", help="relay: relayed connections at once")
    g.add_argument("--circuit-duration", type=int, default=3600, metavar="SECONDS", help="relay: longest relayed connection (0: no limit)")
    g.add_argument("--circuit-data-mib", type=int, default=4096, metavar="MIB", help="relay: bytes per relayed connection and direction (0: no limit)")
    g.add_argument("--circuit-bandwidth-kib", type=int, default=0, metavar="KIB/S", help="relay: bandwidth per relayed connection and direction (0: no limit)")
    d = AdmissionConfig()
    g = p.add_argument_group("inbound connections (checked before any crypto)")
    g.add_argument("--max-handshaking", type=int, default=d.max_handshaking, metavar="N",
                   help="connections still authenticating, from everyone (full: the address holding the most yields)")
    g.add_argument("--max-handshaking-per-ip", type=int, default=d.max_handshaking_per_address, metavar="N",
                   help="... from one IPv4 address or IPv6 /56 (4x that per /24 or /48)")
    g.add_argument("--handshake-timeout", type=float, default=d.handshake_timeout, metavar="SECONDS",
                   help="close a connection that has not authenticated by then")
    g.add_argument("--max-inbound", type=int, default=d.max_connections, metavar="N", help="inbound connections in all")
    g.add_argument("--max-inbound-per-ip", type=int, default=d.max_connections_per_address, metavar="N",
                   help="inbound connections from one IPv4 address or IPv6 /56 (a NAT may hide many volunteers; "
                   "4x that per /24 or /48)")
    r = ResourceConfig()
    g = p.add_argument_group("what one peer may take (after the handshake)")
    g.add_argument("--max-connections-per-peer", type=int, default=r.max_connections_per_peer, metavar="N",
                   help="inbound connections of one authenticated peer")
    g.add_argument("--max-streams-per-peer", type=int, default=r.max_inbound_streams_per_peer, metavar="N",
                   help=f"inbound streams of one peer at once (per protocol: half of it; in all: "
                   f"{r.max_inbound_streams})")
    g.add_argument("--max-memory-per-peer-mib", type=int, default=r.max_memory_per_peer >> 20, metavar="MIB",
                   help="bytes one peer may have in flight to us beyond the initial stream windows")
    g.add_argument("--rate", action="append", default=[], metavar="SERVICE=PER_S[/BURST]",
                   help="requests per second one peer may make of a service, e.g. dht=200/400; services: "
                   + ", ".join(sorted(r.rates)) + " (repeatable)")


def peer_options(p: argparse.ArgumentParser) -> None:
    """The options of a command that runs a swarm peer (``peer`` here, ``average`` a layer up)."""
    common_options(p)
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MULTIADDR",
                   help="full addresses of bootstrap nodes, ending in /p2p/<peer-id>")
    p.add_argument("--bootstrap-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="give up if no initial peer answers within this time (default: %(default)s)")
    p.add_argument("--exchange-interval", type=float, default=5.0, metavar="SECONDS",
                   help="how often to ask connected peers for more peers (default: %(default)s)")
    p.add_argument("--message", default=None, metavar="TEXT", help="send this greeting to every peer met")
    p.add_argument("--client", action="store_true",
                   help="outbound only (a script, or behind a firewall): no relay slots, no AutoNAT service, "
                   "a DHT client; averaging: send and receive, never reduce a part")
    p.add_argument("--no-listen", action="store_true",
                   help="accept no direct connection: dial out, and be reachable only through a relay slot "
                   "(as behind a NAT that maps nothing, or a firewall that drops every inbound packet)")
    p.add_argument("--dht-mode", choices=[m.value for m in DHTMode], default="auto",
                   help="serve the DHT (server), only use it (client), or serve once reachable (auto, the default)")
    nat_options(p)


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:  # type: ignore[type-arg]
    parser, sub = p2p_parser()

    p = sub.add_parser("relay", help="run a public relay and bootstrap node that others join through",
                       description="Run a bootstrap node, circuit relay v2 and AutoNAT server on a machine others can reach. "
                       "It prints the addresses to give to peers; peers behind NAT reserve slots on it.")
    common_options(p)
    nat_options(p)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR", help="other bootstrap nodes to join")
    p.set_defaults(func=cmd_relay)

    p = sub.add_parser("peer", help="join a swarm through one or more initial peers",
                       description="Join a swarm: connect to the initial peers, learn the other peers from them and connect to those.")
    peer_options(p)
    p.set_defaults(func=cmd_peer)

    p = sub.add_parser("status", help="print the NAT funnel, reachability and DHT of a node running on this machine",
                       description="Ask a `dedloc peer` or `dedloc relay` on this machine (give its 127.0.0.1 address) "
                       "for its reachability, relays, hole-punch results, bytes by path and DHT.")
    p.add_argument("address", metavar="MULTIADDR", help="the node's loopback address, ending in /p2p/<peer-id>")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("ping", help="measure the round-trip time to a peer, direct or behind NAT",
                       description="Connect to a peer as an outbound-only client with a throwaway identity and ping it. "
                       "A peer behind NAT is reached at <relay address>/p2p-circuit/p2p/<peer id>; the connection "
                       "starts relayed and turns direct when hole punching works.")
    p.add_argument("address", metavar="MULTIADDR", help="the peer's full address, ending in /p2p/<peer-id>")
    p.add_argument("-c", "--count", type=int, default=4, help="number of pings (default: %(default)s)")
    p.add_argument("-i", "--interval", type=float, default=1.0, metavar="SECONDS", help="time between pings")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="give up on one dial or ping after this long")
    p.add_argument("--listen", action="append", metavar="MULTIADDR", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print one JSON object per line for each event")
    p.set_defaults(func=cmd_ping)

    return parser, sub


def main(argv: Sequence[str] | None = None) -> int:
    parser, _ = build_parser()
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
