"""training.state's protocol and checks, over the in-memory swarm (tests/fake_swarm.py): what a server
answers, what an asker refuses and why, and what loading a state changes. Quick enough to run per mutant;
tests/test_training_state.py runs the same protocol between real peers on loopback."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
import trio
import trio.testing
from libp2p.abc import INetStream

from averaging.tensor_stream import receive_tensors, send_tensors
from averaging.wire import FrameReader, frame
from training.proto import training_pb2 as pb
from training.state import (MAX_META, MAX_UPLOADS, STATE_PROTOCOL, StateDownloadError, StateServer, TrainingState,
                            _join, _split, download_state, load_state, snapshot_of)

from .fake_swarm import FakeSwarm, fake_swarms
from .test_training_state import model_and_optimizer

OK, REFUSED = pb.StateHeader.OK, pb.StateHeader.REFUSED


def serving(state: TrainingState) -> Callable[[], Awaitable[TrainingState]]:
    async def snapshot() -> TrainingState:
        return state

    return snapshot


def answering(peer: FakeSwarm, header: pb.StateHeader | None, tensors: list[torch.Tensor] | None = None) -> None:
    """A hand-made server (what a buggy or hostile peer could send): reads the request, writes ``header``
    and ``tensors`` (nothing at all where ``header`` is None: it hangs up)."""
    async def handler(stream: INetStream) -> None:
        await FrameReader(stream).message(pb.StateRequest, "state request")
        if header is not None:
            await stream.write(frame(header))
            if tensors is not None:
                await send_tensors(stream, tensors)
        await stream.close()

    peer.set_stream_handler(STATE_PROTOCOL, handler)


def ok(params: list[torch.Tensor], *, step: int = 7, pending: bool = False,
       meta: Any = None, n: int | None = None) -> pb.StateHeader:
    return pb.StateHeader(status=OK, step=step, params=len(params) if n is None else n, pending=pending,
                          meta=json.dumps({"optimizer": {"d": []}, "scheduler": None} if meta is None else meta))


async def refusal(asker: FakeSwarm, server: FakeSwarm, params: list[torch.Tensor], *, min_step: int = 5,
                  run: str = "run") -> str:
    """What the asker says of ``server``'s answer (its part of the StateDownloadError)."""
    with pytest.raises(StateDownloadError) as caught:
        await download_state(asker, run, [server.peer_id], min_step, params)
    text = str(caught.value)
    prefix = f"no peer served a usable state: {server.peer_id}: "
    assert text.startswith(prefix), text
    return text[len(prefix):]


# ---------------------------------------------------------------------- state dicts <-> JSON + tensors


def test_split_and_join_keep_every_kind_of_value_and_copy_the_tensors() -> None:
    a, b = torch.arange(3.0), torch.ones(2, 2)
    value = {"x": a, 3: (b, [1, 2.5, "s", None, True]), None: {"nested": [a]}, 1.5: False, True: "t"}
    tensors: list[torch.Tensor] = []
    meta = _split(value, tensors)
    assert json.loads(json.dumps(meta)) == meta  # plain JSON
    assert meta["d"][0] == ["x", {"t": 0}] and meta["d"][1] == [3, {"u": [{"t": 1}, [1, 2.5, "s", None, True]]}]
    assert len(tensors) == 3 and torch.equal(tensors[2], a)
    a += 1  # the split took copies
    assert torch.equal(tensors[0], torch.arange(3.0))
    back = _join(meta, tensors)
    assert set(back) == {"x", 3, None, 1.5, True}
    assert back[3][0] is tensors[1] and back[3][1] == [1, 2.5, "s", None, True] and isinstance(back[3], tuple)
    assert back[None]["nested"][0] is tensors[2] and back[1.5] is False and back[True] == "t"


def test_split_detaches_a_tensor_that_needs_grad() -> None:
    tensors: list[torch.Tensor] = []
    _split(torch.ones(2, requires_grad=True), tensors)
    assert not tensors[0].requires_grad


