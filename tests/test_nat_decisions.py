"""The NAT layer's decisions, without a node: reachability, mapping class, mode, relay admission."""

from __future__ import annotations

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from nat.proto import circuit_pb2 as pb
from nat.reachability import (AddressVerdicts, MappingKind, NatMode, ServerBudget, classify_mapping, judge_reachability,
                              plan_probes, select_mode, server_judges)
from nat.relay import RelayAdmission, RelayConfig, Refusal, advertises_through
from p2p.addresses import reachable_tcp
from p2p.hooks import Reachability
from p2p.identity import new_identity, peer_id_of
from p2p.resources import Rate, default_rates

A = Multiaddr("/ip4/93.184.216.34/tcp/4001")  # data only: no packet is sent (TEST-NET ranges do not count as public)
B = Multiaddr("/ip4/93.184.216.34/tcp/5555")
C = Multiaddr("/ip4/93.184.216.34/tcp/6666")


def peers(n: int) -> list[ID]:
    return [peer_id_of(new_identity()) for _ in range(n)]


def public(addr: Multiaddr) -> bool:
    return reachable_tcp(addr)


def test_one_confirmation_makes_us_public_and_refutation_needs_enough_servers() -> None:
    s1, s2, s3 = peers(3)
    v = AddressVerdicts()
    v.record(A, s1, False)
    assert judge_reachability(Reachability.UNKNOWN, v, [A], servers=3, min_failures=3) == Reachability.UNKNOWN
    assert v.refuted(3) == []
    v.record(A, s2, False)
    v.record(A, s3, None)  # could not tell: counts for neither side
    assert judge_reachability(Reachability.UNKNOWN, v, [A], servers=3, min_failures=3) == Reachability.UNKNOWN
    # With only two servers, two failures are all we can have: private.
    assert judge_reachability(Reachability.UNKNOWN, v, [A], servers=2, min_failures=3) == Reachability.PRIVATE
    v.record(B, s1, True)
    assert v.confirmed() == [B]
    assert judge_reachability(Reachability.PRIVATE, v, [A, B], servers=3, min_failures=3) == Reachability.PUBLIC
    assert v.asked(A, s1) and v.asked(B, s1) and not v.asked(B, s2)


def test_no_servers_changes_nothing_and_no_candidates_means_private() -> None:
    v = AddressVerdicts()
    assert judge_reachability(Reachability.UNKNOWN, v, [A], servers=0, min_failures=3) == Reachability.UNKNOWN
    assert judge_reachability(Reachability.UNKNOWN, v, [], servers=2, min_failures=3) == Reachability.PRIVATE


def test_each_address_goes_to_as_many_servers_as_its_verdict_needs_within_their_budgets() -> None:
    s1, s2, s3, s4 = peers(4)
    addrs = [Multiaddr(f"/ip4/93.184.216.34/tcp/{4000 + i}") for i in range(6)]
    v = AddressVerdicts()
    full = {s: 4 for s in (s1, s2, s3, s4)}
    plan = plan_probes(addrs, [s1, s2, s3, s4], v, full, min_failures=3)
    # 6 addresses at 3 servers each is 18 requests; 4 servers take 4 each: 16 fit, so the sixth address
    # gets one server now and the rest at a later check. No server is asked more than 4 times.
    assert sorted(len(a) for a in plan.values()) == [4, 4, 4, 4]
    asked = {a: [s for s, mine in plan.items() if a in mine] for a in addrs}
    assert [len(asked[a]) for a in addrs] == [3, 3, 3, 3, 3, 1]  # the likeliest first, each to 3 servers
    assert all(mine == sorted(mine, key=addrs.index) for mine in plan.values())  # in order at each server
    # The load spreads: the first address went to the first three, the second starts with the fourth.
    assert asked[addrs[0]] == [s1, s2, s3] and s4 in asked[addrs[1]]
    # Reached once: asked of nobody more. Failed at two: one more server. Failed at all it needs (three):
    # nobody, though a fourth server was never asked.
    v.record(addrs[0], s1, True)
    v.record(addrs[1], s1, False)
    v.record(addrs[1], s2, False)
    for s in (s1, s2, s3):
        v.record(addrs[2], s, False)
    plan = plan_probes(addrs[:3], [s1, s2, s3, s4], v, full, min_failures=3)
    assert plan == {s3: [addrs[1]]}
    # Fewer servers than min_failures: each address goes to all of them; none with budget: nothing.
    assert plan_probes(addrs[3:4], [s1, s2], AddressVerdicts(), full, min_failures=3) == {s1: [addrs[3]], s2: [addrs[3]]}
    assert plan_probes(addrs, [s1, s2], AddressVerdicts(), {s1: 0}, min_failures=3) == {}
    assert plan_probes(addrs, [], AddressVerdicts(), full, min_failures=3) == {}
    # A server that could not tell (None) may be asked again.
    v2 = AddressVerdicts()
    v2.record(addrs[0], s1, None)
    assert plan_probes(addrs[:1], [s1], v2, full, min_failures=1) == {s1: [addrs[0]]}


