"""Beam search alone (training/moe/beam_search.py), over a stand-in DHT and a clock of the test's own:
what a prefix's record is read as, which extensions a beam keeps, what the cache keeps and for how
long, and what a search over a whole grid returns and notes when it leaves experts out.

The search over real servers (and servers that die) stays in tests/test_moe.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.dht.records import KeyLike, ValueWithExpiration
from training.moe.beam_search import Beam, BeamSearcher, Successors, parse_successors, select
from training.moe.grid import coordinate_subkey, prefix_key
from training.moe.protocol import Expert
from training.proto import moe_pb2 as pb

from .kit import random_peer_id

EXPIRES = 1e12
A, B, C = random_peer_id(), random_peer_id(), random_peer_id()


def info(uid: str, *addrs: Multiaddr) -> ValueWithExpiration:
    return ValueWithExpiration(pb.ExpertInfo(uid=uid, addrs=[a.to_bytes() for a in addrs]).SerializeToString(), EXPIRES)


def prefix_record(prefix: str, coords: tuple[int, ...], *declared: tuple[int, ID]) -> ValueWithExpiration:
    """What a prefix key holds: each (coordinate, server) declared, with the uid of the expert under it
    (the full uid at the last dimension; here the prefix's extension, as servers write it)."""
    return ValueWithExpiration({coordinate_subkey(coord, server): info(prefix_key(prefix, (*coords, coord)))
                                for coord, server in declared}, EXPIRES)


class StandInDHT:
    """``get_many`` over a dict of records; records each read. A key in ``failing`` is left out of the
    answer (its read failed); with ``hang`` the read never ends."""

    def __init__(self, records: dict[str, ValueWithExpiration] | None = None) -> None:
        self.records = records or {}
        self.failing: set[str] = set()
        self.hang = False
        self.reads: list[list[KeyLike]] = []
        self.timeouts: list[float | None] = []

    async def get_many(self, keys: Iterable[KeyLike], latest: bool = False, *,
                       timeout: float | None = None) -> dict[KeyLike, ValueWithExpiration | None]:
        keys = list(keys)
        self.reads.append(keys)
        self.timeouts.append(timeout)
        assert not latest  # the first copy found (the module docstring says why)
        await trio.lowlevel.checkpoint()
        if self.hang:
            await trio.sleep_forever()
        return {k: self.records.get(str(k)) for k in keys if k not in self.failing}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def searcher(dht: StandInDHT, clock: Clock, grid: tuple[int, ...] = (4, 4), **kw: object) -> BeamSearcher:
    return BeamSearcher(dht, "ffn", grid, clock=clock, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- parse_successors


def test_a_prefix_record_is_read_as_coordinates_and_their_servers() -> None:
    here = Multiaddr("/ip4/127.0.0.2/tcp/4001")
    record = ValueWithExpiration({
        coordinate_subkey(1, A): info("ffn.1", here),
        coordinate_subkey(1, B): info("ffn.1"),
        coordinate_subkey(3, A): info("ffn.3"),
    }, EXPIRES)
    assert parse_successors(record) == {1: [Expert("ffn.1", A, (here,)), Expert("ffn.1", B)], 3: [Expert("ffn.3", A)]}
    assert parse_successors(None) == {}
    assert parse_successors(ValueWithExpiration(b"a plain value", EXPIRES)) == {}


def test_whatever_else_is_under_a_prefix_is_skipped() -> None:
    good: dict[KeyLike, ValueWithExpiration] = {coordinate_subkey(2, A): info("ffn.2")}
    garbage: dict[KeyLike, ValueWithExpiration] = {
        "2": info("ffn.2"),  # no owner
        b"2[owner:x]": info("ffn.2"),  # not a string
        coordinate_subkey(1, B): ValueWithExpiration({}, EXPIRES),  # not bytes
        coordinate_subkey(3, B): ValueWithExpiration(b"\xff\xff\xff", EXPIRES),  # not an ExpertInfo
    }
    assert parse_successors(ValueWithExpiration({**garbage, **good}, EXPIRES)) == {2: [Expert("ffn.2", A)]}
    # of a server's addresses, those among its first 16 that parse are kept; the expert is kept
    many = [Multiaddr(f"/ip4/127.0.0.{i}/tcp/4001") for i in range(1, 21)]
    declared = pb.ExpertInfo(uid="ffn.0", addrs=[b"\xff", many[0].to_bytes(), b""] + [a.to_bytes() for a in many[1:]])
    record = ValueWithExpiration({coordinate_subkey(0, C): ValueWithExpiration(declared.SerializeToString(), EXPIRES)},
                                 EXPIRES)
    (expert,) = parse_successors(record)[0]
    assert expert == Expert("ffn.0", C, tuple(many[:14]))
    assert str(expert.addrs[0]) == "/ip4/127.0.0.1/tcp/4001"


# ---------------------------------------------------------------------- select


def test_select_scores_each_extension_by_its_beam_and_keeps_the_best() -> None:
    scores = torch.tensor([0.5, 4.0, 1.0, 2.0])
    beams = [Beam(10.0, (0,)), Beam(1.0, (2,)), Beam(5.0, (9,))]
    live: dict[tuple[int, ...], Successors] = {(0,): {0: [Expert("x", A)], 2: [Expert("x", A)]},
                                               (2,): {1: [Expert("x", B)]}}
    out = select(scores, beams, live, 5)
    assert [(b.coords, b.score) for b in out] == [((0, 2), 11.0), ((0, 0), 10.5), ((2, 1), 5.0)]
    assert out[0].experts == [Expert("x", A)]
    assert [b.coords for b in select(scores, beams, live, 2)] == [(0, 2), (0, 0)]
    assert select(scores, beams, live, 0) == []
    assert select(scores, beams, {}, 5) == []


def test_select_leaves_out_coordinates_past_the_grid_wrong_uids_and_banned_servers() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0])
    live: dict[tuple[int, ...], Successors] = {
        (): {2: [Expert("ffn.2", A)], 3: [Expert("ffn.3", A)], 1: [Expert("ffn.0", A), Expert("ffn.1", B)]}}
    assert [b.coords for b in select(scores, [Beam(0.0, ())], live, 5)] == [(2,), (1,)]  # 3 is past [0, 3)
    by_uid = select(scores, [Beam(0.0, ())], live, 5, prefix="ffn")
    assert [(b.coords, b.experts) for b in by_uid] == [((2,), [Expert("ffn.2", A)]), ((1,), [Expert("ffn.1", B)])]
    not_a = select(scores, [Beam(0.0, ())], live, 5, usable=lambda e: e.peer_id != A)
    assert [(b.coords, b.experts) for b in not_a] == [((1,), [Expert("ffn.1", B)])]
    # without ``prefix`` the records are not checked against their coordinates (inner dimensions)
    assert select(scores, [Beam(0.0, ())], live, 5)[1].experts == [Expert("ffn.0", A), Expert("ffn.1", B)]


