"""Idle client streams kept per peer, so that most calls skip opening a stream.

Opening a py-libp2p stream costs two round trips of multistream-select and
about 6 ms of CPU (0.8.1, loopback); a call on an open stream costs one round
trip. A stream returns here only after a call that ended cleanly in both
directions, and is used for one call at a time.
"""

from __future__ import annotations

import trio
from libp2p.peer.id import ID

from .stream import FramedStream


class StreamPool:
    """The idle streams to each peer, freshest last; owned by one :class:`Rpc`."""

    def __init__(self, *, idle_timeout: float, max_idle_per_peer: int):
        self.idle_timeout = idle_timeout
        self.max_idle_per_peer = max_idle_per_peer
        self._idle: dict[ID, list[tuple[FramedStream, float]]] = {}

    def __len__(self) -> int:
        return sum(map(len, self._idle.values()))

    async def take(self, peer_id: ID) -> FramedStream | None:
        """The freshest idle stream to ``peer_id``, closing those idle too long."""
        idle = self._idle.get(peer_id)
        if not idle:
            return None
        limit = trio.current_time() - self.idle_timeout
        taken: FramedStream | None = None
        if idle[-1][1] > limit:
            taken = idle.pop()[0]
        stale = [framed for framed, since in idle if since <= limit]
        if stale:
            idle[:] = [(framed, since) for framed, since in idle if since > limit]
        if not idle:
            del self._idle[peer_id]
        for framed in stale:
            await framed.close()
        return taken

    def give(self, framed: FramedStream) -> bool:
        """Keep ``framed`` for the next call to its peer; False if it must be closed instead."""
        if not framed.reusable or self.idle_timeout <= 0:
            return False
        idle = self._idle.setdefault(framed.peer_id, [])
        if len(idle) >= self.max_idle_per_peer:
            return False
        idle.append((framed, trio.current_time()))
        return True

    def forget(self, peer_id: ID) -> None:
        """Drop the idle streams to ``peer_id`` without a word: its connection is gone."""
        self._idle.pop(peer_id, None)

    async def close(self, *, expired_only: bool) -> None:
        limit = trio.current_time() - self.idle_timeout
        closing: list[FramedStream] = []
        for peer_id in list(self._idle):
            idle = self._idle[peer_id]
            closing += [framed for framed, since in idle if not expired_only or since <= limit]
            idle[:] = [(framed, since) for framed, since in idle if expired_only and since > limit]
            if not idle:
                del self._idle[peer_id]
        for framed in closing:
            await framed.close()
