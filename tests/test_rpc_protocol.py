"""The RPC protocol end to end over in-memory streams: both endpoints real, no sockets.

A fake stream pair stands in for a libp2p stream (``close`` ends one direction,
``reset`` makes the other side's reads and writes fail) so that every path runs
without a network. Where a test needs time, trio's autojump clock provides it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value, StringValue
from libp2p.peer.id import ID

from p2p.rpc import (
    RPC_PROTOCOL,
    CallContext,
    DeadlineExceededError,
    ErrorCode,
    HandlerError,
    InvalidMessageError,
    MessageTooLargeError,
    PeerDisconnectedError,
    PeerUnreachableError,
    RemoteError,
    Rpc,
    RpcError,
    RpcTimeoutError,
    UnknownMethodError,
    rpc_pb2,
)
from p2p.rpc.framing import END_FRAME, FrameDecoder, encode_call, encode_message
from p2p.rpc.server import Admit
from p2p.varint import encode_varint

CLIENT = ID(b"\x00\x06client")
SERVER = ID(b"\x00\x06server")


@dataclass
class Link:
    reset: bool = False


class FakeStream:
    """One end of a trio memory stream pair, shaped like py-libp2p's INetStream."""

    def __init__(self, stream: trio.StapledStream, link: Link):
        self._stream = stream
        self._link = link
        #: Time a write takes to return after its bytes were delivered (a busy muxer).
        self.write_delay = 0.0

    async def read(self, n: int | None = None) -> bytes:
        data = await self._stream.receive_some(n)
        if not data and self._link.reset:
            raise trio.BrokenResourceError("stream reset")
        return bytes(data)

    async def write(self, data: bytes) -> None:
        if self._link.reset:
            raise trio.BrokenResourceError("stream reset")
        await self._stream.send_all(data)
        if self.write_delay:
            await trio.sleep(self.write_delay)

    async def close(self) -> None:
        await self._stream.send_stream.aclose()

    async def reset(self) -> None:
        self._link.reset = True
        await self._stream.aclose()


def fake_stream_pair() -> tuple[FakeStream, FakeStream]:
    a, b = trio.testing.memory_stream_pair()
    link = Link()
    return FakeStream(a, link), FakeStream(b, link)


@dataclass
class Pair:
    client: Rpc
    server: Rpc
    nursery: trio.Nursery
    opened: int = 0
    started: int = 0
    served: int = 0
    #: Streams handed to the test by open_raw(), reset when the pair closes.
    raw: list[FakeStream] = field(default_factory=list)
    #: The server's ends of all streams, in order.
    server_ends: list[FakeStream] = field(default_factory=list)
    server_write_delay: float = 0.0

    async def open_raw(self) -> FakeStream:
        """A stream to the server that the test writes by hand."""
        mine, theirs = fake_stream_pair()
        theirs.write_delay = self.server_write_delay
        self.started += 1
        self.nursery.start_soon(self._serve, theirs)
        self.raw.append(mine)
        self.server_ends.append(theirs)
        return mine

    async def _serve(self, stream: FakeStream) -> None:
        await self.server.serve_stream(stream, CLIENT)
        self.served += 1

    async def wait_served(self) -> None:
        """Until every stream the server was given is done with (a hung server fails the test)."""
        with trio.fail_after(10):
            while self.served < self.started:
                await trio.sleep(0.001)


@asynccontextmanager
async def rpc_pair(
    *, client_max: int = 1 << 20, server_max: int = 1 << 20, default_timeout: float = 30.0,
    admit: Admit | None = None,
) -> AsyncIterator[Pair]:
    async def no_streams(peer_id: ID, protocol: str) -> FakeStream:
        raise AssertionError("the server never calls out")

    async with trio.open_nursery() as nursery:
        server = Rpc(no_streams, max_message_size=server_max, default_timeout=default_timeout, admit=admit)

        async def open_stream(peer_id: ID, protocol: str) -> FakeStream:
            assert peer_id == SERVER and protocol == RPC_PROTOCOL
            pair.opened += 1
            return await pair.open_raw()

        pair = Pair(Rpc(open_stream, max_message_size=client_max, default_timeout=default_timeout), server, nursery)
        yield pair
        await pair.client.close_idle_streams(expired_only=False)
        for stream in pair.raw:
            await stream.close()
        await pair.wait_served()
        nursery.cancel_scope.cancel()


