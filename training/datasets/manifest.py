"""A dataset's manifest: a signed header and a grow-only set of signed entries (pure).

Hydra's datasets are crowd-sourced: any allowed peer adds shards, and the
metadata must survive every single peer leaving. So a dataset here is

* a **header** (name, schema, piece size, creator) signed by its creator; its
  **id** is the SHA-256 of the signed bytes (content-addressed: the id names
  exactly one header);
* a set of **entries**, each signed by its author: shards (path, size, hash
  root over pieces, :mod:`.pieces`) and, in an entry of the creator's only,
  the ids of entries it retracts; in a closed swarm its **authority** retracts
  too (:func:`sign_by_authority`: signed with the run's authority key, which
  every member knows from its pass; honoured only where that key is the one).

Entries merge without coordination: the set only grows, every peer that
holds the same entries computes the same shard list (:meth:`Manifest.shards`:
retractions applied, a path claimed twice going to the earliest entry, then the
lowest id). No total order is needed, so no consensus either
(docs/ARCHITECTURE.md says which of Raft's guarantees this needs and which it
does not). The DHT keeps each signed object under a content-addressed subkey
(``p2p.dht.records.content_subkey``): every storing node checks that the value
is the one the subkey names, so anyone who holds an entry may re-publish it
after its author left, and nobody can replace it.

Everything a peer sends is checked here before it is used, and refused with
the reason (:class:`ManifestError`): a signature that does not verify, a signer
other than the creator or author it names, a path that escapes the dataset's
directory, a root of the wrong length, an entry of another dataset.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from libp2p.crypto.keys import KeyType
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID

from p2p.errors import DedlocError, RemoteProtocolError

from ..proto import datasets_pb2 as pb
from .pieces import HASH_SIZE, MAX_PIECE_SIZE, MAX_PIECES, MIN_PIECE_SIZE, piece_count

#: Shard formats, as training's shard reader reads them.
SCHEMAS = ("text", "jsonl", "parquet")
#: File suffix -> schema.
SUFFIXES = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
#: Shards one entry may carry (an entry is one DHT value: 64 KiB at most).
MAX_SHARDS_PER_ENTRY = 256
#: Entries a manifest takes (the DHT holds at most 1024 subkeys per key).
MAX_ENTRIES = 1000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
_DOMAIN = b"dedloc-dataset:v1\x00"


class DatasetError(DedlocError):
    """A dataset cannot be used as asked: unknown, ambiguous, a bad name or directory."""


class ManifestError(DatasetError, RemoteProtocolError):
    """A header or entry from the swarm that is refused (the message says why)."""


class Signer(Protocol):
    """Who signs: a peer's identity (``nat.Peer`` is one)."""

    @property
    def peer_id(self) -> ID: ...

    @property
    def public_key(self) -> bytes:
        """The libp2p protobuf encoding of our public key."""
        ...

    def sign(self, data: bytes) -> bytes: ...


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise DatasetError(f"dataset name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
                           "starting with a letter or digit")
    return name


def check_path(path: str) -> str:
    """A shard's relative path, refused if it could leave the dataset's directory."""
    parts = PurePosixPath(path).parts
    if (not path or len(path) > 255 or path.startswith("/") or "\\" in path or "\x00" in path
            or any(p in ("..", ".") for p in parts) or parts[0] == ".dedloc" or path != "/".join(parts)):
        raise ManifestError(f"shard path {path[:80]!r} is not a plain relative path inside the dataset")
    return path


def _payload(kind: str, body: bytes) -> bytes:
    return _DOMAIN + kind.encode() + b"\x00" + body


def sign(signer: Signer, kind: str, body: bytes) -> bytes:
    """``body`` (a Header or an Entry) as a Signed message of ``signer``'s."""
    return pb.Signed(body=body, public_key=signer.public_key, signature=signer.sign(_payload(kind, body)),
                     kind=kind).SerializeToString()


def open_signed(raw: bytes, kind: str) -> tuple[bytes, ID]:
    """(body, signer) of a Signed message, or :class:`ManifestError` saying why it is refused."""
    try:
        signed = pb.Signed.FromString(raw)
    except DecodeError as e:
        raise ManifestError(f"a signed {kind} that does not parse: {e}") from None
    if signed.kind != kind:
        raise ManifestError(f"a signed {signed.kind[:20]!r} where a {kind} was expected")
    try:
        key = deserialize_public_key(signed.public_key)
    except Exception:
        raise ManifestError(f"the {kind}'s public key does not parse") from None
    if key.get_type() != KeyType.Ed25519:
        raise ManifestError(f"the {kind} is not signed with an Ed25519 key")
    try:
        ok = key.verify(_payload(kind, signed.body), signed.signature)
    except Exception:
        ok = False
    if not ok:
        raise ManifestError(f"the {kind}'s signature does not match its content")
    return signed.body, ID.from_pubkey(key)


