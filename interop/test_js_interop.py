"""Our Node against a real js-libp2p node (TCP + Noise + Yamux, identify, ping).

Both sides listen and dial on 127.0.0.1 only. The js peer is ``js/peer.mjs``
under node 22 (``bash interop/setup.sh``); see ``jspeer.py`` for its protocol.
The bulk tests move tens of MiB both ways over our Noise and Yamux with sha256
checks (protocol in ``bulk.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest
import trio
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.network.stream.net_stream import NetStream
from libp2p.peer.envelope import Envelope
from libp2p.peer.id import ID
from libp2p.peer.peer_record import PEER_RECORD_ENVELOPE_DOMAIN
from multiaddr import Multiaddr
from multiaddr.protocols import P_P2P

import bulk
from tests.kit import read_to_end, wait_until
from jspeer import JsPeer, JsPeerCommandError
from p2p import DialError, Node
from p2p.yamux import INITIAL_WINDOW, YamuxStream

pytestmark = pytest.mark.interop

PING = "/ipfs/ping/1.0.0"
IDENTIFY = "/ipfs/id/1.0.0"
ECHO = "/dedloc-interop/echo/1.0.0"
#: Every wait in these tests is bounded by this (the js side has its own deadlines too).
STEP = 15.0


def transport_addr(addr: str | Multiaddr) -> str:
    """``addr`` without its trailing /p2p/<id>."""
    return str(Multiaddr(str(addr)).decapsulate_code(P_P2P))


def py_addr(node: Node) -> str:
    addrs = [str(a) for a in node.addrs if str(a).startswith("/ip4/127.0.0.1/tcp/")]
    assert addrs, f"our node has no 127.0.0.1 address: {node.addrs}"
    return addrs[0]


def random_peer_id() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


def stored_record(node: Node, peer_id: ID) -> Envelope | None:
    envelope: Envelope | None = node.host.get_peerstore().get_peer_record(peer_id)
    return envelope


async def py_echo(node: Node, peer_id: ID, protocol: str, data: bytes) -> bytes:
    with trio.fail_after(STEP):
        stream = await node.new_stream(peer_id, protocol)
        await stream.write(data)
        # half-close (yamux FIN), keeping the read side open: NetStream has it,
        # py-libp2p's INetStream interface does not
        assert isinstance(stream, NetStream), type(stream)
        await stream.close_write()
        return await read_to_end(stream)


# --------------------------------------------------------------------------- py dials js


async def test_py_dials_js_then_ping_and_identify(js: JsPeer, node: Node) -> None:
    with trio.fail_after(STEP):
        pid = await node.connect(js.addr)
    assert str(pid) == js.peer_id
    assert early_muxer(node, pid) == "/yamux/1.0.0"  # js lists its muxers in Noise: agreed in the handshake
    await js.wait_event(lambda e: e.get("event") == "peer:connect" and e.get("peer_id") == str(node.peer_id))

    rtt = await node.ping(pid, timeout=STEP)
    assert 0 < rtt < STEP

    info = await node.identify(pid, timeout=STEP)
    assert info.peer_id == pid
    assert info.public_key_valid, info.problems
    assert info.signed_record_valid, info.problems
    assert info.problems == []
    assert {PING, IDENTIFY} <= set(info.protocols)
    assert info.agent_version == js.listening["agent_version"]
    js_tcp = transport_addr(js.addr)
    assert js_tcp in {str(a) for a in info.listen_addrs}
    assert js_tcp in {transport_addr(a) for a in info.signed_record_addrs}

    # py-libp2p's own identify on connect fills the peer store: the public key and
    # the signed peer record (certified addr book), which it verified on the way in
    store = node.host.get_peerstore()
    assert ID.from_pubkey(store.pubkey(pid)) == pid
    envelope = await wait_until(lambda: stored_record(node, pid), STEP, what="js's signed peer record in our peer store")
    envelope.validate(PEER_RECORD_ENVELOPE_DOMAIN)  # raises if the signature is bad
    record = envelope.record()
    assert record.peer_id == pid
    assert ID.from_pubkey(envelope.public_key) == pid
    assert js_tcp in {transport_addr(a) for a in record.addrs}
    assert {PING, IDENTIFY} <= set(store.get_protocols(pid))


# --------------------------------------------------------------------------- js dials py


async def test_js_dials_py_then_ping_and_identify(js: JsPeer, node: Node) -> None:
    addr = py_addr(node)
    me = str(node.peer_id)
    dialed = await js.dial(addr)
    assert dialed["peer_id"] == me
    assert dialed["remote_addr"] == addr

    conns = [c for c in await js.peers() if c["peer_id"] == me]
    assert conns and conns[0]["encryption"] == "/noise" and conns[0]["multiplexer"] == "/yamux/1.0.0", conns

    by_id = await js.ping(peer_id=me)
    assert by_id["rtt_ms"] >= 0 and by_id["elapsed_ms"] > 0
    by_addr = await js.ping(addr=addr)
    assert by_addr["peer_id"] == me and by_addr["elapsed_ms"] > 0

    result = await js.identify(me)
    assert result["fresh_error"] is None, result["fresh_error"]
    fresh = result["fresh"]
    assert fresh["public_key_present"] and fresh["public_key_matches"], fresh
    assert fresh["public_key_type"] == "Ed25519"
    assert {PING, IDENTIFY} <= set(fresh["protocols"])
    assert transport_addr(addr) in fresh["listen_addrs"]
    # js-libp2p returns a signed peer record only after RecordEnvelope.openAndCertify
    # verified its signature and that it names the connection's peer
    spr = fresh["signed_peer_record"]
    assert spr is not None and spr["verified"], fresh
    assert transport_addr(addr) in {transport_addr(a) for a in spr["addrs"]}

    # the identify js-libp2p ran by itself on connect succeeded too
    first = result["first"]
    assert first is not None and "error" not in first, first
    assert first["signed_peer_record"] is not None

    # and its peer store holds our envelope, re-verified by peer.mjs
    store = result["peer_store"]
    assert store["signed_peer_record"]["present"] and store["signed_peer_record"]["verified"], store
    assert store["signed_peer_record"]["payload_type"] == "0301"  # multicodec libp2p-peer-record
    assert store["public_key_present"] and store["public_key_matches"]
    assert {PING, IDENTIFY} <= set(store["protocols"])
    assert {"addr": transport_addr(addr), "certified": True} in store["addrs"]

    # our side sees js as connected and can ping back over the same connection
    await wait_until(lambda: ID.from_base58(js.peer_id) in node.connected_peers(), STEP, what="js in our connected peers")
    assert await node.ping(ID.from_base58(js.peer_id), timeout=STEP) > 0


# --------------------------------------------------------------------------- without the muxer extension


async def test_both_ways_with_a_js_peer_that_lists_no_muxer_in_noise(js_available: None, node: Node) -> None:
    """js-libp2p with the inlined muxer negotiation off (no ``stream_muxers`` in its Noise
    extensions, as a peer without the extension): the muxer is agreed with multistream after
    the handshake, when we dial and when js dials, and streams work both ways on either."""
    from jspeer import open_js_peer

    me = str(node.peer_id)
    async with open_js_peer(env={"JSPEER_NOISE_MUXER_EXTENSION": "0"}) as js:
        with trio.fail_after(STEP):
            pid = await node.connect(js.addr)  # we dial: our proposal of /yamux rides after message 3
        assert early_muxer(node, pid) is None  # nothing agreed inside the handshake
        assert await node.ping(pid, timeout=STEP) > 0
        assert (await js.ping(peer_id=me))["rtt_ms"] >= 0
        assert {PING, IDENTIFY} <= set((await js.identify(me))["fresh"]["protocols"])
        await js.hangup(me)
        await wait_until(lambda: pid not in node.connected_peers(), STEP, what="the hangup")
        dialed = await js.dial(py_addr(node))  # js dials: multistream after the handshake, js proposing
        assert dialed["peer_id"] == me
        conns = [c for c in await js.peers() if c["peer_id"] == me]
        assert conns and conns[0]["encryption"] == "/noise" and conns[0]["multiplexer"] == "/yamux/1.0.0", conns
        assert (await js.ping(peer_id=me))["rtt_ms"] >= 0
        assert await node.ping(pid, timeout=STEP) > 0
        assert early_muxer(node, pid) is None


def early_muxer(node: Node, peer: ID) -> str | None:
    """The muxer our Noise session agreed inside the handshake with ``peer`` (None: multistream after it)."""
    (conn,) = node.network.get_connections(peer)
    return getattr(conn.muxed_conn.secured_conn, "early_muxer", "not a dedloc Noise session")


# --------------------------------------------------------------------------- wrong peer ids


async def test_js_dial_with_wrong_peer_id_fails_and_node_keeps_serving(js: JsPeer, node: Node) -> None:
    addr = py_addr(node)
    wrong = random_peer_id()
    bad_addr = f"{transport_addr(addr)}/p2p/{wrong}"

    with pytest.raises(JsPeerCommandError) as failed:
        await js.dial(bad_addr)
    # js-libp2p's Noise checks the responder's identity key against the expected id
    assert failed.value.reply["cmd"] == "dial"
    assert failed.value.name == "EncryptionFailedError", failed.value.reply
    assert str(wrong) in failed.value.error
    assert not [c for c in await js.peers() if c["peer_id"] in (str(wrong), str(node.peer_id))]

    # the js process and our node both carry on: a correct dial works at once
    ok = await js.dial(addr)
    assert ok["peer_id"] == str(node.peer_id)
    assert (await js.ping(peer_id=str(node.peer_id)))["elapsed_ms"] > 0
    assert (await js.identify(str(node.peer_id)))["fresh"]["signed_peer_record"]["verified"]
    assert await node.ping(ID.from_base58(js.peer_id), timeout=STEP) > 0


async def test_py_dial_with_wrong_peer_id_fails_and_retry_works(js: JsPeer, node: Node) -> None:
    wrong = random_peer_id()
    with trio.fail_after(STEP):
        with pytest.raises(DialError) as failed:
            await node.connect(f"{transport_addr(js.addr)}/p2p/{wrong}")
    # py-libp2p's Noise refuses js's identity key as not the one we asked for
    assert str(wrong) in str(failed.value)
    assert failed.value.attempts, "DialError should say why per address"
    assert wrong not in node.connected_peers()

    with trio.fail_after(STEP):
        pid = await node.connect(js.addr)
    assert str(pid) == js.peer_id
    assert await node.ping(pid, timeout=STEP) > 0
    assert (await js.ping(peer_id=str(node.peer_id)))["elapsed_ms"] > 0


# --------------------------------------------------------------------------- streams, identify/push


async def test_streams_both_ways_and_identify_push_from_js(js: JsPeer, node: Node) -> None:
    with trio.fail_after(STEP):
        pid = await node.connect(js.addr)
    store = node.host.get_peerstore()
    await wait_until(lambda: IDENTIFY in store.get_protocols(pid), STEP, what="js's protocols from identify")
    assert ECHO not in store.get_protocols(pid)

    # a protocol js starts serving after the connection is up reaches us by identify/push
    await js.handle_echo(ECHO)
    await wait_until(lambda: ECHO in store.get_protocols(pid), STEP, what=f"{ECHO} from js's identify/push")

    payload = b"dedloc " * 5000  # several yamux frames
    assert await py_echo(node, pid, ECHO, payload) == payload

    # and js opens a stream to a protocol our node serves
    async def echo_handler(stream: INetStream) -> None:
        while True:
            try:
                chunk = await stream.read(65536)
            except StreamEOF:
                break
            if not chunk:
                break
            await stream.write(chunk)
        await stream.close()

    node.set_stream_handler(ECHO, echo_handler)
    text = "from js " * 1000
    assert await js.echo(str(node.peer_id), ECHO, text) == text


# --------------------------------------------------------------------------- bulk transfer with checksums
# interop/bulk.py has the protocol. Every byte either way is keystream(seed), so the
# sha256 each side expects is computed here independently of both implementations.

BULK = bulk.PROTOCOL
MiB = bulk.MiB
#: Bound on one whole bulk test: generous for a 2-core machine, never a timing assertion.
BULK_STEP = 60.0


def seed(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()[:16]


def assert_py_client_result(result: bulk.BulkResult, *, sent: int, send_seed: bytes, got: int, recv_seed: bytes) -> None:
    """What py sent arrived whole at js, and what js sent arrived whole here."""
    want_sent = bulk.expected_sha256(send_seed, sent)
    want_got = bulk.expected_sha256(recv_seed, got)
    assert result.sent_bytes == sent and result.sent_sha256 == want_sent
    assert result.peer_received_bytes is not None, "no 72-byte trailer from js: the reply was cut short"
    assert (result.peer_received_bytes, result.peer_received_sha256) == (sent, want_sent), "js received other bytes"
    assert result.peer_sent_sha256 == want_got, "js says it sent other bytes than keystream(recv_seed)"
    assert (result.received_bytes, result.received_sha256) == (got, want_got), "py received other bytes"


def assert_js_client_reply(reply: dict[str, Any], *, sent: int, send_seed: bytes, got: int, recv_seed: bytes) -> None:
    """The same, for a transfer js opened (its "bulk" reply; the trailer is py's)."""
    want_sent = bulk.expected_sha256(send_seed, sent)
    want_got = bulk.expected_sha256(recv_seed, got)
    assert reply["protocol"] == BULK
    assert (reply["sent_bytes"], reply["sent_sha256"]) == (sent, want_sent)
    trailer = reply["trailer"]
    assert trailer is not None, f"no 72-byte trailer from py: {reply}"
    assert (trailer["peer_received_bytes"], trailer["peer_received_sha256"]) == (sent, want_sent), "py received other bytes"
    assert trailer["peer_sent_sha256"] == want_got, "py says it sent other bytes than keystream(recv_seed)"
    assert (reply["received_bytes"], reply["received_sha256"]) == (got, want_got), "js received other bytes"


async def js_served(js: JsPeer, count: int, *, start: int = 0) -> list[dict[str, Any]]:
    """The next ``count`` bulk streams js served (from event index ``start``); fails on a bulk:failed."""
    seen: list[dict[str, Any]] = []
    index = start
    while len(seen) < count:
        event = await js.wait_event(lambda e: e.get("event") in ("bulk:served", "bulk:failed"), start=index)
        index = js.events.index(event, index) + 1
        assert event["event"] == "bulk:served", event
        seen.append(event)
    return seen


def serve_bulk_on(node: Node) -> list[bulk.BulkResult]:
    """Serve the bulk protocol on our node; the list fills with what each stream saw."""
    served: list[bulk.BulkResult] = []

    async def handler(stream: INetStream) -> None:
        await bulk.bulk_server(stream, served)

    node.set_stream_handler(BULK, handler)
    return served


async def test_bulk_py_dials_js_32mib_each_way(js: JsPeer, node: Node) -> None:
    size = 32 * MiB
    up, down = seed("py->js 32"), seed("js->py 32")
    start = len(js.events)
    with trio.fail_after(BULK_STEP):
        pid = await node.connect(js.addr)
        stream = await node.new_stream(pid, BULK)
        # js replies only after our FIN: first the whole upload, then the download
        result = await bulk.bulk_client(
            stream, send_bytes=size, send_seed=up, recv_bytes=size, recv_seed=down, mode=bulk.AFTER_EOF
        )
        (served,) = await js_served(js, 1, start=start)
    assert_py_client_result(result, sent=size, send_seed=up, got=size, recv_seed=down)
    assert served["mode"] == "after_eof" and served["peer_id"] == str(node.peer_id)
    assert (served["received_bytes"], served["received_sha256"]) == (size, result.sent_sha256)
    assert (served["sent_bytes"], served["sent_sha256"]) == (size, result.received_sha256)
    # the connection is still good for more
    assert await node.ping(pid, timeout=STEP) > 0


async def test_bulk_js_dials_py_32mib_each_way(js: JsPeer, node: Node) -> None:
    size = 32 * MiB
    up, down = seed("js->py 32"), seed("py->js 32")
    served = serve_bulk_on(node)
    me = str(node.peer_id)
    dialed = await js.dial(py_addr(node))
    assert dialed["peer_id"] == me and dialed["direction"] == "outbound"
    # js opens the stream and sends while we send back (concurrent mode)
    reply = await js.bulk(me, send_bytes=size, send_seed=up, recv_bytes=size, recv_seed=down, timeout=BULK_STEP)
    assert_js_client_reply(reply, sent=size, send_seed=up, got=size, recv_seed=down)
    # our handler records its stream after closing it: js may have its reply before that
    (ours,) = await wait_until(lambda: served, 10, what="our side's record of the bulk stream")
    assert ours.mode == bulk.CONCURRENT
    assert (ours.received_bytes, ours.received_sha256) == (size, reply["sent_sha256"])
    assert (ours.sent_bytes, ours.sent_sha256) == (size, reply["received_sha256"])
    assert await node.ping(ID.from_base58(js.peer_id), timeout=STEP) > 0


async def test_bulk_four_concurrent_streams_8mib_each_way(js: JsPeer, node: Node) -> None:
    """Four streams on one connection, all sending and receiving at once: flow-control
    windows and frame interleaving in both muxers, both directions."""
    size = 8 * MiB
    start = len(js.events)
    results: dict[int, bulk.BulkResult] = {}
    streams: list[INetStream] = []

    async def one(i: int) -> None:
        stream = await node.new_stream(pid, BULK)
        streams.append(stream)
        # different write sizes per stream, so that frames of different sizes interleave
        sizes = bulk.WRITE_SIZES[i:] + bulk.WRITE_SIZES[:i]
        results[i] = await bulk.bulk_client(
            stream, send_bytes=size, send_seed=seed(f"up {i}"), recv_bytes=size, recv_seed=seed(f"down {i}"), sizes=sizes
        )

    with trio.fail_after(BULK_STEP):
        pid = await node.connect(js.addr)
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        served = await js_served(js, 4, start=start)

    assert len({id(s.muxed_conn) for s in streams}) == 1, "the four streams should share one connection"
    for i in range(4):
        assert_py_client_result(results[i], sent=size, send_seed=seed(f"up {i}"), got=size, recv_seed=seed(f"down {i}"))
    assert sorted(e["received_sha256"] for e in served) == sorted(r.sent_sha256 for r in results.values())
    assert all(e["mode"] == "concurrent" for e in served)
    conns = [c for c in await js.peers() if c["peer_id"] == str(node.peer_id)]
    assert len(conns) == 1, conns


async def test_bulk_streams_opened_by_both_sides_at_once(js: JsPeer, node: Node) -> None:
    """Two streams py opens and two js opens, on one connection, all moving 8 MiB each way at once."""
    size = 8 * MiB
    served_here = serve_bulk_on(node)
    me = str(node.peer_id)
    start = len(js.events)
    py_results: dict[int, bulk.BulkResult] = {}
    js_replies: dict[int, dict[str, Any]] = {}

    async def from_py(i: int) -> None:
        stream = await node.new_stream(pid, BULK)
        py_results[i] = await bulk.bulk_client(
            stream, send_bytes=size, send_seed=seed(f"py up {i}"), recv_bytes=size, recv_seed=seed(f"py down {i}")
        )

    async def from_js(i: int) -> None:
        js_replies[i] = await js.bulk(
            me, send_bytes=size, send_seed=seed(f"js up {i}"), recv_bytes=size, recv_seed=seed(f"js down {i}"),
            timeout=BULK_STEP,
        )

    with trio.fail_after(BULK_STEP):
        pid = await node.connect(js.addr)
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(from_py, i)
                nursery.start_soon(from_js, i)
        await js_served(js, 2, start=start)

    for i in range(2):
        assert_py_client_result(
            py_results[i], sent=size, send_seed=seed(f"py up {i}"), got=size, recv_seed=seed(f"py down {i}")
        )
        assert_js_client_reply(
            js_replies[i], sent=size, send_seed=seed(f"js up {i}"), got=size, recv_seed=seed(f"js down {i}")
        )
    # our handler records each stream after closing it: js may have its replies before that (seen in CI)
    await wait_until(lambda: len(served_here) == 2, 10, what="our side's records of both bulk streams")
    conns = [c for c in await js.peers() if c["peer_id"] == me]
    assert len(conns) == 1 and conns[0]["direction"] == "inbound", conns


async def test_bulk_js_stops_at_our_receive_window_until_we_read(js: JsPeer, node: Node) -> None:
    """js fills exactly the 256 KiB initial window (spec) of a stream we do not read,
    then waits; our window updates as we read let the rest through."""
    size = 4 * MiB
    down = seed("window")
    with trio.fail_after(BULK_STEP):
        pid = await node.connect(js.addr)
        stream = await node.new_stream(pid, BULK, lazy=False)  # the reply read: only js's bytes come after
        assert isinstance(stream, NetStream)
        muxed = stream.muxed_stream
        assert isinstance(muxed, YamuxStream), type(muxed)
        await stream.write(bulk.HEADER.pack(bulk.CONCURRENT, size, down))
        await bulk.half_close(stream)
        # We have read only multistream-select's reply (under half the window, so no
        # window update went out): js may send the initial window and not a byte more.
        # (Our reader would fail the connection with a protocol error on a byte more.)
        await wait_until(lambda: muxed._recv_window == 0, STEP, what="js to fill our receive window")
        await trio.sleep(0.3)  # room for a violation to show; no timing is asserted
        assert muxed._recv_window == 0 and muxed.muxed_conn.error is None
        assert muxed._buffered + muxed._unacked == INITIAL_WINDOW
        received = bytearray()
        await bulk.read_to_eof(stream, received.extend)
    payload, trailer = bytes(received[: -bulk.TRAILER.size]), bytes(received[-bulk.TRAILER.size :])
    assert len(payload) == size and hashlib.sha256(payload).hexdigest() == bulk.expected_sha256(down, size)
    count, got_sha, sent_sha = bulk.TRAILER.unpack(trailer)
    assert (count, got_sha) == (0, hashlib.sha256(b"").digest())
    assert sent_sha.hex() == bulk.expected_sha256(down, size)


async def js_store_until(js: JsPeer, peer: str, done: Callable[[dict[str, Any]], bool],
                         timeout: float = 3.0) -> dict[str, Any]:
    """js's peer-store entry for ``peer``, read every 0.1 s until ``done`` holds for it or ``timeout``
    passed: the last read either way (js learns only from what we push: we never ask it to identify)."""
    store = (await js.identify(peer, fresh=False))["peer_store"]
    with trio.move_on_after(timeout):
        while not done(store):
            await trio.sleep(0.1)
            store = (await js.identify(peer, fresh=False))["peer_store"]
    return dict(store)


async def test_py_pushes_a_new_protocol_to_js(js: JsPeer, node: Node) -> None:
    """A protocol we serve after js identified us reaches js's peer store unasked: the Node pushes
    (py-libp2p 0.8.1 pushes only when it starts listening; this was an xfail until it did)."""
    late = "/dedloc-interop/late/1.0.0"
    me = str(node.peer_id)
    await js.dial(py_addr(node))
    first = await js.identify(me, fresh=False)  # waits for js's own identify on connect
    assert late not in first["peer_store"]["protocols"]

    async def handler(stream: INetStream) -> None:
        await stream.close()

    node.set_stream_handler(late, handler)
    store = await js_store_until(js, me, lambda store: late in store["protocols"])
    assert late in store["protocols"]


async def test_py_pushes_a_new_address_to_js(js: JsPeer, node: Node) -> None:
    """An address we advertise after js identified us (a relay slot's, here) reaches js's peer store
    unasked, in the signed record js keeps (certified), as a NATed peer's circuit address must."""
    from p2p.hooks import ExternalAddresses, Reachability

    me = str(node.peer_id)
    await js.dial(py_addr(node))
    first = await js.identify(me, fresh=False)
    assert not any("p2p-circuit" in a["addr"] for a in first["peer_store"]["addrs"])
    circuit = Multiaddr(f"/ip4/127.0.0.1/tcp/4001/p2p/{js.peer_id}/p2p-circuit")  # any relay's id will do
    node.set_external(ExternalAddresses(reachability=Reachability.PRIVATE, relayed=(circuit,), judged=True))
    store = await js_store_until(js, me, lambda store: any("p2p-circuit" in a["addr"] for a in store["addrs"]))
    pushed = [a for a in store["addrs"] if "p2p-circuit" in a["addr"]]
    assert pushed and all(a["certified"] for a in pushed), store["addrs"]


# --------------------------------------------------------------------------- py-libp2p 0.8.1 quirks, pinned
# Each is a strict xfail: it turns into a failure (XPASS) once py-libp2p or our
# Node changes the behaviour, so that the note here and the workaround get revisited.
# raises=AssertionError: only the assertion that shows the gap counts as the expected failure
# (tests/ci_rules.py unwraps pytest-trio's ExceptionGroup for it); a timeout or a dead peer fails.


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="py-libp2p 0.8.1 signs its peer record over host.get_addrs(), which end in /p2p/<id>; "
    "the spec (and js/go) put plain transport addrs there. js-libp2p accepts it anyway.",
)
async def test_py_signed_peer_record_has_plain_transport_addrs(js: JsPeer, node: Node) -> None:
    await js.dial(py_addr(node))
    result = await js.identify(str(node.peer_id))
    spr = result["fresh"]["signed_peer_record"]
    assert spr is not None and spr["addrs"], result
    assert all("/p2p/" not in a for a in spr["addrs"]), spr["addrs"]


