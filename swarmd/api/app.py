"""The aiohttp application: routes, middlewares and the small JSON endpoints."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from swarmd import __version__
from swarmd.api import keys
from swarmd.api.access import auth_middleware, body_middleware, edge_middleware
from swarmd.api.completions import chat_completions, completions
from swarmd.api.diagnostics import build_report
from swarmd.api.errors import Handler, error_middleware
from swarmd.api.metrics import CONTENT_TYPE
from swarmd.api.routing_view import covered, merge_ranges, route_holders
from swarmd.dht.index import CatalogModel
from swarmd.dht.records import NodeRecord
from swarmd.errors import ModelNotFoundError, SwarmError

if TYPE_CHECKING:
    from swarmd.node import Node

log = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
HOLDERS_TIMEOUT_S = 30.0  # above discovery's own worst case (lookup + rpc + record)


@web.middleware
async def connection_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tells the connection's guard (edge.py) that its head arrived: its deadline is over."""
    edge = request.app[keys.NODE].edge
    edge.request_started(request.transport)
    try:
        return await handler(request)
    finally:
        edge.request_done(request.transport)


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
        middlewares=[
            connection_middleware,
            request_id_middleware,
            error_middleware,
            edge_middleware,
            auth_middleware,
            body_middleware,
        ],
    )
    app[keys.NODE] = node
    app[keys.COORDINATOR] = node.coordinator
    app[keys.MAX_BODY_BYTES] = node.config.max_body_bytes
    app[keys.DEFAULT_TEMPERATURE] = node.config.default_temperature
    app.router.add_get("/", chat_page)
    app.router.add_static("/static/", WEB_DIR, append_version=False)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model_detail)
    app.router.add_get("/api/peers", peers)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/admin/diagnostics", diagnostics)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    return app


async def health(request: web.Request) -> web.Response:
    node: Node = request.app[keys.NODE]
    held = list(node.held.values())
    swarm_state = node.swarm_state()
    body: dict[str, Any] = {
        # Degraded: this node still answers for the layers it holds, but has left the swarm.
        "status": "ok" if swarm_state == "ready" else "degraded",
        "swarm": swarm_state,
        "version": __version__,
        "peer_id": node.identity.peer_id,
        "short_id": node.identity.short_id,
        "addrs": node.listen_addrs(),
        # Whether peers can dial this node: "public", "private" (reached through a relay)
        # or "unknown" (not checked yet); see swarmd.net.dialback.
        "reachability": node.swarm.reachability,
        "uptime_s": round(time.monotonic() - node.started_at, 1),
        # The models this node holds layers of (none: it only coordinates).
        "models": [
            {
                "id": h.model.model_id,
                "layers": [h.model.layers.start, h.model.layers.end],
                "num_layers": h.model.num_layers,
                "weights": h.model.weights,
                "dtype": h.model.dtype_name,
                "backend": h.model.backend,
                "kernels": h.model.kernels,  # whose int4/int8 kernels: swarmd, torch, none
                "attention": h.model.attention,  # whose attention: swarmd, torch
                "sessions": h.runtime.session_count,
                "kv_budget_tokens": h.kv_budget.total,
                "kv_reserved_tokens": h.kv_budget.reserved,
            }
            for h in held
        ],
        "coordinates": [m.model_id for m in node.coordinated_models()],
        "in_flight": node.coordinator.in_flight,
        # Totals over the models held.
        "sessions": sum(h.runtime.session_count for h in held),
        "kv_cache_tokens": sum(h.runtime.cached_tokens for h in held),
        "kv_budget_tokens": sum(h.kv_budget.total for h in held),
        "kv_reserved_tokens": sum(h.kv_budget.reserved for h in held),
        "queued": node.coordinator.waiting,
    }
    return web.json_response(body)


