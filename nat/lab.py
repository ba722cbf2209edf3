"""A NAT testbed built from network namespaces, veth pairs, nftables, and tc netem or a userspace wire.

Everything lives in namespaces this module creates: no packet can leave the
machine, and the root namespace is never touched (every veth is created with both
ends already inside lab namespaces: ``ip -n A link add X type veth peer name Y
netns B``; nothing is ever configured in the root namespace).

Usage::

    async with Lab(prefix="dlab") as lab:
        relay = await lab.public_host("relay", delay_ms=25)
        a = await lab.peer("a", NatKind.SYMMETRIC, listen_port=4001, delay_ms=50)
        proc = await relay.spawn([sys.executable, "-m", "nat.cli", ...])
        rc, out, err = await a.run(["ping", "-c1", relay.ip], timeout=5)

Each ``Host`` has ``ns`` (its namespace), ``ip`` (its own address), ``public_ip``
(the address the internet sees for it), ``public_port`` (what the internet sees
for its listen port when it connects out from that port; ``None`` when that
depends on the destination), ``kind`` and ``routers`` (the namespaces between it
and the core, innermost first). Leaving the ``async with`` kills every process
started in the lab's namespaces and deletes the namespaces, also when the body
raised or was cancelled. ``cleanup_stale(prefix)`` removes what killed runs left.

Address plan (``public_net``, default 198.18.0.0/15, is split in two halves)
---------------------------------------------------------------------------
* ``inet``: the internet core, one namespace with ip_forward=1. Access link i
  (i = 1, 2, ...; one per public host, PUBLIC peer or outermost router) is its own
  veth pair and /24: core side ``l<i>`` = 198.18.i.1, far side (``eth0`` on a
  host, ``wan`` on a router) = 198.18.i.2, default route via 198.18.i.1.
* Routed public LANs (FIREWALL only): 198.19.i.0/24 behind link i, router ``lan``
  198.19.i.1, peer 198.19.i.2; the core routes 198.19.i.0/24 via 198.18.i.2.
* NAT LANs: 10.N.0.0/24 (N = 1, 2, ... per NATed peer), router ``lan`` 10.N.0.1,
  peer 10.N.0.2 with default route via 10.N.0.1.
* DOUBLE: the home router's ``wan`` is 100.64.N.2/24 on a carrier LAN whose
  gateway is the peer's own CGNAT namespace at 100.64.N.1; the CGNAT's ``wan`` is
  on access link i. (Each DOUBLE peer has its own CGNAT: no hairpinning modelled.)
* The core drops anything sourced from 10/8 or 100.64/10 (bogon filter), so a NAT
  that leaks an untranslated packet shows up as a failure, not as a silent pass.

Gotcha for the dedloc tests: Python's ``ipaddress`` calls 198.18.0.0/15 and the
TEST-NETs *private* (so ``p2p.addresses.scope_of`` says PRIVATE for the lab's
"public" addresses) while 100.64.0.0/10 is neither private nor global (so
``scope_of`` says PUBLIC for the carrier LAN). Pass another ``public_net`` (e.g. a
globally routed-looking /15; safe, nothing can leave the namespaces) when the code
under test must see public addresses as public.

Router namespaces and their nftables rules (see ``router_ruleset``)
-------------------------------------------------------------------
Every router has ``lan`` and ``wan``, ip_forward=1, and the same filter, a
typical home router: forward policy drop; ``ct state invalid`` dropped; replies
(``ct state established,related``) accepted; anything new from ``lan`` to ``wan``
accepted; everything arriving on ``wan`` for the router itself that is not a
reply is dropped silently (no RST: a RST from the router would kill a
simultaneous-open attempt whose SYN arrives before the local SYN went out, and
real CPE drops rather than rejects). Filtering is therefore address-and-port
dependent (conntrack): only replies to flows the inside opened come in.

* PUBLIC: no router; the peer sits on its access link like a public host.
* EIM_PRESERVING: ``oifname "wan" masquerade``. Linux NAT keeps the source port
  when the resulting tuple is unique, and tuples to different destinations are
  distinct, so one inside port maps to the same outside port for every
  destination (endpoint-independent mapping, port preserving).
* EIM_CHANGING: ``ip saddr <peer> tcp sport P snat to <wan>:P+1000`` and the same
  for udp, then ``masquerade`` for other ports. Every flow from the listen port P
  leaves as P+1000 whatever the destination. nftables has no "port + offset"
  expression for SNAT (iptables' shifted port maps are DNAT-only), and a port
  range (``masquerade to :20000-30000``) picks a *random* port per connection
  (endpoint dependent), so only the listen port is remapped; libp2p-style stacks
  send all their outbound TCP from the listen port, so that is what they observe.
* SYMMETRIC: ``masquerade fully-random``: every new flow gets a random outside
  port, so each destination sees a different port (endpoint-dependent mapping).
  (``random`` would do too; both skip Linux's "keep the source port" step.)
* DOUBLE: home router = EIM_PRESERVING rules; CGNAT = EIM_PRESERVING rules
  between carrier LAN and access link. Port preserved through both.
* FIREWALL: no NAT at all (the peer's routed public address is seen as is); the
  filter alone drops unsolicited inbound.
* UDP_BLOCKED: EIM_PRESERVING plus ``meta l4proto udp drop`` first in forward, so
  no UDP crosses the router in either direction (QUIC must fail, TCP works).

IPv6 (a lab with ``public_net6``): global addresses, no translation. The filter is
``inet``, so a router's IPv6 gets the same stateful filter (FIREWALLED, what home
routers do) unless the host asked for OPEN (new IPv6 flows from ``wan`` to ``lan``
accepted); neighbour discovery reaches the router on ``wan``. Hosts with NONE have
IPv6 on but no global address or route (an IPv6 dial fails at once, ENETUNREACH).

Delay and loss (tc netem)
-------------------------
``delay_ms`` is the one-way delay of the host's access link (the link between
its outermost router, or the host itself, and the core): a ``netem delay D``
qdisc on the egress of *both* ends, so each direction is delayed D and the RTT
over that link grows by 2*D. With the defaults (peers 50 ms, relay 25 ms) a peer
sees a 150 ms RTT to the relay and 200 ms to another peer. Links inside a home
(peer to router, home router to CGNAT) have no delay. ``loss_pct`` (per lab, or
per host) is netem loss on the same qdiscs, per direction; default 0 so tests are
deterministic. netem ``limit`` is raised to 100000 packets so bulk transfers over
a delayed link are not capped by netem's 1000-packet queue. Kernels without
sch_netem (CONFIG_NET_SCH_NETEM unset, e.g. CI's and this one) get the same
delay and loss from a userspace wire instead (:mod:`nat.delay_line`): a link with
a delay or a loss is then a pair of TUN devices, named as the veth ends would
be, and one process per lab moves the packets between them, holding each for
the one-way delay. ``lab.mechanism`` says which one the lab uses ("netem" or
"wire"); ``Lab(netem=True)`` insists on netem, ``Lab(netem=False)`` on the wire.
A link asked for no delay and no loss is a plain veth pair either way.

Bandwidth (tc tbf)
------------------
``shape=Shape(up_mbit, down_mbit)`` on ``public_host``/``peer`` limits the host's
access link with a token bucket on each direction: the far end's egress (the
host's upload) and the core end's egress (its download), so the link is full
duplex like a home line. ``burst_kb`` is the bucket (256 KB default: it must
hold the largest GSO/GRO packet a veth passes, ~64 KB plus headers; with a 64 KB
bucket tbf dropped those outright and Go's TCP in hivemind's daemon stalled)
and ``latency_ms`` bounds the queue (50 ms).
tbf is classful, so netem delay, where the kernel has it, goes below it
(``parent 1:1``) on the same interface.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import trio

from p2p.errors import ConfigError, DedlocError

from .delay_line import QUEUE_LIMIT as WIRE_QUEUE_LIMIT

__all__ = [
    "ALL_KINDS",
    "Host",
    "Ipv6",
    "Lab",
    "NatKind",
    "NetlabError",
    "NetlabTimeout",
    "RunResult",
    "Shape",
    "cleanup_stale",
    "cpu_seconds",
    "netem_unavailable_reason",
    "netns_unavailable_reason",
    "router_ruleset",
]

COMMAND_TIMEOUT = 10.0  # any single ip/nft/tc/sysctl call
CLEANUP_TIMEOUT = 30.0  # the whole teardown of one lab
TERMINATE_GRACE = 1.0  # SIGTERM → SIGKILL for spawned processes
PORT_SHIFT = 1000  # EIM_CHANGING maps listen port P to P + PORT_SHIFT
BOGONS = ("10.0.0.0/8", "100.64.0.0/10")

_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")


class NetlabError(DedlocError, RuntimeError):
    """A lab command failed; the message has the command and its stderr."""


class NetlabTimeout(NetlabError):
    """A lab command did not finish within its timeout (it was killed)."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (from /proc; OSError once it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class NatKind(enum.Enum):
    PUBLIC = "public"
    EIM_PRESERVING = "eim-preserving"
    EIM_CHANGING = "eim-changing"
    SYMMETRIC = "symmetric"
    DOUBLE = "double"
    FIREWALL = "firewall"
    UDP_BLOCKED = "udp-blocked"

    @property
    def nat(self) -> bool:
        """Whether the internet sees another address than the peer's own."""
        return self not in (NatKind.PUBLIC, NatKind.FIREWALL)

    @property
    def reachable(self) -> bool:
        """Whether unsolicited inbound connections get through."""
        return self is NatKind.PUBLIC

    @property
    def udp(self) -> bool:
        return self is not NatKind.UDP_BLOCKED

    def __str__(self) -> str:
        return self.value


