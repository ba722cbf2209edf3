"""Training data: shards in a per-peer order, streamed through a shuffle buffer, bad lines skipped and counted."""

from __future__ import annotations

import itertools
import json
import random
import threading
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


# ---------------------------------------------------------------------- each refusal, whole, and each edge

def test_a_config_is_refused_with_what_to_give_and_its_edges_pass() -> None:
    with pytest.raises(DataError, match=r"^no data: give shard files or directories \(text lines, JSON lines or parquet\)$"):
        DataConfig(files=()).validate()
    with pytest.raises(DataError, match="^shuffle_buffer must be at least 1$"):
        DataConfig(files=("x",), shuffle_buffer=0).validate()
    with pytest.raises(DataError, match=r"^passes must be >= 0 \(0: forever\)$"):
        DataConfig(files=("x",), passes=-1).validate()
    DataConfig(files=("x",), shuffle_buffer=1, passes=0).validate()
    config = DataConfig(files=("x",))
    assert (config.text_field, config.shuffle_buffer, config.seed, config.passes) == ("text", 10_000, None, 0)


WANTED = ".json, .jsonl, .parquet, .text, .txt"


def test_shards_are_found_by_their_suffix_in_any_case_and_nothing_else_is(tmp_path: Path) -> None:
    from training.data import shard_paths

    (tmp_path / "b.TXT").write_text("x\n")
    (tmp_path / "a.JsonL").write_text('{"text": "y"}\n')
    (tmp_path / "c.text").write_text("z\n")
    (tmp_path / "notes.md").write_text("no\n")
    (tmp_path / "sub.txt").mkdir()  # a directory named like a shard
    assert shard_paths([str(tmp_path)]) == [tmp_path / "a.JsonL", tmp_path / "b.TXT", tmp_path / "c.text"]
    assert shard_paths([str(tmp_path / "b.TXT"), str(tmp_path / "c.text")]) == [tmp_path / "b.TXT", tmp_path / "c.text"]
    other = tmp_path / "more"
    other.mkdir()
    (other / "d.txt").write_text("w\n")
    assert shard_paths([str(other), str(tmp_path)]) == [other / "d.txt", tmp_path / "a.JsonL", tmp_path / "b.TXT",
                                                        tmp_path / "c.text"]  # every directory's, in the order given
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme").write_text("")
    with pytest.raises(DataError, match=f"^{empty}: no shard files in it \\(wanted {WANTED}\\)$"):
        shard_paths([str(empty)])
    with pytest.raises(DataError, match=f"^{tmp_path / 'notes.md'}: unknown shard format '.md' \\(wanted {WANTED}\\)$"):
        shard_paths([str(tmp_path / "notes.md")])
    with pytest.raises(DataError, match=f"^{tmp_path / 'gone'}: no such file or directory$"):
        shard_paths([str(tmp_path / "gone")])


def test_a_shard_s_lines_are_read_stripped_undecodable_bytes_replaced_blank_ones_skipped(tmp_path: Path) -> None:
    shard = tmp_path / "t.TXT"
    shard.write_bytes(b"  first  \n\n   \nbad \xff byte\nlast")
    assert list(read_shard(shard)) == ["first", "bad \ufffd byte", "last"]
    lines = tmp_path / "l.JSON"
    lines.write_bytes(b'{"body": "  kept as it is "}\n{"body": "   "}\n{"body": 7}\n{"body": null}\n{"body": "\xff"}\n')
    from training.data import DataStats

    stats = DataStats()
    assert list(read_shard(lines, "body", stats)) == ["  kept as it is ", "\ufffd"]
    assert stats.skipped == 2 and stats.skipped_where == [
        (str(lines), 3, "no string field 'body'"), (str(lines), 4, "no string field 'body'")]
    assert list(read_shard(lines, "body")) == ["  kept as it is ", "\ufffd"]  # no stats given: none kept


