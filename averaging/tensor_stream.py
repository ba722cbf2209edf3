"""Torch tensors over a byte stream: a small protobuf header, then their raw bytes.

The all-reduce moves tensors of up to hundreds of megabytes between peers, so
the bytes are not wrapped in protobuf (which builds and parses a message in one
piece, at the cost of a copy each way). Instead::

    uvarint(len(header))  TensorsHeader  bytes(tensor 0)  bytes(tensor 1) ...

(averaging/proto/tensor.proto has the details). The sender writes slices of
each tensor's own memory, ``chunk_size`` bytes at a time; the receiver
allocates every result once, or fills tensors the caller passes as ``out``,
and copies each chunk it reads straight into place. That is one copy per side
on top of what the stream does, and nothing is ever accumulated.

The receiver trusts nothing the peer declares. The header's length is checked
before the header is read, and every tensor's dtype, shape and byte count
before anything is allocated, against the caller's ``max_bytes`` and
``max_tensors``: a peer can make it hold at most ``max_bytes`` of tensors and
one read of data. The message describes its own end, so nothing past it is
read and the stream may carry more after it.

Failures raise subclasses of :class:`TensorStreamError`; the stream's own
(reset, broken connection) pass through as they are, except the end of the
stream, which becomes :class:`TruncatedTensorStreamError`. After any failure the
stream is out of step with the peer, and ``out`` tensors may be half written:
reset the stream rather than reuse it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from google.protobuf.message import DecodeError

from p2p.errors import DedlocError, RemoteProtocolError
from p2p.varint import LengthPrefix, VarintOverLimit, VarintTooLong, encode_varint

from .finite import tensor_finite
from .proto import tensor_pb2

DEFAULT_CHUNK_SIZE = 1 << 20
#: Most bytes asked for per read; a muxer returns what it has, up to this.
READ_SIZE = 1 << 20
#: Pieces below this (the header, small tensors) are joined into one write: one
#: copy of little data saves a muxer frame and an encryption per piece.
JOIN_LIMIT = 64 * 1024
#: Most dimensions a tensor may have on the wire (torch and numpy allow 64).
MAX_DIMS = 64
#: Most bytes one TensorInfo takes: its tag and length, the dtype, the shape's
#: tag and length, MAX_DIMS 10-byte dims, nbytes. Bounds the header by max_tensors.
MAX_INFO_SIZE = 3 + 11 + 3 + MAX_DIMS * 10 + 11

_TO_WIRE: dict[torch.dtype, tensor_pb2.DType.ValueType] = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float64: tensor_pb2.DTYPE_FLOAT64,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int8: tensor_pb2.DTYPE_INT8,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.bool: tensor_pb2.DTYPE_BOOL,
}
_FROM_WIRE: dict[int, torch.dtype] = {code: dtype for dtype, code in _TO_WIRE.items()}
SUPPORTED_DTYPES = tuple(_TO_WIRE)


class TensorStreamError(DedlocError):
    """Tensors could not be sent or received as asked."""


class UnsupportedTensorError(TensorStreamError, ValueError):
    """A tensor given to send, or as ``out``, is one this module cannot handle."""


class InvalidTensorHeaderError(TensorStreamError, RemoteProtocolError):
    """The peer's header is garbled or contradicts itself (dtype, shape, byte count)."""


class TensorLimitError(TensorStreamError, RemoteProtocolError):
    """The peer announced more than ``max_bytes`` or ``max_tensors`` allow."""


class TensorMismatchError(TensorStreamError, RemoteProtocolError):
    """The peer sent other tensors than the receiver expected (see ``out``)."""


class InvalidTensorDataError(TensorStreamError, RemoteProtocolError):
    """The peer's tensor bytes hold values the receiver refuses."""


class NonFiniteTensorError(InvalidTensorDataError):
    """A floating-point tensor holds NaN or Inf, and the receiver allows none."""


class TruncatedTensorStreamError(TensorStreamError, RemoteProtocolError):
    """The stream ended before the whole message arrived; the message says how far it got."""


