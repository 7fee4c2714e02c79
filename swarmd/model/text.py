"""Text in and out: the tokenizer, chat prompts, streaming detokenization, stop strings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from swarmd.errors import InvalidRequestError, ModelLoadError


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class TextCodec:
    """A model's tokenizer plus the few facts generation needs from it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    @classmethod
    def load(cls, model_dir: Path) -> TextCodec:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"Cannot load the tokenizer in {model_dir}: {exc}") from exc
        return cls(tokenizer, _eos_ids(model_dir, tokenizer))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        conversation: list[dict[str, Any]] = [
            {"role": m.role, "content": m.content} for m in messages
        ]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
        except jinja2.TemplateError as exc:
            # Templates may refuse a conversation (e.g. roles that do not alternate).
            raise InvalidRequestError(
                f"The model's chat template refused these messages: {exc}", "messages"
            ) from exc
        # The template already holds every special token the model expects.
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def _eos_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if (model_dir / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(i) for i in eos)
    return frozenset(ids)


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
