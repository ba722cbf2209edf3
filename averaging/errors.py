"""What averaging raises. Peer faults are also :class:`p2p.errors.RemoteProtocolError`."""

from __future__ import annotations

from p2p.errors import DedlocError, RemoteProtocolError


class AveragingError(DedlocError):
    """An averaging round could not be done as asked."""


class MatchmakingError(AveragingError, TimeoutError):
    """No group formed before the matchmaking deadline; the caller's tensors are untouched."""


class AllreduceProtocolError(AveragingError, RemoteProtocolError):
    """A group member broke the all-reduce protocol (wrong sizes, chunks out of order, not a member)."""


class PartialAverageError(AveragingError):
    """A round averaged only some of what it should; ``report`` says what and why."""

    def __init__(self, message: str, report: object) -> None:
        super().__init__(message)
        self.report = report
