"""p2p/commands.py, the dispatcher every command goes through: this layer's parser, a positive
duration, ``--config`` found in argv and the settings (file, environment) made defaults before the
one parse, the open-files limit raised and never lowered, a command run under trio with each way
it can fail turned into one line and an exit status (the commands themselves, run as processes:
tests/test_cli.py and tests/test_cli_errors.py; the settings' rules: tests/test_settings.py)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from p2p import commands
from p2p.commands import (_config_path, build_parser, directory, parse, positive_count, positive_seconds,
                          raise_open_files_limit, run, run_command, seconds)
from p2p.errors import ConfigError
from p2p.identity import peer_id_from_file
from p2p.output import Output

# ---------------------------------------------------------------------- parsing


def refusal(kind: Any, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        kind(text)
    return str(refused.value)


def test_a_positive_duration_is_a_finite_number_above_zero_and_anything_else_says_why() -> None:
    assert positive_seconds("2.5") == 2.5 and positive_seconds("1e-3") == 0.001
    assert refusal(positive_seconds, "abc") == "'abc' is not a number of seconds"
    assert refusal(positive_seconds, "") == "'' is not a number of seconds"
    for text in ("0", "-5", "-0.0"):
        assert refusal(positive_seconds, text) == f"must be a positive number of seconds, not {text}"
    for text in ("nan", "inf", "-inf", "1e999"):
        assert refusal(positive_seconds, text) == f"must be a finite number of seconds, not {text}"
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        positive_seconds("abc")
    assert refused.value.__suppress_context__  # one line, no ValueError chained


def test_a_duration_of_zero_or_more_is_finite_and_a_negative_one_says_why() -> None:
    assert (seconds("0"), seconds("0.25"), seconds("-0.0")) == (0.0, 0.25, 0.0)
    assert refusal(seconds, "-1") == "must be 0 or a positive number of seconds, not -1"
    assert refusal(seconds, "-1e-9") == "must be 0 or a positive number of seconds, not -1e-9"
    assert refusal(seconds, "nan") == "must be a finite number of seconds, not nan"
    assert refusal(seconds, "x") == "'x' is not a number of seconds"


def test_a_count_is_a_whole_number_of_at_least_one() -> None:
    assert (positive_count("1"), positive_count("12")) == (1, 12)
    assert refusal(positive_count, "0") == "must be at least 1, not 0"
    assert refusal(positive_count, "-3") == "must be at least 1, not -3"
    assert refusal(positive_count, "2.5") == "'2.5' is not a whole number"
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        positive_count("x")
    assert refused.value.__suppress_context__


def test_a_directory_may_be_missing_but_not_a_file_nor_under_one(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert directory(str(tmp_path)) == tmp_path and directory("relative/new") == Path("relative/new")
    assert directory(str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"
    assert refusal(directory, str(tmp_path / "file")) == f"{tmp_path}/file is a file, not a directory"
    assert refusal(directory, str(tmp_path / "file" / "sub")) == (f"{tmp_path}/file/sub: {tmp_path}/file is a file, "
                                                                 "not a directory")


def test_every_directory_option_of_every_command_refuses_a_file_at_parse() -> None:
    """--checkpoint-dir, --workdir, --dir, --authority-dir and a dataset's DIR: a file there failed
    as a FileExistsError or NotADirectoryError traceback once the command ran."""
    from training.commands import build_parser as everything

    parser, sub = everything()
    checked = set()
    for leaf in commands._leaves(sub):
        for action in leaf._actions:
            if action.metavar == "DIR" or action.dest in ("workdir", "checkpoint_dir"):
                assert action.type is directory, (leaf.prog, action.dest)
                checked.add((leaf.prog.split()[-1], action.dest))
    assert {("backbone", "checkpoint_dir"), ("serve-experts", "checkpoint_dir"), ("train", "workdir"),
            ("relay", "authority_dir"), ("add", "dir"), ("get", "directory"), ("seed", "directories"),
            ("create", "directory"), ("retract", "authority_dir")} <= checked


def test_every_option_in_seconds_of_every_command_refuses_a_negative_or_nan_before_anything_runs() -> None:
    """A --duration of -1 or nan reached trio's ``move_on_after`` and came out as a traceback; a
    ping interval of nan and a dht timeout of nan too. Every SECONDS option is checked at parse."""
    from training.commands import build_parser as everything

    parser, sub = everything()
    checked = 0
    for leaf in commands._leaves(sub):
        for action in leaf._actions:
            if action.metavar == "SECONDS" and action.type is not int:  # whole seconds: no nan, the config's check
                assert action.type in (positive_seconds, seconds), (leaf.prog, action.option_strings)
                if "(0: " in (action.help or ""):  # 0 means something (--train-time 0: no training)
                    assert action.type is seconds, (leaf.prog, action.option_strings)
                checked += 1
            if action.option_strings == ["-c", "--count"]:
                assert action.type is positive_count
    assert checked > 90  # every command's --duration and --status-interval at least

def test_config_is_found_in_either_form_the_last_one_winning_and_a_bare_flag_at_the_end_ignored() -> None:
    assert _config_path([]) is None and _config_path(["dht", "get", "k"]) is None
    assert _config_path(["peer", "--config", "a.toml"]) == Path("a.toml")
    assert _config_path(["peer", "--config=b.toml"]) == Path("b.toml")
    assert _config_path(["--config", "a.toml", "--config=b.toml"]) == Path("b.toml")
    assert _config_path(["--config=b.toml", "--config", "a.toml"]) == Path("a.toml")
    assert _config_path(["--config=a.toml", "--config"]) == Path("a.toml")  # no value after it: argparse's to refuse


def test_this_layer_s_parser_has_id_dht_and_authority_each_naming_its_function() -> None:
    parser, sub = build_parser()
    assert set(sub.choices) == {"id", "dht", "authority"} and parser.prog == "dedloc"
    args = parser.parse_args(["-vv", "id", "--identity", "/tmp/x.key"])
    assert (args.verbose, args.func, args.identity, args.json) == (2, "p2p.commands:cmd_id", Path("/tmp/x.key"), False)
    args = parser.parse_args(["dht", "store", "k", "v", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--ttl", "9"])
    assert (args.func, args.key, args.value, args.ttl, args.subkey, args.timeout) == ("p2p.cli:cmd_dht", "k", "v", 9.0,
                                                                                       None, 15.0)
    assert parser.parse_args(["dht", "store", "k", "v", "--initial-peers", "a"]).ttl == 300.0
    args = parser.parse_args(["dht", "get", "k", "--initial-peers", "a", "b", "--latest"])
    assert (args.initial_peers, args.latest, args.dht_command) == (["a", "b"], True, "get")
    for action in ("add", "revoke"):
        args = parser.parse_args(["authority", action, "alice"])
        assert (args.func, args.username, args.dir) == ("p2p.cli:cmd_authority", "alice", Path("dedloc-authority"))
    assert parser.parse_args(["authority", "show", "--dir", "d"]).dir == Path("d")
    with pytest.raises(SystemExit):
        parser.parse_args(["dht", "store", "k", "v", "--initial-peers", "a", "--ttl", "0"])


def test_an_action_s_settings_from_a_file_or_the_environment_become_defaults_that_flags_override(
        tmp_path: Path) -> None:
    """``dht get`` is an action of ``dht``: its options are the action's (before, the file's keys were
    checked against ``dht``'s, which has none, and every key was refused)."""
    parser, sub = build_parser()
    config = tmp_path / "dedloc.toml"
    config.write_text('initial-peers = ["/ip4/127.0.0.1/tcp/1/p2p/A"]\n[dht]\ntimeout = 3.0\n[dht.store]\nttl = 60\n')
    args = parse(parser, sub, ["dht", "get", "k", "--config", str(config)], environ={})
    assert (args.initial_peers, args.timeout, args.config) == (["/ip4/127.0.0.1/tcp/1/p2p/A"], 3.0, config)
    args = parse(parser, sub, ["dht", "get", "k", f"--config={config}", "--timeout", "7"], environ={})
    assert (args.initial_peers, args.timeout) == (["/ip4/127.0.0.1/tcp/1/p2p/A"], 7.0)  # the flag wins
    args = parse(parser, sub, ["dht", "store", "get", "v", "--config", str(config)], environ={})  # a key named get
    assert (args.dht_command, args.key, args.ttl, args.timeout) == ("store", "get", 60.0, 3.0)
    args = parse(parser, sub, ["dht", "get", "k"], environ={"DEDLOC_INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1/p2p/B,x"})
    assert args.initial_peers == ["/ip4/1.2.3.4/tcp/1/p2p/B", "x"]
    parser, sub = build_parser()  # (settings become the parser's defaults: a fresh one)
    with pytest.raises(SystemExit):  # required, and given nowhere
        parse(parser, sub, ["dht", "get", "k"], environ={"DEDLOC_INITIAL_PEERS": ""})


