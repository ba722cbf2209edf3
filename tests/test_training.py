"""Collaborative training between real peers on loopback: it equals large-batch training."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import trio

from averaging import AllreduceConfig, AveragerConfig, MatchmakingConfig
from training import CollaborativeOptimizer, StepReport, TrainingConfig
from training.progress import ProgressTracker

from nat import Peer, Swarm

from .kit import open_peers, wait_until
from .test_averaging import public

pytestmark = pytest.mark.timeout(180)


async def formed(peers: list[Peer]) -> None:
    """Reachable, serving the DHT and knowing every other server (the relay included): a swarm that
    formed, as a run's is after its first minutes; right after start, a peer's first reads of the
    DHT can miss the others' records."""
    await public(peers)
    await wait_until(lambda: all(p.dht.server and len(p.dht.table) >= len(peers) for p in peers), 30)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batches(peer: int, size: int):  # type: ignore[no-untyped-def]
    """An endless stream of (x, y) batches, different on every peer (and of a different size)."""
    g = torch.Generator().manual_seed(100 + peer)
    while True:
        x = torch.randn(size, 8, generator=g)
        yield x, x.sum(dim=1, keepdim=True).sin()


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


Batches = dict[int, list[tuple[torch.Tensor, torch.Tensor]]]  # step -> every batch it was computed at


async def train_together(peer: Swarm, model: torch.nn.Module, data, config: TrainingConfig,  # type: ignore[no-untyped-def]
                         steps: int, used: Batches, reports: list[StepReport], done: list[bool], i: int) -> None:
    """One peer's loop to ``steps`` global steps (its batches go into ``used`` under their step);
    then it stays in the run until every peer is done (a peer that left could be waited for)."""
    async with CollaborativeOptimizer.open(peer, optimizer_of(model), config) as opt:
        while opt.local_step < steps:
            x, y = next(data)
            used.setdefault(opt.local_step, []).append((x, y))
            torch.nn.functional.mse_loss(model(x), y).backward()
            report = await opt.step(len(x))
            if report is not None:
                reports.append(report)
            await trio.sleep(0.01)  # a batch takes time on a real peer
        done[i] = True
        with trio.fail_after(60):
            while not all(done):
                await trio.sleep(0.05)
        last = await opt.finish()  # with delayed updates, the last step's average goes in now
        if last is not None:
            reports.append(last)


def one_process(initial: torch.nn.Module, used: Batches, steps: int, delayed: bool) -> torch.nn.Module:
    """The reference: one process accumulating the same global batches (with delayed updates, each
    step's average applied when the next step's gradients are in: one step stale)."""
    reference = copy.deepcopy(initial)
    opt = optimizer_of(reference)
    means = []
    for step in range(steps):
        total = sum(len(x) for x, _ in used[step])
        accumulated = [torch.zeros_like(p) for p in reference.parameters()]
        for x, y in used[step]:
            reference.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            for acc, p in zip(accumulated, reference.parameters()):
                acc += p.grad * len(x)  # type: ignore[operator]
        means.append([acc / total for acc in accumulated])
        if delayed and step == 0:
            continue
        for g, p in zip(means[step - 1 if delayed else step], reference.parameters()):
            p.grad = g
        opt.step()
    if delayed:
        for g, p in zip(means[-1], reference.parameters()):
            p.grad = g
        opt.step()
    return reference


@pytest.mark.parametrize("delayed", [False, True], ids=["synchronous", "delayed-updates"])
async def test_four_peers_equal_one_process_accumulating_the_global_batch(delayed: bool) -> None:
    """DeDLOC I.6: the same global batches and data as one process that accumulates gradients over
    them give the same parameters (no compression: within float32 rounding). With delayed updates,
    the reference applies each step's average when the next step's gradients are in (one step stale)."""
    steps, target, sizes = 3, 48, [3, 5, 7, 4]
    initial = make_model()
    models = [copy.deepcopy(initial) for _ in sizes]
    used: Batches = {}
    reports: list[list[StepReport]] = [[] for _ in sizes]
    config = TrainingConfig(run_id="equivalence", target_batch_size=target, delay_updates=delayed)
    done = [False] * len(sizes)
    async with open_peers(len(sizes)) as everyone:
        peers = everyone[1:]
        await formed(peers)
        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                for i in range(len(sizes)):
                    nursery.start_soon(train_together, peers[i], models[i], batches(i, sizes[i]), config, steps,
                                       used, reports[i], done, i)

    assert_equals_one_process(initial, models, used, reports, steps, target, delayed)