ALL_KINDS: tuple[NatKind, ...] = tuple(NatKind)


class Ipv6(enum.Enum):
    """A host's IPv6, in a lab with ``public_net6``.

    NONE: IPv6 is on but there is no global address or route (a dial of an IPv6 address fails at
    once, as on an IPv4-only line). OPEN: a global address that anyone can dial (a public host; a
    home router that lets IPv6 in). FIREWALLED: a global address behind the router's stateful
    filter, the same as its IPv4 gets, without translation (what home routers do, RFC 6092).
    """

    NONE = "none"
    OPEN = "open"
    FIREWALLED = "firewalled"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Shape:
    """A full-duplex access link: ``up_mbit`` from the host, ``down_mbit`` to it (tc tbf)."""

    up_mbit: float
    down_mbit: float
    burst_kb: float = 256.0
    latency_ms: float = 50.0

    def __post_init__(self) -> None:
        if not (self.up_mbit > 0 and self.down_mbit > 0 and self.burst_kb > 0 and self.latency_ms > 0):
            raise ConfigError(f"every figure of a Shape must be positive: {self}")

    def tbf(self, mbit: float) -> list[str]:
        return ["tbf", "rate", f"{mbit:g}mbit", "burst", f"{self.burst_kb:g}kb", "latency", f"{self.latency_ms:g}ms"]


