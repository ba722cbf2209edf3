"""Admission's pure decisions (p2p/admission.py): caps, evictions, stalls, refusals and their words,
with times passed in (tests/test_admission.py holds the floods on loopback). These are the tests
``make mutate`` runs against the module."""

from __future__ import annotations

import pytest

from p2p.admission import Admission, AdmissionConfig, Refusal, prefixes
from p2p.errors import ConfigError


def test_prefixes_group_ipv4_by_32_and_24_and_ipv6_by_56_and_48() -> None:
    assert prefixes("203.0.113.7") == ("203.0.113.7/32", "203.0.113.0/24")
    assert prefixes("::ffff:203.0.113.7") == ("203.0.113.7/32", "203.0.113.0/24")
    assert prefixes("2001:db8:1:2ff:3::4") == ("2001:db8:1:200::/56", "2001:db8:1::/48")


def test_caps_per_address_and_subnet_refuse_with_the_reason() -> None:
    adm = Admission(AdmissionConfig(max_handshaking_per_address=2, max_handshaking_per_subnet=3))
    tickets = [adm.admit("10.0.0.1", 0.0)[0] for _ in range(3)]
    assert tickets[2] is None and adm.refused[Refusal.HANDSHAKING_PER_ADDRESS] == 1
    assert adm.admit("10.0.0.2", 0.0)[0] is not None
    assert adm.admit("10.0.0.3", 0.0)[0] is None and adm.refused[Refusal.HANDSHAKING_PER_SUBNET] == 1
    assert adm.admit("10.0.1.1", 0.0)[0] is not None  # another /24
    # authenticated connections no longer count as handshaking, only as connections
    first = tickets[0]
    assert first is not None
    adm.authenticated(first)
    assert adm.admit("10.0.0.1", 0.0)[0] is not None
    adm.release(first)
    assert adm.metrics()["inbound"] == 4 and adm.metrics()["handshaking"] == 4


def test_a_full_handshake_table_evicts_from_the_largest_holder_not_the_newcomer() -> None:
    adm = Admission(AdmissionConfig(max_handshaking=6, max_handshaking_per_address=8, max_handshaking_per_subnet=8))
    flood = [adm.admit("10.0.0.1", float(i))[0] for i in range(5)]
    honest = adm.admit("192.0.2.1", 9.0)[0]
    assert honest is not None and all(flood)
    # full: the next from another subnet evicts the flood's oldest, not anyone newer or smaller
    newcomer, evicted = adm.admit("198.51.100.1", 10.0)
    assert newcomer is not None and evicted == [flood[0]] and flood[0] is not None and flood[0].evicted
    assert adm.refused[Refusal.EVICTED] == 1
    # the flood's own next connection finds itself the largest holder: it is the one refused
    assert adm.admit("10.0.0.1", 11.0)[0] is None and adm.refused[Refusal.HANDSHAKING_TOTAL] == 1
    assert honest is not None and not honest.evicted


def test_a_table_full_of_a_flood_spread_over_many_subnets_yields_its_oldest_stalled_handshake() -> None:
    """No subnet holds more than its share (one stalled handshake from each of many /24s, or /48s):
    the oldest yields to a newcomer once stalled; a fresh one never does; a newcomer whose subnet
    would then hold the most is refused, as before."""
    for family in ("v4", "v6"):
        adm = Admission(AdmissionConfig(max_handshaking=6, max_handshaking_per_address=8,
                                        max_handshaking_per_subnet=8, stalled_after=1.0))
        ip = (lambda i: f"10.0.{i}.1") if family == "v4" else (lambda i: f"2001:db8:{i:x}::1")
        flood = [adm.admit(ip(i), 0.1 * i)[0] for i in range(6)]
        assert all(flood)
        honest_ip = "192.0.2.1" if family == "v4" else "2001:db8:ffff::1"
        # fresh handshakes everywhere: nobody is stalled yet, the newcomer is refused
        assert adm.admit(honest_ip, 0.9)[0] is None
        # a second later the oldest has stalled: it yields
        honest, evicted = adm.admit(honest_ip, 1.05)
        assert honest is not None and evicted == [flood[0]] and flood[0] is not None and flood[0].evicted
        # a flood connection from a subnet already holding one would hold the most: refused
        assert adm.admit(ip(5), 5.0)[0] is None
        # one from a fresh subnet takes the next oldest stalled place, never the honest one
        later, evicted = adm.admit(ip(99), 5.0)
        assert later is not None and evicted == [flood[1]] and not honest.evicted
        adm.authenticated(honest)
        assert adm.metrics()["handshaking"] == 5


