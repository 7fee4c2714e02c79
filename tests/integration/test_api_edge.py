"""The HTTP edge of a node in this process: tokens, Host and Origin, content types,
deadlines for slow clients, connection and queue caps."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from swarmd.api.forward import FORWARD_HEADER
from swarmd.api.tokens import TokenStore
from swarmd.config import Config
from swarmd.errors import ConfigError
from swarmd.node import Node, check_api_exposure
from tests.integration.conftest import NodeFactory, body, hold_steps, poll

CHAT = "/v1/chat/completions"


def port_of(node: Node) -> int:
    return int(node.api_url.rsplit(":", 1)[1])


async def error_of(response: aiohttp.ClientResponse) -> dict[str, Any]:
    payload = await response.json()
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    return payload["error"]


async def raw_exchange(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send raw bytes; everything the node answers until it closes (or the deadline)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            return await reader.read()
    finally:
        writer.close()


# --- API tokens ---------------------------------------------------------------------


async def test_without_a_token_the_api_is_open(make_node: NodeFactory) -> None:
    node = await make_node()
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/models", "/metrics", "/api/peers"):
            async with http.get(node.api_url + path) as response:
                assert response.status == 200, path


async def test_a_token_closes_the_api_to_requests_without_it(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    node = await make_node()
    store = TokenStore(node.config.data_dir)  # as `swarmd token create` would, node running
    _, infer = store.create("app", "infer")
    admin_entry, admin = store.create("ops", "admin")
    base = node.api_url
    async with aiohttp.ClientSession() as http:
        cases: list[tuple[dict[str, str], str]] = [
            ({}, "didn't provide"),
            ({"Authorization": f"Bearer {infer}x"}, "Incorrect API key"),
            ({"Authorization": f"Basic {infer}"}, "Malformed"),
            ({"Authorization": "Bearer"}, "Malformed"),
            ({"Authorization": f"bearer{infer}"}, "Malformed"),
        ]
        for headers, message in cases:
            for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("GET", "/metrics")):
                async with http.request(
                    method, base + path, headers=headers, json=body(max_tokens=1)
                ) as response:
                    assert response.status == 401, (headers, path)
                    assert response.headers["WWW-Authenticate"].startswith("Bearer")
                    error = await error_of(response)
                    assert error["code"] == "invalid_api_key"
                    assert message in error["message"]
                    assert infer not in error["message"]  # a token never echoes back
        for path in ("/", "/health", "/static/app.js"):  # the page and the probe stay open
            async with http.get(base + path) as response:
                assert response.status == 200, path
        user = {"Authorization": f"Bearer {infer}"}
        async with http.post(base + CHAT, headers=user, json=body(max_tokens=2)) as response:
            assert response.status == 200
        for path in ("/metrics", "/api/peers", "/api/admin/diagnostics"):
            async with http.get(base + path, headers=user) as response:
                assert response.status == 403, path
                assert (await error_of(response))["code"] == "insufficient_scope"
            async with http.get(base + path, headers={"Authorization": f"Bearer {admin}"}) as ok:
                assert ok.status == 200, path
        async with http.get(
            base + "/metrics", headers={"Authorization": f"Bearer {admin}"}
        ) as response:
            scrape = await response.text()
        assert 'swarmd_http_refused_total{reason="invalid_api_key"} 15.0' in scrape
        assert 'swarmd_http_refused_total{reason="insufficient_scope"} 3.0' in scrape
        store.revoke(admin_entry.id)  # takes effect on the next request, no restart
        async with http.get(
            base + "/metrics", headers={"Authorization": f"Bearer {admin}"}
        ) as response:
            assert response.status == 401


async def test_require_api_token_refuses_everyone_until_a_token_exists(
    make_node: NodeFactory,
) -> None:
    node = await make_node(require_api_token=True)
    async with aiohttp.ClientSession() as http, http.get(node.api_url + "/v1/models") as response:
        assert response.status == 401


async def test_only_the_nodes_own_forward_secret_stands_in_for_a_token(
    make_node: NodeFactory,
) -> None:
    """A peer's forwarded request runs here over loopback with the node's secret; a
    client that guesses at the header is refused like any client without a token."""
    node = await make_node(require_api_token=True)
    url = node.api_url + CHAT
    async with aiohttp.ClientSession() as http:
        secret = node.forwards.secret
        near = secret[:-1] + ("A" if secret[-1] != "A" else "B")  # one character off
        for guess in ("", "x", near):
            headers = {FORWARD_HEADER: guess}
            async with http.post(url, json=body(max_tokens=1), headers=headers) as response:
                assert response.status == 401
        headers = {FORWARD_HEADER: node.forwards.secret}
        async with http.post(url, json=body(max_tokens=1), headers=headers) as response:
            assert response.status == 200
        # Only the completion endpoints: never the admin ones.
        async with http.get(node.api_url + "/metrics", headers=headers) as response:
            assert response.status == 401


def test_an_api_beyond_loopback_needs_a_token_to_start(tmp_path: Path) -> None:
    open_config = Config(host="0.0.0.0", data_dir=tmp_path)
    with pytest.raises(ConfigError, match="swarmd token create"):
        check_api_exposure(open_config)
    check_api_exposure(Config(host="0.0.0.0", data_dir=tmp_path, allow_open_api=True))
    check_api_exposure(Config(host="127.0.0.1", data_dir=tmp_path))
    TokenStore(tmp_path).create("lan")
    check_api_exposure(open_config)


# --- Host, Origin, Content-Type -----------------------------------------------------


async def test_a_foreign_host_header_is_refused_on_a_loopback_node(make_node: NodeFactory) -> None:
    node = await make_node()
    async with aiohttp.ClientSession() as http:
        for host in ("evil.example", f"evil.example:{port_of(node)}", "10.1.2.3"):
            async with http.get(node.api_url + "/v1/models", headers={"Host": host}) as response:
                assert response.status == 403, host
                assert (await error_of(response))["code"] == "host_not_allowed"
        for host in (f"localhost:{port_of(node)}", f"127.0.0.1:{port_of(node)}"):
            async with http.get(node.api_url + "/v1/models", headers={"Host": host}) as response:
                assert response.status == 200, host


async def test_pages_of_other_origins_are_refused(make_node: NodeFactory) -> None:
    node = await make_node(allowed_origins=("http://app.localhost:3000",))
    own = f"http://127.0.0.1:{port_of(node)}"
    async with aiohttp.ClientSession() as http:
        for origin in ("https://evil.example", "null", f"http://127.0.0.1:{port_of(node) + 1}"):
            async with http.post(
                node.api_url + CHAT, json=body(max_tokens=1), headers={"Origin": origin}
            ) as response:
                assert response.status == 403, origin
                assert (await error_of(response))["code"] == "origin_not_allowed"
        async with http.post(
            node.api_url + CHAT, json=body(max_tokens=1), headers={"Origin": own}
        ) as response:
            assert response.status == 200
            assert "Access-Control-Allow-Origin" not in response.headers
        allowed = {"Origin": "http://app.localhost:3000"}
        async with http.options(
            node.api_url + CHAT,
            headers={**allowed, "Access-Control-Request-Method": "POST"},
        ) as preflight:
            assert preflight.status == 204
            assert preflight.headers["Access-Control-Allow-Origin"] == allowed["Origin"]
            assert "authorization" in preflight.headers["Access-Control-Allow-Headers"]
        # a browser client that sends its own headers (the openai SDK's x-stainless-*)
        asked = "authorization, content-type, x-stainless-lang, x-stainless-retry-count"
        async with http.options(
            node.api_url + CHAT,
            headers={
                **allowed,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": asked,
            },
        ) as preflight:
            assert preflight.status == 204
            assert preflight.headers["Access-Control-Allow-Headers"] == asked
            assert preflight.headers["Vary"] == "Origin, Access-Control-Request-Headers"
        # what is no list of header names gets the plain answer, never an echo
        async with http.options(
            node.api_url + CHAT,
            headers={
                **allowed,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "x-a; evil=1",
            },
        ) as preflight:
            assert preflight.headers["Access-Control-Allow-Headers"] == (
                "authorization, content-type"
            )
        async with http.post(
            node.api_url + CHAT, json=body(max_tokens=1), headers=allowed
        ) as response:
            assert response.status == 200
            assert response.headers["Access-Control-Allow-Origin"] == allowed["Origin"]


async def test_a_form_post_is_refused_as_unsupported_media(make_node: NodeFactory) -> None:
    node = await make_node()
    payload = json.dumps(body(max_tokens=1))
    async with aiohttp.ClientSession() as http:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"Content-Type": content_type} if content_type else {}
            async with http.post(
                node.api_url + CHAT, data=payload.encode(), headers=headers
            ) as response:
                assert response.status == 415, content_type
                assert (await error_of(response))["code"] == "unsupported_media_type"
        async with http.post(
            node.api_url + CHAT,
            data=payload.encode(),
            headers={"Content-Type": "application/json; charset=utf-8"},
        ) as response:
            assert response.status == 200
    assert node.coordinator.in_flight == 0


# --- slow clients and caps ----------------------------------------------------------


async def test_a_trickled_head_is_cut_at_its_deadline(make_node: NodeFactory) -> None:
    node = await make_node(http_head_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(node))
    started = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")

    async def trickle() -> None:  # a byte of header every 100 ms: the head never ends
        while not writer.is_closing():
            writer.write(b"a")
            await asyncio.sleep(0.1)

    task = asyncio.create_task(trickle())
    try:
        async with asyncio.timeout(5):
            answer = await reader.read()
    finally:
        task.cancel()
        writer.close()
    elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert 0.4 < elapsed < 3, elapsed
    assert node.edge.stats.head_timeouts == 1
    assert await poll(lambda: node.edge.stats.open == 0, 2)


async def test_a_trickled_body_is_cut_at_its_deadline(make_node: NodeFactory) -> None:
    node = await make_node(http_body_timeout_s=0.5)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"
    )
    started = time.monotonic()
    answer = await raw_exchange(port_of(node), head, timeout_s=5)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert b"body_timeout" in answer
    assert time.monotonic() - started < 3
    assert node.coordinator.in_flight == 0


MALFORMED = {
    "garbage request line": b"GARBAGE\r\n\r\n",
    "bad length": b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x\r\n\r\n",
    "negative length": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: -5\r\n\r\n",
    "huge header": b"GET /health HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_http_gets_a_4xx_in_openai_shape_and_no_traceback(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture, data: bytes
) -> None:
    """Requests aiohttp cannot parse were answered in plain text echoing the input, and
    logged with a traceback at ERROR (found by a stress run)."""
    node = await make_node()
    with caplog.at_level(logging.INFO):
        answer = await raw_exchange(port_of(node), data)
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:80]
    payload = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert payload["error"]["code"] == "bad_http"
    assert b"GARBAGE" not in answer and b"aaaa" not in answer  # nothing of the input echoed
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "Traceback" not in caplog.text and "malformed HTTP request" in caplog.text
    again = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    assert (await raw_exchange(port_of(node), again)).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
async def test_a_body_over_the_limit_is_refused_at_once_and_the_connection_closed(
    make_node: NodeFactory, chunked: bool
) -> None:
    """A declared length over `max_body_bytes` is refused before its body (it used to
    wait for the body's deadline, then answer 408); a chunked body is refused once it
    passes the limit. Either way one 413 in OpenAI's shape, then the connection closes
    (it used to stay open, and a stray 408 followed on it)."""
    node = await make_node(http_body_timeout_s=5.0)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += b"Content-Type: application/json\r\n"
    if chunked:
        chunk = b"x" * 65536
        size = f"{len(chunk):x}".encode()
        data = head + b"Transfer-Encoding: chunked\r\n\r\n"
        data += (size + b"\r\n" + chunk + b"\r\n") * 20  # 1.25 MiB, never ended
    else:
        data = head + b"Content-Length: 10000000000\r\n\r\n{"
    started = time.monotonic()
    answer = await raw_exchange(port_of(node), data, timeout_s=8)
    assert time.monotonic() - started < 3
    assert answer.startswith(b"HTTP/1.1 413"), answer[:80]
    assert answer.count(b"HTTP/1.1 ") == 1  # and nothing after it
    payload = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert payload["error"]["code"] == "payload_too_large"
    assert await poll(lambda: node.edge.stats.open == 0, 2)


async def test_an_idle_kept_alive_connection_is_closed(make_node: NodeFactory) -> None:
    node = await make_node(http_keepalive_timeout_s=0.5)
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    started = time.monotonic()
    answer = await raw_exchange(port_of(node), request, timeout_s=5)
    assert answer.startswith(b"HTTP/1.1 200")
    assert time.monotonic() - started < 3  # closed by the node, not by the read deadline


async def test_connections_over_the_per_client_cap_get_503(make_node: NodeFactory) -> None:
    node = await make_node(max_connections_per_client=3)
    port = port_of(node)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    try:
        assert await poll(lambda: node.edge.stats.open == 3, 2)
        answer = await raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503"), answer[:80]
        assert b"Retry-After: 1" in answer and b"too_many_connections" in answer
    finally:
        for _reader, writer in held:
            writer.close()
    assert await poll(lambda: node.edge.stats.open == 0, 2)
    again = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    assert (await raw_exchange(port, again)).startswith(b"HTTP/1.1 200")


async def test_a_full_queue_answers_503_at_once(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await make_node(max_sessions=1, max_queued_requests=1, kv_budget_tokens=100)
    release = hold_steps(node, monkeypatch)
    url = node.api_url + CHAT
    try:
        async with aiohttp.ClientSession() as http:
            running = asyncio.create_task(http.post(url, json=body(max_tokens=2)))
            assert await poll(lambda: node.coordinator.in_flight == 1, 5)
            queued = asyncio.create_task(http.post(url, json=body(max_tokens=2)))
            assert await poll(lambda: node.coordinator.waiting == 1, 5)
            async with http.post(url, json=body(max_tokens=2)) as refused:
                assert refused.status == 503
                assert refused.headers["Retry-After"] == "2"
                assert (await error_of(refused))["code"] == "queue_full"
            # One that could never fit the KV budget is told so (413), full queue or not:
            # past the arrival check (lifted here), admission's queue is still full.
            node.config = replace(node.config, max_queued_requests=10)
            async with http.post(url, json=body(max_tokens=120)) as never:
                assert never.status == 413, await never.text()
            release.set()
            assert (await running).status == 200
            assert (await queued).status == 200
    finally:
        release.set()


async def test_a_burst_queues_no_more_than_the_cap(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve requests at once, one slot and a queue of 4: one runs, 4 wait, 7 get 503
    queue_full at once. The cap is checked where a request would wait: as they arrive
    none waits yet (found by a stress run: all 12 queued), and a request that finds room
    never counts against it."""
    node = await make_node(max_sessions=1, max_queued_requests=4)
    release = hold_steps(node, monkeypatch)
    url = node.api_url + CHAT
    try:
        async with aiohttp.ClientSession() as http:

            async def one() -> tuple[int, str | None]:
                async with http.post(url, json=body(max_tokens=2)) as response:
                    if response.status == 200:
                        return 200, None
                    return response.status, (await error_of(response))["code"]

            burst = [asyncio.create_task(one()) for _ in range(12)]
            assert await poll(lambda: sum(t.done() for t in burst) == 7, 10)
            assert (node.coordinator.in_flight, node.coordinator.waiting) == (1, 4)
            release.set()
            outcomes = sorted(await asyncio.gather(*burst), key=str)
            assert outcomes == [(200, None)] * 5 + [(503, "queue_full")] * 7
            assert node.coordinator.waiting == 0
    finally:
        release.set()


async def test_slow_sockets_are_cut_while_real_requests_are_served(
    make_node: NodeFactory,
) -> None:
    """300 slowloris sockets, all admitted (the cap raised: they stand for 300 clients),
    each trickling its head; requests meanwhile answer as fast as on an idle node."""
    head_s = 2.0
    node = await make_node(http_head_timeout_s=head_s, max_connections_per_client=2048)
    port = port_of(node)
    # Each real request on its own connection, so that none is left open when counting.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:

        async def one_request() -> float:
            started = time.monotonic()
            async with http.post(node.api_url + CHAT, json=body(max_tokens=2)) as response:
                assert response.status == 200
                await response.read()
            return time.monotonic() - started

        idle = sorted([await one_request() for _ in range(5)])[2]
        opened = time.monotonic()
        slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(300)]
        for _reader, writer in slow:
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ")
        assert await poll(lambda: node.edge.stats.open >= 300, 5)
        loaded = sorted([await one_request() for _ in range(5)])[2]

        async def trickle(writer: asyncio.StreamWriter) -> None:
            while not writer.is_closing() and time.monotonic() - opened < head_s + 10:
                try:
                    writer.write(b"a")
                    await writer.drain()
                except ConnectionError:
                    return
                await asyncio.sleep(0.25)

        trickles = [asyncio.create_task(trickle(w)) for _r, w in slow]
        try:
            closed = await poll(lambda: node.edge.stats.open == 0, head_s + 8)
            cut_after = time.monotonic() - opened
        finally:
            for task in trickles:
                task.cancel()
            for _reader, writer in slow:
                writer.close()
    assert closed, node.edge.stats
    assert node.edge.stats.head_timeouts >= 300
    assert cut_after < head_s + 8
    # The served requests did not wait on the slow sockets (generous: a busy 2-core box).
    assert loaded < idle * 5 + 0.5, (idle, loaded)


async def test_the_openai_client_with_api_key(make_node: NodeFactory) -> None:
    import openai

    node = await make_node()
    _, token = TokenStore(node.config.data_dir).create("sdk")

    def ask(api_key: str) -> str:
        with openai.OpenAI(base_url=node.api_url + "/v1", api_key=api_key, max_retries=0) as client:
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        return reply.choices[0].finish_reason or ""

    assert await asyncio.to_thread(ask, token) in ("stop", "length")
    with pytest.raises(openai.AuthenticationError) as refused:
        await asyncio.to_thread(ask, token[:-2] + "zz")
    assert refused.value.status_code == 401
    assert refused.value.code == "invalid_api_key"


async def test_the_default_caps_let_one_client_hold_128_streams(make_node: NodeFactory) -> None:
    node = await make_node()  # every edge limit at its default
    url = node.api_url + CHAT

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def stream() -> int:
            async with http.post(url, json=body(max_tokens=4, stream=True)) as response:
                text = await response.text()
                assert text.rstrip().endswith("data: [DONE]"), text[-200:]
                return response.status

        statuses = await asyncio.gather(*(stream() for _ in range(128)))
    assert statuses == [200] * 128
    assert node.edge.stats.refused == 0
    assert not node.edge.stats.refusals
