"""Which records go where (``p2p/dht/replication.py``, sans-I/O): whether we replicate a key, what a
server hands over to peers now among its keys' closest, and Kademlia's rule that a replica a
store reached lately leaves the key out of its republish (measured under churn in test_sim)."""

from __future__ import annotations

import math
import random

from libp2p.peer.id import ID

from p2p.dht.proto import dht_pb2 as pb
from p2p.dht.records import DHTKey, DHTRecord, LocalStore
from p2p.dht.replication import StoresSeen, copyable, hand_over, is_replica, path_copy
from p2p.dht.routing import DHTID, PeerInfo, RoutingTable

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


def setup() -> tuple[RoutingTable, LocalStore, DHTRecord, list[ID]]:
    """A server that is the nearest of a key's 3 replicas, with 39 others in its table (all
    answered at 0); its store holds first a record of a key it does not replicate, then that one."""
    ids = make_ids(40, seed=4)
    rec = DHTRecord.make("the-key", b"v", NOW + 600)
    order = by_distance(rec.key, ids)
    table = RoutingTable(DHTID.from_peer(order[0]), k=20)
    for pid in order[1:]:
        table.add(pid, now=0.0)
    far = next(DHTRecord.make(f"far-{i}", b"f", NOW + 600) for i in range(100)
               if order[0] not in by_distance(DHTKey.encode(f"far-{i}"), ids)[:3])
    store = LocalStore()
    assert store.store(far, NOW) and store.store(rec, NOW)
    return table, store, rec, order[1:]


def test_a_server_hands_a_key_over_only_to_its_other_replicas() -> None:
    table, store, rec, others = setup()
    plan = hand_over(table, store, others, replicas=3, now=NOW)
    assert plan == {others[0]: [rec], others[1]: [rec]}  # with us, the three nearest; not the far key
    assert hand_over(table, store, others[2:], replicas=3, now=NOW) == {}  # not among the nearest
    assert hand_over(table, store, others, replicas=3, now=NOW, skip={rec.key}) == {}  # a store came lately
    far_key = store.keys()[0]
    assert hand_over(table, store, others, replicas=3, now=NOW, skip={far_key}) == plan  # the next key still goes
    assert hand_over(table, store, others, replicas=3, now=NOW, max_keys=1) == {}  # only the far key looked at


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
    assert hand_over(table, store, [newcomer], replicas=3, now=NOW, nearest_only=10.0) == {newcomer: [rec]}
    # the second nearest does not, while the nearest answers (good) ...
    first = next(p for p in make_ids(40, seed=4) if DHTID.from_peer(p) == table.local)
    second = RoutingTable(DHTID.from_peer(others[0]), k=20)
    for pid in [first, *others[1:]]:
        second.add(pid, now=0.0)
    assert hand_over(second, store, [newcomer], replicas=3, now=NOW, nearest_only=10.0) == {}
    # ... but does when the nearer one has never answered: it may be silent, or gone
    contact = second.get(first)
    assert contact is not None
    contact.answered = -math.inf
    assert hand_over(second, store, [newcomer], replicas=3, now=NOW, nearest_only=10.0) == {newcomer: [rec]}
    # and without the rule (a republish) it sends whatever the nearer one does
    contact.answered = 0.0
    assert hand_over(second, store, [newcomer], replicas=3, now=NOW) == {newcomer: [rec]}


def test_a_key_a_nearer_good_replica_hands_over_does_not_stop_the_next() -> None:
    """Two keys, the newcomer among both's replicas: we are the nearest replica of the second only."""
    ids = make_ids(40, seed=9)
    a, b = DHTRecord.make("key-a", b"a", NOW + 600), DHTRecord.make("key-b", b"b", NOW + 600)
    for name in (f"key-b{i}" for i in range(2000)):
        b = DHTRecord.make(name, b"b", NOW + 600)
        near_a, near_b = by_distance(a.key, ids)[:3], by_distance(b.key, ids)[:3]
        if near_a[1] == near_b[0] and near_a[2] == near_b[1]:
            break  # key-b's nearest is key-a's second: we are key-a's second and key-b's first
    else:
        raise AssertionError("no such pair of keys")
    me, newcomer = near_b[0], near_b[1]
    table = RoutingTable(DHTID.from_peer(me), k=20)
    for pid in ids:
        if pid != me:
            table.add(pid, now=0.0)
    store = LocalStore()
    assert store.store(a, NOW) and store.store(b, NOW)
    assert hand_over(table, store, [newcomer], replicas=3, now=NOW, nearest_only=10.0) == {newcomer: [b]}


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


def test_a_read_leaves_a_copy_of_a_plain_value_on_its_path_never_of_a_dictionary() -> None:
    """The copy goes to the peer nearest the key that the read met lacking it, once someone held it;
    a dictionary's never (its writers' later stores would not reach that copy: simulated, 61.6% of
    reads of an expert prefix missed a server with such copies, bench/prefix_freshness.py)."""
    key = DHTKey.encode("popular")
    target = int(DHTID.from_key(key))
    lacking = [PeerInfo(p) for p in make_ids(6, 3)]
    nearest = min(lacking, key=lambda p: int(p.dht_id) ^ target)
    holder = make_ids(1, 4)
    plain = [DHTRecord(key, b"v", NOW + 60)]
    entries = [DHTRecord(key, b"a", NOW + 60, DHTKey.encode("0")), DHTRecord(key, b"b", NOW + 60, DHTKey.encode("1"))]
    assert copyable(plain) and not copyable(entries) and not copyable([])
    assert path_copy(plain, lacking, holder, target) == nearest
    assert path_copy(entries, lacking, holder, target) is None
    assert path_copy(entries, lacking, holder, target, dictionaries=True) == nearest  # the rule before
    assert path_copy(plain, lacking, [], target) is None  # found nowhere but here: nothing to copy
    assert path_copy(plain, [], holder, target) is None and path_copy([], lacking, holder, target) is None
