"""The node's configuration: one frozen dataclass and the function that fills it.

Precedence, highest first: CLI flag > env var `SWARMD_<FIELD>` (e.g. `SWARMD_PORT`) >
TOML config file (flat keys equal to the field names) > default. The config file is the
`config_file` argument, else the file named by env `SWARMD_CONFIG`, else none.

The one exception is `serve`, the models a node serves (`ServeSpec`s): it comes from
repeated `--model` flags or from `[[serve]]` tables in the file, never from the environment.

The environment is passed in by the caller, read once at start-up; nothing here reads
`os.environ` or the disk at import. Ranges are checked by `load_config`, not by `Config`
itself, so tests may build e.g. `Config(port=0)` for an ephemeral port.
"""

from __future__ import annotations

import difflib
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_type_hints

import platformdirs

from swarmd.dtypes import AUTO, COMPUTE_DTYPES, WEIGHT_FORMATS
from swarmd.errors import ConfigError

ENV_PREFIX = "SWARMD_"
CONFIG_ENV_VAR = "SWARMD_CONFIG"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("swarmd"))


def default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("swarmd"))


@dataclass(frozen=True)
class ServeSpec:
    """One model a node serves: which, which layers, in which format."""

    model: str
    layers: str = ""  # as Config.layers: "" every layer, "START:END", "auto"
    weights: str = "auto"  # as Config.weights
    dtype: str = "auto"  # as Config.dtype
    memory_budget_gb: float | None = None  # None: Config.memory_budget_gb


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"  # API listen address
    port: int = 8800  # API port
    model: str = "smollm2-135m-instruct"  # model id or path (HF dir with safetensors, or .gguf)
    no_model: bool = False  # hold no model: join, answer for the swarm's models, hold no layers
    serve: tuple[ServeSpec, ...] = ()  # the models to serve, in order; () = the one named by
    # the flat model / layers / weights / dtype fields
    data_dir: Path = field(default_factory=_default_data_dir)  # identity key, node state
    # (load_config defaults it to <user data dir>/node-<port>: one identity per node)
    cache_dir: Path = field(default_factory=default_cache_dir)  # converted models, per user
    weights: str = (
        "auto"  # layer matrices held as int4 | int8 | bf16 | fp16 | fp32; auto: as the file
    )
    dtype: str = "auto"  # matrix kernels compute in float32 | float16 | bfloat16; auto: by weights
    torch_threads: int = 0  # 0 = one per physical core
    native_kernels: bool = True  # swarmd's int4/int8/attention kernels (AVX512-BF16)
    prefill_chunk_tokens: int = 256  # prompt tokens per forward step
    max_sessions: int = 32  # sessions in flight on this node (they share its forwards)
    max_remote_sessions: int = 64  # other peers' stage sessions here at once, on top of
    # max_sessions (so peers never take this node's own slots)
    max_peer_sessions: int = 32  # stage sessions one peer may hold here at once
    remote_kv_share: float = 0.75  # of the KV budget, what other peers' sessions may hold
    # together (the rest is kept for this node's own requests)
    peer_kv_share: float = 0.5  # of the KV budget, what one peer's sessions may hold
    queue_timeout_s: float = 300.0  # a request waiting longer for room gets 503
    kv_budget_tokens: int = 0  # KV cache tokens this node's layers hold; 0 = half the free
    # memory after loading
    prefix_cache_tokens: int = -1  # finished conversations' KV kept for their next turn
    # (on top of the budget); -1 = an eighth of the KV budget, 0 = off
    step_timeout_s: float = 60.0  # one forward step on the worker
    max_body_bytes: int = 1_048_576  # larger request bodies get 413
    require_api_token: bool = False  # refuse API requests without a token even before
    # one exists (tokens are enforced anyway once `swarmd token create` made one)
    allow_open_api: bool = False  # let a node listen beyond loopback with no API token
    allowed_origins: tuple[str, ...] = ()  # web origins (https://app.example) whose pages may
    # call this node from a browser; "*" = any. The node's own page is always allowed
    http_head_timeout_s: float = 10.0  # a request head must arrive within this
    http_body_timeout_s: float = 30.0  # and its body within this
    http_keepalive_timeout_s: float = 15.0  # an idle kept-alive connection is closed after
    max_connections: int = 1024  # open API connections in all; more get 503 and are closed
    max_connections_per_client: int = 256  # open API connections from one address
    max_queued_requests: int = 256  # requests waiting for a slot or for room; more get 503
    default_temperature: float = 1.0  # when a request names none (OpenAI's default)
    log_level: str = "INFO"  # one of LOG_LEVELS
    layers: str = ""  # "START:END" to serve part of the model; "" = every layer; "auto"
    memory_budget_gb: float = 0.0  # memory for this node's layers (--layers auto); 0 = free now
    max_file_transfers: int = 4  # model files served to peers at once
    max_peer_file_transfers: int = 2  # of those, to one peer at once
    upload_limit_mb_s: float = 0.0  # MB/s of model files served to peers; 0 = no limit
    fetch_timeout_s: float = 600.0  # a model file no peer can supply this long: give up
    p2p_host: str = "127.0.0.1"  # libp2p listen address (0.0.0.0 lets other machines in)
    p2p_port: int = -1  # libp2p TCP port; -1 = API port + 10 (any free port if port is 0)
    bootstrap: tuple[str, ...] = ()  # multiaddrs (/ip4/.../tcp/.../p2p/...) of swarm peers
    no_listen: bool = False  # take no inbound connection (behind NAT): dial out, and be
    # reached through a relay among the peers (a slot reserved there, its address announced)
    relay_service: bool = False  # relay circuits for peers that take no inbound connection
    # auto: peers dial this node back to find out whether it is reachable, and one behind
    # NAT takes a relay slot; public / private: take it as said (private: use a relay)
    reachability: str = "auto"
    relay_max_reservations: int = 32  # peers holding a relay slot here at once
    relay_max_circuits_per_peer: int = 8  # circuits to one such peer at once
    relay_circuit_duration_s: int = 3600  # one relayed circuit's life (0 = unlimited)
    relay_circuit_mb: int = 1024  # one relayed circuit's megabytes, both ways (0 = unlimited)
    announce_addrs: tuple[str, ...] = ()  # multiaddrs peers must dial to reach this node
    # (a forwarded port, a proxy), advertised instead of the listen address; its /p2p/ id
    # is appended
    swarm_key: str = ""  # file holding the private swarm's secret; "" = an open swarm
    record_ttl_s: float = 60.0  # lifetime of this node's DHT records
    republish_interval_s: float = 20.0  # how often they are renewed
    max_failovers: int = 3  # stage failures one distributed request survives
    session_idle_timeout_s: float = 120.0  # a stage frees a session idle this long
    stage_open_timeout_s: float = 20.0  # setting up a distributed session on its route

    def served(self) -> tuple[ServeSpec, ...]:
        """The models this node holds layers of, in order; () for a node with no model."""
        if self.no_model:
            return ()
        if self.serve:
            return self.serve
        return (ServeSpec(self.model, self.layers, self.weights, self.dtype, None),)

    def for_model(self, spec: ServeSpec) -> Config:
        """This config narrowed to one served model: the single-model form loading reads."""
        budget = self.memory_budget_gb if spec.memory_budget_gb is None else spec.memory_budget_gb
        return replace(
            self,
            model=spec.model,
            layers=spec.layers,
            weights=spec.weights,
            dtype=spec.dtype,
            memory_budget_gb=budget,
            serve=(),
        )


