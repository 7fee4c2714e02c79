"""A node in this process on a tiny random model: admission, timeouts, mid-stream errors."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from swarmd.api import completions
from swarmd.errors import InternalError
from tests.integration.conftest import NodeFactory, body, hold_steps, poll


async def read_events(response: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_a_full_node_answers_503_with_retry_after(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await make_node(max_sessions=1, queue_timeout_s=0.2)
    release = hold_steps(node, monkeypatch)
    async with aiohttp.ClientSession() as http:
        url = f"{node.api_url}/v1/chat/completions"
        first = asyncio.create_task(http.post(url, json=body(max_tokens=3)))
        assert await poll(lambda: node.coordinator.in_flight == 1, 5)
        second = await http.post(url, json=body(max_tokens=2))
        assert second.status == 503
        assert int(second.headers["Retry-After"]) > 0
        error = (await second.json())["error"]
        assert error["code"] == "overloaded" and "slots" in error["message"]
        release.set()
        assert (await first).status == 200
        third = await http.post(url, json=body(max_tokens=2))
        assert third.status == 200  # the slot came back


async def test_step_timeout_is_503(make_node: NodeFactory) -> None:
    node = await make_node(step_timeout_s=1e-6)
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{node.api_url}/v1/chat/completions", json=body(max_tokens=4))
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "step_timeout"


async def test_failure_mid_stream_sends_one_error_event_then_done(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    node = await make_node()
    real_step = node.runtime.step_many
    calls = 0

    def failing_step(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise InternalError("the stage broke")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(node.runtime, "step_many", failing_step)
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


async def test_a_close_that_times_out_still_frees_the_slot_and_the_cache(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Generous against a busy CI machine: real steps take milliseconds, the close 2 s.
    node = await make_node(max_sessions=1, step_timeout_s=1.0)
    real_close = node.runtime.close

    def slow_close(session_id: str) -> None:
        time.sleep(2.0)
        real_close(session_id)

    monkeypatch.setattr(node.runtime, "close", slow_close)
    async with aiohttp.ClientSession() as http:
        url = f"{node.api_url}/v1/chat/completions"
        first = await http.post(url, json=body(max_tokens=2))
        assert first.status == 200
        assert node.coordinator.in_flight == 0  # the slot came back despite the timeout
        assert await poll(lambda: node.runtime.session_count == 0, 5)  # close still ran
        monkeypatch.setattr(node.runtime, "close", real_close)
        again = await http.post(url, json=body(max_tokens=2))
        assert again.status == 200, await again.text()


async def test_an_open_that_times_out_is_closed_anyway(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await make_node(step_timeout_s=0.5)
    real_open = node.runtime.open

    def slow_open(*args: Any, **kwargs: Any) -> None:
        time.sleep(1.0)
        real_open(*args, **kwargs)

    monkeypatch.setattr(node.runtime, "open", slow_open)
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{node.api_url}/v1/chat/completions", json=body(max_tokens=2))
        assert response.status == 503
    assert await poll(lambda: node.runtime.session_count == 0, 5)
    assert node.coordinator.in_flight == 0


async def test_a_stream_without_usage_carries_swarm_on_the_finish_chunk(
    make_node: NodeFactory,
) -> None:
    node = await make_node()
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            f"{node.api_url}/v1/chat/completions", json=body(max_tokens=3, stream=True)
        )
        events = await read_events(response)
    chunks = [e for e in events if e != "[DONE]"]
    assert events[-1] == "[DONE]"
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["swarm"]["route"] == "local"
    assert all("swarm" not in c for c in chunks[:-1])


async def _disconnect_when(url: str, payload: dict[str, Any], working: Callable[[], bool]) -> None:
    """Send the request, then leave as soon as `working()` says the node is on it."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    data = json.dumps(payload).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    # The point of the test: leave while the node works (not before it started).
    assert await poll(working, 10), "the node never started on the request"
    writer.close()
    await writer.wait_closed()


async def test_leaving_a_stream_that_sends_no_text_is_a_clean_disconnect(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    node = await make_node()
    caplog.set_level(logging.INFO)
    # Token 0 is a special token: every step decodes to no text, so no write fails and
    # only the per-step check can notice the client has gone.
    payload = body(max_tokens=400, stream=True, logit_bias={"0": 100})
    await _disconnect_when(node.api_url, payload, lambda: node.runtime.cached_tokens > 0)
    assert await poll(lambda: node.coordinator.in_flight == 0, 3)
    assert node.runtime.session_count == 0
    diag = [r.message for r in caplog.records if "DIAG: request complete" in r.message]
    assert "outcome=error error_type=ClientDisconnectedError" in diag[-1]
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged


async def test_leaving_during_prefill_stops_the_prefill(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await make_node(prefill_chunk_tokens=1)
    real_step = node.runtime.step_many
    steps = 0

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        nonlocal steps
        steps += 1
        time.sleep(0.01)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(node.runtime, "step_many", slow_step)
    long_prompt = "hello " * 300  # 300 one-token prefill steps of 10 ms at least
    payload = body(messages=[{"role": "user", "content": long_prompt}], stream=True)
    await _disconnect_when(node.api_url, payload, lambda: steps > 0)
    assert await poll(lambda: node.coordinator.in_flight == 0, 3)
    assert steps < 200, steps  # the prefill stopped soon after the client left
    assert node.runtime.session_count == 0


async def test_a_node_that_takes_no_peers_sessions_announces_no_room_for_them(
    make_node: NodeFactory,
) -> None:
    """With `max_remote_sessions` 0 its record says budget 0, so no other coordinator
    plans through it, nor waits for room that will never be given to it."""
    node = await make_node(max_remote_sessions=0, kv_budget_tokens=4096)
    held = next(iter(node.held.values()))
    record = held.record("p", (), "", 1.0, 60.0)
    assert record.kv_budget_tokens == 0 and record.free_kv_tokens == 0
    assert held.kv_budget.total == 4096  # its own requests keep the whole budget


async def test_replies_carry_one_system_fingerprint_and_openais_usage_details(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await make_node()
    async with aiohttp.ClientSession() as http:
        url = f"{node.api_url}/v1"
        whole = await (await http.post(f"{url}/chat/completions", json=body(max_tokens=3))).json()
        response = await http.post(
            f"{url}/chat/completions",
            json=body(max_tokens=3, stream=True, stream_options={"include_usage": True}),
        )
        chunks = [e for e in await read_events(response) if e != "[DONE]"]
        text = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
        legacy = await (await http.post(f"{url}/completions", json=text)).json()
    fingerprint = whole["system_fingerprint"]
    assert re.fullmatch(r"fp_[0-9a-f]{12}", fingerprint)
    assert {c["system_fingerprint"] for c in chunks} == {fingerprint}
    assert legacy["system_fingerprint"] == fingerprint
    for usage in (whole["usage"], chunks[-1]["usage"], legacy["usage"]):
        assert usage["completion_tokens_details"]["reasoning_tokens"] == 0
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    # It changes with what the tokens depend on: the weights' format, their content, and
    # swarmd's version.
    variant = node.held["tiny"].model.variant
    assert completions._fingerprint(variant) == fingerprint
    for changed in (
        replace(variant, weights="int8"),
        replace(variant, content_id="0" * 64),
        replace(variant, dtype_name="bfloat16"),
    ):
        assert completions._fingerprint(changed) != fingerprint
    monkeypatch.setattr(completions, "__version__", "99.0.0")
    assert completions._fingerprint(variant) != fingerprint
