"""The sans-I/O Kademlia routing: ids, k-buckets, diversity, refresh, and iterative lookups (incl. liars)."""

from __future__ import annotations

import hashlib
import ipaddress
import math
import random

import pytest
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.dht.routing import AddResult, AddStatus, DHTID, Lookup, PeerInfo, RoutingTable, ip_group


def make_ids(n: int, seed: int) -> list[ID]:
    rng = random.Random(seed)
    return [ID(b"\x00\x24" + rng.randbytes(36)) for _ in range(n)]


def peers_in_bucket(local: DHTID, index: int, n: int, seed: int) -> list[ID]:
    """Random peer ids whose DHTID falls in bucket ``index`` of ``local`` (index >= 250 keeps this cheap)."""
    out: list[ID] = []
    for pid in make_ids(100_000, seed):
        if local.bucket_index(DHTID.from_peer(pid)) == index:
            out.append(pid)
            if len(out) == n:
                return out
    raise AssertionError("not enough ids")


def test_ids_and_distances() -> None:
    pid = make_ids(1, 0)[0]
    assert DHTID.from_peer(pid) == int.from_bytes(hashlib.sha256(pid.to_bytes()).digest(), "big")
    assert DHTID.from_key(pid.to_bytes()) == DHTID.from_peer(pid)  # one space for keys and peers
    a = DHTID(0b1011)
    assert a.xor_distance(0b0010) == 0b1001
    assert a.bucket_index(a) == -1
    assert a.bucket_index(0b1010) == 0
    assert a.bucket_index(0b0011) == 3
    assert DHTID(0).bucket_index(1 << 255) == 255
    assert PeerInfo(pid).dht_id == DHTID.from_peer(pid)


def test_ip_group() -> None:
    assert ip_group("8.8.8.8") == "8.8.8.0/24"
    assert ip_group(Multiaddr("/ip4/8.8.4.9/tcp/4001")) == "8.8.4.0/24"
    assert ip_group("/ip6/2001:4860:4860::8888/tcp/1") == "2001:4860:4860::/48"
    assert ip_group(ipaddress.ip_address("::ffff:8.8.8.8")) == "8.8.8.0/24"
    assert ip_group("127.0.0.1") is None and ip_group("/ip4/192.168.1.2/tcp/1") is None
    assert ip_group("/dns4/example.com/tcp/1") is None


def test_full_bucket_caches_replacement_and_remove_promotes() -> None:
    local = DHTID.from_peer(make_ids(1, 1)[0])
    table = RoutingTable(local, k=4, replacement_cache_size=2)
    ids = peers_in_bucket(local, 255, 8, seed=2)
    for t, pid in enumerate(ids[:4]):
        assert table.add(pid, now=t).status is AddStatus.ADDED
    assert table.add(ids[0], now=10).status is AddStatus.UPDATED  # ids[1] is now least recently seen
    res = table.add(ids[4], now=11)  # all four answered within good_for: none is pinged
    assert res.status is AddStatus.CACHED and res.ping_candidate is None
    res = table.add(ids[4], now=901)  # ids[1] was seen 900 s ago: questionable
    assert res.status is AddStatus.CACHED and res.ping_candidate is not None
    assert res.ping_candidate.peer_id == ids[1]
    table.add(ids[5], now=902)
    table.add(ids[6], now=903)  # cache is bounded: ids[4] falls out
    assert [c.peer_id for c in table.replacements(255)] == [ids[5], ids[6]]
    assert len(table) == 4 and ids[4] not in table
    # The ping candidate is dead: three failures evict it, and the newest replacement takes its place.
    assert not table.mark_failed(ids[1]) and not table.mark_failed(ids[1])
    assert table.mark_failed(ids[1])
    assert ids[1] not in table and ids[6] in table and len(table) == 4
    promoted = table.remove(ids[2])
    assert promoted is not None and promoted.peer_id == ids[5]
    assert table.remove(ids[3]) is None and len(table) == 3
    # Seen resets failures; only an answer moves `answered` (a call proves the peer is up, not
    # that we reach it); a given dht id must match; the local id is refused.
    table.mark_failed(ids[0])
    table.mark_seen(ids[0], now=19, answered=False)
    c = table.get(ids[0])
    assert c is not None and c.failures == 0 and c.last_seen == 19 and c.answered == 10
    table.mark_seen(ids[0], now=20)
    assert c.failures == 0 and c.last_seen == 20 and c.answered == 20
    assert table.add(ids[7], DHTID(1), now=0).status is AddStatus.REJECTED
    assert table.add(make_ids(1, 1)[0], now=0).reason == "local id"


