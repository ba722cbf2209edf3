"""Start ``python -m MODULE ...`` (or ``python SCRIPT ...``) as processes forked from one that
imported the modules once.

A dedloc process pays its imports before it does anything: ~1.8 s of CPU for ``nat.cli``, ~3.5 s
with torch, ~9 s for ``dedloc train`` (torch, py-libp2p, transformers' ALBERT and its tokenizer).
``dedloc demo`` starts a dozen of them, the test suite's namespace labs hundreds; on a two-core
machine that was minutes of CPU spent importing the same modules. This server imports them once,
then forks a child per request that runs the module exactly as ``python -m`` does.

A request comes from ``p2p/forkclient.py``, a stdlib-only script that starts in ~20 ms. The
client is the process the caller started and sees (``ip netns exec ns python -S -I forkclient.py
SOCKET -m MODULE ARGS``, or a plain ``subprocess.run``): it hands this server its stdin, stdout,
stderr and network namespace (file descriptors over the unix socket), its working directory and
environment; the child takes all of them (``setns`` into the namespace), so it reads and writes
the caller's pipes and binds in the caller's namespace. The client forwards the signals it gets
to the child, and exits with the child's status (a signal death as the same signal). The client
killed (SIGKILL cannot be forwarded) closes its socket, and the server kills the child. The server
gone (stdin closed, or its parent died) kills every child it forked (``PR_SET_PDEATHSIG``).

The server never runs trio, nor a torch operation: a child starts with no event loop, and only
the threads an import started (torch's; the nat modules start none). ``gc.freeze`` keeps the
imported objects out of each child's collections, so the pages stay shared; the child leaves by
``os._exit`` once it has done what the interpreter's exit does that anyone sees (``run_as_main``),
not by the interpreter's teardown of every module (it writes to every page). A command line that
fails at once took 2.0 s of CPU so (1.5 s of it unfreezing, 0.5 s the teardown), 0.2 s now.

    python -m p2p.forkserver SOCKET MODULE...   (stdout: "ready" once it listens)

Its owners: :class:`Forks` (a blocking ``with``, the test suite's), :class:`ForkServer` (``async
with``, ``dedloc demo``'s). Linux only (``prctl``, ``setns``, descriptors over a unix socket).
Whoever connects runs a module as the server's user: both owners put the socket in a directory of
their own that only that user may enter (``tempfile``'s, mode 0700).

A request names a module (``-m``, run as ``python -m`` runs it: the caller's directory first on
sys.path) or a script's path (run as ``python SCRIPT`` runs it: the script's directory first on
sys.path): the bench scripts a smoke test runs start so (bench/harness.py, ``python_argv``).

Differences from a fresh interpreter, none of which the forked modules depend on: the module's
imports were done before the request (environment variables read at import time are the
server's); the child is the server's child, so its CPU time counts in the caller's rusage only once
the server is reaped; ``ip netns exec``'s private /sys mount is not made (the code reads
/proc/net, which follows the network namespace); garbage among the imported objects is never
collected, and the ``__del__`` of objects alive at exit is not run (Python does not promise it).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import os
import pkgutil
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from .errors import DedlocError

if TYPE_CHECKING:
    import trio

_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
#: The largest request (argv, cwd and environment as JSON).
MAX_REQUEST = 1 << 20


@dataclass
class Request:
    """What a client asked for: run ``module`` (or the script at ``script``) with ``argv`` in its
    namespace, on its stdio."""

    module: str
    argv: list[str]
    cwd: str
    env: dict[str, str]
    stdio: list[int]
    netns: int
    script: str | None = None


def parse(data: bytes, fds: list[int]) -> Request:
    """A request from its bytes and the four descriptors that came with them (stdin, stdout,
    stderr, network namespace); ValueError if it is not one."""
    if len(fds) != 4:
        raise ValueError(f"a request carries 4 descriptors (stdin, stdout, stderr, netns), not {len(fds)}")
    body = json.loads(data)
    if not isinstance(body, dict) or not isinstance(body.get("argv"), list) or not (
            isinstance(body.get("module"), str) or isinstance(body.get("script"), str)):
        raise ValueError("a request is {module or script, argv, cwd, env}")
    script = body.get("script")
    return Request(str(body.get("module") or ""), [str(a) for a in body["argv"]], str(body["cwd"]),
                   {str(k): str(v) for k, v in dict(body["env"]).items()}, fds[:3], fds[3],
                   None if script is None else str(script))


def dies_with_us() -> None:
    """The kernel kills this process when the one that started it dies (``PR_SET_PDEATHSIG``): a
    forked child of the server, or a test's ``preexec_fn`` for the commands it starts (a test killed
    outright, as a mutation run's timeout does, runs no ``finally``: its ``dedloc`` children had held
    the cores and ports of the runs that followed)."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def become(request: Request) -> None:
    """In the forked child: take the client's namespace, stdio, directory and environment, and die
    with the server. A session of its own, so that the server ends what it started with it: a fresh
    interpreter would have been in its caller's process group (a bench kills a worker's group), and
    this child is in the server's unless it leaves."""
    dies_with_us()
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    theirs, ours = os.fstat(request.netns), os.stat("/proc/self/ns/net")
    # setns needs CAP_SYS_ADMIN even into the namespace we are in: a user's `make test` has none
    if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino) and libc.setns(request.netns, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns into the client's network namespace")
    os.close(request.netns)
    for target, fd in enumerate(request.stdio):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    if request.script is None:
        sys.argv = [request.module, *request.argv]
        sys.path[0] = request.cwd  # as -m puts it
    else:  # as the interpreter: __file__ joined to the directory, sys.path[0] the real directory
        request.script = os.path.join(request.cwd, request.script)
        sys.argv = [request.script, *request.argv]
        sys.path[0] = os.path.dirname(os.path.realpath(request.script))
    # stdio as a fresh interpreter opens it on these descriptors (a terminal or PYTHONUNBUFFERED
    # makes stdout line-buffered or unbuffered; stderr is always line-buffered).
    unbuffered = bool(request.env.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, "r", encoding=sys.stdin.encoding, errors=sys.stdin.errors, closefd=False)
    sys.stdout = open(1, "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors, closefd=False,
                      buffering=1 if os.isatty(1) else -1)
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)
    sys.stderr = open(2, "w", encoding=sys.stderr.encoding, errors="backslashreplace", closefd=False, buffering=1)


