"""The `swarmd` command line (typer)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from swarmd import __version__
from swarmd.errors import SwarmError
from swarmd.model.manifest import DEFAULT_CHUNK_BYTES

if TYPE_CHECKING:
    from swarmd.model.manifest import Manifest

app = typer.Typer(
    help="swarmd: one OpenAI-compatible LLM server made of the machines you own.",
    no_args_is_help=True,
    add_completion=False,
)


T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format=LOG_FORMAT,
        stream=sys.stderr,
    )
    # transformers and friends are chatty at INFO; their warnings still show.
    for name in ("transformers", "accelerate", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(max(logging.WARNING, getattr(logging, level)))


def _adopt_libp2p_logger(level: str) -> None:
    """Call after importing libp2p: its import clears its logger's handlers."""
    # libp2p sets propagate=False on its logger and gives it no handler, so its lines
    # bypass our format; its DHT warnings (a peer that did not answer) are routine.
    # Some of its modules set their own levels, so the filter sits on the handler.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(logging.WARNING if level == "DEBUG" else logging.ERROR)
    p2p = logging.getLogger("libp2p")
    p2p.handlers = [handler]


@app.command()
def run(
    model: Annotated[
        list[str] | None,
        typer.Option(help="Model id, GGUF file or HF folder (repeatable: serve several)."),
    ] = None,
    no_model: Annotated[
        bool | None,
        typer.Option(
            "--no-model",
            help="Hold no model: join the swarm and answer for its models (no torch until needed).",
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="API listen address.")] = None,
    port: Annotated[int | None, typer.Option(help="API port (0 = any free port).")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Identity key and node state.")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Converted models cache.")] = None,
    weights: Annotated[
        str | None,
        typer.Option(
            help="Hold layer weights as int4, int8, bf16, fp16 or fp32 (auto: as the file is)."
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="What matrix kernels compute in: bfloat16, float16, float32 or auto."),
    ] = None,
    torch_threads: Annotated[int | None, typer.Option(help="0 = one per physical core.")] = None,
    max_sessions: Annotated[
        int | None, typer.Option(help="Sessions in flight on this node (batched together).")
    ] = None,
    kv_budget_tokens: Annotated[
        int | None,
        typer.Option(help="KV cache tokens this node holds (0 = half the memory left free)."),
    ] = None,
    layers: Annotated[
        list[str] | None,
        typer.Option(
            help="Serve only layers START:END, e.g. 0:15; auto: what the swarm lacks "
            "(with several --model: one --layers each, in their order)."
        ),
    ] = None,
    memory_budget: Annotated[
        float | None, typer.Option(help="GB of memory for --layers auto (default: free memory).")
    ] = None,
    upload_limit: Annotated[
        float | None, typer.Option(help="MB/s of model files served to peers (0 = no limit).")
    ] = None,
    p2p_port: Annotated[
        int | None, typer.Option(help="libp2p TCP port (default: API port + 10).")
    ] = None,
    p2p_host: Annotated[str | None, typer.Option(help="libp2p listen address.")] = None,
    bootstrap: Annotated[
        list[str] | None,
        typer.Option(help="Multiaddr of a swarm peer to join (repeatable)."),
    ] = None,
    no_listen: Annotated[
        bool | None,
        typer.Option(
            "--no-listen",
            help="Take no inbound connection (behind NAT): be reached through a relay.",
        ),
    ] = None,
    relay_service: Annotated[
        bool | None,
        typer.Option(
            "--relay-service",
            help="Relay circuits for peers that take no inbound connection (with limits).",
        ),
    ] = None,
    reachability: Annotated[
        str | None,
        typer.Option(
            help="auto: peers dial this node back to find out whether they can reach it "
            "(behind NAT it then takes a relay slot); public or private: take it as said."
        ),
    ] = None,
    announce_addr: Annotated[
        list[str] | None,
        typer.Option(
            help="Multiaddr peers must dial to reach this node, e.g. a forwarded port "
            "/ip4/203.0.113.7/tcp/8810 (repeatable; advertised instead of the listen address)."
        ),
    ] = None,
    swarm_key: Annotated[
        Path | None, typer.Option(help="Private swarm: file with the shared secret.")
    ] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file.")] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Debug logging.")] = False,
) -> None:
    """Run a node: serve the model over the OpenAI API (the embedded model by default)."""
    from swarmd.config import load_config

    flags: dict[str, object] = {
        "no_model": no_model,
        "host": host,
        "port": port,
        "data_dir": data_dir,
        "cache_dir": cache_dir,
        "weights": weights,
        "dtype": dtype,
        "torch_threads": torch_threads,
        "max_sessions": max_sessions,
        "kv_budget_tokens": kv_budget_tokens,
        "memory_budget_gb": memory_budget,
        "upload_limit_mb_s": upload_limit,
        "p2p_port": p2p_port,
        "p2p_host": p2p_host,
        "bootstrap": tuple(bootstrap) if bootstrap else None,
        "announce_addrs": tuple(announce_addr) if announce_addr else None,
        "no_listen": no_listen,
        "relay_service": relay_service,
        "reachability": reachability,
        "swarm_key": str(swarm_key) if swarm_key else None,
    }
    if verbose:
        flags["log_level"] = "DEBUG"
    try:
        flags.update(_model_flags(model or [], layers or [], weights, dtype))
        cfg = load_config(flags, config, os.environ)
        _setup_logging(cfg.log_level)
        from swarmd.node import serve  # torch and transformers: only once the config is good

        _adopt_libp2p_logger(cfg.log_level)

        asyncio.run(serve(cfg))
    except SwarmError as exc:
        typer.echo(f"swarmd: error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except KeyboardInterrupt:
        pass


def _model_flags(
    models: list[str], layers: list[str], weights: str | None, dtype: str | None
) -> dict[str, object]:
    """--model and --layers as config flags: one model as the flat fields, several as `serve`."""
    from swarmd.config import ServeSpec
    from swarmd.errors import ConfigError

    if len(models) <= 1:
        if len(layers) > 1:
            raise ConfigError(
                f"--layers is given {len(layers)} times but --model at most once: give one "
                "--layers per --model"
            )
        return {"model": models[0] if models else None, "layers": layers[0] if layers else None}
    if layers and len(layers) != len(models):
        raise ConfigError(
            f"--layers is given {len(layers)} times for {len(models)} --model flags: give "
            "one --layers per --model, in the same order, or none (every layer of each)"
        )
    ranges = layers or [""] * len(models)
    serve = tuple(
        ServeSpec(name, span, weights or "auto", dtype or "auto")
        for name, span in zip(models, ranges, strict=True)
    )
    return {"serve": serve}


def _ask(call: Coroutine[Any, Any, T]) -> T:
    """Run one call to a node; a node that cannot be reached or says no exits 1."""
    from swarmd.client import ClientError

    try:
        return asyncio.run(call)
    except ClientError as exc:
        typer.echo(f"swarmd: {exc}", err=True)
        raise typer.Exit(1) from exc


# The API token for the client commands; never echoed, never logged.
Token = Annotated[
    str | None,
    typer.Option(envvar="SWARMD_TOKEN", help="API token (sk-swarm-...), if the node needs one."),
]
Url = Annotated[str, typer.Option(help="The node's API.")]
DEFAULT_URL = "http://127.0.0.1:8800"


@app.command()
def chat(
    prompt: Annotated[str, typer.Argument(help="What to ask.")],
    model: Annotated[str | None, typer.Option(help="Model id (default: the node's first).")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    max_tokens: Annotated[int | None, typer.Option(help="Longest reply, in tokens.")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy.")] = None,
    system: Annotated[str | None, typer.Option(help="A system prompt.")] = None,
) -> None:
    """Stream a reply from a running node to the terminal."""
    from swarmd.client import stream_chat

    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    options = {"max_tokens": max_tokens, "temperature": temperature}
    summary = _ask(
        stream_chat(
            url, model, messages, {k: v for k, v in options.items() if v is not None}, token
        )
    )
    typer.echo("")
    if summary:
        typer.echo(summary, err=True)


@app.command()
def peers(url: Url = DEFAULT_URL, token: Token = None) -> None:
    """List the peers a running node knows: RTT, state and the layers they serve."""
    from rich.console import Console
    from rich.table import Table

    from swarmd.client import get_json

    report = _ask(get_json(url, "/api/peers", token))
    table = Table(title=f"peers of {report['peer_id']}")
    for column in ("peer", "connected", "rtt ms", "ms/layer", "last seen", "serves", "failures"):
        table.add_column(column)
    for peer in report["peers"]:
        serves = ", ".join(
            f"{s['model']} {s['layers'][0]}:{s['layers'][1]} ({s['state']})" for s in peer["serves"]
        )
        rtt = "-" if peer["rtt_ms"] is None else f"{peer['rtt_ms']:.1f}"
        # Measured by this node's routes (what planning uses); an older node has none.
        layer = "-" if peer.get("layer_ms") is None else f"{peer['layer_ms']:.2f}"
        seen = "-" if peer["last_seen_s"] is None else f"{peer['last_seen_s']:.0f} s ago"
        connected = "yes" if peer["connected"] else "no"
        failures = str(peer["failures"])
        table.add_row(peer["peer_id"], connected, rtt, layer, seen, serves or "-", failures)
    console = Console()
    console.print(table)
    for ban in report["bans"]:
        console.print(f"banned {ban['peer_id']}: {ban['reason']} ({ban['remaining_s']:.0f} s left)")
    for out in report.get("sitting_out", []):  # an older node reports none
        console.print(
            f"sitting out (lost) {out['peer_id']}: {out['reason']} "
            f"({out['remaining_s']:.0f} s left)"
        )


@app.command()
def diagnostics(
    url: Url = DEFAULT_URL,
    token: Token = None,
    full: Annotated[
        bool, typer.Option("--full", help="Keep IP addresses and host names (not for sharing).")
    ] = False,
) -> None:
    """Print a node's report: peers, coverage, last requests, failures, sessions."""
    from swarmd.client import get_text

    text = _ask(get_text(url, "/api/admin/diagnostics" + ("?full=1" if full else ""), token))
    typer.echo(text, nl=False)


@app.command()
def models(url: Url = DEFAULT_URL, token: Token = None) -> None:
    """List every model of the swarm: its holders and their layers, coverage and gaps, and
    whether the node at URL can route it."""
    from swarmd.client import get_json

    listing = _ask(get_json(url, "/v1/models", token))
    for entry in listing["data"]:
        typer.echo("\n".join(model_lines(entry)))


def model_lines(entry: dict[str, Any]) -> list[str]:
    """One model of `/v1/models` as `swarmd models` prints it."""
    from swarmd.model.layers import LayerRange
    from swarmd.pipeline.placement import coverage as layer_counts
    from swarmd.pipeline.placement import gaps

    swarm = entry.get("swarm", {})
    total = swarm.get("num_layers", 0)
    coverage = [tuple(r) for r in swarm.get("coverage", [])]
    held = (LayerRange(a, b) for a, b in coverage)
    missing = [f"{g.start}:{g.end}" for g in gaps(layer_counts(total, held))]
    state = "routable here" if swarm.get("routable") else "not routable here"
    covered = ",".join(f"{a}:{b}" for a, b in coverage) or "-"
    lines = [
        f"{entry['id']}  {total} layers  covered {covered}  gaps {','.join(missing) or 'none'}  "
        f"{state}"
    ]
    for holder in swarm.get("holders", []):
        start, end = holder["layers"]
        lines.append(f"  {holder['peer_id'][-8:]}  layers {start}:{end}")
    return lines


token_app = typer.Typer(help="API tokens: create, list and revoke (stored hashed).")
app.add_typer(token_app, name="token")

DataDir = Annotated[
    Path | None, typer.Option(help="The node's data dir (default: from --port / the config).")
]
Port = Annotated[int | None, typer.Option(help="The node's API port, to find its data dir.")]
ConfigFile = Annotated[Path | None, typer.Option("--config", help="The node's TOML config.")]


@contextlib.contextmanager
def _config_errors() -> Iterator[None]:
    """A bad setting or token name: its message and exit 2, no traceback."""
    try:
        yield
    except SwarmError as exc:
        typer.echo(f"swarmd: error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _token_store(data_dir: Path | None, port: int | None, config: Path | None) -> Any:
    from swarmd.api.tokens import TokenStore
    from swarmd.config import load_config

    flags: dict[str, object] = {"data_dir": data_dir, "port": port}
    with _config_errors():
        return TokenStore(load_config(flags, config, os.environ).data_dir)


@token_app.command("create")
def token_create(
    label: Annotated[str, typer.Option(help="A name to list and revoke it by.")] = "",
    scope: Annotated[
        str, typer.Option(help="infer: the OpenAI API; admin: also /api/* and /metrics.")
    ] = "infer",
    data_dir: DataDir = None,
    port: Port = None,
    config: ConfigFile = None,
) -> None:
    """Create a token and print it once (only its SHA-256 is kept)."""
    store = _token_store(data_dir, port, config)
    with _config_errors():
        entry, secret = store.create(label, scope)
    typer.echo(secret)
    typer.echo(
        f"token {entry.id} ({entry.scope}{', ' + entry.label if entry.label else ''}) saved to "
        f"{store.path}; it is shown only now. A running node takes it at once.",
        err=True,
    )


@token_app.command("list")
def token_list(data_dir: DataDir = None, port: Port = None, config: ConfigFile = None) -> None:
    """List the tokens: id, scope, label, created (never the tokens themselves)."""
    import datetime

    store = _token_store(data_dir, port, config)
    for entry in store.entries():
        created = datetime.datetime.fromtimestamp(entry.created).isoformat(timespec="seconds")
        typer.echo(f"{entry.id}  {entry.scope:<5}  {created}  {entry.label or '-'}")


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(metavar="ID|LABEL", help="Which token.")],
    data_dir: DataDir = None,
    port: Port = None,
    config: ConfigFile = None,
) -> None:
    """Revoke a token by id or label; a running node refuses it from its next request."""
    store = _token_store(data_dir, port, config)
    with _config_errors():
        gone = store.revoke(token_id)
    for entry in gone:
        typer.echo(f"revoked {entry.id} ({entry.label or 'no label'})")


@app.command()
def shard(
    source: Annotated[str, typer.Argument(help="GGUF file, Hugging Face folder or model id.")],
    out: Annotated[Path, typer.Option(help="New folder for the manifest and the shards.")],
    stages: Annotated[
        int | None, typer.Option(help="Split into N ranges of (nearly) equal size.")
    ] = None,
    ranges: Annotated[
        str | None, typer.Option(help="Explicit ranges covering every layer: 0:10,10:20,...")
    ] = None,
    model_id: Annotated[
        str | None, typer.Option(help="The id nodes will find it by (default: from SOURCE).")
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(
            help="Store layer weights as int4, int8, bf16, fp16 or fp32 (default: as SOURCE is)."
        ),
    ] = None,
    chunk_bytes: Annotated[
        int, typer.Option(help="Transfer piece size; each piece's SHA-256 is in the manifest.")
    ] = DEFAULT_CHUNK_BYTES,
    cache_dir: Annotated[Path | None, typer.Option(help="Where GGUF files are converted.")] = None,
) -> None:
    """Split a model into a manifest plus one .safetensors file per layer range."""
    _setup_logging("INFO")
    try:
        manifest = _write_shards(
            source, out, stages, ranges, model_id, weights, chunk_bytes, cache_dir
        )
    except SwarmError as exc:
        typer.echo(f"swarmd: error: {exc}", err=True)
        raise typer.Exit(2) from exc
    for entry in manifest.shards:
        size_mb = entry.bytes / 1e6
        typer.echo(f"{entry.start:>5}:{entry.end:<5} {entry.file} {size_mb:9.1f} MB {entry.sha256}")
    typer.echo(f"model {manifest.model_id}, content id {manifest.content_id}")
    typer.echo(f"serve a range with: swarmd run --model {out} --layers START:END")


def _write_shards(
    source: str,
    out: Path,
    stages: int | None,
    ranges: str | None,
    model_id: str | None,
    weights: str | None,
    chunk_bytes: int,
    cache_dir: Path | None,
) -> Manifest:
    from swarmd.config import default_cache_dir
    from swarmd.dtypes import AUTO, WEIGHT_FORMATS
    from swarmd.errors import ConfigError
    from swarmd.model.manifest import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
    from swarmd.model.shards import ShardPlan, even_ranges, parse_ranges, read_config, write_shards
    from swarmd.model.source import resolve_folder

    if (stages is None) == (ranges is None):
        raise ConfigError("give either --stages N or --ranges A:B,B:C,...")
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ConfigError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ConfigError(f"--chunk-bytes must be in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}")
    resolved = resolve_folder(source, cache_dir or default_cache_dir(), weights or AUTO)
    if resolved.manifest is not None:
        raise ConfigError(f"{source} is already sharded; shard the original model instead")
    num_layers = int(read_config(resolved.model_dir)["num_hidden_layers"])  # type: ignore[call-overload]
    layer_ranges = (
        even_ranges(num_layers, stages)
        if stages is not None
        else parse_ranges(ranges or "", num_layers)
    )
    plan = ShardPlan(
        model_id=model_id or resolved.model_id,
        source_dir=resolved.model_dir,
        ranges=tuple(layer_ranges),
        out_dir=out,
        weights=weights or AUTO,
        chunk_bytes=chunk_bytes,
    )
    return write_shards(plan)


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)
