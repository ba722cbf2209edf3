"""Serving the calls on one stream, so that whatever a peer sends stays within that stream.

:func:`serve` never raises (except ``Cancelled``): a bad frame, an unknown method,
a slow or failing handler or a vanished peer each end their own stream, with an
error frame where the peer can still read one, and leave every other call alone.
A call that went well leaves the stream open for the client's next one.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio
from google.protobuf.message import Message as ProtoMessage
from libp2p.peer.id import ID

from . import rpc_pb2
from .errors import (
    FIRST_APPLICATION_CODE,
    DeadlineExceededError,
    HandlerError,
    InvalidMessageError,
    MessageTooLargeError,
    PeerDisconnectedError,
    RemoteError,
    ResourceLimitError,
    RpcError,
    UnknownMethodError,
)
from ..errors import DedlocError
from .framing import END_FRAME, Decoded, Payload, encode_error, message_header, parse_message
from .stream import CLEANUP_TIMEOUT, FramedStream, RpcStream

log = logging.getLogger(__name__)

#: How long a server keeps an idle stream open for the client's next call.
#: Clients reuse a stream for a shorter time (see ``Rpc.idle_timeout``), so that
#: a call never races the server closing the stream under it.
SERVER_IDLE_TIMEOUT = 60.0

Req = TypeVar("Req", bound=ProtoMessage)


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a handler knows of its call besides the request(s)."""

    peer_id: ID
    method: str
    #: On trio's clock; the handler already runs under it, this is for passing it on.
    deadline: float

    @property
    def remaining(self) -> float:
        """Seconds left until the deadline (0 once it passed): the budget for nested calls."""
        return max(0.0, self.deadline - trio.current_time())


#: Asked before a call is served, with the caller and the method; what it raises (a
#: ``p2p.resources.ResourceLimitExceeded``) refuses the call with :class:`ResourceLimitError`.
Admit = Callable[[ID, str], None]

UnaryHandler = Callable[[Req, CallContext], Awaitable[ProtoMessage]]
StreamHandler = Callable[[AsyncIterator[Req], CallContext], AsyncIterator[ProtoMessage]]


@dataclass(frozen=True, slots=True)
class Method:
    """A registered method; unary ones are adapted to the streaming form."""

    name: str
    request_type: type[ProtoMessage]
    respond: Callable[[Requests[Any], CallContext], AsyncIterator[ProtoMessage]]


def unary_method(name: str, request_type: type[Req], handler: UnaryHandler[Req]) -> Method:
    async def respond(requests: Requests[Req], ctx: CallContext) -> AsyncIterator[ProtoMessage]:
        yield await handler(await requests.single(), ctx)

    return Method(name, request_type, respond)


def stream_method(name: str, request_type: type[Req], handler: StreamHandler[Req]) -> Method:
    return Method(name, request_type, handler)


class Requests(Generic[Req]):
    """The requests of one call, parsed as they are read; what a stream handler iterates.

    A failure here is the client's doing; it is kept in :attr:`failure` so that the
    server answers for it even if the handler catches the exception.
    """

    def __init__(self, framed: FramedStream, request_type: type[Req]):
        self._framed = framed
        self._type = request_type
        #: Set when the client sent its end marker: no more requests.
        self.ended = trio.Event()
        self.failure: RpcError | None = None

    def __aiter__(self) -> Requests[Req]:
        return self

    async def __anext__(self) -> Req:
        if self.ended.is_set():
            raise StopAsyncIteration
        if self.failure is not None:
            raise self.failure
        try:
            frame = await self._framed.read_frame()
        except RpcError as e:
            self.failure = e
            raise
        if isinstance(frame, Payload):
            try:
                return parse_message(self._type, frame.data, "request")
            except InvalidMessageError as e:
                raise self._fail(e) from None
        if isinstance(frame, rpc_pb2.End):
            self.ended.set()
            raise StopAsyncIteration
        if frame is None:
            raise self._fail(PeerDisconnectedError(f"{self._framed.peer_id} ended the stream before its requests"))
        raise self._fail(InvalidMessageError(f"unexpected {type(frame).__name__} frame among the requests"))

    async def single(self) -> Req:
        """The one request of a unary call, after checking that no second one follows."""
        try:
            request = await self.__anext__()
        except StopAsyncIteration:
            raise self._fail(InvalidMessageError("unary call without a request")) from None
        try:
            await self.__anext__()
        except StopAsyncIteration:
            return request
        raise self._fail(InvalidMessageError("unary call with more than one request"))

    async def skip_rest(self) -> None:
        """Read past the remaining requests, unparsed, up to the client's end marker."""
        while not self.ended.is_set() and self.failure is None:
            frame = await self._framed.read_frame()
            if isinstance(frame, rpc_pb2.End):
                self.ended.set()
            elif not isinstance(frame, Payload):
                raise self._fail(InvalidMessageError("unexpected frame among the requests"))

    def _fail(self, error: RpcError) -> RpcError:
        self.failure = error
        return error