# ---------------------------------------------------------------------- the cache


async def test_a_read_prefix_is_kept_for_the_cache_ttl_and_an_empty_one_for_the_empty_ttl() -> None:
    dht = StandInDHT({"ffn": prefix_record("ffn", (), (1, A))})
    clock = Clock()
    bs = searcher(dht, clock, cache_ttl=10.0, empty_ttl=2.0)
    first = await bs.successors([(), (), (3,)])
    assert first == {(): {1: [Expert("ffn.1", A)]}, (3,): {}}
    assert dht.reads == [["ffn", "ffn.3"]]  # one read of the prefixes, each once
    assert (bs.stats.reads, bs.stats.keys_read, bs.stats.cache_hits) == (1, 2, 0)

    clock.now += 1.999
    assert await bs.successors([(), (3,)]) == first
    assert len(dht.reads) == 1 and bs.stats.cache_hits == 2
    clock.now += 0.001  # the empty prefix is 2 s old: read again; the other is kept
    await bs.successors([(), (3,)])
    assert dht.reads[1:] == [["ffn.3"]] and bs.stats.cache_hits == 3
    clock.now += 7.999
    await bs.successors([()])
    assert len(dht.reads) == 2
    clock.now += 0.001  # ten seconds
    await bs.successors([()])
    assert dht.reads[2:] == [["ffn"]]
    assert (bs.stats.reads, bs.stats.keys_read) == (3, 4)
    bs.forget()
    await bs.successors([()])
    assert len(dht.reads) == 4


