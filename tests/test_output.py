"""p2p/output.py, what a command prints: each event's human line, JSON lines, the lines written at once
outside a run, and during one the queue that never blocks the node (bounded, its drops counted and
said, a reader gone, the flush at the end). Fast, so that ``make mutate`` runs it for every mutant of
the module (a real command's output: tests/test_cli.py)."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from p2p import events as ev
from p2p.hooks import Direction, PathKind
from p2p.output import FLUSH_TIMEOUT, MAX_QUEUED_LINES, Output, human

from .kit import numbered_peer_id

pytestmark = pytest.mark.timeout(60)

PEER = numbered_peer_id(7)
SHORT = "…" + str(PEER)[-8:]


# ---------------------------------------------------------------------- each event's line


def test_listening_names_the_peer_and_each_address_to_give_others() -> None:
    assert human(ev.Listening(PEER, ["/ip4/1.2.3.4/tcp/1", "/ip4/5.6.7.8/tcp/2"])) == (
        f"peer id {PEER}\nlistening on (give one of these to others):\n  /ip4/1.2.3.4/tcp/1\n  /ip4/5.6.7.8/tcp/2")
    assert human(ev.Listening(PEER, [])) == (
        f"peer id {PEER}\nno direct address (not listening): others reach this node through a relay slot")


def test_the_node_s_own_events_in_their_words() -> None:
    assert SHORT == "…" + str(PEER)[-8:] and len(SHORT) == 9
    assert human(ev.PeerConnected(PEER, "/ip4/1.2.3.4/tcp/1", 0.01234)) == \
        f"connected to {SHORT} at /ip4/1.2.3.4/tcp/1 in 12.3 ms"
    assert human(ev.ConnectionOpened(PEER, "/ip4/1.2.3.4/tcp/1", Direction.INBOUND, PathKind.RELAYED)) == \
        f"+ {Direction.INBOUND} {PathKind.RELAYED} connection {SHORT} /ip4/1.2.3.4/tcp/1"
    assert human(ev.ConnectionClosed(PEER, "/ip4/1.2.3.4/tcp/1", PathKind.DIRECT)) == \
        f"- {PathKind.DIRECT} connection closed {SHORT}"
    assert human(ev.Ping(PEER, 1.234)) == f"ping {SHORT}: 1.23 ms"
    assert human(ev.Ping(PEER, 1.235, PathKind.RELAYED)) == f"ping {SHORT}: 1.24 ms ({PathKind.RELAYED})"
    assert human(ev.Message(PEER, "hello")) == f"message from {SHORT}: hello"
    assert human(ev.PeerCount(1, [PEER])) == f"serving 1 peer: {SHORT}"
    assert human(ev.PeerCount(2, [PEER, numbered_peer_id(8)])) == \
        f"serving 2 peers: {SHORT}, …{str(numbered_peer_id(8))[-8:]}"
    assert human(ev.PeerCount(0, [])) == "serving 0 peers"
    assert human(ev.Error("it broke")) == "error: it broke"
    assert human(ev.Closed(PEER)) == "node stopped"
    assert human(ev.Message(None, "anonymous")) == "message from ?: anonymous"  # type: ignore[arg-type]


def test_an_event_of_a_layer_above_gives_its_own_line() -> None:
    assert human(ev.Rejoining(3)) == "cut off from every peer: dialing the 3 initial peers again"
    assert human(ev.ClosedSwarm(PEER)) == f"{PEER} runs a closed swarm, and this peer has no access pass for it"


@dataclass
class Plain(ev.Event):
    """An event with no line of its own."""

    seconds: float
    count: int
    peers: list[str]
    note: str | None = None
    event: str = field(init=False, default="some_thing_done")


def test_an_event_without_a_line_of_its_own_is_its_name_and_fields_those_empty_left_out() -> None:
    assert human(Plain(0.0021022979999543168, 3, ["a", "b"], "x")) == \
        "some thing done: seconds=0.0021, count=3, peers=['a', 'b'], note=x"
    assert human(Plain(12345.678, 0, [])) == "some thing done: seconds=1.23e+04, count=0"


def test_nat_status_is_the_funnel_in_one_line() -> None:
    from nat.events import NatStatus

    status = NatStatus({"mode": "relayed", "reachability": "private", "mapping": "independent",
                        "reservations": 2, "punch_successes": 3, "punch_attempts": 4})
    assert human(status) == "nat: relayed, reachability private, mapping independent, 2 relay slot(s), punches 3/4"
    assert human(NatStatus({})) == "nat: None, reachability None, mapping None, None relay slot(s), punches None/None"


# ---------------------------------------------------------------------- outside a run: at once


@dataclass
class Silent(ev.Event):
    event: str = field(init=False, default="silent")

    def human(self) -> str:
        return ""


def test_outside_a_run_each_line_is_written_at_once_in_its_form() -> None:
    people, scripts = io.StringIO(), io.StringIO()
    Output(False, people).event(ev.Error("it broke"))
    Output(True, scripts).event(ev.Error("it broke"))
    assert people.getvalue() == "error: it broke\n"
    line = json.loads(scripts.getvalue())
    assert (line["event"], line["message"], line["peer_id"]) == ("error", "it broke", None)
    Output(False, people).event(Silent())  # an empty line is not written
    assert people.getvalue() == "error: it broke\n"
    Output(True, scripts).event(Silent())  # but its JSON is
    assert json.loads(scripts.getvalue().splitlines()[1])["event"] == "silent"


def test_each_line_written_at_once_is_flushed_at_once() -> None:
    stream = Held()
    stream.released.set()
    out = Output(False, stream)
    out.event(ev.Error("a"))
    assert stream.written == ["error: a", "\n"] and stream.flushes == 1  # not left in a buffer
    out.info("b")
    assert stream.flushes == 2


def test_a_one_off_result_is_prose_for_people_and_an_object_for_scripts() -> None:
    people, scripts = io.StringIO(), io.StringIO()
    Output(False, people).info("peer id x", peer_id="x", addrs=["a"])
    Output(True, scripts).info("peer id x", peer_id="x", addrs=["a"])
    assert people.getvalue() == "peer id x\n" and scripts.getvalue() == '{"peer_id": "x", "addrs": ["a"]}\n'


def test_the_defaults_are_standard_output_ten_thousand_lines_and_five_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    out = Output(False)
    assert out.stream is sys.stdout and out.max_queued == MAX_QUEUED_LINES == 10_000 and FLUSH_TIMEOUT == 5.0
    assert (out.json_mode, out.dropped) == (False, 0)
    out.event(ev.Error("x"))
    assert capsys.readouterr().out == "error: x\n"


# ---------------------------------------------------------------------- during a run: the queue


class Held:
    """A stream whose writes wait until released (a reader that stopped reading)."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.written: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> None:
        self.released.wait(30)
        self.written.append(text)

    def flush(self) -> None:
        self.flushes += 1

    def lines(self) -> list[str]:
        return "".join(self.written).splitlines()


