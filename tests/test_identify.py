"""Identify alone (p2p/identify.py): the verdicts on an answer, pure, with real keys and signed
records; and asking, answering and pushing over scripted streams (resets tried again, an oversized,
garbled or missing answer refused with :class:`IdentifyError`, every stream closed or reset).

The Node's identify over real connections (observed addresses, our end of the connection, pushes
and the rate on them) stays in tests/test_node.py.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import trio
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.network.stream.exceptions import StreamClosed, StreamReset
from libp2p.peer.envelope import seal_record
from libp2p.peer.id import ID
from libp2p.peer.peer_record import PeerRecord
from multiaddr import Multiaddr

from p2p.errors import StreamBrokenError
from p2p.identify import (MAX_IDENTIFY_SIZE, PUSH_PROTOCOL, PUSH_TIMEOUT, IdentifyError, identify, push_identify,
                          send_identify, verify_identify)
from p2p.noise import NoiseSession
from p2p.varint import encode_varint

from .test_rpc_stream import Scripted

LISTEN = Multiaddr("/ip4/127.0.0.5/tcp/4001")
OBSERVED = Multiaddr("/ip4/127.0.0.9/tcp/52000")


def keys() -> tuple[KeyPair, ID]:
    pair = create_new_key_pair()
    return pair, ID.from_pubkey(pair.public_key)


def signed_record(pair: KeyPair, peer: ID, *addrs: Multiaddr) -> bytes:
    return bytes(seal_record(PeerRecord(peer, list(addrs)), pair.private_key).marshal_envelope())


def answer_of(pair: KeyPair, peer: ID, **fields: object) -> Identify:
    """What an honest peer answers: its key, its signed record, and ``fields``."""
    msg = Identify(public_key=pair.public_key.serialize(), signedPeerRecord=signed_record(pair, peer, LISTEN),
                   agent_version="dedloc/test", protocol_version="ipfs/0.1.0", protocols=["/ipfs/ping/1.0.0"],
                   listen_addrs=[LISTEN.to_bytes()], observed_addr=OBSERVED.to_bytes())
    for name, value in fields.items():
        if isinstance(value, list):
            msg.ClearField(name)  # type: ignore[arg-type]
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


def reads_of(data: bytes) -> list[bytes]:
    """A varint-prefixed message as the stream gives it: the prefix a byte per read, then the body."""
    prefix = encode_varint(len(data))
    return [prefix[i:i + 1] for i in range(len(prefix))] + ([data] if data else [])


class Opener:
    """``open_stream`` for :func:`identify`: hands out the scripted streams in turn, recording what was asked."""

    def __init__(self, *streams: Scripted) -> None:
        self.streams = list(streams)
        self.asked: list[tuple[ID, str]] = []
        self.at: list[float] = []

    async def __call__(self, peer: ID, protocol: str) -> INetStream:
        self.asked.append((peer, protocol))
        self.at.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        return self.streams.pop(0)  # type: ignore[return-value]


# ---------------------------------------------------------------------- verdicts, pure


def test_an_honest_answer_verifies_whole() -> None:
    pair, peer = keys()
    info = verify_identify(peer, answer_of(pair, peer, listen_addrs=[LISTEN.to_bytes()] * 1 + [
        Multiaddr(f"/ip4/127.0.0.{i}/tcp/4001").to_bytes() for i in range(10, 50)]))
    assert info.peer_id == peer and info.public_key_valid and info.signed_record_valid
    assert info.problems == []
    assert info.signed_record_addrs == [LISTEN]
    assert (info.agent_version, info.protocol_version, info.protocols) == ("dedloc/test", "ipfs/0.1.0",
                                                                           ["/ipfs/ping/1.0.0"])
    assert info.observed_addr == OBSERVED
    # all 41 parsed: the 64 KiB answer bounds them, and whoever stores them keeps its own cap
    assert len(info.listen_addrs) == 41 and info.listen_addrs[0] == LISTEN
    assert info.local_addr is None


def test_what_is_missing_is_said() -> None:
    _, peer = keys()
    info = verify_identify(peer, Identify(agent_version="bare"))
    assert info.public_key_valid is False and info.signed_record_valid is False
    assert info.problems == ["no public key", "no signed peer record"]
    assert info.signed_record_addrs == [] and info.listen_addrs == [] and info.observed_addr is None
    assert info.agent_version == "bare"
    pair, peer = keys()
    empty_record = verify_identify(peer, answer_of(pair, peer, signedPeerRecord=b""))
    assert empty_record.public_key_valid and not empty_record.signed_record_valid
    assert empty_record.problems == ["no signed peer record"]


def test_another_peer_s_key_or_record_is_not_taken() -> None:
    pair, peer = keys()
    other_pair, other = keys()
    info = verify_identify(peer, answer_of(pair, peer, public_key=other_pair.public_key.serialize(),
                                           signedPeerRecord=signed_record(other_pair, other, LISTEN)))
    assert not info.public_key_valid and not info.signed_record_valid
    assert info.problems == ["public key does not hash to the peer id",
                             f"signed peer record names another peer ({other})"]
    assert info.signed_record_addrs == [LISTEN]  # what it says, for the record; the verdict says not to use it
    # a record signed by the right key, naming another peer, is as bad
    named_other = verify_identify(peer, answer_of(pair, peer, signedPeerRecord=signed_record(pair, other)))
    assert named_other.public_key_valid and not named_other.signed_record_valid
    assert named_other.problems == [f"signed peer record names another peer ({other})"]
    assert named_other.signed_record_valid is False


def test_garbled_key_record_and_addresses_are_problems_not_errors() -> None:
    pair, peer = keys()
    record = bytearray(signed_record(pair, peer, LISTEN))
    record[-1] ^= 0xFF  # the signature no longer verifies
    info = verify_identify(peer, answer_of(pair, peer, public_key=b"\x08\x01\x12\x03abc", signedPeerRecord=bytes(record),
                                           listen_addrs=[b"\xff\xff", LISTEN.to_bytes()], observed_addr=b"\x00junk"))
    assert not info.public_key_valid and not info.signed_record_valid
    assert len(info.problems) == 2
    assert info.problems[0].startswith("public key undecodable: ")
    assert info.problems[1].startswith("signed peer record invalid: ")
    assert info.signed_record_addrs == []
    assert info.listen_addrs == [LISTEN] and info.observed_addr is None


# ---------------------------------------------------------------------- asking


async def test_identify_asks_once_reads_the_answer_and_closes_its_stream() -> None:
    pair, peer = keys()
    stream = Scripted(*reads_of(answer_of(pair, peer).SerializeToString()))
    opener = Opener(stream)
    info = await identify(opener, peer)
    assert opener.asked == [(peer, IDENTIFY_PROTOCOL)]
    assert info.public_key_valid and info.signed_record_valid and info.listen_addrs == [LISTEN]
    assert info.local_addr is None  # not a Noise session below: no end of ours to name
    assert (stream.closes, stream.resets, stream.writes) == (1, 0, [])
    assert stream.reads == []  # the answer read whole, not a byte past it


async def test_a_reset_stream_is_asked_again_three_times_then_given_up(autojump_clock: object) -> None:
    pair, peer = keys()
    resets = [Scripted(StreamReset()) for _ in range(3)]
    opener = Opener(*resets, Scripted(*reads_of(answer_of(pair, peer).SerializeToString())))
    start = trio.current_time()
    info = await identify(opener, peer)
    assert info.signed_record_valid and len(opener.asked) == 4
    assert [round(t - start, 3) for t in opener.at] == [0, 0.1, 0.3, 0.7]  # 0.1, 0.2 and 0.4 s apart
    assert all(s.closes == 1 for s in resets)

    always = [Scripted(StreamReset()) for _ in range(4)]
    with pytest.raises(IdentifyError, match=f"{peer} reset its identify stream 4 times: StreamReset"):
        await identify(Opener(*always), peer)
    assert all(s.closes == 1 for s in always)


async def test_a_stream_that_broke_otherwise_is_not_asked_again() -> None:
    _, peer = keys()
    broken = Scripted(StreamClosed("connection ended"))
    opener = Opener(broken, Scripted())
    with pytest.raises(StreamBrokenError, match="connection ended"):
        await identify(opener, peer)
    assert len(opener.asked) == 1 and broken.closes == 1


@pytest.mark.parametrize("reads, words", [
    ([b""], "the stream ended before the Identify was complete"),
    ([encode_varint(10), b"\x0a\x05abc", b""], "the stream ended before the Identify was complete"),
    (reads_of(b"\x0a\xff\xff\xff\xff\xff\xff"), "garbled Identify"),
    ([encode_varint(MAX_IDENTIFY_SIZE + 1)[i:i + 1] for i in range(3)],
     f"Identify of at least {MAX_IDENTIFY_SIZE + 1} bytes announced, over the {MAX_IDENTIFY_SIZE}-byte limit"),
])
async def test_a_missing_short_garbled_or_oversized_answer_is_an_identify_error(
        reads: list[bytes], words: str) -> None:
    _, peer = keys()
    stream = Scripted(*reads, b"never read")
    with pytest.raises(IdentifyError, match=f"identify answer from {peer}: {words}"):
        await identify(Opener(stream), peer)
    assert stream.closes == 1


async def test_an_answer_of_the_largest_size_is_taken() -> None:
    pair, peer = keys()
    honest = answer_of(pair, peer)
    honest.ClearField("agent_version")
    # the rest, the field's tag (1 byte) and its length (3 bytes for 16 KiB to 2 MiB), then the text
    honest.agent_version = "x" * (MAX_IDENTIFY_SIZE - len(honest.SerializeToString()) - 1 - 3)
    data = honest.SerializeToString()
    assert len(data) == MAX_IDENTIFY_SIZE
    info = await identify(Opener(Scripted(*reads_of(data))), peer)
    assert info.agent_version == honest.agent_version


@pytest.mark.parametrize("timeout", [None, 3.0, 25.0])
async def test_a_silent_peer_is_given_up_on_at_the_timeout(autojump_clock: object, timeout: float | None) -> None:
    """10 s unless told; a longer timeout is the answer's too (not the 10 s of one control message)."""
    _, peer = keys()
    stream = Scripted()
    start = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        if timeout is None:
            await identify(Opener(stream), peer)
        else:
            await identify(Opener(stream), peer, timeout=timeout)
    assert trio.current_time() - start == pytest.approx(10.0 if timeout is None else timeout)
    assert stream.closes == 1