def test_a_bad_setting_exits_2_with_the_command_s_name_and_the_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser, sub = build_parser()
    config = tmp_path / "bad.toml"
    config.write_text("no-such-option = 1\n")
    with pytest.raises(SystemExit) as stopped:
        parse(parser, sub, ["-v", "dht", "get", "k", "--config", str(config)], environ={})
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dedloc dht get: error: ") and "unknown key 'no-such-option' for dedloc dht get" in err
    assert "(its keys: initial-peers, json, latest, listen, timeout)" in err and err.endswith("\n")


def test_without_a_file_or_the_environment_the_settings_are_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_: object) -> None:
        raise AssertionError("settings read")

    monkeypatch.setattr("p2p.settings.apply", never)
    parser, sub = build_parser()
    args = parse(parser, sub, ["dht", "get", "k", "--initial-peers", "a"], environ={"UNRELATED": "1"})
    assert args.key == "k" and args.config is None
    with pytest.raises(SystemExit):  # no command named: argparse says so, nothing read first
        parse(parser, sub, ["--config", "x.toml"], environ={})


def test_config_is_offered_by_every_command_or_action_once_however_often_parse_runs() -> None:
    parser, sub = build_parser()
    for _ in range(2):
        parse(parser, sub, ["authority", "show"], environ={})
    leaves = [sub.choices["id"], *commands._actions(sub.choices["dht"]).choices.values(),  # type: ignore[union-attr]
              *commands._actions(sub.choices["authority"]).choices.values()]  # type: ignore[union-attr]
    assert len(leaves) == 6
    for command in leaves:
        assert [a.dest for a in command._actions].count("config") == 1
    for group in ("dht", "authority"):  # a command with actions takes none of its own: the action does
        assert "--config" not in sub.choices[group]._option_string_actions


