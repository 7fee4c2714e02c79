"""Bad requests get the right 4xx in OpenAI's error shape, and the node keeps serving."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.conftest import NodeProcess, http_json

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


# (name, path, body, status, param, code)
def _nested(depth: int) -> dict[str, Any]:
    """An object schema whose one property is arrays of arrays, `depth` deep."""
    schema: dict[str, Any] = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return {"type": "object", "properties": {"x": schema}}


CASES: list[tuple[str, str, Any, int, str | None, str | None]] = [
    ("body not JSON", "chat", b"{not json", 400, None, "invalid_value"),
    ("JSON array body", "chat", b"[1, 2]", 400, None, "invalid_value"),
    ("empty body", "chat", b"", 400, None, "invalid_value"),
    ("missing messages", "chat", {"model": MODEL}, 400, "messages", "invalid_value"),
    ("missing model", "chat", {"messages": USER}, 400, "model", "invalid_value"),
    ("empty messages", "chat", chat(messages=[]), 400, "messages", "invalid_value"),
    ("temperature -1", "chat", chat(temperature=-1), 400, "temperature", "invalid_value"),
    ("temperature 3", "chat", chat(temperature=3), 400, "temperature", "invalid_value"),
    ("top_p 2", "chat", chat(top_p=2), 400, "top_p", "invalid_value"),
    ("max_tokens 0", "chat", chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("max_tokens -5", "chat", chat(max_tokens=-5), 400, "max_tokens", "invalid_value"),
    (
        "unknown role",
        "chat",
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages[0].role",
        "invalid_value",
    ),
    ("temperature as string", "chat", chat(temperature="0.5"), 400, "temperature", "invalid_value"),
    ("max_tokens as float", "chat", chat(max_tokens=1.5), 400, "max_tokens", "invalid_value"),
    ("stream as string", "chat", chat(stream="yes"), 400, "stream", "invalid_value"),
    ("messages as string", "chat", chat(messages="hi"), 400, "messages", "invalid_value"),
    (
        "content as number",
        "chat",
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
        "invalid_value",
    ),
    ("stop as number", "chat", chat(stop=5), 400, "stop", "invalid_value"),
    ("unknown field", "chat", chat(bogus=1), 400, "bogus", "invalid_value"),
    ("n 9", "chat", chat(n=9), 400, "n", "invalid_value"),
    ("n 0", "text", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    (
        "tool without a name",
        "chat",
        chat(tools=[{"type": "function", "function": {"description": "f"}}]),
        400,
        "tools[0].function.name",
        "invalid_value",
    ),
    (
        "deprecated functions",
        "chat",
        chat(functions=[{"name": "f"}]),
        400,
        "functions",
        "unsupported_parameter",
    ),
    ("logprobs as number", "chat", chat(logprobs=1), 400, "logprobs", "invalid_value"),
    (
        "top_logprobs 21",
        "chat",
        chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
        "invalid_value",
    ),
    ("top_logprobs alone", "chat", chat(top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    (
        "completion logprobs 21",
        "text",
        {"model": MODEL, "prompt": "hi", "logprobs": 21},
        400,
        "logprobs",
        "invalid_value",
    ),
    (
        "response_format of no known type",
        "chat",
        chat(response_format={"type": "yaml"}),
        400,
        "response_format.type",
        "invalid_value",
    ),
    (
        "json_schema without its schema object",
        "chat",
        chat(response_format={"type": "json_schema"}),
        400,
        "response_format.json_schema",
        "invalid_value",
    ),
    (
        "a schema the grammar library cannot compile",
        "chat",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
            }
        ),
        400,
        "response_format",
        "invalid_value",
    ),
    (
        "a schema nested deeper than any grammar library reads",
        "chat",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": _nested(500)},
            }
        ),
        400,
        "response_format",
        "invalid_value",
    ),
    (
        "tool parameters nested deeper than any grammar library reads",
        "chat",
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _nested(500)}}]),
        400,
        "tools[0].function.parameters",
        "invalid_value",
    ),
    (
        "metadata value not text",
        "chat",
        chat(metadata={"k": 1}),
        400,
        "metadata.k",
        "invalid_value",
    ),
    (
        "service_tier unknown",
        "chat",
        chat(service_tier="gold"),
        400,
        "service_tier",
        "invalid_value",
    ),
    (
        "reasoning_effort unknown",
        "chat",
        chat(reasoning_effort="extreme"),
        400,
        "reasoning_effort",
        "invalid_value",
    ),
    (
        "chat_template_kwargs setting messages",
        "chat",
        chat(chat_template_kwargs={"messages": []}),
        400,
        "chat_template_kwargs",
        "invalid_value",
    ),
    (
        "stream_options without stream",
        "chat",
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "invalid_value",
    ),
    ("seed past torch's range", "chat", chat(seed=2**64), 400, "seed", "invalid_value"),
    (
        "NaN temperature",
        "chat",
        b'{"model": "m", "messages": [], "temperature": NaN}',
        400,
        None,
        "invalid_value",
    ),
    (
        "image content",
        "chat",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content[0].type",
        "unsupported_parameter",
    ),
    (
        "text part without text",
        "chat",
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        "messages[0].content[0]",
        "invalid_value",
    ),
    ("logit_bias bad key", "chat", chat(logit_bias={"x": 1}), 400, "logit_bias", "invalid_value"),
    (
        "logit_bias superscript digit",
        "chat",
        chat(logit_bias={"\u00b2": 1}),
        400,
        "logit_bias",
        "invalid_value",
    ),
    ("body nested 200k deep", "chat", b"[" * 200_000, 400, None, "invalid_value"),
    (
        "lone surrogate in content",
        "chat",
        b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        None,
        "invalid_value",
    ),
    (
        "prompt over the context",
        "chat",
        chat(messages=[{"role": "user", "content": "hello " * 9000}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "prompt + max_tokens over the context",
        "chat",
        chat(max_tokens=8190),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "completions: echo",
        "text",
        {"model": MODEL, "prompt": "a", "echo": True},
        400,
        "echo",
        "unsupported_parameter",
    ),
    (
        "completions: more than 32 prompts",
        "text",
        {"model": MODEL, "prompt": ["a"] * 33},
        400,
        "prompt",
        "invalid_value",
    ),
    (
        "completions: token id out of range",
        "text",
        {"model": MODEL, "prompt": [10**9]},
        400,
        "prompt",
        "invalid_value",
    ),
    ("completions: missing prompt", "text", {"model": MODEL}, 400, "prompt", "invalid_value"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request(
    embedded_node: NodeProcess,
    path: str,
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    endpoint = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    got_status, got, headers = http_json(embedded_node.url + endpoint, body)
    assert got_status == status, got
    assert set(got) == {"error"}
    error = got["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    assert "x-swarm-request-id" in {k.lower() for k in headers}


def test_unknown_model_is_404(embedded_node: NodeProcess) -> None:
    status, body, _ = http_json(embedded_node.url + "/v1/chat/completions", chat(model="gpt-9"))
    assert status == 404
    assert body["error"]["param"] == "model"
    assert body["error"]["code"] == "model_not_found"
    assert "gpt-9" in body["error"]["message"]


def test_body_over_the_limit_is_413(embedded_node: NodeProcess) -> None:
    huge = json.dumps(chat(messages=[{"role": "user", "content": "x" * (2 << 20)}])).encode()
    status, body, _ = http_json(embedded_node.url + "/v1/chat/completions", huge)
    assert status == 413
    assert body["error"]["code"] == "payload_too_large"


def test_model_detail(embedded_node: NodeProcess) -> None:
    with urllib.request.urlopen(f"{embedded_node.url}/v1/models/{MODEL}", timeout=10) as resp:
        assert json.loads(resp.read())["id"] == MODEL
    try:
        urllib.request.urlopen(f"{embedded_node.url}/v1/models/gpt-9", timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
        assert json.loads(exc.read())["error"]["param"] == "model"
    else:
        pytest.fail("an unknown model id was found")


def test_unknown_path_and_wrong_method(embedded_node: NodeProcess) -> None:
    status, body, _ = http_json(embedded_node.url + "/v1/nothing", {})
    assert status == 404 and body["error"]["type"] == "not_found_error"
    try:
        urllib.request.urlopen(embedded_node.url + "/v1/chat/completions", timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.code == 405
        assert json.loads(exc.read())["error"]["message"].startswith("Method GET")
        assert "POST" in exc.headers["Allow"]  # a 405 names what the path takes
    else:
        pytest.fail("GET on a POST endpoint was accepted")


def test_node_still_serves_after_bad_input(embedded_node: NodeProcess) -> None:
    request_ids = []
    for case in CASES:
        endpoint = "/v1/chat/completions" if case[1] == "chat" else "/v1/completions"
        _, _, headers = http_json(embedded_node.url + endpoint, case[2])
        request_ids.append({k.lower(): v for k, v in headers.items()}["x-swarm-request-id"])
    status, body, _ = http_json(
        embedded_node.url + "/v1/chat/completions", chat(max_tokens=3, temperature=0)
    )
    assert status == 200
    assert body["usage"]["completion_tokens"] == 3
    assert embedded_node.proc.poll() is None
    log = embedded_node.log_text()
    assert "Traceback" not in log
    for request_id in request_ids:  # every rejected request left its own DIAG line
        line = next(ln for ln in log.splitlines() if f"request_id={request_id}" in ln)
        assert "outcome=error error_type=" in line


def test_null_for_nullable_parameters_means_the_default(embedded_node: NodeProcess) -> None:
    nulls = {"presence_penalty": None, "frequency_penalty": None, "n": None, "stream": None}
    status, body, _ = http_json(
        embedded_node.url + "/v1/chat/completions", chat(max_tokens=2, temperature=0, **nulls)
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 2


def test_a_vanishing_temperature_samples_like_greedy(embedded_node: NodeProcess) -> None:
    url = embedded_node.url + "/v1/chat/completions"
    status, tiny, _ = http_json(url, chat(max_tokens=6, temperature=1e-39, seed=1))
    assert status == 200, tiny
    _, greedy, _ = http_json(url, chat(max_tokens=6, temperature=0))
    assert tiny["choices"][0]["message"] == greedy["choices"][0]["message"]
