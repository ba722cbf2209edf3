"""dedloc installs as a package: a wheel built from this tree, in a fresh venv with the locked dependencies,
runs `dedloc id`, a relay and a peer that reserves a slot on it, from outside the repository (nothing
imported from the working tree), and ships its protobuf code, schemas and type stubs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_the_wheel_installs_and_runs_a_relay_and_a_peer(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist)], check=True, timeout=300, cwd=tmp_path)
    (wheel,) = dist.glob("dedloc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("p2p/py.typed", "training/py.typed", "p2p/proto/keys_pb2.py", "p2p/proto/keys_pb2.pyi",
                    "p2p/proto/keys.proto", "averaging/proto/averaging_pb2.py", "nat/proto/circuit_pb2.py",
                    "p2p/rpc/rpc_pb2.py", "training/commands.py", "nat/web/index.html", "nat/web/app.js",
                    "nat/web/style.css"):
        assert shipped in names, shipped
    assert not any(n.startswith(("tests/", "bench/", "interop/")) for n in names)

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    # --no-compile: a throwaway venv needs no .pyc of every module installed (33 -> 24 s for the lock here);
    # what the commands import is compiled as they import it
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-compile"]
    subprocess.run([*pip, "--require-hashes", "-r", str(ROOT / "requirements.lock")], check=True, timeout=600,
                   cwd=tmp_path)
    subprocess.run([*pip, str(wheel)], check=True, timeout=300, cwd=tmp_path)
    subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "check"], check=True, timeout=120, cwd=tmp_path)

    dedloc = str(env_dir / "bin" / "dedloc")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    where = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import p2p; print(p2p.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    assert where.startswith(str(env_dir)), where  # the installed package, not the working tree
    shown = subprocess.run([dedloc, "id", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           check=True, timeout=60)
    assert json.loads(shown.stdout)["peer_id"].startswith("12D3KooW")

    relay = subprocess.Popen([dedloc, "relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--ephemeral", "--json",
                              "--status-interval", "0", "--metrics", "127.0.0.1:0"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert relay.stdout is not None
        address = json.loads(relay.stdout.readline())["addrs"][0]
        for _ in range(50):
            event = json.loads(relay.stdout.readline())
            if event["event"] == "dashboard":
                break
        assert event["event"] == "dashboard", event
        # the page's files and the metrics, served from the installed package
        for path, expected in (("", b"<title>dedloc swarm</title>"), ("app.js", b"/api/status"),
                               ("style.css", b"body"), ("metrics", b"libp2p_relaysvc_status 1.0")):
            with urllib.request.urlopen(event["page"] + path, timeout=10) as response:
                assert expected in response.read(), path
        peer = subprocess.run([dedloc, "peer", "--initial-peers", address, "--ephemeral", "--json", "--duration", "4",
                               "--listen", "/ip4/127.0.0.1/tcp/0", "--allow-private"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        events = [json.loads(line)["event"] for line in peer.stdout.splitlines() if line.startswith("{")]
        assert peer.returncode == 0, peer.stderr[-2000:]
        assert "peer_connected" in events and "dht_joined" in events and "relay_reserved" in events, events
    finally:
        relay.terminate()
        relay.wait(timeout=20)