def test_the_command_and_action_chosen_are_the_first_known_names_in_order() -> None:
    parser, sub = build_parser()
    assert commands._chosen(sub, []) is None and commands._chosen(sub, ["-v"]) is None
    assert commands._chosen(sub, ["-v", "id", "--json"]) == ("id", sub.choices["id"])
    get = commands._actions(sub.choices["dht"]).choices["get"]  # type: ignore[union-attr]
    assert commands._chosen(sub, ["dht", "get", "store"]) == ("dht get", get)
    assert commands._chosen(sub, ["dht"]) is None  # no action yet: argparse says so
    assert commands._chosen(sub, ["store", "dht", "get"]) == ("dht get", get)  # a name before the command is no action


# ---------------------------------------------------------------------- the open-files limit


class Limits:
    """A stand-in for the ``resource`` module: the limits, and what was set."""

    RLIMIT_NOFILE = 7
    RLIM_INFINITY = -1

    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.limits = (soft, hard)
        self.set: list[tuple[int, tuple[int, int]]] = []
        self.refuse = refuse

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        if self.refuse:
            raise ValueError("not allowed")
        self.set.append((which, limits))


@pytest.mark.parametrize("soft, hard, want, wanted", [
    (1024, 524288, 8192, [(7, (8192, 524288))]),  # raised to what it asks
    (1024, 4096, 8192, [(7, (4096, 4096))]),  # to the hard limit, when that is lower
    (1024, -1, 8192, [(7, (8192, -1))]),  # no hard limit
    (8192, 524288, 8192, []),  # already there
    (10000, 524288, 8192, []),  # never lowered
    (-1, -1, 8192, []),  # no limit at all
    (4096, 4096, 8192, []),  # at the hard limit already
])
def test_the_open_files_limit_is_raised_to_what_is_asked_or_the_hard_limit_and_never_lowered(
        monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, want: int, wanted: list[object]) -> None:
    limits = Limits(soft, hard)
    monkeypatch.setitem(sys.modules, "resource", limits)
    raise_open_files_limit(want)
    assert limits.set == wanted
    assert commands.OPEN_FILES == 8192


def test_a_refused_raise_is_logged_and_the_command_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "resource", Limits(1024, 524288, refuse=True))
    with caplog.at_level(logging.INFO, logger="p2p.commands"):
        raise_open_files_limit()
    assert [r.getMessage() for r in caplog.records if r.name == "p2p.commands"] == [
        "could not raise the open files limit from 1024 to 8192: not allowed"]


def test_without_posix_limits_nothing_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "resource", None)  # import resource raises ImportError
    raise_open_files_limit()


# ---------------------------------------------------------------------- running a command


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """run_command's process-wide set-up replaced: the limit recorded, logging left alone."""
    raised: list[int] = []
    monkeypatch.setattr(commands, "raise_open_files_limit", lambda: raised.append(1))
    monkeypatch.setattr(commands, "_setup_logging", lambda verbose: None)
    return raised


def namespace(json_mode: bool = False) -> argparse.Namespace:
    return argparse.Namespace(verbose=0, json=json_mode)


def test_a_command_runs_under_trio_and_its_number_is_the_exit_status(quiet: list[int]) -> None:
    async def command(args: argparse.Namespace, out: Output) -> int:
        await trio.sleep(0)
        out.info("done", done=True)
        return 3

    assert run_command(namespace(), command) == 3 and quiet == [1]


