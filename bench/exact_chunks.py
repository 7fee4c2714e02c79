"""What exact chunks cost: the engine's chunk attention beside SDPA's, in one run.

Since 0.5 the engine attends a prompt chunk with the arithmetic of one-token steps
(`swarmd/engine/attention.py`: keys in whole blocks of 64, at least 4 rows a matmul), so
a position has the same bits however its sequence was cut. This prints, for the embedded
model's attention shape (9 heads over 3 KV heads of 64), the time of `chunk_queries` and
of `scaled_dot_product_attention` (what prompt chunks ran before) for the chunks of a
prompt of `--prompt` tokens cut in `--chunk`-token pieces, per layer and over 30 layers;
then the whole engine (the embedded model, int4) on that prompt: its prefill and the
decode steps after it. Medians of `--repeat` runs, `--threads` torch threads. Ends with

    RESULT attn_over_sdpa=<r> prefill_ms=<ms> decode_ms=<ms>

Usage: .venv/bin/python bench/exact_chunks.py [--prompt 623] [--chunk 256]
       [--threads 2] [--repeat 20] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import platformdirs
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from swarmd.engine.arch import arch_spec  # noqa: E402
from swarmd.engine.attention import chunk_queries, plan_chunk  # noqa: E402
from swarmd.engine.load import load_lean_stage  # noqa: E402
from swarmd.model.layers import LayerRange  # noqa: E402
from swarmd.model.rows import Row  # noqa: E402
from swarmd.model.source import EMBEDDED_MODEL_ID, resolve_folder  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def attention(args: argparse.Namespace) -> float:
    """Per-layer times of the prompt's chunks; returns new over SDPA over all of them."""
    capacity = -(-args.prompt // 64) * 64
    keys = torch.randn(KV_HEADS, capacity, HEAD_DIM)
    values = torch.randn(KV_HEADS, capacity, HEAD_DIM)
    total_new = total_sdpa = 0.0
    print(f"attention of one layer, chunks of {args.chunk} (ms): chunk_queries / SDPA")
    for start in range(0, args.prompt, args.chunk):
        count = min(args.chunk, args.prompt - start)
        end = start + count
        q = torch.randn(count, HEADS, HEAD_DIM)
        plan = plan_chunk([(0, start + t + 1) for t in range(count)], HEADS // KV_HEADS)
        mask = None
        if start:
            mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        new = median_ms(partial(chunk_queries, q, keys, values, plan, 0.125), args.repeat)
        sdpa_call = partial(
            F.scaled_dot_product_attention,
            q.transpose(0, 1)[None],
            keys[None, :, :end],
            values[None, :, :end],
            attn_mask=mask,
            is_causal=mask is None,
            scale=0.125,
            enable_gqa=True,
        )
        sdpa = median_ms(sdpa_call, args.repeat)
        print(f"  positions {start:5d}-{end - 1:5d}: {new:7.2f} / {sdpa:7.2f}")
        total_new, total_sdpa = total_new + new, total_sdpa + sdpa
    whole = f"{total_new * LAYERS:.0f} / {total_sdpa * LAYERS:.0f}"
    print(f"  the prompt over {LAYERS} layers: {whole}")
    return total_new / total_sdpa


def engine(args: argparse.Namespace) -> tuple[float, float]:
    """The embedded model's prefill of the prompt, and a decode step after it (ms)."""
    model = resolve_folder(EMBEDDED_MODEL_ID, Path(args.cache_dir)).model_dir
    config = json.loads((model / "config.json").read_text())
    files = sorted(model.glob("*.safetensors"))
    stage = load_lean_stage(files, arch_spec(config), LayerRange(0, 30), "auto", torch.bfloat16)
    ids = torch.randint(0, 40000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    steps = 32

    def prefill() -> object:
        cache = stage.new_cache(args.prompt + steps)
        for start in range(0, args.prompt, args.chunk):
            stage(ids[:, start : start + args.chunk], cache)
        return cache

    def decode() -> None:
        cache = prefill()
        token = torch.tensor([[5]])
        begin = time.perf_counter()
        for _ in range(steps):
            stage.forward_many([Row(token, cache)])
        times.append((time.perf_counter() - begin) * 1000 / steps)

    prefill_ms = median_ms(prefill, max(3, args.repeat // 4))
    times: list[float] = []
    for _ in range(max(3, args.repeat // 4)):
        decode()
    decode_ms = statistics.median(times)
    print(
        f"engine, {args.prompt}-token prompt: prefill {prefill_ms:.0f} ms, "
        f"decode {decode_ms:.2f} ms a token"
    )
    return prefill_ms, decode_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=623)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--cache-dir", default=platformdirs.user_cache_dir("swarmd"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ratio = attention(args)
    prefill_ms, decode_ms = engine(args)
    print(
        f"RESULT attn_over_sdpa={ratio:.2f} prefill_ms={prefill_ms:.0f} decode_ms={decode_ms:.2f}"
    )


if __name__ == "__main__":
    main()
