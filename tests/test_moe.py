"""Decentralized mixture-of-experts: servers, remote calls, beam search, the layer, faults (real peers on loopback)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from nat import Peer
from p2p.dht import DHTMode
from p2p.errors import ConfigError
from training.moe import (ClientConfig, Expert, ExpertBackend, ExpertCallError, ExpertClient, ExpertServer,
                          MoEConfig, MoEError, RemoteExpert, RemoteMixtureOfExperts, ServerConfig)
from training.moe.beam_search import Beam, parse_successors, select
from training.moe.experts import FeedforwardBlock
from training.moe.grid import expand_pattern
from training.moe.layer import _exchanges, _plan
from training.moe.protocol import Kind

from .kit import loopback_peer_config, random_peer_id, wait_until
from .moe_swarm import HID, HangingDHT, backends, swarm

# ---------------------------------------------------------------------- pure parts


def test_select_keeps_the_best_live_extensions_and_skips_unusable_servers() -> None:
    a, b = random_peer_id(), random_peer_id()
    scores = torch.tensor([0.0, 5.0, 1.0, 3.0])
    live = {(): {1: [Expert("e.1", a)], 2: [Expert("e.2", a)], 3: [Expert("e.3", b)], 9: [Expert("e.9", a)]}}
    best = select(scores, [Beam(0.0, ())], live, 2)
    assert [x.coords for x in best] == [(1,), (3,)]  # 0 is not live, 9 is outside the grid
    best = select(scores, [Beam(0.0, ())], live, 2, usable=lambda e: e.peer_id != a)
    assert [x.coords for x in best] == [(3,)]
    # at the last dimension a record must name the expert of its own coordinates
    lying = {(): {1: [Expert("e.3", a)], 3: [Expert("e.3", b)]}}
    assert [x.coords for x in select(scores, [Beam(0.0, ())], lying, 2, prefix="e")] == [(3,)]
    beams = [[Beam(1.0, (1,), [Expert("e.1", a)]), Beam(0.5, (3,), [Expert("e.3", b)])],
             [Beam(1.0, (3,), [Expert("e.3", b)])]]
    jobs = _plan(beams, 4096)
    assert {j.expert.uid: (j.rows.tolist(), j.slots.tolist()) for j in jobs} == {"e.1": ([0], [0]),
                                                                              "e.3": ([0, 1], [1, 0])}
    # a batch larger than a call's max_rows: several jobs, and exchanges of at most max_rows rows
    jobs = _plan(beams, 1)
    assert sorted((j.expert.uid, j.rows.tolist()) for j in jobs) == [("e.1", [0]), ("e.3", [0]), ("e.3", [1])]
    assert sorted(len(x) for x in _exchanges(jobs, 1)) == [1, 1, 1]
    assert sorted(len(x) for x in _exchanges(_plan(beams, 4096), 4096)) == [1, 1]
    assert parse_successors(None) == {}


# ---------------------------------------------------------------------- over the network


async def test_a_remote_expert_computes_and_trains_like_the_local_module() -> None:
    async with swarm("ffn.[0:1].[0:2]") as sw:
        client_peer, peers, server = sw.client, sw.peers, sw.servers[0]
        local = FeedforwardBlock(HID)
        local.load_state_dict(server.backends["ffn.0.1"].module.state_dict())
        async with ExpertClient.open(client_peer) as client:
            expert = Expert("ffn.0.1", peers[0].peer_id, tuple(peers[0].addrs))
            assert await client.info(expert) == (torch.Size([HID]), torch.Size([HID]))
            remote = RemoteExpert(client, expert)
            x = torch.randn(5, HID, requires_grad=True)
            x_local = x.detach().clone().requires_grad_(True)
            w = torch.randn(5, HID)  # a loss whose gradient reaches W1 (sum(LayerNorm(.)**2) is constant)

            def step() -> tuple[torch.Tensor, torch.Tensor]:
                y = remote(x)
                (y * w).sum().backward()
                return y.detach(), x.grad.detach()  # type: ignore[union-attr]

            y, gx = await client.run(step)
            y_local = local(x_local)
            (y_local * w).sum().backward()
            assert torch.allclose(y, y_local.detach(), atol=1e-5)
            assert torch.allclose(gx, x_local.grad, atol=1e-5)  # type: ignore[arg-type]
            # the server applied its optimizer on the gradient it received
            before = local.ffn.weight.detach()
            after = server.backends["ffn.0.1"].module.ffn.weight.detach()
            assert server.backends["ffn.0.1"].updates == 1 and not torch.allclose(before, after)
            # bad input: a clear error from the server, the call counted, the expert banned
            with pytest.raises(ExpertCallError, match="rows of shape"):
                await client.forward(expert, torch.randn(3, HID + 1))
            with pytest.raises(ExpertCallError, match="does not host"):
                await client.forward(Expert("ffn.9.9", peers[0].peer_id), torch.randn(3, HID))
            with pytest.raises(ExpertCallError, match="non-finite|NaN|nan"):
                await client.forward(Expert("ffn.0.0", peers[0].peer_id), torch.full((2, HID), math.nan))
            assert server.refused["bad_request"] >= 2 and client.stats.failures == 3
            assert client.banned("ffn.0.0", peers[0].peer_id)
            # called from the trio thread itself: a clear error, not a deadlock
            with pytest.raises(RuntimeError, match="worker thread"):
                remote(torch.randn(1, HID))


async def test_the_layer_finds_live_experts_by_beam_search_and_learns() -> None:
    async with swarm("ffn.[0:4].[0:2]", "ffn.[0:4].[2:4]") as sw:
        client_peer, servers = sw.client, sw.servers
        async with ExpertClient.open(client_peer) as client:
            torch.manual_seed(1)
            layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(4, 4), uid_prefix="ffn",
                                           config=MoEConfig(k_best=3))
            head = torch.nn.Linear(HID, 1)
            params = [*layer.parameters(), *head.parameters()]
            opt = torch.optim.SGD(params, lr=0.05)
            x = torch.randn(32, HID)
            target = x[:, :1] * 2 - 1

            def step() -> float:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(head(layer(x)), target)
                loss.backward()
                opt.step()
                return float(loss.detach())

            losses = [await client.run(step) for _ in range(25)]
            report = layer.last_report
            assert report is not None and report.answered == report.asked and not report.failed
            assert report.below_k_min == 0
            # both servers were used, and each trained its experts
            assert all(sum(b.updates for b in s.backends.values()) > 0 for s in servers), \
                [(s.calls, {u: (b.forwards, b.updates) for u, b in s.backends.items()}) for s in servers]
            assert losses[-1] < 0.7 * losses[0], losses
            # the search reads the DHT cold, then answers from its cache
            reads = layer.searcher.stats.reads
            await client.run(lambda: layer(x))
            assert layer.searcher.stats.reads == reads and layer.searcher.stats.cache_hits > 0


async def test_a_dead_server_is_left_out_and_the_weights_renormalised() -> None:
    async with swarm("ffn.[0:2].[0:2]", "ffn.[2:4].[0:2]") as sw:
        client_peer = sw.client
        async with ExpertClient.open(client_peer, ClientConfig(forward_timeout=3.0)) as client:
            # 6 of the 8 experts for each sample: at least 2 of them on the server that lives
            # beam_size 8: the search keeps every prefix, so each sample's 6 are exactly its best 6 of 8
            layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(4, 2), uid_prefix="ffn",
                                           config=MoEConfig(k_best=6, beam_size=8, forward_timeout=5.0,
                                                            timeout_after_k_min=0.5))
            x = torch.randn(16, HID)
            await client.run(lambda: layer(x))  # warm: the cache holds both servers' experts
            sw.kill(1)
            with trio.fail_after(20):
                started = trio.current_time()
                y = await client.run(lambda: layer(x))
                took = trio.current_time() - started
            report = layer.last_report
            assert report is not None
            assert y.shape == (16, HID) and bool(torch.isfinite(y).all())
            assert took < 5.0 + 1.0  # never past the forward timeout (plus the thread hop)
            # the dead server's experts failed or came late, and are banned from the next search
            assert report.failed or report.late
            # the mixed values: each sample's chosen experts that live (ffn.0.* and ffn.1.*, on server 0),
            # weighted by the softmax of their scores over those alone (the dead ones' weight goes to them)
            with torch.no_grad():
                g = layer.gate(x)
                live = sw.servers[0].backends
                expected = torch.zeros(16, HID)
                for i in range(16):
                    scores = {(a, b): float(g[i, a] + g[i, 4 + b]) for a in range(4) for b in range(2)}
                    best = sorted(scores, key=scores.__getitem__, reverse=True)[:6]
                    alive = [c for c in best if f"ffn.{c[0]}.{c[1]}" in live]
                    assert alive  # 6 of 8: at least 2 on the live server
                    w = torch.softmax(torch.tensor([scores[c] for c in alive]), dim=0)
                    for wc, c in zip(w, alive):
                        expected[i] += wc * live[f"ffn.{c[0]}.{c[1]}"].module(x[i:i + 1])[0]
            assert torch.allclose(y, expected, atol=1e-5), float((y - expected).abs().max())
            y2 = await client.run(lambda: layer(x))
            assert layer.last_report is not None and not layer.last_report.failed
            assert bool(torch.isfinite(y2).all())


async def test_nothing_live_is_a_clear_error() -> None:
    async with swarm() as sw:
        client_peer = sw.client
        async with ExpertClient.open(client_peer) as client:
            layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(4, 4), uid_prefix="none",
                                           config=MoEConfig(k_best=2, forward_timeout=3.0))
            with pytest.raises(MoEError, match=r"^no live expert under 'none' \(grid 4x4\): no server declares one$"):
                await client.run(lambda: layer(torch.randn(2, HID)))
            with pytest.raises(ValueError, match="input must be"):
                await client.run(lambda: layer(torch.randn(2, HID + 1)))


async def test_a_search_that_finds_only_banned_experts_says_so() -> None:
    """Every expert found left out after failures is not "nobody is there": the error says how many
    were found, when the first is back in searches (an overloaded one's short ban, not ban_time) and
    the latest failure (a bench's evaluation after a server was killed once failed for a minute with
    only "no live expert" to go on)."""
    async with swarm("ffn.0.[0:2]") as sw:
        peer = sw.peers[0]
        async with ExpertClient.open(sw.client, ClientConfig(ban_time=60.0, overload_ban_time=20.0)) as client:
            layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(1, 2), uid_prefix="ffn",
                                           config=MoEConfig(k_best=2, forward_timeout=3.0))
            await client.run(lambda: layer(torch.randn(2, HID)))
            client.ban(Expert("ffn.0.0", peer.peer_id), ExpertCallError("expert ffn.0.0: overloaded", busy=True))
            client.ban(Expert("ffn.0.1", peer.peer_id), ExpertCallError("expert ffn.0.1: it broke"))
            with pytest.raises(MoEError, match=r"^no live expert under 'ffn' \(grid 1x2\): the 2 experts it found are "
                                               r"all left out after failed calls \(the first is back in searches in "
                                               r"(19\.\d|20\.0) s; the latest failure: expert ffn.0.1: it broke\)$"):
                await client.run(lambda: layer(torch.randn(2, HID)))
            assert {e.uid for e in layer.searcher.last.left_out} == {"ffn.0.0", "ffn.0.1"}
            assert layer.searcher.last.unread == 0


async def test_a_search_whose_reads_hang_says_so_and_not_that_nobody_is_there() -> None:
    """A DHT read that runs past read_timeout is "unknown", not "empty": not cached, and named in the
    error; a search cut by forward_timeout says that instead."""
    async with swarm("ffn.0.[0:2]") as sw:
        async with ExpertClient.open(sw.client) as client:
            layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(1, 2), uid_prefix="ffn",
                                           config=MoEConfig(k_best=2, forward_timeout=2.0))
            layer.searcher.dht = HangingDHT()  # type: ignore[assignment]
            layer.searcher.read_timeout = 0.2
            with pytest.raises(MoEError, match=r"^no live expert under 'ffn' \(grid 1x2\): the DHT read of 1 "
                                               r"prefixes failed or ran past read_timeout 0.2 s$"):
                await client.run(lambda: layer(torch.randn(2, HID)))
            assert layer.searcher.last.unread == 1 and not layer.searcher._cache
            layer.searcher.read_timeout = 5.0
            with pytest.raises(MoEError, match=r"^no live expert under 'ffn' \(grid 1x2\): the search did not finish "
                                               r"within [12]\.\d s \(forward_timeout\)$"):
                await client.run(lambda: layer(torch.randn(2, HID)))


async def test_checkpoints_survive_a_restart(tmp_path: Path) -> None:
    config = ServerConfig(checkpoint_dir=tmp_path)
    async with swarm("ffn.0.[0:2]", config=config) as sw:
        client = sw.client
        servers = sw.servers
        weight = servers[0].backends["ffn.0.1"].module.ffn.weight.detach().clone()
        servers[0].backends["ffn.0.1"].updates = 7
    assert (tmp_path / "ffn.0.1.pt").exists()
    fresh = backends("ffn.0.[0:2]", seed=99)
    ExpertServer(client, fresh, config).load_checkpoints()
    assert torch.equal(fresh[1].module.ffn.weight, weight) and fresh[1].updates == 7


def test_backend_checks_requests() -> None:
    (b,) = backends("ffn.0.0")
    good = torch.zeros(2, HID)
    assert b.check(Kind.FORWARD, [good], 10) is None
    assert "rows of shape" in (b.check(Kind.FORWARD, [torch.zeros(2, 3)], 10) or "")
    assert "1..10 rows" in (b.check(Kind.FORWARD, [torch.zeros(11, HID)], 10) or "")
    assert "takes 2 tensors" in (b.check(Kind.BACKWARD, [good], 10) or "")
    assert "output gradient" in (b.check(Kind.BACKWARD, [good, torch.zeros(3, HID)], 10) or "")



async def test_a_small_batch_waits_for_rows_without_holding_the_device() -> None:
    """min_batch_size / max_wait: a batch short of its rows waits for more (one batch, not two), a lone
    request is served once max_wait has passed, and the waiting holds nothing: another expert's batch
    takes the device meanwhile. (The real clock: a batch computes in a worker thread.)"""
    from training.moe.server import _Pool, _Task

    config = ServerConfig(min_batch_size=8, max_wait=1.0)
    config.validate()
    with pytest.raises(ConfigError, match="min_batch_size"):
        ServerConfig(min_batch_size=8, max_batch_size=4).validate()
    waiting_b, other_b = backends("ffn.[0:2]")
    waiting, other = _Pool(waiting_b, Kind.FORWARD, config), _Pool(other_b, Kind.FORWARD, ServerConfig())
    device = trio.Lock()
    done_at: dict[str, float] = {}

    async def call(pool: _Pool, name: str, rows: int) -> None:
        task = _Task([torch.randn(rows, HID)])
        pool.submit(task)
        await task.done.wait()
        assert task.result is not None and task.result.shape == (rows, HID)
        done_at[name] = trio.current_time()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiting.run, device)
            nursery.start_soon(other.run, device)
            nursery.start_soon(call, waiting, "a", 2)
            await trio.sleep(0.2)
            nursery.start_soon(call, other, "other", 2)  # served at once: the waiting pool holds no lock
            await trio.sleep(0.4)
            assert "other" in done_at and "a" not in done_at and other.batches == 1 and waiting.batches == 0
            nursery.start_soon(call, waiting, "b", 6)  # fills the batch: a and b computed together
            while "a" not in done_at or "b" not in done_at:
                await trio.sleep(0.01)
            assert waiting.batches == 1 and waiting_b.rows_processed == 8
            lone = trio.current_time()
            nursery.start_soon(call, waiting, "lone", 3)  # nothing more comes: served after max_wait
            while "lone" not in done_at:
                await trio.sleep(0.01)
            assert done_at["lone"] - lone >= 1.0 and waiting.batches == 2 and waiting_b.rows_processed == 11
            nursery.cancel_scope.cancel()


def test_serve_experts_options_build_fused_optimizers_and_refuse_bad_threads() -> None:
    """serve-experts' experts step with fused Adam (a small batch's backward is mostly the step);
    --threads sets torch's CPU threads, and a negative count is refused before anything starts."""
    import argparse

    from training.moe.cli import build_backends

    args = argparse.Namespace(expert_pattern="ffn.[0:2]", hidden_dim=8, lr=1e-3, device="cpu", seed=0,
                              expert_cls="ffn", threads=-1)
    with pytest.raises(ConfigError, match="--threads"):
        build_backends(args)
    before = torch.get_num_threads()
    try:
        args.threads = 1
        backends = build_backends(args)
        assert torch.get_num_threads() == 1 and len(backends) == 2
        assert all(b.optimizer is not None and b.optimizer.defaults["fused"] for b in backends)
        backends[0].backward(torch.randn(3, 8), torch.randn(3, 8))
        assert backends[0].updates == 1
    finally:
        torch.set_num_threads(before)


