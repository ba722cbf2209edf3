"""Calling experts over the swarm, from torch code that knows nothing of trio.

Torch's autograd calls a layer's forward and backward synchronously, while the
network runs in trio. :class:`ExpertClient` joins the two at one edge: the
model runs in a worker thread (``await client.run(step)``), and each remote
call inside it hands its coroutine to the trio loop
(``trio.from_thread.run`` with the client's token) and blocks that thread, not
the loop, until the answer or the timeout. Calls to many experts run at once
in one nursery (:meth:`ExpertClient.call_many`).

The client is the shell of :class:`~.calls.CallTable`, which decides per
server (slots, kept streams, joined calls, bans, retries) with trio's clock
passed in; here are the streams, the waits and the torch tensors. Every call
is bounded by its timeout; a failure (no route, refused, wrong shape, NaN,
timeout) is an :class:`ExpertCallError` naming the expert and the reason, and
the expert is left out of searches (``ban_time`` seconds, or
``overload_ban_time`` when it was busy).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from averaging.tensor_stream import TensorStreamError, receive_tensors, tensors_message
from averaging.errors import AllreduceProtocolError
from averaging.wire import FrameReader, frame
from nat import Swarm
from p2p.errors import DedlocError
from p2p.trio_util import finish_quietly

from ..proto import moe_pb2 as pb
from .calls import CallTable, ClientConfig, Joined, new_stream_tries
from .protocol import (PROTOCOL, Expert, ExpertCallError, Kind, KindValue, MoEError, Status, answer_limit,
                       check_answer, describe, failure, header_bytes, refused_busy, split_answer, status_error)

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
Results = list[list[torch.Tensor] | ExpertCallError]


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
        self.stats = CallStats()
        self._threads = trio.CapacityLimiter(config.max_threads)
        #: the decisions: slots (their waiters are woken here), kept streams, joined calls, bans
        self._table: CallTable[_Kept, trio.Event, _Part] = CallTable(config)
        #: each joined group's exchange while its callers wait
        self._exchanges: dict[Joined[_Part], _Exchange] = {}
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
        self._not_in_the_loop()
        return trio.from_thread.run(async_fn, *args, trio_token=self._token)

    def blocking_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` (which reads the loop's clock, as :meth:`ban` does) in the client's trio loop
        from torch code in another thread."""
        self._not_in_the_loop()
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    @staticmethod
    def _not_in_the_loop() -> None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            return
        raise RuntimeError("a remote expert was called from the trio loop's own thread, which it would block: "
                           "run the model with `await client.run(fn)` (a worker thread)")

    # ------------------------------------------------------------------ bans

    def banned(self, uid: str, peer_id: ID) -> bool:
        """Whether the expert is left out of searches now (call it in the loop)."""
        return self._table.banned(uid, peer_id, trio.current_time())

    def unreachable(self, peer_id: ID) -> bool:
        """Whether every expert of server ``peer_id`` is left out now, as unreachable (in the loop)."""
        return self._table.unreachable(peer_id, trio.current_time())

    def ban_left(self, expert: Expert) -> float:
        """Seconds until ``expert`` is back in searches (0 when it is not left out); in the loop."""
        return self._table.ban_left(expert.uid, expert.peer_id, trio.current_time())

    def ban(self, expert: Expert, error: ExpertCallError) -> None:
        """Count ``error`` and leave ``expert`` out of searches (:meth:`CallTable.ban`: briefly when it
        was busy, with every expert of its server when that was unreachable); call it in the loop."""
        self.stats.failed(str(error), error.timed_out)
        seconds = self._table.ban(expert.uid, expert.peer_id, error, trio.current_time())
        log.info("expert %s%s left out for %.0f s: %s", expert, " and every expert of its server (unreachable)"
                 if error.unreachable else "", seconds, error)

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
            error = failure(e, f"expert {expert}", timeout)
        self.ban(expert, error)
        raise error

    async def _call(self, expert: Expert, kind: KindValue, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        rows = int(tensors[0].shape[0]) if tensors else 1
        what = f"expert {expert}"
        if rows > self.config.max_rows:
            raise ExpertCallError(f"{what}: {rows} rows in one call, more than max_rows {self.config.max_rows}")
        if expert.addrs:
            self.peer.add_addrs(expert.peer_id, list(expert.addrs))
        request = pb.ExpertRequest(uid=expert.uid, kind=kind, half=self.config.half)

        def check(_: pb.ExpertResponse, out: list[torch.Tensor]) -> list[torch.Tensor]:
            return check_answer(what, kind, tensors, out)

        async with self._slot(expert.peer_id):
            return await self._call_on_a_stream(expert.peer_id, request, None if kind == Kind.INFO else tensors,
                                                answer_limit(rows, 2 if kind == Kind.INFO else 1), what, check)

    @asynccontextmanager
    async def _slot(self, server: ID) -> AsyncIterator[None]:
        """One of ``server``'s slots for the time of the block, waited for in line (rule 2 of
        :mod:`.calls`)."""
        woken = trio.Event()  # set by the release that hands this waiter its slot
        held = self._table.acquire(server, woken)
        try:
            if not held:
                await woken.wait()
            yield
        finally:
            # it holds the slot when it got one at once or was handed one (even if cancelled before it
            # woke); only a waiter still in line is withdrawn (a scan of the line: on cancellation only)
            if held or woken.is_set() or not self._table.withdraw(server, woken):
                following = self._table.release(server)
                if following is not None:
                    following.set()

    async def _call_on_a_stream(self, peer_id: ID, request: pb.ExpertRequest, tensors: Sequence[torch.Tensor] | None,
                                max_bytes: int, what: str,
                                check: Callable[[pb.ExpertResponse, list[torch.Tensor]], R]) -> R:
        """The exchange on a kept stream, else (none kept, or the server closed it) on a new one; what
        ``check`` makes of the answer (it raises :class:`ExpertCallError` for a wrong one)."""
        kept = self._table.take_stream(peer_id, trio.current_time())
        # streams taken out of use since the last call and by this one (the server counts them open):
        # reset, not closed: an idle stream holds nothing unread, and a reset is queued at once, where
        # a close waits for the connection's writer and, cut short under load, would leave the server
        # holding the stream until its idle_timeout (and its resource manager counting it against ours)
        while (old := self._table.reset_next()) is not None:
            await finish_quietly(old.stream.reset, timeout=0.1)
        if kept is not None:
            kept.retry = True  # the server may have closed it meanwhile
            try:
                return await self._exchange(kept, peer_id, request, tensors, max_bytes, what, check)
            except _StaleStream:
                pass  # the server closed a kept stream (idle, restarted): once more on a new one
        tries, attempt = new_stream_tries(request.kind), 1
        while True:
            stream = await self.peer.new_stream(peer_id, PROTOCOL)
            try:
                return await self._exchange(_Kept(stream, FrameReader(stream), retry=attempt < tries), peer_id,
                                            request, tensors, max_bytes, what, check)
            except _StaleStream as e:
                if attempt == tries:
                    raise ExpertCallError(f"{what}: the stream ended before an answer ({e})", busy=e.busy) from None
                log.debug("%s: a new stream ended before an answer (%s): once more", what, e)
            attempt += 1

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
                raise _StaleStream(describe(e), busy=refused_busy(e)) from None
            except Exception as e:  # the stream's own errors (reset by the server)
                if not kept.retry:
                    raise  # the call's own failure (busy or not: ``failure`` reads its causes)
                raise _StaleStream(describe(e)) from None  # retried: never the call's last word
            response = await reader.message(pb.ExpertResponse, "expert response")
            if response.status != Status.OK:
                raise status_error(what, response.status, response.reason)
            out = await receive_tensors(reader, max_bytes=max_bytes, max_tensors=2, allow_nonfinite=False)
            result = check(response, out)
        except (TensorStreamError, AllreduceProtocolError) as e:
            await finish_quietly(stream.reset)
            raise ExpertCallError(f"{what}: bad answer: {e}") from None
        except BaseException:
            await finish_quietly(stream.reset)
            raise
        self._table.keep(peer_id, kept, trio.current_time())
        return result

    async def call_many(self, experts: Sequence[Expert], kind: KindValue, tensors: Sequence[Sequence[torch.Tensor]],
                        *, timeout: float) -> Results:
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
        results: Results = []
        try:
            if sum(rows) > self.config.max_rows:
                raise ExpertCallError(f"{what}: {sum(rows)} rows in one call, more than max_rows {self.config.max_rows}")
            for e in experts:
                if e.addrs:
                    self.peer.add_addrs(e.peer_id, list(e.addrs))
                    break
            with trio.fail_after(timeout):
                if self._nursery is None or not self._table.joins(server, kind):
                    asked = trio.current_time()
                    async with self._slot(server):
                        results = await self._exchange_many(server, kind, _Part(experts, tensors, rows), what, asked)
                else:
                    results = await self._join(server, kind, _Part(experts, tensors, rows), timeout)
        except Exception as e:  # the stream's own errors too (reset, a dial's failure): the server is unreachable
            error = failure(e, what, timeout)
            results = [ExpertCallError(f"expert {expert}: {error}", busy=error.busy, timed_out=error.timed_out,
                                       unreachable=error.unreachable) for expert in experts]
        for expert, result in zip(experts, results):
            if isinstance(result, ExpertCallError):
                self.ban(expert, result)
        return results

    async def _exchange_many(self, server: ID, kind: KindValue, part: _Part, what: str, asked: float) -> Results:
        """One exchange of several experts' calls (holding one of the server's slots, asked for at ``asked``)."""
        started = trio.current_time()
        experts, tensors, rows = part.experts, part.tensors, part.rows
        joined = [torch.cat([t[i] for t in tensors]) for i in range(len(tensors[0]))]
        request = pb.ExpertRequest(kind=kind, half=self.config.half, uids=[e.uid for e in experts], rows=rows)

        def check(response: pb.ExpertResponse, out: list[torch.Tensor]) -> Results:
            return split_answer(what, experts, kind, tensors, rows, response, out)

        try:
            return await self._call_on_a_stream(server, request, joined, answer_limit(sum(rows), 1), what, check)
        finally:
            self.stats.exchanges += 1
            self.stats.slot_wait_s += started - asked
            self.stats.exchange_s += trio.current_time() - started

    async def _join(self, server: ID, kind: KindValue, part: _Part, timeout: float) -> Results:
        """Wait with the other calls to a busy server for its next free slot, and go in one exchange."""
        size = sum(t.numel() for ts in part.tensors for t in ts) * (2 if self.config.half else 4)
        group, first, new = self._table.join(server, kind, part, experts=len(part.experts), rows=sum(part.rows),
                                             size=size, header=header_bytes([e.uid for e in part.experts]),
                                             deadline=trio.current_time() + timeout)
        if new:
            exchange = self._exchanges[group] = _Exchange(trio.CancelScope(deadline=group.deadline))
            assert self._nursery is not None  # call_many joins only in an open client
            self._nursery.start_soon(self._send_group, server, group, exchange)
        exchange = self._exchanges[group]
        exchange.scope.deadline = group.deadline
        self.stats.joined += len(part.experts)
        await exchange.done.wait()
        if exchange.error is not None:
            raise exchange.error
        return exchange.results[first:first + len(part.experts)]

    async def _send_group(self, server: ID, group: Joined[_Part], exchange: _Exchange) -> None:
        """The exchange of ``group`` (its callers wait, each within its own timeout; this one within the
        latest of theirs), in the server's next free slot; no more calls join once it has one."""
        try:
            with exchange.scope:
                try:
                    asked = trio.current_time()
                    async with self._slot(server):
                        self._table.sending(server, group)
                        part = _Part([e for p in group.items for e in p.experts],
                                     [t for p in group.items for t in p.tensors],
                                     [r for p in group.items for r in p.rows])
                        what = f"server {str(server)[-8:]} ({len(part.experts)} experts of joined calls)"
                        exchange.results = await self._exchange_many(server, group.kind, part, what, asked)
                except Exception as e:  # the callers' failure, said by each of them
                    exchange.error = e
            if exchange.scope.cancelled_caught:
                exchange.error = trio.TooSlowError()
        finally:  # the client closing cancels this too: its callers hear of it at once
            if exchange.error is None and len(exchange.results) != group.experts:
                exchange.error = ExpertCallError("the expert client closed before the exchange")
            self._table.sending(server, group)
            del self._exchanges[group]
            exchange.done.set()

    async def close_idle(self) -> None:
        """Give up every kept stream (reset: see :meth:`_call_on_a_stream`)."""
        for kept in self._table.close():
            await finish_quietly(kept.stream.reset)


class _StaleStream(Exception):
    """A stream failed before its answer began: a kept one (the server closed it meanwhile), or a
    new one where a retry cannot do harm; the call is tried once more on a new stream. ``busy``: its
    node refused it over a resource limit."""

    def __init__(self, message: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


@dataclass(frozen=True)
class _Part:
    """What one call of several experts carries: the experts, each one's tensors and rows."""

    experts: Sequence[Expert]
    tensors: Sequence[Sequence[torch.Tensor]]
    rows: list[int]


@dataclass(eq=False)
class _Exchange:
    """A joined group's exchange, as its callers wait for it."""

    #: the latest of its callers' deadlines
    scope: trio.CancelScope
    done: trio.Event = field(default_factory=trio.Event)
    results: Results = field(default_factory=list)
    error: Exception | None = None


@dataclass(eq=False)
class _Kept:
    """A stream to a server, kept between calls (the server serves one call after another on it)."""

    stream: INetStream
    reader: FrameReader
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
