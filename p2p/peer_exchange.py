"""Peer exchange: learn the swarm's other members from the peers already known.

A newcomer knows only its initial peers. Until the DHT lands, it asks them (and
then everyone it meets) for the peers they are connected to, and dials those, while
it holds fewer connections than the connection manager keeps (:meth:`PeerExchange.wants_more`).
Answers are untrusted input: the counts are capped, unparsable entries are
skipped, and a peer can only make us dial addresses, never lose state.

The rounds slow down while they learn nothing (:func:`next_wait`): a swarm whose
members all know each other asked each of them every interval forever (on a
loopback swarm of n peers, n² asks a second, each ranking every address of every
connection). A round comes at once again when a peer connects to us, and at the
interval while some peer we learnt of could not be reached.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from . import events as ev
from .addresses import rank_for_dial, with_peer_id
from .dialer import live_connection
from .errors import DedlocError
from .hooks import Registration
from .node import Node
from .proto.peer_exchange_pb2 import Ack, Greeting, PeerRecord, PeersRequest, PeersResponse
from .rpc import CallContext, RpcError
from .untrusted import decode_addrs, decode_peer_id

log = logging.getLogger(__name__)

PEERS_METHOD = "px.peers"
GREET_METHOD = "px.greet"
MAX_PEERS = 64
MAX_ADDRS_PER_PEER = 8
#: one dial of a peer learnt through the exchange (all its addresses racing)
DIAL_TIMEOUT = 15.0
MAX_GREETING = 280
#: the longest wait between rounds, in intervals (each quiet round doubles the wait up to it)
MAX_BACKOFF = 16


def next_wait(interval: float, quiet_rounds: int) -> float:
    """Seconds until the next round after ``quiet_rounds`` rounds in a row that met nobody new, left
    no learnt peer unreached and saw no new connection: ``interval``, doubling with each quiet round,
    at most :data:`MAX_BACKOFF` intervals."""
    return interval * min(1 << min(max(quiet_rounds, 0), 8), MAX_BACKOFF)


class PeerExchange:
    """Serves ``px.peers`` / ``px.greet`` and, with :meth:`run`, keeps meeting peers."""

    def __init__(self, node: Node, *, greeting: str | None = None, max_peers: int = MAX_PEERS):
        self.node = node
        self.greeting = greeting
        self.max_peers = max_peers
        self._greeted: set[ID] = set()

    @classmethod
    @asynccontextmanager
    async def open(cls, node: Node, *, greeting: str | None = None, interval: float | None = None,
                   max_peers: int = MAX_PEERS) -> AsyncIterator[PeerExchange]:
        """Serve peer exchange for the block; with ``interval``, also meet peers every ``interval`` seconds.

        The loop runs in the block's own nursery and the RPC methods are removed on exit.
        """
        exchange = cls(node, greeting=greeting, max_peers=max_peers)
        with exchange.serve():
            async with trio.open_nursery() as nursery:
                if interval is not None:
                    nursery.start_soon(exchange.run, interval)
                try:
                    yield exchange
                finally:
                    nursery.cancel_scope.cancel()

    def serve(self) -> Registration:
        """Answer ``px.peers`` and ``px.greet`` until the handle is removed."""
        self.node.rpc.add_unary(PEERS_METHOD, PeersRequest, self._handle_peers)
        self.node.rpc.add_unary(GREET_METHOD, Greeting, self._handle_greet)

        def undo() -> None:
            self.node.rpc.remove(PEERS_METHOD)
            self.node.rpc.remove(GREET_METHOD)

        return Registration(undo)

    async def _handle_peers(self, request: PeersRequest, ctx: CallContext) -> PeersResponse:
        limit = min(request.limit or self.max_peers, self.max_peers)
        records = []
        for pid in self.node.connected_peers():
            if pid == ctx.peer_id:
                continue
            # direct addresses first, then relayed ones: a peer behind a NAT that maps nothing is
            # reachable only through its relay slot, and without that address two such peers never meet
            addrs = rank_for_dial(self.node.known_addrs(pid))[:MAX_ADDRS_PER_PEER]
            if addrs:
                records.append(PeerRecord(peer_id=pid.to_bytes(), addrs=[a.to_bytes() for a in addrs]))
        random.shuffle(records)
        return PeersResponse(peers=records[:limit])

    async def _handle_greet(self, request: Greeting, ctx: CallContext) -> Ack:
        self.node.emit(ev.Message(peer_id=ctx.peer_id, text=request.text[:MAX_GREETING]))
        return Ack()

    async def ask(self, peer_id: ID, *, timeout: float = 10.0) -> list[tuple[ID, list[Multiaddr]]]:
        """The peers ``peer_id`` knows, parsed and capped; bad entries are dropped."""
        response = await self.node.rpc.call(peer_id, PEERS_METHOD, PeersRequest(limit=self.max_peers), PeersResponse, timeout=timeout)
        found = []
        for record in response.peers[: self.max_peers]:
            pid = decode_peer_id(bytes(record.peer_id))
            addrs = decode_addrs(record.addrs, limit=MAX_ADDRS_PER_PEER)
            if pid is None or len(addrs) < min(len(record.addrs), MAX_ADDRS_PER_PEER):
                log.debug("skipping a malformed peer record from %s", peer_id)
                continue
            if pid != self.node.peer_id and addrs:
                found.append((pid, addrs))
        return found

    async def greet(self, peer_id: ID, text: str, *, timeout: float = 10.0) -> None:
        await self.node.rpc.call(peer_id, GREET_METHOD, Greeting(text=text[:MAX_GREETING]), Ack, timeout=timeout)

    async def exchange_once(self) -> int:
        """Ask every connected peer for more peers, dial the new ones; return how many."""
        met, _ = await self._exchange()
        return met

    def wants_more(self) -> bool:
        """Whether to meet more peers: while we are connected to fewer than the connection manager
        keeps (its low water). Past it a peer met would only be trimmed again, and the next round
        would dial it again; and with no bound a swarm of thousands was dialed whole, each round
        dialing every peer learnt of that we held no connection to."""
        manager = self.node.config.connections
        return not manager.enabled or len(self.node.connected_peers()) < manager.low_water

    async def _exchange(self) -> tuple[int, int]:
        """One round: (peers met, peers learnt of that could not be reached). The peers connected
        already are greeted first: a dial to a peer learnt of can take its whole ``DIAL_TIMEOUT``,
        and the demo's public peer greeted the swarm 5.5 s late behind one (its mesh formed so)."""
        await self._greet_new()
        new = unreached = 0
        for peer in self.node.connected_peers():
            if not self.wants_more():
                break
            try:
                found = await self.ask(peer)
            except (RpcError, DedlocError, trio.TooSlowError) as e:
                log.debug("peer exchange with %s failed: %s", peer, e)
                continue
            for pid, addrs in found:
                if not self.wants_more():
                    break
                if live_connection(self.node.network, pid) is not None:
                    continue
                try:  # every address it gave, best first (they race: direct ones, then relayed)
                    await self.node.connect(rank_for_dial(with_peer_id(a, pid) for a in addrs), timeout=DIAL_TIMEOUT)
                    new += 1
                except DedlocError as e:
                    unreached += 1
                    log.debug("could not reach %s learnt from %s: %s", pid, peer, e)
        await self._greet_new()  # and those the round met
        return new, unreached

    async def _greet_new(self) -> None:
        """Greet each connected peer not greeted yet (once: a refusal is not retried)."""
        if self.greeting is None:
            return
        for peer in self.node.connected_peers():
            if peer not in self._greeted:
                self._greeted.add(peer)
                try:
                    await self.greet(peer, self.greeting)
                except (RpcError, DedlocError, trio.TooSlowError) as e:
                    log.debug("greeting %s failed: %s", peer, e)

    async def run(self, interval: float) -> None:
        """Exchange peers forever (give it a nursery): every ``interval`` seconds while rounds meet
        someone, slower while they do not (:func:`next_wait`), at once when a peer connects to us."""
        quiet = 0
        seen: set[ID] = set()
        while True:
            fresh = self._someone_new(seen)
            met, unreached = await self._exchange()
            seen = set(self.node.connected_peers())
            quiet = 0 if fresh or met or unreached else quiet + 1
            await self._wait(next_wait(interval, quiet), interval, seen)

    async def _wait(self, seconds: float, interval: float, seen: set[ID]) -> None:
        """Sleep ``seconds``, looking every ``interval`` for a peer that connected meanwhile (it is
        greeted and asked at once, not after a long quiet wait)."""
        deadline = trio.current_time() + seconds
        while (left := deadline - trio.current_time()) > 0:
            await trio.sleep(min(interval, left))
            if self._someone_new(seen):
                return

    def _someone_new(self, seen: set[ID]) -> bool:
        """Whether a peer not in ``seen`` is connected now."""
        return any(p not in seen for p in self.node.connected_peers())
