"""The expert server (training/moe/server.py), piece by piece.

The backend and the batching pools are called directly; the server runs on the in-memory swarm
(tests/fake_swarm.py) with the test as its caller, writing requests byte for byte and reading every
answer whole: statuses, reasons, tensors, and how each stream ends. The clock is the real one
(the server computes in worker threads, during which an autojump clock would leap to the next
deadline), and every wait in these tests is a fraction of a second.
"""

from __future__ import annotations

import logging
import pickle
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from libp2p.network.stream.exceptions import StreamReset

from averaging.tensor_stream import receive_tensors, tensors_message
from averaging.wire import FrameReader, frame
from p2p.varint import encode_varint
from p2p.errors import ConfigError, StreamBrokenError
from training.moe import ExpertBackend, ExpertServer, ServerConfig
from training.moe.grid import ExpertUid, coordinate_subkey
from training.moe.protocol import MAX_EXPERTS, MAX_REQUEST_HEADER, PROTOCOL, Kind, KindValue, Overloaded, Status
from training.moe.server import _Pool, _Task
from training.proto import moe_pb2 as pb

from .fake_swarm import FakeSwarm, fake_swarms
from .kit import log_lines

HID = 4


class Scaled(torch.nn.Module):
    """x -> x * weight (one weight per column; ``out`` HID + 1: x's first column after them), or a failure on
    demand."""

    def __init__(self, out: int = HID) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(1.0, HID + 1))
        self.out = out
        self.fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail == "raise":
            raise RuntimeError("boom")
        y = x * self.weight if self.out == HID else torch.cat([x * self.weight, x[:, :1]], dim=1)
        if self.fail == "nan":
            return y * float("nan")
        if self.fail == "rows":
            return y[:1]
        return y


def backend(uid: str = "ffn.0.0", *, lr: float = 0.1, out: int = HID, optimizer: bool = True,
            max_grad_norm: float | None = None) -> ExpertBackend:
    module = Scaled(out)
    opt = torch.optim.SGD(module.parameters(), lr=lr) if optimizer else None
    return ExpertBackend(uid, module, opt, (HID,), max_grad_norm=max_grad_norm)


def module_of(b: ExpertBackend) -> Scaled:
    assert isinstance(b.module, Scaled)
    return b.module


# ---------------------------------------------------------------------- settings


def test_the_settings_and_what_they_refuse() -> None:
    assert ServerConfig() == ServerConfig(max_batch_size=4096, max_request_rows=4096, max_queue=256, min_batch_size=1,
                                          max_wait=0.0, request_timeout=30.0, idle_timeout=60.0, update_period=30.0,
                                          expiration=90.0, checkpoint_dir=None, checkpoint_every=300.0)
    ServerConfig(max_batch_size=1, min_batch_size=1, max_request_rows=1, max_queue=1, update_period=1.0,
                 expiration=1.5, max_wait=0.0).validate()
    refused = [
        ("experts: max_batch_size must be at least 1, got 0", ServerConfig(max_batch_size=0)),
        ("experts: min_batch_size must be at least 1, got 0", ServerConfig(min_batch_size=0)),
        ("experts: max_request_rows must be at least 1, got 0", ServerConfig(max_request_rows=0)),
        ("experts: max_queue must be at least 1, got 0", ServerConfig(max_queue=0)),
        ("experts: request_timeout must be positive, got 0.0", ServerConfig(request_timeout=0.0)),
        ("experts: idle_timeout must be positive, got -1.0", ServerConfig(idle_timeout=-1.0)),
        ("experts: update_period must be positive, got nan", ServerConfig(update_period=float("nan"))),
        ("experts: expiration must be positive, got 0.0", ServerConfig(expiration=0.0)),
        ("experts: checkpoint_every must be positive, got 0.0", ServerConfig(checkpoint_every=0.0)),
        ("experts: max_wait must be >= 0, got -0.1", ServerConfig(max_wait=-0.1)),
        ("experts: max_wait must be >= 0, got nan", ServerConfig(max_wait=float("nan"))),
        ("experts: min_batch_size (5) exceeds max_batch_size (4)", ServerConfig(min_batch_size=5, max_batch_size=4)),
        ("experts: expiration must be longer than update_period (records would lapse)",
         ServerConfig(update_period=30.0, expiration=30.0)),
    ]
    for message, config in refused:
        with pytest.raises(ConfigError) as caught:
            config.validate()
        assert str(caught.value) == message
    ServerConfig(min_batch_size=4, max_batch_size=4).validate()


# ---------------------------------------------------------------------- the backend


def test_a_backend_takes_a_module_that_maps_a_batch_to_a_batch() -> None:
    b = backend(out=HID + 1)
    assert (b.uid, b.row_shape, b.out_row_shape, b.device) == (ExpertUid.parse("ffn.0.0"), (HID,), (HID + 1,),
                                                             torch.device("cpu"))
    assert [list(t.shape) for t in b.schema()] == [[1, HID], [1, HID + 1]]
    assert (b.forwards, b.backwards, b.rows_processed, b.updates) == (0, 0, 0, 0)  # the example row is no call
    for module in (torch.nn.Flatten(0), _Scalar()):
        with pytest.raises(ConfigError, match=r"^expert ffn\.0\.1: the module must map a \(batch, \.\.\.\) tensor to "
                                              r"a \(batch, \.\.\.\) tensor$"):
            ExpertBackend("ffn.0.1", module, None, (HID,))


