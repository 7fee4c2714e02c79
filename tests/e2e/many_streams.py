"""Many streams at once against one node: what the concurrency tests share."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tests.conftest import NodeProcess
from tests.e2e.test_pipeline import Stream, chat_body, complete

TOPICS = ["the sea", "a lighthouse", "bread", "owls", "rain", "maps", "trains", "snow"]


def eight_bodies(stream: bool) -> list[dict]:
    """Eight greedy requests with other prompts and other lengths."""
    return [
        chat_body(f"Tell me about {TOPICS[i]} in {2 + i % 3} sentences.", 6 + 7 * i, stream)
        for i in range(8)
    ]


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str | None = None
    errors: list[dict] = field(default_factory=list)
    done: bool = False
    failure: str = ""


def stream_all(
    node: NodeProcess, bodies: list[dict], cancel: int | None = None, cancel_after: int = 3
) -> list[Outcome]:
    """Stream every body at once; the one at index `cancel` is cut after a few tokens."""
    outcomes = [Outcome() for _ in bodies]
    start = threading.Barrier(len(bodies))

    def one(i: int) -> None:
        start.wait(timeout=60)
        try:
            stream = Stream(node, bodies[i])
            for _ in stream.events():
                if i == cancel and stream.content_events >= cancel_after:
                    break
            outcomes[i] = Outcome(stream.text, stream.finish_reason, stream.errors, stream.done)
        except Exception as exc:  # reported by the test, with the others' outcomes
            outcomes[i].failure = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return outcomes


def references(node: NodeProcess, bodies: list[dict]) -> list[str]:
    """Each reply alone, one after the other (non-streamed, same sampling)."""
    texts = []
    for body in bodies:
        reply, _ = complete(node, {**body, "stream": False})
        texts.append(reply["choices"][0]["message"]["content"])
    return texts
