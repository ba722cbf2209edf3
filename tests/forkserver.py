"""Run ``dedloc`` command lines as processes forked from one that imported the commands once.

tests/test_cli_errors.py runs 30 command lines that each fail at once; as processes of their own,
each paid the imports (torch's alone ~2 s, ~3.5 s in all: 104 s of CI's two cores for the table).
This process imports them once, then for each request forks a child that runs the line exactly
as ``python -m training.commands`` does: its own process (exit code, stdout and stderr apart, an
uncaught exception printed as the interpreter prints it), stdin at /dev/null. The parent never
runs trio or a torch operation, so a child starts with no threads and no event loop.

stdin: one JSON request per line, ``{"argv": [...], "timeout": s}``; stdout: one JSON reply per
line, ``{"rc": n, "stdout": ..., "stderr": ...}`` (rc -9 and "timed out" on stderr past the timeout).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import time
import traceback

#: What the commands import before they fail or start: paid here once.
PRELOAD = ("torch", "training.commands", "training.cli", "training.moe.cli", "averaging.cli", "nat.cli", "p2p.node")


def child(argv: list[str], out: int, err: int) -> None:
    """In the forked child: run the line as ``python -m training.commands`` would, then exit."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = [sys.argv[0], *argv]
    code = 0
    try:
        runpy.run_module("training.commands", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(argv: list[str], timeout: float) -> dict[str, object]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(argv, out.fileno(), err.fileno())
        deadline = time.monotonic() + timeout
        status = None
        while status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = raw
            elif time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                status = -9
            else:
                time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        rc = os.waitstatus_to_exitcode(status) if status != -9 else -9
        if status == -9:
            stderr += f"\n(forkserver: timed out after {timeout} s)"
        return {"rc": rc, "stdout": out.read().decode(errors="replace"), "stderr": stderr}


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            print(json.dumps(run(list(request["argv"]), float(request["timeout"]))), flush=True)


if __name__ == "__main__":
    main()
