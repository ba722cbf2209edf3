"""The resource manager (p2p/resources.py): each limit held on loopback, with the honest peer served and
the refused one told which limit (its pure decisions: tests/test_resources_decisions.py). Every flood
is bounded."""

from __future__ import annotations

import socket

import pytest
import trio
from google.protobuf.empty_pb2 import Empty
from libp2p.abc import INetStream

from p2p import Node
from p2p.admission import AdmissionConfig
from p2p.errors import DialError
from p2p.resources import Rate, ResourceConfig
from p2p.rpc import CallContext, ResourceLimitError
from p2p.yamux import INITIAL_WINDOW

from .conftest import loopback_config
from .kit import wait_until

# ---------------------------------------------------------------------- on loopback


def config_with(**limits: object) -> ResourceConfig:
    config = ResourceConfig()
    for key, value in limits.items():
        setattr(config, key, value)
    return config


async def test_a_stream_flood_is_held_per_peer_and_the_honest_peer_is_served() -> None:
    """A peer opening streams that never end as fast as it can: beyond its 32 the streams are
    refused, the limit named; another peer's streams and pings go through, and the streams are
    given back."""
    server_config = loopback_config(resources=config_with(max_inbound_streams_per_peer=32))
    release = trio.Event()

    async def hold(stream: INetStream) -> None:
        with trio.move_on_after(20):
            await release.wait()
        await stream.close()

    async with Node.open(server_config) as server, Node.open(loopback_config()) as attacker, \
            Node.open(loopback_config(listen=["/ip4/127.1.0.1/tcp/0"])) as honest:
        server.set_stream_handler("/hold/1", hold)
        await attacker.connect(server.addrs[0])
        await honest.connect(server.addrs[0])
        streams = []
        for _ in range(200):  # bounded
            s = await attacker.new_stream(server.peer_id, "/hold/1")
            await s.write(b"x")  # the proposal goes with the first bytes
            streams.append(s)
        await wait_until(lambda: server.resources.refused["peer.inbound_streams"] == 168, 10,
                         what="the streams beyond 32 refused")
        assert server.resources.usage()["busiest_peer_streams"] == 32
        # the refused opener is told which limit, as the answer to its proposal
        with pytest.raises(Exception, match="the peer refused the stream: over the limit of 32 inbound streams per peer"):
            await streams[-1].read(1)
        with pytest.raises(Exception, match="refused the stream"):
            await (await attacker.new_stream(server.peer_id, "/hold/1")).read(1)
        assert await honest.ping(server.peer_id) > 0
        honest_stream = await honest.new_stream(server.peer_id, "/hold/1")
        await honest_stream.write(b"x")
        await wait_until(lambda: server.resources.usage()["streams./hold/1"] == 33, 10, what="the honest stream")
        release.set()
        await wait_until(lambda: server.resources.usage()["inbound_streams"] == 0, 10, what="the streams given back")


async def test_requests_over_the_rate_are_refused_with_the_limit_named() -> None:
    server_config = loopback_config(resources=config_with(rates={"dht": Rate(5.0, 10)}))

    async def echo(_: Empty, ctx: CallContext) -> Empty:
        return Empty()

    async with Node.open(server_config) as server, Node.open(loopback_config()) as greedy, \
            Node.open(loopback_config(listen=["/ip4/127.1.0.1/tcp/0"])) as honest:
        server.rpc.add_unary("dht.test", Empty, echo)
        server.rpc.add_unary("other.test", Empty, echo)
        await greedy.connect(server.addrs[0])
        await honest.connect(server.addrs[0])
        refused = 0
        for _ in range(40):  # bounded
            try:
                await greedy.rpc.call(server.peer_id, "dht.test", Empty(), Empty, timeout=5)
            except ResourceLimitError as e:
                refused += 1
                assert "dht.test refused: over the limit of 5 dht requests a second per peer" in str(e)
        assert 20 <= refused <= 30
        # the honest peer, and the greedy one's other services (under the "rpc" rate), are served
        await honest.rpc.call(server.peer_id, "dht.test", Empty(), Empty, timeout=5)
        await greedy.rpc.call(server.peer_id, "other.test", Empty(), Empty, timeout=5)
        assert server.resources.refused["service.dht_requests_a_second_per_peer"] == refused