async def test_js_takes_a_trim_and_dials_back_when_it_wants(js: JsPeer) -> None:
    """Our connection manager closes with yamux GoAway 0x1005 (go-libp2p's ConnGarbageCollected):
    js-libp2p reads it as a close, not a protocol error, and its next dial to us works."""
    from p2p import NodeConfig
    from p2p.conn_manager import ConnManagerConfig
    from p2p.events import ConnectionClosed
    from tests.kit import record_events

    keep_one = ConnManagerConfig(low_water=1, high_water=1, grace_period=0.0, silence_period=3600.0)
    async with Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], connections=keep_one)) as node, \
            Node.open(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])) as other:
        seen = record_events(node)
        with trio.fail_after(STEP):
            pid = await node.connect(js.addr)
            await trio.sleep(0.05)  # js's connection is the older of the two: the one to go
            await node.connect(other.addrs[0])
        # identify's streams, both ways, end within moments: a stream at work keeps its peer
        await wait_until(lambda: all(not c.get_streams() for c in node.connections()), STEP)
        assert await node.trim() == 1 and pid not in node.connected_peers()
        await js.wait_event(lambda e: e.get("event") == "peer:disconnect" and e.get("peer_id") == str(node.peer_id))
        closed = await wait_until(lambda: [e.trimmed for e in seen if isinstance(e, ConnectionClosed)], STEP)
        assert closed == [True]
        await js.dial(py_addr(node))
        assert 0 < await node.ping(pid, timeout=STEP) < STEP
        assert "protocol error" not in js.stderr_tail.lower()
