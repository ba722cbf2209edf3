"""The NAT traversal matrix: every pair of NAT kinds, real dedloc processes in network namespaces.

A public relay runs ``dedloc relay`` (the product's command); two peers run
the NAT layer at its defaults (``tests/nat_agent.py``, what ``dedloc peer``
runs) behind routers of each kind from ``nat/lab.py``. For each pair, B
dials A by the addresses A advertises, and the test asserts:

* they connect at all, always (directly, or through the relay);
* the connection becomes direct where the NATs allow it: at least one side
  public, or both endpoint-independent (TCP simultaneous open); relay-only
  when an endpoint-dependent (symmetric) NAT meets any non-public peer;
* 4 MiB then really flow, checked by sha256, on the path expected.

It prints the matrix with time to direct per cell. Slow (minutes): marked
``slow`` and run in CI as root.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from nat.lab import ALL_KINDS, Host, Ipv6, Lab, NatKind
from p2p.trio_util import read_lines
from tests.forks import python_m
from tests.kit import requires_root_netns

pytestmark = [pytest.mark.slow, requires_root_netns, pytest.mark.timeout(900), pytest.mark.usefixtures("forks")]

ROOT = Path(__file__).resolve().parent.parent
#: Looks globally routed, so the code under test treats it as public; it never leaves the namespaces.
PUBLIC_NET = "11.0.0.0/15"
PORT = 4001
CELL_TIMEOUT = 120
#: cells at once. 7 took the delay matrix from 95 s to 71 s alone (the same CPU), but beside the niced
#: shared tests (tests/ci_rules.py) its bursts took both cores and two of theirs missed their deadlines
#: (a fresh clone at b799b63): 4 until the shared tests stand that
PARALLEL_CELLS = 4


#: What a peer should conclude about its NAT from two observers of its listen port.
EXPECTED_MAPPING = {
    NatKind.PUBLIC: "none",
    NatKind.FIREWALL: "none",
    NatKind.EIM_PRESERVING: "endpoint-independent, port preserved",
    NatKind.DOUBLE: "endpoint-independent, port preserved",
    NatKind.UDP_BLOCKED: "endpoint-independent, port preserved",
    NatKind.EIM_CHANGING: "endpoint-independent, port changed",
    NatKind.SYMMETRIC: "endpoint-dependent",
}


def expect_direct(a: NatKind, b: NatKind) -> bool:
    if NatKind.PUBLIC in (a, b):
        return True
    return NatKind.SYMMETRIC not in (a, b)


class Agent:
    """One tests/nat_agent.py process: JSON commands in, JSON answers out."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self._buffer = b""
        self.peer_id = ""

    async def line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with trio.fail_after(timeout):
            while b"\n" not in self._buffer:
                chunk = await self.proc.stdout.receive_some(65536)
                if not chunk:
                    raise RuntimeError("agent exited")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return dict(json.loads(line))

    async def stop(self) -> None:
        """Ask it to quit (2 s at most), then kill it."""
        with trio.move_on_after(2):
            try:
                await self.ask("quit", timeout=1)
            except Exception:
                pass
        self.proc.kill()

    async def ask(self, cmd: str, timeout: float = 60, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(json.dumps({"cmd": cmd, "timeout": timeout, **fields}).encode() + b"\n")
        reply = await self.line(timeout + 10)
        if "error" in reply:
            raise RuntimeError(f"{cmd}: {reply['error']}")
        return reply


async def start_agent(host: Host, relay_addr: str | list[str], *, listen: list[str] | None = None) -> Agent:
    # DEDLOC_AGENT_LOGS=dir keeps each agent's debug log there.
    logs = os.environ.get("DEDLOC_AGENT_LOGS")
    proc = await host.spawn(
        python_m("tests.nat_agent")
        + [arg for addr in (listen or [f"/ip4/0.0.0.0/tcp/{PORT}"]) for arg in ("--listen", addr)]
        + [arg for addr in ([relay_addr] if isinstance(relay_addr, str) else relay_addr) for arg in ("--relay", addr)]
        + (["--verbose"] if logs else []),
        stderr=open(os.path.join(logs, f"{host.ns}.log"), "wb") if logs else None,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=str(ROOT),
    )
    agent = Agent(proc)
    ready = await agent.line(60)
    agent.peer_id = ready["peer_id"]
    return agent


async def start_relay(lab: Lab, name: str = "relay", *, loss_pct: float | None = None,
                      listen: list[str] | None = None, ipv6: Ipv6 | None = None) -> tuple[Host, str]:
    relay = await lab.public_host(name, delay_ms=25, loss_pct=loss_pct, ipv6=ipv6)
    proc = await relay.spawn(
        python_m("nat.cli", "relay", "--ephemeral", "--json")
        + [arg for addr in (listen or [f"/ip4/0.0.0.0/tcp/{PORT}"]) for arg in ("--listen", addr)]
        + ["--status-interval", "0", "--no-port-mapping"],
        stdout=subprocess.PIPE,
        cwd=str(ROOT),
    )
    assert proc.stdout is not None
    buffer = b""
    with trio.fail_after(60):
        while True:
            while b"\n" not in buffer:
                chunk = await proc.stdout.receive_some(65536)
                assert chunk, "relay exited"
                buffer += chunk
            line, buffer = buffer.split(b"\n", 1)
            event = json.loads(line)
            if event.get("event") == "listening":
                return relay, f"/ip4/{relay.ip}/tcp/{PORT}/p2p/{event['peer_id']}"


@dataclass
class Cell:
    a: NatKind
    b: NatKind
    connected: bool = False
    first_path: str = "-"
    direct: bool = False
    time_to_direct: float | None = None
    sent_ok: bool = False
    path: str = "-"
    detail: str = ""
    funnel: dict[str, float] = field(default_factory=dict)
    #: How each peer classified its NAT's mapping (needs two observers: two relays).
    mapping_a: str = "-"
    mapping_b: str = "-"


async def run_cell(lab: Lab, relay_addr: str | list[str], index: int, cell: Cell, *,
                   loss_pct: float | None = None) -> None:
    host_a = await lab.peer(f"a{index}", cell.a, listen_port=PORT, delay_ms=50, loss_pct=loss_pct)
    host_b = await lab.peer(f"b{index}", cell.b, listen_port=PORT, delay_ms=50, loss_pct=loss_pct)
    agents: list[Agent] = []
    try:
        a = await start_agent(host_a, relay_addr)
        agents.append(a)
        b = await start_agent(host_b, relay_addr)
        agents.append(b)
        with trio.fail_after(CELL_TIMEOUT):
            state_a = await a.ask("wait_mode", timeout=40)
            await b.ask("wait_mode", timeout=40)
            if not state_a["addrs"]:
                cell.detail = f"A advertises nothing (mode {state_a['mode']})"
                return
            connect = await b.ask("connect", addrs=state_a["addrs"], timeout=30)
            cell.connected = True
            cell.first_path = connect["kind"]
            if connect["kind"] == "direct":
                cell.direct, cell.time_to_direct = True, connect["elapsed"]
            else:
                waited = await b.ask("wait_direct", peer=a.peer_id, timeout=25 if expect_direct(cell.a, cell.b) else 8)
                cell.direct = waited["direct"]
                if cell.direct:
                    cell.time_to_direct = connect["elapsed"] + waited["elapsed"]
                    # the relayed connection is retired after a grace period (2 s): polled, not slept
                    await b.ask("wait_relay_retired", peer=a.peer_id, timeout=10)
            sent = await b.ask("send", peer=a.peer_id, mib=4, timeout=60)
            cell.sent_ok, cell.path = sent["ok"], sent["path"]
            metrics = await a.ask("metrics")
            other = await b.ask("metrics")
            if not isinstance(relay_addr, str) and len(relay_addr) > 1:  # two observers: classifiable
                cell.mapping_a = (await a.ask("wait_mapping", timeout=20))["mapping"]
                cell.mapping_b = (await b.ask("wait_mapping", timeout=20))["mapping"]
            cell.detail = f"A: {metrics['mode']}, punch {metrics['punch_successes']}/{metrics['punch_attempts']}"
            for key in FUNNEL:
                cell.funnel[key] = sum(float(m[key]) for m in (metrics, other))
    except Exception as e:  # the cell reports; the assertions below judge
        cell.detail += f" {type(e).__name__}: {e}"
    finally:
        for agent in agents:
            await agent.stop()


FUNNEL = ("reservations_made", "dial_backs", "punch_attempts", "punch_successes", "punch_first_try", "reversals",
          "punch_failures", "bytes_direct", "bytes_relayed")


def funnel_summary(cells: list[Cell]) -> str:
    """The NAT funnel summed over every cell (both peers of each pair)."""
    totals = {key: sum(c.funnel.get(key, 0) for c in cells) for key in FUNNEL}
    ttd = sorted(c.time_to_direct for c in cells if c.time_to_direct is not None and c.first_path == "relayed")
    lines = ["funnel over all cells: " + ", ".join(f"{k}={int(v)}" for k, v in totals.items())]
    if ttd:
        lines.append(f"time to direct after a relayed start: median {ttd[len(ttd) // 2]:.2f} s, max {ttd[-1]:.2f} s over {len(ttd)} pairs")
    return "\n".join(lines)


def path_problems(cells: list[Cell]) -> list[str]:
    """What went against expectations: no connection, lost data, or the wrong path."""
    problems = []
    for c in cells:
        want_direct = expect_direct(c.a, c.b)
        if not c.connected or not c.sent_ok:
            problems.append(f"{c.a.name}<-{c.b.name}: not connected or data lost ({c.detail})")
        elif want_direct and not (c.direct and c.path == "direct"):
            problems.append(f"{c.a.name}<-{c.b.name}: expected a direct path, got {c.path} ({c.detail})")
        elif not want_direct and c.direct:
            problems.append(f"{c.a.name}<-{c.b.name}: direct through a symmetric NAT is unexpected ({c.detail})")
    return problems


def render(cells: list[Cell]) -> str:
    kinds = [k for k in ALL_KINDS]
    by_pair = {(c.a, c.b): c for c in cells}
    width = 16
    lines = ["NAT matrix (row = dialed peer A, column = dialer B): time to direct, or 'relay' / 'FAIL'"]
    lines.append(" " * width + "".join(k.name[:14].ljust(width) for k in kinds))
    for ka in kinds:
        row = ka.name[:14].ljust(width)
        for kb in kinds:
            c = by_pair.get((ka, kb)) or by_pair.get((kb, ka))
            if c is None:
                text = ""
            elif not (c.connected and c.sent_ok):
                text = "FAIL"
            elif c.direct and c.time_to_direct is not None:
                text = f"direct {c.time_to_direct:.1f}s"
            else:
                text = "relay"
            row += text.ljust(width)
        lines.append(row)
    return "\n".join(lines)


#: With loss, and through the js-libp2p relay (interop/test_js_relay.py), CI runs these cells, not all
#: 28: every NAT kind is in one, and each path twice or more (a public peer dialed directly, a hole
#: punched with ports kept or changed, relay only through a symmetric NAT); the matrix at the lab's
#: delays through our relay runs all 28. All 28 with loss took 140 s of CI's serial lane, through
#: the js relay 107 s; ``DEDLOC_FULL_MATRIX=1`` runs them (docs/WAN.md's times with loss are over
#: the full matrix).
SAMPLE_PAIRS = [
    (NatKind.PUBLIC, NatKind.SYMMETRIC),
    (NatKind.EIM_PRESERVING, NatKind.FIREWALL),
    (NatKind.EIM_PRESERVING, NatKind.EIM_CHANGING),
    (NatKind.EIM_CHANGING, NatKind.EIM_CHANGING),
    (NatKind.DOUBLE, NatKind.UDP_BLOCKED),
    (NatKind.EIM_PRESERVING, NatKind.SYMMETRIC),
    (NatKind.SYMMETRIC, NatKind.SYMMETRIC),
]


def matrix_pairs() -> list[tuple[NatKind, NatKind]]:
    """:data:`SAMPLE_PAIRS`, or all 28 pairs with ``DEDLOC_FULL_MATRIX=1``."""
    assert {k for pair in SAMPLE_PAIRS for k in pair} == set(ALL_KINDS)
    if os.environ.get("DEDLOC_FULL_MATRIX") == "1":
        return list(itertools.combinations_with_replacement(ALL_KINDS, 2))
    return list(SAMPLE_PAIRS)


@pytest.mark.parametrize("loss_pct", [None, 1.0], ids=["delay", "delay-and-1pct-loss"])
async def test_nat_traversal_matrix(loss_pct: float | None) -> None:
    """Every pair of NAT kinds at the lab's delays (peers 50 ms, relays 25 ms one-way: 200 ms
    between two peers), and once more with 1% loss per direction on every access link
    (:data:`SAMPLE_PAIRS` of them unless ``DEDLOC_FULL_MATRIX=1``)."""
    pairs = list(itertools.combinations_with_replacement(ALL_KINDS, 2)) if loss_pct is None else matrix_pairs()
    cells = [Cell(a, b) for a, b in pairs]
    async with Lab(prefix="dmx", public_net=PUBLIC_NET) as lab:
        # Two relays: each peer is then observed from its listen port by two servers,
        # enough to classify its NAT's mapping.
        _, relay_addr = await start_relay(lab, loss_pct=loss_pct)
        _, relay2_addr = await start_relay(lab, "relay2", loss_pct=loss_pct)
        limiter = trio.CapacityLimiter(PARALLEL_CELLS)

        async def guarded(i: int, cell: Cell) -> None:
            async with limiter:
                try:
                    await run_cell(lab, [relay_addr, relay2_addr], i, cell, loss_pct=loss_pct)
                except Exception as e:  # a cell that could not even start (a slow CI runner) reports too
                    cell.detail += f" setup failed: {type(e).__name__}: {e}"

        async with trio.open_nursery() as nursery:
            for i, cell in enumerate(cells):
                nursery.start_soon(guarded, i, cell)
    print("\n" + render(cells))
    print(funnel_summary(cells))
    for c in cells:
        print(f"{c.a.name:>15} <- {c.b.name:<15} mapping={c.mapping_a}/{c.mapping_b} connected={c.connected} first={c.first_path} direct={c.direct} "
              f"ttd={c.time_to_direct} sent={c.sent_ok} path={c.path} {c.detail}")
    problems = path_problems(cells)
    for c in cells:
        for kind, seen in ((c.a, c.mapping_a), (c.b, c.mapping_b)):
            if seen == "-":
                problems.append(f"{kind.name}: no mapping classification asked")
            elif seen not in (EXPECTED_MAPPING[kind], "unknown"):
                problems.append(f"{kind.name} classified its mapping as {seen!r}, expected {EXPECTED_MAPPING[kind]!r}")
    # A classification is never wrong; "unknown" (an observer's identify still pending
    # when the cell ends) is allowed, but must stay rare.
    verdicts = [(k, m) for c in cells for k, m in ((c.a, c.mapping_a), (c.b, c.mapping_b))]
    right = sum(1 for k, m in verdicts if m == EXPECTED_MAPPING[k])
    print(f"NAT mapping classified correctly by {right} of {len(verdicts)} peers, the rest unknown")
    if right < 0.8 * len(verdicts):
        problems.append(f"NAT mapping classified by only {right} of {len(verdicts)} peers")
    assert not problems, "\n".join(problems)


@pytest.mark.realtime  # time to direct under 10 s
async def test_ping_from_behind_a_nat_goes_direct_and_says_so() -> None:
    """What a volunteer runs to check their setup: ``dedloc peer`` behind one home NAT, and
    ``dedloc ping <relay>/p2p-circuit/p2p/<peer>`` from behind another (both endpoint-independent),
    at the lab's delays. The ping starts relayed, the hole punch (led by the peer the relayed
    connection reached) turns it direct, and the output says so: a relayed connection, then a
    direct one, later pings ``direct``, and the time to direct in the summary."""
    async with Lab(prefix="dpg", public_net=PUBLIC_NET) as lab:
        _, relay_addr = await start_relay(lab)
        host_a = await lab.peer("a", NatKind.EIM_PRESERVING, listen_port=PORT, delay_ms=50)
        host_b = await lab.peer("b", NatKind.EIM_CHANGING, listen_port=PORT, delay_ms=50)
        peer = await host_a.spawn(
            python_m("nat.cli", "peer", "--ephemeral", "--json", "--listen", f"/ip4/0.0.0.0/tcp/{PORT}",
                     "--initial-peers", relay_addr, "--status-interval", "0", "--no-port-mapping"),
            stdout=subprocess.PIPE, cwd=str(ROOT))
        assert peer.stdout is not None
        circuit = peer_id = ""
        with trio.fail_after(60):
            async for line in read_lines(peer.stdout):
                event = json.loads(line)
                peer_id = event["peer_id"] if event["event"] == "listening" else peer_id
                if event["event"] == "relay_reserved":
                    circuit = f"{event['addrs'][0]}/p2p/{peer_id}"
                    break
        assert circuit, "the peer exited before it held a relay slot"
        result = await host_b.run(
            python_m("nat.cli", "ping", "--json", "-c", "8", "-i", "0.5", circuit), timeout=90)
        peer.kill()
    assert result.rc == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    opened = [e["kind"] for e in events if e["event"] == "connection_opened" and e["peer_id"] == peer_id]
    assert opened[:1] == ["relayed"] and "direct" in opened, events
    pings = [e["kind"] for e in events if e["event"] == "ping"]
    assert pings[0] == "relayed" and pings[-1] == "direct", pings
    (summary,) = [e for e in events if e["event"] == "ping_summary"]
    assert summary["time_to_direct"] is not None and 0 < summary["time_to_direct"] < 10
    print(f"\nping from behind an EIM NAT: direct after {summary['time_to_direct']:.2f} s, pings {pings}")
