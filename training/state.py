"""A peer's training state, served to peers that join late or fell behind.

Protocol ``/dedloc/train/state/1.0.0``: the asker writes one framed
``StateRequest`` (run id, the step it needs at least); the server answers
with a framed ``StateHeader`` (the step, the optimizer's and the scheduler's
state as JSON with every tensor replaced by its index) and one tensor message
(:mod:`averaging.tensor_stream`): the parameters, then the averaged gradients
of a delayed step not applied yet (if any), then the optimizer state's
tensors. The server sends a copy taken at once, so its training goes on.

The asker trusts nothing: the step must be the one it asked for or later,
every parameter must have its own parameter's dtype and shape, no value may
be NaN or Inf, sizes are bounded before anything is allocated (the tensors by
a few times the model's size, the metadata by :data:`MAX_META`), and the
optimizer must accept the state. Only then is anything of its own replaced;
a refusal leaves it as it was and the next peer is asked.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID

from averaging.tensor_stream import TensorStreamError, receive_tensors, send_tensors
from averaging.wire import FrameReader, frame
from nat import Swarm
from p2p.errors import DedlocError, describe
from p2p.hooks import Registration
from p2p.trio_util import finish_quietly

from .proto import training_pb2 as pb

log = logging.getLogger(__name__)

STATE_PROTOCOL = "/dedloc/train/state/1.0.0"
#: Largest metadata JSON (optimizer hyperparameters, scheduler counters) accepted.
MAX_META = 4 * 1024 * 1024


class StateDownloadError(DedlocError):
    """No peer gave us a usable state; the message says what each one did."""


@dataclass
class TrainingState:
    """What a peer serves: a copy of its parameters, optimizer and scheduler state at ``step``."""

    step: int
    params: list[torch.Tensor]
    #: a delayed step's averaged gradients, not applied yet (the asker applies them)
    pending: list[torch.Tensor] | None
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    #: the peer it came from (empty for a local one)
    source: str = ""


# ---------------------------------------------------------------------- state dicts <-> JSON + tensors


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` as JSON, every tensor replaced by ``{"t": index}`` (and appended to ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().clone())
        return {"t": len(tensors) - 1}
    if isinstance(value, dict):
        for key in value:  # what _join takes back: a key is a plain value
            if not (key is None or isinstance(key, (bool, int, float, str))):
                raise TypeError(f"cannot send a {type(key).__name__} key in a training state")
        return {"d": [[k, _split(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"u": [_split(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_split(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot send a {type(value).__name__} in a training state")


def _join(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of :func:`_split`; ValueError for anything it would not have written."""
    if isinstance(value, dict):
        if set(value) == {"t"} and isinstance(value["t"], int) and 0 <= value["t"] < len(tensors):
            return tensors[value["t"]]
        if set(value) == {"d"} and isinstance(value["d"], list):
            out = {}
            for pair in value["d"]:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise ValueError("malformed dictionary entry")
                key = _join(pair[0], tensors)
                if not isinstance(key, (int, str, float, bool)) and key is not None:
                    raise ValueError("a dictionary key must be a plain value")
                out[key] = _join(pair[1], tensors)
            return out
        if set(value) == {"u"} and isinstance(value["u"], list):
            return tuple(_join(v, tensors) for v in value["u"])
        raise ValueError("unknown object in the metadata")
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"unexpected {type(value).__name__} in the metadata")


# ---------------------------------------------------------------------- serving


#: States sent at once by one peer (:class:`StateServer`'s default).
MAX_UPLOADS = 2


