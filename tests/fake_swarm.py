"""An in-memory swarm: the :class:`nat.Swarm` interface without a socket, for the upper layers' tests.

:class:`FakeNetwork` holds the peers and one shared record store (a DHT that
every peer sees alike, at once); :class:`FakeSwarm` is one peer: a real
:class:`p2p.rpc.Rpc` endpoint over in-memory streams, stream handlers run in
the network's nursery (a failing handler resets its stream, as the Node's
do), reachability ``public``, and the events it emitted. A stream is a pair of
byte pipes with libp2p's end-of-stream and reset errors. :meth:`FakeSwarm.kill`
takes a peer off the network at once: its streams reset and dials to it fail,
as a peer that died mid-round.

It proves the interface is the narrow one the upper layers need
(``tests/test_fake_swarm.py`` runs matchmaking, all-reduce and training over
it), and it makes their tests quick: no handshakes, no DHT traversal.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.network.stream.exceptions import StreamClosed, StreamEOF, StreamReset
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.dht.records import KeyLike, ValueWithExpiration
from p2p.errors import DialError, ProtocolNotSupportedError
from p2p.events import Event
from p2p.hooks import ExternalAddresses, Reachability, Registration, SwarmObserver
from p2p.identity import new_identity, peer_id_of
from p2p.node import StreamHandler
from p2p.rpc import RPC_PROTOCOL, Rpc

from .kit import numbered_peer_id

log = logging.getLogger(__name__)

#: trio seconds a block of :func:`fake_swarms` may last (no test's scenario comes near)
DEADLINE = 600.0


class _Pipe:
    """Bytes one way, with end-of-stream and reset."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.eof = False
        self.reset = False
        self._changed = trio.Event()

    def wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def changed(self) -> None:
        await self._changed.wait()


class FakeStream:
    """One end of an in-memory stream, shaped as the libp2p stream the layers use."""

    def __init__(self, inbound: _Pipe, outbound: _Pipe, remote: ID, protocol: str) -> None:
        self._in, self._out = inbound, outbound
        self.muxed_conn = SimpleNamespace(peer_id=remote)
        self._protocol = protocol
        self._reset_here = False

    def get_protocol(self) -> str:
        return self._protocol

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        while True:
            # what the peer wrote before it reset the stream arrives first (as Yamux delivers it); a stream
            # reset here reads nothing more
            if self._reset_here or (self._in.reset and not self._in.buffer):
                raise StreamReset("the stream was reset")
            if self._in.buffer:
                size = len(self._in.buffer) if n is None or n < 0 else n
                data = bytes(self._in.buffer[:size])
                del self._in.buffer[:size]
                return data
            if self._in.eof:
                raise StreamEOF("the peer closed the stream")
            await self._in.changed()

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if self._out.reset:
            raise StreamReset("the stream was reset")
        if self._out.eof:
            raise StreamClosed("the stream is closed for writing")
        self._out.buffer += data
        self._out.wake()

    async def close(self) -> None:
        """Our end of writing (the peer reads to its end); reading goes on."""
        self._out.eof = True
        self._out.wake()

    async def reset(self) -> None:
        self._reset_here = True
        for pipe in (self._in, self._out):
            pipe.reset = True
            pipe.wake()


class FakeRecords:
    """The DHT as every peer of a :class:`FakeNetwork` sees it: one store, newest expiration wins."""

    def __init__(self) -> None:
        self._data: dict[KeyLike, dict[KeyLike | None, tuple[bytes, float]]] = {}
        self.stores = 0

    async def get(self, key: KeyLike, latest: bool = False, *,
                  timeout: float | None = None) -> ValueWithExpiration | None:
        await trio.lowlevel.checkpoint()
        now = time.time()
        entries = {sub: v for sub, v in self._data.get(key, {}).items() if v[1] > now}
        if not entries:
            return None
        if None in entries:
            value, expiration = entries[None]
            return ValueWithExpiration(value, expiration)
        found: dict[KeyLike, ValueWithExpiration] = {
            sub: ValueWithExpiration(v, e) for sub, (v, e) in entries.items() if sub is not None}
        return ValueWithExpiration(found, max(v.expiration for v in found.values()))

    async def get_many(self, keys: Iterable[KeyLike], latest: bool = False, *,
                       timeout: float | None = None) -> dict[KeyLike, ValueWithExpiration | None]:
        return {key: await self.get(key, latest, timeout=timeout) for key in keys}

    async def store(self, key: KeyLike, value: bytes, expiration: float, subkey: KeyLike | None = None,
                    *, timeout: float | None = None) -> bool:
        await trio.lowlevel.checkpoint()
        self.stores += 1
        entries = self._data.setdefault(key, {})
        old = entries.get(subkey)
        if old is not None and old[1] >= expiration:
            return False
        entries[subkey] = (value, expiration)
        return True


