"""``dedloc serve-experts --processes N`` as a user runs it: one grid from two processes, found and called
through the DHT, stopped together (each child's plan: tests/test_moe_shards.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import trio

from nat import Peer
from training.moe import ExpertClient, MoEConfig, MoEError, RemoteMixtureOfExperts

from .kit import collect_events, loopback_peer_config

HID = 8
BOOT = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


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
         "--duration", "90", "--json"],
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
            while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                      for pid in children):
                await trio.sleep(0.1)
    finally:
        if server.returncode is None:
            server.kill()
        for pid in children_of(server.pid):
            os.kill(pid, signal.SIGKILL)


async def test_the_servers_duration_stops_every_child_and_exits_cleanly() -> None:
    """--duration is the parent's: when it passes, every child is stopped as by SIGTERM and the command
    exits 0 (were it each child's, the first to end would look like a crash and fail the command)."""
    server = await trio.lowlevel.open_process(
        [sys.executable, "-m", "training.commands", "serve-experts", "--expert-pattern", "ffn.[0:2]",
         "--processes", "2", "--hidden-dim", str(HID), "--initial-peers", BOOT, "--bootstrap-timeout", "60",
         "--listen", "/ip4/127.0.0.1/tcp/0", "--ephemeral", "--device", "cpu", "--threads", "1",
         "--duration", "6"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with trio.fail_after(40):
            await server.wait()
        assert server.returncode == 0
    finally:
        if server.returncode is None:
            server.kill()
