"""Fixtures for the js-libp2p interop tests: a js peer and one of our Nodes, both on 127.0.0.1."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

INTEROP_DIR = Path(__file__).resolve().parent
for _p in (INTEROP_DIR, INTEROP_DIR.parent):  # jspeer, and p2p when run from elsewhere
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from jspeer import JsPeer, js_unavailable_reason, open_js_peer  # noqa: E402
from p2p import Node, NodeConfig  # noqa: E402
from tests.conftest import forks  # noqa: E402,F401 - the fork server the NAT agents start from

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"


@pytest.fixture
def js_available() -> None:
    """Skips (with the reason) when node 22 or interop/node_modules are missing.

    Set DEDLOC_INTEROP_REQUIRED=1 (e.g. in CI, after setup.sh) to fail instead.
    A plain fixture: a skip raised inside a pytest-trio fixture loses its message.
    """
    reason = js_unavailable_reason()
    if reason is not None:
        if os.environ.get("DEDLOC_INTEROP_REQUIRED") == "1":
            pytest.fail(f"DEDLOC_INTEROP_REQUIRED=1 but {reason}")
        pytest.skip(reason)


@pytest.fixture
async def js(js_available: None) -> AsyncIterator[JsPeer]:
    """A js-libp2p peer (node 22) listening on 127.0.0.1; skips if setup.sh has not run."""
    async with open_js_peer() as peer:
        yield peer


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    """One of our Nodes with an ephemeral key, listening on 127.0.0.1 only."""
    config = NodeConfig(identity_path=None, listen=[LOOPBACK_LISTEN], initial_peers=[])
    async with Node.open(config) as n:
        yield n
