"""The expert client's decisions, per server, as one pure table (sans-I/O).

:class:`CallTable` is what the client knows of each server: its calls in
flight (slots) and those waiting for one, the streams kept between calls, the
calls waiting together for a busy server (joined), and which experts are left
out of searches (bans). Every method is a decision or an update, with the time
(``now``) passed in where it matters; nothing here waits, reads a clock or
touches a socket. :class:`~.client.ExpertClient` is its shell: it opens,
writes, reads and resets streams, waits on trio, and tells the table what
happened. Streams, waiters and joined calls' payloads are opaque here.

Each rule came from an incident in minute-long runs; ``tests/test_moe_calls.py``
replays each in milliseconds:

1. A stream per call cost a protocol negotiation each and tripped the server's
   stream rate (~250 calls/s): streams are kept between calls, newest first
   (:meth:`CallTable.take_stream`, :meth:`CallTable.keep`).
2. More calls in flight than the server's resource manager lets one peer open
   (128 streams per peer and protocol) were refused: at most
   ``max_streams_per_server`` in flight; the rest wait their turn, first come
   first served (:meth:`CallTable.acquire`, :meth:`CallTable.release`).
3. Streams taken out of use (too old, or more than ``max_idle_streams``) were
   closed, and a close cut short under load left the server holding them for
   its idle timeout: they are handed back to be reset (:meth:`CallTable.reset_next`).
4. A long ban of every busy expert of a small grid emptied it: an expert that
   said it was overloaded, or whose node refused the stream over a limit, is
   left out ``overload_ban_time``; one that failed otherwise ``ban_time``
   (:meth:`CallTable.ban`). A killed server's experts stayed in the searches
   until each had failed a call of its own, and took slots of the samples that
   chose them: a call that could not reach its server at all (no connection)
   leaves out every expert of that server.
5. A wrong answer's stream was kept for the next call: only a stream whose
   answer was read whole and accepted is kept (the shell calls :meth:`keep`
   only then; the table never keeps a stream it was not given back).
6. A far server's calls were capped by its streams (Little's law): calls that
   find every slot in use join those waiting for the same server and kind, and
   go as one exchange in the next free slot (:meth:`CallTable.joins`,
   :meth:`CallTable.join`), up to ``max_rows`` rows, 1024 experts and the
   server's request header.
7. Joined requests of 1-4 MB waited a round trip per stream window at 200 ms:
   a joined exchange carries at most ``max_join_bytes`` of tensors.
8. A fresh stream reset before any answer byte failed a forward that could
   simply be asked again: a forward or info is tried once more on a new
   stream, a backward never (the server may have applied it); a kept stream
   the server closed meanwhile is always replaced (:func:`new_stream_tries`).
   (A joined exchange cancelled by the client closing left its callers
   waiting: the shell tells them at once.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from libp2p.peer.id import ID

from p2p.errors import ConfigError

from .protocol import MAX_EXPERTS, MAX_REQUEST_HEADER, ExpertCallError, Kind, KindValue

S = TypeVar("S")  # a stream
W = TypeVar("W")  # a call waiting for a slot
P = TypeVar("P")  # what a joined call carries

#: Bans remembered at most (a client of a huge swarm forgets the oldest). A server is forgotten as soon as
#: the table holds nothing for it.
MAX_BANS = 100_000


@dataclass
class ClientConfig:
    #: Time for one forward call (search excluded: the layer bounds the whole).
    forward_timeout: float = 10.0
    #: Time for one backward call.
    backward_timeout: float = 20.0
    #: Send and receive float16 (half the bytes; the expert computes in float32).
    half: bool = False
    #: An expert whose call failed is left out of searches this long (one that said it was overloaded:
    #: overload_ban_time).
    ban_time: float = 30.0
    overload_ban_time: float = 1.0
    #: Most rows the client sends in one call (the server's limit: keep them equal).
    max_rows: int = 4096
    #: Most tensor bytes of calls joined into one exchange (see :meth:`ExpertClient.call_many`): one
    #: stream window. At 200 ms one-way, joined exchanges of 1-4 MB took 5-12 s to write and the calls
    #: in them 7-11 s, against 1.1-1.6 s for the others (bench/moe_latency.py); likely, not measured
    #: directly, because yamux opens each stream at 256 KiB and grows it only within the connection's
    #: budget, which its streams share, so a larger request waits a round trip per window.
    max_join_bytes: int = 256 * 1024
    #: Calls in flight to one server at once; more wait here for a free one. A server's resource
    #: manager refuses more than 128 inbound streams per peer and protocol (its default
    #: ``max_inbound_streams_per_peer_protocol``), and counts those a caller gave up on (reset) until
    #: the reset arrives: a stream is either in a call or kept, so the two together never exceed this
    #: (a new stream is opened only when every kept one is in use), half the server's limit.
    max_streams_per_server: int = 64
    #: Streams kept open per server between calls (at most max_streams_per_server), and for how long at
    #: most (below the server's idle_timeout). Keep them all: a new stream costs a round trip (its
    #: protocol's negotiation) before the request, which at 200 ms one-way was a third of the throughput.
    max_idle_streams: int = 64
    keep_streams_for: float = 30.0
    #: Most worker threads :meth:`ExpertClient.run` keeps at once: asynchronous trainers keep many
    #: batches in flight to hide the swarm's latency (Learning@home 3.2), more than trio's default 40.
    max_threads: int = 128

    def validate(self) -> None:
        for name in ("forward_timeout", "backward_timeout", "ban_time", "overload_ban_time", "keep_streams_for"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"expert client: {name} must be positive, got {getattr(self, name)}")
        for name in ("max_rows", "max_threads", "max_streams_per_server", "max_idle_streams", "max_join_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"expert client: {name} must be at least 1, got {getattr(self, name)}")
        if self.max_idle_streams > self.max_streams_per_server:
            raise ConfigError("expert client: max_idle_streams cannot exceed max_streams_per_server")


def new_stream_tries(kind: KindValue) -> int:
    """Tries of a call on new streams that end before any answer byte (rule 8): a forward or an info
    is pure and asked twice; a backward once (the server may have applied its gradients)."""
    return 1 if kind == Kind.BACKWARD else 2


@dataclass(eq=False)
class Joined(Generic[P]):
    """Calls to one busy server that wait together for its next free slot, to go as one exchange."""

    kind: KindValue
    #: the latest of its callers' deadlines (it starts with its first caller's)
    deadline: float
    #: each call's payload, in the order they joined
    items: list[P] = field(default_factory=list)
    experts: int = 0
    rows: int = 0
    #: its tensors' bytes, and most bytes its request's uids and rows take
    size: int = 0
    header: int = 0


@dataclass(eq=False)
class _Server(Generic[S, W, P]):
    #: calls in flight (holding a slot), and those waiting for one, first come first served
    busy: int = 0
    queue: deque[W] = field(default_factory=deque)
    #: streams kept between calls, with the time each was given back (newest last)
    kept: list[tuple[S, float]] = field(default_factory=list)
    #: the calls waiting together for a slot, per kind
    waiting: dict[KindValue, Joined[P]] = field(default_factory=dict)

    def idle(self) -> bool:
        return not (self.busy or self.queue or self.kept or self.waiting)


class CallTable(Generic[S, W, P]):
    """The client's state per server and its decisions; see the module docstring."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._servers: dict[ID, _Server[S, W, P]] = {}
        #: (uid, server) -> when the expert is back; (None, server): every expert of an unreachable server
        self._bans: dict[tuple[str | None, ID], float] = {}
        #: streams taken out of use since the shell last asked (rule 3)
        self._reset: list[S] = []

    def _server(self, server: ID) -> _Server[S, W, P]:
        entry = self._servers.get(server)
        if entry is None:
            entry = self._servers[server] = _Server()
        return entry

    def _forget_if_idle(self, server: ID, entry: _Server[S, W, P]) -> None:
        if entry.idle():
            del self._servers[server]

    def servers(self) -> int:
        """Servers the table holds anything for."""
        return len(self._servers)

    # ------------------------------------------------------------------ slots (rule 2)

    def acquire(self, server: ID, waiter: W) -> bool:
        """A slot for one call to ``server``: True when it has one now; else ``waiter`` waits in line
        (behind any earlier one) until :meth:`release` hands it a slot."""
        entry = self._server(server)
        if entry.busy < self.config.max_streams_per_server and not entry.queue:
            entry.busy += 1
            return True
        entry.queue.append(waiter)
        return False

    def withdraw(self, server: ID, waiter: W) -> bool:
        """``waiter`` gives up: True when it was still in line (it holds no slot); False when it holds
        one, which it must :meth:`release`."""
        entry = self._servers.get(server)
        if entry is None:
            return False
        for i, queued in enumerate(entry.queue):
            if queued is waiter:
                del entry.queue[i]
                return True
        return False

    def release(self, server: ID) -> W | None:
        """A call gives its slot back: the waiter it passes to (to be woken), or None."""
        entry = self._servers[server]
        if entry.queue:
            return entry.queue.popleft()
        entry.busy -= 1
        self._forget_if_idle(server, entry)
        return None

    def in_flight(self, server: ID) -> int:
        entry = self._servers.get(server)
        return 0 if entry is None else entry.busy

    # ------------------------------------------------------------------ joined calls (rules 6, 7)

    def joins(self, server: ID, kind: KindValue) -> bool:
        """Whether a call of several experts to ``server`` joins the calls waiting for it rather than
        asking for a slot of its own: every slot is in use, or calls of its kind already wait (they
        go first)."""
        entry = self._servers.get(server)
        return entry is not None and (entry.busy >= self.config.max_streams_per_server or kind in entry.waiting)

    def join(self, server: ID, kind: KindValue, item: P, *, experts: int, rows: int, size: int, header: int,
             deadline: float) -> tuple[Joined[P], int, bool]:
        """Add a call (``experts`` experts, ``rows`` rows, ``size`` bytes of tensors, ``header`` bytes of
        uids) to the group waiting for ``server``: that group, the index of the call's first expert in
        it, and whether the group is new (a new one starts when there is none, or the call would take
        it over ``max_rows``, ``max_join_bytes``, 1024 experts or the server's request header; the
        shell then sends it when it gets a slot)."""
        entry = self._server(server)
        group = entry.waiting.get(kind)
        new = group is None or group.experts + experts > MAX_EXPERTS \
            or group.rows + rows > self.config.max_rows \
            or group.size + size > self.config.max_join_bytes \
            or group.header + header > MAX_REQUEST_HEADER - 64
        if group is None or new:
            group = entry.waiting[kind] = Joined(kind, deadline)
        first = group.experts
        group.items.append(item)
        group.experts += experts
        group.rows += rows
        group.size += size
        group.header += header
        group.deadline = max(group.deadline, deadline)
        return group, first, new

    def sending(self, server: ID, group: Joined[P]) -> None:
        """``group`` has its slot (or ended): no more calls join it."""
        entry = self._servers.get(server)
        if entry is not None and entry.waiting.get(group.kind) is group:
            del entry.waiting[group.kind]
            self._forget_if_idle(server, entry)

    # ------------------------------------------------------------------ kept streams (rules 1, 3, 5)

    def take_stream(self, server: ID, now: float) -> S | None:
        """The newest stream kept for ``server`` and idle for less than ``keep_streams_for``, or None;
        older ones are taken out of use (:meth:`reset_next`)."""
        entry = self._servers.get(server)
        if entry is None:
            return None
        found: S | None = None
        while entry.kept and found is None:
            stream, since = entry.kept.pop()
            if now - since < self.config.keep_streams_for:
                found = stream
            else:
                self._reset.append(stream)
        self._forget_if_idle(server, entry)
        return found

    def keep(self, server: ID, stream: S, now: float) -> None:
        """A stream whose answer was read whole and accepted, kept for the next call (beyond
        ``max_idle_streams``: taken out of use)."""
        entry = self._server(server)
        if len(entry.kept) < self.config.max_idle_streams:
            entry.kept.append((stream, now))
        else:
            self._reset.append(stream)

    def reset_next(self) -> S | None:
        """One stream taken out of use (to reset, not close: see rule 3), or None when none is left."""
        return self._reset.pop() if self._reset else None

    def close(self) -> list[S]:
        """The client closes: every stream kept or taken out of use, to reset."""
        for entry in self._servers.values():
            self._reset.extend(stream for stream, _ in entry.kept)
            entry.kept.clear()
        self._servers = {p: s for p, s in self._servers.items() if not s.idle()}
        out, self._reset = self._reset, []
        return out

    # ------------------------------------------------------------------ bans (rule 4)

    def ban(self, uid: str, server: ID, error: ExpertCallError, now: float) -> float:
        """Leave the expert out of searches after ``error`` (every expert of ``server`` when it was
        unreachable): the seconds it is left out."""
        if len(self._bans) >= MAX_BANS:  # forget the oldest half
            for key in sorted(self._bans, key=self._bans.__getitem__)[:MAX_BANS // 2]:
                del self._bans[key]
        seconds = self.config.overload_ban_time if error.busy else self.config.ban_time
        self._bans[(uid, server)] = now + seconds
        if error.unreachable:
            self._bans[(None, server)] = now + seconds
        return seconds

    def banned(self, uid: str, server: ID, now: float) -> bool:
        return self.ban_left(uid, server, now) > 0

    def ban_left(self, uid: str, server: ID, now: float) -> float:
        """Seconds until the expert is back in searches (0 when it is not left out): its own ban's
        or its server's, the later."""
        return max(self._left((uid, server), now), self._left((None, server), now))

    def unreachable(self, server: ID, now: float) -> bool:
        """Whether every expert of ``server`` is left out now (a call found no connection to it)."""
        return self._left((None, server), now) > 0

    def _left(self, key: tuple[str | None, ID], now: float) -> float:
        until = self._bans.get(key)
        if until is None:
            return 0.0
        if until <= now:
            del self._bans[key]
            return 0.0
        return until - now


__all__ = ["CallTable", "ClientConfig", "Joined", "new_stream_tries"]