_TYPES: dict[str, type] = get_type_hints(Config)


def _finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _finite_non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


# field -> (accepts the value, what it must be); fields not named here take any value.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "host": (lambda v: v != "", "a non-empty address"),
    "port": (lambda v: 0 <= v <= 65535, "in 0..65535 (0 = any free port)"),
    "model": (lambda v: v != "", "a non-empty model id or path"),
    "weights": (
        lambda v: v in (AUTO, *WEIGHT_FORMATS),
        f"auto or one of {', '.join(WEIGHT_FORMATS)}",
    ),
    "dtype": (
        lambda v: v in (AUTO, *COMPUTE_DTYPES),
        f"auto or one of {', '.join(COMPUTE_DTYPES)}",
    ),
    "torch_threads": (lambda v: v >= 0, ">= 0 (0 = one per physical core)"),
    "prefill_chunk_tokens": (lambda v: v >= 1, ">= 1"),
    "max_sessions": (lambda v: v >= 1, ">= 1"),
    "max_remote_sessions": (lambda v: v >= 0, ">= 0 (0 = serve no other peer's sessions)"),
    "max_peer_sessions": (lambda v: v >= 1, ">= 1"),
    "remote_kv_share": (lambda v: math.isfinite(v) and 0 <= v <= 1, "in 0..1"),
    "peer_kv_share": (lambda v: math.isfinite(v) and 0 < v <= 1, "in 0..1, above 0"),
    "queue_timeout_s": (_finite_positive, "a finite number > 0"),
    "kv_budget_tokens": (lambda v: v >= 0, ">= 0 (0 = measured from free memory)"),
    "prefix_cache_tokens": (lambda v: v >= -1, ">= -1 (-1 = an eighth of the KV budget)"),
    "step_timeout_s": (_finite_positive, "a finite number > 0"),
    "max_body_bytes": (lambda v: v >= 1024, ">= 1024"),
    "allowed_origins": (
        lambda v: all(o == "*" or ("://" in o and not o.endswith("/")) for o in v),
        'origins like https://app.example or http://localhost:3000 (no path), or "*"',
    ),
    "http_head_timeout_s": (_finite_positive, "a finite number > 0"),
    "http_body_timeout_s": (_finite_positive, "a finite number > 0"),
    "http_keepalive_timeout_s": (_finite_positive, "a finite number > 0"),
    "max_connections": (lambda v: v >= 1, ">= 1"),
    "max_connections_per_client": (lambda v: v >= 1, ">= 1"),
    "max_queued_requests": (lambda v: v >= 1, ">= 1"),
    # The API's own bound (pipeline/bounds.py): a default above it would be refused.
    "default_temperature": (lambda v: math.isfinite(v) and 0 <= v <= 2, "in 0..2"),
    "log_level": (lambda v: v in LOG_LEVELS, f"one of {', '.join(LOG_LEVELS)}"),
    "layers": (
        lambda v: v in ("", "auto") or v.count(":") == 1,
        "START:END (e.g. 0:15), auto, or empty",
    ),
    "memory_budget_gb": (_finite_non_negative, "a finite number >= 0"),
    "max_file_transfers": (lambda v: v >= 1, ">= 1"),
    "max_peer_file_transfers": (lambda v: v >= 1, ">= 1"),
    "upload_limit_mb_s": (_finite_non_negative, "a finite number >= 0"),
    "fetch_timeout_s": (_finite_positive, "a finite number > 0"),
    "p2p_host": (lambda v: v != "", "a non-empty address"),
    "p2p_port": (lambda v: -1 <= v <= 65535, "in -1..65535 (-1 = API port + 10, 0 = any)"),
    "bootstrap": (
        lambda v: all(a.startswith("/") and "/p2p/" in a for a in v),
        "multiaddrs with a peer id, like /ip4/1.2.3.4/tcp/8810/p2p/12D3KooW...",
    ),
    "reachability": (
        lambda v: v in ("auto", "public", "private"),
        "auto (peers dial this node back), public or private",
    ),
    "relay_max_reservations": (lambda v: 1 <= v <= 4096, "in 1..4096"),
    "relay_max_circuits_per_peer": (lambda v: 1 <= v <= 1024, "in 1..1024"),
    "relay_circuit_duration_s": (lambda v: v >= 0, ">= 0 (0 = unlimited)"),
    "relay_circuit_mb": (lambda v: v >= 0, ">= 0 (0 = unlimited)"),
    "announce_addrs": (
        lambda v: len(v) <= 8 and all(a.startswith("/") and "/p2p/" not in a for a in v),
        "at most 8 multiaddrs without a peer id, like /ip4/203.0.113.7/tcp/8810 (the node "
        "appends its own)",
    ),
    "record_ttl_s": (lambda v: math.isfinite(v) and 5 <= v <= 3600, "in 5..3600 seconds"),
    "republish_interval_s": (_finite_positive, "a finite number > 0"),
    "max_failovers": (lambda v: 0 <= v <= 100, "in 0..100"),
    "session_idle_timeout_s": (_finite_positive, "a finite number > 0"),
    "stage_open_timeout_s": (_finite_positive, "a finite number > 0"),
}


