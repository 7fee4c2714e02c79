"""The stage protocol's frames, built and checked here (pure: no I/O).

One session is a ring of streams on `/swarmd/stage/1`: coordinator -> stage 0 -> ... ->
last stage -> coordinator. Each stream starts with one frame saying what it is:

    open   {"t": "open", "sid", "hop", "route": [[peer, start, end], ...],
            "addrs": {peer: [multiaddr, ...]}, "coord", "model", "max_len",
            "sampling": {...}, "history": <int32 bytes>,
            "keep"?: true, "resume"?: [sid, n], "copy"?: true}  upstream -> stage `hop`
    ret    {"t": "ret", "sid", "reused"?: n}                    last stage -> coordinator

then, downstream, one frame per chunk of tokens:

    step   {"t": "step", "n", "want", "alone", "ids": <int32 bytes>, "ms": [..], "ab"}
    step   {"t": "step", "n", "want", "alone", "h": <bytes>, "dt", "shape": [T, H], "ms", "ab"}
    tok    {"t": "tok", "n", "id", "ms", "ab"}      the last stage's answer (id -1: none)
    tok    {..., "lp", "top": [[id, lp], ...]}      with logprobs, when the session asked
    end    {"t": "end"}                             the session is over, free it

`sampling` may carry `top_logprobs` (logprobs asked for) and `grammar` ([kind, source]:
the reply is constrained to it; the last stage compiles it, and rebuilds its state from
`history` after a failover).

Prefix reuse on a route (since 0.4): `keep` asks each stage to keep the session's cache
when it ends; the coordinator's next turn of that conversation, on the same route, opens
with `resume` [that session's sid, n]: each stage takes the kept cache cut to n positions
and passes `resume` on only when it did, so the last stage's `ret` says `reused` n when
every stage holds the conversation's first n positions (0: the coordinator prefills from
the start on a fresh session). Kept caches answer only to the coordinator that made them.
With `copy` (since 0.5.2) each stage copies those n positions instead, and keeps the
conversation for its own next turn: a request that only shares a start with it (the same
system prompt, the same prompt again).

`ms` lists each stage's compute milliseconds for this step so far, `ab` the activation
bytes sent between stages. A stage that sees something fail sends

    fail   {"t": "fail", "peer", "why", "kind"}     kind: lost | bad | declined
    fail   {"t": "fail", "peer", "why", "kind": "refused", "status", "param"}

towards the coordinator: upstream when its next stage is lost, downstream (on through the
last stage's return stream) when what came from upstream is bad or was cut. The report
moves away from the peer it names, so a faulty peer cannot swallow it. `declined`: the
stage cannot take this session now or here (no KV room or slot, layers it no longer
holds); the coordinator routes around it. A `declined` whose `why` begins with `busy: `
(`BUSY`) says "no room now" (a KV reservation or session slot): a coordinator with no
other holder waits for room and asks again; any other says "not here", and the stage is
left out of the request (older coordinators read both as the latter). `refused`: the
*request* asked what the stage will not serve (`status` 400 or 413, `param` the
parameter): the request fails with that status, nobody is banned, nothing fails over.

Everything here comes from peers: every field is checked, explicitly, before use.
Structural garbage raises `MalformedFrameError` (the sender is banned); a well-formed
request this node cannot serve raises `StageRefusedError` (answered, nobody banned), and
one whose request asked for a value out of the bounds of `bounds` raises
`RequestRefusedError`. Text a peer chose (`why`) is made one printable line on parse.

Each frame above is declared once below, as a `Schema` of its fields (their types and
the bounds that need nothing but the field); its builder emits exactly those keys and
its parser reads them with `swarmd.untrusted`'s readers (every type error is
`MalformedFrameError`), then checks in code what spans fields or needs the node's
limits (route order, hop, vocabulary, shape against bytes) and, last, the refusals.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from swarmd.dtypes import COMPUTE_DTYPES, dtype_name, torch_dtype
from swarmd.errors import MalformedFrameError, RequestRefusedError, StageRefusedError
from swarmd.model.grammar import GRAMMAR_KINDS, MAX_GRAMMAR_BYTES, GrammarSpec
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import IMPOSSIBLE, MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs
from swarmd.net.safe_text import safe_text
from swarmd.pipeline import bounds
from swarmd.untrusted import (
    Bool,
    Bytes,
    Choice,
    Float,
    Int,
    List,
    Map,
    Nullable,
    Schema,
    Str,
    Struct,
    Tuple,
)

if TYPE_CHECKING:
    import torch

STAGE_PROTOCOL = "/swarmd/stage/1"

MAX_SID_CHARS = 64
MAX_ROUTE_STAGES = 64
MAX_ADDRS_PER_PEER = 8
MAX_ADDR_CHARS = 256
MAX_PEER_ID_CHARS = 128
MAX_STEP_TOKENS = bounds.MAX_STEP_TOKENS  # tokens in one step frame
MAX_WHY_CHARS = 500
MAX_LOGIT_BIAS = bounds.MAX_LOGIT_BIAS
MAX_CONTEXT_TOKENS = bounds.MAX_CONTEXT_TOKENS
FAIL_KINDS = ("lost", "bad", "declined", "refused")
REFUSAL_STATUSES = (400, 413)


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
    keep: bool = False  # keep the session's cache when it ends (a next turn resumes it)
    resume: tuple[str, int] | None = None  # (sid, n): take that kept cache's first n positions
    copy: bool = False  # with `resume`: copy those positions, the kept cache stays kept

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
    # Stages before 0.5 attend a chunk marked `alone` as one-token steps (a failover's
    # replay of a reply); since 0.5 every chunk attends so. Still sent and passed on for
    # older stages on a route.
    alone: bool = False


@dataclass(frozen=True)
class Fail:
    peer_id: str
    why: str
    kind: str
    status: int | None = None  # a refusal's HTTP status (400 | 413); None otherwise
    param: str | None = None  # the request parameter a refusal names, when one does


@dataclass(frozen=True)
class Ret:
    sid: str
    reused: int | None  # positions every stage resumed (None: the open did not ask)


@dataclass(frozen=True)
class TokenReply:
    n: int
    token: int | None
    stage_ms: tuple[float, ...]
    activation_bytes: int
    logprobs: TokenLogprobs | None = None


# --- the frames, each declared once ------------------------------------------------------

_ASCII_ALNUM = frozenset(string.ascii_letters + string.digits)
PEER_ID = Str(MAX_PEER_ID_CHARS, min_chars=1, alphabet=_ASCII_ALNUM)
SID = Str(MAX_SID_CHARS, min_chars=1, alphabet=_ASCII_ALNUM | frozenset("-_."))
COUNTER = Int(0, 2**62)  # a step number, a byte count
ANY_INT = Int()  # any int msgpack carries; what it means is checked after the field pass
NUMBER = Float()  # any finite number; its bound (a refusal) is checked after
STAGE_MS_ITEM = Float(0.0, 1e9)  # one stage's ms
STAGE_MS = List(STAGE_MS_ITEM, MAX_ROUTE_STAGES)
TOKEN_ID = Int(-1, 2**31 - 1)  # -1: none; below the vocabulary, checked after
GRAMMAR_SOURCE = Str(MAX_GRAMMAR_BYTES)  # what the text says is the grammar library's to check
TOKEN_IDS = Bytes(MAX_STEP_TOKENS, item_size=4, what="int32")

SAMPLING = Schema(
    "sampling",
    (
        *((b.name, NUMBER) for b in bounds.SAMPLING_NUMBERS),
        ("top_k", ANY_INT),
        # How many entries, and which tokens and values, is what the request asked.
        ("logit_bias", List(Tuple((("token", ANY_INT), ("value", NUMBER))), None)),
        ("seed", Nullable(ANY_INT)),
    ),
    (
        ("top_logprobs", Int(0, MAX_TOP_LOGPROBS)),  # present: logprobs asked for
        # The reply's grammar: its kind and source; whether it compiles is checked after.
        (
            "grammar",
            Tuple((("kind", Choice(GRAMMAR_KINDS, "grammar kind")), ("source", GRAMMAR_SOURCE))),
        ),
    ),
)
OPEN = Schema(
    "open frame",
    (
        ("t", Choice(("open",))),
        ("sid", SID),
        ("hop", Int(0, MAX_ROUTE_STAGES - 1)),
        (
            "route",
            List(
                Tuple((("peer", PEER_ID), ("start", Int(0)), ("end", Int(0)))),
                MAX_ROUTE_STAGES,
                min_len=1,
            ),
        ),
        (
            "addrs",
            Map(PEER_ID, List(Str(MAX_ADDR_CHARS), MAX_ADDRS_PER_PEER), MAX_ROUTE_STAGES + 1),
        ),
        ("coord", PEER_ID),
        ("model", Str(200)),
        ("max_len", Int(1, MAX_CONTEXT_TOKENS)),
        ("sampling", Struct(SAMPLING)),
        ("history", Bytes(MAX_CONTEXT_TOKENS, item_size=4, what="int32")),
    ),
    (
        ("keep", Bool()),
        ("resume", Tuple((("sid", SID), ("n", Int(1, MAX_CONTEXT_TOKENS))))),
        ("copy", Bool()),
    ),
)
RET = Schema(
    "ret frame",
    (("t", Choice(("ret",))), ("sid", SID)),
    (("reused", Int(0, MAX_CONTEXT_TOKENS)),),
)
_STEP_COMMON = (
    ("t", Choice(("step",))),
    ("n", COUNTER),
    ("want", Bool()),
    ("alone", Bool()),
    ("ms", STAGE_MS),
    ("ab", COUNTER),
)
STEP_IDS = Schema("step frame", (*_STEP_COMMON, ("ids", TOKEN_IDS)))
HIDDEN = Schema(
    "hidden state",
    (
        ("dt", Choice(tuple(COMPUTE_DTYPES), "hidden state dtype")),
        ("shape", Tuple((("tokens", ANY_INT), ("hidden", ANY_INT)))),
        ("h", Bytes(2**62)),  # its size is what shape and dtype say, checked after
    ),
)
STEP_HIDDEN = Schema("step frame", (*_STEP_COMMON, *HIDDEN.required))
TOK = Schema(
    "tok frame",
    (
        ("t", Choice(("tok",))),
        ("n", COUNTER),
        ("id", TOKEN_ID),
        ("ms", STAGE_MS),
        ("ab", COUNTER),
    ),
    (
        # The token's logprob and the likeliest tokens' (id, logprob), when asked for.
        ("lp", Float(IMPOSSIBLE, 0.0)),
        ("top", List(Tuple((("id", ANY_INT), ("lp", Float(IMPOSSIBLE, 0.0)))), MAX_TOP_LOGPROBS)),
    ),
)
END = Schema("end frame", (("t", Choice(("end",))),))
_FAIL_COMMON = (
    ("t", Choice(("fail",))),
    ("peer", PEER_ID),
    ("why", Str(MAX_WHY_CHARS)),  # made one printable line after
)
FAIL = Schema("fail frame", (*_FAIL_COMMON, ("kind", Choice(FAIL_KINDS[:3], "fail kind"))))
REFUSAL = Schema(
    "fail frame",
    (
        *_FAIL_COMMON,
        ("kind", Choice(("refused",), "fail kind")),
        ("status", Choice(REFUSAL_STATUSES, "refusal status")),
        ("param", Nullable(Choice(tuple(sorted(bounds.PARAMS)), "request parameter"))),
    ),
)


# --- a step's frames as honest peers send them, read at once ------------------------------
# Every stage reads a step frame, and the coordinator a token frame, on every token, in a
# thread just woken with cold caches, where the schema's reader calls (one a field) cost
# 85-140 us a frame against 6 us warm (10 ms idle before each read, as between a ring's
# tokens). These predicates take the one shape an honest peer sends, with the schemas'
# own bounds, and nothing a schema would refuse (test_wire checks it on mutated frames);
# any other frame is read by the schema, whose error says what is wrong.


def _span(reader: Int | Float) -> tuple[Any, Any]:
    if reader.lo is None or reader.hi is None:
        raise ValueError("a reader bounded on both sides")
    return reader.lo, reader.hi


_COUNTER_LO, _COUNTER_HI = _span(COUNTER)
_MS_LO, _MS_HI = _span(STAGE_MS_ITEM)
_TOKEN_ID_LO, _TOKEN_ID_HI = _span(TOKEN_ID)


def _counter(value: Any) -> bool:
    return type(value) is int and _COUNTER_LO <= value <= _COUNTER_HI


def _stage_ms(value: Any) -> bool:
    return (
        type(value) is list
        and len(value) <= MAX_ROUTE_STAGES
        and all(type(v) is float and _MS_LO <= v <= _MS_HI for v in value)
    )


def plain_step(frame: Any, first: bool) -> bool:
    """Whether `frame` is a step frame (of ids when `first`, else of a hidden state) in
    the plain shape, which `STEP_IDS` / `STEP_HIDDEN` would read unchanged."""
    if type(frame) is not dict or frame.keys() != (STEP_IDS if first else STEP_HIDDEN).keys:
        return False
    t = frame["t"]
    if not (
        type(t) is str
        and t == "step"
        and _counter(frame["n"])
        and _counter(frame["ab"])
        and type(frame["want"]) is bool
        and type(frame["alone"]) is bool
        and _stage_ms(frame["ms"])
    ):
        return False
    if first:
        ids = frame["ids"]
        return type(ids) is bytes and not len(ids) % 4 and len(ids) // 4 <= TOKEN_IDS.max_items
    dt, shape = frame["dt"], frame["shape"]
    return (
        type(dt) is str
        and dt in COMPUTE_DTYPES
        and type(shape) is list
        and len(shape) == 2
        and type(shape[0]) is int
        and type(shape[1]) is int
        and type(frame["h"]) is bytes
    )


def plain_tok(frame: Any) -> bool:
    """Whether `frame` is a token frame without logprobs in the plain shape, which `TOK`
    would read unchanged."""
    if type(frame) is not dict or frame.keys() != TOK.required_keys:
        return False
    t, token = frame["t"], frame["id"]
    return (
        type(t) is str
        and t == "tok"
        and _counter(frame["n"])
        and type(token) is int
        and _TOKEN_ID_LO <= token <= _TOKEN_ID_HI
        and _stage_ms(frame["ms"])
        and _counter(frame["ab"])
    )


def _build(schema: Schema, **fields: Any) -> dict[str, Any]:
    return schema.check_keys(fields)


def _read(schema: Schema, frame: Any) -> dict[str, Any]:
    return schema.read(frame, MalformedFrameError)


# --- building ---------------------------------------------------------------------------


def ints_to_bytes(values: list[int] | tuple[int, ...]) -> bytes:
    """int32 little-endian, as `_ints` reads them (numpy: a coordinator has no torch)."""
    return np.asarray(values, dtype="<i4").tobytes()


# Optional `sampling` keys and the swarmd version whose stages first read them. An older
# stage refuses a frame holding one as malformed (and bans its sender), so a request that
# needs one is routed only through stages whose records say they read it.
SAMPLING_KEYS_SINCE: dict[str, tuple[int, ...]] = {"top_logprobs": (0, 2), "grammar": (0, 2)}
# The first swarmd whose stages read `keep` and `resume` (and whose `ret` says `reused`).
RESUME_SINCE = (0, 4)
# The first whose stages take a tool-call grammar with an `answer` (tools beside a JSON
# response_format); an older one refuses that format (a 400, nobody banned), so such a
# request is routed past it.
ANSWER_SINCE = (0, 5, 1)
# The first whose stages read `copy` beside `resume` (a shared start copied, not taken).
COPY_SINCE = (0, 5, 2)


def reads_resume(version: str) -> bool:
    """Whether a stage of swarmd `version` reads `keep` and `resume` in an open."""
    return version_tuple(version) >= RESUME_SINCE


def reads_copy(version: str) -> bool:
    """Whether a stage of swarmd `version` reads `copy` in an open."""
    return version_tuple(version) >= COPY_SINCE


def version_tuple(version: str) -> tuple[int, ...]:
    """ "0.2.0" -> (0, 2, 0); each part's leading digits ("1rc2" -> 1); unreadable: (0,)."""
    parts: list[int] = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts) or (0,)


