"""Calling experts over the swarm, from torch code that knows nothing of trio.

Torch's autograd calls a layer's forward and backward synchronously, while the
network runs in trio. :class:`ExpertClient` joins the two at one edge: the
model runs in a worker thread (``await client.run(step)``), and each remote
call inside it hands its coroutine to the trio loop
(``trio.from_thread.run`` with the client's token) and blocks that thread, not
the loop, until the answer or the timeout. Calls to many experts run at once
in one nursery (:meth:`ExpertClient.call_many`).

Every call is bounded by its timeout; a failure (no route, refused, wrong
shape, NaN, timeout) is an :class:`ExpertCallError` naming the expert and the
reason, and the expert is left out of searches for ``ban_time`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from averaging.tensor_stream import TensorStreamError, receive_tensors, tensors_message
from averaging.errors import AllreduceProtocolError
from averaging.wire import FrameReader, frame
from nat import Swarm
from p2p.errors import ConfigError, DedlocError
from p2p.trio_util import finish_quietly

from ..proto import moe_pb2 as pb
from .server import MAX_EXPERTS, MAX_REQUEST_HEADER, PROTOCOL, Kind, KindValue, Status

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
#: how an OVERLOADED answer reads in an ExpertCallError ("<expert>: overloaded: <reason>")
OVERLOADED = Status.Name(Status.OVERLOADED).lower()
#: how a server's resource manager words a refused stream (p2p/resources.py): busy, not broken
RESOURCE_LIMIT = "over the limit of"


class ExpertCallError(DedlocError):
    """One call to one expert failed (the message says which and why)."""


class MoEError(DedlocError):
    """A mixture-of-experts call could not give a result (no expert answered for some sample)."""


@dataclass(frozen=True)
class Expert:
    """Where one expert is served: its uid and its server."""

    uid: str
    peer_id: ID
    addrs: tuple[Multiaddr, ...] = ()

    def __str__(self) -> str:
        return f"{self.uid}@{str(self.peer_id)[-8:]}"


@dataclass
class ClientConfig:
    #: Time for one forward call (search excluded: the layer bounds the whole).
    forward_timeout: float = 10.0
    #: Time for one backward call.
    backward_timeout: float = 20.0
    #: Send and receive float16 (half the bytes; the expert computes in float32).
    half: bool = False
    #: An expert whose call failed is left out of searches this long (one that said it was overloaded:
    #: overload_ban_time).
    ban_time: float = 30.0
    overload_ban_time: float = 1.0
    #: Most rows the client sends in one call (the server's limit: keep them equal).
    max_rows: int = 4096
    #: Most tensor bytes of calls joined into one exchange (see :meth:`ExpertClient.call_many`): one
    #: stream window. At 200 ms one-way, joined exchanges of 1-4 MB took 5-12 s to write and the calls
    #: in them 7-11 s, against 1.1-1.6 s for the others (bench/moe_latency.py); likely, not measured
    #: directly, because yamux opens each stream at 256 KiB and grows it only within the connection's
    #: budget, which its streams share, so a larger request waits a round trip per window.
    max_join_bytes: int = 256 * 1024
    #: Calls in flight to one server at once; more wait here for a free one. A server's resource
    #: manager refuses more than 128 inbound streams per peer and protocol (its default
    #: ``max_inbound_streams_per_peer_protocol``), and counts those a caller gave up on (reset) until
    #: the reset arrives: a stream is either in a call or kept, so the two together never exceed this
    #: (a new stream is opened only when every kept one is in use), half the server's limit.
    max_streams_per_server: int = 64
    #: Streams kept open per server between calls (at most max_streams_per_server), and for how long at
    #: most (below the server's idle_timeout). Keep them all: a new stream costs a round trip (its
    #: protocol's negotiation) before the request, which at 200 ms one-way was a third of the throughput.
    max_idle_streams: int = 64
    keep_streams_for: float = 30.0
    #: Most worker threads :meth:`ExpertClient.run` keeps at once: asynchronous trainers keep many
    #: batches in flight to hide the swarm's latency (Learning@home 3.2), more than trio's default 40.
    max_threads: int = 128

    def validate(self) -> None:
        for name in ("forward_timeout", "backward_timeout", "ban_time", "overload_ban_time"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"expert client: {name} must be positive, got {getattr(self, name)}")
        for name in ("max_rows", "max_threads", "max_streams_per_server", "max_idle_streams", "max_join_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"expert client: {name} must be at least 1, got {getattr(self, name)}")
        if self.max_idle_streams > self.max_streams_per_server:
            raise ConfigError("expert client: max_idle_streams cannot exceed max_streams_per_server")


@dataclass
class CallStats:
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    #: the latest failures' reasons, newest last (at most 20)
    reasons: list[str] = field(default_factory=list)
    #: exchanges with servers, and the seconds calls spent waiting for one of a server's slots
    #: (max_streams_per_server) and in exchanges: where a call's time went
    exchanges: int = 0
    slot_wait_s: float = 0.0
    exchange_s: float = 0.0
    #: expert calls that found every slot of their server in use and went in one exchange with others
    joined: int = 0

    def failed(self, reason: str, timeout: bool) -> None:
        self.failures += 1
        self.timeouts += timeout
        self.reasons = [*self.reasons[-19:], reason]


class ExpertClient:
    """Calls experts on ``peer``'s swarm; see the module docstring. Use :meth:`open`."""

    def __init__(self, peer: Swarm, config: ClientConfig, token: trio.lowlevel.TrioToken) -> None:
        self.peer = peer
        self.config = config
        self._token = token
        #: (uid, server) -> monotonic time until which it is left out
        self._banned: dict[tuple[str, ID], float] = {}
        self.stats = CallStats()
        self._threads = trio.CapacityLimiter(config.max_threads)
        #: server -> streams kept between calls; streams to close (taken out of use) at the next chance
        self._streams: dict[ID, list[_Kept]] = {}
        self._closing: list[_Kept] = []
        #: server -> its calls in flight (bounded by max_streams_per_server)
        self._slots: dict[ID, trio.Semaphore] = {}
        #: (server, kind) -> the calls waiting together for one of its slots (see :meth:`call_many`)
        self._waiting: dict[tuple[ID, KindValue], _Group] = {}
        self._nursery: trio.Nursery | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, peer: Swarm, config: ClientConfig | None = None) -> AsyncIterator[ExpertClient]:
        config = config or ClientConfig()
        config.validate()
        client = cls(peer, config, trio.lowlevel.current_trio_token())
        try:
            async with trio.open_nursery() as nursery:
                client._nursery = nursery
                yield client
                nursery.cancel_scope.cancel()
        finally:
            client._nursery = None
            with trio.CancelScope(shield=True):
                await client.close_idle()

    # ------------------------------------------------------------------ the thread edge

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run torch code that calls experts (a forward, a backward, a training step) in a worker thread."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._threads)

    def blocking(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``async_fn(*args)`` in the client's trio loop from torch code in another thread."""
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("a remote expert was called from the trio loop's own thread, which it would block: "
                               "run the model with `await client.run(fn)` (a worker thread)")
        return trio.from_thread.run(async_fn, *args, trio_token=self._token)

    # ------------------------------------------------------------------ bans

    def banned(self, uid: str, peer_id: ID) -> bool:
        until = self._banned.get((uid, peer_id))
        if until is None:
            return False
        if until <= time.monotonic():
            del self._banned[(uid, peer_id)]
            return False
        return True

    def ban(self, expert: Expert, reason: str) -> None:
        """Leave ``expert`` out of searches for ``ban_time`` (``overload_ban_time`` when it said it was
        overloaded, or its node refused the stream over a resource limit: busy, not broken; a long ban
        of every busy expert of a small grid would empty it)."""
        if len(self._banned) > 100_000:  # bounded: forget the oldest half
            for key in sorted(self._banned, key=self._banned.__getitem__)[:50_000]:
                del self._banned[key]
        busy = f": {OVERLOADED}:" in reason or RESOURCE_LIMIT in reason  # its queue, or its resource manager
        seconds = self.config.overload_ban_time if busy else self.config.ban_time
        self._banned[(expert.uid, expert.peer_id)] = time.monotonic() + seconds
        log.info("expert %s left out for %.0f s: %s", expert, seconds, reason)

    # ------------------------------------------------------------------ calls

    async def info(self, expert: Expert, *, timeout: float | None = None) -> tuple[torch.Size, torch.Size]:
        """The shapes of one input row and one output row of ``expert``."""
        example = await self.call(expert, Kind.INFO, [], timeout=timeout or self.config.forward_timeout)
        return example[0].shape[1:], example[1].shape[1:]

    async def forward(self, expert: Expert, x: torch.Tensor, *, timeout: float | None = None) -> torch.Tensor:
        return (await self.call(expert, Kind.FORWARD, [x], timeout=timeout or self.config.forward_timeout))[0]

    async def backward(self, expert: Expert, x: torch.Tensor, grad: torch.Tensor, *,
                       timeout: float | None = None) -> torch.Tensor:
        return (await self.call(expert, Kind.BACKWARD, [x, grad],
                                timeout=timeout or self.config.backward_timeout))[0]

    async def call(self, expert: Expert, kind: KindValue, tensors: Sequence[torch.Tensor], *,
                   timeout: float) -> list[torch.Tensor]:
        """One call; :class:`ExpertCallError` (and the expert banned) on any failure or at ``timeout``."""
        self.stats.calls += 1
        try:
            with trio.fail_after(timeout):
                return await self._call(expert, kind, tensors)
        except Exception as e:  # the stream's own errors too (reset, a dial's failure): the expert is unreachable
            reason, timed_out = _failure(e, f"expert {expert}", timeout)
        self.stats.failed(reason, timed_out)
        self.ban(expert, reason)
        raise ExpertCallError(reason)

    async def _call(self, expert: Expert, kind: KindValue, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        rows = int(tensors[0].shape[0]) if tensors else 1
        if rows > self.config.max_rows:
            raise ExpertCallError(f"expert {expert}: {rows} rows in one call, more than max_rows "
                                  f"{self.config.max_rows}")
        if expert.addrs:
            self.peer.add_addrs(expert.peer_id, list(expert.addrs))
        request = pb.ExpertRequest(uid=expert.uid, kind=kind, half=self.config.half)
        want = 2 if kind == Kind.INFO else 1

        def check(_: pb.ExpertResponse, out: list[torch.Tensor]) -> list[torch.Tensor]:
            if len(out) != want:
                raise ExpertCallError(f"expert {expert}: answered {len(out)} tensors, not {want}")
            if kind != Kind.INFO and (out[0].dim() < 1 or out[0].shape[0] != rows):
                raise ExpertCallError(f"expert {expert}: answered {list(out[0].shape)} for {rows} rows")
            if kind == Kind.BACKWARD and out[0].shape != tensors[0].shape:
                raise ExpertCallError(f"expert {expert}: input gradient {list(out[0].shape)} for an input of "
                                      f"{list(tensors[0].shape)}")
            return [t.float() for t in out]

        async with self._slots_of(expert.peer_id):
            # an answer is at most as large as the caller's rows of a generous row (64 Ki values)
            return await self._call_on_a_stream(expert.peer_id, request, None if kind == Kind.INFO else tensors,
                                                4 * rows * (1 << 16) * want, f"expert {expert}", check)

    def _slots_of(self, peer_id: ID) -> trio.Semaphore:
        slots = self._slots.get(peer_id)
        if slots is None:
            if len(self._slots) > 10_000:  # bounded: drop the idle ones
                self._slots = {p: s for p, s in self._slots.items() if s.value < self.config.max_streams_per_server}
            slots = self._slots[peer_id] = trio.Semaphore(self.config.max_streams_per_server)
        return slots

    async def _call_on_a_stream(self, peer_id: ID, request: pb.ExpertRequest, tensors: Sequence[torch.Tensor] | None,
                                max_bytes: int, what: str,
                                check: Callable[[pb.ExpertResponse, list[torch.Tensor]], R]) -> R:
        """The exchange on a kept stream, else (none kept, or the server closed it) on a new one; what
        ``check`` makes of the answer (it raises :class:`ExpertCallError` for a wrong one)."""
        # streams taken out of use since the last call (the server counts them open): reset, not closed:
        # an idle stream holds nothing unread, and a reset is queued at once, where a close waits for
        # the connection's writer and, cut short under load, would leave the server holding the stream
        # until its idle_timeout (and its resource manager counting it against our streams)
        while self._closing:
            await finish_quietly(self._closing.pop().stream.reset, timeout=0.1)
        kept = self._take_stream(peer_id)
        if kept is not None:
            try:
                return await self._exchange(kept, peer_id, request, tensors, max_bytes, what, check)
            except _StaleStream:
                pass  # the server closed a kept stream (idle, restarted): once more on a new one
        # a new stream reset before any byte of its answer is tried once more when that cannot apply a
        # call twice: a forward or info (pure). A backward is not: the server may have applied its
        # gradients before the reset (a kept stream's stale end is the server's idle close, before any read)
        retries = 0 if request.kind == Kind.BACKWARD else 1
        for attempt in range(retries + 1):
            stream = await self.peer.new_stream(peer_id, PROTOCOL)
            try:
                return await self._exchange(_Kept(stream, FrameReader(stream), time.monotonic(),
                                                  retry=attempt < retries), peer_id, request,
                                            tensors, max_bytes, what, check)
            except _StaleStream as e:
                if attempt == retries:
                    raise ExpertCallError(f"{what}: the stream ended before an answer ({e})") from None
                log.debug("%s: a new stream ended before an answer (%s): once more", what, e)
        raise AssertionError("unreachable")

    async def _exchange(self, kept: _Kept, peer_id: ID, request: pb.ExpertRequest,
                        tensors: Sequence[torch.Tensor] | None, max_bytes: int, what: str,
                        check: Callable[[pb.ExpertResponse, list[torch.Tensor]], R]) -> R:
        """One request and its answer on ``kept``; the stream is kept again only after an OK answer
        read whole that ``check`` accepts (a server that answered wrong is not asked again on it).
        :class:`_StaleStream` when it failed before any byte of an answer came back."""
        stream, reader = kept.stream, kept.reader
        try:
            try:
                if tensors is None:
                    await stream.write(frame(request))
                else:  # the request and its tensors in one write: one turn on a busy connection, not three
                    await stream.write(await tensors_message(
                        [t.detach().to(torch.float16 if request.half else torch.float32) for t in tensors],
                        prefix=frame(request)))
                if await reader.at_eof():
                    raise _StaleStream("closed")
            except (OSError, EOFError, DedlocError) as e:
                raise _StaleStream(_describe(e)) from None
            except Exception as e:  # the stream's own errors (reset by the server)
                if not kept.retry:
                    raise
                raise _StaleStream(_describe(e)) from None
            response = await reader.message(pb.ExpertResponse, "expert response")
            if response.status != Status.OK:
                raise ExpertCallError(f"{what}: {Status.Name(response.status).lower()}: "
                                      f"{response.reason or 'no reason given'}")
            out = await receive_tensors(reader, max_bytes=max_bytes, max_tensors=2, allow_nonfinite=False)
            result = check(response, out)
        except (TensorStreamError, AllreduceProtocolError) as e:
            await finish_quietly(stream.reset)
            raise ExpertCallError(f"{what}: bad answer: {e}") from None
        except BaseException:
            await finish_quietly(stream.reset)
            raise
        self._keep(peer_id, kept)
        return result

    async def call_many(self, experts: Sequence[Expert], kind: KindValue, tensors: Sequence[Sequence[torch.Tensor]],
                        *, timeout: float) -> list[list[torch.Tensor] | ExpertCallError]:
        """Several experts of one server in one exchange (FORWARD or BACKWARD; ``tensors[i]`` is expert
        i's): each one's result, or its :class:`ExpertCallError` (it is banned). A trainer with many
        batches in flight needs a stream per batch and server this way, not per batch and expert.

        When every one of the server's slots is in use, the call joins the others waiting for that
        server (same kind) and they go out together in the next free slot as one exchange (up to
        ``max_rows`` rows, ``max_join_bytes`` of tensors and 1024 experts): the calls in flight to a
        far server are no longer capped by its streams (Little's law: 120 streams of 1.7 s exchanges
        held a trainer 200 ms from its servers to 70 exchanges a second each), and the server gets
        bigger batches."""
        if not experts:
            return []
        server = experts[0].peer_id
        if any(e.peer_id != server for e in experts) or len(tensors) != len(experts) or kind == Kind.INFO:
            raise ValueError("call_many: FORWARD or BACKWARD, experts of one server, one tensor list each")
        rows = [int(t[0].shape[0]) for t in tensors]
        what = f"server {str(server)[-8:]} ({len(experts)} experts)"
        self.stats.calls += len(experts)
        failure: str | None = None
        timed_out = False
        results: list[list[torch.Tensor] | ExpertCallError] = []
        try:
            if sum(rows) > self.config.max_rows:
                raise ExpertCallError(f"{what}: {sum(rows)} rows in one call, more than max_rows {self.config.max_rows}")
            for e in experts:
                if e.addrs:
                    self.peer.add_addrs(e.peer_id, list(e.addrs))
                    break
            with trio.fail_after(timeout):
                slots = self._slots_of(server)
                key = (server, kind)
                if (slots.value > 0 and key not in self._waiting) or self._nursery is None:
                    t0 = time.monotonic()
                    async with slots:
                        results = await self._exchange_many(server, kind, experts, tensors, rows, what, t0)
                else:
                    results = await self._join(key, experts, tensors, rows, timeout)
        except Exception as e:  # the stream's own errors too (reset, a dial's failure): the server is unreachable
            failure, timed_out = _failure(e, what, timeout)
        if failure is not None:
            results = [ExpertCallError(f"expert {e}: {failure}") for e in experts]
        for expert, result in zip(experts, results):
            if isinstance(result, ExpertCallError):
                self.stats.failed(str(result), timed_out)
                self.ban(expert, str(result))
        return results

    async def _exchange_many(self, server: ID, kind: KindValue, experts: Sequence[Expert],
                             tensors: Sequence[Sequence[torch.Tensor]], rows: list[int], what: str,
                             asked: float) -> list[list[torch.Tensor] | ExpertCallError]:
        """One exchange of several experts' calls (holding one of the server's slots, asked for at ``asked``)."""
        started = time.monotonic()
        joined = [torch.cat([t[i] for t in tensors]) for i in range(len(tensors[0]))]
        request = pb.ExpertRequest(kind=kind, half=self.config.half, uids=[e.uid for e in experts], rows=rows)

        def check(response: pb.ExpertResponse, out: list[torch.Tensor]) -> list[list[torch.Tensor] | ExpertCallError]:
            return self._split_answer(experts, kind, tensors, rows, response, out, what)

        try:
            return await self._call_on_a_stream(server, request, joined, 4 * sum(rows) * (1 << 16), what, check)
        finally:
            self.stats.exchanges += 1
            self.stats.slot_wait_s += started - asked
            self.stats.exchange_s += time.monotonic() - started

    async def _join(self, key: tuple[ID, KindValue], experts: Sequence[Expert],
                    tensors: Sequence[Sequence[torch.Tensor]], rows: list[int], timeout: float
                    ) -> list[list[torch.Tensor] | ExpertCallError]:
        """Wait with the other calls to a busy server for its next free slot, and go in one exchange."""
        group = self._waiting.get(key)
        # at most what a server takes in one request: its experts, rows, and header's bytes (each uid
        # with its tag and length, and its row count: at most 6 bytes more than the uid)
        header = sum(len(e.uid.encode()) + 6 for e in experts)
        size = sum(t.numel() for ts in tensors for t in ts) * (2 if self.config.half else 4)
        deadline = trio.current_time() + timeout
        if group is None or len(group.experts) + len(experts) > MAX_EXPERTS \
                or group.total_rows + sum(rows) > self.config.max_rows \
                or group.size + size > self.config.max_join_bytes \
                or group.header + header > MAX_REQUEST_HEADER - 64:
            group = self._waiting[key] = _Group(scope=trio.CancelScope(deadline=deadline))
            assert self._nursery is not None  # call_many joins only in an open client
            self._nursery.start_soon(self._send_group, key, group)
        first = len(group.experts)
        group.experts.extend(experts)
        group.tensors.extend(tensors)
        group.rows.extend(rows)
        group.total_rows += sum(rows)
        group.size += size
        group.header += header
        group.scope.deadline = max(group.scope.deadline, deadline)
        self.stats.joined += len(experts)
        await group.done.wait()
        if group.error is not None:
            raise group.error
        return group.results[first:first + len(experts)]

    async def _send_group(self, key: tuple[ID, KindValue], group: _Group) -> None:
        """The exchange of ``group`` (its callers wait, each within its own timeout; this one within the
        latest of theirs), in the server's next free slot; no more calls join once it has one."""
        server, kind = key
        try:
            with group.scope:
                try:
                    asked = time.monotonic()
                    async with self._slots_of(server):
                        if self._waiting.get(key) is group:
                            del self._waiting[key]
                        what = f"server {str(server)[-8:]} ({len(group.experts)} experts of joined calls)"
                        group.results = await self._exchange_many(server, kind, group.experts, group.tensors,
                                                                  group.rows, what, asked)
                except Exception as e:  # the callers' failure, said by each of them
                    group.error = e
            if group.scope.cancelled_caught:
                group.error = trio.TooSlowError()
        finally:  # the client closing cancels this too: its callers hear of it at once
            if group.error is None and len(group.results) != len(group.experts):
                group.error = ExpertCallError("the expert client closed before the exchange")
            if self._waiting.get(key) is group:
                del self._waiting[key]
            group.done.set()

    @staticmethod
    def _split_answer(experts: Sequence[Expert], kind: KindValue, tensors: Sequence[Sequence[torch.Tensor]],
                      rows: list[int], response: pb.ExpertResponse, out: list[torch.Tensor], what: str
                      ) -> list[list[torch.Tensor] | ExpertCallError]:
        if len(response.statuses) != len(experts) or len(response.reasons) != len(experts):
            raise ExpertCallError(f"{what}: answered {len(response.statuses)} statuses for {len(experts)} experts")
        ok = [i for i, status in enumerate(response.statuses) if status == Status.OK]
        if len(out) != (1 if ok else 0):
            raise ExpertCallError(f"{what}: answered {len(out)} tensors")
        ok_rows = [rows[i] for i in ok]
        if ok and (out[0].dim() < 1 or out[0].shape[0] != sum(ok_rows)):
            raise ExpertCallError(f"{what}: answered {list(out[0].shape)} for {sum(ok_rows)} rows")
        pieces = dict(zip(ok, torch.split(out[0].float(), ok_rows))) if ok else {}
        results: list[list[torch.Tensor] | ExpertCallError] = []
        for i, expert in enumerate(experts):
            if i not in pieces:
                results.append(ExpertCallError(f"expert {expert}: {Status.Name(response.statuses[i]).lower()}: "
                                               f"{response.reasons[i] or 'no reason given'}"))
            elif kind == Kind.BACKWARD and pieces[i].shape != tensors[i][0].shape:
                results.append(ExpertCallError(f"expert {expert}: input gradient {list(pieces[i].shape)} for an "
                                               f"input of {list(tensors[i][0].shape)}"))
            else:
                results.append([pieces[i]])
        return results

    def _take_stream(self, peer_id: ID) -> _Kept | None:
        """A kept stream to ``peer_id`` idle for less than ``keep_streams_for``, or None."""
        idle = self._streams.get(peer_id)
        now = time.monotonic()
        while idle:
            kept = idle.pop()
            if now - kept.since < self.config.keep_streams_for:
                kept.retry = True  # the server may have closed it meanwhile
                return kept
            self._closing.append(kept)  # too old: the server may close it any moment
        return None

    def _keep(self, peer_id: ID, kept: _Kept) -> None:
        kept.since = time.monotonic()
        idle = self._streams.setdefault(peer_id, [])
        if len(idle) < self.config.max_idle_streams:
            idle.append(kept)
        else:
            self._closing.append(kept)

    async def close_idle(self) -> None:
        """Give up every kept stream (reset: see :meth:`_call_on_a_stream`)."""
        for idle in self._streams.values():
            self._closing.extend(idle)
        self._streams.clear()
        closing, self._closing = self._closing, []
        for kept in closing:
            await finish_quietly(kept.stream.reset)


def _failure(e: Exception, what: str, timeout: float) -> tuple[str, bool]:
    """What a failed call says (and whether it timed out): one wording for single and many-expert calls."""
    if isinstance(e, trio.TooSlowError):
        return f"{what}: no answer within {timeout:.1f} s", True
    if isinstance(e, ExpertCallError):
        return str(e), False
    return f"{what}: {_describe(e)}", False


def _describe(e: BaseException) -> str:
    """``Type: message``, with the cause's message where py-libp2p's wrapper has none of its own (its
    ``StreamReset()`` says nothing; the Yamux error under it says who reset the stream, or that the
    connection ended, and why)."""
    text = f"{type(e).__name__}: {e}"
    cause = e.__cause__ or e.__context__
    if not str(e) and cause is not None:
        text += f"({type(cause).__name__}: {cause})"
    return text


class _StaleStream(Exception):
    """A stream failed before its answer began: a kept one (the server closed it meanwhile), or a
    new one where a retry cannot do harm; the call is tried once more on a new stream."""


@dataclass(eq=False)
class _Group:
    """Calls to one busy server that wait for its next free slot, to go as one exchange."""

    experts: list[Expert] = field(default_factory=list)
    tensors: list[Sequence[torch.Tensor]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    #: sum(rows), kept (a group grows to 1024 experts, one call at a time)
    total_rows: int = 0
    #: most bytes its request's uids and rows take
    header: int = 0
    #: its tensors' bytes
    size: int = 0
    #: the latest of its callers' deadlines
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    results: list[list[torch.Tensor] | ExpertCallError] = field(default_factory=list)
    error: Exception | None = None


@dataclass(eq=False)
class _Kept:
    """A stream to a server, kept between calls (the server serves one call after another on it)."""

    stream: INetStream
    reader: FrameReader
    since: float
    #: a failure before any answer byte is retried on a new stream (see :meth:`_call_on_a_stream`): a
    #: kept stream taken again, or a new one for a call that cannot be applied twice
    retry: bool = False


class _RemoteCall(torch.autograd.Function):
    """One expert as an autograd function: forward and backward are calls over the swarm."""

    @staticmethod
    def forward(ctx: Any, client: ExpertClient, expert: Expert, _trains: torch.Tensor, x: torch.Tensor
                ) -> torch.Tensor:
        ctx.client, ctx.expert = client, expert
        ctx.save_for_backward(x)
        out = client.blocking(client.forward, expert, x.detach().cpu())
        return out.to(x.device, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        client: ExpertClient = ctx.client
        gx = client.blocking(client.backward, ctx.expert, x.detach().cpu(), grad.detach().cpu())
        return None, None, None, gx.to(x.device, x.dtype) if ctx.needs_input_grad[3] else None


class RemoteExpert(torch.nn.Module):
    """One remote expert as a module: ``y = expert(x)``, differentiable (its backward trains it).

    Call it (and back-propagate) in a worker thread: ``await client.run(step)``.
    """

    def __init__(self, client: ExpertClient, expert: Expert) -> None:
        super().__init__()
        self.client = client
        self.expert = expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ``trains`` requires grad: the backward (the expert's training) runs even when x does not
        trains = torch.empty(0, requires_grad=True)
        out: torch.Tensor = _RemoteCall.apply(self.client, self.expert, trains, x)  # type: ignore[no-untyped-call]
        return out


__all__ = ["CallStats", "ClientConfig", "Expert", "ExpertCallError", "ExpertClient", "MoEError", "RemoteExpert"]