def load_config(
    flags: Mapping[str, object], config_file: Path | None, env: Mapping[str, str]
) -> Config:
    """Build the Config from the flags the user gave, the environment and the config file.

    `flags` maps field names to values; None values are ignored. A str value is parsed like
    an env var, any other value must already have the field's type (`serve`: a tuple of
    ServeSpec, which replaces the file's [[serve]] tables).
    """
    unknown_flags = sorted(name for name in flags if name not in _TYPES)
    if unknown_flags:
        raise ConfigError(f"unknown flag(s): {', '.join(unknown_flags)}")
    file_values, file_source = _read_file(config_file, env)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # field -> where its value came from, for errors
    for name, kind in _TYPES.items():
        if name == "serve":  # a list of tables: read by _load_serve
            continue
        env_var = ENV_PREFIX + name.upper()
        flag = flags.get(name)
        if flag is not None:
            source = f"flag --{name.replace('_', '-')}"
            if isinstance(flag, str):
                value = _from_string(name, kind, flag, source)
            else:
                value = _from_value(name, kind, flag, source)
        elif env_var in env:
            source = f"env {env_var}"
            value = _from_string(name, kind, env[env_var], source)
        elif name in file_values:
            source = file_source
            value = _from_value(name, kind, file_values[name], source)
        else:
            continue
        _check_range(name, value, source)
        values[name] = value
        sources[name] = source
    serve = _load_serve(flags.get("serve"), env, file_values.get("serve"), file_source)
    if serve:
        values["serve"] = serve
        sources["serve"] = "flag --model" if flags.get("serve") is not None else file_source
    _check_no_model(values, sources)
    ttl = values.get("record_ttl_s", Config.record_ttl_s)
    if values.get("republish_interval_s", Config.republish_interval_s) >= ttl:
        raise ConfigError(
            f"republish_interval_s must be shorter than record_ttl_s ({ttl:g} s), or this "
            "node's records expire between renewals"
        )
    if "data_dir" not in values:
        # One identity per node: two nodes on one machine (ports 8800 and 8801) must not
        # share a key, or they would be one peer id.
        values["data_dir"] = _default_data_dir() / f"node-{values.get('port', Config.port)}"
    return Config(**values)