@contextmanager
def counted(calls: Counter[ID] | None, peer_id: ID) -> Iterator[None]:
    """Count a call in ``calls`` (by peer) for the block: the calls in flight, what the connection
    manager reads so as never to close a connection under one (``Rpc.in_flight``)."""
    if calls is None:
        yield
        return
    calls[peer_id] += 1
    try:
        yield
    finally:
        calls[peer_id] -= 1
        if calls[peer_id] <= 0:
            del calls[peer_id]


async def serve(
    stream: RpcStream,
    peer_id: ID,
    methods: Mapping[str, Method],
    *,
    max_message_size: int,
    default_timeout: float,
    idle_timeout: float = SERVER_IDLE_TIMEOUT,
    admit: Admit | None = None,
    busy: Counter[ID] | None = None,
) -> None:
    """Serve the calls ``peer_id`` makes on ``stream``, one after the other, then end it. ``busy``
    counts the calls being handled, by peer (a stream waiting for its next call is idle)."""
    framed = FramedStream(stream, peer_id, max_message_size)
    try:
        # Until a call frame names a deadline, the default one bounds the wait.
        wait = default_timeout
        while await _serve_call(framed, methods, max_message_size, default_timeout, wait, idle_timeout, admit, busy):
            wait = idle_timeout
    except Exception:
        log.exception("RPC server failed on a stream from %s", peer_id)
    finally:
        await framed.abort()  # a no-op after a clean close


class _Watcher:
    """Notices a client that gives up while its handler runs, by reading the stream.

    Once its requests are in, a client only waits; anything it does before the
    answer (a reset, a close, another frame) means it gave up, and the handler
    is cancelled. py-libp2p's yamux reports a reset as a plain EOF, which is why
    the protocol has the client keep its side open. The read is never cancelled
    while the stream may carry another call: what it brings after the answer is
    the next call, and stays buffered for it.
    """

    def __init__(self, framed: FramedStream, requests: Requests[Any], handler_scope: trio.CancelScope):
        self._framed = framed
        self._requests = requests
        self._handler_scope = handler_scope
        self.answered = False
        self.abandoned = False
        self.reading = False
        #: After the answer: True if the next call began arriving, False if the client ended the stream.
        self.more: bool | None = None
        self.done = trio.Event()

    async def run(self) -> None:
        try:
            await self._requests.ended.wait()
            if self.answered:
                return
            self.reading = True
            try:
                more = await self._framed.fill()
            except RpcError:
                more = False
            self.reading = False
            if self.answered:
                self.more = more
            else:
                self.abandoned = True
                self._handler_scope.cancel()
        finally:
            self.done.set()


