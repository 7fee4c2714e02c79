"""One table of request bounds: whatever the API accepts, the stage wire accepts too.

A request that passed the API but that a stage took for garbage made the coordinator ban
honest stages (and fail over four times, then answer 503); `top_k: 100000` and 2,000
`logit_bias` entries did. Here random valid requests, extremes included, go the whole
way: the API's validation, the sampling the endpoint builds, the `open` frame the
coordinator builds, msgpack, and the stage's parser.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from swarmd.api.completions import _sampling  # the endpoint's own request -> sampling
from swarmd.api.schemas import ChatCompletionRequest, CompletionRequest, validate
from swarmd.errors import InvalidRequestError, RequestRefusedError
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import SamplingParams
from swarmd.net.frames import FRAME_HEADER_BYTES, FrameDecoder, encode_frame
from swarmd.pipeline import bounds, wire
from swarmd.pipeline.distributed import ChainSettings, open_request
from swarmd.pipeline.ring import RingTimeouts
from swarmd.pipeline.route import Route, Stage

VOCAB = 49152
CONTEXT = 8192
NUM_LAYERS = 30
COORD = "12D3KooWCOORDCOORDCOORDCOORDCOORDCOORDCOORDCOORDCO"
STAGE0 = "12D3KooWSTAGESTAGESTAGESTAGESTAGESTAGESTAGESTAGEST"
STAGE1 = "12D3KooWLASTLASTLASTLASTLASTLASTLASTLASTLASTLASTLA"
MAX_FRAME = 1 << 24
MODEL = SimpleNamespace(vocab_size=VOCAB)
SETTINGS = ChainSettings("m", NUM_LAYERS, VOCAB, 256, 4, RingTimeouts())
ROUTE = Route(
    "m",
    NUM_LAYERS,
    COORD,
    (Stage(STAGE0, 0, 15, False, None, 0.01), Stage(STAGE1, 15, 30, False, None, 0.01)),
)
LIMITS = wire.StageLimits(STAGE0, "m", LayerRange(0, 15), NUM_LAYERS, 576, VOCAB, CONTEXT)


def number(rng: random.Random, bound: bounds.NumberBound) -> float:
    """A value in the bound, its ends included half the time (`lo` when it is closed)."""
    ends = [bound.hi] + ([] if bound.lo_open else [bound.lo])
    if rng.random() < 0.5:
        return rng.choice(ends)
    return rng.uniform(bound.lo, bound.hi) or bound.hi  # uniform may give an open lo


def random_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for bound in bounds.SAMPLING_NUMBERS:
        if rng.random() < 0.8:
            body[bound.name] = number(rng, bound)
    if rng.random() < 0.8:
        body["top_k"] = rng.choice(
            [bounds.TOP_K_MIN, 0, 1, VOCAB - 1, VOCAB, VOCAB + 1, 100_000, 2**70]
        )
    if rng.random() < 0.8:
        count = rng.choice([0, 1, bounds.MAX_LOGIT_BIAS, rng.randrange(bounds.MAX_LOGIT_BIAS)])
        tokens = rng.sample(range(VOCAB), count)
        body["logit_bias"] = {str(t): number(rng, bounds.LOGIT_BIAS_VALUE) for t in tokens}
    if rng.random() < 0.8:
        body["seed"] = rng.choice([bounds.SEED_MIN, bounds.SEED_MAX, 0, rng.getrandbits(63)])
    if rng.random() < 0.5:
        body["stop"] = ["x"] * rng.randint(1, bounds.MAX_STOP)
    return body


def through_the_wire(frame: dict[str, Any]) -> dict[str, Any]:
    data = encode_frame(frame, MAX_FRAME)
    decoder = FrameDecoder(MAX_FRAME, MAX_FRAME + FRAME_HEADER_BYTES)
    (received,) = decoder.feed(data)
    return received


def stage_reads(body: dict[str, Any], prompt_tokens: int = 20) -> wire.OpenRequest:
    """What stage 0 parses from the open frame the coordinator builds for `body`."""
    req = validate(ChatCompletionRequest, body)
    req.check_supported()
    sampling = _sampling(req, MODEL, 1.0)  # type: ignore[arg-type]
    max_length = prompt_tokens + (req.token_limit() or CONTEXT - prompt_tokens)
    history = tuple(range(min(5, max_length)))
    request = open_request("req-1.1", ROUTE, [], COORD, (), SETTINGS, max_length, sampling, history)
    return wire.parse_open(through_the_wire(wire.open_frame(request)), LIMITS)


def test_random_valid_requests_pass_the_stage_wire() -> None:
    rng = random.Random(14)
    for _ in range(300):
        body = random_body(rng)
        parsed = stage_reads(body).sampling
        top_k = body.get("top_k")
        assert parsed.top_k == bounds.wire_top_k(top_k, VOCAB), body.get("top_k")
        assert len(parsed.logit_bias) == len(body.get("logit_bias") or {})
        if "temperature" in body:
            assert parsed.temperature == body["temperature"]


@pytest.mark.parametrize("top_k", [VOCAB, 100_000, 2**64, 10**30])
def test_top_k_over_the_vocabulary_is_no_top_k_on_the_wire(top_k: int) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": top_k}
    assert stage_reads(body).sampling.top_k == 0


def test_a_sampling_number_just_outside_its_bound_is_a_400_here_and_refused_there() -> None:
    for bound in bounds.SAMPLING_NUMBERS:
        for outside in (bound.lo - 0.01, bound.hi + 0.01) + ((bound.lo,) if bound.lo_open else ()):
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                bound.name: outside,
            }
            if (bound, outside) != (bounds.TOP_P, 0.0):  # the API's own reading: below
                with pytest.raises(InvalidRequestError) as api:
                    validate(ChatCompletionRequest, body)
                assert api.value.param == bound.name
            frame = wire.open_frame(
                open_request(
                    "r.1", ROUTE, [], COORD, (), SETTINGS, 30, _sampling_of(bound.name, outside), ()
                )
            )
            with pytest.raises(RequestRefusedError) as stage:
                wire.parse_open(through_the_wire(frame), LIMITS)
            assert (stage.value.param, stage.value.status) == (bound.name, 400)


@pytest.mark.parametrize("top_k", [None, 0, 5])
def test_top_p_0_keeps_the_likeliest_token_and_travels_as_top_k_1(top_k: int | None) -> None:
    # OpenAI's range is [0, 1]; the wire's top_p stays above 0, so 0 travels as top_k 1
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}
    if top_k is not None:
        body["top_k"] = top_k
    parsed = stage_reads(body).sampling
    assert (parsed.top_p, parsed.top_k) == (1.0, 1)


def _sampling_of(name: str, value: float) -> SamplingParams:
    return SamplingParams(**{name: value})


def test_more_logit_bias_entries_than_the_wire_carries_is_a_400_naming_logit_bias() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    most = {str(t): 1.0 for t in range(bounds.MAX_LOGIT_BIAS)}
    assert len(stage_reads({**base, "logit_bias": most}).sampling.logit_bias) == len(most)
    too_many = {str(t): 1.0 for t in range(2000)}
    with pytest.raises(InvalidRequestError) as info:
        validate(ChatCompletionRequest, {**base, "logit_bias": too_many})
    assert info.value.param == "logit_bias"
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("field", "value", "param", "says"),
    [
        ("stop", ["x"] * (bounds.MAX_STOP + 1), "stop", f"at most {bounds.MAX_STOP} items"),
        ("prompt", [], "prompt", "at least 1 item"),
        ("prompt", [-1], "prompt[0]", "greater than or equal to 0"),
        ("prompt", [[1], []], "prompt[1]", "at least 1 item"),
    ],
)
def test_a_field_of_several_shapes_names_what_is_wrong_with_the_one_sent(
    field: str, value: Any, param: str, says: str
) -> None:
    """A list that breaks a limit used to be told "Input should be a valid string" (the
    error of the field's first shape, a string); found by a stress run."""
    body = {"model": "m", "prompt": "x", field: value}
    with pytest.raises(InvalidRequestError) as caught:
        validate(CompletionRequest, body)
    assert caught.value.param == param
    assert says in str(caught.value) and "valid string" not in str(caught.value)


def test_a_value_of_no_accepted_shape_is_told_every_shape() -> None:
    for field in ("stop", "prompt"):
        with pytest.raises(InvalidRequestError) as caught:
            validate(CompletionRequest, {"model": "m", "prompt": "x", field: 5})
        assert caught.value.param == field
        assert "should be a valid string or a valid list" in str(caught.value)