def _kind(raw: bytes) -> str:
    try:
        return pb.Signed.FromString(raw).kind
    except DecodeError:
        return ""


def object_id(raw: bytes) -> bytes:
    """The content address of a signed header or entry."""
    return hashlib.sha256(raw).digest()


@dataclass(frozen=True)
class Shard:
    path: str
    size: int
    root: bytes

    def pieces(self, piece_size: int) -> int:
        return piece_count(self.size, piece_size)


@dataclass(frozen=True)
class Header:
    id: bytes
    name: str
    schema: str
    piece_size: int
    creator: ID
    created: float
    text_field: str
    signed: bytes = field(repr=False)

    @classmethod
    def make(cls, signer: Signer, name: str, schema: str, *, piece_size: int, now: float,
             text_field: str = "text") -> Header:
        check_name(name)
        if schema not in SCHEMAS:
            raise DatasetError(f"schema {schema!r}: use one of {', '.join(SCHEMAS)}")
        body = pb.Header(name=name, schema=schema, piece_size=piece_size, creator=signer.peer_id.to_bytes(),
                         created=now, text_field=text_field).SerializeToString()
        return cls.parse(sign(signer, "header", body))

    @classmethod
    def parse(cls, raw: bytes) -> Header:
        body, signer = open_signed(raw, "header")
        try:
            h = pb.Header.FromString(body)
        except DecodeError as e:
            raise ManifestError(f"a header that does not parse: {e}") from None
        creator = ID(h.creator)  # any bytes make an ID: one that is not the signer's is refused next
        if creator != signer:
            raise ManifestError(f"a header naming {creator} as creator, signed by {signer}")
        if not _NAME.match(h.name):
            raise ManifestError(f"a header with an invalid name {h.name[:80]!r}")
        if h.schema not in SCHEMAS:
            raise ManifestError(f"a header with an unknown schema {h.schema[:40]!r}")
        ps = h.piece_size
        if not (MIN_PIECE_SIZE <= ps <= MAX_PIECE_SIZE and ps & (ps - 1) == 0):
            raise ManifestError(f"a header with a piece size of {ps} bytes (a power of two from "
                                f"{MIN_PIECE_SIZE} to {MAX_PIECE_SIZE})")
        if not math.isfinite(h.created) or len(h.text_field) > 100:
            raise ManifestError("a header with a bad time or text field")
        return cls(object_id(raw), h.name, h.schema, ps, creator, h.created, h.text_field or "text", raw)

    @property
    def label(self) -> str:
        """``name@<creator, short>``: the unambiguous way to name it."""
        return f"{self.name}@{str(self.creator)[-8:]}"


@dataclass(frozen=True)
class Entry:
    id: bytes
    dataset: bytes
    author: ID
    created: float
    shards: tuple[Shard, ...]
    retract: tuple[bytes, ...]
    signed: bytes = field(repr=False)

    @classmethod
    def make(cls, signer: Signer, header: Header, shards: Sequence[Shard], *, now: float,
             retract: Iterable[bytes] = ()) -> Entry:
        body = pb.Entry(dataset=header.id, author=signer.peer_id.to_bytes(), created=now,
                        shards=[pb.Shard(path=s.path, size=s.size, root=s.root) for s in shards],
                        retract=list(retract)).SerializeToString()
        return cls.parse(sign(signer, "entry", body), header)

    @classmethod
    def parse(cls, raw: bytes, header: Header) -> Entry:
        body, signer = open_signed(raw, "entry")
        try:
            e = pb.Entry.FromString(body)
        except DecodeError as err:
            raise ManifestError(f"an entry that does not parse: {err}") from None
        if e.dataset != header.id:
            raise ManifestError("an entry of another dataset")
        author = ID(e.author)  # any bytes make an ID: one that is not the signer's is refused next
        if author != signer:
            raise ManifestError(f"an entry naming {author} as author, signed by {signer}")
        if len(e.shards) > MAX_SHARDS_PER_ENTRY or len(e.retract) > MAX_ENTRIES:
            raise ManifestError(f"an entry with {len(e.shards)} shards (at most {MAX_SHARDS_PER_ENTRY})")
        if not e.shards and not e.retract:
            raise ManifestError("an empty entry")
        if e.retract and author != header.creator:
            raise ManifestError(f"a retraction by {author}, who did not create the dataset")
        if not math.isfinite(e.created):
            raise ManifestError("an entry with a bad time")
        shards = []
        for s in e.shards:
            check_path(s.path)
            if len(s.root) != HASH_SIZE:
                raise ManifestError(f"shard {s.path!r}: a root of {len(s.root)} bytes")
            if not 0 < s.size or piece_count(s.size, header.piece_size) > MAX_PIECES:
                raise ManifestError(f"shard {s.path!r}: {s.size} bytes (1 to {MAX_PIECES} pieces)")
            shards.append(Shard(s.path, s.size, bytes(s.root)))
        if any(len(r) != HASH_SIZE for r in e.retract):
            raise ManifestError("a retraction of something that is not an entry id")
        return cls(object_id(raw), header.id, author, e.created, tuple(shards), tuple(bytes(r) for r in e.retract),
                   raw)