class _Scalar(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return 1.0


def test_a_backend_checks_each_request() -> None:
    b = backend(out=HID + 1)
    good, grad = torch.zeros(2, HID), torch.zeros(2, HID + 1)
    assert b.check(Kind.FORWARD, [good], 2) is None and b.check(Kind.BACKWARD, [good, grad], 2) is None
    problems = {
        "forward takes 1 tensors, got 2": (Kind.FORWARD, [good, grad], 4),
        "backward takes 2 tensors, got 1": (Kind.BACKWARD, [good], 4),
        f"expert ffn.0.0 takes rows of shape [{HID}], got a tensor of [2, 3]": (Kind.FORWARD, [torch.zeros(2, 3)], 4),
        f"expert ffn.0.0 takes rows of shape [{HID}], got a tensor of [{HID}]": (Kind.FORWARD, [torch.zeros(HID)], 4),
        "a request holds 1..1 rows, got 2": (Kind.FORWARD, [good], 1),
        "a request holds 1..4 rows, got 0": (Kind.FORWARD, [torch.zeros(0, HID)], 4),
        f"the output gradient must be [2, {HID + 1}], got [2, {HID}]": (Kind.BACKWARD, [good, torch.zeros(2, HID)], 4),
        "tensors must be floating point": (Kind.BACKWARD, [good, torch.zeros(2, HID + 1, dtype=torch.int64)], 4),
    }
    for problem, (kind, tensors, max_rows) in problems.items():
        assert b.check(kind, tensors, max_rows) == problem


def test_a_backward_returns_the_input_gradient_and_steps_the_optimizer() -> None:
    b = backend(lr=0.5)
    x, g = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]]), torch.ones(2, HID)
    y = b.forward(x.double())
    assert y.dtype == torch.float32 and torch.equal(y, x * torch.arange(1.0, 5.0))
    grad_x = b.backward(x.double(), g.double())
    assert grad_x.dtype == torch.float32 and torch.equal(grad_x, torch.arange(1.0, 5.0).expand(2, HID))
    # d(sum g*x*w)/dw = the columns' sums: 2, 3, 4, 5; one SGD step of 0.5
    assert torch.equal(module_of(b).weight.detach(), torch.arange(1.0, 5.0) - 0.5 * torch.tensor([2.0, 3.0, 4.0, 5.0]))
    assert module_of(b).weight.grad is None  # cleared for the next batch
    assert (b.forwards, b.backwards, b.updates, b.rows_processed) == (1, 1, 1, 4)
    b.backward(x, g)
    b.forward(x)
    assert (b.forwards, b.backwards, b.updates, b.rows_processed) == (2, 2, 2, 8)
    # the gradient's norm clipped before the step; no optimizer: no step, still a gradient
    clipped = backend(lr=1.0, max_grad_norm=1.0)
    clipped.backward(x, g)
    step = torch.arange(1.0, 5.0) - module_of(clipped).weight.detach()
    assert torch.allclose(step.norm(), torch.tensor(1.0)) and torch.allclose(step / step.norm(),
                                                                            torch.tensor([2.0, 3, 4, 5]) / 54 ** 0.5)
    assert not x.requires_grad and x.grad is None  # the caller's tensor is left as it was
    frozen = backend(optimizer=False)
    assert torch.equal(frozen.backward(x, g), grad_x)
    assert torch.equal(module_of(frozen).weight.detach(), torch.arange(1.0, 5.0)) and frozen.updates == 0
    assert (frozen.backwards, frozen.rows_processed) == (1, 2)


def test_a_backends_state_round_trips_with_its_optimizer_and_updates() -> None:
    b = backend(lr=0.5)
    b.optimizer = torch.optim.Adam(b.module.parameters(), lr=0.5)
    b.backward(torch.ones(1, HID), torch.ones(1, HID))
    state = b.state_dict()
    assert state["uid"] == "ffn.0.0" and state["updates"] == 1
    fresh = backend()
    fresh.optimizer = torch.optim.Adam(fresh.module.parameters(), lr=0.5)
    fresh.load_state_dict(state)
    assert torch.equal(module_of(fresh).weight, module_of(b).weight) and fresh.updates == 1
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1
    bare = backend(optimizer=False)
    bare.load_state_dict({**state, "optimizer": None, "updates": 3})
    assert bare.updates == 3 and bare.optimizer is None
    old = backend()
    old.load_state_dict({"module": state["module"]})  # an older checkpoint: no optimizer, no count
    assert old.updates == 0 and old.optimizer is not None and not old.optimizer.state_dict()["state"]
    frozen = backend(optimizer=False).state_dict()
    assert (sorted(frozen), frozen["optimizer"], frozen["updates"]) == (["module", "optimizer", "uid", "updates"],
                                                                        None, 0)


