"""js-libp2p as the other peer in the NAT lab: behind each NAT kind, against dedloc, through a dedloc relay.

``js/natpeer.mjs`` runs js-libp2p 3.x with what a js app behind a home router
runs: circuit relay v2 (it reserves on our relay), DCUtR and AutoNAT v2 (our
relay's AutoNAT v2 server confirms its address, or does not). Our side is a
``tests/nat_agent.py`` peer (the NAT layer at its defaults) either public or
behind an endpoint-independent NAT. Each cell: dedloc dials js by the addresses
js advertises (a circuit address through the relay, and a TCP one once js's
AutoNAT confirmed it); js, the relayed connection's inbound side, leads DCUtR.

Expected, per cell (``expect_direct``):

* direct when js is public (its confirmed address is dialed directly) or when
  dedloc is public (js's DCUtR dials our public address: a connection reversal);
* relayed otherwise. js dials TCP from an ephemeral port, never from its listen
  port (node's ``net`` has no SO_REUSEPORT), so the simultaneous open that
  works between two dedloc peers behind endpoint-independent NATs cannot work
  with js behind one: its NAT maps the punching dial to another port than the
  one it told us. (Symmetric NATs and firewalls stay relayed with anyone.)

And one cell the other way round, the case that found the late-address bug: a
public js peer dials a dedloc peer behind a NAT right after it started, before
its AutoNAT confirmed its address. js announces its TCP address only once
confirmed, so our first upgrade (we are the inbound side) has nothing to dial;
when js's confirmation arrives, js pushes identify, the addresses we know
change and our upgrade runs again: it must end direct. The same again with js's
identify push off (rust-libp2p's default) and our peer behind a symmetric NAT:
it must end direct within 3 s of js's announcement. (Measured before and after
our upgrade learned to ask the peer again while it has nothing to dial: 0.73 and
0.6-0.7 s. In this lab js itself gets through soon after its address is
confirmed, so this cell guards the goal, not our re-identify; that is
``tests/test_holepunch.py``'s test of an upgrade with nothing to dial, against a
peer that never dials.) Since our upgrade asks the peer who it is beside its
first round and dials what it hears (js's identify lists the address it listens
on before its AutoNAT confirmed it), both cells go direct before js announces:
about 2.2 s after js's dial, in the first upgrade; that passes too.

Root (namespaces), node 22 and interop/node_modules with @libp2p/dcutr and
@libp2p/autonat-v2 (``bash interop/setup.sh``); slow: about 2 min.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from jspeer import NATPEER_SCRIPT, NODE_MODULES, JsPeer, js_unavailable_reason, open_js_peer
from nat.lab import ALL_KINDS, Lab, NatKind
from tests.kit import requires_root_netns
from tests.test_nat_matrix import PARALLEL_CELLS, PORT, PUBLIC_NET, Agent, start_agent, start_relay

pytestmark = [pytest.mark.interop, pytest.mark.slow, requires_root_netns, pytest.mark.timeout(600),
              pytest.mark.usefixtures("forks")]

PACKAGES = ("@libp2p/dcutr", "@libp2p/autonat-v2", "@libp2p/circuit-relay-v2")
LAB_PREFIX = "/ip4/11."  # PUBLIC_NET, 11.0.0.0/15: only inside the lab's namespaces
OURS = (NatKind.PUBLIC, NatKind.EIM_PRESERVING)
#: the late case: direct within this many seconds of js's announcement, pushed or not (our upgrade asks
#: the peer again while it has nothing to dial: nat/holepunch.py's reidentify_after)
LATE_GOAL_S = 3.0


def expect_direct(js: NatKind, ours: NatKind) -> bool:
    return NatKind.PUBLIC in (js, ours)


@dataclass
class JsCell:
    js: NatKind
    ours: NatKind
    js_dials: bool = False
    #: js pushes identify when its addresses change (off: rust-libp2p's default)
    push: bool = True
    connected: bool = False
    first_path: str = "-"
    direct: bool = False
    time_to_direct: float | None = None
    js_confirmed: bool = False
    #: the late case: seconds from js's dial to its address's announcement, and from there to direct
    late_by: float | None = None
    after_announce: float | None = None
    detail: str = ""
    #: js's own timeline (addresses, connections), kept for a cell that failed
    trace: str = ""

    @property
    def name(self) -> str:
        arrow = "js -> dedloc" if self.js_dials else "dedloc -> js"
        return f"js {self.js.name} / dedloc {self.ours.name} ({arrow}{'' if self.push else ', no identify push'})"


@pytest.fixture
def js_nat_available() -> None:
    reason = js_unavailable_reason()
    for package in PACKAGES:
        if reason is None and not (NODE_MODULES / package / "package.json").is_file():
            reason = f"js package {package} missing from {NODE_MODULES}: run `bash interop/setup.sh`"
    if reason is not None:
        if os.environ.get("DEDLOC_INTEROP_REQUIRED") == "1":
            pytest.fail(f"DEDLOC_INTEROP_REQUIRED=1 but {reason}")
        pytest.skip(reason)


def js_public_addrs(addrs: list[str]) -> list[str]:
    return [a for a in addrs if a.startswith(LAB_PREFIX) and "p2p-circuit" not in a]


async def latest_addrs(js: JsPeer, predicate: object, timeout: float) -> list[str]:
    """js's advertised addresses once ``predicate(addrs)`` holds (the last ones seen after ``timeout``)."""
    check = predicate if callable(predicate) else (lambda _: True)
    with trio.move_on_after(timeout):
        await js.wait_event(lambda e: e.get("event") == "addrs" and check(e["addrs"]), timeout=timeout)
    updates = [e["addrs"] for e in js.events if e.get("event") == "addrs"]
    return updates[-1] if updates else list(js.listening.get("addrs", []))


