"""What an int4 kernel on bfloat16 dot products would give over torch's, by rows (issue 13).

swarmd's int4 layers run torch's `_weight_int4pack_mm_for_cpu`, which dequantizes every
weight to float32 and does one float32 FMA per multiply-add. From 4 rows on it runs at the
FMA unit's peak (about 41 GMAC/s a core on this AVX-512 box), so a decode step of 8
sessions costs twice one of 4 in its matrices, and 8 streams stay under 3x one stream.
`bench/int4_dot.cpp` is a prototype that sums each group of 32 weights with AVX512-BF16
`vdpbf16ps` instead (two multiply-adds a lane, no weight rounded: see its header). This
script builds it with g++ (`-march=native`) into a temporary folder, calls it through
ctypes on one thread, and compares it with torch's kernel on one thread, on the four
matrix shapes of a SmolLM2-135M layer (q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536), 30 layers' worth, for M rows. For each M it prints both times, the error of
each against a float32 matmul over the dequantized weights (as a fraction of the largest
output; the prototype's also before its float32 output is rounded to bfloat16, as
torch's is), and whether every row of the M-row call equals that row called alone, bit for
bit (what batched-equals-solo needs). Ends with

    RESULT int4_1row_ms=<ms> int4_8rows_ms=<ms> dot_1row_ms=<ms> dot_8rows_ms=<ms>
        speedup1=<r> speedup8=<r>

It needs g++ and a CPU with avx512_bf16 (it says so and exits 2 otherwise). swarmd does not
use the prototype: it has no threads, no torch op and no fallback for other CPUs.

Usage: .venv/bin/python bench/int4_dot.py [--levels 1,2,4,8,16] [--reps 50]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("int4_dot.cpp")
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K) of one layer's matrices
LAYERS = 30
GROUP = 32


def build(folder: Path) -> ctypes.CDLL:
    flags = "/proc/cpuinfo"
    if "avx512_bf16" not in Path(flags).read_text():
        sys.exit(f"this CPU has no avx512_bf16 ({flags}): the prototype cannot run here")
    if shutil.which("g++") is None:
        sys.exit("g++ is not installed")
    lib = folder / "libint4dot.so"
    cmd = ["g++", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(lib), str(SOURCE)]
    subprocess.run(cmd, check=True)
    dll = ctypes.CDLL(str(lib))
    dll.q4dot.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    dll.q4dot.restype = ctypes.c_int
    return dll


class Matrix:
    """One random int4 matrix in both layouts, and its float32 weights."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        q = torch.randint(0, 16, (n, k), dtype=torch.int32)
        self.scale_zero = (torch.randn(k // GROUP, n, 2) * 0.02).to(torch.bfloat16)
        self.torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        pairs = q.to(torch.uint8).view(n // 16, 16, k // 2, 2)
        # [N/16][K/2][16]: byte j of a pair holds column j's two weights (int4_dot.cpp)
        self.dot_packed = (pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 1).contiguous()
        self.s = self.scale_zero[..., 0].float().contiguous()
        self.z = self.scale_zero[..., 1].float().contiguous()
        # [K/32, N] -> [N, K]: each group's scale and zero over its 32 weights
        scale, zero = (t.repeat_interleave(GROUP, 0).T for t in (self.s, self.z))
        self.dense = (q.float() - 8) * scale + zero

    def torch_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.torch_packed, GROUP, self.scale_zero
        )

    def dot_mm(self, dll: ctypes.CDLL, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        bits = x.view(torch.int16)
        ptrs = (self.dot_packed, self.s, self.z, bits, out)
        if dll.q4dot(*(t.data_ptr() for t in ptrs), rows, self.k, self.n) != 0:
            raise RuntimeError("q4dot refused the shapes")
        return out


def best_s(fn: Callable[[], object], reps: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,2,4,8,16", help="rows per call")
    parser.add_argument("--reps", type=int, default=50, help="calls per timing")
    args = parser.parse_args()
    levels = [int(v) for v in args.levels.split(",")]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        mats = [Matrix(n, k) for n, k in SHAPES]
        print(
            f"{'rows':>4} {'torch ms':>9} {'dot ms':>7} {'speedup':>7} "
            f"{'err torch':>9} {'err dot':>8} {'(float32)':>9}  rows alone = in the batch"
        )
        result: dict[int, tuple[float, float]] = {}
        for rows in levels:
            t_torch = t_dot = 0.0
            err_torch = err_dot = err_dot32 = 0.0
            same = True
            for mat in mats:
                x = torch.randn(rows, mat.k).to(torch.bfloat16)
                out = torch.empty(rows, mat.n)
                ref = x.float() @ mat.dense.T
                top = ref.abs().max().item()
                got = mat.dot_mm(dll, x, out).clone()
                err_dot = max(err_dot, (got.bfloat16().float() - ref).abs().max().item() / top)
                err_dot32 = max(err_dot32, (got - ref).abs().max().item() / top)
                err_torch = max(err_torch, (mat.torch_mm(x).float() - ref).abs().max().item() / top)
                for r in range(rows):
                    alone = mat.dot_mm(dll, x[r : r + 1].contiguous(), torch.empty(1, mat.n))
                    same = same and torch.equal(alone[0], got[r])
                t_torch += best_s(lambda mat=mat, x=x: mat.torch_mm(x), args.reps)
                t_dot += best_s(lambda mat=mat, x=x, out=out: mat.dot_mm(dll, x, out), args.reps)
            ms_torch, ms_dot = t_torch * LAYERS * 1e3, t_dot * LAYERS * 1e3
            result[rows] = (ms_torch, ms_dot)
            print(
                f"{rows:>4} {ms_torch:>9.2f} {ms_dot:>7.2f} {ms_torch / ms_dot:>6.2f}x "
                f"{err_torch:>9.1e} {err_dot:>8.1e} {err_dot32:>9.1e}  {same}",
                flush=True,
            )
    one, eight = result.get(1), result.get(8)
    if one and eight:
        print(
            f"RESULT int4_1row_ms={one[0]:.2f} int4_8rows_ms={eight[0]:.2f} "
            f"dot_1row_ms={one[1]:.2f} dot_8rows_ms={eight[1]:.2f} "
            f"speedup1={one[0] / one[1]:.2f} speedup8={eight[0] / eight[1]:.2f}"
        )


if __name__ == "__main__":
    main()
