"""DHT records and the local store: pure, deterministic (time is passed in)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from p2p.dht.proto.records_pb2 import DHTRecord as DHTRecordPB
from p2p.dht.records import (
    DHTError,
    DHTKey,
    DHTRecord,
    ExpirationTooFar,
    InvalidKey,
    InvalidSignature,
    LocalStore,
    MalformedRecord,
    RecordTooLarge,
    Schema,
    SchemaViolation,
    StoreFull,
    StoreQuotaExceeded,
    owned,
    sign_record,
    verify_record,
)
from p2p.errors import DedlocError
from p2p.identity import new_identity, peer_id_of

NOW = 1_000_000.0


def rec(key: object, value: bytes, exp: float, subkey: object = None) -> DHTRecord:
    return DHTRecord.make(key, value, exp, subkey)  # type: ignore[arg-type]


def test_key_encoding_round_trips_and_is_tagged() -> None:
    for k in ["run", "", "ü", b"run", b"", 0, 7, -12, 10**30]:
        assert DHTKey.decode(DHTKey.encode(k)) == k
        assert type(DHTKey.decode(DHTKey.encode(k))) is type(k)
    assert len({DHTKey.encode("1"), DHTKey.encode(b"1"), DHTKey.encode(1)}) == 3


@pytest.mark.parametrize("bad", [1.5, None, True, ["a"], ("a",), {"a": 1}])
def test_wrong_key_types_rejected_clearly(bad: object) -> None:
    with pytest.raises(InvalidKey, match="must be str, bytes or int"):
        DHTKey.encode(bad)
    assert issubclass(InvalidKey, TypeError) and issubclass(InvalidKey, DedlocError)
    with pytest.raises(InvalidKey):
        LocalStore().store(rec(bad, b"v", NOW + 1), NOW)


def test_record_wire_round_trip() -> None:
    for r in [rec("k", b"v", NOW + 5), rec(3, b"", NOW + 5, subkey=b""),
              sign_record(new_identity().private_key, "x", b"v", NOW + 1)]:
        assert DHTRecord.from_bytes(r.to_bytes()) == r


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff", b"\x0a\x05ab", DHTRecordPB(key=b"zq").SerializeToString()])
def test_garbled_protobuf_rejected(garbage: bytes) -> None:
    with pytest.raises(DHTError):
        DHTRecord.from_bytes(garbage)
    with pytest.raises(DHTError):
        LocalStore().store(garbage, NOW)
    with pytest.raises(MalformedRecord, match="does not parse"):
        DHTRecord.from_bytes(b"\xff\xff\xff")


def test_plain_value_newer_expiration_wins() -> None:
    s = LocalStore()
    assert s.store(rec("k", b"a", NOW + 10), NOW)
    assert s.get("k", NOW) == b"a"
    assert not s.store(rec("k", b"b", NOW + 10), NOW)  # equal loses
    assert not s.store(rec("k", b"b", NOW + 5), NOW)  # older loses
    assert s.get("k", NOW) == b"a"
    assert s.store(rec("k", b"c", NOW + 20), NOW)
    assert s.get("k", NOW) == b"c"
    assert s.get("other", NOW) is None


def test_subkeys_merge_and_each_follows_newer_wins() -> None:
    s = LocalStore()
    assert s.store(rec("run", b"p1", NOW + 10, subkey="peer1"), NOW)
    assert s.store(rec("run", b"p2", NOW + 5, subkey="peer2"), NOW)
    assert not s.store(rec("run", b"old", NOW + 10, subkey="peer1"), NOW)
    assert s.store(rec("run", b"p2new", NOW + 6, subkey="peer2"), NOW)
    got = s.get("run", NOW)
    assert got == {"peer1": (b"p1", NOW + 10), "peer2": (b"p2new", NOW + 6)}
    # a plain value only replaces a dictionary if newer than all its subkeys
    assert not s.store(rec("run", b"plain", NOW + 8), NOW)
    assert s.store(rec("run", b"plain", NOW + 11), NOW)
    assert s.get("run", NOW) == b"plain"
    assert not s.store(rec("run", b"x", NOW + 11, subkey=1), NOW)
    assert s.store(rec("run", b"x", NOW + 12, subkey=1), NOW)
    assert s.get("run", NOW) == {1: (b"x", NOW + 12)}


def test_a_newer_value_under_a_key_s_only_subkey_replaces_it() -> None:
    """The key's only subkey, replaced: the entry emptied by the removal was dropped, and the newer value
    went into a dictionary no longer stored (a backbone alone in its run: every other report of its
    archive vanished; a peer's last word that it left, the last one in the run, did too)."""
    s = LocalStore()
    for i in range(3):
        assert s.store(rec("run", b"v%d" % i, NOW + 10 + i, subkey="peer1"), NOW)
        assert s.get("run", NOW) == {"peer1": (b"v%d" % i, NOW + 10 + i)}
        assert len(s.get_records("run", NOW)) == 1 and s.bytes_used == s.get_records("run", NOW)[0].size
    assert s.store(rec("plain", b"a", NOW + 10), NOW) and s.store(rec("plain", b"b", NOW + 11), NOW)
    assert s.get("plain", NOW) == b"b" and len(s) == 2  # keys held


@settings(max_examples=300, deadline=None)
# a plain value's stale expiry entry beside a subkey of its expiration: None and bytes compared (TypeError)
@example([("a", None, 2, b""), ("a", "p2", 3, b""), ("a", "p1", 2, b"")])
@example([("a", "p1", 1, b"x"), ("a", "p1", 2, b"y")])  # the key's only subkey, replaced
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([None, "p1", "p2", "p3"]),
                          st.integers(1, 6), st.binary(max_size=3)), max_size=30))