def test_split_refuses_what_json_cannot_say() -> None:
    with pytest.raises(TypeError, match="^cannot send a set in a training state$"):
        _split({"x": {1, 2}}, [])
    tensors: list[torch.Tensor] = []
    for key, name in ((torch.zeros(1), "Tensor"), ((1, 2), "tuple")):  # _join would refuse it as a key
        with pytest.raises(TypeError, match=f"^cannot send a {name} key in a training state$"):
            _split({"x": 1, key: 2}, tensors)
    assert tensors == []


@pytest.mark.parametrize("bad, words", [
    ({"t": 2}, "unknown object in the metadata"),
    ({"t": -1}, "unknown object in the metadata"),
    ({"t": "0"}, "unknown object in the metadata"),
    ({"t": 0, "u": []}, "unknown object in the metadata"),
    ({"d": {}}, "unknown object in the metadata"),
    ({"u": "ab"}, "unknown object in the metadata"),
    ({"x": 1}, "unknown object in the metadata"),
    ({"d": [[1]]}, "malformed dictionary entry"),
    ({"d": [[1, 2, 3]]}, "malformed dictionary entry"),
    ({"d": ["ab"]}, "malformed dictionary entry"),
    ({"d": [[[1], 2]]}, "a dictionary key must be a plain value"),
    ({"d": [[{"t": 0}, 2]]}, "a dictionary key must be a plain value"),
    ({"d": [[{"u": []}, 2]]}, "a dictionary key must be a plain value"),
    ([1, {"d": [[1, {"t": 5}]]}], "unknown object in the metadata"),
    ({"u": [{"q": 1}]}, "unknown object in the metadata"),
    (b"x", "unexpected bytes in the metadata"),
])
def test_join_refuses_anything_split_would_not_have_written(bad: Any, words: str) -> None:
    with pytest.raises(ValueError, match=f"^{words}$"):
        _join(bad, [torch.zeros(1), torch.zeros(2)])


def test_join_takes_the_last_tensor_and_plain_keys() -> None:
    tensors = [torch.zeros(1), torch.ones(1)]
    assert _join({"t": 1}, tensors) is tensors[1]
    assert _join({"d": [[None, 1], [2.5, 2], [False, 3]]}, tensors) == {None: 1, 2.5: 2, False: 3}


# ---------------------------------------------------------------------- snapshots and loading


def test_a_snapshot_is_a_copy_that_training_cannot_change() -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    pending = [torch.ones_like(p) for p in params]
    state = snapshot_of(4, params, opt, sched, pending)
    before = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1)
    pending[0].add_(1)
    opt.state_dict()["state"][0]["exp_avg"].add_(1)
    sched.step()
    assert state.step == 4 and all(torch.equal(a, b) for a, b in zip(state.params, before))
    assert not any(p.requires_grad for p in state.params)
    assert state.pending is not None and torch.equal(state.pending[0], torch.ones_like(params[0]))
    assert not torch.equal(state.optimizer["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert state.scheduler is not None and state.scheduler["last_epoch"] == 1 and sched.last_epoch == 2
    sched.base_lrs[0] = 99.0  # a list inside the scheduler's state: the snapshot holds its own
    assert state.scheduler["base_lrs"] == [0.01]
    bare = snapshot_of(4, params, opt, None, None)
    assert bare.pending is None and bare.scheduler is None and bare.source == ""


def test_load_state_puts_the_parameters_optimizer_and_scheduler_in_place() -> None:
    model, opt, sched = model_and_optimizer()
    state = snapshot_of(3, list(model.parameters()), opt, sched, None)
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.5)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=2)
    load_state(state, list(other.parameters()), other_opt, other_sched)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))
    assert other_opt.param_groups[0]["lr"] == 0.01 and other_sched.last_epoch == 1
    assert other_opt.state_dict()["state"][0]["step"] == 1
    bare = torch.optim.Adam(other.parameters(), lr=0.5)
    load_state(state, list(other.parameters()), bare, None)  # no scheduler here: the peer's is not needed
    assert bare.param_groups[0]["lr"] == 0.01