#: The kind of a closed swarm's authority's retraction (signed with its key, not a peer's).
AUTHORITY_RETRACTION = "authority-retraction"


def sign_by_authority(key: Any, header: Header, retract: Iterable[bytes], *, now: float) -> bytes:
    """A retraction of ``retract`` (entry ids) signed by a closed swarm's authority (a PyNaCl ``SigningKey``:
    ``p2p.authority.load_or_create_key``)."""
    body = pb.Entry(dataset=header.id, created=now, retract=list(retract)).SerializeToString()
    signature = key.sign(_payload(AUTHORITY_RETRACTION, body)).signature
    return pb.Signed(body=body, public_key=bytes(key.verify_key), signature=signature,
                     kind=AUTHORITY_RETRACTION).SerializeToString()


def parse_authority_retraction(raw: bytes, header: Header, authority: bytes | None) -> tuple[bytes, ...]:
    """The entry ids a retraction by ``authority`` (the closed swarm's Ed25519 key) takes out; refused with
    the reason when there is no authority (an open swarm) or another key signed it."""
    from nacl.exceptions import BadSignatureError
    from nacl.signing import VerifyKey

    try:
        signed = pb.Signed.FromString(raw)
        e = pb.Entry.FromString(signed.body)
    except DecodeError as err:
        raise ManifestError(f"an authority's retraction that does not parse: {err}") from None
    if authority is None:
        raise ManifestError("a retraction by an authority, in a swarm that has none")
    if signed.public_key != authority:
        raise ManifestError("a retraction signed by another key than the swarm's authority")
    try:
        VerifyKey(authority).verify(_payload(AUTHORITY_RETRACTION, signed.body), signed.signature)
    except (BadSignatureError, ValueError):
        raise ManifestError("the authority's retraction's signature does not match its content") from None
    if e.dataset != header.id or not e.retract or any(len(r) != HASH_SIZE for r in e.retract):
        raise ManifestError("an authority's retraction of another dataset, or of nothing")
    return tuple(bytes(r) for r in e.retract)


