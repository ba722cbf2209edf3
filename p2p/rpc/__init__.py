"""RPC over libp2p streams: protobuf messages, unary and streaming calls, deadlines.

The DHT, all-reduce and training talk to peers through this layer::

    rpc.add_unary("dht.find", FindRequest, find)      # async find(req, ctx) -> FindResponse
    resp = await rpc.call(peer_id, "dht.find", FindRequest(...), FindResponse, timeout=5.0)

    async with rpc.open_stream_call(peer_id, "avg.part", PartResponse, timeout=10.0) as call:
        await call.send(PartRequest(...))
        await call.done_sending()
        async for resp in call:
            ...

Each call has a deadline, enforced on both sides; failures are typed (see
:mod:`p2p.rpc.errors`). A stream carries one call at a time and is reused for
the next call to the same peer, which saves py-libp2p's two-round-trip stream
opening on most calls.

Wire format: p2p/rpc/rpc.proto. After editing it, regenerate the checked-in
code from the repository root with::

    python -m grpc_tools.protoc -I. --python_out=. --mypy_out=. p2p/rpc/rpc.proto
"""

from .client import StreamCall
from .endpoint import RPC_PROTOCOL, OpenStream, Rpc
from .errors import (
    FIRST_APPLICATION_CODE,
    DeadlineExceededError,
    ErrorCode,
    HandlerError,
    InvalidMessageError,
    MessageTooLargeError,
    PeerDisconnectedError,
    PeerUnreachableError,
    RemoteError,
    ResourceLimitError,
    RpcError,
    RpcTimeoutError,
    UnknownMethodError,
)
from .server import CallContext
from .stream import RpcStream

__all__ = [
    "FIRST_APPLICATION_CODE",
    "RPC_PROTOCOL",
    "CallContext",
    "DeadlineExceededError",
    "ErrorCode",
    "HandlerError",
    "InvalidMessageError",
    "MessageTooLargeError",
    "OpenStream",
    "PeerDisconnectedError",
    "PeerUnreachableError",
    "RemoteError",
    "ResourceLimitError",
    "Rpc",
    "RpcError",
    "RpcStream",
    "RpcTimeoutError",
    "StreamCall",
    "UnknownMethodError",
]
