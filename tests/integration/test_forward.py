"""`/swarmd/forward/1` between two real libp2p hosts on 127.0.0.1 (trio).

The holder's API is stood in for by `execute` functions (the e2e tests run the real one):
a response streams through in order; the caps answer 503 without a ban; a requester that
sends garbage is banned by the holder, a holder that sends garbage is refused by the
requester (MalformedFrameError naming it); a requester gone mid-reply cancels `execute`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from swarmd.errors import MalformedFrameError
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity
from swarmd.transfer.forward import (
    END_FRAME,
    FORWARD_PROTOCOL,
    Deliver,
    ForwardLimits,
    ForwardService,
    data_frame,
    forward,
    head_frame,
)

LIMITS = ForwardLimits(max_body_bytes=1024, max_forwards=3, max_peer_forwards=2, first_s=10.0)
BODY = b'{"model": "m", "messages": []}'
BANNED = trio.Event()  # set on the first ban; each test runs in its own trio.run


def setup_function() -> None:
    global BANNED
    BANNED = trio.Event()


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[P2PHost, P2PHost, list[tuple[str, str]]]]:
    """A holder and a requester, connected; the holder's bans are recorded."""
    bans: list[tuple[str, str]] = []

    async def ban(peer_id: str, why: str) -> None:
        bans.append((peer_id, why))
        BANNED.set()

    async with (
        open_host(Identity.generate(), 0) as holder,
        open_host(Identity.generate(), 0) as requester,
    ):
        holder.misbehaved = ban
        await requester.connect(holder.addrs[0])
        yield holder, requester, bans


async def collect(requester: P2PHost, holder: P2PHost, path: str = "/v1/completions") -> list[Any]:
    got: list[dict[str, Any]] = []
    await forward(requester, holder.peer_id, path, BODY, got.append, LIMITS)
    return got


def test_a_response_streams_through_in_order_with_only_the_passed_headers() -> None:
    seen: list[tuple[str, bytes]] = []

    async def execute(path: str, body: bytes, peer_id: str, deliver: Deliver) -> None:
        seen.append((path, body))
        headers = {"Content-Type": "text/event-stream", "X-Swarm-Route": "local", "Set-Cookie": "x"}
        deliver(head_frame(200, headers))
        for i in range(5):
            await trio.sleep(0.01)
            deliver(data_frame(f"data: {i}\n\n".encode()))
        deliver(END_FRAME)

    async def main() -> None:
        async with pair() as (holder, requester, bans):
            ForwardService(holder, execute, LIMITS)
            got = await collect(requester, holder)
            assert got[0] == {
                "t": "head",
                "status": 200,
                "headers": {"content-type": "text/event-stream", "x-swarm-route": "local"},
            }
            assert [f["data"] for f in got[1:-1]] == [f"data: {i}\n\n".encode() for i in range(5)]
            assert got[-1] == END_FRAME
            assert seen == [("/v1/completions", BODY)] and bans == []

    trio.run(main)


def test_requests_over_the_caps_get_a_503_and_no_ban() -> None:
    release, both_running = trio.Event(), trio.Event()
    running: list[str] = []

    async def execute(path: str, body: bytes, peer_id: str, deliver: Deliver) -> None:
        deliver(head_frame(200, {"content-type": "application/json"}))
        running.append(peer_id)
        if len(running) == LIMITS.max_peer_forwards:
            both_running.set()
        await release.wait()
        deliver(END_FRAME)

    async def main() -> None:
        async with pair() as (holder, requester, bans):
            service = ForwardService(holder, execute, LIMITS)
            results: list[list[Any]] = []

            async def one() -> None:
                results.append(await collect(requester, holder))

            async with trio.open_nursery() as nursery:
                for _ in range(LIMITS.max_peer_forwards):
                    nursery.start_soon(one)
                with trio.fail_after(10):
                    await both_running.wait()
                assert service.in_flight == LIMITS.max_peer_forwards
                over = await collect(requester, holder)  # this peer's third at once
                assert over[0]["status"] == 503
                assert over[0]["headers"]["retry-after"] == "2"  # a client's cue to retry
                error = json.loads(over[1]["data"])["error"]
                assert "as many forwarded requests" in error["message"]
                assert (error["type"], error["code"]) == ("service_unavailable", "forward_busy")
                release.set()
            assert [r[0]["status"] for r in results] == [200, 200]
            assert bans == []

    trio.run(main)


