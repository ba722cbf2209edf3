"""One butterfly all-reduce round over a formed group, streamed and pipelined.

The flat vector is cut into one part per member (:mod:`averaging.partition`,
fractions from :mod:`averaging.load_balancing`). Each sender opens one
stream per other reducer with a non-empty part (``PROTOCOL``) and, on it,
writes its chunks of that part while it reads the averaged chunks back: the
two directions run at once, so a reducer averages chunk k while chunk k+1
arrives and chunk k-1 goes back, and every link runs full duplex. A reducer
returns a chunk's average as soon as every expected sender delivered it
(:class:`averaging.reduction.PartReduction`), with the set of members whose
values are in it. Streams always go from the sender to the reducer, so a
member that cannot be dialled (client mode) only ever sends.

Faults cost only what the faulty member held:

* a sender that fails, stalls for ``stall_timeout`` or breaks the protocol is
  dropped by the reducer: the chunks it had not delivered are averaged
  without it (weights renormalised), and each of them says so;
* a reducer that fails or stalls: its part's remaining chunks keep this
  peer's own values, and the report names them;
* nothing waits past the round's ``timeout``.

:class:`RoundReport` tells all of it. ``complete`` is true only if every
chunk of every part came back averaged over every sender in the group.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from nat import Swarm
from p2p.errors import ConfigError
from p2p.rpc.stream import TRANSPORT_ERRORS
from p2p.trio_util import beside, finish_quietly

from . import serial
from .bandwidth import TransferClock
from .compression import Compression, Region, codec_regions, decode, encode, payload_size
from .errors import AllreduceProtocolError
from .group import Group, contributors_bits, contributors_from_bits
from .partition import Schema, chunk_spans, part_bounds
from .proto import averaging_pb2 as pb
from .reduction import ChunkRejected, FinalChunk, PartReduction
from .robust import CenteredClipConfig
from .staging import BufferPool, FlatVector
from .tensor_stream import JOIN_LIMIT, tensor_bytes
from .wire import FrameReader, frame

log = logging.getLogger(__name__)

PROTOCOL = "/dedloc/allreduce/1.0.0"
#: The reducer's note naming a sender robust aggregation clipped (averaging/reduction.py).
_CLIPPED = re.compile(r"member (\d+) clipped x([0-9.eE+-]+)")


async def _write_chunk(stream: INetStream, head: bytes, payload: bytes | memoryview) -> None:
    """A chunk header and its payload: one write when the payload is small, else two (no big copy).

    ``payload`` may be a view of tensor memory: the muxer has encrypted it
    when the write returns.
    """
    if len(payload) < JOIN_LIMIT:
        await stream.write(head + payload)
    else:
        await stream.write(head)
        await stream.write(cast(bytes, payload))


class _ChunkBuffer:
    """One stream's receive buffer, as large as its largest chunk: payloads land here in one copy and are
    decoded in place (a float32 chunk is a view of it), so its contents live until the next chunk.
    Taken from the averager's pool and given back (:meth:`release`): a fresh one costs page faults."""

    def __init__(self, spans: Sequence[Region], pool: BufferPool) -> None:
        """``spans``: a part's chunks, at least one (a part without chunks has no stream)."""
        self._pool = pool
        self._tensor = pool.take("host", torch.uint8, max(payload_size(s.codec, s.end - s.start) for s in spans))
        self._memory = tensor_bytes(self._tensor)

    def release(self) -> None:
        self._pool.give("host", self._tensor)

    async def read(self, reader: FrameReader, index: int, span: Region, who: str, *,
                   empty_ok: bool = False) -> tuple[pb.ChunkHeader, memoryview]:
        """Chunk ``index`` of ``span`` from ``who``: header checked (index, codec, exact size), then its payload.

        ``empty_ok``: a reducer returns an empty payload for a chunk nobody's values reached.
        """
        head = await reader.message(pb.ChunkHeader, f"chunk header from {who}")
        expected = payload_size(span.codec, span.end - span.start)
        if head.index != index or head.codec != span.codec or head.nbytes not in (expected, 0 if empty_ok else expected):
            raise ChunkRejected(f"{who} sent chunk {head.index} ({head.nbytes} bytes, codec {head.codec}); "
                                f"expected chunk {index} ({expected} bytes, codec {span.codec})")
        view = self._memory[:head.nbytes]
        await reader.readinto(view)
        return head, view


