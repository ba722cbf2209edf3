"""Datasets on the composed peer: publish, grow, find, fetch and seed (the I/O shell of this package).

``async with Datasets.open(peer) as datasets:`` mounts the piece protocol
(``/dedloc/dataset/1.0.0``) on the peer and keeps, for every dataset this
peer holds, its tracker record and its manifest alive in the DHT:

* ``dedloc.dataset.<name>``: the signed headers and entries, each under a
  content-addressed subkey (``h[sha256:...]``, ``e[sha256:...]``); every
  holder re-publishes them, so the manifest outlives its authors;
* ``dedloc.datasets``: every header again, so ``dedloc dataset list`` finds
  them (the DHT cannot list keys);
* ``dedloc.seeders.<id hex>``: the tracker, a subkey per seeder owned by it
  (only it writes it; it expires unless refreshed): where it is reached and
  which shards it holds whole or in part. A downloader announces itself as
  soon as it holds a piece, so downloaders trade pieces among themselves.

The decisions (which piece of which seeder, who to connect to, the upload
pace) are :mod:`.picker`'s; the download itself is :mod:`.fetch`'s.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from averaging.wire import FrameReader, frame
from nat.swarm import Swarm
from p2p.dht.records import DHTKey, ValueWithExpiration, content_subkey, owned, owner_of
from p2p.errors import ConfigError, DedlocError, RemoteProtocolError
from p2p.lockfile import HeldLock
from p2p.trio_util import finish_quietly
from p2p.untrusted import decode_addrs

from ..proto import datasets_pb2 as pb
from . import events as ev
from .manifest import (
    DatasetError,
    Entry,
    Header,
    Manifest,
    ManifestError,
    Shard,
    Signer,
    SUFFIXES,
    check_name,
    object_id,
    resolve,
    schema_of,
    sign_by_authority,
)
from .picker import Pacer, UploadSlots
from .store import LocalDataset, lock_directory, read_checked

if TYPE_CHECKING:
    from .fetch import FetchConfig, FetchReport

log = logging.getLogger(__name__)

PROTOCOL = "/dedloc/dataset/1.0.0"
#: The DHT key that lists every dataset's header.
INDEX_KEY = "dedloc.datasets"
#: Largest request or answer header on the piece protocol (a HAVE answer of many shards).
MAX_HEADER = 1 << 20
#: Addresses kept from one tracker record.
MAX_SEEDER_ADDRS = 8
#: Seeders read from one tracker key.
MAX_SEEDERS = 256
#: The least time between two tracker records of one dataset.
ANNOUNCE_GAP = 2.0


def dataset_key(name: str) -> str:
    return f"dedloc.dataset.{check_name(name)}"


def seeders_key(dataset: bytes) -> str:
    return f"dedloc.seeders.{dataset.hex()}"


class DatasetSwarm(Swarm, Signer, Protocol):
    """What datasets need of the network: the :class:`nat.Swarm`, our identity's signatures (entries are
    signed objects) and whether a peer is reached directly (bulk data never goes through a relay's
    limited circuits unless asked). :class:`nat.Peer` is one."""

    def path_to(self, peer_id: ID) -> str: ...


@dataclass
class DatasetsConfig:
    #: bytes per piece of a dataset created here
    piece_size: int = 1 << 20
    #: upload cap in bytes a second over every stream (None: none)
    upload_rate: float | None = None
    #: streams served at once; more are answered BUSY
    upload_slots: int = 32
    #: pieces sent at once; more wait, the asker furthest behind first (picker.UploadSlots)
    sending_slots: int = 8
    #: tracker records live this long and are refreshed every third of it
    announce_ttl: float = 600.0
    #: bytes served since the last tracker record that make it worth a new one (credit for data follows it)
    announce_served: int = 16 << 20
    #: the manifest's records live this long in the DHT; every holder re-publishes them every sixth of it
    manifest_ttl: float = 12 * 3600.0
    #: a served stream with no request for this long is closed
    idle_timeout: float = 60.0
    #: the time allowed for a DHT read or write
    dht_timeout: float = 15.0

    def validate(self) -> None:
        if self.piece_size & (self.piece_size - 1) or not 16 * 1024 <= self.piece_size <= 16 << 20:
            raise ConfigError("piece size must be a power of two from 16 KiB to 16 MiB")
        if self.upload_rate is not None and not (self.upload_rate > 0 and math.isfinite(self.upload_rate)):
            raise ConfigError("the upload rate must be a positive number of bytes per second (or None: no cap)")
        if self.upload_slots < 1 or self.sending_slots < 1:
            raise ConfigError("upload and sending slots must be at least 1")
        if not (self.announce_ttl > 0 and 0 < self.manifest_ttl <= 24 * 3600):
            raise ConfigError("announce_ttl must be positive and manifest_ttl within 24 h")


@dataclass(frozen=True)
class SeederInfo:
    """One tracker record: a seeder, where it is reached, what it holds."""

    peer_id: ID
    addrs: list[Multiaddr]
    whole: frozenset[bytes]
    partial: frozenset[bytes]
    bytes_served: int
    expiration: float


@dataclass(frozen=True)
class Show:
    """A dataset as the swarm holds it (``dedloc dataset show``)."""

    manifest: Manifest
    seeders: list[SeederInfo]
    #: shard root -> seeders holding it whole / in part
    whole: dict[bytes, int]
    partial: dict[bytes, int]

    @property
    def complete(self) -> bool:
        """Every shard held whole by some seeder."""
        return all(self.whole.values())


@dataclass
class _Held:
    local: LocalDataset
    served: int = 0
    announced_served: int = 0
    #: the expiration of our last tracker record (unix time; 0: none yet)
    announced_expiration: float = 0.0
    changed: trio.Event = field(default_factory=trio.Event)


class Datasets:
    """Datasets on one peer; see the module docstring. Use :meth:`open`."""

    def __init__(self, peer: DatasetSwarm, config: DatasetsConfig, nursery: trio.Nursery) -> None:
        self.peer = peer
        self.config = config
        self._nursery = nursery
        self.held: dict[bytes, _Held] = {}
        self.pacer = Pacer(config.upload_rate)
        self.sending = UploadSlots(config.sending_slots)
        self._tickets: dict[int, trio.Event] = {}
        #: dataset id -> what each download of ours wants to hear of the peers that ask us for it
        self._askers: dict[bytes, list[Callable[[ID], None]]] = {}
        self.serving = 0
        #: bytes served, every dataset together
        self.bytes_served = 0
        self.refused: dict[str, int] = {}
        #: the directories this service writes, one process at a time (``store.lock_directory``)
        self._locks: dict[Path, HeldLock] = {}

    @classmethod
    @asynccontextmanager
    async def open(cls, peer: DatasetSwarm, config: DatasetsConfig | None = None) -> AsyncIterator[Datasets]:
        config = config or DatasetsConfig()
        config.validate()
        async with trio.open_nursery() as nursery:
            datasets = cls(peer, config, nursery)
            registration = peer.set_stream_handler(PROTOCOL, datasets._on_stream)
            try:
                yield datasets
            finally:
                registration.remove()
                nursery.cancel_scope.cancel()
                for lock in datasets._locks.values():
                    lock.release()

    def _lock(self, directory: Path) -> None:
        """Hold ``directory`` until the service closes; refused if another process holds it. A
        directory this service holds already (a download that then seeds) is not locked twice."""
        key = Path(directory).resolve()
        if key not in self._locks:
            self._locks[key] = lock_directory(Path(directory))

    # ------------------------------------------------------------------ publishing

    async def create(self, name: str, directory: Path, *, schema: str | None = None, text_field: str = "text",
                     seed: bool = True) -> LocalDataset:
        """Make ``directory``'s shard files a dataset named ``name``, publish it and (``seed``) serve it."""
        check_name(name)
        directory = Path(directory)
        files = shard_files(directory)
        self._lock(directory)
        schema = schema or schema_of(str(p) for p in files)
        mine = [h for h in await self.headers(name) if h.creator == self.peer.peer_id]
        if mine:
            raise DatasetError(f"you already created a dataset {name} ({mine[0].id.hex()[:16]}): grow it with "
                               "`dedloc dataset add`, or name another")
        header = Header.make(self.peer, name, schema, piece_size=self.config.piece_size, now=time.time(),
                             text_field=text_field)
        shards = await trio.to_thread.run_sync(_hash_shards, directory, files, header.piece_size)
        manifest = Manifest(header)
        entry = Entry.make(self.peer, header, shards, now=time.time())
        manifest.add(entry.signed)
        local = await trio.to_thread.run_sync(LocalDataset.open, directory, manifest)
        await self.publish(manifest)
        self.peer.emit(ev.DatasetPublished(name=name, dataset=header.id.hex(), creator=str(header.creator),
                                           shards=len(shards), bytes=sum(s.size for s in shards),
                                           entry=entry.id.hex()))
        if seed:
            self.seed(local)
        return local

    async def add(self, ref: str, files: Sequence[Path], directory: Path, *, seed: bool = True) -> Entry:
        """Add ``files`` to dataset ``ref`` as an entry of ours: copied into ``directory`` (our copy of the
        dataset, which need not hold the rest), published and (``seed``) served."""
        manifest = await self.find(ref)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._lock(directory)
        if schema_of(str(f) for f in files) != manifest.header.schema:
            raise DatasetError(f"{ref} holds {manifest.header.schema} shards; these files are not")
        taken = {s.path for s in manifest.shards()}
        names = []
        for f in files:
            f = Path(f)
            if not f.is_file():
                raise DatasetError(f"{f}: no such file")
            if f.name in taken:
                raise DatasetError(f"{ref} already has a shard {f.name}; rename the file")
            target = directory / f.name
            if f.resolve() != target.resolve():
                await trio.to_thread.run_sync(_copy, f, target)
            names.append(target)
        shards = await trio.to_thread.run_sync(_hash_shards, directory, names, manifest.header.piece_size)
        entry = Entry.make(self.peer, manifest.header, shards, now=time.time())
        manifest.add(entry.signed)
        local = await trio.to_thread.run_sync(LocalDataset.open, directory, manifest)
        await self.publish(manifest)
        self.peer.emit(ev.DatasetPublished(name=manifest.header.name, dataset=manifest.header.id.hex(),
                                           creator=str(manifest.header.creator), shards=len(shards),
                                           bytes=sum(s.size for s in shards), entry=entry.id.hex()))
        if seed:
            self.seed(local)
        return entry

    @property
    def authority(self) -> bytes | None:
        """A closed swarm's authority key (its retractions count), None in an open swarm."""
        authenticator = getattr(self.peer, "authenticator", None)
        return None if authenticator is None else bytes(authenticator.config.authority)

    async def retract(self, ref: str, entry_ids: Sequence[bytes], *, authority_key: Any = None) -> bytes:
        """Take entries out of a dataset: as its creator (an entry of ours that names them), or, with
        ``authority_key`` (the closed swarm's, ``p2p.authority.load_or_create_key``), as its authority.
        The signed retraction's id."""
        manifest = await self.find(ref)
        if authority_key is not None:
            if self.authority is None or bytes(authority_key.verify_key) != self.authority:
                raise DatasetError("that authority key is not this swarm's authority (is the peer in its closed "
                                   "swarm?)")
            raw = sign_by_authority(authority_key, manifest.header, entry_ids, now=time.time())
        else:
            if manifest.header.creator != self.peer.peer_id:
                raise DatasetError(f"only {ref}'s creator ({manifest.header.creator}) or, in a closed swarm, its "
                                   "authority can retract its entries")
            raw = Entry.make(self.peer, manifest.header, [], now=time.time(), retract=entry_ids).signed
        manifest.add(raw)
        await self.publish(manifest)
        return object_id(raw)

    async def publish(self, manifest: Manifest) -> int:
        """Store the header and every entry (and the header in the index); how many records some replica took."""
        expiration = time.time() + self.config.manifest_ttl
        key = dataset_key(manifest.header.name)
        records = [(key, content_subkey(manifest.header.signed, "h"), manifest.header.signed),
                   (INDEX_KEY, content_subkey(manifest.header.signed, "h"), manifest.header.signed)]
        records += [(key, content_subkey(raw, "e"), raw) for raw in manifest.signed()]
        stored = 0

        async def one(key: str, subkey: str, value: bytes) -> None:
            nonlocal stored
            try:
                # awaited first: `stored += await ...` reads `stored` before the await, and the
                # stores run at once (the last to finish would set the count alone)
                took = await self.peer.dht.store(key, value, expiration, subkey=subkey,
                                                 timeout=self.config.dht_timeout)
                stored += took
            except DedlocError as e:
                log.warning("datasets: storing %s failed: %s", key, e)

        async with trio.open_nursery() as nursery:
            for record in records:
                nursery.start_soon(one, *record)
        if not stored:
            raise DatasetError(f"no DHT peer took {manifest.header.name}'s manifest; is the peer connected?")
        return stored

    # ------------------------------------------------------------------ finding

    async def headers(self, name: str | None = None) -> list[Header]:
        """Every dataset's header the DHT holds (of ``name``'s key, else of the index), checked."""
        found = await self.peer.dht.get(INDEX_KEY if name is None else dataset_key(name), latest=True,
                                        timeout=self.config.dht_timeout)
        out = []
        for subkey, raw in _subkeys(found, "h"):
            try:
                out.append(Header.parse(raw))
            except ManifestError as e:
                log.info("datasets: refused a header under %r: %s", subkey, e)
        return out

    async def find(self, ref: str) -> Manifest:
        """The manifest ``ref`` names (``NAME``, ``NAME@creator``), every entry checked; entries of ours a
        peer holds locally count too."""
        name = ref.partition("@")[0]
        check_name(name)
        found = await self.peer.dht.get(dataset_key(name), latest=True, timeout=self.config.dht_timeout)
        headers = []
        for subkey, raw in _subkeys(found, "h"):
            try:
                headers.append(Header.parse(raw))
            except ManifestError as e:
                log.info("datasets: refused a header of %s: %s", name, e)
        held = [h.local.manifest.header for h in self.held.values() if h.local.manifest.header.name == name]
        header = resolve(headers + held, ref)
        manifest = Manifest(header, authority=self.authority)
        for _, raw in _subkeys(found, "e"):
            manifest.add(raw)
        if header.id in self.held:
            manifest.merge(self.held[header.id].local.manifest)
        return manifest

    async def seeders(self, dataset: bytes) -> list[SeederInfo]:
        """The tracker's seeders of a dataset (records whose owner is the seeder; addresses checked)."""
        found = await self.peer.dht.get(seeders_key(dataset), latest=True, timeout=self.config.dht_timeout)
        return parse_seeders(found, dataset)

    # ------------------------------------------------------------------ fetching

    async def get(self, ref: str, directory: Path, *, config: FetchConfig | None = None,
                  priority: Sequence[bytes] | Callable[[list[Shard]], Sequence[bytes]] | None = None,
                  on_shard: Callable[[Shard], None] | None = None,
                  on_start: Callable[[LocalDataset], None] | None = None, seed: bool = True) -> FetchReport:
        """Fetch dataset ``ref`` into ``directory`` (resuming from what is there), seeding what it holds while
        it fetches and (``seed``) after. ``priority``: shard roots wanted first, in order (or a function of
        the shards that says so: a trainer draws its own random order); ``on_shard``:
        called with each shard once it is whole and at its path; ``on_start``: with the local dataset, once
        what was on disk is checked."""
        from .fetch import Download

        manifest = await self.find(ref)
        self._lock(Path(directory))
        local = await trio.to_thread.run_sync(LocalDataset.open, Path(directory), manifest)
        if on_start is not None:
            on_start(local)
        if callable(priority):
            priority = priority(sorted(local.shards.values(), key=lambda s: s.path))
        download = Download(self, local, config, priority=priority, on_shard=on_shard)
        watchers = self._askers.setdefault(manifest.header.id, [])
        watchers.append(download.asked_by)
        try:
            report = await download.run()
        finally:
            watchers.remove(download.asked_by)  # another download of it at once goes on hearing them
            if not watchers:
                del self._askers[manifest.header.id]
            if not seed:
                self.unseed(manifest.header.id)
        self.peer.emit(ev.DatasetComplete(
            name=manifest.header.name, directory=str(directory), bytes=report.bytes, seconds=report.seconds,
            sources={str(p): n for p, n in report.sources.items()}, discarded=local.discarded))
        if seed:
            self.seed(local)
        return report

    async def show(self, ref: str) -> Show:
        """What the swarm holds of a dataset: its shards, their seeders, whether every shard is held whole."""
        manifest = await self.find(ref)
        seeders = await self.seeders(manifest.header.id)
        shards = manifest.shards()
        return Show(manifest, seeders, {s.root: sum(1 for x in seeders if s.root in x.whole) for s in shards},
                    {s.root: sum(1 for x in seeders if s.root in x.partial) for s in shards})

    # ------------------------------------------------------------------ seeding

    def seed(self, local: LocalDataset) -> None:
        """Serve ``local`` and keep its tracker record and manifest in the DHT (until the service closes)."""
        self._lock(local.directory)
        did = local.manifest.header.id
        if did in self.held:
            self.held[did].local = local
            self.announce_soon(did)
            return
        held = self.held[did] = _Held(local)
        self._nursery.start_soon(self._announce_loop, held)
        self._nursery.start_soon(self._republish_loop, held)

    def hold(self, local: LocalDataset) -> None:
        """Serve what a download holds so far (it seeds while it fetches)."""
        self.seed(local)

    def unseed(self, dataset: bytes) -> None:
        """Stop serving ``dataset``; our tracker record is replaced by an empty one (a DHT record cannot be
        deleted, only outlived), so downloaders stop asking us."""
        held = self.held.pop(dataset, None)
        if held is not None:
            held.changed.set()
            if held.announced_expiration:
                self._nursery.start_soon(self._withdraw, dataset, held.announced_expiration + 1.0)

    async def _withdraw(self, dataset: bytes, expiration: float) -> None:
        empty = pb.Seeding(dataset=dataset).SerializeToString()
        try:
            await self.peer.dht.store(seeders_key(dataset), empty, expiration, subkey=owned("s", self.peer.peer_id),
                                      timeout=self.config.dht_timeout)
        except DedlocError as e:
            log.info("datasets: withdrawing our tracker record failed: %s", e)

    def announce_soon(self, dataset: bytes) -> None:
        """Our holdings of ``dataset`` changed: the tracker record is refreshed (at most every 2 s)."""
        held = self.held.get(dataset)
        if held is not None:
            held.changed.set()

    def seeding_record(self, held: _Held) -> bytes:
        local = held.local
        return pb.Seeding(dataset=local.manifest.header.id,
                          addrs=[bytes(a.to_bytes()) for a in self.peer.addrs][:MAX_SEEDER_ADDRS],
                          shards=sorted(local.whole), partial=sorted(r for r, h in local.have.items() if h),
                          bytes_served=held.served).SerializeToString()

    async def _announce_loop(self, held: _Held) -> None:
        """The tracker record: as soon as we hold a piece (a downloader is found by the others at once), again
        within ``ANNOUNCE_GAP`` of every change, and every third of its life."""
        did = held.local.manifest.header.id
        stored_at = -1e9
        while self.held.get(did) is held:
            held.changed = trio.Event()
            if held.local.whole or any(held.local.have.values()):
                try:
                    # noted before the store: a withdrawal meanwhile must outlive this record
                    held.announced_expiration = expiration = time.time() + self.config.announce_ttl
                    await self.peer.dht.store(seeders_key(did), self.seeding_record(held), expiration,
                                              subkey=owned("s", self.peer.peer_id), timeout=self.config.dht_timeout)
                    stored_at = trio.current_time()
                    held.announced_served = held.served
                except DedlocError as e:
                    log.info("datasets: announcing %s failed: %s", held.local.manifest.header.name, e)
            with trio.move_on_after(self.config.announce_ttl / 3):
                await held.changed.wait()
            await trio.sleep_until(stored_at + ANNOUNCE_GAP)  # changes within the gap go out in one record

    async def _republish_loop(self, held: _Held) -> None:
        did = held.local.manifest.header.id
        while True:
            await trio.sleep(self.config.manifest_ttl / 6)
            if self.held.get(did) is not held:  # unseeded meanwhile
                return
            try:
                await self.publish(held.local.manifest)
            except DedlocError as e:
                log.info("datasets: re-publishing %s failed: %s", held.local.manifest.header.name, e)

    # ------------------------------------------------------------------ serving pieces

    def _refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    async def _on_stream(self, stream: INetStream) -> None:
        """Requests one after another, each answered in order (HAVE, LEAVES, PIECE); at the downloader's end
        of writing, idle for ``idle_timeout`` or BUSY, the stream is closed (our end of writing: the
        downloader reads to its end), and at a malformed request reset."""
        reader = FrameReader(stream)
        busy = self.serving >= self.config.upload_slots
        self.serving += 1
        try:
            while True:
                request: pb.Request | None = None
                with trio.move_on_after(self.config.idle_timeout):
                    if not await reader.at_eof():
                        request = await reader.message(pb.Request, "dataset request", max_size=1024)
                if request is None:  # the downloader is done, or idle
                    break
                if busy:
                    self._refuse("busy")
                    await stream.write(frame(pb.Answer(status=pb.Answer.BUSY, reason="all upload slots in use")))
                    break
                await self._answer(stream, request)
        except RemoteProtocolError as e:
            self._refuse("bad request")
            log.debug("datasets: a bad request: %s", e)
            await finish_quietly(stream.reset)
        except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError, OSError, DedlocError, StreamError) as e:
            log.debug("datasets: a stream ended: %r", e)  # the downloader reset it: done, or gave up
            await finish_quietly(stream.reset)
        else:
            await finish_quietly(stream.close)
        finally:
            self.serving -= 1

    async def _answer(self, stream: INetStream, request: pb.Request) -> None:
        if request.kind == pb.Request.HAVE:
            peer = getattr(getattr(stream, "muxed_conn", None), "peer_id", None)
            if isinstance(peer, ID):
                for watcher in self._askers.get(request.dataset, []):
                    watcher(peer)  # a peer fetching the dataset we fetch: it may hold what we lack
        held = self.held.get(request.dataset)
        if held is None:
            await stream.write(frame(pb.Answer(status=pb.Answer.NOT_FOUND, reason="not seeding that dataset")))
            return
        local = held.local
        if request.kind == pb.Request.HAVE:
            have = []
            for root in local.shards:
                bits = local.bitfield(root)
                if bits is not None:
                    have.append(pb.ShardHave(root=root, bits=bits))
            await stream.write(frame(pb.Answer(status=pb.Answer.OK, have=have)))
            return
        data = (local.read_leaves(request.shard) if request.kind == pb.Request.LEAVES
                else await self._read_piece(held, request.shard, request.index))
        if data is None:
            await stream.write(frame(pb.Answer(status=pb.Answer.NOT_FOUND, reason="not holding that")))
            return
        if request.kind == pb.Request.LEAVES:  # small: no slot
            await stream.write(frame(pb.Answer(status=pb.Answer.OK, size=len(data))) + data)
            return
        async with self._sending_slot(request.held_permille):
            wait = self.pacer.delay(len(data), trio.current_time())
            if wait > 0:
                await trio.sleep(wait)
            await stream.write(frame(pb.Answer(status=pb.Answer.OK, size=len(data))) + data)
        held.served += len(data)
        self.bytes_served += len(data)
        if held.served - held.announced_served >= self.config.announce_served:
            held.changed.set()  # the record says what we served (credit for data)

    async def _read_piece(self, held: _Held, root: bytes, index: int) -> bytes | None:
        """A piece to serve, read and checked again in a worker thread (``store.read_checked``: the
        loop goes on with the other streams meanwhile); one that no longer matches is no longer held,
        and the tracker record is refreshed to say so."""
        at = held.local.locate_piece(root, index)
        if at is None:
            return None
        data = await trio.to_thread.run_sync(read_checked, at)
        if isinstance(data, str):
            if held.local.lost(at, data):
                self.announce_soon(held.local.manifest.header.id)
            return None
        return data

    @asynccontextmanager
    async def _sending_slot(self, held: int) -> AsyncIterator[None]:
        """One of ``sending_slots``: granted by :class:`UploadSlots` (the asker furthest behind first)."""
        ticket = self.sending.enter(held)
        if ticket is not None:
            granted = self._tickets[ticket] = trio.Event()
            try:
                await granted.wait()
            except BaseException:
                self._tickets.pop(ticket, None)
                if granted.is_set():  # the slot came as we were cancelled: pass it on
                    self._pass_slot()
                else:
                    self.sending.withdraw(ticket)
                raise
            self._tickets.pop(ticket, None)
        try:
            yield
        finally:
            self._pass_slot()

    def _pass_slot(self) -> None:
        ticket = self.sending.leave()
        if ticket is not None:
            self._tickets[ticket].set()

    def metrics(self) -> dict[str, float | int | str]:
        return {"datasets.held": len(self.held), "datasets.serving": self.serving,
                "datasets.bytes_served": self.bytes_served,
                **{f"datasets.refused.{k}": v for k, v in self.refused.items()}}


