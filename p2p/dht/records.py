"""DHT values and a peer's local store of them, sans-I/O (no sockets, no clock).

Semantics follow hivemind's DHT, since training runs rely on them:

* **Every value expires.** A record carries a unix-seconds ``expiration``; for
  one key (or one ``(key, subkey)`` of a dictionary) the *newer* expiration wins
  and an older or equal one loses, so re-publishing is idempotent and stale
  copies cannot roll a value back. Expired values vanish from every read.
* **Dictionary values.** Many peers write their own *subkey* under one key
  (e.g. each peer's progress under a training-run key); subkeys merge and each
  one follows the newer-expiration rule on its own.
* **Owned records.** A key or subkey ending in ``[owner:<base58 peer id>]``
  (:func:`owned`) can only be written by that peer: the record must carry the
  peer's Ed25519 public key and its signature over :func:`signed_payload`, and
  every storing node checks both, because any node may relay or re-publish it.
* **Content-addressed subkeys.** A subkey ending in ``[sha256:<hex>]``
  (:func:`content_subkey`) holds exactly the value whose SHA-256 it names:
  every storing node checks it, so anyone may re-publish such a value (keep it
  alive after its author left) and nobody can replace it with other bytes.
  Self-signed objects (a dataset's entries, ``training/datasets``) live there.
* **Schemas.** :class:`Schema` declares per-key-prefix rules checked on store.

Hostile input is rejected with a :class:`DHTError` subclass that says what to do,
and bounded where rejection alone is not enough (:class:`LocalStore` limits
keys, subkeys, bytes and per-origin store rate), so honest records survive.
The time ``now`` is always passed in, which keeps everything here deterministic.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from google.protobuf.message import DecodeError, Message
from libp2p.crypto.keys import KeyType, PrivateKey
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID

from ..errors import DedlocError
from .proto.records_pb2 import DHTRecord as DHTRecordPB

KeyLike = str | bytes | int


class DHTError(DedlocError):
    """Base of every error raised for a DHT record or store."""


class InvalidKey(DHTError, TypeError):
    """A key or subkey is not str/bytes/int, or its canonical bytes are malformed."""


class MalformedRecord(DHTError, ValueError):
    """Bytes received as a record do not parse as a well-formed ``DHTRecord``."""


class StoreRejected(DHTError):
    """A record was refused by a storing node; the message says why."""


class RecordTooLarge(StoreRejected):
    """The key, subkey or value exceeds the store's size limit."""


class InvalidSignature(StoreRejected):
    """An owned record's signature or owner key is missing, forged or someone else's."""


class ContentMismatch(StoreRejected):
    """A content-addressed subkey holds a value whose SHA-256 is not the one it names."""


class ExpirationTooFar(StoreRejected):
    """The expiration is not finite or lies further ahead than the store accepts."""


class SchemaViolation(StoreRejected):
    """The value breaks the schema declared for its key."""


class StoreQuotaExceeded(StoreRejected):
    """One origin peer sent more stores in the current window than it may."""


class StoreFull(StoreRejected):
    """The store is full of values that all outlive the new one."""


# ---------------------------------------------------------------- keys

_TAG_STR, _TAG_BYTES, _TAG_INT = b"s", b"b", b"i"
_INT_RE = re.compile(rb"-?(0|[1-9][0-9]*)\Z")


class DHTKey:
    """Deterministic canonical bytes for user keys and subkeys.

    Users name keys with str, bytes or int; peers must agree byte-for-byte on
    what was signed and where it is routed, so each is encoded as a one-byte
    type tag plus payload (UTF-8, raw bytes, canonical decimal). Tags keep
    ``"1"``, ``b"1"`` and ``1`` distinct; ``bool`` is refused because
    ``True == 1`` would silently alias keys.
    """

    @staticmethod
    def encode(key: object) -> bytes:
        if isinstance(key, bool) or not isinstance(key, (str, bytes, int)):
            raise InvalidKey(
                f"DHT keys and subkeys must be str, bytes or int, not {type(key).__name__}"
            )
        if isinstance(key, str):
            return _TAG_STR + key.encode("utf-8", "surrogatepass")
        if isinstance(key, bytes):
            return _TAG_BYTES + key
        try:
            return _TAG_INT + str(key).encode()
        except ValueError as e:  # beyond Python's int-to-str digit limit
            raise InvalidKey(f"integer DHT key is too large: {e}") from None

    @staticmethod
    def decode(raw: bytes) -> KeyLike:
        tag, body = raw[:1], raw[1:]
        if tag == _TAG_BYTES:
            return body
        if tag == _TAG_STR:
            try:
                return body.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidKey("str DHT key is not valid UTF-8") from None
        if tag == _TAG_INT and _INT_RE.match(body) and body != b"-0":
            return int(body)
        raise InvalidKey(f"malformed canonical DHT key {raw[:32]!r}")