def test_ip_group_limits_per_bucket_and_table() -> None:
    local = DHTID.from_peer(make_ids(1, 3)[0])
    table = RoutingTable(local, k=20, max_per_ip_group=2, max_per_ip_group_total=3)
    far = peers_in_bucket(local, 255, 3, seed=4)
    near = peers_in_bucket(local, 254, 2, seed=5)
    g = ip_group("1.2.3.4")
    assert table.add(far[0], ip_group=g, now=0).status is AddStatus.ADDED
    assert table.add(far[1], ip_group=g, now=0).status is AddStatus.ADDED
    res = table.add(far[2], ip_group=g, now=0)
    assert res.status is AddStatus.REJECTED and "bucket" in (res.reason or "")
    assert table.add(far[2], ip_group=ip_group("1.2.4.4"), now=0).status is AddStatus.ADDED
    assert table.add(near[0], ip_group=g, now=0).status is AddStatus.ADDED
    res = table.add(near[1], ip_group=g, now=0)
    assert res.status is AddStatus.REJECTED and "table" in (res.reason or "")
    table.remove(far[0])  # frees a slot of the group
    assert table.add(near[1], ip_group=g, now=0).status is AddStatus.ADDED
    assert table.add(near[1], ip_group=g, now=1).status is AddStatus.UPDATED  # refreshing is not re-counted
    for pid in peers_in_bucket(local, 253, 5, seed=6):  # exempt (None) groups are unlimited
        assert table.add(pid, ip_group=None, now=0).status is AddStatus.ADDED


def test_nearest_is_exact() -> None:
    ids = make_ids(1001, 7)
    table = RoutingTable(DHTID.from_peer(ids[0]), k=1000)
    for pid in ids[1:]:
        table.add(pid, now=0)
    assert len(table) == 1000 and len(list(table)) == 1000
    rng = random.Random(8)
    for _ in range(20):
        target = DHTID(rng.getrandbits(256))
        want = sorted(ids[1:], key=lambda p: DHTID.from_peer(p) ^ target)
        assert [c.peer_id for c in table.nearest(target, 20)] == want[:20]
        assert [c.peer_id for c in table.nearest(target, 5, exclude=want[:3])] == want[3:8]


def test_nearest_is_exact_for_targets_in_every_tier_of_buckets() -> None:
    ids = make_ids(3000, 26)
    local = DHTID.from_peer(ids[0])
    table = RoutingTable(local, k=4)
    for pid in ids[1:]:
        table.add(pid, now=0)
    held = list(table)
    assert 30 < len(held) < 200  # full buckets far away, sparse ones near us
    rng = random.Random(27)
    near = [DHTID(int(local) ^ rng.getrandbits(bits)) for bits in (0, 1, 3, 8, 12, 20)]  # 0 bits: ourselves
    targets = [DHTID(rng.getrandbits(256)) for _ in range(20)] + near + [c.dht_id for c in held[:10]]
    for target in targets:
        want = sorted(held, key=lambda c: c.dht_id ^ target)
        for count in (1, 4, 10, 25):
            assert table.nearest(target, count) == want[:count], (target, count)
        skipped = [c.peer_id for c in want[:2]]
        assert table.nearest(target, 6, exclude=skipped) == want[2:8]
    assert table.nearest(local, 1000) == sorted(held, key=lambda c: c.dht_id ^ local)
    # emptying the buckets nearest us, one contact at a time (no replacements: the far buckets'
    # caches are full, the near ones' empty): every tier still found
    for gone in sorted(held, key=lambda c: c.dht_id ^ local)[:8]:
        assert table.remove(gone.peer_id) is None
        left = list(table)
        for target in (local, near[3], held[-1].dht_id):
            assert table.nearest(target, 6) == sorted(left, key=lambda c: c.dht_id ^ target)[:6]


def test_refresh_ids_fall_into_stale_buckets() -> None:
    local = DHTID.from_peer(make_ids(1, 9)[0])
    table = RoutingTable(local, rng=random.Random(10))
    assert table.stale_buckets(now=0, refresh_interval=60) == []
    for pid in peers_in_bucket(local, 255, 2, seed=11) + peers_in_bucket(local, 252, 1, seed=12):
        table.add(pid, now=100)
    stale = table.stale_buckets(now=130, refresh_interval=60)
    assert sorted(local.bucket_index(t) for t in stale) == [251, 253, 254]  # never touched; 252, 255 fresh
    table.touch(stale[0], now=130)
    assert len(table.stale_buckets(now=130, refresh_interval=60)) == 2
    later = table.stale_buckets(now=200, refresh_interval=60)
    assert sorted(local.bucket_index(t) for t in later) == [251, 252, 253, 254, 255]
    for i in (0, 1, 17, 255):
        assert local.bucket_index(table.random_id_in_bucket(i)) == i


