"""A command's settings from a TOML file (``--config FILE``) and the environment, under its flags.

The file's keys are the command's long options without the dashes (``max-reservations = 512``, or
``max_reservations``); top-level keys apply to the command that reads the file, and a table named
after a command (``[relay]``, ``[peer]``) to that command alone, so one file can serve several.
Precedence, highest first: flags, the environment (:data:`ENVIRONMENT`, the few settings a
container sets), the file, the built-in defaults. A key no option of the command has, a value of
the wrong kind or outside an option's choices is refused with the file, the key and the reason,
before anything starts (stdlib ``tomllib``: nothing to install).
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError

#: Environment variables a container sets, and the option each stands for (lists: comma-separated).
ENVIRONMENT = {
    "DEDLOC_IDENTITY": "identity",
    "DEDLOC_LISTEN": "listen",
    "DEDLOC_ANNOUNCE": "announce",
    "DEDLOC_INITIAL_PEERS": "initial_peers",
}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options by dest (help and positionals left out: a file cannot give those)."""
    return {a.dest: a for a in parser._actions  # argparse keeps its actions here (no public accessor)
            if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))}


def _takes_list(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")


def _convert(action: argparse.Action, key: str, value: Any, source: str) -> Any:
    def fail(why: str) -> ConfigError:
        return ConfigError(f"{source}: {key} = {value!r}: {why}")

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise fail("must be true or false")
        return value
    if isinstance(action, argparse._CountAction):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise fail("must be a count (0, 1, 2 ...)")
        return value
    if _takes_list(action):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise fail("must be a list of values")
        return [_one(action, v, fail) for v in value]
    if isinstance(value, (list, dict)):
        raise fail("must be a single value")
    return _one(action, value, fail)


def _one(action: argparse.Action, value: Any, fail: Any) -> Any:
    if isinstance(value, bool):
        raise fail("must not be true or false")
    if action.type is int and isinstance(value, float):
        raise fail("must be a whole number")  # int() would cut 2.5 to 2 without a word
    converter = action.type if callable(action.type) else str
    try:
        converted = converter(str(value))  # as its flag's text would be: a number's str() reads back exactly
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise fail(str(e) or f"not a valid {getattr(converter, '__name__', 'value')}") from None
    if action.choices is not None and converted not in action.choices:
        raise fail(f"must be one of {', '.join(map(str, action.choices))}")
    return converted


def load(path: Path, command: str) -> dict[str, Any]:
    """The file's settings for ``command``: its top-level keys, then its ``[command]`` table over them.

    A command with actions (``dataset get``) reads ``[dataset]``, then ``[dataset.get]`` over it:
    what a whole command's actions share, then what one takes. The tables of other commands and
    actions are left alone; within the action's own table a table is an error, as any value of
    the wrong kind is."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    settings = _values(data)
    words = command.split()
    for depth, word in enumerate(words, start=1):
        data = data.get(word, {})
        if not isinstance(data, dict):
            name = ".".join(words[:depth])
            raise ConfigError(f"--config {path}: {name} must be a table ([{name}])")
        settings.update(data if depth == len(words) else _values(data))
    return settings


def _values(table: dict[str, Any]) -> dict[str, Any]:
    """A table's own values, without the tables in it (other commands' and actions')."""
    return {k: v for k, v in table.items() if not isinstance(v, dict)}


def apply(parser: argparse.ArgumentParser, command: str, argv: Sequence[str], config: Path | None,
          environ: Mapping[str, str] = os.environ) -> None:
    """Make the file's and the environment's settings ``parser``'s defaults, checked: flags still win."""
    options = _options(parser)
    values: dict[str, Any] = {}
    sources: list[tuple[str, dict[str, Any]]] = []
    if config is not None:
        sources.append((f"--config {config}", load(config, command)))
    env = {dest: environ[name] for name, dest in ENVIRONMENT.items() if environ.get(name) and dest in options}
    sources.append(("environment", {k: (v.split(",") if _takes_list(options[k]) else v) for k, v in env.items()}))
    for source, settings in sources:
        for key, value in settings.items():
            dest = key.replace("-", "_")
            action = options.get(dest)
            if action is None or dest == "config":
                known = ", ".join(sorted(d.replace("_", "-") for d in options if d != "config"))
                raise ConfigError(f"{source}: unknown key {key!r} for dedloc {command} (its keys: {known})")
            values[dest] = _convert(action, key, value, source)
    given = _flags_given(options, argv)
    for dest, value in values.items():
        action = options[dest]
        if isinstance(action, (argparse._AppendAction, argparse._CountAction)) and dest in given:
            continue  # a flag of an appending or counting option replaces the file's value rather than adding to it
        parser.set_defaults(**{dest: value})
        action.required = False  # given here, an option the command requires need not be a flag too


def _flags_given(options: Mapping[str, argparse.Action], argv: Sequence[str]) -> set[str]:
    given = set()
    for dest, action in options.items():
        for arg in argv:
            if any(_names(arg, s) for s in action.option_strings):
                given.add(dest)
    return given


def _names(arg: str, option: str) -> bool:
    """Whether ``arg`` on the command line is ``option``: itself, with ``=value``, or for a short
    option with its value or more short options run on (``-v3``, ``-vv``)."""
    if arg == option or arg.startswith(option + "="):
        return True
    return len(option) == 2 and arg.startswith(option)  # "-v": argparse has no two-character long option


__all__ = ["ENVIRONMENT", "apply", "load"]
