"""AutoNAT v2 on loopback: dial-backs, the nonce, the amplification guard, rate limits, bad input."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio
from libp2p.abc import INetStream
from multiaddr import Multiaddr

import nat.autonat
from nat.autonat import DIAL_BACK, DIAL_REQUEST, AutoNATClient, AutoNATConfig, AutoNATError, AutoNATServer, DialResult
from nat.proto import autonat_v2_pb2 as pb
from p2p.wire import MAX_ADDRS, read_message, write_message
from p2p import Node
from p2p.addresses import without_peer_id
from p2p.varint import encode_varint
from p2p.errors import ConfigError
from p2p.resources import Rate

from .conftest import open_nodes
from .kit import closed_port, log_lines, wait_until

OTHER_IP = "127.0.0.2"  # loopback too, but not the IP the client's requests come from


@asynccontextmanager
async def autonat_pair(
    server_config: AutoNATConfig | None = None, client_config: AutoNATConfig | None = None
) -> AsyncIterator[tuple[Node, AutoNATServer, Node, AutoNATClient]]:
    async with open_nodes(2) as (s, c):
        server = AutoNATServer(s, server_config or AutoNATConfig(allow_private=True))
        server.install()
        client = AutoNATClient(c, client_config or AutoNATConfig())
        client.install()
        await c.connect(s.addrs[0])
        yield s, server, c, client


@asynccontextmanager
async def tcp_counter(host: str = OTHER_IP, *, hold: bool = False) -> AsyncIterator[tuple[int, list[trio.SocketStream]]]:
    """A bare TCP port (a 'third party') that counts the connections it gets and closes them at once, or,
    with ``hold``, keeps them open and silent until the block ends (a dial-back there holds its slot for
    the dial timeout)."""
    (listener,) = await trio.open_tcp_listeners(0, host=host)
    port = listener.socket.getsockname()[1]
    accepted: list[trio.SocketStream] = []

    async def serve() -> None:
        async with listener:
            while True:
                conn = await listener.accept()
                accepted.append(conn)
                if not hold:
                    await conn.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        yield port, accepted
        nursery.cancel_scope.cancel()
    for conn in accepted:
        await conn.aclose()


def listen_addr(node: Node) -> Multiaddr:
    return without_peer_id(node.addrs[0])


async def raw_request(client: Node, server: Node, raw: bytes, *, close: bool = False) -> pb.Message | None:
    """Write raw bytes on a dial-request stream; the server's first answer, or None when it reset the stream."""
    stream = await client.new_stream(server.peer_id, DIAL_REQUEST)
    await stream.write(raw)
    if close:
        await stream.close()
    with trio.fail_after(15):
        try:
            return await read_message(stream, pb.Message)
        except Exception:
            return None
        finally:
            await stream.reset()


def _frame(message: pb.Message) -> bytes:
    body = message.SerializeToString()
    return encode_varint(len(body)) + body


def request(addrs: list[bytes], nonce: int = 1234) -> bytes:
    return _frame(pb.Message(dialRequest=pb.DialRequest(addrs=addrs, nonce=nonce)))


# ---------------------------------------------------------------------- verdicts


async def test_dial_back_confirms_a_listening_address():
    async with autonat_pair() as (s, server, c, client):
        result = await client.check(s.peer_id, [listen_addr(c)])
        assert result == DialResult(s.peer_id, listen_addr(c), True, "dial-back with our nonce arrived")
        assert server.verdicts == {c.peer_id: "public"}
        assert server.metrics()["dial_backs"] == 1 and server.metrics()["dial_back_ok"] == 1
        assert server.metrics()["dial_data_asked"] == 0  # the client's own IP costs nothing
        assert client._waiting == {}


async def test_closed_port_is_reported_unreachable():
    async with autonat_pair() as (s, server, c, client):
        port = closed_port()
        dead = Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")
        result = await client.check(s.peer_id, [dead])
        assert result == DialResult(s.peer_id, dead, False, "server could not connect")
        assert server.metrics()["dial_backs"] == 1 and server.metrics()["dial_back_ok"] == 0
        assert server.verdicts == {c.peer_id: "unreachable"}


