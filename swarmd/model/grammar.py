"""Constrained decoding: a reply that must match a JSON schema, any JSON object, or a
tool call format, enforced token by token with llguidance.

Why llguidance (shared/notes/grammar.md has the figures): it builds its tokenizer from
the `tokenizer.json` text itself (xgrammar needs transformers and pulls in triton, about
1 GB), compiles a schema in about 1 ms (xgrammar ~10 ms), and its Lark grammars embed JSON
schemas (`%json`), which the tool call formats need. Its mask, ~0.1 ms a token (p99 ~1 ms)
on this CPU, is 3-4x xgrammar's but a few percent of a decode step at most.

The pieces, all pure and typed:

- `GrammarSpec` (kind, source): what a request asks for, as plain text that rides in the
  session's open frame (`to_wire` / `from_wire`, at most `MAX_GRAMMAR_BYTES`);
- `ToolCallFormat`: the functions a tool call may name and the text around each call
  (Hermes/Qwen `<tool_call>`, Llama 3 bare JSON, Mistral `[TOOL_CALLS]`); its JSON is a
  `tool_calls` spec's source;
- `Vocabulary`: a model's tokenizer, logits width and EOS ids, built once per model;
- `compile_grammar(spec, vocab)`: the spec checked and compiled (an LRU cache per
  vocabulary); a spec that cannot be enforced is an `InvalidRequestError` naming
  `response_format` (or `tools`), never a 500;
- `Constraint`: one reply's state, next to its sampler on the last stage: `mask` the
  logits, `accept` the drawn token; `Constraint.replay` rebuilds it from the reply's tokens
  after a failover. Each session owns its own; sessions share the compiled grammar.

Layout: JSON is compact with `", "` and `": "` separators and no free whitespace. A
model left free to add whitespace may emit newlines forever (a known failure of
unconstrained layouts); `json.dumps`' layout is also the one models saw most. Objects that
list `properties` and do not say otherwise get `additionalProperties: false`, as OpenAI's
strict mode requires: a small model offered free keys invents them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import llguidance
import numpy as np
from tokenizers import Tokenizer

from swarmd.errors import InternalError, InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    import torch

GrammarKind = Literal["json_object", "json_schema", "tool_calls"]
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)
MAX_GRAMMAR_BYTES = 64 * 1024  # a spec's source, UTF-8 (schemas of real APIs are far smaller)
# Objects and arrays in a spec's source, nested: real schemas take a few dozen; llguidance
# gives up at about 300 and a walk over one in Python recursing that deep would overflow.
MAX_SCHEMA_DEPTH = 128
MAX_TOOL_FUNCTIONS = 128  # OpenAI's bound on `tools`
MAX_WRAPPER_CHARS = 256  # each text around a call
COMPILED_CACHE_SIZE = 64  # compiled grammars kept per vocabulary
VOCABULARY_CACHE_SIZE = 4  # tokenizers kept (a node serves one model, or a few)
_ERROR_CHARS = 300  # of a library message quoted back to the client

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_SEPARATORS = (", ", ": ")
_NO_ARGUMENTS = {"type": "object", "properties": {}}  # a function that lists no parameters
_LAYOUT = {
    "whitespace_flexible": False,
    "item_separator": _SEPARATORS[0],
    "key_separator": _SEPARATORS[1],
}
# Short error messages: the verbose ones dump parser state and grammar into the reply.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# Row b: the logits bias of the 8 tokens whose bits are byte b (bit k: token 8i + k).
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0.0),
    np.float32(-np.inf),
).astype(np.float32)


@dataclass(frozen=True)
class GrammarSpec:
    """What the reply must match.

    - `json_object`: any JSON object; `source` is "" (ignored);
    - `json_schema`: `source` is the schema's JSON text (an object: a JSON schema);
    - `tool_calls`: `source` is a `ToolCallFormat`'s JSON (`ToolCallFormat.to_json`).
    """

    kind: GrammarKind
    source: str = ""

    @functools.cached_property
    def has_answer(self) -> bool:
        """A tool-call format whose reply may be an answer instead (`ToolCallFormat.answer`)."""
        if self.kind != "tool_calls":
            return False
        try:
            data = json.loads(self.source)
        except ValueError:
            return False
        return isinstance(data, dict) and bool(data.get("answer"))

    @property
    def param(self) -> str:
        """The request parameter a refusal of this spec names."""
        return "tools" if self.kind == "tool_calls" else "response_format"

    def to_wire(self) -> list[str]:
        """`[kind, source]`: two strings, for a msgpack frame."""
        return [self.kind, self.source]

    @classmethod
    def from_wire(cls, value: object) -> GrammarSpec:
        """The inverse of `to_wire`, checked (it comes from a peer). ValueError if bad."""
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise ValueError("a grammar is [kind, source]")
        kind, source = value
        if kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}")
        if not isinstance(source, str) or len(source.encode()) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"a grammar's source is a string of at most {MAX_GRAMMAR_BYTES} B")
        return cls(cast(GrammarKind, kind), source)

    @classmethod
    def tool_calls(cls, fmt: ToolCallFormat) -> GrammarSpec:
        return cls("tool_calls", fmt.to_json())


@dataclass(frozen=True)
class ToolFunction:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)  # a JSON schema; {}: no arguments


@dataclass(frozen=True)
class ToolCallFormat:
    """One or more calls, and only calls: `prefix call (separator call)* suffix`, where
    each call is `begin {"<name_key>": "<name>", "<arguments_key>": {...}} end` and the
    arguments validate against the named function's `parameters`.

    The defaults are Hermes/Qwen's. The others:
    - Llama 3 (JSON tool calling): `begin=end=""`, `arguments_key="parameters"`,
      `parallel=False`: `{"name": "f", "parameters": {...}}`;
    - Mistral: `prefix="[TOOL_CALLS][", begin=end="", separator=", ", suffix="]"`.

    Every text is matched as text. A special token of the same spelling (Qwen's
    `<tool_call>`, Mistral's `[TOOL_CALLS]`) is masked like every special token, so the
    reply, decoded without special tokens, still holds the wrapper a parser looks for.
    """

    functions: tuple[ToolFunction, ...]
    prefix: str = ""  # once, before the first call
    begin: str = "<tool_call>\n"  # before each call
    end: str = "\n</tool_call>"  # after each call
    separator: str = "\n"  # between two calls
    suffix: str = ""  # once, after the last call
    name_key: str = "name"
    arguments_key: str = "arguments"
    parallel: bool = True  # several calls may follow each other (else exactly one)
    # The JSON text of a schema the whole reply may match instead of calls: tools offered
    # with a JSON `response_format` ("" = calls only). Sent only when set, so a format
    # without it is what stages before 0.5.1 read.
    answer: str = ""

    @classmethod
    def hermes(cls, functions: Iterable[ToolFunction], parallel: bool = True) -> ToolCallFormat:
        return cls(tuple(functions), parallel=parallel)

    @classmethod
    def llama3_json(cls, functions: Iterable[ToolFunction]) -> ToolCallFormat:
        return cls(tuple(functions), begin="", end="", arguments_key="parameters", parallel=False)

    @classmethod
    def mistral(cls, functions: Iterable[ToolFunction], parallel: bool = True) -> ToolCallFormat:
        return cls(
            tuple(functions),
            prefix="[TOOL_CALLS][",
            begin="",
            end="",
            separator=", ",
            suffix="]",
            parallel=parallel,
        )

    def to_json(self) -> str:
        data = {
            "functions": [{"name": f.name, "parameters": f.parameters} for f in self.functions],
            **{k: getattr(self, k) for k in _FORMAT_TEXTS},
            "parallel": self.parallel,
            **({"answer": self.answer} if self.answer else {}),
        }
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> ToolCallFormat:
        """Parse and check a `tool_calls` source; InvalidRequestError naming `tools`."""
        data = _json_value(text, "tools")
        if not isinstance(data, dict):
            raise _Refusal("tools", "the tool call format is not a JSON object")
        unknown = set(data) - {"functions", "parallel", "answer", *_FORMAT_TEXTS}
        if unknown:
            raise _Refusal("tools", f"unknown keys in the tool call format: {sorted(unknown)}")
        raw = data.get("functions")
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_TOOL_FUNCTIONS:
            raise _Refusal("tools", f"between 1 and {MAX_TOOL_FUNCTIONS} functions are needed")
        functions = tuple(_function(item) for item in raw)
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise _Refusal("tools", "two functions have the same name")
        texts: dict[str, str] = {}
        for key in _FORMAT_TEXTS:
            value = data.get(key, getattr(cls, key))
            if not isinstance(value, str) or len(value) > MAX_WRAPPER_CHARS:
                raise _Refusal("tools", f"'{key}' must be a string of at most 256 characters")
            texts[key] = value
        if not texts["name_key"] or not texts["arguments_key"]:
            raise _Refusal("tools", "'name_key' and 'arguments_key' must not be empty")
        if texts["name_key"] == texts["arguments_key"]:
            raise _Refusal("tools", "'name_key' and 'arguments_key' must differ")
        parallel = data.get("parallel", True)
        if not isinstance(parallel, bool):
            raise _Refusal("tools", "'parallel' must be true or false")
        answer = data.get("answer", "")
        if not isinstance(answer, str) or (
            answer and not isinstance(_json_value(answer, "response_format"), dict)
        ):
            raise _Refusal("response_format", "the answer's schema is not a JSON object")
        return cls(functions, parallel=parallel, answer=answer, **texts)


_FORMAT_TEXTS = ("prefix", "begin", "end", "separator", "suffix", "name_key", "arguments_key")


def _function(item: object) -> ToolFunction:
    if not isinstance(item, dict) or set(item) - {"name", "parameters"}:
        raise _Refusal("tools", "a function is {'name': ..., 'parameters': {...}}")
    name = item.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise _Refusal("tools", f"a function name must match {_FUNCTION_NAME.pattern}")
    parameters = item.get("parameters", {})
    if not isinstance(parameters, dict):
        raise _Refusal("tools", f"the parameters of '{name}' are not a JSON schema object")
    return ToolFunction(name, parameters)


class Vocabulary:
    """A model's tokenizer as the grammar library sees it, built once per model (0.5 s
    for SmolLM2's): the token bytes, the logits width and the EOS ids.

    `logits_width` is the model config's `vocab_size`, the width of its logits. It may
    exceed the tokenizer's vocabulary (padded embeddings): those rows are never allowed.
    """

    def __init__(self, tokenizer: Tokenizer, logits_width: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.logits_width = logits_width
        self.eos_ids = frozenset(i for i in eos_ids if 0 <= i < logits_width)
        if not self.eos_ids:
            raise ModelLoadError("constrained decoding needs an EOS token inside the logits")
        n_vocab = max(logits_width, self.tokenizer_size)
        self._llg = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=n_vocab, eos_token=sorted(self.eos_ids)
        )
        self._words = (n_vocab + 31) // 32  # int32 words of a bitmask
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()

    @classmethod
    def load(cls, tokenizer_json: Path, logits_width: int, eos_ids: Iterable[int]) -> Vocabulary:
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # tokenizers raises plain Exceptions for bad files
            raise ModelLoadError(f"Cannot load the tokenizer {tokenizer_json}: {exc}") from exc
        return cls.for_tokenizer(tokenizer, logits_width, eos_ids)

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Tokenizer, logits_width: int, eos_ids: Iterable[int]
    ) -> Vocabulary:
        """The cached vocabulary of this tokenizer (the same text), width and EOS ids."""
        eos = tuple(sorted(set(eos_ids)))
        digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
        key = (digest, logits_width, eos)
        with _VOCABULARIES_LOCK:
            found = _VOCABULARIES.get(key)
            if found is not None:
                _VOCABULARIES.move_to_end(key)
                return found
        built = cls(tokenizer, logits_width, eos)
        with _VOCABULARIES_LOCK:
            found = _VOCABULARIES.setdefault(key, built)
            _VOCABULARIES.move_to_end(key)
            while len(_VOCABULARIES) > VOCABULARY_CACHE_SIZE:
                _VOCABULARIES.popitem(last=False)
        return found


_VOCABULARIES: OrderedDict[tuple[str, int, tuple[int, ...]], Vocabulary] = OrderedDict()
_VOCABULARIES_LOCK = threading.Lock()


class CompiledGrammar:
    """A spec compiled for one vocabulary: shared by every session that asks for it."""

    def __init__(self, spec: GrammarSpec, vocab: Vocabulary, matcher: llguidance.LLMatcher):
        self.spec = spec
        self.vocab = vocab
        self._initial = matcher  # never advanced: each session starts from a copy
        self._lock = threading.Lock()

    def _fresh(self) -> llguidance.LLMatcher:
        with self._lock:  # one copy at a time from the shared initial state
            return self._initial.deep_copy()


def compile_grammar(spec: GrammarSpec, vocab: Vocabulary) -> CompiledGrammar:
    """The spec checked and compiled (cached per vocabulary, least recently used out).

    InvalidRequestError (param `response_format`, or `tools` for tool calls) when the
    source is too big, not JSON, not an object, or a schema the library cannot enforce.
    """
    with vocab._lock:
        found = vocab._compiled.get(spec)
        if found is not None:
            vocab._compiled.move_to_end(spec)
            return found
    compiled = CompiledGrammar(spec, vocab, _matcher(spec, vocab))
    with vocab._lock:
        found = vocab._compiled.setdefault(spec, compiled)
        vocab._compiled.move_to_end(spec)
        while len(vocab._compiled) > COMPILED_CACHE_SIZE:
            vocab._compiled.popitem(last=False)
    return found


def check_tool_parameters(functions: Sequence[ToolFunction], vocab: Vocabulary) -> None:
    """Each function's `parameters` compiled as the schema its arguments must match
    (cached): InvalidRequestError naming `tools[i].function.parameters` of the first
    that cannot be enforced. Under tool_choice "auto" no grammar holds the calls, and a
    forced call's grammar would name only `tools`: a schema the model's calls can never
    be held to is the request's fault either way."""
    for i, function in enumerate(functions):
        schema = function.parameters or _NO_ARGUMENTS
        spec = GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False))
        try:
            compile_grammar(spec, vocab)
        except _Refusal as exc:
            where = f"tools[{i}].function.parameters"
            raise _Refusal(where, exc.reason) from exc


