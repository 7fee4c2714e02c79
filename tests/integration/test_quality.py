"""Quantized formats against the float32 path over the same GGUF, on the embedded model:
perplexity of a fixed English text, and greedy replies to fixed prompts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarmd.model.loader import LoadedModel, load_model
from swarmd.model.source import ModelSource
from swarmd.model.text import ChatMessage, TextCodec

DATA = Path(__file__).parent.parent / "data"
CHUNK = 256
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def text_ids(smollm_fp32_dir: Path) -> list[int]:
    ids = TextCodec.load(smollm_fp32_dir).encode((DATA / "english.txt").read_text())
    assert 1500 < len(ids) < 2500
    return ids


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return list(json.loads((DATA / "prompts.json").read_text()))


@pytest.fixture(scope="module")
def reference(smollm_fp32_dir: Path) -> Any:
    """transformers in float32 on the GGUF dequantized (the node's fp32 path)."""
    return AutoModelForCausalLM.from_pretrained(str(smollm_fp32_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_greedy(reference: Any, prompts: list[str], smollm_fp32_dir: Path) -> list[list[int]]:
    codec = TextCodec.load(smollm_fp32_dir)
    replies = []
    for prompt in prompts:
        ids = codec.chat_prompt([ChatMessage("user", prompt)])
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=2
            )
        replies.append(out[0, len(ids) :].tolist())
    return replies


def perplexity_reference(model: Any, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(float(nll))


def perplexity(model: LoadedModel, ids: list[int]) -> float:
    stage = model.stage
    cache = stage.new_cache(len(ids))
    total = 0.0
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        logits = stage(torch.tensor([chunk]), cache, all_positions=True)[0]  # type: ignore[call-arg]
        targets = ids[start + 1 : start + 1 + len(chunk)]
        total += float(
            torch.nn.functional.cross_entropy(
                logits[: len(targets)], torch.tensor(targets), reduction="sum"
            )
        )
    return math.exp(total / (len(ids) - 1))


def greedy(model: LoadedModel, prompt: str, count: int) -> list[int]:
    ids = model.codec.chat_prompt([ChatMessage("user", prompt)])
    cache = model.stage.new_cache(len(ids) + count)
    out = [int(model.stage(torch.tensor([ids]), cache).argmax())]
    while len(out) < count and out[-1] not in model.codec.eos_ids:
        out.append(int(model.stage(torch.tensor([[out[-1]]]), cache).argmax()))
    return out


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_quantized_formats_keep_the_float32_quality(
    weights: str,
    smollm_dir: Path,
    text_ids: list[int],
    reference: Any,
    prompts: list[str],
    reference_greedy: list[list[int]],
) -> None:
    # The embedded GGUF as a node holds it (int4 from its Q4_1 blocks, bit for bit); int8
    # requantizes those same weights once.
    model = load_model(ModelSource("smollm", smollm_dir), None, weights)
    assert model.backend == "engine" and model.weights == weights
    assert model.dtype_name == "bfloat16"
    base = perplexity_reference(reference, text_ids)
    ppl = perplexity(model, text_ids)
    agree = sum(
        greedy(model, prompt, GREEDY_TOKENS) == ref[:GREEDY_TOKENS]
        for prompt, ref in zip(prompts, reference_greedy, strict=True)
    )
    print(
        f"\n{weights}-bfloat16: perplexity {ppl:.3f} vs float32 {base:.3f} "
        f"({100 * (ppl / base - 1):+.2f}%); greedy replies equal on the first "
        f"{GREEDY_TOKENS} tokens for {agree} of {len(prompts)} prompts"
    )
    assert ppl <= base * 1.03
    assert agree > len(prompts) // 2
