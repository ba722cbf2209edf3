"""Allowlist authentication (p2p/auth.py, p2p/authority.py): every way in, on real nodes on loopback.

Each I.5 check has its test: expired pass, a pass from another authority, for another peer id, a
forged signature, a replayed token, a clock off beyond the bound, a revoked user (connections closed
within the bound), a response from a peer that is not a passholder, an outsider refused by every
protocol the node serves; and the authority's issuing exchange (wrong secret, replayed challenge,
a proof made for another peer id)."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
from libp2p.abc import INetConn, INetStream
from libp2p.peer.id import ID
from multiaddr import Multiaddr
from nacl.signing import SigningKey

from p2p.auth import (
    PRE_AUTH,
    PROTOCOL,
    SIGNING_DOMAIN,
    AuthConfig,
    AuthError,
    Authenticator,
    Token,
    check_hello,
    pass_expiration,
    verify_pass,
)
from p2p.authority import (
    ALLOWLIST_FILE,
    DEFAULT_LIFETIME,
    ISSUE_PROTOCOL,
    KEY_FILE,
    MAX_NONCES,
    NONCE_TTL,
    AllowList,
    Authority,
    SecretCheck,
    check_username,
    load_or_create_key,
    proof,
    request_pass,
)
from p2p.errors import ConfigError, DedlocError, ProtocolNotSupportedError, RemoteProtocolError
from p2p.hooks import ConnectionInfo, Direction, PathKind
from p2p.identity import new_identity, peer_id_of
from p2p.node import Node
from p2p.proto import auth_pb2 as pb
from p2p.wire import read_message, write_message

from .conftest import loopback_config
from .kit import End, ends, log_lines, random_peer_id, wait_until

pytestmark = pytest.mark.timeout(60)


def authority(tmp_path: Path, *users: str, lifetime: float = 900.0) -> tuple[Authority, dict[str, bytes]]:
    allowlist = AllowList(tmp_path / "allowlist.json")
    secrets = {u: allowlist.add(u) for u in users}
    allowlist.save()
    return Authority(SigningKey.generate(), SecretCheck(allowlist), lifetime=lifetime), secrets


def cfg(auth: Authority, **overrides: object) -> AuthConfig:
    settings: dict[str, object] = {"authority": auth.public_key, "verdict_timeout": 2.0, "recheck_interval": 0.2}
    settings.update(overrides)
    return AuthConfig(**settings)  # type: ignore[arg-type]


@asynccontextmanager
async def member(auth: Authority, username: str, **overrides: object) -> AsyncIterator[Node]:
    async with Node.open(loopback_config()) as node:
        access = auth.sign(username, node.peer_id, time.time())
        with node.authenticate(Authenticator(node, cfg(auth, **overrides), access)):
            yield node


# ---------------------------------------------------------------------- the checks, pure


def test_every_bad_pass_is_refused_with_its_reason(tmp_path: Path) -> None:
    auth, _ = authority(tmp_path)
    other, _ = authority(tmp_path / "other")
    me, someone = peer_id_of(new_identity()), peer_id_of(new_identity())
    config = cfg(auth, max_skew=60.0)
    now = time.time()
    good = auth.sign("alice", me, now)
    assert verify_pass(good, config, me, now).username == "alice"
    cases = {
        "expired": (auth.sign("alice", me, now - 2000), "expired"),
        "another authority": (other.sign("alice", me, now), "not our authority's"),
        "another peer id": (auth.sign("alice", someone, now), "another peer id"),
        "forged": (pb.AccessPass(token=good.token, signature=bytes(64)), "not our authority's"),
        "tampered token": (pb.AccessPass(token=good.token.replace(b"alice", b"mallo"), signature=good.signature),
                           "not our authority's"),
        "garbage": (pb.AccessPass(token=b"\xff" * 10, signature=b"x"), "not our authority's"),
    }
    for name, (access, why) in cases.items():
        with pytest.raises(AuthError, match=why):
            verify_pass(access, config, me, now)
    # a pass our authority signed but naming another authority inside is refused too
    token = pb.AccessToken(username="alice", peer_id=me.to_bytes(), expiration=int(now + 60), authority=other.public_key)
    signed = auth.key.sign(b"dedloc-access-token\n" + token.SerializeToString()).signature
    with pytest.raises(AuthError, match="^the pass names another authority$"):
        verify_pass(pb.AccessPass(token=token.SerializeToString(), signature=signed), config, me, now)
    # expiry has max_skew of grace, no more
    recent = auth.sign("alice", me, now - 900 - 30)
    assert verify_pass(recent, config, me, now)
    with pytest.raises(AuthError, match="revoked"):
        verify_pass(good, cfg(auth, revoked=frozenset({"alice"})), me, now)
    # a peer whose clock is off by more than the bound
    for off in (-120.0, 120.0):
        with pytest.raises(AuthError, match="clock"):
            check_hello(pb.Hello(access=good, time_ms=int((now + off) * 1000)), config, me, now)
    assert check_hello(pb.Hello(access=good, time_ms=int((now + 30) * 1000)), config, me, now)


def test_the_config_refuses_what_cannot_work_and_takes_its_edges(tmp_path: Path) -> None:
    auth, _ = authority(tmp_path)
    with pytest.raises(AuthError, match=r"^the authority's key must be 32 bytes \(Ed25519\), got 31$"):
        cfg(auth, authority=bytes(31)).validate()
    bounds = r"^max_skew must be in 0 \.\. 3600 s; recheck_interval and verdict_timeout positive$"
    for bad in ({"max_skew": -0.001}, {"max_skew": 3600.001}, {"recheck_interval": 0.0}, {"verdict_timeout": 0.0}):
        with pytest.raises(AuthError, match=bounds):
            cfg(auth, **bad).validate()
    for good in ({"max_skew": 0.0}, {"max_skew": 3600.0}, {"recheck_interval": 0.5, "verdict_timeout": 0.5}):
        cfg(auth, **good).validate()
    # an authenticator checks its own config and its own pass before it runs
    me = peer_id_of(new_identity())
    node = Desk(me)
    with pytest.raises(AuthError, match="32 bytes"):
        Authenticator(node, cfg(auth, authority=bytes(31)), auth.sign("alice", me, time.time()))
    with pytest.raises(AuthError, match="^the pass was issued to another peer id$"):
        Authenticator(node, cfg(auth), auth.sign("alice", peer_id_of(new_identity()), time.time()))


def test_a_pass_says_exactly_what_is_wrong_and_carries_its_token(tmp_path: Path) -> None:
    auth, _ = authority(tmp_path, lifetime=900.0)
    me = peer_id_of(new_identity())
    config = cfg(auth, max_skew=60.0)
    now = 1_700_000_000.0
    access = auth.sign("alice", me, now)
    token = pb.AccessToken()
    token.ParseFromString(access.token)
    assert (token.username, token.peer_id, token.expiration, token.authority) == (
        "alice", me.to_bytes(), int(now + 900), auth.public_key)
    assert pass_expiration(access) == now + 900
    got = verify_pass(access, config, me, now)
    assert got == Token("alice", me, now + 900, token.serial)
    assert isinstance(got.expiration, float) and got.serial != verify_pass(auth.sign("alice", me, now), config, me, now).serial  # fresh each time
    serials = {verify_pass(auth.sign("alice", me, now), config, me, now).serial for _ in range(64)}
    assert len(serials) == 64 and max(serials) < 2**63  # a signed 64-bit number in any language's logs
    # expiry: max_skew of grace to the second, then the words and the seconds since it expired
    assert verify_pass(access, config, me, now + 960).username == "alice"
    with pytest.raises(AuthError, match="^the pass expired 61 s ago$"):
        verify_pass(access, config, me, now + 961)
    with pytest.raises(AuthError, match="^user 'alice' is revoked$"):
        verify_pass(access, cfg(auth, revoked=frozenset({"alice"})), me, now)
    assert verify_pass(access, cfg(auth, revoked=frozenset({"bob"})), me, now)
    # signed by our authority, yet no token: its own words
    junk = b"\xff\xff\xff"
    signed = pb.AccessPass(token=junk, signature=auth.key.sign(SIGNING_DOMAIN + junk).signature)
    with pytest.raises(AuthError, match="^the pass's token does not decode$"):
        verify_pass(signed, config, me, now)
    # the signature covers the domain too: one made over the bare token is not the authority's
    bare = pb.AccessPass(token=access.token, signature=auth.key.sign(access.token).signature)
    with pytest.raises(AuthError, match="^the pass's signature is not our authority's$"):
        verify_pass(bare, config, me, now)
    # the Hello: no pass at all, and the clock's bound to the second, in words
    with pytest.raises(AuthError, match=r"^the peer shows no access pass \(it is not a member of this closed swarm\)$"):
        check_hello(pb.Hello(time_ms=int(now * 1000)), config, me, now)
    for off in (-60.0, 60.0):
        assert check_hello(pb.Hello(access=access, time_ms=int((now + off) * 1000)), config, me, now).username == "alice"
    with pytest.raises(AuthError, match=r"^the peer's clock is 61 s off ours \(the bound is 60 s\)$"):
        check_hello(pb.Hello(access=access, time_ms=int((now - 61) * 1000)), config, me, now)


def test_usernames_and_the_allowlist_file(tmp_path: Path) -> None:
    assert check_username("a") == "a" and check_username("A.b_c-9" * 9 + "x") == "A.b_c-9" * 9 + "x"
    for bad in ("", "x" * 65, "a b", "a/b", "ünï" + "!"):
        with pytest.raises(ConfigError, match=r"^username .*: 1 to 64 letters, digits, '\.', '_' or '-'$"):
            check_username(bad)
    check_username("x" * 64)
    path = tmp_path / "runs" / "one" / "allowlist.json"  # directories made as needed
    assert AllowList.load(path).users == {}  # no file yet: nobody
    allowlist = AllowList(path)
    before = int(time.time())
    first = allowlist.add("alice")
    assert len(first) == 32 and allowlist.secret_of("alice") == first
    entry = allowlist.users["alice"]
    assert entry["secret"] == first.hex() and entry["revoked"] is False
    assert before <= entry["added"] <= time.time()  # type: ignore[operator]
    bobs = allowlist.add("bob")
    allowlist.save()
    assert path.stat().st_mode & 0o777 == 0o600 and not path.with_suffix(".tmp").exists()
    # a temporary file that a crash left, readable by all: the secrets never land in it
    path.with_suffix(".tmp").write_text("left by a crash")
    path.with_suffix(".tmp").chmod(0o644)
    allowlist.revoke("bob")
    allowlist.save()
    assert path.stat().st_mode & 0o777 == 0o600 and not path.with_suffix(".tmp").exists()
    # the file people read and edit: one user per sorted key, indented by one
    assert path.read_text() == json.dumps({"users": allowlist.users}, indent=1, sort_keys=True)
    assert path.read_text().startswith('{\n "users": {\n  "alice": {\n   "added": ')
    loaded = AllowList.load(path)
    assert loaded.users == allowlist.users
    assert loaded.secret_of("alice") == first and loaded.secret_of("bob") is None and loaded.secret_of("carol") is None
    assert loaded.revoked() == frozenset({"bob"})
    again = loaded.add("bob")  # added again: a fresh secret, and allowed
    assert again != bobs and loaded.secret_of("bob") == again and loaded.revoked() == frozenset()
    with pytest.raises(ConfigError, match="^'carol' is not on the allowlist$"):
        loaded.revoke("carol")
    for text, why in (("not json", "Expecting value: line 1 column 1 (char 0)"), ('{"people": {}}', "'users'"),
                      ('{"users": []}', "users is not an object")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: not an allowlist \\({re.escape(why)}\\)$"):
            AllowList.load(path)


def test_the_authority_key_is_made_once_private_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "new" / "run" / KEY_FILE  # directories made as needed
    key = load_or_create_key(path)
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_bytes() == bytes(key)
    assert bytes(load_or_create_key(path)) == bytes(key)
    made = Authority.from_dir(tmp_path / "new" / "run", lifetime=5.0)
    assert made.public_key == bytes(key.verify_key) and made.lifetime == 5.0
    assert isinstance(made.check, SecretCheck) and made.check.allowlist.path == tmp_path / "new" / "run" / ALLOWLIST_FILE
    assert Authority.from_dir(tmp_path / "new" / "run").lifetime == DEFAULT_LIFETIME == 900
    path.chmod(0o640)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))} is readable by others: chmod 600 it"):
        load_or_create_key(path)
    path.chmod(0o604)
    with pytest.raises(ConfigError, match="readable by others"):
        load_or_create_key(path)
    path.chmod(0o600)
    path.write_bytes(b"short")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: an authority key is 32 bytes, this is 5$"):
        load_or_create_key(path)


def test_challenges_are_single_use_bounded_and_forgotten_after_a_minute(tmp_path: Path) -> None:
    auth, secrets = authority(tmp_path, "alice")
    me = peer_id_of(new_identity())
    now = 1_700_000_000.0

    def request(nonce: bytes, username: str = "alice") -> pb.IssueRequest:
        return pb.IssueRequest(username=username, nonce=nonce, proof=proof(secrets["alice"], nonce, me))

    nonce = auth.challenge("alice", now)
    assert len(nonce) == 32 and nonce != auth.challenge("alice", now)
    # a challenge taken for one user is no good for another's request, and is used up by the try
    with pytest.raises(AuthError, match="^unknown, used or expired challenge$"):
        auth.issue(request(nonce, "bob"), me, now)
    with pytest.raises(AuthError, match="^unknown, used or expired challenge$"):
        auth.issue(request(nonce), me, now)
    # good for exactly NONCE_TTL
    nonce = auth.challenge("alice", now)
    issued = auth.issue(request(nonce), me, now + NONCE_TTL)
    assert pass_expiration(issued) == int(now + NONCE_TTL + 900) and auth.issued == 1
    assert auth.issue(request(auth.challenge("alice", now)), me, now) and auth.issued == 2
    with pytest.raises(AuthError, match="^not on the allowlist, revoked, or a wrong secret for 'nobody'$"):
        auth.issue(pb.IssueRequest(username="nobody", nonce=auth.challenge("nobody", now), proof=b""), me, now)
    assert auth.issued == 2
    # at most MAX_NONCES outstanding; those older than a minute are forgotten when the next is asked for
    auth._nonces.clear()
    auth._nonces.update({i.to_bytes(4, "big"): ("alice", now) for i in range(MAX_NONCES - 1)})
    kept = auth.challenge("alice", now + NONCE_TTL)
    with pytest.raises(AuthError, match="^too many outstanding challenges; try again in a minute$"):
        auth.challenge("alice", now + NONCE_TTL)
    newest = auth.challenge("alice", now + NONCE_TTL + 0.001)
    assert list(auth._nonces) == [kept, newest] and auth._nonces[newest] == ("alice", now + NONCE_TTL + 0.001)
    assert MAX_NONCES == 10_000


# ---------------------------------------------------------------------- on connections


async def test_passholders_talk_and_an_outsider_is_refused_by_every_protocol(tmp_path: Path) -> None:
    auth, _ = authority(tmp_path)
    async with member(auth, "alice") as alice, member(auth, "bob") as bob, Node.open(loopback_config()) as outsider:
        await bob.connect(str(alice.addrs[0]))
        assert await bob.ping(alice.peer_id, timeout=5) > 0  # both passes checked, then the ping
        assert alice.authenticator is not None and alice.authenticator.token_of(bob.peer_id) is not None
        await outsider.connect(str(alice.addrs[0]))
        served = [p for p in alice.host.get_mux().handlers if p is not None and p not in PRE_AUTH]
        assert len(served) >= 2, served  # rpc, ping (and every protocol a layer above adds)
        # the outsider was told (alice's Hello) and refuses itself at once, saying what to do
        await wait_until(lambda: alice.peer_id in outsider.closed_swarm, 5)
        with pytest.raises(AuthError, match="runs a closed swarm; it admits only holders of an access pass"):
            await outsider.new_stream(alice.peer_id, served[0])
        for protocol in served:
            outsider.closed_swarm.clear()  # one that ignores being told (a script): alice's gate refuses it
            with pytest.raises(DedlocError, match="unauthenticated: the peer shows no access pass.*the swarm is closed"):
                stream = await outsider.new_stream(alice.peer_id, protocol, lazy=False)
                await stream.read(1)
        # and alice never speaks (nor takes an answer from) a peer without a pass
        with pytest.raises(AuthError, match="no valid access pass"):
            await alice.ping(outsider.peer_id, timeout=5)


async def test_a_hello_stream_cut_short_is_no_verdict_and_a_garbled_one_is(tmp_path: Path) -> None:
    """A Hello whose stream is reset (the connection it rode closed: two peers that dial each other at
    once keep one of the two) says nothing of the peer's pass: alice keeps bob's good verdict, and bob
    may still speak to her. Found so: a trainer that met a server both ways was refused by it for
    30 s (`serve-experts --processes` in a closed run). A garbled Hello is a verdict: refused."""
    auth, _ = authority(tmp_path)
    async with member(auth, "alice") as alice, member(auth, "bob") as bob:
        await bob.connect(str(alice.addrs[0]))
        assert await bob.ping(alice.peer_id, timeout=5) > 0
        assert alice.authenticator is not None
        stream = await bob.new_stream(alice.peer_id, PROTOCOL, lazy=False)
        await stream.reset()
        await trio.sleep(0.5)  # alice's handler reads the reset
        assert alice.authenticator.token_of(bob.peer_id) is not None, alice.authenticator.refused
        assert await bob.ping(alice.peer_id, timeout=5) > 0
        stream = await bob.new_stream(alice.peer_id, PROTOCOL, lazy=False)
        await stream.write(b"\x05garbl")
        await wait_until(lambda: alice.authenticator is not None and alice.authenticator.token_of(bob.peer_id) is None, 5)
        assert any(k.startswith("bad Hello") for k in alice.authenticator.refused), alice.authenticator.refused


async def test_a_copied_pass_is_useless_without_its_peers_key(tmp_path: Path) -> None:
    """Replay of a token: mallory presents alice's pass on its own connection; Noise proved mallory's
    peer id, the pass names alice's: refused, and the connection closed."""
    auth, _ = authority(tmp_path)
    async with member(auth, "bob") as bob, Node.open(loopback_config()) as alice_node, \
            Node.open(loopback_config()) as mallory:
        stolen = auth.sign("alice", alice_node.peer_id, time.time())
        await mallory.connect(str(bob.addrs[0]))
        stream = await mallory.new_stream(bob.peer_id, PROTOCOL)
        await write_message(stream, pb.Hello(access=stolen, time_ms=int(time.time() * 1000)))
        await wait_until(lambda: not bob.has_connection(mallory.peer_id), 5)
        assert bob.authenticator is not None and bob.authenticator.refused.get("the pass was issued to another peer id")


