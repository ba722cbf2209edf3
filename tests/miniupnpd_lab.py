"""A home router running Debian's miniupnpd, in network namespaces, for tests/test_port_mapping.py.

Topology: three namespaces made here, nothing configured in the root namespace
(every veth is created with both ends already inside lab namespaces)::

    client 192.168.77.2 --lan-- router 192.168.77.1 | 11.22.33.1 --wan-- outside 11.22.33.2

The router forwards with nftables (masquerade out, miniupnpd's DNAT in) and runs
``miniupnpd -d`` with a config written to a temporary directory. The client
namespace's default route points at the router, so ``nat.port_mapping``'s
discovery (NAT-PMP/PCP to the gateway, SSDP unicast and multicast on the LAN
veth) never sees another link; the outside namespace has nothing but its veth.

Gotchas found on the way (miniupnpd 2.3.1, Debian bookworm):

* The WAN address must look public: miniupnpd refuses to forward anything when
  the ext interface has a private or documentation address (10/8, 192.168/16,
  100.64/10, 198.18/15, the TEST-NETs all count), logging "Reserved / private IP
  address ... Port forwarding is impossible". 11.22.33.0/24 is used; the
  namespaces have no route off the machine, so no real host can be reached.
* miniupnpd 2.3.1 does not create its nftables table or chains: they must exist
  (``ROUTER_RULESET``; names set in the config), and the Debian package's
  nft_init.sh cannot do it (it sources a miniupnpd_functions.sh it does not ship).
* ``-P`` with a private pid file: the default /var/run/miniupnpd.pid is shared by
  every namespace and a second instance exits with "already running".
* PCP clamps lifetimes to ``min_lifetime`` (default 120 s); the lab sets 2 s so a
  renewal can be watched. NAT-PMP and UPnP take what is asked.

The module also runs inside the namespaces: ``python -m tests.miniupnpd_lab
client|probe|connect ...`` (see ``main``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent
MINIUPNPD = "/usr/sbin/miniupnpd"
LAN_NET = "192.168.77.0/24"
ROUTER_LAN_IP = "192.168.77.1"
CLIENT_IP = "192.168.77.2"
WAN_IP = "11.22.33.1"
OUTSIDE_IP = "11.22.33.2"
HTTP_PORT = 5000
COMMAND_TIMEOUT = 10.0

ROUTER_RULESET = """
table inet miniupnpd {
    chain forward {
        type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept
        jump forward_miniupnpd
    }
    chain forward_miniupnpd {
    }
    chain prerouting {
        type nat hook prerouting priority -100; policy accept;
        jump prerouting_miniupnpd
    }
    chain prerouting_miniupnpd {
    }
    chain postrouting {
        type nat hook postrouting priority 100; policy accept;
        jump postrouting_miniupnpd
        oifname "wan" masquerade
    }
    chain postrouting_miniupnpd {
    }
}
"""


def miniupnpd_config(workdir: Path) -> str:
    return f"""\
