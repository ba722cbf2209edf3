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
  RuntimeError that quotes its stderr (:func:`json_result` reads what a worker
  run elsewhere, e.g. on a lab host, printed, the same way).
- :class:`Worker` and :func:`open_worker`: a long-lived worker speaking JSON lines
  on stdin/stdout, in its own session (:meth:`Worker.kill` kills the group).
- :class:`Spawned` and :func:`stop_all`: the same for a blocking bench that
  runs several workers at once (their lines read by a thread each);
  :func:`first_json`: a trio helper process's first line.
- :func:`kill_group`.
- :func:`start_relay` (trio) and :func:`spawn_relay` (blocking): ``dedloc
  relay`` and its address; :func:`relay_argv` is the one command line.
- :data:`PYTHON`, :data:`HIVEMIND_PYTHON`, :func:`hivemind_python`.
- :func:`python_argv`: a worker of this interpreter started from the test suite's fork server, where
  a smoke test runs the bench (each function here starting a worker applies it).

Peers made inside a bench's own process use ``PeerConfig.loopback()``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import trio

ROOT = Path(__file__).resolve().parent.parent
#: This project's interpreter (the bench's own), and hivemind's venv (bench/setup_hivemind.sh).
PYTHON = Path(sys.executable)
HIVEMIND_PYTHON = ROOT / ".venv-hivemind" / "bin" / "python"
#: Lines of stderr quoted in a failure.
TAIL_LINES = 40
#: py-libp2p's noise on stderr, left out of a failure's quote.
NOISE = ("Failed to open TCP stream",)


#: Set by the test suite's ``forks`` fixture (tests/conftest.py): the socket of a server that imported
#: torch and the project's packages once and forks a process per request (p2p/forkserver.py).
FORKS_ENV = "DEDLOC_FORKS"


def python_argv(argv: Sequence[str | Path]) -> list[str]:
    """``argv`` as words; where it runs this interpreter on a script or a ``-m`` module and
    $DEDLOC_FORKS names a fork server, the same command through it (its client starts in ~20 ms)
    in place of a fresh interpreter (3-4 s of CPU importing torch and py-libp2p).

    Only the test suite sets it, in tests/test_bench_smoke.py: a smoke test checks that a bench runs
    and writes its figures, and reads none that a process's start could change. A bench run by hand
    measures fresh interpreters, as a volunteer's processes are."""
    if not os.environ.get(FORKS_ENV):
        return [str(a) for a in argv]
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from tests.forks import python_argv as forked  # the suite's, where the variable comes from

    return forked(argv)


