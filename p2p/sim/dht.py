"""The DHT at internet scale: thousands of peers running the project's routing table, lookups,
traversal, serving rules and record store over the modelled network of :mod:`.network`.

What runs here is the DHT's own sans-I/O code (:mod:`p2p.dht.routing`, :mod:`p2p.dht.traversal`,
:mod:`p2p.dht.serving`, :mod:`p2p.dht.records`); this module only delivers its messages
(after the modelled delays, or never) and plays the I/O shell's small schedule
(:class:`p2p.dht.DHT`: join by pinging the initial peers then looking up our own id and three
far buckets; refresh stale buckets every maintenance pass; ping a full bucket's questionable
contact; hand our records over to a server new to the table, and on each republish re-store our
own records and hand over to every contact, as :mod:`p2p.dht.replication` decides).
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from ..dht import protocol as wire
from ..dht.dht import DHTConfig
from ..dht.maintenance import after_add, join_targets, republish_due, to_check, to_refresh
from ..dht.proto import dht_pb2 as pb
from ..dht.records import DHTRecord, LocalStore, ValueWithExpiration
from ..dht.replication import StoresSeen, hand_over, is_replica, path_copy, republish_skip
from ..dht.routing import ID_BITS, AddResult, DHTID, Lookup, PeerInfo, RoutingTable, ip_group
from ..dht.serving import admit_answerer, admit_caller, answer_find, answer_store, check_find, check_store
from ..dht.traversal import ReplyTimer, Search, Traversal
from .engine import Engine
from .network import Kind, NetworkModel, Place

#: Wall-clock time of the simulation's start (records' expirations are wall-clock).
EPOCH = 1_800_000_000.0
#: A connection costs this many round trips before the first request (TCP, then Noise with
#: the muxer agreed inside it: the network layer's measured 2.1).
CONNECT_RTTS = 2.0


class Rules(enum.Enum):
    """Whose routing-table rules the peers follow.

    ``DEDLOC``: this project's (:class:`RoutingTable`'s defaults and the I/O shell's schedule).
    ``KAD_DHT_2022``: go-libp2p-kad-dht's as the RFM19 crawl (2022-04) met them, to check the
    network model against the crawl with the protocol the crawl measured: a full bucket rejects
    a newcomer (no replacement cache, nobody pinged: ``kbucket.TryAddPeer`` replaces only peers
    marked replaceable while bootstrapping); a peer that fails one query leaves the table
    (``peerStoppedDHT``); and every refresh interval each entry without a successful query for
    ``ln(1/k) / ln(1 - alpha/k)`` refresh intervals (43 min at k 20, alpha 10) is pinged and
    dropped if it does not answer (``rtRefreshManager.pingAndEvictPeers``). Everything else
    (lookups, admission of callers and answerers, refresh of stale buckets) is the same code:
    go-libp2p-kad-dht too adds a server that queries it (``handleNewMessage``: ``peerFound``)
    and one that answered a query. Its diversity filter (:data:`KAD_DHT_2022_PER_GROUP`) is the
    table's own; what it does depends on how many peers share an IP group
    (``NetworkModel.shared_group_share``). Not modelled: a newcomer's minutes in client mode
    before AutoNAT lets it serve.
    """

    DEDLOC = "dedloc"
    KAD_DHT_2022 = "kad-dht-2022"


#: go-ipfs's WAN DHT (go-libp2p-kad-dht v0.15 ``dual.New``, the version of the 2022 crawls) turns
#: on kbucket's peer diversity filter (``RoutingTablePeerDiversityFilter``) with
#: ``maxPrefixCountPerCpl = 2`` and ``maxPrefixCount = 3``: at most 2 peers of one IP group per
#: common prefix length and 3 in the whole table (a group, ``peerdiversity.Filter.ipGroupKey``: an
#: IPv4 /16, or a legacy class A /8, or an IPv6 address's ASN). A plain ``dht.New`` has no filter.
KAD_DHT_2022_PER_GROUP_PER_CPL = 2
KAD_DHT_2022_PER_GROUP = 3


@dataclass
class SimPeer:
    index: int
    peer_id: ID
    dht_id: DHTID
    addr: Multiaddr
    place: Place
    kind: Kind
    table: RoutingTable
    storage: LocalStore
    joined: float
    alive: bool = True
    #: Open connections, by the other peer's index.
    connected: set[int] = field(default_factory=set)
    pinging: set[ID] = field(default_factory=set)
    replies: ReplyTimer = field(default_factory=ReplyTimer)
    #: Records this peer stored (``DHT._mine``): re-stored at each republish.
    mine: dict[tuple[bytes, bytes | None], DHTRecord] = field(default_factory=dict)
    last_republish: float = 0.0
    stores_seen: StoresSeen = field(default_factory=StoresSeen)
    #: Its address's diversity group (:func:`ip_group`), as the peers it calls observe it.
    ip_group: str | None = None

    @property
    def server(self) -> bool:
        return self.kind is not Kind.UNREACHABLE

    @property
    def answers(self) -> bool:
        return self.alive and self.kind is Kind.PUBLIC


@dataclass(frozen=True)
class Stored:
    """What a simulated store did: its whole time, its lookup's part, who took the record, and
    whether its lookup waited for a query until that query's timeout (see :meth:`DHTSim.traverse`)."""

    seconds: float
    lookup_s: float
    holders: list[ID]
    stalled: bool = False


