"""AutoNAT v2: is this address of mine reachable from the internet? (libp2p/specs autonat/autonat-v2.md)

Why not py-libp2p's AutoNAT: it "dials back" over the connection it already
has, so a firewalled peer is told it is public. Here the server dials the one
address it picked on a *new* connection and proves it by sending the client's
random nonce over it; the client believes only a dial-back that carries its
nonce. A server can therefore lie about failures, not about successes, which
is why one verified success confirms an address and several failures are
needed to call it unreachable (:mod:`nat.reachability`).

Amplification guard: a server will only dial an IP other than the one the
request came from after the client has paid for it with ``dial_data`` bytes
(30 KB by default, the spec asks for 30-100 KB), so it cannot be used to
point handshakes at a third party for free.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from dataclasses import dataclass

import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import Node
from p2p.addresses import ip_family, is_relayed, reachable_tcp, without_peer_id
from p2p.errors import ConfigError, DedlocError, RemoteProtocolError
from p2p.hooks import Metrics, Registration
from p2p.resources import ResourceLimitExceeded
from p2p.trio_util import finish_quietly
from p2p.untrusted import decode_addr
from p2p.wire import MAX_ADDRS, read_message, write_message

from .proto import autonat_v2_pb2 as pb

log = logging.getLogger(__name__)

DIAL_REQUEST = "/libp2p/autonat/2/dial-request"
DIAL_BACK = "/libp2p/autonat/2/dial-back"
#: Spec: dial data travels in chunks of at most 4096 bytes.
DATA_CHUNK = 4096
#: Peers whose last dial-back verdict the server remembers (the oldest go first).
MAX_VERDICTS = 4096


@dataclass
class AutoNATConfig:
    #: Dial private and loopback addresses too (LAN swarms, tests); public ones only otherwise.
    allow_private: bool = False
    #: Bytes a client must send before we dial an IP other than its own.
    dial_data: int = 30_000
    #: Most bytes we agree to send when a server asks.
    max_dial_data: int = 100_000
    #: Dial-backs this server runs at once; a request beyond them waits in line for one.
    max_concurrent: int = 8
    #: Requests waiting for a dial-back, and how long each waits, before E_REQUEST_REJECTED. A client
    #: may never ask again after a rejection (js-libp2p asks each server once per connection), and a
    #: dial-back to a NAT that drops the SYN holds its slot for ``dial_timeout``: with 8 slots, a
    #: rejection at once cost a public js peer its verdict while NATed peers' dial-backs ran (CI).
    max_waiting: int = 32
    slot_wait: float = 10.0
    #: Time for one dial-back (connect, handshake, nonce) and for a whole request.
    dial_timeout: float = 10.0
    request_timeout: float = 30.0

    def validate(self) -> None:
        if self.dial_data < 0 or self.max_dial_data < 0:
            raise ConfigError("dial data sizes must not be negative")
        if self.max_concurrent < 1:
            raise ConfigError("AutoNAT rate limits must be at least 1")
        if self.max_waiting < 0 or self.slot_wait < 0:
            raise ConfigError("the AutoNAT waiting line must not be negative")
        if self.dial_timeout <= 0 or self.request_timeout <= 0:
            raise ConfigError("AutoNAT timeouts must be positive")


@dataclass(frozen=True)
class DialResult:
    """One server's verdict on one of our addresses (``reachable`` None: no verdict)."""

    server: ID
    addr: Multiaddr | None
    reachable: bool | None
    detail: str