async def test_a_client_that_takes_no_dial_back_stream_gets_no_verdict_and_each_success_is_counted(caplog):
    caplog.set_level(logging.DEBUG, logger="nat.autonat")
    async with autonat_pair() as (s, server, c, client):
        for _ in range(2):
            assert (await client.check(s.peer_id, [listen_addr(c)])).reachable is True
        assert server.metrics()["dial_back_ok"] == 2
        client.install().remove()  # the dial-back protocol no longer served: the server connects, the stream fails
        result = await client.check(s.peer_id, [listen_addr(c)])
        assert result == DialResult(s.peer_id, listen_addr(c), None, "server connected but could not deliver the nonce")
        assert server.metrics()["dial_backs"] == 3 and server.metrics()["dial_back_ok"] == 2
    (line,) = log_lines(caplog, "nat.autonat", f"dial-back to {c.peer_id} connected but the nonce did not get through: ")
    assert not line.endswith(": None")


async def test_server_dials_the_first_acceptable_address_and_says_which():
    async with autonat_pair() as (s, server, c, client):
        addrs = [Multiaddr("/ip4/127.0.0.1/udp/4001/quic-v1"), Multiaddr(f"/ip4/127.0.0.1/tcp/{closed_port()}"), listen_addr(c)]
        result = await client.check(s.peer_id, addrs)
        assert result.addr == addrs[1] and result.reachable is False


# ---------------------------------------------------------------------- a lying server


FakeServer = Callable[[Node, INetStream, pb.DialRequest], Awaitable[None]]


@asynccontextmanager
async def fake_server(behaviour: FakeServer, client_config: AutoNATConfig | None = None) -> AsyncIterator[tuple[Node, Node, AutoNATClient]]:
    async with open_nodes(2) as (f, c):

        async def handler(stream: INetStream) -> None:
            msg = await read_message(stream, pb.Message)
            await behaviour(f, stream, msg.dialRequest)

        f.set_stream_handler(DIAL_REQUEST, handler)
        client = AutoNATClient(c, client_config)
        client.install()
        await c.connect(f.addrs[0])
        yield f, c, client


async def respond(stream: INetStream, status: int = pb.DialResponse.OK, index: int = 0, dial: int = pb.OK) -> None:
    await write_message(stream, pb.Message(dialResponse=pb.DialResponse(status=status, addrIdx=index, dialStatus=dial)))  # type: ignore[arg-type]
    await stream.close()


async def deliver(server: Node, conn, nonce: int) -> None:  # type: ignore[no-untyped-def]
    back = await server.new_stream_on(conn, DIAL_BACK)
    await write_message(back, pb.DialBack(nonce=nonce))
    await read_message(back, pb.DialBackResponse)
    await back.close()


@pytest.mark.parametrize(("offset", "reachable"), [(0, True), (1, None)], ids=["right-nonce", "wrong-nonce"])
async def test_only_a_dial_back_with_our_nonce_counts(offset, reachable):
    async def behaviour(f: Node, stream: INetStream, req: pb.DialRequest) -> None:
        peer = stream.muxed_conn.peer_id
        conn = await f.network.dial_addr(Multiaddr(req.addrs[0]), peer)  # a fresh connection, like a real server
        try:
            await deliver(f, conn, (req.nonce + offset) % 2**64)
        finally:
            await conn.close()
        await respond(stream)  # and claims success either way

    async with fake_server(behaviour) as (f, c, client):
        result = await client.check(f.peer_id, [listen_addr(c)])
        assert result.reachable is reachable, result.detail


async def test_claimed_success_without_dial_back_is_ignored():
    async def behaviour(f: Node, stream: INetStream, req: pb.DialRequest) -> None:
        await respond(stream)

    async with fake_server(behaviour) as (f, c, client):
        result = await client.check(f.peer_id, [listen_addr(c)])
        assert result == DialResult(f.peer_id, listen_addr(c), None, "server claims a dial-back that never arrived: ignored")


async def test_a_server_that_connected_but_could_not_deliver_gives_no_verdict():
    async def behaviour(f: Node, stream: INetStream, req: pb.DialRequest) -> None:
        await respond(stream, dial=pb.E_DIAL_BACK_ERROR)

    async with fake_server(behaviour) as (f, c, client):
        result = await client.check(f.peer_id, [listen_addr(c)])
        assert result == DialResult(f.peer_id, listen_addr(c), None, "server connected but could not deliver the nonce")


