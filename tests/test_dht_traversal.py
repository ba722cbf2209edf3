"""The sans-I/O traversal that the DHT's I/O shell and the simulator both drive: one request per
peer carrying every search's query, replies taken by the store's rules, failures, first copies."""

from __future__ import annotations

import logging
import random

import pytest

from libp2p.peer.id import ID

from p2p.dht import protocol as wire
from p2p.dht.proto import dht_pb2 as pb
from p2p.dht.records import DHTKey, DHTRecord, LocalStore
from p2p.dht.routing import DHTID, Lookup, PeerInfo
from p2p.dht.traversal import ReplyTimer, Search, Traversal

NOW = 1_000_000.0


def ids(n: int, seed: int = 0) -> list[ID]:
    rng = random.Random(seed)
    return [ID(b"\x00\x24" + rng.randbytes(36)) for _ in range(n)]


def search_for(key: str | None, seeds: list[PeerInfo], *, first_found: bool = False, k: int = 4, alpha: int = 2) -> Search:
    raw = DHTKey.encode(key) if key is not None else None
    target = DHTID.from_key(raw) if raw is not None else DHTID(0)
    found = LocalStore() if raw is not None else None
    return Search(Lookup(target, k, alpha, seeds), raw, first_found=first_found, found=found)


def reply(*results: pb.FindResult) -> pb.FindResponse:
    return pb.FindResponse(server=True, results=list(results))


def entries(peers: list[ID]) -> list[pb.PeerEntry]:
    return [pb.PeerEntry(peer_id=p.to_bytes()) for p in peers]


def test_searches_that_want_the_same_peer_share_one_request_in_order() -> None:
    seeds = [PeerInfo(p) for p in ids(2)]
    a, b = search_for("a", seeds), search_for("b", seeds)
    t = Traversal([a, b], k=4, max_records=10)
    requests = t.requests()
    assert sorted(str(peer.peer_id) for peer, _ in requests) == sorted(str(s.peer_id) for s in seeds)
    assert all(batch == [a, b] for _, batch in requests)
    assert t.in_flight == 2 and not t.done
    assert [q.key for q in (s.query() for s in requests[0][1])] == [a.key, b.key]
    assert t.requests() == []  # alpha (2) in flight for each: nothing more now
    assert t.in_flight == 2


def test_a_target_search_asks_for_its_target_and_a_key_search_for_its_key() -> None:
    s = search_for(None, [])
    assert s.query().target == wire.target_query(s.lookup.target).target and not s.query().key
    r = search_for("x", [], first_found=True)
    assert r.query().key == DHTKey.encode("x") and r.query().first_copy


def test_batches_split_at_the_limit() -> None:
    seeds = [PeerInfo(ids(1)[0])]
    searches = [search_for(f"k{i}", seeds) for i in range(wire.MAX_BATCH + 1)]
    t = Traversal(searches, k=4, max_records=10)
    sizes = sorted(len(batch) for _, batch in t.requests())
    assert sizes == [1, wire.MAX_BATCH] and t.in_flight == 2


def test_a_failed_call_fails_the_peer_in_every_search_it_carried_and_the_traversal_ends() -> None:
    seeds = [PeerInfo(ids(1)[0])]
    a, b = search_for("a", seeds), search_for("b", seeds)
    t = Traversal([a, b], k=4, max_records=10)
    ((peer, batch),) = t.requests()
    t.on_reply(peer, batch, None, NOW)
    assert t.in_flight == 0 and t.done
    assert a.lookup.done and b.lookup.done  # the peer failed in both: no one left to wait for
    assert a.lookup.result() == [] and b.lookup.result() == []


def test_closer_peers_are_followed_and_bounded_by_k() -> None:
    first, *others = ids(12, seed=1)
    s = search_for(None, [PeerInfo(first)], k=4)
    t = Traversal([s], k=4, max_records=10)
    ((peer, batch),) = t.requests()
    t.on_reply(peer, batch, reply(pb.FindResult(closer=entries(others))), NOW)
    asked = {str(p.peer_id) for p, _ in t.requests()}
    assert len(asked) == 2 and asked <= {str(o) for o in others[:4]}  # only k of the reply's peers are taken


def test_a_reply_is_read_only_up_to_k_peers() -> None:
    """Parsing is bounded too: entries past the first k are not read, even when the first k
    bring nothing new (here: the answering peer itself, which the lookup ignores)."""
    first, *others = ids(6, seed=5)
    s = search_for(None, [PeerInfo(first)], k=4)
    t = Traversal([s], k=4, max_records=10)
    ((peer, batch),) = t.requests()
    t.on_reply(peer, batch, reply(pb.FindResult(closer=entries([first] * 4 + others))), NOW)
    assert t.requests() == [] and t.done


def test_records_are_taken_by_the_stores_rules_and_foreign_or_bad_ones_dropped(caplog: pytest.LogCaptureFixture) -> None:
    holder, empty = ids(2, seed=2)
    s = search_for("key", [PeerInfo(holder), PeerInfo(empty)], k=2, alpha=2)
    t = Traversal([s], k=2, max_records=10)
    good = DHTRecord.make("key", b"v1", NOW + 60).to_pb()
    foreign = DHTRecord.make("other", b"x", NOW + 60).to_pb()
    forged = DHTRecord.make("key", b"bad", NOW + 60).to_pb()
    forged.signature = b"junk"  # a signature on a record that names no owner: refused by the store's rules
    expired = DHTRecord.make("key", b"old", NOW - 1).to_pb()
    by_peer = {str(p.peer_id): (p, batch) for p, batch in t.requests()}
    p, batch = by_peer[str(holder)]
    with caplog.at_level(logging.DEBUG, logger="p2p.dht.traversal"):
        t.on_reply(p, batch, reply(pb.FindResult(records=[foreign, expired, forged, good])), NOW)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"DHT: dropped a bad record from {holder}: ") and len(line) > 60
    p, batch = by_peer[str(empty)]
    t.on_reply(p, batch, reply(pb.FindResult(records=[foreign])), NOW)  # holds nothing of ours
    assert t.done
    assert s.found is not None and s.key is not None
    value = s.found.found(s.key, NOW)
    assert value is not None and value.value == b"v1"
    assert s.holders == {holder} and [x.peer_id for x in s.lacking] == [empty]