def test_the_store_holds_what_the_newer_wins_rule_says_after_any_sequence_of_stores(
        stores: list[tuple[str, str | None, int, bytes]]) -> None:
    """Against a model of the rules (a key holds a plain value or subkeys; each store is kept only if newer
    than what it would replace): what reads return, the records, keys and bytes held, after every store."""
    s = LocalStore()
    model: dict[str, dict[str | None, tuple[bytes, float]]] = {}
    for key, sub, ahead, value in stores:
        exp = NOW + ahead
        entry = model.get(key, {})
        if sub is None or None in entry:
            kept = not entry or exp > max(e for _, e in entry.values())
            if sub is not None and None in entry:
                kept = exp > entry[None][1]
            if kept:
                model[key] = {sub: (value, exp)}
        else:
            kept = sub not in entry or exp > entry[sub][1]
            if kept:
                model.setdefault(key, {})[sub] = (value, exp)
        assert s.store(rec(key, value, exp, subkey=sub), NOW) == kept
        for k in ("a", "b"):
            want = model.get(k)
            got = s.get(k, NOW)
            if want is None:
                assert got is None
            elif None in want:
                assert got == want[None][0]
            else:
                assert got == {sk: v for sk, v in want.items()}
        records = [r for k in ("a", "b") for r in s.get_records(k, NOW)]
        assert len(records) == sum(len(e) for e in model.values()) and len(s) == len(model)
        assert s.bytes_used == sum(r.size for r in records)


def test_expired_values_vanish() -> None:
    s = LocalStore()
    assert not s.store(rec("gone", b"v", NOW), NOW)  # already expired: nothing to keep
    s.store(rec("k", b"v", NOW + 5), NOW)
    s.store(rec("d", b"1", NOW + 5, subkey="a"), NOW)
    s.store(rec("d", b"2", NOW + 50, subkey="b"), NOW)
    assert s.get("k", NOW + 5) is None
    assert s.get("d", NOW + 5) == {"b": (b"2", NOW + 50)}
    used = s.bytes_used
    s.expire(NOW + 5)
    assert len(s) == 1 and s.bytes_used < used
    s.expire(NOW + 50)
    assert len(s) == 0 and s.bytes_used == 0
    # after expiry an older expiration than the vanished one is accepted again
    assert s.store(rec("k", b"w", NOW + 60), NOW + 51)


