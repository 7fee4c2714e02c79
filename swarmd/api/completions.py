"""`POST /v1/chat/completions` and `POST /v1/completions`, streamed or not."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

from aiohttp import web

from swarmd import __version__
from swarmd.api import keys
from swarmd.api.choices import Choices, choice_requests, run_all
from swarmd.api.errors import classify
from swarmd.api.forward import forward_reply, is_forwarded
from swarmd.api.logprobs import LogprobsWriter, Pairs
from swarmd.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_body,
    validate,
)
from swarmd.dht.records import NodeRecord
from swarmd.errors import (
    ClientDisconnectedError,
    ContextLengthError,
    InvalidRequestError,
    KVRoomError,
    ModelNotFoundError,
    SwarmError,
)
from swarmd.model.common import Variant
from swarmd.model.grammar import GrammarSpec, ToolCallFormat, check_tool_parameters
from swarmd.model.sampling import SamplingParams, random_seed
from swarmd.model.tool_calls import StreamEvent, ToolCallStreamer, parse_tool_calls
from swarmd.model.tool_prompt import (
    check_tool_choice,
    check_tools,
    detect_family,
    render_tools_prompt,
    tool_call_format,
)
from swarmd.pipeline.chain import route_kind
from swarmd.pipeline.coordinator import Coordinator, Routed
from swarmd.pipeline.generation import Delta, Generation, GenerationRequest, Timing
from swarmd.pipeline.report import RequestRecord, ms

Kind = Literal["chat", "text"]


@dataclass(frozen=True)
class _Reply:
    """What the two endpoints differ in."""

    kind: Kind
    reply_id: str
    model: str
    created: int
    fingerprint: str  # OpenAI's `system_fingerprint` (`_fingerprint`)
    include_usage: bool
    return_token_ids: bool
    logprobs: LogprobsWriter | None  # when the request asked for logprobs
    tools: _Tools | None = None  # when the reply may call tools
    forwarded: bool = False  # a peer's forwarded request: its client sees route "forwarded"

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_name(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def choice(
        self,
        text: str | None,
        finish: str | None,
        first: bool = False,
        pairs: Pairs = (),
        index: int = 0,
    ) -> dict[str, Any]:
        logprobs = self._logprobs(pairs, index)
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def whole_choice(
        self, text: str, finish: str | None, pairs: Pairs, index: int = 0
    ) -> dict[str, Any]:
        if self.kind == "text":
            return self.choice(text, finish, pairs=pairs, index=index)
        message = {"role": "assistant", "content": text}
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(pairs, index),
            "finish_reason": finish,
        }

    def _logprobs(self, pairs: Pairs, index: int) -> dict[str, Any] | None:
        """OpenAI sends null where no logprobs were asked for, and on chunks with no token."""
        if self.logprobs is None or not pairs:
            return None
        return self.logprobs.format(pairs, index)

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body: dict[str, Any] = {
            "id": self.reply_id,
            "object": self.chunk_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return sse(body)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _ms(seconds: float | None) -> float | None:
    value = ms(seconds)
    return None if value is None else round(value, 2)


def _server_timing(timing: Timing, full: bool) -> str:
    parts = [("queue", timing.queue_s), ("sched", timing.sched_s)]
    if full:
        parts += [("ttft", timing.ttft_s), ("decode", timing.decode_s)]
    return ", ".join(f"{name};dur={_ms(s)}" for name, s in parts if s is not None)


def _route_headers(gen: Generation, request_id: str, full_timing: bool) -> dict[str, str]:
    hops = gen.chain.hops
    return {
        "x-swarm-route": route_kind(gen.chain),
        "x-swarm-segments": str(len(hops)),
        "x-swarm-nodes": ",".join(hop.short_id for hop in hops),
        "x-swarm-request-id": request_id,
        "server-timing": _server_timing(gen.timing, full_timing),
    }


def _swarm_summary(gen: Generation, forwarded: bool = False) -> dict[str, Any]:
    """The reply's `swarm` object. A forwarded request's reply reaches its client through
    the node it asked, whose `x-swarm-route` says "forwarded": so does this."""
    hops = gen.chain.hops
    t = gen.timing
    return {
        "route": "forwarded" if forwarded else route_kind(gen.chain),
        "nodes": [hop.short_id for hop in hops],
        "segments": [
            {"node": hop.short_id, "layers": [hop.layers.start, hop.layers.end], "ms": _ms(s)}
            for hop, s in zip(hops, gen.chain.stage_seconds(), strict=False)
        ],
        "failovers": gen.chain.failovers,
        "timing": {
            "queue_ms": _ms(t.queue_s),
            "sched_ms": _ms(t.sched_s),
            "ttft_ms": _ms(t.ttft_s),
            "decode_ms": _ms(t.decode_s),
            "total_ms": _ms(t.since_received()),
        },
    }


def _usage(gens: list[Generation]) -> dict[str, Any]:
    """Each prompt counts once (as OpenAI counts it for `n`); the replies add up."""
    leads = [gen for gen in gens if gen.request.share is None]  # each prompt's choice 0
    prompt = sum(len(gen.request.prompt_ids) for gen in leads)
    done = sum(gen.completion_tokens for gen in gens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": done,
        "total_tokens": prompt + done,
        "prompt_tokens_details": {"cached_tokens": sum(gen.cached_tokens for gen in leads)},
        # Every token is in the reply: none is reasoning kept from it, nor a prediction.
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _fingerprint(v: Variant) -> str:
    """OpenAI's `system_fingerprint`: what a reply's tokens depend on besides the request
    and the machines: swarmd's version, the model's content, and the format its weights
    are held and computed in (every stage of a route holds that same variant). With a
    `seed`, a changed fingerprint says why a reply may have changed."""
    key = f"swarmd {__version__} {v.content_id} {v.weights} {v.dtype_name}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _reply_length(prompt_len: int, requested: int | None, context: int, prompt_param: str) -> int:
    if prompt_len == 0:
        raise InvalidRequestError("The prompt is empty", prompt_param)
    if prompt_len >= context:
        raise ContextLengthError(
            f"This model's maximum context length is {context} tokens, but the prompt has "
            f"{prompt_len} tokens",
            prompt_param,
        )
    if requested is None:
        return context - prompt_len
    if prompt_len + requested > context:
        raise ContextLengthError(
            f"This model's maximum context length is {context} tokens, but {prompt_len + requested}"
            f" were requested ({prompt_len} in the prompt, {requested} for the completion); "
            f"lower max_tokens to {context - prompt_len} or less",
            "max_tokens",
        )
    return requested


def _sampling(
    req: SamplingFields,
    model: Routed,
    default_temperature: float,
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = max(0, req.top_k or 0)
    if top_p == 0.0:  # the likeliest token alone (schemas.TopP)
        top_p, top_k = 1.0, 1
    return SamplingParams(
        temperature=default_temperature if req.temperature is None else req.temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=req.logit_bias_ids(model.vocab_size),
        # A seed for every reply, so that a failover draws what the lost stage would have.
        seed=random_seed() if req.seed is None else req.seed,
        top_logprobs=req.wants_logprobs(),
        grammar=grammar,
    )


def _reseeded(sampling: SamplingParams) -> SamplingParams:
    return replace(sampling, seed=random_seed())


def _chat_prompt(req: ChatCompletionRequest, model: Routed) -> list[int]:
    if not model.codec.has_chat_template:
        raise InvalidRequestError(
            f"Model '{model.model_id}' has no chat template; use /v1/completions", "model"
        )
    variables = req.template_variables(model.codec.chat_template or "")
    return model.codec.chat_prompt([m.to_chat() for m in req.messages], variables)


@dataclass(frozen=True)
class _Tools:
    """A request that offers tools: the format calls come in, and what may be called."""

    fmt: ToolCallFormat
    names: frozenset[str]
    # tool_choice required or named: only calls can come out; auto with a JSON
    # response_format: calls, or JSON of that format
    grammar: GrammarSpec | None
    certain: bool  # only calls can come out: a call's arguments stream as they are written


def _tools_prompt(req: ChatCompletionRequest, model: Routed) -> tuple[list[int], _Tools | None]:
    """The prompt of a conversation with tools (or tool turns); the plan for the reply
    (None when no tool may be called: `tool_choice: "none"`, or no tools offered)."""
    codec = model.codec
    template = codec.chat_template or ""
    functions = check_tools(req.tools) if req.tools is not None else []
    if functions:  # (a vocabulary is built on the first use: about 1 s, once)
        check_tool_parameters(functions, model.grammar_vocabulary)
    names = [f.name for f in functions]
    mode, named = check_tool_choice(req.tool_choice, names)
    family = detect_family(codec.chat_template)
    variables = req.template_variables(template)
    prompt = render_tools_prompt(
        codec.chat_template,
        [m.openai() for m in req.messages],
        req.tools if mode != "none" else None,
        family,
        {**codec.special_tokens, **variables},
    )
    ids = codec.render_prompt(prompt.messages, prompt.tools, variables)
    if mode == "none":
        return ids, None
    parallel = req.parallel_tool_calls is not False and named is None
    fmt = tool_call_format(family, functions, parallel)
    grammar = None
    answer = req.grammar()  # a JSON response_format: what a reply that calls nothing is
    if mode == "required":  # only calls: the format would shape an answer that cannot come
        chosen = [f for f in functions if named is None or f.name == named]
        grammar = GrammarSpec.tool_calls(tool_call_format(family, chosen, parallel))
    elif answer is not None:
        schema = answer.source if answer.kind == "json_schema" else '{"type":"object"}'
        grammar = GrammarSpec.tool_calls(replace(fmt, answer=schema))
    return ids, _Tools(fmt, frozenset(names), grammar, certain=mode == "required")


def _text_prompts(req: CompletionRequest, model: Routed) -> list[list[int]]:
    """The request's prompts as token ids: one, or one per entry of a list of strings or
    of token lists."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [model.codec.encode(prompt)]
    entries: list[Any] = [prompt] if isinstance(prompt[0], int) else list(prompt)
    out: list[list[int]] = []
    vocab = model.vocab_size
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            out.append(model.codec.encode(entry))
            continue
        ids = [int(t) for t in entry]
        if any(t >= vocab for t in ids):
            where = "prompt" if len(entries) == 1 else f"prompt[{i}]"
            raise InvalidRequestError(f"Prompt token ids must be below {vocab}", where)
        out.append(ids)
    return out


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "text")