def test_an_empty_prefix_is_never_kept_longer_than_a_full_one() -> None:
    assert searcher(StandInDHT(), Clock(), cache_ttl=1.0, empty_ttl=5.0).empty_ttl == 1.0
    defaults = searcher(StandInDHT(), Clock())
    assert (defaults.cache_ttl, defaults.empty_ttl, defaults.read_timeout) == (15.0, 2.0, 5.0)


async def test_a_failed_read_is_counted_and_not_remembered() -> None:
    dht = StandInDHT({"ffn.1": prefix_record("ffn", (1,), (0, A))})
    dht.failing.update(("ffn.1", "ffn.3"))
    bs = searcher(dht, Clock(), read_timeout=4.0)
    outcome = bs.last
    assert await bs.successors([(1,), (2,), (3,)], outcome) == {(1,): {}, (2,): {}, (3,): {}}
    assert outcome.unread == 2
    assert dht.timeouts == [4.0]
    dht.failing.discard("ffn.3")
    assert await bs.successors([(1,), (2,)]) == {(1,): {}, (2,): {}}  # no outcome: nothing to count in
    assert dht.reads[1] == ["ffn.1"]  # read again: the empty (2,) is cached, the failed (1,) is not
    dht.failing.clear()
    assert await bs.successors([(1,)]) == {(1,): {0: [Expert("ffn.1.0", A)]}}


async def test_a_read_that_hangs_is_given_up_on_at_the_read_timeout(autojump_clock: trio.abc.Clock) -> None:
    dht = StandInDHT({"ffn": prefix_record("ffn", (), (1, A))})
    dht.hang = True
    bs = searcher(dht, Clock(), read_timeout=3.0)
    start = trio.current_time()
    outcome = bs.last
    assert await bs.successors([()], outcome) == {(): {}}
    assert trio.current_time() - start == pytest.approx(3.0)
    assert outcome.unread == 1
    dht.hang = False
    assert await bs.successors([()]) == {(): {1: [Expert("ffn.1", A)]}}


async def test_the_cache_is_bounded() -> None:
    dht = StandInDHT()
    bs = searcher(dht, Clock())
    await bs.successors([(0,)])
    bs._cache.update({(i, i): ({}, 0.0) for i in range(99_999)})
    await bs.successors([(1,)])  # 100,000 entries: not yet
    assert len(bs._cache) == 100_001
    await bs.successors([(2,)])  # over the bound: dropped whole, then this read kept
    assert list(bs._cache) == [(2,)]


# ---------------------------------------------------------------------- a whole search


def grid_records(*servers: tuple[ID, tuple[int, int]]) -> dict[str, ValueWithExpiration]:
    """The records of a 2-D grid "ffn" where each (server, (i, j)) serves expert ffn.i.j: as servers
    declare them (``ExpertServer.declare``), each naming under a prefix the first of its experts there."""
    outer: dict[KeyLike, ValueWithExpiration] = {}
    inner: dict[str, dict[KeyLike, ValueWithExpiration]] = {}
    for server, (i, j) in servers:
        outer.setdefault(coordinate_subkey(i, server), info(f"ffn.{i}.{j}"))
        inner.setdefault(f"ffn.{i}", {})[coordinate_subkey(j, server)] = info(f"ffn.{i}.{j}")
    records = {"ffn": ValueWithExpiration(outer, EXPIRES)}
    records.update({k: ValueWithExpiration(v, EXPIRES) for k, v in inner.items()})
    return records


async def test_a_search_finds_each_sample_s_best_live_experts() -> None:
    dht = StandInDHT(grid_records((A, (0, 0)), (A, (0, 3)), (B, (2, 1)), (C, (3, 3))))
    bs = searcher(dht, Clock())
    rows = torch.tensor([[0.0, 0.0, 0.0, 5.0], [5.0, 0.0, 1.0, 0.0]])  # dimension 0: sample 0 likes 3, 1 likes 0
    cols = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    found = await bs.search([rows, cols], k=2)
    assert [[(b.coords, b.score) for b in sample] for sample in found] == [
        [((3, 3), 5.0), ((0, 0), 1.0)],
        [((0, 3), 7.0), ((0, 0), 5.0)],
    ]
    assert found[0][0].experts == [Expert("ffn.3.3", C)]
    # dimension 0 read the grid's prefix; dimension 1 the union of every sample's beams, once
    assert dht.reads == [["ffn"], ["ffn.3", "ffn.0", "ffn.2"]]
    assert bs.stats.searches == 1