async def _serve_call(
    framed: FramedStream,
    methods: Mapping[str, Method],
    max_message_size: int,
    default_timeout: float,
    wait: float,
    idle_timeout: float,
    admit: Admit | None = None,
    busy: Counter[ID] | None = None,
) -> bool:
    """Serve the next call on the stream; True when the stream is ready for another."""
    peer_id = framed.peer_id
    first: Decoded | None = None
    with trio.move_on_after(wait) as waiting:
        try:
            first = await framed.read_frame()
        except PeerDisconnectedError:
            return False
        except RemoteError as e:
            await _refuse(framed, e)
            return False
    if waiting.cancelled_caught:
        # Reset, not close: a client that picks the stream up now fails on its
        # first write, which it knows is safe to retry on a new stream.
        return False
    if first is None:  # the client ended the stream
        await framed.close()
        return False
    if not isinstance(first, rpc_pb2.Call):
        await _refuse(framed, InvalidMessageError(f"expected a call frame, got a {type(first).__name__}"))
        return False

    budget = first.deadline_ms / 1000 if first.deadline_ms else default_timeout
    deadline = trio.current_time() + budget
    method = methods.get(first.method)
    if method is None:
        await _reply_error(framed, UnknownMethodError(f"no method {first.method!r}"), deadline)
        return False
    if admit is not None:
        try:
            admit(peer_id, method.name)
        except DedlocError as e:
            await _reply_error(framed, ResourceLimitError(f"{method.name} refused: {e}"), deadline)
            return False

    ctx = CallContext(peer_id, method.name, deadline)
    requests: Requests[Any] = Requests(framed, method.request_type)
    handler_scope = trio.CancelScope()
    watcher = _Watcher(framed, requests, handler_scope)
    reply: RemoteError | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watcher.run)
        with trio.move_on_at(deadline) as timer, handler_scope, counted(busy, peer_id):
            reply = await _respond(framed, method, requests, ctx, max_message_size, watcher)
        watcher.answered = True
        answered_well = not timer.cancelled_caught and reply is None and framed.broken is None
        if watcher.reading and answered_well and not watcher.abandoned:
            # Its pending read is the wait for the next call; cancelling it could
            # lose that call's first bytes, so only the idle limit may.
            with trio.move_on_after(idle_timeout):
                await watcher.done.wait()
        nursery.cancel_scope.cancel()

    if framed.broken is not None or watcher.abandoned:
        log.debug("%s went away during %s", peer_id, method.name)
        return False
    failure = requests.failure
    if failure is not None:
        if isinstance(failure, PeerDisconnectedError):
            log.debug("%s went away during %s: %s", peer_id, method.name, failure)
        elif isinstance(failure, MessageTooLargeError):
            await _reply_error(framed, failure, deadline)
        elif isinstance(failure, RemoteError):
            await _refuse(framed, failure)
        return False
    if timer.cancelled_caught:
        await _reply_error(
            framed, DeadlineExceededError(f"{method.name} did not finish within {budget:.3g}s"), deadline
        )
        return False
    if reply is not None:
        await _reply_error(framed, reply, deadline)
        return False
    if watcher.more is False:  # the client took the answer and ended the stream
        await framed.close()
        return False
    if not requests.ended.is_set():
        # The handler stopped reading early: skip the client's remaining requests
        # up to its end marker, where the next call may start.
        with trio.move_on_at(deadline + CLEANUP_TIMEOUT):
            try:
                await requests.skip_rest()
            except RpcError:
                pass
        if not requests.ended.is_set():
            return False
    return not framed.desynced


async def _respond(
    framed: FramedStream,
    method: Method,
    requests: Requests[Any],
    ctx: CallContext,
    max_message_size: int,
    watcher: _Watcher,
) -> RemoteError | None:
    """Run the handler and send what it yields, then the end marker; or say what went wrong."""
    try:
        responses = method.respond(requests, ctx)
        try:
            async for response in responses:
                if not isinstance(response, ProtoMessage):
                    return HandlerError(f"{method.name} answered with a {type(response).__name__}, not a message")
                payload = response.SerializeToString()
                if len(payload) > max_message_size:
                    return MessageTooLargeError(
                        f"response of {len(payload)} bytes is over the limit of {max_message_size}"
                    )
                await framed.write(message_header(len(payload)), payload)
        finally:
            aclose = getattr(responses, "aclose", None)
            if aclose is not None:
                await aclose()
        # From the moment the end marker may reach the client, what the client
        # sends is its next call, not a sign that it gave up.
        watcher.answered = True
        await framed.write(END_FRAME)
    except Exception as e:
        if isinstance(e, RemoteError) and e.code >= FIRST_APPLICATION_CODE:
            return e
        if framed.broken is None and requests.failure is None:
            log.warning("handler of %s failed on a call from %s", method.name, ctx.peer_id, exc_info=e)
        return HandlerError(f"{method.name} failed: {type(e).__name__}: {e}")
    return None


async def _reply_error(framed: FramedStream, error: RemoteError, deadline: float) -> None:
    """Send ``error``, then drain until the client ends the stream, so that it can read it."""
    with trio.move_on_after(CLEANUP_TIMEOUT):
        try:
            await framed.write(encode_error(error.code, error.message))
        except PeerDisconnectedError:
            return
    if await framed.drain(max(deadline, trio.current_time()) + CLEANUP_TIMEOUT):
        await framed.close()


async def _refuse(framed: FramedStream, error: RemoteError) -> None:
    """Answer bytes that are not our protocol: the error, then FIN and reset.

    FIN before RST lets a libp2p peer still read the error frame; the reset
    stops it sending more garbage.
    """
    log.debug("refusing an RPC stream from %s: %s", framed.peer_id, error.message)
    with trio.move_on_after(CLEANUP_TIMEOUT):
        try:
            await framed.write(encode_error(error.code, error.message))
        except PeerDisconnectedError:
            return
        await framed.close()
    await framed.abort(after_close=True)