def parse_seeders(found: ValueWithExpiration | None, dataset: bytes) -> list[SeederInfo]:
    """The tracker records in a lookup's result: owned by the seeder they describe, of this dataset."""
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for subkey, entry in list(found.value.items())[:MAX_SEEDERS]:
        if not isinstance(entry.value, bytes):
            continue
        try:
            owner = owner_of(DHTKey.encode(subkey))
            msg = pb.Seeding.FromString(entry.value)
        except Exception as e:  # a stranger's garbage costs it only its entry
            log.debug("datasets: a malformed tracker record: %r", e)
            continue
        if owner is None or msg.dataset != dataset or not (msg.shards or msg.partial):
            continue  # another dataset's, or a withdrawn record (it holds nothing)
        addrs = decode_addrs(msg.addrs, limit=MAX_SEEDER_ADDRS)
        out.append(SeederInfo(owner, addrs, frozenset(bytes(r) for r in msg.shards[:100_000]),
                              frozenset(bytes(r) for r in msg.partial[:100_000]), msg.bytes_served,
                              entry.expiration))
    return out


def _subkeys(found: ValueWithExpiration | None, prefix: str) -> list[tuple[str, bytes]]:
    if found is None or not isinstance(found.value, dict):
        return []
    return [(k, v.value) for k, v in found.value.items()
            if isinstance(k, str) and k.startswith(prefix + "[sha256:") and isinstance(v.value, bytes)]