def test_answers_go_stale_and_are_asked_again_while_they_still_count() -> None:
    s1, s2 = peers(2)
    v = AddressVerdicts(ttl=3600.0)
    v.record(A, s1, True, now=0.0)
    assert v.reached(A, now=3599.0) and v.asked(A, s1, now=3599.0)
    # Stale: asked again, while it still counts for what we advertise and conclude.
    assert not v.reached(A, now=3600.0) and not v.asked(A, s1, now=3600.0) and v.reached(A)
    assert v.confirmed() == [A]
    assert plan_probes([A], [s1, s2], v, {s1: 4, s2: 4}, min_failures=2, now=3600.0) == {s1: [A], s2: [A]}
    assert plan_probes([A], [s1, s2], v, {s1: 4, s2: 4}, min_failures=2, now=100.0) == {}
    # A fresh answer about the address replaces the stale ones: the address is lost.
    v.record(A, s2, False, now=3700.0)
    assert v.confirmed() == [] and v.failures(A) == 1 and v.failures(A, now=3700.0) == 1
    assert plan_probes([A], [s1, s2], v, {s1: 4, s2: 4}, min_failures=2, now=3700.0) == {s1: [A]}
    # A server's newer answer replaces its own older one, fresh or not.
    v.record(B, s1, True, now=3700.0)
    v.record(B, s1, False, now=3701.0)
    assert B not in v.confirmed() and v.failures(B) == 1
    # A stale failure is asked again too (a NAT that opened up: a new router, a mapping added).
    assert plan_probes([A], [s1, s2], v, {s1: 4, s2: 4}, min_failures=1, now=3700.0 + 3600.0) == {s1: [A]}
    # Kept three ttl at most: then forgotten, address and all.
    v.record(C, s1, True, now=3700.0 + 3 * 3600.0 - 2)
    v.expire(3700.0 + 3 * 3600.0 - 1)
    assert v.failures(A) == 1 and v.confirmed() == [C]
    v.expire(3700.0 + 3 * 3600.0)
    assert v.failures(A) == 0 and not v.asked(A, s2) and v.failures(B) == 1
    v.expire(3701.0 + 3 * 3600.0)
    assert v.refuted(1) == [] and v.confirmed() == [C]
    v.expire(3700.0 + 6 * 3600.0)
    assert v.confirmed() == [] and not v._by_addr  # nothing kept of addresses with no answer left
    # Without times, as before: every answer stays fresh.
    plain = AddressVerdicts()
    plain.record(A, s1, True)
    assert plain.reached(A, now=1e9) and plain.asked(A, s1, now=1e9)


def test_the_budget_is_what_a_server_lets_one_peer_ask() -> None:
    s1, s2 = peers(2)
    rate = default_rates()["autonat"]
    assert rate == Rate(0.2, 4)  # the server's default, which the client's default pace mirrors
    budget = ServerBudget(rate)
    assert budget.available(s1, 100.0) == 4
    for _ in range(4):
        budget.spend(s1, 100.0)
    assert budget.available(s1, 100.0) == 0 and budget.available(s2, 100.0) == 4
    assert budget.available(s1, 104.9) == 0 and budget.available(s1, 105.0) == 1  # one every 5 s
    assert budget.available(s1, 1000.0) == 4  # never more than the burst
    budget.spend(s1, 105.0)
    assert budget.available(s1, 105.0) == 0 and budget.available(s1, 110.0) == 1
    budget.spend(s2, 200.0)
    assert list(budget._spent) == [s2]  # s1 filled up again: forgotten, memory stays bounded


