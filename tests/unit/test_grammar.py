"""Constrained decoding against the real SmolLM2 tokenizer: replies drawn from random
logits under a grammar always parse and validate, replays rebuild the state, bad specs
are 400s naming their parameter."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from swarmd.errors import InternalError, InvalidRequestError
from swarmd.model.grammar import (
    MAX_GRAMMAR_BYTES,
    Constraint,
    GrammarSpec,
    ToolCallFormat,
    ToolFunction,
    Vocabulary,
    as_enforced,
    compile_grammar,
    relaxed,
)
from swarmd.model.text import TextCodec

STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string literal
LIMIT = 400  # tokens a reply may take
PADDING = 64  # extra logits rows of a padded model


@pytest.fixture(scope="module")
def codec(smollm_dir: Path) -> TextCodec:
    return TextCodec.load(smollm_dir)


@pytest.fixture(scope="module")
def width(smollm_dir: Path) -> int:
    return int(json.loads((smollm_dir / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def vocab(codec: TextCodec, width: int) -> Vocabulary:
    return Vocabulary.for_tokenizer(codec.tokenizer, width, codec.eos_ids)


def schema_spec(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def generate(
    constraint: Constraint, seed: int, bias: torch.Tensor | None = None, limit: int = LIMIT
) -> list[int]:
    """Tokens drawn from seeded random logits (plus `bias`) under the constraint, until
    it finishes, an EOS is drawn, or `limit`. The EOS is not returned."""
    width = constraint.compiled.vocab.logits_width
    eos = constraint.compiled.vocab.eos_ids
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    while len(tokens) < limit and not constraint.finished:
        logits = torch.randn(width, generator=generator) * 3.0
        if bias is not None:
            logits = logits + bias
        masked = constraint.mask(logits)
        assert torch.isfinite(masked).any(), "every token masked"
        token = int(torch.multinomial(torch.softmax(masked, dim=-1), 1, generator=generator))
        constraint.accept(token)
        if token in eos:
            break
        tokens.append(token)
    return tokens


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }


NAME = {"type": "string", "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "booleans": obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}}),
    "nulls": obj(
        {"nothing": {"type": "null"}, "maybe": {"type": ["string", "null"], "maxLength": 5}}
    ),
    "nested": obj(
        {
            "user": obj(
                {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "profile": obj({"nick": NAME}),
                }
            )
        }
    ),
    "deep": obj(
        {"a": obj({"b": obj({"c": obj({"d": {"type": "integer", "minimum": 0, "maximum": 9}})})})}
    ),
    "array_bounds": obj(
        {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 2,
                "maxItems": 4,
            }
        }
    ),
    "array_exact": obj(
        {
            "rgb": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 255},
                "minItems": 3,
                "maxItems": 3,
            }
        }
    ),
    "array_of_objects": obj(
        {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": obj(
                    {
                        "sku": {"type": "string", "maxLength": 5},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),
            }
        }
    ),
    "empty_array_allowed": obj(
        {"xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}
    ),
    "string_enum": obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    "mixed_enum": obj({"level": {"enum": [1, "two", None, True]}}),
    "const": obj(
        {"version": {"const": "v1"}, "n": {"type": "integer", "minimum": 0, "maximum": 3}}
    ),
    "integer_range": obj({"score": {"type": "integer", "minimum": -50, "maximum": 50}}),
    "number_range": obj(
        {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        }
    ),
    "exclusive_range": obj(
        {"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}
    ),
    "optional_keys": obj(
        {
            "title": NAME,
            "subtitle": NAME,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        required=["title"],
    ),
    "all_optional": obj(
        {"x": {"type": "integer", "minimum": 0, "maximum": 5}, "y": {"type": "boolean"}},
        required=[],
    ),
    "string_bounds": obj(
        {
            "code": {"type": "string", "minLength": 3, "maxLength": 3},
            "note": {"type": "string", "maxLength": 20},
        }
    ),
    "pattern": obj({"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}}),
    "any_of_ref": {
        "type": "object",
        "$defs": {
            "point": obj(
                {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                }
            )
        },
        "properties": {
            "at": {"$ref": "#/$defs/point"},
            "radius": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]
            },
        },
        "required": ["at", "radius"],
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_reply_from_random_logits_validates(
    name: str, vocab: Vocabulary, codec: TextCodec
) -> None:
    schema = SCHEMAS[name]
    constraint = Constraint(compile_grammar(schema_spec(schema), vocab))
    tokens = generate(constraint, seed=len(name))
    assert constraint.finished, (name, codec.decode(tokens))
    text = codec.decode(tokens)
    jsonschema.validate(json.loads(text), schema)
    # swarmd's layout: json.dumps' separators, no other whitespace.
    assert not re.search(r"\s", re.sub(r"[,:] ", "", STRING.sub('""', text))), text


def structure_bias(codec: TextCodec, width: int) -> torch.Tensor:
    """Favours tokens that close strings and objects, so that a free-form object from
    random logits ends within the limit (its strings have no maxLength)."""
    bias = torch.zeros(width)
    for token, idx in codec.tokenizer.get_vocab().items():
        if idx < width and any(c in token for c in '"}'):
            bias[idx] = 8.0
    return bias


def test_json_object_gives_an_object(vocab: Vocabulary, codec: TextCodec, width: int) -> None:
    for seed in range(3):
        constraint = Constraint(compile_grammar(GrammarSpec("json_object", ""), vocab))
        tokens = generate(constraint, seed, bias=structure_bias(codec, width))
        assert constraint.finished
        assert isinstance(json.loads(codec.decode(tokens)), dict)


def test_only_subschemas_are_closed(vocab: Vocabulary, codec: TextCodec) -> None:
    # A property named "properties", and a const that looks like a schema, are not closed.
    schema = obj(
        {
            "properties": obj({"n": {"type": "integer", "minimum": 0, "maximum": 9}}),
            "fixed": {"const": {"properties": {}}},
        }
    )
    constraint = Constraint(compile_grammar(schema_spec(schema), vocab))
    value = json.loads(codec.decode(generate(constraint, seed=1)))
    jsonschema.validate(value, schema)
    assert value["fixed"] == {"properties": {}}
    assert set(value) == {"properties", "fixed"}


ALL_OF = {
    "two objects": {
        "allOf": [
            obj({"a": {"type": "integer", "minimum": 0, "maximum": 9}}),
            obj({"b": {"type": "string", "maxLength": 5}}),
        ]
    },
    "a base by $ref beside its own properties": {
        "$defs": {"Base": obj({"id": {"type": "integer", "minimum": 0, "maximum": 99}})},
        "allOf": [{"$ref": "#/$defs/Base"}],
        "type": "object",
        "properties": {"name": NAME, "id": {"type": "integer", "minimum": 5}},
        "required": ["name"],
    },
}


@pytest.mark.parametrize("name", sorted(ALL_OF))
def test_an_all_of_of_objects_is_one_closed_object(
    name: str, vocab: Vocabulary, codec: TextCodec
) -> None:
    """Closed branch by branch, each would refuse the others' properties (a 400,
    "unsatisfiable", before 0.5.2); merged, the reply has every branch's required
    properties, satisfies every branch (a name in two satisfies both), and nothing else."""
    schema = ALL_OF[name]
    allowed: set[str] = set()
    for part in [schema, *schema["allOf"]]:
        target = schema["$defs"]["Base"] if "$ref" in part else part
        allowed |= set(target.get("properties", {}))
    for seed in range(4):
        constraint = Constraint(compile_grammar(schema_spec(schema), vocab))
        tokens = generate(constraint, seed=seed)
        assert constraint.finished, codec.decode(tokens)
        value = json.loads(codec.decode(tokens))
        jsonschema.validate(value, schema)
        assert set(value) <= allowed, value


def test_json_object_refuses_a_bare_value(vocab: Vocabulary, codec: TextCodec) -> None:
    constraint = Constraint(compile_grammar(GrammarSpec("json_object", ""), vocab))
    allowed = constraint.allowed()
    texts = {codec.decode([i]) for i in torch.nonzero(allowed).flatten().tolist()}
    assert texts and all(t.startswith("{") for t in texts), sorted(texts)[:10]


WEATHER = ToolFunction(
    "get_weather",
    obj({"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}}),
)
TIME = ToolFunction("get_time", obj({"zone": {"type": "string", "pattern": "^UTC[+-][0-9]$"}}))
PING = ToolFunction("ping")  # no parameters: {} only


def parse_calls(text: str, fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """The calls of a reply in `fmt`, checked to be nothing but calls."""
    assert text.startswith(fmt.prefix) and text.endswith(fmt.suffix), text
    body = text[len(fmt.prefix) : len(text) - len(fmt.suffix)]
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        assert body.startswith(fmt.begin, pos), (body, pos)
        call, pos = decoder.raw_decode(body, pos + len(fmt.begin))
        assert body.startswith(fmt.end, pos), (body, pos)
        pos += len(fmt.end)
        calls.append(call)
        if pos == len(body):
            return calls
        assert fmt.parallel and body.startswith(fmt.separator, pos), (body, pos)
        pos += len(fmt.separator)


FORMATS = {
    "hermes": ToolCallFormat.hermes([WEATHER, TIME, PING]),
    "hermes_single": ToolCallFormat.hermes([WEATHER, TIME], parallel=False),
    "llama3": ToolCallFormat.llama3_json([WEATHER, TIME]),
    "mistral": ToolCallFormat.mistral([WEATHER, TIME, PING]),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tool_calls_validate(name: str, vocab: Vocabulary, codec: TextCodec) -> None:
    fmt = FORMATS[name]
    schemas = {
        f.name: f.parameters or {"type": "object", "maxProperties": 0} for f in fmt.functions
    }
    seen = 0
    for seed in range(4):
        constraint = Constraint(compile_grammar(GrammarSpec.tool_calls(fmt), vocab))
        tokens = generate(constraint, seed)
        assert constraint.finished or constraint.accepting, codec.decode(tokens)
        calls = parse_calls(codec.decode(tokens), fmt)
        assert fmt.parallel or len(calls) == 1
        for call in calls:
            assert list(call) == [fmt.name_key, fmt.arguments_key]
            jsonschema.validate(call[fmt.arguments_key], schemas[call[fmt.name_key]])
        seen += len(calls)
    assert seen >= 4


def test_hermes_text_is_exact(vocab: Vocabulary, codec: TextCodec) -> None:
    fmt = ToolCallFormat.hermes([WEATHER], parallel=False)
    constraint = Constraint(compile_grammar(GrammarSpec.tool_calls(fmt), vocab))
    text = codec.decode(generate(constraint, seed=7))
    assert re.fullmatch(
        r'<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": ".*", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>',
        text,
        re.S,
    ), text
    assert constraint.finished


def test_tool_calls_round_trip_their_format() -> None:
    fmt = FORMATS["mistral"]
    assert ToolCallFormat.from_json(fmt.to_json()) == fmt


# "name" is a call's first key too: a bare call (Llama 3) and this answer start alike
ANSWER = obj({"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}})


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_calls_or_an_answer_of_the_format(name: str, vocab: Vocabulary, codec: TextCodec) -> None:
    """Tools with a JSON response_format: the reply is calls, or one JSON value of the
    answer's schema, nothing else; both can start the reply."""
    fmt = replace(FORMATS[name], answer=json.dumps(ANSWER))
    spec = GrammarSpec.tool_calls(fmt)
    first = Constraint(compile_grammar(spec, vocab)).allowed()
    starts = {codec.decode([i])[:1] for i in torch.nonzero(first).flatten().tolist()}
    assert "{" in starts and (fmt.prefix or fmt.begin or "{")[0] in starts
    for seed in range(8):
        constraint = Constraint(compile_grammar(spec, vocab))
        text = codec.decode(
            generate(constraint, seed, bias=structure_bias(codec, vocab.logits_width))
        )
        assert constraint.finished or constraint.accepting, text
        try:
            calls = parse_calls(text, fmt)
            assert all(list(call) == [fmt.name_key, fmt.arguments_key] for call in calls)
        except (AssertionError, ValueError):
            jsonschema.validate(json.loads(text), ANSWER)  # not calls: then the answer
            continue
        functions = {f.name: f.parameters for f in fmt.functions}
        for call in calls:
            schema = functions[call[fmt.name_key]] or {"type": "object", "maxProperties": 0}
            jsonschema.validate(call[fmt.arguments_key], schema)
    # which one the noise picks is its business; both are taken here:
    call = '{"name": "get_time", "arguments": {"zone": "UTC+1"}}'.replace(
        '"arguments"', json.dumps(fmt.arguments_key)
    )
    for text in (
        f"{fmt.prefix}{fmt.begin}{call}{fmt.end}{fmt.suffix}",
        '{"name": "get_timer", "ok": true}',
    ):
        constraint = Constraint(compile_grammar(spec, vocab))
        for token in codec.encode(text):
            assert constraint.allowed()[token], text
            constraint.accept(token)
        assert constraint.accepting, text