def test_a_fast_churning_spread_flood_cannot_keep_out_a_subnet_that_never_stalled() -> None:
    """A flood from many /24s that keeps the table full of fresh handshakes (faster than stalled_after):
    its subnets soon all have stalls on record; a newcomer from a subnet that never stalled takes the
    place of the worst staller's handshake, however young; a flood newcomer does not."""
    adm = Admission(AdmissionConfig(max_handshaking=4, max_handshaking_per_address=8, max_handshaking_per_subnet=8,
                                    stalled_after=1.0, stall_memory=60.0))
    t = 0.0
    first = [adm.admit(f"10.0.{i}.1", t)[0] for i in range(4)]
    for ticket in first:  # they stall: the deadline closes them
        assert ticket is not None
        adm.timed_out(ticket)
        adm.release(ticket)
    assert set(adm.stalls) == {f"10.0.{i}.0/24" for i in range(4)}
    t = 10.0
    young = [adm.admit(f"10.0.{i}.1", t + 0.01 * i)[0] for i in range(4)]
    assert all(young)
    # a flood subnet's newcomer, everything young: refused
    assert adm.admit("10.0.2.1", t + 0.1)[0] is None
    # an honest one: takes the place of the worst staller's oldest young handshake
    honest, evicted = adm.admit("192.0.2.1", t + 0.1)
    assert honest is not None and evicted == [young[0]]
    assert adm.stalls["10.0.0.0/24"] == 2.0
    # the record halves every stall_memory seconds and is forgotten below 0.01
    adm.admit("198.51.100.1", t + 60.0)
    assert adm.stalls["10.0.0.0/24"] == 1.0
    adm.authenticated(honest)
    adm.release(honest)
    assert "192.0.2.0/24" not in adm.stalls  # finished handshakes are no stalls


def test_established_connections_have_their_own_caps() -> None:
    adm = Admission(AdmissionConfig(max_connections_per_address=2, max_connections=3))
    for ip in ("10.0.0.1", "10.0.0.1"):
        ticket = adm.admit(ip, 0.0)[0]
        assert ticket is not None
        adm.authenticated(ticket)
    assert adm.admit("10.0.0.1", 0.0)[0] is None and adm.refused[Refusal.CONNECTIONS_PER_ADDRESS] == 1
    third = adm.admit("10.0.1.1", 0.0)[0]
    assert third is not None
    adm.authenticated(third)
    assert adm.admit("10.0.2.1", 0.0)[0] is None and adm.refused[Refusal.CONNECTIONS_TOTAL] == 1


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError):
        AdmissionConfig(handshake_timeout=0).validate()
    with pytest.raises(ConfigError):
        AdmissionConfig(max_handshaking=-1).validate()


def test_each_refusal_is_described_to_the_refused_peer() -> None:
    from p2p.admission import describe_refusal, is_admission_refusal

    texts = {
        "handshaking_per_address": "too many connections still handshaking from your address",
        "handshaking_per_subnet": "too many connections still handshaking from your subnet",
        "handshaking_total": "too many connections still handshaking",
        "connections_per_address": "too many connections from your address",
        "connections_per_subnet": "too many connections from your subnet",
        "connections_total": "too many connections",
        "evicted": "evicted: your address or subnet held the most unfinished handshakes, or yours had stalled",
        "handshake_deadline": "the handshake took too long",
    }
    assert set(texts) == {r.value for r in Refusal}
    for reason, text in texts.items():
        assert is_admission_refusal(reason) and describe_refusal(reason) == f"{text} ({reason})"
    assert not is_admission_refusal("over the limit of 2 streams") and describe_refusal("other words") == "other words"