def shard_files(directory: Path) -> list[Path]:
    """The files of ``directory`` that ``create`` makes a dataset of (a clear error if none)."""
    if not directory.is_dir():
        raise DatasetError(f"{directory}: no such directory")
    files = sorted(p for p in directory.rglob("*") if p.is_file() and ".dedloc" not in p.relative_to(directory).parts
                   and p.suffix.lower() in SUFFIXES and p.stat().st_size > 0)
    if not files:
        raise DatasetError(f"{directory}: no shard files in it (wanted {', '.join(sorted(SUFFIXES))})")
    return files


def _hash_shards(directory: Path, files: Sequence[Path], piece_size: int) -> list[Shard]:
    from .pieces import hash_file, merkle_root

    shards = []
    for f in files:
        size, leaves = hash_file(f, piece_size)
        if size == 0:
            continue
        shards.append(Shard(f.relative_to(directory).as_posix(), size, merkle_root(leaves)))
    return shards


def _copy(src: Path, dst: Path) -> None:
    import shutil

    try:
        dst.hardlink_to(src)
    except OSError:
        shutil.copyfile(src, dst)


__all__ = ["Datasets", "DatasetsConfig", "DatasetSwarm", "INDEX_KEY", "PROTOCOL", "SeederInfo", "Show", "dataset_key",
           "parse_seeders", "seeders_key"]