async def test_a_pass_from_another_authority_is_refused_both_ways(tmp_path: Path) -> None:
    auth, _ = authority(tmp_path)
    other, _ = authority(tmp_path / "other")
    async with member(auth, "alice") as alice, member(other, "eve") as eve:
        await eve.connect(str(alice.addrs[0]))
        # eve's side: alice's pass is not from eve's authority, so eve speaks nothing to her
        with pytest.raises(AuthError, match="no valid access pass: the pass's signature is not our authority's"):
            await eve.ping(alice.peer_id, timeout=5)
        # alice's side, each gate on its own: her inbound gate refuses eve's streams...
        assert alice.authenticator is not None and eve.authenticator is not None
        for protocol in ("/ipfs/ping/1.0.0", "/dedloc/rpc/1.0.0"):
            reason = await alice.authenticator.inbound(eve.peer_id, protocol)
            assert reason is not None and reason.startswith("unauthenticated: ")
        assert alice.authenticator.refused.get("the pass's signature is not our authority's")
        assert eve.authenticator.refused.get("the pass's signature is not our authority's")
        # ...and her outbound gate refuses to speak to eve
        with pytest.raises(AuthError, match="no valid access pass"):
            await alice.ping(eve.peer_id, timeout=5)
        await wait_until(lambda: not alice.has_connection(eve.peer_id), 5)


