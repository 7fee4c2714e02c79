"""`StageRuntime`: one stage and its sessions, each with a KV cache and a sampler.

Every method runs on the torch worker thread. A session lives from `open` to `close`;
the coordinator closes it however the reply ends.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from swarmd.errors import ContextLengthError, InternalError, OverloadedError, SwarmError
from swarmd.model.grammar import GrammarSpec
from swarmd.model.layers import LayerRange
from swarmd.model.prefix import MIN_PREFIX_TOKENS, reuse
from swarmd.model.rows import Row
from swarmd.model.sampler import Sampler
from swarmd.model.sampling import Constraint, Sampled, SamplingParams, TokenLogprobs


class Stage(Protocol):
    """Layers [start, end) of a model, runnable on their own: the engine's `LeanStage` or
    the transformers-modules `StageModule`."""

    layers_range: LayerRange
    vocab_size: int
    hidden_size: int

    @property
    def is_first(self) -> bool: ...

    @property
    def is_last(self) -> bool: ...

    @property
    def weight_formats(self) -> set[str]: ...

    def new_cache(self, max_length: int) -> Any: ...

    def fork_cache(self, cache: Any, length: int, max_length: int) -> Any | None:
        """A copy of `cache`'s first `length` positions (None: this cache cannot be cut)."""
        ...

    def view(self, layers: LayerRange) -> Stage: ...

    def __call__(self, inputs: torch.Tensor, cache: Any) -> torch.Tensor: ...

    def forward_many(self, rows: list[Row]) -> list[torch.Tensor]:
        """A chunk of each of several sequences; one output per row, as `__call__` gives."""
        ...


TRIAL_PROMPT = 4  # tokens of the trial forward's prefill


def trial_forward(stage: Stage) -> float:
    """One small prefill and one decode step outside any session; the seconds the prefill
    took (a first step: an upper bound of what a prompt token costs this stage)."""
    cache = stage.new_cache(8)
    if stage.is_first:
        chunks = [
            torch.zeros(1, TRIAL_PROMPT, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long),
        ]
    else:
        chunks = [
            torch.zeros(1, TRIAL_PROMPT, stage.hidden_size),
            torch.zeros(1, 1, stage.hidden_size),
        ]
    took = []
    with torch.inference_mode():
        for chunk in chunks:
            started = time.perf_counter()
            stage(chunk, cache)
            took.append(time.perf_counter() - started)
    return took[0]


@dataclass
class StageSession:
    session_id: str
    module: Stage  # the layers this session runs (all this node holds, or part)
    cache: Any  # the stage's KV cache for this session
    max_length: int  # tokens this session may hold in its cache
    sampler: Sampler | None  # only on the last stage
    length: int = 0
    tokens: list[int] | None = None  # the ids its cache holds (a whole-model session)
    prompt: tuple[int, ...] = ()  # its prompt ids (a whole-model session: forks check them)
    # A whole-model session's logits at the end of its prompt, kept for forks (other
    # replies to the prompt), and a fork's copy: its first step is answered from them.
    prompt_logits: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    # A stage of a route: keep its cache under this key when it ends, for the next turn
    # of the conversation, which its coordinator opens on the same route to resume it.
    keep_as: str | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.prompt)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    layers: LayerRange
    length: int  # tokens in its KV cache


@dataclass(frozen=True)
class StepRequest:
    session_id: str
    inputs: torch.Tensor  # [1, T] ids (first stage) or [1, T, H] hidden states
    want_token: bool


@dataclass(frozen=True)
class StepResult:
    hidden: torch.Tensor | None  # [1, T, H] for the next stage, when this is not the last
    token: int | None  # the sampled token, when the last stage was asked for one
    compute_s: float
    logprobs: TokenLogprobs | None = None  # the token's, when its session asked for them


@dataclass
class _Prefix:
    """A finished session's cache, kept for a next turn that starts with its tokens."""

    tokens: list[int] | None  # None: a route's stage, resumed by key only (it sees no ids)
    module: Stage
    cache: Any
    held: int  # positions its buffer holds (at least its tokens)
    prompt_length: int  # a next turn repeats more than this (its whole prompt and more)


