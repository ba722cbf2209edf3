"""The test kit: what several test files need, once (waiting, reading, pipes, composed peers).

Real parts only: the peers are real :class:`nat.Peer` objects on loopback, the
pipes trio's in-memory streams.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, TypeVar

import pytest
import trio
import trio.testing
from libp2p.peer.id import ID

from nat import Peer, PeerConfig
from nat.lab import netns_unavailable_reason
from p2p.identity import new_identity, peer_id_of

T = TypeVar("T")


async def wait_until(predicate: Callable[[], T], timeout: float = 20.0, *, interval: float = 0.02,
                     what: str = "") -> T:
    """Poll ``predicate`` until it returns something truthy, and return that;
    :class:`trio.TooSlowError`, naming ``what``, after ``timeout`` seconds."""
    with trio.move_on_after(timeout):
        while True:
            value = predicate()
            if value:
                return value
            await trio.sleep(interval)
    raise trio.TooSlowError(f"timed out after {timeout:g} s waiting for {what or 'the condition'}")


async def all_at_once(calls: Sequence[Callable[[], Awaitable[T]]],
                      caught: tuple[type[BaseException], ...] = ()) -> list[T | BaseException]:
    """Each call's result, all run at once in one nursery, in the calls' order; an error of a ``caught``
    kind takes its call's place (any other ends them all)."""
    out: list[T | BaseException] = [RuntimeError("not run")] * len(calls)

    async def one(i: int) -> None:
        try:
            out[i] = await calls[i]()
        except caught as e:
            out[i] = e

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i)
    return out


def stat_of(pid: int) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command's name (state, parent pid, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    stat = stat_of(pid)
    return stat is not None and stat[0] != "Z"


def record_events(node: Any) -> list[Any]:
    """Every event ``node`` emits from now on, appended as it is emitted.

    A subscriber's channel (:meth:`p2p.Node.events`) hands an event over a moment after the
    state change it reports, so a test that waited for the state and then read the channel's
    events could miss the last one on a loaded machine; this list is never behind the state.
    """
    seen: list[Any] = []
    emit = node.emit

    def recording(event: Any) -> None:
        seen.append(event)
        emit(event)

    node.emit = recording
    return seen


def without_auto_identify(node: Any) -> None:
    """Stop py-libp2p's host from identifying peers by itself (it does on every new connection,
    in a task of its own): a test that needs the state before identify (a peer's addresses
    not yet known) calls :meth:`p2p.Node.identify` when it wants them known, instead of
    racing that task, which on a fast machine told them before the test looked."""
    node.host._schedule_identify = lambda *args, **kwargs: None


class Readable(Protocol):
    async def read(self, n: int | None = None) -> bytes: ...


async def read_to_end(stream: Readable, chunk: int = 1 << 16, *, check: Callable[[], None] | None = None) -> bytes:
    """Everything a stream (libp2p's or a Yamux one) delivers until its end (EOF or an empty
    read); ``check``, where given, runs after every read (an invariant that must hold throughout)."""
    data = bytearray()
    while True:
        try:
            part = await stream.read(chunk)
        except EOFError:
            break
        if not part:
            break
        data += part
        if check is not None:
            check()
    return bytes(data)


