"""The swarm over links that are not loopback's: delay, jitter, a bandwidth cap, a black
hole and a reset, each put on real node processes by the fault proxy (tests/faultproxy.py).

Every node listens behind a proxy of its own and announces the proxy's address
(`--announce-addr`), so every connection between two nodes runs through one proxy: a
40 ms delay on each proxy is 40 ms each way on every link. A node a fault must cut off
whole is named by its pid on the other proxies too (the connections it dialed itself).
The reference is always a single node of the same weights: greedy output through any
link, and through any failover, equals it token for token.
"""

from __future__ import annotations

import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from swarmd.net.identity import load_or_create_identity
from tests.conftest import NodeProcess, http_json, running_node, start_node, wait_until
from tests.e2e.test_pipeline import LONG_PROMPT, Stream, Swarm, chat_body, complete
from tests.faultproxy import FaultProxy

pytestmark = pytest.mark.e2e

DELAY_MS = 40.0
JITTER_MS = 5.0
RTT_S = 2 * DELAY_MS / 1000.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Proxied:
    node: NodeProcess
    proxy: FaultProxy
    peer_id: str

    @property
    def addr(self) -> str:
        return f"{self.proxy.addr}/p2p/{self.peer_id}"

    @property
    def pid(self) -> int:
        return self.node.proc.pid


@dataclass
class ProxiedSwarm:
    """Nodes each behind a fault proxy; `stop` ends them and their proxies."""

    tmp_path: Path
    model_args: list[str]
    members: dict[str, Proxied] = field(default_factory=dict)

    def start(self, name: str, layers: str, *extra: str) -> Proxied:
        """A node holding `layers`, behind a new proxy; the first one is the bootstrap."""
        workdir = self.tmp_path / name
        data = workdir / "data"
        peer_id = load_or_create_identity(data).peer_id
        port = free_port()
        proxy = FaultProxy(port).start()
        args = ["--port", "0", "--p2p-port", str(port), "--data-dir", str(data)]
        args += ["--layers", layers, "--announce-addr", proxy.addr, *self.model_args, *extra]
        if self.members:
            args += ["--bootstrap", next(iter(self.members.values())).addr]
        try:
            node = start_node(args, workdir)
        except BaseException:
            proxy.stop()
            raise
        member = self.members[name] = Proxied(node, proxy, peer_id)
        return member

    def __getitem__(self, name: str) -> Proxied:
        return self.members[name]

    def shape(self, **how: float) -> None:
        for member in self.members.values():
            member.proxy.shape(**how)

    def black_hole(self, name: str) -> None:
        """Cut `name` off: nothing reaches it, nothing leaves it, every socket stays open."""
        victim = self.members[name]
        for member in self.members.values():
            if member is victim:
                member.proxy.black_hole()
            else:
                member.proxy.black_hole(pid=victim.pid)

    def reset(self, name: str) -> int:
        """Tear every connection of `name` with a RST; how many there were."""
        victim = self.members[name]
        return sum(
            m.proxy.reset() if m is victim else m.proxy.reset(pid=victim.pid)
            for m in self.members.values()
        )

    def heal(self) -> None:
        for member in self.members.values():
            member.proxy.heal()

    def wait_routable(self, coordinator: str, holders: int, timeout_s: float = 90.0) -> None:
        node = self.members[coordinator].node

        def ready() -> bool:
            entry = node.get_json("/v1/models")["data"][0]  # type: ignore[index]
            swarm = entry["swarm"]
            return len(swarm["holders"]) >= holders and bool(swarm["routable"])

        assert wait_until(ready, timeout_s, 0.5), f"{coordinator} never saw {holders} holders"

    def stop(self) -> None:
        for member in self.members.values():
            member.node.stop()
            member.proxy.stop()


def short(member: Proxied) -> str:
    return member.peer_id[-8:]


def ids(reply: dict[str, Any]) -> list[int]:
    return list(reply["choices"][0]["token_ids"])


# --- the embedded model over 40 ms links, and through a 10 Mbit/s one --------------------


