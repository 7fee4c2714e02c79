"""Forwarded API requests over `/swarmd/forward/1` (trio side, both ends).

A node asked for a model it cannot route (served only from a GGUF file or a Hugging Face
folder: no manifest, so no tokenizer to take by content id) forwards the request to a
node holding that model whole. One stream per request:

    -> {"path": "/v1/chat/completions", "body": <the request body, as the client sent it>}
    <- {"t": "head", "status": 200, "headers": {"content-type": ..., "x-swarm-...": ...}}
    <- {"t": "data", "data": <bytes>}      (as the holder's API writes them: SSE stays SSE)
    <- {"t": "end"}

The holder runs the body through its own API as a client of its own would (validation,
admission, the DIAG line: `execute`), and streams the response back as it is written.
Forwards in flight are capped per peer and in all (over a cap: a 503 head, no ban); the
body is capped at the API's own limit. A frame outside this shape is a bad frame: a
holder that sends one is banned by the caller, a requester by the host (it raised a
FrameError in the handler). A request refused for what it asked (a 4xx) is the holder's
answer, passed on as it is: nobody is banned for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from swarmd.errors import MalformedFrameError, StreamClosedError
from swarmd.net.frames import FrameStream
from swarmd.net.host import P2PHost
from swarmd.untrusted import Bytes, Choice, Int, Map, Schema, Str

log = logging.getLogger(__name__)

FORWARD_PROTOCOL = "/swarmd/forward/1"
FORWARD_SINCE = (0, 3)  # the first swarmd version serving it (records name theirs)
FORWARDED_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_CHUNK_BYTES = 1 << 20  # one data frame; the holder's writes are far smaller
# The response headers a holder may pass on: what the client needs, nothing that would
# let a peer set cookies, redirect or change the connection.
PASSED_HEADERS = frozenset({"content-type", "cache-control", "retry-after"})
PASSED_PREFIX = "x-swarm-"
FORWARD_BUSY = "forward_busy"  # the error code of a holder at its forward caps
# ... also said in the head, so a requester can try another holder without the body
FORWARD_BUSY_HEADER = "x-swarm-forward-busy"

Deliver = Callable[[dict[str, Any]], None]
"""`deliver(frame)`: one response frame (head, data..., end), as it comes."""

Execute = Callable[[str, bytes, str, Deliver], Awaitable[None]]
"""`await execute(path, body, peer_id, deliver)`: run a forwarded request on this node's
API, delivering its response frames, `end` last; `deliver` may be called from the
asyncio side of the bridge (it goes back into trio through the trio token)."""


@dataclass(frozen=True)
class ForwardLimits:
    max_body_bytes: int  # the API's own body limit
    max_forwards: int = 16  # forwarded requests in flight here, from every peer
    max_peer_forwards: int = 4  # from one peer
    request_s: float = 10.0  # the request frame, once the stream is open
    first_s: float = 330.0  # the head: the holder's queue (300 s by default) and prefill
    idle_s: float = 120.0  # between two frames of the response
    send_s: float = 30.0  # a peer must take each response frame within this


def _request_schema(max_body_bytes: int) -> Schema:
    return Schema(
        "forward request",
        (("path", Choice(FORWARDED_PATHS)), ("body", Bytes(max_body_bytes))),
    )


_HEADER_NAME = Str(64, min_chars=1, printable=True)
_HEADER_VALUE = Str(1024, printable=True)
HEAD = Schema(
    "forward head",
    (
        ("t", Choice(("head",))),
        ("status", Int(100, 599)),
        ("headers", Map(_HEADER_NAME, _HEADER_VALUE, 32)),
    ),
)
DATA = Schema("forward data", (("t", Choice(("data",))), ("data", Bytes(MAX_CHUNK_BYTES))))
END = Schema("forward end", (("t", Choice(("end",))),))


def head_frame(status: int, headers: dict[str, str]) -> dict[str, Any]:
    """The head of a response, with only the headers a holder may pass on."""
    kept = {k.lower(): v for k, v in headers.items() if passed_header(k)}
    return HEAD.check_keys({"t": "head", "status": status, "headers": kept})


def data_frame(data: bytes) -> dict[str, Any]:
    return DATA.check_keys({"t": "data", "data": data})


END_FRAME: dict[str, Any] = {"t": "end"}


def passed_header(name: str) -> bool:
    name = name.lower()
    return name in PASSED_HEADERS or name.startswith(PASSED_PREFIX)


def error_frames(
    status: int, message: str, kind: str, code: str | None = None, retry_after_s: int = 0
) -> list[dict[str, Any]]:
    """A whole response in OpenAI's error shape: head, body, end (`retry_after_s`: a
    Retry-After header, for a refusal that passes)."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    headers = {"content-type": "application/json"}
    if retry_after_s:
        headers["retry-after"] = str(retry_after_s)
    if code == FORWARD_BUSY:
        headers[FORWARD_BUSY_HEADER] = "1"
    return [head_frame(status, headers), data_frame(body.encode()), END_FRAME]


