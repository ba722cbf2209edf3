"""What a DHT peer answers, sans-I/O: finds, stores, and whom a caller's claims put in the table.

The DHT's I/O shell (:class:`.dht.DHT`) calls these with what the connection
showed (the caller's peer id, where the connection came from); the simulator
(``p2p/sim``) calls them with its modelled peers. Both then act on the result
(a new contact may get our records; a full bucket's oldest contact is pinged).
"""

from __future__ import annotations

from collections.abc import Sequence

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from ..addresses import is_relayed
from ..errors import RemoteProtocolError
from . import protocol as wire
from .proto import dht_pb2 as pb
from .records import DHTError, DHTKey, DHTRecord, LocalStore
from .routing import AddResult, RoutingTable, ip_group


def check_find(request: pb.FindRequest) -> None:
    """Every rule a find request must keep before anything is looked up (:class:`wire.BadDHTRequest`)."""
    try:
        wire.check_batch(len(request.queries), "queries")
        for q in request.queries:
            wire.query_target(q)
            if q.key:
                DHTKey.decode(q.key)
    except (RemoteProtocolError, DHTError) as e:
        raise wire.BadDHTRequest(str(e)) from None


def answer_find(request: pb.FindRequest, caller: ID, *, table: RoutingTable, storage: LocalStore, server: bool,
                now: float, budget: int) -> pb.FindResponse:
    """The answer to a (checked) find: each key's records while we serve (at most ``budget``
    bytes in all; a record that does not fit is left out and the result marked truncated),
    and the closest contacts we know, except to a first-copy read we could answer."""
    response = pb.FindResponse(server=server)
    for query in request.queries:
        target = wire.query_target(query)
        result = response.results.add()
        if query.key and server:
            for rec in storage.records_at(query.key, now):
                if rec.size > budget:
                    result.truncated = True
                    continue
                budget -= rec.size
                result.records.append(rec.to_pb())
        if not (query.first_copy and result.records):
            result.closer.extend(wire.peer_entry(c) for c in table.nearest(target, exclude=[caller]))
    return response


def check_store(request: pb.StoreRequest) -> None:
    """A store request's size limit, checked before anything is stored (:class:`wire.BadDHTRequest`)."""
    try:
        wire.check_batch(len(request.records), "records")
    except RemoteProtocolError as e:
        raise wire.BadDHTRequest(str(e)) from None


def answer_store(request: pb.StoreRequest, caller: ID, *, storage: LocalStore, server: bool,
                 now: float) -> pb.StoreResponse:
    """Store what a (checked) request sent, record by record (each by every rule of the store):
    STORED, STALE (we hold as new or newer) or REJECTED with the reason; a client stores nothing."""
    response = pb.StoreResponse(server=server)
    for raw in request.records:
        result = response.results.add()
        if not server:
            result.status, result.error = pb.StoreResult.REJECTED, "this peer is a DHT client and stores nothing"
            continue
        try:
            stored = storage.store(DHTRecord.from_pb(raw), now, origin=caller)
        except DHTError as e:
            result.status, result.error = pb.StoreResult.REJECTED, str(e)
        else:
            result.status = pb.StoreResult.STORED if stored else pb.StoreResult.STALE
    return response


def admit_caller(table: RoutingTable, caller: ID, sender: pb.Sender, observed: Multiaddr | None,
                 now: float) -> tuple[AddResult, list[Multiaddr]] | None:
    """Route to a caller only if it says it serves and came over a direct connection
    (``observed``: where it came from; None when relayed or unknown) from an address it
    claims to listen on. The table's verdict and the addresses it was added with; None when
    it was not a candidate (or was already known: then it is marked seen)."""
    if not sender.server:
        return None
    if caller in table:
        table.mark_seen(caller, now, answered=False)
        return None
    if observed is None:
        return None
    addrs = wire.same_host(wire.decode_addrs(sender.addrs, direct_only=True), observed)
    if not addrs:
        return None
    return table.add(caller, addrs=addrs, ip_group=ip_group(observed), now=now, answered=False), addrs


def admit_answerer(table: RoutingTable, peer: ID, server: bool, observed: Multiaddr | None,
                   known_addrs: Sequence[Multiaddr], now: float) -> tuple[AddResult, list[Multiaddr]] | None:
    """A peer answered us: a client leaves the table; a server over a direct connection
    (``observed``) joins it with its ``known_addrs`` (direct ones, bounded). Same result as
    :func:`admit_caller`."""
    if not server:
        table.remove(peer)
        return None
    if peer in table:
        table.mark_seen(peer, now)
        return None
    if observed is None:
        return None  # reached through a relay: not a server anyone could dial
    addrs = [a for a in known_addrs if not is_relayed(a)][: wire.MAX_ADDRS]
    if not addrs:
        return None
    return table.add(peer, addrs=addrs, ip_group=ip_group(observed), now=now), addrs

