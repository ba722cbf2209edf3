"""The upper layers over the in-memory swarm (tests/fake_swarm.py): the narrow interface
(:class:`nat.Swarm`) is all averaging and training need, and their coordination runs without a
socket. The same scenarios on the real network are in tests/test_averaging.py and test_training.py.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import trio

from averaging import AllreduceConfig, Averager, MatchmakingConfig, RoundReport
from averaging.errors import MatchmakingError, PartialAverageError
from averaging.group import Group
from averaging.moshpit import GridPosition, MoshpitConfig
from nat import Peer, Swarm
from training import StepReport, TrainingConfig

from .fake_swarm import fake_swarms
from .kit import wait_until
from .test_averaging import config, step_all, weighted_mean
from .test_training import Batches, assert_equals_one_process, batches, make_model, train_together

pytestmark = pytest.mark.timeout(120)


async def test_peer_and_the_fake_both_implement_the_interface() -> None:
    """mypy checks Peer against it where the upper layers are given one; here, by name."""
    names = {n for n in dir(Swarm) if not n.startswith("_")}
    assert names == {"peer_id", "addrs", "dht", "rpc", "external", "new_stream", "set_stream_handler",
                     "add_addrs", "observe", "protect", "emit"}
    assert all(hasattr(Peer, name) for name in names)
    async with fake_swarms(1) as (fake,):
        assert isinstance(fake, Swarm)


async def test_a_group_averages_exactly_over_the_fake_swarm() -> None:
    async with fake_swarms(4) as peers:
        torch.manual_seed(1)
        data = [[torch.randn(300, 70), torch.randn(17)] for _ in peers]
        weights = [1.0, 2.0, 3.0, 0.5]
        exact = [weighted_mean(data, weights, k) for k in range(2)]
        async with Averager.open(peers[0], config(4)) as a0, Averager.open(peers[1], config(4)) as a1, \
                Averager.open(peers[2], config(4)) as a2, Averager.open(peers[3], config(4)) as a3:
            reports = await step_all([a0, a1, a2, a3], data, weights)
        for report in reports:
            assert isinstance(report, RoundReport) and report.complete, report
            assert report.group_id == reports[0].group_id  # type: ignore[union-attr]
        for tensors in data:
            for k, t in enumerate(tensors):
                assert torch.allclose(t.double(), exact[k], atol=1e-5), k
        # each kept its group connected for the round (no trim mid-round: p2p/conn_manager.py), and let go after
        for me in peers:
            assert sorted(map(str, me.protections_made)) == sorted(str((p.peer_id, "averaging round")) for p in peers if p is not me)
            assert not +me.protected


async def test_a_peer_that_dies_mid_round_is_reported_never_silent() -> None:
    """test_averaging's dying peer, on the fake swarm: killed once the round is under way, the
    survivors' values are the full average, the survivors' own, or their own values, and a report
    over anything but the full average says so."""
    async with fake_swarms(4) as peers:
        size = 1_000_000
        data = [[torch.full((size,), float(i + 1))] for i in range(4)]
        full, survivors_only = sum(range(1, 5)) / 4, sum(range(1, 4)) / 3
        cfg = config(4, allreduce=AllreduceConfig(chunk_elements=16 * 1024, stall_timeout=3.0, timeout=30.0))
        results: list[RoundReport | BaseException] = [RuntimeError("not run")] * 3
        averagers = [Averager.open(p, cfg) for p in peers]
        async with averagers[0] as a0, averagers[1] as a1, averagers[2] as a2, averagers[3] as doomed:

            async def one(i: int, averager: Averager) -> None:
                try:
                    results[i] = await averager.step(data[i], strict=False)
                except Exception as e:
                    results[i] = e

            async def doomed_step() -> None:
                try:
                    await doomed.step(data[3])
                except* Exception:  # its own round broke as it died (not the subject here); Cancelled goes on
                    pass

            async def dies() -> None:
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(doomed_step)
                        await wait_until(lambda: doomed._rounds, 30)  # the round started
                        await trio.sleep(0.01)
                        peers[3].kill()  # its streams reset; its own step goes with it
                        scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(dies)
                for i, averager in enumerate((a0, a1, a2)):
                    nursery.start_soon(one, i, averager)
        for i, report in enumerate(results):
            assert isinstance(report, RoundReport), report
            values = data[i][0]
            is_full = torch.isclose(values, torch.tensor(full))
            is_partial = torch.isclose(values, torch.tensor(survivors_only))
            assert bool((is_full | is_partial | (values == float(i + 1))).all()), "values that are no average"
            if not bool(is_full.all()):
                assert not report.complete, "a silent partial average"
                assert report.left_out or any(p.not_averaged for p in report.parts), report.summary()


async def test_no_group_in_time_over_the_fake_swarm() -> None:
    async with fake_swarms(1) as (peer,):
        cfg = config(2, matchmaking=MatchmakingConfig(target_size=2, min_size=2, timeout=1.0))
        async with Averager.open(peer, cfg) as a:
            with pytest.raises(MatchmakingError, match="no group of at least 2"):
                await a.step([torch.ones(3)])


@pytest.mark.parametrize("delayed", [False, True], ids=["synchronous", "delayed-updates"])
async def test_three_trainers_equal_one_process_over_the_fake_swarm(delayed: bool) -> None:
    """test_training's equivalence, on the fake swarm: the same global batches give the same
    parameters as one process accumulating them."""
    steps, target, sizes = 3, 24, [3, 5, 4]
    initial = make_model()
    models = [copy.deepcopy(initial) for _ in sizes]
    used: Batches = {}
    reports: list[list[StepReport]] = [[] for _ in sizes]
    cfg = TrainingConfig(run_id="fake", target_batch_size=target, delay_updates=delayed)
    done = [False] * len(sizes)
    async with fake_swarms(len(sizes)) as peers:
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                for i, peer in enumerate(peers):
                    nursery.start_soon(train_together, peer, models[i], batches(i, sizes[i]), cfg, steps, used,
                                       reports[i], done, i)
    assert_equals_one_process(initial, models, used, reports, steps, target, delayed)


@pytest.mark.parametrize("compression", ["none", "float16", "uint8"])
async def test_the_device_staging_path_averages_like_the_host_path(compression: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """averaging.staging.DeviceVector (what a GPU's tensors go through: chunks encoded on the device,
    staged in one host buffer in send order, averages copied back) on a CPU device, so that a machine
    without a GPU runs its logic: the same average as the host path, within the codec's error."""
    from averaging.allreduce import RoundPlan
    from averaging.compression import Compression
    from averaging.staging import DeviceVector

    staged: list[DeviceVector] = []

    def stage(self: Averager, tensors: list[torch.Tensor], plan: RoundPlan) -> DeviceVector:
        staged.append(DeviceVector(tensors, plan.spans, self._buffers))
        return staged[-1]

    monkeypatch.setattr(Averager, "_stage", stage)
    cfg = config(3, allreduce=AllreduceConfig(compression=Compression(compression), chunk_elements=16 * 1024,
                                              min_compress_elements=1000, timeout=30.0))
    tolerance = {"none": 1e-5, "float16": 2e-3, "uint8": 0.05}[compression]
    async with fake_swarms(3) as peers:
        torch.manual_seed(2)
        for round_ in range(2):  # the second round reuses the first one's buffers
            data = [[torch.randn(200, 300), torch.randn(17)] for _ in peers]
            weights = [1.0, 2.0, 3.0]
            exact = [weighted_mean(data, weights, k) for k in range(2)]
            async with Averager.open(peers[0], cfg) as a0, Averager.open(peers[1], cfg) as a1, \
                    Averager.open(peers[2], cfg) as a2:
                reports = await step_all([a0, a1, a2], data, weights)
            assert all(isinstance(r, RoundReport) and r.complete for r in reports), reports
            for tensors in data:
                assert torch.allclose(tensors[0].double(), exact[0], atol=tolerance)
                assert torch.allclose(tensors[1].double(), exact[1], atol=1e-5)  # small: stays float32
    assert len(staged) == 6