class Network:
    """500 simulated DHT servers; each answers FIND_NODE from its own routing table."""

    def __init__(self, n: int, seed: int, k: int = 20) -> None:
        rng = random.Random(seed)
        self.ids = make_ids(n, seed)
        self.info = {pid: PeerInfo(pid) for pid in self.ids}
        self.tables: dict[ID, RoutingTable] = {}
        for pid in self.ids:
            table = RoutingTable(self.info[pid].dht_id, k=k, replacement_cache_size=0)
            for other in rng.sample(self.ids, len(self.ids)):
                if other != pid:
                    table.add(other, self.info[other].dht_id, now=0)
            self.tables[pid] = table
        self.dead: set[ID] = set()
        self.liars: dict[ID, list[PeerInfo]] = {}
        self.pruned = False  # whether live peers have already evicted the dead from their tables

    def answer(self, pid: ID, target: DHTID, k: int) -> list[PeerInfo] | None:
        if pid in self.dead or pid not in self.tables:  # sybils do not exist
            return None
        if pid in self.liars:
            return self.liars[pid]
        exclude = self.dead if self.pruned else ()
        return [c.info for c in self.tables[pid].nearest(target, k, exclude=exclude)]

    def run(self, lookup: Lookup, rng: random.Random) -> tuple[int, set[ID]]:
        asked: set[ID] = set()
        pending: list[PeerInfo] = []
        while True:
            for peer in lookup.next_queries():
                assert peer.peer_id not in asked, "queried twice"
                asked.add(peer.peer_id)
                pending.append(peer)
            assert len(pending) <= lookup.alpha
            if not pending:
                break
            peer = pending.pop(rng.randrange(len(pending)))  # replies arrive in any order
            reply = self.answer(peer.peer_id, lookup.target, lookup.k)
            if reply is None:
                lookup.on_failure(peer.peer_id)
            else:
                lookup.on_response(peer.peer_id, reply)
        assert lookup.done and lookup.in_flight == 0
        return lookup.queries, asked

    def true_closest(self, target: DHTID, k: int, skip: set[ID] = set()) -> list[ID]:
        alive = [p for p in self.ids if p not in self.dead and p not in skip]
        return sorted(alive, key=lambda p: self.info[p].dht_id ^ target)[:k]


@pytest.fixture(scope="module")
def network() -> Network:
    return Network(500, seed=13)


def lookup_from(net: Network, origin: ID, target: DHTID, k: int = 20, alpha: int = 3) -> Lookup:
    seeds = [c.info for c in net.tables[origin].nearest(target, k)]
    return Lookup(target, k, alpha, seeds, local=net.info[origin].dht_id, exclude=[origin])


def test_lookup_finds_true_closest_within_bounded_queries(network: Network) -> None:
    rng = random.Random(14)
    bound = 3 * 3 * math.log2(500)
    for _ in range(30):
        origin = rng.choice(network.ids)
        target = DHTID(rng.getrandbits(256))
        lookup = lookup_from(network, origin, target)
        queries, _ = network.run(lookup, rng)
        assert [p.peer_id for p in lookup.result()] == network.true_closest(target, 20, skip={origin})
        assert queries <= bound


def test_lookup_from_one_far_seed(network: Network) -> None:
    rng = random.Random(15)
    target = DHTID(rng.getrandbits(256))
    far = max(network.ids, key=lambda p: network.info[p].dht_id ^ target)
    lookup = Lookup(target, 20, 3, [network.info[far]])
    network.run(lookup, rng)
    assert [p.peer_id for p in lookup.result()] == network.true_closest(target, 20)


def test_lying_peers_cannot_derail_lookup(network: Network) -> None:
    rng = random.Random(16)
    sybils = [PeerInfo(pid) for pid in make_ids(100, 17)]  # exist nowhere: queries to them fail
    liars = rng.sample(network.ids, 100)
    try:
        for i, liar in enumerate(liars):
            # half point at themselves (many times), half flood the same 100 sybils plus themselves
            self_ref = [network.info[liar]] * 50
            network.liars[liar] = self_ref if i % 2 else sybils + self_ref
        for _ in range(20):
            target = DHTID(rng.getrandbits(256))
            origin = rng.choice([p for p in network.ids if p not in network.liars])
            # the worst case: liars among the seeds, and a single honest one
            honest = rng.choice([p for p in network.ids if p not in network.liars and p != origin])
            seeds = [network.info[p] for p in liars[:3]] + [network.info[honest]]
            lookup = Lookup(target, 20, 3, seeds, local=network.info[origin].dht_id, exclude=[origin])
            _, asked = network.run(lookup, rng)  # asserts nobody is queried twice
            assert [p.peer_id for p in lookup.result()] == network.true_closest(target, 20, skip={origin})
            # each sybil costs at most one failed query (never retried); the honest work stays bounded
            assert lookup.queries - sum(1 for s in sybils if s.peer_id in asked) <= 3 * 3 * math.log2(500)
    finally:
        network.liars.clear()