# ---------------------------------------------------------------------- the pools


def task(rows: int, start: float = 0.0) -> _Task:
    return _Task([torch.arange(start, start + rows * HID).view(rows, HID)])


@asynccontextmanager
async def running(pool: _Pool) -> AsyncIterator[trio.Lock]:
    device = trio.Lock()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.run, device)
        yield device
        nursery.cancel_scope.cancel()


async def batched(pool: _Pool, tasks: Sequence[_Task]) -> None:
    """``tasks`` queued while the device is busy (so a batch may take them all), then run to the end."""
    async with running(pool) as device:
        async with device:
            for t in tasks:
                pool.submit(t)
            await trio.sleep(0.05)
        await done(tasks)


async def done(tasks: Sequence[_Task]) -> None:
    with trio.fail_after(5):
        for t in tasks:
            await t.done.wait()


async def test_a_pool_batches_what_queued_meanwhile_and_splits_the_answer() -> None:
    b = backend()
    pool = _Pool(b, Kind.FORWARD, ServerConfig(max_batch_size=4))
    tasks = [task(2), task(3, 100.0), task(2, 200.0)]
    await batched(pool, tasks)
    # a batch takes tasks until it holds max_batch_size rows (the last may overshoot it): 2 + 3, then 2
    assert pool.batches == 2 and b.forwards == 2 and b.rows_processed == 7
    for t in tasks:
        assert t.error is None and t.result is not None and torch.equal(t.result, t.tensors[0] * module_of(b).weight)
    # a batch exactly full takes no more
    pool = _Pool(b, Kind.FORWARD, ServerConfig(max_batch_size=4))
    tasks = [task(2), task(2), task(2)]
    await batched(pool, tasks)
    assert pool.batches == 2


async def test_a_full_queue_is_overloaded() -> None:
    pool = _Pool(backend(), Kind.FORWARD, ServerConfig(max_queue=2))
    pool.submit(task(1))
    pool.submit(task(1))
    with pytest.raises(Overloaded, match=r"^expert ffn\.0\.0: 2 requests already queued$"):
        pool.submit(task(1))


async def test_a_small_batch_waits_up_to_max_wait_for_more_rows() -> None:
    b = backend()
    pool = _Pool(b, Kind.FORWARD, ServerConfig(min_batch_size=3, max_wait=0.3))
    async with running(pool):
        started = trio.current_time()
        first = task(1)
        pool.submit(first)
        await trio.sleep(0.1)
        second = task(2)
        pool.submit(second)  # 3 rows: the batch goes at once
        await done([first, second])
        assert trio.current_time() - started < 0.25 and pool.batches == 1
        alone = task(1)
        started = trio.current_time()
        pool.submit(alone)
        await done([alone])
        assert 0.3 <= trio.current_time() - started < 0.5 and pool.batches == 2
        big = task(3)
        started = trio.current_time()
        pool.submit(big)  # enough rows: no wait
        await done([big])
        assert trio.current_time() - started < 0.1
    # without max_wait, min_batch_size alone waits for nothing
    pool = _Pool(b, Kind.FORWARD, ServerConfig(min_batch_size=3))
    async with running(pool):
        started = trio.current_time()
        lone = task(1)
        pool.submit(lone)
        await done([lone])
        assert trio.current_time() - started < 0.1


async def test_tasks_whose_caller_left_are_dropped_from_their_batch() -> None:
    b = backend()
    pool = _Pool(b, Kind.FORWARD, ServerConfig())
    kept, left, also_left = task(1), task(1), task(2)
    async with running(pool) as device:
        async with device:
            for t in (kept, left, also_left):
                pool.submit(t)
            await trio.sleep(0.05)
            left.abandoned = also_left.abandoned = True
        await done([kept])
        await trio.sleep(0.05)
        # a batch of nothing but abandoned tasks takes no device time
        gone = task(1)
        async with device:
            pool.submit(gone)
            await trio.sleep(0.05)
            gone.abandoned = True
        await trio.sleep(0.05)
    assert (pool.dropped, pool.batches, b.forwards, b.rows_processed) == (3, 1, 1, 1)
    assert not left.done.is_set() and left.result is None


async def test_an_expert_that_fails_fails_its_batch_with_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    b = backend()
    reasons = [("raise", Kind.FORWARD, "RuntimeError: boom"), ("raise", Kind.BACKWARD, "RuntimeError: boom"),
               ("nan", Kind.FORWARD, "ExpertFailed: returned NaN or Inf"),
               ("nan", Kind.BACKWARD, "ExpertFailed: returned NaN or Inf"),
               ("rows", Kind.FORWARD, "ExpertFailed: returned 1 rows for 3")]
    for fail, kind, reason in reasons:
        module_of(b).fail = fail
        pool = _Pool(b, kind, ServerConfig())
        tasks = [task(1), task(2)] if kind == Kind.FORWARD else [
            _Task([torch.ones(1, HID), torch.ones(1, HID)]), _Task([torch.ones(2, HID), torch.ones(2, HID)])]
        caplog.clear()
        with caplog.at_level(logging.WARNING, "training.moe.server"):
            await batched(pool, tasks)
        assert [(t.error, t.result) for t in tasks] == [(reason, None)] * 2 and pool.batches == 1
        name = "forward" if kind == Kind.FORWARD else "backward"
        assert [r.getMessage() for r in caplog.records] == [f"expert ffn.0.0: {name} of 3 rows failed: "
                                                            f"{reason.split(': ', 1)[1]}"]


