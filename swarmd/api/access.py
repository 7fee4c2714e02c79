"""Who may ask what: the Host and Origin checks, API tokens, content types, body deadlines.

The middlewares run in this order, each cheaper than the next and each refusing before
the request costs anything:

1. `edge_middleware`: on a loopback-bound node a `Host` that is not a loopback name is a
   DNS-rebinding page (403); an `Origin` that is neither the node's own nor configured in
   `allowed_origins` is another site's page posting through the user's browser (403).
   Configured origins get CORS headers and their preflights answered.
2. `auth_middleware`: once a token was created (or with `require_api_token`), `/v1/*` needs a
   token and `/api/*` and `/metrics` an admin-scope one; `/`, `/health` and `/static/*`
   stay open (401/403 in OpenAI's error shape otherwise).
3. `body_middleware`: a JSON endpoint takes `application/json` only (415: a `text/plain`
   form post needs no preflight, so this is what keeps plain forms out); the body must
   arrive within `http_body_timeout_s` (408); a full queue answers 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
from typing import TYPE_CHECKING

from aiohttp import web

from swarmd.api import keys
from swarmd.api.errors import Handler, error_body
from swarmd.api.forward import is_forwarded
from swarmd.api.tokens import TokenEntry

if TYPE_CHECKING:
    from swarmd.node import Node

OPEN_PATHS = frozenset({"/", "/health"})
OPEN_PREFIXES = ("/static/",)
INFER_PREFIX = "/v1/"
JSON_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
QUEUED_PATHS = JSON_PATHS
CORS_MAX_AGE_S = 600
_MAX_ASKED_HEADERS = 2048  # a preflight's Access-Control-Request-Headers echoed back
_HEADER_LIST = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(?:\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")
DRAIN_S = 1.0  # how long a refused body is read and dropped before the connection closes


def is_loopback_name(host: str) -> bool:
    """`localhost`, `*.localhost` or a loopback IP (the names that never leave this machine)."""
    name = host.strip().lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port: `[::1]:8800` -> `::1`."""
    host = host_header.strip()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _refuse(
    request: web.Request, status: int, message: str, error_type: str, code: str
) -> web.Response:
    request.app[keys.NODE].edge.stats.refuse(code)
    return web.json_response(error_body(message, error_type, None, code), status=status)


def _own_origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}".lower()


@web.middleware
async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    node: Node = request.app[keys.NODE]
    if is_loopback_name(node.config.host) and not is_loopback_name(host_name(request.host)):
        return _refuse(
            request,
            403,
            "This node listens on loopback only and answers only to loopback host names "
            "(localhost, 127.0.0.1, [::1]); the Host header named another",
            "permission_error",
            "host_not_allowed",
        )
    origin = request.headers.get("Origin")
    if origin is None:
        return await handler(request)
    allowed = node.config.allowed_origins
    configured = "*" in allowed or origin in allowed
    if origin.lower() != _own_origin(request) and not configured:
        return _refuse(
            request,
            403,
            f"Requests from pages of another origin are refused; add {origin!r} to "
            "allowed_origins to let that site use this node",
            "permission_error",
            "origin_not_allowed",
        )
    if not configured:
        return await handler(request)
    if request.method == "OPTIONS":  # a CORS preflight from a configured site
        response: web.StreamResponse = web.Response(status=204)
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        # What the page's client asks to send: the openai SDK adds its x-stainless-* headers,
        # others their own. The origin is trusted; the token still decides what it may do.
        asked = request.headers.get("Access-Control-Request-Headers", "")
        if len(asked) > _MAX_ASKED_HEADERS or not _HEADER_LIST.fullmatch(asked):
            asked = ""  # not a list of header names: the plain answer
        response.headers["Access-Control-Allow-Headers"] = asked or "authorization, content-type"
        response.headers["Access-Control-Max-Age"] = str(CORS_MAX_AGE_S)
    else:
        response = await handler(request)
    if not response.prepared:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "*"
        # a preflight's answer also depends on the headers it asked for
        asked_too = ", Access-Control-Request-Headers" if request.method == "OPTIONS" else ""
        response.headers["Vary"] = "Origin" + asked_too
    return response


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None if absent or malformed."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


