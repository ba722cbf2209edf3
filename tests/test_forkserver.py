"""The fork server (tests/forkserver.py): a forked ``python -m`` is the caller's process in all it
shows — its stdio, arguments, directory, environment, network namespace, signals and exit status."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2p.forkserver import Forks, ForkServer, ForkServerError, script_argv
from tests.forks import ROOT, suite_forks
from tests.kit import alive

pytestmark = pytest.mark.timeout(60)

#: A module the server runs from the caller's directory (``python -m`` puts it first on sys.path).
PROBE = '''
import json, os, signal, socket, sys, time
mode = sys.argv[1]
if mode == "show":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
                      "stdin": sys.stdin.read(), "interfaces": [n for _, n in socket.if_nameindex()],
                      "pid": os.getpid(), "name": __name__, "path0": sys.path[0], "file": __file__}))
    print("to stderr", file=sys.stderr)
    sys.exit(3)
if mode == "wait":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(0)))
    os.write(1, f"{os.getpid()}\\n".encode())  # not print: a SIGTERM inside its flush made the handler's print reentrant
    for _ in range(3000):  # short sleeps: a signal just before one blocks waits 10 ms at most, not 30 s
        time.sleep(0.01)
if mode == "spawn":  # a process of its own, in our process group (no session of its own)
    import subprocess
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    print(os.getpid(), grandchild.pid, flush=True)
    grandchild.wait()
if mode == "die":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "raise":
    raise RuntimeError("uncaught")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "exit":  # what the interpreter's exit does: join the threads, run atexit, flush, the message
    import atexit, threading
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
    print("buffered", end=" ")
    sys.exit("exit message")
'''


@pytest.fixture(scope="module")
def forks() -> Iterator[Forks]:
    with suite_forks("json.tool") as server:
        yield server


@pytest.fixture
def here(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def gone(pid: int, timeout: float = 10) -> bool:
    """Whether ``pid`` has stopped running within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def test_the_child_has_the_callers_stdio_arguments_directory_environment_and_exit_code(forks: Forks,
                                                                                       here: Path) -> None:
    result = subprocess.run(forks.argv("probe", "show", "two words"), cwd=here, input="from stdin",
                            capture_output=True, text=True, env={**os.environ, "PROBE": "set"}, timeout=30)
    assert result.returncode == 3, result.stderr
    shown = json.loads(result.stdout)
    assert shown["argv"] == ["show", "two words"] and shown["cwd"] == str(here) and shown["probe"] == "set"
    assert shown["stdin"] == "from stdin" and shown["name"] == "__main__"
    assert result.stderr == "to stderr\n"


def test_a_script_runs_by_its_path_as_a_fresh_interpreter_runs_it(forks: Forks, here: Path) -> None:
    """``python SCRIPT``: the script's directory first on sys.path (not the caller's), its file as
    ``__file__``, run as ``__main__``; and the fresh interpreter agrees on each (the bench scripts
    a smoke test starts from the server, bench/harness.py)."""
    elsewhere = here / "elsewhere"
    elsewhere.mkdir()
    for argv in (script_argv(forks.path, "../probe.py", "show", "x"), [sys.executable, "../probe.py", "show", "x"]):
        result = subprocess.run(argv, cwd=elsewhere, input="", capture_output=True, text=True, timeout=30)
        assert result.returncode == 3, result.stderr
        shown = json.loads(result.stdout)
        assert shown["argv"] == ["show", "x"] and shown["cwd"] == str(elsewhere) and shown["name"] == "__main__"
        assert shown["path0"] == str(here) and os.path.normpath(shown["file"]) == str(here / "probe.py"), shown


def test_a_preloaded_module_runs_as_main_as_a_fresh_one_would(forks: Forks, tmp_path: Path) -> None:
    """json.tool was imported by the server, yet runs as ``__main__`` without runpy's warning that it
    was imported already."""
    result = subprocess.run(forks.argv("json.tool", "--compact"), cwd=tmp_path, input='{"a": [1, 2]}',
                            capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout, result.stderr) == (0, '{"a":[1,2]}\n', "")


