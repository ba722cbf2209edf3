"""The connection manager's choice (p2p/conn_manager.py): which connections to close, with the time passed in."""

from __future__ import annotations

import pytest

from p2p.conn_manager import Conn, ConnManagerConfig, KeptPeers, Tags, select_to_close
from p2p.errors import ConfigError
from p2p.hooks import Registration

CONFIG = ConnManagerConfig(low_water=2, high_water=4, grace_period=10.0, silence_period=1.0)
NOW = 100.0


def conns(*peers: str, opened: float = 0.0, busy: int = 0, inbound: bool = False) -> list[Conn]:
    return [Conn(peer=p, opened=opened, busy=busy, inbound=inbound) for p in peers]


def closed(chosen: list[Conn]) -> list[str]:
    return [str(c.peer) for c in chosen]


def test_nothing_is_closed_at_or_below_the_high_water() -> None:
    assert select_to_close(conns("a", "b", "c", "d"), Tags(), NOW, CONFIG) == []
    assert closed(select_to_close(conns("a", "b", "c", "d", "e"), Tags(), NOW, CONFIG)) == ["a", "b", "c"]


def test_over_the_high_water_it_closes_down_to_the_low_water() -> None:
    chosen = select_to_close(conns(*"abcdefg"), Tags(), NOW, CONFIG)
    assert len(chosen) == 5 and len(set(closed(chosen))) == 5


def test_a_disabled_manager_closes_nothing() -> None:
    off = ConnManagerConfig(low_water=2, high_water=4, grace_period=0.0, enabled=False)
    assert select_to_close(conns(*"abcdefg"), Tags(), NOW, off) == []


def test_protected_peers_are_kept_and_do_not_count_toward_the_low_water() -> None:
    tags = Tags()
    tags.protect("a", "relay")
    tags.protect("b", "averaging")
    chosen = closed(select_to_close(conns(*"abcdef"), tags, NOW, CONFIG))
    assert "a" not in chosen and "b" not in chosen
    assert len(chosen) == 2  # c..f are the candidates: two of them stay, as low_water says


def test_protections_count_per_tag_and_a_release_never_made_is_a_no_op() -> None:
    tags = Tags()
    tags.protect("a", "round")
    tags.protect("a", "round")
    tags.unprotect("a", "round")
    assert tags.is_protected("a") and tags.protections("a") == ["round"]
    tags.unprotect("a", "other")
    tags.unprotect("b", "round")
    assert tags.is_protected("a") and not tags.is_protected("b") and tags.protections("b") == []
    tags.unprotect("a", "round")
    assert not tags.is_protected("a") and tags.protected_count() == 0 and len(tags) == 0


def test_peers_in_their_grace_period_are_kept() -> None:
    young = conns("y1", "y2", opened=NOW - 9.9)
    old = conns("o1", "o2", "o3", "o4", opened=NOW - 10.0)
    chosen = closed(select_to_close(young + old, Tags(), NOW, CONFIG))
    assert sorted(chosen) == ["o1", "o2"]


def test_a_peer_s_newest_connection_sets_its_grace() -> None:
    """A peer that just opened a second connection (a hole punch's direct one beside the relayed) is young."""
    peer_conns = [Conn("p", opened=0.0, busy=0, inbound=False), Conn("p", opened=NOW - 1, busy=0, inbound=False)]
    chosen = closed(select_to_close(peer_conns + conns("a", "b", "c", "d"), Tags(), NOW, CONFIG))
    assert "p" not in chosen and len(chosen) == 2


def test_too_few_past_their_grace_closes_nothing() -> None:
    """Fewer old connections than the low water: closing them would trade useful ones for young ones
    that may not be (go-libp2p's rule)."""
    young = conns("y1", "y2", "y3", "y4", opened=NOW)
    assert select_to_close(young + conns("o1"), Tags(), NOW, CONFIG) == []
    assert closed(select_to_close(young + conns("o1", "o2", "o3"), Tags(), NOW, CONFIG)) == ["o1"]


def test_a_peer_s_connections_close_together() -> None:
    two = [Conn("p", opened=0.0, busy=0, inbound=True), Conn("p", opened=1.0, busy=0, inbound=True)]
    chosen = select_to_close(two + conns("a", "b", "c"), Tags(), NOW, CONFIG)
    assert closed(chosen)[:2] == ["p", "p"] and len(chosen) == 3


