"""The chat page's Swarm column, driven by Playwright in headless Chromium.

A two-model swarm in real node processes: A serves a tiny random Llama from its folder;
`other` is the same weights sharded in two, held by `half` (layers 0:2) and by `whole`
(0:4, short-lived records). A's page draws one card per model, a lane per holder with its
short id, and no gap; `whole` killed, its records expire and the card names "gap 2:4".
With /api/peers refused the layers still show, and the column polls only while open.
Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Page, expect

from tests.browser import test_chat_page as chat_page
from tests.conftest import NodeProcess, running_node, start_node, wait_until

pytestmark = pytest.mark.e2e

# The chat page's fixtures (Debian's Chromium, a fresh context per test), shared by name.
playwright = chat_page.playwright
browser = chat_page.browser
page = chat_page.page
ARTIFACTS = chat_page.ARTIFACTS

OTHER = "other"
CLOCK_START_S = 1_700_000_000  # the page's fake clock (epoch seconds), any fixed time
GAP_TIMEOUT_MS = 90_000  # record TTL 5 s, plus lookups that may wait on the dead peer


@pytest.fixture(scope="module")
def other_shards(tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_chat_dir` (4 layers) sharded 0:2 and 2:4 under the id `other`."""
    out = tmp_path_factory.mktemp("swarm-view-shards") / "shards"
    cmd = [sys.executable, "-m", "swarmd", "shard", str(tiny_chat_dir), "--stages", "2"]
    cmd += ["--out", str(out), "--model-id", OTHER]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def a(tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    args = ["--model", str(tiny_chat_dir), "--torch-threads", "1"]
    with running_node(tmp_path_factory, "sv-a", args) as node:
        yield node


@pytest.fixture(scope="module")
def half(
    other_shards: Path, a: NodeProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    args = ["--model", str(other_shards), "--layers", "0:2", "--torch-threads", "1"]
    with running_node(tmp_path_factory, "sv-half", [*args, "--bootstrap", a.p2p_addrs[0]]) as node:
        yield node


def listed(node: NodeProcess) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in node.get_json("/v1/models")["data"]}  # type: ignore[union-attr]


def holder_ranges(node: NodeProcess, model: str) -> dict[str, list[int]]:
    entry = listed(node).get(model)
    return {} if entry is None else {h["peer_id"]: h["layers"] for h in entry["swarm"]["holders"]}


def short_id(node: NodeProcess) -> str:
    return str(node.health()["peer_id"])[-8:]


def rtt_known(node: NodeProcess, peer_id: str) -> bool:
    rows = node.get_json("/api/peers")["peers"]  # type: ignore[index]
    return any(r["peer_id"] == peer_id and r["rtt_ms"] is not None for r in rows)  # type: ignore[union-attr]


def test_the_swarm_view_draws_every_model_and_names_a_gap(
    a: NodeProcess, half: NodeProcess, other_shards: Path, tmp_path: Path, page: Page
) -> None:
    config = tmp_path / "short.toml"
    config.write_text("record_ttl_s = 5.0\nrepublish_interval_s = 2.0\n")
    args = ["--port", "0", "--p2p-port", "0", "--data-dir", str(tmp_path / "data")]
    args += ["--model", str(other_shards), "--torch-threads", "1", "--config", str(config)]
    whole = start_node([*args, "--bootstrap", a.p2p_addrs[0]], tmp_path)
    try:
        whole_id, half_id = str(whole.health()["peer_id"]), str(half.health()["peer_id"])
        want = {half_id: [0, 2], whole_id: [0, 4]}
        assert wait_until(lambda: holder_ranges(a, OTHER) == want, 60, 0.5), listed(a)
        assert wait_until(lambda: rtt_known(a, whole_id), 60, 0.5), a.get_json("/api/peers")

        page.goto(f"{a.url}/")
        expect(page.locator("#model option")).to_have_count(2, timeout=30_000)
        page.click("[data-panel=swarm]")
        expect(page.locator("#side-title")).to_have_text("Swarm")
        expect(page.locator(".swarm-model")).to_have_count(2)
        own = page.locator(f'.swarm-model[data-model="{a.model_id}"]')
        expect(own.locator(".badge")).to_have_text("routable")
        expect(own.locator(".lane.holder .lane-label")).to_have_text([short_id(a)])
        expect(own.locator(".lane.holder .lane-rtt")).to_have_text(["this node"])
        expect(own.locator(".swarm-summary")).to_contain_text("every layer is served")

        card = page.locator(f'.swarm-model[data-model="{OTHER}"]')
        expect(card.locator(".badge")).to_have_text("routable")
        lanes = card.locator(".lane.holder")
        # Overlapping holders get a lane each, by start then end: half (0:2), whole (0:4).
        expect(lanes.locator(".lane-label")).to_have_text([half_id[-8:], whole_id[-8:]])
        expect(lanes.locator(".seg")).to_have_text(["0:2", "0:4"])
        expect(card.locator(".swarm-summary")).to_contain_text("4 layers · 2 holders")
        expect(card.locator(".swarm-summary")).to_contain_text("every layer is served")
        expect(card.locator(".seg.gap")).to_have_count(0)
        hover = re.compile(rf"^{whole_id[-8:]} · layers 0:4 · RTT \d+\.\d ms")
        expect(lanes.nth(1)).to_have_attribute("title", hover)
        expect(lanes.nth(1).locator(".lane-rtt")).to_contain_text(" ms")
        # Drawn to scale, each peer in its own colour.
        track = lanes.nth(1).locator(".track").bounding_box()
        seg_half = lanes.nth(0).locator(".seg").bounding_box()
        seg_whole = lanes.nth(1).locator(".seg").bounding_box()
        assert track and seg_half and seg_whole
        assert abs(seg_whole["width"] - track["width"]) < 2
        assert abs(seg_half["width"] - track["width"] / 2) < 2
        colours = lanes.locator(".seg").evaluate_all(
            "segs => segs.map(s => getComputedStyle(s).backgroundColor)"
        )
        assert colours[0] != colours[1], colours
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "swarm-view.png"), full_page=True)

        whole.proc.kill()  # no withdrawal: the gap shows once its records expire
        whole.proc.wait(timeout=30)
        gap = card.locator(".seg.gap")
        expect(gap).to_have_text(["gap 2:4"], timeout=GAP_TIMEOUT_MS)
        expect(card.locator(".swarm-summary")).to_contain_text("1 holder · gap 2:4")
        expect(card.locator(".badge")).to_have_text("not routable")
        expect(lanes.locator(".lane-label")).to_have_text([half_id[-8:]])
        gap_box, track = gap.bounding_box(), lanes.nth(0).locator(".track").bounding_box()
        assert gap_box and track and abs(gap_box["x"] - (track["x"] + track["width"] / 2)) < 2
        # The picker follows: `other` is listed, not pickable, the reason in its text.
        option = page.locator(f'#model option[value="{OTHER}"]')
        expect(option).to_be_disabled()
        expect(option).to_contain_text("missing layers 2:4")
        page.screenshot(path=str(ARTIFACTS / "swarm-view-gap.png"), full_page=True)
    finally:
        whole.stop()


