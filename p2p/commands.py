"""The ``dedloc`` command line of this layer (``id``, ``dht``), and the dispatcher every layer's commands go through.

Only argparse and light modules here: a parser names each command's function
as ``"module:function"``, and :func:`run` imports that module once the
command is chosen. So ``dedloc --help`` and ``dedloc id`` never import torch
or py-libp2p (the commands of each layer: ``p2p/commands.py``,
``nat/commands.py``, ``averaging/commands.py``, ``training/commands.py``, the
entry point; their implementations: each layer's ``cli.py``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import settings
from .errors import DedlocError
from .identity import default_identity_path, peer_id_from_file

if TYPE_CHECKING:
    from .output import Output

DESCRIPTION = """\
dedloc: train neural networks together over the internet, peer to peer.

Start with `dedloc demo` to see a small swarm run on this machine. To join a
real swarm, ask its operator for a bootstrap address and run
`dedloc peer --initial-peers <address>`. To host one, run `dedloc relay` on a
machine with a public IP and give people the address it prints.
"""


def common_options(p: argparse.ArgumentParser, *, node: bool = True) -> None:
    """Options every command shares (``node``: those of a command that runs a node)."""
    p.add_argument("--json", action="store_true", help="print one JSON object per line for each event (see docs/CLI.md)")
    p.add_argument(
        "--identity", type=Path, default=default_identity_path(), metavar="PATH",
        help="identity key file, created on first use with mode 0600 (default: %(default)s)",
    )
    if node:
        p.add_argument("--listen", action="append", metavar="MULTIADDR", help="address to listen on (repeatable)")
        p.add_argument("--announce", action="append", metavar="MULTIADDR",
                       help="address to advertise instead of the listen addresses (repeatable), e.g. a public IP")
        p.add_argument("--duration", type=positive_seconds, default=None, metavar="SECONDS", help="exit after this long (default: run until Ctrl-C)")
        p.add_argument("--status-interval", type=seconds, default=10.0, metavar="SECONDS", help="how often to report the peer count (0: never)")
        p.add_argument("--ephemeral", action="store_true", help="use a throwaway identity instead of --identity")
        p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                       help="serve Prometheus metrics at /metrics and the live page at / (e.g. 127.0.0.1:9100; "
                       ":PORT listens on loopback; see docs/OPERATORS.md)")


def positive_seconds(text: str) -> float:
    """An argparse type: a duration that must be more than zero (a TTL of -5 s is refused, not sent;
    a --duration of -1 or nan reached trio, which raised its ValueError past every handler)."""
    return _seconds(text, zero=False)


def seconds(text: str) -> float:
    """An argparse type: a duration of zero or more (``--status-interval 0``: never)."""
    return _seconds(text, zero=True)


def _seconds(text: str, *, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, not {text}")
    if value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be {'0 or ' if zero else ''}a positive number of seconds, not {text}")
    return value


def directory(text: str) -> Path:
    """An argparse type: a directory, made when first written if missing; a file in its place, or
    in place of one of its parents, is refused at parse (each failed as a FileExistsError or
    NotADirectoryError traceback once the command ran)."""
    path = Path(text)
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                raise argparse.ArgumentTypeError(f"{text} is a file, not a directory" if place == path else
                                                 f"{text}: {place} is a file, not a directory")
            break
    return path


def positive_count(text: str) -> int:
    """An argparse type: a whole number of at least 1 (``ping -c -3`` pinged nothing and said nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


class _Version(argparse.Action):
    """``dedloc --version``: what a bug report needs (dedloc's, py-libp2p's and Python's versions),
    read from the installed distributions only when asked (``dedloc --help`` stays quick)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        def of(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "not installed"

        python = ".".join(map(str, sys.version_info[:3]))
        print(f"dedloc {of('dedloc')} (py-libp2p {of('libp2p')}, Python {python})")
        parser.exit()


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:  # type: ignore[type-arg]
    """The commands of this layer (``id``, ``dht``); upper layers add theirs to the returned subparsers."""
    parser = argparse.ArgumentParser(
        prog="dedloc", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: py-libp2p's too)")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the versions of dedloc, py-libp2p and Python")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("id", help="show this machine's peer id, creating the identity on first run",
                       description="Print the peer id of the identity file, creating a new Ed25519 identity if there is none.")
    common_options(p, node=False)
    p.set_defaults(func="p2p.commands:cmd_id")

    p = sub.add_parser("dht", help="store or read a value in a running swarm's DHT (for debugging)",
                       description="Join the swarm as a short-lived DHT client, do one store or get, and leave.")
    dht_sub = p.add_subparsers(dest="dht_command", required=True, metavar="ACTION")

    def dht_common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--initial-peers", nargs="+", required=True, metavar="MULTIADDR",
                       help="full addresses of swarm members (e.g. the relay), ending in /p2p/<peer-id>")
        q.add_argument("--timeout", type=positive_seconds, default=15.0, metavar="SECONDS", help="give up after this long")
        q.add_argument("--listen", action="append", metavar="MULTIADDR", help=argparse.SUPPRESS)
        q.add_argument("--json", action="store_true", help="print the result as one JSON object")
        q.set_defaults(func="p2p.cli:cmd_dht")

    q = dht_sub.add_parser("get", help="print the value under KEY (exit 1 if none)")
    q.add_argument("key", metavar="KEY")
    q.add_argument("--latest", action="store_true", help="ask every replica and merge, instead of taking the first copy")
    dht_common(q)
    q = dht_sub.add_parser("store", help="store VALUE (text) under KEY for --ttl seconds")
    q.add_argument("key", metavar="KEY")
    q.add_argument("value", metavar="VALUE")
    q.add_argument("--ttl", type=positive_seconds, default=300.0, metavar="SECONDS", help="lifetime of the value (default: %(default)s)")
    q.add_argument("--subkey", default=None, metavar="SUBKEY", help="store under this subkey of a dictionary key")
    dht_common(q)

    p = sub.add_parser("authority", help="a closed run's allowlist: add and revoke users, show the run's key",
                       description="Keep a closed run's authority in --dir (its key and allowlist.json, mode 0600; "
                       "created on first use). `add USER` prints the user's secret once (give it to them) and the "
                       "options their peers join with; `revoke USER` stops their passes being renewed (they are out "
                       "within a pass's life, 15 min); `show` prints the run's authority key and the users. The "
                       "node serving passes is `dedloc relay --authority-dir DIR` (or `backbone`).")
    auth_sub = p.add_subparsers(dest="authority_command", required=True, metavar="ACTION")
    for action, text in (("add", "put USER on the allowlist with a new secret"), ("revoke", "take USER off"),
                         ("show", "print the authority key and the users")):
        q = auth_sub.add_parser(action, help=text)
        if action != "show":
            q.add_argument("username", metavar="USER")
        q.add_argument("--dir", type=directory, default=Path("dedloc-authority"), metavar="DIR",
                       help="the authority's files (default: %(default)s)")
        q.add_argument("--json", action="store_true", help="print one JSON object")
        q.set_defaults(func="p2p.cli:cmd_authority")

    return parser, sub


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
        sub: argparse._SubParsersAction) -> int:  # type: ignore[type-arg]
    """Parse ``argv`` (:func:`parse`), import the chosen command's module and run it."""
    args = parse(parser, sub, list(sys.argv[1:] if argv is None else argv))
    module, _, name = str(args.func).partition(":")
    return run_command(args, getattr(importlib.import_module(module), name))


def parse(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction,  # type: ignore[type-arg]
          argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """``argv`` parsed, with the settings of ``--config`` and the environment under the flags (p2p/settings.py).

    The settings become the command's defaults before the one parse, so an option the command
    requires (``--initial-peers``) may come from the file or the environment instead of a flag.
    """
    for command in _leaves(sub):
        if "--config" not in command._option_string_actions:  # argparse's table of option strings
            command.add_argument("--config", type=Path, metavar="FILE",
                                 help="read settings from this TOML file (its keys are these options' names; "
                                      "flags override it; see docs/OPERATORS.md)")
    chosen = _chosen(sub, argv)
    config = _config_path(argv)
    if chosen is not None and (config is not None or any(environ.get(v) for v in settings.ENVIRONMENT)):
        name, command = chosen
        try:
            settings.apply(command, name, argv, config, environ)
        except DedlocError as e:
            parser.exit(2, f"dedloc {name}: error: {e}\n")
    return parser.parse_args(argv)


def _actions(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:  # type: ignore[type-arg]
    """A command's actions (``dht get``, ``dataset create``), if it has any."""
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _leaves(sub: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:  # type: ignore[type-arg]
    """The parsers that take a command's options: each command's, or each of its actions'."""
    found: list[argparse.ArgumentParser] = []
    for command in dict.fromkeys(sub.choices.values()):  # an alias maps to the same parser
        actions = _actions(command)
        found += [command] if actions is None else _leaves(actions)
    return found


def _chosen(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
            argv: Sequence[str]) -> tuple[str, argparse.ArgumentParser] | None:
    """The command (and action) ``argv`` runs, by name (``dht get``), with the parser of its options.

    Before the command only -v may stand, which takes no value: the first known name is the
    command; a command with actions takes none of its own options before the action, so the next
    known name is the action. None while either is missing (argparse then says what is)."""
    names: list[str] = []
    rest = list(argv)
    while True:
        name = next((arg for arg in rest if arg in sub.choices), None)
        if name is None:
            return None
        names.append(name)
        command = sub.choices[name]
        rest = rest[rest.index(name) + 1:]
        actions = _actions(command)
        if actions is None:
            return " ".join(names), command
        sub = actions


def _config_path(argv: Sequence[str]) -> Path | None:
    """``--config FILE`` or ``--config=FILE`` in ``argv`` (the last one wins, as argparse's would)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            found = Path(argv[i + 1])
        elif arg.startswith("--config="):
            found = Path(arg.removeprefix("--config="))
    return found


#: Open files a command asks for: each connection is a socket, a relay admits 4,096 inbound ones
#: (``--max-inbound``) and a peer keeps 192 before its connection manager trims (``--conn-high-water``),
#: while Linux starts a process at a soft limit of 1,024; past it every accept and dial fails with
#: EMFILE. kubo raises its daemon's limit to 8,192 the same way.
OPEN_FILES = 8192


def raise_open_files_limit(want: int = OPEN_FILES) -> None:
    """Raise this process's soft limit of open files to ``want``, or to the hard limit if that is
    lower; never lower it (nor fail: where the platform has no such limit, or forbids raising it,
    the command goes on with the one it has).

    A command's process only (:func:`run_command`): an app that embeds the Node owns its process's
    limits and sets them itself."""
    try:
        import resource
    except ImportError:  # not a POSIX platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:  # a sandbox that forbids it
        logging.getLogger(__name__).info("could not raise the open files limit from %d to %d: %s", soft, target, e)


def run_command(args: argparse.Namespace, func: Callable[[argparse.Namespace, Output], Any]) -> int:
    """Run a parsed command under trio; errors become one clear line and exit 1."""
    import trio  # only once a command runs: `dedloc --help` imports argparse and little else

    from . import events as ev
    from .output import Output
    from .trio_util import unwrap_single_group

    _setup_logging(args.verbose)
    raise_open_files_limit()
    out = Output(getattr(args, "json", False))

    async def command() -> int:
        async with out.writing():
            return int(await func(args, out))

    try:
        with unwrap_single_group():
            return trio.run(command)
    except KeyboardInterrupt:
        out.event(ev.Error(message="interrupted"))
        return 130
    except DedlocError as e:
        if out.json_mode:
            out.event(ev.Error(message=str(e)))
        else:
            print(f"dedloc: error: {e}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:  # several failures at once: show each
        for exc in group.exceptions:
            print(f"dedloc: error: {exc!r}", file=sys.stderr)
        return 1


def _setup_logging(verbose: int) -> None:
    logging.basicConfig(level=logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    # py-libp2p logs every failed dial attempt at ERROR; dedloc reports those itself.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL if verbose < 2 else logging.DEBUG)


async def cmd_id(args: argparse.Namespace, out: Output) -> int:
    """Only the peer id goes to stdout (``PEER=$(dedloc id)`` is the id, as ``ipfs id -f '<id>'``);
    whether the file was created or loaded is a note for people, on stderr."""
    pid, created = peer_id_from_file(args.identity)
    out.info(str(pid), peer_id=str(pid), identity_path=str(args.identity), created=created)
    if not out.json_mode:
        print(f"({'created' if created else 'loaded'} {args.identity})", file=sys.stderr)
    return 0
