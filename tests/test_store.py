"""training/datasets/store.py, a dataset on this peer's disk, call by call (test_datasets has its whole-shard,
restart and served-piece stories): the HAVE bits, the serving read's three refusals, opening and
loading with their errors, the scan of whole files, leaves files and part files, what is held and
where, the checks of a fetched piece and its write, and a shard's move to its path."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from nacl.signing import SigningKey

from training.datasets.manifest import DatasetError, Entry, Header, Manifest, sign_by_authority
from training.datasets.pieces import leaf
from training.datasets.store import META, LocalDataset, PieceAt, _bits, from_bits, read_checked

from .kit import log_lines
from .test_datasets import NOW, PIECE, leaves_of, manifest_of, shard, signer, write_files

LOG = "training.datasets.store"
RNG = random.Random(5)
#: a.txt of four pieces (the last of 100 bytes), sub/dir/b.txt of two (the last of 7)
DATA = {"a.txt": RNG.randbytes(3 * PIECE + 100), "sub/dir/b.txt": RNG.randbytes(PIECE + 7)}


def roots(manifest: Manifest) -> tuple[bytes, bytes]:
    a, b = sorted(manifest.shards(), key=lambda s: s.path)
    return a.root, b.root


# ---------------------------------------------------------------------------- HAVE's bits


def test_bits_name_pieces_most_significant_first_and_an_empty_field_is_every_piece() -> None:
    assert _bits({0, 3, 8}, 10) == bytes([0b1001_0000, 0b1000_0000])
    assert _bits(set(), 9) == bytes(2) and _bits(set(), 0) == b""
    assert from_bits(bytes([0b1001_0000, 0b1100_0000]), 10) == {0, 3, 8, 9}
    assert from_bits(bytes([0xFF, 0xFF]), 10) == set(range(10))  # bits past the count are not pieces
    assert from_bits(bytes([0xFF]), 12) == set(range(8))
    assert from_bits(b"", 5) is None
    assert from_bits(bytes([0x00, 0xFF]), 16) == set(range(8, 16)) and from_bits(bytes([0x01]), 8) == {7}


# ---------------------------------------------------------------------------- the serving read


def test_read_checked_says_why_the_bytes_are_not_the_piece(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abcdef" * 10)
    at = PieceAt(b"r", 2, path, 6, 12, leaf(b"abcdef" * 2))
    assert read_checked(at) == b"abcdef" * 2
    assert read_checked(PieceAt(b"r", 2, path, 6, 12, leaf(b"x"))) == (
        "piece 2 does not match its hash: the file changed on disk since it was checked")
    assert read_checked(PieceAt(b"r", 3, path, 54, 12, leaf(b"x"))) == (
        "piece 3 is cut short (6 of 12 bytes): the file changed on disk")
    assert read_checked(PieceAt(b"r", 3, tmp_path / "gone", 0, 1, leaf(b"x"))) == (
        "unreadable (No such file or directory)")


# ---------------------------------------------------------------------------- open and load


def test_open_keeps_the_entries_a_directory_already_holds_and_saves_the_manifest(tmp_path: Path) -> None:
    first = manifest_of(DATA)
    LocalDataset.open(tmp_path, first)
    meta = tmp_path / META
    assert (meta / "parts").is_dir() and (meta / "leaves").is_dir() and not (meta / "manifest.partial").exists()
    assert Manifest.from_stored((meta / "manifest").read_bytes()).header.id == first.header.id
    fresh = Manifest(first.header)  # the same dataset, none of its entries known yet
    local = LocalDataset.open(tmp_path, fresh)
    assert fresh.entries.keys() == first.entries.keys() and set(local.shards) == set(roots(first))


@pytest.mark.parametrize("stored, message", [
    (b"\xff garbage", "a stored manifest that does not parse"),
    (b"", "a header"),
])
def test_a_stored_manifest_that_does_not_read_is_refused_by_its_path(tmp_path: Path, stored: bytes,
                                                                     message: str) -> None:
    (tmp_path / META).mkdir()
    (tmp_path / META / "manifest").write_bytes(stored)
    with pytest.raises(DatasetError) as e:
        LocalDataset.open(tmp_path, manifest_of(DATA))
    text = str(e.value)
    assert text.startswith(f"{tmp_path / META / 'manifest'}: ") and message in text
    assert text.endswith("; move the directory away or name another")
    with pytest.raises(DatasetError) as e:
        LocalDataset.load(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / META / 'manifest'}: ") and message in str(e.value)
    assert not str(e.value).endswith("name another")


def test_a_directory_of_another_dataset_names_it(tmp_path: Path) -> None:
    other = manifest_of(DATA, "books")
    LocalDataset.open(tmp_path, other)
    with pytest.raises(DatasetError) as e:
        LocalDataset.open(tmp_path, manifest_of(DATA))
    assert str(e.value) == f"{tmp_path} holds another dataset ({other.header.label}); name another directory"


def test_load_reads_the_stored_manifest_with_the_authority_given_and_checks_the_files(tmp_path: Path) -> None:
    manifest = manifest_of(DATA)
    LocalDataset.open(tmp_path, manifest)
    write_files(tmp_path, DATA)
    local = LocalDataset.load(tmp_path, authority=b"k" * 32)
    assert local.manifest.authority == b"k" * 32 and local.whole == set(roots(manifest))
    assert LocalDataset.load(tmp_path).manifest.authority is None
    with pytest.raises(DatasetError) as e:
        LocalDataset.load(tmp_path / "nothing")
    assert str(e.value) == (f"{tmp_path / 'nothing'}: no dataset here (no {META}/manifest); "
                            "`dedloc dataset create` or `get` makes one")


# ---------------------------------------------------------------------------- the scan


def test_a_whole_file_of_the_wrong_bytes_or_size_is_not_held(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOG)
    manifest = manifest_of(DATA)
    a, b = roots(manifest)
    write_files(tmp_path, {"a.txt": b"X" + DATA["a.txt"][1:], "sub/dir/b.txt": DATA["sub/dir/b.txt"] + b"!"})
    local = LocalDataset.open(tmp_path, manifest)
    assert local.whole == set() and local.have == {a: set(), b: set()} and local.leaves == {}
    assert log_lines(caplog, LOG, str(tmp_path)) == [
        f"{tmp_path / 'a.txt'} does not match its shard's root: fetched again"]  # the wrong size is not hashed
    write_files(tmp_path, DATA)
    local = LocalDataset.open(tmp_path, manifest)
    assert local.whole == {a, b} and local.have == {} and local.leaves[a] == leaves_of(DATA["a.txt"])


def test_a_leaves_file_is_taken_only_when_it_adds_up_to_the_root(tmp_path: Path) -> None:
    manifest = manifest_of(DATA)
    a, b = roots(manifest)
    LocalDataset.open(tmp_path, manifest)
    leaves = tmp_path / META / "leaves"
    (leaves / a.hex()).write_bytes(b"".join(leaves_of(DATA["a.txt"])))
    (leaves / b.hex()).write_bytes(b"".join(leaves_of(DATA["a.txt"])[:2]))  # the right length, wrong leaves
    local = LocalDataset.open(tmp_path, manifest)
    assert local.leaves == {a: leaves_of(DATA["a.txt"])}
    (leaves / a.hex()).write_bytes(b"".join(leaves_of(DATA["a.txt"])) + bytes(32))  # one leaf too many
    assert LocalDataset.open(tmp_path, manifest).leaves == {}


def test_a_part_file_keeps_the_pieces_that_match_and_counts_the_torn_ones(tmp_path: Path) -> None:
    manifest = manifest_of(DATA)
    a, b = roots(manifest)
    local = LocalDataset.open(tmp_path, manifest)
    local.set_leaves(a, leaves_of(DATA["a.txt"]))
    for i in (0, 1, 3):
        local.write_piece(a, i, DATA["a.txt"][i * PIECE:(i + 1) * PIECE])
    part = tmp_path / META / "parts" / a.hex()
    with part.open("r+b") as f:  # pieces 0 and 1 torn; piece 2 never written (zeros: not counted)
        for offset in (3, PIECE + 3):
            f.seek(offset)
            f.write(b"torn")
    again = LocalDataset.open(tmp_path, manifest)
    assert again.have[a] == {3} and again.discarded == 2 and again.have[b] == set()
    assert part.stat().st_mode & 0o777 == 0o644
    part.write_bytes(b"")  # a part file without leaves known is not read
    (tmp_path / META / "leaves" / a.hex()).unlink()
    assert LocalDataset.open(tmp_path, manifest).discarded == 0


def test_a_part_file_found_whole_is_moved_to_its_path(tmp_path: Path) -> None:
    manifest = manifest_of(DATA)
    a, b = roots(manifest)
    local = LocalDataset.open(tmp_path, manifest)
    local.set_leaves(b, leaves_of(DATA["sub/dir/b.txt"]))
    (tmp_path / META / "parts" / b.hex()).write_bytes(DATA["sub/dir/b.txt"] + bytes(PIECE - 7))  # padded
    again = LocalDataset.open(tmp_path, manifest)
    assert b in again.whole and (tmp_path / "sub" / "dir" / "b.txt").read_bytes() == DATA["sub/dir/b.txt"]
    assert not (tmp_path / META / "parts" / b.hex()).exists() and b not in again.have


def test_refresh_takes_the_entries_added_since_and_scans_only_them(tmp_path: Path) -> None:
    manifest = manifest_of({"a.txt": DATA["a.txt"]})
    local = LocalDataset.open(tmp_path, manifest)
    me = signer()
    header = manifest.header
    write_files(tmp_path, {"c.txt": b"c" * 10})
    manifest.add(Entry.make(me, header, [shard("c.txt", b"c" * 10)], now=NOW + 1).signed)
    assert local.refresh() == [shard("c.txt", b"c" * 10)]
    assert local.whole == {shard("c.txt", b"c" * 10).root} and len(local.shards) == 2
    assert local.refresh() == []


# ---------------------------------------------------------------------------- what is held


def test_what_is_held_where_and_how_much(tmp_path: Path) -> None:
    manifest = manifest_of(DATA)
    a, b = roots(manifest)
    write_files(tmp_path, {"sub/dir/b.txt": DATA["sub/dir/b.txt"]})
    local = LocalDataset.open(tmp_path, manifest)
    local.set_leaves(a, leaves_of(DATA["a.txt"]))
    local.write_piece(a, 3, DATA["a.txt"][3 * PIECE:])
    local.write_piece(a, 1, DATA["a.txt"][PIECE:2 * PIECE])
    assert local.pieces_of(b) is None and local.pieces_of(a) == {1, 3} and local.pieces_of(b"?") == set()
    assert local.bitfield(b) == b"" and local.bitfield(a) == bytes([0b0101_0000]) and local.bitfield(b"?") is None
    assert local.held_bytes == len(DATA["sub/dir/b.txt"]) + PIECE + 100
    assert not local.complete and local.whole_paths() == [tmp_path / "sub" / "dir" / "b.txt"]
    assert local.read_leaves(a) == b"".join(leaves_of(DATA["a.txt"])) and local.read_leaves(b"?") is None
    at = local.locate_piece(a, 3)
    assert at == PieceAt(a, 3, tmp_path / META / "parts" / a.hex(), 3 * PIECE, 100, leaves_of(DATA["a.txt"])[3])
    assert local.locate_piece(b, 1) == PieceAt(b, 1, tmp_path / "sub" / "dir" / "b.txt", PIECE, 7,
                                              leaves_of(DATA["sub/dir/b.txt"])[1])
    local.set_leaves(b"?" * 32, leaves_of(DATA["a.txt"]))  # leaves of a shard the manifest does not name
    for root, index in ((a, 0), (a, 4), (a, -1), (b, 2), (b"?", 0), (b"?" * 32, 0)):
        assert local.locate_piece(root, index) is None
    assert local.read_piece(a, 1) == DATA["a.txt"][PIECE:2 * PIECE] and local.read_piece(a, 2) is None
    local.set_leaves(a, leaves_of(DATA["a.txt"])[:2])  # fewer leaves than pieces: only those are located
    assert local.locate_piece(a, 3) is None


def test_a_shard_retracted_since_it_was_held_is_not_counted(tmp_path: Path) -> None:
    me = signer()
    manifest = Manifest(Header.make(me, "wiki", "text", piece_size=PIECE, now=NOW))
    first = Entry.make(me, manifest.header, [shard("a.txt", DATA["a.txt"])], now=NOW)
    manifest.add(first.signed)
    manifest.add(Entry.make(me, manifest.header, [shard("sub/dir/b.txt", DATA["sub/dir/b.txt"])], now=NOW + 1).signed)
    write_files(tmp_path, DATA)
    local = LocalDataset.open(tmp_path, manifest)
    local.have[shard("c.txt", b"c").root] = {0}  # a part of a shard the manifest no longer names
    assert len(local.whole) == 2
    manifest.add(Entry.make(me, manifest.header, [], now=NOW + 2, retract=[first.id]).signed)
    assert local.refresh() == []
    assert local.whole_paths() == [tmp_path / "sub" / "dir" / "b.txt"]  # it raised KeyError for a.txt
    assert local.held_bytes == len(DATA["sub/dir/b.txt"]) and local.complete


def test_a_lost_piece_of_a_part_takes_that_piece_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOG)
    manifest = manifest_of(DATA)
    a, _ = roots(manifest)
    local = LocalDataset.open(tmp_path, manifest)
    local.set_leaves(a, leaves_of(DATA["a.txt"]))
    for i in (0, 1):
        local.write_piece(a, i, DATA["a.txt"][i * PIECE:(i + 1) * PIECE])
    at = local.locate_piece(a, 1)
    assert at is not None and local.lost(at, "why") and local.have[a] == {0} and local.discarded == 1
    assert log_lines(caplog, LOG, str(at.path)) == [f"{at.path}: why: no longer seeding that piece"]
    assert not local.lost(at, "again") and local.discarded == 1


# ---------------------------------------------------------------------------- fetching


def test_a_fetched_piece_is_checked_against_its_shard_and_leaf(tmp_path: Path) -> None:
    manifest = manifest_of(DATA)
    a, _ = roots(manifest)
    local = LocalDataset.open(tmp_path, manifest)
    assert local.check_piece(a, 0, DATA["a.txt"][:PIECE]) == "a piece of a shard we did not ask for"  # no leaves
    local.set_leaves(a, leaves_of(DATA["a.txt"]))
    assert (tmp_path / META / "leaves" / a.hex()).read_bytes() == b"".join(leaves_of(DATA["a.txt"]))
    assert not (tmp_path / META / "leaves" / (a.hex() + ".partial")).exists()
    for root, index in ((b"?", 0), (a, 4), (a, -1)):
        assert local.check_piece(root, index, b"") == "a piece of a shard we did not ask for"
    assert local.check_piece(a, 3, DATA["a.txt"][3 * PIECE:] + b"!") == "piece 3 of a.txt: 101 bytes, not 100"
    assert local.check_piece(a, 2, DATA["a.txt"][:PIECE]) == "piece 2 of a.txt does not match its hash"
    assert local.check_piece(a, 3, DATA["a.txt"][3 * PIECE:]) is None


def test_the_last_piece_written_moves_the_shard_to_its_path_whole(tmp_path: Path) -> None:
    manifest = manifest_of(DATA)
    _, b = roots(manifest)
    local = LocalDataset.open(tmp_path, manifest)
    local.set_leaves(b, leaves_of(DATA["sub/dir/b.txt"]))
    assert not local.write_piece(b, 1, DATA["sub/dir/b.txt"][PIECE:])
    part = tmp_path / META / "parts" / b.hex()
    assert part.read_bytes()[PIECE:] == DATA["sub/dir/b.txt"][PIECE:] and not (tmp_path / "sub").exists()
    assert local.write_piece(b, 0, DATA["sub/dir/b.txt"][:PIECE])
    assert (tmp_path / "sub" / "dir" / "b.txt").read_bytes() == DATA["sub/dir/b.txt"] and not part.exists()
    assert b in local.whole and b not in local.have
    assert not local.write_piece(b, 0, DATA["sub/dir/b.txt"][:PIECE])  # whole already: nothing written
    assert not part.exists()


def test_whole_paths_are_in_the_order_of_the_shards_paths(tmp_path: Path) -> None:
    files = {f"{name}.txt": name.encode() * 10 for name in ("e", "b", "d", "a", "c", "f")}
    write_files(tmp_path, files)
    local = LocalDataset.open(tmp_path, manifest_of(files))
    assert local.whole_paths() == [tmp_path / name for name in sorted(files)]


def test_a_closed_swarms_retraction_kept_on_disk_is_honoured_when_the_directory_is_opened_again(
        tmp_path: Path) -> None:
    key = SigningKey.generate()
    authority = bytes(key.verify_key)
    manifest = manifest_of(DATA)
    manifest.authority = authority
    (entry,) = manifest.entries.values()
    manifest.add(sign_by_authority(key, manifest.header, [entry.id], now=NOW + 1))
    LocalDataset.open(tmp_path, manifest)
    fresh = Manifest(manifest.header, authority=authority)
    LocalDataset.open(tmp_path, fresh)
    assert fresh.by_authority.keys() == manifest.by_authority.keys() and fresh.shards() == []


# ---------------------------------------------------------------------- one process per directory

def test_a_directory_is_held_by_one_holder_at_a_time_and_free_once_released(tmp_path: Path) -> None:
    import os

    from training.datasets.store import lock_directory

    first = lock_directory(tmp_path / "data")
    assert (tmp_path / "data" / META / "lock").read_text() == str(os.getpid())
    with pytest.raises(DatasetError) as refused:  # another descriptor: as another process would be
        lock_directory(tmp_path / "data")
    assert str(refused.value) == (f"{tmp_path / 'data'} is in use by another dedloc process (pid {os.getpid()}); "
                                  "wait for it to end, or name another directory")
    first.release()
    first.release()  # twice: nothing
    lock_directory(tmp_path / "data").release()


def test_a_directory_held_by_another_process_is_refused_until_it_ends_even_killed(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from training.datasets.store import lock_directory

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib; from training.datasets.store import lock_directory; "
         f"lock_directory(pathlib.Path({str(tmp_path)!r})); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(DatasetError, match=rf"in use by another dedloc process \(pid {holder.pid}\)"):
            lock_directory(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: the kernel drops its lock, no stale file locks us out
        holder.wait(timeout=20)
    lock_directory(tmp_path).release()
