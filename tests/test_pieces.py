"""training/datasets/pieces.py: a shard's pieces and their hash tree, checked against values computed
here by hand from hashlib (BitTorrent v2's shape: leaves padded with zero hashes to a power of two)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from training.datasets.pieces import (
    HASH_SIZE,
    check_leaves,
    hash_file,
    leaf,
    merkle_root,
    piece_count,
    piece_span,
    split_leaves,
)


def h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


ZERO = bytes(32)


def test_a_hash_is_32_bytes_of_sha256() -> None:
    assert HASH_SIZE == 32 and leaf(b"piece") == h(b"piece") and leaf(memoryview(b"piece")) == h(b"piece")


@pytest.mark.parametrize(("size", "count"), [(0, 0), (1, 1), (1024, 1), (1025, 2), (4096, 4), (4097, 5)])
def test_pieces_of_a_shard(size: int, count: int) -> None:
    assert piece_count(size, 1024) == count


def test_a_piece_s_span_and_the_last_one_shorter() -> None:
    assert piece_span(0, 2500, 1024) == (0, 1024)
    assert piece_span(1, 2500, 1024) == (1024, 1024)
    assert piece_span(2, 2500, 1024) == (2048, 452)
    assert piece_span(1, 2048, 1024) == (1024, 1024)
    for index, size in ((3, 2500), (2, 2048), (-1, 2500), (0, 0)):
        with pytest.raises(IndexError, match=f"^piece {index} is outside a shard of {size} bytes$"):
            piece_span(index, size, 1024)


def test_the_root_of_known_trees() -> None:
    a, b, c, d, e = (h(bytes([i])) for i in range(5))
    assert merkle_root([]) == h(b"")
    assert merkle_root([a]) == a  # one leaf is its own root
    assert merkle_root([a, b]) == h(a + b)
    assert merkle_root([a, b, c]) == h(h(a + b) + h(c + ZERO))  # padded to four
    assert merkle_root([a, b, c, d]) == h(h(a + b) + h(c + d))
    assert merkle_root([a, b, c, d, e]) == h(h(h(a + b) + h(c + d)) + h(h(e + ZERO) + h(ZERO + ZERO)))
    assert merkle_root([b, a]) != merkle_root([a, b])


def test_split_leaves_cuts_every_32_bytes() -> None:
    raw = bytes(range(96))
    assert split_leaves(raw) == [raw[:32], raw[32:64], raw[64:]]
    assert split_leaves(b"") == []


def test_leaves_from_a_seeder_are_checked_against_the_root_and_the_count() -> None:
    leaves = [h(bytes([i])) for i in range(3)]
    root = merkle_root(leaves)
    assert check_leaves(b"".join(leaves), root, 2500, 1024) == leaves
    assert check_leaves(b"".join(leaves[:2]), root, 2500, 1024) == \
        "64 bytes of piece hashes where the shard has 3 pieces"
    assert check_leaves(b"".join(reversed(leaves)), root, 2500, 1024) == \
        "the piece hashes do not add up to the shard's root"
    assert check_leaves(b"", merkle_root([]), 0, 1024) == []


@pytest.mark.parametrize("size", [0, 1, 1024, 2500])
def test_hashing_a_file_reads_it_a_piece_at_a_time(tmp_path: Path, size: int) -> None:
    data = bytes(i % 251 for i in range(size))
    path = tmp_path / "shard"
    path.write_bytes(data)
    assert hash_file(path, 1024) == (size, [h(data[i:i + 1024]) for i in range(0, size, 1024)])
