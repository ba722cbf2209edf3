"""The backbone keeps the run: checkpoints a restart takes up, a curve and a board that go on where they
stopped, one backbone per directory, and the newest checkpoint served to a swarm that fell behind it."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import trio

from p2p.errors import ConfigError
from training import CollaborativeOptimizer, TrainingConfig
from training.checkpoints import (CheckpointError, checkpoint_path, hold_directory, latest_checkpoint,
                                  prune_checkpoints, save_checkpoint, saved_steps)
from training.monitor import Monitor
from p2p.lockfile import HeldLock
from training.progress import LocalProgress, ProgressTracker
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


def test_only_the_newest_checkpoints_are_kept_when_asked(tmp_path: Path) -> None:
    state, _ = state_at(1)
    for step in (5, 10, 15, 20):
        save_checkpoint(tmp_path, "run", replace(state, step=step))
    (tmp_path / "curve.jsonl").write_text("")
    assert prune_checkpoints(tmp_path, 0) == [] and len(saved_steps(tmp_path)) == 4  # 0: keep all
    assert prune_checkpoints(tmp_path, 2) == [checkpoint_path(tmp_path, 10), checkpoint_path(tmp_path, 5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000015.pt", "checkpoint-000020.pt", "curve.jsonl"]
    assert prune_checkpoints(tmp_path, 2) == []
    assert prune_checkpoints(tmp_path, 1) == [checkpoint_path(tmp_path, 15)]
    assert [step for step, _ in saved_steps(tmp_path)] == [20]


def test_pruning_passes_over_a_checkpoint_deleted_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator who deletes old checkpoints by hand while the backbone prunes them costs nothing."""
    import training.checkpoints as checkpoints

    state, _ = state_at(1)
    save_checkpoint(tmp_path, "run", replace(state, step=20))
    gone = checkpoint_path(tmp_path, 10)
    monkeypatch.setattr(checkpoints, "saved_steps", lambda d: [(20, checkpoint_path(d, 20)), (10, gone)])
    assert prune_checkpoints(tmp_path, 1) == [gone] and checkpoint_path(tmp_path, 20).exists()


