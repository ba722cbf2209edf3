"""Drive a js-libp2p peer (``interop/js/peer.mjs``) from trio code.

    async with open_js_peer() as js:
        js.peer_id, js.addrs                  # from its "listening" line
        await js.dial("/ip4/127.0.0.1/tcp/N/p2p/12D3...")
        reply = await js.ping(peer_id="12D3...")
        info = await js.identify("12D3...")

Every wait has a deadline (:class:`JsPeerTimeout` past it). A command that the
peer answers with ``{"event": "error"}`` raises :class:`JsPeerCommandError`
carrying that reply. Leaving the block closes the peer's stdin (it then exits by
itself) and kills it if it has not exited a few seconds later.

Node 22 and ``interop/node_modules`` come from ``bash interop/setup.sh``;
:func:`js_unavailable_reason` says why they are not usable (tests skip on it).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

INTEROP_DIR = Path(__file__).resolve().parent
PEER_SCRIPT = INTEROP_DIR / "js" / "peer.mjs"
RELAY_SCRIPT = INTEROP_DIR / "js" / "relay.mjs"
NATPEER_SCRIPT = INTEROP_DIR / "js" / "natpeer.mjs"
NODE_MODULES = INTEROP_DIR / "node_modules"
#: Where setup.sh puts node 22; DEDLOC_NODE22 overrides it.
DEFAULT_NODE = INTEROP_DIR / ".node" / "bin" / "node"
REQUIRED_NODE_MAJOR = 22
#: Packages peer.mjs imports; all must be installed.
REQUIRED_PACKAGES = (
    "libp2p",
    "@libp2p/tcp",
    "@chainsafe/libp2p-noise",
    "@chainsafe/libp2p-yamux",
    "@libp2p/identify",
    "@libp2p/ping",
    "@libp2p/peer-id",
    "@libp2p/peer-record",
    "@libp2p/crypto",
    "@multiformats/multiaddr",
)
MAX_LINE = 1 << 20
STDERR_KEEP = 16 * 1024


class JsPeerError(Exception):
    """The js peer could not be started, died, or said something unparseable."""


class JsPeerTimeout(JsPeerError, TimeoutError):
    """A wait on the js peer ran past its deadline."""


class JsPeerCommandError(JsPeerError):
    """The js peer answered a command with ``{"event": "error", ...}``."""

    def __init__(self, reply: dict[str, Any]):
        self.reply = reply
        self.name = str(reply.get("name", ""))
        self.error = str(reply.get("error", ""))
        super().__init__(f"js {reply.get('cmd')!r} failed: {self.name}: {self.error}")


def node_path() -> Path:
    return Path(os.environ.get("DEDLOC_NODE22") or DEFAULT_NODE)


def js_unavailable_reason() -> str | None:
    """None when node 22 and the js packages are installed, else why not."""
    node = node_path()
    if not node.is_file() or not os.access(node, os.X_OK):
        return f"node {REQUIRED_NODE_MAJOR} not found at {node}: run `bash interop/setup.sh`"
    try:
        out = subprocess.run([str(node), "--version"], capture_output=True, text=True, timeout=20)
        version = out.stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"{node} does not run: {e}"
    if not version.startswith(f"v{REQUIRED_NODE_MAJOR}."):
        return f"{node} is {version or 'unknown'}, need node {REQUIRED_NODE_MAJOR}: run `bash interop/setup.sh`"
    missing = [p for p in REQUIRED_PACKAGES if not (NODE_MODULES / p / "package.json").is_file()]
    if missing:
        return f"js packages missing from {NODE_MODULES} ({', '.join(missing)}): run `bash interop/setup.sh`"
    return None


class JsPeer:
    """A running ``peer.mjs``; create it with :func:`open_js_peer`."""

    def __init__(self, process: trio.Process, default_timeout: float):
        self.process = process
        self.default_timeout = default_timeout
        self.listening: dict[str, Any] = {}
        #: Every line without an "id" (listening, peer:connect, peer:identify, ...), in order.
        self.events: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[str, Any]] = {}
        self._waiting: dict[int, trio.Event] = {}
        self._changed = trio.Event()
        self._closed = False
        self._stderr = bytearray()
        self._send_lock = trio.Lock()

    # --------------------------------------------------------------- properties

    @property
    def peer_id(self) -> str:
        return str(self.listening["peer_id"])

    @property
    def addrs(self) -> list[str]:
        return [str(a) for a in self.listening["addrs"]]

    @property
    def addr(self) -> str:
        """The first listen address, with /p2p/<id>."""
        return self.addrs[0]

    @property
    def stderr_tail(self) -> str:
        return self._stderr.decode(errors="replace")

    # --------------------------------------------------------------- commands

    async def request(self, cmd: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one command, wait for its reply; raise on an error reply or past the deadline."""
        timeout = self.default_timeout if timeout is None else timeout
        rid = next(self._ids)
        done = trio.Event()
        self._waiting[rid] = done
        try:
            await self._send({"cmd": cmd, "id": rid, **args}, timeout)
            with trio.move_on_after(timeout):
                while not done.is_set() and not self._closed:
                    await self._wait_change()
            if rid not in self._replies:
                if self._closed:
                    raise JsPeerError(f"js peer exited before answering {cmd!r}{self._stderr_note()}")
                raise JsPeerTimeout(f"js peer gave no answer to {cmd!r} within {timeout:g}s{self._stderr_note()}")
            reply = self._replies.pop(rid)
        finally:
            self._waiting.pop(rid, None)
        if reply.get("event") == "error":
            raise JsPeerCommandError(reply)
        return reply

    async def dial(self, addr: str, *, timeout: float | None = None) -> dict[str, Any]:
        return await self.request("dial", addr=str(addr), timeout=timeout)

    async def ping(
        self, *, addr: str | None = None, peer_id: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        target = {"addr": str(addr)} if addr is not None else {"peer_id": str(peer_id)}
        return await self.request("ping", timeout=timeout, **target)

    async def hangup(self, peer_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Close every connection js has to ``peer_id``."""
        return await self.request("hangup", peer_id=str(peer_id), timeout=timeout)

    async def identify(self, peer_id: str, *, fresh: bool = True, timeout: float | None = None) -> dict[str, Any]:
        """What js knows of a peer from identify; see peer.mjs for the fields."""
        timeout = self.default_timeout if timeout is None else timeout
        # js bounds its own waits to timeout_ms; leave it time to answer
        return await self.request(
            "identify", peer_id=str(peer_id), fresh=fresh, timeout_ms=int(timeout * 1000 * 0.8), timeout=timeout
        )

    async def peers(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        reply = await self.request("peers", timeout=timeout)
        return list(reply["connections"])

    async def handle_echo(self, protocol: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Serve an echo protocol on the js side (js then sends identify/push)."""
        return await self.request("handle", protocol=protocol, timeout=timeout)

    async def echo(self, peer_id: str, protocol: str, data: str, *, timeout: float | None = None) -> str:
        """Open ``protocol`` to a peer, send ``data``, half-close, return all it sent back."""
        timeout = self.default_timeout if timeout is None else timeout
        reply = await self.request(
            "echo",
            peer_id=str(peer_id),
            protocol=protocol,
            data=data,
            timeout_ms=int(timeout * 1000 * 0.8),
            timeout=timeout,
        )
        return str(reply["data"])

    async def bulk(
        self,
        peer_id: str,
        *,
        send_bytes: int,
        send_seed: bytes,
        recv_bytes: int,
        recv_seed: bytes,
        mode: str = "concurrent",
        protocol: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """js opens a bulk stream (see ``interop/bulk.py``) to a peer as the client.

        It sends ``send_bytes`` of keystream(send_seed), half-closes, asks for
        ``recv_bytes`` of keystream(recv_seed) back and reads to EOF; the reply
        has both sha256s, the byte counts and the server's trailer.
        """
        timeout = self.default_timeout if timeout is None else timeout
        args: dict[str, Any] = {
            "peer_id": str(peer_id),
            "send_bytes": send_bytes,
            "send_seed": send_seed.hex(),
            "recv_bytes": recv_bytes,
            "recv_seed": recv_seed.hex(),
            "mode": mode,
            "timeout_ms": int(timeout * 1000 * 0.8),
        }
        if protocol is not None:
            args["protocol"] = protocol
        return await self.request("bulk", timeout=timeout, **args)

    async def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], *, timeout: float | None = None, start: int = 0
    ) -> dict[str, Any]:
        """The first unsolicited event (from index ``start``) for which ``predicate`` holds."""
        timeout = self.default_timeout if timeout is None else timeout
        with trio.move_on_after(timeout):
            seen = start
            while True:
                while seen < len(self.events):
                    if predicate(self.events[seen]):
                        return self.events[seen]
                    seen += 1
                if self._closed:
                    raise JsPeerError(f"js peer exited while waiting for an event{self._stderr_note()}")
                await self._wait_change()
        raise JsPeerTimeout(f"no matching js event within {timeout:g}s{self._stderr_note()}")

    # --------------------------------------------------------------- internals

    async def _send(self, obj: dict[str, Any], timeout: float) -> None:
        if self._closed or self.process.stdin is None:
            raise JsPeerError(f"js peer has exited{self._stderr_note()}")
        data = (json.dumps(obj) + "\n").encode()
        try:
            with trio.fail_after(timeout):
                async with self._send_lock:
                    await self.process.stdin.send_all(data)
        except trio.TooSlowError:
            raise JsPeerTimeout(f"js peer did not take a command within {timeout:g}s") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise JsPeerError(f"js peer's stdin is closed{self._stderr_note()}") from e

    async def _wait_change(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _on_line(self, line: bytes) -> None:
        line = line.strip()
        if not line:
            return
        try:
            msg = json.loads(line)
        except ValueError:
            msg = {"event": "unparsed", "line": line.decode(errors="replace")}
        if not isinstance(msg, dict):
            msg = {"event": "unparsed", "line": line.decode(errors="replace")}
        rid = msg.get("id")
        if isinstance(rid, int) and rid in self._waiting:
            self._replies[rid] = msg
            self._waiting[rid].set()
        else:
            if msg.get("event") == "listening" and not self.listening:
                self.listening = msg
            self.events.append(msg)
        self._notify()

    async def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        buf = bytearray()
        try:
            while True:
                chunk = await self.process.stdout.receive_some(65536)
                if not chunk:
                    break
                buf += chunk
                while (nl := buf.find(b"\n")) >= 0:
                    self._on_line(bytes(buf[:nl]))
                    del buf[: nl + 1]
                if len(buf) > MAX_LINE:
                    self._on_line(bytes(buf))
                    buf.clear()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if buf:
                self._on_line(bytes(buf))
            self._closed = True
            self._notify()

    async def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        try:
            while True:
                chunk = await self.process.stderr.receive_some(65536)
                if not chunk:
                    return
                self._stderr += chunk
                if len(self._stderr) > STDERR_KEEP:
                    del self._stderr[: len(self._stderr) - STDERR_KEEP]
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _stderr_note(self) -> str:
        tail = self.stderr_tail.strip()
        code = self.process.returncode
        note = f" (exit code {code})" if code is not None else ""
        return f"{note}; stderr:\n{tail[-2000:]}" if tail else note


@asynccontextmanager
async def open_js_peer(
    *,
    start_timeout: float = 30.0,
    default_timeout: float = 15.0,
    exit_timeout: float = 5.0,
    env: dict[str, str] | None = None,
    spawn: Callable[..., Awaitable[trio.Process]] = trio.lowlevel.open_process,
    script: Path | None = None,
    argv: Sequence[str] = (),
) -> AsyncIterator[JsPeer]:
    """Start ``peer.mjs`` under node 22, wait for its listening line, stop it on exit.

    ``spawn``: how to start it (a lab ``Host.spawn`` runs it in that host's namespace,
    where it listens on the namespace's own loopback and dials the lab's addresses).
    ``script`` and ``argv``: another script that speaks the same lines (``natpeer.mjs``).
    """
    reason = js_unavailable_reason()
    if reason is not None:
        raise JsPeerError(reason)
    child_env = {**os.environ, **(env or {})}
    child_env.pop("NODE_OPTIONS", None)
    process = await spawn(
        [str(node_path()), str(script or PEER_SCRIPT), *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(INTEROP_DIR),
        env=child_env,
    )
    peer = JsPeer(process, default_timeout)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer._read_stdout)
            nursery.start_soon(peer._read_stderr)
            try:
                await peer.wait_event(lambda e: e.get("event") in ("listening", "fatal"), timeout=start_timeout)
                if not peer.listening:
                    raise JsPeerError(f"js peer failed to start: {peer.events[-1]}{peer._stderr_note()}")
                yield peer
            finally:
                with trio.CancelScope(shield=True):
                    await _stop(process, exit_timeout)
                nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:  # only if something above failed before _stop
            with trio.CancelScope(shield=True):
                await _stop(process, exit_timeout)


async def _stop(process: trio.Process, exit_timeout: float) -> None:
    """Close stdin (peer.mjs exits on EOF), then kill after ``exit_timeout``."""
    if process.stdin is not None:
        try:
            await process.stdin.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    with trio.move_on_after(exit_timeout):
        await process.wait()
    if process.returncode is None:
        process.kill()
        with trio.move_on_after(max(1.0, min(exit_timeout, 5.0))):
            await process.wait()


# ---------------------------------------------------------------------- relay.mjs

STDERR_KEEP = 16 * 1024


class JsRelay:
    """A running ``relay.mjs``: its listening line, its later events, a ``stats`` command."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.listening: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.stderr = bytearray()
        self._changed = trio.Event()

    @property
    def peer_id(self) -> str:
        return str(self.listening["peer_id"])

    async def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        buffer = b""
        while True:  # always drained: node writes to a pipe synchronously and would stall on a full one
            chunk = await self.process.stdout.receive_some(65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                event = dict(json.loads(line))
                if event.get("event") == "listening":
                    self.listening = event
                self.events.append(event)
                self._changed.set()
        self._changed.set()

    async def _read_stderr(self) -> None:
        if self.process.stderr is None:
            return
        while chunk := await self.process.stderr.receive_some(65536):
            self.stderr += chunk
            del self.stderr[:-STDERR_KEEP]

    async def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        seen = len(self.events)
        with trio.fail_after(timeout):
            while True:
                for event in self.events[seen:]:
                    if event.get("event") in (name, "fatal"):
                        if event["event"] == "fatal":
                            raise RuntimeError(f"js relay failed: {event} {self.stderr[-2000:].decode(errors='replace')}")
                        return event
                seen = len(self.events)
                if self.process.returncode is not None or self.process.poll() is not None:
                    raise RuntimeError(f"js relay exited ({self.process.returncode}): "
                                       f"{self.stderr[-2000:].decode(errors='replace')}")
                self._changed = trio.Event()
                with trio.move_on_after(0.5):
                    await self._changed.wait()

    async def stats(self, timeout: float = 10) -> dict[str, Any]:
        assert self.process.stdin is not None
        waiter = trio.Event()
        result: dict[str, Any] = {}

        async def wait() -> None:
            result.update(await self.wait_event("stats", timeout))
            waiter.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(0)
            await self.process.stdin.send_all(b'{"cmd":"stats"}\n')
        return result


@asynccontextmanager
async def open_js_relay(
    spawn: Callable[..., Awaitable[trio.Process]], argv: list[str], *, start_timeout: float = 60
) -> AsyncIterator[JsRelay]:
    """Start relay.mjs with ``spawn`` (``trio.lowlevel.open_process`` or ``Host.spawn``); stop it on exit."""
    env = dict(os.environ)
    env.pop("NODE_OPTIONS", None)
    process = await spawn(
        [str(node_path()), str(RELAY_SCRIPT), *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(INTEROP_DIR),
        env=env,
    )
    relay = JsRelay(process)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay._read_stdout)
            nursery.start_soon(relay._read_stderr)
            try:
                await relay.wait_event("listening", start_timeout)
                yield relay
            finally:
                with trio.CancelScope(shield=True):
                    assert process.stdin is not None
                    try:
                        await process.stdin.aclose()  # relay.mjs exits on EOF
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                    with trio.move_on_after(5):
                        await process.wait()
                nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await process.wait()
