"""NAT-PMP (RFC 6886): the wire format as pure functions, the UDP exchange, and its mapper."""

from __future__ import annotations

import socket as stdsocket
import struct
from dataclasses import dataclass

from p2p.errors import ConfigError

from .common import MalformedResponse, MappingRefused, Method, PCP_VERSION, PMP_PORT, Protocol, _Grant, _Mapper, _check_port, _udp_exchange


# ---------------------------------------------------------------------- NAT-PMP (RFC 6886), sans-I/O

NATPMP_RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized or refused (port mapping switched off on the router?)",
    3: "network failure (the router has no external address yet?)",
    4: "out of resources (the router has no free port or mapping slot)",
    5: "unsupported opcode",
}
_NATPMP_OPCODES: dict[Protocol, int] = {"UDP": 1, "TCP": 2}


@dataclass(frozen=True)
class NatPmpAddress:
    """Answer to the external address request."""

    epoch: int
    external_ip: str


@dataclass(frozen=True)
class NatPmpMapping:
    """Answer to a map request; ``lifetime`` 0 confirms a deletion."""

    epoch: int
    protocol: Protocol
    internal_port: int
    external_port: int
    lifetime: int


def natpmp_address_request() -> bytes:
    """Version 0, opcode 0: "what is your external address?"."""
    return b"\x00\x00"


def natpmp_map_request(protocol: Protocol, internal_port: int, external_port: int, lifetime: int) -> bytes:
    """Map ``internal_port``; ``external_port`` is only a suggestion, 0 for "any"."""
    _check_port(internal_port, "internal port")
    _check_port(external_port, "suggested external port", allow_zero=True)
    if not 0 <= lifetime < 2**32:
        raise ConfigError(f"lifetime must fit 32 bits, not {lifetime}")
    return struct.pack("!BBHHHI", 0, _NATPMP_OPCODES[protocol], 0, internal_port, external_port, lifetime)


def natpmp_delete_request(protocol: Protocol, internal_port: int) -> bytes:
    """RFC 6886 section 3.4: lifetime 0 and suggested external port 0 delete a mapping."""
    return natpmp_map_request(protocol, internal_port, 0, 0)


def decode_natpmp_response(data: bytes) -> NatPmpAddress | NatPmpMapping:
    """Decode a NAT-PMP response; a non-zero result code raises :class:`MappingRefused`.

    The result code is checked before the length: gateways answer errors with
    just the 8-byte header (miniupnpd does).
    """
    if len(data) < 8:
        raise MalformedResponse(f"natpmp: {len(data)}-byte reply, shorter than the 8-byte header")
    version, opcode, result, epoch = struct.unpack_from("!BBHI", data)
    if version == PCP_VERSION and opcode & 0x80:
        raise MappingRefused("natpmp", 1, "unsupported version: the gateway speaks PCP only (answered version 2)")
    if version != 0:
        raise MalformedResponse(f"natpmp: reply has version {version}, not 0")
    if not opcode & 0x80:
        raise MalformedResponse(f"natpmp: opcode {opcode} is a request, not a response")
    if result != 0:
        raise MappingRefused("natpmp", result, NATPMP_RESULTS.get(result, "unknown result code"))
    op = opcode & 0x7F
    if op == 0:
        if len(data) < 12:
            raise MalformedResponse(f"natpmp: {len(data)}-byte address reply, expected 12")
        return NatPmpAddress(epoch, stdsocket.inet_ntoa(data[8:12]))
    if op in (1, 2):
        if len(data) < 16:
            raise MalformedResponse(f"natpmp: {len(data)}-byte mapping reply, expected 16")
        internal, external, lifetime = struct.unpack_from("!HHI", data, 8)
        return NatPmpMapping(epoch, "UDP" if op == 1 else "TCP", internal, external, lifetime)
    raise MalformedResponse(f"natpmp: unknown response opcode {opcode}")


def natpmp_retransmit_delays() -> list[float]:
    """RFC 6886 section 3.1: 250 ms, doubling, nine tries (64 s in all; callers bound it)."""
    return [0.25 * 2**i for i in range(9)]


def natpmp_address_reply(data: bytes) -> NatPmpAddress | None:
    """``data`` as the answer to an external-address request, or None: a packet of another kind, which the
    exchange ignores and waits on. A refusal raises :class:`MappingRefused`."""
    if len(data) < 2 or data[1] != 128:
        return None
    reply = decode_natpmp_response(data)
    return reply if isinstance(reply, NatPmpAddress) else None


def natpmp_map_reply(data: bytes, protocol: Protocol, internal_port: int) -> NatPmpMapping | None:
    """``data`` as the answer to a map request of ``protocol`` for ``internal_port``, or None: an answer
    to another request (another opcode, another port), which the exchange ignores and waits on."""
    if len(data) < 2 or data[1] != 128 + _NATPMP_OPCODES[protocol]:
        return None
    reply = decode_natpmp_response(data)
    return reply if isinstance(reply, NatPmpMapping) and reply.internal_port == internal_port else None


# pragma: no mutate block (the UDP exchanges and the mapper: tests/test_port_mapping.py, against loopback fakes and miniupnpd)


async def natpmp_external_address(gateway: str, *, port: int = PMP_PORT) -> str:
    """The gateway's external IPv4 address, asked over NAT-PMP."""
    reply = await _udp_exchange(gateway, natpmp_address_request(), natpmp_address_reply, natpmp_retransmit_delays(),
                                what="natpmp", port=port)
    return reply.external_ip


async def natpmp_map(
    gateway: str, protocol: Protocol, internal_port: int, external_port: int, lifetime: int, *, port: int = PMP_PORT
) -> NatPmpMapping:
    """Ask for (lifetime > 0) or delete (lifetime 0) a NAT-PMP mapping of ``internal_port``."""
    request = natpmp_map_request(protocol, internal_port, external_port, lifetime)
    return await _udp_exchange(gateway, request, lambda data: natpmp_map_reply(data, protocol, internal_port),
                               natpmp_retransmit_delays(), what="natpmp", port=port)


class _NatPmpMapper(_Mapper):
    method: Method = "natpmp"

    def __init__(self, gateway: str, protocol: Protocol, internal_port: int):
        self.gateway, self.protocol, self.internal_port = gateway, protocol, internal_port

    async def map(self, external_port: int, lifetime: int) -> _Grant:
        reply = await natpmp_map(self.gateway, self.protocol, self.internal_port, external_port, lifetime)
        address = await natpmp_external_address(self.gateway)
        return _Grant(address, reply.external_port, reply.lifetime)

    async def unmap(self) -> None:
        await natpmp_map(self.gateway, self.protocol, self.internal_port, 0, 0)