async def test_serve_experts_command_hosts_a_grid_that_a_layer_uses(tmp_path: Path) -> None:
    """`dedloc serve-experts` as a user runs it, found through the DHT and called by the layer; its
    checkpoints written when it stops."""
    import subprocess
    import sys

    async with Peer.open(loopback_peer_config(relay=True)) as relay:
        boot = str(relay.addrs[0])
        server = await trio.lowlevel.open_process(
            [sys.executable, "-m", "training.commands", "serve-experts", "--expert-pattern", "ffn.[0:2].[0:3]",
             "--hidden-dim", str(HID), "--initial-peers", boot, "--listen", "/ip4/127.0.0.1/tcp/0", "--ephemeral",
             "--allow-private", "--device", "cpu", "--threads", "1", "--checkpoint-dir", str(tmp_path),
             "--duration", "60"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async with Peer.open(loopback_peer_config(initial_peers=[boot])) as peer, \
                    ExpertClient.open(peer) as client:
                layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2, 3), uid_prefix="ffn",
                                               config=MoEConfig(k_best=2, cache_ttl=0.1))
                x = torch.randn(4, HID)
                with trio.fail_after(40):
                    while True:  # until the server has started and declared its grid
                        try:
                            y = await client.run(lambda: layer(x))
                            break
                        except MoEError:
                            await trio.sleep(0.5)
                assert y.shape == (4, HID) and layer.last_report is not None
                assert layer.last_report.answered == layer.last_report.asked >= 1
                await client.run(lambda: layer(x).sum().backward())
            # a second server of the same experts on the directory would save over the first one's weights
            second = await trio.run_process(
                [sys.executable, "-m", "training.commands", "serve-experts", "--expert-pattern", "ffn.[0:2].[0:3]",
                 "--hidden-dim", str(HID), "--initial-peers", boot, "--ephemeral", "--checkpoint-dir", str(tmp_path)],
                capture_stdout=True, capture_stderr=True, check=False)
            assert second.returncode == 1 and (f"--checkpoint-dir {tmp_path} is in use by another dedloc process (pid "
                                               f"{server.pid})") in second.stderr.decode(), second.stderr.decode()
        finally:
            server.terminate()
            with trio.fail_after(20):
                await server.wait()
    assert len(list(tmp_path.glob("ffn.*.pt"))) == 6