def test_owned_record_valid_signature_accepted() -> None:
    kp = new_identity()
    pid = peer_id_of(kp)
    s = LocalStore()
    key = owned("profile", pid)
    r = sign_record(kp.private_key, key, b"me", NOW + 10)
    assert verify_record(r) == pid
    assert s.store(r.to_bytes(), NOW)
    assert s.get(key, NOW) == b"me"
    sub = owned("peer", pid)
    r2 = sign_record(kp.private_key, "run", b"42%", NOW + 10, subkey=sub)
    assert s.store(r2, NOW)
    assert s.get("run", NOW) == {sub: (b"42%", NOW + 10)}
    assert s.get_records("run", NOW) == [r2]  # served with the signature intact


def test_owned_record_forgeries_rejected() -> None:
    kp, other = new_identity(), new_identity()
    sub = owned("peer", peer_id_of(kp))
    good = sign_record(kp.private_key, "run", b"v", NOW + 10, subkey=sub)
    s = LocalStore()
    forged = [
        dataclasses.replace(good, value=b"evil"),
        dataclasses.replace(good, expiration=NOW + 11),
        dataclasses.replace(good, key=DHTKey.encode("run2")),
        dataclasses.replace(good, subkey=DHTKey.encode(owned("peer2", peer_id_of(kp)))),
        dataclasses.replace(good, signature=bytes(64)),
        dataclasses.replace(good, signature=b"short"),
        dataclasses.replace(good, owner_public_key=b"junk"),
        # signed by another peer, with that peer's key
        sign_record(other.private_key, "run", b"v", NOW + 10, subkey=sub),
        # the owner's key, but another peer's signature
        dataclasses.replace(good, signature=sign_record(other.private_key, "run", b"v", NOW + 10, subkey=sub).signature),
        # marker without signature
        rec("run", b"v", NOW + 10, subkey=sub),
        # malformed marker
        rec("run", b"v", NOW + 10, subkey="peer[owner:0OIl]"),
        # signature on an unowned record
        dataclasses.replace(good, subkey=DHTKey.encode("peer")),
    ]
    for bad in forged:
        with pytest.raises(InvalidSignature):
            s.store(bad, NOW)
    assert s.get("run", NOW) is None
    assert s.store(good, NOW)  # the honest record still goes in


def test_value_over_max_size_rejected() -> None:
    s = LocalStore(max_value_size=100)
    assert s.store(rec("k", b"x" * 100, NOW + 1), NOW)
    with pytest.raises(RecordTooLarge, match="exceeds the limit"):
        s.store(rec("k", b"x" * 101, NOW + 2), NOW)
    with pytest.raises(RecordTooLarge):
        s.store(rec("k" * 2000, b"", NOW + 2), NOW)


def test_expiration_too_far_rejected() -> None:
    s = LocalStore(max_expiration_ahead=3600)
    assert s.store(rec("k", b"v", NOW + 3600), NOW)
    for exp in [NOW + 3601, float("inf"), float("nan")]:
        with pytest.raises(ExpirationTooFar):
            s.store(rec("k", b"v", exp), NOW)


def test_flood_from_one_origin_bounded_other_origin_still_stores() -> None:
    s = LocalStore(max_stores_per_origin=10, origin_window=60)
    attacker, honest = peer_id_of(new_identity()), peer_id_of(new_identity())
    for i in range(10):
        s.store(rec(f"junk{i}", b"v", NOW + 100), NOW, origin=attacker)
    with pytest.raises(StoreQuotaExceeded):
        s.store(rec("junk-more", b"v", NOW + 100), NOW, origin=attacker)
    assert s.store(rec("honest", b"v", NOW + 100), NOW, origin=honest)
    assert s.store(rec("again", b"v", NOW + 100), NOW + 61, origin=attacker)  # new window


def test_max_bytes_and_max_keys_bounds_hold() -> None:
    s = LocalStore(max_bytes=2000, max_keys=10)
    for i in range(100):
        try:
            s.store(rec(f"k{i}", b"x" * 150, NOW + 100 + i), NOW)
        except StoreFull:
            pass
        assert s.bytes_used <= 2000 and len(s) <= 10
    # the soonest-expiring were evicted, the longest-lived kept
    assert s.get("k99", NOW) is not None and s.get("k0", NOW) is None
    # a newcomer never displaces longer-lived values
    with pytest.raises(StoreFull):
        s.store(rec("short", b"x" * 150, NOW + 1), NOW)
    assert s.get("k99", NOW) is not None


