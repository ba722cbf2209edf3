"""The RPC layer between real Nodes on loopback: py-libp2p streams, yamux flow control, resets.

Timeouts here are upper bounds only (a hang fails fast); nothing asserts speed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value, StringValue
from libp2p.peer.id import ID

from p2p import Node, NodeConfig
from p2p.identity import new_identity, peer_id_of
from p2p.rpc import (
    RPC_PROTOCOL,
    CallContext,
    DeadlineExceededError,
    ErrorCode,
    HandlerError,
    MessageTooLargeError,
    PeerDisconnectedError,
    PeerUnreachableError,
    RpcStream,
    RpcTimeoutError,
    UnknownMethodError,
    rpc_pb2,
)
from p2p.rpc.framing import END_FRAME, FrameDecoder, encode_call, encode_message

pytestmark = pytest.mark.timeout(60)


async def echo(request: StringValue, ctx: CallContext) -> StringValue:
    return StringValue(value=f"{request.value}@{ctx.peer_id}")


async def double_each(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
    async for request in requests:
        yield Int64Value(value=2 * request.value)


async def blobs(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[BytesValue]:
    async for request in requests:
        for i in range(request.value):
            yield BytesValue(value=bytes([i % 256]) * 300_000)


async def checksum(requests: AsyncIterator[BytesValue], ctx: CallContext) -> AsyncIterator[Int64Value]:
    yield Int64Value(value=sum([sum(r.value) async for r in requests]))


def serve(node: Node) -> None:
    node.rpc.add_unary("echo", StringValue, echo)
    node.rpc.add_stream("double_each", Int64Value, double_each)
    node.rpc.add_stream("blobs", Int64Value, blobs)
    node.rpc.add_stream("checksum", BytesValue, checksum)


async def test_unary_call_between_nodes(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair
    serve(a)
    response = await b.rpc.call(a.peer_id, "echo", StringValue(value="hi"), StringValue, timeout=10)
    assert response.value == f"hi@{b.peer_id}"


async def test_streaming_both_ways_with_flow_control(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair
    serve(a)
    # Server streaming: 6 MB in 300 kB messages, more than yamux's initial window.
    async with b.rpc.open_stream_call(a.peer_id, "blobs", BytesValue, timeout=30) as call:
        await call.send(Int64Value(value=20))
        await call.done_sending()
        sizes = [len(r.value) async for r in call]
    assert sizes == [300_000] * 20
    # Client streaming, the same amount the other way.
    async with b.rpc.open_stream_call(a.peer_id, "checksum", Int64Value, timeout=30) as upload:
        for i in range(20):
            await upload.send(BytesValue(value=bytes([i]) * 300_000))
        await upload.done_sending()
        assert (await upload.receive()).value == sum(i * 300_000 for i in range(20))
    # Bidirectional, sender and receiver in two tasks.
    async with b.rpc.open_stream_call(a.peer_id, "double_each", Int64Value, timeout=30) as both:

        async def sender() -> None:
            for i in range(300):
                await both.send(Int64Value(value=i))
            await both.done_sending()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            got = [r.value async for r in both]
    assert got == [2 * i for i in range(300)]


async def test_slow_handler_hits_the_deadline_and_is_cancelled(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair
    cancelled = trio.Event()

    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        try:
            await trio.sleep(3600)
        finally:
            cancelled.set()
        return request

    a.rpc.add_unary("slow", StringValue, slow)
    serve(a)
    with trio.fail_after(10):  # a hang would be a bug; 1 s deadline + slack
        with pytest.raises((DeadlineExceededError, RpcTimeoutError)):
            await b.rpc.call(a.peer_id, "slow", StringValue(), StringValue, timeout=1.0)
        await cancelled.wait()
    assert (await b.rpc.call(a.peer_id, "echo", StringValue(value="x"), StringValue, timeout=10)).value


async def test_unknown_method_and_handler_error(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair

    async def broken(request: StringValue, ctx: CallContext) -> StringValue:
        raise ZeroDivisionError("bad luck")

    a.rpc.add_unary("broken", StringValue, broken)
    serve(a)
    with pytest.raises(UnknownMethodError) as unknown:
        await b.rpc.call(a.peer_id, "dht.nope", StringValue(), StringValue, timeout=10)
    assert unknown.value.peer_id == a.peer_id
    with pytest.raises(HandlerError, match="ZeroDivisionError: bad luck"):
        await b.rpc.call(a.peer_id, "broken", StringValue(), StringValue, timeout=10)
    assert (await b.rpc.call(a.peer_id, "echo", StringValue(value="x"), StringValue, timeout=10)).value


async def test_oversized_request_refused_then_normal_call(make_config: Callable[..., NodeConfig]) -> None:
    async with (
        Node.open(make_config(max_message_size=64 * 1024)) as server,
        Node.open(make_config(max_message_size=16 << 20)) as client,
    ):
        await client.connect(server.addrs[0])
        serve(server)
        # 12 MB: far over the server's limit and over what yamux lets a stream
        # have in flight (~8 MB once auto-tuned); the server must refuse it
        # without buffering it, and without leaving the client stuck writing.
        with pytest.raises(MessageTooLargeError) as info:
            await client.rpc.call(server.peer_id, "echo", StringValue(value="x" * (12 << 20)), StringValue, timeout=30)
        assert info.value.peer_id == server.peer_id
        response = await client.rpc.call(server.peer_id, "echo", StringValue(value="ok"), StringValue, timeout=10)
        assert response.value.startswith("ok@")


async def read_frames(stream: object, *, limit: int = 1 << 20) -> list[object]:
    """Frames on a raw libp2p stream, up to an end marker or error (or the stream's end)."""
    decoder = FrameDecoder(limit)
    frames: list[object] = []
    while True:
        try:
            data = await stream.read(65536)  # type: ignore[attr-defined]
        except Exception:
            return frames
        if not data:
            return frames
        decoder.feed(data)
        while (frame := decoder.next()) is not None:
            frames.append(frame)
            if isinstance(frame, (rpc_pb2.Error, rpc_pb2.End)):
                return frames


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"\x06garbage!", ErrorCode.INVALID_MESSAGE),
        (encode_message(b"no call"), ErrorCode.INVALID_MESSAGE),
        (encode_call("echo", 5000) + encode_message(b"\xff\xff") + END_FRAME, ErrorCode.INVALID_MESSAGE),
        (b"\xff\xff\xff\xff\x0f", ErrorCode.MESSAGE_TOO_LARGE),
    ],
)
async def test_garbled_frames_on_a_raw_stream(node_pair: tuple[Node, Node], raw: bytes, code: int) -> None:
    a, b = node_pair
    serve(a)
    stream = await b.new_stream(a.peer_id, RPC_PROTOCOL)
    await stream.write(raw)
    with trio.fail_after(10):
        frames = await read_frames(stream)
    await stream.reset()
    assert len(frames) == 1 and isinstance(frames[0], rpc_pb2.Error) and frames[0].code == code
    assert (await b.rpc.call(a.peer_id, "echo", StringValue(value="x"), StringValue, timeout=10)).value


