"""Small helpers for living with trio's structured concurrency at API edges."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio

#: Most bytes :func:`read_lines` takes from its stream at a time.
LINE_READ_SIZE = 65536


@contextmanager
def unwrap_single_group() -> Iterator[None]:
    """Let a lone error leaving nurseries reach the caller as itself.

    trio wraps everything leaving a nursery in an ExceptionGroup, even the
    caller's own exception from inside an ``async with`` block, and nested
    nurseries nest the groups. A caller of ``Node.open`` should be able to write
    ``except DialError``. Groups of several errors stay groups.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        inner: BaseException = group
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        if inner is group:
            raise
        raise inner from None


@asynccontextmanager
async def beside(job: Callable[[], Awaitable[object]]) -> AsyncIterator[None]:
    """Run ``job`` (a writer beside a reader, say) while the body runs; the first of the two to fail
    ends the other, and the body waits for ``job`` when it ends first.

    A failure of ``job`` reaches the caller as itself, after the body was cancelled. With a bare
    nursery, a job that fails as an *outer* scope cancels the body (a stream reset by the peer whose
    round ended at the same deadline as ours) leaves a ``BaseExceptionGroup`` of the error and
    ``Cancelled``: ``except Exception`` misses it, and once the outer scope took its ``Cancelled``
    the error escaped the round and ended the process (seen in the demo under CI's load). Here the
    outer cancel stays a plain cancel: ``job``'s error then says nothing the cancel did not.
    """
    failed: list[Exception] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            try:
                await job()
            except Exception as e:
                failed.append(e)
                nursery.cancel_scope.cancel()

        nursery.start_soon(run)
        yield
    if failed:
        raise failed[0]


async def finish_quietly(closing: Callable[[], Awaitable[object]], *, timeout: float = 1.0,
                         shield: bool = False) -> None:
    """Run a close/reset on a path that is already failing or done.

    Its own failure says nothing new (the peer is gone, the stream already
    reset), and it must never hang the caller. ``shield`` runs it even while the
    caller is being cancelled (a photo finish's loser, whose winner cancels the
    nursery: a close cut at its first checkpoint leaves a connection nobody
    holds); ``timeout`` still bounds it.
    """
    with trio.CancelScope(shield=shield), trio.move_on_after(timeout):
        try:
            await closing()
        except Exception:
            pass


def start_cancellable(nursery: trio.Nursery, job: Callable[[], Awaitable[object]]) -> trio.CancelScope:
    """Run ``job`` in ``nursery`` under a scope of its own: cancelling the scope stops that job alone
    (a service's background task, ended when the service is removed while the nursery lives on)."""
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await job()

    nursery.start_soon(run)
    return scope


async def cancel_on_sigterm(scope: trio.CancelScope) -> None:
    """Cancel ``scope`` at each SIGTERM (how systemd or a parent stops a command: as Ctrl-C does, its
    cleanup runs, and it exits 0)."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()


class Mutex:
    """A fair lock that costs no task switch when it is free.

    ``trio.Lock`` checkpoints on every acquire: on a data path that takes three
    locks per frame, those switches cost more than the bytes. This one takes a
    free lock synchronously (its holder reaches a checkpoint soon enough: the
    I/O it guards) and parks waiters first come, first served, handing the lock
    straight to the next one on release.
    """

    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters = trio.lowlevel.ParkingLot()

    @property
    def locked(self) -> bool:
        return self._held

    async def __aenter__(self) -> None:
        if not self._held:
            self._held = True
            return
        # Ownership is handed over in __aexit__ before we are woken.
        await self._waiters.park()

    async def __aexit__(self, *exc: object) -> None:
        if self._waiters:
            self._waiters.unpark()
        else:
            self._held = False


async def read_lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    """Lines of a child process's output, as they arrive (the last may lack a newline)."""
    buffer = b""
    while True:
        chunk = await stream.receive_some(LINE_READ_SIZE)
        if not chunk:
            if buffer:
                yield buffer.decode(errors="replace")
            return
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            yield line.decode(errors="replace")
