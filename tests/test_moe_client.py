"""training/moe/client.py, the expert client, with the test as every expert server.

A real :class:`ExpertClient` calls over the in-memory swarm (tests/fake_swarm.py) under trio's autojump
clock; each server is a stream handler the test writes (:class:`Server`): it reads every request whole
(its header and tensors) and answers byte for byte, honestly (a forward doubles its input, a backward
doubles the gradient) or as the test says (a refusal, a wrong shape, NaN, garbage, nothing, a close, a
reset). What is checked is the client's side: what it sends, on which stream, in which slot and
group, what it makes of each answer, whom it bans for how long and why, its counts, and its thread
edge (torch code in a worker thread, with the real clock). The client against real expert servers is
test_moe_layer's and test_moe's; its decisions alone, test_moe_calls'.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import torch
import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from averaging.tensor_stream import receive_tensors, tensors_message
from averaging.wire import FrameReader, frame
from libp2p.network.stream.exceptions import StreamError, StreamReset

from p2p.errors import ConfigError, describe
from p2p.multistream import PeerRefused
from p2p.resources import ResourceLimitExceeded, Scope
from training.moe.calls import ClientConfig
from training.moe.client import ExpertClient, RemoteExpert, Results
from training.moe.protocol import (MAX_REQUEST_HEADER, PROTOCOL, Expert, ExpertCallError, Kind, KindValue, Status,
                                   StatusValue)
from training.proto import moe_pb2 as pb

from .fake_swarm import FakeSwarm, fake_swarms
from .kit import log_lines

LOG = "training.moe.client"
HID = 4
#: the trio time every test starts at (a sum where a difference belongs shows)
START = 5.0

#: what a server does with one request: an answer's bytes, or one of these words, or None: honestly
STALL, CLOSE, RESET = "stall", "close", "reset"
Script = Callable[[pb.ExpertRequest, list[torch.Tensor], "Server"], bytes | str | None]


def x_of(rows: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(start, start + rows * HID, dtype=torch.float32).reshape(rows, HID)


async def answer(tensors: list[torch.Tensor], status: StatusValue = Status.OK, reason: str = "", **fields: Any) -> bytes:
    return await tensors_message(tensors, prefix=frame(pb.ExpertResponse(status=status, reason=reason, **fields)))


@dataclass
class Server:
    """An expert server the test plays on ``swarm``: every request read whole and answered in order, as
    ``script`` says (None: honestly); ``delay`` s before each answer."""

    swarm: FakeSwarm
    script: Script | None = None
    delay: float = 0.0
    requests: list[tuple[pb.ExpertRequest, list[torch.Tensor]]] = field(default_factory=list)
    #: each request's stream number (the first stream is 1) and trio time
    on: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    streams: int = 0
    #: the server ends of the streams, and how each ended ("closed" by the client, "reset")
    ends: dict[int, str] = field(default_factory=dict)
    in_flight: int = 0
    most_in_flight: int = 0
    #: reset each stream right after its answer
    reset_after_answer: bool = False

    def __post_init__(self) -> None:
        self.swarm.set_stream_handler(PROTOCOL, self.serve)

    @property
    def peer_id(self) -> ID:
        return self.swarm.peer_id

    def expert(self, uid: str = "ffn.0.0", addrs: tuple[Multiaddr, ...] = ()) -> Expert:
        return Expert(uid, self.swarm.peer_id, addrs)

    async def honest(self, request: pb.ExpertRequest, tensors: list[torch.Tensor]) -> bytes:
        if request.kind == Kind.INFO:
            return await answer([torch.zeros(1, HID), torch.zeros(1, HID + 1)])
        out = tensors[-1].float() * 2  # a forward's input, a backward's gradient
        if request.uids:
            return await answer([out.to(tensors[-1].dtype)], statuses=[Status.OK] * len(request.uids),
                                reasons=[""] * len(request.uids))
        return await answer([out.to(tensors[-1].dtype)])

    async def serve(self, stream: Any) -> None:
        self.streams += 1
        number = self.streams
        reader = FrameReader(stream)
        try:
            while True:
                if await reader.at_eof():
                    self.ends[number] = "closed"
                    return
                request = await reader.message(pb.ExpertRequest, "request", max_size=MAX_REQUEST_HEADER)
                tensors = [] if request.kind == Kind.INFO else await receive_tensors(
                    reader, max_bytes=1 << 24, max_tensors=2)
                self.requests.append((request, tensors))
                self.on.append(number)
                self.times.append(trio.current_time())
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                try:
                    if self.delay:
                        await trio.sleep(self.delay)
                    said = self.script(request, tensors, self) if self.script is not None else None
                    if said == STALL:
                        await trio.sleep_forever()
                    if said == CLOSE:
                        await stream.close()
                        self.ends[number] = "closed here"
                        return
                    if said == RESET:
                        await stream.reset()
                        self.ends[number] = "reset here"
                        return
                    await stream.write(await self.honest(request, tensors) if said is None else cast(bytes, said))
                    if self.reset_after_answer:
                        await stream.reset()
                        self.ends[number] = "reset here"
                        return
                finally:
                    self.in_flight -= 1
        except Exception:
            self.ends[number] = "reset"


def said(data: bytes | str) -> Script:
    """A script that answers every request with ``data``."""
    return lambda request, tensors, server: data


@asynccontextmanager
async def client_of(n: int = 2, *, start: float = START, **config: Any
                    ) -> AsyncIterator[tuple[ExpertClient, list[Server]]]:
    """A client on peer 0 (``config``'s settings) and peers 1.. as servers, from trio time ``start`` on
    (0 on the real clock)."""
    async with fake_swarms(n) as peers:
        await trio.sleep(start)
        servers = [Server(p) for p in peers[1:]]
        async with ExpertClient.open(peers[0], ClientConfig(**config)) as client:
            yield client, servers


def failing_writes(me: FakeSwarm, error: Callable[[], Exception]) -> None:
    """Each new stream of ``me``'s fails its writes with ``error()`` (reset before the request went, a
    node that refused it over a limit)."""
    opened = me.new_stream

    async def refusing(peer_id: ID, protocol: str) -> Any:
        stream = await opened(peer_id, protocol)

        async def write(data: bytes) -> None:
            await trio.lowlevel.checkpoint()
            raise error()

        stream.write = write
        return stream

    me.new_stream = refusing  # type: ignore[method-assign]


# ---------------------------------------------------------------------------- one call


async def test_a_forward_sends_the_rows_and_gives_the_experts_answer(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        x = x_of(3)
        y = await client.forward(server.expert(), x)
        assert torch.equal(y, x * 2) and y.dtype == torch.float32
        (request, tensors), = server.requests
        assert request == pb.ExpertRequest(uid="ffn.0.0", kind=Kind.FORWARD, half=False)
        assert len(tensors) == 1 and torch.equal(tensors[0], x)
        assert (client.stats.calls, client.stats.failures) == (1, 0)
        assert not x.requires_grad
        await client.forward(server.expert(), x.double())
        assert server.requests[1][1][0].dtype == torch.float32


async def test_a_backward_sends_the_input_and_its_gradient(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        x, grad = x_of(2), x_of(2, 100.0)
        gx = await client.backward(server.expert("ffn.1.2"), x.requires_grad_(), grad)
        assert torch.equal(gx, grad * 2)
        (request, tensors), = server.requests
        assert (request.uid, request.kind) == ("ffn.1.2", Kind.BACKWARD)
        assert [t.tolist() for t in tensors] == [x.tolist(), grad.tolist()]


async def test_info_gives_the_shapes_of_one_row_in_and_out(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        assert await client.info(server.expert()) == (torch.Size([HID]), torch.Size([HID + 1]))
        (request, tensors), = server.requests
        assert request.kind == Kind.INFO and tensors == []


async def test_half_sends_and_takes_float16_and_gives_float32(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(half=True) as (client, (server,)):
        y = await client.forward(server.expert(), x_of(2).double())
        (request, tensors), = server.requests
        assert request.half and tensors[0].dtype == torch.float16
        assert y.dtype == torch.float32 and torch.equal(y, x_of(2) * 2)


async def test_an_experts_addresses_are_given_to_the_swarm(autojump_clock: trio.abc.Clock) -> None:
    addr = Multiaddr("/ip4/127.0.0.1/tcp/4001")
    async with client_of() as (client, (server,)):
        await client.forward(server.expert(), x_of(1))
        assert cast(FakeSwarm, client.peer).known == {}
        await client.forward(server.expert(addrs=(addr,)), x_of(1))
        assert cast(FakeSwarm, client.peer).known == {server.peer_id: [addr]}


@pytest.mark.parametrize("kind, timeout", [(Kind.FORWARD, 10.0), (Kind.INFO, 10.0), (Kind.BACKWARD, 20.0)])
async def test_a_call_without_an_answer_times_out_at_its_kinds_timeout_and_bans_the_expert(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, kind: KindValue, timeout: float) -> None:
    caplog.set_level(logging.INFO, LOG)
    async with client_of() as (client, (server,)):
        server.script = said(STALL)
        expert = server.expert()
        start = trio.current_time()
        with pytest.raises(ExpertCallError) as e:
            if kind == Kind.INFO:
                await client.info(expert)
            elif kind == Kind.FORWARD:
                await client.forward(expert, x_of(1))
            else:
                await client.backward(expert, x_of(1), x_of(1))
        assert trio.current_time() - start == pytest.approx(timeout)
        assert str(e.value) == f"expert {expert}: no answer within {timeout:.1f} s"
        assert e.value.timed_out and not e.value.busy and not e.value.unreachable
        assert client.banned(expert.uid, expert.peer_id) and client.ban_left(expert) == pytest.approx(30.0)
        assert not client.banned("ffn.9.9", expert.peer_id) and not client.unreachable(expert.peer_id)
        assert (client.stats.calls, client.stats.failures, client.stats.timeouts) == (1, 1, 1)
        assert client.stats.reasons == [str(e.value)]
        assert log_lines(caplog, LOG, "expert ") == [f"expert {expert} left out for 30 s: {e.value}"]
        await trio.sleep(30)
        assert not client.banned(expert.uid, expert.peer_id) and client.ban_left(expert) == 0


async def test_a_call_with_its_own_timeout_takes_it(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(forward_timeout=50.0, backward_timeout=60.0) as (client, (server,)):
        server.script = said(STALL)
        for call, timeout in ((client.forward(server.expert(), x_of(1), timeout=3.0), 3.0),
                              (client.forward(server.expert(), x_of(1)), 50.0),
                              (client.backward(server.expert(), x_of(1), x_of(1), timeout=4.0), 4.0),
                              (client.backward(server.expert(), x_of(1), x_of(1)), 60.0),
                              (client.info(server.expert(), timeout=5.0), 5.0), (client.info(server.expert()), 50.0)):
            start = trio.current_time()
            with pytest.raises(ExpertCallError, match=f"no answer within {timeout:.1f} s"):
                await call
            assert trio.current_time() - start == pytest.approx(timeout)


@pytest.mark.parametrize("status, busy, ban", [(Status.OVERLOADED, True, 1.0), (Status.FAILED, False, 30.0),
                                               (Status.UNKNOWN_EXPERT, False, 30.0)])
async def test_a_refusal_names_its_status_and_reason_and_bans_as_long_as_it_deserves(
        autojump_clock: trio.abc.Clock, status: StatusValue, busy: bool, ban: float) -> None:
    async with client_of() as (client, (server,)):
        server.script = said(frame(pb.ExpertResponse(status=status, reason="why not")))
        expert = server.expert()
        with pytest.raises(ExpertCallError) as e:
            await client.forward(expert, x_of(1))
        assert str(e.value) == f"expert {expert}: {Status.Name(status).lower()}: why not"
        assert e.value.busy == busy and not e.value.timed_out
        assert client.ban_left(expert) == pytest.approx(ban)
        await trio.sleep(0.1)
        assert client.stats.timeouts == 0 and server.ends == {1: "reset"}  # a refused call's stream is not kept


async def test_too_many_rows_fail_before_any_stream(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_rows=4) as (client, (server,)):
        expert = server.expert()
        assert torch.equal(await client.forward(expert, x_of(4)), x_of(4) * 2)
        with pytest.raises(ExpertCallError) as e:
            await client.forward(expert, x_of(5))
        assert str(e.value) == f"expert {expert}: 5 rows in one call, more than max_rows 4"
        assert len(server.requests) == 1 and client.banned(expert.uid, expert.peer_id)


async def test_an_unreachable_server_leaves_out_every_expert_of_it(autojump_clock: trio.abc.Clock,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOG)
    async with client_of() as (client, (server,)):
        expert = server.expert()
        server.swarm.kill()
        with pytest.raises(ExpertCallError) as e:
            await client.forward(expert, x_of(1))
        assert e.value.unreachable and str(e.value).startswith(f"expert {expert}: ")
        assert client.unreachable(expert.peer_id) and client.banned("ffn.7.7", expert.peer_id)
        assert log_lines(caplog, LOG, "expert ") == [
            f"expert {expert} and every expert of its server (unreachable) left out for 30 s: {e.value}"]


@pytest.mark.parametrize("kind, wrong, message", [
    (Kind.FORWARD, [torch.zeros(2, HID)], "answered [2, 4] for 3 rows"),
    (Kind.FORWARD, [torch.zeros(3, HID), torch.zeros(3, HID)], "answered 2 tensors, not 1"),
    (Kind.FORWARD, [torch.tensor(1.0)], "answered [] for 3 rows"),
    (Kind.BACKWARD, [torch.zeros(3, HID + 1)], "input gradient [3, 5] for an input of [3, 4]"),
    (Kind.INFO, [torch.zeros(1, HID)], "answered 1 tensors, not 2"),
])
async def test_a_wrong_answer_fails_the_call_and_its_stream_is_not_kept(
        autojump_clock: trio.abc.Clock, kind: KindValue, wrong: list[torch.Tensor], message: str) -> None:
    async with client_of() as (client, (server,)):
        expert = server.expert()
        server.script = said(await answer(wrong))
        with pytest.raises(ExpertCallError) as e:
            await client.call(expert, kind, [] if kind == Kind.INFO else [x_of(3), x_of(3)][:1 + (kind == Kind.BACKWARD)],
                              timeout=10.0)
        assert str(e.value) == f"expert {expert}: {message}"
        server.script = None
        await client.call(expert, Kind.INFO, [], timeout=10.0)
        assert server.on == [1, 2]  # the second call on a new stream


@pytest.mark.parametrize("garbage, message", [
    ("nan", "bad answer: "),
    ("too big", "bad answer: "),
    ("header", "bad answer: "),
])
async def test_an_answer_that_does_not_read_resets_its_stream(autojump_clock: trio.abc.Clock, garbage: str,
                                                             message: str) -> None:
    async with client_of() as (client, (server,)):
        expert = server.expert()
        if garbage == "nan":
            server.script = said(await answer([torch.full((1, HID), float("nan"))]))
        elif garbage == "too big":  # more than 4 bytes x 65536 values a row for one row
            server.script = said(await answer([torch.zeros(1, (1 << 16) + 1)]))
        else:
            server.script = said(frame(pb.ExpertResponse(status=Status.OK)) + b"\x05\xff\xff\xff\xff\xff")
        with pytest.raises(ExpertCallError) as e:
            await client.forward(expert, x_of(1))
        assert str(e.value).startswith(f"expert {expert}: {message}")
        await trio.sleep(1)
        assert server.ends == {1: "reset"} and client.banned(expert.uid, expert.peer_id)


# ---------------------------------------------------------------------------- kept streams


async def test_streams_are_kept_between_calls_and_reset_when_the_client_closes(autojump_clock: trio.abc.Clock) -> None:
    async with fake_swarms(2) as (me, peer):
        server = Server(peer)
        async with ExpertClient.open(me) as client:
            for i in range(3):
                await client.forward(server.expert(), x_of(1, i))
            assert server.on == [1, 1, 1] and server.streams == 1
            assert client._table.servers() == 1
        await trio.sleep(1)
        assert server.ends == {1: "reset"}
        assert client._nursery is None


async def test_a_kept_stream_idle_past_keep_streams_for_is_reset_and_a_new_one_opened(
        autojump_clock: trio.abc.Clock) -> None:
    async with client_of(keep_streams_for=20.0) as (client, (server,)):
        await client.forward(server.expert(), x_of(1))
        await trio.sleep(19.5)
        await client.forward(server.expert(), x_of(1))
        await trio.sleep(20)
        await client.forward(server.expert(), x_of(1))
        assert server.on == [1, 1, 2]
        await trio.sleep(0.1)
        assert server.ends == {1: "reset"}  # by the call that found it too old


async def test_streams_beyond_max_idle_streams_are_reset_at_the_next_call(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_idle_streams=1, max_streams_per_server=4) as (client, (server,)):
        server.delay = 1.0
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(client.forward, server.expert(), x_of(1, i))
        assert server.streams == 3 and server.most_in_flight == 3
        await trio.sleep(1)
        assert server.ends == {}  # taken out of use, reset at the next call
        await client.forward(server.expert(), x_of(1))
        await trio.sleep(1)
        assert sorted(server.ends.values()) == ["reset", "reset"] and server.on[-1] not in server.ends


async def test_a_kept_stream_the_server_closed_is_replaced_once(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        await client.forward(server.expert(), x_of(1))
        server.script = lambda request, tensors, s: CLOSE if s.on[-1] == 1 else None
        y = await client.backward(server.expert(), x_of(1), x_of(1, 3.0))  # even a backward: it never arrived
        assert torch.equal(y, x_of(1, 3.0) * 2) and server.on == [1, 1, 2]


@pytest.mark.parametrize("kind, tries", [(Kind.FORWARD, 2), (Kind.INFO, 2), (Kind.BACKWARD, 1)])
async def test_a_new_stream_ended_before_an_answer_is_tried_again_unless_a_backward(
        autojump_clock: trio.abc.Clock, kind: KindValue, tries: int) -> None:
    async with client_of() as (client, (server,)):
        server.script = said(CLOSE)
        expert = server.expert()
        with pytest.raises(ExpertCallError) as e:
            await client.call(expert, kind, [] if kind == Kind.INFO else [x_of(1), x_of(1)][:1 + (kind == Kind.BACKWARD)],
                              timeout=10.0)
        assert str(e.value) == f"expert {expert}: the stream ended before an answer (closed)"
        assert not e.value.busy and client.ban_left(expert) == pytest.approx(30.0)  # broken, not busy
        assert server.streams == tries and len(server.requests) == tries
        server.script = lambda request, tensors, s: CLOSE if s.streams == tries + 1 else None
        await client.call(expert, Kind.INFO, [], timeout=10.0)
        assert server.streams == tries + 2  # a forward or info: once more on a new stream


async def test_a_reset_before_the_answer_is_retried_on_a_new_stream(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        server.script = lambda request, tensors, s: RESET if s.streams == 1 else None
        assert torch.equal(await client.forward(server.expert(), x_of(1)), x_of(1) * 2)
        assert server.streams == 2
        server.script = said(RESET)
        with pytest.raises(ExpertCallError, match="the stream ended before an answer"):
            await client.backward(server.expert(), x_of(1), x_of(1))


# ---------------------------------------------------------------------------- slots


async def test_calls_past_max_streams_per_server_wait_their_turn_in_order(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=2, max_idle_streams=2) as (client, (server,)):
        server.delay = 1.0
        done: list[int] = []

        async def call(i: int) -> None:
            await trio.sleep(i * 0.01)
            await client.forward(server.expert(), x_of(1, i))
            done.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(call, i)
        assert done == [0, 1, 2, 3, 4] and server.most_in_flight == 2 and server.streams == 2
        assert [round(t - START, 2) for t in server.times] == [0.0, 0.01, 1.0, 1.01, 2.0]


async def test_a_call_that_gave_up_waiting_for_a_slot_gives_it_up(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=1, max_idle_streams=1) as (client, (server,)):
        server.delay = 5.0
        expert = server.expert()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.forward, expert, x_of(1))
            await trio.sleep(0.1)
            with pytest.raises(ExpertCallError, match="no answer within 1.0 s"):
                await client.forward(expert, x_of(1), timeout=1.0)  # waited in line all along
        assert client._table.in_flight(expert.peer_id) == 0
        assert torch.equal(await client.forward(expert, x_of(1, 7.0)), x_of(1, 7.0) * 2)
        assert len(server.requests) == 2


async def test_a_slot_handed_to_a_call_as_it_times_out_is_passed_on(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=1, max_idle_streams=1) as (client, (server,)):
        server.delay = 1.0
        expert = server.expert()
        results: list[str] = []

        async def call(timeout: float, name: str) -> None:
            try:
                await client.forward(expert, x_of(1), timeout=timeout)
                results.append(name)
            except ExpertCallError:
                results.append(f"{name} failed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, 10.0, "first")
            await trio.sleep(0)
            nursery.start_soon(call, 1.0, "second")  # its timeout ends as the first call's slot frees
            await trio.sleep(0)
            nursery.start_soon(call, 10.0, "third")
        assert sorted(results) == ["first", "second failed", "third"]
        assert client._table.in_flight(expert.peer_id) == 0 and len(server.requests) == 2


# ---------------------------------------------------------------------------- several experts in one exchange


async def test_call_many_sends_every_expert_in_one_exchange_and_splits_the_answer(
        autojump_clock: trio.abc.Clock) -> None:
    addr = Multiaddr("/ip4/127.0.0.1/tcp/4001")
    async with client_of() as (client, (server,)):
        experts = [server.expert("ffn.0.0"), server.expert("ffn.0.1", (addr,)), server.expert("ffn.0.2")]
        xs = [[x_of(1)], [x_of(2, 10.0)], [x_of(3, 20.0)]]
        results = await client.call_many(experts, Kind.FORWARD, xs, timeout=10.0)
        assert [r[0].tolist() for r in cast(list[list[torch.Tensor]], results)] == [(x[0] * 2).tolist() for x in xs]
        (request, tensors), = server.requests
        assert request == pb.ExpertRequest(kind=Kind.FORWARD, uids=["ffn.0.0", "ffn.0.1", "ffn.0.2"], rows=[1, 2, 3])
        assert torch.equal(tensors[0], torch.cat([x[0] for x in xs]))
        assert cast(FakeSwarm, client.peer).known == {server.peer_id: [addr]}
        assert (client.stats.calls, client.stats.exchanges, client.stats.joined) == (3, 1, 0)
        assert client.stats.slot_wait_s == 0.0


async def test_call_many_backward_sends_inputs_and_gradients(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(half=True) as (client, (server,)):
        experts = [server.expert("ffn.0.0"), server.expert("ffn.0.1")]
        xs = [[x_of(1), x_of(1, 5.0)], [x_of(2), x_of(2, 9.0)]]
        results = await client.call_many(experts, Kind.BACKWARD, xs, timeout=10.0)
        assert [r[0].tolist() for r in cast(list[list[torch.Tensor]], results)] == [(x[1] * 2).tolist() for x in xs]
        (request, tensors), = server.requests
        assert request.half and [t.dtype for t in tensors] == [torch.float16] * 2
        assert torch.equal(tensors[1].float(), torch.cat([x_of(1, 5.0), x_of(2, 9.0)]))


async def test_call_many_gives_each_expert_its_own_status(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        experts = [server.expert("ffn.0.0"), server.expert("ffn.0.1"), server.expert("ffn.0.2")]
        server.script = said(await answer([torch.ones(3, HID)], statuses=[Status.OK, Status.OVERLOADED, Status.OK],
                                          reasons=["", "queue full", ""]))
        results = await client.call_many(experts, Kind.FORWARD, [[x_of(1)], [x_of(2)], [x_of(2)]], timeout=10.0)
        assert isinstance(results[1], ExpertCallError) and results[1].busy
        assert str(results[1]) == f"expert {experts[1]}: overloaded: queue full"
        assert [list(cast(list[torch.Tensor], r)[0].shape) for r in (results[0], results[2])] == [[1, HID], [2, HID]]
        assert client.ban_left(experts[1]) == pytest.approx(1.0) and not client.banned("ffn.0.0", server.peer_id)
        assert (client.stats.calls, client.stats.failures) == (3, 1)


async def test_call_many_of_no_expert_is_nothing_and_a_wrong_call_is_refused(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(3) as (client, (one, two)):
        assert await client.call_many([], Kind.FORWARD, [], timeout=1.0) == []
        for experts, kind, tensors in (([one.expert(), two.expert()], Kind.FORWARD, [[x_of(1)], [x_of(1)]]),
                                       ([one.expert()], Kind.FORWARD, [[x_of(1)], [x_of(1)]]),
                                       ([one.expert()], Kind.INFO, [[x_of(1)]])):
            with pytest.raises(ValueError, match="call_many: FORWARD or BACKWARD, experts of one server, one tensor"):
                await client.call_many(experts, kind, tensors, timeout=1.0)
        assert client.stats.calls == 0 and one.requests == []


async def test_call_many_over_max_rows_fails_every_expert(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_rows=3) as (client, (server,)):
        experts = [server.expert("ffn.0.0"), server.expert("ffn.0.1")]
        results = await client.call_many(experts, Kind.FORWARD, [[x_of(2)], [x_of(2)]], timeout=10.0)
        what = f"server {str(server.peer_id)[-8:]} (2 experts)"
        assert [str(r) for r in results] == [
            f"expert {e}: {what}: 4 rows in one call, more than max_rows 3" for e in experts]
        assert server.requests == [] and all(client.banned(e.uid, e.peer_id) for e in experts)
        assert client.stats.failures == 2


async def test_call_many_that_times_out_fails_every_expert_as_timed_out(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        server.script = said(STALL)
        experts = [server.expert("ffn.0.0"), server.expert("ffn.0.1")]
        results = await client.call_many(experts, Kind.FORWARD, [[x_of(1)], [x_of(1)]], timeout=2.0)
        what = f"server {str(server.peer_id)[-8:]} (2 experts)"
        assert [str(r) for r in results] == [f"expert {e}: {what}: no answer within 2.0 s" for e in experts]
        assert all(cast(ExpertCallError, r).timed_out and not cast(ExpertCallError, r).busy for r in results)
        assert client.stats.timeouts == 2
        server.swarm.kill()
        results = await client.call_many(experts, Kind.FORWARD, [[x_of(1)], [x_of(1)]], timeout=2.0)
        assert all(cast(ExpertCallError, r).unreachable for r in results)


async def crowd(client: ExpertClient, server: Server, timeouts: Sequence[float], rows: Sequence[int] | None = None,
                kind: KindValue = Kind.FORWARD, starts: Sequence[float] | None = None) -> list[Results]:
    """Calls of one expert each (``ffn.0.i``: ``rows[i]`` rows, default 1, of ``x_of(rows, 10 i)``, and a
    backward's gradient ``x_of(rows, 10 i + 1)``) within ``timeouts[i]``, made ``starts[i]`` s from now:
    by default the first at once (it takes the server's slot), the others from 0.1 s on, 0.01 s apart
    (they find the server busy); each one's results."""
    results: dict[int, Results] = {}
    starts = starts or [0.0] + [0.1 + 0.01 * i for i in range(len(timeouts) - 1)]
    begin = trio.current_time()

    async def call(i: int) -> None:
        await trio.sleep_until(begin + starts[i])
        x = x_of(1 if rows is None else rows[i], 10.0 * i)
        tensors = [x] if kind == Kind.FORWARD else [x, x + 1]
        results[i] = await client.call_many([server.expert(f"ffn.0.{i}")], kind, [tensors], timeout=timeouts[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(timeouts)):
            nursery.start_soon(call, i)
    return [results[i] for i in range(len(timeouts))]


def uids(server: Server) -> list[list[str]]:
    """The experts of each request the server read, in order."""
    return [list(r.uids) for r, _ in server.requests]


async def test_calls_to_a_busy_server_join_into_one_exchange(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=1, max_idle_streams=1) as (client, (server,)):
        server.delay = 1.0
        results = await crowd(client, server, [10.0] * 4, rows=[1, 1, 2, 3])
        assert uids(server) == [["ffn.0.0"], ["ffn.0.1", "ffn.0.2", "ffn.0.3"]]
        assert server.requests[1][0].rows == [1, 2, 3]
        for i, rows in enumerate([1, 1, 2, 3]):
            assert torch.equal(cast(list[torch.Tensor], results[i][0])[0], x_of(rows, 10.0 * i) * 2)
        assert client.stats.joined == 3 and client.stats.exchanges == 2
        assert client.stats.slot_wait_s == pytest.approx(0.9) and client.stats.exchange_s == pytest.approx(2.0)
        assert client._exchanges == {} and client._table.servers() == 1  # its kept stream


@pytest.mark.parametrize("half", [False, True])
async def test_joined_calls_start_a_new_group_past_max_join_bytes(autojump_clock: trio.abc.Clock, half: bool) -> None:
    # two rows' values: 4 bytes each, or 2 with half
    async with client_of(max_streams_per_server=1, max_idle_streams=1, max_join_bytes=2 * HID * (2 if half else 4),
                         half=half) as (client, (server,)):
        server.delay = 1.0
        await crowd(client, server, [10.0] * 4)
        assert uids(server) == [["ffn.0.0"], ["ffn.0.1", "ffn.0.2"], ["ffn.0.3"]]


async def test_a_joined_group_waits_as_long_as_its_latest_caller(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=1, max_idle_streams=1) as (client, (server,)):
        server.delay = 3.0
        # the group goes at 3.0 and is answered at 6.0: too late for its first caller, in time for the second
        results = await crowd(client, server, [10.0, 4.0, 8.0])
        what = f"server {str(server.peer_id)[-8:]} (1 experts)"
        assert str(results[1][0]) == f"expert {server.expert('ffn.0.1')}: {what}: no answer within 4.0 s"
        assert isinstance(results[2][0], list) and len(server.requests) == 2


async def test_a_joined_group_past_every_callers_deadline_fails_them_as_timed_out(
        autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=1, max_idle_streams=1) as (client, (server,)):
        server.delay = 10.0
        results = await crowd(client, server, [20.0, 2.0, 3.0])
        assert [cast(ExpertCallError, results[i][0]).timed_out for i in (1, 2)] == [True, True]
        assert len(server.requests) == 1 and client._exchanges == {}
        assert client._table.in_flight(server.peer_id) == 0


async def test_a_joined_group_that_fails_fails_each_caller(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=1, max_idle_streams=1) as (client, (server,)):
        server.delay = 1.0
        wrong = await answer([torch.ones(2, HID)], statuses=[Status.OK], reasons=[""])
        server.script = lambda request, tensors, s: wrong if len(request.uids) > 1 else None
        results = await crowd(client, server, [10.0] * 3)
        what = f"server {str(server.peer_id)[-8:]} (2 experts of joined calls)"
        assert [str(results[i][0]) for i in (1, 2)] == [
            f"expert {server.expert(f'ffn.0.{i}')}: {what}: answered 1 statuses for 2 experts" for i in (1, 2)]


async def test_joined_calls_are_told_at_once_when_the_client_closes(autojump_clock: trio.abc.Clock) -> None:
    async with fake_swarms(2) as (me, peer):
        server = Server(peer, delay=100.0)
        experts = [server.expert(f"ffn.0.{i}") for i in range(2)]
        results: dict[int, Any] = {}
        async with trio.open_nursery() as outer:
            async with ExpertClient.open(me, ClientConfig(max_streams_per_server=1, max_idle_streams=1)) as client:

                async def call(i: int) -> None:
                    results[i] = await client.call_many([experts[i]], Kind.FORWARD, [[x_of(1)]], timeout=500.0)

                outer.start_soon(call, 0)
                await trio.sleep(0.1)
                outer.start_soon(call, 1)
                await trio.sleep(1)
            closed = trio.current_time()
        assert str(results[1][0]) == (f"expert {experts[1]}: the expert client closed before the exchange")
        assert trio.current_time() - closed < 100


async def test_a_client_made_without_open_never_joins_calls(autojump_clock: trio.abc.Clock) -> None:
    async with fake_swarms(2) as (me, peer):
        server = Server(peer, delay=1.0)
        # no nursery to send a joined group from: each call waits for a slot of its own
        client = ExpertClient(me, ClientConfig(max_streams_per_server=1, max_idle_streams=1),
                              trio.lowlevel.current_trio_token())
        await crowd(client, server, [10.0] * 3)
        assert uids(server) == [["ffn.0.0"], ["ffn.0.1"], ["ffn.0.2"]]
        assert client.stats.joined == 0 and client.stats.exchanges == 3
        assert client.stats.slot_wait_s == pytest.approx(0.9 + 1.89)  # each one's wait, summed
        await client.close_idle()


# ---------------------------------------------------------------------------- settings and stats


async def test_a_bad_setting_is_refused_when_the_client_opens() -> None:
    async with fake_swarms(1) as (me,):
        with pytest.raises(ConfigError, match="max_rows must be at least 1"):
            async with ExpertClient.open(me, ClientConfig(max_rows=0)):
                pass  # pragma: no cover


async def test_the_stats_keep_the_latest_twenty_reasons(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_rows=1) as (client, (server,)):
        for i in range(25):
            with pytest.raises(ExpertCallError):
                await client.forward(server.expert(f"ffn.0.{i}"), x_of(2))
        assert len(client.stats.reasons) == 20 and client.stats.reasons[-1].startswith("expert ffn.0.24@")
        assert client.stats.reasons[0].startswith("expert ffn.0.5@") and client.stats.failures == 25


# ---------------------------------------------------------------------------- the thread edge (the real clock)


async def test_torch_code_in_a_worker_thread_calls_experts_and_trains_through_them() -> None:
    async with client_of(start=0) as (client, (server,)):
        expert = RemoteExpert(client, server.expert())
        x = x_of(2).requires_grad_()

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            y = expert(x)
            y.sum().backward()
            assert x.grad is not None
            return y.detach(), x.grad

        y, grad = await client.run(step)
        assert torch.equal(y, x_of(2) * 2) and torch.equal(grad, torch.full((2, HID), 2.0))
        assert [r.kind for r, _ in server.requests] == [Kind.FORWARD, Kind.BACKWARD]
        assert torch.equal(server.requests[1][1][1], torch.ones(2, HID))


async def test_an_input_that_needs_no_gradient_still_trains_the_expert() -> None:
    async with client_of(start=0) as (client, (server,)):
        expert = RemoteExpert(client, server.expert())

        def step() -> torch.Tensor:
            y = expert(x_of(1).double())
            y.sum().backward()
            return cast(torch.Tensor, y)

        y = await client.run(step)
        assert y.dtype == torch.float64
        assert [r.kind for r, _ in server.requests] == [Kind.FORWARD, Kind.BACKWARD]


async def test_a_call_from_the_loops_own_thread_is_refused_with_the_way_out() -> None:
    async with client_of(start=0) as (client, (server,)):
        message = ("a remote expert was called from the trio loop's own thread, which it would block: run the "
                   "model with `await client.run(fn)` (a worker thread)")
        with pytest.raises(RuntimeError) as e:
            client.blocking(client.forward, server.expert(), x_of(1))
        assert str(e.value) == message
        with pytest.raises(RuntimeError) as e:
            client.blocking_sync(client.banned, "ffn.0.0", server.peer_id)
        assert str(e.value) == message
        assert await client.run(client.blocking_sync, client.banned, "ffn.0.0", server.peer_id) is False
        assert server.requests == []


async def test_run_keeps_at_most_max_threads_threads() -> None:
    async with client_of(start=0, max_threads=2) as (client, _):
        lock, running, most = threading.Lock(), [0], [0]

        def work() -> None:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(client.run, work)
        assert most[0] == 2


async def test_a_thread_trio_did_not_start_reaches_the_loop_too() -> None:
    """Torch's own threads (a CUDA backward runs in autograd's device threads) call experts with the
    client's token."""
    async with client_of(start=0) as (client, (server,)):
        out: list[Any] = []

        def plain_thread() -> None:
            out.append(client.blocking(client.forward, server.expert(), x_of(1)))
            out.append(client.blocking_sync(client.banned, "ffn.0.0", server.peer_id))

        def start_and_join() -> None:
            thread = threading.Thread(target=plain_thread)
            thread.start()
            thread.join(10)

        await trio.to_thread.run_sync(start_and_join)
        assert torch.equal(out[0], x_of(1) * 2) and out[1] is False


async def test_an_info_answer_may_hold_two_rows_of_the_largest_size_and_no_more(autojump_clock: trio.abc.Clock) -> None:
    values = 1 << 16  # MAX_ROW_VALUES: an answer of 4 bytes x 65536 values a row, for each of its tensors
    async with client_of() as (client, (server,)):
        server.script = said(await answer([torch.zeros(1, values), torch.zeros(1, values)]))
        assert await client.info(server.expert()) == (torch.Size([values]), torch.Size([values]))
        server.script = said(await answer([torch.zeros(1, values), torch.zeros(1, values + 1)]))
        with pytest.raises(ExpertCallError, match="bad answer: "):
            await client.info(server.expert("ffn.0.1"))


async def test_a_kept_stream_the_server_reset_while_idle_is_replaced(autojump_clock: trio.abc.Clock,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    async with client_of() as (client, (server,)):
        server.reset_after_answer = True
        await client.forward(server.expert(), x_of(1))
        await trio.sleep(1)
        server.reset_after_answer = False
        y = await client.backward(server.expert(), x_of(1), x_of(1, 3.0))  # the write failed: nothing arrived
        assert torch.equal(y, x_of(1, 3.0) * 2) and server.on == [1, 2]


@pytest.mark.parametrize("kind", [Kind.FORWARD, Kind.BACKWARD])
async def test_a_new_stream_reset_before_the_request_went_fails_the_call_with_the_streams_words(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, kind: KindValue) -> None:
    caplog.set_level(logging.DEBUG, LOG)
    async with client_of() as (client, (server,)):
        # the server reset each stream before our request went: the write fails
        failing_writes(cast(FakeSwarm, client.peer), lambda: StreamReset("the stream was reset"))
        expert = server.expert()
        with pytest.raises(ExpertCallError) as e:
            await client.call(expert, kind, [x_of(1), x_of(1)][:1 + (kind == Kind.BACKWARD)], timeout=10.0)
        assert str(e.value).startswith(f"expert {expert}: ") and "ended before an answer" not in str(e.value)
        assert not e.value.unreachable and not e.value.timed_out
        await trio.sleep(0.1)  # the server's handlers ran
        assert server.streams == (2 if kind == Kind.FORWARD else 1) and server.requests == []
        lines = log_lines(caplog, LOG, f"expert {expert}: a new stream ended before an answer")
        assert len(lines) == (1 if kind == Kind.FORWARD else 0)
        assert all(line.endswith("): once more") for line in lines)


# ---------------------------------------------------------------------------- the survivors' cases


async def test_the_calls_are_counted(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        await client.forward(server.expert(), x_of(1))
        await client.info(server.expert())
        await client.call_many([server.expert("ffn.0.1"), server.expert("ffn.0.2")], Kind.FORWARD,
                               [[x_of(1)], [x_of(1)]], timeout=5.0)
        await client.call_many([server.expert("ffn.0.3")], Kind.FORWARD, [[x_of(1)]], timeout=5.0)
        assert client.stats.calls == 5 and client.stats.exchanges == 2


async def test_each_server_has_slots_of_its_own(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(3, max_streams_per_server=1, max_idle_streams=1) as (client, (one, two)):
        one.delay = two.delay = 1.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.forward, one.expert(), x_of(1))
            nursery.start_soon(client.forward, two.expert(), x_of(1))
        assert one.times == two.times == [START]


async def test_a_stream_whose_reset_hangs_delays_the_next_call_a_tenth_of_a_second(
        autojump_clock: trio.abc.Clock) -> None:
    async with client_of(keep_streams_for=10.0) as (client, (server,)):
        await client.forward(server.expert(), x_of(1))
        (kept, _), = client._table._servers[server.peer_id].kept

        async def hangs() -> None:
            await trio.sleep_forever()

        kept.stream.reset = hangs  # type: ignore[method-assign]
        await trio.sleep(20)
        start = trio.current_time()
        await client.forward(server.expert(), x_of(1))
        assert trio.current_time() - start == pytest.approx(0.1)


async def test_a_refusal_on_a_kept_stream_names_the_expert(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        expert = server.expert()
        await client.forward(expert, x_of(1))
        server.script = said(frame(pb.ExpertResponse(status=Status.FAILED, reason="boom")))
        with pytest.raises(ExpertCallError) as e:
            await client.forward(expert, x_of(1))
        assert str(e.value) == f"expert {expert}: failed: boom" and server.on == [1, 1]


BUSY_REASON = str(ResourceLimitExceeded(Scope.PEER_PROTOCOL, "inbound streams", 128))


def wrapped_refusal() -> Exception:
    """py-libp2p's StreamError hiding the refusal as its cause."""
    try:
        raise PeerRefused(BUSY_REASON)
    except PeerRefused as refusal:
        error = StreamError("stream error")
        error.__cause__ = refusal
        return error


@pytest.mark.parametrize("error", [lambda: PeerRefused(BUSY_REASON), wrapped_refusal], ids=["refusal", "wrapped"])
async def test_a_stream_refused_over_a_limit_is_busy_not_broken(autojump_clock: trio.abc.Clock,
                                                                caplog: pytest.LogCaptureFixture,
                                                                error: Callable[[], Exception]) -> None:
    caplog.set_level(logging.DEBUG, LOG)
    assert PeerRefused(BUSY_REASON).busy
    async with client_of() as (client, (server,)):
        failing_writes(cast(FakeSwarm, client.peer), error)
        expert = server.expert()
        with pytest.raises(ExpertCallError) as e:
            await client.forward(expert, x_of(1))
        described = describe(error())
        if isinstance(error(), PeerRefused):  # one of ours: the stream ended, on either try
            assert str(e.value) == f"expert {expert}: the stream ended before an answer ({described})"
        else:  # a stranger's error on the last try is the call's own
            assert str(e.value) == f"expert {expert}: {described}"
        assert e.value.busy and client.ban_left(expert) == pytest.approx(1.0)
        assert log_lines(caplog, LOG, f"expert {expert}: a new stream") == [
            f"expert {expert}: a new stream ended before an answer ({described}): once more"]


async def test_a_garbled_answer_header_names_the_expert_response(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        server.script = said(b"\x05\xff\xff\xff\xff\xff")
        with pytest.raises(ExpertCallError) as e:
            await client.forward(server.expert(), x_of(1))
        assert "expert response does not parse" in str(e.value)


async def test_an_answer_of_three_tensors_is_refused_as_it_is_read(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        server.script = said(await answer([torch.zeros(1, HID)] * 3))
        with pytest.raises(ExpertCallError) as e:
            await client.forward(server.expert(), x_of(1))
        assert str(e.value).startswith(f"expert {server.expert()}: bad answer: ")


async def test_call_many_refuses_a_wrong_call_in_its_words(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        with pytest.raises(ValueError) as e:
            await client.call_many([server.expert()], Kind.INFO, [[x_of(1)]], timeout=1.0)
        assert str(e.value) == "call_many: FORWARD or BACKWARD, experts of one server, one tensor list each"


async def test_call_many_of_exactly_max_rows_goes(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_rows=3) as (client, (server,)):
        results = await client.call_many([server.expert("ffn.0.0"), server.expert("ffn.0.1")], Kind.FORWARD,
                                         [[x_of(1)], [x_of(2)]], timeout=10.0)
        assert all(isinstance(r, list) for r in results) and len(server.requests) == 1


async def test_joined_backward_calls_go_as_one_backward(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=1, max_idle_streams=1) as (client, (server,)):
        server.delay = 1.0
        results = await crowd(client, server, [10.0] * 3, kind=Kind.BACKWARD)
        assert [r.kind for r, _ in server.requests] == [Kind.BACKWARD] * 2 and uids(server)[1] == ["ffn.0.1", "ffn.0.2"]
        for i in range(3):
            assert torch.equal(cast(list[torch.Tensor], results[i][0])[0], (x_of(1, 10.0 * i) + 1) * 2)


async def test_a_call_of_several_experts_that_fails_whole_names_the_server(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        experts = [server.expert("ffn.0.0"), server.expert("ffn.0.1")]
        what = f"server {str(server.peer_id)[-8:]} (2 experts)"
        server.script = said(frame(pb.ExpertResponse(status=Status.OVERLOADED, reason="full")))
        results = await client.call_many(experts, Kind.FORWARD, [[x_of(1)], [x_of(1)]], timeout=10.0)
        assert [str(r) for r in results] == [f"expert {e}: {what}: overloaded: full" for e in experts]
        assert all(cast(ExpertCallError, r).busy for r in results)
        assert [client.ban_left(e) for e in experts] == [pytest.approx(1.0)] * 2
        server.script = said(CLOSE)
        results = await client.call_many(experts, Kind.FORWARD, [[x_of(1)], [x_of(1)]], timeout=10.0)
        assert [str(r) for r in results] == [
            f"expert {e}: {what}: the stream ended before an answer (closed)" for e in experts]
        server.script = said(await answer([torch.zeros(1, (1 << 16) + 1)], statuses=[Status.OK], reasons=[""]))
        results = await client.call_many(experts[:1], Kind.FORWARD, [[x_of(1)]], timeout=10.0)
        assert str(results[0]).startswith(f"expert {experts[0]}: server {str(server.peer_id)[-8:]} (1 experts): "
                                          "bad answer: ")


async def test_a_call_that_finds_the_group_already_sent_starts_another(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=1, max_idle_streams=1) as (client, (server,)):
        server.delay = 1.0
        results = await crowd(client, server, [10.0] * 3, starts=[0.0, 0.1, 1.5])  # the group goes at 1.0
        assert uids(server) == [["ffn.0.0"], ["ffn.0.1"], ["ffn.0.2"]]
        assert [t - START for t in server.times] == [0.0, 1.0, 2.0]
        assert all(isinstance(r[0], list) for r in results)


async def test_a_group_given_up_before_its_slot_takes_no_more_calls(autojump_clock: trio.abc.Clock) -> None:
    async with client_of(max_streams_per_server=1, max_idle_streams=1) as (client, (server,)):
        server.delay = 10.0
        # the group of the calls at 0.1 and 0.11 is given up at 3.1; the call at 5 makes a group of its own
        results = await crowd(client, server, [40.0, 2.0, 3.0, 30.0], starts=[0.0, 0.1, 0.11, 5.0])
        assert uids(server) == [["ffn.0.0"], ["ffn.0.3"]] and isinstance(results[3][0], list)


async def test_a_backward_of_several_experts_checks_each_gradients_shape(autojump_clock: trio.abc.Clock) -> None:
    async with client_of() as (client, (server,)):
        experts = [server.expert("ffn.0.0"), server.expert("ffn.0.1")]
        server.script = said(await answer([torch.zeros(2, HID + 1)], statuses=[Status.OK] * 2, reasons=[""] * 2))
        results = await client.call_many(experts, Kind.BACKWARD, [[x_of(1), x_of(1)], [x_of(1), x_of(1)]], timeout=5.0)
        assert [str(r) for r in results] == [
            f"expert {e}: input gradient [1, 5] for an input of [1, 4]" for e in experts]
