"""Tool calling, the pure part: which call format a model's chat template speaks, the
conversation and tools as that template wants them, and the calls found in a reply (whole
or streamed). The constrained decoding of calls is `grammar.py`'s; the I/O is the API's.

Families (`detect_family`, on the template's text; the first row that matches wins), and
what a call looks like in each:

    fallback  no template, a template that never reads `tools` (SmolLM2's), or a tools
              section in a format not parsed here (Qwen3-Coder's `<function=...>` XML,
              Mistral's v11 `[TOOL_CALLS]name[ARGS]{...}`, Granite, DeepSeek, ...):
              as hermes
    mistral   `[TOOL_CALLS]` or `[AVAILABLE_TOOLS]`:
              [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
    hermes    `<tool_call>` (Qwen2.5, Qwen3, Hermes):
              <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3    `<|python_tag|>`, "Environment: ipython", or `"parameters"` in a template
              of Llama 3 headers:
              {"name": "f", "parameters": {...}}   (opening the reply)

Each family has a `ToolCallFormat` (`tool_call_format`, grammar.py's presets); the
fallback uses the Hermes one. For the fallback, swarmd writes the tools into the system
message itself (`fallback_tools_prompt`, text below), turns earlier calls into
`<tool_call>` blocks and tool results into a user turn of `<tool_response>` blocks, so any
chat template renders them. The other families get `tools` and the messages in the shape
their templates read (`render_tools_prompt`).

The fallback's system text (`{tools}`: one JSON object per function, one per line):

    # Tools

    You may call one or more functions to help with the user's request. The functions
    are listed below, one JSON object per line, each with its name, description and
    parameters (a JSON schema):
    <tools>
    {tools}
    </tools>

    To call a function, reply with its name and arguments as a JSON object inside
    <tool_call></tool_call> tags, one block per call:
    <tool_call>
    {"name": "<function-name>", "arguments": <arguments-as-a-JSON-object>}
    </tool_call>
    Each result comes back inside <tool_response></tool_response> tags.

Parsing (`parse_tool_calls`, `ToolCallStreamer`) reads a reply in one family's format; a
call that names an unknown function, or whose arguments are not a JSON object, stays in
the content. Both run the same scanner, so a streamed reply yields exactly the calls and
content of the whole one, however it is split.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

import jinja2

from swarmd.errors import InternalError, InvalidRequestError
from swarmd.model.chat_template import compile_template
from swarmd.model.grammar import MAX_TOOL_FUNCTIONS, ToolCallFormat, ToolFunction

ToolFamily = Literal["hermes", "llama3", "mistral", "fallback"]
ToolChoiceMode = Literal["auto", "none", "required"]
# What a streamer yields: content certain not to be part of a call; a call's id and name
# (its first event); a piece of its arguments' JSON text (the pieces concatenate to it).
ContentEvent = tuple[Literal["content"], str]
CallStartEvent = tuple[Literal["call_start"], int, str, str]
ArgumentsEvent = tuple[Literal["arguments"], int, str]
StreamEvent = ContentEvent | CallStartEvent | ArgumentsEvent

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
_READS_TOOLS = re.compile(r"\btools\b")  # `custom_tools` alone does not count
_UNPARSED = ("<function=", "[ARGS]")  # tools sections in formats we do not parse
_ID_CHARS = string.ascii_letters + string.digits
_ID_LENGTH = 24  # call_ + 24 alphanumerics, as OpenAI's ids look
_MISTRAL_ID_LENGTH = 9  # Mistral's templates refuse any other tool call id
_PYTHON_TAG = "<|python_tag|>"  # may open a Llama 3 call (a special token, usually dropped)
_WS = " \t\n\r"  # JSON's whitespace
_MAX_DEPTH = 64  # nesting of a call's JSON (deeper is not a call)
_RESCAN_MIN_CHARS = 64  # a held text shorter than this is rescanned on every delta
_SYSTEM_PROBE = "swarmd-system-probe-7f3a"

FALLBACK_TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. The functions "
    "are listed below, one JSON object per line, each with its name, description and "
    "parameters (a JSON schema):\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with its name and arguments as a JSON object inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "<function-name>", "arguments": <arguments-as-a-JSON-object>}}\n'
    "</tool_call>\n"
    "Each result comes back inside <tool_response></tool_response> tags."
)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str  # compact JSON text of an object, as OpenAI returns it

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # the text outside calls, stripped; None when nothing is left
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolPrompt:
    """What to hand the chat template: `messages`, and `tools` (None: no tools section)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(_ID_LENGTH))