def _matcher(spec: GrammarSpec, vocab: Vocabulary) -> llguidance.LLMatcher:
    param = spec.param
    if spec.kind not in GRAMMAR_KINDS:
        raise _Refusal(param, f"unknown grammar kind {spec.kind!r}")
    if len(spec.source.encode()) > MAX_GRAMMAR_BYTES:
        raise _Refusal(param, f"the schema is over {MAX_GRAMMAR_BYTES} bytes")
    try:
        if spec.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(_laid_out({"type": "object"}))
        elif spec.kind == "json_schema":
            schema = _json_value(spec.source, param)
            if not isinstance(schema, dict):
                raise _Refusal(param, "the schema is not a JSON object")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(_laid_out(_closed(schema)))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(
                _tool_calls_lark(ToolCallFormat.from_json(spec.source))
            )
    except (ValueError, TypeError, OverflowError) as exc:
        # What the client's schema holds that llguidance cannot take in (an integer past
        # 64 bits, anywhere, even in `default` or `examples`): the request's fault.
        raise _Refusal(param, f"the schema cannot be enforced: {exc}") from exc
    # The constructor never raises for a grammar's faults: it enters an error state.
    matcher = llguidance.LLMatcher(vocab._llg, grammar, log_level=0, limits=_LIMITS)
    if matcher.is_error():
        raise _Refusal(param, f"the schema cannot be enforced: {matcher.get_error()}")
    return matcher