async def test_a_backward_pool_joins_inputs_and_gradients_in_order() -> None:
    b = backend(lr=0.0)
    pool = _Pool(b, Kind.BACKWARD, ServerConfig())
    tasks = [_Task([torch.ones(1, HID), torch.full((1, HID), 2.0)]), _Task([torch.ones(2, HID), torch.ones(2, HID)])]
    await batched(pool, tasks)
    w = torch.arange(1.0, 5.0)
    assert tasks[0].result is not None and torch.equal(tasks[0].result, 2 * w.view(1, HID))
    assert tasks[1].result is not None and torch.equal(tasks[1].result, w.expand(2, HID))
    assert b.backwards == 1


# ---------------------------------------------------------------------- the server, on the in-memory swarm


@asynccontextmanager
async def serving(*backends: ExpertBackend, config: ServerConfig | None = None
                  ) -> AsyncIterator[tuple[ExpertServer, FakeSwarm, FakeSwarm]]:
    async with fake_swarms(2) as (host, caller):
        async with ExpertServer.open(host, backends or [backend()], config) as server:
            yield server, host, caller


class Call:
    """The caller's end of one stream to the server."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.reader = FrameReader(stream)

    @classmethod
    async def open(cls, caller: FakeSwarm, host: FakeSwarm) -> Call:
        return cls(await caller.new_stream(host.peer_id, PROTOCOL))

    async def send(self, request: pb.ExpertRequest, tensors: Sequence[torch.Tensor] = ()) -> None:
        await self.stream.write(await tensors_message(list(tensors), prefix=frame(request)) if tensors
                                else frame(request))

    async def answer(self) -> tuple[pb.ExpertResponse, list[torch.Tensor]]:
        with trio.fail_after(5):
            response = await self.reader.message(pb.ExpertResponse, "expert response")
            if response.status != Status.OK:
                return response, []
            return response, await receive_tensors(self.reader, max_bytes=1 << 20, max_tensors=2)

    async def ended(self) -> str:
        """How the server ended the stream: "closed" or "reset"."""
        with trio.fail_after(5):
            try:
                return "closed" if await self.reader.at_eof() else "open"
            except StreamBrokenError as e:
                assert isinstance(e.__cause__, StreamReset)
                return "reset"


def forward(uid: str = "ffn.0.0", half: bool = False) -> pb.ExpertRequest:
    return pb.ExpertRequest(uid=uid, kind=Kind.FORWARD, half=half)


W = torch.arange(1.0, HID + 1)


async def test_calls_on_one_stream_are_answered_one_after_another() -> None:
    async with serving() as (server, host, caller):
        call = await Call.open(caller, host)
        x = torch.randn(3, HID)
        for half in (False, True):
            await call.send(forward(half=half), [x])
            response, out = await call.answer()
            assert response.status == Status.OK and response.reason == "" and len(out) == 1
            assert out[0].dtype == (torch.float16 if half else torch.float32)
            assert torch.allclose(out[0].float(), x * W, atol=1e-2 if half else 0.0)
        await call.send(pb.ExpertRequest(uid="ffn.0.0", kind=Kind.INFO, half=True))
        response, out = await call.answer()
        assert [(list(t.shape), t.dtype) for t in out] == [([1, HID], torch.float32)] * 2  # the schema is exact
        await call.send(pb.ExpertRequest(uid="ffn.0.0", kind=Kind.BACKWARD), [x, torch.ones(3, HID)])
        response, out = await call.answer()
        assert torch.equal(out[0], W.expand(3, HID))
        await call.stream.close()
        assert await call.ended() == "closed"
        assert (server.calls, server.streams, server.refused, server.abandoned) == (3, 1, {}, 0)
        other = await Call.open(caller, host)
        await other.send(forward(), [x])
        assert (await other.answer())[0].status == Status.OK
        assert (server.calls, server.streams) == (4, 2)


async def test_each_refusal_says_why_and_closes_the_stream() -> None:
    async with serving(backend(), config=ServerConfig(max_request_rows=4)) as (server, host, caller):
        refusals = [
            (forward("ffn.9.9"), [torch.ones(1, HID)], Status.UNKNOWN_EXPERT, "this server does not host 'ffn.9.9'"),
            (forward("x" * 300), [], Status.UNKNOWN_EXPERT, "this server does not host '" + "x" * 99),
            (pb.ExpertRequest(uid="ffn.0.0", kind=KindValue(7)), [], Status.BAD_REQUEST, "unknown request kind 7"),
            (forward(), [torch.ones(2, 3)], Status.BAD_REQUEST,
             f"expert ffn.0.0 takes rows of shape [{HID}], got a tensor of [2, 3]"),
            (pb.ExpertRequest(uid="ffn.0.0", kind=Kind.BACKWARD), [torch.ones(1, HID)], Status.BAD_REQUEST,
             "backward takes 2 tensors, got 1"),
        ]
        for request, tensors, status, reason in refusals:
            call = await Call.open(caller, host)
            await call.send(request, tensors)
            response, _ = await call.answer()
            assert (response.status, response.reason) == (status, reason)
            assert await call.ended() == "closed"
        assert server.refused == {"unknown_expert": 2, "bad_request": 3} and server.calls == 0


async def test_tensors_past_the_limit_or_garbled_are_refused_and_the_stream_reset(
        caplog: pytest.LogCaptureFixture) -> None:
    async with serving(backend(), config=ServerConfig(max_request_rows=4)) as (server, host, caller):
        for tensors, reason in [([torch.ones(5, HID)], r"^tensors 0-0 alone take 80 bytes, over max_bytes=64;"),
                                ([torch.ones(1, HID), torch.ones(1, HID)], r"^2 tensors announced, over max_tensors=1$"),
                                ([torch.full((1, HID), float("nan"))], r"NaN or Inf"),
                                ([torch.ones(1, HID)] * 3, r"^3 tensors announced, over max_tensors=2$")]:
            call = await Call.open(caller, host)
            caplog.clear()
            request = forward() if len(tensors) < 3 else pb.ExpertRequest(uid="ffn.0.0", kind=Kind.BACKWARD)
            with caplog.at_level(logging.DEBUG):
                await call.send(request, tensors)
                response, _ = await call.answer()
                assert response.status == Status.BAD_REQUEST and re.search(reason, response.reason), response.reason
                assert await call.ended() == "reset"
            # the server reset the stream itself: its handler did not fail
            assert server_lines(caplog) == [f"experts: a call from {caller.peer_id} failed: {response.reason}"]
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        # exactly the limit is served: 4 rows of HID floats
        call = await Call.open(caller, host)
        await call.send(forward(), [torch.ones(4, HID)])
        assert (await call.answer())[0].status == Status.OK
        backward_call = await Call.open(caller, host)
        await backward_call.send(pb.ExpertRequest(uid="ffn.0.0", kind=Kind.BACKWARD),
                                 [torch.ones(4, HID), torch.ones(4, HID)])
        assert (await backward_call.answer())[0].status == Status.OK
        assert server.refused == {"bad_request": 4}


async def test_a_failed_expert_answers_failed_and_a_full_queue_overloaded() -> None:
    b = backend()
    async with serving(b, config=ServerConfig(max_queue=1)) as (server, host, caller):
        module_of(b).fail = "raise"
        call = await Call.open(caller, host)
        await call.send(forward(), [torch.ones(1, HID)])
        response, _ = await call.answer()
        assert (response.status, response.reason) == (Status.FAILED, "RuntimeError: boom")
        assert await call.ended() == "closed"
        module_of(b).fail = None
        async with server._device:  # the first call's batch waits for the device, the second queues
            calls = [await Call.open(caller, host) for _ in range(3)]
            for c in calls:
                await c.send(forward(), [torch.ones(1, HID)])
                await trio.sleep(0.02)
            response, _ = await calls[2].answer()
            assert (response.status, response.reason) == (Status.OVERLOADED,
                                                           "expert ffn.0.0: 1 requests already queued")
            assert await calls[2].ended() == "closed"
        assert [(await c.answer())[0].status for c in calls[:2]] == [Status.OK, Status.OK]
        assert server.refused == {"failed": 1, "overloaded": 1} and server.calls == 3


async def test_an_idle_stream_is_closed_and_a_slow_request_reset() -> None:
    async with serving(config=ServerConfig(idle_timeout=0.2, request_timeout=0.3)) as (server, host, caller):
        call = await Call.open(caller, host)
        started = trio.current_time()
        assert await call.ended() == "closed"
        assert 0.2 <= trio.current_time() - started < 0.4
        call = await Call.open(caller, host)
        await call.stream.write(frame(forward()))  # a header, and its tensors never
        started = trio.current_time()
        assert await call.ended() == "reset"
        assert 0.3 <= trio.current_time() - started < 0.5
        # a call answered, then the caller half-closes: the stream ends cleanly at once
        call = await Call.open(caller, host)
        await call.send(forward(), [torch.ones(1, HID)])
        await call.stream.close()
        assert (await call.answer())[0].status == Status.OK
        assert await call.ended() == "closed"


async def test_callers_that_leave_have_their_queued_work_dropped() -> None:
    b = backend()
    async with serving(b) as (server, host, caller):
        async with server._device:
            for request in (forward(), many(["ffn.0.0"], [1])):
                call = await Call.open(caller, host)
                await call.send(request, [torch.ones(1, HID)])
                await trio.sleep(0.02)
                await call.stream.reset()
                await trio.sleep(0.02)
        await trio.sleep(0.05)
        assert server.abandoned == 2 and server._pools[("ffn.0.0", Kind.FORWARD)].dropped == 2 and b.forwards == 0


def many(uids: Sequence[str], rows: Sequence[int], kind: KindValue = Kind.FORWARD) -> pb.ExpertRequest:
    return pb.ExpertRequest(kind=kind, uids=list(uids), rows=list(rows))


async def test_a_call_of_several_experts_answers_each_on_its_own() -> None:
    good, broken, other = backend("ffn.0.0"), backend("ffn.0.1"), backend("ffn.0.2")
    module_of(broken).fail = "raise"
    with torch.no_grad():
        module_of(other).weight.mul_(10)
    async with serving(good, broken, other) as (server, host, caller):
        call = await Call.open(caller, host)
        x = torch.randn(6, HID)
        await call.send(many(["ffn.0.2", "ffn.9.9", "ffn.0.1", "ffn.0.0"], [1, 2, 1, 2]), [x])
        response, out = await call.answer()
        assert response.status == Status.OK
        assert list(response.statuses) == [Status.OK, Status.UNKNOWN_EXPERT, Status.FAILED, Status.OK]
        assert list(response.reasons) == ["", "this server does not host 'ffn.9.9'", "RuntimeError: boom", ""]
        # the answered experts' rows, in the call's order, joined
        assert len(out) == 1 and torch.allclose(out[0], torch.cat([x[:1] * (W * 10), x[4:] * W]))
        half = many(["ffn.0.0"], [2])
        half.half = True
        await call.send(half, [x[:2]])
        response, out = await call.answer()
        assert out[0].dtype == torch.float16 and torch.allclose(out[0].float(), x[:2] * W, atol=1e-2)
        await call.send(many(["ffn.0.0", "ffn.0.2"], [1, 1], Kind.BACKWARD), [x[:2], torch.ones(2, HID)])
        response, out = await call.answer()
        assert list(response.statuses) == [Status.OK, Status.OK]
        assert torch.allclose(out[0], torch.stack([W, W * 10]))
        assert server.calls == 6 and server.refused == {"unknown_expert": 1, "failed": 1}


async def test_a_call_of_several_experts_refuses_what_does_not_add_up() -> None:
    config = ServerConfig(max_request_rows=2000, max_queue=MAX_EXPERTS)
    async with serving(backend("ffn.0.0"), backend("ffn.0.1"), backend("ffn.0.2", out=HID + 1),
                       config=config) as (server, host, caller):
        shape = ("a call of {} experts needs FORWARD or BACKWARD, as many row counts, each >= 1, at most 2000 rows "
                 "in all")
        refusals = [
            (many(["ffn.0.0"], [1], Kind.INFO), [], Status.BAD_REQUEST, shape.format(1)),
            (many(["ffn.0.0", "ffn.0.1"], [1]), [], Status.BAD_REQUEST, shape.format(2)),
            (many(["ffn.0.0", "ffn.0.1"], [1, 0]), [], Status.BAD_REQUEST, shape.format(2)),
            (many(["ffn.0.0", "ffn.0.1"], [1000, 1001]), [], Status.BAD_REQUEST, shape.format(2)),
            (many(["ffn.0.0"] * 1025, [1] * 1025), [], Status.BAD_REQUEST, shape.format(1025)),
            (many(["ffn.9.9", "ffn.9.8"], [1, 1]), [], Status.UNKNOWN_EXPERT, "this server hosts none of them"),
            (many(["ffn.0.0", "ffn.0.2"], [1, 1]), [], Status.BAD_REQUEST,
             "experts of different shapes cannot share a call"),
            (many(["ffn.0.0", "ffn.0.1"], [1, 2]), [torch.ones(2, HID)], Status.BAD_REQUEST,
             "2 rows where the row counts add up to 3"),
            (many(["ffn.0.0", "ffn.0.1"], [1, 1]), [torch.ones(2, 3)], Status.BAD_REQUEST,
             f"expert ffn.0.0 takes rows of shape [{HID}], got a tensor of [2, 3]"),
        ]
        for request, tensors, status, reason in refusals:
            call = await Call.open(caller, host)
            await call.send(request, tensors)
            response, _ = await call.answer()
            assert (response.status, response.reason) == (status, reason), reason
            assert await call.ended() == "closed"
        # more bytes than the declared rows hold (4 rows of 4 float32s: 64; 9 float16 rows are 72), another
        # tensor, NaN: refused, and the stream reset
        garbled = [
            (many(["ffn.0.0", "ffn.0.1"], [2, 2]), [torch.ones(9, HID, dtype=torch.float16)],
             "tensors 0-0 alone take 72 bytes, over max_bytes=64;"),
            (many(["ffn.0.0"], [1], Kind.BACKWARD), [torch.ones(1, HID)] * 3, "3 tensors announced, over max_tensors=2"),
            (many(["ffn.0.0"], [1]), [torch.full((1, HID), float("inf"))], "NaN or Inf"),
        ]
        for request, tensors, reason in garbled:
            call = await Call.open(caller, host)
            await call.send(request, tensors)
            response, _ = await call.answer()
            assert response.status == Status.BAD_REQUEST and reason in response.reason, response.reason
            assert await call.ended() == "reset"
        # the bound itself is served: 64 bytes of float16 rows (8), refused for their count, not their size
        call = await Call.open(caller, host)
        await call.send(many(["ffn.0.0", "ffn.0.1"], [2, 2]), [torch.ones(8, HID, dtype=torch.float16)])
        response, _ = await call.answer()
        assert (response.status, response.reason) == (Status.BAD_REQUEST, "8 rows where the row counts add up to 4")
        assert await call.ended() == "closed"
        # as many experts as a call may name
        call = await Call.open(caller, host)
        await call.send(many(["ffn.0.0"] * MAX_EXPERTS, [1] * MAX_EXPERTS), [torch.ones(MAX_EXPERTS, HID)])
        response, out = await call.answer()
        assert list(response.statuses) == [Status.OK] * MAX_EXPERTS and out[0].shape == (MAX_EXPERTS, HID)
        # max_request_rows in all is within bounds
        call = await Call.open(caller, host)
        await call.send(many(["ffn.0.0", "ffn.0.1"], [1000, 1000]), [torch.ones(2000, HID)])
        response, out = await call.answer()
        assert list(response.statuses) == [Status.OK, Status.OK] and out[0].shape == (2000, HID)
        assert server.calls == MAX_EXPERTS + 2


async def test_a_call_of_several_experts_names_the_one_overloaded_and_cuts_long_reasons() -> None:
    long_uid = "ffn.0.1"  # fails with a reason longer than a status may carry
    async with serving(backend("ffn.0.0"), backend(long_uid), config=ServerConfig(max_queue=1)) as (server, host,
                                                                                                    caller):
        async with server._device:
            first = await Call.open(caller, host)
            await first.send(many(["ffn.0.0"], [1]), [torch.ones(1, HID)])
            await trio.sleep(0.02)
            second = await Call.open(caller, host)
            await second.send(many(["ffn.0.0"], [1]), [torch.ones(1, HID)])
            await trio.sleep(0.02)
            third = await Call.open(caller, host)
            await third.send(many(["ffn.0.0", long_uid], [1, 1]), [torch.ones(2, HID)])
            await trio.sleep(0.02)
        response, out = await third.answer()
        assert list(response.statuses) == [Status.OVERLOADED, Status.OK]
        assert list(response.reasons) == ["expert ffn.0.0: 1 requests already queued", ""]
        assert out[0].shape == (1, HID)
        assert server.refused == {"overloaded": 1} and server.calls == 3
        server.backends[long_uid].module.forward = _long_failure
        call = await Call.open(caller, host)
        await call.send(many([long_uid], [1]), [torch.ones(1, HID)])
        response, out = await call.answer()
        assert list(response.statuses) == [Status.FAILED] and response.reasons[0] == ("RuntimeError: " + "y" * 400)[:300]
        assert out == []
        call = await Call.open(caller, host)
        await call.send(forward(long_uid), [torch.ones(1, HID)])
        response, _ = await call.answer()
        assert response.status == Status.FAILED and response.reason == ("RuntimeError: " + "y" * 600)[:500]


def _long_failure(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("y" * 600)


async def test_a_header_past_its_bound_or_a_caller_gone_mid_reply_resets_the_stream(
        caplog: pytest.LogCaptureFixture) -> None:
    async with serving() as (server, host, caller):
        call = await Call.open(caller, host)
        with caplog.at_level(logging.DEBUG):
            await call.stream.write(encode_varint(MAX_REQUEST_HEADER + 1))
            assert await call.ended() == "reset"
        assert server_lines(caplog) == [f"experts: a call from {caller.peer_id} failed: expert request of "
                                        f"{MAX_REQUEST_HEADER + 1} bytes, more than {MAX_REQUEST_HEADER}"]
        # the caller resets as soon as it has asked: the refusal's write fails
        call = await Call.open(caller, host)
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            await call.send(forward("ffn.9.9"), [torch.ones(1, HID)])
            await call.stream.reset()
            with trio.fail_after(5):
                while not server_lines(caplog):
                    await trio.sleep(0.01)
        assert server_lines(caplog) == [f"experts: a call from {caller.peer_id} ended: StreamReset: the stream was "
                                        f"reset"]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def server_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return log_lines(caplog, "training.moe.server", "")


# ---------------------------------------------------------------------- declarations and checkpoints


async def test_the_server_declares_every_prefix_of_every_expert(caplog: pytest.LogCaptureFixture) -> None:
    async with serving(backend("ffn.0.1"), backend("ffn.2.0"), backend("ffn.0.3")) as (server, host, caller):
        records = host.dht
        key_values = {}
        infos: list[pb.ExpertInfo] = []
        for key in ("ffn", "ffn.0", "ffn.2"):
            found = await records.get(key)
            assert found is not None and isinstance(found.value, dict)
            values = {sub: v.value for sub, v in found.value.items() if isinstance(v.value, bytes)}
            infos += [pb.ExpertInfo.FromString(v) for v in values.values()]
            key_values[key] = {sub: pb.ExpertInfo.FromString(v).uid for sub, v in values.items()}
        me = host.peer_id
        assert key_values == {
            "ffn": {coordinate_subkey(0, me): "ffn.0.1", coordinate_subkey(2, me): "ffn.2.0"},
            "ffn.0": {coordinate_subkey(1, me): "ffn.0.1", coordinate_subkey(3, me): "ffn.0.3"},
            "ffn.2": {coordinate_subkey(0, me): "ffn.2.0"},
        }
        assert all(list(info.addrs) == [bytes(a.to_bytes()) for a in host.addrs] for info in infos)
        found = await records.get("ffn")
        assert found is not None and 85 < found.expiration - time.time() <= 90
        assert server.declared_at is not None and abs(server.declared_at - time.time()) < 5
        assert records.stores == 5  # each record once
        # the count of records taken, though the stores run at once (`stored += await ...` counted 1)
        with caplog.at_level(logging.DEBUG, "training.moe.server"):
            assert await server.declare() == 5
        assert server_lines(caplog) == ["experts: declared 5 of 5 records"]


async def test_declarations_go_sixteen_at_a_time() -> None:
    async with serving(*[backend(f"ffn.{i}.0") for i in range(17)]) as (server, host, caller):
        assert ExpertServer(host, [], ServerConfig()).declared_at is None
        flight, most = 0, 0

        async def slow(key: Any, value: bytes, expiration: float, subkey: Any = None, *,
                       timeout: float | None = None) -> bool:
            nonlocal flight, most
            flight += 1
            most = max(most, flight)
            await trio.sleep(0.02)
            flight -= 1
            return True

        host.dht.store = slow  # type: ignore[method-assign]
        assert await server.declare() == 34 and most == 16


async def test_a_failed_declaration_is_logged_and_the_server_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async with serving(backend("ffn.0.1")) as (server, host, caller):
        calls: list[float | None] = []

        async def failing(key: Any, value: bytes, expiration: float, subkey: Any = None, *,
                          timeout: float | None = None) -> bool:
            calls.append(timeout)
            if key == "ffn.0":
                raise RuntimeError("no replica")
            return True

        host.dht.store = failing  # type: ignore[method-assign]
        with caplog.at_level(logging.DEBUG, "training.moe.server"):
            assert await server.declare() == 1
        assert calls == [15.0, 15.0]
        assert server_lines(caplog) == ["experts: declaring ffn.0 failed: no replica",
                                        "experts: declared 1 of 2 records"]


async def test_declarations_repeat_every_update_period() -> None:
    async with serving(config=ServerConfig(update_period=0.2, expiration=1.0)) as (server, host, caller):
        stores = host.dht.stores
        await trio.sleep(0.5)
        assert host.dht.stores - stores == 2 * 2  # two periods, two records (ffn and ffn.0)


async def test_checkpoints_are_saved_whole_on_close_and_every_period_and_loaded_on_open(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "deep" / "ckpt"
    config = ServerConfig(checkpoint_dir=directory, checkpoint_every=0.2)
    b = backend("ffn.0.1")
    async with serving(b, config=config) as (server, host, caller):
        assert not directory.exists()
        await trio.sleep(0.3)
        assert sorted(p.name for p in directory.iterdir()) == ["ffn.0.1.pt"]
        with torch.no_grad():
            module_of(b).weight.fill_(7.0)
        b.updates = 5
    fresh = backend("ffn.0.1")
    assert ExpertServer(host, [fresh], config).load_checkpoints() == 1
    assert torch.equal(module_of(fresh).weight.detach(), torch.full((HID,), 7.0)) and fresh.updates == 5
    # no directory: nothing saved or loaded
    assert ExpertServer(host, [fresh], ServerConfig()).load_checkpoints() == 0
    ExpertServer(host, [fresh], ServerConfig()).save_checkpoints()
    async with serving(backend("ffn.0.1"), config=config) as (server, host, caller):
        assert server.backends["ffn.0.1"].updates == 5  # loaded on open
    async with serving(backend("ffn.0.2"), config=config) as (server, host, caller):
        assert server.backends["ffn.0.2"].updates == 0  # none saved for it: a fresh expert
    caplog.clear()
    with caplog.at_level(logging.INFO, "training.moe.server"):
        assert ExpertServer(host, [backend("ffn.0.1"), backend("ffn.0.2")], config).load_checkpoints() == 2
    assert server_lines(caplog) == [f"experts: loaded 2 checkpoints from {directory}"]
    # a checkpoint is read as weights only: one that would run code on load is refused
    torch.save({**fresh.state_dict(), "extra": _Pickled()}, directory / "ffn.0.1.pt")
    with pytest.raises(pickle.UnpicklingError):
        ExpertServer(host, [backend("ffn.0.1")], config).load_checkpoints()


class _Pickled:
    """An object a weights-only load refuses (its class would be imported and built)."""


def test_two_backends_with_one_uid_are_refused() -> None:
    with pytest.raises(ConfigError, match="^experts: two backends share a uid$"):
        ExpertServer(None, [backend("ffn.0.1"), backend("ffn.0.1")], ServerConfig())  # type: ignore[arg-type]