async def test_server_disconnecting_mid_call(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair
    started = trio.Event()

    async def hang(request: StringValue, ctx: CallContext) -> StringValue:
        started.set()
        await trio.sleep(3600)
        return request

    a.rpc.add_unary("hang", StringValue, hang)

    async def drop_client() -> None:
        await started.wait()
        await a.disconnect(b.peer_id)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drop_client)
            with pytest.raises(PeerDisconnectedError):
                await b.rpc.call(a.peer_id, "hang", StringValue(), StringValue, timeout=30)


async def test_client_going_away_cancels_the_handler(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair
    started, cancelled = trio.Event(), trio.Event()

    async def hang(request: StringValue, ctx: CallContext) -> StringValue:
        started.set()
        try:
            await trio.sleep(3600)
        finally:
            cancelled.set()
        return request

    a.rpc.add_unary("hang", StringValue, hang)
    serve(a)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.rpc.call, a.peer_id, "hang", StringValue(), StringValue)
            await started.wait()
            nursery.cancel_scope.cancel()  # the caller gives up long before the 30 s deadline
        await cancelled.wait()  # the reset reached the server, which stopped the handler
    assert (await b.rpc.call(a.peer_id, "echo", StringValue(value="x"), StringValue, timeout=10)).value


async def test_client_disconnecting_mid_stream(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair
    left = trio.Event()
    first = trio.Event()

    async def collect(requests: AsyncIterator[Int64Value], ctx: CallContext) -> AsyncIterator[Int64Value]:
        try:
            async for _ in requests:
                first.set()
        except PeerDisconnectedError:
            left.set()
            raise
        yield Int64Value()

    a.rpc.add_stream("collect", Int64Value, collect)
    with trio.fail_after(20):
        with pytest.raises(PeerDisconnectedError):
            async with b.rpc.open_stream_call(a.peer_id, "collect", Int64Value, timeout=30) as call:
                await call.send(Int64Value(value=1))
                # mid-stream: the server is reading (the stream's protocol is proposed with its
                # first bytes, so a disconnect right after send() can beat the call itself there)
                await first.wait()
                await b.disconnect(a.peer_id)
                await call.receive()
        await left.wait()


async def test_unreachable_peer() -> None:
    async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])) as node:
        stranger = peer_id_of(new_identity())
        with trio.fail_after(10):
            with pytest.raises(PeerUnreachableError):
                await node.rpc.call(stranger, "echo", StringValue(), StringValue, timeout=5)


async def test_many_concurrent_callers(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair
    serve(a)
    results: dict[int, str] = {}

    async def caller(k: int) -> None:
        for j in range(8):
            i = k * 8 + j
            results[i] = (await b.rpc.call(a.peer_id, "echo", StringValue(value=str(i)), StringValue, timeout=30)).value

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for k in range(32):
                nursery.start_soon(caller, k)
    assert results == {i: f"{i}@{b.peer_id}" for i in range(256)}


async def test_calls_reuse_a_stream_and_survive_a_reconnect(node_pair: tuple[Node, Node]) -> None:
    a, b = node_pair
    serve(a)
    opened: list[str] = []
    open_stream = b.rpc._open_stream

    async def counting(peer_id: ID, protocol: str) -> RpcStream:
        opened.append(protocol)
        return await open_stream(peer_id, protocol)

    b.rpc._open_stream = counting
    for i in range(200):
        assert (await b.rpc.call(a.peer_id, "echo", StringValue(value=str(i)), StringValue, timeout=10)).value
    assert len(opened) == 1
    # The idle stream dies with its connection; the next call notices on its
    # first write (nothing was delivered) and goes through a new connection.
    await b.disconnect(a.peer_id)
    with trio.fail_after(20):
        response = await b.rpc.call(a.peer_id, "echo", StringValue(value="again"), StringValue, timeout=10)
    assert response.value.startswith("again@") and len(opened) == 2