async def test_nonce_over_the_connection_we_dialed_proves_nothing():
    """The nonce is no proof of a dial-back when it comes over the connection the client itself opened."""

    async def behaviour(f: Node, stream: INetStream, req: pb.DialRequest) -> None:
        peer = stream.muxed_conn.peer_id
        (existing,) = f.network.get_connections(peer)
        await deliver(f, existing, req.nonce)
        await respond(stream)

    async with fake_server(behaviour) as (f, c, client):
        result = await client.check(f.peer_id, [listen_addr(c)])
        assert result.reachable is None, result.detail


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (pb.DialResponse(status=pb.DialResponse.OK, addrIdx=5, dialStatus=pb.OK), "answered for address #5 of 1"),
        (pb.DialResponse(status=pb.DialResponse.OK, addrIdx=1, dialStatus=pb.OK), "answered for address #1 of 1"),
        (pb.DialResponse(status=pb.DialResponse.E_REQUEST_REJECTED), "gave no verdict: E_REQUEST_REJECTED"),
        (pb.DialResponse(status=pb.DialResponse.E_DIAL_REFUSED), "gave no verdict: E_DIAL_REFUSED"),
        (pb.DialResponse(status=pb.DialResponse.E_INTERNAL_ERROR), "gave no verdict: E_INTERNAL_ERROR"),
        (pb.DialResponse(status=77), "gave no verdict: 77"),  # type: ignore[arg-type]
    ],
    ids=["index-out-of-range", "index-one-past", "rejected", "refused", "internal", "unknown-status"],
)
async def test_forged_or_negative_responses_give_no_verdict(answer, words):
    async def behaviour(f: Node, stream: INetStream, req: pb.DialRequest) -> None:
        await write_message(stream, pb.Message(dialResponse=answer))
        await stream.close()

    async with fake_server(behaviour) as (f, c, client):
        with pytest.raises(AutoNATError) as raised:
            await client.check(f.peer_id, [listen_addr(c)])
        assert str(raised.value) == f"{f.peer_id} {words}"
        assert raised.value.status == (words.split(": ")[1] if "verdict" in words else None)


@pytest.mark.parametrize(
    "raw",
    [
        encode_varint(5000) + bytes(100),
        b"\x03\xff\xff\xff",
        b"",
        encode_varint(len(pb.Message(dialDataResponse=pb.DialDataResponse(data=b"x")).SerializeToString()))
        + pb.Message(dialDataResponse=pb.DialDataResponse(data=b"x")).SerializeToString(),
    ],
    ids=["oversized", "garbled", "silent", "unexpected-message"],
)
async def test_broken_server_answers_give_a_clear_error(raw):
    async def behaviour(f: Node, stream: INetStream, req: pb.DialRequest) -> None:
        await stream.write(raw)
        await stream.close()

    async with fake_server(behaviour) as (f, c, client):
        with pytest.raises(AutoNATError, match="failed"):
            await client.check(f.peer_id, [listen_addr(c)])
        assert client._waiting == {}
        assert await c.ping(f.peer_id) > 0


# ---------------------------------------------------------------------- the amplification guard


async def test_client_pays_dial_data_at_most_once_and_within_its_limit():
    """A server that keeps asking for dial data gets at most ``max_dial_data`` bytes in all."""
    received = []

    async def behaviour(f: Node, stream: INetStream, req: pb.DialRequest) -> None:
        for _ in range(5):
            await write_message(stream, pb.Message(dialDataRequest=pb.DialDataRequest(addrIdx=0, numBytes=30_000)))
            got = 0
            while got < 30_000:
                msg = await read_message(stream, pb.Message, max_size=8192)
                got += len(msg.dialDataResponse.data)
                received.append(len(msg.dialDataResponse.data))
        await respond(stream)

    async with fake_server(behaviour, AutoNATConfig(max_dial_data=50_000)) as (f, c, client):
        with pytest.raises(AutoNATError) as raised:
            await client.check(f.peer_id, [listen_addr(c)])
        assert str(raised.value) == f"AutoNAT check with {f.peer_id} failed: server asks for dial data again"
        assert 30_000 <= sum(received) <= 50_000