def test_response_hygiene() -> None:
    ids = make_ids(60, 18)
    target = DHTID(0)
    lookup = Lookup(target, 5, 2, [PeerInfo(ids[0])], local=DHTID.from_peer(ids[1]), exclude=[ids[2]])
    assert lookup.on_response(ids[0], [PeerInfo(ids[3])]) == 0  # not asked yet: unsolicited
    (first,) = lookup.next_queries()
    assert first.peer_id == ids[0] and lookup.next_queries() == []
    flood = [PeerInfo(ids[0]), PeerInfo(ids[1]), PeerInfo(ids[2])] + [PeerInfo(p) for p in ids[3:]]
    assert lookup.on_response(ids[0], flood) == 5  # self, local and excluded ignored; capped at k
    assert lookup.on_response(ids[0], [PeerInfo(ids[50])]) == 0  # a second reply is ignored
    assert len(lookup.next_queries()) == 2
    lookup.stop()
    assert lookup.done and lookup.next_queries() == []


def test_failures_are_routed_around(network: Network) -> None:
    rng = random.Random(19)
    network.dead = set(rng.sample(network.ids, 50))
    try:
        # Fresh deaths: every table still lists the dead, and replies carry only k contacts, so
        # dead entries can push the last few true closest out of every reply the lookup gets (plain
        # Kademlia under churn; table maintenance, not the lookup, cures it). The lookup must still
        # skip the dead, return only live peers, and get the head of the true set exactly.
        for _ in range(15):
            target = DHTID(rng.getrandbits(256))
            origin = rng.choice([p for p in network.ids if p not in network.dead])
            lookup = lookup_from(network, origin, target)
            network.run(lookup, rng)
            got = [p.peer_id for p in lookup.result()]
            want = network.true_closest(target, 20, skip={origin})
            assert not set(got) & network.dead and got[:10] == want[:10]
            assert len(set(got) & set(want)) >= 17
        # Live peers have evicted the dead, but our own seeds are stale: exact again.
        network.pruned = True
        for _ in range(15):
            target = DHTID(rng.getrandbits(256))
            origin = rng.choice([p for p in network.ids if p not in network.dead])
            stale = sorted(network.dead, key=lambda p: network.info[p].dht_id ^ target)[:10]
            seeds = [network.info[p] for p in stale] + [c.info for c in network.tables[origin].nearest(target, 3)]
            lookup = Lookup(target, 20, 3, seeds, local=network.info[origin].dht_id, exclude=[origin])
            network.run(lookup, rng)
            assert [p.peer_id for p in lookup.result()] == network.true_closest(target, 20, skip={origin})
        # Everyone we know is dead: the lookup ends with an empty result instead of hanging.
        everyone = Lookup(DHTID(5), 20, 3, [network.info[p] for p in network.dead][:10])
        network.run(everyone, rng)
        assert everyone.result() == [] and everyone.queries == 10
    finally:
        network.dead = set()
        network.pruned = False


def test_removing_a_cached_replacement_and_group_counts_after_removal() -> None:
    local = DHTID.from_peer(make_ids(1, 20)[0])
    table = RoutingTable(local, k=2, replacement_cache_size=2, max_per_ip_group=2, max_per_ip_group_total=2)
    ids = peers_in_bucket(local, 255, 4, seed=21)
    g = ip_group("5.6.7.8")
    assert table.add(ids[0], ip_group=g, now=0).status is AddStatus.ADDED
    assert table.add(ids[1], ip_group=g, now=0).status is AddStatus.ADDED
    assert table.add(ids[2], now=1).status is AddStatus.CACHED
    assert table.add(ids[3], now=2).status is AddStatus.CACHED
    assert table.remove(ids[2]) is None  # a cached replacement: dropped from the cache, nothing promoted
    assert [c.peer_id for c in table.replacements(255)] == [ids[3]] and ids[2] not in table
    # removing a contact frees exactly one slot of its group, in the bucket and in the table
    assert table.remove(ids[0]) is not None  # ids[3] (no group) promoted
    assert table.remove(ids[3]) is None
    assert table.add(ids[0], ip_group=g, now=3).status is AddStatus.ADDED  # the group had one slot free again
    assert table.add(ids[2], ip_group=g, now=3).reason == f"ip group {g} limit reached in bucket 255"
    table.remove(ids[1])
    table.remove(ids[0])
    assert table.get(ids[0]) is None and table.get(ids[1]) is None
    for pid in ids[:2]:  # both slots of the group are free again, in the bucket and the table
        assert table.add(pid, ip_group=g, now=4).status is AddStatus.ADDED
    assert table.bucket(255) == [table.get(ids[0]), table.get(ids[1])]


