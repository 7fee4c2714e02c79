"""swarmd: one OpenAI-compatible LLM server made of the machines you already own.

Where things live:
- `swarmd.cli`        the `swarmd` command (typer): run, chat
- `swarmd.config`     `Config`, a frozen dataclass; precedence flag > env > TOML > default
- `swarmd.node`       `Node`: start-up and shutdown of one daemon
- `swarmd.errors`     the exception tree (drawn at its top)
- `swarmd.model`      loading models, the stage (a layer range with KV caches), sampling,
                      the torch worker thread
- `swarmd.pipeline`   generation sessions: the coordinator's loop over a route of stages
- `swarmd.api`        the aiohttp OpenAI-compatible HTTP API
- `swarmd.net`        identity and (later) the libp2p host
- `swarmd.dht`        (later) discovery records
"""

__version__ = "0.1.0"
