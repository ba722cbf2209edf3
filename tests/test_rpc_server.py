"""The serving side of the RPC layer, branch by branch, over raw in-memory streams.

test_rpc_protocol shows that bad calls get their error and good calls go on; here
the test holds the client's end by hand to see what the server does after each
error: the words it sends, the lines it logs, whether it ends the stream with a
FIN or a reset, and that a stream it gave up on never serves another call.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from google.protobuf.wrappers_pb2 import Int64Value, StringValue

from p2p.errors import DedlocError
from p2p.rpc import CallContext, ErrorCode, PeerDisconnectedError, rpc_pb2
from p2p.rpc.framing import END_FRAME, Payload, encode_call, encode_frame, encode_message
from p2p.rpc.server import Method, serve
from p2p.rpc.stream import CLEANUP_TIMEOUT

from .test_rpc_protocol import (
    CLIENT,
    SERVER,
    FakeStream,
    Pair,
    fake_stream_pair,
    first_only,
    read_reply,
    rpc_pair,
    serve_defaults,
    server_never_fails,  # noqa: F401  (autouse: serve logs no failure of its own)
    unary_call,
)

SERVER_LOG = "p2p.rpc.server"


async def error_of(stream: FakeStream) -> rpc_pb2.Error:
    with trio.fail_after(60):
        frames = await read_reply(stream)
    assert len(frames) == 1 and isinstance(frames[0], rpc_pb2.Error), frames
    return frames[0]


async def ended_how(p: Pair, stream: FakeStream) -> str:
    """``fin`` or ``reset``: how the server left a stream, once it is done with it."""
    await p.wait_served()
    try:
        data = await stream.read(65536)
    except trio.BrokenResourceError:
        return "reset"
    assert data == b"", data
    return "fin"


# ---------------------------------------------------------------------- what the requests say


@pytest.mark.parametrize("raw, message", [
    (encode_call("echo", 5000) + END_FRAME, "unary call without a request"),
    (encode_call("echo", 5000) + encode_message(b"") * 2 + END_FRAME, "unary call with more than one request"),
    (encode_call("echo", 5000) + encode_call("echo", 5000), "unexpected Call frame among the requests"),
    (unary_call("echo", b"\xff\xff\xff"), "request is not a valid StringValue: Error parsing message"),
    (encode_message(b"no call first"), "expected a call frame, got a Payload"),
])
async def test_a_bad_call_is_answered_in_words(raw: bytes, message: str) -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        stream = await p.open_raw()
        await stream.write(raw)
        error = await error_of(stream)
        assert error.code == ErrorCode.INVALID_MESSAGE
        assert error.message.startswith(message), error.message


async def test_garbage_is_refused_with_a_log_line_a_fin_and_a_reset(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=SERVER_LOG)
    async with rpc_pair() as p:
        stream = await p.open_raw()
        await stream.write(encode_message(b"no call first"))
        await error_of(stream)
        assert await ended_how(p, stream) == "reset"  # after the FIN: it stops the peer sending more
    assert f"refusing an RPC stream from {CLIENT}: expected a call frame, got a Payload" in caplog.messages


async def test_a_handler_sees_a_client_that_left_before_its_requests_ended(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=SERVER_LOG)
    seen: list[str] = []

    async def collect(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
        try:
            async for _ in requests:
                pass
        except PeerDisconnectedError as e:
            seen.append(str(e))
            raise
        yield Int64Value()

    async with rpc_pair() as p:
        p.server.add_stream("collect", Int64Value, collect)
        stream = await p.open_raw()
        await stream.write(encode_call("collect", 5000) + encode_message(b""))
        await stream.close()
        await p.wait_served()
    assert seen == [f"{CLIENT} ended the stream before its requests"]
    assert f"{CLIENT} went away during collect: {seen[0]}" in caplog.messages
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the client's doing, no warning


async def test_a_handler_that_fails_on_the_clients_garbage_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    async def strict(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
        async for _ in requests:
            pass
        yield Int64Value()

    async with rpc_pair() as p:
        p.server.add_stream("strict", Int64Value, strict)
        stream = await p.open_raw()
        await stream.write(unary_call("strict", b"\xff\xff\xff"))
        assert (await error_of(stream)).code == ErrorCode.INVALID_MESSAGE
    assert not [r for r in caplog.records if r.name == SERVER_LOG and r.levelno >= logging.WARNING]


async def test_a_failing_handler_is_logged_with_the_method_and_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    async def fail(request: StringValue, ctx: CallContext) -> StringValue:
        raise KeyError("nothing here")

    async with rpc_pair() as p:
        p.server.add_unary("fail", StringValue, fail)
        stream = await p.open_raw()
        await stream.write(unary_call("fail"))
        error = await error_of(stream)
    assert error.code == ErrorCode.HANDLER_ERROR and error.message == "fail failed: KeyError: 'nothing here'"
    assert f"handler of fail failed on a call from {CLIENT}" in caplog.messages


async def test_an_answer_that_is_no_message_is_a_handler_error() -> None:
    async def wrong(request: StringValue, ctx: CallContext) -> StringValue:
        return "plain text"  # type: ignore[return-value]

    async with rpc_pair() as p:
        p.server.add_unary("wrong", StringValue, wrong)
        stream = await p.open_raw()
        await stream.write(unary_call("wrong"))
        error = await error_of(stream)
    assert error.code == ErrorCode.HANDLER_ERROR and error.message == "wrong answered with a str, not a message"


async def test_a_client_that_gives_up_is_logged_as_gone(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=SERVER_LOG)
    started = trio.Event()

    async def never(request: StringValue, ctx: CallContext) -> StringValue:
        started.set()
        await trio.sleep_forever()
        raise AssertionError

    async with rpc_pair() as p:
        p.server.add_unary("never", StringValue, never)
        stream = await p.open_raw()
        await stream.write(unary_call("never"))
        with trio.fail_after(5):
            await started.wait()
        await stream.close()
        await p.wait_served()
    assert f"{CLIENT} went away during never" in caplog.messages


async def test_a_client_that_resets_before_its_call_ends_the_stream() -> None:
    async with rpc_pair() as p:
        stream = await p.open_raw()
        await stream.reset()
        await p.wait_served()  # not a loop on a dead stream


# ---------------------------------------------------------------------- deadlines


async def test_a_call_that_names_no_deadline_gets_the_servers_default(autojump_clock: trio.testing.MockClock) -> None:
    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        await trio.sleep(5)
        return request

    async with rpc_pair(default_timeout=2) as p:
        p.server.add_unary("slow", StringValue, slow)
        serve_defaults(p.server)
        stream = await p.open_raw()
        no_deadline = encode_frame(rpc_pb2.Frame(call=rpc_pb2.Call(method="slow", deadline_ms=0)))
        await stream.write(no_deadline + encode_message(b"") + END_FRAME)
        start = trio.current_time()
        error = await error_of(stream)
        assert error.code == ErrorCode.DEADLINE_EXCEEDED and error.message == "slow did not finish within 2s"
        assert trio.current_time() - start == pytest.approx(2)
        fast = await p.open_raw()
        await fast.write(encode_frame(rpc_pb2.Frame(call=rpc_pb2.Call(method="echo", deadline_ms=0)))
                         + encode_message(b"") + END_FRAME)
        frames = await read_reply(fast)
        assert isinstance(frames[-1], rpc_pb2.End)  # no deadline named is not "no time at all"


async def test_an_error_reply_waits_for_the_clients_end_past_the_deadline(
        autojump_clock: trio.testing.MockClock) -> None:
    """The server drains until the client ends its side, up to the call's deadline and the cleanup
    time after it, and then ends its own side cleanly."""
    async with rpc_pair() as p:
        stream = await p.open_raw()
        await stream.write(unary_call("nope", deadline_ms=1000))
        assert (await error_of(stream)).code == ErrorCode.UNKNOWN_METHOD
        await trio.sleep(1 + CLEANUP_TIMEOUT / 2)
        await stream.close()
        assert await ended_how(p, stream) == "fin"


def refusing_admit(peer_id: object, method: str) -> None:
    if method == "refused":
        raise DedlocError("over a limit")


async def fail_now(request: StringValue, ctx: CallContext) -> StringValue:
    raise ValueError("no")


async def too_slow(request: StringValue, ctx: CallContext) -> StringValue:
    await trio.sleep(10)
    return request


@pytest.mark.parametrize("call, code", [
    # the call frame alone: no request left buffered that a server which went on would trip over
    (encode_call("nope", 1000), ErrorCode.UNKNOWN_METHOD),
    (encode_call("refused", 1000), ErrorCode.RESOURCE_LIMIT),
    (unary_call("fail_now", deadline_ms=1000), ErrorCode.HANDLER_ERROR),
    (unary_call("too_slow", deadline_ms=1000), ErrorCode.DEADLINE_EXCEEDED),
    (unary_call("echo", b"x" * 200, deadline_ms=1000), ErrorCode.MESSAGE_TOO_LARGE),
])
async def test_a_stream_that_carried_an_error_serves_no_further_call(
        call: bytes, code: int, autojump_clock: trio.testing.MockClock) -> None:
    """A client that keeps its side open past the drain and then sends another call gets no
    answer: after an error the stream is out of step, and the server reset it."""
    async with rpc_pair(server_max=100, admit=refusing_admit) as p:
        serve_defaults(p.server)
        p.server.add_unary("refused", StringValue, fail_now)
        p.server.add_unary("fail_now", StringValue, fail_now)
        p.server.add_unary("too_slow", StringValue, too_slow)
        stream = await p.open_raw()
        await stream.write(call)
        assert (await error_of(stream)).code == code
        await trio.sleep(2 + CLEANUP_TIMEOUT)  # past the deadline and the drain's cleanup time
        try:
            await stream.write(unary_call("echo", StringValue(value="late").SerializeToString()))
        except trio.BrokenResourceError:
            return  # reset already: the late call never went
        assert await read_reply(stream) == []


async def test_a_handler_that_stops_reading_early_keeps_the_stream_for_the_next_call(
        autojump_clock: trio.testing.MockClock) -> None:
    """The server skips the requests its handler left, up to the client's end marker, until the
    cleanup time after the call's deadline: a deadline shorter than that cleanup time still gets
    the stream back in step."""

    async with rpc_pair() as p:
        serve_defaults(p.server)
        p.server.add_stream("first_only", Int64Value, first_only)
        async with p.client.open_stream_call(SERVER, "first_only", Int64Value, timeout=1) as call:
            await call.send(Int64Value(value=7))
            await call.send(Int64Value(value=8))  # left for the server to skip
            assert [r.value async for r in call] == [7]
        assert (await p.client.call(SERVER, "echo", StringValue(value="next"), StringValue)).value.startswith("next")
        assert p.opened == 1


async def test_a_frame_other_than_a_request_among_the_skipped_ones_ends_the_stream() -> None:
    async with rpc_pair() as p:
        p.server.add_stream("first_only", Int64Value, first_only)
        stream = await p.open_raw()
        seven = encode_message(Int64Value(value=7).SerializeToString())
        await stream.write(encode_call("first_only", 5000) + seven + seven + encode_call("echo", 5000))
        frames = await read_reply(stream)
        assert [type(f) for f in frames] == [Payload, rpc_pb2.End]
        assert await ended_how(p, stream) == "reset"


class Broken(dict[str, Method]):
    def get(self, key: str, default: object = None) -> Method | None:  # type: ignore[override]
        raise RuntimeError("a bug in the server")


async def test_a_failure_of_the_server_itself_is_logged_with_the_peer_and_the_stream_reset(
        caplog: pytest.LogCaptureFixture) -> None:
    mine, theirs = fake_stream_pair()
    await mine.write(unary_call("echo"))
    await serve(theirs, CLIENT, Broken(), max_message_size=1 << 20, default_timeout=5)
    with pytest.raises(trio.BrokenResourceError):
        await mine.read(65536)
    [record] = [r for r in caplog.records if r.name == SERVER_LOG]
    assert record.levelno == logging.ERROR and record.getMessage() == f"RPC server failed on a stream from {CLIENT}"
    assert record.exc_info is not None and "a bug in the server" in str(record.exc_info[1])
    caplog.clear()  # seen: the guard is for failures no test expects


async def test_a_handler_cut_short_is_closed_at_once_in_its_own_task() -> None:
    """A stream handler whose answer is refused (too large, or no message) is closed before the
    error goes out: its ``finally`` runs under the call's deadline, not later in trio's finalizer."""
    closed_in: list[bool] = []

    async def too_big(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[StringValue]:
        task = trio.lowlevel.current_task()
        try:
            yield StringValue(value="x" * 500)
        finally:
            closed_in.append(trio.lowlevel.current_task() is task)

    async with rpc_pair(server_max=100) as p:
        p.server.add_stream("too_big", Int64Value, too_big)
        stream = await p.open_raw()
        await stream.write(encode_call("too_big", 5000) + END_FRAME)
        error = await error_of(stream)
        assert error.code == ErrorCode.MESSAGE_TOO_LARGE
        assert closed_in == [True]