def test_the_swarm_view_without_peer_details_polls_only_while_open(
    a: NodeProcess, half: NodeProcess, page: Page
) -> None:
    """/api/peers refused (403, as with an infer-scope token): layers shown, RTTs not."""
    half_id = str(half.health()["peer_id"])
    assert wait_until(lambda: holder_ranges(a, OTHER) == {half_id: [0, 2]}, 60, 0.5), listed(a)
    refused = {
        "error": {
            "message": "/api/peers needs an admin-scope token",
            "type": "permission_error",
            "param": None,
            "code": "insufficient_scope",
        }
    }
    page.route(
        "**/api/peers",
        lambda route: route.fulfill(
            status=403, content_type="application/json", body=json.dumps(refused)
        ),
    )
    # What the page asked, in order. Playwright's sync API delivers these events only
    # while the test is inside one of its calls: waits below are `expect_*`, not polls.
    paths: list[str] = []
    page.on("request", lambda r: paths.append(urlsplit(r.url).path))

    def peers_asked() -> int:
        return paths.count("/api/peers")

    # The page's timers fire only when the test moves its clock (install alone lets it run).
    page.clock.install(time=CLOCK_START_S)
    page.clock.pause_at(CLOCK_START_S + 1)
    page.goto(f"{a.url}/")
    expect(page.locator("#model option")).to_have_count(2, timeout=30_000)
    assert peers_asked() == 0  # closed: never asked
    page.click("[data-panel=swarm]")
    expect(page.locator("#swarm-note")).to_contain_text("admin-scope token")
    card = page.locator(f'.swarm-model[data-model="{OTHER}"]')
    expect(card.locator(".seg.gap")).to_have_text(["gap 2:4"], timeout=30_000)
    lane = card.locator(".lane.holder")
    expect(lane.locator(".lane-label")).to_have_text([half_id[-8:]])
    expect(lane).to_have_attribute("title", f"{half_id[-8:]} · layers 0:2 · RTT unavailable")
    expect(page.locator("#token-ask")).to_be_hidden()  # a 403 here is no reason to nag
    assert peers_asked() == 1

    def idle() -> None:  # polled from here: the page's own frames wait on the paused clock
        assert wait_until(lambda: not page.evaluate("state.swarmBusy"), 60, 0.1)

    idle()
    with page.expect_request("**/api/peers", timeout=30_000):
        page.clock.run_for(3_100)  # one refresh period
    idle()
    page.click("[data-panel=swarm]")  # closed again
    expect(page.locator("#panel-swarm")).to_be_hidden()
    with page.expect_request("**/v1/models", timeout=30_000):
        page.clock.run_for(16_000)  # past the page's 15 s model refresh: five swarm periods
    assert peers_asked() == 2, paths