async def test_lines_are_written_by_the_writer_task_in_order_each_batch_flushed() -> None:
    stream = Held()
    stream.released.set()
    out = Output(False, stream)
    async with out.writing():
        for i in range(5):
            out.event(ev.Error(f"{i}"))
        assert stream.written == []  # queued, not written by the caller
        await trio.testing.wait_all_tasks_blocked()
        out.event(ev.Error("5"))
    assert stream.lines() == [f"error: {i}" for i in range(6)] and stream.flushes == len(stream.written) >= 2
    assert out.dropped == 0
    out.event(ev.Error("after"))  # after the run: at once again
    assert stream.lines()[-1] == "error: after"


async def test_a_run_with_nothing_to_write_ends_at_once(autojump_clock: trio.abc.Clock) -> None:
    out = Output(False, Held())
    began = trio.current_time()
    async with out.writing():
        pass
    assert trio.current_time() == began


async def test_beyond_the_bound_new_lines_are_dropped_and_their_count_said_once_the_reader_is_back() -> None:
    stream = Held()
    out = Output(True, stream, max_queued=3)
    async with out.writing():
        out.event(ev.Message(PEER, "first"))
        await trio.testing.wait_all_tasks_blocked()  # the first batch is in the thread, held
        for i in range(5):
            out.event(ev.Message(PEER, f"{i}"))  # 3 queued, 2 dropped
        assert out.dropped == 2
        stream.released.set()
    lines = [json.loads(line) for line in stream.lines()]
    assert [e.get("text") for e in lines[:4]] == ["first", "0", "1", "2"]
    assert lines[4]["event"] == "error"
    assert lines[4]["message"] == "2 output line(s) dropped: the output was not read"
    assert len(lines) == 5 and out.dropped == 2