async def test_an_expiring_pass_closes_the_connection_unless_renewed(tmp_path: Path) -> None:
    auth, _ = authority(tmp_path, lifetime=2.0)
    async with member(auth, "alice", max_skew=0.5) as alice, member(auth, "bob", max_skew=0.5) as bob, \
            member(auth, "carol", max_skew=0.5) as carol:
        bob_expires = time.time() + 2.0  # at the latest (passes carry whole seconds)
        await bob.connect(str(alice.addrs[0]))
        await carol.connect(str(alice.addrs[0]))
        assert await bob.ping(alice.peer_id, timeout=5) > 0 and await carol.ping(alice.peer_id, timeout=5) > 0
        # alice and carol renew (a fresh pass, 30 s this time) before theirs expire; bob does not
        await trio.sleep(0.8)
        auth.lifetime = 30.0
        for node, name in ((alice, "alice"), (carol, "carol")):
            assert node.authenticator is not None
            await node.authenticator.renew(auth.sign(name, node.peer_id, time.time()))
        await wait_until(lambda: not alice.has_connection(bob.peer_id), 5)
        # closed within expiry + max_skew + the recheck interval (+ slack for the loaded machine)
        assert time.time() <= bob_expires + 0.5 + 0.2 + 0.5
        assert alice.has_connection(carol.peer_id) and await carol.ping(alice.peer_id, timeout=5) > 0


