"""Collaborative training: a thin torch loop on top of :mod:`averaging` and :mod:`nat`.

May import :mod:`p2p`, :mod:`nat` and :mod:`averaging`. The entry point is
:class:`CollaborativeOptimizer`, which takes the composed network object
(:class:`nat.Peer`, or any :class:`nat.Swarm`), as hivemind's ``Optimizer`` takes its DHT::

    async with CollaborativeOptimizer.open(peer, torch.optim.SGD(model.parameters(), lr=0.1),
                                           TrainingConfig(run_id="my-run", target_batch_size=4096)) as opt:
        for batch in data:
            model(batch).loss.backward()
            await opt.step(len(batch))

:mod:`training.progress` keeps the swarm's progress in the DHT.
"""

from typing import TYPE_CHECKING

from p2p.lazy import exports

if TYPE_CHECKING:
    from .optimizer import CollaborativeOptimizer, StepReport, TrainingConfig
    from .progress import GlobalProgress, LocalProgress, ProgressTracker, global_progress

__all__ = [
    "CollaborativeOptimizer",
    "GlobalProgress",
    "LocalProgress",
    "ProgressTracker",
    "StepReport",
    "TrainingConfig",
    "global_progress",
]

__getattr__, __dir__ = exports(__name__, {
    "CollaborativeOptimizer": ".optimizer",
    "StepReport": ".optimizer",
    "TrainingConfig": ".optimizer",
    "GlobalProgress": ".progress",
    "LocalProgress": ".progress",
    "ProgressTracker": ".progress",
    "global_progress": ".progress",
})
