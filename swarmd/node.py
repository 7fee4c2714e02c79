"""`Node`: one swarmd daemon, from start-up to a clean shutdown.

Start-up: identity -> model (resolve, convert once, load) -> torch worker -> API.
Shutdown reverses it and leaves no task, thread or socket behind.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

from aiohttp import web

from swarmd.api.app import create_app
from swarmd.config import Config
from swarmd.errors import ConfigError
from swarmd.model.loader import LoadedModel, load_model
from swarmd.model.runtime import StageRuntime
from swarmd.model.source import resolve_model
from swarmd.model.worker import TorchWorker
from swarmd.net.identity import Identity, load_or_create_identity
from swarmd.pipeline.coordinator import Coordinator, CoordinatorLimits

log = logging.getLogger(__name__)


class Node:
    def __init__(self, config: Config, identity: Identity, model: LoadedModel) -> None:
        self.config = config
        self.identity = identity
        self.model = model
        self.worker = TorchWorker(config.torch_threads)
        self.runtime = StageRuntime(model.stage, config.max_sessions)
        limits = CoordinatorLimits(
            max_sessions=config.max_sessions,
            queue_timeout_s=config.queue_timeout_s,
            step_timeout_s=config.step_timeout_s,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
        )
        self.coordinator = Coordinator(model, self.runtime, self.worker, identity.short_id, limits)
        self.started_at = time.monotonic()
        self.started_wall = time.time()
        self.api_url = ""
        self._runner: web.AppRunner | None = None

    @classmethod
    def prepare(cls, config: Config) -> Node:
        """The blocking part of start-up: identity and model loading."""
        identity = load_or_create_identity(Path(config.data_dir))
        log.info("node %s (short id %s)", identity.peer_id, identity.short_id)
        source = resolve_model(config.model, Path(config.cache_dir))
        model = load_model(source, None, config.dtype)
        return cls(config, identity, model)

    async def start(self) -> None:
        self.worker.start()
        self._runner = web.AppRunner(create_app(self), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError as exc:
            await self.stop()
            raise ConfigError(
                f"Cannot listen on {self.config.host}:{self.config.port}: {exc.strerror} "
                "(is another node using that port? try --port)"
            ) from exc
        host, port = self._runner.addresses[0][:2]
        self.api_url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.worker.stop()


async def serve(config: Config) -> None:
    """Run a node until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    node = await asyncio.to_thread(Node.prepare, config)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await node.start()
        model = node.model
        print(
            f"swarmd: serving {model.model_id} (layers {model.layers} of {model.num_layers}) "
            f"at {node.api_url}/v1",
            flush=True,
        )
        print(f'swarmd: node {node.identity.short_id} ready; try: swarmd chat "hello"', flush=True)
        await stop.wait()
        print("swarmd: shutting down", flush=True)
    finally:
        await node.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
