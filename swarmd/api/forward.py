"""Forwarded requests, the API's side of `transfer.forward` (asyncio).

- `forward_reply`: this node cannot route the model a request names (it is served only
  from a GGUF file or a Hugging Face folder), so the request goes, body as the client sent
  it, to a node holding the model whole; its response comes back as it is written, with
  `x-swarm-route: forwarded` and `x-swarm-nodes` naming the holder.
- `LoopbackExecutor`: the holder's end. A peer's forwarded request runs through this
  node's own API over loopback, as a local client's would (every check, admission, the
  DIAG line); it carries a secret made at start-up (`FORWARD_HEADER`) in place of an API
  token: swarm peers may use a node's model, as they may use its stage protocol, and a
  forwarded request is never forwarded again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from swarmd.dht.records import NodeRecord
from swarmd.errors import ClientDisconnectedError, FrameError, PeerError, SwarmError
from swarmd.net.bridge import call_on_loop
from swarmd.pipeline.report import RequestRecord, ms
from swarmd.transfer.forward import (
    END_FRAME,
    FORWARD_BUSY_HEADER,
    MAX_CHUNK_BYTES,
    Deliver,
    data_frame,
    error_frames,
    head_frame,
)

log = logging.getLogger(__name__)

FORWARD_HEADER = "X-Swarmd-Forward"  # the loopback request's secret, instead of a token


class ForwardAccess(Protocol):
    """What the requester's side needs of its node."""

    async def forward_to(self, peer_id: str, path: str, body: bytes, deliver: Deliver) -> None:
        """Run `transfer.forward.forward` to `peer_id` (trio side), delivering frames."""
        ...

    async def ban(self, peer_id: str, reason: str) -> None: ...


def is_forwarded(request: web.Request, secret: str) -> bool:
    """Whether `request` is a peer's forwarded request, run here over loopback."""
    presented = request.headers.get(FORWARD_HEADER)
    return presented is not None and secrets.compare_digest(presented, secret)


async def forward_reply(
    request: web.Request,
    node: ForwardAccess,
    holders: list[NodeRecord],
    body: bytes,
    request_id: str,
    model: str,
    report: Callable[[RequestRecord], None],
) -> web.StreamResponse:
    """Send the request to the first of `holders` (nearest first) and write its response
    here as it comes; a holder at its forward caps (`forward_busy`) hands it to the next.
    A holder that breaks the protocol is banned; one that goes away before its head is a
    503 (a PeerError), after it an error event (a stream) or a cut response."""
    started = time.monotonic()
    rest = list(holders)
    holder = rest.pop(0)
    frames: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
    task = _start(node, holder, request.path, body, frames)
    response: web.StreamResponse | None = None
    first_data: float | None = None
    error: BaseException | None = None
    try:
        while True:
            frame = await frames.get()
            if isinstance(frame, BaseException):
                raise frame
            kind = frame["t"]
            if kind == "head" and rest and FORWARD_BUSY_HEADER in frame["headers"]:
                log.info("forward: %s is at its caps, trying the next", holder.peer_id[-8:])
                await _stop(task)
                holder = rest.pop(0)
                frames = asyncio.Queue()  # the busy answer's rest is left behind
                task = _start(node, holder, request.path, body, frames)
                continue
            if kind == "head":
                headers = dict(frame["headers"])
                headers["x-swarm-route"] = "forwarded"
                headers["x-swarm-nodes"] = holder.peer_id[-8:]
                # This node's id, which its DIAG line logs; the holder's logs its own.
                holder_id = headers.pop("x-swarm-request-id", None)
                headers["x-swarm-request-id"] = request_id
                if holder_id is not None:
                    headers["x-swarm-holder-request-id"] = holder_id
                response = web.StreamResponse(status=frame["status"], headers=headers)
                if not await _to_client(response.prepare(request)):
                    error = ClientDisconnectedError("The client closed the connection")
                    return response
            elif kind == "data" and response is not None:
                first_data = first_data or time.monotonic()
                if not await _to_client(response.write(frame["data"])):
                    error = ClientDisconnectedError("The client closed the stream mid-reply")
                    return response  # the holder's request ends with the task's cancel
            elif kind == "end" and response is not None:
                # Clients close as soon as they read `[DONE]`: the reply was whole anyway.
                await _to_client(response.write_eof())
                return response
    except FrameError as exc:
        error = exc
        short = holder.peer_id[-8:]
        await node.ban(holder.peer_id, f"bad frame on a forwarded reply: {exc}")
        return await _broken(request, response, f"node {short} sent a bad reply; it is banned")
    except (PeerError, SwarmError) as exc:
        error = exc
        if response is None:
            raise
        why = f"node {holder.peer_id[-8:]} went away mid-reply: {exc}"
        return await _broken(request, response, why)
    except BaseException as exc:
        error = exc
        raise
    finally:
        await _stop(task)
        total = time.monotonic() - started
        report(
            RequestRecord(
                request_id=request_id,
                model=model,
                route="forwarded",
                nodes=[holder.peer_id[-8:]],
                outcome="ok" if error is None else "error",
                error_type=None if error is None else type(error).__name__,
                ttft_ms=ms(first_data - started) if first_data is not None else None,
                total_ms=ms(total),
            )
        )