ext_ifname=wan
listening_ip=lan
http_port={HTTP_PORT}
enable_natpmp=yes
enable_upnp=yes
secure_mode=yes
system_uptime=no
notify_interval=60
min_lifetime=2
max_lifetime=86400
clean_ruleset_interval=600
lease_file={workdir / "leases"}
uuid={uuid.uuid4()}
upnp_table_name=miniupnpd
upnp_nat_table_name=miniupnpd
upnp_forward_chain=forward_miniupnpd
upnp_nat_chain=prerouting_miniupnpd
upnp_nat_postrouting_chain=postrouting_miniupnpd
allow 1024-65535 {LAN_NET} 1024-65535
deny 0-65535 0.0.0.0/0 0-65535
"""


def unavailable_reason() -> str | None:
    """Why the miniupnpd lab cannot run here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (network namespaces, nftables)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` not installed (make system-deps)"
    if not os.path.exists(MINIUPNPD):
        return f"{MINIUPNPD} not installed: apt-get install miniupnpd-nftables (make system-deps)"
    try:
        version = subprocess.run([MINIUPNPD, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{MINIUPNPD} does not run: {e}"
    if "nftables" not in version.stdout + version.stderr:
        return f"{MINIUPNPD} is not the nftables build (install miniupnpd-nftables): {version.stdout.strip()}"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=5)
    if probe.returncode != 0:
        return f"`ip netns` unusable: {probe.stderr.strip()}"
    return None


#: How long miniupnpd may take to listen on both its servers.
READY_TIMEOUT = 20.0


class LabError(Exception):
    """A lab command failed (the message has the command and its stderr)."""


async def _run(
    argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT, check: bool = True, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(timeout):
        result = await trio.run_process(list(argv), stdin=stdin, capture_stdout=True, capture_stderr=True, check=False)
    if check and result.returncode != 0:
        raise LabError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.decode(errors='replace').strip()}")
    return result


class LabClient:
    """``python -m tests.miniupnpd_lab client`` running in the client namespace, driven over its stdio."""

    def __init__(self, process: trio.Process):
        self.process = process
        self._buf = b""

    async def event(self, timeout: float = 20.0) -> dict[str, object]:
        """The next JSON line it printed."""
        assert self.process.stdout is not None
        with trio.fail_after(timeout):
            while b"\n" not in self._buf:
                chunk = await self.process.stdout.receive_some(65536)
                if not chunk:
                    raise LabError(f"client exited ({await self.process.wait()}) without a line; got {self._buf!r}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return dict(json.loads(line))

    async def send(self, command: str) -> None:
        assert self.process.stdin is not None
        with trio.fail_after(5):
            await self.process.stdin.send_all(command.encode() + b"\n")

    async def finish(self, timeout: float = 15.0, *, how: str = "exit") -> dict[str, object]:
        """Ask it to leave its ``map_port`` block ("exit", or "raise" an error in it); its last event."""
        await self.send(how)
        last = await self.event(timeout)
        with trio.fail_after(timeout):
            await self.process.wait()
        return last


@dataclass
class Lab:
    """The namespaces of one lab and the miniupnpd in its router."""

    workdir: Path
    id: str = field(default_factory=lambda: f"dlpm{os.getpid()}{secrets.token_hex(2)}")
    miniupnpd: trio.Process | None = None
    clients: list[LabClient] = field(default_factory=list)

    async def start_client(self, port: int, *, method: str = "", external: int = 0, lifetime: int = 3600) -> LabClient:
        options = ["--port", str(port), "--method", method, "--external", str(external), "--lifetime", str(lifetime)]
        argv = self.python_argv(self.client, "client", *options)
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, env=_child_env()
        )
        client = LabClient(process)
        self.clients.append(client)
        return client

    @property
    def router(self) -> str:
        return f"{self.id}-router"

    @property
    def client(self) -> str:
        return f"{self.id}-client"

    @property
    def outside(self) -> str:
        return f"{self.id}-outside"

    @property
    def namespaces(self) -> tuple[str, str, str]:
        return (self.router, self.client, self.outside)

    @property
    def log_path(self) -> Path:
        return self.workdir / "miniupnpd.log"

    def miniupnpd_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    async def run_in(
        self, ns: str, argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT, check: bool = False
    ) -> subprocess.CompletedProcess[bytes]:
        return await _run(["ip", "netns", "exec", ns, *argv], timeout=timeout, check=check)

    def python_argv(self, ns: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.miniupnpd_lab", *args]

    async def python_in(self, ns: str, *args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[bytes]:
        with trio.fail_after(timeout):
            return await trio.run_process(
                self.python_argv(ns, *args), capture_stdout=True, capture_stderr=True, check=False, cwd=REPO, env=_child_env()
            )

    async def connect_from_outside(self, port: int) -> str:
        """What a TCP client on the outside reads from WAN_IP:port ("error: ..." if it cannot)."""
        result = await self.python_in(self.outside, "connect", WAN_IP, str(port), timeout=15)
        return result.stdout.decode(errors="replace").strip() or result.stderr.decode(errors="replace").strip()

    async def router_rules(self) -> str:
        result = await self.run_in(self.router, ["nft", "list", "table", "inet", "miniupnpd"])
        return result.stdout.decode(errors="replace")

    async def _build(self, *, start_miniupnpd: bool) -> None:
        for ns in self.namespaces:
            await _run(["ip", "netns", "add", ns])
            await _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        await _run(["ip", "-n", self.router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", self.client])
        await _run(["ip", "-n", self.router, "link", "add", "wan", "type", "veth", "peer", "name", "eth0", "netns", self.outside])
        for ns, dev, address in (
            (self.router, "lan", f"{ROUTER_LAN_IP}/24"),
            (self.router, "wan", f"{WAN_IP}/24"),
            (self.client, "eth0", f"{CLIENT_IP}/24"),
            (self.outside, "eth0", f"{OUTSIDE_IP}/24"),
        ):
            await _run(["ip", "-n", ns, "addr", "add", address, "dev", dev])
            await _run(["ip", "-n", ns, "link", "set", dev, "up"])
        await _run(["ip", "-n", self.client, "route", "add", "default", "via", ROUTER_LAN_IP])
        await _run(["ip", "-n", self.router, "route", "add", "default", "via", OUTSIDE_IP])
        await self.run_in(self.router, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], check=True)
        await _run(["ip", "netns", "exec", self.router, "nft", "-f", "-"], stdin=ROUTER_RULESET.encode())
        if start_miniupnpd:
            await self._start_miniupnpd()

    async def stop_miniupnpd(self) -> None:
        """Stop the daemon as a router reboot would (SIGTERM; it removes its rules on the way out)."""
        if self.miniupnpd is not None and self.miniupnpd.poll() is None:
            self.miniupnpd.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                await self.miniupnpd.wait()

    async def start_miniupnpd(self) -> None:
        await self._start_miniupnpd()

    async def _start_miniupnpd(self) -> None:
        conf = self.workdir / "miniupnpd.conf"
        conf.write_text(miniupnpd_config(self.workdir))
        log = self.log_path.open("ab")
        offset = log.tell()
        argv = ["ip", "netns", "exec", self.router, MINIUPNPD, "-d", "-f", str(conf), "-P", str(self.workdir / "miniupnpd.pid")]
        try:
            self.miniupnpd = await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        finally:
            log.close()
        # Ready when both servers said they listen (debug logging goes to stderr with -d): polled, with a
        # deadline far above its usual 0.1 s (a loaded 2-core machine once took seconds).
        with trio.move_on_after(READY_TIMEOUT):
            while True:
                text = self.miniupnpd_log()[offset:]
                if "HTTP listening on port" in text and "Listening for NAT-PMP/PCP" in text:
                    return
                if self.miniupnpd.poll() is not None:
                    break
                await trio.sleep(0.02)
        state = f"exited {self.miniupnpd.poll()}" if self.miniupnpd.poll() is not None else f"running but not listening after {READY_TIMEOUT:g} s"
        raise LabError(f"miniupnpd did not start ({state}); its output:\n{self.miniupnpd_log()}")

    async def _teardown(self) -> None:
        """Stop miniupnpd, kill what runs in the lab's namespaces, delete them. Never raises."""
        for client in self.clients:
            if client.process.poll() is None:
                client.process.kill()
                with trio.move_on_after(2):
                    await client.process.wait()
        if self.miniupnpd is not None and self.miniupnpd.poll() is None:
            self.miniupnpd.send_signal(signal.SIGTERM)
            with trio.move_on_after(3):
                await self.miniupnpd.wait()
            if self.miniupnpd.poll() is None:
                self.miniupnpd.kill()
                with trio.move_on_after(2):
                    await self.miniupnpd.wait()
        for ns in self.namespaces:
            try:
                pids = (await _run(["ip", "netns", "pids", ns], timeout=5, check=False)).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)  # only processes inside our own namespaces
                    except (ValueError, ProcessLookupError):
                        pass
                await _run(["ip", "netns", "delete", ns], timeout=10, check=False)
            except (OSError, trio.TooSlowError):
                pass


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@asynccontextmanager
async def router_lab(workdir: Path, *, start_miniupnpd: bool = True) -> AsyncIterator[Lab]:
    """Build the lab; leaving it (also on error or cancellation) removes every trace within ~20 s."""
    lab = Lab(workdir)
    try:
        with trio.fail_after(30):
            await lab._build(start_miniupnpd=start_miniupnpd)
        yield lab
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(20):
            await lab._teardown()


# ---------------------------------------------------------------------- the side that runs inside the namespaces


async def _client(args: argparse.Namespace) -> None:
    """Listen on --port, map it, report as JSON lines; obey "status", "exit" and "raise" on stdin."""
    from nat.port_mapping import PortMapping, map_port

    def report(event: str, mapping: PortMapping | None = None, **extra: object) -> None:
        line: dict[str, object] = {"event": event, **extra}
        if mapping is not None:
            line.update(
                method=mapping.method,
                external_ip=mapping.external_ip,
                external_port=mapping.external_port,
                internal_ip=mapping.internal_ip,
                lifetime=mapping.lifetime,
                renewals=mapping.renewals,
                error=str(mapping.error) if mapping.error else None,
            )
        print(json.dumps(line), flush=True)

    async def serve(listener: trio.SocketListener) -> None:
        while True:
            stream = await listener.accept()
            async with stream:
                with trio.move_on_after(2):
                    await stream.send_all(f"hello from {args.port}\n".encode())

    listeners = await trio.open_tcp_listeners(args.port, host="0.0.0.0")
    methods = tuple(args.method.split(",")) if args.method else ("pcp", "natpmp", "upnp")
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(serve, listener)
        try:
            mapping_cm = map_port(args.port, methods=methods, lifetime=args.lifetime, external_port=args.external, timeout=10)
            async with mapping_cm as mapping:
                report("mapped", mapping)
                buf = b""
                while True:
                    with trio.fail_after(120):  # the test drives us; never outlive it by much
                        chunk = await stdin.receive_some(1024)
                    if not chunk:
                        break
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    if b"exit" in lines:
                        break
                    if b"raise" in lines:  # leave the block by an exception: must still delete
                        raise RuntimeError("asked to")
                    if b"status" in lines:
                        report("status", mapping)
        except Exception as e:
            report("failed", error=f"{type(e).__name__}: {e}")
        else:
            report("deleted")
        nursery.cancel_scope.cancel()


async def _probe(args: argparse.Namespace) -> None:
    from nat.port_mapping import probe

    support = await probe(timeout=args.timeout)
    print(
        json.dumps(
            {
                "methods": list(support.methods),
                "gateway": support.gateway,
                "local_ip": support.local_ip,
                "external_ip": support.external_ip,
                "natpmp_external_ip": support.natpmp_external_ip,
                "upnp_external_ip": support.upnp_external_ip,
                "upnp_control_url": support.upnp.service.control_url if support.upnp else None,
                "failures": support.failures,
            }
        ),
        flush=True,
    )


async def _connect(args: argparse.Namespace) -> None:
    try:
        with trio.fail_after(3):
            stream = await trio.open_tcp_stream(args.host, args.port)
            async with stream:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = await stream.receive_some(100)
                    if not chunk:
                        break
                    data += chunk
        print(data.decode(errors="replace").strip() or "error: closed without a greeting", flush=True)
    except (OSError, trio.TooSlowError, trio.BrokenResourceError) as e:
        print(f"error: {type(e).__name__}: {e}", flush=True)
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.miniupnpd_lab")
    commands = parser.add_subparsers(dest="command", required=True)
    client = commands.add_parser("client")
    client.add_argument("--port", type=int, required=True)
    client.add_argument("--method", default="")
    client.add_argument("--external", type=int, default=0)
    client.add_argument("--lifetime", type=int, default=3600)
    probe = commands.add_parser("probe")
    probe.add_argument("--timeout", type=float, default=3.0)
    connect = commands.add_parser("connect")
    connect.add_argument("host")
    connect.add_argument("port", type=int)
    args = parser.parse_args()
    trio.run({"client": _client, "probe": _probe, "connect": _connect}[args.command], args)


if __name__ == "__main__":
    main()
