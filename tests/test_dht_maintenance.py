"""What the DHT does on its own (``p2p/dht/maintenance.py``, sans-I/O): each maintenance pass, and
the follow-up of the table's verdict on a peer. The real DHT and the simulator both run these;
the real Nodes' tests (test_dht) and the simulation's (test_sim) show the effects."""

from __future__ import annotations

import random

import pytest
from libp2p.peer.id import ID

from p2p.dht.maintenance import (MAX_REFRESH_PER_PASS, AfterAdd, after_add, check_when_closed, join_targets,
                                  republish_due, to_check, to_refresh)
from p2p.dht.proto import dht_pb2 as pb
from p2p.dht.records import DHTRecord
from p2p.dht.replication import StoresSeen, republish_skip
from p2p.dht.routing import AddResult, AddStatus, Contact, DHTID, RoutingTable


def make_ids(n: int, seed: int) -> list[ID]:
    rng = random.Random(seed)
    return [ID(b"\x00\x24" + rng.randbytes(36)) for _ in range(n)]


def table_of(ids: list[ID], now: float) -> RoutingTable:
    table = RoutingTable(DHTID.from_peer(ids[0]), k=20, rng=random.Random(1))
    for pid in ids[1:]:
        table.add(pid, now=now)
    return table


def test_a_pass_refreshes_the_stale_buckets_at_most_eight_at_a_time() -> None:
    table = table_of(make_ids(200, seed=1), now=0.0)
    assert len(table.stale_buckets(700.0, 600.0)) > MAX_REFRESH_PER_PASS == 8
    due = to_refresh(table, 700.0, 600.0)
    buckets = [table.bucket_of(int(t)) for t in table.stale_buckets(700.0, 600.0)]  # a random id in each
    assert [table.bucket_of(int(t)) for t in due] == buckets[:8]
    fresh = to_refresh(table, 100.0, 600.0)
    # the buckets filled at 0 are fresh; only empty ones that were never looked up remain
    assert len(fresh) < len(buckets)
    assert all(not table.bucket(table.bucket_of(int(t))) for t in fresh)


def test_a_closed_connection_calls_for_a_check_of_a_contact_left_unconnected_within_the_limit() -> None:
    ids = make_ids(6, seed=5)
    table = table_of(ids[:5], now=0.0)
    contact, stranger = ids[1], ids[5]
    assert check_when_closed(table, contact, connected=False, checking=(), checks=2)
    assert not check_when_closed(table, stranger, connected=False, checking=(), checks=2)  # no contact of ours
    assert not check_when_closed(table, contact, connected=True, checking=(), checks=2)  # another one stands
    assert not check_when_closed(table, contact, connected=False, checking={contact}, checks=2)  # checked now
    assert check_when_closed(table, contact, connected=False, checking={ids[2]}, checks=2)
    assert not check_when_closed(table, contact, connected=False, checking={ids[2], ids[3]}, checks=2)  # limit


def test_a_pass_checks_the_quietest_contacts_up_to_its_limit() -> None:
    ids = make_ids(30, seed=2)
    table = table_of(ids, now=0.0)
    table.mark_seen(ids[1], 1000.0)  # answered lately: not quiet
    quiet = [c.peer_id for c in table.unanswered(1300.0, 1200.0, 60.0)]
    assert ids[1] not in quiet and len(quiet) > 4
    assert to_check(table, 1300.0, check_after=1200.0, check_new_after=60.0, checks=4) == quiet[:4]
    every = to_check(table, 1300.0, check_after=1200.0, check_new_after=60.0, checks=None)
    assert every == quiet  # the kad-dht twin: all of them
    assert to_check(table, 1000.0, check_after=1200.0, check_new_after=60.0, checks=4) == []


def test_a_caller_that_never_answered_is_checked_soon_after_it_came() -> None:
    ids = make_ids(10, seed=3)
    table = table_of(ids[:-1], now=0.0)
    table.add(ids[-1], now=500.0, answered=False)  # it called us
    at = {now: to_check(table, now, check_after=1200.0, check_new_after=60.0, checks=4) for now in (550.0, 560.0)}
    assert at == {550.0: [], 560.0: [ids[-1]]}


@pytest.mark.parametrize(("last", "now", "interval", "due"), [
    (0.0, 3599.0, 3600.0, False), (0.0, 3600.0, 3600.0, True), (100.0, 3650.0, 3600.0, False),
    (0.0, 9999.0, None, False),  # the simulator without replication
])
def test_a_pass_republishes_once_the_interval_passed(last: float, now: float, interval: float | None,
                                                     due: bool) -> None:
    assert republish_due(now, last, interval) is due


def contact(pid: ID) -> Contact:
    return Contact(pid, DHTID.from_peer(pid), (), None, 0.0)


def test_a_new_contact_gets_our_records_only_from_a_server_that_holds_some() -> None:
    added = AddResult(AddStatus.ADDED)
    assert after_add(added, server=True, holds_records=True, pinging=set()) == AfterAdd(hand_over=True)
    assert after_add(added, server=False, holds_records=True, pinging=set()) == AfterAdd()
    assert after_add(added, server=True, holds_records=False, pinging=set()) == AfterAdd()


def test_a_full_buckets_questionable_contact_is_pinged_once_at_a_time() -> None:
    old = make_ids(1, seed=5)[0]
    cached = AddResult(AddStatus.CACHED, "bucket full", contact(old))
    assert after_add(cached, server=True, holds_records=True, pinging=set()) == AfterAdd(ping=old)
    assert after_add(cached, server=True, holds_records=True, pinging={old}) == AfterAdd()
    assert after_add(AddResult(AddStatus.CACHED, "bucket full"), server=True, holds_records=True,
                     pinging=set()) == AfterAdd()  # all good: nobody to ping
    for other in (AddResult(AddStatus.UPDATED), AddResult(AddStatus.REJECTED, "local id")):
        assert after_add(other, server=True, holds_records=True, pinging=set()) == AfterAdd()


def test_a_republish_leaves_out_keys_a_store_reached_lately_and_its_own() -> None:
    seen = StoresSeen()
    a, b = DHTRecord.make("a", b"1", 2e9), DHTRecord.make("b", b"2", 2e9)
    seen.note(pb.StoreRequest(records=[a.to_pb()]), pb.StoreResponse(results=[pb.StoreResult()]), now=100.0)
    assert republish_skip(seen, [b.key], 600.0, now=650.0) == {a.key, b.key}
    assert republish_skip(seen, [b.key], 600.0, now=700.0) == {b.key}  # the note is older than the interval


def test_a_join_looks_up_our_own_id_then_the_three_farthest_buckets() -> None:
    table = table_of(make_ids(50, seed=6), now=0.0)
    first, *far = join_targets(table)
    assert first == table.local
    assert [table.bucket_of(int(t)) for t in far] == [255, 254, 253]