def reads_sampling(version: str, sampling: SamplingParams) -> bool:
    """Whether a stage of swarmd `version` reads every optional key `sampling` travels with."""
    present = [
        key
        for key, value in (("top_logprobs", sampling.top_logprobs), ("grammar", sampling.grammar))
        if value is not None
    ]
    have = version_tuple(version)
    if sampling.grammar is not None and sampling.grammar.has_answer and have < ANSWER_SINCE:
        return False
    return all(have >= SAMPLING_KEYS_SINCE[key] for key in present)


def open_frame(req: OpenRequest) -> dict[str, Any]:
    s = req.sampling
    sampling = _build(
        SAMPLING,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=[[int(k), float(v)] for k, v in s.logit_bias.items()],
        seed=s.seed,
        **({} if s.top_logprobs is None else {"top_logprobs": s.top_logprobs}),
        **({} if s.grammar is None else {"grammar": [s.grammar.kind, s.grammar.source]}),
    )
    return _build(
        OPEN,
        t="open",
        sid=req.sid,
        hop=req.hop,
        route=[[h.peer_id, h.start, h.end] for h in req.route],
        addrs={peer: list(addrs) for peer, addrs in req.addrs.items()},
        coord=req.coordinator,
        model=req.model_id,
        max_len=req.max_length,
        sampling=sampling,
        history=ints_to_bytes(req.history),
        **({"keep": True} if req.keep else {}),
        **({} if req.resume is None else {"resume": [req.resume[0], req.resume[1]]}),
        **({"copy": True} if req.copy and req.resume is not None else {}),
    )