async def test_connections_beyond_the_per_peer_limit_are_closed() -> None:
    server_config = loopback_config(resources=config_with(max_connections_per_peer=2))
    async with Node.open(server_config) as server, Node.open(loopback_config()) as client:
        conns = []
        for _ in range(4):  # bounded: py-libp2p's swarm dials a fresh connection each time
            try:
                conns.append(await client.network.dial_addr(server.addrs[0], server.peer_id))
            except Exception:
                pass
        await wait_until(lambda: server.resources.refused["peer.connections"] >= 2, 10,
                         what="the third and fourth connections refused")
        assert server.resources.usage()["peers_connected_in"] == 1
        assert await client.ping(server.peer_id) > 0


async def test_bytes_in_flight_stay_within_the_peers_budget() -> None:
    """A peer sending on 4 streams nobody reads fast: windows grow only within the peer's
    budget (2 MiB beyond the initial windows), and everything is given back at the end."""
    budget = 2 << 20
    server_config = loopback_config(resources=config_with(max_memory_per_peer=budget))
    peaks: list[int] = []

    async def slow_reader(stream: INetStream) -> None:
        while True:
            data = await stream.read(1 << 16)
            if not data:
                break
            peaks.append(server.resources.usage()["memory_bytes"])
        await stream.close()

    async with Node.open(server_config) as server, Node.open(loopback_config()) as client:
        server.set_stream_handler("/sink/1", slow_reader)
        await client.connect(server.addrs[0])

        async def send(n: int) -> None:
            s = await client.new_stream(server.peer_id, "/sink/1")
            for _ in range(64):
                await s.write(b"\0" * (1 << 16))
            await s.close()

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(send, i)
        assert max(peaks) <= budget
        assert max(peaks) > INITIAL_WINDOW  # the windows did grow, within the budget
        await client.disconnect(server.peer_id)
        await wait_until(lambda: server.resources.usage()["memory_bytes"] == 0, 10, what="the budget given back")


async def test_a_refused_dialer_is_told_why_and_gets_a_few_bytes_for_its_own() -> None:
    """Over the per-address cap the dialer's error names the limit; a stranger's refused
    connection gets the 40-odd bytes of the refusal and nothing more."""
    server_config = loopback_config(resources=config_with(
        admission=AdmissionConfig(max_connections_per_address=1, max_connections_per_subnet=8)))
    async with Node.open(server_config) as server, Node.open(loopback_config()) as client:
        port = int(str(server.addrs[0]).split("/tcp/")[1].split("/")[0])
        holder = await trio.open_tcp_stream("127.0.0.1", port)  # the address's one connection
        try:
            with pytest.raises(DialError, match="refused the connection: too many connections from your address"):
                await client.connect(server.addrs[0])
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            await sock.bind(("127.0.0.1", 0))
            await sock.connect(("127.0.0.1", port))
            stranger = trio.SocketStream(sock)
            await stranger.send_all(b"\x13/multistream/1.0.0\n" * 4)  # 80 bytes
            received = b""
            with trio.fail_after(5):
                while chunk := await stranger.receive_some(4096):
                    received += chunk
            await stranger.aclose()
            assert b"/dedloc/refused/connections_per_address" in received and len(received) <= 64
        finally:
            await holder.aclose()
        await wait_until(lambda: server.admission.metrics()["inbound"] == 0, 10, what="the holder's ticket back")
        await client.connect(server.addrs[0], force=True)  # refused a moment ago: its backoff holds it 5 s
        assert await client.ping(server.peer_id) > 0