def test_mapping_classification() -> None:
    p1, p2 = peers(2)
    own = [Multiaddr("/ip4/192.168.1.2/tcp/4001")]
    assert classify_mapping({}, own, {4001}, public) is None
    assert classify_mapping({p1: A}, own, {4001}, public) == MappingKind.UNKNOWN  # one observer says little
    assert classify_mapping({p1: A, p2: A}, own, {4001}, public) == MappingKind.INDEPENDENT_PRESERVED
    assert classify_mapping({p1: B, p2: B}, own, {4001}, public) == MappingKind.INDEPENDENT_CHANGED
    assert classify_mapping({p1: A, p2: B}, own, {4001}, public) == MappingKind.DEPENDENT
    assert classify_mapping({p1: A}, [A], {4001}, public) == MappingKind.NONE
    private_view = Multiaddr("/ip4/10.0.0.9/tcp/4001")
    assert classify_mapping({p1: private_view}, own, {4001}, public) is None


def test_mode_selection() -> None:
    (relay,) = peers(1)
    assert select_mode(Reachability.UNKNOWN, [], [], relays_tried=True) is None
    assert select_mode(Reachability.PUBLIC, [A], [relay], relays_tried=False) == (NatMode.PUBLIC, f"reachable at {A}")
    assert select_mode(Reachability.PRIVATE, [], [relay], relays_tried=True)[0] == NatMode.RELAYED  # type: ignore[index]
    assert select_mode(Reachability.PRIVATE, [], [], relays_tried=False) is None  # not before a relay pass
    assert select_mode(Reachability.PRIVATE, [], [], relays_tried=True)[0] == NatMode.CLIENT  # type: ignore[index]


def test_relay_admission_limits_and_expiry() -> None:
    a, b, c, d = peers(4)
    admission = RelayAdmission(RelayConfig(max_reservations=3, max_reservations_per_ip=2, reservation_ttl=60,
                                           max_circuits=2, max_circuits_per_peer=1))
    assert admission.reserve(a, "198.51.100.1", now=1000.0) == 1060
    assert admission.reserve(b, "198.51.100.1", now=1000.0) == 1060
    assert admission.reserve(c, "198.51.100.1", now=1000.0) == Refusal(pb.RESERVATION_REFUSED, "too many reservations from one IP")
    assert admission.reserve(a, "198.51.100.1", now=1010.0) == 1070  # a refresh is never refused
    assert admission.reserve(c, "198.51.100.2", now=1010.0) == 1070
    assert admission.reserve(d, "198.51.100.3", now=1010.0) == Refusal(pb.RESERVATION_REFUSED, "too many reservations")
    assert admission.open_circuit(d, a) is None
    assert admission.open_circuit(c, a) == Refusal(pb.RESOURCE_LIMIT_EXCEEDED, "too many circuits for a peer")
    assert admission.open_circuit(d, d) == Refusal(pb.NO_RESERVATION, "no reservation")
    assert admission.open_circuit(c, b) is None
    assert admission.open_circuit(b, c) == Refusal(pb.RESOURCE_LIMIT_EXCEEDED, "too many circuits")
    admission.close_circuit(d, a)
    admission.close_circuit(c, b)
    assert admission.circuit_count == 0 and not admission.circuits
    # Expired slots and slots of disconnected peers go at the next sweep.
    admission.sweep(1065.0, connected=lambda p: p != c)
    assert set(admission.slots) == {a}


