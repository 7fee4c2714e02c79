"""`TorchWorker`: the one thread that runs torch, fed typed jobs through a queue.

Model compute never runs on the asyncio loop (the HTTP side). The one exception to "on
the worker thread" is `run_here`: a short step of the only session open on a stage, run
by the stage service's trio thread itself (the worker idle, one job at a time either
way). A job is `OpenJob`, `StepJob` or `CloseJob`
on the node's `StageRuntime`; `submit` queues one from any thread and returns a `Ticket`
that calls a `wake` function (on the worker thread) when the job starts and when it ends.
The waiters are thin: `TorchWorker.run` for asyncio (the HTTP side) and
`worker_trio.run_job` for trio (the stage service), so a remote step goes trio -> worker
-> trio with no detour through the other loop (or stays on trio: `run_here`).

Every wait has a timeout counted from the moment the worker starts the job (time in the
queue is the admission's business, not the step's). A queued job whose caller has gone is
skipped, unless it must run (a `CloseJob` frees a KV cache whoever still waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from swarmd.errors import InternalError, StepTimeoutError, SwarmError
from swarmd.model.batching import Gatherer
from swarmd.model.jobs import CloseJob, Job, OpenJob, StepJob
from swarmd.model.layers import LayerRange
from swarmd.model.runtime import StepRequest
from swarmd.model.sampling import SamplingParams

log = logging.getLogger(__name__)


class Runtime(Protocol):
    """What the worker runs jobs on (`model.runtime.StageRuntime`)."""

    def warm_up(self) -> None: ...

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
    ) -> int: ...

    def step_many(self, requests: list[StepRequest]) -> list[Any]: ...

    def close(self, session_id: str) -> None: ...


_QUEUED, _RUNNING, _DONE, _SKIPPED = "queued", "running", "done", "skipped"


class Ticket:
    """One submitted job: its state, and its result or error once done."""

    def __init__(self, job: Job, wake: Callable[[], None]) -> None:
        self.job = job
        self.must_run = isinstance(job, CloseJob)
        self._wake = wake
        self._lock = threading.Lock()
        self.state = _QUEUED
        self.result: Any = None
        self.error: BaseException | None = None
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None  # monotonic seconds; None while queued

    @property
    def finished(self) -> bool:
        return self.state in (_DONE, _SKIPPED)

    def cancel(self) -> None:
        """The caller left: a job that has not started will not (unless it must run)."""
        with self._lock:
            if self.state == _QUEUED and not self.must_run:
                self.state = _SKIPPED

    def time_left(self, timeout_s: float) -> float:
        """Seconds the job may still run: a step's timeout counts from its start (a queued
        job waits for those ahead of it); the whole timeout while it is queued."""
        started_at = self.started_at
        return timeout_s if started_at is None else started_at + timeout_s - time.monotonic()

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result

    # --- worker side ---

    def _begin(self) -> bool:
        with self._lock:
            if self.state != _QUEUED:
                return False
            self.state = _RUNNING
            self.started_at = time.monotonic()
        # No wake-up here: the caller learns of the start when it checks its deadline
        # (one cross-thread wake-up a job instead of two: a decode step's overhead).
        return True

    def _end(self, result: Any, error: BaseException | None) -> None:
        self.result, self.error = result, error
        self.state = _DONE
        self._notify()

    def _notify(self) -> None:
        # A waiting loop that has closed (shutdown) has nobody left to tell.
        with contextlib.suppress(RuntimeError):
            self._wake()


BATCH_TOKENS = 512  # tokens of one forward: decode rows plus prompt chunks
GATHER_MAX_S = 0.005  # the longest a forward waits for a session that comes back quickly
# A stage on rings of several stages: a forward waits for its share of the sessions (below)
# up to this share of a forward's time, and never longer than RING_WAIT_MAX_S.
RING_WAIT_SHARE = 0.5
RING_WAIT_MAX_S = 0.02
# `run_here` runs a step on its caller's thread only when it is a short one: the caller
# (the stage service's trio thread) answers nothing else while it computes, so this
# bounds how long the node's networking waits (DESIGN.md section 1 keeps compute off the
# event loops; this is the one measured exception).
HERE_MAX_TOKENS = 8
HERE_MAX_FORWARD_S = 0.02


class TorchWorker:
    def __init__(
        self,
        runtime: Runtime,
        threads: int = 0,
        name: str = "swarmd-torch",
        batch_tokens: int = BATCH_TOKENS,
        gather_max_s: float = GATHER_MAX_S,
    ) -> None:
        self.runtime = runtime
        self._threads = threads
        self._queue: queue.SimpleQueue[Ticket | None] = queue.SimpleQueue()
        self._pending: deque[Ticket] = deque()  # taken from the queue, not run yet
        self._stopping = False
        self._batch_tokens = batch_tokens
        self._gatherer = Gatherer(gather_max_s)
        self._rings: dict[str, int] = {}  # open session -> stages on its route
        self._forward_s = 0.0  # a forward's time, an exponential average
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._running = False
        self._exited = threading.Event()
        # Held while a job runs, on the worker thread or on a caller's (`run_here`).
        self._busy = threading.Lock()

    def start(self) -> None:
        self._running = True
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._running and self._thread.is_alive()

    def submit(self, job: Job, wake: Callable[[], None]) -> Ticket:
        """Queue a job; `wake()` is called on the worker thread when it ends."""
        if not self.running:
            raise InternalError("The torch worker is not running")
        ticket = Ticket(job, wake)
        self._queue.put(ticket)
        return ticket

    def run_here(self, job: Job) -> Ticket | None:
        """Run a step on the calling thread, at once, when the worker is idle and nothing
        could share its forward: the step's session the only one open here, a few tokens,
        forwards measured short. None otherwise (submit it). A decode step on a stage then
        skips two cross-thread wake-ups (to the worker and back) and runs with the caches
        its frame's parsing warmed: measured, a hop 0.46 ms cheaper (issue 17)."""
        if (
            not isinstance(job, StepJob)
            or job.session_id not in self._rings
            or len(self._rings) > 1
            or job.inputs.shape[1] > HERE_MAX_TOKENS
            # measured short: a step run here cannot time out, and nothing else of the
            # caller's runs meanwhile (a stage's trio thread: its pings, its frames)
            or not 0 < self._forward_s <= HERE_MAX_FORWARD_S
            or not self.running
        ):
            return None
        if not self._busy.acquire(blocking=False):
            return None
        try:
            # Anything queued or taken goes first: a session's jobs keep their order.
            if self._pending or not self._queue.empty():
                return None
            ticket = Ticket(job, _nobody)
            self._run_steps([ticket])
            return ticket
        finally:
            self._busy.release()

    async def run(self, job: Job, timeout_s: float) -> Any:
        """Run a job from asyncio and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        ticket = self.submit(job, lambda: loop.call_soon_threadsafe(changed.set))
        try:
            while not ticket.finished:
                left = ticket.time_left(timeout_s)
                if left <= 0:
                    raise StepTimeoutError(f"A model step took longer than {timeout_s:g} s")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await changed.wait()
                changed.clear()
        finally:
            ticket.cancel()  # tells the worker to skip it if it has not started
        return ticket.outcome()

    async def stop(self) -> None:
        """Finish the queued jobs and end the thread (from asyncio)."""
        await asyncio.to_thread(self.shutdown)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Finish the queued jobs and end the thread (blocking; any thread)."""
        if not self._running:
            return
        self._running = False
        if self._thread.is_alive():
            self._queue.put(None)
            self._exited.wait(timeout_s)
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        if self._threads > 0:
            torch.set_num_threads(self._threads)
        try:
            try:
                self.runtime.warm_up()  # jobs queued meanwhile wait for it
            except Exception:  # a stage that cannot run says so on its first real step
                log.exception("warming up the stage failed")
            while (ticket := self._next()) is not None:
                with self._busy:
                    self._take(ticket)
        finally:
            self._running = False
            # A job queued after the stop (a submit racing `shutdown`) is failed, not left
            # to a waiter that would wait for it forever.
            self._drain()
            for late in self._pending:
                if late._begin():
                    late._end(None, InternalError("The torch worker stopped"))
            self._exited.set()

    def _take(self, ticket: Ticket) -> None:
        if isinstance(ticket.job, StepJob):
            self._run_steps(self._gather(ticket))
            return
        if not ticket._begin():
            return
        result: Any = None
        error: BaseException | None = None
        try:
            result = self._execute(ticket.job)
        except SwarmError as exc:
            error = exc
        except Exception as exc:  # a torch failure must reach the caller, typed
            log.exception("model step failed")
            error = InternalError(f"Model step failed: {type(exc).__name__}: {exc}")
        ticket._end(result, error)

    # --- the queue, and batches of steps ---------------------------------------------

    def _next(self) -> Ticket | None:
        """The oldest open not taken yet, else the oldest job (blocking); None once the
        worker is to stop.

        Opens go first: an open only sets a session up (a cache, maybe a copy of a kept
        one: milliseconds), and its ring waits for every stage's open within one deadline
        (`Ring.open`), while the prompts of sessions already open may queue a minute of
        forwards here under load. A session's own jobs keep their order: its steps are
        only sent once its open has answered."""
        while True:
            if self._pending:
                self._drain()
                for ticket in self._pending:
                    if isinstance(ticket.job, OpenJob):
                        self._pending.remove(ticket)
                        return ticket
                return self._pending.popleft()
            if self._stopping:
                return None
            item = self._queue.get()
            if item is None:
                return None
            self._pending.append(item)

    def _drain(self, timeout_s: float = 0.0) -> bool:
        """Move what is queued into `_pending` (waiting up to `timeout_s` for the first)."""
        got = False
        while not self._stopping:
            try:
                item = self._queue.get(block=timeout_s > 0, timeout=timeout_s or None)
            except queue.Empty:
                break
            timeout_s = 0.0
            if item is None:
                self._stopping = True  # after what is pending
                break
            self._pending.append(item)
            got = True
        return got

    def _ring_share(self) -> int:
        """The sessions one forward should hold where some come through rings of several
        stages: a session on a ring of N stages counts 1/N, one that runs here alone 1;
        0 where every session runs here alone (no cap, no wait).

        A ring of N stages serves most when its sessions move as N groups, one on each
        stage, instead of all on one stage while the others idle (README "Many users at
        once"); left alone, they also scatter into forwards of one or two rows as their
        steps come back at different times."""
        if not any(n > 1 for n in self._rings.values()):
            return 0
        return max(1, math.ceil(sum(1 / n for n in self._rings.values()) - 1e-9))

    def _gather(self, first: Ticket) -> list[Ticket]:
        """`first` and the queued steps of other sessions that fit the token budget (and,
        on a ring, the session share of `_ring_share`).

        Jobs stay in order per session: once a session has a job left behind (a close, or
        a second step), none of its later jobs joins this forward.
        """
        batch = [first]
        present = {_sid(first)}
        tokens = _tokens(first)
        blocked: set[str] = set()
        until: float | None = None
        share = self._ring_share()
        # A forward short of its share waits for the steps that come back from the ring.
        ring_until = time.monotonic() + min(RING_WAIT_MAX_S, RING_WAIT_SHARE * self._forward_s)
        self._drain()
        while True:
            kept: deque[Ticket] = deque()
            for ticket in self._pending:
                sid = _sid(ticket)
                if not isinstance(ticket.job, StepJob) or sid in present or sid in blocked:
                    kept.append(ticket)
                    blocked.add(sid)
                    continue
                if ticket.finished:  # skipped: its caller left
                    continue
                full = share > 0 and len(batch) >= share
                if full or tokens + _tokens(ticket) > self._batch_tokens:
                    kept.append(ticket)
                    blocked.add(sid)
                    continue
                batch.append(ticket)
                present.add(sid)
                tokens += _tokens(ticket)
            self._pending = kept
            if until is None:
                until = self._gatherer.wait_until(present)
            short = share > 0 and len(batch) < share
            left = max(until, ring_until if short else 0.0) - time.monotonic()
            full = tokens >= self._batch_tokens or (share > 0 and len(batch) >= share)
            if left <= 0 or full or not self._drain(left):
                return batch

    def _run_steps(self, batch: list[Ticket]) -> None:
        tickets = [t for t in batch if t._begin()]
        if not tickets:
            return
        for t in tickets:
            self._gatherer.arrived(_sid(t), t.submitted_at)
        requests = []
        for t in tickets:
            job = t.job
            assert isinstance(job, StepJob)
            requests.append(StepRequest(job.session_id, job.inputs, job.want_token))
        outcomes: list[Any]
        started = time.monotonic()
        try:
            outcomes = self.runtime.step_many(requests)
        except SwarmError as exc:
            outcomes = [exc] * len(tickets)
        except Exception as exc:  # a torch failure must reach every caller, typed
            log.exception("model step failed")
            error = InternalError(f"Model step failed: {type(exc).__name__}: {exc}")
            outcomes = [error] * len(tickets)
        self._gatherer.ended(_sid(t) for t in tickets)
        took = time.monotonic() - started
        self._forward_s = took if not self._forward_s else 0.8 * self._forward_s + 0.2 * took
        for ticket, outcome in zip(tickets, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                ticket._end(None, outcome)
            else:
                ticket._end(outcome, None)

    def _execute(self, job: Job) -> Any:
        if isinstance(job, CloseJob):
            self._gatherer.forget(job.session_id)
            self._rings.pop(job.session_id, None)
        if isinstance(job, OpenJob):
            opened = self.runtime.open(
                job.session_id,
                job.max_length,
                job.sampling,
                list(job.history),
                job.layers,
                list(job.prompt) or None,
                job.share,
                job.resume,
                job.keep_as,
                job.copy,
            )
            self._rings[job.session_id] = job.ring
            return opened
        return self.runtime.close(job.session_id)


def _nobody() -> None:
    """The wake-up of a job run on its caller's thread: nobody waits for it."""


def _sid(ticket: Ticket) -> str:
    return ticket.job.session_id


def _tokens(ticket: Ticket) -> int:
    job = ticket.job
    return int(job.inputs.shape[1]) if isinstance(job, StepJob) else 0
