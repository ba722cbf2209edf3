"""What a command prints: events as human lines or JSON lines (``docs/CLI.md``), written without ever blocking
the node (:class:`Output`), and the human form of each event (:func:`human`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from . import events as ev


#: Lines that may wait unwritten while the output is not read, before new ones are dropped.
MAX_QUEUED_LINES = 10_000
#: How long a command's last lines may take to be written once it ends.
FLUSH_TIMEOUT = 5.0


class Output:
    """Writes events as JSON lines or as short human-readable lines.

    While a command runs (:meth:`writing`), lines are queued and one task writes them
    through a worker thread: a reader that stops reading (a full pipe, a terminal
    paused with Ctrl-S) stalls that thread, never the node. A relay whose output
    nobody read used to freeze on a full pipe (docs/FLOOD.md). Beyond
    :data:`MAX_QUEUED_LINES` unwritten lines, new ones are dropped and counted
    (:attr:`dropped`), and the count is written as soon as the output moves again.
    Outside :meth:`writing` (errors before or after the run) a line is written at once.
    """

    def __init__(self, json_mode: bool, stream: Any = None, *, max_queued: int = MAX_QUEUED_LINES):
        self.json_mode = json_mode
        self.stream = stream or sys.stdout
        self.max_queued = max_queued
        #: Lines dropped because the output was not read (in all).
        self.dropped = 0
        self._unreported = 0
        self._queue: deque[str] | None = None
        self._queued = trio.Event()
        self._writing = False  # a batch is in the worker thread
        self._closed = False  # the reader is gone: nothing more is written

    def event(self, event: ev.Event) -> None:
        if self.json_mode:
            self._line(event.to_json())
        else:
            text = human(event)
            if text:
                self._line(text)

    def info(self, text: str, **fields: Any) -> None:
        """A one-off result (``dedloc id``): prose for people, an object for scripts."""
        self._line(json.dumps(fields) if self.json_mode else text)

    def _line(self, text: str) -> None:
        if self._queue is None:
            print(text, file=self.stream, flush=True)
        elif self._closed:
            self.dropped += 1
        elif len(self._queue) >= self.max_queued:
            self.dropped += 1
            self._unreported += 1
        else:
            self._queue.append(text)
            self._queued.set()

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """Queue lines while the block runs, written by a task of their own; at the end,
        what is left gets :data:`FLUSH_TIMEOUT` seconds to be written."""
        self._queue = deque()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop)
                try:
                    yield
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(FLUSH_TIMEOUT):
                        while not self._closed and (self._queue or self._unreported or self._writing):
                            await trio.sleep(0.01)
                    nursery.cancel_scope.cancel()
        finally:
            self._queue = None

    async def _write_loop(self) -> None:
        assert self._queue is not None
        queue = self._queue
        while True:
            await self._queued.wait()
            self._queued = trio.Event()
            lines = list(queue)
            queue.clear()
            if self._unreported:
                notice = ev.Error(message=f"{self._unreported} output line(s) dropped: the output was not read")
                lines.append(notice.to_json() if self.json_mode else human(notice))
                self._unreported = 0
            if not lines:
                continue
            self._writing = True
            try:
                # the one thread of the CLI: a blocked write must not block the loop
                await trio.to_thread.run_sync(  # type: ignore[call-arg]  # (trio-typing's stubs, via libp2p, are older)
                    self._write_blocking, "\n".join(lines) + "\n", abandon_on_cancel=True)
            except OSError as e:  # the reader is gone (a closed pipe): the node goes on without output
                logging.getLogger(__name__).warning("the output is closed (%s): events are no longer printed", e)
                self.dropped += len(lines)
                self._close_output()
                return
            finally:
                self._writing = False
            # lines queued meanwhile set the event we wait on next (and a drop only ever follows one)

    def _write_blocking(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _close_output(self) -> None:
        """Stop writing; later lines are dropped. Python's own flush of stdout at exit would
        fail on the closed pipe too: stdout then points at /dev/null (the ``signal``
        module's advice for SIGPIPE)."""
        assert self._queue is not None
        self._closed = True
        self.dropped += len(self._queue)
        self._queue.clear()
        if self.stream is sys.stdout:
            with contextlib.suppress(OSError, ValueError):  # a stdout with no descriptor: nothing to point
                fd = sys.stdout.fileno()
                devnull = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(devnull, fd)
                finally:
                    os.close(devnull)


def human(event: ev.Event) -> str:
    match event:
        case ev.Listening(peer_id=pid, addrs=addrs):
            if not addrs:
                return f"peer id {pid}\nno direct address (not listening): others reach this node through a relay slot"
            lines = [f"peer id {pid}", "listening on (give one of these to others):"]
            lines += [f"  {a}" for a in addrs]
            return "\n".join(lines)
        case ev.PeerConnected(peer_id=pid, addr=addr, elapsed=t):
            return f"connected to {_short(pid)} at {addr} in {t * 1e3:.1f} ms"
        case ev.ConnectionOpened(peer_id=pid, direction=d, kind=k, addr=addr):
            return f"+ {d} {k} connection {_short(pid)} {addr}"
        case ev.ConnectionClosed(peer_id=pid, kind=k):
            return f"- {k} connection closed {_short(pid)}"
        case ev.Ping(peer_id=pid, rtt_ms=rtt, kind=kind):
            return f"ping {_short(pid)}: {rtt:.2f} ms" + (f" ({kind})" if kind else "")
        case ev.Message(peer_id=pid, text=text):
            return f"message from {_short(pid)}: {text}"
        case ev.PeerCount(count=n, peers=peers):
            return f"serving {n} peer{'s' if n != 1 else ''}" + (f": {', '.join(map(_short, peers))}" if peers else "")
        case ev.Error(message=msg):
            return f"error: {msg}"
        case ev.Closed():
            return "node stopped"
    # Events of the layers above: their own line, else a generic one.
    own = event.human()
    if own is not None:
        return own
    fields = {k: v for k, v in event.to_dict().items() if k not in ("event", "ts")}
    if event.event == "nat_status":
        m = fields["metrics"]
        return (
            f"nat: {m.get('mode')}, reachability {m.get('reachability')}, mapping {m.get('mapping')}, "
            f"{m.get('reservations')} relay slot(s), punches {m.get('punch_successes')}/{m.get('punch_attempts')}"
        )
    return f"{event.event.replace('_', ' ')}: " + ", ".join(f"{k}={_value(v)}" for k, v in fields.items()
                                                            if v not in (None, []))


def _value(v: object) -> str:
    """A field as a person reads it: 0.0021022979999543168 s is 0.0021."""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _short(pid: object) -> str:
    return f"…{str(pid)[-8:]}" if pid else "?"


# ---------------------------------------------------------------------- commands
