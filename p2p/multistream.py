"""multistream-select 1.0, the dialer's side, in one flight instead of two round trips.

py-libp2p's ``MultiselectClient`` writes the ``/multistream/1.0.0`` header and
waits for its echo, then proposes a protocol and waits again: every
negotiation costs two round trips, and a connection has two of them (security,
then muxer) before the first stream adds a third. go-libp2p and js-libp2p send
header and proposal together, and where only one protocol is proposed, the
first application bytes with them ("lazy" selection): a refusal then surfaces
on the first read. This module does the same for dedloc's dialer:

* :func:`encode` and :class:`Reply`, the pure part: the wire format (a uvarint
  length, the message, ``\\n``) and the check of the listener's answer (the
  header echoed, then the protocol echoed, or ``na``), fed exactly the bytes it
  asks for (:attr:`Reply.wanted`), so nothing past the answer is ever consumed;
* :func:`select` (optimistic: header and proposal in one write, then the
  answer), for the muxer and for streams offered several protocols;
* :class:`LazySelect`, a wrapper of a connection or stream whose first write
  carries header and proposal, and whose first read checks the answer; used
  for the security protocol (the proposal rides with the first Noise message)
  and for streams opened with one protocol.

The listener's side stays py-libp2p's ``Multiselect``: it reads one exact
message at a time, so bytes that follow a proposal in the same flight are left
for the protocol they belong to.
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

from .admission import describe_refusal, is_admission_refusal
from .errors import CLOSED_SWARM_HINT, UNAUTHENTICATED, ProtocolNotSupportedError, RemoteProtocolError
from .resources import over_a_limit
from .varint import LengthPrefix, VarintTooLong, decode_varint, encode_varint

HEADER = "/multistream/1.0.0"
NA = "na"
#: What a dedloc listener answers, instead of the protocol, to a connection it refuses before
#: the handshake (``p2p/admission.py``; the reason follows, a :class:`p2p.admission.Refusal`)
#: or to a stream over a limit of the resource manager (the reason is the limit, in words).
#: Any other dialer reads it as an unexpected answer and gives up, as it should.
REFUSED_PREFIX = "/dedloc/refused/"
#: the longest refusal reason kept from a peer's answer
MAX_REASON = 160
#: the longest message accepted from a peer (protocol ids are short; the spec caps them at 64 KiB)
MAX_MESSAGE = 1024
#: the longest length prefix read (3 bytes: up to 2 MiB, past any message we accept)
MAX_LENGTH_BYTES = 3


class MultistreamError(RemoteProtocolError):
    """The peer's multistream-select answer was garbled, oversized or unexpected."""


class ProtocolRefused(ProtocolNotSupportedError, ValueError):
    """The peer answered ``na``: it speaks none of the protocols proposed.

    Also a ValueError for one reason: py-libp2p 0.8.1's ``NetStream.read`` passes
    ValueErrors through as they are and wraps anything else in its StreamError,
    and a lazily selected stream raises this from its first read.
    """


class PeerRefused(MultistreamError, ValueError):
    """The listener refused the connection before the handshake, or the stream over one of its
    limits or its gate (a closed swarm), and said why (:attr:`reason`).

    A ValueError for :class:`ProtocolRefused`'s reason: a lazily selected stream raises this from
    its first read, and py-libp2p's ``NetStream.read`` would otherwise hide it in a StreamError.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        if is_admission_refusal(reason):
            super().__init__(f"the peer refused the connection: {describe_refusal(reason)}")
        elif reason.startswith(UNAUTHENTICATED):  # a closed swarm's gate (p2p/auth.py): say what to do
            super().__init__(f"the peer refused the stream: {reason}; the swarm is closed: {CLOSED_SWARM_HINT}")
        else:
            super().__init__(f"the peer refused the stream: {reason}")

    @property
    def busy(self) -> bool:
        """Refused over one of the listener's resource limits: busy, not broken (retry later or elsewhere)."""
        return over_a_limit(self.reason)


def refusal_message(reason: str) -> str:
    """The message a listener answers a proposal with to refuse it, saying why."""
    return REFUSED_PREFIX + reason[:MAX_REASON]


def refusal(reason: str) -> bytes:
    """A listener's whole answer refusing a connection or stream: the header, then the reason."""
    return encode(HEADER, refusal_message(reason))


def encode(*messages: str) -> bytes:
    """``messages`` as multistream-select frames, back to back (one write)."""
    out = bytearray()
    for message in messages:
        body = message.encode() + b"\n"
        out += encode_varint(len(body))
        out += body
    return bytes(out)


def complete_messages(data: bytes) -> int:
    """How many whole multistream messages ``data`` starts with (a peer's first flight).

    A listener's first flight is the header alone; a dialer's is the header and a
    proposal: two messages tell them apart (:func:`p2p.dialer.dial_simultaneous`).
    Stops at the first incomplete or malformed message.
    """
    count = pos = 0
    while pos < len(data):
        try:
            decoded = decode_varint(data, pos, max_bytes=MAX_LENGTH_BYTES)
        except VarintTooLong:
            return count
        if decoded is None:
            return count
        length, pos = decoded
        if not 1 <= length <= MAX_MESSAGE or pos + length > len(data) or data[pos + length - 1] != 0x0A:
            return count
        pos += length
        count += 1
    return count


