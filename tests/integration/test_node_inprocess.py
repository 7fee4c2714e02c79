"""A node in this process on a tiny random model: admission, timeouts, mid-stream errors."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from swarmd.config import Config
from swarmd.errors import InternalError
from swarmd.model.loader import load_model
from swarmd.model.source import ModelSource
from swarmd.net.identity import load_or_create_identity
from swarmd.node import Node

NodeFactory = Callable[..., Any]


@pytest.fixture
async def make_node(tiny_chat_dir: Path, tmp_path: Path) -> AsyncIterator[NodeFactory]:
    started: list[Node] = []
    model = load_model(ModelSource("tiny", tiny_chat_dir), None, "float32")

    async def factory(**overrides: Any) -> Node:
        config = Config(port=0, data_dir=tmp_path / "data", cache_dir=tmp_path, **overrides)
        node = Node(config, load_or_create_identity(config.data_dir), model)
        await node.start()
        started.append(node)
        return node

    yield factory
    for node in started:
        await node.stop()


def body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "temperature": 0,
        **fields,
    }


async def read_events(response: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_a_full_node_answers_503_with_retry_after(make_node: NodeFactory) -> None:
    node = await make_node(max_sessions=1, queue_timeout_s=0.2)
    async with aiohttp.ClientSession() as http:
        url = f"{node.api_url}/v1/chat/completions"
        first = await http.post(url, json=body(max_tokens=400, stream=True))
        assert first.status == 200
        second = await http.post(url, json=body(max_tokens=2))
        assert second.status == 503
        assert int(second.headers["Retry-After"]) > 0
        error = (await second.json())["error"]
        assert error["code"] == "OverloadedError" and "slots" in error["message"]
        events = await read_events(first)
        assert events[-1] == "[DONE]"
        assert any(
            e != "[DONE]" and e["choices"] and e["choices"][0]["finish_reason"] for e in events
        )
        third = await http.post(url, json=body(max_tokens=2))
        assert third.status == 200  # the slot came back


async def test_step_timeout_is_503(make_node: NodeFactory) -> None:
    node = await make_node(step_timeout_s=1e-6)
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{node.api_url}/v1/chat/completions", json=body(max_tokens=4))
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "StepTimeoutError"


async def test_failure_mid_stream_sends_one_error_event_then_done(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    node = await make_node()
    real_step = node.runtime.step
    calls = 0

    def failing_step(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise InternalError("the stage broke")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(node.runtime, "step", failing_step)
    caplog.set_level(logging.INFO, logger="swarmd.requests")
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            f"{node.api_url}/v1/chat/completions", json=body(max_tokens=50, stream=True)
        )
        assert response.status == 200
        events = await read_events(response)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["message"] == "the stage broke"
    assert events[-1] == "[DONE]" and events[-2] == errors[0]
    assert node.runtime.session_count == 0  # the KV cache was freed
    diag = [r.message for r in caplog.records if "DIAG: request complete" in r.message]
    assert "outcome=error error_type=InternalError" in diag[-1]


async def test_sessions_are_freed_and_counted(make_node: NodeFactory) -> None:
    node = await make_node()
    async with aiohttp.ClientSession() as http:
        url = f"{node.api_url}/v1/chat/completions"
        replies = await asyncio.gather(*(http.post(url, json=body(max_tokens=8)) for _ in range(4)))
        assert [r.status for r in replies] == [200] * 4
        usage = [(await r.json())["usage"]["completion_tokens"] for r in replies]
        assert all(1 <= u <= 8 for u in usage)
        health = await (await http.get(f"{node.api_url}/health")).json()
    assert health["sessions"] == 0 and health["in_flight"] == 0
    assert node.runtime.session_count == 0
