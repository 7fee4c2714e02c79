"""The stage protocol's frames, built and checked here (pure: no I/O).

One session is a ring of streams on `/swarmd/stage/1`: coordinator -> stage 0 -> ... ->
last stage -> coordinator. Each stream starts with one frame saying what it is:

    open   {"t": "open", "sid", "hop", "route": [[peer, start, end], ...],
            "addrs": {peer: [multiaddr, ...]}, "coord", "model", "max_len",
            "sampling": {...}, "history": <int32 bytes>}       upstream -> stage `hop`
    ret    {"t": "ret", "sid"}                                  last stage -> coordinator

then, downstream, one frame per chunk of tokens:

    step   {"t": "step", "n", "want", "alone", "ids": <int32 bytes>, "ms": [..], "ab"}
    step   {"t": "step", "n", "want", "alone", "h": <bytes>, "dt", "shape": [T, H], "ms", "ab"}
    tok    {"t": "tok", "n", "id", "ms", "ab"}      the last stage's answer (id -1: none)
    end    {"t": "end"}                             the session is over, free it

`ms` lists each stage's compute milliseconds for this step so far, `ab` the activation
bytes sent between stages. A stage that sees something fail sends

    fail   {"t": "fail", "peer", "why", "kind"}     kind: lost | bad | refused

towards the coordinator: upstream when its next stage is lost, downstream (on through the
last stage's return stream) when what came from upstream is bad or was cut. The report
moves away from the peer it names, so a faulty peer cannot swallow it.

Everything here comes from peers: every field is checked, explicitly, before use.
Structural garbage raises `MalformedFrameError` (the sender is banned); a well-formed
request this node cannot serve raises `StageRefusedError` (answered, nobody banned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.dtypes import COMPUTE_DTYPES, dtype_name, torch_dtype
from swarmd.errors import MalformedFrameError, StageRefusedError
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import SamplingParams

STAGE_PROTOCOL = "/swarmd/stage/1"

MAX_SID_CHARS = 64
MAX_ROUTE_STAGES = 64
MAX_ADDRS_PER_PEER = 8
MAX_ADDR_CHARS = 256
MAX_PEER_ID_CHARS = 128
MAX_STEP_TOKENS = 1024  # tokens in one step frame (prefill chunks are smaller)
MAX_WHY_CHARS = 500
MAX_LOGIT_BIAS = 1024
FAIL_KINDS = ("lost", "bad", "refused")


@dataclass(frozen=True)
class RouteHop:
    peer_id: str
    start: int
    end: int

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.start, self.end)


@dataclass(frozen=True)
class OpenRequest:
    sid: str
    hop: int  # this stage's index in `route`
    route: tuple[RouteHop, ...]
    addrs: dict[str, tuple[str, ...]]  # how to reach the route's peers and the coordinator
    coordinator: str
    model_id: str
    max_length: int
    sampling: SamplingParams
    history: tuple[int, ...]  # reply tokens so far (a session rebuilt after a failover)

    @property
    def me(self) -> RouteHop:
        return self.route[self.hop]

    @property
    def is_last(self) -> bool:
        return self.hop == len(self.route) - 1

    @property
    def next_peer(self) -> str:
        """Where this stage sends its output: the next stage, or the coordinator."""
        return self.coordinator if self.is_last else self.route[self.hop + 1].peer_id


@dataclass(frozen=True)
class StageLimits:
    """What this node holds and accepts; the checks of `parse_open` and `parse_step`."""

    peer_id: str
    model_id: str
    held: LayerRange
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int


@dataclass(frozen=True)
class Step:
    n: int
    want: bool
    inputs: torch.Tensor  # [1, T] ids on the first stage, else [1, T, H]
    stage_ms: tuple[float, ...]
    activation_bytes: int
    alone: bool = False  # attend each position as a one-token step would


@dataclass(frozen=True)
class Fail:
    peer_id: str
    why: str
    kind: str


@dataclass(frozen=True)
class TokenReply:
    n: int
    token: int | None
    stage_ms: tuple[float, ...]
    activation_bytes: int


# --- building ---------------------------------------------------------------------------


def ints_to_bytes(values: list[int] | tuple[int, ...]) -> bytes:
    return torch.tensor(list(values), dtype=torch.int32).numpy().tobytes()


def open_frame(req: OpenRequest) -> dict[str, Any]:
    s = req.sampling
    return {
        "t": "open",
        "sid": req.sid,
        "hop": req.hop,
        "route": [[h.peer_id, h.start, h.end] for h in req.route],
        "addrs": {peer: list(addrs) for peer, addrs in req.addrs.items()},
        "coord": req.coordinator,
        "model": req.model_id,
        "max_len": req.max_length,
        "sampling": {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "logit_bias": [[int(k), float(v)] for k, v in s.logit_bias.items()],
            "seed": s.seed,
        },
        "history": ints_to_bytes(req.history),
    }


def step_frame(
    n: int,
    want: bool,
    inputs: torch.Tensor,
    stage_ms: list[float],
    activation_bytes: int,
    alone: bool = False,
) -> dict[str, Any]:
    """inputs: [1, T] token ids (to the first stage) or [1, T, H] hidden states. `alone`:
    attend each position as a one-token step would (a failover's replay of a reply)."""
    frame: dict[str, Any] = {"t": "step", "n": n, "want": want, "alone": alone, "ms": stage_ms}
    if inputs.dim() == 2:
        frame["ids"] = inputs[0].to(torch.int32).numpy().tobytes()
    else:
        hidden = inputs[0].contiguous()  # [T, H]
        frame["dt"] = dtype_name(hidden.dtype)  # hidden states travel in a compute dtype
        frame["shape"] = [int(hidden.shape[0]), int(hidden.shape[1])]
        # bfloat16 has no numpy dtype: ship its raw 16-bit words.
        raw = hidden.view(torch.int16) if hidden.dtype == torch.bfloat16 else hidden
        frame["h"] = raw.numpy().tobytes()
        activation_bytes += len(frame["h"])
    frame["ab"] = activation_bytes
    return frame


def token_frame(
    n: int, token: int | None, stage_ms: list[float], activation_bytes: int
) -> dict[str, Any]:
    return {
        "t": "tok",
        "n": n,
        "id": -1 if token is None else token,
        "ms": stage_ms,
        "ab": activation_bytes,
    }


def fail_frame(peer_id: str, why: str, kind: str) -> dict[str, Any]:
    return {"t": "fail", "peer": peer_id, "why": why[:MAX_WHY_CHARS], "kind": kind}


END_FRAME: dict[str, Any] = {"t": "end"}


def ret_frame(sid: str) -> dict[str, Any]:
    return {"t": "ret", "sid": sid}


# --- checking ---------------------------------------------------------------------------


def is_dialable(peer_id: str, addr: str) -> bool:
    """An address an `open` frame may name for a peer: a full multiaddr of that peer."""
    return len(addr) <= MAX_ADDR_CHARS and addr.startswith("/") and addr.endswith(f"/p2p/{peer_id}")


def frame_type(frame: dict[str, Any]) -> str:
    kind = frame.get("t")
    if kind not in ("open", "ret", "step", "tok", "end", "fail"):
        raise MalformedFrameError(f"stage frame of unknown type {str(kind)[:20]!r}")
    return str(kind)


def parse_open(frame: dict[str, Any], limits: StageLimits) -> OpenRequest:
    _exact_keys(
        frame,
        {"t", "sid", "hop", "route", "addrs", "coord", "model", "max_len", "sampling", "history"},
    )
    sid = _sid(frame["sid"])
    route = _route(frame["route"], limits.num_layers)
    hop = _int(frame["hop"], "hop", 0, len(route) - 1)
    coordinator = _peer_id(frame["coord"], "coord")
    addrs = _addrs(frame["addrs"])
    model_id = _str(frame["model"], "model", 200)
    max_length = _int(frame["max_len"], "max_len", 1, 10**7)
    sampling = _sampling(frame["sampling"], limits.vocab_size)
    history = tuple(_ints(frame["history"], "history", limits.vocab_size, 10**7))
    req = OpenRequest(sid, hop, route, addrs, coordinator, model_id, max_length, sampling, history)
    me = req.me
    if me.peer_id != limits.peer_id:
        raise MalformedFrameError(f"open for hop {hop} names peer {me.peer_id[-8:]}, not this one")
    if model_id != limits.model_id:
        raise StageRefusedError(f"this node does not serve model '{model_id[:80]}'")
    if not (limits.held.start <= me.start and me.end <= limits.held.end):
        raise StageRefusedError(f"this node holds layers {limits.held}, not {me.layers}")
    if max_length > limits.context_length:
        raise StageRefusedError(
            f"max_len {max_length} is over the model's context of {limits.context_length}"
        )
    return req


def parse_step(
    frame: dict[str, Any], expected_n: int, first: bool, limits: StageLimits, dtype: torch.dtype
) -> Step:
    """A step for this stage: ids when it is the route's first, else a hidden state."""
    keys = {"t", "n", "want", "alone", "ms", "ab"} | ({"ids"} if first else {"h", "dt", "shape"})
    _exact_keys(frame, keys)
    n = _int(frame["n"], "n", 0, 2**62)
    if n != expected_n:
        raise MalformedFrameError(f"step {n} arrived where step {expected_n} was due")
    want, alone = frame["want"], frame["alone"]
    if not isinstance(want, bool) or not isinstance(alone, bool):
        raise MalformedFrameError("step 'want' or 'alone' is not a bool")
    stage_ms = _stage_ms(frame["ms"])
    ab = _int(frame["ab"], "ab", 0, 2**62)
    if first:
        ids = _ints(frame["ids"], "ids", limits.vocab_size, MAX_STEP_TOKENS)
        if not ids:
            raise MalformedFrameError("a step of no tokens")
        inputs = torch.tensor([ids], dtype=torch.long)  # [1, T]
    else:
        inputs = parse_hidden(frame, limits.hidden_size, dtype)
    return Step(n, want, inputs, stage_ms, ab, alone)


def parse_hidden(frame: dict[str, Any], hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The [1, T, H] hidden state of a step frame, checked and cast to `dtype`."""
    name = frame.get("dt")
    if not isinstance(name, str) or name not in COMPUTE_DTYPES:
        raise MalformedFrameError(f"hidden state of unknown dtype {str(name)[:20]!r}")
    wire_dtype = torch_dtype(name)
    shape = frame.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or not all(type(x) is int for x in shape):
        raise MalformedFrameError("hidden state shape is not [tokens, hidden]")
    tokens, width = shape
    if not 1 <= tokens <= MAX_STEP_TOKENS:
        raise MalformedFrameError(f"hidden state of {tokens} tokens (1..{MAX_STEP_TOKENS})")
    if width != hidden_size:
        raise MalformedFrameError(f"hidden state {width} wide, this model is {hidden_size}")
    raw = frame.get("h")
    itemsize = wire_dtype.itemsize
    if not isinstance(raw, bytes) or len(raw) != tokens * width * itemsize:
        raise MalformedFrameError(
            f"hidden state of {len(raw) if isinstance(raw, bytes) else '?'} bytes, "
            f"its shape and dtype say {tokens * width * itemsize}"
        )
    storage = torch.int16 if wire_dtype == torch.bfloat16 else wire_dtype
    hidden = torch.frombuffer(bytearray(raw), dtype=storage).view(wire_dtype)
    if not bool(torch.isfinite(hidden).all()):
        raise MalformedFrameError("hidden state holds NaN or Inf")
    return hidden.reshape(1, tokens, width).to(dtype)  # [1, T, H]


def parse_token(frame: dict[str, Any], expected_n: int, vocab_size: int, want: bool) -> TokenReply:
    _exact_keys(frame, {"t", "n", "id", "ms", "ab"})
    n = _int(frame["n"], "n", 0, 2**62)
    if n != expected_n:
        raise MalformedFrameError(f"token for step {n} arrived where step {expected_n} was due")
    token = _int(frame["id"], "id", -1, vocab_size - 1)
    if want and token < 0:
        raise MalformedFrameError("no token where one was asked for")
    return TokenReply(
        n, token if want else None, _stage_ms(frame["ms"]), _int(frame["ab"], "ab", 0, 2**62)
    )


def parse_fail(frame: dict[str, Any]) -> Fail:
    _exact_keys(frame, {"t", "peer", "why", "kind"})
    kind = frame["kind"]
    if kind not in FAIL_KINDS:
        raise MalformedFrameError(f"fail report of unknown kind {str(kind)[:20]!r}")
    return Fail(
        _peer_id(frame["peer"], "peer"), _str(frame["why"], "why", MAX_WHY_CHARS), str(kind)
    )


def parse_ret(frame: dict[str, Any]) -> str:
    _exact_keys(frame, {"t", "sid"})
    return _sid(frame["sid"])


# --- field checks -----------------------------------------------------------------------


def _exact_keys(frame: dict[str, Any], keys: set[str]) -> None:
    if set(frame) != keys:
        odd = sorted(set(frame) ^ keys)[:5]
        raise MalformedFrameError(f"{frame.get('t')!s:.10} frame with wrong fields: {odd}")


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise MalformedFrameError(f"'{name}' is not an integer in {lo}..{hi}")
    return value


def _float(value: Any, name: str, lo: float, hi: float) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise MalformedFrameError(f"'{name}' is not a number in {lo}..{hi}")
    return float(value)


def _str(value: Any, name: str, max_chars: int) -> str:
    if not isinstance(value, str) or len(value) > max_chars:
        raise MalformedFrameError(f"'{name}' is not a string of at most {max_chars} characters")
    return value


def _sid(value: Any) -> str:
    sid = _str(value, "sid", MAX_SID_CHARS)
    if not sid or not all((c.isascii() and c.isalnum()) or c in "-_." for c in sid):
        raise MalformedFrameError("'sid' must be 1+ characters of [A-Za-z0-9-_.]")
    return sid


def _peer_id(value: Any, name: str) -> str:
    peer = _str(value, name, MAX_PEER_ID_CHARS)
    if not peer or not (peer.isascii() and peer.isalnum()):
        raise MalformedFrameError(f"'{name}' is not a peer id")
    return peer


def _ints(value: Any, name: str, upper: int, max_count: int) -> list[int]:
    """int32 little-endian bytes -> ints in [0, upper)."""
    if not isinstance(value, bytes) or len(value) % 4 or len(value) // 4 > max_count:
        raise MalformedFrameError(f"'{name}' is not int32 bytes of at most {max_count} items")
    if not value:
        return []
    ids = torch.frombuffer(bytearray(value), dtype=torch.int32)
    if int(ids.min()) < 0 or int(ids.max()) >= upper:
        raise MalformedFrameError(f"'{name}' holds a token id outside 0..{upper - 1}")
    return ids.tolist()


def _stage_ms(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) > MAX_ROUTE_STAGES:
        raise MalformedFrameError(f"'ms' is not a list of at most {MAX_ROUTE_STAGES} numbers")
    return tuple(_float(v, "ms", 0.0, 1e9) for v in value)


def _route(value: Any, num_layers: int) -> tuple[RouteHop, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ROUTE_STAGES:
        raise MalformedFrameError(f"'route' is not a list of 1..{MAX_ROUTE_STAGES} stages")
    hops: list[RouteHop] = []
    at = 0
    for item in value:
        if not isinstance(item, list) or len(item) != 3:
            raise MalformedFrameError("a route stage is [peer, start, end]")
        peer = _peer_id(item[0], "route peer")
        start = _int(item[1], "route start", 0, num_layers - 1)
        end = _int(item[2], "route end", start + 1, num_layers)
        if start != at:
            raise MalformedFrameError("route stages do not cover the layers in order")
        at = end
        hops.append(RouteHop(peer, start, end))
    if at != num_layers:
        raise MalformedFrameError(f"route ends at layer {at}, the model has {num_layers}")
    if len({h.peer_id for h in hops}) != len(hops):
        raise MalformedFrameError("a peer appears twice in the route")
    return tuple(hops)


def _addrs(value: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict) or len(value) > MAX_ROUTE_STAGES + 1:
        raise MalformedFrameError("'addrs' is not a map of peers to addresses")
    out: dict[str, tuple[str, ...]] = {}
    for peer, addrs in value.items():
        _peer_id(peer, "addrs peer")
        if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS_PER_PEER:
            raise MalformedFrameError(f"addresses of a peer: a list of <= {MAX_ADDRS_PER_PEER}")
        if not all(isinstance(a, str) and is_dialable(peer, a) for a in addrs):
            raise MalformedFrameError(
                f"an address is not a multiaddr of <= {MAX_ADDR_CHARS} characters ending in "
                "/p2p/<its peer>"
            )
        out[peer] = tuple(addrs)
    return out


def _sampling(value: Any, vocab_size: int) -> SamplingParams:
    keys = {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "seed",
    }
    if not isinstance(value, dict):
        raise MalformedFrameError("'sampling' is not a map")
    if set(value) != keys:
        raise MalformedFrameError(f"sampling with wrong fields: {sorted(set(value) ^ keys)[:5]}")
    bias_items = value["logit_bias"]
    if not isinstance(bias_items, list) or len(bias_items) > MAX_LOGIT_BIAS:
        raise MalformedFrameError(f"'logit_bias' is a list of at most {MAX_LOGIT_BIAS} pairs")
    bias: dict[int, float] = {}
    for pair in bias_items:
        if not isinstance(pair, list) or len(pair) != 2:
            raise MalformedFrameError("a logit_bias entry is [token, value]")
        bias[_int(pair[0], "logit_bias token", 0, vocab_size - 1)] = _float(
            pair[1], "logit_bias value", -100.0, 100.0
        )
    seed = value["seed"]
    if seed is not None and (type(seed) is not int or not -(2**63) <= seed < 2**64):
        raise MalformedFrameError("'seed' is not a 64-bit integer")
    return SamplingParams(
        temperature=_float(value["temperature"], "temperature", 0.0, 100.0),
        top_p=_float(value["top_p"], "top_p", 0.0, 1.0),
        top_k=_int(value["top_k"], "top_k", 0, vocab_size),
        min_p=_float(value["min_p"], "min_p", 0.0, 1.0),
        presence_penalty=_float(value["presence_penalty"], "presence_penalty", -2.0, 2.0),
        frequency_penalty=_float(value["frequency_penalty"], "frequency_penalty", -2.0, 2.0),
        logit_bias=bias,
        seed=seed,
    )