@pytest.fixture(scope="module")
def wan(test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxiedSwarm]:
    swarm = ProxiedSwarm(tmp_path_factory.mktemp("wan"), ["--cache-dir", str(test_cache_dir)])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SWARMD_TORCH_THREADS", "1")  # nodes share two cores
        try:
            swarm.start("a", "0:15")
            swarm.start("b", "15:30")
            swarm.wait_routable("a", 2)
            yield swarm
        finally:
            swarm.stop()


@pytest.fixture(scope="module")
def one_thread_node(
    test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    """The whole embedded model on one node with the swarm's threads (the TTFT yardstick)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SWARMD_TORCH_THREADS", "1")
        args = ["--cache-dir", str(test_cache_dir)]
        with running_node(tmp_path_factory, "one-thread", args) as node:
            yield node


def test_replies_over_40_ms_links_with_jitter_equal_one_nodes(
    wan: ProxiedSwarm, embedded_node: NodeProcess
) -> None:
    wan.shape(delay_ms=DELAY_MS, jitter_ms=JITTER_MS)
    try:
        for prompt in ("What is the capital of France?", LONG_PROMPT):
            reference, _ = complete(embedded_node, chat_body(prompt, 12))
            reply, headers = complete(wan["a"].node, chat_body(prompt, 12))
            assert headers["x-swarm-nodes"] == f"{short(wan['a'])},{short(wan['b'])}"
            assert ids(reply) == ids(reference)
            assert reply["swarm"]["failovers"] == 0
            # Proof the ring crossed the delayed links: a token cannot come round faster.
            timing = reply["swarm"]["timing"]
            assert timing["decode_ms"] / (len(ids(reply)) - 1) >= 1000 * RTT_S
    finally:
        wan.shape(delay_ms=0, jitter_ms=0)


def test_several_sessions_at_once_over_40_ms_links_each_equal_one_nodes(
    wan: ProxiedSwarm, embedded_node: NodeProcess
) -> None:
    """Sessions share the stages and the delayed links, their prompts' chunks pipelined
    (one to six chunks each) and their decode steps batched: each reply is its own."""
    prompts = ["Name three rivers.", LONG_PROMPT, " ".join([LONG_PROMPT] * 3)]
    bodies = [chat_body(prompt, 10 + 3 * i) for i, prompt in enumerate(prompts)]
    references = [ids(complete(embedded_node, body)[0]) for body in bodies]
    wan.shape(delay_ms=DELAY_MS, jitter_ms=JITTER_MS)
    try:
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
            replies = list(pool.map(lambda body: complete(wan["a"].node, body)[0], bodies))
    finally:
        wan.shape(delay_ms=0, jitter_ms=0)
    for reply, reference in zip(replies, references, strict=True):
        assert ids(reply) == reference
        assert reply["swarm"]["failovers"] == 0
    assert replies[2]["usage"]["prompt_tokens"] > 5 * 256


def test_a_long_prompt_over_40_ms_links_pays_the_latency_about_once(
    wan: ProxiedSwarm, one_thread_node: NodeProcess
) -> None:
    """Prompt chunks flow through the stages one behind the other, so the first token
    comes within one node's time plus two round trips (not a round trip per chunk)."""
    prompt = " ".join([LONG_PROMPT] * 3)  # about 1,500 tokens: six chunks

    def body(run: str) -> dict[str, Any]:
        # Each run its own first words: a prompt asked again would be copied from the
        # cache (prefix reuse), and only its last token prefilled.
        return chat_body(f"Run {run}. {prompt}", 1)

    def ttft(reply: dict[str, Any]) -> float:
        assert reply["usage"]["prompt_tokens"] > 5 * 256
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] < 40
        return float(reply["swarm"]["timing"]["ttft_ms"])

    one_node = min(ttft(complete(one_thread_node, body(f"one {k}"))[0]) for k in "ab")
    wan.shape(delay_ms=DELAY_MS, jitter_ms=JITTER_MS)
    try:
        replies = {k: complete(wan["a"].node, body(f"links {k}"))[0] for k in "ab"}
    finally:
        wan.shape(delay_ms=0, jitter_ms=0)
    for k, reply in replies.items():
        assert ids(reply) == ids(complete(one_thread_node, body(f"links {k}"))[0])
    over_links = min(ttft(r) for r in replies.values())
    assert over_links <= one_node + 2 * 1000 * RTT_S, (over_links, one_node)