def assert_equals_one_process(initial: torch.nn.Module, models: list[torch.nn.Module], used: Batches,
                              reports: list[list[StepReport]], steps: int, target: int, delayed: bool) -> None:
    """Every peer took every step averaged with all the others, holds the same parameters, and they
    are those of one process accumulating the same global batches."""
    for i, rs in enumerate(reports):
        assert [r.step for r in rs] == list(range(steps)), rs
        for r in rs:
            assert r.averaged and r.complete and r.group_size == len(models), (i, r)
    for step in range(steps):  # whoever triggered a step saw the target reached
        assert max(rs[step].samples for rs in reports) >= target
    # every peer holds the same parameters
    for model in models[1:]:
        for p, q in zip(models[0].parameters(), model.parameters()):
            assert torch.equal(p, q)
    # ... and they are those of one process accumulating the same global batches
    reference = one_process(initial, used, steps, delayed)
    for p, q in zip(reference.parameters(), models[0].parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), (p - q).abs().max()


async def test_a_late_joiner_downloads_the_state_and_then_steps_with_the_others() -> None:
    target, size = 20, 5
    initial = make_model()
    models = [copy.deepcopy(initial) for _ in range(3)]
    torch.manual_seed(99)
    for p in models[2].parameters():  # the joiner starts elsewhere: only the download puts it in step
        p.data.normal_()
    config = TrainingConfig(run_id="late", target_batch_size=target)
    reports: list[list[StepReport]] = [[], [], []]
    downloads = [-1, -1, -1]
    phase = [trio.Event(), trio.Event()]  # first two peers at step 2; everyone at step 4
    async with open_peers(3) as everyone:
        peers = everyone[1:]
        await formed(peers)

        async def train(i: int, until: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            model, data = models[i], batches(i, size)
            async with CollaborativeOptimizer.open(peers[i], optimizer_of(model), config) as opt:
                downloads[i] = opt.downloads
                task_status.started()
                for goal in ((2, 4) if i < 2 else (4,)):
                    while opt.local_step < goal:
                        x, y = next(data)
                        torch.nn.functional.mse_loss(model(x), y).backward()
                        report = await opt.step(len(x))
                        if report is not None:
                            reports[i].append(report)
                        await trio.sleep(0.01)
                    if goal == 2:
                        await phase[0].wait()  # the others wait here, in the run, for the joiner
                await phase[1].wait()

        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(train, 0, 4)
                nursery.start_soon(train, 1, 4)
                while not all(len(r) >= 2 for r in reports[:2]):
                    await trio.sleep(0.05)
                await nursery.start(train, 2, 4)  # joins at step 2: downloads the state on open
                for p, q in zip(models[0].parameters(), models[2].parameters()):
                    assert torch.equal(p, q)
                phase[0].set()
                while not all(len(r) >= (4 if i < 2 else 2) for i, r in enumerate(reports)):
                    await trio.sleep(0.05)
                phase[1].set()
    assert downloads == [0, 0, 1]
    assert [r.step for r in reports[2]] == [2, 3]
    for r in reports[0][2:] + reports[2]:
        assert r.averaged and r.complete and r.group_size == 3, r
    for model in models[1:]:
        for p, q in zip(models[0].parameters(), model.parameters()):
            assert torch.equal(p, q)


async def test_a_peer_dying_mid_round_costs_only_its_own_contribution() -> None:
    """The third peer dies inside the round of step 0 (after its group formed). Whatever it was to
    do in the round, the two others apply the same step, averaged over their own samples."""
    target, size = 30, 5
    initial = make_model()
    models = [copy.deepcopy(initial) for _ in range(3)]
    allreduce = AllreduceConfig(stall_timeout=2.0, timeout=20.0)
    config = TrainingConfig(run_id="death", target_batch_size=target, allreduce=allreduce)
    reports: list[list[StepReport]] = [[], [], []]
    async with open_peers(3) as everyone:
        peers = everyone[1:]
        await formed(peers)
        doomed = trio.CancelScope()

        async def train(i: int) -> None:
            model, data = models[i], batches(i, size)
            async with CollaborativeOptimizer.open(peers[i], optimizer_of(model), config) as opt:
                if i == 2:
                    run = opt.averager._average

                    async def die_in_the_round(*args: object, **kwargs: object) -> object:
                        doomed.cancel()  # its peer stops: connections close mid-round
                        return await run(*args, **kwargs)  # type: ignore[arg-type]

                    opt.averager._average = die_in_the_round  # type: ignore[method-assign]
                while opt.local_step < 1:
                    x, y = next(data)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    report = await opt.step(len(x))
                    if report is not None:
                        reports[i].append(report)
                    await trio.sleep(0.01)

        async def doomed_peer() -> None:
            with doomed:
                await train(2)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(train, 0)
                nursery.start_soon(train, 1)
                nursery.start_soon(doomed_peer)
    assert reports[2] == []
    for r in reports[:2]:
        assert len(r) == 1 and r[0].step == 0, r
        assert r[0].averaged and r[0].group_size == 2, r[0]
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


async def test_a_batch_with_nan_gradients_is_dropped_and_the_swarm_steps_on() -> None:
    target, size = 20, 5
    initial = make_model()
    models = [copy.deepcopy(initial) for _ in range(2)]
    config = TrainingConfig(run_id="nan", target_batch_size=target)
    reports: list[list[StepReport]] = [[], []]
    dropped = [0, 0]
    async with open_peers(2) as everyone:
        peers = everyone[1:]
        await formed(peers)

        async def train(i: int) -> None:
            model, data = models[i], batches(i, size)
            async with CollaborativeOptimizer.open(peers[i], optimizer_of(model), config) as opt:
                first = True
                while opt.local_step < 2:
                    x, y = next(data)
                    if i == 1 and first:
                        x = x.clone()
                        x[0, 0] = float("nan")  # a poisoned batch: NaN loss and gradients
                        first = False
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    report = await opt.step(len(x))
                    if report is not None:
                        reports[i].append(report)
                    await trio.sleep(0.01)
                dropped[i] = opt.dropped_batches
                with trio.fail_after(30):
                    while not all(len(r) >= 2 for r in reports):
                        await trio.sleep(0.05)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(train, 0)
                nursery.start_soon(train, 1)
    assert dropped == [0, 1]
    for r in reports[0] + reports[1]:
        assert r.averaged and r.complete and r.group_size == 2, r
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.isfinite(p).all() and torch.equal(p, q)


async def test_peers_that_stepped_alone_before_they_met_follow_the_one_furthest_ahead() -> None:
    """Two peers start apart (two swarms, as when the DHT is still forming) and each steps alone:
    A to step 3, B to step 1. When they meet, the quorum rule puts the run at B's step, where B has
    the samples but never the quorum: B takes A's state (the most training done) and they step
    together. Before, both waited for ever."""
    config = TrainingConfig(run_id="split", target_batch_size=8, rejoin_after=1.0, report_interval=0.2)
    models = [make_model(), make_model()]
    joint: list[list[StepReport]] = [[], []]
    apart: list[StepReport] = []
    async with open_peers(1) as (_, a), open_peers(1) as (_, b):
        await public([a, b])
        async with CollaborativeOptimizer.open(a, optimizer_of(models[0]), config) as opt_a, \
                CollaborativeOptimizer.open(b, optimizer_of(models[1]), config) as opt_b:
            opts = [opt_a, opt_b]

            async def train(i: int, until: int | None = None) -> None:
                data = batches(i, 4)
                while (opts[i].local_step < until) if until is not None else len(joint[i]) < 2:
                    x, y = next(data)
                    torch.nn.functional.mse_loss(models[i](x), y).backward()
                    report = await opts[i].step(len(x))
                    if report is not None:
                        (joint[i] if until is None else apart).append(report)
                    await trio.sleep(0.01)

            with trio.fail_after(30):
                await train(0, until=3)
                await train(1, until=1)
            assert (opt_a.local_step, opt_b.local_step) == (3, 1)
            # alone in its run, each applied its own gradient: as expected, no failure to report
            assert len(apart) == 4 and all(r.solo and not r.averaged and r.complete for r in apart), apart
            # the swarms meet
            b.node.add_addrs(a.peer_id, list(a.addrs))
            await b.node.connect(a.peer_id, timeout=10)
            await b.dht.bootstrap()
            await a.dht.bootstrap()
            with trio.fail_after(90):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(train, 0)
                    nursery.start_soon(train, 1)
            assert (opt_a.downloads, opt_b.downloads) == (0, 1)  # A kept its work, B took it
    for r in joint[0] + joint[1]:
        assert r.step >= 3 and r.averaged and r.complete and r.group_size == 2, r
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


async def test_two_peers_that_missed_a_round_for_a_lone_client_ahead_go_on_at_their_step(
        caplog: pytest.LogCaptureFixture) -> None:
    """The demo in CI (2026-12-03): an outbound-only trainer stepped alone before it saw the others
    and stood at step 1; the two servers at step 0 each missed their round for it, and each asked
    the other for step 1's state, refused ("at step 0, behind 1") for the rest of the run. Now,
    ``rejoin_after`` on with nobody that could serve that state, the miss is moot and they step.
    (The miss is set as the round left it: a round that fails to form only on a loaded machine.)"""
    config = TrainingConfig(run_id="moot", target_batch_size=8, rejoin_after=1.0, report_interval=0.2)
    models = [make_model(), make_model()]
    reports: list[list[StepReport]] = [[], []]
    async with open_peers(3) as (_, a, b, lone):
        await formed([a, b, lone])
        ahead = ProgressTracker(lone, "moot", 8, client=True)
        assert await ahead.report(1, 0, 0.0)
        async with CollaborativeOptimizer.open(a, optimizer_of(models[0]), config) as opt_a, \
                CollaborativeOptimizer.open(b, optimizer_of(models[1]), config) as opt_b:
            opts = [opt_a, opt_b]
            for opt in opts:
                opt._missed_at = opt.clock()  # as a round that found no group leaves it, the client ahead

            async def train(i: int) -> None:
                data = batches(i, 4)
                while opts[i].local_step < 2:
                    x, y = next(data)
                    torch.nn.functional.mse_loss(models[i](x), y).backward()
                    report = await opts[i].step(len(x))
                    if report is not None:
                        reports[i].append(report)
                    await trio.sleep(0.01)

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(train, 0)
                    nursery.start_soon(train, 1)
            assert (opt_a.downloads, opt_b.downloads) == (0, 0)  # nobody had the state they missed
    for r in reports[0] + reports[1]:
        assert r.averaged and r.complete and r.group_size == 2, r
    assert [r.step for r in reports[0]] == [r.step for r in reports[1]] == [0, 1]
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    # each forgot its miss once, and said so (kept, it would want step 2's state at step 1)
    moot = [r for r in caplog.records if "the round we missed is moot" in r.getMessage()]
    assert len(moot) == 2, [r.getMessage() for r in moot]


async def test_state_averaging_every_k_steps_pulls_drifted_peers_together() -> None:
    """Three peers whose parameters drifted apart (as after a partial round) take identical steps,
    which keep the drift; with ``average_state_every=2`` the second step ends with one state on all:
    parameters and momentum, the mean of theirs."""
    config = TrainingConfig(run_id="state-avg", target_batch_size=24, average_state_every=2)
    models = [make_model() for _ in range(3)]
    with torch.no_grad():
        for i, m in enumerate(models):
            for p in m.parameters():
                p.add_(0.01 * i)  # drift
    opts: list[CollaborativeOptimizer] = []
    snapshots: list[list[list[torch.Tensor]]] = [[], [], []]  # per peer, per step: parameters
    async with open_peers(3) as everyone:
        peers = everyone[1:]
        await formed(peers)

        async def train(i: int) -> None:
            data = batches(i, 4)
            async with CollaborativeOptimizer.open(peers[i], optimizer_of(models[i]), config) as opt:
                opts.append(opt)
                while opt.local_step < 2:
                    x, y = next(data)
                    torch.nn.functional.mse_loss(models[i](x), y).backward()
                    if await opt.step(len(x)) is not None:
                        snapshots[i].append([p.detach().clone() for p in models[i].parameters()])
                    await trio.sleep(0.01)
                with trio.fail_after(30):
                    while not all(len(s) >= 2 for s in snapshots):
                        await trio.sleep(0.05)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(train, i)
    assert all(opt.state_rounds == 1 for opt in opts)
    after_first = [s[0] for s in snapshots]
    assert not torch.equal(after_first[0][0], after_first[1][0])  # step 1: identical steps keep the drift
    for m in models[1:]:  # step 2 and the state round: one state everywhere
        for p, q in zip(models[0].parameters(), m.parameters()):
            assert torch.equal(p, q)
    momentum = [[s["momentum_buffer"] for s in o.optimizer.state.values()] for o in opts]
    for other in momentum[1:]:
        for a, b in zip(momentum[0], other):
            assert torch.equal(a, b)


async def test_a_step_whose_group_cannot_form_is_reported_not_raised() -> None:
    """Two peers that may not reduce (as two relayed volunteers without a public peer): no group can
    form. Each step says so: the first to give up steps on its own gradient, the other then finds it
    ahead and takes its state rather than stepping apart; both go on. Before, the MatchmakingError
    left the optimizer inside an exception group and ended the training loop."""
    config = TrainingConfig(run_id="no-reducer", target_batch_size=8, averager=AveragerConfig(reduces=False),
                            matchmaking=MatchmakingConfig(target_size=2, min_size=2, gather_time=0.5, timeout=2.0))
    reports: list[list[StepReport]] = [[], []]
    steps = [0, 0]
    async with open_peers(2) as everyone:
        peers = everyone[1:]
        await formed(peers)

        async def train(i: int) -> None:
            model, data = make_model(), batches(i, 4)
            async with CollaborativeOptimizer.open(peers[i], optimizer_of(model), config) as opt:
                while opt.local_step < 2:
                    x, y = next(data)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    report = await opt.step(len(x))
                    if report is not None:
                        reports[i].append(report)
                    steps[i] = opt.local_step
                    await trio.sleep(0.01)
                with trio.fail_after(60):
                    while min(steps) < 2:
                        await trio.sleep(0.05)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(train, 0)
                nursery.start_soon(train, 1)
    for r in reports[0] + reports[1]:
        assert not r.averaged and "may reduce" in r.summary, r
        assert "no group" in r.summary or r.missed, r


async def test_lamb_a_scheduler_clipping_and_a_loss_scaler_step_as_in_one_process() -> None:
    """The usual training features through the swarm: LAMB (pytorch_optimizer's), a warm-up
    scheduler stepped per global step, clipping of the averaged gradient, and mixed precision on
    one peer (float16 autocast with a GradScaler whose first scale overflows: those batches are
    dropped and the scale backs off, as GradScaler.step would) next to a float32 peer. The result
    is one process doing the same with the same batches (each computed as the peer computed it)."""
    from pytorch_optimizer import Lamb

    steps, target, sizes = 3, 24, [4, 5]
    initial = make_model()
    models = [copy.deepcopy(initial) for _ in sizes]
    used: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, float | None]]] = {}  # peer, x, y, loss scale
    overflows = [0, 0]
    done = [False] * len(sizes)

    def lamb(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        opt = Lamb(model.parameters(), lr=0.05, weight_decay=0.01)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))

    def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float | None) -> torch.Tensor:
        if scale is None:
            return torch.nn.functional.mse_loss(model(x), y)
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.nn.functional.mse_loss(model(x).float(), y)

    config = TrainingConfig(run_id="features", target_batch_size=target, max_grad_norm=0.5)
    async with open_peers(len(sizes)) as everyone:
        peers = everyone[1:]
        await formed(peers)

        async def train(i: int) -> None:
            model, data = models[i], batches(i, sizes[i])
            optimizer, scheduler = lamb(model)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2) if i == 0 else None
            async with CollaborativeOptimizer.open(peers[i], optimizer, config, scheduler=scheduler,
                                                   scaler=scaler) as opt:
                while opt.local_step < steps:
                    x, y = next(data)
                    scale = scaler.get_scale() if scaler is not None else None
                    loss = loss_of(model, x, y, scale)
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    step, dropped = opt.local_step, opt.dropped_batches
                    await opt.step(len(x))
                    if opt.dropped_batches == dropped:
                        used.setdefault(step, []).append((i, x, y, scale))
                    await trio.sleep(0.01)
                overflows[i] = opt.overflows
                done[i] = True
                with trio.fail_after(60):
                    while not all(done):
                        await trio.sleep(0.05)

        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                for i in range(len(sizes)):
                    nursery.start_soon(train, i)

    assert overflows[0] >= 1 and overflows[1] == 0, overflows
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    reference = copy.deepcopy(initial)
    optimizer, scheduler = lamb(reference)
    for step in range(steps):
        # in the swarm's order of float32 operations: each peer's sum of its batches, its mean, then
        # the mean of those weighted by samples (averaging/reduction.py). Summed in another order the
        # gradient differs by ulps, which LAMB's division by sqrt(v) + eps (eps 1e-6) can make up to
        # lr / eps = 5e4 times larger in a parameter: summed batch by batch, steps of ~90 samples
        # rather than ~60 came out up to 9.4e-6 apart (4 runs in 30 on a loaded machine); in this
        # order, 3e-8 to 9.7e-7 in 30 runs (the members' chunks still add in arrival order)
        means: list[tuple[list[torch.Tensor], int]] = []
        for peer in range(len(sizes)):
            mine = [(x, y, scale) for j, x, y, scale in used[step] if j == peer]
            sums = [torch.zeros_like(p) for p in reference.parameters()]
            for x, y, scale in mine:
                reference.zero_grad()
                (loss_of(reference, x, y, scale) * (scale or 1.0)).backward()
                for acc, p in zip(sums, reference.parameters()):
                    acc.add_(p.grad, alpha=len(x) / (scale or 1.0))  # type: ignore[arg-type]
            n = sum(len(x) for x, _, _ in mine)
            if n:
                means.append(([acc / n for acc in sums], n))
        total = [m * means[0][1] for m in means[0][0]]
        for mean, n in means[1:]:
            for t, m in zip(total, mean):
                t.add_(m, alpha=n)
        for t, p in zip(total, reference.parameters()):
            p.grad = t / sum(n for _, n in means)
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
        optimizer.step()
        scheduler.step()
    for p, q in zip(reference.parameters(), models[0].parameters()):
        # three steps move the parameters 0.2; without the clipping, or the scheduler, they end 0.04 or 0.08 apart
        assert torch.allclose(p, q, atol=1e-5, rtol=1e-5), (p - q).abs().max()