@pytest.mark.parametrize(("asked", "chunks"), [(8192, 2), (8193, 3), (10_000, 3), (10_001, None)])
async def test_client_pays_what_is_asked_in_whole_chunks_up_to_its_limit(asked, chunks):
    """Dial data goes in 4096-byte chunks, as many as cover the ask, nothing more; an ask over
    ``max_dial_data`` (10,000 here) is refused, one equal to it is paid."""
    paid: list[int] = []

    async def behaviour(f: Node, stream: INetStream, req: pb.DialRequest) -> None:
        await write_message(stream, pb.Message(dialDataRequest=pb.DialDataRequest(addrIdx=0, numBytes=asked)))
        count = 0
        with trio.move_on_after(1.0):  # everything the client sends, not only what covers the ask
            while True:
                msg = await read_message(stream, pb.Message, max_size=8192)
                assert len(msg.dialDataResponse.data) == 4096
                count += 1
        paid.append(count)
        await respond(stream, dial=pb.E_DIAL_ERROR)

    async with fake_server(behaviour, AutoNATConfig(max_dial_data=10_000)) as (f, c, client):
        if chunks is None:
            with pytest.raises(AutoNATError, match=f"server asks {asked} bytes of dial data, over our 10000"):
                await client.check(f.peer_id, [listen_addr(c)])
            return
        result = await client.check(f.peer_id, [listen_addr(c)])
        assert result.reachable is False and paid == [chunks]


async def test_client_refusing_to_pay_gets_no_dial(caplog):
    caplog.set_level(logging.DEBUG, logger="nat.autonat")
    async with tcp_counter() as (port, accepted):
        async with autonat_pair(client_config=AutoNATConfig(max_dial_data=1000)) as (s, server, c, client):
            target = Multiaddr(f"/ip4/{OTHER_IP}/tcp/{port}")
            with pytest.raises(AutoNATError, match="dial data"):
                await client.check(s.peer_id, [target])
            # the client reset the stream: the server, waiting for the data, says the request ended early
            await wait_until(lambda: log_lines(caplog, "nat.autonat", f"AutoNAT request from {c.peer_id} ended early: "),
                             10, what="the server's line")
            (line,) = log_lines(caplog, "nat.autonat", f"AutoNAT request from {c.peer_id} ended early: ")
            assert not line.endswith(": None")
            assert server.metrics()["dial_data_asked"] == 1
            assert server.metrics()["dial_backs"] == 0
            # The server keeps working for requests it need not be paid for.
            assert (await client.check(s.peer_id, [listen_addr(c)])).reachable is True
            assert server.metrics()["dial_backs"] == 1
        assert accepted == []


async def test_third_party_is_dialed_only_after_payment():
    async with tcp_counter() as (port, accepted):
        async with autonat_pair(AutoNATConfig(allow_private=True, dial_data=20_000)) as (s, server, c, client):
            paid: list[tuple[int, int]] = []
            pay = client._pay

            async def recording_pay(stream: INetStream, size: int) -> None:
                paid.append((size, len(accepted)))
                await pay(stream, size)

            client._pay = recording_pay  # type: ignore[method-assign]
            target = Multiaddr(f"/ip4/{OTHER_IP}/tcp/{port}")
            result = await client.check(s.peer_id, [target])
            # Asked first, with nobody dialed yet; the dial came after the bytes.
            assert paid == [(20_000, 0)]
            assert len(accepted) == 1
            assert result.reachable is False  # it is no libp2p peer, let alone the client
            assert server.metrics()["dial_data_asked"] == 1 and server.metrics()["dial_backs"] == 1


