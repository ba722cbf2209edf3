"""PCP (RFC 6887) ANNOUNCE and MAP: the wire format as pure functions, the UDP exchange, and its mapper."""

from __future__ import annotations

import ipaddress
import random
import secrets
import struct
from dataclasses import dataclass

from p2p.errors import ConfigError

from .common import MAX_PCP_MESSAGE, MalformedResponse, MappingRefused, Method, PCP_VERSION, PMP_PORT, Protocol, _Grant, _Mapper, _check_port, _ipv4, _udp_exchange


# ---------------------------------------------------------------------- PCP (RFC 6887), sans-I/O

PCP_OPCODE_ANNOUNCE = 0
PCP_OPCODE_MAP = 1
PCP_RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized (mapping switched off, or not allowed for this host or port)",
    3: "malformed request",
    4: "unsupported opcode",
    5: "unsupported option",
    6: "malformed option",
    7: "network failure (the router has no external address yet?)",
    8: "no resources (the router has no free port or mapping slot)",
    9: "unsupported protocol",
    10: "user exceeded quota",
    11: "cannot provide the external port or address asked for",
    12: "address mismatch (another NAT between us and the PCP server)",
    13: "excessive remote peers",
}
_IP_PROTOCOLS: dict[Protocol, int] = {"TCP": 6, "UDP": 17}
_PCP_HEADER = struct.Struct("!BBBBII12x")  # version, R|opcode, reserved, result, lifetime, epoch
_PCP_MAP = struct.Struct("!12sB3xHH16s")  # nonce, protocol, internal port, external port, external IP


@dataclass(frozen=True)
class PcpAnnounce:
    """Answer to ANNOUNCE: the server speaks PCP; ``epoch`` is its uptime as it counts it."""

    epoch: int


@dataclass(frozen=True)
class PcpMapping:
    """Answer to MAP; ``lifetime`` 0 confirms a deletion."""

    epoch: int
    lifetime: int
    nonce: bytes
    protocol: Protocol
    internal_port: int
    external_port: int
    external_ip: str


def _mapped(ip: str) -> bytes:
    """IPv4 as the IPv4-mapped IPv6 address PCP carries (``::ffff:a.b.c.d``)."""
    return b"\x00" * 10 + b"\xff\xff" + _ipv4(ip, "PCP address").packed


def _unmapped(raw: bytes) -> str:
    address = ipaddress.IPv6Address(raw)
    return str(address.ipv4_mapped) if address.ipv4_mapped is not None else str(address)


def _pcp_request_header(opcode: int, lifetime: int, client_ip: str) -> bytes:
    if not 0 <= lifetime < 2**32:
        raise ConfigError(f"lifetime must fit 32 bits, not {lifetime}")
    return struct.pack("!BBHI", PCP_VERSION, opcode, 0, lifetime) + _mapped(client_ip)


def pcp_announce_request(client_ip: str) -> bytes:
    """ANNOUNCE (RFC 6887 section 14.1): a side-effect-free "do you speak PCP?"."""
    return _pcp_request_header(PCP_OPCODE_ANNOUNCE, 0, client_ip)


def pcp_map_request(
    nonce: bytes,
    protocol: Protocol,
    internal_port: int,
    external_port: int,
    lifetime: int,
    client_ip: str,
    external_ip: str = "0.0.0.0",
) -> bytes:
    """MAP ``internal_port``; lifetime 0 with the same nonce deletes the mapping.

    ``client_ip`` must be our source address as the server sees it, or it answers
    ADDRESS_MISMATCH; the external port and address are suggestions (0 for any).
    """
    if len(nonce) != 12:
        raise ConfigError("a PCP mapping nonce is 12 bytes")
    _check_port(internal_port, "internal port")
    _check_port(external_port, "suggested external port", allow_zero=True)
    body = _PCP_MAP.pack(nonce, _IP_PROTOCOLS[protocol], internal_port, external_port, _mapped(external_ip))
    return _pcp_request_header(PCP_OPCODE_MAP, lifetime, client_ip) + body


