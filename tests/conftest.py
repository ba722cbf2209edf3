"""Shared fixtures: real Nodes on loopback, nothing mocked."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest

from p2p import Node, NodeConfig

LOOPBACK4 = "/ip4/127.0.0.1/tcp/0"
LOOPBACK6 = "/ip6/::1/tcp/0"

# py-libp2p logs each failed dial at ERROR; tests that provoke failures on purpose
# would drown the report in them.
logging.getLogger("libp2p").setLevel(logging.CRITICAL)


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
