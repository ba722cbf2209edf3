"""Expert uids on a grid, and where their records live in the DHT (pure functions).

An expert's uid is a prefix and d integer coordinates, ``"ffn.3.5"``: the
expert at (3, 5) of a 2-dimensional grid of the layer ``ffn`` (Learning@home,
section 3.1: product-key gating scores each coordinate separately, so the
best experts are found one dimension at a time). The DHT holds one dictionary
per prefix of every live uid: key ``"ffn"`` has a subkey per live first
coordinate, key ``"ffn.3"`` one per live second coordinate under 3, and so on;
each subkey is owned by the server that wrote it (``"5[owner:<peer>]"``:
signed, so no peer can erase or redirect another's expert). Beam search reads
d keys per beam entry, never the whole grid.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from libp2p.peer.id import ID

from p2p.dht.records import owned
from p2p.errors import ConfigError

UID_DELIMITER = "."
_PREFIX_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}\Z")
_OWNED_SUBKEY_RE = re.compile(r"(0|[1-9][0-9]{0,8})\[owner:([1-9A-HJ-NP-Za-km-z]{20,128})\]\Z")
#: most dimensions of a grid, and most coordinates along one
MAX_DIMS = 8
MAX_GRID_SIZE = 1 << 20


class UidError(ConfigError):
    """A malformed expert uid or grid pattern."""


@dataclass(frozen=True, order=True)
class ExpertUid:
    prefix: str
    coords: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> ExpertUid:
        """``"ffn.3.5"`` -> ExpertUid("ffn", (3, 5)); UidError for anything else."""
        if not isinstance(text, str) or len(text) > 256:
            raise UidError(f"an expert uid is a short string, not {text!r:.80}")
        prefix, *coords = text.split(UID_DELIMITER)
        if not _PREFIX_RE.match(prefix) or not 1 <= len(coords) <= MAX_DIMS:
            raise UidError(f"expert uid {text!r}: want PREFIX.i.j... (a name and 1..{MAX_DIMS} coordinates)")
        try:
            values = tuple(int(c) for c in coords)
        except ValueError:
            raise UidError(f"expert uid {text!r}: coordinates must be integers") from None
        if any(not 0 <= v < MAX_GRID_SIZE or str(v) != c for v, c in zip(values, coords)):
            raise UidError(f"expert uid {text!r}: coordinates must be plain integers in [0, {MAX_GRID_SIZE})")
        return cls(prefix, values)

    def __str__(self) -> str:
        return UID_DELIMITER.join([self.prefix, *map(str, self.coords)])

    def level_keys(self) -> Iterator[tuple[str, int]]:
        """(DHT key, next coordinate) for every prefix: ("ffn", 3), ("ffn.3", 5)."""
        for level, coord in enumerate(self.coords):
            yield prefix_key(self.prefix, self.coords[:level]), coord


def prefix_key(prefix: str, coords: Iterable[int]) -> str:
    """The DHT key listing the live coordinates after ``coords`` ("ffn", "ffn.3", ...)."""
    return UID_DELIMITER.join([prefix, *map(str, coords)])


def coordinate_subkey(coord: int, server: ID) -> str:
    """The subkey under which ``server`` declares ``coord`` live (signed by it)."""
    return str(owned(str(coord), server))


def parse_subkey(subkey: object) -> tuple[int, ID] | None:
    """(coordinate, server) of a prefix's subkey, None for anything another program wrote there."""
    if not isinstance(subkey, str):
        return None
    m = _OWNED_SUBKEY_RE.match(subkey)
    if m is None:
        return None
    # the DHT stored it only under its owner's signature: the id is that signer's
    return int(m.group(1)), ID.from_base58(m.group(2))


def expand_pattern(pattern: str) -> list[ExpertUid]:
    """Every uid of a hivemind-style pattern: ``"ffn.[0:4].[0:8]"`` -> 32 uids, ``"ffn.1.[2:4]"`` -> 2."""
    prefix, *parts = pattern.split(UID_DELIMITER)
    if not _PREFIX_RE.match(prefix) or not 1 <= len(parts) <= MAX_DIMS:
        raise UidError(f"expert pattern {pattern!r}: want PREFIX.[a:b].[c:d]... or fixed coordinates")
    ranges: list[range] = []
    for part in parts:
        m = re.fullmatch(r"\[(\d+):(\d+)\]", part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
        elif part.isdigit():
            lo, hi = int(part), int(part) + 1
        else:
            raise UidError(f"expert pattern {pattern!r}: {part!r} is neither [a:b] nor an integer")
        if not 0 <= lo < hi <= MAX_GRID_SIZE:
            raise UidError(f"expert pattern {pattern!r}: empty or out-of-range {part!r}")
        ranges.append(range(lo, hi))
    total = math.prod(len(r) for r in ranges)
    if total > 100_000:
        raise UidError(f"expert pattern {pattern!r} names {total} experts (at most 100000)")
    return [ExpertUid(prefix, coords) for coords in itertools.product(*ranges)]  # the last coordinate fastest
