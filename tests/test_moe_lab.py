"""The README's mixture-of-experts example, run as it stands (but for the relay address), behind a NAT.

A public relay, `dedloc serve-experts` on a public host, and the example on a host behind an
endpoint-independent NAT with 10 ms links: it finds the experts through the DHT, calls them
forward and backward, and its loss falls. Marked ``slow``; needs root (network namespaces).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from nat.lab import Lab, NatKind
from tests.kit import readme_example, requires_root_netns
from tests.forks import PACKAGES, python_m
from tests.test_nat_matrix import PUBLIC_NET, ROOT, start_relay

pytestmark = [pytest.mark.slow, requires_root_netns, pytest.mark.timeout(240), pytest.mark.usefixtures("forks")]
FORKS_PRELOAD = PACKAGES  # the fork server (p2p/forkserver.py) imports the commands' modules and torch once


def readme_serve_command() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    line = readme.split("<!-- moe-example -->", 1)[0].rsplit("```bash\n", 1)[1].split("\n", 1)[0]
    words = line.split("#", 1)[0].split()
    assert words[:2] == ["dedloc", "serve-experts"], line
    return [w.strip('"') for w in words[2:]]


async def test_readme_moe_example_behind_a_nat(tmp_path: Path) -> None:
    async with Lab(prefix="dmoel", public_net=PUBLIC_NET) as lab:
        _, relay_addr = await start_relay(lab)
        server_host = await lab.public_host("srv", delay_ms=10)
        trainer_host = await lab.peer("trn", NatKind.EIM_PRESERVING, delay_ms=10)
        args = [a.replace("$RELAY", relay_addr) for a in readme_serve_command()]
        await server_host.spawn(python_m("training.commands", "serve-experts", *args, "--device", "cpu",
                                 "--ephemeral", "--no-port-mapping", "--listen", "/ip4/0.0.0.0/tcp/4001"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(ROOT))
        script = tmp_path / "example.py"
        script.write_text(readme_example("moe-example", relay_addr))
        losses: list[float] = []
        with trio.fail_after(180):
            for _attempt in range(10):  # the server may not have declared its experts yet: the example fails fast
                rc, out, err = await trainer_host.run([sys.executable, str(script)], timeout=150)
                losses = [float(m) for m in re.findall(r"^loss ([0-9.]+) ", out, flags=re.M)]
                if rc == 0:
                    break
                assert "MoEError" in err, err[-3000:]
                await trio.sleep(2)
        assert rc == 0, err[-3000:]
        assert len(losses) == 30 and losses[-1] < 0.5 * losses[0], losses
        assert "failed=[]" in out.splitlines()[-1]