def test_refresh_at_exactly_the_interval_and_the_lowest_bucket_considered() -> None:
    local = DHTID.from_peer(make_ids(1, 30)[0])
    table = RoutingTable(local, rng=random.Random(31))
    (near,) = peers_in_bucket(local, 250, 1, seed=32)
    table.add(near, now=0)
    stale = table.stale_buckets(now=60, refresh_interval=60)  # touched exactly one interval ago: stale
    assert sorted(local.bucket_index(t) for t in stale) == list(range(249, 256))
    assert table.stale_buckets(now=59.9, refresh_interval=60) != [] and \
        250 not in [local.bucket_index(t) for t in table.stale_buckets(now=59.9, refresh_interval=60)]
    table.touch(local, now=61)  # our own id is in no bucket: nothing changes
    assert len(table.stale_buckets(now=61, refresh_interval=60)) == 7
    table.touch(table.random_id_in_bucket(0), now=61)  # bucket 0 is below the lowest considered
    assert len(table.stale_buckets(now=61, refresh_interval=60)) == 7
    assert table.nearest(local) == [table.get(near)]  # count defaults to k


def test_a_lookup_skips_its_own_id_the_sender_and_peers_it_knows() -> None:
    ids = make_ids(6, 40)
    local = DHTID.from_peer(ids[0])
    target = DHTID.from_peer(ids[5])
    lookup = Lookup(target, 3, 1, [PeerInfo(ids[1])], local=local, exclude=[ids[4]])
    assert [p.peer_id for p in lookup.next_queries()] == [ids[1]]
    added = lookup.on_response(ids[1], [PeerInfo(ids[0]), PeerInfo(ids[1]), PeerInfo(ids[2]), PeerInfo(ids[2]),
                                        PeerInfo(ids[4]), PeerInfo(ids[3])])
    assert added == 2  # not ourselves, not the sender, not the excluded, each new one once
    assert repr(DHTID(255)) == "DHTID(" + "0" * 62 + "ff)"


def test_a_full_bucket_pings_only_a_contact_not_known_good() -> None:
    """BEP 5: good = answered us once, and answered or called within good_for. A caller that never
    answered is pinged even when newest; one that answered and called 899 s ago is not."""
    local = DHTID.from_peer(make_ids(1, 60)[0])
    table = RoutingTable(local, k=3, good_for=900)
    ids = peers_in_bucket(local, 255, 5, seed=61)
    table.add(ids[0], now=0)
    table.add(ids[1], now=1, answered=False)
    table.add(ids[2], now=2)
    candidate = table.add(ids[3], now=3).ping_candidate
    assert candidate is not None and candidate.peer_id == ids[1]  # ids[0] is older, and good
    table.mark_seen(ids[1], 4)  # it answered
    assert table.add(ids[3], now=5).ping_candidate is None
    table.mark_seen(ids[0], 100, answered=False)  # a call from a contact that answered before: still good
    assert table.add(ids[4], now=899).ping_candidate is None
    candidate = table.add(ids[4], now=904).ping_candidate  # ids[2] seen 902 s ago; ids[0] 804 s ago
    assert candidate is not None and candidate.peer_id == ids[2]
    spared = table.add(ids[4], now=905, ping=False)  # a caller that will not ping: cached, nothing to ping
    assert spared.status is AddStatus.CACHED and spared.ping_candidate is None
    assert ids[4] in [c.peer_id for c in table.replacements(255)]


def test_defaults_are_kademlias_and_the_diversity_limits() -> None:
    """k = 20 (Kademlia's), a replacement cache of k, 2 contacts of one /24 per bucket and 10 per table,
    and a table made without an rng still draws refresh ids."""
    local = DHTID.from_peer(make_ids(1, 50)[0])
    table = RoutingTable(local)
    assert (table.k, table.replacement_cache_size, table.max_per_ip_group, table.max_per_ip_group_total,
            table.max_failures) == (20, 20, 2, 10, 3)
    ids = peers_in_bucket(local, 255, 22, seed=51)
    for t, pid in enumerate(ids[:20]):
        assert table.add(pid, now=t).status is AddStatus.ADDED
    cached = table.add(ids[20], now=900)
    assert (cached.status, cached.reason, cached.ping_candidate) == (AddStatus.CACHED, "bucket full", table.get(ids[0]))
    assert table.good_for == 900.0
    assert local.bucket_index(table.random_id_in_bucket(200)) == 200


