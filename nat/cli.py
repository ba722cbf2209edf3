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
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from google.protobuf.empty_pb2 import Empty
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from p2p import events as ev
from p2p.addresses import Scope, parse_peer_addr, peer_ids_of, scope_of
from p2p.auth import AuthError
from p2p.output import Output
from p2p.admission import AdmissionConfig
from p2p.conn_manager import ConnManagerConfig
from p2p.collector import settle
from p2p.resources import Rate
from p2p.trio_util import cancel_on_sigterm
from p2p.config import NodeConfig
from p2p.errors import CLOSED_SWARM_HINT, ConfigError
from p2p.hooks import PathKind
from p2p.http import parse_endpoint
from p2p.dht.events import DHTMode
from p2p.dialer import remote_addr
from p2p.node import Node
from p2p.rpc import CallContext, RemoteError

from .events import DashboardServing, HolePunched, NatStatus, PingSummary
from .peer import PEER_LISTEN, RELAY_LISTEN, AuthSettings, Peer, PeerConfig
from .port_mapping import PortMappingConfig
from .relay import RelayConfig

if TYPE_CHECKING:
    from .dashboard import Dashboard

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

    with trio.move_on_after(duration if duration is not None else float("inf")):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_sigterm, nursery.cancel_scope)
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
    config.node.connections = ConnManagerConfig(low_water=args.conn_low_water, high_water=args.conn_high_water,
                                                grace_period=args.conn_grace)
    try:
        config.node.connections.validate()
    except ConfigError as e:
        raise ConfigError(f"--conn-low-water, --conn-high-water, --conn-grace: {e}") from e
    config.nat.allow_private = args.allow_private
    if args.no_port_mapping:
        config.nat.port_mapping = PortMappingConfig(enabled=False)
    config.auth = auth_settings(args)
    duration = getattr(args, "duration", None)
    if duration is not None:  # --duration 4 with no initial peer up: the error at 4 s, not after 30 s of trying
        config.node.bootstrap_timeout = min(config.node.bootstrap_timeout, duration)
        if config.dht is not None:
            config.dht.bootstrap_timeout = min(config.dht.bootstrap_timeout, duration)
    return config


def auth_settings(args: argparse.Namespace) -> AuthSettings | None:
    """A closed run from the command line: ``--authority-dir`` (relay, backbone) or ``--authority`` with
    ``--username`` and ``--secret-file`` (peers); None for an open swarm."""
    directory = getattr(args, "authority_dir", None)
    if directory is not None:
        return AuthSettings(authority_dir=directory)
    key = getattr(args, "authority", None)
    if key is None:
        if getattr(args, "username", None) or getattr(args, "secret_file", None):
            raise ConfigError("--username and --secret-file need --authority (the run's key)")
        return None
    try:
        authority = bytes.fromhex(key)
    except ValueError:
        raise ConfigError(f"--authority {key!r}: not hex") from None
    secret = None
    if args.secret_file is not None:
        try:
            secret = bytes.fromhex(args.secret_file.read_text().strip())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--secret-file {args.secret_file}: {e}") from None
    return AuthSettings(authority=authority, username=args.username, secret=secret, server=args.auth_server)


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
                   work: Callable[[Peer, Dashboard | None], Awaitable[None]] | None = None,
                   role: str | None = None, quiet: bool = False) -> int:
    """Run a peer (``config``, else one from ``args``) printing its events until ``--duration``, Ctrl-C
    or SIGTERM; ``work`` (what a layer above does with the peer, given the ``--metrics`` dashboard to add
    its own families and page sections to, or None) runs beside it, and the peer stops when it returns.
    ``quiet``: a one-shot query's peer (``dataset list``): only what ``work`` prints is printed, as
    ``dht get`` prints only the value, not the peer's connections, relay slots and NAT verdicts."""
    config = config or peer_config(args, relay=relay)
    endpoint = getattr(args, "metrics", None)
    if endpoint:
        parse_endpoint(endpoint)  # a malformed --metrics fails before the peer starts
    async with trio.open_nursery() as nursery:
        async with Peer.open(config, on_listening=lambda node: _print_listening(
                node, out, nursery, has_pass=config.auth is not None, quiet=quiet)) as peer:
            _serve_status(peer)
            settle()  # a long-running process: full collections skip start-up's heap (p2p/collector.py)

            def report() -> None:
                peers = peer.node.connected_peers()
                peer.node.emit(ev.PeerCount(count=len(peers), peers=peers))
                peer.node.emit(NatStatus(metrics=peer.nat.metrics()))

            async with _dashboard(peer, endpoint, role or ("relay" if relay else "peer")) as dashboard:
                async with trio.open_nursery() as inner:

                    async def then_stop(job: Callable[[], Awaitable[None]]) -> None:  # whichever ends first stops both
                        await job()
                        inner.cancel_scope.cancel()

                    if work is not None:
                        inner.start_soon(then_stop, partial(work, peer, dashboard))
                    inner.start_soon(then_stop, partial(_serve, args.duration, args.status_interval, report))
            await trio.sleep(0)  # let the last event reach the printer
        nursery.cancel_scope.cancel()
    return 0