def test_max_subkeys_per_key_bound() -> None:
    s = LocalStore(max_subkeys_per_key=3)
    for i in range(3):
        s.store(rec("run", b"v", NOW + 10 + i, subkey=i), NOW)
    with pytest.raises(StoreFull):
        s.store(rec("run", b"v", NOW + 5, subkey=9), NOW)
    assert s.store(rec("run", b"v", NOW + 50, subkey=9), NOW)  # evicts subkey 0
    got = s.get("run", NOW)
    assert isinstance(got, dict) and set(got) == {1, 2, 9}


def test_schema_violation_rejected_conforming_accepted() -> None:
    schema = Schema()
    schema.declare("progress", message=DHTRecordPB, subkeys=True, max_size=200)

    def even_length(r: DHTRecord) -> None:
        if len(r.value) % 2:
            raise SchemaViolation("odd length")

    schema.declare(b"even", check=even_length)
    s = LocalStore(schema=schema)
    ok = DHTRecordPB(key=b"x").SerializeToString()
    assert s.store(rec("progress/run1", ok, NOW + 10, subkey="p1"), NOW)
    for bad in [rec("progress/run1", b"\xff\xff", NOW + 10, subkey="p2"),  # not the message
                rec("progress/run1", ok, NOW + 10),  # subkey required
                rec("progress/run1", b"\x0a" + bytes([200]) + b"a" * 200, NOW + 10, subkey="p3")]:
        with pytest.raises(SchemaViolation):
            s.store(bad, NOW)
    assert s.store(rec(b"even-1", b"ab", NOW + 1), NOW)
    with pytest.raises(SchemaViolation, match="odd"):
        s.store(rec(b"even-2", b"abc", NOW + 1), NOW)
    assert s.store(rec("unconstrained", b"\xff", NOW + 1), NOW)


def test_every_forgery_is_refused_with_its_own_reason() -> None:
    """Each check of verify_record, matched on its whole message (a person reads why a store failed)."""
    from libp2p.crypto.secp256k1 import create_new_key_pair

    from p2p.dht.records import ContentMismatch, content_subkey

    kp, other = new_identity(), new_identity()
    pid, other_pid = peer_id_of(kp), peer_id_of(other)
    sub = owned("peer", pid)
    good = sign_record(kp.private_key, "run", b"v", NOW + 10, subkey=sub)
    mismatch = f"^signature of owner {pid} does not match the record$"
    secp = create_new_key_pair()
    cases: list[tuple[DHTRecord, str]] = [
        (dataclasses.replace(good, value=b"evil"), mismatch),
        (dataclasses.replace(good, expiration=NOW + 11), mismatch),
        (dataclasses.replace(good, signature=b"short"), mismatch),
        (dataclasses.replace(good, owner_public_key=b"junk"), "^owner public key does not parse$"),
        (dataclasses.replace(good, owner_public_key=secp.public_key.serialize()), "^owner public key is not Ed25519$"),
        (sign_record(other.private_key, "run", b"v", NOW + 10, subkey=sub),
         f"^record is signed by another peer than its owner {pid}$"),
        (rec("run", b"v", NOW + 10, subkey=sub), f"^record for owner {pid} is not signed; sign it with sign_record$"),
        (dataclasses.replace(good, signature=b""), f"^record for owner {pid} is not signed"),
        (dataclasses.replace(good, owner_public_key=b""), f"^record for owner {pid} is not signed"),
        (dataclasses.replace(good, subkey=DHTKey.encode("peer")), r"^record has a signature but no \[owner:...\] marker$"),
        (dataclasses.replace(rec("run", b"v", NOW + 10), signature=b"x" * 64),
         r"^record has a signature but no \[owner:...\] marker$"),
        (dataclasses.replace(rec("run", b"v", NOW + 10), owner_public_key=b"k"),
         r"^record has a signature but no \[owner:...\] marker$"),
        (dataclasses.replace(good, key=DHTKey.encode(owned("run", other_pid))), "^key and subkey name different owners$"),
        (rec("run", b"v", NOW + 10, subkey="peer[owner:0OIl]"), "^malformed owner marker in key "),
    ]
    s = LocalStore()
    for bad, why in cases:
        with pytest.raises(InvalidSignature, match=why):
            s.store(bad, NOW)
    # a content-addressed subkey holds exactly the value it names, whoever stores it
    named = content_subkey(b"data", "shard")
    assert named == "shard[sha256:" + __import__("hashlib").sha256(b"data").hexdigest() + "]"
    assert s.store(rec("blobs", b"data", NOW + 10, subkey=named), NOW)
    with pytest.raises(ContentMismatch, match="^the value is not the one its content-addressed subkey names$"):
        s.store(rec("blobs", b"other", NOW + 10, subkey=named), NOW)
    with pytest.raises(ContentMismatch, match=r"^malformed content marker in subkey "):
        s.store(rec("blobs", b"data", NOW + 10, subkey="x[sha256:beef]"), NOW)
    assert s.get("run", NOW) is None


