"""What OpenAI clients send back and newer clients send at all, with the official `openai`
client against a node in this process on a tiny random model: a reply's message dumped
back into the history, refusals, the parameters newer SDKs know, `null` for optional
fields, `top_p: 0`, and each choice's own `text_offset`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tests.integration.conftest import NodeFactory


@pytest.fixture
async def api(make_node: NodeFactory) -> AsyncIterator[openai.AsyncOpenAI]:
    node = await make_node()
    async with openai.AsyncOpenAI(
        base_url=f"{node.api_url}/v1", api_key="none", max_retries=0
    ) as client:
        yield client


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def test_a_reply_dumped_back_into_the_history_is_a_turn(api: openai.AsyncOpenAI) -> None:
    """`messages.append(reply.choices[0].message.model_dump())`: the SDK's dump carries
    refusal, annotations, audio and function_call as null; several conversations at once."""

    async def converse(opening: str) -> list[Any]:
        history: list[Any] = [user(opening)]
        first = await api.chat.completions.create(
            model="tiny", messages=history, max_tokens=4, temperature=0
        )
        dumped = first.choices[0].message.model_dump()
        assert {"refusal", "audio", "function_call"} <= set(dumped)
        history += [dumped, user("And then?")]
        second = await api.chat.completions.create(
            model="tiny", messages=history, max_tokens=4, temperature=0
        )
        assert second.usage is not None and first.usage is not None
        assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the turn was read
        return history

    await asyncio.gather(*(converse(f"Hi {i}") for i in range(4)))


async def test_a_refusal_in_the_history_is_what_the_assistant_said(
    api: openai.AsyncOpenAI,
) -> None:
    said = "I cannot help with that."
    as_field = [user("Hi"), {"role": "assistant", "content": None, "refusal": said}]
    as_part = [
        user("Hi"),
        {"role": "assistant", "content": [{"type": "refusal", "refusal": said}]},
    ]
    beside_empty = [user("Hi"), {"role": "assistant", "content": "", "refusal": said}]
    as_text = [user("Hi"), {"role": "assistant", "content": said}]
    prompts = []
    for history in (as_field, as_part, beside_empty, as_text):
        reply = await api.chat.completions.create(
            model="tiny", messages=[*history, user("Why?")], max_tokens=1, temperature=0
        )
        assert reply.usage is not None
        prompts.append(reply.usage.prompt_tokens)
    assert prompts[0] == prompts[1] == prompts[2] == prompts[3]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "assistant", "content": "x", "audio": {"id": "a1"}}, "messages[1].audio"),
        (
            {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": ""}},
            "messages[1].function_call",
        ),
        ({"role": "user", "content": "x", "refusal": "no"}, "messages[1].refusal"),
        (
            {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]},
            "messages[1].content[0].type",
        ),
        (
            {"role": "assistant", "content": [{"type": "refusal"}]},
            "messages[1].content[0]",
        ),
    ],
)
async def test_what_a_history_turn_cannot_carry_is_a_400_naming_it(
    api: openai.AsyncOpenAI, message: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(
            model="tiny", messages=[user("Hi"), message, user("Go")], max_tokens=1
        )
    assert caught.value.param == param  # type: ignore[attr-defined]


async def test_newer_parameters_and_nulls_are_accepted(api: openai.AsyncOpenAI) -> None:
    asked: dict[str, Any] = {
        "model": "tiny",
        "messages": [user("Hi")],
        "max_tokens": 2,
        "temperature": 0,
        "safety_identifier": "someone",
        "prompt_cache_key": "conversation-1",
        "prompt_cache_retention": "24h",
        "verbosity": "low",
        "service_tier": "fast",
        "reasoning_effort": "xhigh",
        "extra_body": {"return_token_ids": None},
    }
    reply = await api.chat.completions.create(**asked)
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    chunks = [
        chunk
        async for chunk in await api.chat.completions.create(
            **asked,
            stream=True,
            stream_options={"include_usage": None, "include_obfuscation": True},
        )
    ]
    assert all(chunk.usage is None for chunk in chunks)  # null: the default, no usage chunk
    text = await api.completions.create(
        model="tiny", prompt="Once", max_tokens=2, temperature=0, extra_body={"echo": None}
    )
    assert text.usage is not None and text.usage.completion_tokens == 2


async def test_top_p_0_draws_the_likeliest_token(api: openai.AsyncOpenAI) -> None:
    async def ask(**sampling: Any) -> str | None:
        reply = await api.chat.completions.create(
            model="tiny", messages=[user("Count")], max_tokens=12, **sampling
        )
        return reply.choices[0].message.content

    greedy = await ask(temperature=0)
    drawn = await asyncio.gather(*(ask(temperature=1.5, top_p=0, seed=s) for s in range(3)))
    assert drawn == [greedy] * 3


@pytest.mark.parametrize("stream", [False, True])
async def test_each_choice_counts_its_own_text_offsets(
    api: openai.AsyncOpenAI, stream: bool
) -> None:
    asked: dict[str, Any] = {
        "model": "tiny",
        "prompt": ["Once", "Twice"],
        "n": 2,
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": 1,
    }
    tokens: dict[int, list[str]] = {}
    offsets: dict[int, list[int]] = {}
    if stream:
        async for chunk in await api.completions.create(**asked, stream=True):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens or [])
                    offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset or [])
    else:
        reply = await api.completions.create(**asked)
        for choice in reply.choices:
            assert choice.logprobs is not None
            tokens[choice.index] = list(choice.logprobs.tokens or [])
            offsets[choice.index] = list(choice.logprobs.text_offset or [])
    assert sorted(tokens) == [0, 1, 2, 3]
    for index, seen in tokens.items():
        starts = [sum(len(t) for t in seen[:i]) for i in range(len(seen))]
        assert offsets[index] == starts, index
