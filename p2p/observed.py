"""Our addresses as peers report seeing them (identify's observed address), bounded.

Peers choose what they report, and a public node meets peers without end, so
both the addresses and the peers counted for each are bounded:

* at most ``max_observers`` distinct peers are remembered per address: past
  that, more confirm nothing a caller asks about (``min_observers`` is a small
  threshold). Remembering every one kept each visitor's peer id alive: a relay
  grew by ~390 bytes per visitor, 0.37 MiB per 1,000, without end
  (``bench/relay_soak.py --visitors 50000``);
* at most ``max_addrs`` addresses: a new one evicts the least confirmed (the
  oldest among equals). Refusing new ones once full let 64 lying peers fill the
  table for good, and a node that moved never learnt its new address.
"""

from __future__ import annotations

from libp2p.peer.id import ID
from multiaddr import Multiaddr

#: Bound on distinct observed addresses kept: peers choose what they report.
MAX_OBSERVED_ADDRS = 64
#: Bound on the peers remembered per address: enough for any confirmation threshold.
MAX_OBSERVERS = 16


class ObservedAddrs:
    """Observed addresses, each with the distinct peers (up to ``max_observers``) that reported it."""

    def __init__(self, max_addrs: int = MAX_OBSERVED_ADDRS, max_observers: int = MAX_OBSERVERS) -> None:
        if max_addrs < 1 or max_observers < 1:
            raise ValueError(f"max_addrs and max_observers must be >= 1, got {max_addrs}, {max_observers}")
        self.max_addrs = max_addrs
        self.max_observers = max_observers
        self._observers: dict[str, set[ID]] = {}  # insertion order: the oldest first

    def add(self, addr: Multiaddr, observer: ID) -> None:
        """``observer`` reported seeing us at ``addr``."""
        key = str(addr)
        observers = self._observers.get(key)
        if observers is None:
            if len(self._observers) >= self.max_addrs:
                least = min(self._observers, key=lambda a: len(self._observers[a]))  # the first of equals
                del self._observers[least]
            observers = self._observers[key] = set()
        if len(observers) < self.max_observers:
            observers.add(observer)

    def confirmed(self, min_observers: int = 1) -> list[Multiaddr]:
        """The addresses reported by at least ``min_observers`` distinct peers (at most ``max_observers``
        are counted)."""
        return [Multiaddr(a) for a, observers in self._observers.items()
                if len(observers) >= min(min_observers, self.max_observers)]

    def __len__(self) -> int:
        return len(self._observers)


__all__ = ["MAX_OBSERVED_ADDRS", "MAX_OBSERVERS", "ObservedAddrs"]