def parties() -> tuple[TrainingState, torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    model, opt, sched = model_and_optimizer()
    state = snapshot_of(3, list(model.parameters()), opt, sched, None)
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.5)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=5)
    other_sched.last_epoch = 1  # its own state, which a refusal must leave
    return state, other, other_opt, other_sched


def unchanged(other: torch.nn.Module, other_opt: torch.optim.Optimizer, other_sched: Any,
              before: list[torch.Tensor]) -> bool:
    return (all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
            and other_opt.param_groups[0]["lr"] == 0.5 and other_opt.state_dict()["state"] == {}
            and other_sched.last_epoch == 1 and other_sched.step_size == 5)


@pytest.mark.parametrize("spoil", ["no scheduler", "optimizer"])
def test_a_refused_state_changes_nothing(spoil: str) -> None:
    state, other, other_opt, other_sched = parties()
    if spoil == "no scheduler":
        state.scheduler, words = None, "the peer has no scheduler state"
    else:
        state.optimizer["param_groups"] = state.optimizer["param_groups"] * 2
        words = "loaded state dict has a different number of parameter groups"
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ValueError, match=f"^the optimizer or scheduler refused the state: {re.escape(words)}$"):
        load_state(state, list(other.parameters()), other_opt, other_sched)
    assert unchanged(other, other_opt, other_sched, before)


def test_a_scheduler_that_refuses_after_the_optimizer_took_its_state_puts_both_back() -> None:
    state, other, other_opt, other_sched = parties()
    loaded: list[dict[str, Any]] = []
    real = other_sched.load_state_dict

    def refuse(d: dict[str, Any]) -> None:
        loaded.append(d)
        if len(loaded) == 1:
            raise ValueError("no")
        real(d)

    other_sched.load_state_dict = refuse  # type: ignore[method-assign]
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ValueError, match="refused the state: no$"):
        load_state(state, list(other.parameters()), other_opt, other_sched)
    assert len(loaded) == 2 and loaded[1]["step_size"] == 5  # its own state, put back
    assert unchanged(other, other_opt, other_sched, before)


# ---------------------------------------------------------------------- the protocol


async def test_a_download_brings_the_state_with_its_pending_gradients() -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    pending = [torch.full_like(p, 0.5) for p in params]
    async with fake_swarms(2) as (asker, server):
        state = snapshot_of(7, params, opt, sched, pending)
        served = StateServer(server, "run", serving(state))
        served.install()
        got = await download_state(asker, "run", [server.peer_id], 7, [torch.zeros_like(p) for p in params])
        assert got.step == 7 and got.source == server.peer_id.to_base58()
        assert all(torch.equal(a, b) for a, b in zip(got.params, params))
        assert got.pending is not None and len(got.pending) == 2 and torch.equal(got.pending[1], pending[1])
        assert got.scheduler == sched.state_dict()
        assert got.optimizer["param_groups"] == opt.state_dict()["param_groups"]
        assert torch.equal(got.optimizer["state"][1]["exp_avg_sq"], opt.state_dict()["state"][1]["exp_avg_sq"])
        assert served.served == 1 and served.uploading == 0 and served.refused_busy == 0
        state.pending = None
        again = await download_state(asker, "run", [server.peer_id], 0, params)
        assert again.pending is None and served.served == 2