class StateServer:
    """Serves ``snapshot()`` on the peer while installed (one stream per asker), to at most
    ``max_uploads`` askers at once: the others are refused at once ("busy"), and ask the next peer.

    Every asker sees the same sources in the same order (the freshest report first), so peers that
    join together all ask one peer (hivemind's issue #169). Served all at once, each took a copy of
    the parameters and the optimizer's state (three times the model, with Adam) and a share of one
    uplink that made every download slow; refused, they spread over the swarm's peers.
    """

    def __init__(self, peer: Swarm, run_id: str, snapshot: Callable[[], Awaitable[TrainingState]], *,
                 max_uploads: int = MAX_UPLOADS) -> None:
        if max_uploads < 1:
            raise ValueError(f"max_uploads must be >= 1, got {max_uploads}")
        self.peer = peer
        self.run_id = run_id
        self.snapshot = snapshot
        self.max_uploads = max_uploads
        self.served = 0
        self.refused_busy = 0
        self.uploading = 0

    def install(self) -> Registration:
        """Serve the training state until the registration is removed."""
        return self.peer.set_stream_handler(STATE_PROTOCOL, self._on_stream)

    async def _on_stream(self, stream: INetStream) -> None:
        reader = FrameReader(stream)
        try:
            with trio.fail_after(30):
                request = await reader.message(pb.StateRequest, "state request")
            if request.run_id != self.run_id:
                await _refuse(stream, f"this peer trains run {self.run_id!r}")
                return
            if self.uploading >= self.max_uploads:
                self.refused_busy += 1
                await _refuse(stream, f"busy: sending its state to {self.uploading} peers already")
                return
            self.uploading += 1
            try:
                await self._send(stream, request)
            finally:
                self.uploading -= 1
        except (trio.TooSlowError, DedlocError, OSError, EOFError, StreamError) as e:  # the asker reset or left
            log.info("state request from %s failed: %s", stream.muxed_conn.peer_id, describe(e))
            await finish_quietly(stream.reset)

    async def _send(self, stream: INetStream, request: pb.StateRequest) -> None:
        state = await self.snapshot()
        if state.step < request.min_step:
            await _refuse(stream, f"at step {state.step}, behind {request.min_step}")
            return
        tensors: list[torch.Tensor] = []
        meta = json.dumps({"optimizer": _split(state.optimizer, tensors),
                           "scheduler": _split(state.scheduler, tensors)})
        body = [*state.params, *(state.pending or []), *tensors]
        # tensor indices in the metadata count from the end of the parameters and pending gradients
        await stream.write(frame(pb.StateHeader(status=pb.StateHeader.OK, step=state.step,
                                                params=len(state.params), pending=state.pending is not None,
                                                meta=meta)))
        await send_tensors(stream, body)
        self.served += 1
        await finish_quietly(stream.close)


async def _refuse(stream: INetStream, reason: str) -> None:
    """Say why, then close: the asker reads the refusal to its end and asks the next peer."""
    await stream.write(frame(pb.StateHeader(status=pb.StateHeader.REFUSED, reason=reason)))
    await finish_quietly(stream.close)


def snapshot_of(step: int, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: Any,
                pending: Sequence[torch.Tensor] | None) -> TrainingState:
    """A copy of the state, so that training can go on while it is sent."""
    return TrainingState(
        step, [p.detach().clone() for p in params], None if pending is None else [g.clone() for g in pending],
        copy.deepcopy(optimizer.state_dict()), None if scheduler is None else copy.deepcopy(scheduler.state_dict()))


# ---------------------------------------------------------------------- downloading


async def download_state(peer: Swarm, run_id: str, sources: Sequence[ID], min_step: int,
                         params: Sequence[torch.Tensor], *, timeout: float = 60.0) -> TrainingState:
    """The state of the first of ``sources`` that gives a usable one (checked as the module says).

    :class:`StateDownloadError` lists what every source did when none did.
    """
    failures: list[str] = []
    for source in sources:
        try:
            with trio.fail_after(timeout):
                return await _download_from(peer, run_id, source, min_step, params)
        # StreamError: the source reset the stream or died mid-download (py-libp2p's StreamReset)
        except (trio.TooSlowError, DedlocError, ValueError, OSError, EOFError, StreamError) as e:
            reason = "timed out" if isinstance(e, trio.TooSlowError) else describe(e)
            log.warning("state download from %s failed: %s", source, reason)
            failures.append(f"{source}: {reason}")
    raise StateDownloadError("no peer served a usable state" + (": " + "; ".join(failures) if failures
                                                               else " (none to ask)"))