def test_an_uncaught_exception_is_printed_and_exits_1(forks: Forks, here: Path) -> None:
    result = subprocess.run(forks.argv("probe", "raise"), cwd=here, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "RuntimeError: uncaught" in result.stderr


def test_the_child_exits_as_the_interpreter_would(forks: Forks, here: Path) -> None:
    """Without the interpreter's teardown (``run_as_main``): threads joined, then atexit, stdout
    flushed, a ``sys.exit`` message printed with status 1; an uncaught KeyboardInterrupt a SIGINT death."""
    result = subprocess.run(forks.argv("probe", "exit"), cwd=here, capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout, result.stderr) == (1, "buffered thread joined\natexit ran\n",
                                                                 "exit message\n")
    result = subprocess.run(forks.argv("probe", "interrupt"), cwd=here, capture_output=True, text=True, timeout=30)
    assert result.returncode == -signal.SIGINT and result.stderr.rstrip().endswith("KeyboardInterrupt"), result


def test_the_child_runs_in_the_callers_network_namespace(forks: Forks, here: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a network namespace of its own")
    result = subprocess.run(["unshare", "--net", *forks.argv("probe", "show")], cwd=here, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 3, result.stderr
    assert json.loads(result.stdout)["interfaces"] == ["lo"]  # a new namespace: loopback only


def test_a_caller_in_the_servers_own_namespace_needs_no_privilege(here: Path) -> None:
    """setns wants CAP_SYS_ADMIN even into the namespace one is in: a user's ``make test`` (no labs,
    but tests/test_cli_errors.py's table) has none, so the child stays where it is."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to run without CAP_SYS_ADMIN")
    code = ("import subprocess, sys\nfrom tests.forks import suite_forks\nwith suite_forks() as f:\n"
            f"    sys.exit(subprocess.run(f.argv('probe', 'show'), cwd={str(here)!r}, capture_output=True).returncode)")
    result = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c", code],
                            cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 3, result.stderr


def test_a_signal_to_the_caller_reaches_the_child_and_a_death_by_signal_is_the_callers(forks: Forks,
                                                                                      here: Path) -> None:
    proc = subprocess.Popen(forks.argv("probe", "wait"), cwd=here, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    int(proc.stdout.readline())
    proc.terminate()
    assert proc.wait(timeout=10) == 0 and proc.stdout.read() == "got SIGTERM\n"
    died = subprocess.run(forks.argv("probe", "die"), cwd=here, timeout=30)
    assert died.returncode == -signal.SIGKILL


def test_a_caller_killed_takes_its_child_with_it(forks: Forks, here: Path) -> None:
    proc = subprocess.Popen(forks.argv("probe", "wait"), cwd=here, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert child != proc.pid and alive(child)
    proc.kill()
    proc.wait(timeout=10)
    assert gone(child)


def test_a_caller_killed_takes_what_its_child_started_with_it(forks: Forks, here: Path) -> None:
    """As ``killpg`` on a fresh interpreter's group would: the child's own processes (no session of their
    own) end with it, as a bench's killed worker takes its helpers (bench/harness.py ``kill_group``)."""
    proc = subprocess.Popen(forks.argv("probe", "spawn"), cwd=here, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    child, grandchild = map(int, proc.stdout.readline().split())
    assert alive(child) and alive(grandchild)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert gone(child) and gone(grandchild)


def test_the_server_closed_takes_its_children_with_it(here: Path) -> None:
    with suite_forks() as server:
        proc = subprocess.Popen(server.argv("probe", "wait"), cwd=here, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        closing = time.monotonic()
    assert time.monotonic() - closing < 10  # it killed the child (sleeping 30 s) rather than waiting for it
    assert not alive(child)
    assert proc.wait(timeout=10) == 70  # the client says the server went away


def test_the_server_killed_takes_its_children_with_it(here: Path) -> None:
    with suite_forks() as server:
        proc = subprocess.Popen(server.argv("probe", "wait"), cwd=here, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert server.server is not None
        server.server.kill()  # no goodbye: its children die with it (PR_SET_PDEATHSIG)
        server.server.wait()
        assert proc.wait(timeout=10) == 70
        assert gone(child)


def test_without_a_server_the_client_says_so(tmp_path: Path) -> None:
    result = subprocess.run(suite_forks().argv("probe", "show"), cwd=tmp_path, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 70 and "no fork server at" in result.stderr


def test_a_child_started_with_dies_with_us_dies_with_the_test_that_started_it() -> None:
    """``dies_with_us`` as a test's ``preexec_fn``: a test SIGKILLed (a mutation run's timeout) takes the commands it
    started with it, though no ``finally`` of it runs."""
    code = ("import subprocess, sys, time\nfrom p2p.forkserver import dies_with_us\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=dies_with_us)\n"
            "print(child.pid, flush=True)\ntime.sleep(60)\n")
    test = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert test.stdout is not None
    child = int(test.stdout.readline())
    assert alive(child)
    test.kill()
    test.wait(timeout=10)
    assert gone(child)


async def test_an_async_owner_waits_for_ready_forks_children_and_its_end_ends_them(here: Path) -> None:
    """``ForkServer``, ``dedloc demo``'s: ``ready`` returns once the server listens, a child runs as the
    caller's process, and leaving the block kills what still runs (the server's own session: a Ctrl-C
    reaches the owner, not the server mid-fork)."""
    import trio

    async with ForkServer.open(("json.tool",)) as forks:
        await forks.ready()
        await forks.ready()  # once said, said: the second returns at once
        assert os.getsid(forks.process.pid) == forks.process.pid
        assert stat.S_IMODE(os.stat(os.path.dirname(forks.path)).st_mode) == 0o700  # its user's alone
        done = await trio.run_process(forks.argv("probe", "show", "x"), cwd=here, stdin=b"in", capture_stdout=True,
                                      capture_stderr=True, check=False)
        assert done.returncode == 3 and json.loads(done.stdout)["argv"] == ["show", "x"], done.stderr
        waiting = await trio.lowlevel.open_process(forks.argv("probe", "wait"), cwd=here, stdout=subprocess.PIPE)
        assert waiting.stdout is not None
        child = int((await waiting.stdout.receive_some(64)).split()[0])
        assert alive(child)
        server = forks.process
    assert server.returncode == 0 and gone(child)
    with trio.fail_after(10):
        assert await waiting.wait() == 70


async def test_an_async_owner_hears_why_the_server_did_not_start() -> None:
    """A preload that fails ends the server before it listens: ``ready`` raises, naming what it said
    and its exit; a server that says nothing in its time is refused too."""
    async with ForkServer.open(("no_such_module_for_the_fork_server",)) as forks:
        with pytest.raises(ForkServerError, match=r"did not start \(it said '', exit 1\)"):
            await forks.ready()
        with pytest.raises(ForkServerError):  # and again, not a hang
            await forks.ready()
    async with ForkServer.open(("json.tool",), timeout=0.01) as forks:
        with pytest.raises(ForkServerError, match=r"it said 'nothing in 0.01 s', still running"):
            await forks.ready()


async def test_the_demo_starts_fresh_interpreters_where_its_fork_server_did_not_start() -> None:
    """``dedloc demo`` says why and goes on with fresh interpreters; with a server, its nodes' command
    line is the client's."""
    from training.demo import ENTRY, _Launcher

    said: list[str] = []
    async with ForkServer.open(("no_such_module_for_the_fork_server",)) as forks:
        launcher = _Launcher(forks)
        assert launcher("relay")[:3] == [sys.executable, "-S", "-I"] and launcher("relay")[-3:] == ["-m", ENTRY, "relay"]
        await launcher.ready(said.append)
    assert launcher("relay", "--json") == [sys.executable, "-m", ENTRY, "relay", "--json"]
    assert len(said) == 1 and said[0].startswith("each node a fresh interpreter: the fork server did not start"), said
