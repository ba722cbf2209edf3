"""The DHT: the swarm's shared dictionary, as Kademlia over the Node's RPC.

This is the I/O shell around the sans-I/O core (:mod:`.routing` decides whom to
ask and whom to keep, :mod:`.records` decides what a value is and whether to
keep it). What lives here is what needs the network or a clock:

* **Traversal.** Every read and write is an iterative lookup. Lookups of many
  keys (``get_many``, ``store_many``) share their RPCs: each round, the peers
  that several lookups want to ask get one ``dht.find`` carrying all their
  queries.
* **Replication.** A value goes to the ``replicas`` servers closest to its key
  (Kademlia's k plays two roles; like hivemind we keep routing width ``k`` and
  replication ``replicas`` apart, because every extra replica is an extra RPC on
  every store). Replicas hand their records to a newcomer that becomes one of
  the closest, the writer re-publishes its records, and replicas re-publish
  what they hold, so values outlive churn until they expire.
* **Caching.** A found value is kept locally and stored at the closest peer
  the lookup asked that lacked it, so popular keys get cheaper to read.
* **NAT awareness.** Only servers (publicly reachable peers) are put into
  routing tables; a peer behind NAT (or reachable only through a relay) is a
  client: it reads and writes through servers and serves nobody. In ``auto``
  mode the DHT follows the NAT layer's reachability.
* **Joining.** With initial peers, opening fails unless some DHT server
  answered, so a misconfigured peer never silently starts a DHT of its own;
  an emptied routing table re-bootstraps from the initial peers.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from ..addresses import is_relayed, parse_peer_addr, without_peer_id
from ..dialer import live_connection, remote_addr
from ..errors import ConfigError, DedlocError
from ..hooks import ConnectionInfo, ExternalAddresses, Observers, Reachability, Registration, SwarmObserver
from ..node import Node
from ..trio_util import unwrap_single_group
from ..rpc import CallContext, RpcError
from . import protocol as wire
from .events import DHTIsolated, DHTJoined, DHTMode, DHTModeChanged
from .proto import dht_pb2 as pb
from .records import (
    DHTError,
    DHTKey,
    DHTRecord,
    KeyLike,
    LocalStore,
    Schema,
    StoreRejected,
    ValueWithExpiration,
    owner_of,
    sign_record,
)
from . import maintenance, replication, serving
from .routing import AddResult, AddStatus, DHTID, Lookup, PeerInfo, RoutingTable
from .traversal import ReplyTimer, Search, Traversal

log = logging.getLogger(__name__)

#: Seconds our own listen addresses, as sent with each call, are reused before being recomputed.
SENDER_TTL = 5.0
#: What a routing table's contact is worth to the connection manager (``Node.value_peers``; others: 0).
CONTACT_VALUE = 5

#: ``observer(kind, seconds, outcome)``: one query this peer made (:meth:`DHT.observe_queries`).
QueryObserver = Callable[[str, float, str], None]


class DHTBootstrapError(DHTError):
    """Initial peers were given but no DHT server among them (or reachable through them) answered."""


@dataclass
class DHTConfig:
    """Settings of one peer's DHT; the defaults suit a swarm of tens to thousands of peers."""

    #: Bucket size and lookup width.
    k: int = 20
    #: Parallel RPCs per lookup: the libp2p Kademlia spec's 10 (the Kademlia paper's 3). Most calls
    #: of a lookup in a large swarm open a connection first; with three in flight, reads at 3,000
    #: simulated peers took 0.29 s median, with ten 0.17 s (bench/scale.py, docs/SCALE.md).
    alpha: int = 10
    #: ... and ``alpha_near`` while our replies come back within ``near_rtt`` s (the median of the
    #: last 16): with no round trips to hide, ten in flight only cost the peers CPU (bench/dht.py,
    #: 32 peers on one machine: a read 2.3 ms with three, 7.3 ms with ten).
    alpha_near: int = 3
    near_rtt: float = 0.05
    #: Servers each value is stored at.
    replicas: int = 5
    #: ``server`` serves others; ``client`` only queries; ``auto`` serves while reachable.
    mode: DHTMode = DHTMode.AUTO
    #: Time for one RPC (a dead peer costs at most this once: it is then skipped).
    rpc_timeout: float = 3.0
    #: Default time limit of one store/get (of any batch).
    op_timeout: float = 30.0
    #: Time to find a DHT server through the initial peers when opening.
    bootstrap_timeout: float = 30.0
    #: How often maintenance runs: expiry, bucket refresh, republishing, re-bootstrap.
    maintenance_interval: float = 30.0
    #: Buckets not used by a lookup for this long are refreshed with a random lookup.
    refresh_interval: float = 600.0
    #: Contacts that have not answered a call of ours for this long are pinged, up to
    #: ``checks_per_pass`` each maintenance pass, and dropped if they do not answer (as
    #: go-libp2p-kad-dht's refresh does). Without it, a peer that left stays in the near buckets,
    #: which lookups rarely ask: at 1,000 simulated peers after two hours of churn, 38% of the
    #: peers in the tables were unreachable, 21% with it (bench/scale.py, docs/SCALE.md).
    check_after: float = 1200.0
    #: A caller that has never answered us is pinged this long after it joined the table (a silent
    #: peer that calls was handed to every lookup near it), unless one of our calls hears it answer first.
    check_new_after: float = 60.0
    checks_per_pass: int = 16
    #: A contact whose last connection to us closed (it left, its link broke) is pinged this long
    #: after, and dropped if it does not answer: servers handed a peer that had left to every lookup
    #: near it until ``check_after`` (20 min; in the namespace demo, 819 dials refused in 50 s).
    #: Up to ``checks_per_pass`` such checks at once; None: only the maintenance pass checks.
    check_closed_after: float | None = 1.0
    #: Records are re-published this often by their writer and by their replicas.
    republish_interval: float = 600.0
    #: Keep found plain values locally and at the closest queried peer that lacked them
    #: (never a dictionary: :func:`.replication.copyable`).
    cache: bool = True
    #: Limits of the local store (see :class:`LocalStore`).
    max_value_size: int = 64 * 1024
    max_expiration_ahead: float = 24 * 3600.0
    max_stores_per_origin: int = 1000
    max_bytes: int = 256 * 1024 * 1024
    schema: Schema = field(default_factory=Schema)

    def validate(self) -> None:
        for name in ("k", "alpha", "alpha_near", "replicas", "checks_per_pass"):
            if getattr(self, name) < 1:
                raise ConfigError(f"DHT {name} must be at least 1, got {getattr(self, name)}")
        if self.replicas > self.k:
            raise ConfigError(f"DHT replicas ({self.replicas}) cannot exceed k ({self.k})")
        if self.mode not in tuple(DHTMode):
            raise ConfigError(f"DHT mode must be auto, server or client, got {self.mode!r}")
        if self.check_closed_after is not None and not (0 <= self.check_closed_after < math.inf):
            raise ConfigError(f"check_closed_after must be >= 0 and finite (or None), not {self.check_closed_after}")
        for name in ("rpc_timeout", "near_rtt", "op_timeout", "bootstrap_timeout", "maintenance_interval",
                     "refresh_interval", "check_after", "check_new_after", "republish_interval", "max_expiration_ahead"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"DHT {name} must be positive, got {getattr(self, name)}")

    def local_store(self) -> LocalStore:
        return LocalStore(max_value_size=self.max_value_size, max_expiration_ahead=self.max_expiration_ahead,
                          max_stores_per_origin=self.max_stores_per_origin, max_bytes=self.max_bytes,
                          schema=self.schema)