def test_replies_through_a_10_mbit_link_equal_one_nodes(
    wan: ProxiedSwarm, embedded_node: NodeProcess
) -> None:
    wan.shape(rate_mbit=10.0)
    try:
        # Its own first words: a start shared with an earlier prompt is copied on the
        # stages (prefix reuse), and its hidden states never cross the link.
        body = chat_body("Over a slow link. " + LONG_PROMPT, 12)
        reference, _ = complete(embedded_node, body)
        reply, _ = complete(wan["a"].node, body)
        assert ids(reply) == ids(reference)
        # The prefilled tokens' hidden states (576 bfloat16 values a token) crossed the
        # capped link before the first token: 10 Mbit/s is 1.25 MB/s.
        usage = reply["usage"]
        fed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        assert fed > 200
        hidden_bytes = fed * 576 * 2
        assert reply["swarm"]["timing"]["ttft_ms"] >= 1000 * hidden_bytes / 1.25e6
    finally:
        wan.shape(rate_mbit=0.0)


# --- a stage black-holed or reset mid-stream (a tiny model: fresh swarms start fast) ----


@pytest.fixture
def tiny_wan(tmp_path: Path, tiny_chat_dir: Path, swarm_env: None) -> Iterator[ProxiedSwarm]:
    swarm = ProxiedSwarm(tmp_path, ["--model", str(tiny_chat_dir)])
    try:
        yield swarm
    finally:
        swarm.stop()


def stream_body(tiny_reference: NodeProcess, max_tokens: int) -> dict[str, Any]:
    body = chat_body("Tell me a long story about the sea.", max_tokens, stream=True)
    body["model"] = tiny_reference.model_id
    body.pop("return_token_ids", None)
    return body


def reference_text(tiny_reference: NodeProcess, body: dict[str, Any]) -> str:
    stream = Stream(tiny_reference, body)
    for _ in stream.events():
        pass
    assert stream.done and not stream.errors
    return stream.text


def start_with_standby(swarm: ProxiedSwarm) -> None:
    swarm.start("a", "0:2")
    swarm.start("b", "2:4")
    swarm.start("b2", "2:4")
    swarm.wait_routable("a", 3)


@pytest.mark.parametrize("fault", ["black hole", "reset"])
def test_a_stage_cut_off_mid_stream_fails_over_to_its_standby_with_the_same_text(
    fault: str, tiny_wan: ProxiedSwarm, tiny_reference: NodeProcess
) -> None:
    start_with_standby(tiny_wan)
    body = stream_body(tiny_reference, 60)
    expected = reference_text(tiny_reference, body)
    # A second session at once, on whichever holder its plan takes: it must come through
    # the same cut with its own text, failed over only if the cut stage was on its route.
    other_body = {**body, "max_tokens": 50, "messages": [{"role": "user", "content": "Hi."}]}
    other_expected = reference_text(tiny_reference, other_body)
    tiny_wan.shape(delay_ms=DELAY_MS, jitter_ms=JITTER_MS)
    stream = Stream(tiny_wan["a"].node, body)
    other = Stream(tiny_wan["a"].node, other_body)
    on_route = stream.headers["x-swarm-nodes"].split(",")[1]
    other_route = other.headers["x-swarm-nodes"].split(",")[1]
    victim = next(n for n in ("b", "b2") if short(tiny_wan[n]) == on_route)
    events, other_events = stream.events(), other.events()
    while stream.content_events < 5:
        next(events)
    while other.content_events < 5:
        next(other_events)
    cut = time.monotonic()
    if fault == "black hole":
        tiny_wan.black_hole(victim)
    else:
        assert tiny_wan.reset(victim) > 0
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda rest: [None for _ in rest], [events, other_events]))
    took = time.monotonic() - cut
    tiny_wan.heal()
    assert stream.done and stream.errors == [] and stream.finish_reason == "length"
    assert stream.text == expected
    assert stream.swarm is not None and stream.swarm["failovers"] == 1
    assert on_route not in stream.swarm["nodes"]
    assert took < 15.0, took
    assert other.done and other.errors == [] and other.text == other_expected
    assert other.swarm is not None
    assert other.swarm["failovers"] == (1 if other_route == on_route else 0)
    assert on_route not in other.swarm["nodes"]
    log = tiny_wan["a"].node.log_text()
    assert "DIAG: stage failed request_id=" in log and f"peer={on_route} kind=lost" in log


