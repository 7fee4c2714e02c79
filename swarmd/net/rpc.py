"""Remote calls between nodes (trio): one protocol, one framing, a timeout on every call.

Handler side: `RpcService(host)` serves `/swarmd/rpc/1`; `service.register("name", rpc_name)`
adds a method with its own concurrency cap and timeout. Caller side: `call(host, peer_id,
"name", args, timeout_s)`, wrapped by a `call_name` helper with the same name as the
handler's `rpc_name` (the built-in pair is `rpc_ping` / `call_ping`).

On the wire (frames of `swarmd.net.frames`), a stream carries requests one after another:

    request  {"method": str, "args": {...}}
    reply    {"ok": {...}}  or  {"error": {"type": str, "message": str}}

A handler's SwarmError travels back with its class name and message and is raised on the
caller as `RemoteError` (peer, method, remote type, message). Any other exception is
logged here with its traceback and travels as a bare "InternalError": no traceback or
internal detail leaves the node. No reply within the caller's timeout: `RpcTimeoutError`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from swarmd.errors import (
    FrameTooLargeError,
    MalformedFrameError,
    RemoteError,
    RpcTimeoutError,
    StreamClosedError,
    SwarmError,
)
from swarmd.net.frames import FrameStream
from swarmd.net.host import P2PHost

__all__ = [
    "ERROR_BAD_REQUEST",
    "ERROR_HANDLER_TIMEOUT",
    "ERROR_INTERNAL",
    "ERROR_OVERLOADED",
    "ERROR_UNKNOWN_METHOD",
    "RPC_PROTOCOL",
    "RpcHandler",
    "RpcService",
    "call",
    "call_ping",
    "rpc_ping",
]

log = logging.getLogger(__name__)

RPC_PROTOCOL = "/swarmd/rpc/1"

RpcHandler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
"""`async def rpc_name(peer_id, args) -> result`; `args` comes from a peer: check it."""

DEFAULT_MAX_CONCURRENCY = 16  # calls of one method running at once
DEFAULT_HANDLER_TIMEOUT_S = 30.0  # waiting for a slot + running, per call
STREAM_IDLE_TIMEOUT_S = 30.0  # an RPC stream with no request for this long is reset
PING_TIMEOUT_S = 5.0
MAX_METHOD_CHARS = 64
MAX_REMOTE_TEXT_CHARS = 1000  # of a remote error's type and message, as shown here

# Error types of failures that are not a handler's own SwarmError.
ERROR_BAD_REQUEST = "BadRequestError"
ERROR_UNKNOWN_METHOD = "UnknownMethodError"
ERROR_OVERLOADED = "OverloadedError"
ERROR_HANDLER_TIMEOUT = "HandlerTimeoutError"
ERROR_INTERNAL = "InternalError"


@dataclass(frozen=True)
class _Method:
    handler: RpcHandler
    slots: trio.Semaphore
    timeout_s: float


class RpcService:
    """The handler side: methods by name on `/swarmd/rpc/1` of one host."""

    def __init__(self, host: P2PHost, idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S) -> None:
        self._host = host
        self._idle_timeout_s = idle_timeout_s
        self._methods: dict[str, _Method] = {}
        self.register("ping", rpc_ping, max_concurrency=64, timeout_s=PING_TIMEOUT_S)
        host.set_handler(RPC_PROTOCOL, self._serve)

    @property
    def methods(self) -> list[str]:
        return sorted(self._methods)

    def register(
        self,
        method: str,
        handler: RpcHandler,
        *,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        timeout_s: float = DEFAULT_HANDLER_TIMEOUT_S,
    ) -> None:
        """Serve `method`: at most `max_concurrency` calls at once, each within `timeout_s`."""
        if not method or len(method) > MAX_METHOD_CHARS:
            raise ValueError(f"a method name has 1..{MAX_METHOD_CHARS} characters")
        if method in self._methods:
            raise ValueError(f"method {method!r} is already registered")
        if max_concurrency < 1 or not timeout_s > 0:
            raise ValueError("max_concurrency must be >= 1 and timeout_s > 0")
        self._methods[method] = _Method(handler, trio.Semaphore(max_concurrency), timeout_s)

    async def _serve(self, stream: FrameStream) -> None:
        """Answer the requests of one stream in turn until the caller closes it."""
        while True:
            try:
                request = await stream.recv(self._idle_timeout_s)
            except StreamClosedError as exc:
                if exc.truncated:
                    raise
                return  # the caller is done
            method, reply = await self._dispatch(stream.peer_id, request)
            try:
                await stream.send(reply)
            except (MalformedFrameError, FrameTooLargeError) as exc:  # nothing was sent
                log.error("the result of rpc %r cannot be sent: %s", method, exc)
                await stream.send(_error(ERROR_INTERNAL, f"the result of '{method}' is unsendable"))

    async def _dispatch(self, peer_id: str, request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        method, args = request.get("method"), request.get("args")
        if not isinstance(method, str) or not isinstance(args, dict) or len(request) != 2:
            return "?", _error(ERROR_BAD_REQUEST, "a request is {'method': str, 'args': map}")
        entry = self._methods.get(method)
        if entry is None:
            return method, _error(ERROR_UNKNOWN_METHOD, f"no method {method[:MAX_METHOD_CHARS]!r}")
        started = False
        try:
            with trio.move_on_after(entry.timeout_s) as scope:
                async with entry.slots:
                    started = True
                    result = await entry.handler(peer_id, args)
        except SwarmError as exc:
            return method, _error(type(exc).__name__, str(exc))
        except Exception:
            log.exception("rpc %r from peer %s failed", method, peer_id[-8:])
            return method, _error(ERROR_INTERNAL, f"internal error in '{method}'")
        if scope.cancelled_caught:
            if started:
                why = f"'{method}' ran past its {entry.timeout_s:g} s limit"
                return method, _error(ERROR_HANDLER_TIMEOUT, why)
            why = f"every '{method}' slot stayed busy for {entry.timeout_s:g} s"
            return method, _error(ERROR_OVERLOADED, why)
        if not isinstance(result, dict):
            log.error("rpc %r returned %s, not a dict", method, type(result).__name__)
            return method, _error(ERROR_INTERNAL, f"internal error in '{method}'")
        return method, {"ok": result}


def _error(error_type: str, message: str) -> dict[str, Any]:
    return {"error": {"type": error_type, "message": message}}


# --- the caller side --------------------------------------------------------------------


async def call(
    host: P2PHost, peer_id: str, method: str, args: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """Call `method` on a peer; its result, or RemoteError / RpcTimeoutError / PeerError.

    `timeout_s` covers everything: opening the stream, sending, the handler, the reply.
    """
    if not isinstance(args, dict):
        raise TypeError(f"rpc args must be a dict, got {type(args).__name__}")
    reply: dict[str, Any] | None = None
    with trio.move_on_after(timeout_s):
        async with await host.open_stream(peer_id, RPC_PROTOCOL) as stream:
            reply = await _exchange(stream, method, args)
    if reply is None:
        raise RpcTimeoutError(peer_id, method, timeout_s)
    return _unwrap(peer_id, method, reply)


async def _exchange(stream: FrameStream, method: str, args: dict[str, Any]) -> dict[str, Any]:
    # No timeouts of their own: the caller's deadline covers the whole call.
    await stream.send({"method": method, "args": args}, timeout_s=math.inf)
    return await stream.recv(math.inf)


def _unwrap(peer_id: str, method: str, reply: dict[str, Any]) -> dict[str, Any]:
    if len(reply) == 1 and isinstance(reply.get("ok"), dict):
        return reply["ok"]
    error = reply.get("error") if len(reply) == 1 else None
    if isinstance(error, dict):
        error_type, message = error.get("type"), error.get("message")
        if isinstance(error_type, str) and isinstance(message, str):
            raise RemoteError(
                peer_id,
                method,
                error_type[:MAX_REMOTE_TEXT_CHARS],
                message[:MAX_REMOTE_TEXT_CHARS],
            )
    raise MalformedFrameError(
        f"peer {peer_id[-8:]} answered '{method}' with neither a result nor an error", peer_id
    )


# --- built-in methods -------------------------------------------------------------------


async def rpc_ping(peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
    return {}


async def call_ping(
    host: P2PHost, peer_id: str, timeout_s: float = PING_TIMEOUT_S, rounds: int = 3
) -> float:
    """Round-trip time to a peer, in seconds: the best of `rounds` pings on one stream.

    Opening the stream (about 5 ms of protocol negotiation) is not counted: this is the
    latency a long-lived stream sees.
    """
    best = math.inf
    done = False
    with trio.move_on_after(timeout_s):
        async with await host.open_stream(peer_id, RPC_PROTOCOL) as stream:
            for _ in range(max(1, rounds)):
                start = time.perf_counter()
                _unwrap(peer_id, "ping", await _exchange(stream, "ping", {}))
                best = min(best, time.perf_counter() - start)
            done = True
    if not done:
        raise RpcTimeoutError(peer_id, "ping", timeout_s)
    return best