async def test_calls_share_a_kept_stream_and_survive_the_server_closing_it() -> None:
    """Many calls, few streams (a stream per call would cost a negotiation each and trip the
    per-peer stream rate); a kept stream the server closed meanwhile is replaced without a failure."""
    async with swarm("ffn.0.[0:2]", config=ServerConfig(idle_timeout=0.3)) as sw:
        server = sw.servers[0]
        async with ExpertClient.open(sw.client) as client:
            expert = Expert("ffn.0.0", sw.peers[0].peer_id, tuple(sw.peers[0].addrs))
            for _ in range(30):
                await client.forward(expert, torch.randn(2, HID))
            assert server.calls == 30 and server.streams == 1
            await trio.sleep(0.6)  # the server closes the idle stream
            out = await client.forward(expert, torch.randn(3, HID))
            assert out.shape == (3, HID) and client.stats.failures == 0 and server.streams == 2
            # concurrent calls each take a stream of their own, then keep them
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(client.forward, expert, torch.randn(2, HID))
            assert server.calls == 39 and server.streams <= 2 + 8


async def test_a_new_stream_reset_before_its_answer_is_retried_for_a_forward_never_for_a_backward() -> None:
    """A forward is pure: a fresh stream reset before any answer byte (a race with a closing
    connection, a refusal) costs one more stream, not a failed call. A backward may have been
    applied before the reset: it fails, and the error says who reset the stream."""
    from training.moe.protocol import PROTOCOL

    async with swarm("ffn.0.[0:1]", real=True) as sw:  # the error names who reset the stream: Yamux's words
        server_peer, server = sw.peers[0], sw.servers[0]
        resets = 0

        async def flaky(stream: Any) -> None:  # resets the next stream it gets, then serves as usual
            nonlocal resets
            if resets < 1:
                resets += 1
                await stream.read(64)
                await stream.reset()
                return
            await server._on_stream(stream)

        server_peer.set_stream_handler(PROTOCOL, flaky)
        expert = Expert("ffn.0.0", server_peer.peer_id)
        async with ExpertClient.open(sw.client) as client:
            out = await client.forward(expert, torch.randn(2, HID))
            assert out.shape == (2, HID) and client.stats.failures == 0 and resets == 1 and server.streams == 1
        resets = 0
        async with ExpertClient.open(sw.client) as client:  # no kept stream: the backward opens a new one
            with pytest.raises(ExpertCallError, match="StreamReset.*reset by"):
                await client.backward(expert, torch.randn(2, HID), torch.randn(2, HID))
            assert resets == 1 and server.calls == 1  # the forward's only


