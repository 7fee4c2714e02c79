"""The stage protocol's frames: every builder round-trips, every field a peer sends is checked.

Structural garbage is a MalformedFrameError (the sender gets banned); a well-formed open
this node cannot serve is a StageRefusedError (answered, nobody banned), never the former;
one whose request asked for a value out of `bounds` is a RequestRefusedError naming it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from swarmd import __version__
from swarmd.errors import MalformedFrameError, RequestRefusedError, StageRefusedError
from swarmd.model.grammar import MAX_GRAMMAR_BYTES, GrammarSpec, ToolCallFormat, ToolFunction
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import IMPOSSIBLE, SamplingParams, TokenLogprobs
from swarmd.net.frames import FRAME_HEADER_BYTES, FrameDecoder, encode_frame
from swarmd.pipeline import wire as stage_wire
from swarmd.pipeline.wire import (
    END_FRAME,
    MAX_LOGIT_BIAS,
    MAX_ROUTE_STAGES,
    MAX_SID_CHARS,
    MAX_STEP_TOKENS,
    MAX_WHY_CHARS,
    Fail,
    OpenRequest,
    RouteHop,
    StageLimits,
    TokenReply,
    fail_frame,
    frame_type,
    ints_to_bytes,
    open_frame,
    parse_fail,
    parse_hidden,
    parse_open,
    parse_ret,
    parse_step,
    parse_token,
    refusal_frame,
    relay_frame,
    ret_frame,
    step_frame,
    token_frame,
)

ME = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
PREV = "12D3KooWPREVPREVPREVPREVPREVPREVPREVPREVPREVPREVPR"
NEXT = "12D3KooWNEXTNEXTNEXTNEXTNEXTNEXTNEXTNEXTNEXTNEXTNE"
COORD = "12D3KooWCOORDCOORDCOORDCOORDCOORDCOORDCOORDCOORDCO"
HIDDEN = 8
VOCAB = 100
LIMITS = StageLimits(
    peer_id=ME,
    model_id="m",
    held=LayerRange(0, 20),
    num_layers=30,
    hidden_size=HIDDEN,
    vocab_size=VOCAB,
    context_length=512,
)
MAX_FRAME = 1 << 22


def addr(peer: str, port: int = 4001) -> str:
    return f"/ip4/10.0.0.1/tcp/{port}/p2p/{peer}"


def make_request(
    route: tuple[RouteHop, ...] = (RouteHop(ME, 0, 20), RouteHop(NEXT, 20, 30)),
    hop: int = 0,
    **changes: Any,
) -> OpenRequest:
    fields: dict[str, Any] = {
        "sid": "sess-01_a.b",
        "hop": hop,
        "route": route,
        "addrs": {
            NEXT: (addr(NEXT), f"/ip6/::1/udp/4001/quic-v1/p2p/{NEXT}"),
            COORD: (addr(COORD, 4002),),
        },
        "coordinator": COORD,
        "model_id": "m",
        "max_length": 256,
        "sampling": SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            logit_bias={3: -100.0, 17: 2.5, 99: 100.0},
            seed=2**64 - 1,
            top_logprobs=3,
            grammar=GrammarSpec("json_schema", '{"type": "object"}'),
        ),
        "history": (5, 0, 99, 42),
    }
    fields.update(changes)
    return OpenRequest(**fields)


def wire(frame: dict[str, Any]) -> dict[str, Any]:
    """The frame as a peer receives it: encoded, split in two reads, decoded (msgpack)."""
    data = encode_frame(frame, MAX_FRAME)
    decoder = FrameDecoder(MAX_FRAME, MAX_FRAME + FRAME_HEADER_BYTES)
    half = len(data) // 2
    frames = decoder.feed(data[:half]) + decoder.feed(data[half:])
    assert len(frames) == 1 and not decoder.mid_frame
    return frames[0]


def open_dict(**changes: Any) -> dict[str, Any]:
    frame = open_frame(make_request())
    frame.update(changes)
    return frame


def sampling_dict(**changes: Any) -> dict[str, Any]:
    frame = open_dict()
    frame["sampling"].update(changes)
    return frame


def hidden_dict(hidden: torch.Tensor | None = None, **changes: Any) -> dict[str, Any]:
    if hidden is None:
        hidden = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(0))
    frame = step_frame(4, True, hidden, [1.5, 2.0], 10)
    frame.update(changes)
    return frame


def ids_dict(**changes: Any) -> dict[str, Any]:
    frame = step_frame(0, False, torch.tensor([[1, 2, 3]]), [], 0)
    frame.update(changes)
    return frame


def malformed(call: Callable[[], object], match: str | None = None) -> None:
    with pytest.raises(MalformedFrameError, match=match):
        call()


# --- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("alone", [False, True])
def test_a_step_keeps_every_field_it_was_built_with(alone: bool) -> None:
    """A failover's replay attends `alone`: a step that dropped the flag on the way would
    recompute the reply with other numbers (it did, once, when a field slipped in)."""
    frame = step_frame(3, True, torch.tensor([[5, 6]]), [1.5], 7, alone)
    step = parse_step(wire(frame), 3, True, LIMITS, torch.float32)
    assert (step.n, step.want, step.stage_ms, step.activation_bytes, step.alone) == (
        3,
        True,
        (1.5,),
        7,
        alone,
    )
    assert step.inputs.tolist() == [[5, 6]]


@pytest.mark.parametrize("over_wire", [False, True])
def test_open_round_trips(over_wire: bool) -> None:
    req = make_request()
    frame = open_frame(req)
    got = parse_open(wire(frame) if over_wire else frame, LIMITS)
    assert got == req
    assert got.sampling.logit_bias == {3: -100.0, 17: 2.5, 99: 100.0}
    assert got.sampling.seed == 2**64 - 1
    assert got.history == (5, 0, 99, 42)
    assert got.addrs[NEXT] == req.addrs[NEXT]
    assert got.me == RouteHop(ME, 0, 20) and not got.is_last and got.next_peer == NEXT
    assert frame_type(frame) == "open"


def test_open_round_trips_defaults_and_an_empty_history() -> None:
    req = make_request(sampling=SamplingParams(), history=(), addrs={})
    assert parse_open(wire(open_frame(req)), LIMITS) == req


def test_open_of_the_last_stage_sends_to_the_coordinator() -> None:
    limits = StageLimits(ME, "m", LayerRange(10, 30), 30, HIDDEN, VOCAB, 512)
    req = make_request(route=(RouteHop(PREV, 0, 10), RouteHop(ME, 10, 30)), hop=1)
    got = parse_open(wire(open_frame(req)), limits)
    assert got == req and got.is_last and got.next_peer == COORD
    assert got.me.layers == LayerRange(10, 30)


def test_a_stage_may_be_asked_for_part_of_what_it_holds() -> None:
    route = (RouteHop(PREV, 0, 5), RouteHop(ME, 5, 20), RouteHop(NEXT, 20, 30))
    req = make_request(route=route, hop=1)
    got = parse_open(wire(open_frame(req)), LIMITS)
    assert got == req
    assert got.me.layers == LayerRange(5, 20)
    assert got.next_peer == NEXT


def test_ids_step_round_trips() -> None:
    ids = torch.tensor([[0, 7, 99, 42]])  # [1, T]
    frame = step_frame(3, True, ids, [1.25], 0)
    step = parse_step(wire(frame), 3, True, LIMITS, torch.float32)
    assert step.n == 3 and step.want is True
    assert step.inputs.dtype == torch.long and torch.equal(step.inputs, ids)
    assert step.stage_ms == (1.25,) and step.activation_bytes == 0
    assert frame_type(frame) == "step"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hidden_step_round_trips_bit_for_bit(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    hidden = (torch.randn(1, 5, HIDDEN, generator=generator) * 100).to(dtype)  # [1, T, H]
    hidden[0, 0, 0] = -0.0
    hidden[0, 0, 1] = torch.finfo(dtype).max
    hidden[0, 0, 2] = torch.finfo(dtype).tiny / 2  # a subnormal
    frame = step_frame(7, False, hidden, [3.0, 4.5], 100)
    assert frame["ab"] == 100 + hidden.numel() * hidden.element_size()
    got = parse_step(wire(frame), 7, False, LIMITS, dtype)
    assert got.inputs.dtype == dtype and got.inputs.shape == (1, 5, HIDDEN)
    # Bit for bit: compare the raw words, so -0.0 and subnormals count too.
    assert got.inputs.view(torch.int8).tolist() == hidden.view(torch.int8).tolist()
    assert got.n == 7 and got.want is False
    assert got.stage_ms == (3.0, 4.5) and got.activation_bytes == frame["ab"]
    as_float = parse_step(wire(frame), 7, False, LIMITS, torch.float32)
    assert as_float.inputs.dtype == torch.float32
    assert torch.equal(as_float.inputs, hidden.float())


def test_hidden_step_of_an_inference_tensor_and_a_strided_view() -> None:
    with torch.inference_mode():
        base = torch.randn(1, HIDDEN, 4, generator=torch.Generator().manual_seed(2))
        hidden = base.transpose(1, 2).to(torch.bfloat16)  # [1, 4, H], not contiguous
    frame = step_frame(0, True, hidden, [], 0)
    got = parse_hidden(wire(frame), HIDDEN, torch.bfloat16)
    assert torch.equal(got, hidden)


def test_received_hidden_state_is_writable_and_owns_its_memory() -> None:
    frame = wire(hidden_dict())
    raw = frame["h"]
    got = parse_hidden(frame, HIDDEN, torch.float32)
    got.add_(1)  # a read-only buffer would warn (filterwarnings=error) or fail here
    assert frame["h"] == raw


def test_token_round_trips() -> None:
    frame = token_frame(9, 42, [1.0, 2.0, 3.0], 4096)
    reply = parse_token(wire(frame), 9, VOCAB, want=True)
    assert reply == TokenReply(9, 42, (1.0, 2.0, 3.0), 4096)
    assert frame_type(frame) == "tok"


def test_token_of_a_step_that_wanted_none() -> None:
    frame = token_frame(2, None, [], 0)
    assert frame["id"] == -1
    assert parse_token(wire(frame), 2, VOCAB, want=False) == TokenReply(2, None, (), 0)
    # A token where none was asked for is dropped, not an error.
    assert parse_token(token_frame(2, 5, [], 0), 2, VOCAB, want=False).token is None


def test_fail_round_trips() -> None:
    for kind in ("lost", "bad", "declined"):
        frame = fail_frame(NEXT, "connection reset", kind)
        assert parse_fail(wire(frame)) == Fail(NEXT, "connection reset", kind)
    long = fail_frame(NEXT, "x" * (MAX_WHY_CHARS + 50), "bad")
    assert parse_fail(long).why == "x" * (MAX_WHY_CHARS - 1) + "…"
    assert len(parse_fail(long).why) == MAX_WHY_CHARS
    assert frame_type(long) == "fail"


def test_a_refusal_carries_its_status_and_param() -> None:
    plain = fail_frame(NEXT, "no", "refused")
    assert parse_fail(wire(plain)) == Fail(NEXT, "no", "refused", 400, None)
    big = fail_frame(NEXT, "too long", "refused", 413, "max_tokens")
    assert parse_fail(wire(big)) == Fail(NEXT, "too long", "refused", 413, "max_tokens")
    # A relaying stage passes both on as they were.
    assert parse_fail(wire(relay_frame(wire(big)))) == parse_fail(wire(big))
    # Only a refusal carries them; a status or param outside the known sets is garbage.
    malformed(lambda: parse_fail({**fail_frame(NEXT, "x", "lost"), "status": 400}), "fields")
    malformed(lambda: parse_fail({**plain, "status": 500}), "status")
    malformed(lambda: parse_fail({**plain, "status": True}), "status")
    malformed(lambda: parse_fail({**plain, "param": "x\nforged"}), "parameter")
    del plain["param"]
    malformed(lambda: parse_fail(plain), "fields")


def test_refusal_frame_tells_a_refused_request_from_a_declined_session() -> None:
    asked = RequestRefusedError("top_k -3 is below 0", "top_k")
    assert parse_fail(refusal_frame(ME, asked)) == Fail(
        ME, "top_k -3 is below 0", "refused", 400, "top_k"
    )
    busy = StageRefusedError("no KV room")
    assert parse_fail(refusal_frame(ME, busy)) == Fail(ME, "no KV room", "declined")


@pytest.mark.parametrize(
    "why",
    ["line one\nDIAG: forged line", "bell\x07 and \x1b[31mred", "sep\u2028arated", "tab\there"],
)
def test_a_why_is_one_printable_line_when_parsed(why: str) -> None:
    raw = {"t": "fail", "peer": NEXT, "why": why, "kind": "lost"}  # as a hostile peer sends it
    parsed = parse_fail(wire(raw)).why
    assert parsed.isprintable() and "\n" not in parsed and "\x1b" not in parsed
    assert parsed.replace("?", "") in why.replace("\n", "").replace("\x07", "").replace(
        "\x1b", ""
    ).replace("\u2028", "").replace("\t", "")
    assert fail_frame(NEXT, why, "bad")["why"].isprintable()  # and when built


def test_ret_and_end_round_trip() -> None:
    assert parse_ret(wire(ret_frame("sess-01"))) == stage_wire.Ret("sess-01", None)
    assert parse_ret(wire(ret_frame("sess-01", 0))) == stage_wire.Ret("sess-01", 0)
    assert parse_ret(wire(ret_frame("sess-01", 37))).reused == 37
    assert frame_type(ret_frame("s")) == "ret"
    assert frame_type(wire(END_FRAME)) == "end"


def test_ints_to_bytes_is_little_endian_int32() -> None:
    assert ints_to_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert ints_to_bytes(()) == b""


# --- frame types ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [None, "", "opened", 1, b"open", ["open"]])
def test_unknown_frame_type(kind: object) -> None:
    malformed(lambda: frame_type({"t": kind}), "unknown type")
    malformed(lambda: frame_type({}), "unknown type")


# --- hidden states ----------------------------------------------------------------------


def test_hidden_of_the_wrong_width() -> None:
    hidden = torch.zeros(1, 2, HIDDEN + 1)
    malformed(lambda: parse_step(hidden_dict(hidden), 4, False, LIMITS, torch.float32), "wide")


@pytest.mark.parametrize("tokens", [0, -1, MAX_STEP_TOKENS + 1])
def test_hidden_of_a_bad_token_count(tokens: int) -> None:
    count = max(tokens, 0) * HIDDEN
    frame = hidden_dict(shape=[tokens, HIDDEN], h=b"\x00" * (4 * count))
    malformed(lambda: parse_hidden(frame, HIDDEN, torch.float32), "tokens")


def test_hidden_of_the_largest_token_count_is_accepted() -> None:
    hidden = torch.zeros(1, MAX_STEP_TOKENS, HIDDEN, dtype=torch.float16)
    assert parse_hidden(hidden_dict(hidden), HIDDEN, torch.float16).shape == (
        1,
        MAX_STEP_TOKENS,
        HIDDEN,
    )


@pytest.mark.parametrize("name", ["float64", "int32", "FLOAT32", "", None, 4, ["float32"]])
def test_hidden_of_an_unknown_dtype(name: object) -> None:
    frame = hidden_dict(dt=name)
    malformed(lambda: parse_step(frame, 4, False, LIMITS, torch.float32), "dtype")


def test_float64_tensor_is_not_a_wire_dtype() -> None:
    # float64 bytes sent under a float32 name are the wrong length, never reinterpreted.
    hidden = torch.zeros(1, 3, HIDDEN, dtype=torch.float64)
    raw = hidden[0].numpy().tobytes()
    frame = hidden_dict(h=raw)
    malformed(lambda: parse_hidden(frame, HIDDEN, torch.float32), "bytes")


@pytest.mark.parametrize("delta", [-1, 1, -4, 4, -96])
def test_hidden_whose_bytes_do_not_match_shape_and_dtype(delta: int) -> None:
    frame = hidden_dict()
    frame["h"] = frame["h"] + b"\x00" * delta if delta > 0 else frame["h"][:delta]
    malformed(lambda: parse_hidden(frame, HIDDEN, torch.float32), "bytes")


def test_hidden_bytes_sized_for_another_dtype() -> None:
    frame = hidden_dict(dt="float16")  # float32 bytes: twice what float16 says
    malformed(lambda: parse_hidden(frame, HIDDEN, torch.float32), "bytes")


@pytest.mark.parametrize("raw", ["text", None, [0, 1], 3, bytearray(96)])
def test_hidden_bytes_that_are_not_bytes(raw: object) -> None:
    malformed(lambda: parse_hidden(hidden_dict(h=raw), HIDDEN, torch.float32), "bytes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [(0, 0), (1, 3), (2, HIDDEN - 1)])
def test_hidden_holding_nan_or_inf(dtype: torch.dtype, bad: float, where: tuple[int, int]) -> None:
    hidden = torch.ones(1, 3, HIDDEN, dtype=dtype)
    hidden[0, where[0], where[1]] = bad
    frame = wire(hidden_dict(hidden))
    malformed(lambda: parse_step(frame, 4, False, LIMITS, torch.float32), "NaN or Inf")


def test_float32_values_past_half_precision_are_accepted_as_float32() -> None:
    hidden = torch.full((1, 1, HIDDEN), 1e30)
    assert torch.equal(parse_hidden(hidden_dict(hidden), HIDDEN, torch.float32), hidden)


@pytest.mark.parametrize(
    "shape",
    [
        (3, HIDDEN),
        [3],
        [3, HIDDEN, 1],
        [1, 3, HIDDEN],
        [True, HIDDEN],
        [3, True],
        [3.0, HIDDEN],
        ["3", HIDDEN],
        None,
        {"0": 3, "1": HIDDEN},
    ],
)
def test_hidden_of_a_bad_shape(shape: object) -> None:
    malformed(lambda: parse_hidden(hidden_dict(shape=shape), HIDDEN, torch.float32), "shape")


# --- step frames ------------------------------------------------------------------------


@pytest.mark.parametrize("first", [True, False])
def test_step_with_an_extra_key(first: bool) -> None:
    frame = ids_dict() if first else hidden_dict()
    frame["extra"] = 1
    malformed(lambda: parse_step(frame, frame["n"], first, LIMITS, torch.float32), "fields")


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("key", ["t", "n", "want", "ms", "ab", "payload"])
def test_step_with_a_missing_key(first: bool, key: str) -> None:
    frame = ids_dict() if first else hidden_dict()
    if key == "payload":
        key = "ids" if first else "shape"
    n = frame["n"]
    del frame[key]
    malformed(lambda: parse_step(frame, n, first, LIMITS, torch.float32), "fields")


def test_ids_step_to_a_stage_that_wants_hidden_states_and_back() -> None:
    malformed(lambda: parse_step(ids_dict(), 0, False, LIMITS, torch.float32), "fields")
    malformed(lambda: parse_step(hidden_dict(), 4, True, LIMITS, torch.float32), "fields")


@pytest.mark.parametrize("n", [3, 5, -1, True, 4.0, "4", None, 2**62 + 1])
def test_step_of_the_wrong_number(n: object) -> None:
    frame = hidden_dict(n=n)
    malformed(lambda: parse_step(frame, 4, False, LIMITS, torch.float32))


@pytest.mark.parametrize("want", [1, 0, "true", None, 1.0])
def test_step_want_must_be_a_bool(want: object) -> None:
    frame = ids_dict(want=want)
    malformed(lambda: parse_step(frame, 0, True, LIMITS, torch.float32), "want")


@pytest.mark.parametrize(
    "ms", [None, 1.0, [math.nan], [-1.0], [math.inf], [True], ["1"], [0.0] * 65]
)
def test_step_with_bad_stage_times(ms: object) -> None:
    frame = ids_dict(ms=ms)
    malformed(lambda: parse_step(frame, 0, True, LIMITS, torch.float32), "'ms'")


@pytest.mark.parametrize("ab", [-1, 1.5, True, None, 2**62 + 1])
def test_step_with_bad_activation_bytes(ab: object) -> None:
    frame = ids_dict(ab=ab)
    malformed(lambda: parse_step(frame, 0, True, LIMITS, torch.float32), "'ab'")


def test_step_with_the_most_stage_times_is_accepted() -> None:
    frame = ids_dict(ms=[0.0] * MAX_ROUTE_STAGES)
    assert len(parse_step(frame, 0, True, LIMITS, torch.float32).stage_ms) == MAX_ROUTE_STAGES


@pytest.mark.parametrize("count", [0, MAX_STEP_TOKENS + 1])
def test_ids_step_of_a_bad_token_count(count: int) -> None:
    frame = ids_dict(ids=ints_to_bytes([1] * count))
    malformed(lambda: parse_step(frame, 0, True, LIMITS, torch.float32))


def test_ids_step_of_the_most_tokens_is_accepted() -> None:
    frame = ids_dict(ids=ints_to_bytes([1] * MAX_STEP_TOKENS))
    step = parse_step(frame, 0, True, LIMITS, torch.float32)
    assert step.inputs.shape == (1, MAX_STEP_TOKENS)


@pytest.mark.parametrize("ids", [[VOCAB], [0, 1, VOCAB + 5], [2**31 - 1], [-1], [3, -(2**31)]])
def test_ids_step_with_an_id_outside_the_vocab(ids: list[int]) -> None:
    frame = ids_dict(ids=ints_to_bytes(ids))
    malformed(lambda: parse_step(frame, 0, True, LIMITS, torch.float32), "token id")


@pytest.mark.parametrize("length", [1, 3, 5, 13])
def test_ids_bytes_not_a_multiple_of_four(length: int) -> None:
    frame = ids_dict(ids=b"\x01" * length)
    malformed(lambda: parse_step(frame, 0, True, LIMITS, torch.float32), "int32 bytes")


@pytest.mark.parametrize("ids", [[1, 2], "abcd", None, bytearray(4)])
def test_ids_that_are_not_bytes(ids: object) -> None:
    frame = ids_dict(ids=ids)
    malformed(lambda: parse_step(frame, 0, True, LIMITS, torch.float32), "int32 bytes")


# --- token, fail, ret -------------------------------------------------------------------


@pytest.mark.parametrize("token", [VOCAB, -2, 1.0, True, None, "3"])
def test_token_out_of_range(token: object) -> None:
    frame = token_frame(1, 0, [], 0)
    frame["id"] = token
    malformed(lambda: parse_token(frame, 1, VOCAB, want=True), "'id'")


def test_no_token_where_one_was_asked_for() -> None:
    malformed(lambda: parse_token(token_frame(1, None, [], 0), 1, VOCAB, want=True), "no token")


def test_token_of_the_wrong_step_or_fields() -> None:
    malformed(lambda: parse_token(token_frame(2, 1, [], 0), 1, VOCAB, want=True), "step 2")
    frame = token_frame(1, 1, [], 0)
    frame["x"] = 0
    malformed(lambda: parse_token(frame, 1, VOCAB, want=True), "fields")
    del frame["x"], frame["ab"]
    malformed(lambda: parse_token(frame, 1, VOCAB, want=True), "fields")


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "gone"},
        {"kind": None},
        {"peer": ""},
        {"peer": "12D3/KooW"},
        {"peer": "a" * 129},
        {"peer": 5},
        {"why": "x" * (MAX_WHY_CHARS + 1)},
        {"why": b"bytes"},
        {"extra": 1},
    ],
)
def test_bad_fail_reports(change: dict[str, object]) -> None:
    frame = {**fail_frame(NEXT, "why", "lost"), **change}
    malformed(lambda: parse_fail(frame))


def test_fail_report_missing_a_field() -> None:
    frame = fail_frame(NEXT, "why", "lost")
    del frame["why"]
    malformed(lambda: parse_fail(frame), "fields")


@pytest.mark.parametrize("sid", ["", "a b", "a/b", "x" * (MAX_SID_CHARS + 1), 7, None])
def test_bad_ret(sid: object) -> None:
    malformed(lambda: parse_ret({"t": "ret", "sid": sid}), "sid")
    malformed(lambda: parse_ret({"t": "ret", "sid": "ok", "more": 1}), "fields")


# --- open: structure --------------------------------------------------------------------


def test_open_with_an_extra_key() -> None:
    malformed(lambda: parse_open(open_dict(extra=1), LIMITS), "fields")


@pytest.mark.parametrize(
    "key",
    ["t", "sid", "hop", "route", "addrs", "coord", "model", "max_len", "sampling", "history"],
)
def test_open_missing_a_key(key: str) -> None:
    frame = open_dict()
    del frame[key]
    malformed(lambda: parse_open(frame, LIMITS), "fields")


@pytest.mark.parametrize(
    "sid",
    ["", "a b", "a/b", "a:b", "a\nb", "x" * (MAX_SID_CHARS + 1), 5, None, b"sid"],
)
def test_open_with_a_bad_sid(sid: object) -> None:
    malformed(lambda: parse_open(open_dict(sid=sid), LIMITS), "sid")


def test_open_with_the_longest_sid_is_accepted() -> None:
    sid = "x" * MAX_SID_CHARS
    assert parse_open(open_dict(sid=sid), LIMITS).sid == sid


@pytest.mark.parametrize("sid", ["sé", "s\u0663", "s\u00b2"])
def test_open_with_a_non_ascii_sid(sid: str) -> None:
    malformed(lambda: parse_open(open_dict(sid=sid), LIMITS), "sid")


@pytest.mark.parametrize("hop", [-1, 2, True, 0.0, "0", None])
def test_open_with_a_bad_hop(hop: object) -> None:
    malformed(lambda: parse_open(open_dict(hop=hop), LIMITS), "hop")


def test_open_whose_hop_names_another_peer() -> None:
    frame = open_dict(hop=1)  # hop 1 is NEXT's
    malformed(lambda: parse_open(frame, LIMITS), "names peer")
    other = StageLimits(NEXT, "m", LayerRange(0, 20), 30, HIDDEN, VOCAB, 512)
    malformed(lambda: parse_open(open_dict(), other), "names peer")


@pytest.mark.parametrize(
    ("route", "match"),
    [
        ([[ME, 0, 20]], "ends at layer 20"),  # ends early
        ([[ME, 0, 20], [NEXT, 20, 29]], "ends at layer 29"),
        ([[ME, 0, 20], [NEXT, 21, 30]], "in order"),  # a gap
        ([[ME, 0, 20], [NEXT, 19, 30]], "in order"),  # an overlap
        ([[NEXT, 20, 30], [ME, 0, 20]], "in order"),  # out of order
        ([[ME, 1, 20], [NEXT, 20, 30]], "in order"),  # does not start at 0
        ([[ME, 0, 20], [NEXT, 20, 25], [ME, 25, 30]], "twice"),  # a repeated peer
        ([[ME, 0, 20], [NEXT, 20, 31]], "route end"),  # past the model
        ([[ME, 0, 0], [NEXT, 0, 30]], "route end"),  # an empty stage
        ([[ME, 0, 20], [NEXT, 20, 20], [PREV, 20, 30]], "route end"),
        ([[ME, 0, 20], [NEXT, 30, 30]], "route start"),
        ([], "route"),
        ([[ME, 0, 1]] * (MAX_ROUTE_STAGES + 1), "route"),
        (None, "route"),
        ({"0": [ME, 0, 30]}, "route"),
        ([[ME, 0, 20], [NEXT, 20]], "peer, start, end"),
        ([[ME, 0, 20], [NEXT, 20, 30, 0]], "peer, start, end"),
        ([[ME, 0, 20], (NEXT, 20, 30)], "peer, start, end"),
        ([[ME, 0, 20], "NEXT"], "peer, start, end"),
        ([[ME, 0, 20], [NEXT, 20.0, 30]], "route start"),
        ([[ME, False, 20], [NEXT, 20, 30]], "route start"),
        ([[ME, 0, 20], [NEXT, 20, True]], "route end"),
        ([[ME, 0, 20], ["bad/peer", 20, 30]], "route peer"),
        ([[ME, 0, 20], ["", 20, 30]], "route peer"),
        ([[ME, 0, 20], [7, 20, 30]], "route peer"),
    ],
)
def test_open_with_a_bad_route(route: object, match: str) -> None:
    malformed(lambda: parse_open(open_dict(route=route), LIMITS), match)


@pytest.mark.parametrize("coord", ["", "not a peer", "a" * 129, None, 3])
def test_open_with_a_bad_coordinator(coord: object) -> None:
    malformed(lambda: parse_open(open_dict(coord=coord), LIMITS), "coord")


@pytest.mark.parametrize(
    "addrs",
    [
        {NEXT: [f"/ip4/10.0.0.1/tcp/4001/p2p/{COORD}"]},  # another peer's address
        {NEXT: [f"/ip4/10.0.0.1/tcp/4001/p2p/{NEXT}/extra"]},
        {NEXT: ["/ip4/10.0.0.1/tcp/4001"]},  # no /p2p/ part
        {NEXT: [f"ip4/10.0.0.1/tcp/4001/p2p/{NEXT}"]},  # not starting with /
        {NEXT: [f"/ip4/10.0.0.1/tcp/4001/p2p/X{NEXT}"]},  # another peer's id as a suffix
        {NEXT: [addr(NEXT), "/ip4/1.2.3.4/tcp/1"]},  # one good, one bad
        {NEXT: [f"/ip4/{'1' * 300}/p2p/{NEXT}"]},  # too long
        {NEXT: [addr(NEXT)] * 9},  # too many
        {NEXT: addr(NEXT)},  # a string, not a list
        {NEXT: [7]},
        {"bad peer": ["/ip4/10.0.0.1/tcp/4001/p2p/bad peer"]},
        {"": ["/p2p/"]},
        [[NEXT, addr(NEXT)]],
        None,
        {f"12D3KooW{i:040d}": [] for i in range(MAX_ROUTE_STAGES + 2)},
    ],
)
def test_open_with_bad_addresses(addrs: object) -> None:
    malformed(lambda: parse_open(open_dict(addrs=addrs), LIMITS))


@pytest.mark.parametrize("model", [None, 5, "m" * 201, b"m"])
def test_open_with_a_bad_model_name(model: object) -> None:
    malformed(lambda: parse_open(open_dict(model=model), LIMITS), "model")


@pytest.mark.parametrize("max_len", [0, -1, 10**7 + 1, 1.5, True, "256", None])
def test_open_with_a_bad_max_len(max_len: object) -> None:
    malformed(lambda: parse_open(open_dict(max_len=max_len), LIMITS), "max_len")


@pytest.mark.parametrize(
    "history",
    [ints_to_bytes([VOCAB]), ints_to_bytes([1, -1]), b"\x00\x00\x00", [1, 2], "ab"],
)
def test_open_with_a_bad_history(history: object) -> None:
    malformed(lambda: parse_open(open_dict(history=history), LIMITS), "history")


def test_open_whose_history_is_longer_than_the_session_is_malformed() -> None:
    frame = open_dict(max_len=4, history=ints_to_bytes([1, 2, 3, 4, 5]))
    malformed(lambda: parse_open(frame, LIMITS), "history")
    assert parse_open(open_dict(max_len=4, history=ints_to_bytes([1, 2, 3, 4])), LIMITS)


# --- open: sampling ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": None}, "top_p"),
        ({"top_k": 1.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": math.nan}, "min_p"),
        ({"presence_penalty": -math.inf}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": "1"}, "seed"),
    ],
)
def test_open_with_bad_sampling(change: dict[str, object], match: str) -> None:
    """The wrong type, NaN or Inf: no API request makes these, the sender is at fault."""
    frame = sampling_dict(**change)
    malformed(lambda: parse_open(frame, LIMITS), match)
    malformed(lambda: parse_open(wire(frame), LIMITS), match)  # NaN survives msgpack


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": 100}, "temperature"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": -0.01}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"logit_bias": [[VOCAB, 1.0]]}, "logit_bias"),
        ({"logit_bias": [[-1, 1.0]]}, "logit_bias"),
        ({"logit_bias": [[3, 100.5]]}, "logit_bias"),
        ({"logit_bias": [[3, -101]]}, "logit_bias"),
        ({"logit_bias": [[i % VOCAB, 0.0] for i in range(MAX_LOGIT_BIAS + 1)]}, "logit_bias"),
    ],
)
def test_open_with_sampling_out_of_bounds_is_refused_naming_the_param(
    change: dict[str, object], param: str
) -> None:
    """A number of the right type out of its bound is what the request asked: a 400 that
    names the parameter, nobody banned (an older or differently bounded coordinator)."""
    frame = sampling_dict(**change)
    seed = change.get("seed")
    if type(seed) is not int or -(2**63) <= seed < 2**64:  # what msgpack can carry
        frame = wire(frame)
    with pytest.raises(RequestRefusedError) as info:
        parse_open(frame, LIMITS)
    assert not isinstance(info.value, MalformedFrameError)
    assert (info.value.param, info.value.status) == (param, 400)


@pytest.mark.parametrize("top_k", [VOCAB, VOCAB + 1, 2**63 - 1, 0])
def test_open_with_top_k_at_or_over_the_vocab_is_no_top_k(top_k: int) -> None:
    assert parse_open(wire(sampling_dict(top_k=top_k)), LIMITS).sampling.top_k == 0
    assert parse_open(wire(sampling_dict(top_k=VOCAB - 1)), LIMITS).sampling.top_k == VOCAB - 1


@pytest.mark.parametrize(
    ("bias", "match"),
    [
        ([[1.0, 1.0]], "logit_bias token"),
        ([[True, 1.0]], "logit_bias token"),
        ([["3", 1.0]], "logit_bias token"),
        ([[3, math.nan]], "logit_bias value"),
        ([[3, math.inf]], "logit_bias value"),
        ([[3, "1"]], "logit_bias value"),
        ([[3]], r"\[token, value\]"),
        ([[3, 1.0, 2.0]], r"\[token, value\]"),
        ([(3, 1.0)], r"\[token, value\]"),
        ([3, 1.0], r"\[token, value\]"),
        ({"3": 1.0}, "list of"),
        (None, "list of"),
    ],
)
def test_open_with_a_bad_logit_bias(bias: object, match: str) -> None:
    malformed(lambda: parse_open(sampling_dict(logit_bias=bias), LIMITS), match)


def test_open_with_sampling_at_its_bounds_is_accepted() -> None:
    frame = sampling_dict(
        temperature=2,
        top_p=1e-9,
        top_k=VOCAB - 1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2.0,
        logit_bias=[[0, -100], [VOCAB - 1, 100.0]],
        seed=-(2**63),
    )
    sampling = parse_open(wire(frame), LIMITS).sampling
    assert sampling == SamplingParams(
        temperature=2.0,
        top_p=1e-9,
        top_k=VOCAB - 1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        logit_bias={0: -100.0, VOCAB - 1: 100.0},
        seed=-(2**63),
        top_logprobs=3,
        grammar=GrammarSpec("json_schema", '{"type": "object"}'),
    )
    assert all(type(v) is float for v in sampling.logit_bias.values())
    assert type(sampling.temperature) is float


@pytest.mark.parametrize("key", ["temperature", "logit_bias", "seed"])
def test_open_with_a_sampling_key_missing(key: str) -> None:
    frame = open_dict()
    del frame["sampling"][key]
    malformed(lambda: parse_open(frame, LIMITS), "fields")


def test_open_with_an_extra_sampling_key() -> None:
    malformed(lambda: parse_open(sampling_dict(greedy=True), LIMITS), "fields")


def test_open_with_a_sampling_key_named_t() -> None:
    malformed(lambda: parse_open(sampling_dict(t="x"), LIMITS), "fields")


@pytest.mark.parametrize("sampling", [None, [], "greedy", 0])
def test_open_whose_sampling_is_not_a_map(sampling: object) -> None:
    malformed(lambda: parse_open(open_dict(sampling=sampling), LIMITS), "sampling")


# --- open: well formed, but not for this node -------------------------------------------


def refused(frame: dict[str, Any], limits: StageLimits, match: str) -> None:
    with pytest.raises(StageRefusedError, match=match) as info:
        parse_open(frame, limits)
    assert not isinstance(info.value, MalformedFrameError)


def test_open_for_another_model_is_refused() -> None:
    refused(wire(open_dict(model="other-model")), LIMITS, "does not serve model 'other-model'")


@pytest.mark.parametrize(
    ("route", "hop"),
    [
        ([[PREV, 0, 20], [ME, 20, 30]], 1),  # wholly outside 0:20
        ([[PREV, 0, 15], [ME, 15, 25], [NEXT, 25, 30]], 1),  # runs past the end
        ([[ME, 0, 30]], 0),  # the whole model
        ([[ME, 0, 21], [NEXT, 21, 30]], 0),
    ],
)
def test_open_for_layers_this_node_does_not_hold_is_refused(
    route: list[list[object]], hop: int
) -> None:
    refused(wire(open_dict(route=route, hop=hop)), LIMITS, "holds layers 0:20")


def test_open_for_layers_before_the_held_range_is_refused() -> None:
    limits = StageLimits(ME, "m", LayerRange(10, 30), 30, HIDDEN, VOCAB, 512)
    frame = open_dict(route=[[PREV, 0, 5], [ME, 5, 30]], hop=1)
    refused(frame, limits, "holds layers 10:30, not 5:30")


def test_open_longer_than_the_context_is_refused() -> None:
    refused(wire(open_dict(max_len=513)), LIMITS, "over the model's context of 512")
    with pytest.raises(RequestRefusedError) as info:  # the request asked it: a 400
        parse_open(wire(open_dict(max_len=513)), LIMITS)
    assert info.value.param == "max_tokens"
    assert parse_open(open_dict(max_len=512), LIMITS).max_length == 512


def test_structural_errors_win_over_refusals() -> None:
    # A frame both malformed and for another model is malformed: the sender is at fault.
    frame = open_dict(model="other", sid="bad sid")
    malformed(lambda: parse_open(frame, LIMITS), "sid")
    # Also over a refusal of what the request asked (a garbage frame is not a request).
    frame = sampling_dict(top_k=-5)
    frame["hop"] = 1  # names NEXT, not this node
    malformed(lambda: parse_open(frame, LIMITS), "names peer")


def test_parse_open_does_not_change_the_frame() -> None:
    frame = open_dict()
    before = copy.deepcopy(frame)
    parse_open(frame, LIMITS)
    assert frame == before


# --- one declaration per frame ------------------------------------------------------------


def built_frames() -> list[tuple[dict[str, Any], Any, Callable[[dict[str, Any]], object]]]:
    """(frame, its declaration, its parser) for every frame a builder makes."""
    w = stage_wire
    return [
        (open_frame(replace(RESUMING, copy=True)), w.OPEN, lambda f: parse_open(f, LIMITS)),
        (ids_dict(), w.STEP_IDS, lambda f: parse_step(f, 0, True, LIMITS, torch.float32)),
        (hidden_dict(), w.STEP_HIDDEN, lambda f: parse_step(f, 4, False, LIMITS, torch.float32)),
        (
            token_frame(1, 5, [1.0], 0, LOGPROBS),
            w.TOK,
            lambda f: parse_token(f, 1, VOCAB, want=True),
        ),
        (fail_frame(NEXT, "x", "lost"), w.FAIL, parse_fail),
        (fail_frame(NEXT, "x", "refused", 413, "max_tokens"), w.REFUSAL, parse_fail),
        (ret_frame("s", 12), w.RET, parse_ret),
        (dict(END_FRAME), w.END, frame_type),
    ]


LOGPROBS = TokenLogprobs(-0.5, ((5, -0.5), (7, -1.25), (0, IMPOSSIBLE)))
RESUMING = make_request(keep=True, resume=("chatcmpl-9f.1", 40))


def test_keep_and_resume_travel_and_are_optional() -> None:
    """Prefix reuse on a route: an open asks its stages to keep the session's cache, and a
    next turn's open resumes a kept one; an older coordinator's open has neither key."""
    req = parse_open(wire(open_frame(RESUMING)), LIMITS)
    assert (req.keep, req.resume) == (True, ("chatcmpl-9f.1", 40))
    plain = open_frame(make_request())
    assert "keep" not in plain and "resume" not in plain
    req = parse_open(wire(plain), LIMITS)
    assert (req.keep, req.resume) == (False, None)


@pytest.mark.parametrize(
    "resume",
    [
        ["chatcmpl-9f.1", 0],  # nothing to resume
        ["chatcmpl-9f.1", 256],  # the whole session (max_len 256): nothing left to feed
        ["chatcmpl-9f.1", -3],
        ["a/b", 40],  # not a session id
        ["chatcmpl-9f.1"],
        "chatcmpl-9f.1",
        ["chatcmpl-9f.1", 40, 1],
    ],
)
def test_a_bad_resume_is_malformed(resume: Any) -> None:
    frame = {**open_frame(RESUMING), "resume": resume}
    malformed(lambda: parse_open(wire(frame), LIMITS), "resume")


def test_copy_travels_beside_resume_only() -> None:
    """A shared start (since 0.5.2): each stage copies the kept positions; the key is
    only ever sent with `resume`, and one without it is malformed."""
    copying = make_request(keep=True, resume=("chatcmpl-9f.1", 40), copy=True)
    frame = open_frame(copying)
    assert frame["copy"] is True
    req = parse_open(wire(frame), LIMITS)
    assert (req.resume, req.copy) == (("chatcmpl-9f.1", 40), True)
    assert "copy" not in open_frame(RESUMING)
    assert parse_open(wire(open_frame(RESUMING)), LIMITS).copy is False
    assert "copy" not in open_frame(make_request(copy=True))  # nothing to copy
    malformed(
        lambda: parse_open(wire({**open_frame(make_request()), "copy": True}), LIMITS), "copy"
    )
    malformed(lambda: parse_open(wire({**frame, "copy": 1}), LIMITS), "copy")
    assert stage_wire.reads_copy("0.5.2") and not stage_wire.reads_copy("0.5.1")


@pytest.mark.parametrize("reused", [-1, "3", None, 1.5])
def test_a_bad_reused_count_is_malformed(reused: Any) -> None:
    malformed(lambda: parse_ret({"t": "ret", "sid": "ok", "reused": reused}), "reused")


def test_logprobs_and_the_grammar_travel_and_are_optional() -> None:
    reply = parse_token(wire(token_frame(1, 5, [1.0], 0, LOGPROBS)), 1, VOCAB, want=True)
    assert reply.logprobs == LOGPROBS
    plain = token_frame(1, 5, [1.0], 0)
    assert "lp" not in plain and parse_token(wire(plain), 1, VOCAB, want=True).logprobs is None
    req = parse_open(wire(open_frame(make_request())), LIMITS)
    assert req.sampling.top_logprobs == 3
    assert req.sampling.grammar == GrammarSpec("json_schema", '{"type": "object"}')
    bare = make_request(sampling=SamplingParams(seed=1))
    sampling = open_frame(bare)["sampling"]
    assert "grammar" not in sampling and "top_logprobs" not in sampling
    got = parse_open(wire(open_frame(bare)), LIMITS).sampling
    assert (got.grammar, got.top_logprobs) == (None, None)


@pytest.mark.parametrize(
    "change",
    [
        {"lp": 0.5},  # a logprob above 0
        {"lp": math.nan},
        {"top": [[VOCAB, -1.0]]},  # a token outside the vocabulary
        {"top": [[1, -1.0]] * 21},  # more than top_logprobs' bound
        {"top": [[1, "x"]]},
    ],
)
def test_bad_logprobs_are_malformed(change: dict[str, Any]) -> None:
    frame = {**token_frame(1, 5, [1.0], 0, LOGPROBS), **change}
    with pytest.raises(MalformedFrameError):
        parse_token(wire(frame), 1, VOCAB, want=True)


def test_logprobs_come_with_a_token_and_with_each_other() -> None:
    frame = token_frame(1, 5, [1.0], 0, LOGPROBS)
    for key in ("lp", "top"):
        with pytest.raises(MalformedFrameError):
            parse_token({k: v for k, v in frame.items() if k != key}, 1, VOCAB, want=True)
    with pytest.raises(MalformedFrameError):
        parse_token({**frame, "id": -1}, 1, VOCAB, want=False)


@pytest.mark.parametrize(
    "grammar",
    [["yaml", ""], ["json_schema"], ["json_schema", "x" * (MAX_GRAMMAR_BYTES + 1)], "json_object"],
)
def test_a_bad_grammar_is_malformed(grammar: Any) -> None:
    frame = open_frame(make_request())
    frame["sampling"] = {**frame["sampling"], "grammar": grammar}
    with pytest.raises(MalformedFrameError):
        parse_open(wire(frame), LIMITS)


def test_every_builder_emits_exactly_its_declared_keys_and_its_parser_takes_them() -> None:
    for frame, schema, parse in built_frames():
        assert set(frame) == schema.keys, frame["t"]
        parse(wire(frame))


def test_a_declaration_refuses_a_builder_that_strays_from_it() -> None:
    frame = token_frame(1, 5, [1.0], 0)
    with pytest.raises(ValueError, match="wrong fields"):
        stage_wire.TOK.check_keys({**frame, "extra": 1})
    del frame["ab"]
    with pytest.raises(ValueError, match="wrong fields"):
        stage_wire.TOK.check_keys(frame)


def test_no_int_field_of_any_frame_takes_a_bool() -> None:
    for frame, _, parse in built_frames():
        for key, value in frame.items():
            if type(value) is int:
                bad = {**frame, key: True}
                with pytest.raises(MalformedFrameError):
                    parse(bad)


def test_every_field_of_every_frame_is_refused_when_missing_or_of_another_type() -> None:
    for frame, schema, parse in built_frames():
        if frame["t"] == "end":
            continue  # one field, read by frame_type
        optional = {k for k, _ in schema.optional}
        for key in frame:
            if key == "t":
                continue
            if key not in optional:  # an optional key's absence: its own tests
                with pytest.raises(MalformedFrameError):
                    parse({k: v for k, v in frame.items() if k != key})
            with pytest.raises(MalformedFrameError):
                parse({**frame, key: {"not": "this"}})


def test_garbage_in_sampling_wins_over_a_bound_the_request_broke() -> None:
    """Every field's type is checked before any bound: a frame that is both refused and
    garbage is garbage (no coordinator builds a wrong type), whichever field comes first."""
    frame = sampling_dict(temperature=5.0, seed="7")  # out of bound, then the wrong type
    malformed(lambda: parse_open(frame, LIMITS), "seed")
    frame = sampling_dict(logit_bias=[[VOCAB, 1.0], [3, "x"]])  # refused entry, then garbage
    malformed(lambda: parse_open(frame, LIMITS), "logit_bias value")
    frame = sampling_dict(top_k=-3, logit_bias=None)
    malformed(lambda: parse_open(frame, LIMITS), "logit_bias")


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("0.2.0", (0, 2, 0)), ("1.10", (1, 10)), ("0.3.0rc1", (0, 3, 0)), ("dev", (0,)), ("", (0,))],
)
def test_versions_are_read_part_by_part(version: str, parsed: tuple[int, ...]) -> None:
    assert stage_wire.version_tuple(version) == parsed


def test_a_request_with_new_sampling_keys_needs_a_stage_that_reads_them() -> None:
    """An older stage refuses a frame with keys it does not know (and bans its sender):
    such a request is planned only through stages whose version reads them, a plain one
    through any."""
    plain = SamplingParams(temperature=0.7, seed=3)
    logprobs = SamplingParams(temperature=0.7, seed=3, top_logprobs=0)
    grammar = SamplingParams(grammar=GrammarSpec("json_object", ""))
    for sampling in (plain, logprobs, grammar):
        assert stage_wire.reads_sampling("0.2.0", sampling)
        assert stage_wire.reads_sampling("1.0.0", sampling)
    assert stage_wire.reads_sampling("0.1.0", plain)
    assert not stage_wire.reads_sampling("0.1.0", logprobs)
    assert not stage_wire.reads_sampling("0.1.9", grammar)
    assert not stage_wire.reads_sampling("garbage", grammar)
    # Every optional key the frame may carry has a version, so none is sent unchecked.
    full = open_frame(make_request())["sampling"]  # every optional key set
    bare = open_frame(make_request(sampling=plain))["sampling"]
    assert set(full) - set(bare) == set(stage_wire.SAMPLING_KEYS_SINCE)


def test_tools_beside_a_json_format_need_a_stage_that_takes_an_answer() -> None:
    # An older stage refuses that format with a 400: the request is routed past it.
    fmt = ToolCallFormat.hermes([ToolFunction("f")])
    calls = SamplingParams(grammar=GrammarSpec.tool_calls(fmt))
    either = SamplingParams(
        grammar=GrammarSpec.tool_calls(replace(fmt, answer='{"type":"object"}'))
    )
    assert not calls.grammar.has_answer and either.grammar.has_answer  # type: ignore[union-attr]
    assert stage_wire.reads_sampling("0.5.0", calls)
    assert not stage_wire.reads_sampling("0.5.0", either)
    assert stage_wire.reads_sampling("0.5.1", either)
    assert stage_wire.reads_sampling(__version__, either)


# --- the plain shape of step and token frames, read at once -------------------------------

_ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**62, 2**62 + 1, 2**31, -2, 1.5, 0.0, -0.0, 1e9, 1e10,
    math.nan, math.inf, -math.inf, "step", "tok", "float32", "x", b"", b"\0" * 4, b"\0" * 5,
    bytearray(4), [], [1.0], [1], [1, 2], [1.0, 2.0], ["a", 2], [1.0] * 65, {}, {"t": "step"},
    (1, 2),
]  # fmt: skip


def _mutations(frame: dict[str, Any]) -> list[Any]:
    """`frame` with each field dropped, each set to each odd value, an extra field, and
    items of its lists changed: what a schema must refuse or read as sent."""
    out: list[Any] = [frame, [frame], None, {**frame, "extra": 1}, {**frame, 7: 1}]
    for key in frame:
        out.append({k: v for k, v in frame.items() if k != key})
        out += [{**frame, key: odd} for odd in _ODD_VALUES]
        if isinstance(frame[key], list):
            for i in range(len(frame[key])):
                out += [
                    {**frame, key: [*frame[key][:i], odd, *frame[key][i + 1 :]]}
                    for odd in _ODD_VALUES
                ]
    return out


def _plain_frames() -> list[tuple[str, dict[str, Any], Any]]:
    """(kind, frame as a peer sends it, its schema) for every plain shape."""
    frames: list[tuple[str, dict[str, Any], Any]] = [
        ("ids", wire(step_frame(3, True, [5, 6, 7], [1.5, 2.0], 10)), stage_wire.STEP_IDS),
        ("ids", wire(step_frame(0, False, [], [], 0, alone=True)), stage_wire.STEP_IDS),
        ("tok", wire(token_frame(4, 17, [1.0, 2.5, 3.0], 99)), stage_wire.TOK),
        ("tok", wire(token_frame(4, None, [], 0)), stage_wire.TOK),
    ]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        hidden = torch.ones(1, 2, HIDDEN, dtype=dtype)
        frames.append(
            ("hidden", wire(step_frame(9, True, hidden, [0.5], 3)), stage_wire.STEP_HIDDEN)
        )
    return frames


@pytest.mark.parametrize("kind,frame,schema", _plain_frames())
def test_the_plain_shape_takes_nothing_its_schema_would_refuse_or_change(
    kind: str, frame: dict[str, Any], schema: Any
) -> None:
    """`plain_step` / `plain_tok` let a frame skip its schema's readers: each must take
    the frames honest peers send, and any frame it takes must read through the schema
    unchanged (so skipping the schema changes nothing)."""

    def plain(value: Any) -> bool:
        if kind == "tok":
            return stage_wire.plain_tok(value)
        return stage_wire.plain_step(value, kind == "ids")

    assert plain(frame)
    taken = 0
    for mutated in _mutations(frame):
        if not plain(mutated):
            continue
        taken += 1
        read = schema.read(mutated, MalformedFrameError)  # raises if the schema refuses it
        assert read.keys() == mutated.keys()
        for key, value in read.items():
            sent = mutated[key]
            assert type(sent) is type(value) or isinstance(value, tuple), key
            assert (list(value) if isinstance(value, tuple) else value) == sent, key
    assert taken > 1  # some mutations keep the plain shape (another int, another float)