def test_a_full_relay_asks_its_longest_holders_and_frees_the_slots_nobody_is_told_of() -> None:
    a, b, c, d, relay = peers(5)
    admission = RelayAdmission(RelayConfig(max_reservations=3, reservation_ttl=3600, reclaim_checks=2,
                                           reclaim_recheck=300.0, reclaim_grace=30.0))
    for i, p in enumerate((a, b, c)):
        assert isinstance(admission.reserve(p, f"198.51.100.{i}", now=1000.0 + i), int)
    assert admission.reclaim_candidates(1010.0, d) == []  # every slot within its grace
    assert admission.reclaim_candidates(1040.0, a) == []  # a holder asks again: a renewal, never refused
    # the longest held first, at most reclaim_checks
    assert admission.reclaim_candidates(1040.0, d) == [a, b]
    assert not admission.heard(a, True, now=1040.0)  # a still advertises us: kept, and not asked for a while
    assert admission.reclaim_candidates(1041.0, d) == [b, c]
    assert admission.heard(b, False, now=1041.0)  # b does not: its slot is free
    assert b not in admission.slots and not admission.heard(b, False, now=1041.0)
    assert admission.reclaim_candidates(1041.0, d) == []  # not full any more
    assert isinstance(admission.reserve(d, "198.51.100.9", now=1041.0), int)
    assert admission.reclaim_candidates(1341.0, b) == [a, c]  # a's answer is 300 s old: asked again
    # a renewal counts as use, and keeps the slot's age
    assert isinstance(admission.reserve(c, "198.51.100.2", now=1341.0), int)
    assert admission.slots[c].since == 1002.0
    assert admission.reclaim_candidates(1341.0, b) == [a, d]
    # what a holder advertises: an address through this relay, not another's
    through = Multiaddr(f"/ip4/198.51.100.7/tcp/4001/p2p/{relay}/p2p-circuit")
    other = Multiaddr(f"/ip4/198.51.100.8/tcp/4001/p2p/{a}/p2p-circuit")
    direct = Multiaddr("/ip4/198.51.100.9/tcp/4001")
    assert advertises_through([direct, through], relay)
    assert not advertises_through([direct, other], relay)
    assert not advertises_through([Multiaddr("/p2p-circuit")], relay)  # names no relay: skipped
    assert not advertises_through([], relay)


def test_failures_are_counted_per_address_and_refuted_needs_no_confirmation() -> None:
    s1, s2, s3 = peers(3)
    v = AddressVerdicts()
    assert v.failures(A) == 0  # never asked
    v.record(A, s1, False)
    v.record(A, s2, False)
    assert v.failures(A) == 2 and v.failures(B) == 0
    assert v.refuted(2) == [A] and v.refuted(3) == []  # exactly min_failures is enough, one fewer is not
    v.record(A, s3, True)  # one server reached it: not refuted, however many failed
    assert v.refuted(2) == [] and v.confirmed() == [A]


def test_each_mode_says_why_in_full() -> None:
    r1, r2 = peers(2)
    assert select_mode(Reachability.PUBLIC, [A, B], [], relays_tried=False) == (
        NatMode.PUBLIC, f"reachable at {A}, {B}")
    assert select_mode(Reachability.PRIVATE, [], [r1, r2], relays_tried=False) == (
        NatMode.RELAYED, f"reachable through {r1}, {r2}")
    assert select_mode(Reachability.PRIVATE, [], [], relays_tried=True) == (
        NatMode.CLIENT, "not reachable and no relay accepted us: dialing out only")


# ---------------------------------------------------------------------- dual stack

SIX = Multiaddr("/ip6/2606:2800:220:1::1/tcp/4001")  # data only, as A
SIX_OTHER = Multiaddr("/ip6/2606:2800:220:1::1/tcp/5001")


def test_an_ipv6_confirmation_alone_makes_nobody_public() -> None:
    s1, s2, s3 = peers(3)
    v = AddressVerdicts()
    v.record(SIX, s1, True)
    # reached over IPv6 only: still unknown while IPv4 is unjudged (IPv4-only peers may not reach us)
    assert judge_reachability(Reachability.UNKNOWN, v, [A, SIX], servers=3, min_failures=3) == Reachability.UNKNOWN
    for s in (s1, s2, s3):
        v.record(A, s, False)
    # every IPv4 candidate refuted: private, though the IPv6 address is confirmed (and advertised)
    assert judge_reachability(Reachability.UNKNOWN, v, [A, SIX], servers=3, min_failures=3) == Reachability.PRIVATE
    assert v.confirmed() == [SIX]
    # an IPv4 confirmation makes us public
    v.record(B, s1, True)
    assert judge_reachability(Reachability.PRIVATE, v, [A, B, SIX], servers=3, min_failures=3) == Reachability.PUBLIC
    # a swarm with no IPv4 judges IPv6
    w = AddressVerdicts()
    w.record(SIX, s1, True)
    assert judge_reachability(Reachability.UNKNOWN, w, [SIX], servers=3, min_failures=3, family="ip6") == Reachability.PUBLIC


