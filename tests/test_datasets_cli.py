"""`dedloc dataset`'s options to configs: which actions run as a client, the upload cap, the fetch table."""

from __future__ import annotations

import argparse

import pytest

from p2p.dht.events import DHTMode
from p2p.errors import ConfigError
from training.commands import build_parser
from training.datasets.cli import ONE_SHOT, dataset_peer_config, datasets_config, fetch_config

BOOT = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWAcEpZFodCrgPpMU2qAk5qtpQ56tAuMnkTH17K4P48xtF", "--ephemeral"]


def args(*argv: str) -> argparse.Namespace:
    parser, _ = build_parser()
    return parser.parse_args(["dataset", *argv, *BOOT])


ACTIONS = {"list": ["list"], "show": ["show", "corpus"], "retract": ["retract", "corpus", "abcd"],
           "get": ["get", "corpus", "out"], "create": ["create", "corpus", "src"], "seed": ["seed", "src"],
           "add": ["add", "corpus", "a.txt"]}


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_an_action_that_asks_and_leaves_is_a_client_and_the_others_full_peers(action: str) -> None:
    config = dataset_peer_config(args(*ACTIONS[action]))
    assert config.dht is not None
    if action in ONE_SHOT:  # no relay slot taken, no AutoNAT served, a DHT client
        assert not config.nat.autorelay.enabled and not config.nat.autonat_server
        assert config.dht.mode == DHTMode.CLIENT
    else:
        assert config.nat.autorelay.enabled and config.nat.autonat_server
        assert config.dht.mode == DHTMode.AUTO
    assert set(ONE_SHOT) == {"list", "show", "retract"}


@pytest.mark.parametrize("flag", ["--no-listen", "--serve-relay"])
def test_a_one_shot_action_asked_to_listen_otherwise_stays_a_peer_rather_than_contradict_itself(flag: str) -> None:
    config = dataset_peer_config(args("list", flag))
    assert config.nat.autorelay.enabled


def test_the_upload_cap_is_in_megabits_and_0_or_none_means_no_cap() -> None:
    assert datasets_config(args("seed", "src")).upload_rate is None
    assert datasets_config(args("seed", "src", "--upload-rate-mbit", "0")).upload_rate is None
    assert datasets_config(args("seed", "src", "--upload-rate-mbit", "8")).upload_rate == 1e6
    assert datasets_config(args("create", "c", "src", "--piece-size-kib", "64")).piece_size == 64 * 1024
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(ConfigError, match=r"^--upload-rate-mbit must be a number of Mbit/s, 0 or more \(0: no "):
            datasets_config(args("seed", "src", "--upload-rate-mbit", bad))


def test_get_fetches_from_at_most_max_seeders_at_once() -> None:
    assert fetch_config(args("get", "corpus", "out", "--max-seeders", "3")).table.max_connected == 3
    assert fetch_config(args("get", "corpus", "out", "--allow-relayed")).table.allow_relayed
    with pytest.raises(ConfigError, match=r"^--max-seeders must be at least 1$"):
        fetch_config(args("get", "corpus", "out", "--max-seeders", "0"))