async def _download_from(peer: Swarm, run_id: str, source: ID, min_step: int,
                         params: Sequence[torch.Tensor]) -> TrainingState:
    stream = await peer.new_stream(source, STATE_PROTOCOL)
    try:
        await stream.write(frame(pb.StateRequest(run_id=run_id, min_step=min_step)))
        reader = FrameReader(stream)
        header = await reader.message(pb.StateHeader, "state header", max_size=MAX_META + 1024)
        if header.status != pb.StateHeader.OK:
            raise ValueError(f"refused: {header.reason or 'no reason given'}")
        if header.step < min_step:
            raise ValueError(f"sent step {header.step}, behind the {min_step} asked for")
        if header.params != len(params):
            raise ValueError(f"sent {header.params} parameters where this model has {len(params)}")
        model_bytes = sum(p.nbytes for p in params)
        body = await receive_tensors(reader, max_bytes=5 * model_bytes + (1 << 20),
                                     max_tensors=8 * len(params) + 64, allow_nonfinite=False)
    except TensorStreamError as e:
        await finish_quietly(stream.reset)
        raise ValueError(str(e)) from None
    except BaseException:
        await finish_quietly(stream.reset)
        raise
    await finish_quietly(stream.close)
    n = len(params)
    pending_n = n if header.pending else 0
    if len(body) < n + pending_n:
        raise ValueError(f"sent {len(body)} tensors, fewer than its {n} parameters")
    for i, (mine, theirs) in enumerate(zip(params, body[: n])):
        if mine.dtype != theirs.dtype or mine.shape != theirs.shape:
            raise ValueError(f"parameter {i} is {theirs.dtype} {tuple(theirs.shape)}, "
                             f"here {mine.dtype} {tuple(mine.shape)}")
    pending = body[n: n + pending_n] if header.pending else None
    if pending is not None:
        for i, (mine, g) in enumerate(zip(params, pending)):
            if g.shape != mine.shape:
                raise ValueError(f"pending gradient {i} has shape {tuple(g.shape)}, here {tuple(mine.shape)}")
    rest = body[n + pending_n:]
    try:
        meta = json.loads(header.meta)
        if not (isinstance(meta, dict) and set(meta) == {"optimizer", "scheduler"}):
            raise ValueError("metadata without the optimizer and scheduler state")
        optimizer = _join(meta["optimizer"], rest)
        scheduler = _join(meta["scheduler"], rest)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"unusable metadata: {e}") from None
    if not isinstance(optimizer, dict) or not (scheduler is None or isinstance(scheduler, dict)):
        raise ValueError("the optimizer or scheduler state is not a dictionary")
    return TrainingState(header.step, list(body[:n]), pending, optimizer, scheduler, source=source.to_base58())


def load_state(state: TrainingState, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
               scheduler: Any) -> None:
    """Put a downloaded state in place; ValueError (and nothing changed) if the optimizer or scheduler
    refuses it."""
    saved_opt = copy.deepcopy(optimizer.state_dict())
    saved_sched = None if scheduler is None else copy.deepcopy(scheduler.state_dict())
    try:
        optimizer.load_state_dict(state.optimizer)
        if scheduler is not None:
            if state.scheduler is None:
                raise ValueError("the peer has no scheduler state")
            scheduler.load_state_dict(state.scheduler)
    except Exception as e:
        optimizer.load_state_dict(saved_opt)
        if saved_sched is not None:  # None exactly when there is no scheduler
            scheduler.load_state_dict(saved_sched)
        raise ValueError(f"the optimizer or scheduler refused the state: {e}") from None
    with torch.no_grad():
        for p, value in zip(params, state.params):
            p.copy_(value)


__all__ = ["MAX_UPLOADS", "STATE_PROTOCOL", "StateDownloadError", "StateServer", "TrainingState", "download_state", "load_state",
           "snapshot_of"]
