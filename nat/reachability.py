"""The NAT layer's verdicts, as pure functions of what it observed: no I/O, no clock.

:class:`nat.traversal.NatService` gathers the facts (AutoNAT answers, what
observers saw of our listen port, relay slots) and asks this module what they
mean; ``tests/test_nat_decisions.py`` checks every rule without a node.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.addresses import without_peer_id
from p2p.hooks import Reachability
from p2p.addresses import tcp_port


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
    ok: set[ID] = field(default_factory=set)
    failed: set[ID] = field(default_factory=set)


class AddressVerdicts:
    """AutoNAT answers per candidate address: which servers reached it, which failed to."""

    def __init__(self) -> None:
        self._by_addr: dict[Multiaddr, _Verdicts] = {}

    def asked(self, addr: Multiaddr, server: ID) -> bool:
        verdicts = self._by_addr.get(without_peer_id(addr))
        return verdicts is not None and (server in verdicts.ok or server in verdicts.failed)

    def record(self, addr: Multiaddr, server: ID, reachable: bool | None) -> None:
        """One server's answer (None: it could not tell, and counts for neither)."""
        verdicts = self._by_addr.setdefault(without_peer_id(addr), _Verdicts())
        if reachable is True:
            verdicts.ok.add(server)
        elif reachable is False:
            verdicts.failed.add(server)

    def failures(self, addr: Multiaddr) -> int:
        verdicts = self._by_addr.get(without_peer_id(addr))
        return 0 if verdicts is None else len(verdicts.failed)

    def confirmed(self) -> list[Multiaddr]:
        """Addresses one nonce-verified dial-back reached (a server cannot fake a success)."""
        return [a for a, v in self._by_addr.items() if v.ok]

    def refuted(self, min_failures: int) -> list[Multiaddr]:
        """Addresses no server reached and at least ``min_failures`` failed to."""
        return [a for a, v in self._by_addr.items() if not v.ok and len(v.failed) >= min_failures]


def judge_reachability(current: Reachability, verdicts: AddressVerdicts, candidates: Collection[Multiaddr],
                       servers: int, min_failures: int) -> Reachability:
    """Public once any address is confirmed; private once every candidate failed at enough servers
    (``min_failures``, at most all the ``servers`` we have), or when we have servers but no candidate;
    otherwise what it was (too few answers to change our mind)."""
    if verdicts.confirmed():
        return Reachability.PUBLIC
    needed = min(min_failures, servers)
    if servers and all(verdicts.failures(c) >= needed for c in candidates):
        return Reachability.PRIVATE
    return current


def classify_mapping(listen_views: Mapping[ID, Multiaddr], own_addrs: Iterable[Multiaddr],
                     listen_ports: Collection[int | None], public: Callable[[Multiaddr], bool]) -> MappingKind | None:
    """Our NAT's mapping of the listen port, from what each peer observed of connections that used it.

    None when no observation is public (nothing to conclude yet: keep the last verdict).
    """
    views = {without_peer_id(v) for v in listen_views.values() if public(v)}
    if not views:
        return None
    if len(views) > 1:
        return MappingKind.DEPENDENT
    (mapped,) = views
    if any(without_peer_id(a) == mapped for a in own_addrs):
        return MappingKind.NONE
    if len(listen_views) < 2:
        return MappingKind.UNKNOWN
    if tcp_port(mapped) in listen_ports:
        return MappingKind.INDEPENDENT_PRESERVED
    return MappingKind.INDEPENDENT_CHANGED


def select_mode(reachability: Reachability, confirmed: Iterable[Multiaddr], relays: Iterable[ID],
                *, relays_tried: bool) -> tuple[NatMode, str] | None:
    """Public, relayed, or client (only once a pass over the relays found no slot); None: too early to say."""
    relays = list(relays)
    if reachability == Reachability.PUBLIC:
        return NatMode.PUBLIC, "reachable at " + ", ".join(map(str, confirmed))
    if relays:
        return NatMode.RELAYED, "reachable through " + ", ".join(map(str, relays))
    if reachability == Reachability.PRIVATE and relays_tried:
        return NatMode.CLIENT, "not reachable and no relay accepted us: dialing out only"
    return None
