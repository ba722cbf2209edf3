"""Training state downloads between real peers on loopback: checked, and another peer tried on refusal."""

from __future__ import annotations

import re

import pytest
import trio
import torch
from libp2p.abc import INetStream

from training.state import (STATE_PROTOCOL, StateDownloadError, StateServer, TrainingState, _join, _split,
                            download_state, load_state, snapshot_of)

from .kit import open_peers, wait_until
from .test_averaging import public

pytestmark = pytest.mark.timeout(120)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_state_dicts_survive_the_json_and_tensor_split() -> None:
    _, opt, sched = model_and_optimizer()
    tensors: list[torch.Tensor] = []
    meta = _split({"o": opt.state_dict(), "s": sched.state_dict()}, tensors)
    back = _join(meta, tensors)
    assert back["o"]["param_groups"] == opt.state_dict()["param_groups"]  # int keys, tuples (betas) kept
    assert set(back["o"]["state"]) == {0, 1}
    assert torch.equal(back["o"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    for bad in ({"t": 99}, {"x": 1}, {"d": [[1]]}):
        with pytest.raises(ValueError):
            _join(bad, tensors)


async def test_a_download_refuses_bad_states_and_takes_the_next_peer() -> None:
    model, opt, sched = model_and_optimizer()
    params = list(model.parameters())
    good = snapshot_of(7, params, opt, sched, None)
    wrong_shape = TrainingState(7, [torch.zeros(5, 4), torch.zeros(3)], None, good.optimizer, good.scheduler)
    stale = snapshot_of(2, params, opt, sched, None)
    nan = TrainingState(7, [torch.full((3, 4), float("nan")), torch.zeros(3)], None, good.optimizer, good.scheduler)
    async with open_peers(5) as everyone:
        asker, *servers = everyone[1:]
        await public(everyone[1:])
        states = [wrong_shape, stale, nan, good]
        undo = []
        for server, state in zip(servers, states):

            async def snapshot(state: TrainingState = state) -> TrainingState:
                return state

            undo.append(StateServer(server, "run", snapshot).install())
        ids = [s.peer_id for s in servers]
        fresh, fresh_opt = torch.nn.Linear(4, 3), None
        fresh_params = list(fresh.parameters())
        got = await download_state(asker, "run", ids, 5, fresh_params)
        assert got.step == 7
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
        fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2)
        load_state(got, fresh_params, fresh_opt, fresh_sched)
        assert all(torch.equal(a, b) for a, b in zip(fresh_params, params))
        assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        assert fresh_sched.state_dict() == sched.state_dict()
        with pytest.raises(StateDownloadError) as caught:
            await download_state(asker, "run", ids[:3], 5, fresh_params)
        text = str(caught.value)
        assert "parameter 0 is torch.float32 (5, 4)" in text and "behind 5" in text and "NaN" in text.replace(
            "non-finite", "NaN"), text
        with pytest.raises(StateDownloadError, match="trains run 'run'"):
            await download_state(asker, "other-run", ids[3:], 0, fresh_params)
        for u in undo:
            u.remove()


def test_load_state_leaves_everything_as_it_was_when_the_optimizer_refuses() -> None:
    model, opt, sched = model_and_optimizer()
    params = list(model.parameters())
    state = snapshot_of(3, params, opt, sched, None)
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.Adam(list(other.parameters())[:1], lr=0.1)  # one param group of 1: does not fit
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(ValueError, match="refused the state"):
        load_state(state, list(other.parameters()), other_opt, None)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    assert other_opt.param_groups[0]["lr"] == 0.1


async def test_a_busy_server_refuses_at_once_and_the_asker_takes_the_next_peer() -> None:
    """Peers that join together all see the same sources first (hivemind's issue #169): a server
    sends its state to at most ``max_uploads`` at once and refuses the others at once, and they
    take it from the next peer instead of all sharing (and copying the state for) one."""
    model, opt, sched = model_and_optimizer()
    params = list(model.parameters())
    good = snapshot_of(7, params, opt, sched, None)
    release = trio.Event()
    async with open_peers(4) as everyone:
        first, second, busy, other = everyone[1:]
        await public(everyone[1:])

        async def slow_snapshot() -> TrainingState:
            await release.wait()  # a delayed step's round still running: the first asker waits
            return good

        async def snapshot() -> TrainingState:
            return good

        busy_server = StateServer(busy, "run", slow_snapshot, max_uploads=1)
        undo = [busy_server.install(), StateServer(other, "run", snapshot).install()]
        fresh = [torch.zeros_like(p) for p in params]
        got: list[TrainingState] = []
        async with trio.open_nursery() as nursery:
            async def ask_first() -> None:
                got.append(await download_state(first, "run", [busy.peer_id], 5, fresh))

            nursery.start_soon(ask_first)
            await wait_until(lambda: busy_server.uploading == 1, 10)
            with trio.fail_after(10):
                state = await download_state(second, "run", [busy.peer_id, other.peer_id], 5, fresh)
            assert state.source == other.peer_id.to_base58() and busy_server.refused_busy == 1
            release.set()
        assert got[0].step == 7 and got[0].source == busy.peer_id.to_base58()
        assert busy_server.served == 1 and busy_server.uploading == 0
        with pytest.raises(ValueError, match="max_uploads"):
            StateServer(busy, "run", snapshot, max_uploads=0)
        for u in undo:
            u.remove()


async def test_a_source_that_resets_mid_download_is_named_and_the_next_one_serves() -> None:
    """py-libp2p's stream raises its own StreamReset (no DedlocError, no OSError) when the source resets
    or its connection dies mid-download: the asker names it and asks the next peer, not crash its
    training (it did until 2026-12-05)."""
    model, opt, sched = model_and_optimizer()
    params = list(model.parameters())
    async with open_peers(3) as everyone:
        asker, resetting, good = everyone[1:]
        await public(everyone[1:])

        async def reset_midway(stream: INetStream) -> None:
            await stream.read(64)
            await stream.write(b"\x40partial")  # a header's first bytes, then the reset
            await stream.reset()

        resetting.set_stream_handler(STATE_PROTOCOL, reset_midway)
        StateServer(good, "run", lambda: _ready(snapshot_of(7, params, opt, sched, None))).install()
        with trio.fail_after(20):
            got = await download_state(asker, "run", [resetting.peer_id, good.peer_id], 5, params)
            assert got.source == good.peer_id.to_base58()
            with pytest.raises(StateDownloadError) as caught:
                await download_state(asker, "run", [resetting.peer_id], 5, params)
        assert re.search(f"{resetting.peer_id}: StreamBrokenError: the stream broke after [0-9]+ bytes: "
                         r"StreamReset: \(StreamAbortedError: stream", str(caught.value))
        assert f"was reset by {resetting.peer_id}" in str(caught.value)


async def _ready(state: TrainingState) -> TrainingState:
    return state
