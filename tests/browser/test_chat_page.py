"""The chat page at "/", driven by Playwright in headless Chromium (Debian's `chromium`).

Against a real node serving the embedded model: pick the model, send with Enter, see the
streamed reply and its speed line, Stop a long reply (the node stops generating), reload
and find the chat, Retry a failed reply, the Performance column. Against a three-node
swarm: an incomplete model cannot be picked, then the reply's route has three stages.
A screenshot after a reply is saved to test-artifacts/.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Playwright, expect, sync_playwright

from tests.conftest import NodeProcess, running_node, start_node, wait_until

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root in a container, without the background services Chromium would try to reach.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
REPLY_TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    try:
        yield browser
    finally:
        browser.close()


@pytest.fixture()
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    try:
        yield page
    finally:
        context.close()


def set_setting(page: Page, field: str, value: str) -> None:
    if page.locator("#panel-settings").is_hidden():
        page.click("[data-panel=settings]")
    page.fill(field, value)
    page.press(field, "Tab")  # `change` fires when the field loses focus


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_chat_on_one_node(embedded_node: NodeProcess, page: Page) -> None:
    page.goto(f"{embedded_node.url}/")
    expect(page.locator("#model-status")).to_have_text("ready", timeout=30_000)
    assert page.locator("#model").input_value() == "smollm2-135m-instruct"
    set_setting(page, "#set-temperature", "0")
    set_setting(page, "#set-max-tokens", "24")
    expect(page.locator("#api-base")).to_have_text(f"{embedded_node.url}/v1")
    page.click("[data-panel=settings]")  # hide the column again

    # Shift+Enter is a new line, not a send.
    page.fill("#prompt", "line one")
    page.press("#prompt", "Shift+Enter")
    page.keyboard.type("line two")
    assert page.locator("#prompt").input_value() == "line one\nline two"
    assert page.locator(".msg").count() == 0

    send(page, "What is the capital of France?")
    reply = page.locator(".msg.assistant").last
    speed = reply.locator(".speed")
    expect(speed).to_be_visible(timeout=REPLY_TIMEOUT_MS)
    expect(speed).to_contain_text("smollm2-135m-instruct")
    expect(speed).to_contain_text("tok/s")
    expect(speed).to_contain_text("TTFT")
    expect(speed).to_contain_text("route: local")
    assert "Paris" in reply.locator(".body").inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-page.png"), full_page=True)

    # The address names the chat: a reload comes back to it.
    assert "#chat=" in page.url
    page.reload()
    expect(page.locator(".msg.user .body").first).to_have_text("What is the capital of France?")
    expect(page.locator(".msg.assistant .speed")).to_be_visible()

    # New chat empties the page; Back returns to the chat.
    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    page.go_back()
    expect(page.locator(".msg.user .body").first).to_have_text("What is the capital of France?")

    page.click("[data-panel=performance]")
    cards = page.locator(".stage-card")
    expect(cards).to_have_count(1)
    expect(cards.first).to_contain_text("layers 0:30")
    expect(page.locator("#link-time")).to_contain_text("ms per token")
    page.click("[data-panel=performance]")

    # Stop during a long reply: the node stops generating.
    set_setting(page, "#set-max-tokens", "600")
    page.click("[data-panel=settings]")
    send(page, "Write a very long story about a dragon who learns to sail.")
    long_reply = page.locator(".msg.assistant").last
    expect(page.locator("#stop")).to_be_visible()
    assert wait_until(lambda: len(long_reply.locator(".body").inner_text()) > 40, 120, 0.2)
    assert embedded_node.health()["in_flight"] == 1
    page.click("#stop")
    expect(long_reply.locator(".speed")).to_contain_text("stopped")
    assert wait_until(lambda: embedded_node.health()["in_flight"] == 0, 15, 0.1)
    expect(page.locator("#send")).to_be_visible()


def test_a_failed_reply_shows_the_error_and_retries(embedded_node: NodeProcess, page: Page) -> None:
    page.goto(f"{embedded_node.url}/")
    expect(page.locator("#model-status")).to_have_text("ready", timeout=30_000)
    set_setting(page, "#set-max-tokens", "8")
    page.click("[data-panel=settings]")
    error = {
        "error": {
            "message": "No node of the swarm serves layers [10:20) of smollm2-135m-instruct",
            "type": "service_unavailable",
            "param": None,
            "code": "no_route",
        }
    }
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=503, content_type="application/json", body=json.dumps(error)
        ),
    )
    send(page, "Hello there")
    failed = page.locator(".msg.assistant").last
    expect(failed.locator(".error")).to_contain_text("503")
    expect(failed.locator(".error")).to_contain_text("layers [10:20)")
    page.unroute("**/v1/chat/completions")
    failed.get_by_role("button", name="Retry").click()
    expect(page.locator(".msg.assistant").last.locator(".speed")).to_be_visible(
        timeout=REPLY_TIMEOUT_MS
    )
    expect(page.locator(".msg.assistant .error")).to_have_count(0)

    # Chats: listed, searchable, renamable.
    page.click("[data-panel=chats]")
    items = page.locator("#chat-list .chat-item")
    expect(items.first).to_contain_text("Hello there")
    page.fill("#chat-search", "no chat has this")
    expect(page.locator("#chat-list .chat-item")).to_have_count(0)
    page.fill("#chat-search", "Hello")
    expect(items).to_have_count(1)
    items.first.get_by_role("button", name="Rename").click()
    page.fill("#chat-list .rename", "Greetings")
    page.press("#chat-list .rename", "Enter")
    expect(page.locator("#chat-list .chat-title").first).to_have_text("Greetings")
    page.on("dialog", lambda dialog: dialog.accept())
    items.first.get_by_role("button", name="Delete").click()
    expect(page.locator("#chat-list .chat-item")).to_have_count(0)
    expect(page.locator(".msg")).to_have_count(0)


def test_markdown_is_escaped_and_reasoning_collapsed(
    embedded_node: NodeProcess, page: Page
) -> None:
    page.goto(f"{embedded_node.url}/")
    html = page.evaluate(
        "(text) => Markdown.render(text)",
        "<think>first, the sum</think>The **answer**:\n```python\nprint(1 < 2)\n```\n"
        "<img src=x onerror=alert(1)> and [a link](https://example.org)",
    )
    assert '<details class="think"><summary>Reasoning</summary>' in html
    assert "<details open" not in html  # collapsed by default
    assert "<strong>answer</strong>" in html
    assert '<button type="button" class="copy-code">Copy</button>' in html
    assert "print(1 &lt; 2)" in html
    assert "<img" not in html and "&lt;img src=x" in html
    assert '<a href="https://example.org" target="_blank" rel="noopener noreferrer">' in html


def test_the_page_fits_a_phone(embedded_node: NodeProcess, browser: Browser) -> None:
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    try:
        page = context.new_page()
        page.goto(f"{embedded_node.url}/")
        expect(page.locator("#model-status")).to_have_text("ready", timeout=30_000)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the page is {width} px wide on a 390 px screen"
        expect(page.locator("#prompt")).to_be_visible()
        page.click("[data-panel=chats]")
        box = page.locator("#side").bounding_box()
        assert box is not None and box["width"] >= 380  # the column covers the screen
        page.click("#side-close")
        expect(page.locator("#side")).to_be_hidden()
    finally:
        context.close()


def test_a_three_node_swarm_in_the_page(
    tiny_shards: Path, tmp_path_factory: pytest.TempPathFactory, page: Page
) -> None:
    common = ["--model", str(tiny_shards), "--torch-threads", "1"]
    with running_node(tmp_path_factory, "pa", [*common, "--layers", "0:2"]) as a:
        boot = ["--bootstrap", a.p2p_addrs[0]]
        with running_node(tmp_path_factory, "pb", [*common, "--layers", "2:3", *boot]):
            page.goto(f"{a.url}/")
            # Layers 3:4 are served by nobody: listed, not pickable, the reason shown.
            expect(page.locator("#model-status")).to_have_text("incomplete", timeout=30_000)
            option = page.locator("#model option").first
            expect(option).to_be_disabled()
            expect(option).to_contain_text("missing layers 3:4")
            expect(page.locator("#model-reason")).to_contain_text("missing layers 3:4")
            with running_node(tmp_path_factory, "pc", [*common, "--layers", "3:4", *boot]):

                def routable() -> bool:
                    entry = a.get_json("/v1/models")["data"][0]  # type: ignore[index]
                    return bool(entry["swarm"]["routable"])

                assert wait_until(routable, 60, 0.5)
                page.reload()
                expect(page.locator("#model-status")).to_have_text("ready", timeout=30_000)
                set_setting(page, "#set-max-tokens", "6")
                page.click("[data-panel=settings]")
                send(page, "Say something.")
                speed = page.locator(".msg.assistant").last.locator(".speed")
                expect(speed).to_contain_text("3 stages", timeout=REPLY_TIMEOUT_MS)
                expect(speed).to_contain_text("route: distributed")
                page.click("[data-panel=performance]")
                cards = page.locator(".stage-card")
                expect(cards).to_have_count(3)
                for i, layers in enumerate(("0:2", "2:3", "3:4")):
                    expect(cards.nth(i)).to_contain_text(f"layers {layers}")
                expect(page.locator("#link-time")).to_contain_text("per hop")


def test_the_page_asks_for_a_token_when_the_node_needs_one(
    browser: Browser, tmp_path_factory: pytest.TempPathFactory, test_cache_dir: Path
) -> None:
    from swarmd.api.tokens import TokenStore

    workdir = tmp_path_factory.mktemp("token-node")
    _, token = TokenStore(workdir / "data").create("page", "infer")
    args = ["--port", "0", "--p2p-port", "0", "--data-dir", str(workdir / "data")]
    node = start_node([*args, "--cache-dir", str(test_cache_dir)], workdir)
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    try:
        page = context.new_page()
        page.goto(f"{node.url}/")  # the page itself is open; its API calls are not
        expect(page.locator("#token-ask")).to_be_visible(timeout=30_000)
        expect(page.locator("#model-status")).to_have_text("needs a token")
        page.fill("#token-input", token[:-3] + "bad")
        page.press("#token-input", "Enter")
        expect(page.locator("#token-why")).to_contain_text("refused", timeout=30_000)
        page.fill("#token-input", token)
        page.press("#token-input", "Enter")
        expect(page.locator("#model-status")).to_have_text("ready", timeout=30_000)
        expect(page.locator("#token-ask")).to_be_hidden()
        set_setting(page, "#set-max-tokens", "4")
        page.click("[data-panel=settings]")
        send(page, "Hello")
        expect(page.locator(".msg.assistant .speed").last).to_be_visible(timeout=REPLY_TIMEOUT_MS)
        assert token not in node.log_text()  # the token never reaches the node's log
    finally:
        context.close()
        node.stop()
