"""What an RPC call can fail with, and how failures cross the wire.

Callers usually catch :class:`RpcError` ("this peer did not serve me") and look
closer only where it changes what they do next: :class:`PeerUnreachableError`
means the request never left this machine, so retrying elsewhere is safe even
for calls that are not idempotent; :class:`RemoteError` carries the code the
peer sent.

Codes 1-99 belong to the RPC layer (:class:`ErrorCode`); applications define
their own error types with codes from :data:`FIRST_APPLICATION_CODE` up and
register them with :meth:`p2p.rpc.Rpc.register_error` so that callers get the
same type back.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from types import MappingProxyType
from libp2p.peer.id import ID

from ..errors import DedlocError

#: Handlers may send codes from here up; lower ones would be mistaken for the RPC layer's.
FIRST_APPLICATION_CODE = 100


class ErrorCode(IntEnum):
    """Codes of the errors the RPC layer itself reports (see rpc.proto)."""

    UNKNOWN = 0
    UNKNOWN_METHOD = 1
    DEADLINE_EXCEEDED = 2
    MESSAGE_TOO_LARGE = 3
    INVALID_MESSAGE = 4
    HANDLER_ERROR = 5
    RESOURCE_LIMIT = 6


class RpcError(DedlocError):
    """Base class of every RPC failure."""


class RemoteError(RpcError):
    """A failure with a wire code: sent by the peer, or found in what the peer sent.

    ``peer_id`` is the peer the error came from, None when it was raised on this
    machine (by a handler, or by the codec rejecting the peer's bytes).
    Subclasses fix ``code``; an application error type looks like::

        class NotFound(RemoteError):
            code = FIRST_APPLICATION_CODE
    """

    code: int = ErrorCode.UNKNOWN

    def __init__(self, message: str = "", *, code: int | None = None, peer_id: ID | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            # Shadows the class default for codes no registered type claims.
            self.code = code
        self.peer_id = peer_id

    def __str__(self) -> str:
        origin = f" from {self.peer_id}" if self.peer_id is not None else ""
        return f"{self.message} (code {self.code}{origin})"


class UnknownMethodError(RemoteError):
    """The peer serves no method of that name."""

    code = ErrorCode.UNKNOWN_METHOD


class DeadlineExceededError(RemoteError):
    """The peer gave up on the call when its deadline passed."""

    code = ErrorCode.DEADLINE_EXCEEDED


class MessageTooLargeError(RemoteError):
    """A message was over ``max_message_size`` (ours or the peer's); it was not buffered."""

    code = ErrorCode.MESSAGE_TOO_LARGE


class InvalidMessageError(RemoteError):
    """Bytes that do not decode as the protocol or the method's message type."""

    code = ErrorCode.INVALID_MESSAGE


class HandlerError(RemoteError):
    """The peer's handler raised; ``message`` names the exception, never its traceback."""

    code = ErrorCode.HANDLER_ERROR


class ResourceLimitError(RemoteError):
    """The peer refused the call: this caller (or all callers together) is over one of its
    limits, named in ``message`` (``dht.find refused: over the limit of 200 dht requests a
    second per peer``). Retrying later, or elsewhere, may succeed."""

    code = ErrorCode.RESOURCE_LIMIT


class RpcTimeoutError(RpcError, TimeoutError):
    """The call's deadline passed on this side before the peer answered."""


class PeerDisconnectedError(RpcError):
    """The stream broke (reset, closed, connection lost) before the call ended."""


class PeerUnreachableError(PeerDisconnectedError):
    """No stream could be opened to the peer: the request was never sent."""


#: The RPC layer's own error types by code; each Rpc's registry starts from a copy.
BUILTIN_ERRORS: Mapping[int, type[RemoteError]] = MappingProxyType({
    cls.code: cls
    for cls in (UnknownMethodError, DeadlineExceededError, MessageTooLargeError, InvalidMessageError, HandlerError,
                ResourceLimitError)
})
