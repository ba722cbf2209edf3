"""The dial backoff's rules without a node (``p2p/dial_backoff.py``): go-libp2p's schedule, its clearing
and forgetting, and the table's bound. The node's use of it is in tests/test_node.py."""

from __future__ import annotations

import pytest

from p2p.dial_backoff import BackoffConfig, DialBackoff, Held
from p2p.errors import ConfigError

A, B = "/ip4/127.0.0.1/tcp/1/p2p/X", "/ip6/::1/tcp/1/p2p/X"


def test_each_failure_waits_longer_go_libp2p_s_schedule_within_the_cap() -> None:
    backoff = DialBackoff()
    assert [backoff.delay(tries) for tries in (0, 1, 2, 3, 4, 17, 18, 100)] == [5, 6, 9, 14, 21, 294, 300, 300]
    now = 0.0
    for tries, wait in enumerate([5, 6, 9, 14], start=1):
        backoff.failed("x", A, now)
        free, held = backoff.split("x", [A], now + wait - 0.01)
        assert free == [] and held == [Held(A, tries, pytest.approx(0.01))]
        assert backoff.split("x", [A], now + wait) == ([A], [])
        now += wait


def test_only_the_addresses_that_failed_of_that_peer_are_held_in_the_order_given() -> None:
    backoff = DialBackoff()
    backoff.failed("x", B, 0)
    assert backoff.split("x", [A, B, "/c"], 1) == ([A, "/c"], [Held(B, 1, 4.0)])
    assert backoff.split("y", [B], 1) == ([B], [])
    assert Held(B, 1, 4.0).reason() == "backed off for 4.0 s more after 1 failed dial"
    assert Held(B, 3, 0.25).reason() == "backed off for 0.2 s more after 3 failed dials"


def test_a_held_address_says_why_its_last_dial_failed() -> None:
    """A caller refused by the backoff hears what it would have met: CI showed "backed off after 1
    failed dial" of a relay and nothing more, so nobody could tell what had failed."""
    backoff = DialBackoff()
    backoff.failed("x", A, 0, "connection refused")
    backoff.failed("x", A, 5, "timed out after 10s")
    (held,) = backoff.split("x", [A], 6)[1]
    assert held.last == "timed out after 10s"
    assert held.reason() == "backed off for 5.0 s more after 2 failed dials (last: timed out after 10s)"


def test_an_answer_from_the_peer_clears_every_address_of_it_and_no_other() -> None:
    backoff = DialBackoff()
    for peer in ("x", "y"):
        backoff.failed(peer, A, 0)
        backoff.failed(peer, B, 0)
    backoff.clear("x")
    assert backoff.split("x", [A, B], 1) == ([A, B], [])
    assert backoff.split("y", [A, B], 1)[0] == []
    assert len(backoff) == 2
    backoff.failed("x", A, 2)
    assert backoff.split("x", [A], 3)[1] == [Held(A, 1, 4.0)]  # a new start after the clear


def test_a_failure_long_after_the_last_wait_ended_starts_afresh_and_old_entries_are_forgotten() -> None:
    backoff = DialBackoff(BackoffConfig(base=5, coef=1, max=60))
    backoff.failed("x", A, 0)
    backoff.failed("x", A, 5)  # tries 2: waits until 11
    backoff.failed("x", B, 5)
    backoff.failed("x", A, 11 + 60 - 0.5)  # within max of its end: tries 3
    assert backoff.split("x", [A], 70.5)[1] == [Held(A, 3, 9.0)]
    backoff.expire(5 + 5 + 60)  # B's wait ended at 10: forgotten at 70
    assert len(backoff) == 1
    backoff.failed("x", A, 79.5 + 60)  # A's wait ended at 79.5: this is a first failure again
    assert backoff.split("x", [A], 79.5 + 60)[1] == [Held(A, 1, 5.0)]


def test_the_table_is_bounded_and_drops_the_oldest_failure_first() -> None:
    backoff = DialBackoff(BackoffConfig(max_entries=3))
    for i, peer in enumerate("abcd"):
        backoff.failed(peer, A, i)
    assert len(backoff) == 3
    assert backoff.split("a", [A], 4) == ([A], [])
    assert all(backoff.split(peer, [A], 4)[1] for peer in "bcd")
    backoff.failed("b", A, 4)  # b failed again: now the newest, c the oldest
    backoff.failed("e", A, 4)
    assert backoff.split("c", [A], 4)[1] == [] and backoff.split("b", [A], 4)[1]
    backoff.clear("b")
    backoff.clear("b")
    assert len(backoff) == 2


def test_what_expiry_or_the_bound_drops_leaves_the_peer_index_true() -> None:
    """A peer's addresses are found through an index: one dropped by expiry or by the bound is out of
    it too, and the rest of that peer's addresses stay in it."""
    backoff = DialBackoff(BackoffConfig(base=5, coef=0, max=10))
    backoff.failed("x", A, 0)
    backoff.failed("x", B, 20)
    backoff.expire(30)  # A's wait ended at 5: forgotten; B's at 25: kept
    assert len(backoff) == 1
    backoff.clear("x")  # B goes too, and the index names no A that is gone
    assert len(backoff) == 0 and backoff.split("x", [A, B], 30) == ([A, B], [])
    backoff.failed("y", A, 0)
    backoff.expire(100)
    backoff.clear("y")


def test_the_table_at_its_bound_keeps_every_entry_and_forgets_the_expired_only_past_it() -> None:
    backoff = DialBackoff(BackoffConfig(base=5, coef=0, max=10, max_entries=2))
    backoff.failed("a", A, 0)
    backoff.failed("b", A, 400)  # a's entry is long expired, but the table is not over its bound
    assert len(backoff) == 2
    backoff.failed("c", A, 400)  # now it is: the expired one goes, no live one
    assert len(backoff) == 2 and backoff.split("b", [A], 401)[1] and backoff.split("c", [A], 401)[1]


@pytest.mark.parametrize("config", [BackoffConfig(base=0, coef=0, max=0), BackoffConfig(max_entries=1)])
def test_the_edges_of_the_settings_are_usable(config: BackoffConfig) -> None:
    config.validate()  # base=0 coef=0 max=0: no backoff at all (bench/departed_peer.py's comparison)
    backoff = DialBackoff(config)
    backoff.failed("x", A, 0)
    assert len(backoff) == 1


@pytest.mark.parametrize("config", [BackoffConfig(base=-1), BackoffConfig(coef=-1), BackoffConfig(base=10, max=5)])
def test_unusable_settings_are_refused(config: BackoffConfig) -> None:
    with pytest.raises(ConfigError, match=r"^dial backoff needs 0 <= base <= max and coef >= 0, got base=-?\d+(\.\d+)?, "
                                          r"coef=-?\d+(\.\d+)?, max=\d+(\.\d+)?$"):
        config.validate()
    with pytest.raises(ConfigError, match=r"^dial backoff max_entries must be positive, got 0$"):
        BackoffConfig(max_entries=0).validate()