def _needs_admin(path: str) -> bool:
    return not path.startswith(INFER_PREFIX)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    path = request.path
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES) or request.method == "OPTIONS":
        return await handler(request)
    node: Node = request.app[keys.NODE]
    if not (node.config.require_api_token or node.tokens.enforced):
        return await handler(request)
    if path in JSON_PATHS and is_forwarded(request, node.forwards.secret):
        return await handler(request)  # a swarm peer's request, run here over loopback
    header = request.headers.get("Authorization")
    token = bearer_token(header)
    entry: TokenEntry | None = node.tokens.verify(token) if token is not None else None
    if entry is None:
        # Never echo the presented token: error bodies end up in logs and bug reports.
        if header is None:
            message = (
                "You didn't provide an API key. Send it as 'Authorization: Bearer sk-swarm-...'"
                " (create one on the node with `swarmd token create`)"
            )
        elif token is None:
            message = "Malformed Authorization header: expected 'Bearer sk-swarm-...'"
        else:
            message = "Incorrect API key provided"
        response = _refuse(request, 401, message, "invalid_request_error", "invalid_api_key")
        response.headers["WWW-Authenticate"] = 'Bearer realm="swarmd"'
        return response
    if _needs_admin(path) and not entry.allows_admin():
        return _refuse(
            request,
            403,
            f"{path} needs an admin-scope token (swarmd token create --scope admin)",
            "permission_error",
            "insufficient_scope",
        )
    return await handler(request)


@web.middleware
async def body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST":
        return await handler(request)
    node: Node = request.app[keys.NODE]
    if request.path in JSON_PATHS and request.content_type != "application/json":
        return _refuse(
            request,
            415,
            f"Content-Type must be application/json, got {request.content_type or 'none'}",
            "invalid_request_error",
            "unsupported_media_type",
        )
    if request.path in QUEUED_PATHS and node.coordinator.waiting >= node.config.max_queued_requests:
        response = _refuse(
            request,
            503,
            f"{node.coordinator.waiting} requests are already waiting for this node; "
            "try again shortly",
            "service_unavailable",
            "queue_full",
        )
        response.headers["Retry-After"] = "2"
        return response
    if request.body_exists:
        limit = node.config.max_body_bytes
        too_large = f"Request body too large: the limit is {limit} bytes"
        declared = request.content_length
        if declared is not None and declared > limit:  # refused without waiting for it
            # What the client sent already is drained (DRAIN_S at most), as for a chunked
            # body: closing on unread bytes resets the connection, and the reset can
            # destroy the 413 in the client's buffer before it is read.
            return await _refuse_and_close(
                request, 413, too_large, "invalid_request_error", "payload_too_large", declared
            )
        try:
            # Read here, under a deadline: the handlers' request.json() then finds it read.
            async with asyncio.timeout(node.config.http_body_timeout_s):
                await request.read()
        except TimeoutError:
            return await _refuse_and_close(
                request,
                408,
                f"The request body did not arrive within {node.config.http_body_timeout_s:g} s",
                "invalid_request_error",
                "body_timeout",
            )
        except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit
            return await _refuse_and_close(
                request, 413, too_large, "invalid_request_error", "payload_too_large", limit
            )
    return await handler(request)


async def _refuse_and_close(
    request: web.Request,
    status: int,
    message: str,
    error_type: str,
    code: str,
    drain_bytes: int = 0,
) -> web.Response:
    """Refuse, send it, and close the connection: the rest of the body is not waited for
    (aiohttp would otherwise linger reading it, and answer the leftovers with a 408).
    `drain_bytes`: first read and drop up to that much of what the client has sent
    already (for `DRAIN_S` at most), so the close is a FIN after the answer, not a reset
    that can destroy the answer in the client's buffer."""
    response = _refuse(request, status, message, error_type, code)
    await response.prepare(request)
    await response.write_eof()
    if drain_bytes:
        with contextlib.suppress(Exception):  # whatever stops the drain: close now
            async with asyncio.timeout(DRAIN_S):
                while drain_bytes > 0 and (got := await request.content.readany()):
                    drain_bytes -= len(got)
    request.protocol.force_close()
    return response