def hivemind_python() -> Path:
    """hivemind's interpreter; exits with what to run when its venv is missing."""
    if not HIVEMIND_PYTHON.exists():
        sys.exit("hivemind is not installed: run `bash bench/setup_hivemind.sh` first (it creates .venv-hivemind)")
    return HIVEMIND_PYTHON


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process that must come back at the same address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def json_result(stdout: str, stderr: str, returncode: int | None, *, what: str, timeout: float) -> dict[str, Any]:
    """The last line of a worker's ``stdout`` that is a JSON object; RuntimeError with its exit code
    and the tail of its ``stderr`` when there is none."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{what} gave no result (exit code {returncode}, limit {timeout:.0f} s): "
                           + tail(stderr))
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def run_json(argv: Sequence[str | Path], *, timeout: float, what: str, env: Mapping[str, str] | None = None,
             cwd: Path = ROOT) -> dict[str, Any]:
    """Run a one-shot worker in its own session for at most ``timeout`` s, kill its process group, and
    return the last line of its stdout that is a JSON object (:func:`json_result`).

    Output goes to files, not pipes: hivemind's DHT processes outlive the worker holding what they
    inherited, so a pipe would not end with it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(python_argv(argv), cwd=cwd, env=None if env is None else dict(env),
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
    return json_result(stdout, stderr, process.returncode, what=what, timeout=timeout)


class Spawned:
    """A worker of a blocking bench, in its own session, whose stdout lines a thread reads: several
    run at once and each is waited for with a deadline (:meth:`wait_for`), a silent one included.
    ``keep_stderr``: its stderr goes to a file that a failure quotes (:meth:`said`)."""

    def __init__(self, argv: Sequence[str | Path], *, what: str | None = None, stderr: Any = None,
                 keep_stderr: bool = False, stdin: Any = None, env: Mapping[str, str] | None = None,
                 cwd: Path = ROOT) -> None:
        self.what = what or " ".join(str(a) for a in list(argv)[1:3])
        self.argv = python_argv(argv)
        self.log: IO[str] | None = tempfile.TemporaryFile("w+") if keep_stderr else None
        self.process = subprocess.Popen(self.argv, cwd=cwd, env=None if env is None else dict(env), stdin=stdin,
                                        stdout=subprocess.PIPE, stderr=self.log if keep_stderr else stderr,
                                        text=True, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        stdout = self.process.stdout
        assert stdout is not None

        def read() -> None:
            for line in stdout:
                self.lines.put(line)
            self.lines.put(None)

        threading.Thread(target=read, daemon=True).start()

    def said(self) -> str:
        """The tail of its stderr (with ``keep_stderr``; else empty)."""
        if self.log is None or self.log.closed:
            return ""
        self.log.seek(0)
        return tail(self.log.read())

    def wait_for(self, key: str | None, timeout: float) -> dict[str, Any]:
        """The next JSON line holding ``key`` (None: any); RuntimeError at ``timeout`` or when the worker's
        output ends, quoting its stderr."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"{self.what} ended (exit code {self.process.wait()}) without "
                                   f"{'a ' + repr(key) if key else 'a JSON'} line\n{self.said()}".rstrip())
            line = line.strip()
            if line.startswith("{"):
                message: dict[str, Any] = json.loads(line)
                if key is None or key in message:
                    return message
        raise RuntimeError(f"{self.what}: no {key or 'JSON'!s} line within {timeout:.0f} s\n{self.said()}".rstrip())

    def send(self, line: str) -> None:
        """A line to its stdin (``stdin=subprocess.PIPE``)."""
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM, then its process group's SIGKILL ``grace`` s later."""
        stop_all([self], grace)


def stop_all(workers: Iterable[Spawned], grace: float = 20.0) -> None:
    """Terminate every worker at once, then kill what has not exited ``grace`` s later."""
    workers = list(workers)
    for w in workers:
        if w.process.poll() is None:
            w.process.terminate()
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill_group(w.process.pid)
        w.process.wait()
        if w.log is not None:
            w.log.close()


async def first_json(process: trio.Process, what: str, timeout: float = 60.0) -> dict[str, Any]:
    """The first line a trio child process prints, parsed: how the benches' helpers say they are ready."""
    assert process.stdout is not None
    line = b""
    with trio.fail_after(timeout):
        while b"\n" not in line:
            chunk = await process.stdout.receive_some(4096)
            if not chunk:
                raise RuntimeError(f"{what} process exited (rc={process.returncode}) before it was ready")
            line += chunk
    return dict(json.loads(line.split(b"\n", 1)[0]))


class Worker:
    """A long-lived worker process speaking JSON lines on its stdin and stdout."""

    def __init__(self, name: str, proc: trio.Process) -> None:
        self.name = name
        self.proc = proc
        self.buffer = b""
        self.peer_id = ""
        self.addrs: list[str] = []
        #: the worker's first line (``{"ready": true, ...}``), with whatever else it announced
        self.hello: dict[str, Any] = {}

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


async def open_worker(name: str, argv: Sequence[str | Path], *, log: Path | None, ready_timeout: float,
                      spawn: Any = None, env: Mapping[str, str] | None = None) -> Worker:
    """Start a :class:`Worker` in its own session (stderr appended to ``log``; None: the bench's own) and
    wait for its first line, ``{"ready": true, "peer_id": ..., "addrs": [...]}``. ``spawn``: a lab host's
    ``spawn`` (it runs the worker in the host's namespace), else a local process."""
    start = spawn or trio.lowlevel.open_process
    extra: dict[str, Any] = {} if env is None else {"env": dict(env)}
    with contextlib.ExitStack() as files:
        err = None if log is None else files.enter_context(open(log, "ab"))
        proc = await start(python_argv(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
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
    worker.hello, worker.peer_id, worker.addrs = ready, ready.get("peer_id", ""), ready.get("addrs", [])
    return worker


def relay_argv(*, python: Path = PYTHON, listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
               allow_private: bool = True, python_flags: Sequence[str] = ()) -> list[str]:
    """``dedloc relay`` as a bench runs it: ephemeral, JSON events, no port mapping, no status lines;
    ``allow_private``: loopback and lab addresses count as reachable."""
    return [str(python), *python_flags, "-m", "nat.cli", "relay", "--ephemeral", "--json",
            *(a for address in listen for a in ("--listen", address)),
            "--status-interval", "0", "--no-port-mapping", *(["--allow-private"] if allow_private else [])]


def relay_address(event: dict[str, Any], listen: str, announce: str | None = None) -> str | None:
    """The address to dial from a relay's ``listening`` event (None for any other event): the one on
    ``listen``'s interface, or on ``announce`` (a lab host's address, when it listens on 0.0.0.0)."""
    if event.get("event") != "listening":
        return None
    if announce is not None:
        port = listen.split("/tcp/")[1].split("/")[0]
        return f"/ip4/{announce}/tcp/{port}/p2p/{event['peer_id']}"
    host = listen.split("/")[2]
    return next(str(a) for a in event["addrs"] if f"/{host}/" in a)


async def start_relay(*, python: Path = PYTHON, listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
                      announce: str | None = None, allow_private: bool = True, python_flags: Sequence[str] = (),
                      timeout: float = 60.0, spawn: Any = None, stderr: Any = None) -> tuple[trio.Process, str]:
    """:func:`relay_argv` started (``spawn``: a lab host's, else a local process in its own session) and
    its address (:func:`relay_address` on the first of ``listen``); the caller kills it (:func:`kill_group`)."""
    start = spawn or trio.lowlevel.open_process
    process = await start(python_argv(relay_argv(python=python, listen=listen, allow_private=allow_private,
                                                 python_flags=python_flags)),
                          cwd=str(ROOT), stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
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
                    if line.startswith(b"{") and (address := relay_address(json.loads(line), listen[0], announce)):
                        return process, address
    except BaseException:
        kill_group(process.pid)
        raise


def spawn_relay(*, python: Path = PYTHON, listen: str = "/ip4/127.0.0.1/tcp/0",
                timeout: float = 60.0) -> tuple[Spawned, str]:
    """:func:`start_relay` for a blocking bench: the relay (stop it with the workers) and its address."""
    relay = Spawned(relay_argv(python=python, listen=(listen,)), stderr=subprocess.DEVNULL)
    try:
        address = relay_address(relay.wait_for("addrs", timeout), listen)
        if address is None:
            raise RuntimeError("the relay's first line with addresses was no `listening` event")
        return relay, address
    except BaseException:
        relay.stop(grace=0)
        raise


__all__ = ["HIVEMIND_PYTHON", "PYTHON", "ROOT", "Spawned", "Worker", "first_json", "hivemind_python", "json_result", "kill_group",
           "open_worker", "relay_address", "relay_argv", "run_json", "spawn_relay", "start_relay", "stop_all", "tail"]
