"""Tool calls with the official `openai` client against a node in this process on a tiny
random model: what it calls, and with what, is the constraint's doing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.integration.conftest import NodeFactory

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["city", "unit", "days"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
BAD_PARAMETERS = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "strung"}}},
    },
}


@pytest.fixture
async def api(make_node: NodeFactory) -> AsyncIterator[openai.AsyncOpenAI]:
    node = await make_node()
    base = f"{node.api_url}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client:
        yield client


def ask(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 200, **fields}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_required_gives_calls_whose_arguments_validate_then_an_answer(
    api: openai.AsyncOpenAI, temperature: float
) -> None:
    # One call: noise left free to add calls may never stop adding them.
    reply = await api.chat.completions.create(
        **ask(tool_choice="required", parallel_tool_calls=False, temperature=temperature, seed=4)
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    history: list[dict[str, Any]] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump() for c in calls],
        },
        *({"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21}'} for c in calls),
    ]
    answer = await api.chat.completions.create(
        **ask(messages=history, tool_choice="none", temperature=0, max_tokens=8)
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")


async def test_a_named_function_is_the_one_called(api: openai.AsyncOpenAI) -> None:
    reply = await api.chat.completions.create(
        **ask(tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=1)
    )
    calls = reply.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"]  # one call: named means one
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME)


async def test_a_streamed_call_accumulates_to_the_whole_ones_arguments(
    api: openai.AsyncOpenAI,
) -> None:
    asked = ask(tool_choice="required", parallel_tool_calls=False, temperature=0.8, seed=9)
    whole = await api.chat.completions.create(**asked)
    want = [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []
    ]
    stream = await api.chat.completions.create(**asked, stream=True)
    calls: dict[int, dict[str, str]] = {}
    pieces = 0
    finish = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # the first delta names id and function
                assert delta.id and delta.function and delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None
            piece = (delta.function and delta.function.arguments) or ""
            calls[delta.index]["arguments"] += piece
            pieces += bool(piece)
    got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert got == want and finish == "tool_calls"
    # Constrained to calls: the arguments stream as they are written, not in one piece.
    assert pieces > 1


FORECAST = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["summary", "days"],
}
FORMATS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (
        {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}},
        FORECAST,
    ),
    ({"type": "json_object"}, {"type": "object"}),
]


@pytest.mark.parametrize(("response_format", "schema"), FORMATS)
async def test_auto_with_a_json_format_calls_or_answers_in_that_format(
    api: openai.AsyncOpenAI, response_format: dict[str, Any], schema: dict[str, Any]
) -> None:
    """Tools and a JSON response_format together (the Agents SDK and Vercel's AI SDK send
    both): every reply is calls whose arguments validate, or content that validates
    against the format; eight at once, each the reply it gets alone."""

    async def one(seed: int) -> tuple[str | None, list[tuple[str, str]]]:
        reply = await api.chat.completions.create(
            **ask(response_format=response_format, temperature=1.0, seed=seed, max_tokens=120)
        )
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if calls:
            assert choice.finish_reason == "tool_calls" and not choice.message.content
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
        else:  # cut by max_tokens: what there is is the start of the format's JSON
            assert choice.finish_reason == "length"
            assert (choice.message.content or "").lstrip().startswith("{")
        return choice.message.content, [(c.function.name, c.function.arguments) for c in calls]

    together = await asyncio.gather(*(one(seed) for seed in range(8)))
    assert [await one(seed) for seed in (0, 5)] == [together[0], together[5]]
    assert any(calls for _, calls in together) or any(text for text, _ in together)


async def test_required_with_a_json_format_only_calls(api: openai.AsyncOpenAI) -> None:
    reply = await api.chat.completions.create(
        **ask(
            tool_choice="required",
            parallel_tool_calls=False,
            response_format={"type": "json_object"},
            seed=2,
        )
    )
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 1 and reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


async def test_none_never_calls(api: openai.AsyncOpenAI) -> None:
    for seed in range(3):
        reply = await api.chat.completions.create(
            **ask(tool_choice="none", temperature=1.0, seed=seed, max_tokens=30)
        )
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].finish_reason in ("stop", "length")


async def test_text_beside_tools_is_the_same_streamed_or_not(api: openai.AsyncOpenAI) -> None:
    """A reply that calls nothing and ends in whitespace (token 216 is " " for this
    tokenizer, pushed to come every time): the stream holds whitespace back (a call may
    follow it) and drops what is left at the end, so the whole reply says what the
    stream said. Before 0.5.2 the whole reply kept the raw text, whitespace and all."""
    for bias in ({"26843": 100}, {"216": 100}):  # "Hi" each time; " " each time
        fields = ask(max_tokens=3, temperature=0, logit_bias=bias)
        whole = await api.chat.completions.create(**fields)
        streamed = ""
        async for chunk in await api.chat.completions.create(**fields, stream=True):
            for choice in chunk.choices:
                streamed += choice.delta.content or ""
        assert (whole.choices[0].message.content or "") == streamed
        assert streamed == ("HiHiHi" if "26843" in bias else "")


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
async def test_a_tool_choice_that_needs_tools_without_them_is_a_400(
    api: openai.AsyncOpenAI, choice: Any
) -> None:
    """Before 0.5.2 the choice went unheeded and the reply was text."""
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=4, tool_choice=choice
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "tool_choice", error
    for harmless in ("auto", "none"):  # nothing to choose from: no effect
        reply = await api.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=4, tool_choice=harmless
        )
        assert reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "answer",
                        "schema": {"type": "string", "pattern": "(("},
                    },
                }
            },
            "response_format",
        ),
        (
            {"messages": [*ASK, {"role": "tool", "content": "x"}]},
            "messages[1].tool_call_id",
        ),
        # A parameter schema no call could be held to, whether calls are forced or not.
        *(
            ({"tools": [TOOLS[0], BAD_PARAMETERS], **choice}, "tools[1].function.parameters")
            for choice in ({}, {"tool_choice": "required"}, {"tool_choice": "none"})
        ),
        (
            {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
            "messages[1]",
        ),
        (
            {"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": "yes"}}]},
            "tools[0].function.strict",
        ),
    ],
)
async def test_bad_tool_requests_are_400s_naming_the_parameter(
    api: openai.AsyncOpenAI, change: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(**{**ask(), **change})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert len(error["message"]) < 400 and "%json" not in error["message"], error


async def test_parameters_that_cannot_all_be_enforced_are_a_400_only_when_strict(
    api: openai.AsyncOpenAI,
) -> None:
    # A set of days (pydantic writes uniqueItems for one): llguidance cannot hold the
    # arguments to uniqueItems; a function that is not strict gets the rest enforced.
    days = {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3}
    parameters = {
        "type": "object",
        "properties": {"days": {**days, "uniqueItems": True}},
        "required": ["days"],
    }
    function = {"name": "plan", "parameters": parameters}
    enforced = {**parameters, "properties": {"days": days}, "additionalProperties": False}
    calls = await asyncio.gather(
        *(
            api.chat.completions.create(
                **ask(
                    tools=[{"type": "function", "function": function}],
                    tool_choice="required",
                    parallel_tool_calls=False,
                    temperature=1.0,
                    seed=seed,
                )
            )
            for seed in range(3)
        )
    )
    for reply in calls:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), enforced)
    strict = {"type": "function", "function": {**function, "strict": True}}
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(**ask(tools=[strict], tool_choice="auto"))
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "tools[0].function.parameters", error
