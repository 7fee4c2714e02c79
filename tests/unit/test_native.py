"""swarmd's int4 and int8 kernels (engine/native.py, bf16_dot.cpp) and torch's, as `linear`
holds them: each within a bfloat16 rounding of a float32 reference, each row the same alone
and in any batch, and swarmd's taken exactly where they can run. And swarmd's attention
(attend.cpp): float32 accuracy, and a query's bits whatever runs with it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from swarmd.engine import native
from swarmd.engine.linear import Int4, Int4Dot, Int8, Int8Dot, Matrix, make_matrix
from swarmd.errors import ModelLoadError
from swarmd.model import quant

OPS = native.ops()
# (format, kernel): torch's kernels always, swarmd's where this CPU and machine run them
KERNELS = [(fmt, kernel) for fmt in ("int4", "int8") for kernel in ("torch", "swarmd")]
KERNELS = [fk for fk in KERNELS if OPS is not None or fk[1] == "torch"]
SHAPES = [(16, 32), (960, 576), (576, 1536), (48, 2080)]  # (N, K): 1 group to 65 groups


def weights(fmt: str, n: int, k: int, seed: int = 0) -> quant.Int4 | quant.Int8:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quant.quantize_int4(w) if fmt == "int4" else quant.quantize_int8(w)


def held(kernel: str, q: quant.Int4 | quant.Int8, bias: torch.Tensor | None = None) -> Matrix:
    if kernel == "torch":
        if isinstance(q, quant.Int4):
            return Int4(q, bias, torch.bfloat16)
        return Int8(q, bias, torch.bfloat16)
    assert OPS is not None
    return Int4Dot(q, bias, OPS) if isinstance(q, quant.Int4) else Int8Dot(q, bias, OPS)


def dense(q: quant.Int4 | quant.Int8) -> torch.Tensor:
    """The float32 weights a quantized form stands for: [N, K]."""
    if isinstance(q, quant.Int8):
        return q.values.float() * q.scale.float()[:, None]
    scale, zero = (t.float().repeat_interleave(32, dim=1) for t in (q.scale, q.zero))
    return (q.values.float() - 8) * scale + zero


def test_the_kernels_are_taken_exactly_where_they_can_run() -> None:
    runnable = native.cpu_has_bf16_dot() and shutil.which("g++") is not None
    assert (OPS is not None) == runnable
    for fmt, ours, theirs in (("int4", Int4Dot, Int4), ("int8", Int8Dot, Int8)):
        q = weights(fmt, 32, 64)
        assert type(make_matrix(q, None, torch.bfloat16)) is (ours if runnable else theirs)
        # float32 activations: torch's kernels (swarmd's take bfloat16 only)
        assert type(make_matrix(q, None, torch.float32)) is theirs
    # an int8 shape swarmd's cannot block (N % 16): torch's (int4 needs N % 16 anyway)
    assert type(make_matrix(weights("int8", 40, 64), None, torch.bfloat16)) is Int8


@pytest.mark.parametrize(("fmt", "kernel"), KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_quantized_matmul_is_within_a_rounding_of_float32(
    fmt: str, kernel: str, shape: tuple[int, int]
) -> None:
    """swarmd's kernels keep float32 scales and multiply exact weights: each output is the
    float32 result rounded once to bfloat16. torch's round scales and zeros to bfloat16
    first: within a few of their roundings of the largest output."""
    n, k = shape
    q = weights(fmt, n, k, seed=n + k)
    matrix = held(kernel, q)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = matrix(x).float()
    ref = x.float() @ dense(q).T
    if kernel == "swarmd":
        # one rounding to bfloat16 (8 significant bits) of a sum exact to ~1e-6
        bound = ref.abs() * 2.0**-8 + ref.abs().max() * 1e-5
        assert bool(((got - ref).abs() <= bound).all())
    else:
        assert float((got - ref).abs().max()) <= float(ref.abs().max()) * 2.0**-5


@pytest.mark.parametrize(("fmt", "kernel"), KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_has_its_bits_alone_and_in_any_batch(fmt: str, kernel: str, threads: int) -> None:
    """What batching sessions relies on (engine.linear): row r of an M-row call equals row
    r called alone, for M across the kernels' blocks of 8, 4, 2 and 1 rows, on 1 and 2
    threads."""
    q = weights(fmt, 960, 576)
    matrix = held(kernel, q, bias=torch.randn(960))
    x = torch.randn(21, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = [matrix(x[r : r + 1]) for r in range(len(x))]
        for rows in (2, 3, 5, 8, 13, 21):
            batch = matrix(x[:rows])
            for r in range(rows):
                assert torch.equal(batch[r], alone[r][0]), (rows, r)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("fmt", "kernel"), KERNELS)
def test_a_bias_is_added_and_an_empty_batch_gives_no_rows(fmt: str, kernel: str) -> None:
    q = weights(fmt, 64, 96)
    bias = torch.randn(64)
    x = torch.randn(3, 96).bfloat16()
    plain = held(kernel, q)(x)
    assert torch.equal(held(kernel, q, bias)(x), plain.add_(bias.bfloat16()))
    assert held(kernel, q)(x[:0]).shape == (0, 64)


def test_the_ops_refuse_what_they_cannot_compute() -> None:
    """Shapes the blocking never makes are refused with torch's error, never read past."""
    unloaded = native.Ops(torch.mm, torch.mm)
    with pytest.raises(ModelLoadError, match="N % 16"):
        Int4Dot(weights("int4", 24, 64), None, unloaded)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="N % 16"):
        Int8Dot(weights("int8", 24, 64), None, unloaded)  # type: ignore[arg-type]
    if OPS is None:
        return  # the ops are not loaded on this machine (the first test says why)
    four = Int4Dot(weights("int4", 32, 64), None, OPS)
    eight = Int8Dot(weights("int8", 32, 64), None, OPS)
    for matrix in (four, eight):
        with pytest.raises(RuntimeError, match="bfloat16"):
            matrix(torch.randn(2, 64))  # float32 activations
        with pytest.raises(RuntimeError, match="match"):
            matrix(torch.randn(2, 32).bfloat16())  # K does not match the weights
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="float32"):
        OPS.int4(x, four.packed, four.scale.bfloat16(), four.zero)
    with pytest.raises(RuntimeError, match="float32"):
        OPS.int8(x, eight.packed, eight.scale[:16])


