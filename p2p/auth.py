"""Allowlist authentication for a closed swarm (DeDLOC, Appendix I.5), checked once per connection.

A run's authority (:mod:`p2p.authority`) signs access passes: a username, the one
peer id it may act as, and an expiry. In an authenticated run every connection
begins with both sides sending their pass on ``/dedloc/auth/1.0.0``
(:class:`Hello`); until the peer's pass checked out, every other protocol it
opens is refused (``/dedloc/refused/unauthenticated``, before the protocol is
echoed) and every stream we would open to it waits, then fails with
:class:`AuthError`: requests and responses alike go only between passholders.

Why once per connection and not a signature per request as I.5 does: I.5 signs
each request with the receiver's key, a time and a nonce because hivemind's
channel did not authenticate peers. Ours does: the Noise handshake proves that
the remote end holds the private key of its peer id, and every later byte is
encrypted and authenticated under that session's keys. So, with the checks
below (:func:`verify_pass`), each of I.5's guarantees holds per request:

* *allowlisted sender*: the pass is signed by the authority we trust, names this
  connection's (Noise-proven) peer id, and has not expired;
* *unforgeable, unmodified*: only the holder of that peer's key can complete the
  handshake, and only the session's keys can write a record the receiver accepts;
* *meant for this receiver*: the dialer checked the remote's peer id in the
  handshake; the bytes cannot reach anyone else;
* *not replayable*: Noise's nonces reject a repeated or reordered record; a
  recorded session cannot be replayed on a new connection (fresh ephemeral keys),
  and a copied pass is useless without its peer's key;
* *expiry and revocation on long-lived connections*: every
  :attr:`AuthConfig.recheck_interval` the passes of connected peers are checked
  again and the connections of an expired one are closed; the authority renews
  no pass of a revoked user, so a revoked user is out within the pass lifetime
  plus the recheck interval (:data:`p2p.authority.DEFAULT_LIFETIME`: 15 min + 5 s).

The cost is one Ed25519 verification per connection (and per renewal), instead
of a signature and a verification per request (``bench/auth.py`` measures both).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio
from libp2p.abc import INetConn, INetStream
from libp2p.peer.id import ID
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from .errors import UNAUTHENTICATED, DedlocError, ProtocolNotSupportedError, RemoteProtocolError
from .hooks import ConnectionInfo, Registration, SwarmObserver
from .proto import auth_pb2 as pb
from .rpc.stream import TRANSPORT_ERRORS
from .trio_util import finish_quietly, start_cancellable
from .wire import read_message, write_message

log = logging.getLogger(__name__)

PROTOCOL = "/dedloc/auth/1.0.0"
#: The authority's issuing protocol (``p2p/authority.py``): a peer asks for its pass before it has one.
ISSUE_PROTOCOL = "/dedloc/auth/issue/1.0.0"
#: What the authority signs, before the token's bytes (no other signature in dedloc starts so).
SIGNING_DOMAIN = b"dedloc-access-token\n"
#: Protocols a peer may open before its pass checked out: this one, the authority's issuing one, and
#: identify (how to reach it; it carries nothing of the run).
PRE_AUTH = frozenset({PROTOCOL, ISSUE_PROTOCOL, "/ipfs/id/1.0.0", "/ipfs/id/push/1.0.0"})


class AuthError(DedlocError):
    """A peer without a valid access pass (or ours was refused): the reason says which check failed."""


@dataclass(frozen=True)
class Token:
    """A verified pass's contents."""

    username: str
    peer_id: ID
    expiration: float
    serial: int


