"""Structured outputs, logprobs, seeds and the accepted fields, with the official `openai`
client against a node in this process on a tiny random model: the model is noise, so
every valid reply is the constraint's doing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from tests.integration.conftest import NodeFactory


def small_int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city", "days"],
    },
    {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"}},
        "required": ["unit", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -50, "maximum": 50},
                    "y": {"type": "integer", "minimum": -50, "maximum": 50},
                },
                "required": ["x", "y"],
            },
            "label": {"type": ["string", "null"], "maxLength": 8},
        },
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "items": {"enum": ["up", "down", "left", "right"]},
                "maxItems": 4,
            },
            "done": {"type": "boolean"},
        },
        "required": ["steps", "done"],
    },
    {
        "type": "object",
        "properties": {
            "price": {"type": "integer", "minimum": 0, "maximum": 100},
            "currency": {"enum": ["EUR", "USD"]},
        },
        "required": ["price", "currency"],
    },
    {  # only optional keys
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 5}, "b": small_int(0, 9)},
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": small_int(1, 99), "ok": {"type": "boolean"}},
                    "required": ["id"],
                },
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
    {  # three levels deep
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": small_int(0, 5)},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "x": small_int(-9, 9)},
        "required": ["kind", "x"],
    },
    {
        "type": "object",
        "properties": {"value": {"anyOf": [small_int(0, 9), {"type": "string", "maxLength": 4}]}},
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {
            "rgb": {"type": "array", "items": small_int(0, 255), "minItems": 3, "maxItems": 3}
        },
        "required": ["rgb"],
    },
    {  # an array at the top
        "type": "array",
        "items": small_int(0, 9),
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {"flag": {"type": "boolean"}, "note": {"type": "null"}},
        "required": ["flag", "note"],
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "day": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        },
        "required": ["code", "day"],
    },
    {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": small_int(0, 9), "y": small_int(0, 9)},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
        "required": ["from", "to"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": small_int(0, 9),
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {
            "shape": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "circle"}, "r": small_int(1, 9)},
                        "required": ["kind", "r"],
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "square"}, "side": small_int(1, 9)},
                        "required": ["kind", "side"],
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    {
        "type": "object",
        "properties": {
            "word": {"type": "string", "minLength": 3, "maxLength": 6},
            "count": small_int(10, 20),
        },
        "required": ["word", "count"],
    },
    {  # an optional nested object next to a bounded array
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
            "meta": {"type": "object", "properties": {"v": small_int(1, 3)}},
        },
        "required": ["tags"],
    },
]


@pytest.fixture
async def api(make_node: NodeFactory) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai client of a fresh node (closed after the test)."""
    node = await make_node()
    base = f"{node.api_url}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client:
        client.node = node  # type: ignore[attr-defined]
        yield client


def messages(text: str = "Answer in JSON.") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def sampled(
    api: openai.AsyncOpenAI, schema: dict[str, Any], seed: int, strict: bool | None = True
) -> Awaitable[Any]:
    """A sampled reply held to `schema` (`strict` None: the key left out)."""
    json_schema: dict[str, Any] = {"name": "s", "schema": schema}
    if strict is not None:
        json_schema["strict"] = strict
    return api.chat.completions.create(
        model="tiny",
        messages=messages(),  # type: ignore[arg-type]
        temperature=1.0,
        seed=seed,
        max_tokens=200,
        response_format={"type": "json_schema", "json_schema": json_schema},  # type: ignore[typeddict-item]
    )


def assert_meets(reply: Any, schema: dict[str, Any]) -> None:
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_every_schema_gives_a_reply_that_validates(
    api: openai.AsyncOpenAI, temperature: float
) -> None:
    for i, schema in enumerate(SCHEMAS):
        reply = await api.chat.completions.create(
            model="tiny",
            messages=messages(),  # type: ignore[arg-type]
            temperature=temperature,
            seed=i,
            max_tokens=200,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


async def test_fractional_numbers_validate_in_sampled_replies(api: openai.AsyncOpenAI) -> None:
    """A number's fraction has no length bound in a grammar: greedy noise writes digits to
    `max_tokens` (as it would a free string), but a sampled reply ends and validates."""
    schema = {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "delta": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1},
        },
        "required": ["price", "delta"],
    }
    for seed in range(4):
        assert_meets(await sampled(api, schema, seed), schema)