async def test_server_rejects_dial_data_that_is_not_dial_data(caplog):
    caplog.set_level(logging.DEBUG, logger="nat.autonat")
    async with tcp_counter() as (port, accepted):
        async with autonat_pair() as (s, server, c, client):
            stream = await c.new_stream(s.peer_id, DIAL_REQUEST)
            target = Multiaddr(f"/ip4/{OTHER_IP}/tcp/{port}")
            await write_message(stream, pb.Message(dialRequest=pb.DialRequest(addrs=[target.to_bytes()], nonce=1)))
            with trio.fail_after(15):
                asked = await read_message(stream, pb.Message)
                assert asked.WhichOneof("msg") == "dialDataRequest" and asked.dialDataRequest.numBytes == 30_000
                # "Pay" with another dial request (then with real bytes, too late), or with a chunk over the spec's 4096 bytes.
                await write_message(stream, pb.Message(dialRequest=pb.DialRequest(addrs=[target.to_bytes()], nonce=1)))
                try:
                    for _ in range(8):
                        await write_message(stream, pb.Message(dialDataResponse=pb.DialDataResponse(data=bytes(4096))))
                except Exception:
                    pass  # the server reset the stream already
                with pytest.raises(Exception):
                    await read_message(stream, pb.Message)
            stream = await c.new_stream(s.peer_id, DIAL_REQUEST)
            await write_message(stream, pb.Message(dialRequest=pb.DialRequest(addrs=[target.to_bytes()], nonce=2)))
            with trio.fail_after(15):
                await read_message(stream, pb.Message)
                try:
                    await write_message(stream, pb.Message(dialDataResponse=pb.DialDataResponse(data=bytes(40_000))))
                except Exception:
                    pass
                with pytest.raises(Exception):
                    await read_message(stream, pb.Message)
            assert server.metrics()["dial_backs"] == 0
            assert (await client.check(s.peer_id, [listen_addr(c)])).reachable is True
        assert accepted == []
        assert f"bad AutoNAT request from {c.peer_id}: expected DialDataResponse" in \
            log_lines(caplog, "nat.autonat", "bad AutoNAT request from ")


# ---------------------------------------------------------------------- server limits


async def test_requests_per_peer_are_rate_limited(caplog):
    caplog.set_level(logging.DEBUG, logger="nat.autonat")
    async with autonat_pair(AutoNATConfig(allow_private=True)) as (s, server, c, client):
        s.resources.config.rates["autonat"] = Rate(1 / 60, 2)  # the node's resource manager keeps the rates
        dead = Multiaddr(f"/ip4/127.0.0.1/tcp/{closed_port()}")
        for _ in range(2):
            await client.check(s.peer_id, [dead])
        with pytest.raises(AutoNATError, match="E_REQUEST_REJECTED"):
            await client.check(s.peer_id, [listen_addr(c)])
        assert server.metrics()["rejected"] == 1 and server.metrics()["dial_backs"] == 2
        assert server.metrics()["requests"] == 3
        assert s.resources.refused["service.autonat_requests_a_second_per_peer"] == 1
        (line,) = log_lines(caplog, "nat.autonat", f"AutoNAT request from {c.peer_id} rejected: ")
        assert "autonat" in line.split("rejected: ")[1]
        failed = log_lines(caplog, "nat.autonat", f"dial-back to {c.peer_id} at {dead} failed: ")
        assert len(failed) == 2 and not any(line.endswith(": None") for line in failed)
        # Another peer is not affected.
        async with open_nodes(1) as (d,):
            other = AutoNATClient(d)
            other.install()
            await d.connect(s.addrs[0])
            assert (await other.check(s.peer_id, [listen_addr(d)])).reachable is True


