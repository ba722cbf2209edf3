"""One process at a time: an exclusive, non-blocking ``flock`` held for a process's life.

Three things must have one writer: an identity (a node's key file: two nodes with
one peer id ran side by side, and the swarm cannot tell them apart), a dataset's
directory (two ``dataset get`` into one hung the second for good) and a
backbone's checkpoint directory (two backbones wrote one curve and one leaderboard).
Each holds :class:`HeldLock` on a file for as long as it runs.

Why ``flock`` and not a pid file: the kernel drops the lock when the process ends,
however it ends (a pid file outlives a crash and locks the owner out until someone
deletes it by hand). Why not the ``filelock`` package (here only as torch's dependency,
not the p2p layer's): it is made for locks that wait (timeouts, reentrancy, soft-lock
fallbacks); what is needed here is one non-blocking ``flock`` and the holder's pid
in the refusal, which it does not record.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from .errors import DedlocError


class LockHeld(DedlocError):
    """Another process (or another descriptor of this one) holds the lock; ``owner`` is the pid it
    recorded ("" where none is recorded)."""

    def __init__(self, path: Path, owner: str) -> None:
        super().__init__(f"{path} is locked by {f'pid {owner}' if owner else 'another process'}")
        self.path = path
        self.owner = owner


class HeldLock:
    """An exclusive ``flock`` on ``path``, held until :meth:`release` (or the block's end) or the
    process ends.

    ``record_pid``: create the file if missing and write our pid in it, for the message of whoever is
    refused next (a lock file of its own); without it the file must exist and is only read (a file
    that holds something else, as an identity's key).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, path: Path, *, record_pid: bool = True) -> HeldLock:
        """Take the lock at once or raise :class:`LockHeld`; ``OSError`` where the file cannot be opened."""
        import fcntl

        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644) if record_pid else os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() if record_pid else ""
            os.close(fd)
            raise LockHeld(path, owner) from None
        if record_pid:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (closing the descriptor drops the flock); a second call does nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.release()


__all__ = ["HeldLock", "LockHeld"]
