"""The node's long-lived Ed25519 identity, kept in a file only its owner can read.

A peer id is the swarm's name for a volunteer (allowlists, contribution
accounting and relay reservations key on it), so it must survive restarts and
must not leak: the key file is created with mode 0600 and refused when others
can read it, as ssh does with private keys. The file holds the libp2p protobuf
encoding of the private key, the format other libp2p implementations use.
One running node at a time uses an identity (:func:`held_identity`): the swarm
keys relay slots, routing tables and allowlists on the peer id, and cannot tell
two nodes with one apart.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import IdentityError

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair
    from libp2p.peer.id import ID

# py-libp2p is imported inside the functions that need it: importing it costs 0.7 s, and
# `dedloc --help` builds its parser (default_identity_path) without it (p2p/lazy.py).

MAX_IDENTITY_FILE_SIZE = 4096


def default_identity_path() -> Path:
    """Where ``dedloc`` keeps the identity unless told otherwise (XDG config dir)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dedloc" / "identity.key"


def new_identity() -> KeyPair:
    """A fresh in-memory Ed25519 identity (tests, throwaway nodes)."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    return create_new_key_pair()


def peer_id_of(key_pair: KeyPair) -> ID:
    from libp2p.peer.id import ID

    return ID.from_pubkey(key_pair.public_key)


def load_identity(path: Path) -> KeyPair:
    """Read an identity file, refusing ones that are insecure or not Ed25519."""
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.crypto.keys import KeyPair, KeyType
    from libp2p.crypto.serialization import deserialize_private_key

    data = _read_key_file(path)
    try:
        private_key = deserialize_private_key(data)
    except Exception as e:
        raise IdentityError(
            f"identity file {path} is not a libp2p private key ({type(e).__name__}); "
            "move it away to create a new identity"
        ) from e
    if private_key.get_type() != KeyType.Ed25519 or not isinstance(
        private_key, Ed25519PrivateKey
    ):
        raise IdentityError(
            f"identity file {path} holds a {private_key.get_type().name} key; "
            "dedloc peer ids are Ed25519"
        )
    return KeyPair(private_key, private_key.get_public_key())


def _read_key_file(path: Path) -> bytes:
    """The bytes of an identity file, refused when others may read it or it is no key file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise IdentityError(f"identity file {path} does not exist") from None
    except OSError as e:
        raise IdentityError(f"cannot read identity file {path}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        raise IdentityError(f"identity file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise IdentityError(
            f"identity file {path} has mode {stat.S_IMODE(st.st_mode):04o}; other users "
            f"could read your private key. Fix it with: chmod 600 {path}"
        )
    if st.st_size > MAX_IDENTITY_FILE_SIZE:
        raise IdentityError(f"identity file {path} is {st.st_size} bytes: not a key file")
    return path.read_bytes()


def save_identity(path: Path, key_pair: KeyPair) -> None:
    """Write a new identity file atomically with mode 0600; never overwrite one."""
    _write_key_file(path, key_pair.private_key.serialize())


def _write_key_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if another process created it first
    except FileExistsError:
        raise IdentityError(f"identity file {path} appeared while creating it") from None
    finally:
        tmp.unlink(missing_ok=True)


def load_or_create_identity(path: Path) -> tuple[KeyPair, bool]:
    """The identity at ``path``, created on first use; also says whether it is new."""
    if path.exists() or path.is_symlink():
        return load_identity(path), False
    key_pair = new_identity()
    try:
        save_identity(path, key_pair)
    except OSError as e:
        raise IdentityError(f"cannot create identity file {path}: {e.strerror}") from e
    return key_pair, True


@contextmanager
def held_identity(path: Path) -> Iterator[KeyPair]:
    """The identity at ``path`` (created on first use), held for the block: a second node started
    with the same file is refused, as kubo refuses a second daemon on one repo (two nodes with one
    peer id ran side by side before, which the swarm cannot tell apart). The hold
    is an exclusive ``flock`` on the key file itself: no lock file to leave behind, and the kernel
    drops it when the process ends, however it ends. Reading the file (``dedloc id``) takes none."""
    from .lockfile import HeldLock, LockHeld

    key_pair, _ = load_or_create_identity(path)
    try:
        lock = HeldLock.acquire(path, record_pid=False)  # read-only: the file is the key
    except LockHeld:
        raise IdentityError(f"identity file {path} is in use by another running dedloc node (one peer id, one "
                            "node); stop it, or give this one another --identity (or --ephemeral)") from None
    with lock:
        yield key_pair


def peer_id_from_file(path: Path) -> tuple[str, bool]:
    """The peer id (base58) of the identity at ``path``, created on first use, and whether it is new.

    Without py-libp2p, whose import is the whole cost of ``dedloc id`` (0.7 s): the file is libp2p's
    PrivateKey protobuf (p2p/proto/keys.proto), the Ed25519 key is PyNaCl's, the peer id the identity
    multihash of the PublicKey's encoding (the peer-id spec); the same bytes and id as
    :func:`load_or_create_identity` and :func:`peer_id_of` (tests/test_identity.py holds them equal).
    """
    import multihash
    from nacl.signing import SigningKey

    from .proto import keys_pb2

    created = not (path.exists() or path.is_symlink())
    if created:
        key = SigningKey.generate()
        try:
            _write_key_file(path, keys_pb2.PrivateKey(Type=keys_pb2.Ed25519, Data=bytes(key)).SerializeToString())
        except OSError as e:
            raise IdentityError(f"cannot create identity file {path}: {e.strerror}") from e
    else:
        message = keys_pb2.PrivateKey()
        try:
            data = _read_key_file(path)
            if not data:  # parsed, it would be an RSA key of no bytes
                raise ValueError
            message.ParseFromString(data)
        except Exception as e:
            if isinstance(e, IdentityError):
                raise
            raise IdentityError(f"identity file {path} is not a libp2p private key ({type(e).__name__}); "
                                "move it away to create a new identity") from e
        if message.Type != keys_pb2.Ed25519:
            raise IdentityError(f"identity file {path} holds a {keys_pb2.KeyType.Name(message.Type)} key; "
                                "dedloc peer ids are Ed25519")
        if len(message.Data) != 32:
            raise IdentityError(f"identity file {path} holds an Ed25519 key of {len(message.Data)} bytes, not 32")
        key = SigningKey(message.Data)
    public = keys_pb2.PublicKey(Type=keys_pb2.Ed25519, Data=bytes(key.verify_key)).SerializeToString()
    return str(multihash.to_b58_string(multihash.encode(public, 0x00))), created
