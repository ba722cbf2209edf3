"""Event records of the averaging layer, alongside :mod:`p2p.events` (same base, same ``--json`` lines)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p.events import Event


@dataclass
class Averaged(Event):
    """One round of ``dedloc average`` ended: with whom, this peer's share, what moved, and the result.

    ``value`` is the mean of this peer's tensor before the round and ``mean``
    after it, so a watcher who knows every member's value can check the
    average; ``complete`` is False when some part was not averaged over every
    sender (``summary`` says which and why).
    """

    round: int
    members: list[str]
    role: str
    fraction: float
    complete: bool
    summary: str
    left_out: dict[str, str]
    elapsed: float
    bytes_sent: int
    bytes_received: int
    value: float
    mean: float
    event: str = field(init=False, default="averaged")

    def human(self) -> str:
        state = "averaged" if self.complete else "PARTIAL"
        others = len(self.members) - 1
        return (f"round {self.round}: {state} with {others} other{'s' if others != 1 else ''} as {self.role} "
                f"(share {self.fraction:.0%}) in {self.elapsed:.2f} s, {self.bytes_sent / 1e6:.1f} MB out, "
                f"{self.bytes_received / 1e6:.1f} MB in: mean {self.value:.4f} -> {self.mean:.4f}"
                + ("" if self.complete else f" ({self.summary})"))


@dataclass
class AverageFailed(Event):
    """A round that did not happen (no group in time) or could not start; the tensor is untouched."""

    round: int
    reason: str
    event: str = field(init=False, default="average_failed")

    def human(self) -> str:
        return f"round {self.round}: no average: {self.reason}"
