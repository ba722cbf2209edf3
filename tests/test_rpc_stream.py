"""The RPC layer's I/O edge alone: :class:`FramedStream` over a scripted stream, and the idle-stream pool.

The end-to-end protocol tests (test_rpc_protocol) see these only through calls
that work or fail; here each failure of the stream below (EOF, a reset, a refusal
wrapped by py-libp2p, a hang, a cancellation) is made on purpose and what the
layer above is told is checked: the error type, its words, and the flags
(``broken``, ``desynced``, ``done``) that decide whether a stream is reused.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID

from p2p.multistream import PeerRefused
from p2p.rpc import rpc_pb2
from p2p.rpc.errors import PeerDisconnectedError, ResourceLimitError
from p2p.rpc.framing import END_FRAME, Payload, encode_message
from p2p.rpc.pool import StreamPool
from p2p.rpc.stream import CLEANUP_TIMEOUT, JOIN_LIMIT, READ_SIZE, FramedStream

PEER = ID(b"\x00\x04peer")
OTHER = ID(b"\x00\x05other")


class Scripted:
    """A stream whose reads return (or raise) what the test lined up, and that records the rest.

    With nothing left to read, a read waits forever; ``hang`` makes close or reset do the same.
    """

    def __init__(self, *reads: bytes | BaseException) -> None:
        self.reads = list(reads)
        self.read_sizes: list[int | None] = []
        self.writes: list[bytes] = []
        self.write_error: BaseException | None = None
        self.close_error: BaseException | None = None
        self.reset_error: BaseException | None = None
        self.hang: set[str] = set()
        self.closes = 0
        self.resets = 0

    async def read(self, n: int | None = None) -> bytes:
        self.read_sizes.append(n)
        await trio.lowlevel.checkpoint()
        if not self.reads:
            await trio.sleep_forever()
        item = self.reads.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def write(self, data: bytes) -> None:
        await self._step("write", self.write_error)
        self.writes.append(data)

    async def close(self) -> None:
        await self._step("close", self.close_error)
        self.closes += 1

    async def reset(self) -> None:
        await self._step("reset", self.reset_error)
        self.resets += 1

    async def _step(self, name: str, error: BaseException | None) -> None:
        """A checkpoint first (a cancelled caller stops here), then the hang or the failure asked for."""
        await trio.lowlevel.checkpoint()
        if name in self.hang:
            await trio.sleep_forever()
        if error is not None:
            raise error


def framed(*reads: bytes | BaseException) -> tuple[FramedStream, Scripted]:
    stream = Scripted(*reads)
    return FramedStream(stream, PEER, 1 << 20), stream


def chain(*errors: BaseException) -> BaseException:
    """``errors[0]``, raised from ``errors[1]``, raised from ``errors[2]``...: py-libp2p's wrapping."""
    for outer, inner in zip(errors, errors[1:]):
        outer.__cause__ = inner
    return errors[0]


# ---------------------------------------------------------------------- reading


async def test_a_new_stream_is_in_step_and_open() -> None:
    f, _ = framed()
    assert f.reusable
    assert f.broken is None and f.desynced is False and f.done is False


async def test_frames_are_read_whole_across_reads_and_a_clean_end_is_none() -> None:
    one, two = encode_message(b"first"), encode_message(b"second")
    f, stream = framed(one[:2], one[2:] + two[:3], two[3:] + END_FRAME, b"")
    assert await f.read_frame() == Payload(b"first")
    assert await f.read_frame() == Payload(b"second")
    assert isinstance(await f.read_frame(), rpc_pb2.End)
    assert f.reusable
    assert await f.read_frame() is None
    assert stream.read_sizes == [READ_SIZE] * 4
    assert f.broken is None


async def test_libp2p_eof_is_a_clean_end_too() -> None:
    f, _ = framed(EOFError())
    assert await f.read_frame() is None
    assert f.broken is None


async def test_an_end_in_the_middle_of_a_frame_breaks_the_stream() -> None:
    f, _ = framed(encode_message(b"cut short")[:4], EOFError())
    with pytest.raises(PeerDisconnectedError) as caught:
        await f.read_frame()
    assert str(caught.value) == f"{PEER} closed the stream in the middle of a frame"
    assert f.broken is caught.value
    assert not f.reusable


async def test_a_broken_read_says_what_broke_and_the_first_break_is_kept() -> None:
    f, _ = framed(trio.BrokenResourceError("gone"), OSError("later"))
    with pytest.raises(PeerDisconnectedError) as first:
        await f.read_frame()
    assert str(first.value) == f"stream to {PEER} broke while reading: BrokenResourceError('gone')"
    assert isinstance(first.value.__cause__, trio.BrokenResourceError)
    with pytest.raises(PeerDisconnectedError) as second:
        await f.fill()
    assert "OSError('later')" in str(second.value)
    assert f.broken is first.value
    assert f.done is False