class Reply:
    """The listener's answer to ``header + proposal``: the header, then the protocol or ``na``.

    Sans I/O: :attr:`wanted` is how many bytes to read next (exactly that many, so
    nothing after the answer is consumed); :meth:`feed` takes them. ``done`` once
    the protocol was confirmed; :class:`ProtocolRefused` on ``na``,
    :class:`MultistreamError` on anything else.
    """

    def __init__(self, protocol: str, *, header: bool = True) -> None:
        """``header``: whether the header's echo comes first (not for a second proposal)."""
        self.protocol = protocol
        self.done = False
        self._header_seen = not header
        self._length: int | None = None  # of the message being read (None: still in its varint)
        self._prefix = LengthPrefix(max_bytes=MAX_LENGTH_BYTES)

    @property
    def wanted(self) -> int:
        if self.done:
            return 0
        return 1 if self._length is None else self._length

    def feed(self, data: bytes) -> None:
        if self.done:
            raise MultistreamError("multistream answer already complete")
        if len(data) != self.wanted:
            raise ValueError(f"fed {len(data)} bytes where {self.wanted} were wanted")
        if self._length is None:
            try:
                length = self._prefix.feed(data[0])
            except VarintTooLong:
                raise MultistreamError(f"multistream message length does not fit in {MAX_LENGTH_BYTES} bytes") from None
            if length is None:
                return
            self._prefix = LengthPrefix(max_bytes=MAX_LENGTH_BYTES)
            if not 1 <= length <= MAX_MESSAGE:
                raise MultistreamError(f"multistream message of {length} bytes (1..{MAX_MESSAGE} allowed)")
            self._length = length
            return
        self._length = None
        if not data.endswith(b"\n"):
            raise MultistreamError(f"multistream message without its newline: {data[:64]!r}")
        message = data[:-1].decode(errors="replace")
        if not self._header_seen:
            if message != HEADER:
                raise MultistreamError(f"the peer does not speak {HEADER} (it sent {message[:64]!r})")
            self._header_seen = True
        elif message == self.protocol:
            self.done = True
        elif message == NA:
            raise ProtocolRefused(f"the peer does not speak {self.protocol}")
        elif message.startswith(REFUSED_PREFIX):
            raise PeerRefused(message[len(REFUSED_PREFIX):][:MAX_REASON])
        else:
            raise MultistreamError(f"the peer answered {message[:64]!r} to a proposal of {self.protocol}")


class Conn(Protocol):
    """What a negotiation needs of a connection or stream."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


async def read_reply(conn: Conn, reply: Reply) -> None:
    """Read ``reply`` from ``conn``, exactly its bytes; EOF is a :class:`MultistreamError`."""
    while not reply.done:
        wanted = reply.wanted
        data = b""
        while len(data) < wanted:
            try:
                part = await conn.read(wanted - len(data))
            except EOFError:
                part = b""
            if not part:
                raise MultistreamError(f"the peer closed while negotiating {reply.protocol}")
            data += part
        reply.feed(data)


async def select(conn: Conn, protocols: list[str]) -> str:
    """Optimistic selection: header and the first proposal in one write, the others one by one
    after an ``na``; the protocol the peer confirmed. :class:`ProtocolRefused` when none."""
    if not protocols:
        raise ValueError("no protocol to propose")
    await conn.write(encode(HEADER, protocols[0]))
    reply = Reply(protocols[0])
    for i, protocol in enumerate(protocols):
        if i:
            await conn.write(encode(protocol))
            reply = Reply(protocol, header=False)  # the header was answered with the first proposal
        try:
            await read_reply(conn, reply)
            return protocol
        except ProtocolRefused:
            pass  # the next proposal, if there is one
    raise ProtocolRefused(f"the peer speaks none of {', '.join(protocols)}")


class LazySelect:
    """``inner`` (a raw connection or a stream) with ``protocol`` proposed lazily.

    The first write sends header, proposal and the data in one go; the first read
    or half-close sends the proposal if it has not gone yet, then checks the
    answer, raising :class:`ProtocolRefused` or :class:`MultistreamError`.
    Everything else is ``inner``'s.
    """

    def __init__(self, inner: Any, protocol: str) -> None:
        self.inner = inner
        self.protocol = protocol
        self._preamble: bytes | None = encode(HEADER, protocol)
        self._reply = Reply(protocol)
        # a reader that sends the proposal alone and a writer must not reorder it and the data
        self._first = trio.Lock()
        # a reader and a half-close must not read the answer at once
        self._answer = trio.Lock()

    @property
    def negotiated(self) -> bool:
        """Whether the peer confirmed the protocol (a read has checked its answer)."""
        return self._reply.done

    async def write(self, data: bytes) -> None:
        if self._preamble is None and not self._first.locked():
            await self.inner.write(data)
            return
        async with self._first:
            if self._preamble is not None:
                data, self._preamble = self._preamble + bytes(data), None
            await self.inner.write(data)

    async def read(self, n: int | None = None) -> bytes:
        await self._confirm()
        return bytes(await self.inner.read(n))

    async def close_write(self) -> None:
        """Half-close once the peer confirmed the protocol: js-libp2p 3.x's listener drops
        the data of a stream whose end arrives before it answered the proposal (it never
        runs the handler), so a request that ends with a half-close waits for the answer."""
        await self._confirm()
        await self.inner.close_write()

    async def _confirm(self) -> None:
        if self._reply.done:
            return
        async with self._answer:
            if self._reply.done:
                return
            await self._flush()
            try:
                await read_reply(self.inner, self._reply)
            except (MultistreamError, ProtocolRefused):
                reset = getattr(self.inner, "reset", None)  # a stream; a raw connection is closed by its owner
                if reset is not None:
                    await reset()
                raise

    async def _flush(self) -> None:
        if self._preamble is not None or self._first.locked():
            async with self._first:
                if self._preamble is not None:
                    preamble, self._preamble = self._preamble, None
                    await self.inner.write(preamble)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
