"""Training data: shards in a per-peer order, streamed through a shuffle buffer, bad lines skipped and counted."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from training.data import DataConfig, DataError, ExampleStream, batches, read_shard, shuffled


def write_shards(tmp: Path, shards: int = 4, lines: int = 250) -> set[str]:
    everything = set()
    for s in range(shards):
        texts = [f"shard {s} example {i}" for i in range(lines)]
        everything |= set(texts)
        if s % 2:
            (tmp / f"part-{s}.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                                         for i, t in enumerate(texts)))
        else:
            (tmp / f"part-{s}.txt").write_text("\n".join(texts) + "\n")
    return everything


def test_every_example_once_per_pass_in_a_different_order_on_every_peer(tmp_path: Path) -> None:
    everything = write_shards(tmp_path)
    a = ExampleStream(DataConfig(files=(str(tmp_path),), shuffle_buffer=100, seed=1, passes=1))
    b = ExampleStream(DataConfig(files=(str(tmp_path),), shuffle_buffer=100, seed=2, passes=1))
    got_a, got_b = list(a), list(b)
    assert sorted(got_a) == sorted(got_b) == sorted(everything)  # nothing lost, nothing twice
    assert got_a != got_b  # each peer its own order
    # neighbours in a file are spread apart: few consecutive pairs survive the buffer
    pairs = sum(1 for x, y in zip(got_a, got_a[1:]) if x.rsplit(" ", 1)[0] == y.rsplit(" ", 1)[0]
                and int(y.rsplit(" ", 1)[1]) == int(x.rsplit(" ", 1)[1]) + 1)
    assert pairs < len(got_a) // 10
    assert a.stats.examples == len(everything) and a.stats.passes == 1 and a.stats.shards_read == 4


def test_the_stream_starts_after_the_buffer_not_after_the_corpus() -> None:
    read = 0

    def endless() -> itertools.count[int]:
        nonlocal read
        for i in itertools.count():
            read = i + 1
            yield i  # type: ignore[misc]
        raise AssertionError  # pragma: no cover

    first = list(itertools.islice(shuffled(endless(), 50, random.Random(0)), 10))  # type: ignore[arg-type]
    assert len(first) == 10 and read <= 60
    assert sorted(shuffled(range(20), 100, random.Random(0))) == list(range(20))  # smaller than the buffer


def test_passes_repeat_in_new_orders(tmp_path: Path) -> None:
    write_shards(tmp_path, shards=2, lines=20)
    stream = ExampleStream(DataConfig(files=(str(tmp_path),), shuffle_buffer=5, seed=3, passes=3))
    got = list(stream)
    assert len(got) == 120 and stream.stats.passes == 3
    assert got[:40] != got[40:80]


def test_bad_lines_are_skipped_and_counted_and_bad_shards_refused(tmp_path: Path) -> None:
    shard = tmp_path / "broken.jsonl"
    shard.write_text('{"text": "good one"}\nnot json at all\n{"other": 1}\n[1, 2]\n\n{"text": "good two"}\n')
    stream = ExampleStream(DataConfig(files=(str(shard),), shuffle_buffer=10, seed=0, passes=1))
    assert sorted(stream) == ["good one", "good two"]
    assert stream.stats.skipped == 3
    assert [(line, why) for _, line, why in stream.stats.skipped_where] == [
        (2, "not valid JSON"), (3, "no string field 'text'"), (4, "no string field 'text'")]
    with pytest.raises(DataError, match="no such file"):
        ExampleStream(DataConfig(files=(str(tmp_path / "missing.txt"),)))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown shard format"):
        ExampleStream(DataConfig(files=(str(tmp_path / "x.csv"),)))
    with pytest.raises(DataError, match="no data"):
        ExampleStream(DataConfig(files=()))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "nothing.jsonl").write_text("garbage\n")
    with pytest.raises(DataError, match="no examples"):
        list(ExampleStream(DataConfig(files=(str(empty),), seed=0)))


def test_parquet_shards_are_read_by_row_group(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"text": [f"row {i}" for i in range(3000)], "n": list(range(3000))})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=500)
    assert list(read_shard(tmp_path / "rows.parquet")) == [f"row {i}" for i in range(3000)]
    with pytest.raises(DataError, match="no column 'body'"):
        list(read_shard(tmp_path / "rows.parquet", text_field="body"))


def test_batches() -> None:
    assert list(batches(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