@dataclass
class Manifest:
    """One dataset as a peer knows it: its header and every entry it accepted (the grow-only set).

    ``authority``: a closed swarm's authority key (32 bytes): its retractions are honoured too.
    """

    header: Header
    entries: dict[bytes, Entry] = field(default_factory=dict)
    #: (what, why) of everything refused, the first few
    refused: list[tuple[str, str]] = field(default_factory=list)
    authority: bytes | None = None
    #: the authority's retractions: id -> (the signed bytes, the entry ids they take out)
    by_authority: dict[bytes, tuple[bytes, tuple[bytes, ...]]] = field(default_factory=dict)

    def add(self, raw: bytes) -> Entry | None:
        """Take a signed entry (or an authority's retraction) from anywhere; None (and the reason in
        ``refused``) if it is refused, or if it is a retraction by the authority (kept apart)."""
        eid = object_id(raw)
        if eid in self.entries:
            return self.entries[eid]
        if eid in self.by_authority:
            return None
        if len(self.entries) + len(self.by_authority) >= MAX_ENTRIES:
            self._refuse(eid, f"the manifest already holds {MAX_ENTRIES} entries")
            return None
        try:
            if _kind(raw) == AUTHORITY_RETRACTION:
                self.by_authority[eid] = (raw, parse_authority_retraction(raw, self.header, self.authority))
                return None
            entry = Entry.parse(raw, self.header)
        except ManifestError as e:
            self._refuse(eid, str(e))
            return None
        self.entries[eid] = entry
        return entry

    def _refuse(self, eid: bytes, why: str) -> None:
        if len(self.refused) < 32:
            self.refused.append((f"entry {eid.hex()[:12]}", why))

    def merge(self, other: Manifest) -> None:
        for raw in [e.signed for e in other.entries.values()] + [r for r, _ in other.by_authority.values()]:
            self.add(raw)

    def signed(self) -> list[bytes]:
        """Every signed object of the manifest but the header (what the DHT and the stored copy keep)."""
        return ([e.signed for e in sorted(self.entries.values(), key=lambda e: e.id)]
                + [raw for _, (raw, _) in sorted(self.by_authority.items())])

    def retracted(self) -> set[bytes]:
        """Entry ids taken out: by the creator's entries, and in a closed swarm by its authority."""
        return ({r for e in self.entries.values() if e.author == self.header.creator for r in e.retract}
                | {r for _, ids in self.by_authority.values() for r in ids})

    def _live(self) -> dict[str, tuple[Shard, ID]]:
        gone = self.retracted()
        taken: dict[str, tuple[Shard, ID]] = {}
        roots: set[bytes] = set()
        for entry in sorted(self.entries.values(), key=lambda e: (e.created, e.id)):
            if entry.id in gone:
                continue
            for s in entry.shards:
                if s.path in taken or s.root in roots:
                    continue
                taken[s.path] = (s, entry.author)
                roots.add(s.root)
        return taken

    def shards(self) -> list[Shard]:
        """The dataset's shards: retracted entries left out; a path claimed by two shards goes to the earliest
        entry (then the lowest id); the same root under two paths is kept once. The same on every peer that
        holds the same entries."""
        return sorted((s for s, _ in self._live().values()), key=lambda s: s.path)

    def authors(self) -> dict[ID, int]:
        """How many of the dataset's shards (:meth:`shards`) each peer added (credit for data)."""
        out: dict[ID, int] = {}
        for _, author in self._live().values():
            out[author] = out.get(author, 0) + 1
        return out

    def stored(self) -> bytes:
        """What is kept beside the files (``DIR/.dedloc/manifest``)."""
        return pb.Stored(header=self.header.signed, entries=self.signed()).SerializeToString()

    @classmethod
    def from_stored(cls, raw: bytes, authority: bytes | None = None) -> Manifest:
        try:
            stored = pb.Stored.FromString(raw)
        except DecodeError as e:
            raise ManifestError(f"a stored manifest that does not parse: {e}") from None
        manifest = cls(Header.parse(stored.header), authority=authority)
        for entry in stored.entries:
            manifest.add(entry)
        return manifest

    @property
    def size(self) -> int:
        return sum(s.size for s in self.shards())


def resolve(headers: Iterable[Header], ref: str) -> Header:
    """The one header ``ref`` names: ``NAME``, ``NAME@<creator peer id, or its end>`` or the id's hex (its start,
    8 digits at least). Several creators' datasets of one name need the ``@``: the error lists them."""
    name, _, who = ref.partition("@")
    found = list({h.id: h for h in headers}.values())
    if not who and len(name) >= 8 and all(c in "0123456789abcdef" for c in name):
        by_id = [h for h in found if h.id.hex().startswith(name)]
        if len(by_id) == 1:
            return by_id[0]
    matches = [h for h in found if h.name == name and (not who or str(h.creator).endswith(who))]
    if not matches:
        raise DatasetError(f"no dataset {ref!r} in the swarm (`dedloc dataset list` shows those there are)")
    if len({h.creator for h in matches}) == 1:  # one creator's: its newest (create refuses a second one)
        return max(matches, key=lambda h: (h.created, h.id))
    if len(matches) > 1:
        options = ", ".join(sorted(h.label for h in matches))
        raise DatasetError(f"{len(matches)} datasets are named {name!r}, by different creators: name one as "
                           f"{options}")
    return matches[0]


def schema_of(paths: Iterable[str]) -> str:
    """The one schema of a set of shard files (by suffix); a clear error for mixed or unknown ones."""
    kinds = set()
    for p in paths:
        kind = SUFFIXES.get(PurePosixPath(p).suffix.lower())
        if kind is None:
            raise DatasetError(f"{p}: unknown shard format (wanted {', '.join(sorted(SUFFIXES))})")
        kinds.add(kind)
    if len(kinds) != 1:
        raise DatasetError(f"shards of {len(kinds)} formats ({', '.join(sorted(kinds)) or 'none'}); "
                           "a dataset holds one")
    return kinds.pop()


__all__ = ["AUTHORITY_RETRACTION", "DatasetError", "Entry", "Header", "Manifest", "ManifestError", "SCHEMAS", "SUFFIXES", "Shard", "Signer",
           "check_name", "check_path", "object_id", "open_signed", "parse_authority_retraction", "resolve", "schema_of",
           "sign", "sign_by_authority"]
