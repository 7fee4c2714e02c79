"""Several real nodes on 127.0.0.1 find each other through the DHT alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmd.net.identity import load_or_create_identity
from tests.conftest import NodeProcess, http_json, start_node, wait_until

pytestmark = pytest.mark.e2e

TTL_S = 10.0
REPUBLISH_S = 2.0


@pytest.fixture
def swarm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Short record lifetimes keep the test quick; the defaults are 60 s and 20 s.
    monkeypatch.setenv("SWARMD_RECORD_TTL_S", str(TTL_S))
    monkeypatch.setenv("SWARMD_REPUBLISH_INTERVAL_S", str(REPUBLISH_S))
    monkeypatch.setenv("SWARMD_TORCH_THREADS", "1")


@pytest.fixture
def nodes(swarm_env: None) -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []
    yield started
    for node in started:
        node.stop()


def launch_node(nodes: list[NodeProcess], tmp_path: Path, name: str, *args: str) -> NodeProcess:
    """Start a node on free ports with its own data dir; `nodes` stops it at the end."""
    workdir = tmp_path / name
    workdir.mkdir()
    data = ["--data-dir", str(workdir / "data")]
    node = start_node(["--port", "0", "--p2p-port", "0", *data, *args], workdir)
    nodes.append(node)
    return node


def holders(node: NodeProcess) -> dict[str, list[int]]:
    entry = node.get_json("/v1/models")["data"][0]  # type: ignore[index]
    return {h["peer_id"]: h["layers"] for h in entry["swarm"]["holders"]}


def test_five_nodes_discover_each_other_and_forget_a_dead_one(
    nodes: list[NodeProcess], test_cache_dir: Path, tmp_path: Path, smollm_dir: Path
) -> None:
    def launch(name: str, *extra: str) -> NodeProcess:
        return launch_node(nodes, tmp_path, name, "--cache-dir", str(test_cache_dir), *extra)

    a = launch("a")
    join = ["--bootstrap", a.p2p_addrs[0]]
    b = launch("b", "--layers", "0:15", *join)
    c = launch("c", "--layers", "15:30", *join)
    d = launch("d", *join)
    e = launch("e", *join)  # knows only A
    ids = {id(n): str(n.health()["peer_id"]) for n in (a, b, c, d, e)}

    def sees_everyone() -> bool:
        found = holders(e)
        return all(ids[id(n)] in found for n in (b, c, d))

    assert wait_until(sees_everyone, 10.0, interval_s=0.25), holders(e)
    found = holders(e)
    assert (
        found[ids[id(b)]] == [0, 15]
        and found[ids[id(c)]] == [15, 30]
        and found[ids[id(d)]] == [0, 30]
    )
    entry = e.get_json("/v1/models")["data"][0]  # type: ignore[index]
    assert entry["swarm"]["complete"] is True and entry["swarm"]["coverage"] == [[0, 30]]

    # A partial node answers through a route: its own layers first, then a peer's.
    status, body, headers = http_json(
        b.url + "/v1/chat/completions",
        {"model": b.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200, body
    lowered = {k.lower(): v for k, v in headers.items()}
    assert lowered["x-swarm-route"] == "distributed"
    assert lowered["x-swarm-nodes"].split(",")[0] == ids[id(b)][-8:]

    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.wait(timeout=10)

    def forgot_c() -> bool:
        found = holders(e)
        return ids[id(c)] not in found and ids[id(b)] in found and ids[id(d)] in found

    assert wait_until(forgot_c, TTL_S + REPUBLISH_S + 5.0, interval_s=0.5), holders(e)


def test_peers_lists_the_other_node(
    nodes: list[NodeProcess], test_cache_dir: Path, tmp_path: Path, tiny_chat_dir: Path
) -> None:
    import subprocess
    import sys

    def launch(name: str, *extra: str) -> NodeProcess:
        return launch_node(nodes, tmp_path, name, "--model", str(tiny_chat_dir), *extra)

    first = launch("first")
    second = launch("second", "--bootstrap", first.p2p_addrs[0])
    first_id, second_id = (str(n.health()["peer_id"]) for n in (first, second))
    assert first.health()["addrs"] == first.p2p_addrs

    def lists(node: NodeProcess, other: str) -> bool:
        peers = node.get_json("/api/peers")["peers"]  # type: ignore[index]
        return any(p["peer_id"] == other and p["serves"] for p in peers)

    assert wait_until(lambda: lists(first, second_id) and lists(second, first_id), 10, 0.25)
    result = subprocess.run(
        [sys.executable, "-m", "swarmd", "peers", "--url", second.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert first_id in result.stdout and "0:4" in result.stdout
    health = second.health()
    assert health["status"] == "ok" and health["swarm"] == "ready"


def test_a_private_swarm_keeps_out_other_keys(
    nodes: list[NodeProcess], tmp_path: Path, tiny_chat_dir: Path
) -> None:
    def key_file(name: str, secret: str) -> str:
        path = tmp_path / name
        path.write_text(secret)
        path.chmod(0o600)
        return str(path)

    ours = key_file("ours.key", "a" * 64)
    theirs = key_file("theirs.key", "b" * 64)

    def launch(name: str, *extra: str) -> NodeProcess:
        return launch_node(nodes, tmp_path, name, "--model", str(tiny_chat_dir), *extra)

    first = launch("first", "--swarm-key", ours)
    join = ["--bootstrap", first.p2p_addrs[0]]
    friend = launch("friend", "--swarm-key", ours, *join)
    stranger = launch("stranger", "--swarm-key", theirs, *join)
    open_node = launch("open", *join)
    friend_id, stranger_id, open_id = (
        str(n.health()["peer_id"]) for n in (friend, stranger, open_node)
    )

    def peer_view(node: NodeProcess) -> dict[str, dict]:
        return {p["peer_id"]: p for p in node.get_json("/api/peers")["peers"]}  # type: ignore[index]

    def settled() -> bool:
        report = first.get_json("/api/peers")
        banned = {b["peer_id"] for b in report["bans"]}  # type: ignore[index]
        view = {p["peer_id"]: p for p in report["peers"]}  # type: ignore[index]
        return bool(view.get(friend_id, {}).get("serves")) and {stranger_id, open_id} <= banned

    names = {friend_id: "friend", stranger_id: "stranger", open_id: "open"}
    assert wait_until(settled, 15, 0.25), json.dumps(
        {names.get(k, k): v for k, v in peer_view(first).items()}
    )
    # Outsiders may redial, but they are cut off again and their records never count.
    view = peer_view(first)
    assert not view.get(stranger_id, {}).get("serves") and not view.get(open_id, {}).get("serves")
    found = holders(first)
    assert friend_id in found
    assert stranger_id not in found and open_id not in found
    assert str(first.health()["peer_id"]) not in holders(stranger)
    assert "DIAG: peer refused" in first.log_text()


def test_three_nodes_started_in_reverse_order_form_the_swarm_and_route(
    nodes: list[NodeProcess], test_cache_dir: Path, tmp_path: Path, smollm_dir: Path
) -> None:
    """The bootstrap node comes up last: the other two serve (joining) meanwhile, then
    join it by themselves; a request at either holder of layers 0:15 routes through the
    holder of 15:30, which each knows only through the bootstrap node."""
    boot_data = tmp_path / "boot" / "data"
    boot_id = load_or_create_identity(boot_data).peer_id  # its address, known beforehand
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        boot_port = sock.getsockname()[1]
    boot_addr = f"/ip4/127.0.0.1/tcp/{boot_port}/p2p/{boot_id}"
    cache = ["--cache-dir", str(test_cache_dir), "--bootstrap", boot_addr]

    last = launch_node(nodes, tmp_path, "last", "--layers", "15:30", *cache)
    first = launch_node(nodes, tmp_path, "first", "--layers", "0:15", *cache)
    for holder in (last, first):
        health = holder.health()
        assert health["swarm"] == "joining" and health["status"] == "degraded", health
        assert any(ln.startswith("swarmd: joining the swarm") for ln in holder.stdout_lines)

    boot_args = ["--port", "0", "--p2p-port", str(boot_port), "--data-dir", str(boot_data)]
    boot_args += ["--cache-dir", str(test_cache_dir), "--layers", "0:15"]
    boot = start_node(boot_args, tmp_path / "boot")
    nodes.append(boot)
    booted = time.monotonic()
    assert boot.p2p_addrs == [boot_addr]

    def routes(node: NodeProcess) -> bool:
        status, _, headers = http_json(
            node.url + "/v1/chat/completions",
            {
                "model": first.model_id,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        )
        lowered = {k.lower(): v for k, v in headers.items()}
        return status == 200 and len(lowered.get("x-swarm-nodes", "").split(",")) == 2

    assert wait_until(lambda: routes(boot) and routes(first), 60.0, interval_s=1.0)
    assert time.monotonic() - booted < 60.0
    for node in (first, last, boot):
        assert node.health()["swarm"] == "ready"