def detect_family(template_source: str | None) -> ToolFamily:
    """The call format a chat template speaks (the table in the module docstring)."""
    src = template_source or ""
    if not _READS_TOOLS.search(src) or any(marker in src for marker in _UNPARSED):
        return "fallback"
    if "[TOOL_CALLS]" in src or "[AVAILABLE_TOOLS]" in src:
        return "mistral"
    if "<tool_call>" in src:
        return "hermes"
    if _PYTHON_TAG in src or "Environment: ipython" in src:
        return "llama3"
    if '"parameters"' in src and "<|start_header_id|>" in src:
        return "llama3"
    return "fallback"


def tool_call_format(
    family: ToolFamily, functions: Iterable[ToolFunction], parallel: bool = True
) -> ToolCallFormat:
    """The family's call format, for the grammar and the parser. Llama 3 calls one
    function at a time whatever `parallel` says (its templates refuse several)."""
    if family == "llama3":
        return ToolCallFormat.llama3_json(functions)
    if family == "mistral":
        return ToolCallFormat.mistral(functions, parallel)
    return ToolCallFormat.hermes(functions, parallel)


# --- Request checks ---------------------------------------------------------------------


def check_tools(tools: object) -> list[ToolFunction]:
    """The functions of an OpenAI `tools` list; InvalidRequestError naming the exact path
    (`tools[2].function.name`) of the first fault."""
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOL_FUNCTIONS:
        raise InvalidRequestError(
            f"Invalid 'tools': expected a list of 1 to {MAX_TOOL_FUNCTIONS} tools", "tools"
        )
    seen: dict[str, int] = {}
    functions = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _invalid(at, "expected an object")
        if tool.get("type") != "function":
            raise _invalid(f"{at}.type", "only 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _invalid(f"{at}.function", "expected an object")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise _invalid(
                f"{at}.function.name", f"expected a string matching {_FUNCTION_NAME.pattern}"
            )
        if name in seen:
            raise _invalid(
                f"{at}.function.name", f"'{name}' is also the name of tools[{seen[name]}]"
            )
        seen[name] = i
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid(f"{at}.function.description", "expected a string")
        parameters = function.get("parameters")
        parameters = {} if parameters is None else parameters
        if not isinstance(parameters, dict):
            raise _invalid(f"{at}.function.parameters", "expected a JSON schema object")
        if parameters.get("type", "object") != "object":
            raise _invalid(f"{at}.function.parameters", "the arguments must be a JSON object")
        functions.append(ToolFunction(name, parameters))
    return functions


