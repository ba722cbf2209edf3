"""The expert protocol's vocabulary: its name and limits, requests, answers and typed failures.

The client (:mod:`.client`, with its decisions in :mod:`.calls`) and the
server (:mod:`.server`) both import this module and not each other. The wire
format is ``training/proto/moe.proto``; what here is pure: the checks that
turn an answer into tensors or a failure (:func:`check_answer`,
:func:`split_answer`), and the one wording of a failed call with the two facts
a decision needs from it, typed, not read back from its text: whether it
timed out, and whether the expert was busy rather than broken
(:func:`failure`: a busy expert is left out briefly, a broken one long).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.errors import DedlocError, DialError, cause_of, describe
from p2p.multistream import PeerRefused

from ..proto import moe_pb2 as pb

PROTOCOL = "/dedloc/moe/expert/1.0.0"
#: Most experts in one exchange, and most bytes of its request (1024 uids of up to ~60 bytes with their
#: row counts: a client joins many batches' calls to a busy server into one exchange).
MAX_EXPERTS = 1024
MAX_REQUEST_HEADER = 64 * 1024
#: Most values in one row of an answer a client reads (a generous row: 64 Ki float32 values).
MAX_ROW_VALUES = 1 << 16
Kind = pb.ExpertRequest.Kind
Status = pb.ExpertResponse.Status
KindValue: TypeAlias = pb.ExpertRequest.Kind.ValueType
StatusValue: TypeAlias = pb.ExpertResponse.Status.ValueType


@dataclass(frozen=True)
class Expert:
    """Where one expert is served: its uid and its server."""

    uid: str
    peer_id: ID
    addrs: tuple[Multiaddr, ...] = ()

    def __str__(self) -> str:
        return f"{self.uid}@{str(self.peer_id)[-8:]}"


class ExpertCallError(DedlocError):
    """One call to one expert failed (the message says which and why).

    ``timed_out``: no answer within the call's timeout. ``busy``: the expert said it was overloaded,
    or its node refused the stream over a resource limit: busy, not broken (it is left out of
    searches for a short while, not a long one). ``unreachable``: no connection to its server could
    be made (a :class:`~p2p.errors.DialError`): every expert of that server is left out, not this
    one alone.
    """

    def __init__(self, message: str, *, busy: bool = False, timed_out: bool = False,
                 unreachable: bool = False) -> None:
        super().__init__(message)
        self.busy = busy
        self.timed_out = timed_out
        self.unreachable = unreachable


class MoEError(DedlocError):
    """A mixture-of-experts call could not give a result (no expert answered for some sample)."""


class ExpertFailed(DedlocError):
    """The expert's forward or backward raised, or returned something unusable."""


class Overloaded(DedlocError):
    """The expert's queue is full."""


def status_error(what: str, status: StatusValue, reason: str) -> ExpertCallError:
    """A refusal the server answered (``what: overloaded: <its reason>``)."""
    return ExpertCallError(f"{what}: {Status.Name(status).lower()}: {reason or 'no reason given'}",
                           busy=status == Status.OVERLOADED)


def answer_limit(rows: int, tensors: int) -> int:
    """Most bytes of an answer of ``tensors`` tensors for ``rows`` rows (see MAX_ROW_VALUES)."""
    return 4 * rows * MAX_ROW_VALUES * tensors


def header_bytes(uids: Sequence[str]) -> int:
    """Most bytes these uids take in a request of several experts: each with its tag and length, and
    its row count (at most 6 bytes more than the uid)."""
    return sum(len(uid.encode()) + 6 for uid in uids)


def check_answer(what: str, kind: KindValue, inputs: Sequence[torch.Tensor], out: list[torch.Tensor]
                 ) -> list[torch.Tensor]:
    """A one-expert call's answer as float32 tensors, or :class:`ExpertCallError` for a wrong one:
    INFO answers an example input and output, FORWARD the outputs of the input's rows, BACKWARD the
    gradient of the input, of its shape."""
    want = 2 if kind == Kind.INFO else 1
    if len(out) != want:
        raise ExpertCallError(f"{what}: answered {len(out)} tensors, not {want}")
    if kind != Kind.INFO:
        rows = int(inputs[0].shape[0])
        if out[0].dim() < 1 or out[0].shape[0] != rows:
            raise ExpertCallError(f"{what}: answered {list(out[0].shape)} for {rows} rows")
    if kind == Kind.BACKWARD and out[0].shape != inputs[0].shape:
        raise ExpertCallError(f"{what}: input gradient {list(out[0].shape)} for an input of "
                              f"{list(inputs[0].shape)}")
    return [t.float() for t in out]


def split_answer(what: str, experts: Sequence[Expert], kind: KindValue, inputs: Sequence[Sequence[torch.Tensor]],
                 rows: Sequence[int], response: pb.ExpertResponse, out: list[torch.Tensor]
                 ) -> list[list[torch.Tensor] | ExpertCallError]:
    """A call of several experts' answer: each one's tensors, or its own :class:`ExpertCallError`
    (its status); :class:`ExpertCallError` for the whole when the answer itself is wrong."""
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
            results.append(status_error(f"expert {expert}", response.statuses[i], response.reasons[i]))
        elif kind == Kind.BACKWARD and pieces[i].shape != inputs[i][0].shape:
            results.append(ExpertCallError(f"expert {expert}: input gradient {list(pieces[i].shape)} for an "
                                           f"input of {list(inputs[i][0].shape)}"))
        else:
            results.append([pieces[i]])
    return results


def failure(e: BaseException, what: str, timeout: float) -> ExpertCallError:
    """What a failed call says: one wording for single and many-expert calls, typed."""
    if isinstance(e, ExpertCallError):
        return e
    if isinstance(e, trio.TooSlowError):
        return ExpertCallError(f"{what}: no answer within {timeout:.1f} s", timed_out=True)
    return ExpertCallError(f"{what}: {describe(e)}", busy=refused_busy(e),
                           unreachable=cause_of(e, DialError, 3) is not None)


def refused_busy(e: BaseException) -> bool:
    """``e`` is, or was caused by, a refusal over a resource limit of the server's node (busy, not
    broken; py-libp2p may wrap it)."""
    refusal = cause_of(e, PeerRefused, 3)
    return refusal is not None and refusal.busy


__all__ = ["MAX_EXPERTS", "MAX_REQUEST_HEADER", "MAX_ROW_VALUES", "PROTOCOL", "Expert", "ExpertCallError",
           "ExpertFailed", "Kind", "KindValue", "MoEError", "Overloaded", "Status", "StatusValue", "answer_limit",
           "check_answer", "describe", "failure", "header_bytes", "refused_busy", "split_answer", "status_error"]
