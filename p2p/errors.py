"""The exceptions a dedloc node raises to its caller.

One hierarchy, so an app embedding the node can catch :class:`DedlocError` at its
edge and show the message: every message says what went wrong *and* what to do.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)

#: How the gate's refusal of a stream begins (the reason follows): what the opener recognises.
UNAUTHENTICATED = "unauthenticated: "

#: What a peer without a pass is told when a closed swarm (p2p/auth.py) refuses it (the CLI's flags; the Python API's
#: ``nat.AuthSettings`` has the same three).
CLOSED_SWARM_HINT = ("it admits only holders of an access pass: ask its operator to add you "
                     "(`dedloc authority add NAME`), then join with --authority KEY --username NAME --secret-file FILE")


class DedlocError(Exception):
    """Base class of every error dedloc raises on purpose."""


class ConfigError(DedlocError, ValueError):
    """A setting or argument cannot be used as given."""


class AddressError(ConfigError):
    """A multiaddr is malformed or cannot be used for what it was given for."""


class IdentityError(DedlocError):
    """The identity file is missing, unreadable, insecure or not an Ed25519 key."""


class DialError(DedlocError, ConnectionError):
    """No connection could be opened to a peer; ``attempts`` says why per address."""

    def __init__(self, message: str, attempts: list[tuple[str, str]] | None = None):
        self.attempts = attempts or []
        detail = "".join(f"\n  {addr}: {why}" for addr, why in self.attempts)
        super().__init__(message + detail)


class ProtocolNotSupportedError(DedlocError):
    """The peer answered, but speaks none of the protocols asked for."""


class StreamOpenError(DedlocError, ConnectionError):
    """A stream could not be opened on an existing connection."""


class StreamBrokenError(DedlocError, ConnectionError):
    """A stream was reset, or its connection ended, in the middle of an exchange (py-libp2p's own
    ``StreamReset``/``StreamClosed`` under it: neither a DedlocError nor an OSError, so a caller that
    catches those would let it end the task)."""


class DialBackoffError(DialError):
    """Every address of the peer failed lately and waits out its backoff (``p2p/dial_backoff.py``):
    nothing was dialed. ``attempts`` says, per address, for how long more."""


class BootstrapError(DialError):
    """None of the configured initial peers could be reached."""


class RemoteProtocolError(DedlocError):
    """A peer broke a protocol: its message was oversized, garbled, unexpected or late.

    The one base of every peer fault (h11's ``RemoteProtocolError`` idea), so
    that callers can tell a faulty or hostile peer (leave it out, try another)
    from a broken local setup (a :class:`ConfigError`, a missing route).
    """


def cause_of(error: BaseException, kind: type[E], depth: int) -> E | None:
    """``error`` or the first of its causes (or contexts), ``depth`` looked at in all, that is a
    ``kind``: py-libp2p wraps our errors, once or twice, in its own bare ones."""
    seen: BaseException | None = error
    for _ in range(depth):
        if seen is None:
            return None
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def describe(e: BaseException) -> str:
    """``Type: message``, with the cause's message where py-libp2p's wrapper has none of its own (its
    ``StreamReset()`` says nothing; the Yamux error under it says who reset the stream, or that the
    connection ended, and why)."""
    text = f"{type(e).__name__}: {e}"
    cause = e.__cause__ or e.__context__
    if not str(e) and cause is not None:
        text += f"({type(cause).__name__}: {cause})"
    return text
