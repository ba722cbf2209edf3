"""The published measurements the simulated network is calibrated to and judged against.

Every figure carries its source; ``docs/SCALE.md`` lists them with what the simulation
measures beside each. Figures marked *assumed* have no measurement behind them here and
say how they were chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: RFM2, "Uptime and Churn" (Protocol Labs network measurements, D. Trautwein, 2022-05;
#: github.com/probe-lab/network-measurements results/rfm2-uptime-and-churn.md): of the DHT
#: servers that join, 50% stay online ~2 h or less, 80% 8 h or less.
SESSION_HALF_GONE_H = 2.0
SESSION_80_GONE_H = 8.0

#: RFM19, "DHT Routing Table Health" (G. Michel, 2022-07; results/rfm19-dht-routing-table-health.md),
#: 28 Nebula crawls, 2022-04-19..26: 20,811 peers found per crawl, 15,371 reachable (26.1% not).
UNREACHABLE_SHARE = 1 - 15_371 / 20_811
#: RFM19: unreachable entries in bucket 0 (common prefix length 0): 3.78% on average.
UNREACHABLE_IN_BUCKET_0 = 0.0378
#: RFM19: unreachable entries in the non-full buckets (CPL 9 to 21): about 15%.
UNREACHABLE_IN_NON_FULL = 0.15
#: RFM19: 61.09% of peers hold all of their 20 closest peers in their routing table.
KNOW_ALL_20_CLOSEST = 0.6109
#: RFM19: 4.79% of peers know fewer than 18 of their 20 closest.
KNOW_UNDER_18_CLOSEST = 0.0479

#: RFM17, "Provider Record Liveness" (M. Cortes-Goicoechea, L. Bautista-Gomez, 2022-08;
#: results/rfm17-provider-record-liveness.md), 10,000 CIDs published with k = 20: PR holders
#: that took the record at publication, 5th / 50th / 90th percentile 14 / 18 / 20.
STORE_HOLDERS_P5_P50_P90 = (14, 18, 20)
#: The issue's anchors for the same operations on the public network (IPFS): a lookup's mean,
#: 0.62 s; holders reached by a store, 17.4 of 20 on average.
IPFS_LOOKUP_MEAN_S = 0.62
IPFS_STORE_HOLDERS_MEAN = 17.4

#: Round trips: the issue's median of 100 ms between peers spread over the world, with a long
#: tail. The shape follows "Round Trip Time (RTT) Delay in the Internet: Analysis and Trends"
#: (Martinez, Hernandez, Reviriego, Reinheimer, arXiv 2301.07788, WonderProxy data): RTT grows
#: with great-circle distance at about twice the fibre minimum, plus access delay. *Assumed*:
#: region shares (rounded from the Nebula crawls' country ranking: China, the US, Germany
#: first) and the tail's spread.
MEDIAN_RTT_S = 0.100
#: A silent peer accepts connections and never answers (the issue's 10%).
SILENT_SHARE = 0.10


@dataclass(frozen=True)
class SessionModel:
    """Session lengths as a Weibull distribution through the two RFM2 points."""

    shape: float
    scale_h: float

    @classmethod
    def fitted(cls, half_h: float = SESSION_HALF_GONE_H, eighty_h: float = SESSION_80_GONE_H) -> SessionModel:
        # F(t) = 1 - exp(-(t/scale)^shape): F(half) = 0.5, F(eighty) = 0.8.
        shape = math.log(math.log(5) / math.log(2)) / math.log(eighty_h / half_h)
        scale = half_h / math.log(2) ** (1 / shape)
        return cls(shape, scale)

    def cdf(self, hours: float) -> float:
        return 1 - math.exp(-((hours / self.scale_h) ** self.shape))
