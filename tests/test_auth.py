"""Allowlist authentication (p2p/auth.py, p2p/authority.py): every way in, on real nodes on loopback.

Each I.5 check has its test: expired pass, a pass from another authority, for another peer id, a
forged signature, a replayed token, a clock off beyond the bound, a revoked user (connections closed
within the bound), a response from a peer that is not a passholder, an outsider refused by every
protocol the node serves; and the authority's issuing exchange (wrong secret, replayed challenge,
a proof made for another peer id)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import trio
from nacl.signing import SigningKey

from p2p.auth import PRE_AUTH, PROTOCOL, AuthConfig, AuthError, Authenticator, check_hello, verify_pass
from p2p.authority import AllowList, Authority, SecretCheck, proof, request_pass
from p2p.errors import DedlocError
from p2p.identity import new_identity, peer_id_of
from p2p.node import Node
from p2p.proto import auth_pb2 as pb
from p2p.wire import write_message

from .conftest import loopback_config
from .kit import wait_until

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
    with pytest.raises(AuthError, match="another authority"):
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


# ---------------------------------------------------------------------- a closed swarm of nat.Peers


async def test_a_closed_swarm_works_for_passholders_and_refuses_an_outsider_everywhere(tmp_path: Path) -> None:
    import torch

    from averaging import Averager
    from nat import Peer
    from nat.peer import AuthSettings
    from p2p.authority import ALLOWLIST_FILE
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
            from p2p.authority import KEY_FILE, load_or_create_key

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
