"""What a DHT peer answers, sans-I/O (the I/O shell and the simulator both call it): finds within
a byte budget, first-copy reads, stores record by record, and whom a caller's claims admit."""

from __future__ import annotations

import math
import random

import pytest
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.dht import protocol as wire
from p2p.dht.proto import dht_pb2 as pb
from p2p.dht.records import DHTKey, DHTRecord, LocalStore
from p2p.dht.routing import AddStatus, DHTID, RoutingTable
from p2p.dht.serving import admit_answerer, admit_caller, answer_find, answer_store, check_find, check_store

NOW = 1_000_000.0


def ids(n: int, seed: int = 0) -> list[ID]:
    rng = random.Random(seed)
    return [ID(b"\x00\x24" + rng.randbytes(36)) for _ in range(n)]


def table_of(me: ID, contacts: list[ID]) -> RoutingTable:
    table = RoutingTable(DHTID.from_peer(me), k=20)
    for i, c in enumerate(contacts):
        table.add(c, addrs=[Multiaddr(f"/ip4/10.0.{i}.1/tcp/4001")], ip_group=f"10.0.{i}.0/24", now=NOW)
    return table


def store_with(*records: DHTRecord) -> LocalStore:
    storage = LocalStore()
    for r in records:
        storage.store(r, NOW)
    return storage


def find(*queries: pb.Query) -> pb.FindRequest:
    return pb.FindRequest(sender=pb.Sender(server=False), queries=list(queries))


def test_a_find_answers_records_and_the_closest_contacts_but_never_the_caller() -> None:
    me, caller, *others = ids(8)
    table = table_of(me, [caller, *others])
    rec = DHTRecord.make("k", b"v", NOW + 60)
    response = answer_find(find(pb.Query(key=DHTKey.encode("k"))), caller, table=table, storage=store_with(rec),
                           server=True, now=NOW, budget=1 << 20)
    (result,) = response.results
    assert response.server and [DHTRecord.from_pb(r).value for r in result.records] == [b"v"]
    assert {bytes(e.peer_id) for e in result.closer} == {o.to_bytes() for o in others}


def test_a_first_copy_read_we_can_answer_gets_no_contacts_and_one_we_cannot_gets_them() -> None:
    me, caller, other = ids(3, seed=1)
    table = table_of(me, [other])
    storage = store_with(DHTRecord.make("k", b"v", NOW + 60))
    response = answer_find(find(pb.Query(key=DHTKey.encode("k"), first_copy=True),
                                pb.Query(key=DHTKey.encode("missing"), first_copy=True)),
                           caller, table=table, storage=storage, server=True, now=NOW, budget=1 << 20)
    held, missing = response.results
    assert len(held.records) == 1 and not held.closer
    assert not missing.records and len(missing.closer) == 1


def test_a_client_answers_contacts_but_no_records() -> None:
    me, caller, other = ids(3, seed=2)
    response = answer_find(find(pb.Query(key=DHTKey.encode("k"))), caller, table=table_of(me, [other]),
                           storage=store_with(DHTRecord.make("k", b"v", NOW + 60)), server=False, now=NOW, budget=1 << 20)
    assert not response.server and not response.results[0].records and len(response.results[0].closer) == 1


def test_the_byte_budget_is_spent_record_by_record() -> None:
    me, caller = ids(2, seed=10)
    records = [DHTRecord.make("k", b"z" * 100, NOW + 60, subkey=f"s{i}") for i in range(3)]
    storage = store_with(*records)
    response = answer_find(find(pb.Query(key=DHTKey.encode("k"))), caller, table=table_of(me, []), storage=storage,
                           server=True, now=NOW, budget=2 * records[0].size + 1)
    assert len(response.results[0].records) == 2 and response.results[0].truncated


def test_records_over_the_byte_budget_are_left_out_and_the_result_says_so() -> None:
    me, caller = ids(2, seed=3)
    big = DHTRecord.make("k", b"x" * 1000, NOW + 60, subkey="a")
    small = DHTRecord.make("k", b"y", NOW + 60, subkey="b")
    storage = store_with(big, small)
    response = answer_find(find(pb.Query(key=DHTKey.encode("k"))), caller, table=table_of(me, []), storage=storage,
                           server=True, now=NOW, budget=small.size + 10)
    (result,) = response.results
    assert [DHTRecord.from_pb(r).value for r in result.records] == [b"y"] and result.truncated
    exact = answer_find(find(pb.Query(key=DHTKey.encode("k"))), caller, table=table_of(me, []), storage=storage,
                        server=True, now=NOW, budget=big.size + small.size)
    assert len(exact.results[0].records) == 2 and not exact.results[0].truncated


@pytest.mark.parametrize("query", [pb.Query(target=b"short"), pb.Query(key=b"\xff\xfe garbled")], ids=["target", "key"])
def test_malformed_finds_are_refused_before_anything_is_read(query: pb.Query) -> None:
    with pytest.raises(wire.BadDHTRequest):
        check_find(find(query))
    with pytest.raises(wire.BadDHTRequest, match=rf"^{wire.MAX_BATCH + 1} queries in one call"):
        check_find(find(*[pb.Query(key=DHTKey.encode("k"))] * (wire.MAX_BATCH + 1)))
    check_find(find(*[pb.Query(key=DHTKey.encode("k"))] * wire.MAX_BATCH))


