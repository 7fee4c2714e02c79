"""A swarmd node whose stage is slow, or whose record claims a throughput of its choosing.

    python tests/e2e/slow_node.py slow run [swarmd run options]
    python tests/e2e/slow_node.py claim:TPS run [swarmd run options]
    python tests/e2e/slow_node.py lag:MS run [swarmd run options]

`slow`: every forward of its stage takes 5 times as long (it sleeps 4 times what the
forward took, outside the compute it reports), while its DHT record claims a huge
throughput, so route planning that trusted records would keep choosing it. `claim:TPS`:
an honest stage whose record claims TPS tokens per second (a prior the planner can weigh
before it has measured the peer). `lag:MS`: an honest stage that waits MS milliseconds
after every forward and claims nothing: once measured, planning prefers any holder of
its range that is not slow (the abuse tests use it so that a hostile holder's claim keeps
winning the plans). The fault lives here, in the tests, not in swarmd.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from swarmd.cli import app
from swarmd.model.runtime import StageRuntime
from swarmd.pipeline.coordinator import Coordinator

SLOWDOWN = 5.0


def claim(tps: float) -> None:
    def recent_tokens_per_second(self: Coordinator, model_id: str | None = None) -> float:
        return tps

    Coordinator.recent_tokens_per_second = recent_tokens_per_second  # type: ignore[method-assign]


def slow_down(factor: float = SLOWDOWN, extra_s: float = 0.0) -> None:
    """Every forward takes `factor` times as long, plus `extra_s`."""
    honest = StageRuntime.step_many

    def step_many(self: StageRuntime, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = honest(self, *args, **kwargs)
        time.sleep((factor - 1.0) * (time.perf_counter() - started) + extra_s)
        return result

    StageRuntime.step_many = step_many  # type: ignore[method-assign]


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "slow":
        slow_down()
        claim(1e6)
    elif mode.startswith("claim:"):
        claim(float(mode.removeprefix("claim:")))
    elif mode.startswith("lag:"):
        slow_down(1.0, float(mode.removeprefix("lag:")) / 1000.0)
    else:
        sys.exit("usage: slow_node.py slow|claim:TPS|lag:MS run [options]")
    sys.argv = ["swarmd", *sys.argv[2:]]
    app()