@asynccontextmanager
async def _dashboard(peer: Peer, endpoint: str | None, role: str) -> AsyncIterator[Dashboard | None]:
    """``--metrics``: serve the metrics and the live page (prometheus_client is imported only then)."""
    if not endpoint:
        yield None
        return
    from .dashboard import Dashboard

    async with Dashboard.serve(peer, endpoint, role=role) as dashboard:
        assert dashboard.address is not None
        host, port = dashboard.address
        base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        peer.node.emit(DashboardServing(metrics=f"{base}/metrics", page=f"{base}/"))
        yield dashboard


def _print_listening(node: Node, out: Output, nursery: trio.Nursery, *, has_pass: bool = False,
                     quiet: bool = False) -> None:
    """Print the node's events from its first moment (bootstrap progress included), unless ``quiet``;
    without a pass (``has_pass``: the peer is configured for a closed run), a closed swarm that one of
    our initial peers belongs to ends the command at once, saying so."""
    if not has_pass:
        nursery.start_soon(_refused_by_closed_swarm, node)
    if not quiet:
        nursery.start_soon(_follow, node, out)
        out.event(ev.Listening(peer_id=node.peer_id, addrs=[str(a) for a in node.addrs]))


async def _refused_by_closed_swarm(node: Node) -> None:
    """Raise :class:`AuthError` once an initial peer shows us a closed swarm's pass and we have none
    (``Node.closed_swarm``). Only an initial peer: any peer may open that protocol to us, and a stranger
    must not be able to stop a relay."""
    initial = set(peer_ids_of(node.config.initial_peers))
    async with node.events() as events:
        while True:
            closed = sorted(str(p) for p in node.closed_swarm & initial)
            if closed:
                raise AuthError(f"the swarm of {closed[0]} is closed; {CLOSED_SWARM_HINT}")
            async for event in events:
                if isinstance(event, ev.ClosedSwarm):
                    break
            else:
                return  # the node closed


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
    metrics = status_values(MessageToDict(reply))
    if out.json_mode:
        print(json.dumps(metrics), flush=True)
    else:
        width = max((len(key) for key in metrics), default=0)
        for key, value in metrics.items():
            print(f"{key:<{width}}  {value}")
    return 0


def status_values(metrics: dict[str, Any]) -> dict[str, Any]:
    """The status reply as people and scripts read it: sorted by name (``limits.*`` together,
    ``resources.*`` together), and counts as whole numbers (a protobuf Struct holds every number
    as a double, so ``connections.open`` came back as ``1.0``)."""
    return {key: int(value) if isinstance(value, float) and value.is_integer() else value
            for key, value in sorted(metrics.items())}


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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nat.cli``: this layer's commands (the ``dedloc`` entry point is training's)."""
    from .commands import main as commands_main

    return commands_main(argv)


if __name__ == "__main__":
    sys.exit(main())
