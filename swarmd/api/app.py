"""The aiohttp application: routes, middlewares and the small JSON endpoints."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from swarmd import __version__
from swarmd.api import keys
from swarmd.api.completions import chat_completions, completions
from swarmd.api.errors import Handler, error_middleware

if TYPE_CHECKING:
    from swarmd.node import Node


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request[keys.REQUEST_ID] = str(uuid.uuid4())
    response = await handler(request)
    if not response.prepared:
        headers = response.headers
        headers.setdefault("x-swarm-request-id", request[keys.REQUEST_ID])
        if request.path.startswith("/v1/") and "x-swarm-route" not in headers:
            # Answered here before any stage ran (an error, or a model listing).
            headers["x-swarm-route"] = "local"
            headers["x-swarm-segments"] = "0"
            headers["x-swarm-nodes"] = request.app[keys.NODE].identity.short_id
    return response


def create_app(node: Node) -> web.Application:
    app = web.Application(
        client_max_size=node.config.max_body_bytes,
        middlewares=[request_id_middleware, error_middleware],
    )
    app[keys.NODE] = node
    app[keys.COORDINATOR] = node.coordinator
    app[keys.MAX_BODY_BYTES] = node.config.max_body_bytes
    app[keys.DEFAULT_TEMPERATURE] = node.config.default_temperature
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model_detail)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    return app


async def health(request: web.Request) -> web.Response:
    node: Node = request.app[keys.NODE]
    model = node.model
    body: dict[str, Any] = {
        "status": "ok",
        "version": __version__,
        "peer_id": node.identity.peer_id,
        "short_id": node.identity.short_id,
        "uptime_s": round(time.monotonic() - node.started_at, 1),
        "models": [
            {
                "id": model.model_id,
                "layers": [model.layers.start, model.layers.end],
                "num_layers": model.num_layers,
                "dtype": model.dtype_name,
            }
        ],
        "in_flight": node.coordinator.in_flight,
        "sessions": node.runtime.session_count,
        "kv_cache_tokens": node.runtime.cached_tokens,
    }
    return web.json_response(body)


async def models(request: web.Request) -> web.Response:
    node: Node = request.app[keys.NODE]
    return web.json_response({"object": "list", "data": [_model_entry(node)]})


async def model_detail(request: web.Request) -> web.Response:
    node: Node = request.app[keys.NODE]
    node.coordinator.resolve(request.match_info["model"])  # 404 for an unknown id
    return web.json_response(_model_entry(node))


def _model_entry(node: Node) -> dict[str, Any]:
    model = node.model
    return {
        "id": model.model_id,
        "object": "model",
        "created": int(node.started_wall),
        "owned_by": "swarmd",
        "context_length": model.context_length,
        "swarm": {
            "holders": [
                {"peer_id": node.identity.peer_id, "layers": [model.layers.start, model.layers.end]}
            ],
            "coverage": [[model.layers.start, model.layers.end]],
            "num_layers": model.num_layers,
            "complete": model.is_whole,
            "routable": model.is_whole,
        },
    }
