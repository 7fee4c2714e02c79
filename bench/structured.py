"""Constrained decoding's cost: a json_schema reply against an unconstrained one.

    python bench/structured.py [--tokens 96] [--runs 3]

Starts a node in this process on the embedded model (whole model, no peers) and asks the
same prompt for the same number of tokens, alternately unconstrained and under a JSON
schema whose one string must run past `--tokens` (so both replies are `length`-cut at the
same count). Decode speed is the node's own measure (`swarm.timing.decode_ms` over the
completion tokens after the first), so prefill and HTTP are left out. Then, in process:
the compile time of a few schemas (each new, so uncached) and the mask + accept time per
token of a constrained reply. Ends with

    RESULT plain_tps=<t/s> json_tps=<t/s> ratio=<json/plain> compile_ms=<median>
           mask_us=<mean>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch

from swarmd.config import Config
from swarmd.model.grammar import Constraint, GrammarSpec, compile_grammar
from swarmd.node import Node

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def long_story_schema(tokens: int) -> dict[str, Any]:
    # At least ~4 characters a token: the string cannot close before max_tokens cuts it.
    return {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": tokens * 8}},
        "required": ["story"],
    }


async def decode_tps(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    async with http.post(url, json=body) as response:
        reply = await response.json()
        assert response.status == 200, reply
    done = reply["usage"]["completion_tokens"]
    assert done == body["max_tokens"], f"the reply stopped at {done} tokens"
    return (done - 1) / (reply["swarm"]["timing"]["decode_ms"] / 1000.0)


def compile_and_mask(node: Node, tokens: int) -> tuple[float, float]:
    """Median compile ms of fresh schemas; mean mask + accept µs per token."""
    model = node.model
    vocab = model.grammar_vocabulary
    compile_ms = []
    for i in range(8):
        schema = {
            "type": "object",
            "properties": {
                f"field_{i}": {"type": "integer", "minimum": 0, "maximum": 1000 + i},
                "tags": {"type": "array", "items": {"enum": ["a", "b", f"c{i}"]}, "maxItems": 5},
                "name": {"type": "string", "maxLength": 20 + i},
            },
            "required": [f"field_{i}", "name"],
        }
        started = time.perf_counter()
        compile_grammar(GrammarSpec("json_schema", json.dumps(schema)), vocab)
        compile_ms.append((time.perf_counter() - started) * 1000)
    compiled = compile_grammar(
        GrammarSpec("json_schema", json.dumps(long_story_schema(tokens))), vocab
    )
    constraint = Constraint(compiled)
    generator = torch.Generator().manual_seed(0)
    spent = []
    for _ in range(tokens):
        logits = torch.randn(vocab.logits_width, generator=generator)
        started = time.perf_counter()
        masked = constraint.mask(logits)
        token = int(torch.argmax(masked))
        constraint.accept(token)
        spent.append(time.perf_counter() - started)
    return statistics.median(compile_ms), statistics.mean(spent) * 1e6


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        node = await asyncio.to_thread(Node.prepare, Config(port=0, data_dir=Path(tmp)))
        await node.start()
        try:
            url = node.api_url + "/v1/chat/completions"
            base = {"model": node.model.model_id, "messages": PROMPT, "temperature": 0}
            plain = {**base, "max_tokens": args.tokens}
            schema = long_story_schema(args.tokens)
            constrained = {
                **plain,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "story", "schema": schema},
                },
            }
            async with aiohttp.ClientSession() as http:
                await decode_tps(http, url, {**plain, "max_tokens": 8})  # warm-up
                await decode_tps(http, url, {**constrained, "max_tokens": 8})
                plain_tps, json_tps = [], []
                for _ in range(args.runs):
                    plain_tps.append(await decode_tps(http, url, plain))
                    json_tps.append(await decode_tps(http, url, constrained))
            compile_ms, mask_us = await asyncio.to_thread(compile_and_mask, node, args.tokens)
        finally:
            await node.stop()
    p, j = statistics.median(plain_tps), statistics.median(json_tps)
    print(f"{args.tokens} tokens, {args.runs} runs each, greedy, embedded model")
    print(f"decode tokens/s: unconstrained {p:.1f}, json_schema {j:.1f} ({j / p:.2f}x)")
    print(f"schema compile (uncached) median {compile_ms:.2f} ms; mask + accept {mask_us:.0f} µs")
    print(
        f"RESULT plain_tps={p:.1f} json_tps={j:.1f} ratio={j / p:.2f} "
        f"compile_ms={compile_ms:.2f} mask_us={mask_us:.0f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