def step_frame(
    n: int,
    want: bool,
    inputs: torch.Tensor | list[int],
    stage_ms: list[float],
    activation_bytes: int,
    alone: bool = False,
) -> dict[str, Any]:
    """inputs: token ids (to the first stage: a list, or a [1, T] tensor) or [1, T, H]
    hidden states. `alone`: for stages before 0.5, attend each position as a one-token step
    would (a failover's replay of a reply; see `Step`). Ids as a list need no torch (a
    coordinator's ring sends them)."""
    common = {"t": "step", "n": n, "want": want, "alone": alone, "ms": stage_ms}
    if isinstance(inputs, list):
        return _build(STEP_IDS, **common, ab=activation_bytes, ids=ints_to_bytes(inputs))
    import torch  # only a stage holds tensors

    if inputs.dim() == 2:
        ids = inputs[0].to(torch.int32).numpy().tobytes()
        return _build(STEP_IDS, **common, ab=activation_bytes, ids=ids)
    # As few torch calls as can be: a stage builds this on every step, in a thread just
    # woken with cold caches (a forward's output is contiguous already: no copy).
    if inputs.dim() != 3 or inputs.shape[0] != 1:
        raise ValueError(f"a step's hidden state is [1, T, H], not {list(inputs.shape)}")
    hidden = inputs if inputs.is_contiguous() else inputs.contiguous()  # [1, T, H]
    # bfloat16 has no numpy dtype: ship its raw 16-bit words.
    raw = (hidden.view(torch.int16) if hidden.dtype == torch.bfloat16 else hidden).numpy()
    h = raw.tobytes()
    _, tokens, width = raw.shape
    return _build(
        STEP_HIDDEN,
        **common,
        ab=activation_bytes + len(h),
        dt=dtype_name(hidden.dtype),  # hidden states travel in a compute dtype
        shape=[tokens, width],
        h=h,
    )