async def test_the_asker_sends_its_run_and_step_closes_after_a_good_answer_and_resets_after_a_bad_one() -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    requests: list[pb.StateRequest] = []
    ends: list[str] = []
    async with fake_swarms(2) as (asker, server):
        async def handler(stream: INetStream) -> None:
            requests.append(await FrameReader(stream).message(pb.StateRequest, "state request"))
            await stream.write(frame(ok(params, step=9)))
            await send_tensors(stream, params)
            await stream.close()
            try:
                await stream.read(1)
            except Exception as e:  # how the asker left: StreamEOF (closed) or StreamReset
                ends.append(type(e).__name__)

        server.set_stream_handler(STATE_PROTOCOL, handler)
        assert (await download_state(asker, "the-run", [server.peer_id], 9, params)).step == 9
        await trio.sleep(0.01)
        assert requests == [pb.StateRequest(run_id="the-run", min_step=9)] and ends == ["StreamEOF"]
        # refused from the header, or from the tensors (a TensorStreamError): the asker resets its stream
        for header, tensors, words in ((ok(params, n=3), [], "sent 3 parameters"),
                                       (ok(params), [params[0], torch.full((3,), float("nan"))], "NaN")):
            ends.clear()

            async def bad(stream: INetStream, header: pb.StateHeader = header,
                          tensors: list[torch.Tensor] = tensors) -> None:
                await FrameReader(stream).message(pb.StateRequest, "state request")
                await stream.write(frame(header))
                if tensors:
                    await send_tensors(stream, tensors)
                try:
                    await stream.read(1)
                except Exception as e:
                    ends.append(type(e).__name__)

            server.set_stream_handler(STATE_PROTOCOL, bad)
            assert words in await refusal(asker, server, params)
            await trio.sleep(0.01)
            assert ends == ["StreamReset"]


async def test_another_run_is_refused_with_the_server_s_run() -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    async with fake_swarms(2) as (asker, server):
        StateServer(server, "run", serving(snapshot_of(7, params, opt, sched, None))).install()
        assert await refusal(asker, server, params, run="other") == "ValueError: refused: this peer trains run 'run'"


async def test_a_server_behind_the_step_asked_for_refuses() -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    async with fake_swarms(2) as (asker, server):
        StateServer(server, "run", serving(snapshot_of(4, params, opt, sched, None))).install()
        assert await refusal(asker, server, params, min_step=5) == "ValueError: refused: at step 4, behind 5"
        assert (await download_state(asker, "run", [server.peer_id], 4, params)).step == 4  # its step exactly


class Held:
    """A snapshot that waits for :attr:`released` (a delayed step's round still running)."""

    def __init__(self, state: TrainingState) -> None:
        self.state = state
        self.released = trio.Event()

    async def __call__(self) -> TrainingState:
        await self.released.wait()
        return self.state


async def test_a_busy_server_refuses_past_max_uploads_and_counts_it() -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    slow = Held(snapshot_of(7, params, opt, sched, None))
    assert MAX_UPLOADS == 2
    async with fake_swarms(4) as (a, b, c, server):
        busy = StateServer(server, "run", slow)
        busy.install()
        got: list[TrainingState] = []

        async def ask(asker: FakeSwarm) -> None:
            got.append(await download_state(asker, "run", [server.peer_id], 5, params))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, a)
            nursery.start_soon(ask, b)
            with trio.fail_after(5):
                while busy.uploading < 2:
                    await trio.sleep(0.01)
            assert await refusal(c, server, params) == "ValueError: refused: busy: sending its state to 2 peers already"
            assert busy.refused_busy == 1
            slow.released.set()
        assert [g.step for g in got] == [7, 7] and busy.served == 2 and busy.uploading == 0
        assert (await download_state(c, "run", [server.peer_id], 5, params)).step == 7
    with pytest.raises(ValueError, match="^max_uploads must be >= 1, got 0$"):
        StateServer(server, "run", slow, max_uploads=0)


async def test_an_upload_that_fails_frees_its_slot_and_resets_the_stream() -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    async with fake_swarms(2) as (asker, server):
        broken = snapshot_of(7, params, opt, sched, None)
        broken.optimizer = {"bad": object()}  # cannot be sent
        served = StateServer(server, "run", serving(broken), max_uploads=1)
        served.install()
        said = await refusal(asker, server, params)  # a local fault: the node resets
        assert said.startswith("StreamBrokenError: the stream broke after 0 bytes: StreamReset")
        assert served.uploading == 0 and served.served == 0


