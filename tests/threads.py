"""Two threads at one object, switching often: how the tests show that state the trio
thread and the API's thread share stays whole (swarmd/net/bridge.py)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def switching_often() -> Iterator[None]:
    """Let Python switch threads every microsecond (5 ms by default), so that a race
    between two threads shows within a second instead of once in hours."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(switch)


def in_both_threads(write: Callable[[int], None], read: Callable[[], None]) -> list[str]:
    """`write(i)` over and over in another thread while this one calls `read()` for half a
    second, switching often; the errors either raised."""
    stop = threading.Event()
    errors: list[str] = []

    def writer() -> None:
        i = 0
        try:
            while not stop.is_set():
                write(i)
                i += 1
        except Exception as exc:
            errors.append(repr(exc))

    with switching_often():
        other = threading.Thread(target=writer)
        other.start()
        try:
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                read()
        except Exception as exc:
            errors.append(repr(exc))
        finally:
            stop.set()
            other.join()
    return errors
