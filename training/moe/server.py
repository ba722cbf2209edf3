"""Expert servers: torch modules hosted under grid uids, declared in the DHT, batched for the device.

Learning@home (section 3.3): trainers tolerate latency, so a server gathers
requests into batches for its device. Here the batching needs no fixed wait:
every expert has a queue for forwards and one for backwards, one device lock
is shared by all of them, and a batch takes every request queued by the time
it holds the lock. A lone caller waits for nothing; under load each batch
grows with what arrived while the previous one ran. Where requests come in
small and far apart (callers 200 ms away: most of them are on the wire, and a
server saw 2-10 per batch where it saw 18-31 at 0 ms), ``min_batch_size`` and
``max_wait`` let a batch wait for more rows before it takes the device, as
hivemind's TaskPool does; other experts' batches use the device meanwhile, and
each batch's fixed costs (the optimizer step, torch's per-op overhead, the
thread hop) are paid less often. A full queue answers
OVERLOADED at once (the caller asks another expert), so a server holds at most
``max_queue`` requests of ``max_request_rows`` rows per expert.

The forward and backward of a batch run in a worker thread (the one edge where
torch computes), one batch at a time. Backward recomputes the forward with
gradients on, back-propagates the callers' output gradients, and applies the
expert's optimizer, as hivemind's ModuleBackend does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio
from libp2p.abc import INetStream

from averaging.tensor_stream import TensorStreamError, receive_tensors, tensors_message
from averaging.errors import AllreduceProtocolError
from averaging.finite import tensor_finite
from averaging.wire import FrameReader, frame
from nat import Swarm
from p2p.errors import ConfigError
from p2p.trio_util import finish_quietly

from ..checkpoints import save_whole
from ..proto import moe_pb2 as pb
from .grid import ExpertUid, coordinate_subkey
from .protocol import (MAX_EXPERTS, MAX_REQUEST_HEADER, PROTOCOL, ExpertFailed, Kind, KindValue, Overloaded, Status,
                       StatusValue)

log = logging.getLogger(__name__)

@dataclass
class ServerConfig:
    #: Most rows in one batch of an expert (requests are never split: one may overshoot it).
    max_batch_size: int = 4096
    #: Most rows in one request.
    max_request_rows: int = 4096
    #: Requests waiting per expert and kind before the server answers OVERLOADED.
    max_queue: int = 256
    #: A batch with fewer rows waits up to ``max_wait`` s for more before it takes the device
    #: (the wait holds nothing: other experts' batches run meanwhile). 1: no wait.
    min_batch_size: int = 1
    max_wait: float = 0.0
    #: Time for a caller to send its request, and for the server to answer it.
    request_timeout: float = 30.0
    #: A caller's stream with no request for this long is closed (callers keep theirs for less).
    idle_timeout: float = 60.0
    #: How often the experts are declared in the DHT; each declaration lives ``expiration`` s.
    update_period: float = 30.0
    expiration: float = 90.0
    #: Save every expert's module and optimizer here this often (and on close), load it on open.
    checkpoint_dir: Path | None = None
    checkpoint_every: float = 300.0

    def validate(self) -> None:
        for name in ("max_batch_size", "min_batch_size", "max_request_rows", "max_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"experts: {name} must be at least 1, got {getattr(self, name)}")
        for name in ("request_timeout", "idle_timeout", "update_period", "expiration", "checkpoint_every"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"experts: {name} must be positive, got {getattr(self, name)}")
        if not self.max_wait >= 0:
            raise ConfigError(f"experts: max_wait must be >= 0, got {self.max_wait}")
        if self.min_batch_size > self.max_batch_size:
            raise ConfigError(f"experts: min_batch_size ({self.min_batch_size}) exceeds max_batch_size "
                              f"({self.max_batch_size})")
        if self.expiration <= self.update_period:
            raise ConfigError("experts: expiration must be longer than update_period (records would lapse)")


class _Abandoned(Exception):
    """The caller went away (reset its stream) before its answer was ready."""


@dataclass(eq=False)
class _Task:
    tensors: list[torch.Tensor]
    done: trio.Event = field(default_factory=trio.Event)
    result: torch.Tensor | None = None
    error: str | None = None
    #: the caller gave up: a batch that has not started yet leaves the task out
    abandoned: bool = False

    @property
    def rows(self) -> int:
        return int(self.tensors[0].shape[0])


class ExpertBackend:
    """One hosted expert: its module, optimizer and input schema (the shape of one row)."""

    def __init__(self, uid: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 row_shape: Sequence[int], *, device: torch.device | str = "cpu",
                 max_grad_norm: float | None = None) -> None:
        self.uid = ExpertUid.parse(uid)
        self.device = torch.device(device)
        self.module = module.to(self.device)
        self.optimizer = optimizer
        self.row_shape = tuple(int(s) for s in row_shape)
        self.max_grad_norm = max_grad_norm
        self.forwards = 0
        self.backwards = 0
        self.rows_processed = 0
        self.updates = 0
        with torch.no_grad():
            example = torch.zeros(1, *self.row_shape, device=self.device)
            out = module(example)
        if not isinstance(out, torch.Tensor) or out.shape[:1] != (1,):
            raise ConfigError(f"expert {uid}: the module must map a (batch, ...) tensor to a (batch, ...) tensor")
        self.out_row_shape = tuple(out.shape[1:])

    def schema(self) -> list[torch.Tensor]:
        """One example input and output row (INFO's answer)."""
        return [torch.zeros(1, *self.row_shape), torch.zeros(1, *self.out_row_shape)]

    def check(self, kind: KindValue, tensors: Sequence[torch.Tensor], max_rows: int) -> str | None:
        """What is wrong with a request's tensors, or None."""
        want = 1 if kind == Kind.FORWARD else 2
        if len(tensors) != want:
            return f"{'forward' if kind == Kind.FORWARD else 'backward'} takes {want} tensors, got {len(tensors)}"
        x = tensors[0]
        if x.dim() != 1 + len(self.row_shape) or tuple(x.shape[1:]) != self.row_shape:
            return f"expert {self.uid} takes rows of shape {list(self.row_shape)}, got a tensor of {list(x.shape)}"
        if not 1 <= x.shape[0] <= max_rows:
            return f"a request holds 1..{max_rows} rows, got {x.shape[0]}"
        if kind == Kind.BACKWARD and tuple(tensors[1].shape) != (x.shape[0], *self.out_row_shape):
            return (f"the output gradient must be {[x.shape[0], *self.out_row_shape]}, "
                    f"got {list(tensors[1].shape)}")
        if any(not t.is_floating_point() for t in tensors):
            return "tensors must be floating point"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A batch's outputs (runs in the worker thread)."""
        with torch.no_grad():
            out: torch.Tensor = self.module(x.to(self.device, torch.float32))
        self.forwards += 1
        self.rows_processed += x.shape[0]
        return out.float().cpu()

    def backward(self, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        """The gradient of the inputs for a batch; applies the optimizer (runs in the worker thread)."""
        # detached: ``to`` returns x itself when it changes nothing, and the caller's tensor would
        # then take requires_grad and, call after call, an accumulating .grad
        x = x.detach().to(self.device, torch.float32).requires_grad_(True)
        with torch.enable_grad():
            out = self.module(x)
            out.backward(grad_out.to(self.device, out.dtype))
        if self.optimizer is not None:
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.updates += 1
        self.module.zero_grad(set_to_none=True)
        self.backwards += 1
        self.rows_processed += x.shape[0]
        assert x.grad is not None
        return x.grad.cpu()

    def state_dict(self) -> dict[str, object]:
        return {"uid": str(self.uid), "module": self.module.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "updates": self.updates}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.module.load_state_dict(state["module"])  # type: ignore[arg-type]
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        self.updates = int(state.get("updates", 0))  # type: ignore[call-overload]


class _Pool:
    """The queue of one expert and kind, and its batching loop."""

    def __init__(self, backend: ExpertBackend, kind: KindValue, config: ServerConfig) -> None:
        self.backend, self.kind, self.config = backend, kind, config
        self.send, self.receive = trio.open_memory_channel[_Task](config.max_queue)
        self.batches = 0
        #: tasks left out because their caller had gone
        self.dropped = 0

    def submit(self, task: _Task) -> None:
        try:
            self.send.send_nowait(task)
        except trio.WouldBlock:
            raise Overloaded(f"expert {self.backend.uid}: {self.config.max_queue} requests already queued") from None

    async def run(self, device: trio.Lock) -> None:
        config = self.config
        async for first in self.receive:
            batch = [first]
            if config.max_wait > 0 and first.rows < config.min_batch_size:
                # before the device lock: a wait that held it would idle the device for every expert
                with trio.move_on_after(config.max_wait):
                    while sum(t.rows for t in batch) < config.min_batch_size:
                        batch.append(await self.receive.receive())
            async with device:
                while sum(t.rows for t in batch) < config.max_batch_size:
                    try:
                        batch.append(self.receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                self.dropped += sum(t.abandoned for t in batch)
                batch = [t for t in batch if not t.abandoned]
                if batch:
                    await self._process(batch)

    async def _process(self, batch: list[_Task]) -> None:
        sizes = [t.rows for t in batch]
        backend, forward = self.backend, self.kind == Kind.FORWARD

        def work() -> torch.Tensor:
            """The batch's tensors joined, computed and checked, all in the worker thread: the event
            loop only moves bytes (a busy server's loop spent a third of its time here)."""
            inputs = [torch.cat([t.tensors[i] for t in batch]) if len(batch) > 1 else batch[0].tensors[i]
                      for i in range(len(batch[0].tensors))]
            out = backend.forward(inputs[0]) if forward else backend.backward(inputs[0], inputs[1])
            if out.shape[0] != sum(sizes):
                raise ExpertFailed(f"returned {out.shape[0]} rows for {sum(sizes)}")
            if not tensor_finite(out):
                raise ExpertFailed("returned NaN or Inf")
            return out

        try:
            out = await trio.to_thread.run_sync(work)
            for task, part in zip(batch, torch.split(out, sizes)):
                task.result = part
        except Exception as e:  # the expert's own code: anything it raises fails this batch, not the server
            log.warning("expert %s: %s of %d rows failed: %s", backend.uid, Kind.Name(self.kind).lower(),
                        sum(sizes), e)
            for task in batch:
                task.error = f"{type(e).__name__}: {e}"
        self.batches += 1
        for task in batch:
            task.done.set()


class ExpertServer:
    """Hosts ``backends`` on ``peer``: serves calls, declares them in the DHT, checkpoints.

    Use :meth:`open`; the experts are reachable through every path the peer has
    (relays and hole punching included: it is one more protocol of the node).
    """

    def __init__(self, peer: Swarm, backends: Sequence[ExpertBackend], config: ServerConfig) -> None:
        self.peer = peer
        self.config = config
        self.backends = {str(b.uid): b for b in backends}
        if len(self.backends) != len(backends):
            raise ConfigError("experts: two backends share a uid")
        self._pools = {(uid, kind): _Pool(b, kind, config) for uid, b in self.backends.items()
                       for kind in (Kind.FORWARD, Kind.BACKWARD)}
        self._device = trio.Lock()
        self.declared_at: float | None = None
        self.calls = 0
        #: streams callers opened (each may carry many calls)
        self.streams = 0
        #: calls whose caller reset its stream before the answer
        self.abandoned = 0
        self.refused: dict[str, int] = {}

    @classmethod
    @asynccontextmanager
    async def open(cls, peer: Swarm, backends: Sequence[ExpertBackend],
                   config: ServerConfig | None = None) -> AsyncIterator[ExpertServer]:
        config = config or ServerConfig()
        config.validate()
        server = cls(peer, backends, config)
        server.load_checkpoints()
        registration = peer.set_stream_handler(PROTOCOL, server._on_stream)
        try:
            async with trio.open_nursery() as nursery:
                for pool in server._pools.values():
                    nursery.start_soon(pool.run, server._device)
                await server.declare()
                nursery.start_soon(server._declare_loop)
                if config.checkpoint_dir is not None:
                    nursery.start_soon(server._checkpoint_loop)
                yield server
                nursery.cancel_scope.cancel()
        finally:
            registration.remove()
            server.save_checkpoints()

    # ------------------------------------------------------------------ the DHT

    async def declare(self) -> int:
        """Store every prefix of every hosted uid (one record per prefix and next coordinate); how many
        records some replica took."""
        now = time.time()
        records: dict[tuple[str, str], bytes] = {}
        addrs = [bytes(a.to_bytes()) for a in self.peer.addrs]
        for uid in sorted(b.uid for b in self.backends.values()):
            for key, coord in uid.level_keys():
                records.setdefault((key, coordinate_subkey(coord, self.peer.peer_id)),
                                   pb.ExpertInfo(uid=str(uid), addrs=addrs).SerializeToString())
        stored = 0
        limiter = trio.CapacityLimiter(16)

        async def one(key: str, subkey: str, value: bytes) -> None:
            nonlocal stored
            async with limiter:
                try:
                    # awaited first: `stored += await ...` reads `stored` before the await, and
                    # the stores run at once (each would add to the count as it was when it began)
                    took = await self.peer.dht.store(key, value, now + self.config.expiration, subkey=subkey,
                                                     timeout=self.config.update_period / 2)
                    stored += took
                except Exception as e:  # a store that fails is retried next period; the server goes on
                    log.warning("experts: declaring %s failed: %s", key, e)

        async with trio.open_nursery() as nursery:
            for (key, subkey), value in records.items():
                nursery.start_soon(one, key, subkey, value)
        self.declared_at = now
        log.debug("experts: declared %d of %d records", stored, len(records))
        return stored

    async def _declare_loop(self) -> None:
        while True:
            await trio.sleep(self.config.update_period)
            await self.declare()

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_path(self, uid: str) -> Path:
        assert self.config.checkpoint_dir is not None
        return self.config.checkpoint_dir / f"{uid}.pt"

    def load_checkpoints(self) -> int:
        if self.config.checkpoint_dir is None:
            return 0
        loaded = 0
        for uid, backend in self.backends.items():
            path = self._checkpoint_path(uid)
            if path.exists():
                backend.load_state_dict(torch.load(path, map_location=backend.device, weights_only=True))
                loaded += 1
        if loaded:
            log.info("experts: loaded %d checkpoints from %s", loaded, self.config.checkpoint_dir)
        return loaded

    def save_checkpoints(self) -> None:
        if self.config.checkpoint_dir is None:
            return
        self.config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        for uid, backend in self.backends.items():
            save_whole(backend.state_dict(), self._checkpoint_path(uid))  # a crash leaves the previous one whole

    async def _checkpoint_loop(self) -> None:
        while True:
            await trio.sleep(self.config.checkpoint_every)
            async with self._device:  # not while a batch changes the weights
                await trio.to_thread.run_sync(self.save_checkpoints)

    # ------------------------------------------------------------------ serving

    def _count(self, status: StatusValue) -> None:
        """A refusal counted by its status (``refused``); OK counts nothing."""
        if status != Status.OK:
            name = Status.Name(status).lower()
            self.refused[name] = self.refused.get(name, 0) + 1

    async def _reply(self, stream: INetStream, status: StatusValue, reason: str) -> None:
        self._count(status)
        await stream.write(frame(pb.ExpertResponse(status=status, reason=reason[:500])))

    @staticmethod
    async def _answer(stream: INetStream, tensors: list[torch.Tensor], half: bool,
                      response: pb.ExpertResponse | None = None) -> None:
        """An OK answer (``response``, by default a bare OK) and its tensors, in one write: one turn on
        a busy connection, not three."""
        await stream.write(await tensors_message(
            [t.half() for t in tensors] if half else tensors,
            prefix=frame(response if response is not None else pb.ExpertResponse(status=Status.OK))))

    async def _on_stream(self, stream: INetStream) -> None:
        """Calls one after another on one stream, as long as each is answered OK (a caller keeps its
        streams: a new stream per call would cost a negotiation each, and a trainer's many calls a
        second would trip the resource manager's per-peer stream rate). Idle for ``idle_timeout``,
        or any refusal: the stream is closed."""
        reader = FrameReader(stream)
        self.streams += 1
        try:
            while True:
                with trio.move_on_after(self.config.idle_timeout):
                    if await reader.at_eof():
                        break
                if not reader.buffered:
                    break  # idle too long
                with trio.fail_after(self.config.request_timeout):
                    if not await self._serve(stream, reader):
                        break
            await finish_quietly(stream.close)
        except _Abandoned:
            await finish_quietly(stream.reset)
        except (trio.TooSlowError, AllreduceProtocolError, TensorStreamError, OSError, EOFError) as e:
            log.debug("experts: a call from %s failed: %s", stream.muxed_conn.peer_id, e)
            await finish_quietly(stream.reset)
        except Exception as e:  # the stream's own errors (reset by the caller that gave up)
            log.debug("experts: a call from %s ended: %s: %s", stream.muxed_conn.peer_id, type(e).__name__, e)
            await finish_quietly(stream.reset)

    async def _wait(self, reader: FrameReader, tasks: Sequence[_Task]) -> None:
        """Until ``tasks`` are done, or the caller goes away. A caller that gave up (its timeout, or
        a mixture that had its k_min answers) resets its stream; its tasks still queued are then
        left out of their batches (no device time for answers nobody reads) and the stream is given
        up at once (this node's resource manager counts it against the caller's stream limits until
        then, and under load those queued answers would outlive the callers' timeouts and crowd out
        the next calls). A caller that half-closes after its request still gets its answer.
        Raises :class:`_Abandoned` when the caller went away."""
        gone = False
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                nonlocal gone
                try:
                    await reader.at_eof()  # a caller sends nothing before its answer
                except Exception:  # reset: gone (a clean end is a caller that half-closed and still reads)
                    gone = True
                    nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            for task in tasks:
                await task.done.wait()
            nursery.cancel_scope.cancel()
        if gone:
            for task in tasks:
                task.abandoned = True
            self.abandoned += 1
            raise _Abandoned

    async def _serve(self, stream: INetStream, reader: FrameReader) -> bool:
        """One call; True when it was answered OK (the stream may carry the next one)."""
        request = await reader.message(pb.ExpertRequest, "expert request", max_size=MAX_REQUEST_HEADER)
        if request.uids:
            return await self._serve_many(stream, reader, request)
        backend = self.backends.get(request.uid)
        if backend is None:
            await self._reply(stream, Status.UNKNOWN_EXPERT, f"this server does not host {request.uid!r:.100}")
            return False
        if request.kind == Kind.INFO:
            await self._answer(stream, backend.schema(), False)
            return True
        if request.kind not in (Kind.FORWARD, Kind.BACKWARD):
            await self._reply(stream, Status.BAD_REQUEST, f"unknown request kind {request.kind}")
            return False
        count = 1 if request.kind == Kind.FORWARD else 2
        row = math.prod(backend.row_shape) + (0 if count == 1 else math.prod(backend.out_row_shape))
        try:
            tensors = await receive_tensors(reader, max_bytes=4 * self.config.max_request_rows * row,
                                            max_tensors=count, allow_nonfinite=False)
        except TensorStreamError as e:
            await self._reply(stream, Status.BAD_REQUEST, str(e))
            raise
        problem = backend.check(request.kind, tensors, self.config.max_request_rows)
        if problem is not None:
            await self._reply(stream, Status.BAD_REQUEST, problem)
            return False
        task = _Task([t.float() for t in tensors])
        try:
            self._pools[(request.uid, request.kind)].submit(task)
        except Overloaded as e:
            await self._reply(stream, Status.OVERLOADED, str(e))
            return False
        self.calls += 1
        await self._wait(reader, [task])
        if task.error is not None or task.result is None:
            await self._reply(stream, Status.FAILED, task.error or "no result")
            return False
        await self._answer(stream, [task.result], request.half)
        return True


    async def _serve_many(self, stream: INetStream, reader: FrameReader, request: pb.ExpertRequest) -> bool:
        """A call of several experts (moe.proto): each answered on its own, the call OK as a whole."""
        uids, rows = list(request.uids), list(request.rows)
        if request.kind not in (Kind.FORWARD, Kind.BACKWARD) or len(uids) != len(rows) or len(uids) > MAX_EXPERTS \
                or not all(rows) or sum(rows) > self.config.max_request_rows:
            await self._reply(stream, Status.BAD_REQUEST, f"a call of {len(uids)} experts needs FORWARD or BACKWARD, "
                              f"as many row counts, each >= 1, at most {self.config.max_request_rows} rows in all")
            return False
        backends = [self.backends.get(uid) for uid in uids]
        known = [b for b in backends if b is not None]
        if not known:
            await self._reply(stream, Status.UNKNOWN_EXPERT, "this server hosts none of them")
            return False
        first = known[0]
        if any(b.row_shape != first.row_shape or b.out_row_shape != first.out_row_shape for b in known):
            await self._reply(stream, Status.BAD_REQUEST, "experts of different shapes cannot share a call")
            return False
        count = 1 if request.kind == Kind.FORWARD else 2
        row = math.prod(first.row_shape) + (0 if count == 1 else math.prod(first.out_row_shape))
        try:
            tensors = await receive_tensors(reader, max_bytes=4 * sum(rows) * row, max_tensors=count,
                                            allow_nonfinite=False)
        except TensorStreamError as e:
            await self._reply(stream, Status.BAD_REQUEST, str(e))
            raise
        problem = first.check(request.kind, tensors, self.config.max_request_rows)
        if problem is None and tensors[0].shape[0] != sum(rows):
            problem = f"{tensors[0].shape[0]} rows where the row counts add up to {sum(rows)}"
        if problem is not None:
            await self._reply(stream, Status.BAD_REQUEST, problem)
            return False
        pieces = list(zip(*(torch.split(t.float(), rows) for t in tensors)))
        statuses: list[StatusValue] = []
        reasons: list[str] = []
        tasks: list[_Task | None] = []
        for uid, backend, piece in zip(uids, backends, pieces):
            task = None
            if backend is None:
                statuses.append(Status.UNKNOWN_EXPERT)
                reasons.append(f"this server does not host {uid!r:.100}")
            else:
                task = _Task(list(piece))
                try:
                    self._pools[(uid, request.kind)].submit(task)
                    statuses.append(Status.OK)
                    reasons.append("")
                    self.calls += 1
                except Overloaded as e:
                    task = None
                    statuses.append(Status.OVERLOADED)
                    reasons.append(str(e))
            tasks.append(task)
        await self._wait(reader, [t for t in tasks if t is not None])
        outputs = []
        for i, task in enumerate(tasks):
            if task is None:
                continue
            if task.error is not None or task.result is None:
                statuses[i], reasons[i] = Status.FAILED, task.error or "no result"
            else:
                outputs.append(task.result)
        for status in statuses:
            self._count(status)
        joined = [torch.cat(outputs)] if outputs else []
        await self._answer(stream, joined, request.half, pb.ExpertResponse(
            status=Status.OK, statuses=statuses, reasons=[r[:300] for r in reasons]))
        return True


__all__ = ["ExpertBackend", "ExpertServer", "ServerConfig"]
