"""What the benches need of their worker processes, in one place.

A bench compares systems that each run in processes of their own (dedloc in
this project's venv, hivemind 1.1.12 in ``.venv-hivemind``, libtorrent in its
own), so every bench does the same few things: run a worker that prints JSON,
within a deadline, keeping its stderr for the failure message, and kill its
whole process group at the end (hivemind leaves a Go daemon and DHT processes
behind it); talk JSON lines with long-lived workers; start a ``dedloc relay``
on loopback as the bootstrap node; find the other systems' interpreters. Each
is here once:

- :func:`run_json`: a one-shot worker, blocking; its last JSON line, or a
  RuntimeError that quotes its stderr.
- :class:`Worker` and :func:`open_worker`: a long-lived worker speaking JSON lines
  on stdin/stdout, in its own session (:meth:`Worker.kill` kills the group).
- :func:`kill_group`.
- :func:`start_relay`: ``dedloc relay`` on loopback and its address.
- :data:`PYTHON`, :data:`HIVEMIND_PYTHON`, :func:`hivemind_python`.

Peers made inside a bench's own process use ``PeerConfig.loopback()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
#: This project's interpreter (the bench's own), and hivemind's venv (bench/setup_hivemind.sh).
PYTHON = Path(sys.executable)
HIVEMIND_PYTHON = ROOT / ".venv-hivemind" / "bin" / "python"
#: Lines of stderr quoted in a failure.
TAIL_LINES = 40
#: py-libp2p's noise on stderr, left out of a failure's quote.
NOISE = ("Failed to open TCP stream",)


def hivemind_python() -> Path:
    """hivemind's interpreter; exits with what to run when its venv is missing."""
    if not HIVEMIND_PYTHON.exists():
        sys.exit("hivemind is not installed: run `bash bench/setup_hivemind.sh` first (it creates .venv-hivemind)")
    return HIVEMIND_PYTHON


def kill_group(pid: int) -> None:
    """SIGKILL a worker's whole process group (its own session): what it started goes with it."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tail(text: str, noise: Iterable[str] = NOISE, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``text`` without the known noise."""
    kept = [line for line in text.splitlines() if not any(n in line for n in noise)]
    return "\n".join(kept[-lines:])


def run_json(argv: Sequence[str | Path], *, timeout: float, what: str, env: Mapping[str, str] | None = None,
             cwd: Path = ROOT) -> dict[str, Any]:
    """Run a one-shot worker in its own session for at most ``timeout`` s, kill its process group, and
    return the last line of its stdout that is a JSON object; RuntimeError with its exit code and the
    tail of its stderr when there is none.

    Output goes to files, not pipes: hivemind's DHT processes outlive the worker holding what they
    inherited, so a pipe would not end with it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen([str(a) for a in argv], cwd=cwd, env=None if env is None else dict(env),
                                   stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_group(process.pid)  # the worker if still running, and what it left behind
            process.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{what} gave no result (exit code {process.returncode}, limit {timeout:.0f} s): "
                           + tail(stderr))
    result: dict[str, Any] = json.loads(lines[-1])
    return result


class Worker:
    """A long-lived worker process speaking JSON lines on its stdin and stdout."""

    def __init__(self, name: str, proc: trio.Process) -> None:
        self.name = name
        self.proc = proc
        self.buffer = b""
        self.peer_id = ""
        self.addrs: list[str] = []

    async def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all((json.dumps(message) + "\n").encode())

    async def receive(self, timeout: float) -> dict[str, Any]:
        """The next line as JSON; trio.TooSlowError after ``timeout``, EOFError when the worker exited."""
        assert self.proc.stdout is not None
        with trio.fail_after(timeout):
            while b"\n" not in self.buffer:
                data = await self.proc.stdout.receive_some(1 << 16)
                if not data:
                    raise EOFError(f"{self.name} exited (rc={self.proc.returncode})")
                self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    def kill(self) -> None:
        if self.proc.returncode is None:
            kill_group(self.proc.pid)


async def open_worker(name: str, argv: Sequence[str | Path], *, log: Path, ready_timeout: float,
                      spawn: Any = None, env: Mapping[str, str] | None = None) -> Worker:
    """Start a :class:`Worker` in its own session (stderr appended to ``log``) and wait for its first line,
    ``{"ready": true, "peer_id": ..., "addrs": [...]}``. ``spawn``: a lab host's ``spawn`` (it runs the
    worker in the host's namespace), else a local process."""
    start = spawn or trio.lowlevel.open_process
    extra: dict[str, Any] = {} if env is None else {"env": dict(env)}
    with open(log, "ab") as err:
        proc = await start([str(a) for a in argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                           start_new_session=True, **extra)
    worker = Worker(name, proc)
    try:
        ready = await worker.receive(ready_timeout)
    except BaseException:
        worker.kill()
        raise
    if not ready.get("ready"):
        worker.kill()
        raise RuntimeError(f"{name}: {ready}")
    worker.peer_id, worker.addrs = ready.get("peer_id", ""), ready.get("addrs", [])
    return worker


async def start_relay(*, python: Path = PYTHON, listen: str = "/ip4/127.0.0.1/tcp/0", timeout: float = 60.0,
                      spawn: Any = None, stderr: Any = None) -> tuple[trio.Process, str]:
    """``dedloc relay`` (ephemeral, no port mapping, no status page) and the first of its addresses on
    ``listen``'s interface; the caller kills it (:func:`kill_group`)."""
    start = spawn or trio.lowlevel.open_process
    process = await start([str(python), "-m", "nat.cli", "relay", "--ephemeral", "--json", "--listen", listen,
                           "--status-interval", "0", "--no-port-mapping", "--allow-private"],
                          cwd=str(ROOT), stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    host = listen.split("/")[2]
    buffer = b""
    assert process.stdout is not None
    try:
        with trio.fail_after(timeout):
            while True:
                data = await process.stdout.receive_some(1 << 16)
                if not data:
                    raise RuntimeError(f"the relay exited (rc={process.returncode}) before it listened")
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.startswith(b"{"):
                        continue
                    event = json.loads(line)
                    if event.get("event") == "listening":
                        return process, next(a for a in event["addrs"] if f"/{host}/" in a)
    except BaseException:
        kill_group(process.pid)
        raise


__all__ = ["HIVEMIND_PYTHON", "PYTHON", "ROOT", "Worker", "hivemind_python", "kill_group", "open_worker",
           "run_json", "start_relay", "tail"]
