"""`swarmd run` as a user meets it: bad settings, clean shutdown."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import start_node

pytestmark = pytest.mark.e2e


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmd", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_bad_flag_value_names_the_key(tmp_path: Path) -> None:
    result = run_cli("run", "--dtype", "float64", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "dtype" in result.stderr and "float64" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_env_value_names_the_variable(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "SWARMD_PORT": "eighty"}
    result = run_cli("run", "--data-dir", str(tmp_path), env=env)
    assert result.returncode == 2
    assert "SWARMD_PORT" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_model_path_is_refused(tmp_path: Path) -> None:
    result = run_cli("run", "--model", str(tmp_path / "nope"), "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "nope" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_sigterm_shuts_down_cleanly(tiny_chat_dir: Path, tmp_path: Path) -> None:
    node = start_node(
        ["--model", str(tiny_chat_dir), "--port", "0", "--data-dir", str(tmp_path / "data")],
        tmp_path,
    )
    try:
        assert node.health()["status"] == "ok"
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(timeout=20) == 0
    finally:
        node.stop()
    log = node.log_text()
    assert "Traceback" not in log
    assert (tmp_path / "data" / "identity.key").stat().st_mode & 0o777 == 0o600


def test_chat_against_no_node_says_so() -> None:
    result = run_cli("chat", "hi", "--url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert "cannot reach http://127.0.0.1:9" in result.stderr
