"""The suite's use of the product's fork server (:mod:`p2p.forkserver`): what each module's server
imports, and how a test's or a bench's command line goes through it.

The ``forks`` fixture (tests/conftest.py) starts a server with the module's ``FORKS_PRELOAD`` and sets
$DEDLOC_FORKS to its socket; :func:`python_m` and :func:`python_argv` then start a command through
it (a ~20 ms client) in place of a fresh interpreter (seconds of imports)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from p2p.forkserver import Forks, client_argv, script_argv
from training.demo import PACKAGES, PRELOAD

ROOT = Path(__file__).resolve().parent.parent

#: The environment variable that tells :func:`python_m` where a test's fork server listens.
ENV = "DEDLOC_FORKS"

#: What NAT agents and relays import (the ``forks`` fixture's default preload).
NAT = ("tests.nat_agent", "nat.cli")
#: What a lab that runs light ``dedloc`` commands beside its relay imports (``training.commands``
#: imports a command's modules only as it runs: the CLI starts at once).
COMMANDS = ("nat.cli", "training.commands")
# PACKAGES (imported above): what the heavier commands (``average``, ``serve-experts``) import as they
# run, torch and every module of the four packages (163 modules, ~8 s once, 4 s a child).
#: And what ``train`` and ``backbone`` import for the example model: the demo's own preload (the
#: packages, transformers' ALBERT and its tokenizer: 4.8 s more of each trainer's start).
TRAINING = PRELOAD
#: What the benches' workers import: the packages and the NAT agent (tests/test_bench_smoke.py).
BENCH = (*PACKAGES, "tests.nat_agent")


def suite_forks(*preload: str, timeout: float = 60) -> Forks:
    """A fork server in the repository's root (a preload may name the suite's own modules)."""
    return Forks(*preload, timeout=timeout, cwd=ROOT)


def python_m(module: str, *args: str) -> list[str]:
    """``python -m module args``: through the fork server named by $DEDLOC_FORKS (set by the
    ``forks`` fixture, tests/conftest.py) where there is one, a fresh interpreter where not (a
    bench that borrows a test's helpers)."""
    return python_argv([sys.executable, "-m", module, *args])


def python_argv(argv: Sequence[str | os.PathLike[str]]) -> list[str]:
    """``argv`` as words; where it runs this interpreter on a script or a ``-m`` module and
    $DEDLOC_FORKS names a fork server, the same command through it. Other interpreters (hivemind's
    venv) and other options (``-c``, ``-u``) start as they are."""
    words = [os.fspath(a) for a in argv]
    path = os.environ.get(ENV)
    if not path or len(words) < 2 or words[0] != sys.executable:
        return words
    if words[1] == "-m" and len(words) > 2:
        return client_argv(path, *words[2:])
    if not words[1].startswith("-") and words[1].endswith(".py"):
        return script_argv(path, *words[1:])
    return words
