"""Which records go where, sans-I/O: whether we are one of a key's replicas, what a server
hands over to peers now among its keys' closest, which keys it need not hand over at its
republish because a store of them reached it lately (:class:`StoresSeen`), and what a read
keeps a copy of, and where (:func:`copyable`, :func:`path_copy`).

The DHT's I/O shell (:class:`.dht.DHT`) sends what these decide when a server joins its table
and on each republish; the simulator (``p2p/sim``) sends it over its modelled network, so that
a record's life under churn is measured on the rules the real peers keep.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence

from libp2p.peer.id import ID

from .proto import dht_pb2 as pb
from .records import DHTRecord, LocalStore
from .routing import DHTID, PeerInfo, RoutingTable


def is_replica(local: DHTID, target: int, closest: Sequence[DHTID], replicas: int) -> bool:
    """Whether ``local`` is one of the ``replicas`` closest to ``target``, given the closest other
    servers it knows (closest first): with fewer than ``replicas`` known, it is."""
    if len(closest) < replicas:
        return True
    return int(local) ^ target < int(closest[replicas - 1]) ^ target


def copyable(records: Sequence[DHTRecord]) -> bool:
    """Whether a copy of a key's ``records`` that its writers' later stores never reach (a
    reader's own cache, a peer on its lookup's path) stays true to the key: a plain value's does,
    a dictionary's does not.

    A plain value has one writer, and a copy of it is a version of that writer's value until it
    expires. A dictionary's subkeys come from many writers, whose later stores go to the replicas:
    a copy is a snapshot that hides every writer since from the first-copy reads that meet it, for
    the records' lifetime. Simulated (bench/prefix_freshness.py, 1,000 peers, 16 expert servers
    declaring under one prefix, 4 reads a second): with copies of dictionaries left on the path,
    61.6% of the reads missed a server, 5.4 of them on average; none without. A trainer's own
    cache once held a prefix's snapshot that lacked every live expert (a CI run's MoE bench)."""
    return bool(records) and all(r.subkey is None for r in records)


def path_copy(records: Sequence[DHTRecord], lacking: Sequence[PeerInfo], holders: Collection[ID],
              target: int, *, dictionaries: bool = False) -> PeerInfo | None:
    """Where a read leaves a copy of the ``records`` it found (Kademlia's caching along the
    path): the peer nearest ``target`` that its lookup met lacking them, once someone held them;
    never for records that are not :func:`copyable`. ``dictionaries``: copy a dictionary's too,
    as the DHT did before (the simulator's comparison)."""
    if not records or not lacking or not holders or not (dictionaries or copyable(records)):
        return None
    return min(lacking, key=lambda p: p.dht_id.xor_distance(target))


def hand_over(table: RoutingTable, storage: LocalStore, peers: Iterable[ID], *, replicas: int, now: float,
              skip: Collection[bytes] = frozenset(), nearest_only: float | None = None,
              max_keys: int = 50_000) -> dict[ID, list[DHTRecord]]:
    """The records each of ``peers`` should hold from us: those of every key we still replicate
    (by our table) for which that peer is among the ``replicas`` closest (with us, so the other
    ``replicas - 1``), except the keys in ``skip``. ``nearest_only`` (the table's time): only the keys of
    which no good contact (:meth:`RoutingTable.is_good`, besides ``peers``) is a nearer replica:
    when a server joins, each of a key's replicas meets it, and one copy is enough. Only the first ``max_keys`` keys are looked at,
    to bound one pass's CPU."""
    plan: dict[ID, list[DHTRecord]] = defaultdict(list)
    wanted = set(peers)
    if not wanted:
        return {}
    for key in storage.keys()[:max_keys]:
        if key in skip:
            continue
        target = int(DHTID.from_key(key))
        others = table.nearest(target, replicas)
        if not is_replica(table.local, target, [c.dht_id for c in others], replicas):
            continue  # we are no longer a replica: not ours to spread
        if nearest_only is not None:
            ours = int(table.local) ^ target
            if any(int(c.dht_id) ^ target < ours and table.is_good(c, nearest_only)
                   for c in others if c.peer_id not in wanted):
                continue  # a nearer replica hands it over
        records = storage.records_at(key, now)
        for contact in others[: replicas - 1]:
            if contact.peer_id in wanted:
                plan[contact.peer_id].extend(records)
    return dict(plan)


class StoresSeen:
    """When a store of each key last reached us, for the Kademlia paper's republish rule (§2.5):
    a replica that received a key's store within the republish interval assumes the key's other
    replicas received it too, and leaves that key out of its own republish's hand-over. As the
    replicas' intervals are not in step, about one of them hands a key over per interval (and a
    writer's own republish, which reaches them all, spares every one), not each of the
    ``replicas`` to every other (simulated at 300 peers: 2,678 copies of a record per hour).

    Only keys a store reached are noted, and notes older than the interval are dropped at each
    :meth:`recent`: its size is bounded by the store's keys."""

    def __init__(self) -> None:
        self._at: dict[bytes, float] = {}

    def note(self, request: pb.StoreRequest, response: pb.StoreResponse, now: float) -> None:
        """The keys of ``request`` that our answer did not refuse (stored, or already held)."""
        for raw, result in zip(request.records, response.results):
            if result.status != pb.StoreResult.REJECTED:
                self._at[raw.key] = now

    def recent(self, within: float, now: float) -> set[bytes]:
        """The keys a store reached within ``within`` seconds of ``now``; older notes are dropped."""
        self._at = {key: at for key, at in self._at.items() if now - at < within}
        return set(self._at)

    def __len__(self) -> int:
        return len(self._at)


def republish_skip(seen: StoresSeen, own: Iterable[bytes], interval: float, now: float) -> set[bytes]:
    """The keys a republish's hand-over leaves out: those a store reached within ``interval``
    (:class:`StoresSeen`: it went to the other replicas too) and our ``own`` (the republish has
    just stored them again, at every replica)."""
    skip = seen.recent(interval, now)
    skip.update(own)
    return skip