def _takes(spec: GrammarSpec, text: str, vocab: Vocabulary, codec: TextCodec) -> bool:
    constraint = Constraint(compile_grammar(spec, vocab))
    for token in codec.encode(text):
        if not constraint.allowed()[token]:
            return False
        constraint.accept(token)
    return constraint.accepting


@pytest.mark.parametrize(
    ("name", "answer", "unchecked_call", "answers"),
    [
        (
            "llama3",
            {"type": "object"},
            '{"name": "get_time", "parameters": {"bogus": 1}}',
            ['{"x": 1}', '{"name": "get_time", "ok": true}'],
        ),
        (
            "mistral",
            {"type": "array", "items": {"type": "object"}},
            '[{"name": "get_time", "arguments": {"bogus": 1}}]',
            ['[{"x": 1}]', '[{"name": "get_time"}]'],
        ),
    ],
)
def test_an_answer_is_never_a_call_whose_arguments_went_unchecked(
    name: str,
    answer: dict[str, Any],
    unchecked_call: str,
    answers: list[str],
    vocab: Vocabulary,
    codec: TextCodec,
) -> None:
    """A bare call is read by its arguments key: an open answer could have been a call
    to a real function with any arguments. The answer may not carry that key there."""
    fmt = replace(FORMATS[name], answer=json.dumps(answer))
    spec = GrammarSpec.tool_calls(fmt)
    assert not _takes(spec, unchecked_call, vocab, codec)
    for text in answers:
        assert _takes(spec, text, vocab, codec), text


