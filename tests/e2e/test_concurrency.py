"""Many users at once: concurrent streams through a two-stage swarm and on one node, each
reply what it would have been alone; admission by KV tokens (FIFO waits, 413 past the
route's budget)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from swarmd.model.prefix import MIN_PREFIX_TOKENS
from tests.conftest import NodeProcess, http_json, running_node, wait_until
from tests.e2e.many_streams import eight_bodies, references, stream_all
from tests.e2e.test_pipeline import Swarm, chat_body, complete

pytestmark = pytest.mark.e2e

BUDGET = 3000  # KV tokens per node: the eight streams fit at once, a 3,500-token ask does not


@pytest.fixture(scope="module")
def two_stages(test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    args = ["--cache-dir", str(test_cache_dir), "--kv-budget-tokens", str(BUDGET)]
    swarm = Swarm(tmp_path_factory.mktemp("two"), args)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SWARMD_TORCH_THREADS", "1")  # nodes share two cores
        try:
            swarm.start([("a", "0:15", None), ("b", "15:30", None)])
            for name in ("a", "b"):
                swarm.wait_holders(name, 2)
            yield swarm
        finally:
            swarm.stop()


def test_eight_streams_through_two_stages_each_equal_their_reply_alone(
    two_stages: Swarm, embedded_node: NodeProcess
) -> None:
    bodies = eight_bodies(stream=True)
    expected = references(embedded_node, bodies)
    nodes = [two_stages["a"], two_stages["b"]]
    outcomes = stream_all(nodes[0], bodies, cancel=3)
    ended = time.monotonic()
    for i, (got, want) in enumerate(zip(outcomes, expected, strict=True)):
        assert got.failure == "" and got.errors == [], (i, got)
        if i == 3:  # cut by its client: what it got is the start of its reply
            assert want.startswith(got.text) and got.text
            continue
        assert got.done and got.finish_reason in ("stop", "length"), (i, got)
        assert got.text == want, i
    assert wait_until(lambda: all(int(n.health()["sessions"]) == 0 for n in nodes), 2.0)
    assert time.monotonic() - ended < 2.5
    assert all(int(n.health()["kv_reserved_tokens"]) == 0 for n in nodes)
    for node in nodes:
        log = node.log_text()
        assert "peer banned" not in log and "stage failed" not in log
    forwards = _metric(nodes[1], "swarmd_forward_rows_total") / _metric(
        nodes[1], "swarmd_forwards_total"
    )
    assert forwards > 1.0  # the last stage ran several sessions' steps per forward


def test_stages_on_one_thread_each_reply_as_a_node_on_two_threads(
    two_stages: Swarm, test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Nodes with other core counts serve one reply exactly: the stages run one torch
    thread each, the reference node two. Six 64-token greedy replies, sent through the
    stages at once, equal the reference's one by one in their text and in every token's
    logprob (which shows a logit's last bit)."""
    texts = json.loads((Path(__file__).parents[1] / "data" / "prompts.json").read_text())
    bodies = [{**chat_body(text, 64), "logprobs": True} for text in texts[8:14]]
    args = ["--cache-dir", str(test_cache_dir), "--torch-threads", "2"]
    with running_node(tmp_path_factory, "two-threads", args) as reference:
        expected = [_text_and_logprobs(complete(reference, body)[0]) for body in bodies]
    got: list[tuple[str, list[float]] | None] = [None] * len(bodies)

    def one(i: int) -> None:
        got[i] = _text_and_logprobs(complete(two_stages["a"], bodies[i])[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert got == expected


def test_more_streams_than_a_stage_has_room_for_wait_their_turn_and_all_finish(
    two_stages: Swarm, embedded_node: NodeProcess
) -> None:
    """Sixty streams through two stages whose second gives one peer's sessions room for
    about 25 of them (half of its 3,000 KV tokens): each stream that finds it full waits
    for room instead of failing (on the old code 80 of 100 such streams got 503, "layers
    [15:30) are not served"), and every reply is its single-node reply."""
    bodies = [chat_body(f"Name a colour and an animal, number {i}.", 12, True) for i in range(60)]
    expected = references(embedded_node, bodies)
    nodes = [two_stages["a"], two_stages["b"]]
    outcomes = stream_all(nodes[0], bodies)
    failed = [(i, o) for i, o in enumerate(outcomes) if o.failure or o.errors or not o.done]
    assert failed == []
    assert [o.text for o in outcomes] == expected
    log = nodes[0].log_text()
    assert "stage declined" in log  # the second stage was full: some streams waited
    assert "peer banned" not in log and "stage failed" not in log
    assert wait_until(lambda: all(int(n.health()["sessions"]) == 0 for n in nodes), 5.0)
    assert all(int(n.health()["kv_reserved_tokens"]) == 0 for n in nodes)


def test_a_stage_killed_under_load_fails_over_while_its_standby_is_full(
    tmp_path: Path, test_cache_dir: Path, embedded_node: NodeProcess, swarm_env: None
) -> None:
    """Forty streams through 0:15 and 15:30 with a standby of 15:30, each stage room for
    about 20 of them: the busy 15:30 is killed mid-run. Its sessions fail over to the
    standby, which has no room for all of them at once: those wait for room (no 503), and
    every reply is its single-node reply."""
    bodies = [
        chat_body(f"Write two sentences about river number {i}.", 40, True) for i in range(40)
    ]
    args = ["--cache-dir", str(test_cache_dir), "--kv-budget-tokens", str(BUDGET)]
    _kill_a_holder_of_15_30_under_load(
        Swarm(tmp_path, args), bodies, references(embedded_node, bodies), lambda n: n[1] >= 10
    )


def test_streams_turned_away_by_a_full_stage_wait_for_it_when_the_other_holder_dies(
    tmp_path: Path,
    test_cache_dir: Path,
    embedded_node: NodeProcess,
    swarm_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sixteen streams through 0:15 and two holders of 15:30 that take four of a peer's
    sessions each: the streams one holder turns away ("busy") go to the other, which is
    killed mid-run. Those streams must wait for the full holder, not end: on the old code
    the holder that had said "busy" stayed out of their failover, and 3 to 11 of the 16
    got 503 "layers [15:30) are not served" (found by a stress run)."""
    monkeypatch.setenv("SWARMD_MAX_PEER_SESSIONS", "4")
    bodies = [chat_body(f"Write two sentences about lake number {i}.", 40, True) for i in range(16)]
    swarm = Swarm(tmp_path, ["--cache-dir", str(test_cache_dir)])

    def overflowing(counts: list[int]) -> bool:  # one holder full, the other taking more
        return counts[1] >= 4 and counts[0] >= 1

    log = _kill_a_holder_of_15_30_under_load(
        swarm, bodies, references(embedded_node, bodies), overflowing, kill_busier=False
    )
    assert "are not served" not in log


def _kill_a_holder_of_15_30_under_load(
    swarm: Swarm,
    bodies: list[dict[str, Any]],
    expected: list[str],
    when: Callable[[list[int]], bool],
    kill_busier: bool = True,
) -> str:
    """Stream `bodies` through 0:15 and two holders of 15:30; once the holders' session
    counts (sorted) satisfy `when`, kill the one with more (or fewer) sessions. Every
    stream must end with its single-node reply; the coordinator's log is returned."""
    try:
        swarm.start([("a", "0:15", None), ("b", "15:30", None), ("b2", "15:30", None)])
        swarm.wait_holders("a", 3)
        killed: list[str] = []

        def sessions(name: str) -> int:
            return int(swarm[name].health()["sessions"])

        def kill() -> None:
            if wait_until(lambda: when(sorted(map(sessions, ("b", "b2")))), 120.0, 0.02):
                pick = max if kill_busier else min
                killed.append(pick(("b", "b2"), key=sessions))
                swarm[killed[0]].proc.kill()

        killer = threading.Thread(target=kill)
        killer.start()
        outcomes = stream_all(swarm["a"], bodies)
        killer.join(timeout=130)
        assert killed, "the holders of 15:30 never held the sessions to kill one"
        failed = [(i, o) for i, o in enumerate(outcomes) if o.failure or o.errors or not o.done]
        assert failed == []
        assert [o.text for o in outcomes] == expected
        log = swarm["a"].log_text()
        assert "stage failed" in log  # the killed stage's sessions failed over
        assert "stage declined" in log  # and the survivor had no room for all at once
        survivor = "b2" if killed[0] == "b" else "b"
        assert wait_until(lambda: sessions(survivor) == 0, 5.0)
        assert int(swarm["a"].health()["queued"]) == 0
        return log
    finally:
        swarm.stop()


def _text_and_logprobs(reply: dict[str, Any]) -> tuple[str, list[float]]:
    choice = reply["choices"][0]
    return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]


def test_a_request_over_the_routes_kv_budget_gets_413_and_the_swarm_keeps_serving(
    two_stages: Swarm,
) -> None:
    node = two_stages["a"]
    body = chat_body("Write a very long story.", 3500)
    status, reply, _ = http_json(f"{node.url}/v1/chat/completions", body)
    assert status == 413, reply
    error = reply["error"]
    assert error["code"] == "context_length_exceeded"
    # A stage gives one other peer's sessions at most peer_kv_share (0.5) of its budget.
    assert "3,5" in error["message"] and f"{BUDGET // 2:,}" in error["message"]
    status, events = _stream_raw(node, {**body, "stream": True})
    assert status == 413
    assert events[-1] == "[DONE]" and events[0]["error"]["code"] == "context_length_exceeded"
    status, reply, _ = http_json(f"{node.url}/v1/chat/completions", chat_body("Hi.", 4))
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")


def test_requests_without_max_tokens_through_two_stages_run_within_the_routes_budget(
    two_stages: Swarm,
) -> None:
    """No max_tokens (as most clients send): the reply may run to what the route holds
    for one session (1,500 of the 8,192-token context here), not a 413 for the whole
    context; two such requests at once each reserve nearly all of it, so the second
    waits for the first's room, and both complete."""
    node = two_stages["a"]
    bodies = [chat_body("Count from one to five.", 1), chat_body("Name three colours.", 1)]
    for body in bodies:
        del body["max_tokens"]
    replies: list[tuple[int, dict[str, Any]] | None] = [None, None]

    def one(i: int) -> None:
        status, reply, _ = http_json(f"{node.url}/v1/chat/completions", bodies[i])
        replies[i] = (status, reply)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for got in replies:
        assert got is not None
        status, reply = got
        assert status == 200, reply
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
        usage = reply["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= BUDGET // 2
    completion = {**chat_body("Say hi.", 1), "stream": True}
    del completion["max_tokens"]
    status, events = _stream_raw(node, completion)
    assert status == 200 and events[-1] == "[DONE]"
    assert all("error" not in e for e in events[:-1])


@pytest.fixture(scope="module")
def small_budget_node(
    test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    args = ["--cache-dir", str(test_cache_dir), "--kv-budget-tokens", "1500"]
    with running_node(tmp_path_factory, "small-budget", args) as node:
        yield node


def test_a_hundred_streams_on_one_node_all_finish(small_budget_node: NodeProcess) -> None:
    """More than the budget holds at once (100 x ~45 tokens over 1,500): the rest wait
    their turn in FIFO order, and every one completes."""
    node = small_budget_node
    bodies = [chat_body(f"Say hello to person {i}.", 8, True) for i in range(100)]
    outcomes = stream_all(node, bodies)
    failed = [(i, o) for i, o in enumerate(outcomes) if o.failure or o.errors or not o.done]
    assert failed == []
    assert all(o.finish_reason in ("stop", "length") and o.text for o in outcomes)
    assert wait_until(lambda: int(node.health()["kv_reserved_tokens"]) == 0, 2.0)
    assert "OverloadedError" not in node.log_text()
    status, reply, _ = http_json(f"{node.url}/v1/chat/completions", chat_body("Hi.", 2000))
    assert status == 413 and "1,500" in reply["error"]["message"]
    # No max_tokens: the reply may run to the end of the budget, not of the context.
    unbounded = chat_body("Count from one to five.", 1)
    del unbounded["max_tokens"]
    status, reply, _ = http_json(f"{node.url}/v1/chat/completions", unbounded)
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")


def _metric(node: NodeProcess, name: str) -> float:
    conn = http.client.HTTPConnection(*_host_port(node), timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _host_port(node: NodeProcess) -> tuple[str, int]:
    url = urlsplit(node.url)
    return str(url.hostname), int(url.port or 80)


def _stream_raw(node: NodeProcess, body: dict[str, Any]) -> tuple[int, list[Any]]:
    conn = http.client.HTTPConnection(*_host_port(node), timeout=60)
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        events: list[Any] = []
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line.removeprefix("data:").strip()
                events.append(data if data == "[DONE]" else json.loads(data))
        return response.status, events
    finally:
        conn.close()


def test_a_second_turn_reuses_the_first_turns_cache(
    embedded_node: NodeProcess, small_budget_node: NodeProcess
) -> None:
    """Turn 2 starts with turn 1's prompt and reply: those positions come from the cache
    (cached_tokens), its first token comes at least twice as fast, and its text is what a
    node that never saw turn 1 answers."""
    from tests.e2e.test_pipeline import LONG_PROMPT

    # Its own first words: other tests send LONG_PROMPT to this node too, and a start
    # shared with them would be copied (only the system prompt is, this way).
    first = {**chat_body("Conversation seven. " + LONG_PROMPT, 12), "stream": False}
    status, turn1, _ = http_json(f"{embedded_node.url}/v1/chat/completions", first)
    assert status == 200
    assert turn1["usage"]["prompt_tokens_details"]["cached_tokens"] < 40
    messages = [
        *first["messages"],
        {"role": "assistant", "content": turn1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Now say it in five words."},
    ]
    second = {**first, "messages": messages}
    status, turn2, _ = http_json(f"{embedded_node.url}/v1/chat/completions", second)
    assert status == 200
    cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert turn1["usage"]["prompt_tokens"] <= cached < turn2["usage"]["prompt_tokens"]
    assert turn2["swarm"]["timing"]["ttft_ms"] <= turn1["swarm"]["timing"]["ttft_ms"] / 2
    status, fresh, _ = http_json(f"{small_budget_node.url}/v1/chat/completions", second)
    assert status == 200  # it never saw turn 1: at most a system prompt comes from its cache
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] < 40
    assert turn2["choices"][0]["message"] == fresh["choices"][0]["message"]
    assert f"cached_tokens={cached}" in embedded_node.log_text()


def test_second_turns_reused_at_once_equal_a_fresh_nodes_greedy_and_seeded(
    embedded_node: NodeProcess, small_budget_node: NodeProcess
) -> None:
    """Eight conversations, half greedy, half seeded: their second turns run at once on the
    node that holds their first turns, each reusing its cache, and every reply is the one
    a node that never saw turn 1 gives. The reused reply positions were decoded one token
    at a time, the fresh node prefills them as a chunk: before attention gave a position
    the same bits in any chunk, about half of such replies parted (bench/prefix_reuse.py)."""
    from concurrent.futures import ThreadPoolExecutor

    topics = ["a harbour at dawn", "a beekeeper", "an old clock", "a desert road",
              "a violin", "a garden in winter", "a lighthouse", "a market"]  # fmt: skip

    def body(i: int, messages: list[dict[str, str]]) -> dict[str, Any]:
        sampled = {"temperature": 0.9, "seed": 7 + i} if i % 2 else {"temperature": 0}
        return {"model": "smollm2-135m-instruct", "max_tokens": 48, "messages": messages,
                **sampled}  # fmt: skip

    def ask(node: NodeProcess, payload: dict[str, Any]) -> dict[str, Any]:
        status, reply, _ = http_json(f"{node.url}/v1/chat/completions", payload, timeout_s=300)
        assert status == 200, reply
        return reply

    firsts = [[{"role": "user", "content": f"Describe {t} in two sentences."}] for t in topics]
    with ThreadPoolExecutor(len(topics)) as pool:
        turn1 = list(pool.map(lambda i: ask(embedded_node, body(i, firsts[i])), range(8)))
        seconds = [
            body(i, [*firsts[i], {"role": "assistant", "content": r["choices"][0]["message"]
                     ["content"]}, {"role": "user", "content": "Now tell it to a child."}])
            for i, r in enumerate(turn1)
        ]  # fmt: skip
        turn2 = list(pool.map(lambda b: ask(embedded_node, b), seconds))
    for first, second, payload in zip(turn1, turn2, seconds, strict=True):
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first["usage"]["prompt_tokens"] <= cached < second["usage"]["prompt_tokens"]
        fresh = ask(small_budget_node, payload)
        fresh_cached = fresh["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert fresh_cached < first["usage"]["prompt_tokens"]  # never saw turn 1
        assert second["choices"][0]["message"] == fresh["choices"][0]["message"]


def test_next_turns_through_two_stages_reuse_every_stages_cache(
    two_stages: Swarm, embedded_node: NodeProcess
) -> None:
    """Prefix reuse on a route: two conversations at once through two stages; each next
    turn goes back to the stages that hold its first turn, reuses those positions on both
    (cached_tokens), answers first at least twice as fast as the same prompts prefilled
    whole on the same route, two at once, and says what a node that never saw turn 1
    says. Then a turn whose stages let the cache go prefills it all, right.

    The time is held to the same prompts without reuse, not to turn 1's: these first turns
    are short (both must fit the stages' prefix caches), and since swarmd's own kernels
    prefill about twice as fast, a short first turn's time is mostly what any request
    costs (CI: turn 1 224 ms, turn 2 113 ms)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.test_pipeline import LONG_PROMPT

    node = two_stages["a"]
    url = f"{node.url}/v1/chat/completions"
    # Two conversations of ~125 tokens: both fit the stages' prefix caches (an eighth
    # of their 3,000-token budgets: 375) at once, each holding its cache's capacity in
    # whole blocks of 64 positions (128).
    head = LONG_PROMPT[: LONG_PROMPT.index("Line 4:")]
    firsts = [{**chat_body(f"{head} Number {i}.", 12), "stream": False} for i in (3, 8)]
    # A system message of their own: the first turns prefill all of their prompts (the
    # template's default system prompt would be copied from earlier tests' conversations,
    # which shortens the first turn that the second's time to first token is held to).
    run = uuid.uuid4().hex[:8]
    for i, body in enumerate(firsts):
        system = {"role": "system", "content": f"Test run {run}, conversation {i}."}
        body["messages"] = [system, *body["messages"]]

    def ask(body: dict[str, Any]) -> dict[str, Any]:
        status, reply, _ = http_json(url, body, timeout_s=120)
        assert status == 200, reply
        return reply

    with ThreadPoolExecutor(2) as pool:
        turn1 = list(pool.map(ask, firsts))
    seconds = [
        {
            **first,
            "messages": [
                *first["messages"],
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Now say it in five words."},
            ],
        }
        for first, reply in zip(firsts, turn1, strict=True)
    ]
    with ThreadPoolExecutor(2) as pool:
        turn2 = list(pool.map(ask, seconds))
    for first, second, body in zip(turn1, turn2, seconds, strict=True):
        # At most the system prompt was copied from an earlier test's conversation.
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 40
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first["usage"]["prompt_tokens"] < cached < second["usage"]["prompt_tokens"]
        status, fresh, _ = http_json(f"{embedded_node.url}/v1/chat/completions", body)
        assert status == 200  # it never saw turn 1: at most a shared start is copied
        fresh_cached = fresh["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert fresh_cached < first["usage"]["prompt_tokens"]
        assert second["choices"][0]["message"] == fresh["choices"][0]["message"]
        assert f"cached_tokens={cached}" in node.log_text()
    # Each stage took its cache over: a third turn of conversation 0 that repeats turn 2's
    # prompt is no continuation of turn 2's reply, and nothing of turn 1 is kept any more.
    # It only shares turn 2's prompt: a copy of all of it but its last token, or nothing
    # where a stage's LRU let turn 2 go.
    third = ask(seconds[0])
    third_cached = third["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert third_cached in (0, turn2[0]["usage"]["prompt_tokens"] - 1)
    assert third["choices"][0]["message"] == turn2[0]["choices"][0]["message"]
    # A longer conversation then pushes conversation 1's caches out of both stages; this
    # node still remembers them, so its next turn asks, is told 0, and prefills it all.
    ask({**chat_body(LONG_PROMPT[: LONG_PROMPT.index("Line 14:")], 4), "stream": False})
    later = {
        **seconds[1],
        "messages": [
            *seconds[1]["messages"],
            {"role": "assistant", "content": turn2[1]["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And in three?"},
        ],
    }
    missed = ask(later)
    assert missed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "missed on the route" in node.log_text()
    status, fresh, _ = http_json(f"{embedded_node.url}/v1/chat/completions", later)
    assert status == 200 and missed["choices"][0]["message"] == fresh["choices"][0]["message"]
    # The second turns' prompts again, two at once, each under a system message of its own
    # (nothing to reuse): turn 2 answered first in at most half their time.
    unseen = [
        {
            **body,
            "messages": [
                {"role": "system", "content": f"Unseen {run}, {i}."},
                *body["messages"][1:],
            ],
        }
        for i, body in enumerate(seconds)
    ]
    with ThreadPoolExecutor(2) as pool:
        whole = list(pool.map(ask, unseen))
    for second, prefilled in zip(turn2, whole, strict=True):
        assert prefilled["usage"]["prompt_tokens_details"]["cached_tokens"] < 40
        assert second["swarm"]["timing"]["ttft_ms"] <= prefilled["swarm"]["timing"]["ttft_ms"] / 2
    for stage in (two_stages["a"], two_stages["b"]):
        assert "peer banned" not in stage.log_text() and "stage failed" not in stage.log_text()


def test_a_shared_start_is_copied_on_every_stage_of_the_route(
    two_stages: Swarm, embedded_node: NodeProcess
) -> None:
    """Requests through two stages that only share a start with a finished conversation
    (the same question again, or the same system prompt and first words) copy it on both
    stages, three at once: cached_tokens says so, each reply is the one a single node
    gives, and the conversation's own next turn still takes its whole cache over."""
    from concurrent.futures import ThreadPoolExecutor

    node = two_stages["a"]
    url = f"{node.url}/v1/chat/completions"

    def ask(at: str, body: dict[str, Any]) -> dict[str, Any]:
        status, reply, _ = http_json(at, body, timeout_s=120)
        assert status == 200, reply
        return reply

    def cached(reply: dict[str, Any]) -> int:
        return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])

    first = chat_body("Name three rivers of Europe, with one fact about each.", 16)
    turn1 = ask(url, first)
    others = [
        first,
        chat_body("Name three mountains of Asia, with one fact about each.", 16),
        chat_body("Name three lakes of Africa, with one fact about each.", 16),
    ]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda body: ask(url, body), others))
    assert cached(replies[0]) == replies[0]["usage"]["prompt_tokens"] - 1  # all but one
    for body, reply in zip(others, replies, strict=True):
        assert MIN_PREFIX_TOKENS <= cached(reply) < reply["usage"]["prompt_tokens"]
        alone = ask(f"{embedded_node.url}/v1/chat/completions", body)
        assert reply["choices"][0]["message"] == alone["choices"][0]["message"]
    assert replies[0]["choices"][0]["message"] == turn1["choices"][0]["message"]
    second = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": turn1["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Which of them is the longest?"},
        ],
    }
    turn2 = ask(url, second)
    assert cached(turn2) >= turn1["usage"]["prompt_tokens"]  # taken over, not copied away
    alone = ask(f"{embedded_node.url}/v1/chat/completions", second)
    assert turn2["choices"][0]["message"] == alone["choices"][0]["message"]
    for stage in (two_stages["a"], two_stages["b"]):
        assert "peer banned" not in stage.log_text() and "stage failed" not in stage.log_text()