def unary_call(method: str, payload: bytes = b"", deadline_ms: int = 5000) -> bytes:
    """The bytes of a whole unary call, as a client writes them: the call frame, one request, the end."""
    return encode_call(method, deadline_ms) + encode_message(payload) + END_FRAME


async def read_reply(stream: FakeStream, limit: int = 1 << 20) -> list[object]:
    """The frames the server sends on a raw stream, up to its end marker, error, EOF or reset."""
    decoder = FrameDecoder(limit)
    frames: list[object] = []
    while True:
        try:
            data = await stream.read(65536)
        except trio.BrokenResourceError:
            return frames
        if not data:
            return frames
        decoder.feed(data)
        while (frame := decoder.next()) is not None:
            frames.append(frame)
            if isinstance(frame, (rpc_pb2.Error, rpc_pb2.End)):
                return frames


async def echo(request: StringValue, ctx: CallContext) -> StringValue:
    return StringValue(value=f"{request.value} from {ctx.peer_id == CLIENT and 'client'} via {ctx.method}")


async def count_up(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
    async for request in requests:
        for i in range(request.value):
            yield Int64Value(value=i)


async def total(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
    yield Int64Value(value=sum([r.value async for r in requests]))


async def double_each(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
    async for request in requests:
        yield Int64Value(value=2 * request.value)


async def first_only(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
    """Answers the first request and stops reading: the server skips the rest."""
    async for request in requests:
        yield request
        return


async def blob(request: Int64Value, ctx: CallContext) -> BytesValue:
    return BytesValue(value=b"b" * request.value)


def serve_defaults(server: Rpc) -> None:
    server.add_unary("echo", StringValue, echo)
    server.add_unary("blob", Int64Value, blob)
    server.add_stream("count_up", Int64Value, count_up)
    server.add_stream("total", Int64Value, total)
    server.add_stream("double_each", Int64Value, double_each)


@pytest.fixture(autouse=True)
def server_never_fails(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """``serve`` never raises: what it catches of its own failing it logs at ERROR, and no test may
    see one (a bug there would otherwise pass for a peer that went away)."""
    yield
    failures = [r.getMessage() for r in caplog.get_records("call")
                if r.name == "p2p.rpc.server" and r.levelno >= logging.ERROR]
    assert not failures, failures


# ---------------------------------------------------------------------- calls that work


async def test_unary_call_round_trip() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        response = await p.client.call(SERVER, "echo", StringValue(value="hi"), StringValue, timeout=5)
        assert response.value == "hi from client via echo"
        assert p.opened == 1
    assert p.served == 1


async def test_handler_sees_peer_method_and_the_callers_deadline() -> None:
    seen: list[tuple[ID, str, float]] = []

    async def look(request: StringValue, ctx: CallContext) -> StringValue:
        seen.append((ctx.peer_id, ctx.method, ctx.remaining))
        return request

    async with rpc_pair() as p:
        p.server.add_unary("look", StringValue, look)
        await p.client.call(SERVER, "look", StringValue(), StringValue, timeout=7.0)
    (peer, method, remaining), = seen
    assert peer == CLIENT and method == "look"
    assert 5.0 < remaining <= 7.0


async def test_server_streaming() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        async with p.client.open_stream_call(SERVER, "count_up", Int64Value, timeout=5) as call:
            await call.send(Int64Value(value=50))
            await call.done_sending()
            assert [r.value async for r in call] == list(range(50))
            assert call.ended


async def test_client_streaming() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        async with p.client.open_stream_call(SERVER, "total", Int64Value, timeout=5) as call:
            for i in range(100):
                await call.send(Int64Value(value=i))
            await call.done_sending()
            assert (await call.receive()).value == sum(range(100))
            assert [r async for r in call] == []


async def test_bidirectional_streaming_interleaved_in_one_task() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        async with p.client.open_stream_call(SERVER, "double_each", Int64Value, timeout=5) as call:
            for i in range(20):
                await call.send(Int64Value(value=i))
                assert (await call.receive()).value == 2 * i
            await call.done_sending()
            assert [r async for r in call] == []


async def test_bidirectional_streaming_from_two_tasks() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        got: list[int] = []
        async with p.client.open_stream_call(SERVER, "double_each", Int64Value, timeout=5) as call:

            async def sender() -> None:
                for i in range(200):
                    await call.send(Int64Value(value=i))
                await call.done_sending()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                got = [r.value async for r in call]
        assert got == [2 * i for i in range(200)]


async def test_many_concurrent_calls() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            results[i] = (await p.client.call(SERVER, "echo", StringValue(value=str(i)), StringValue)).value

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, i)
        assert results == {i: f"{i} from client via echo" for i in range(200)}
    assert p.served == 200


async def test_message_of_exactly_the_limit_passes_both_ways() -> None:
    limit = 64 * 1024
    async with rpc_pair(client_max=limit, server_max=limit) as p:
        p.server.add_unary("same", BytesValue, lambda r, ctx: _return(r))
        payload = b"x" * (limit - 4)  # BytesValue adds a tag and a 3-byte length
        response = await p.client.call(SERVER, "same", BytesValue(value=payload), BytesValue)
        assert response.value == payload


async def _return(message: BytesValue) -> BytesValue:
    return message


# ---------------------------------------------------------------------- errors that come back typed


async def test_unknown_method_then_the_server_keeps_serving() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        with pytest.raises(UnknownMethodError) as info:
            await p.client.call(SERVER, "nope", StringValue(), StringValue, timeout=5)
        assert info.value.code == ErrorCode.UNKNOWN_METHOD and info.value.peer_id == SERVER
        assert "nope" in info.value.message
        assert (await p.client.call(SERVER, "echo", StringValue(value="x"), StringValue)).value.startswith("x")
    assert p.served == 2


async def test_unknown_streaming_method() -> None:
    async with rpc_pair() as p:
        async with p.client.open_stream_call(SERVER, "nope", Int64Value, timeout=5) as call:
            await call.done_sending()
            with pytest.raises(UnknownMethodError):
                await call.receive()
            with pytest.raises(UnknownMethodError):  # and again: the call is over
                await call.send(Int64Value())


async def test_handler_exception_becomes_handler_error_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(request: StringValue, ctx: CallContext) -> StringValue:
        raise ValueError("secret internals")

    async with rpc_pair() as p:
        p.server.add_unary("broken", StringValue, broken)
        serve_defaults(p.server)
        with caplog.at_level(logging.WARNING, logger="p2p.rpc"):
            with pytest.raises(HandlerError) as info:
                await p.client.call(SERVER, "broken", StringValue(), StringValue, timeout=5)
        assert info.value.message == "broken failed: ValueError: secret internals"
        assert "Traceback" not in info.value.message
        assert any(r.exc_info and r.exc_info[0] is ValueError for r in caplog.records), "logged on the server"
        assert (await p.client.call(SERVER, "echo", StringValue(), StringValue)).value


async def test_failing_stream_handler_after_some_responses() -> None:
    async def flaky(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
        yield Int64Value(value=1)
        raise KeyError("gone")

    async with rpc_pair() as p:
        p.server.add_stream("flaky", Int64Value, flaky)
        async with p.client.open_stream_call(SERVER, "flaky", Int64Value, timeout=5) as call:
            await call.done_sending()
            assert (await call.receive()).value == 1
            with pytest.raises(HandlerError, match="KeyError"):
                await call.receive()


class NotFound(RemoteError):
    code = 100


async def test_application_errors_keep_their_code_and_type() -> None:
    async def lookup(request: StringValue, ctx: CallContext) -> StringValue:
        raise NotFound(f"no key {request.value}")

    async with rpc_pair() as p:
        p.server.add_unary("lookup", StringValue, lookup)
        with pytest.raises(RemoteError) as info:
            await p.client.call(SERVER, "lookup", StringValue(value="k"), StringValue)
        assert type(info.value) is RemoteError and info.value.code == 100  # unregistered: plain RemoteError
        p.client.register_error(NotFound)
        with pytest.raises(NotFound) as found:
            await p.client.call(SERVER, "lookup", StringValue(value="k"), StringValue)
        assert found.value.message == "no key k" and found.value.peer_id == SERVER


async def test_rpc_layer_errors_from_a_handler_are_not_passed_on_as_ours() -> None:
    # A handler whose own nested call failed must not make *our* call look unknown.
    async def proxy(request: StringValue, ctx: CallContext) -> StringValue:
        raise UnknownMethodError("the third peer has no such method", peer_id=SERVER)

    async with rpc_pair() as p:
        p.server.add_unary("proxy", StringValue, proxy)
        with pytest.raises(HandlerError, match="UnknownMethodError"):
            await p.client.call(SERVER, "proxy", StringValue(), StringValue)


def test_register_error_refuses_rpc_codes_and_clashes() -> None:
    rpc = Rpc(_never_open)
    with pytest.raises(ValueError):
        rpc.register_error(HandlerError)

    class Other(RemoteError):
        code = 100

    rpc.register_error(NotFound)
    rpc.register_error(NotFound)
    with pytest.raises(ValueError):
        rpc.register_error(Other)


async def _never_open(peer_id: ID, protocol: str) -> FakeStream:
    raise AssertionError


def test_methods_are_registered_once() -> None:
    rpc = Rpc(_never_open)
    rpc.add_unary("a", StringValue, echo)
    with pytest.raises(ValueError):
        rpc.add_stream("a", Int64Value, count_up)
    rpc.remove("a")
    rpc.add_stream("a", Int64Value, count_up)
    assert rpc.methods == ["a"]


# ---------------------------------------------------------------------- deadlines


async def test_slow_unary_handler_hits_the_deadline_and_is_cancelled(autojump_clock: trio.testing.MockClock) -> None:
    cancelled = trio.Event()

    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError

    async with rpc_pair() as p:
        p.server.add_unary("slow", StringValue, slow)
        serve_defaults(p.server)
        start = trio.current_time()
        with pytest.raises((DeadlineExceededError, RpcTimeoutError)):
            await p.client.call(SERVER, "slow", StringValue(), StringValue, timeout=3.0)
        assert 3.0 <= trio.current_time() - start < 3.1
        with trio.fail_after(1):
            await cancelled.wait()
        assert (await p.client.call(SERVER, "echo", StringValue(), StringValue)).value


async def test_server_enforces_the_deadline_the_client_sent(autojump_clock: trio.testing.MockClock) -> None:
    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        await trio.sleep(60)
        return request

    async with rpc_pair() as p:
        p.server.add_unary("slow", StringValue, slow)
        stream = await p.open_raw()
        start = trio.current_time()
        await stream.write(unary_call("slow", deadline_ms=250))
        (error,) = await read_reply(stream)
        assert isinstance(error, rpc_pb2.Error) and error.code == ErrorCode.DEADLINE_EXCEEDED
        assert 0.25 <= trio.current_time() - start < 0.3
        await stream.reset()


async def test_streaming_call_deadline(autojump_clock: trio.testing.MockClock) -> None:
    async def silent(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
        await trio.sleep_forever()
        yield Int64Value()

    async with rpc_pair() as p:
        p.server.add_stream("silent", Int64Value, silent)
        start = trio.current_time()
        async with p.client.open_stream_call(SERVER, "silent", Int64Value, timeout=2.0) as call:
            await call.send(Int64Value(value=1))
            with pytest.raises((DeadlineExceededError, RpcTimeoutError)):
                await call.receive()
            with pytest.raises((DeadlineExceededError, RpcTimeoutError)):
                await call.send(Int64Value(value=2))  # the call stays failed
        assert trio.current_time() - start < 2.1


async def test_timeout_must_be_positive() -> None:
    async with rpc_pair() as p:
        with pytest.raises(ValueError):
            await p.client.call(SERVER, "echo", StringValue(), StringValue, timeout=0)


# ---------------------------------------------------------------------- limits


async def test_oversized_request_is_refused_and_the_server_keeps_serving() -> None:
    async with rpc_pair(client_max=8 << 20, server_max=64 * 1024) as p:
        serve_defaults(p.server)
        with pytest.raises(MessageTooLargeError) as info:
            await p.client.call(SERVER, "echo", StringValue(value="x" * (2 << 20)), StringValue, timeout=10)
        assert info.value.peer_id == SERVER, "refused by the server, not locally"
        assert (await p.client.call(SERVER, "echo", StringValue(value="ok"), StringValue)).value.startswith("ok")


async def test_oversized_request_in_a_stream_call() -> None:
    async with rpc_pair(client_max=8 << 20, server_max=64 * 1024) as p:
        serve_defaults(p.server)
        async with p.client.open_stream_call(SERVER, "total", Int64Value, timeout=10) as call:
            await call.send(Int64Value(value=1))
            await call.send(BytesValue(value=b"z" * (1 << 20)))
            await call.done_sending()
            with pytest.raises(MessageTooLargeError):
                await call.receive()


async def test_request_over_our_own_limit_is_never_sent() -> None:
    async with rpc_pair(client_max=1024) as p:
        serve_defaults(p.server)
        with pytest.raises(MessageTooLargeError) as info:
            await p.client.call(SERVER, "echo", StringValue(value="x" * 2000), StringValue)
        assert info.value.peer_id is None and p.opened == 0


async def test_response_over_the_servers_limit() -> None:
    async with rpc_pair(server_max=4096) as p:
        serve_defaults(p.server)
        with pytest.raises(MessageTooLargeError) as info:
            await p.client.call(SERVER, "blob", Int64Value(value=10_000), BytesValue)
        assert info.value.peer_id == SERVER


async def test_response_over_the_clients_limit() -> None:
    async with rpc_pair(client_max=4096, server_max=1 << 20) as p:
        serve_defaults(p.server)
        with pytest.raises(MessageTooLargeError) as info:
            await p.client.call(SERVER, "blob", Int64Value(value=10_000), BytesValue)
        assert info.value.peer_id is None  # our own decoder refused it
        assert len((await p.client.call(SERVER, "blob", Int64Value(value=100), BytesValue)).value) == 100


async def test_oversized_length_prefix_is_refused_without_sending_the_body() -> None:
    async with rpc_pair(server_max=1024) as p:
        serve_defaults(p.server)
        stream = await p.open_raw()
        # Only the prefix of a "1 GB" frame: the server must answer without waiting for it.
        await stream.write(encode_call("echo", 5000) + encode_varint(1 << 30))
        with trio.fail_after(5):
            frames = await read_reply(stream)
        assert isinstance(frames[0], rpc_pb2.Error) and frames[0].code == ErrorCode.MESSAGE_TOO_LARGE


# ---------------------------------------------------------------------- garbage on the wire


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"\x05\xff\xff\xff\xff\xff", ErrorCode.INVALID_MESSAGE),  # a frame that is not protobuf
        (encode_message(b"no call first"), ErrorCode.INVALID_MESSAGE),  # a message before the call
        (END_FRAME, ErrorCode.INVALID_MESSAGE),
        (b"\x80" * 12, ErrorCode.INVALID_MESSAGE),  # a length prefix that never ends
        (b"\xff" * 4, ErrorCode.MESSAGE_TOO_LARGE),  # refused before the prefix even ends
        (encode_call("echo", 5000) + encode_message(b"\xff\xff\xff") + END_FRAME, ErrorCode.INVALID_MESSAGE),
        (encode_call("echo", 5000) + END_FRAME, ErrorCode.INVALID_MESSAGE),  # unary without request
        (encode_call("echo", 5000) + encode_message(b"") * 2 + END_FRAME, ErrorCode.INVALID_MESSAGE),
        (encode_call("echo", 5000) + encode_call("echo", 5000), ErrorCode.INVALID_MESSAGE),
        (encode_call("echo", 5000) + b"\x03\x00\x00\x00", ErrorCode.INVALID_MESSAGE),
    ],
)
async def test_garbled_input_gets_an_error_frame_and_others_are_unaffected(raw: bytes, code: int) -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        stream = await p.open_raw()
        await stream.write(raw)
        with trio.fail_after(5):
            frames = await read_reply(stream)
        assert len(frames) == 1 and isinstance(frames[0], rpc_pb2.Error), frames
        assert frames[0].code == code
        assert (await p.client.call(SERVER, "echo", StringValue(value="x"), StringValue)).value.startswith("x")


async def test_garbled_response_is_an_invalid_message_on_the_client() -> None:
    async with trio.open_nursery() as nursery:

        async def open_stream(peer_id: ID, protocol: str) -> FakeStream:
            mine, theirs = fake_stream_pair()

            async def bad_server() -> None:
                await theirs.read(65536)
                await theirs.write(encode_message(b"\xff\xff") + END_FRAME)

            nursery.start_soon(bad_server)
            return mine

        client = Rpc(open_stream)
        with pytest.raises(InvalidMessageError):
            await client.call(SERVER, "echo", StringValue(), StringValue, timeout=5)


async def test_stream_that_sends_no_call_is_dropped_after_the_default_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rpc_pair(default_timeout=10) as p:
        stream = await p.open_raw()
        start = trio.current_time()
        assert await read_reply(stream) == []
        assert 10 <= trio.current_time() - start < 11


# ---------------------------------------------------------------------- peers that go away


async def test_server_that_vanishes_mid_call() -> None:
    async with trio.open_nursery() as nursery:

        async def open_stream(peer_id: ID, protocol: str) -> FakeStream:
            mine, theirs = fake_stream_pair()

            async def vanishing_server() -> None:
                await theirs.read(65536)
                await theirs.write(encode_message(StringValue(value="partial").SerializeToString())[:-2])
                await theirs.reset()

            nursery.start_soon(vanishing_server)
            return mine

        client = Rpc(open_stream)
        with pytest.raises(PeerDisconnectedError):
            await client.call(SERVER, "echo", StringValue(), StringValue, timeout=5)


async def test_server_that_closes_without_answering() -> None:
    async with trio.open_nursery() as nursery:

        async def open_stream(peer_id: ID, protocol: str) -> FakeStream:
            mine, theirs = fake_stream_pair()

            async def rude_server() -> None:
                await theirs.read(65536)
                await theirs.close()

            nursery.start_soon(rude_server)
            return mine

        client = Rpc(open_stream)
        with pytest.raises(PeerDisconnectedError):
            await client.call(SERVER, "echo", StringValue(), StringValue, timeout=5)


async def test_unreachable_peer() -> None:
    async def cannot(peer_id: ID, protocol: str) -> FakeStream:
        raise ConnectionRefusedError("nobody home")

    client = Rpc(cannot)
    with pytest.raises(PeerUnreachableError, match="nobody home"):
        await client.call(SERVER, "echo", StringValue(), StringValue, timeout=5)


async def test_client_that_goes_away_mid_stream_cancels_nothing_else() -> None:
    outcome: list[str] = []

    async def collect(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
        try:
            async for _ in requests:
                pass
        except PeerDisconnectedError:
            outcome.append("client left")
            raise
        yield Int64Value()

    async with rpc_pair() as p:
        p.server.add_stream("collect", Int64Value, collect)
        serve_defaults(p.server)
        async with p.client.open_stream_call(SERVER, "collect", Int64Value, timeout=5) as call:
            await call.send(Int64Value(value=1))
            # leaving without done_sending(): the stream is reset
        with trio.fail_after(5):
            while p.served < 1:
                await trio.sleep(0.01)
        assert outcome == ["client left"]
        assert (await p.client.call(SERVER, "echo", StringValue(value="x"), StringValue)).value


async def test_client_that_gives_up_cancels_the_unary_handler() -> None:
    started, cancelled = trio.Event(), trio.Event()

    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError

    async with rpc_pair() as p:
        p.server.add_unary("slow", StringValue, slow)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(p.client.call, SERVER, "slow", StringValue(), StringValue)
            with trio.fail_after(5):
                await started.wait()
            nursery.cancel_scope.cancel()  # the caller is cancelled long before the 30 s deadline
        with trio.fail_after(5):
            await cancelled.wait()


async def test_stream_call_misuse() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        async with p.client.open_stream_call(SERVER, "double_each", Int64Value, timeout=5) as call:
            await call.done_sending()
            await call.done_sending()  # idempotent
            with pytest.raises(RuntimeError):
                await call.send(Int64Value())
            assert [r async for r in call] == []
            with pytest.raises(InvalidMessageError):
                await call.receive()


async def test_error_in_the_callers_block_propagates_as_itself() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        with pytest.raises(KeyError):
            async with p.client.open_stream_call(SERVER, "double_each", Int64Value, timeout=5):
                raise KeyError("mine")


# ---------------------------------------------------------------------- a busy server with bad neighbours


async def test_good_calls_succeed_among_bad_ones(autojump_clock: trio.testing.MockClock) -> None:
    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        await trio.sleep(100)
        return request

    async def broken(request: StringValue, ctx: CallContext) -> StringValue:
        raise RuntimeError("no")

    async with rpc_pair(server_max=4096, client_max=1 << 20) as p:
        serve_defaults(p.server)
        p.server.add_unary("slow", StringValue, slow)
        p.server.add_unary("broken", StringValue, broken)
        good: list[int] = []
        errors: list[type[BaseException]] = []

        async def good_call(i: int) -> None:
            response = await p.client.call(SERVER, "echo", StringValue(value=str(i)), StringValue, timeout=20)
            assert response.value.startswith(f"{i} ")
            good.append(i)

        async def bad_call(method: str, request: StringValue) -> None:
            try:
                await p.client.call(SERVER, method, request, StringValue, timeout=5)
            except RpcError as e:
                errors.append(type(e))

        async def garbage() -> None:
            stream = await p.open_raw()
            await stream.write(b"\x04junk")
            await read_reply(stream)

        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(good_call, i)
                if i % 10 == 0:
                    nursery.start_soon(bad_call, "slow", StringValue())
                    nursery.start_soon(bad_call, "broken", StringValue())
                    nursery.start_soon(bad_call, "missing", StringValue())
                    nursery.start_soon(bad_call, "echo", StringValue(value="x" * 10_000))
                    nursery.start_soon(garbage)
        assert sorted(good) == list(range(100))
        assert len(errors) == 40
        assert {e.__name__ for e in errors} >= {"HandlerError", "UnknownMethodError", "MessageTooLargeError"}
        assert set(errors) <= {HandlerError, UnknownMethodError, MessageTooLargeError, DeadlineExceededError, RpcTimeoutError}



# ---------------------------------------------------------------------- streams carry one call after another


async def test_sequential_calls_share_one_stream() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        for i in range(20):
            response = await p.client.call(SERVER, "echo", StringValue(value=str(i)), StringValue)
            assert response.value.startswith(f"{i} ")
        async with p.client.open_stream_call(SERVER, "count_up", Int64Value, timeout=5) as call:
            await call.send(Int64Value(value=3))
            await call.done_sending()
            assert [r.value async for r in call] == [0, 1, 2]
        assert (await p.client.call(SERVER, "echo", StringValue(value="last"), StringValue)).value
        assert p.opened == 1


async def test_a_stream_is_not_reused_after_an_error() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        with pytest.raises(UnknownMethodError):
            await p.client.call(SERVER, "nope", StringValue(), StringValue)
        assert (await p.client.call(SERVER, "echo", StringValue(value="x"), StringValue)).value
        assert p.opened == 2


async def test_stream_reused_after_handler_stopped_reading_early() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        p.server.add_stream("first_only", Int64Value, first_only)
        async with p.client.open_stream_call(SERVER, "first_only", Int64Value, timeout=5) as call:
            for i in range(10):
                await call.send(Int64Value(value=i + 7))
            # no done_sending(): leaving the block sends the end marker
            assert [r.value async for r in call] == [7]
        # The server skipped requests 8..16 up to the end marker; the stream is in step.
        assert (await p.client.call(SERVER, "echo", StringValue(value="next"), StringValue)).value.startswith("next")
        assert p.opened == 1


async def test_idle_stream_whose_server_end_died_is_replaced_transparently() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        await p.server_ends[0].reset()  # e.g. the connection under it went down
        assert (await p.client.call(SERVER, "echo", StringValue(value="x"), StringValue)).value.startswith("x")
        assert p.opened == 2


async def test_idle_streams_expire_on_both_sides(autojump_clock: trio.testing.MockClock) -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        await trio.sleep(p.client._pool.idle_timeout + 1)
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        assert p.opened == 2  # the first stream was too old to reuse, and was closed
        with trio.fail_after(1):
            while p.served < 1:
                await trio.sleep(0.1)
        # The server drops the stream the client keeps idle, once the server's own limit passes.
        await trio.sleep(61)
        assert p.served == 2


async def test_cancelled_call_never_returns_its_stream() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        started = trio.Event()

        async def hang(request: StringValue, ctx: CallContext) -> StringValue:
            started.set()
            await trio.sleep_forever()
            raise AssertionError

        p.server.add_unary("hang", StringValue, hang)
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(p.client.call, SERVER, "hang", StringValue(), StringValue)
            await started.wait()
            nursery.cancel_scope.cancel()
        assert len(p.client._pool) == 0
        assert (await p.client.call(SERVER, "echo", StringValue(value="x"), StringValue)).value.startswith("x")
        assert p.opened == 2


async def test_idle_streams_are_bounded_per_peer() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(p.client.call, SERVER, "echo", StringValue(), StringValue)
        assert len(p.client._pool) == 16
        await p.client.close_idle_streams(expired_only=False)
        assert len(p.client._pool) == 0
        await p.wait_served()


def test_idle_timeout_must_stay_well_below_the_servers() -> None:
    with pytest.raises(ValueError):
        Rpc(_never_open, idle_timeout=45)
    Rpc(_never_open, idle_timeout=0)


async def test_back_to_back_calls_never_trip_over_the_previous_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The next call's frames may reach the server before its write of the
    # previous answer has returned; they must count as the next call, not as
    # the client giving up.
    async with rpc_pair() as p:
        p.server_write_delay = 0.5
        serve_defaults(p.server)
        for i in range(50):
            assert (await p.client.call(SERVER, "echo", StringValue(value=str(i)), StringValue)).value
        assert p.opened == 1


async def test_client_enforces_its_deadline_when_the_server_never_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ends: list[FakeStream] = []

    async def black_hole(peer_id: ID, protocol: str) -> FakeStream:
        mine, theirs = fake_stream_pair()
        ends.append(theirs)  # nobody reads or answers it
        return mine

    client = Rpc(black_hole)
    start = trio.current_time()
    with pytest.raises(RpcTimeoutError):
        await client.call(SERVER, "echo", StringValue(), StringValue, timeout=4.0)
    assert 4.0 <= trio.current_time() - start < 4.1
    async with client.open_stream_call(SERVER, "echo", StringValue, timeout=2.0) as call:
        with pytest.raises(RpcTimeoutError):
            await call.receive()
    assert isinstance(RpcTimeoutError("x"), TimeoutError)


async def test_reuse_can_be_turned_off() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        p.client = Rpc(p.client._open_stream, idle_timeout=0)
        for _ in range(3):
            await p.client.call(SERVER, "echo", StringValue(), StringValue)
        assert p.opened == 3
