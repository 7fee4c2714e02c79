"""The bytes each token id stands for, as OpenAI's logprobs report them (`bytes`).

A token's own text may be part of a character (byte-level BPE splits UTF-8), so the
reply's text cannot be cut per token; the bytes can. Two vocabularies are common:

- byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen): each vocabulary character stands for
  one byte through GPT-2's printable byte table (`Ġ` is a space);
- sentencepiece-style (Llama 2, Mistral, Gemma): `▁` is a space and `<0xNN>` a raw byte.

Anything else, and special tokens, fall back to the UTF-8 of the decoded token.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_chars() -> dict[int, str]:
    """GPT-2's `bytes_to_unicode`: byte -> the printable vocabulary character for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """`byte_level_chars`, inverted: vocabulary character -> byte."""
    return {ch: b for b, ch in byte_level_chars().items()}


def _kind(spec: dict[str, Any]) -> str:
    """'byte_level', 'metaspace' or '' (unknown), from the tokenizer's decoder."""
    found = json.dumps(spec.get("decoder") or {}, ensure_ascii=False)
    if '"ByteLevel"' in found:
        return "byte_level"
    if '"ByteFallback"' in found or '"Metaspace"' in found or "\u2581" in found:
        return "metaspace"
    return ""


class TokenBytes:
    """id -> bytes for one tokenizer (computed on demand, then kept)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        spec = json.loads(tokenizer.to_str())  # the whole tokenizer.json: read it once
        self._kind = _kind(spec)
        self._special = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        cached = self._cache.get(token)
        if cached is None:
            cached = self._cache[token] = self._compute(token)
        return cached

    def text(self, token: int) -> str:
        """The token as text; bytes that are not whole UTF-8 characters become U+FFFD."""
        return self(token).decode("utf-8", errors="replace")

    def _compute(self, token: int) -> bytes:
        piece = self._tokenizer.id_to_token(token)
        if piece is None:
            return b""
        if token in self._special:
            return piece.encode("utf-8")
        if self._kind == "byte_level":
            table = _byte_level_table()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        elif self._kind == "metaspace":
            match = _BYTE_TOKEN.fullmatch(piece)
            if match is not None:
                return bytes([int(match.group(1), 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return str(self._tokenizer.decode([token], skip_special_tokens=False)).encode("utf-8")
