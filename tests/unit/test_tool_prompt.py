"""Tool calling, the offer: family detection, the prompt given to the template, and the
request checks of `tools` and `tool_choice`."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from swarmd.errors import InvalidRequestError
from swarmd.model import tool_prompt as tp
from swarmd.model.chat_template import compile_template
from swarmd.model.grammar import ToolCallFormat, ToolFunction
from swarmd.model.text import TextCodec
from swarmd.model.tool_calls import parse_tool_calls
from tests.unit.test_tool_calls import NAMES, TIME, WEATHER

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
FUNCTIONS = [ToolFunction("get_weather", WEATHER), ToolFunction("get_time", TIME)]
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
    assert tp.detect_family(snippet) == family


def test_the_embedded_model_has_no_tools_section(smollm_dir: Path) -> None:
    template = TextCodec.load(smollm_dir).chat_template
    assert template and "im_start" in template
    assert tp.detect_family(template) == "fallback"


def test_each_family_maps_to_grammar_presets() -> None:
    assert tp.tool_call_format("hermes", FUNCTIONS) == ToolCallFormat.hermes(FUNCTIONS)
    assert tp.tool_call_format("fallback", FUNCTIONS) == ToolCallFormat.hermes(FUNCTIONS)
    assert tp.tool_call_format("mistral", FUNCTIONS, False) == ToolCallFormat.mistral(
        FUNCTIONS, False
    )
    assert tp.tool_call_format("llama3", FUNCTIONS) == ToolCallFormat.llama3_json(FUNCTIONS)


# --- The prompt -------------------------------------------------------------------------


def render(source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    family = tp.detect_family(source)
    prompt = tp.render_tools_prompt(source, messages, tools, family)
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
    prompt = tp.render_tools_prompt(None, HISTORY, TOOLS, "fallback")
    assistant = prompt.messages[2]
    assert assistant["role"] == "assistant"
    parsed = parse_tool_calls(assistant["content"], tp.tool_call_format("hermes", FUNCTIONS), NAMES)
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
    prompt = tp.render_tools_prompt(
        gemma_like, [{"role": "user", "content": "Hi"}], TOOLS, "fallback"
    )
    assert [m["role"] for m in prompt.messages] == ["user"]
    assert prompt.messages[0]["content"].startswith("# Tools\n")
    assert prompt.messages[0]["content"].endswith("\n\nHi")
    text = compile_template(gemma_like).render(messages=prompt.messages)
    assert "get_weather" in text


def test_fallback_text_is_the_documented_one() -> None:
    text = tp.fallback_tools_prompt(TOOLS[1:])
    assert text == tp.FALLBACK_TOOLS_PROMPT.format(
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
    prompt = tp.render_tools_prompt(QWEN_LIKE, HISTORY, TOOLS, "hermes")
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
    prompt = tp.render_tools_prompt(QWEN_LIKE, HISTORY, None, "hermes")
    assert prompt.tools is None
    assert "<tool_call>" in render(QWEN_LIKE, HISTORY, None)
    fallback = tp.render_tools_prompt(None, HISTORY, [], "fallback")
    assert [m["role"] for m in fallback.messages] == ["user", "assistant", "user"]


def test_mistral_ids_are_nine_alphanumerics_and_still_pair() -> None:
    prompt = tp.render_tools_prompt(None, HISTORY, TOOLS, "mistral")
    ids = [c["id"] for c in prompt.messages[1]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    assert len(set(ids)) == 2
    assert [m["tool_call_id"] for m in prompt.messages[2:]] == ids
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    kept = tp.render_tools_prompt(
        None,
        [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "abcDEF123", "content": "x"},
        ],
        TOOLS,
        "mistral",
    )
    assert kept.messages[0]["tool_calls"][0]["id"] == "abcDEF123"
    assert kept.messages[1]["tool_call_id"] == "abcDEF123"


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
        # A result must answer a call of the assistant turn just before it.
        (lambda h: h[3].update(tool_call_id="call_9"), "messages[3].tool_call_id"),
        (lambda h: h.insert(2, {"role": "user", "content": "and?"}), "messages[3]"),
        (lambda h: h.pop(1), "messages[1]"),
        (lambda h: h[0].update(content=42), "messages[0].content"),
    ],
)
def test_a_bad_history_names_its_path(change: Callable[[Any], Any], param: str) -> None:
    history = json.loads(json.dumps(HISTORY))
    change(history)
    for family in ("hermes", "fallback"):
        with pytest.raises(InvalidRequestError) as caught:
            tp.render_tools_prompt(None, history, TOOLS, family)  # type: ignore[arg-type]
        assert caught.value.param == param


# --- Request checks ---------------------------------------------------------------------


def test_check_tools_gives_the_functions() -> None:
    assert tp.check_tools(TOOLS) == FUNCTIONS
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    assert tp.check_tools(strict) == FUNCTIONS[:1]
    bare = tp.check_tools([{"type": "function", "function": {"name": "ping"}}])
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
        ([tool(name="f", strict="yes")], "tools[0].function.strict"),
        ([tool(name="f"), tool(name="g", paramters={})], "tools[1].function.paramters"),
        ([{**tool(name="f"), "name": "f"}], "tools[0].name"),
    ],
)
def test_check_tools_names_the_bad_path(tools: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        tp.check_tools(tools)
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
    assert tp.check_tool_choice(choice, names) == expected


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
        tp.check_tool_choice(choice, names)
    assert caught.value.param == "tool_choice"


@pytest.mark.parametrize("empty", ["", "  "])
def test_a_call_recorded_with_no_arguments_is_a_call_with_none(empty: str) -> None:
    history = copy.deepcopy(HISTORY)
    history[1]["tool_calls"][1]["function"]["arguments"] = empty
    prompt = tp.render_tools_prompt(QWEN_LIKE, history, TOOLS, "hermes")
    assert prompt.messages[1]["tool_calls"][1]["function"]["arguments"] == {}