@dataclass
class DHTSimConfig:
    peers: int = 1000
    seed: int = 0
    dht: DHTConfig = field(default_factory=lambda: DHTConfig(replicas=20))
    #: Initial peers everyone joins through (they answer and never leave, as public bootstrap nodes).
    bootstrap: int = 4
    #: The first ``peers`` join at random times within this many seconds.
    join_spread_s: float = 600.0
    #: Sessions end (lengths drawn from the model) and each peer that leaves is replaced by a
    #: new one, keeping the size; False: a static network.
    churn: bool = True
    #: Start from a network at steady state instead of joins: every peer online at once with its
    #: routing table filled from the true population (random contacts of each bucket's range, up to
    #: k, buckets last refreshed at random times) and the rest of a session found under way. A
    #: join costs a peer ~17 lookups (its own id, three far buckets, then refreshing every bucket
    #: it has not touched), ~300 calls: 10,000 joins do not fit the bench's minutes. Peers that
    #: come later (churn) join through the I/O shell's schedule as in a cold start.
    warm: bool = False
    #: Lookups stop waiting for a peer past its :class:`ReplyTimer` (the DHT's behaviour);
    #: False: they wait for every reply up to the RPC timeout (before the fix, for comparison).
    reply_timer: bool = True
    #: Whose routing-table rules (see :class:`Rules`).
    rules: Rules = Rules.DEDLOC
    #: Records move as the DHT moves them after a store: a server hands its records over to a
    #: server new to its table and, every ``republish_interval``, to every contact now among their
    #: keys' closest; a writer re-stores its own. False: records stay where their store put them.
    replication: bool = True
    #: Lookups of random keys each peer makes per hour besides its maintenance: the content-routing
    #: load (provides, finds) the public DHT's servers carry, whose first queries go to the far
    #: contacts nearest each key and so find the ones that left. *Unmeasured*; 0: maintenance only.
    lookups_per_hour: float = 0.0

    @property
    def check_after_s(self) -> float:
        """How long a contact may go without answering before it is pinged: ``DHTConfig.check_after``,
        or :attr:`Rules.KAD_DHT_2022`'s ``successfulOutboundQueryGracePeriod`` (its dht.go's
        ``maxLastSuccessfulOutboundThreshold``)."""
        if self.rules is Rules.DEDLOC:
            return self.dht.check_after
        k, alpha = self.dht.k, self.dht.alpha
        return math.log(1 / k) / math.log(1 - alpha / k) * self.dht.refresh_interval


