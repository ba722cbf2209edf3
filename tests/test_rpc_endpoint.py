"""The RPC endpoint's own duties, over in-memory streams: its settings, admission, the count of calls
in flight, and what it does with the streams it keeps for reuse.

test_rpc_protocol covers the calls themselves; these are what an owner of an
``Rpc`` (the Node, the connection manager, the resource manager) relies on.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value, StringValue
from libp2p.peer.id import ID

from p2p.errors import DedlocError
from p2p.rpc import (
    FIRST_APPLICATION_CODE,
    CallContext,
    MessageTooLargeError,
    PeerDisconnectedError,
    RemoteError,
    ResourceLimitError,
    Rpc,
    RpcTimeoutError,
)
from p2p.rpc.server import SERVER_IDLE_TIMEOUT

from .test_rpc_protocol import CLIENT, SERVER, rpc_pair, serve_defaults
from .test_rpc_protocol import server_never_fails  # noqa: F401  (autouse: serve logs no failure of its own)


async def nowhere(peer_id: ID, protocol: str) -> object:
    raise AssertionError("no stream is opened here")


def test_the_defaults() -> None:
    rpc = Rpc(nowhere)  # type: ignore[arg-type]
    assert rpc.default_timeout == 30.0
    assert rpc.max_message_size == 4 * 1024 * 1024
    assert rpc.admit is None
    assert rpc.methods == []


@pytest.mark.parametrize("settings, message", [
    ({"max_message_size": 0}, "max_message_size must be positive, got 0"),
    ({"default_timeout": 0.0}, "default_timeout must be positive, got 0.0"),
    ({"idle_timeout": -1.0}, "idle_timeout must be within [0, 30] s, got -1.0"),
    ({"idle_timeout": SERVER_IDLE_TIMEOUT / 2 + 0.5}, "idle_timeout must be within [0, 30] s, got 30.5"),
    ({"max_idle_streams": -1}, "max_idle_streams must be >= 0, got -1"),
])
def test_bad_settings_are_refused_by_name(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        Rpc(nowhere, **settings)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_the_smallest_good_settings_are_taken() -> None:
    rpc = Rpc(nowhere, max_message_size=1, default_timeout=0.5,  # type: ignore[arg-type]
              idle_timeout=SERVER_IDLE_TIMEOUT / 2, max_idle_streams=0)
    assert rpc.max_message_size == 1 and rpc.default_timeout == 0.5
    Rpc(nowhere, idle_timeout=0)  # type: ignore[arg-type]


def test_methods_need_a_name_and_are_served_once() -> None:
    rpc = Rpc(nowhere)  # type: ignore[arg-type]
    serve_defaults(rpc)
    with pytest.raises(ValueError, match="^a method needs a name$"):
        rpc.add_unary("", StringValue, lambda request, ctx: request)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="^method 'echo' is already served$"):
        rpc.add_unary("echo", StringValue, lambda request, ctx: request)  # type: ignore[arg-type, return-value]
    rpc.remove("echo")
    rpc.remove("echo")  # gone already: fine
    rpc.remove("never served")
    assert "echo" not in rpc.methods


def test_error_registration_says_what_is_wrong() -> None:
    rpc = Rpc(nowhere)  # type: ignore[arg-type]

    class Low(RemoteError):
        code = FIRST_APPLICATION_CODE - 1

    class Mine(RemoteError):
        code = FIRST_APPLICATION_CODE

    class Clash(RemoteError):
        code = FIRST_APPLICATION_CODE

    with pytest.raises(ValueError, match=f"^application error codes start at {FIRST_APPLICATION_CODE}, got 99$"):
        rpc.register_error(Low)
    rpc.register_error(Mine)
    rpc.register_error(Mine)  # the same again: fine
    with pytest.raises(ValueError, match=f"^code {FIRST_APPLICATION_CODE} is already Mine's$"):
        rpc.register_error(Clash)


async def test_a_call_the_owner_does_not_admit_is_refused_with_the_reason() -> None:
    asked: list[tuple[ID, str]] = []

    def admit(peer_id: ID, method: str) -> None:
        asked.append((peer_id, method))
        if method == "echo":
            raise DedlocError("over the limit of 2 echoes a second")

    async with rpc_pair(admit=admit) as p:
        serve_defaults(p.server)
        with pytest.raises(ResourceLimitError) as caught:
            await p.client.call(SERVER, "echo", StringValue(value="x"), StringValue)
        assert caught.value.message == "echo refused: over the limit of 2 echoes a second"
        assert caught.value.peer_id == SERVER
        assert (await p.client.call(SERVER, "blob", Int64Value(value=3), BytesValue)).value == b"bbb"
    assert asked == [(CLIENT, "echo"), (CLIENT, "blob")]


async def test_calls_in_flight_are_counted_both_ways() -> None:
    seen: list[tuple[int, int]] = []
    async with rpc_pair() as p:

        async def look(request: StringValue, ctx: CallContext) -> StringValue:
            seen.append((p.client.in_flight(SERVER), p.server.in_flight(CLIENT)))
            return request

        p.server.add_unary("look", StringValue, look)
        await p.client.call(SERVER, "look", StringValue(value="a"), StringValue)
        async with p.client.open_stream_call(SERVER, "look", StringValue, timeout=5) as call:
            await call.send(StringValue(value="b"))
            await call.done_sending()
            assert [r.value async for r in call] == ["b"]
        assert p.client.in_flight(SERVER) == 0 and p.server.in_flight(CLIENT) == 0
    assert seen == [(1, 1), (1, 1)]


async def test_a_request_over_the_limit_names_itself() -> None:
    async with rpc_pair(client_max=4) as p:
        with pytest.raises(MessageTooLargeError, match="^request of 7 bytes is over max_message_size 4"):
            await p.client.call(SERVER, "echo", StringValue(value="hello"), StringValue)
        assert p.opened == 0


async def test_a_timeout_names_the_method_the_peer_and_the_time(autojump_clock: trio.testing.MockClock) -> None:
    async def never(request: StringValue, ctx: CallContext) -> StringValue:
        await trio.sleep_forever()
        raise AssertionError

    async with rpc_pair() as p:
        p.server.add_unary("never", StringValue, never)
        with pytest.raises(RpcTimeoutError) as caught:
            await p.client.call(SERVER, "never", StringValue(), StringValue, timeout=0.5)
        assert str(caught.value) == f"never on {SERVER} did not answer within 0.5s"
        for bad in (0, -1.0):
            with pytest.raises(ValueError, match=f"^timeout must be positive, got {bad}$"):
                await p.client.call(SERVER, "never", StringValue(), StringValue, timeout=bad)


async def test_idle_streams_are_kept_until_they_expire(autojump_clock: trio.testing.MockClock) -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        await p.client.close_idle_streams()  # only the expired ones, by default
        await trio.sleep(9.5)  # within the default 10 s
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        assert p.opened == 1
        await trio.sleep(10.5)
        await p.client.close_idle_streams()
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        assert p.opened == 2


async def test_forgetting_a_peer_drops_its_idle_streams() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        p.client.forget_peer(SERVER)
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        assert p.opened == 2


async def test_a_peer_that_broke_a_call_loses_its_other_idle_streams() -> None:
    """Two streams idle to one peer; one breaks mid-call: the other likely went down with the
    connection, so the next call opens a new stream rather than try it."""

    async def slow_echo(request: StringValue, ctx: CallContext) -> StringValue:
        await trio.sleep(0.05)
        return request

    async with rpc_pair() as p:

        async def vanish(request: StringValue, ctx: CallContext) -> StringValue:
            for end in list(p.server_ends):  # the connection under both went down
                await end.reset()
            await trio.sleep_forever()
            raise AssertionError


        p.server.add_unary("slow_echo", StringValue, slow_echo)
        p.server.add_unary("vanish", StringValue, vanish)
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(p.client.call, SERVER, "slow_echo", StringValue(), StringValue)
        assert p.opened == 2
        with pytest.raises(PeerDisconnectedError):
            await p.client.call(SERVER, "vanish", StringValue(), StringValue, timeout=5)
        assert len(p.client._pool) == 0
        await p.client.call(SERVER, "slow_echo", StringValue(value="after"), StringValue)
        assert p.opened == 3


async def test_a_pooled_stream_that_fails_its_write_is_reset_not_left_open() -> None:
    async with rpc_pair() as p:
        serve_defaults(p.server)
        await p.client.call(SERVER, "echo", StringValue(), StringValue)
        await p.server_ends[0].reset()  # the idle stream's far end is gone
        assert (await p.client.call(SERVER, "echo", StringValue(value="x"), StringValue)).value.startswith("x")
        assert p.opened == 2
        with pytest.raises(trio.ClosedResourceError):  # our end was reset (and closed) too
            await p.raw[0].read(1)