def test_the_answer_travels_only_when_there_is_one() -> None:
    plain = FORMATS["hermes"]
    assert "answer" not in json.loads(plain.to_json())  # what stages before 0.5.1 read
    with_answer = replace(plain, answer=json.dumps(ANSWER))
    assert ToolCallFormat.from_json(with_answer.to_json()) == with_answer


def test_an_answer_that_is_no_schema_is_a_400_naming_response_format(vocab: Vocabulary) -> None:
    source = json.dumps({"functions": [{"name": "f"}], "answer": '["no"]'})
    with pytest.raises(InvalidRequestError) as caught:
        compile_grammar(GrammarSpec("tool_calls", source), vocab)
    assert caught.value.param == "response_format"


@pytest.mark.parametrize("name", ["nested", "array_of_objects", "pattern", "any_of_ref"])
def test_replay_gives_the_live_mask(name: str, vocab: Vocabulary) -> None:
    compiled = compile_grammar(schema_spec(SCHEMAS[name]), vocab)
    live = Constraint(compiled)
    generator = torch.Generator().manual_seed(3)
    tokens: list[int] = []
    masks: list[torch.Tensor] = []  # the live state's mask before each token
    while not live.finished:
        masks.append(live.allowed())
        masked = live.mask(torch.randn(vocab.logits_width, generator=generator) * 3.0)
        token = int(torch.multinomial(torch.softmax(masked, dim=-1), 1, generator=generator))
        live.accept(token)
        tokens.append(token)
    assert len(tokens) >= 6
    for n in (0, 1, len(tokens) // 2, len(tokens) - 1):
        replayed = Constraint.replay(compiled, tokens[:n])
        assert replayed.length == n
        assert torch.equal(replayed.allowed(), masks[n]), n
    assert Constraint.replay(compiled, tokens).finished


def test_replay_then_continue_matches_the_live_mask(vocab: Vocabulary) -> None:
    compiled = compile_grammar(schema_spec(SCHEMAS["array_bounds"]), vocab)
    live = Constraint(compiled)
    tokens = generate(live, seed=11, limit=5)
    replayed = Constraint.replay(compiled, tokens)
    assert torch.equal(live.allowed(), replayed.allowed())
    following = int(torch.nonzero(live.allowed())[0])
    live.accept(following)
    replayed.accept(following)
    assert torch.equal(live.allowed(), replayed.allowed())


def test_sessions_share_a_grammar_not_a_state(vocab: Vocabulary) -> None:
    compiled = compile_grammar(schema_spec(SCHEMAS["flat"]), vocab)
    assert compile_grammar(schema_spec(SCHEMAS["flat"]), vocab) is compiled  # cached
    first, second = Constraint(compiled), Constraint(compiled)
    initial = second.allowed()
    generate(first, seed=5, limit=4)
    assert torch.equal(second.allowed(), initial)
    assert not torch.equal(first.allowed(), initial)


def test_sessions_on_threads_draw_what_they_draw_alone(vocab: Vocabulary) -> None:
    compiled = compile_grammar(schema_spec(SCHEMAS["flat"]), vocab)
    alone = [generate(Constraint(compiled), seed) for seed in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda seed: generate(Constraint(compiled), seed), range(4)))
    assert together == alone
    assert len({tuple(t) for t in alone}) == 4