class ForwardService:
    """The holder's end: runs forwarded requests through `execute`, within its caps."""

    def __init__(self, host: P2PHost, execute: Execute, limits: ForwardLimits) -> None:
        self._execute = execute
        self._limits = limits
        self._request = _request_schema(limits.max_body_bytes)
        self._in_flight: dict[str, int] = {}
        host.set_handler(FORWARD_PROTOCOL, self._serve)

    @property
    def in_flight(self) -> int:
        return sum(self._in_flight.values())

    async def _serve(self, stream: FrameStream) -> None:
        peer = stream.peer_id
        frame = await stream.recv(self._limits.request_s)
        request = self._request.read(frame, _bad_frame(peer))
        refusal = self._over_cap(peer)
        if refusal is not None:
            busy = error_frames(503, refusal, "service_unavailable", FORWARD_BUSY, 2)
            for out in busy:
                await stream.send(out, timeout_s=self._limits.send_s)
            return
        self._in_flight[peer] = self._in_flight.get(peer, 0) + 1
        try:
            await self._relay(stream, request["path"], request["body"])
        finally:
            left = self._in_flight.pop(peer) - 1
            if left:
                self._in_flight[peer] = left

    def _over_cap(self, peer: str) -> str | None:
        if self.in_flight >= self._limits.max_forwards:
            return f"this node runs {self.in_flight} forwarded requests already (its cap)"
        if self._in_flight.get(peer, 0) >= self._limits.max_peer_forwards:
            return "this node runs as many forwarded requests of your node as it may"
        return None

    async def _relay(self, stream: FrameStream, path: str, body: bytes) -> None:
        """`execute` delivers frames (from asyncio, through the token); they go out in
        order. The requester gone, the nursery's cancellation reaches `execute`, and the
        API sees its client leave (the session is freed there)."""
        token = trio.lowlevel.current_trio_token()
        tx, rx = trio.open_memory_channel[dict[str, Any]](math.inf)

        def put(frame: dict[str, Any]) -> None:
            with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                tx.send_nowait(frame)

        def deliver(frame: dict[str, Any]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(put, frame)

        closed = trio.Event()  # the requester closed its side
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._execute, path, body, stream.peer_id, deliver)
            nursery.start_soon(_watch, stream, nursery.cancel_scope, closed)
            async with rx:
                async for frame in rx:
                    await stream.send(frame, timeout_s=self._limits.send_s)
                    if frame["t"] == "end":
                        break
            tx.close()
            # The requester closes its side once it has read `end`. Cancelling the watch's
            # read before that resets the stream, and a reset can drop the `end` (and the
            # last data) still in flight: wait for the close, within a bound.
            with trio.move_on_after(self._limits.request_s):
                await closed.wait()
            nursery.cancel_scope.cancel()


async def _watch(stream: FrameStream, scope: trio.CancelScope, closed: trio.Event) -> None:
    """The requester's side of the stream, while its reply runs: closed (it read the whole
    reply, or its client left, or it failed), the reply is over; anything it sends is a
    bad frame."""
    try:
        await stream.recv(math.inf)
    except StreamClosedError:
        closed.set()
        scope.cancel()
        return
    raise MalformedFrameError("a forward stream carries one request frame", stream.peer_id)


async def forward(
    host: P2PHost,
    peer_id: str,
    path: str,
    body: bytes,
    deliver: Deliver,
    limits: ForwardLimits,
) -> None:
    """The requester's end: send the request to `peer_id`, deliver its response frames
    (each checked) until `end`. MalformedFrameError (naming the peer) for a frame outside
    the protocol; StreamClosedError / RecvTimeoutError when the holder goes away."""
    stream = await host.open_stream(peer_id, FORWARD_PROTOCOL, limits.request_s)
    done = False
    try:
        await stream.send({"path": path, "body": body}, timeout_s=limits.request_s)
        bad = _bad_frame(peer_id)
        deliver(HEAD.read(await stream.recv(limits.first_s), bad))
        while True:
            frame = await stream.recv(limits.idle_s)
            if frame.get("t") == "end":
                deliver(END.read(frame, bad))
                done = True
                return
            deliver(DATA.read(frame, bad))
    finally:
        if done:
            await stream.close()
        else:
            await stream.reset()


def _bad_frame(peer_id: str) -> Callable[[str], Exception]:
    return lambda why: MalformedFrameError(why, peer_id)