class RunResult(NamedTuple):
    rc: int
    stdout: str
    stderr: str


def _fmt(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


async def _kill_now(proc: trio.Process) -> None:
    proc.kill()


async def _run(
    argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT, input: bytes | None = None, check: bool = True
) -> RunResult:
    """Run a command to completion; kill it and raise NetlabTimeout after ``timeout`` s."""
    argv = [str(a) for a in argv]
    with trio.move_on_after(timeout) as scope:
        try:
            done = await trio.run_process(
                argv,
                stdin=input if input is not None else subprocess.DEVNULL,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                deliver_cancel=_kill_now,
            )
        except OSError as exc:
            raise NetlabError(f"cannot run {_fmt(argv)}: {exc}") from exc
    if scope.cancelled_caught:
        raise NetlabTimeout(f"timed out after {timeout:g} s: {_fmt(argv)}")
    result = RunResult(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))
    if check and result.rc != 0:
        raise NetlabError(f"{_fmt(argv)} failed (rc={result.rc}): {result.stderr.strip() or result.stdout.strip()}")
    return result


def _run_sync(argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT, input: bytes | None = None) -> RunResult:
    try:
        done = subprocess.run(list(argv), input=input, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise NetlabTimeout(f"timed out after {timeout:g} s: {_fmt(argv)}") from None
    except OSError as exc:
        return RunResult(127, "", str(exc))
    return RunResult(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))


