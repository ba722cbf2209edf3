"""The backbone keeps the run: checkpoints a restart takes up, a curve and a board that go on where they
stopped, one backbone per directory, and the newest checkpoint served to a swarm that fell behind it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import trio

from p2p.errors import ConfigError
from training import CollaborativeOptimizer, TrainingConfig
from training.checkpoints import (CheckpointError, checkpoint_path, hold_directory, latest_checkpoint, save_checkpoint,
                                  saved_steps)
from training.cli import Monitor
from training.progress import ProgressTracker
from training.state import StateServer, TrainingState, snapshot_of

from .kit import open_peers
from .test_averaging import public

pytestmark = pytest.mark.timeout(120)


def model_and_optimizer(seed: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def state_at(step: int, seed: int = 3, pending: bool = False) -> tuple[TrainingState, list[torch.Tensor]]:
    model, opt, sched = model_and_optimizer(seed)
    params = list(model.parameters())
    grads = [torch.full_like(p, 0.5) for p in params] if pending else None
    return snapshot_of(step, params, opt, sched, grads), params


# ---------------------------------------------------------------------- checkpoints


def test_a_checkpoint_is_read_back_whole_and_the_newest_that_reads_is_taken_up(tmp_path: Path,
                                                                                 caplog: pytest.LogCaptureFixture) -> None:
    state, params = state_at(10, pending=True)
    path = save_checkpoint(tmp_path, "run", state)
    assert path == checkpoint_path(tmp_path, 10) == tmp_path / "checkpoint-000010.pt"
    assert not list(tmp_path.glob("*.partial"))
    save_checkpoint(tmp_path, "run", state_at(20)[0])
    (tmp_path / "checkpoint-000030.pt").write_bytes(b"torn by a crash")  # newest, but not whole
    (tmp_path / "checkpoint-000040.pt.partial").write_bytes(b"a save cut short")  # no checkpoint's name
    (tmp_path / "notes.txt").write_text("not one")
    assert [s for s, _ in saved_steps(tmp_path)] == [30, 20, 10]
    fresh = [torch.zeros_like(p) for p in params]
    with caplog.at_level(logging.WARNING):
        taken = latest_checkpoint(tmp_path, "run", fresh)
    assert taken is not None and taken.step == 20 and taken.pending is None
    assert "passing over" in caplog.text and "checkpoint-000030.pt does not read as a checkpoint" in caplog.text
    (tmp_path / "checkpoint-000030.pt").unlink()
    (tmp_path / "checkpoint-000020.pt").unlink()
    back = latest_checkpoint(tmp_path, "run", fresh)
    assert back is not None and back.step == 10 and back.source == str(path)
    assert all(torch.equal(a, b) for a, b in zip(back.params, params))
    assert back.pending is not None and all(torch.equal(g, torch.full_like(p, 0.5)) for g, p in zip(back.pending, params))
    assert back.optimizer["param_groups"] == state.optimizer["param_groups"] and back.scheduler == state.scheduler
    assert latest_checkpoint(tmp_path / "none", "run", fresh) is None  # no directory yet: nothing to take up


def test_a_save_cut_short_leaves_no_torn_file_under_a_checkpoint_s_name(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    state, params = state_at(10)
    save_checkpoint(tmp_path, "run", state)

    def crash(obj: object, f: Path) -> None:
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, "run", state_at(20)[0])
    assert [s for s, _ in saved_steps(tmp_path)] == [10]


def test_another_run_s_or_model_s_checkpoints_are_refused_not_mixed_with_this_run_s(tmp_path: Path) -> None:
    state, params = state_at(10)
    save_checkpoint(tmp_path, "their-run", state)
    with pytest.raises(CheckpointError, match=r"checkpoint-000010.pt is a checkpoint of run 'their-run', not 'run': "
                                              "name another --checkpoint-dir"):
        latest_checkpoint(tmp_path, "run", params)
    assert isinstance(CheckpointError("x"), ConfigError)  # the CLI says it in a line and exits 1
    other = torch.nn.Linear(8, 2)
    with pytest.raises(CheckpointError, match=r"holds another model's parameters \(4 tensors, this model has 2\)"):
        latest_checkpoint(tmp_path, "their-run", list(other.parameters()))
    wide = [torch.zeros(16, 9), *params[1:]]
    with pytest.raises(CheckpointError, match="another model's"):
        latest_checkpoint(tmp_path, "their-run", wide)


def test_a_checkpoint_directory_is_held_by_one_backbone_at_a_time(tmp_path: Path) -> None:
    import os

    with hold_directory(tmp_path / "ck"):
        with pytest.raises(CheckpointError) as refused:
            hold_directory(tmp_path / "ck")
        assert str(refused.value) == (f"--checkpoint-dir {tmp_path / 'ck'} is in use by another dedloc process "
                                      f"(pid {os.getpid()}); stop it, or name another directory")
    hold_directory(tmp_path / "ck").release()


# ---------------------------------------------------------------------- the curve and the board


class Reads:
    """What the monitor reads of a tracker: its last progress and reports."""

    def __init__(self, step: int) -> None:
        from training.progress import global_progress

        self.reports: list[object] = []
        self.last = global_progress([], 100, 0.0, local_step=step)
        self.target = 100


def test_a_monitor_takes_up_the_curve_and_the_board_a_backbone_before_it_left(tmp_path: Path) -> None:
    lines = [json.dumps({"step": s, "time": 1.0 * s, "loss": 5.0 - s, "samples_per_second": 1.0, "peers": 2})
             for s in range(3)]
    (tmp_path / "curve.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "ti')  # torn by a crash
    (tmp_path / "contributions.json").write_text(json.dumps({"a": {"samples": 500, "claimed": 600,
                                                                   "auxiliary_steps": 0}}))
    monitor = Monitor(tmp_path, 100)
    assert [p["step"] for p in monitor.curve] == [0, 1, 2] and monitor.last_step == 2
    assert monitor.credits.after == 1  # step 2 was under way: its claims count on
    assert monitor.contributions() == {"a": {"samples": 500, "claimed": 600, "auxiliary_steps": 0}}
    monitor.observe(Reads(3))  # type: ignore[arg-type]
    steps = [json.loads(line)["step"] for line in (tmp_path / "curve.jsonl").read_text().splitlines()
             if line.startswith('{"step": ') and line.endswith("}")]
    assert steps == [0, 1, 2, 3]  # the torn line was ended: the next one is whole
    assert json.loads((tmp_path / "contributions.json").read_text()) == monitor.contributions()
    again = Monitor(tmp_path, 100)
    assert again.last_step == 3 and again.earlier == {"a": {"samples": 500, "claimed": 600, "auxiliary_steps": 0}}


def test_a_board_that_does_not_read_is_kept_aside_and_the_board_starts_anew(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "contributions.json").write_text('{"a": {"samples": 5')
    with caplog.at_level(logging.WARNING):
        monitor = Monitor(tmp_path, 100)
    assert monitor.earlier == {} and monitor.last_step == -1
    aside = list(tmp_path.glob("contributions.unreadable-*.json"))
    assert len(aside) == 1 and aside[0].read_text() == '{"a": {"samples": 5'
    assert "does not read as a leaderboard" in caplog.text and aside[0].name in caplog.text


# ---------------------------------------------------------------------- the archive, on a swarm


#: a global batch no trainer here completes alone: a step it reached is one it took up
TARGET = 10**6


async def test_a_trainer_that_finds_the_swarm_behind_a_trusted_archive_takes_the_run_up_there() -> None:
    """Every trainer left; the backbone holds step 7. A trainer that trusts it (joined through it) takes
    the run up at step 7 with the backbone's weights; one that does not trains on from its own step 0."""
    held, _ = state_at(7, seed=11)
    async with open_peers(3) as everyone:
        backbone, trusting, other = everyone[1:]
        await public(everyone[1:])
        archive = ProgressTracker(backbone, "run", TARGET, client=False, archive=True)

        async def snapshot() -> TrainingState:
            return held

        serving = StateServer(backbone, "run", snapshot).install()
        try:
            assert await archive.report(held.step, 0, 0.0)
            for peer, trusted in ((other, ()), (trusting, (backbone.peer_id,))):
                model, opt, _ = model_and_optimizer(seed=5)
                config = TrainingConfig(run_id="run", target_batch_size=TARGET, trusted_archives=trusted)
                async with CollaborativeOptimizer.open(peer, opt, config) as collaborative:
                    with trio.move_on_after(3 if not trusted else 30):
                        while collaborative.local_step < held.step:
                            x = torch.randn(8, 8)
                            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
                            await collaborative.step(8)
                            await trio.sleep(0.01)
                    if trusted:
                        assert collaborative.local_step == 7 and collaborative.downloads == 1
                        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), held.params))
                    else:
                        assert collaborative.local_step == 0 and collaborative.downloads == 0
        finally:
            serving.remove()