async def test_a_revoked_user_is_cut_within_the_recheck_interval_and_gets_no_new_pass(tmp_path: Path) -> None:
    auth, secrets = authority(tmp_path, "alice", "bob")
    async with member(auth, "alice") as alice, member(auth, "bob") as bob:
        await bob.connect(str(alice.addrs[0]))
        assert await bob.ping(alice.peer_id, timeout=5) > 0
        assert alice.authenticator is not None
        alice.authenticator.revoke(frozenset({"bob"}))
        started = trio.current_time()
        await wait_until(lambda: not alice.has_connection(bob.peer_id), 5)
        assert trio.current_time() - started <= 0.2 + 0.5
        # bob's end of the closed connection goes too (a stream opened on it meanwhile is reset)
        await wait_until(lambda: not bob.has_connection(alice.peer_id), 5)
        # the authority's list: revoked there, bob's renewal is refused
        allowlist = AllowList.load(tmp_path / "allowlist.json")
        allowlist.revoke("bob")
        allowlist.save()
        alice.set_stream_handler("/dedloc/auth/issue/1.0.0", auth.handle)
        with pytest.raises(AuthError, match="revoked"):
            await request_pass(bob, alice.peer_id, "bob", secrets["bob"], timeout=10)


async def test_the_authority_issues_only_to_a_correct_proof_once_per_challenge(tmp_path: Path) -> None:
    auth, secrets = authority(tmp_path, "alice")
    async with Node.open(loopback_config()) as server, Node.open(loopback_config()) as client:
        server.set_stream_handler("/dedloc/auth/issue/1.0.0", auth.handle)
        await client.connect(str(server.addrs[0]))
        access = await request_pass(client, server.peer_id, "alice", secrets["alice"])
        assert verify_pass(access, cfg(auth), client.peer_id, time.time()).username == "alice"
        with pytest.raises(AuthError, match="wrong secret"):
            await request_pass(client, server.peer_id, "alice", b"\x00" * 32)
        with pytest.raises(AuthError, match="allowlist"):
            await request_pass(client, server.peer_id, "nobody", b"\x00" * 32)
    # pure: a nonce is good once; a proof made for another peer id is refused
    now = time.time()
    me, other = peer_id_of(new_identity()), peer_id_of(new_identity())
    nonce = auth.challenge("alice", now)
    request = pb.IssueRequest(username="alice", nonce=nonce, proof=proof(secrets["alice"], nonce, other))
    with pytest.raises(AuthError, match="wrong secret"):
        auth.issue(request, me, now)
    nonce = auth.challenge("alice", now)
    good = pb.IssueRequest(username="alice", nonce=nonce, proof=proof(secrets["alice"], nonce, me))
    assert auth.issue(good, me, now)
    with pytest.raises(AuthError, match="challenge"):
        auth.issue(good, me, now)  # replayed
    stale = auth.challenge("alice", now)
    late = pb.IssueRequest(username="alice", nonce=stale, proof=proof(secrets["alice"], stale, me))
    with pytest.raises(AuthError, match="challenge"):
        auth.issue(late, me, now + 61)


