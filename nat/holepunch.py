"""Direct connection upgrade through relay (DCUtR, libp2p/specs relay/DCUtR.md): hole punching.

Two peers that reached each other through a relay try to open a direct TCP
connection by dialing each other at the same moment from their listen ports
(TCP simultaneous open), which endpoint-independent NATs let through. The
peer that received the relayed connection (B) leads: it first tries a plain
direct dial when the other side advertises public addresses (connection
reversal), then runs up to ``attempts`` rounds of CONNECT (exchange
addresses, measure the relay RTT) and SYNC (A dials at once, B after RTT/2).
Per the spec, A is the Noise initiator on the punched connection and B the
responder, whoever's SYN won.

Why not py-libp2p's DCUtR: it first spends 10 s dialing the peer's private
LAN address. Only public addresses are exchanged and dialed here (private
ones too when ``allow_private`` is set, for LAN swarms and tests).

Once the direct connection answers a ping, the relayed one is closed after a
short grace period and once the streams on it ended, so traffic moves to the
direct path and none under way is cut.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

import trio
from libp2p.abc import INetConn, INetStream
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p import Node
from p2p.addresses import is_relayed_conn, reachable_tcp, without_peer_id
from p2p.dialer import dial_simultaneous, remote_addr
from p2p.errors import ConfigError, RemoteProtocolError
from p2p.hooks import Metrics, Registration
from p2p.resources import ResourceLimitExceeded
from p2p.trio_util import finish_quietly
from p2p.untrusted import decode_addrs
from p2p.wire import read_message, write_message

from .proto import holepunch_pb2 as pb

log = logging.getLogger(__name__)

PROTOCOL = "/libp2p/dcutr"
#: Most addresses offered, taken from an offer, or dialed for a reversal: a peer chooses how many it advertises.
MAX_PUNCH_ADDRS = 16


@dataclass
class HolePunchConfig:
    attempts: int = 3
    #: Time for one dial of one address while punching.
    dial_timeout: float = 5.0
    #: Time the relayed connection stays open after the direct one works; then it is closed
    #: once the streams still on it ended (new ones go direct: the swarm prefers a direct
    #: connection), ``drain`` seconds at most, so a request or an averaging round under way
    #: when the punch succeeded is not cut.
    grace: float = 2.0
    drain: float = 60.0
    allow_private: bool = False
    #: An upgrade that failed is tried again, at most ``retries`` times, when the addresses
    #: change that it depends on (ours, or the peer's in the peer store): a peer often learns
    #: its public address after the relayed connection opened (its AutoNAT confirms it later,
    #: identify push tells us). At least ``retry_backoff`` seconds after the last try, doubling;
    #: the addresses are looked at every ``retry_poll`` seconds. Without any change it is tried
    #: again after ``retry_idle`` seconds (doubling, within the same ``retries``): a round also
    #: fails to what passes (SYNs lost twice, a peer too busy to dial in time), and a relayed
    #: connection is slow and limited for as long as it lasts.
    retries: int = 4
    retry_backoff: float = 2.0
    retry_poll: float = 1.0
    retry_idle: float = 30.0
    #: An upgrade that found nothing to dial (the peer advertised no public address yet) asks the
    #: peer who it is again (identify) ``reidentify_after`` seconds later, doubling, at most
    #: ``reidentify_times`` times, and runs again at once when its addresses changed: a peer that
    #: confirms its address late and does not push it (rust-libp2p's default, js-libp2p without
    #: identifyPush) would otherwise wait for ``retry_idle``. 0.5 s doubling asks at most 2 a
    #: second, the identify rate every peer grants (p2p/resources.py).
    reidentify_after: float = 0.5
    reidentify_times: int = 6

    def validate(self) -> None:
        if self.attempts < 1:
            raise ConfigError("hole punch attempts must be at least 1")
        if self.dial_timeout <= 0 or self.grace < 0 or self.drain < 0:
            raise ConfigError("hole punch timeouts must be positive")
        if self.retries < 0 or self.retry_backoff < 0 or self.retry_poll <= 0 or self.retry_idle <= 0:
            raise ConfigError("hole punch retries must not be negative and retry_poll and retry_idle must be positive")
        if self.reidentify_after <= 0 or self.reidentify_times < 0:
            raise ConfigError("hole punch reidentify_after must be positive and reidentify_times not negative")


class PunchMethod(StrEnum):
    """How a relayed connection became direct: a plain dial back (reversal), a simultaneous open, or not at all."""

    REVERSAL = "reversal"
    PUNCH = "punch"
    NONE = "none"


@dataclass(frozen=True)
class PunchResult:
    """One upgrade's outcome: the direct connection (None: stays relayed), how, after how many rounds."""

    conn: INetConn | None
    method: PunchMethod
    attempts: int
    elapsed: float
    #: No address to dial: the peer's store held no public one and it offered none in CONNECT.
    nothing_to_dial: bool = False