class NaNExpert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(HID))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w * math.nan


async def test_garbage_and_lying_servers_give_clear_errors_and_nothing_hangs() -> None:
    from averaging.tensor_stream import send_tensors
    from averaging.wire import FrameReader, frame
    from training.proto import moe_pb2 as pb
    from training.moe.protocol import PROTOCOL

    async with swarm("ffn.0.[0:1]") as sw:
        server_peer, server = sw.peers[0], sw.servers[0]
        # a caller that sends garbage, or claims a huge tensor: the server refuses or resets, and goes on
        for garbage in [b"\xff" * 64, frame(pb.ExpertRequest(uid="ffn.0.0")) + b"\x05\x0a\x03\x08\x01\x12\x7f",
                        frame(pb.ExpertRequest(uid="ffn.0.0")) + b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"]:
            stream = await sw.client.new_stream(server_peer.peer_id, PROTOCOL)
            await stream.write(garbage)
            with trio.fail_after(10):
                try:
                    while await stream.read(65536):
                        pass
                except Exception:
                    pass  # reset: as good as closed
        # an expert whose module returns NaN: FAILED, said so
        nan_backend = ExpertBackend("nan.0.0", NaNExpert(), None, (HID,))
        server.backends["nan.0.0"] = nan_backend
        from training.moe.protocol import Kind as K
        from training.moe.server import _Pool
        server._pools[("nan.0.0", K.FORWARD)] = pool = _Pool(nan_backend, K.FORWARD, server.config)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.run, server._device)
            async with ExpertClient.open(sw.client) as client:
                with pytest.raises(ExpertCallError, match="NaN or Inf"):
                    await client.forward(Expert("nan.0.0", server_peer.peer_id), torch.randn(2, HID))
                assert (await client.forward(Expert("ffn.0.0", server_peer.peer_id), torch.randn(2, HID))).shape == (2, HID)

                # a lying server: answers OK with the wrong number of rows, or NaN, or never
                async def liar(stream: Any) -> None:
                    reader = FrameReader(stream)
                    request = await reader.message(pb.ExpertRequest, "request")
                    if request.uid == "lie.0.0":
                        await stream.write(frame(pb.ExpertResponse(status=pb.ExpertResponse.OK)))
                        await send_tensors(stream, [torch.zeros(5, HID)])
                    elif request.uid == "lie.0.1":
                        await stream.write(frame(pb.ExpertResponse(status=pb.ExpertResponse.OK)))
                        await send_tensors(stream, [torch.full((2, HID), math.nan)])
                    else:
                        await trio.sleep_forever()

                sw.peers[0].set_stream_handler(PROTOCOL, liar)
            async with ExpertClient.open(sw.client) as client:  # a new client: no stream kept by the old handler
                with pytest.raises(ExpertCallError, match=r"answered \[5, 8\] for 2 rows"):
                    await client.forward(Expert("lie.0.0", server_peer.peer_id), torch.randn(2, HID))
                with pytest.raises(ExpertCallError, match="non-finite|NaN|nan"):
                    await client.forward(Expert("lie.0.1", server_peer.peer_id), torch.randn(2, HID))
                started = trio.current_time()
                with pytest.raises(ExpertCallError, match="no answer within 0.5 s"):
                    await client.forward(Expert("lie.0.2", server_peer.peer_id), torch.randn(2, HID), timeout=0.5)
                assert trio.current_time() - started < 1.5
            nursery.cancel_scope.cancel()