async def test_a_wider_beam_finds_an_expert_a_narrow_one_passes_by() -> None:
    records = grid_records((A, (0, 0)), (A, (0, 3)), (B, (2, 1)), (C, (3, 3)))
    rows, cols = torch.tensor([[4.0, 0.0, 0.0, 5.0]]), torch.tensor([[3.0, 0.0, 0.0, 0.0]])
    # one wide: row 3 (5) beats row 0 (4), and row 3 holds only (3, 3): 5 in all
    narrow = await searcher(StandInDHT(records), Clock()).search([rows, cols], k=1)
    assert [(b.coords, b.score) for b in narrow[0]] == [((3, 3), 5.0)]
    # two wide: row 0 stays in, and (0, 0) scores 4 + 3
    wide = await searcher(StandInDHT(records), Clock()).search([rows, cols], k=1, beam_size=2)
    assert [(b.coords, b.score) for b in wide[0]] == [((0, 0), 7.0)]
    assert await searcher(StandInDHT(records), Clock()).search([rows, cols], k=1, beam_size=0) == narrow


async def test_a_search_says_which_experts_it_left_out() -> None:
    dht = StandInDHT(grid_records((A, (0, 0)), (B, (1, 0)), (C, (1, 1))))
    bs = searcher(dht, Clock(), usable=lambda e: e.peer_id != C, reachable=lambda p: p != B)
    rows = torch.tensor([[0.0, 9.0]])
    cols = torch.tensor([[0.0, 9.0]])
    found = await bs.search([rows, cols], k=2)
    # row 1 was declared by B (unreachable: not taken for the row) and C; at the last dimension only
    # bans count: C's (1, 1) is left out, B's (1, 0) is found
    assert [[(b.coords, b.experts) for b in s] for s in found] == [
        [((1, 0), [Expert("ffn.1.0", B)]), ((0, 0), [Expert("ffn.0.0", A)])]]
    assert bs.last.left_out == {Expert("ffn.1.0", B), Expert("ffn.1.1", C)}
    assert bs.last.unread == 0
    # a row only unreachable servers declared is passed over: no beam ends there with no expert
    only_b = searcher(StandInDHT(dht.records), Clock(), reachable=lambda p: p not in (B, C))
    assert [[b.coords for b in s] for s in await only_b.search([rows, cols], k=2)] == [[(0, 0)]]
    # each search notes afresh
    dht.failing.add("ffn.0")
    bs.forget()
    await bs.search([rows, torch.tensor([[0.0, 0.0]])], k=2)
    assert bs.last.unread == 1 and bs.last.left_out == {Expert("ffn.1.0", B), Expert("ffn.1.1", C)}
    assert bs.stats.searches == 2


async def test_a_one_dimensional_grid_and_a_lying_record() -> None:
    """A record under the last prefix that names another expert than its coordinates' is not taken."""
    dht = StandInDHT({"ffn": ValueWithExpiration({
        coordinate_subkey(0, A): info("ffn.0"), coordinate_subkey(1, B): info("ffn.0"),
        coordinate_subkey(2, C): info("ffn.2")}, EXPIRES)})
    bs = searcher(dht, Clock(), grid=(3,))
    found = await bs.search([torch.tensor([[1.0, 9.0, 2.0], [5.0, 0.0, 0.0]])], k=3)
    assert [[(b.coords, b.experts) for b in s] for s in found] == [
        [((2,), [Expert("ffn.2", C)]), ((0,), [Expert("ffn.0", A)])],
        [((0,), [Expert("ffn.0", A)]), ((2,), [Expert("ffn.2", C)])]]


async def test_a_search_needs_one_score_tensor_per_dimension() -> None:
    bs = searcher(StandInDHT(), Clock(), grid=(4, 4, 4))
    with pytest.raises(ValueError, match="^2 score tensors for a 3-dimensional grid$"):
        await bs.search([torch.zeros(1, 4), torch.zeros(1, 4)], k=1)
