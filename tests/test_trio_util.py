"""p2p.trio_util's helpers, on trio's MockClock (deterministic, no sockets)."""

from __future__ import annotations

import os
import signal
from typing import cast

import pytest
import trio
import trio.testing

from p2p.trio_util import (LINE_READ_SIZE, Mutex, beside, cancel_on_sigterm, finish_quietly, read_lines,
                           start_cancellable, unwrap_single_group)


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


async def test_finish_quietly_waits_a_second_by_default_and_no_shield(autojump_clock: trio.testing.MockClock) -> None:
    started = trio.current_time()
    await finish_quietly(trio.sleep_forever)
    assert trio.current_time() - started == pytest.approx(1.0)
    ran = []

    async def closing() -> None:
        await trio.lowlevel.checkpoint()
        ran.append(True)

    with trio.CancelScope() as scope:
        scope.cancel()
        await finish_quietly(closing)
    assert ran == []  # unshielded: the caller's cancel cut it


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


# ---------------------------------------------------------------------- unwrap_single_group


def test_a_lone_error_in_nested_groups_comes_out_as_itself() -> None:
    error = ValueError("the one")
    with pytest.raises(ValueError) as caught, unwrap_single_group():
        raise BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [error])])
    assert caught.value is error and caught.value.__suppress_context__


def test_a_group_of_several_errors_stays_the_group() -> None:
    group = BaseExceptionGroup("two", [ValueError("a"), KeyError("b")])
    with pytest.raises(BaseExceptionGroup) as caught, unwrap_single_group():
        raise group
    assert caught.value is group


def test_a_lone_group_around_several_is_opened_to_them_only() -> None:
    several = BaseExceptionGroup("two", [ValueError("a"), KeyError("b")])
    with pytest.raises(BaseExceptionGroup) as caught, unwrap_single_group():
        raise BaseExceptionGroup("outer", [several])
    assert caught.value is several


def test_a_plain_error_and_no_error_pass_as_they_are() -> None:
    error = KeyError("plain")
    with pytest.raises(KeyError) as caught, unwrap_single_group():
        raise error
    assert caught.value is error
    with unwrap_single_group():
        pass


# ---------------------------------------------------------------------- start_cancellable


async def test_cancelling_a_started_job_stops_it_alone(autojump_clock: trio.testing.MockClock) -> None:
    ended: list[str] = []

    async def job(name: str) -> None:
        try:
            await trio.sleep(10)
            ended.append(f"{name} done")
        except trio.Cancelled:
            ended.append(f"{name} cancelled")
            raise

    async with trio.open_nursery() as nursery:
        first = start_cancellable(nursery, lambda: job("first"))
        start_cancellable(nursery, lambda: job("second"))
        await trio.sleep(1)
        first.cancel()
    assert ended == ["first cancelled", "second done"] and trio.current_time() == 10
    assert first.cancelled_caught


# ---------------------------------------------------------------------- cancel_on_sigterm


async def test_sigterm_cancels_the_scope_as_ctrl_c_would() -> None:
    with trio.fail_after(10):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_on_sigterm, scope)
                await trio.testing.wait_all_tasks_blocked()  # its receiver is installed
                os.kill(os.getpid(), signal.SIGTERM)
                await trio.sleep_forever()
        assert scope.cancelled_caught


async def test_each_sigterm_is_taken_while_the_receiver_runs() -> None:
    """The receiver stays: a second SIGTERM (systemd's after a cleanup that took long) is taken too,
    not left to the default handler that would kill the process mid-cleanup. (A signal still queued
    when the receiver closes is redelivered, so the test waits until each one was taken.)"""

    class Counting:
        cancels = 0

        def cancel(self) -> None:
            self.cancels += 1

    counting = Counting()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_sigterm, cast(trio.CancelScope, counting))
            await trio.testing.wait_all_tasks_blocked()
            for sent in (1, 2):
                os.kill(os.getpid(), signal.SIGTERM)
                while counting.cancels < sent:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert counting.cancels == 2


# ---------------------------------------------------------------------- Mutex


async def test_a_free_mutex_is_taken_without_a_checkpoint() -> None:
    lock = Mutex()
    assert lock.locked is False
    with trio.testing.assert_no_checkpoints():
        async with lock:
            assert lock.locked is True
    assert lock.locked is False


async def test_waiters_get_the_mutex_first_come_first_served(autojump_clock: trio.testing.MockClock) -> None:
    lock = Mutex()
    order: list[int] = []

    async def take(i: int) -> None:
        async with lock:
            order.append(i)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(take, i)
            await trio.testing.wait_all_tasks_blocked()
    assert order == [0, 1, 2, 3] and trio.current_time() == 4 and not lock.locked


async def test_a_released_mutex_is_handed_to_its_waiter_before_anyone_else(
        autojump_clock: trio.testing.MockClock) -> None:
    """Release hands the lock over: a task arriving between the release and the waiter's wakeup
    waits its turn instead of barging in."""
    lock = Mutex()
    order: list[str] = []

    async def waiter() -> None:
        async with lock:
            order.append("waiter")

    async with trio.open_nursery() as nursery:
        await lock.__aenter__()
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        await lock.__aexit__(None, None, None)
        assert lock.locked  # the waiter holds it, though it has not run yet
        async with lock:
            order.append("late")
    assert order == ["waiter", "late"]


# ---------------------------------------------------------------------- read_lines


class Chunks(trio.abc.ReceiveStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.asked: list[int | None] = []

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        self.asked.append(max_bytes)
        await trio.lowlevel.checkpoint()
        return self.chunks.pop(0) if self.chunks else b""

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize(("chunks", "lines"), [
    ([b"one\ntwo\n"], ["one", "two"]),
    ([b"on", b"e\ntw", b"o\n"], ["one", "two"]),  # lines cut across reads
    ([b"one\nlast"], ["one", "last"]),  # the last without its newline
    ([b"\n\nx\n"], ["", "", "x"]),
    ([], []),
    ([b"caf\xc3\xa9 \xff\n"], ["caf\u00e9 \ufffd"]),  # undecodable bytes replaced, not an error
    ([b"tail \xff"], ["tail \ufffd"]),
])
async def test_read_lines_yields_each_line_as_it_completes(chunks: list[bytes], lines: list[str]) -> None:
    stream = Chunks(list(chunks))
    assert [line async for line in read_lines(stream)] == lines
    assert stream.asked == [LINE_READ_SIZE] * (len(chunks) + 1)  # bounded reads, to the end
