"""What requests and failures leave behind: the DIAG line, the recent-requests ring and
the failure ring."""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field

_UNSAFE = re.compile(r"[\s=]")


def ms(seconds: float | None) -> float | None:
    """Seconds to milliseconds, keeping None (not measured) as None."""
    return None if seconds is None else seconds * 1000.0


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    model: str
    route: str  # local | distributed
    nodes: list[str]  # short ids, in route order
    outcome: str  # ok | error
    error_type: str | None = None
    queue_ms: float | None = None
    sched_ms: float | None = None
    ttft_ms: float | None = None
    decode_ms: float | None = None
    total_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, reused from a cached conversation
    tokens: int | None = None
    stage_ms: tuple[float, ...] = ()
    activation_bytes: int | None = None
    failovers: int | None = None
    finished_at: float = field(default_factory=time.time)  # unix seconds

    @property
    def tok_per_sec(self) -> float | None:
        # Decode speed after the first token, as llama.cpp and vLLM report it.
        if self.tokens is None or self.tokens < 2 or not self.decode_ms:
            return None
        return (self.tokens - 1) / (self.decode_ms / 1000.0)

    @property
    def tpot_ms(self) -> float | None:
        if self.tokens is None or self.tokens < 2 or not self.decode_ms:
            return None
        return self.decode_ms / (self.tokens - 1)

    def diag_line(self) -> str:
        """`DIAG: request complete ...`; a field that was not measured is left out."""
        fields: list[tuple[str, object]] = [
            ("request_id", self.request_id),
            ("route", self.route),
            ("segments", len(self.nodes) if self.nodes else None),
            ("model", self.model),
            ("nodes", ",".join(self.nodes) if self.nodes else None),
            ("queue_ms", self.queue_ms),
            ("sched_ms", self.sched_ms),
            ("ttft_ms", self.ttft_ms),
            ("decode_ms", self.decode_ms),
            ("total_ms", self.total_ms),
            ("prompt_tokens", self.prompt_tokens),
            ("cached_tokens", self.cached_tokens),
            ("tokens", self.tokens),
            ("tok_per_sec", self.tok_per_sec),
            ("tpot_ms", self.tpot_ms),
        ]
        fields += [(f"seg{i}_ms", ms) for i, ms in enumerate(self.stage_ms)]
        fields += [
            ("activation_bytes", self.activation_bytes),
            ("failovers", self.failovers),
            ("outcome", self.outcome),
            ("error_type", self.error_type),
        ]
        parts = [f"{k}={_fmt(v)}" for k, v in fields if v is not None]
        return "DIAG: request complete " + " ".join(parts)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 1 or value == 0 else f"{value:.3f}"
    # Values such as the model name come from clients: no spaces, newlines or '=' that
    # could forge another field or another log line.
    return _UNSAFE.sub("_", str(value))[:128]


class RequestRing:
    """The last N finished requests, newest last."""

    def __init__(self, size: int = 50) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=size)

    def add(self, record: RequestRecord) -> None:
        self._records.append(record)

    def recent(self) -> list[RequestRecord]:
        return list(self._records)


@dataclass(frozen=True)
class Failure:
    at: float  # unix seconds
    logger: str
    line: str  # the DIAG line as logged


class FailureRing(logging.Handler):
    """The last N failures of this node: every `DIAG:` line logged at WARNING or above.

    A logging handler, so every failure path that logs its DIAG line (a stage failed, a
    peer banned, a bad frame, a refused chunk, a request that ended in error) lands here
    without each one having to know about the ring.
    """

    def __init__(self, size: int = 50) -> None:
        super().__init__(level=logging.WARNING)
        self._failures: deque[Failure] = deque(maxlen=size)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format string: logging's problem, not ours
            return
        if message.startswith("DIAG:"):
            self._failures.append(Failure(record.created, record.name, message))

    def recent(self) -> list[Failure]:
        return list(self._failures)
