"""Sharded models in a swarm of real node processes on 127.0.0.1.

A 30-layer random model (hidden 64) is sharded [0:10] [10:20] [20:30]. A seed node holds
every file and serves [0:10]; fresh nodes with empty data and cache dirs fetch what they
lack from the swarm, verify it and serve; the reference is one node over the whole shard
folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    NodeProcess,
    build_tiny_llama,
    http_json,
    running_node,
    start_node,
    wait_until,
)

pytestmark = pytest.mark.e2e

MODEL_ID = "tiny30"
SHARD_10_20 = "layers-00010-00020.safetensors"
SHARD_20_30 = "layers-00020-00030.safetensors"
PROMPTS = ["What is the capital of France?", "Count from one to ten."]


@pytest.fixture(scope="module")
def shards(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny30 sharded in three, 64 KiB chunks (so a shard is many chunks)."""
    root = tmp_path_factory.mktemp("tiny30")
    source = build_tiny_llama(root / "hf", smollm_dir, 30)
    out = root / "shards"
    cmd = [sys.executable, "-m", "swarmd", "shard", str(source), "--stages", "3"]
    cmd += ["--out", str(out), "--model-id", MODEL_ID, "--chunk-bytes", "65536"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def seed(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    args = ["--model", str(shards), "--layers", "0:10", "--torch-threads", "1"]
    with running_node(tmp_path_factory, "seed", args) as node:
        yield node


def fresh_args(tmp_path_factory: pytest.TempPathFactory, name: str, layers: str) -> list[str]:
    cache = tmp_path_factory.mktemp(f"{name}-cache")
    return [
        "--model",
        MODEL_ID,
        "--layers",
        layers,
        "--cache-dir",
        str(cache),
        "--torch-threads",
        "1",
    ]


def chat(node: NodeProcess, prompt: str) -> tuple[dict[str, Any], dict[str, str]]:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 16,
        "temperature": 0,
        "return_token_ids": True,
    }
    status, reply, headers = http_json(f"{node.url}/v1/chat/completions", body, timeout_s=120)
    assert status == 200, reply
    return reply, {k.lower(): v for k, v in headers.items()}


def holders(node: NodeProcess) -> list[dict[str, Any]]:
    return node.get_json("/v1/models")["data"][0]["swarm"]["holders"]  # type: ignore[index]


def manifest_sha(shards: Path, name: str) -> str:
    manifest = json.loads((shards / "manifest.json").read_text())
    return next(s["sha256"] for s in manifest["shards"] if s["file"] == name)


def test_fresh_nodes_fetch_their_layers_and_the_swarm_answers(
    shards: Path, seed: NodeProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    boot = ["--bootstrap", seed.p2p_addrs[0]]
    with running_node(tmp_path_factory, "reference", ["--model", str(shards)]) as reference:
        expected = [chat(reference, p)[0] for p in PROMPTS]
    b_args = fresh_args(tmp_path_factory, "b", "10:20")
    with running_node(tmp_path_factory, "b", b_args + boot) as b:
        b_cache = Path(b_args[b_args.index("--cache-dir") + 1])
        fetched = {p.name for p in b_cache.rglob("*.safetensors")}
        assert fetched == {SHARD_10_20}  # only the shard of its own range
        assert "fetched layers-00010-00020.safetensors" in b.log_text()
        c_args = [*fresh_args(tmp_path_factory, "c", "auto"), "--memory-budget", "1"]
        with running_node(tmp_path_factory, "c", c_args + boot) as c:
            assert "--layers auto chose 20:30" in c.log_text()
            assert "serving tiny30 (layers 20:30 of 30)" in "".join(c.stdout_lines)
            assert wait_until(lambda: len(holders(b)) == 3, 60, 0.5), holders(b)
            for prompt, reference_reply in zip(PROMPTS, expected, strict=True):
                reply, headers = chat(b, prompt)
                assert headers["x-swarm-route"] == "distributed"
                assert headers["x-swarm-segments"] == "3"
                assert (
                    reply["choices"][0]["token_ids"] == reference_reply["choices"][0]["token_ids"]
                )
                assert reply["choices"][0]["message"] == reference_reply["choices"][0]["message"]


def test_a_flipped_byte_is_refused_and_nothing_is_announced(
    shards: Path, seed: NodeProcess, tmp_path: Path
) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    target = copy / SHARD_10_20
    data = bytearray(target.read_bytes())
    data[len(data) // 3] ^= 0x40
    target.write_bytes(bytes(data))
    before = {h["peer_id"] for h in holders(seed)}
    cmd = [sys.executable, "-m", "swarmd", "run", "--model", str(copy), "--layers", "10:20"]
    cmd += ["--port", "0", "--p2p-port", "0", "--data-dir", str(tmp_path / "data")]
    cmd += ["--bootstrap", seed.p2p_addrs[0]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr
    assert str(target) in done.stderr
    assert manifest_sha(shards, SHARD_10_20) in done.stderr
    assert hashlib.sha256(bytes(data)).hexdigest() in done.stderr
    assert "serving" not in done.stdout
    assert {h["peer_id"] for h in holders(seed)} == before


def test_a_transfer_cut_halfway_resumes_from_another_holder(
    shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Two holders of every file, each sending at 2 MB/s: the 14 MB shard takes seconds.
    slow = ["--model", str(shards), "--layers", "0:10", "--upload-limit", "2"]
    with running_node(tmp_path_factory, "h1", slow) as h1:
        boot = ["--bootstrap", h1.p2p_addrs[0]]
        with running_node(tmp_path_factory, "h2", slow + boot) as h2:
            nodes = {str(h1.health()["short_id"]): h1, str(h2.health()["short_id"]): h2}
            assert len(nodes) == 2
            assert wait_until(lambda: len(holders(h1)) == 2, 60, 0.5)
            fetch_into = tmp_path_factory.mktemp("f-cache")
            workdir = tmp_path_factory.mktemp("f")
            args = ["--model", MODEL_ID, "--layers", "20:30", "--cache-dir", str(fetch_into)]
            args += ["--port", "0", "--p2p-port", "0", "--data-dir", str(workdir / "data")]
            args += ["--torch-threads", "1", *boot]
            started: dict[str, NodeProcess | BaseException] = {}

            def run_f() -> None:
                try:
                    started["f"] = start_node(args, workdir)
                except BaseException as exc:  # reported by the test thread below
                    started["f"] = exc

            thread = threading.Thread(target=run_f)
            thread.start()
            try:
                part = _wait_half(fetch_into, manifest_bytes(shards, SHARD_20_30))
                source = _source_of(workdir)
                nodes[source].proc.kill()  # the holder sending the shard, mid-transfer
                thread.join(timeout=180)
                f = started.get("f")
                assert isinstance(f, NodeProcess), f
                try:
                    log = f.log_text()
                    other = next(s for s in nodes if s != source)
                    assert f"fetching {SHARD_20_30} from {other} at chunk" in log
                    assert f"fetched {SHARD_20_30}" in log
                    final = part.with_name(SHARD_20_30)
                    digest = hashlib.sha256(final.read_bytes()).hexdigest()
                    assert digest == manifest_sha(shards, SHARD_20_30)
                    assert not part.exists()
                finally:
                    f.stop()
            finally:
                thread.join(timeout=180)
                node = started.get("f")
                if isinstance(node, NodeProcess):
                    node.stop()


def manifest_bytes(shards: Path, name: str) -> int:
    manifest = json.loads((shards / "manifest.json").read_text())
    return int(next(s["bytes"] for s in manifest["shards"] if s["file"] == name))


def _wait_half(cache: Path, total: int) -> Path:
    found: list[Path] = []

    def half_done() -> bool:
        found[:] = list(cache.rglob(f".{SHARD_20_30}.part"))
        return bool(found) and found[0].stat().st_size >= total * 0.4

    assert wait_until(half_done, 120, 0.05), "the transfer never got under way"
    return found[0]


def _source_of(workdir: Path) -> str:
    """The short id of the holder the fetching node is taking the shard from (its log)."""
    marker = f"fetching {SHARD_20_30} from "
    log = "".join(p.read_text(errors="replace") for p in workdir.glob("node-*.log"))
    lines = [ln for ln in log.splitlines() if marker in ln]
    assert lines, log
    return lines[-1].split(marker)[1].split()[0]
