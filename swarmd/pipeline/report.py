"""What requests and failures leave behind: the DIAG line, the recent-requests ring, the
failure ring, and the ledger of failure reports that proved false."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

_UNSAFE = re.compile(r"[\s=]")


def ms(seconds: float | None) -> float | None:
    """Seconds to milliseconds, keeping None (not measured) as None."""
    return None if seconds is None else seconds * 1000.0


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    model: str
    route: str  # local | distributed | relayed | forwarded
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
    relayed: list[str] = field(default_factory=list)  # the nodes reached through a relay
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
            ("relayed", ",".join(self.relayed) if self.relayed else None),
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
    """The last N failures of this node: every `DIAG:` line logged at WARNING or above,
    but for notices of a state reached (`dht.swarm.NOTICE`).

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
        # A notice (`extra=NOTICE`: reachable, joined) is a DIAG line but no failure.
        if message.startswith("DIAG:") and not getattr(record, "notice", False):
            self._failures.append(Failure(record.created, record.name, message))

    def recent(self) -> list[Failure]:
        return list(self._failures)


class FalseReports:
    """Which peers keep telling this node of failures that its own checks disprove.

    A stage's `fail` report naming another peer is only that stage's word. The
    coordinator checks it (a ping of the peer it names); when the named peer answers, the
    report is false and is charged to its teller. The rule: a teller with `limit` false
    reports within `window_s` seconds is banned (`add` returns True, and its count starts
    again, so the ban's own backoff decides how long it stays out).

    Three in ten minutes forgives the odd honest report that a ping cannot confirm (a
    link between two stages that broke while both still answer this node) and still
    catches a peer that names an honest neighbour on every request.

    A ping cannot settle a report about the teller's own link, though: "my neighbour
    closed our stream" is true when a hostile neighbour hangs up on purpose and still
    answers pings. So a teller that has `served` a step of this node's sessions within
    the window is not charged for reports naming a peer of its route (`vouched`): its
    word is weighed against its record. A peer that never serves and keeps naming
    neighbours is still charged every time; a hostile stage cannot get its honest
    neighbour banned by hanging up on it, as long as that neighbour serves any session
    (one through another holder of the hostile stage's range, say).
    """

    def __init__(self, limit: int = 3, window_s: float = 600.0, max_tellers: int = 4096) -> None:
        self.limit = limit
        self.window_s = window_s
        self._max_tellers = max_tellers  # a bound on what throwaway peer ids can fill
        self._charged: dict[str, deque[float]] = {}
        self._served: dict[str, float] = {}  # peer -> when it last served a step
        # `served` runs in the trio thread (a ring's callback), the rest on the API's.
        self._lock = threading.Lock()

    def served(self, peers: Iterable[str], now: float | None = None) -> None:
        """These peers just carried a step of one of this node's sessions."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for peer in peers:
                self._served.pop(peer, None)
                self._served[peer] = now  # re-inserted: the oldest stays first, to be evicted
            while len(self._served) > self._max_tellers:
                self._served.pop(next(iter(self._served)))

    def vouched(self, teller: str, now: float | None = None) -> bool:
        """True when `teller` served a step within the window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            when = self._served.get(teller)
        return when is not None and when > now - self.window_s

    def add(self, teller: str, now: float | None = None) -> bool:
        """Charge `teller` with one false report; True: ban it now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            times = self._charged.pop(teller, None) or deque()
            times.append(now)
            while times and times[0] <= now - self.window_s:
                times.popleft()
            if len(times) >= self.limit:
                return True  # dropped from the ledger: the ban takes over
            self._charged[teller] = times  # re-inserted: the most recently charged is newest
            while len(self._charged) > self._max_tellers:
                self._charged.pop(next(iter(self._charged)))
            return False

    def count(self, teller: str, now: float | None = None) -> int:
        """False reports charged to `teller` within the window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return sum(1 for t in self._charged.get(teller, ()) if t > now - self.window_s)
