"""p2p/errors.py: the one hierarchy of dedloc's errors, and the two helpers that see through
py-libp2p's wrappers (``cause_of``, ``describe``)."""

from __future__ import annotations

import pytest

from p2p.errors import (AddressError, BootstrapError, ConfigError, DedlocError, DialBackoffError, DialError,
                        IdentityError, ProtocolNotSupportedError, RemoteProtocolError, StreamBrokenError,
                        StreamOpenError, cause_of, describe)


def chained(*errors: BaseException, implicit: bool = False) -> BaseException:
    """``errors[0]`` raised from ``errors[1]``, raised from ``errors[2]``...; by ``__context__``
    (an error raised while handling another) instead of ``__cause__`` when ``implicit``."""
    for outer, inner in zip(errors, errors[1:]):
        if implicit:
            outer.__context__ = inner
        else:
            outer.__cause__ = inner
    return errors[0]


def test_dial_error_lists_each_address_and_why() -> None:
    e = DialError("could not reach peer X", [("/ip4/1.2.3.4/tcp/1", "refused"), ("/ip4/5.6.7.8/tcp/2", "timed out")])
    assert str(e) == "could not reach peer X\n  /ip4/1.2.3.4/tcp/1: refused\n  /ip4/5.6.7.8/tcp/2: timed out"
    assert e.attempts == [("/ip4/1.2.3.4/tcp/1", "refused"), ("/ip4/5.6.7.8/tcp/2", "timed out")]
    bare = DialError("no addresses")
    assert str(bare) == "no addresses" and bare.attempts == []


@pytest.mark.parametrize(("kind", "bases"), [
    (ConfigError, (DedlocError, ValueError)),
    (AddressError, (ConfigError,)),
    (IdentityError, (DedlocError,)),
    (DialError, (DedlocError, ConnectionError)),
    (DialBackoffError, (DialError,)),
    (BootstrapError, (DialError,)),
    (ProtocolNotSupportedError, (DedlocError,)),
    (StreamOpenError, (DedlocError, ConnectionError)),
    (StreamBrokenError, (DedlocError, OSError)),
    (RemoteProtocolError, (DedlocError,)),
])
def test_each_error_is_what_its_callers_catch(kind: type[Exception], bases: tuple[type[Exception], ...]) -> None:
    """A ValueError for bad settings, an OSError for broken transports, all DedlocErrors."""
    assert all(issubclass(kind, base) for base in bases)
    assert issubclass(kind, DedlocError)


def test_cause_of_finds_the_error_itself_or_a_cause_within_depth() -> None:
    inner = RemoteProtocolError("garbled")
    assert cause_of(inner, RemoteProtocolError, 1) is inner
    two = chained(RuntimeError("wrapper"), inner)
    assert cause_of(two, RemoteProtocolError, 1) is None  # looks at the error alone
    assert cause_of(two, RemoteProtocolError, 2) is inner
    three = chained(OSError("outer"), RuntimeError("wrapper"), inner)
    assert cause_of(three, RemoteProtocolError, 2) is None
    assert cause_of(three, RemoteProtocolError, 3) is inner
    assert cause_of(three, RemoteProtocolError, 0) is None


def test_cause_of_follows_the_context_where_there_is_no_cause() -> None:
    inner = DialError("no route")
    outer = chained(RuntimeError("while handling it"), inner, implicit=True)
    assert cause_of(outer, DialError, 2) is inner


def test_cause_of_prefers_the_explicit_cause_to_the_context() -> None:
    cause, context = DialError("the cause"), StreamOpenError("the context")
    outer = RuntimeError("outer")
    outer.__cause__, outer.__context__ = cause, context
    assert cause_of(outer, DedlocError, 2) is cause


def test_cause_of_stops_at_the_end_of_the_chain() -> None:
    assert cause_of(chained(RuntimeError("a"), ValueError("b")), DialError, 10) is None


def test_cause_of_returns_the_first_match_from_the_outside() -> None:
    outer, inner = DialError("outer"), DialError("inner")
    assert cause_of(chained(outer, inner), DialError, 2) is outer


def test_describe_names_the_type_and_message() -> None:
    assert describe(DialError("no route")) == "DialError: no route"
    assert describe(chained(DialError("no route"), OSError("ignored: it has its own message"))) == "DialError: no route"


def test_describe_adds_the_cause_where_the_wrapper_says_nothing() -> None:
    """py-libp2p's StreamReset() has no message; the Yamux error under it says who reset the stream."""
    reset = chained(RuntimeError(), ConnectionResetError("stream 3 was reset by Qm..."))
    assert describe(reset) == "RuntimeError: (ConnectionResetError: stream 3 was reset by Qm...)"
    implicit = chained(RuntimeError(), EOFError("the connection ended"), implicit=True)
    assert describe(implicit) == "RuntimeError: (EOFError: the connection ended)"
    assert describe(RuntimeError()) == "RuntimeError: "
