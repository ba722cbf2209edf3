"""averaging.staging one call at a time: the buffer pool, the host vector, and the device vector on
this host's CPU (its CUDA calls, where a test names them, are recorded by stand-ins in torch.cuda).

The device vector's page-locked path itself runs only on a GPU (test_averaging_core's
``test_device_vector_stages_a_gpu_through_page_locked_memory``); here every decision around it is
checked: the order chunks go out in, their offsets, the event each waits for, what is waited for at
the end and where each buffer goes back.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import trio
import trio.testing

from averaging import staging
from averaging.compression import Region, decode, encode, payload_size
from averaging.proto import averaging_pb2 as pb
from averaging.staging import BufferPool, DeviceVector, HostVector

F32, F16, U8 = pb.CODEC_FLOAT32, pb.CODEC_FLOAT16, pb.CODEC_UINT8


def tensors_of(*sizes: int) -> list[torch.Tensor]:
    values = torch.arange(sum(sizes), dtype=torch.float32) / 7 - 3
    return [part.clone() for part in torch.split(values, list(sizes))]


def rounded(values: torch.Tensor, codec: pb.Codec.ValueType) -> torch.Tensor:
    return decode(encode(values, codec), codec, values.numel())


class Event:
    """A CUDA event's stand-in: not done for its first ``pending`` queries."""

    def __init__(self, pending: int = 0) -> None:
        self.pending = pending
        self.queries = 0
        self.recorded_on: object = None

    def record(self, stream: object) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.pending


class Stream:
    """A CUDA stream's stand-in: what waited on what."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[object] = []

    def wait_stream(self, other: object) -> None:
        self.waited.append(other)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """torch.cuda's events and streams recorded: the events made, the stream entered, the caller's."""
    seen: dict[str, Any] = {"events": [], "entered": [], "current": Stream("caller's")}

    def event() -> Event:
        seen["events"].append(Event())
        return seen["events"][-1]  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def on(stream: object) -> Iterator[None]:
        seen["entered"].append(stream)
        yield

    def current(device: object) -> Stream:
        seen["device"] = device
        return seen["current"]  # type: ignore[no-any-return]

    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", current)
    yield seen


# --- BufferPool -----------------------------------------------------------------------------------

def test_a_new_buffer_has_the_place_dtype_and_size_asked_for() -> None:
    pool = BufferPool()
    host = pool.take("host", torch.float32, 10)
    assert (host.device.type, host.dtype, host.numel()) == ("cpu", torch.float32, 10)
    on_device = pool.take("meta", torch.uint8, 3)  # a device's own name
    assert (on_device.device.type, on_device.dtype, on_device.numel()) == ("meta", torch.uint8, 3)
    assert pool.keep == 16


def test_a_page_locked_buffer_is_asked_of_torch_as_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, object]] = []
    empty = torch.empty

    def spy(*size: int, **kwargs: Any) -> torch.Tensor:
        asked.append(dict(kwargs))
        kwargs.pop("pin_memory", None)  # this host has no CUDA to lock pages for
        return empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    pool = BufferPool()
    assert pool.take("pinned", torch.uint8, 7).numel() == 7
    assert asked == [{"dtype": torch.uint8, "pin_memory": True}]
    asked.clear()
    pool.take("host", torch.float32, 2)
    assert asked == [{"dtype": torch.float32, "device": "cpu"}]


def test_a_buffer_given_back_is_lent_again_whole_then_as_its_front() -> None:
    pool = BufferPool()
    a = pool.take("host", torch.float32, 8)
    pool.give("host", a)
    again = pool.take("host", torch.float32, 8)
    assert again.data_ptr() == a.data_ptr() and again.numel() == 8
    pool.give("host", again)
    front = pool.take("host", torch.float32, 3)
    assert front.data_ptr() == a.data_ptr() and front.numel() == 3
    pool.give("host", front)  # its whole base goes back, not the view
    assert [b.numel() for b in pool._free[("host", torch.float32)]] == [8]
    assert pool._lent == {}


def test_buffers_are_kept_apart_by_place() -> None:
    pool = BufferPool()
    a = pool.take("host", torch.float32, 8)
    pool.give("host", a)
    assert pool.take("cpu", torch.float32, 8).data_ptr() != a.data_ptr()
    assert pool.take("host", torch.float32, 8).data_ptr() == a.data_ptr()


def test_a_buffer_the_pool_did_not_lend_is_kept_as_it_is() -> None:
    pool = BufferPool()
    own = torch.zeros(5, dtype=torch.float64)
    pool.give("host", own)
    assert pool.take("host", torch.float64, 5).data_ptr() == own.data_ptr()


def test_past_keep_the_smallest_buffer_is_dropped() -> None:
    pool = BufferPool(keep=2)
    lent = [pool.take("host", torch.float32, n) for n in (30, 10, 20)]
    for buffer in lent:
        pool.give("host", buffer)
    assert [b.numel() for b in pool._free[("host", torch.float32)]] == [30, 20]
    pool.give("host", torch.zeros(40))
    assert [b.numel() for b in pool._free[("host", torch.float32)]] == [30, 40]
    assert pool.take("host", torch.float32, 25).numel() == 25
    assert [b.numel() for b in pool._free[("host", torch.float32)]] == [40]  # the 30, first and smallest
    pool.give("host", torch.zeros(35))
    assert pool.take("host", torch.float32, 33).numel() == 33
    assert [b.numel() for b in pool._free[("host", torch.float32)]] == [40]  # the 35: smallest, though last


def test_a_view_dropped_without_being_given_back_is_forgotten_and_mistaken_for_nothing() -> None:
    pool = BufferPool()
    view = pool.take("host", torch.float32, 30)
    key = id(view)
    assert list(pool._lent) == [key]
    del view  # never given back (a round cut short)
    assert pool._lent == {}
    dead = torch.zeros(1)
    ref = weakref.ref(dead)
    del dead
    stranger = torch.zeros(35)
    pool._lent[id(stranger)] = (ref, torch.zeros(30))  # a dead view's entry under the id it had
    pool.give("host", stranger)  # is still itself, not that view's base
    assert [b.numel() for b in pool._free[("host", torch.float32)]] == [35]


def test_a_view_given_back_then_dropped_ends_quietly_and_leaves_the_entries_of_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ignored: list[object] = []  # an error in a weakref's callback is only printed: catch it
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    pool = BufferPool()
    given, kept = pool.take("host", torch.float32, 10), pool.take("host", torch.float32, 20)
    pool.give("host", given)
    del given  # its entry went when it was given: its callback finds none
    assert ignored == [] and list(pool._lent) == [id(kept)]


def test_a_pool_with_views_out_is_freed_at_once_when_dropped_and_the_views_outlive_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No reference cycle through a lent view's callback: the pool goes when its last user lets go
    (not at the cyclic collector's next pass), and a view dropped after it ends quietly."""
    ignored: list[object] = []  # an error in a weakref's callback is only printed: catch it
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    collecting = gc.isenabled()
    gc.disable()
    try:
        pool = BufferPool()
        view = pool.take("host", torch.float32, 30)
        gone = weakref.ref(pool)
        del pool
        assert gone() is None
        view.fill_(1.0)
        del view  # its callback finds no pool
    finally:
        if collecting:
            gc.enable()
    assert ignored == []


