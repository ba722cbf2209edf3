"""p2p.wire's read_message and write_message (the relay, DCUtR, AutoNAT and access-pass messages) on a
scripted stream: a stream that breaks mid-message is a DedlocError that says why, never py-libp2p's bare
StreamReset (which the callers' `except (DedlocError, OSError, ...)` let through, ending their task)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from libp2p.network.stream.exceptions import StreamClosed, StreamEOF, StreamReset

from p2p.errors import DedlocError, RemoteProtocolError, StreamBrokenError
from p2p.proto import auth_pb2 as pb
from p2p.wire import MAX_MESSAGE, MESSAGE_TIMEOUT, read_message, write_message


class Broken:
    """Returns ``data`` a byte at a time, then raises ``error`` (made from the muxer's error, as
    py-libp2p's NetStream does: ``raise StreamReset() from error``)."""

    def __init__(self, data: bytes, error: Exception) -> None:
        self.data = bytearray(data)
        self.error = error

    async def read(self, n: int | None = None) -> bytes:
        if self.data:
            out = bytes(self.data[:1])
            del self.data[:1]
            return out
        raise self.error

    async def write(self, data: bytes) -> None:
        raise self.error


def reset_by_the_peer() -> StreamReset:
    try:
        try:
            raise ConnectionResetError("stream 7 was reset by 12D3KooWpeer")
        except ConnectionResetError as cause:
            raise StreamReset() from cause
    except StreamReset as e:
        return e


async def test_a_reset_mid_message_is_a_broken_stream_that_names_its_cause() -> None:
    hello = pb.ChallengeRequest(username="alice").SerializeToString()
    with pytest.raises(StreamBrokenError) as caught:
        await read_message(Broken(bytes([len(hello)]) + hello[:3], reset_by_the_peer()), pb.ChallengeRequest)
    assert str(caught.value) == ("the stream broke before the ChallengeRequest was complete: "
                                 "StreamReset: (ConnectionResetError: stream 7 was reset by 12D3KooWpeer)")
    assert isinstance(caught.value, DedlocError) and isinstance(caught.value, OSError)
    assert isinstance(caught.value.__cause__, StreamReset)


async def test_a_reset_before_the_first_byte_too() -> None:
    with pytest.raises(StreamBrokenError, match="^the stream broke before the Challenge was complete: StreamReset: $"):
        await read_message(Broken(b"", StreamReset()), pb.Challenge)


async def test_a_clean_end_is_still_the_peer_s_fault() -> None:
    with pytest.raises(RemoteProtocolError, match="^the stream ended before the Challenge was complete$"):
        await read_message(Broken(b"\x05ab", StreamEOF()), pb.Challenge)


@pytest.mark.parametrize("error", [StreamReset(), StreamClosed("the stream is closed for writing")])
async def test_a_write_on_a_broken_stream_is_a_broken_stream(error: Exception) -> None:
    with pytest.raises(StreamBrokenError, match=f"^could not send the ChallengeRequest: {type(error).__name__}: "):
        await write_message(Broken(b"", error), pb.ChallengeRequest(username="alice"))


async def test_other_errors_pass_as_they_are() -> None:
    with pytest.raises(ValueError, match="^odd$"):
        await read_message(Broken(b"", ValueError("odd")), pb.Challenge)
    with pytest.raises(ValueError, match="^odd$"):
        await write_message(Broken(b"", ValueError("odd")), pb.Challenge())


async def test_an_authority_that_resets_mid_exchange_fails_a_pass_request_as_a_dedloc_error() -> None:
    """nat.Peer renews its access pass with `except (AuthError, DedlocError, trio.TooSlowError)`: the reset
    of an authority that restarted mid-exchange reached it as a bare StreamReset and ended the peer."""
    from libp2p.abc import INetStream

    from p2p.authority import ISSUE_PROTOCOL, request_pass
    from p2p.wire import read_message as read

    from .fake_swarm import fake_swarms

    async with fake_swarms(2) as (me, authority):
        async def restarting(stream: INetStream) -> None:
            await read(stream, pb.ChallengeRequest)
            await stream.reset()

        authority.set_stream_handler(ISSUE_PROTOCOL, restarting)
        with pytest.raises(DedlocError, match="^the stream broke before the Challenge was complete: StreamReset"):
            await request_pass(me, authority.peer_id, "alice", b"secret")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- messages read exactly


class Scripted:
    """Returns its pieces, each cut to what the read asked (the rest kept), then b"" (its end); records
    each read's size and what was written. ``delay`` s pass before each read returns."""

    def __init__(self, *pieces: bytes, delay: float = 0.0) -> None:
        self.pieces = [bytearray(p) for p in pieces]
        self.delay = delay
        self.asked: list[int | None] = []
        self.written: list[bytes] = []

    async def read(self, n: int | None = None) -> bytes:
        self.asked.append(n)
        await trio.sleep(self.delay)
        if not self.pieces:
            return b""
        piece = self.pieces[0]
        out = bytes(piece[:n])
        del piece[:len(out)]
        if not piece:
            self.pieces.pop(0)
        return out

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    @property
    def unread(self) -> bytes:
        return b"".join(bytes(p) for p in self.pieces)


async def test_a_message_is_read_exactly_and_nothing_past_it() -> None:
    request = pb.ChallengeRequest(username="bob")
    body = request.SerializeToString()
    stream = Scripted(bytes([len(body)]) + body + b"next protocol's bytes")
    assert await read_message(stream, pb.ChallengeRequest) == request
    assert stream.asked == [1, len(body)] and stream.unread == b"next protocol's bytes"


async def test_a_body_that_comes_in_pieces_is_joined_and_nothing_past_it_read() -> None:
    stream = Scripted(b"\x05", b"\x0a\x03", b"bobrest")
    assert await read_message(stream, pb.ChallengeRequest) == pb.ChallengeRequest(username="bob")
    assert stream.asked == [1, 5, 3] and stream.unread == b"rest"


async def test_a_stream_that_ends_inside_a_message_is_the_peer_s_fault() -> None:
    for sent in (b"", b"\x80", b"\x05ab"):
        with pytest.raises(RemoteProtocolError, match="^the stream ended before the Challenge was complete$"):
            await read_message(Scripted(sent), pb.Challenge)


async def test_write_message_frames_the_body_with_its_length() -> None:
    stream = Scripted()
    await write_message(stream, pb.ChallengeRequest(username="x" * 200))
    body = pb.ChallengeRequest(username="x" * 200).SerializeToString()
    assert stream.written == [b"\xcb\x01" + body] and len(body) == 203


async def test_a_message_of_max_size_is_read_and_one_byte_more_is_refused() -> None:
    def framed(size: int) -> bytes:
        message = pb.ChallengeRequest(username="u" * (size - 3))
        body = message.SerializeToString()
        assert len(body) == size
        return bytes([0x80 | (size & 0x7F), size >> 7]) + body

    assert MAX_MESSAGE == 4096
    got = await read_message(Scripted(framed(4096)), pb.ChallengeRequest)
    assert len(got.username) == 4093
    with pytest.raises(RemoteProtocolError, match="^ChallengeRequest of at least 4097 bytes announced, over the "
                                                  "4096-byte limit$"):
        await read_message(Scripted(framed(4097)), pb.ChallengeRequest)
    assert (await read_message(Scripted(framed(200)), pb.ChallengeRequest, max_size=200)).username == "u" * 197
    with pytest.raises(RemoteProtocolError, match="over the 199-byte limit$"):
        await read_message(Scripted(framed(200)), pb.ChallengeRequest, max_size=199)


async def test_a_length_prefix_of_more_than_five_bytes_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="^Challenge length prefix is too long$"):
        await read_message(Scripted(b"\x80" * 5 + b"\x00"), pb.Challenge, max_size=1 << 40)
    assert await read_message(Scripted(b"\x80" * 4 + b"\x00"), pb.Challenge, max_size=1 << 40) == pb.Challenge()


async def test_garbled_or_incomplete_messages_are_the_peer_s_fault() -> None:
    from nat.proto import holepunch_pb2

    with pytest.raises(RemoteProtocolError, match="^garbled Challenge: "):
        await read_message(Scripted(b"\x02\x0a\xff"), pb.Challenge)
    with pytest.raises(RemoteProtocolError, match="^HolePunch lacks a required field$"):
        await read_message(Scripted(b"\x00"), holepunch_pb2.HolePunch)  # proto2: its type is required


async def test_a_message_that_does_not_come_in_time(autojump_clock: trio.testing.MockClock) -> None:
    started = trio.current_time()
    with pytest.raises(RemoteProtocolError, match="^no complete Challenge within 10 s$"):
        await read_message(Scripted(b"\x05", b"ab", delay=4), pb.Challenge)
    assert trio.current_time() - started == pytest.approx(10)
    assert MESSAGE_TIMEOUT == 10.0
    with pytest.raises(RemoteProtocolError, match="^no complete Challenge within 2.5 s$"):
        await read_message(Scripted(delay=9), pb.Challenge, timeout=2.5)
    assert (await read_message(Scripted(b"\x00", delay=9), pb.Challenge, timeout=9.5)) == pb.Challenge()
