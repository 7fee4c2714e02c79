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


def test_tokens_from_the_cli_guard_a_running_node(tiny_chat_dir: Path, tmp_path: Path) -> None:
    import os

    data = str(tmp_path / "data")
    refused = run_cli("run", "--host", "0.0.0.0", "--model", str(tiny_chat_dir), "--data-dir", data)
    assert refused.returncode == 2
    assert "swarmd token create" in refused.stderr and "Traceback" not in refused.stderr
    created = run_cli("token", "create", "--label", "ops", "--scope", "admin", "--data-dir", data)
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("sk-swarm-") and "\n" not in token
    listed = run_cli("token", "list", "--data-dir", data)
    assert "ops" in listed.stdout and "admin" in listed.stdout and token not in listed.stdout
    node = start_node(
        ["--model", str(tiny_chat_dir), "--port", "0", "--p2p-port", "0", "--data-dir", data],
        tmp_path,
    )
    try:
        without = run_cli("peers", "--url", node.url)
        assert without.returncode == 1
        assert "HTTP 401" in without.stderr and "--token" in without.stderr
        env = {**os.environ, "SWARMD_TOKEN": token}
        assert run_cli("peers", "--url", node.url, env=env).returncode == 0
        models = run_cli("models", "--url", node.url, "--token", token)
        assert models.returncode == 0 and "routable" in models.stdout
        diagnostics = run_cli("diagnostics", "--url", node.url, env=env)
        assert diagnostics.returncode == 0 and "== " in diagnostics.stdout
        chat = run_cli("chat", "hi", "--max-tokens", "2", "--url", node.url, env=env)
        assert chat.returncode == 0, chat.stderr
        assert run_cli("token", "revoke", "ops", "--data-dir", data).returncode == 0
        assert run_cli("peers", "--url", node.url, env=env).returncode == 1
    finally:
        node.stop()
    assert token not in node.log_text()


def test_chat_against_no_node_says_so() -> None:
    result = run_cli("chat", "hi", "--url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert "cannot reach http://127.0.0.1:9" in result.stderr


def _gguf(path: Path, architecture: str, tensors: dict[str, tuple[str, tuple[int, int]]]) -> Path:
    """A small GGUF file: `tensors` maps a name to (GGML type, (rows, columns))."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    for name, (kind, (rows, cols)) in tensors.items():
        qtype = GGMLQuantizationType[kind]
        block, size = GGML_QUANT_SIZES[qtype]
        raw = np.zeros((rows, cols // block * size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype)  # the shape from the bytes per row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("architecture", "tensors", "named"),
    [
        ("gpt2", {"token_embd.weight": ("F32", (8, 32))}, ["architecture 'gpt2'", "llama"]),
        (
            "llama",
            {"token_embd.weight": ("F32", (8, 32)), "blk.0.ffn_down.weight": ("Q2_K", (16, 256))},
            ["blk.0.ffn_down.weight", "Q2_K", "Q4_K"],
        ),
        (
            "llama",
            {"blk.0.ffn_up.weight": ("IQ4_NL", (16, 256))},
            ["blk.0.ffn_up.weight", "IQ4_NL"],
        ),
    ],
)
def test_a_gguf_swarmd_cannot_run_is_refused_at_start(
    tmp_path: Path,
    architecture: str,
    tensors: dict[str, tuple[str, tuple[int, int]]],
    named: list[str],
) -> None:
    model = _gguf(tmp_path / "model.gguf", architecture, tensors)
    cache = tmp_path / "cache"
    result = run_cli(
        "run", "--model", str(model), "--data-dir", str(tmp_path / "d"), "--cache-dir", str(cache)
    )
    assert result.returncode == 2, result.stderr
    for text in named:
        assert text in result.stderr
    assert "Traceback" not in result.stderr
    assert "serving" not in result.stdout
    converted = [p for p in (cache / "models").iterdir() if p.is_dir()]
    assert converted == []  # nothing half-converted is left to be served later


def test_a_range_that_does_not_fit_is_refused_with_the_numbers(tmp_path: Path) -> None:
    result = run_cli(
        "run", "--layers", "0:30", "--memory-budget", "0.2",
        "--data-dir", str(tmp_path / "d"), "--cache-dir", str(tmp_path / "cache"),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "layers 0:30 of smollm2-135m-instruct needs" in result.stderr
    assert "the memory budget is 0.20 GB" in result.stderr
    assert "KV cache for 512 tokens" in result.stderr and "Traceback" not in result.stderr
    assert "serving" not in result.stdout