# ---------------------------------------------------------------------- the commands


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_restarted_backbone_takes_up_its_directory_and_a_trainer_joining_an_empty_swarm_takes_the_run_up(
        tmp_path: Path) -> None:
    """The user's story: the run reached step 7, every volunteer left, the backbone restarted (an upgrade,
    a reboot). It takes up its checkpoint, curve and board (a second one on the directory is refused),
    and the next volunteer, joining through it, goes on from step 7, not from scratch."""
    import subprocess
    import sys

    from training.cli import build
    from training.commands import build_parser

    from .kit import ProcessLines

    dedloc = [sys.executable, "-m", "training.commands"]
    workdir, checkpoints = tmp_path / "example", tmp_path / "checkpoints"
    run_args = ["--run-id", "restart", "--target-batch-size", "100000", "--workdir", str(workdir)]
    parser, _ = build_parser()
    _, model, opt, sched = build(parser.parse_args(["backbone", *run_args]))
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.add_(0.25)  # weights no fresh peer starts with
    checkpoints.mkdir()
    save_checkpoint(checkpoints, "restart", snapshot_of(7, params, opt, sched, None))
    (checkpoints / "curve.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in range(8)))
    (checkpoints / "contributions.json").write_text(json.dumps({"ann": {"samples": 700, "claimed": 700,
                                                                        "auxiliary_steps": 0}}))
    peer = ["--listen", "/ip4/127.0.0.1/tcp/0", "--allow-private", "--ephemeral", "--json", "--status-interval", "0"]
    backbone = subprocess.Popen([*dedloc, "backbone", *peer, "--checkpoint-dir", str(checkpoints), "--report-every",
                                 "0.5", *run_args], stdout=subprocess.PIPE, text=True)
    try:
        lines = ProcessLines(backbone)
        assert lines.wait_for(lambda e: e.get("event") == "taken_up", 60), lines.events
        taken = next(e for e in lines.events() if e.get("event") == "taken_up")
        assert (taken["step"], taken["path"], taken["curve_step"], taken["volunteers"]) == (
            7, str(checkpoints / "checkpoint-000007.pt"), 7, 1)
        addr = next(a for e in lines.events() if e.get("event") == "listening" for a in e["addrs"] if "/127.0.0.1/" in a)
        second = subprocess.run([*dedloc, "backbone", *peer, "--checkpoint-dir", str(checkpoints), *run_args],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and (f"--checkpoint-dir {checkpoints} is in use by another dedloc process "
                                           f"(pid {backbone.pid})") in second.stdout, second.stdout  # --json: a line
        trainer = subprocess.run([*dedloc, "train", *peer, "--initial-peers", addr, "--max-steps", "7", *run_args],
                                 capture_output=True, text=True, timeout=150)
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        events = [json.loads(line) for line in trainer.stdout.splitlines() if line.startswith("{")]
        downloads = [e for e in events if e.get("event") == "state_downloaded"]
        assert [d["step"] for d in downloads] == [7] and downloads[0]["source"] == addr.rsplit("/p2p/", 1)[1]
    finally:
        backbone.terminate()
        backbone.wait(timeout=30)
    assert json.loads((checkpoints / "contributions.json").read_text())["ann"]["samples"] == 700
