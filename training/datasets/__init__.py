"""Datasets carried by the swarm (DeDLOC's streamed data, Hydra's crowd-sourced datasets and trackers).

A dataset is a signed header and a grow-only set of signed entries in the
DHT (:mod:`.manifest`); its files are cut into pieces under a hash tree
(:mod:`.pieces`) that move between peers on ``/dedloc/dataset/1.0.0``, picked
rarest first from many seeders at once and checked before they are written
(:mod:`.picker`, :mod:`.fetch`); who seeds what is a tracker record per seeder
in the DHT (:mod:`.service`). An app on the network beside training's shard
reader, usable by any app on the composed peer::

    async with Peer.open(config) as peer, Datasets.open(peer) as datasets:
        await datasets.create("wiki-en", Path("shards/"))            # publish and seed
        await datasets.get("wiki-en", Path("data/wiki-en"))          # elsewhere: fetch, check, seed
"""

from typing import TYPE_CHECKING

from p2p.lazy import exports

if TYPE_CHECKING:
    from .fetch import Download, FetchConfig, FetchReport, NoSeeders
    from .manifest import DatasetError, Entry, Header, Manifest, ManifestError, Shard
    from .service import Datasets, DatasetsConfig, SeederInfo, Show
    from .store import LocalDataset

__all__ = ["DatasetError", "Datasets", "DatasetsConfig", "Download", "Entry", "FetchConfig", "FetchReport", "Header",
           "LocalDataset", "Manifest", "ManifestError", "NoSeeders", "SeederInfo", "Shard", "Show"]

__getattr__, __dir__ = exports(__name__, {
    "Download": ".fetch", "FetchConfig": ".fetch", "FetchReport": ".fetch", "NoSeeders": ".fetch",
    "DatasetError": ".manifest", "Entry": ".manifest", "Header": ".manifest", "Manifest": ".manifest",
    "ManifestError": ".manifest", "Shard": ".manifest",
    "Datasets": ".service", "DatasetsConfig": ".service", "SeederInfo": ".service", "Show": ".service",
    "LocalDataset": ".store",
})
