"""Typed keys of the aiohttp application's state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from swarmd.pipeline.coordinator import Coordinator

if TYPE_CHECKING:
    from swarmd.node import Node

NODE: web.AppKey[Node] = web.AppKey("node")
COORDINATOR = web.AppKey("coordinator", Coordinator)
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
DEFAULT_TEMPERATURE = web.AppKey("default_temperature", float)
REQUEST_ID = web.RequestKey("request_id", str)