class StageRuntime:
    def __init__(
        self,
        stage: Stage,
        max_sessions: int,
        on_step: Callable[[float], None] | None = None,
        prefix_tokens: int = 0,
        constraints: Callable[[GrammarSpec], Constraint] | None = None,
    ) -> None:
        """`on_step(seconds)`: told the time of every forward pass (metrics);
        `prefix_tokens`: how many tokens of finished conversations to keep for reuse;
        `constraints`: a grammar's fresh state for a session's reply (None: this runtime
        refuses grammars)."""
        self.stage = stage
        self._constraints = constraints
        self.prefix_tokens = prefix_tokens
        self._prefixes: OrderedDict[str, _Prefix] = OrderedDict()  # oldest first
        self.prefix_hits = 0
        self.prefix_reused_tokens = 0
        self._on_step = on_step
        self.max_sessions = max_sessions
        self._sessions: dict[str, StageSession] = {}
        self._views: dict[LayerRange, Stage] = {}
        self.batches = 0  # forwards run
        self.batched_rows = 0  # session steps they ran
        self.last_batch = 0  # rows in the latest forward

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        return sum(s.length for s in list(self._sessions.values()))

    def sessions(self) -> list[SessionInfo]:
        """A snapshot of the open sessions (readable from outside the worker thread)."""
        return [
            SessionInfo(s.session_id, s.module.layers_range, s.length)
            for s in list(self._sessions.values())
        ]

    def open(
        self,
        session_id: str,
        max_length: int,
        sampling: SamplingParams | None,
        history: list[int] | None = None,
        layers: LayerRange | None = None,
        prompt: list[int] | None = None,
        share: str | None = None,
        resume: tuple[str, int] | None = None,
        keep_as: str | None = None,
        copy: bool = False,
    ) -> int:
        """Create a session over `layers` (default: all held); return how many tokens of
        `prompt` its cache already holds (reused from a finished conversation that began
        with them, or copied from the open session `share`, another reply to the same
        prompt: the caller prefills only the rest).

        `history`: reply tokens already sampled (for the penalties), when a session is
        rebuilt after a failover. `resume` (key, n): a route's stage takes over the cache
        a finished session kept under `key`, cut to its first n positions (0 when it is
        not kept any more: the coordinator then prefills from the start); `keep_as`: when
        this session ends, keep its cache under that key for such a resume; `copy`: the
        resume copies those n positions and the cache stays kept (a request that shares
        the conversation's start, not its next turn).
        """
        if session_id in self._sessions:
            raise InternalError(f"Session {session_id} is already open")
        if len(self._sessions) >= self.max_sessions:
            raise OverloadedError(f"All {self.max_sessions} session slots of this stage are busy")
        module = self._view(layers)
        sampler = None
        if module.is_last and sampling is not None:
            constraint = None
            if sampling.grammar is not None:
                if self._constraints is None:
                    raise InternalError("this stage has no tokenizer for a grammar")
                constraint = self._constraints(sampling.grammar)
            sampler = Sampler(sampling, module.vocab_size, constraint)
            for token in history or []:
                sampler.observe(token)
        reused, cache, pending = self._fork(share, module, prompt, max_length)
        if cache is None and resume is not None:
            reused, cache = self._resume(module, resume[0], resume[1], max_length, copy)
        if cache is None:
            reused, cache = self._adopt(module, prompt, max_length)
        track = module.is_first and prompt is not None and self.prefix_tokens > 0
        self._sessions[session_id] = StageSession(
            session_id,
            module,
            cache if cache is not None else module.new_cache(max_length),
            max_length,
            sampler,
            reused,
            list(prompt[:reused]) if track and prompt is not None else None,
            tuple(prompt or ()),
            pending=pending,
            keep_as=keep_as,
        )
        return reused

    def _fork(
        self, share: str | None, module: Stage, prompt: list[int] | None, max_length: int
    ) -> tuple[int, Any, torch.Tensor | None]:
        """Another reply to the prompt of open session `share`: a copy of its cache holding
        the whole prompt, and its logits there. The caller is told all but the last token
        are cached and sends that one; its step is answered from the logits without a
        forward, so the reply draws from exactly the numbers a fresh prefill gives.
        (0, None, None) when `share` is not open on these layers with this prompt
        prefilled: a fresh prefill."""
        sibling = self._sessions.get(share) if share is not None else None
        if sibling is None or sibling.module is not module or not prompt:
            return 0, None, None
        if sibling.prompt_logits is None or sibling.prompt != tuple(prompt):
            return 0, None, None  # not prefilled yet, or another prompt
        cache = module.fork_cache(sibling.cache, len(prompt), max_length)
        if cache is None:
            return 0, None, None
        self.prefix_hits += 1
        self.prefix_reused_tokens += len(prompt) - 1
        return len(prompt) - 1, cache, sibling.prompt_logits

    def _adopt(self, module: Stage, prompt: list[int] | None, max_length: int) -> tuple[int, Any]:
        """The most of `prompt` a cache here already holds: a kept conversation it
        continues (its whole prompt and some of its reply) is taken over, cut to the
        shared start; a start shared with any other conversation, finished or still
        running (the same system prompt, the same prompt again), is copied. (0, None):
        nothing worth reusing."""
        if not prompt or self.prefix_tokens <= 0:
            return 0, None
        best_key, best = None, 0  # a kept conversation `prompt` continues: taken over
        source, shared = None, 0  # the longest start it shares with any: copied
        for key, kept in self._prefixes.items():
            if kept.module is not module or kept.tokens is None:
                continue
            take, copy = reuse(kept.tokens, kept.prompt_length, prompt)
            if take > best:
                best_key, best = key, take
            if copy > shared:
                source, shared = kept.cache, copy
        for session in self._sessions.values():  # running: only ever copied
            if session.module is module and session.pending is None and session.tokens:
                # (a transformers cache has no `length`: it is never copied)
                held = int(getattr(session.cache, "length", 0))
                copy = min(reuse(session.tokens, 0, prompt)[1], held)
                if copy > shared and copy >= MIN_PREFIX_TOKENS:
                    source, shared = session.cache, copy
        # Copying is exact: a position's bits do not depend on the chunk that computed
        # it (engine/attention.py). A continuation at least as long is taken instead.
        if shared > best and source is not None:
            cache = module.fork_cache(source, shared, max_length)
            if cache is not None:
                self.prefix_hits += 1
                self.prefix_reused_tokens += shared
                return shared, cache
        if best_key is None:
            return 0, None
        return self._take(best_key, best, max_length)

    def _resume(
        self, module: Stage, key: str, length: int, max_length: int, copy: bool = False
    ) -> tuple[int, Any]:
        """The cache kept under `key` by a session over the same layers, cut to `length`
        positions (with `copy`, a copy of them: the kept cache stays, now the most
        recently used); (0, None) when it is gone (evicted, or never kept here) or
        shorter."""
        if key not in self._prefixes:
            self._end_keeper(key)
        kept = self._prefixes.get(key)
        if kept is None or kept.module is not module or not 0 < length < max_length:
            return 0, None
        if kept.cache.length < length:
            return 0, None
        if copy:
            cache = module.fork_cache(kept.cache, length, max_length)
            if cache is None:
                return 0, None
            self._prefixes.move_to_end(key)
            self.prefix_hits += 1
            self.prefix_reused_tokens += length
            return length, cache
        return self._take(key, length, max_length)

    def _end_keeper(self, key: str) -> None:
        """Close the session still open to keep its cache under `key`, if any. Its
        coordinator resumes only a turn it has finished, so that session is done: its
        close is on another stream and may come after this open (a next turn sent at
        once), and must not make the resume miss."""
        for session_id, session in list(self._sessions.items()):
            if session.keep_as == key:
                self.close(session_id)  # the late close then finds nothing to do
                return

    def _take(self, key: str, length: int, max_length: int) -> tuple[int, Any]:
        """Take the kept cache `key` over for a new session, cut to `length` positions."""
        kept = self._prefixes.pop(key)
        kept.cache.length = length  # later positions are overwritten as the session runs
        kept.cache.max_length = max_length
        self.prefix_hits += 1
        self.prefix_reused_tokens += length
        return length, kept.cache

    def step(self, session_id: str, inputs: torch.Tensor, want_token: bool) -> StepResult:
        """Run one chunk: inputs [1, T] ids (first stage) or [1, T, H] hidden states."""
        outcome = self.step_many([StepRequest(session_id, inputs, want_token)])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def step_many(self, requests: list[StepRequest]) -> list[StepResult | SwarmError]:
        """Run a chunk of each of several sessions, batched where the stage allows.

        Sessions over the same layers share one forward (the engine's `forward_many`);
        each request gets its result, or its own error (a session that is not open, or a
        chunk past its length) without failing the others.
        """
        outcomes: list[StepResult | SwarmError | None] = [None] * len(requests)
        groups: dict[int, list[tuple[int, StageSession, StepRequest]]] = {}
        for i, req in enumerate(requests):
            try:
                session = self._get(req.session_id)
                count = int(req.inputs.shape[1])
                if session.length + count > session.max_length:
                    raise ContextLengthError(
                        f"Session {req.session_id} would hold {session.length + count} "
                        f"tokens, over its limit of {session.max_length}"
                    )
                if session.module.is_last and req.want_token and session.sampler is None:
                    raise InternalError(f"Session {req.session_id} has no sampling parameters")
                if session.pending is not None:
                    outcomes[i] = self._answer_fork(session, req)
                    continue
            except SwarmError as exc:
                outcomes[i] = exc
                continue
            groups.setdefault(id(session.module), []).append((i, session, req))
        for group in groups.values():
            for i, result in self._run_group(group):
                outcomes[i] = result
        return [o if o is not None else InternalError("step not run") for o in outcomes]

    def _answer_fork(self, session: StageSession, req: StepRequest) -> StepResult:
        """A fork's first step: its prompt's last token, already in the copied cache."""
        logits, session.pending = session.pending, None
        if logits is None or req.inputs.tolist() != [[session.prompt[-1]]]:
            raise InternalError(
                f"Session {session.session_id}: a fork's first step is its prompt's last token"
            )
        session.length += 1
        if session.tokens is not None:
            session.tokens.append(session.prompt[-1])
        drawn = None
        if req.want_token and session.sampler is not None:
            drawn = session.sampler.draw(logits.clone())  # the sibling's stay as they were
        return StepResult(
            None,
            None if drawn is None else drawn.token,
            0.0,
            None if drawn is None else drawn.logprobs,
        )

    def _run_group(
        self, group: list[tuple[int, StageSession, StepRequest]]
    ) -> list[tuple[int, StepResult]]:
        module = group[0][1].module
        started = time.perf_counter()
        outs = module.forward_many([Row(req.inputs, s.cache) for _, s, req in group])
        sampled: list[tuple[int, torch.Tensor, Sampled | None]] = []
        for (i, session, req), out in zip(group, outs, strict=True):
            session.length += int(req.inputs.shape[1])  # the cache holds them now
            if session.tokens is not None:
                session.tokens.extend(req.inputs[0].tolist())
            drawn = None
            if module.is_last and req.want_token and session.sampler is not None:
                if module.is_first and session.length == session.prompt_length:
                    session.prompt_logits = out[0].clone()  # for forks of this prompt
                drawn = session.sampler.draw(out[0])
            sampled.append((i, out, drawn))
        elapsed = time.perf_counter() - started
        if self._on_step is not None:
            self._on_step(elapsed)
        self.batches += 1
        self.batched_rows += len(group)
        self.last_batch = len(group)
        hidden = not module.is_last
        return [
            (
                i,
                StepResult(
                    out if hidden else None,
                    None if drawn is None else drawn.token,
                    elapsed,
                    None if drawn is None else drawn.logprobs,
                ),
            )
            for i, out, drawn in sampled
        ]

    def warm_up(self) -> None:
        """A trial forward on the worker thread, outside any session: the first request
        then finds the kernels, the thread team and the tables ready."""
        trial_forward(self.stage)

    def _view(self, layers: LayerRange | None) -> Stage:
        if layers is None:
            return self.stage
        view = self._views.get(layers)
        if view is None:  # a handful of ranges at most: the ones routes ask for
            view = self._views[layers] = self.stage.view(layers)
        return view

    def close(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None or not hasattr(session.cache, "length"):
            return  # only the engine's caches can be cut back to a shared start
        key, tokens = session_id, session.tokens
        if session.keep_as is not None:  # a route's stage: resumed by key, by its coordinator
            key, tokens = session.keep_as, None
        elif tokens is None or session.cache.length != len(tokens):
            return  # nothing a prompt could be matched against
        if session.cache.length < MIN_PREFIX_TOKENS:
            return
        held = max(session.cache.length, int(getattr(session.cache, "capacity", 0)))
        self._prefixes.pop(key, None)
        if held > self.prefix_tokens:
            return  # it would push out every other conversation, and then itself
        kept = _Prefix(tokens, session.module, session.cache, held, session.prompt_length)
        self._prefixes[key] = kept
        while self._prefixes and self.prefix_held_tokens > self.prefix_tokens:
            self._prefixes.popitem(last=False)  # the least recently finished goes

    @property
    def prefix_held_tokens(self) -> int:
        return sum(p.held for p in list(self._prefixes.values()))

    def _get(self, session_id: str) -> StageSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise InternalError(f"Session {session_id} is not open on this stage")
        return session
