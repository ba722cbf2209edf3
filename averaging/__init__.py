"""Decentralized averaging: DHT group formation, streamed butterfly all-reduce, load balancing.

May import :mod:`p2p` and :mod:`nat`. The entry point is :class:`Averager`,
which takes the composed network object (:class:`nat.Peer`, or any :class:`nat.Swarm`)::

    async with Averager.open(peer, AveragerConfig(prefix="my-run")) as averager:
        report = await averager.step(tensors, weight=samples)

docs/ARCHITECTURE.md has the data flow of one round. Also here:
:mod:`averaging.tensor_stream` sends and receives whole torch tensors over any
byte stream with limits a peer cannot exceed.
"""

from typing import TYPE_CHECKING

from p2p.lazy import exports

if TYPE_CHECKING:
    from .allreduce import AllreduceConfig, PartOutcome, RoundReport
    from .averager import Averager, AveragerConfig
    from .compression import Compression
    from .errors import AllreduceProtocolError, AveragingError, MatchmakingError, PartialAverageError
    from .group import Group, Member, Role
    from .load_balancing import Balance, Capacity, balance
    from .matchmaking import MatchmakingConfig
    from .powersgd import PowerSGD, PowerSGDConfig, PowerSGDReport
    from .robust import CenteredClipConfig

__all__ = [
    "AllreduceConfig",
    "AllreduceProtocolError",
    "Averager",
    "AveragerConfig",
    "AveragingError",
    "Balance",
    "Capacity",
    "CenteredClipConfig",
    "Compression",
    "Group",
    "MatchmakingConfig",
    "MatchmakingError",
    "Member",
    "PartOutcome",
    "PartialAverageError",
    "PowerSGD",
    "PowerSGDConfig",
    "PowerSGDReport",
    "RoundReport",
    "Role",
    "balance",
]

__getattr__, __dir__ = exports(__name__, {
    "AllreduceConfig": ".allreduce",
    "PartOutcome": ".allreduce",
    "RoundReport": ".allreduce",
    "Averager": ".averager",
    "AveragerConfig": ".averager",
    "Compression": ".compression",
    "CenteredClipConfig": ".robust",
    "AllreduceProtocolError": ".errors",
    "AveragingError": ".errors",
    "MatchmakingError": ".errors",
    "PartialAverageError": ".errors",
    "Group": ".group",
    "Member": ".group",
    "Role": ".group",
    "Balance": ".load_balancing",
    "Capacity": ".load_balancing",
    "balance": ".load_balancing",
    "MatchmakingConfig": ".matchmaking",
    "PowerSGD": ".powersgd",
    "PowerSGDConfig": ".powersgd",
    "PowerSGDReport": ".powersgd",
})