async def test_the_answer_names_our_end_of_the_connection_it_came_over() -> None:
    """With two connections to a peer, only our end of this one says which the observation is of."""
    pair, peer = keys()
    with socket.socket() as ours:
        ours.bind(("127.0.0.1", 0))
        session = object.__new__(NoiseSession)  # the Noise session under the stream: only its socket is read
        session._socket = SimpleNamespace(socket=ours)  # type: ignore[assignment]
        stream = Scripted(*reads_of(answer_of(pair, peer).SerializeToString()))
        stream.muxed_conn = SimpleNamespace(secured_conn=session)  # type: ignore[attr-defined]
        info = await identify(Opener(stream), peer)
        assert info.local_addr == ours.getsockname()
        # over anything but a Noise session (a relayed stream): no end of ours to name
        relayed = Scripted(*reads_of(answer_of(pair, peer).SerializeToString()))
        relayed.muxed_conn = SimpleNamespace(secured_conn=object())  # type: ignore[attr-defined]
        assert (await identify(Opener(relayed), peer)).local_addr is None


# ---------------------------------------------------------------------- answering and pushing


async def test_send_identify_writes_the_prefixed_message_and_closes() -> None:
    stream = Scripted()
    await send_identify(stream, b"hello")  # type: ignore[arg-type]
    assert stream.writes == [b"\x05hello"] and (stream.closes, stream.resets) == (1, 0)


async def test_a_failed_write_resets_the_stream_and_raises() -> None:
    stream = Scripted()
    stream.write_error = StreamReset("gone")
    with pytest.raises(StreamReset):
        await send_identify(stream, b"hello")  # type: ignore[arg-type]
    assert (stream.closes, stream.resets) == (0, 1)


async def test_a_push_opens_its_own_stream_and_is_bounded_in_time(autojump_clock: object) -> None:
    _, peer = keys()
    stream = Scripted()
    opener = Opener(stream)
    await push_identify(opener, peer, b"x" * 200)
    assert opener.asked == [(peer, PUSH_PROTOCOL)]
    assert stream.writes == [encode_varint(200) + b"x" * 200] and stream.closes == 1

    stalled = Scripted()
    stalled.hang.add("write")
    start = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        await push_identify(Opener(stalled), peer, b"x")
    assert trio.current_time() - start == pytest.approx(PUSH_TIMEOUT)
    assert stalled.resets == 1  # cut short: reset, not left open
    with pytest.raises(trio.TooSlowError):
        await push_identify(Opener(Scripted()), peer, b"x", timeout=0)