@dataclass
class HolePunchStats:
    attempts: int = 0
    successes: int = 0
    first_try_successes: int = 0
    reversals: int = 0
    failures: int = 0
    #: Upgrades tried again after an address changed (each also counts in attempts/successes/failures).
    retries: int = 0
    #: Identifies asked again because an upgrade found nothing to dial.
    reidentified: int = 0
    #: Seconds from the relayed connection's start to a working direct one, per success.
    time_to_direct: list[float] = field(default_factory=list)
    #: go-libp2p's holepunch labels: direct dials (reversals) by outcome; upgrades by
    #: (side, rounds, outcome), side ``initiator`` (we lead: the relayed connection was inbound)
    #: or ``receiver``; outcome ``success``, ``failed`` or ``no_suitable_address``.
    direct_dials: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, int, str]] = field(default_factory=Counter)


class NoAddressToPunch(RemoteProtocolError):
    """The peer offered no public address in CONNECT: a round has nothing to dial."""


@dataclass
class RetrySchedule:
    """When :meth:`HolePuncher.keep_upgrading` runs an upgrade again, and when it asks the peer again
    who it is, as a pure function of the last outcome and the time (passed in).

    After an upgrade that dialed and failed: again once the addresses changed but not before
    ``retry_backoff`` (doubling), or after ``retry_idle`` (doubling) without a change. After one that
    found nothing to dial: identify the peer at ``reidentify_after`` (doubling, ``reidentify_times``
    at most) and run again as soon as the addresses changed (no dial was made, so there is nothing
    to back off from). ``retries`` upgrades again at most, in all.
    """

    config: HolePunchConfig
    tries_left: int
    delay: float
    idle: float
    earliest: float = 0.0
    deadline: float = 0.0
    next_identify: float | None = None
    identify_gap: float = 0.0
    identifies_left: int = 0

    @classmethod
    def start(cls, config: HolePunchConfig) -> RetrySchedule:
        return cls(config, config.retries, config.retry_backoff, config.retry_idle)

    def after(self, nothing_to_dial: bool, now: float) -> bool:
        """An upgrade ended relayed at ``now``; False when no retry is left."""
        if self.tries_left <= 0:
            return False
        self.earliest = now if nothing_to_dial else now + self.delay
        self.deadline = now + self.idle
        self.next_identify = None
        if nothing_to_dial and self.config.reidentify_times > 0:
            self.identify_gap, self.identifies_left = self.config.reidentify_after, self.config.reidentify_times
            self.next_identify = now + self.identify_gap
        return True

    def wake(self, now: float) -> float:
        """When to look again: the next poll of the addresses, or the next identify if sooner."""
        poll = now + self.config.retry_poll
        return poll if self.next_identify is None else min(poll, self.next_identify)

    def identify_due(self, now: float) -> bool:
        return self.next_identify is not None and now >= self.next_identify

    def identified(self, now: float) -> None:
        self.identifies_left -= 1
        self.identify_gap *= 2
        self.next_identify = now + self.identify_gap if self.identifies_left > 0 else None

    def retry_due(self, now: float, changed: bool) -> str | None:
        """Why to run the upgrade again now (None: not yet)."""
        if changed and now >= self.earliest:
            return "addresses changed"
        if now >= self.deadline:
            return f"nothing changed in {self.idle:.0f} s"
        return None

    def retried(self) -> None:
        self.tries_left -= 1
        self.delay *= 2
        self.idle *= 2


