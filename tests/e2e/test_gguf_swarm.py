"""GGUF models in a swarm, in real node processes on 127.0.0.1. A GGUF read in place has a
content id (its manifest: the file hashed once), so a `--no-model` gateway routes it in
stages, a node without the file fetches it from a holder checked chunk by chunk, and two
different files under one name are never joined in one reply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import NodeProcess, http_json, running_node, wait_until
from tests.gguf_files import SHAPES, write_llama_gguf

pytestmark = pytest.mark.e2e

MODEL = "tiny-gguf"  # both files' stem: one name, two contents
QUIET = (0, 1, 2)  # the tokenizer's special ids: a random model never ends a reply early
SEEDS = range(3)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf-files")
    (root / "a").mkdir()
    (root / "b").mkdir()
    one = write_llama_gguf(root / "a" / f"{MODEL}.gguf", SHAPES["tiny"], silence=QUIET)
    two = write_llama_gguf(root / "b" / f"{MODEL}.gguf", SHAPES["tiny"], seed=1, silence=QUIET)
    return one, two


@pytest.fixture(scope="module")
def holders_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the holders of the files (each file's header read once, under its
    lock, as nodes of one user on one machine share it); the gateway and the fetcher have
    their own."""
    return tmp_path_factory.mktemp("holders-cache")


@contextlib.contextmanager
def node(
    factory: pytest.TempPathFactory, name: str, *args: str, cache: Path | None = None
) -> Iterator[NodeProcess]:
    """A node with the cache `cache`, else one of its own."""
    cache = cache or factory.mktemp(f"{name}-cache")
    with running_node(factory, name, ["--cache-dir", str(cache), *args]) as started:
        started.cache = cache  # type: ignore[attr-defined]
        yield started


@pytest.fixture(scope="module")
def first(
    files: tuple[Path, Path], holders_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    """Layers 0:2 of the first file."""
    args = ("--model", str(files[0]), "--layers", "0:2", "--torch-threads", "1")
    with node(tmp_path_factory, "first", *args, cache=holders_cache) as started:
        yield started


@pytest.fixture(scope="module")
def second(
    files: tuple[Path, Path],
    first: NodeProcess,
    holders_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[NodeProcess]:
    """Layers 2:4 of the same file, read in place."""
    args = ("--model", str(files[0]), "--layers", "2:4", "--torch-threads", "1")
    args += ("--bootstrap", first.p2p_addrs[0])
    with node(tmp_path_factory, "second", *args, cache=holders_cache) as started:
        yield started


def chat(target: NodeProcess, **extra: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 10,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    status, reply, headers = http_json(f"{target.url}/v1/chat/completions", body, timeout_s=120)
    return status, reply, {k.lower(): v for k, v in headers.items()}


def tokens(reply: dict[str, Any]) -> list[int]:
    return list(reply["choices"][0]["token_ids"])


def answers(target: NodeProcess) -> bool:
    return chat(target)[0] == 200


def short(target: NodeProcess) -> str:
    return str(target.health()["peer_id"])[-8:]


def sampled_at_once(target: NodeProcess) -> list[list[int]]:
    """Several sessions at once, sampled: each reply's tokens."""
    with ThreadPoolExecutor(max_workers=len(SEEDS)) as pool:
        replies = list(pool.map(lambda s: chat(target, temperature=0.9, seed=s), SEEDS))
    assert [r[0] for r in replies] == [200] * len(SEEDS), [r[1] for r in replies]
    return [tokens(r[1]) for r in replies]


def test_a_gateway_routes_a_gguf_model_through_its_two_stages(
    first: NodeProcess, second: NodeProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert wait_until(lambda: answers(first), 60, 0.5), first.log_text()[-2000:]
    status, want, headers = chat(first)
    assert status == 200 and headers["x-swarm-route"] == "distributed", want
    assert headers["x-swarm-nodes"] == f"{short(first)},{short(second)}"
    sampled = sampled_at_once(first)
    args = ("--no-model", "--bootstrap", first.p2p_addrs[0])
    with node(tmp_path_factory, "gateway", *args) as gate:
        assert wait_until(lambda: answers(gate), 60, 0.5), gate.log_text()[-2000:]
        status, reply, headers = chat(gate)
        assert status == 200 and headers["x-swarm-route"] == "distributed", reply
        assert headers["x-swarm-nodes"] == f"{short(first)},{short(second)}"
        assert tokens(reply) == tokens(want)
        assert sampled_at_once(gate) == sampled
        # It took the manifest and the tokenizer files, checked by the content id; no weights.
        cache: Path = gate.cache  # type: ignore[attr-defined]
        taken = {p.name for p in cache.rglob("*") if p.is_file()}
        assert {"manifest.json", "tokenizer.json"} <= taken, taken
        assert not any(name.endswith(".gguf") for name in taken), taken
        listed = {m["id"]: m for m in gate.get_json("/v1/models")["data"]}  # type: ignore[union-attr]
        assert listed[MODEL]["swarm"]["routable"] is True


def test_a_node_without_the_file_fetches_it_checked_and_serves_the_same_replies(
    first: NodeProcess, second: NodeProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert wait_until(lambda: answers(first), 60, 0.5)
    want = tokens(chat(first)[1])
    args = ("--model", MODEL, "--bootstrap", first.p2p_addrs[0], "--torch-threads", "1")
    with node(tmp_path_factory, "fetcher", *args) as fetcher:
        log = fetcher.log_text()
        assert "took the manifest of tiny-gguf" in log, log[-2000:]
        cache: Path = fetcher.cache  # type: ignore[attr-defined]
        fetched = [p for p in cache.rglob("weights.gguf") if p.is_file()]
        assert len(fetched) == 1 and fetched[0].stat().st_size > 0
        status, reply, headers = chat(fetcher)
        assert status == 200 and headers["x-swarm-route"] == "local", reply
        assert tokens(reply) == want


def test_two_files_under_one_name_are_never_joined_in_one_reply(
    files: tuple[Path, Path],
    first: NodeProcess,
    holders_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The second file's layers 2:4 beside the first file's 0:2, under one model id: their
    content ids differ, so the second file's holder has no route (no holder of 0:2 of
    its file) and answers 503, and no reply of the first file's goes through it."""
    assert wait_until(lambda: answers(first), 60, 0.5)
    args = ("--model", str(files[1]), "--layers", "2:4", "--torch-threads", "1")
    args += ("--bootstrap", first.p2p_addrs[0])
    with node(tmp_path_factory, "stranger", *args, cache=holders_cache) as other:
        stranger = short(other)
        assert wait_until(lambda: stranger in str(first.get_json("/api/peers")), 30, 0.5)
        for _ in range(3):
            status, reply, headers = chat(other)
            assert status == 503, reply
            assert reply["error"]["type"] != "server_error" or "layers" in reply["error"]["message"]
            status, reply, headers = chat(first)
            assert stranger not in headers.get("x-swarm-nodes", ""), (status, headers)