async def test_a_refused_stream_is_a_resource_limit_even_when_wrapped() -> None:
    """py-libp2p wraps the refusal up to three times; what the peer said reaches the caller, and the
    stream is done with (the peer is there and fine: no break)."""
    f, _ = framed(chain(StreamError(), ValueError(), RuntimeError(), PeerRefused("too many streams")))
    with pytest.raises(ResourceLimitError) as caught:
        await f.read_frame()
    assert caught.value.message == "the peer refused the stream: too many streams"
    assert caught.value.peer_id == PEER
    assert f.done is True
    assert f.broken is None


async def test_a_refusal_deeper_than_libp2p_wraps_is_a_break() -> None:
    f, _ = framed(chain(StreamError(), ValueError(), RuntimeError(), KeyError(), PeerRefused("too deep")))
    with pytest.raises(PeerDisconnectedError):
        await f.read_frame()
    assert f.done is False


async def test_a_cancelled_read_desyncs_the_stream() -> None:
    f, _ = framed()
    with trio.move_on_after(0.01):
        await f.read_frame()
    assert f.desynced is True
    assert not f.reusable


async def test_fill_buffers_without_taking_a_frame() -> None:
    f, _ = framed(encode_message(b"next call"), b"")
    assert await f.fill() is True
    assert not f.reusable  # bytes wait in the buffer
    assert await f.fill() is False
    assert await f.read_frame() == Payload(b"next call")


# ---------------------------------------------------------------------- writing


