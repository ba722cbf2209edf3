"""An RPC endpoint: the methods this peer serves, and calls to other peers' methods.

The Node owns one, gives it a way to open streams, and routes the RPC
protocol's inbound streams to :meth:`Rpc.handle_stream`. The endpoint holds no
tasks of its own: a served call lives in the task py-libp2p starts for its
stream, a client call in the caller's task, so cancelling either side's scope
ends the call, and resets its stream, right away. A stream carries one call
at a time; after a call that went well the client keeps it for the next call
to the same peer (see :mod:`p2p.rpc.pool` for why).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import trio
from google.protobuf.message import Message as ProtoMessage
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from .client import StreamCall, deadline_ms, receive_unary, serialize
from .errors import (
    BUILTIN_ERRORS,
    FIRST_APPLICATION_CODE,
    PeerDisconnectedError,
    PeerUnreachableError,
    RemoteError,
    RpcTimeoutError,
)
from .framing import END_FRAME, encode_call, message_header
from .pool import StreamPool
from .server import (SERVER_IDLE_TIMEOUT, Admit, Method, StreamHandler, UnaryHandler, counted, serve, stream_method,
                     unary_method)
from .stream import FramedStream, RpcStream

#: The libp2p protocol id of the RPC layer; one call at a time per stream.
RPC_PROTOCOL = "/dedloc/rpc/1.0.0"

OpenStream = Callable[[ID, str], Awaitable[RpcStream]]

Req = TypeVar("Req", bound=ProtoMessage)
Resp = TypeVar("Resp", bound=ProtoMessage)


class Rpc:
    """Serve and call methods over ``/dedloc/rpc/1.0.0``.

    ``open_stream(peer_id, protocol)`` opens a stream speaking ``protocol``,
    dialing if needed (the Node's ``new_stream``). ``max_message_size`` bounds
    every request and response, both ways; ``default_timeout`` is the deadline
    of calls that set none, and the server's bound for a peer that names none.
    Up to ``max_idle_streams`` streams per peer are kept ``idle_timeout`` seconds
    for reuse (0 turns reuse off); servers keep them longer, 60 s.
    """

    def __init__(
        self,
        open_stream: OpenStream,
        *,
        max_message_size: int = 4 * 1024 * 1024,
        default_timeout: float = 30.0,
        idle_timeout: float = 10.0,
        max_idle_streams: int = 16,
        admit: Admit | None = None,
    ):
        if max_message_size <= 0:
            raise ValueError(f"max_message_size must be positive, got {max_message_size}")
        if default_timeout <= 0:
            raise ValueError(f"default_timeout must be positive, got {default_timeout}")
        if not 0 <= idle_timeout <= SERVER_IDLE_TIMEOUT / 2:
            # Well below the server's, or a call could race the server closing the stream.
            raise ValueError(f"idle_timeout must be within [0, {SERVER_IDLE_TIMEOUT / 2:g}] s, got {idle_timeout}")
        if max_idle_streams < 0:
            raise ValueError(f"max_idle_streams must be >= 0, got {max_idle_streams}")
        self._open_stream = open_stream
        #: Asked before each call is served (the node's request rates); raises to refuse it.
        self.admit = admit
        self.max_message_size = max_message_size
        self.default_timeout = default_timeout
        self._methods: dict[str, Method] = {}
        self._errors: dict[int, type[RemoteError]] = dict(BUILTIN_ERRORS)
        self._pool = StreamPool(idle_timeout=idle_timeout, max_idle_per_peer=max_idle_streams)
        #: calls in flight by peer, both ways (:meth:`in_flight`)
        self._busy: Counter[ID] = Counter()

    # ------------------------------------------------------------------ serving

    def add_unary(self, method: str, request_type: type[Req], handler: UnaryHandler[Req]) -> None:
        """Serve ``method``: ``await handler(request, ctx)`` returns the one response.

        The handler runs under the caller's deadline; an exception it raises
        reaches the caller as :class:`HandlerError`, except a :class:`RemoteError`
        with an application code, which reaches it as itself.
        """
        self._add(unary_method(method, request_type, handler))

    def add_stream(self, method: str, request_type: type[Req], handler: StreamHandler[Req]) -> None:
        """Serve ``method`` as a stream: ``handler(requests, ctx)`` is an async generator
        that reads requests as it needs them and yields responses."""
        self._add(stream_method(method, request_type, handler))

    def remove(self, method: str) -> None:
        """Stop serving ``method``; calls in progress finish."""
        self._methods.pop(method, None)

    @property
    def methods(self) -> list[str]:
        return sorted(self._methods)

    def _add(self, method: Method) -> None:
        if not method.name:
            raise ValueError("a method needs a name")
        if method.name in self._methods:
            raise ValueError(f"method {method.name!r} is already served")
        self._methods[method.name] = method

    def register_error(self, error_type: type[RemoteError]) -> None:
        """Make errors with ``error_type.code`` from peers come back as ``error_type``.

        ``error_type`` is built like :class:`RemoteError`: ``(message, code=, peer_id=)``.
        """
        if error_type.code < FIRST_APPLICATION_CODE:
            raise ValueError(f"application error codes start at {FIRST_APPLICATION_CODE}, got {error_type.code}")
        known = self._errors.get(error_type.code)
        if known is not None and known is not error_type:
            raise ValueError(f"code {error_type.code} is already {known.__name__}'s")
        self._errors[error_type.code] = error_type

    async def handle_stream(self, stream: INetStream) -> None:
        """The stream handler of :data:`RPC_PROTOCOL`; never raises."""
        await self.serve_stream(stream, stream.muxed_conn.peer_id)

    async def serve_stream(self, stream: RpcStream, peer_id: ID) -> None:
        """Serve the calls on any byte stream from ``peer_id`` (what tests use); never raises."""
        await serve(
            stream,
            peer_id,
            self._methods,
            max_message_size=self.max_message_size,
            default_timeout=self.default_timeout,
            admit=self.admit,
            busy=self._busy,
        )

    # ------------------------------------------------------------------ calling

    async def call(
        self,
        peer_id: ID,
        method: str,
        request: ProtoMessage,
        response_type: type[Resp],
        *,
        timeout: float | None = None,
    ) -> Resp:
        """Call a unary method and return its response.

        Raises :class:`RpcTimeoutError` once ``timeout`` (default: ``default_timeout``)
        has passed, counting the stream's opening; the peer's errors as their
        :class:`RemoteError` types; :class:`PeerUnreachableError` when no stream
        could be opened and :class:`PeerDisconnectedError` when it broke.
        """
        payload = serialize(request, self.max_message_size, "request")
        timeout, deadline = self._deadline(timeout)
        framed: FramedStream | None = None
        try:
            with trio.move_on_at(deadline), counted(self._busy, peer_id):
                framed = await self._begin(peer_id, method, deadline, message_header(len(payload)), payload, END_FRAME)
                response = await receive_unary(framed, response_type, self._errors)
                released, framed = framed, None
                await self._release(released)
                return response
            raise RpcTimeoutError(f"{method} on {peer_id} did not answer within {timeout:.3g}s")
        except PeerDisconnectedError:
            self._pool.forget(peer_id)  # its other streams likely went down with it
            raise
        finally:
            if framed is not None:
                await framed.abort()  # a no-op once released

    @asynccontextmanager
    async def open_stream_call(
        self,
        peer_id: ID,
        method: str,
        response_type: type[Resp],
        *,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamCall[Resp]]:
        """Start a streaming call; leaving the block ends it (a reset, if the server had not).

        ``timeout`` bounds the whole call, from opening the stream to the last
        response; each operation on the call raises :class:`RpcTimeoutError` after it.
        """
        timeout, deadline = self._deadline(timeout)
        framed: FramedStream | None = None
        try:
            with counted(self._busy, peer_id):
                with trio.move_on_at(deadline):
                    framed = await self._begin(peer_id, method, deadline)
                if framed is None:
                    raise RpcTimeoutError(f"{method} on {peer_id}: no stream within {timeout:.3g}s")
                call = StreamCall(framed, method, response_type, deadline, self._errors, self.max_message_size)
                yield call
                if await call.finish():
                    released, framed = framed, None
                    await self._release(released)
        except PeerDisconnectedError:
            self._pool.forget(peer_id)
            raise
        finally:
            if framed is not None:
                await framed.abort()

    def in_flight(self, peer_id: ID) -> int:
        """Calls to or from ``peer_id`` under way now (a pooled stream waiting for the next is none)."""
        return self._busy[peer_id]

    async def close_idle_streams(self, *, expired_only: bool = True) -> None:
        """Close the streams kept for reuse (only those idle too long, by default).

        Streams are tidied as calls go, peer by peer; a periodic call of this
        closes those to peers no longer called.
        """
        await self._pool.close(expired_only=expired_only)

    def forget_peer(self, peer_id: ID) -> None:
        """Drop the idle streams to a peer whose connection closed."""
        self._pool.forget(peer_id)

    async def _begin(self, peer_id: ID, method: str, deadline: float, *parts: bytes) -> FramedStream:
        """A stream to ``peer_id`` with the call frame and ``parts`` written: an idle one if any.

        An idle stream whose write fails (its connection died, the server
        timed it out) never delivered the call, so a new stream gets it.
        """
        while True:
            framed = await self._pool.take(peer_id)
            pooled = framed is not None
            if framed is None:
                framed = await self._open(peer_id)
            try:
                await framed.write(encode_call(method, deadline_ms(deadline)), *parts)
                return framed
            except PeerDisconnectedError:
                if not pooled:
                    raise
                self._pool.forget(peer_id)
            finally:
                if framed.broken is not None or framed.desynced:
                    await framed.abort()

    async def _release(self, framed: FramedStream) -> None:
        """After a call that ended cleanly: keep the stream for the next call, or close it."""
        if self._pool.give(framed):
            return
        try:
            await framed.close()
        finally:
            await framed.abort()  # a no-op unless closing failed

    def _deadline(self, timeout: float | None) -> tuple[float, float]:
        if timeout is None:
            timeout = self.default_timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        return timeout, trio.current_time() + timeout

    async def _open(self, peer_id: ID) -> FramedStream:
        try:
            stream = await self._open_stream(peer_id, RPC_PROTOCOL)
        except Exception as e:
            raise PeerUnreachableError(f"cannot open an RPC stream to {peer_id}: {e}") from e
        return FramedStream(stream, peer_id, self.max_message_size)
