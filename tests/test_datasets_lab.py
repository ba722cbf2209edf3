"""Datasets through real NATs (network namespaces, nftables routers): the README's example, run as it stands
but for the relay address, behind a port-changing NAT, fetches a dataset that `dedloc dataset create`
seeds from behind a port-preserving one. The bytes must come on a hole-punched direct connection, not
through the relay's limited circuits. Marked ``slow``; needs root."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from nat.lab import Lab, NatKind
from p2p.trio_util import read_lines
from tests.kit import readme_example, requires_root_netns
from tests.test_datasets_swarm import corpus
from tests.forks import COMMANDS, python_m
from tests.test_nat_matrix import PORT, PUBLIC_NET, ROOT, start_relay

pytestmark = [pytest.mark.slow, requires_root_netns, pytest.mark.timeout(240), pytest.mark.usefixtures("forks")]
FORKS_PRELOAD = COMMANDS  # the fork server (p2p/forkserver.py) imports the relay and the commands once


async def test_the_readme_example_fetches_from_a_seeder_behind_another_nat(tmp_path: Path) -> None:
    expected = corpus(tmp_path / "src", shards=2, size=300_000)
    async with Lab(prefix="ddata", public_net=PUBLIC_NET) as lab:
        _, relay_addr = await start_relay(lab)
        seeder_host = await lab.peer("seed", NatKind.EIM_PRESERVING, delay_ms=10)
        fetcher_host = await lab.peer("fetch", NatKind.EIM_CHANGING, delay_ms=10)
        seeder = await seeder_host.spawn(
            python_m("training.commands", "dataset", "create", "wiki-en", str(tmp_path / "src"),
             "--initial-peers", relay_addr, "--ephemeral", "--json", "--listen", f"/ip4/0.0.0.0/tcp/{PORT}",
             "--no-port-mapping", "--piece-size-kib", "64"), stdout=subprocess.PIPE, cwd=str(ROOT))
        try:
            assert seeder.stdout is not None
            with trio.fail_after(90):
                async for line in read_lines(seeder.stdout):
                    if line.startswith("{") and json.loads(line).get("event") == "dataset_published":
                        break
            script = tmp_path / "example.py"
            script.write_text(readme_example("datasets-example", relay_addr))
            work = tmp_path / "fetcher"
            work.mkdir()
            proc = await fetcher_host.spawn([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=str(work),
                                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
            assert proc.stdout is not None
            lines: list[str] = []
            with trio.fail_after(150):
                async for line in read_lines(proc.stdout):
                    lines.append(line.strip())
                await proc.wait()
            assert proc.returncode == 0, lines
            assert sorted(line for line in lines if line.startswith("checked")) == \
                ["checked part-0.txt", "checked part-1.txt"], lines
            assert lines[-1].endswith("via direct"), lines  # a hole punch, not the relay's circuit
            for name, data in expected.items():
                got = (work / "wiki-en" / name).read_bytes()
                assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        finally:
            seeder.terminate()
            with trio.move_on_after(10):
                await seeder.wait()
