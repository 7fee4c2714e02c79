"""The private-swarm proof: a shared secret, and a challenge-response bound to both peers.

This is the pure part (no sockets); the ``/swarmd/auth/1`` protocol wraps it. Each side
of a new connection sends the other a fresh `make_challenge()`, and answers the one it
received with ``prove(key, challenge, prover_peer_id=<its own id>,
verifier_peer_id=<the remote id>)``; each checks the answer with `check_proof`.

Both peer ids MUST be the ones the Noise handshake authenticated for the connection,
never ids that a message claims. The proof is

    HMAC-SHA256(k, PROOF_DOMAIN || lp(challenge) || lp(prover) || lp(verifier))

with ``lp(x)`` = x's length as 4 big-endian bytes, then x (peer ids as UTF-8), and
``k = SHA-256(KEY_DOMAIN || secret)``. Binding the prover and the verifier, in that
order, means a proof is good for one direction of one pair of peers: a peer that
lacks the secret cannot relay our challenge to a third node and replay the answer,
nor reflect our own challenge back at us.

The key file holds the secret as text or bytes; surrounding whitespace is stripped and
the rest, at least 16 bytes, is the secret as is (``generate_swarm_key`` writes 64 hex
characters, i.e. 32 random bytes). The file must not be accessible to "others"
(group access is allowed, so a deployment can share it with a service group).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from swarmd.errors import ConfigError
from swarmd.net.private_file import read_private_file

__all__ = [
    "CHALLENGE_BYTES",
    "MIN_SECRET_BYTES",
    "PROOF_BYTES",
    "SwarmKey",
    "check_proof",
    "generate_swarm_key",
    "load_swarm_key",
    "make_challenge",
    "prove",
]

KEY_DOMAIN = b"swarmd-swarm-key-v1\x00"
PROOF_DOMAIN = b"swarmd-swarm-proof-v1\x00"
FINGERPRINT_DOMAIN = b"swarmd-swarm-key-fingerprint-v1\x00"
CHALLENGE_BYTES = 32
PROOF_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_KEY_FILE_BYTES = 4096
_MAX_PEER_ID_BYTES = 128


class SwarmKey:
    """The swarm secret, reduced to a 32-byte HMAC key. Its repr never shows the secret."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        """`secret` as read from the key file; raises ValueError if under 16 bytes."""
        if not isinstance(secret, bytes):
            raise TypeError("a swarm secret is bytes")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"a swarm secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}"
            )
        self._key = hashlib.sha256(KEY_DOMAIN + secret).digest()

    @property
    def fingerprint(self) -> str:
        """8 hex characters naming the key (for logs and diagnostics; reveals nothing)."""
        return hashlib.sha256(FINGERPRINT_DOMAIN + self._key).hexdigest()[:8]

    def __repr__(self) -> str:
        return f"SwarmKey(fingerprint={self.fingerprint!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SwarmKey):
            return NotImplemented
        return hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.fingerprint)


def generate_swarm_key() -> str:
    """A new swarm secret: 64 hex characters (32 random bytes), for a key file."""
    return secrets.token_hex(32)


def load_swarm_key(path: Path | str) -> SwarmKey:
    """The swarm key in `path`; raises ConfigError naming the file if it is unusable."""
    path = Path(path)
    try:
        blob = read_private_file(path, "swarm key file", MAX_KEY_FILE_BYTES, 0o007, ConfigError)
    except FileNotFoundError as exc:
        raise ConfigError(f"Cannot read the swarm key file {path}: {exc}") from exc
    total = len(blob)
    if total > MAX_KEY_FILE_BYTES:
        raise ConfigError(
            f"The swarm key file {path} is over {MAX_KEY_FILE_BYTES} bytes; is it the right file?"
        )
    secret = blob.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"The swarm key file {path} holds {len(secret)} bytes; a swarm secret needs at "
            f"least {MIN_SECRET_BYTES}. Make one with: "
            f"python3 -c 'import secrets; print(secrets.token_hex(32))' > {path}"
        )
    return SwarmKey(secret)


def make_challenge() -> bytes:
    """A fresh random challenge (32 bytes); never reuse one."""
    return secrets.token_bytes(CHALLENGE_BYTES)


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def _mac(key: SwarmKey, challenge: bytes, prover: bytes, verifier: bytes) -> bytes:
    message = PROOF_DOMAIN + _lp(challenge) + _lp(prover) + _lp(verifier)
    return hmac.new(key._key, message, hashlib.sha256).digest()


def _peer_id_bytes(peer_id: object) -> bytes | None:
    if not isinstance(peer_id, str) or not peer_id:
        return None
    raw = peer_id.encode("utf-8", "surrogatepass")
    return raw if len(raw) <= _MAX_PEER_ID_BYTES else None


def prove(key: SwarmKey, challenge: bytes, prover_peer_id: str, verifier_peer_id: str) -> bytes:
    """The 32-byte proof that `prover_peer_id` holds `key`, for `verifier_peer_id`'s challenge.

    Raises ValueError for a challenge that is not 32 bytes or an empty or over-long peer
    id (all local values; a peer's input goes to `check_proof`).
    """
    if not isinstance(key, SwarmKey):
        raise TypeError("prove needs a SwarmKey")
    if not isinstance(challenge, bytes) or len(challenge) != CHALLENGE_BYTES:
        raise ValueError(f"a challenge is {CHALLENGE_BYTES} bytes")
    prover = _peer_id_bytes(prover_peer_id)
    verifier = _peer_id_bytes(verifier_peer_id)
    if prover is None or verifier is None:
        raise ValueError(f"peer ids are non-empty strings of at most {_MAX_PEER_ID_BYTES} bytes")
    return _mac(key, challenge, prover, verifier)


def check_proof(
    key: SwarmKey,
    challenge: bytes,
    prover_peer_id: str,
    verifier_peer_id: str,
    proof: bytes,
) -> bool:
    """True if `proof` answers `challenge` for exactly this prover and verifier.

    Constant time in the proof's content; never raises: any wrong type or length is False.
    """
    if not isinstance(key, SwarmKey):
        return False
    if not isinstance(challenge, bytes) or len(challenge) != CHALLENGE_BYTES:
        return False
    if not isinstance(proof, bytes) or len(proof) != PROOF_BYTES:
        return False
    prover = _peer_id_bytes(prover_peer_id)
    verifier = _peer_id_bytes(verifier_peer_id)
    if prover is None or verifier is None:
        return False
    return hmac.compare_digest(_mac(key, challenge, prover, verifier), proof)
