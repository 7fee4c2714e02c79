"""The engine's forward equals transformers' for each family, prefill and decode, whole and
split, in float32; quantized formats stay close to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from swarmd.engine import native
from swarmd.engine.arch import arch_spec
from swarmd.engine.linear import make_matrix
from swarmd.engine.load import load_lean_stage
from swarmd.engine.stage import LeanStage
from swarmd.errors import ModelLoadError
from swarmd.model.layers import LayerRange
from swarmd.model.rows import Row
from tests.conftest import TINY

FAMILIES = {
    "llama": (transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "llama-untied-bias": (transformers.LlamaConfig, {"attention_bias": True, "mlp_bias": True}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 6}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "gemma3": (
        transformers.Gemma3TextConfig,
        {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 16},
    ),
}
# Gemma's last layer is global, the others slide; the window of 6 is shorter than the
# prompts, so the sliding masks are exercised.


def make_tiny(family: str, out: Path) -> tuple[Path, torch.nn.Module]:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**TINY, **extra)
    if family == "gemma3":
        config.layer_types = ["sliding_attention"] * 3 + ["full_attention"]
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: perturb them all
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(str(out))
    return out, model


def lean(path: Path, layers: LayerRange | None = None, weights: str = "fp32") -> LeanStage:
    """`weights` "int4-torch": int4 (and the int8 head) on torch's kernels even where
    swarmd's own loaded."""
    config = json.loads((path / "config.json").read_text())
    spec = arch_spec(config)
    span = layers or LayerRange(0, spec.num_layers)
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    files = sorted(path.glob("*.safetensors"))
    if weights == "int4-torch":
        with mock.patch.object(native, "ops", return_value=None):
            return load_lean_stage(files, spec, span, "int4", dtype)
    return load_lean_stage(files, spec, span, weights, dtype)


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + length)
    return torch.randint(0, TINY["vocab_size"], (1, length), generator=generator)  # [1, T]