class DHTSim:
    """``peers`` DHT peers on :class:`NetworkModel`; :meth:`run` advances simulated time."""

    def __init__(self, config: DHTSimConfig, model: NetworkModel | None = None) -> None:
        self.config = config
        self.model = model or NetworkModel().calibrate(config.seed)
        self.rng = random.Random(config.seed)
        self.engine = Engine()
        self.peers: list[SimPeer] = []
        self.by_id: dict[ID, SimPeer] = {}
        self.calls = 0
        self.timeouts = 0
        #: Records sent by hand-overs, and by every store (one per record per receiving peer).
        self.handed_over = 0
        self.copies_sent = 0
        self._next_ip = 0
        self._group_rng = random.Random(config.seed ^ 0x5EED)
        self._load_rng = random.Random(config.seed ^ 0x10AD)  # its own: the seeded run stays the same without
        self._senders: dict[int, pb.Sender] = {}
        if config.warm:
            self._warm_start()
            return
        for _ in range(config.bootstrap):
            self._spawn(kind=Kind.PUBLIC, at=0.0, session=None)
        for _ in range(config.peers - config.bootstrap):
            self._spawn(kind=None, at=self.rng.uniform(0, config.join_spread_s), session=-1.0)

    def _warm_start(self) -> None:
        """``config.warm``: the whole network online at time 0 with filled tables."""
        cfg, rng = self.config, self.rng
        for i in range(cfg.peers):
            self._join(Kind.PUBLIC if i < cfg.bootstrap else None, None if i < cfg.bootstrap else -2.0)
        servers = sorted((int(p.dht_id), p.index) for p in self.peers if p.server)
        ids = [i for i, _ in servers]
        k, interval = cfg.dht.k, cfg.dht.refresh_interval
        for peer in self.peers:
            local, table = int(peer.dht_id), peer.table
            for index in range(ID_BITS - 1, -1, -1):
                low = ((local >> (index + 1)) << (index + 1)) | ((local & (1 << index)) ^ (1 << index))
                start, end = bisect.bisect_left(ids, low), bisect.bisect_left(ids, low + (1 << index))
                if start == end:
                    if len(ids) * 2.0 ** (index - ID_BITS) < 0.01:
                        break  # ranges this small hold nobody from here down
                    continue
                chosen = rng.sample(range(start, end), min(end - start, 2 * k))
                for j in chosen:  # k contacts, k more in the replacement cache
                    other = self.peers[servers[j][1]]
                    table.add(other.peer_id, other.dht_id, (other.addr,), other.ip_group, now=0.0, ping=False)
                silent = {self.peers[servers[j][1]].peer_id for j in chosen
                          if self.peers[servers[j][1]].kind is Kind.SILENT}
                for contact in table.bucket(index) + table.replacements(index):
                    if contact.peer_id in silent and cfg.rules is Rules.DEDLOC:
                        # It never answered: it is in our table only as a caller, checked
                        # check_new_after from when it came (a moment of the last pass or two).
                        contact.answered = -math.inf
                        contact.added = -rng.uniform(0, cfg.dht.check_new_after + cfg.dht.maintenance_interval)
                    else:  # last answered (and last seen) at some point of the check interval
                        contact.answered = contact.last_seen = -rng.uniform(0, cfg.check_after_s)
                table.touch(table.random_id_in_bucket(index), -rng.uniform(0, interval))

    # ------------------------------------------------------------------ peers

    @property
    def now(self) -> float:
        return self.engine.now

    def wall(self) -> float:
        return EPOCH + self.engine.now

    def _spawn(self, *, kind: Kind | None, at: float, session: float | None) -> None:
        """A peer joins ``at`` seconds from now; ``session``: None stays, -1 draws its length."""
        self.engine.at(at, self._join, kind, session)

    def _join(self, kind: Kind | None, session: float | None) -> None:
        rng = self.rng
        peer_id = ID(b"\x00\x24" + rng.randbytes(36))  # an identity multihash: no key needed
        self._next_ip += 1
        n = self._next_ip
        addr = Multiaddr(f"/ip4/{11 + (n >> 16) % 200}.{(n >> 8) & 255}.{n & 255}.{rng.randrange(1, 255)}/tcp/4001")
        if self.model.shared_group_share > 0:  # its own generator: the seeded run stays the same without
            shared = self.model.shared_group(self._group_rng)
            if shared is not None:  # one of a few shared groups (one /24 here, as the DHT groups)
                addr = Multiaddr(f"/ip4/12.{shared >> 8}.{shared & 255}.1/tcp/{1024 + n % 60_000}")
        dht_id = DHTID.from_peer(peer_id)
        peer = SimPeer(len(self.peers), peer_id, dht_id, addr, self.model.place(rng), kind or self.model.kind(rng),
                       self._table(dht_id),
                       self.config.dht.local_store(), joined=self.now, ip_group=ip_group(addr))
        # A peer found online by the warm start last republished at some moment of the interval.
        peer.last_republish = self.now - (self.rng.uniform(0, self.config.dht.republish_interval)
                                          if self.config.warm and self.now == 0.0 else 0.0)
        self.peers.append(peer)
        self.by_id[peer_id] = peer
        if peer.index >= self.config.bootstrap and not (self.config.warm and self.now == 0.0):
            self._bootstrap(peer)
        if session is not None and self.config.churn:
            # -1: a new session; -2: one found under way (the warm start's); else its length
            length = self.model.session_s(rng) if session == -1 else \
                self.model.residual_session_s(rng) if session == -2 else session
            self.engine.at(length, self._leave, peer)
        self.engine.at(self.config.dht.maintenance_interval * (0.5 + rng.random()), self._maintain, peer)
        if self.config.lookups_per_hour > 0:
            self._next_content_lookup(peer)

    def _table(self, dht_id: DHTID) -> RoutingTable:
        rng = random.Random(self.rng.random())
        if self.config.rules is Rules.KAD_DHT_2022:
            return RoutingTable(dht_id, k=self.config.dht.k, replacement_cache_size=0, max_failures=1,
                                max_per_ip_group=KAD_DHT_2022_PER_GROUP_PER_CPL,
                                max_per_ip_group_total=KAD_DHT_2022_PER_GROUP, rng=rng)
        return RoutingTable(dht_id, k=self.config.dht.k, rng=rng)

    def _leave(self, peer: SimPeer) -> None:
        peer.alive = False
        if self.config.churn:
            self._spawn(kind=None, at=0.0, session=-1.0)

    def _sender(self, peer: SimPeer) -> pb.Sender:
        sender = self._senders.get(peer.index)
        if sender is None:
            sender = pb.Sender(server=peer.server, addrs=wire.encode_addrs([peer.addr]) if peer.server else [])
            self._senders[peer.index] = sender
        return sender

    # ------------------------------------------------------------------ the I/O shell's schedule

    def _bootstrap(self, peer: SimPeer) -> None:
        seeds = [self.peers[i] for i in range(self.config.bootstrap)]
        pending = len(seeds)

        def pinged(_: pb.FindResponse | None) -> None:
            nonlocal pending
            pending -= 1
            if pending == 0 and len(peer.table):
                self.refresh(peer, join_targets(peer.table), lambda _: None)

        for seed in seeds:
            self.find(peer, seed.peer_id, [wire.target_query(peer.dht_id)], pinged)

    def _maintain(self, peer: SimPeer) -> None:
        if not peer.alive:
            return
        cfg = self.config.dht
        peer.storage.expire(self.wall())
        stale = to_refresh(peer.table, self.now, cfg.refresh_interval)
        if stale:
            self.refresh(peer, stale, lambda _: None)
        ours = self.config.rules is Rules.DEDLOC
        if ours or stale:  # the twin: every quiet contact, with each refresh
            for target in to_check(peer.table, self.now, check_after=self.config.check_after_s,
                                   check_new_after=cfg.check_new_after, checks=cfg.checks_per_pass if ours else None):
                self._check_contact(peer, target)
        if republish_due(self.now, peer.last_republish, cfg.republish_interval if self.config.replication else None):
            self.republish(peer)
        self.engine.at(cfg.maintenance_interval, self._maintain, peer)

    def _content_lookup(self, peer: SimPeer) -> None:
        """One lookup of a random key (``lookups_per_hour``), then the next after a random wait."""
        if not peer.alive:
            return
        self.refresh(peer, [DHTID(self._load_rng.getrandbits(ID_BITS))], lambda _: None)
        self._next_content_lookup(peer)

    def _next_content_lookup(self, peer: SimPeer) -> None:
        self.engine.at(self._load_rng.expovariate(self.config.lookups_per_hour / 3600), self._content_lookup, peer)

    def republish(self, peer: SimPeer) -> None:
        """``DHT._republish``: our own live records stored again, then the rest of what we hold
        handed over to every contact now among their keys' closest (but the keys a store reached
        within the interval: :class:`StoresSeen`)."""
        peer.last_republish = self.now
        wall = self.wall()
        peer.mine = {k: r for k, r in peer.mine.items() if r.expiration > wall}
        for record in peer.mine.values():
            self.store(peer, record, lambda _: None, own=False)
        if peer.server and len(peer.storage):  # but the keys whose store reached it lately, and its own
            skip = republish_skip(peer.stores_seen, [key for key, _ in peer.mine], self.config.dht.republish_interval,
                                  self.now)
            self._hand_over(peer, [c.peer_id for c in peer.table], skip)

    def _hand_over(self, peer: SimPeer, to: list[ID], skip: set[bytes] | None = None, *,
                   nearest_only: float | None = None) -> None:
        plan = hand_over(peer.table, peer.storage, to, replicas=self.config.dht.replicas, now=self.wall(),
                         skip=skip or set(), nearest_only=nearest_only)
        for target, records in plan.items():
            self.handed_over += len(records)
            self.store_at(peer, target, records, lambda _: None)

    def _check_contact(self, peer: SimPeer, target: ID, then: Callable[[], None] = lambda: None) -> None:
        """``DHT._check_contact``: ping ``target``; drop it if it does not answer."""
        def checked(response: pb.FindResponse | None) -> None:
            if response is None:
                peer.table.remove(target)
            then()

        self.find(peer, target, [wire.target_query(peer.dht_id)], checked)

    def _added(self, peer: SimPeer, added: tuple[AddResult, list[Multiaddr]] | None, other: ID) -> None:
        if added is None:
            return
        then = after_add(added[0], server=peer.server, holds_records=bool(len(peer.storage)), pinging=peer.pinging)
        if then.hand_over and self.config.replication:
            self._hand_over(peer, [other], nearest_only=self.now)
        if then.ping is not None:
            oldest = then.ping
            peer.pinging.add(oldest)
            self._check_contact(peer, oldest, lambda: peer.pinging.discard(oldest))

    # ------------------------------------------------------------------ calls

    def find(self, a: SimPeer, target: ID, queries: list[pb.Query], done: Callable[[pb.FindResponse | None], None]) -> None:
        """``a`` calls ``dht.find`` on ``target``: the answer after the modelled delays, or None at the RPC timeout."""
        self.calls += 1
        timeout = self.config.dht.rpc_timeout
        request = pb.FindRequest(sender=self._sender(a), queries=queries)
        b, there = self._reach(a, target)
        if b is None or b.kind is Kind.SILENT or there >= timeout:
            self.engine.at(timeout, self._failed, a, target, done)
            return
        self.engine.at(there, self._serve, a, b, request, done, self.now, self.now + timeout)

    def _reach(self, a: SimPeer, target: ID) -> tuple[SimPeer | None, float]:
        """The peer a call reaches and when its request arrives (a new connection first costs
        ``CONNECT_RTTS``); None when no dial gets through (gone, or behind a NAT with no
        connection from it)."""
        b = self.by_id.get(target)
        if b is None or not b.alive:
            return None, 0.0
        open_ = self.connected(a, b)
        if b.kind is Kind.UNREACHABLE and not open_:
            return None, 0.0
        setup = 0.0 if open_ else CONNECT_RTTS * self.model.rtt(a.place, b.place)
        self.use(a, b)
        return b, setup + self.model.one_way(a.place, b.place, self.rng)

    def connected(self, a: SimPeer, b: SimPeer) -> bool:
        """Whether ``a`` holds a connection to ``b`` (opened by either; connections stay open,
        as the Node closes none for being idle)."""
        return b.index in a.connected

    def use(self, a: SimPeer, b: SimPeer) -> None:
        """A message between ``a`` and ``b``: their connection is open (opened now, if it was not)."""
        a.connected.add(b.index)
        b.connected.add(a.index)

    def _serve(self, a: SimPeer, b: SimPeer, request: pb.FindRequest, done: Callable[[pb.FindResponse | None], None],
               sent: float, deadline: float) -> None:
        if not b.alive:
            self.engine.at(deadline - self.now, self._failed, a, b.peer_id, done)
            return
        check_find(request)
        added = admit_caller(b.table, a.peer_id, request.sender, a.addr, self.now)
        if added is not None and self.config.rules is Rules.KAD_DHT_2022:
            contact = b.table.get(a.peer_id)  # go-libp2p-kad-dht: a new entry counts as queried when added
            if contact is not None and contact.answered == -math.inf:
                contact.answered = self.now
        self._added(b, added, a.peer_id)
        response = answer_find(request, a.peer_id, table=b.table, storage=b.storage, server=b.server,
                               now=self.wall(), budget=2 * 1024 * 1024)
        back = self.model.one_way(b.place, a.place, self.rng)
        if self.now + back >= deadline:
            self.engine.at(deadline - self.now, self._failed, a, b.peer_id, done)
        else:
            self.engine.at(back, self._answered, a, b, response, done, sent)

    def _answered(self, a: SimPeer, b: SimPeer, response: pb.FindResponse, done: Callable[[pb.FindResponse | None], None],
                  sent: float) -> None:
        if not a.alive:
            return
        a.replies.observe(self.now - sent)
        self._added(a, admit_answerer(a.table, b.peer_id, response.server, b.addr, [b.addr], self.now), b.peer_id)
        done(response)

    def _failed(self, a: SimPeer, target: ID, done: Callable[[pb.FindResponse | None], None]) -> None:
        self.timeouts += 1
        if not a.alive:
            return
        a.table.mark_failed(target)
        done(None)

    def store_at(self, a: SimPeer, target: ID, records: list[DHTRecord], done: Callable[[bool], None]) -> None:
        """``a`` calls ``dht.store`` on ``target`` (same delays and failures as :meth:`find`)."""
        timeout = self.config.dht.rpc_timeout
        self.copies_sent += len(records)
        b, there = self._reach(a, target)
        if b is None or not b.answers or there >= timeout:
            self.engine.at(timeout, done, False)
            return
        back = self.model.one_way(b.place, a.place, self.rng)
        request = pb.StoreRequest(sender=self._sender(a), records=[r.to_pb() for r in records])

        def serve() -> None:
            if not b.alive:
                self.engine.at(timeout - there, done, False)
                return
            check_store(request)
            response = answer_store(request, a.peer_id, storage=b.storage, server=b.server, now=self.wall())
            b.stores_seen.note(request, response, self.now)
            if there + back >= timeout:  # stored, but the answer comes after the caller gave up
                self.engine.at(timeout - there, done, False)
            else:
                self.engine.at(back, done, all(r.status != pb.StoreResult.REJECTED for r in response.results))

        self.engine.at(there, serve)

    # ------------------------------------------------------------------ operations

    def _lookup(self, peer: SimPeer, target: DHTID, width: int, parallel: int | None = None) -> Lookup:
        cfg = self.config.dht
        seeds = [c.info for c in peer.table.nearest(target, cfg.k)]
        peer.table.touch(target, self.now)
        return Lookup(target, width, parallel or self._alpha(peer), seeds, local=peer.dht_id)

    def _alpha(self, peer: SimPeer) -> int:
        cfg = self.config.dht
        return peer.replies.parallelism(cfg.alpha, cfg.alpha_near, cfg.near_rtt)

    def traverse(self, peer: SimPeer, searches: list[Search], finished: Callable[[bool], None]) -> None:
        """Drive ``searches`` with the DHT's :class:`Traversal`, as ``DHT._traverse`` does (slow
        peers reported after the peer's :class:`ReplyTimer`, their calls going on).
        ``finished(stalled)``: whether it waited for a query until that query's timeout (the
        failure a silent peer caused: it held the lookup for the whole RPC timeout)."""
        traversal = Traversal(searches, k=self.config.dht.k, max_records=peer.storage.max_subkeys_per_key)
        over = stalled = False

        def launch() -> None:
            for info, batch in traversal.requests():
                state = [False, False]  # answered, reported slow
                self.find(peer, info.peer_id, [s.query() for s in batch], _bound(reply, info, batch, state))
                if self.config.reply_timer:
                    self.engine.at(peer.replies.slow_after, slow, info, batch, state)

        def slow(info: PeerInfo, batch: list[Search], state: list[bool]) -> None:
            if not over and not state[0]:
                state[1] = True
                traversal.on_slow(info, batch)
                settle()

        def reply(info: PeerInfo, batch: list[Search], response: pb.FindResponse | None, was_slow: bool) -> None:
            nonlocal stalled
            if over:
                return
            if response is not None and len(response.results) != len(batch):
                response = None
            stalled = stalled or (response is None and not was_slow)  # every failure comes at the timeout
            traversal.on_reply(info, batch, response, self.wall())
            settle()

        def settle() -> None:  # after every event, as DHT._traverse's loop: done, or ask the next peers
            nonlocal over
            if traversal.done:
                over = True
                finished(stalled)
            else:
                launch()

        launch()
        if traversal.done and not over:
            over = True
            finished(stalled)

    def refresh(self, peer: SimPeer, targets: list[DHTID], finished: Callable[[bool], None]) -> None:
        self.traverse(peer, [Search(self._lookup(peer, t, self.config.dht.k)) for t in targets], finished)

    def get(self, peer: SimPeer, key: bytes, finished: Callable[[float, bool, bool], None]) -> None:
        """A first-copy read of ``key``; ``finished(seconds, found, stalled)`` (see :meth:`traverse`)."""
        self.read(peer, key, lambda seconds, value, stalled: finished(seconds, value is not None, stalled))

    def read(self, peer: SimPeer, key: bytes, finished: Callable[[float, ValueWithExpiration | None, bool], None], *,
             latest: bool = False, leave_copy: bool = False, copy_dictionaries: bool = False) -> None:
        """A read of ``key`` as ``DHT.get`` does it (``latest``: every replica asked, answers merged;
        else the first copy); ``finished(seconds, value, stalled)``. ``leave_copy``: it leaves a copy
        where :func:`~p2p.dht.replication.path_copy` says, as ``DHT._cache`` does (off by default:
        the scale figures were measured without it); ``copy_dictionaries``: a dictionary's too, as
        the DHT did before that rule (for the comparison)."""
        started = self.now
        cfg = self.config.dht
        found = LocalStore(max_value_size=cfg.max_value_size, max_expiration_ahead=cfg.max_expiration_ahead)
        parallel = max(self._alpha(peer), cfg.replicas) if latest else None
        if peer.server:
            held = peer.storage.records_at(key, self.wall())
            if held and not latest:  # DHT.get answers a first-copy read from its own store
                finished(0.0, peer.storage.found(key, self.wall()), False)
                return
            for rec in held:
                found.store(rec, self.wall())
        search = Search(self._lookup(peer, DHTID.from_key(key), cfg.replicas, parallel), key,
                        first_found=not latest, found=found)

        def done(stalled: bool) -> None:
            if leave_copy:
                records = found.records_at(key, self.wall())
                nearest = path_copy(records, search.lacking, search.holders, int(search.lookup.target),
                                    dictionaries=copy_dictionaries)
                if nearest is not None:
                    self.store_at(peer, nearest.peer_id, records, lambda ok: None)
            finished(self.now - started, found.found(key, self.wall()), stalled)

        self.traverse(peer, [search], done)

    def store(self, peer: SimPeer, record: DHTRecord, finished: Callable[[Stored], None], *, own: bool = True) -> None:
        """Replicate ``record`` to the ``replicas`` closest servers found, as ``DHT.store`` does
        (``own``: it is ours to republish)."""
        started = self.now
        if own:
            peer.mine[(record.key, record.subkey)] = record
        cfg = self.config.dht
        search = Search(self._lookup(peer, DHTID.from_key(record.key), cfg.replicas, max(self._alpha(peer), cfg.replicas)))

        def found(stalled: bool) -> None:
            looked = self.now - started
            closest = search.lookup.result()[: cfg.replicas]
            replicas = [p.peer_id for p in closest]
            holders: list[ID] = []
            if peer.server and is_replica(peer.dht_id, int(DHTID.from_key(record.key)), [p.dht_id for p in closest],
                                          cfg.replicas):
                peer.storage.store(record, self.wall())  # as DHT._replicate: we are one of its replicas
            pending = len(replicas)
            if not pending:
                finished(Stored(self.now - started, looked, holders, stalled))
            for target in replicas:
                def one(ok: bool, target: ID = target) -> None:
                    nonlocal pending
                    pending -= 1
                    if ok:
                        holders.append(target)
                    if pending == 0:
                        finished(Stored(self.now - started, looked, holders, stalled))
                self.store_at(peer, target, [record], one)

        self.traverse(peer, [search], found)

    def run(self, until: float) -> None:
        self.engine.run(until)

    # ------------------------------------------------------------------ what the network looks like

    def live_servers(self) -> list[SimPeer]:
        return [p for p in self.peers if p.answers]

    def closest(self, target: int, count: int, among: list[SimPeer]) -> list[SimPeer]:
        return heapq.nsmallest(count, among, key=lambda p: int(p.dht_id) ^ target)

    def holders(self, key: bytes, servers: list[SimPeer] | None = None) -> int:
        """How many of the ``replicas`` live servers closest to ``key`` now hold a live record of it."""
        wall = self.wall()
        closest = self.closest(int(DHTID.from_key(key)), self.config.dht.replicas, servers or self.live_servers())
        return sum(bool(p.storage.records_at(key, wall)) for p in closest)

    def health(self, sample: int = 300) -> dict[str, float]:
        """RFM19's measures on a sample of live servers, at this instant: unreachable entries in
        bucket 0 (CPL 0) and in non-full buckets, and how many know all (or fewer than 18) of their
        20 closest; and the crawl's share of unreachable peers among all those found in the live
        servers' tables."""
        servers = self.live_servers()
        chosen = random.Random(self.config.seed + 1).sample(servers, min(sample, len(servers)))
        tables = {p.peer_id: _snapshot(p.table) for p in chosen}
        everyone = {c.peer_id for p in servers for c in p.table}
        return self._measures(chosen, servers, tables, everyone, self._reachable)

    def crawl(self, seconds: float, sample: int = 300) -> dict[str, float]:
        """:meth:`health`'s measures as one crawl takes them, over ``seconds`` of simulated time
        (RFM19's Nebula: "one run takes ~5-10 min"): every peer is visited at its own moment of the
        window; a live server visited gives its table as it is then and joins the crawl's population;
        each one's 20 closest are taken from that population (peers that joined during the crawl
        among them), and an entry is unreachable when the crawl could not visit it."""
        if seconds <= 0:
            return self.health(sample)
        rng = random.Random(self.config.seed + 2)
        slots = 60
        slot_of: dict[int, int] = {}
        visited: dict[ID, SimPeer] = {}
        tables: dict[ID, dict[int, list[ID]]] = {}

        def visit(slot: int) -> None:
            for peer in self.peers:  # those that joined since too
                if slot_of.setdefault(peer.index, rng.randrange(slots)) == slot and peer.answers:
                    visited[peer.peer_id] = peer
                    tables[peer.peer_id] = _snapshot(peer.table)

        for slot in range(slots):
            self.engine.at(seconds * (slot + 0.5) / slots, visit, slot)
        self.run(self.now + seconds)
        servers = list(visited.values())
        chosen = random.Random(self.config.seed + 1).sample(servers, min(sample, len(servers)))
        everyone = {c for table in tables.values() for entries in table.values() for c in entries}
        return self._measures(chosen, servers, tables, everyone, lambda peer_id: peer_id in visited)

    def _measures(self, chosen: list[SimPeer], servers: list[SimPeer], tables: dict[ID, dict[int, list[ID]]],
                  everyone: set[ID], reachable: Callable[[ID], bool]) -> dict[str, float]:
        """The measures over ``chosen`` (their ``tables``, as read) against the population ``servers``;
        ``everyone``: all peers found in the tables read."""
        k = self.config.dht.k
        cpl0: list[float] = []
        nonfull: list[float] = []
        all20 = under18 = 0
        for p in chosen:
            table = tables[p.peer_id]
            b0 = table.get(ID_BITS - 1, [])
            if b0:
                cpl0.append(sum(not reachable(c) for c in b0) / len(b0))
            for entries in table.values():
                if 0 < len(entries) < k:
                    nonfull.extend(float(not reachable(c)) for c in entries)
            known = {c for entries in table.values() for c in entries}
            truth = self.closest(int(p.dht_id), 20, [s for s in servers if s is not p])
            count = sum(s.peer_id in known for s in truth)
            all20 += count == len(truth)
            under18 += count < 18
        n = max(1, len(chosen))
        return {
            "unreachable_in_tables": sum(not reachable(i) for i in everyone) / max(1, len(everyone)),
            "unreachable_in_bucket_0": statistics.fmean(cpl0) if cpl0 else 0.0,
            "unreachable_in_non_full": statistics.fmean(nonfull) if nonfull else 0.0,
            "know_all_20_closest": all20 / n,
            "know_under_18_closest": under18 / n,
            "sampled": float(len(chosen)),
        }

    def _reachable(self, peer_id: ID) -> bool:
        peer = self.by_id.get(peer_id)
        return peer is not None and peer.answers


def _snapshot(table: RoutingTable) -> dict[int, list[ID]]:
    """A routing table's contacts by bucket index (non-empty buckets only), as a crawl reads them."""
    return {i: ids for i in range(ID_BITS) if (ids := [c.peer_id for c in table.bucket(i)])}


def _bound(reply: Callable[[PeerInfo, list[Search], pb.FindResponse | None, bool], None], info: PeerInfo,
           batch: list[Search], state: list[bool]) -> Callable[[pb.FindResponse | None], None]:
    def bound(response: pb.FindResponse | None) -> None:
        state[0] = True
        reply(info, batch, response, state[1])
    return bound


def make_record(rng: random.Random, now_wall: float) -> DHTRecord:
    return DHTRecord.make(f"key-{rng.getrandbits(64):016x}", b"v" * 64, now_wall + 3600)