@pytest.mark.parametrize("delayed", [False, True], ids=["synchronous", "delayed-updates"])
async def test_an_auxiliary_peer_reduces_for_trainers_that_cannot(delayed: bool) -> None:
    """Two trainers that may not reduce (as two volunteers behind NAT) and one auxiliary peer (no
    GPU: it trains nothing and has no vote on the step): every step is averaged through the
    auxiliary, in groups of three, and the trainers end as one process accumulating their batches
    would. Without it no group could form (see the test above)."""
    steps, target, sizes = 3, 24, [4, 5]
    initial = make_model()
    models = [copy.deepcopy(initial) for _ in sizes]
    used: Batches = {}
    reports: list[list[StepReport]] = [[] for _ in sizes]
    helped: list[StepReport] = []
    senders = TrainingConfig(run_id="auxiliary", target_batch_size=target, delay_updates=delayed,
                             averager=AveragerConfig(reduces=False))
    helper = replace(senders, averager=AveragerConfig(auxiliary=True))
    done = [False] * len(sizes)
    async with open_peers(len(sizes) + 1) as everyone:
        peers = everyone[1:]
        await formed(peers)

        async def assist() -> None:
            model = make_model()
            async with CollaborativeOptimizer.open(peers[-1], optimizer_of(model), helper) as opt:
                with pytest.raises(RuntimeError, match="auxiliary"):
                    await opt.step(1)
                # until every trainer has its last step's report: with delayed updates a trainer is
                # done when its last round begins, and that round still needs us
                while not all(len(r) >= steps for r in reports):
                    report = await opt.assist()
                    if report is not None:
                        helped.append(report)

        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(assist)
                for i in range(len(sizes)):
                    nursery.start_soon(train_together, peers[i], models[i], batches(i, sizes[i]), senders, steps,
                                       used, reports[i], done, i)

    for i, rs in enumerate(reports):
        assert [r.step for r in rs] == list(range(steps)), rs
        for r in rs:
            assert r.averaged and r.complete and r.group_size == 3, (i, r)
    assert [r.step for r in helped if r.averaged] == list(range(steps)), helped
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    reference = one_process(initial, used, steps, delayed)
    for p, q in zip(reference.parameters(), models[0].parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), (p - q).abs().max()