_OWNER_RE = re.compile(rb"\[owner:([1-9A-HJ-NP-Za-km-z]{20,128})\]\Z")


def owned(name: KeyLike, peer_id: ID) -> KeyLike:
    """``name`` with the owner marker of ``peer_id``: only that peer may write it."""
    marker = f"[owner:{peer_id.to_base58()}]"
    if isinstance(name, str):
        return name + marker
    if isinstance(name, bytes):
        return name + marker.encode()
    raise InvalidKey("only str and bytes keys can carry an owner marker")


def owner_of(raw: bytes) -> ID | None:
    """The peer a canonical key/subkey is bound to, or None if it has no marker.

    Anything that mentions ``[owner:`` without a well-formed trailing marker is
    refused, so a near-miss cannot pass as an unowned key and fool readers.
    """
    body = raw[1:]
    if b"[owner:" not in body:
        return None
    m = _OWNER_RE.search(body)
    if m is None or body.count(b"[owner:") != 1:
        raise InvalidSignature(f"malformed owner marker in key {raw[:64]!r}")
    return ID.from_base58(m.group(1).decode())


_CONTENT_RE = re.compile(rb"\[sha256:([0-9a-f]{64})\]\Z")


def content_subkey(value: bytes, name: str = "") -> str:
    """The subkey that holds exactly ``value`` (``name`` in front, for readers): any peer may store it,
    and every storing node checks that the value's SHA-256 is the one named."""
    return f"{name}[sha256:{hashlib.sha256(value).hexdigest()}]"


def content_of(raw: bytes) -> bytes | None:
    """The SHA-256 a canonical subkey names, or None if it has no ``[sha256:...]`` marker; a near-miss
    (the marker's start without a well-formed end) is refused, as for owner markers."""
    body = raw[1:]
    if b"[sha256:" not in body:
        return None
    m = _CONTENT_RE.search(body)
    if m is None or body.count(b"[sha256:") != 1:
        raise ContentMismatch(f"malformed content marker in subkey {raw[:96]!r}")
    return bytes.fromhex(m.group(1).decode())


# ---------------------------------------------------------------- records

_DOMAIN = b"dedloc-dht-record:v1\x00"


def signed_payload(key: bytes, subkey: bytes | None, value: bytes, expiration: float) -> bytes:
    """The exact bytes an owner signs: domain tag, then length-prefixed fields.

    The domain tag keeps a DHT signature from being replayed as any other
    signature the identity key makes; length prefixes keep ``key+subkey``
    boundaries unambiguous; "no subkey" differs from an empty subkey.
    """
    def lp(b: bytes) -> bytes:
        return struct.pack(">I", len(b)) + b

    sub = b"\x00" if subkey is None else b"\x01" + lp(subkey)
    return _DOMAIN + lp(key) + sub + lp(value) + struct.pack(">d", expiration)


