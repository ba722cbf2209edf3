"""Expert servers on a swarm for the mixture-of-experts tests: the in-memory one, or real peers on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import torch
import trio

from nat import Peer
from training.moe import ExpertBackend, ExpertServer, ServerConfig
from training.moe.experts import FeedforwardBlock
from training.moe.grid import expand_pattern

from .fake_swarm import FakeNetwork
from .kit import loopback_peer_config

HID = 8


def backends(pattern: str, seed: int = 0, lr: float = 0.05, module: type[torch.nn.Module] = FeedforwardBlock
             ) -> list[ExpertBackend]:
    out = []
    for uid in expand_pattern(pattern):
        torch.manual_seed(seed + hash(uid.coords) % 1000)
        m = module(HID)
        out.append(ExpertBackend(str(uid), m, torch.optim.SGD(m.parameters(), lr=lr), (HID,)))
    return out


class HangingDHT:
    """A DHT whose reads never answer (a peer whose table holds only silent contacts)."""

    async def get_many(self, keys: list[Any], latest: bool = False, *, timeout: float | None = None) -> dict[Any, Any]:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


class Swarm:
    """Expert servers, one peer per pattern (each in its own task: killable), and a client peer: on the
    in-memory swarm (tests/fake_swarm.py: no socket, records at once) unless a test needs the real
    network (then a bootstrap relay and real peers on loopback)."""

    def __init__(self, network: FakeNetwork | None, boot: list[str]) -> None:
        self.network = network
        self.boot = boot
        self.peers: list[Any] = []
        self.servers: list[ExpertServer] = []
        self.scopes: list[trio.CancelScope] = []
        self.client: Any

    def kill(self, i: int) -> None:
        """Server i's peer closes at once (its records stay in the DHT until they expire)."""
        self.scopes[i].cancel()
        if self.network is not None:
            self.peers[i].kill()  # its streams reset, dials to it fail: as a peer that died

    @asynccontextmanager
    async def another_peer(self) -> AsyncIterator[Any]:
        """One more peer of the same swarm."""
        if self.network is not None:
            yield self.network.join()
            return
        async with Peer.open(loopback_peer_config(initial_peers=self.boot)) as peer:
            yield peer


@asynccontextmanager
async def swarm(*patterns: str | list[ExpertBackend], config: ServerConfig | None = None, real: bool = False
                ) -> AsyncIterator[Swarm]:
    """A server per pattern (a uid pattern served by :func:`backends`, or the backends themselves)."""
    async with AsyncExitStack() as stack:
        if real:
            relay = await stack.enter_async_context(Peer.open(loopback_peer_config(relay=True)))
            out = Swarm(None, [str(relay.addrs[0])])
        else:
            network_nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(network_nursery.cancel_scope.cancel)
            out = Swarm(FakeNetwork(network_nursery), [])
        # the client before the nursery: the nursery is cancelled first on the way out, and a peer closed
        # inside a cancelled nursery would raise Cancelled over a failed test's error, which the nursery
        # then absorbs (the test would pass)
        out.client = await stack.enter_async_context(out.another_peer())
        nursery = await stack.enter_async_context(trio.open_nursery())

        async def host(served: list[ExpertBackend], scope: trio.CancelScope, *,
                       task_status: Any) -> None:
            with scope:
                async with out.another_peer() as peer, ExpertServer.open(peer, served, config) as server:
                    task_status.started((peer, server))
                    await trio.sleep_forever()

        for pattern in patterns:
            scope = trio.CancelScope()
            served = backends(pattern) if isinstance(pattern, str) else pattern
            peer, server = await nursery.start(host, served, scope)
            out.peers.append(peer)
            out.servers.append(server)
            out.scopes.append(scope)
        try:
            yield out
        finally:
            nursery.cancel_scope.cancel()
