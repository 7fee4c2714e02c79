"""The embedded model through a real `swarmd run`, driven by the official openai client."""

from __future__ import annotations

import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarmd.engine import native
from swarmd.model.loader import load_model
from swarmd.model.source import EMBEDDED_MODEL_ID, resolve_model
from swarmd.model.text import ChatMessage
from tests.conftest import NodeProcess, running_node, wait_until

pytestmark = pytest.mark.e2e

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow and say one thing about each."},
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def client(embedded_node: NodeProcess) -> Iterator[openai.OpenAI]:
    # Closed after the module: its pooled keep-alive sockets would otherwise be left for
    # the garbage collector, which reports them as ResourceWarnings at the session's end.
    with openai.OpenAI(
        base_url=f"{embedded_node.url}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


@pytest.fixture(scope="module")
def fp32_node(
    test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    """The embedded model on the exact path: transformers modules over float32 weights."""
    args = ["--cache-dir", str(test_cache_dir), "--weights", "fp32", "--dtype", "float32"]
    with running_node(tmp_path_factory, "fp32-node", args) as node:
        yield node


def transformers_reference(model_dir: Path) -> tuple[list[int], list[int]]:
    """Prompt ids and greedy reply ids from plain transformers on the same weights."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            pad_token_id=tokenizer.eos_token_id,
        )
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids) :].tolist()


def engine_reference(cache_dir: Path) -> tuple[list[int], list[int]]:
    """Prompt ids and greedy reply ids from the engine run in this process, int4, loaded
    as a node loads it (the GGUF read in place)."""
    model = load_model(resolve_model(EMBEDDED_MODEL_ID, cache_dir), None)
    assert model.backend == "engine" and model.weights == "int4"
    messages = [ChatMessage(m["role"], m["content"]) for m in MESSAGES]
    prompt_ids = model.codec.chat_prompt(messages)
    cache = model.stage.new_cache(len(prompt_ids) + MAX_TOKENS)
    reply = [int(model.stage(torch.tensor([prompt_ids]), cache).argmax())]
    while len(reply) < MAX_TOKENS and reply[-1] not in model.codec.eos_ids:
        reply.append(int(model.stage(torch.tensor([[reply[-1]]]), cache).argmax()))
    return prompt_ids, reply


@pytest.mark.parametrize("path", ["int4-engine", "fp32-transformers"])
def test_greedy_stream_and_whole_match_a_reference(
    path: str,
    request: pytest.FixtureRequest,
    test_cache_dir: Path,
    smollm_fp32_dir: Path,
) -> None:
    """The default node (int4, the engine) equals the engine run in-process; the exact path
    (--weights fp32 --dtype float32) equals plain transformers, token for token."""
    if path == "int4-engine":
        node: NodeProcess = request.getfixturevalue("embedded_node")
        reference_ids = engine_reference(test_cache_dir)
    else:
        node = request.getfixturevalue("fp32_node")
        reference_ids = transformers_reference(smollm_fp32_dir)
    backend = {"int4-engine": "engine", "fp32-transformers": "transformers"}[path]
    assert node.health()["models"][0]["backend"] == backend  # type: ignore[index]
    with openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0) as client:
        _check_greedy(client, node, reference_ids)


def _check_greedy(
    client: openai.OpenAI, node: NodeProcess, reference_ids: tuple[list[int], list[int]]
) -> None:
    model = node.model_id
    whole = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True},
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = whole.choices[0].message.content
    assert text and streamed == text

    prompt_ids, reply_ids = reference_ids
    assert whole.model_extra["prompt_token_ids"] == prompt_ids
    assert whole.choices[0].model_extra["token_ids"] == reply_ids
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish[0].choices[0].model_extra["token_ids"] == reply_ids
    expected_reason = "length" if len(reply_ids) == MAX_TOKENS else "stop"
    assert whole.choices[0].finish_reason == expected_reason
    assert finish[0].choices[0].finish_reason == expected_reason

    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == len(prompt_ids)
    assert usage_chunk.usage.completion_tokens == len(reply_ids)
    assert usage_chunk.usage.total_tokens == len(prompt_ids) + len(reply_ids)
    assert whole.usage is not None and whole.usage.completion_tokens == len(reply_ids)
    swarm = usage_chunk.model_extra["swarm"]
    assert swarm["route"] == "local" and swarm["failovers"] == 0
    assert swarm["timing"]["ttft_ms"] > 0


def test_headers_and_diag_line(client: openai.OpenAI, embedded_node: NodeProcess) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=embedded_node.model_id, messages=MESSAGES, temperature=0, max_tokens=4
    )
    short_id = str(embedded_node.health()["short_id"])
    assert raw.headers["x-swarm-route"] == "local"
    assert raw.headers["x-swarm-segments"] == "1"
    assert raw.headers["x-swarm-nodes"] == short_id
    request_id = raw.headers["x-swarm-request-id"]
    assert re.fullmatch(r"[0-9a-f-]{36}", request_id)
    timing = raw.headers["server-timing"]
    for phase in ("queue", "sched", "ttft", "decode"):
        assert re.search(rf"{phase};dur=[0-9.]+", timing), timing

    def diag_line() -> str | None:
        for line in embedded_node.log_text().splitlines():
            if f"request_id={request_id}" in line:
                return line
        return None

    assert wait_until(lambda: diag_line() is not None, 5)
    line = diag_line() or ""
    assert "DIAG: request complete" in line
    for name in ("route=local", "segments=1", f"nodes={short_id}", "outcome=ok", "tokens=4"):
        assert name in line
    for name in ("queue_ms=", "ttft_ms=", "decode_ms=", "total_ms=", "seg0_ms=", "tpot_ms="):
        assert name in line


def test_text_completion_stream_and_whole(
    client: openai.OpenAI, embedded_node: NodeProcess
) -> None:
    kwargs = {"model": embedded_node.model_id, "prompt": "The capital of France is"}
    whole = client.completions.create(**kwargs, temperature=0, max_tokens=8)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**kwargs, temperature=0, max_tokens=8, stream=True)
        if c.choices
    )
    assert whole.choices[0].text and streamed == whole.choices[0].text
    assert "Paris" in whole.choices[0].text


def test_stop_string_cuts_the_reply(client: openai.OpenAI, embedded_node: NodeProcess) -> None:
    base = client.chat.completions.create(
        model=embedded_node.model_id, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS
    )
    text = base.choices[0].message.content or ""
    stop = text.split()[3]  # a word from the middle of the greedy reply
    cut = client.chat.completions.create(
        model=embedded_node.model_id,
        messages=MESSAGES,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stop=[stop],
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, embedded_node: NodeProcess) -> None:
    def reply(seed: int) -> str:
        out = client.chat.completions.create(
            model=embedded_node.model_id,
            messages=MESSAGES,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            extra_body={"top_k": 50, "min_p": 0.02},
            max_tokens=16,
        )
        return out.choices[0].message.content or ""

    assert reply(7) == reply(7)
    assert len({reply(s) for s in (1, 2, 3)}) > 1


CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "languages": {
            "type": "array",
            "items": {"enum": ["English", "French", "German", "Spanish"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "languages"],
}


def test_the_embedded_model_answers_in_json(
    client: openai.OpenAI, embedded_node: NodeProcess
) -> None:
    ask = [{"role": "user", "content": "Invent a contact: name, age, email, languages."}]
    for temperature in (0.0, 0.8):
        reply = client.chat.completions.create(
            model=embedded_node.model_id,
            messages=ask,  # type: ignore[arg-type]
            temperature=temperature,
            seed=5,
            max_tokens=120,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "contact", "schema": CONTACT, "strict": True},
            },
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), CONTACT)
    loose = client.chat.completions.create(
        model=embedded_node.model_id,
        messages=[
            {
                "role": "user",
                "content": "Describe a cat as a JSON object with the keys name, color and age.",
            }
        ],
        temperature=0,
        max_tokens=150,
        response_format={"type": "json_object"},
    )
    assert loose.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(loose.choices[0].message.content or ""), dict)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


def test_the_embedded_model_calls_a_tool_and_answers_from_its_result(
    client: openai.OpenAI, embedded_node: NodeProcess
) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    call_reply = client.chat.completions.create(
        model=embedded_node.model_id,
        messages=ask,  # type: ignore[arg-type]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        # One call: left free to add calls, a 135M model repeats its call until max_tokens.
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    choice = call_reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]
    history = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *(
            {"role": "tool", "tool_call_id": c.id, "content": '{"temperature_c": 18}'}
            for c in calls
        ),
    ]
    answer = client.chat.completions.create(
        model=embedded_node.model_id,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content


def test_models_and_health(client: openai.OpenAI, embedded_node: NodeProcess) -> None:
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [embedded_node.model_id]
    swarm = models.data[0].model_extra["swarm"]
    assert swarm["complete"] is True and swarm["coverage"] == [[0, 30]]
    health = embedded_node.health()
    assert health["status"] == "ok"
    [held] = health["models"]  # type: ignore[misc]
    assert {k: held[k] for k in ("id", "layers", "num_layers", "weights", "dtype", "backend")} == {
        "id": embedded_node.model_id,
        "layers": [0, 30],
        "num_layers": 30,
        "weights": "int4",  # the GGUF's own Q4_1, held as it is
        "dtype": "bfloat16",
        "backend": "engine",
    }
    # swarmd's int4/int8 kernels where this CPU and machine run them, else torch's
    runnable = native.cpu_has_bf16_dot() and shutil.which("g++") is not None
    assert held["kernels"] == ("swarmd" if runnable else "torch")
    assert held["attention"] == ("swarmd" if runnable else "torch")
    # Per model, and in all: one model held, so the two agree.
    assert held["kv_budget_tokens"] == health["kv_budget_tokens"] > 0
    assert held["sessions"] == health["sessions"]
    assert str(health["peer_id"]).startswith("12D3KooW")


def _open_stream(url: str, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def test_client_disconnect_stops_generation(embedded_node: NodeProcess) -> None:
    import json

    body = json.dumps(
        {
            "model": embedded_node.model_id,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "temperature": 0,
            "max_tokens": 400,
            "stream": True,
        }
    ).encode()
    sock = _open_stream(embedded_node.url, body)
    received = b""
    while received.count(b"data: ") < 6:
        data = sock.recv(65536)
        assert data, "stream closed early"
        received += data
    request_id = re.search(rb"x-swarm-request-id: ([0-9a-f-]+)", received, re.I)
    assert request_id is not None
    sock.close()
    closed_at = time.monotonic()

    def idle() -> bool:
        health = embedded_node.health()
        return health["in_flight"] == 0 and health["sessions"] == 0

    assert wait_until(idle, 2.0), embedded_node.health()
    assert time.monotonic() - closed_at < 2.0
    rid = request_id.group(1).decode()
    line = next(
        (ln for ln in embedded_node.log_text().splitlines() if f"request_id={rid}" in ln), ""
    )
    assert "outcome=error error_type=ClientDisconnectedError" in line
    tokens = int(re.search(r" tokens=(\d+)", line).group(1))  # type: ignore[union-attr]
    # The client saw one event per token after the role chunk; the node may finish the step
    # in flight when the socket closes, and must stop there.
    seen_tokens = received.count(b"data: ") - 1
    assert tokens <= seen_tokens + 2, (tokens, seen_tokens, line)


def test_health_stays_fast_during_a_long_prefill(embedded_node: NodeProcess) -> None:
    """Torch runs on its worker: /health answers while a long prompt is prefilled."""
    client = openai.OpenAI(base_url=f"{embedded_node.url}/v1", api_key="unused", max_retries=0)
    long_prompt = "Summarise this text. " + "The quick brown fox jumps over the lazy dog. " * 150
    done = threading.Event()

    def generate() -> None:
        try:
            client.chat.completions.create(
                model=embedded_node.model_id,
                messages=[{"role": "user", "content": long_prompt}],
                temperature=0,
                max_tokens=64,
            )
        finally:
            done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        assert wait_until(lambda: embedded_node.health()["in_flight"] == 1, 10)
        latencies = []
        while not done.is_set() and len(latencies) < 40:
            started = time.perf_counter()
            with urllib.request.urlopen(f"{embedded_node.url}/health", timeout=5) as response:
                response.read()
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    finally:
        worker.join(timeout=120)
        client.close()
    assert len(latencies) >= 10, "the generation ended before /health could be sampled"
    # A forward step on the event loop would stall /health for a whole prefill chunk
    # (hundreds of ms); the worker keeps it at a few ms.
    assert statistics.median(latencies) < 0.05, latencies
    assert max(latencies) < 0.5, latencies


def test_swarmd_chat_streams_to_the_terminal(
    client: openai.OpenAI, embedded_node: NodeProcess
) -> None:
    prompt = "Say hello in one short sentence."
    expected = client.chat.completions.create(
        model=embedded_node.model_id,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=24,
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmd",
            "chat",
            prompt,
            "--url",
            embedded_node.url,
            "--temperature",
            "0",
            "--max-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip() == (expected.choices[0].message.content or "").strip()
    assert "local via" in result.stderr


def test_concurrent_sessions_each_get_their_solo_reply(
    client: openai.OpenAI, embedded_node: NodeProcess
) -> None:
    """Sessions interleave on the worker, each with its own KV cache: a greedy reply is the
    same alone or beside others."""
    prompts = ["Name a fruit.", "What is 2 + 3?", "Say hello in French.", "Describe rain."]

    def reply(prompt: str) -> list[int]:
        out = client.chat.completions.create(
            model=embedded_node.model_id,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=24,
            extra_body={"return_token_ids": True},
        )
        return list(out.choices[0].model_extra["token_ids"])

    alone = [reply(p) for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        together = list(pool.map(reply, prompts))
    assert together == alone
    assert len({tuple(t) for t in alone}) == len(prompts)
