"""training/datasets/service.py, the datasets service of one peer, on the in-memory swarm.

Real :class:`Datasets` services run on signed in-memory peers (tests/fake_swarm.py) under trio's autojump
clock, with real files in a temporary directory; the DHT is the fake one every peer shares, behind a
spy that records each read and store (and fails those a test says). Worker threads run inline and the
wall clock is trio's plus :data:`WALL`, so every expiration and creation time is exact. The test plays
the downloaders byte for byte on the piece protocol (:class:`Client`). What is checked: what goes into
the DHT under which key, subkey, expiration and timeout; what each request is answered, when a stream
is closed or reset, who is served first and when; the tracker record's life; the errors' words. The
same service between real peers is tests/test_datasets_swarm.py's; a download's own side, test_fetch's.
"""

from __future__ import annotations

import logging
import random
from functools import partial
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID
from multiaddr import Multiaddr
from nacl.signing import SigningKey

from averaging.wire import FrameReader, frame
from p2p.dht.records import KeyLike, ValueWithExpiration, content_subkey, owned
from p2p.errors import ConfigError, DedlocError
from training.datasets import events as ev
from training.datasets import service
from training.datasets.fetch import FetchConfig, NoSeeders
from training.datasets.manifest import DatasetError, Header, ManifestError, Shard, object_id
from training.datasets.service import (
    ANNOUNCE_GAP,
    INDEX_KEY,
    MAX_SEEDER_ADDRS,
    MAX_SEEDERS,
    PROTOCOL,
    Datasets,
    DatasetsConfig,
    SeederInfo,
    dataset_key,
    parse_seeders,
    seeders_key,
)
from training.datasets.store import LocalDataset
from training.proto import datasets_pb2 as pb

from .fake_swarm import FakeSwarm, fake_swarms
from .kit import log_lines, numbered_peer_id
from .test_datasets import PIECE, shard, write_files

LOG = "training.datasets.service"
#: the wall clock the service reads: trio's clock plus this
WALL = 1_900_000_000.0
#: the trio time every lab starts at (a sum where a difference belongs shows)
START = 5.0
RNG = random.Random(3)
#: a.txt of four pieces (the last short), b.txt of two
FILES = {"a.txt": RNG.randbytes(3 * PIECE + 100), "b.txt": RNG.randbytes(PIECE + 7)}


