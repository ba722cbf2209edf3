"""The userspace wire's core (nat.delay_line.DelayLine): packets in, packets out, a fake clock."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nat.delay_line import MAX_PACKET, DelayLine, main, open_tun, serve

from .kit import requires_root_netns


def test_every_packet_leaves_after_the_delay_in_the_order_it_came() -> None:
    line = DelayLine(delay=0.05)
    for i in range(5):
        assert line.push(bytes([i]), now=1.0 + i * 0.01)
    assert line.next_deadline() == pytest.approx(1.05)
    assert line.due(1.049) == []
    assert line.due(1.06) == [b"\x00", b"\x01"]
    assert line.due(10.0) == [b"\x02", b"\x03", b"\x04"]
    assert line.next_deadline() is None and len(line) == 0 and line.passed == 5


def test_zero_delay_passes_at_once() -> None:
    line = DelayLine(delay=0.0)
    line.push(b"x", now=3.0)
    assert line.due(3.0) == [b"x"]


def test_loss_drops_its_share_independently_and_repeatably() -> None:
    def run(seed: int) -> tuple[int, list[bytes]]:
        line = DelayLine(delay=0.01, loss=0.2, rng=random.Random(seed))
        for i in range(10_000):
            line.push(i.to_bytes(2, "big"), now=0.0)
        return line.lost, line.due(1.0)

    lost, out = run(7)
    assert 1_800 < lost < 2_200 and lost + len(out) == 10_000
    assert out == sorted(out)  # the survivors keep their order
    assert run(7) == (lost, out)  # a seed repeats the run
    assert run(8)[1] != out


def test_a_full_queue_drops_the_newcomer_and_counts_it() -> None:
    line = DelayLine(delay=1.0, limit=3)
    assert [line.push(b"%d" % i, now=0.0) for i in range(5)] == [True, True, True, False, False]
    assert line.overflowed == 2 and line.due(1.0) == [b"0", b"1", b"2"]


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError):
        DelayLine(delay=-1.0)
    with pytest.raises(ValueError):
        DelayLine(delay=0.0, loss=1.5)


class _Fixed(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def random(self) -> float:
        return self.value


def test_a_cut_link_loses_everything_and_says_so() -> None:
    line = DelayLine(delay=0.0, loss=1.0)  # 100% is a loss like any other
    assert [line.push(b"x", now=0.0) for _ in range(3)] == [False] * 3
    assert line.lost == 3 and line.due(1.0) == []


def test_a_packet_is_lost_with_probability_loss_exactly() -> None:
    """random() is in [0, 1): a draw equal to ``loss`` passes (else loss=0.5 loses a hair more)."""
    line = DelayLine(delay=0.0, loss=0.5, rng=_Fixed(0.5))
    assert line.push(b"kept", now=0.0)
    line.rng = _Fixed(0.4999)
    assert not line.push(b"lost", now=0.0)
    assert line.due(0.0) == [b"kept"] and line.lost == 1


# ---------------------------------------------------------------------------- the process's loop


class Wire:
    """``serve`` on a thread, its devices ``SOCK_SEQPACKET`` pairs (a packet per read, as a TUN
    device's): ``ends[(ns, dev)]`` is the namespace's side of each device the wire opened."""

    def __init__(self, fail: set[str] = frozenset(), broken: set[str] = frozenset(),  # type: ignore[assignment]
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ends: dict[tuple[str, str], socket.socket] = {}
        self.fds: list[int] = []  # the wire's sides, its to close
        self.fail = fail
        self.broken = broken
        self.replies: list[dict[str, object]] = []
        self._commands_r, self._commands_w = os.pipe()
        self._got = threading.Condition()
        self.thread = threading.Thread(target=serve, args=(self._commands_r, self._reply),
                                       kwargs={"open_device": self._open, "clock": clock}, daemon=True)
        self.thread.start()

    def _open(self, ns: str, dev: str) -> int:
        if dev in self.fail:
            raise OSError(19, f"no device {dev}")
        if dev in self.broken:  # readable at once, and every read fails (ENOTCONN)
            self.fds.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).detach())
            return self.fds[-1]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        self.ends[(ns, dev)] = ours
        theirs.setblocking(False)
        self.fds.append(theirs.detach())
        return self.fds[-1]

    def _reply(self, message: dict[str, object]) -> None:
        with self._got:
            self.replies.append(message)
            self._got.notify_all()

    def command(self, text: str) -> dict[str, object]:
        """Send one command line (``text``, or a JSON object of it) and wait for its reply."""
        with self._got:
            count = len(self.replies)
            os.write(self._commands_w, text.encode() + b"\n")
            assert self._got.wait_for(lambda: len(self.replies) > count, timeout=5), "no reply"
            return self.replies[count]

    def link(self, **spec: object) -> dict[str, object]:
        return self.command(json.dumps({"a_ns": "home", "a_dev": "eth0", "b_ns": "core", "b_dev": "l1", **spec}))

    def cpu_seconds(self) -> float:
        """CPU time the wire's thread has used (user + system, from /proc)."""
        fields = Path(f"/proc/self/task/{self.thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def cpu_while_idle(self, seconds: float = 0.5) -> float:
        """CPU time the wire's thread uses over the next ``seconds`` (nothing sent meanwhile)."""
        before = self.cpu_seconds()
        time.sleep(seconds)
        return self.cpu_seconds() - before

    def close(self) -> None:
        os.close(self._commands_w)
        self.thread.join(timeout=5)
        assert not self.thread.is_alive(), "the wire did not stop when its command stream ended"
        os.close(self._commands_r)
        for end in self.ends.values():
            end.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):  # closed by the wire already
                os.close(fd)


def receive(end: socket.socket, count: int, timeout: float = 5.0) -> list[tuple[bytes, float]]:
    """``count`` packets from ``end``, each with when it came."""
    got: list[tuple[bytes, float]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        if select.select([end], [], [], 0.05)[0]:
            got.append((end.recv(MAX_PACKET), time.monotonic()))
    return got


@pytest.fixture
def wire() -> Iterator[Wire]:
    w = Wire()
    yield w
    w.close()


def test_the_wire_carries_packets_both_ways_after_the_delay_and_in_order(wire: Wire) -> None:
    reply = wire.link(delay_ms=60)
    assert reply == {"ok": True, "links": 1} and type(reply["links"]) is int
    home, core = wire.ends[("home", "eth0")], wire.ends[("core", "l1")]
    sent = time.monotonic()
    for i in range(20):
        home.send(b"up %d" % i)
    core.send(b"down")
    up, down = receive(core, 20), receive(home, 1)
    assert [p for p, _ in up] == [b"up %d" % i for i in range(20)] and [p for p, _ in down] == [b"down"]
    assert min(t for _, t in up + down) - sent >= 0.06  # nothing early; a packet keeps its bytes whole


def test_each_link_has_its_own_delay_and_a_seeded_loss(wire: Wire) -> None:
    assert wire.link(delay_ms=0, loss_pct=50, seed=3) == {"ok": True, "links": 1}
    assert wire.command(json.dumps({"a_ns": "b", "a_dev": "eth0", "b_ns": "core", "b_dev": "l2",
                                    "delay_ms": 0}))["links"] == 2
    lossy, clean = wire.ends[("home", "eth0")], wire.ends[("b", "eth0")]
    for i in range(200):
        lossy.send(b"%d" % i)
        clean.send(b"%d" % i)
    assert len(receive(wire.ends[("core", "l2")], 200)) == 200
    got = receive(wire.ends[("core", "l1")], 200, timeout=1.0)
    assert 60 < len(got) < 140  # half of them, each direction deciding on its own
    expected = random.Random(random.Random(3).random())  # the a-to-b direction's generator
    assert [p for p, _ in got] == [b"%d" % i for i in range(200) if not expected.random() < 0.5]


@pytest.mark.parametrize("command, error", [
    ("not json", "JSONDecodeError"),
    ("[1, 2]", "AttributeError"),
    ('{"a_ns": "home", "a_dev": "eth0", "b_ns": "core", "b_dev": "l1"}', "KeyError: 'delay_ms'"),
    ('{"a_ns": "home", "a_dev": "eth0", "b_ns": "core", "b_dev": "l1", "delay_ms": -5}', "ConfigError: delay must be >= 0"),
    ('{"a_ns": "home", "a_dev": "eth0", "b_ns": "core", "b_dev": "l1", "delay_ms": 5, "loss_pct": 200}', "ConfigError"),
    ('{"a_ns": "home", "a_dev": "eth0", "b_ns": "core", "b_dev": "l1", "delay_ms": 5, "seed": [1]}', "TypeError"),
    ('{"a_ns": "b", "a_dev": "eth0", "b_ns": "core", "delay_ms": 5}', "KeyError: 'b_dev'"),  # after a_dev opened
])
def test_a_bad_command_is_answered_with_why_and_the_wire_goes_on(wire: Wire, command: str, error: str) -> None:
    assert wire.link(delay_ms=0) == {"ok": True, "links": 1}
    reply = wire.command(command)
    assert reply["ok"] is False and str(reply["error"]).startswith(error)
    wire.ends[("home", "eth0")].send(b"still here")
    assert [p for p, _ in receive(wire.ends[("core", "l1")], 1)] == [b"still here"]
    assert wire.link(delay_ms=0, b_dev="l9")["links"] == 2  # and takes the next link


def test_a_device_that_cannot_be_opened_leaves_no_other_open() -> None:
    wire = Wire(fail={"l1"})
    try:
        assert wire.link(delay_ms=5) == {"ok": False, "error": "OSError: [Errno 19] no device l1"}
        (fd,) = wire.fds  # eth0's, opened first: closed again (a TUN device goes with its fd)
        with pytest.raises(OSError):
            os.fstat(fd)
    finally:
        wire.close()


@requires_root_netns
def test_a_tun_device_opens_inside_its_namespace_and_goes_with_its_fd() -> None:
    ns, home = f"dltest{os.getpid()}", os.readlink("/proc/self/ns/net")
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        fd = open_tun(ns, "wire0")
        try:
            assert subprocess.run(["ip", "-n", ns, "link", "show", "wire0"], capture_output=True).returncode == 0
            assert subprocess.run(["ip", "link", "show", "wire0"], capture_output=True).returncode != 0  # not here
            assert os.readlink("/proc/self/ns/net") == home  # and the process is back home
            assert not os.get_blocking(fd)
            with pytest.raises(BlockingIOError):
                os.read(fd, MAX_PACKET)
        finally:
            os.close(fd)
        assert subprocess.run(["ip", "-n", ns, "link", "show", "wire0"], capture_output=True).returncode != 0
        with pytest.raises(FileNotFoundError):
            open_tun(ns + "-missing", "wire1")
        assert os.readlink("/proc/self/ns/net") == home
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def test_a_link_whose_far_end_is_gone_does_not_stop_the_others(wire: Wire) -> None:
    """A namespace deleted under a link: its device's reads end and its writes fail; the wire drops
    that link's packets, as a cut cable would, and goes on carrying the other links'."""
    wire.link(delay_ms=0)
    wire.link(delay_ms=0, a_ns="b", b_dev="l2")
    wire.ends[("core", "l1")].close()
    for i in range(50):
        wire.ends[("home", "eth0")].send(b"into the void %d" % i)
        wire.ends[("b", "eth0")].send(b"%d" % i)
    assert [p for p, _ in receive(wire.ends[("core", "l2")], 50)] == [b"%d" % i for i in range(50)]
    wire.ends[("core", "l2")].send(b"back")
    assert [p for p, _ in receive(wire.ends[("b", "eth0")], 1)] == [b"back"]
    assert wire.cpu_while_idle() < 0.1  # idle: not spinning on the dead device's reads


def test_an_idle_wire_sleeps(wire: Wire) -> None:
    wire.link(delay_ms=30)
    wire.ends[("home", "eth0")].send(b"one")
    assert len(receive(wire.ends[("core", "l1")], 1)) == 1
    assert wire.cpu_while_idle() < 0.1


def test_a_packet_is_held_the_delay_to_the_millisecond_by_the_wire_s_clock() -> None:
    now = [100.0]
    wire = Wire(clock=lambda: now[0])
    try:
        wire.link(delay_ms=1000)
        wire.ends[("home", "eth0")].send(b"late")
        time.sleep(0.2)  # read by the wire at 100.0
        now[0] = 100.9995  # due at 101.0: a wire that held it 999 ms lets it go here
        assert wire.link(delay_ms=0, a_ns="b", b_dev="l2")["ok"]  # (a command wakes the wire: it looks again)
        assert receive(wire.ends[("core", "l1")], 1, timeout=0.3) == []
        now[0] = 101.0
        assert [p for p, _ in receive(wire.ends[("core", "l1")], 1)] == [b"late"]
    finally:
        now[0] = 1e9
        wire.close()


def test_a_command_that_is_not_utf8_is_answered_and_the_wire_goes_on(wire: Wire) -> None:
    os.write(wire._commands_w, b'{"a_ns": "\xff\xfe"}\n')
    with wire._got:
        assert wire._got.wait_for(lambda: wire.replies, timeout=5), "no reply: the wire died"
    assert wire.replies[0]["ok"] is False and str(wire.replies[0]["error"]).startswith("KeyError")
    assert wire.link(delay_ms=0) == {"ok": True, "links": 1}


def test_a_device_whose_reads_fail_is_dropped_and_sends_nothing() -> None:
    wire = Wire(broken={"l1"})
    try:
        assert wire.link(delay_ms=0)["ok"]
        time.sleep(0.2)
        assert receive(wire.ends[("home", "eth0")], 1, timeout=0.3) == []  # nothing made up from the failed reads
        assert wire.cpu_while_idle() < 0.1  # no longer read
    finally:
        wire.close()


@requires_root_netns
def test_a_namespace_that_cannot_be_entered_or_a_device_that_cannot_be_made_says_why() -> None:
    not_a_netns = "../../../../../proc/self/ns/uts"  # resolves outside /var/run/netns, to no network namespace
    home = os.readlink("/proc/self/ns/net")
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as refused:
        open_tun(not_a_netns, "wire2")
    assert refused.value.errno == errno.EINVAL and refused.value.strerror == f"setns into {not_a_netns}"
    ns = f"dltest{os.getpid()}b"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        with pytest.raises(OSError):  # "lo" is there already, and no TUN device
            open_tun(ns, "lo")
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    assert len(os.listdir("/proc/self/fd")) == fds and os.readlink("/proc/self/ns/net") == home


def test_the_process_answers_each_command_with_one_json_line(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    r, w = os.pipe()
    os.write(w, b"not json\n[1]\n")
    os.close(w)
    with os.fdopen(r) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        main()  # returns once its stdin ends
    out = capsys.readouterr().out
    assert out.endswith("}\n") and out.count("\n") == 2
    first, second = map(json.loads, out.splitlines())
    assert first["ok"] is False and first["error"].startswith("JSONDecodeError")
    assert second == {"ok": False, "error": "AttributeError: 'list' object has no attribute 'get'"}