def decode_pcp_response(data: bytes) -> PcpAnnounce | PcpMapping:
    """Decode a PCP response; a non-zero result code raises :class:`MappingRefused`.

    A NAT-PMP-only gateway answers a PCP request with a NAT-PMP "unsupported
    version" (version byte 0): that is a refusal too, saying which one it is.
    """
    if len(data) > MAX_PCP_MESSAGE:
        raise MalformedResponse(f"pcp: {len(data)}-byte reply, longer than PCP allows ({MAX_PCP_MESSAGE})")
    if len(data) >= 4 and data[0] == 0 and data[1] & 0x80:
        result = struct.unpack_from("!H", data, 2)[0]
        raise MappingRefused("pcp", result, "the gateway speaks NAT-PMP only (answered version 0)")
    if len(data) < _PCP_HEADER.size:
        raise MalformedResponse(f"pcp: {len(data)}-byte reply, shorter than the 24-byte header")
    version, r_opcode, _, result, lifetime, epoch = _PCP_HEADER.unpack_from(data)
    if not r_opcode & 0x80:
        raise MalformedResponse(f"pcp: opcode {r_opcode} is a request, not a response")
    if result == 1 and version != PCP_VERSION:
        raise MappingRefused("pcp", result, f"unsupported version (the gateway speaks PCP version {version})")
    if version != PCP_VERSION:
        raise MalformedResponse(f"pcp: reply has version {version}, not {PCP_VERSION}")
    if result != 0:
        raise MappingRefused("pcp", result, PCP_RESULTS.get(result, "unknown result code"))
    opcode = r_opcode & 0x7F
    if opcode == PCP_OPCODE_ANNOUNCE:
        return PcpAnnounce(epoch)
    if opcode == PCP_OPCODE_MAP:
        if len(data) < _PCP_HEADER.size + _PCP_MAP.size:
            raise MalformedResponse(f"pcp: {len(data)}-byte MAP reply, expected at least 60")
        nonce, proto, internal, external, ext_ip = _PCP_MAP.unpack_from(data, _PCP_HEADER.size)
        names = {v: k for k, v in _IP_PROTOCOLS.items()}
        if proto not in names:
            raise MalformedResponse(f"pcp: MAP reply for IP protocol {proto}, not TCP or UDP")
        return PcpMapping(epoch, lifetime, nonce, names[proto], internal, external, _unmapped(ext_ip))
    raise MalformedResponse(f"pcp: unexpected response opcode {opcode}")


def pcp_retransmit_delays(rng: random.Random | None = None) -> list[float]:
    """RFC 6887 section 8.1.1: 3 s, doubling, each +-10 % (callers bound the total)."""
    rng = rng or random.Random()
    return [3.0 * 2**i * (1 + rng.uniform(-0.1, 0.1)) for i in range(8)]



def pcp_announce_reply(data: bytes) -> PcpAnnounce | None:
    """``data`` as the answer to an ANNOUNCE, or None: a packet of another kind, which the exchange ignores."""
    reply = decode_pcp_response(data)
    return reply if isinstance(reply, PcpAnnounce) else None


def pcp_map_reply(data: bytes, nonce: bytes, internal_port: int) -> PcpMapping | None:
    """``data`` as the answer to our MAP request (``nonce``, ``internal_port``), or None: an answer about
    another mapping, even a refusal, is not ours, and the exchange ignores it and waits on."""
    if len(data) >= 2 and data[0] == PCP_VERSION and data[1] != 0x80 | PCP_OPCODE_MAP:
        return None
    if len(data) >= 36 and data[0] == PCP_VERSION and data[24:36] != nonce:
        return None  # checked before decoding: another mapping's refusal must not raise here
    reply = decode_pcp_response(data)  # a MAP reply of PCP's version, so of our nonce: a mapping or a refusal
    return reply if isinstance(reply, PcpMapping) and reply.internal_port == internal_port else None


# pragma: no mutate block (the UDP exchanges and the mapper: tests/test_port_mapping.py, against loopback fakes and miniupnpd)


async def pcp_announce(gateway: str, client_ip: str, *, port: int = PMP_PORT) -> PcpAnnounce:
    """ANNOUNCE: does the gateway speak PCP?"""
    return await _udp_exchange(gateway, pcp_announce_request(client_ip), pcp_announce_reply, pcp_retransmit_delays(),
                               what="pcp", port=port)


async def pcp_map(
    gateway: str,
    client_ip: str,
    nonce: bytes,
    protocol: Protocol,
    internal_port: int,
    external_port: int,
    lifetime: int,
    *,
    port: int = PMP_PORT,
) -> PcpMapping:
    """Ask for (lifetime > 0) or delete (lifetime 0, same nonce) a PCP mapping."""
    request = pcp_map_request(nonce, protocol, internal_port, external_port, lifetime, client_ip)
    return await _udp_exchange(gateway, request, lambda data: pcp_map_reply(data, nonce, internal_port),
                               pcp_retransmit_delays(), what="pcp", port=port)


class _PcpMapper(_Mapper):
    method: Method = "pcp"

    def __init__(self, gateway: str, local_ip: str, protocol: Protocol, internal_port: int):
        self.gateway, self.local_ip, self.protocol, self.internal_port = gateway, local_ip, protocol, internal_port
        # RFC 6887 section 11.1: the nonce proves, on renewal and deletion, that the mapping is ours.
        self.nonce = secrets.token_bytes(12)
        self.external_port = 0

    async def map(self, external_port: int, lifetime: int) -> _Grant:
        reply = await pcp_map(self.gateway, self.local_ip, self.nonce, self.protocol, self.internal_port, external_port, lifetime)
        self.external_port = reply.external_port
        return _Grant(reply.external_ip, reply.external_port, reply.lifetime)

    async def unmap(self) -> None:
        await pcp_map(self.gateway, self.local_ip, self.nonce, self.protocol, self.internal_port, self.external_port, 0)