def test_a_black_holed_stage_without_standby_ends_the_stream_with_one_error(
    tiny_wan: ProxiedSwarm, tiny_reference: NodeProcess
) -> None:
    """And once the link heals, the next request goes through that stage again: a lost
    stage sits out of routes only while another holder can serve (it is not banned), so
    a home network that dropped for a minute costs its layers no longer outage."""
    tiny_wan.start("a", "0:2")
    tiny_wan.start("b", "2:4")
    tiny_wan.wait_routable("a", 2)
    stream = Stream(tiny_wan["a"].node, stream_body(tiny_reference, 200))
    events = stream.events()
    while stream.content_events < 3:
        next(events)
    cut = time.monotonic()
    tiny_wan.black_hole("b")
    for _ in events:
        pass
    took = time.monotonic() - cut
    tiny_wan.heal()
    assert stream.done, "no [DONE] after the error"
    assert len(stream.errors) == 1 and "2:4" in stream.errors[0]["message"], stream.errors
    assert took < 60.0, took  # the step timeout; the stall check answers well before it
    a, b = tiny_wan["a"].node, tiny_wan["b"]
    peers = a.get_json("/api/peers")
    assert peers["bans"] == []  # type: ignore[index]
    assert [o["peer_id"] for o in peers["sitting_out"]] == [b.peer_id]  # type: ignore[index]
    report = _text(a.url + "/api/admin/diagnostics")
    assert "1 banned" not in report and "0 banned, 1 lost and sitting out" in report
    assert f"sitting out {short(b)} for " in report
    assert "swarmd_peers_sitting_out 1.0" in _text(a.url + "/metrics")
    body = {**stream_body(tiny_reference, 12), "stream": False}
    expected = complete(tiny_reference, body)[0]["choices"][0]["message"]["content"]
    healed = time.monotonic()
    served: list[dict[str, Any]] = []

    def served_again() -> bool:
        status, reply, headers = http_json(f"{a.url}/v1/chat/completions", body, timeout_s=60)
        assert status in (200, 503), reply  # 503: the layers are missing, said so
        if status == 200:
            served.append({k.lower(): v for k, v in headers.items()})
        return bool(served)

    assert wait_until(served_again, 20.0, 1.0), "the healed stage was never routed again"
    assert served[0]["x-swarm-nodes"].split(",")[1] == short(b)
    assert complete(a, body)[0]["choices"][0]["message"]["content"] == expected
    assert time.monotonic() - healed < 20.0
    log = a.log_text()
    assert f"DIAG: peer back peer={short(b)}" in log and "DIAG: peer banned" not in log


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


# --- nodes that take no inbound connection, reached through a relay -------------------


