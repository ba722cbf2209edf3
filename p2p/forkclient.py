"""``python -m MODULE ARGS``, run by p2p/forkserver.py: this process hands over its stdio, network
namespace, directory and environment, forwards the signals it gets, and exits as the child does.

    python -S -I p2p/forkclient.py SOCKET -m MODULE ARGS...
    python -S -I p2p/forkclient.py SOCKET SCRIPT ARGS...     (``python SCRIPT ARGS``)

Standard library only, and nothing imported that a bare interpreter does not need: it starts in
~20 ms where the module's own imports take seconds.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

#: Signals a caller may send to stop or poke the process; each goes on to the child.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def fail(message: str) -> None:
    print(f"forkclient: {message}", file=sys.stderr, flush=True)
    raise SystemExit(70)


def main() -> None:
    if len(sys.argv) < 3 or (sys.argv[2] == "-m" and len(sys.argv) < 4) or (
            sys.argv[2] != "-m" and sys.argv[2].startswith("-")):
        fail("usage: forkclient.py SOCKET -m MODULE ARGS... | forkclient.py SOCKET SCRIPT ARGS...")
    path = sys.argv[1]
    if sys.argv[2] == "-m":
        target, argv = {"module": sys.argv[3]}, sys.argv[4:]
    else:  # a script's path (the child resolves it from our directory, which it takes)
        target, argv = {"script": sys.argv[2]}, sys.argv[3:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError as e:
        fail(f"no fork server at {path}: {e}")
    stdio = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            stdio.append(fd)
        except OSError:  # closed: the child gets /dev/null, as a fresh interpreter would see nothing
            stdio.append(os.open(os.devnull, os.O_RDWR))
    # The handlers go in before the child can exist: its first output may reach our caller, who
    # may signal us at once; a signal before the child's pid is known is sent once it is.
    child = 0
    early: list[int] = []

    def forward(number: int, _frame: object) -> None:
        if not child:
            early.append(number)
            return
        try:
            os.kill(child, number)
        except ProcessLookupError:  # it just ended; its status is on the way
            pass

    # A signal that comes just before recv() blocks would run its handler only after recv returns:
    # the wakeup pipe makes select() return for it instead, and the handler runs then.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    request = {**target, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(sock, [json.dumps(request).encode()], [*stdio, netns])
    os.close(netns)
    started = json.loads(sock.recv(1 << 16) or b"{}")
    if "pid" not in started:
        fail(started.get("error", "the fork server closed the connection"))
    child = int(started["pid"])
    for number in early:
        forward(number, None)
    while sock.fileno() not in select.select([sock.fileno(), wake_r], [], [])[0]:
        os.read(wake_r, 512)
    ended = json.loads(sock.recv(1 << 16) or b"{}")
    if "status" not in ended:
        fail("the fork server went away before the child ended")
    code = os.waitstatus_to_exitcode(int(ended["status"]))
    if code < 0:  # killed by a signal: die by the same one
        if -code in FORWARDED:  # the others (SIGKILL...) have no handler here to take off
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