def test_config_errors_name_the_setting() -> None:
    for field in ("max_handshaking", "max_handshaking_per_address", "max_handshaking_per_subnet", "max_connections",
                  "max_connections_per_address", "max_connections_per_subnet", "backlog"):
        with pytest.raises(ConfigError, match=f"^admission {field} must be >= 0, got -1$"):
            AdmissionConfig(**{field: -1}).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^admission handshake_timeout must be positive, got 0$"):
        AdmissionConfig(handshake_timeout=0).validate()
    for bad in (dict(stalled_after=0.0), dict(stall_memory=0.0)):
        with pytest.raises(ConfigError, match="^admission stalled_after and stall_memory must be positive$"):
            AdmissionConfig(**bad).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^admission max_tracked_subnets must be at least 1$"):
        AdmissionConfig(max_tracked_subnets=0).validate()
    with pytest.raises(ConfigError, match="^admission backlog must be at least 1$"):
        AdmissionConfig(backlog=0).validate()
    AdmissionConfig(max_handshaking=0, max_connections=0, max_tracked_subnets=1, backlog=1).validate()


def test_zero_caps_are_no_limit_and_each_cap_refuses_at_exactly_its_value() -> None:
    free = Admission(AdmissionConfig(max_handshaking=0, max_handshaking_per_address=0, max_handshaking_per_subnet=0,
                                     max_connections=0, max_connections_per_address=0, max_connections_per_subnet=0))
    assert all(free.admit("10.0.0.1", 0.0)[0] for _ in range(50)) and free.refused == {}
    adm = Admission(AdmissionConfig(max_connections_per_subnet=2, max_handshaking_per_address=8))
    for ip in ("10.0.0.1", "10.0.0.2"):
        ticket = adm.admit(ip, 0.0)[0]
        assert ticket is not None
        adm.authenticated(ticket)
    assert adm.admit("10.0.0.3", 0.0)[0] is None and adm.last_refusal is Refusal.CONNECTIONS_PER_SUBNET
    assert adm.metrics() == {"inbound": 2, "handshaking": 0, "admitted": 2, "addresses": 2,
                             **{f"refused.{r.value}": int(r is Refusal.CONNECTIONS_PER_SUBNET) for r in Refusal}}


def test_deadlines_and_closes_count_stalls_once_and_the_record_is_bounded() -> None:
    adm = Admission(AdmissionConfig(max_tracked_subnets=2, stall_memory=10.0))
    a, b, c = (adm.admit(ip, 0.0)[0] for ip in ("10.0.1.1", "10.0.2.1", "10.0.3.1"))
    assert a is not None and b is not None and c is not None
    adm.timed_out(a)
    adm.timed_out(a)  # the deadline's second call: counted, but the handshake went once
    adm.release(a)  # closing it after its deadline is no second stall
    assert adm.stalls == {"10.0.1.0/24": 1.0} and adm.refused[Refusal.HANDSHAKE_DEADLINE] == 2
    adm.release(b)  # closed unfinished: a stall
    adm.stalls["10.0.2.0/24"] = 3.0
    adm.release(c)  # a third subnet: the least-stalled one is forgotten
    assert adm.stalls == {"10.0.2.0/24": 3.0, "10.0.3.0/24": 1.0}
    done = adm.admit("10.0.4.1", 0.0)[0]
    assert done is not None
    adm.authenticated(done)
    adm.timed_out(done)  # an authenticated connection has no handshake deadline
    assert adm.refused[Refusal.HANDSHAKE_DEADLINE] == 2
    adm.admit("10.0.5.1", 10.0)  # one stall_memory later: halved
    assert adm.stalls == {"10.0.2.0/24": 1.5, "10.0.3.0/24": 0.5}
    adm.admit("10.0.5.1", 75.0)  # six more halvings: 1.5/64 stays, 0.5/64 (< 0.01) is forgotten
    assert adm.stalls == {"10.0.2.0/24": 1.5 / 64}


def test_edges_of_admission_settings_zone_ids_and_the_stall_record() -> None:
    AdmissionConfig(handshake_timeout=0.5, stalled_after=0.5, stall_memory=0.5).validate()
    assert prefixes("fe80::1%eth0") == ("fe80::/56", "fe80::/48")
    assert prefixes("10.1.2.3") == ("10.1.2.3/32", "10.1.2.0/24")
    adm = Admission(AdmissionConfig(max_tracked_subnets=2, stall_memory=10.0))
    adm.stalls = {"10.0.1.0/24": 5.0, "10.0.9.0/24": 1.0}  # the least stalled sorts last by name
    t = adm.admit("10.0.5.1", 0.0)[0]
    assert t is not None
    adm.release(t)  # closed unfinished: a third subnet, the least stalled is forgotten
    assert adm.stalls == {"10.0.1.0/24": 5.0, "10.0.5.0/24": 1.0}
    adm.stalls = {"a": 0.02, "b": 0.0199}
    adm.admit("10.0.6.1", 10.0)  # halved: 0.01 is kept, under it forgotten
    assert adm.stalls == {"a": 0.01}


