"""``dedloc serve-experts --processes N``: the plan of each child (pure), then the command as a user runs
it: one grid from two processes, found and called through the DHT, stopped together."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from nat import Peer
from p2p.errors import AddressError, ConfigError
from training.commands import build_parser
from training.moe import ExpertClient, MoEConfig, MoEError, RemoteMixtureOfExperts
from training.moe.cli import build_backends, expert_uids
from training.moe.experts import expert_seed
from training.moe.processes import (check_processes, child_args, child_identity, child_metrics, decode_args,
                                    encode_args, shard, shifted_port)

from .kit import collect_events, loopback_peer_config

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


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


async def test_two_processes_serve_one_grid_that_a_layer_uses_and_stop_together(tmp_path: Path) -> None:
    """`serve-experts --processes 2` as a user runs it: two peers (two peer ids), each declaring its
    half of the grid; a layer's forward and backward reach both; SIGTERM to the command stops both,
    each saving its checkpoints."""
    async with Peer.open(loopback_peer_config(relay=True)) as relay:
        boot = str(relay.addrs[0])
        server = await trio.lowlevel.open_process(
            [sys.executable, "-m", "training.commands", "serve-experts", "--expert-pattern", "ffn.[0:2].[0:3]",
             "--processes", "2", "--hidden-dim", str(HID), "--initial-peers", boot, "--listen",
             "/ip4/127.0.0.1/tcp/0", "--ephemeral", "--allow-private", "--device", "cpu", "--threads", "1",
             "--checkpoint-dir", str(tmp_path), "--duration", "90", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        events: list[dict[str, Any]] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect_events, server, ["listening", "expert_processes"], events)
                async with Peer.open(loopback_peer_config(initial_peers=[boot])) as peer, \
                        ExpertClient.open(peer) as client:
                    layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2, 3), uid_prefix="ffn",
                                                   config=MoEConfig(k_best=6, cache_ttl=0.1))
                    x = torch.randn(4, HID, requires_grad=True)
                    with trio.fail_after(60):
                        while True:  # until both children have started and declared their halves
                            try:
                                y = await client.run(lambda: layer(x))
                            except MoEError:
                                y = None
                            if y is not None and layer.last_report is not None and layer.last_report.answered == 6:
                                break
                            await trio.sleep(0.5)
                    await client.run(lambda: layer(x).sum().backward())  # every expert of both halves steps
                    assert y.shape == (4, HID) and x.grad is not None
                    listening = {e["peer_id"] for e in events if e["event"] == "listening"}
                    assert len(listening) == 2
                server.send_signal(signal.SIGTERM)
                with trio.fail_after(30):
                    await server.wait()
        finally:
            if server.returncode is None:
                server.kill()
    assert server.returncode == 0
    assert [e for e in events if e["event"] == "expert_processes"][0]["processes"] == 2
    saved = {path.stem: torch.load(path, weights_only=True) for path in tmp_path.glob("ffn.*.pt")}
    assert len(saved) == 6  # every expert saved by the child hosting it, each updated by the backward
    assert all(int(state["updates"]) >= 1 for state in saved.values()), {k: v["updates"] for k, v in saved.items()}


async def test_a_child_that_dies_stops_the_others_and_the_command_fails(tmp_path: Path) -> None:
    server = await trio.lowlevel.open_process(
        [sys.executable, "-m", "training.commands", "serve-experts", "--expert-pattern", "ffn.[0:4]",
         "--processes", "2", "--hidden-dim", str(HID), "--initial-peers", BOOT, "--bootstrap-timeout", "60",
         "--listen", "/ip4/127.0.0.1/tcp/0", "--ephemeral", "--device", "cpu", "--threads", "1",
         "--duration", "90"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with trio.fail_after(30):
            while len(children := children_of(server.pid)) < 2:
                await trio.sleep(0.1)
        os.kill(children[0], signal.SIGKILL)
        with trio.fail_after(30):
            await server.wait()
        assert server.returncode not in (0, None)
        with trio.fail_after(10):
            while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                      for pid in children):
                await trio.sleep(0.1)
    finally:
        if server.returncode is None:
            server.kill()
        for pid in children_of(server.pid):
            os.kill(pid, signal.SIGKILL)