# --- HostVector -----------------------------------------------------------------------------------

def test_the_host_vector_is_a_float32_copy_of_the_tensors_in_order() -> None:
    tensors = [torch.arange(6, dtype=torch.float64).reshape(2, 3), torch.tensor([7.5, -1.0])]
    vector = HostVector(tensors, BufferPool())
    assert vector.result is vector.flat
    assert vector.flat.dtype == torch.float32
    assert vector.flat.tolist() == [0, 1, 2, 3, 4, 5, 7.5, -1.0]
    vector.flat.zero_()
    assert tensors[1].tolist() == [7.5, -1.0]  # a copy


@pytest.mark.parametrize("codec", [F32, F16, U8])
async def test_the_host_vector_sends_each_span_encoded_and_adds_what_it_sent(codec: pb.Codec.ValueType) -> None:
    tensors = tensors_of(300, 212)
    flat = torch.cat(tensors)
    vector = HostVector(tensors, BufferPool())
    span = Region(100, 400, codec)
    assert bytes(await vector.payload(span)) == bytes(encode(flat[100:400], codec))
    own = await vector.own(span)
    assert torch.equal(own, rounded(flat[100:400], codec))
    if codec == F32:
        assert own.data_ptr() == vector.flat[100:].data_ptr()  # no copy of what is sent as it is
    else:
        assert not torch.equal(own, flat[100:400])  # the codec's rounding, as the others decode it


def test_an_average_written_into_the_host_vector_is_copied() -> None:
    vector = HostVector(tensors_of(10), BufferPool())
    values = torch.full((4,), 2.5)
    vector.write(Region(3, 7, F32), values)
    values.fill_(0.0)  # the caller's buffer, reused at once
    assert vector.result[3:7].tolist() == [2.5] * 4
    assert vector.result[:3].tolist() == tensors_of(10)[0][:3].tolist()


