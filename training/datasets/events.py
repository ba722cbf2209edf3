"""Event records of datasets (the ``--json`` lines of ``dedloc dataset`` and their human form)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p.events import Event

from ..events import bar as _bar


def _mib(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


@dataclass
class DatasetPublished(Event):
    """A dataset created (or grown) here and stored in the DHT."""

    name: str
    dataset: str
    creator: str
    shards: int
    bytes: int
    entry: str
    event: str = field(init=False, default="dataset_published")

    def human(self) -> str:
        return (f"dataset {self.name} ({self.dataset[:12]}): {self.shards} shard{'s' if self.shards != 1 else ''}, "
                f"{_mib(self.bytes)} published (entry {self.entry[:12]})")


@dataclass
class DatasetProgress(Event):
    """A download under way: bytes held of the whole, rate, seeders."""

    name: str
    held: int
    total: int
    rate: float
    seeders: int
    shards_done: int
    shards: int
    #: seeders banned for a bad piece (with none connected, why the download waits)
    banned: int = 0
    event: str = field(init=False, default="dataset_progress")

    def human(self) -> str:
        return (f"{self.name} {_bar(self.held, self.total)} {_mib(min(self.held, self.total))}/{_mib(self.total)} "
                f"| {self.rate * 8 / 1e6:.1f} Mbit/s | {self.shards_done}/{self.shards} shards "
                f"| {self.seeders} seeder{'s' if self.seeders != 1 else ''}"
                + (f" ({self.banned} banned)" if self.banned else ""))


@dataclass
class ShardFetched(Event):
    """A shard whole, checked and at its path."""

    name: str
    path: str
    bytes: int
    event: str = field(init=False, default="dataset_shard")

    def human(self) -> str:
        return f"{self.name}: {self.path} ({_mib(self.bytes)}) checked and written"


@dataclass
class SeederBanned(Event):
    """A seeder that sent a bad piece: never asked again for this dataset."""

    name: str
    peer_id: str
    reason: str
    event: str = field(init=False, default="dataset_seeder_banned")

    def human(self) -> str:
        return f"{self.name}: seeder {self.peer_id} banned: {self.reason}"


@dataclass
class DatasetComplete(Event):
    """Every shard whole and checked."""

    name: str
    directory: str
    bytes: int
    seconds: float
    #: bytes received from each seeder (peer id -> bytes)
    sources: dict[str, int]
    discarded: int
    event: str = field(init=False, default="dataset_complete")

    def human(self) -> str:
        rate = self.bytes * 8 / 1e6 / self.seconds if self.seconds > 0 else 0.0
        return (f"{self.name}: complete in {self.directory} ({_mib(self.bytes)} in {self.seconds:.1f} s, "
                f"{rate:.1f} Mbit/s, from {len(self.sources)} seeder{'s' if len(self.sources) != 1 else ''})")


@dataclass
class Seeding(Event):
    """What this peer seeds now."""

    name: str
    dataset: str
    shards: int
    bytes: int
    served: int
    event: str = field(init=False, default="dataset_seeding")

    def human(self) -> str:
        return (f"seeding {self.name} ({self.dataset[:12]}): {self.shards} shards, {_mib(self.bytes)}; "
                f"served {_mib(self.served)}")


__all__ = ["DatasetComplete", "DatasetProgress", "DatasetPublished", "SeederBanned", "Seeding", "ShardFetched"]