async def chat_page(request: web.Request) -> web.FileResponse:
    """The chat page (swarmd/web): plain HTML, CSS and JS, every asset served from here."""
    return web.FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def metrics(request: web.Request) -> web.Response:
    node: Node = request.app[keys.NODE]
    return web.Response(body=node.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def diagnostics(request: web.Request) -> web.Response:
    """The plain-text report; addresses are redacted unless ?full=1."""
    node: Node = request.app[keys.NODE]
    full = request.query.get("full", "") in ("1", "true", "yes")
    text = await build_report(node, await _swarm_holders(node), full=full)
    return web.Response(text=text, content_type="text/plain")


async def models(request: web.Request) -> web.Response:
    """This node's models first, then every other model the swarm lists and holds."""
    node: Node = request.app[keys.NODE]
    own = await asyncio.gather(*(_model_entry(node, model_id) for model_id in node.held))
    listed = [m for m in await _catalog(node) if m.model_id not in node.held]
    others = await asyncio.gather(*(_swarm_entry(node, m) for m in listed))
    return web.json_response(
        {"object": "list", "data": [*own, *(e for e in others if e is not None)]}
    )


async def model_detail(request: web.Request) -> web.Response:
    node: Node = request.app[keys.NODE]
    model_id = request.match_info["model"]
    if model_id in node.held:
        return web.json_response(await _model_entry(node, model_id))
    listed = next((m for m in await _catalog(node) if m.model_id == model_id), None)
    entry = None if listed is None else await _swarm_entry(node, listed)
    if entry is None:
        raise ModelNotFoundError(model_id, node.model_ids)
    return web.json_response(entry)


async def peers(request: web.Request) -> web.Response:
    """This node's view of the swarm: connected peers, RTTs, what they serve, bans."""
    node: Node = request.app[keys.NODE]
    serves: dict[str, list[NodeRecord]] = {}
    for record in await _swarm_holders(node):
        serves.setdefault(record.peer_id, []).append(record)
    now = time.time()
    connected_ids, table, records, relayed = await node.peer_snapshot()
    connected = set(connected_ids)
    rows = []
    known = {row.peer_id: row for row in table}
    for peer_id in sorted((connected | set(known) | set(serves)) - {node.identity.peer_id}):
        row = known.get(peer_id)
        rows.append(
            {
                "peer_id": peer_id,
                "short_id": peer_id[-8:],
                "connected": peer_id in connected,
                # How: "direct", or "relayed" (through a circuit relay only); None if not.
                "link": None
                if peer_id not in connected
                else ("relayed" if peer_id in relayed else "direct"),
                "rtt_ms": None if row is None else row.rtt_ms,
                # What route planning uses for this peer's compute (None: its record's claim).
                "layer_ms": None if row is None else row.layer_ms,
                "last_seen_s": None
                if row is None or row.last_seen is None
                else round(now - row.last_seen, 1),
                "failures": 0 if row is None else row.failures,
                "serves": [
                    {
                        "model": record.model_id,
                        "layers": [record.layer_start, record.layer_end],
                        "state": record.state,
                        "throughput_tps": record.throughput_tps,
                    }
                    for record in serves.get(peer_id, [])
                ],
            }
        )
    bans = [
        {"peer_id": b.peer_id, "reason": b.reason, "remaining_s": round(b.remaining_s, 1)}
        for b in node.bans(now)
    ]
    # Lost peers (a stage that went silent or whose link broke) sit out of routes for a
    # while; unlike the banned they may connect and use this node meanwhile.
    outs = [
        {"peer_id": o.peer_id, "reason": o.reason, "remaining_s": round(o.remaining_s, 1)}
        for o in node.outs(now)
    ]
    body = {
        "peer_id": node.identity.peer_id,
        "peers": rows,
        "bans": bans,
        "sitting_out": outs,
        "records": records,
    }
    return web.json_response(body)


async def _swarm_holders(node: Node) -> list[NodeRecord]:
    """The holders of every model this node holds or the swarm lists, model by model."""
    model_ids = dict.fromkeys([*node.held, *(m.model_id for m in await _catalog(node))])
    found = await asyncio.gather(*(_holders(node, model_id) for model_id in model_ids))
    return [record for records in found for record in records]


async def _holders(node: Node, model_id: str) -> list[NodeRecord]:
    try:
        return await asyncio.wait_for(node.holders(model_id), HOLDERS_TIMEOUT_S)
    except (TimeoutError, SwarmError) as exc:
        log.warning("DHT lookup of %s failed: %s", model_id, exc)
        return []


async def _catalog(node: Node) -> list[CatalogModel]:
    try:
        return await asyncio.wait_for(node.swarm_models(), HOLDERS_TIMEOUT_S)
    except (TimeoutError, SwarmError) as exc:
        log.warning("DHT lookup of the swarm's models failed: %s", exc)
        return []


async def _model_entry(node: Node, model_id: str) -> dict[str, Any]:
    """A model this node holds layers of."""
    model = node.held[model_id].model
    records = [r for r in await _holders(node, model_id) if r.state == "ready"]
    holders = {r.peer_id: (r.layer_start, r.layer_end) for r in records}
    # This node serves its range even when the DHT is slow to answer.
    holders.setdefault(node.identity.peer_id, (model.layers.start, model.layers.end))
    return _entry(node, model.model_id, model.context_length, model.num_layers, holders, True)


async def _swarm_entry(node: Node, listed: CatalogModel) -> dict[str, Any] | None:
    """A model this node holds no layers of, as its holders' records show it (None: no
    ready holder backs the listing, so it is not shown). Its holders are those of the
    variant this node would route through (every holder when none has a content id)."""
    ready = [r for r in await _holders(node, listed.model_id) if r.state == "ready"]
    if not ready:
        return None
    view = route_holders(node, listed.model_id, ready)
    holders = {r.peer_id: (r.layer_start, r.layer_end) for r in view.holders}
    hashes = {e.model_hash: e for _, e in listed.listed_by}
    variant = view.variant
    listing = hashes.get(variant.content_id if variant else "") or listed.listed_by[0][1]
    num_layers = view.holders[0].num_layers
    return _entry(
        node, listed.model_id, listing.context_length, num_layers, holders, view.can_route
    )


def _entry(
    node: Node,
    model_id: str,
    context_length: int,
    num_layers: int,
    holders: dict[str, tuple[int, int]],
    can_route: bool,
) -> dict[str, Any]:
    """A `/v1/models` entry; routable when this node can route the model at all and the
    holders it would use (banned peers left out) cover every layer."""
    coverage = merge_ranges(list(holders.values()))
    return {
        "id": model_id,
        "object": "model",
        "created": int(node.started_wall),
        "owned_by": "swarmd",
        "context_length": context_length,
        "swarm": {
            "holders": [
                {"peer_id": peer_id, "layers": list(layers)}
                for peer_id, layers in sorted(holders.items())
            ],
            "coverage": coverage,
            "num_layers": num_layers,
            "complete": coverage == [[0, num_layers]],
            "routable": can_route and covered(num_layers, holders, node.banned()),
        },
    }