async def test_a_silent_asker_is_dropped_after_30_s(autojump_clock: trio.testing.MockClock) -> None:
    async with fake_swarms(2) as (asker, server):
        model, opt, sched = model_and_optimizer()
        params: list[torch.Tensor] = list(model.parameters())
        served = StateServer(server, "run", serving(snapshot_of(7, params, opt, sched, None)))
        served.install()
        stream = await asker.new_stream(server.peer_id, STATE_PROTOCOL)
        started = trio.current_time()
        with trio.fail_after(60), pytest.raises(Exception, match="reset"):
            await stream.read(1)
        assert 30 <= trio.current_time() - started < 31
        stream = await asker.new_stream(server.peer_id, STATE_PROTOCOL)
        await stream.write(b"\x02\xff\xff")  # a request that does not parse: reset at once
        with trio.fail_after(1), pytest.raises(Exception, match="reset"):
            await stream.read(1)
        assert served.served == 0


async def test_a_server_that_hangs_up_or_lies_is_refused_with_the_reason() -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    good_tail = ok(params)
    cases: list[tuple[pb.StateHeader | None, list[torch.Tensor] | None, str]] = [
        (None, None, "TruncatedStreamError: the peer closed the stream mid-frame"),
        (pb.StateHeader(status=REFUSED), None, "ValueError: refused: no reason given"),
        (pb.StateHeader(status=pb.StateHeader.STATUS_UNSPECIFIED, reason="?"), None, "ValueError: refused: ?"),
        (ok(params, step=4), params, "ValueError: sent step 4, behind the 5 asked for"),
        (ok(params, n=3), params, "ValueError: sent 3 parameters where this model has 2"),
        (good_tail, params[:1], "ValueError: sent 1 tensors, fewer than its 2 parameters"),
        (ok(params, pending=True), params + params[:1], "ValueError: sent 3 tensors, fewer than its 2 parameters"),
        (good_tail, [params[0].double(), params[1]],
         "ValueError: parameter 0 is torch.float64 (3, 4), here torch.float32 (3, 4)"),
        (good_tail, [params[0], torch.zeros(4)], "ValueError: parameter 1 is torch.float32 (4,), here torch.float32 (3,)"),
        (ok(params, pending=True), params + [params[0], torch.zeros(2)],
         "ValueError: pending gradient 1 has shape (2,), here (3,)"),
        (good_tail, [params[0], torch.tensor([0.0, float("inf"), 1.0])], "ValueError: tensor 1"),
        (ok(params, meta=[1]), params, "ValueError: unusable metadata: metadata without the optimizer and scheduler state"),
        (ok(params, meta={"optimizer": {"d": []}}), params,
         "ValueError: unusable metadata: metadata without the optimizer and scheduler state"),
        (ok(params, meta={"optimizer": {"d": []}, "scheduler": None, "x": 1}), params,
         "ValueError: unusable metadata: metadata without the optimizer and scheduler state"),
        (ok(params, meta={"optimizer": {"t": 0}, "scheduler": None}), params,
         "ValueError: unusable metadata: unknown object in the metadata"),
        (ok(params, meta={"optimizer": {"d": []}, "scheduler": {"x": 1}}), params,
         "ValueError: unusable metadata: unknown object in the metadata"),
        (ok(params, meta={"optimizer": [], "scheduler": None}), params,
         "ValueError: the optimizer or scheduler state is not a dictionary"),
        (ok(params, meta={"optimizer": {"d": []}, "scheduler": 3}), params,
         "ValueError: the optimizer or scheduler state is not a dictionary"),
    ]
    async with fake_swarms(2) as (asker, server):
        for header, tensors, words in cases:
            answering(server, header, tensors)
            said = await refusal(asker, server, params)
            assert said.startswith(words), (said, words)
        bad_json = ok(params)
        bad_json.meta = "{"
        answering(server, bad_json, params)
        assert (await refusal(asker, server, params)).startswith("ValueError: unusable metadata: Expecting")
        deep = ok(params)  # JSON decodes it; the join of its 600 nested lists is past Python's recursion limit
        deep.meta = '{"optimizer": ' + "[" * 600 + "]" * 600 + ', "scheduler": null}'
        answering(server, deep, params)
        assert await refusal(asker, server, params) == "ValueError: unusable metadata: maximum recursion depth exceeded"
        answering(server, ok(params, meta={"optimizer": {"d": []}, "scheduler": None}), params)
        got = await download_state(asker, "run", [server.peer_id], 5, params)
        assert got.optimizer == {} and got.scheduler is None and got.pending is None