def test_a_first_copy_read_stops_at_the_first_valid_record() -> None:
    a, b, c = ids(3, seed=3)
    s = search_for("key", [PeerInfo(a), PeerInfo(b), PeerInfo(c)], first_found=True, k=3, alpha=3)
    t = Traversal([s], k=3, max_records=10)
    requests = t.requests()
    (empty, empty_batch), (peer, batch) = requests[0], requests[1]
    t.on_reply(empty, empty_batch, reply(pb.FindResult()), NOW)
    assert not t.done and not s.lookup.done  # no copy yet: go on
    t.on_reply(peer, batch, reply(pb.FindResult(records=[DHTRecord.make("key", b"v", NOW + 60).to_pb()])), NOW)
    assert t.done and s.lookup.done and s.holders == {peer.peer_id}
    assert {p.peer_id for p in s.lookup.result()} == {empty.peer_id, peer.peer_id}
    assert t.requests() == []


def test_records_past_the_limit_are_not_read() -> None:
    holder = ids(1, seed=4)[0]
    s = search_for("key", [PeerInfo(holder)], k=1, alpha=1)
    t = Traversal([s], k=1, max_records=1)
    ((peer, batch),) = t.requests()
    records = [DHTRecord.make("key", b"a", NOW + 60, subkey="s1").to_pb(),
               DHTRecord.make("key", b"b", NOW + 60, subkey="s2").to_pb()]
    t.on_reply(peer, batch, reply(pb.FindResult(records=records)), NOW)
    assert s.found is not None and s.key is not None
    value = s.found.found(s.key, NOW)
    assert value is not None and isinstance(value.value, dict) and len(value.value) == 1


def test_a_slow_peer_is_reported_to_every_search_it_carried_and_its_late_reply_still_read() -> None:
    seeds = sorted((PeerInfo(p) for p in ids(2, 7)), key=lambda i: int(i.dht_id))  # closest to 0 first
    a, b = search_for(None, seeds, alpha=1), search_for(None, seeds, alpha=1)
    t = Traversal([a, b], k=4, max_records=10)
    ((peer, batch),) = t.requests()
    assert peer == seeds[0] and batch == [a, b]
    t.on_slow(peer, batch)
    assert t.in_flight == 1 and not t.done  # the call itself is still under way
    ((second, again),) = t.requests()  # each search asks the next peer meanwhile
    assert second == seeds[1] and again == [a, b] and t.in_flight == 2
    t.on_reply(second, again, reply(pb.FindResult(), pb.FindResult()), NOW)
    assert t.done  # nobody waits for the slow peer
    t.on_reply(peer, batch, reply(pb.FindResult(), pb.FindResult()), NOW)  # its late reply is read
    assert t.in_flight == 0
    assert [p.peer_id for p in a.lookup.result()] == [s.peer_id for s in seeds] == [p.peer_id for p in b.lookup.result()]


def test_the_reply_timer_follows_tcps_retransmission_rule_within_its_bounds() -> None:
    timer = ReplyTimer(floor=0.25, ceiling=3.0)
    assert timer.slow_after == 1.0  # before any reply
    timer.observe(0.2)  # srtt 0.2, rttvar 0.1
    assert timer.slow_after == pytest.approx(0.6)
    timer.observe(0.2)  # rttvar 0.75 * 0.1 + 0
    assert timer.slow_after == pytest.approx(0.2 + 4 * 0.075)
    timer.observe(0.4)  # rttvar 0.75 * 0.075 + 0.25 * 0.2, srtt 0.875 * 0.2 + 0.125 * 0.4
    assert timer.slow_after == pytest.approx(0.225 + 4 * 0.10625)
    for _ in range(60):
        timer.observe(0.01)
    assert timer.slow_after == 0.25  # the floor
    for _ in range(3):
        timer.observe(10.0)
    assert timer.slow_after == 3.0  # the ceiling
    assert ReplyTimer(initial=2.0).slow_after == 2.0


def test_lookups_go_wide_only_where_round_trips_are_long() -> None:
    timer = ReplyTimer()
    assert timer.typical is None and timer.parallelism(10, 3, 0.05) == 10  # nothing known: the internet's
    for seconds in (0.4, 0.3, 0.005):  # a start under load, then the machine's own
        timer.observe(seconds)
    assert timer.typical == 0.3 and timer.parallelism(10, 3, 0.05) == 10
    for _ in range(2):
        timer.observe(0.004)
    assert timer.typical == 0.005 and timer.parallelism(10, 3, 0.05) == 3  # the median forgets the burst
    for _ in range(16):
        timer.observe(0.12)  # paths across the internet
    assert timer.typical == 0.12 and timer.parallelism(10, 3, 0.05) == 10  # only the last 16 count
    timer.observe(0.05)
    assert timer.parallelism(10, 3, 0.05) == 10 and timer.parallelism(10, 3, 0.2) == 3
