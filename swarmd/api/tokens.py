"""API tokens: created once, stored only as SHA-256, checked in constant time.

A token is `sk-swarm-` plus 43 URL-safe characters (32 random bytes). The store is one
JSON file in the node's data dir, mode 0600, holding for each token its id, label, scope
and digest; the token itself is printed once by `swarmd token create` and never again.
A running node re-reads the file when it changes, so a revocation takes effect on the
next request without a restart. The file's existence is what closes the API: revoking
the last token locks it, deleting the file opens it again.

Scopes: `infer` opens the OpenAI API (`/v1/*`); `admin` opens that and the operator's
endpoints too (`/api/*`, `/metrics`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from swarmd.errors import ConfigError

TOKEN_PREFIX = "sk-swarm-"
TOKENS_FILE = "api_tokens.json"
SCOPES = ("infer", "admin")
_TOKEN_BYTES = 32
_MAX_LABEL_CHARS = 64


@dataclass(frozen=True)
class TokenEntry:
    id: str  # 8 hex characters: names a token in `list` and `revoke`, reveals nothing
    label: str
    scope: str  # one of SCOPES
    sha256: str  # hex digest of the whole token
    created: float  # unix time

    def allows_admin(self) -> bool:
        return self.scope == "admin"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class TokenStore:
    """The tokens of one node: `<data_dir>/api_tokens.json`."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / TOKENS_FILE
        self._entries: tuple[TokenEntry, ...] = ()
        self._stamp: tuple[int, int] | None = None  # (mtime_ns, size) of what was read
        self._reload()

    def entries(self) -> tuple[TokenEntry, ...]:
        self._reload()
        return self._entries

    @property
    def enforced(self) -> bool:
        """Once a token was created the API stays closed, also after the last one is
        revoked (revoking everything locks the API; deleting the file reopens it)."""
        self._reload()
        return self._stamp is not None

    def create(self, label: str = "", scope: str = "infer") -> tuple[TokenEntry, str]:
        """A new token and its entry; the token is returned once and stored only hashed."""
        if scope not in SCOPES:
            raise ConfigError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        label = label.strip()
        if len(label) > _MAX_LABEL_CHARS or not label.isprintable():
            raise ConfigError(f"a label is at most {_MAX_LABEL_CHARS} printable characters")
        entries = self.entries()
        if label and any(e.label == label for e in entries):
            raise ConfigError(f"a token labelled {label!r} exists; revoke it or pick another")
        token = TOKEN_PREFIX + secrets.token_urlsafe(_TOKEN_BYTES)
        taken = {e.id for e in entries}
        token_id = secrets.token_hex(4)
        while token_id in taken:
            token_id = secrets.token_hex(4)
        entry = TokenEntry(token_id, label, scope, _digest(token), round(time.time(), 3))
        self._write((*entries, entry))
        return entry, token

    def revoke(self, id_or_label: str) -> list[TokenEntry]:
        """Remove the tokens with this id or label; the ones removed (none: ConfigError)."""
        entries = self.entries()
        gone = [e for e in entries if id_or_label in (e.id, e.label) and id_or_label]
        if not gone:
            raise ConfigError(f"no token has the id or label {id_or_label!r}")
        self._write(tuple(e for e in entries if e not in gone))
        return gone

    def verify(self, token: str) -> TokenEntry | None:
        """The entry of a presented token, or None. Every digest is compared, in constant
        time, so neither the answer's timing nor its path says how close a guess came."""
        digest = _digest(token)
        found: TokenEntry | None = None
        for entry in self.entries():
            if hmac.compare_digest(entry.sha256, digest):
                found = entry
        return found

    def _reload(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._entries, self._stamp = (), None
            return
        except OSError as exc:
            raise ConfigError(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        self._entries = self._parse(self.path)
        self._stamp = stamp

    @staticmethod
    def _parse(path: Path) -> tuple[TokenEntry, ...]:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return tuple(
                TokenEntry(
                    id=str(item["id"]),
                    label=str(item["label"]),
                    scope=str(item["scope"]) if item["scope"] in SCOPES else "infer",
                    sha256=str(item["sha256"]),
                    created=float(item["created"]),
                )
                for item in data["tokens"]
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{path} is not a valid token file ({exc}); fix or delete it and create "
                "the tokens again"
            ) from exc

    def _write(self, entries: tuple[TokenEntry, ...]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        body = json.dumps({"tokens": [asdict(e) for e in entries]}, indent=1) + "\n"
        # Created 0600 from the start: the digests are not secrets, but nobody else
        # should be able to add one.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(body)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
        self._stamp = None
        self._reload()