@pytest.fixture(autouse=True)
def inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker threads run inline (under the autojump clock a thread's real time would let trio's clock
    jump past every timer), and the service's wall clock is trio's plus WALL."""

    async def run_sync(fn: Callable[..., Any], *args: Any, **_: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
    monkeypatch.setattr(service, "time", SimpleNamespace(time=lambda: WALL + trio.current_time()))


def corpus(directory: Path, files: dict[str, bytes] = FILES) -> Path:
    directory.mkdir(parents=True, exist_ok=True)  # made even with no files
    return write_files(directory, files)


# ---------------------------------------------------------------------------- the DHT spy and the lab


@dataclass
class Stored:
    key: KeyLike
    subkey: KeyLike | None
    value: bytes
    expiration: float
    timeout: float | None
    at: float


@dataclass
class Spy:
    """The shared fake DHT as one peer sees it, every call recorded; ``refuse(key, subkey)`` true: that
    store fails; ``took`` false: stores are taken by nobody."""

    records: Any
    stores: list[Stored] = field(default_factory=list)
    gets: list[tuple[KeyLike, bool, float | None]] = field(default_factory=list)
    refuse: Callable[[KeyLike, KeyLike | None], bool] = lambda key, subkey: False
    took: bool = True

    async def get(self, key: KeyLike, latest: bool = False, *,
                  timeout: float | None = None) -> ValueWithExpiration | None:
        self.gets.append((key, latest, timeout))
        found: ValueWithExpiration | None = await self.records.get(key, latest, timeout=timeout)
        return found

    async def store(self, key: KeyLike, value: bytes, expiration: float, subkey: KeyLike | None = None,
                    *, timeout: float | None = None) -> bool:
        self.stores.append(Stored(key, subkey, value, expiration, timeout, trio.current_time()))
        if self.refuse(key, subkey):
            await trio.lowlevel.checkpoint()
            raise DedlocError("no peer took " + str(key))
        took: bool = await self.records.store(key, value, expiration, subkey, timeout=timeout)
        return took and self.took

    def of(self, key: KeyLike) -> list[Stored]:
        return [s for s in self.stores if s.key == key]


def spy(d: Datasets) -> Spy:
    return cast(Spy, d.peer.dht)


def swarm_of(d: Datasets) -> FakeSwarm:
    return cast(FakeSwarm, d.peer)


@asynccontextmanager
async def lab(n: int = 1, **config: Any) -> AsyncIterator[list[Datasets]]:
    """``n`` signed peers, each with its datasets service (``config``'s settings, pieces of 16 KiB)."""
    config.setdefault("piece_size", PIECE)
    async with fake_swarms(n, signed=True) as peers:
        await trio.sleep(START)
        for p in peers:
            p.dht = cast(Any, Spy(p.network.records))
        async with AsyncExitStack() as stack:
            yield [await stack.enter_async_context(Datasets.open(cast(Any, p), DatasetsConfig(**config)))
                   for p in peers]


def record(d: Datasets, key: str, subkey: KeyLike | None) -> tuple[bytes, float]:
    """What the shared DHT holds under ``key``/``subkey`` (value, expiration)."""
    held: tuple[bytes, float] = spy(d).records._data[key][subkey]
    return held


def seeding(d: Datasets, dataset: bytes) -> pb.Seeding:
    """``d``'s tracker record of ``dataset``."""
    value, _ = record(d, seeders_key(dataset), owned("s", d.peer.peer_id))
    return pb.Seeding.FromString(value)


class Client:
    """One stream to a seeder, spoken as a downloader speaks it."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.reader = FrameReader(stream)

    @classmethod
    async def to(cls, me: Datasets, seeder: Datasets) -> Client:
        return cls(await swarm_of(me).new_stream(seeder.peer.peer_id, PROTOCOL))

    async def send(self, kind: pb.Request.Kind.ValueType, dataset: bytes = b"", shard: bytes = b"", index: int = 0, held: int = 0) -> None:
        await self.stream.write(frame(pb.Request(kind=kind, dataset=dataset, shard=shard, index=index,
                                                 held_permille=held)))

    async def answer(self) -> tuple[pb.Answer, bytes]:
        head = await self.reader.message(pb.Answer, "answer", max_size=1 << 20)
        return head, (await self.reader.exactly(head.size) if head.size else b"")

    async def ask(self, kind: pb.Request.Kind.ValueType, dataset: bytes = b"", shard: bytes = b"", index: int = 0,
                  held: int = 0) -> tuple[pb.Answer, bytes]:
        await self.send(kind, dataset, shard, index, held)
        return await self.answer()

    async def end(self) -> str:
        """How the seeder ended the stream: ``closed`` (its end of writing) or ``reset``."""
        try:
            extra = await self.stream.read(1)
        except StreamEOF:
            return "closed"
        except StreamReset:
            return "reset"
        raise AssertionError(f"more bytes where the stream should end: {extra!r}")


HAVE, LEAVES, PIECE_ = pb.Request.HAVE, pb.Request.LEAVES, pb.Request.PIECE
OK, NOT_FOUND, BUSY = pb.Answer.OK, pb.Answer.NOT_FOUND, pb.Answer.BUSY


def events(d: Datasets, kind: type) -> list[dict[str, Any]]:
    """The events of ``kind`` that ``d``'s peer emitted, each as its fields but the time stamp."""
    return [{k: v for k, v in vars(e).items() if k != "ts"} for e in swarm_of(d).events if isinstance(e, kind)]


def event(kind: type, **fields: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(kind(**fields)).items() if k != "ts"}


# ---------------------------------------------------------------------------- settings and keys


PIECES = "piece size must be a power of two from 16 KiB to 16 MiB"
TTLS = "announce_ttl must be positive and manifest_ttl within 24 h"
SLOTS = "upload and sending slots must be at least 1"
RATE = "the upload rate must be a positive number of bytes per second (or None: no cap)"


@pytest.mark.parametrize("change, message", [
    ({"piece_size": 3 * 16384}, PIECES), ({"piece_size": 8 * 1024}, PIECES), ({"piece_size": 32 << 20}, PIECES),
    ({"upload_rate": 0.0}, RATE), ({"upload_rate": -1.0}, RATE), ({"upload_rate": float("inf")}, RATE),
    ({"upload_rate": float("nan")}, RATE),
    ({"upload_slots": 0}, SLOTS), ({"sending_slots": 0}, SLOTS),
    ({"announce_ttl": 0.0}, TTLS), ({"manifest_ttl": 0.0}, TTLS), ({"manifest_ttl": 24 * 3600.0 + 1}, TTLS),
])
def test_a_setting_out_of_range_is_refused_with_its_reason(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        DatasetsConfig(**change).validate()
    assert str(e.value) == message


@pytest.mark.parametrize("change", [{"piece_size": 16 * 1024}, {"piece_size": 16 << 20}, {"upload_rate": 1.0},
                                    {"upload_slots": 1, "sending_slots": 1}, {"manifest_ttl": 24 * 3600.0},
                                    {"announce_ttl": 0.5, "manifest_ttl": 0.5}])
def test_settings_at_their_bounds_are_taken(change: dict[str, Any]) -> None:
    DatasetsConfig(**change).validate()


def test_the_defaults_are_the_documented_ones() -> None:
    c = DatasetsConfig()
    assert (c.piece_size, c.upload_rate, c.upload_slots, c.sending_slots) == (1 << 20, None, 32, 8)
    assert (c.announce_ttl, c.announce_served, c.manifest_ttl) == (600.0, 16 << 20, 12 * 3600.0)
    assert (c.idle_timeout, c.dht_timeout) == (60.0, 15.0)
    c.validate()


async def test_a_service_opened_with_a_bad_setting_is_refused_before_it_mounts_anything() -> None:
    async with fake_swarms(1, signed=True) as (peer,):
        with pytest.raises(ConfigError, match="slots"):
            async with Datasets.open(cast(Any, peer), DatasetsConfig(upload_slots=0)):
                pass  # pragma: no cover
        assert PROTOCOL not in peer.handlers


async def test_the_service_mounts_the_piece_protocol_while_open_and_only_then(autojump_clock: trio.abc.Clock) -> None:
    async with fake_swarms(1, signed=True) as (peer,):
        async with Datasets.open(cast(Any, peer)) as d:
            assert peer.handlers[PROTOCOL] == d._on_stream
            assert d.config == DatasetsConfig()
        assert PROTOCOL not in peer.handlers


def test_keys_name_the_dataset_and_refuse_a_bad_name() -> None:
    assert dataset_key("wiki-en.v2") == "dedloc.dataset.wiki-en.v2"
    assert seeders_key(bytes([1, 2, 255])) == "dedloc.seeders.0102ff"
    assert INDEX_KEY == "dedloc.datasets"
    with pytest.raises(DatasetError):
        dataset_key("../etc")


# ---------------------------------------------------------------------------- create


async def test_create_signs_publishes_and_seeds_the_directory(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with lab() as (d,):
        local = await d.create("wiki", corpus(tmp_path / "src"), text_field="body")
        header = local.manifest.header
        assert (header.name, header.schema, header.piece_size, header.creator, header.text_field) == (
            "wiki", "text", PIECE, d.peer.peer_id, "body")
        assert header.created == WALL + START
        shards = local.manifest.shards()
        assert shards == [shard(p, b) for p, b in sorted(FILES.items())]
        assert local.whole == {s.root for s in shards} and local.directory == tmp_path / "src"
        (entry,) = local.manifest.entries.values()
        assert entry.created == WALL + START and entry.author == d.peer.peer_id
        # the header under the dataset's key and in the index, the entry under the dataset's key
        expected = {(dataset_key("wiki"), content_subkey(header.signed, "h"), header.signed),
                    (INDEX_KEY, content_subkey(header.signed, "h"), header.signed),
                    (dataset_key("wiki"), content_subkey(entry.signed, "e"), entry.signed)}
        published = [s for s in spy(d).stores if s.key != seeders_key(header.id)]
        assert {(s.key, s.subkey, s.value) for s in published} == expected and len(published) == 3
        assert {(s.expiration, s.timeout) for s in published} == {(WALL + START + 12 * 3600.0, 15.0)}
        assert events(d, ev.DatasetPublished) == [event(ev.DatasetPublished, 
            name="wiki", dataset=header.id.hex(), creator=str(d.peer.peer_id), shards=2,
            bytes=sum(len(b) for b in FILES.values()), entry=entry.id.hex())]
        assert d.held[header.id].local is local
        await trio.sleep(1)
        assert set(seeding(d, header.id).shards) == {s.root for s in shards}


async def test_create_reads_the_shard_files_under_the_directory_and_only_those(autojump_clock: trio.abc.Clock,
                                                                              tmp_path: Path) -> None:
    src = corpus(tmp_path / "src", {"a.txt": b"1", "sub/b.TXT": b"two\n" * 10, "empty.txt": b"",
                                     ".dedloc/old.txt": b"meta\n", "notes.md": b"# not a shard\n"})
    async with lab() as (d,):
        local = await d.create("wiki", src, seed=False)
        assert [s.path for s in local.manifest.shards()] == ["a.txt", "sub/b.TXT"]
        assert local.manifest.header.schema == "text" and local.manifest.header.text_field == "text"


async def test_create_takes_the_schema_it_is_given(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with lab() as (d,):
        local = await d.create("wiki", corpus(tmp_path / "src"), schema="jsonl", seed=False)
        assert local.manifest.header.schema == "jsonl"


@pytest.mark.parametrize("files, message", [
    (None, "no such directory"),
    ({"notes.md": b"x"}, "no shard files in it (wanted .json, .jsonl, .parquet, .text, .txt)"),
    ({"empty.txt": b""}, "no shard files in it"),
    ({".dedloc/a.txt": b"x"}, "no shard files in it"),
])
async def test_create_says_what_is_wrong_with_the_directory(autojump_clock: trio.abc.Clock, tmp_path: Path,
                                                            files: dict[str, bytes] | None, message: str) -> None:
    src = tmp_path / "src" if files is None else corpus(tmp_path / "src", files)
    async with lab() as (d,):
        with pytest.raises(DatasetError) as e:
            await d.create("wiki", src)
        assert str(e.value) == f"{src}: {message}" or message in str(e.value)
        assert str(e.value).startswith(f"{src}: ")
        assert not spy(d).stores


async def test_a_directory_one_service_writes_is_refused_to_another_until_the_first_closes(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    """Two `dataset get` into one directory at once: the second hung at 2 of 3 shards for good."""
    async with lab(2) as (a, b):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        a.seed(local)  # a directory it holds already: not locked twice
        started: list[LocalDataset] = []
        with pytest.raises(DatasetError, match=r"src is in use by another dedloc process \(pid \d+\)"):
            await b.get("wiki", tmp_path / "src", on_start=started.append)
        assert started == []  # refused before it read or wrote a byte there
        with pytest.raises(DatasetError, match=r"in use by another dedloc process"):
            b.seed(local)
        corpus(tmp_path / "more", {"c.txt": b"x" * 100})
        with pytest.raises(DatasetError, match=r"in use by another dedloc process"):
            await b.add("wiki", [tmp_path / "more" / "c.txt"], tmp_path / "src")
        with pytest.raises(DatasetError, match=r"in use by another dedloc process"):
            await b.create("wiki2", tmp_path / "src")
        await b.get("wiki", tmp_path / "got", seed=False)  # another directory: fine
    async with lab() as (c,):  # the first service closed: its directory is free
        c.seed(local)


async def test_create_refuses_a_second_dataset_of_ours_by_the_same_name_but_not_anothers(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with lab(2) as (a, b):
        first = await a.create("wiki", corpus(tmp_path / "one"), seed=False)
        with pytest.raises(DatasetError) as e:
            await a.create("wiki", corpus(tmp_path / "two"))
        assert str(e.value) == (f"you already created a dataset wiki ({first.manifest.header.id.hex()[:16]}): grow it "
                                "with `dedloc dataset add`, or name another")
        other = await b.create("wiki", corpus(tmp_path / "three"), seed=False)
        assert other.manifest.header.creator == b.peer.peer_id
        assert (dataset_key("wiki"), True, 15.0) in spy(a).gets
        with pytest.raises(DatasetError):
            await a.create("../x", tmp_path / "one")


# ---------------------------------------------------------------------------- add and retract


async def test_add_copies_the_files_into_our_copy_and_publishes_an_entry_of_ours(autojump_clock: trio.abc.Clock,
                                                                                tmp_path: Path) -> None:
    extra = corpus(tmp_path / "extra", {"c.txt": b"three\n" * 100, "d.txt": b"four\n" * 5000})
    async with lab(2) as (a, b):
        created = await a.create("wiki", corpus(tmp_path / "src"))
        mine = tmp_path / "mine" / "deep"
        entry = await b.add("wiki", [extra / "c.txt", extra / "d.txt"], mine)
        assert (mine / "c.txt").read_bytes() == b"three\n" * 100
        assert (mine / "c.txt").stat().st_ino == (extra / "c.txt").stat().st_ino  # a hard link, not a copy
        assert entry.author == b.peer.peer_id and entry.created == WALL + START
        assert list(entry.shards) == [shard("c.txt", b"three\n" * 100), shard("d.txt", b"four\n" * 5000)]
        stored = [s for s in spy(b).of(dataset_key("wiki")) if s.value == entry.signed]
        assert [(s.subkey, s.expiration, s.timeout) for s in stored] == [
            (content_subkey(entry.signed, "e"), WALL + START + 12 * 3600.0, 15.0)]
        header = created.manifest.header
        assert events(b, ev.DatasetPublished) == [event(ev.DatasetPublished, 
            name="wiki", dataset=header.id.hex(), creator=str(a.peer.peer_id), shards=2, bytes=25600,
            entry=entry.id.hex())]
        held = b.held[header.id].local
        assert held.directory == mine and held.whole == {s.root for s in entry.shards}
        found = await a.find("wiki")
        assert [s.path for s in found.shards()] == ["a.txt", "b.txt", "c.txt", "d.txt"]


async def test_add_without_seeding_publishes_only(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    extra = corpus(tmp_path / "extra", {"c.txt": b"three\n"})
    async with lab(2) as (a, b):
        await a.create("wiki", corpus(tmp_path / "src"))
        await b.add("wiki", [extra / "c.txt"], extra, seed=False)  # already in the directory: not copied
        assert not b.held and (extra / "c.txt").read_bytes() == b"three\n"
        assert [s.path for s in (await a.find("wiki")).shards()] == ["a.txt", "b.txt", "c.txt"]


async def test_add_copies_when_a_hard_link_cannot_be_made(autojump_clock: trio.abc.Clock, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    extra = corpus(tmp_path / "extra", {"c.txt": b"three\n"})

    def no_links(self: Path, target: Path) -> None:
        raise OSError("another file system")

    monkeypatch.setattr(Path, "hardlink_to", no_links)
    async with lab() as (a,):
        await a.create("wiki", corpus(tmp_path / "src"))
        await a.add("wiki", [extra / "c.txt"], tmp_path / "mine")
        copy = tmp_path / "mine" / "c.txt"
        assert copy.read_bytes() == b"three\n" and copy.stat().st_ino != (extra / "c.txt").stat().st_ino


async def test_add_skips_an_empty_file(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    extra = corpus(tmp_path / "extra", {"c.txt": b"three\n", "e.txt": b""})
    async with lab() as (a,):
        await a.create("wiki", corpus(tmp_path / "src"))
        entry = await a.add("wiki", [extra / "e.txt", extra / "c.txt"], extra)
        assert [s.path for s in entry.shards] == ["c.txt"]


@pytest.mark.parametrize("name, message", [
    ("c.jsonl", "wiki holds text shards; these files are not"),
    ("missing.txt", "{path}: no such file"),
    ("a.txt", "wiki already has a shard a.txt; rename the file"),
])
async def test_add_refuses_files_that_do_not_fit_and_publishes_nothing(autojump_clock: trio.abc.Clock, tmp_path: Path,
                                                                      name: str, message: str) -> None:
    extra = corpus(tmp_path / "extra", {"c.jsonl": b"{}\n", "a.txt": b"another a\n"})
    async with lab() as (a,):
        await a.create("wiki", corpus(tmp_path / "src"), seed=False)
        before = len(spy(a).stores)
        with pytest.raises(DatasetError) as e:
            await a.add("wiki", [extra / name], tmp_path / "mine")
        assert str(e.value) == message.format(path=extra / name)
        assert len(spy(a).stores) == before and not events(a, ev.DatasetPublished)[1:]


async def test_the_creator_retracts_an_entry_and_the_shards_leave_the_dataset(autojump_clock: trio.abc.Clock,
                                                                             tmp_path: Path) -> None:
    extra = corpus(tmp_path / "extra", {"c.txt": b"three\n"})
    async with lab(2) as (a, b):
        await a.create("wiki", corpus(tmp_path / "src"))
        entry = await b.add("wiki", [extra / "c.txt"], extra)
        with pytest.raises(DatasetError) as e:
            await b.retract("wiki", [entry.id])
        assert str(e.value) == (f"only wiki's creator ({a.peer.peer_id}) or, in a closed swarm, its authority can "
                                "retract its entries")
        rid = await a.retract("wiki", [entry.id])
        (retraction,) = [s for s in spy(a).stores if s.value and object_id(s.value) == rid]
        assert (retraction.key, retraction.subkey, retraction.expiration) == (
            dataset_key("wiki"), content_subkey(retraction.value, "e"), WALL + START + 12 * 3600.0)
        found = await b.find("wiki")
        assert rid in found.entries and found.entries[rid].retract == (entry.id,)
        assert found.entries[rid].created == WALL + START and found.entries[rid].author == a.peer.peer_id
        assert [s.path for s in found.shards()] == ["a.txt", "b.txt"]


async def test_a_closed_swarms_authority_retracts_any_entry_with_its_key_and_only_with_it(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    key = SigningKey.generate()
    extra = corpus(tmp_path / "extra", {"c.txt": b"three\n"})
    async with lab(2) as (a, b):
        assert a.authority is None
        with pytest.raises(DatasetError) as e:
            await a.retract("wiki-none", [], authority_key=key)
        for d in (a, b):
            swarm_of(d).authenticator = SimpleNamespace(config=SimpleNamespace(authority=key.verify_key))  # type: ignore[attr-defined]
        assert a.authority == bytes(key.verify_key)
        await a.create("wiki", corpus(tmp_path / "src"))
        entry = await b.add("wiki", [extra / "c.txt"], extra)
        with pytest.raises(DatasetError) as e:
            await b.retract("wiki", [entry.id], authority_key=SigningKey.generate())
        assert str(e.value) == "that authority key is not this swarm's authority (is the peer in its closed swarm?)"
        rid = await b.retract("wiki", [entry.id], authority_key=key)  # b is not the creator: the key is enough
        found = await a.find("wiki")
        signed = pb.Signed.FromString(found.by_authority[rid][0])
        assert pb.Entry.FromString(signed.body).created == WALL + START
        assert rid in found.by_authority and [s.path for s in found.shards()] == ["a.txt", "b.txt"]


async def test_an_authority_key_in_an_open_swarm_is_refused(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with lab() as (a,):
        await a.create("wiki", corpus(tmp_path / "src"), seed=False)
        with pytest.raises(DatasetError, match="not this swarm's authority"):
            await a.retract("wiki", [], authority_key=SigningKey.generate())


# ---------------------------------------------------------------------------- publish


async def test_publish_counts_the_records_taken_and_logs_each_failure(autojump_clock: trio.abc.Clock, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    async with lab() as (a,):
        local = await a.create("wiki", corpus(tmp_path / "src"), seed=False)
        await trio.sleep(10)
        caplog.set_level(logging.WARNING, LOG)
        spy(a).refuse = lambda key, subkey: key == INDEX_KEY
        assert await a.publish(local.manifest) == 2  # newer expirations: the header and the entry taken again
        assert log_lines(caplog, LOG, "datasets: ") == [f"datasets: storing {INDEX_KEY} failed: no peer took {INDEX_KEY}"]
        assert {s.expiration for s in spy(a).stores[-3:]} == {WALL + START + 10 + 12 * 3600.0}
        spy(a).took = False
        spy(a).refuse = lambda key, subkey: False
        with pytest.raises(DatasetError) as e:
            await a.publish(local.manifest)
        assert str(e.value) == "no DHT peer took wiki's manifest; is the peer connected?"


# ---------------------------------------------------------------------------- finding


def refusal(raw: bytes) -> str:
    """Why :class:`Header` refuses ``raw``."""
    with pytest.raises(ManifestError) as e:
        Header.parse(raw)
    return str(e.value)


def put(d: Datasets, key: str, subkey: KeyLike | None, value: Any, expiration: float = WALL + 1e6) -> None:
    spy(d).records._data.setdefault(key, {})[subkey] = (value, expiration)


async def test_headers_lists_the_index_or_one_names_and_skips_what_is_not_a_header(
        autojump_clock: trio.abc.Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOG)
    async with lab(2) as (a, b):
        wiki = (await a.create("wiki", corpus(tmp_path / "one"), seed=False)).manifest.header
        books = (await b.create("books", corpus(tmp_path / "two"), seed=False)).manifest.header
        assert await a.headers() != [] and {h.id for h in await a.headers()} == {wiki.id, books.id}
        assert [h.id for h in await a.headers("books")] == [books.id]
        assert spy(a).gets[-2:] == [(INDEX_KEY, True, 15.0), (dataset_key("books"), True, 15.0)]
        put(a, INDEX_KEY, "h[sha256:00]", b"not a header")
        put(a, INDEX_KEY, "x[sha256:01]", wiki.signed)  # not a header's subkey
        put(a, INDEX_KEY, "h[sha256:02]", 7)  # not bytes
        assert {h.id for h in await a.headers()} == {wiki.id, books.id}
        assert log_lines(caplog, LOG, "datasets: ") == [f"datasets: refused a header under 'h[sha256:00]': "
                                                        f"{refusal(b'not a header')}"]
        assert await a.headers("nothing") == []


async def test_find_resolves_a_reference_and_checks_every_entry(autojump_clock: trio.abc.Clock, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOG)
    async with lab(2) as (a, b):
        ours = (await a.create("wiki", corpus(tmp_path / "one"), seed=False)).manifest
        theirs = (await b.create("wiki", corpus(tmp_path / "two", {"z.txt": b"zz\n"}), seed=False)).manifest
        with pytest.raises(DatasetError, match="2 datasets are named 'wiki'"):
            await a.find("wiki")
        found = await a.find(f"wiki@{b.peer.peer_id}")
        assert found.header.id == theirs.header.id and [s.path for s in found.shards()] == ["z.txt"]
        assert found.authority is None and found.entries.keys() == theirs.entries.keys()
        put(a, dataset_key("wiki"), "h[sha256:00]", b"garbage")
        put(a, dataset_key("wiki"), "e[sha256:00]", b"garbage")
        assert (await a.find(f"wiki@{a.peer.peer_id}")).shards() == ours.shards()
        assert log_lines(caplog, LOG, "datasets: ") == [f"datasets: refused a header of wiki: {refusal(b'garbage')}"]
        assert spy(a).gets[-1] == (dataset_key("wiki"), True, 15.0)
        with pytest.raises(DatasetError):
            await a.find("../x@y")


async def test_find_counts_the_datasets_and_entries_we_hold_that_the_dht_lost(autojump_clock: trio.abc.Clock,
                                                                             tmp_path: Path) -> None:
    extra = corpus(tmp_path / "extra", {"c.txt": b"three\n"})
    async with lab() as (a,):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        await a.add("wiki", [extra / "c.txt"], tmp_path / "src")
        spy(a).records._data.clear()  # the DHT forgot it all
        found = await a.find("wiki")
        assert found.header.id == local.manifest.header.id
        assert [s.path for s in found.shards()] == ["a.txt", "b.txt", "c.txt"]
        with pytest.raises(DatasetError, match="no dataset 'books'"):
            await a.find("books")


async def test_find_in_a_closed_swarm_honours_the_authoritys_retractions(autojump_clock: trio.abc.Clock,
                                                                         tmp_path: Path) -> None:
    key = SigningKey.generate()
    async with lab(2) as (a, b):
        swarm_of(a).authenticator = SimpleNamespace(config=SimpleNamespace(authority=key.verify_key))  # type: ignore[attr-defined]
        local = await b.create("wiki", corpus(tmp_path / "src"), seed=False)
        (entry,) = local.manifest.entries.values()
        await a.retract("wiki", [entry.id], authority_key=key)
        assert (await a.find("wiki")).authority == bytes(key.verify_key)
        assert (await a.find("wiki")).shards() == []
        assert [s.path for s in (await b.find("wiki")).shards()] == ["a.txt", "b.txt"]  # b's swarm is open


# ---------------------------------------------------------------------------- the tracker's records


def tracker(entries: dict[KeyLike, tuple[Any, float]]) -> ValueWithExpiration:
    found = {k: ValueWithExpiration(v, e) for k, (v, e) in entries.items()}
    return ValueWithExpiration(found, max((e for _, e in entries.values()), default=0.0))


def record_of(dataset: bytes, shards: list[bytes] = [b"r1"], partial: list[bytes] = [], addrs: int = 1,
              served: int = 0) -> bytes:
    return pb.Seeding(dataset=dataset, shards=shards, partial=partial, bytes_served=served,
                      addrs=[Multiaddr(f"/ip4/127.0.0.1/tcp/{4000 + i}").to_bytes() for i in range(addrs)]
                      ).SerializeToString()


def test_parse_seeders_takes_the_records_their_owners_wrote_of_this_dataset(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOG)
    p = [numbered_peer_id(i) for i in range(1, 9)]
    found = tracker({  # each refused record before the ones taken: a refusal skips only its own
        owned("s", p[5]): (17, 1000.0),  # not bytes
        owned("s", p[4]): (b"\xff\xff garbage", 1000.0),
        "s[owner:broken": (record_of(b"D"), 1000.0),  # a near-miss owner marker
        "s": (record_of(b"D"), 1000.0),  # nobody's: anyone could have written it
        owned("s", p[2]): (record_of(b"other"), 1000.0),  # another dataset's
        owned("s", p[3]): (record_of(b"D", [], []), 1000.0),  # withdrawn: holds nothing
        owned("s", p[0]): (record_of(b"D", [b"r2", b"r1"], [b"r3"], addrs=12, served=77), 1000.0),
        owned("s", p[1]): (record_of(b"D", [], [b"r3"]), 900.0),  # partial only: a downloader
    })
    first, second = parse_seeders(found, b"D")
    lines = log_lines(caplog, LOG, "datasets: a malformed tracker record: ")
    assert len(lines) == 2 and "DecodeError" in lines[0] and "malformed owner marker" in lines[1]
    assert first == SeederInfo(p[0], [Multiaddr(f"/ip4/127.0.0.1/tcp/{4000 + i}") for i in range(MAX_SEEDER_ADDRS)],
                               frozenset({b"r1", b"r2"}), frozenset({b"r3"}), 77, 1000.0)
    assert second == SeederInfo(p[1], [Multiaddr("/ip4/127.0.0.1/tcp/4000")], frozenset(), frozenset({b"r3"}), 0,
                                900.0)
    assert parse_seeders(None, b"D") == [] and parse_seeders(ValueWithExpiration(b"one", 1.0), b"D") == []


def test_a_tracker_record_names_at_most_100_000_shards_of_each_kind() -> None:
    roots = [i.to_bytes(3, "big") for i in range(100_001)]
    found = tracker({owned("s", numbered_peer_id(1)): (pb.Seeding(dataset=b"D", shards=roots, partial=roots)
                                                       .SerializeToString(), 1000.0)})
    (seeder,) = parse_seeders(found, b"D")
    assert seeder.whole == seeder.partial == frozenset(roots[:100_000])


def test_parse_seeders_reads_at_most_max_seeders_records() -> None:
    found = tracker({owned("s", numbered_peer_id(i)): (record_of(b"D"), 1000.0) for i in range(1, MAX_SEEDERS + 5)})
    seeders = parse_seeders(found, b"D")
    assert len(seeders) == MAX_SEEDERS and seeders[-1].peer_id == numbered_peer_id(MAX_SEEDERS)


async def test_show_counts_the_seeders_of_each_shard(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with lab(2) as (a, b):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        first, second = (s.root for s in local.manifest.shards())
        did = local.manifest.header.id
        put(a, seeders_key(did), owned("s", b.peer.peer_id), record_of(did, [first], [second]))
        await trio.sleep(1)
        shown = await b.show("wiki")
        assert shown.manifest.header.id == did and {s.peer_id for s in shown.seeders} == {a.peer.peer_id, b.peer.peer_id}
        assert shown.whole == {first: 2, second: 1} and shown.partial == {first: 0, second: 1}
        assert shown.complete
        assert spy(b).gets[-1] == (seeders_key(did), True, 15.0)
        a.unseed(did)
        await trio.sleep(1)
        shown = await b.show("wiki")
        assert shown.whole == {first: 1, second: 0} and not shown.complete


# ---------------------------------------------------------------------------- seeding and the tracker record


async def test_a_seeder_announces_at_once_and_again_every_third_of_the_records_life(autojump_clock: trio.abc.Clock,
                                                                                   tmp_path: Path) -> None:
    async with lab(announce_ttl=300.0) as (a,):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        did = local.manifest.header.id
        await trio.sleep(250)
        records = spy(a).of(seeders_key(did))
        assert [r.at for r in records] == [START, START + 100, START + 200]
        assert [r.expiration for r in records] == [WALL + START + 300, WALL + START + 400, WALL + START + 500]
        assert {(r.subkey, r.timeout) for r in records} == {(owned("s", a.peer.peer_id), 15.0)}
        msg = seeding(a, did)
        assert msg.dataset == did and list(msg.shards) == sorted(s.root for s in local.manifest.shards())
        assert list(msg.partial) == [] and msg.bytes_served == 0
        assert [Multiaddr(x) for x in msg.addrs] == a.peer.addrs


async def test_changes_within_the_gap_go_out_in_one_record(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with lab() as (a,):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        did = local.manifest.header.id
        await trio.sleep(0.5)
        for _ in range(3):
            a.announce_soon(did)
            await trio.sleep(0.25)
        await trio.sleep(10)
        assert [r.at for r in spy(a).of(seeders_key(did))] == [START, START + ANNOUNCE_GAP]
        a.announce_soon(did)
        await trio.sleep(1)
        assert [r.at for r in spy(a).of(seeders_key(did))][-1] == START + 0.5 + 0.75 + 10
        a.announce_soon(b"unknown")  # nothing held: nothing to announce


async def test_a_record_that_failed_is_tried_again_at_the_next_change(autojump_clock: trio.abc.Clock, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOG)
    async with lab() as (a,):
        spy(a).refuse = lambda key, subkey: str(key).startswith("dedloc.seeders.")
        local = await a.create("wiki", corpus(tmp_path / "src"))
        did = local.manifest.header.id
        await trio.sleep(1)
        assert log_lines(caplog, LOG, "datasets: ") == ["datasets: announcing wiki failed: no peer took " + seeders_key(did)]
        assert a.held[did].announced_served == 0
        spy(a).refuse = lambda key, subkey: False
        a.announce_soon(did)
        await trio.sleep(0.5)
        assert [r.at for r in spy(a).of(seeders_key(did))] == [START, START + 1]  # no gap after a failure


async def test_a_peer_holding_nothing_yet_announces_nothing(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with lab(2) as (a, b):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        empty = LocalDataset.open(tmp_path / "empty", (await b.find("wiki")))
        b.hold(empty)
        await trio.sleep(300)
        assert not spy(b).of(seeders_key(local.manifest.header.id))
        b.unseed(local.manifest.header.id)  # never announced: nothing to withdraw
        await trio.sleep(1)
        assert not spy(b).of(seeders_key(local.manifest.header.id))


async def test_a_part_held_is_announced_as_partial(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with lab(2) as (a, b):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        first = min(local.manifest.shards(), key=lambda s: s.path)
        part = LocalDataset.open(tmp_path / "part", await b.find("wiki"))
        part.set_leaves(first.root, local.leaves[first.root])
        part.write_piece(first.root, 1, FILES["a.txt"][PIECE:2 * PIECE])
        b.hold(part)
        await trio.sleep(1)
        msg = seeding(b, local.manifest.header.id)
        assert list(msg.shards) == [] and list(msg.partial) == [first.root]


async def test_seeding_again_takes_the_new_copy_and_announces_it(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with lab() as (a,):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        did = local.manifest.header.id
        await trio.sleep(10)
        again = LocalDataset.open(tmp_path / "src", local.manifest)
        a.seed(again)
        await trio.sleep(0.1)
        assert a.held[did].local is again
        assert [r.at for r in spy(a).of(seeders_key(did))] == [START, START + 10]


async def test_unseeding_withdraws_the_record_with_an_empty_one_that_outlives_it(autojump_clock: trio.abc.Clock,
                                                                                tmp_path: Path,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOG)
    async with lab() as (a,):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        did = local.manifest.header.id
        await trio.sleep(50)
        a.unseed(did)
        await trio.sleep(300)
        last = spy(a).of(seeders_key(did))[-1]
        assert (last.at, last.expiration, last.subkey, last.timeout) == (
            START + 50, WALL + START + 600 + 1, owned("s", a.peer.peer_id), 15.0)
        assert pb.Seeding.FromString(last.value) == pb.Seeding(dataset=did)
        assert len(spy(a).of(seeders_key(did))) == 2 and did not in a.held  # the loop stopped with it
        a.unseed(did)  # twice: nothing more
        a.seed(local)
        await trio.sleep(1)
        spy(a).refuse = lambda key, subkey: True
        a.unseed(did)
        await trio.sleep(1)
        assert log_lines(caplog, LOG, "datasets: ")[-1] == "datasets: withdrawing our tracker record failed: no peer took " + \
            seeders_key(did)


async def test_every_holder_republishes_the_manifest_every_sixth_of_its_life(autojump_clock: trio.abc.Clock,
                                                                             tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOG)
    async with lab(manifest_ttl=600.0, announce_ttl=3600.0) as (a,):
        local = await a.create("wiki", corpus(tmp_path / "src"))
        await trio.sleep(250)
        assert [s.at for s in spy(a).of(INDEX_KEY)] == [START, START + 100, START + 200]
        assert [s.expiration for s in spy(a).of(INDEX_KEY)] == [WALL + START + 600, WALL + START + 700,
                                                                 WALL + START + 800]
        spy(a).took = False
        await trio.sleep(100)
        assert log_lines(caplog, LOG, "datasets: ") == ["datasets: re-publishing wiki failed: no DHT peer took wiki's manifest; "
                                          "is the peer connected?"]
        a.unseed(local.manifest.header.id)
        await trio.sleep(200)
        assert len(spy(a).of(INDEX_KEY)) == 4


# ---------------------------------------------------------------------------- serving pieces


@asynccontextmanager
async def seeded(tmp_path: Path, n: int = 2, **config: Any) -> AsyncIterator[tuple[list[Datasets], LocalDataset]]:
    """Peer 0 created and seeds the two shards; the others ask."""
    async with lab(n, **config) as peers:
        local = await peers[0].create("wiki", corpus(tmp_path / "src"))
        yield peers, local


def shards_of(local: LocalDataset) -> tuple[Shard, Shard]:
    a, b = sorted(local.manifest.shards(), key=lambda s: s.path)
    return a, b


async def test_a_seeder_answers_have_leaves_and_pieces_in_order_on_one_stream(autojump_clock: trio.abc.Clock,
                                                                             tmp_path: Path) -> None:
    async with seeded(tmp_path) as ((a, b), local):
        did, (first, second) = local.manifest.header.id, shards_of(local)
        c = await Client.to(b, a)
        head, body = await c.ask(HAVE, did)
        assert head == pb.Answer(status=OK, have=[pb.ShardHave(root=r, bits=b"") for r in local.shards]) and body == b""
        head, body = await c.ask(LEAVES, did, first.root)
        assert head == pb.Answer(status=OK, size=4 * 32) and body == b"".join(local.leaves[first.root])
        for index in (3, 0):
            head, body = await c.ask(PIECE_, did, first.root, index)
            assert head == pb.Answer(status=OK, size=len(body))
            assert body == FILES["a.txt"][index * PIECE:(index + 1) * PIECE]
        assert (await c.ask(PIECE_, did, second.root, 1))[1] == FILES["b.txt"][PIECE:]
        served = 100 + PIECE + 7
        assert (a.bytes_served, a.held[did].served) == (served, served)
        assert a.metrics() == {"datasets.held": 1, "datasets.serving": 1, "datasets.bytes_served": served}
        await c.stream.close()
        assert await c.end() == "closed"
        await trio.sleep(0)
        assert a.serving == 0


async def test_have_names_the_pieces_of_a_part_and_leaves_out_what_is_not_held(autojump_clock: trio.abc.Clock,
                                                                              tmp_path: Path) -> None:
    async with seeded(tmp_path, 3) as ((a, b, c), local):
        did, (first, second) = local.manifest.header.id, shards_of(local)
        part = LocalDataset.open(tmp_path / "part", await b.find("wiki"))
        part.set_leaves(first.root, local.leaves[first.root])
        for i in (0, 2):
            part.write_piece(first.root, i, FILES["a.txt"][i * PIECE:(i + 1) * PIECE])
        b.hold(part)
        client = await Client.to(c, b)
        head, _ = await client.ask(HAVE, did)
        assert list(head.have) == [pb.ShardHave(root=first.root, bits=bytes([0b1010_0000]))]
        assert (await client.ask(LEAVES, did, second.root))[0] == pb.Answer(status=NOT_FOUND, reason="not holding that")
        assert (await client.ask(PIECE_, did, first.root, 1))[0].status == NOT_FOUND
        assert (await client.ask(PIECE_, did, first.root, 2))[1] == FILES["a.txt"][2 * PIECE:3 * PIECE]
        assert (await client.ask(PIECE_, did, first.root, 4))[0].status == NOT_FOUND  # past the shard's end
        assert (await client.ask(PIECE_, did, b"\x00" * 32, 0))[0].status == NOT_FOUND


async def test_a_dataset_not_seeded_is_not_found(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with seeded(tmp_path) as ((a, b), local):
        c = await Client.to(b, a)
        for kind in (HAVE, LEAVES, PIECE_):
            assert await c.ask(kind, b"another") == (pb.Answer(status=NOT_FOUND, reason="not seeding that dataset"),
                                                     b"")
        a.unseed(local.manifest.header.id)
        assert (await c.ask(HAVE, local.manifest.header.id))[0].status == NOT_FOUND


async def test_a_peer_asking_for_a_dataset_we_fetch_is_told_to_our_download(autojump_clock: trio.abc.Clock,
                                                                           tmp_path: Path) -> None:
    async with seeded(tmp_path) as ((a, b), local):
        did = local.manifest.header.id
        heard: list[ID] = []
        a._askers[did] = [heard.append]
        a._askers[b"other"] = [lambda peer: heard.append(numbered_peer_id(99))]
        c = await Client.to(b, a)
        await c.ask(HAVE, did)
        await c.ask(LEAVES, did, next(iter(local.shards)))  # only HAVE says who fetches
        await c.ask(HAVE, b"nobody")
        assert heard == [b.peer.peer_id]
        a.unseed(did)
        await c.ask(HAVE, did)  # told even when we do not seed it
        assert heard == [b.peer.peer_id] * 2

        class Bare:  # a stream that names no peer (no muxed connection): answered, nobody told
            written = b""

            async def write(self, data: bytes) -> None:
                self.written += data

        bare = Bare()
        await a._answer(cast(Any, bare), pb.Request(kind=HAVE, dataset=did))
        assert bare.written == frame(pb.Answer(status=NOT_FOUND, reason="not seeding that dataset"))
        assert heard == [b.peer.peer_id] * 2


async def test_an_idle_stream_is_closed_after_idle_timeout(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with seeded(tmp_path, idle_timeout=30.0) as ((a, b), local):
        c = await Client.to(b, a)
        await trio.sleep(20)
        await c.ask(HAVE, local.manifest.header.id)
        start = trio.current_time()
        assert await c.end() == "closed"
        assert trio.current_time() - start == pytest.approx(30.0)
        assert a.serving == 0 and a.refused == {}


async def test_past_the_upload_slots_a_stream_is_answered_busy_and_closed(autojump_clock: trio.abc.Clock,
                                                                          tmp_path: Path) -> None:
    async with seeded(tmp_path, upload_slots=2) as ((a, b), local):
        did = local.manifest.header.id
        first, second = await Client.to(b, a), await Client.to(b, a)
        await first.ask(HAVE, did)
        await second.ask(HAVE, did)
        third = await Client.to(b, a)
        assert await third.ask(HAVE, did) == (pb.Answer(status=BUSY, reason="all upload slots in use"), b"")
        assert await third.end() == "closed"
        assert a.refused == {"busy": 1} and a.metrics()["datasets.refused.busy"] == 1
        assert a.serving == 2
        assert (await (await Client.to(b, a)).ask(HAVE, did))[0].status == BUSY
        assert a.refused == {"busy": 2}
        await first.stream.close()
        await trio.sleep(1)
        fourth = await Client.to(b, a)
        assert (await fourth.ask(HAVE, did))[0].status == OK


def request_of(size: int) -> bytes:
    """A HAVE request of exactly ``size`` bytes (a long dataset id), framed."""
    raw = pb.Request(kind=HAVE, dataset=b"d" * (size - 3)).SerializeToString()
    assert len(raw) == size
    return frame(pb.Request(kind=HAVE, dataset=b"d" * (size - 3)))


@pytest.mark.parametrize("raw, why", [
    (b"\x05\xff\xff\xff\xff\xff", "dataset request does not parse: "),
    (request_of(1025), "dataset request of 1025 bytes, more than 1024"),
], ids=["garbled", "1025 bytes"])
async def test_a_garbled_or_oversized_request_resets_the_stream(autojump_clock: trio.abc.Clock, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture, raw: bytes,
                                                                why: str) -> None:
    caplog.set_level(logging.DEBUG, LOG)
    async with seeded(tmp_path) as ((a, b), local):
        c = await Client.to(b, a)
        await c.stream.write(raw)
        assert await c.end() == "reset"
        assert a.refused == {"bad request": 1} and a.serving == 0
        (line,) = log_lines(caplog, LOG, "datasets: a bad request: ")
        assert why in line


async def test_a_request_of_1024_bytes_is_answered(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with seeded(tmp_path) as ((a, b), local):
        c = await Client.to(b, a)
        await c.stream.write(request_of(1024))
        assert (await c.answer())[0].status == NOT_FOUND


async def test_a_downloader_that_resets_mid_stream_ends_its_service(autojump_clock: trio.abc.Clock,
                                                                    tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOG)
    async with seeded(tmp_path, upload_rate=float(PIECE)) as ((a, b), local):
        did, (first, _) = local.manifest.header.id, shards_of(local)
        c = await Client.to(b, a)
        await c.ask(HAVE, did)
        await c.send(PIECE_, did, first.root, 0)  # paced: 0.75 s before it is written
        await trio.sleep(0.1)
        await c.stream.reset()
        await trio.sleep(1)
        assert a.serving == 0 and a.refused == {} and a.bytes_served == 0
        assert swarm_of(a)._streams[-1]._reset_here  # the seeder's end reset too
        (line,) = log_lines(caplog, LOG, "datasets: a stream ended: ")
        assert "StreamReset" in line


async def test_the_upload_rate_paces_the_pieces(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with seeded(tmp_path, upload_rate=float(PIECE)) as ((a, b), local):
        did, (first, _) = local.manifest.header.id, shards_of(local)
        c = await Client.to(b, a)
        start = trio.current_time()
        times = []
        for index in range(3):
            await c.ask(PIECE_, did, first.root, index)
            times.append(trio.current_time() - start)
        assert times == pytest.approx([0.75, 1.75, 2.75])  # a quarter second's burst, then the rate
        await c.ask(LEAVES, did, first.root)
        assert trio.current_time() - start == pytest.approx(2.75)  # leaves are not paced


async def test_a_free_sending_slot_goes_to_the_asker_furthest_behind(autojump_clock: trio.abc.Clock,
                                                                     tmp_path: Path) -> None:
    async with seeded(tmp_path, 4, upload_rate=float(PIECE), sending_slots=1) as ((a, b, c, d), local):
        did, (first, _) = local.manifest.header.id, shards_of(local)
        done: list[str] = []

        async def fetch(who: str, asker: Datasets, held: int, delay: float) -> None:
            await trio.sleep(delay)
            client = await Client.to(asker, a)
            await client.ask(PIECE_, did, first.root, 0, held)
            done.append(who)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch, "first", b, 0, 0.0)
            nursery.start_soon(fetch, "ahead", c, 900, 0.1)
            nursery.start_soon(fetch, "behind", d, 100, 0.2)
        assert done == ["first", "behind", "ahead"]


async def sending(d: Datasets, order: list[tuple[str, float]], who: str, held: int,
                  scope: trio.CancelScope | None = None, then: Callable[[], None] | None = None) -> None:
    """Hold one of ``d``'s sending slots for a second (asked for as an asker holding ``held`` permille),
    within ``scope``; ``order`` notes who got one when; ``then()`` runs just before it is given back."""
    with scope or trio.CancelScope():
        async with d._sending_slot(held):
            order.append((who, trio.current_time()))
            await trio.sleep(1)
            if then is not None:
                then()


async def test_a_wait_for_a_sending_slot_cancelled_gives_its_place_up(autojump_clock: trio.abc.Clock) -> None:
    async with lab(sending_slots=1) as (a,):
        order: list[tuple[str, float]] = []
        gone = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sending, a, order, "first", 0)
            await trio.sleep(0.1)
            nursery.start_soon(sending, a, order, "gone", 0, gone)
            nursery.start_soon(sending, a, order, "last", 500)
            await trio.sleep(0.1)
            assert a.sending.waiting == 2
            gone.cancel()
        assert order == [("first", START), ("last", START + 1)]
        assert a.sending.waiting == 0 and a._tickets == {}


async def test_a_slot_granted_as_its_wait_is_cancelled_is_passed_on(autojump_clock: trio.abc.Clock) -> None:
    async with lab(sending_slots=1) as (a,):
        order: list[tuple[str, float]] = []
        gone = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            # the first cancels the second's wait as it leaves: the slot goes to it before it runs again
            nursery.start_soon(partial(sending, a, order, "first", 0, then=gone.cancel))
            await trio.sleep(0.1)
            nursery.start_soon(sending, a, order, "gone", 0, gone)
            await trio.sleep(0.1)
            nursery.start_soon(sending, a, order, "last", 500)
        assert order == [("first", START), ("last", START + 1)]
        assert a.sending.waiting == 0 and a._tickets == {}
        async with a._sending_slot(0):  # and the slot is free
            pass


async def test_serving_past_announce_served_refreshes_the_record_with_the_count(autojump_clock: trio.abc.Clock,
                                                                               tmp_path: Path) -> None:
    async with seeded(tmp_path, announce_served=2 * PIECE) as ((a, b), local):
        did, (first, _) = local.manifest.header.id, shards_of(local)
        c = await Client.to(b, a)
        await trio.sleep(10)
        await c.ask(PIECE_, did, first.root, 0)
        await trio.sleep(5)
        assert len(spy(a).of(seeders_key(did))) == 1
        await c.ask(PIECE_, did, first.root, 1)
        await trio.sleep(0.1)
        assert [r.at for r in spy(a).of(seeders_key(did))] == [START, START + 15]
        assert seeding(a, did).bytes_served == 2 * PIECE and a.held[did].announced_served == 2 * PIECE
        await c.ask(PIECE_, did, first.root, 2)
        await trio.sleep(5)
        assert len(spy(a).of(seeders_key(did))) == 2


async def test_a_piece_changed_on_disk_is_not_served_and_the_record_says_so(autojump_clock: trio.abc.Clock,
                                                                           tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    async with seeded(tmp_path) as ((a, b), local):
        did, (first, second) = local.manifest.header.id, shards_of(local)
        await trio.sleep(10)
        path = tmp_path / "src" / "a.txt"
        path.write_bytes(b"X" + FILES["a.txt"][1:])
        c = await Client.to(b, a)
        assert await c.ask(PIECE_, did, first.root, 0) == (pb.Answer(status=NOT_FOUND, reason="not holding that"), b"")
        await trio.sleep(0.1)
        assert [r.at for r in spy(a).of(seeders_key(did))] == [START, START + 10]
        assert list(seeding(a, did).shards) == [second.root] and a.bytes_served == 0
        assert (await c.ask(PIECE_, did, first.root, 1))[0].status == NOT_FOUND  # gone with its shard
        assert log_lines(caplog, "training.datasets.store", str(path)) == [
            f"{path}: piece 0 does not match its hash: the file changed on disk since it was checked: no longer "
            f"seeding it (check it again with `dedloc dataset seed {tmp_path / 'src'}`)"]
        await trio.sleep(5)
        assert len(spy(a).of(seeders_key(did))) == 2  # lost once, announced once


# ---------------------------------------------------------------------------- get


async def test_get_fetches_into_the_directory_then_seeds_and_says_so(autojump_clock: trio.abc.Clock,
                                                                    tmp_path: Path) -> None:
    async with seeded(tmp_path, upload_rate=float(PIECE)) as ((a, b), local):  # a piece a second, in order
        did, (first, second) = local.manifest.header.id, shards_of(local)
        await trio.sleep(1)
        started: list[LocalDataset] = []
        offered: list[list[str]] = []
        whole: list[tuple[str, int]] = []
        asked: list[Any] = []

        def priority(shards: list[Shard]) -> list[bytes]:
            offered.append([s.path for s in shards])
            return [shards[0].root]

        def on_shard(shard: Shard) -> None:  # and how many pieces of b.txt are here then
            whole.append((shard.path, len(started[0].have.get(second.root, ()))))
            asked.extend(b._askers.get(did, []))

        report = await b.get("wiki", tmp_path / "got", priority=priority, on_start=started.append, on_shard=on_shard)
        assert offered == [["a.txt", "b.txt"]] and did not in b._askers
        download = asked[0].__self__  # the download hears who asks
        assert download.local is started[0] and download.picker.priority == [0, 1]  # a.txt first
        assert started[0].directory == tmp_path / "got" and whole == [("a.txt", 0), ("b.txt", 0)]
        assert all((tmp_path / "got" / p).read_bytes() == data for p, data in FILES.items())
        total = sum(len(v) for v in FILES.values())
        assert report.bytes == total and report.sources == {a.peer.peer_id: total}
        assert events(b, ev.DatasetComplete) == [event(
            ev.DatasetComplete, name="wiki", directory=str(tmp_path / "got"), bytes=total, seconds=report.seconds,
            sources={str(a.peer.peer_id): total}, discarded=0)]
        assert b.held[did].local.complete
        await trio.sleep(ANNOUNCE_GAP + 0.1)
        assert set(seeding(b, did).shards) == set(local.shards)


async def test_get_without_seeding_stops_serving_when_done(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with seeded(tmp_path) as ((a, b), local):
        await trio.sleep(1)
        report = await b.get("wiki", tmp_path / "got", priority=[], seed=False)
        assert report.bytes == sum(len(v) for v in FILES.values())
        assert not b.held and local.manifest.header.id not in b._askers
        assert events(b, ev.DatasetComplete)[0]["discarded"] == 0


async def test_get_takes_its_fetch_settings(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with seeded(tmp_path) as ((a, b), local):
        a.unseed(local.manifest.header.id)
        start = trio.current_time()
        with pytest.raises(NoSeeders, match="no seeder of wiki reached in 3 s"):
            await b.get("wiki", tmp_path / "got", config=FetchConfig(no_seeder_timeout=3.0))
        assert trio.current_time() - start == pytest.approx(3.0, abs=1.0)
        assert not b._askers


async def test_two_downloads_of_one_dataset_at_once_each_hear_the_askers_until_the_last_ends(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    corpus(tmp_path / "one", {"a.txt": FILES["a.txt"]})  # the first lacks b.txt only: it ends first
    async with seeded(tmp_path, upload_rate=4.0 * PIECE) as ((a, b), local):
        did = local.manifest.header.id
        await trio.sleep(1)
        finished: list[tuple[str, list[Any]]] = []
        during: list[Any] = []

        async def get(name: str) -> None:
            await b.get("wiki", tmp_path / name)
            finished.append((name, list(b._askers.get(did, []))))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(get, "two")
            await trio.sleep(0.01)  # its download has begun
            nursery.start_soon(get, "one")
            await trio.sleep(0.001)
            during.extend(b._askers[did])
        assert [w.__self__.local.directory for w in during] == [tmp_path / "two", tmp_path / "one"]
        (first, heard), (second, after) = finished
        assert (first, second) == ("one", "two") and after == []  # "one" began last and ended first
        assert [w.__self__.local.directory for w in heard] == [tmp_path / "two"]
        assert did not in b._askers
