"""The one table from the exception tree to HTTP statuses, in OpenAI's error shape."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from swarmd.api import keys
from swarmd.api.redact import Redactor
from swarmd.errors import (
    AuthError,
    ClientDisconnectedError,
    InternalError,
    ModelError,
    ModelNotFoundError,
    PeerError,
    RequestError,
    SwarmError,
    UnavailableError,
)

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _redacted(exc: BaseException) -> str:
    """A server-side error's text with addresses replaced by tags: a 503 about a peer
    must not tell every API client where that peer lives (the log keeps the detail)."""
    return Redactor().redact(str(exc))


def error_code(exc: BaseException) -> str:
    """An error's `code` in OpenAI's style: its own, or its class's name in snake case
    (`NoRouteError` -> `no_route`, `StepTimeoutError` -> `step_timeout`)."""
    own = getattr(exc, "code", None)
    if isinstance(own, str) and own:
        return own
    name = type(exc).__name__.removesuffix("Error") or type(exc).__name__
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def classify(exc: BaseException) -> tuple[int, dict[str, object], dict[str, str]]:
    """status, body and extra headers for an error."""
    if isinstance(exc, RequestError):
        return exc.status, error_body(str(exc), exc.error_type, exc.param, exc.code), {}
    if isinstance(exc, ModelNotFoundError):
        return 404, error_body(str(exc), "invalid_request_error", "model", "model_not_found"), {}
    if isinstance(exc, AuthError):
        return 401, error_body(str(exc), "authentication_error", None, "invalid_api_key"), {}
    if isinstance(exc, UnavailableError):
        body = error_body(_redacted(exc), "service_unavailable", None, error_code(exc))
        return 503, body, {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, PeerError):  # a peer or the link to it failed: worth a retry
        body = error_body(_redacted(exc), "service_unavailable", None, error_code(exc))
        return 503, body, {"Retry-After": "5"}
    if isinstance(exc, ModelError | InternalError | ClientDisconnectedError | SwarmError):
        return 500, error_body(_redacted(exc), "server_error", None, error_code(exc)), {}
    return 500, error_body("Internal server error", "server_error", None, "internal_error"), {}


def error_response(exc: BaseException) -> web.Response:
    status, body, headers = classify(exc)
    return web.json_response(body, status=status, headers=headers)


_HTTP_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape; a bug becomes a 500, never a traceback."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            message = (
                f"Request body too large: the limit is {request.app[keys.MAX_BODY_BYTES]} bytes"
            )
            code = "payload_too_large"
        else:
            message, code = exc.reason, None
            if exc.status == 404:
                message = f"Unknown path {request.path}"
            elif exc.status == 405:
                message = f"Method {request.method} is not allowed on {request.path}"
        body = error_body(message, _HTTP_TYPES.get(exc.status, "invalid_request_error"), None, code)
        # a 405 names the methods the path takes (RFC 9110 requires it)
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response(body, status=exc.status, headers=allow)
    except SwarmError as exc:
        return error_response(exc)
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(exc)
