"""The py-libp2p 0.8.1 host, built and corrected in one place: the surgery the pin exists for.

dedloc runs on py-libp2p's swarm (connection bookkeeping, multistream-select,
the Noise handshake, identify, peer store) and replaces what it gets wrong for
us. Every correction of that release lives here, each with its reason, so a
new release is checked against one module before the pin in ``pyproject.toml``
moves (``tests/test_node.py`` and ``interop/`` pin the behaviour):

* **Security and muxer.** Noise only (its defaults also offer TLS, SECIO and
  plaintext: not interoperable or not secure, and each costs a negotiation
  round); our record layer after its handshake (``p2p/noise.py``); our Yamux
  (``p2p/yamux.py``), which needs :class:`_Muxers` because its
  ``MuxerMultistream.new_conn`` builds its own Yamux whatever class it was given.
* **Round trips of the upgrade.** Its dialer spends two round trips on each
  multistream negotiation. :class:`_Security` proposes ``/noise`` lazily (the
  proposal rides with the first handshake message); the muxer is agreed inside
  the Noise handshake where the peer lists its muxers (``p2p/noise.py``'s
  ``_XX``), else :class:`_Muxers` sends its proposal right after the last
  handshake message without waiting for the answer (checked in front of the
  listener's first frames): a dial is connected after 2 round trips, not 6
  (``p2p/multistream.py``). Their listener sides are py-libp2p's, which read one
  exact message at a time.
* **Retries and auto-connect.** The swarm's per-address retries are off (retry
  policy lives in ``Node.bootstrap``'s backoff) and its auto-connector, which
  dials peer-store entries to keep 150 connections, is stopped: whom to connect
  to is the app's decision. What the swarm still tells it of each disconnect is
  dropped: it kept every peer that ever disconnected (its pruning runs in the loop
  stopped), one entry per visitor of a relay, for good (``bench/relay_soak.py``).
* **Advertised addresses.** ``get_addrs`` is replaced: py-libp2p's cuts
  ``/p2p-circuit`` addresses at the relay's ``/p2p`` and adds identify's
  unconfirmed observed addresses.
* **Peer store cap.** Its automatic identify stores up to 1000 self-reported
  addresses per peer; :func:`_cap_peer_addrs` keeps ``max_addrs``.
* **Peer store eviction.** Its peer store holds at most 1,000 peers and, at the bound, evicts
  first the entries without an address, which our own is (it holds our key pair): the 1,001st
  peer learnt (a DHT lookup in a swarm of thousands learns that many) took our keys away, and
  identify answered no one from then on. :func:`_bound_peer_store` applies ``p2p/peer_store.py``'s
  rule instead: ourselves, connected and dialing peers are kept; of the rest at most
  ``known_peers``.
* **Identify's observed address.** Its handler reports ``/p2p/<relay>/p2p-circuit``
  as the observed address whenever the peer has *any* relayed connection to us
  (even when asked over a direct one). js-libp2p 3.x throws on an observed
  address that does not start with an IP, which fails its whole identify: no
  protocols learned, so no DCUtR, and the connection stays relayed (found by
  ``interop/test_js_nat.py``). :func:`_identify_handler` reports the stream's
  own connection's remote TCP address, and nothing on a relayed connection,
  where there is nothing to observe (the field is optional).
* **Identify push, taken.** Its handler reads up to 1 MiB, at any rate, and logs each push it
  cannot parse at ERROR: a peer could fill our log. :func:`_identify_push_handler` takes a push
  within the peer's identify rate and 64 KiB, drops garbage at debug, and updates the peer store as
  py-libp2p does. (Sending: it pushed only when it began listening; ``Node._push_identify`` pushes
  each change of what we advertise or serve.)
* **Admission.** Its swarm refuses inbound connections by one global count (an
  inbound limiter and its own resource manager, 300 connections, both on by
  default): a script holding 500 idle connections refused honest peers as often
  as itself. Both are taken out of the path; :func:`_install_admission` puts
  ``p2p/admission.py`` in front of the handshake (caps per address and subnet,
  a handshake deadline, eviction from the largest holder) and sizes the listen
  backlog.
* **IPv6 remote addresses.** Its TCP stream's ``get_remote_address`` answers None for
  an IPv6 connection (``getpeername`` gives 4 fields there, and it accepts 2): admission
  let every IPv6 connection past its caps unseen (found by ``bench/flood.py --ipv6``:
  2,000 stalled handshakes from 400 /48s, not one refused), identify observed nothing
  and ``dedloc status`` refused ``::1``. :func:`tcp_remote_address` reads the socket
  itself and caches the answer on the stream, where py-libp2p's own method then finds it:
  at admission for inbound connections, before the handshake for dialed ones (else the
  connection's transport addresses were empty: the dialer and the NAT lab's IPv6 peers
  could not tell where a direct IPv6 connection went).
* **Stream refusals.** Its listener's multistream-select (``Multiselect``) echoes
  any protocol it has a handler for, so a stream over a limit could only be reset
  after it was accepted: the opener read a bare reset. :class:`_Multiselect`
  asks the resource manager first and, over a limit, answers
  ``/dedloc/refused/<the limit>`` instead of the echo (yamux does the same for
  streams over the stream-open rate, before any negotiation).
* **Which connection a stream goes on.** When a peer has several connections, its
  swarm's ``new_stream`` picks the direct one with the most open streams, ties
  broken by ``id(conn)`` (a memory address: in effect at random). A peer's young
  extra connections are mostly short-lived: js-libp2p's AutoNAT v2 server dials
  us back from its own peer id and closes that connection ~0.3 s later. A relay
  that opened a circuit's STOP stream on it lost the circuit mid-handshake
  ("failed to negotiate the secure protocol"; ``interop/test_js_nat.py``: 1 cell
  failed in 1 of 4 runs, and in CI). :func:`_oldest_direct_first` picks the oldest open direct
  connection, else the oldest relayed one: the one both sides have kept.
* **Listen failures.** Its ``Swarm.listen`` logs a listener that failed (a port
  in use, an address not this machine's) and returns False, which ``BasicHost.run``
  ignores: a relay started on a port that another process held ran on, listening
  nowhere, and said only "no direct address". :func:`check_listening` fails the
  node's start instead, with the operating system's reason for each address.
* **Listeners outliving the host.** Its listener serves from a trio system task of its
  own, cancelled only by ``listener.close()``; the swarm calls that in the ``finally`` of
  its service after it was cancelled, where the first ``await`` (closing a connection)
  raises ``Cancelled`` again, so the listeners were never closed: a closed Node went on
  accepting and answering on its port for the life of the process (found when a node
  restarted on its port in the same process shared it, through ``SO_REUSEPORT``, with its
  dead self, which took every other connection and closed it). :func:`close_listeners`
  closes them, shielded, as the node leaves.
* **Closing one connection at a time.** Its ``SwarmConn`` sleeps 0.1 s in every close (to
  let stream handlers see their resets) and its swarm closes connections one after
  another, so a node left with N connections took 0.1 N s to close: 0.6-0.9 s with 10 on
  loopback, 19 s at the connection manager's high water of 192, minutes for a relay near its
  4,096 (past systemd's 90 s stop timeout). :func:`close_connections` closes them all
  at once, shielded, as the node leaves.
* **Dialing** is not here: ``p2p/dialer.py`` replaces ``Swarm.dial_peer`` (a
  250 ms stall on every successful connect) and is a module of its own.

Nothing global is mutated: every setting goes through constructors or one
host instance's attributes.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from contextvars import ContextVar
from typing import Any, cast

from libp2p import new_host
from libp2p.abc import IHost, IMuxedConn, INetConn, INetStream, INetwork, INotifee, IRawConnection, ISecureConn
from libp2p.crypto.keys import KeyPair
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.identity.identify.identify import _mk_identify_protobuf, _remote_address_to_multiaddr
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.identity.update import update_peerstore_from_identify
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.stream.net_stream import NetStream, StreamState
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError
from libp2p.abc import IMultiselectCommunicator
from libp2p.custom_types import StreamHandlerFn
from libp2p.protocol_muxer.exceptions import MultiselectClientError, MultiselectCommunicatorError, MultiselectError
from libp2p.protocol_muxer.multiselect import Multiselect
from libp2p.security.security_multistream import SecurityMultistream
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
import trio
from multiaddr import Multiaddr

from . import multistream
from .addresses import ip_and_tcp_port, is_relayed_conn
from .errors import DedlocError, RemoteProtocolError, StreamBrokenError
from .admission import Ticket
from .peer_store import Entry, low_water, to_forget
from .resources import ResourceLimitExceeded, ResourceManager
from .identify import MAX_IDENTIFY_SIZE, PUSH_PROTOCOL, PUSH_READ_TIMEOUT, send_identify
from .trio_util import finish_quietly
from .wire import read_message
from .noise import PROTOCOL_ID as NOISE_PROTOCOL_ID
from .noise import NoiseConfig, NoiseSession, NoiseTransport
from .yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from .yamux import GO_AWAY_NORMAL, YamuxConfig, YamuxConnection

ConnectionCallback = Callable[[INetConn], Awaitable[None]]

log = logging.getLogger(__name__)


def build_host(
    key_pair: KeyPair,
    listen: list[Multiaddr],
    *,
    yamux: YamuxConfig,
    noise_config: NoiseConfig,
    dial_timeout: float,
    advertised: Callable[[list[Multiaddr]], list[Multiaddr]],
    max_addrs: int,
    resources: ResourceManager,
    known_peers: int,
    keep: Callable[[], Collection[ID]],
    forgot: Callable[[int], None],
) -> IHost:
    """A py-libp2p host with dedloc's data plane and every correction above applied.

    ``advertised`` maps the transport's listen addresses to what identify
    and ``get_addrs`` report (the Node's address policy). ``keep``: the peers the
    peer store never forgets besides us (connected, dialing); ``forgot`` hears
    how many it forgot (:func:`_bound_peer_store`). Call :func:`started` once
    the host runs.
    """
    noise = NoiseTransport(key_pair, muxers=(YAMUX_PROTOCOL_ID,), config=noise_config)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={YAMUX_PROTOCOL_ID: YamuxConnection},
        listen_addrs=listen,
        addrs_factory=advertised,
        connection_config=ConnectionConfig(
            min_connections=0, low_watermark=0, dial_timeout=dial_timeout,
            # admission (p2p/admission.py) caps inbound connections; py-libp2p's count stays out of its way
            max_connections=1_000_000, high_watermark=1_000_000,
            inbound_upgrade_timeout=resources.config.admission.handshake_timeout + 1.0,
        ),
    )
    network = host.get_network()
    network.set_resource_manager(None)  # type: ignore[attr-defined]
    _install_admission(network, resources)
    upgrader = network.upgrader  # type: ignore[attr-defined]
    upgrader.security_multistream = _Security(noise)
    upgrader.muxer_multistream = _Muxers(yamux, upgrader.muxer_multistream.negotiate_timeout, resources)
    host.multiselect = _Multiselect(host.multiselect.handlers, resources)  # type: ignore[attr-defined]
    network.retry_config = RetryConfig(max_retries=0)  # type: ignore[attr-defined]
    network._select_connection = _oldest_direct_first  # type: ignore[attr-defined]
    _cap_peer_addrs(host.get_peerstore(), max_addrs)
    me = host.get_id()
    _bound_peer_store(host.get_peerstore(), lambda: {me, *keep()}, known_peers, forgot)
    return host


def _oldest_direct_first(connections: list[INetConn], peer_id: ID) -> INetConn:
    """The connection a new stream to ``peer_id`` goes on: the oldest open direct one, else
    the oldest relayed one (see the module docstring).

    The swarm lists a peer's connections in the order they were added, so the first
    is the oldest; ``peer_id`` is the swarm's signature, unused.
    """
    if not connections:
        raise ValueError("no connection to choose from")
    open_ = [c for c in connections if not getattr(c, "is_closed", False)] or connections
    return next((c for c in open_ if not is_relayed_conn(c)), open_[0])


async def started(host: IHost, get_addrs: Callable[[], list[Multiaddr]],
                  connected: ConnectionCallback, disconnected: ConnectionCallback, resources: ResourceManager,
                  ) -> None:
    """What can only be corrected on a running host: the auto-connector, ``get_addrs``, our notifee,
    the listen backlog (py-libp2p listens with 128: a flood's SYNs would crowd honest ones out)."""
    network = host.get_network()
    for listener in getattr(network, "listeners", {}).values():
        for socket_listener in getattr(listener, "listeners", []):
            sock = getattr(socket_listener, "socket", None)
            if sock is not None:
                sock.listen(resources.config.admission.backlog)  # listen() again on a listening socket resizes its queue
    await network.auto_connector.stop()  # type: ignore[attr-defined]
    # the swarm still tells the stopped auto-connector of every disconnect, and it kept each peer's time
    # for good (its pruning runs in the loop stopped above): a relay's every visitor, one entry each
    network.auto_connector.record_disconnect = _ignore_disconnect  # type: ignore[attr-defined]
    host.get_addrs = get_addrs  # type: ignore[method-assign]
    network.register_notifee(_Notifee(connected, disconnected))
    host.set_stream_handler(IDENTIFY_PROTOCOL, _identify_handler(host, resources))
    host.set_stream_handler(TProtocol(PUSH_PROTOCOL), _identify_push_handler(host, resources))


async def close_listeners(host: IHost, *, timeout: float = 5.0) -> None:
    """Stop accepting connections (see the module's "Listeners outliving the host"): shielded,
    so that it runs however the node is left, and within ``timeout``."""
    with trio.CancelScope(shield=True), trio.move_on_after(timeout):
        for listener in list(getattr(host.get_network(), "listeners", {}).values()):
            try:
                await listener.close()
            except Exception as e:  # a listener that cannot close is logged, the others still close
                log.warning("could not close a listener: %s", e)


async def close_connections(conns: Iterable[INetConn], *, code: int = GO_AWAY_NORMAL, timeout: float = 5.0) -> None:
    """Close ``conns`` at once, our yamux saying GoAway ``code`` (see the module's "Closing one connection
    at a time"; a trim's is 0x1005): shielded, so that it runs however the node is left, and within
    ``timeout``. Best effort: one that cannot close is logged, the others still close."""
    with trio.CancelScope(shield=True), trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            for conn in list(conns):
                nursery.start_soon(_close_quietly, conn, code)


async def left_open(stream: INetStream) -> bool:
    """Whether ``stream`` is a py-libp2p stream not yet closed or reset by us (nor found reset).

    py-libp2p's ``close`` sends a FIN and takes the stream out of its connection's
    table each time it is called (and tells the swarm's notifees again): it is for
    a stream in one of these states only.
    """
    return isinstance(stream, NetStream) and await stream.state in (
        StreamState.INIT, StreamState.OPEN, StreamState.CLOSE_READ, StreamState.CLOSE_WRITE)


async def _close_quietly(conn: INetConn, code: int) -> None:
    try:
        if isinstance(conn.muxed_conn, YamuxConnection):
            await conn.muxed_conn.close(code)  # py-libp2p's close below says no code
        await conn.close()
    except Exception as e:  # the connection may be failing already
        log.debug("closing a connection to %s: %r", conn.muxed_conn.peer_id, e)


def check_listening(host: IHost, listen: Sequence[Multiaddr]) -> None:
    """Raise :class:`DedlocError` naming each TCP address of ``listen`` that has no listener (see the
    module's "Listen failures"), with the operating system's reason (found by binding it as py-libp2p does)."""
    bound = [b for b in map(ip_and_tcp_port, host.get_transport_addrs()) if b is not None]
    missing = []
    for addr in listen:
        wanted = ip_and_tcp_port(addr)
        if wanted is None:
            continue  # not TCP over IP (QUIC's listeners fail loudly on their own)
        ip, port = wanted
        if not any(port in (0, bound_port) and ip in ("0.0.0.0", "::", bound_ip) for bound_ip, bound_port in bound):
            missing.append(f"{addr}: {_bind_reason(ip, port)}")
    if missing:
        raise DedlocError("cannot listen on " + "; ".join(missing)
                          + " (choose another port with --listen, or tcp/0 for any free one)")


def _bind_reason(ip: str, port: int) -> str:
    """Why the OS refuses to bind ``ip``:``port`` with py-libp2p's socket options (it logs and drops the reason)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((ip, port))
            sock.listen(1)
        except OSError as e:
            return e.strerror or str(e)
    return "py-libp2p opened no listener (the address binds now: it may have been taken a moment ago)"


#: The admission ticket of the inbound connection a task is upgrading (each accepted connection has its task).
_TICKET: ContextVar[Ticket | None] = ContextVar("dedloc_admission_ticket", default=None)


#: Refused connections that may linger a moment so the refusal is read, at once (more are just closed).
MAX_LINGERING = 64
#: How long a refused connection lingers for the dialer's first bytes before it is closed.
LINGER = 1.0


def _install_admission(swarm: Any, resources: ResourceManager) -> None:
    """Put the resource manager's admission (``p2p/admission.py``) in front of py-libp2p's accept
    path, and its connections-per-peer limit right after the handshake.

    The swarm runs each accepted socket in a task of its own (``trio.serve_listeners``),
    so the accept loop never waits on a handshake. In that task we ask for a ticket
    before anything is read, run the upgrade under the handshake deadline, lift the
    deadline once the upgrade authenticated the peer, and give the ticket back when the
    connection closes. An evicted connection's deadline is moved to now.

    A refused connection is told why before it is closed: the multistream header and
    ``/dedloc/refused/<reason>`` where the security protocol's echo would be (one short
    write, only to an address that completed TCP's handshake, so nothing a spoofed
    source could turn into an amplifier). It lingers up to :data:`LINGER` for the
    dialer's first bytes, so that closing with them unread does not reset the
    connection before the dialer read the refusal; at most :data:`MAX_LINGERING` at once.
    """
    admission = resources.admission
    swarm._inbound_limiter = trio.CapacityLimiter(1_000_000)  # its global cap: replaced by ours
    handle = swarm._handle_inbound_connection
    upgrade = swarm.upgrade_inbound_raw_conn
    scopes: dict[Ticket, trio.CancelScope] = {}
    lingering = 0

    async def refuse(read_write_closer: Any, reason: str) -> None:
        nonlocal lingering
        if lingering >= MAX_LINGERING:
            await finish_quietly(read_write_closer.close)
            return
        lingering += 1
        try:
            with trio.move_on_after(LINGER):
                await read_write_closer.write(multistream.refusal(reason))
                await read_write_closer.read(1024)
        except Exception:
            pass
        finally:
            lingering -= 1
            await finish_quietly(read_write_closer.close)

    async def admitted(read_write_closer: Any, maddr: Multiaddr) -> None:
        remote = tcp_remote_address(read_write_closer)
        if remote is None:
            await handle(read_write_closer, maddr)
            return
        ticket, evicted = admission.admit(str(remote[0]), trio.current_time())
        for victim in evicted:
            if victim in scopes:
                scopes[victim].deadline = -float("inf")
        if ticket is None:
            await refuse(read_write_closer, str(admission.last_refusal or "unknown"))
            return
        scope = scopes[ticket] = trio.CancelScope(deadline=trio.current_time() + admission.config.handshake_timeout)
        token = _TICKET.set(ticket)
        try:
            with scope:
                await handle(read_write_closer, maddr)
            if scope.cancelled_caught and not ticket.authenticated and not ticket.evicted:
                admission.timed_out(ticket)
        finally:
            _TICKET.reset(token)
            scopes.pop(ticket, None)
            admission.release(ticket)
            await finish_quietly(read_write_closer.close)

    async def upgraded(raw_conn: IRawConnection, maddr: Multiaddr) -> IMuxedConn:
        muxed = await upgrade(raw_conn, maddr)
        ticket = _TICKET.get()
        if ticket is not None and ticket in scopes:
            admission.authenticated(ticket)
            peer = str(muxed.peer_id)
            try:
                resources.open_connection(peer)
            except ResourceLimitExceeded as e:
                log.debug("refused a connection from %s: %s", peer, e)
                await finish_quietly(muxed.close)
                raise
            scope = scopes[ticket]
            scope.deadline = float("inf")
            closed = getattr(muxed, "event_closed", None)

            # The swarm's task now waits for the swarm's end, not the connection's: end
            # it (and give the ticket back) when the connection closes.
            async def until_closed() -> None:
                try:
                    if closed is not None:
                        await closed.wait()
                        scope.cancel()
                    else:
                        await trio.sleep_forever()
                finally:
                    resources.close_connection(peer)

            swarm.background_nursery.start_soon(until_closed)
        return muxed  # type: ignore[no-any-return]

    swarm._handle_inbound_connection = admitted
    swarm.upgrade_inbound_raw_conn = upgraded


def identify_message(host: IHost, remote: tuple[str, int] | None = None, *, purpose: str) -> bytes | None:
    """Our identify message as py-libp2p builds it (protocols, advertised addresses, signed peer record),
    with ``remote`` as the observed address (none for a push, or on a relayed connection); None when it
    cannot be built. Quietly while our listeners close (``OSError``: the node is leaving, nothing to
    say); any other fault is ours, logged at ERROR naming ``purpose`` ("answer for <peer>", "push"):
    raised, it left the caller, the node's nursery and ended the node (py-libp2p's ``PeerStoreError``
    from a full peer store did so at every relay's ~1,000th visitor, see :mod:`p2p.peer_store`)."""
    try:
        return bytes(_mk_identify_protobuf(host, _remote_address_to_multiaddr(remote)).SerializeToString())
    except OSError:
        return None
    except Exception:
        log.error("could not build our identify %s", purpose, exc_info=True)
        return None


async def _within_identify_rate(stream: INetStream, resources: ResourceManager) -> bool:
    """Whether the stream's peer is within its identify rate (one request and one push share it);
    a peer over it gets its stream reset."""
    try:
        resources.allow("identify", str(stream.muxed_conn.peer_id), trio.current_time())
    except ResourceLimitExceeded:
        await finish_quietly(stream.reset)
        return False
    return True


def _identify_push_handler(host: IHost, resources: ResourceManager) -> Callable[[INetStream], Awaitable[None]]:
    """Take a peer's identify/push (see the module docstring): within the peer's identify rate (a
    reset beyond it), :data:`MAX_IDENTIFY_SIZE` and :data:`PUSH_READ_TIMEOUT` at most; what it says
    replaces what we held of it, by py-libp2p's update (which keeps a public key only if it hashes to
    the sender, and a signed record only if it names the sender). What does not parse is dropped,
    logged at debug: a peer cannot fill our log."""

    async def handle(stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        if not await _within_identify_rate(stream, resources):
            return
        try:
            message = await read_message(stream, Identify, max_size=MAX_IDENTIFY_SIZE, timeout=PUSH_READ_TIMEOUT)
        except (RemoteProtocolError, StreamBrokenError) as e:
            log.debug("identify push from %s dropped: %s", peer, e)
            await finish_quietly(stream.reset)
            return
        await update_peerstore_from_identify(host.get_peerstore(), peer, message)
        await finish_quietly(stream.close)

    return handle


def _identify_handler(host: IHost, resources: ResourceManager) -> Callable[[INetStream], Awaitable[None]]:
    """Answer identify as py-libp2p does (its message, varint-prefixed), with the observed
    address of this stream's connection: its TCP remote, or none when relayed. A peer over
    its identify rate gets a reset, and so does a stream whose answer cannot be built
    (:func:`identify_message`)."""

    async def handle(stream: INetStream) -> None:
        if not await _within_identify_rate(stream, resources):
            return
        remote = stream.get_remote_address()  # None on a relayed connection (nat/circuit.py)
        message = identify_message(host, remote, purpose=f"answer for {stream.muxed_conn.peer_id}")
        if message is None:  # the node leaving, or a fault of ours (logged): this stream is reset, nothing more
            await finish_quietly(stream.reset)
            return
        try:
            await send_identify(stream, message)
        except Exception:  # the asker left or reset: it asks again or goes without
            return

    return handle


def tcp_remote_address(conn: Any) -> tuple[str, int] | None:
    """The (host, port) of a raw TCP connection's other end, IPv4 or IPv6 (see the module docstring),
    cached on py-libp2p's stream so that its ``get_remote_address`` answers the same from then on; None
    for a connection that is not a TCP socket's."""
    cached = getattr(conn, "_cached_remote_address", None)
    if cached is not None:
        return cast(tuple[str, int], cached)
    sock = getattr(getattr(conn, "stream", None), "socket", None)
    try:
        name = sock.getpeername() if sock is not None else None
    except OSError:
        name = None
    if isinstance(name, tuple) and len(name) >= 2:
        found = (str(name[0]), int(name[1]))
        if hasattr(conn, "_cached_remote_address"):
            conn._cached_remote_address = found
        return found
    getter = getattr(conn, "get_remote_address", None)
    return cast("tuple[str, int] | None", getter()) if getter is not None else None


def _ignore_disconnect(peer_id: ID) -> None:
    """The stopped auto-connector's ``record_disconnect``: nothing to remember (see :func:`started`)."""


def _bound_peer_store(peerstore: Any, keep: Callable[[], Collection[ID]], limit: int,
                      forgot: Callable[[int], None]) -> None:
    """Forget peers by ``p2p/peer_store.py``'s rule instead of py-libp2p's eviction (see the module docstring).

    Its ``add_addrs`` calls ``_enforce_peer_limit`` whenever the store holds more than ``max_peers``
    entries; this one instance's method is replaced, and ``max_peers`` moves to where the next check
    is due: ``limit`` entries at first, then ``limit - low_water(limit)`` entries past what remained
    (connected peers count in the store's size, not in the rule's).
    """

    def enforce() -> None:
        entries = [Entry(pid, bool(data.addrs), data.is_expired(), data.last_identified)
                   for pid, data in peerstore.peer_data_map.items()]
        gone = to_forget(entries, keep(), limit)
        for pid in gone:
            peerstore.clear_peerdata(pid)
        peerstore.max_peers = len(peerstore.peer_data_map) + limit - low_water(limit)
        if gone:
            forgot(len(gone))

    peerstore._enforce_peer_limit = enforce
    peerstore.max_peers = limit


def _cap_peer_addrs(peerstore: Any, max_addrs: int) -> None:
    """Keep at most ``max_addrs`` addresses per peer in this host's peer store.

    A hostile peer could otherwise make us hold, and dial, a thousand addresses
    of its choosing. Wraps this one instance's ``add_addrs``.
    """
    original = peerstore.add_addrs

    def add_addrs(peer_id: ID, addrs: Sequence[Multiaddr], ttl: int = 0) -> None:
        try:
            known = set(map(str, peerstore.addrs(peer_id)))
        except PeerStoreError:
            known = set()
        room = max(0, max_addrs - len(known))
        fresh = [a for a in addrs if str(a) not in known][:room]
        original(peer_id, [a for a in addrs if str(a) in known] + fresh, ttl)

    peerstore.add_addrs = add_addrs


class _Security(SecurityMultistream):
    """``/noise``, proposed lazily by the dialer: header, proposal and the first handshake
    message in one write; the answer is read before the second (a refusal fails the dial)."""

    def __init__(self, noise: NoiseTransport) -> None:
        super().__init__({TProtocol(NOISE_PROTOCOL_ID): noise})
        self._noise = noise

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        # an IPv6 dial's remote address, read and cached before the swarm records the connection's
        # transport addresses from it (inbound ones are read at admission)
        tcp_remote_address(getattr(conn, "stream", None))
        lazy = multistream.LazySelect(conn, NOISE_PROTOCOL_ID)
        try:
            secure = await self._noise.secure_outbound(conn, peer_id, handshake_over=cast(IRawConnection, lazy))
        except (multistream.MultistreamError, multistream.ProtocolRefused) as e:
            raise MultiselectClientError(f"security negotiation: {e}") from e
        setattr(secure, "negotiated_security_protocol", NOISE_PROTOCOL_ID)
        return secure


class _Muxers(MuxerMultistream):
    """Muxer negotiation that builds our :class:`YamuxConnection` with our config; the dialer
    proposes without waiting (over another secure channel than ours: optimistically, header
    and proposal in one write)."""

    def __init__(self, config: YamuxConfig, negotiate_timeout: int, resources: ResourceManager) -> None:
        super().__init__({YAMUX_PROTOCOL_ID: YamuxConnection}, negotiate_timeout)
        self._config = config
        self._resources = resources

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
        if isinstance(conn, NoiseSession) and conn.early_muxer == YAMUX_PROTOCOL_ID:
            protocol = TProtocol(YAMUX_PROTOCOL_ID)  # agreed inside the handshake: no negotiation
        elif conn.is_initiator and isinstance(conn, NoiseSession):
            # proposed with the Noise handshake's last flight; the answer is checked in front of
            # the first frames the listener sends (a refusal fails the connection there)
            await conn.write(multistream.encode(multistream.HEADER, YAMUX_PROTOCOL_ID))
            conn.expect_preface(multistream.Reply(YAMUX_PROTOCOL_ID))
            protocol = TProtocol(YAMUX_PROTOCOL_ID)
        elif conn.is_initiator:
            try:
                with trio.fail_after(self.negotiate_timeout):
                    protocol = TProtocol(await multistream.select(conn, [YAMUX_PROTOCOL_ID]))
            except (multistream.MultistreamError, multistream.ProtocolRefused, trio.TooSlowError) as e:
                raise MultiselectClientError(f"muxer negotiation: {e or 'timed out'}") from e
        else:
            protocol, _ = await self._selector.select(conn, False, self.negotiate_timeout)
        peer, resources = str(peer_id), self._resources
        muxed = YamuxConnection(conn, peer_id, self._config, memory=resources.memory_account(peer),
                                admit_stream=lambda: resources.stream_open_refusal(peer, trio.current_time()))
        return self._annotate_connection(muxed, conn, protocol)


class _Multiselect(Multiselect):
    """The listener's multistream-select, where every inbound stream is acquired from the
    resource manager, and one over a limit is answered with its refusal.

    py-libp2p's, but before a protocol is echoed the stream is acquired
    (:meth:`ResourceManager.open_stream`: in all, per protocol, per peer, per peer and
    protocol) and given back when its handler returns, whatever the handler (the Node's,
    identify, ping). Over a limit, the opener reads ``/dedloc/refused/<the limit>`` as the
    answer to its proposal, then FIN (a reset a moment later); a dedloc opener raises
    :class:`p2p.multistream.PeerRefused` naming the limit.
    """

    def __init__(self, handlers: dict[TProtocol | None, StreamHandlerFn | None], resources: ResourceManager) -> None:
        super().__init__(handlers)
        self._resources = resources
        #: An authenticated run's gate (``p2p/auth.py``): None lets the stream in, else the refusal.
        self.gate: Callable[[ID, str], Awaitable[str | None]] | None = None

    async def negotiate(self, communicator: IMultiselectCommunicator, negotiate_timeout: int = 30,
                        ) -> tuple[TProtocol | None, StreamHandlerFn | None]:
        try:
            with trio.fail_after(negotiate_timeout):
                await self.handshake(communicator)
                while True:
                    try:
                        command = await communicator.read()
                        if command == "ls":
                            await communicator.write("\n".join(p for p in self.handlers if p is not None) + "\n")
                            continue
                        protocol = TProtocol(command) if command else None
                        if protocol is None or protocol not in self.handlers:
                            await communicator.write(multistream.NA)
                            continue
                        return protocol, await self._accept(communicator, protocol)
                    except MultiselectCommunicatorError as e:
                        raise MultiselectError(str(e)) from e
        except trio.TooSlowError:
            raise MultiselectError("handshake read timeout") from None
        except UnicodeDecodeError as e:
            # py-libp2p's reader decodes every line unchecked; a proposal that is not UTF-8 (often
            # a lazy opener's first message behind a refused proposal) would otherwise escape the
            # stream handler and take the whole Node down. It costs the stream (reset), no more.
            raise MultiselectError(f"a proposal that is not UTF-8: {e}") from None

    async def _accept(self, communicator: IMultiselectCommunicator, protocol: TProtocol) -> StreamHandlerFn | None:
        """Acquire the stream and echo ``protocol``; the handler, wrapped to give the stream back."""
        handler = self.handlers[protocol]
        stream = getattr(communicator, "read_writer", None)
        muxed = getattr(stream, "muxed_conn", None)
        if handler is None or muxed is None:
            await communicator.write(protocol)
            return handler
        if self.gate is not None:
            refusal = await self.gate(muxed.peer_id, protocol)
            if refusal is not None:
                log.debug("refused a %s stream from %s: %s", protocol, muxed.peer_id, refusal)
                await communicator.write(multistream.refusal_message(refusal))
                await finish_quietly(getattr(stream, "close"))
                return _linger_then_reset
        resources = self._resources
        try:
            grant = resources.open_stream(str(muxed.peer_id), protocol)
        except ResourceLimitExceeded as e:
            log.debug("refused a %s stream from %s: %s", protocol, muxed.peer_id, e)
            await communicator.write(multistream.refusal_message(str(e)))  # the header went with the handshake
            await finish_quietly(getattr(stream, "close"))
            return _linger_then_reset  # not a reset at once: it would discard the reason unread
        try:
            await communicator.write(protocol)
        except BaseException:
            resources.close_stream(grant)
            raise
        served = handler

        async def handle(net_stream: INetStream) -> None:
            try:
                await served(net_stream)
            finally:
                resources.close_stream(grant)

        return handle


def set_gate(host: IHost, gate: Callable[[ID, str], Awaitable[str | None]] | None) -> None:
    """Put ``gate`` in front of every inbound stream's protocol (None: remove it)."""
    multiselect = host.multiselect  # type: ignore[attr-defined]
    assert isinstance(multiselect, _Multiselect)
    multiselect.gate = gate


async def _linger_then_reset(stream: INetStream) -> None:
    """A refused stream (its refusal and FIN sent): wait a moment for the opener to read the
    reason and reset, then reset it ourselves."""
    with trio.move_on_after(1.0):
        try:
            while await stream.read(4096):
                pass
        except Exception:
            pass
    await finish_quietly(stream.reset)


class _Notifee(INotifee):
    """py-libp2p's network callbacks, forwarded (it runs each in a task of its own, for every connection)."""

    def __init__(self, connected: ConnectionCallback, disconnected: ConnectionCallback) -> None:
        self._connected = connected
        self._disconnected = disconnected

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        await self._connected(conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        await self._disconnected(conn)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass
