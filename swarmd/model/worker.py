"""`TorchWorker`: the one thread that runs torch, fed typed jobs through a queue.

Model compute never runs on an event loop. A job is `OpenJob`, `StepJob` or `CloseJob`
on the node's `StageRuntime`; `submit` queues one from any thread and returns a `Ticket`
that calls a `wake` function (on the worker thread) when the job starts and when it ends.
The waiters are thin: `TorchWorker.run` for asyncio (the HTTP side) and
`worker_trio.run_job` for trio (the stage service), so a remote step goes trio -> worker
-> trio with no detour through the other loop.

Every wait has a timeout counted from the moment the worker starts the job (time in the
queue is the admission's business, not the step's). A queued job whose caller has gone is
skipped, unless it must run (a `CloseJob` frees a KV cache whoever still waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from swarmd.errors import InternalError, StepTimeoutError, SwarmError
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenJob:
    session_id: str
    max_length: int  # tokens the session may hold
    sampling: SamplingParams | None  # only where the last stage samples
    history: tuple[int, ...] = ()  # reply tokens so far (a session rebuilt after failover)
    layers: LayerRange | None = None  # part of what this node holds; None = all


@dataclass(frozen=True)
class StepJob:
    session_id: str
    inputs: torch.Tensor  # [1, T] ids (first stage) or [1, T, H] hidden states
    want_token: bool
    alone: bool = False  # attend each position as a one-token step would (replays)


@dataclass(frozen=True)
class CloseJob:
    session_id: str


Job = OpenJob | StepJob | CloseJob


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
    ) -> None: ...

    def step(
        self, session_id: str, inputs: torch.Tensor, want_token: bool, alone: bool = False
    ) -> Any: ...

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

    @property
    def started(self) -> bool:
        return self.state != _QUEUED

    @property
    def finished(self) -> bool:
        return self.state in (_DONE, _SKIPPED)

    def cancel(self) -> None:
        """The caller left: a job that has not started will not (unless it must run)."""
        with self._lock:
            if self.state == _QUEUED and not self.must_run:
                self.state = _SKIPPED

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
        self._notify()
        return True

    def _end(self, result: Any, error: BaseException | None) -> None:
        self.result, self.error = result, error
        self.state = _DONE
        self._notify()

    def _notify(self) -> None:
        # A waiting loop that has closed (shutdown) has nobody left to tell.
        with contextlib.suppress(RuntimeError):
            self._wake()


class TorchWorker:
    def __init__(self, runtime: Runtime, threads: int = 0, name: str = "swarmd-torch") -> None:
        self.runtime = runtime
        self._threads = threads
        self._queue: queue.SimpleQueue[Ticket | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._running = False
        self._exited = threading.Event()

    def start(self) -> None:
        self._running = True
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._running and self._thread.is_alive()

    def submit(self, job: Job, wake: Callable[[], None]) -> Ticket:
        """Queue a job; `wake()` is called on the worker thread when it starts and ends."""
        if not self.running:
            raise InternalError("The torch worker is not running")
        ticket = Ticket(job, wake)
        self._queue.put(ticket)
        return ticket

    async def run(self, job: Job, timeout_s: float) -> Any:
        """Run a job from asyncio and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        ticket = self.submit(job, lambda: loop.call_soon_threadsafe(changed.set))
        try:
            while not ticket.started:
                await changed.wait()
                changed.clear()
            async with asyncio.timeout(timeout_s):
                while not ticket.finished:
                    await changed.wait()
                    changed.clear()
        except TimeoutError as exc:
            raise StepTimeoutError(f"A model step took longer than {timeout_s:g} s") from exc
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
            while (ticket := self._queue.get()) is not None:
                if not ticket._begin():
                    continue
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
        finally:
            self._running = False
            # A job queued after the stop (a submit racing `shutdown`) is failed, not left
            # to a waiter that would wait for it forever.
            while True:
                try:
                    late = self._queue.get_nowait()
                except queue.Empty:
                    break
                if late is not None and late._begin():
                    late._end(None, InternalError("The torch worker stopped"))
            self._exited.set()

    def _execute(self, job: Job) -> Any:
        if isinstance(job, StepJob):
            return self.runtime.step(job.session_id, job.inputs, job.want_token, job.alone)
        if isinstance(job, OpenJob):
            return self.runtime.open(
                job.session_id, job.max_length, job.sampling, list(job.history), job.layers
            )
        return self.runtime.close(job.session_id)