async def test_a_server_that_starts_after_the_first_search_is_found_soon() -> None:
    """An empty prefix is cached only briefly (empty_ttl), not for the whole cache_ttl."""
    async with swarm() as sw:
        async with ExpertClient.open(sw.client) as client:
            layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(1, 2), uid_prefix="late",
                                           config=MoEConfig(k_best=1, cache_ttl=60.0))
            layer.searcher.empty_ttl = 0.5
            with pytest.raises(MoEError):
                await client.run(lambda: layer(torch.randn(2, HID)))
            async with sw.another_peer() as peer, ExpertServer.open(peer, backends("late.0.[0:2]")):
                with trio.fail_after(10):
                    while True:
                        try:
                            y = await client.run(lambda: layer(torch.randn(2, HID)))
                            break
                        except MoEError:
                            await trio.sleep(0.2)
                assert y.shape == (2, HID)


async def test_a_server_that_joins_a_live_prefix_is_found_soon() -> None:
    """A server declaring under a prefix that others already hold is found once the search's own
    copy is past cache_ttl: the trainer's DHT keeps no copy of a dictionary (one read before the
    new server declared hid it for the records' whole lifetime, 90 s: a bench whose first server
    of ffn.0.* was killed found no other expert under ffn.0 for a minute)."""
    async with swarm("join.0.[0:2]", real=True) as sw:  # the trainer a DHT client, as a volunteer's laptop
        async with Peer.open(loopback_peer_config(initial_peers=sw.boot, dht=DHTMode.CLIENT)) as trainer, \
                ExpertClient.open(trainer) as client:
            layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(1, 4), uid_prefix="join",
                                           config=MoEConfig(k_best=4, cache_ttl=0.5))
            with trio.fail_after(20):
                while True:  # until the first server's records are found
                    try:
                        await client.run(lambda: layer(torch.randn(2, HID)))
                        break
                    except MoEError:
                        await trio.sleep(0.2)
            assert layer.last_report is not None and layer.last_report.asked == 2
            async with sw.another_peer() as peer, ExpertServer.open(peer, backends("join.0.[2:4]")):
                # soon: within seconds, where a kept copy hid them for 90 s. Not at the first read past
                # cache_ttl: a read takes the first replica's copy, and one that the new server's second
                # declaration had not reached yet showed 3 of 4 (a CI run under load)
                asked = []
                with trio.move_on_after(10):
                    while not asked or asked[-1] != 4:
                        await trio.sleep(0.6)  # past the search's cache_ttl
                        await client.run(lambda: layer(torch.randn(2, HID)))
                        assert layer.last_report is not None
                        asked.append(layer.last_report.asked)
                assert asked[-1] == 4, asked


