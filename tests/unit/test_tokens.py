"""API tokens: stored hashed with mode 0600, verified, listed and revoked; header parsing."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

from swarmd.api.access import bearer_token, host_name, is_loopback_name
from swarmd.api.tokens import TOKEN_PREFIX, TokenStore
from swarmd.errors import ConfigError


def test_a_created_token_verifies_and_only_its_digest_is_stored(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    entry, token = store.create("laptop", "infer")
    assert token.startswith(TOKEN_PREFIX) and len(token) > len(TOKEN_PREFIX) + 40
    assert store.verify(token) == entry
    assert store.verify(token + "x") is None
    assert store.verify(token[:-1]) is None
    text = store.path.read_text()
    assert token not in text
    assert hashlib.sha256(token.encode()).hexdigest() in text
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


def test_scopes_labels_and_revocation_by_id_or_label(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    infer, infer_token = store.create("app")
    admin, admin_token = store.create("ops", "admin")
    assert not infer.allows_admin() and admin.allows_admin()
    assert [e.label for e in store.entries()] == ["app", "ops"]
    with pytest.raises(ConfigError, match="labelled"):
        store.create("app")
    with pytest.raises(ConfigError, match="scope"):
        store.create("x", "root")
    assert store.revoke("app") == [infer]
    assert store.verify(infer_token) is None
    assert store.revoke(admin.id) == [admin]
    assert store.verify(admin_token) is None and store.enforced  # still locked
    with pytest.raises(ConfigError, match="no token"):
        store.revoke("app")


def test_a_running_node_sees_tokens_created_and_revoked_by_the_cli(tmp_path: Path) -> None:
    """Two stores on one file stand for the node and `swarmd token ...`."""
    node_view = TokenStore(tmp_path)
    assert not node_view.enforced
    cli = TokenStore(tmp_path)
    entry, token = cli.create("late")
    assert node_view.verify(token) == entry
    cli.revoke(entry.id)
    assert node_view.verify(token) is None


def test_a_corrupt_token_file_is_a_clear_config_error(tmp_path: Path) -> None:
    (tmp_path / "api_tokens.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid token file"):
        TokenStore(tmp_path)
    (tmp_path / "api_tokens.json").write_text(json.dumps({"tokens": [{"id": "a"}]}))
    with pytest.raises(ConfigError, match="not a valid token file"):
        TokenStore(tmp_path)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic dXNlcjpwYXNz", None),
        ("Bearer a b", None),
        ("Bearer sk-swarm-abc", "sk-swarm-abc"),
        ("bearer   sk-swarm-abc  ", "sk-swarm-abc"),
    ],
)
def test_bearer_header_parsing(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1:8800", True),
        ("127.9.9.9", True),
        ("localhost:8800", True),
        ("LOCALHOST.", True),
        ("app.localhost:3000", True),
        ("[::1]:8800", True),
        ("::1", True),
        ("evil.example:8800", False),
        ("localhost.evil.example", False),
        ("10.0.0.5:8800", False),
        ("0.0.0.0", False),
        ("", False),
    ],
)
def test_loopback_host_names(host: str, loopback: bool) -> None:
    assert is_loopback_name(host_name(host)) is loopback