def token_frame(
    n: int,
    token: int | None,
    stage_ms: list[float],
    activation_bytes: int,
    logprobs: TokenLogprobs | None = None,
) -> dict[str, Any]:
    tok = -1 if token is None else token
    if logprobs is None:
        return _build(TOK, t="tok", n=n, id=tok, ms=stage_ms, ab=activation_bytes)
    top = [[i, lp] for i, lp in logprobs.top]
    return _build(
        TOK, t="tok", n=n, id=tok, ms=stage_ms, ab=activation_bytes, lp=logprobs.logprob, top=top
    )


def fail_frame(
    peer_id: str, why: str, kind: str, status: int | None = None, param: str | None = None
) -> dict[str, Any]:
    """A failure report; a `refused` one carries its status (default 400) and param."""
    if kind != "refused":
        return _build(FAIL, t="fail", peer=peer_id, why=_clean_why(why), kind=kind)
    return _build(
        REFUSAL,
        t="fail",
        peer=peer_id,
        why=_clean_why(why),
        kind=kind,
        status=status if status in REFUSAL_STATUSES else 400,
        param=param if param in bounds.PARAMS else None,
    )


BUSY = "busy: "  # how a `declined` report's why begins when the stage lacks room only


def busy_frame(peer_id: str, why: str) -> dict[str, Any]:
    """A stage declines an open for want of room now (the coordinator may wait)."""
    return fail_frame(peer_id, BUSY + why, "declined")