#: js-libp2p's own log of its relay reservations and of its AutoNAT v2 client (stderr: whether it asked
#: our relay to dial it back and what it heard), for a cell that failed
JS_DEBUG = "libp2p:circuit-relay:transport:*,libp2p:auto-nat-v2:*"


def js_timeline(events: list[dict[str, Any]], js: JsPeer | None) -> str:
    """What js saw, briefly: its address changes and its connections, with its clock (s),
    and the end of its reservation log."""
    out = []
    for e in events:
        t = f"{e.get('t_ms', 0) / 1000:.1f}s"
        if e.get("event") == "addrs" and e["addrs"]:
            out.append(f"{t} addrs {e['addrs']}")
        elif e.get("event") in ("connection:open", "connection:close"):
            out.append(f"{t} {e['event']} {e.get('id', '')} {str(e.get('peer_id'))[-6:]} {e.get('remote_addr')} "
                       f"{e.get('direction', '')}{' limited' if e.get('limited') else ''}")
        elif e.get("event") in ("error", "fatal"):
            out.append(f"{t} {e}")
    lines = js.stderr_tail.strip().splitlines() if js is not None else []
    log = [line for line in lines if not line.lstrip().startswith("at ")][-20:]  # no stack frames
    return "; ".join(out) + ("\n  js's relay and AutoNAT log:\n    " + "\n    ".join(log) if log else "")


async def run_cell(lab: Lab, relay_addr: str, index: int, cell: JsCell) -> None:
    js_host = await lab.peer(f"j{index}", cell.js, listen_port=PORT, delay_ms=50)
    our_host = await lab.peer(f"o{index}", cell.ours, listen_port=PORT, delay_ms=50)
    agent: Agent | None = None
    js_events: list[dict[str, Any]] = []
    js_peer: JsPeer | None = None
    try:
        agent = await start_agent(our_host, relay_addr)
        async with open_js_peer(spawn=js_host.spawn, script=NATPEER_SCRIPT, start_timeout=60, default_timeout=40,
                                env={"DEBUG": JS_DEBUG},
                                argv=["--listen", f"/ip4/0.0.0.0/tcp/{PORT}", "--relay", relay_addr,
                                      "--lab-prefix", LAB_PREFIX, *([] if cell.push else ["--no-identify-push"])]) as js:
            js_events, js_peer = js.events, js
            ours = await agent.ask("wait_mode", timeout=40)
            if cell.js_dials:
                started = trio.current_time()
                announced: list[float] = []  # when js's confirmed TCP address reached us, driver's clock

                async def watch() -> None:
                    await js.wait_event(lambda e: e.get("event") == "addrs" and bool(js_public_addrs(e["addrs"])),
                                        timeout=60)
                    announced.append(trio.current_time())

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    dialed = await js.request("dial", addrs=ours["addrs"], timeout=40)
                    cell.connected = True
                    cell.first_path = "relayed" if dialed["limited"] else "direct"
                    waited = await agent.ask("wait_direct", peer=js.peer_id, timeout=60)
                    cell.direct = waited["direct"]
                    done = trio.current_time()
                    nursery.cancel_scope.cancel()
                if cell.direct:
                    cell.time_to_direct = done - started
                cell.js_confirmed = bool(announced)
                if announced:
                    cell.late_by = announced[0] - started
                    cell.after_announce = done - announced[0]
            else:
                # js advertises its circuit once it reserved; its TCP address once AutoNAT confirmed it
                wanted = js_public_addrs if cell.js is NatKind.PUBLIC else (lambda a: any("p2p-circuit" in x for x in a))
                addrs = await latest_addrs(js, wanted, 30)
                cell.js_confirmed = bool(js_public_addrs(addrs))
                full = [a if f"/p2p/{js.peer_id}" in a else f"{a}/p2p/{js.peer_id}" for a in addrs]
                connect = await agent.ask("connect", addrs=full, timeout=30)
                cell.connected, cell.first_path = True, connect["kind"]
                if connect["kind"] == "direct":
                    cell.direct, cell.time_to_direct = True, connect["elapsed"]
                else:
                    waited = await agent.ask("wait_direct", peer=js.peer_id,
                                             timeout=25 if expect_direct(cell.js, cell.ours) else 10)
                    cell.direct = waited["direct"]
                    if cell.direct:
                        cell.time_to_direct = connect["elapsed"] + waited["elapsed"]
            if cell.direct != expect_direct(cell.js, cell.ours):
                cell.trace = js_timeline(js_events, js_peer)
            metrics = await agent.ask("metrics")
            cell.detail = (f"dedloc punch {metrics['punch_successes']}/{metrics['punch_attempts']}, "
                           f"retries {metrics['punch_retries']}")
    except Exception as e:  # the cell reports; the assertions judge
        while isinstance(e, ExceptionGroup) and len(e.exceptions) == 1:  # say what failed, not where
            e = e.exceptions[0]
        cell.detail += f" {type(e).__name__}: {e}"[:2000]  # every address's reason, the circuit's last
        cell.trace = js_timeline(js_events, js_peer)
    finally:
        if agent is not None:
            await agent.stop()