def test_a_full_connection_table_evicts_a_handshake_and_closes_give_back_their_counts() -> None:
    adm = Admission(AdmissionConfig(max_connections=3, max_connections_per_address=2, max_handshaking=0,
                                    stalled_after=1.0))
    done = [adm.admit(ip, 0.0)[0] for ip in ("10.0.0.1", "10.0.1.1")]
    for ticket in done:
        assert ticket is not None
        adm.authenticated(ticket)
    stalled = adm.admit("10.0.2.1", 0.0)[0]  # still handshaking
    assert stalled is not None
    newcomer, evicted = adm.admit("10.0.3.1", 1.0)  # full: the stalled handshake yields (exactly stalled_after)
    assert newcomer is not None and evicted == [stalled] and stalled.evicted
    assert adm.refused[Refusal.EVICTED] == 1 and adm.stalls == {"10.0.2.0/24": 1.0}
    adm.authenticated(stalled)  # an evicted handshake does not become authenticated
    assert not stalled.authenticated and adm.metrics()["handshaking"] == 1
    adm.release(stalled)  # the listener closes the evicted connection
    adm.authenticated(newcomer)
    full, evicted = adm.admit("10.0.5.1", 1.6)  # three established, no handshake to take over: refused
    assert full is None and evicted == [] and adm.last_refusal is Refusal.CONNECTIONS_TOTAL
    assert adm.metrics()["inbound"] == 3
    adm.release(done[0])
    again, evicted = adm.admit("10.0.4.1", 1.7)  # a close frees its place
    assert again is not None and evicted == []
    # per-address counts come back with each close, and are forgotten at zero
    per = Admission(AdmissionConfig(max_connections_per_address=2, max_connections_per_subnet=3))
    a, b = per.admit("10.9.0.1", 0.0)[0], per.admit("10.9.0.1", 0.0)[0]
    assert a is not None and b is not None and per.admit("10.9.0.1", 0.0)[0] is None
    per.release(a)
    c = per.admit("10.9.0.1", 0.0)[0]
    assert c is not None
    d = per.admit("10.9.0.2", 0.0)[0]
    assert d is not None and per.admit("10.9.0.3", 0.0)[0] is None  # the subnet's 3
    for ticket in (b, c, d):
        per.release(ticket)
    assert per._address == {} and per._subnet == {} and per._hs_address == {} and per._hs_subnet == {}
    assert per.metrics()["inbound"] == 0 and per.metrics()["addresses"] == 0
    assert per.refused[Refusal.CONNECTIONS_PER_ADDRESS] == 1 and per.refused[Refusal.CONNECTIONS_PER_SUBNET] == 1
    e = per.admit("10.9.0.1", 0.0)[0]
    assert e is not None
    per.authenticated(e)
    assert per._hs_address == {} and per._hs_subnet == {} and per._address == {"10.9.0.1/32": 1}


def test_the_largest_holder_yields_and_the_worst_staller_goes_first() -> None:
    adm = Admission(AdmissionConfig(max_handshaking=4, max_handshaking_per_address=8, max_handshaking_per_subnet=8,
                                    stalled_after=100.0))
    big = [adm.admit("10.0.0.1", float(i))[0] for i in range(2)]
    small = adm.admit("10.0.1.1", 2.0)[0]
    other = adm.admit("10.0.2.1", 3.0)[0]
    assert all(big) and small is not None and other is not None
    # the newcomer's subnet would hold 1: the biggest (2) yields its oldest
    newcomer, evicted = adm.admit("10.0.3.1", 4.0)
    assert newcomer is not None and evicted == [big[0]]
    # a staller's handshake yields to a subnet that never stalled, the worst staller first
    adm.stalls = {"10.0.1.0/24": 3.0, "10.0.2.0/24": 1.0}
    fresh, evicted = adm.admit("10.0.4.1", 5.0)
    assert fresh is not None and evicted == [small]
