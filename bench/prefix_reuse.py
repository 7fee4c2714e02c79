"""How often a second turn that reuses its conversation's cache equals a fresh node's.

    python bench/prefix_reuse.py [--chats 12] [--tokens 40] [--cache-dir DIR]

Two nodes (processes) on the embedded model: one keeps finished conversations'
caches (the default `prefix_cache_tokens`), one keeps none. Each chat's first turn
(an English description, half greedy, half seeded) runs on the first node; its second
turn (the first reply, then "say it again in French") runs on both, the first reusing
the cache (`cached_tokens`), the other prefilling all of it. The reused positions of the
reply were computed one token at a time, the fresh ones as a chunk, and their last bits
differ, so a reply can part at a near-tie. Prints each chat and ends with

    RESULT same=<chats whose second turns are equal> chats=<n> cached_tokens=<median>
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import platformdirs
from concurrency import Node

JSON = {"Content-Type": "application/json"}

TOPICS = [
    "the sea", "a mountain", "a city at night", "autumn leaves", "a lost cat", "the moon",
    "a storm", "bread", "trains", "owls", "a library", "rain", "a bridge", "snow",
]  # fmt: skip


def ask(node: Node, body: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), JSON)
    response = conn.getresponse()
    reply: dict[str, Any] = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {reply}")
    return reply


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        threads = ["--torch-threads", "1"]  # the two nodes share the cores
        nodes = [Node(args, workdir, "keeps", threads)]
        os.environ["SWARMD_PREFIX_CACHE_TOKENS"] = "0"  # this node keeps no conversation
        try:
            nodes.append(Node(args, workdir, "fresh", threads))
        finally:
            del os.environ["SWARMD_PREFIX_CACHE_TOKENS"]
        try:
            same, cached = 0, []
            for i in range(args.chats):
                base: dict[str, Any] = {
                    "model": nodes[0].model,
                    "max_tokens": args.tokens,
                    "temperature": 0,
                }
                if i % 2:
                    base.update(temperature=0.8, seed=100 + i)
                topic = TOPICS[i % len(TOPICS)]
                turn1 = [{"role": "user", "content": f"Describe {topic} in two sentences."}]
                first = ask(nodes[0], {**base, "messages": turn1})
                turn2 = [
                    *turn1,
                    {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Now say it again in French."},
                ]
                reused = ask(nodes[0], {**base, "messages": turn2})
                anew = ask(nodes[1], {**base, "messages": turn2})
                details = reused["usage"].get("prompt_tokens_details") or {}
                cached.append(int(details.get("cached_tokens") or 0))
                equal = reused["choices"][0]["message"] == anew["choices"][0]["message"]
                same += equal
                how = "greedy" if i % 2 == 0 else "seeded"
                verdict = "same" if equal else "DIFFERENT"
                print(f"chat {i:2d} {how}: cached {cached[-1]:3d}, {verdict}", flush=True)
        finally:
            for node in nodes:
                node.stop()
    median = int(statistics.median(cached)) if cached else 0
    print(f"RESULT same={same} chats={args.chats} cached_tokens={median}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--cache-dir", default=platformdirs.user_cache_dir("swarmd"))
    main(parser.parse_args())
