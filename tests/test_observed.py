"""Observed addresses (p2p/observed.py), pure: peers counted per address and addresses kept, both
bounded; the end-to-end learning from identify is in tests/test_node.py."""

from __future__ import annotations

import pytest
from multiaddr import Multiaddr

from p2p.observed import ObservedAddrs

from .kit import numbered_peer_id as peer


def addr(n: int) -> Multiaddr:
    return Multiaddr(f"/ip4/11.0.0.{n}/tcp/4001")


def test_an_address_is_confirmed_by_distinct_peers() -> None:
    seen = ObservedAddrs()
    seen.add(addr(1), peer(1))
    seen.add(addr(1), peer(1))
    assert seen.confirmed() == [addr(1)] and seen.confirmed(2) == []
    seen.add(addr(1), peer(2))
    assert seen.confirmed(2) == [addr(1)]


def test_a_public_node_remembers_a_bounded_number_of_observers() -> None:
    """Every visitor of a relay reports the same address; each one remembered kept its peer id
    alive (the relay grew 0.37 MiB per 1,000 visitors without end)."""
    seen = ObservedAddrs(max_observers=4)
    for n in range(1000):
        seen.add(addr(1), peer(n))
    assert len(seen._observers[str(addr(1))]) == 4  # noqa: SLF001
    assert seen.confirmed(4) == [addr(1)] and seen.confirmed(100) == [addr(1)]  # as many as are counted


def test_a_new_address_evicts_the_least_confirmed_when_full() -> None:
    """Refusing new addresses once full let a few lying peers fill the table for good: a node that
    moved never learnt where it is now."""
    seen = ObservedAddrs(max_addrs=3)
    for observer in range(3):
        seen.add(addr(1), peer(observer))  # confirmed thrice
    seen.add(addr(2), peer(10))  # two lies, once each
    seen.add(addr(3), peer(11))
    seen.add(addr(4), peer(12))  # the oldest of the least confirmed goes
    assert seen.confirmed() == [addr(1), addr(3), addr(4)]
    seen.add(addr(4), peer(13))
    seen.add(addr(5), peer(14))
    assert seen.confirmed() == [addr(1), addr(4), addr(5)] and len(seen) == 3


def test_bounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="^max_addrs and max_observers must be >= 1, got 0, 16$"):
        ObservedAddrs(max_addrs=0)
    with pytest.raises(ValueError, match="^max_addrs and max_observers must be >= 1, got 64, 0$"):
        ObservedAddrs(max_observers=0)
    one = ObservedAddrs(max_addrs=1, max_observers=1)  # one of each is a table
    one.add(addr(1), peer(1))
    one.add(addr(1), peer(2))
    one.add(addr(2), peer(3))
    assert one.confirmed() == [addr(2)] and one.confirmed(5) == [addr(2)]
