"""Multiaddr parsing and ranking: the one place that decides which address to dial.

The ranking follows what works for volunteers behind NAT: a direct path beats a
relayed one (relays are cheap public boxes with little bandwidth), and a public
address beats a private one (a private address of a remote peer is only useful
if we happen to share its LAN). Loopback comes last, so that a peer advertising
127.0.0.1 never shadows a real route, but still works in local swarms.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from enum import IntEnum

import multiaddr
import multihash
from libp2p.abc import INetConn
from libp2p.peer.id import ID
from multiaddr import Multiaddr
from multiaddr.transforms import bytes_iter

from .errors import AddressError

CIRCUIT = "p2p-circuit"


class Scope(IntEnum):
    """How far an address can be reached from; lower is better to dial."""

    PUBLIC = 0
    PRIVATE = 1
    LOOPBACK = 2
    UNKNOWN = 3


def parse_multiaddr(text: str | Multiaddr, *, what: str = "address") -> Multiaddr:
    """Parse ``text`` or raise :class:`AddressError` naming the bad part and the fix."""
    if isinstance(text, Multiaddr):
        return text
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"empty {what}: expected a multiaddr like /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo...")
    text = text.strip()
    if not text.startswith("/"):
        raise AddressError(
            f"{what} {text!r} is not a multiaddr: it must start with '/', "
            "e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo..."
        )
    try:
        return Multiaddr(text)
    except multiaddr.exceptions.Error as e:
        raise AddressError(f"{what} {text!r} is malformed: {_reason(e, text)}") from e
    except Exception as e:  # the multiaddr codecs raise assorted types on garbage
        raise AddressError(f"{what} {text!r} is malformed: {e}") from e


def _reason(e: Exception, text: str) -> str:
    """py-multiaddr's message without the input it repeats twice ("Invalid MultiAddr '<text>': <reason>
    (string: <text>)"): cut by the input itself, which may hold any characters."""
    msg = str(e)
    msg = msg.removeprefix(f"Invalid MultiAddr {text!r}: ")
    return msg.removesuffix(f" (string: {text})")


def peer_id_of(addr: Multiaddr) -> ID | None:
    """The peer an address leads to: the last ``/p2p/`` component (after a circuit)."""
    raw = None
    for name, value in _parts(addr):
        if name == "p2p":
            raw = value
    if raw is None:
        return None
    peer_id = peer_id_from_bytes(raw)  # the usual form: the peer id's own bytes
    if peer_id is not None:
        return peer_id
    text = None  # a CIDv1 (/p2p/bafz...): as py-multiaddr renders it, in base58
    try:
        text = [str(v) for p, v in addr.items() if p.name == "p2p"][-1]
        return ID.from_base58(text)
    except Exception as e:
        raise AddressError(f"address {addr.to_bytes().hex()} has an invalid peer id {text or raw.hex()!r}") from e


def peer_ids_of(addrs: Iterable[str | Multiaddr], *, what: str = "address") -> tuple[ID, ...]:
    """The peers ``addrs`` lead to (:func:`peer_id_of`), each once, in order; an address that names no
    peer is left out (initial peers: the ones the swarm's closed-swarm check and a trainer's trust know)."""
    ids = (peer_id_of(parse_multiaddr(a, what=what)) for a in addrs)
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def peer_id_from_bytes(raw: bytes) -> ID | None:
    """The peer id whose bytes ``raw`` are, or None: ``ID()`` itself accepts any bytes, so the
    multihash is checked first."""
    try:
        multihash.decode(raw)
    except Exception:
        return None
    return ID(raw)


def parse_peer_addr(text: str | Multiaddr, *, what: str = "peer address") -> tuple[Multiaddr, ID]:
    """Parse an address that must name its peer, as initial peers and dial targets do."""
    addr = parse_multiaddr(text, what=what)
    pid = peer_id_of(addr)
    if pid is None:
        raise AddressError(
            f"{what} {addr} has no /p2p/<peer-id> part; without it the peer cannot be "
            "authenticated. Ask its operator for the full address (`dedloc id` prints it)."
        )
    return addr, pid


def without_peer_id(addr: Multiaddr) -> Multiaddr:
    """The transport part of a direct address (what a transport dials)."""
    raw = addr.to_bytes()
    spans = [(offset, proto.name) for offset, proto, _, _ in bytes_iter(raw)]
    if any(name == CIRCUIT for _, name in spans):
        return addr
    ends = [offset for offset, _ in spans[1:]] + [len(raw)]
    kept = b"".join(raw[offset:end] for (offset, name), end in zip(spans, ends) if name != "p2p")
    return addr if len(kept) == len(raw) else Multiaddr(kept)


def with_peer_id(addr: Multiaddr, pid: ID) -> Multiaddr:
    if peer_id_of(addr) == pid:
        return addr
    return addr.encapsulate(Multiaddr(f"/p2p/{pid.to_base58()}"))


def is_relayed(addr: Multiaddr) -> bool:
    return any(p.name == CIRCUIT for p in addr.protocols())


def is_relayed_conn(conn: INetConn) -> bool:
    """Whether a connection goes through a relay (its transport address is a circuit); one
    that cannot say counts as direct, as py-libp2p's own connection choice has it."""
    try:
        return any(is_relayed(a) for a in conn.get_transport_addresses())
    except Exception:
        return False


