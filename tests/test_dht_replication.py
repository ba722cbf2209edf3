"""Which records go where (``p2p/dht/replication.py``, sans-I/O): whether we replicate a key, what a
server hands over to peers now among its keys' closest, and Kademlia's rule that a replica a
store reached lately leaves the key out of its republish (measured under churn in test_sim)."""

from __future__ import annotations

import math
import random

from libp2p.peer.id import ID

from p2p.dht.proto import dht_pb2 as pb
from p2p.dht.records import DHTRecord, LocalStore
from p2p.dht.replication import StoresSeen, hand_over, is_replica
from p2p.dht.routing import DHTID, RoutingTable

NOW = 1_800_000_000.0


def make_ids(n: int, seed: int) -> list[ID]:
    rng = random.Random(seed)
    return [ID(b"\x00\x24" + rng.randbytes(36)) for _ in range(n)]


def by_distance(key: bytes, ids: list[ID]) -> list[ID]:
    target = int(DHTID.from_key(key))
    return sorted(ids, key=lambda p: int(DHTID.from_peer(p)) ^ target)


def test_we_replicate_a_key_while_fewer_than_replicas_others_are_nearer() -> None:
    target = 0
    assert is_replica(DHTID(50), target, [DHTID(10), DHTID(20)], replicas=3)  # fewer known than replicas
    assert is_replica(DHTID(25), target, [DHTID(10), DHTID(20), DHTID(30)], replicas=3)
    assert not is_replica(DHTID(35), target, [DHTID(10), DHTID(20), DHTID(30)], replicas=3)
    assert not is_replica(DHTID(30), target, [DHTID(10), DHTID(20), DHTID(30)], replicas=3)  # a tie is not nearer


def setup(replicas: int = 3) -> tuple[RoutingTable, LocalStore, DHTRecord, list[ID]]:
    """A server that is the nearest of a key's replicas, with the others in its table (all answered at 0)."""
    ids = make_ids(12, seed=4)
    rec = DHTRecord.make("the-key", b"v", NOW + 600)
    order = by_distance(rec.key, ids)
    table = RoutingTable(DHTID.from_peer(order[0]), k=20)
    for pid in order[1:]:
        table.add(pid, now=0.0)
    store = LocalStore()
    assert store.store(rec, NOW)
    return table, store, rec, order[1:]


def test_a_server_hands_a_key_over_only_to_its_other_replicas() -> None:
    table, store, rec, others = setup()
    plan = hand_over(table, store, others, replicas=3, now=NOW)
    assert set(plan) == set(others[:2])  # with us, the three nearest
    assert all(records == [rec] for records in plan.values())
    assert hand_over(table, store, others[2:], replicas=3, now=NOW) == {}  # not among the nearest
    assert hand_over(table, store, others, replicas=3, now=NOW, skip={rec.key}) == {}  # a store came lately


def test_a_server_no_longer_among_a_keys_replicas_does_not_spread_it() -> None:
    table, store, rec, others = setup()
    far = RoutingTable(DHTID.from_peer(others[-1]), k=20)  # the farthest of them holds it
    for pid in others[:-1]:
        far.add(pid, now=0.0)
    assert hand_over(far, store, others[:-1], replicas=3, now=NOW) == {}


def test_a_newcomer_gets_a_key_from_its_nearest_good_replica_only() -> None:
    table, store, rec, others = setup()
    newcomer = others[1]
    # we are the nearest replica: we send it
    assert set(hand_over(table, store, [newcomer], replicas=3, now=NOW, nearest_only=10.0)) == {newcomer}
    # the second nearest does not, while the nearest answers (good) ...
    first = next(p for p in make_ids(12, seed=4) if DHTID.from_peer(p) == table.local)
    second = RoutingTable(DHTID.from_peer(others[0]), k=20)
    for pid in [first, *others[1:]]:
        second.add(pid, now=0.0)
    assert hand_over(second, store, [newcomer], replicas=3, now=NOW, nearest_only=10.0) == {}
    # ... but does when the nearer one has never answered: it may be silent, or gone
    contact = second.get(first)
    assert contact is not None
    contact.answered = -math.inf
    assert set(hand_over(second, store, [newcomer], replicas=3, now=NOW, nearest_only=10.0)) == {newcomer}
    # and without the rule (a republish) it sends whatever the nearer one does
    contact.answered = 0.0
    assert set(hand_over(second, store, [newcomer], replicas=3, now=NOW)) == {newcomer}


def test_stores_seen_notes_the_keys_a_store_reached_and_forgets_them_after_the_interval() -> None:
    seen = StoresSeen()
    a, b = DHTRecord.make("a", b"1", NOW + 60), DHTRecord.make("b", b"2", NOW + 60)
    request = pb.StoreRequest(records=[a.to_pb(), b.to_pb()])
    response = pb.StoreResponse(results=[pb.StoreResult(status=pb.StoreResult.STALE),
                                         pb.StoreResult(status=pb.StoreResult.REJECTED, error="no")])
    seen.note(request, response, now=100.0)
    assert seen.recent(600.0, now=650.0) == {a.key}  # a refused store did not reach us
    assert seen.recent(600.0, now=700.0) == set()
    assert len(seen) == 0  # dropped, not only hidden