@contextmanager
def node_group(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """`start(name, *args, launcher=None)` runs a node (any free ports, its own data dir;
    `launcher`: start_node's); every node started is stopped at the end."""
    nodes: list[NodeProcess] = []

    def start(name: str, *args: str, launcher: list[str] | None = None) -> NodeProcess:
        workdir = tmp_path / name
        workdir.mkdir()
        common = ["--port", "0", "--p2p-port", "0", "--data-dir", str(workdir / "data")]
        nodes.append(start_node([*common, *args], workdir, launcher=launcher))
        return nodes[-1]

    try:
        yield start
    finally:
        for node in nodes:
            node.stop()


def announces_relay_only(node: NodeProcess) -> bool:
    return relay_only(node.health())


def relay_only(health: dict[str, object]) -> bool:
    """Whether a node's /health lists only circuit addresses (a relay's) to dial it at."""
    addrs = health.get("addrs") or []
    return bool(addrs) and all("/p2p-circuit" in str(a) for a in addrs)  # type: ignore[union-attr]


def routes_both_halves(node: NodeProcess) -> bool:
    entry = node.get_json("/v1/models")["data"][0]  # type: ignore[index]
    return len(entry["swarm"]["holders"]) == 2 and bool(entry["swarm"]["routable"])


def test_nodes_without_inbound_connections_serve_their_stages_through_a_relay(
    tmp_path: Path, tiny_chat_dir: Path, tiny_reference: NodeProcess, swarm_env: None
) -> None:
    """Two --no-listen nodes hold the two halves of the model: neither can dial the
    other, so the ring between them runs through the --relay-service node's circuits
    (both ways: stage 0 to stage 1, and stage 1's answers back to its coordinator)."""
    with node_group(tmp_path) as start:
        relay = start("relay", "--no-model", "--relay-service")
        boot = ["--bootstrap", relay.p2p_addrs[0], "--model", str(tiny_chat_dir), "--no-listen"]
        first = start("first", *boot, "--layers", "0:2")
        second = start("second", *boot, "--layers", "2:4")
        assert first.p2p_addrs == [] and second.p2p_addrs == []  # they listen nowhere
        assert wait_until(
            lambda: announces_relay_only(first) and announces_relay_only(second), 60.0, 0.5
        )
        assert wait_until(lambda: routes_both_halves(first), 60.0, 0.5)
        body = chat_body("Tell me about the sea.", 12)
        body["model"] = tiny_reference.model_id
        reference, _ = complete(tiny_reference, body)
        for _ in range(2):
            reply, headers = complete(first, body)
            assert ids(reply) == ids(reference)
            assert headers["x-swarm-route"] == "relayed"
            assert headers["x-swarm-nodes"].split(",")[1] == second.health()["short_id"]
            assert reply["swarm"]["failovers"] == 0
        bodies = [
            {**chat_body(f"Tell me about {topic}.", 8 + 4 * i), "model": tiny_reference.model_id}
            for i, topic in enumerate(("the sea", "rivers", "mountains"))
        ]
        expected = [ids(complete(tiny_reference, b)[0]) for b in bodies]
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:  # sessions at once
            at_once = list(pool.map(lambda b: complete(first, b), bodies))
        for (reply, headers), want in zip(at_once, expected, strict=True):
            assert ids(reply) == want and headers["x-swarm-route"] == "relayed"
        diag = f"route=relayed segments=2 model={tiny_reference.model_id}"
        assert (
            diag in first.log_text()
            and f"relayed={second.health()['short_id']}" in first.log_text()
        )
        report = first.get_json("/health")
        assert report["swarm"] == "ready"
        # Reservations and circuits that ended as they should print no error.
        assert "Error reading from hop stream" not in relay.log_text()


def test_a_node_peers_cannot_dial_finds_out_and_serves_through_a_relay(
    tmp_path: Path, tiny_chat_dir: Path, tiny_reference: NodeProcess, swarm_env: None
) -> None:
    """A node that listens, but at an address peers cannot reach (what it announces takes
    connections and never answers, as a NAT that drops them), is told so by the peers it
    asks to dial it back; it takes a relay slot by itself and its stage is served through
    the relay. The nodes peers can dial find themselves public and stay direct."""
    silent = socket.create_server(("127.0.0.1", 0), backlog=16)
    with silent, node_group(tmp_path) as start:
        relay = start("relay", "--no-model", "--relay-service")
        boot = ["--bootstrap", relay.p2p_addrs[0], "--model", str(tiny_chat_dir)]
        first = start("first", *boot, "--layers", "0:2")
        dead = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}"
        hidden = start("hidden", *boot, "--layers", "2:4", "--announce-addr", dead)

        def relayed(node: NodeProcess) -> bool:
            return node.health()["reachability"] == "private" and announces_relay_only(node)

        assert wait_until(lambda: relayed(hidden), 60.0, 0.5), hidden.health()
        assert "DIAG: reachability private" in hidden.log_text()
        assert wait_until(lambda: first.health()["reachability"] == "public", 30.0, 0.5)
        assert relay.health()["reachability"] == "public"
        assert first.health()["addrs"] == first.p2p_addrs  # found reachable: still direct

        assert wait_until(lambda: routes_both_halves(first), 60.0, 0.5)
        bodies = [
            {**chat_body(f"Tell me about {topic}.", 8 + 4 * i), "model": tiny_reference.model_id}
            for i, topic in enumerate(("the sea", "rivers"))
        ]
        expected = [ids(complete(tiny_reference, b)[0]) for b in bodies]
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:  # sessions at once
            at_once = list(pool.map(lambda b: complete(first, b), bodies))
        for (reply, headers), want in zip(at_once, expected, strict=True):
            assert ids(reply) == want and reply["swarm"]["failovers"] == 0
            assert headers["x-swarm-route"] == "relayed"
            assert headers["x-swarm-nodes"].split(",")[1] == hidden.health()["short_id"]
        report = urlopen_text(f"{hidden.url}/api/admin/diagnostics")
        line = next(x for x in report.splitlines() if x.startswith("reachability: "))
        port = silent.getsockname()[1]  # the report hides IPs, not ports
        assert line.startswith("reachability: private: ") and f"/tcp/{port}/p2p/" in line
        # The hidden node dials out to the reachable one itself (its stage answers its
        # coordinator): that connection is direct, and it carries rings once the relay
        # has gone.
        hidden_id = str(hidden.health()["peer_id"])

        def link() -> object:
            rows = first.get_json("/api/peers")["peers"]  # type: ignore[index]
            return next((r["link"] for r in rows if r["peer_id"] == hidden_id), None)

        assert wait_until(lambda: link() == "direct", 30.0, 0.5), link()
        assert "yes (direct)" in urlopen_text(f"{first.url}/api/admin/diagnostics")
        relay.stop()
        body = {**chat_body("Name a river.", 10), "model": tiny_reference.model_id}
        reply, _ = complete(first, body)
        assert ids(reply) == ids(complete(tiny_reference, body)[0])
        assert reply["swarm"]["failovers"] == 0
        assert reply["swarm"]["nodes"][1] == hidden.health()["short_id"]


