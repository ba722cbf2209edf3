"""``dedloc serve-experts --processes N`` as a user runs it: one grid from two processes, found and called
through the DHT, stopped together (each child's plan: tests/test_moe_shards.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from nat import Peer
from p2p.errors import DedlocError
from training.moe import ExpertClient, MoEConfig, MoEError, RemoteMixtureOfExperts
from training.moe.protocol import PROTOCOL

from .kit import alive, collect_events, loopback_peer_config, stat_of

HID = 8
BOOT = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (stat := stat_of(int(e))) and int(stat[1]) == pid]


def serve_experts(pattern: str, boot: str, *options: str, duration: float = 90) -> list[str]:
    """`dedloc serve-experts --processes 2` of ``pattern`` on loopback, joining through ``boot``."""
    return [sys.executable, "-m", "training.commands", "serve-experts", "--expert-pattern", pattern,
            "--processes", "2", "--hidden-dim", str(HID), "--initial-peers", boot, "--listen",
            "/ip4/127.0.0.1/tcp/0", "--ephemeral", "--allow-private", "--device", "cpu", "--threads", "1",
            *options, "--duration", f"{duration:g}"]


@asynccontextmanager
async def serving(boot: str, pattern: str, *options: str, kinds: Sequence[str],
                  ctrl_c: bool = False) -> AsyncIterator[tuple[trio.Process, list[dict[str, Any]]]]:
    """`dedloc serve-experts --processes 2` on loopback, its ``kinds`` of events collected; on leaving,
    SIGTERM to the command (as systemd stops it) or, with ``ctrl_c``, SIGINT to its process group (as a
    terminal's Ctrl-C reaches the parent and every child at once), and its exit (killed if it outlives
    the block)."""
    server = await trio.lowlevel.open_process(serve_experts(pattern, boot, *options, "--json"), stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, start_new_session=True)
    events: list[dict[str, Any]] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect_events, server, kinds, events)
            yield server, events
            if server.returncode is None:
                if ctrl_c:
                    os.killpg(server.pid, signal.SIGINT)
                else:
                    server.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                await server.wait()
    finally:
        if server.returncode is None:
            server.kill()


async def forward_through_every_expert(client: ExpertClient, layer: RemoteMixtureOfExperts, x: torch.Tensor,
                                       experts: int) -> torch.Tensor:
    """``layer(x)`` once every one of its ``experts`` answers (every child has started and declared its share)."""
    with trio.fail_after(60):
        while True:
            y: torch.Tensor | None
            try:
                y = await client.run(lambda: layer(x))
            except MoEError:
                y = None
            if y is not None and layer.last_report is not None and layer.last_report.answered == experts:
                return y
            await trio.sleep(0.5)


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl-c"])
@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
async def test_two_processes_serve_one_grid_that_a_layer_uses_and_stop_together(tmp_path: Path, ctrl_c: bool) -> None:
    """`serve-experts --processes 2` as a user runs it: two peers (two peer ids), each declaring its
    half of the grid; a layer's forward and backward reach both; SIGTERM to the command, or Ctrl-C in
    its terminal, stops both, each saving its checkpoints, with one process's exit status (0; 130)."""
    async with Peer.open(loopback_peer_config(relay=True)) as relay:
        boot = str(relay.addrs[0])
        async with serving(boot, "ffn.[0:2].[0:3]", "--checkpoint-dir", str(tmp_path),
                           kinds=["listening", "expert_processes", "experts_serving"], ctrl_c=ctrl_c) as (server, events):
            async with Peer.open(loopback_peer_config(initial_peers=[boot])) as peer, \
                    ExpertClient.open(peer) as client:
                layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2, 3), uid_prefix="ffn",
                                               config=MoEConfig(k_best=6, cache_ttl=0.1))
                x = torch.randn(4, HID, requires_grad=True)
                y = await forward_through_every_expert(client, layer, x, 6)
                await client.run(lambda: layer(x).sum().backward())  # every expert of both halves steps
                assert y.shape == (4, HID) and x.grad is not None
                listening = {e["peer_id"] for e in events if e["event"] == "listening"}
                assert len(listening) == 2
                ready = sorted((e["process"], e["processes"], e["experts"]) for e in events
                               if e["event"] == "experts_serving")
                assert ready == [(0, 2, 3), (1, 2, 3)]  # each child says when its half is declared
    assert server.returncode == (130 if ctrl_c else 0)
    assert [e for e in events if e["event"] == "expert_processes"][0]["processes"] == 2
    saved = {path.stem: torch.load(path, weights_only=True) for path in tmp_path.glob("ffn.*.pt")}
    assert len(saved) == 6  # every expert saved by the child hosting it, each updated by the backward
    assert all(int(state["updates"]) >= 1 for state in saved.values()), {k: v["updates"] for k, v in saved.items()}


