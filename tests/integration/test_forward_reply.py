"""`forward_reply`, the requester's API side of a forwarded request (asyncio, aiohttp on
127.0.0.1), with the holder stood in for by a fake `forward_to`.

Clients (the openai library among them) close the connection as soon as they read
`data: [DONE]`; the end of the response, or the rest of a reply whose client left,
then has nobody to go to. That is no error of the node: no traceback, nobody banned, and
the DIAG line says ok for a whole reply (found by a stress run: a light node logged
"unhandled error" for every such reply).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from swarmd.api.errors import Handler
from swarmd.api.forward import forward_reply
from swarmd.pipeline.report import RequestRecord
from swarmd.transfer.forward import (
    END_FRAME,
    FORWARD_BUSY,
    Deliver,
    data_frame,
    error_frames,
    head_frame,
)
from tests.unit.test_route import record

HOLDER = "12D3KooWHOLDERxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
DONE = b"data: [DONE]\n\n"
HOLDER_ID = {"X-Swarm-Request-Id": "holders-id"}


class FakeNode:
    """Streams a head and `chunks`, then waits until the test's client has closed its
    connection, then sends `after` (more data, or the end)."""

    def __init__(self, chunks: list[bytes], after: list[dict[str, Any]]) -> None:
        self.chunks, self.after = chunks, after
        self.client_closed = asyncio.Event()
        self.bans: list[str] = []
        self.cancelled = False

    async def forward_to(self, peer_id: str, path: str, body: bytes, deliver: Deliver) -> None:
        deliver(head_frame(200, {"Content-Type": "text/event-stream", **HOLDER_ID}))
        for chunk in self.chunks:
            deliver(data_frame(chunk))
        await self.client_closed.wait()
        await asyncio.sleep(0.05)  # the server side sees the close too
        for frame in self.after:
            deliver(frame)
        try:
            await asyncio.sleep(5.0)  # a holder still streaming: cancelled when not wanted
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    async def ban(self, peer_id: str, reason: str) -> None:
        self.bans.append(peer_id)


async def _serve_and_read(node: FakeNode, until: bytes) -> tuple[bytes, list[RequestRecord]]:
    reports: list[RequestRecord] = []
    reported = asyncio.Event()
    holder = record(HOLDER, 0, 30, 100.0)

    def report(line: RequestRecord) -> None:
        reports.append(line)
        reported.set()

    async def handler(request: web.Request) -> web.StreamResponse:
        return await forward_reply(request, node, [holder], b"{}", "r1", "m", report)

    async with serving(handler) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
        )
        got = b""
        while until not in got:
            got += await asyncio.wait_for(reader.read(4096), 5.0)
        writer.close()  # as a client does once it has read [DONE]
        await writer.wait_closed()
        node.client_closed.set()
        await asyncio.wait_for(reported.wait(), 5.0)
        return got, reports


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[int]:
    """`handler` at POST /v1/chat/completions on 127.0.0.1; its port."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


def test_a_client_closing_at_done_leaves_a_whole_reply_logged_ok(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = FakeNode([b"data: {}\n\n", DONE], [END_FRAME])
    with caplog.at_level(logging.WARNING):
        got, reports = asyncio.run(_serve_and_read(node, DONE))
    assert got.startswith(b"HTTP/1.1 200") and DONE in got
    # The id this node's DIAG line logs, and the holder's beside it.
    head = got.split(b"\r\n\r\n")[0].lower()
    assert b"\r\nx-swarm-request-id: r1\r\n" in head
    assert b"\r\nx-swarm-holder-request-id: holders-id" in head
    assert [(r.outcome, r.error_type) for r in reports] == [("ok", None)]
    assert node.bans == [] and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_gone_mid_reply_ends_the_holders_request_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = FakeNode([b"data: {}\n\n"], [data_frame(b"data: {}\n\n")] * 3 + [END_FRAME])
    with caplog.at_level(logging.WARNING):
        got, reports = asyncio.run(_serve_and_read(node, b"data: {}"))
    assert got.startswith(b"HTTP/1.1 200")
    assert [(r.outcome, r.error_type) for r in reports] == [("error", "ClientDisconnectedError")]
    assert node.bans == [] and node.cancelled
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class CappedHolders:
    """Holders by peer id: `busy` ones answer as a holder at its forward caps does; the
    others answer one short reply. Records which were asked."""

    def __init__(self, busy: set[str], code: str = FORWARD_BUSY) -> None:
        self.busy, self.code = busy, code
        self.asked: list[str] = []

    async def forward_to(self, peer_id: str, path: str, body: bytes, deliver: Deliver) -> None:
        self.asked.append(peer_id)
        if peer_id in self.busy:
            for frame in error_frames(503, "at its caps", "x", self.code, 2):
                deliver(frame)
            return
        deliver(head_frame(200, {"Content-Type": "application/json"}))
        deliver(data_frame(b'{"served_by": "%s"}' % peer_id.encode()))
        deliver(END_FRAME)

    async def ban(self, peer_id: str, reason: str) -> None:
        raise AssertionError(f"nobody is banned for being busy: {peer_id}")


async def _forward_once(node: CappedHolders, peers: list[str]) -> tuple[int, dict[str, Any]]:
    reports: list[RequestRecord] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        holders = [record(p, 0, 30, 100.0) for p in peers]
        return await forward_reply(request, node, holders, b"{}", "r1", "m", reports.append)

    async with (
        serving(handler) as port,
        aiohttp.ClientSession() as http,
        http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}) as reply,
    ):
        return reply.status, await reply.json()


def test_a_holder_at_its_forward_caps_hands_the_request_to_the_next() -> None:
    """A light node forwarded only to the nearest whole holder, and a busy one's 503 was
    the client's, while another holder idled (found by a stress run)."""
    node = CappedHolders(busy={"near", "mid"})
    status, reply = asyncio.run(_forward_once(node, ["near", "mid", "far"]))
    assert (status, reply, node.asked) == (200, {"served_by": "far"}, ["near", "mid", "far"])
    # Every holder at its caps: the last one's 503 is the client's, as it was sent.
    node = CappedHolders(busy={"near", "far"})
    status, reply = asyncio.run(_forward_once(node, ["near", "far"]))
    assert status == 503 and reply["error"]["code"] == FORWARD_BUSY
    # Another 503 (the holder's own queue is full, say) is the holder's answer: passed on.
    node = CappedHolders(busy={"near"}, code="queue_full")
    status, reply = asyncio.run(_forward_once(node, ["near", "far"]))
    assert (status, reply["error"]["code"], node.asked) == (503, "queue_full", ["near"])
