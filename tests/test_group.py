"""averaging/group.py: members' declarations, a group's agreed order and its checks, on the wire and
off it, and the contributors' bit set each averaged chunk carries (pure)."""

from __future__ import annotations

import hashlib

import pytest
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from averaging.errors import AllreduceProtocolError
from averaging.group import (
    MAX_GROUP_SIZE,
    Group,
    Member,
    Role,
    contributors_bits,
    contributors_from_bits,
)
from averaging.load_balancing import Capacity
from averaging.proto import averaging_pb2 as pb
from p2p.errors import ConfigError

from .kit import random_peer_id

IDS = [random_peer_id() for _ in range(4)]
ADDR = Multiaddr("/ip4/127.0.0.1/tcp/4001")


def member(i: int, role: Role = Role.FULL) -> Member:
    return Member(IDS[i], (ADDR,), role, b"schema")


def test_roles_say_who_sends_and_who_reduces() -> None:
    assert (Role.FULL.sends, Role.FULL.reduces) == (True, True)
    assert (Role.SENDER.sends, Role.SENDER.reduces) == (True, False)
    assert (Role.AUXILIARY.sends, Role.AUXILIARY.reduces) == (False, True)


def test_a_member_s_capacity_is_its_rates_and_its_role() -> None:
    m = Member(IDS[0], (), Role.SENDER, b"", upload=1.0, download=2.0, compute=3.0)
    assert m.capacity == Capacity(1.0, 2.0, 3.0, True, False)
    assert (member(0).upload, member(0).download, member(0).compute, member(0).accepts_joins,
            member(0).expiration) == (0.0, 0.0, 0.0, False, 0.0)


@pytest.mark.parametrize("role", list(Role))
def test_every_field_of_a_declaration_crosses_the_wire(role: Role) -> None:
    full = Member(IDS[1], (ADDR,), role, b"fingerprint", upload=1.5, download=2.5, compute=3.5, accepts_joins=True,
                  expiration=99.0)
    assert Member.from_wire(pb.Declaration.FromString(full.to_wire().SerializeToString())) == full


def test_a_malformed_declaration_is_refused_by_name() -> None:
    good = member(0).to_wire()
    bad = pb.Declaration()
    bad.CopyFrom(good)
    bad.peer_id = b"\x00junk"
    with pytest.raises(AllreduceProtocolError, match="^declaration with a malformed peer id$"):
        Member.from_wire(bad)
    bad.CopyFrom(good)
    bad.role = 99  # type: ignore[assignment]
    with pytest.raises(AllreduceProtocolError, match=f"^declaration of {IDS[0]} has unknown role 99$"):
        Member.from_wire(bad)
    for name in ("upload", "download", "compute", "expiration"):
        for value in (-1.0, float("nan"), float("inf")):
            bad.CopyFrom(good)
            setattr(bad, name, value)
            with pytest.raises(AllreduceProtocolError, match=f"^declaration of {IDS[0]} has {name} = {value}$"):
                Member.from_wire(bad)
    many = pb.Declaration()
    many.CopyFrom(good)
    many.addrs.extend(Multiaddr(f"/ip4/127.0.0.1/tcp/{5000 + i}").to_bytes() for i in range(20))
    assert len(Member.from_wire(many).addrs) == 16  # at most 16 addresses are kept


def test_a_group_knows_its_members_in_order() -> None:
    group = Group(b"id", (member(0), member(1, Role.AUXILIARY), member(2, Role.SENDER)), 1)
    assert group.me == member(1, Role.AUXILIARY) and group.size == 3
    assert [group.index_of(i) for i in IDS] == [0, 1, 2, None]
    assert group.senders() == [0, 2]