class DHT:
    """One peer's DHT. Open it on a running :class:`p2p.Node`::

        async with Node.open(NodeConfig(initial_peers=[...])) as node:
            async with DHT.open(node) as dht:
                await dht.store("run:progress", b"...", time.time() + 60, subkey=str(node.peer_id))
                found = await dht.get("run:progress", latest=True)

    Values are bytes (callers serialise); keys and subkeys are str, bytes or int.
    """

    def __init__(self, node: Node, config: DHTConfig, nursery: trio.Nursery,
                 clock: Callable[[], float] = time.time) -> None:
        self.node = node
        self.config = config
        self._nursery = nursery
        #: Wall time, for expirations (they travel on the wire); intervals use trio's clock.
        self._clock = clock
        self.local_id = DHTID.from_peer(node.peer_id)
        self.table = RoutingTable(self.local_id, k=config.k)
        self.storage = config.local_store()
        #: Values this peer found, for its own reads (a client's only store).
        self.cache = LocalStore(max_value_size=config.max_value_size, max_keys=10_000,
                                max_bytes=min(config.max_bytes, 32 * 1024 * 1024),
                                max_expiration_ahead=config.max_expiration_ahead)
        self._mine: dict[tuple[bytes, bytes | None], DHTRecord] = {}
        self._last_republish = trio.current_time()
        self._stores_seen = replication.StoresSeen()
        self._pinging: set[ID] = set()
        #: when a lookup stops waiting for a peer's reply (its call goes on to rpc_timeout)
        self.replies = ReplyTimer(ceiling=config.rpc_timeout)
        self._sender_cache: tuple[float, pb.Sender] | None = None
        #: Why the last call to a peer failed (for bootstrap's error); bounded, oldest first out.
        self._why: dict[ID, str] = {}
        self.server = self._wants_server()
        self._initial = self._initial_peers()
        #: Told of every query this peer made (:meth:`observe_queries`; the metrics' histograms).
        self._query_observers: Observers[QueryObserver] = Observers("the DHT's queries")
        #: Requests served, by kind (``find``, ``store``).
        self.served: Counter[str] = Counter()

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def open(cls, node: Node, config: DHTConfig | None = None, *,
                   clock: Callable[[], float] = time.time) -> AsyncIterator[DHT]:
        """Serve and join the DHT for the duration of the block.

        In ``auto`` mode it serves while the node is publicly reachable (as the
        NAT layer judges it; a node without one is taken at its word and serves).
        ``clock`` is the wall clock that expirations are compared with (tests
        pass a fake one to expire records without waiting).

        Raises :class:`DHTBootstrapError` when the node has initial peers but no
        DHT server answered within ``bootstrap_timeout``.
        """
        config = config or DHTConfig()
        config.validate()
        with unwrap_single_group():
            async with trio.open_nursery() as nursery:
                dht = cls(node, config, nursery, clock)
                node.rpc.register_error(wire.BadDHTRequest)
                node.rpc.add_unary(wire.FIND, pb.FindRequest, dht._on_find)
                node.rpc.add_unary(wire.STORE, pb.StoreRequest, dht._on_store)
                try:
                    with node.observe(_FollowReachability(dht)), node.value_peers(dht._contact_value):
                        await dht.bootstrap()
                        nursery.start_soon(dht._maintain)
                        yield dht
                finally:
                    node.rpc.remove(wire.FIND)
                    node.rpc.remove(wire.STORE)
                    nursery.cancel_scope.cancel()

    def _initial_peers(self) -> list[ID]:
        out = []
        for a in self.node.config.initial_peers:
            _, peer_id = parse_peer_addr(a, what="initial peer")
            if peer_id != self.node.peer_id:
                out.append(peer_id)
        return out

    def _wants_server(self) -> bool:
        if self.config.mode != DHTMode.AUTO:
            return self.config.mode == DHTMode.SERVER
        external = self.node.external
        return not external.judged or external.reachability == Reachability.PUBLIC

    def set_mode(self, server: bool, reason: str) -> None:
        """Serve (or stop serving) others; peers learn it from our next calls, and a new server
        makes one at once (a lookup of itself): a peer that only answered as a client until
        AutoNAT judged it public stayed in no one's table, and every record went to the relay."""
        if server != self.server:
            self.server = server
            self.node.emit(DHTModeChanged(mode=DHTMode.SERVER if server else DHTMode.CLIENT, reason=reason))
            if server and len(self.table):
                self._nursery.start_soon(self._announce)

    async def _announce(self) -> None:
        with trio.move_on_after(self.config.op_timeout):
            await self._refresh(self.local_id)

    async def bootstrap(self) -> None:
        """Join through the initial peers (and whoever we are connected to): ping, then look ourselves up.

        Retries until ``bootstrap_timeout``: initial peers may be starting their DHT
        right now. A node with no initial peers starts a new DHT, and says so.
        """
        started = time.perf_counter()
        deadline = trio.current_time() + self.config.bootstrap_timeout
        delay = 0.2
        while True:
            seeds = list(dict.fromkeys(self._initial + self.node.connected_peers()))
            async with trio.open_nursery() as nursery:
                for peer in seeds:
                    nursery.start_soon(self._ping, peer)
            if len(self.table) > 0 or not self._initial:
                break
            if trio.current_time() + delay > deadline:
                reasons = "; ".join(f"{peer}: {self._why.get(peer, 'no answer')}" for peer in seeds[:4])
                raise DHTBootstrapError(
                    f"none of the {len(self._initial)} initial peers (nor the {len(seeds)} peers we are connected to) "
                    f"answered as a DHT server within {self.config.bootstrap_timeout:g}s; refusing to start a "
                    f"separate DHT: check that the initial peers run the DHT and are publicly reachable ({reasons})")
            await trio.sleep(delay)
            delay = min(2 * delay, 2.0)
        if len(self.table):
            await self._refresh(*maintenance.join_targets(self.table))
        else:
            log.info("DHT: no initial peers, starting a new DHT")
        self.node.emit(DHTJoined(mode=DHTMode.SERVER if self.server else DHTMode.CLIENT, peers=len(self.table),
                                    elapsed=time.perf_counter() - started))

    # ------------------------------------------------------------------ public API

    async def store(self, key: KeyLike, value: bytes, expiration: float, subkey: KeyLike | None = None,
                    *, timeout: float | None = None) -> bool:
        """Store ``value`` under ``key`` (or its ``subkey``) until ``expiration`` (unix seconds).

        Keys made with :func:`owned` for this peer are signed with its key.
        Returns whether some replica took it: False when none was reachable, or
        when they hold a copy as new or newer (the newer expiration wins). Raises :class:`StoreRejected` when the
        record breaks a rule every node applies, or when every replica that
        answered refused it (the replicas' reasons are in the message).
        """
        rec = self.make_record(key, value, expiration, subkey)
        return (await self.store_many([rec], timeout=timeout))[0]

    def make_record(self, key: KeyLike, value: bytes, expiration: float,
                    subkey: KeyLike | None = None) -> DHTRecord:
        """A record ready to store: signed when its key or subkey is owned by this peer."""
        rec = DHTRecord.make(key, value, expiration, subkey)
        owners = {owner_of(rec.key), None if rec.subkey is None else owner_of(rec.subkey)} - {None}
        if owners == {self.node.peer_id}:
            rec = sign_record(self.node.key_pair.private_key, key, value, expiration, subkey)
        return rec

    async def store_many(self, records: Sequence[DHTRecord], *, timeout: float | None = None) -> list[bool]:
        """Store many records, sharing lookups and RPCs; one bool per record as in :meth:`store`."""
        now = self._clock()
        for rec in records:
            self.storage.validate(rec, now)  # the rules every replica applies: fail here, clearly
        for rec in records:
            self._mine[(rec.key, rec.subkey)] = rec
        started = trio.current_time()
        stored = [False] * len(records)
        with trio.move_on_after(timeout or self.config.op_timeout) as scope:
            stored = await self._replicate(records, now)
        self._query_done("store", started, "timeout" if scope.cancelled_caught
                         else "ok" if all(stored) else "partial" if any(stored) else "failed")
        return stored

    def observe_queries(self, observer: QueryObserver) -> Registration:
        """Call ``observer(kind, seconds, outcome)`` after every get, store and peer lookup this peer makes
        (kind ``get``/``store``/``find_peers``; outcome ``ok``, ``not_found``, ``partial``, ``failed``
        or ``timeout``). Synchronous, lossless, until the handle is removed."""
        return self._query_observers.add(observer)

    def _query_done(self, kind: str, started: float, outcome: str) -> None:
        elapsed = trio.current_time() - started
        self._query_observers.notify(lambda o: o(kind, elapsed, outcome), f"a {kind} query")

    async def get(self, key: KeyLike, latest: bool = False, *,
                  timeout: float | None = None) -> ValueWithExpiration | None:
        """The value under ``key``, or None if no live one was found.

        ``latest=False`` returns the first copy found (a local one, if any: a
        plain value read before, which a read keeps, or a replica's own);
        ``latest=True`` asks every replica and merges: the newest expiration of
        the plain value, or of each subkey of a dictionary. A dictionary comes
        back as ``{subkey: ValueWithExpiration}``, and a read keeps no copy of
        one (:func:`.replication.copyable`).
        """
        return (await self.get_many([key], latest=latest, timeout=timeout))[key]

    async def get_many(self, keys: Iterable[KeyLike], latest: bool = False, *,
                       timeout: float | None = None) -> dict[KeyLike, ValueWithExpiration | None]:
        """Many gets in one traversal (shared RPCs). For Learning@home's expert lookup,
        store each prefix of an expert uid as a dictionary key whose subkeys are the
        next coordinate, then ``get_many`` every prefix of a layer at once."""
        wanted = {key: DHTKey.encode(key) for key in keys}
        now = self._clock()
        result: dict[KeyLike, ValueWithExpiration | None] = {}
        searches: dict[KeyLike, Search] = {}
        for key, raw in wanted.items():
            if not latest:
                local = self._local_value(raw, now)
                if local is not None:
                    result[key] = local
                    continue
            parallel = max(self._alpha(), self.config.replicas) if latest else None
            search = Search(self._lookup(DHTID.from_key(raw), self.config.replicas, parallel=parallel), raw,
                             first_found=not latest, found=LocalStore(max_value_size=self.config.max_value_size,
                                                                      max_expiration_ahead=self.config.max_expiration_ahead))
            if self.server and search.found is not None:
                for rec in self.storage.records_at(raw, now):
                    search.found.store(rec, now)
            searches[key] = search
        started = trio.current_time()
        with trio.move_on_after(timeout or self.config.op_timeout) as scope:
            await self._traverse(list(searches.values()))
        now = self._clock()
        for key, search in searches.items():
            assert search.found is not None and search.key is not None
            value = search.found.found(search.key, now)
            result[key] = value
            if value is not None and self.config.cache:
                self._cache(search, now)
        if searches:
            missing = sum(result.get(key) is None for key in searches)
            self._query_done("get", started, "ok" if not missing else "timeout" if scope.cancelled_caught
                             else "not_found" if missing == len(searches) else "partial")
        return {key: result.get(key) for key in wanted}

    async def find_peers(self, target: int | ID, count: int | None = None) -> list[PeerInfo]:
        """The servers closest to ``target`` (an id in the key space, or a peer's id)."""
        t = DHTID.from_peer(target) if isinstance(target, ID) else DHTID(target)
        search = Search(self._lookup(t, count or self.config.k))
        started = trio.current_time()
        with trio.move_on_after(self.config.op_timeout) as scope:
            await self._traverse([search])
        found = search.lookup.result()
        self._query_done("find_peers", started, "ok" if found else "timeout" if scope.cancelled_caught else "failed")
        return found

    # ------------------------------------------------------------------ serving

    def _sender(self) -> pb.Sender:
        if not self.server:
            return pb.Sender(server=False)
        now = trio.current_time()
        if self._sender_cache is None or now - self._sender_cache[0] > SENDER_TTL:
            # Cached: computing the node's addresses cost a tenth of a lookup's CPU.
            addrs = wire.encode_addrs(without_peer_id(a) for a in self.node.addrs if not is_relayed(a))
            self._sender_cache = (now, pb.Sender(server=True, addrs=addrs))
        return self._sender_cache[1]

    async def _on_find(self, request: pb.FindRequest, ctx: CallContext) -> pb.FindResponse:
        serving.check_find(request)
        self._admit(ctx.peer_id, request.sender)
        self.served["find"] += 1
        return serving.answer_find(request, ctx.peer_id, table=self.table, storage=self.storage, server=self.server,
                                   now=self._clock(), budget=self.node.config.max_message_size // 2)

    async def _on_store(self, request: pb.StoreRequest, ctx: CallContext) -> pb.StoreResponse:
        serving.check_store(request)
        self._admit(ctx.peer_id, request.sender)
        self.served["store"] += 1
        response = serving.answer_store(request, ctx.peer_id, storage=self.storage, server=self.server, now=self._clock())
        self._stores_seen.note(request, response, trio.current_time())
        return response

    def _admit(self, peer_id: ID, sender: pb.Sender) -> None:
        """A caller that says it serves, over a direct connection from where it claims to listen, may join the table."""
        # where the connection came from is looked up only when it can matter: a server not yet in the table
        observed = self._direct_remote(peer_id) if sender.server and peer_id not in self.table else None
        self._added(serving.admit_caller(self.table, peer_id, sender, observed, trio.current_time()), peer_id)

    def _added(self, added: tuple[AddResult, list[Multiaddr]] | None, peer_id: ID) -> None:
        """Act on the table's verdict: a new contact gets our records; a full bucket's oldest contact is pinged."""
        if added is None:
            return
        result, addrs = added
        if result.status is AddStatus.ADDED:
            self.node.add_addrs(peer_id, addrs)
        then = maintenance.after_add(result, server=self.server, holds_records=bool(len(self.storage)),
                                     pinging=self._pinging)
        if then.hand_over:  # one copy is enough: the nearest replica sends it
            self._nursery.start_soon(functools.partial(self._hand_over, [peer_id], nearest_only=trio.current_time()))
        if then.ping is not None:
            self._pinging.add(then.ping)
            self._nursery.start_soon(self._check_oldest, then.ping)

    def _contact_value(self, peer_id: ID) -> int:
        """What a connected peer is worth to the connection manager: a contact of our routing table
        more than a peer a lookup passed by (go-libp2p-kad-dht tags its contacts with 5)."""
        return CONTACT_VALUE if peer_id in self.table else 0

    def _closed(self, peer_id: ID, trimmed: bool = False) -> None:
        """A connection closed: if it was the last to a contact of ours, check the contact soon. Not
        when a connection manager closed it (``trimmed``, ours or the peer's): the contact is alive,
        and dialing it to check would open the connection just trimmed."""
        delay = self.config.check_closed_after
        if delay is None or trimmed or not maintenance.check_when_closed(
                self.table, peer_id, connected=live_connection(self.node.network, peer_id) is not None,
                checking=self._pinging, checks=self.config.checks_per_pass):
            return
        self._pinging.add(peer_id)
        self._nursery.start_soon(self._check_closed, peer_id, delay)

    async def _check_closed(self, peer_id: ID, delay: float) -> None:
        try:
            await trio.sleep(delay)  # let a restart or a redial settle; the ping then proves it either way
            await self._check_contact(peer_id)
        finally:
            self._pinging.discard(peer_id)

    async def _check_contact(self, peer_id: ID) -> None:
        """A contact that may be gone (quiet for ``check_after``, or a full bucket's oldest): it stays if it answers."""
        with trio.move_on_after(self.config.rpc_timeout * 2):
            if not await self._ping(peer_id):
                self.table.remove(peer_id)

    async def _check_oldest(self, peer_id: ID) -> None:
        """Kademlia's rule for a full bucket: the oldest contact stays if it still answers."""
        try:
            await self._check_contact(peer_id)  # a dead one's removal promotes the newest replacement
        finally:
            self._pinging.discard(peer_id)

    # ------------------------------------------------------------------ calling

    async def _ping(self, peer_id: ID) -> bool:
        """A find of our own id: proves the peer is alive, tells us whether it serves, and learns its table."""
        response = await self._find(PeerInfo(peer_id), [wire.target_query(self.local_id)])
        return response is not None

    async def _find(self, peer: PeerInfo, queries: list[pb.Query]) -> pb.FindResponse | None:
        if peer.addrs and live_connection(self.node.network, peer.peer_id) is None:
            self.node.add_addrs(peer.peer_id, peer.addrs)
        request = pb.FindRequest(sender=self._sender(), queries=queries)
        started = trio.current_time()
        try:
            response = await self.node.rpc.call(peer.peer_id, wire.FIND, request, pb.FindResponse,
                                                timeout=self.config.rpc_timeout)
            self.replies.observe(trio.current_time() - started)
        except (RpcError, DedlocError) as e:
            log.debug("DHT find on %s failed: %s", peer.peer_id, e)
            self._why[peer.peer_id] = str(e)
            if len(self._why) > 256:
                del self._why[next(iter(self._why))]
            self.table.mark_failed(peer.peer_id)
            return None
        if len(response.results) != len(queries):
            log.debug("DHT find on %s: %d results for %d queries", peer.peer_id, len(response.results), len(queries))
            self.table.mark_failed(peer.peer_id)
            return None
        self._answered(peer.peer_id, response.server)
        return response

    def _answered(self, peer_id: ID, server: bool) -> None:
        if not server:
            self._why[peer_id] = "it answered as a DHT client"
        observed = None if not server or peer_id in self.table else self._direct_remote(peer_id)
        known = self.node.known_addrs(peer_id) if observed is not None else []
        self._added(serving.admit_answerer(self.table, peer_id, server, observed, known, trio.current_time()), peer_id)

    def _direct_remote(self, peer_id: ID) -> Multiaddr | None:
        """Where our live direct connection to ``peer_id`` comes from; None if none (or only relayed)."""
        conn = live_connection(self.node.network, peer_id)
        if conn is None:
            return None
        observed = remote_addr(conn)
        return None if is_relayed(observed) else observed

    async def _store_at(self, peer_id: ID, records: Sequence[DHTRecord]) -> list[pb.StoreResult] | None:
        out: list[pb.StoreResult] = []
        for start in range(0, len(records), wire.MAX_BATCH):
            chunk = records[start:start + wire.MAX_BATCH]
            request = pb.StoreRequest(sender=self._sender(), records=[r.to_pb() for r in chunk])
            try:
                response = await self.node.rpc.call(peer_id, wire.STORE, request, pb.StoreResponse,
                                                    timeout=self.config.rpc_timeout)
            except (RpcError, DedlocError) as e:
                log.debug("DHT store on %s failed: %s", peer_id, e)
                self.table.mark_failed(peer_id)
                return None
            if len(response.results) != len(chunk):
                self.table.mark_failed(peer_id)
                return None
            self._answered(peer_id, response.server)
            out.extend(response.results)
        return out

    # ------------------------------------------------------------------ traversal

    def _lookup(self, target: DHTID, width: int, *, parallel: int | None = None) -> Lookup:
        seeds = [c.info for c in self.table.nearest(target, self.config.k)]
        self.table.touch(target, trio.current_time())
        return Lookup(target, width, parallel or self._alpha(), seeds, local=self.local_id)

    def _alpha(self) -> int:
        return self.replies.parallelism(self.config.alpha, self.config.alpha_near, self.config.near_rtt)

    async def _traverse(self, searches: list[Search]) -> None:
        """Drive several lookups at once (:class:`.traversal.Traversal` decides; this sends).

        A call not answered within ``self.replies.slow_after`` is reported slow: the lookups
        stop waiting for it and ask the next peers, while the call goes on (a late answer is
        still taken). Returns as soon as every lookup is done. Calls still under way then (a
        reader stopped at the first copy, a slow peer) finish in the background instead of
        being cancelled: cancelling resets their streams, and the next calls to those peers
        would pay for opening new ones.
        """
        traversal = Traversal(searches, k=self.config.k, max_records=self.storage.max_subkeys_per_key)
        send, receive = trio.open_memory_channel[tuple[bool, PeerInfo, list[Search], pb.FindResponse | None]](math.inf)

        def tell(answered: bool, peer: PeerInfo, batch: list[Search], response: pb.FindResponse | None) -> None:
            try:
                send.send_nowait((answered, peer, batch, response))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the traversal is over (done, timed out or cancelled)

        async def slow(peer: PeerInfo, batch: list[Search], after: float) -> None:
            await trio.sleep(after)
            tell(False, peer, batch, None)

        async def ask(peer: PeerInfo, batch: list[Search]) -> None:
            async with trio.open_nursery() as timer:
                timer.start_soon(slow, peer, batch, self.replies.slow_after)
                response = await self._find(peer, [s.query() for s in batch])
                timer.cancel_scope.cancel()
            tell(True, peer, batch, response)

        def launch() -> None:
            for peer, batch in traversal.requests():
                self._nursery.start_soon(ask, peer, batch)

        with send, receive:
            launch()
            while not traversal.done:
                answered, peer, batch, response = await receive.receive()
                if answered:
                    traversal.on_reply(peer, batch, response, self._clock())
                else:
                    traversal.on_slow(peer, batch)
                launch()

    async def _refresh(self, *targets: DHTID) -> None:
        """Node lookups that fill and refresh the table (ourselves: our neighbourhood)."""
        await self._traverse([Search(self._lookup(t, self.config.k)) for t in targets])

    # ------------------------------------------------------------------ replication

    def _local_value(self, raw: bytes, now: float) -> ValueWithExpiration | None:
        if self.server:
            value = self.storage.found(raw, now)
            if value is not None:
                return value
        return self.cache.found(raw, now)

    async def _replicate(self, records: Sequence[DHTRecord], now: float) -> list[bool]:
        by_key: dict[bytes, list[int]] = defaultdict(list)
        for i, rec in enumerate(records):
            by_key[rec.key].append(i)
        # All `replicas` closest must answer anyway: ask that many at once (one round when the table knows them).
        parallel = max(self._alpha(), self.config.replicas)
        searches = {key: Search(self._lookup(DHTID.from_key(key), self.config.replicas, parallel=parallel))
                    for key in by_key}
        await self._traverse(list(searches.values()))
        stored = [False] * len(records)
        stale = [False] * len(records)
        errors: dict[int, list[str]] = defaultdict(list)
        plan: dict[ID, list[int]] = defaultdict(list)
        for key, search in searches.items():
            replicas = search.lookup.result()[: self.config.replicas]
            for peer in replicas:
                plan[peer.peer_id].extend(by_key[key])
            if self.server and replication.is_replica(self.local_id, int(DHTID.from_key(key)), [p.dht_id for p in replicas],
                                                      self.config.replicas):
                for i in by_key[key]:
                    try:
                        if self.storage.store(records[i], now):
                            stored[i] = True
                        else:
                            stale[i] = True
                    except StoreRejected as e:
                        errors[i].append(f"{self.node.peer_id} (local): {e}")

        async def one(peer_id: ID, indexes: list[int]) -> None:
            results = await self._store_at(peer_id, [records[i] for i in indexes])
            for i, result in zip(indexes, results or []):
                if result.status == pb.StoreResult.REJECTED:
                    errors[i].append(f"{peer_id}: {result.error}")
                elif result.status == pb.StoreResult.STORED:
                    stored[i] = True
                else:
                    stale[i] = True  # it already holds this or a newer copy

        async with trio.open_nursery() as nursery:
            for peer_id, indexes in plan.items():
                nursery.start_soon(one, peer_id, indexes)
        for i, ok in enumerate(stored):
            if not ok and not stale[i] and errors[i]:
                raise StoreRejected(f"every replica refused the record: {'; '.join(errors[i][:3])}")
        return stored

    def _cache(self, search: Search, now: float) -> None:
        assert search.found is not None and search.key is not None
        records = search.found.records_at(search.key, now)
        if not replication.copyable(records):
            return  # a dictionary: a copy would hide the subkeys its other writers store later
        for rec in records:
            try:
                self.cache.store(rec, now)
            except DHTError:
                pass
        nearest = replication.path_copy(records, search.lacking, search.holders, int(search.lookup.target))
        if nearest is not None:
            self._nursery.start_soon(self._store_at, nearest.peer_id, records)

    async def _hand_over(self, peers: Sequence[ID], skip: Collection[bytes] = frozenset(), *,
                         nearest_only: float | None = None) -> None:
        """Send our records to those of ``peers`` now among their keys' closest servers
        (:func:`.replication.hand_over` decides), but for the keys in ``skip`` (and, given
        ``nearest_only``, those a nearer replica we know as good hands over).

        Runs when a server joins (it may be closer to our keys than some
        replicas) and on republish; duplicates are harmless (the newer expiration wins).
        """
        plan = replication.hand_over(self.table, self.storage, peers, replicas=self.config.replicas,
                                     now=self._clock(), skip=skip, nearest_only=nearest_only)
        async with trio.open_nursery() as nursery:
            for peer_id, records in plan.items():
                nursery.start_soon(self._store_at, peer_id, records)

    # ------------------------------------------------------------------ maintenance

    async def _maintain(self) -> None:
        while True:
            await trio.sleep(self.config.maintenance_interval)
            now = self._clock()
            self.storage.expire(now)
            self.cache.expire(now)
            self._mine = {k: r for k, r in self._mine.items() if r.expiration > now}
            if not len(self.table) and self._initial:
                self.node.emit(DHTIsolated(initial_peers=len(self._initial)))
                for peer in self._initial:
                    with trio.move_on_after(self.config.rpc_timeout * 2):
                        try:
                            await self.node.connect(peer)
                        except DedlocError:
                            continue
                    await self._ping(peer)
                if len(self.table):  # as when joining: our neighbourhood, through whoever answered
                    with trio.move_on_after(self.config.op_timeout):
                        await self._refresh(self.local_id)
            cfg = self.config
            stale = maintenance.to_refresh(self.table, trio.current_time(), cfg.refresh_interval)
            if stale:
                with trio.move_on_after(cfg.op_timeout):
                    await self._refresh(*stale)
            quiet = maintenance.to_check(self.table, trio.current_time(), check_after=cfg.check_after,
                                         check_new_after=cfg.check_new_after, checks=cfg.checks_per_pass)
            if quiet:
                async with trio.open_nursery() as nursery:
                    for peer_id in quiet:
                        nursery.start_soon(self._check_contact, peer_id)
            if maintenance.republish_due(trio.current_time(), self._last_republish, cfg.republish_interval):
                await self._republish(now)

    async def _republish(self, now: float) -> None:
        """Store our own records again, then hand the rest of what we hold over to the contacts
        now among their keys' closest, but for the keys a store reached lately (the Kademlia
        paper's rule: that store went to the other replicas too) and the ones we just stored."""
        self._last_republish = trio.current_time()
        if self._mine:
            with trio.move_on_after(self.config.op_timeout):
                await self._replicate(list(self._mine.values()), now)
        if self.server:
            skip = replication.republish_skip(self._stores_seen, [key for key, _ in self._mine],
                                              self.config.republish_interval, trio.current_time())
            with trio.move_on_after(self.config.op_timeout):
                await self._hand_over([c.peer_id for c in self.table], skip=skip)

    # ------------------------------------------------------------------ introspection

    def metrics(self) -> dict[str, int | float | str]:
        """What ``dedloc status`` shows: flat name -> value, as every service's ``metrics()``."""
        return {
            "mode": DHTMode.SERVER if self.server else DHTMode.CLIENT,
            "routing_table": len(self.table),
            "keys": len(self.storage),
            "bytes": self.storage.bytes_used,
            "cached_keys": len(self.cache),
            "own_records": len(self._mine),
        }


class _FollowReachability(SwarmObserver):
    """``auto`` mode: serve while the node is publicly reachable, switch when the NAT layer's verdict
    changes; and a contact whose last connection closed is checked (:meth:`DHT._closed`)."""

    def __init__(self, dht: DHT) -> None:
        self._dht = dht

    def external_changed(self, external: ExternalAddresses) -> None:
        self._dht.set_mode(self._dht._wants_server(), f"reachability is {external.reachability}")

    def connection_closed(self, info: ConnectionInfo) -> None:
        self._dht._closed(info.peer_id, info.trimmed)