async def test_the_tensors_are_bounded_by_the_model_s_size_and_count() -> None:
    params = [torch.zeros(3, 4), torch.zeros(3)]  # 60 bytes
    max_bytes, max_tensors = 5 * 60 + (1 << 20), 8 * 2 + 64
    async with fake_swarms(2) as (asker, server):
        answering(server, ok(params), params + [torch.zeros(max_bytes - 60, dtype=torch.uint8)])
        assert len((await download_state(asker, "run", [server.peer_id], 5, params)).params) == 2
        answering(server, ok(params), params + [torch.zeros(max_bytes - 59, dtype=torch.uint8)])
        assert f"over max_bytes={max_bytes}" in await refusal(asker, server, params)
        answering(server, ok(params), params + [torch.zeros(1)] * (max_tensors - 2))
        assert (await download_state(asker, "run", [server.peer_id], 5, params)).step == 7
        answering(server, ok(params), params + [torch.zeros(1)] * (max_tensors - 1))
        said = await refusal(asker, server, params)
        assert said == f"ValueError: {max_tensors + 1} tensors announced, over max_tensors={max_tensors}"


async def test_a_header_is_bounded_by_max_meta() -> None:
    params = [torch.zeros(3, 4), torch.zeros(3)]
    async with fake_swarms(2) as (asker, server):
        fits = ok(params)
        fits.meta = fits.meta[:-1] + ', "pad": "' + "x" * (MAX_META + 1024 - fits.ByteSize() - 16) + '"}'
        while fits.ByteSize() < MAX_META + 1024:
            fits.meta = fits.meta[:-2] + 'x"}'
        assert fits.ByteSize() == MAX_META + 1024
        answering(server, fits, params)
        assert "metadata without the optimizer" in await refusal(asker, server, params)  # read, then judged
        over = ok(params)
        over.meta = fits.meta[:-2] + 'x"}'
        answering(server, over, params)
        assert await refusal(asker, server, params) == (
            f"AllreduceProtocolError: state header of {MAX_META + 1025} bytes, more than {MAX_META + 1024}")


async def test_every_source_is_tried_in_order_and_every_failure_named(autojump_clock: trio.testing.MockClock) -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    async with fake_swarms(5) as (asker, silent, refusing, gone, good):
        async def hang(stream: INetStream) -> None:
            await trio.sleep_forever()

        silent.set_stream_handler(STATE_PROTOCOL, hang)
        answering(refusing, pb.StateHeader(status=REFUSED, reason="no"))
        StateServer(good, "run", serving(snapshot_of(7, params, opt, sched, None))).install()
        started = trio.current_time()
        with pytest.raises(StateDownloadError) as caught:
            await download_state(asker, "run", [silent.peer_id, refusing.peer_id, gone.peer_id], 5, params, timeout=12)
        assert trio.current_time() - started == pytest.approx(12)
        said = str(caught.value)
        assert said.startswith(f"no peer served a usable state: {silent.peer_id}: timed out; "
                               f"{refusing.peer_id}: ValueError: refused: no; {gone.peer_id}: "), said
        assert "does not speak" in said
        got = await download_state(asker, "run", [silent.peer_id, good.peer_id], 5, params)
        assert got.source == good.peer_id.to_base58() and trio.current_time() - started == pytest.approx(72)
        with pytest.raises(StateDownloadError, match=r"^no peer served a usable state \(none to ask\)$"):
            await download_state(asker, "run", [], 5, params)


# ---------------------------------------------------------------------- what goes over the stream