async def test_a_moshpit_group_whose_round_failed_still_moves_on_the_grid() -> None:
    """A member dies mid-round in a strict step: the survivors' round fails (their values kept) and
    they still take their next group key from the order fixed with the group. Staying on the old
    key left them out of the grid's phase (bench/scale.py's Moshpit simulation found it)."""
    async with fake_swarms(4) as peers:
        size = 1_000_000
        data = [[torch.full((size,), float(i + 1))] for i in range(4)]
        cfg = config(4, allreduce=AllreduceConfig(chunk_elements=16 * 1024, stall_timeout=2.0, timeout=30.0),
                     moshpit=MoshpitConfig(group_size=4, dims=3, initial=(1, 2)))
        results: list[RoundReport | BaseException] = [RuntimeError("not run")] * 3
        averagers = [Averager.open(p, cfg) for p in peers]
        async with averagers[0] as a0, averagers[1] as a1, averagers[2] as a2, averagers[3] as doomed:
            groups: list[Group] = []
            for averager in (a0, a1, a2):
                original = averager.matchmake

                async def matchmake(*args: Any, original: Any = original, **kwargs: Any) -> Group:
                    group: Group = await original(*args, **kwargs)
                    groups.append(group)
                    return group

                averager.matchmake = matchmake  # type: ignore[method-assign]

            async def one(i: int, averager: Averager) -> None:
                try:
                    results[i] = await averager.step(data[i])
                except PartialAverageError as e:
                    results[i] = e

            async def dies() -> None:
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as inner:
                        async def doomed_step() -> None:
                            try:
                                await doomed.step(data[3])
                            except* Exception:
                                pass
                        inner.start_soon(doomed_step)
                        await wait_until(lambda: doomed._rounds, 30)
                        peers[3].kill()
                        scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(dies)
                for i, averager in enumerate((a0, a1, a2)):
                    nursery.start_soon(one, i, averager)
            assert all(isinstance(r, PartialAverageError) for r in results), results
            assert all(bool((data[i][0] == float(i + 1)).all()) for i in range(3))  # strict: values kept
            last_digits = set()
            for averager in (a0, a1, a2):
                group = next(g for g in groups if g.me.peer_id == averager.peer.peer_id)
                assert group.size == 4
                expected = GridPosition(4, (1, 2))
                expected.advance(group.my_index, group.group_id)
                assert averager.grid is not None and averager.grid.digits == expected.digits
                last_digits.add(expected.digits[1])
            assert expected.digits[0] == 2 and len(last_digits) == 3  # the group's members on distinct cells


