"""Request bodies of the OpenAI endpoints, validated with pydantic.

Strict types (a string is not a number), unknown fields refused, and every OpenAI
parameter that swarmd does not serve is named and refused rather than ignored. Every
bound on a value that travels to the stages comes from the one table in
`swarmd.pipeline.bounds`, which the stage wire checks too: what passes here passes there.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmd.errors import InvalidRequestError, UnsupportedError
from swarmd.model.grammar import GrammarSpec, held_form
from swarmd.model.sampling import MAX_TOP_LOGPROBS
from swarmd.model.text import ChatMessage
from swarmd.pipeline import bounds

_STRICT = ConfigDict(strict=True, extra="forbid")
M = TypeVar("M", bound=BaseModel)


def _number(bound: bounds.NumberBound) -> Any:
    """The pydantic field of a number in the bounds table."""
    if bound.lo_open:
        return Annotated[float, Field(gt=bound.lo, le=bound.hi)]
    return Annotated[float, Field(ge=bound.lo, le=bound.hi)]


Temperature = _number(bounds.TEMPERATURE)
# OpenAI's top_p range is [0, 1]; 0 keeps only the likeliest token, which travels as top_k 1
# (`completions._sampling`): the wire's top_p stays above 0, as every stage takes it.
TopP = Annotated[float, Field(ge=0.0, le=bounds.TOP_P.hi)]
MinP = _number(bounds.MIN_P)
PresencePenalty = _number(bounds.PRESENCE_PENALTY)
FrequencyPenalty = _number(bounds.FREQUENCY_PENALTY)
BiasValue = _number(bounds.LOGIT_BIAS_VALUE)
# No upper bound here: past the context it is a context_length_exceeded naming both numbers.
MaxTokens = Annotated[int, Field(ge=1)]


class ContentPart(BaseModel):
    # Loose on purpose: an image part must reach check_supported to be refused by name.
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None

    @property
    def said(self) -> object:
        """The part's text: `text`, or an assistant's `refusal` part's `refusal`."""
        return (self.model_extra or {}).get("refusal") if self.type == "refusal" else self.text


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only where OpenAI allows it: an assistant turn that made tool calls.
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant; checked by tool_calls.py
    tool_call_id: str | None = None  # tool
    # An assistant turn as OpenAI returns it (`message.model_dump()` sent back as history)
    # carries these; a refusal is what the assistant said, the rest say nothing here.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def openai(self) -> dict[str, Any]:
        """The turn as an OpenAI-shaped dict (text parts joined), for the tools renderer."""
        turn: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": None
            if self.content is None and not self.refusal
            else self.to_chat().content,
        }
        if self.tool_calls is not None:
            turn["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn

    @property
    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)

    def check_supported(self, index: int) -> None:
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequestError(
                "Only assistant messages carry tool_calls", f"messages[{index}].tool_calls"
            )
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise InvalidRequestError(
                "A tool message needs its tool_call_id, and only a tool message has one",
                f"messages[{index}].tool_call_id",
            )
        if self.role != "assistant" and self.refusal is not None:
            raise InvalidRequestError(
                "Only assistant messages carry a refusal", f"messages[{index}].refusal"
            )
        if self.audio is not None:
            raise UnsupportedError("Audio is not supported", f"messages[{index}].audio")
        if self.function_call is not None:
            raise UnsupportedError(
                "'function_call' is the deprecated form; use tool_calls",
                f"messages[{index}].function_call",
            )
        said = self.tool_calls or self.refusal is not None
        if self.content is None and not (self.role == "assistant" and said):
            raise InvalidRequestError(
                f"Missing required parameter: 'messages[{index}].content'",
                f"messages[{index}].content",
            )
        for j, part in enumerate(self.content if isinstance(self.content, list) else []):
            where = f"messages[{index}].content[{j}]"
            field = "refusal" if part.type == "refusal" and self.role == "assistant" else "text"
            if part.type != field:
                allowed = "'text' or 'refusal'" if self.role == "assistant" else "'text'"
                raise UnsupportedError(
                    f"Content parts of type '{part.type}' are not supported; only {allowed}",
                    f"{where}.type",
                )
            if not isinstance(part.said, str):
                raise InvalidRequestError(f"Missing required parameter: '{where}.{field}'", where)

    def to_chat(self) -> ChatMessage:
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(p.said or "" for p in self.content)
        text = text or self.refusal or ""  # a refusal dumped beside "" is what was said
        # Chat templates know no "developer" role; it is OpenAI's new name for system.
        return ChatMessage("system" if self.role == "developer" else self.role, text)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # Strict: every keyword enforced, a 400 for one that cannot be; otherwise those are
    # dropped and the rest enforced (`grammar.held_form`), as OpenAI's non-strict mode takes
    # any schema. Either way the reply is held to the schema by constrained decoding.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        """The reply's grammar: None for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_object", "")
        if self.json_schema is None:
            raise InvalidRequestError(
                "response_format of type 'json_schema' needs 'json_schema'",
                "response_format.json_schema",
            )
        schema = self.json_schema.schema_
        if schema is None:  # a name alone: any JSON object
            return GrammarSpec("json_object", "")
        schema = held_form(schema, bool(self.json_schema.strict))
        return GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":")))


