"""`safe_text`: a string a peer chose, made fit for one log line (pure).

Peers decide what a `why`, an error message or a record field says. Written to a log as
is, a newline forges a second log entry and an ANSI escape repaints the operator's
terminal; a megabyte of text drowns the log. So every peer-supplied string the swarm
layer logs goes through `safe_text` first: control characters (C0, DEL, C1, and the
Unicode line and paragraph separators) become ``?`` and the result is capped in length.
"""

from __future__ import annotations

__all__ = ["MAX_LOG_CHARS", "safe_text"]

MAX_LOG_CHARS = 200  # enough for a reason or a multiaddr; the rest is cut


def _unsafe(char: str) -> bool:
    # isprintable() is False for every control, format and separator character except
    # the plain space, which is the one we keep.
    return char != " " and not char.isprintable()


def safe_text(value: object, max_chars: int = MAX_LOG_CHARS) -> str:
    """`value` as one printable line of at most `max_chars` characters (plus an ellipsis)."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > max_chars
    text = text[:max_chars]
    if not text.isprintable():
        text = "".join("?" if _unsafe(c) else c for c in text)
    return text + "…" if cut else text