async def test_js_libp2p_behind_each_nat_kind(js_nat_available: None) -> None:
    cells = [JsCell(js, ours) for js in ALL_KINDS for ours in OURS]
    cells.append(JsCell(NatKind.PUBLIC, NatKind.EIM_PRESERVING, js_dials=True))
    cells.append(JsCell(NatKind.PUBLIC, NatKind.SYMMETRIC, js_dials=True, push=False))
    async with Lab(prefix="djn", public_net=PUBLIC_NET) as lab:
        _, relay_addr = await start_relay(lab)
        limiter = trio.CapacityLimiter(PARALLEL_CELLS)

        async def guarded(i: int, cell: JsCell) -> None:
            async with limiter:
                try:
                    await run_cell(lab, relay_addr, i, cell)
                except Exception as e:
                    cell.detail += f" setup failed: {type(e).__name__}: {e}"

        async with trio.open_nursery() as nursery:
            for i, cell in enumerate(cells):
                nursery.start_soon(guarded, i, cell)
    print("\njs-libp2p 3.x behind each NAT kind, dedloc public or behind an endpoint-independent NAT:")
    print("| js behind | dedloc | who dials | js's address confirmed | first path | result | expected |")
    print("|---|---|---|---|---|---|---|")
    for c in cells:
        result = f"direct after {c.time_to_direct:.2f} s" if c.direct and c.time_to_direct is not None else \
            "relayed" if c.connected else "FAIL"
        print(f"| {c.js.name} | {c.ours.name} | {'js' if c.js_dials else 'dedloc'} | {c.js_confirmed} | "
              f"{c.first_path} | {result} | {'direct' if expect_direct(c.js, c.ours) else 'relayed'} |  {c.detail}")
    problems = []
    for c in cells:
        if c.trace:
            print(f"js's timeline in {c.name}: {c.trace}")
        if not c.connected:
            problems.append(f"{c.name}: not connected ({c.detail})")
        elif c.direct != expect_direct(c.js, c.ours):
            problems.append(f"{c.name}: {'direct' if c.direct else 'relayed'}, expected otherwise ({c.detail})")
    for late in cells[-2:]:
        if late.late_by is not None and late.after_announce is not None:
            print(f"late address{'' if late.push else ', no identify push'}: js announced its address "
                  f"{late.late_by:.1f} s after it dialed through the relay; direct {late.after_announce:.2f} s later")
        elif late.direct and late.late_by is None and late.time_to_direct is not None:
            # our upgrade asks js who it is beside its first round and dials what it heard: direct
            # before js's AutoNAT confirmed the address (js listens on it already)
            print(f"late address{'' if late.push else ', no identify push'}: direct {late.time_to_direct:.2f} s "
                  "after js dialed through the relay, before js announced its address")
        if late.connected and (late.first_path != "relayed" or (late.late_by is None and not late.direct)
                               or (late.late_by is not None and late.late_by < 1.0)):
            problems.append(f"{late.name}: not the late case (first path {late.first_path}, js's address announced "
                            f"{late.late_by} s after its dial)")
        elif late.direct and late.after_announce is not None and late.after_announce > LATE_GOAL_S:
            problems.append(f"{late.name}: direct {late.after_announce:.2f} s after js announced its address, "
                            f"over the goal of {LATE_GOAL_S:g} s ({late.detail})")
    assert not problems, "\n".join(problems)
