"""Tool calling, what comes back: calls parsed from a reply, whole and streamed (however
split), uncertain (announced whole) and certain (arguments streamed as written), and the
canonical form of their arguments."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest
import torch

from swarmd.model import tool_calls as tc
from swarmd.model.grammar import (
    Constraint,
    GrammarSpec,
    ToolCallFormat,
    ToolFunction,
    Vocabulary,
    compile_grammar,
)
from swarmd.model.text import IncrementalDetokenizer, TextCodec
from swarmd.model.tool_prompt import tool_call_format

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}}
NAMES = {"get_weather", "get_time"}
FUNCTIONS = [ToolFunction("get_weather", WEATHER), ToolFunction("get_time", TIME)]
FORMATS = {
    family: tool_call_format(family, FUNCTIONS) for family in ("hermes", "llama3", "mistral")
}
ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


def counter() -> Callable[[], str]:
    """Deterministic call ids (a parse and a stream of the same text get the same ones)."""
    n = iter(range(1_000_000))
    return lambda: f"call_{next(n)}"


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
    fmt: ToolCallFormat, deltas: list[str], certain: bool = False
) -> tuple[list[tc.StreamEvent], tc.ToolCallStreamer]:
    streamer = tc.ToolCallStreamer(fmt, NAMES, new_id=counter(), certain=certain)
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


# --- The canonical form of arguments ---------------------------------------------------


def random_string(rng: random.Random) -> str:
    alphabet = 'ab Z09"\\/\b\f\n\r\t\x00\x1f\x7féü€\u2028😀𝄞'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-(10**20), 10**20)
    if kind == 2:
        return rng.choice([0.0, -0.0, 1e-7, 2.5e300, rng.uniform(-1e6, 1e6)])
    if kind in (3, 4):
        return random_string(rng)
    if kind == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict[str, object]:
    return {random_string(rng): random_value(rng, depth) for _ in range(rng.randint(0, 4))}


def test_strings_are_written_as_json_writes_them() -> None:
    rng = random.Random(7)
    for _ in range(300):
        text = random_string(rng)
        assert tc._escape(text) == json.dumps(text, ensure_ascii=False)[1:-1]
    # A lone surrogate stays escaped (it would not encode), as json writes it.
    assert tc._escape("a\ud800b\udfff") == "a\\ud800b\\udfff"


@pytest.mark.parametrize("seed", range(40))
def test_arguments_are_json_dumps_of_json_loads(seed: int) -> None:
    """However the model lays out and escapes an object without repeated keys, its
    arguments are `json.dumps(json.loads(text), compact, ensure_ascii=False)`, whole and
    streamed (certain) alike."""
    rng = random.Random(seed)
    value = random_object(rng)
    text = json.dumps(
        value,
        ensure_ascii=rng.random() < 0.5,  # True: astral characters as surrogate pairs
        indent=rng.choice([None, 0, 2]),
        separators=rng.choice([None, (",", ":"), (" ,", " : ")]),
    )
    expected = json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
    reply = f'<tool_call>\n{{"name": "get_time", "arguments": {text}}}\n</tool_call>'
    (call,) = tc.parse_tool_calls(reply, FORMATS["hermes"], NAMES).calls
    assert call.arguments_json == expected
    for deltas in splits(reply, rng):
        events, streamer = stream(FORMATS["hermes"], deltas, certain=True)
        assert "".join(e[2] for e in events if e[0] == "arguments") == expected  # type: ignore[misc]
        assert [c.arguments_json for c in streamer.calls] == [expected]


def test_a_lone_surrogate_stays_escaped_and_reads_back() -> None:
    reply = '{"name": "get_time", "parameters": {"zone": "\\ud800x\\udc00", "e": "\\ud83d\\ude00"}}'
    (call,) = tc.parse_tool_calls(reply, FORMATS["llama3"], NAMES).calls
    assert call.arguments_json == '{"zone":"\\ud800x\\udc00","e":"😀"}'
    call.arguments_json.encode()  # UTF-8 clean
    assert json.loads(call.arguments_json) == json.loads(reply)["parameters"]


# --- Certain: a call announced by its name, its arguments streamed ----------------------

CERTAIN_FORMATS = {**FORMATS, "fallback": tool_call_format("fallback", FUNCTIONS)}
STRINGS = '"Z\\u00fcrich \\"old\\"\\n\\ud83d\\ude00 \\/ \\\\ é"'
NUMBERS = "[-12.5e+3, 0, -0, 1E2, 0.25, 12345678901234567890, 1.5e-7, true, false, null]"
# (family, reply): replies that are calls, as constrained decoding makes them and looser.
SAMPLES: list[tuple[str, str]] = [
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": {STRINGS}}}}}\n</tool_call>',
    ),
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_time", "arguments": {{"n": {NUMBERS}, "o": {{}}, "a": []}}}}'
        f"\n</tool_call>\n<tool_call>\n{W1}\n</tool_call>",
    ),
    ("fallback", f"Let me check.\n<tool_call>{W2}</tool_call>"),
    # The arguments before the name: held until it is read.
    (
        "hermes",
        '<tool_call>{"arguments": {"zone": "UTC", "x": [1]}, "name": "get_time"}</tool_call>',
    ),
    (
        "hermes",
        '<tool_call>\n{ "name" : "get_time" , "id": [1, {"x": null}], "arguments" : '
        '{ "zone" : "UT\\tC" , "n" : [ 1 , 2.50 ] } }\n</tool_call>',
    ),
    ("mistral", f"[TOOL_CALLS][{W1}, {W2}]"),
    ("mistral", ' [{"name": "get_time", "arguments": {"zone": "a\\u0000b"}}]'),
    (
        "llama3",
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "F"}};',
    ),
    ("llama3", f"{W1}; {W2}"),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "\\ud800x", "unit": "C"}}'),
]


def every_split(text: str) -> Iterator[list[str]]:
    """Every cut into two pieces, and a piece per character."""
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]
    yield list(text)


def check_stream(reply: str, fmt: ToolCallFormat, deltas: list[str], whole: tc.ParsedReply) -> None:
    events, streamer = stream(fmt, deltas, certain=True)
    assert streamer.calls == whole.calls, deltas  # ids (drawn in order), names, arguments
    assert streamer.content == whole.content
    check_events(events, whole)


def test_samples_cover_every_syntax() -> None:
    assert {family for family, _ in SAMPLES} == set(CERTAIN_FORMATS)


@pytest.mark.parametrize(("family", "reply"), SAMPLES)
def test_certain_streaming_equals_the_whole_parse_at_every_split(family: str, reply: str) -> None:
    """The pieces of each call's arguments concatenate to what `parse_tool_calls` gives
    (certain or not), however the reply is cut: inside strings, escapes, numbers."""
    fmt = CERTAIN_FORMATS[family]
    streamer = tc.ToolCallStreamer(fmt, NAMES, new_id=counter())
    streamer.feed(reply)
    streamer.flush()
    whole = tc.ParsedReply(streamer.content, streamer.calls)
    assert whole.calls
    certain = tc.ToolCallStreamer(fmt, NAMES, new_id=counter(), certain=True)
    certain.feed(reply)
    certain.flush()
    assert (certain.content, certain.calls) == (whole.content, whole.calls)
    for deltas in every_split(reply):
        check_stream(reply, fmt, deltas, whole)
    for deltas in splits(reply, random.Random(reply)):
        check_stream(reply, fmt, deltas, whole)


@pytest.mark.parametrize(("family", "reply"), SAMPLES)
def test_certain_arguments_arrive_before_the_call_is_whole(family: str, reply: str) -> None:
    """Fed a character at a time: uncertain, a call is announced once whole; certain, its
    start comes with its name and its arguments grow in many pieces before that."""
    fmt = CERTAIN_FORMATS[family]
    uncertain = tc.ToolCallStreamer(fmt, NAMES, new_id=counter())
    certain = tc.ToolCallStreamer(fmt, NAMES, new_id=counter(), certain=True)
    whole_at: dict[int, int] = {}  # call index -> characters fed when announced whole
    first_piece_at: dict[int, int] = {}
    pieces: dict[int, int] = {}
    for k in range(1, len(reply) + 1):
        for event in uncertain.feed(reply[k - 1]):
            if event[0] == "call_start":
                whole_at[event[1]] = k
        for event in certain.feed(reply[k - 1]):
            if event[0] == "call_start":  # as the name's closing quote is read
                assert reply[:k].endswith(f'"{event[3]}"')
            if event[0] == "arguments":
                first_piece_at.setdefault(event[1], k)
                pieces[event[1]] = pieces.get(event[1], 0) + 1
    uncertain.flush()
    certain.flush()
    for index, call in enumerate(certain.calls):
        at = whole_at.get(index, len(reply) + 1)  # a call cut by the end: at flush
        assert first_piece_at[index] < at, (index, call)
        if '{"arguments"' not in reply and len(call.arguments_json) > 2:  # not held
            assert pieces[index] > 3


def test_arguments_before_the_name_are_held_then_sent() -> None:
    streamer = tc.ToolCallStreamer(FORMATS["hermes"], NAMES, new_id=counter(), certain=True)
    assert streamer.feed('<tool_call>{"arguments": {"zone": "U') == []
    assert streamer.feed('TC"}, "name": "get_ti') == []
    assert streamer.feed('me"') == [
        ("call_start", 0, "call_0", "get_time"),
        ("arguments", 0, ARGS2),
    ]
    assert streamer.feed("}</tool_call>") == []
    assert [c.arguments_json for c in streamer.calls] == [ARGS2]


def test_a_certain_call_streams_its_arguments_as_they_grow() -> None:
    streamer = tc.ToolCallStreamer(FORMATS["hermes"], NAMES, new_id=counter(), certain=True)
    assert streamer.feed('<tool_call>\n{"name": "get_time"') == [
        ("call_start", 0, "call_0", "get_time")
    ]
    assert streamer.feed(', "arguments": {"zo') == [("arguments", 0, '{"zo')]
    assert streamer.feed('ne": "a\\') == [("arguments", 0, 'ne":"a')]  # the escape held
    assert streamer.feed("ud83d") == []  # a low surrogate may follow
    assert streamer.feed('\\ude00 b", "n": 12') == [("arguments", 0, '😀 b","n":')]
    assert streamer.feed("3}}\n</tool_call>") == [("arguments", 0, "123}")]
    assert [c.arguments_json for c in streamer.calls] == ['{"zone":"a😀 b","n":123}']


def test_a_certain_call_cut_short_keeps_what_was_streamed() -> None:
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert tc.parse_tool_calls(reply, FORMATS["hermes"], NAMES).calls == []  # uncertain
    parsed = tc.parse_tool_calls(reply, FORMATS["hermes"], NAMES, certain=True)
    assert [(c.name, c.arguments_json) for c in parsed.calls] == [("get_weather", '{"city":"Par')]
    assert parsed.content is None
    for deltas in splits(reply, random.Random(1)):
        events, streamer = stream(FORMATS["hermes"], deltas, certain=True)
        assert [(c.name, c.arguments_json) for c in streamer.calls] == [
            (c.name, c.arguments_json) for c in parsed.calls
        ]
        check_events(events, tc.ParsedReply(None, streamer.calls))


@pytest.mark.parametrize(
    "reply",
    [
        "<tool_c",
        "  <tool_call>",
        '<tool_call>\n{"name": "get_ti',
        '<tool_call>\n{"na',
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool',
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "',
    ],
)
def test_certain_hides_a_call_the_end_cut_before_its_name(reply: str) -> None:
    """Only calls can come out (tool_choice required or named): max_tokens may cut one
    before its name is whole. That is no content (before 0.5.2 the client got
    "<tool_call" as the reply); the calls before it stand, streamed or not."""
    fmt = FORMATS["hermes"]
    parsed = tc.parse_tool_calls(reply, fmt, NAMES, certain=True)
    assert parsed.content is None
    whole = reply.count("</tool_call>")
    assert [c.name for c in parsed.calls] == ["get_time"] * whole
    for deltas in splits(reply, random.Random(2)):
        events, streamer = stream(fmt, deltas, certain=True)
        assert streamer.content is None and len(streamer.calls) == whole
        check_events(events, tc.ParsedReply(None, streamer.calls))
    assert tc.parse_tool_calls(reply, fmt, NAMES).content is not None  # uncertain: text


def test_certain_is_never_a_call_before_a_known_name() -> None:
    """Until the name is read and known, certain holds as uncertain does: text that is
    no call is content, whole."""
    for reply in (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {"x": 1}, "oops"</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        "[TOOL_CALLS][]",
    ):
        family = "mistral" if reply.startswith("[") else "hermes"
        for certain in (False, True):
            parsed = tc.parse_tool_calls(reply, FORMATS[family], NAMES, certain=certain)
            assert (parsed.content, parsed.calls) == (reply, [])


@pytest.mark.parametrize("index", range(len(CASES)))
def test_certain_streaming_of_any_reply_equals_its_certain_parse(index: int) -> None:
    """Split invariance holds for certain mode on every case, calls or not. Where the
    reply is whole calls, certain finds exactly the uncertain calls."""
    family, reply, _, calls = CASES[index]
    fmt = FORMATS[family]
    streamer = tc.ToolCallStreamer(fmt, NAMES, new_id=counter(), certain=True)
    streamer.feed(reply)
    streamer.flush()
    whole = tc.ParsedReply(streamer.content, streamer.calls)
    if calls:
        assert [(c.name, c.arguments_json) for c in whole.calls] == calls
    for deltas in splits(reply, random.Random(index)) if len(reply) > 1 else [[reply]]:
        check_stream(reply, fmt, deltas, whole)


def test_certain_streaming_a_long_call_reads_each_character_once() -> None:
    zone = "z\\n" * 7_000
    reply = f'<tool_call>\n{{"name": "get_time", "arguments": {{"zone": "{zone}"}}}}\n</tool_call>'
    streamer = tc.ToolCallStreamer(FORMATS["hermes"], NAMES, certain=True)
    read = 0
    original = tc._Reader.advance

    def counted(self: tc._Reader, text: str) -> None:
        nonlocal read
        read += len(text) - self.pos
        original(self, text)

    pieces = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tc._Reader, "advance", counted)
        for ch in reply:
            pieces += sum(e[0] == "arguments" for e in streamer.feed(ch))
        streamer.flush()
    assert [c.arguments_json for c in streamer.calls] == ['{"zone":"' + zone + '"}']
    assert read < 2 * len(reply)  # a rescan per delta would be ~len(reply) ** 2 / 2
    assert pieces > len(zone) // 3


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
        # Certain (as the API streams a required call): the same calls, their arguments
        # sent as the tokens come, the first piece before the last token.
        certain = tc.ToolCallStreamer(fmt, NAMES, new_id=counter(), certain=True)
        events, first = [], None
        for k, delta in enumerate(deltas):
            new = certain.feed(delta)
            if first is None and any(e[0] == "arguments" for e in new):
                first = k
            events += new
        events += certain.flush()
        assert [(c.name, c.arguments_json) for c in certain.calls] == [
            (c.name, c.arguments_json) for c in parsed.calls
        ]
        check_events(events, tc.ParsedReply(None, certain.calls))
        assert first is not None and first < len(tokens) - 1, reply
