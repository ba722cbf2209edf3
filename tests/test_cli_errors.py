"""Errors a person can read: every command, given a bad input it can foresee, exits non-zero with one
line that names what failed and what to do, and no traceback.

A table: (command line, what its last line must say). ``{open}`` is an open relay's address, ``{closed}``
a closed swarm's relay (it admits only passholders), ``{busy}`` a port another socket holds,
``{nobody}`` an address where nothing listens, ``{tmp}`` the test's scratch folder.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2p.forkserver import Forks
from tests.forks import suite_forks

ROOT = Path(__file__).resolve().parent.parent
#: a valid peer id with nothing behind it
NOBODY_ID = "12D3KooWAcEpZFodCrgPpMU2qAk5qtpQ56tAuMnkTH17K4P48xtF"

pytestmark = pytest.mark.timeout(300)


#: What the commands import before they fail or start: paid once, in the fork server.
PRELOAD = ("torch", "training.commands", "training.cli", "training.moe.cli", "averaging.cli", "nat.cli", "p2p.node")


class Dedloc:
    """``dedloc`` command lines, each a process forked from one that imported the commands once
    (p2p/forkserver.py: a process of its own paid ~3.5 s of imports per line, 104 s for the table)."""

    def __init__(self, forks: Forks) -> None:
        self.forks = forks

    def __call__(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(self.forks.argv("training.commands", *argv), cwd=ROOT, capture_output=True, text=True,
                                stdin=subprocess.DEVNULL, timeout=timeout)
        return subprocess.CompletedProcess(["dedloc", *argv], result.returncode, result.stdout, result.stderr)


@pytest.fixture(scope="module")
def dedloc() -> Iterator[Dedloc]:
    with suite_forks(*PRELOAD) as forks:
        yield Dedloc(forks)


def _relay(*extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "training.commands", "relay", "--listen", "/ip4/127.0.0.1/tcp/0",
                             "--ephemeral", "--json", "--status-interval", "0", "--allow-private", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, json.loads(line)["addrs"][0]


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory, dedloc: Dedloc) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("cli-errors")
    added = dedloc("authority", "add", "alice", "--dir", str(tmp / "authority"))
    assert added.returncode == 0, added.stderr
    (tmp / "loose.key").write_text("not a key")
    (tmp / "loose.key").chmod(0o644)
    (tmp / "garbled.key").write_bytes(b"not a key at all")
    (tmp / "garbled.key").chmod(0o600)
    (tmp / "bad.toml").write_text("listen = [\n")
    (tmp / "empty").mkdir()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    open_relay, open_addr = _relay()
    closed_relay, closed_addr = _relay("--authority-dir", str(tmp / "authority"))
    try:
        yield {"open": open_addr, "closed": closed_addr, "busy": str(busy.getsockname()[1]),
               "nobody": f"/ip4/127.0.0.1/tcp/1/p2p/{NOBODY_ID}", "tmp": str(tmp)}
    finally:
        for proc in (open_relay, closed_relay):
            proc.terminate()
            proc.wait(timeout=20)
        busy.close()


#: (command line, a piece of its error line); every command of `dedloc --help` has at least one row
TABLE: list[tuple[str, str]] = [
    # bad addresses
    ("ping /ip4/999.0.0.1/tcp/1", "is malformed: base address '999.0.0.1' is not IPv4"),
    ("ping not-an-address", "must start with '/'"),
    ("peer --initial-peers garbage --ephemeral", "initial peer 'garbage' is not a multiaddr"),
    ("relay --listen /ip4/127.0.0.1/udp/1 --ephemeral", "listen"),
    # unreachable
    ("ping {nobody} --timeout 5", "could not connect to"),
    ("peer --initial-peers {nobody} --ephemeral --bootstrap-timeout 3", "none of the 1 initial peers could be reached"),
    ("dht get somekey --initial-peers {nobody} --timeout 3", "none of the 1 initial peers could be reached"),
    # --duration bounds the join too: the error at 3 s, not after the default 30 s of trying
    ("average --initial-peers {nobody} --ephemeral --duration 3", "none of the 1 initial peers could be reached within 3s"),
    ("status /ip4/127.0.0.1/tcp/1", "has no /p2p/<peer-id> part"),
    ("status {nobody}", "could not connect to"),
    # refused by a closed swarm, at once
    ("ping {closed}", "the swarm is closed: it admits only holders of an access pass"),
    ("peer --initial-peers {closed} --ephemeral --duration 30", "is closed; it admits only holders of an access pass"),
    ("average --initial-peers {closed} --ephemeral --duration 30", "is closed; it admits only holders"),
    # a port in use
    ("relay --listen /ip4/127.0.0.1/tcp/{busy} --ephemeral", "Address already in use (choose another port"),
    ("peer --initial-peers {open} --listen /ip4/127.0.0.1/tcp/{busy} --ephemeral", "Address already in use"),
    # bad files
    ("id --identity {tmp}/loose.key", "has mode 0644; other users could read your private key"),
    ("id --identity {tmp}/garbled.key", "{tmp}/garbled.key"),
    ("peer --config {tmp}/bad.toml --initial-peers {open}", "not valid TOML"),
    ("peer --config {tmp}/missing.toml --initial-peers {open}", "--config {tmp}/missing.toml: No such file"),
    ("authority revoke nobody --dir {tmp}/authority", "nobody"),
    ("dataset create corpus {tmp}/missing --initial-peers {nobody} --ephemeral", "{tmp}/missing: no such directory"),
    ("dataset create corpus {tmp}/empty --initial-peers {nobody} --ephemeral", "no shard files"),
    ("dataset add corpus {tmp}/missing.txt --initial-peers {nobody} --ephemeral", "{tmp}/missing.txt: no such file"),
    ("dataset seed {tmp}/empty --initial-peers {nobody} --ephemeral", "{tmp}/empty: no dataset here (no .dedloc/manifest)"),
    # a bad name before the peer starts: {nobody} would be a bootstrap error after 30 s
    ("dataset create ../x {tmp}/empty --initial-peers {nobody} --ephemeral", "dataset name '../x': use 1-64 letters"),
    ("dataset create ok@x {tmp}/empty --initial-peers {nobody} --ephemeral", "dataset name 'ok@x'"),  # no @ in a new name
    ("dataset get .x@12D3 {tmp}/got --initial-peers {nobody} --ephemeral", "dataset name '.x': use 1-64"),
    ("dataset get nothing-here {tmp}/got --initial-peers {open} --ephemeral --bootstrap-timeout 3", "nothing-here"),
    ("train --data {tmp}/missing --initial-peers {open} --ephemeral --max-steps 1", "{tmp}/missing"),
    # bad settings
    ("average --initial-peers {open} --ephemeral --size -5", "--size must be positive"),
    ("average --initial-peers {open} --ephemeral --weight nan", "--weight: weight must be finite and >= 0, not nan"),
    ("average --initial-peers {open} --ephemeral --weight -1", "--weight: weight must be finite and >= 0, not -1.0"),
    ("average --initial-peers {open} --ephemeral --value inf", "--value must be a finite number"),
    ("average --initial-peers {open} --ephemeral --rounds -1", "--rounds must be 0 (until --duration) or more"),
    ("average --initial-peers {open} --ephemeral --min-size 5 --group-size 3",
     "need 1 <= --min-size <= --group-size, got --min-size 5 and --group-size 3"),
    ("train --initial-peers {open} --ephemeral --group-size 1", "--group-size must be at least 2 (this peer and one"),
    ("train --initial-peers {open} --ephemeral --max-grad-norm -1",
     "--max-grad-norm must be 0 (no clipping) or a positive number, not -1.0"),
    ("train --initial-peers {open} --ephemeral --target-batch-size 0", "--target-batch-size must be positive"),
    ("train --initial-peers {open} --ephemeral --warmup-steps -1", "--warmup-steps must be 0 or more"),
    ("serve-experts --expert-pattern ffn.[0:2] --lr inf --initial-peers {open} --ephemeral", "--lr must be a positive"),
    ("dataset create corpus {tmp}/empty --upload-rate-mbit inf --initial-peers {open} --ephemeral",
     "--upload-rate-mbit must be a number of Mbit/s, 0 or more (0: no cap), not inf"),
    ("relay --listen /ip4/127.0.0.1/tcp/0 --ephemeral --conn-low-water 300",
     "--conn-low-water, --conn-high-water, --conn-grace: connection manager needs 0 < low_water <= high_water, "
     "got low_water=300, high_water=192"),
    ("serve-experts --expert-pattern bad[ --initial-peers {open} --ephemeral", "expert pattern 'bad['"),
    ("serve-experts --expert-pattern ffn.[0:2] --processes 3 --initial-peers {open} --ephemeral",
     "--processes 3: more processes than the 2 experts"),
    ("serve-experts --expert-pattern ffn.[0:2] --processes 2 --min-batch-size 9 --max-batch-size 8 "
     "--initial-peers {open} --ephemeral", "min_batch_size (9) exceeds max_batch_size (8)"),
    # (it builds the model before it listens: the example's files go under --workdir)
    ("backbone --listen /ip4/127.0.0.1/tcp/{busy} --ephemeral --checkpoint-dir {tmp}/ckpt --workdir {tmp}/example",
     "Address already in use"),
    ("backbone --listen /ip4/127.0.0.1/tcp/0 --ephemeral --checkpoint-dir {tmp}/ckpt --lr nan",
     "--lr must be a positive number"),
    ("backbone --listen /ip4/127.0.0.1/tcp/0 --ephemeral --checkpoint-dir {tmp}/ckpt --target-batch-size 0",
     "--target-batch-size must be positive"),
    ("backbone --listen /ip4/127.0.0.1/tcp/0 --ephemeral --checkpoint-dir {tmp}/ckpt --keep-checkpoints -1",
     "--keep-checkpoints must be 0 (keep all) or more, not -1"),
    ("train --initial-peers {open} --ephemeral --lr inf", "--lr must be a positive number"),
    ("train --initial-peers {open} --ephemeral --run-id " + "r" * 101, "--run-id must be 1 to 100 characters"),
]


@pytest.mark.parametrize("line, says", TABLE, ids=[line.split(" {")[0][:48] for line, _ in TABLE])
def test_a_foreseeable_failure_is_one_line_saying_what_to_do(places: dict[str, str], dedloc: Dedloc, line: str,
                                                            says: str) -> None:
    argv = [part.format(**places) for part in line.split()]
    result = dedloc(*argv)
    assert result.returncode != 0, f"exit 0 for: dedloc {' '.join(argv)}\n{result.stdout}{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    # argparse's own usage errors are "dedloc CMD: error: ..."; ours are "dedloc: error: ..."
    error_lines = [ln for ln in result.stderr.splitlines() if ln.startswith("dedloc") and "error:" in ln]
    assert error_lines, f"no error line: {result.stderr!r}"
    assert says.format(**places) in result.stderr, f"wanted {says.format(**places)!r} in:\n{result.stderr}"
    assert last, result.stderr


def test_every_command_has_a_row() -> None:
    """A command added to the CLI without a bad-input row here fails this."""
    from training.commands import build_parser

    _, sub = build_parser()
    covered = {line.split()[0] for line, _ in TABLE}
    missing = set(sub.choices) - covered - {"demo"}  # demo takes no input a person gives it
    assert not missing, f"commands without a row in TABLE: {sorted(missing)}"
