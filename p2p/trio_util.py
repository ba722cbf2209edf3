"""Small helpers for living with trio's structured concurrency at API edges."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


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
