"""Where a round's values live: the flat vector the all-reduce reads its payloads from and writes its
averages into, on the host or staged from a GPU.

:class:`HostVector` is a float32 copy of CPU tensors: a payload is a view of
it (float32) or its chunk encoded on the spot, an average is written into it.

:class:`DeviceVector` keeps the vector on the tensors' device (a GPU) and
stages only bytes through the host. At the round's start every chunk this
peer will send (or reduce itself) is encoded *on the device* (float16 and
8-bit blockwise run there, so only the compressed bytes cross the PCIe
bus) and copied without blocking into one page-locked host buffer, in the
order the chunks go out, with a CUDA event every few megabytes: the first
chunks leave while later ones are still being copied, so the copy overlaps
the network. An average that comes back is written into a page-locked
float32 buffer and copied to the device vector without blocking; chunks
that never come back keep the device's own values. :meth:`finish` waits
for the last copy, polling the event from the event loop (never blocking
it), and the averager unflattens from the device vector into the caller's
tensors device to device.

Both hand the all-reduce the same four calls (:class:`FlatVector`).
Buffers are the averager's to reuse between rounds (:class:`BufferPool`):
a fresh page-locked buffer costs a cudaHostAlloc, and a fresh pageable
one 10,000 page faults per 40 MB.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch
import trio

from . import serial
from .compression import Region, decode, encode, encode_tensor, payload_size
from .partition import flatten
from .proto import averaging_pb2 as pb
from .tensor_stream import tensor_bytes

#: A CUDA event after at least this many staged bytes: sends wait for the event covering their chunk.
EVENT_EVERY = 8 << 20
#: How often a wait for a device copy polls its event (the event loop keeps running between polls).
POLL_S = 0.0005


class FlatVector(Protocol):
    """What an all-reduce round reads and writes: payloads out, this peer's own values, averages in."""

    async def payload(self, span: Region) -> memoryview:
        """The encoded bytes of ``span`` as this peer sends them (valid until the round ends)."""
        ...

    async def own(self, span: Region) -> torch.Tensor:
        """This peer's float32 host values of ``span`` as the codec rounds them (what its reducer adds)."""
        ...

    def write(self, span: Region, values: torch.Tensor) -> None:
        """The averaged float32 host values of ``span`` (copied: ``values`` may be reused at once)."""
        ...


class BufferPool:
    """Buffers kept between rounds: a round takes what it needs and gives it back when done.

    Per place and dtype, up to ``keep`` buffers; a taker gets a view of the
    front of the smallest that is large enough (a round's sizes move with the
    split), or a new one.

    A view lent is known by its id, through a weak reference: a view dropped without being
    given back takes its entry with it. Before, the entry stayed, and a tensor given later
    that happened to get the dead view's id was taken for it (its base went back to the pool
    instead: a fresh-clone CI run saw it once).
    """

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._free: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        self._lent: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def _forget(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        entry = self._lent.get(key)
        if entry is not None and entry[0] is ref:
            del self._lent[key]

    def take(self, where: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``numel`` values: ``where`` is "host", "pinned" or a device's name; contents undefined."""
        free = self._free.setdefault((where, dtype), [])
        fitting = [i for i, b in enumerate(free) if b.numel() >= numel]
        if fitting:
            base = free.pop(min(fitting, key=lambda i: free[i].numel()))  # by position: == on tensors compares values
        elif where == "pinned":
            base = torch.empty(numel, dtype=dtype, pin_memory=True)
        else:
            base = torch.empty(numel, dtype=dtype, device="cpu" if where == "host" else where)
        view = base[:numel]
        key, pool = id(view), weakref.ref(self)  # the callback must not hold the pool: a cycle till gc

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            if (alive := pool()) is not None:  # always: the pool's end takes this weakref, callback and all
                alive._forget(key, ref)
        self._lent[key] = (weakref.ref(view, forget), base)
        return view

    def give(self, where: str, buffer: torch.Tensor) -> None:
        entry = self._lent.pop(id(buffer), None)
        base = entry[1] if entry is not None and entry[0]() is buffer else buffer
        free = self._free.setdefault((where, base.dtype), [])
        free.append(base)
        if len(free) > self.keep:
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))


