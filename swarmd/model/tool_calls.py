"""Tool calling, what comes back: the calls in a model's reply and the content around
them, whole (`parse_tool_calls`) or streamed (`ToolCallStreamer`), in one
`ToolCallFormat`. Which format a model speaks and what it is offered is `tool_prompt.py`'s;
the constrained decoding of calls is `grammar.py`'s; the I/O is the API's.

A call that names an unknown function, or whose arguments are not a JSON object, stays in
the content. Both entry points run the same scanner, so a streamed reply yields exactly
the calls and content of the whole one, however it is split.

Arguments, one canonical form (`ToolCall.arguments_json`, and what the `arguments`
events of a call concatenate to): the arguments object's JSON text as the reply wrote it,
less the whitespace between tokens, each string and number rewritten as Python's `json`
writes the value it reads: strings unescaped but for `"`, `\\`, control characters
(`\\n`, `\\u001b`) and lone surrogates (`\\ud800`); numbers as `int` or `float` write
themselves (`1E2` -> `100.0`). For an object without repeated keys that is
`json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)`. Written token
by token, it can be streamed: a prefix of the reply gives a prefix of the form.

When a call is announced (`("call_start", index, id, name)`):

- by default, once the call is whole and valid; its arguments follow in one event. A
  streamed reply never shows a call the finished reply would not have.
- `certain=True` (the caller knows constrained decoding makes the reply calls only:
  tool_choice "required" or a named function): as soon as its name is read and is a
  known function's; its arguments follow as they are written (held until then, when the
  model writes them before the name), so a client sees them grow as OpenAI streams them.
  An announced call stays a call whatever follows: cut short (max_tokens), its arguments
  are the prefix streamed; broken, the text from the break on is read on as usual.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import string
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from swarmd.errors import InternalError
from swarmd.model.grammar import ToolCallFormat

# What a streamer yields: content certain not to be part of a call; a call's id and name
# (its first event); a piece of its arguments' JSON text (the pieces concatenate to it).
ContentEvent = tuple[Literal["content"], str]
CallStartEvent = tuple[Literal["call_start"], int, str, str]
ArgumentsEvent = tuple[Literal["arguments"], int, str]
StreamEvent = ContentEvent | CallStartEvent | ArgumentsEvent

PYTHON_TAG = "<|python_tag|>"  # may open a Llama 3 call (a special token, usually dropped)
_ID_CHARS = string.ascii_letters + string.digits
_ID_LENGTH = 24  # call_ + 24 alphanumerics, as OpenAI's ids look
_WS = " \t\n\r"  # JSON's whitespace
_MAX_DEPTH = 64  # nesting of a call's JSON (deeper is not a call)
_RESCAN_MIN_CHARS = 64  # a held text shorter than this is rescanned on every delta


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str  # the arguments object's JSON text, in the canonical form

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


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(_ID_LENGTH))


@dataclass(frozen=True)
class _Syntax:
    """A `ToolCallFormat` as the scanner reads it, whitespace around every marker free:

    - wrapped: `open {call} close`, anywhere in the reply (Hermes, the fallback);
    - listed: `open [{call}, ...] close`, anywhere; also with no `open` when the array
      opens the reply: Mistral's `[TOOL_CALLS]` is a control token, gone from a reply
      decoded without special tokens;
    - bare: `{call}` opening the reply (after an optional `<|python_tag|>`), more calls
      after `;` or whitespace (Llama 3); the first thing that is not a call ends them.

    In a call's object the first `name_key` names the function and the first of
    `arguments_keys` holds the arguments; other keys are read past.
    """

    shape: Literal["wrapped", "listed", "bare"]
    open: str
    close: str
    name_key: str
    arguments_keys: tuple[str, ...]  # the format's own; "arguments"/"parameters" too

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
    whitespace at either end of the content is dropped), and each call's
    `("call_start", index, id, name)` then `("arguments", index, piece)` events, when the
    module docstring says (`certain`). `flush` decides the rest. `calls` and `content`
    are the reply's (a call enters `calls` once its arguments are all sent).
    """

    def __init__(
        self,
        fmt: ToolCallFormat,
        names: Collection[str],
        new_id: Callable[[], str] = new_call_id,
        certain: bool = False,
    ) -> None:
        self._syntax = _Syntax.of(fmt)
        self._names = frozenset(names)
        self._new_id = new_id
        self._certain = certain
        self._buf = ""  # the text not decided yet
        self._reader: _Reader | None = None  # the JSON of the candidate call opening in _buf
        self._events: list[StreamEvent] = []  # what the current feed yields
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
        # Uncertain, a long held text is a call in progress that is only announced whole,
        # which can only happen on one of the trigger characters. Skipping the scan
        # otherwise (until the text doubles) saves its cost per delta; a broken call is
        # then found a little later, never missed.
        if (
            not self._certain
            and self._held >= _RESCAN_MIN_CHARS
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
        self._events = events
        while self._buf:
            found = self._step(final)
            if found is None:
                break
            self._reader = None  # its text is decided
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
            if final and self._cut_marker(buf):
                return len(buf), []
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
            if not final:
                return None
            return (len(buf), []) if self._certain and start else _BROKEN  # a cut marker
        if buf[j] != ("{" if syntax.shape == "wrapped" else "["):
            return _BROKEN
        reader = self._read(j)
        if reader.state != "complete":
            return None if reader.state == "open" and not final else self._cut(reader)
        calls = self._whole_calls(reader)
        if calls is None:
            return _BROKEN
        end = reader.pos
        if not syntax.close:
            return end, calls
        m = _skip_ws(buf, end)
        if buf.startswith(syntax.close, m):
            return m + len(syntax.close), calls
        if syntax.close.startswith(buf[m:]):
            # Cut short by the end of the reply (a stop, the model's EOS): still a call.
            return (len(buf), calls) if final else None
        return (end, calls) if self._certain else _BROKEN  # certain: announced already

    def _step_bare(self, final: bool) -> _Found | None:
        buf = self._buf
        seps = _WS + ";" if self._after_call else _WS
        j = 0
        while j < len(buf) and buf[j] in seps:
            j += 1
        if j == len(buf):
            # Trailing separators belong to the calls; leading whitespace is content.
            return None if not final else (j, [] if self._after_call else None)
        if buf.startswith(PYTHON_TAG, j):
            j = _skip_ws(buf, j + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(buf[j:]) and not final:
            return None
        if j == len(buf) and not final:
            return None
        if j < len(buf) and buf[j] == "{":
            reader = self._read(j)
            if reader.state == "open" and not final:
                return None
            if reader.state == "complete":
                calls = self._whole_calls(reader)
                found = _BROKEN if calls is None else (reader.pos, calls)
            else:
                found = self._cut(reader)
            if found is not _BROKEN:
                self._after_call = True
                return found
        self._text_only = True
        return len(buf), None

    def _read(self, j: int) -> _Reader:
        """The candidate's JSON (opening at `_buf[j]`) read as far as the text goes; when
        certain, what of its calls that decides is sent."""
        if self._reader is None or self._reader.start != j:
            self._reader = _Reader(self._syntax, self._names, j)
        self._reader.advance(self._buf)
        if self._certain:
            self._release(self._reader, finished=False)
        return self._reader

    def _whole_calls(self, reader: _Reader) -> list[tuple[str, str]] | None:
        """A whole candidate's calls to announce, or None if it is not calls. Certain: it
        is (its calls are all named, else it would have broken), and they are sent."""
        if not reader.calls:
            return None
        if self._certain:
            self._release(reader, finished=True)
            return []
        calls = []
        for call in reader.calls:
            if call.name is None or call.args_state != "done" or not call.exact:
                return None
            calls.append((call.name, "".join(call.args)))
        return calls

    def _cut(self, reader: _Reader) -> _Found:
        """A candidate that broke, or that the end of the reply cut short: not a call,
        unless (certain) some of its calls were announced: those end where it broke."""
        at = reader.resume(len(self._buf)) if self._certain else None
        if at is None:
            if self._certain and reader.state == "open":
                # Cut by the end of the reply before a name was whole: only calls could
                # come out, so this is one, with nothing to announce, and no content.
                return len(self._buf), []
            return _BROKEN
        self._release(reader, finished=True)
        return at, []

    def _cut_marker(self, buf: str) -> bool:
        """Certain, at the end: `buf` is whitespace and then the start of a call's marker
        ("<tool_c"), which the end of the reply cut (only calls could come out)."""
        rest = buf[_skip_ws(buf, 0) :]
        return self._certain and bool(rest) and self._syntax.open.startswith(rest)

    def _release(self, reader: _Reader, finished: bool) -> None:
        """Certain: announce each named call once, send what its arguments grew by; a call
        whose object closed (`finished`: every named one) enters `calls`."""
        for call in reader.calls:
            if call.name is None:
                break
            if call.id is None:
                call.id, call.index = self._new_id(), len(self.calls)
                self._events.append(("call_start", call.index, call.id, call.name))
            if call.sent < len(call.args):
                self._events.append(("arguments", call.index, "".join(call.args[call.sent :])))
                call.sent = len(call.args)
            if (call.end is not None or finished) and not call.finished:
                self.calls.append(ToolCall(call.id, call.name, "".join(call.args)))
                call.finished = True


def parse_tool_calls(
    text: str, fmt: ToolCallFormat, names: Collection[str], certain: bool = False
) -> ParsedReply:
    """The calls in a finished reply and the content around them (see `ToolCallStreamer`,
    which this runs on the whole text)."""
    streamer = ToolCallStreamer(fmt, names, certain=certain)
    streamer.feed(text)
    streamer.flush()
    return ParsedReply(streamer.content, streamer.calls)


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


# --- The JSON of calls, read as it grows ------------------------------------------------

_INT = r"-?(?:0|[1-9][0-9]*)"
# One whole JSON token, or the quote that opens a string. A number is whole only once
# something that cannot go on with it follows: "12" may be the start of "123".
_TOKEN = re.compile(
    rf'[ \t\n\r]+|"|{_INT}(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?(?=[^0-9.eE+-])'
    r"|true|false|null|[{}\[\]:,]"
)
# The start of such a token that the end of the text cut short.
_UNFINISHED = re.compile(
    rf"-|{_INT}(?:\.[0-9]*|(?:\.[0-9]+)?[eE][+-]?[0-9]*)?|t(?:ru?)?|f(?:a(?:ls?)?)?|n(?:ul?)?"
)
_CLOSERS = {"{": "}", "[": "]"}
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # a string's characters that stand for themselves
_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u([0-9a-fA-F]{4}))')
_ESCAPE_START = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")  # an escape cut short
_UNESCAPED = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# What `json.dumps(ensure_ascii=False)` escapes, and lone surrogates (which would not
# encode as UTF-8): each is written as `json.dumps` (ASCII) writes it.
_TO_ESCAPE = re.compile(r'[\x00-\x1f"\\\ud800-\udfff]')

_Role = Literal["name", "args", "skip"]  # what the value of a call's key is


@dataclass(eq=False)
class _Call:
    """One call's object, as far as it is read."""

    name: str | None = None  # set once read, and known
    args: list[str] = field(default_factory=list)  # its arguments so far (canonical), by piece
    args_state: Literal["none", "reading", "done", "bad"] = "none"  # bad: not an object
    args_level: int = 0  # the depth of the arguments object
    exact: bool = True  # every number in the arguments reads back (1e999 does not)
    end: int | None = None  # just past its `}`, once closed
    # The streamer's, once it announces the call (certain):
    id: str | None = None
    index: int = -1
    sent: int = 0  # pieces of `args` sent
    finished: bool = False  # in the streamer's `calls`


class _Reader:
    """The JSON of one call's object (listed: an array of them) opening at `start`, read
    as the text grows, each character once: tokens checked as `json.loads` reads them
    (strict, less NaN and Infinity), names checked, arguments written in the canonical
    form. Never decides on where the text happens to end, so any split reads the same."""

    def __init__(self, syntax: _Syntax, names: frozenset[str], start: int) -> None:
        self.start = start
        self.pos = start  # where reading goes on; where the text broke, once broken
        self.state: Literal["open", "broken", "complete"] = "open"
        self.calls: list[_Call] = []
        self._syntax = syntax
        self._names = names
        self._level = 2 if syntax.shape == "listed" else 1  # the depth of a call's object
        self._stack: list[str] = []
        self._expect = "value"  # value, first_item, first_key, key, colon, after
        self._role: _Role = "skip"  # of the call's key just read
        self._in_string = False
        self._key = False  # the string is a key
        self._string: Literal["args", "collect", "skip"] = "skip"  # where its text goes
        self._chars: list[str] = []  # a key or name of the call's, being read

    def advance(self, text: str) -> None:
        while self.state == "open" and self.pos < len(text):
            if self._in_string:
                if not self._read_string(text):
                    return
                continue
            m = _TOKEN.match(text, self.pos)
            if m is None:
                if not _UNFINISHED.fullmatch(text, self.pos):
                    self.state = "broken"
                return
            if not self._take(m.group()):
                self.state = "broken"
                return
            self.pos = m.end()

    def resume(self, length: int) -> int | None:
        """Where the text of the named calls ends (None: none is named): past the last
        one's object; if the text broke in it, there; if it ended in it, `length`."""
        named = [call for call in self.calls if call.name is not None]
        if not named:
            return None
        if named[-1].end is not None:
            return named[-1].end
        return length if self.state == "open" else self.pos

    def _take(self, token: str) -> bool:
        """One token in the grammar of JSON; False: no JSON has it here."""
        c, expect = token[0], self._expect
        if c in _WS:
            return True
        if expect == "colon":
            if c != ":":
                return False
            self._write(c)
            self._expect = "value"
            return True
        if expect in ("first_key", "key"):
            if c == '"':
                self._open_string(key=True)
                return True
            return c == "}" and expect == "first_key" and self._close(c)
        if expect == "after":
            if c == ",":
                self._write(c)
                self._expect = "key" if self._stack[-1] == "{" else "value"
                return True
            return c == _CLOSERS[self._stack[-1]] and self._close(c)
        if c == "]" and expect == "first_item":
            return self._close(c)
        return c not in "}],:" and self._value(token)

    def _value(self, token: str) -> bool:
        """A value opens at `token` (a scalar: is whole)."""
        c, depth = token[0], len(self._stack)
        if depth < self._level - 1 and c != "[":
            return False  # listed: an array of calls
        if depth == self._level - 1:
            if c != "{":
                return False  # a call is an object
            self.calls.append(_Call())
        elif depth == self._level:  # the value of one of the call's keys
            call = self.calls[-1]
            if self._role == "name" and c != '"':
                return False
            if self._role == "args" and c == "{":
                call.args_state, call.args_level = "reading", depth + 1
            elif self._role == "args":
                call.args_state = "bad"
        if c in "{[":
            self._write(c)
            self._stack.append(c)
            self._expect = "first_key" if c == "{" else "first_item"
            return len(self._stack) <= _MAX_DEPTH
        if c == '"':
            self._open_string(key=False)
            return True
        if c in "tfn":
            self._write(token)
        else:
            self._write_number(token)
        self._ended()
        return True

    def _close(self, closer: str) -> bool:
        self._write(closer)
        self._stack.pop()
        depth = len(self._stack)
        call = self.calls[-1] if self.calls else None
        if call is not None and call.args_state == "reading" and depth < call.args_level:
            call.args_state = "done"
        if call is not None and depth == self._level - 1 and closer == "}":
            if call.name is None:  # the call's object closed, and it named no function
                return False
            call.end = self.pos + 1
        self._ended()
        return True

    def _ended(self) -> None:
        """A value just ended."""
        if self._stack:
            self._expect = "after"
        else:
            self.state = "complete"

    def _open_string(self, key: bool) -> None:
        call = self.calls[-1]
        self._in_string, self._key = True, key
        if call.args_state == "reading":
            self._string = "args"
            self._write('"')
        elif len(self._stack) == self._level and (key or self._role == "name"):
            self._string = "collect"
            self._chars = []
        else:
            self._string = "skip"

    def _read_string(self, text: str) -> bool:
        """Reads on in a string; False: wait for more text (or it broke)."""
        chars, self.pos, state = _scan_string(text, self.pos)
        if chars and self._string == "args":
            self._write(_escape(chars))
        elif chars and self._string == "collect":
            self._chars.append(chars)
        if state != "closed":
            if state == "broken":
                self.state = "broken"
            return False
        self._in_string = False
        if self._string == "args":
            self._write('"')
        if self._key:
            if self._string == "collect":
                self._role = self._role_of("".join(self._chars))
            self._expect = "colon"
            return True
        if self._string == "collect":  # the call's name
            name = "".join(self._chars)
            if name not in self._names:
                self.state = "broken"
                return False
            self.calls[-1].name = name
        self._ended()
        return True

    def _role_of(self, key: str) -> _Role:
        call = self.calls[-1]
        if key == self._syntax.name_key and call.name is None:
            return "name"
        if key in self._syntax.arguments_keys and call.args_state == "none":
            return "args"
        return "skip"

    def _write(self, piece: str) -> None:
        if self.calls and self.calls[-1].args_state == "reading":
            self.calls[-1].args.append(piece)

    def _write_number(self, token: str) -> None:
        if not (self.calls and self.calls[-1].args_state == "reading"):
            return
        try:
            if token.lstrip("-").isdigit():
                written, exact = str(int(token)), True
            else:
                value = float(token)
                exact = math.isfinite(value)
                written = repr(value) if exact else token
        except ValueError:  # more digits than int reads (or writes)
            written, exact = token, False
        self.calls[-1].args.append(written)
        self.calls[-1].exact &= exact


def _scan_string(text: str, i: int) -> tuple[str, int, Literal["open", "closed", "broken"]]:
    """The characters of a JSON string from `text[i]` (inside it), decoded as `json.loads`
    decodes them (a high surrogate escape and a low one next are one character): (the
    characters, where reading stopped, state). open: the text ends inside the string or
    inside an escape (which is left unread); broken: `text[i]` cannot be in a string."""
    out: list[str] = []
    while i < len(text):
        m = _PLAIN.match(text, i)
        if m:
            out.append(m.group())
            i = m.end()
            continue
        if text[i] == '"':
            return "".join(out), i + 1, "closed"
        m = _ESCAPE.match(text, i)
        if m is None:
            state: Literal["open", "broken"] = (
                "open" if _ESCAPE_START.fullmatch(text, i) else "broken"
            )
            return "".join(out), i, state
        if m.group(1) is None:
            e = text[i + 1]
            out.append(_UNESCAPED.get(e, e))
            i = m.end()
            continue
        code = int(m.group(1), 16)
        if 0xD800 <= code <= 0xDBFF:
            low = _ESCAPE.match(text, m.end())
            if low is None and (m.end() == len(text) or _ESCAPE_START.fullmatch(text, m.end())):
                return "".join(out), i, "open"  # a low surrogate may be next
            if low is not None and low.group(1) is not None:
                code2 = int(low.group(1), 16)
                if 0xDC00 <= code2 <= 0xDFFF:
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (code2 - 0xDC00)))
                    i = low.end()
                    continue
        out.append(chr(code))
        i = m.end()
    return "".join(out), i, "open"


def _escape(chars: str) -> str:
    return _TO_ESCAPE.sub(lambda m: json.dumps(m.group())[1:-1], chars)