@dataclass(frozen=True)
class DHTRecord:
    """One stored item: canonical key (and subkey), value, expiration, owner proof."""

    key: bytes
    value: bytes
    expiration: float
    subkey: bytes | None = None
    owner_public_key: bytes = b""
    signature: bytes = b""

    @classmethod
    def make(cls, key: KeyLike, value: bytes, expiration: float,
             subkey: KeyLike | None = None) -> DHTRecord:
        """An unsigned record from user-level key/subkey (values are bytes: callers serialise)."""
        if not isinstance(value, (bytes, bytearray)):
            raise InvalidKey(f"DHT values must be bytes, not {type(value).__name__}")
        return cls(DHTKey.encode(key), bytes(value), float(expiration),
                   None if subkey is None else DHTKey.encode(subkey))

    def to_pb(self) -> DHTRecordPB:
        pb = DHTRecordPB(key=self.key, value=self.value, expiration=self.expiration,
                         owner_public_key=self.owner_public_key, signature=self.signature)
        if self.subkey is not None:
            pb.subkey = self.subkey
        return pb

    def to_bytes(self) -> bytes:
        return self.to_pb().SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> DHTRecord:
        """Parse wire bytes; garbled input raises :class:`MalformedRecord`."""
        pb = DHTRecordPB()
        try:
            pb.ParseFromString(data)
        except (DecodeError, ValueError) as e:
            raise MalformedRecord(f"DHT record does not parse: {e}") from None
        return cls.from_pb(pb)

    @classmethod
    def from_pb(cls, pb: DHTRecordPB) -> DHTRecord:
        """From a parsed message (e.g. inside an RPC); a garbled key raises :class:`InvalidKey`."""
        rec = cls(pb.key, pb.value, pb.expiration,
                  pb.subkey if pb.HasField("subkey") else None,
                  pb.owner_public_key, pb.signature)
        DHTKey.decode(rec.key)  # a garbled key is caught here, not deep in a store
        if rec.subkey is not None:
            DHTKey.decode(rec.subkey)
        return rec

    @property
    def size(self) -> int:
        """Bytes this record costs a store (payloads plus a fixed overhead)."""
        return (len(self.key) + len(self.subkey or b"") + len(self.value)
                + len(self.owner_public_key) + len(self.signature) + 64)


def sign_record(private_key: PrivateKey, key: KeyLike, value: bytes, expiration: float,
                subkey: KeyLike | None = None) -> DHTRecord:
    """A record signed by ``private_key`` (use with keys/subkeys made by :func:`owned`)."""
    rec = DHTRecord.make(key, value, expiration, subkey)
    sig = private_key.sign(signed_payload(rec.key, rec.subkey, rec.value, rec.expiration))
    return DHTRecord(rec.key, rec.value, rec.expiration, rec.subkey,
                     private_key.get_public_key().serialize(), sig)


def verify_record(rec: DHTRecord) -> ID | None:
    """Check the owner proof; returns the owner (None for unowned records).

    Raises :class:`ContentMismatch` when a content-addressed subkey holds other bytes than it
    names, and :class:`InvalidSignature` when a marked key/subkey lacks a valid
    signature by exactly the marked peer, or when an unmarked record carries
    owner fields (they would mean nothing and only cost every node a check).
    """
    if rec.subkey is not None:
        digest = content_of(rec.subkey)
        if digest is not None and hashlib.sha256(rec.value).digest() != digest:
            raise ContentMismatch("the value is not the one its content-addressed subkey names")
    owners = {o for o in (owner_of(rec.key),
                          None if rec.subkey is None else owner_of(rec.subkey)) if o}
    if not owners:
        if rec.owner_public_key or rec.signature:
            raise InvalidSignature("record has a signature but no [owner:...] marker")
        return None
    if len(owners) > 1:
        raise InvalidSignature("key and subkey name different owners")
    owner = owners.pop()
    if not rec.owner_public_key or not rec.signature:
        raise InvalidSignature(f"record for owner {owner} is not signed; sign it with sign_record")
    try:
        pub = deserialize_public_key(rec.owner_public_key)
    except Exception:
        raise InvalidSignature("owner public key does not parse") from None
    if pub.get_type() != KeyType.Ed25519:
        raise InvalidSignature("owner public key is not Ed25519")
    if ID.from_pubkey(pub) != owner:
        raise InvalidSignature(f"record is signed by another peer than its owner {owner}")
    try:
        ok = pub.verify(signed_payload(rec.key, rec.subkey, rec.value, rec.expiration),
                        rec.signature)
    except Exception:
        ok = False
    if not ok:
        raise InvalidSignature(f"signature of owner {owner} does not match the record")
    return owner


