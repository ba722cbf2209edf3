"""``--config FILE`` (TOML) and the environment under the flags (p2p/settings.py), on the real parser."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from p2p import commands, settings
from p2p.errors import ConfigError
from training.commands import build_parser

ROOT = Path(__file__).resolve().parent.parent


def parse(argv: list[str], config: str | None, tmp_path: Path, environ: dict[str, str] | None = None):
    """What ``dedloc ARGV --config FILE`` parses to (p2p.commands.parse, the dispatcher's)."""
    parser, sub = build_parser()
    if config is not None:
        path = tmp_path / "dedloc.toml"
        path.write_text(config)
        argv = [*argv, "--config", str(path)]
    return commands.parse(parser, sub, argv, environ or {})


def apply(command: str, config: str, tmp_path: Path) -> None:
    """settings.apply alone, so that a refusal arrives as the ConfigError it is."""
    _, sub = build_parser()
    path = tmp_path / "dedloc.toml"
    path.write_text(config)
    settings.apply(sub.choices[command], command, [command], path, {})


def test_the_file_sets_defaults_and_flags_win(tmp_path: Path) -> None:
    config = 'max-reservations = 512\nmax_circuits = 64\nlisten = ["/ip4/127.0.0.1/tcp/4001"]\nallow-private = true\n'
    args = parse(["relay"], config, tmp_path)
    assert (args.max_reservations, args.max_circuits, args.listen, args.allow_private) == (
        512, 64, ["/ip4/127.0.0.1/tcp/4001"], True)
    args = parse(["relay", "--max-circuits", "128", "--listen", "/ip4/127.0.0.1/tcp/5001"], config, tmp_path)
    assert args.max_circuits == 128  # a flag equal to the built-in default still wins
    assert args.listen == ["/ip4/127.0.0.1/tcp/5001"]  # replaced, not appended to the file's
    assert args.max_reservations == 512


def test_a_table_is_for_its_command_and_the_environment_sits_between(tmp_path: Path) -> None:
    config = 'ephemeral = true\n[relay]\nmax-reservations = 9\n[peer]\ninitial-peers = ["/ip4/10.0.0.1/tcp/1/p2p/x"]\n'
    assert parse(["relay"], config, tmp_path).max_reservations == 9
    args = parse(["peer"], config, tmp_path)
    assert args.initial_peers == ["/ip4/10.0.0.1/tcp/1/p2p/x"] and args.ephemeral and args.max_reservations == 256
    env = {"DEDLOC_INITIAL_PEERS": "/ip4/10.0.0.2/tcp/1/p2p/y,/ip4/10.0.0.3/tcp/1/p2p/z", "DEDLOC_IDENTITY": "/k"}
    assert parse(["peer"], None, tmp_path, env).initial_peers == env["DEDLOC_INITIAL_PEERS"].split(",")  # no file
    args = parse(["peer"], config, tmp_path, env)
    assert args.initial_peers == ["/ip4/10.0.0.2/tcp/1/p2p/y", "/ip4/10.0.0.3/tcp/1/p2p/z"]
    assert str(args.identity) == "/k"
    args = parse(["peer", "--initial-peers", "/ip4/10.0.0.4/tcp/1/p2p/w"], config, tmp_path, env)
    assert args.initial_peers == ["/ip4/10.0.0.4/tcp/1/p2p/w"]


@pytest.mark.parametrize("config, message", [
    ("max-reservatons = 5\n", "unknown key 'max-reservatons' for dedloc relay"),
    ("max-reservations = 'many'\n", "max-reservations = 'many': invalid literal for int"),
    ("allow-private = 1\n", "allow-private = 1: must be true or false"),
    ("listen = 4001\n", "listen = 4001: must be a list of values"),
    ("max-circuits = [1, 2]\n", "max-circuits = [1, 2]: must be a single value"),
    ("relay = 3\n", "relay must be a table"),
    ("listen = [\n", "not valid TOML"),
])
def test_bad_keys_and_values_are_refused_by_name(tmp_path: Path, config: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        apply("relay", config, tmp_path)


def test_a_choice_outside_the_option_s_choices_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dht-mode = 'sometimes': must be one of auto, server, client"):
        apply("peer", 'dht-mode = "sometimes"\ninitial-peers = ["/ip4/1.2.3.4/tcp/1/p2p/x"]\n', tmp_path)


def test_a_relay_runs_from_its_file_and_a_bad_file_stops_it_with_the_reason(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "relay.toml"
    config.write_text(f'listen = ["/ip4/127.0.0.1/tcp/{port}"]\nephemeral = true\njson = true\nduration = 1\n'
                      f'status-interval = 0\n')
    result = subprocess.run([sys.executable, "-m", "training.commands", "relay", "--config", str(config)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    listening = json.loads(result.stdout.splitlines()[0])
    assert listening["event"] == "listening" and any(f"/tcp/{port}/" in a for a in listening["addrs"])
    config.write_text("max-circuits = -\n")
    result = subprocess.run([sys.executable, "-m", "training.commands", "relay", "--config", str(config)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "not valid TOML" in result.stderr and "relay.toml" in result.stderr


def test_an_action_of_dataset_takes_the_swarm_from_the_file_or_the_environment(tmp_path: Path) -> None:
    """``dataset get`` is an action: its options are its own, ``[dataset]`` is read for every action
    and ``[dataset.get]`` for it alone (before, every key was checked against ``dataset``'s options,
    which are none, and refused; and the environment's swarm was passed over)."""
    config = ('[dataset]\ninitial-peers = ["/ip4/10.0.0.1/tcp/1/p2p/x"]\n'
              '[dataset.get]\nmax-seeders = 3\n[dataset.seed]\nmax-seeders = 9\n')
    args = parse(["dataset", "get", "wiki", str(tmp_path)], config, tmp_path)
    assert (args.initial_peers, args.max_seeders) == (["/ip4/10.0.0.1/tcp/1/p2p/x"], 3)
    env = {"DEDLOC_INITIAL_PEERS": "/ip4/10.0.0.2/tcp/1/p2p/y"}
    assert parse(["dataset", "get", "wiki", "d"], None, tmp_path, env).initial_peers == ["/ip4/10.0.0.2/tcp/1/p2p/y"]