def test_a_token_the_grammar_refuses_raises(vocab: Vocabulary, codec: TextCodec) -> None:
    constraint = Constraint(compile_grammar(schema_spec(SCHEMAS["flat"]), vocab))
    refused = codec.tokenizer.token_to_id("hello")
    assert refused is not None and not bool(constraint.allowed()[refused])
    with pytest.raises(InternalError, match="not allowed"):
        constraint.accept(refused)


def test_eos_only_once_finished(vocab: Vocabulary) -> None:
    constraint = Constraint(compile_grammar(schema_spec(SCHEMAS["booleans"]), vocab))
    assert not bool(constraint.allowed()[sorted(vocab.eos_ids)].any())
    generate(constraint, seed=2)
    assert constraint.finished
    allowed = torch.nonzero(constraint.allowed()).flatten().tolist()
    assert allowed and set(allowed) <= vocab.eos_ids


def test_padded_logits_rows_are_always_masked(codec: TextCodec, width: int) -> None:
    padded = Vocabulary.for_tokenizer(codec.tokenizer, width + PADDING, codec.eos_ids)
    assert padded.tokenizer_size == width
    constraint = Constraint(compile_grammar(GrammarSpec("json_object", ""), padded))
    bias = torch.zeros(width + PADDING)
    bias[width:] = 1e4  # the padded rows are the likeliest by far
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        logits = torch.randn(width + PADDING, generator=generator) + bias
        masked = constraint.mask(logits)
        assert torch.isneginf(masked[width:]).all()
        constraint.accept(int(torch.argmax(masked)))