def test_lowest_value_first() -> None:
    tags = Tags()
    tags.tag("a", "dht", 5)
    tags.tag("a", "app", 1)
    tags.tag("b", "dht", 5)
    tags.tag("c", "app", 3)
    assert tags.value("a") == 6 and tags.value("z") == 0
    chosen = closed(select_to_close(conns("a", "b", "c", "d", "e"), tags, NOW, CONFIG))
    assert chosen == ["d", "e", "c"]
    tags.untag("a", "app")
    tags.untag("a", "nothing")
    tags.untag("z", "app")
    assert tags.value("a") == 5 and len(tags) == 3
    tags.untag("a", "dht")
    assert tags.value("a") == 0 and len(tags) == 2


def test_the_caller_s_values_add_to_the_tags() -> None:
    tags = Tags()
    tags.tag("a", "app", 1)
    chosen = closed(select_to_close(conns("a", "b", "c", "d", "e"), tags, NOW, CONFIG, {"b": 2, "c": 1}))
    assert chosen == ["d", "e", "a"]  # a (its tag) and c (the caller) are worth 1 each: the tie keeps their order


def test_busy_peers_are_kept_and_do_not_count_toward_the_low_water() -> None:
    """A stream at work on any of a peer's connections (a call under way) keeps the peer: closing it
    cut DHT lookups short (bench/conn_manager.py)."""
    busy = [Conn("b", opened=0.0, busy=0, inbound=True), Conn("b", opened=0.0, busy=1, inbound=True)]
    chosen = closed(select_to_close(busy + conns("c", "d", "e", "f"), Tags(), NOW, CONFIG))
    assert "b" not in chosen and len(chosen) == 2  # c..f the candidates: two stay, as low_water says
    assert select_to_close(conns("c", "d", "x", busy=2) + conns("e", "f"), Tags(), NOW, CONFIG) == []


def test_inbound_before_outbound_then_the_longest_unused() -> None:
    peers = [
        Conn("out-old", opened=1.0, busy=0, inbound=False),
        Conn("out-new", opened=2.0, busy=0, inbound=False),
        Conn("in-new", opened=5.0, busy=0, inbound=True),
        Conn("in-old", opened=3.0, busy=0, inbound=True),
        Conn("kept", opened=0.0, busy=0, inbound=True),
    ]
    wide = ConnManagerConfig(low_water=1, high_water=1, grace_period=0.0)
    tags = Tags()
    tags.tag("kept", "dht", 1)
    assert closed(select_to_close(peers, tags, NOW, wide)) == ["in-old", "in-new", "out-old", "out-new"]


@pytest.mark.parametrize(("settings", "words"), [
    ({"low_water": 0}, "0 < low_water <= high_water, got low_water=0, high_water=192"),
    ({"low_water": 5, "high_water": 4}, "got low_water=5, high_water=4"),
    ({"grace_period": -1.0}, "grace_period >= 0 and silence_period > 0, got grace_period=-1.0, silence_period=10.0"),
    ({"silence_period": 0.0}, "got grace_period=60.0, silence_period=0.0"),
])
def test_bad_settings_are_refused_with_what_was_given(settings: dict[str, float], words: str) -> None:
    with pytest.raises(ConfigError, match="connection manager needs") as caught:
        ConnManagerConfig(**settings).validate()  # type: ignore[arg-type]
    assert words in str(caught.value)


def test_the_defaults_are_go_libp2p_s() -> None:
    c = ConnManagerConfig()
    c.validate()
    assert (c.low_water, c.high_water, c.grace_period, c.silence_period, c.enabled) == (160, 192, 60.0, 10.0, True)
    ConnManagerConfig(low_water=3, high_water=3, grace_period=0.0).validate()
    ConnManagerConfig(low_water=1, high_water=1, grace_period=0.0, silence_period=0.5).validate()  # the edges


def test_kept_peers_protects_those_new_to_the_set_and_releases_those_gone() -> None:
    tags = Tags()

    def protect(peer: str, tag: str) -> Registration:
        tags.protect(peer, tag)
        return Registration(lambda: tags.unprotect(peer, tag))

    kept = KeptPeers(protect, "slot")
    kept.keep(["a", "b"])
    kept.keep(["a", "b", "c"])  # a and b are not protected twice
    assert [tags.protections(p) for p in "abc"] == [["slot"], ["slot"], ["slot"]]
    kept.keep({"b", "c"}.__iter__())  # any iterable, read once
    tags.unprotect("b", "slot")
    assert not tags.is_protected("a") and not tags.is_protected("b") and tags.is_protected("c")
    kept.clear()
    assert tags.protected_count() == 0
