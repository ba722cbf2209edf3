"""Chunk codecs for the all-reduce: float32, float16, 8-bit blockwise quantization.

Each chunk on the wire says its codec, and its payload size follows from the
codec and the chunk's element count alone, so a receiver knows exactly how
many bytes to expect before reading any (and refuses anything else).

The codec is chosen per tensor (:func:`codec_regions`): tensors smaller than
``min_elements`` stay float32, since their bytes do not matter and their
precision (biases, norms) often does. Chunks never straddle two regions.

8-bit blockwise: per block of ``UINT8_BLOCK`` values a float32 offset and
scale, then one byte per value: ``code = round((x - lo) / scale)``, so the
error of any value is at most ``scale / 2 = (hi - lo) / 510`` of its block.
float16 saturates at +-65504 rather than turning large values into inf.

PowerSGD (low-rank gradients with error feedback) is not a chunk codec: it
changes what is averaged, and lives beside the averager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from . import serial
from .proto import averaging_pb2 as pb
from .tensor_stream import tensor_bytes

UINT8_BLOCK = 1024
FLOAT16_MAX = 65504.0


class Compression(StrEnum):
    NONE = "none"
    FLOAT16 = "float16"
    UINT8 = "uint8"


_WIRE = {Compression.NONE: pb.CODEC_FLOAT32, Compression.FLOAT16: pb.CODEC_FLOAT16,
         Compression.UINT8: pb.CODEC_UINT8}
WIRE_CODECS = frozenset(_WIRE.values())


def wire_codec(compression: Compression) -> pb.Codec.ValueType:
    return _WIRE[compression]


def _block_count(elements: int) -> int:
    """The 8-bit codec's blocks for ``elements`` values: the last one may be short."""
    return -(-elements // UINT8_BLOCK)


def payload_size(codec: pb.Codec.ValueType, elements: int) -> int:
    """Bytes of a chunk of ``elements`` values under ``codec``."""
    if codec == pb.CODEC_FLOAT32:
        return 4 * elements
    if codec == pb.CODEC_FLOAT16:
        return 2 * elements
    if codec == pb.CODEC_UINT8:
        return elements + 8 * _block_count(elements)
    raise ValueError(f"unknown codec {codec}")


def encode_tensor(values: torch.Tensor, codec: pb.Codec.ValueType) -> torch.Tensor:
    """The payload of a chunk as a uint8 tensor on ``values``' device (a 1-D float32 tensor).

    On a GPU the codec runs there, so only the encoded bytes cross the PCIe
    bus. float32 is a view of ``values``' memory (no copy).
    """
    if codec == pb.CODEC_FLOAT32:
        return values.contiguous().view(torch.uint8)
    if codec == pb.CODEC_FLOAT16:
        out = torch.empty(values.numel(), dtype=torch.float16, device=values.device)
        for piece in serial.pieces(values):  # on the host in serial pieces (averaging.serial)
            out[piece].copy_(values[piece].clamp(-FLOAT16_MAX, FLOAT16_MAX))
        return out.view(torch.uint8)
    if codec == pb.CODEC_UINT8:
        n = values.numel()
        blocks = _block_count(n)  # heads first, then codes; a piece is whole blocks (PIECE is)
        out = torch.empty(8 * blocks + n, dtype=torch.uint8, device=values.device)
        all_heads = out[:8 * blocks].view(torch.float32).view(blocks, 2)
        for piece in serial.pieces(values):
            heads, codes = _uint8_blocks(values[piece])
            first = piece.start // UINT8_BLOCK
            all_heads[first:first + heads.shape[0]].copy_(heads)
            out[8 * blocks + piece.start:8 * blocks + piece.stop].copy_(codes)
        return out
    raise ValueError(f"unknown codec {codec}")


def _uint8_blocks(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit blockwise codes of ``values`` (starting at a block's start): each block's (offset, scale) as
    a float32 ``[blocks, 2]`` tensor, and each value's code, a whole float32 in [0, 255] (the copy
    into the payload's bytes converts it).

    A short last block is padded with its own last value, so the padding never widens its range. A
    constant block's scale is 1 on the wire, never 0 (no 0/0). ``(x - lo) / scale`` already lies in
    [0, 255] for every value of its block, so the codes need no clamp.
    """
    n = values.numel()
    blocks = _block_count(n)
    padded = torch.cat([values, values[-1:].expand(blocks * UINT8_BLOCK - n)]).view(blocks, UINT8_BLOCK)
    lo = padded.min(dim=1).values
    scale = (padded.max(dim=1).values - lo) / 255.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((padded - lo[:, None]) / scale[:, None]).round_()
    return torch.stack([lo, scale], dim=1), codes.reshape(-1)[:n]


def _uint8_values(heads: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 8-bit blockwise ``codes`` (starting at a block's start) under ``heads``."""
    n = codes.numel()
    blocks = heads.shape[0]
    lo, scale = heads.unbind(1)
    padded = torch.nn.functional.pad(codes.float(), (0, blocks * UINT8_BLOCK - n)).view(blocks, UINT8_BLOCK)
    return (padded * scale[:, None] + lo[:, None]).reshape(-1)[:n]


def encode(values: torch.Tensor, codec: pb.Codec.ValueType) -> memoryview:
    """:func:`encode_tensor`'s bytes for a CPU tensor, as a view (float32: of ``values``' own memory, zero-copy:
    the caller writes it out before changing them)."""
    return tensor_bytes(encode_tensor(values, codec))


def _writable(payload: bytes | bytearray | memoryview) -> bytearray | memoryview:
    """``payload`` itself when torch may view it (writable), else a copy."""
    if isinstance(payload, bytearray) or (isinstance(payload, memoryview) and not payload.readonly):
        return payload
    return bytearray(payload)


def decode(payload: bytes | bytearray | memoryview, codec: pb.Codec.ValueType, elements: int) -> torch.Tensor:
    """float32 values of a chunk; ``payload`` must be :func:`payload_size` bytes.

    A float32 payload in a writable buffer (the all-reduce's receive buffers)
    is viewed, not copied: the result shares its memory.
    """
    if len(payload) != payload_size(codec, elements):
        raise ValueError(f"payload of {len(payload)} bytes for {elements} values of codec {codec}")
    if elements == 0:
        return torch.empty(0, dtype=torch.float32)
    buffer = _writable(payload)
    if codec == pb.CODEC_FLOAT32:
        return torch.frombuffer(buffer, dtype=torch.float32)
    if codec == pb.CODEC_FLOAT16:
        return serial.copied(torch.frombuffer(buffer, dtype=torch.float16))
    blocks = _block_count(elements)  # the 8-bit codec: payload_size knew no other codec
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    heads = raw[:8 * blocks].view(torch.float32).view(blocks, 2)
    codes = raw[8 * blocks:]
    out = torch.empty(elements, dtype=torch.float32)
    for piece in serial.pieces(codes):  # in serial pieces (averaging.serial), whole blocks each
        first = piece.start // UINT8_BLOCK
        last = _block_count(piece.stop)
        out[piece].copy_(_uint8_values(heads[first:last], codes[piece]))
    return out


@dataclass(frozen=True)
class Region:
    """Elements ``[start, end)`` of the flat vector, sent with ``codec``."""

    start: int
    end: int
    codec: pb.Codec.ValueType


def codec_regions(sizes: Sequence[int], compression: Compression, min_elements: int) -> list[Region]:
    """Per-tensor codecs over the flat vector, neighbours with one codec merged."""
    regions: list[Region] = []
    offset = 0
    for n in sizes:
        codec = wire_codec(compression if n >= min_elements else Compression.NONE)
        if regions and regions[-1].codec == codec:
            regions[-1] = Region(regions[-1].start, offset + n, codec)
        elif n:
            regions.append(Region(offset, offset + n, codec))
        offset += n
    return regions
