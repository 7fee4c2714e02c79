"""Fixtures shared by every tier: the embedded model, tiny random models, node processes."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from swarmd.model.source import EMBEDDED_MODEL_ID, resolve_folder

# Tiny random transformers configs of every family (the engine and the exact-path tests).
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 256,
}
# "serving MODEL (...) at URL/v1" per model held, or one line of a node holding none.
READY = re.compile(r"swarmd: (?:serving (\S+) .*|holding no model;.*) at (http://\S+)/v1")


@pytest.fixture(scope="session")
def test_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Converted models for this run (SWARMD_TEST_CACHE_DIR reuses one across runs)."""
    given = os.environ.get("SWARMD_TEST_CACHE_DIR")
    return Path(given) if given else tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def smollm_dir(test_cache_dir: Path) -> Path:
    """The embedded SmolLM2-135M-Instruct converted once into a folder (`swarmd shard`'s
    input, the folder-loading tests): int4 layers, an int8 table, tokenizer and config. A
    node reads the GGUF in place and holds the same bits (tests/unit/test_gguf_tensors.py)."""
    return resolve_folder(EMBEDDED_MODEL_ID, test_cache_dir).model_dir


@pytest.fixture(scope="session")
def smollm_fp32_dir(test_cache_dir: Path) -> Path:
    """The embedded model dequantized to float32: a folder transformers loads as it
    loads the GGUF itself (the references of the exact path)."""
    return resolve_folder(EMBEDDED_MODEL_ID, test_cache_dir, "fp32").model_dir


@dataclass
class NodeProcess:
    """A `swarmd run` subprocess; stderr (logs, DIAG lines) goes to `log_path`."""

    proc: subprocess.Popen[str]
    log_path: Path
    url: str = ""
    model_id: str = ""
    stdout_lines: list[str] = field(default_factory=list)

    @property
    def p2p_addrs(self) -> list[str]:
        prefix = "swarmd: p2p listening on "
        return [
            ln.strip().removeprefix(prefix) for ln in self.stdout_lines if ln.startswith(prefix)
        ]

    def get_json(self, path: str) -> dict[str, object]:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
            return json.loads(response.read())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict[str, object]:
        with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _pump(stream: object, lines: queue.Queue[str | None]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)
    lines.put(None)


def start_node(
    args: list[str],
    workdir: Path,
    ready_timeout_s: float = 180.0,
    launcher: list[str] | None = None,
) -> NodeProcess:
    """Start `swarmd run ARGS` and wait (with a deadline) until it says it is serving.

    `launcher` replaces `python -m swarmd` (e.g. a test script wrapping a node).
    """
    log_path = workdir / f"node-{time.monotonic_ns()}.log"
    log_file = log_path.open("w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*(launcher or [sys.executable, "-m", "swarmd"]), "run", *args],
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        env=env,
    )
    log_file.close()
    node = NodeProcess(proc, log_path)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    deadline = time.monotonic() + ready_timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"swarmd exited with {proc.wait()}:\n{node.log_text()}")
            node.stdout_lines.append(line)
            match = READY.search(line)
            if match:
                node.model_id, node.url = match.group(1) or "", match.group(2)
                return node
        raise TimeoutError(f"swarmd not ready in {ready_timeout_s} s:\n{node.log_text()}")
    except BaseException:
        node.stop()
        raise


@contextlib.contextmanager
def running_node(
    tmp_path_factory: pytest.TempPathFactory, name: str, args: list[str]
) -> Iterator[NodeProcess]:
    """A node on free ports with its own data dir in a fresh temp dir, stopped on exit."""
    workdir = tmp_path_factory.mktemp(name)
    node = start_node(
        ["--port", "0", "--p2p-port", "0", "--data-dir", str(workdir / "data"), *args], workdir
    )
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def embedded_node(
    smollm_dir: Path, test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    """One node serving the embedded model for the whole session (greedy tests share it)."""
    args = ["--cache-dir", str(test_cache_dir)]
    with running_node(tmp_path_factory, "embedded-node", args) as node:
        yield node


def wait_until(predicate: object, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `predicate()` until it is true or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval_s)
    return bool(predicate())  # type: ignore[operator]


def http_json(url: str, body: object | bytes, timeout_s: float = 60.0) -> tuple[int, dict, dict]:
    """POST raw bytes or JSON; return status, parsed body and headers (errors included)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def build_tiny_llama(out: Path, tokenizer_from: Path, num_layers: int) -> Path:
    """A random-weight Llama (hidden 64, seed 0) with the embedded model's tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_chat_dir(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 4-layer Llama (hidden 64) with the embedded model's tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-chat"), smollm_dir, 4)


@pytest.fixture(scope="session")
def tiny_shards(tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_chat_dir` sharded by `swarmd shard` into 0:2, 2:3 and 3:4."""
    out = tmp_path_factory.mktemp("tiny-shards") / "shards"
    cmd = [sys.executable, "-m", "swarmd", "shard", str(tiny_chat_dir), "--out", str(out)]
    cmd += ["--ranges", "0:2,2:3,3:4"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out