def test_the_first_ten_skipped_lines_are_kept_and_logged_and_every_one_counted(tmp_path: Path, caplog) -> None:
    from training.data import DataStats

    shard = tmp_path / "bad.jsonl"
    shard.write_text("oops\n" * 12)
    stats = DataStats()
    with caplog.at_level("WARNING", logger="training.data"):
        assert list(read_shard(shard, stats=stats)) == []
    assert stats.skipped == 12 and stats.skipped_where == [(str(shard), n, "not valid JSON") for n in range(1, 11)]
    assert [r.getMessage() for r in caplog.records] == [f"skipping {shard} line {n}: not valid JSON" for n in range(1, 11)]


def test_parquet_rows_that_are_no_text_are_skipped_and_a_missing_column_names_those_there_are(tmp_path: Path,
                                                                                              monkeypatch) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"n": list(range(2400)), "text": ["a", None, "  ", "b"] * 600}), tmp_path / "r.PARQUET")
    assert list(read_shard(tmp_path / "r.PARQUET")) == ["a", "b"] * 600
    with pytest.raises(DataError, match=f"^{tmp_path / 'r.PARQUET'}: no column 'body' \\(columns: n, text\\)$"):
        list(read_shard(tmp_path / "r.PARQUET", text_field="body"))
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(DataError, match=r"r.PARQUET: reading parquet needs pyarrow \(pip install pyarrow\)$"):
        list(read_shard(tmp_path / "r.PARQUET"))


def test_a_source_says_why_it_has_nothing_to_read(tmp_path: Path) -> None:
    from training.data import ShardSource

    source = ShardSource("wiki")
    assert source.name == "wiki" and source.timeout == 600.0 and source.complete is False and source.paths() == []
    source.add(tmp_path / "a.txt")
    source.add(tmp_path / "a.txt")  # once
    assert source.paths() == [tmp_path / "a.txt"] == source.wait_first()
    empty = ShardSource("wiki", timeout=5.0)
    empty.finish()
    assert empty.complete
    with pytest.raises(DataError, match="^swarm:wiki: the dataset has no shards$"):
        empty.wait_first()
    late = ShardSource("books", timeout=0.05)
    with pytest.raises(DataError, match="^swarm:books: no shard arrived within 0.05 s$"):
        late.wait_first()
    soon = ShardSource("books", timeout=0.9)  # a shard 0.1 s later is waited for, under a second too
    threading.Timer(0.1, soon.add, [tmp_path / "b.txt"]).start()
    assert soon.wait_first() == [tmp_path / "b.txt"]
    failed = ShardSource("wiki", timeout=5.0)
    failed.fail("no seeder reached")
    with pytest.raises(DataError, match="^swarm:wiki: no seeder reached$"):
        failed.wait_first()


def test_a_stream_without_a_seed_draws_its_own_and_one_with_a_source_needs_no_files(tmp_path: Path) -> None:
    from training.data import ShardSource

    write_shards(tmp_path, shards=2, lines=50)
    config = DataConfig(files=(str(tmp_path),), shuffle_buffer=20, passes=1)
    orders = {tuple(ExampleStream(config)) for _ in range(3)}
    assert len(orders) == 3  # each its own order
    seeded = DataConfig(files=(str(tmp_path),), shuffle_buffer=20, passes=1, seed=5)
    assert list(ExampleStream(seeded)) == list(ExampleStream(seeded))  # a seed repeats the run
    stream = ExampleStream(config)
    assert stream.paths == sorted(tmp_path.iterdir()) and stream.stats.examples == 0 and stream.source is None
    source = ShardSource("wiki")
    sourced = ExampleStream(DataConfig(files=("swarm:wiki",)), source)  # its files are not looked for: the swarm brings them
    assert sourced.paths == [] and sourced.source is source


def test_a_pass_that_yields_nothing_says_how_many_shards_and_skipped_lines(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("bad\n{}\n")
    (tmp_path / "b.txt").write_text("\n\n")
    with pytest.raises(DataError, match=r"^no examples in 2 shard\(s\) \(2 lines skipped\)$"):
        list(ExampleStream(DataConfig(files=(str(tmp_path),), seed=0)))
    (tmp_path / "b.txt").write_text("one\n")
    stream = ExampleStream(DataConfig(files=(str(tmp_path),), seed=0, passes=2))
    assert list(stream) == ["one", "one"] and stream.stats.passes == 2 and stream.stats.shards_read == 4
