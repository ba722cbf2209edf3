"""Group all-reduce on shaped links in network namespaces, with a peer behind a symmetric NAT.

Three ``dedloc average`` processes, each on a 40/40 Mbit link (tc tbf on both
ends): two public peers and one behind a symmetric NAT (no hole punch works,
so it is reachable only through the relay). Every round must come out exact
(peer *i* averages the value *i*), the NATed peer must take part as a sender
(share 0, DeDLOC's a_i = 0 for a peer reachable only through a relay), and the
round times must show the links were really shaped. Marked ``slow``; needs
root (network namespaces).
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import trio

from tests.kit import collect_events
from nat.lab import Lab, NatKind, Shape
from tests.kit import requires_root_netns
from tests.forks import PACKAGES, python_m
from tests.test_nat_matrix import PUBLIC_NET, ROOT, start_relay

pytestmark = [pytest.mark.slow, requires_root_netns, pytest.mark.timeout(240), pytest.mark.usefixtures("forks")]
FORKS_PRELOAD = PACKAGES  # the fork server (p2p/forkserver.py) imports the commands' modules and torch once

MBIT = 40
SIZE = 1_000_000  # float32 values: 4 MB
ROUNDS = 2


async def test_three_peers_on_shaped_links_one_behind_a_symmetric_nat_average_exactly() -> None:
    events: dict[str, list[dict[str, Any]]] = {}
    async with Lab(prefix="dav", public_net=PUBLIC_NET) as lab:
        _, relay_addr = await start_relay(lab)
        kinds = {"p1": NatKind.PUBLIC, "p2": NatKind.PUBLIC, "p3": NatKind.SYMMETRIC}
        hosts = {name: await lab.peer(name, kind, delay_ms=0, shape=Shape(up_mbit=MBIT, down_mbit=MBIT))
                 for name, kind in kinds.items()}

        async def run(name: str) -> None:
            value = name.removeprefix("p")
            proc = await hosts[name].spawn(
                python_m("training.commands", "average", "--ephemeral", "--json", "--initial-peers", relay_addr,
                 "--listen", "/ip4/0.0.0.0/tcp/4001", "--no-port-mapping", "--status-interval", "0",
                 "--value", value, "--size", str(SIZE), "--group-size", "3", "--min-size", "3", "--gather-time", "2",
                 "--rounds", str(ROUNDS), "--interval", "0.5", "--match-timeout", "60", "--duration", "150"),
                stdout=subprocess.PIPE, cwd=str(ROOT))
            await collect_events(proc, ("averaged", "average_failed", "nat_mode"), events.setdefault(name, []))

        with trio.fail_after(200):
            async with trio.open_nursery() as nursery:
                for name in kinds:
                    nursery.start_soon(run, name)

    for name, got in events.items():
        rounds = [e for e in got if e["event"] == "averaged"]
        assert len(rounds) == ROUNDS, (name, got)
        for e in rounds:
            assert e["complete"] and len(e["members"]) == 3, (name, e)
            assert abs(e["mean"] - 2.0) < 1e-5, (name, e)  # mean of 1, 2, 3
    nated = [e for e in events["p3"] if e["event"] == "averaged"]
    assert all(e["role"] == "sender" and e["fraction"] == 0.0 for e in nated), nated
    modes = [e["mode"] for e in events["p3"] if e["event"] == "nat_mode"]
    assert modes and modes[-1] == "relayed", modes  # reachable through the relay only
    for name in ("p1", "p2"):
        assert all(e["role"] == "full" and e["fraction"] > 0.3 for e in events[name] if e["event"] == "averaged")
    # The sender uploads its whole 4 MB at 40 Mbit: at least 0.8 s if the link is really shaped.
    assert min(e["elapsed"] for e in nated) >= 0.7 * SIZE * 4 * 8 / (MBIT * 1e6), nated
