"""training/datasets/fetch.py, one download, with the test as every seeder and as the tracker.

The downloader is a real :class:`Download` on the in-memory swarm (tests/fake_swarm.py) under trio's
autojump clock, writing into a real directory; the tracker is a script (:class:`Tracker`) and each
seeder a stream handler the test writes (:class:`Seeder`): it reads every request and answers it
byte for byte, honestly or as the test says (a bad piece, bad leaves, too many bytes, BUSY, nothing
at all). What is checked is the downloader's side: what it asks and in which order, what it
writes, whom it bans and why, what it reports, announces and emits, and when it gives up. The same
downloads between real peers are tests/test_datasets_swarm.py's.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from averaging.wire import FrameReader, frame
from p2p.errors import DedlocError
from p2p.events import Event
from p2p.varint import decode_varint
from training.datasets import events as ev
from training.datasets.fetch import Download, FetchConfig, FetchReport, NoSeeders
from training.datasets.manifest import Shard
from training.datasets.picker import PickerConfig, SeederState, TableConfig
from training.datasets.pieces import piece_count
from training.datasets.service import MAX_HEADER, PROTOCOL, SeederInfo
from training.datasets.store import LocalDataset, _bits
from training.proto import datasets_pb2 as pb

from .fake_swarm import FakeSwarm, fake_swarms
from .kit import log_lines, numbered_peer_id
from .test_datasets import NOW, PIECE, leaves_of, manifest_of, shard

LOG = "training.datasets.fetch"
RNG = random.Random(7)
#: two shards: a.txt of four pieces (the last short), b.txt of two
FILES = {"a.txt": RNG.randbytes(3 * PIECE + 100), "b.txt": RNG.randbytes(PIECE + 7)}


# ---------------------------------------------------------------------------- the tracker and the seeders


class Tracker:
    """The :class:`~training.datasets.service.Datasets` service as a download uses it."""

    def __init__(self, peer: FakeSwarm) -> None:
        self.peer = peer
        self.found: list[SeederInfo] = []
        self.reads: list[float] = []
        self.fail: DedlocError | None = None
        self.held: list[LocalDataset] = []
        self.announced: list[bytes] = []

    def hold(self, local: LocalDataset) -> None:
        self.held.append(local)

    async def seeders(self, dataset: bytes) -> list[SeederInfo]:
        await trio.lowlevel.checkpoint()
        self.reads.append(trio.current_time())
        if self.fail is not None:
            raise self.fail
        return list(self.found)

    def announce_soon(self, dataset: bytes) -> None:
        self.announced.append(dataset)


def info(peer: FakeSwarm, *, whole: bool = True, addrs: list[Multiaddr] | None = None) -> SeederInfo:
    return SeederInfo(peer.peer_id, addrs or [], frozenset([b"x"]) if whole else frozenset(), frozenset(), 0, NOW)


Answer = tuple[pb.Answer, bytes]
#: what a seeder does with one request: an answer (and its bytes), or one of these words
STALL, CLOSE = "stall", "close"
Script = Callable[[pb.Request, "Seeder"], Answer | str | None]


def on(kind: int, answer: Answer | str, index: int | None = None) -> Script:
    """A script that gives ``answer`` to every request of ``kind`` (of piece ``index`` only, where given)
    and answers the others honestly."""

    def script(request: pb.Request, seeder: Seeder) -> Answer | str | None:
        return answer if request.kind == kind and index in (None, request.index) else None

    return script


@dataclass
class Seeder:
    """A seeder the test plays on ``swarm``: it holds ``pieces`` (root -> piece indices; None: every
    piece of every shard) and answers each request in order, as ``script`` says (None: honestly)."""

    swarm: FakeSwarm
    shards: list[Shard]
    pieces: dict[bytes, set[int]] | None = None
    script: Script | None = None
    requests: list[pb.Request] = field(default_factory=list)
    streams: int = 0
    #: trio times of the requests, the server ends of the streams, and the most requests seen waiting
    times: list[float] = field(default_factory=list)
    ends: list[Any] = field(default_factory=list)
    delay: float = 0.0
    waiting: int = 0

    def __post_init__(self) -> None:
        self.swarm.set_stream_handler(PROTOCOL, self.serve)

    def data(self, root: bytes) -> bytes:
        return next(FILES[s.path] for s in self.shards if s.root == root)

    def honest(self, request: pb.Request) -> Answer:
        if request.kind == pb.Request.HAVE:
            have = []
            for s in self.shards:
                count = piece_count(s.size, PIECE)
                held = set(range(count)) if self.pieces is None else self.pieces.get(s.root, set())
                if held:
                    have.append(pb.ShardHave(root=s.root, bits=b"" if len(held) == count else _bits(held, count)))
            return pb.Answer(status=pb.Answer.OK, have=have), b""
        data = self.data(request.shard)
        if request.kind == pb.Request.LEAVES:
            body = b"".join(leaves_of(data))
        else:
            body = data[request.index * PIECE:(request.index + 1) * PIECE]
        return pb.Answer(status=pb.Answer.OK, size=len(body)), body

    async def serve(self, stream: INetStream) -> None:
        self.streams += 1
        self.ends.append(stream)
        reader = FrameReader(stream)
        while True:
            try:
                request = await reader.message(pb.Request, "request", max_size=MAX_HEADER)
            except Exception:
                return
            self.requests.append(request)
            self.times.append(trio.current_time())
            if self.delay and request.kind == pb.Request.PIECE:
                await trio.sleep(self.delay)  # the requests sent meanwhile wait in the stream
                self.waiting = max(self.waiting, 1 + frames_in(bytes(reader._buf) + bytes(stream._in.buffer)))  # type: ignore[attr-defined]
            answer = self.script(request, self) if self.script is not None else None
            if answer == STALL:
                await trio.sleep_forever()
            if answer == CLOSE:
                await stream.close()
                return
            head, body = self.honest(request) if answer is None else cast(Answer, answer)
            await stream.write((b"" if head is None else frame(head)) + body)  # no head: raw bytes

    def asked(self, kind: int) -> list[tuple[str, int]]:
        """The requests of one kind, as (shard path, index)."""
        paths = {s.root: s.path for s in self.shards}
        return [(paths.get(r.shard, "?"), r.index) for r in self.requests if r.kind == kind]


def frames_in(data: bytes) -> int:
    """Whole PIECE requests in ``data``."""
    count, pos = 0, 0
    while (decoded := decode_varint(data, pos)) is not None and decoded[1] + decoded[0] <= len(data):
        length, start = decoded
        count += pb.Request.FromString(data[start:start + length]).kind == pb.Request.PIECE
        pos = start + length
    return count


@dataclass
class Harness:
    download: Download
    tracker: Tracker
    local: LocalDataset
    peers: list[FakeSwarm]
    shards: list[Shard]
    directory: Path
    paths: dict[ID, str]

    @property
    def me(self) -> FakeSwarm:
        return self.peers[0]

    def seeder(self, i: int, **kw: Any) -> Seeder:
        """Peer ``i`` as a seeder, in the tracker."""
        seeder = Seeder(self.peers[i], self.shards, **kw)
        self.tracker.found.append(info(self.peers[i]))
        return seeder

    async def run(self, limit: float = 300.0) -> FetchReport:
        with trio.fail_after(limit):
            return await self.download.run()


@asynccontextmanager
async def harness(tmp_path: Path, n: int = 3, files: dict[str, bytes] = FILES, **config: Any
                  ) -> AsyncIterator[Harness]:
    manifest = manifest_of(files)
    directory = tmp_path / "get"
    local = LocalDataset.open(directory, manifest)
    async with fake_swarms(n) as peers:
        await trio.sleep(5)  # the clock is well past 0: a sum where a difference belongs shows
        tracker = Tracker(peers[0])
        shards = sorted(manifest.shards(), key=lambda s: s.path)
        download = Download(cast(Any, tracker), local, FetchConfig(**config), rng=random.Random(1))
        yield Harness(download, tracker, local, peers, shards, directory, peers[0].paths)


@asynccontextmanager
async def running(h: Harness, limit: float = 120.0) -> AsyncIterator[None]:
    """The download runs in the background during the block; after it, it must finish within ``limit``."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.download.run)
        yield
        with trio.fail_after(limit):
            await h.download._done.wait()