# --- placement on measured speed ----------------------------------------------------------

SLOW = [sys.executable, str(Path(__file__).with_name("slow_node.py"))]


def test_a_stage_slower_than_its_record_claims_is_avoided_once_measured(
    tmp_path: Path, test_cache_dir: Path, embedded_node: NodeProcess, swarm_env: None
) -> None:
    """s holds 15:30 and claims a huge throughput, but every forward takes it 5x as long
    (outside the compute it reports); b2 holds 15:30 too and claims a modest one. The
    first plan believes s's claim; once a decode has measured s, a routes through b2."""
    swarm = Swarm(tmp_path, ["--cache-dir", str(test_cache_dir)])
    try:
        swarm.start([("a", "0:15", None), ("s", "15:30", [*SLOW, "slow"])])
        swarm._start_one("b2", "15:30", [*SLOW, "claim:30"], swarm["a"].p2p_addrs[0])
        swarm.wait_holders("a", 3)
        swarm.wait_rtts("a", ["s", "b2"])
        slow, fast = swarm.short_id("s"), swarm.short_id("b2")
        body = chat_body("What is the capital of France?", 8)
        reference, _ = complete(embedded_node, body)
        routes = []
        for _ in range(5):
            reply, headers = complete(swarm["a"], body)
            assert ids(reply) == ids(reference)
            routes.append(headers["x-swarm-nodes"].split(",")[1])
        assert routes[0] == slow, routes  # its claim decided the first plan
        assert routes[1:] == [fast] * 4, routes  # measured once: avoided from then on
        peers = {p["short_id"]: p for p in swarm["a"].get_json("/api/peers")["peers"]}
        assert peers[slow]["layer_ms"] > 3 * peers[fast]["layer_ms"], peers
        assert "ms/layer" in urlopen_text(swarm["a"].url + "/api/admin/diagnostics")
    finally:
        swarm.stop()


def urlopen_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()
