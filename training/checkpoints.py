"""The backbone's checkpoints: the run's state saved whole, a file per saved step, taken up again at a restart.

DeDLOC's backbone peers "store checkpoints" so that the run outlives its
volunteers (3.1: at least one of them is up at all times). A checkpoint is only
worth what a restart can do with it, so:

* a file is written beside its name and renamed over it (``.partial``): a crash
  mid-save leaves the previous checkpoints whole and no torn file under a
  checkpoint's name;
* a restarted backbone takes up the newest checkpoint that reads whole and fits
  the model (:func:`latest_checkpoint`), serves it, and publishes it as the
  run's archive (``training/progress.py``): a volunteer who joins after every
  other left takes the run on from there, not from scratch;
* a checkpoint names its run: a directory that holds another run's checkpoints,
  or another model's, is refused at start (two runs' curves and leaderboards in
  one directory would be mixed for good), as is a directory another backbone
  holds (:func:`hold_directory`).

Files: ``checkpoint-NNNNNN.pt`` (``torch.save`` of ``{"run_id", "step", "params",
"pending", "optimizer", "scheduler", "time"}``, read back with
``weights_only=True``: nothing in it runs code) and ``.lock``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from p2p.errors import ConfigError
from p2p.lockfile import HeldLock, LockHeld

from .state import TrainingState

log = logging.getLogger(__name__)

NAME = re.compile(r"checkpoint-(\d{6,})\.pt")


class CheckpointError(ConfigError):
    """A checkpoint directory this backbone cannot take up: another run's or model's, or held."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"checkpoint-{step:06d}.pt"


def hold_directory(directory: Path) -> HeldLock:
    """One process at a time writes a checkpoint directory (``p2p.lockfile`` on ``DIR/.lock``): a
    backbone's, or an expert server's (``serve-experts --checkpoint-dir``: two servers of the same
    experts saved over each other's weights; its ``--processes`` children share their parent's hold)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        return HeldLock.acquire(directory / ".lock")
    except LockHeld as e:
        raise CheckpointError(f"--checkpoint-dir {directory} is in use by another dedloc process"
                              f"{f' (pid {e.owner})' if e.owner else ''}; stop it, or name another directory") from None


def save_whole(obj: object, path: Path) -> None:
    """``torch.save`` of ``obj`` at ``path``, whole or not at all: written beside it (``.partial``) and
    renamed over it, so a crash mid-save leaves the previous file whole; a save cut short (a full disk)
    leaves nothing behind. The backbone's checkpoints and an expert server's (``moe/server.py``)."""
    partial = path.with_name(path.name + ".partial")
    try:
        torch.save(obj, partial)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def save_checkpoint(directory: Path, run_id: str, state: TrainingState) -> Path:
    """Write ``state`` as ``checkpoint-<step>.pt`` (:func:`save_whole`); its path."""
    path = checkpoint_path(directory, state.step)
    save_whole({"run_id": run_id, "step": state.step, "params": state.params, "pending": state.pending,
                "optimizer": state.optimizer, "scheduler": state.scheduler, "time": time.time()}, path)
    return path


def saved_steps(directory: Path) -> list[tuple[int, Path]]:
    """The checkpoints in ``directory`` by their names, newest step first."""
    if not Path(directory).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(directory).iterdir() if (m := NAME.fullmatch(p.name))]
    return sorted(found, reverse=True)


def prune_checkpoints(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (0: keep all); what was deleted. A backbone that
    saves every few steps for weeks filled its disk (a model with Adam's moments is three models a file)."""
    if keep <= 0:
        return []
    old = [path for _, path in saved_steps(directory)[keep:]]
    for path in old:
        path.unlink(missing_ok=True)
    return old


def load_checkpoint(path: Path, run_id: str, params: Sequence[torch.Tensor]) -> TrainingState:
    """The state in ``path``; :class:`CheckpointError` when it is another run's or model's, ``ValueError``
    when it does not read as a checkpoint at all (torn, or not one)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(saved, dict):
            raise ValueError("not a dictionary")
        step, tensors = int(saved["step"]), list(saved["params"])
        optimizer, scheduler, pending = saved["optimizer"], saved.get("scheduler"), saved.get("pending")
    except Exception as e:  # torch's unpickler raises many kinds: a torn file is any of them
        raise ValueError(f"{path} does not read as a checkpoint: {e}") from None
    if saved.get("run_id", run_id) != run_id:
        raise CheckpointError(f"{path} is a checkpoint of run {saved['run_id']!r}, not {run_id!r}: "
                              "name another --checkpoint-dir for this run")
    if len(tensors) != len(params) or any(not isinstance(t, torch.Tensor) or t.shape != p.shape
                                          for t, p in zip(tensors, params)):
        raise CheckpointError(f"{path} holds another model's parameters ({len(tensors)} tensors, this model has "
                              f"{len(params)}): name another --checkpoint-dir, or start this backbone as that run's")
    if not isinstance(optimizer, dict) or not (scheduler is None or isinstance(scheduler, dict)):
        raise ValueError(f"{path} does not read as a checkpoint: no optimizer state")
    if pending is not None and (len(pending) != len(params) or any(
            not isinstance(g, torch.Tensor) or g.shape != p.shape for g, p in zip(pending, params))):
        raise ValueError(f"{path} does not read as a checkpoint: its pending gradients do not fit its parameters")
    return TrainingState(step, [t.to(p.dtype) for t, p in zip(tensors, params)],
                         None if pending is None else list(pending), optimizer, scheduler, source=str(path))


def latest_checkpoint(directory: Path, run_id: str, params: Sequence[torch.Tensor]) -> TrainingState | None:
    """The newest checkpoint in ``directory`` that reads whole (a file that does not is passed over,
    with a warning); None when there is none. :class:`CheckpointError` as :func:`load_checkpoint`."""
    for step, path in saved_steps(directory):
        try:
            state = load_checkpoint(path, run_id, params)
        except CheckpointError:
            raise
        except ValueError as e:
            log.warning("backbone: passing over %s", e)
            continue
        if state.step != step:
            log.warning("backbone: passing over %s: it holds step %d", path, state.step)
            continue
        return state
    return None


__all__ = ["CheckpointError", "checkpoint_path", "hold_directory", "latest_checkpoint", "load_checkpoint",
           "prune_checkpoints", "save_checkpoint", "save_whole", "saved_steps"]