class FakeNetwork:
    """The peers and their shared records; handlers run in ``nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.peers: dict[ID, FakeSwarm] = {}
        self.records = FakeRecords()
        self._count = 0

    def join(self, identity: KeyPair | None = None) -> FakeSwarm:
        """A new peer: numbered (:func:`numbered_peer_id`), or with ``identity``'s id and signatures."""
        self._count += 1
        peer_id = numbered_peer_id(self._count) if identity is None else peer_id_of(identity)
        swarm = FakeSwarm(self, peer_id, Multiaddr(f"/ip4/127.0.0.1/tcp/{40000 + self._count}"), identity)
        self.peers[peer_id] = swarm
        return swarm


class FakeSwarm:
    """One peer of a :class:`FakeNetwork`: implements :class:`nat.Swarm`; with an identity, it signs as
    :class:`nat.Peer` does (what datasets need), and :meth:`path_to` says ``paths``' word or ``direct``."""

    def __init__(self, network: FakeNetwork, peer_id: ID, addr: Multiaddr, identity: KeyPair | None = None) -> None:
        self.network = network
        self.peer_id = peer_id
        self.identity = identity
        #: peer -> how we are connected to it, where not ``direct`` (:meth:`path_to`)
        self.paths: dict[ID, str] = {}
        self.addrs = [addr]
        self.dht = network.records
        self.external = ExternalAddresses(Reachability.PUBLIC, confirmed=(addr,), judged=True)
        self.handlers: dict[str, StreamHandler] = {}
        self.observers: list[SwarmObserver] = []
        self.events: list[Event] = []
        self.known: dict[ID, list[Multiaddr]] = {}
        #: protections held by peer (:meth:`protect`)
        self.protected: Counter[ID] = Counter()
        self.protections_made: list[tuple[ID, str]] = []
        self._streams: list[FakeStream] = []
        self.rpc = Rpc(self.new_stream)
        self.set_stream_handler(RPC_PROTOCOL, self.rpc.handle_stream)

    async def new_stream(self, peer_id: ID, protocol: str) -> Any:
        await trio.lowlevel.checkpoint()
        if self.peer_id not in self.network.peers:
            raise DialError(f"{self.peer_id} left the network")
        target = self.network.peers.get(peer_id)
        if target is None:
            raise DialError(f"no route to {peer_id}")
        handler = target.handlers.get(protocol)
        if handler is None:
            raise ProtocolNotSupportedError(f"{peer_id} does not speak {protocol}")
        there, back = _Pipe(), _Pipe()
        mine, theirs = FakeStream(back, there, peer_id, protocol), FakeStream(there, back, self.peer_id, protocol)
        self._streams.append(mine)
        target._streams.append(theirs)
        self.network.nursery.start_soon(target._serve, protocol, handler, theirs)
        return mine

    async def _serve(self, protocol: str, handler: StreamHandler, stream: FakeStream) -> None:
        try:
            await handler(stream)  # type: ignore[arg-type]
        except Exception as e:
            log.warning("handler for %s failed: %r", protocol, e)
            await stream.reset()

    def _key(self) -> KeyPair:
        if self.identity is None:
            raise TypeError("a numbered fake peer has no key: join the network with an identity")
        return self.identity

    @property
    def public_key(self) -> bytes:
        return bytes(self._key().public_key.serialize())

    def sign(self, data: bytes) -> bytes:
        return bytes(self._key().private_key.sign(data))

    def path_to(self, peer_id: ID) -> str:
        return self.paths.get(peer_id, "direct")

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> Registration:
        self.handlers[protocol] = handler

        def undo() -> None:
            if self.handlers.get(protocol) is handler:
                del self.handlers[protocol]

        return Registration(undo)

    def add_addrs(self, peer_id: ID, addrs: Sequence[Multiaddr]) -> None:
        self.known[peer_id] = list(addrs)

    def observe(self, observer: SwarmObserver) -> Registration:
        self.observers.append(observer)
        return Registration(lambda: self.observers.remove(observer))

    def protect(self, peer_id: ID, tag: str) -> Registration:
        """Nothing is ever trimmed here: the protection is only counted and logged (what a test may read)."""
        self.protected[peer_id] += 1
        self.protections_made.append((peer_id, tag))

        def undo() -> None:
            self.protected[peer_id] -= 1

        return Registration(undo)

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def kill(self) -> None:
        """Leave the network at once, as a peer that died: every stream of ours is reset, and what was
        in flight on them is lost (a stream reset by a living peer still delivers what it wrote first)."""
        self.network.peers.pop(self.peer_id, None)
        for stream in self._streams:
            stream._reset_here = True
            for pipe in (stream._in, stream._out):
                pipe.buffer.clear()  # its connections are gone with whatever was still in flight
                pipe.reset = True
                pipe.wake()


@asynccontextmanager
async def fake_swarms(n: int, *, signed: bool = False) -> AsyncIterator[list[FakeSwarm]]:
    """``n`` peers of a fresh :class:`FakeNetwork` whose handlers run in a nursery of their own (``signed``:
    each with a fresh identity).

    The block (the caller's code too) fails after :data:`DEADLINE` s of trio's clock: under the
    autojump clock a hang (a mutant's that lost a timeout) then fails at once, where it would
    otherwise sleep until pytest's timeout in real seconds.
    """
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            network = FakeNetwork(nursery)
            yield [network.join(new_identity() if signed else None) for _ in range(n)]
            nursery.cancel_scope.cancel()
