"""The relay library's ERROR lines for streams that simply ended are DEBUG lines here;
its other errors still show."""

from __future__ import annotations

import logging

import pytest

from swarmd.net.relay import is_circuit_ending, quiet_circuit_endings

PEER = "12D3KooWPXT8cKWPaQJJxL1si3hWuyfJZJLYhc3JMG1mKbZry87D"


@pytest.mark.parametrize(
    ("message", "ending"),
    [
        (f"Error reading from hop stream from {PEER}: ", True),
        ("Unexpected error reading from stream: ", True),
        ("Unexpected error reading from stream: Cannot read from stream; stream is reset", True),
        ("Error writing to destination stream: ", True),
        (f"Error reading from hop stream from {PEER}: Error parsing message", False),
        ("Error writing to destination stream: [Errno 32] Broken pipe", False),
        ("Error relaying data: boom", False),
        (f"Timeout reading from hop stream from {PEER}", False),
    ],
)
def test_only_streams_that_ended_are_endings(message: str, ending: bool) -> None:
    assert is_circuit_ending(message) is ending


def test_endings_reach_no_error_handler_and_other_errors_do() -> None:
    quiet_circuit_endings()
    quiet_circuit_endings()  # once is enough; twice adds nothing
    relay_logger = logging.getLogger("libp2p.relay.circuit_v2.protocol")
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep(level=logging.ERROR)
    relay_logger.addHandler(handler)
    try:
        relay_logger.error("Error reading from hop stream from %s: %s", PEER, "")
        relay_logger.error("Error writing to destination stream: %s", "")
        relay_logger.error("Error relaying data: %s", "boom")
    finally:
        relay_logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["Error relaying data: boom"]
    assert sum(1 for f in relay_logger.filters if type(f).__name__ == "_CircuitEndings") == 1