def is_busy(fail: Fail) -> bool:
    return fail.kind == "declined" and fail.why.startswith(BUSY)


def refusal_frame(peer_id: str, exc: StageRefusedError) -> dict[str, Any]:
    """How a stage answers an open it will not serve: `refused` when the request asked
    for it (the request fails), else `declined` (the coordinator routes around it)."""
    if isinstance(exc, RequestRefusedError):
        return fail_frame(peer_id, str(exc), "refused", exc.status, exc.param)
    return fail_frame(peer_id, str(exc), "declined")


def relay_frame(frame: dict[str, Any]) -> dict[str, Any]:
    """A failure report from another stage, checked and rebuilt, to pass on."""
    fail = parse_fail(frame)
    return fail_frame(fail.peer_id, fail.why, fail.kind, fail.status, fail.param)


def _clean_why(why: str) -> str:
    return safe_text(why, MAX_WHY_CHARS - 1)  # room for the ellipsis of a cut text


END_FRAME: dict[str, Any] = _build(END, t="end")


def ret_frame(sid: str, reused: int | None = None) -> dict[str, Any]:
    """`reused`: only in answer to an open that asked to resume (an older coordinator
    never asks, so never reads a key it does not know)."""
    if reused is None:
        return _build(RET, t="ret", sid=sid)
    return _build(RET, t="ret", sid=sid, reused=reused)


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
    f = _read(OPEN, frame)  # every field's type and static bound: garbage is malformed
    route = _route(f["route"], limits.num_layers)
    hop = f["hop"]
    if hop >= len(route):
        raise MalformedFrameError(f"'hop' is not an integer in 0..{len(route) - 1}")
    addrs = _addrs(f["addrs"])
    max_length = f["max_len"]
    # The reply so far is part of the session: never longer than the session itself.
    history = tuple(_ints(f["history"], "history", limits.vocab_size, max_length))
    refusal: RequestRefusedError | None = None
    try:
        sampling = _sampling(f["sampling"], limits.vocab_size)
    except RequestRefusedError as exc:  # raised once the whole frame is known well formed
        refusal, sampling = exc, SamplingParams()
    model_id = f["model"]
    resume = f.get("resume")
    if resume is not None and resume[1] >= max_length:
        why = f"'resume' keeps {resume[1]} positions of a {max_length}-token session"
        raise MalformedFrameError(why)
    copy = f.get("copy", False)
    if copy and resume is None:
        raise MalformedFrameError("'copy' without 'resume'")
    req = OpenRequest(
        f["sid"],
        hop,
        route,
        addrs,
        f["coord"],
        model_id,
        max_length,
        sampling,
        history,
        f.get("keep", False),
        None if resume is None else (resume[0], resume[1]),
        copy,
    )
    me = req.me
    if me.peer_id != limits.peer_id:
        raise MalformedFrameError(f"open for hop {hop} names peer {me.peer_id[-8:]}, not this one")
    if refusal is not None:
        raise refusal
    if model_id != limits.model_id:
        raise StageRefusedError(f"this node does not serve model '{model_id[:80]}'")
    if not (limits.held.start <= me.start and me.end <= limits.held.end):
        raise StageRefusedError(f"this node holds layers {limits.held}, not {me.layers}")
    if max_length > limits.context_length:
        raise RequestRefusedError(
            f"a session of {max_length} tokens is over the model's context of "
            f"{limits.context_length}",
            "max_tokens",
        )
    return req