@pytest.mark.parametrize(
    "frame",
    [
        {"path": "/api/admin/diagnostics", "body": BODY},  # not a forwarded path
        {"path": "/v1/completions", "body": b"x" * 2048},  # over the body limit
        {"path": "/v1/completions", "body": "text"},  # not bytes
        {"path": "/v1/completions"},  # no body
    ],
)
def test_a_requester_sending_garbage_is_banned_by_the_holder(frame: dict[str, Any]) -> None:
    async def execute(path: str, body: bytes, peer_id: str, deliver: Deliver) -> None:
        raise AssertionError("a bad request never runs")

    async def main() -> None:
        async with pair() as (holder, requester, bans):
            ForwardService(holder, execute, LIMITS)
            stream = await requester.open_stream(holder.peer_id, FORWARD_PROTOCOL)
            await stream.send(frame)
            with trio.fail_after(10):
                await BANNED.wait()
            assert bans[0][0] == requester.peer_id
            assert FORWARD_PROTOCOL in bans[0][1]

    trio.run(main)


@pytest.mark.parametrize(
    "frames",
    [
        [{"t": "data", "data": b"x"}],  # data before a head
        [{"t": "head", "status": 99, "headers": {}}],  # no HTTP status
        [{"t": "head", "status": 200, "headers": {"a": 1}}],  # a header that is no string
        [head_frame(200, {}), {"t": "head", "status": 200, "headers": {}}],  # two heads
        [head_frame(200, {}), {"t": "data", "data": "text"}],  # data that is no bytes
    ],
)
def test_a_holder_sending_garbage_is_refused_naming_it(frames: list[dict[str, Any]]) -> None:
    async def main() -> None:
        async with pair() as (holder, requester, _):

            async def hostile(stream: Any) -> None:
                await stream.recv(5.0)
                for frame in frames:
                    await stream.send(frame)
                await trio.sleep(5)

            holder.set_handler(FORWARD_PROTOCOL, hostile)
            with pytest.raises(MalformedFrameError) as caught:
                await collect(requester, holder)
            assert caught.value.peer_id == holder.peer_id

    trio.run(main)


def test_a_requester_gone_mid_reply_cancels_the_request_on_the_holder() -> None:
    cancelled = trio.Event()
    started = trio.Event()

    async def execute(path: str, body: bytes, peer_id: str, deliver: Deliver) -> None:
        deliver(head_frame(200, {"content-type": "text/event-stream"}))
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async def main() -> None:
        async with pair() as (holder, requester, bans):
            ForwardService(holder, execute, LIMITS)
            with trio.move_on_after(30) as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(collect, requester, holder)
                    await started.wait()
                    nursery.cancel_scope.cancel()  # the requester's client went away
                with trio.fail_after(10):
                    await cancelled.wait()
            assert not scope.cancelled_caught
            assert bans == []

    trio.run(main)


def test_every_reply_arrives_whole_before_the_stream_ends() -> None:
    """The holder waits for the requester to close before it lets go of the stream: a
    reset right after `end` could drop the last frames still in flight. A requester
    that reads its reply late (a loaded machine) still gets every frame."""

    async def execute(path: str, body: bytes, peer_id: str, deliver: Deliver) -> None:
        deliver(head_frame(200, {"content-type": "text/event-stream"}))
        for i in range(20):
            deliver(data_frame(b"x" * 2000 + str(i).encode()))
        deliver(END_FRAME)

    async def main() -> None:
        async with pair() as (holder, requester, bans):
            ForwardService(holder, execute, LIMITS)
            for _ in range(40):
                got = await collect(requester, holder)
                assert len(got) == 22 and got[-1] == END_FRAME
            for _ in range(3):
                stream = await requester.open_stream(holder.peer_id, FORWARD_PROTOCOL)
                await stream.send({"path": "/v1/completions", "body": BODY})
                await trio.sleep(0.5)  # the holder has sent everything by now
                late = [await stream.recv(5.0) for _ in range(22)]
                assert late[-1] == END_FRAME
                await stream.close()
            assert bans == []

    trio.run(main)
