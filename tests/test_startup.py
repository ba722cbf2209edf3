"""Commands that start at once: what each command imports, and what an idle relay holds.

The entry point (training/commands.py) builds every layer's parser from modules that import argparse
and little else, and imports a command's module only once it is chosen (p2p/commands.py); the
packages import their parts on first use (p2p/lazy.py). Times are a benchmark's to measure
(bench/startup.py); here the imports that make them are held: ``--help`` and ``id`` import neither
torch nor py-libp2p, no network command imports torch, transformers or scipy, and an idle relay
stays under 100 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "scipy", "tokenizers", "libp2p", "aioquic", "numpy")

PROBE = """
import json, sys
from training.commands import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def imported_by(*argv: str, tmp_path: Path) -> list[str]:
    """The heavy modules a fresh interpreter holds after ``dedloc ARGV`` ran (or printed its help)."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    modules: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return modules


def test_help_and_id_import_neither_torch_nor_py_libp2p(tmp_path: Path) -> None:
    assert imported_by("--help", tmp_path=tmp_path) == []
    for command in ("relay", "peer", "ping", "train", "average", "dht"):
        assert imported_by(command, "--help", tmp_path=tmp_path) == [], command
    assert imported_by("id", tmp_path=tmp_path) == []
    assert (tmp_path / "dedloc" / "identity.key").exists()  # it did create the identity
    assert imported_by("id", "--json", tmp_path=tmp_path) == []


def test_network_commands_never_import_the_training_stack() -> None:
    """Each command's module, as the dispatcher imports it: the network layers' pull in py-libp2p, never
    torch, transformers or scipy (a relay on a small VPS; a dataset's seeder too); `average` and the
    training commands do."""
    from training.commands import build_parser

    parser, sub = build_parser()
    modules = {}
    for name, command in sub.choices.items():
        func = command.get_default("func")
        if func is None:  # `dht`, `authority` and `dataset` have their actions below them
            argv = {"dht": [name, "get", "key", "--initial-peers", "/ip4/127.0.0.1/tcp/1"],
                    "dataset": [name, "list", "--initial-peers", "/ip4/127.0.0.1/tcp/1"]}.get(name, [name, "show"])
            func = parser.parse_args(argv).func
        modules[name] = func.partition(":")[0]
    assert set(modules) >= {"id", "dht", "authority", "relay", "peer", "status", "ping", "average", "train", "backbone", "serve-experts",
                            "demo", "dataset"}
    for name, module in modules.items():
        if name in ("average", "train", "backbone", "demo", "serve-experts"):
            continue
        probe = (f"import importlib, json, sys; importlib.import_module({module!r}); "
                 f"print(json.dumps(sorted(m for m in ('torch', 'transformers', 'scipy', 'tokenizers') "
                 f"if m in sys.modules)))")
        result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == [], f"dedloc {name} ({module}) imports {result.stdout}"


def test_compression_choices_are_the_codecs() -> None:
    from averaging.commands import COMPRESSIONS
    from averaging.compression import Compression

    assert COMPRESSIONS == tuple(c.value for c in Compression)


@pytest.mark.slow
def test_an_idle_relay_stays_under_100_mib(tmp_path: Path) -> None:
    relay = subprocess.Popen([sys.executable, "-m", "training.commands", "relay", "--listen", "/ip4/127.0.0.1/tcp/0",
                              "--ephemeral", "--json", "--status-interval", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        assert relay.stdout is not None
        line = relay.stdout.readline()
        assert '"listening"' in line, line
        time.sleep(2.0)  # idle: its services started, nobody connected
        status = Path(f"/proc/{relay.pid}/status").read_text()
        rss_kib = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1])
        assert rss_kib <= 100 * 1024, f"an idle relay holds {rss_kib / 1024:.0f} MiB"
    finally:
        relay.terminate()
        relay.wait(timeout=20)