def test_stores_are_answered_record_by_record() -> None:
    caller = ids(1, seed=4)[0]
    storage = store_with(DHTRecord.make("k", b"newer", NOW + 120))
    request = pb.StoreRequest(records=[DHTRecord.make("k", b"older", NOW + 60).to_pb(),
                                       DHTRecord.make("j", b"fresh", NOW + 60).to_pb(),
                                       DHTRecord.make("i", b"too far", NOW + 10 * 24 * 3600).to_pb()])
    response = answer_store(request, caller, storage=storage, server=True, now=NOW)
    assert response.server
    assert [r.status for r in response.results] == [pb.StoreResult.STALE, pb.StoreResult.STORED, pb.StoreResult.REJECTED]
    assert "expiration" in response.results[2].error
    client = answer_store(request, caller, storage=LocalStore(), server=False, now=NOW)
    assert not client.server and len(client.results) == 3
    assert all(r.status == pb.StoreResult.REJECTED and r.error == "this peer is a DHT client and stores nothing"
               for r in client.results)
    with pytest.raises(wire.BadDHTRequest, match=rf"^{wire.MAX_BATCH + 1} records in one call"):
        check_store(pb.StoreRequest(records=[request.records[0]] * (wire.MAX_BATCH + 1)))
    check_store(pb.StoreRequest(records=[request.records[0]] * wire.MAX_BATCH))


def test_stores_count_against_the_callers_quota() -> None:
    caller, other = ids(2, seed=8)
    storage = LocalStore(max_stores_per_origin=1)
    one = pb.StoreRequest(records=[DHTRecord.make("a", b"1", NOW + 60).to_pb()])
    two = pb.StoreRequest(records=[DHTRecord.make("b", b"2", NOW + 60).to_pb()])
    assert answer_store(one, caller, storage=storage, server=True, now=NOW).results[0].status == pb.StoreResult.STORED
    assert answer_store(two, caller, storage=storage, server=True, now=NOW).results[0].status == pb.StoreResult.REJECTED
    assert answer_store(two, other, storage=storage, server=True, now=NOW).results[0].status == pb.StoreResult.STORED


def test_a_caller_is_admitted_only_as_a_server_on_the_address_it_came_from() -> None:
    me, caller = ids(2, seed=5)
    observed = Multiaddr("/ip4/8.8.8.8/tcp/5555")
    circuit = Multiaddr(f"/ip4/8.8.8.8/tcp/4002/p2p/{ids(1, seed=9)[0]}/p2p-circuit")
    claims = pb.Sender(server=True, addrs=wire.encode_addrs([circuit, Multiaddr("/ip4/8.8.8.8/tcp/4001"),
                                                             Multiaddr("/ip4/1.2.3.4/tcp/4001")]))
    assert admit_caller(table_of(me, []), caller, pb.Sender(server=False), observed, NOW) is None
    assert admit_caller(table_of(me, []), caller, claims, None, NOW) is None  # relayed: no one could dial it
    elsewhere = pb.Sender(server=True, addrs=wire.encode_addrs([Multiaddr("/ip4/1.2.3.4/tcp/4001")]))
    assert admit_caller(table_of(me, []), caller, elsewhere, observed, NOW) is None  # points elsewhere
    table = table_of(me, [])
    added = admit_caller(table, caller, claims, observed, NOW)
    assert added is not None and added[0].status is AddStatus.ADDED
    assert [str(a) for a in added[1]] == ["/ip4/8.8.8.8/tcp/4001"] and caller in table
    contact = table.get(caller)
    assert contact is not None and contact.ip_group == "8.8.8.0/24" and contact.last_seen == NOW
    assert [str(a) for a in contact.addrs] == ["/ip4/8.8.8.8/tcp/4001"]
    table.mark_failed(caller)
    assert admit_caller(table, caller, claims, observed, NOW + 5) is None  # known: only marked seen
    assert table.get(caller).last_seen == NOW + 5  # type: ignore[union-attr]
    # ... and its call is no answer: one that calls and never answers (silent, or unreachable)
    # has not answered yet, so the check of quiet contacts pings it, first, new_after its joining
    assert table.get(caller).answered == -math.inf  # type: ignore[union-attr]
    assert table.unanswered(NOW + 5, 1200.0, new_after=60.0) == []
    assert [c.peer_id for c in table.unanswered(NOW + 60, 1200.0, new_after=60.0)] == [caller]
    table.mark_seen(caller, NOW + 61)  # it answered the check (or a call of ours)
    assert table.unanswered(NOW + 61, 1200.0, new_after=60.0) == []


def test_an_answer_as_a_client_removes_the_peer_and_a_direct_server_joins() -> None:
    me, peer = ids(2, seed=6)
    table = table_of(me, [peer])
    assert admit_answerer(table, peer, False, None, [], NOW) is None and peer not in table
    direct = Multiaddr("/ip4/9.9.9.9/tcp/4001")
    relayed = Multiaddr(f"/ip4/1.1.1.1/tcp/1/p2p/{ids(1, seed=7)[0]}/p2p-circuit")
    assert admit_answerer(table, peer, True, None, [direct], NOW) is None  # reached through a relay
    assert admit_answerer(table, peer, True, direct, [relayed], NOW) is None  # nothing direct to dial
    added = admit_answerer(table, peer, True, direct, [relayed, direct], NOW)
    assert added is not None and added[0].status is AddStatus.ADDED and added[1] == [direct]
    contact = table.get(peer)
    assert contact is not None and contact.ip_group == "9.9.9.0/24" and contact.last_seen == NOW
    assert contact.addrs == (direct,)
    assert admit_answerer(table, peer, True, direct, [direct], NOW + 3) is None
    assert table.get(peer).last_seen == NOW + 3  # type: ignore[union-attr]
