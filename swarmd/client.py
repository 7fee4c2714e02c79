"""A small streaming client for `swarmd chat`: SSE in, text to the terminal."""

from __future__ import annotations

import json
import sys
from typing import Any

import aiohttp

from swarmd.errors import SwarmError


class ClientError(SwarmError):
    """The node could not be reached or answered with an error."""


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def stream_chat(
    url: str,
    model: str | None,
    messages: list[dict[str, Any]],
    options: dict[str, Any],
    token: str | None = None,
) -> str:
    """Stream a chat reply to stdout; return a one-line summary of the route and speed."""
    base = url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    try:
        async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers(token)) as http:
            model = model or await _first_model(http, base)
            body = {"model": model, "messages": messages, "stream": True, **options}
            body["stream_options"] = {"include_usage": True}
            async with http.post(f"{base}/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    raise ClientError(await _error_text(response))
                return await _print_stream(response)
    except aiohttp.ClientError as exc:
        raise ClientError(f"cannot reach {base}: {exc}") from exc


async def get_json(url: str, path: str, token: str | None = None) -> Any:
    """GET a JSON document from a node."""
    return json.loads(await get_text(url, path, token))


async def get_text(url: str, path: str, token: str | None = None) -> str:
    """GET a document from a node, as text."""
    base = url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=60)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout, headers=auth_headers(token)) as http,
            http.get(f"{base}{path}") as response,
        ):
            if response.status != 200:
                raise ClientError(await _error_text(response))
            return await response.text()
    except aiohttp.ClientError as exc:
        raise ClientError(f"cannot reach {base}: {exc}") from exc


async def _first_model(http: aiohttp.ClientSession, base: str) -> str:
    async with http.get(f"{base}/v1/models") as response:
        if response.status != 200:
            raise ClientError(await _error_text(response))
        data = (await response.json())["data"]
    if not data:
        raise ClientError(f"{base} serves no model")
    return str(data[0]["id"])


async def _error_text(response: aiohttp.ClientResponse) -> str:
    hint = ""
    if response.status == 401:
        hint = " (pass --token or set SWARMD_TOKEN)"
    try:
        error = (await response.json())["error"]
        return f"HTTP {response.status}: {error['message']}{hint}"
    except (aiohttp.ContentTypeError, KeyError, TypeError, json.JSONDecodeError):
        return f"HTTP {response.status}: {await response.text()}"


async def _print_stream(response: aiohttp.ClientResponse) -> str:
    summary = ""
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise ClientError(chunk["error"]["message"])
        for choice in chunk.get("choices", []):
            text = choice.get("delta", {}).get("content")
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
        if "swarm" in chunk:
            forwarded = response.headers.get("x-swarm-route") == "forwarded"
            summary = _summary(chunk["swarm"], chunk.get("usage"), forwarded)
    return summary


def _summary(swarm: dict[str, Any], usage: dict[str, Any] | None, forwarded: bool) -> str:
    """`forwarded`: the node passed the request on whole; `swarm` is the holder's."""
    timing = swarm.get("timing", {})
    route = f"{swarm.get('route')} via {','.join(swarm.get('nodes', []))}"
    parts = [f"forwarded ({route})" if forwarded else route]
    if usage:
        parts.append(f"{usage['completion_tokens']} tokens")
    decode_ms = timing.get("decode_ms")
    if usage and decode_ms and usage["completion_tokens"] > 1:
        parts.append(f"{(usage['completion_tokens'] - 1) / (decode_ms / 1000):.1f} tok/s")
    if timing.get("ttft_ms") is not None:
        parts.append(f"ttft {timing['ttft_ms']:.0f} ms")
    return "[" + " · ".join(parts) + "]"
