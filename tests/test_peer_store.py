"""What the peer store remembers: the rule (p2p/peer_store.py), pure. A real Node that learns more
peers than the bound and still answers identify with its own keys (py-libp2p 0.8.1's own eviction
took them away at the 1,001st peer) is in tests/test_node.py."""

from __future__ import annotations

import pytest
from libp2p.peer.id import ID

from p2p import NodeConfig
from p2p.errors import ConfigError
from p2p.peer_store import Entry, low_water, to_forget


def _id(i: int) -> ID:
    return ID(b"\x00\x24" + i.to_bytes(36, "big"))


def _entries(n: int) -> list[Entry]:
    """``n`` entries with live addresses, heard of in the order of their ids."""
    return [Entry(_id(i), has_addrs=True, expired=False, heard=float(i)) for i in range(n)]


def test_nothing_is_forgotten_up_to_the_limit() -> None:
    assert to_forget(_entries(100), keep=set(), limit=100) == []
    assert len(to_forget(_entries(101), keep=set(), limit=100)) == 101 - low_water(100)


def test_forgetting_goes_down_to_a_tenth_below_the_limit() -> None:
    assert low_water(1000) == 900 and low_water(100) == 90 and low_water(10) == 9 and low_water(5) == 4
    gone = to_forget(_entries(1001), keep=set(), limit=1000)
    assert len(gone) == 101 and gone == [_id(i) for i in range(101)]  # the least recently heard of


def test_kept_peers_are_never_forgotten_and_not_counted() -> None:
    entries = _entries(150)
    keep = {_id(i) for i in range(60)}  # ourselves, connected and dialing peers: the oldest heard of
    assert to_forget(entries, keep, limit=90) == []  # 90 others: at the limit
    gone = to_forget(entries + [Entry(_id(500), True, False, 0.0)], keep, limit=90)
    assert not keep & set(gone) and len(gone) == 91 - low_water(90)
    assert gone[0] == _id(500)


def test_without_an_address_first_then_expired_then_least_recently_heard_of() -> None:
    fresh = [Entry(_id(i), True, False, float(i)) for i in range(10)]
    expired = [Entry(_id(100 + i), True, True, 50.0 + i) for i in range(3)]
    bare = [Entry(_id(200 + i), False, False, 99.0 + i) for i in range(2)]
    gone = to_forget(fresh + expired + bare, keep=set(), limit=10)  # 15 > 10: forget down to 9
    assert gone == [_id(200), _id(201), _id(100), _id(101), _id(102), _id(0)]


def test_a_limit_below_ten_is_refused() -> None:
    with pytest.raises(ConfigError, match="known_peers"):
        NodeConfig(known_peers=5).validate()