def events(peer: FakeSwarm, kind: type[Event]) -> list[Any]:
    return [e for e in peer.events if isinstance(e, kind)]


# ---------------------------------------------------------------------------- a whole download


async def test_one_seeder_brings_every_piece_checked_and_each_shard_reaches_its_path(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    got: list[str] = []
    async with harness(tmp_path) as h:
        h.download.on_shard = lambda s: got.append(s.path)
        seeder = h.seeder(1)
        report = await h.run()
        for path, data in FILES.items():
            assert (h.directory / path).read_bytes() == data
        total = sum(len(d) for d in FILES.values())
        assert (report.bytes, report.sources, report.banned, report.duplicates) == (
            total, {h.peers[1].peer_id: total}, {}, 0)
        assert report.first_seeder_s == 0.0 and report.first_piece_s == 0.0
        assert report.seconds == 0.0
        assert h.tracker.held == [h.local]
        assert sorted(got) == ["a.txt", "b.txt"]
        assert sorted(e.path for e in events(h.me, ev.ShardFetched)) == ["a.txt", "b.txt"]
        assert [e.bytes for e in events(h.me, ev.ShardFetched) if e.path == "a.txt"] == [len(FILES["a.txt"])]
        assert all(e.name == "wiki" for e in events(h.me, ev.ShardFetched))
        # announced after its first piece (others can find it now) and after each whole shard
        assert h.tracker.announced == [h.local.manifest.header.id] * 3
        assert seeder.requests[0].kind == pb.Request.HAVE
        assert seeder.requests[0].dataset == h.local.manifest.header.id
        assert sorted(seeder.asked(pb.Request.LEAVES)) == [("a.txt", 0), ("b.txt", 0)]
        assert sorted(seeder.asked(pb.Request.PIECE)) == [("a.txt", i) for i in range(4)] + [("b.txt", 0),
                                                                                               ("b.txt", 1)]
        # the pieces asked say how much the asker holds (the furthest behind is served first)
        permille = [r.held_permille for r in seeder.requests if r.kind == pb.Request.PIECE]
        assert permille[0] == 0 and permille == sorted(permille) and 0 < permille[-1] < 1000
        assert seeder.ends and all(end._in.reset for end in seeder.ends)  # our end reset when done
        assert h.download.table.known[h.peers[1].peer_id].why == "closed"


async def test_a_dataset_already_whole_is_not_fetched(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        for path, data in FILES.items():
            (h.directory / path).write_bytes(data)
        local = LocalDataset.open(h.directory, h.local.manifest)
        download = Download(cast(Any, h.tracker), local)
        report = await download.run()
        assert report == FetchReport() and h.tracker.held == [] and h.tracker.reads == []


async def test_pieces_come_from_the_seeders_that_hold_them(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        a, b = h.shards
        first = h.seeder(1, pieces={a.root: {0, 1}, b.root: {0, 1}})
        second = h.seeder(2, pieces={a.root: {2, 3}})
        report = await h.run()
        assert sorted(first.asked(pb.Request.PIECE)) == [("a.txt", 0), ("a.txt", 1), ("b.txt", 0), ("b.txt", 1)]
        assert sorted(second.asked(pb.Request.PIECE)) == [("a.txt", 2), ("a.txt", 3)]
        assert report.sources == {h.peers[1].peer_id: 2 * PIECE + len(FILES["b.txt"]),
                                  h.peers[2].peer_id: PIECE + 100}
        assert (h.directory / "a.txt").read_bytes() == FILES["a.txt"]


async def test_a_partial_download_resumes_with_the_missing_pieces_only(autojump_clock: trio.abc.Clock,
                                                                        tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        a, b = h.shards
        h.local.set_leaves(a.root, leaves_of(FILES["a.txt"]))
        assert not h.local.write_piece(a.root, 1, FILES["a.txt"][PIECE:2 * PIECE])
        download = Download(cast(Any, h.tracker), LocalDataset.open(h.directory, h.local.manifest))
        seeder = h.seeder(1)
        with trio.fail_after(300):
            await download.run()
        assert ("a.txt", 1) not in seeder.asked(pb.Request.PIECE)
        assert seeder.asked(pb.Request.LEAVES) == [("b.txt", 0)]  # a.txt's leaves are here
        assert len(seeder.asked(pb.Request.PIECE)) == 5
        assert download._held_permille() == 1000


# ---------------------------------------------------------------------------- bad seeders


async def test_a_bad_piece_bans_its_seeder_by_name_and_another_brings_it(
        autojump_clock: trio.abc.Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    liar = on(pb.Request.PIECE, (pb.Answer(status=pb.Answer.OK, size=PIECE), bytes(PIECE)))
    async with harness(tmp_path) as h:
        a, b = h.shards
        bad = h.seeder(1, script=liar)
        with caplog.at_level(logging.WARNING, LOG):
            with trio.fail_after(30):
                while not h.download.report.banned:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(h.download.run)
                        await trio.sleep(5)
                        nursery.cancel_scope.cancel()
        (reason,) = h.download.report.banned.values()
        path, index = bad.asked(pb.Request.PIECE)[0]
        assert reason == f"piece {index} of {path} does not match its hash"
        assert h.download.report.banned == {h.peers[1].peer_id: reason}
        assert [(e.name, e.peer_id, e.reason) for e in events(h.me, ev.SeederBanned)] == [
            ("wiki", str(h.peers[1].peer_id), reason)]
        assert log_lines(caplog, LOG, "datasets:") == [f"datasets: wiki: seeder {h.peers[1].peer_id} banned: {reason}"]
        assert h.download.table.state(h.peers[1].peer_id) == SeederState.BANNED
        assert h.download.table.known[h.peers[1].peer_id].why == reason
        assert h.download.picker.banned() == {h.peers[1].peer_id: reason}
        assert h.download.progress().banned == 1
        asked = len(bad.requests)
        good = h.seeder(2)
        report = await h.run()
        assert len(bad.requests) == asked  # never asked again
        assert report.bytes == sum(len(d) for d in FILES.values())
        assert report.sources == {h.peers[2].peer_id: report.bytes}
        assert len(good.asked(pb.Request.PIECE)) == 6


async def test_leaves_that_do_not_add_up_to_the_root_ban_their_seeder(autojump_clock: trio.abc.Clock,
                                                                     tmp_path: Path) -> None:
    def liar(request: pb.Request, seeder: Seeder) -> Answer | None:
        if request.kind == pb.Request.LEAVES:
            count = piece_count(len(seeder.data(request.shard)), PIECE)
            return pb.Answer(status=pb.Answer.OK, size=count * 32), bytes(count * 32)
        return None

    async with harness(tmp_path / "2", files={"a.txt": FILES["a.txt"]}) as h:
        h.seeder(1, script=on(pb.Request.LEAVES, (pb.Answer(status=pb.Answer.OK), b"")))
        with trio.move_on_after(1):
            await h.download.run()
        assert h.download.report.banned == {
            h.peers[1].peer_id: "a.txt: 0 bytes of piece hashes where the shard has 4 pieces"}
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        h.seeder(1, script=liar)
        async with running(h):
            await trio.sleep(1)
            assert h.download.report.banned
            good = h.seeder(2)
        report = h.download.report
        assert report.banned == {h.peers[1].peer_id: "a.txt: the piece hashes do not add up to the shard's root"}
        assert len(good.asked(pb.Request.LEAVES)) == 1
        assert h.local.leaves[h.shards[0].root] == leaves_of(FILES["a.txt"])


@pytest.mark.parametrize(("kind", "size", "message"), [
    (pb.Request.PIECE, PIECE + 1, f"an answer of {PIECE + 1} bytes where at most {PIECE} fit"),
    (pb.Request.LEAVES, 4 * 32 + 1, f"an answer of {4 * 32 + 1} bytes where at most {4 * 32} fit"),
    (pb.Request.HAVE, 1, "an answer of 1 bytes where at most 0 fit"),
])
async def test_an_answer_larger_than_what_was_asked_fails_the_seeder(
        autojump_clock: trio.abc.Clock, tmp_path: Path, kind: int, size: int, message: str) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        seeder = h.seeder(1, script=on(kind, (pb.Answer(status=pb.Answer.OK, size=size), bytes(size))))
        with trio.move_on_after(1.5):
            await h.download.run()
        known = h.download.table.known[h.peers[1].peer_id]
        assert known.why == message and known.failures == 1
        assert seeder.streams == 1
        assert h.download.report.banned == {}


async def test_a_busy_seeder_is_tried_again_later(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    busy = [True]

    def slots(request: pb.Request, seeder: Seeder) -> Answer | None:
        if busy[0] and request.kind == pb.Request.PIECE:
            return pb.Answer(status=pb.Answer.BUSY, reason="all upload slots in use"), b""
        return None

    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        seeder = h.seeder(1, script=slots)
        async with running(h):
            await trio.sleep(1)
            assert h.download.table.known[h.peers[1].peer_id].why == "all upload slots in use"
            busy[0] = False
        assert seeder.streams >= 2
        assert (h.directory / "a.txt").read_bytes() == FILES["a.txt"]

    async with harness(tmp_path / "2", files={"a.txt": FILES["a.txt"]}) as h:
        h.seeder(1, script=on(pb.Request.PIECE, (pb.Answer(status=pb.Answer.BUSY), b"")))  # no reason given
        with trio.move_on_after(1):
            await h.download.run()
        assert h.download.table.known[h.peers[1].peer_id].why == "busy"


async def test_a_piece_a_seeder_does_not_have_is_asked_of_another(autojump_clock: trio.abc.Clock,
                                                                  tmp_path: Path) -> None:
    missing = on(pb.Request.PIECE, (pb.Answer(status=pb.Answer.NOT_FOUND, reason="gone"), b""), index=2)
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        first = h.seeder(1, script=missing)
        async with running(h):
            await trio.sleep(2)
            assert ("a.txt", 2) in first.asked(pb.Request.PIECE)
            assert not h.download._done.is_set()
            second = h.seeder(2, pieces={h.shards[0].root: {2}})
        report = h.download.report
        assert second.asked(pb.Request.PIECE) == [("a.txt", 2)]
        assert report.sources[h.peers[2].peer_id] == PIECE
        assert report.banned == {}


async def test_a_seeder_that_stalls_is_given_up_after_stall_timeout(autojump_clock: trio.abc.Clock,
                                                                    tmp_path: Path) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}, stall_timeout=7.0) as h:
        h.seeder(1, script=on(pb.Request.PIECE, STALL))
        async with running(h):
            started = trio.current_time()
            await trio.sleep(0.1)
            assert h.download.table.state(h.peers[1].peer_id) == SeederState.CONNECTED
            assert h.download.progress().seeders == 1
            while h.download.table.known[h.peers[1].peer_id].failures == 0:
                await trio.sleep(0.5)
            assert trio.current_time() - started == pytest.approx(7.0, abs=1.01)
            assert h.download.table.known[h.peers[1].peer_id].why == "no answer for 7 s"
            h.seeder(2)


async def test_a_seeder_that_closes_its_stream_costs_only_time(autojump_clock: trio.abc.Clock,
                                                              tmp_path: Path) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        h.seeder(1, script=on(pb.Request.LEAVES, CLOSE))
        with trio.move_on_after(1):
            await h.download.run()
        known = h.download.table.known[h.peers[1].peer_id]
        assert known.failures == 1 and known.why == "the peer closed the stream mid-frame"


async def test_a_seeder_that_cannot_be_reached_in_time_is_retried(autojump_clock: trio.abc.Clock,
                                                                  tmp_path: Path) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}, connect_timeout=3.0) as h:
        seeder = h.seeder(1)

        async def slow_dial(peer_id: ID, protocol: str) -> Any:
            await trio.sleep_forever()

        original = h.me.new_stream
        h.me.new_stream = slow_dial  # type: ignore[method-assign]
        with trio.move_on_after(3.5):
            await h.download.run()
        assert h.download.table.known[h.peers[1].peer_id].why == "no answer in time"
        h.me.new_stream = original  # type: ignore[method-assign]
        await h.run()
        assert seeder.streams == 1
    async with harness(tmp_path / "2", files={"a.txt": FILES["a.txt"]}) as h:
        h.seeder(1)

        async def refused(peer_id: ID, protocol: str) -> Any:
            raise OSError()

        h.me.new_stream = refused  # type: ignore[method-assign]
        with trio.move_on_after(0.5):
            await h.download.run()
        assert h.download.table.known[h.peers[1].peer_id].why == "OSError"


# ---------------------------------------------------------------------------- the tracker


async def test_with_no_seeder_the_download_gives_up_and_says_why(autojump_clock: trio.abc.Clock,
                                                                tmp_path: Path) -> None:
    async with harness(tmp_path, no_seeder_timeout=30.0) as h:
        started = trio.current_time()
        with pytest.raises(NoSeeders, match=r"^no seeder of wiki reached in 30 s \(none in the tracker\)$"):
            await h.run()
        assert 30.0 < trio.current_time() - started <= 31.0
    async with harness(tmp_path / "2", no_seeder_timeout=30.0) as h:
        h.tracker.found = [info(h.peers[1]), info(h.peers[2])]  # nobody serves the protocol there
        with pytest.raises(NoSeeders) as caught:
            await h.run()
        assert str(caught.value).startswith("no seeder of wiki reached in 30 s (")
        assert f"{h.peers[1].peer_id}: " in str(caught.value) and f"; {h.peers[2].peer_id}: " in str(caught.value)


async def test_no_seeder_timeout_zero_waits_for_ever(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with harness(tmp_path, no_seeder_timeout=0.0) as h:
        with trio.move_on_after(500):
            await h.download.run()
        assert h.download.report.seconds == 500.0


async def test_the_tracker_is_read_every_second_while_it_names_new_seeders_then_less_often(
        autojump_clock: trio.abc.Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with harness(tmp_path, tracker_interval=4.0, no_seeder_timeout=0.0) as h:
        with trio.move_on_after(13.5):
            await h.download.run()
        start = h.tracker.reads[0]
        assert [round(t - start, 3) for t in h.tracker.reads] == [0.0, 2.0, 6.0, 10.0]
    async with harness(tmp_path / "2", tracker_interval=4.0, no_seeder_timeout=0.0) as h:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(h.download.run)
            await trio.sleep(3.5)
            h.tracker.found.append(info(h.peers[1]))  # a new seeder (nobody there): the next read is 1 s after
            await trio.sleep(5.0)
            nursery.cancel_scope.cancel()
        start = h.tracker.reads[0]
        assert [round(t - start, 3) for t in h.tracker.reads] == [0.0, 2.0, 6.0, 7.0]
    async with harness(tmp_path / "3", no_seeder_timeout=0.0) as h:
        h.tracker.fail = DedlocError("no DHT peer answered")
        with caplog.at_level(logging.INFO, LOG):
            with trio.move_on_after(0.5):
                await h.download.run()
        assert log_lines(caplog, LOG, "datasets: reading") == [
            "datasets: reading the tracker failed: no DHT peer answered"]


async def test_a_seeder_s_addresses_from_the_tracker_are_learnt_and_our_own_record_is_skipped(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        addr = Multiaddr("/ip4/127.0.0.1/tcp/4001")
        Seeder(h.peers[1], h.shards)
        h.tracker.found = [info(h.me), info(h.peers[1], addrs=[addr], whole=False), info(h.peers[2])]
        await h.run()
        assert h.me.known == {h.peers[1].peer_id: [addr]}
        assert h.download.table.known[h.peers[1].peer_id].whole is False
        assert h.download.table.known[h.peers[2].peer_id].whole is True
        assert h.me.peer_id not in h.download.table.known


async def test_a_relayed_seeder_is_left_for_later_unless_relayed_transfers_are_allowed(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        h.paths[h.peers[1].peer_id] = "relayed"
        seeder = h.seeder(1)
        with trio.move_on_after(1):
            await h.download.run()
        assert seeder.requests == [] and h.download.report.first_seeder_s is None
        assert h.download.table.state(h.peers[1].peer_id) == SeederState.RELAYED
        h.paths[h.peers[1].peer_id] = "direct"  # a hole punch made it direct
        await h.run()
        assert seeder.asked(pb.Request.PIECE)
    async with harness(tmp_path / "2", files={"a.txt": FILES["a.txt"]},
                       table=TableConfig(allow_relayed=True)) as h:
        h.paths[h.peers[1].peer_id] = "relayed"
        h.seeder(1)
        await h.run()


async def test_a_peer_that_asks_us_for_the_dataset_is_a_seeder_before_the_tracker_names_it(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        seeder = Seeder(h.peers[1], h.shards)
        h.download.asked_by(h.me.peer_id)
        assert h.download.table.known == {}
        h.download.asked_by(h.peers[1].peer_id)
        assert h.download.table.known[h.peers[1].peer_id].whole is False
        h.download.table.known[h.peers[1].peer_id].why = "kept"
        h.download.asked_by(h.peers[1].peer_id)  # known already: unchanged
        assert h.download.table.known[h.peers[1].peer_id].why == "kept"
        await h.run()
        assert seeder.asked(pb.Request.PIECE)


# ---------------------------------------------------------------------------- progress


async def test_progress_is_emitted_every_interval_and_the_rate_is_over_a_window(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with harness(tmp_path, progress_interval=2.0, no_seeder_timeout=0.0) as h:
        with trio.move_on_after(5):
            await h.download.run()
        progress = events(h.me, ev.DatasetProgress)
        assert len(progress) == 2
        total = sum(len(d) for d in FILES.values())
        first = progress[0]
        assert (first.name, first.held, first.total, first.rate, first.seeders, first.shards_done, first.shards,
                first.banned) == ("wiki", 0, total, 0.0, 0, 0, 2, 0)
    async with harness(tmp_path / "2") as h:
        h.seeder(1)
        await h.run()
        now = trio.current_time()
        total = sum(len(d) for d in FILES.values())
        assert h.download.rate(now) == total / 5.0
        assert h.download.rate(now, window=10.0) == total / 10.0
        assert h.download.progress().held == total and h.download.progress().shards_done == 2
        assert h.download.rate(now + 5.0) == total / 5.0  # a window's edge still counts
        assert h.download.rate(now + 5.01) == 0.0


def test_how_much_an_answer_may_hold_and_how_much_we_hold(tmp_path: Path) -> None:
    manifest = manifest_of(FILES)
    local = LocalDataset.open(tmp_path / "d", manifest)
    download = Download(cast(Any, SimpleNamespace(peer=SimpleNamespace(peer_id=numbered_peer_id(1)))), local)
    a, b = download.shards
    assert download._limit((-1, -2)) == 0
    assert download._limit((0, -1)) == 4 * 32 and download._limit((1, -1)) == 2 * 32
    assert download._limit((0, 3)) == PIECE
    assert download._held_permille() == 0
    download.total = 2000
    download._held = 999
    assert download._held_permille() == 499
    download._held = 4000
    assert download._held_permille() == 1000
    download.total, download._held = 3, 2
    assert download._held_permille() == 666
    download.total = 0
    assert download._held_permille() == 1000



# ---------------------------------------------------------------------------- settings


async def test_priority_shards_come_first_and_each_whole_shard_is_handed_to_on_shard(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    for first in ("a.txt", "b.txt"):  # either way round, whatever the random order
        got: list[str] = []
        async with harness(tmp_path / first) as h:
            roots = {s.path: s.root for s in h.shards}
            seeder = h.seeder(1)
            download = Download(cast(Any, h.tracker), h.local, priority=[roots[first]], rng=random.Random(1),
                                on_shard=lambda s: got.append(s.path))
            with trio.fail_after(300):
                await download.run()
            assert seeder.asked(pb.Request.LEAVES)[0] == (first, 0)
            assert seeder.asked(pb.Request.PIECE)[0][0] == first
            assert sorted(got) == ["a.txt", "b.txt"]


async def test_a_seeded_download_asks_in_the_same_order_every_time(autojump_clock: trio.abc.Clock,
                                                                   tmp_path: Path) -> None:
    orders = []
    for run in range(2):
        async with harness(tmp_path / str(run)) as h:
            seeder = h.seeder(1)
            download = Download(cast(Any, h.tracker), h.local, rng=random.Random(3))
            with trio.fail_after(300):
                await download.run()
            orders.append(seeder.asked(pb.Request.PIECE))
    assert orders[0] == orders[1]


async def test_the_picker_s_and_the_table_s_settings_are_the_download_s(autojump_clock: trio.abc.Clock,
                                                                        tmp_path: Path) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]},
                       picker=PickerConfig(pipeline=1, pipeline_start=1)) as h:
        seeder = h.seeder(1, delay=1.0)
        await h.run()
        assert seeder.waiting == 1  # one piece asked at a time
    async with harness(tmp_path / "2", files={"a.txt": FILES["a.txt"]}) as h:
        seeder = h.seeder(1, delay=1.0)
        await h.run()
        assert seeder.waiting > 1  # the default pipeline: two to start with, more as the rate is known
    async with harness(tmp_path / "3", table=TableConfig(max_connected=1)) as h:
        first, second = h.seeder(1), h.seeder(2)
        report = await h.run()
        assert len(report.sources) == 1 and (first.streams, second.streams).count(0) == 1


async def test_each_seeder_is_asked_what_it_holds_every_have_interval(autojump_clock: trio.abc.Clock,
                                                                      tmp_path: Path) -> None:
    async with harness(tmp_path, have_interval=1.0, no_seeder_timeout=0.0) as h:
        seeder = h.seeder(1, pieces={})  # holds nothing yet
        with trio.move_on_after(3.5):
            await h.download.run()
        assert all(r.kind == pb.Request.HAVE for r in seeder.requests)
        start = seeder.times[0]
        assert [round(t - start, 6) for t in seeder.times] == [0.0, 1.0, 2.0, 3.0]


async def test_a_large_have_answer_is_read_and_a_garbled_one_fails_the_seeder(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    def large(request: pb.Request, seeder: Seeder) -> Answer | None:
        if request.kind == pb.Request.HAVE:  # many shards we do not want, then ours
            have = [pb.ShardHave(root=bytes([i % 256, i // 256]) * 16) for i in range(300)]
            have += [pb.ShardHave(root=s.root) for s in seeder.shards]
            return pb.Answer(status=pb.Answer.OK, have=have), b""
        return None

    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        h.seeder(1, script=large)
        await h.run()

    garbled = on(pb.Request.HAVE, (cast(Any, None), b"\x03\xff\xff\xff"))  # a header of three bytes that do not parse
    async with harness(tmp_path / "2", files={"a.txt": FILES["a.txt"]}) as h:
        h.seeder(1, script=garbled)
        with trio.move_on_after(0.5):
            await h.download.run()
        assert h.download.table.known[h.peers[1].peer_id].why.startswith("dataset answer does not parse")


async def test_a_download_that_takes_long_with_a_seeder_connected_does_not_give_up(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}, no_seeder_timeout=3.0) as h:
        h.seeder(1, delay=2.0)
        report = await h.run()
        assert report.seconds > 6.0


async def test_the_reasons_of_at_most_five_seeders_are_given(autojump_clock: trio.abc.Clock,
                                                              tmp_path: Path) -> None:
    async with harness(tmp_path, 8, no_seeder_timeout=3.0) as h:
        h.tracker.found = [info(p) for p in h.peers[1:]]  # seven, none of which speaks the protocol
        with pytest.raises(NoSeeders) as caught:
            await h.run()
        named = [p for p in h.peers[1:] if str(p.peer_id) in str(caught.value)]
        assert len(named) == 5 and str(caught.value).count("; ") == 4


async def test_each_answer_is_told_to_the_picker_as_it_came(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with harness(tmp_path, files={"a.txt": FILES["a.txt"]}) as h:
        d, peer = h.download, h.peers[1].peer_id
        (a,) = h.shards
        d.picker.update(peer, 0, None)
        data = FILES["a.txt"]
        ok = pb.Answer(status=pb.Answer.OK)
        # leaves: the picker counts their bytes toward the seeder's rate
        leaves = b"".join(leaves_of(data))
        await trio.sleep(1)
        d._take(peer, (0, -1), ok, leaves)
        assert d.picker.seeders[peer].recent[-1] == (trio.current_time(), len(leaves))
        assert h.local.leaves[a.root] == leaves_of(data)
        # a piece, then the same piece again (an endgame duplicate: dropped and counted)
        await trio.sleep(1)
        d._take(peer, (0, 1), ok, data[PIECE:2 * PIECE])
        assert d.picker.seeders[peer].recent[-1] == (trio.current_time(), PIECE)
        for n in (1, 2):
            d._take(peer, (0, 1), ok, data[PIECE:2 * PIECE])
            assert d.report.duplicates == n
        assert d.report.bytes == PIECE
        # a piece it said it holds, answered NOT_FOUND: released, and nothing of the shard asked of it
        key = d.picker.pick(peer, trio.current_time())
        assert key is not None and key in d.picker.seeders[peer].in_flight
        d._take(peer, key, pb.Answer(status=pb.Answer.NOT_FOUND), b"")
        assert key not in d.picker.seeders[peer].in_flight
        assert not {k for k in d.picker.seeders[peer].keys if k[0] == 0}
        # a piece that came before its shard's leaves (asked in the endgame): released, asked again
        d.picker.update(peer, 0, None)
        key = d.picker.pick(peer, trio.current_time())
        assert key is not None and key[1] >= 0
        del h.local.leaves[a.root]
        d._take(peer, key, ok, data[key[1] * PIECE:(key[1] + 1) * PIECE])
        assert key not in d.picker.seeders[peer].in_flight and d.report.bytes == PIECE