def reference_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[T, V]: the logits of every position, from one transformers forward."""
    with torch.inference_mode():
        return model(ids).logits[0]


ATOL = 2e-5  # float32: another order of the same sums, never another token


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_equal_transformers(family: str, tmp_path: Path) -> None:
    path, model = make_tiny(family, tmp_path)
    stage = lean(path)
    ids = prompt(14)
    expected = reference_logits(model, ids)  # [T, V]
    cache = stage.new_cache(32)
    got = stage(ids[:, :9], cache)  # prefill of 9, then one token at a time
    torch.testing.assert_close(got[0], expected[8], rtol=0, atol=ATOL)
    for t in range(9, 14):
        got = stage(ids[:, t : t + 1], cache)
        torch.testing.assert_close(got[0], expected[t], rtol=0, atol=ATOL)
    assert cache.length == 14


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_chunked_prefill_equals_one_piece(family: str, tmp_path: Path) -> None:
    path, model = make_tiny(family, tmp_path)
    stage = lean(path)
    ids = prompt(17, seed=3)
    expected = reference_logits(model, ids)
    cache = stage.new_cache(17)
    for start in range(0, 17, 5):  # 5, 5, 5, 2: chunks that start past the window
        got = stage(ids[:, start : start + 5], cache)
    torch.testing.assert_close(got[0], expected[-1], rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("split", [1, 3])
def test_split_stages_chain_to_the_same_logits(family: str, split: int, tmp_path: Path) -> None:
    path, model = make_tiny(family, tmp_path)
    first = lean(path, LayerRange(0, split))
    last = lean(path, LayerRange(split, 4))
    assert first.is_first and not first.is_last and last.is_last and not last.is_first
    ids = prompt(10, seed=1)
    expected = reference_logits(model, ids)
    c1, c2 = first.new_cache(12), last.new_cache(12)
    hidden = first(ids, c1)  # [1, T, H] float32
    assert hidden.shape == (1, 10, TINY["hidden_size"]) and hidden.dtype == torch.float32
    torch.testing.assert_close(last(hidden, c2)[0], expected[-1], rtol=0, atol=ATOL)
    step = prompt(1, seed=9)
    full = reference_logits(model, torch.cat([ids, step], dim=1))
    torch.testing.assert_close(last(first(step, c1), c2)[0], full[-1], rtol=0, atol=ATOL)


def test_views_share_weights_and_equal_stages_loaded_for_the_range(tmp_path: Path) -> None:
    path, _ = make_tiny("llama", tmp_path)
    whole = lean(path)
    view = whole.view(LayerRange(1, 3))
    loaded = lean(path, LayerRange(1, 3))
    assert view.blocks[0] is whole.blocks[1] and not view.is_first and not view.is_last
    hidden = torch.randn(1, 6, TINY["hidden_size"])
    torch.testing.assert_close(
        view(hidden, view.new_cache(6)), loaded(hidden, loaded.new_cache(6)), rtol=0, atol=0
    )
    with pytest.raises(ModelLoadError, match="not inside"):
        view.view(LayerRange(0, 2))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("weights", ["int4", "int4-torch", "int8", "bf16"])
def test_quantized_formats_stay_close_to_float32(family: str, weights: str, tmp_path: Path) -> None:
    path, _ = make_tiny(family, tmp_path)
    exact = lean(path)
    quantized = lean(path, weights=weights)
    fmt = weights.removesuffix("-torch")
    assert quantized.weight_formats == {fmt}
    ids = prompt(12, seed=5)
    a = exact(ids, exact.new_cache(12))[0]
    b = quantized(ids, quantized.new_cache(12))[0]
    # Random tiny weights are no model: only check the logits keep their shape.
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0)
    assert cosine > {"int4": 0.95, "int8": 0.995, "bf16": 0.999}[fmt]


def test_a_session_that_would_pass_its_length_is_refused(tmp_path: Path) -> None:
    path, _ = make_tiny("llama", tmp_path)
    stage = lean(path)
    cache = stage.new_cache(5)
    stage(prompt(4), cache)
    with pytest.raises(Exception, match="exceed"):
        stage(prompt(2), cache)


def test_an_architecture_the_engine_does_not_run_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        arch_spec({"model_type": "gpt2", "num_hidden_layers": 2})
    with pytest.raises(ModelLoadError, match="yarn"):
        arch_spec(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            }
        )


# Ways to feed the same 150 tokens: chunk sizes in order.
CUTS = {
    "one chunk": [150],
    "a prompt, then one-token steps": [5] + [1] * 145,
    "uneven chunks across the 64-position blocks": [3, 61, 1, 1, 64, 7, 13],
    "steps, then a chunk": [1] * 70 + [80],
}


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
@pytest.mark.parametrize("weights", ["int4", "int4-torch", "int8", "bf16", "fp32"])
def test_any_cut_of_a_sequence_leaves_the_same_bits(
    family: str, weights: str, tmp_path: Path
) -> None:
    """What a failover's replay and a reused prefix rely on: a sequence fed as one chunk,
    as a prompt and one-token steps, or in uneven chunks leaves the same cache and the same
    last logits. The int4, int8 and bfloat16 matrices give a row the same bits in any
    batch; torch's float32 GEMM does not (it blocks by row count): there, equal to float32
    rounding. Sliding windows of 6 (mistral, gemma3) are crossed many times."""
    path, _ = make_tiny(family, tmp_path)
    stage = lean(path, weights=weights)
    ids = prompt(150, seed=11)
    runs = []
    for sizes in CUTS.values():
        cache, at = stage.new_cache(150), 0
        for size in sizes:
            logits = stage(ids[:, at : at + size], cache)
            at += size
        runs.append((logits, cache.buffer[..., :150, :].clone()))  # the slot goes with it
    (expected, reference), *others = runs
    for got, cached in others:
        if weights == "fp32":
            torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
            torch.testing.assert_close(cached, reference, rtol=0, atol=ATOL)
        else:
            assert torch.equal(got, expected)
            assert torch.equal(cached, reference)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("weights", ["int4", "int4-torch", "int8", "bf16", "fp32"])
def test_rows_batched_together_equal_each_row_alone(
    family: str, weights: str, tmp_path: Path
) -> None:
    """Continuous batching: three sequences with their own caches; one joins late with its
    prompt while the others decode; a decode-only forward, a mixed one, and chunks. Each
    row's outputs and cache equal the same row's run alone: bit for bit for int4, int8 and
    bfloat16 (their matrices give a row the same bits in any batch), to float32 rounding
    for float32 (its GEMM blocks by row count)."""
    path, _ = make_tiny(family, tmp_path)
    stage = lean(path, weights=weights)
    streams = [prompt(n, seed=20 + n)[0] for n in (19, 23, 17)]  # past the window of 6
    # Per forward: (row, how many of its tokens) for the rows in it.
    plan = [
        [(0, 9), (1, 4)],  # two prompt chunks
        [(0, 1), (1, 5)],  # a decode step beside a chunk
        [(0, 1), (1, 1)],  # decode only
        [(0, 1), (1, 1), (2, 11)],  # the third joins with its prompt
        [(0, 1), (1, 1), (2, 1)],
        [(2, 1), (0, 1), (1, 1)],  # another order
        [(1, 1), (2, 1)],
    ]
    solo = [stage.new_cache(32) for _ in streams]
    together = [stage.new_cache(32) for _ in streams]
    done = [0, 0, 0]
    for forward in plan:
        chunks = []
        for row, count in forward:
            chunks.append((row, streams[row][done[row] : done[row] + count][None, :]))
            done[row] += count
        batched = stage.forward_many([Row(ids, together[row]) for row, ids in chunks])
        for (row, ids), got in zip(chunks, batched, strict=True):
            expected = stage(ids, solo[row])
            if weights == "fp32":
                torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
            else:
                assert torch.equal(got, expected), (row, ids.shape)
    for a, b in zip(solo, together, strict=True):
        assert a.length == b.length
        if weights == "fp32":
            torch.testing.assert_close(a._buffer[..., : a.length, :], b._buffer[..., : b.length, :])
        else:
            assert torch.equal(a._buffer[..., : a.length, :], b._buffer[..., : b.length, :])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("weights", ["int4", "int4-torch", "int8", "bf16", "fp32"])
def test_scripted_decode_steps_equal_the_eager_ones_bit_for_bit(
    family: str, weights: str, tmp_path: Path
) -> None:
    """Decode forwards (every row one token) run their layers as TorchScript; the eager
    loop is the reference. One row and three at once, at different positions and past the
    sliding window, on the whole model and on a middle stage fed hidden states: outputs
    and caches equal bit for bit, float32 included (the same kernels on the same inputs)."""
    path, _ = make_tiny(family, tmp_path)
    stage = lean(path, weights=weights)
    middle = stage.view(LayerRange(1, 3))
    streams = [prompt(n, seed=40 + n)[0] for n in (12, 9, 15)]
    generator = torch.Generator().manual_seed(7)
    width = TINY["hidden_size"]
    prompts = [torch.randn(1, len(ids), width, generator=generator) for ids in streams]
    hidden = torch.randn(3, 16, 1, 1, width, generator=generator)
    for part in (stage, middle):
        runs = []
        for scripted in (True, False):
            part.scripted_decode = scripted
            caches = [part.new_cache(40) for _ in streams]
            outs = []
            for row, ids in enumerate(streams):  # the prompts, as chunks (never scripted)
                chunk = ids[None, :] if part.is_first else prompts[row]
                outs.append(part(chunk, caches[row]))
            for step in range(8):
                rows = [0, 1, 2] if step % 2 else [step % 3]
                feed = [
                    streams[r][step : step + 1][None, :] if part.is_first else hidden[r, step]
                    for r in rows
                ]
                batch = [Row(x, caches[r]) for r, x in zip(rows, feed, strict=True)]
                outs += part.forward_many(batch)
            runs.append((outs, [c.buffer[..., : c.length, :].clone() for c in caches]))
        (got, got_kv), (expected, expected_kv) = runs
        assert part._decode_loop is not None  # the scripted loop did run
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got_kv, expected_kv, strict=True))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_step_over_shared_kv_pages_gives_each_row_its_bits_alone(
    family: str, tmp_path: Path
) -> None:
    """Sessions of one capacity class share a KV page, and a scripted decode step attends
    each page's rows as one matmul over the slots from the lowest to the highest of them
    that read the same span (engine/kv.py, scripted.py). Rows in two classes (64 and 640
    positions), two spans in one page, a freed slot between two rows, sessions of the
    page that sit the step out, and rows that see a sliding window (gemma3: row by row
    there): each row's logits and cache equal the same row on a stage of its own, stepped
    eagerly (one query at a time)."""
    path, _ = make_tiny(family, tmp_path)
    stage = lean(path, weights="int4")
    lengths = [12, 530, 30, 7, 620, 40, 20]  # spans of 64, 576 and 640 keys
    streams = [prompt(n + 6, seed=60 + i)[0] for i, n in enumerate(lengths)]
    caches = [stage.new_cache(n + 6) for n in lengths]
    for ids, cache, n in zip(streams, caches, lengths, strict=True):
        stage(ids[None, :n], cache)
    assert len({id(c.page) for c in caches}) == 2 and caches[3].slot > caches[0].slot + 1
    del caches[2]  # a free slot between rows 0 and 3 of the small page
    rows = [0, 1, 2, 3, 4, 5]  # of what is left: lengths 12, 530, 7, 620, 40, 20
    kept = [lengths[i] for i in (0, 1, 3, 4, 5, 6)]
    alone = []
    for r in rows:
        own = lean(path, weights="int4")
        own.scripted_decode = False  # row by row, the reference
        cache = own.new_cache(kept[r] + 6)
        ids = streams[(0, 1, 3, 4, 5, 6)[r]]
        own(ids[None, : kept[r]], cache)
        alone.append((own, cache, ids))
    for step in range(4):
        stepping = [r for r in rows if (r + step) % 3]  # some sit each step out
        feed = [alone[r][2][kept[r] : kept[r] + 1][None, :] for r in stepping]
        got = stage.forward_many([Row(x, caches[r]) for r, x in zip(stepping, feed, strict=True)])
        for r, x, out in zip(stepping, feed, got, strict=True):
            own, cache, _ = alone[r]
            assert torch.equal(out, own(x, cache)), (step, r)
        for r in stepping:
            kept[r] += 1
    assert stage._decode_loop is not None  # the scripted loop did run
    for r in rows:
        cache = alone[r][1]
        assert torch.equal(
            caches[r].buffer[..., : cache.length, :], cache.buffer[..., : cache.length, :]
        )


@pytest.mark.parametrize("shape", [(32, 64), (64, 64), (960, 960), (576, 1536), (960, 1280)])
def test_a_bf16_matrix_gives_a_row_the_same_bits_in_any_batch(shape: tuple[int, int]) -> None:
    """What batched rows' exactness rests on with bf16 weights: a row's bits do not depend
    on the other rows, a row alone included. On AVX-512 CPUs oneDNN rounds a lone row
    otherwise once K passes 1024, and ATen's own gemm takes the smallest products: there
    `Dense` runs a lone row as two. On AVX2 CPUs every M rounds alike as it is."""
    n, k = shape
    torch.manual_seed(0)
    matrix = make_matrix((torch.randn(n, k) * 0.05).bfloat16(), None, torch.bfloat16)
    x = torch.randn(48, k).bfloat16()  # [M, K]
    batch = matrix(x)
    for m in (1, 2, 3, 7):
        for i in range(0, 48 - m + 1, m):
            assert torch.equal(matrix(x[i : i + m]), batch[i : i + m]), (m, i)


def test_a_next_turn_reuses_the_cache_of_the_conversation_it_continues(tmp_path: Path) -> None:
    """The runtime keeps a finished session's cache; a prompt that starts with its tokens
    gets that many positions for free, and the rest runs as in a fresh session."""
    from swarmd.model.runtime import MIN_PREFIX_TOKENS, StageRuntime
    from swarmd.model.sampling import SamplingParams

    path, _ = make_tiny("llama", tmp_path)
    stage = lean(path)
    runtime = StageRuntime(stage, max_sessions=4, prefix_tokens=400)
    greedy = SamplingParams(temperature=0.0)
    turn1 = prompt(24, seed=3)[0].tolist()
    assert runtime.open("t1", 128, greedy, prompt=turn1) == 0
    token = runtime.step("t1", torch.tensor([turn1]), True).token
    reply = [token]
    for _ in range(5):
        reply.append(runtime.step("t1", torch.tensor([[reply[-1]]]), True).token)
    runtime.close("t1")  # its cache holds turn1 + reply[:-1]
    assert runtime.prefix_held_tokens >= len(turn1) + 5
    turn2 = turn1 + reply + prompt(7, seed=4)[0].tolist()
    reused = runtime.open("t2", 128, greedy, prompt=turn2)
    assert reused == len(turn1) + len(reply) - 1
    got = runtime.step("t2", torch.tensor([turn2[reused:]]), True).token
    fresh = StageRuntime(stage, max_sessions=1)
    fresh.open("f", 128, greedy, prompt=turn2)
    assert fresh.step("f", torch.tensor([turn2]), True).token == got
    assert runtime.prefix_hits == 1 and runtime.prefix_held_tokens == 0  # taken, not shared
    # A prompt that shares a long start (a system prompt) but not t2's whole prompt is
    # another conversation: it gets a copy of that start, and t2's cache stays kept.
    runtime.close("t2")
    other = prompt(30, seed=9)[0].tolist()
    shared = len(turn2) - 3
    assert shared >= MIN_PREFIX_TOKENS
    t3 = turn2[:shared] + other
    assert runtime.open("t3", 128, greedy, prompt=t3) == shared
    assert runtime.prefix_hits == 2 and runtime.prefix_held_tokens >= len(turn2)  # copied
    got = runtime.step("t3", torch.tensor([t3[shared:]]), True).token
    fresh.close("f")
    fresh.open("f3", 128, greedy, prompt=t3)
    assert fresh.step("f3", torch.tensor([t3]), True).token == got
    # The least recently finished conversation goes first once the cap is passed.
    # Each holds 64: its capacity, the smallest class of positions (engine/kv.py).
    small = StageRuntime(stage, max_sessions=4, prefix_tokens=100)
    for i in range(3):
        ids = prompt(20, seed=30 + i)[0].tolist()
        small.open(f"c{i}", 32, greedy, prompt=ids)
        small.step(f"c{i}", torch.tensor([ids]), True)
        small.close(f"c{i}")
    assert small.prefix_held_tokens == 64 and list(small._prefixes) == ["c2"]
    # A conversation larger than the whole cap is not kept, and pushes nothing out.
    big = prompt(90, seed=40)[0].tolist()
    small.open("big", 128, greedy, prompt=big)
    small.step("big", torch.tensor([big]), True)
    small.close("big")
    assert list(small._prefixes) == ["c2"]


def test_a_shared_start_is_copied_from_finished_and_running_conversations(
    tmp_path: Path,
) -> None:
    """The same prompt again, or another with the same long start (a system prompt),
    copies that start from a kept conversation or from a session still running, and
    prefills only the rest: every reply equals a fresh runtime's, several at once; a
    start under MIN_PREFIX_TOKENS is not worth a copy, and neither is a stage's cache
    kept by key (it holds no ids to match)."""
    from swarmd.model.runtime import MIN_PREFIX_TOKENS, StageRuntime, StepRequest
    from swarmd.model.sampling import SamplingParams

    path, _ = make_tiny("llama", tmp_path)
    stage = lean(path)
    greedy = SamplingParams(temperature=0.0)
    system = prompt(24, seed=5)[0].tolist()
    asks = [system + prompt(3 + i, seed=40 + i)[0].tolist() for i in range(4)]

    def reply(runtime: StageRuntime, sid: str, ids: list[int], reused: int) -> list[int]:
        out = [runtime.step(sid, torch.tensor([ids[reused:]]), True).token]
        for _ in range(4):
            out.append(runtime.step(sid, torch.tensor([[out[-1]]]), True).token)
        return out

    fresh = StageRuntime(stage, max_sessions=1)
    expected = []
    for i, ids in enumerate(asks):
        assert fresh.open(f"f{i}", 64, greedy, prompt=ids) == 0
        expected.append(reply(fresh, f"f{i}", ids, 0))
        fresh.close(f"f{i}")
    runtime = StageRuntime(stage, max_sessions=4, prefix_tokens=400)
    assert runtime.open("first", 64, greedy, prompt=asks[0]) == 0
    assert reply(runtime, "first", asks[0], 0) == expected[0]
    # Still running: the others copy the system prompt from it, and run beside it.
    opened = {}
    for i in (1, 2):
        opened[i] = runtime.open(f"s{i}", 64, greedy, prompt=asks[i])
        assert opened[i] == len(system)
    outs = {1: [], 2: []}
    steps = {i: torch.tensor([asks[i][opened[i] :]]) for i in (1, 2)}
    for _ in range(5):
        results = runtime.step_many([StepRequest(f"s{i}", steps[i], True) for i in (1, 2)])
        for i, result in zip((1, 2), results, strict=True):
            assert not isinstance(result, BaseException)
            outs[i].append(result.token)
            steps[i] = torch.tensor([[result.token]])
    assert [outs[1], outs[2]] == expected[1:3]
    for sid in ("first", "s1", "s2"):
        runtime.close(sid)
    # Finished: the same prompt again copies all of it but its last token.
    assert runtime.open("again", 64, greedy, prompt=asks[3]) == len(system)
    runtime.close("again")
    assert runtime.open("repeat", 64, greedy, prompt=asks[0]) == len(asks[0]) - 1
    assert reply(runtime, "repeat", asks[0], len(asks[0]) - 1) == expected[0]
    hits = runtime.prefix_hits
    short = system[: MIN_PREFIX_TOKENS - 1] + prompt(20, seed=60)[0].tolist()
    assert runtime.open("short", 64, greedy, prompt=short) == 0
    assert runtime.prefix_hits == hits


def test_a_routes_stages_keep_a_session_by_key_and_resume_it_cut_short(tmp_path: Path) -> None:
    """Prefix reuse on a route: each stage keeps its part of a finished session under the
    key its open named, and a next turn's open takes it cut to n positions; both stages
    then compute what a fresh two-stage session does. A stage asked for a cache it no
    longer holds (another key, other layers, too short) takes nothing and says 0."""
    from swarmd.model.runtime import StageRuntime, StepRequest
    from swarmd.model.sampling import SamplingParams

    path, _ = make_tiny("llama", tmp_path)
    greedy = SamplingParams(temperature=0.0)
    front, back = LayerRange(0, 2), LayerRange(2, 4)

    def two_stages() -> tuple[StageRuntime, StageRuntime]:
        return (
            StageRuntime(lean(path, front), max_sessions=4, prefix_tokens=400),
            StageRuntime(lean(path, back), max_sessions=4, prefix_tokens=400),
        )

    def run(stages: tuple[StageRuntime, StageRuntime], sid: str, ids: list[int]) -> int | None:
        hidden = stages[0].step(sid, torch.tensor([ids]), False).hidden
        return stages[1].step(sid, hidden, True).token

    kept = two_stages()
    turn1 = prompt(20, seed=11)[0].tolist()
    for i, stage in enumerate(kept):
        stage.open("a.1", 96, greedy if i else None, keep_as="coord/a.1")
    reply = [run(kept, "a.1", turn1)]
    for _ in range(4):
        reply.append(run(kept, "a.1", [reply[-1]]))
    for stage in kept:
        stage.close("a.1")
    fed = turn1 + reply[:-1]  # what the caches hold
    assert all(stage.prefix_held_tokens >= len(fed) for stage in kept)
    # Nothing resumes without the key: not another key, nor a prompt that matches.
    assert kept[0].open("x", 96, None, prompt=[*fed, 3]) == 0
    assert kept[0].open("y", 96, None, resume=("coord/other.1", 10)) == 0
    turn2 = [*fed, int(reply[-1]), *prompt(6, seed=12)[0].tolist()]
    fresh = two_stages()
    # Another request that shares turn 1's start copies it on each stage (`copy`), twice
    # at once, and the conversation stays kept for its own next turn.
    shared = turn1[:18] + prompt(5, seed=13)[0].tolist()
    for i, stage in enumerate(kept):
        for sid in ("s.1", "s.2"):
            opened = stage.open(sid, 96, greedy if i else None, resume=("coord/a.1", 18), copy=True)
            assert opened == 18
        assert stage.prefix_hits == 2 and stage.prefix_held_tokens >= len(fed)
    hidden = kept[0].step_many(
        [StepRequest(sid, torch.tensor([shared[18:]]), False) for sid in ("s.1", "s.2")]
    )
    copies = kept[1].step_many(
        [StepRequest(sid, h.hidden, True) for sid, h in zip(("s.1", "s.2"), hidden, strict=True)]
    )
    for i, stage in enumerate(fresh):
        stage.open("g.1", 96, greedy if i else None)
    assert [c.token for c in copies] == [run(fresh, "g.1", shared)] * 2
    for stage in (*kept, *fresh):
        stage.close("s.1")
        stage.close("s.2")
        stage.close("g.1")
    n = len(fed) - 2  # a resume may take fewer positions than were kept
    for i, stage in enumerate(kept):
        assert stage.open("b.1", 96, greedy if i else None, resume=("coord/a.1", n)) == n
    got = run(kept, "b.1", turn2[n:])
    for i, stage in enumerate(fresh):
        stage.open("f.1", 96, greedy if i else None)
    assert run(fresh, "f.1", turn2) == got
    assert all(stage.prefix_hits == 3 and "coord/a.1" not in stage._prefixes for stage in kept)

    # Taken once: a second resume of the same key finds nothing; nor does one of more
    # positions than were kept, nor one over other layers.
    def keeping(sid: str) -> tuple[StageRuntime, StageRuntime]:
        """Two fresh stages with session `sid` open to be kept, turn 1 prefilled."""
        stages = two_stages()
        for stage in stages:
            stage.open(sid, 96, None, keep_as=f"coord/{sid}")
        hidden = stages[0].step(sid, torch.tensor([turn1]), False).hidden
        stages[1].step(sid, hidden, False)
        return stages

    again = keeping("c.1")
    for stage in again:
        stage.close("c.1")
    assert again[0].open("d.1", 96, None, resume=("coord/c.1", len(turn1) + 1)) == 0
    assert again[0].open("e.1", 96, None, resume=("coord/c.1", 5), layers=LayerRange(0, 1)) == 0
    assert again[0].open("g.1", 96, None, resume=("coord/c.1", 5)) == 5
    assert again[0].open("h.1", 96, None, resume=("coord/c.1", 5)) == 0
    # The next turn's open may come before the last turn's close (they travel on two
    # streams): the session keeping the cache is ended then, and its close comes to nothing.
    for stage in keeping("p.1"):
        assert stage.open("q.1", 96, None, resume=("coord/p.1", 7)) == 7
        assert stage.session_count == 1
        stage.close("p.1")
        assert stage.session_count == 1 and stage.prefix_held_tokens == 0


def test_two_conversations_continue_at_once_each_from_its_own_cache(tmp_path: Path) -> None:
    """Prefix reuse with several sessions: two finished conversations, both next turns
    opened together and prefilled in one batched forward, each reusing its own cache."""
    from swarmd.model.runtime import StageRuntime, StepRequest
    from swarmd.model.sampling import SamplingParams

    path, _ = make_tiny("llama", tmp_path)
    stage = lean(path)
    runtime = StageRuntime(stage, max_sessions=4, prefix_tokens=400)
    greedy = SamplingParams(temperature=0.0)
    turns = []
    for i in range(2):
        ids = prompt(20 + i, seed=40 + i)[0].tolist()
        runtime.open(f"a{i}", 96, greedy, prompt=ids)
        first = runtime.step(f"a{i}", torch.tensor([ids]), True).token
        second = runtime.step(f"a{i}", torch.tensor([[first]]), True).token
        runtime.close(f"a{i}")
        turns.append([*ids, first, second, *prompt(5, seed=50 + i)[0].tolist()])
    reused = [runtime.open(f"b{i}", 96, greedy, prompt=t) for i, t in enumerate(turns)]
    assert reused == [21, 22]  # each its own prompt and first reply token
    outcomes = runtime.step_many(
        [
            StepRequest(f"b{i}", torch.tensor([t[n:]]), True)
            for i, (t, n) in enumerate(zip(turns, reused, strict=True))
        ]
    )
    for i, turn in enumerate(turns):
        fresh = StageRuntime(stage, max_sessions=1)
        fresh.open("f", 96, greedy)
        assert fresh.step("f", torch.tensor([turn]), True).token == outcomes[i].token
    assert runtime.prefix_hits == 2


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_a_choice_copies_its_siblings_prefilled_prompt(engine: str, tmp_path: Path) -> None:
    """`n` choices: a session opened with `share` gets a copy of the open sibling's cache
    and its logits at the prompt's end; its first step is answered from them, so its
    seeded reply is exactly a fresh prefill's, and the sibling is not disturbed."""
    from swarmd.errors import InternalError
    from swarmd.model.runtime import StageRuntime
    from swarmd.model.sampling import SamplingParams
    from swarmd.model.stage import load_stage

    path, _ = make_tiny("llama", tmp_path)
    config = transformers.AutoConfig.from_pretrained(path)
    if engine == "lean":
        stage: Any = lean(path)
    else:
        stage = load_stage(path, config, LayerRange(0, config.num_hidden_layers), torch.float32)
    runtime = StageRuntime(stage, max_sessions=5)
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=1.0, seed=99)
    ids = prompt(20, seed=61)[0].tolist()

    def reply(rt: StageRuntime, sid: str, first: list[int], steps: int) -> list[int]:
        tokens = [rt.step(sid, torch.tensor([first]), True).token]
        for _ in range(steps):
            tokens.append(rt.step(sid, torch.tensor([[tokens[-1]]]), True).token)
        return tokens

    assert runtime.open("c0", 64, greedy, prompt=ids, share="missing") == 0
    assert runtime.open("early", 64, greedy, prompt=ids, share="c0") == 0  # not prefilled
    c0 = reply(runtime, "c0", ids, 3)  # the sibling decodes on past its prompt
    other = [*ids[:-1], 5]  # another prompt: no copy
    assert runtime.open("other", 64, greedy, prompt=other, share="c0") == 0
    assert runtime.open("c1", 64, sampled, prompt=ids, share="c0") == len(ids) - 1
    c1 = reply(runtime, "c1", ids[-1:], 5)
    assert runtime.open("c2", 64, greedy, prompt=ids, share="c0") == len(ids) - 1
    with pytest.raises(InternalError):  # a fork's first step is its prompt's last token
        runtime.step("c2", torch.tensor([[ids[0]]]), True)
    c0 += reply(runtime, "c0", [c0[-1]], 1)[1:]
    fresh = StageRuntime(stage, max_sessions=2)
    fresh.open("g", 64, greedy)
    fresh.open("s", 64, sampled)
    assert c0 == reply(fresh, "g", ids, 4)  # the copies took nothing from the sibling
    assert c1 == reply(fresh, "s", ids, 5)  # the seeded fork is a fresh prefill's reply
    assert runtime.prefix_hits == 2 and runtime.prefix_reused_tokens == 2 * (len(ids) - 1)


def test_a_stage_says_whose_kernels_its_quantized_matrices_run(tmp_path: Path) -> None:
    """What /health's `kernels` and the diagnostics report show."""
    path, _ = make_tiny("llama", tmp_path)
    ours = "swarmd" if native.ops() is not None else "torch"
    assert lean(path, weights="int4").quantized_kernels == ours
    assert lean(path, weights="int8").quantized_kernels == ours
    assert lean(path, weights="int4-torch").quantized_kernels == "torch"
    assert lean(path, weights="bf16").quantized_kernels == "none"
    # attention (attend.cpp) follows the same switch, for every format
    assert lean(path, weights="bf16").native_attention == (ours == "swarmd")
    assert lean(path).native_attention == (ours == "swarmd")
    assert not lean(path, weights="int4-torch").native_attention
