"""Any node answers for every model of the swarm, in real node processes on 127.0.0.1.

A serves one model (a tiny random Llama from its folder); B serves another, a copy of it
sharded under the id `other`. A holds no layer of `other`: it takes that model's common
files (manifest, tokenizer, templates) from B once, checked against the content id, and
runs the ring over B; its replies are B's own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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

OTHER = "other"


@pytest.fixture(scope="module")
def folders(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A's model (a folder) and B's (the same weights sharded in two, as `other`)."""
    root = tmp_path_factory.mktemp("models")
    source = build_tiny_llama(root / "tiny-a", smollm_dir, 4)
    out = root / "shards"
    cmd = [sys.executable, "-m", "swarmd", "shard", str(source), "--stages", "2"]
    cmd += ["--out", str(out), "--model-id", OTHER]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return source, out


@pytest.fixture(scope="module")
def b(
    folders: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    args = ["--model", str(folders[1]), "--torch-threads", "1"]
    with running_node(tmp_path_factory, "b", args) as node:
        yield node


@pytest.fixture(scope="module")
def a(
    folders: tuple[Path, Path], b: NodeProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    cache = tmp_path_factory.mktemp("a-cache")
    args = ["--model", str(folders[0]), "--cache-dir", str(cache), "--torch-threads", "1"]
    with running_node(tmp_path_factory, "a", [*args, "--bootstrap", b.p2p_addrs[0]]) as node:
        node.cache = cache  # type: ignore[attr-defined]
        yield node


def question(model: str, **extra: Any) -> dict[str, Any]:
    """The tests' chat request: a short greedy reply unless `extra` says otherwise."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 12,
        "temperature": 0,
        **extra,
    }


def chat(node: NodeProcess, model: str, **extra: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = question(model, return_token_ids=True, **extra)
    status, reply, headers = http_json(f"{node.url}/v1/chat/completions", body, timeout_s=120)
    return status, reply, {k.lower(): v for k, v in headers.items()}


def test_a_node_answers_a_model_it_holds_no_layers_of(a: NodeProcess, b: NodeProcess) -> None:
    status, own, _ = chat(b, OTHER)
    assert status == 200, own
    status, reply, headers = chat(a, OTHER)
    assert status == 200, reply
    assert headers["x-swarm-route"] == "distributed"
    assert headers["x-swarm-nodes"] == b.health()["peer_id"][-8:]  # type: ignore[index]
    assert reply["model"] == OTHER
    assert reply["choices"][0]["token_ids"] == own["choices"][0]["token_ids"]
    assert reply["choices"][0]["message"] == own["choices"][0]["message"]
    # Only the common files came over: the tokenizer and the manifest, no weights.
    cache: Path = a.cache  # type: ignore[attr-defined]
    taken = {p.name for p in cache.rglob("*") if p.is_file() and OTHER in str(p)}
    assert {"manifest.json", "tokenizer.json"} <= taken
    assert not any(name.endswith(".safetensors") for name in taken), taken
    assert "coordinating other" in a.log_text()
    with urllib.request.urlopen(f"{a.url}/api/admin/diagnostics", timeout=30) as response:
        report = response.read().decode()
    assert f"coordinates   {OTHER} (" in report
    # Sampled, several choices, and A's own model still served alongside.
    status, many, _ = chat(a, OTHER, temperature=0.9, seed=3, n=2)
    status_b, many_b, _ = chat(b, OTHER, temperature=0.9, seed=3, n=2)
    assert status == status_b == 200
    assert [c["token_ids"] for c in many["choices"]] == [c["token_ids"] for c in many_b["choices"]]
    own_model = a.get_json("/v1/models")["data"][0]["id"]  # type: ignore[index]
    status, _, headers = chat(a, str(own_model))
    assert status == 200 and headers["x-swarm-route"] == "local"


def listed(node: NodeProcess) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in node.get_json("/v1/models")["data"]}  # type: ignore[union-attr]


def test_every_node_lists_every_model_of_the_swarm(a: NodeProcess, b: NodeProcess) -> None:
    own_a = str(a.get_json("/v1/models")["data"][0]["id"])  # type: ignore[index]
    b_id = str(b.health()["peer_id"])
    assert wait_until(lambda: set(listed(a)) == {own_a, OTHER}, 30, 0.5), listed(a)
    assert wait_until(lambda: set(listed(b)) == {own_a, OTHER}, 30, 0.5), listed(b)
    other = listed(a)[OTHER]["swarm"]
    assert other["holders"] == [{"peer_id": b_id, "layers": [0, 4]}]
    assert other["complete"] and other["routable"] and other["num_layers"] == 4
    # A's model comes from a plain folder: B cannot take its files, but forwards to A.
    assert listed(b)[own_a]["swarm"]["routable"] is True
    status, detail = _get(a, f"/v1/models/{OTHER}")
    assert status == 200 and detail["id"] == OTHER
    assert _get(a, "/v1/models/nobody-serves-this")[0] == 404
    shown = subprocess.run(
        [sys.executable, "-m", "swarmd", "models", "--url", a.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert f"{OTHER}  4 layers  covered 0:4  gaps none  routable here" in lines
    assert f"  {b_id[-8:]}  layers 0:4" in lines
    assert any(line.startswith(f"{own_a}  4 layers") for line in lines)


def test_a_model_that_leaves_the_swarm_leaves_every_list(
    folders: tuple[Path, Path], a: NodeProcess, b: NodeProcess, c: NodeProcess, tmp_path: Path
) -> None:
    """Stopped, its node withdraws it at once; killed, it goes when its records expire:
    from the lists of holders and of the light node alike."""
    leaver = tmp_path / "leaver"
    shutil.copytree(folders[0], leaver)
    config = tmp_path / "short.toml"
    config.write_text("record_ttl_s = 5.0\nrepublish_interval_s = 2.0\n")
    boot = ["--bootstrap", b.p2p_addrs[0], "--torch-threads", "1", "--config", str(config)]
    node = start_node(
        [
            "--port",
            "0",
            "--p2p-port",
            "0",
            "--data-dir",
            str(tmp_path / "data"),
            "--model",
            str(leaver),
            *boot,
        ],
        tmp_path,
    )
    try:
        assert wait_until(lambda: all("leaver" in listed(n) for n in (a, b, c)), 30, 0.5)
        node.proc.kill()  # no withdrawal: its records run out
        node.proc.wait(timeout=30)
        assert wait_until(lambda: "leaver" not in listed(a), 30, 0.5), listed(a)
        assert "leaver" not in listed(b)
        assert wait_until(lambda: "leaver" not in listed(c), 10, 0.5), listed(c)
    finally:
        node.stop()


def _get(node: NodeProcess, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(node.url + path, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_model_nobody_serves_is_a_404_naming_model(a: NodeProcess) -> None:
    status, reply, _ = chat(a, "nobody-serves-this")
    assert status == 404 and reply["error"]["param"] == "model"
    assert "no peer of the swarm serves it" in reply["error"]["message"]


def stream_text(node: NodeProcess, model: str) -> tuple[str, dict[str, str]]:
    """A greedy streamed reply's text (every delta joined) and the response headers."""
    body = question(model, stream=True)
    request = urllib.request.Request(
        f"{node.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    parts: list[str] = []
    with urllib.request.urlopen(request, timeout=120) as response:
        headers = {k.lower(): v for k, v in response.headers.items()}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                parts.append(choice["delta"].get("content") or "")
            if "swarm" in event:  # the final chunk's route, as the chat page shows it
                headers["swarm-route"] = event["swarm"]["route"]
    return "".join(parts), headers


def test_a_model_served_without_a_manifest_is_forwarded_to_its_holder(
    a: NodeProcess, b: NodeProcess
) -> None:
    """A's model comes from a plain folder: no content id to take its files by, so B
    forwards the request, as its client sent it, to A, which holds it whole."""
    own_model = str(a.get_json("/v1/models")["data"][0]["id"])  # type: ignore[index]
    status, want, _ = chat(a, own_model)
    assert status == 200, want
    # Until B finds A's record, the model is one nobody serves.
    assert wait_until(lambda: chat(b, own_model)[0] == 200, 30, 0.5)
    with ThreadPoolExecutor(max_workers=3) as pool:
        replies = list(pool.map(lambda m: chat(b, m), [own_model] * 3))
    for status, reply, headers in replies:
        assert status == 200, reply
        assert headers["x-swarm-route"] == "forwarded"
        assert headers["x-swarm-nodes"] == a.health()["peer_id"][-8:]  # type: ignore[index]
        assert reply["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert reply["swarm"]["route"] == "forwarded"  # as the header says
    assert want["swarm"]["route"] == "local"  # asked of the holder itself
    text, headers = stream_text(b, own_model)
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-swarm-route"] == headers["swarm-route"] == "forwarded"
    assert text == want["choices"][0]["message"]["content"]
    assert "route=forwarded" in b.log_text()
    # What only the holder can check (its model's context) is refused as it says it,
    # and nobody is banned for what a request asked.
    status, reply, headers = chat(b, own_model, max_tokens=10**6)
    assert status == 400 and headers["x-swarm-route"] == "forwarded", reply
    assert reply["error"]["param"] == "max_tokens", reply
    assert b.get_json("/api/peers")["bans"] == []  # type: ignore[index]
    assert a.get_json("/api/peers")["bans"] == []  # type: ignore[index]


def test_first_requests_at_once_take_the_files_once_and_a_damaged_cache_is_taken_again(
    folders: tuple[Path, Path], b: NodeProcess, tmp_path: Path
) -> None:
    """Several sessions at once on a node that has not coordinated `other` yet: one take of
    its files, each reply B's own. Restarted over a cache whose tokenizer was damaged, the
    node takes that file again and answers the same."""
    cache = tmp_path / "cache"
    args = ["--port", "0", "--p2p-port", "0", "--data-dir", str(tmp_path / "data")]
    args += ["--model", str(folders[0]), "--cache-dir", str(cache), "--torch-threads", "1"]
    args += ["--bootstrap", b.p2p_addrs[0]]
    seeds = range(4)
    want = []
    for seed in seeds:
        status, reply, _ = chat(b, OTHER, temperature=0.9, seed=seed)
        assert status == 200, reply
        want.append(reply["choices"][0]["token_ids"])
    node = start_node(args, tmp_path)
    try:
        with ThreadPoolExecutor(max_workers=len(seeds)) as pool:
            replies = list(pool.map(lambda s: chat(node, OTHER, temperature=0.9, seed=s), seeds))
        assert [r[0] for r in replies] == [200] * len(seeds), [r[1] for r in replies]
        assert [r[1]["choices"][0]["token_ids"] for r in replies] == want
        assert node.log_text().count(f"took the manifest of {OTHER}") == 1
    finally:
        node.stop()
    tokenizer = next(p for p in cache.rglob("tokenizer.json") if OTHER in str(p))
    tokenizer.write_bytes(tokenizer.read_bytes()[:-10] + b"0123456789")  # same size, bad hash
    node = start_node(args, tmp_path)
    try:
        status, reply, _ = chat(node, OTHER, temperature=0.9, seed=0)
        assert status == 200, reply
        assert reply["choices"][0]["token_ids"] == want[0]
        log = node.log_text()
        assert f"took the manifest of {OTHER}" not in log  # the cached one still holds
        assert "fetching 1 file(s)" in log  # only the damaged tokenizer
    finally:
        node.stop()


# --- a node without a model, and a node with two -----------------------------------------


@pytest.fixture(scope="module")
def c(b: NodeProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A light node: no model, no layers, no torch; it joins through B."""
    cache = tmp_path_factory.mktemp("c-cache")
    args = ["--no-model", "--cache-dir", str(cache), "--bootstrap", b.p2p_addrs[0]]
    with running_node(tmp_path_factory, "c", args) as node:
        yield node


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _maps_torch(pid: int) -> bool:
    """Whether the process has mapped torch's library (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_node_without_a_model_lists_and_answers_the_swarms_models(
    a: NodeProcess, b: NodeProcess, c: NodeProcess
) -> None:
    assert not _maps_torch(c.proc.pid)  # joined and serving the API, torch never loaded
    health = c.health()
    assert health["models"] == [] and health["status"] == "ok"
    own_a = str(a.get_json("/v1/models")["data"][0]["id"])  # type: ignore[index]
    assert wait_until(lambda: set(listed(c)) == {own_a, OTHER}, 30, 0.5), listed(c)
    assert listed(c)[OTHER]["swarm"]["routable"] is True
    # Several sessions at once through C, each equal to B's own reply.
    seeds = range(3)
    want = [chat(b, OTHER, temperature=0.9, seed=s)[1]["choices"][0]["token_ids"] for s in seeds]
    with ThreadPoolExecutor(max_workers=len(seeds)) as pool:
        replies = list(pool.map(lambda s: chat(c, OTHER, temperature=0.9, seed=s), seeds))
    assert [r[0] for r in replies] == [200] * len(seeds), [r[1] for r in replies]
    assert [r[1]["choices"][0]["token_ids"] for r in replies] == want
    assert {r[2]["x-swarm-route"] for r in replies} == {"distributed"}
    status, greedy, _ = chat(c, OTHER)
    assert (
        status == 200
        and greedy["choices"][0]["token_ids"] == chat(b, OTHER)[1]["choices"][0]["token_ids"]
    )
    # A's model has no manifest: C forwards it to A, and the reply is A's own.
    assert wait_until(lambda: chat(c, own_a)[0] == 200, 30, 0.5)
    status, reply, headers = chat(c, own_a)
    assert status == 200 and headers["x-swarm-route"] == "forwarded", reply
    assert reply["choices"][0]["token_ids"] == chat(a, own_a)[1]["choices"][0]["token_ids"]
    # Still no torch, and the peak memory of the whole run is that of a light node.
    assert not _maps_torch(c.proc.pid)
    peak_mb = _status_kb(c.proc.pid, "VmHWM") / 1024
    print(f"light node peak RSS {peak_mb:.0f} MB")
    assert peak_mb <= 300, f"peak RSS {peak_mb:.0f} MB"
    with urllib.request.urlopen(f"{c.url}/api/admin/diagnostics", timeout=30) as response:
        report = response.read().decode()
    assert "none held (--no-model)" in report and "torch not loaded" in report
    assert f"holder(s) of {OTHER}: complete" in report
    peers = c.get_json("/api/peers")["peers"]  # type: ignore[index]
    b_row = next(p for p in peers if p["peer_id"] == b.health()["peer_id"])  # type: ignore[union-attr]
    assert {s["model"] for s in b_row["serves"]} == {OTHER}


def test_a_node_without_a_model_refuses_stage_sessions_and_can_be_the_bootstrap(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    """A swarm whose first node holds nothing: a holder joins through it, and the light
    node routes the holder's model; it is never asked to hold layers."""
    light = start_node(
        ["--port", "0", "--p2p-port", "0", "--data-dir", str(tmp_path / "l"), "--no-model"],
        tmp_path,
    )
    holder: NodeProcess | None = None
    try:
        boot = light.p2p_addrs[0]
        args = ["--port", "0", "--p2p-port", "0", "--data-dir", str(tmp_path / "h")]
        args += ["--model", str(folders[1]), "--torch-threads", "1", "--bootstrap", boot]
        holder = start_node(args, tmp_path)
        assert wait_until(lambda: OTHER in listed(light), 30, 0.5), listed(light)
        status, reply, headers = chat(light, OTHER)
        assert status == 200, reply
        assert reply["choices"][0]["token_ids"] == chat(holder, OTHER)[1]["choices"][0]["token_ids"]
        assert headers["x-swarm-nodes"] == holder.health()["peer_id"][-8:]  # type: ignore[index]
        assert not _maps_torch(light.proc.pid)
    finally:
        if holder is not None:
            holder.stop()
        light.stop()


def test_one_node_serves_two_models(
    folders: tuple[Path, Path], a: NodeProcess, b: NodeProcess, tmp_path: Path
) -> None:
    """`--model` twice: both held whole, both answered locally, each reply its holder's."""
    args = ["--port", "0", "--p2p-port", "0", "--data-dir", str(tmp_path / "d")]
    args += ["--model", str(folders[0]), "--model", str(folders[1]), "--torch-threads", "1"]
    args += ["--kv-budget-tokens", "4096"]
    node = start_node(args, tmp_path)  # alone: its copy of `other` joins no route of A's
    try:
        own_a = str(a.get_json("/v1/models")["data"][0]["id"])  # type: ignore[index]
        assert set(listed(node)) == {own_a, OTHER}
        assert [m["id"] for m in node.health()["models"]] == [own_a, OTHER]  # type: ignore[union-attr]
        for model, holder in ((own_a, a), (OTHER, b)):
            want = chat(holder, model)[1]["choices"][0]["token_ids"]
            with ThreadPoolExecutor(max_workers=2) as pool:
                replies = list(pool.map(lambda m: chat(node, m), [model, model]))
            for status, reply, headers in replies:
                assert status == 200, reply
                assert headers["x-swarm-route"] == "local"
                assert reply["choices"][0]["token_ids"] == want
    finally:
        node.stop()
