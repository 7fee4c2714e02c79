"""swarmd: one OpenAI-compatible LLM server made of the machines you already own.

Where things live:
- `swarmd.cli`        the `swarmd` command (typer): run, chat, peers, models, token, shard
- `swarmd.config`     `Config`, a frozen dataclass; precedence flag > env > TOML > default
- `swarmd.node`       `Node`: start-up and shutdown of one daemon
- `swarmd.acquire`    before loading: `--layers auto` placement and fetching missing files
- `swarmd.errors`     the exception tree (drawn at its top)
- `swarmd.dtypes`     the one table of weight formats and compute dtypes
- `swarmd.untrusted`  typed, bounded readers of what peers send (every decoder uses them)
- `swarmd.model`      models on disk (GGUF conversion, shards, quantized weights), loading,
                      the runtime (a stage with KV caches), sampling, the torch worker
- `swarmd.engine`     swarmd's own forward for the Llama family and Gemma 3
- `swarmd.pipeline`   generation sessions: the coordinator's loop over a route of stages
- `swarmd.api`        the aiohttp OpenAI-compatible HTTP API, /metrics, the diagnostics report
- `swarmd.web`        the chat page served at "/" (index.html, app.js, markdown.js, style.css)
- `swarmd.net`        identity, the libp2p host, frames, RPC, the private-swarm gate
- `swarmd.dht`        discovery: signed records of who serves which layers; the node's
                      swarm presence (host + DHT + announcements)
- `swarmd.transfer`   model files between peers: serving and fetching them

Layers, each importing only those below it (tests/unit/test_layers.py):
errors, dtypes, config, untrusted < model, engine < net < dht < pipeline, transfer
< acquire, api, client < node < cli.
"""

__version__ = "0.7.0"