def check_tool_choice(choice: object, names: Collection[str]) -> tuple[ToolChoiceMode, str | None]:
    """`tool_choice` as (mode, function name): a named function is ("required", name).
    Absent: "auto" with tools, "none" without. 400s name `tool_choice`."""
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in ("auto", "none"):
        return (cast(ToolChoiceMode, choice) if names else "none"), None
    if choice == "required":
        if not names:
            raise InvalidRequestError(
                "Invalid 'tool_choice': 'required' needs 'tools'", "tool_choice"
            )
        return "required", None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError(
                "Invalid 'tool_choice': expected {'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
        if name not in names:
            raise InvalidRequestError(
                f"Invalid 'tool_choice': no function named '{name}' in 'tools'", "tool_choice"
            )
        return "required", name
    raise InvalidRequestError(
        "Invalid 'tool_choice': expected 'auto', 'none', 'required' or a named function",
        "tool_choice",
    )


def _invalid(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid '{param}': {message}", param)


# --- The prompt -------------------------------------------------------------------------


def render_tools_prompt(
    template_source: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    family: ToolFamily,
    variables: dict[str, Any] | None = None,
) -> ToolPrompt:
    """The messages (and tools) to render the chat template with, for `family`.

    `messages` are OpenAI-shaped dicts: assistant turns may carry `tool_calls` (content
    None), `tool` turns a `tool_call_id`. `tools` were checked by `check_tools`; None or
    [] renders no tools (tool_choice "none") but still renders the calls in the history.

    Templates with a tools section get each call's arguments as a dict: Qwen2.5's and
    Llama 3.1's apply `tojson` to them (a string would come out quoted), Qwen3's takes
    either. Mistral's refuse ids that are not 9 alphanumerics: there every id is mapped
    to one (the same for a call and its result). Keys other than role, content,
    tool_calls, tool_call_id are dropped. InvalidRequestError names the message path.
    `variables` (the special tokens the caller renders with) reach the fallback's probe
    of whether the template takes a system message.
    """
    listed = [_tool_entry(tool) for tool in tools or []]
    turns = _turns(messages)
    if family == "fallback":
        return ToolPrompt(_fallback_turns(template_source, turns, listed, variables or {}), None)
    if family == "mistral":
        turns = [_with_short_ids(turn) for turn in turns]
    return ToolPrompt(turns, [{"type": "function", "function": f} for f in listed] or None)


def fallback_tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The fallback's system text for OpenAI `tools` (checked)."""
    return _tools_text([_tool_entry(tool) for tool in tools])


def _tools_text(entries: list[dict[str, Any]]) -> str:
    lines = [json.dumps(entry, ensure_ascii=False) for entry in entries]
    return FALLBACK_TOOLS_PROMPT.format(tools="\n".join(lines))


def _tool_entry(tool: dict[str, Any]) -> dict[str, Any]:
    """{name, description?, parameters?} of an OpenAI tool (unknown keys dropped)."""
    function = tool["function"]
    return {k: function[k] for k in ("name", "description", "parameters") if k in function}


def _turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names: dict[str, str] = {}  # call id -> function name, for the tool turns
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        role = message.get("role")
        content = _text(message.get("content"), f"{at}.content")
        if role == "assistant" and message.get("tool_calls"):
            calls = _history_calls(message["tool_calls"], f"{at}.tool_calls")
            names.update((c["id"], c["function"]["name"]) for c in calls)
            turns.append({"role": "assistant", "content": content, "tool_calls": calls})
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _invalid(f"{at}.tool_call_id", "a tool message needs the id of its call")
            turn = {"role": "tool", "tool_call_id": call_id, "content": content}
            if call_id in names:
                turn["name"] = names[call_id]  # some templates print it
            turns.append(turn)
        else:
            turns.append({"role": role, "content": content})
    return turns


def _text(content: object, at: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise _invalid(at, "expected a string or a list of text parts")


def _history_calls(raw: object, at: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise _invalid(at, "expected a list")
    calls = []
    for j, call in enumerate(raw):
        here = f"{at}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(function, dict):
            raise _invalid(here, "expected {'id', 'type': 'function', 'function': {...}}")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise _invalid(f"{here}.id", "expected a string")
        if not isinstance(function.get("name"), str):
            raise _invalid(f"{here}.function.name", "expected a string")
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise _invalid(f"{here}.function.arguments", "expected the JSON text of an object")
        calls.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": parsed},
            }
        )
    return calls


def _with_short_ids(turn: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" in turn:
        calls = [{**c, "id": _short_id(c["id"])} for c in turn["tool_calls"]]
        return {**turn, "tool_calls": calls}
    if "tool_call_id" in turn:
        return {**turn, "tool_call_id": _short_id(turn["tool_call_id"])}
    return turn


def _short_id(call_id: str) -> str:
    if len(call_id) == _MISTRAL_ID_LENGTH and call_id.isalnum() and call_id.isascii():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:_MISTRAL_ID_LENGTH]


def _fallback_turns(
    source: str | None,
    turns: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    variables: dict[str, Any],
) -> list[dict[str, Any]]:
    """Calls as `<tool_call>` blocks (the Hermes format's exact text: what the grammar
    makes the model write), each run of tool results as one user turn, the tools text
    appended to the system message (or put first in the first user turn, for templates
    that refuse or drop a system message)."""
    out: list[dict[str, Any]] = []
    after_tool = False
    for turn in turns:
        if turn["role"] == "tool":
            block = f"<tool_response>\n{turn['content']}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        if "tool_calls" in turn:
            blocks = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in turn["tool_calls"]
            ]
            content = turn["content"].strip()
            out.append(
                {
                    "role": "assistant",
                    "content": "\n".join([content, *blocks] if content else blocks),
                }
            )
        else:
            out.append(dict(turn))
    if not tools:
        return out
    text = _tools_text(tools)
    if out and out[0]["role"] == "system":
        system = out[0]["content"]
        out[0] = {"role": "system", "content": f"{system}\n\n{text}" if system else text}
    elif source is None or _takes_system(source, variables):
        out.insert(0, {"role": "system", "content": text})
    else:
        first = next((m for m in out if m["role"] == "user"), None)
        if first is None:
            out.insert(0, {"role": "user", "content": text})
        else:
            first["content"] = f"{text}\n\n{first['content']}"
    return out


def _takes_system(source: str, variables: dict[str, Any]) -> bool:
    """Whether the template renders a leading system message (Gemma 2's raise, some drop)."""
    probe = [
        {"role": "system", "content": _SYSTEM_PROBE},
        {"role": "user", "content": "hello"},
    ]
    try:
        rendered = compile_template(source).render(
            **{"bos_token": "", "eos_token": "", **variables},
            messages=probe,
            tools=None,
            documents=None,
            add_generation_prompt=True,
        )
    except (jinja2.TemplateError, TypeError, ValueError):
        return False
    return _SYSTEM_PROBE in rendered


# --- Finding calls in a reply -----------------------------------------------------------


@dataclass(frozen=True)
class _Syntax:
    """A `ToolCallFormat` as the scanner reads it, whitespace around every marker free:

    - wrapped: `open {call} close`, anywhere in the reply (Hermes, the fallback);
    - listed: `open [{call}, ...] close`, anywhere; also with no `open` when the array
      opens the reply: Mistral's `[TOOL_CALLS]` is a control token, gone from a reply
      decoded without special tokens;
    - bare: `{call}` opening the reply (after an optional `<|python_tag|>`), more calls
      after `;` or whitespace (Llama 3); the first thing that is not a call ends them.
    """

    shape: Literal["wrapped", "listed", "bare"]
    open: str
    close: str
    name_key: str
    arguments_keys: tuple[str, ...]  # the format's own first; "arguments"/"parameters" too

    @classmethod
    def of(cls, fmt: ToolCallFormat) -> _Syntax:
        keys = tuple(dict.fromkeys((fmt.arguments_key, "arguments", "parameters")))
        begin, prefix, suffix = fmt.begin.strip(), fmt.prefix.strip(), fmt.suffix.strip()
        if begin:
            return cls("wrapped", begin, fmt.end.strip(), fmt.name_key, keys)
        if prefix.endswith("[") and suffix.startswith("]"):
            return cls("listed", prefix[:-1].strip(), suffix[1:].strip(), fmt.name_key, keys)
        if prefix:  # one call between prefix and suffix
            return cls("wrapped", prefix, suffix, fmt.name_key, keys)
        return cls("bare", "", "", fmt.name_key, keys)


_Found = tuple[int, list[tuple[str, str]] | None]  # chars decided; the calls in them (None: text)
_BROKEN: _Found = (-1, None)  # the candidate is not a call


class ToolCallStreamer:
    """Calls and content from a reply fed as text deltas.

    `feed` returns the events the text so far decides: content that cannot be part of a
    call (a possible start of one is held back, as a stop-string matcher holds a prefix;
    whitespace at either end of the content is dropped), and for each call, once it is
    whole and valid, `("call_start", index, id, name)` then its arguments. A call is only
    announced once it is certain, so a streamed reply never shows a call the finished
    reply would not have. `flush` decides the rest. `calls` and `content` are the reply's.
    """

    def __init__(
        self,
        fmt: ToolCallFormat,
        names: Collection[str],
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._syntax = _Syntax.of(fmt)
        self._names = frozenset(names)
        self._new_id = new_id
        self._buf = ""  # the text not decided yet
        self._at_start = True  # nothing but whitespace decided so far
        self._after_call = False  # bare: the last thing decided was a call
        self._text_only = False  # bare, or listed without a marker: the rest is content
        self._held = 0  # len(_buf) after the last scan
        self._triggers = frozenset("}]" + self._syntax.close[-1:])  # chars that end a call
        self._started = False  # some content was emitted
        self._space = ""  # whitespace held back after the content so far
        self._content: list[str] = []
        self._done = False
        self.calls: list[ToolCall] = []

    @property
    def content(self) -> str | None:
        return "".join(self._content) or None

    def feed(self, delta: str) -> list[StreamEvent]:
        if self._done:
            raise InternalError("a tool call streamer was fed after flush")
        self._buf += delta
        # A long held text is a call in progress; it can only become whole on one of the
        # trigger characters. Skipping the rescan otherwise (until the text doubles)
        # keeps the cost linear; a broken call is then found a little later, never missed.
        if (
            self._held >= _RESCAN_MIN_CHARS
            and len(self._buf) < 2 * self._held
            and self._triggers.isdisjoint(delta)
        ):
            return []
        return self._advance(final=False)

    def flush(self) -> list[StreamEvent]:
        if self._done:
            return []
        events = self._advance(final=True)
        self._done = True
        return events

    def _advance(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while self._buf:
            found = self._step(final)
            if found is None:
                break
            n, calls = found
            text, self._buf = self._buf[:n], self._buf[n:]
            if calls is None:
                self._emit_content(text, events)
                continue
            self._at_start = False
            for name, arguments in calls:
                index = len(self.calls)
                call = ToolCall(self._new_id(), name, arguments)
                self.calls.append(call)
                events.append(("call_start", index, call.id, name))
                events.append(("arguments", index, arguments))
        self._held = len(self._buf)
        return events

    def _emit_content(self, text: str, events: list[StreamEvent]) -> None:
        if text.strip():
            self._at_start = False
        if not self._started:
            text = text.lstrip()
            if not text:
                return
            self._started = True
        body = text.rstrip()
        if not body:
            self._space += text
            return
        piece = self._space + body
        self._space = text[len(body) :]
        self._content.append(piece)
        events.append(("content", piece))

    def _step(self, final: bool) -> _Found | None:
        """The next decided piece of `_buf` (a prefix), or None: wait for more text."""
        syntax, buf = self._syntax, self._buf
        if self._text_only:
            return len(buf), None
        if syntax.shape == "bare":
            return self._step_bare(final)
        if self._at_start and syntax.shape == "listed":
            lead = _skip_ws(buf, 0)
            if lead:
                return lead, None
            if buf[0] == "[":
                found = self._region(0, final)
                if found is not _BROKEN:
                    return found
            self._at_start = False
            if not syntax.open:
                self._text_only = True
                return len(buf), None
        at = buf.find(syntax.open)
        if at < 0:
            keep = 0 if final else _partial_suffix(buf, syntax.open)
            return (len(buf) - keep, None) if len(buf) > keep else None
        if at > 0:
            return at, None
        found = self._region(len(syntax.open), final)
        return (len(syntax.open), None) if found is _BROKEN else found

    def _region(self, start: int, final: bool) -> _Found | None:
        """The call (wrapped) or array of calls (listed) from `start`, past its marker."""
        syntax, buf = self._syntax, self._buf
        j = _skip_ws(buf, start)
        if j == len(buf):
            return _BROKEN if final else None
        if buf[j] != ("{" if syntax.shape == "wrapped" else "["):
            return _BROKEN
        state, end = _json_extent(buf, j)
        if state != "complete":
            return _BROKEN if final or state == "broken" else None
        calls = self._calls_in(buf[j:end])
        if calls is None:
            return _BROKEN
        if not syntax.close:
            return end, calls
        m = _skip_ws(buf, end)
        if buf.startswith(syntax.close, m):
            return m + len(syntax.close), calls
        if syntax.close.startswith(buf[m:]):
            # Cut short by the end of the reply (a stop, the model's EOS): still a call.
            return (len(buf), calls) if final else None
        return _BROKEN

    def _step_bare(self, final: bool) -> _Found | None:
        buf = self._buf
        seps = _WS + ";" if self._after_call else _WS
        j = 0
        while j < len(buf) and buf[j] in seps:
            j += 1
        if j == len(buf):
            # Trailing separators belong to the calls; leading whitespace is content.
            return None if not final else (j, [] if self._after_call else None)
        if buf.startswith(_PYTHON_TAG, j):
            j = _skip_ws(buf, j + len(_PYTHON_TAG))
        elif _PYTHON_TAG.startswith(buf[j:]) and not final:
            return None
        if j == len(buf) and not final:
            return None
        if j < len(buf) and buf[j] == "{":
            state, end = _json_extent(buf, j)
            if state == "open" and not final:
                return None
            calls = self._calls_in(buf[j:end]) if state == "complete" else None
            if calls is not None:
                self._after_call = True
                return end, calls
        self._text_only = True
        return len(buf), None

    def _calls_in(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call in a whole JSON text, or None if any is
        not a call (ids are drawn only once a call is certain)."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return None
        items = [value] if self._syntax.shape != "listed" else value
        if not isinstance(items, list) or not items:
            return None
        calls = []
        for item in items:
            call = self._call(item)
            if call is None:
                return None
            calls.append(call)
        return calls

    def _call(self, item: object) -> tuple[str, str] | None:
        if not isinstance(item, dict):
            return None
        name = item.get(self._syntax.name_key)
        if not isinstance(name, str) or name not in self._names:
            return None
        key = next((k for k in self._syntax.arguments_keys if k in item), None)
        arguments = item.get(key) if key is not None else None
        if not isinstance(arguments, dict):
            return None
        try:
            return name, _compact(arguments)
        except ValueError:  # 1e999 read as inf: not JSON once written back
            return None


def parse_tool_calls(text: str, fmt: ToolCallFormat, names: Collection[str]) -> ParsedReply:
    """The calls in a finished reply and the content around them (see `ToolCallStreamer`,
    which this runs on the whole text)."""
    streamer = ToolCallStreamer(fmt, names)
    streamer.feed(text)
    streamer.flush()
    return ParsedReply(streamer.content, streamer.calls)


def _compact(value: dict[str, Any]) -> str:
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: keep it escaped
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# --- JSON extent ------------------------------------------------------------------------

_STRING = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'  # less its closing quote
_INT = r"-?(?:0|[1-9][0-9]*)"
# One whole JSON token. A number must not be followed by what could go on with it, so
# "1." at the end of the text is a token still being written, not "1" and a stray ".".
_TOKEN = re.compile(
    rf"[ \t\n\r]+|{_STRING}\"|{_INT}(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?(?![0-9.eE+-])"
    r"|true|false|null|[{}\[\]:,]"
)
# The start of a token that the end of the text cut short.
_UNFINISHED = re.compile(
    rf"{_STRING}(?:\\(?:u[0-9a-fA-F]{{0,3}})?)?|-|{_INT}(?:\.[0-9]*|(?:\.[0-9]+)?[eE][+-]?[0-9]*)?"
    r"|t(?:ru?)?|f(?:a(?:ls?)?)?|n(?:ul?)?"
)
_CLOSERS = {"{": "}", "[": "]"}


def _json_extent(text: str, start: int) -> tuple[Literal["open", "broken", "complete"], int]:
    """Whether the JSON object or array opening at `text[start]` is whole (and where it
    ends), broken (no text can follow that makes it JSON), or open (it may still be).

    Strict JSON, as `json.loads` reads it less NaN and Infinity, so a whole one loads."""
    stack: list[str] = []
    expect = "value"  # value, first_item, first_key, key, colon, after
    i = start
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            return ("open" if _UNFINISHED.fullmatch(text, i) else "broken"), i
        token, i = m.group(), m.end()
        c = token[0]
        if c in _WS:
            continue
        if expect in ("value", "first_item"):
            if c in "{[":
                stack.append(c)
                if len(stack) > _MAX_DEPTH:
                    return "broken", i
                expect = "first_key" if c == "{" else "first_item"
                continue
            if not stack or c in "}:,":
                return "broken", i  # only an object or array opens
            if c == "]" and expect != "first_item":
                return "broken", i
            if c == "]":
                stack.pop()
        elif expect in ("first_key", "key"):
            if c == '"':
                expect = "colon"
                continue
            if c != "}" or expect != "first_key":
                return "broken", i
            stack.pop()
        elif expect == "colon":
            if c != ":":
                return "broken", i
            expect = "value"
            continue
        else:  # after a value in a container
            if c == ",":
                expect = "key" if stack[-1] == "{" else "value"
                continue
            if c != _CLOSERS[stack[-1]]:
                return "broken", i
            stack.pop()
        # A value just ended.
        if not stack:
            return "complete", i
        expect = "after"
    return "open", i