def test_every_refusal_says_why() -> None:
    ids = make_ids(3, 52)
    local = DHTID.from_peer(ids[0])
    table = RoutingTable(local, k=1, replacement_cache_size=0)
    assert table.add(ids[0], now=0) == AddResult(AddStatus.REJECTED, "local id")
    assert table.add(ids[1], DHTID.from_peer(ids[2]), now=0) == AddResult(AddStatus.REJECTED,
                                                                          "dht id does not match peer id")
    assert table.add(ids[1], DHTID.from_peer(ids[1]), now=0) == AddResult(AddStatus.ADDED)
    (other,) = [p for p in peers_in_bucket(local, table.bucket_of(DHTID.from_peer(ids[1])), 2, seed=53)
                if p != ids[1]][:1]
    assert table.add(other, now=1) == AddResult(AddStatus.REJECTED, "bucket full")  # no cache: refused outright
    table.replacement_cache_size = 1
    assert table.add(other, now=1).status is AddStatus.CACHED  # a cache of one holds one
    assert table.remove(make_ids(1, 54)[0]) is None  # unknown: nothing to drop, nothing promoted
    assert table.mark_failed(make_ids(1, 54)[0]) is False


def test_a_refreshed_contact_keeps_or_takes_addresses_and_its_failures_start_over() -> None:
    local = DHTID.from_peer(make_ids(1, 55)[0])
    table = RoutingTable(local, max_failures=3)
    (pid,) = peers_in_bucket(local, 255, 1, seed=56)
    first, second = Multiaddr("/ip4/8.8.8.8/tcp/1"), Multiaddr("/ip4/8.8.8.8/tcp/2")
    table.add(pid, addrs=[first], now=5)
    contact = table.get(pid)
    assert contact is not None and (contact.addrs, contact.last_seen, contact.failures) == ((first,), 5, 0)
    assert contact.info == PeerInfo(pid, (first,))
    table.mark_failed(pid)
    table.mark_failed(pid)
    assert table.add(pid, now=6) == AddResult(AddStatus.UPDATED)  # no addresses given: the known ones stay
    assert (contact.addrs, contact.last_seen, contact.failures) == ((first,), 6, 0)
    table.add(pid, addrs=[second], now=7)
    assert contact.addrs == (second,)
    table.mark_failed(pid)
    table.mark_failed(pid)
    assert table.mark_failed(pid) is True and pid not in table  # three in a row after the reset, not five


def test_the_replacement_cache_keeps_the_newest_and_a_returning_peer_moves_to_its_end() -> None:
    local = DHTID.from_peer(make_ids(1, 57)[0])
    table = RoutingTable(local, k=1, replacement_cache_size=2)
    ids = peers_in_bucket(local, 255, 4, seed=58)
    table.add(ids[0], now=0)
    for t, pid in enumerate(ids[1:3], start=1):
        assert table.add(pid, now=t).status is AddStatus.CACHED
    assert table.add(ids[1], now=3).status is AddStatus.CACHED  # seen again: now the newest
    assert [c.peer_id for c in table.replacements(255)] == [ids[2], ids[1]]
    table.add(ids[3], now=4)  # over the cache's size: the oldest goes
    assert [c.peer_id for c in table.replacements(255)] == [ids[1], ids[3]]
    assert table.remove(ids[0]) == table.get(ids[3])  # the most recently seen is promoted
    assert [c.peer_id for c in table.replacements(255)] == [ids[1]]


def test_promotion_skips_a_replacement_whose_group_is_full_in_the_bucket_or_the_table() -> None:
    """A replacement is cached while its group has room; by the time a slot frees, others of its group
    may have filled it: the newest replacement that still fits is promoted, not the newest."""
    g2, g3, g5 = ip_group("2.2.2.2"), ip_group("3.3.3.3"), ip_group("5.5.5.5")
    for per_bucket, total in ((2, 10), (5, 2)):  # the bucket's limit binds, then the table's
        local = DHTID.from_peer(make_ids(1, 59)[0])
        table = RoutingTable(local, k=3, replacement_cache_size=4, max_per_ip_group=per_bucket,
                             max_per_ip_group_total=total)
        a, b, x, d, c1, c2 = peers_in_bucket(local, 255, 6, seed=60)
        table.add(a, ip_group=ip_group("1.1.1.1"), now=0)
        table.add(b, ip_group=g2, now=0)
        table.add(x, ip_group=g5, now=0)
        for t, (pid, group) in enumerate(((d, g3), (c1, g2), (c2, g2)), start=1):
            assert table.add(pid, ip_group=group, now=t).status is AddStatus.CACHED
        assert table.remove(x) == table.get(c2)  # the newest fits: g2 now holds 2
        assert table.remove(a) == table.get(d)  # c1 (g2, at its limit) is passed over for the older d
        assert [c.peer_id for c in table.replacements(255)] == [c1]
        assert table.remove(b) is None or table.get(c1) is not None  # one g2 slot free: c1 fits again
        assert c1 in table
        # a replacement left in the cache while the bucket had room is taken out of the cache when added
        table.remove(c2)
        assert c1 in table and table.replacements(255) == []