@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
async def test_children_whose_parent_is_killed_save_their_experts_and_stop(tmp_path: Path) -> None:
    """SIGKILL to the command (the OOM killer, say) gives it no chance to stop its children: each reads
    EOF on its stdin, its lifeline, and stops as SIGTERM stops it, saving its experts, instead of
    serving on as an orphan."""
    async with Peer.open(loopback_peer_config(relay=True)) as relay:
        boot = str(relay.addrs[0])
        async with serving(boot, "ffn.[0:4]", "--checkpoint-dir", str(tmp_path), kinds=[]) as (server, _):
            async with Peer.open(loopback_peer_config(initial_peers=[boot])) as peer, \
                    ExpertClient.open(peer) as client:
                layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(4,), uid_prefix="ffn",
                                               config=MoEConfig(k_best=4, cache_ttl=0.1))
                await forward_through_every_expert(client, layer, torch.randn(2, HID), 4)
            children = children_of(server.pid)
            assert len(children) == 2
            server.kill()
            try:
                with trio.fail_after(30):
                    while any(alive(pid) for pid in children):
                        await trio.sleep(0.1)
            finally:  # orphans left by a broken lifeline would serve on
                for pid in filter(alive, children):
                    os.kill(pid, signal.SIGKILL)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", *(f"ffn.{i}.pt" for i in range(4))]


async def test_a_child_that_dies_stops_the_others_and_the_command_fails(tmp_path: Path) -> None:
    server = await trio.lowlevel.open_process(serve_experts("ffn.[0:4]", BOOT, "--bootstrap-timeout", "60", "--json"),
                                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    events: list[dict[str, Any]] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect_events, server, ["expert_process_exited"], events)
            with trio.fail_after(30):
                while len(children := children_of(server.pid)) < 2:
                    await trio.sleep(0.1)
            os.kill(children[0], signal.SIGKILL)
            with trio.fail_after(30):
                await server.wait()
        assert server.returncode not in (0, None)
        (exited,) = events
        assert exited["returncode"] == -signal.SIGKILL and exited["processes"] == 2 and "ts" in exited
        with trio.fail_after(10):
            while any(alive(pid) for pid in children):
                await trio.sleep(0.1)
    finally:
        if server.returncode is None:
            server.kill()
        for pid in children_of(server.pid):
            os.kill(pid, signal.SIGKILL)


async def test_the_servers_duration_stops_every_child_and_exits_cleanly() -> None:
    """--duration is the parent's: when it passes, every child is stopped as by SIGTERM and the command
    exits 0 (were it each child's, the first to end would look like a crash and fail the command)."""
    server = await trio.lowlevel.open_process(serve_experts("ffn.[0:2]", BOOT, "--bootstrap-timeout", "60", duration=6),
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with trio.fail_after(40):
            await server.wait()
        assert server.returncode == 0
    finally:
        if server.returncode is None:
            server.kill()


async def test_in_a_closed_run_each_process_gets_its_own_pass_and_refuses_an_outsider(tmp_path: Path) -> None:
    """`--processes 2` with `--authority`: each child is a peer of its own, so each proves the user's secret
    for its own peer id and holds its own pass (the authority issues one per peer id, not per user); a
    member's layer reaches the experts of both, and each refuses a peer without a pass."""
    from nat.peer import AuthSettings
    from p2p.authority import ALLOWLIST_FILE, AllowList

    allowlist = AllowList(tmp_path / ALLOWLIST_FILE)
    secrets = {u: allowlist.add(u) for u in ("experts", "trainer")}
    allowlist.save()
    (tmp_path / "secret").write_text(secrets["experts"].hex())
    relay_config = loopback_peer_config(relay=True)
    relay_config.auth = AuthSettings(authority_dir=tmp_path)
    async with Peer.open(relay_config) as relay:
        assert relay.authenticator is not None
        key = relay.authenticator.config.authority
        boot = str(relay.addrs[0])
        async with serving(boot, "ffn.[0:4]", "--authority", key.hex(), "--username", "experts", "--secret-file",
                           str(tmp_path / "secret"), kinds=["listening"]) as (server, events):
            member = loopback_peer_config(initial_peers=[boot])
            member.auth = AuthSettings(authority=key, username="trainer", secret=secrets["trainer"])
            async with Peer.open(member) as peer, ExpertClient.open(peer) as client:
                layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(4,), uid_prefix="ffn",
                                               config=MoEConfig(k_best=4, cache_ttl=0.1))
                y = await forward_through_every_expert(client, layer, torch.randn(3, HID), 4)
                assert y.shape == (3, HID)
                assert len({e["peer_id"] for e in events if e["event"] == "listening"}) == 2
            outsider_config = loopback_peer_config(initial_peers=[boot])
            outsider_config.dht = None
            async with Peer.open(outsider_config) as outsider:
                for listening in (e for e in events if e["event"] == "listening"):
                    child = await outsider.node.connect(listening["addrs"][0])
                    outsider.node.closed_swarm.clear()  # as a script that ignores being told: the child's gate refuses
                    with pytest.raises(DedlocError, match="unauthenticated"):
                        stream = await outsider.node.new_stream(child, PROTOCOL, lazy=False)
                        await stream.read(1)
    assert server.returncode == 0