async def ask(asker: FakeSwarm, server: FakeSwarm, *, run: str = "run", min_step: int = 5,
              request: bytes | None = None) -> tuple[pb.StateHeader, list[torch.Tensor] | None, str]:
    """A hand-made asker: the server's header, its tensors (after an OK), and how the server left the
    stream: "closed", "reset", or "open" (still open a second later)."""
    stream = await asker.new_stream(server.peer_id, STATE_PROTOCOL)
    await stream.write(frame(pb.StateRequest(run_id=run, min_step=min_step)) if request is None else request)
    reader = FrameReader(stream)
    header = await reader.message(pb.StateHeader, "state header", max_size=MAX_META + 1024)
    tensors = await receive_tensors(reader, max_bytes=1 << 24, max_tensors=100) if header.status == OK else None
    end = "open"
    with trio.move_on_after(1):
        try:
            assert await reader.read(1) == b""
            end = "closed"
        except Exception:
            end = "reset"
    await stream.close()
    return header, tensors, end


async def test_refusals_and_states_as_sent(autojump_clock: trio.testing.MockClock) -> None:
    model, opt, sched = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    snapshot = Held(snapshot_of(7, params, opt, sched, None))
    async with fake_swarms(4) as (a, b, c, server):
        served = StateServer(server, "run", snapshot, max_uploads=1)
        served.install()
        snapshot.released.set()
        assert await ask(c, server, run="other") == (
            pb.StateHeader(status=REFUSED, reason="this peer trains run 'run'"), None, "closed")
        assert await ask(c, server, min_step=8) == (
            pb.StateHeader(status=REFUSED, reason="at step 7, behind 8"), None, "closed")
        header, tensors, end = await ask(c, server, min_step=7)
        assert header.status == OK and header.step == 7 and header.params == 2 and not header.pending
        # the parameters, then Adam's step, exp_avg and exp_avg_sq of each
        assert tensors is not None and len(tensors) == 2 + 6 and torch.equal(tensors[0], params[0]) and end == "closed"
        assert json.loads(header.meta)["scheduler"]["d"][0] == ["step_size", 2]
        snapshot.released = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, a, server)
            await trio.sleep(1)
            for _ in range(2):
                assert await ask(b, server) == (
                    pb.StateHeader(status=REFUSED, reason="busy: sending its state to 1 peers already"), None, "closed")
            snapshot.released.set()
        assert served.refused_busy == 2 and served.served == 2


async def test_a_scheduler_s_tensors_travel_too() -> None:
    model, opt, _ = model_and_optimizer()
    params: list[torch.Tensor] = list(model.parameters())
    state = snapshot_of(7, params, opt, None, None)
    state.scheduler = {"counts": torch.arange(4), "nested": [torch.ones(2)]}
    async with fake_swarms(2) as (asker, server):
        StateServer(server, "run", serving(state)).install()
        got = await download_state(asker, "run", [server.peer_id], 5, params)
        assert got.scheduler is not None and torch.equal(got.scheduler["counts"], torch.arange(4))
        assert torch.equal(got.scheduler["nested"][0], torch.ones(2))


async def test_the_server_logs_what_broke_a_request(caplog: pytest.LogCaptureFixture,
                                                    autojump_clock: trio.testing.MockClock) -> None:
    caplog.set_level(logging.INFO, logger="training.state")
    model, opt, sched = model_and_optimizer()
    async with fake_swarms(2) as (asker, server):
        StateServer(server, "run", serving(snapshot_of(7, list(model.parameters()), opt, sched, None))).install()
        stream = await asker.new_stream(server.peer_id, STATE_PROTOCOL)
        await stream.write(b"\x80\x40")  # 8,192 bytes announced
        with trio.fail_after(5), pytest.raises(Exception, match="reset"):
            await stream.read(1)
    said = [r.getMessage() for r in caplog.records if r.name == "training.state"]
    assert said == [f"state request from {asker.peer_id} failed: AllreduceProtocolError: state request of 8192 "
                    "bytes, more than 4096"]


async def test_the_asker_logs_each_source_s_failure(caplog: pytest.LogCaptureFixture) -> None:
    params = [torch.zeros(3, 4), torch.zeros(3)]
    async with fake_swarms(2) as (asker, server):
        answering(server, pb.StateHeader(status=REFUSED, reason="no"))
        await refusal(asker, server, params)
    said = [r.getMessage() for r in caplog.records if r.name == "training.state"]
    assert said == [f"state download from {server.peer_id} failed: ValueError: refused: no"]
