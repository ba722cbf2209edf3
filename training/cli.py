"""The commands that train: ``train`` and ``backbone`` (the entry point and their options: training/commands.py;
``demo``'s code is training/demo.py).

This is the highest layer with commands, so the entry point sits here and its
parser extends the averaging layer's (``average``), which extends the network
layer's (``relay``, ``peer``, ``status``, ``ping``; ``id``, ``dht``).

``train`` is ``dedloc peer`` plus a :class:`~training.CollaborativeOptimizer`
training the example model (:mod:`training.mlm`, a tiny ALBERT) on shards
(:mod:`training.data`; by default the example's generated corpus). It prints
the run's progress every ``--report-every`` seconds and every global step.
``backbone`` is the run's public node: it keeps the learning curve and what
each peer contributed (:mod:`training.monitor`), saves a checkpoint every few
steps and serves the newest (:mod:`training.checkpoints`), and takes all of it
up again when it restarts.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import trio
from libp2p.peer.id import ID

from averaging import AllreduceConfig, AveragerConfig, MatchmakingConfig
from averaging.robust import CenteredClipConfig
from nat import Peer
from nat.cli import peer_config, run_peer
from p2p import events as ev
from p2p.errors import ConfigError, DedlocError
from p2p.output import Output

from .data import DataConfig, DataError, ExampleStream, ShardSource, batches, shard_paths
from .checkpoints import hold_directory, latest_checkpoint, prune_checkpoints, save_checkpoint
from .events import Checkpointed, GlobalStepDone, StateDownloaded, TakenUp, TrainingStatus
from .monitor import Monitor
from .optimizer import LEAVE_TIMEOUT, CollaborativeOptimizer, StepReport, TrainingConfig
from .progress import ProgressTracker
from .state import StateDownloadError, StateServer, TrainingState, download_state

if TYPE_CHECKING:
    from nat.dashboard import Dashboard
    from p2p import Node

log = logging.getLogger(__name__)



# ---------------------------------------------------------------------- the example run's files and model


def example_files(args: argparse.Namespace) -> tuple[list[str], Path]:
    """The shards and the tokenizer: the user's, else the example's (generated under --workdir once)."""
    from .corpus import prepare

    workdir = Path(args.workdir)
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    data = list(args.data or [])
    if not data or tokenizer is None:
        prepared = prepare(workdir)
        data = data or [str(p) for p in prepared.corpus]
        tokenizer = tokenizer or prepared.tokenizer
    if not tokenizer.is_file():
        raise ConfigError(f"--tokenizer {tokenizer}: no such file")
    return data, tokenizer


#: ``--data swarm:NAME``: a dataset fetched from the swarm as training runs (training/datasets).
SWARM = "swarm:"


def swarm_dataset(data: list[str] | None) -> str | None:
    """The dataset ``--data swarm:NAME`` names (None: local files)."""
    refs = [d for d in data or [] if d.startswith(SWARM)]
    if not refs:
        return None
    if len(data or []) != 1:
        raise ConfigError("--data swarm:NAME stands alone: one dataset from the swarm, no local files beside it")
    ref = refs[0][len(SWARM):]
    from .datasets.manifest import DatasetError, check_name

    try:
        check_name(ref.partition("@")[0])
    except DatasetError as e:
        raise ConfigError(f"--data {refs[0]}: {e}") from None
    return ref


@asynccontextmanager
async def swarm_data(peer: Peer, args: argparse.Namespace, ref: str) -> AsyncIterator[ShardSource]:
    """``--data swarm:NAME``: fetch the dataset under ``--workdir``/datasets/NAME in this peer's own random
    shard order, seeding it meanwhile; the shards reach training as each is whole and checked."""
    import random

    from .datasets import Datasets, LocalDataset

    source = ShardSource(ref, timeout=args.data_timeout)
    directory = Path(args.workdir) / "datasets" / ref.partition("@")[0]
    rng = random.Random(args.data_seed)

    def order(shards: list[Any]) -> list[bytes]:
        roots = [s.root for s in shards]
        rng.shuffle(roots)
        return roots

    def started(local: LocalDataset) -> None:
        for path in local.whole_paths():
            source.add(path)

    async def fetch() -> None:
        try:
            await datasets.get(ref, directory, priority=order, on_start=started,
                               on_shard=lambda shard: source.add(directory / shard.path))
            source.finish()
        except DedlocError as e:
            source.fail(str(e))
            peer.node.emit(ev.Error(message=f"--data swarm:{ref}: {e}"))

    async with Datasets.open(peer) as datasets, trio.open_nursery() as nursery:
        nursery.start_soon(fetch)
        yield source
        nursery.cancel_scope.cancel()


def build(args: argparse.Namespace) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, Any]:
    """Tokenizer, model (the same initial weights on every peer), optimizer, warm-up scheduler."""
    from .mlm import build_model, load_tokenizer

    _, tokenizer_path = example_files(args)
    tokenizer = load_tokenizer(tokenizer_path)
    model = build_model(tokenizer, seed=args.model_seed).to(getattr(args, "device", "cpu"))
    optimizer: torch.optim.Optimizer
    if args.optimizer == "lamb":  # DeDLOC's choice for ALBERT; pytorch_optimizer's, a maintained package
        from pytorch_optimizer import Lamb

        optimizer = Lamb(model.parameters(), lr=args.lr, weight_decay=0.01)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return tokenizer, model, optimizer, scheduler


def training_config(args: argparse.Namespace) -> TrainingConfig:
    return TrainingConfig(
        run_id=args.run_id, target_batch_size=args.target_batch_size,
        matchmaking=MatchmakingConfig(target_size=args.group_size, min_size=2, gather_time=args.gather_time,
                                      timeout=args.match_timeout),
        max_grad_norm=args.max_grad_norm or None, delay_updates=args.delay_updates,
        allreduce=AllreduceConfig(robust=CenteredClipConfig() if getattr(args, "centered_clip", False) else None),
        averager=AveragerConfig(auxiliary=getattr(args, "auxiliary", False)),
        trusted_archives=initial_peer_ids(args))


def initial_peer_ids(args: argparse.Namespace) -> tuple[ID, ...]:
    """The peers of ``--initial-peers`` (their ``/p2p/`` ids): a trainer trusts their saved state (a run's
    backbone is its public node, the address its volunteers join through: ``training/progress.py``)."""
    from p2p.addresses import peer_ids_of

    return peer_ids_of(getattr(args, "initial_peers", None) or ())


# ---------------------------------------------------------------------- dedloc train


async def train(peer: Peer, args: argparse.Namespace, dashboard: Dashboard | None = None) -> None:
    """Train the example model with the swarm until --max-steps global steps (or --duration); with
    ``--metrics``, the run's and the averager's families join the dashboard's; ``--data swarm:NAME``
    trains on a dataset of the swarm as it arrives."""
    torch.set_num_threads(max(1, args.threads))
    if args.auxiliary:
        return await assist(peer, args, dashboard)
    ref = swarm_dataset(args.data)
    async with AsyncExitStack() as stack:
        source = None if ref is None else await stack.enter_async_context(swarm_data(peer, args, ref))
        await _train(peer, args, dashboard, source)


async def _train(peer: Peer, args: argparse.Namespace, dashboard: Dashboard | None, source: ShardSource | None) -> None:
    from .mlm import MaskedBatches

    files, _ = example_files(args) if source is None else ([], None)
    tokenizer, model, optimizer, scheduler = await trio.to_thread.run_sync(build, args)  # off the event loop
    stream = ExampleStream(DataConfig(files=tuple(files), text_field=args.text_field,
                                      shuffle_buffer=args.shuffle_buffer, seed=args.data_seed), source)
    texts: Iterator[list[str]] = batches(stream, args.batch_size)
    masked = MaskedBatches(tokenizer)
    model.train()

    device = torch.device(args.device)
    # mixed precision: float16 with a loss scaler on a GPU, bfloat16 (no scaler needed) on a CPU
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type) if args.amp and amp_dtype is torch.float16 else None
    if args.amp and device.type == "cpu" and not cpu_has_bfloat16():
        log.warning("--amp on this CPU (no bfloat16 instructions) computes slower than float32 "
                    "(the example model 5-8x slower on a 2-core x86 without them): leave --amp off here")

    def forward_backward() -> tuple[int, float]:
        """One local batch, in the worker thread (the one edge where torch computes)."""
        batch = {k: v.to(device) for k, v in masked(next(texts)).items()}
        with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
            loss = model(**batch).loss
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return int(batch["input_ids"].shape[0]), float(loss.detach())

    node = peer.node
    async with CollaborativeOptimizer.open(peer, optimizer, training_config(args), scheduler=scheduler,
                                           scaler=scaler) as opt, observed(opt, dashboard):
        if opt.downloads:
            node.emit(_downloaded(opt))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(status_loop, opt, node, args.report_every)
            downloads = opt.downloads
            while args.max_steps == 0 or opt.local_step < args.max_steps:
                n, loss = await trio.to_thread.run_sync(forward_backward)
                report = await opt.step(n, loss=loss)
                if report is not None:
                    node.emit(_step_event(report, opt.loss))
                if opt.downloads > downloads:
                    downloads = opt.downloads
                    node.emit(_downloaded(opt))
            nursery.cancel_scope.cancel()


def _downloaded(opt: CollaborativeOptimizer) -> StateDownloaded:
    seconds, source = opt.last_download or (0.0, "")
    return StateDownloaded(step=opt.local_step, seconds=seconds, source=source)


@asynccontextmanager
async def observed(opt: CollaborativeOptimizer, dashboard: Dashboard | None) -> AsyncIterator[None]:
    """With ``--metrics``: ``dedloc_training_*`` and the optimizer's averager's ``dedloc_averaging_*``."""
    if dashboard is None:
        yield
        return
    from averaging.cli import observed as averaging_observed

    from .metrics import TrainingMetrics

    collector = TrainingMetrics(opt.tracker, opt)
    dashboard.registry.register(collector)
    try:
        async with averaging_observed(opt.averager, dashboard):
            yield
    finally:
        dashboard.registry.unregister(collector)


async def assist(peer: Peer, args: argparse.Namespace, dashboard: Dashboard | None = None) -> None:
    """An auxiliary peer of the run (``--auxiliary``): no batches; it joins every step's round with
    weight 0 and reduces a part of the gradients (the model is built only for its shapes)."""
    _, model, optimizer, _ = await trio.to_thread.run_sync(build, args)  # off the event loop
    async with CollaborativeOptimizer.open(peer, optimizer, training_config(args)) as opt, observed(opt, dashboard), \
            trio.open_nursery() as nursery:
        nursery.start_soon(status_loop, opt, peer.node, args.report_every)
        while args.max_steps == 0 or opt.local_step < args.max_steps:
            report = await opt.assist()
            if report is not None:
                peer.node.emit(_step_event(report, None))
        nursery.cancel_scope.cancel()


async def status_loop(opt: CollaborativeOptimizer, node: Node, every: float) -> None:
    """A training_status event every ``every`` s once the swarm's progress is known (a trainer's and an
    auxiliary peer's alike: the first one says the peer is in the run)."""
    while True:
        await trio.sleep(every)
        p = opt.progress
        if p is not None:
            node.emit(TrainingStatus(
                step=p.step, swarm_samples=p.samples, target=p.target,
                swarm_samples_per_second=p.samples_per_second, samples_per_second=opt.samples_per_second,
                loss=opt.loss, swarm_loss=p.loss, peers=p.peers, eta=p.eta, local_samples=opt.samples))