# ---------------------------------------------------------------- schema

Validator = Callable[[DHTRecord], None]


@dataclass
class Schema:
    """Per-key-prefix rules, checked on every store (the prefix is user-level).

    A rule may cap the value size, require the value to parse as a protobuf
    message type, require (or forbid) subkeys, and run a custom ``check`` that
    raises :class:`SchemaViolation`. Keys matching no prefix are unconstrained.
    """

    _rules: list[tuple[bytes, Validator]] = field(default_factory=list)

    def declare(self, prefix: str | bytes, *, max_size: int | None = None,
                message: type[Message] | None = None, subkeys: bool | None = None,
                check: Validator | None = None) -> None:
        raw_prefix = DHTKey.encode(prefix)

        def validate(rec: DHTRecord) -> None:
            where = f"key {DHTKey.decode(rec.key)!r}"
            if max_size is not None and len(rec.value) > max_size:
                raise SchemaViolation(f"{where}: value of {len(rec.value)} bytes > {max_size}")
            if subkeys is not None and (rec.subkey is not None) != subkeys:
                raise SchemaViolation(f"{where}: subkeys are {'required' if subkeys else 'forbidden'}")
            if message is not None:
                try:
                    message.FromString(rec.value)
                except (DecodeError, ValueError) as e:
                    raise SchemaViolation(f"{where}: value is not a {message.__name__}: {e}") from None
            if check is not None:
                check(rec)

        self._rules.append((raw_prefix, validate))

    def validate(self, rec: DHTRecord) -> None:
        for prefix, rule in self._rules:
            if rec.key.startswith(prefix):
                rule(rec)


# ---------------------------------------------------------------- local store

class ValueWithExpiration(NamedTuple):
    """A value as reads return it: bytes, or for a dictionary key its live subkeys."""

    value: bytes | dict[KeyLike, ValueWithExpiration]
    expiration: float


def _slot(expiration: float, key: bytes, subkey: bytes | None) -> tuple[float, bytes, bool, bytes]:
    """A record's entry in the store's expiry heap (see ``LocalStore._heap``)."""
    return (expiration, key, subkey is not None, subkey or b"")


