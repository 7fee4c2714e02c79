"""Tool calling, the pure part: family detection, the prompt given to the template, calls
parsed from a reply (whole and streamed, however split), and the request checks."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from swarmd.errors import InvalidRequestError
from swarmd.model import tool_calls as tc
from swarmd.model.chat_template import compile_template
from swarmd.model.grammar import (
    Constraint,
    GrammarSpec,
    ToolCallFormat,
    ToolFunction,
    Vocabulary,
    compile_grammar,
)
from swarmd.model.text import IncrementalDetokenizer, TextCodec

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
NAMES = {"get_weather", "get_time"}
FUNCTIONS = [ToolFunction("get_weather", WEATHER), ToolFunction("get_time", TIME)]
FORMATS = {
    family: tc.tool_call_format(family, FUNCTIONS) for family in ("hermes", "llama3", "mistral")
}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"C"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]
ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


def counter() -> Callable[[], str]:
    """Deterministic call ids (a parse and a stream of the same text get the same ones)."""
    n = iter(range(1_000_000))
    return lambda: f"call_{next(n)}"


# --- Families ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("snippet", "family"),
    [
        (None, "fallback"),
        ("", "fallback"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "fallback"),
        # Reads tools, in a format of its own: we render our prompt instead.
        ("{% if tools %}<|tool|>{{ tools | tojson }}<|/tool|>{% endif %}", "fallback"),
        ("{% if custom_tools %}<tool_call>{% endif %}", "fallback"),  # never reads `tools`
        ("{% if tools %}<tool_call>\n<function={{ t.name }}>{% endif %}", "fallback"),
        ("{% if tools %}[TOOL_CALLS]{{ c.name }}[ARGS]{% endif %}", "fallback"),
        ("{%- if tools %}<tools>{{ tools | tojson }}</tools><tool_call>{% endif %}", "hermes"),
        ("{% if tools is not none %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}", "mistral"),
        ("{% for t in tools %}{% endfor %}{{ '[TOOL_CALLS] [' }}", "mistral"),
        ("{% if tools is not none %}{{- 'Environment: ipython\\n' }}{% endif %}", "llama3"),
        ("{% if tools %}{{ '<|python_tag|>' + c.name }}{% endif %}", "llama3"),
        (
            "{{ '<|start_header_id|>' }}{% for t in tools %}{{ t | tojson }}{% endfor %}"
            "{{ '\"parameters\": ' }}",
            "llama3",
        ),
    ],
)
def test_family_from_template_text(snippet: str | None, family: str) -> None:
    assert tc.detect_family(snippet) == family


def test_the_embedded_model_has_no_tools_section(smollm_dir: Path) -> None:
    template = TextCodec.load(smollm_dir).chat_template
    assert template and "im_start" in template
    assert tc.detect_family(template) == "fallback"


def test_each_family_maps_to_grammar_presets() -> None:
    assert tc.tool_call_format("hermes", FUNCTIONS) == ToolCallFormat.hermes(FUNCTIONS)
    assert tc.tool_call_format("fallback", FUNCTIONS) == ToolCallFormat.hermes(FUNCTIONS)
    assert tc.tool_call_format("mistral", FUNCTIONS, False) == ToolCallFormat.mistral(
        FUNCTIONS, False
    )
    assert tc.tool_call_format("llama3", FUNCTIONS) == ToolCallFormat.llama3_json(FUNCTIONS)


# --- The prompt -------------------------------------------------------------------------


def render(source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    family = tc.detect_family(source)
    prompt = tc.render_tools_prompt(source, messages, tools, family)
    return str(
        compile_template(source).render(
            messages=prompt.messages, tools=prompt.tools, add_generation_prompt=True
        )
    )


def test_fallback_prompt_through_the_embedded_template(smollm_dir: Path) -> None:
    template = TextCodec.load(smollm_dir).chat_template
    assert template is not None
    text = render(template, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "SmolLM" not in text  # our system turn replaced the template's default one
    for tool in TOOLS:
        entry = {k: v for k, v in tool["function"].items()}
        assert json.dumps(entry) in text  # name, description, the whole schema
    assert '<tool_call>\n{"name": "<function-name>", "arguments":' in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_history_renders_calls_and_results(smollm_dir: Path) -> None:
    template = TextCodec.load(smollm_dir).chat_template
    assert template is not None
    system = {"role": "system", "content": "Be brief."}
    text = render(template, [system, *HISTORY], TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    calls = (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
    )
    results = (
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
        "<tool_response>\n14:05\n</tool_response><|im_end|>\n"
    )
    assert calls + results + "<|im_start|>assistant\n" in text


def test_a_history_call_is_the_text_the_parser_reads() -> None:
    """The fallback writes earlier calls as the Hermes format writes them (what the
    grammar makes the model produce), so the model sees its own calls as it made them."""
    prompt = tc.render_tools_prompt(None, HISTORY, TOOLS, "fallback")
    assistant = prompt.messages[2]
    assert assistant["role"] == "assistant"
    parsed = tc.parse_tool_calls(assistant["content"], FORMATS["hermes"], NAMES)
    assert parsed.content is None
    assert [(c.name, c.arguments_json) for c in parsed.calls] == [
        ("get_weather", '{"city":"Paris","unit":"C"}'),
        ("get_time", "{}"),
    ]


def test_fallback_without_a_system_role_goes_in_the_first_user_turn() -> None:
    gemma_like = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
        "supported') }}{% endif %}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
        "{{ m.content }}<end_of_turn>\n{% endfor %}"
    )
    prompt = tc.render_tools_prompt(
        gemma_like, [{"role": "user", "content": "Hi"}], TOOLS, "fallback"
    )
    assert [m["role"] for m in prompt.messages] == ["user"]
    assert prompt.messages[0]["content"].startswith("# Tools\n")
    assert prompt.messages[0]["content"].endswith("\n\nHi")
    text = compile_template(gemma_like).render(messages=prompt.messages)
    assert "get_weather" in text


def test_fallback_text_is_the_documented_one() -> None:
    text = tc.fallback_tools_prompt(TOOLS[1:])
    assert text == tc.FALLBACK_TOOLS_PROMPT.format(
        tools='{"name": "get_time", "parameters": ' + json.dumps(TIME) + "}"
    )
    assert "{{" not in text and "<tools>\n{" in text


# A template shaped like Qwen2.5's: `tojson` on the tools and on each call's arguments.
QWEN_LIKE = (
    "{% if tools %}<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% for c in m.tool_calls %}{% set c = c.function %}\n<tool_call>\n"
    '{"name": "{{ c.name }}", "arguments": {{ c.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
)


def test_native_templates_get_tools_and_arguments_as_dicts() -> None:
    prompt = tc.render_tools_prompt(QWEN_LIKE, HISTORY, TOOLS, "hermes")
    assert prompt.tools == [{"type": "function", "function": t["function"]} for t in TOOLS]
    call = prompt.messages[1]["tool_calls"][0]
    assert call == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
    }
    assert prompt.messages[1]["content"] == ""
    assert prompt.messages[2] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": "18 C, sunny",
        "name": "get_weather",
    }
    assert "tool_calls" not in prompt.messages[0]  # Mistral/Llama test for the key
    text = render(QWEN_LIKE, HISTORY, TOOLS)
    assert '"arguments": {"city": "Paris", "unit": "C"}}' in text
    assert '{"type": "function", "function": {"name": "get_weather"' in text


def test_no_tools_still_renders_the_history() -> None:
    prompt = tc.render_tools_prompt(QWEN_LIKE, HISTORY, None, "hermes")
    assert prompt.tools is None
    assert "<tool_call>" in render(QWEN_LIKE, HISTORY, None)
    fallback = tc.render_tools_prompt(None, HISTORY, [], "fallback")
    assert [m["role"] for m in fallback.messages] == ["user", "assistant", "user"]


def test_mistral_ids_are_nine_alphanumerics_and_still_pair() -> None:
    prompt = tc.render_tools_prompt(None, HISTORY, TOOLS, "mistral")
    ids = [c["id"] for c in prompt.messages[1]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    assert len(set(ids)) == 2
    assert [m["tool_call_id"] for m in prompt.messages[2:]] == ids
    kept = tc.render_tools_prompt(
        None,
        [{"role": "tool", "tool_call_id": "abcDEF123", "content": "x"}],
        TOOLS,
        "mistral",
    )
    assert kept.messages[0]["tool_call_id"] == "abcDEF123"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (
            lambda h: h[1]["tool_calls"][1]["function"].update(arguments="{bad"),
            "messages[1].tool_calls[1].function.arguments",
        ),
        (
            lambda h: h[1]["tool_calls"][0]["function"].update(arguments="[1]"),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (lambda h: h[1]["tool_calls"][0].pop("id"), "messages[1].tool_calls[0].id"),
        (
            lambda h: h[1]["tool_calls"][0]["function"].pop("name"),
            "messages[1].tool_calls[0].function.name",
        ),
        (lambda h: h[3].pop("tool_call_id"), "messages[3].tool_call_id"),
        (lambda h: h[0].update(content=42), "messages[0].content"),
    ],
)
def test_a_bad_history_names_its_path(change: Callable[[Any], Any], param: str) -> None:
    history = json.loads(json.dumps(HISTORY))
    change(history)
    for family in ("hermes", "fallback"):
        with pytest.raises(InvalidRequestError) as caught:
            tc.render_tools_prompt(None, history, TOOLS, family)  # type: ignore[arg-type]
        assert caught.value.param == param


# --- Parsing ----------------------------------------------------------------------------

W1 = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
W2 = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
ARGS1, ARGS2 = '{"city":"Paris","unit":"C"}', '{"zone":"UTC"}'

# (family, reply, content, calls as (name, arguments JSON))
CASES: list[tuple[str, str, str | None, list[tuple[str, str]]]] = [
    ("hermes", f"<tool_call>\n{W1}\n</tool_call>", None, [("get_weather", ARGS1)]),
    (
        "hermes",
        f"<tool_call>\n{W1}\n</tool_call>\n<tool_call>\n{W2}\n</tool_call>\n",
        None,
        [("get_weather", ARGS1), ("get_time", ARGS2)],
    ),
    (
        "hermes",
        f"Let me check.\n<tool_call>{W1}</tool_call>\nOne moment.",
        "Let me check.\n\nOne moment.",
        [("get_weather", ARGS1)],
    ),
    ("hermes", f"  \n<tool_call>\n{W1}\n</tool_call>  \n ", None, [("get_weather", ARGS1)]),
    ("hermes", f"<tool_call>\n{W1}", None, [("get_weather", ARGS1)]),  # cut by the end
    ("hermes", f"<tool_call>\n{W1}\n</tool_", None, [("get_weather", ARGS1)]),
    # Not calls: left in the content.
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',
        [],
    ),
    ("hermes", f"<tool_call>\n{W1}\n</tool_callx>", f"<tool_call>\n{W1}\n</tool_callx>", []),
    (
        "hermes",
        f"Use <tool_call> tags: <tool_call>{W2}</tool_call>",
        "Use <tool_call> tags:",
        [("get_time", ARGS2)],
    ),
    (
        "hermes",
        f"<tool_call>{{bad</tool_call><tool_call>{W2}</tool_call>",
        "<tool_call>{bad</tool_call>",
        [("get_time", ARGS2)],
    ),
    (
        "hermes",  # numbers cut mid-way ("-1", "-12.", "-12.5e") are still being written
        '<tool_call>{"name": "get_time", "arguments": {"n": [-12.5e+3, 0, 1E2, 0.25], '
        '"s": "\\"\\u00e9\\n", "b": [true, false, null], "o": {}}}</tool_call>',
        None,
        [("get_time", '{"n":[-12500.0,0,100.0,0.25],"s":"\\"é\\n","b":[true,false,null],"o":{}}')],
    ),
    ("hermes", "Just text, 2 < 3 and {x}.", "Just text, 2 < 3 and {x}.", []),
    ("hermes", "   ", None, []),
    ("hermes", "", None, []),
    # Llama 3: a bare JSON call opening the reply.
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
        None,
        [("get_weather", ARGS1)],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
        None,
        [("get_time", ARGS2)],
    ),
    ("llama3", f"{W1}; {W2};", None, [("get_weather", ARGS1), ("get_time", ARGS2)]),
    ("llama3", f"\n{W2}\nThat is the call.", "That is the call.", [("get_time", ARGS2)]),
    ("llama3", f"Calling: {W1}", f"Calling: {W1}", []),  # not at the start: text
    ("llama3", '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ("llama3", '{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),
    ("llama3", f"{W2} {{oops}}", "{oops}", [("get_time", ARGS2)]),
    # Mistral: an array after [TOOL_CALLS] (or opening the reply: the control token is
    # dropped when decoding without special tokens).
    ("mistral", f"[TOOL_CALLS][{W1}, {W2}]", None, [("get_weather", ARGS1), ("get_time", ARGS2)]),
    ("mistral", f"[TOOL_CALLS] [{W2}]", None, [("get_time", ARGS2)]),
    ("mistral", f" [{W1}]", None, [("get_weather", ARGS1)]),
    ("mistral", f"Sure.[TOOL_CALLS][{W2}] Done.", "Sure. Done.", [("get_time", ARGS2)]),
    ("mistral", f"[TOOL_CALLS][{W2}, 7]", f"[TOOL_CALLS][{W2}, 7]", []),
    ("mistral", "[1] is a footnote.", "[1] is a footnote.", []),
    ("mistral", "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
]


def test_parse_cases_cover_every_family() -> None:
    assert {case[0] for case in CASES} == set(FORMATS)


@pytest.mark.parametrize(("family", "reply", "content", "calls"), CASES)
def test_parse(family: str, reply: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parsed = tc.parse_tool_calls(reply, FORMATS[family], NAMES)
    assert parsed.content == content
    assert [(c.name, c.arguments_json) for c in parsed.calls] == calls
    for call in parsed.calls:
        assert ID.match(call.id)
        assert json.loads(call.arguments_json) == json.loads(call.arguments_json)
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


def test_arguments_are_compact_json_text() -> None:
    arguments = '{"city" :  "Z\\u00fcrich" , "unit": "C"}'
    reply = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    (call,) = tc.parse_tool_calls(reply, FORMATS["hermes"], NAMES).calls
    assert call.arguments_json == '{"city":"Zürich","unit":"C"}'
    assert call.to_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": call.arguments_json},
    }


@pytest.mark.parametrize(
    "arguments",
    [
        '{"x": 1e999}',
        '{"x": NaN}',
        '{"x": 01}',
        '{"x": "a\tb"}',
        '{"x": "\\q"}',
        "[" * 70 + "]" * 70,
    ],
)
def test_arguments_json_cannot_load_or_write_back_is_no_call(arguments: str) -> None:
    reply = f'<tool_call>{{"name": "get_time", "arguments": {arguments}}}</tool_call>'
    parsed = tc.parse_tool_calls(reply, FORMATS["hermes"], NAMES)
    assert parsed.calls == []
    assert parsed.content == reply


# --- Streaming --------------------------------------------------------------------------


def splits(text: str, rng: random.Random) -> Iterator[list[str]]:
    yield [text]
    yield list(text)  # one character at a time
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream(
    fmt: ToolCallFormat, deltas: list[str]
) -> tuple[list[tc.StreamEvent], tc.ToolCallStreamer]:
    streamer = tc.ToolCallStreamer(fmt, NAMES, new_id=counter())
    events: list[tc.StreamEvent] = []
    for delta in deltas:
        events += streamer.feed(delta)
    events += streamer.flush()
    return events, streamer


def check_events(events: list[tc.StreamEvent], parsed: tc.ParsedReply) -> None:
    """Content pieces join to the content; each call starts (once) before its arguments,
    which join to its arguments JSON."""
    content = "".join(e[1] for e in events if e[0] == "content")
    assert (content or None) == parsed.content
    starts = [e for e in events if e[0] == "call_start"]
    assert [(e[1], e[2], e[3]) for e in starts] == [
        (i, c.id, c.name) for i, c in enumerate(parsed.calls)
    ]
    for i, call in enumerate(parsed.calls):
        first = next(k for k, e in enumerate(events) if e[0] != "content" and e[1] == i)
        assert events[first][0] == "call_start"
        pieces = [e[2] for e in events if e[0] == "arguments" and e[1] == i]
        assert "".join(pieces) == call.arguments_json  # type: ignore[arg-type]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_streaming_equals_parsing_however_split(index: int) -> None:
    family, reply, _, _ = CASES[index]
    fmt = FORMATS[family]
    streamer = tc.ToolCallStreamer(fmt, NAMES, new_id=counter())
    streamer.feed(reply)
    streamer.flush()
    whole = tc.ParsedReply(streamer.content, streamer.calls)
    assert (whole.content, [(c.name, c.arguments_json) for c in whole.calls]) == (
        CASES[index][2],
        CASES[index][3],
    )
    for deltas in splits(reply, random.Random(index)) if len(reply) > 1 else [[reply]]:
        events, streamed = stream(fmt, deltas)
        assert streamed.calls == whole.calls, deltas
        assert streamed.content == whole.content
        check_events(events, whole)


def test_content_flows_and_a_possible_call_start_is_held() -> None:
    streamer = tc.ToolCallStreamer(FORMATS["hermes"], NAMES, new_id=counter())
    assert streamer.feed("Hello") == [("content", "Hello")]
    assert streamer.feed(" world <tool") == [("content", " world")]  # " <tool" held
    assert streamer.feed('_call>\n{"name": "get_time", ') == []
    assert streamer.feed('"arguments": {"zone": "UTC"}}\n</tool_call>') == [
        ("call_start", 0, "call_0", "get_time"),
        ("arguments", 0, ARGS2),
    ]
    # The space held before the wrapper was content after all: it goes out now.
    assert streamer.feed(" then <tooltip>") == [("content", "  then <tooltip>")]
    assert streamer.flush() == []
    assert streamer.content == "Hello world  then <tooltip>"


def test_a_long_call_is_announced_when_its_wrapper_closes() -> None:
    streamer = tc.ToolCallStreamer(FORMATS["hermes"], NAMES, new_id=counter())
    head = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "' + "x" * 200
    for ch in head + '"}}\n</tool_call':
        assert streamer.feed(ch) == []
    assert streamer.feed(">") == [
        ("call_start", 0, "call_0", "get_time"),
        ("arguments", 0, '{"zone":"' + "x" * 200 + '"}'),
    ]


def test_a_broken_call_is_released_before_the_end() -> None:
    """A wrapper that turns out not to hold a call goes out as content as soon as that is
    certain, not at flush (here: the JSON breaks inside a long held text)."""
    streamer = tc.ToolCallStreamer(FORMATS["hermes"], NAMES)
    events = streamer.feed('<tool_call>\n{"name": "get_time", "arguments": {"zone": "' + "x" * 100)
    assert events == []
    events = []
    for ch in '" oops ' + "y" * 300:
        events += streamer.feed(ch)
    assert "".join(e[1] for e in events if e[0] == "content").startswith("<tool_call>")


def test_streaming_a_long_call_one_character_at_a_time_is_linear() -> None:
    zone = "z" * 20_000
    reply = f'<tool_call>\n{{"name": "get_time", "arguments": {{"zone": "{zone}"}}}}\n</tool_call>'
    streamer = tc.ToolCallStreamer(FORMATS["hermes"], NAMES)
    scans = 0
    original = streamer._advance

    def counted(final: bool) -> list[tc.StreamEvent]:
        nonlocal scans
        scans += 1
        return original(final)

    streamer._advance = counted  # type: ignore[method-assign]
    for ch in reply:
        streamer.feed(ch)
    streamer.flush()
    assert [c.arguments_json for c in streamer.calls] == [
        json.dumps({"zone": zone}, separators=(",", ":"))
    ]
    assert scans < 200  # a rescan per delta would be ~20 000


# --- Replies made under the grammar always parse ----------------------------------------


@pytest.fixture(scope="module")
def codec(smollm_dir: Path) -> TextCodec:
    return TextCodec.load(smollm_dir)


@pytest.fixture(scope="module")
def vocab(codec: TextCodec, smollm_dir: Path) -> Vocabulary:
    width = int(json.loads((smollm_dir / "config.json").read_text())["vocab_size"])
    return Vocabulary.for_tokenizer(codec.tokenizer, width, codec.eos_ids)


def constrained_reply(fmt: ToolCallFormat, vocab: Vocabulary, seed: int) -> list[int]:
    """Tokens drawn from seeded random logits under the format's grammar, to its end."""
    constraint = Constraint(compile_grammar(GrammarSpec.tool_calls(fmt), vocab))
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    while not constraint.finished and len(tokens) < 600:
        logits = constraint.mask(torch.randn(vocab.logits_width, generator=generator) * 3.0)
        token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        constraint.accept(token)
        if token in vocab.eos_ids:
            break
        tokens.append(token)
    assert constraint.finished or constraint.accepting
    return tokens


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_grammar_made_replies_parse_as_valid_calls(
    family: str, codec: TextCodec, vocab: Vocabulary
) -> None:
    fmt = FORMATS[family]
    schemas = {f.name: f.parameters for f in FUNCTIONS}
    for seed in range(3):
        tokens = constrained_reply(fmt, vocab, seed)
        reply = codec.decode(tokens)
        parsed = tc.parse_tool_calls(reply, fmt, NAMES)
        assert parsed.calls, reply
        assert parsed.content is None, reply
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments_json), schemas[call.name])
        # Streamed token by token, as the API will feed it.
        streamer = tc.ToolCallStreamer(fmt, NAMES)
        detokenizer = IncrementalDetokenizer(codec)
        deltas = [detokenizer.add(token) for token in tokens] + [detokenizer.flush()]
        assert "".join(deltas) == reply
        events: list[tc.StreamEvent] = []
        for delta in deltas:
            events += streamer.feed(delta)
        events += streamer.flush()
        assert [(c.name, c.arguments_json) for c in streamer.calls] == [
            (c.name, c.arguments_json) for c in parsed.calls
        ]
        assert not [e for e in events if e[0] == "content"]