async def test_the_host_vector_finishes_at_once_and_gives_its_buffer_back() -> None:
    pool = BufferPool()
    vector = HostVector(tensors_of(10), pool)
    with trio.fail_after(1):
        await vector.finish()
    vector.release()
    assert pool.take("host", torch.float32, 10).data_ptr() == vector.flat.data_ptr()


def test_the_host_vector_takes_its_buffer_from_the_pool() -> None:
    pool = BufferPool()
    kept = pool.take("host", torch.float32, 12)
    pool.give("host", kept)
    assert HostVector(tensors_of(4, 8), pool).flat.data_ptr() == kept.data_ptr()


# --- DeviceVector on a CPU device -------------------------------------------------------------------

def test_tensors_on_two_devices_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"tensors on several devices \(\['cpu', 'meta'\]\): "
                                         "average the tensors of each device apart"):
        DeviceVector([torch.zeros(2), torch.zeros(2, device="meta")], [], BufferPool())


def test_chunks_are_staged_chunk_k_of_every_part_before_chunk_k_plus_one() -> None:
    a0, a1 = Region(0, 10, F32), Region(10, 20, F16)
    b0 = Region(20, 300, U8)
    c0, c1, c2 = Region(300, 301, F32), Region(301, 303, F16), Region(303, 310, F32)
    vector = DeviceVector(tensors_of(310), [[a0, a1], [b0], [c0, c1, c2]], BufferPool())
    order = [a0, b0, c0, a1, c1, c2]
    sizes = [payload_size(s.codec, s.end - s.start) for s in order]
    offsets = [sum(sizes[:i]) for i in range(len(order))]
    assert {k: v[:2] for k, v in vector._where.items()} == {
        (s.start, s.end): (offset, size) for s, offset, size in zip(order, offsets, sizes)}
    assert vector._out.numel() == sum(sizes) and vector._out.dtype == torch.uint8
    assert vector._back.numel() == 310 and vector._back.dtype == torch.float32
    assert vector.cuda is False and vector.stream is None


@pytest.mark.parametrize("codec", [F32, F16, U8])
async def test_each_staged_payload_is_its_span_encoded(codec: pb.Codec.ValueType) -> None:
    tensors = tensors_of(1000, 24)
    flat = torch.cat(tensors)
    spans = [Region(0, 300, codec), Region(300, 1024, F32)]
    vector = DeviceVector(tensors, [spans], BufferPool())
    for span in spans:
        assert bytes(await vector.payload(span)) == bytes(encode(flat[span.start:span.end], span.codec))
        assert torch.equal(await vector.own(span), rounded(flat[span.start:span.end], span.codec))


def test_a_round_with_nothing_to_send_still_has_buffers_of_one() -> None:
    vector = DeviceVector([torch.zeros(0)], [[], []], BufferPool())
    assert (vector._out.numel(), vector._back.numel()) == (1, 1)
    assert vector._events == [] and vector._where == {}
    assert DeviceVector([torch.zeros(0)], [], BufferPool())._out.numel() == 1


def test_an_event_follows_every_event_every_bytes_and_the_last_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "EVENT_EVERY", 100)
    sizes = [15, 15, 10, 50, 2, 25]  # float32 elements: 60, 60, 40, 200, 8, 100 bytes
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    spans = [Region(lo, hi, F32) for lo, hi in zip(bounds, bounds[1:])]
    vector = DeviceVector(tensors_of(bounds[-1]), [spans], BufferPool())
    # 60, 120 (an event), 40, 240 (an event), 8, 108 (an event, and the last)
    assert [vector._where[(s.start, s.end)][2] for s in spans] == [0, 0, 1, 1, 2, 2]
    assert vector._events == [None, None, None]  # a CPU device records none
    exact = DeviceVector(tensors_of(50), [[Region(0, 25, F32), Region(25, 50, F32)]], BufferPool())
    assert [index for _, _, index in exact._where.values()] == [0, 1]  # 100 bytes exactly: an event
    assert staging.EVENT_EVERY == 100 and 8 << 20 == 8388608


def test_the_bytes_since_an_event_start_again_from_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "EVENT_EVERY", 99)
    spans = [Region(0, 50, F16), Region(50, 99, F16), Region(99, 100, F32)]  # 100, 98 and 4 bytes
    vector = DeviceVector(tensors_of(100), [spans], BufferPool())
    assert [index for _, _, index in vector._where.values()] == [0, 1, 1]


