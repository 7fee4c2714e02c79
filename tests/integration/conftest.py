"""Fixtures for the tests that run a node in this process on a tiny random model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from swarmd.config import Config
from swarmd.dht.records import NodeRecord
from swarmd.model.loader import load_model
from swarmd.model.source import ModelSource
from swarmd.net.host import P2PHost
from swarmd.net.identity import load_or_create_identity
from swarmd.node import Node

NodeFactory = Callable[..., Any]


@pytest.fixture
async def make_node(tiny_chat_dir: Path, tmp_path: Path) -> AsyncIterator[NodeFactory]:
    started: list[Node] = []
    model = load_model(ModelSource("tiny", tiny_chat_dir), None)

    async def factory(**overrides: Any) -> Node:
        config = Config(port=0, data_dir=tmp_path / "data", cache_dir=tmp_path, **overrides)
        node = Node(config, load_or_create_identity(config.data_dir), [model])
        await node.start()
        started.append(node)
        return node

    yield factory
    for node in started:
        await node.stop()


async def poll(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


def body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "temperature": 0,
        **fields,
    }


def host_record(host: P2PHost, model_id: str = "m") -> NodeRecord:
    """A ready record of a 4-layer model served by `host`, valid for a minute."""
    return NodeRecord(
        peer_id=host.peer_id,
        model_id=model_id,
        model_hash="",
        layer_start=0,
        layer_end=4,
        num_layers=4,
        dtype="float32",
        weights="fp32",
        free_kv_tokens=64,
        kv_budget_tokens=64,
        throughput_tps=1.0,
        state="ready",
        addrs=tuple(host.addrs),
        api_url="",
        version="0.1.0",
        expires_at=time.time() + 60.0,
    )


def host_records(host: P2PHost) -> list[NodeRecord]:
    """`SwarmPresence`'s records of a node serving one model: `host_record`'s."""
    return [host_record(host)]


def hold_steps(node: Node, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make every forward of `node` wait until the returned event is set (or 30 s)."""
    release = threading.Event()
    real_step = node.runtime.step_many

    def held_step(*args: Any, **kwargs: Any) -> Any:
        release.wait(timeout=30)  # holds the session slots until the test lets go
        return real_step(*args, **kwargs)

    monkeypatch.setattr(node.runtime, "step_many", held_step)
    return release