def check_weight(weight: float) -> None:
    """A member's weight (its samples) must be finite and >= 0."""
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"weight must be finite and >= 0, not {weight}")


class _Counter:
    """Chunks returned on one stream so far; the sender waits on it to stay at most so many ahead."""

    def __init__(self) -> None:
        self.value = 0
        self._changed = trio.Event()

    def advance(self, value: int) -> None:
        self.value = value
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, value: int) -> None:
        while self.value < value:
            await self._changed.wait()


def _why_not_averaged(outcome: PartOutcome) -> str:
    """Why a part whose exchange ended cleanly kept some of this peer's own values."""
    late = outcome.chunks - outcome.returned_chunks
    empty = outcome.returned_chunks - outcome.averaged_chunks
    why = []
    if late:
        why.append(f"{late} chunks not returned in time")
    if empty:
        why.append(f"{empty} chunks came back without an average (no sender's values reached it)")
    return "; ".join(why)


def _innermost(error: BaseException) -> BaseException:
    """The first real error inside nested exception groups (a nursery wraps even one)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _describe(error: BaseException) -> str:
    """The first real error inside nested exception groups, named."""
    error = _innermost(error)
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class AllreduceConfig:
    """How a round moves bytes.

    ``chunk_elements``: values per chunk, the unit of pipelining; None (the
    default) sizes chunks to the group's links (:func:`chunk_elements_for`):
    ``chunk_seconds`` of the slowest declared link, a power of two between
    ``min_chunk_elements`` (32 Ki float32 = 128 KiB, what 100 Mbit links
    want, below) and ``max_chunk_elements`` (1 Mi = 4 MiB), and at most an
    eighth of the largest part so that the pipeline still has stages. Every
    chunk costs Python work (a header, a muxer frame, a reduction call, a few
    scheduler passes) while a byte costs only C: on loopback, 4 peers, 40 MB,
    2 cores, 128 KiB chunks took 0.70 s a round and 1 MiB chunks 0.34 s
    (``bench/averaging.py --setups unshaped``), but on 100 Mbit 512 KiB chunks
    lose the lockstep below (1.22x the bound against 1.10x). ``compression`` applies to tensors of at least
    ``min_compress_elements`` values; smaller ones go as float32.
    ``stall_timeout``: how long a stream may go without a byte before its
    peer is given up on. ``timeout``: the whole round. ``max_chunks_ahead``:
    how many chunks a sender may send to a reducer before their averages come
    back. Without it a sender's stream to one reducer races ahead (TCP shares a
    link unevenly between flows) while that reducer waits on the slowest
    sender anyway: the lead buys nothing, and the bandwidth it took from the
    sender's other streams and returns shows up as a tail at the round's end
    (4 x 100 Mbit: parts finished 2 s apart). The less a stream holds in
    flight, the tighter the lockstep and the shorter the tail, as long as it
    still covers a chunk's round trip: ``bench/averaging.py`` (4 x 100 Mbit,
    40 MB, lab without delay), median of 4 rounds over the bound: 8 x 512 KiB
    in flight 1.21x, 4 x 512 KiB 1.22x, 16 x 128 KiB 1.18x, 4 x 128 KiB
    1.10-1.11x, 2 x 128 KiB 1.08x, 4 x 64 KiB 1.09x. Four 128 KiB chunks
    cover ~35 Mbit x 120 ms per stream (a peer runs one per reducer); raise
    ``max_chunks_ahead`` for long fat paths.
    """

    chunk_elements: int | None = None
    chunk_seconds: float = 0.01
    min_chunk_elements: int = 32 * 1024
    max_chunk_elements: int = 1024 * 1024
    compression: Compression = Compression.NONE
    min_compress_elements: int = 16 * 1024
    stall_timeout: float = 15.0
    timeout: float = 120.0
    max_chunks_ahead: int = 4
    #: Opt-in robust aggregation at each reducer (CenteredClip, :mod:`averaging.robust`): a closed swarm
    #: trusts its peers' gradients; an open one may want this.
    robust: CenteredClipConfig | None = None

    def validate(self) -> None:
        if self.robust is not None:
            self.robust.validate()
        if self.max_chunks_ahead < 1:
            raise ConfigError("max_chunks_ahead must be at least 1")
        for name in ("chunk_elements", "min_chunk_elements", "max_chunk_elements"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= (1 << 24):
                raise ConfigError(f"{name} must be in 1 .. 16 Mi")
        if self.min_chunk_elements > self.max_chunk_elements:
            raise ConfigError("min_chunk_elements must not exceed max_chunk_elements")
        if not self.chunk_seconds > 0:
            raise ConfigError("chunk_seconds must be positive")
        if not (self.stall_timeout > 0 and self.timeout > 0):
            raise ConfigError("timeouts must be positive")


@dataclass
class PartOutcome:
    """One part as this peer saw it: who reduced it, what moved, what was left out."""

    part: int
    reducer: ID
    elements: int
    chunks: int
    averaged_chunks: int = 0
    #: chunks the reducer answered, averaged or not (a chunk nobody's values reached comes back empty)
    returned_chunks: int = 0
    #: chunks whose average left out some sender, with the members left out
    partial_chunks: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    left_out: dict[str, str] = field(default_factory=dict)
    #: why some chunks kept this peer's own values (empty when all came back)
    not_averaged: str = ""
    #: with robust aggregation: members whose contribution the reducer clipped hard, and the least
    #: factor it was scaled by (their values counted only that much of their way)
    clipped: dict[str, float] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.averaged_chunks == self.chunks and self.partial_chunks == 0


@dataclass
class RoundReport:
    """What one round did: the group, each part, who was left out, and the time."""

    group_id: bytes
    members: list[ID]
    my_index: int
    fractions: tuple[float, ...]
    parts: list[PartOutcome]
    elapsed: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(p.complete for p in self.parts)

    @property
    def bytes_sent(self) -> int:
        return sum(p.bytes_sent for p in self.parts)

    @property
    def bytes_received(self) -> int:
        return sum(p.bytes_received for p in self.parts)

    @property
    def left_out(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for p in self.parts:
            out.update(p.left_out)
        return out

    @property
    def clipped(self) -> dict[str, float]:
        """Robust aggregation's suspects: member -> the least factor a reducer scaled its values by."""
        out: dict[str, float] = {}
        for p in self.parts:
            for member, scale in p.clipped.items():
                out[member] = min(scale, out.get(member, 1.0))
        return out

    def summary(self) -> str:
        clipped = self.clipped
        suspects = (f"; clipped by robust aggregation: {', '.join(f'{m} x{s:.2g}' for m, s in sorted(clipped.items()))}"
                    if clipped else "")
        if self.complete:
            return f"group of {len(self.members)}: every part averaged over every sender" + suspects
        bad = [f"part {p.part} ({p.reducer}): " + (p.not_averaged or
               f"{p.partial_chunks} chunks without {', '.join(p.left_out) or 'some senders'}")
               for p in self.parts if not p.complete]
        return f"group of {len(self.members)}: partial average: " + "; ".join(bad) + suspects


