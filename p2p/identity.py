"""The node's long-lived Ed25519 identity, kept in a file only its owner can read.

A peer id is the swarm's name for a volunteer (allowlists, contribution
accounting and relay reservations key on it), so it must survive restarts and
must not leak: the key file is created with mode 0600 and refused when others
can read it, as ssh does with private keys. The file holds the libp2p protobuf
encoding of the private key, the format other libp2p implementations use.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from .errors import IdentityError

MAX_IDENTITY_FILE_SIZE = 4096


def default_identity_path() -> Path:
    """Where ``dedloc`` keeps the identity unless told otherwise (XDG config dir)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dedloc" / "identity.key"


def new_identity() -> KeyPair:
    """A fresh in-memory Ed25519 identity (tests, throwaway nodes)."""
    return create_new_key_pair()


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)


def load_identity(path: Path) -> KeyPair:
    """Read an identity file, refusing ones that are insecure or not Ed25519."""
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
    data = path.read_bytes()
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


def save_identity(path: Path, key_pair: KeyPair) -> None:
    """Write a new identity file atomically with mode 0600; never overwrite one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key_pair.private_key.serialize())
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