# ---------------------------------------------------------------------- the gate's state, with no network


class Desk:
    """What an Authenticator needs of a Node, and nothing more: who is connected, who was cut, and what a
    stream open gives (``answer``: our end of a stream the test plays the peer on, or an error)."""

    def __init__(self, peer_id: ID) -> None:
        self.peer_id = peer_id
        self.connected: dict[ID, int] = {}
        self.cut: list[tuple[float, ID]] = []
        self.opened: list[tuple[str, bool]] = []
        self.answer: End | BaseException = ConnectionError("no network at this desk")

    async def new_stream_on(self, conn: object, protocol: str, *, timeout: float = 10.0, lazy: bool = False) -> INetStream:
        self.opened.append((protocol, lazy))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[return-value]

    def has_connection(self, peer_id: ID) -> bool:
        return self.connected.get(peer_id, 0) > 0

    def connections(self) -> list[INetConn]:
        return []

    async def disconnect(self, peer_id: ID) -> None:
        self.cut.append((trio.current_time(), peer_id))
        self.connected.pop(peer_id, None)


def conn_to(peer: ID) -> INetConn:
    return SimpleNamespace(muxed_conn=SimpleNamespace(peer_id=peer))  # type: ignore[return-value]


#: The wall clock of the gates below at trio's time 0 (passes expire in Unix time).
BASE = 1_700_000_000.0


def desk_gate(auth: Authority, **config: object) -> tuple[Authenticator, Desk]:
    """An Authenticator on a fresh Desk, its pass signed at BASE, its wall clock BASE + trio's time."""
    me = random_peer_id()
    desk = Desk(me)
    gate = Authenticator(desk, cfg(auth, **config), auth.sign("me", me, BASE), clock=lambda: BASE + trio.current_time())
    return gate, desk


def hello(auth: Authority, name: str, peer: ID) -> pb.Hello:
    """``peer``'s Hello as ``name``, its pass signed and its clock read now (on the gates' clock)."""
    now = BASE + trio.current_time()
    return pb.Hello(access=auth.sign(name, peer, now), time_ms=int(now * 1000))


async def test_our_hello_goes_out_lazily_and_each_way_it_can_end_is_told(
        tmp_path: Path, autojump_clock: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "p2p.auth")
    auth, _ = authority(tmp_path)
    gate, desk = desk_gate(auth, verdict_timeout=3.0)
    me, bob, carol, dave = desk.peer_id, random_peer_id(), random_peer_id(), random_peer_id()
    # no stream: said in the debug log, no verdict
    await gate._send_hello(conn_to(bob))
    assert log_lines(caplog, "p2p.auth", "could not open") == [
        f"could not open /dedloc/auth/1.0.0 to {bob}: no network at this desk"]
    assert desk.opened == [(PROTOCOL, True)] and gate.token_of(bob) is None and gate.refused == {}
    # bob answers with his pass: ours went first, his is judged, the stream closed
    mine, bobs = ends(me, bob)
    desk.answer = mine
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate._send_hello, conn_to(bob))
        ours = await read_message(bobs, pb.Hello)
        assert ours.access == gate.my_pass and ours.time_ms == int(BASE * 1000)
        await write_message(bobs, hello(auth, "bob", bob))
    assert mine.finished == "closed" and gate.token_of(bob) is not None
    # a peer that does not speak the protocol (an open swarm's): refused, unless it already showed a pass
    for peer in (carol, bob):
        mine, _ = ends(me, peer)
        mine.refuse = ProtocolNotSupportedError("none of them")
        desk.answer = mine
        await gate._send_hello(conn_to(peer))
        assert mine.finished == "reset"
    assert gate.token_of(bob) is not None and gate.token_of(carol) is None
    assert await gate.inbound(carol, "/x") == (
        "unauthenticated: the peer shows no access pass (it does not speak /dedloc/auth/1.0.0)")
    # no answer within verdict_timeout: logged, reset; its own Hello (if any) decides
    mine, _ = ends(me, dave)
    desk.answer = mine
    await gate._send_hello(conn_to(dave))
    assert trio.current_time() == 3.0 and mine.finished == "reset" and dave not in gate._verdicts
    assert log_lines(caplog, "p2p.auth", "no Hello back") == [f"no Hello back from {dave}: "]


async def test_a_peers_hello_is_judged_answered_or_refused_in_words(
        tmp_path: Path, autojump_clock: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "p2p.auth")
    auth, _ = authority(tmp_path)
    gate, desk = desk_gate(auth, verdict_timeout=3.0)
    me, bob, eve = desk.peer_id, random_peer_id(), random_peer_id()
    # a good Hello is answered with ours, then closed
    mine, bobs = ends(me, bob)
    await write_message(bobs, hello(auth, "bob", bob))
    await gate.handle(mine)  # type: ignore[arg-type]
    assert mine.finished == "closed" and (await read_message(bobs, pb.Hello)).access == gate.my_pass
    assert gate.token_of(bob) is not None
    # a bad pass: refused, reset, no answer
    mine, eves = ends(me, eve)
    await write_message(eves, hello(auth, "eve", bob))
    await gate.handle(mine)  # type: ignore[arg-type]
    assert mine.finished == "reset" and await eves.read() == b""
    assert log_lines(caplog, "p2p.auth", "refused") == [f"refused {eve}: the pass was issued to another peer id"]
    # nothing sent: refused after verdict_timeout (not the wire's own 10 s)
    mine, _ = ends(me, eve)
    started = trio.current_time()
    await gate.handle(mine)  # type: ignore[arg-type]
    assert trio.current_time() - started == 3.0 and mine.finished == "reset"
    assert await gate.inbound(eve, "/x") == "unauthenticated: bad Hello: no complete Hello within 3 s"
    # a read that fails otherwise: the error's type is the reason
    mine, _ = ends(me, eve)
    mine.broken = ValueError("odd")
    await gate.handle(mine)  # type: ignore[arg-type]
    assert await gate.inbound(eve, "/x") == "unauthenticated: bad Hello: ValueError" and mine.finished == "reset"
    assert gate.refused == {"the pass was issued to another peer id": 1, "bad Hello": 2} and None not in gate._verdicts
    # the stream broke (its connection closed): no verdict either way, a debug line
    mine, _ = ends(me, bob)
    mine.broken = trio.BrokenResourceError("gone")
    await gate.handle(mine)  # type: ignore[arg-type]
    assert mine.finished == "reset" and gate.token_of(bob) is not None
    assert log_lines(caplog, "p2p.auth", "Hello from") == [f"Hello from {bob} cut short: gone"]
    # a peer never judged whose connection closes: nothing to forget, nothing raised
    gate.connection_closed(closed(random_peer_id()))