def split_circuit(addr: Multiaddr) -> tuple[Multiaddr, ID]:
    """``<relay addr>/p2p/<relay>/p2p-circuit[/p2p/<target>]`` → (relay address, relay id).

    The relay address may be just ``/p2p/<relay>`` (dial the relay by id).
    """
    items = list(addr.items())
    cut = next((i for i, (p, _) in enumerate(items) if p.name == CIRCUIT), None)
    if cut is None:
        raise AddressError(f"{addr} is not a relayed (/p2p-circuit) address")
    relay_part = Multiaddr("".join(f"/{p.name}/{v}" if v is not None else f"/{p.name}" for p, v in items[:cut]))
    relay = peer_id_of(relay_part) if items[:cut] else None
    if relay is None:
        raise AddressError(f"relayed address {addr} does not name its relay (/p2p/<relay> before /p2p-circuit)")
    return relay_part, relay


def _parts(addr: Multiaddr) -> list[tuple[str, bytes]]:
    """Each protocol's name and raw value, in one pass over the bytes. py-multiaddr's ``items()``
    renders every value as text (a peer id in base58): 38 us for a three-part address, which the
    ranking of a peer exchange's answer paid for every address of every peer it lists."""
    return [(proto.name, raw) for _, proto, _, raw in bytes_iter(addr.to_bytes())]


def _scope(parts: list[tuple[str, bytes]]) -> Scope:
    """The scope of the first IP or DNS name among ``parts``."""
    for name, raw in parts:
        if name in ("ip4", "ip6", "dns", "dns4", "dns6", "dnsaddr"):
            break
    else:
        return Scope.UNKNOWN
    if name in ("ip4", "ip6"):
        ip = ipaddress.IPv4Address(raw) if name == "ip4" else ipaddress.IPv6Address(raw)
        if ip.is_loopback:
            return Scope.LOOPBACK
        if not ip.is_global:  # private, link-local, unspecified, CGNAT 100.64/10: none is global
            return Scope.PRIVATE
        return Scope.PUBLIC
    return Scope.PUBLIC if raw != b"localhost" else Scope.LOOPBACK  # a DNS name


def scope_of(addr: Multiaddr) -> Scope:
    """Where the address's first part (an IP or a DNS name) can be reached from."""
    return _scope(_parts(addr))


def ip_and_tcp_port(addr: Multiaddr) -> tuple[str, int] | None:
    """The IP and TCP port of an ``/ip4|ip6/<ip>/tcp/<port>…`` address, else None."""
    items = list(addr.items())
    if len(items) > 1 and items[0][0].name in ("ip4", "ip6") and items[1][0].name == "tcp":
        return str(items[0][1]), int(str(items[1][1]))
    return None


def tcp_port(addr: Multiaddr) -> int | None:
    """The TCP port of an ``/ip4|ip6/…/tcp/<port>`` address, else None."""
    found = ip_and_tcp_port(addr)
    return None if found is None else found[1]


def ip_family(addr: Multiaddr) -> str | None:
    """``"ip4"`` or ``"ip6"``: the family of an address's first part, if it is an IP (None for a DNS name)."""
    items = list(addr.items())
    name = items[0][0].name if items else None
    return name if name in ("ip4", "ip6") else None


def reachable_tcp(addr: Multiaddr, *, allow_private: bool = False) -> bool:
    """A direct TCP address (``/ip4|ip6/…/tcp/…``, no circuit) in public scope, or any scope if allowed.

    What AutoNAT may dial back and hole punching may aim at: private addresses
    only make sense inside one LAN (and cost a 10 s timeout elsewhere).
    """
    names = [p.name for p in addr.protocols()]
    if is_relayed(addr) or len(names) < 2 or names[0] not in ("ip4", "ip6") or names[1] != "tcp":
        return False
    return allow_private or scope_of(addr) == Scope.PUBLIC


def dial_rank(addr: Multiaddr) -> tuple[bool, Scope, bool]:
    """Sort key: direct before relayed, public before private before loopback, IPv4 first."""
    parts = _parts(addr)
    names = {name for name, _ in parts}
    return (CIRCUIT in names, _scope(parts), "ip6" in names)


def is_unspecified(addr: Multiaddr) -> bool:
    """Whether the address's IP is ``0.0.0.0`` or ``::``: a listen socket's "every address", never
    one to dial (a connect to it reaches the dialer's own host)."""
    items = list(addr.items())
    return bool(items) and items[0][0].name in ("ip4", "ip6") and ipaddress.ip_address(str(items[0][1])).is_unspecified


def rank_for_dial(addrs: Iterable[Multiaddr]) -> list[Multiaddr]:
    """Unique addresses in the order a dialer should try them, unspecified ones (``0.0.0.0``, ``::``)
    left out as go-libp2p's swarm leaves them: a peer with no IPv6 address advertised ``/ip6/::/…``,
    and each dial of it reached the dialer's own host."""
    unique = {a.to_bytes(): a for a in addrs if not is_unspecified(a)}
    return sorted(unique.values(), key=dial_rank)
