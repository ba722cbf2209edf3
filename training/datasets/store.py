"""A dataset on this peer's disk: whole shards at their paths, the rest piece by piece, resumable.

Layout of a dataset's directory ``DIR``::

    DIR/<shard path>                 a whole shard, checked against its root (appears by rename: whole or absent)
    DIR/.dedloc/manifest             the signed header and entries (``Manifest.stored``)
    DIR/.dedloc/parts/<root hex>     a shard being fetched: its pieces at their offsets
    DIR/.dedloc/leaves/<root hex>    its piece hashes (checked against the root when fetched)
    DIR/.dedloc/lock                 held (flock) by the one process that has the directory open

Nothing unchecked is ever written where training reads: a piece is written
to its part file only after it matched its leaf, and a shard moves to its
path only when every piece did. A restart resumes from what is on disk: whole
shards are checked against their roots, the pieces of part files against
their leaves (a piece torn by a crash fails and is fetched again).

Every piece is checked again as it is read to be served (:func:`read_checked`): a
file edited, truncated or rotted on disk since it was checked would otherwise be
sent, every fetcher would ban us for it, and we would never know. A piece that no
longer matches takes its shard out of what we hold and serve (:meth:`LocalDataset.lost`),
with a warning that names the file; checking the directory again (``dedloc dataset
seed DIR``, or a restart) takes back what still matches.

Synchronous file I/O (a piece is a page-cache write of at most a few MiB);
the callers run the whole-directory checks, and the serving reads with their
hash, in a worker thread.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from p2p.lockfile import HeldLock, LockHeld

from .manifest import DatasetError, Manifest, ManifestError, Shard
from .pieces import HASH_SIZE, hash_file, leaf, merkle_root, piece_count, piece_span, split_leaves

log = logging.getLogger(__name__)

META = ".dedloc"


def lock_directory(directory: Path) -> HeldLock:
    """Hold a dataset's directory, one process at a time (``p2p.lockfile``): an exclusive lock on
    ``DIR/.dedloc/lock``, which holds the owner's pid for the message. With two ``dataset get`` into
    one directory at once, both writing its part files, the second hung at 2 of 3 shards for good."""
    meta = Path(directory) / META
    meta.mkdir(parents=True, exist_ok=True)
    try:
        return HeldLock.acquire(meta / "lock")
    except LockHeld as e:
        raise DatasetError(f"{directory} is in use by another dedloc process{f' (pid {e.owner})' if e.owner else ''}; "
                           "wait for it to end, or name another directory") from None


def stored_manifest(directory: Path) -> Path:
    """Where ``directory``'s dataset keeps its manifest; a clear error if it holds none (``dataset
    seed DIR`` checks it before its peer starts, :meth:`LocalDataset.load` when it loads)."""
    stored = directory / META / "manifest"
    if not stored.exists():
        raise DatasetError(f"{directory}: no dataset here (no {META}/manifest); "
                           "`dedloc dataset create` or `get` makes one")
    return stored


def _bits(held: set[int], count: int) -> bytes:
    out = bytearray((count + 7) // 8)
    for i in held:
        out[i // 8] |= 0x80 >> (i % 8)
    return bytes(out)


def from_bits(bits: bytes, count: int) -> set[int] | None:
    """The pieces a HAVE bitfield names (None: every piece, an empty bitfield)."""
    if not bits:
        return None
    return {i for i in range(min(count, len(bits) * 8)) if bits[i // 8] & (0x80 >> (i % 8))}


@dataclass(frozen=True)
class PieceAt:
    """Where a held piece lies on disk (its shard's file or part file) and the hash it must match."""

    root: bytes
    index: int
    path: Path
    offset: int
    length: int
    leaf: bytes


def read_checked(at: PieceAt) -> bytes | str:
    """The piece's bytes, or why they are not the piece any more (changed, truncated, unreadable).
    Thread-safe: only the file is read (hashlib releases the GIL while it hashes)."""
    try:
        with at.path.open("rb") as f:
            f.seek(at.offset)
            data = f.read(at.length)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if len(data) != at.length:
        return f"piece {at.index} is cut short ({len(data)} of {at.length} bytes): the file changed on disk"
    if leaf(data) != at.leaf:
        return f"piece {at.index} does not match its hash: the file changed on disk since it was checked"
    return data


class LocalDataset:
    """One dataset's files in one directory, and which of its pieces are here (see the module docstring)."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self.piece_size = manifest.header.piece_size
        #: shards by root, as the manifest lists them now
        self.shards: dict[bytes, Shard] = {s.root: s for s in manifest.shards()}
        #: roots of the shards held whole (checked)
        self.whole: set[bytes] = set()
        #: pieces held of shards not whole yet
        self.have: dict[bytes, set[int]] = {}
        self.leaves: dict[bytes, list[bytes]] = {}
        #: pieces a check refused while scanning (torn by a crash, changed on disk)
        self.discarded = 0

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, directory: Path, manifest: Manifest) -> LocalDataset:
        """``directory`` for ``manifest``: what it already holds is checked and kept, the manifest saved."""
        directory = Path(directory)
        stored = directory / META / "manifest"
        if stored.exists():
            try:
                old = Manifest.from_stored(stored.read_bytes(), manifest.authority)
            except ManifestError as e:
                raise DatasetError(f"{stored}: {e}; move the directory away or name another") from None
            if old.header.id != manifest.header.id:
                raise DatasetError(f"{directory} holds another dataset ({old.header.label}); name another directory")
            manifest.merge(old)
        local = cls(directory, manifest)
        local.save_manifest()
        local.scan()
        return local

    @classmethod
    def load(cls, directory: Path, authority: bytes | None = None) -> LocalDataset:
        """The dataset a directory holds (``dedloc dataset seed DIR``; ``authority``: a closed swarm's key,
        whose retractions count)."""
        stored = stored_manifest(Path(directory))
        try:
            manifest = Manifest.from_stored(stored.read_bytes(), authority)
        except ManifestError as e:
            raise DatasetError(f"{stored}: {e}") from None
        local = cls(Path(directory), manifest)
        local.scan()
        return local

    def save_manifest(self) -> None:
        meta = self.directory / META
        (meta / "parts").mkdir(parents=True, exist_ok=True)
        (meta / "leaves").mkdir(parents=True, exist_ok=True)
        tmp = meta / "manifest.partial"
        tmp.write_bytes(self.manifest.stored())
        tmp.replace(meta / "manifest")

    def refresh(self) -> list[Shard]:
        """Take the manifest's shards as they are now (entries added since); the new ones."""
        new = [s for s in self.manifest.shards() if s.root not in self.shards]
        current = {s.root: s for s in self.manifest.shards()}
        self.shards = current
        for s in new:
            self._scan_one(s)
        return new

    def path(self, shard: Shard) -> Path:
        return self.directory / shard.path

    def _part(self, root: bytes) -> Path:
        return self.directory / META / "parts" / root.hex()

    def _leaves_file(self, root: bytes) -> Path:
        return self.directory / META / "leaves" / root.hex()

    def scan(self) -> None:
        """Check what the directory holds: whole shards against their roots, part files against their leaves."""
        for shard in self.shards.values():
            self._scan_one(shard)

    def _scan_one(self, shard: Shard) -> None:
        path = self.path(shard)
        if path.is_file() and path.stat().st_size == shard.size:
            size, leaves = hash_file(path, self.piece_size)
            if size == shard.size and merkle_root(leaves) == shard.root:
                self.whole.add(shard.root)
                self.leaves[shard.root] = leaves
                self.have.pop(shard.root, None)
                return
            log.warning("%s does not match its shard's root: fetched again", path)
        leaves_file = self._leaves_file(shard.root)
        if leaves_file.exists():
            raw = leaves_file.read_bytes()
            leaves = split_leaves(raw)
            if len(raw) == piece_count(shard.size, self.piece_size) * HASH_SIZE and merkle_root(leaves) == shard.root:
                self.leaves[shard.root] = leaves
        part = self._part(shard.root)
        held: set[int] = set()
        if part.exists() and shard.root in self.leaves:
            with part.open("rb") as f:
                for i, expected in enumerate(self.leaves[shard.root]):
                    offset, length = piece_span(i, shard.size, self.piece_size)
                    f.seek(offset)
                    data = f.read(length)
                    if len(data) == length and leaf(data) == expected:
                        held.add(i)
                    elif any(data):
                        self.discarded += 1
        self.have[shard.root] = held
        if held and len(held) == piece_count(shard.size, self.piece_size):
            self._finish(shard)

    # ------------------------------------------------------------------ what is held

    def pieces_of(self, root: bytes) -> set[int] | None:
        """Pieces held of a shard (None: whole)."""
        if root in self.whole:
            return None
        return self.have.get(root, set())

    def bitfield(self, root: bytes) -> bytes | None:
        """HAVE's bits for a shard: empty for a whole one, None for one we hold nothing of."""
        if root in self.whole:
            return b""
        held = self.have.get(root)
        shard = self.shards.get(root)
        if not held or shard is None:
            return None
        return _bits(held, piece_count(shard.size, self.piece_size))

    @property
    def held_bytes(self) -> int:
        total = sum(self.shards[r].size for r in self.whole if r in self.shards)
        for root, held in self.have.items():
            shard = self.shards.get(root)
            if shard is not None:
                total += sum(piece_span(i, shard.size, self.piece_size)[1] for i in held)
        return total

    @property
    def complete(self) -> bool:
        return all(r in self.whole for r in self.shards)

    def whole_paths(self) -> list[Path]:
        live = [self.shards[r] for r in self.whole if r in self.shards]  # a shard retracted since is not
        return [self.path(s) for s in sorted(live, key=lambda s: s.path)]

    # ------------------------------------------------------------------ serving

    def read_leaves(self, root: bytes) -> bytes | None:
        leaves = self.leaves.get(root)
        return None if leaves is None else b"".join(leaves)

    def locate_piece(self, root: bytes, index: int) -> PieceAt | None:
        """Where a piece we hold lies, and its hash (None: not held)."""
        shard = self.shards.get(root)
        leaves = self.leaves.get(root)
        if shard is None or leaves is None or not 0 <= index < min(len(leaves), piece_count(shard.size, self.piece_size)):
            return None
        if root in self.whole:
            path = self.path(shard)
        elif index in self.have.get(root, ()):
            path = self._part(root)
        else:
            return None
        offset, length = piece_span(index, shard.size, self.piece_size)
        return PieceAt(root, index, path, offset, length, leaves[index])

    def read_piece(self, root: bytes, index: int) -> bytes | None:
        """A piece we hold, read and checked again (:func:`read_checked`), or None (not held, or no longer)."""
        at = self.locate_piece(root, index)
        if at is None:
            return None
        data = read_checked(at)
        if isinstance(data, str):
            self.lost(at, data)
            return None
        return data

    def lost(self, at: PieceAt, why: str) -> bool:
        """A piece we held failed its check as it was read to be served: a whole shard is no longer held
        (which of its other pieces still match, only checking the file again says), a piece of a part
        file no longer held. False when that was known already (another read found it first)."""
        if self.locate_piece(at.root, at.index) != at:
            return False
        if at.root in self.whole:
            self.whole.discard(at.root)
            self.have[at.root] = set()
            log.warning("%s: %s: no longer seeding it (check it again with `dedloc dataset seed %s`)",
                        at.path, why, self.directory)
        else:
            self.have[at.root].discard(at.index)
            log.warning("%s: %s: no longer seeding that piece", at.path, why)
        self.discarded += 1
        return True

    # ------------------------------------------------------------------ fetching

    def set_leaves(self, root: bytes, leaves: list[bytes]) -> None:
        """A shard's leaves, already checked against its root."""
        self.leaves[root] = leaves
        tmp = self._leaves_file(root).with_suffix(".partial")
        tmp.write_bytes(b"".join(leaves))
        tmp.replace(self._leaves_file(root))

    def check_piece(self, root: bytes, index: int, data: bytes) -> str | None:
        """Why ``data`` is not piece ``index`` of the shard (None: it is)."""
        shard = self.shards.get(root)
        leaves = self.leaves.get(root)
        if shard is None or leaves is None or not 0 <= index < len(leaves):
            return "a piece of a shard we did not ask for"
        if len(data) != piece_span(index, shard.size, self.piece_size)[1]:
            return f"piece {index} of {shard.path}: {len(data)} bytes, not {piece_span(index, shard.size, self.piece_size)[1]}"
        if leaf(data) != leaves[index]:
            return f"piece {index} of {shard.path} does not match its hash"
        return None

    def write_piece(self, root: bytes, index: int, data: bytes) -> bool:
        """Write a checked piece; True when its shard became whole (and moved to its path)."""
        shard = self.shards[root]
        if root in self.whole:
            return False
        part = self._part(root)
        offset, _ = piece_span(index, shard.size, self.piece_size)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        held = self.have.setdefault(root, set())
        held.add(index)
        if len(held) == piece_count(shard.size, self.piece_size):
            self._finish(shard)
            return True
        return False

    def _finish(self, shard: Shard) -> None:
        part = self._part(shard.root)
        path = self.path(shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        with part.open("rb+") as f:
            f.truncate(shard.size)
            os.fsync(f.fileno())
        part.replace(path)
        self.whole.add(shard.root)
        self.have.pop(shard.root, None)


__all__ = ["LocalDataset", "META", "from_bits"]