class HostVector:
    """CPU tensors' float32 copy; averages land in it (:attr:`flat`)."""

    def __init__(self, tensors: Sequence[torch.Tensor], pool: BufferPool) -> None:
        numel = sum(t.numel() for t in tensors)
        self.pool = pool
        self.flat = flatten(tensors, pool.take("host", torch.float32, numel))

    async def payload(self, span: Region) -> memoryview:
        return encode(self.flat[span.start:span.end], span.codec)

    async def own(self, span: Region) -> torch.Tensor:
        values = self.flat[span.start:span.end]
        if span.codec != pb.CODEC_FLOAT32:
            values = decode(encode(values, span.codec), span.codec, span.end - span.start)
        return values

    def write(self, span: Region, values: torch.Tensor) -> None:
        serial.copy_(self.flat[span.start:span.end], values)

    @property
    def result(self) -> torch.Tensor:
        return self.flat

    async def finish(self) -> None:
        pass

    def release(self) -> None:
        """Give the buffer back (after the caller copied the result out)."""
        self.pool.give("host", self.flat)


class DeviceVector:
    """GPU tensors' float32 vector on their device, staged to and from the host in page-locked buffers.

    ``parts``: the round's chunk spans per part (``RoundPlan.spans``); every
    chunk is encoded, in the order the round needs them: chunk k of every
    part before chunk k+1 of any (its sends and its own part). Also runs on a CPU device (no
    page-locking, no events), which is how the tests exercise it on machines
    without a GPU.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], parts: Sequence[Sequence[Region]], pool: BufferPool) -> None:
        self.device = tensors[0].device
        if any(t.device != self.device for t in tensors):
            raise ValueError(f"tensors on several devices ({sorted({str(t.device) for t in tensors})}): "
                             "average the tensors of each device apart")
        self.pool = pool
        self.cuda = self.device.type == "cuda"
        self._staging = "pinned" if self.cuda else "host"
        numel = sum(t.numel() for t in tensors)
        where = str(self.device)
        outgoing = [spans[k] for k in range(max(map(len, parts), default=0)) for spans in parts if k < len(spans)]
        sizes = [payload_size(s.codec, s.end - s.start) for s in outgoing]
        self._out = pool.take(self._staging, torch.uint8, max(1, sum(sizes)))
        self._back = pool.take(self._staging, torch.float32, max(1, numel))
        self._where: dict[tuple[int, int], tuple[int, int, int]] = {}  # span -> offset, size, event index
        self._events: list[torch.cuda.Event | None] = []
        # The round's copies and codecs run on a stream of their own, after what the caller queued
        # (its gradients), and beside what it queues next (the next micro-batch's compute).
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None  # type: ignore[no-untyped-call]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_stream():
            self.flat = flatten(tensors, pool.take(where, torch.float32, numel))
            offset = since_event = 0
            for span, size in zip(outgoing, sizes):
                encoded = encode_tensor(self.flat[span.start:span.end], span.codec)
                self._out[offset:offset + size].copy_(encoded, non_blocking=self.cuda)
                self._where[(span.start, span.end)] = (offset, size, len(self._events))
                offset += size
                since_event += size
                if since_event >= EVENT_EVERY or span is outgoing[-1]:
                    self._events.append(self._record())
                    since_event = 0

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def _record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    async def _wait(self, event: torch.cuda.Event | None) -> None:
        if event is None:
            return
        while not event.query():  # type: ignore[no-untyped-call]
            await trio.sleep(POLL_S)

    async def payload(self, span: Region) -> memoryview:
        offset, size, index = self._where[(span.start, span.end)]
        await self._wait(self._events[index])
        return tensor_bytes(self._out[offset:offset + size])

    async def own(self, span: Region) -> torch.Tensor:
        return decode(await self.payload(span), span.codec, span.end - span.start)

    def write(self, span: Region, values: torch.Tensor) -> None:
        staged = self._back[span.start:span.end]
        serial.copy_(staged, values)
        with self._on_stream():
            self.flat[span.start:span.end].copy_(staged, non_blocking=self.cuda)

    @property
    def result(self) -> torch.Tensor:
        return self.flat

    async def finish(self) -> None:
        """Wait until every copy to the device is done (the staged buffers may then be reused), and
        order the caller's stream after them."""
        await self._wait(self._record())
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def release(self) -> None:
        self.pool.give(str(self.device), self.flat)
        self.pool.give(self._staging, self._out)
        self.pool.give(self._staging, self._back)


__all__ = ["BufferPool", "DeviceVector", "FlatVector", "HostVector"]
