"""Shared fixtures: real Nodes on loopback, nothing mocked."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest

from p2p import Node, NodeConfig
from p2p.forkserver import Forks
from tests.forks import ENV as FORKS_ENV, NAT, suite_forks

LOOPBACK4 = "/ip4/127.0.0.1/tcp/0"
LOOPBACK6 = "/ip6/::1/tcp/0"

# py-libp2p logs each failed dial at ERROR; tests that provoke failures on purpose
# would drown the report in them.
logging.getLogger("libp2p").setLevel(logging.CRITICAL)


#: Name prefixes of the namespace labs the suite builds (nat/lab.py names each ``<prefix>-<pid>-...``).
LAB_PREFIXES = ("dlab", "ddemo", "dmx", "djr", "dltest", "dav", "dtr", "demb", "dlavg", "ddht", "dwire")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Delete the labs of earlier runs that were killed (a timeout, a lost machine).

    Labs whose creating process still lives are kept. Hundreds of stale
    namespaces once made a CI run's NAT matrix fail, so this runs before anything.
    """
    if os.geteuid() != 0:
        return
    from nat.lab import cleanup_stale

    for prefix in LAB_PREFIXES:
        cleanup_stale(prefix)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (torch, the packages, every test module: ~300,000 objects), as
    the commands do once their peer is up (:func:`p2p.collector.settle`): the full collections of
    a worker's later tests, whose peers and tensors are in-process, then skip it (test_averaging.py
    alone: 6.1 -> 2.9-3.1 s of its 66 s of CPU in full collections)."""
    from p2p.collector import settle

    settle()


def loopback_config(**overrides: Any) -> NodeConfig:
    settings: dict[str, Any] = {"listen": [LOOPBACK4], "bootstrap_timeout": 10.0, "dial_timeout": 5.0}
    settings.update(overrides)
    return NodeConfig(**settings)


@asynccontextmanager
async def open_nodes(n: int, **overrides: Any) -> AsyncIterator[list[Node]]:
    async with AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(Node.open(loopback_config(**overrides))) for _ in range(n)]
        yield nodes


@pytest.fixture
def make_config() -> Callable[..., NodeConfig]:
    return loopback_config


@pytest.fixture
async def node_pair() -> AsyncIterator[tuple[Node, Node]]:
    async with open_nodes(2) as (a, b):
        await b.connect(a.addrs[0])
        yield a, b


@pytest.fixture(scope="module")
def forks(request: pytest.FixtureRequest) -> Iterator[Forks]:
    """A fork server for the module's processes (p2p/forkserver.py, tests/forks.py): ``python_m`` starts them
    from it. Preloads the module's ``FORKS_PRELOAD`` (by default what NAT agents and relays import).

    Module-scoped, so the children's CPU is counted (as the server's, when it is reaped) in the
    module's last test rather than at the end of the session."""
    preload = getattr(request.module, "FORKS_PRELOAD", NAT)
    with suite_forks(*preload) as server, pytest.MonkeyPatch.context() as patch:
        patch.setenv(FORKS_ENV, server.path)
        yield server