class ReadStream(Protocol):
    """What :func:`receive_tensors` needs: py-libp2p's ``INetStream`` has it.

    ``read(n)`` returns at least one and at most ``n`` bytes, and ``b""`` or
    raises ``EOFError`` at the end of the stream.
    """

    async def read(self, n: int) -> bytes: ...


class WriteStream(Protocol):
    """What :func:`send_tensors` needs: py-libp2p's ``INetStream`` has it.

    ``write`` is handed memoryviews of tensor memory, which py-libp2p's muxers
    take like bytes (they slice the data and join it to a frame header); its
    stubs say ``bytes``, and so does this, to accept them. It must be done with
    the data when it returns, as a stream that copies or sends it is.
    """

    async def write(self, data: bytes) -> None: ...


@dataclass(frozen=True, slots=True)
class _Spec:
    """A tensor as its header announced it, checked."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int

    def __str__(self) -> str:
        return _describe(self.dtype, self.shape)


def _describe(dtype: torch.dtype, shape: Sequence[int]) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _check_host() -> None:
    if sys.byteorder != "little":
        raise UnsupportedTensorError("tensors travel little-endian; this big-endian host would have to byte-swap")


def _check_tensor(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedTensorError(f"{what} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.layout != torch.strided:
        raise UnsupportedTensorError(f"{what} is {tensor.layout}; convert it with .to_dense() first")
    if tensor.dtype not in _TO_WIRE:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise UnsupportedTensorError(f"{what} has dtype {tensor.dtype}, which cannot be sent; supported: {supported}")
    return tensor


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor: a writable view of its memory, no copy.

    The view keeps the tensor alive, and sees its later writes.

    Viewed as uint8 in torch first, since numpy has no bfloat16. (numpy's stubs
    declare the buffer protocol only on Python 3.12 and later, hence the cast.)
    """
    return memoryview(cast(bytes, tensor.detach().reshape(-1).view(torch.uint8).numpy()))


class _Writer:
    """Writes pieces in order, joining the small ones to write fewer, larger pieces."""

    def __init__(self, stream: WriteStream, join_limit: int):
        self._stream = stream
        self._join_limit = join_limit
        self._parts: list[bytes | memoryview] = []
        self._size = 0

    async def write(self, piece: bytes | memoryview) -> None:
        if self._size + len(piece) > self._join_limit:
            await self.flush()
        if len(piece) >= self._join_limit:
            await self._stream.write(cast(bytes, piece))
        else:
            self._parts.append(piece)
            self._size += len(piece)

    async def flush(self) -> None:
        if self._parts:
            data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
            self._parts.clear()
            self._size = 0
            await self._stream.write(cast(bytes, data))