class AutoNATError(DedlocError):
    """A reachability check could not be made (the server refused, broke the protocol, timed out).

    ``status``: the server's response status when it answered without a verdict (``E_DIAL_REFUSED``:
    no address it would dial; ``E_REQUEST_REJECTED``: over its limits), else None."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


def _ip(addr: Multiaddr) -> str:
    return str(list(addr.items())[0][1])


class AutoNATServer:
    """Answers dial-requests: dial the first acceptable address on a fresh connection, prove it with the nonce."""

    def __init__(self, node: Node, config: AutoNATConfig | None = None) -> None:
        self._node = node
        self.config = config or AutoNATConfig()
        self.config.validate()
        self._slots = trio.Semaphore(self.config.max_concurrent)
        self._waiting = 0
        #: Per peer that asked, ``public`` once a dial-back reached one of its addresses, else
        #: ``unreachable`` (newest last); the live page shows it as what this server knows of its NAT.
        self.verdicts: dict[ID, str] = {}
        self.counts: Counter[str] = Counter({"requests": 0, "rejected": 0, "refused": 0, "dial_backs": 0, "dial_back_ok": 0, "dial_data_asked": 0})

    def install(self) -> Registration:
        return self._node.set_stream_handler(DIAL_REQUEST, self._on_request)

    def metrics(self) -> Metrics:
        return dict(self.counts)

    def _rate_limited(self, stream: INetStream, peer: ID) -> bool:
        """Over the node's AutoNAT rates (``p2p/resources.py``): per peer, and per requesting IP
        (fresh peer ids cost nothing; addresses do)."""
        resources, now = self._node.resources, trio.current_time()
        observed = stream.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
        try:
            resources.allow("autonat", str(peer), now)
            if observed is not None:
                resources.allow("autonat.address", str(observed[0]), now)
        except ResourceLimitExceeded as e:
            log.debug("AutoNAT request from %s rejected: %s", peer, e)
            return True
        return False

    async def _on_request(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        self.counts["requests"] += 1
        with trio.move_on_after(self.config.request_timeout):
            try:
                await self._serve(stream, peer)
            except RemoteProtocolError as e:
                log.info("bad AutoNAT request from %s: %s", peer, e)
                await finish_quietly(stream.reset)
                return
            except Exception as e:  # the client went away mid-request: nothing to answer
                log.debug("AutoNAT request from %s ended early: %r", peer, e)
                await finish_quietly(stream.reset)
                return
        await finish_quietly(stream.close)

    async def _reject(self, stream: INetStream) -> None:
        """Over a limit: E_REQUEST_REJECTED, counted."""
        self.counts["rejected"] += 1
        await self._respond(stream, pb.DialResponse.E_REQUEST_REJECTED)

    async def _respond(self, stream: INetStream, status: int, index: int = 0, dial: int = 0) -> None:
        response = pb.DialResponse(status=status, addrIdx=index, dialStatus=dial)  # type: ignore[arg-type]
        await write_message(stream, pb.Message(dialResponse=response))

    async def _serve(self, stream: INetStream, peer: ID) -> None:
        msg = await read_message(stream, pb.Message)
        if msg.WhichOneof("msg") != "dialRequest":
            raise RemoteProtocolError("the first AutoNAT message is not a DialRequest")
        request = msg.dialRequest
        if self._rate_limited(stream, peer):
            await self._reject(stream)
            return
        # addrIdx is the place in the request (garbage entries count), among the first MAX_ADDRS.
        parsed = ((i, decode_addr(bytes(raw))) for i, raw in enumerate(list(request.addrs)[:MAX_ADDRS]))
        families = self._families()
        found = next(((i, a) for i, a in parsed if a is not None and reachable_tcp(a, allow_private=self.config.allow_private)
                      and ip_family(a) in families), None)
        if found is None:
            self.counts["refused"] += 1
            await self._respond(stream, pb.DialResponse.E_DIAL_REFUSED)
            return
        index, target = found[0], without_peer_id(found[1])
        observed = stream.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
        if observed is None or _ip(target) != str(observed[0]):
            # Another IP than the requester's: make it pay before we dial anyone for it.
            self.counts["dial_data_asked"] += 1
            await write_message(stream, pb.Message(dialDataRequest=pb.DialDataRequest(addrIdx=index, numBytes=self.config.dial_data)))
            received = 0
            while received < self.config.dial_data:
                chunk = await read_message(stream, pb.Message, max_size=DATA_CHUNK + 64)
                if chunk.WhichOneof("msg") != "dialDataResponse":
                    raise RemoteProtocolError("expected DialDataResponse")
                received += len(chunk.dialDataResponse.data)
            try:  # and however many pay, an address that is not theirs is dialed only so often
                self._node.resources.allow("autonat.dial_back", _ip(target), trio.current_time())
            except ResourceLimitExceeded:
                await self._reject(stream)
                return
        if not await self._take_slot():
            await self._reject(stream)
            return
        try:
            status = await self._dial_back(peer, target, request.nonce)
        finally:
            self._slots.release()
        # public once any of its addresses answered: a peer asks about each of its addresses in turn,
        # and one it cannot be reached at (a second interface, an old mapping) does not undo that
        verdict = "public" if status == pb.OK or self.verdicts.get(peer) == "public" else "unreachable"
        self.verdicts.pop(peer, None)
        self.verdicts[peer] = verdict
        while len(self.verdicts) > MAX_VERDICTS:
            del self.verdicts[next(iter(self.verdicts))]
        await self._respond(stream, pb.DialResponse.OK, index, status)

    async def _take_slot(self) -> bool:
        """One of ``max_concurrent`` dial-back slots, waiting in line up to ``slot_wait``; False when
        the line is full or the wait ran out (the caller must release a slot it got)."""
        try:
            self._slots.acquire_nowait()
            return True
        except trio.WouldBlock:
            if self._waiting >= self.config.max_waiting:
                return False
        self._waiting += 1
        try:
            with trio.move_on_after(self.config.slot_wait):
                await self._slots.acquire()
                return True
            return False
        finally:
            self._waiting -= 1

    def _families(self) -> set[str | None]:
        """The address families we can dial back: IPv4 (a NAT lets us dial out), and IPv6 where this host
        has an acceptable IPv6 address (a global one; any, when private ones are allowed). A server with
        no IPv6 refuses an IPv6 address (the spec's E_DIAL_REFUSED): its failed dial would tell the
        client it is unreachable there, when it only cannot be judged from here."""
        six = any(reachable_tcp(a, allow_private=self.config.allow_private) for a in self._node.interface_addrs("ip6"))
        return {"ip4", "ip6"} if six else {"ip4"}

    async def _dial_back(self, peer: ID, target: Multiaddr, nonce: int) -> int:
        """Dial ``target`` on a new connection and hand over the nonce there."""
        self.counts["dial_backs"] += 1
        conn = None
        with trio.move_on_after(self.config.dial_timeout):
            try:
                conn = await self._node.network.dial_addr(target, peer)
            except Exception as e:
                log.debug("dial-back to %s at %s failed: %s", peer, target, e)
        if conn is None:
            return pb.E_DIAL_ERROR
        try:
            with trio.fail_after(self.config.dial_timeout):
                back = await self._node.new_stream_on(conn, DIAL_BACK)
                await write_message(back, pb.DialBack(nonce=nonce))
                await read_message(back, pb.DialBackResponse)
                await finish_quietly(back.close)
        except Exception as e:
            log.debug("dial-back to %s connected but the nonce did not get through: %s", peer, e)
            return pb.E_DIAL_BACK_ERROR
        finally:
            await finish_quietly(conn.close)
        self.counts["dial_back_ok"] += 1
        return pb.OK


class AutoNATClient:
    """Asks servers to dial our addresses and believes only dial-backs carrying our nonce."""

    def __init__(self, node: Node, config: AutoNATConfig | None = None) -> None:
        self._node = node
        self.config = config or AutoNATConfig()
        self._waiting: dict[int, trio.Event] = {}

    def install(self) -> Registration:
        return self._node.set_stream_handler(DIAL_BACK, self._on_dial_back)

    async def _on_dial_back(self, stream: INetStream) -> None:
        try:
            msg = await read_message(stream, pb.DialBack)
        except (StreamError, DedlocError, OSError, EOFError) as e:  # RemoteProtocolError is a DedlocError
            log.debug("a dial-back stream from %s ended before its nonce: %r", stream.muxed_conn.peer_id, e)
            await finish_quietly(stream.reset)
            return
        # Proof only on a connection the server opened to us, directly: not one we dialed, not a relayed one.
        conn = stream.muxed_conn
        fresh = getattr(conn, "is_initiator", True) is False and not any(is_relayed(a) for a in conn.get_transport_addresses())
        event = self._waiting.get(msg.nonce)
        if event is not None and fresh:
            event.set()
        try:
            await write_message(stream, pb.DialBackResponse(status=pb.DialBackResponse.OK))
        except (StreamError, DedlocError, OSError) as e:
            # the nonce is what proves the path; a server that hangs up first changes nothing
            log.debug("dial-back from %s: the answer did not get through: %r", conn.peer_id, e)
            await finish_quietly(stream.reset)
            return
        await finish_quietly(stream.close)

    async def check(self, server: ID, addrs: list[Multiaddr]) -> DialResult:
        """Ask ``server`` to dial one of ``addrs`` (best first); raises :class:`AutoNATError` when it gives no verdict."""
        if not addrs:
            raise AutoNATError("no address to check")
        nonce = secrets.randbits(64)
        arrived = trio.Event()
        self._waiting[nonce] = arrived
        try:
            return await self._check(server, addrs, nonce, arrived)
        finally:
            del self._waiting[nonce]

    async def _check(self, server: ID, addrs: list[Multiaddr], nonce: int, arrived: trio.Event) -> DialResult:
        try:
            stream = await self._node.new_stream(server, DIAL_REQUEST)
        except DedlocError as e:
            raise AutoNATError(f"{server} does not serve AutoNAT v2: {e}") from e
        try:
            with trio.fail_after(self.config.request_timeout):
                request = pb.DialRequest(addrs=[without_peer_id(a).to_bytes() for a in addrs], nonce=nonce)
                await write_message(stream, pb.Message(dialRequest=request))
                asked = False
                while True:
                    msg = await read_message(stream, pb.Message, timeout=self.config.request_timeout)
                    kind = msg.WhichOneof("msg")
                    if kind == "dialDataRequest":
                        if asked:  # one DialDataRequest per request (spec); more would drain us
                            raise RemoteProtocolError("server asks for dial data again")
                        asked = True
                        await self._pay(stream, msg.dialDataRequest.numBytes)
                    elif kind == "dialResponse":
                        break
                    else:
                        raise RemoteProtocolError(f"unexpected AutoNAT message {kind}")
        except (RemoteProtocolError, trio.TooSlowError) as e:
            await finish_quietly(stream.reset)
            raise AutoNATError(f"AutoNAT check with {server} failed: {e}") from e
        except Exception as e:
            await finish_quietly(stream.reset)
            raise AutoNATError(f"AutoNAT check with {server} broke: {e!r}") from e
        await finish_quietly(stream.close)
        response = msg.dialResponse
        if response.status != pb.DialResponse.OK:
            name = pb.DialResponse.ResponseStatus.Name(response.status) if response.status in pb.DialResponse.ResponseStatus.values() else str(response.status)
            raise AutoNATError(f"{server} gave no verdict: {name}", status=name)
        if response.addrIdx >= len(addrs):
            raise AutoNATError(f"{server} answered for address #{response.addrIdx} of {len(addrs)}")
        addr = addrs[response.addrIdx]
        if response.dialStatus == pb.OK:
            if arrived.is_set():
                return DialResult(server, addr, True, "dial-back with our nonce arrived")
            return DialResult(server, addr, None, "server claims a dial-back that never arrived: ignored")
        if response.dialStatus == pb.E_DIAL_ERROR:
            return DialResult(server, addr, False, "server could not connect")
        return DialResult(server, addr, None, "server connected but could not deliver the nonce")

    async def _pay(self, stream: INetStream, size: int) -> None:
        if size > self.config.max_dial_data:
            raise RemoteProtocolError(f"server asks {size} bytes of dial data, over our {self.config.max_dial_data}")
        chunk = pb.Message(dialDataResponse=pb.DialDataResponse(data=bytes(DATA_CHUNK)))
        sent = 0
        while sent < size:
            await write_message(stream, chunk)
            sent += DATA_CHUNK