def test_found_gives_the_value_or_the_subkeys_with_the_latest_expiration() -> None:
    s = LocalStore()
    s.store(rec("plain", b"v", NOW + 5), NOW)
    s.store(rec("dict", b"a", NOW + 7, subkey="a"), NOW)
    s.store(rec("dict", b"b", NOW + 9, subkey="b"), NOW)
    assert s.found(DHTKey.encode("plain"), NOW) == (b"v", NOW + 5)
    assert s.found(DHTKey.encode("dict"), NOW) == ({"a": (b"a", NOW + 7), "b": (b"b", NOW + 9)}, NOW + 9)
    assert s.found(DHTKey.encode("dict"), NOW + 8) == ({"b": (b"b", NOW + 9)}, NOW + 9)
    assert s.found(DHTKey.encode("absent"), NOW) is None
    assert sorted(s.keys()) == sorted([DHTKey.encode("plain"), DHTKey.encode("dict")])


def test_too_many_origins_at_once_are_refused_until_old_ones_age_out() -> None:
    s = LocalStore(max_origins=3, origin_window=60)
    for i in range(3):
        assert s.store(rec(f"k{i}", b"v", NOW + 100), NOW, origin=f"peer{i}")
    with pytest.raises(StoreQuotaExceeded, match="^too many peers are storing at once; try again later$"):
        s.store(rec("k9", b"v", NOW + 100), NOW + 1, origin="peer9")
    assert s.store(rec("k0b", b"v", NOW + 100), NOW + 1, origin="peer0")  # a known origin is still counted
    assert s.store(rec("k9", b"v", NOW + 100), NOW + 61, origin="peer9")  # the old ones' windows ended
    one = LocalStore(max_stores_per_origin=1, origin_window=60)
    one.store(rec("a", b"v", NOW + 90), NOW, origin="peer9")
    with pytest.raises(StoreQuotaExceeded, match=r"^peer peer9 sent over 1 stores in 60s; try again later$"):
        one.store(rec("b", b"v", NOW + 90), NOW + 59.9, origin="peer9")
    assert one.store(rec("b", b"v", NOW + 90), NOW + 60, origin="peer9")  # the window is 60 s exactly


def test_a_full_key_evicts_its_soonest_expiring_subkey_and_refuses_a_tie() -> None:
    s = LocalStore(max_subkeys_per_key=2)
    s.store(rec("run", b"v", NOW + 50, subkey="a"), NOW)  # the smallest subkey lives longest
    s.store(rec("run", b"v", NOW + 20, subkey="z"), NOW)
    with pytest.raises(StoreFull, match="^key already has 2 longer-lived subkeys$"):
        s.store(rec("run", b"v", NOW + 20, subkey="m"), NOW)  # as long as the soonest: refused
    assert s.store(rec("run", b"v", NOW + 21, subkey="m"), NOW)
    got = s.get("run", NOW)
    assert isinstance(got, dict) and set(got) == {"a", "m"}


