"""Text in and out: the tokenizer, chat prompts, streaming detokenization, stop strings.

`TextCodec` runs the model's `tokenizer.json` with the `tokenizers` library and renders its
chat template as transformers' `apply_chat_template` does (`chat_template.py`), without
transformers' tokenizer classes: loading those pulls in its modelling code, about 100 MB
of a node's memory.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from swarmd.errors import InvalidRequestError, ModelLoadError
from swarmd.model import chat_template
from swarmd.model.token_bytes import TokenBytes

_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class TextCodec:
    """A model's tokenizer plus the few facts generation needs from it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int],
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        clean_up_spaces: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}
        self._clean_up_spaces = clean_up_spaces

    @classmethod
    def load(cls, model_dir: Path) -> TextCodec:
        path = model_dir / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exceptions for bad files
            raise ModelLoadError(f"Cannot load the tokenizer {path}: {exc}") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {
            **_special_tokens(config),
            **_special_tokens(_read_json(model_dir / "special_tokens_map.json")),
        }
        eos_ids = _eos_ids(model_dir, tokenizer, special.get("eos_token"))
        return cls(
            tokenizer,
            eos_ids,
            _chat_template(model_dir, config),
            special,
            bool(config.get("clean_up_tokenization_spaces", False)),
        )

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        """Each token's bytes (logprobs report them); built on first use."""
        return TokenBytes(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def chat_prompt(
        self, messages: list[ChatMessage], variables: dict[str, Any] | None = None
    ) -> list[int]:
        """The prompt's token ids; `variables` reach the template (after its own)."""
        if not self.chat_template:
            raise InvalidRequestError("This model has no chat template", "messages")
        conversation: list[dict[str, Any]] = [
            {"role": m.role, "content": m.content} for m in messages
        ]
        return self.render_prompt(conversation, None, variables)

    def render_prompt(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids from template-shaped messages (and tools)."""
        if not self.chat_template:
            raise InvalidRequestError("This model has no chat template", "messages")
        try:
            rendered = chat_template.render(
                self.chat_template,
                conversation,
                True,
                {**self.special_tokens, **(variables or {})},
                tools,
            )
        except jinja2.TemplateError as exc:
            # Templates may refuse a conversation (e.g. roles that do not alternate).
            raise InvalidRequestError(
                f"The model's chat template refused these messages: {exc}", "messages"
            ) from exc
        # The template already holds every special token the model expects.
        return list(self.tokenizer.encode(rendered, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        return _clean_up_tokenization(text) if self._clean_up_spaces else text


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as strings (configs give a string or {"content": ...})."""
    out: dict[str, str] = {}
    for key in _SPECIAL_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template") or _read_json(model_dir / "chat_template.json").get(
        "chat_template"
    )
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _eos_ids(model_dir: Path, tokenizer: Tokenizer, eos_token: str | None) -> frozenset[int]:
    ids: set[int] = set()
    if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
        ids.add(int(tokenizer.token_to_id(eos_token)))
    eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(i) for i in eos if isinstance(i, int))
    return frozenset(ids)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks multi-byte characters and word joins, so each step
    decodes a short window and emits only what is new and complete (no trailing U+FFFD).
    """

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token: int) -> str:
        self._ids.append(token)
        prefix = self._codec.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._codec.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back at the end of the reply."""
        prefix = self._codec.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._codec.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopMatcher:
    """Cuts a streamed reply at the first stop string.

    Text that could still be the start of a stop string is held back until the next
    delta decides it, so a client never sees part of a stop string.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Returns the text that is safe to emit now."""
        if self.stopped:
            return ""
        text = self._held + delta
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
