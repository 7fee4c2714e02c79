"""A position's attention, and so its whole forward, gives the same bits whatever
`--torch-threads` and however its sequence was cut into chunks: what lets nodes with
other core counts serve one reply exactly, a standby replay it, and a second turn reuse
the first's cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swarmd.engine.arch import arch_spec
from swarmd.engine.attention import BLOCK, chunk_queries, one_query, plan_chunk
from swarmd.engine.load import load_lean_stage
from swarmd.model.layers import LayerRange
from swarmd.model.rows import Row
from swarmd.model.text import TextCodec
from tests.unit.test_engine import FAMILIES, lean, make_tiny, prompt

THREADS = (1, 2, 3)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


SHAPES = [(9, 3, 64), (4, 2, 16), (8, 8, 32), (4, 1, 256), (16, 2, 64)]  # heads, kv, D


def _cache(kv_heads: int, length: int, head_dim: int, seed: int) -> torch.Tensor:
    """[kv, capacity, D]: `length` random positions, then zeros to whole blocks (a
    KVCache's buffer)."""
    generator = torch.Generator().manual_seed(seed)
    capacity = -(-length // BLOCK) * BLOCK
    buffer = torch.zeros(kv_heads, capacity, head_dim)
    buffer[:, :length] = torch.randn(kv_heads, length, head_dim, generator=generator)
    return buffer


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize(("lo", "hi"), [(0, 1), (0, 5), (0, 64), (0, 65), (0, 300), (37, 300)])
def test_one_query_is_sdpas_attention(
    heads: int, kv_heads: int, head_dim: int, lo: int, hi: int
) -> None:
    """The same attention as SDPA with grouped-query heads over positions [lo, hi) (to
    float32 rounding): query head h reads kv head h // (heads / kv_heads)."""
    generator = torch.Generator().manual_seed(hi)
    q = torch.randn(heads, head_dim, generator=generator)
    keys, values = _cache(kv_heads, hi, head_dim, 1), _cache(kv_heads, hi, head_dim, 2)
    scale = head_dim**-0.5
    expected = F.scaled_dot_product_attention(
        q[None, :, None],
        keys[None, :, lo:hi],
        values[None, :, lo:hi],
        scale=scale,
        enable_gqa=heads != kv_heads,
    )[0, :, 0]
    torch.testing.assert_close(one_query(q, keys, values, lo, hi, scale), expected)


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize(("start", "count", "window"), [
    (0, 1, None), (0, 7, None), (0, 300, None), (63, 2, None), (100, 129, None),
    (1000, 200, None), (0, 300, 100), (450, 90, 128), (3, 61, 6),
])  # fmt: skip
def test_a_chunk_gives_each_position_the_bits_of_its_one_token_step(
    heads: int, kv_heads: int, head_dim: int, start: int, count: int, window: int | None
) -> None:
    """What makes a position's bits independent of how its sequence was cut into chunks
    (prompt, steps, replays, reused prefixes): `chunk_queries` over any chunk equals
    `one_query` at each of its positions, with or without a sliding window, with 1, 2 and
    3 torch threads, bit for bit."""
    end = start + count
    generator = torch.Generator().manual_seed(end)
    q = torch.randn(count, heads, head_dim, generator=generator)
    keys, values = _cache(kv_heads, end, head_dim, 1), _cache(kv_heads, end, head_dim, 2)

    def seen(position: int) -> tuple[int, int]:
        return (0 if window is None else max(0, position + 1 - window)), position + 1

    windows = [seen(start + t) for t in range(count)]
    runs = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        chunk = chunk_queries(q, keys, values, plan_chunk(windows, heads // kv_heads), 0.125)
        steps = [one_query(q[t], keys, values, *windows[t], 0.125) for t in range(count)]
        assert torch.equal(chunk, torch.stack(steps))
        runs.append(chunk)
    assert all(torch.equal(runs[0], run) for run in runs[1:])


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("weights", ["int4", "int8", "bf16"])
def test_a_reply_gives_the_same_bits_on_any_thread_count(
    family: str, weights: str, tmp_path: Path
) -> None:
    """Prompts as chunks (one past the sliding window), then decode steps of one row and of
    two at once, scripted and eager: logits and caches equal bit for bit with 1, 2 and 3
    torch threads."""
    path, _ = make_tiny(family, tmp_path)
    stage = lean(path, weights=weights)
    streams = [prompt(n, seed=60 + n)[0] for n in (150, 90)]
    runs = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        caches = [stage.new_cache(200) for _ in streams]
        outs = [stage(ids[None, :-20], cache) for ids, cache in zip(streams, caches, strict=True)]
        for step in range(20):
            stage.scripted_decode = step < 10
            picked = [0, 1] if step % 3 else [0]
            rows = [Row(_next(streams[r], caches[r].length), caches[r]) for r in picked]
            outs += stage.forward_many(rows)
        runs.append((outs, [c.buffer[..., : c.length, :].clone() for c in caches]))
    (first, first_kv), *others = runs
    for outs, kv in others:
        assert all(torch.equal(a, b) for a, b in zip(first, outs, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(first_kv, kv, strict=True))


def _next(ids: torch.Tensor, position: int) -> torch.Tensor:
    return ids[position : position + 1][None, :]


@pytest.mark.usefixtures("restore_threads")
def test_the_embedded_models_greedy_replies_give_the_same_bits_on_any_thread_count(
    smollm_dir: Path,
) -> None:
    """The embedded model, eight chat prompts decoded greedily side by side for 32 steps:
    every step's logits equal bit for bit with 1, 2 and 3 torch threads. (Before decode
    attention left SDPA, one and two threads parted within a few steps on real text.)"""
    codec = TextCodec.load(smollm_dir)
    config = json.loads((smollm_dir / "config.json").read_text())
    files = sorted(smollm_dir.glob("*.safetensors"))
    stage = load_lean_stage(files, arch_spec(config), LayerRange(0, 30), "auto", torch.bfloat16)
    texts = json.loads((Path(__file__).parents[1] / "data" / "prompts.json").read_text())[:8]
    prompts = [codec.render_prompt([{"role": "user", "content": t}], None) for t in texts]
    runs = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        caches = [stage.new_cache(len(ids) + 32) for ids in prompts]
        pairs = zip(prompts, caches, strict=True)
        steps = [stage(torch.tensor([ids]), cache) for ids, cache in pairs]
        for _ in range(32):
            # Each row's greedy token from its last logits (every thread count alike
            # until one parts, which the comparison then shows).
            rows = [
                Row(logits.argmax(-1).view(1, 1), cache)
                for logits, cache in zip(steps[-len(caches) :], caches, strict=True)
            ]
            steps += stage.forward_many(rows)
        runs.append(steps)
    first, *others = runs
    for steps in others:
        assert all(torch.equal(a, b) for a, b in zip(first, steps, strict=True))