def router_ruleset(
    kind: NatKind, *, inside_ip: str | None = None, wan_ip: str | None = None, listen_port: int | None = None,
    open_ipv6: bool = False,
) -> str:
    """The nftables ruleset (``nft -f`` text) of a router of ``kind``.

    ``kind`` is the router's behaviour: for DOUBLE pass EIM_PRESERVING for both
    the home router and the CGNAT. EIM_CHANGING needs ``inside_ip``, ``wan_ip``
    and ``listen_port``. The filter is ``inet``: IPv6 gets the same stateful filter
    as IPv4 (and no translation), unless ``open_ipv6`` lets new IPv6 flows in.
    """
    if kind is NatKind.PUBLIC:
        raise ValueError("a PUBLIC peer has no router")
    if kind is NatKind.DOUBLE:
        raise ValueError("DOUBLE is two EIM_PRESERVING routers; ask for EIM_PRESERVING")
    nat_rules: list[str] = []
    if kind is NatKind.EIM_CHANGING:
        if inside_ip is None or wan_ip is None or listen_port is None:
            raise ValueError("EIM_CHANGING needs inside_ip, wan_ip and listen_port")
        for proto in ("tcp", "udp"):
            nat_rules.append(
                f'oifname "wan" ip saddr {inside_ip} {proto} sport {listen_port} '
                f"snat to {wan_ip}:{listen_port + PORT_SHIFT}"
            )
    if kind is NatKind.SYMMETRIC:
        nat_rules.append('oifname "wan" masquerade fully-random')
    elif kind is not NatKind.FIREWALL:
        nat_rules.append('oifname "wan" masquerade')
    udp_drop = "meta l4proto udp drop" if kind is NatKind.UDP_BLOCKED else ""
    lines = []
    if nat_rules:
        lines += [
            "table ip netlab_nat {",
            "  chain postrouting {",
            "    type nat hook postrouting priority srcnat; policy accept;",
            *(f"    {r}" for r in nat_rules),
            "  }",
            "}",
        ]
    lines += [
        "table inet netlab_filter {",
        "  chain forward {",
        "    type filter hook forward priority filter; policy drop;",
        *([f"    {udp_drop}"] if udp_drop else []),
        "    ct state invalid drop",
        "    ct state established,related accept",
        '    iifname "lan" oifname "wan" accept',
        *(['    iifname "wan" oifname "lan" meta nfproto ipv6 accept'] if open_ipv6 else []),
        "  }",
        "  chain input {",
        "    type filter hook input priority filter; policy accept;",
        '    iifname "wan" ct state established,related accept',
        # IPv6's neighbour discovery (its ARP) is no reply to anything: without it the core cannot
        # find the router's address, and nothing comes back to it (RFC 4890 lets it through)
        '    iifname "wan" icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept',
        '    iifname "wan" drop',
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


CORE_RULESET = (
    "table ip netlab_core {\n"
    "  chain forward {\n"
    "    type filter hook forward priority filter; policy accept;\n"
    f"    ip saddr {{ {', '.join(BOGONS)} }} drop\n"
    f"    ip daddr {{ {', '.join(BOGONS)} }} drop\n"
    "  }\n"
    "}\n"
)


@dataclass(eq=False)
class Host:
    lab: Lab
    name: str
    kind: NatKind
    ns: str
    ip: str
    public_ip: str
    listen_port: int | None = None
    delay_ms: float = 0.0
    routers: tuple[str, ...] = ()  # router namespaces, innermost first
    shape: Shape | None = None
    ipv6: Ipv6 = Ipv6.NONE
    #: its global IPv6 address (OPEN or FIREWALLED), seen as is by the internet: IPv6 has no NAT here
    ip6: str | None = None

    @property
    def public_port(self) -> int | None:
        """The port the internet sees for a flow from ``listen_port`` (None: per destination)."""
        if self.listen_port is None or self.kind is NatKind.SYMMETRIC:
            return None
        if self.kind is NatKind.EIM_CHANGING:
            return self.listen_port + PORT_SHIFT
        return self.listen_port

    async def spawn(self, argv: Sequence[str], **kwargs: Any) -> trio.Process:
        """Start ``argv`` inside this host's namespace; the lab kills it on exit.

        ``kwargs`` go to ``trio.lowlevel.open_process`` (stdin/stdout/stderr/env/cwd...).
        """
        return await self.lab.spawn_in(self.ns, argv, **kwargs)

    async def run(
        self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT, *, input: bytes | None = None
    ) -> RunResult:
        """Run ``argv`` to completion inside the namespace: (rc, stdout, stderr).

        Raises NetlabTimeout (after killing it) when it runs longer than ``timeout``.
        """
        return await self.lab.run_in(self.ns, argv, timeout=timeout, input=input)

    async def wait_listening(self, port: int, *, udp: bool = False, timeout: float = COMMAND_TIMEOUT) -> None:
        """Wait until something in the namespace listens on (TCP) or binds (UDP) ``port``."""
        flag = "-Hlun" if udp else "-Hltn"
        with trio.move_on_after(timeout):
            while True:
                res = await self.run(["ss", flag, "sport", "=", f":{port}"], timeout=timeout)
                if res.stdout.strip():
                    return
                await trio.sleep(0.02)
        raise NetlabTimeout(f"nothing {'bound' if udp else 'listening'} on port {port} in {self.ns} after {timeout:g} s")

    def __repr__(self) -> str:
        six = f", ip6={self.ip6} ({self.ipv6})" if self.ip6 else ""
        return f"Host({self.name!r}, {self.kind}, ip={self.ip}, public_ip={self.public_ip}{six}, ns={self.ns!r})"


@dataclass(eq=False)
class _Link:
    index: int
    core_ip: str
    far_ip: str
    core_ip6: str | None = None
    far_ip6: str | None = None


@dataclass(eq=False)
class Lab:
    """A set of namespaces around one internet core; use as ``async with Lab() as lab``.

    ``netem``: None = delay/loss by netem where the kernel has sch_netem, else by the
    userspace wire; True = require netem; False = always the wire.

    ``public_net6`` (an IPv6 /48 or larger; None: no IPv6 anywhere, the default) gives the core
    IPv6 and each host the ``ipv6`` it asks for (:class:`Ipv6`; by default OPEN for a public host,
    FIREWALLED behind a router, NONE behind a DOUBLE NAT). Access link i is the /64 number i of it
    (core ``::1``, far side ``::2``); the LAN behind a router on link i is the /64 number
    0x8000 + i (router ``::1``, peer ``::2``), routed by the core to the router's ``wan``.
    """

    prefix: str = "dlab"
    loss_pct: float = 0.0
    netem: bool | None = None
    public_net: str = "198.18.0.0/15"
    public_net6: str | None = None
    command_timeout: float = COMMAND_TIMEOUT
    cleanup_timeout: float = CLEANUP_TIMEOUT
    id: str = field(init=False)
    hosts: dict[str, Host] = field(init=False, default_factory=dict)
    namespaces: list[str] = field(init=False, default_factory=list)
    core: str = field(init=False, default="")
    _procs: list[trio.Process] = field(init=False, default_factory=list)
    _links: int = field(init=False, default=0)
    _lans: int = field(init=False, default=0)
    _started: bool = field(init=False, default=False)
    _closed: bool = field(init=False, default=False)
    #: the userspace wire's process (started with the first delayed link that needs it)
    _wire: trio.Process | None = field(init=False, default=None)
    _wire_lock: trio.Lock = field(init=False, default_factory=trio.Lock)
    _wire_out: bytes = field(init=False, default=b"")
    #: links built as a userspace wire
    wired_links: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not _NAME.match(self.prefix):
            raise ConfigError(f"prefix must match {_NAME.pattern} (no '-'): {self.prefix!r}")
        net = ipaddress.ip_network(self.public_net)
        if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 16:
            raise ConfigError(f"public_net must be an IPv4 network of /16 or larger: {self.public_net}")
        self._link_net, self._routed_net = net.subnets(prefixlen_diff=1)
        self._net6: ipaddress.IPv6Network | None = None
        if self.public_net6 is not None:
            net6 = ipaddress.ip_network(self.public_net6)
            if not isinstance(net6, ipaddress.IPv6Network) or net6.prefixlen > 48:
                raise ConfigError(f"public_net6 must be an IPv6 network of /48 or larger: {self.public_net6}")
            self._net6 = net6
        # <prefix>-<pid>-<random>: the pid lets cleanup_stale skip labs of live processes.
        self.id = f"{self.prefix}-{os.getpid()}-{secrets.token_hex(2)}"

    def __repr__(self) -> str:
        return f"Lab({self.id!r}, hosts={list(self.hosts)}, delay by {self.mechanism})"

    def wire_cpu_seconds(self) -> float:
        """CPU time the userspace wire's process has used so far (0 without one): what a bench's
        delayed links cost the machine, beside what they measure."""
        if self._wire is None:
            return 0.0
        try:
            return cpu_seconds(self._wire.pid)
        except OSError:
            return 0.0

    @property
    def mechanism(self) -> str:
        """What gives links their delay and loss: "netem" (the kernel's qdisc) or "wire" (userspace)."""
        return "netem" if self.netem else "wire"

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Lab:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.close()
        except NetlabError as cleanup_error:
            if exc is None:
                raise
            exc.add_note(f"netlab cleanup also failed: {cleanup_error}")

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("lab already started")
        self._started = True
        if self.netem is not False:
            reason = netem_unavailable_reason()
            if reason is not None:
                if self.netem:
                    raise NetlabError(f"netem required but unavailable: {reason}")
                self.netem = False  # delayed or lossy links get the userspace wire
            else:
                self.netem = True
        try:
            self.core = await self._new_ns("inet", forward=True, ipv6=self._net6 is not None)
            await self._nft(self.core, CORE_RULESET)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Kill every process in the lab's namespaces and delete them; idempotent.

        Runs shielded from cancellation; every step has its own timeout.
        """
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.cleanup_timeout) as scope:
                # 1. spawned processes: SIGTERM, a grace period, then SIGKILL.
                live = [p for p in self._procs if p.returncode is None]
                for p in live:
                    _signal(p, signal.SIGTERM)
                with trio.move_on_after(TERMINATE_GRACE if live else 0):
                    for p in live:
                        await p.wait()
                for p in live:
                    if p.returncode is None:
                        _signal(p, signal.SIGKILL)
                # 2. anything else inside (grandchildren, processes started by hand).
                for ns in self.namespaces:
                    try:
                        _kill_ns_pids(ns, await _run(["ip", "netns", "pids", ns], timeout=5, check=False))
                    except NetlabError as e:
                        errors.append(str(e))
                with trio.move_on_after(5):
                    for p in live:
                        await p.wait()
                # 3. the namespaces, outermost last (deleting one destroys its veth ends).
                for ns in reversed(self.namespaces):
                    try:
                        res = await _run(["ip", "netns", "delete", ns], timeout=10, check=False)
                        if res.rc != 0 and "No such file" not in res.stderr:
                            errors.append(f"ip netns delete {ns}: {res.stderr.strip()}")
                    except NetlabError as e:
                        errors.append(str(e))
                left = [ns for ns in await _list_netns() if ns in self.namespaces]
                if left:
                    errors.append(f"namespaces left behind: {left}")
            if scope.cancelled_caught:
                errors.append(f"cleanup timed out after {self.cleanup_timeout:g} s")
                # last resort, blocking: whatever is left must not outlive the lab
                for ns in reversed(self.namespaces):
                    _kill_ns_pids(ns, _run_sync(["ip", "netns", "pids", ns], timeout=5))
                    _run_sync(["ip", "netns", "delete", ns], timeout=5)
        if errors:
            raise NetlabError("; ".join(errors))

    # -- building ----------------------------------------------------------------

    async def public_host(
        self, name: str, *, delay_ms: float = 25.0, loss_pct: float | None = None, shape: Shape | None = None,
        wire: bool = False, ipv6: Ipv6 | None = None,
    ) -> Host:
        """A host with a public address straight on the core (a relay, a bootstrap node).

        ``wire``: its link goes through the userspace wire even at zero delay (where the lab has no
        netem). A bench that compares delays then compares the delay alone: the wire's hop costs
        CPU (a Python process moving every packet) that a plain veth at zero delay does not."""
        return await self._direct(name, NatKind.PUBLIC, None, delay_ms, loss_pct, shape, wire=wire,
                                  ipv6=self._ipv6_of(NatKind.PUBLIC, ipv6))

    async def peer(
        self,
        name: str,
        kind: NatKind,
        *,
        listen_port: int = 4001,
        delay_ms: float = 50.0,
        loss_pct: float | None = None,
        shape: Shape | None = None,
        ipv6: Ipv6 | None = None,
    ) -> Host:
        """A peer behind a router of ``kind`` (PUBLIC: no router); ``shape`` limits its access link;
        ``ipv6`` its IPv6 in a lab with ``public_net6`` (see :class:`Lab`)."""
        if not 1 <= listen_port <= 65535 - PORT_SHIFT:
            raise ValueError(f"listen_port out of range: {listen_port}")
        six = self._ipv6_of(kind, ipv6)
        if kind is NatKind.PUBLIC:
            return await self._direct(name, kind, listen_port, delay_ms, loss_pct, shape, ipv6=six)
        self._check_name(name)
        loss = self.loss_pct if loss_pct is None else loss_pct
        v6 = self._net6 is not None
        host_ns = await self._new_ns(name, forward=False, ipv6=v6)
        router = await self._new_ns(f"{name}-r", forward=True, ipv6=v6)
        if kind is NatKind.FIREWALL:
            link = await self._core_link(router, "wan", delay_ms, loss, shape)
            routed = _nth24(self._routed_net, link.index)
            gw, ip = str(routed[1]), str(routed[2])
            await self._ip(self.core, "route", "add", str(routed), "via", link.far_ip)
            await self._lan(router, gw, host_ns, ip, 24)
            ip6 = await self._lan6(router, host_ns, link, six)
            await self._nft(router, router_ruleset(kind, open_ipv6=six is Ipv6.OPEN))
            return self._add(Host(self, name, kind, host_ns, ip, ip, listen_port, delay_ms, (router,), shape, six, ip6))
        self._lans += 1
        n = self._lans
        if n > 254:
            raise NetlabError("too many NATed peers in one lab (254)")
        gw, ip = f"10.{n}.0.1", f"10.{n}.0.2"
        if kind is NatKind.DOUBLE:
            cgnat = await self._new_ns(f"{name}-cg", forward=True)  # no IPv6 through a carrier's NAT here
            link = await self._core_link(cgnat, "wan", delay_ms, loss, shape, ipv6=False)
            carrier_gw, home_wan = f"100.64.{n}.1", f"100.64.{n}.2"
            await self._veth(cgnat, "lan", router, "wan")
            await self._addr(cgnat, "lan", f"{carrier_gw}/24")
            await self._addr(router, "wan", f"{home_wan}/24")
            await self._ip(router, "route", "add", "default", "via", carrier_gw)
            await self._nft(cgnat, router_ruleset(NatKind.EIM_PRESERVING))
            await self._lan(router, gw, host_ns, ip, 24)
            await self._nft(router, router_ruleset(NatKind.EIM_PRESERVING))
            routers: tuple[str, ...] = (router, cgnat)
            ip6 = None
        else:
            link = await self._core_link(router, "wan", delay_ms, loss, shape)
            await self._lan(router, gw, host_ns, ip, 24)
            ip6 = await self._lan6(router, host_ns, link, six)
            await self._nft(router, router_ruleset(kind, inside_ip=ip, wan_ip=link.far_ip, listen_port=listen_port,
                                                   open_ipv6=six is Ipv6.OPEN))
            routers = (router,)
        return self._add(Host(self, name, kind, host_ns, ip, link.far_ip, listen_port, delay_ms, routers, shape, six, ip6))

    async def spawn_in(self, ns: str, argv: Sequence[str], **kwargs: Any) -> trio.Process:
        """Start ``argv`` in lab namespace ``ns`` (a host's or a router's)."""
        self._check_ns(ns)
        proc = await trio.lowlevel.open_process(["ip", "netns", "exec", ns, *map(str, argv)], **kwargs)
        self._procs.append(proc)
        return proc

    async def run_in(
        self, ns: str, argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT, input: bytes | None = None
    ) -> RunResult:
        """Run ``argv`` to completion in lab namespace ``ns``; never raises on rc != 0."""
        self._check_ns(ns)
        return await _run(["ip", "netns", "exec", ns, *argv], timeout=timeout, input=input, check=False)

    # -- internals ---------------------------------------------------------------

    def _check_ns(self, ns: str) -> None:
        if ns not in self.namespaces:
            raise ValueError(f"{ns!r} is not a namespace of this lab")
        if self._closed:
            raise RuntimeError("lab is closed")

    def _check_name(self, name: str) -> None:
        if not self._started or self._closed:
            raise RuntimeError("use the lab inside `async with` (or between start() and close())")
        if not _NAME.match(name):
            raise ValueError(f"host name must match {_NAME.pattern}: {name!r}")
        if name in self.hosts or name == "inet":
            raise ValueError(f"host name already used: {name!r}")

    def _add(self, host: Host) -> Host:
        self.hosts[host.name] = host
        return host

    async def _direct(
        self,
        name: str,
        kind: NatKind,
        listen_port: int | None,
        delay_ms: float,
        loss_pct: float | None,
        shape: Shape | None,
        *,
        wire: bool = False,
        ipv6: Ipv6 = Ipv6.NONE,
    ) -> Host:
        self._check_name(name)
        ns = await self._new_ns(name, forward=False, ipv6=self._net6 is not None)
        loss = self.loss_pct if loss_pct is None else loss_pct
        link = await self._core_link(ns, "eth0", delay_ms, loss, shape, wire=wire, ipv6=ipv6 is not Ipv6.NONE)
        return self._add(Host(self, name, kind, ns, link.far_ip, link.far_ip, listen_port, delay_ms, (), shape,
                              ipv6, link.far_ip6))

    def _ipv6_of(self, kind: NatKind, asked: Ipv6 | None) -> Ipv6:
        """A host's IPv6: what was asked, else the default for its kind (see :class:`Lab`)."""
        if self._net6 is None:
            if asked not in (None, Ipv6.NONE):
                raise ConfigError(f"ipv6={asked} needs a lab with public_net6")
            return Ipv6.NONE
        if kind is NatKind.DOUBLE:
            if asked not in (None, Ipv6.NONE):
                raise ConfigError("IPv6 behind a DOUBLE NAT is not modelled")
            return Ipv6.NONE
        if kind is NatKind.PUBLIC and asked is Ipv6.FIREWALLED:
            raise ConfigError("a PUBLIC host has no router to filter its IPv6: ask for a FIREWALL peer")
        if asked is not None:
            return asked
        return Ipv6.OPEN if kind is NatKind.PUBLIC else Ipv6.FIREWALLED

    async def _x(self, argv: Sequence[str], input: bytes | None = None) -> RunResult:
        return await _run(argv, timeout=self.command_timeout, input=input)

    async def _ip(self, ns: str, *args: str) -> None:
        await self._x(["ip", "-n", ns, *args])

    async def _new_ns(self, role: str, *, forward: bool, ipv6: bool = False) -> str:
        """A namespace; ``ipv6``: with IPv6 on (no duplicate address detection, which holds a new
        address back for a second; no router advertisements), else off."""
        ns = f"{self.id}-{role}"
        await self._x(["ip", "netns", "add", ns])
        self.namespaces.append(ns)  # before configuring: close() must delete it whatever fails next
        await self._ip(ns, "link", "set", "lo", "up")
        six = [
            "net.ipv6.conf.all.disable_ipv6=0", "net.ipv6.conf.default.disable_ipv6=0",
            "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0",
            "net.ipv6.conf.all.accept_ra=0", "net.ipv6.conf.default.accept_ra=0",
            f"net.ipv6.conf.all.forwarding={int(forward)}",
        ] if ipv6 else ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
        await self._x(
            ["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.ip_forward={int(forward)}", *six]
        )  # fmt: skip
        return ns

    async def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        # Both ends are created inside the lab namespaces: nothing appears in the root one.
        await self._ip(ns_a, "link", "add", "name", if_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)

    async def _addr(self, ns: str, ifname: str, cidr: str) -> None:
        await self._ip(ns, "addr", "add", cidr, "dev", ifname)
        await self._ip(ns, "link", "set", ifname, "up")

    async def _lan6(self, router: str, host_ns: str, link: _Link, ipv6: Ipv6) -> str | None:
        """The IPv6 LAN behind ``router`` on ``link`` (the routed /64 0x8000 + i); the host's address."""
        if ipv6 is Ipv6.NONE or self._net6 is None or link.far_ip6 is None:
            return None
        routed = _nth64(self._net6, 0x8000 + link.index)
        gw, ip = str(routed[1]), str(routed[2])
        await self._ip(self.core, "-6", "route", "add", str(routed), "via", link.far_ip6)
        await self._ip(router, "-6", "addr", "add", f"{gw}/64", "dev", "lan", "nodad")
        await self._ip(host_ns, "-6", "addr", "add", f"{ip}/64", "dev", "eth0", "nodad")
        await self._ip(host_ns, "-6", "route", "add", "default", "via", gw)
        return ip

    async def _lan(self, router: str, gw: str, host_ns: str, ip: str, plen: int) -> None:
        await self._veth(router, "lan", host_ns, "eth0")
        await self._addr(router, "lan", f"{gw}/{plen}")
        await self._addr(host_ns, "eth0", f"{ip}/{plen}")
        await self._ip(host_ns, "route", "add", "default", "via", gw)

    async def _core_link(
        self, ns: str, ifname: str, delay_ms: float, loss_pct: float, shape: Shape | None = None,
        *, wire: bool = False, ipv6: bool = True,
    ) -> _Link:
        """Access link i between the core and ``ns``; with IPv6 too where the lab has it and ``ipv6``."""
        self._links += 1
        i = self._links
        net = _nth24(self._link_net, i)
        link = _Link(i, str(net[1]), str(net[2]))
        if self._net6 is not None and ipv6:
            net6 = _nth64(self._net6, i)
            link.core_ip6, link.far_ip6 = str(net6[1]), str(net6[2])
        core_if = f"l{i}"
        if not self.netem and (delay_ms > 0 or loss_pct > 0 or wire):
            await self._wire_link(self.core, core_if, ns, ifname, delay_ms, loss_pct, seed=i)
        else:
            await self._veth(self.core, core_if, ns, ifname)
        await self._addr(self.core, core_if, f"{link.core_ip}/24")
        await self._addr(ns, ifname, f"{link.far_ip}/24")
        await self._ip(ns, "route", "add", "default", "via", link.core_ip)
        if link.core_ip6 is not None and link.far_ip6 is not None:
            await self._ip(self.core, "-6", "addr", "add", f"{link.core_ip6}/64", "dev", core_if, "nodad")
            await self._ip(ns, "-6", "addr", "add", f"{link.far_ip6}/64", "dev", ifname, "nodad")
            await self._ip(ns, "-6", "route", "add", "default", "via", link.core_ip6)
        await self._qdiscs(self.core, core_if, delay_ms, loss_pct, shape.tbf(shape.down_mbit) if shape else None)
        await self._qdiscs(ns, ifname, delay_ms, loss_pct, shape.tbf(shape.up_mbit) if shape else None)
        return link

    async def _wire_link(self, ns_a: str, if_a: str, ns_b: str, if_b: str, delay_ms: float, loss_pct: float,
                         *, seed: int) -> None:
        """Link ``ns_a``/``if_a`` and ``ns_b``/``if_b`` through the userspace wire (two TUN devices)."""
        command = {"a_ns": ns_a, "a_dev": if_a, "b_ns": ns_b, "b_dev": if_b, "delay_ms": delay_ms,
                   "loss_pct": loss_pct, "seed": seed}
        async with self._wire_lock:
            if self._wire is None:
                self._wire = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "nat.delay_line"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self._procs.append(self._wire)
            assert self._wire.stdin is not None and self._wire.stdout is not None
            with trio.move_on_after(self.command_timeout):
                await self._wire.stdin.send_all(json.dumps(command).encode() + b"\n")
                while b"\n" not in self._wire_out:
                    chunk = await self._wire.stdout.receive_some(65536)
                    if not chunk:
                        raise NetlabError(f"the delay wire exited (rc {self._wire.returncode})")
                    self._wire_out += chunk
                line, self._wire_out = self._wire_out.split(b"\n", 1)
                answer = json.loads(line)
                if not answer.get("ok"):
                    raise NetlabError(f"the delay wire could not link {ns_a}/{if_a} and {ns_b}/{if_b}: "
                                      f"{answer.get('error')}")
                # a TUN device's ring holds txqueuelen packets (500) and drops what comes while the wire
                # is off the CPU: 812 of 193,000 packets of a DMoE run at 200 ms (`ip -s link`: TX dropped),
                # losses on a long path that no real link of the lab has; as deep as the wire's queue
                for ns, ifname in ((ns_a, if_a), (ns_b, if_b)):
                    await self._ip(ns, "link", "set", "dev", ifname, "txqueuelen", str(WIRE_QUEUE_LIMIT))
                self.wired_links += 1
                return
            raise NetlabTimeout(f"the delay wire did not answer within {self.command_timeout:g} s")

    async def _qdiscs(
        self, ns: str, ifname: str, delay_ms: float, loss_pct: float, tbf: list[str] | None
    ) -> None:
        """tbf (the rate) at the root when shaped, netem (delay, loss) under it or at the root."""
        parent = ["root"]
        if tbf is not None:
            await self._x(["tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", "handle", "1:", *tbf])
            parent = ["parent", "1:1"]
        if not self.netem or (delay_ms <= 0 and loss_pct <= 0):
            return
        args = ["tc", "-n", ns, "qdisc", "add", "dev", ifname, *parent, "netem", "limit", "100000"]
        if delay_ms > 0:
            args += ["delay", f"{delay_ms:g}ms"]
        if loss_pct > 0:
            args += ["loss", f"{loss_pct:g}%"]
        await self._x(args)

    async def _nft(self, ns: str, ruleset: str) -> None:
        await self._x(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=ruleset.encode())


def _nth64(net: ipaddress.IPv6Network, i: int) -> ipaddress.IPv6Network:
    """The ``i``-th /64 of ``net``."""
    if net.prefixlen > 64 or i >= 1 << (64 - net.prefixlen):
        raise NetlabError(f"{net} has no /64 number {i}")
    return ipaddress.IPv6Network((int(net.network_address) + (i << 64), 64))


def _nth24(net: ipaddress.IPv4Network, i: int) -> ipaddress.IPv4Network:
    if not 0 < i < 2 ** (24 - net.prefixlen) - 1:
        raise NetlabError(f"out of /24s in {net} (asked for #{i})")
    return ipaddress.IPv4Network((int(net.network_address) + (i << 8), 24))


def _signal(proc: trio.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _kill_ns_pids(ns: str, res: RunResult) -> None:
    for tok in res.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except ProcessLookupError:
                pass


async def _list_netns() -> list[str]:
    res = await _run(["ip", "netns", "list"], timeout=5, check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = "dlab", *, force: bool = False) -> list[str]:
    """Delete namespaces ``<prefix>-<pid>-...`` whose creating process is gone (all of them with ``force``).

    Kills what still runs inside them first. Synchronous, so it also works from a
    sync fixture or a shell (``python -m nat.lab --cleanup PREFIX``). Returns
    the deleted names.
    """
    if not _NAME.match(prefix):
        raise ValueError(f"bad prefix {prefix!r}")
    if shutil.which("ip") is None:
        return []
    listed = _run_sync(["ip", "netns", "list"], timeout=5)
    deleted = []
    for line in listed.stdout.splitlines():
        if not line.strip():
            continue
        ns = line.split()[0]
        parts = ns.split("-")
        if len(parts) < 4 or parts[0] != prefix or not parts[1].isdigit():
            continue
        if not force and _pid_alive(int(parts[1])):
            continue
        _kill_ns_pids(ns, _run_sync(["ip", "netns", "pids", ns], timeout=5))
        res = _run_sync(["ip", "netns", "delete", ns], timeout=10)
        if res.rc == 0:
            deleted.append(ns)
    return deleted


@functools.cache
def netns_unavailable_reason() -> str | None:
    """Why a lab cannot be built here (None: it can): root, ip/nft/tc, netns, veth, nftables NAT."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, nftables)"
    missing = [t for t in ("ip", "nft", "tc", "sysctl", "ss") if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (install iproute2, nftables, procps: `make system-deps`)"
    probe = f"netlabprobe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        res = _run_sync(["ip", "netns", "add", probe])
        if res.rc != 0:
            return f"`ip netns add` failed (unprivileged container?): {res.stderr.strip()}"
        try:
            res = _run_sync(["ip", "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"])
            if res.rc != 0:
                return f"cannot create veth pairs: {res.stderr.strip()}"
            ruleset = router_ruleset(NatKind.SYMMETRIC)
            res = _run_sync(["ip", "netns", "exec", probe, "nft", "-f", "-"], input=ruleset.encode())
            if res.rc != 0:
                return f"nftables NAT unavailable: {res.stderr.strip()}"
        finally:
            _run_sync(["ip", "netns", "delete", probe])
    except NetlabError as exc:
        return str(exc)
    return None


@functools.cache
def netem_unavailable_reason() -> str | None:
    """Why tc netem cannot be used (None: it can), e.g. a kernel without sch_netem."""
    if netns_unavailable_reason() is not None:
        return netns_unavailable_reason()
    probe = f"netlabprobe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        res = _run_sync(["ip", "netns", "add", probe])
        if res.rc != 0:
            return f"`ip netns add` failed: {res.stderr.strip()}"
        try:
            _run_sync(["ip", "-n", probe, "link", "set", "lo", "up"])
            res = _run_sync(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"])
            if res.rc != 0:
                return f"tc netem unavailable (kernel without CONFIG_NET_SCH_NETEM?): {res.stderr.strip()}"
        finally:
            _run_sync(["ip", "netns", "delete", probe])
    except NetlabError as exc:
        return str(exc)
    return None


if __name__ == "__main__":  # python -m nat.lab --cleanup [PREFIX]
    import sys

    if len(sys.argv) >= 2 and sys.argv[1] == "--cleanup":
        for gone in cleanup_stale(sys.argv[2] if len(sys.argv) > 2 else "dlab", force="--force" in sys.argv):
            print("deleted", gone)
    else:
        print(netns_unavailable_reason() or "netlab: namespaces, veth and nftables usable")
        netem = netem_unavailable_reason()
        print(f"{netem}; delay and loss go through the userspace wire (nat/delay_line.py)" if netem else "netlab: tc netem usable")
