"""The simulated internet: where each peer sits, how long a message takes, what gets lost,
how long a peer stays, and whether it can be reached at all (calibrated in :mod:`.calibration`)."""

from __future__ import annotations

import enum
import math
import random
import statistics
from dataclasses import dataclass, field

from ..errors import ConfigError
from . import calibration as cal


@dataclass(frozen=True)
class Region:
    name: str
    lat: float
    lon: float
    share: float


#: *Assumed* shares (see :mod:`.calibration`), centroids of where peers cluster.
REGIONS = (
    Region("east-asia", 31.0, 118.0, 0.30),
    Region("north-america", 39.0, -95.0, 0.27),
    Region("europe", 50.0, 9.0, 0.28),
    Region("south-east-asia", 5.0, 105.0, 0.06),
    Region("south-america", -20.0, -50.0, 0.04),
    Region("oceania", -30.0, 145.0, 0.03),
    Region("africa", 5.0, 20.0, 0.02),
)

#: Light in fibre covers about 200 km per ms; measured paths take a multiple of that minimum
#: (arXiv 2301.07788), which :meth:`NetworkModel.calibrate` sets. Peers of one region are
#: still this far apart.
KM_PER_MS = 200.0
MIN_PATH_KM = 800.0


class Kind(enum.Enum):
    """What reaching a peer gives: an answer, nothing (behind a NAT: no dial gets in), or a
    connection and then silence."""

    PUBLIC = "public"
    UNREACHABLE = "unreachable"
    SILENT = "silent"


@dataclass
class Place:
    """One peer's spot on the network."""

    region: int
    #: Its access link's share of every round trip (one way there and back), seconds.
    access_s: float


def _great_circle_km(a: Region, b: Region) -> float:
    la1, lo1, la2, lo2 = map(math.radians, (a.lat, a.lon, b.lat, b.lon))
    h = math.sin((la2 - la1) / 2) ** 2 + math.cos(la1) * math.cos(la2) * math.sin((lo2 - lo1) / 2) ** 2
    return 2 * 6371.0 * math.asin(math.sqrt(h))


@dataclass
class NetworkModel:
    """Round trips between places, message loss, session lengths and peer kinds."""

    median_rtt_s: float = cal.MEDIAN_RTT_S
    #: Spread of the access delay (lognormal sigma): the long tail of home links.
    access_sigma: float = 0.9
    #: A message is lost with this probability; TCP sends it again after its retransmission timeout.
    loss: float = 0.01
    unreachable_share: float = cal.UNREACHABLE_SHARE
    silent_share: float = cal.SILENT_SHARE
    sessions: cal.SessionModel = field(default_factory=cal.SessionModel.fitted)
    regions: tuple[Region, ...] = REGIONS
    #: Median of one access link's share of a round trip (home links: a few ms to hundreds).
    access_median_s: float = 0.008
    #: Measured path over the fibre minimum, set by :meth:`calibrate` so that the median round trip is ``median_rtt_s``.
    path_inflation: float = 1.0
    #: *Assumed*, 0 by default (no measurement here): the share of peers whose address falls in
    #: one of ``shared_groups`` IP groups, as many peer IDs behind one cloud IP, one provider's
    #: /16 or one IPv6 ASN do. A routing table's diversity filter counts such peers together
    #: (go-libp2p-kad-dht's WAN table: at most 3 per group); every other peer is alone in its group.
    shared_group_share: float = 0.0
    #: at most 65,536: a shared group is one /24 of 12.0.0.0/8 in the simulated addresses
    shared_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("unreachable_share", "silent_share", "shared_group_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"network model: {name} is a share, from 0 to 1; got {getattr(self, name)}")
        if not 0.0 <= self.loss < 1.0:  # a message lost every time would be sent again for ever
            raise ConfigError(f"network model: loss is a probability, from 0 to below 1; got {self.loss}")
        if self.unreachable_share + self.silent_share > 1.0:
            raise ConfigError("network model: unreachable_share and silent_share add up to more than 1")
        if not 1 <= self.shared_groups <= 65_536:
            raise ConfigError(f"network model: shared_groups is from 1 to 65,536; got {self.shared_groups}")
        self._fibre = [[2 * max(MIN_PATH_KM, _great_circle_km(a, b)) / KM_PER_MS / 1000 for b in self.regions]
                       for a in self.regions]
        self._weights = [r.share for r in self.regions]

    def calibrate(self, seed: int = 0, samples: int = 20_000) -> NetworkModel:
        """Choose the path inflation so that random pairs' median round trip is ``median_rtt_s``."""
        rng = random.Random(seed)
        pairs = [(self.place(rng), self.place(rng)) for _ in range(samples)]
        lo, hi = 0.0, 10.0
        for _ in range(50):
            self.path_inflation = (lo + hi) / 2
            if statistics.median(self.rtt(a, b) for a, b in pairs) > self.median_rtt_s:
                hi = self.path_inflation
            else:
                lo = self.path_inflation
        return self

    def place(self, rng: random.Random) -> Place:
        region = rng.choices(range(len(self.regions)), self._weights)[0]
        return Place(region, self.access_median_s * math.exp(rng.gauss(0.0, self.access_sigma)))

    def kind(self, rng: random.Random) -> Kind:
        x = rng.random()
        if x < self.unreachable_share:
            return Kind.UNREACHABLE
        if x < self.unreachable_share + self.silent_share:
            return Kind.SILENT
        return Kind.PUBLIC

    def shared_group(self, rng: random.Random) -> int | None:
        """The shared IP group a new peer's address falls in (see ``shared_group_share``), or None."""
        if rng.random() >= self.shared_group_share:
            return None
        return rng.randrange(self.shared_groups)

    def session_s(self, rng: random.Random) -> float:
        """How long a newly joined peer stays (Weibull through the measured churn points)."""
        return self.sessions.scale_h * 3600 * rng.weibullvariate(1.0, self.sessions.shape)

    def residual_session_s(self, rng: random.Random) -> float:
        """How much longer a peer found online in a network at steady state stays: a session drawn
        by its length (long ones are likelier to be under way; for a Weibull the length-biased
        length is ``scale * Gamma(1 + 1/shape) ** (1/shape)``), then a uniform point in it."""
        shape = self.sessions.shape
        length = self.sessions.scale_h * 3600 * rng.gammavariate(1 + 1 / shape, 1.0) ** (1 / shape)
        return float(rng.random() * length)

    def rtt(self, a: Place, b: Place) -> float:
        return self.path_inflation * self._fibre[a.region][b.region] + a.access_s + b.access_s

    def one_way(self, a: Place, b: Place, rng: random.Random) -> float:
        """One message from ``a`` to ``b``: half the round trip, and a retransmission timeout when lost."""
        rtt = self.rtt(a, b)
        delay = rtt / 2
        while rng.random() < self.loss:
            delay += max(0.2, 2 * rtt)  # TCP's RTO floor (Linux 200 ms) or twice the RTT
        return delay