def parse_step(
    frame: dict[str, Any], expected_n: int, first: bool, limits: StageLimits, dtype: torch.dtype
) -> Step:
    """A step for this stage: ids when it is the route's first, else a hidden state."""
    f = frame if plain_step(frame, first) else _read(STEP_IDS if first else STEP_HIDDEN, frame)
    n = f["n"]
    if n != expected_n:
        raise MalformedFrameError(f"step {n} arrived where step {expected_n} was due")
    if first:
        ids = _ints(f["ids"], "ids", limits.vocab_size, MAX_STEP_TOKENS)
        if not ids:
            raise MalformedFrameError("a step of no tokens")
        import torch  # only a stage parses steps

        inputs = torch.tensor([ids], dtype=torch.long)  # [1, T]
    else:
        inputs = _hidden(f, limits.hidden_size, dtype)
    return Step(n, f["want"], inputs, tuple(f["ms"]), f["ab"], f["alone"])


def parse_hidden(frame: dict[str, Any], hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The [1, T, H] hidden state of a step frame, checked and cast to `dtype`."""
    if not isinstance(frame, dict):
        raise MalformedFrameError("a hidden state comes in a map")
    # The step frame's other fields are parse_step's: read only the hidden state's here.
    part = {k: frame[k] for k in HIDDEN.keys if k in frame}
    return _hidden(_read(HIDDEN, part), hidden_size, dtype)


def _hidden(f: dict[str, Any], hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    import torch  # hidden states reach stages only

    wire_dtype = torch_dtype(f["dt"])
    tokens, width = f["shape"]
    if not 1 <= tokens <= MAX_STEP_TOKENS:
        raise MalformedFrameError(f"hidden state of {tokens} tokens (1..{MAX_STEP_TOKENS})")
    if width != hidden_size:
        raise MalformedFrameError(f"hidden state {width} wide, this model is {hidden_size}")
    raw = f["h"]
    itemsize = wire_dtype.itemsize
    if len(raw) != tokens * width * itemsize:
        raise MalformedFrameError(
            f"hidden state of {len(raw)} bytes, its shape and dtype say {tokens * width * itemsize}"
        )
    # Checked and copied with numpy: each torch op costs several times a numpy one, and
    # this runs on every step of every stage (a decode step's state is a few KB).
    if wire_dtype == torch.bfloat16:  # numpy has no bfloat16: its 16-bit words
        words = np.frombuffer(raw, dtype=np.int16)
        finite = not bool(np.any((words & _BF16_EXPONENT) == _BF16_EXPONENT))
        hidden = torch.from_numpy(words.copy()).view(torch.bfloat16)
    else:
        values = np.frombuffer(raw, dtype=f["dt"])
        finite = bool(np.isfinite(values).all())
        hidden = torch.from_numpy(values.copy())
    if not finite:
        raise MalformedFrameError("hidden state holds NaN or Inf")
    return hidden.view(1, tokens, width).to(dtype)  # [1, T, H]


_BF16_EXPONENT = 0x7F80  # all ones: Inf or NaN


def parse_token(frame: dict[str, Any], expected_n: int, vocab_size: int, want: bool) -> TokenReply:
    f = frame if plain_tok(frame) else _read(TOK, frame)
    n = f["n"]
    if n != expected_n:
        raise MalformedFrameError(f"token for step {n} arrived where step {expected_n} was due")
    token = f["id"]
    if token >= vocab_size:
        raise MalformedFrameError(f"'id' is not an integer in -1..{vocab_size - 1}")
    if want and token < 0:
        raise MalformedFrameError("no token where one was asked for")
    logprobs = None
    if ("lp" in f) != ("top" in f):
        raise MalformedFrameError("'lp' and 'top' come together")
    if "lp" in f:
        if not want or any(not 0 <= i < vocab_size for i, _ in f["top"]):
            raise MalformedFrameError("logprobs of no token, or of a token outside the vocabulary")
        logprobs = TokenLogprobs(f["lp"], tuple((i, lp) for i, lp in f["top"]))
    return TokenReply(n, token if want else None, tuple(f["ms"]), f["ab"], logprobs)


def parse_fail(frame: dict[str, Any]) -> Fail:
    kind = frame.get("kind") if isinstance(frame, dict) else None
    if kind not in FAIL_KINDS or type(kind) is not str:
        raise MalformedFrameError(f"fail report of unknown kind {str(kind)[:20]!r}")
    refused = kind == "refused"
    f = _read(REFUSAL if refused else FAIL, frame)
    why = safe_text(f["why"], MAX_WHY_CHARS)
    if not refused:
        return Fail(f["peer"], why, f["kind"])
    return Fail(f["peer"], why, "refused", f["status"], f["param"])


def parse_ret(frame: dict[str, Any]) -> Ret:
    f = _read(RET, frame)
    return Ret(f["sid"], f.get("reused"))


# --- checks that span fields or need this node's limits ---------------------------------


def _ints(value: bytes, name: str, upper: int, max_count: int) -> list[int]:
    """int32 little-endian bytes (their type checked) -> ints in [0, upper)."""
    if len(value) // 4 > max_count:
        raise MalformedFrameError(f"'{name}' is not int32 bytes of at most {max_count} items")
    if not value:
        return []
    ids = np.frombuffer(value, dtype="<i4")
    if int(ids.min()) < 0 or int(ids.max()) >= upper:
        raise MalformedFrameError(f"'{name}' holds a token id outside 0..{upper - 1}")
    return ids.tolist()


def _route(stages: list[tuple[str, int, int]], num_layers: int) -> tuple[RouteHop, ...]:
    hops: list[RouteHop] = []
    at = 0
    for peer, start, end in stages:
        if start > num_layers - 1:
            raise MalformedFrameError(f"'route start' is not an integer in 0..{num_layers - 1}")
        if not start + 1 <= end <= num_layers:
            raise MalformedFrameError(f"'route end' is not an integer in {start + 1}..{num_layers}")
        if start != at:
            raise MalformedFrameError("route stages do not cover the layers in order")
        at = end
        hops.append(RouteHop(peer, start, end))
    if at != num_layers:
        raise MalformedFrameError(f"route ends at layer {at}, the model has {num_layers}")
    if len({h.peer_id for h in hops}) != len(hops):
        raise MalformedFrameError("a peer appears twice in the route")
    return tuple(hops)


def _addrs(value: dict[str, list[str]]) -> dict[str, tuple[str, ...]]:
    for peer, addrs in value.items():
        if not all(is_dialable(peer, a) for a in addrs):
            raise MalformedFrameError(
                f"an address is not a multiaddr of <= {MAX_ADDR_CHARS} characters ending in "
                "/p2p/<its peer>"
            )
    return {peer: tuple(addrs) for peer, addrs in value.items()}


def _sampling(value: dict[str, Any], vocab_size: int) -> SamplingParams:
    """The session's sampling (its types checked), against `bounds`: a number out of
    its bound is what the request asked (refused)."""
    numbers = {b.name: _bounded(value[b.name], b) for b in bounds.SAMPLING_NUMBERS}
    top_k = value["top_k"]
    if top_k < bounds.TOP_K_OFF:
        raise RequestRefusedError(f"top_k {top_k} is below {bounds.TOP_K_OFF}", "top_k")
    seed = value["seed"]
    if seed is not None and not bounds.seed_holds(seed):
        raise RequestRefusedError("'seed' is not a 64-bit integer", "seed")
    return SamplingParams(
        temperature=numbers["temperature"],
        top_p=numbers["top_p"],
        top_k=bounds.wire_top_k(top_k, vocab_size),
        min_p=numbers["min_p"],
        presence_penalty=numbers["presence_penalty"],
        frequency_penalty=numbers["frequency_penalty"],
        logit_bias=_logit_bias(value["logit_bias"], vocab_size),
        seed=seed,
        top_logprobs=value.get("top_logprobs"),
        grammar=None if "grammar" not in value else GrammarSpec(*value["grammar"]),
    )


def _logit_bias(pairs: list[tuple[int, float]], vocab_size: int) -> dict[int, float]:
    if len(pairs) > MAX_LOGIT_BIAS:
        raise RequestRefusedError(
            f"logit_bias has {len(pairs)} entries; a stage takes at most {MAX_LOGIT_BIAS}",
            "logit_bias",
        )
    bias: dict[int, float] = {}
    for token, value in pairs:
        if not 0 <= token < vocab_size:
            raise RequestRefusedError(
                f"logit_bias token {token} is not a token id below {vocab_size}", "logit_bias"
            )
        bias[token] = _bounded(value, bounds.LOGIT_BIAS_VALUE, "logit_bias value")
    return bias


def _bounded(value: float, bound: bounds.NumberBound, what: str = "") -> float:
    """A finite number (checked by the field pass) within `bound`, else refused."""
    what = what or bound.name
    if not bound.holds(value):
        raise RequestRefusedError(f"{what} {value:g} is outside {bound.describe()}", bound.name)
    return value