def _hold_the_budget(node: NodeProcess, max_tokens: int) -> http.client.HTTPConnection:
    """A stream that reserves `max_tokens` (its end-of-turn tokens barred, so it runs on)
    and has begun: the caller closes it."""
    body = {**chat_body("Count upwards from one, one number a line.", max_tokens, True)}
    body["logit_bias"] = {"0": -100, "2": -100}  # <|endoftext|>, <|im_end|>
    conn = http.client.HTTPConnection(*_host_port(node), timeout=60)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200
    for raw in response:
        if raw.startswith(b"data:") and b'"content"' in raw:
            return conn  # tokens flow: its room is taken
    raise AssertionError("the stream ended before its first token")


@pytest.mark.parametrize("where", ["one node", "two stages"])
def test_a_waiting_request_whose_client_left_gives_up_its_place(
    where: str, small_budget_node: NodeProcess, two_stages: Swarm
) -> None:
    """A request queued for KV room (one node) or for a busy stage (two stages) whose
    client hangs up leaves the queue within a second or so, not when room frees minutes
    later (then to run only until its first step noticed)."""
    node = small_budget_node if where == "one node" else two_stages["a"]
    holder = _hold_the_budget(node, 1400)  # of 1,500 here; of the 1,500 stage b lends a
    try:
        waiter = socket.create_connection(_host_port(node), timeout=10)
        body = json.dumps(chat_body("Say hello.", 200, True)).encode()
        waiter.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            assert wait_until(lambda: int(node.health()["queued"]) == 1, 10.0)
        finally:
            waiter.close()
        left = time.monotonic()
        assert wait_until(lambda: int(node.health()["queued"]) == 0, 5.0)
        assert time.monotonic() - left < 3.0
        assert int(node.health()["sessions"]) >= 1  # the holder still runs: no room freed
    finally:
        holder.close()
    nodes = [node] if where == "one node" else [two_stages["a"], two_stages["b"]]
    assert wait_until(lambda: all(int(n.health()["kv_reserved_tokens"]) == 0 for n in nodes), 10)
    assert "peer banned" not in node.log_text()