@dataclass(frozen=True)
class RoundPlan:
    """The cut every member computes from the group, the schema and the fractions."""

    bounds: tuple[int, ...]
    spans: tuple[tuple[Region, ...], ...]
    chunk_elements: int

    @classmethod
    def make(cls, schema: Schema, fractions: Sequence[float], config: AllreduceConfig,
             group: Group | None = None) -> RoundPlan:
        """The cut; chunks sized by ``config.chunk_elements`` or, when it is None, by ``group``'s links."""
        regions = codec_regions(schema.sizes(), config.compression, config.min_compress_elements)
        bounds = tuple(part_bounds(schema.numel, fractions))
        chunk = config.chunk_elements
        if chunk is None:
            rates = [] if group is None else [min(m.upload, m.download) for m in group.members]
            chunk = chunk_elements_for(rates, max(b - a for a, b in zip(bounds, bounds[1:])), config)
        spans = tuple(tuple(chunk_spans(bounds[j], bounds[j + 1], chunk, regions))
                      for j in range(len(fractions)))
        return cls(bounds, spans, chunk)


def chunk_elements_for(rates: Sequence[float], largest_part: int, config: AllreduceConfig) -> int:
    """Values per chunk for links of ``rates`` (bytes/s, 0 unknown): ``chunk_seconds`` of the slowest known
    link, as a power of two in ``[min_chunk_elements, max_chunk_elements]``, at most ``largest_part / 8``.

    Pure, so every member computes the same from the group's declarations. No known rate gives the
    minimum: a link never measured may be slow, and small chunks only cost CPU on a fast one.
    """
    known = [r for r in rates if r > 0 and math.isfinite(r)]
    if not known:
        return config.min_chunk_elements
    want = min(min(known) * config.chunk_seconds / 4, largest_part / 8)
    chunk = config.min_chunk_elements
    while chunk * 2 <= min(want, config.max_chunk_elements):
        chunk *= 2
    return chunk