@pytest.mark.parametrize("slot_wait, max_waiting, served", [(10.0, 32, True), (0.3, 32, False), (10.0, 0, False)])
async def test_a_request_beyond_the_dial_back_slots_waits_in_line_for_one(slot_wait, max_waiting, served):
    """One slot, held for its 1.5 s dial timeout by a silent address: the next request waits and gets
    its verdict (a client told E_REQUEST_REJECTED may never ask again: js-libp2p asks once per
    connection); rejected only when its wait runs out or the line is full, at once then."""
    config = AutoNATConfig(allow_private=True, max_concurrent=1, dial_timeout=1.5, slot_wait=slot_wait,
                           max_waiting=max_waiting)
    async with tcp_counter("127.0.0.1", hold=True) as (port, _), autonat_pair(config) as (s, server, c, client):
        results: dict[str, object] = {}

        async def check(name: str, addr: Multiaddr) -> None:
            started = trio.current_time()
            try:
                results[name] = (await client.check(s.peer_id, [addr])).reachable
            except AutoNATError as e:
                results[name] = str(e)
            results[name + " took"] = trio.current_time() - started

        async with trio.open_nursery() as nursery:
            nursery.start_soon(check, "silent", Multiaddr(f"/ip4/127.0.0.1/tcp/{port}"))
            await wait_until(lambda: server._slots.value == 0, 5, what="the silent dial-back under way")
            nursery.start_soon(check, "next", listen_addr(c))
        assert results["silent"] is False
        if served:
            assert results["next"] is True and server.metrics()["rejected"] == 0
            assert server.metrics()["dial_backs"] == 2 and server.metrics()["dial_back_ok"] == 1
        else:
            assert "E_REQUEST_REJECTED" in str(results["next"]) and server.metrics()["rejected"] == 1
            assert server.metrics()["dial_backs"] == 1
            assert results["next took"] < (0.5 if max_waiting == 0 else 1.2), results  # type: ignore[operator]
            assert results["next took"] >= (0.0 if max_waiting == 0 else 0.3), results  # type: ignore[operator]
        assert server._waiting == 0 and server._slots.value == 1


@pytest.mark.parametrize("field, value", [("max_concurrent", 0), ("max_waiting", -1), ("slot_wait", -0.1),
                                          ("dial_data", -1), ("max_dial_data", -1), ("dial_timeout", 0),
                                          ("request_timeout", 0)])
def test_autonat_limits_out_of_range_are_refused(field, value):
    words = {"max_concurrent": "AutoNAT rate limits must be at least 1",
             "max_waiting": "the AutoNAT waiting line must not be negative", "slot_wait": "the AutoNAT waiting line must not be negative",
             "dial_data": "dial data sizes must not be negative", "max_dial_data": "dial data sizes must not be negative",
             "dial_timeout": "AutoNAT timeouts must be positive", "request_timeout": "AutoNAT timeouts must be positive"}
    with pytest.raises(ConfigError, match=f"^{words[field]}$"):
        AutoNATConfig(**{field: value}).validate()
    AutoNATConfig(**{field: {"max_concurrent": 1, "dial_timeout": 0.1, "request_timeout": 0.1}.get(field, 0)}).validate()


async def test_requests_from_one_ip_are_rate_limited_whatever_the_peer_ids():
    """Fresh peer ids cost nothing; the requests from one address are counted together."""
    async with autonat_pair(AutoNATConfig(allow_private=True)) as (s, server, c, client):
        s.resources.config.rates.update({"autonat": Rate(100, 100), "autonat.address": Rate(1 / 60, 2)})
        assert (await client.check(s.peer_id, [listen_addr(c)])).reachable is True
        async with open_nodes(2) as (d, e):
            clients = [AutoNATClient(d), AutoNATClient(e)]
            for other, its in zip((d, e), clients):
                its.install()
                await other.connect(s.addrs[0])
            assert (await clients[0].check(s.peer_id, [listen_addr(d)])).reachable is True
            with pytest.raises(AutoNATError, match="E_REQUEST_REJECTED"):
                await clients[1].check(s.peer_id, [listen_addr(e)])
        assert s.resources.refused["service.autonat.address_requests_a_second_per_peer"] == 1
        assert server.metrics()["rejected"] == 1


async def test_the_server_remembers_each_peers_verdict_newest_last_and_only_so_many(monkeypatch):
    """What the live page shows of the peers that asked: public once any of a peer's addresses was
    reached (a later failure on another address does not undo it), unreachable otherwise; the peer
    asked most recently last, and the oldest forgotten past MAX_VERDICTS."""
    monkeypatch.setattr(nat.autonat, "MAX_VERDICTS", 2)
    dead = Multiaddr(f"/ip4/127.0.0.1/tcp/{closed_port()}")
    async with autonat_pair() as (s, server, c, client), open_nodes(2) as (d, e):
        clients = {}
        for other in (d, e):
            clients[other.peer_id] = AutoNATClient(other)
            clients[other.peer_id].install()
            await other.connect(s.addrs[0])
        await client.check(s.peer_id, [listen_addr(c)])
        await client.check(s.peer_id, [dead])
        assert server.verdicts == {c.peer_id: "public"}
        await clients[d.peer_id].check(s.peer_id, [dead])
        assert list(server.verdicts.items()) == [(c.peer_id, "public"), (d.peer_id, "unreachable")]
        await client.check(s.peer_id, [dead])  # c asked again: it moves to the end
        assert list(server.verdicts) == [d.peer_id, c.peer_id]
        await clients[e.peer_id].check(s.peer_id, [listen_addr(e)])
        assert list(server.verdicts.items()) == [(c.peer_id, "public"), (e.peer_id, "public")]