def test_the_vocabulary_is_cached(vocab: Vocabulary, codec: TextCodec, width: int) -> None:
    assert Vocabulary.for_tokenizer(codec.tokenizer, width, codec.eos_ids) is vocab


def test_a_mask_of_the_wrong_width_is_a_bug(vocab: Vocabulary, width: int) -> None:
    constraint = Constraint(compile_grammar(GrammarSpec("json_object", ""), vocab))
    with pytest.raises(InternalError):
        constraint.mask(torch.zeros(width + 1))


BAD_SCHEMAS = {
    "unknown type": '{"type": "frobnicate"}',
    "not json": "{type: object",
    "a list": '[{"type": "object"}]',
    "a string": '"object"',
    "bad pattern": '{"type": "string", "pattern": "(("}',
    "unknown format": '{"type": "string", "format": "frobnicate"}',
    "dangling ref": '{"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}',
    "oversize": json.dumps({"type": "object", "description": "x" * MAX_GRAMMAR_BYTES}),
    # Integers past 64 bits, which llguidance cannot take in (a 500 before 0.5.2).
    "huge minimum": '{"type": "integer", "minimum": 100000000000000000000}',
    "huge default": '{"type": "object", "properties": {"n": {"type": "integer", '
    '"default": 100000000000000000000}}}',
    "huge enum": '{"enum": [1, -100000000000000000000]}',
    # Deeper than llguidance reads (a 500 from Python's recursion limit before 0.5.4).
    "nested 128 deep": '{"type": "array", "items": ' * 127 + "{}" + "}" * 127,
    "nested 600 deep": '{"type": "array", "items": ' * 600 + "{}" + "}" * 600,
}


@pytest.mark.parametrize("name", sorted(BAD_SCHEMAS))
def test_a_schema_that_cannot_be_enforced_is_a_400(name: str, vocab: Vocabulary) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        compile_grammar(GrammarSpec("json_schema", BAD_SCHEMAS[name]), vocab)
    assert caught.value.param == "response_format"
    assert caught.value.status == 400
    assert len(str(caught.value)) < 400


