import os
import random
import stat

import pytest
from libp2p.crypto.keys import KeyType

from p2p import IdentityError
from p2p.identity import MAX_IDENTITY_FILE_SIZE, default_identity_path, load_identity, load_or_create_identity
from p2p.identity import new_identity, peer_id_from_file, peer_id_of, save_identity


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
    with pytest.raises(IdentityError, match=r"is not a libp2p private key \(\w+Error\); move it away to create a new identity$"):
        load_identity(path)
    assert path.read_bytes() == content  # never overwritten


def test_the_default_path_is_in_the_xdg_config_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "conf"))
    assert default_identity_path() == tmp_path / "conf" / "dedloc" / "identity.key"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_identity_path() == tmp_path / "home" / ".config" / "dedloc" / "identity.key"


@pytest.mark.parametrize("reader", [load_identity, peer_id_from_file], ids=["py-libp2p", "light"])
def test_a_missing_or_unreachable_or_oversized_file_says_which_and_why(tmp_path, reader):
    with pytest.raises(IdentityError, match=f"identity file {tmp_path / 'none.key'} does not exist"):
        load_identity(tmp_path / "none.key")
    (tmp_path / "plain").write_bytes(b"")
    under_a_file = tmp_path / "plain" / "identity.key"
    with pytest.raises(IdentityError, match=f"cannot read identity file {under_a_file}: Not a directory"):
        load_identity(under_a_file)
    path = tmp_path / "big.key"
    path.write_bytes(b"x" * MAX_IDENTITY_FILE_SIZE)  # the largest read: then refused for what it holds
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError) as refused:
        reader(path)
    assert "bytes: not a key file" not in str(refused.value)
    path.write_bytes(b"x" * (MAX_IDENTITY_FILE_SIZE + 1))
    with pytest.raises(IdentityError, match=f"identity file {path} is {MAX_IDENTITY_FILE_SIZE + 1} bytes: not a key file"):
        reader(path)


def test_a_new_file_s_directories_are_made_for_its_owner_alone(tmp_path):
    path = tmp_path / "a" / "b" / "identity.key"
    load_or_create_identity(path)
    old = os.umask(0)
    try:
        peer_id_from_file(tmp_path / "c" / "d" / "identity.key")
    finally:
        os.umask(old)
    for made in (tmp_path / "a" / "b", tmp_path / "c" / "d"):  # its own (~/.config stays as umask makes it)
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made


@pytest.mark.parametrize("create", [load_or_create_identity, peer_id_from_file], ids=["py-libp2p", "light"])
def test_an_identity_that_cannot_be_created_says_why(tmp_path, create):
    (tmp_path / "plain").write_bytes(b"")
    path = tmp_path / "plain" / "identity.key"  # its directory would be a file
    with pytest.raises(IdentityError, match=f"cannot create identity file {path}: File exists"):
        create(path)


def secp256k1_key_file(path):
    """An identity file holding a valid libp2p key of another type, mode 0600."""
    from libp2p.crypto.secp256k1 import create_new_key_pair

    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, create_new_key_pair().private_key.serialize())
    os.close(fd)
    return path


def test_non_ed25519_key_is_refused(tmp_path):
    path = secp256k1_key_file(tmp_path / "identity.key")
    with pytest.raises(IdentityError, match="holds a Secp256k1 key; dedloc peer ids are Ed25519$"):
        load_identity(path)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(IdentityError, match="not a regular file"):
        load_identity(tmp_path)


def test_save_never_overwrites(tmp_path):
    path = tmp_path / "identity.key"
    save_identity(path, new_identity())
    before = path.read_bytes()
    with pytest.raises(IdentityError, match=f"identity file {path} appeared while creating it"):
        save_identity(path, new_identity())
    assert path.read_bytes() == before


# ---------------------------------------------------------------- `dedloc id` without py-libp2p


def test_the_light_reader_agrees_with_py_libp2p_both_ways(tmp_path):
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
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    wanted = {b"": r"is not a libp2p private key \(ValueError\); move it away to create a new identity$",
              GARBAGE: r"is not a libp2p private key \(\w+Error\); move it away to create a new identity$"}
    with pytest.raises(IdentityError, match=wanted.get(content, "not a libp2p private key|Ed25519")):
        peer_id_from_file(path)
    assert path.read_bytes() == content
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        peer_id_from_file(path)


def test_the_light_reader_refuses_other_key_types(tmp_path):
    path = secp256k1_key_file(tmp_path / "identity.key")
    with pytest.raises(IdentityError, match="Secp256k1 key; dedloc peer ids are Ed25519"):
        peer_id_from_file(path)


def test_the_light_reader_refuses_an_ed25519_key_of_the_wrong_size(tmp_path):
    from p2p.proto import keys_pb2

    path = tmp_path / "identity.key"
    path.write_bytes(keys_pb2.PrivateKey(Type=keys_pb2.Ed25519, Data=bytes(31)).SerializeToString())
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match=f"identity file {path} holds an Ed25519 key of 31 bytes, not 32$"):
        peer_id_from_file(path)


def test_an_identity_is_held_by_one_node_at_a_time_and_read_freely_meanwhile(tmp_path):
    """Two nodes with one peer id ran side by side; the swarm cannot tell them apart."""
    from p2p.identity import held_identity

    path = tmp_path / "identity.key"
    with held_identity(path) as key_pair:  # created on first use, then held
        assert peer_id_from_file(path) == (str(peer_id_of(key_pair)), False)  # `dedloc id` reads it meanwhile
        with pytest.raises(IdentityError) as refused, held_identity(path):
            pass
        assert str(refused.value) == (f"identity file {path} is in use by another running dedloc node (one peer "
                                      "id, one node); stop it, or give this one another --identity (or --ephemeral)")
    with held_identity(path) as again:  # released at the end of the block
        assert peer_id_of(again) == peer_id_of(key_pair)


def test_a_bad_identity_file_is_refused_before_it_is_held(tmp_path):
    from p2p.identity import held_identity

    path = tmp_path / "identity.key"
    path.write_bytes(b"not a key at all")
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="is not a libp2p private key"), held_identity(path):
        pass