async def test_refusals_and_requests_are_each_counted():
    async with autonat_pair(AutoNATConfig()) as (s, server, c, client):
        for _ in range(2):
            with pytest.raises(AutoNATError, match="E_DIAL_REFUSED"):
                await client.check(s.peer_id, [Multiaddr("/ip4/10.0.0.1/tcp/4001")])
        assert server.metrics() == {"requests": 2, "rejected": 0, "refused": 2, "dial_backs": 0, "dial_back_ok": 0,
                                    "dial_data_asked": 0}


async def test_private_addresses_are_refused_unless_allowed():
    async with autonat_pair(AutoNATConfig()) as (s, server, c, client):
        with pytest.raises(AutoNATError, match="E_DIAL_REFUSED"):
            await client.check(s.peer_id, [listen_addr(c), Multiaddr("/ip4/10.0.0.1/tcp/4001"), Multiaddr("/ip4/192.168.1.1/tcp/4001")])
        assert server.metrics()["refused"] == 1 and server.metrics()["dial_backs"] == 0


async def test_an_ipv6_address_is_judged_only_by_a_server_with_ipv6(monkeypatch):
    async with autonat_pair() as (s, server, c, client):
        six = Multiaddr(f"/ip6/::1/tcp/{closed_port()}")  # this host has ::1: the server dials it
        result = await client.check(s.peer_id, [six])
        assert result.reachable is False and server.metrics()["dial_backs"] == 1
        # a host without IPv6: the server refuses rather than report a failure it cannot judge
        monkeypatch.setattr(s, "interface_addrs", lambda family: [] if family == "ip6" else [Multiaddr("/ip4/127.0.0.1/tcp/0")])
        with pytest.raises(AutoNATError, match="E_DIAL_REFUSED"):
            await client.check(s.peer_id, [six])
        assert server.metrics()["refused"] == 1 and server.metrics()["dial_backs"] == 1
        # an IPv4 address after it in the same request is still judged
        result = await client.check(s.peer_id, [six, listen_addr(c)])
        assert result.addr == listen_addr(c) and result.reachable is True


async def test_client_rejects_an_empty_check():
    async with autonat_pair() as (s, server, c, client):
        with pytest.raises(AutoNATError, match="^no address to check$"):
            await client.check(s.peer_id, [])
        assert server.metrics()["requests"] == 0


# ---------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("raw", "close"),
    [
        (encode_varint(5000) + bytes(300), False),
        (b"\xff" * 12, False),
        (b"\x05\xff\xff\xff\xff\xff", False),
        (encode_varint(200) + bytes(20), True),
        (_frame(pb.Message(dialDataResponse=pb.DialDataResponse(data=b"1234"))), False),
        (request([b"\x00\x01" * 8] * 500), False),  # hundreds of addresses, over the 4 KiB cap
    ],
    ids=["oversized", "endless-varint", "garbled", "truncated", "not-a-dial-request", "500-addresses"],
)
async def test_bad_requests_are_reset_and_server_keeps_working(raw, close, caplog):
    caplog.set_level(logging.DEBUG, logger="nat.autonat")
    async with autonat_pair() as (s, server, c, client):
        assert await raw_request(c, s, raw, close=close) is None
        said = [*log_lines(caplog, "nat.autonat", f"bad AutoNAT request from {c.peer_id}: "),
                *log_lines(caplog, "nat.autonat", f"AutoNAT request from {c.peer_id} ended early: ")]
        assert len(said) == 1 and not said[0].endswith(": None"), said
        if raw == _frame(pb.Message(dialDataResponse=pb.DialDataResponse(data=b"1234"))):  # not a dial request
            assert said == [f"bad AutoNAT request from {c.peer_id}: the first AutoNAT message is not a DialRequest"]
        assert server.metrics()["dial_backs"] == 0
        assert (await client.check(s.peer_id, [listen_addr(c)])).reachable is True