def test_an_unjudged_ipv6_candidate_holds_up_no_verdict() -> None:
    s1, s2, s3 = peers(3)
    v = AddressVerdicts()
    for s in (s1, s2, s3):
        v.record(A, s, False)
    # no server could dial the IPv6 address (none has IPv6): the IPv4 verdict stands alone
    assert judge_reachability(Reachability.UNKNOWN, v, [A, SIX, SIX_OTHER], servers=3, min_failures=3) == Reachability.PRIVATE


def test_an_address_goes_only_to_servers_that_can_dial_its_family() -> None:
    s1, s2, s3 = peers(3)
    has_six = {s1}
    judges = lambda s, addr: not str(addr).startswith("/ip6/") or s in has_six  # noqa: E731
    plan = plan_probes([A, SIX], [s1, s2, s3], AddressVerdicts(), {s: 4 for s in (s1, s2, s3)}, min_failures=3,
                       judges=judges)
    assert sorted(plan, key=str) == sorted([s1, s2, s3], key=str)
    assert all(A in addrs for addrs in plan.values())
    assert [s for s, addrs in plan.items() if SIX in addrs] == [s1]  # the one server with IPv6, once
    # once it answered, nobody else is asked: one failure is all a verdict can get here
    v = AddressVerdicts()
    v.record(SIX, s1, False)
    again = plan_probes([SIX], [s1, s2, s3], v, {s: 4 for s in (s1, s2, s3)}, min_failures=3, judges=judges)
    assert again == {}


def test_every_server_judges_ipv4_and_only_one_with_public_ipv6_judges_ipv6() -> None:
    public = lambda a: reachable_tcp(a, allow_private=False)  # noqa: E731
    natted_with_six = [Multiaddr("/ip4/192.168.1.7/tcp/4001"), Multiaddr("/ip6/2606:4700::7/tcp/4001")]
    public_four = [Multiaddr("/ip4/8.8.8.8/tcp/4001")]
    lan_six = [Multiaddr("/ip4/8.8.8.8/tcp/4001"), Multiaddr("/ip6/fd00::7/tcp/4001")]
    # IPv4: every server dials out, behind a NAT or not, or whatever it advertises (nothing known)
    for addrs in (natted_with_six, public_four, lan_six, []):
        assert server_judges("ip4", addrs, public)
    # IPv6: only a server that advertises a public IPv6 address
    assert server_judges("ip6", natted_with_six, public)
    assert not server_judges("ip6", public_four, public)
    assert not server_judges("ip6", lan_six, public)  # a unique-local address is no route to ours
    assert not server_judges("ip6", [], public)
    assert not server_judges(None, natted_with_six, public)


def test_a_dual_stack_peers_ipv6_view_is_not_a_second_mapping() -> None:
    p1, p2, p3 = peers(3)
    own = [Multiaddr("/ip4/192.168.1.2/tcp/4001"), SIX]
    # two observers saw the IPv4 mapping, one saw our own IPv6 address: the IPv4 NAT preserves the port
    assert classify_mapping({p1: A, p2: A, p3: SIX}, own, {4001}, public) == MappingKind.INDEPENDENT_PRESERVED
    assert classify_mapping({p1: A, p3: SIX}, own, {4001}, public) == MappingKind.UNKNOWN
    # an IPv6-only peer: its views are judged
    assert classify_mapping({p3: SIX}, [SIX], {4001}, public) == MappingKind.NONE


def test_a_peer_reached_over_ipv6_only_says_so_in_its_mode() -> None:
    (relay,) = peers(1)
    assert select_mode(Reachability.PRIVATE, [SIX, SIX_OTHER], [relay], relays_tried=False) == (
        NatMode.RELAYED, f"reachable through {relay}; directly only at {SIX}, {SIX_OTHER}")
    assert select_mode(Reachability.PRIVATE, [SIX], [], relays_tried=True) == (
        NatMode.CLIENT, f"not reachable and no relay accepted us: dialing out only; directly only at {SIX}")