# --- Request checks ---------------------------------------------------------------------


def test_check_tools_gives_the_functions() -> None:
    assert tc.check_tools(TOOLS) == FUNCTIONS
    bare = tc.check_tools([{"type": "function", "function": {"name": "ping"}}])
    assert bare == [ToolFunction("ping", {})]


def tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ({"type": "function"}, "tools"),
        ([], "tools"),
        ([tool(name="f")] * 129, "tools"),
        (["f"], "tools[0]"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([tool(name="ok"), tool(name="has space")], "tools[1].function.name"),
        ([tool(name="x" * 65)], "tools[0].function.name"),
        ([tool(name="")], "tools[0].function.name"),
        ([tool(description="no name")], "tools[0].function.name"),
        ([tool(name="a"), tool(name="b"), tool(name="a")], "tools[2].function.name"),
        ([tool(name="f", description=3)], "tools[0].function.description"),
        ([tool(name="f", parameters="{}")], "tools[0].function.parameters"),
        ([tool(name="f", parameters={"type": "string"})], "tools[0].function.parameters"),
    ],
)
def test_check_tools_names_the_bad_path(tools: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        tc.check_tools(tools)
    assert caught.value.param == param
    assert caught.value.status == 400
    assert param in str(caught.value)


@pytest.mark.parametrize(
    ("choice", "names", "expected"),
    [
        (None, NAMES, ("auto", None)),
        (None, set(), ("none", None)),
        ("auto", NAMES, ("auto", None)),
        ("auto", set(), ("none", None)),
        ("none", NAMES, ("none", None)),
        ("required", NAMES, ("required", None)),
        ({"type": "function", "function": {"name": "get_time"}}, NAMES, ("required", "get_time")),
    ],
)
def test_check_tool_choice(
    choice: object, names: set[str], expected: tuple[str, str | None]
) -> None:
    assert tc.check_tool_choice(choice, names) == expected


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ({"type": "function", "function": {"name": "get_date"}}, NAMES),
        ({"type": "function", "function": {}}, NAMES),
        ({"type": "function"}, NAMES),
        ({"type": "allowed_tools", "tools": []}, NAMES),
        ("always", NAMES),
        (3, NAMES),
        ("required", set()),
        ({"type": "function", "function": {"name": "get_time"}}, set()),
    ],
)
def test_a_bad_tool_choice_is_a_400_naming_it(choice: object, names: set[str]) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        tc.check_tool_choice(choice, names)
    assert caught.value.param == "tool_choice"