def cpu_has_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX), where ``--amp`` pays off.

    torch asks oneDNN (``torch.ops.mkldnn._is_mkldnn_bf16_supported``, private: a torch without it
    counts as a CPU that has them, so nothing is said rather than something wrong).
    """
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return True if check is None else bool(check())
    except RuntimeError:
        return True


def _step_event(report: StepReport, loss: float | None) -> GlobalStepDone:
    return GlobalStepDone(**dataclasses.asdict(report), loss=loss)


def resolve_device(name: str) -> str:
    """``--device auto``: a GPU when torch sees one, else the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


async def cmd_train(args: argparse.Namespace, out: Output) -> int:
    _check_training_args(args)
    if args.shuffle_buffer < 1:
        raise ConfigError("--shuffle-buffer must be at least 1")
    if args.data and swarm_dataset(args.data) is None:
        try:
            shard_paths(args.data)  # missing files and unknown formats fail before the peer starts
        except DataError as e:
            raise ConfigError(str(e)) from None
    return await run_peer(args, out, config=peer_config(args, relay=False), work=lambda peer, dashboard: train(peer, args, dashboard))


def _check_run_args(args: argparse.Namespace) -> None:
    """The run's options (training/commands.py ``run_options``), shared by ``train`` and ``backbone``,
    refused in the options' words before the peer starts (the backbone raised torch's and the
    tracker's ValueError once running)."""
    if not 1 <= len(args.run_id) <= 100:
        raise ConfigError("--run-id must be 1 to 100 characters")
    if args.target_batch_size <= 0:
        raise ConfigError("--target-batch-size must be positive")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ConfigError("--lr must be a positive number")
    if args.warmup_steps < 0:
        raise ConfigError("--warmup-steps must be 0 or more")


