"""p2p.trio_util's helpers, on trio's MockClock (deterministic, no sockets)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2p.trio_util import beside


class Reset(Exception):
    """Stands for a transport error (a stream reset) raised by a writer."""


async def test_a_job_failing_as_an_outer_scope_cancels_leaves_a_plain_cancel(
        autojump_clock: trio.testing.MockClock) -> None:
    """The job turns the outer cancel into its own error (a write whose stream the peer reset at the
    same deadline): the outer scope still catches a plain cancel, and nothing escapes it."""
    async def job() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            raise Reset("reset at the same deadline") from None

    with trio.move_on_after(3) as scope:
        async with beside(job):
            await trio.sleep_forever()
    assert scope.cancelled_caught


async def test_a_failing_job_ends_the_body_and_reaches_the_caller_as_itself(
        autojump_clock: trio.testing.MockClock) -> None:
    body_cancelled = []

    async def job() -> None:
        await trio.sleep(1)
        raise Reset("the writer failed")

    with pytest.raises(Reset, match="the writer failed"):
        async with beside(job):
            try:
                await trio.sleep(10)
            except trio.Cancelled:
                body_cancelled.append(trio.current_time())
                raise
    assert body_cancelled == [pytest.approx(1.0)]


async def test_the_body_ending_first_waits_for_the_job(autojump_clock: trio.testing.MockClock) -> None:
    done = []

    async def job() -> None:
        await trio.sleep(5)
        done.append(trio.current_time())

    async with beside(job):
        await trio.sleep(1)
    assert done == [pytest.approx(5.0)]


async def test_an_error_of_the_body_reaches_the_caller_in_a_group(autojump_clock: trio.testing.MockClock) -> None:
    """As a nursery's would: ``except Exception`` catches it (an ExceptionGroup is one)."""
    async def job() -> None:
        await trio.sleep_forever()

    with pytest.raises(ExceptionGroup) as caught:
        async with beside(job):
            raise Reset("the reader failed")
    assert caught.group_contains(Reset)