def test_a_table_without_groups_promotes_any_replacement() -> None:
    local = DHTID.from_peer(make_ids(1, 61)[0])
    table = RoutingTable(local, k=1, replacement_cache_size=1)
    a, b = peers_in_bucket(local, 255, 2, seed=62)
    table.add(a, now=0)
    table.add(b, now=1)
    assert table.remove(a) == table.get(b)


def test_a_cached_peer_added_once_its_group_has_room_leaves_the_cache() -> None:
    """A replacement whose group was full when a slot freed stays cached beside the free slot; added
    once its group has room, it is a contact and no longer a replacement."""
    g = ip_group("7.7.7.7")
    local = DHTID.from_peer(make_ids(1, 63)[0])
    table = RoutingTable(local, k=2, replacement_cache_size=2, max_per_ip_group_total=1)
    a, b, c = peers_in_bucket(local, 255, 3, seed=64)
    (elsewhere,) = peers_in_bucket(local, 254, 1, seed=65)
    table.add(a, now=0)
    table.add(b, now=0)
    assert table.add(c, ip_group=g, now=1).status is AddStatus.CACHED
    assert table.add(elsewhere, ip_group=g, now=1).status is AddStatus.ADDED  # g's one slot in the table
    assert table.remove(b) is None  # c does not fit: the slot stays free, c stays cached
    assert [r.peer_id for r in table.replacements(255)] == [c]
    table.remove(elsewhere)
    assert table.add(c, ip_group=g, now=2).status is AddStatus.ADDED
    assert c in table and table.replacements(255) == []


def test_lookups_and_answers_refresh_buckets_down_to_bucket_zero() -> None:
    """A contact in bucket 1 puts bucket 0 among those refreshed; a lookup of an id there, or an answer
    from a contact, counts as the bucket's refresh."""
    (pid,) = make_ids(1, 66)
    local = DHTID(DHTID.from_peer(pid) ^ 0b10)  # the peer lands in our bucket 1
    table = RoutingTable(local, rng=random.Random(67))
    table.add(pid, now=0)
    assert table.bucket_of(DHTID.from_peer(pid)) == 1
    stale = sorted(local.bucket_index(t) for t in table.stale_buckets(now=60, refresh_interval=60))
    assert stale == list(range(0, 256))
    table.touch(DHTID(int(local) ^ 1), now=61)  # bucket 0
    assert 0 not in [local.bucket_index(t) for t in table.stale_buckets(now=61, refresh_interval=60)]
    table.mark_seen(pid, now=100)
    assert 1 not in [local.bucket_index(t) for t in table.stale_buckets(now=120, refresh_interval=60)]
    table.mark_seen(make_ids(1, 68)[0], now=100)  # not a contact: nothing happens


def test_relayed_addresses_are_not_grouped_by_their_relay() -> None:
    """A relayed peer is observed at its relay's address: grouping it there would let one relay's
    peers fill only two slots of a bucket, so relayed addresses are exempt, wherever the circuit is."""
    relay = make_ids(1, 69)[0].to_base58()
    assert ip_group(f"/ip4/8.8.8.8/tcp/4001/p2p/{relay}/p2p-circuit") is None
    assert ip_group(Multiaddr(f"/ip4/8.8.8.8/tcp/4001/p2p/{relay}/p2p-circuit")) is None
    assert ip_group(f"/ip4/8.8.8.8/tcp/4001/p2p/{relay}") == "8.8.8.0/24"


def test_the_table_wide_group_count_falls_by_one_per_contact_removed() -> None:
    g = ip_group("9.9.9.9")
    local = DHTID.from_peer(make_ids(1, 70)[0])
    table = RoutingTable(local, max_per_ip_group_total=2)
    a, b, c, d = (peers_in_bucket(local, index, 1, seed=71)[0] for index in (255, 254, 253, 252))
    assert table.add(a, ip_group=g, now=0).status is AddStatus.ADDED
    assert table.add(b, ip_group=g, now=0).status is AddStatus.ADDED
    table.remove(a)
    assert table.add(c, ip_group=g, now=1).status is AddStatus.ADDED  # one slot freed in the table
    assert table.add(d, ip_group=g, now=1) == AddResult(AddStatus.REJECTED, f"ip group {g} limit reached in table")