@pytest.mark.parametrize("compression", ["none", "float16", "uint8"])
async def test_a_round_s_per_chunk_ops_never_open_a_parallel_region(compression: str) -> None:
    """Every CPU op a round does per chunk (the checks, the reduction, the write-back, the codec) runs on
    at most averaging.serial.PIECE values, so torch opens no parallel region for it: on a busy 16-core GPU
    host each region cost ~8 ms and a 740 MB round took 27-51 s (docs/AVERAGING.md). Only the round's
    one-off ops (flattening the tensors, unflattening the result, the input's finite check) are whole."""
    import sys

    from torch.overrides import TorchFunctionMode

    from averaging import serial
    from averaging.compression import Compression

    whole = {"flatten", "unflatten_into", "all_finite", "_check_finite"}
    computing = {"mul", "add_", "div_", "copy_", "sum", "isfinite", "clamp", "to", "all", "__mul__",
                 "__truediv__", "__setitem__", "div", "add", "__sub__", "__add__", "min", "max", "round_", "clamp_",
                 "pad", "cat", "where"}

    class Largest(TorchFunctionMode):
        """The averaging package's computing torch calls on more than PIECE values, by caller."""

        def __init__(self) -> None:
            super().__init__()
            self.seen = 0
            self.over: list[tuple[str, str, int]] = []

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back  # type: ignore[assignment]
            if name in computing and frame is not None and "/averaging/" in frame.f_code.co_filename:
                callers, f = set(), frame
                for _ in range(4):
                    if f is None:
                        break
                    callers.add(f.f_code.co_name)
                    f = f.f_back  # type: ignore[assignment]
                if not callers & whole:
                    self.seen += 1
                    n = max((a.numel() for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), default=0)
                    if n > serial.PIECE:
                        self.over.append((frame.f_code.co_name, name, n))
            return func(*args, **kwargs)

    async with fake_swarms(2) as peers:
        torch.manual_seed(3)
        data = [[torch.randn(700, 300), torch.randn(17)] for _ in peers]  # 210,017 values: 7 pieces
        exact = [weighted_mean(data, [1.0, 3.0], k) for k in range(2)]
        settings = config(2, allreduce=AllreduceConfig(chunk_elements=128 * 1024, stall_timeout=5.0, timeout=30.0,
                                                       compression=Compression(compression), min_compress_elements=1))
        threads = torch.get_num_threads()
        torch.set_num_threads(2)  # several intra-op threads, as torch gives a process where cores are several
        try:
            async with Averager.open(peers[0], settings) as a0, Averager.open(peers[1], settings) as a1:
                with Largest() as mode:
                    reports = await step_all([a0, a1], data, [1.0, 3.0])
        finally:
            torch.set_num_threads(threads)
    assert all(isinstance(r, RoundReport) and r.complete for r in reports), reports
    assert mode.seen > 20 and not mode.over, mode.over[:5]
    for tensors in data:
        assert torch.allclose(tensors[0].double(), exact[0], atol={"none": 1e-5, "float16": 5e-3, "uint8": 0.1}[compression])


@pytest.mark.parametrize("sent", [b"", b"\x05ab"])
async def test_a_sender_that_resets_before_its_part_header_is_refused_quietly(
        sent: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """The reducer's read of the part header meets py-libp2p's StreamReset (no OSError, no EOFError):
    refused and logged as any broken sender, not a failed handler (a warning and an Error event)."""
    from averaging.allreduce import PROTOCOL

    caplog.set_level(logging.INFO)
    async with fake_swarms(2) as (sender, reducer):
        async with Averager.open(reducer, config(2)):
            stream = await sender.new_stream(reducer.peer_id, PROTOCOL)
            if sent:
                await stream.write(sent)
            await trio.sleep(0.05)
            await stream.reset()
            await trio.sleep(0.05)
    assert "refused an all-reduce stream" in caplog.text
    assert "handler for" not in caplog.text