async def test_a_payload_waits_for_the_event_of_its_own_chunk(monkeypatch: pytest.MonkeyPatch,
                                                              autojump_clock: trio.testing.MockClock) -> None:
    monkeypatch.setattr(staging, "EVENT_EVERY", 4)
    spans = [Region(0, 1, F32), Region(1, 2, F32), Region(2, 3, F32)]
    vector = DeviceVector(tensors_of(3), [spans], BufferPool())
    events = [Event(pending=0), Event(pending=3), Event(pending=0)]
    vector._events = list(events)  # type: ignore[arg-type]
    start = trio.current_time()
    assert bytes(await vector.payload(spans[1])) == bytes(encode(vector.flat[1:2], F32))
    assert events[1].queries == 4 and events[0].queries == events[2].queries == 0
    assert trio.current_time() - start == pytest.approx(3 * staging.POLL_S)
    assert staging.POLL_S == 0.0005
    await vector.own(spans[0])
    assert events[0].queries == 1


async def test_a_done_event_is_not_waited_for(autojump_clock: trio.testing.MockClock) -> None:
    vector = DeviceVector(tensors_of(2), [[Region(0, 2, F32)]], BufferPool())
    start = trio.current_time()
    await vector._wait(Event())  # type: ignore[arg-type]
    await vector._wait(None)
    assert trio.current_time() == start


def test_an_average_is_staged_then_copied_into_the_device_vector() -> None:
    tensors = tensors_of(6)
    vector = DeviceVector(tensors, [[Region(0, 6, F32)]], BufferPool())
    values = torch.tensor([9.0, 8.0])
    vector.write(Region(2, 4, F32), values)
    values.zero_()
    assert vector._back[2:4].tolist() == [9.0, 8.0]
    assert vector.result is vector.flat
    assert vector.result.tolist() == tensors[0][:2].tolist() + [9.0, 8.0] + tensors[0][4:].tolist()


async def test_on_a_stream_writes_go_on_it_and_finish_waits_for_them(cuda: dict[str, Any],
                                                                    autojump_clock: trio.testing.MockClock) -> None:
    vector = DeviceVector(tensors_of(4), [[Region(0, 4, F32)]], BufferPool())
    ours = Stream("the round's")
    vector.stream = ours  # type: ignore[assignment]  # as on a GPU: what the constructor makes there
    vector.write(Region(0, 2, F32), torch.ones(2))
    assert cuda["entered"] == [ours]
    with trio.fail_after(1):
        await vector.finish()
    (event,) = cuda["events"]
    assert event.recorded_on is ours and event.queries == 1
    assert cuda["current"].waited == [ours] and cuda["device"] == vector.device  # the caller's after ours


async def test_off_a_stream_nothing_is_recorded_or_entered(cuda: dict[str, Any]) -> None:
    vector = DeviceVector(tensors_of(4), [[Region(0, 4, F32)]], BufferPool())
    vector.write(Region(0, 2, F32), torch.ones(2))
    await vector.finish()
    assert cuda["events"] == [] and cuda["entered"] == [] and cuda["current"].waited == []
    assert "device" not in cuda


def test_the_device_vector_takes_its_three_buffers_from_the_pool_by_place_and_dtype() -> None:
    pool = BufferPool()
    kept = {key: torch.empty(100, dtype=key[1]) for key in
            [("cpu", torch.float32), ("host", torch.uint8), ("host", torch.float32)]}
    for (where, _), buffer in kept.items():
        pool.give(where, buffer)
    vector = DeviceVector(tensors_of(8), [[Region(0, 8, F16)]], pool)
    assert vector.flat.data_ptr() == kept[("cpu", torch.float32)].data_ptr()
    assert vector._out.data_ptr() == kept[("host", torch.uint8)].data_ptr()
    assert vector._back.data_ptr() == kept[("host", torch.float32)].data_ptr()


def test_the_device_vector_takes_and_gives_back_its_three_buffers() -> None:
    pool = BufferPool()
    vector = DeviceVector(tensors_of(8), [[Region(0, 8, F16)]], pool)
    assert pool._lent.keys() == {id(vector.flat), id(vector._out), id(vector._back)}
    vector.release()
    assert pool._lent == {}
    assert [b.data_ptr() for b in pool._free[("cpu", torch.float32)]] == [vector.flat.data_ptr()]
    assert [b.data_ptr() for b in pool._free[("host", torch.uint8)]] == [vector._out.data_ptr()]
    assert [b.data_ptr() for b in pool._free[("host", torch.float32)]] == [vector._back.data_ptr()]
