"""A closed run's authority (DeDLOC, Appendix I.5): the allowlist, and access passes for those on it.

The authority holds an Ed25519 key (its public half is the run's trust anchor:
every member checks passes against it, ``p2p/auth.py``) and an allowlist file.
``dedloc authority add alice`` puts a user on the list with a fresh secret
(printed once, given to the user); ``revoke`` takes them off (their pass is not
renewed: they are out within its lifetime). A node that serves the authority
(``dedloc relay --authority-dir DIR``) answers ``/dedloc/auth/issue/1.0.0``, the
one protocol a peer without a pass may open there besides the Hello:

1. the peer sends ``ChallengeRequest(username)``; the authority answers a fresh
   nonce (single use, 60 s);
2. the peer sends ``IssueRequest(username, nonce, proof)`` with
   ``proof = HMAC-SHA256(secret, "dedloc-pass\\n" + nonce + its peer id)``: the
   secret never travels, a proof is good for one nonce and one peer id, and the
   stream runs over Noise (nobody else reads it);
3. the authority checks the proof with its :class:`IdentityCheck` (the default,
   :class:`SecretCheck`, reads the allowlist; another could ask an identity
   provider, as sahajBERT's asked Hugging Face) and answers a pass for the
   caller's Noise-proven peer id, valid for :data:`DEFAULT_LIFETIME`.

Files: ``authority.key`` (the 32-byte Ed25519 seed) and ``allowlist.json``
(``{"users": {name: {"secret": hex, "revoked": bool}}}``), both mode 0600.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from nacl.signing import SigningKey

from .auth import ISSUE_PROTOCOL, SIGNING_DOMAIN, AuthError
from .errors import ConfigError, RemoteProtocolError
from .proto import auth_pb2 as pb
from .trio_util import finish_quietly
from .wire import read_message, write_message

log = logging.getLogger(__name__)

#: Seconds a pass is valid; members renew at two thirds of it. Also the bound on a revocation.
DEFAULT_LIFETIME = 15 * 60
#: Seconds a challenge nonce stays good, and how many may be outstanding.
NONCE_TTL = 60.0
MAX_NONCES = 10_000
PROOF_DOMAIN = b"dedloc-pass\n"
KEY_FILE = "authority.key"
ALLOWLIST_FILE = "allowlist.json"
#: A username: what the allowlist and the pass carry (letters, digits, ``._-``, 1..64).
MAX_USERNAME = 64


def proof(secret: bytes, nonce: bytes, peer_id: ID) -> bytes:
    """What a peer sends to show it holds ``secret``, for this nonce and its own peer id."""
    return hmac.new(secret, PROOF_DOMAIN + nonce + peer_id.to_bytes(), hashlib.sha256).digest()


def check_username(name: str) -> str:
    if not (0 < len(name) <= MAX_USERNAME and all(c.isalnum() or c in "._-" for c in name)):
        raise ConfigError(f"username {name!r}: 1 to {MAX_USERNAME} letters, digits, '.', '_' or '-'")
    return name


class IdentityCheck(Protocol):
    """Whether ``proof`` shows that the caller is ``username`` (and the user is allowed now), and who
    is revoked (the authority's own node refuses them at once; others when their pass expires)."""

    def verify(self, username: str, nonce: bytes, proof: bytes, peer_id: ID) -> bool: ...

    def revoked(self) -> frozenset[str]: ...


@dataclass
class AllowList:
    """The authority's list of users and their secrets (``allowlist.json``)."""

    path: Path
    users: dict[str, dict[str, object]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> AllowList:
        if not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text())
            users = data["users"]
            if not isinstance(users, dict):
                raise TypeError("users is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}: not an allowlist ({e})") from None
        return cls(path, users)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        # one that a crash left may be readable by others, and O_CREAT would keep its mode: the secrets
        # go only into a file made here, 0600
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"users": self.users}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def add(self, username: str) -> bytes:
        """Put ``username`` on the list (again) with a fresh secret, returned (and stored)."""
        secret = secrets.token_bytes(32)
        self.users[check_username(username)] = {"secret": secret.hex(), "revoked": False, "added": int(time.time())}
        return secret

    def revoke(self, username: str) -> None:
        if username not in self.users:
            raise ConfigError(f"{username!r} is not on the allowlist")
        self.users[username]["revoked"] = True

    def secret_of(self, username: str) -> bytes | None:
        entry = self.users.get(username)
        if entry is None or entry.get("revoked"):
            return None
        return bytes.fromhex(str(entry["secret"]))

    def revoked(self) -> frozenset[str]:
        return frozenset(u for u, e in self.users.items() if e.get("revoked"))


@dataclass
class SecretCheck:
    """The default identity check: an HMAC with the user's secret from the allowlist (re-read on change)."""

    allowlist: AllowList

    def verify(self, username: str, nonce: bytes, proof_: bytes, peer_id: ID) -> bool:
        self._reload()
        secret = self.allowlist.secret_of(username)
        return secret is not None and hmac.compare_digest(proof(secret, nonce, peer_id), proof_)

    def revoked(self) -> frozenset[str]:
        self._reload()
        return self.allowlist.revoked()

    def _reload(self) -> None:
        path = self.allowlist.path
        if path.exists():
            self.allowlist.users = AllowList.load(path).users


def load_or_create_key(path: Path) -> SigningKey:
    """The authority's key (created, mode 0600, on first use)."""
    if path.exists():
        if path.stat().st_mode & 0o077:
            raise ConfigError(f"{path} is readable by others: chmod 600 it (it signs every pass of the run)")
        seed = path.read_bytes()
        if len(seed) != 32:
            raise ConfigError(f"{path}: an authority key is 32 bytes, this is {len(seed)}")
        return SigningKey(seed)
    key = SigningKey.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(bytes(key))
    return key


