"""Log probabilities in OpenAI's two shapes, from the (token, logprobs) pairs of a reply.

Chat (`choices[].logprobs`)::

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}, ...]}, ...], "refusal": null}

Completions (the legacy shape)::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
    "text_offset": [...]}

A streamed reply gets the same objects per chunk, for the tokens that chunk's text
completes; `text_offset` keeps counting across chunks, each choice its own text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from swarmd.model.sampling import TokenLogprobs
from swarmd.model.token_bytes import TokenBytes

Pairs = Sequence[tuple[int, TokenLogprobs]]


class LogprobsWriter:
    """Formats one reply's logprobs, chunk by chunk (or all at once)."""

    def __init__(self, kind: Literal["chat", "text"], token_bytes: TokenBytes) -> None:
        self._kind = kind
        self._bytes = token_bytes
        # per choice: characters of its text before its next token (completions)
        self._offsets: dict[int, int] = {}

    def format(self, pairs: Pairs, index: int = 0) -> dict[str, Any]:
        """The logprobs of choice `index`'s next tokens."""
        if self._kind == "chat":
            return {"content": [self._chat_entry(t, lp) for t, lp in pairs], "refusal": None}
        tokens, offsets = [], []
        offset = self._offsets.get(index, 0)
        for token, _ in pairs:
            text = self._bytes.text(token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for _, lp in pairs],
            "top_logprobs": [{self._bytes.text(i): v for i, v in lp.top} for _, lp in pairs],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, lp: TokenLogprobs) -> dict[str, Any]:
        return {
            **self._one(token, lp.logprob),
            "top_logprobs": [self._one(i, v) for i, v in lp.top],
        }

    def _one(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._bytes(token)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}
