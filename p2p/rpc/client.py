"""The calling side: a unary call in one write and one read, streaming calls step by step.

Every step runs under the call's deadline; whatever ends a call early resets
its stream, which tells the server to stop working on it.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, ParamSpec, TypeVar

import trio
from google.protobuf.message import Message as ProtoMessage
from libp2p.peer.id import ID

from . import rpc_pb2
from .errors import (
    InvalidMessageError,
    MessageTooLargeError,
    PeerDisconnectedError,
    RemoteError,
    RpcError,
    RpcTimeoutError,
)
from .framing import END_FRAME, Decoded, Payload, message_header, parse_message
from .stream import FramedStream

Resp = TypeVar("Resp", bound=ProtoMessage)
T = TypeVar("T")
P = ParamSpec("P")


def serialize(message: ProtoMessage, max_message_size: int, what: str) -> bytes:
    """The message's bytes; refused here already when the peer would refuse them anyway."""
    if not isinstance(message, ProtoMessage):
        raise TypeError(f"{what} must be a protobuf message, got {type(message).__name__}")
    payload = message.SerializeToString()
    if len(payload) > max_message_size:
        raise MessageTooLargeError(f"{what} of {len(payload)} bytes is over max_message_size {max_message_size}")
    return payload


def deadline_ms(deadline: float) -> int:
    """What is left of ``deadline``, as the call frame carries it."""
    return max(1, math.ceil((deadline - trio.current_time()) * 1000))


def failure_of(frame: Decoded | None, framed: FramedStream, errors: Mapping[int, type[RemoteError]]) -> RpcError:
    """The exception for a frame that ends a call where a response was expected."""
    if isinstance(frame, rpc_pb2.Error):
        error_type = errors.get(frame.code, RemoteError)
        return error_type(frame.message, code=frame.code, peer_id=framed.peer_id)
    if frame is None:
        return PeerDisconnectedError(f"{framed.peer_id} closed the stream before ending the call")
    if isinstance(frame, rpc_pb2.End):
        return InvalidMessageError("the call ended without a response", peer_id=framed.peer_id)
    return InvalidMessageError(f"unexpected {type(frame).__name__} frame in the response", peer_id=framed.peer_id)


async def receive_unary(
    framed: FramedStream, response_type: type[Resp], errors: Mapping[int, type[RemoteError]]
) -> Resp:
    frame = await framed.read_frame()
    if not isinstance(frame, Payload):
        raise failure_of(frame, framed, errors)
    response = parse_message(response_type, frame.data, "response")
    frame = await framed.read_frame()
    if isinstance(frame, rpc_pb2.End):
        return response
    if isinstance(frame, Payload):
        raise InvalidMessageError("more than one response to a unary call", peer_id=framed.peer_id)
    raise failure_of(frame, framed, errors)


class StreamCall(Generic[Resp]):
    """A streaming call in progress: :meth:`send` requests, iterate for responses.

    Sending and receiving may happen in two tasks at once; with a single task,
    send everything before reading (or alternate), as the server's handler
    dictates. Any failure ends the call for good and is raised again by every
    later operation.
    """

    def __init__(
        self,
        framed: FramedStream,
        method: str,
        response_type: type[Resp],
        deadline: float,
        errors: Mapping[int, type[RemoteError]],
        max_message_size: int,
    ):
        self._framed = framed
        self.method = method
        self._type = response_type
        #: On trio's clock: every send and receive fails with RpcTimeoutError after it.
        self.deadline = deadline
        self._errors = errors
        self._max = max_message_size
        self._sent_end = False
        self._failure: RpcError | None = None
        #: The server sent its end marker: every response has been received.
        self.ended = False

    @property
    def peer_id(self) -> ID:
        return self._framed.peer_id

    async def send(self, request: ProtoMessage) -> None:
        """Send one request; raises the call's failure if it already ended badly."""
        self._check_open()
        if self._sent_end:
            raise RuntimeError(f"{self.method}: send() after done_sending()")
        payload = serialize(request, self._max, "request")
        await self._guarded(self._framed.write, message_header(len(payload)), payload)

    async def done_sending(self) -> None:
        """Tell the server no more requests follow (idempotent)."""
        if self._sent_end:
            return
        self._check_open()
        self._sent_end = True
        await self._guarded(self._framed.write, END_FRAME)

    def __aiter__(self) -> StreamCall[Resp]:
        return self

    async def __anext__(self) -> Resp:
        if self._failure is not None:
            raise self._failure
        if self.ended:
            raise StopAsyncIteration
        frame = await self._guarded(self._framed.read_frame)
        if isinstance(frame, Payload):
            try:
                return parse_message(self._type, frame.data, "response")
            except InvalidMessageError as e:
                raise self._fail(e) from None
        if isinstance(frame, rpc_pb2.End):
            self.ended = True
            raise StopAsyncIteration
        if frame is None:
            raise self._fail(PeerDisconnectedError(f"{self.peer_id} closed the stream without ending {self.method}"))
        raise self._fail(failure_of(frame, self._framed, self._errors))

    async def receive(self) -> Resp:
        """The next response; :class:`InvalidMessageError` if the server ended the call instead."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise InvalidMessageError(f"{self.method} ended without another response", peer_id=self.peer_id) from None

    async def finish(self) -> bool:
        """Wrap up after the caller's block; True if the stream is fit for another call.

        It is when the server ended the call and nothing failed; our end marker
        goes out now if the caller never sent it, so that both sides are in step.
        """
        if not self.ended or self._failure is not None:
            return False
        if not self._sent_end:
            self._sent_end = True
            try:
                await self._guarded(self._framed.write, END_FRAME)
            except RpcError:
                return False
        return self._framed.reusable

    def _check_open(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self.ended:
            raise RpcError(f"{self.method}: the server already ended the call")

    async def _guarded(self, operation: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        with trio.move_on_at(self.deadline):
            try:
                return await operation(*args, **kwargs)
            except RpcError as e:
                raise self._fail(e) from None
        raise self._fail(RpcTimeoutError(f"{self.method} on {self.peer_id} passed its deadline"))

    def _fail(self, error: RpcError) -> RpcError:
        if self._failure is None:
            self._failure = error
        return self._failure