@dataclass
class AuthConfig:
    """An authenticated run: whose passes count, and how strictly time is judged."""

    #: The authority's Ed25519 public key (32 bytes).
    authority: bytes
    #: Largest difference between a peer's clock and ours, and the grace on expirations (seconds).
    max_skew: float = 60.0
    #: How often the passes of connected peers are checked again (expired: connections closed).
    recheck_interval: float = 5.0
    #: How long a stream waits for the peer's pass before it is refused.
    verdict_timeout: float = 10.0
    #: Usernames refused even with a valid pass (what a node knows of revocations before they expire).
    revoked: frozenset[str] = frozenset()

    def validate(self) -> None:
        if len(self.authority) != 32:
            raise AuthError(f"the authority's key must be 32 bytes (Ed25519), got {len(self.authority)}")
        if not (0 <= self.max_skew <= 3600 and self.recheck_interval > 0 and self.verdict_timeout > 0):
            raise AuthError("max_skew must be in 0 .. 3600 s; recheck_interval and verdict_timeout positive")


def pass_expiration(access: pb.AccessPass) -> float:
    """When a pass expires (Unix seconds), read without verifying it (our own, to renew in time)."""
    token = pb.AccessToken()
    token.ParseFromString(access.token)
    return float(token.expiration)


def verify_pass(access: pb.AccessPass, config: AuthConfig, peer_id: ID, now: float) -> Token:
    """The pass's token if ``access`` is valid for ``peer_id`` at ``now``; else :class:`AuthError` with why.

    Checks, in order: the authority's signature over the token's bytes; that the pass names our
    authority; that it names ``peer_id`` (the connection's Noise-proven remote); its expiry (with
    ``max_skew`` of grace); that the user is not revoked. Pure: no I/O, no clock of its own.
    """
    try:
        VerifyKey(config.authority).verify(SIGNING_DOMAIN + access.token, access.signature)
    except (BadSignatureError, ValueError, TypeError):
        raise AuthError("the pass's signature is not our authority's") from None
    token = pb.AccessToken()
    try:
        token.ParseFromString(access.token)
    except Exception:
        raise AuthError("the pass's token does not decode") from None
    if token.authority != config.authority:
        raise AuthError("the pass names another authority")
    if token.peer_id != peer_id.to_bytes():
        raise AuthError("the pass was issued to another peer id")
    if token.expiration + config.max_skew < now:
        raise AuthError(f"the pass expired {now - token.expiration:.0f} s ago")
    if token.username in config.revoked:
        raise AuthError(f"user {token.username!r} is revoked")
    return Token(token.username, peer_id, float(token.expiration), token.serial)


def check_hello(hello: pb.Hello, config: AuthConfig, peer_id: ID, now: float) -> Token:
    """A peer's :class:`pb.Hello`: its pass (:func:`verify_pass`) and its clock within ``max_skew``."""
    if not hello.HasField("access"):
        raise AuthError("the peer shows no access pass (it is not a member of this closed swarm)")
    skew = abs(hello.time_ms / 1000.0 - now)
    if skew > config.max_skew:
        raise AuthError(f"the peer's clock is {skew:.0f} s off ours (the bound is {config.max_skew:.0f} s)")
    return verify_pass(hello.access, config, peer_id, now)


@dataclass
class _Verdict:
    """What we know of one peer: its pass (None: not yet, or refused) and why it was refused."""

    token: Token | None = None
    refused: str = ""
    decided: trio.Event = field(default_factory=trio.Event)


