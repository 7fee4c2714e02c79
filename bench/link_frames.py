"""Several sessions' steps over one link: a frame per session, or one frame for them all?

Issue 13 asks which: when a stage's batched forward gives N sessions' hidden states for
the same next peer, each can travel as its own frame on its session's stream (what
swarmd does), or all N in one frame. This benchmark measures the transport alone, with
swarmd's own libp2p host (Noise, yamux, `FrameStream`) between two processes on
127.0.0.1: per step, N frames of `--bytes` each sent at once on N streams and echoed,
against one frame holding the N payloads on one stream, echoed. It prints the median
round trip and the client's CPU time per step for each N, and

    RESULT streams8_ms=<ms> bundle8_ms=<ms> bundle8_speedup=<r>

Usage: .venv/bin/python bench/link_frames.py [--bytes 1152] [--steps 300] [--sessions 1,2,4,8,16]
(1,152 bytes: one token's hidden state of the embedded model in bfloat16.)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from swarmd.net.frames import FrameStream  # noqa: E402
from swarmd.net.host import open_host  # noqa: E402
from swarmd.net.identity import Identity  # noqa: E402

PROTOCOL = "/swarmd-bench/echo/1"
WARMUP = 30


async def serve() -> None:
    """The far end: echo every frame on every stream, until stdin closes."""
    async with open_host(Identity.generate(), 0) as host:

        async def echo(stream: FrameStream) -> None:
            while True:
                await stream.send(await stream.recv(60.0))

        host.set_handler(PROTOCOL, echo, gated=False)
        print(host.addrs[0], flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)


async def measure(addr: str, sessions: list[int], size: int, steps: int) -> dict[int, tuple]:
    results: dict[int, tuple] = {}
    async with open_host(Identity.generate(), 0) as host:
        peer = await host.connect(addr)
        for n in sessions:
            streams = [await host.open_stream(peer, PROTOCOL) for _ in range(n)]
            one = await host.open_stream(peer, PROTOCOL)
            frame = {"h": os.urandom(size)}
            bundle = {"b": [os.urandom(size) for _ in range(n)]}

            per_session = functools.partial(_per_session, streams, frame)
            bundled = functools.partial(_bundled, one, bundle)
            # Alternated, twice each, so a slow moment of the machine hits both.
            runs: dict[str, list[tuple[float, float]]] = {"streams": [], "bundle": []}
            for name, step in [("streams", per_session), ("bundle", bundled)] * 2:
                runs[name] += await _timed(step, steps)
            results[n] = tuple(
                (
                    statistics.median(wall for wall, _ in runs[name]),
                    statistics.median(cpu for _, cpu in runs[name]),
                )
                for name in ("streams", "bundle")
            )
            for stream in [*streams, one]:
                await stream.close()
    return results


async def _per_session(streams: list[FrameStream], frame: dict) -> None:
    async def round_trip(stream: FrameStream) -> None:
        await stream.send(frame)
        await stream.recv(60.0)

    async with trio.open_nursery() as nursery:
        for stream in streams:
            nursery.start_soon(round_trip, stream)


async def _bundled(one: FrameStream, bundle: dict) -> None:
    await one.send(bundle)
    await one.recv(60.0)


async def _timed(step: Callable[[], Awaitable[None]], steps: int) -> list[tuple[float, float]]:
    out = []
    for i in range(steps + WARMUP):
        wall, cpu = time.perf_counter(), time.process_time()
        await step()
        if i >= WARMUP:
            out.append(((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--bytes", type=int, default=1152, help="payload per session per step")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sessions", default="1,2,4,8,16")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve)
        return
    sessions = [int(n) for n in args.sessions.split(",")]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        addr = server.stdout.readline().strip()
        if not addr:
            raise SystemExit(f"the echo process exited with {server.wait()}")
        results = trio.run(measure, addr, sessions, args.bytes, args.steps)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=30)
    print(f"{args.bytes} bytes per session per step; medians of {2 * args.steps} steps")
    print("sessions  per-session frames: ms (client cpu)   one frame: ms (client cpu)")
    for n, ((s_ms, s_cpu), (b_ms, b_cpu)) in results.items():
        print(f"{n:8d}  {s_ms:10.2f} ({s_cpu:5.2f})            {b_ms:10.2f} ({b_cpu:5.2f})")
    if 8 in results:
        (s_ms, _), (b_ms, _) = results[8]
        print(
            f"RESULT streams8_ms={s_ms:.2f} bundle8_ms={b_ms:.2f} bundle8_speedup={s_ms / b_ms:.2f}"
        )


if __name__ == "__main__":
    main()
