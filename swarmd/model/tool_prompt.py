"""Tool calling, the offer: which call format a model's chat template speaks, the request's
`tools` and `tool_choice` checked, and the conversation and tools as that template wants
them. What comes back (the calls in a reply) is `tool_calls.py`'s; the constrained decoding
of calls is `grammar.py`'s; the I/O is the API's.

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
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

import jinja2

from swarmd.errors import InvalidRequestError
from swarmd.model.chat_template import compile_template
from swarmd.model.grammar import MAX_TOOL_FUNCTIONS, ToolCallFormat, ToolFunction, held_form
from swarmd.model.tool_calls import PYTHON_TAG

ToolFamily = Literal["hermes", "llama3", "mistral", "fallback"]
ToolChoiceMode = Literal["auto", "none", "required"]

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
_READS_TOOLS = re.compile(r"\btools\b")  # `custom_tools` alone does not count
_UNPARSED = ("<function=", "[ARGS]")  # tools sections in formats we do not parse
_MISTRAL_ID_LENGTH = 9  # Mistral's templates refuse any other tool call id
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
class ToolPrompt:
    """What to hand the chat template: `messages`, and `tools` (None: no tools section)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def detect_family(template_source: str | None) -> ToolFamily:
    """The call format a chat template speaks (the table in the module docstring)."""
    src = template_source or ""
    if not _READS_TOOLS.search(src) or any(marker in src for marker in _UNPARSED):
        return "fallback"
    if "[TOOL_CALLS]" in src or "[AVAILABLE_TOOLS]" in src:
        return "mistral"
    if "<tool_call>" in src:
        return "hermes"
    if PYTHON_TAG in src or "Environment: ipython" in src:
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
        _known_keys(tool, _TOOL_KEYS, at)
        _known_keys(function, _FUNCTION_KEYS, f"{at}.function")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _invalid(f"{at}.function.strict", "expected true or false")
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
        # Not strict: the keywords no reply can be held to are dropped, not refused.
        functions.append(ToolFunction(name, held_form(parameters, bool(strict))))
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


# What OpenAI's tool objects may hold; anything else is a typo the client should hear of
# (as OpenAI says of it) rather than a setting silently ignored.
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _known_keys(given: dict[str, Any], known: frozenset[str], at: str) -> None:
    for key in given:
        if key not in known:
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {at}.{key}", f"{at}.{key}"
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
    """The turns for a template. A tool message answers a call of the assistant turn
    just before it (other tool messages between them), as OpenAI requires: a result
    the model never asked for would be rendered as an answer to nothing."""
    names: dict[str, str] = {}  # call id -> function name, of the calls being answered
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        role = message.get("role")
        content = _text(message.get("content"), f"{at}.content")
        if role == "assistant" and message.get("tool_calls"):
            calls = _history_calls(message["tool_calls"], f"{at}.tool_calls")
            names = {c["id"]: c["function"]["name"] for c in calls}
            turns.append({"role": "assistant", "content": content, "tool_calls": calls})
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _invalid(f"{at}.tool_call_id", "a tool message needs the id of its call")
            if not names:
                raise _invalid(
                    at,
                    "a message with role 'tool' must answer a call of a preceding "
                    "assistant message with 'tool_calls'",
                )
            if call_id not in names:
                raise _invalid(
                    f"{at}.tool_call_id",
                    f"'{call_id}' is not the id of a call in the preceding assistant "
                    f"message's tool_calls ({', '.join(sorted(names))})",
                )
            turns.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": content,
                    "name": names[call_id],
                }
            )
        else:
            names = {}
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
        if isinstance(arguments, str) and not arguments.strip():
            arguments = "{}"  # a call made without arguments, as some clients record it
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