async def _forward_holders(request: web.Request, model_id: str) -> list[NodeRecord]:
    """Where to forward a request for a model this node cannot route, nearest first
    (none: nowhere; a request forwarded here already is never forwarded again)."""
    node = request.app[keys.NODE]
    if is_forwarded(request, node.forwards.secret):
        return []
    holders: list[NodeRecord] = await node.forward_holders(model_id)
    return holders


async def _complete(request: web.Request, kind: Kind) -> web.StreamResponse:
    coordinator: Coordinator = request.app[keys.COORDINATOR]
    timing = Timing()
    request_id: str = request[keys.REQUEST_ID]
    model_name = "-"
    prompt_ids: list[int] = []
    try:
        body = parse_body(await request.read())
        req: ChatCompletionRequest | CompletionRequest
        if kind == "chat":
            req = validate(ChatCompletionRequest, body)
        else:
            req = validate(CompletionRequest, body)
        model_name = req.model
        req.check_supported()
        try:
            model = await coordinator.resolve(req.model)
        except ModelNotFoundError:
            holders = await _forward_holders(request, req.model)
            if not holders:
                raise
            node = request.app[keys.NODE]
            report = coordinator.report
            raw = await request.read()
            return await forward_reply(request, node, holders, raw, request_id, req.model, report)
        # Tokenizing a long prompt takes long enough to stall the loop: do it off it.
        tools: _Tools | None = None
        prompts: list[list[int]] | None = None  # several, from /v1/completions
        if isinstance(req, ChatCompletionRequest) and req.uses_tools():
            if not model.codec.has_chat_template:
                raise InvalidRequestError(
                    f"Model '{model.model_id}' has no chat template; use /v1/completions",
                    "model",
                )
            prompt_ids, tools = await asyncio.to_thread(_tools_prompt, req, model)
            param = "messages"
        elif isinstance(req, ChatCompletionRequest):
            # No tools: "auto" and "none" mean nothing; "required" or a named function
            # cannot be honoured, and says so (a 400) rather than answering in text.
            check_tool_choice(req.tool_choice, ())
            prompt_ids = await asyncio.to_thread(_chat_prompt, req, model)
            param = "messages"
        else:
            prompts = await asyncio.to_thread(_text_prompts, req, model)
            prompt_ids = prompts[0]
            param = "prompt"
        answer = req.grammar()
        grammar = tools.grammar if tools is not None and tools.grammar else answer
        if answer is not None and grammar is not answer:  # its own faults name response_format
            await asyncio.to_thread(model.check_grammar, answer)
        if grammar is not None:  # a 400 here, before any stage is asked to compile it
            await asyncio.to_thread(model.check_grammar, grammar)
        sampling = _sampling(req, model, request.app[keys.DEFAULT_TEMPERATURE], grammar)
        each = [prompt_ids] if prompts is None else prompts
        several = prompts is not None and len(prompts) > 1
        lengths = [
            _reply_length(
                len(ids),
                req.token_limit(),
                model.context_length,
                f"prompt[{i}]" if several else param,
            )
            for i, ids in enumerate(each)
        ]
        if req.token_limit() is None:
            # No max_tokens: the rest of the context, or of what one session's KV can
            # hold (this node's budget, or the best route's), whichever is smaller. The
            # sessions of several prompts share it, so that they can run at once.
            holds = await coordinator.session_room(model, sampling)
            if holds is not None:
                longest = max(len(ids) for ids in each)
                room = min(holds, max(holds // (len(each) * req.choices), longest + 1))
                lengths = [
                    min(n, room - len(ids)) if room - len(ids) >= 1 else n
                    for n, ids in zip(lengths, each, strict=True)
                ]
        gen_prompts = [
            GenerationRequest(
                request_id=request_id,
                model_id=model.model_id,
                prompt_ids=ids,
                max_tokens=max_tokens,
                # Without a seed every prompt draws its own (two equal prompts are two
                # samples); with one, each prompt's choices are what it gets alone.
                sampling=sampling if req.seed is not None or i == 0 else _reseeded(sampling),
                stop=req.stop_list(),
            )
            for i, (ids, max_tokens) in enumerate(zip(each, lengths, strict=True))
        ]
    except Exception as exc:  # every rejected request leaves its DIAG line, bugs included
        _report_rejected(coordinator, request_id, model_name, prompt_ids, timing, exc)
        raise
    reply = _Reply(
        kind=kind,
        reply_id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex,
        model=model.model_id,
        created=int(time.time()),
        fingerprint=_fingerprint(model.variant),
        include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        return_token_ids=bool(req.return_token_ids),
        logprobs=(
            None if req.wants_logprobs() is None else LogprobsWriter(kind, model.codec.token_bytes)
        ),
        tools=tools,
        forwarded=is_forwarded(request, request.app[keys.NODE].forwards.secret),
    )
    gen_requests = choice_requests(gen_prompts, req.choices)
    if req.stream:
        return await _stream(request, gen_requests, timing, reply)
    return await _whole(request, gen_requests, timing, reply)


def _report_rejected(
    coordinator: Coordinator,
    request_id: str,
    model: str,
    prompt_ids: list[int],
    timing: Timing,
    exc: BaseException,
) -> None:
    coordinator.report(
        RequestRecord(
            request_id=request_id,
            model=model,
            route="local",
            nodes=[],
            outcome="error",
            error_type=type(exc).__name__,
            total_ms=timing.since_received() * 1000.0,
            prompt_tokens=len(prompt_ids) if prompt_ids else None,
        )
    )


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _whole(
    request: web.Request,
    gen_requests: list[list[GenerationRequest]],
    timing: Timing,
    reply: _Reply,
) -> web.Response:
    coordinator: Coordinator = request.app[keys.COORDINATOR]
    choices = Choices(coordinator, gen_requests, timing, lambda: _client_gone(request))

    async def one(index: int) -> tuple[Generation, dict[str, Any]]:
        async with choices.generation(index) as gen:
            events = [event async for event in gen.events()]
        return gen, _whole_choice(reply, gen, events, index)

    done = await run_all([partial(one, i) for i in range(choices.n)])
    gens = [gen for gen, _ in done]
    first = gens[0]
    summary = _swarm_summary(first, reply.forwarded)
    if len(gens) > 1:
        summary["choices"] = [_swarm_summary(gen, reply.forwarded) for gen in gens]
    body: dict[str, Any] = {
        "id": reply.reply_id,
        "object": reply.object_name,
        "created": reply.created,
        "model": reply.model,
        "system_fingerprint": reply.fingerprint,
        "choices": [choice for _, choice in done],
        "usage": _usage(gens),
        "swarm": summary,
    }
    if reply.return_token_ids:
        if len(gen_requests) == 1:
            body["prompt_token_ids"] = list(first.request.prompt_ids)
        else:  # several prompts: each choice names its own
            for gen, choice in done:
                choice["prompt_token_ids"] = list(gen.request.prompt_ids)
    headers = _route_headers(first, first.request.request_id, full_timing=True)
    return web.json_response(body, headers=headers)


def _whole_choice(
    reply: _Reply, gen: Generation, events: list[Delta], index: int
) -> dict[str, Any]:
    text = "".join(event.text for event in events)
    pairs = [pair for event in events for pair in event.logprobs]
    choice = reply.whole_choice(text, gen.finish_reason, pairs, index)
    if reply.tools is not None:
        tools = reply.tools
        parsed = parse_tool_calls(text, tools.fmt, tools.names, certain=tools.certain)
        # The content the stream gives (`_write_events`), with or without calls: the
        # text around calls, without their markup or a cut call's.
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.calls]
            if gen.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        choice["message"] = message
    if reply.return_token_ids:
        choice["token_ids"] = list(gen.tokens)
    return choice


class _Sink:
    """The SSE stream the choices write to, one whole event at a time."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self._lock = asyncio.Lock()

    async def write(self, data: bytes) -> None:
        async with self._lock:
            await self.response.write(data)


async def _stream(
    request: web.Request,
    gen_requests: list[list[GenerationRequest]],
    timing: Timing,
    reply: _Reply,
) -> web.StreamResponse:
    coordinator: Coordinator = request.app[keys.COORDINATOR]
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    sink = _Sink(response)
    choices = Choices(coordinator, gen_requests, timing, lambda: _client_gone(request))
    started = asyncio.Event()  # the headers are sent (choice 0's route decides them)

    async def one(index: int) -> Generation:
        async with choices.generation(index) as gen:
            if index == 0:
                response.headers.update(_route_headers(gen, gen.request.request_id, False))
                await response.prepare(request)
                started.set()
            else:
                await started.wait()
            try:
                await _write_events(sink, gen, reply, index)
            except ConnectionResetError as exc:
                raise ClientDisconnectedError("The client closed the stream") from exc
        return gen

    try:
        gens = await run_all([partial(one, i) for i in range(choices.n)])
        if reply.include_usage:
            await sink.write(
                reply.chunk([], usage=_usage(gens), swarm=_swarm_summary(gens[0], reply.forwarded))
            )
        await sink.write(sse("[DONE]"))
    except (ClientDisconnectedError, ConnectionResetError):
        pass  # nobody is left to answer; the DIAG line has recorded it
    except KVRoomError as exc:
        if response.prepared:
            await _write_error(response, exc)
            return response
        # Too large for the route's KV room: the status says so, and so does the stream
        # a streaming client reads (one error event, then [DONE]).
        status, body, _ = classify(exc)
        refused = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await refused.prepare(request)
        await refused.write(sse(body))
        await refused.write(sse("[DONE]"))
        return refused
    except SwarmError as exc:
        if not response.prepared:
            raise  # nothing sent yet: the middleware answers with the right status
        await _write_error(response, exc)
    return response


async def _write_error(response: web.StreamResponse, exc: SwarmError) -> None:
    """Mid-stream the status is already sent, so the error travels as one event."""
    _, body, _ = classify(exc)
    with contextlib.suppress(ConnectionResetError):
        await response.write(sse(body))
        await response.write(sse("[DONE]"))


async def _write_tool_events(
    sink: _Sink, reply: _Reply, events: list[StreamEvent], pairs: Pairs, index: int
) -> None:
    """A streamed reply that may call tools: content as content deltas; each call as
    OpenAI streams it (its first delta names id and function, the next append arguments).
    A chunk's logprobs go with the first delta written for it."""
    for event in events:
        delta: dict[str, Any]
        if event[0] == "content":
            delta = {"content": event[1]}
        elif event[0] == "call_start":
            _, call, call_id, name = event
            delta = {
                "tool_calls": [
                    {
                        "index": call,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                ]
            }
        else:
            _, call, fragment = event
            delta = {"tool_calls": [{"index": call, "function": {"arguments": fragment}}]}
        choice = reply.choice(None, None, pairs=pairs, index=index)
        choice["delta"] = delta
        pairs = ()
        await sink.write(reply.chunk([choice]))
    if pairs and reply.logprobs is not None:  # held text: its logprobs still go out
        await sink.write(reply.chunk([reply.choice(None, None, pairs=pairs, index=index)]))


async def _write_events(sink: _Sink, gen: Generation, reply: _Reply, index: int) -> None:
    """One choice's chunks: its role, its text (or calls), its finish. With no usage chunk
    to come, the finish carries the choice's route summary."""
    extra: dict[str, Any] = {}
    if reply.return_token_ids and gen.request.share is None:  # each prompt's choice 0
        extra["prompt_token_ids"] = list(gen.request.prompt_ids)
    opening = reply.choice("" if reply.kind == "chat" else None, None, first=True, index=index)
    await sink.write(reply.chunk([opening], **extra))
    tools = reply.tools
    streamer = None
    if tools is not None:
        streamer = ToolCallStreamer(tools.fmt, tools.names, certain=tools.certain)
    async for event in gen.events():
        if streamer is None:
            choice = reply.choice(event.text, None, pairs=event.logprobs, index=index)
            await sink.write(reply.chunk([choice]))
        else:
            await _write_tool_events(sink, reply, streamer.feed(event.text), event.logprobs, index)
    finish_reason: str | None = gen.finish_reason
    if streamer is not None:
        await _write_tool_events(sink, reply, streamer.flush(), (), index)
        if streamer.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
    finish = reply.choice(None if reply.kind == "chat" else "", finish_reason, index=index)
    if reply.return_token_ids:
        finish["token_ids"] = list(gen.tokens)
    if reply.include_usage:
        await sink.write(reply.chunk([finish]))
    else:
        await sink.write(reply.chunk([finish], swarm=_swarm_summary(gen, reply.forwarded)))
