"""`n` choices against as many separate requests: what prefilling the prompt once saves.

    python bench/choices.py [--n 4] [--prompt-words 400] [--tokens 16] [--runs 3]

Starts a node in this process on the embedded model (whole model, no peers) and asks one
long prompt, sampled with a seed, two ways: one request with `n` choices (choice 0
prefills, the others copy its KV cache and logits), and `n` requests with `n: 1` sent at
once (each prefills; the prefills share batched forwards). Measures each way's wall time
from the first byte sent to the last reply, and the time to the first token of the
slowest choice (`swarm.timing.ttft_ms`, the node's own measure). Ends with

    RESULT n=<n> prompt_tokens=<p> one_request_s=<s> separate_s=<s> speedup=<x>
           one_request_ttft_ms=<ms> separate_ttft_ms=<ms>
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from swarmd.config import Config
from swarmd.node import Node

STORY = "the keeper climbed the stairs of the old lighthouse to light the lamp at dusk"
WORDS = STORY.split(" ")


async def ask(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body) as response:
        reply: dict[str, Any] = await response.json()
        assert response.status == 200, reply
    return reply


def slowest_ttft(replies: list[dict[str, Any]]) -> float:
    ttfts = []
    for reply in replies:
        summaries = reply["swarm"].get("choices") or [reply["swarm"]]
        ttfts += [s["timing"]["ttft_ms"] for s in summaries]
    return max(ttfts)


async def main(args: argparse.Namespace) -> None:
    text = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_words))
    messages = [{"role": "user", "content": f"Summarise this: {text}"}]
    with tempfile.TemporaryDirectory() as tmp:
        node = await asyncio.to_thread(Node.prepare, Config(port=0, data_dir=Path(tmp)))
        await node.start()
        try:
            url = node.api_url + "/v1/chat/completions"
            base = {
                "model": node.model.model_id,
                "messages": messages,
                "temperature": 0.8,
                "seed": 7,
                "max_tokens": args.tokens,
            }
            one_s, sep_s, one_ttft, sep_ttft = [], [], [], []
            async with aiohttp.ClientSession() as http:
                prompt_tokens = (await ask(http, url, {**base, "max_tokens": 2}))["usage"][
                    "prompt_tokens"
                ]  # also the warm-up
                for run in range(args.runs):
                    body = {**base, "seed": 100 + run}
                    started = time.perf_counter()
                    reply = await ask(http, url, {**body, "n": args.n})
                    one_s.append(time.perf_counter() - started)
                    one_ttft.append(slowest_ttft([reply]))
                    started = time.perf_counter()
                    replies = await asyncio.gather(
                        *(ask(http, url, {**body, "seed": body["seed"] + i}) for i in range(args.n))
                    )
                    sep_s.append(time.perf_counter() - started)
                    sep_ttft.append(slowest_ttft(list(replies)))
        finally:
            await node.stop()
    one, sep = statistics.median(one_s), statistics.median(sep_s)
    one_ms, sep_ms = statistics.median(one_ttft), statistics.median(sep_ttft)
    print(f"n={args.n}, a {prompt_tokens}-token prompt, {args.tokens} tokens a choice, embedded")
    print(f"one request with n: {one:.2f} s (slowest first token {one_ms:.0f} ms)")
    print(f"{args.n} requests at once: {sep:.2f} s (slowest first token {sep_ms:.0f} ms)")
    print(
        f"RESULT n={args.n} prompt_tokens={prompt_tokens} one_request_s={one:.2f} "
        f"separate_s={sep:.2f} speedup={sep / one:.2f} "
        f"one_request_ttft_ms={one_ms:.0f} separate_ttft_ms={sep_ms:.0f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
