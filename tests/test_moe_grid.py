"""training/moe/grid.py: expert uids on a grid, their DHT keys and subkeys, and hivemind-style patterns
(pure; the search over them: tests/test_moe.py)."""

from __future__ import annotations

import pytest

from p2p.errors import ConfigError
from training.moe.grid import (
    MAX_DIMS,
    MAX_GRID_SIZE,
    UID_DELIMITER,
    ExpertUid,
    UidError,
    coordinate_subkey,
    expand_pattern,
    parse_subkey,
    prefix_key,
)

from .kit import random_peer_id


def test_a_uid_parses_prints_and_names_its_level_keys() -> None:
    uid = ExpertUid.parse("ffn.3.5")
    assert uid == ExpertUid("ffn", (3, 5)) and str(uid) == "ffn.3.5" and UID_DELIMITER == "."
    assert list(uid.level_keys()) == [("ffn", 3), ("ffn.3", 5)]
    assert list(ExpertUid.parse("Ab_-9.0").level_keys()) == [("Ab_-9", 0)]
    assert ExpertUid.parse("_x.1") < ExpertUid.parse("_x.2")  # ordered: prefix, then coordinates
    assert prefix_key("ffn", ()) == "ffn" and prefix_key("ffn", [3, 5]) == "ffn.3.5"
    assert issubclass(UidError, ConfigError)


def test_the_grid_s_bounds_are_inclusive_where_they_say() -> None:
    eight = "e." + ".".join(["1"] * MAX_DIMS)
    assert ExpertUid.parse(eight).coords == (1,) * MAX_DIMS
    assert ExpertUid.parse(f"e.{MAX_GRID_SIZE - 1}").coords == (MAX_GRID_SIZE - 1,)
    assert ExpertUid.parse("e" * 64 + ".1").prefix == "e" * 64
    text = "ee" + ".1" * 127  # 256 characters: allowed in length, too many dimensions
    assert len(text) == 256
    with pytest.raises(UidError, match="want PREFIX"):
        ExpertUid.parse(text)


@pytest.mark.parametrize(("bad", "message"), [
    ("ffn", r"^expert uid 'ffn': want PREFIX\.i\.j\.\.\. \(a name and 1\.\.8 coordinates\)$"),
    ("3.4", r"^expert uid '3\.4': want PREFIX"),
    ("e" * 65 + ".1", r"want PREFIX"),
    ("ffn.1.2.3.4.5.6.7.8.9", r"want PREFIX"),
    ("ffn.x", r"^expert uid 'ffn\.x': coordinates must be integers$"),
    ("ffn..1", r"coordinates must be integers$"),
    ("ffn.-1", r"^expert uid 'ffn\.-1': coordinates must be plain integers in \[0, 1048576\)$"),
    ("ffn.01", r"coordinates must be plain integers"),
    ("ffn.+1", r"coordinates must be plain integers"),
    (f"ffn.{MAX_GRID_SIZE}", r"coordinates must be plain integers"),
    ("a" * 300, r"^an expert uid is a short string, not 'aaaa"),
    ("a" * 257, r"^an expert uid is a short string"),
])
def test_malformed_uids_are_refused_by_name(bad: str, message: str) -> None:
    with pytest.raises(UidError, match=message):
        ExpertUid.parse(bad)


def test_a_uid_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(UidError, match="^an expert uid is a short string, not 42$"):
        ExpertUid.parse(42)  # type: ignore[arg-type]


def test_subkeys_name_the_coordinate_and_the_server() -> None:
    server = random_peer_id()
    assert coordinate_subkey(7, server) == f"7[owner:{server.to_base58()}]"
    assert parse_subkey(coordinate_subkey(7, server)) == (7, server)
    assert parse_subkey(coordinate_subkey(0, server)) == (0, server)
    assert parse_subkey(coordinate_subkey(999_999_999, server)) == (999_999_999, server)
    for junk in ["7", 7, b"7[owner:" + server.to_base58().encode() + b"]", "x[owner:abc]", None,
                 "07[owner:" + server.to_base58() + "]", "1000000000[owner:" + server.to_base58() + "]",
                 "7[owner:" + server.to_base58() + "]x", "7[owner:" + "1" * 19 + "]"]:
        assert parse_subkey(junk) is None, junk


def test_patterns_expand_to_every_uid_in_order() -> None:
    assert [str(u) for u in expand_pattern("ffn.[0:2].[1:3]")] == ["ffn.0.1", "ffn.0.2", "ffn.1.1", "ffn.1.2"]
    assert [str(u) for u in expand_pattern("ffn.1.[2:4]")] == ["ffn.1.2", "ffn.1.3"]
    assert [str(u) for u in expand_pattern("ffn.0")] == ["ffn.0"]
    assert len(expand_pattern("e.[0:16].[0:16]")) == 256
    assert len(expand_pattern("e.[0:100000]")) == 100_000  # the most a pattern may name
    assert expand_pattern(f"e.[{MAX_GRID_SIZE - 1}:{MAX_GRID_SIZE}]") == [ExpertUid("e", (MAX_GRID_SIZE - 1,))]
    assert len(expand_pattern("e." + ".".join(["0"] * MAX_DIMS))) == 1


@pytest.mark.parametrize(("bad", "message"), [
    ("ffn", r"^expert pattern 'ffn': want PREFIX\.\[a:b\]\.\[c:d\]\.\.\. or fixed coordinates$"),
    ("3.[0:2]", r"want PREFIX"),
    ("e." + ".".join(["0"] * (MAX_DIMS + 1)), r"want PREFIX"),
    ("e.[0:x]", r"^expert pattern 'e\.\[0:x\]': '\[0:x\]' is neither \[a:b\] nor an integer$"),
    ("e.-1", r"is neither \[a:b\] nor an integer$"),
    ("e.[2:2]", r"^expert pattern 'e\.\[2:2\]': empty or out-of-range '\[2:2\]'$"),
    ("e.[3:2]", r"empty or out-of-range"),
    (f"e.[0:{MAX_GRID_SIZE + 1}]", r"empty or out-of-range"),
    (f"e.{MAX_GRID_SIZE}", r"empty or out-of-range"),
    ("e.[0:100001]", r"^expert pattern 'e\.\[0:100001\]' names 100001 experts \(at most 100000\)$"),
    ("e.[0:1000].[0:1000]", r"names 1000000 experts"),
])
def test_malformed_patterns_are_refused_by_name(bad: str, message: str) -> None:
    with pytest.raises(UidError, match=message):
        expand_pattern(bad)