def _start(
    node: ForwardAccess,
    holder: NodeRecord,
    path: str,
    body: bytes,
    frames: asyncio.Queue[dict[str, Any] | BaseException],
) -> asyncio.Task[None]:
    """Forward to `holder`, its frames (or its error) put on `frames`."""

    loop = asyncio.get_running_loop()

    def deliver(frame: dict[str, Any]) -> None:
        # Called in the trio thread; the queue is the loop's (FIFO, so frames keep order).
        call_on_loop(loop, frames.put_nowait, frame)

    async def run() -> None:
        try:
            await node.forward_to(holder.peer_id, path, body, deliver)
        except Exception as exc:  # handed to the writer, which raises it
            frames.put_nowait(exc)

    return asyncio.create_task(run())


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _broken(
    request: web.Request, response: web.StreamResponse | None, why: str
) -> web.StreamResponse:
    """End a forwarded response that broke: an error event for a stream begun, else a 502."""
    body = {"error": {"message": why, "type": "server_error", "param": None, "code": None}}
    if response is None:
        return web.json_response(body, status=502)
    if response.content_type == "text/event-stream":
        event = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
        if not await _to_client(response.write(event.encode())):
            return response
    await _to_client(response.write_eof())
    return response


async def _to_client(write: Awaitable[object]) -> bool:
    """Write to the client; False when it has closed the connection (nobody to tell)."""
    try:
        await write
    except ConnectionResetError:
        return False
    return True


class LoopbackExecutor:
    """The holder's end: runs a peer's forwarded request on this node's own API."""

    def __init__(self, api_url: Callable[[], str], timeout_s: float) -> None:
        self.secret = secrets.token_urlsafe(32)
        self._api_url = api_url
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def execute(self, path: str, body: bytes, peer_id: str, deliver: Deliver) -> None:
        """Run the request; deliver its head, its body as it is written, then `end`. This
        node's own failure to answer is a 503 in OpenAI's shape, never silence."""
        session = self._session
        if session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_read=self._timeout_s)
            session = self._session = aiohttp.ClientSession(timeout=timeout)
        headers = {
            FORWARD_HEADER: self.secret,
            "Content-Type": "application/json",
            "X-Swarm-Forwarded-For": peer_id[-8:],
        }
        headed = False
        try:
            async with session.post(self._api_url() + path, data=body, headers=headers) as reply:
                deliver(head_frame(reply.status, dict(reply.headers)))
                headed = True
                async for chunk in reply.content.iter_any():
                    for start in range(0, len(chunk), MAX_CHUNK_BYTES):
                        deliver(data_frame(bytes(chunk[start : start + MAX_CHUNK_BYTES])))
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("a forwarded request from %s failed here: %s", peer_id[-8:], exc)
            if not headed:
                for frame in error_frames(503, "the holder could not answer", "server_error"):
                    deliver(frame)
                return
        deliver(END_FRAME)  # after a cut body too: the requester sees a short response
