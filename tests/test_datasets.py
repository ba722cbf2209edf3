"""Datasets' pure parts in milliseconds: the hash tree, signed manifests, the on-disk store, and the DHT's
content-addressed subkeys they live under (the piece picker, the seeder table and the upload pacer:
test_picker)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from p2p.dht.records import ContentMismatch, DHTRecord, LocalStore, content_subkey
from p2p.identity import new_identity, peer_id_of
from training.datasets.manifest import (
    DatasetError,
    Entry,
    Header,
    Manifest,
    ManifestError,
    Shard,
    resolve,
    schema_of,
)
from training.datasets.pieces import check_leaves, leaf, merkle_root, piece_count, piece_span, split_leaves
from training.datasets.store import LocalDataset, from_bits
from training.proto import datasets_pb2 as pb

NOW = 1_800_000_000.0
PIECE = 16 * 1024


@dataclass
class KeySigner:
    pair: KeyPair

    @property
    def peer_id(self) -> ID:
        return peer_id_of(self.pair)

    @property
    def public_key(self) -> bytes:
        return bytes(self.pair.public_key.serialize())

    def sign(self, data: bytes) -> bytes:
        return bytes(self.pair.private_key.sign(data))


def signer() -> KeySigner:
    return KeySigner(new_identity())


def leaves_of(data: bytes, piece: int = PIECE) -> list[bytes]:
    return [leaf(data[i:i + piece]) for i in range(0, len(data), piece)]


def shard(path: str, data: bytes, piece: int = PIECE) -> Shard:
    return Shard(path, len(data), merkle_root(leaves_of(data, piece)))


def manifest_of(files: dict[str, bytes], name: str = "wiki") -> Manifest:
    """A dataset ``name`` by a fresh creator: one entry of ``files`` (path -> bytes), pieces of PIECE."""
    me = signer()
    header = Header.make(me, name, "text", piece_size=PIECE, now=NOW)
    manifest = Manifest(header)
    manifest.add(Entry.make(me, header, [shard(p, d) for p, d in files.items()], now=NOW).signed)
    return manifest


def write_files(directory: Path, files: dict[str, bytes]) -> Path:
    """``files`` (relative path -> bytes) written under ``directory``, made as need be; ``directory``."""
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


# ---------------------------------------------------------------------- the hash tree

def test_the_root_pads_leaves_to_a_power_of_two_and_checks_any_leaf_set() -> None:
    leaves = [leaf(bytes([i])) for i in range(3)]
    import hashlib

    def h(a: bytes, b: bytes) -> bytes:
        return hashlib.sha256(a + b).digest()

    assert merkle_root(leaves) == h(h(leaves[0], leaves[1]), h(leaves[2], bytes(32)))
    assert merkle_root(leaves[:1]) == leaves[0]
    size = 2 * PIECE + 5
    raw = b"".join(leaves)
    assert check_leaves(raw, merkle_root(leaves), size, PIECE) == leaves
    assert "do not add up" in str(check_leaves(raw[::-1], merkle_root(leaves), size, PIECE))
    assert "3 pieces" in str(check_leaves(raw[:64], merkle_root(leaves), size, PIECE))
    assert piece_count(size, PIECE) == 3 and piece_span(2, size, PIECE) == (2 * PIECE, 5)
    with pytest.raises(IndexError):
        piece_span(3, size, PIECE)
    assert split_leaves(raw) == leaves


# ---------------------------------------------------------------------- signed manifests

def test_a_header_is_content_addressed_and_refused_when_its_signature_or_creator_is_wrong() -> None:
    me = signer()
    header = Header.make(me, "wiki", "text", piece_size=PIECE, now=NOW)
    assert Header.parse(header.signed) == header and header.creator == me.peer_id
    signed = pb.Signed.FromString(header.signed)
    body = pb.Header.FromString(signed.body)
    body.name = "other"
    tampered = pb.Signed(body=body.SerializeToString(), public_key=signed.public_key, signature=signed.signature,
                         kind="header").SerializeToString()
    with pytest.raises(ManifestError, match="signature does not match"):
        Header.parse(tampered)
    other = signer()  # signs a header that names me as its creator
    forged = pb.Header(name="wiki", schema="text", piece_size=PIECE, creator=me.peer_id.to_bytes(), created=NOW)
    from training.datasets.manifest import sign
    with pytest.raises(ManifestError, match="signed by"):
        Header.parse(sign(other, "header", forged.SerializeToString()))
    with pytest.raises(ManifestError, match="where a header was expected"):
        Header.parse(sign(me, "entry", forged.SerializeToString()))
    with pytest.raises(ManifestError, match="piece size"):
        Header.parse(sign(me, "header", pb.Header(name="w", schema="text", piece_size=1000,
                                                  creator=me.peer_id.to_bytes()).SerializeToString()))
    with pytest.raises(DatasetError, match="dataset name"):
        Header.make(me, "../etc", "text", piece_size=PIECE, now=NOW)


@pytest.mark.parametrize("path", ["../escape.txt", "/abs.txt", "a/../b.txt", ".dedloc/manifest", "a//b.txt", "",
                                  "a\\b.txt", "./a.txt"])
def test_an_entry_whose_path_could_leave_the_directory_is_refused(path: str) -> None:
    me = signer()
    header = Header.make(me, "wiki", "text", piece_size=PIECE, now=NOW)
    with pytest.raises(ManifestError, match="plain relative path"):
        Entry.make(me, header, [Shard(path, 10, bytes(32))], now=NOW)


async def test_the_backbone_keeps_credit_for_shards_a_later_read_missed_and_drops_retracted_ones(tmp_path: Path) -> None:
    """The backbone reads a dataset's manifest from the DHT at every turn; a read that missed an entry
    (a replica behind, or cut short by its timeout: CI once read the adder's shards as 0 so) must
    not take its author's credit back. A retraction is an entry too, and it does."""
    from training.monitor import Monitor

    creator, adder = signer(), signer()
    header = Header.make(creator, "wiki", "text", piece_size=PIECE, now=NOW)
    first = Entry.make(creator, header, [Shard("a.txt", 10, b"\x01" * 32), Shard("b.txt", 10, b"\x02" * 32)], now=NOW)
    added = Entry.make(adder, header, [Shard("c.txt", 10, b"\x03" * 32)], now=NOW + 1)
    retract = Entry.make(creator, header, [], now=NOW + 2, retract=[added.id])

    class Reads:  # what Datasets.find and .seeders give the backbone, read after read
        def __init__(self) -> None:
            self.entries: list[Entry] = []

        async def find(self, name: str) -> Manifest:
            m = Manifest(header)
            for e in self.entries:
                m.add(e.signed)
            return m

        async def seeders(self, dataset: bytes) -> list[object]:
            return []

    reads, monitor = Reads(), Monitor(tmp_path)

    async def shards_added() -> dict[str, int]:
        await monitor.observe_datasets(reads, ["wiki"], now=0.0)  # type: ignore[arg-type]
        return {p: row["shards_added"] for p, row in monitor.data.leaderboard().items()}

    reads.entries = [first, added]
    assert await shards_added() == {str(creator.peer_id): 2, str(adder.peer_id): 1}
    reads.entries = [first]  # the next read missed the adder's entry
    assert await shards_added() == {str(creator.peer_id): 2, str(adder.peer_id): 1}
    reads.entries = [retract]  # the creator took it out (and this read missed the rest)
    assert await shards_added() == {str(creator.peer_id): 2}


def test_entries_are_refused_with_their_reason_and_nothing_of_them_is_kept() -> None:
    creator, volunteer = signer(), signer()
    header = Header.make(creator, "wiki", "text", piece_size=PIECE, now=NOW)
    other = Header.make(creator, "books", "text", piece_size=PIECE, now=NOW)
    manifest = Manifest(header)
    good = Entry.make(volunteer, header, [Shard("a.txt", 10, bytes(32))], now=NOW)
    assert manifest.add(good.signed) == good
    assert manifest.add(Entry.make(volunteer, other, [Shard("b.txt", 10, bytes(32))], now=NOW).signed) is None
    from training.datasets.manifest import sign
    retraction = pb.Entry(dataset=header.id, author=volunteer.peer_id.to_bytes(), created=NOW, retract=[good.id])
    assert manifest.add(sign(volunteer, "entry", retraction.SerializeToString())) is None
    assert manifest.add(b"\x00garbage") is None
    reasons = " | ".join(why for _, why in manifest.refused)
    assert "another dataset" in reasons and "did not create the dataset" in reasons and "does not parse" in reasons
    assert [s.path for s in manifest.shards()] == ["a.txt"]


def test_the_grow_only_set_merges_to_the_same_shards_in_any_order_and_the_creator_retracts() -> None:
    creator, a, b = signer(), signer(), signer()
    header = Header.make(creator, "wiki", "text", piece_size=PIECE, now=NOW)
    e1 = Entry.make(a, header, [Shard("x.txt", 10, b"\x01" * 32)], now=NOW + 1)
    e2 = Entry.make(b, header, [Shard("x.txt", 20, b"\x02" * 32), Shard("y.txt", 5, b"\x03" * 32)], now=NOW + 2)
    e3 = Entry.make(b, header, [Shard("z.txt", 5, b"\x01" * 32)], now=NOW + 3)  # the same root as x.txt: kept once
    orders = [[e1, e2, e3], [e3, e2, e1], [e2, e3, e1]]
    results = []
    for order in orders:
        m = Manifest(header)
        for e in order:
            m.add(e.signed)
        results.append(m.shards())
    assert results[0] == results[1] == results[2]
    assert [(s.path, s.size) for s in results[0]] == [("x.txt", 10), ("y.txt", 5)]
    m = Manifest(header)
    for e in (e1, e2, e3):
        m.add(e.signed)
    m.add(Entry.make(creator, header, [], now=NOW + 4, retract=[e1.id]).signed)
    assert [(s.path, s.size) for s in m.shards()] == [("x.txt", 20), ("y.txt", 5), ("z.txt", 5)]
    again = Manifest.from_stored(m.stored())
    assert again.shards() == m.shards() and again.header == header


def test_a_name_several_creators_used_needs_the_creator_and_the_error_lists_them() -> None:
    one, two = signer(), signer()
    h1 = Header.make(one, "wiki", "text", piece_size=PIECE, now=NOW)
    h2 = Header.make(two, "wiki", "jsonl", piece_size=PIECE, now=NOW)
    h3 = Header.make(one, "books", "text", piece_size=PIECE, now=NOW)
    with pytest.raises(DatasetError, match="2 datasets are named 'wiki'") as e:
        resolve([h1, h2, h3], "wiki")
    assert h1.label in str(e.value) and h2.label in str(e.value)
    assert resolve([h1, h2, h3], f"wiki@{str(two.peer_id)[-6:]}") == h2
    assert resolve([h1, h2, h3], "books") == h3
    assert resolve([h1, h2, h3], h2.id.hex()[:10]) == h2
    with pytest.raises(DatasetError, match="no dataset 'nope'"):
        resolve([h1], "nope")


def test_a_dataset_holds_one_schema() -> None:
    assert schema_of(["a.txt", "b.TXT"]) == "text"
    with pytest.raises(DatasetError, match="2 formats"):
        schema_of(["a.txt", "b.jsonl"])
    with pytest.raises(DatasetError, match="unknown shard format"):
        schema_of(["a.csv"])


# ---------------------------------------------------------------------- content-addressed DHT subkeys

def test_a_content_addressed_subkey_holds_only_the_bytes_it_names() -> None:
    store = LocalStore()
    value = b"signed entry"
    sub = content_subkey(value, "e")
    assert store.store(DHTRecord.make("k", value, NOW + 60, sub), NOW)
    with pytest.raises(ContentMismatch):
        store.store(DHTRecord.make("k", b"junk with a later expiration", NOW + 3600, sub), NOW)
    with pytest.raises(ContentMismatch, match="malformed"):
        store.store(DHTRecord.make("k", value, NOW + 60, "e[sha256:abc]"), NOW)
    assert store.get("k", NOW) == {sub: (value, NOW + 60)}
    assert store.store(DHTRecord.make("k", value, NOW + 120, sub), NOW)  # anyone re-publishes the same bytes


# ---------------------------------------------------------------------- the store

def make_local(tmp: Path, data: dict[str, bytes]) -> tuple[LocalDataset, Manifest]:
    manifest = manifest_of(data)
    return LocalDataset.open(tmp, manifest), manifest


def test_a_shard_reaches_its_path_only_whole_and_checked_and_a_restart_resumes(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(3 * PIECE + 100)
    local, manifest = make_local(tmp_path / "d", {"s.txt": data})
    s = manifest.shards()[0]
    leaves = leaves_of(data)
    local.set_leaves(s.root, leaves)
    assert local.check_piece(s.root, 1, data[:PIECE]) == "piece 1 of s.txt does not match its hash"
    assert local.check_piece(s.root, 3, data[3 * PIECE:]) is None
    assert not local.write_piece(s.root, 3, data[3 * PIECE:])
    assert not local.write_piece(s.root, 0, data[:PIECE])
    assert not (tmp_path / "d" / "s.txt").exists()
    assert local.bitfield(s.root) == bytes([0b10010000]) and from_bits(bytes([0b10010000]), 4) == {0, 3}
    # a restart: the pieces on disk are checked again; one torn by a crash is dropped
    part = tmp_path / "d" / ".dedloc" / "parts" / s.root.hex()
    with part.open("r+b") as f:
        f.seek(10)
        f.write(b"torn")
    again = LocalDataset.open(tmp_path / "d", Manifest.from_stored(manifest.stored()))
    assert again.pieces_of(s.root) == {3} and again.discarded == 1
    for i in (0, 1, 2):
        assert again.write_piece(s.root, i, data[i * PIECE:(i + 1) * PIECE]) == (i == 2)
    assert (tmp_path / "d" / "s.txt").read_bytes() == data
    assert again.read_piece(s.root, 1) == data[PIECE:2 * PIECE] and again.bitfield(s.root) == b""
    (tmp_path / "d" / "s.txt").write_bytes(data[:-1] + b"!")  # changed on disk: not whole any more
    assert LocalDataset.open(tmp_path / "d", manifest).pieces_of(s.root) == set()


def test_a_piece_is_checked_again_as_it_is_read_to_be_served(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file edited, cut short or rotted after it was checked: never served, its shard no longer held."""
    rng = random.Random(2)
    data = {"a.txt": rng.randbytes(3 * PIECE), "b.txt": rng.randbytes(2 * PIECE + 7)}
    local, manifest = make_local(write_files(tmp_path / "d", data), data)
    a, b = sorted(manifest.shards(), key=lambda s: s.path)
    assert local.whole == {a.root, b.root} and local.read_piece(a.root, 2) == data["a.txt"][2 * PIECE:]
    with (tmp_path / "d" / "a.txt").open("r+b") as f:  # edited in place, the same size: only the hash tells
        f.seek(PIECE + 5)
        f.write(b"EDITED")
    assert local.read_piece(a.root, 0) == data["a.txt"][:PIECE]  # a piece not touched still reads
    with caplog.at_level("WARNING", logger="training.datasets.store"):
        assert local.read_piece(a.root, 1) is None
    assert "a.txt: piece 1 does not match its hash: the file changed on disk since it was checked: " \
           "no longer seeding it" in caplog.text
    assert a.root not in local.whole and local.pieces_of(a.root) == set() and local.bitfield(a.root) is None
    assert local.read_piece(a.root, 0) is None and local.discarded == 1
    at = local.locate_piece(b.root, 2)
    assert at is not None and at.length == 7
    (tmp_path / "d" / "b.txt").write_bytes(data["b.txt"][:-3])  # cut short
    assert local.read_piece(b.root, 2) is None and b.root not in local.whole
    assert not local.lost(at, "again")  # found once: a second read's failure changes nothing
    assert local.discarded == 2
    # Checking the directory again takes back what matches.
    (tmp_path / "d" / "b.txt").write_bytes(data["b.txt"])
    assert LocalDataset.load(tmp_path / "d").whole == {b.root}


def test_a_directory_of_another_dataset_is_refused(tmp_path: Path) -> None:
    make_local(tmp_path / "d", {"s.txt": b"x" * 100})
    with pytest.raises(DatasetError, match="holds another dataset"):
        make_local(tmp_path / "d", {"s.txt": b"y" * 100})
    with pytest.raises(DatasetError, match="no dataset here"):
        LocalDataset.load(tmp_path)


# ---------------------------------------------------------------------- training's reader of arriving shards

def test_the_reader_waits_for_the_first_shard_and_takes_new_ones_during_a_pass(tmp_path: Path) -> None:
    import threading

    from training.data import DataConfig, DataError, ExampleStream, ShardSource

    for i in range(3):
        (tmp_path / f"s{i}.txt").write_text("\n".join(f"shard{i} line{j}" for j in range(5)))
    source = ShardSource("wiki", timeout=5.0)
    stream = iter(ExampleStream(DataConfig(files=(), shuffle_buffer=1, seed=0, passes=1), source))
    threading.Timer(0.05, source.add, [tmp_path / "s0.txt"]).start()
    assert next(stream).startswith("shard0")  # waited for it
    source.add(tmp_path / "s1.txt")
    rest = list(_take(stream, 4))
    source.add(tmp_path / "s2.txt")
    rest += list(stream)
    assert sorted(x.split()[0] for x in rest).count("shard1") == 5 and "shard2 line0" in rest

    late = ShardSource("wiki", timeout=0.05)
    with pytest.raises(DataError, match="no shard arrived within 0.05 s"):
        next(iter(ExampleStream(DataConfig(files=()), late)))
    failed = ShardSource("wiki")
    failed.fail("no seeder of wiki reached")
    with pytest.raises(DataError, match="swarm:wiki: no seeder of wiki reached"):
        next(iter(ExampleStream(DataConfig(files=()), failed)))


def _take(it: object, n: int) -> list[str]:
    return [next(it) for _ in range(n)]  # type: ignore[call-overload]


# ---------------------------------------------------------------------- a closed swarm's authority

def test_a_closed_swarms_authority_retracts_any_entry_and_nobody_else_can_sign_as_it() -> None:
    from nacl.signing import SigningKey

    from training.datasets.manifest import sign_by_authority

    creator, volunteer = signer(), signer()
    authority, impostor = SigningKey.generate(), SigningKey.generate()
    header = Header.make(creator, "wiki", "text", piece_size=PIECE, now=NOW)
    mine = Entry.make(creator, header, [Shard("a.txt", 10, b"\x01" * 32)], now=NOW)
    theirs = Entry.make(volunteer, header, [Shard("b.txt", 10, b"\x02" * 32)], now=NOW + 1)
    closed = Manifest(header, authority=bytes(authority.verify_key))
    for e in (mine, theirs):
        closed.add(e.signed)
    closed.add(sign_by_authority(impostor, header, [mine.id], now=NOW + 2))
    assert [s.path for s in closed.shards()] == ["a.txt", "b.txt"]
    assert "another key than the swarm's authority" in closed.refused[-1][1]
    forged = pb.Signed.FromString(sign_by_authority(impostor, header, [mine.id], now=NOW + 2))
    forged.public_key = bytes(authority.verify_key)  # the authority's key named, the impostor's signature
    closed.add(forged.SerializeToString())
    assert "signature does not match" in closed.refused[-1][1] and len(closed.shards()) == 2
    retraction = sign_by_authority(authority, header, [theirs.id, mine.id], now=NOW + 3)
    closed.add(retraction)
    assert closed.shards() == [] and closed.retracted() == {theirs.id, mine.id}
    again = Manifest.from_stored(closed.stored(), bytes(authority.verify_key))
    assert again.shards() == []  # kept with the files, honoured again
    opened = Manifest(header)  # an open swarm has no authority: the same bytes are refused
    for e in (mine, theirs):
        opened.add(e.signed)
    opened.add(retraction)
    assert [s.path for s in opened.shards()] == ["a.txt", "b.txt"]
    assert "a swarm that has none" in opened.refused[-1][1]


def test_garbled_headers_and_entries_are_refused_each_with_its_reason() -> None:
    """Every check of Header.parse and Entry.parse on its own, matched on its whole message."""
    import re

    from libp2p.crypto.secp256k1 import create_new_key_pair

    from training.datasets.manifest import MAX_ENTRIES, MAX_SHARDS_PER_ENTRY, sign
    from training.datasets.pieces import MAX_PIECE_SIZE, MAX_PIECES, MIN_PIECE_SIZE

    me, other = signer(), signer()
    ok = dict(name="wiki", schema="text", piece_size=PIECE, creator=me.peer_id.to_bytes(), created=NOW)

    def header(**changes: object) -> bytes:
        return sign(me, "header", pb.Header(**{**ok, **changes}).SerializeToString())  # type: ignore[arg-type]

    size_rule = f"(a power of two from {MIN_PIECE_SIZE} to {MAX_PIECE_SIZE})"
    secp = create_new_key_pair()
    for raw, why in [
        (b"\xff", "a signed header that does not parse: "),
        (sign(me, "header", b"\xff"), "a header that does not parse: "),
        (header(creator=b"\x01"), f"a header naming 2 as creator, signed by {me.peer_id}"),
        (header(name="../x"), "a header with an invalid name '../x'"),
        (header(schema="csv"), "a header with an unknown schema 'csv'"),
        (header(piece_size=MIN_PIECE_SIZE // 2), f"a header with a piece size of {MIN_PIECE_SIZE // 2} bytes {size_rule}"),
        (header(piece_size=MAX_PIECE_SIZE * 2), f"a header with a piece size of {MAX_PIECE_SIZE * 2} bytes {size_rule}"),
        (header(piece_size=PIECE + 1), f"a header with a piece size of {PIECE + 1} bytes"),
        (header(created=float("nan")), "a header with a bad time or text field"),
        (header(text_field="t" * 101), "a header with a bad time or text field"),
        (pb.Signed(body=b"", public_key=b"junk", signature=b"", kind="header").SerializeToString(),
         "the header's public key does not parse"),
        (pb.Signed(body=b"", public_key=secp.public_key.serialize(), signature=b"", kind="header").SerializeToString(),
         "the header is not signed with an Ed25519 key"),
        (pb.Signed(body=header(), public_key=me.public_key, signature=b"short", kind="header").SerializeToString(),
         "the header's signature does not match its content"),
    ]:
        with pytest.raises(ManifestError, match="^" + re.escape(why)):
            Header.parse(raw)
    # the edges that pass: the smallest and largest piece sizes, a text field of 100, an empty one read as "text"
    assert Header.parse(header(piece_size=MIN_PIECE_SIZE)).piece_size == MIN_PIECE_SIZE
    assert Header.parse(header(piece_size=MAX_PIECE_SIZE)).piece_size == MAX_PIECE_SIZE
    h = Header.parse(header(text_field="t" * 100))
    assert (h.name, h.schema, h.creator, h.created, h.text_field) == ("wiki", "text", me.peer_id, NOW, "t" * 100)
    assert Header.parse(header(text_field="")).text_field == "text"
    assert Header.make(me, "wiki", "jsonl", piece_size=PIECE, now=NOW, text_field="body").text_field == "body"
    with pytest.raises(DatasetError, match=r"^schema 'csv': use one of text, jsonl, parquet$"):
        Header.make(me, "wiki", "csv", piece_size=PIECE, now=NOW)
    with pytest.raises(DatasetError, match=r"^dataset name '\.x': use 1-64 letters, digits, '\.', '_' or '-', "
                                           r"starting with a letter or digit$"):
        Header.make(me, ".x", "text", piece_size=PIECE, now=NOW)

    hd = Header.make(me, "wiki", "text", piece_size=PIECE, now=NOW)
    good_shard = pb.Shard(path="a.txt", size=10, root=bytes(32))
    base = dict(dataset=hd.id, author=me.peer_id.to_bytes(), created=NOW, shards=[good_shard])

    def entry(by: KeySigner = me, **changes: object) -> bytes:
        return sign(by, "entry", pb.Entry(**{**base, **changes}).SerializeToString())  # type: ignore[arg-type]

    for raw, why in [
        (sign(me, "entry", b"\xff"), "an entry that does not parse: "),
        (entry(dataset=bytes(32)), "an entry of another dataset"),
        (entry(author=b"\x01"), f"an entry naming 2 as author, signed by {me.peer_id}"),
        (entry(other), f"an entry naming {me.peer_id} as author, signed by {other.peer_id}"),
        (entry(shards=[good_shard] * (MAX_SHARDS_PER_ENTRY + 1)),
         f"an entry with {MAX_SHARDS_PER_ENTRY + 1} shards (at most {MAX_SHARDS_PER_ENTRY})"),
        (entry(retract=[bytes(32)] * (MAX_ENTRIES + 1)), "an entry with 1 shards"),
        (entry(shards=[]), "an empty entry"),
        (entry(created=float("inf")), "an entry with a bad time"),
        (entry(shards=[pb.Shard(path="a.txt", size=10, root=bytes(31))]), "shard 'a.txt': a root of 31 bytes"),
        (entry(shards=[pb.Shard(path="a.txt", size=0, root=bytes(32))]), f"shard 'a.txt': 0 bytes (1 to {MAX_PIECES} pieces)"),
        (entry(shards=[pb.Shard(path="a.txt", size=PIECE * MAX_PIECES + 1, root=bytes(32))]),
         f"shard 'a.txt': {PIECE * MAX_PIECES + 1} bytes"),
        (entry(retract=[b"short"]), "a retraction of something that is not an entry id"),
    ]:
        with pytest.raises(ManifestError, match="^" + re.escape(why)):
            Entry.parse(raw, hd)
    # the edges that pass: as many shards as allowed, the most pieces, a path of 255 characters
    most = Entry.parse(entry(shards=[pb.Shard(path=f"{i}.txt", size=PIECE * MAX_PIECES, root=bytes(32))
                                     for i in range(MAX_SHARDS_PER_ENTRY)]), hd)
    assert len(most.shards) == MAX_SHARDS_PER_ENTRY and most.shards[0].pieces(PIECE) == MAX_PIECES
    long = "d/" * 126 + "abc"
    assert len(long) == 255 and Entry.parse(entry(shards=[pb.Shard(path=long, size=1, root=bytes(32))]), hd)
    with pytest.raises(ManifestError, match="is not a plain relative path"):
        Entry.parse(entry(shards=[pb.Shard(path=long + "d", size=1, root=bytes(32))]), hd)
    e = Entry.parse(entry(retract=[bytes(32)]), hd)
    assert (e.dataset, e.author, e.created, e.retract) == (hd.id, me.peer_id, NOW, (bytes(32),))


def test_authors_are_credited_per_live_shard_and_names_resolve_to_one_dataset() -> None:
    creator, a, b = signer(), signer(), signer()
    header = Header.make(creator, "wiki", "text", piece_size=PIECE, now=NOW)
    manifest = Manifest(header)
    manifest.add(Entry.make(a, header, [Shard("1.txt", 10, bytes(32)), Shard("2.txt", 10, b"\x01" * 32)], now=NOW).signed)
    manifest.add(Entry.make(b, header, [Shard("3.txt", 10, b"\x02" * 32)], now=NOW).signed)
    assert manifest.authors() == {a.peer_id: 2, b.peer_id: 1}
    newer = Header.make(creator, "wiki", "text", piece_size=PIECE, now=NOW + 5)
    assert resolve([header, newer], "wiki") == newer  # one creator's: the newest
    assert resolve([header, newer], header.id.hex()[:8]) == header
    assert resolve([header, newer], f"wiki@{str(creator.peer_id)[-6:]}") == newer
    rival = Header.make(a, "wiki", "text", piece_size=PIECE, now=NOW)
    with pytest.raises(DatasetError, match=r"^2 datasets are named 'wiki', by different creators: name one as "):
        resolve([newer, rival], "wiki")
    with pytest.raises(DatasetError, match=r"^no dataset 'nope' in the swarm \(`dedloc dataset list` shows those "
                                           r"there are\)$"):
        resolve([header], "nope")
    with pytest.raises(DatasetError, match=r"^shards of 2 formats \(jsonl, text\); a dataset holds one$"):
        schema_of(["a.txt", "b.jsonl"])
    with pytest.raises(DatasetError, match=r"^shards of 0 formats \(none\); a dataset holds one$"):
        schema_of([])


def test_an_authority_retraction_is_refused_with_its_reason() -> None:
    import re

    from nacl.signing import SigningKey

    from training.datasets.manifest import AUTHORITY_RETRACTION, parse_authority_retraction, sign_by_authority

    creator = signer()
    key, other = SigningKey.generate(), SigningKey.generate()
    authority = bytes(key.verify_key)
    header = Header.make(creator, "wiki", "text", piece_size=PIECE, now=NOW)
    books = Header.make(creator, "books", "text", piece_size=PIECE, now=NOW)
    good = sign_by_authority(key, header, [bytes(32)], now=NOW)
    assert parse_authority_retraction(good, header, authority) == (bytes(32),)
    body = pb.Entry.FromString(pb.Signed.FromString(good).body)
    assert body.created == NOW and body.retract == [bytes(32)]

    def signed(entry: pb.Entry) -> bytes:
        """``entry`` signed by the authority as sign_by_authority signs (one of its retract ids malformed)."""
        from training.datasets.manifest import _payload

        raw = entry.SerializeToString()
        return pb.Signed(body=raw, public_key=authority, signature=key.sign(_payload(AUTHORITY_RETRACTION, raw)).signature,
                         kind=AUTHORITY_RETRACTION).SerializeToString()

    for raw, auth, why in [
        (b"\xff", authority, "an authority's retraction that does not parse: "),
        (good, None, "a retraction by an authority, in a swarm that has none"),
        (sign_by_authority(other, header, [bytes(32)], now=NOW), authority,
         "a retraction signed by another key than the swarm's authority"),
        (pb.Signed(body=pb.Signed.FromString(good).body, public_key=authority, signature=bytes(64),
                   kind=AUTHORITY_RETRACTION).SerializeToString(), authority,
         "the authority's retraction's signature does not match its content"),
        (sign_by_authority(key, books, [bytes(32)], now=NOW), authority,
         "an authority's retraction of another dataset, or of nothing"),
        (sign_by_authority(key, header, [], now=NOW), authority,
         "an authority's retraction of another dataset, or of nothing"),
        (sign_by_authority(key, header, [b"short"], now=NOW), authority,
         "an authority's retraction of another dataset, or of nothing"),
        (signed(pb.Entry(dataset=header.id, retract=[bytes(32), b"x"])), authority,
         "an authority's retraction of another dataset, or of nothing"),
    ]:
        with pytest.raises(ManifestError, match="^" + re.escape(why)):
            parse_authority_retraction(raw, header, auth)
