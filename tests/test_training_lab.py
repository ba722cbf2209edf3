"""Collaborative training with peers behind real NATs in network namespaces.

Four ``dedloc train`` processes through one relay: a public peer, two behind
endpoint-independent NATs (they reach each other only by hole punching) and
one behind a symmetric NAT (no punch works: reachable only through the relay).
They must train the example model together: global steps averaged in groups
of all four (a peer behind a NAT needs a few seconds to find out and reserve
its relay slot while the first steps go on, and its first DHT reads can miss
the others' records for ~15 s: it may spend one matchmaking timeout on a step
the others left, then takes their state), the loss falling, the symmetric one as a sender through its
relay slot, a hole punch between the two cone-NATed ones. Marked ``slow``;
needs root (network namespaces).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from training.corpus import prepare
from tests.kit import collect_events
from nat.lab import Lab, NatKind
from tests.kit import requires_root_netns
from tests.forks import TRAINING, python_m
from tests.test_nat_matrix import PUBLIC_NET, ROOT, start_relay

pytestmark = [pytest.mark.slow, requires_root_netns, pytest.mark.timeout(300), pytest.mark.usefixtures("forks")]
FORKS_PRELOAD = TRAINING  # the fork server (p2p/forkserver.py) imports the commands and the example model once

STEPS = 12


async def test_four_peers_behind_different_nats_train_together(tmp_path: Path) -> None:
    prepare(tmp_path)  # the corpus and tokenizer every peer shares
    events: dict[str, list[dict[str, Any]]] = {}
    async with Lab(prefix="dtr", public_net=PUBLIC_NET) as lab:
        _, relay_addr = await start_relay(lab)
        kinds = {"p1": NatKind.PUBLIC, "p2": NatKind.EIM_PRESERVING, "p3": NatKind.EIM_CHANGING,
                 "p4": NatKind.SYMMETRIC}
        hosts = {name: await lab.peer(name, kind, delay_ms=0) for name, kind in kinds.items()}

        async def run(name: str) -> None:
            proc = await hosts[name].spawn(
                python_m("training.commands", "train", "--ephemeral", "--json", "--initial-peers", relay_addr,
                 "--listen", "/ip4/0.0.0.0/tcp/4001", "--no-port-mapping", "--status-interval", "0",
                 "--workdir", str(tmp_path), "--run-id", "lab", "--target-batch-size", "512", "--batch-size", "16",
                 "--max-steps", str(STEPS), "--group-size", "4", "--gather-time", "2", "--report-every", "1",
                 "--match-timeout", "10", "--data-seed", name[1:], "--duration", "240"),
                stdout=subprocess.PIPE, cwd=str(ROOT))
            await collect_events(proc, ("global_step", "nat_mode", "hole_punch", "error"), events.setdefault(name, []))

        with trio.fail_after(260):
            async with trio.open_nursery() as nursery:
                for name in kinds:
                    nursery.start_soon(run, name)

    for name, got in events.items():
        steps = [e for e in got if e["event"] == "global_step" and not e["missed"]]
        assert steps and steps[-1]["step"] == STEPS - 1, (name, got)
        assert [e["step"] for e in steps] == sorted({e["step"] for e in steps})  # monotone, none twice
        errors = [e for e in got if e["event"] == "error"]
        assert not errors, (name, errors)
        together = [e for e in steps if e["averaged"] and e["complete"] and e["group_size"] == 4]
        print(f"{name}: {len(steps)} steps, {len(together)} of them averaged by all four")
        assert len(together) >= 5, (
            name, [(e["step"], e["group_size"], e["averaged"], e["complete"], e["summary"]) for e in steps])
        assert steps[-1]["loss"] < steps[0]["loss"], (name, steps)  # the model learns
    modes = [e["mode"] for e in events["p4"] if e["event"] == "nat_mode"]
    assert modes and modes[-1] == "relayed", modes  # the symmetric NAT: through its relay slot only
    punches = [(name, str(e["peer_id"])[-6:], e["method"], e["success"], e["attempts"], round(e["elapsed"], 2))
               for name in kinds for e in events[name] if e["event"] == "hole_punch"]
    print("hole punches (who led, to whom, how, worked, rounds, s):", punches)
    punched = [e for name in ("p2", "p3") for e in events[name] if e["event"] == "hole_punch" and e["success"]]
    assert punched, punches
