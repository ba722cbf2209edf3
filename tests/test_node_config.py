"""p2p.config.NodeConfig: the defaults a volunteer's machine gets, and each setting refused in its
words at the edge of its range (each protocol's own settings: in its own tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from p2p.conn_manager import ConnManagerConfig
from p2p.config import NodeConfig
from p2p.dial_backoff import BackoffConfig
from p2p.errors import AddressError, ConfigError
from p2p.noise import NoiseConfig
from p2p.peer_store import KNOWN_PEERS
from p2p.resources import ResourceConfig
from p2p.yamux import YamuxConfig

PEER = "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"


def config(**settings: Any) -> NodeConfig:
    return NodeConfig(**settings)


def refused(words: str, config: NodeConfig, error: type[Exception] = ConfigError) -> None:
    with pytest.raises(error, match=words):
        config.validate()


def test_the_defaults_suit_a_volunteer_and_pass() -> None:
    config = NodeConfig()
    config.validate()
    assert config.identity_path is None
    assert config.listen == ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"]
    assert (config.announce, config.initial_peers) == ([], [])
    assert (config.bootstrap_timeout, config.initial_backoff, config.max_backoff, config.backoff_jitter) == (
        30.0, 0.5, 8.0, 0.5)
    assert (config.dial_timeout, config.dial_stagger, config.dial_stagger_local) == (10.0, 0.25, 0.05)
    assert (config.max_message_size, config.rpc_timeout, config.known_peers) == (4 * 1024 * 1024, 30.0, KNOWN_PEERS)
    assert config.dial_backoff == BackoffConfig() and config.yamux == YamuxConfig()
    assert config.noise == NoiseConfig() and config.connections == ConnManagerConfig()
    assert config.resources.max_connections_per_peer == ResourceConfig().max_connections_per_peer
    assert NodeConfig().listen is not config.listen and NodeConfig().announce is not config.announce


def test_listen_addresses_are_tcp_over_ip4_or_ip6() -> None:
    NodeConfig(listen=["/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/0"]).validate()
    for bad in ("/ip4/127.0.0.1/udp/4001", "/ip4/127.0.0.1/tcp/4001/ws", "/dns4/example.org/tcp/1", "/tcp/1/ip4/1.2.3.4"):
        refused(rf"^listen address {bad} is not supported: use /ip4/<ip>/tcp/<port> or /ip6/<ip>/tcp/<port>$",
                NodeConfig(listen=[bad]))
    refused("^listen address 'not an address' is not a multiaddr", NodeConfig(listen=["not an address"]), AddressError)


def test_an_announce_address_needs_a_listen_address_and_must_be_dialable() -> None:
    NodeConfig(listen=[], announce=[]).validate()
    refused("^announce given but no listen address: nothing would answer at the announced address$",
            NodeConfig(listen=[], announce=["/ip4/1.2.3.4/tcp/4001"]))
    NodeConfig(announce=["/ip4/1.2.3.4/tcp/4001"]).validate()
    refused(r"^announce address /ip4/0\.0\.0\.0/tcp/4001 is unspecified \(0\.0\.0\.0 or ::\): nobody can dial it; "
            r"announce the address peers reach this node at \(its public IP\)$",
            NodeConfig(announce=["/ip4/0.0.0.0/tcp/4001"]))
    refused("^announce address 'garbage' is not a multiaddr", NodeConfig(announce=["garbage"]), AddressError)


def test_initial_peers_need_a_peer_id() -> None:
    NodeConfig(initial_peers=[PEER]).validate()
    refused("^initial peer /ip4/1.2.3.4/tcp/4001 has no /p2p/<peer-id> part",
            NodeConfig(initial_peers=["/ip4/1.2.3.4/tcp/4001"]), AddressError)


@pytest.mark.parametrize("name", ["bootstrap_timeout", "dial_timeout", "rpc_timeout", "initial_backoff", "max_backoff"])
def test_each_time_is_positive(name: str) -> None:
    config(**{name: 0.001}).validate()
    refused(f"^{name} must be positive, got 0$", config(**{name: 0}))
    refused(f"^{name} must be positive, got -1.5$", config(**{name: -1.5}))


def test_the_jitter_is_a_fraction_below_one() -> None:
    NodeConfig(backoff_jitter=0).validate()
    NodeConfig(backoff_jitter=0.99).validate()
    refused(r"^backoff_jitter must be in \[0, 1\), got 1$", NodeConfig(backoff_jitter=1))
    refused(r"^backoff_jitter must be in \[0, 1\), got -0.1$", NodeConfig(backoff_jitter=-0.1))


def test_the_staggers_are_not_negative() -> None:
    NodeConfig(dial_stagger=0, dial_stagger_local=0).validate()
    refused("^dial_stagger and dial_stagger_local must be >= 0, got -0.1 and 0.05$", NodeConfig(dial_stagger=-0.1))
    refused("^dial_stagger and dial_stagger_local must be >= 0, got 0.25 and -1$", NodeConfig(dial_stagger_local=-1))


def test_the_peer_store_and_message_floors() -> None:
    NodeConfig(known_peers=10, max_message_size=1024).validate()
    refused("^known_peers must be at least 10, got 9$", NodeConfig(known_peers=9))
    refused("^max_message_size must be at least 1024 bytes, got 1023$", NodeConfig(max_message_size=1023))


@pytest.mark.parametrize(("part", "words"), [
    ({"dial_backoff": BackoffConfig(max_entries=0)}, "dial backoff max_entries"),
    ({"yamux": YamuxConfig(max_frame=10)}, "max_frame must be at least 1024 bytes"),
    ({"noise": NoiseConfig(crypto_threads=65)}, "noise.crypto_threads must be from 0 to 64"),
    ({"resources": ResourceConfig(max_tracked_peers=0)}, "resources max_tracked_peers must be at least 1"),
    ({"connections": ConnManagerConfig(low_water=0)}, "connection manager needs 0 < low_water"),
])
def test_each_protocol_s_settings_are_checked_too(part: dict[str, Any], words: str) -> None:
    refused(words, config(**part))


def test_an_identity_path_is_kept_as_given(tmp_path: Path) -> None:
    config = NodeConfig(identity_path=tmp_path / "key")
    config.validate()
    assert config.identity_path == tmp_path / "key"
