"""`run_trio`: a trio test body run to completion, or failed at its deadline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


def run_trio(test: Callable[[], Awaitable[None]], deadline_s: float) -> None:
    async def main() -> None:
        with trio.fail_after(deadline_s):
            await test()

    trio.run(main)
