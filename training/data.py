"""Training data: shards read in a different random order on every peer, streamed through a shuffle buffer.

DeDLOC 3.3 and I.4: volunteers cannot download a whole corpus before they
start, and peers that read the same examples in the same order add the same
gradient twice. So every peer reads the shards in its own random order, one
line at a time (nothing is loaded whole), through a shuffle buffer: the first
batch is ready after ``shuffle_buffer`` examples, not after the corpus, and
examples of neighbouring lines are spread apart. When every shard was read,
the next pass starts in a new order.

Shards are local files: text lines (``.txt``: one example per non-empty
line), JSON lines (``.jsonl``/``.json``: one object per line, the example in
``text_field``) or parquet (``.parquet``, read a row group at a time with
pyarrow, the example in the column ``text_field``). Nothing is downloaded.
A line that is not valid JSON, or lacks the field, is skipped and counted
(``DataStats``), with its file and line in the log: one bad line in a
volunteer's shard must not stop the run, and must not pass unnoticed.

Pure iterators (no I/O but reading the files), usable from the worker thread
that runs the model.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from p2p.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: suffix -> format
FORMATS = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


class DataError(ConfigError):
    """Shards that cannot be used at all: none given, missing, an unknown format, an empty corpus."""


@dataclass
class DataStats:
    """What the stream read so far."""

    examples: int = 0
    skipped: int = 0
    passes: int = 0
    shards_read: int = 0
    #: (file, line, why) of the first few skipped lines
    skipped_where: list[tuple[str, int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class DataConfig:
    """Where the examples come from and how they are mixed.

    ``files``: shard files or directories (every shard file in them, sorted).
    ``seed``: None draws one from the OS, so every peer reads its own order.
    ``passes``: stop after this many passes over the shards (0: forever).
    """

    files: tuple[str, ...]
    text_field: str = "text"
    shuffle_buffer: int = 10_000
    seed: int | None = None
    passes: int = 0

    def validate(self) -> None:
        if not self.files:
            raise DataError("no data: give shard files or directories (text lines, JSON lines or parquet)")
        if self.shuffle_buffer < 1:
            raise DataError("shuffle_buffer must be at least 1")
        if self.passes < 0:
            raise DataError("passes must be >= 0 (0: forever)")


def shard_paths(files: Sequence[str]) -> list[Path]:
    """The shard files named, directories expanded; a clear error for what is missing or unknown."""
    paths: list[Path] = []
    for name in files:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FORMATS)
            if not found:
                raise DataError(f"{path}: no shard files in it (wanted {', '.join(sorted(FORMATS))})")
            paths += found
        elif path.is_file():
            if path.suffix.lower() not in FORMATS:
                raise DataError(f"{path}: unknown shard format {path.suffix!r} (wanted {', '.join(sorted(FORMATS))})")
            paths.append(path)
        else:
            raise DataError(f"{path}: no such file or directory")
    return paths


def read_shard(path: Path, text_field: str = "text", stats: DataStats | None = None) -> Iterator[str]:
    """The examples of one shard, streamed."""
    stats = stats if stats is not None else DataStats()
    kind = FORMATS.get(path.suffix.lower())
    if kind == "parquet":
        yield from _read_parquet(path, text_field)
        return
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if kind == "text":
                yield line
                continue
            try:
                value = json.loads(line)
            except ValueError:
                _skip(stats, path, number, "not valid JSON")
                continue
            text = value.get(text_field) if isinstance(value, dict) else None
            if not isinstance(text, str):
                _skip(stats, path, number, f"no string field {text_field!r}")
            elif text.strip():
                yield text


def _skip(stats: DataStats, path: Path, number: int, why: str) -> None:
    stats.skipped += 1
    if len(stats.skipped_where) < 10:
        stats.skipped_where.append((str(path), number, why))
        log.warning("skipping %s line %d: %s", path, number, why)


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    shard = pq.ParquetFile(path)
    if text_field not in shard.schema_arrow.names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(shard.schema_arrow.names)})")
    for batch in shard.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text.strip():
                yield text


def shuffled(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """``items`` through a shuffle buffer of ``size``: each new item swaps out a random held one.

    The first item comes out once the buffer is full (or the input ended),
    so a stream starts after ``size`` items, not after all of them.
    """
    buffer: list[T] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        i = rng.randrange(size)
        buffer[i], item = item, buffer[i]
        yield item
    rng.shuffle(buffer)
    yield from buffer


class ShardSource:
    """Shard files that arrive while training runs (a dataset fetched from the swarm, ``training/datasets``).

    The fetch (in trio) adds each shard once it is whole and checked; the
    reader (the model's worker thread) waits for the first, then reads those
    there are, and takes the new ones as they come. Thread-safe.
    """

    def __init__(self, name: str, *, timeout: float = 600.0) -> None:
        self.name = name
        self.timeout = timeout
        self._paths: list[Path] = []
        self._cond = threading.Condition()
        self._complete = False
        self._error: str | None = None

    def add(self, path: Path) -> None:
        with self._cond:
            if path not in self._paths:
                self._paths.append(path)
            self._cond.notify_all()

    def finish(self) -> None:
        """Every shard arrived."""
        with self._cond:
            self._complete = True
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        """The fetch stopped: the reader raises :class:`DataError` once it has nothing left to read."""
        with self._cond:
            self._error = why
            self._cond.notify_all()

    @property
    def complete(self) -> bool:
        return self._complete

    def paths(self) -> list[Path]:
        with self._cond:
            return list(self._paths)

    def wait_first(self) -> list[Path]:
        """The shards there are, once there is one; :class:`DataError` after ``timeout`` or a failed fetch."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while not self._paths:
                if self._error is not None:
                    raise DataError(f"swarm:{self.name}: {self._error}")
                if self._complete:
                    raise DataError(f"swarm:{self.name}: the dataset has no shards")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DataError(f"swarm:{self.name}: no shard arrived within {self.timeout:g} s")
                self._cond.wait(left)
            return list(self._paths)


class ExampleStream:
    """The examples of a run's shards, in this peer's own order, pass after pass.

    Iterating gives strings; ``stats`` says what was read and skipped. With a
    :class:`ShardSource` the shards are those that arrived so far: a pass
    reads them in a random order, taking shards that arrive during the pass too.
    """

    def __init__(self, config: DataConfig, source: ShardSource | None = None) -> None:
        if source is None:
            config.validate()
        self.config = config
        self.source = source
        self.paths = shard_paths(config.files) if source is None else []
        seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "big")
        self.rng = random.Random(seed)
        self.stats = DataStats()

    def _order(self) -> Iterator[Path]:
        """One pass's shards in a random order: every shard; with a source, those that arrived, taking the
        ones that arrive during the pass too."""
        if self.source is None:
            order = list(self.paths)
            self.rng.shuffle(order)
            yield from order
            return
        self.source.wait_first()
        done: set[Path] = set()
        while left := [p for p in self.source.paths() if p not in done]:
            path = self.rng.choice(left)
            done.add(path)
            yield path

    def _passes(self) -> Iterator[str]:
        while self.config.passes == 0 or self.stats.passes < self.config.passes:
            before = self.stats.examples
            shards = 0
            for path in self._order():
                shards += 1
                for text in read_shard(path, self.config.text_field, self.stats):
                    self.stats.examples += 1
                    yield text
                self.stats.shards_read += 1
            self.stats.passes += 1
            if self.stats.examples == before:
                raise DataError(f"no examples in {shards} shard(s) ({self.stats.skipped} lines skipped)")

    def __iter__(self) -> Iterator[str]:
        return shuffled(self._passes(), self.config.shuffle_buffer, self.rng)


def batches(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Lists of ``size`` items (the last may be shorter)."""
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
