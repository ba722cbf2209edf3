"""Small helpers for living with trio's structured concurrency at API edges."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import trio


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


async def finish_quietly(closing: Callable[[], Awaitable[object]], *, timeout: float = 1.0) -> None:
    """Run a close/reset on a path that is already failing or done.

    Its own failure says nothing new (the peer is gone, the stream already
    reset), and it must never hang the caller.
    """
    with trio.move_on_after(timeout):
        try:
            await closing()
        except Exception:
            pass