class HolePuncher:
    """Both sides of DCUtR for one Node; ``our_addrs`` says what to offer the peer."""

    def __init__(self, node: Node, our_addrs: Callable[[], list[Multiaddr]], config: HolePunchConfig | None = None) -> None:
        self._node = node
        self._our_addrs = our_addrs
        self.config = config or HolePunchConfig()
        self.config.validate()
        self.stats = HolePunchStats()
        self._busy: set[ID] = set()
        self._nursery: trio.Nursery | None = None

    def install(self, nursery: trio.Nursery) -> Registration:
        """Answer DCUtR; retiring relayed connections runs in ``nursery`` (the owning service's)."""
        self._nursery = nursery
        return self._node.set_stream_handler(PROTOCOL, self._on_stream)

    def metrics(self) -> Metrics:
        s = self.stats
        return {"punch_attempts": s.attempts, "punch_successes": s.successes, "punch_first_try": s.first_try_successes,
                "reversals": s.reversals, "punch_failures": s.failures, "punch_retries": s.retries,
                "punch_reidentified": s.reidentified,
                "time_to_direct": list(s.time_to_direct)}

    def _offer(self) -> list[bytes]:
        return [without_peer_id(a).to_bytes() for a in self._our_addrs() if reachable_tcp(a, allow_private=self.config.allow_private)][:MAX_PUNCH_ADDRS]

    # ---------------------------------------------------------------- the inbound side (B) leads

    async def keep_upgrading(self, peer: ID, started: float, report: Callable[[PunchResult], None]) -> None:
        """:meth:`upgrade` the relayed connection to ``peer``; while it stays relayed, again
        (``config.retries`` times at most, backing off) whenever the addresses it depends on
        change (ours, or the peer's public ones in the peer store), or after ``retry_idle``
        seconds without a change (doubling). ``report`` hears every outcome."""
        relayed = self._relayed_only(peer)
        if relayed is None:
            return
        seen = self._addresses(peer)
        result = await self.upgrade(peer, relayed, started)
        report(result)
        schedule = RetrySchedule.start(self.config)
        while result.conn is None and schedule.after(result.nothing_to_dial, trio.current_time()):
            while True:
                await trio.sleep_until(schedule.wake(trio.current_time()))
                relayed = self._relayed_only(peer)
                if relayed is None:
                    return  # closed, or direct by other means
                if schedule.identify_due(trio.current_time()):
                    schedule.identified(trio.current_time())
                    await self._reidentify(peer)
                now = self._addresses(peer)
                why = schedule.retry_due(trio.current_time(), now != seen)
                if why is not None:
                    break
            seen = now
            schedule.retried()
            self.stats.retries += 1
            log.info("retrying the upgrade of the relayed connection to %s: %s", peer, why)
            result = await self.upgrade(peer, relayed, started)
            report(result)

    async def _reidentify(self, peer: ID) -> None:
        """Ask the peer who it is again: what it listens on now goes to the peer store."""
        self.stats.reidentified += 1
        await self._identify(peer)

    async def _identify(self, peer: ID, done: trio.Event | None = None) -> None:
        try:
            await self._node.identify(peer, timeout=self.config.dial_timeout)
        except Exception as e:  # gone, or busy with another identify: the schedule asks again
            log.debug("identify of %s while upgrading failed: %s", peer, e)
        finally:
            if done is not None:
                done.set()

    def _relayed_only(self, peer: ID) -> INetConn | None:
        """The relayed connection to ``peer`` if that is all there is."""
        conns = self._node.network.get_connections(peer)
        if any(not is_relayed_conn(c) for c in conns):
            return None
        return next((c for c in conns if is_relayed_conn(c)), None)

    def _addresses(self, peer: ID) -> tuple[frozenset[str], frozenset[str]]:
        """What an upgrade depends on: the addresses we offer, the peer's we know."""
        ours = frozenset(str(a) for a in self._our_addrs() if reachable_tcp(a, allow_private=self.config.allow_private))
        theirs = frozenset(str(a) for a in self._node.known_addrs(peer)
                           if reachable_tcp(a, allow_private=self.config.allow_private))
        return ours, theirs

    async def upgrade(self, peer: ID, relayed: INetConn, started: float | None = None) -> PunchResult:
        """Get a direct connection to ``peer``, which reached us through a relay (``conn`` None when it cannot be had).

        ``started`` (trio time) is when the relayed connection opened: ``time_to_direct`` counts from there.
        """
        started = trio.current_time() if started is None else started
        if peer in self._busy:
            return PunchResult(None, PunchMethod.NONE, 0, trio.current_time() - started)
        self._busy.add(peer)
        stats = self.stats
        rounds = 0
        try:
            direct, dialed = await self._reverse(peer)
            log.debug("upgrade to %s: reversal %s after %.2f s", peer, "worked" if direct else "found nothing",
                      trio.current_time() - started)
            stats.direct_dials["success" if direct is not None else "failed"] += 1
            offered = True
            late = False  # the reversal, tried again during the punch: it went direct
            punched = False
            identified = trio.Event()

            async def reverse_late() -> INetConn | None:
                """The reversal again, if the first dialed nothing: it ran as the connection opened,
                before identify told us the peer's addresses. We ask the peer who it is beside the
                first round's exchange (py-libp2p's own identify, started with the connection, takes
                two round trips more than ours: its stream costs them), wait for the answer, and dial
                what it told us, beside the punch (:meth:`_punch_round`). A peer that listens where we
                can reach it is dialed so (a reversal only after a failed round: direct in 5.07 s; this
                one: 0.3-0.8 s). The punch reaches such a peer too since a listen-nowhere peer's punch
                dial speaks first (:func:`p2p.dialer.dial_simultaneous`; it used to wait as the
                responder, and every round failed). go-libp2p waits for identify before its first dial
                instead: a round trip more for every punch."""
                nonlocal dialed, late
                if dialed:
                    return None
                with trio.move_on_after(self.config.dial_timeout):
                    await identified.wait()
                targets = self._reverse_targets(peer)
                dialed = len(targets)  # tried once, even if the punch wins meanwhile
                found, _ = await self._reverse(peer, targets)
                if dialed:
                    stats.direct_dials["success" if found is not None else "failed"] += 1
                if found is not None:
                    stats.reversals += 1
                    late = True
                return found

            if direct is not None:
                stats.reversals += 1
            else:
                async with trio.open_nursery() as asking:
                    asking.start_soon(self._identify, peer, identified)
                    for rounds in range(1, self.config.attempts + 1):
                        stats.attempts += 1
                        try:
                            direct = await self._punch_round(peer, relayed, reverse_late)
                        except NoAddressToPunch as e:  # another round now would hear the same: wait for news
                            log.info("hole punch with %s: %s", peer, e)
                            offered = False
                        except (RemoteProtocolError, trio.TooSlowError, Exception) as e:
                            log.info("hole punch round %d with %s failed after %.2f s: %r", rounds, peer,
                                     trio.current_time() - started, e)
                            direct = None
                        if direct is None:
                            direct = await reverse_late()  # the exchange failed before it could
                        if direct is not None:
                            if not late:
                                punched = True
                                if rounds == 1:
                                    stats.first_try_successes += 1
                            break
                        if not offered:
                            break
                    asking.cancel_scope.cancel()
            elapsed = trio.current_time() - started
            nothing_to_dial = direct is None and not dialed and not offered
            if rounds:
                outcome = "success" if punched else "no_suitable_address" if not offered else "failed"
                stats.outcomes[("initiator", rounds, outcome)] += 1
            if direct is None:
                stats.failures += 1
                return PunchResult(None, PunchMethod.NONE, rounds, elapsed, nothing_to_dial=nothing_to_dial)
            stats.successes += 1
            stats.time_to_direct.append(elapsed)
            if self._nursery is not None:
                self._nursery.start_soon(self._retire, relayed)
            return PunchResult(direct, PunchMethod.PUNCH if punched else PunchMethod.REVERSAL, rounds, elapsed)
        finally:
            self._busy.discard(peer)

    def _reverse_targets(self, peer: ID) -> list[Multiaddr]:
        """The peer's public addresses a reversal dials, at most MAX_PUNCH_ADDRS (identify stores up
        to 1000: we would dial them all, one by one)."""
        targets = [a for a in self._node.known_addrs(peer) if reachable_tcp(a, allow_private=self.config.allow_private)]
        return targets[:MAX_PUNCH_ADDRS]

    async def _reverse(self, peer: ID, targets: list[Multiaddr] | None = None) -> tuple[INetConn | None, int]:
        """Dial the peer's public addresses (``targets``, else :meth:`_reverse_targets`) directly (it may
        be public or port-mapped): the connection, and how many addresses there were to dial."""
        targets = self._reverse_targets(peer) if targets is None else targets
        for addr in targets:
            with trio.move_on_after(self.config.dial_timeout):
                try:
                    return await self._node.network.dial_addr(without_peer_id(addr), peer), len(targets)
                except Exception:
                    continue
        return None, len(targets)

    async def _punch_round(self, peer: ID, relayed: INetConn,
                           reverse: Callable[[], Awaitable[INetConn | None]]) -> INetConn | None:
        """CONNECT and SYNC over ``relayed``, then two dials at once, the first to get a direct
        connection winning: the punch (ours to the addresses the peer offered, half a round trip after
        SYNC) and ``reverse`` (the upgrade's late reversal, a connection if it went direct). The
        reversal does not delay the punch: an address identify told us may be filtered, and its dial
        then waits out the dial timeout."""
        # lazily: CONNECT rides with the protocol proposal (a relayed round trip saved)
        stream = await self._node.new_stream_on(relayed, PROTOCOL, lazy=True)
        try:
            with trio.fail_after(self.config.dial_timeout * 2):
                sent = trio.current_time()
                await write_message(stream, pb.HolePunch(type=pb.HolePunch.CONNECT, ObsAddrs=self._offer()))
                reply = await read_message(stream, pb.HolePunch)
                rtt = trio.current_time() - sent
                if reply.type != pb.HolePunch.CONNECT:
                    raise RemoteProtocolError("expected CONNECT")
                theirs = [a for a in decode_addrs(reply.ObsAddrs, limit=MAX_PUNCH_ADDRS) if reachable_tcp(a, allow_private=self.config.allow_private)]
                await write_message(stream, pb.HolePunch(type=pb.HolePunch.SYNC))
        finally:
            await finish_quietly(stream.close)
        synced = trio.current_time()
        won: list[INetConn] = []

        async def punch() -> None:
            await trio.sleep_until(synced + rtt / 2)
            direct = await self._dial_any(peer, theirs, responder=True, rtt=rtt)
            if direct is None:
                # The peer's SYN may have reached our listener first (a NAT that filters by
                # mapping only, a mapped port): then the punched connection came in, and our
                # own connect found the address pair taken.
                inbound = next((c for c in self._node.network.get_connections(peer) if not is_relayed_conn(c)), None)
                if inbound is not None:
                    direct = await self._proven(peer, inbound)
            if direct is not None:
                won.append(direct)
                race.cancel_scope.cancel()

        async def reversal() -> None:
            direct = await reverse()
            if direct is not None:
                won.append(direct)
                race.cancel_scope.cancel()

        async with trio.open_nursery() as race:
            race.start_soon(reversal)
            if theirs:
                race.start_soon(punch)
        if won:
            return won[0]
        if not theirs:
            raise NoAddressToPunch(f"{peer} offered no public address to punch to")
        return None

    # ---------------------------------------------------------------- the outbound side (A) answers

    async def _on_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:  # each exchange makes us dial: a peer gets a few a second (p2p/resources.py)
            self._node.resources.allow("dcutr", str(peer), trio.current_time())
        except ResourceLimitExceeded as e:
            log.info("DCUtR from %s refused: %s", peer, e)
            await finish_quietly(stream.reset)
            return
        try:
            first = await read_message(stream, pb.HolePunch)
            if first.type != pb.HolePunch.CONNECT:
                raise RemoteProtocolError("expected CONNECT")
            theirs = [a for a in decode_addrs(first.ObsAddrs, limit=MAX_PUNCH_ADDRS) if reachable_tcp(a, allow_private=self.config.allow_private)]
            await write_message(stream, pb.HolePunch(type=pb.HolePunch.CONNECT, ObsAddrs=self._offer()))
            sync = await read_message(stream, pb.HolePunch)
            if sync.type != pb.HolePunch.SYNC:
                raise RemoteProtocolError("expected SYNC")
        except RemoteProtocolError as e:
            log.info("bad DCUtR exchange with %s: %s", peer, e)
            await finish_quietly(stream.reset)
            return
        await finish_quietly(stream.close)
        if not theirs:
            self.stats.outcomes[("receiver", 1, "no_suitable_address")] += 1
            return
        conn = await self._dial_any(peer, theirs, responder=False)
        self.stats.outcomes[("receiver", 1, "success" if conn is not None else "failed")] += 1

    # ---------------------------------------------------------------- dialing

    async def _dial_any(self, peer: ID, addrs: list[Multiaddr], *, responder: bool, rtt: float = 0.0) -> INetConn | None:
        """Dial every address at once from our listen port; the first connection that works wins.

        ``responder``: we lead the upgrade, so on a simultaneous open we answer the
        handshake; ``rtt`` (the relayed round trip) tells how long to wait for the
        peer to speak before taking it for a listener (:func:`p2p.dialer.dial_simultaneous`).
        """
        network = self._node.network
        won: list[INetConn] = []

        async def one(addr: Multiaddr) -> None:
            source = self._node.listen_source(addr)
            try:
                if responder:
                    conn = await dial_simultaneous(network, without_peer_id(addr), peer, source=source,
                                                   listener_after=max(0.5, 2 * rtt))
                else:
                    conn = await network.dial_addr(without_peer_id(addr), peer, source=source)
            except Exception as e:
                log.debug("punch dial to %s failed: %s", addr, e)
                return
            if is_relayed_conn(conn):
                return  # the swarm's relayed connection: nothing was punched
            if won:  # lost a photo finish: one direct connection is enough
                await finish_quietly(conn.close, shield=True)  # the winner is cancelling us
                return
            won.append(conn)
            nursery.cancel_scope.cancel()

        with trio.move_on_after(self.config.dial_timeout):
            async with trio.open_nursery() as nursery:
                for addr in addrs:
                    nursery.start_soon(one, addr)
        if not won:
            return None
        return await self._proven(peer, won[0])

    async def _proven(self, peer: ID, conn: INetConn) -> INetConn | None:
        """``conn`` if a ping goes through on the direct connection itself; closed otherwise."""
        try:
            with trio.fail_after(self.config.dial_timeout):
                stream = await self._node.new_stream_on(conn, "/ipfs/ping/1.0.0")
                payload = bytes(32)
                await stream.write(payload)
                echoed = b""
                while len(echoed) < len(payload):
                    echoed += await stream.read(len(payload) - len(echoed))
                await finish_quietly(stream.close)
        except Exception as e:
            log.info("punched connection to %s at %s does not carry traffic: %s", peer, remote_addr(conn), e)
            await finish_quietly(conn.close)
            return None
        return conn

    async def _retire(self, relayed: INetConn) -> None:
        await trio.sleep(self.config.grace)
        with trio.move_on_after(self.config.drain):
            while relayed.get_streams() and not relayed.is_closed:
                await trio.sleep(0.25)
        await finish_quietly(relayed.close)
