"""How ``serve-experts --processes N`` splits a server (training/moe/shards.py, pure): each child's share
of the grid, identity, ports and options; and each expert's initial weights, whichever child hosts it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from p2p.errors import AddressError, ConfigError
from training.commands import build_parser
from training.moe.cli import build_backends, expert_uids, torch_threads
from training.moe.experts import expert_seed
from training.moe.shards import (check_processes, child_args, child_identity, child_metrics, decode_args,
                                 encode_args, shard, shifted_port)

HID = 8
BOOT = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def parsed(*argv: str) -> argparse.Namespace:
    from p2p.commands import parse

    parser, sub = build_parser()
    return parse(parser, sub, ["serve-experts", "--initial-peers", BOOT, *argv], environ={})


def test_shards_take_every_nth_expert_and_cover_the_grid_once() -> None:
    items = list(range(10))
    parts = [shard(items, i, 3) for i in range(3)]
    assert parts == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(sum(parts, [])) == items
    assert shard(items, 0, 1) == items
    with pytest.raises(ValueError):
        shard(items, 3, 3)


def test_fixed_ports_move_up_by_the_process_index_and_port_zero_stays() -> None:
    assert shifted_port("/ip4/0.0.0.0/tcp/4001", 2, what="--listen") == "/ip4/0.0.0.0/tcp/4003"
    assert shifted_port("/ip6/::/tcp/4001", 0, what="--listen") == "/ip6/::/tcp/4001"
    assert shifted_port("/ip4/0.0.0.0/tcp/0", 3, what="--listen") == "/ip4/0.0.0.0/tcp/0"
    relayed = f"{BOOT}/p2p-circuit"  # the port is the relay's: never moved
    assert shifted_port(relayed, 1, what="--announce") == relayed
    with pytest.raises(ConfigError, match="65536"):
        shifted_port("/ip4/1.2.3.4/tcp/65535", 1, what="--listen")
    with pytest.raises(AddressError):
        shifted_port("ip4/1.2.3.4", 1, what="--listen")
    assert child_metrics("127.0.0.1:9100", 2) == "127.0.0.1:9102"
    assert child_metrics(":0", 2) == ":0" and child_metrics(None, 1) is None
    with pytest.raises(ConfigError):
        child_metrics("127.0.0.1:nine", 1)


def test_each_child_gets_its_share_its_identity_and_its_ports(tmp_path: Path) -> None:
    args = parsed("--expert-pattern", "ffn.[0:2].[0:3]", "--processes", "2", "--identity", str(tmp_path / "id.key"),
                  "--listen", "/ip4/0.0.0.0/tcp/4001", "--listen", "/ip6/::/tcp/4001",
                  "--announce", "/ip4/203.0.113.7/tcp/4001", "--metrics", ":9100", "--secret-file", str(tmp_path / "s"))
    first, second = child_args(args, 0, 2), child_args(args, 1, 2)
    assert first.identity == tmp_path / "id.key" and second.identity == tmp_path / "id.key.1"
    assert child_identity(tmp_path / "id.key", 3) == tmp_path / "id.key.3"
    assert first.listen == args.listen and second.listen == ["/ip4/0.0.0.0/tcp/4002", "/ip6/::/tcp/4002"]
    assert second.announce == ["/ip4/203.0.113.7/tcp/4002"] and second.metrics == ":9101"
    assert first.processes == second.processes == 1 and args.processes == 2  # the server's own are untouched
    assert parsed("--expert-pattern", "ffn.[0:2]", "--duration", "5").duration == 5 and second.duration is None
    mine = [str(u) for u in expert_uids(first)], [str(u) for u in expert_uids(second)]
    assert mine == (["ffn.0.0", "ffn.0.2", "ffn.1.1"], ["ffn.0.1", "ffn.1.0", "ffn.1.2"])
    back = decode_args(encode_args(second))  # what the child reads on its stdin
    assert vars(back) == vars(second) and isinstance(back.secret_file, Path)
    with pytest.raises(ConfigError, match="more processes than the 6 experts"):
        check_processes(7, 6)
    with pytest.raises(ConfigError, match="--processes must be"):
        check_processes(0, 6)
    with pytest.raises(ConfigError):
        decode_args(b"[1, 2]")


def test_an_experts_initial_weights_do_not_depend_on_the_process_that_hosts_it() -> None:
    one = parsed("--expert-pattern", "ffn.[0:4]", "--hidden-dim", str(HID), "--device", "cpu", "--threads", "1")
    whole = {str(b.uid): b for b in build_backends(one)}
    part = build_backends(child_args(one, 1, 2))
    assert [str(b.uid) for b in part] == ["ffn.1", "ffn.3"]
    for b in part:
        assert all(torch.equal(p, q) for p, q in zip(b.module.parameters(), whole[str(b.uid)].module.parameters()))
    assert not torch.equal(whole["ffn.0"].module.ffn.weight, whole["ffn.1"].module.ffn.weight)
    assert expert_seed(0, "ffn.1") != expert_seed(1, "ffn.1") and 0 <= expert_seed(0, "ffn.1") < 1 << 63


def test_a_servers_torch_threads_are_its_share_of_the_cores_it_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """--threads 0: the cores a container's quota leaves (not the host's count, torch's default),
    shared among --processes; a number given is kept."""
    assert torch_threads(0, 8, 1) == 8 and torch_threads(0, 8, 2) == 4 and torch_threads(0, 2, 4) == 1
    assert torch_threads(3, 8, 2) == 3
    monkeypatch.setattr("training.moe.cli.process_cores", lambda: 6)
    before = torch.get_num_threads()
    try:
        build_backends(child_args(parsed("--expert-pattern", "ffn.[0:4]", "--hidden-dim", str(HID), "--device", "cpu"),
                                  0, 3))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_plans_edges_and_what_its_errors_say(tmp_path: Path) -> None:
    """Each bound at its edge, and each error naming the flag it is about."""
    with pytest.raises(ValueError, match="shard 3 of 3"):
        shard([1, 2, 3], 3, 3)
    assert shifted_port("/ip4/1.2.3.4/tcp/65534", 1, what="--listen") == "/ip4/1.2.3.4/tcp/65535"
    with pytest.raises(ConfigError, match=r"--listen /ip4/1.2.3.4/tcp/65535: process 1 would need TCP port 65536"):
        shifted_port("/ip4/1.2.3.4/tcp/65535", 1, what="--listen")
    assert child_metrics("[::1]:9100", 1) == "[::1]:9101"  # the port is after the last colon
    assert child_metrics("127.0.0.1:65534", 1) == "127.0.0.1:65535"
    with pytest.raises(ConfigError, match=r"--metrics 127.0.0.1:65535: process 1 would need port 65536"):
        child_metrics("127.0.0.1:65535", 1)
    with pytest.raises(ConfigError, match=r"process 2 would need port 65537"):
        child_metrics("127.0.0.1:65535", 2)
    base = argparse.Namespace(identity=tmp_path / "id.key", listen=["/ip4/0.0.0.0/tcp/4001"])  # no announce, metrics
    child = child_args(base, 1, 2)
    assert child.listen == ["/ip4/0.0.0.0/tcp/4002"] and child.metrics is None and not hasattr(child, "announce")
    with pytest.raises(AddressError, match="--listen 'ip4/1.2.3.4'"):
        child_args(argparse.Namespace(identity=tmp_path / "k", listen=["ip4/1.2.3.4"]), 1, 2)
    with pytest.raises(AddressError, match="--announce 'ip4/1.2.3.4'"):
        child_args(argparse.Namespace(identity=tmp_path / "k", listen=None, announce=["ip4/1.2.3.4"]), 1, 2)
    assert vars(decode_args(b'{"options": {"seed": 3}}')) == {"seed": 3}  # no paths named: none converted
    for garbled in (b'{"paths": []}', b"{not json", b""):
        with pytest.raises(ConfigError, match="^serve-experts child: its options must come as a JSON object on stdin$"):
            decode_args(garbled)
    for count, experts in ((1, 1), (64, 64), (6, 6)):
        check_processes(count, experts)
    with pytest.raises(ConfigError, match=r"^--processes must be 1\.\.64, got 65$"):
        check_processes(65, 100)
    with pytest.raises(ConfigError, match=r"^--processes 7: more processes than the 6 experts of --expert-pattern$"):
        check_processes(7, 6)
