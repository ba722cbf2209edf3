"""p2p.settings on a parser of its own: each kind of option a file or the environment may set, each
refusal in its words, the file's tables, and what a flag on the command line keeps. The real
commands' parsers and a relay started from a file: tests/test_settings.py."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from p2p import settings
from p2p.errors import ConfigError


def port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is no port")
    return value


def silent(text: str) -> str:
    raise ValueError("")


class Nameless:
    """A type with no ``__name__`` (an instance), whose refusal says nothing."""

    def __call__(self, text: str) -> str:
        raise ValueError("")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dedloc thing")
    p.add_argument("--version", action="version", version="1")
    p.add_argument("target", nargs="?")
    p.add_argument("--config", type=Path)
    p.add_argument("--listen", action="append")
    p.add_argument("--initial-peers", nargs="+")
    p.add_argument("--some", nargs="*")
    p.add_argument("--maybe", nargs="?")
    p.add_argument("--size", type=int, default=1)
    p.add_argument("--rate", type=float)
    p.add_argument("--port", type=port)
    p.add_argument("--strange", type=silent)
    p.add_argument("--odd", type=Nameless())
    p.add_argument("--key-file", type=Path)
    p.add_argument("--name")
    p.add_argument("--mode", choices=["auto", "server", "client"])
    p.add_argument("--level", type=int, choices=[1, 2, 3])
    p.add_argument("--fast", action="store_true")
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("--identity", required=True)
    p.set_defaults(func=print)
    return p


def options() -> dict[str, argparse.Action]:
    return settings._options(parser())


def convert(dest: str, value: Any) -> Any:
    return settings._convert(options()[dest], dest.replace("_", "-"), value, "--config f.toml")


def refused(dest: str, value: Any, why: str) -> None:
    words = f"--config f.toml: {dest.replace('_', '-')} = {value!r}: {why}"
    with pytest.raises(ConfigError, match=f"^{re.escape(words)}$"):
        convert(dest, value)


def applied(toml: str | None, argv: list[str] | None = None, environ: dict[str, str] | None = None,
            tmp_path: Path | None = None) -> argparse.Namespace:
    p = parser()
    path = None
    if toml is not None:
        assert tmp_path is not None
        path = tmp_path / "dedloc.toml"
        path.write_text(toml)
    argv = argv if argv is not None else []
    settings.apply(p, "thing", argv, path, environ or {})
    return p.parse_args(argv)


# ---------------------------------------------------------------------- the options a file may set


def test_a_file_may_set_every_option_but_help_version_and_positionals() -> None:
    assert list(options()) == ["config", "listen", "initial_peers", "some", "maybe", "size", "rate", "port", "strange",
                               "odd", "key_file", "name", "mode", "level", "fast", "check", "verbose", "identity"]


def test_which_options_take_lists() -> None:
    taken = {dest for dest, action in options().items() if settings._takes_list(action)}
    assert taken == {"listen", "initial_peers", "some"}


# ---------------------------------------------------------------------- values converted


def test_switches_take_true_or_false_only() -> None:
    assert convert("fast", True) is True and convert("check", False) is False
    refused("fast", 1, "must be true or false")
    refused("check", "no", "must be true or false")


def test_a_count_is_a_whole_number_from_zero() -> None:
    assert convert("verbose", 0) == 0 and convert("verbose", 3) == 3
    refused("verbose", -1, "must be a count (0, 1, 2 ...)")
    refused("verbose", True, "must be a count (0, 1, 2 ...)")
    refused("verbose", "2", "must be a count (0, 1, 2 ...)")


def test_a_list_takes_one_value_or_a_list_of_values() -> None:
    assert convert("listen", "/ip4/1.2.3.4/tcp/1") == ["/ip4/1.2.3.4/tcp/1"]
    assert convert("initial_peers", ["a", "b"]) == ["a", "b"]
    assert convert("some", [1, 2.5, "x"]) == ["1", "2.5", "x"]
    assert convert("listen", []) == []
    refused("listen", 4001, "must be a list of values")
    refused("listen", {"a": 1}, "must be a list of values")
    refused("listen", ["a", ["b"]], "must be a list of values")
    refused("listen", ["a", True], "must not be true or false")


def test_a_single_value_is_not_a_list_or_a_table() -> None:
    refused("size", [1, 2], "must be a single value")
    refused("name", {"a": 1}, "must be a single value")
    refused("size", True, "must not be true or false")


def test_numbers_keep_their_kind_and_text_is_converted() -> None:
    assert convert("size", 5) == 5 and convert("size", "7") == 7
    assert convert("rate", 3) == 3.0 and isinstance(convert("rate", 3), float) and convert("rate", "0.5") == 0.5
    assert convert("name", 42) == "42" and convert("name", "x") == "x"
    assert convert("maybe", 1.5) == "1.5"
    refused("size", "many", "invalid literal for int() with base 10: 'many'")
    refused("rate", "fast", "could not convert string to float: 'fast'")


def test_a_fraction_is_no_whole_number() -> None:
    refused("size", 2.5, "must be a whole number")
    refused("size", 3.0, "must be a whole number")
    assert convert("size", 3) == 3


def test_an_option_s_own_type_gives_its_reason_or_its_name() -> None:
    assert convert("port", 4001) == 4001
    refused("port", 70000, "70000 is no port")
    refused("strange", "x", "not a valid silent")
    refused("odd", "x", "not a valid value")
    assert convert("key_file", 5) == Path("5") and convert("key_file", "/k") == Path("/k")  # as its flag's text
    assert convert("rate", 1e-7) == 1e-7 and convert("rate", 10**20) == 1e20


def test_a_value_outside_the_choices_is_refused_with_them() -> None:
    assert convert("mode", "server") == "server" and convert("level", 2) == 2
    refused("mode", "sometimes", "must be one of auto, server, client")
    refused("level", 4, "must be one of 1, 2, 3")


# ---------------------------------------------------------------------- the file


def test_top_level_keys_and_the_command_s_table_over_them(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text('size = 1\nname = "top"\n[thing]\nsize = 2\n[other]\nsize = 3\n')
    assert settings.load(path, "thing") == {"size": 2, "name": "top"}
    assert settings.load(path, "other") == {"size": 3, "name": "top"}
    assert settings.load(path, "third") == {"size": 1, "name": "top"}


def test_an_action_reads_its_command_s_table_then_its_own_and_no_other(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text('size = 1\nname = "top"\n[thing]\nsize = 2\nmode = "a"\n[thing.get]\nsize = 3\n'
                    '[thing.put]\nsize = 4\nname = "put"\n[other]\nsize = 5\n')
    assert settings.load(path, "thing get") == {"size": 3, "name": "top", "mode": "a"}
    assert settings.load(path, "thing put") == {"size": 4, "name": "put", "mode": "a"}
    assert settings.load(path, "thing list") == {"size": 2, "name": "top", "mode": "a"}  # no table of its own
    assert settings.load(path, "thing") == {"size": 2, "name": "top", "mode": "a",  # a command's own table whole:
                                            "get": {"size": 3}, "put": {"size": 4, "name": "put"}}  # refused keys
    path.write_text("[thing]\nget = 3\n")
    with pytest.raises(ConfigError, match=rf"^--config {path}: thing\.get must be a table \(\[thing\.get\]\)$"):
        settings.load(path, "thing get")
    path.write_text("thing = 3\n")
    with pytest.raises(ConfigError, match=rf"^--config {path}: thing must be a table \(\[thing\]\)$"):
        settings.load(path, "thing get")
    path.write_text("[thing.get]\nsize = { a = 1 }\n")  # a table where a value goes: kept, and refused by apply
    assert settings.load(path, "thing get") == {"size": {"a": 1}}


def test_a_command_s_key_that_is_no_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text("thing = 3\n")
    with pytest.raises(ConfigError, match=rf"^--config {path}: thing must be a table \(\[thing\]\)$"):
        settings.load(path, "thing")


def test_a_file_that_cannot_be_read_or_parsed_is_refused_by_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "none.toml"
    with pytest.raises(ConfigError, match=rf"^--config {missing}: No such file or directory$"):
        settings.load(missing, "thing")
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path}: Is a directory$"):
        settings.load(tmp_path, "thing")
    garbled = tmp_path / "bad.toml"
    garbled.write_text("size = [\n")
    with pytest.raises(ConfigError, match=rf"^--config {garbled}: not valid TOML: "):
        settings.load(garbled, "thing")
    garbled.write_bytes(b'name = "\xff"\n')
    with pytest.raises(ConfigError, match=rf"^--config {garbled}: not valid TOML: "):
        settings.load(garbled, "thing")


# ---------------------------------------------------------------------- apply


def test_the_file_s_values_become_defaults_under_dashed_or_underscored_keys(tmp_path: Path) -> None:
    args = applied('size = 4\ninitial-peers = ["a"]\ninitial_peers = ["b"]\nfast = true\nidentity = "/k"\n',
                   tmp_path=tmp_path)
    assert (args.size, args.initial_peers, args.fast, args.identity, args.check) == (4, ["b"], True, "/k", True)


def test_the_command_s_table_is_read(tmp_path: Path) -> None:
    args = applied('size = 4\nidentity = "/k"\n[thing]\nsize = 5\n[other]\nsize = 6\n', tmp_path=tmp_path)
    assert args.size == 5


def test_an_option_required_as_a_flag_may_come_from_the_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        applied('size = 4\n', tmp_path=tmp_path)  # --identity still required
    assert applied('identity = "/k"\n', tmp_path=tmp_path).identity == "/k"


def test_a_flag_wins_over_the_file_and_an_appending_flag_replaces_its_list(tmp_path: Path) -> None:
    toml = 'size = 4\nlisten = ["a", "b"]\nidentity = "/k"\n'
    args = applied(toml, ["--size", "1", "--listen", "c"], tmp_path=tmp_path)
    assert (args.size, args.listen) == (1, ["c"])
    args = applied(toml, ["--size=9", "--listen=d"], tmp_path=tmp_path)
    assert (args.size, args.listen) == (9, ["d"])
    assert applied(toml, [], tmp_path=tmp_path).listen == ["a", "b"]
    args = applied(toml, ["--name", "x"], tmp_path=tmp_path)
    assert args.listen == ["a", "b"] and args.size == 4


@pytest.mark.parametrize(("argv", "verbose"), [([], 2), (["-v"], 1), (["-vv"], 2), (["--verbose"], 1),
                                               (["-v", "-v", "-v"], 3)])
def test_a_counting_flag_replaces_the_file_s_count(tmp_path: Path, argv: list[str], verbose: int) -> None:
    assert applied('verbose = 2\nidentity = "/k"\n', argv, tmp_path=tmp_path).verbose == verbose


def test_what_names_an_option_on_the_command_line() -> None:
    assert settings._names("--size", "--size") and settings._names("--size=3", "--size")
    assert not settings._names("--sizes", "--size") and not settings._names("--sizes=3", "--size")
    assert settings._names("-v", "-v") and settings._names("-vv", "-v") and settings._names("-v3", "-v")
    assert not settings._names("--v", "-v") and not settings._names("-x", "-v")
    assert not settings._names("--verbose-more", "--verbose")


def test_unknown_keys_are_refused_with_the_command_s_keys(tmp_path: Path) -> None:
    known = ("check, fast, identity, initial-peers, key-file, level, listen, maybe, mode, name, odd, port, rate, size, "
             "some, strange, verbose")
    for key in ("sise", "config", "func"):
        with pytest.raises(ConfigError, match=rf"^--config {tmp_path / 'dedloc.toml'}: unknown key '{key}' for "
                                              rf"dedloc thing \(its keys: {known}\)$"):
            applied(f'{key} = 1\n', tmp_path=tmp_path)


def test_the_environment_sits_between_the_file_and_the_flags(tmp_path: Path) -> None:
    env = {"DEDLOC_IDENTITY": "/env", "DEDLOC_LISTEN": "x,y", "DEDLOC_INITIAL_PEERS": "", "DEDLOC_ANNOUNCE": "z",
           "HOME": "/root"}
    args = applied('identity = "/file"\ninitial-peers = ["p"]\n', [], env, tmp_path)
    assert (args.identity, args.listen, args.initial_peers) == ("/env", ["x", "y"], ["p"])  # an empty one is unset
    assert not hasattr(args, "announce")  # an option this command has not
    assert applied(None, ["--identity", "/flag"], env).identity == "/flag"
    assert settings.ENVIRONMENT == {"DEDLOC_IDENTITY": "identity", "DEDLOC_LISTEN": "listen",
                                    "DEDLOC_ANNOUNCE": "announce", "DEDLOC_INITIAL_PEERS": "initial_peers"}


def test_the_environment_s_values_are_checked_in_its_name(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--identity", type=port)
    with pytest.raises(ConfigError, match="^environment: identity = 'x': invalid literal for int"):
        settings.apply(p, "thing", [], None, {"DEDLOC_IDENTITY": "x"})


def test_without_a_file_or_environment_nothing_changes() -> None:
    p = parser()
    settings.apply(p, "thing", [], None, {})
    assert p.parse_args(["--identity", "/k"]).size == 1
    assert settings.__all__ == ["ENVIRONMENT", "apply", "load"]
