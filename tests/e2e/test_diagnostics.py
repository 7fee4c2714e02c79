"""`swarmd diagnostics` and `/metrics` on a three-node swarm, after a distributed request."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import NodeProcess, http_json, running_node, wait_until

pytestmark = pytest.mark.e2e

SECTIONS = (
    "== Summary",
    "== This node",
    "== Listen addresses",
    "== Peers",
    "== Models and shards",
    "== Layer coverage",
    "== Last requests",
    "== Failures",
    "== Sessions in flight",
)
IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")


@pytest.fixture(scope="module")
def swarm(
    tiny_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[NodeProcess]]:
    common = ["--model", str(tiny_shards), "--torch-threads", "1"]
    with running_node(tmp_path_factory, "a", [*common, "--layers", "0:2"]) as a:
        boot = ["--bootstrap", a.p2p_addrs[0]]
        with (
            running_node(tmp_path_factory, "b", [*common, "--layers", "2:3", *boot]) as b,
            running_node(tmp_path_factory, "c", [*common, "--layers", "3:4", *boot]) as c,
        ):
            yield [a, b, c]


def scrape(node: NodeProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{node.url}/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def report(node: NodeProcess, *flags: str) -> str:
    cmd = [sys.executable, "-m", "swarmd", "diagnostics", "--url", node.url, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def test_report_and_metrics_after_a_distributed_request(swarm: list[NodeProcess]) -> None:
    a = swarm[0]

    def routable() -> bool:
        entry = a.get_json("/v1/models")["data"][0]  # type: ignore[index]
        return len(entry["swarm"]["holders"]) == 3 and bool(entry["swarm"]["routable"])

    assert wait_until(routable, 60, 0.5)
    before = scrape(a)
    body = {
        "model": a.model_id,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    status, reply, headers = http_json(f"{a.url}/v1/chat/completions", body)
    assert status == 200, reply
    assert headers["x-swarm-route"] == "distributed"
    route = headers["x-swarm-nodes"].split(",")
    assert len(route) == 3
    bad, _, bad_headers = http_json(f"{a.url}/v1/chat/completions", {**body, "temperature": "hot"})
    assert bad == 400
    after = scrape(a)

    usage = reply["usage"]
    ok = "swarmd_requests_total"
    assert value(after, ok, outcome="ok") - value(before, ok, outcome="ok") == 1
    assert value(after, ok, outcome="error") - value(before, ok, outcome="error") == 1
    generated = "swarmd_generated_tokens_total"
    assert value(after, generated) - value(before, generated) == usage["completion_tokens"]
    prompt = "swarmd_prompt_tokens_total"
    assert value(after, prompt) - value(before, prompt) == usage["prompt_tokens"]
    ttft = "swarmd_ttft_seconds_count"
    assert value(after, ttft) - value(before, ttft) == 1
    gaps = "swarmd_inter_token_seconds_count"
    assert value(after, gaps) - value(before, gaps) == usage["completion_tokens"] - 1
    assert value(after, "swarmd_stage_forward_seconds_count") > value(
        before, "swarmd_stage_forward_seconds_count"
    )
    stage = "/swarmd/stage/1"
    assert value(after, "swarmd_bytes_sent_total", protocol=stage) > 0
    assert value(after, "swarmd_bytes_received_total", protocol=stage) > 0
    assert value(after, "swarmd_peers_connected") >= 2
    assert value(after, "swarmd_swarm_joining") == 0
    # Peers dialed it back (a check right after joining): reachable on loopback.
    assert wait_until(
        lambda: value(scrape(a), "swarmd_reachability", state="public") == 1, 30.0, 0.5
    )
    assert value(scrape(a), "swarmd_reachability", state="private") == 0

    text = report(a)
    for section in SECTIONS:
        assert section in text, section
    for short_id in route:
        assert text.count(short_id) >= 3, short_id  # peers, coverage and the request's route
    assert reply["id"] not in text  # the report names requests by the node's request id
    assert headers["x-swarm-request-id"][:8] in text
    assert "complete: every layer has a holder" in text
    summary = text.split("== This node")[0]
    assert "3 holder(s)" in summary and ": complete;" in summary
    bad_id = bad_headers["x-swarm-request-id"][:8]
    assert f"last req  {bad_id} local -: " in summary and "InvalidRequestError" in summary
    ok_id = headers["x-swarm-request-id"][:8]
    assert re.search(rf"{ok_id}\s+distributed\s+{','.join(route)}\s", text), text
    assert "verified at start" in text
    assert "outcome=error" in text  # the rejected request's DIAG line, in the failure ring
    assert not IPV4.findall(text), IPV4.findall(text)
    assert "<loopback-ip-" in text
    full = report(a, "--full")
    assert "127.0.0.1" in full
    assert "/ip4/127.0.0.1/tcp/" in full
