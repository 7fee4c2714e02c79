"""swarmd's int4 and int8 kernels against torch's, by rows (engine/native.py, bf16_dot.cpp).

The embedded model's matrices as a node holds them (random weights of the same shapes): a
layer's fused q/k/v 960x576, o 576x576, fused gate/up 6144x576 and down 576x1536, 30 layers'
worth, and the int8 head 49152x576. For each row count M it times torch's kernels
(`linear.Int4` / `Int8`) and swarmd's (`Int4Dot` / `Int8Dot`) in turns, and checks that each
row of swarmd's M-row call equals that row called alone, bit for bit. The error of each
against a float32 matmul of the same weights is printed as a fraction of the largest
output. Ends with

    RESULT int4_1row_ms=<torch> dot4_1row_ms=<swarmd> int4_8rows_ms=... dot4_8rows_ms=...
        head_1row_ms=... dot8_1row_ms=... head_8rows_ms=... dot8_8rows_ms=...

It needs swarmd's kernels (a CPU with avx512_bf16 and g++; `make native` builds them) and
says so and exits 2 otherwise.

Usage: .venv/bin/python bench/quant_kernels.py [--levels 1,2,4,8,16] [--threads 2] [--reps 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from swarmd.engine import native
from swarmd.engine.linear import Int4, Int4Dot, Int8, Int8Dot, Matrix
from swarmd.model import quant

LAYER = ((960, 576), (576, 576), (6144, 576), (576, 1536))  # (N, K) as a layer holds them
LAYERS = 30
HEAD = (49152, 576)


def best_s(fn: Callable[[], object], reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - started) / reps)
    return min(times)


def dense(q: quant.Int4 | quant.Int8) -> torch.Tensor:
    if isinstance(q, quant.Int8):
        return q.values.float() * q.scale[:, None]
    scale, zero = (t.repeat_interleave(32, dim=1) for t in (q.scale, q.zero))
    return (q.values.float() - 8) * scale + zero


class Pair:
    """One matrix on both kernels, and its float32 weights."""

    def __init__(self, q: quant.Int4 | quant.Int8, ops: native.Ops) -> None:
        self.k = q.shape[1]
        self.dense = dense(q)
        if isinstance(q, quant.Int4):
            self.theirs: Matrix = Int4(q, None, torch.bfloat16)
            self.ours: Matrix = Int4Dot(q, None, ops)
        else:
            self.theirs, self.ours = Int8(q, None, torch.bfloat16), Int8Dot(q, None, ops)


def measure(pairs: list[Pair], rows: int, reps: int, times: int) -> tuple[float, ...]:
    """(torch ms, swarmd ms, torch error, swarmd error, rows alike) over `pairs`, x times."""
    t_theirs = t_ours = err_theirs = err_ours = 0.0
    alike = True
    for pair in pairs:
        x = torch.randn(rows, pair.k).bfloat16()
        ref = x.float() @ pair.dense.T
        top = float(ref.abs().max())
        got = pair.ours(x)
        err_ours = max(err_ours, float((got.float() - ref).abs().max()) / top)
        err_theirs = max(err_theirs, float((pair.theirs(x).float() - ref).abs().max()) / top)
        alike = alike and all(torch.equal(pair.ours(x[r : r + 1])[0], got[r]) for r in range(rows))
        t_theirs += best_s(lambda pair=pair, x=x: pair.theirs(x), reps)
        t_ours += best_s(lambda pair=pair, x=x: pair.ours(x), reps)
    return t_theirs * times * 1e3, t_ours * times * 1e3, err_theirs, err_ours, float(alike)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,2,4,8,16", help="rows per call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30, help="calls per timing")
    args = parser.parse_args()
    ops = native.ops()
    if ops is None:
        sys.exit("swarmd's kernels are not available here (see the log above): nothing to compare")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    layer = [Pair(quant.quantize_int4(torch.randn(n, k) * 0.05), ops) for n, k in LAYER]
    head = [Pair(quant.quantize_int8(torch.randn(*HEAD) * 0.05), ops)]
    print(f"{args.threads} threads; ms for 30 layers' int4 matrices and for the int8 head")
    print(
        f"{'rows':>4} {'int4 torch':>10} {'swarmd':>7} {'x':>5}  {'head torch':>10} "
        f"{'swarmd':>7} {'x':>5}  {'err torch':>9} {'swarmd':>7}  rows alike"
    )
    result: dict[int, tuple[float, float, float, float]] = {}
    for rows in (int(v) for v in args.levels.split(",")):
        l4, o4, e4, d4, a4 = measure(layer, rows, args.reps, LAYERS)
        l8, o8, e8, d8, a8 = measure(head, rows, args.reps, 1)
        result[rows] = (l4, o4, l8, o8)
        print(
            f"{rows:>4} {l4:>10.2f} {o4:>7.2f} {l4 / o4:>4.2f}x  {l8:>10.2f} {o8:>7.2f} "
            f"{l8 / o8:>4.2f}x  {max(e4, e8):>9.1e} {max(d4, d8):>7.1e}  {bool(a4 and a8)}",
            flush=True,
        )
    one, eight = result.get(1), result.get(8)
    if one and eight:
        print(
            f"RESULT int4_1row_ms={one[0]:.2f} dot4_1row_ms={one[1]:.2f} "
            f"int4_8rows_ms={eight[0]:.2f} dot4_8rows_ms={eight[1]:.2f} "
            f"head_1row_ms={one[2]:.2f} dot8_1row_ms={one[3]:.2f} "
            f"head_8rows_ms={eight[2]:.2f} dot8_8rows_ms={eight[3]:.2f}"
        )


if __name__ == "__main__":
    main()
