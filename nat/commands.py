"""The ``dedloc`` commands of the NAT layer: ``relay``, ``peer``, ``status``, ``ping`` (their options, and those
every command that runs a swarm peer shares); the commands themselves are in ``nat/cli.py``, imported
only when one runs (p2p/commands.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from collections.abc import Sequence

from p2p.admission import AdmissionConfig
from p2p.conn_manager import ConnManagerConfig
from p2p.commands import (build_parser as p2p_parser, common_options, directory, positive_count, positive_seconds,
                          run, seconds)
from p2p.dht.events import DHTMode
from p2p.resources import ResourceConfig


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
    g.add_argument("--handshake-timeout", type=positive_seconds, default=d.handshake_timeout, metavar="SECONDS",
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
    c = ConnManagerConfig()
    g = p.add_argument_group("connections kept (the connection manager: p2p/conn_manager.py)")
    g.add_argument("--conn-high-water", type=int, default=c.high_water, metavar="N",
                   help="over this many open connections, close those of least use (a relay slot's, an averaging "
                   "round's are kept)")
    g.add_argument("--conn-low-water", type=int, default=c.low_water, metavar="N",
                   help="... until this many of the others remain")
    g.add_argument("--conn-grace", type=seconds, default=c.grace_period, metavar="SECONDS",
                   help="a peer connected within this time is never closed for the count")


def peer_options(p: argparse.ArgumentParser) -> None:
    """The options of a command that runs a swarm peer (``peer`` here, ``average`` a layer up)."""
    common_options(p)
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MULTIADDR",
                   help="full addresses of bootstrap nodes, ending in /p2p/<peer-id>")
    p.add_argument("--bootstrap-timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="give up if no initial peer answers within this time (default: %(default)s; at most --duration)")
    p.add_argument("--exchange-interval", type=positive_seconds, default=5.0, metavar="SECONDS",
                   help="how often to ask connected peers for more peers while that meets new ones; "
                        "up to 16x as seldom while it does not (default: %(default)s)")
    p.add_argument("--message", default=None, metavar="TEXT", help="send this greeting to every peer met")
    p.add_argument("--client", action="store_true",
                   help="outbound only (a script, or behind a firewall): no relay slots, no AutoNAT service, "
                   "a DHT client; averaging: send and receive, never reduce a part")
    p.add_argument("--no-listen", action="store_true",
                   help="accept no direct connection: dial out, and be reachable only through a relay slot "
                   "(as behind a NAT that maps nothing, or a firewall that drops every inbound packet)")
    p.add_argument("--dht-mode", choices=[m.value for m in DHTMode], default="auto",
                   help="serve the DHT (server), only use it (client), or serve once reachable (auto, the default)")
    g = p.add_argument_group("a closed run (allowlist authentication; `dedloc authority`)")
    g.add_argument("--authority", default=None, metavar="KEY",
                   help="the run's authority key (64 hex digits): only its passholders are spoken to")
    g.add_argument("--username", default=None, help="your name on the run's allowlist")
    g.add_argument("--secret-file", type=Path, default=None, metavar="PATH",
                   help="the file holding the secret `dedloc authority add` printed for you")
    g.add_argument("--auth-server", default=None, metavar="MULTIADDR",
                   help="where passes are issued (default: the first initial peer)")
    nat_options(p)


def authority_options(p: argparse.ArgumentParser) -> None:
    """A public node that is a closed run's authority (``relay``, ``backbone``)."""
    p.add_argument("--authority-dir", type=directory, default=None, metavar="DIR",
                   help="serve passes for the allowlist in DIR (`dedloc authority add`) and admit only passholders")


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:  # type: ignore[type-arg]
    parser, sub = p2p_parser()

    p = sub.add_parser("relay", help="run a public relay and bootstrap node that others join through",
                       description="Run a bootstrap node, circuit relay v2 and AutoNAT server on a machine others can reach. "
                       "It prints the addresses to give to peers; peers behind NAT reserve slots on it.")
    common_options(p)
    nat_options(p)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR", help="other bootstrap nodes to join")
    authority_options(p)
    p.set_defaults(func="nat.cli:cmd_relay")

    p = sub.add_parser("peer", help="join a swarm through one or more initial peers",
                       description="Join a swarm: connect to the initial peers, learn the other peers from them and connect to those.")
    peer_options(p)
    p.set_defaults(func="nat.cli:cmd_peer")

    p = sub.add_parser("status", help="print the NAT funnel, reachability and DHT of a node running on this machine",
                       description="Ask a `dedloc peer` or `dedloc relay` on this machine (give its 127.0.0.1 address) "
                       "for its reachability, relays, hole-punch results, bytes by path and DHT.")
    p.add_argument("address", metavar="MULTIADDR", help="the node's loopback address, ending in /p2p/<peer-id>")
    p.add_argument("--timeout", type=positive_seconds, default=10.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.set_defaults(func="nat.cli:cmd_status")

    p = sub.add_parser("ping", help="measure the round-trip time to a peer, direct or behind NAT",
                       description="Connect to a peer as an outbound-only client with a throwaway identity and ping it. "
                       "A peer behind NAT is reached at <relay address>/p2p-circuit/p2p/<peer id>; the connection "
                       "starts relayed and turns direct when hole punching works.")
    p.add_argument("address", metavar="MULTIADDR", help="the peer's full address, ending in /p2p/<peer-id>")
    p.add_argument("-c", "--count", type=positive_count, default=4, help="number of pings (default: %(default)s)")
    p.add_argument("-i", "--interval", type=positive_seconds, default=1.0, metavar="SECONDS", help="time between pings")
    p.add_argument("--timeout", type=positive_seconds, default=10.0, metavar="SECONDS", help="give up on one dial or ping after this long")
    p.add_argument("--listen", action="append", metavar="MULTIADDR", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print one JSON object per line for each event")
    p.set_defaults(func="nat.cli:cmd_ping")

    return parser, sub


def main(argv: Sequence[str] | None = None) -> int:
    parser, sub = build_parser()
    return run(parser, argv, sub)
