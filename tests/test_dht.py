"""The DHT between real Nodes on loopback: storing, reading, replication, modes, joining, and hostile peers.

Swarms here live in one process (one trio loop); tests/test_dht_churn.py runs
a swarm across processes. Timeouts are upper bounds only; nothing asserts speed.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio
from libp2p.peer.id import ID

from p2p.hooks import ExternalAddresses, Reachability
from p2p import Node
from p2p.errors import ConfigError
from p2p.dht import (
    DHT,
    DHTBootstrapError,
    DHTConfig,
    DHTRecord,
    ExpirationTooFar,
    InvalidKey,
    InvalidSignature,
    RecordTooLarge,
    Schema,
    SchemaViolation,
    StoreRejected,
    owned,
    sign_record,
)
from p2p.dht import protocol as wire
from p2p.dht.proto import dht_pb2 as pb
from p2p.dht.records import DHTKey, signed_payload
from p2p.dht.routing import DHTID
from p2p.identity import new_identity
from p2p.rpc import CallContext

from .conftest import loopback_config

pytestmark = pytest.mark.timeout(90)


def addr_of(node: Node) -> str:
    return str(node.addrs[0])


class WallClock:
    """A wall clock that tests move forward (the swarm's expirations are compared with it): no sleeping."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@asynccontextmanager
async def swarm(n: int, *, first: DHT | None = None, modes: list[str] | None = None,
                clock: WallClock | None = None, **config: Any) -> AsyncIterator[list[DHT]]:
    """``n`` DHT peers, each joining through the first (or through ``first``), sharing ``clock`` if given."""
    async with AsyncExitStack() as stack:
        dhts: list[DHT] = []
        for i in range(n):
            boot = first or (dhts[0] if dhts else None)
            node_config = loopback_config(initial_peers=[addr_of(boot.node)] if boot else [])
            node = await stack.enter_async_context(Node.open(node_config))
            mode = modes[i] if modes else "server"
            dht_config = DHTConfig(mode=mode, **config)  # type: ignore[arg-type]
            dhts.append(await stack.enter_async_context(DHT.open(node, dht_config, clock=clock or time.time)))
        yield dhts


def later(seconds: float = 60.0) -> float:
    return time.time() + seconds


# ---------------------------------------------------------------- storing and reading


async def test_every_peer_reads_what_any_peer_stored() -> None:
    async with swarm(8) as dhts:
        for i, dht in enumerate(dhts):
            assert await dht.store(f"key-{i}", f"value-{i}".encode(), later())
        for i in range(len(dhts)):
            for reader in dhts:
                found = await reader.get(f"key-{i}")
                assert found is not None and found.value == f"value-{i}".encode()
        assert await dhts[3].get("never-stored") is None


async def test_values_live_on_the_replicas_closest_to_their_key() -> None:
    async with swarm(10, replicas=3) as dhts:
        assert await dhts[0].store("placed", b"v", later())
        target = DHTID.from_key(DHTKey.encode("placed"))
        by_distance = sorted(dhts, key=lambda d: int(d.local_id) ^ int(target))
        holders = [d for d in dhts if d.storage.records_at(DHTKey.encode("placed"), time.time())]
        assert set(map(id, by_distance[:3])) <= set(map(id, holders))
        assert len(holders) <= 4  # the replicas, plus the writer if it counted itself among them


async def test_newer_expiration_wins_and_expired_values_vanish() -> None:
    clock = WallClock()
    async with swarm(5, clock=clock) as dhts:
        assert await dhts[0].store("k", b"long", later(100))
        assert not await dhts[1].store("k", b"older", later(50))  # not newer: refused everywhere
        found = await dhts[2].get("k", latest=True)
        assert found is not None and found.value == b"long"
        assert await dhts[3].store("k", b"newest", later(200))
        found = await dhts[4].get("k", latest=True)
        assert found is not None and found.value == b"newest"

        assert await dhts[0].store("short", b"v", clock() + 1.0)
        assert (await dhts[1].get("short", latest=True)) is not None
        clock.advance(1.2)  # every peer's wall clock, at once: no sleeping
        for dht in dhts:
            assert await dht.get("short", latest=True) is None


async def test_subkeys_from_many_writers_merge_under_one_key() -> None:
    async with swarm(6) as dhts:
        for i, dht in enumerate(dhts):
            assert await dht.store("run:progress", f"step {i}".encode(), later(), subkey=str(dht.node.peer_id))
        found = await dhts[0].get("run:progress", latest=True)
        assert found is not None and isinstance(found.value, dict)
        assert {k: v.value for k, v in found.value.items()} == {
            str(d.node.peer_id): f"step {i}".encode() for i, d in enumerate(dhts)}


async def test_get_many_shares_rpcs_across_keys() -> None:
    async with swarm(8) as dhts:
        keys = [f"expert.{i}" for i in range(24)]
        assert all(await dhts[1].store_many([DHTRecord.make(k, k.encode(), later()) for k in keys]))
        reader = dhts[5]
        calls: list[str] = []
        real_call = reader.node.rpc.call

        async def counting_call(peer_id: ID, method: str, *args: Any, **kwargs: Any) -> Any:
            calls.append(method)
            return await real_call(peer_id, method, *args, **kwargs)

        reader.node.rpc.call = counting_call  # type: ignore[method-assign]
        reader.cache.expire(later(10_000))
        found = await reader.get_many(keys, latest=True)
        assert {k: v.value if v else None for k, v in found.items()} == {k: k.encode() for k in keys}
        finds = calls.count(wire.FIND)
        assert finds <= len(dhts) - 1, f"{finds} find RPCs for {len(keys)} keys among {len(dhts)} peers"


async def test_found_values_are_cached_near_the_reader() -> None:
    async with swarm(12, replicas=2) as dhts:
        assert await dhts[0].store("popular", b"v", later())
        raw = DHTKey.encode("popular")
        before = sum(1 for d in dhts if d.storage.records_at(raw, time.time()))
        reader = next(d for d in dhts if not d.storage.records_at(raw, time.time()))
        for holder in dhts:  # the reader must go through peers that lack the value to find it
            if holder.storage.records_at(raw, time.time()):
                reader.table.remove(holder.node.peer_id)
        assert (await reader.get("popular")) is not None
        assert reader.cache.records_at(raw, time.time())
        with trio.fail_after(10):
            while sum(1 for d in dhts if d.storage.records_at(raw, time.time())) <= before:
                await trio.sleep(0.05)



async def test_a_dictionary_found_is_not_copied_near_the_reader() -> None:
    """A read leaves a copy of a plain value on its path, never of a dictionary: the writers of its
    other subkeys store to the replicas, and the copy would hide them from the readers that meet it."""
    async with swarm(12, replicas=2) as dhts:
        assert await dhts[0].store("prefix", b"a", later(), subkey="0")
        assert await dhts[0].store("popular", b"v", later())
        raws = [DHTKey.encode(k) for k in ("prefix", "popular")]

        def holding(raw: bytes) -> int:
            return sum(1 for d in dhts if d.storage.records_at(raw, time.time()))

        before = [holding(raw) for raw in raws]
        reader = next(d for d in dhts if not any(d.storage.records_at(raw, time.time()) for raw in raws))
        for key, raw in zip(("prefix", "popular"), raws):
            for holder in dhts:  # the reader goes through peers that lack it to find it
                if holder.storage.records_at(raw, time.time()):
                    reader.table.remove(holder.node.peer_id)
            assert (await reader.get(key)) is not None
        with trio.fail_after(10):
            while holding(raws[1]) <= before[1]:  # the plain value's copy, sent after the dictionary's would be
                await trio.sleep(0.05)
        assert holding(raws[0]) == before[0]


async def test_a_reader_keeps_a_plain_value_it_read_never_a_dictionary() -> None:
    """A client answers a first-copy read of a plain value it read before from its own copy; it
    keeps no copy of a dictionary, whose other writers' later subkeys a copy would hide for the
    records' lifetime (a trainer's copy of an expert prefix once hid every live expert)."""
    async with swarm(4, modes=["server", "server", "server", "client"]) as dhts:
        reader = dhts[3]
        assert await dhts[0].store("prefix", b"a", later(), subkey="0")
        first = await reader.get("prefix")
        assert first is not None and set(first.value) == {"0"}  # type: ignore[arg-type]
        assert not reader.cache.records_at(DHTKey.encode("prefix"), time.time())
        assert await dhts[1].store("prefix", b"b", later(), subkey="1")
        fresh = await reader.get("prefix")
        assert fresh is not None and set(fresh.value) == {"0", "1"}  # type: ignore[arg-type]
        assert await dhts[0].store("plain", b"v1", later(60))
        assert (await reader.get("plain")).value == b"v1"  # type: ignore[union-attr]
        assert reader.cache.records_at(DHTKey.encode("plain"), time.time())
        assert await dhts[0].store("plain", b"v2", later(120))
        assert (await reader.get("plain")).value == b"v1"  # type: ignore[union-attr]  # its own copy
        assert (await reader.get("plain", latest=True)).value == b"v2"  # type: ignore[union-attr]


async def test_a_joining_server_receives_the_records_it_is_now_closest_to() -> None:
    async with swarm(4, replicas=2) as dhts:
        for i in range(40):
            assert await dhts[i % 4].store(f"k{i}", b"v", later())
        async with swarm(1, first=dhts[0], replicas=2) as (newcomer,):
            with trio.fail_after(15):
                while not len(newcomer.storage):
                    await trio.sleep(0.05)
            now = time.time()
            for raw in newcomer.storage.keys():
                target = DHTID.from_key(raw)
                everyone = sorted(dhts + [newcomer], key=lambda d: int(d.local_id) ^ int(target))
                assert newcomer in everyone[:2], "handed a record it is not a replica of"
                assert newcomer.storage.records_at(raw, now)


# ---------------------------------------------------------------- owned records and bad input


async def test_owned_records_are_writable_only_by_their_owner() -> None:
    async with swarm(5) as dhts:
        owner, other = dhts[0], dhts[1]
        key = owned("profile", owner.node.peer_id)
        assert await owner.store(key, b"mine", later())
        with pytest.raises(InvalidSignature):
            await other.store(key, b"hijacked", later(120))
        # Signed by the wrong key and sent straight to every server: each one refuses it.
        forged = sign_record(other.node.key_pair.private_key, key, b"hijacked", later(120))
        response = await other.node.rpc.call(dhts[2].node.peer_id, wire.STORE,
                                             pb.StoreRequest(records=[forged.to_pb()]), pb.StoreResponse)
        assert response.results[0].status == pb.StoreResult.REJECTED
        assert "signed by another peer" in response.results[0].error
        found = await dhts[4].get(key, latest=True)
        assert found is not None and found.value == b"mine"
        # An owned subkey: each peer signs its own entry of a shared key.
        assert await other.store("roster", b"here", later(), subkey=owned("", other.node.peer_id))
        found = await dhts[3].get("roster", latest=True)
        assert found is not None and isinstance(found.value, dict) and len(found.value) == 1


async def test_bad_values_fail_with_clear_errors_and_store_nothing() -> None:
    schema = Schema()
    schema.declare("num:", check=lambda rec: None if rec.value.isdigit() else (_ for _ in ()).throw(
        SchemaViolation("num: values are decimal digits")))
    async with swarm(4, max_value_size=1024, schema=schema) as dhts:
        with pytest.raises(RecordTooLarge, match="exceeds the limit"):
            await dhts[0].store("big", b"x" * 2048, later())
        with pytest.raises(ExpirationTooFar):
            await dhts[0].store("forever", b"v", time.time() + 10 * 365 * 86400)
        with pytest.raises(ExpirationTooFar):
            await dhts[0].store("nan", b"v", float("nan"))
        with pytest.raises(InvalidKey):
            await dhts[0].store(3.5, b"v", later())  # type: ignore[arg-type]
        with pytest.raises(InvalidKey):
            await dhts[0].get(True)
        with pytest.raises(SchemaViolation):
            await dhts[0].store("num:a", b"twelve", later())
        assert await dhts[0].store("num:a", b"12", later())
        for dht in dhts:
            assert not dht.storage.records_at(DHTKey.encode("big"), time.time())


async def test_servers_refuse_hostile_stores_and_honest_records_survive() -> None:
    async with swarm(3, max_stores_per_origin=50) as dhts:
        honest, victim, flooder = dhts
        assert await honest.store("honest", b"v", later())
        # A record whose signature field is garbage, one with a far expiration, and one over the size limit.
        rec = DHTRecord.make(owned("x", flooder.node.peer_id), b"v", later())
        garbled = pb.StoreRequest(records=[
            DHTRecord(rec.key, rec.value, rec.expiration, None, b"\x08\x01junk", b"sig").to_pb(),
            DHTRecord.make("far", b"v", time.time() + 10**9).to_pb(),
            DHTRecord.make("huge", b"x" * 100_000, later()).to_pb(),
        ])
        response = await flooder.node.rpc.call(victim.node.peer_id, wire.STORE, garbled, pb.StoreResponse)
        assert [r.status for r in response.results] == [pb.StoreResult.REJECTED] * 3
        assert "public key" in response.results[0].error and "ahead" in response.results[1].error
        # A flood of stores: the first 50 in the window are taken, the rest refused.
        statuses = []
        for start in range(0, 200, wire.MAX_BATCH):
            request = pb.StoreRequest(records=[DHTRecord.make(f"junk{i}", b"j", later(1)).to_pb()
                                               for i in range(start, min(200, start + wire.MAX_BATCH))])
            response = await flooder.node.rpc.call(victim.node.peer_id, wire.STORE, request, pb.StoreResponse)
            statuses += [(r.status, r.error) for r in response.results]
        refused = [e for s, e in statuses if s == pb.StoreResult.REJECTED]
        assert len(refused) >= 150 and "try again later" in refused[0]
        found = await victim.get("honest", latest=True)
        assert found is not None and found.value == b"v"
        # Oversized batches and garbled queries are refused as a whole.
        with pytest.raises(wire.BadDHTRequest, match="limit"):
            await flooder.node.rpc.call(victim.node.peer_id, wire.FIND,
                                        pb.FindRequest(queries=[pb.Query(key=b"sx")] * 65), pb.FindResponse)
        with pytest.raises(wire.BadDHTRequest, match="target"):
            await flooder.node.rpc.call(victim.node.peer_id, wire.FIND,
                                        pb.FindRequest(queries=[pb.Query(target=b"short")]), pb.FindResponse)
        with pytest.raises(wire.BadDHTRequest, match="malformed"):
            await flooder.node.rpc.call(victim.node.peer_id, wire.FIND,
                                        pb.FindRequest(queries=[pb.Query(key=b"\xffbad")]), pb.FindResponse)
        assert await victim.get("honest", latest=True) is not None


async def test_lookups_survive_peers_that_lie_in_find_replies() -> None:
    """Liars answer every find with themselves, made-up peers and junk: lookups still find the value."""
    async with swarm(6) as dhts:
        liars: list[Node] = []
        async with AsyncExitStack() as stack:
            for _ in range(3):
                node = await stack.enter_async_context(Node.open(loopback_config(initial_peers=[addr_of(dhts[0].node)])))
                fake_peers = [pb.PeerEntry(peer_id=new_identity().public_key.serialize()[:8])] + [
                    pb.PeerEntry(peer_id=ID.from_pubkey(new_identity().public_key).to_bytes(),
                                 addrs=[b"\x04\x7f\x00\x00\x01\x06\x00\x01"]) for _ in range(40)]

                def lie(node: Node = node, fakes: list[pb.PeerEntry] = fake_peers) -> Any:
                    async def on_find(request: pb.FindRequest, ctx: CallContext) -> pb.FindResponse:
                        me = pb.PeerEntry(peer_id=node.peer_id.to_bytes(), addrs=[a.to_bytes() for a in node.addrs])
                        forged = DHTRecord.make("target", b"lie", later(), None).to_pb()
                        forged.owner_public_key = b"junk"
                        return pb.FindResponse(server=True, results=[
                            pb.FindResult(closer=[me] * 5 + fakes, records=[forged]) for _ in request.queries])
                    return on_find

                node.rpc.add_unary(wire.FIND, pb.FindRequest, lie())
                liars.append(node)
                # Make every honest peer route to the liar, as if it were a close server.
                for dht in dhts:
                    dht.table.add(node.peer_id, addrs=node.addrs, ip_group=None, now=trio.current_time())
                    dht.node.add_addrs(node.peer_id, node.addrs)
            assert await dhts[1].store("target", b"truth", later())
            for dht in dhts:
                dht.cache.expire(later(10_000))
                found = await dht.get("target", latest=True, timeout=20)
                assert found is not None and found.value == b"truth"


# ---------------------------------------------------------------- modes and joining


async def test_clients_use_the_dht_but_stay_out_of_routing_tables() -> None:
    async with swarm(5, modes=["server", "server", "server", "client", "client"]) as dhts:
        clients = dhts[3:]
        assert await clients[0].store("from-client", b"c", later())
        found = await clients[1].get("from-client")
        assert found is not None and found.value == b"c"
        assert await dhts[1].get("from-client") is not None
        for dht in dhts:
            for client in clients:
                assert client.node.peer_id not in dht.table
        for client in clients:
            assert not len(client.storage) and len(client.table) >= 2


async def test_auto_mode_follows_reachability() -> None:
    async with swarm(2) as (a, b):
        async with Node.open(loopback_config(initial_peers=[addr_of(a.node)])) as n:
            n.set_external(ExternalAddresses(reachability=Reachability.UNKNOWN, judged=True))  # as the NAT layer does
            async with DHT.open(n, DHTConfig(mode="auto")) as dht:
                assert not dht.server
                await dht.get("anything")
                assert n.peer_id not in a.table
                n.set_external(ExternalAddresses(reachability=Reachability.PUBLIC, judged=True))
                with trio.fail_after(5):
                    while not dht.server:
                        await trio.sleep(0.01)
                # it announces itself (a lookup of its own id): no call of ours is needed for the
                # others to route to it (peers that turned public stayed out of every table)
                with trio.fail_after(5):
                    while not (n.peer_id in a.table and n.peer_id in b.table):
                        await trio.sleep(0.01)
        # A node nothing judges (no NAT layer) is taken at its word: auto serves.
        async with Node.open(loopback_config(initial_peers=[addr_of(a.node)])) as n, \
                DHT.open(n, DHTConfig(mode="auto")) as dht:
            assert dht.server


@pytest.mark.realtime  # a failed open that waited out its 10 s
async def test_opening_fails_instead_of_starting_a_separate_dht() -> None:
    async with Node.open(loopback_config()) as plain:  # a peer that runs no DHT
        async with Node.open(loopback_config(initial_peers=[addr_of(plain)])) as node:
            started = trio.current_time()
            with pytest.raises(DHTBootstrapError, match="refusing to start a separate DHT"):
                async with DHT.open(node, DHTConfig(mode="server", bootstrap_timeout=1.0)):
                    pass
            assert trio.current_time() - started < 10


async def test_an_emptied_routing_table_rebootstraps() -> None:
    async with swarm(3, maintenance_interval=0.2) as dhts:
        lonely = dhts[2]
        for contact in list(lonely.table):
            lonely.table.remove(contact.peer_id)
        assert not len(lonely.table)
        with trio.fail_after(10):
            while not len(lonely.table):
                await trio.sleep(0.05)
        assert await lonely.get("k") is None and await lonely.store("k", b"v", later())
        assert len(lonely.table) == 2  # the lookups met the peer that answered none of our calls yet


async def test_dead_replicas_cost_one_timeout_and_reads_still_succeed() -> None:
    async with swarm(6, replicas=3, rpc_timeout=1.0) as dhts:
        assert await dhts[0].store("k", b"v", later())
        raw = DHTKey.encode("k")
        holders = [d for d in dhts[1:] if d.storage.records_at(raw, time.time())]
        # Close two replicas' nodes the hard way: their connections drop mid-swarm.
        for dead in holders[:2]:
            await dead.node.host.close()
        reader = next(d for d in dhts[1:] if d not in holders[:2])
        reader.cache.expire(later(10_000))
        with trio.fail_after(15):
            found = await reader.get("k", latest=True)
        assert found is not None and found.value == b"v"


def test_signed_payload_is_domain_separated() -> None:
    # Why: a DHT signature must never be valid for anything else the key signs.
    assert signed_payload(b"sk", None, b"v", 1.0).startswith(b"dedloc-dht-record")


async def test_refresh_fills_a_thin_routing_table() -> None:
    async with swarm(8, maintenance_interval=0.2, refresh_interval=0.3) as dhts:
        thin = dhts[5]
        keep = next(iter(thin.table))
        for contact in list(thin.table):
            if contact.peer_id != keep.peer_id:
                thin.table.remove(contact.peer_id)
        assert len(thin.table) == 1
        with trio.fail_after(15):
            while len(thin.table) < 5:
                await trio.sleep(0.05)


async def test_maintenance_drops_a_contact_that_left() -> None:
    """A peer leaves a quiet swarm (no lookups): every table still holds it until maintenance
    pings the contacts that have not answered for ``check_after``, and the callers that never
    answered once ``check_new_after`` has passed since they joined (the last peer to join is
    only a caller in some tables: with the default 60 s grace it would still be there)."""
    async with swarm(4, maintenance_interval=0.2, check_after=1.0, check_new_after=1.0,
                     rpc_timeout=1.0) as dhts:
        gone = dhts[3]
        assert all(gone.node.peer_id in d.table for d in dhts[:3])
        await gone.node.host.close()
        with trio.fail_after(10):
            while any(gone.node.peer_id in d.table for d in dhts[:3]):
                await trio.sleep(0.05)
        assert all(len(d.table) == 2 for d in dhts[:3])  # the ones that answer stay


async def test_a_contact_whose_last_connection_closed_is_checked_at_once_and_dropped_if_gone() -> None:
    """At the defaults (quiet contacts checked after 20 min), a server that left was handed to every
    lookup near it for that long: in the namespace demo, its dials were refused 819 times in 50 s.
    Now its closed connection has it pinged a second later, and dropped; a contact whose connection
    merely closed, and that answers, stays."""
    async with swarm(4, rpc_timeout=1.0) as dhts:
        gone, stays = dhts[3], dhts[2]
        assert all(gone.node.peer_id in d.table for d in dhts[:3])
        await dhts[0].node.disconnect(stays.node.peer_id)
        await gone.node.host.close()
        with trio.fail_after(8):
            while any(gone.node.peer_id in d.table for d in dhts[:3]):
                await trio.sleep(0.05)
        await trio.sleep(1.5)  # its check (a ping that dials it again) is over
        assert stays.node.peer_id in dhts[0].table and all(len(d.table) == 2 for d in dhts[:3])


async def test_a_check_starts_only_for_a_contact_left_without_a_connection_and_so_many_at_once() -> None:
    """Not for a peer outside the table (a client that leaves), not while another connection to
    the contact stands, and no more at once than ``checks_per_pass`` (a flood of closing connections
    asks little)."""
    async with swarm(3, rpc_timeout=1.0, checks_per_pass=1, check_closed_after=30.0) as dhts:
        a, b, c = dhts
        async with Node.open(loopback_config()) as client:
            await client.connect(addr_of(a.node))
        await trio.sleep(0.2)
        assert client.peer_id not in a.table and not a._pinging
        a._closed(b.node.peer_id)  # one closed, the other stands
        assert not a._pinging
        await a.node.disconnect(b.node.peer_id)
        with trio.fail_after(5):
            while not a._pinging:
                await trio.sleep(0.02)
        assert a._pinging == {b.node.peer_id}
        await a.node.disconnect(c.node.peer_id)
        await trio.sleep(0.2)
        assert a._pinging == {b.node.peer_id}


@pytest.mark.parametrize("value, ok", [(None, True), (0.0, True), (1.0, True), (-0.5, False), (math.inf, False),
                                       (math.nan, False)])
def test_the_closed_contact_check_takes_a_finite_delay_or_none(value: float | None, ok: bool) -> None:
    config = DHTConfig(check_closed_after=value)
    if ok:
        config.validate()
    else:
        with pytest.raises(ConfigError, match="check_closed_after must be >= 0 and finite"):
            config.validate()


async def test_maintenance_checks_only_contacts_its_refresh_did_not_hear() -> None:
    """A pass refreshes first and picks the contacts to check after: a quiet contact that
    answered the refresh's lookups is not pinged again. With no refresh due, the same quiet
    contacts are checked (the check is there to be skipped)."""

    async def checked(refresh_interval: float) -> list[ID]:
        async with swarm(3, maintenance_interval=0.5, refresh_interval=refresh_interval, check_after=0.45,
                         check_new_after=0.45, rpc_timeout=1.0) as dhts:
            watched, seen = dhts[0], []
            check = watched._check_contact

            async def counted(peer_id: ID) -> None:
                seen.append(peer_id)
                await check(peer_id)

            watched._check_contact = counted  # type: ignore[method-assign]
            await trio.sleep(2.6)  # five passes
            assert len(watched.table) == 2
            return list(seen)  # not the closing's: a peer that left is quiet, and checked

    assert await checked(refresh_interval=0.001) == []  # every pass refreshes
    assert len(await checked(refresh_interval=3600.0)) >= 4


async def test_writers_republish_to_the_servers_now_closest() -> None:
    """Both replicas of a value die; the writer's republish puts it on the servers now closest."""
    async with swarm(7, replicas=2, maintenance_interval=0.2, republish_interval=0.5, rpc_timeout=1.0) as dhts:
        writer = dhts[0]
        assert await writer.store("survivor", b"v", later())
        raw = DHTKey.encode("survivor")
        replicas = [d for d in dhts[1:] if d.storage.records_at(raw, time.time())]
        assert replicas
        for dead in replicas:
            await dead.node.host.close()
        others = [d for d in dhts[1:] if d not in replicas]
        with trio.fail_after(20):
            while not any(d.storage.records_at(raw, time.time()) for d in others):
                await trio.sleep(0.05)
        reader = others[-1]
        reader.cache.expire(later(10_000))
        found = await reader.get("survivor", latest=True, timeout=10)
        assert found is not None and found.value == b"v"


async def test_a_replica_a_store_reached_lately_leaves_that_key_out_of_its_republish() -> None:
    """The Kademlia paper's republish rule (section 2.5): the store that reached a replica went to
    the key's other replicas too, so within the republish interval it does not hand the key over;
    after it, it does. A writer's republish stores its own records once, not again as a
    hand-over. Every replica handing every key to every other each interval cost 2,678 copies of
    a record per hour under simulated churn (docs/SCALE.md, finding 8)."""
    async with swarm(3, replicas=3, republish_interval=1.0, maintenance_interval=3600.0) as dhts:
        writer, a, b = dhts
        assert await writer.store("k", b"v", later())

        def served() -> list[int]:
            return [d.served["store"] for d in dhts]

        await trio.sleep(1.1)  # the store's notes are older than the interval now
        before = served()
        await writer._republish(time.time())
        assert served() == [before[0], before[1] + 1, before[2] + 1]  # stored again, not handed over too
        await a._republish(time.time())
        assert served() == [before[0], before[1] + 1, before[2] + 1]  # the writer's store just reached it
        await trio.sleep(1.1)
        await a._republish(time.time())
        assert served() == [before[0] + 1, before[1] + 1, before[2] + 2]  # none lately: to the other two


@pytest.mark.realtime  # loopback replies within ms, lookups within 4.5 s: alone, not beside a lab (one CI run saw 1.35 s)
async def test_silent_peers_do_not_hold_lookups_for_their_rpc_timeout() -> None:
    """A peer that accepts the call and never answers (10% of the simulated internet's) costs a
    lookup the reply timer's short wait, not the RPC timeout: py-libp2p's Kademlia hung every
    lookup on one such peer, and ours waited the whole timeout whenever one was among the k closest."""

    async def never(request: pb.FindRequest, ctx: CallContext) -> pb.FindResponse:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with swarm(8, rpc_timeout=6.0) as dhts:
        for silent in dhts[1:3]:
            silent.node.rpc.remove(wire.FIND)
            silent.node.rpc.add_unary(wire.FIND, pb.FindRequest, never)
        reader = dhts[6]
        assert all(s.node.peer_id in reader.table for s in dhts[1:3])  # among the k closest of any key
        assert reader.replies.slow_after == 1.0  # loopback replies came in ms: RFC 6298's floor
        for attempt in range(3):
            started = trio.current_time()
            assert await reader.get(f"absent-{attempt}") is None  # a lookup that runs to its end
            assert await reader.store(f"key-{attempt}", b"v", later())
            assert trio.current_time() - started < 4.5  # both; one silent peer waited for was 6 s each
        assert await dhts[7].get("key-0") is not None
