"""swarmd's own CPU kernels: `bf16_dot.cpp` (int4 and int8 matmuls) and `attend.cpp`
(attention over the KV caches), built with g++ against the installed torch into one library
for CPUs with avx512_bf16; and `blocks.cpp` (matmuls over GGUF's Q4_0 and Q8_0 blocks as the
file holds them), a second library for any CPU with AVX2, FMA and F16C (`blocks_op`).

Why hand-written kernels: torch's int4 and int8 CPU kernels turn each weight into float32
and do one float32 FMA per multiply-add, so from 4 rows on they run at the FMA units'
peak, which caps what batching sessions gains. These sum with AVX512-BF16 dot products,
two multiply-adds a lane, with no weight rounded (the .cpp's header; README "Speed"). No
maintained library has such CPU kernels on the package index (torchao's wheel holds CUDA
kernels only).

- `build(folder)` compiles the ops once into a cache folder (`make install` runs
  `python -m swarmd.engine.native`; a node builds them on first use otherwise, ~10 s).
  The file's name carries a hash of the source, the torch version and the flags, so an
  upgrade builds a new one; concurrent builders each write a temporary file and rename it.
- `ops()` is the loaded ops, or None where they cannot run: a CPU without avx512_bf16, no
  g++, a failed build, or switched off (`configure(False)`, the `native_kernels` setting).
  The answer is settled once per process: every matrix of a process uses one kind.
- `block_int4` / `block_int8`: the weight layouts the ops read.
- `attend`: a query's attention computed alone in one fixed order (attend.cpp's header), so
  its bits never depend on the batch, the chunk or the threads; `attend_fits` says where a
  stage takes it.

Their results differ from torch's kernels in the last bits (float32 scales, another order
of adds); each node's replies are exact under batching either way (README "Speed").
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmd.model import quant

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("bf16_dot.cpp"), Path(__file__).with_name("attend.cpp"))
CPU_FLAG = "avx512_bf16"  # as /proc/cpuinfo spells it
BLOCKS_SOURCES = (Path(__file__).with_name("blocks.cpp"),)
BLOCKS_CPU_FLAGS = ("avx2", "fma", "f16c")
BLOCKS_FLAGS = ("-mavx2", "-mfma", "-mf16c")
BLOCKS_SCHEMA = "q_mm(Tensor x, Tensor blocks, int qtype) -> Tensor"
BLOCK_TYPES = {"Q4_0": 0, "Q8_0": 1, "Q4_K": 3, "Q5_K": 4}  # blocks.cpp's qtype codes
BAND_CODE, BAND_ROWS = 2, 4  # Q4_0 interleaved by 4 rows (`band_q4_0`)
COLUMNS = 16  # output columns per block of the packed weights (bf16_dot.cpp's kCols)
SCHEMAS = (  # as bf16_dot.cpp and attend.cpp define them
    "int4_bf16_mm(Tensor x, Tensor packed, Tensor scale, Tensor zero) -> Tensor",
    "int8_bf16_mm(Tensor x, Tensor packed, Tensor scale) -> Tensor",
    "attend(Tensor q, Tensor new_kv, Tensor[] caches, int layer, int[] which, int[] lo, "
    "int[] hi, float scale) -> Tensor",
)
ATTEND_LANES, ATTEND_MAX_HEAD_DIM = 16, 256  # attend.cpp's head dims: multiples, up to


@dataclass(frozen=True)
class Ops:
    int4: Callable[..., torch.Tensor]  # (x, packed, scale, zero) -> bfloat16 [M, N]
    int8: Callable[..., torch.Tensor]  # (x, packed, scale) -> bfloat16 [M, N]


# Not -march=native: some VMs advertise AMX and trap on it (shared/notes/engine.md).
_ARCH_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")
BUILD_TIMEOUT_S = 300.0

_lock = threading.Lock()
_enabled = True
_settled = False
_ops: Ops | None = None
_schema_only: torch.library.Library | None = None  # kept: dropping it unregisters the schema
_blocks_settled = False
_blocks_op: Callable[..., torch.Tensor] | None = None
_blocks_schema: torch.library.Library | None = None


def configure(enabled: bool) -> None:
    """Whether this process may use swarmd's kernels (at start-up, before any model loads:
    once a matrix took a kernel, every later one takes the same kind)."""
    global _enabled
    with _lock:
        if _settled:
            log.debug("kernels already settled; configure(%s) changes nothing", enabled)
        _enabled = enabled


def cache_folder() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("swarmd")) / "native"


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_has_bf16_dot() -> bool:
    return CPU_FLAG in _cpu_flags()


def cpu_has_blocks() -> bool:
    return set(BLOCKS_CPU_FLAGS) <= _cpu_flags()


def blocks_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.swarmd_blocks.q_mm` (x bfloat16 [M, K], blocks uint8 [N, bytes], qtype
    code) -> bfloat16 [M, N], loaded (and built if need be), or None where it cannot run
    (no AVX2/FMA/F16C, no g++, a failed build, or switched off like the other kernels)."""
    global _blocks_settled, _blocks_op, _blocks_schema
    with _lock:
        if not _blocks_settled:
            _blocks_op = _load_blocks() if _enabled else None
            if _blocks_op is None:
                # TorchScript resolves the op's name when it compiles the decode loop.
                _blocks_schema = torch.library.Library("swarmd_blocks", "DEF")
                _blocks_schema.define(BLOCKS_SCHEMA)
            _blocks_settled = True
        return _blocks_op


