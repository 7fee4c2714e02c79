from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from swarmd.errors import IdentityError
from swarmd.net.identity import (
    Identity,
    b58decode,
    b58encode,
    load_or_create_identity,
    public_key_from_peer_id,
    verify,
)

# Known-answer vector, produced with the real py-libp2p 0.8.1 in a scratch venv:
#   from libp2p.identity_utils import create_identity_from_seed
#   from libp2p.peer.id import ID
#   kp = create_identity_from_seed(bytes(range(32)))
#   ID.from_pubkey(kp.public_key).to_base58()   -> LIBP2P_PEER_ID
#   kp.private_key.serialize().hex()            -> LIBP2P_KEY_FILE (what save_identity writes)
#   kp.private_key.sign(b"hello").hex()         -> LIBP2P_SIG_HELLO
VECTOR_SEED = bytes(range(32))
LIBP2P_PEER_ID = "12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB"
LIBP2P_KEY_FILE = bytes.fromhex(
    "08011220000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
)
LIBP2P_SIG_HELLO = bytes.fromhex(
    "e1a7fca94a835127885b99e2eba733d6ee5bf5dc463ed8385eb6f1dcaa1117c0"
    "f151750a10f46f5b3796a91203578f702c85c67c334b5689a516284d499f710f"
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_known_answer_vector_matches_libp2p() -> None:
    ident = Identity.from_seed(VECTOR_SEED)
    assert ident.peer_id == LIBP2P_PEER_ID
    assert ident.private_seed == VECTOR_SEED
    assert ident.sign(b"hello") == LIBP2P_SIG_HELLO
    assert verify(LIBP2P_PEER_ID, b"hello", LIBP2P_SIG_HELLO)


def test_reads_a_key_file_written_by_libp2p(tmp_path: Path) -> None:
    key = tmp_path / "identity.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, LIBP2P_KEY_FILE)
    os.close(fd)
    assert load_or_create_identity(tmp_path).peer_id == LIBP2P_PEER_ID


def test_create_then_reload_same_peer_id(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = load_or_create_identity(data_dir)
    second = load_or_create_identity(data_dir)
    assert first.peer_id == second.peer_id
    assert first.private_seed == second.private_seed
    assert first == second
    # the file is in libp2p's save_identity format: protobuf PrivateKey{Ed25519, seed}
    assert (data_dir / "identity.key").read_bytes() == b"\x08\x01\x12\x20" + first.private_seed


def test_file_and_dir_modes(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    load_or_create_identity(data_dir)
    assert _mode(data_dir / "identity.key") == 0o600
    assert _mode(data_dir) & 0o077 == 0


def test_group_readable_file_is_refused(tmp_path: Path) -> None:
    load_or_create_identity(tmp_path)
    key = tmp_path / "identity.key"
    key.chmod(0o644)
    with pytest.raises(IdentityError) as err:
        load_or_create_identity(tmp_path)
    msg = str(err.value)
    assert str(key) in msg
    assert "0644" in msg
    assert "chmod 600" in msg


@pytest.mark.parametrize(
    "blob",
    [b"", b"garbage", b"\x08\x01\x12\x20" + b"\x00" * 31, b"\x08\x02\x12\x20" + b"\x00" * 32],
)
def test_corrupt_file_is_refused(tmp_path: Path, blob: bytes) -> None:
    key = tmp_path / "identity.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, blob)
    os.close(fd)
    with pytest.raises(IdentityError, match="corrupt") as err:
        load_or_create_identity(tmp_path)
    assert str(key) in str(err.value)
    assert key.read_bytes() == blob  # never overwritten


def test_key_path_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    # A directory where the key should be is unreadable as a key for any user, root too.
    key = tmp_path / "identity.key"
    key.mkdir(mode=0o700)
    with pytest.raises(IdentityError) as err:
        load_or_create_identity(tmp_path)
    assert str(key) in str(err.value)


def test_peer_id_shape_and_short_id() -> None:
    ident = Identity.generate()
    assert ident.peer_id.startswith("12D3KooW")
    assert len(ident.peer_id) == 52
    assert ident.short_id == ident.peer_id[-8:]
    assert len(ident.public_key_bytes) == 32
    assert len(ident.private_seed) == 32
    assert public_key_from_peer_id(ident.peer_id) == ident.public_key_bytes


def test_sign_verify_round_trip() -> None:
    ident = Identity.generate()
    sig = ident.sign(b"payload")
    assert len(sig) == 64
    assert verify(ident.peer_id, b"payload", sig)


def test_verify_rejects_bad_input_without_raising() -> None:
    ident = Identity.generate()
    other = Identity.generate()
    sig = ident.sign(b"payload")
    assert not verify(other.peer_id, b"payload", sig)  # wrong key
    assert not verify(ident.peer_id, b"payloaD", sig)  # tampered message
    assert not verify(ident.peer_id, b"payload", sig[:63])  # wrong-length signature
    assert not verify(ident.peer_id, b"payload", sig + b"\x00")
    assert not verify(ident.peer_id, b"payload", bytes(64))
    for junk in [
        "",
        "garbage",
        "0OIl",  # not in the base58 alphabet
        "12D3KooW",
        ident.peer_id[:-1],
        ident.peer_id + "1",
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # a sha2-256 (RSA) peer id
        "1" * 10_000,
        None,
        b"12D3KooW",
    ]:
        assert not verify(junk, b"payload", sig)  # type: ignore[arg-type]
    assert not verify(ident.peer_id, b"payload", "not bytes")  # type: ignore[arg-type]
    assert not verify(ident.peer_id, None, sig)  # type: ignore[arg-type]


def test_base58_round_trip_with_leading_zeros() -> None:
    for data in [b"", b"\x00", b"\x00\x00\x00", b"\x00\x00\x01\x02\xff", bytes(range(256))]:
        assert b58decode(b58encode(data)) == data
    assert b58encode(b"\x00\x00\x01") == "112"
    assert b58encode(b"hello world") == "StV1DL6CwTryKyV"  # the bitcoin alphabet
    with pytest.raises(ValueError):
        b58decode("0")


def test_identity_is_immutable_and_repr_hides_the_key() -> None:
    ident = Identity.from_seed(VECTOR_SEED)
    with pytest.raises(AttributeError):
        ident.peer_id = "x"  # type: ignore[misc]
    assert repr(ident) == f"Identity(peer_id={LIBP2P_PEER_ID!r})"
    with pytest.raises(ValueError):
        Identity.from_seed(b"short")