async def test_hundreds_of_bogus_addresses_only_the_first_ones_are_parsed():
    async with autonat_pair() as (s, server, c, client):
        mine = listen_addr(c).to_bytes()
        junk = [bytes([i % 256, 0xFF]) for i in range(300)]
        # The real address after MAX_ADDRS entries of junk is never looked at.
        answer = await raw_request(c, s, request(junk[:MAX_ADDRS] + [mine] + junk))
        assert answer is not None and answer.dialResponse.status == pb.DialResponse.E_DIAL_REFUSED
        assert server.metrics()["dial_backs"] == 0
        # Within the first MAX_ADDRS it is found, and its index is its place in the request.
        answer = await raw_request(c, s, request(junk[: MAX_ADDRS - 1] + [mine] + junk))
        assert answer is not None and answer.dialResponse.status == pb.DialResponse.OK
        assert answer.dialResponse.dialStatus == pb.OK
        assert answer.dialResponse.addrIdx == MAX_ADDRS - 1
        assert server.metrics()["dial_backs"] == 1


async def test_dial_back_stream_with_garbage_is_reset_and_client_keeps_working(caplog):
    caplog.set_level(logging.DEBUG, logger="nat.autonat")
    async with autonat_pair() as (s, server, c, client):
        conn = await s.network.dial_addr(listen_addr(c), c.peer_id)
        back = await s.new_stream_on(conn, DIAL_BACK)
        await back.write(encode_varint(5000))
        with trio.fail_after(15), pytest.raises(Exception):
            await read_message(back, pb.DialBackResponse)
        (line,) = log_lines(caplog, "nat.autonat", f"a dial-back stream from {s.peer_id} ended before its nonce: ")
        assert not line.endswith(": None")
        await conn.close()
        assert (await client.check(s.peer_id, [listen_addr(c)])).reachable is True


async def test_a_stranger_cannot_make_the_server_an_amplifier():
    """Eight paid requests for dial-backs to a third party's address: the server dials it at most
    the burst of its per-address dial-back rate (4), and what it sends there is a sliver of what
    the requester had to send first (the 30 KB of dial data per request)."""
    (listener,) = await trio.open_tcp_listeners(0, host=OTHER_IP)
    port = listener.socket.getsockname()[1]
    received: list[int] = []

    async def count(conn: trio.SocketStream) -> None:
        total = 0
        with trio.move_on_after(3):
            while chunk := await conn.receive_some(65536):
                total += len(chunk)
        received.append(total)
        await conn.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, count, [listener])
        async with autonat_pair(AutoNATConfig(allow_private=True, dial_timeout=1.0)) as (s, server, c, client):
            s.resources.config.rates.update({"autonat": Rate(100, 100), "autonat.address": Rate(100, 100)})
            paid: list[int] = []
            pay = client._pay

            async def recording_pay(stream: INetStream, size: int) -> None:
                paid.append(size)
                await pay(stream, size)

            client._pay = recording_pay  # type: ignore[method-assign]
            target = Multiaddr(f"/ip4/{OTHER_IP}/tcp/{port}")
            rejected = 0
            for _ in range(8):
                try:
                    await client.check(s.peer_id, [target])
                except AutoNATError as e:
                    assert "E_REQUEST_REJECTED" in str(e)
                    rejected += 1
            assert server.metrics()["dial_backs"] == 4 and rejected == 4
            assert server.metrics()["rejected"] == 4 and server.metrics()["dial_data_asked"] == 8
            assert s.resources.refused["service.autonat.dial_back_requests_a_second_per_peer"] == 4
            await wait_until(lambda: len(received) == 4, 10, what="the dial-backs counted")
        nursery.cancel_scope.cancel()
    sent_to_target, paid_in = sum(received), sum(paid)
    assert paid_in >= 8 * 30_000
    assert sent_to_target / paid_in < 0.01, (sent_to_target, paid_in)