def test_an_embedding_reads_its_rows_from_a_tied_heads_blocked_table() -> None:
    q = weights("int8", 64, 96)
    ids = torch.tensor([[0, 17, 63, 5], [16, 15, 1, 40]])
    assert torch.equal(native.int8_rows(native.block_int8(q.values), ids), q.values[ids])


def test_switched_off_torchs_kernel_serves_and_decode_steps_still_script() -> None:
    """`native_kernels = false`: every quantized matrix on torch's kernels, and the decode
    loop still compiles (it names swarmd's ops, whose schemas are registered without
    kernels)."""
    code = (
        "import torch\n"
        "from swarmd.engine import native, scripted\n"
        "from swarmd.engine.linear import Int4, Int8, make_matrix\n"
        "from swarmd.model import quant\n"
        "native.configure(False)\n"
        "w = torch.randn(32, 64)\n"
        "assert type(make_matrix(quant.quantize_int4(w), None, torch.bfloat16)) is Int4\n"
        "assert type(make_matrix(quant.quantize_int8(w), None, torch.bfloat16)) is Int8\n"
        "assert native.ops() is None and not native.attend_fits(64)\n"
        "assert scripted._script() is not None\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


# --- attention ---------------------------------------------------------------------------

needs_ops = pytest.mark.skipif(OPS is None, reason="swarmd's kernels do not run on this CPU")


def slots(count: int, kv: int, capacity: int, dim: int, seed: int) -> list[torch.Tensor]:
    """KV slots as kv.py holds them: views [layers=2, 2, 1, kv, capacity, D] of a page."""
    page = torch.randn(
        2, 2, count + 1, kv, capacity, dim, generator=torch.Generator().manual_seed(seed)
    )
    return [page[:, :, i + 1 : i + 2] for i in range(count)]  # not the page's first slot


def reference(q: torch.Tensor, cache: torch.Tensor, layer: int, lo: int, hi: int, scale: float):
    """float64 softmax attention of one row q [heads, D] over positions [lo, hi)."""
    keys, values = (cache[layer, i, 0, :, lo:hi].double() for i in (0, 1))  # [kv, n, D]
    heads, dim = q.shape
    grouped = q.double().view(keys.shape[0], heads // keys.shape[0], dim) * scale
    weights = torch.softmax(grouped @ keys.transpose(1, 2), dim=-1)
    return (weights @ values).view(heads, dim)


@needs_ops
@pytest.mark.parametrize(
    ("heads", "kv", "dim"),
    [(9, 3, 64), (4, 1, 256), (32, 1, 32), (14, 2, 32), (8, 8, 128), (4, 2, 16), (6, 2, 48)],
)
def test_attention_is_float32_softmax_attention(heads: int, kv: int, dim: int) -> None:
    caches = slots(5, kv, 320, dim, seed=heads)
    windows = [(0, 1), (0, 17), (3, 300), (64, 320), (250, 251)]  # [lo, hi) a row
    q = torch.randn(len(windows), heads, dim, generator=torch.Generator().manual_seed(1))
    lo, hi = [w[0] for w in windows], [w[1] for w in windows]
    got = native.attend(q, torch.empty(0), caches, 1, list(range(5)), lo, hi, dim**-0.5)
    for r, (a, b) in enumerate(windows):
        ref = reference(q[r], caches[r], 1, a, b, dim**-0.5)
        assert float((got[r].double() - ref).abs().max()) < 1e-5 * float(ref.abs().max() + 1)


@needs_ops
@pytest.mark.parametrize("threads", [1, 2])
def test_a_querys_attention_has_its_bits_in_any_batch_and_any_chunk(threads: int) -> None:
    """What exactness rests on: a row attended alone, with other sessions' rows, or as one
    position of a chunk of its own sequence (the kernel tiles such positions), gets the
    same bits (on 1 and 2 threads)."""
    caches = slots(6, 3, 256, 64, seed=7)
    q = torch.randn(6, 9, 64, generator=torch.Generator().manual_seed(2))
    his = [1, 40, 64, 65, 200, 256]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = native.attend(q, torch.empty(0), caches, 0, list(range(6)), [0] * 6, his, 0.125)
        for r in range(6):
            alone = native.attend(
                q[r : r + 1], torch.empty(0), caches, 0, [r], [0], [his[r]], 0.125
            )
            assert torch.equal(alone[0], batched[r])
        # the six rows as positions of one sequence's chunk (one cache, growing windows)
        chunk = native.attend(q, torch.empty(0), [caches[5]], 0, [0] * 6, [0] * 6, his, 0.125)
        for r in range(6):
            alone = native.attend(
                q[r : r + 1], torch.empty(0), [caches[5]], 0, [0], [0], [his[r]], 0.125
            )
            assert torch.equal(alone[0], chunk[r])
        # a chunk of a sliding-window layer: tiles of rows whose windows start apart
        los = [max(0, hi - 50) for hi in his]
        chunk = native.attend(q, torch.empty(0), [caches[5]], 0, [0] * 6, los, his, 0.125)
        for r in range(6):
            alone = native.attend(
                q[r : r + 1], torch.empty(0), [caches[5]], 0, [0], [los[r]], [his[r]], 0.125
            )
            assert torch.equal(alone[0], chunk[r])
    finally:
        torch.set_num_threads(before)


@needs_ops
def test_a_decode_row_writes_its_key_and_value_before_it_reads() -> None:
    caches = slots(3, 3, 128, 64, seed=3)
    copies = [c.clone() for c in caches]
    q = torch.randn(3, 9, 64)
    fresh = torch.randn(2, 3, 3, 64)
    his = [5, 64, 100]
    got = native.attend(q, fresh, caches, 1, [0, 1, 2], [0, 0, 0], his, 0.125)
    for r, hi in enumerate(his):
        copies[r][1, 0, 0, :, hi - 1] = fresh[0, r]
        copies[r][1, 1, 0, :, hi - 1] = fresh[1, r]
        assert torch.equal(caches[r], copies[r])  # that position, nothing else
        expect = native.attend(q[r : r + 1], torch.empty(0), [copies[r]], 1, [0], [0], [hi], 0.125)
        assert torch.equal(got[r], expect[0])


@needs_ops
def test_attention_refuses_what_it_cannot_compute() -> None:
    caches = slots(2, 3, 64, 64, seed=4)
    q = torch.randn(2, 9, 64)
    none = torch.empty(0)
    cases = [
        ((q.double(), none, caches, 0, [0, 1], [0, 0], [1, 1]), "float32"),
        ((q, none, caches, 0, [0, 1], [1, 0], [1, 1]), "lo < hi"),
        ((q, none, caches, 0, [0, 1], [0, 0], [1, 65]), "capacity"),
        ((q, none, caches, 2, [0, 1], [0, 0], [1, 1]), "layer"),
        ((q, none, caches, 0, [0, 2], [0, 0], [1, 1]), "which"),
        ((q, none, caches, 0, [0], [0], [1]), "one per row"),
        ((q, torch.randn(2, 2, 3, 64), caches, 0, [0, 0], [0, 0], [1, 2]), "of their own"),
        ((torch.randn(2, 9, 40), none, caches, 0, [0, 1], [0, 0], [1, 1]), "head dim"),
        ((torch.randn(2, 8, 64), none, caches, 0, [0, 1], [0, 0], [1, 1]), "multiple"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            native.attend(*args, 0.125)
