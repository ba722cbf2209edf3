"""p2p.trio_util's helpers, on trio's MockClock (deterministic, no sockets)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2p.trio_util import beside, finish_quietly


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


# ---------------------------------------------------------------------- finish_quietly


async def test_finish_quietly_swallows_the_close_s_own_error(autojump_clock: trio.testing.MockClock) -> None:
    async def closing() -> None:
        raise Reset("already reset")

    await finish_quietly(closing)  # nothing escapes


async def test_finish_quietly_gives_up_after_its_timeout(autojump_clock: trio.testing.MockClock) -> None:
    started = trio.current_time()
    await finish_quietly(trio.sleep_forever, timeout=2.5)
    assert trio.current_time() - started == pytest.approx(2.5)


@pytest.mark.parametrize("shield", [True, False])
async def test_only_a_shielded_finish_completes_while_its_caller_is_cancelled(
        shield: bool, autojump_clock: trio.testing.MockClock) -> None:
    """A photo finish's loser closes its connection as the winner cancels the nursery: shielded, the
    close (one checkpoint long) still runs to its end and the cancel lands after it; unshielded, the
    cancel cuts it at once."""
    done = []

    async def closing() -> None:
        await trio.sleep(0.5)
        done.append(True)

    with trio.CancelScope() as scope:
        scope.cancel()
        await finish_quietly(closing, shield=shield)
        await trio.sleep(0)  # an unshielded finish was cut already; a shielded one meets its cancel here
    assert done == ([True] if shield else []) and scope.cancelled_caught


async def test_a_shielded_finish_is_still_bounded_by_its_timeout(autojump_clock: trio.testing.MockClock) -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        started = trio.current_time()
        await finish_quietly(trio.sleep_forever, timeout=3, shield=True)
        assert trio.current_time() - started == pytest.approx(3)
        await trio.sleep(0)
    assert scope.cancelled_caught
