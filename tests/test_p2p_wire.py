"""p2p.wire's read_message and write_message (the relay, DCUtR, AutoNAT and access-pass messages) on a
scripted stream: a stream that breaks mid-message is a DedlocError that says why, never py-libp2p's bare
StreamReset (which the callers' `except (DedlocError, OSError, ...)` let through, ending their task)."""

from __future__ import annotations

import pytest
from libp2p.network.stream.exceptions import StreamClosed, StreamEOF, StreamReset

from p2p.errors import DedlocError, RemoteProtocolError, StreamBrokenError
from p2p.proto import auth_pb2 as pb
from p2p.wire import read_message, write_message


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
