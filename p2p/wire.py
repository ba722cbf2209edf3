"""Length-prefixed protobuf messages on a stream, and checks on what peers put in them.

Relay, DCUtR, AutoNAT and the access-pass protocols (``p2p/auth.py``,
``p2p/authority.py``) all send uvarint-length-prefixed protobuf messages, and
relay then hands the very same stream over as a connection. So a
message is read exactly (the prefix a byte at a time, then the body): nothing
past it may be consumed. Every read has a size cap and a deadline; every
address a peer sends is parsed and capped (:mod:`p2p.untrusted`) before anyone uses it.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import trio
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage
from libp2p.network.stream.exceptions import StreamError

from .errors import RemoteProtocolError, StreamBrokenError, describe
from .varint import LengthPrefix, VarintOverLimit, VarintTooLong, encode_varint

M = TypeVar("M", bound=ProtoMessage)

#: Default cap on one control message (the DCUtR spec says 4 KiB; the others are as small).
MAX_MESSAGE = 4096
#: Most addresses taken from one message; the rest are ignored.
MAX_ADDRS = 32
#: Time allowed for one control message to arrive.
MESSAGE_TIMEOUT = 10.0


class Stream(Protocol):
    """What these protocols need of a libp2p stream."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


async def write_message(stream: Stream, message: ProtoMessage) -> None:
    """Send one message; :class:`StreamBrokenError` if the stream was reset or closed."""
    body = message.SerializeToString()
    try:
        await stream.write(encode_varint(len(body)) + body)
    except StreamError as e:
        raise StreamBrokenError(f"could not send the {type(message).__name__}: {describe(e)}") from e


async def read_message(
    stream: Stream, message_type: type[M], *, max_size: int = MAX_MESSAGE, timeout: float = MESSAGE_TIMEOUT
) -> M:
    """Read one message and not a byte more; :class:`RemoteProtocolError` on anything wrong, and
    :class:`StreamBrokenError` if the stream is reset (or its connection ends) before it is whole."""
    what = message_type.__name__
    with trio.move_on_after(timeout) as scope:
        prefix = LengthPrefix(max_size, max_bytes=5)
        size: int | None = None
        try:
            while size is None:
                size = prefix.feed((await _read_some(stream, 1, what))[0])
        except VarintOverLimit as e:
            raise RemoteProtocolError(f"{what} of at least {e.value} bytes announced, over the {max_size}-byte limit"
                                      ) from None
        except VarintTooLong:
            raise RemoteProtocolError(f"{what} length prefix is too long") from None
        body = bytearray()
        while len(body) < size:
            body += await _read_some(stream, size - len(body), what)
    if scope.cancelled_caught:
        raise RemoteProtocolError(f"no complete {what} within {timeout:g} s")
    try:
        message = message_type.FromString(bytes(body))
    except DecodeError as e:
        raise RemoteProtocolError(f"garbled {what}: {e}") from None
    if not message.IsInitialized():  # proto2 required fields (DCUtR's type): upb parses without them
        raise RemoteProtocolError(f"{what} lacks a required field")
    return message


async def _read_some(stream: Stream, n: int, what: str) -> bytes:
    try:
        data = await stream.read(n)
        if data:
            return data
    except EOFError:
        pass
    except StreamError as e:
        raise StreamBrokenError(f"the stream broke before the {what} was complete: {describe(e)}") from e
    raise RemoteProtocolError(f"the stream ended before the {what} was complete")