@dataclass
class LocalStore:
    """The records one peer keeps for the DHT, with every memory bound enforced.

    When full (``max_keys``, ``max_bytes``, or ``max_subkeys_per_key`` for one
    key) the store evicts the soonest-expiring entries, but only those that
    expire before the new record: a newcomer never displaces longer-lived
    values, so a flood of short-lived junk cannot push honest records out,
    and the newcomer is refused with :class:`StoreFull` instead. Floods are
    further bounded per origin peer: ``max_stores_per_origin`` attempts per
    ``origin_window`` seconds, counted *before* validation so that even
    forged records cannot make a node burn CPU on signature checks.
    """

    max_value_size: int = 64 * 1024
    max_expiration_ahead: float = 24 * 3600.0
    max_keys: int = 100_000
    max_subkeys_per_key: int = 1024
    max_bytes: int = 256 * 1024 * 1024
    max_key_size: int = 1024
    max_stores_per_origin: int = 1000
    origin_window: float = 60.0
    max_origins: int = 100_000
    schema: Schema = field(default_factory=Schema)
    # key -> {subkey or None: record}; None is the plain value (never mixed with subkeys).
    _data: dict[bytes, dict[bytes | None, DHTRecord]] = field(default_factory=dict)
    # (expiration, key, is a subkey, the subkey or b""): the flag sorts a plain value's entry apart, as
    # None and bytes do not compare (a plain value's stale entry beside its key's subkey of the same
    # expiration raised TypeError mid-store)
    _heap: list[tuple[float, bytes, bool, bytes]] = field(default_factory=list)
    _origins: dict[str, tuple[float, int]] = field(default_factory=dict)
    bytes_used: int = 0
    _count: int = 0

    def validate(self, rec: DHTRecord, now: float) -> None:
        """Every check a record must pass before storing; raises a :class:`StoreRejected`."""
        if len(rec.key) > self.max_key_size or len(rec.subkey or b"") > self.max_key_size:
            raise RecordTooLarge(f"key or subkey longer than {self.max_key_size} bytes")
        if len(rec.value) > self.max_value_size:
            raise RecordTooLarge(
                f"value of {len(rec.value)} bytes exceeds the limit of {self.max_value_size}; "
                "store a reference to the data instead")
        if not math.isfinite(rec.expiration) or rec.expiration > now + self.max_expiration_ahead:
            raise ExpirationTooFar(
                f"expiration {rec.expiration} is more than {self.max_expiration_ahead}s ahead; "
                "re-publish periodically instead")
        DHTKey.decode(rec.key)
        if rec.subkey is not None:
            DHTKey.decode(rec.subkey)
        verify_record(rec)
        self.schema.validate(rec)

    def store(self, item: DHTRecord | bytes, now: float, origin: ID | str | None = None) -> bool:
        """Store a record: True if kept, False if stale (expired, or not newer).

        Raises a :class:`DHTError` subclass for records that are invalid or over a
        bound. ``origin`` is the peer that sent it (None for our own stores).
        """
        if origin is not None:
            self._charge(str(origin), now)
        rec = DHTRecord.from_bytes(item) if isinstance(item, bytes) else item
        self.validate(rec, now)
        if rec.expiration <= now:
            return False
        entry = self._data.get(rec.key)
        if entry is not None:
            self._drop_expired(rec.key, now)
            entry = self._data.get(rec.key)
        if entry:
            if rec.subkey is None:  # a plain value replaces all subkeys only if newer than all
                if rec.expiration <= max(r.expiration for r in entry.values()):
                    return False
            elif None in entry:  # a subkey replaces a plain value only if newer
                if rec.expiration <= entry[None].expiration:
                    return False
            else:
                old = entry.get(rec.subkey)
                if old is not None and rec.expiration <= old.expiration:
                    return False
                if old is None and len(entry) >= self.max_subkeys_per_key:
                    subs = entry
                    soonest = min(subs, key=lambda s: subs[s].expiration)
                    if subs[soonest].expiration >= rec.expiration:
                        raise StoreFull(f"key already has {self.max_subkeys_per_key} longer-lived subkeys")
                    self._remove(rec.key, soonest)
        if not entry:
            replaced: list[DHTRecord] = []
        elif rec.subkey is None or None in entry:
            replaced = list(entry.values())  # plain <-> dictionary: the winner takes the key
        else:
            replaced = [entry[rec.subkey]] if rec.subkey in entry else []
        freed = sum(r.size for r in replaced)
        self._make_room(rec, now, freed, new_key=not entry)
        entry = self._data.get(rec.key, {})
        if rec.subkey is None or None in entry:
            for sub in list(entry):
                self._remove(rec.key, sub)
        elif rec.subkey in entry:
            self._remove(rec.key, rec.subkey)
        # after the removals: one that empties the key drops its entry (a peer's newer report under the
        # key's only subkey was written into a dictionary no longer stored, and the key read as empty)
        self._data.setdefault(rec.key, {})[rec.subkey] = rec
        self.bytes_used += rec.size
        self._count += 1
        heapq.heappush(self._heap, _slot(rec.expiration, rec.key, rec.subkey))
        if len(self._heap) > 2 * self._count + 1024:  # drop lazily-deleted entries
            self._heap = [_slot(r.expiration, k, s) for k, e in self._data.items() for s, r in e.items()]
            heapq.heapify(self._heap)
        return True

    def get(self, key: KeyLike, now: float) -> bytes | dict[KeyLike, ValueWithExpiration] | None:
        """A plain value, a dict of live subkeys, or None; expired entries are skipped."""
        recs = self.get_records(key, now)
        if not recs:
            return None
        if recs[0].subkey is None:
            return recs[0].value
        return {DHTKey.decode(r.subkey): ValueWithExpiration(r.value, r.expiration)
                for r in recs if r.subkey is not None}

    def get_records(self, key: KeyLike, now: float) -> list[DHTRecord]:
        """Live records under a key, signatures intact, for serving to other peers."""
        return self.records_at(DHTKey.encode(key), now)

    def records_at(self, raw_key: bytes, now: float) -> list[DHTRecord]:
        """Like :meth:`get_records`, by canonical key bytes (what RPCs carry)."""
        entry = self._data.get(raw_key, {})
        return [r for r in entry.values() if r.expiration > now]

    def keys(self) -> list[bytes]:
        """Canonical bytes of every key held (expired ones may linger until :meth:`expire`)."""
        return list(self._data)

    def found(self, raw_key: bytes, now: float) -> ValueWithExpiration | None:
        """The value under a key as reads return it, with the key's latest expiration."""
        recs = self.records_at(raw_key, now)
        if not recs:
            return None
        if recs[0].subkey is None:
            return ValueWithExpiration(recs[0].value, recs[0].expiration)
        subs: dict[KeyLike, ValueWithExpiration] = {
            DHTKey.decode(r.subkey): ValueWithExpiration(r.value, r.expiration) for r in recs if r.subkey is not None}
        return ValueWithExpiration(subs, max(r.expiration for r in recs))

    def expire(self, now: float) -> None:
        """Drop every expired record and stale per-origin counters."""
        self._expire_records(now)
        self._prune_origins(now)

    def __len__(self) -> int:
        return len(self._data)

    # -- internals

    def _expire_records(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, key, has, sub = heapq.heappop(self._heap)
            self._remove_if_expired(key, sub if has else None, now)

    def _prune_origins(self, now: float) -> None:
        self._origins = {o: w for o, w in self._origins.items() if w[0] + self.origin_window > now}

    def _charge(self, origin: str, now: float) -> None:
        if origin not in self._origins and len(self._origins) >= self.max_origins:  # bound the counters against Sybils
            self._prune_origins(now)
            if len(self._origins) >= self.max_origins:
                raise StoreQuotaExceeded("too many peers are storing at once; try again later")
        start, count = self._origins.get(origin, (now, 0))
        if start + self.origin_window <= now:
            start, count = now, 0
        if count >= self.max_stores_per_origin:
            raise StoreQuotaExceeded(
                f"peer {origin} sent over {self.max_stores_per_origin} stores in "
                f"{self.origin_window}s; try again later")
        self._origins[origin] = (start, count + 1)

    def _remove(self, key: bytes, sub: bytes | None) -> None:
        entry = self._data[key]
        self.bytes_used -= entry.pop(sub).size
        self._count -= 1
        if not entry:
            del self._data[key]

    def _remove_if_expired(self, key: bytes, sub: bytes | None, now: float) -> None:
        rec = self._data.get(key, {}).get(sub)
        if rec is not None and rec.expiration <= now:
            self._remove(key, sub)

    def _drop_expired(self, key: bytes, now: float) -> None:
        for sub in list(self._data.get(key, {})):
            self._remove_if_expired(key, sub, now)

    def _make_room(self, rec: DHTRecord, now: float, freed: int, new_key: bool) -> None:
        """Evict soonest-expiring records that die before ``rec`` until it fits.

        Records under ``rec.key`` itself are never evicted here (their bytes are
        already counted in ``freed`` or they are the dictionary ``rec`` joins).
        """
        def fits() -> bool:
            keys_ok = not new_key or len(self._data) < self.max_keys
            return keys_ok and self.bytes_used - freed + rec.size <= self.max_bytes

        if rec.size > self.max_bytes:
            raise RecordTooLarge(f"record of {rec.size} bytes exceeds max_bytes")
        self._expire_records(now)
        while not fits():
            while self._heap:
                exp, key, has, sub = self._heap[0]
                live = self._data.get(key, {}).get(sub if has else None)
                if live is not None and live.expiration == exp:
                    break
                heapq.heappop(self._heap)  # lazily dropped: replaced or removed before
            if not self._heap or self._heap[0][0] >= rec.expiration or self._heap[0][1] == rec.key:
                raise StoreFull("store is full of records that outlive this one; retry later")
            _, key, has, sub = heapq.heappop(self._heap)
            self._remove(key, sub if has else None)