async def test_the_drop_notice_is_a_human_line_for_people() -> None:
    stream = Held()
    out = Output(False, stream, max_queued=1)
    async with out.writing():
        out.event(ev.Error("first"))
        await trio.testing.wait_all_tasks_blocked()
        out.event(ev.Error("kept"))
        out.event(ev.Error("dropped"))
        stream.released.set()
    assert stream.lines() == ["error: first", "error: kept",
                              "error: 1 output line(s) dropped: the output was not read"]


async def test_a_reader_that_never_comes_back_holds_the_end_of_a_run_five_seconds_at_most(
        autojump_clock: trio.abc.Clock) -> None:
    stream = Held()
    out = Output(False, stream)
    began = trio.current_time()
    try:
        async with out.writing():
            out.event(ev.Error("never read"))
            await trio.testing.wait_all_tasks_blocked()
            out.event(ev.Error("queued"))
        assert trio.current_time() - began == pytest.approx(FLUSH_TIMEOUT, abs=0.05)
    finally:
        stream.released.set()  # let the abandoned thread go


async def release(stream: Held, after: float) -> None:
    await trio.sleep(after)
    stream.released.set()


@pytest.mark.parametrize("behind", [[], ["more"]])
async def test_the_end_of_a_run_waits_for_the_batch_in_the_thread_then_writes_what_was_queued_behind(
        behind: list[str]) -> None:
    """(On the real clock: the autojump clock would run past the flush timeout while the thread writes.)
    With nothing queued behind the batch, only the batch in the thread holds the end of the run."""
    stream = Held()
    out = Output(False, stream)
    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(release, stream, 0.3)
        async with out.writing():
            out.event(ev.Error("slow"))
            await trio.testing.wait_all_tasks_blocked()  # in the thread, held
            for text in behind:
                out.event(ev.Error(text))  # queued meanwhile, nothing dropped
        assert stream.lines() == [f"error: {t}" for t in ["slow", *behind]] and out.dropped == 0
        assert 0.3 <= trio.current_time() - began < FLUSH_TIMEOUT - 2  # the rest at once, not at the timeout


