"""A group as every member sees it: the members in one agreed order, their roles and capacities."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.errors import ConfigError
from p2p.untrusted import decode_addrs, decode_peer_id

from .errors import AllreduceProtocolError
from .load_balancing import Capacity
from .proto import averaging_pb2 as pb

#: Most members a group may have (one bit each in a chunk's contributors).
MAX_GROUP_SIZE = 256


class Role(StrEnum):
    """``full`` sends and reduces; ``sender`` never reduces (client mode, relayed);
    ``auxiliary`` only reduces (no tensors of its own, DeDLOC's c_i = 0)."""

    FULL = "full"
    SENDER = "sender"
    AUXILIARY = "auxiliary"

    @property
    def sends(self) -> bool:
        return self is not Role.AUXILIARY

    @property
    def reduces(self) -> bool:
        return self is not Role.SENDER


_ROLE_TO_WIRE = {Role.FULL: pb.ROLE_FULL, Role.SENDER: pb.ROLE_SENDER, Role.AUXILIARY: pb.ROLE_AUXILIARY}
_ROLE_FROM_WIRE = {v: k for k, v in _ROLE_TO_WIRE.items()}


@dataclass(frozen=True)
class Member:
    """One member as its declaration describes it."""

    peer_id: ID
    addrs: tuple[Multiaddr, ...]
    role: Role
    schema: bytes
    upload: float = 0.0
    download: float = 0.0
    compute: float = 0.0
    accepts_joins: bool = False
    expiration: float = 0.0

    @property
    def capacity(self) -> Capacity:
        return Capacity(self.upload, self.download, self.compute, self.role.sends, self.role.reduces)

    def to_wire(self) -> pb.Declaration:
        return pb.Declaration(peer_id=self.peer_id.to_bytes(), addrs=[a.to_bytes() for a in self.addrs],
                              role=_ROLE_TO_WIRE[self.role], schema=self.schema, upload=self.upload,
                              download=self.download, compute=self.compute, accepts_joins=self.accepts_joins,
                              expiration=self.expiration)

    @classmethod
    def from_wire(cls, msg: pb.Declaration) -> Member:
        """Parse a peer's declaration; :class:`AllreduceProtocolError` when it is malformed."""
        peer_id = decode_peer_id(msg.peer_id)
        if peer_id is None:
            raise AllreduceProtocolError("declaration with a malformed peer id")
        if msg.role not in _ROLE_FROM_WIRE:
            raise AllreduceProtocolError(f"declaration of {peer_id} has unknown role {msg.role}")
        for name in ("upload", "download", "compute", "expiration"):
            value = getattr(msg, name)
            if not math.isfinite(value) or value < 0:
                raise AllreduceProtocolError(f"declaration of {peer_id} has {name} = {value}")
        return cls(peer_id, tuple(decode_addrs(msg.addrs, limit=16)), _ROLE_FROM_WIRE[msg.role], bytes(msg.schema),
                   msg.upload, msg.download, msg.compute, msg.accepts_joins, msg.expiration)


@dataclass(frozen=True)
class Group:
    """The members of one round in the order all of them use, and who this peer is among them."""

    group_id: bytes
    members: tuple[Member, ...]
    my_index: int

    def __post_init__(self) -> None:
        if not 0 <= self.my_index < len(self.members):
            raise ConfigError("my_index out of range")
        if len(self.members) > MAX_GROUP_SIZE:
            raise ConfigError(f"a group has at most {MAX_GROUP_SIZE} members")
        if len({m.peer_id for m in self.members}) != len(self.members):
            raise ConfigError("a peer appears twice in the group")

    @property
    def me(self) -> Member:
        return self.members[self.my_index]

    @property
    def size(self) -> int:
        return len(self.members)

    def index_of(self, peer_id: ID) -> int | None:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        return None

    def senders(self) -> list[int]:
        return [i for i, m in enumerate(self.members) if m.role.sends]

    def for_phase(self, phase: int) -> Group:
        """The same members under another round id: a group that averages more than once (PowerSGD's
        phases) runs each round apart, and a stream names the round it belongs to."""
        group_id = hashlib.sha256(self.group_id + b"/phase/" + str(phase).encode()).digest()[:16]
        return replace(self, group_id=group_id)

    def to_wire(self) -> pb.Group:
        return pb.Group(group_id=self.group_id, members=[m.to_wire() for m in self.members])

    @classmethod
    def from_wire(cls, msg: pb.Group, me: ID) -> Group:
        if not msg.members or len(msg.members) > MAX_GROUP_SIZE:
            raise AllreduceProtocolError(f"group of {len(msg.members)} members")
        members = tuple(Member.from_wire(m) for m in msg.members)
        ids = [m.peer_id for m in members]
        if me not in ids:
            raise AllreduceProtocolError("the group does not include this peer")
        if len(set(ids)) != len(ids):
            raise AllreduceProtocolError("a peer appears twice in the group")
        if not msg.group_id or len(msg.group_id) > 64:
            raise AllreduceProtocolError("group id missing or too long")
        return cls(bytes(msg.group_id), members, ids.index(me))


def contributors_bits(indexes: Sequence[int] | frozenset[int], size: int) -> bytes:
    bits = bytearray((size + 7) // 8)
    for i in indexes:
        bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


def contributors_from_bits(bits: bytes, size: int) -> frozenset[int]:
    if len(bits) != (size + 7) // 8:
        raise AllreduceProtocolError(f"contributors of {len(bits)} bytes for a group of {size}")
    found = frozenset(i for i in range(size) if bits[i // 8] >> (i % 8) & 1)
    return found
