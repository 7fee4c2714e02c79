"""`StageRuntime`: one stage and its sessions, each with a KV cache and a sampler.

Every method runs on the torch worker thread. A session lives from `open` to `close`;
the coordinator closes it however the reply ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from swarmd.errors import ContextLengthError, InternalError, OverloadedError
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import Sampler, SamplingParams


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

    def view(self, layers: LayerRange) -> Stage: ...

    def __call__(self, inputs: torch.Tensor, cache: Any, alone: bool = False) -> torch.Tensor:
        """`alone`: attend each position of the chunk as a one-token step would."""
        ...


def trial_forward(stage: Stage) -> None:
    """One small prefill and one decode step outside any session."""
    cache = stage.new_cache(8)
    if stage.is_first:
        chunks = [torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)]
    else:
        chunks = [torch.zeros(1, 4, stage.hidden_size), torch.zeros(1, 1, stage.hidden_size)]
    with torch.inference_mode():
        for chunk in chunks:
            stage(chunk, cache)


@dataclass
class StageSession:
    session_id: str
    module: Stage  # the layers this session runs (all this node holds, or part)
    cache: Any  # the stage's KV cache for this session
    max_length: int  # tokens this session may hold in its cache
    sampler: Sampler | None  # only on the last stage
    length: int = 0


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    layers: LayerRange
    length: int  # tokens in its KV cache


@dataclass(frozen=True)
class StepResult:
    hidden: torch.Tensor | None  # [1, T, H] for the next stage, when this is not the last
    token: int | None  # the sampled token, when the last stage was asked for one
    compute_s: float


class StageRuntime:
    def __init__(
        self,
        stage: Stage,
        max_sessions: int,
        on_step: Callable[[float], None] | None = None,
    ) -> None:
        """`on_step(seconds)`: told the time of every forward pass (metrics)."""
        self.stage = stage
        self._on_step = on_step
        self.max_sessions = max_sessions
        self._sessions: dict[str, StageSession] = {}
        self._views: dict[LayerRange, Stage] = {}

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
    ) -> None:
        """Create a session over `layers` (default: all held).

        `history`: reply tokens already sampled (for the penalties), when a session is
        rebuilt after a failover.
        """
        if session_id in self._sessions:
            raise InternalError(f"Session {session_id} is already open")
        if len(self._sessions) >= self.max_sessions:
            raise OverloadedError(f"All {self.max_sessions} session slots of this stage are busy")
        module = self._view(layers)
        sampler = None
        if module.is_last and sampling is not None:
            sampler = Sampler(sampling, module.vocab_size)
            for token in history or []:
                sampler.observe(token)
        self._sessions[session_id] = StageSession(
            session_id, module, module.new_cache(max_length), max_length, sampler
        )

    def step(
        self, session_id: str, inputs: torch.Tensor, want_token: bool, alone: bool = False
    ) -> StepResult:
        """Run one chunk: inputs [1, T] ids (first stage) or [1, T, H] hidden states.

        `alone`: each position attends as a one-token step would (a replay of reply
        tokens after a failover gets the very numbers their decode steps had)."""
        session = self._get(session_id)
        count = int(inputs.shape[1])
        if session.length + count > session.max_length:
            raise ContextLengthError(
                f"Session {session_id} would hold {session.length + count} tokens, over its "
                f"limit of {session.max_length}"
            )
        started = time.perf_counter()
        module = session.module
        out = module(inputs, session.cache, alone)
        session.length += count  # the cache holds them now, whatever sampling does
        token = None
        if module.is_last and want_token:
            if session.sampler is None:
                raise InternalError(f"Session {session_id} has no sampling parameters")
            token = session.sampler.sample(out[0])
        elapsed = time.perf_counter() - started
        if self._on_step is not None:
            self._on_step(elapsed)
        hidden = None if module.is_last else out
        return StepResult(hidden, token, elapsed)

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
        self._sessions.pop(session_id, None)

    def _get(self, session_id: str) -> StageSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise InternalError(f"Session {session_id} is not open on this stage")
        return session