NAMED = obj({"name": NAME, "n": {"type": "integer", "minimum": 0, "maximum": 9}}, [])
# Keywords llguidance cannot enforce, each in a schema a client might send (pydantic writes
# `uniqueItems` for a set, `propertyNames` for a dict with Literal keys, and so on).
UNENFORCED = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}},
    "not": {"type": "string", "maxLength": 4, "not": {"const": "no"}},
    "if/then/else": {
        "type": "string",
        "if": {"maxLength": 2},
        "then": {"pattern": "^a"},
        "else": {"pattern": "^b"},
    },
    "dependentRequired": {**NAMED, "dependentRequired": {"name": ["n"]}},
    "propertyNames": {
        "type": "object",
        "propertyNames": {"pattern": "^[a-z]+$"},
        "additionalProperties": {"type": "integer"},
    },
    "minProperties of optional ones": {
        **NAMED,
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "minProperties": 1,
    },
    "unevaluatedProperties": {**NAMED, "unevaluatedProperties": False},
}


@pytest.mark.parametrize("name", sorted(UNENFORCED))
def test_what_cannot_be_enforced_is_refused_strict_and_dropped_otherwise(
    name: str, vocab: Vocabulary, codec: TextCodec, width: int
) -> None:
    schema = UNENFORCED[name]
    with pytest.raises(InvalidRequestError) as caught:  # as a strict schema sends it
        compile_grammar(schema_spec(schema), vocab)
    assert caught.value.param == "response_format"
    # Not strict: deep in a schema too, the rest of which is still enforced.
    nested = obj({"inner": {"type": "array", "items": schema, "maxItems": 2}}, ["inner"])
    loose = relaxed(nested)
    constraint = Constraint(compile_grammar(schema_spec(loose), vocab))
    value = json.loads(codec.decode(generate(constraint, 3, structure_bias(codec, width))))
    assert constraint.finished
    jsonschema.validate(value, loose)
    assert _takes(schema_spec(loose), '{"inner": []}', vocab, codec)
    assert not _takes(schema_spec(loose), "{}", vocab, codec)  # required
    assert not _takes(schema_spec(loose), '{"inner": [], "x": 1}', vocab, codec)  # closed


def test_relaxing_drops_keywords_of_subschemas_only() -> None:
    data = {"not": 1, "uniqueItems": True}  # a value, not a schema: kept as it is
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "array", "uniqueItems": True, "const": [data]},
            "tags": {"type": "array", "items": {"type": "string", "not": {"const": ""}}},
        },
        "$defs": {"T": {"anyOf": [{"type": "array", "contains": {"type": "integer"}}]}},
        "required": ["not", "tags"],
        "minProperties": 1,  # llguidance counts the properties of this object
        "default": {"uniqueItems": True},
    }
    assert relaxed(schema) == {
        "type": "object",
        "properties": {
            "not": {"type": "array", "const": [data]},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "$defs": {"T": {"anyOf": [{"type": "array"}]}},
        "required": ["not", "tags"],
        "minProperties": 1,
        "default": {"uniqueItems": True},
    }
    # Optional properties beside free ones: llguidance cannot count them, the bound goes.
    free = {**schema, "required": ["tags"], "additionalProperties": True, "minProperties": 2}
    assert "minProperties" not in relaxed(free)
    # What can be enforced stays as it is; what is wrong otherwise stays wrong.
    assert relaxed(SCHEMAS["flat"]) is SCHEMAS["flat"]
    deep = json.loads(BAD_SCHEMAS["nested 600 deep"])
    assert relaxed(deep) is deep  # (compile_grammar refuses it)
    assert relaxed({"type": "frobnicate", "uniqueItems": True}) == {"type": "frobnicate"}


# Bounds as schema generators write them for an int64, a double or a float32: llguidance
# makes no grammar of them as they are.
WIDE_BOUNDS = {
    "int64": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    "uint64": {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},
    "double": {"type": "number", "minimum": -1.7976931348623157e308, "maximum": 1.7e308},
    "float32 exclusive": {
        "type": "number",
        "exclusiveMinimum": -3.4028234663852886e38,
        "exclusiveMaximum": 3.4028234663852886e38,
    },
    "positive double": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e300},
}


