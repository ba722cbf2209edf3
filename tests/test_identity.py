import os
import random
import stat

import pytest
from libp2p.crypto.keys import KeyType

from p2p import IdentityError
from p2p.identity import load_identity, load_or_create_identity, peer_id_of, save_identity
from p2p.identity import new_identity


def test_created_with_mode_0600_and_reused(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    first, created = load_or_create_identity(path)
    assert created
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first.private_key.get_type() == KeyType.Ed25519
    again, created_again = load_or_create_identity(path)
    assert not created_again
    assert peer_id_of(again) == peer_id_of(first)
    assert str(peer_id_of(first)).startswith("12D3KooW")  # Ed25519 ids are inlined


def test_group_readable_file_is_refused(tmp_path):
    path = tmp_path / "identity.key"
    load_or_create_identity(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(path)


#: 68 random bytes, the same in every process (xdist workers must collect the same tests)
GARBAGE = random.Random(68).randbytes(68)


@pytest.mark.parametrize("content", [b"", b"not a key at all", GARBAGE], ids=["empty", "text", "random"])
def test_garbage_file_is_refused_and_kept(tmp_path, content):
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="not a libp2p private key|not a key file"):
        load_identity(path)
    assert path.read_bytes() == content  # never overwritten


def secp256k1_key_file(path):
    """An identity file holding a valid libp2p key of another type, mode 0600."""
    from libp2p.crypto.secp256k1 import create_new_key_pair

    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, create_new_key_pair().private_key.serialize())
    os.close(fd)
    return path


def test_non_ed25519_key_is_refused(tmp_path):
    path = secp256k1_key_file(tmp_path / "identity.key")
    with pytest.raises(IdentityError, match="Secp256k1|dedloc peer ids are Ed25519"):
        load_identity(path)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(IdentityError, match="not a regular file"):
        load_identity(tmp_path)


def test_save_never_overwrites(tmp_path):
    path = tmp_path / "identity.key"
    save_identity(path, new_identity())
    before = path.read_bytes()
    with pytest.raises(IdentityError):
        save_identity(path, new_identity())
    assert path.read_bytes() == before


# ---------------------------------------------------------------- `dedloc id` without py-libp2p


def test_the_light_reader_agrees_with_py_libp2p_both_ways(tmp_path):
    from p2p.identity import peer_id_from_file

    made_by_libp2p = tmp_path / "a.key"
    key_pair, _ = load_or_create_identity(made_by_libp2p)
    assert peer_id_from_file(made_by_libp2p) == (str(peer_id_of(key_pair)), False)
    made_light = tmp_path / "b.key"
    pid, created = peer_id_from_file(made_light)
    assert created and stat.S_IMODE(made_light.stat().st_mode) == 0o600
    assert str(peer_id_of(load_identity(made_light))) == pid
    assert made_light.read_bytes() == load_identity(made_light).private_key.serialize()  # the same bytes


@pytest.mark.parametrize("content", [b"", b"not a key at all", GARBAGE], ids=["empty", "text", "random"])
def test_the_light_reader_refuses_what_py_libp2p_refuses(tmp_path, content):
    from p2p.identity import peer_id_from_file

    path = tmp_path / "identity.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="not a libp2p private key|not a key file|Ed25519"):
        peer_id_from_file(path)
    assert path.read_bytes() == content
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        peer_id_from_file(path)


def test_the_light_reader_refuses_other_key_types(tmp_path):
    from p2p.identity import peer_id_from_file

    path = secp256k1_key_file(tmp_path / "identity.key")
    with pytest.raises(IdentityError, match="Secp256k1 key; dedloc peer ids are Ed25519"):
        peer_id_from_file(path)
