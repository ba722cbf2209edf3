"""One download: pieces from many seeders at once, each checked before it is written (the picker's shell).

``Download(datasets, local, ...).run()`` keeps, until every shard is whole:

* a **tracker task**: reads the dataset's seeders from the DHT every
  ``tracker_interval`` and connects to those :class:`~.picker.SeederTable` says
  (direct connections only, unless ``allow_relayed``: a seeder behind a NAT is
  dialled through its relay and the NAT layer's hole punch makes it direct; one
  that stays relayed is looked at again later);
* per connected seeder, **one stream** with a pipeline of requests: a writer
  that asks what :class:`~.picker.PiecePicker` picks (HAVE every
  ``have_interval``, so pieces other downloaders gained are seen), and a reader
  that takes the answers in order, checks each piece against its leaf (and
  leaves against the shard's root), writes it, and tells the picker. A bad
  piece bans the seeder for the dataset and names it (:class:`~.events.SeederBanned`);
  a stream that breaks or stalls (``stall_timeout`` without a byte while
  something is asked) costs only time: its requests go to the others.

While it runs, the dataset is held by the :class:`~.service.Datasets` service:
what it has so far is served and announced, so downloaders trade pieces.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from averaging.wire import FrameReader, frame
from p2p.errors import DedlocError, RemoteProtocolError
from p2p.trio_util import finish_quietly, unwrap_single_group

from ..proto import datasets_pb2 as pb
from . import events as ev
from .manifest import Shard
from .picker import LEAVES, PickerConfig, PieceKey, PiecePicker, SeederState, SeederTable, TableConfig
from .pieces import HASH_SIZE, check_leaves, piece_count
from .service import MAX_HEADER, PROTOCOL
from .store import LocalDataset, from_bits

if TYPE_CHECKING:
    from .service import Datasets

log = logging.getLogger(__name__)

_HAVE = (-1, -2)  # the outstanding-queue marker of a HAVE request


@dataclass
class FetchConfig:
    picker: PickerConfig = field(default_factory=PickerConfig)
    table: TableConfig = field(default_factory=TableConfig)
    #: how often the tracker is read: every second while it names new seeders, then less often, doubling
    #: up to this
    tracker_interval: float = 5.0
    #: how often each seeder is asked what it holds
    have_interval: float = 1.0
    #: no byte for this long while something is asked: the seeder is given up (for now)
    stall_timeout: float = 20.0
    #: opening a stream to a seeder (dialling, a relay, a hole punch)
    connect_timeout: float = 20.0
    #: how often a progress event is emitted
    progress_interval: float = 1.0
    #: give up when no seeder is found for this long (0: wait forever)
    no_seeder_timeout: float = 120.0


@dataclass
class FetchReport:
    bytes: int = 0
    seconds: float = 0.0
    #: bytes received per seeder
    sources: dict[ID, int] = field(default_factory=dict)
    #: seeders banned, and why
    banned: dict[ID, str] = field(default_factory=dict)
    #: pieces received twice (endgame) and dropped
    duplicates: int = 0
    #: seconds from the start to the first seeder connected, and to the first piece written
    first_seeder_s: float | None = None
    first_piece_s: float | None = None


class NoSeeders(DedlocError):
    """Nobody seeds the dataset (or nobody reachable)."""


class Download:
    """See the module docstring."""

    def __init__(self, datasets: Datasets, local: LocalDataset, config: FetchConfig | None = None, *,
                 priority: Sequence[bytes] | None = None, on_shard: Callable[[Shard], None] | None = None,
                 rng: random.Random | None = None) -> None:
        self.datasets = datasets
        self.peer = datasets.peer
        self.local = local
        self.config = config or FetchConfig()
        self.name = local.manifest.header.name
        self.dataset = local.manifest.header.id
        self.shards = sorted(local.shards.values(), key=lambda s: s.path)
        self.index = {s.root: i for i, s in enumerate(self.shards)}
        self.on_shard = on_shard
        rng = rng or random.Random()
        order = {root: i for i, root in enumerate(priority or ())}
        ps = local.piece_size
        held: list[PieceKey] = []
        for i, s in enumerate(self.shards):
            pieces = local.pieces_of(s.root)
            held += [(i, j) for j in range(piece_count(s.size, ps))] if pieces is None else [(i, j) for j in pieces]
        self.picker = PiecePicker([s.pieces(ps) for s in self.shards], held,
                                  leaves_known=[i for i, s in enumerate(self.shards) if s.root in local.leaves],
                                  priority=[order.get(s.root, len(order)) for s in self.shards],
                                  config=self.config.picker, rng=rng, piece_size=ps)
        self.table = SeederTable(self.peer.peer_id, self.config.table, rng)
        self.addrs: dict[ID, list[Multiaddr]] = {}
        self.report = FetchReport()
        self._changed = trio.Event()
        self._done = trio.Event()
        self._rate_bytes: deque[tuple[float, int]] = deque()
        self._start = 0.0
        self.total = sum(s.size for s in self.shards)
        self._held = local.held_bytes

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self) -> FetchReport:
        """Fetch every missing piece; :class:`NoSeeders` if none is found within ``no_seeder_timeout``."""
        start = self._start = trio.current_time()
        if self.picker.complete:
            return self.report
        self.datasets.hold(self.local)
        try:
            with unwrap_single_group():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._tracker, nursery)
                    nursery.start_soon(self._progress)
                    await self._done.wait()
                    nursery.cancel_scope.cancel()
        finally:
            self.report.seconds = trio.current_time() - start
        return self.report

    # ------------------------------------------------------------------ seeders

    def asked_by(self, peer: ID) -> None:
        """``peer`` asked us for this dataset (it fetches it too): a seeder for us as soon as it holds a piece,
        known before its tracker record is read (BitTorrent's connections work both ways alike)."""
        if peer not in self.table.known:
            self.table.learn(peer, whole=False)  # (never ourselves: the table knows who we are)
            self._wake()

    async def _tracker(self, nursery: trio.Nursery) -> None:
        read_at = -1e9
        interval = 1.0
        alone_since = trio.current_time()
        while True:
            now = trio.current_time()
            if now - read_at >= interval:
                read_at = now
                try:
                    found = await self.datasets.seeders(self.dataset)
                except DedlocError as e:
                    log.info("datasets: reading the tracker failed: %s", e)
                    found = []
                new = False
                for s in found:
                    if s.peer_id == self.peer.peer_id:
                        continue
                    new = new or s.peer_id not in self.table.known
                    self.table.learn(s.peer_id, whole=bool(s.whole))
                    if s.addrs:
                        self.addrs[s.peer_id] = s.addrs
                interval = 1.0 if new else min(self.config.tracker_interval, interval * 2)
            for peer in self.table.to_connect(trio.current_time()):
                nursery.start_soon(self._seeder, peer)
            if self.table.count(SeederState.CONNECTED):
                alone_since = trio.current_time()
            elif self.config.no_seeder_timeout and trio.current_time() - alone_since > self.config.no_seeder_timeout:
                why = "; ".join(f"{p}: {k.why}" for p, k in list(self.table.known.items())[:5] if k.why)
                raise NoSeeders(f"no seeder of {self.name} reached in {self.config.no_seeder_timeout:g} s"
                                + (f" ({why})" if why else " (none in the tracker)"))
            with trio.move_on_after(min(1.0, interval)):
                await self._changed.wait()

    async def _seeder(self, peer: ID) -> None:
        stream: INetStream | None = None
        why = "closed"
        try:
            if peer in self.addrs:
                self.peer.add_addrs(peer, self.addrs[peer])
            with trio.fail_after(self.config.connect_timeout):
                stream = await self.peer.new_stream(peer, PROTOCOL)
            if not self.config.table.allow_relayed and self.peer.path_to(peer) != "direct":
                self.table.relayed(peer, trio.current_time())
                return
            self.table.connected(peer)
            if self.report.first_seeder_s is None:
                self.report.first_seeder_s = trio.current_time() - self._start
            with unwrap_single_group():
                await self._exchange(peer, stream)
        except trio.TooSlowError as e:  # the stall's says how long; the connect timeout's is bare
            why = str(e) or "no answer in time"
        except (DedlocError, OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError, StreamError) as e:
            why = str(e) or type(e).__name__
        except ExceptionGroup as group:  # the writer and the reader failed at once (the stream broke)
            why = "; ".join(str(e) or type(e).__name__ for e in group.exceptions)
        finally:
            self.picker.lost(peer)
            if self.table.state(peer) == SeederState.CONNECTED:
                self.table.failed(peer, trio.current_time(), why)
            if stream is not None:
                await finish_quietly(stream.reset)
            self._wake()

    async def _exchange(self, peer: ID, stream: INetStream) -> None:
        outstanding: deque[PieceKey] = deque()
        asked = trio.Event()

        async def writer() -> None:
            nonlocal asked
            have_at = -1e9
            while True:
                now = trio.current_time()
                if now - have_at >= self.config.have_interval:
                    have_at = now
                    outstanding.append(_HAVE)
                    await stream.write(frame(pb.Request(kind=pb.Request.HAVE, dataset=self.dataset)))
                    asked.set()
                    continue
                key = self.picker.pick(peer, now)
                if key is None:
                    with trio.move_on_after(max(0.05, have_at + self.config.have_interval - now)):
                        await self._changed.wait()
                    continue
                shard = self.shards[key[0]]
                request = (pb.Request(kind=pb.Request.LEAVES, dataset=self.dataset, shard=shard.root)
                           if key[1] == LEAVES else
                           pb.Request(kind=pb.Request.PIECE, dataset=self.dataset, shard=shard.root, index=key[1],
                                      held_permille=self._held_permille()))
                outstanding.append(key)
                await stream.write(frame(request))
                asked.set()

        async def reader() -> None:
            nonlocal asked
            frames = FrameReader(stream)
            while True:
                if not outstanding:
                    asked = trio.Event()
                    await asked.wait()
                with trio.CancelScope(deadline=trio.current_time() + self.config.stall_timeout) as scope:
                    frames.watch(scope, self.config.stall_timeout)
                    answer = await frames.message(pb.Answer, "dataset answer", max_size=MAX_HEADER)
                    key = outstanding.popleft()
                    limit = self._limit(key)
                    if answer.size > limit:
                        raise RemoteProtocolError(f"an answer of {answer.size} bytes where at most {limit} fit")
                    data = await frames.exactly(answer.size) if answer.size else b""
                if scope.cancelled_caught:
                    raise trio.TooSlowError(f"no answer for {self.config.stall_timeout:g} s")
                self._take(peer, key, answer, data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            nursery.start_soon(reader)

    def _held_permille(self) -> int:
        total = self.total
        return 1000 if not total else min(1000, self._held * 1000 // total)

    def _limit(self, key: PieceKey) -> int:
        if key == _HAVE:
            return 0
        shard = self.shards[key[0]]
        if key[1] == LEAVES:
            return piece_count(shard.size, self.local.piece_size) * HASH_SIZE
        return self.local.piece_size

    def _take(self, peer: ID, key: PieceKey, answer: pb.Answer, data: bytes) -> None:
        """One answer, in the order asked: checked, written, told to the picker."""
        now = trio.current_time()
        if answer.status == pb.Answer.BUSY:
            raise _Busy(answer.reason or "busy")
        if key == _HAVE:
            if answer.status == pb.Answer.OK:
                for have in answer.have:
                    i = self.index.get(bytes(have.root))
                    if i is not None:
                        self.picker.update(peer, i, from_bits(bytes(have.bits), self.picker.pieces[i]))
                self._wake()
            return
        if answer.status != pb.Answer.OK:
            self.picker.failed(peer, key, now)
            self._wake()
            return
        shard = self.shards[key[0]]
        if key[1] == LEAVES:
            leaves = check_leaves(data, shard.root, shard.size, self.local.piece_size)
            if isinstance(leaves, str):
                self._ban(peer, f"{shard.path}: {leaves}")
            if self.picker.received(peer, key, now, len(data)):
                self.local.set_leaves(shard.root, leaves)
            self._wake()
            return
        if shard.root not in self.local.leaves:
            self.picker.returned(peer, key)  # asked in the endgame before the leaves came: ask again
            return
        bad = self.local.check_piece(shard.root, key[1], data)
        if bad is not None:
            self._ban(peer, bad)
        if not self.picker.received(peer, key, now, len(data)):
            self.report.duplicates += 1
            self._wake()
            return
        if self.report.first_piece_s is None:
            self.report.first_piece_s = now - self._start
        self.report.bytes += len(data)
        self.report.sources[peer] = self.report.sources.get(peer, 0) + len(data)
        self._rate_bytes.append((now, len(data)))
        whole = self.local.write_piece(shard.root, key[1], data)
        self._held += len(data)
        first = self.report.bytes == len(data)  # our first piece: the others can find us now
        if whole or first:
            self.datasets.announce_soon(self.dataset)
        if whole:
            self.peer.emit(ev.ShardFetched(name=self.name, path=shard.path, bytes=shard.size))
            if self.on_shard is not None:
                self.on_shard(shard)
        if self.picker.complete:
            self._done.set()
        self._wake()

    def _ban(self, peer: ID, reason: str) -> NoReturn:
        """Ban ``peer`` for this dataset, say so, and end its exchange."""
        self.picker.ban(peer, reason)
        self.table.ban(peer, reason)
        self.report.banned[peer] = reason
        log.warning("datasets: %s: seeder %s banned: %s", self.name, peer, reason)
        self.peer.emit(ev.SeederBanned(name=self.name, peer_id=str(peer), reason=reason))
        raise _Banned(reason)

    # ------------------------------------------------------------------ progress

    def rate(self, now: float, window: float = 5.0) -> float:
        while self._rate_bytes and self._rate_bytes[0][0] < now - window:
            self._rate_bytes.popleft()
        return sum(n for _, n in self._rate_bytes) / window

    def progress(self) -> ev.DatasetProgress:
        return ev.DatasetProgress(name=self.name, held=self.local.held_bytes, total=sum(s.size for s in self.shards),
                                  rate=self.rate(trio.current_time()), seeders=self.table.count(SeederState.CONNECTED),
                                  shards_done=sum(1 for s in self.shards if s.root in self.local.whole),
                                  shards=len(self.shards), banned=len(self.report.banned))

    async def _progress(self) -> None:
        while True:
            await trio.sleep(self.config.progress_interval)
            self.peer.emit(self.progress())


class _Busy(DedlocError):
    """The seeder's upload slots are all in use."""


class _Banned(DedlocError):
    """The seeder sent a bad piece (its stream is closed)."""


__all__ = ["Download", "FetchConfig", "FetchReport", "NoSeeders"]