@pytest.mark.parametrize("name", sorted(WIDE_BOUNDS))
def test_wide_bounds_are_narrowed_so_that_every_reply_still_meets_them(
    name: str, vocab: Vocabulary, codec: TextCodec
) -> None:
    schema = obj({"n": WIDE_BOUNDS[name], "m": WIDE_BOUNDS[name]})
    if name != "uint64":  # (llguidance takes that one as it is)
        with pytest.raises(InvalidRequestError):
            compile_grammar(schema_spec(schema), vocab)
    spec = schema_spec(as_enforced(schema))  # as a strict schema is sent
    for seed in range(3):
        constraint = Constraint(compile_grammar(spec, vocab))
        value = json.loads(codec.decode(generate(constraint, seed)))
        assert constraint.finished
        jsonschema.validate(value, schema)  # the schema as the client wrote it
    negatives = name in ("int64", "double", "float32 exclusive")
    assert _takes(spec, '{"n": -12, "m": 7}', vocab, codec) == negatives


def test_an_unknown_format_is_an_annotation_and_a_known_one_is_enforced(
    vocab: Vocabulary, codec: TextCodec
) -> None:
    schema = obj(
        {
            "data": {"type": "string", "format": "binary", "maxLength": 8},  # pydantic bytes
            "key": {"type": "string", "format": "password", "maxLength": 8},  # SecretStr
            "id": {"type": "integer", "format": "int64", "minimum": 0, "maximum": 99},
            "at": {"type": "string", "format": "date"},
        }
    )
    with pytest.raises(InvalidRequestError):  # as written
        compile_grammar(schema_spec(schema), vocab)
    spec = schema_spec(as_enforced(schema))  # strict or not
    assert json.loads(spec.source)["properties"]["at"]["format"] == "date"
    constraint = Constraint(compile_grammar(spec, vocab))
    value = json.loads(codec.decode(generate(constraint, 5)))
    assert constraint.finished
    jsonschema.validate(value, schema)
    good = '{"data": "x", "key": "y", "id": 3, "at": "2026-12-05"}'
    assert _takes(spec, good, vocab, codec)
    assert not _takes(spec, good.replace("2026-12-05", "yesterday"), vocab, codec)


def test_a_bound_that_cannot_be_narrowed_is_refused_strict_and_dropped_otherwise(
    vocab: Vocabulary,
) -> None:
    far = obj({"n": {"type": "number", "minimum": 1e30}, "k": {"type": "integer", "maximum": 3}})
    assert as_enforced(far) == far
    with pytest.raises(InvalidRequestError):
        compile_grammar(schema_spec(as_enforced(far)), vocab)
    loose = relaxed(as_enforced(far))
    assert loose["properties"] == {"n": {"type": "number"}, "k": far["properties"]["k"]}
    compile_grammar(schema_spec(loose), vocab)


BAD_TOOLS = {
    "not json": "{",
    "no functions": '{"functions": []}',
    "bad name": '{"functions": [{"name": "no spaces allowed"}]}',
    "same name twice": '{"functions": [{"name": "f"}, {"name": "f"}]}',
    "unknown key": '{"functions": [{"name": "f"}], "prelude": "x"}',
    "bad schema": '{"functions": [{"name": "f", "parameters": {"type": "frobnicate"}}]}',
    "parallel not bool": '{"functions": [{"name": "f"}], "parallel": "yes"}',
    "nested 600 deep": '{"functions": [{"name": "f", "parameters": '
    + '{"type": "array", "items": ' * 600
    + "{}"
    + "}" * 601
    + "]}",
}


@pytest.mark.parametrize("name", sorted(BAD_TOOLS))
def test_a_bad_tool_format_is_a_400_naming_tools(name: str, vocab: Vocabulary) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        compile_grammar(GrammarSpec("tool_calls", BAD_TOOLS[name]), vocab)
    assert caught.value.param == "tools"


def test_the_wire_form_round_trips() -> None:
    spec = schema_spec(SCHEMAS["nested"])
    wire = spec.to_wire()
    assert wire == ["json_schema", spec.source]
    assert all(isinstance(x, str) for x in wire)
    assert GrammarSpec.from_wire(wire) == spec
    assert GrammarSpec.from_wire(("json_object", "")) == GrammarSpec("json_object")


@pytest.mark.parametrize(
    "value",
    [
        "json_object",
        ["json_object"],
        ["regex", "a+"],
        ["json_schema", 7],
        ["json_schema", "x" * (MAX_GRAMMAR_BYTES + 1)],
        {"kind": "json_object", "source": ""},
    ],
)
def test_a_bad_wire_form_is_refused(value: object) -> None:
    with pytest.raises(ValueError):
        GrammarSpec.from_wire(value)
