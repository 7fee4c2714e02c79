"""`StageRuntime`: one stage and its sessions, each with a KV cache and a sampler.

Every method runs on the torch worker thread. A session lives from `open` to `close`;
the coordinator closes it however the reply ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from swarmd.errors import ContextLengthError, InternalError, OverloadedError
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import Sampler, SamplingParams
from swarmd.model.stage import StageModule


@dataclass
class StageSession:
    session_id: str
    module: StageModule  # the layers this session runs (all this node holds, or part)
    cache: DynamicCache
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
        stage: StageModule,
        max_sessions: int,
        on_step: Callable[[float], None] | None = None,
    ) -> None:
        """`on_step(seconds)`: told the time of every forward pass (metrics)."""
        self.stage = stage
        self._on_step = on_step
        self.max_sessions = max_sessions
        self._sessions: dict[str, StageSession] = {}
        self._views: dict[LayerRange, StageModule] = {}

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
            session_id, module, module.new_cache(), max_length, sampler
        )

    def step(self, session_id: str, inputs: torch.Tensor, want_token: bool) -> StepResult:
        """Run one chunk: inputs [1, T] ids (first stage) or [1, T, H] hidden states."""
        session = self._get(session_id)
        count = int(inputs.shape[1])
        if session.length + count > session.max_length:
            raise ContextLengthError(
                f"Session {session_id} would hold {session.length + count} tokens, over its "
                f"limit of {session.max_length}"
            )
        started = time.perf_counter()
        module = session.module
        out = module(inputs, session.cache)
        token = None
        if module.is_last and want_token:
            if session.sampler is None:
                raise InternalError(f"Session {session_id} has no sampling parameters")
            token = session.sampler.sample(out[0])
        elapsed = time.perf_counter() - started
        if self._on_step is not None:
            self._on_step(elapsed)
        session.length += count
        hidden = None if module.is_last else out
        return StepResult(hidden, token, elapsed)

    def _view(self, layers: LayerRange | None) -> StageModule:
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