async def test_small_parts_go_in_one_write_large_ones_one_by_one() -> None:
    f, stream = framed()
    await f.write(b"only")
    half = b"h" * (JOIN_LIMIT // 2)
    await f.write(half, half)  # exactly the limit: still joined
    await f.write(half, half + b"!")
    assert stream.writes == [b"only", half + half, half, half + b"!"]


async def test_a_broken_write_says_so() -> None:
    f, stream = framed()
    stream.write_error = trio.ClosedResourceError("closed")
    with pytest.raises(PeerDisconnectedError) as caught:
        await f.write(b"x")
    assert str(caught.value) == f"stream to {PEER} broke while writing: ClosedResourceError('closed')"
    assert f.broken is caught.value


async def test_a_cancelled_write_desyncs_the_stream() -> None:
    f, stream = framed()
    stream.hang.add("write")
    with trio.move_on_after(0.01):
        await f.write(b"half sent")
    assert f.desynced is True


async def test_writers_take_turns() -> None:
    f, stream = framed()
    big = [b"a" * JOIN_LIMIT, b"b" * JOIN_LIMIT]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(f.write, *big)
        nursery.start_soon(f.write, b"c")
    assert stream.writes in ([*big, b"c"], [b"c", *big])


# ---------------------------------------------------------------------- draining


async def test_drain_reads_to_the_peers_end() -> None:
    f, stream = framed(b"left", b"over", b"")
    assert await f.drain(trio.current_time() + 5) is True
    assert stream.read_sizes == [READ_SIZE] * 3
    assert f.desynced is True


async def test_drain_takes_libp2p_eof_as_the_end() -> None:
    f, _ = framed(b"left", EOFError())
    assert await f.drain(trio.current_time() + 5) is True


async def test_drain_of_a_broken_stream_is_no_end() -> None:
    f, _ = framed(b"left", trio.BrokenResourceError())
    assert await f.drain(trio.current_time() + 5) is False


async def test_drain_gives_up_at_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    f, _ = framed(b"and it keeps coming")
    start = trio.current_time()
    assert await f.drain(start + 3) is False
    assert trio.current_time() - start == pytest.approx(3)


# ---------------------------------------------------------------------- ending


async def test_close_ends_our_side_once() -> None:
    f, stream = framed()
    await f.close()
    await f.close()
    assert stream.closes == 1 and f.done is True
    await f.abort()  # closed: nothing to reset
    assert stream.resets == 0


async def test_a_failed_close_leaves_the_stream_to_abort() -> None:
    f, stream = framed()
    stream.close_error = trio.BrokenResourceError()
    await f.close()
    assert f.done is False
    await f.abort()
    assert stream.resets == 1 and f.done is True


async def test_a_hanging_close_is_cut_short(autojump_clock: trio.testing.MockClock) -> None:
    f, stream = framed()
    stream.hang.add("close")
    start = trio.current_time()
    await f.close()
    assert trio.current_time() - start == pytest.approx(CLEANUP_TIMEOUT)
    assert f.done is False


async def test_abort_resets_once_unless_asked_after_a_close() -> None:
    f, stream = framed()
    await f.abort()
    await f.abort()
    assert stream.resets == 1 and f.done is True and not f.reusable
    g, other = framed()
    await g.close()
    await g.abort(after_close=True)
    assert other.resets == 1


async def test_abort_works_while_cancelled_and_swallows_a_failed_reset() -> None:
    f, stream = framed()
    with trio.CancelScope() as scope:
        scope.cancel()
        await f.abort()
    assert stream.resets == 1
    g, broken = framed()
    broken.reset_error = OSError("already gone")
    await g.abort()
    assert g.done is True


async def test_a_hanging_reset_is_cut_short(autojump_clock: trio.testing.MockClock) -> None:
    f, stream = framed()
    stream.hang.add("reset")
    start = trio.current_time()
    await f.abort()
    assert trio.current_time() - start == pytest.approx(CLEANUP_TIMEOUT)


# ---------------------------------------------------------------------- the idle-stream pool


def to(peer: ID) -> FramedStream:
    return FramedStream(Scripted(), peer, 1 << 20)


def closes(f: FramedStream) -> int:
    stream = f.stream
    assert isinstance(stream, Scripted)
    return stream.closes


async def test_the_pool_hands_out_the_freshest_stream_of_the_peer(autojump_clock: trio.testing.MockClock) -> None:
    pool = StreamPool(idle_timeout=0.5, max_idle_per_peer=4)
    old, new, theirs = to(PEER), to(PEER), to(OTHER)
    assert pool.give(old)
    await trio.sleep(0.1)
    assert pool.give(new) and pool.give(theirs)
    assert len(pool) == 3
    assert await pool.take(PEER) is new
    assert await pool.take(PEER) is old
    assert await pool.take(PEER) is None
    assert await pool.take(OTHER) is theirs
    assert len(pool) == 0


async def test_the_pool_keeps_no_unfit_stream_and_no_more_than_its_limit() -> None:
    pool = StreamPool(idle_timeout=10, max_idle_per_peer=2)
    desynced = to(PEER)
    desynced.desynced = True
    assert not pool.give(desynced)
    assert pool.give(to(PEER)) and pool.give(to(PEER))
    assert not pool.give(to(PEER))
    assert pool.give(to(OTHER))
    assert len(pool) == 3
    assert not StreamPool(idle_timeout=0, max_idle_per_peer=2).give(to(PEER))


async def test_a_stream_idle_for_exactly_the_timeout_is_stale(autojump_clock: trio.testing.MockClock) -> None:
    pool = StreamPool(idle_timeout=2, max_idle_per_peer=4)
    stale, fresh = to(PEER), to(PEER)
    pool.give(stale)
    await trio.sleep(1)
    pool.give(fresh)
    await trio.sleep(1)  # stale: exactly 2 s idle
    assert await pool.take(PEER) is fresh
    assert closes(stale) == 1 and closes(fresh) == 0
    assert len(pool) == 0
    pool.give(fresh)
    await trio.sleep(2)
    assert await pool.take(PEER) is None
    assert closes(fresh) == 1


async def test_taking_leaves_the_others_pooled(autojump_clock: trio.testing.MockClock) -> None:
    pool = StreamPool(idle_timeout=2, max_idle_per_peer=4)
    a, b = to(PEER), to(PEER)
    pool.give(a)
    pool.give(b)
    assert await pool.take(PEER) is b
    assert len(pool) == 1
    assert await pool.take(PEER) is a


async def test_forgetting_a_peer_drops_only_its_streams() -> None:
    pool = StreamPool(idle_timeout=10, max_idle_per_peer=4)
    mine, theirs = to(PEER), to(OTHER)
    pool.give(mine)
    pool.give(theirs)
    pool.forget(PEER)
    assert len(pool) == 1
    assert closes(mine) == 0  # its connection is gone: nothing to say on it
    assert await pool.take(PEER) is None
    assert await pool.take(OTHER) is theirs
    pool.forget(PEER)  # twice, or for a peer never seen: fine


async def test_closing_the_expired_streams_of_every_peer(autojump_clock: trio.testing.MockClock) -> None:
    pool = StreamPool(idle_timeout=2, max_idle_per_peer=4)
    old = [to(PEER), to(OTHER)]
    for f in old:
        pool.give(f)
    await trio.sleep(1)
    fresh = [to(PEER), to(OTHER)]
    for f in fresh:
        pool.give(f)
    await trio.sleep(1)  # old: exactly 2 s idle
    await pool.close(expired_only=True)
    assert [closes(f) for f in old + fresh] == [1, 1, 0, 0]
    assert len(pool) == 2
    await pool.close(expired_only=False)
    assert [closes(f) for f in old + fresh] == [1, 1, 1, 1]
    assert len(pool) == 0
    assert await pool.take(PEER) is None