def test_a_save_cut_short_leaves_no_torn_file_under_a_checkpoint_s_name(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    state, params = state_at(10)
    save_checkpoint(tmp_path, "run", state)

    def crash(obj: object, f: Path) -> None:
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    assert set(torch.load(tmp_path / "checkpoint-000010.pt", weights_only=True)) == {
        "run_id", "step", "params", "pending", "optimizer", "scheduler", "time"}  # when it was saved: for people
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, "run", state_at(20)[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000010.pt"]  # no half file left behind


class Evil:
    """A pickle that runs code when loaded without ``weights_only``: it would make ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return Path.touch, (self.marker,)


def test_what_does_not_read_as_a_checkpoint_is_passed_over_and_named(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    state, params = state_at(1)
    good = {"run_id": "run", "step": 1, "params": state.params, "pending": None, "optimizer": state.optimizer,
            "scheduler": state.scheduler}
    marker = tmp_path / "ran"
    wrong = [
        (2, [1, 2], "not a dictionary"),
        (3, {**good, "step": 3, "optimizer": [1]}, "no optimizer state"),
        (4, {**good, "step": 4, "scheduler": [1]}, "no optimizer state"),
        (5, {**good, "step": 5, "pending": [torch.zeros(1)]}, "its pending gradients do not fit"),
        (6, {**good, "step": 6, "pending": [torch.zeros(3, 3) for _ in params]}, "its pending gradients do not fit"),
        (7, {**good, "step": 7, "extra": Evil(marker)}, "does not read as a checkpoint"),  # nothing in it runs code
        (9, {**good, "step": 8}, "it holds step 8"),  # a file renamed by hand
    ]
    torch.save(good, tmp_path / "checkpoint-000001.pt")
    for step, content, _ in wrong:
        torch.save(content, tmp_path / f"checkpoint-{step:06d}.pt")
    with caplog.at_level(logging.WARNING):
        taken = latest_checkpoint(tmp_path, "run", [torch.zeros_like(p) for p in params])
    assert taken is not None and taken.step == 1 and not marker.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(wrong)
    for (step, _, words), line in zip(sorted(wrong, reverse=True), warnings):
        assert f"checkpoint-{step:06d}.pt" in line and words in line, (step, line)


def test_a_checkpoint_without_a_run_id_is_taken_and_its_tensors_take_the_model_s_dtype(tmp_path: Path) -> None:
    """Checkpoints of a backbone before this one named no run: they are taken (the model's shapes still
    checked); a checkpoint saved in another precision is loaded in the model's."""
    state, params = state_at(4)
    torch.save({"step": 4, "params": [p.double() for p in state.params], "pending": None,
                "optimizer": state.optimizer, "scheduler": state.scheduler}, tmp_path / "checkpoint-000004.pt")
    taken = latest_checkpoint(tmp_path, "any-run", [torch.zeros_like(p) for p in params])
    assert taken is not None and taken.step == 4
    assert all(t.dtype == torch.float32 and torch.equal(t, p) for t, p in zip(taken.params, state.params))


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

    ck = tmp_path / "runs" / "ck"  # made with its parents
    with hold_directory(ck):
        assert (ck / ".lock").read_text() == str(os.getpid())
        with pytest.raises(CheckpointError) as refused:
            hold_directory(ck)
        assert str(refused.value) == (f"--checkpoint-dir {ck} is in use by another dedloc process "
                                      f"(pid {os.getpid()}); stop it, or name another directory")
    hold_directory(ck).release()
    (ck / ".lock").write_text("")  # held by one that recorded no pid (an older dedloc, a hand-made lock)
    with HeldLock.acquire(ck / ".lock", record_pid=False):
        with pytest.raises(CheckpointError) as refused:
            hold_directory(ck)
        assert str(refused.value) == (f"--checkpoint-dir {ck} is in use by another dedloc process; stop it, "
                                      "or name another directory")


def test_a_lock_says_who_holds_it_and_locks_a_file_it_does_not_own_read_only(tmp_path: Path) -> None:
    import os
    import stat

    from p2p.lockfile import LockHeld

    assert str(LockHeld(tmp_path, "12")) == f"{tmp_path} is locked by pid 12"
    assert str(LockHeld(tmp_path, "")) == f"{tmp_path} is locked by another process"
    before = os.umask(0o022)
    try:
        lock = HeldLock.acquire(tmp_path / "lock")
    finally:
        os.umask(before)
    assert lock.path == tmp_path / "lock" and lock.held
    assert stat.S_IMODE((tmp_path / "lock").stat().st_mode) == 0o644
    (tmp_path / "lock").write_bytes(b"\xff77 ")  # not UTF-8: read as well as it can be
    with pytest.raises(LockHeld) as held:
        HeldLock.acquire(tmp_path / "lock")
    assert (held.value.path, held.value.owner) == (tmp_path / "lock", "\ufffd77")
    lock.release()
    assert not lock.held
    key = tmp_path / "identity.key"
    with pytest.raises(FileNotFoundError):  # a file it does not own is never created
        HeldLock.acquire(key, record_pid=False)
    key.write_bytes(b"secret key bytes")
    with HeldLock.acquire(key, record_pid=False):
        with pytest.raises(LockHeld) as held:
            HeldLock.acquire(key, record_pid=False)
        assert held.value.owner == ""  # its contents are not a pid, and are never read out
    assert key.read_bytes() == b"secret key bytes"


# ---------------------------------------------------------------------- the curve and the board


class Reads:
    """What the monitor reads of a tracker: its last progress and reports."""

    def __init__(self, step: int | None) -> None:
        """A trainer at ``step``; None: nobody (every trainer left)."""
        from training.progress import global_progress

        from p2p.identity import new_identity, peer_id_of

        self.reports = [] if step is None else [LocalProgress(peer_id_of(new_identity()), step, 10, 1.0, 0.0)]
        self.last = global_progress(self.reports, 100, 0.0)
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
    monitor.observe(Reads(None))  # type: ignore[arg-type]
    assert monitor.last_step == 3 and [p["step"] for p in monitor.curve][-1] == 3  # an empty swarm: no point
    assert json.loads((tmp_path / "contributions.json").read_text()) == monitor.contributions()
    again = Monitor(tmp_path, 100)
    assert again.last_step == 3 and again.earlier["a"] == {"samples": 500, "claimed": 600, "auxiliary_steps": 0}


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


async def test_a_backbone_that_stops_withdraws_its_archive_at_once(tmp_path: Path) -> None:
    """Stopped (a SIGTERM cancels its work), the backbone no longer serves its checkpoint: its last report
    says so, and a trainer trusting it stops counting on it now, not a minute later when it expires."""
    import argparse

    from training.cli import backbone as run_backbone

    held, params = state_at(7)
    args = argparse.Namespace(checkpoint_dir=str(tmp_path), target_batch_size=TARGET, run_id="run", datasets=None,
                              report_every=0.2, checkpoint_every=100, keep_checkpoints=0)
    async with open_peers(2) as everyone:
        reader, backbone = everyone[1:]
        await public(everyone[1:])
        trusting = ProgressTracker(reader, "run", TARGET, trusted=(backbone.peer_id,))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_backbone, backbone, args, params, held)
            with trio.fail_after(20):
                while (await trusting.fetch(local_step=0)).step != 7:
                    await trio.sleep(0.1)
            assert [a.peer_id for a in trusting.archives] == [backbone.peer_id]
            nursery.cancel_scope.cancel()
        progress = await trusting.fetch(local_step=0)
        assert progress.step == 0 and trusting.archives == [] and progress.sources == ()


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

    from p2p.forkserver import dies_with_us
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
                                 "0.5", *run_args], stdout=subprocess.PIPE, text=True, preexec_fn=dies_with_us)
    try:
        lines = ProcessLines(backbone)
        assert lines.wait_for(lambda e: e.get("event") == "taken_up", 60), lines.events
        taken = next(e for e in lines.events() if e.get("event") == "taken_up")
        assert (taken["step"], taken["path"], taken["curve_step"], taken["volunteers"]) == (
            7, str(checkpoints / "checkpoint-000007.pt"), 7, 1)
        addr = next(a for e in lines.events() if e.get("event") == "listening" for a in e["addrs"] if "/127.0.0.1/" in a)
        second = subprocess.run([*dedloc, "backbone", *peer, "--checkpoint-dir", str(checkpoints), *run_args],
                                capture_output=True, text=True, timeout=60, preexec_fn=dies_with_us)
        assert second.returncode == 1 and (f"--checkpoint-dir {checkpoints} is in use by another dedloc process "
                                           f"(pid {backbone.pid})") in second.stdout, second.stdout  # --json: a line
        trainer = subprocess.run([*dedloc, "train", *peer, "--initial-peers", addr, "--max-steps", "7", *run_args],
                                 capture_output=True, text=True, timeout=150, preexec_fn=dies_with_us)
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        events = [json.loads(line) for line in trainer.stdout.splitlines() if line.startswith("{")]
        downloads = [e for e in events if e.get("event") == "state_downloaded"]
        assert [d["step"] for d in downloads] == [7] and downloads[0]["source"] == addr.rsplit("/p2p/", 1)[1]
    finally:
        backbone.terminate()
        backbone.wait(timeout=30)
    assert json.loads((checkpoints / "contributions.json").read_text())["ann"]["samples"] == 700