async def test_one_exchange_carries_several_experts_each_answered_on_its_own() -> None:
    async with swarm("ffn.0.[0:3]") as sw:
        server, peer = sw.servers[0], sw.peers[0]
        async with ExpertClient.open(sw.client) as client:
            experts = [Expert(uid, peer.peer_id) for uid in ("ffn.0.0", "ffn.0.9", "ffn.0.2")]
            xs = [torch.randn(2, HID), torch.randn(3, HID), torch.randn(4, HID)]
            results = await client.call_many(experts, Kind.FORWARD, [[x] for x in xs], timeout=10)
            assert isinstance(results[1], ExpertCallError) and "does not host" in str(results[1])
            for i in (0, 2):
                out = results[i]
                assert not isinstance(out, ExpertCallError)
                with torch.no_grad():
                    want = server.backends[experts[i].uid].module(xs[i])
                assert torch.allclose(out[0], want, atol=1e-5)
            assert client.banned("ffn.0.9", peer.peer_id) and not client.banned("ffn.0.0", peer.peer_id)
            assert server.streams == 1
            grads = await client.call_many([experts[0], experts[2]], Kind.BACKWARD,
                                           [[xs[0], torch.ones(2, HID)], [xs[2], torch.ones(4, HID)]], timeout=10)
            assert [list(g[0].shape) for g in grads if not isinstance(g, ExpertCallError)] == [[2, HID], [4, HID]]
            assert server.backends["ffn.0.0"].updates == 1 and server.backends["ffn.0.2"].updates == 1
            # where the calls' time went: two exchanges, each timed, with no wait for a slot
            assert client.stats.exchanges == 2 and client.stats.exchange_s > 0
            assert 0 <= client.stats.slot_wait_s < client.stats.exchange_s
            # 500 calls in one exchange (fewer than a queue's 256 per expert): a request header of ~5 KB
            # (joined calls make them that big)
            many = await client.call_many([experts[0], experts[2]] * 250, Kind.FORWARD, [[xs[0][:1]]] * 500,
                                          timeout=10)
            assert all(not isinstance(r, ExpertCallError) and torch.allclose(r[0], many[i % 2][0])
                       for i, r in enumerate(many))


async def test_calls_to_a_server_whose_slots_are_all_in_use_go_together_in_the_next_one() -> None:
    """With one slot per server, 12 concurrent calls: the first takes the slot, the others join one
    exchange (two if one would pass max_rows) that goes when the slot frees; each caller gets its own
    experts' answers, right, and the server sees few exchanges. A joined caller's unknown expert
    fails alone; a caller cancelled while it waits leaves the others' answers whole."""
    async with swarm("ffn.0.[0:3]") as sw:
        server, peer = sw.servers[0], sw.peers[0]
        async with ExpertClient.open(sw.client, ClientConfig(max_streams_per_server=1, max_idle_streams=1,
                                                             max_rows=40)) as client:
            uids = ["ffn.0.0", "ffn.0.1", "ffn.0.2"]
            inputs = {i: [torch.randn(1 + (i + j) % 3, HID) for j in range(3)] for i in range(12)}
            got: dict[int, list[Any]] = {}

            async def call(i: int) -> None:
                names = uids if i != 5 else ["ffn.0.0", "ffn.0.7", "ffn.0.2"]
                got[i] = await client.call_many([Expert(u, peer.peer_id) for u in names], Kind.FORWARD,
                                                [[x] for x in inputs[i]], timeout=10)

            cancelled = trio.CancelScope()

            async def gives_up() -> None:
                with cancelled:
                    await client.call_many([Expert("ffn.0.1", peer.peer_id)], Kind.FORWARD, [[torch.randn(2, HID)]],
                                           timeout=10)

            async with trio.open_nursery() as nursery:
                for i in range(12):
                    nursery.start_soon(call, i)
                nursery.start_soon(gives_up)
                await trio.sleep(0)
                cancelled.cancel()
            for i in range(12):
                for j, out in enumerate(got[i]):
                    if i == 5 and j == 1:
                        assert isinstance(out, ExpertCallError) and "does not host" in str(out)
                        continue
                    assert not isinstance(out, ExpertCallError), out
                    with torch.no_grad():
                        want = server.backends[uids[j]].module(inputs[i][j])
                    assert torch.allclose(out[0], want, atol=1e-5)
            # 12 calls of 6 rows each and one of 2: the first alone, the rest in exchanges of at most 40 rows
            assert client.stats.joined >= 30 and 3 <= client.stats.exchanges <= 5, client.stats
            assert client.stats.failures == 1 and not client._exchanges and client._table.servers() <= 1