async def test_identify_over_its_rate_is_reset_and_other_peers_are_served() -> None:
    server_config = loopback_config(resources=config_with(rates={"identify": Rate(0.01, 3)}))
    async with Node.open(server_config) as server, Node.open(loopback_config()) as greedy, \
            Node.open(loopback_config(listen=["/ip4/127.1.0.1/tcp/0"])) as honest:
        await greedy.connect(server.addrs[0])
        failures = 0
        for _ in range(6):  # bounded
            try:
                await greedy.identify(server.peer_id, timeout=5)
            except Exception:
                failures += 1
        assert failures >= 2
        assert server.resources.refused["service.identify_requests_a_second_per_peer"] >= 3
        await honest.connect(server.addrs[0])
        assert (await honest.identify(server.peer_id, timeout=5)).peer_id == server.peer_id


async def test_streams_opened_over_the_rate_are_refused_by_the_muxer() -> None:
    """Over its stream-open rate a peer's new streams are refused by yamux, before any negotiation
    (the refusal, FIN, RST); another peer's streams are not affected."""
    server_config = loopback_config(resources=config_with(rates={"streams": Rate(0.5, 20)}))
    served: list[bytes] = []

    async def echo(stream: INetStream) -> None:
        served.append(await stream.read(1))
        await stream.close()

    async with Node.open(server_config) as server, Node.open(loopback_config()) as greedy, \
            Node.open(loopback_config(listen=["/ip4/127.1.0.1/tcp/0"])) as honest:
        server.set_stream_handler("/one/1", echo)
        await greedy.connect(server.addrs[0])
        await honest.connect(server.addrs[0])
        opened = []
        for _ in range(60):  # bounded
            try:
                s = await greedy.new_stream(server.peer_id, "/one/1")
                await s.write(b"x")
                opened.append(s)
            except Exception as e:  # a refusal ends with FIN, not a reset: writes go on; a failure must name it
                assert "the peer refused the stream: over the limit of 0.5 streams" in str(e)
        await wait_until(lambda: server.resources.refused["service.streams_requests_a_second_per_peer"] >= 30, 10,
                         what="the streams over the rate refused")
        assert len(served) <= 30
        # over the rate, the opener reads the limit where the protocol's echo would be
        told = []
        for s in opened[20:] + [None] * 3:
            try:
                if s is None:
                    s = await greedy.new_stream(server.peer_id, "/one/1")
                    await s.write(b"x")
                await s.read(1)
            except Exception as e:
                told.append(str(e))
        assert len(told) >= 3 and all("the peer refused the stream: over the limit of 0.5 streams requests a second "
                                      "per peer" in m for m in told), told
        before = len(served)
        s = await honest.new_stream(server.peer_id, "/one/1")
        await s.write(b"y")
        await wait_until(lambda: len(served) == before + 1, 10, what="the honest stream served")


async def test_an_rpc_call_on_a_stream_over_the_limit_is_refused_with_the_limit_named() -> None:
    """Two calls hold the peer's two RPC streams; a third is refused while its stream is
    negotiated: ResourceLimitError naming the limit, not a broken connection; the calls
    held are served, and the next call after them too."""
    server_config = loopback_config(resources=config_with(max_inbound_streams_per_peer_protocol=2))
    release = trio.Event()

    async def slow(_: Empty, ctx: CallContext) -> Empty:
        with trio.move_on_after(10):
            await release.wait()
        return Empty()

    async with Node.open(server_config) as server, Node.open(loopback_config()) as client:
        server.rpc.add_unary("slow.test", Empty, slow)
        await client.connect(server.addrs[0])
        done: list[str] = []

        async def held() -> None:
            await client.rpc.call(server.peer_id, "slow.test", Empty(), Empty, timeout=15)
            done.append("ok")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(held)
            nursery.start_soon(held)
            await wait_until(lambda: server.resources.usage()["inbound_streams"] == 2, 10, what="two calls held")
            with pytest.raises(ResourceLimitError, match="refused the stream: over the limit of 2 inbound streams "
                                                         "per peer for /dedloc/rpc"):
                await client.rpc.call(server.peer_id, "slow.test", Empty(), Empty, timeout=5)
            release.set()
        assert done == ["ok", "ok"]
        await client.rpc.call(server.peer_id, "slow.test", Empty(), Empty, timeout=5)