class Gone:
    """A stream whose reader has gone (a closed pipe)."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, text: str) -> None:
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        pass


async def test_a_reader_gone_ends_the_output_not_the_command_and_every_line_since_is_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    stream = Gone()
    out = Output(True, stream, max_queued=1)
    with caplog.at_level(logging.WARNING, logger="p2p.output"), trio.fail_after(5):
        async with out.writing():
            out.event(ev.Message(PEER, "a"))
            out.event(ev.Message(PEER, "b"))  # over the bound: dropped (1)
            while out.dropped < 3:  # "a" and the drop notice failed (2 more): the output is closed
                await trio.sleep(0.01)
            for i in range(2):
                out.event(ev.Message(PEER, f"{i}"))  # after the end: dropped at once (2 more)
            assert out.dropped == 5
    assert stream.writes == 1 and out.dropped == 5
    assert [r.getMessage() for r in caplog.records if r.name == "p2p.output"] == [
        "the output is closed ([Errno 32] Broken pipe): events are no longer printed"]


async def test_lines_queued_behind_the_write_that_failed_are_counted_as_dropped() -> None:
    class HeldThenGone(Held):
        def write(self, text: str) -> None:
            self.released.wait(30)
            raise BrokenPipeError(32, "Broken pipe")

    stream = HeldThenGone()
    out = Output(False, stream)
    with trio.fail_after(5):
        async with out.writing():
            out.event(ev.Error("a"))
            await trio.testing.wait_all_tasks_blocked()  # "a" in the thread, held
            out.event(ev.Error("b"))
            out.event(ev.Error("c"))  # queued behind it
            stream.released.set()
            while out.dropped < 3:
                await trio.sleep(0.01)
    assert out.dropped == 3


async def test_a_closed_standard_output_is_pointed_at_dev_null(monkeypatch: pytest.MonkeyPatch) -> None:
    """So that Python's own flush of stdout at exit does not fail on the closed pipe too."""
    read_fd, write_fd = os.pipe()

    class ClosedStdout(Gone):
        def fileno(self) -> int:
            return write_fd

    stdout = ClosedStdout()
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        out = Output(False)
        assert out.stream is stdout
        with trio.fail_after(5):
            async with out.writing():
                out.event(ev.Error("x"))
        os.write(write_fd, b"lost")  # now /dev/null's: the pipe has no writer left
        os.close(write_fd)
        assert os.read(read_fd, 10) == b""
    finally:
        os.close(read_fd)


@pytest.mark.parametrize("error", [ValueError("I/O operation on closed file"), OSError(9, "Bad file descriptor")])
async def test_a_closed_standard_output_without_a_descriptor_ends_quietly(monkeypatch: pytest.MonkeyPatch,
                                                                          error: Exception) -> None:
    class NoDescriptor(Gone):
        def fileno(self) -> int:
            raise error

    monkeypatch.setattr(sys, "stdout", NoDescriptor())
    out = Output(False)
    with trio.fail_after(5):
        async with out.writing():
            out.event(ev.Error("x"))
    assert out.dropped == 1


async def test_output_queues_while_unread_drops_beyond_its_bound_and_says_how_many() -> None:
    """Output.writing: with nobody reading a real pipe, the event loop runs on, lines beyond the bound
    are dropped and counted, and once the pipe is read the count is written after the rest."""
    read_fd, write_fd = os.pipe()
    writer = os.fdopen(write_fd, "w")
    reader = trio.lowlevel.FdStream(read_fd)
    out = Output(True, writer, max_queued=50)
    text = b""
    async with reader:
        async with out.writing():
            for i in range(4000):  # ~440 KB of lines for a 64 KiB pipe
                out.event(ev.Message(peer_id=None, text=f"line {i:04d} " + "x" * 40))  # type: ignore[arg-type]
                await trio.sleep(0)
            with trio.fail_after(1):
                await trio.sleep(0.05)  # the loop is not blocked
            assert out.dropped > 2000
            with trio.fail_after(10):
                while b"dropped" not in text:
                    text += await reader.receive_some(65536)
        writer.close()
        while chunk := await reader.receive_some(65536):
            text += chunk
    lines = [json.loads(line) for line in text.decode().splitlines()]
    written = [e for e in lines if e["event"] == "message"]
    notices = [e["message"] for e in lines if e["event"] == "error"]
    assert notices and all(m.endswith(" output line(s) dropped: the output was not read") for m in notices)
    assert sum(int(m.split()[0]) for m in notices) == out.dropped  # every drop reported, once
    assert len(written) + out.dropped == 4000
    assert [e["text"] for e in written] == sorted(e["text"] for e in written)  # in order, none twice