async def test_json_object_gives_an_object_and_the_stream_the_same(api: openai.AsyncOpenAI) -> None:
    asked: dict[str, Any] = {
        "model": "tiny",
        "messages": messages(),
        "temperature": 0.8,
        "seed": 11,
        "max_tokens": 200,
        "response_format": {"type": "json_object"},
    }
    whole = await api.chat.completions.create(**asked)
    text = whole.choices[0].message.content or ""
    # Noise may fill a free string up to max_tokens (so would OpenAI's models: "length",
    # and the JSON cut); the embedded model's e2e test closes its objects.
    assert text.startswith("{")
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert whole.choices[0].finish_reason == "length"
    stream = await api.chat.completions.create(**asked, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == whole.choices[0].message.content  # seeded: the same reply


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")
    days: int = pydantic.Field(ge=1, le=7)


async def test_parse_with_a_pydantic_model_returns_the_object(api: openai.AsyncOpenAI) -> None:
    reply = await api.chat.completions.parse(
        model="tiny",
        messages=messages("Weather?"),  # type: ignore[arg-type]
        response_format=Weather,
        temperature=0,
        max_tokens=200,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Weather)
    assert 1 <= parsed.days <= 7 and parsed.unit in ("celsius", "fahrenheit")


async def test_logprobs_whole_and_streamed(api: openai.AsyncOpenAI) -> None:
    asked: dict[str, Any] = {
        "model": "tiny",
        "messages": messages("Hi"),
        "temperature": 0.9,
        "seed": 3,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 5,
    }
    whole = await api.chat.completions.create(**asked)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) >= 1
    assert len(content) <= (whole.usage.completion_tokens if whole.usage else 0)
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 5
        assert all(t.logprob <= 0.0 for t in entry.top_logprobs)
        assert bytes(entry.bytes or []).decode("utf-8", errors="replace") == entry.token
    text = "".join(bytes(e.bytes or []).decode("utf-8", errors="replace") for e in content)
    assert text == whole.choices[0].message.content
    stream = await api.chat.completions.create(**asked, stream=True)
    streamed = [
        e
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content or []
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    text_reply = await api.completions.create(
        model="tiny", prompt="Once", max_tokens=6, temperature=0, logprobs=2
    )
    legacy = text_reply.choices[0].logprobs
    assert legacy is not None and legacy.tokens and legacy.token_logprobs and legacy.top_logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs)
    assert all(len(top) <= 2 for top in legacy.top_logprobs)
    assert legacy.text_offset is not None and legacy.text_offset[0] == 0


async def test_a_seeded_sampled_reply_is_the_same_alone_and_batched(
    api: openai.AsyncOpenAI,
) -> None:

    async def ask(seed: int) -> list[int]:
        reply = await api.chat.completions.create(
            model="tiny",
            messages=messages("Tell me a story."),  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=24,
            extra_body={"return_token_ids": True},
        )
        return list(reply.choices[0].model_extra["token_ids"])  # type: ignore[index]

    alone = await ask(42)
    together = await asyncio.gather(ask(42), ask(1), ask(2), ask(42))
    assert together[0] == alone and together[3] == alone
    assert together[1] != alone  # another seed, another reply (the model is noise)
    runtime = api.node.runtime  # type: ignore[attr-defined]
    assert runtime.batched_rows > runtime.batches  # they did share forwards


async def test_the_harmless_fields_are_accepted(api: openai.AsyncOpenAI) -> None:
    reply = await api.chat.completions.create(
        model="tiny",
        messages=messages("Hi"),  # type: ignore[arg-type]
        max_tokens=3,
        user="someone",
        store=False,
        metadata={"project": "tests"},
        service_tier="auto",
        reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"custom": 1}},
    )
    assert reply.choices[0].message.content is not None


async def test_grammars_logprobs_and_tools_at_once_each_get_their_reply_alone(
    api: openai.AsyncOpenAI,
) -> None:
    """Several sessions in one batch, each with its own grammar state (or none), logprobs
    or tools: each reply is the one it gets alone."""
    tool = {
        "type": "function",
        "function": {"name": "pick", "parameters": SCHEMAS[1]},
    }
    bodies: list[dict[str, Any]] = [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]},
            }
        }
        for i in range(3)
    ]
    bodies += [
        {"logprobs": True, "top_logprobs": 2},
        {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False},
        {},
    ]

    async def ask(extra: dict[str, Any]) -> tuple[str | None, str]:
        reply = await api.chat.completions.create(
            model="tiny",
            messages=messages(),  # type: ignore[arg-type]
            temperature=1.0,
            seed=21,
            max_tokens=120,
            **extra,
        )
        message = reply.choices[0].message
        calls = [c.function.arguments for c in message.tool_calls or []]
        return message.content, json.dumps(calls)

    alone = [await ask(extra) for extra in bodies]
    together = await asyncio.gather(*(ask(extra) for extra in bodies))
    assert list(together) == alone
    runtime = api.node.runtime  # type: ignore[attr-defined]
    assert runtime.batched_rows > runtime.batches


# uniqueItems and not: JSON schema llguidance cannot hold a reply to. The rest of it can.
UNENFORCED = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "maxItems": 3,
            "uniqueItems": True,
        },
        "n": {"type": "integer", "minimum": 1, "maximum": 5, "not": {"const": 3}},
    },
    "required": ["tags", "n"],
}
ENFORCED = {  # what is left of it
    **UNENFORCED,
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "n": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "additionalProperties": False,
}


async def test_what_cannot_be_enforced_is_dropped_unless_the_schema_is_strict(
    api: openai.AsyncOpenAI,
) -> None:
    # Several at once, as OpenAI's default (strict absent) and said outright.
    replies = await asyncio.gather(
        *(sampled(api, UNENFORCED, seed, (None, False)[seed % 2]) for seed in range(4))
    )
    for reply in replies:
        assert_meets(reply, ENFORCED)
    with pytest.raises(openai.BadRequestError) as caught:
        await sampled(api, UNENFORCED, 0, True)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "response_format", error
    assert "uniqueItems" in error["message"] or "not" in error["message"], error


async def test_int64_double_and_bytes_fields_are_kept_strictly(api: openai.AsyncOpenAI) -> None:
    # As generators write a long, a double and bytes: llguidance makes no grammar of those
    # bounds, or of format "binary", as they are; in the form it enforces (the bounds
    # narrowed, the format an annotation) every reply still meets the schema.
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
            "x": {"type": "number", "minimum": -1.7976931348623157e308, "maximum": 1e308},
            "raw": {"type": "string", "format": "binary", "maxLength": 12},
        },
        "required": ["id", "x", "raw"],
    }
    for reply in await asyncio.gather(*(sampled(api, schema, seed) for seed in range(3))):
        assert_meets(reply, schema)