def test_a_replaced_record_frees_its_bytes_and_a_known_key_needs_no_new_slot() -> None:
    one = rec("k", b"x" * 100, NOW + 10, subkey="a").size
    s = LocalStore(max_bytes=one, max_keys=1)
    assert s.store(rec("k", b"x" * 100, NOW + 10, subkey="a"), NOW)
    assert s.store(rec("k", b"y" * 100, NOW + 20, subkey="a"), NOW)  # its own bytes are freed first
    assert s.bytes_used == one
    plain = LocalStore(max_bytes=rec("p", b"x" * 100, NOW + 10).size, max_keys=1)
    assert plain.store(rec("p", b"x" * 100, NOW + 10), NOW)
    assert plain.store(rec("p", b"y" * 100, NOW + 20), NOW)
    keyed = LocalStore(max_keys=1)
    assert keyed.store(rec("k", b"v", NOW + 10, subkey="a"), NOW)
    assert keyed.store(rec("k", b"v", NOW + 10, subkey="b"), NOW)  # the same key: no new key slot
    with pytest.raises(StoreFull, match="^store is full of records that outlive this one; retry later$"):
        keyed.store(rec("other", b"v", NOW + 5), NOW)
    exact = LocalStore(max_bytes=one)
    assert exact.store(rec("k", b"x" * 100, NOW + 10, subkey="a"), NOW)  # exactly max_bytes fits
    with pytest.raises(RecordTooLarge, match=f"^record of {one + 1} bytes exceeds max_bytes$"):
        exact.store(rec("k", b"x" * 101, NOW + 11, subkey="a"), NOW)


def test_the_expiry_heap_is_compacted_and_counts_stay_true() -> None:
    s = LocalStore()
    for i in range(5):
        s.store(rec(f"k{i}", b"v", NOW + 1000), NOW)
    for t in range(1, 2100):  # one key replaced again and again: each leaves a stale heap entry
        assert s.store(rec("k0", b"v", NOW + 1000 + t), NOW)
    assert s._count == len(s) == 5
    assert len(s._heap) <= 2 * 5 + 1024 + 1
    s.expire(NOW + 1001)
    assert s.get("k1", NOW + 1001) is None and s.get("k0", NOW + 1001) == b"v" and s._count == 1


def test_schema_messages_say_which_key_and_what_rule() -> None:
    schema = Schema()
    schema.declare("progress", message=DHTRecordPB, subkeys=True, max_size=20)
    schema.declare("plain", subkeys=False)
    s = LocalStore(schema=schema)
    assert s.store(rec("progress/a", DHTRecordPB(key=b"x" * 16).SerializeToString(), NOW + 1, subkey="p"), NOW)
    for bad, why in [(rec("progress/a", b"x" * 21, NOW + 1, subkey="p"), "^key 'progress/a': value of 21 bytes > 20$"),
                     (rec("progress/a", b"\x0a\x05", NOW + 1), "^key 'progress/a': subkeys are required$"),
                     (rec("plain/a", b"v", NOW + 1, subkey="p"), "^key 'plain/a': subkeys are forbidden$"),
                     (rec("progress/a", b"\xff\xff", NOW + 1, subkey="p"),
                      "^key 'progress/a': value is not a DHTRecord: ")]:
        with pytest.raises(SchemaViolation, match=why):
            s.store(bad, NOW)


def test_key_errors_and_edges_say_what_is_wrong() -> None:
    import sys

    with pytest.raises(InvalidKey, match="^DHT keys and subkeys must be str, bytes or int, not float$"):
        DHTKey.encode(1.5)
    with pytest.raises(InvalidKey, match="^DHT keys and subkeys must be str, bytes or int, not bool$"):
        DHTKey.encode(True)
    lone = "\ud800"  # a lone surrogate: encodable only with surrogatepass, and refused on the way back
    assert DHTKey.encode(lone) == DHTKey.encode("")[:1] + lone.encode("utf-8", "surrogatepass")
    with pytest.raises(InvalidKey, match="^str DHT key is not valid UTF-8$"):
        DHTKey.decode(DHTKey.encode(lone))
    limit = sys.get_int_max_str_digits()
    if limit:
        with pytest.raises(InvalidKey, match="^integer DHT key is too large: "):
            DHTKey.encode(10 ** (limit + 1))
    tag_int = DHTKey.encode(0)[:1]
    for bad in (tag_int + b"-0", tag_int + b"007", b"\x09abc", tag_int + b"x" * 40):
        with pytest.raises(InvalidKey, match="^malformed canonical DHT key " + __import__("re").escape(repr(bad[:32])) + "$"):
            DHTKey.decode(bad)
    assert DHTKey.decode(DHTKey.encode("ü")) == "ü"
    pid = peer_id_of(new_identity())
    assert owned(b"name", pid) == b"name[owner:" + pid.to_base58().encode() + b"]"
    with pytest.raises(InvalidKey, match="^only str and bytes keys can carry an owner marker$"):
        owned(5, pid)


