"""A userspace wire for the NAT lab: one-way delay and loss on kernels without ``tc netem``.

CI's kernel, like this one, has no ``sch_netem``, and a lab at zero delay hides
every round trip a handshake costs. So where netem is missing the lab builds a
delayed access link as two TUN devices, one in each namespace (named as the veth
ends would be: ``eth0``/``wan`` on the far side, ``l<i>`` in the core), and this
module's process moves the packets between them: every packet read from one
device is written to the other ``delay_ms`` later, unless it is dropped (each
direction drops ``loss_pct`` percent of its packets, independently). Per
direction the delay is constant, so a FIFO per direction keeps the order and no
packet overtakes another (netem's default too). ``tc tbf`` still shapes the TUN
devices where a link has a rate, so shaping and delay combine as with netem.

:class:`DelayLine` is the pure core (sans-I/O: packets and times in, packets
out), tested with a fake clock; :func:`serve` is the I/O edge: one process per
lab, started with ``python -m nat.delay_line``, one JSON command per line on
stdin (``{"a_ns": ..., "a_dev": ..., "b_ns": ..., "b_dev": ..., "delay_ms": ...,
"loss_pct": ..., "seed": ...}``), one JSON reply per line on stdout. It opens each
TUN device inside its namespace (``setns``), so the lab's root namespace never
holds one; the devices are not persistent, so they vanish with the process.
A plain ``selectors`` loop: the process does nothing else, and one process for
every link of a lab costs one core at most (a Python hop is ~10 µs a packet,
plenty for the lab's 10-100 Mbit links; a bulk benchmark that needs more uses
zero delay, i.e. plain veth, as the averaging lab does).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import random
import selectors
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from p2p.errors import ConfigError

#: netem's own default limit is 1000 packets; the lab raised it to 100000 so bulk transfers over a
#: delayed link are not capped by the queue: the same here (about 150 MB of full-size packets)
QUEUE_LIMIT = 100_000
#: the largest packet a TUN device hands us (its MTU is 1500; room for a larger one set by hand)
MAX_PACKET = 65_536

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000


@dataclass
class DelayLine:
    """One direction of a link: packets leave ``delay`` seconds after they came, ``loss`` of them never.

    ``loss`` is a probability (0..1); ``rng`` decides which packets are lost (seed it for a
    repeatable run). A full queue drops the newcomer (``overflowed`` counts them).
    """

    delay: float
    loss: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    limit: int = QUEUE_LIMIT
    passed: int = 0
    lost: int = 0
    overflowed: int = 0
    _queue: deque[tuple[float, bytes]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.delay < 0 or not 0.0 <= self.loss <= 1.0:
            raise ConfigError(f"delay must be >= 0 and loss in [0, 1], not {self.delay}, {self.loss}")

    def push(self, packet: bytes, now: float) -> bool:
        """A packet entered the line at ``now``; False when it is lost or the queue is full."""
        if self.loss and self.rng.random() < self.loss:
            self.lost += 1
            return False
        if len(self._queue) >= self.limit:
            self.overflowed += 1
            return False
        self._queue.append((now + self.delay, packet))
        return True

    def due(self, now: float) -> list[bytes]:
        """The packets whose time has come, in the order they entered."""
        out = []
        while self._queue and self._queue[0][0] <= now:
            out.append(self._queue.popleft()[1])
        self.passed += len(out)
        return out

    def next_deadline(self) -> float | None:
        """When the next packet is due (None: the line is empty)."""
        return self._queue[0][0] if self._queue else None

    def __len__(self) -> int:
        return len(self._queue)


# ---------------------------------------------------------------------------------- the process


def open_tun(netns: str, name: str) -> int:
    """A new TUN device ``name`` inside network namespace ``netns`` (by its /var/run/netns name); its fd.

    The device lives in the namespace the process is in when it is created; the fd works from
    anywhere. Non-blocking, without the packet-information header (plain IP packets).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
            except BaseException:
                os.close(fd)
                raise
        finally:
            if libc.setns(home, _CLONE_NEWNET) != 0:  # pragma: no cover - cannot fail for our own ns
                raise OSError(ctypes.get_errno(), "setns back home")
        return fd
    finally:
        os.close(target)
        os.close(home)


@dataclass
class _Direction:
    source: int
    sink: int
    line: DelayLine


def serve(command_fd: int, reply: Callable[[dict[str, object]], None],
          clock: Callable[[], float] = time.monotonic, open_device: Callable[[str, str], int] = open_tun) -> None:
    """Run the wire until the command stream ends: add links as commands come, move packets between.

    ``open_device(netns, name)``: a packet device's fd, non-blocking, one packet per read and write
    (:func:`open_tun`; a test's is one end of a ``SOCK_SEQPACKET`` pair)."""
    selector = selectors.DefaultSelector()
    selector.register(command_fd, selectors.EVENT_READ, None)
    directions: list[_Direction] = []
    pending = b""
    while True:
        deadlines = [d for d in (x.line.next_deadline() for x in directions) if d is not None]
        timeout = max(0.0, min(deadlines) - clock()) if deadlines else None
        for key, _ in selector.select(timeout):
            if key.data is None:
                chunk = os.read(command_fd, 65536)
                if not chunk:  # the lab closed our stdin (or died): the links go with us
                    return
                *commands, pending = (pending + chunk).split(b"\n")
                for command in commands:
                    if command.strip():
                        reply(_add_link(command.decode(errors="replace"), selector, directions, open_device))
                continue
            direction: _Direction = key.data
            now = clock()
            for _ in range(256):  # a burst at a time, so one busy link cannot starve the others
                try:
                    packet = os.read(direction.source, MAX_PACKET)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # the device went away (its namespace was deleted): stop reading it
                    packet = b""
                if not packet:  # (no packet is empty: an empty read is an end too)
                    selector.unregister(direction.source)
                    break
                direction.line.push(packet, now)
        now = clock()
        for direction in directions:
            for packet in direction.line.due(now):
                with contextlib.suppress(OSError):  # the device is full or gone: the packet is lost, as on a wire
                    os.write(direction.sink, packet)


def _add_link(command: str, selector: selectors.BaseSelector, directions: list[_Direction],
              open_device: Callable[[str, str], int]) -> dict[str, object]:
    """One command: a link's two directions, or why not (a bad command leaves the wire as it was)."""
    opened: list[int] = []
    try:
        spec = json.loads(command)
        rng = random.Random(spec.get("seed"))
        delay = float(spec["delay_ms"]) / 1000
        loss = float(spec.get("loss_pct", 0.0)) / 100
        lines = [DelayLine(delay, loss, random.Random(rng.random())) for _ in range(2)]
        for ns, dev in (("a_ns", "a_dev"), ("b_ns", "b_dev")):
            opened.append(open_device(str(spec[ns]), str(spec[dev])))
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:  # AttributeError: JSON not an object
        for fd in opened:  # a device opened before the other failed: gone with its fd
            os.close(fd)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    a, b = opened
    for (source, sink), line in zip(((a, b), (b, a)), lines):
        direction = _Direction(source, sink, line)
        directions.append(direction)
        selector.register(source, selectors.EVENT_READ, direction)
    return {"ok": True, "links": len(directions) // 2}


def main() -> None:
    """``python -m nat.delay_line``: the lab's wire process (see the module docstring)."""
    def reply(message: dict[str, object]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    serve(sys.stdin.fileno(), reply)


if __name__ == "__main__":
    main()