_SERVE_KEYS = tuple(f.name for f in fields(ServeSpec))
_SERVE_ENV_VAR = ENV_PREFIX + "SERVE"


def _load_serve(
    flag: object, env: Mapping[str, str], file_value: object, file_source: str
) -> tuple[ServeSpec, ...]:
    """The `serve` list: the flag's ServeSpecs, else the file's [[serve]] tables, checked."""
    if _SERVE_ENV_VAR in env:
        # A list of tables does not fit one variable; guessing a syntax would be a trap.
        raise ConfigError(
            f"env {_SERVE_ENV_VAR} is not read: name the models to serve in the config file "
            '([[serve]] tables with model = "...") or with repeated --model flags'
        )
    if flag is not None:
        specs, source = _serve_from_flag(flag), "flag --model"
    elif file_value is not None:
        specs, source = _serve_from_file(file_value, file_source), file_source
    else:
        return ()
    seen: set[str] = set()
    for spec in specs:
        if spec.model in seen:
            # Requests and records name a model by this string: two entries are ambiguous.
            raise ConfigError(
                f"serve: model {spec.model!r} is named twice (from {source}); name each model once"
            )
        seen.add(spec.model)
    return specs


def _serve_from_flag(flag: object) -> tuple[ServeSpec, ...]:
    if not isinstance(flag, list | tuple) or not all(isinstance(s, ServeSpec) for s in flag):
        raise ConfigError(
            f"serve: expected a tuple of ServeSpec, got {type(flag).__name__} {flag!r} "
            "(from flag --model)"
        )
    specs = []
    for spec in flag:
        checked: dict[str, Any] = {}
        for key in _SERVE_KEYS:
            value = getattr(spec, key)
            if value is not None:  # None: memory_budget_gb left to the node's own
                source = f"flag --{key.replace('_', '-')}"
                value = _from_value(key, _TYPES[key], value, source)
                _check_range(key, value, source)
            checked[key] = value
        specs.append(ServeSpec(**checked))
    return tuple(specs)