# OpenAI's bounds on `metadata`: 16 pairs, keys of 64 characters, values of 512.
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted: no chunk is padded here


class SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = _STRICT
    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # -1 or 0 = off (vLLM's extension); at or over the vocabulary, off too (bounds.wire_top_k)
    top_k: Annotated[int, Field(ge=bounds.TOP_K_MIN)] | None = None
    min_p: MinP | None = None
    max_tokens: MaxTokens | None = None
    stop: (
        str
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=bounds.MAX_STOP)]
        | None
    ) = None
    seed: Annotated[int, Field(ge=bounds.SEED_MIN, le=bounds.SEED_MAX)] | None = None
    # OpenAI documents these as nullable, and some clients send null: null = the default.
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: PresencePenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None
    # More entries than a stage takes is a 400 naming logit_bias, never a failed route.
    logit_bias: Annotated[dict[str, BiasValue], Field(max_length=bounds.MAX_LOGIT_BIAS)] | None = (
        None
    )
    user: str | None = None  # accepted; a node keeps no per-user state
    safety_identifier: str | None = None  # `user`'s successor: the same
    # Accepted and without effect here: nothing is stored, there are no tiers, and prefix
    # reuse finds a conversation by its tokens, not by a key.
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    n: Annotated[int, Field(ge=1, le=bounds.N_MAX)] | None = None  # choices to draw
    return_token_ids: bool | None = None  # vLLM's extension: token ids in the reply

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float]:
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            # isdigit() alone accepts '²', which int() refuses.
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias key '{key}' is not a token id below {vocab_size}", "logit_bias"
                )
            bias[int(key)] = value
        return bias


TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    # The template's thinking switch where it has one (Qwen3's enable_thinking).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, without effect
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    # Checked by swarmd.model.tool_prompt (exact parameter paths in its errors).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        for index, message in enumerate(self.messages):
            message.check_supported(index)
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise UnsupportedError(
                    f"'{name}' is the deprecated form; use tools and tool_choice", name
                )
        for name in ("audio", "prediction"):
            if getattr(self, name) is not None:
                raise UnsupportedError(f"'{name}' is not supported", name)
        if self.modalities not in (None, ["text"]):
            raise UnsupportedError("Only the text modality is supported", "modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequestError(
                "Give max_tokens or max_completion_tokens, not both", "max_completion_tokens"
            )

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def uses_tools(self) -> bool:
        """Tools offered, or tool turns in the history: the tools renderer builds the prompt."""
        return self.tools is not None or any(m.uses_tools for m in self.messages)

    def wants_logprobs(self) -> int | None:
        """How many top logprobs per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def grammar(self) -> GrammarSpec | None:
        return None if self.response_format is None else self.response_format.grammar()

    def template_variables(self, template: str) -> dict[str, Any]:
        """`chat_template_kwargs`, and `reasoning_effort` as the template's own switch."""
        variables = dict(self.chat_template_kwargs or {})
        for reserved in ("messages", "tools", "documents", "add_generation_prompt"):
            if reserved in variables:
                raise InvalidRequestError(
                    f"chat_template_kwargs cannot set '{reserved}'", "chat_template_kwargs"
                )
        effort = self.reasoning_effort
        if effort is not None:
            if "enable_thinking" in template:
                variables.setdefault("enable_thinking", effort not in ("none", "minimal"))
            if "reasoning_effort" in template:
                variables.setdefault("reasoning_effort", effort)
        return variables


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
            Field(min_length=1),
        ]
    )
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: TopLogprobs | None = None  # the legacy form: how many top logprobs

    def wants_logprobs(self) -> int | None:
        return self.logprobs

    def grammar(self) -> GrammarSpec | None:
        return None

    def check_supported(self) -> None:
        super().check_supported()
        prompts = self.prompt_count()
        if prompts * self.choices > bounds.PROMPTS_MAX:
            raise InvalidRequestError(
                f"At most {bounds.PROMPTS_MAX} replies per request: {prompts} prompt(s) "
                f"times n={self.choices} is {prompts * self.choices}",
                "prompt" if prompts > bounds.PROMPTS_MAX else "n",
            )
        if self.echo:
            raise UnsupportedError("echo is not supported", "echo")
        if self.suffix:
            raise UnsupportedError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise UnsupportedError("Only best_of=1 is supported", "best_of")

    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompt_count(self) -> int:
        """Prompts in the request: a string or a token list is one; a list of strings or
        of token lists, one each (each gets its `n` choices)."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return 1
        return len(prompt)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        # Python's json accepts NaN and Infinity; JSON does not, and neither do we.
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequestError("The request body is nested too deeply") from exc
    try:
        # A lone surrogate escape ("\ud800") is valid JSON but not text a tokenizer takes.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError("The request body holds text that is not valid UTF-8") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"The request body must be a JSON object, not {type(body).__name__}"
        )
    return body


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = _most_telling(exc.errors())
        param = _param_path(first["loc"])
        if first["type"] == "extra_forbidden":
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {param}", param
            ) from exc
        if first["type"] == "missing":
            raise InvalidRequestError(f"Missing required parameter: '{param}'", param) from exc
        raise InvalidRequestError(f"Invalid value for '{param}': {first['msg']}", param) from exc


def _most_telling(errors: list[Any]) -> Any:
    """The error to report. A field of several accepted shapes (`stop`: a string or a
    list; `prompt`: four) fails once per shape, the first being "should be a valid
    string" for a value that is plainly a list; a shape whose type matched and whose
    limit failed ("at most 4 items", ">= 0") says what is wrong."""
    first = errors[0]
    shapes = [e for e in errors if e["loc"][:1] == first["loc"][:1]]  # the first field's
    for error in shapes:
        if not str(error["type"]).endswith(("_type", "_parsing")):
            return error
    # A type none of the shapes takes: name them all ("a valid string or a valid list").
    prefix = "Input should be "
    said = list(dict.fromkeys(str(e["msg"]).removeprefix(prefix) for e in shapes))
    whole = {_param_path(e["loc"]) for e in shapes} == {_param_path(first["loc"][:1])}
    if whole and len(said) > 1 and all(str(e["msg"]).startswith(prefix) for e in shapes):
        return {**first, "msg": prefix + " or ".join(said)}
    return first


def _param_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[ContentPart]") or "[" in str(part):
            continue  # pydantic names the union member it tried; the client never wrote it
        else:
            path += f".{part}" if path else str(part)
    return path