def ops() -> Ops | None:
    """`torch.ops.swarmd`'s kernels, loaded (and built if need be), or None."""
    global _settled, _ops, _schema_only
    with _lock:
        if not _settled:
            _ops = _load() if _enabled else None
            if _ops is None:
                # TorchScript resolves the ops' names when it compiles the decode loop
                # (scripted.py), so the schemas exist even where no kernel does.
                _schema_only = torch.library.Library("swarmd", "DEF")
                for schema in SCHEMAS:
                    _schema_only.define(schema)
            _settled = True
        return _ops


def int8_fits(n: int, k: int) -> bool:
    return n % COLUMNS == 0 and k % 2 == 0


def block_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of 0..15 -> [N/16, K/2, 16]: per block of 16 output columns, byte j of
    pair p holds column j's weights 2p (low nibble) and 2p + 1 (high)."""
    n, k = values.shape
    pairs = quant.pack_nibbles(values)  # [N, K/2]
    return pairs.view(n // COLUMNS, COLUMNS, k // 2).transpose(1, 2).contiguous()


def block_int8(values: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N/16, K/2, 16, 2]: per block of 16 output columns, pair p of
    column j's weights side by side."""
    n, k = values.shape
    return values.view(n // COLUMNS, COLUMNS, k // 2, 2).transpose(1, 2).contiguous()


def int8_rows(blocked: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` ([...]) of a `block_int8` matrix: int8 [..., K] (embedding lookups of a
    table that a tied head holds blocked)."""
    k = blocked.shape[1] * 2
    return blocked[ids // COLUMNS, :, ids % COLUMNS, :].reshape(*ids.shape, k)


def band_q4_0(data: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows uint8 [N, G * 18] -> [N / 4, G * 72]: per 4 rows and block, the 4 fp16
    scales, then the 4 rows' 16 bytes of nibbles (blocks.cpp's `band_dot` reads them so)."""
    n, row_bytes = data.shape
    groups = row_bytes // 18
    bands = data.view(n // BAND_ROWS, BAND_ROWS, groups, 18)
    scales = bands[..., :2].permute(0, 2, 1, 3).reshape(n // BAND_ROWS, groups, 2 * BAND_ROWS)
    nibbles = bands[..., 2:].permute(0, 2, 1, 3).reshape(n // BAND_ROWS, groups, 16 * BAND_ROWS)
    return torch.cat([scales, nibbles], dim=-1).reshape(n // BAND_ROWS, -1).contiguous()


def attend_fits(head_dim: int) -> bool:
    """Whether attention of this head size runs on `attend` (the ops loaded)."""
    fits = head_dim % ATTEND_LANES == 0 and 0 < head_dim <= ATTEND_MAX_HEAD_DIM
    return fits and ops() is not None


def attend(
    q: torch.Tensor,
    new_kv: torch.Tensor,
    caches: list[torch.Tensor],
    layer: int,
    which: list[int],
    lo: list[int],
    hi: list[int],
    scale: float,
) -> torch.Tensor:
    """Attention of q [R, heads, D] (float32), row r over positions [lo[r], hi[r]) of
    layer `layer` of `caches[which[r]]` (KV slots [layers, 2, 1, kv, capacity, D]), after
    writing new_kv [2, R, kv, D] at each row's hi - 1 (empty: written already):
    [R, heads, D]. Only once `ops()` loaded (attend.cpp)."""
    return torch.ops.swarmd.attend(q, new_kv, caches, layer, which, lo, hi, scale)


def library_path(
    folder: Path,
    sources: tuple[Path, ...] = SOURCES,
    flags: tuple[str, ...] = _ARCH_FLAGS,
    stem: str = "bf16_dot",
) -> Path:
    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in sources),
        torch.__version__.encode(),
        " ".join(flags).encode(),
    ):
        key.update(part)
    key.update(str(torch_dir).encode())
    return folder / f"{stem}-{key.hexdigest()[:16]}.so"


def build_blocks(folder: Path) -> Path:
    return build(folder, BLOCKS_SOURCES, BLOCKS_FLAGS, "blocks")


def build(
    folder: Path,
    sources: tuple[Path, ...] = SOURCES,
    flags: tuple[str, ...] = _ARCH_FLAGS,
    stem: str = "bf16_dot",
) -> Path:
    """The compiled ops in `folder`, built now unless they are there. Raises OSError or
    subprocess.CalledProcessError (with g++'s output) when they cannot be built."""
    target = library_path(folder, sources, flags, stem)
    if target.exists():
        return target
    compiler = shutil.which("g++")
    if compiler is None:
        raise OSError("g++ is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    torch_dir = Path(torch.__file__).parent
    lib = torch_dir / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".so.tmp", delete=False) as tmp:
        partial = Path(tmp.name)
    # torch's own libgomp (same soname as the system's): at::parallel_for's OpenMP regions
    # then share torch's thread pool instead of starting a second one.
    cmd = [
        compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", *flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-I", str(torch_dir / "include"),
        "-I", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
        *(str(source) for source in sources), "-o", str(partial),
        "-L", str(lib), "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib}",
        str(lib / "libgomp.so.1"),
    ]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _load() -> Ops | None:
    if not cpu_has_bf16_dot():
        log.info("int4 and int8 kernels: torch's (this CPU has no %s)", CPU_FLAG)
        return None
    try:
        path = library_path(cache_folder())
        if not path.exists():
            log.info("building swarmd's kernels once into %s", path.parent)
            path = build(path.parent)
        torch.ops.load_library(str(path))
        loaded = Ops(torch.ops.swarmd.int4_bf16_mm, torch.ops.swarmd.int8_bf16_mm)
    except subprocess.CalledProcessError as exc:
        log.warning(
            "int4 and int8 kernels: torch's (the build failed: %s)", exc.stderr.strip()[-500:]
        )
        return None
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        log.warning("int4 and int8 kernels: torch's (%s)", exc)
        return None
    log.info("int4 and int8 kernels: swarmd's bf16-dot (%s)", path.name)
    return loaded


def _load_blocks() -> Callable[..., torch.Tensor] | None:
    if not cpu_has_blocks():
        log.info("GGUF block kernels: none (this CPU lacks one of %s)", ", ".join(BLOCKS_CPU_FLAGS))
        return None
    try:
        path = library_path(cache_folder(), BLOCKS_SOURCES, BLOCKS_FLAGS, "blocks")
        if not path.exists():
            log.info("building swarmd's GGUF block kernels once into %s", path.parent)
            path = build_blocks(path.parent)
        torch.ops.load_library(str(path))
        op: Callable[..., torch.Tensor] = torch.ops.swarmd_blocks.q_mm
    except subprocess.CalledProcessError as exc:
        log.warning("GGUF block kernels: none (the build failed: %s)", exc.stderr.strip()[-500:])
        return None
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        log.warning("GGUF block kernels: none (%s)", exc)
        return None
    log.info("GGUF block kernels: swarmd's (%s)", path.name)
    return op


def main() -> int:
    """`python -m swarmd.engine.native`: build the ops now (make install), or say why not."""
    if cpu_has_blocks() and shutil.which("g++") is not None:
        try:
            print(f"swarmd GGUF block kernels: {build_blocks(cache_folder())}")
        except subprocess.CalledProcessError as exc:
            print(exc.stderr, file=sys.stderr)
            return 1
    if not cpu_has_bf16_dot():
        print(f"swarmd kernels: not built (this CPU has no {CPU_FLAG}); torch's serve")
        return 0
    if shutil.which("g++") is None:
        print("swarmd kernels: not built (no g++); torch's serve")
        return 0
    try:
        path = build(cache_folder())
    except subprocess.CalledProcessError as exc:
        print(exc.stderr, file=sys.stderr)
        return 1
    print(f"swarmd kernels: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
