"""The API's listening socket: connection caps and a deadline for every request head.

aiohttp alone keeps a connection that trickles its request head for as long as its
keep-alive allows and has no cap on connections, so a few hundred slow sockets hold a
node. Each accepted connection here gets a small protocol in front of aiohttp's own:

- past `max_connections` in all, or `max_connections_per_client` from one address, it is
  answered 503 (Retry-After) and closed before aiohttp sees it;
- a request head must be complete within `head_timeout_s` of the connection opening,
  or of the first byte after the previous reply (408, closed). Idle keep-alive time is
  aiohttp's `keepalive_timeout`, set with the runner; body deadlines are in access.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

log = logging.getLogger(__name__)

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_BUSY_BODY = (
    b'{"error": {"message": "Too many open connections to this node", '
    b'"type": "service_unavailable", "param": null, "code": "too_many_connections"}}'
)
_HEAD_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


@dataclass(frozen=True)
class EdgeLimits:
    max_connections: int
    max_connections_per_client: int
    head_timeout_s: float


@dataclass
class EdgeStats:
    open: int = 0
    refused: int = 0  # connections over a cap
    head_timeouts: int = 0  # connections cut for a slow head
    per_client: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)  # by reason, for /metrics

    def refuse(self, reason: str) -> None:
        self.refusals[reason] += 1


class Edge:
    """The counts shared by every connection of one listening socket."""

    def __init__(self, limits: EdgeLimits) -> None:
        self.limits = limits
        self.stats = EdgeStats()
        self._guards: dict[asyncio.BaseTransport, _Guard] = {}

    def factory(self, server: web.Server) -> Any:
        def connection() -> _Guard:
            # aiohttp's own handler, with malformed HTTP answered as the API answers.
            inner = _Handler(self, server, loop=server._loop, **server._kwargs)
            return _Guard(self, inner)

        return connection

    def admit(self, client: str) -> bool:
        limits, stats = self.limits, self.stats
        if stats.open >= limits.max_connections or (
            stats.per_client[client] >= limits.max_connections_per_client
        ):
            stats.refused += 1
            stats.refuse("too_many_connections")
            return False
        stats.open += 1
        stats.per_client[client] += 1
        return True

    def release(self, client: str) -> None:
        self.stats.open -= 1
        self.stats.per_client[client] -= 1
        if self.stats.per_client[client] <= 0:
            del self.stats.per_client[client]

    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        guard = self._guards.get(transport) if transport is not None else None
        if guard is not None:
            guard.request_started()

    def request_done(self, transport: asyncio.BaseTransport | None) -> None:
        guard = self._guards.get(transport) if transport is not None else None
        if guard is not None:
            guard.request_done()


class _Handler(RequestHandler):
    """aiohttp's request handler, but a request it cannot parse (a bad request line,
    header or length, a head over its size) gets a 4xx in OpenAI's error shape and one
    log line, not a plain-text body echoing the input and a logged traceback."""

    __slots__ = ("_edge",)

    def __init__(self, edge: Edge, server: web.Server, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self._edge = edge

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        what = type(exc).__name__ if exc is not None else "BadHttpMessage"
        log.info("malformed HTTP request from %s: %s (%d)", request.remote, what, status)
        self._edge.stats.refuse("bad_http")
        body = {
            "error": {
                "message": f"Malformed HTTP request ({what})",
                "type": "invalid_request_error",
                "param": None,
                "code": "bad_http",
            }
        }
        response = web.json_response(body, status=status)
        response.force_close()
        return response


class _Guard(asyncio.Protocol):
    """Sits between the transport and aiohttp's RequestHandler, passing everything on."""

    def __init__(self, edge: Edge, inner: asyncio.Protocol) -> None:
        self._edge = edge
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._client = ""
        self._admitted = False
        self._requests = 0  # in progress on this connection
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._edge.admit(self._client):
            transport.write(_BUSY % (len(_BUSY_BODY), _BUSY_BODY))
            transport.close()
            return
        self._admitted = True
        self._edge._guards[transport] = self
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if self._requests == 0 and self._timer is None:
            self._arm()  # the first byte of the next head on a kept-alive connection
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._admitted else None

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._admitted:
            return
        self._admitted = False
        if self._transport is not None:
            self._edge._guards.pop(self._transport, None)
        self._edge.release(self._client)
        self._inner.connection_lost(exc)

    def request_started(self) -> None:
        self._requests += 1
        self._disarm()

    def request_done(self) -> None:
        self._requests = max(0, self._requests - 1)

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._edge.limits.head_timeout_s, self._head_expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_expired(self) -> None:
        self._timer = None
        if self._requests or self._transport is None or self._transport.is_closing():
            return
        self._edge.stats.head_timeouts += 1
        self._edge.stats.refuse("head_timeout")
        self._transport.write(_HEAD_TIMEOUT)
        self._transport.close()


async def listen(
    runner: web.AppRunner, edge: Edge, host: str, port: int, backlog: int = 1024
) -> asyncio.Server:
    """Listen on host:port with the app of `runner` (set up) behind the edge's guards."""
    server = runner.server
    assert server is not None, "runner.setup() first"
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        edge.factory(server), host, port, reuse_address=True, backlog=backlog
    )
