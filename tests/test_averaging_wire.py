"""averaging.wire's FrameReader and frame(): the framing of the all-reduce (and expert) streams, on a
scripted stream (no sockets; trio's MockClock where the stall watchdog's deadlines matter)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
from libp2p.network.stream.exceptions import StreamEOF, StreamReset

from averaging.errors import AllreduceProtocolError
from averaging.proto import averaging_pb2 as pb
from p2p.errors import StreamBrokenError
from averaging.wire import MAX_HEADER, MID_FRAME, READ_SIZE, FrameReader, TruncatedStreamError, frame


@dataclass
class Pieces:
    """A stream that returns its pieces one read at a time, then ``b""`` (its end), or raises
    EOFError there when ``eof_error`` (py-libp2p's StreamReset, caused by ``reset``, when that is set). A piece may be longer than the read asked for (a stream that
    returns more than asked). ``delay`` s pass before each read returns (on the test's clock)."""

    pieces: list[bytes]
    eof_error: bool = False
    reset: BaseException | None = None
    delay: float = 0.0
    asked: list[int] = field(default_factory=list)

    async def read(self, n: int) -> bytes:
        self.asked.append(n)
        await trio.sleep(self.delay)
        if self.pieces:
            return self.pieces.pop(0)
        if self.reset is not None:
            raise StreamReset() from self.reset
        if self.eof_error:
            raise EOFError
        return b""

    async def write(self, data: bytes) -> None:
        raise AssertionError("a reader never writes")


def header(**fields: object) -> pb.ChunkHeader:
    return pb.ChunkHeader(**fields)  # type: ignore[arg-type]


def note_of_framed_size(size: int) -> pb.ChunkHeader:
    """A header whose serialization is exactly ``size`` bytes (a note of the right length)."""
    for n in range(size, -1, -1):
        h = header(index=1, note="x" * n)
        if h.ByteSize() == size:
            return h
    raise AssertionError(size)


# ---------------------------------------------------------------------- frames and messages


def test_frame_is_the_length_then_the_serialized_header() -> None:
    h = header(index=300, codec=pb.CODEC_UINT8, nbytes=5)
    raw = h.SerializeToString()
    assert frame(h) == bytes([len(raw)]) + raw
    long = note_of_framed_size(200)
    assert frame(long)[:2] == b"\xc8\x01" and len(frame(long)) == 202  # a two-byte varint


async def test_a_frame_and_its_payload_come_back_however_the_stream_cuts_them() -> None:
    h = header(index=7, codec=pb.CODEC_FLOAT16, nbytes=3, contributors=b"\x05", note="a, b")
    long = note_of_framed_size(300)  # a two-byte length prefix, cut between its bytes too
    data = frame(long) + frame(h) + b"xyz"
    stream = Pieces([data[i:i + 1] for i in range(len(data))])  # one byte a read
    reader = FrameReader(stream)
    assert await reader.message(pb.ChunkHeader, "chunk header") == long
    assert await reader.message(pb.ChunkHeader, "chunk header") == h
    assert await reader.exactly(3) == b"xyz"
    assert reader.bytes_read == len(data) and reader.buffered == 0
    assert await reader.at_eof()


async def test_a_header_of_exactly_max_size_is_read_and_one_byte_more_is_refused() -> None:
    for limit in (MAX_HEADER, 64):
        fits, over = note_of_framed_size(limit), note_of_framed_size(limit + 1)
        kwargs = {} if limit == MAX_HEADER else {"max_size": limit}
        assert await FrameReader(Pieces([frame(fits)])).message(pb.ChunkHeader, "h", **kwargs) == fits
        with pytest.raises(AllreduceProtocolError, match=f"^chunk header of {limit + 1} bytes, more than {limit}$"):
            await FrameReader(Pieces([frame(over)])).message(pb.ChunkHeader, "chunk header", **kwargs)
    assert MAX_HEADER == 4096


async def test_an_oversized_header_is_refused_from_its_length_before_its_bytes_arrive() -> None:
    stream = Pieces([b"\x80\x80\x04"])  # 65,536 bytes announced, none sent
    with pytest.raises(AllreduceProtocolError, match="of 65536 bytes"):
        await FrameReader(stream).message(pb.ChunkHeader, "chunk header")
    assert len(stream.asked) == 1


async def test_a_length_prefix_that_never_ends_is_malformed() -> None:
    with pytest.raises(AllreduceProtocolError, match="^part header: malformed length prefix$"):
        await FrameReader(Pieces([b"\xff" * 11])).message(pb.ChunkHeader, "part header")


async def test_a_header_that_does_not_parse_is_a_protocol_error() -> None:
    with pytest.raises(AllreduceProtocolError, match="^chunk header from peer does not parse: "):
        await FrameReader(Pieces([b"\x02\x0a\xff"])).message(pb.ChunkHeader, "chunk header from peer")


@pytest.mark.parametrize("eof_error", [False, True])
@pytest.mark.parametrize("sent", [b"", b"\x80", b"\x05ab"])
async def test_a_stream_that_ends_inside_a_frame_is_truncated(sent: bytes, eof_error: bool) -> None:
    reader = FrameReader(Pieces([sent] if sent else [], eof_error=eof_error))
    with pytest.raises(TruncatedStreamError, match="^the peer closed the stream mid-frame$"):
        await reader.message(pb.ChunkHeader, "chunk header")
    assert isinstance(TruncatedStreamError(), AllreduceProtocolError)
    assert isinstance(TruncatedStreamError(), EOFError)


@pytest.mark.parametrize("call", ["message", "exactly", "read", "readinto", "at_eof"])
async def test_a_reset_under_any_read_is_a_broken_stream_naming_its_cause(call: str) -> None:
    why = ConnectionResetError("the peer reset stream 7")
    reader = FrameReader(Pieces([b"\x05ab"] if call != "at_eof" else [], reset=why))
    with pytest.raises(StreamBrokenError) as caught:
        if call == "message":
            await reader.message(pb.ChunkHeader, "chunk header")
        elif call == "exactly":
            await reader.exactly(8)
        elif call == "read":
            await reader.read(3)
            await reader.read(3)
        elif call == "readinto":
            await reader.readinto(memoryview(bytearray(8)))
        else:
            await reader.at_eof()
    bytes_before = 0 if call == "at_eof" else 3
    assert str(caught.value) == (f"the stream broke after {bytes_before} bytes: "
                                 "StreamReset: (ConnectionResetError: the peer reset stream 7)")
    assert isinstance(caught.value.__cause__, StreamReset) and isinstance(caught.value, OSError)


async def test_py_libp2ps_stream_eof_is_the_streams_end_not_a_break() -> None:
    class Ended(Pieces):
        async def read(self, n: int) -> bytes:
            raise StreamEOF()

    assert await FrameReader(Ended([])).at_eof()
    with pytest.raises(TruncatedStreamError):
        await FrameReader(Ended([])).exactly(1)


async def test_exactly_reads_until_it_has_enough_and_keeps_the_rest() -> None:
    stream = Pieces([b"ab", b"cdef", b"gh"])
    reader = FrameReader(stream)
    assert reader.bytes_read == 0 and reader.buffered == 0
    assert await reader.exactly(3) == b"abc"
    assert reader.buffered == 3 and reader.bytes_read == 6
    assert stream.asked == [READ_SIZE, READ_SIZE]
    assert await reader.exactly(0) == b""
    assert await reader.exactly(3) == b"def" and len(stream.asked) == 2  # from the buffer alone
    with pytest.raises(TruncatedStreamError):
        await reader.exactly(3)  # "gh", then the end


# ---------------------------------------------------------------------- the reader as a stream


async def test_read_hands_out_the_buffer_first_and_no_more_than_asked() -> None:
    stream = Pieces([b"\x03abcde", b"fgh"])
    reader = FrameReader(stream)
    assert await reader.exactly(1) == b"\x03"
    assert await reader.read(2) == b"ab" and reader.buffered == 3
    assert await reader.read(10) == b"cde" and reader.buffered == 0  # the buffer's rest, no stream read
    assert len(stream.asked) == 1
    assert await reader.read(7) == b"fgh" and stream.asked[-1] == 7  # from the stream, asking what it was asked
    assert reader.bytes_read == 9
    assert await reader.read(7) == b""  # the end


async def test_read_never_asks_the_stream_for_more_than_a_read_size() -> None:
    stream = Pieces([b"a"])
    assert await FrameReader(stream).read(READ_SIZE * 4) == b"a"
    assert stream.asked == [READ_SIZE] and READ_SIZE == 1 << 20


async def test_read_at_an_eof_error_returns_the_end() -> None:
    reader = FrameReader(Pieces([], eof_error=True))
    assert await reader.read(5) == b"" and reader.bytes_read == 0


async def test_readinto_fills_a_buffer_from_what_it_holds_and_the_stream() -> None:
    stream = Pieces([b"\x03abcde", b"fgh", b"ijkl"])
    reader = FrameReader(stream)
    assert await reader.exactly(1) == b"\x03"  # leaves "abcde" buffered
    view = memoryview(bytearray(9))
    await reader.readinto(view)
    assert bytes(view) == b"abcdefghi"
    assert stream.asked == [READ_SIZE, 4, 1]  # the stream is asked for what is still missing
    assert reader.buffered == 3 and reader.bytes_read == 13  # "ijkl" was more than asked: "jkl" is kept
    assert await reader.exactly(3) == b"jkl"
    with pytest.raises(TruncatedStreamError, match=f"^{MID_FRAME}$"):
        await reader.readinto(memoryview(bytearray(1)))


async def test_readinto_takes_a_part_of_the_buffer_and_leaves_the_rest() -> None:
    reader = FrameReader(Pieces([b"\x01abcdef"]))
    await reader.exactly(1)
    view = memoryview(bytearray(2))
    await reader.readinto(view)
    assert bytes(view) == b"ab" and reader.buffered == 4
    assert await reader.exactly(4) == b"cdef"


async def test_readinto_asks_a_read_size_at_most_and_fails_at_an_eof_error() -> None:
    stream = Pieces([b"x" * 10], eof_error=True)
    view = memoryview(bytearray(READ_SIZE + 20))
    with pytest.raises(TruncatedStreamError, match=f"^{MID_FRAME}$"):
        await FrameReader(stream).readinto(view)
    assert stream.asked == [READ_SIZE, READ_SIZE]
    assert bytes(view[:10]) == b"x" * 10


async def test_at_eof_is_true_only_at_a_clean_end_between_frames() -> None:
    stream = Pieces([b"ab"])
    reader = FrameReader(stream)
    assert not await reader.at_eof()  # "ab" came in and is kept
    assert not await reader.at_eof() and len(stream.asked) == 1  # something is buffered: no read
    assert await reader.exactly(2) == b"ab"
    assert await reader.at_eof()
    assert await FrameReader(Pieces([], eof_error=True)).at_eof()


# ---------------------------------------------------------------------- the stall watchdog


@pytest.mark.parametrize("how", ["exactly", "read", "readinto", "at_eof"])
async def test_every_read_that_brings_bytes_pushes_the_watchdog(
        how: str, autojump_clock: trio.testing.MockClock) -> None:
    reader = FrameReader(Pieces([b"ab", b"cd"], delay=3))
    with trio.CancelScope(deadline=trio.current_time() + 5) as scope:
        reader.watch(scope, 4)
        for _ in range(2):  # each read takes 3 s: without the push the second would pass the deadline
            if how == "exactly":
                await reader.exactly(2)
            elif how == "read":
                await reader.read(2)
            elif how == "readinto":
                await reader.readinto(memoryview(bytearray(2)))
            else:
                assert not await reader.at_eof()
                await reader.exactly(2)
            assert scope.deadline == trio.current_time() + 4
    assert not scope.cancelled_caught


async def test_a_read_that_brings_nothing_leaves_the_watchdog_alone(autojump_clock: trio.testing.MockClock) -> None:
    reader = FrameReader(Pieces([], delay=1))
    with trio.CancelScope(deadline=trio.current_time() + 5) as scope:
        reader.watch(scope, 4)
        assert await reader.read(2) == b""
        assert scope.deadline == 5
        with pytest.raises(TruncatedStreamError):
            await reader.exactly(1)
        assert scope.deadline == 5


async def test_a_stalled_peer_is_cut_by_the_watchdog(autojump_clock: trio.testing.MockClock) -> None:
    reader = FrameReader(Pieces([b"a", b"b"], delay=10))
    with trio.move_on_after(60) as scope:
        reader.watch(scope, 5)
        await reader.exactly(2)
    assert scope.cancelled_caught and trio.current_time() == 15  # "a" at 10 s: due by 15, "b" at 20