def test_a_slow_peer_frees_its_slot_and_the_lookup_stops_waiting_but_takes_its_late_answer() -> None:
    ids = sorted(make_ids(8, 23), key=lambda p: DHTID.from_peer(p) ^ 0)  # closest to 0 first
    lookup = Lookup(DHTID(0), 3, 2, [PeerInfo(p) for p in ids[:3]])
    a, b = lookup.next_queries()
    assert (a.peer_id, b.peer_id) == (ids[0], ids[1]) and lookup.in_flight == 2
    lookup.on_slow(ids[0])  # silent so far: its slot goes to the next candidate
    assert lookup.in_flight == 1
    (c,) = lookup.next_queries()
    assert c.peer_id == ids[2] and lookup.in_flight == 2
    lookup.on_slow(ids[0])  # twice is once
    lookup.on_slow(ids[5])  # never asked: nothing
    assert lookup.in_flight == 2
    lookup.on_response(ids[1], [])
    lookup.on_response(ids[2], [])
    # the slow peer is no longer waited for: the two that answered are the k closest live
    assert lookup.in_flight == 0 and lookup.done
    assert [p.peer_id for p in lookup.result()] == [ids[1], ids[2]]
    # its late answer counts (no slot given back twice) and brings a closer peer to ask
    closer = next(p for p in make_ids(200, 24) if DHTID.from_peer(p) ^ 0 < DHTID.from_peer(ids[0]) ^ 0)
    assert lookup.on_response(ids[0], [PeerInfo(closer)]) == 1
    assert lookup.in_flight == 0 and not lookup.done
    assert [p.peer_id for p in lookup.result()] == [ids[0], ids[1], ids[2]]
    (d,) = lookup.next_queries()
    assert d.peer_id == closer


def test_a_slow_peer_that_then_fails_is_dropped_without_giving_its_slot_back_twice() -> None:
    ids = make_ids(4, 25)
    lookup = Lookup(DHTID(0), 4, 1, [PeerInfo(p) for p in ids])
    (first,) = lookup.next_queries()
    lookup.on_slow(first.peer_id)
    (second,) = lookup.next_queries()
    lookup.on_failure(first.peer_id)
    assert lookup.in_flight == 1  # the second's query is still the one in flight
    assert lookup.on_response(first.peer_id, []) == 0  # failed: a reply after that is ignored
    assert lookup.next_queries() == []
    lookup.on_failure(ids[0] if ids[0] not in (first.peer_id, second.peer_id) else make_ids(1, 99)[0])
    lookup.on_failure(make_ids(1, 98)[0])  # never a candidate: nothing
    assert lookup.in_flight == 1
    lookup.on_response(second.peer_id, [])
    assert first.peer_id not in [p.peer_id for p in lookup.result()]


def test_answers_after_stop_are_ignored_even_from_asked_peers() -> None:
    ids = make_ids(6, 28)
    lookup = Lookup(DHTID(0), 4, 2, [PeerInfo(p) for p in ids[:2]])
    a, b = lookup.next_queries()
    lookup.stop()
    assert lookup.on_response(a.peer_id, [PeerInfo(p) for p in ids[2:]]) == 0
    assert lookup.result() == [] and lookup.done and lookup.next_queries() == []


def test_contacts_that_have_not_answered_for_a_while_are_listed_longest_quiet_first() -> None:
    local = DHTID.from_peer(make_ids(1, 60)[0])
    table = RoutingTable(local, k=20)
    ids = make_ids(4, 61)
    for t, pid in enumerate(ids):
        table.add(pid, now=float(t))
    table.mark_seen(ids[0], now=50, answered=False)  # it called us: still quiet
    table.mark_seen(ids[1], now=50)  # it answered
    assert [c.peer_id for c in table.unanswered(now=10, after=8)] == [ids[0], ids[2]]
    assert [c.peer_id for c in table.unanswered(now=10, after=7)] == [ids[0], ids[2], ids[3]]
    assert table.unanswered(now=10, after=11) == []
    late, early = make_ids(2, 62)
    table.add(late, now=9, answered=False)  # callers that never answered: first, earliest joined first,
    table.add(early, now=5, answered=False)  # once new_after has passed since they joined
    assert [c.peer_id for c in table.unanswered(now=10, after=11, new_after=6)] == []
    assert [c.peer_id for c in table.unanswered(now=11, after=12, new_after=6)] == [early]
    assert [c.peer_id for c in table.unanswered(now=15, after=8, new_after=6)] == [early, late, ids[0], ids[2], ids[3]]