class Authority:
    """Signs passes for users its :class:`IdentityCheck` accepts; :meth:`handle` serves ISSUE_PROTOCOL."""

    def __init__(self, key: SigningKey, check: IdentityCheck, *, lifetime: float = DEFAULT_LIFETIME,
                 clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self.public_key = bytes(key.verify_key)
        self.check = check
        self.lifetime = lifetime
        self._clock = clock
        self._nonces: dict[bytes, tuple[str, float]] = {}
        self.issued = 0
        self.refused = 0
        #: The node's rate check for a caller (``ResourceManager.allow`` bound to ``auth.issue``), if any.
        self.allow: Callable[[str], None] | None = None

    @classmethod
    def from_dir(cls, directory: Path, *, lifetime: float = DEFAULT_LIFETIME) -> Authority:
        key = load_or_create_key(directory / KEY_FILE)
        return cls(key, SecretCheck(AllowList.load(directory / ALLOWLIST_FILE)), lifetime=lifetime)

    def sign(self, username: str, peer_id: ID, now: float) -> pb.AccessPass:
        token = pb.AccessToken(username=username, peer_id=peer_id.to_bytes(), expiration=int(now + self.lifetime),
                               authority=self.public_key, serial=secrets.randbits(63))
        data = token.SerializeToString()
        return pb.AccessPass(token=data, signature=self.key.sign(SIGNING_DOMAIN + data).signature)

    def challenge(self, username: str, now: float) -> bytes:
        for nonce, (_, at) in list(self._nonces.items()):
            if now - at > NONCE_TTL:
                del self._nonces[nonce]
        if len(self._nonces) >= MAX_NONCES:
            raise AuthError("too many outstanding challenges; try again in a minute")
        nonce = secrets.token_bytes(32)
        self._nonces[nonce] = (username, now)
        return nonce

    def issue(self, request: pb.IssueRequest, peer_id: ID, now: float) -> pb.AccessPass:
        """A pass for ``peer_id`` if the request's nonce is ours, fresh and unused and its proof checks out."""
        entry = self._nonces.pop(request.nonce, None)
        if entry is None or entry[0] != request.username or now - entry[1] > NONCE_TTL:
            raise AuthError("unknown, used or expired challenge")
        if not self.check.verify(request.username, request.nonce, request.proof, peer_id):
            raise AuthError(f"not on the allowlist, revoked, or a wrong secret for {request.username!r}")
        self.issued += 1
        return self.sign(request.username, peer_id, now)

    async def handle(self, stream: INetStream) -> None:
        """One issuing exchange on ``/dedloc/auth/issue/1.0.0`` (2 round trips); callers are rate limited
        by the node's ``auth.issue`` rate (``p2p/resources.py``) when ``allow`` is given."""
        peer = stream.muxed_conn.peer_id
        if self.allow is not None:
            try:
                self.allow(str(peer))
            except Exception as e:
                log.info("pass request from %s refused: %s", peer, e)
                await finish_quietly(stream.reset)
                return
        try:
            with trio.fail_after(30):
                first = await read_message(stream, pb.ChallengeRequest)
                check_username(first.username)
                await write_message(stream, pb.Challenge(nonce=self.challenge(first.username, self._clock())))
                request = await read_message(stream, pb.IssueRequest)
                try:
                    reply = pb.IssueReply(access=self.issue(request, peer, self._clock()))
                    log.info("issued a pass to %r (%s)", request.username, peer)
                except AuthError as e:
                    self.refused += 1
                    log.info("refused a pass to %s: %s", peer, e)
                    reply = pb.IssueReply(error=str(e))
                await write_message(stream, reply)
            await finish_quietly(stream.close)
        except (RemoteProtocolError, ConfigError, AuthError, trio.TooSlowError, Exception) as e:
            log.info("bad pass request from %s: %s", peer, e)
            await finish_quietly(stream.reset)


class IssuingNode(Protocol):
    peer_id: ID

    async def new_stream(self, peer_id: ID, protocol: str) -> INetStream: ...


async def request_pass(node: IssuingNode, authority_peer: ID, username: str, secret: bytes, *,
                       timeout: float = 30.0) -> pb.AccessPass:
    """Ask the authority at ``authority_peer`` (connected, or dialable) for our pass; :class:`AuthError` if refused."""
    with trio.fail_after(timeout):
        stream = await node.new_stream(authority_peer, ISSUE_PROTOCOL)
        try:
            await write_message(stream, pb.ChallengeRequest(username=username))
            challenge = await read_message(stream, pb.Challenge)
            # the authority binds the pass to our Noise-proven id: the proof names it too
            request = pb.IssueRequest(username=username, nonce=challenge.nonce,
                                      proof=proof(secret, challenge.nonce, node.peer_id))
            await write_message(stream, request)
            reply = await read_message(stream, pb.IssueReply)
        finally:
            await finish_quietly(stream.close)
    if reply.error or not reply.HasField("access"):
        raise AuthError(f"the authority refused a pass: {reply.error or 'no pass in its answer'}")
    return reply.access


__all__ = ["ALLOWLIST_FILE", "AllowList", "Authority", "DEFAULT_LIFETIME", "ISSUE_PROTOCOL", "IdentityCheck",
           "KEY_FILE", "SecretCheck", "check_username", "load_or_create_key", "proof", "request_pass"]