def _laid_out(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with swarmd's layout (a client's own `x-guidance` is replaced)."""
    return {**{k: v for k, v in schema.items() if k != "x-guidance"}, "x-guidance": _LAYOUT}


def _closed(schema: Any, root: Any = None) -> Any:
    """`additionalProperties: false` on every object that lists properties and is silent.

    Only subschemas are visited: a `const` or `enum` value, or a property that happens to
    be named "properties", is data and stays as it is. An `allOf` of plain objects (the
    usual `allOf: [{"$ref": Base}]` beside its own `properties`) is merged into the
    schema first: closed one by one, each branch would refuse the others' properties,
    and no object could satisfy them all."""
    if not isinstance(schema, dict):
        return schema
    root = schema if root is None else root
    out = _subschemas_mapped(_merge_all_of(dict(schema), root), lambda s: _closed(s, root))
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# What an `allOf` branch may say to be merged into its parent: a plain object.
_MERGEABLE = frozenset({"type", "properties", "required", "title", "description"})


def _merge_all_of(schema: dict[str, Any], root: Any) -> dict[str, Any]:
    """`schema` with the plain-object branches of its `allOf` (inline, or a local `$ref`
    to one) merged in: their properties beside its own (a name in both must satisfy
    both), their `required` added. Other branches stay in `allOf`."""
    branches = schema.get("allOf")
    own, wanted = schema.get("properties", {}), schema.get("required", [])
    if not (isinstance(branches, list) and isinstance(own, dict) and isinstance(wanted, list)):
        return schema  # (a malformed schema stays as it came: llguidance says what is wrong)
    properties, required, rest = dict(own), list(wanted), []
    for branch in branches:
        target = _local_ref(branch, root)
        plain = isinstance(target, dict) and set(target) <= _MERGEABLE
        props = target.get("properties", {}) if plain else None
        needs = target.get("required", []) if plain else None
        if not (isinstance(props, dict) and isinstance(needs, list)) or (
            target.get("type", "object") != "object"
        ):
            rest.append(branch)
            continue
        for name, sub in props.items():
            properties[name] = {"allOf": [properties[name], sub]} if name in properties else sub
        required += [n for n in needs if n not in required]
    if len(rest) == len(branches):
        return schema
    out = {k: v for k, v in schema.items() if k != "allOf"}
    out["properties"] = properties
    out.setdefault("type", "object")
    if required:
        out["required"] = required
    if rest:
        out["allOf"] = rest
    return out


def _local_ref(branch: Any, root: Any) -> Any:
    """What a branch `{"$ref": "#/..."}` points to in `root` (None when it cannot be
    found); any other branch as it is."""
    if not (isinstance(branch, dict) and set(branch) == {"$ref"}):
        return branch
    ref = branch["$ref"]
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def held_form(schema: dict[str, Any], strict: bool) -> dict[str, Any]:
    """A client's schema (`response_format`'s, a tool's `parameters`) as the stages are
    sent it: `as_enforced`, and `relaxed` unless `strict` (its depth checked once)."""
    if _deeper_than(schema, MAX_SCHEMA_DEPTH):
        return schema  # (too deep: `compile_grammar` says so)
    enforced = _enforced_form(schema, drop_far=False)
    return enforced if strict else _relaxed(enforced)


def as_enforced(schema: Any, drop_far: bool = False) -> Any:
    """`schema` in a form llguidance makes a grammar of, met by every reply that meets it,
    so that a strict schema stays strictly kept:

    - numeric bounds past what llguidance turns into a grammar are brought in to what it
      does (`_BOUND_LIMITS`): `maximum` 2^63 - 1 or 1.8e308 (the range of an int64 or a
      double, as schema generators write it) becomes 2^62 or 1e18; a bound that cannot
      be brought in (a `minimum` of 1e30) stays, for `compile_grammar` to refuse, or
      goes with `drop_far` (`relaxed`);
    - a `format` llguidance does not know (pydantic's "binary" for bytes and "password"
      for a SecretStr, OpenAPI's "int64") is dropped: JSON schema makes a format an
      annotation unless a validator opts in, so any string meets it either way (the
      formats llguidance knows, "date-time", "email", ..., it enforces)."""
    if not isinstance(schema, dict) or _deeper_than(schema, MAX_SCHEMA_DEPTH):
        return schema  # (too deep: `compile_grammar` says so)
    return _enforced_form(schema, drop_far)


def _enforced_form(schema: Any, drop_far: bool) -> Any:
    """`as_enforced` of a schema known to nest within bounds."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("format"), str) and not _known_format(out["format"]):
        del out["format"]
    limit = _bound_limit(out)
    for exclusive, inclusive, sign in _BOUNDS:
        value = out.get(exclusive)
        if _number(value) and sign * value > limit:
            del out[exclusive]
            out.setdefault(inclusive, sign * limit)
        value = out.get(inclusive)
        if _number(value) and sign * value > limit:
            out[inclusive] = sign * limit
    if drop_far:
        for key in _NUMERIC_BOUNDS:
            if _number(out.get(key)) and abs(out[key]) > limit:
                del out[key]
    return _subschemas_mapped(out, lambda s: _enforced_form(s, drop_far))


def _bound_limit(schema: dict[str, Any]) -> float:
    return _BOUND_LIMITS[schema.get("type") in ("integer", ["integer"])]


def _number(value: Any) -> bool:
    return type(value) in (int, float)  # (not a bool: draft 4's exclusiveMaximum: true)


# The bounds llguidance 1.9 makes a grammar of (measured: integers past about 2^63 and
# numbers past 1e18 fail "Failed to generate regex for ... range"): [number, integer].
_BOUND_LIMITS = (1e18, 2**62)
_BOUNDS = (("exclusiveMaximum", "maximum", 1), ("exclusiveMinimum", "minimum", -1))
_NUMERIC_BOUNDS = frozenset(k for pair in _BOUNDS for k in pair[:2])


def relaxed(schema: Any) -> Any:
    """A schema that is not strict, as far as it can be enforced.

    OpenAI enforces a schema only under `strict: true`, where it refuses what it cannot
    enforce; otherwise it takes any schema. So does swarmd: a strict schema is compiled
    as it is (a 400 for what llguidance cannot hold a reply to), one that is not loses
    those keywords (`_UNENFORCED`, numeric bounds `as_enforced` cannot bring in, then
    `minProperties` / `maxProperties`, which llguidance counts only on some objects) and
    is enforced in all the rest: llguidance's "lenient" mode, done here because the
    stages compile what they are sent. A schema wrong in
    another way stays wrong, for `compile_grammar` to refuse."""
    if not isinstance(schema, dict) or _deeper_than(schema, MAX_SCHEMA_DEPTH):
        return schema  # (too deep: `compile_grammar` says so)
    return _relaxed(schema)


def _relaxed(schema: dict[str, Any]) -> dict[str, Any]:
    """`relaxed` of a schema known to nest within bounds."""
    if _enforceable(schema):
        return schema
    out = _enforced_form(_without(schema, _UNENFORCED), drop_far=True)
    return out if _enforceable(out) else _without(out, _COUNTS)


@functools.lru_cache(maxsize=256)
def _known_format(name: str) -> bool:
    return _enforceable({"type": "string", "format": name})


def _enforceable(schema: dict[str, Any]) -> bool:
    """Whether llguidance takes `schema` as `compile_grammar` would give it (no tokenizer
    needed: the grammar alone is checked)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_laid_out(_closed(schema)))
    except (ValueError, TypeError, OverflowError):
        return False
    return not llguidance.LLMatcher.validate_grammar(grammar)


def _without(schema: Any, keywords: frozenset[str]) -> Any:
    """`schema` without `keywords`, in it and every subschema in it (a value, as of
    `const`, `enum` or `default`, is data and stays as it is)."""
    if not isinstance(schema, dict):
        return schema
    kept = {k: v for k, v in schema.items() if k not in keywords}
    return _subschemas_mapped(kept, lambda s: _without(s, keywords))


def _subschemas_mapped(schema: dict[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """`schema` (a fresh dict the caller owns) with `fn` applied to each of its direct
    subschemas, in place."""
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            schema[key] = fn(schema[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            schema[key] = [fn(s) for s in schema[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            schema[key] = {name: fn(s) for name, s in schema[key].items()}
    return schema


_COUNTS = frozenset({"minProperties", "maxProperties"})
# The JSON schema keywords llguidance 1.9 refuses as unimplemented (checked one by one).
_UNENFORCED = frozenset(
    {
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$dynamicRef",
        "$dynamicAnchor",
        "$recursiveRef",
        "$recursiveAnchor",
    }
)
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _tool_calls_lark(fmt: ToolCallFormat) -> str:
    """A Lark grammar: `prefix call (separator call)* suffix`, one `%json` per function
    (each function's schema stays the root of its own `%json`, so its `$ref`s resolve);
    with an `answer`, that or one JSON value of the answer's schema."""
    rules = []
    for i, function in enumerate(fmt.functions):
        # The call's head in the pieces the JSON grammar lexes ("{", a key, ": ", a value,
        # ", "). A bare call ("{" first: Llama 3, Mistral) beside an answer, which is JSON
        # too, is written piece by piece: the lexer extends the longest literal it can, so
        # one long literal would shut out an answer that starts the same way.
        key_sep, item_sep = _SEPARATORS[1], _SEPARATORS[0]
        pieces = ["{", json.dumps(fmt.name_key), key_sep, json.dumps(function.name), item_sep]
        pieces += [json.dumps(fmt.arguments_key), key_sep]
        if fmt.answer and not fmt.begin:
            opening = " ".join(_lit(p) for p in pieces)
        else:
            opening = _lit(fmt.begin + "".join(pieces))
        tail = f"}}{fmt.end}"
        schema = function.parameters or _NO_ARGUMENTS
        args = json.dumps(_laid_out(_closed(schema)), ensure_ascii=False)
        rules.append(f"call_{i}: {opening} args_{i} {_lit(tail)}")
        rules.append(f"args_{i}: %json {args}")
    calls = " | ".join(f"call_{i}" for i in range(len(fmt.functions)))
    more = f" ({_lit(fmt.separator)} call)*" if fmt.parallel else ""
    if fmt.answer:
        schema = json.loads(fmt.answer)
        if not fmt.begin:
            schema = _not_call_shaped(schema, fmt.arguments_key)
        answer = json.dumps(_laid_out(_closed(schema)), ensure_ascii=False)
        rules += ["start: calls | answer", f"answer: %json {answer}"]
    head = "calls" if fmt.answer else "start"
    return "\n".join(
        [
            f"{head}: {_lit(fmt.prefix)} call{more} {_lit(fmt.suffix)}",
            f"call: {calls}",
            *rules,
        ]
    )


def _not_call_shaped(schema: Any, arguments_key: str) -> Any:
    """A bare call (Llama 3's object, Mistral's list of objects) is read as one by its
    `arguments_key`: an answer may not carry that key where a call would, at the top or in
    a top-level list's items, so an answer is never read as a call whose arguments no
    schema checked. (A format that names that key itself keeps it.)"""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("items"), dict):
        out["items"] = _not_call_shaped(out["items"], arguments_key)
    if out.get("type") == "array":
        return out
    properties = out.get("properties")
    if properties is None:  # any keys: all but that one (`_closed` must not shut the rest)
        out["properties"] = {arguments_key: False}
        out.setdefault("additionalProperties", True)
    elif (
        isinstance(properties, dict)
        and arguments_key not in properties
        and out.get("additionalProperties", False) is not False  # else `_closed` shuts it
    ):
        out["properties"] = {**properties, arguments_key: False}
    return out


def _lit(text: str) -> str:
    """A Lark string literal (nothing for "": Lark has no empty literal)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def _json_value(text: str, param: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _Refusal(param, f"not valid JSON: {exc}") from exc
    if _deeper_than(value, MAX_SCHEMA_DEPTH):
        raise _Refusal(param, f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels in `value` (counted without
    recursion: the walks over a schema recurse, a level of it taking a few frames)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        elif not isinstance(node, list):
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in node)
    return False


class _Refusal(InvalidRequestError):
    """A grammar the request asked for that cannot be enforced; `reason` says why."""

    def __init__(self, param: str, reason: str) -> None:
        self.reason = reason[:_ERROR_CHARS]
        super().__init__(f"Invalid '{param}': {self.reason}", param)


class Constraint:
    """One reply's grammar state (mutable; used by one worker thread at a time).

    Per token: `mask(logits)`, draw from what it allows, `accept(token)`. When `finished`
    the grammar is complete and only an EOS id is allowed.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        # torch only here and in the tensor methods: a coordinator compiles a request's
        # grammar to check it (`compile_grammar`) and never holds a Constraint.
        import torch

        self.compiled = compiled
        self._vocab = compiled.vocab
        self._matcher = compiled._fresh()
        self._words = torch.zeros(self._vocab._words, dtype=torch.int32)  # bitmask: [W]
        self.length = 0  # tokens accepted

    @classmethod
    def replay(cls, compiled: CompiledGrammar, tokens: Iterable[int]) -> Constraint:
        """The state after the reply `tokens` (a failover's new last stage)."""
        constraint = cls(compiled)
        for token in tokens:
            constraint.accept(token)
        return constraint

    @property
    def finished(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The reply may end here (EOS is allowed), though it may also go on."""
        return bool(self._matcher.is_accepting())

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens that may come next (never none)."""
        import torch

        return torch.from_numpy(self._bias() == 0.0)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] float32 -> a copy with every disallowed token at -inf."""
        import torch

        if logits.shape != (self._vocab.logits_width,):
            raise InternalError(
                f"grammar mask for {self._vocab.logits_width} logits, given {tuple(logits.shape)}"
            )
        return logits + torch.from_numpy(self._bias())

    def _bias(self) -> np.ndarray:
        """[V] float32: 0 where the grammar allows the token, -inf elsewhere."""
        self._check()
        words = self._words
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        self._check()
        # Bit i % 32 of word i // 32 is token i, so byte i // 8, bit i % 8 of the
        # little-endian bytes; one row of _BYTE_BIAS per byte (unpacking bits and then
        # masked_fill is ~5x slower on this CPU).
        raw = words.numpy().astype("<i4", copy=False).view(np.uint8)
        bias = np.take(_BYTE_BIAS, raw, axis=0).reshape(-1)[: self._vocab.logits_width]
        bias[self._vocab.tokenizer_size :] = -np.inf  # padded logits rows stand for no token
        if not (bias == 0.0).any():
            # The library allows EOS whenever nothing else fits; this only guards the
            # sampler from an all -inf row (softmax of it is NaN).
            bias[sorted(self._vocab.eos_ids)] = 0.0
        return bias

    def accept(self, token: int) -> None:
        """Advance past `token`. InternalError if the grammar does not allow it (the
        library's state is then failed for good: the reply cannot go on)."""
        self._check()
        if not 0 <= token < self._vocab.logits_width or not self._matcher.consume_token(token):
            raise InternalError(
                f"token {token} is not allowed by the grammar after {self.length} tokens"
                + (f": {self._matcher.get_error()}" if self._matcher.is_error() else "")
            )
        self.length += 1

    def _check(self) -> None:
        if self._matcher.is_error():
            raise InternalError(f"the grammar's state failed: {self._matcher.get_error()}")