async def send_tensors(
    stream: WriteStream, tensors: Sequence[torch.Tensor], *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> None:
    """Write ``tensors`` to ``stream`` as one message, in writes of at most ``chunk_size`` bytes.

    (Only a header longer than ``chunk_size`` is written whole.) Every tensor is
    checked before the first byte goes out. A tensor that is contiguous and on
    the CPU is written straight from its memory, so it must not change until
    this returns; any other is copied, one at a time, to make it so.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    _check_host()
    header = tensor_pb2.TensorsHeader()
    for i, tensor in enumerate(tensors):
        _check_tensor(tensor, f"tensor {i}")
        header.tensors.add(dtype=_TO_WIRE[tensor.dtype], shape=tensor.shape, nbytes=tensor.nbytes)
    body = header.SerializeToString()
    writer = _Writer(stream, min(chunk_size, JOIN_LIMIT))
    await writer.write(encode_varint(len(body)) + body)
    for tensor in tensors:
        # contiguous() before cpu(): on a GPU the copy is cheap, and the transfer then is one block.
        data = tensor_bytes(tensor.detach().resolve_neg().contiguous().cpu())
        for start in range(0, len(data), chunk_size):
            await writer.write(data[start : start + chunk_size])
    await writer.flush()


class _Collector:
    """A :class:`WriteStream` that keeps the pieces it is handed, to be joined before anything changes them."""

    def __init__(self, prefix: bytes) -> None:
        self.parts: list[bytes | memoryview] = [prefix]

    async def write(self, data: bytes) -> None:
        self.parts.append(data)


async def tensors_message(tensors: Sequence[torch.Tensor], *, prefix: bytes = b"") -> bytes:
    """``prefix`` and the message :func:`send_tensors` writes for ``tensors``, in one buffer (one copy).

    For a request or an answer and its tensors in one stream write: each write
    of a stream waits its turn on a busy connection (an expert client with 240
    exchanges in flight waited ~100 ms a write), and a frame, a tensor header
    and a body were three turns. Read it with :func:`receive_tensors` as usual.
    """
    collector = _Collector(prefix)
    await send_tensors(collector, tensors)  # nothing in it yields: the views stay valid until the join
    return b"".join(collector.parts)


async def send_tensor(stream: WriteStream, tensor: torch.Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
    """:func:`send_tensors` of just ``tensor``; read it with :func:`receive_tensor`."""
    await send_tensors(stream, [tensor], chunk_size=chunk_size)


async def _read(stream: ReadStream, n: int) -> bytes:
    try:
        return await stream.read(n)
    except EOFError:
        return b""


async def _fill(stream: ReadStream, view: memoryview) -> int:
    """Read into ``view`` until it is full or the stream ends; the bytes filled."""
    filled = 0
    while filled < len(view):
        want = min(len(view) - filled, READ_SIZE)
        data = await _read(stream, want)
        if not data:
            break
        if len(data) > want:
            raise RuntimeError(f"{type(stream).__name__}.read({want}) returned {len(data)} bytes, more than asked")
        view[filled : filled + len(data)] = data
        filled += len(data)
    return filled


async def _read_header(stream: ReadStream, max_tensors: int) -> tensor_pb2.TensorsHeader:
    limit = max_tensors * MAX_INFO_SIZE
    prefix = LengthPrefix(limit)
    size: int | None = None
    try:
        while size is None:
            byte = await _read(stream, 1)
            if not byte:
                where = "inside the header's length prefix" if prefix.started else "before the message"
                raise TruncatedTensorStreamError(f"the stream ended {where}")
            size = prefix.feed(byte[0])
    except VarintOverLimit as e:
        raise TensorLimitError(f"header of {'' if e.complete else 'at least '}{e.value} bytes announced, over the "
                               f"{limit} that max_tensors={max_tensors} allows") from None
    except VarintTooLong:
        raise InvalidTensorHeaderError("header length prefix longer than 10 bytes") from None
    body = bytearray(size)
    filled = await _fill(stream, memoryview(body))
    if filled < size:
        raise TruncatedTensorStreamError(f"the stream ended after {filled} of the header's {size} bytes")
    try:
        # upb parses any buffer without copying it first; the stubs only say bytes.
        return tensor_pb2.TensorsHeader.FromString(cast(bytes, body))
    except DecodeError as e:
        raise InvalidTensorHeaderError(f"header is not a valid TensorsHeader: {e}") from None


def _check_header(header: tensor_pb2.TensorsHeader, max_bytes: int, max_tensors: int) -> list[_Spec]:
    """Every tensor the header announces, once none is malformed and all fit the limits."""
    if len(header.tensors) > max_tensors:
        raise TensorLimitError(f"{len(header.tensors)} tensors announced, over max_tensors={max_tensors}")
    specs = []
    total = 0
    for i, info in enumerate(header.tensors):
        dtype = _FROM_WIRE.get(info.dtype)
        if dtype is None:
            raise InvalidTensorHeaderError(f"tensor {i} has unknown dtype code {info.dtype}")
        if len(info.shape) > MAX_DIMS:
            raise InvalidTensorHeaderError(f"tensor {i} has {len(info.shape)} dimensions, over {MAX_DIMS}")
        shape = tuple(info.shape)
        # Even an empty tensor may not have a dimension no non-empty one could have.
        if any(dim > max_bytes for dim in shape):
            raise TensorLimitError(f"tensor {i} has a dimension of {max(shape)}, over max_bytes={max_bytes}")
        nbytes = math.prod(shape) * dtype.itemsize
        if info.nbytes != nbytes:
            raise InvalidTensorHeaderError(
                f"tensor {i} announces {info.nbytes} bytes, but a {_describe(dtype, shape)} takes {nbytes}"
            )
        total += nbytes
        if total > max_bytes:
            raise TensorLimitError(
                f"tensors 0-{i} alone take {total} bytes, over max_bytes={max_bytes}; "
                "raise it if the peer may send this much"
            )
        specs.append(_Spec(dtype, shape, nbytes))
    return specs


def _check_out(out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    checked = []
    for i, tensor in enumerate(out):
        tensor = _check_tensor(tensor, f"out[{i}]")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise UnsupportedTensorError(
                f"out[{i}] is on {tensor.device}{'' if tensor.is_contiguous() else ', not contiguous'}: "
                "tensors are received in place only into contiguous CPU tensors"
            )
        checked.append(tensor)
    return checked


def _check_values(tensor: torch.Tensor, spec: _Spec, index: int, allow_nonfinite: bool) -> None:
    if tensor.numel() == 0:
        return
    if tensor.dtype == torch.bool and int(tensor.view(torch.uint8).max()) > 1:
        raise InvalidTensorDataError(f"tensor {index} ({spec}) holds bytes other than 0 and 1")
    if not allow_nonfinite and tensor.is_floating_point() and not tensor_finite(tensor):
        bad = tensor.numel() - int(torch.isfinite(tensor).sum())
        raise NonFiniteTensorError(f"tensor {index} ({spec}) holds {bad} NaN or Inf values")


async def receive_tensors(
    stream: ReadStream,
    *,
    max_bytes: int,
    max_tensors: int,
    out: Sequence[torch.Tensor] | None = None,
    allow_nonfinite: bool = True,
) -> list[torch.Tensor]:
    """Read one message of :func:`send_tensors` from ``stream`` and return its tensors.

    Refuses a message of more than ``max_tensors`` tensors or ``max_bytes``
    bytes of data before allocating anything. With ``out``, the peer must send
    exactly as many tensors, each of the same dtype and shape, and they are
    written into ``out`` (contiguous CPU tensors), which is returned as a list;
    without, new tensors are allocated. ``allow_nonfinite=False`` refuses NaN
    and Inf in floating-point tensors.
    """
    if max_bytes < 0 or max_tensors < 0:
        raise ValueError(f"max_bytes and max_tensors must be >= 0, got {max_bytes} and {max_tensors}")
    _check_host()
    targets = None if out is None else _check_out(out)
    specs = _check_header(await _read_header(stream, max_tensors), max_bytes, max_tensors)
    if targets is None:
        targets = [torch.empty(spec.shape, dtype=spec.dtype) for spec in specs]
    elif len(targets) != len(specs):
        raise TensorMismatchError(f"the peer sent {len(specs)} tensors where out holds {len(targets)}")
    else:
        for i, (spec, tensor) in enumerate(zip(specs, targets)):
            if spec.dtype != tensor.dtype or spec.shape != tuple(tensor.shape):
                raise TensorMismatchError(
                    f"the peer sent {spec} as tensor {i} where out[{i}] is {_describe(tensor.dtype, tensor.shape)}"
                )
    total = sum(spec.nbytes for spec in specs)
    received = 0
    for i, (spec, tensor) in enumerate(zip(specs, targets)):
        filled = await _fill(stream, tensor_bytes(tensor))
        received += filled
        if filled < spec.nbytes:
            raise TruncatedTensorStreamError(
                f"the stream ended after {filled} of the {spec.nbytes} bytes of tensor {i} ({spec}), "
                f"{received} of {total} data bytes in all"
            )
        _check_values(tensor, spec, i, allow_nonfinite)
    return targets


async def receive_tensor(
    stream: ReadStream, *, max_bytes: int, out: torch.Tensor | None = None, allow_nonfinite: bool = True
) -> torch.Tensor:
    """Read the message of one :func:`send_tensor`; like :func:`receive_tensors` otherwise."""
    received = await receive_tensors(
        stream,
        max_bytes=max_bytes,
        max_tensors=1,
        out=None if out is None else [out],
        allow_nonfinite=allow_nonfinite,
    )
    if len(received) != 1:
        raise TensorMismatchError("the peer sent no tensor where one was expected")
    return received[0]
