"""Pieces and their hash tree: any piece of a shard checked alone, the whole shard named by one root.

A shard is cut into fixed-size pieces (the last shorter). Each piece's SHA-256
is a leaf of a binary hash tree (BitTorrent v2's shape: leaves padded with
zero hashes to a power of two, each node the SHA-256 of its two children), and
the shard's entry in the manifest carries only the root: 32 bytes whatever the
shard's size, so an entry stays small enough for a DHT record. A downloader
fetches the leaves once from any seeder, checks them against the root, and then
checks each piece against its leaf before a byte of it is written.

Pure functions over bytes, and :func:`hash_file` reading one file. SHA-256 and
a tree of a few dozen lines are written here rather than taken from a library:
hashlib does the hashing, and no maintained package offers BitTorrent v2's
padded tree over leaves we already hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

#: Bytes of one hash (SHA-256).
HASH_SIZE = 32
#: Default piece size: 1 MiB (any piece is checked alone; a 200 MB dataset is 200 pieces).
PIECE_SIZE = 1 << 20
#: Smallest and largest piece sizes a dataset may use.
MIN_PIECE_SIZE = 16 * 1024
MAX_PIECE_SIZE = 16 * 1024 * 1024
#: Pieces one shard may have (its leaves are one answer: 32 bytes each, 2 MiB at most).
MAX_PIECES = 65_536
_ZERO = bytes(HASH_SIZE)


def piece_count(size: int, piece_size: int) -> int:
    """Pieces of a shard of ``size`` bytes (an empty shard has none)."""
    return -(-size // piece_size)


def piece_span(index: int, size: int, piece_size: int) -> tuple[int, int]:
    """(offset, length) of piece ``index`` in a shard of ``size`` bytes."""
    offset = index * piece_size
    if not 0 <= offset < size:
        raise IndexError(f"piece {index} is outside a shard of {size} bytes")
    return offset, min(piece_size, size - offset)


def leaf(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """The root of the tree over ``leaves`` (padded with zero hashes to a power of two)."""
    if not leaves:
        return leaf(b"")
    level = list(leaves)
    width = 1
    while width < len(level):
        width *= 2
    level += [_ZERO] * (width - len(level))
    while len(level) > 1:
        level = [hashlib.sha256(level[i] + level[i + 1]).digest() for i in range(0, len(level), 2)]
    return level[0]


def split_leaves(raw: bytes) -> list[bytes]:
    return [raw[i:i + HASH_SIZE] for i in range(0, len(raw), HASH_SIZE)]


def check_leaves(raw: bytes, root: bytes, size: int, piece_size: int) -> list[bytes] | str:
    """The leaves of a shard from a seeder's bytes, or why they are refused."""
    expected = piece_count(size, piece_size)
    if len(raw) != expected * HASH_SIZE:
        return f"{len(raw)} bytes of piece hashes where the shard has {expected} pieces"
    leaves = split_leaves(raw)
    if merkle_root(leaves) != root:
        return "the piece hashes do not add up to the shard's root"
    return leaves


def hash_file(path: Path, piece_size: int) -> tuple[int, list[bytes]]:
    """(size, leaves) of one file, read a piece at a time."""
    leaves: list[bytes] = []
    size = 0
    with path.open("rb") as f:
        while True:
            data = f.read(piece_size)
            if not data:
                break
            size += len(data)
            leaves.append(leaf(data))
    return size, leaves


__all__ = ["HASH_SIZE", "MAX_PIECES", "MAX_PIECE_SIZE", "MIN_PIECE_SIZE", "PIECE_SIZE", "check_leaves", "hash_file",
           "leaf", "merkle_root", "piece_count", "piece_span", "split_leaves"]
