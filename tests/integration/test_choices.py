"""`n` choices per request, with the official `openai` client against a node in this process
on a tiny random model: every choice is its own seeded draw, the prompt is prefilled once
(the other choices copy its caches), and streams carry each choice under its index."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest

from swarmd.model.sampling import choice_seed
from swarmd.node import Node
from tests.integration.conftest import NodeFactory, poll

MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a helpful assistant who answers briefly."},
    {"role": "user", "content": "Name three colours of the rainbow, please."},
]


@pytest.fixture
async def node(make_node: NodeFactory) -> Node:
    node: Node = await make_node()
    return node


@pytest.fixture
async def api(node: Node) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{node.api_url}/v1", api_key="none", max_retries=0
    ) as client:
        yield client


async def test_n_choices_are_seeded_draws_and_choice_0_is_the_reply_alone(
    api: openai.AsyncOpenAI, node: Node
) -> None:
    common: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "temperature": 1.0,
        "max_tokens": 12,
        "seed": 1234,
    }
    alone = await api.chat.completions.create(**common)
    hits_before = node.runtime.prefix_hits
    reused_before = node.runtime.prefix_reused_tokens
    many = await api.chat.completions.create(n=4, **common)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in many.choices]
    assert texts[0] == alone.choices[0].message.content
    assert len(set(texts)) == 4, texts  # a noise model: four seeds, four replies
    assert all(c.finish_reason == "length" for c in many.choices)
    usage = many.usage
    assert usage is not None and alone.usage is not None
    assert usage.prompt_tokens == alone.usage.prompt_tokens  # counted once
    assert usage.completion_tokens == 4 * 12
    # The three other choices copied choice 0's prefilled prompt (all but its last token).
    assert node.runtime.prefix_hits - hits_before == 3
    assert node.runtime.prefix_reused_tokens - reused_before == 3 * (usage.prompt_tokens - 1)
    again = await api.chat.completions.create(n=4, **common)
    assert [c.message.content for c in again.choices] == texts  # same seed, same choices
    # A copied prompt draws from the very numbers of a fresh prefill: choice 2 is the
    # reply a request alone gets with choice 2's seed.
    third = await api.chat.completions.create(**{**common, "seed": choice_seed(1234, 2)})
    assert third.choices[0].message.content == texts[2]


async def test_n_streamed_gives_each_choice_its_whole_reply(api: openai.AsyncOpenAI) -> None:
    common: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "temperature": 0.9,
        "max_tokens": 10,
        "seed": 77,
        "n": 3,
    }
    whole = await api.chat.completions.create(**common)
    stream = await api.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **common
    )
    texts = ["", "", ""]
    roles: list[int] = []
    finishes: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in finishes  # nothing after a choice's finish
            if choice.delta.role == "assistant":
                roles.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert sorted(roles) == [0, 1, 2]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 30


async def test_n_with_a_schema_gives_valid_choices_and_logprobs_each(
    api: openai.AsyncOpenAI,
) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
        "required": ["colour", "n"],
    }
    reply = await api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        temperature=1.0,
        max_tokens=40,
        seed=5,
        n=3,
        logprobs=True,
        top_logprobs=2,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": schema, "strict": True},
        },
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)


async def test_completions_take_n_too(api: openai.AsyncOpenAI) -> None:
    reply = await api.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=9, n=2
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage is not None and reply.usage.completion_tokens == 12


async def test_requests_with_n_at_once_each_get_their_own_choices(
    api: openai.AsyncOpenAI,
) -> None:
    async def ask(seed: int, n: int) -> list[str]:
        reply = await api.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=8, seed=seed, n=n
        )
        return [c.message.content or "" for c in reply.choices]

    alone = [await ask(seed, n) for seed, n in ((1, 3), (2, 2), (3, 1))]
    together = await asyncio.gather(ask(1, 3), ask(2, 2), ask(3, 1))
    assert list(together) == alone


@pytest.mark.parametrize("n", [0, 9, -1])
async def test_n_out_of_range_is_a_400_naming_n(api: openai.AsyncOpenAI, n: int) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, n=n)
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body.get("param") == "n"


async def test_a_client_that_leaves_an_n_stream_frees_every_choice(
    api: openai.AsyncOpenAI, node: Node
) -> None:
    stream = await api.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=400, n=4, stream=True
    )
    seen: set[int] = set()
    async for chunk in stream:
        seen.update(c.index for c in chunk.choices if c.delta.content)
        if len(seen) >= 2:
            break
    await stream.close()
    # The sessions close on the worker before the request's own accounting ends.
    assert await poll(
        lambda: node.runtime.session_count == 0 and node.coordinator.in_flight == 0, 30.0
    )
    reply = await api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, n=2)
    assert len(reply.choices) == 2  # and the node serves on


# --- several prompts in one /v1/completions request ---------------------------------------

PROMPTS = ["Once upon a time", "The quick brown fox", "In a hole in the ground"]


async def test_several_prompts_give_each_prompts_choices_as_it_alone_gets_them(
    api: openai.AsyncOpenAI,
) -> None:
    common: dict[str, Any] = {"model": "tiny", "max_tokens": 6, "temperature": 1.0, "seed": 77}
    alone = [await api.completions.create(prompt=p, n=2, **common) for p in PROMPTS]
    many = await api.completions.create(prompt=PROMPTS, n=2, **common)
    # Prompt p's choice j is index p * n + j, and is the draw that prompt alone gets.
    assert [c.index for c in many.choices] == list(range(6))
    assert [c.text for c in many.choices] == [c.text for a in alone for c in a.choices]
    texts = [c.text for c in many.choices]
    assert all(texts[2 * p] != texts[2 * p + 1] for p in range(3))  # each prompt: two seeds
    assert many.usage is not None
    assert many.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert many.usage.completion_tokens == 6 * 6
    # Token lists are prompts too, and say the same.
    tokenized = await api.completions.create(
        prompt=[[1, 2, 3, 4], [5, 6, 7]], n=1, extra_body={"return_token_ids": True}, **common
    )
    firsts = [await api.completions.create(prompt=p, **common) for p in ([1, 2, 3, 4], [5, 6, 7])]
    assert [c.text for c in tokenized.choices] == [f.choices[0].text for f in firsts]
    extra = [c.model_extra or {} for c in tokenized.choices]
    assert [e.get("prompt_token_ids") for e in extra] == [[1, 2, 3, 4], [5, 6, 7]]


async def test_several_prompts_streamed_give_each_choice_its_whole_reply(
    api: openai.AsyncOpenAI,
) -> None:
    common: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0.0}
    whole = await api.completions.create(prompt=PROMPTS, **common)
    stream = await api.completions.create(prompt=PROMPTS, stream=True, **common)
    texts = ["", "", ""]
    finishes: list[int] = []
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finishes.append(c.index)
    assert texts == [c.text for c in whole.choices]
    assert sorted(finishes) == [0, 1, 2]


async def test_equal_prompts_without_a_seed_are_separate_samples(
    api: openai.AsyncOpenAI,
) -> None:
    reply = await api.completions.create(
        model="tiny", prompt=["Once upon a time"] * 4, max_tokens=8, temperature=1.0
    )
    assert len({c.text for c in reply.choices}) == 4  # a noise model: four seeds


@pytest.mark.parametrize(
    ("prompt", "n", "param"),
    [
        (["x"] * 33, 1, "prompt"),  # more than 32 replies
        (["x"] * 17, 2, "n"),  # 34 replies
        ([[1, 2], [10**9]], 1, "prompt[1]"),  # a token id past the vocabulary
        ([[1, 2], []], 1, "prompt[1]"),  # an empty token list
        (["a", ""], 1, "prompt[1]"),  # an empty text
        (["a", [1]], 1, "prompt"),  # text and tokens mixed
    ],
)
async def test_bad_prompt_lists_are_a_400_naming_the_prompt(
    api: openai.AsyncOpenAI, prompt: Any, n: int, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await api.completions.create(model="tiny", prompt=prompt, n=n, max_tokens=2)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
