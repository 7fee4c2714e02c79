"""What the swarm layer does with an error its background loops did not expect (pure).

A loop that runs for the life of the node (pings, record renewal, the private-swarm
gate) must outlive any one bad round: one peer's odd answer or one library bug must not
stop the node's presence in the swarm for good. Each round's unexpected exception goes
to `LoopErrors.report`, which counts it per loop (for ``/metrics``) and logs it, once
per distinct error and then at most every `repeat_log_s`, so a loop failing every
round does not flood the log.

trio's nurseries wrap errors in exception groups, even a single one; `leaves` and
`first_of` see through them, so code that bans or retries on a `PeerError` sees one
that arrived inside a group too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from swarmd.net.safe_text import safe_text

__all__ = ["LoopErrors", "first_of", "leaves"]

log = logging.getLogger(__name__)

E = TypeVar("E", bound=BaseException)

REPEAT_LOG_S = 300.0  # the same error of one loop is logged again after this long


class LoopErrors:
    def __init__(
        self, clock: Callable[[], float] = time.monotonic, repeat_log_s: float = REPEAT_LOG_S
    ) -> None:
        self._clock = clock
        self._repeat_log_s = repeat_log_s
        self._counts: dict[str, int] = {}
        self._logged: dict[str, tuple[str, float]] = {}  # loop -> (error text, when)

    def report(self, loop: str, exc: BaseException) -> None:
        """Count one failed round of `loop` and log it unless it was just logged."""
        count = self._counts[loop] = self._counts.get(loop, 0) + 1
        text = "; ".join(safe_text(f"{type(e).__name__}: {e}") for e in leaves(exc)[:4])
        now = self._clock()
        last = self._logged.get(loop)
        if last is not None and last[0] == text and now - last[1] < self._repeat_log_s:
            return
        self._logged[loop] = (text, now)
        log.error(
            "DIAG: background loop failed loop=%s count=%d (it goes on): %s",
            loop,
            count,
            text,
            exc_info=exc,
        )

    def as_dict(self) -> dict[str, int]:
        """Failed rounds so far, by loop name."""
        return dict(self._counts)


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside `exc`, with every (nested) exception group opened."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def first_of(exc: BaseException, kind: type[E]) -> E | None:
    """The first exception of `kind` in `exc` (itself or inside its groups), or None."""
    for leaf in leaves(exc):
        if isinstance(leaf, kind):
            return leaf
    return None