def closed(peer: ID) -> ConnectionInfo:
    return ConnectionInfo(peer, Multiaddr("/ip4/127.0.0.1/tcp/1"), Direction.INBOUND, PathKind.DIRECT,
                          conn=None)  # type: ignore[arg-type]


async def test_the_gate_waits_for_a_verdict_and_says_why_it_refused(tmp_path: Path, autojump_clock: object) -> None:
    auth, _ = authority(tmp_path)
    gate, desk = desk_gate(auth, verdict_timeout=3.0)
    bob, eve = random_peer_id(), random_peer_id()
    for protocol in sorted(PRE_AUTH):  # open to anyone at once
        assert await gate.inbound(eve, protocol) is None
    await gate.outbound(eve, sorted(PRE_AUTH))
    assert trio.current_time() == 0
    # no Hello: refused after verdict_timeout, in words
    assert await gate.inbound(eve, "/ipfs/ping/1.0.0") == "unauthenticated: no access pass within 3 s"
    assert trio.current_time() == 3.0
    with pytest.raises(AuthError, match=f"^{eve} has no valid access pass: no access pass within 3 s$"):
        await gate.outbound(eve, ["/ipfs/id/1.0.0", "/dedloc/rpc/1.0.0"])
    # a Hello that comes while a stream waits lets it through then
    waiting = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.outbound, bob, ["/dedloc/rpc/1.0.0"])
        await trio.sleep(1.0)
        assert gate._judge(bob, hello(auth, "bob", bob)) is True
    assert trio.current_time() - waiting == 1.0
    token = gate.token_of(bob)
    assert token is not None and (token.username, token.peer_id) == ("bob", bob)
    assert await gate.inbound(bob, "/dedloc/rpc/1.0.0") is None and gate.refused == {}
    # a bad pass is a verdict at once, counted by its first words (before a colon, at most 60 characters)
    assert gate._judge(eve, hello(auth, "eve", bob)) is False
    assert await gate.inbound(eve, "/x") == "unauthenticated: the pass was issued to another peer id"
    gate._refuse(eve, "bad Hello: garbled")
    gate._refuse(eve, "bad Hello: too long")
    long = "y" * 64
    assert gate._judge(eve, hello(auth, long, eve)) is True
    gate.revoke(frozenset({long}))
    assert gate._judge(eve, hello(auth, long, eve)) is False
    assert gate.refused == {"the pass was issued to another peer id": 1, "bad Hello": 2,
                            f"user '{long}' is revoked"[:60]: 1}
    assert gate.token_of(eve) is None and gate.token_of(random_peer_id()) is None
    # a closed connection forgets the verdict unless another connection to the peer stays
    desk.connected[bob] = 1
    gate.connection_closed(closed(bob))
    assert gate.token_of(bob) is not None
    desk.connected[bob] = 0
    gate.connection_closed(closed(bob))
    assert gate.token_of(bob) is None and bob not in gate._verdicts


async def test_refused_expired_and_revoked_peers_are_cut_in_time(tmp_path: Path, autojump_clock: object) -> None:
    auth, _ = authority(tmp_path, lifetime=100.0)
    gate, desk = desk_gate(auth, verdict_timeout=3.0, recheck_interval=5.0, max_skew=10.0)
    bob, carol, dave, eve = (random_peer_id() for _ in range(4))
    async with trio.open_nursery() as nursery:
        handle = gate.attach(nursery)
        for peer in (bob, carol, dave, eve):
            desk.connected[peer] = 1
        for name, peer in (("bob", bob), ("carol", carol)):
            assert gate._judge(peer, hello(auth, name, peer))
        # refused: cut after verdict_timeout, unless it shows a good pass meanwhile (a lapsed member may ask
        # the authority for a new one on the same connection)
        gate._judge_failed(dave, "the pass expired 9 s ago")
        gate._judge_failed(eve, "the pass expired 9 s ago")
        await trio.sleep(2.9)
        assert desk.cut == [] and gate._judge(dave, hello(auth, "dave", dave))
        await trio.sleep(0.2)
        assert desk.cut == [(3.0, eve)]
        # revoked: cut at the next recheck (every 5 s)
        gate.revoke(frozenset({"carol"}))
        await trio.sleep(2.0)
        assert desk.cut[1:] == [(5.0, carol)] and gate.refused["the pass of 'carol' revoked"] == 1
        # expired: its pass's 100 s and the 10 s of grace are over at 110; the next recheck (115) cuts it
        await trio.sleep(104.8)
        assert desk.cut[2:] == []
        await trio.sleep(6)
        assert {cut[1] for cut in desk.cut[2:]} == {bob, dave} and {cut[0] for cut in desk.cut[2:]} == {115.0}
        assert gate.refused["the pass of 'bob' expired"] == 1 and gate.token_of(bob) is None
        # removed: no more rechecks, nor cuts of the refused
        handle.remove()
        assert gate._nursery is None
        frank = random_peer_id()
        desk.connected[frank] = 1
        assert gate._judge(frank, hello(auth, "frank", frank))
        gate.revoke(frozenset({"frank"}))
        gate._judge_failed(random_peer_id(), "bad Hello: garbled")
        cuts = len(desk.cut)
        await trio.sleep(20)
        assert len(desk.cut) == cuts and gate.token_of(frank) is not None