def test_a_group_refuses_what_no_round_could_run() -> None:
    two = (member(0), member(1))
    for index in (-1, 2):
        with pytest.raises(ConfigError, match="^my_index out of range$"):
            Group(b"id", two, index)
    with pytest.raises(ConfigError, match="^a peer appears twice in the group$"):
        Group(b"id", (member(0), member(0)), 0)
    many = tuple(Member(ID(bytes([i % 256, i // 256])), (), Role.FULL, b"") for i in range(MAX_GROUP_SIZE + 1))
    with pytest.raises(ConfigError, match=f"^a group has at most {MAX_GROUP_SIZE} members$"):
        Group(b"id", many, 0)
    assert Group(b"id", many[:MAX_GROUP_SIZE], MAX_GROUP_SIZE - 1).size == MAX_GROUP_SIZE


def test_each_phase_is_a_round_of_its_own_with_the_same_members() -> None:
    group = Group(b"group-id", (member(0), member(1)), 1)
    phase = group.for_phase(3)
    assert phase.group_id == hashlib.sha256(b"group-id/phase/3").digest()[:16]
    assert (phase.members, phase.my_index) == (group.members, group.my_index)
    assert group.for_phase(4).group_id != phase.group_id


def test_a_group_crosses_the_wire_and_each_member_finds_itself() -> None:
    group = Group(b"g" * 64, (member(0), member(1, Role.SENDER), member(2, Role.AUXILIARY)), 0)
    wire = pb.Group.FromString(group.to_wire().SerializeToString())
    for i in range(3):
        assert Group.from_wire(wire, IDS[i]) == Group(group.group_id, group.members, i)


@pytest.mark.parametrize(("members", "group_id", "me", "message"), [
    ([], b"id", 0, "^group of 0 members$"),
    ([0, 1], b"id", 3, "^the group does not include this peer$"),
    ([0, 1, 0], b"id", 0, "^a peer appears twice in the group$"),
    ([0, 1], b"", 0, "^group id missing or too long$"),
    ([0, 1], b"g" * 65, 0, "^group id missing or too long$"),
])
def test_a_malformed_group_is_refused_by_name(members: list[int], group_id: bytes, me: int, message: str) -> None:
    wire = pb.Group(group_id=group_id, members=[member(i).to_wire() for i in members])
    with pytest.raises(AllreduceProtocolError, match=message):
        Group.from_wire(wire, IDS[me])


def test_a_group_over_the_limit_is_refused_before_its_members_are_read() -> None:
    wire = pb.Group(group_id=b"id", members=[pb.Declaration()] * (MAX_GROUP_SIZE + 1))
    with pytest.raises(AllreduceProtocolError, match=f"^group of {MAX_GROUP_SIZE + 1} members$"):
        Group.from_wire(wire, IDS[0])


def test_contributors_are_one_bit_each_low_bit_first() -> None:
    assert contributors_bits([0, 9], 10) == b"\x01\x02"
    assert contributors_bits(frozenset({7, 8, 15}), 16) == b"\x80\x81"
    assert contributors_bits([], 0) == b"" and contributors_bits([], 9) == b"\x00\x00"
    for size in (1, 8, 9, 255, 256):
        indexes = frozenset(range(0, size, 3))
        assert contributors_from_bits(contributors_bits(indexes, size), size) == indexes
    assert contributors_from_bits(b"\xff", 3) == frozenset({0, 1, 2})  # bits past the group are not members


def test_contributors_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(AllreduceProtocolError, match="^contributors of 1 bytes for a group of 9$"):
        contributors_from_bits(b"\x01", 9)
    with pytest.raises(AllreduceProtocolError, match="^contributors of 2 bytes for a group of 8$"):
        contributors_from_bits(b"\x01\x00", 8)


def test_a_group_of_the_most_members_crosses_the_wire() -> None:
    ids = [random_peer_id() for _ in range(MAX_GROUP_SIZE)]
    wire = pb.Group(group_id=b"id", members=[Member(i, (), Role.FULL, b"").to_wire() for i in ids])
    assert Group.from_wire(wire, ids[-1]).my_index == MAX_GROUP_SIZE - 1
