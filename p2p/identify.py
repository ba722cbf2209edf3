"""Asking a peer who it is (libp2p identify), and checking its answer.

py-libp2p runs identify in the background after each connection and quietly
drops what does not verify. Callers here (the CLI, interop tests, later AutoNAT)
need the answer itself and a verdict on it, so this asks explicitly and checks
that the public key hashes to the peer id and that the signed peer record's
signature and peer id are valid.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetStream
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.network.stream.exceptions import StreamReset
from libp2p.peer.envelope import consume_envelope
from libp2p.peer.id import ID
from libp2p.peer.peer_record import PEER_RECORD_ENVELOPE_DOMAIN
from multiaddr import Multiaddr

from .errors import RemoteProtocolError, StreamBrokenError, describe
from .noise import NoiseSession
from .trio_util import finish_quietly
from .untrusted import decode_addr, decode_addrs
from .varint import encode_varint
from .wire import read_message

#: libp2p identify/push: the identify message, sent unasked when it changes; no answer.
PUSH_PROTOCOL = "/ipfs/id/push/1.0.0"
#: One push's time to open its stream and write (a peer that stalls is left with what it had).
PUSH_TIMEOUT = 5.0
#: The time a peer's push has to arrive whole once its stream is open.
PUSH_READ_TIMEOUT = 10.0
#: After a change of what we advertise, how long to wait for the next before pushing: a verdict, a relay
#: slot and the addresses they bring come within moments of each other; one push says them all.
PUSH_DELAY = 0.25
#: Pushes under way at once.
PUSH_CONCURRENCY = 16
MAX_IDENTIFY_SIZE = 64 * 1024
#: Identify streams opened before a peer that resets each is given up on (see :func:`identify`).
IDENTIFY_ATTEMPTS = 4
#: Most self-reported listen addresses taken from one answer: the peer chooses how many it sends.
MAX_LISTEN_ADDRS = 32


class IdentifyError(RemoteProtocolError):
    """The peer's identify answer was missing, oversized or garbled, or it reset every stream asked on."""


@dataclass
class PeerIdentity:
    """What a peer said about itself, with verdicts on what it signed."""

    peer_id: ID
    agent_version: str
    protocol_version: str
    protocols: list[str]
    listen_addrs: list[Multiaddr]
    observed_addr: Multiaddr | None
    #: The public key was present and hashes to ``peer_id``.
    public_key_valid: bool
    #: A signed peer record was present, its signature verified and it names ``peer_id``.
    signed_record_valid: bool
    signed_record_addrs: list[Multiaddr] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: Our end (TCP ip, port) of the connection the answer came over, of which
    #: ``observed_addr`` is the peer's view; None when relayed or unknown. With two
    #: connections to a peer, only this one says which the observation is of.
    local_addr: tuple[str, int] | None = None


async def identify(open_stream: Callable[[ID, str], Awaitable[INetStream]], peer_id: ID, *,
                   timeout: float = 10.0) -> PeerIdentity:
    """Open an identify stream to a connected peer (``open_stream``: the Node's, which proposes
    the protocol lazily: the answer comes one round trip after the proposal) and verify it.

    js-libp2p serves one inbound identify stream per connection and resets a second
    one, and py-libp2p's host identifies every new connection by itself: a reset stream
    is tried again (three times, 0.1, 0.2 and 0.4 s later), within ``timeout``; then
    :class:`IdentifyError` (a leaving node resets it too: ``p2p/libp2p_host.py``).
    """
    with trio.fail_after(timeout):
        for attempt in range(IDENTIFY_ATTEMPTS):
            stream = await open_stream(peer_id, IDENTIFY_PROTOCOL)
            try:
                msg = await read_message(stream, Identify, max_size=MAX_IDENTIFY_SIZE, timeout=timeout)
                session = getattr(getattr(stream, "muxed_conn", None), "secured_conn", None)
                local = session.local_address() if isinstance(session, NoiseSession) else None
                break
            except StreamBrokenError as e:
                if not isinstance(e.__cause__, StreamReset):
                    raise  # its connection ended: asking again on it cannot help
                if attempt == IDENTIFY_ATTEMPTS - 1:
                    raise IdentifyError(f"{peer_id} reset its identify stream {attempt + 1} times: "
                                        f"{describe(e.__cause__)}") from e
            except RemoteProtocolError as e:
                raise IdentifyError(f"identify answer from {peer_id}: {e}") from e
            finally:
                await finish_quietly(stream.close, shield=True)  # timed out too: not left open
            await trio.sleep(0.1 * 2**attempt)
    info = verify_identify(peer_id, msg)
    info.local_addr = local
    return info


async def push_identify(open_stream: Callable[[ID, str], Awaitable[INetStream]], peer_id: ID, message: bytes, *,
                        timeout: float = PUSH_TIMEOUT) -> None:
    """Tell a connected peer our identify ``message`` unasked (identify/push, as go- and js-libp2p do when
    their addresses change): varint-prefixed on a stream of its own, which we close; the peer answers
    nothing and replaces what it knew of us. Raises what opening or writing raised, or ``trio.TooSlowError``."""
    with trio.fail_after(timeout):
        await send_identify(await open_stream(peer_id, PUSH_PROTOCOL), message)


async def send_identify(stream: INetStream, message: bytes) -> None:
    """Write an identify ``message`` (an answer or a push), varint-prefixed, and close the stream; a
    write that fails resets it and raises."""
    try:
        await stream.write(encode_varint(len(message)) + message)
    except BaseException:
        await finish_quietly(stream.reset, shield=True)  # timed out or cancelled too: not left open
        raise
    await finish_quietly(stream.close)


def verify_identify(peer_id: ID, msg: Identify) -> PeerIdentity:
    """Pure check of an identify message received from ``peer_id`` (no I/O)."""
    problems: list[str] = []
    key_ok = False
    if msg.HasField("public_key"):
        try:
            key_ok = ID.from_pubkey(deserialize_public_key(msg.public_key)) == peer_id
            if not key_ok:
                problems.append("public key does not hash to the peer id")
        except Exception as e:
            problems.append(f"public key undecodable: {e}")
    else:
        problems.append("no public key")

    record_ok = False
    record_addrs: list[Multiaddr] = []
    if msg.HasField("signedPeerRecord") and msg.signedPeerRecord:
        try:
            _, record = consume_envelope(msg.signedPeerRecord, PEER_RECORD_ENVELOPE_DOMAIN)
            record_ok = record.peer_id == peer_id
            record_addrs = list(record.addrs)
            if not record_ok:
                problems.append(f"signed peer record names another peer ({record.peer_id})")
        except Exception as e:
            problems.append(f"signed peer record invalid: {e}")
    else:
        problems.append("no signed peer record")

    return PeerIdentity(
        peer_id=peer_id,
        agent_version=msg.agent_version,
        protocol_version=msg.protocol_version,
        protocols=list(msg.protocols),
        # All parsed (the answer's 64 KiB cap bounds them); whoever stores them keeps MAX_LISTEN_ADDRS.
        listen_addrs=decode_addrs(msg.listen_addrs, limit=len(msg.listen_addrs)),
        observed_addr=decode_addr(bytes(msg.observed_addr)),  # None when absent (empty) or garbled
        public_key_valid=key_ok,
        signed_record_valid=record_ok,
        signed_record_addrs=record_addrs,
        problems=problems,
    )