class Server:
    """The accept/fork/reap loop. ``serve`` returns in a child (with its request) or when stdin closes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pid = os.getpid()
        self.children: dict[int, socket.socket] = {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def serve(self) -> Request | None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, "accept")
        sel.register(self.wake_r, selectors.EVENT_READ, "reap")
        sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        print("ready", flush=True)
        try:
            while True:
                for key, _ in sel.select():
                    if key.data == "accept":
                        conn, _ = self.listener.accept()
                        request = self.start(conn, sel)
                        if request is not None:
                            return request  # in the child
                    elif key.data == "reap":
                        while len(os.read(self.wake_r, 512)) == 512:
                            pass
                        self.reap(sel)
                    elif key.data == "stdin":
                        if not os.read(sys.stdin.fileno(), 512):
                            return None
                    else:  # a client's socket: readable only at its end (the client died)
                        pid = key.data
                        sel.unregister(key.fileobj)
                        if pid in self.children:
                            kill_session(pid)
        finally:
            sel.close()
            if os.getpid() == self.pid:
                self.close()

    def start(self, conn: socket.socket, sel: selectors.BaseSelector) -> Request | None:
        """Fork a child for the request on ``conn``; the request in the child, None in the server."""
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 4)
            request = parse(data, fds)
        except (OSError, ValueError) as e:
            for fd in fds:
                os.close(fd)
            try:
                conn.send(json.dumps({"error": f"bad request: {e}"}).encode())
            except OSError:
                pass
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.listener.close()
            for other in self.children.values():
                other.close()
            conn.close()
            return request
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        except OSError:
            os.kill(pid, signal.SIGKILL)
        sel.register(conn, selectors.EVENT_READ, pid)
        return None

    def reap(self, sel: selectors.BaseSelector) -> None:
        """Collect every child that ended; tell its client how."""
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            try:
                sel.unregister(conn)
            except KeyError:
                pass
            try:
                conn.send(json.dumps({"status": status}).encode())
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        for pid in self.children:
            kill_session(pid)
        for pid in list(self.children):
            os.waitpid(pid, 0)
            self.children.pop(pid).close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def kill_session(pid: int) -> None:
    """SIGKILL a child and the processes of its session's group (what it started without a session of
    their own), as a caller's ``killpg`` would have ended them with a fresh interpreter."""
    for kill in (os.killpg, os.kill):  # the group, or the child alone before its setsid
        try:
            kill(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            continue


#: The client script: started as ``python -S -I forkclient.py`` (stdlib only, ~20 ms), never imported.
CLIENT = Path(__file__).resolve().parent / "forkclient.py"


def client_argv(path: str, module: str, *args: str) -> list[str]:
    """``python -m module args`` through the fork server listening at ``path``."""
    return [sys.executable, "-S", "-I", str(CLIENT), path, "-m", module, *args]


def script_argv(path: str, script: str, *args: str) -> list[str]:
    """``python script args`` through the fork server listening at ``path``."""
    return [sys.executable, "-S", "-I", str(CLIENT), path, script, *args]


def server_argv(path: str, preload: Sequence[str]) -> list[str]:
    """The server's own command line: it imports ``preload`` (``package.*``: a package and every
    module under it), listens at ``path``, says "ready" on stdout, and serves until its stdin closes."""
    return [sys.executable, "-m", "p2p.forkserver", path, *preload]


class ForkServerError(DedlocError):
    """The fork server did not start: what it said, how it ended."""


def _failed(said: str, status: int | None) -> ForkServerError:
    ended = "still running" if status is None else f"exit {status}"
    return ForkServerError(f"the fork server did not start (it said {said.strip()!r}, {ended})")


class Forks:
    """A fork server for a blocking caller (the test suite): ``with Forks("nat.cli") as forks:
    forks.argv("nat.cli", "relay")``. ``argv(module, *args)`` is the command line to start in place of
    ``python -m module args``. ``cwd``: the server's directory, first on its sys.path (a test's
    preload names modules of the repository's ``tests``)."""

    def __init__(self, *preload: str, timeout: float = 60, cwd: str | os.PathLike[str] | None = None) -> None:
        self.preload = preload
        self.timeout = timeout
        self.cwd = cwd
        self._dir = tempfile.TemporaryDirectory(prefix="forks-")
        self.path = os.path.join(self._dir.name, "socket")
        self.server: subprocess.Popen[str] | None = None

    def argv(self, module: str, *args: str) -> list[str]:
        return client_argv(self.path, module, *args)

    def __enter__(self) -> Forks:
        self.server = subprocess.Popen(server_argv(self.path, self.preload), cwd=self.cwd, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        assert self.server.stdout is not None
        line = self.server.stdout.readline()
        if line != "ready\n":
            self.server.kill()
            raise _failed(line, self.server.wait())
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self.server is not None:
            assert self.server.stdin is not None
            self.server.stdin.close()
            try:
                self.server.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        self._dir.cleanup()


class ForkServer:
    """A fork server owned by a trio task: ``async with ForkServer.open(preload) as forks``, then
    ``await forks.ready()`` before the first ``forks.argv(...)`` is started. The server imports while
    the owner does other work (``dedloc demo`` builds its NAT lab meanwhile); leaving the block closes
    its stdin, and the server kills whatever it forked that still runs.

    The server has a session of its own: a Ctrl-C at the terminal reaches the owner, which ends it
    in order, not the server in the middle of a fork."""

    def __init__(self, process: trio.Process, path: str, timeout: float) -> None:
        self.process = process
        self.path = path
        self.timeout = timeout
        self._said: str | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, preload: Sequence[str], *, timeout: float = 120.0,
                   close_timeout: float = 10.0) -> AsyncIterator[ForkServer]:
        """Start the server (``timeout``: how long its imports may take, from here to "ready")."""
        import trio

        with tempfile.TemporaryDirectory(prefix="forks-") as directory:
            path = os.path.join(directory, "socket")
            process = await trio.lowlevel.open_process(server_argv(path, preload), stdin=subprocess.PIPE,
                                                       stdout=subprocess.PIPE, start_new_session=True)
            try:
                yield cls(process, path, timeout)
            finally:
                with trio.CancelScope(shield=True):
                    if process.stdin is not None:
                        await process.stdin.aclose()
                    with trio.move_on_after(close_timeout):
                        await process.wait()
                    if process.returncode is None:
                        process.kill()
                        await process.wait()

    async def ready(self) -> None:
        """Wait until the server listens; :class:`ForkServerError` where it ended or said something
        else, or did not say it within the timeout."""
        import trio

        if self._said is None:
            assert self.process.stdout is not None
            said, ended = b"", False
            with trio.move_on_after(self.timeout):
                while not said.endswith(b"\n"):
                    chunk = await self.process.stdout.receive_some(64)
                    if not chunk:
                        ended = True
                        break
                    said += chunk
            if ended:  # its status, for the error
                with trio.move_on_after(5):
                    await self.process.wait()
            self._said = said.decode(errors="replace") if said or ended else f"nothing in {self.timeout:g} s"
        if self._said != "ready\n":
            raise _failed(self._said, self.process.returncode)

    def argv(self, module: str, *args: str) -> list[str]:
        """``python -m module args`` as a child of this server."""
        return client_argv(self.path, module, *args)


def main() -> None:
    path, *preload = sys.argv[1:]
    for name in preload:
        preload_module(name)
    gc.collect()
    gc.freeze()
    request = Server(path).serve()
    if request is None:
        return
    # The child: from here on it is `python -m MODULE ARGV` (an uncaught exception, SystemExit and
    # the interpreter's exit all as there).
    become(request)
    # The imported objects stay frozen in the child too: unfrozen, the child's first full collection
    # and its exit's traverse every one of them (torch's), writing to each page (a copy of each).
    # Preloaded, the module itself is in sys.modules; `python -m` runs it with only its imports there.
    if request.script is None:
        sys.modules.pop(request.module, None)
    os._exit(run_as_main(request.module, request.script))


def preload_module(name: str) -> None:
    """Import ``name``; ``package.*``: the package and every module under it (``__main__`` apart)."""
    if not name.endswith(".*"):
        importlib.import_module(name)
        return
    package = importlib.import_module(name[:-2])
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not info.name.endswith(".__main__"):
            importlib.import_module(info.name)


def run_as_main(module: str, script: str | None = None) -> int:
    """Run ``module`` as ``python -m`` does (or the file ``script`` as ``python script`` does) and
    return its exit status, for ``os._exit``.

    The interpreter's own exit would then tear down every module the server imported, each object's
    reference count written (each page copied): ~0.5 s of CPU per child, 0.7 -> 0.2 s for a command
    line that fails at once. What that exit does that anyone can see is done here, in its order:
    SystemExit's status (its message printed), an uncaught exception's traceback (status 1), the
    other threads joined, the atexit functions run (logging's flush), stdio flushed (status 120 if
    stdout cannot be); an uncaught KeyboardInterrupt ends the process by SIGINT. What it skips:
    the ``__del__`` of objects still referenced at exit, which Python does not promise to run."""
    interrupted = False
    try:
        if script is None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as e:
        status = exit_status(e.code)
    except BaseException as e:  # as the interpreter: the traceback on stderr
        interrupted = isinstance(e, KeyboardInterrupt)
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own join of non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if not stream.closed:  # as the interpreter: a stream the program closed is left be
                stream.flush()
        except OSError:
            if stream is sys.stdout and status == 0:
                status = 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return status


def exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` gives: None 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1

if __name__ == "__main__":
    main()