def test_size_and_time_refusals_name_the_limit_and_what_to_do() -> None:
    s = LocalStore(max_key_size=10, max_value_size=100, max_expiration_ahead=3600)
    assert s.store(rec("k" * 9, b"v", NOW + 1), NOW)  # 9 characters and the tag: exactly 10 bytes
    assert s.store(rec("d", b"v", NOW + 1, subkey="s" * 9), NOW)
    for bad in (rec("k" * 10, b"v", NOW + 1), rec("d", b"v", NOW + 1, subkey="s" * 10)):
        with pytest.raises(RecordTooLarge, match="^key or subkey longer than 10 bytes$"):
            s.store(bad, NOW)
    with pytest.raises(RecordTooLarge, match="^value of 101 bytes exceeds the limit of 100; store a reference to the "
                                             "data instead$"):
        s.store(rec("k", b"x" * 101, NOW + 1), NOW)
    with pytest.raises(ExpirationTooFar, match=rf"^expiration {NOW + 3601} is more than 3600s ahead; re-publish "
                                               "periodically instead$"):
        s.store(rec("k", b"v", NOW + 3601), NOW)


def test_an_expired_subkey_makes_room_under_its_own_key() -> None:
    s = LocalStore(max_subkeys_per_key=2)
    s.store(rec("run", b"v", NOW + 5, subkey="old"), NOW)
    s.store(rec("run", b"v", NOW + 50, subkey="kept"), NOW)
    # at NOW + 10 "old" is gone: the new subkey takes its place without evicting "kept"
    assert s.store(rec("run", b"v", NOW + 40, subkey="new"), NOW + 10)
    got = s.get("run", NOW + 10)
    assert isinstance(got, dict) and set(got) == {"kept", "new"}
    # a plain value replaces an expired one even when it expires sooner than the old one did
    s.store(rec("p", b"a", NOW + 20), NOW)
    assert s.store(rec("p", b"b", NOW + 30), NOW + 25) and s.get("p", NOW + 25) == b"b"


def test_making_room_skips_stale_heap_entries_evicts_subkeys_and_spares_its_own_key() -> None:
    one, sub = rec("a", b"x" * 50, NOW + 10).size, rec("b", b"x" * 50, NOW + 20, subkey="s").size
    s = LocalStore(max_bytes=2 * one + sub)
    s.store(rec("a", b"x" * 50, NOW + 10), NOW)
    s.store(rec("a", b"y" * 50, NOW + 60), NOW)  # "a" replaced: its NOW + 10 heap entry is stale
    s.store(rec("b", b"x" * 50, NOW + 20, subkey="s"), NOW)  # a subkey record, the soonest live one
    s.store(rec("c", b"x" * 50, NOW + 30), NOW)
    assert s.bytes_used == 2 * one + sub
    # full: the newcomer evicts the soonest live record ("b"/"s"), not "a" (its stale entry comes first)
    assert s.store(rec("d", b"x" * 50, NOW + 40), NOW)
    assert s.get("b", NOW) is None and s.get("a", NOW) == b"y" * 50 and s.get("c", NOW) == b"x" * 50
    # one that expires exactly with the soonest ("c" at NOW + 30) displaces nothing
    with pytest.raises(StoreFull, match="^store is full of records that outlive this one; retry later$"):
        s.store(rec("e", b"x" * 50, NOW + 30), NOW)
    # a new subkey never evicts another subkey of its own key to make room
    size = rec("g", b"x" * 50, NOW + 5, subkey="s1").size
    own = LocalStore(max_bytes=2 * size)
    own.store(rec("g", b"x" * 50, NOW + 5, subkey="s1"), NOW)
    own.store(rec("h", b"x" * 50, NOW + 50, subkey="s1"), NOW)
    with pytest.raises(StoreFull):
        own.store(rec("g", b"x" * 50, NOW + 60, subkey="s2"), NOW)
    got = own.get("g", NOW)
    assert isinstance(got, dict) and set(got) == {"s1"}
