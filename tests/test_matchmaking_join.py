"""averaging.matchmaking's join call as the follower sees each answer of a leader, over the in-memory
swarm of tests/fake_swarm.py (a real RPC, hand-made leaders)."""

from __future__ import annotations

import pytest
import trio

from averaging.formation import JoinOutcome, Redirected, Refused
from averaging.matchmaking import JOIN_METHOD
from averaging.proto import averaging_pb2 as pb
from p2p.rpc import CallContext

from .fake_swarm import fake_swarms
from .kit import numbered_peer_id
from .test_matchmaking import ask_to_join, member


async def join_answered(response: pb.JoinResponse) -> JoinOutcome:
    """What a follower makes of a leader that answers its join with ``response``."""
    async with fake_swarms(2) as (follower, leader):
        async def answer(request: pb.JoinRequest, ctx: CallContext) -> pb.JoinResponse:
            return response

        leader.rpc.add_unary(f"{JOIN_METHOD}.run", pb.JoinRequest, answer)
        with trio.fail_after(10):
            return await ask_to_join(follower, member(leader))


async def test_a_redirect_names_the_new_leader() -> None:
    other = numbered_peer_id(7)
    assert await join_answered(pb.JoinResponse(status=pb.JoinResponse.REDIRECT,
                                               leader=other.to_bytes())) == Redirected(other)


@pytest.mark.parametrize("leader", [b"", b"\x00", b"not a multihash at all"])
async def test_a_redirect_to_no_peer_is_a_refusal(leader: bytes) -> None:
    """py-libp2p's ID() takes any bytes: the leader's are parsed as every peer's are (p2p.untrusted)."""
    assert await join_answered(pb.JoinResponse(status=pb.JoinResponse.REDIRECT, leader=leader)) == \
        Refused("a redirect to no peer")


async def test_a_rejection_is_a_refusal_with_the_leaders_reason() -> None:
    assert await join_answered(pb.JoinResponse(status=pb.JoinResponse.REJECTED, reason="full")) == Refused("full")
