"""What a step's frame costs a thread that has just woken: each piece warm and cold.

A ring's nodes take turns: while one stage computes, the others' threads wait, and the
thread a frame wakes runs with cold caches. So every Python call on a hop's path costs
many times what a warm loop says (issue 17, item 7; `bench/hop_timeline.py` shows it in
place). This benchmark times, in one process, the pieces of a decode step's frame for the
embedded model's width (576, float32) two ways:

- warm: `--warm` calls back to back (after 100 untimed), the mean;
- cold: `--cold` calls, each after the thread slept 10 ms (as between a ring's tokens),
  the median.

Pieces: the step frame built (`wire.step_frame`) and encoded (`frames.encode_frame`);
its body decoded (`frames.decode_body`: budget walk and msgpack); its fields read by the
schema (`STEP_HIDDEN`) and by the one-pass check (`wire.plain_step`); a hidden state's
NaN/Inf check by torch and by numpy; and the whole `wire.parse_step`. The last line is

    RESULT parse_warm_us=<us> parse_cold_us=<us> schema_cold_us=<us> plain_cold_us=<us>

Usage: .venv/bin/python bench/cold_frames.py [--warm 2000] [--cold 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.errors import MalformedFrameError
from swarmd.model.layers import LayerRange
from swarmd.net.frames import FRAME_HEADER_BYTES, decode_body, encode_frame
from swarmd.pipeline import wire

WIDTH = 576  # SmolLM2-135M's hidden size
IDLE_S = 0.010  # a thread's wait between a ring's tokens


def warm_us(fn: Callable[[], Any], count: int) -> float:
    for _ in range(100):
        fn()
    started = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - started) / count * 1e6


def cold_us(fn: Callable[[], Any], count: int) -> float:
    times = []
    for _ in range(count):
        time.sleep(IDLE_S)
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--warm", type=int, default=2000)
    parser.add_argument("--cold", type=int, default=150)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a node's network thread (keep_this_thread_single_threaded)

    limits = wire.StageLimits("p", "m", LayerRange(15, 30), 30, WIDTH, 49152, 8192)
    hidden = torch.randn(1, 1, WIDTH)
    frame = wire.step_frame(7, True, hidden, [4.5], 100)
    body = encode_frame(frame, 2**24)[FRAME_HEADER_BYTES:]
    raw = frame["h"]

    def torch_finite() -> bool:
        return bool(torch.isfinite(torch.frombuffer(bytearray(raw), dtype=torch.float32)).all())

    def numpy_finite() -> bool:
        return bool(np.isfinite(np.frombuffer(raw, dtype=np.float32)).all())

    pieces: dict[str, Callable[[], Any]] = {
        "build (step_frame)": lambda: wire.step_frame(7, True, hidden, [4.5], 100),
        "encode (encode_frame)": lambda: encode_frame(frame, 2**24),
        "decode (decode_body)": lambda: decode_body(body),
        "read by the schema": lambda: wire.STEP_HIDDEN.read(frame, MalformedFrameError),
        "read in one pass (plain_step)": lambda: wire.plain_step(frame, False),
        "NaN/Inf check, torch": torch_finite,
        "NaN/Inf check, numpy": numpy_finite,
        "parse_step (whole)": lambda: wire.parse_step(frame, 7, False, limits, torch.float32),
    }
    print(f"a decode step's frame, width {WIDTH}, float32; cold: after {IDLE_S * 1000:g} ms idle")
    print(f"  {'piece':32s} {'warm us':>9s} {'cold us':>9s} {'cold/warm':>9s}")
    results: dict[str, tuple[float, float]] = {}
    for name, fn in pieces.items():
        warm, cold = warm_us(fn, args.warm), cold_us(fn, args.cold)
        results[name] = (warm, cold)
        print(f"  {name:32s} {warm:9.2f} {cold:9.1f} {cold / warm:9.1f}")
    parse_warm, parse_cold = results["parse_step (whole)"]
    print(
        f"RESULT parse_warm_us={parse_warm:.2f} parse_cold_us={parse_cold:.1f}"
        f" schema_cold_us={results['read by the schema'][1]:.1f}"
        f" plain_cold_us={results['read in one pass (plain_step)'][1]:.1f}"
    )


if __name__ == "__main__":
    main()