class AllreduceRound:
    """This peer's side of one round: its sends, its reduction, its result."""

    def __init__(self, swarm: Swarm, group: Group, plan: RoundPlan, values: FlatVector | None,
                 weight: float, config: AllreduceConfig, fractions: tuple[float, ...],
                 pool: BufferPool | None = None) -> None:
        self.swarm = swarm
        #: where the streams' receive buffers come from (the averager's, kept between rounds)
        self.pool = pool if pool is not None else BufferPool()
        self.group = group
        self.plan = plan
        self.config = config
        self.me = group.my_index
        sends = group.me.role.sends
        if sends and values is None:
            raise ValueError("a sending member needs values")
        check_weight(weight)
        self.weight = weight
        #: where payloads come from and averages go (:mod:`averaging.staging`): averaged chunk by
        #: chunk in place (a chunk's average comes back only after its values went out; what never
        #: came back keeps this peer's values)
        self.values = values
        self.report = RoundReport(group.group_id, [m.peer_id for m in group.members], self.me, fractions, [])
        self.outcomes: dict[int, PartOutcome] = {}
        for j, member in enumerate(group.members):
            spans = plan.spans[j]
            if spans and (sends or j == self.me):
                self.outcomes[j] = PartOutcome(j, member.peer_id, plan.bounds[j + 1] - plan.bounds[j], len(spans))
        self.reduction: PartReduction | None = None
        self._channels: dict[int, trio.MemorySendChannel[tuple[bytes, memoryview] | None]] = {}
        self._receivers: dict[int, trio.MemoryReceiveChannel[tuple[bytes, memoryview] | None]] = {}
        self._served: set[int] = set()
        mine = plan.spans[self.me]
        if mine and group.me.role.reduces:
            senders = group.senders()
            self.reduction = PartReduction(mine, senders, robust=self.config.robust)
            for s in senders:
                if s != self.me:
                    send, receive = trio.open_memory_channel[tuple[bytes, memoryview] | None](len(mine) + 1)
                    self._channels[s] = send
                    self._receivers[s] = receive
        #: per stream, the payloads this peer wrote and read in the round, for its bandwidth estimate
        self.upload: list[TransferClock] = []
        self.download: list[TransferClock] = []
        self._reduced = trio.Event()
        if self.reduction is None or not self.reduction.expected:
            self._reduced.set()
        #: senders' streams still being served (their averages still going back)
        self._serving = 0
        self._served_one = trio.Event()

    # ------------------------------------------------------------------ running

    async def run(self) -> RoundReport:
        """Send, reduce and collect until done or the round's timeout; never raises for a peer's fault."""
        started = time.perf_counter()
        with trio.move_on_after(self.config.timeout) as scope:
            async with trio.open_nursery() as nursery:
                if self.reduction is not None and self.me in self.reduction.expected:
                    nursery.start_soon(self._add_own)
                for j in self.outcomes:
                    if j != self.me:
                        nursery.start_soon(self._exchange, j)
                async with trio.open_nursery() as watch:
                    if self.reduction is not None:
                        watch.start_soon(self._drop_absent_senders)
                    await self._reduced.wait()
                    # The round is this peer's until every average went back: a caller
                    # that computes after step() returns must not stall the others.
                    while self._serving:
                        await self._served_one.wait()
                        self._served_one = trio.Event()
                    watch.cancel_scope.cancel()
        if scope.cancelled_caught:
            self.report.notes.append(f"round timed out after {self.config.timeout:.0f} s")
            if self.reduction is not None and not self.reduction.done:
                self._finish_reduction_on_timeout()
        for outcome in self.outcomes.values():
            if outcome.averaged_chunks < outcome.chunks and not outcome.not_averaged:
                outcome.not_averaged = _why_not_averaged(outcome)
        for channel in self._channels.values():
            channel.close()
        self.report.parts = [self.outcomes[j] for j in sorted(self.outcomes)]
        self.report.elapsed = time.perf_counter() - started
        return self.report

    @staticmethod
    def _clock(clocks: list[TransferClock]) -> TransferClock:
        clock = TransferClock()
        clocks.append(clock)
        return clock

    async def _drop_absent_senders(self) -> None:
        """A sender that has not opened its stream within ``stall_timeout`` is given up on."""
        assert self.reduction is not None
        await trio.sleep(self.config.stall_timeout)
        for s in sorted(self.reduction.expected - self._served - {self.me}):
            self._dispatch(self.reduction.drop(s, f"did not open its stream within {self.config.stall_timeout:.0f} s"))

    def _finish_reduction_on_timeout(self) -> None:
        assert self.reduction is not None
        for s in sorted(self.reduction.expected):
            self._dispatch(self.reduction.drop(s, "no chunks before the round's timeout"))

    async def _add_own(self) -> None:
        assert self.reduction is not None and self.values is not None
        self.reduction.set_weight(self.me, self.weight)
        for k, span in enumerate(self.plan.spans[self.me]):
            # The reducer's own values go through the codec too, so every
            # sender's contribution is rounded alike.
            values = await self.values.own(span)
            if self.me in self.reduction.expected:  # not dropped by a timeout meanwhile
                self._dispatch(self.reduction.add(self.me, k, values))

    # ------------------------------------------------------------------ reducer side

    def _dispatch(self, finals: list[FinalChunk]) -> None:
        assert self.reduction is not None
        size = self.group.size
        spans = self.plan.spans[self.me]
        for final in finals:
            span = spans[final.index]
            payload = memoryview(b"") if final.values is None else encode(final.values, span.codec)
            head = frame(pb.ChunkHeader(index=final.index, codec=span.codec, nbytes=len(payload),
                                        contributors=contributors_bits(final.contributors, size),
                                        note="; ".join(final.notes)[:1000]))
            for s, channel in self._channels.items():
                if s not in self.reduction.dropped:  # dropped senders get nothing more
                    try:
                        channel.send_nowait((head, payload))
                    except (trio.WouldBlock, trio.ClosedResourceError):
                        pass
            if self.me in self.outcomes:
                self._take(self.me, final.index, final.values, final.contributors, final.notes)
        if self.reduction.done:
            self._reduced.set()
            for channel in self._channels.values():
                try:
                    channel.send_nowait(None)
                except (trio.WouldBlock, trio.ClosedResourceError):
                    pass

    async def serve(self, stream: INetStream, reader: FrameReader, sender: int, header: pb.PartHeader) -> None:
        """A sender's stream to this reducer, its header already read and matched to this round."""
        reduction = self.reduction
        if reduction is None or sender not in self._channels or sender in self._served:
            raise AllreduceProtocolError(f"member {sender} may not send part {self.me} here (or sent it twice)")
        self._served.add(sender)
        self._serving += 1
        try:
            await self._serve(stream, reader, sender, header, reduction)
        finally:
            self._serving -= 1
            self._served_one.set()

    async def _serve(self, stream: INetStream, reader: FrameReader, sender: int, header: pb.PartHeader,
                     reduction: PartReduction) -> None:
        mine = self.plan.spans[self.me]
        try:
            if (header.part != self.me or header.start != self.plan.bounds[self.me]
                    or header.end != self.plan.bounds[self.me + 1] or header.chunk_elements != self.plan.chunk_elements):
                raise AllreduceProtocolError(
                    f"member {sender} cut the vector otherwise: part {header.part} [{header.start}, {header.end}) "
                    f"in chunks of {header.chunk_elements}; here part {self.me} is "
                    f"[{self.plan.bounds[self.me]}, {self.plan.bounds[self.me + 1]}) in chunks of {self.plan.chunk_elements}")
            reduction.set_weight(sender, header.weight)
        except AllreduceProtocolError as e:
            self._dispatch(reduction.drop(sender, str(e)))
            raise
        buffer = _ChunkBuffer(mine, self.pool)
        try:
            await self._read_chunks(stream, reader, sender, reduction, mine, buffer)
        finally:
            buffer.release()

    async def _read_chunks(self, stream: INetStream, reader: FrameReader, sender: int, reduction: PartReduction,
                           mine: Sequence[Region], buffer: _ChunkBuffer) -> None:
        """Read a sender's chunks while its averages go back. Either direction failing drops the
        sender: a sender that left shows first in whichever of the two touches its stream next, and
        a failed write-back that only cancelled the reads left its chunks awaited until the round's
        timeout, holding up every member's part here."""
        clock = self._clock(self.download)
        try:
            async with beside(partial(self._write_back, stream, sender)):
                for k, span in enumerate(mine):
                    with trio.fail_after(self.config.stall_timeout) as watchdog:
                        reader.watch(watchdog, self.config.stall_timeout)
                        _, payload = await buffer.read(reader, k, span, f"member {sender}")
                    clock.add(len(payload), time.perf_counter())
                    values = decode(payload, span.codec, span.end - span.start)
                    self._dispatch(reduction.add(sender, k, values))
        except Exception as e:
            error = _innermost(e)
            stalled = isinstance(error, trio.TooSlowError)
            self._dispatch(reduction.drop(sender, f"stalled for {self.config.stall_timeout:.0f} s" if stalled
                                          else _describe(error)))
            await finish_quietly(stream.reset)
            if not isinstance(error, (trio.TooSlowError, AllreduceProtocolError, *TRANSPORT_ERRORS)):
                log.info("stream from member %d failed: %r", sender, error)

    async def _write_back(self, stream: INetStream, sender: int) -> None:
        receive = self._receivers[sender]
        clock = self._clock(self.upload)
        async for item in receive:
            if item is None:
                break
            await _write_chunk(stream, *item)
            clock.add(len(item[1]), time.perf_counter())
        await finish_quietly(stream.close, timeout=self.config.stall_timeout)

    # ------------------------------------------------------------------ sender side

    def _take(self, part: int, index: int, values: torch.Tensor | None, contributors: frozenset[int],
              notes: Sequence[str]) -> None:
        outcome = self.outcomes[part]
        span = self.plan.spans[part][index]
        if values is not None and self.values is not None:
            self.values.write(span, values)
        outcome.returned_chunks += 1
        if values is not None:
            outcome.averaged_chunks += 1
        for note in notes:
            clipped = _CLIPPED.fullmatch(note)
            if clipped is not None and int(clipped[1]) < self.group.size:
                member = self.group.members[int(clipped[1])].peer_id.to_base58()
                outcome.clipped[member] = min(float(clipped[2]), outcome.clipped.get(member, 1.0))
        missing = [i for i in self.group.senders() if i not in contributors]
        if missing:
            outcome.partial_chunks += 1
            for i in missing:
                reason = next((n for n in notes if n.startswith((f"member {i} left out", f"member {i}:"))), "left out")
                outcome.left_out.setdefault(self.group.members[i].peer_id.to_base58(), reason)

    async def _exchange(self, part: int) -> None:
        """Send part ``part`` to its reducer and read its average back, both at once."""
        outcome = self.outcomes[part]
        reducer = self.group.members[part]
        spans = self.plan.spans[part]
        try:
            with trio.fail_after(self.config.stall_timeout):
                self.swarm.add_addrs(reducer.peer_id, list(reducer.addrs))
                stream = await self.swarm.new_stream(reducer.peer_id, PROTOCOL)
        except Exception as e:
            outcome.not_averaged = f"could not reach the reducer: {type(e).__name__}: {e}"
            return
        reader = FrameReader(stream)
        buffer = _ChunkBuffer(spans, self.pool)
        try:
            await self._exchange_on(stream, reader, buffer, part, outcome)
        finally:
            buffer.release()

    async def _exchange_on(self, stream: INetStream, reader: FrameReader, buffer: _ChunkBuffer, part: int,
                           outcome: PartOutcome) -> None:
        spans = self.plan.spans[part]
        clock = self._clock(self.download)
        returned = _Counter()
        got = 0
        try:
            async with beside(partial(self._send_chunks, stream, part, outcome, returned)):
                for k, span in enumerate(spans):
                    # The reducer itself may wait stall_timeout for another sender
                    # before it gives up on it: be more patient than that.
                    with trio.fail_after(2 * self.config.stall_timeout) as watchdog:
                        reader.watch(watchdog, 2 * self.config.stall_timeout)
                        head, payload = await buffer.read(reader, k, span, "the reducer", empty_ok=True)
                    clock.add(len(payload), time.perf_counter())
                    contributors = contributors_from_bits(bytes(head.contributors), self.group.size)
                    if bool(contributors) != bool(payload):
                        raise AllreduceProtocolError(f"the reducer returned chunk {k} with {len(payload)} bytes "
                                                     f"and {len(contributors)} contributors")
                    values = decode(payload, span.codec, span.end - span.start) if contributors else None
                    if values is not None and not serial.finite(values):
                        raise AllreduceProtocolError("the reducer returned non-finite values")
                    self._take(part, k, values, contributors, head.note.split("; ") if head.note else [])
                    got += 1
                    returned.advance(got)
        except Exception as e:
            why = (f"the reducer stalled for {2 * self.config.stall_timeout:.0f} s"
                   if isinstance(_innermost(e), trio.TooSlowError) else _describe(e))
            outcome.not_averaged = f"chunks {got}..{len(spans) - 1} kept own values: {why}"
            await finish_quietly(stream.reset)
        else:
            await finish_quietly(stream.close)
        outcome.bytes_received = reader.bytes_read

    async def _send_chunks(self, stream: INetStream, part: int, outcome: PartOutcome, returned: _Counter) -> None:
        assert self.values is not None
        bounds = self.plan.bounds
        clock = self._clock(self.upload)
        await stream.write(frame(pb.PartHeader(group_id=self.group.group_id, part=part, start=bounds[part],
                                               end=bounds[part + 1], weight=self.weight,
                                               chunk_elements=self.plan.chunk_elements)))
        ahead = self.config.max_chunks_ahead
        for k, span in enumerate(self.plan.spans[part]):
            await returned.wait_for(k - ahead + 1)
            payload = await self.values.payload(span)
            head = frame(pb.ChunkHeader(index=k, codec=span.codec, nbytes=len(payload)))
            await _write_chunk(stream, head, payload)
            clock.add(len(payload), time.perf_counter())
            outcome.bytes_sent += len(head) + len(payload)