def _check_training_args(args: argparse.Namespace) -> None:
    # in the options' words first; the config's check (field names) stays the last word
    _check_run_args(args)
    if args.group_size < 2:
        raise ConfigError(f"--group-size must be at least 2 (this peer and one other), not {args.group_size}")
    if not (math.isfinite(args.max_grad_norm) and args.max_grad_norm >= 0):
        raise ConfigError(f"--max-grad-norm must be 0 (no clipping) or a positive number, not {args.max_grad_norm}")
    try:
        training_config(args).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.batch_size <= 0:
        raise ConfigError("--batch-size must be positive")
    if args.max_steps < 0:
        raise ConfigError("--max-steps must be >= 0 (0: until --duration)")
    device = args.device = resolve_device(getattr(args, "device", "cpu"))  # the rest reads args.device
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise ConfigError(f"--device {device}: {e}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: this torch sees no CUDA device")


# ---------------------------------------------------------------------- dedloc backbone


async def backbone(peer: Peer, args: argparse.Namespace, params: Sequence[torch.Tensor], latest: TrainingState | None,
                   dashboard: Dashboard | None = None) -> None:
    """Watch the run: keep its curve and contributions, checkpoint it every --checkpoint-every steps,
    and serve the newest checkpoint, published as the run's archive (``training/progress.py``: a
    trainer that trusts us takes it up when the swarm is behind it, every trainer having left);
    ``latest``: the checkpoint taken up at start. With ``--metrics``, the run's families and the
    page's ``run`` section."""
    directory = Path(args.checkpoint_dir)
    monitor = Monitor(directory, args.target_batch_size)
    tracker = ProgressTracker(peer, args.run_id, args.target_batch_size, client=False, archive=True)
    if latest is not None or monitor.last_step >= 0 or monitor.earlier:
        if latest is not None:
            monitor.checkpoint = {"step": latest.step, "path": latest.source, "time": time.time()}
        peer.node.emit(TakenUp(step=latest.step if latest is not None else -1,
                               path=latest.source if latest is not None else "",
                               curve_step=monitor.last_step, volunteers=len(monitor.earlier)))
    if dashboard is not None:
        from .metrics import TrainingMetrics

        dashboard.registry.register(TrainingMetrics(tracker))
        dashboard.sections["run"] = lambda: monitor.page(tracker, args.run_id)

    async def snapshot() -> TrainingState:
        return latest if latest is not None else TrainingState(-1, [], None, {}, None)

    serving = StateServer(peer, args.run_id, snapshot).install()
    saved = latest.step if latest is not None else -1
    names = list(getattr(args, "datasets", None) or [])
    try:
        async with AsyncExitStack() as stack:
            datasets = None
            if names:  # credit for data: who served the run's datasets, who added their shards
                from .datasets import Datasets

                datasets = await stack.enter_async_context(Datasets.open(peer))
            while True:
                if latest is not None:  # the run's archive: what we hold, for a swarm that fell behind it
                    await tracker.report(latest.step, 0, 0.0)
                progress = await tracker.fetch()
                if peer.authenticator is not None:  # a closed run: credit users, not just peer ids
                    for r in tracker.reports:
                        token = peer.authenticator.token_of(r.peer_id)
                        if token is not None:
                            monitor.usernames[r.peer_id] = token.username
                if datasets is not None:
                    await monitor.observe_datasets(datasets, names)
                monitor.observe(tracker)
                if progress.step >= max(1, saved + args.checkpoint_every) and progress.sources:
                    sources = [s for s in progress.sources if s != peer.peer_id]
                    for report in tracker.reports:
                        if report.peer_id in progress.sources and report.addrs:
                            peer.node.add_addrs(report.peer_id, list(report.addrs))
                    try:
                        state = await download_state(peer, args.run_id, sources, progress.step, params, timeout=60)
                    except StateDownloadError as e:
                        peer.node.emit(Checkpointed(step=-1, path="", source=f"none: {e}"))
                    else:
                        path = await trio.to_thread.run_sync(save_checkpoint, directory, args.run_id, state)
                        await trio.to_thread.run_sync(prune_checkpoints, directory, args.keep_checkpoints)
                        latest, saved = state, state.step
                        monitor.checkpoint = {"step": latest.step, "path": str(path), "time": time.time()}
                        peer.node.emit(Checkpointed(step=latest.step, path=str(path), source=str(sources[0])))
                await trio.sleep(args.report_every)
    finally:
        serving.remove()
        if latest is not None:  # the archive is no longer served: trainers stop waiting on it now
            with trio.CancelScope(shield=True), trio.move_on_after(LEAVE_TIMEOUT):
                await tracker.leave(timeout=LEAVE_TIMEOUT)


async def cmd_backbone(args: argparse.Namespace, out: Output) -> int:
    """Everything checked before the peer starts: the options, the directory (held: one backbone
    each), and the checkpoint to take up (this run's, this model's)."""
    _check_run_args(args)
    if args.checkpoint_every <= 0:
        raise ConfigError("--checkpoint-every must be positive")
    if args.keep_checkpoints < 0:
        raise ConfigError(f"--keep-checkpoints must be 0 (keep all) or more, not {args.keep_checkpoints}")
    with hold_directory(Path(args.checkpoint_dir)):
        _, model, _, _ = await trio.to_thread.run_sync(build, args)  # off the event loop
        params = [p for p in model.parameters() if p.requires_grad]
        latest = await trio.to_thread.run_sync(latest_checkpoint, Path(args.checkpoint_dir), args.run_id, params)
        return await run_peer(args, out, relay=True, role="backbone",
                              work=lambda peer, dashboard: backbone(peer, args, params, latest, dashboard))


def main(argv: Sequence[str] | None = None) -> int:
    """The ``dedloc`` entry point (training/commands.py), kept here for ``python -m training.cli``."""
    from .commands import main as commands_main

    return commands_main(argv)


if __name__ == "__main__":
    sys.exit(main())