def _serve_from_file(value: object, file_source: str) -> tuple[ServeSpec, ...]:
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(
            f'serve: expected [[serve]] tables, each with model = "...", got '
            f"{type(value).__name__} {value!r} (from {file_source})"
        )
    specs = []
    for number, table in enumerate(value, start=1):
        where = f"[[serve]] table {number} of {file_source}"
        for key in table:
            if key not in _SERVE_KEYS:
                close = difflib.get_close_matches(key, _SERVE_KEYS, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(
                    f"unknown key '{key}' in {where} (it takes {', '.join(_SERVE_KEYS)}){hint}"
                )
        if "model" not in table:
            raise ConfigError(f'{where} has no model: each [[serve]] table needs model = "..."')
        checked: dict[str, Any] = {}
        for key, raw in table.items():
            checked[key] = _from_value(key, _TYPES[key], raw, where)
            _check_range(key, checked[key], where)
        specs.append(ServeSpec(**checked))
    return tuple(specs)


def _check_no_model(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """A node told to hold no model must not also be told which model or layers to hold."""
    if not values.get("no_model"):
        return
    for name in ("serve", "model", "layers"):
        if name in values:  # given explicitly; a default is no contradiction
            what = "the models to serve" if name == "serve" else name
            raise ConfigError(
                f"no_model (from {sources['no_model']}) holds no model, but {what} is set "
                f"too (from {sources[name]}): drop one of them"
            )


def _read_file(config_file: Path | None, env: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """The top-level keys of the config file and how to name it in errors; ({}, "") if none."""
    named_by = ""
    if config_file is None:
        if not env.get(CONFIG_ENV_VAR):
            return {}, ""
        config_file = Path(env[CONFIG_ENV_VAR])
        named_by = f" (named by env {CONFIG_ENV_VAR})"
    path = config_file.expanduser()
    source = f"config file {path}"
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"{source}{named_by} does not exist") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {source}{named_by}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}{named_by} is not valid TOML: {exc}") from exc

    for key in data:
        if key not in _TYPES:
            close = difflib.get_close_matches(key, _TYPES, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown key '{key}' in {source}{hint}")
    return data, source


_STR_TUPLE = tuple[str, ...]


def _from_string(name: str, kind: type, text: str, source: str) -> object:
    """Parse an env var (or a str flag) as the field's type."""
    if kind == _STR_TUPLE:  # a list in one variable: comma separated
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if kind is Path:
        return Path(text).expanduser()
    if kind is str:
        return text
    if kind is bool:
        word = text.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{name}: cannot read {text!r} as true or false (from {source})")
    try:
        return kind(text)
    except ValueError as exc:
        raise ConfigError(
            f"{name}: cannot read {text!r} as {kind.__name__} (from {source})"
        ) from exc


def _from_value(name: str, kind: type, value: object, source: str) -> object:
    """Check a TOML (or non-str flag) value against the field's type; no lossy conversions."""
    if isinstance(value, bool):  # bool is an int subclass: only a bool field takes one
        if kind is bool:
            return value
    elif kind == _STR_TUPLE:
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif kind is float and isinstance(value, int | float):
        return float(value)
    elif kind is Path and isinstance(value, str | os.PathLike):
        return Path(value).expanduser()
    elif isinstance(value, kind):
        return value
    kind_name = "list of strings" if kind == _STR_TUPLE else kind.__name__
    raise ConfigError(
        f"{name}: expected {kind_name}, got {type(value).__name__} {value!r} (from {source})"
    )


def _check_range(name: str, value: object, source: str) -> None:
    rule = _RULES.get(name)
    if rule is not None and not rule[0](value):
        raise ConfigError(f"{name} must be {rule[1]}, got {value!r} (from {source})")
