"""The private-swarm proof: bound to the key, the challenge and both peers, in order."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path

import pytest

from swarmd.errors import ConfigError
from swarmd.net.auth import (
    CHALLENGE_BYTES,
    KEY_DOMAIN,
    PROOF_BYTES,
    PROOF_DOMAIN,
    SwarmKey,
    check_proof,
    generate_swarm_key,
    load_swarm_key,
    make_challenge,
    prove,
)
from swarmd.net.identity import Identity

ALICE = Identity.from_seed(bytes(range(32))).peer_id
BOB = Identity.from_seed(bytes(range(1, 33))).peer_id
CAROL = Identity.from_seed(bytes(range(2, 34))).peer_id
KEY = SwarmKey(b"correct horse battery staple")
OTHER_KEY = SwarmKey(b"correct horse battery staplf")


def write_key(path: Path, data: bytes | str, mode: int = 0o600) -> Path:
    if isinstance(data, str):
        data = data.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data)
    os.close(fd)
    os.chmod(path, mode)
    return path


# --- the proof --------------------------------------------------------------------------


def test_correct_proof_passes() -> None:
    challenge = make_challenge()
    proof = prove(KEY, challenge, ALICE, BOB)
    assert len(proof) == PROOF_BYTES
    assert check_proof(KEY, challenge, ALICE, BOB, proof)
    assert check_proof(SwarmKey(b"correct horse battery staple"), challenge, ALICE, BOB, proof)


def test_known_answer() -> None:
    # Pins the construction, so two versions of swarmd keep agreeing.
    challenge = bytes(CHALLENGE_BYTES)
    k = hashlib.sha256(KEY_DOMAIN + b"correct horse battery staple").digest()

    def lp(b: bytes) -> bytes:
        return len(b).to_bytes(4, "big") + b

    message = PROOF_DOMAIN + lp(challenge) + lp(ALICE.encode()) + lp(BOB.encode())
    expected = hmac.new(k, message, hashlib.sha256).digest()
    assert prove(KEY, challenge, ALICE, BOB) == expected


def test_wrong_key_fails() -> None:
    challenge = make_challenge()
    assert not check_proof(OTHER_KEY, challenge, ALICE, BOB, prove(KEY, challenge, ALICE, BOB))
    assert not check_proof(KEY, challenge, ALICE, BOB, prove(OTHER_KEY, challenge, ALICE, BOB))


def test_swapped_peer_ids_fail() -> None:
    # Reflection: Bob's answer to Alice's challenge does not pass as Alice's own proof.
    challenge = make_challenge()
    proof = prove(KEY, challenge, ALICE, BOB)
    assert not check_proof(KEY, challenge, BOB, ALICE, proof)


def test_replay_to_another_verifier_fails() -> None:
    # Mallory (no key) relays Carol's challenge to Alice; Alice's answer is for Mallory.
    challenge = make_challenge()
    proof_for_bob = prove(KEY, challenge, ALICE, BOB)
    assert not check_proof(KEY, challenge, ALICE, CAROL, proof_for_bob)
    assert not check_proof(KEY, challenge, CAROL, BOB, proof_for_bob)


def test_other_challenge_fails() -> None:
    first, second = make_challenge(), make_challenge()
    assert first != second and len(first) == CHALLENGE_BYTES
    assert not check_proof(KEY, second, ALICE, BOB, prove(KEY, first, ALICE, BOB))


def test_peer_id_boundaries_are_unambiguous() -> None:
    challenge = make_challenge()
    assert prove(KEY, challenge, "ab", "c") != prove(KEY, challenge, "a", "bc")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda p: p[:-1],
        lambda p: p[:16],
        lambda p: b"",
        lambda p: p + b"\x00",
        lambda p: bytes([p[0] ^ 1]) + p[1:],
        lambda p: p[:-1] + bytes([p[-1] ^ 0x80]),
        lambda p: bytearray(p),  # right bytes, wrong type
        lambda p: p.hex(),
        lambda p: None,
        lambda p: 12345,
    ],
    ids=[
        "truncated",
        "half",
        "empty",
        "extended",
        "first-bit",
        "last-bit",
        "bytearray",
        "hex",
        "none",
        "int",
    ],
)
def test_mangled_proof_fails_without_raising(mangle: object) -> None:
    challenge = make_challenge()
    proof = prove(KEY, challenge, ALICE, BOB)
    assert not check_proof(KEY, challenge, ALICE, BOB, mangle(proof))  # type: ignore[operator]


@pytest.mark.parametrize(
    ("key", "challenge", "prover", "verifier"),
    [
        ("not a key", None, ALICE, BOB),
        (KEY, b"short", ALICE, BOB),
        (KEY, "x" * 32, ALICE, BOB),
        (KEY, None, None, BOB),
        (KEY, None, ALICE, 7),
        (KEY, None, "", BOB),
        (KEY, None, "x" * 10_000, BOB),
        (KEY, None, "\ud800", BOB),  # a lone surrogate cannot be UTF-8 encoded
    ],
)
def test_check_never_raises_on_bad_arguments(
    key: object, challenge: object, prover: object, verifier: object
) -> None:
    good = make_challenge()
    proof = prove(KEY, good, ALICE, BOB)
    given = good if challenge is None else challenge
    assert check_proof(key, given, prover, verifier, proof) is False  # type: ignore[arg-type]


def test_prove_refuses_bad_local_arguments() -> None:
    with pytest.raises(ValueError):
        prove(KEY, b"short", ALICE, BOB)
    with pytest.raises(ValueError):
        prove(KEY, make_challenge(), "", BOB)
    with pytest.raises(TypeError):
        prove("key", make_challenge(), ALICE, BOB)  # type: ignore[arg-type]


# --- keys and key files -----------------------------------------------------------------


def test_key_repr_hides_the_secret() -> None:
    key = SwarmKey(b"a-secret-that-must-not-leak")
    assert "secret" not in repr(key) and "leak" not in repr(key)
    assert len(key.fingerprint) == 8
    assert key.fingerprint != OTHER_KEY.fingerprint
    assert key == SwarmKey(b"a-secret-that-must-not-leak") and key != OTHER_KEY


def test_short_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        SwarmKey(b"x" * 15)
    assert SwarmKey(b"x" * 16)


def test_generated_key_round_trips_through_a_file(tmp_path: Path) -> None:
    text = generate_swarm_key()
    assert len(text) == 64 and bytes.fromhex(text)
    assert generate_swarm_key() != text
    path = write_key(tmp_path / "swarm.key", text + "\n")
    assert load_swarm_key(path) == SwarmKey(text.encode())
    assert load_swarm_key(str(path)) == load_swarm_key(path)


def test_whitespace_around_the_secret_is_ignored(tmp_path: Path) -> None:
    a = write_key(tmp_path / "a.key", "  0123456789abcdef0123\r\n")
    b = write_key(tmp_path / "b.key", "0123456789abcdef0123")
    assert load_swarm_key(a) == load_swarm_key(b)


def test_group_readable_is_allowed(tmp_path: Path) -> None:
    path = write_key(tmp_path / "swarm.key", "x" * 32, mode=0o640)
    assert load_swarm_key(path) == SwarmKey(b"x" * 32)


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o602, 0o601, 0o666])
def test_world_accessible_file_is_refused(tmp_path: Path, mode: int) -> None:
    path = write_key(tmp_path / "swarm.key", "x" * 32, mode=mode)
    with pytest.raises(ConfigError, match=re.escape(str(path))) as info:
        load_swarm_key(path)
    assert "chmod 600" in str(info.value)


@pytest.mark.parametrize("content", ["", "   \n", "x" * 15, " " + "x" * 15 + "\n"])
def test_too_short_secret_is_refused(tmp_path: Path, content: str) -> None:
    path = write_key(tmp_path / "swarm.key", content)
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_swarm_key(path)


def test_huge_file_is_refused(tmp_path: Path) -> None:
    path = write_key(tmp_path / "swarm.key", "x" * 5000)
    with pytest.raises(ConfigError, match="over 4096 bytes"):
        load_swarm_key(path)


def test_missing_file_and_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("missing.key")):
        load_swarm_key(tmp_path / "missing.key")
    directory = tmp_path / "dir.key"
    directory.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=re.escape("dir.key")):
        load_swarm_key(directory)


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "swarm.key"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_swarm_key(fifo)