class Authenticator(SwarmObserver):
    """Both sides of ``/dedloc/auth/1.0.0`` on one Node, and the gate in front of every other protocol.

    Install it with :meth:`Node.authenticate` (before the node dials anyone), which runs it in the
    node's nursery (:meth:`attach`: greetings, and :meth:`recheck`). ``my_pass`` is ours (:meth:`renew` replaces it and
    tells every connected peer). ``clock``: wall time (passes expire in Unix time).
    """

    def __init__(self, node: AuthNode, config: AuthConfig, my_pass: pb.AccessPass, *,
                 clock: Callable[[], float] = time.time) -> None:
        config.validate()
        self._node = node
        self.config = config
        self.my_pass = my_pass
        self._clock = clock
        self._verdicts: dict[ID, _Verdict] = {}
        self._nursery: trio.Nursery | None = None
        #: Refusals by reason (the first words of the error), for the metrics and tests.
        self.refused: dict[str, int] = {}
        verify_pass(my_pass, config, node.peer_id, clock())  # our own pass must be good, clearly

    # ---------------------------------------------------------------- what the node asks

    def token_of(self, peer: ID) -> Token | None:
        verdict = self._verdicts.get(peer)
        return verdict.token if verdict is not None else None

    async def inbound(self, peer: ID, protocol: str) -> str | None:
        """None if ``peer`` may open ``protocol`` here, else the refusal's reason."""
        if protocol in PRE_AUTH:
            return None
        verdict = await self._wait(peer)
        return None if verdict.token is not None else f"{UNAUTHENTICATED}{verdict.refused}"

    async def outbound(self, peer: ID, protocols: list[str]) -> None:
        """Wait until ``peer`` showed a valid pass before we speak anything but the pre-auth protocols to it."""
        if all(p in PRE_AUTH for p in protocols):
            return
        verdict = await self._wait(peer)
        if verdict.token is None:
            raise AuthError(f"{peer} has no valid access pass: {verdict.refused}")

    async def _wait(self, peer: ID) -> _Verdict:
        verdict = self._verdicts.setdefault(peer, _Verdict())
        with trio.move_on_after(self.config.verdict_timeout):
            await verdict.decided.wait()
        if not verdict.decided.is_set():
            return _Verdict(refused=f"no access pass within {self.config.verdict_timeout:g} s")
        return verdict

    # ---------------------------------------------------------------- connections

    def connection_opened(self, info: ConnectionInfo) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._send_hello, info.conn)

    def connection_closed(self, info: ConnectionInfo) -> None:
        if not self._node.has_connection(info.peer_id):
            self._verdicts.pop(info.peer_id, None)  # the next connection presents its pass again

    def _hello(self) -> pb.Hello:
        return pb.Hello(access=self.my_pass, time_ms=int(self._clock() * 1000))

    async def _send_hello(self, conn: INetConn) -> None:
        """Show our pass on ``conn`` and take the peer's in answer (one round trip). Both sides do it
        on every connection, so a connection opened before either side authenticated is covered."""
        peer = conn.muxed_conn.peer_id
        try:
            stream = await self._node.new_stream_on(conn, PROTOCOL, lazy=True)
        except Exception as e:
            log.debug("could not open %s to %s: %s", PROTOCOL, peer, e)
            return
        try:
            with trio.fail_after(self.config.verdict_timeout):
                await write_message(stream, self._hello())
                hello = await read_message(stream, pb.Hello, timeout=self.config.verdict_timeout)
        except ProtocolNotSupportedError:  # an open swarm's peer: it has no pass to show, refuse it now
            await finish_quietly(stream.reset)
            if self.token_of(peer) is None:
                self._judge_failed(peer, f"the peer shows no access pass (it does not speak {PROTOCOL})")
            return
        except Exception as e:  # it refused us, or went away: its own Hello (if any) decides
            log.debug("no Hello back from %s: %s", peer, e)
            await finish_quietly(stream.reset)
            return
        await finish_quietly(stream.close)
        self._judge(peer, hello)

    async def handle(self, stream: INetStream) -> None:
        """A peer's Hello: judge it, and answer ours (the peer judges it in turn)."""
        peer = stream.muxed_conn.peer_id
        try:
            hello = await read_message(stream, pb.Hello, timeout=self.config.verdict_timeout)
        except TRANSPORT_ERRORS as e:
            # reset, or its connection ended (of two that peers dialing each other at once opened, one
            # is closed): that says nothing of the peer's pass, and must not undo a verdict another
            # connection's Hello gave; the Hello on the connection that stays decides
            log.debug("Hello from %s cut short: %s", peer, e)
            await finish_quietly(stream.reset)
            return
        except Exception as e:  # garbled, oversized, ended unsent or late: a verdict
            self._judge_failed(peer, f"bad Hello: {e}" if isinstance(e, RemoteProtocolError) else
                               f"bad Hello: {type(e).__name__}")
            await finish_quietly(stream.reset)
            return
        if self._judge(peer, hello):
            with trio.move_on_after(self.config.verdict_timeout):
                try:
                    await write_message(stream, self._hello())
                except Exception:
                    pass
            await finish_quietly(stream.close)
        else:
            await finish_quietly(stream.reset)

    def _judge(self, peer: ID, hello: pb.Hello) -> bool:
        """Record the verdict on a Hello from ``peer``; True if its pass is good."""
        try:
            token = check_hello(hello, self.config, peer, self._clock())
        except AuthError as e:
            self._judge_failed(peer, str(e))
            return False
        verdict = self._verdicts.setdefault(peer, _Verdict())
        verdict.token, verdict.refused = token, ""
        verdict.decided.set()
        return True

    def _judge_failed(self, peer: ID, reason: str) -> None:
        self._refuse(peer, reason)
        if self._nursery is not None:
            self._nursery.start_soon(self._disconnect_unless_renewed, peer)

    async def _disconnect_unless_renewed(self, peer: ID) -> None:
        """Close a refused peer's connections after ``verdict_timeout``, unless it showed a valid pass
        meanwhile: a peer whose pass lapsed may still ask the authority (a pre-auth protocol) for a
        new one on the same connection."""
        await trio.sleep(self.config.verdict_timeout)
        if self.token_of(peer) is None and self._node.has_connection(peer):
            await self._node.disconnect(peer)

    def _refuse(self, peer: ID, reason: str) -> None:
        log.info("refused %s: %s", peer, reason)
        key = reason.split(":")[0][:60]
        self.refused[key] = self.refused.get(key, 0) + 1
        verdict = self._verdicts.setdefault(peer, _Verdict())
        verdict.token, verdict.refused = None, reason
        verdict.decided.set()

    # ---------------------------------------------------------------- time

    async def recheck(self) -> None:
        """Forever: close the connections of peers whose pass expired (or whose user was revoked)."""
        while True:
            await trio.sleep(self.config.recheck_interval)
            now = self._clock()
            for peer, verdict in list(self._verdicts.items()):
                token = verdict.token
                if token is None:
                    continue
                if token.expiration + self.config.max_skew < now or token.username in self.config.revoked:
                    why = "revoked" if token.username in self.config.revoked else "expired"
                    self._refuse(peer, f"the pass of {token.username!r} {why}")
                    await self._node.disconnect(peer)

    async def renew(self, new_pass: pb.AccessPass) -> None:
        """Use ``new_pass`` from now on, and show it on every open connection (else they would be
        closed when the old one expires)."""
        verify_pass(new_pass, self.config, self._node.peer_id, self._clock())
        self.my_pass = new_pass
        self._greet_all()

    def attach(self, nursery: trio.Nursery) -> Registration:
        """Run in ``nursery`` (the node's; :meth:`p2p.Node.authenticate` calls this): show our pass on
        the connections already open and recheck passes, until the handle is removed."""
        self._nursery = nursery
        self._greet_all()
        recheck = start_cancellable(nursery, self.recheck)

        def undo() -> None:
            recheck.cancel()
            self._nursery = None

        return Registration(undo)

    def _greet_all(self) -> None:
        if self._nursery is not None:
            for conn in self._node.connections():
                self._nursery.start_soon(self._send_hello, conn)

    def revoke(self, usernames: frozenset[str]) -> None:
        """Refuse these users from now on (their connections close at the next recheck)."""
        self.config.revoked = self.config.revoked | usernames


class AuthNode(Protocol):
    """What the authenticator needs of a Node (p2p/node.py implements it)."""

    peer_id: ID

    async def new_stream_on(self, conn: INetConn, protocol: str, *, timeout: float = 10.0,
                            lazy: bool = False) -> INetStream: ...

    def has_connection(self, peer_id: ID) -> bool: ...

    def connections(self) -> list[INetConn]: ...

    async def disconnect(self, peer_id: ID) -> None: ...


__all__ = ["AuthConfig", "AuthError", "Authenticator", "ISSUE_PROTOCOL", "PRE_AUTH", "PROTOCOL", "SIGNING_DOMAIN", "Token",
           "check_hello", "pass_expiration", "verify_pass"]