async def test_a_renewed_pass_must_be_good_and_replaces_ours(tmp_path: Path) -> None:
    auth, _ = authority(tmp_path)
    me = random_peer_id()
    old = auth.sign("me", me, time.time())
    gate = Authenticator(Desk(me), cfg(auth), old)
    with pytest.raises(AuthError, match="another peer id"):
        await gate.renew(auth.sign("me", random_peer_id(), time.time()))
    assert gate.my_pass == old
    new = auth.sign("me", me, time.time())
    await gate.renew(new)
    assert gate.my_pass == new and gate._hello().access == new


class Issuer:
    """A node as :func:`request_pass` sees it: each stream it opens reaches ``serve`` (the authority's
    handler, or the test's) at the far end, in memory; ``hang``: an open that never completes."""

    def __init__(self, nursery: trio.Nursery, serve: Callable[[End], Awaitable[None]]) -> None:
        self.peer_id = random_peer_id()
        self.authority_id = random_peer_id()
        self._nursery, self._serve = nursery, serve
        self.hang = False
        self.streams: list[tuple[End, End]] = []

    async def new_stream(self, peer_id: ID, protocol: str) -> INetStream:
        assert (peer_id, protocol) == (self.authority_id, ISSUE_PROTOCOL)
        if self.hang:
            await trio.sleep_forever()
        mine, theirs = ends(self.peer_id, peer_id)
        self.streams.append((mine, theirs))
        self._nursery.start_soon(self._serve, theirs)
        return mine  # type: ignore[return-value]


async def test_the_authority_serves_counts_and_logs_each_request_and_resets_a_bad_one(
        tmp_path: Path, autojump_clock: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "p2p.authority")
    auth, secrets = authority(tmp_path, "alice")
    assert (auth.issued, auth.refused) == (0, 0)
    async with trio.open_nursery() as nursery:
        node = Issuer(nursery, auth.handle)  # type: ignore[arg-type]
        me = node.peer_id
        access = await request_pass(node, node.authority_id, "alice", secrets["alice"])
        assert verify_pass(access, cfg(auth), me, time.time()).username == "alice"
        assert [(a.finished, b.finished) for a, b in node.streams] == [("closed", "closed")]
        assert log_lines(caplog, "p2p.authority", "issued") == [f"issued a pass to 'alice' ({me})"]
        for _ in range(2):
            with pytest.raises(AuthError, match="^the authority refused a pass: not on the allowlist, revoked, or a "
                                                "wrong secret for 'alice'$"):
                await request_pass(node, node.authority_id, "alice", b"\x00" * 32)
        assert (auth.issued, auth.refused) == (1, 2)
        assert log_lines(caplog, "p2p.authority", "refused a pass") == [
            f"refused a pass to {me}: not on the allowlist, revoked, or a wrong secret for 'alice'"] * 2
        # a name no allowlist holds: reset before any challenge, said in the log
        with pytest.raises(RemoteProtocolError, match="ended before the Challenge"):
            await request_pass(node, node.authority_id, "a b", secrets["alice"])
        assert node.streams[-1][1].finished == "reset"
        assert log_lines(caplog, "p2p.authority", "bad pass request") == [
            f"bad pass request from {me}: username 'a b': 1 to 64 letters, digits, '.', '_' or '-'"]
        # over the node's rate for this caller: reset at once
        asked: list[str] = []

        def over_the_rate(who: str) -> None:
            asked.append(who)
            raise DedlocError("auth.issue: over 5 a minute")

        auth.allow = over_the_rate
        with pytest.raises((RemoteProtocolError, trio.BrokenResourceError)):  # the write, or the read, finds it reset
            await request_pass(node, node.authority_id, "alice", secrets["alice"])
        assert asked == [str(me)] and node.streams[-1][1].finished == "reset"
        assert log_lines(caplog, "p2p.authority", "pass request from") == [
            f"pass request from {me} refused: auth.issue: over 5 a minute"]
        auth.allow = asked.append  # under it: served
        assert await request_pass(node, node.authority_id, "alice", secrets["alice"]) and auth.issued == 2

    # a caller that asks for a challenge and takes no answer holds the handler 30 s at most
    async def asks_and_listens_no_more(stream: End) -> None:
        await write_message(stream, pb.ChallengeRequest(username="alice"))
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        mine, theirs = ends(random_peer_id(), random_peer_id(), lockstep=True)
        nursery.start_soon(asks_and_listens_no_more, mine)
        started = trio.current_time()
        await auth.handle(theirs)  # type: ignore[arg-type]
        assert trio.current_time() - started == 30.0 and theirs.finished == "reset"
        nursery.cancel_scope.cancel()


async def test_a_pass_request_ends_in_words_or_within_its_timeout(tmp_path: Path, autojump_clock: object) -> None:
    def answers(reply: pb.IssueReply) -> Callable[[End], Awaitable[None]]:
        async def serve(stream: End) -> None:
            await read_message(stream, pb.ChallengeRequest)
            await write_message(stream, pb.Challenge(nonce=b"n" * 32))
            await read_message(stream, pb.IssueRequest)
            await write_message(stream, reply)
        return serve

    async with trio.open_nursery() as nursery:
        node = Issuer(nursery, answers(pb.IssueReply()))
        with pytest.raises(AuthError, match="^the authority refused a pass: no pass in its answer$"):
            await request_pass(node, node.authority_id, "alice", b"s" * 32)
        node = Issuer(nursery, answers(pb.IssueReply(error="closed for the night")))
        with pytest.raises(AuthError, match="^the authority refused a pass: closed for the night$"):
            await request_pass(node, node.authority_id, "alice", b"s" * 32)
        node.hang = True
        started = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            await request_pass(node, node.authority_id, "alice", b"s" * 32)
        assert trio.current_time() - started == 30.0


# ---------------------------------------------------------------------- a closed swarm of nat.Peers