def test_a_dedloc_error_is_one_line_on_stderr_or_an_error_record_and_exit_1(
        quiet: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    async def command(args: argparse.Namespace, out: Output) -> int:
        async with trio.open_nursery():  # trio wraps it in a group: one error comes out as itself
            raise ConfigError("--metrics x: give HOST:PORT")

    assert run_command(namespace(), command) == 1
    captured = capsys.readouterr()
    assert captured.err == "dedloc: error: --metrics x: give HOST:PORT\n" and captured.out == ""
    assert run_command(namespace(json_mode=True), command) == 1
    captured = capsys.readouterr()
    [line] = captured.out.splitlines()
    assert json.loads(line)["event"] == "error" and json.loads(line)["message"] == "--metrics x: give HOST:PORT"
    assert captured.err == ""


def test_an_interrupt_is_an_error_record_and_exit_130(quiet: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    async def command(args: argparse.Namespace, out: Output) -> int:
        raise KeyboardInterrupt

    assert run_command(namespace(json_mode=True), command) == 130
    assert json.loads(capsys.readouterr().out)["message"] == "interrupted"


def test_several_errors_at_once_are_each_shown_and_exit_1(quiet: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    async def fail(message: str) -> None:
        raise RuntimeError(message)

    async def command(args: argparse.Namespace, out: Output) -> int:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail, "one")
            nursery.start_soon(fail, "two")
        return 0

    assert run_command(namespace(), command) == 1
    assert sorted(capsys.readouterr().err.splitlines()) == ["dedloc: error: RuntimeError('one')",
                                                            "dedloc: error: RuntimeError('two')"]


def test_another_error_is_not_swallowed(quiet: list[int]) -> None:
    async def command(args: argparse.Namespace, out: Output) -> int:
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError, match="a bug"):
        run_command(namespace(), command)


async def chosen(args: argparse.Namespace, out: Output) -> int:
    """A command for :func:`run` to import by its ``module:function`` name."""
    return len(args.key)


def test_run_parses_imports_the_chosen_command_s_module_and_runs_it(quiet: list[int],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    parser, sub = build_parser()
    q = sub.add_parser("echo")
    q.add_argument("key")
    q.set_defaults(func=f"{__name__}:chosen")
    assert run(parser, ["echo", "abcd"], sub) == 4
    monkeypatch.setattr("sys.argv", ["dedloc", "echo", "ab"])
    assert run(parser, None, sub) == 2  # argv None: the process's


def test_logging_follows_v_and_py_libp2p_s_only_at_vv(monkeypatch: pytest.MonkeyPatch) -> None:
    configured: list[dict[str, Any]] = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: configured.append(kw))
    libp2p = logging.getLogger("libp2p")
    monkeypatch.setattr(libp2p, "level", libp2p.level)
    for verbose, level, theirs in ((0, logging.WARNING, logging.CRITICAL), (1, logging.INFO, logging.CRITICAL),
                                   (2, logging.DEBUG, logging.DEBUG), (3, logging.DEBUG, logging.DEBUG)):
        commands._setup_logging(verbose)
        assert configured[-1]["level"] == level and libp2p.level == theirs
    assert configured[0]["format"] == "%(asctime)s %(name)s %(levelname)s %(message)s"
    assert configured[0]["stream"] is sys.stderr


def test_an_identity_is_created_then_loaded_by_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "id.key"
    out = Output(True)
    args = SimpleNamespace(identity=path)
    assert trio.run(commands.cmd_id, args, out) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["created"] is True and first["identity_path"] == str(path)
    assert trio.run(commands.cmd_id, args, out) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["created"] is False and second["peer_id"] == first["peer_id"]


def test_id_prints_only_the_peer_id_on_stdout_and_the_note_on_stderr(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``PEER=$(dedloc id)`` is the id: the note saying whether the file was made goes to stderr."""
    path = tmp_path / "id.key"
    args = SimpleNamespace(identity=path)
    assert trio.run(commands.cmd_id, args, Output(False)) == 0
    first = capsys.readouterr()
    assert first.err == f"(created {path})\n"
    assert trio.run(commands.cmd_id, args, Output(False)) == 0
    second = capsys.readouterr()
    assert first.out == second.out == f"{peer_id_from_file(path)[0]}\n" and second.err == f"(loaded {path})\n"


def test_version_names_dedloc_py_libp2p_and_python_on_stdout_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """What a bug report needs, from the installed distributions (the pin: libp2p==0.8.1)."""
    from importlib.metadata import version

    parser, _ = build_parser()
    with pytest.raises(SystemExit) as ended:
        parser.parse_args(["--version"])
    assert ended.value.code == 0
    python = ".".join(map(str, sys.version_info[:3]))
    assert capsys.readouterr() == (f"dedloc {version('dedloc')} (py-libp2p 0.8.1, Python {python})\n", "")


def test_version_says_so_of_a_distribution_not_installed(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def version(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    parser, _ = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--version"])
    assert capsys.readouterr().out.startswith("dedloc not installed (py-libp2p not installed, Python ")
