"""A peer's upload and download rates, measured from the transfers of its earlier rounds.

DeDLOC's load balancing needs each member's bandwidth; asking users for it
gives wrong figures (nobody knows their line's real upload), so each peer
measures it. Sans-I/O: a round feeds a :class:`TransferClock` per stream and
direction with every payload it writes or reads (bytes and the time);
:func:`link_rate` adds up the concurrent streams' rates, and the
:class:`BandwidthEstimator` keeps the best of the last few rounds, rounded
to a ~19% grid so that alike links declare alike figures.

What a round sees is a lower bound of the link: a peer idles while it waits
for a slower member, and on a shared link other traffic takes its share. So
a rate is bytes over the span from first to last byte of that round in that
stream after its first payload (not over the whole round, which includes
matchmaking and waits), and the estimate is the *best* of the recent rounds, not their mean: the
best round is the one where the link, not the group, was the limit. A round
that moved too little to tell (less than ``min_bytes`` or ``min_seconds``)
counts for nothing. A user's figure, where given, wins over the measure.

Lockstep hides the link. A sender sends only a few chunks ahead of the
averages it got back (``AllreduceConfig.max_chunks_ahead``), so every stream
of a round runs at the pace of the slowest sender: on 200/200/40/40 Mbit a
200 Mbit peer measured about what the 40 Mbit peers did, the load balancer
saw four alike peers and kept the equal split (1.66x the ideal round, where
declared figures gave 1.06x). So some rounds are *probes*
(:func:`is_probe`): their senders are not held in lockstep, a stream to a fast
peer finishes at the pace of the two links it crosses, and its rate is the
link's. Every member computes the same answer from the group (any member
with an unknown figure, else one round in ``probe_every`` chosen by the group
id), so all of a round's streams run free together. The estimate is the
best of the last ``window`` rounds and the last ``probe_window`` probes, so
lockstep rounds (lower bounds of the link, like every measure here) do not
wash a probe out, and a link that got slower shows within two probes.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from p2p.errors import ConfigError


@dataclass
class TransferClock:
    """One stream's payloads in one direction: the rate it kept once moving.

    The first payload's completion starts the clock and its bytes are not
    counted: before it, the stream waited (for the group, for a reducer to
    gather every sender's chunk), and that wait says nothing about the link.
    """

    bytes: int = 0
    first: float | None = None
    last: float = 0.0

    def add(self, nbytes: int, now: float) -> None:
        """``nbytes`` finished moving at ``now``."""
        if nbytes <= 0:
            return
        if self.first is None:
            self.first = self.last = now
            return
        self.bytes += nbytes
        self.last = max(self.last, now)

    def rate(self, min_seconds: float) -> float | None:
        """Bytes per second after the first payload, or None when too little moved to tell."""
        if self.first is None or self.bytes <= 0 or self.last - self.first < min_seconds:
            return None
        return self.bytes / (self.last - self.first)


def link_rate(streams: Sequence[TransferClock], min_bytes: int, min_seconds: float) -> float | None:
    """A direction's rate in one round: the streams' rates added, as they run at the same time.

    Each stream is held back by its slower end, so one stream alone, or the
    direction's bytes over the whole round, measure the group, not this
    link: a fast peer sending to slow ones would look slow, and a peer that
    reduced more would look faster than one that only sent. The sum of
    what each concurrent stream kept up is the link's share they used.
    """
    rates = [(c.bytes, c.rate(min_seconds)) for c in streams]
    counted = [(n, r) for n, r in rates if r is not None]
    if sum(n for n, _ in counted) < min_bytes:
        return None
    return sum(r for _, r in counted)


def quantize(rate: float, steps_per_doubling: int = 4) -> float:
    """Round to a grid of 2^(1/steps) (~19%), so peers on alike links declare alike figures.

    The LP gives peers with identical capacities identical shares; measured
    figures differ by noise, which would otherwise skew the split.
    """
    if rate <= 0:
        return 0.0
    return float(2.0 ** (round(math.log2(rate) * steps_per_doubling) / steps_per_doubling))


def is_probe(group_id: bytes, rates: Sequence[tuple[float, float]], probe_every: int) -> bool:
    """Whether a round probes the links (its senders run free of lockstep).

    ``rates`` are the members' declared (upload, download); a member that
    knows neither yet makes the round a probe, so a new swarm's first round
    measures. Otherwise one round in ``probe_every``, picked by the group id,
    which every member has: they agree without a word. ``probe_every`` 0: never.
    """
    if probe_every <= 0:
        return False
    if any(u <= 0 or d <= 0 for u, d in rates):
        return True
    return int.from_bytes(hashlib.sha256(b"dedloc/probe" + group_id).digest()[:4], "big") % probe_every == 0


@dataclass(frozen=True)
class BandwidthConfig:
    """How rates are measured. ``upload``/``download`` (bytes/s, 0: measure) override the measure.

    ``probe_every``: one round in this many (and any round with a member that
    has no figure yet) runs without lockstep to measure the links; 0 never
    (every measure then comes from lockstep rounds and is held to the group's pace).
    """

    upload: float = 0.0
    download: float = 0.0
    #: the best rate of this many recent rounds is the estimate
    window: int = 5
    #: ... and of this many recent probe rounds
    probe_window: int = 2
    probe_every: int = 8
    #: a round that moved less than this in a direction tells nothing about it
    min_bytes: int = 1 << 20
    min_seconds: float = 0.05

    def validate(self) -> None:
        if self.upload < 0 or self.download < 0:
            raise ConfigError("upload and download must be >= 0 (0: measure them)")
        if self.window < 1 or self.probe_window < 1 or self.min_bytes < 1 or self.min_seconds <= 0:
            raise ConfigError("window, probe_window, min_bytes and min_seconds must be positive")
        if self.probe_every < 0:
            raise ConfigError("probe_every must be >= 0 (0: never probe)")


class BandwidthEstimator:
    """The rates a peer publishes with its matchmaking record: the user's, else the best recent measure."""

    def __init__(self, config: BandwidthConfig | None = None) -> None:
        self.config = config or BandwidthConfig()
        self.config.validate()
        c = self.config
        self._uploads: deque[float] = deque(maxlen=c.window)
        self._downloads: deque[float] = deque(maxlen=c.window)
        self._probe_uploads: deque[float] = deque(maxlen=c.probe_window)
        self._probe_downloads: deque[float] = deque(maxlen=c.probe_window)

    def observe(self, uploads: Sequence[TransferClock], downloads: Sequence[TransferClock],
                probe: bool = False) -> None:
        """Take one round's streams into account, per direction (``probe``: a round without lockstep)."""
        c = self.config
        up, down = (self._probe_uploads, self._probe_downloads) if probe else (self._uploads, self._downloads)
        for streams, rates in ((uploads, up), (downloads, down)):
            rate = link_rate(streams, c.min_bytes, c.min_seconds)
            if rate is not None:
                rates.append(rate)

    @property
    def upload(self) -> float:
        """Bytes/s to declare for upload; 0 while unknown."""
        return self.config.upload or quantize(max((*self._uploads, *self._probe_uploads), default=0.0))

    @property
    def download(self) -> float:
        """Bytes/s to declare for download; 0 while unknown."""
        return self.config.download or quantize(max((*self._downloads, *self._probe_downloads), default=0.0))

    @property
    def measured(self) -> bool:
        """Whether both figures come from measure or the user (not unknown)."""
        return self.upload > 0 and self.download > 0
