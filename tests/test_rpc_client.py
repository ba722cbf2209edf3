"""The calling side of the RPC layer alone, over a scripted stream: what each answer of a server,
good or bad, becomes for the caller, in type and in words.

test_rpc_protocol runs calls against the real server; here the server's side is
bytes lined up by hand, so that answers no correct server gives (a second
response, an end with none, a stray call frame) are tested too.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from google.protobuf.wrappers_pb2 import Int64Value, StringValue

from p2p.rpc import rpc_pb2
from p2p.rpc.client import StreamCall, deadline_ms, failure_of, receive_unary, serialize
from p2p.rpc.errors import (
    BUILTIN_ERRORS,
    FIRST_APPLICATION_CODE,
    ErrorCode,
    HandlerError,
    InvalidMessageError,
    MessageTooLargeError,
    PeerDisconnectedError,
    RemoteError,
    RpcError,
    RpcTimeoutError,
)
from p2p.rpc.framing import END_FRAME, encode_call, encode_error, encode_message

from .test_rpc_stream import PEER, Scripted, framed

ANSWER = Int64Value(value=42)
GARBLED = b"\xff\xff\xff"  # not an Int64Value: a field number of 0 is invalid


def reply(*frames: bytes) -> bytes:
    return b"".join(frames)


# ---------------------------------------------------------------------- errors


def test_a_remote_error_reads_as_message_code_and_origin() -> None:
    assert str(RemoteError("boom", code=7)) == "boom (code 7)"
    assert str(HandlerError("boom", peer_id=PEER)) == f"boom (code {ErrorCode.HANDLER_ERROR} from {PEER})"
    bare = RemoteError()
    assert bare.message == "" and bare.args == ("",) and bare.code == ErrorCode.UNKNOWN and bare.peer_id is None
    assert RemoteError("said").args == ("said",)


def test_an_unclaimed_code_shadows_the_class_default_only_on_the_instance() -> None:
    error = RemoteError("x", code=FIRST_APPLICATION_CODE + 1)
    assert error.code == FIRST_APPLICATION_CODE + 1
    assert RemoteError.code == ErrorCode.UNKNOWN
    assert HandlerError("y").code == ErrorCode.HANDLER_ERROR


# ---------------------------------------------------------------------- one-shot helpers


def test_serialize_refuses_what_is_no_message_or_too_big() -> None:
    assert serialize(ANSWER, 100, "request") == ANSWER.SerializeToString()
    with pytest.raises(TypeError, match=r"^request must be a protobuf message, got str$"):
        serialize("42", 100, "request")  # type: ignore[arg-type]
    big = StringValue(value="x" * 20)
    size = len(big.SerializeToString())
    assert serialize(big, size, "response") == big.SerializeToString()
    with pytest.raises(MessageTooLargeError,
                       match=rf"^response of {size} bytes is over max_message_size {size - 1} \(code 3\)$"):
        serialize(big, size - 1, "response")


async def test_the_deadline_goes_as_whole_milliseconds_never_zero(autojump_clock: trio.testing.MockClock) -> None:
    now = trio.current_time()
    assert deadline_ms(now + 2.5) == 2500
    assert deadline_ms(now + 0.0015) == 2  # rounded up: the server never gets less than was left
    assert deadline_ms(now + 0.0001) == 1
    assert deadline_ms(now - 5) == 1  # past: the server fails it at once, rather than "no deadline"


async def test_failure_of_each_frame_that_is_no_response() -> None:
    f, _ = framed()
    errors = dict(BUILTIN_ERRORS)
    refused = failure_of(rpc_pb2.Error(code=ErrorCode.HANDLER_ERROR, message="it broke"), f, errors)
    assert type(refused) is HandlerError and refused.message == "it broke" and refused.peer_id == PEER
    odd = failure_of(rpc_pb2.Error(code=FIRST_APPLICATION_CODE + 5, message="app"), f, errors)
    assert type(odd) is RemoteError and odd.code == FIRST_APPLICATION_CODE + 5 and odd.peer_id == PEER
    gone = failure_of(None, f, errors)
    assert type(gone) is PeerDisconnectedError
    assert str(gone) == f"{PEER} closed the stream before ending the call"
    empty = failure_of(rpc_pb2.End(), f, errors)
    assert type(empty) is InvalidMessageError
    assert empty.message == "the call ended without a response" and empty.peer_id == PEER
    stray = failure_of(rpc_pb2.Call(method="m"), f, errors)
    assert type(stray) is InvalidMessageError
    assert stray.message == "unexpected Call frame in the response" and stray.peer_id == PEER


async def test_receive_unary_takes_one_response_then_the_end() -> None:
    f, _ = framed(reply(encode_message(ANSWER.SerializeToString()), END_FRAME))
    assert await receive_unary(f, Int64Value, BUILTIN_ERRORS) == ANSWER
    assert f.reusable


async def test_receive_unary_refuses_a_garbled_or_second_response() -> None:
    f, _ = framed(reply(encode_message(GARBLED), END_FRAME))
    with pytest.raises(InvalidMessageError, match=r"^response is not a valid Int64Value"):
        await receive_unary(f, Int64Value, BUILTIN_ERRORS)
    payload = encode_message(ANSWER.SerializeToString())
    g, _ = framed(reply(payload, payload, END_FRAME))
    with pytest.raises(InvalidMessageError) as caught:
        await receive_unary(g, Int64Value, BUILTIN_ERRORS)
    assert caught.value.message == "more than one response to a unary call" and caught.value.peer_id == PEER


async def test_receive_unary_reports_what_came_instead_of_the_end() -> None:
    payload = encode_message(ANSWER.SerializeToString())
    f, _ = framed(reply(payload, encode_error(ErrorCode.HANDLER_ERROR, "failed late")))
    with pytest.raises(HandlerError) as caught:
        await receive_unary(f, Int64Value, BUILTIN_ERRORS)
    assert caught.value.message == "failed late" and caught.value.peer_id == PEER
    g, _ = framed(payload, b"")
    with pytest.raises(PeerDisconnectedError, match="closed the stream before ending the call"):
        await receive_unary(g, Int64Value, BUILTIN_ERRORS)
    h, _ = framed(encode_error(ErrorCode.DEADLINE_EXCEEDED, "too slow"))
    with pytest.raises(RemoteError, match=r"^too slow \(code 2 from"):
        await receive_unary(h, Int64Value, BUILTIN_ERRORS)


# ---------------------------------------------------------------------- streaming calls


def stream_call(*reads: bytes | BaseException, deadline: float | None = None,
                max_message_size: int = 1 << 20) -> tuple[StreamCall[Int64Value], Scripted]:
    f, stream = framed(*reads)
    end = trio.current_time() + 10 if deadline is None else deadline
    return StreamCall(f, "count", Int64Value, end, BUILTIN_ERRORS, max_message_size), stream


async def test_a_stream_call_sends_receives_and_ends_in_step() -> None:
    answers = [encode_message(Int64Value(value=i).SerializeToString()) for i in range(3)]
    call, stream = stream_call(reply(*answers, END_FRAME))
    assert call.method == "count" and call.peer_id == PEER and call.ended is False
    await call.send(Int64Value(value=3))
    assert [r.value async for r in call] == [0, 1, 2]
    assert call.ended is True
    assert await call.finish() is True  # our end marker goes out now
    assert stream.writes[-1] == END_FRAME
    await call.done_sending()  # already sent: nothing more
    assert stream.writes.count(END_FRAME) == 1
    with pytest.raises(StopAsyncIteration):
        await call.__anext__()


async def test_done_sending_is_sent_once() -> None:
    call, stream = stream_call()
    await call.done_sending()
    await call.done_sending()
    assert stream.writes == [END_FRAME]
    with pytest.raises(RuntimeError, match=r"^count: send\(\) after done_sending\(\)$"):
        await call.send(Int64Value(value=1))


async def test_a_request_over_the_limit_is_not_sent() -> None:
    call, stream = stream_call(max_message_size=1)
    with pytest.raises(MessageTooLargeError, match=r"^request of 2 bytes"):
        await call.send(Int64Value(value=42))
    assert stream.writes == []


async def test_receive_after_the_end_names_the_call() -> None:
    call, _ = stream_call(reply(encode_message(ANSWER.SerializeToString()), END_FRAME))
    assert await call.receive() == ANSWER
    with pytest.raises(InvalidMessageError) as caught:
        await call.receive()
    assert caught.value.message == "count ended without another response" and caught.value.peer_id == PEER
    with pytest.raises(RpcError, match=r"^count: the server already ended the call$"):
        await call.send(ANSWER)


async def test_a_garbled_response_fails_the_call_for_good() -> None:
    call, _ = stream_call(reply(encode_message(GARBLED), END_FRAME))
    with pytest.raises(InvalidMessageError, match=r"^response is not a valid Int64Value") as first:
        await call.receive()
    with pytest.raises(InvalidMessageError) as again:
        await call.receive()
    assert again.value is first.value
    with pytest.raises(InvalidMessageError) as on_send:
        await call.send(ANSWER)
    assert on_send.value is first.value
    assert await call.finish() is False


async def test_a_server_that_leaves_without_ending_the_call() -> None:
    call, _ = stream_call(b"")
    with pytest.raises(PeerDisconnectedError) as caught:
        await call.receive()
    assert str(caught.value) == f"{PEER} closed the stream without ending count"
    with pytest.raises(PeerDisconnectedError) as again:
        await call.receive()
    assert again.value is caught.value


async def test_an_error_frame_fails_the_call_with_its_type() -> None:
    call, _ = stream_call(encode_error(ErrorCode.HANDLER_ERROR, "no"))
    with pytest.raises(HandlerError, match=r"^no \(code 5 from"):
        await call.receive()


async def test_a_broken_stream_fails_the_call_for_good() -> None:
    call, stream = stream_call()
    stream.write_error = trio.BrokenResourceError("reset")
    with pytest.raises(PeerDisconnectedError, match="broke while writing") as caught:
        await call.send(ANSWER)
    with pytest.raises(PeerDisconnectedError) as again:
        await call.done_sending()
    assert again.value is caught.value


async def test_finish_says_no_when_our_end_marker_cannot_go() -> None:
    call, stream = stream_call(END_FRAME)
    assert [r async for r in call] == []
    stream.write_error = OSError("gone")
    assert await call.finish() is False


async def test_finish_before_the_server_ended_is_no(autojump_clock: trio.testing.MockClock) -> None:
    call, stream = stream_call()
    assert await call.finish() is False
    assert stream.writes == []


async def test_every_step_fails_after_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    call, _ = stream_call(deadline=trio.current_time() + 1)
    with pytest.raises(RpcTimeoutError) as caught:
        await call.receive()
    assert str(caught.value) == f"count on {PEER} passed its deadline"
    assert trio.current_time() == pytest.approx(1)
    with pytest.raises(RpcTimeoutError) as again:
        await call.send(ANSWER)
    assert again.value is caught.value


async def test_a_call_frame_is_no_answer() -> None:
    call, _ = stream_call(encode_call("m", 5))
    with pytest.raises(InvalidMessageError, match="^unexpected Call frame in the response"):
        await call.receive()