async def http_get(address: tuple[str, int], path: str, *, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on its own connection: (status, headers by lower-case name, body)."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(f"{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
        data = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def pipe() -> tuple[trio.testing.MemoryStapledStream, trio.testing.MemoryStapledStream]:  # type: ignore[name-defined]
    """Two ends of an in-memory byte stream (for sans-I/O cores driven through trio streams)."""
    return trio.testing.memory_stream_pair()


def loopback_peer_config(*, relay: bool = False, initial_peers: list[str] | None = None, **nat: Any) -> PeerConfig:
    """A :class:`PeerConfig` for loopback tests: :meth:`PeerConfig.loopback`."""
    return PeerConfig.loopback(relay=relay, initial_peers=initial_peers or [], **nat)


@asynccontextmanager
async def open_peers(n: int) -> AsyncIterator[list[Peer]]:
    """A relay/bootstrap :class:`Peer` and ``n`` peers that joined through it, all on loopback."""
    async with AsyncExitStack() as stack:
        relay = await stack.enter_async_context(Peer.open(loopback_peer_config(relay=True)))
        boot = [str(relay.addrs[0])]
        peers = [await stack.enter_async_context(Peer.open(loopback_peer_config(initial_peers=boot))) for _ in range(n)]
        yield [relay, *peers]


async def collect_events(proc: trio.Process, kinds: Sequence[str], into: list[dict[str, Any]]) -> None:
    """The JSON event lines of ``kinds`` a child prints, appended to ``into``, until it exits."""
    from p2p.trio_util import read_lines

    assert proc.stdout is not None
    async for line in read_lines(proc.stdout):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") in kinds:
            into.append(event)
    await proc.wait()


class ProcessLines:
    """A blocking child's stdout, read by a thread from the start (so nothing is lost to a partial read):
    wait for an event line by polling with a deadline, then take the whole output at the end."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        self.lines: list[str] = []
        self._changed = threading.Condition()
        stdout = process.stdout

        def read() -> None:
            for line in stdout:
                with self._changed:
                    self.lines.append(line)
                    self._changed.notify_all()

        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()

    def events(self) -> list[dict[str, Any]]:
        with self._changed:
            lines = list(self.lines)
        return [json.loads(line) for line in lines if line.startswith("{")]

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> bool:
        """Whether an event line satisfying ``predicate`` came within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not any(predicate(e) for e in self.events()):
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return any(predicate(e) for e in self.events())
                self._changed.wait(min(left, 1.0))
        return True

    def join(self, timeout: float) -> str:
        """All of stdout, once the child closed it (within ``timeout`` s)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the child's stdout still open after {timeout} s")
        return "".join(self.lines)


#: set to 1 (CI does) to fail the namespace tests where the lab is unusable, instead of skipping them
NETLAB_REQUIRED_ENV = "DEDLOC_NETLAB_REQUIRED"

requires_root_netns: pytest.MarkDecorator = pytest.mark.skipif(
    netns_unavailable_reason() is not None and os.environ.get(NETLAB_REQUIRED_ENV, "") in ("", "0"),
    reason=f"netlab: {netns_unavailable_reason()}",
)
"""Skip (with the reason) where namespaces/nftables are unusable; fail instead when DEDLOC_NETLAB_REQUIRED=1."""


def readme_example(marker: str, relay_addr: str) -> str:
    """The README's python example after ``<!-- marker -->``, its ``RELAY = "..."`` line set to ``relay_addr``."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split(f"<!-- {marker} -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    code, n = re.subn(r'^RELAY = ".*"$', f"RELAY = {relay_addr!r}", block, flags=re.M)
    assert n == 1, f"the README's {marker} no longer has a RELAY line"
    return code


def closed_port() -> int:
    """A loopback TCP port nothing listens on now (bound and let go): a dial there is refused at once,
    and a listener started later may take it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def random_peer_id() -> ID:
    """A fresh peer id whose key is made and dropped here: a peer nobody runs."""
    return peer_id_of(new_identity())


def numbered_peer_id(n: int) -> ID:
    """Peer id number ``n``: the same for the same ``n``, ordered as ``n`` (an identity multihash of
    ``n``'s 32 bytes), for tests that name peers without keys."""
    return ID(bytes([0, 36, 8, 1, 18, 32]) + n.to_bytes(32, "big"))


class End:
    """One end of an in-memory stream, shaped as py-libp2p's INetStream with ``peer`` at the far end; it
    records how it was finished, and a write may fail as a refused lazy negotiation does."""

    def __init__(self, stream: trio.StapledStream, peer: ID) -> None:
        self._stream = stream
        self.muxed_conn = SimpleNamespace(peer_id=peer)
        #: every close and reset called, in order
        self.how: list[str] = []
        #: the sizes reads asked for
        self.asked: list[int | None] = []
        self.refuse: BaseException | None = None
        self.broken: BaseException | None = None

    @property
    def finished(self) -> str:
        """How the stream was first finished ("closed", "reset"), or "" while it is open."""
        return self.how[0] if self.how else ""

    async def read(self, n: int | None = None) -> bytes:
        self.asked.append(n)
        if self.broken is not None:
            raise self.broken
        return bytes(await self._stream.receive_some(n))

    async def write(self, data: bytes) -> None:
        if self.refuse is not None:
            raise self.refuse
        await self._stream.send_all(data)

    async def close(self) -> None:
        self.how.append("closed")
        await self._stream.send_stream.aclose()

    async def reset(self) -> None:
        self.how.append("reset")
        await self._stream.aclose()


def ends(a: ID, b: ID, *, lockstep: bool = False) -> tuple[End, End]:
    """``a``'s end (its far end is ``b``) and ``b``'s; ``lockstep``: a write waits for the reader."""
    x, y = trio.testing.lockstep_stream_pair() if lockstep else trio.testing.memory_stream_pair()
    return End(x, b), End(y, a)


def log_lines(caplog: pytest.LogCaptureFixture, logger: str, start: str) -> list[str]:
    """``logger``'s captured lines that begin with ``start``, each formatted (a wrong count of arguments
    raises here, as it would only print a traceback in a real log)."""
    return [r.getMessage() for r in caplog.records if r.name == logger and r.getMessage().startswith(start)]