async def test_joined_calls_go_in_exchanges_of_at_most_max_join_bytes() -> None:
    """A joined exchange larger than a stream's window waits a round trip per window on a far path:
    calls join one only up to ``max_join_bytes`` of tensors, then start the next (each answered right)."""
    async with swarm("ffn.0.[0:1]") as sw:
        server, peer = sw.servers[0], sw.peers[0]
        expert = Expert("ffn.0.0", peer.peer_id)
        for cap, exchanges in ((1 << 20, 2), (3 * 6 * HID * 4, 5)):  # all 11 waiting calls in one; or 3 a time
            async with ExpertClient.open(sw.client, ClientConfig(max_streams_per_server=1, max_idle_streams=1,
                                                                 max_join_bytes=cap)) as client:
                inputs = [torch.randn(6, HID) for _ in range(12)]
                got: dict[int, Any] = {}

                async def call(i: int) -> None:
                    got[i] = await client.call_many([expert], Kind.FORWARD, [[inputs[i]]], timeout=10)

                async with trio.open_nursery() as nursery:
                    for i in range(12):
                        nursery.start_soon(call, i)
                for i in range(12):
                    with torch.no_grad():
                        assert torch.allclose(got[i][0][0], server.backends["ffn.0.0"].module(inputs[i]), atol=1e-5)
                assert client.stats.joined == 11 and client.stats.exchanges == exchanges, (cap, client.stats)
    with pytest.raises(ConfigError, match="max_join_bytes"):
        ClientConfig(max_join_bytes=0).validate()


async def test_a_call_its_caller_gave_up_is_dropped_unanswered_and_frees_its_stream() -> None:
    """A caller past its timeout resets its stream: the server gives the stream up at once (its resource
    manager would otherwise count it against the caller's streams) and leaves the queued task out of
    its batch (no device time for an answer nobody reads)."""
    async with swarm("ffn.0.[0:1]", real=True) as sw:  # the server's resource manager
        server, peer = sw.servers[0], sw.peers[0]
        backend = server.backends["ffn.0.0"]
        async with ExpertClient.open(sw.client, ClientConfig(forward_timeout=0.3)) as client:
            expert = Expert("ffn.0.0", peer.peer_id, tuple(peer.addrs))
            async with server._device:  # the device is busy: the call waits in the queue
                with pytest.raises(ExpertCallError, match="no answer within"):
                    await client.forward(expert, torch.randn(2, HID))
                def held() -> bool:  # the stream is given back as its handler returns, just after
                    return any(k.startswith("streams./dedloc/moe") and v for k, v in peer.node.resources.usage().items())

                with trio.fail_after(5):  # while the device stays busy: a stream not given up stays held
                    while server.abandoned < 1 or held():
                        await trio.sleep(0.02)
            await trio.sleep(0.1)
            assert backend.forwards == 0 and server._pools[("ffn.0.0", Kind.FORWARD)].dropped == 1
            # the server serves again: 0.3 s was for the queued call above (a loaded CI missed it here)
            out = await client.forward(expert, torch.randn(2, HID), timeout=30)
            assert out.shape == (2, HID) and backend.forwards == 1


async def test_a_batch_larger_than_a_call_is_split_into_calls() -> None:
    """An evaluation's batch of thousands of rows: exchanges of at most max_rows rows, not a refusal."""
    async with swarm("ffn.[0:2].[0:2]") as sw:
        async with ExpertClient.open(sw.client, ClientConfig(max_rows=4)) as client:
            layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2, 2), uid_prefix="ffn",
                                           config=MoEConfig(k_best=2))
            x = torch.randn(16, HID, requires_grad=True)
            y = await client.run(lambda: layer(x))
            report = layer.last_report
            assert report is not None and not report.failed and report.answered == report.asked >= 8
            assert y.shape == (16, HID)
            await client.run(lambda: y.sum().backward())
            assert x.grad is not None and bool(torch.isfinite(x.grad).all())
            assert sum(b.rows_processed for b in sw.servers[0].backends.values()) == 2 * 16 * 2  # fwd + bwd, k 2


async def test_a_caller_that_half_closes_after_its_request_still_gets_its_answer() -> None:
    """Only a reset means the caller gave up: one that closes its side after the request (as many
    request-response clients do) is answered, with the device busy meanwhile."""
    from averaging.tensor_stream import receive_tensors, send_tensors
    from averaging.wire import FrameReader, frame
    from training.moe.protocol import PROTOCOL
    from training.proto import moe_pb2 as pb

    async with swarm("ffn.0.[0:1]") as sw:
        server, peer = sw.servers[0], sw.peers[0]
        stream = await sw.client.new_stream(peer.peer_id, PROTOCOL)
        x = torch.randn(3, HID)
        async with server._device:  # the answer waits in the queue while the caller has closed its side
            await stream.write(frame(pb.ExpertRequest(uid="ffn.0.0", kind=Kind.FORWARD)))
            await send_tensors(stream, [x])
            await stream.close()
            await trio.sleep(0.3)
        reader = FrameReader(stream)
        with trio.fail_after(10):
            response = await reader.message(pb.ExpertResponse, "response")
            (out,) = await receive_tensors(reader, max_bytes=1 << 20, max_tensors=1)
        assert response.status == pb.ExpertResponse.OK and out.shape == (3, HID) and server.abandoned == 0
        with torch.no_grad():
            assert torch.allclose(out, server.backends["ffn.0.0"].module(x), atol=1e-5)


