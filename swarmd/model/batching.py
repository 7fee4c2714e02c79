"""`Gatherer`: which sessions' steps one forward waits for (continuous batching's timing).

The worker runs the steps that are queued when a forward starts as one batch. Sessions
whose next step comes back quickly (a local reply: the token goes to the HTTP side and
the next step is queued about 2 ms later) would miss every batch by that much and run
alone in turn; so a forward waits for them, briefly. Sessions whose next step comes back
slowly (a ring: it travels through the other stages first) are never waited for: the
forward runs with what has arrived, and they join a later one.

Each session's "gap" (from the end of its last step to the arrival of its next) is an
exponential average; a session is waited for when its gap is under `max_wait_s`, until
about 1.5 gaps after its last step ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

_EMA = 0.3  # weight of the newest gap
_SLACK = 1.5  # wait up to this many gaps past the last step's end


class Gatherer:
    def __init__(self, max_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._ended: dict[str, float] = {}  # session -> when its last step ended
        self._gap: dict[str, float] = {}  # session -> average gap, seconds

    def arrived(self, session_id: str, submitted_at: float) -> None:
        """A step of `session_id` was queued at `submitted_at` (worker clock)."""
        ended = self._ended.pop(session_id, None)
        if ended is None:
            return
        gap = max(0.0, submitted_at - ended)
        old = self._gap.get(session_id)
        self._gap[session_id] = gap if old is None else (1 - _EMA) * old + _EMA * gap

    def ended(self, session_ids: Iterable[str]) -> None:
        """These sessions' steps just ended (their results are on their way)."""
        now = self._clock()
        for sid in session_ids:
            self._ended[sid] = now

    def forget(self, session_id: str) -> None:
        self._ended.pop(session_id, None)
        self._gap.pop(session_id, None)

    def wait_until(self, present: set[str]) -> float:
        """The clock time until which a forward holding `present` waits for quick ones."""
        now = self._clock()
        until = now
        for sid, ended in self._ended.items():
            gap = self._gap.get(sid)
            if sid in present or gap is None or gap > self.max_wait_s:
                continue
            until = max(until, ended + _SLACK * gap + 0.0005)
        return min(until, now + self.max_wait_s)