async def test_a_closed_swarm_works_for_passholders_and_refuses_an_outsider_everywhere(tmp_path: Path) -> None:
    import torch

    from averaging import Averager
    from nat import Peer
    from nat.peer import AuthSettings
    from training.state import STATE_PROTOCOL

    from .kit import loopback_peer_config
    from .test_averaging import config as averager_config

    allowlist = AllowList(tmp_path / ALLOWLIST_FILE)
    secrets = {u: allowlist.add(u) for u in ("alice", "bob")}
    allowlist.save()
    async with AsyncExitStack() as stack:
        relay_config = loopback_peer_config(relay=True)
        relay_config.auth = AuthSettings(authority_dir=tmp_path)
        relay = await stack.enter_async_context(Peer.open(relay_config))
        assert relay.authenticator is not None
        key = relay.authenticator.config.authority
        boot = [str(relay.addrs[0])]
        members = []
        for name in ("alice", "bob"):
            c = loopback_peer_config(initial_peers=boot)
            c.auth = AuthSettings(authority=key, username=name, secret=secrets[name])
            members.append(await stack.enter_async_context(Peer.open(c)))
        alice, bob = members
        # the DHT and averaging work between passholders
        assert await alice.dht.store("closed-run", b"members only", time.time() + 60)
        found = await bob.dht.get("closed-run", latest=True)
        assert found is not None and found.value == b"members only"
        cfg = averager_config(2)
        async with Averager.open(alice, cfg) as a, Averager.open(bob, cfg) as b:
            x, y = [torch.zeros(1000)], [torch.ones(1000)]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.step, x)
                nursery.start_soon(b.step, y)
            assert torch.allclose(x[0], torch.full((1000,), 0.5))
        # and datasets: bob fetches what alice publishes
        from training.datasets import Datasets

        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "a.txt").write_text("members only\n" * 1000)
        alice_data = await stack.enter_async_context(Datasets.open(alice))  # alice serves pieces too
        await alice_data.create("closed", tmp_path / "data")
        async with Datasets.open(bob) as bob_data:
            await bob_data.get("closed", tmp_path / "got", seed=False)
            assert (tmp_path / "got" / "a.txt").read_text() == "members only\n" * 1000
            # bob adds a shard; the run's authority (not a member's key) takes it out again
            (tmp_path / "more.txt").write_text("bob's\n" * 100)
            entry = await bob_data.add("closed", [tmp_path / "more.txt"], tmp_path / "bob", seed=False)
            assert [s.path for s in (await alice_data.find("closed")).shards()] == ["a.txt", "more.txt"]
            with pytest.raises(DedlocError, match="only closed's creator"):
                await bob_data.retract("closed", [entry.id])  # a member's own key: not enough
            await alice_data.retract("closed", [entry.id], authority_key=load_or_create_key(tmp_path / KEY_FILE))
            assert [s.path for s in (await bob_data.find("closed")).shards()] == ["a.txt"]
        # an outsider: connects (TCP and Noise), and is refused by every protocol of every member
        outsider_config = loopback_peer_config(initial_peers=boot)
        outsider_config.dht = None
        outsider = await stack.enter_async_context(Peer.open(outsider_config))
        averaging = await stack.enter_async_context(Averager.open(alice, cfg))  # alice serves all-reduce too
        told: set[object] = set()  # every member that told it; alice may greet it during the relay's turn
        for target in (relay, alice):
            await outsider.node.connect(str(target.addrs[0]))
            served = [p for p in target.node.host.get_mux().handlers if p is not None and p not in PRE_AUTH]
            assert "/dedloc/rpc/1.0.0" in served and ("/dedloc/allreduce/1.0.0" in served or target is relay)
            assert "/dedloc/dataset/1.0.0" in served or target is relay
            # told by the member's Hello (no other path fills closed_swarm); 15 s for a loaded 2-core CI
            await wait_until(lambda: target.peer_id in told | outsider.node.closed_swarm, 15)
            for protocol in served:
                told |= outsider.node.closed_swarm
                outsider.node.closed_swarm.clear()  # as a script that ignores being told: the gate refuses
                with pytest.raises(DedlocError, match="unauthenticated"):
                    stream = await outsider.node.new_stream(target.peer_id, protocol, lazy=False)
                    await stream.read(1)
        del averaging
        # its DHT requests (a store of its own record, a read) are refused at the door
        outsider.node.closed_swarm.clear()
        with pytest.raises(DedlocError, match="unauthenticated"):
            await outsider.node.rpc.call(alice.peer_id, "dht.find", pb.Hello(), pb.Hello, timeout=5)
        assert STATE_PROTOCOL not in PRE_AUTH


def test_the_authority_command_keeps_its_files_private_and_says_what_it_did(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}

    def dedloc(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "training.commands", *argv], cwd=root, env=env,
                              capture_output=True, text=True, timeout=60)

    added = json.loads(dedloc("authority", "add", "alice", "--dir", str(tmp_path / "a"), "--json").stdout)
    assert len(bytes.fromhex(added["secret"])) == 32 and len(bytes.fromhex(added["authority"])) == 32
    for name in ("authority.key", "allowlist.json"):
        assert (tmp_path / "a" / name).stat().st_mode & 0o777 == 0o600
    shown = json.loads(dedloc("authority", "show", "--dir", str(tmp_path / "a"), "--json").stdout)
    assert shown == {"authority": added["authority"], "users": {"alice": "allowed"}}
    assert dedloc("authority", "revoke", "alice", "--dir", str(tmp_path / "a")).returncode == 0
    assert json.loads(dedloc("authority", "show", "--dir", str(tmp_path / "a"), "--json").stdout)["users"] == {
        "alice": "revoked"}
    refused = dedloc("authority", "add", "bad name!", "--dir", str(tmp_path / "a"))
    assert refused.returncode != 0 and "username" in refused.stderr
    no_key = dedloc("peer", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA",
                    "--username", "alice", "--ephemeral", "--duration", "1")
    assert no_key.returncode != 0 and "--authority" in no_key.stderr


def test_the_authoritys_check_sees_a_revocation_written_to_its_allowlist_later(tmp_path: Path) -> None:
    """`dedloc authority revoke` edits the file while the authority's node runs: its check reads the
    change (the node's own renewal loop refuses the user at once from then on)."""
    auth, _ = authority(tmp_path, "alice", "bob")
    assert auth.check.revoked() == frozenset()
    allowlist = AllowList.load(tmp_path / "allowlist.json")
    allowlist.revoke("bob")
    allowlist.save()
    assert auth.check.revoked() == frozenset({"bob"})
