"""The NAT layer's verdicts, as pure functions of what it observed: no I/O, no clock.

:class:`nat.traversal.NatService` gathers the facts (AutoNAT answers, what
observers saw of our listen port, relay slots) and asks this module what they
mean; ``tests/test_nat_decisions.py`` checks every rule without a node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.addresses import ip_family, tcp_port, without_peer_id
from p2p.hooks import Reachability
from p2p.resources import Rate


class NatMode(StrEnum):
    """How we take part: reachable directly, through relay slots, or dialing out only."""

    STARTING = "starting"
    PUBLIC = "public"
    RELAYED = "relayed"
    CLIENT = "client"


class MappingKind(StrEnum):
    """How our NAT maps the listen port, from what observers of that port saw."""

    UNKNOWN = "unknown"
    #: Observers see our own interface address: no NAT.
    NONE = "none"
    INDEPENDENT_PRESERVED = "endpoint-independent, port preserved"
    INDEPENDENT_CHANGED = "endpoint-independent, port changed"
    #: Different observers saw different mappings (symmetric NAT): TCP punching cannot predict the port.
    DEPENDENT = "endpoint-dependent"


@dataclass
class _Verdicts:
    ok: dict[ID, float] = field(default_factory=dict)  # server -> when it answered
    failed: dict[ID, float] = field(default_factory=dict)

    def drop(self, gone: Callable[[ID, float], bool]) -> None:
        """Forget the answers ``gone(server, when)`` picks, of either kind."""
        for answers in (self.ok, self.failed):
            for server in [s for s, at in answers.items() if gone(s, at)]:
                del answers[server]


class AddressVerdicts:
    """AutoNAT answers per candidate address: which servers reached it, which failed to, and when.

    An answer is fresh for ``ttl`` seconds, then stale: the address is asked again (an address once
    confirmed can be lost: the ISP hands out a new IP, the router forgets a mapping), while the stale
    answer still counts until a fresh one about that address comes, or it is ``3 * ttl`` old
    (go-libp2p's tracker: probed again after an hour, results kept three). Given no times, every
    answer stays fresh. A server's newer answer replaces its older one.
    """

    def __init__(self, ttl: float = math.inf) -> None:
        self.ttl = ttl
        self._by_addr: dict[Multiaddr, _Verdicts] = {}

    def _fresh(self, at: float, now: float | None) -> bool:
        return now is None or now - at < self.ttl

    def asked(self, addr: Multiaddr, server: ID, now: float | None = None) -> bool:
        """Whether ``server`` answered about ``addr`` (by ``now``: and its answer is still fresh)."""
        verdicts = self._by_addr.get(without_peer_id(addr))
        if verdicts is None:
            return False
        at = verdicts.ok.get(server, verdicts.failed.get(server))
        return at is not None and self._fresh(at, now)

    def record(self, addr: Multiaddr, server: ID, reachable: bool | None, now: float = 0.0) -> None:
        """One server's answer at ``now`` (None: it could not tell, and counts for neither); the
        address's stale answers give way to it."""
        if reachable is None:
            return
        verdicts = self._by_addr.setdefault(without_peer_id(addr), _Verdicts())
        verdicts.drop(lambda other, at: other == server or not self._fresh(at, now))
        (verdicts.ok if reachable else verdicts.failed)[server] = now

    def expire(self, now: float) -> None:
        """Forget answers ``3 * ttl`` old, and addresses left with none."""
        for addr, verdicts in list(self._by_addr.items()):
            verdicts.drop(lambda _, at: now - at >= 3 * self.ttl)
            if not verdicts.ok and not verdicts.failed:
                del self._by_addr[addr]

    def reached(self, addr: Multiaddr, now: float | None = None) -> bool:
        """Whether a dial-back reached ``addr`` (by ``now``: one still fresh)."""
        verdicts = self._by_addr.get(without_peer_id(addr))
        return verdicts is not None and any(self._fresh(at, now) for at in verdicts.ok.values())

    def failures(self, addr: Multiaddr, now: float | None = None) -> int:
        """Servers that failed to reach ``addr`` (by ``now``: with a fresh answer)."""
        verdicts = self._by_addr.get(without_peer_id(addr))
        return 0 if verdicts is None else sum(1 for at in verdicts.failed.values() if self._fresh(at, now))

    def confirmed(self) -> list[Multiaddr]:
        """Addresses one nonce-verified dial-back reached (a server cannot fake a success)."""
        return [a for a, v in self._by_addr.items() if v.ok]

    def refuted(self, min_failures: int) -> list[Multiaddr]:
        """Addresses no server reached and at least ``min_failures`` failed to."""
        return [a for a, v in self._by_addr.items() if not v.ok and len(v.failed) >= min_failures]


class ServerBudget:
    """How many AutoNAT requests each server takes from us now: a token bucket per server at the
    rate servers let one peer ask (``p2p/resources.py``'s ``autonat`` rate, 12 a minute and 4 at
    once; go-libp2p's servers allow 12 a minute), so that our checks are never refused as a flood,
    nor shown as one in an honest server's log. Time is passed in."""

    def __init__(self, rate: Rate) -> None:
        self.rate = rate
        self._spent: dict[ID, tuple[float, float]] = {}  # server -> (tokens, at); absent: a full bucket

    def _tokens(self, server: ID, now: float) -> float:
        tokens, at = self._spent.get(server, (float(self.rate.burst), now))
        return self.rate.refill(tokens, max(0.0, now - at))

    def available(self, server: ID, now: float) -> int:
        return int(self._tokens(server, now) + 1e-9)

    def spend(self, server: ID, now: float) -> None:
        self._spent[server] = (self._tokens(server, now) - 1.0, now)
        # Buckets that have filled up again say nothing a missing one does not: drop them, so that
        # what is kept is bounded by the requests of the last burst / per_second seconds.
        for full in [o for o in self._spent if self._tokens(o, now) >= self.rate.burst]:
            del self._spent[full]


def plan_probes(candidates: Sequence[Multiaddr], servers: Sequence[ID], verdicts: AddressVerdicts,
                budget: Mapping[ID, int], min_failures: int, now: float | None = None,
                judges: Callable[[ID, Multiaddr], bool] | None = None) -> dict[ID, list[Multiaddr]]:
    """Which server to ask about which address in this check (each request carries one address).

    An address no server has reached goes to as many servers not yet asked about it as it still
    lacks failures for a verdict (``min_failures``, at most all the servers that ``judges`` it: one
    without an IPv6 address cannot dial ours, and refuses); one that a server
    reached needs nothing more (a nonce-verified dial-back cannot be faked). Answers count here only
    while fresh at ``now`` (:class:`AddressVerdicts`): a stale one is asked again. Each server is asked at
    most ``budget`` times, those with the most left first so that the load spreads; what is left
    over waits for the next check. The addresses keep their order (the likeliest first)."""
    left = {s: budget.get(s, 0) for s in servers}
    rank = {s: i for i, s in enumerate(servers)}
    plan: dict[ID, list[Multiaddr]] = {}
    for addr in candidates:
        if verdicts.reached(addr, now):
            continue
        able = [s for s in servers if judges is None or judges(s, addr)]
        needed = min(min_failures, len(able))
        fresh = sorted((s for s in able if left[s] > 0 and not verdicts.asked(addr, s, now)),
                       key=lambda s: (-left[s], rank[s]))
        for server in fresh[: max(0, needed - verdicts.failures(addr, now))]:
            plan.setdefault(server, []).append(addr)
            left[server] -= 1
    return plan


def server_judges(family: str | None, server_addrs: Iterable[Multiaddr], public: Callable[[Multiaddr], bool]) -> bool:
    """Whether an AutoNAT server can dial our addresses of ``family``, from the addresses it advertises.

    IPv4: every server (one behind a NAT dials out through it, and a server accepts IPv4 from
    anyone). IPv6: only one that advertises a public IPv6 address; one without refuses
    (``E_DIAL_REFUSED``), and asking it spends a request for nothing. Asking about IPv4 only servers
    that advertised a public IPv4 address left a swarm whose servers sit behind NATs, with public
    IPv6 beside them, with nobody to judge IPv4 at all."""
    if family == "ip4":
        return True
    return family is not None and any(ip_family(a) == family and public(a) for a in server_addrs)


def judge_reachability(current: Reachability, verdicts: AddressVerdicts, candidates: Collection[Multiaddr],
                       servers: int, min_failures: int, family: str = "ip4") -> Reachability:
    """Whether every peer can dial us, judged in the one address ``family`` every peer can dial
    (IPv4: about half of home lines have IPv6, the rest dial IPv4 only).

    Public once an address of ``family`` is confirmed; private once every candidate of ``family``
    failed at enough servers (``min_failures``, at most all the ``servers`` that can judge that family),
    or when we have servers but no such candidate; otherwise what it was (too few answers to change
    our mind). An address of the other family, confirmed, is advertised but makes nobody public: a
    peer reached over IPv6 only keeps its relay slots, or IPv4-only peers lose it (libp2p/specs#614:
    one IPv6 success made a node public and it dropped its relays); unconfirmed, it holds up no
    verdict (a swarm may have no server that can dial it)."""
    if any(ip_family(a) == family for a in verdicts.confirmed()):
        return Reachability.PUBLIC
    needed = min(min_failures, servers)
    if servers and all(verdicts.failures(c) >= needed for c in candidates if ip_family(c) == family):
        return Reachability.PRIVATE
    return current


def classify_mapping(listen_views: Mapping[ID, Multiaddr], own_addrs: Iterable[Multiaddr],
                     listen_ports: Collection[int | None], public: Callable[[Multiaddr], bool]) -> MappingKind | None:
    """Our NAT's mapping of the listen port, from what each peer observed of connections that used it.

    None when no observation is public (nothing to conclude yet: keep the last verdict). IPv4's
    views are judged when there are any (the NAT is IPv4's: a dual-stack peer's IPv6 view is its own
    address, and beside its IPv4 mapping read as two mappings, endpoint dependence), else IPv6's.
    """
    public_views = [without_peer_id(v) for v in listen_views.values() if public(v)]
    family = "ip4" if any(ip_family(v) == "ip4" for v in public_views) else "ip6"
    observers = [v for v in listen_views.values() if ip_family(v) == family]
    views = {v for v in public_views if ip_family(v) == family}
    if not views:
        return None
    if len(views) > 1:
        return MappingKind.DEPENDENT
    (mapped,) = views
    if any(without_peer_id(a) == mapped for a in own_addrs):
        return MappingKind.NONE
    if len(observers) < 2:
        return MappingKind.UNKNOWN
    if tcp_port(mapped) in listen_ports:
        return MappingKind.INDEPENDENT_PRESERVED
    return MappingKind.INDEPENDENT_CHANGED


def select_mode(reachability: Reachability, confirmed: Iterable[Multiaddr], relays: Iterable[ID],
                *, relays_tried: bool) -> tuple[NatMode, str] | None:
    """Public, relayed, or client (only once a pass over the relays found no slot); None: too early to say."""
    relays, confirmed = list(relays), list(confirmed)
    if reachability == Reachability.PUBLIC:
        return NatMode.PUBLIC, "reachable at " + ", ".join(map(str, confirmed))
    # not public, yet confirmed: reached in a family not every peer has (IPv6), so the others need a relay
    also = "; directly only at " + ", ".join(map(str, confirmed)) if confirmed else ""
    if relays:
        return NatMode.RELAYED, "reachable through " + ", ".join(map(str, relays)) + also
    if reachability == Reachability.PRIVATE and relays_tried:
        return NatMode.CLIENT, "not reachable and no relay accepted us: dialing out only" + also
    return None
