"""Admission before crypto (p2p/admission.py): floods held on loopback (the pure decisions:
tests/test_admission_decisions.py).

Loopback offers 127.0.0.0/8: the attacker's sockets are bound to 127.0.x.y source
addresses, the honest client's to 127.1.0.1 (another /24). Every flood is bounded
in count and time.
"""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack

import pytest
import trio

from p2p import Node
from p2p.admission import AdmissionConfig, Refusal

from .conftest import loopback_config
from .kit import wait_until


# ---------------------------------------------------------------------- on loopback


async def idle_connections(port: int, source_ips: list[str], per_ip: int) -> list[trio.SocketStream]:
    """Open TCP connections that send nothing, from each source address (bounded: len * per_ip)."""
    out = []
    for ip in source_ips:
        for _ in range(per_ip):
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            await sock.bind((ip, 0))
            try:
                with trio.fail_after(5):
                    await sock.connect(("127.0.0.1", port))
            except (OSError, trio.TooSlowError):
                sock.close()
                continue
            out.append(trio.SocketStream(sock))
    return out


async def honest_ping(target: Node, source_ip: str = "127.1.0.1") -> float:
    """A fresh node from another address: connect and ping (what `dedloc ping` does)."""
    async with Node.open(loopback_config(listen=[f"/ip4/{source_ip}/tcp/0"])) as client:
        with trio.fail_after(10):
            await client.connect(target.addrs[0], from_listen_port=True)
            return await client.ping(target.peer_id)


@pytest.mark.realtime  # the flood must fill the table within its handshake deadlines: starved at nice 10 beside a lab, it did not (a fresh clone at b799b63)
async def test_idle_floods_from_one_address_and_from_many_leave_honest_peers_served() -> None:
    """One address holding 60 idle connections gets 8 handshaking slots; 30 addresses of 4 each fill
    the global table, which evicts from the largest holders for the honest client. Idle ones are
    closed at the handshake deadline. The honest client is served throughout."""
    config = loopback_config()
    config.resources.admission = AdmissionConfig(max_handshaking=64, handshake_timeout=1.5)
    async with AsyncExitStack() as stack, Node.open(config) as node:
        port = int(str(node.addrs[0]).split("/tcp/")[1].split("/")[0])
        flood = await idle_connections(port, ["127.0.0.2"], 60)
        for s in flood:
            stack.push_async_callback(s.aclose)
        await wait_until(lambda: node.admission.refused[Refusal.HANDSHAKING_PER_ADDRESS] >= 50, 10,
                         what="the flood's connections beyond 8 refused")
        assert node.admission.metrics()["handshaking"] <= 8
        assert await honest_ping(node) > 0
        many = await idle_connections(port, [f"127.0.{i}.{i + 1}" for i in range(10, 40)], 4)
        for s in many:
            stack.push_async_callback(s.aclose)
        await wait_until(lambda: node.admission.metrics()["handshaking"] >= 60, 10, what="the table filling up")
        assert await honest_ping(node) > 0
        # idle connections do not outlive the deadline
        await wait_until(lambda: node.admission.metrics()["handshaking"] == 0, 10, what="the deadline")
        assert node.admission.refused[Refusal.HANDSHAKE_DEADLINE] >= 60
        assert await honest_ping(node) > 0


async def test_an_authenticated_connection_is_not_cut_at_the_handshake_deadline() -> None:
    config = loopback_config()
    config.resources.admission = AdmissionConfig(handshake_timeout=0.5)
    async with Node.open(config) as node, Node.open(loopback_config(listen=["/ip4/127.1.0.2/tcp/0"])) as client:
        await client.connect(node.addrs[0])
        await trio.sleep(1.5)
        assert await client.ping(node.peer_id) > 0
        assert node.admission.metrics()["inbound"] == 1 and node.admission.metrics()["handshaking"] == 0
        await client.disconnect(node.peer_id)
        await wait_until(lambda: node.admission.metrics()["inbound"] == 0, 10, what="the ticket given back")


async def test_ipv6_connections_go_through_admission_too() -> None:
    """py-libp2p 0.8.1 reads no remote address from an IPv6 socket (4 fields from getpeername):
    admission let every IPv6 connection past its caps. 20 idle connections from ::1: 8 handshaking,
    the rest refused per address; the node knows an IPv6 peer's address (identify, status)."""
    config = loopback_config(listen=["/ip6/::1/tcp/0"])
    async with Node.open(config) as node:
        port = int(str(node.addrs[0]).split("/tcp/")[1].split("/")[0])
        flood = []
        for _ in range(20):
            sock = trio.socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            with trio.fail_after(5):
                await sock.connect(("::1", port))
            flood.append(trio.SocketStream(sock))
        await wait_until(lambda: node.admission.refused[Refusal.HANDSHAKING_PER_ADDRESS] >= 12, 10,
                         what="the connections beyond 8 from ::1 refused")
        assert node.admission.metrics()["handshaking"] <= 8
        for stream in flood:
            await stream.aclose()
        await wait_until(lambda: node.admission.metrics()["handshaking"] == 0, 10, what="the flood gone")
        async with Node.open(loopback_config(listen=["/ip6/::1/tcp/0"])) as client:
            with trio.fail_after(10):
                await client.connect(node.addrs[0])
            assert await client.ping(node.peer_id) > 0
            (conn,) = node.network.get_connections(client.peer_id)
            assert conn.muxed_conn.get_remote_address()[0] == "::1"