async def test_a_server_that_cannot_be_reached_has_every_expert_left_out_after_one_call() -> None:
    """Incident 4's second part through the client: a call that finds no connection to its server
    leaves out every expert of that server (a killed server's other experts took the slots of the
    samples that chose them until each had failed a call of its own); a live server's stay in."""
    async with swarm("ffn.0.[0:2]", "ffn.1.[0:3]") as sw:
        live, dead = sw.peers[0].peer_id, sw.peers[1].peer_id
        async with ExpertClient.open(sw.client) as client:
            sw.kill(1)
            (failed,) = await client.call_many([Expert("ffn.1.0", dead)], Kind.FORWARD, [[torch.randn(2, HID)]],
                                               timeout=5)  # the layer's path
            assert isinstance(failed, ExpertCallError) and "DialError" in str(failed)
            assert failed.unreachable and not failed.busy
            assert all(client.banned(f"ffn.1.{i}", dead) for i in range(3))
            with pytest.raises(ExpertCallError, match="DialError") as single:
                await client.forward(Expert("ffn.1.1", dead), torch.randn(2, HID))
            assert single.value.unreachable
            assert not client.banned("ffn.0.0", live)
            assert 29.0 < client.ban_left(Expert("ffn.1.2", dead)) <= 30.0  # ban_time, as the one called
            results = await client.call_many([Expert("ffn.0.0", live)], Kind.FORWARD, [[torch.randn(2, HID)]],
                                             timeout=5)
            assert not isinstance(results[0], ExpertCallError)  # the live server answers on


async def test_the_search_passes_over_a_prefix_that_only_unreachable_servers_declared() -> None:
    """With one prefix kept per dimension, a sample whose gate prefers a row whose only server died
    would end with no expert at all (the error for the whole batch): once a call found that server
    unreachable, the search passes over its prefix and keeps the next."""
    async with swarm("ffn.0.[0:2]", "ffn.1.[0:2]") as sw:
        dead = sw.peers[0].peer_id
        async with ExpertClient.open(sw.client) as client:
            layer = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2, 2), uid_prefix="ffn",
                                           config=MoEConfig(k_best=1, beam_size=1, forward_timeout=5.0))
            with torch.no_grad():
                layer.gate.weight.zero_()
                layer.gate.bias.copy_(torch.tensor([10.0, 0.0, 5.0, 0.0]))  # row 0 first, then column 0
            x = torch.randn(2, HID)
            await client.run(lambda: layer(x))
            assert layer.last_report is not None and layer.last_report.answered == 1
            sw.kill(0)
            (failed,) = await client.call_many([Expert("ffn.0.0", dead)], Kind.FORWARD, [[x]], timeout=5)
            assert isinstance(failed, ExpertCallError) and failed.unreachable
            y = await client.run(lambda: layer(x))
            assert y.shape == (2, HID) and layer.last_report is not None and not layer.last_report.failed
            with torch.no_grad():
                want = sw.servers[1].backends["ffn.1.0"].module(x)
            assert torch.allclose(y, want, atol=1e-5)  # row 1's best, the one expert each sample has


async def test_a_busy_expert_is_left_out_briefly_and_a_broken_one_for_ban_time() -> None:
    """Incident 4 of training/moe/calls.py through the client: an expert whose queue is full answers
    OVERLOADED and is left out ``overload_ban_time`` (a long ban of every busy expert of a small grid
    emptied it); one that fails otherwise, ``ban_time``. The ban length comes from the typed failure."""
    async with swarm("ffn.0.[0:2]", config=ServerConfig(max_queue=1)) as sw:
        server, peer = sw.servers[0], sw.peers[0]
        busy, other = Expert("ffn.0.0", peer.peer_id), Expert("ffn.0.9", peer.peer_id)
        async with ExpertClient.open(sw.client, ClientConfig(overload_ban_time=0.3, ban_time=60.0)) as client:
            async with trio.open_nursery() as nursery:
                async with server._device:  # one call waits for the device, one in the queue: the queue is full
                    for _ in range(2):
                        nursery.start_soon(client.forward, busy, torch.randn(2, HID))
                    pool = server._pools[("ffn.0.0", Kind.FORWARD)]
                    await wait_until(lambda: pool.receive.statistics().current_buffer_used == 1, 5, what="queued")
                    with pytest.raises(ExpertCallError, match="^expert ffn.0.0@.*: overloaded: expert ffn.0.0: 1 "
                                                              "requests already queued$") as info:
                        await client.forward(busy, torch.randn(2, HID))
                    assert info.value.busy and not info.value.timed_out and client.banned("ffn.0.0", peer.peer_id)
            with pytest.raises(ExpertCallError, match="unknown_expert") as info:
                await client.forward(other, torch.randn(2, HID))
            assert not info.value.busy
            await trio.sleep(0.35)
            assert not client.banned("ffn.0.0", peer.peer_id) and client.banned("ffn.0.9", peer.peer_id)
            assert client.stats.failures == 2 and client.stats.calls == 4
