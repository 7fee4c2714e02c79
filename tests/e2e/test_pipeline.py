"""Distributed generation across real node processes on 127.0.0.1.

The reference is always a single process running the same weights: greedy output through
any route, with or without failovers, must equal it token for token.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import NodeProcess, http_json, start_node, wait_until

pytestmark = pytest.mark.e2e

HOSTILE = [sys.executable, str(Path(__file__).with_name("hostile_node.py"))]
LAGGING = [sys.executable, str(Path(__file__).with_name("slow_node.py")), "lag:20"]
LONG_PROMPT = "Summarise this text in one sentence. " + " ".join(
    f"Line {i}: the harbour lights were lit at dusk and the boats came home." for i in range(25)
)
PROMPTS = ["What is the capital of France?", "Count from one to ten.", LONG_PROMPT]


@dataclass
class Swarm:
    """Nodes by name; `stop` ends every one still running."""

    tmp_path: Path
    model_args: list[str]
    nodes: dict[str, NodeProcess] = field(default_factory=dict)
    args: dict[str, list[str]] = field(default_factory=dict)  # each node's `swarmd run` args

    def start(self, specs: list[tuple[str, str, list[str] | None]]) -> None:
        """Start (name, layers, launcher) nodes: the first alone, the rest together."""
        first, *rest = specs
        self._start_one(*first, bootstrap=None)
        boot = next(iter(self.nodes.values())).p2p_addrs[0]
        with ThreadPoolExecutor(max_workers=len(rest) or 1) as pool:
            for future in [pool.submit(self._start_one, *spec, bootstrap=boot) for spec in rest]:
                future.result()

    def _start_one(
        self, name: str, layers: str, launcher: list[str] | None, bootstrap: str | None
    ) -> None:
        workdir = self.tmp_path / name
        workdir.mkdir()
        args = ["--port", "0", "--p2p-port", "0", "--data-dir", str(workdir / "data")]
        args += ["--layers", layers, *self.model_args]
        if bootstrap is not None:
            args += ["--bootstrap", bootstrap]
        self.args[name] = args
        self.nodes[name] = start_node(args, workdir, launcher=launcher)

    def restart(self, name: str) -> None:
        """Stop a node cleanly (SIGTERM) and start it again as a user would: the same data
        dir (so the same peer id) and the same p2p port (the address others know)."""
        node = self.nodes[name]
        port = node.p2p_addrs[0].split("/tcp/")[1].split("/")[0]  # /ip4/.../tcp/<port>/p2p/...
        node.stop()
        args = [*self.args[name]]
        args[args.index("--p2p-port") + 1] = port
        self.nodes[name] = start_node(args, self.tmp_path / name)

    def __getitem__(self, name: str) -> NodeProcess:
        return self.nodes[name]

    def short_id(self, name: str) -> str:
        return str(self.nodes[name].health()["short_id"])

    def wait_holders(self, coordinator: str, count: int, timeout_s: float = 60.0) -> None:
        node = self.nodes[coordinator]

        def seen() -> bool:
            entry = node.get_json("/v1/models")["data"][0]  # type: ignore[index]
            return len(entry["swarm"]["holders"]) >= count and bool(entry["swarm"]["routable"])

        assert wait_until(seen, timeout_s, 0.5), f"{coordinator} never saw {count} holders"

    def wait_rtts(self, coordinator: str, names: list[str], timeout_s: float = 60.0) -> None:
        """Until the coordinator has a round trip for each named node (unmeasured peers
        cost the planner's default RTT, which would decide the plans instead)."""
        node = self.nodes[coordinator]
        ids = {str(self.nodes[name].health()["peer_id"]) for name in names}

        def measured() -> bool:
            rows = node.get_json("/api/peers")["peers"]  # type: ignore[index]
            return ids <= {r["peer_id"] for r in rows if r["rtt_ms"] is not None}

        assert wait_until(measured, timeout_s, 0.5), f"{coordinator} never pinged {names}"

    def rtt_ms(self, coordinator: str, name: str) -> float | None:
        """The coordinator's round trip to a named node, as its planner sees it."""
        peer_id = str(self.nodes[name].health()["peer_id"])
        rows = self.nodes[coordinator].get_json("/api/peers")["peers"]  # type: ignore[index]
        return next((r["rtt_ms"] for r in rows if r["peer_id"] == peer_id), None)

    def wait_near(self, coordinator: str, name: str, rival: str, timeout_s: float = 90.0) -> None:
        """Until the coordinator measures `name` within 4 ms of `rival`: a stage claiming
        the best throughput saves at most the 5 ms default layer cost, so on a loaded box
        (its first pings all met a stall) every plan would take the rival instead."""

        def near() -> bool:
            mine, theirs = self.rtt_ms(coordinator, name), self.rtt_ms(coordinator, rival)
            return mine is not None and theirs is not None and mine < theirs + 4.0

        assert wait_until(near, timeout_s, 1.0), f"{coordinator} never measured {name} as near"

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


def chat_body(prompt: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "return_token_ids": True,
    }


def complete(node: NodeProcess, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    status, reply, headers = http_json(f"{node.url}/v1/chat/completions", body, timeout_s=300)
    assert status == 200, reply
    return reply, {k.lower(): v for k, v in headers.items()}


class Stream:
    """A streamed chat reply read event by event (http.client, so it can be cut)."""

    def __init__(self, node: NodeProcess, body: dict[str, Any]) -> None:
        url = urlsplit(node.url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
        self.conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        self.headers = {k.lower(): v for k, v in self.response.getheaders()}
        self.text = ""
        self.content_events = 0
        self.finish_reason: str | None = None
        self.swarm: dict[str, Any] | None = None
        self.errors: list[dict[str, Any]] = []
        self.done = False

    def events(self) -> Iterator[dict[str, Any]]:
        try:
            yield from self._events()
        finally:
            self.close()

    def _events(self) -> Iterator[dict[str, Any]]:
        for raw in self.response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                self.done = True
                return
            event = json.loads(data)
            if "error" in event:
                self.errors.append(event["error"])
            for choice in event.get("choices", []):
                content = choice["delta"].get("content")
                if content:
                    self.text += content
                    self.content_events += 1
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
            if "swarm" in event:
                self.swarm = event["swarm"]
            yield event

    def close(self) -> None:
        self.response.close()
        self.conn.close()


# --- exact match and client gone: one swarm of three for the module -------------------


@pytest.fixture(scope="module")
def three_stages(test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    swarm = Swarm(tmp_path_factory.mktemp("three"), ["--cache-dir", str(test_cache_dir)])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SWARMD_TORCH_THREADS", "1")  # nodes share two cores
        try:
            swarm.start([("a", "0:10", None), ("b", "10:20", None), ("c", "20:30", None)])
            for name in ("a", "b", "c"):
                swarm.wait_holders(name, 3)
            yield swarm
        finally:
            swarm.stop()


def test_three_stages_give_the_single_node_tokens(
    three_stages: Swarm, embedded_node: NodeProcess
) -> None:
    route = [three_stages.short_id(n) for n in ("a", "b", "c")]
    # The embedded model's own format on every node: an int4 swarm against an int4 node.
    for node in (embedded_node, *(three_stages[n] for n in ("a", "b", "c"))):
        model = node.health()["models"][0]  # type: ignore[index]
        assert (model["weights"], model["backend"]) == ("int4", "engine")
    for prompt in PROMPTS:
        reference, _ = complete(embedded_node, chat_body(prompt, 16))
        for name in ("a", "b", "c"):  # each node coordinates once
            reply, headers = complete(three_stages[name], chat_body(prompt, 16))
            assert headers["x-swarm-route"] == "distributed"
            assert headers["x-swarm-segments"] == "3"
            assert headers["x-swarm-nodes"] == ",".join(route)
            assert reply["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
            assert reply["choices"][0]["message"] == reference["choices"][0]["message"]
            # The counts; not cached_tokens: which nodes copied a shared start differs.
            for count in ("prompt_tokens", "completion_tokens", "total_tokens"):
                assert reply["usage"][count] == reference["usage"][count]
            swarm = reply["swarm"]
            assert swarm["failovers"] == 0
            assert [s["node"] for s in swarm["segments"]] == route
            assert all(s["ms"] > 0 for s in swarm["segments"])
    assert reference["usage"]["prompt_tokens"] > 256  # the last prompt took several chunks
    log = three_stages["a"].log_text()
    assert "route=distributed segments=3" in log
    assert "seg2_ms=" in log and "activation_bytes=" in log and "failovers=0" in log


def test_client_gone_frees_the_session_on_every_stage(three_stages: Swarm) -> None:
    nodes = [three_stages[n] for n in ("a", "b", "c")]
    stream = Stream(nodes[0], chat_body("Write a long story about a lighthouse.", 400, True))
    events = stream.events()
    while stream.content_events < 3:
        next(events)
    assert all(int(n.health()["sessions"]) == 1 for n in nodes)  # one cache on each stage
    stream.close()
    left = time.monotonic()
    assert wait_until(lambda: all(int(n.health()["sessions"]) == 0 for n in nodes), 2.0)
    assert time.monotonic() - left < 2.0
    assert wait_until(lambda: "error_type=ClientDisconnectedError" in nodes[0].log_text(), 5.0)


def test_eight_streams_through_three_stages_each_equal_their_reply_alone(
    three_stages: Swarm, embedded_node: NodeProcess
) -> None:
    from tests.e2e.many_streams import eight_bodies, references, stream_all  # built on Stream

    bodies = eight_bodies(stream=True)
    expected = references(embedded_node, bodies)
    nodes = [three_stages[n] for n in ("a", "b", "c")]
    outcomes = stream_all(nodes[1], bodies, cancel=5)  # coordinated by the middle stage
    for i, (got, want) in enumerate(zip(outcomes, expected, strict=True)):
        assert got.failure == "" and got.errors == [], (i, got)
        if i == 5:
            assert want.startswith(got.text) and got.text
        else:
            assert got.done and got.text == want, i
    assert wait_until(lambda: all(int(n.health()["sessions"]) == 0 for n in nodes), 2.0)
    assert all("peer banned" not in n.log_text() for n in nodes)


def test_structured_replies_at_once_through_three_stages_equal_their_single_node_reply(
    three_stages: Swarm, embedded_node: NodeProcess
) -> None:
    """Five sessions at once, each its own grammar (or logprobs) on the last stage: one
    offers a tool beside a JSON response_format (calls, or an answer in the format)."""
    bodies = [
        {**chat_body(f"Describe a sea creature number {i}.", 40), **SEEDED_JSON, "seed": i}
        for i in range(3)
    ]
    bodies.append({**chat_body("Name a fish.", 12), "logprobs": True, "top_logprobs": 3})
    bodies.append({**chat_body("Weather in Paris?", 40), **SEEDED_JSON, "tools": [FORECAST_TOOL]})
    expected = [complete(embedded_node, body)[0] for body in bodies]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        got = list(pool.map(lambda b: complete(three_stages["b"], b)[0], bodies))
    for want, reply in zip(expected, got, strict=True):
        assert reply["swarm"]["route"] == "distributed"
        assert reply["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    for reply in got[:3]:  # cut at 40 tokens, but under the schema from the first one
        assert reply["choices"][0]["message"]["content"].startswith('{"title": "')
    content = got[3]["choices"][0]["logprobs"]["content"]
    assert content and all(len(e["top_logprobs"]) == 3 for e in content)
    message = got[4]["choices"][0]["message"]
    assert message.get("tool_calls") or message["content"].startswith('{"title": "')


def test_n_choices_through_three_stages_equal_the_single_nodes(
    three_stages: Swarm, embedded_node: NodeProcess
) -> None:
    """`n` through a pipeline: every choice prefills on the stages, while the single node
    copies choice 0's prompt; each choice is the same seeded draw either way."""
    body = {**chat_body("Write a short line about rivers.", 16), "temperature": 0.9}
    body.update(seed=4242, n=3)
    alone, _ = complete(embedded_node, body)
    piped, headers = complete(three_stages["b"], body)
    assert headers["x-swarm-route"] == "distributed"
    assert [c["index"] for c in piped["choices"]] == [0, 1, 2]
    ids = [c["token_ids"] for c in piped["choices"]]
    assert ids == [c["token_ids"] for c in alone["choices"]]
    assert len({tuple(t) for t in ids}) == 3  # three seeds, three replies
    assert piped["usage"]["completion_tokens"] == sum(len(t) for t in ids)
    assert [s["route"] for s in piped["swarm"]["choices"]] == ["distributed"] * 3


def test_several_prompts_through_three_stages_each_equal_the_single_nodes_reply(
    three_stages: Swarm, embedded_node: NodeProcess
) -> None:
    """Several prompts in one /v1/completions request run as sessions of their own,
    batched on every stage: each reply is what the single node gives that prompt alone."""
    prompts = ["The capital of France is", "Water boils at", "My favourite fruit is", "1, 2, 3,"]
    body = {"model": "smollm2-135m-instruct", "max_tokens": 12, "temperature": 0}

    def ask(node: NodeProcess, prompt: Any) -> dict[str, Any]:
        status, reply, _ = http_json(
            f"{node.url}/v1/completions", {**body, "prompt": prompt}, timeout_s=300
        )
        assert status == 200, reply
        return reply

    alone = [ask(embedded_node, p) for p in prompts]
    piped = ask(three_stages["b"], prompts)
    assert [c["index"] for c in piped["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in piped["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert piped["swarm"]["route"] == "distributed"
    for counted in ("prompt_tokens", "completion_tokens"):
        assert piped["usage"][counted] == sum(a["usage"][counted] for a in alone)


# --- failover ---------------------------------------------------------------------------


@pytest.fixture
def swarm(tmp_path: Path, test_cache_dir: Path, swarm_env: None) -> Iterator[Swarm]:
    made = Swarm(tmp_path, ["--cache-dir", str(test_cache_dir)])
    try:
        yield made
    finally:
        made.stop()


# A sampled reply under a grammar, with logprobs: the new last stage must draw what the
# lost route would have (seed and position) from the grammar state rebuilt from the reply.
SEEDED_JSON: dict[str, Any] = {
    "temperature": 0.9,
    "seed": 1234,
    "logprobs": True,
    "top_logprobs": 2,
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "poem",
            "schema": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 40},
                    "lines": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 60},
                        "minItems": 3,  # long enough to be cut mid-reply
                        "maxItems": 4,
                    },
                },
                "required": ["title", "lines"],
            },
        },
    },
}


FORECAST_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("extra", [{}, SEEDED_JSON], ids=["greedy", "seeded-json"])
def test_a_killed_stage_fails_over_to_its_standby(
    swarm: Swarm, embedded_node: NodeProcess, extra: dict[str, Any]
) -> None:
    prompt = "Write a short poem about the sea."
    reference = Stream(embedded_node, {**chat_body(prompt, 100, True), **extra})
    list(reference.events())
    swarm.start(
        [("a", "0:10", None), ("b", "10:20", None), ("b2", "10:20", None), ("c", "20:30", None)]
    )
    swarm.wait_holders("a", 4)
    by_short = {swarm.short_id(n): n for n in ("b", "b2")}

    stream = Stream(swarm["a"], {**chat_body(prompt, 100, True), **extra})
    route = stream.headers["x-swarm-nodes"].split(",")
    victim_short = next(s for s in route if s in by_short)
    victim = by_short[victim_short]
    survivor = "b2" if victim == "b" else "b"
    for _ in stream.events():
        if stream.content_events == 20:
            os.kill(swarm[victim].proc.pid, signal.SIGKILL)
            swarm[victim].proc.wait(timeout=10)
    assert stream.done and not stream.errors
    assert stream.text == reference.text
    assert stream.finish_reason == reference.finish_reason
    if extra:
        assert set(json.loads(stream.text)) == {"title", "lines"}
    assert stream.swarm is not None
    assert stream.swarm["failovers"] == 1
    assert swarm.short_id(survivor) in stream.swarm["nodes"]
    # The DIAG line is written once the reply is over: poll for it.
    assert wait_until(lambda: "failovers=1 outcome=ok" in swarm["a"].log_text(), 5.0)
    # Lost, not banned: it sits out of routes while the other holder serves.
    log = swarm["a"].log_text()
    assert f"DIAG: peer sits out peer={victim_short}" in log
    assert "DIAG: peer banned" not in log


def test_a_stage_shut_down_mid_stream_hands_over_and_is_routable_once_restarted(
    swarm: Swarm, embedded_node: NodeProcess
) -> None:
    """A rolling restart: the holder of 10:20 on the first of four concurrent streams'
    routes gets SIGTERM mid-reply. It tells the coordinator it is leaving, so its streams
    fail over to the other holder without a ban (the others run on), and once it is back
    (same peer id) it serves while the other holder is restarted in turn. On the old code
    the clean shutdown read as a lost stage, banned 30 s: the restarted holder got no
    requests, and 503s followed (found by a stress run)."""
    prompts = [f"Write a short poem about {t}." for t in ("the sea", "trains", "owls", "rain")]
    references = [Stream(embedded_node, chat_body(p, 60, True)) for p in prompts]
    for reference in references:
        list(reference.events())
    swarm.start(
        [("a", "0:10", None), ("b", "10:20", None), ("b2", "10:20", None), ("c", "20:30", None)]
    )
    swarm.wait_holders("a", 4)
    by_short = {swarm.short_id(n): n for n in ("b", "b2")}
    streams = [Stream(swarm["a"], chat_body(p, 60, True)) for p in prompts]
    holders = [
        next(by_short[s] for s in st.headers["x-swarm-nodes"].split(",") if s in by_short)
        for st in streams
    ]
    victim = holders[0]
    other = "b2" if victim == "b" else "b"
    first = streams[0].events()
    while streams[0].content_events < 20:
        next(first)
    swarm[victim].proc.terminate()  # SIGTERM: a clean shutdown
    with ThreadPoolExecutor(max_workers=len(streams)) as pool:
        list(pool.map(lambda st: list(st.events()), streams))
    for stream, reference, holder in zip(streams, references, holders, strict=True):
        assert stream.done and not stream.errors and stream.text == reference.text
        assert stream.swarm is not None
        assert stream.swarm["failovers"] == (1 if holder == victim else 0)
        assert swarm.short_id(other) in stream.swarm["nodes"]
    prompt, reference = prompts[0], references[0]
    swarm.restart(victim)
    swarm.wait_holders("a", 4)
    swarm[other].stop()  # the other holder's turn: only the restarted one is left
    reply, headers = complete(swarm["a"], chat_body(prompt, 60))
    assert reply["choices"][0]["message"]["content"] == reference.text
    assert swarm.short_id(victim) in headers["x-swarm-nodes"].split(",")
    log = swarm["a"].log_text()
    assert "kind=declined" in log and "shutting down" in log
    assert "peer banned" not in log


def test_a_resumed_turn_whose_stage_is_killed_fails_over_to_the_same_text(swarm: Swarm) -> None:
    """Turn 2 resumes turn 1's caches on its route; its last stage then dies mid-reply. The
    standby is fed what those caches held (turn 1's steps, as they ran) and turn 2's own,
    so the reply goes on exactly as the resumed route gave it without the kill. (Not
    necessarily as a fresh prefill gives it: see the README on prefix reuse.)"""
    swarm.start([("a", "0:15", None), ("b", "15:30", None), ("b2", "15:30", None)])
    swarm.wait_holders("a", 3)
    by_short = {swarm.short_id(n): n for n in ("b", "b2")}
    first = chat_body(LONG_PROMPT[: LONG_PROMPT.index("Line 6:")], 12)

    def second_turn() -> dict[str, Any]:
        status, turn1, _ = http_json(f"{swarm['a'].url}/v1/chat/completions", first)
        assert status == 200
        messages = [
            *first["messages"],
            {"role": "assistant", "content": turn1["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now write a short poem about those boats."},
        ]
        return {
            **chat_body("", 80, True),
            "messages": messages,
            "stream_options": {"include_usage": True},
        }

    def run(kill: bool) -> tuple[Stream, int | None]:
        stream = Stream(swarm["a"], second_turn())
        route = stream.headers["x-swarm-nodes"].split(",")
        victim = next(by_short[s] for s in route if s in by_short)
        cached = None
        for event in stream.events():
            if kill and stream.content_events == 10 and swarm[victim].proc.poll() is None:
                os.kill(swarm[victim].proc.pid, signal.SIGKILL)
                swarm[victim].proc.wait(timeout=10)
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert stream.done and not stream.errors and stream.swarm is not None
        return stream, cached

    reference, cached = run(kill=False)
    assert reference.swarm is not None and reference.swarm["failovers"] == 0 and cached
    # Turn 1 again (a copy of its kept start, then kept anew), and turn 2 again: it
    # continues turn 1, and is also the first run's turn 2 asked again, the longer reuse
    # (a copy of all of its prompt but the last token, since 0.5.2). Either is resumed
    # state the standby must be fed.
    stream, cached_again = run(kill=True)
    assert stream.swarm is not None and stream.swarm["failovers"] == 1
    assert cached is not None and cached_again is not None and cached_again >= cached
    assert stream.text == reference.text
    assert stream.finish_reason == reference.finish_reason


def test_a_killed_range_without_standby_ends_the_stream_with_an_error(swarm: Swarm) -> None:
    swarm.start([("a", "0:10", None), ("b", "10:20", None), ("c", "20:30", None)])
    swarm.wait_holders("a", 3)
    stream = Stream(swarm["a"], chat_body("Write a short poem about the sea.", 100, True))
    for _ in stream.events():
        if stream.content_events == 10 and swarm["b"].proc.poll() is None:
            os.kill(swarm["b"].proc.pid, signal.SIGKILL)
            swarm["b"].proc.wait(timeout=10)
    assert stream.done  # [DONE] after the error event
    assert len(stream.errors) == 1
    assert "[10:20)" in stream.errors[0]["message"]
    assert stream.finish_reason is None

    status, body, headers = http_json(
        f"{swarm['a'].url}/v1/chat/completions", chat_body("Hello", 5), timeout_s=60
    )
    assert status == 503
    assert "[10:20)" in body["error"]["message"]
    assert int(headers["Retry-After"]) > 0


# --- a stage that sends garbage ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["shape", "dtype", "nan"])
def test_a_hostile_stage_is_banned_and_routed_around(
    mode: str, tmp_path: Path, tiny_chat_dir: Path, tiny_reference: NodeProcess, swarm_env: None
) -> None:
    swarm = Swarm(tmp_path, ["--model", str(tiny_chat_dir)])
    try:
        swarm.start(
            [
                ("a", "0:2", None),
                ("h", "2:3", [*HOSTILE, mode]),
                # Lagging: planning goes by measured speed, and a measured b2 that is not
                # slow would win the plans against h's claim whenever its RTT is lower.
                ("b2", "2:3", [*LAGGING]),
                ("c", "3:4", None),
            ]
        )
        swarm.wait_holders("a", 4)
        swarm.wait_rtts("a", ["h", "b2", "c"])
        swarm.wait_near("a", "h", "b2")
        hostile = swarm.short_id("h")
        body = chat_body("Tell me about the sea.", 12)
        body["model"] = tiny_reference.model_id
        reference, _ = complete(tiny_reference, body)
        # The planner prefers h for its claimed throughput, but measured RTTs count too:
        # while a's pings of h have all met a stall, the honest b2 may win a plan. Every
        # reply must be right; the first one planned through h must have routed around it.
        for _attempt in range(10):
            reply, _ = complete(swarm["a"], body)
            assert reply["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
            if reply["swarm"]["failovers"]:
                break
            assert hostile not in reply["swarm"]["nodes"]
        else:
            pytest.fail("ten plans in a row left out the stage claiming the best throughput")
        assert reply["swarm"]["failovers"] == 1
        assert hostile not in reply["swarm"]["nodes"]
        hostile_peer = swarm["h"].health()["peer_id"]
        # c caught it and banned it; a (the coordinator) has only c's word, which a ping
        # cannot check: it routes around h for this request and bans nobody (issue 14).
        bans = swarm["c"].get_json("/api/peers")["bans"]
        assert hostile_peer in [b["peer_id"] for b in bans]  # type: ignore[union-attr]
        assert swarm["a"].get_json("/api/peers")["bans"] == []
        assert "DIAG: stage rejected a frame" in swarm["c"].log_text()
        # The route went through it first: the coordinator failed it over as "bad".
        assert f"peer={hostile} kind=bad failover=1" in swarm["a"].log_text()
    finally:
        swarm.stop()
