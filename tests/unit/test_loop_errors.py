"""Peer strings made safe for logs; background-loop errors counted and logged sparingly."""

from __future__ import annotations

import logging

import pytest

from swarmd.errors import DialError, PeerError
from swarmd.net.loop_errors import LoopErrors, first_of, leaves
from swarmd.net.safe_text import MAX_LOG_CHARS, safe_text

HOSTILE = "peer said: ok\nDIAG: peer banned peer=honest\x1b[2J\x1b[31mred\u2028\x00end"


def test_peer_text_becomes_one_printable_line() -> None:
    text = safe_text(HOSTILE)
    assert text.isprintable()
    assert "\n" not in text and "\x1b" not in text and "\u2028" not in text
    assert text == "peer said: ok?DIAG: peer banned peer=honest?[2J?[31mred??end"
    assert safe_text("plain text, spaces kept") == "plain text, spaces kept"


def test_long_peer_text_is_capped() -> None:
    text = safe_text("x" * 100_000)
    assert len(text) == MAX_LOG_CHARS + 1 and text.endswith("…")
    assert safe_text(ValueError("a\nb")) == "a?b"  # anything, through str()


def test_a_logged_why_with_newlines_and_escapes_is_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("swarmd.test")
    with caplog.at_level(logging.WARNING, logger="swarmd.test"):
        logger.warning("DIAG: stage failed why=%s", safe_text(HOSTILE))
    (record,) = caplog.records
    line = record.getMessage()
    assert "\n" not in line and "\x1b" not in line
    assert len(caplog.text.strip().splitlines()) == 1


def test_groups_are_opened_to_find_the_real_error() -> None:
    inner = DialError("cannot connect", "peer-x")
    group = ExceptionGroup("nursery", [RuntimeError("other"), ExceptionGroup("in", [inner])])
    assert leaves(group)[1] is inner
    assert first_of(group, PeerError) is inner
    assert first_of(RuntimeError("x"), PeerError) is None
    assert first_of(inner, PeerError) is inner


def test_loop_errors_count_every_round_and_log_a_repeat_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    errors = LoopErrors(clock=lambda: now[0], repeat_log_s=60.0)
    with caplog.at_level(logging.ERROR, logger="swarmd.net.loop_errors"):
        for _ in range(5):
            errors.report("ping", RuntimeError("boom\nforged line"))
        errors.report("ping", ExceptionGroup("g", [ValueError("another")]))  # a new error
        now[0] = 61.0
        errors.report("ping", ExceptionGroup("g", [ValueError("another")]))  # time to repeat
        errors.report("renew", RuntimeError("boom"))
    assert errors.as_dict() == {"ping": 7, "renew": 1}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4
    assert all("\n" not in m for m in messages)
    assert "RuntimeError: boom?forged line" in messages[0]
    assert "ValueError: another" in messages[1]
