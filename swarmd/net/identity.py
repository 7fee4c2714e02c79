"""The node's Ed25519 identity: key file, libp2p peer id, signing and verifying.

Peer ids are computed exactly as libp2p does for an Ed25519 key: the identity multihash
(code 0x00) of the protobuf ``PublicKey{Type: Ed25519 (1), Data: 32 raw bytes}``,
written in base58btc. They are 52 characters long and all start with ``12D3KooW``.

The key file ``identity.key`` uses the format of py-libp2p's
``identity_utils.save_identity/load_identity`` (0.8.1): the protobuf
``PrivateKey{Type: Ed25519 (1), Data: 32-byte seed}``, i.e. the 36 bytes
``08 01 12 20 <seed>``, mode 0600. libp2p's ``load_identity`` reads our file and we read
its file. For a later libp2p host: ``libp2p.crypto.ed25519.create_new_key_pair(
seed=identity.private_seed)``.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from swarmd.errors import IdentityError
from swarmd.net.private_file import read_private_file

__all__ = [
    "KEY_FILE_NAME",
    "Identity",
    "b58decode",
    "b58encode",
    "load_or_create_identity",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "verify",
]

KEY_FILE_NAME = "identity.key"

# protobuf field 1 (key_type, varint) = 1 (Ed25519); field 2 (data, bytes) of length 32.
_ED25519_KEY_PREFIX = b"\x08\x01\x12\x20"
# go-libp2p writes Data as seed || public key (64 bytes); accepted on read only.
_ED25519_KEY64_PREFIX = b"\x08\x01\x12\x40"
# identity multihash: code 0x00, digest length 36 (the protobuf public key above).
_PEER_ID_PREFIX = b"\x00\x24" + _ED25519_KEY_PREFIX
_PEER_ID_BYTES = len(_PEER_ID_PREFIX) + 32  # 38
_PEER_ID_MAX_CHARS = 64  # an Ed25519 peer id is 52 chars; bounds the base58 work on junk
_SIGNATURE_BYTES = 64
_KEY_FILE_MAX_BYTES = 4096

# --- base58btc (bitcoin alphabet) -------------------------------------------------------

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def b58encode(data: bytes) -> str:
    """Encode bytes as base58btc; each leading zero byte becomes a leading '1'."""
    zeros = len(data) - len(data.lstrip(b"\x00"))
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, rem = divmod(n, 58)
        out.append(_B58_ALPHABET[rem])
    return "1" * zeros + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    """Decode base58btc; raises ValueError on a character outside the alphabet."""
    n = 0
    for ch in text:
        digit = _B58_INDEX.get(ch)
        if digit is None:
            raise ValueError(f"invalid base58 character {ch!r}")
        n = n * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\x00" * zeros + body


# --- peer ids ---------------------------------------------------------------------------


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58btc) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    return b58encode(_PEER_ID_PREFIX + public_key)


def public_key_from_peer_id(peer_id: str) -> bytes | None:
    """The raw 32-byte Ed25519 public key inside a peer id, or None if it holds none."""
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _PEER_ID_MAX_CHARS:
        return None
    try:
        raw = b58decode(peer_id)
    except ValueError:
        return None
    if len(raw) != _PEER_ID_BYTES or not raw.startswith(_PEER_ID_PREFIX):
        return None
    return raw[len(_PEER_ID_PREFIX) :]


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True if ``signature`` is the Ed25519 signature of ``data`` by the key of ``peer_id``.

    Never raises on bad input: a malformed peer id, a non-Ed25519 peer id, a signature of
    the wrong type or length, or an invalid point all give False.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        return False
    if not isinstance(signature, bytes | bytearray) or len(signature) != _SIGNATURE_BYTES:
        return False
    raw = public_key_from_peer_id(peer_id)
    if raw is None:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(raw).verify(bytes(signature), bytes(data))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


# --- the identity -----------------------------------------------------------------------


class Identity:
    """The node's Ed25519 key pair and the names derived from it (immutable)."""

    __slots__ = ("_peer_id", "_private_key", "_public_key_bytes")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise TypeError("Identity needs a cryptography Ed25519PrivateKey")
        pub = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        object.__setattr__(self, "_private_key", private_key)
        object.__setattr__(self, "_public_key_bytes", pub)
        object.__setattr__(self, "_peer_id", peer_id_from_public_key(pub))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Identity is immutable")

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a raw 32-byte seed (as libp2p's ``create_identity_from_seed``)."""
        if len(seed) != 32:
            raise ValueError(f"an Ed25519 seed has 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return self._private_key

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def short_id(self) -> str:
        return self._peer_id[-8:]

    @property
    def public_key_bytes(self) -> bytes:
        return self._public_key_bytes

    @property
    def private_seed(self) -> bytes:
        return self._private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(bytes(data))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Identity):
            return NotImplemented
        return self._peer_id == other._peer_id

    def __hash__(self) -> int:
        return hash(self._peer_id)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self._peer_id!r})"


# --- the key file -----------------------------------------------------------------------


def _encode_key_file(identity: Identity) -> bytes:
    return _ED25519_KEY_PREFIX + identity.private_seed


def _decode_key_file(path: Path, blob: bytes) -> Identity:
    if len(blob) == 36 and blob.startswith(_ED25519_KEY_PREFIX):
        return Identity.from_seed(blob[4:])
    if len(blob) == 68 and blob.startswith(_ED25519_KEY64_PREFIX):
        identity = Identity.from_seed(blob[4:36])
        if identity.public_key_bytes == blob[36:]:
            return identity
    raise IdentityError(
        f"The identity key file {path} is corrupt (expected a libp2p protobuf Ed25519 "
        f"private key, got {len(blob)} bytes). Restore it from a backup, or delete it to "
        "start this node with a new peer id."
    )


def _read_key_file(path: Path) -> Identity | None:
    """The identity in ``path``, or None if the file does not exist."""
    try:
        blob = read_private_file(
            path, "identity key file", _KEY_FILE_MAX_BYTES, 0o077, IdentityError
        )
    except FileNotFoundError:
        return None
    return _decode_key_file(path, blob)


def _create_key_file(path: Path, identity: Identity) -> bool:
    """Write a new key file; False if one appeared meanwhile (another process won)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return False
    except OSError as exc:
        raise IdentityError(f"Cannot create the identity key file {path}: {exc}") from exc
    try:
        try:
            if os.name != "nt":
                os.fchmod(fd, 0o600)  # the umask may only have narrowed it; make it exact
            data = _encode_key_file(identity)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise IdentityError(f"Cannot write the identity key file {path}: {exc}") from exc
    return True


def load_or_create_identity(data_dir: Path) -> Identity:
    """Load ``data_dir/identity.key``, creating it (and ``data_dir``, mode 0700) if missing.

    Raises IdentityError if the file is unreadable, corrupt, or readable by group/others.
    """
    data_dir = Path(data_dir)
    path = data_dir / KEY_FILE_NAME
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise IdentityError(f"Cannot create the data directory {data_dir}: {exc}") from exc
    identity = _read_key_file(path)
    if identity is not None:
        return identity
    identity = Identity.generate()
    if _create_key_file(path, identity):
        return identity
    identity = _read_key_file(path)
    if identity is None:
        raise IdentityError(f"The identity key file {path} vanished while it was being created")
    return identity
