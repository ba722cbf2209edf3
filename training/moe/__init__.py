"""Decentralized mixture-of-experts (Learning@home): experts hosted by volunteers, found through the DHT.

An app on the network like training itself: it needs the composed object
(:class:`nat.Swarm`: streams and the DHT) and the tensor streams, not
averaging. :class:`ExpertServer` hosts torch modules under grid uids
(``ffn.3.5``) and declares them; :class:`RemoteMixtureOfExperts` is an
``nn.Module`` that gates, finds the best live experts by beam search and
calls them over the swarm, forward and backward::

    async with Peer.open(config) as peer, ExpertClient.open(peer) as client:
        layer = RemoteMixtureOfExperts(client, in_features=512, grid_size=(16, 16), uid_prefix="ffn")
        model = torch.nn.Sequential(torch.nn.Linear(784, 512), layer, torch.nn.Linear(512, 10))

        def step(x, y):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            ...

        await client.run(step, x, y)   # torch in a worker thread, the calls in trio
"""

from typing import TYPE_CHECKING

from p2p.lazy import exports

if TYPE_CHECKING:
    from .beam_search import BeamSearcher
    from .calls import ClientConfig
    from .client import ExpertClient, RemoteExpert
    from .protocol import Expert, ExpertCallError, MoEError
    from .layer import CallReport, MoEConfig, RemoteMixtureOfExperts
    from .server import ExpertBackend, ExpertServer, ServerConfig

__all__ = ["BeamSearcher", "CallReport", "ClientConfig", "Expert", "ExpertBackend", "ExpertCallError", "ExpertClient",
           "ExpertServer", "MoEConfig", "MoEError", "RemoteExpert", "RemoteMixtureOfExperts", "ServerConfig"]

__getattr__, __dir__ = exports(__name__, {
    "BeamSearcher": ".beam_search",
    "CallReport": ".layer", "MoEConfig": ".layer", "RemoteMixtureOfExperts": ".layer",
    "ClientConfig": ".calls", "ExpertClient": ".client", "RemoteExpert": ".client",
    "Expert": ".protocol", "ExpertCallError": ".protocol", "MoEError": ".protocol",
    "ExpertBackend": ".server", "ExpertServer": ".server", "ServerConfig": ".server",
})
