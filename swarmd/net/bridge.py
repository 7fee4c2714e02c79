"""The one crossing between asyncio (the process's main loop) and trio (py-libp2p).

aiohttp, signals and shutdown live on asyncio, in the main thread; py-libp2p is built on
trio, which runs in a thread of its own (`trio.run` in the "swarmd-trio" thread). No
other module of swarmd imports both libraries (DESIGN.md section 1).

    bridge = TrioBridge()
    await bridge.start()
    peers = await bridge.run(host_get_peers, host)      # asyncio -> trio, with its result
    bridge.start_soon(serve_protocol, host)             # background trio task
    ... inside trio code: value = await bridge.to_asyncio(some_coroutine())
    await bridge.stop()

Why a thread and not a guest run on the asyncio loop (what swarmd did up to 0.7): a guest
run waits for I/O in a helper thread and comes back to the loop through
`call_soon_threadsafe`, so every wake of the network side (a frame arriving, the torch
worker done) crossed two threads instead of one, and each trio checkpoint cost an asyncio
loop iteration. Measured on a 2-core box (`bench/p2p.py`, 2 KB frames, two runs each): a
libp2p round trip 0.82 / 1.03 ms as guest runs against 0.53 / 0.78 ms with trio in its
own thread; a stage hop pays that twice (issue 17).

Rules the bridge keeps:

- Trio objects (nurseries, cancel scopes, channels, events) are touched only in the trio
  thread: the asyncio side reaches trio through `TrioToken.run_sync_soon`, and asyncio
  objects only in the loop's thread: trio reaches asyncio through
  `loop.call_soon_threadsafe`. State both sides read or write is either immutable, read
  as a whole value (a snapshot), or guarded by a lock of its own.
- Every trio task belongs to the root nursery; a call made with `run()` is cancelled with
  its asyncio caller, and the caller sees `CancelledError` only once the trio side has
  finished unwinding, so no trio task outlives the code that asked for it.
- `stop()` cancels the root scope and returns once the trio thread has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import types
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import trio

from swarmd.errors import InternalError

__all__ = ["TrioBridge", "call_on_loop", "resolve_soon"]

log = logging.getLogger(__name__)

T = TypeVar("T")

THREAD_NAME = "swarmd-trio"


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(*args)` on `loop` from any thread (in call order); nothing when the loop has
    closed (the process is shutting down and nobody waits for it any more)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def resolve_soon(future: asyncio.Future[None]) -> None:
    """Resolve `future` (with None) on its own loop, from any thread; once only."""
    call_on_loop(future.get_loop(), _resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(eq=False)
class _Call(Generic[T]):
    """One `TrioBridge.run` call: what to run in trio and where its result lands.

    `finished` is an asyncio future resolved (on the loop) once the trio side has
    completely unwound the call. The cancel scope is created on the asyncio side (a scope
    is a plain object until entered) but only ever entered and cancelled in trio.
    """

    fn: Callable[..., Awaitable[T]]
    args: tuple[Any, ...]
    finished: asyncio.Future[None]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    value: T | None = None
    error: BaseException | None = None
    settled: bool = False  # trio side only

    def settle(self, value: T | None = None, error: BaseException | None = None) -> None:
        """(trio) Record the call's result; the first settle wins (later ones are no-ops).
        The value is written before the loop is told, so the caller reads it whole."""
        if self.settled:
            return
        self.settled = True
        self.value, self.error = value, error
        resolve_soon(self.finished)


class TrioBridge:
    """A trio run in its own thread, with calls in both directions from the asyncio loop.

    A bridge runs once: `start()`, any number of calls, `stop()`. It is also an async
    context manager (`async with TrioBridge() as bridge:`).
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        # Wraps the root nursery; cancelling it is how the trio run is told to end.
        self._root_scope = trio.CancelScope()
        # Set while the root nursery accepts new tasks (trio side only).
        self._nursery: trio.Nursery | None = None
        self._ready: asyncio.Future[None] | None = None
        self._done: asyncio.Future[None] | None = None
        self._failure: BaseException | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        """True from the end of `start()` until `stop()` is called or trio's run ends."""
        return (
            self._ready is not None
            and self._ready.done()
            and self._done is not None
            and not self._done.done()
            and not self._stopping
        )

    def in_trio_thread(self) -> bool:
        """Whether the caller runs in this bridge's trio thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    async def __aenter__(self) -> TrioBridge:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start trio in its thread; return once it accepts calls.

        If the trio run dies before it is ready, raises `InternalError` from the cause.
        """
        if self._loop is not None:
            raise InternalError("TrioBridge.start() was called twice; a bridge runs once")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._ready = loop.create_future()
        self._done = loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, name=THREAD_NAME, daemon=True)
        self._thread.start()
        await asyncio.wait({self._ready, self._done}, return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.done():
            failure, self._failure = self._failure, None
            raise InternalError("the trio run ended before it was ready") from failure

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `await fn(*args)` as a trio task in the root nursery; return its result.

        The exception `fn` raises is raised here unchanged. Cancelling the awaiting
        asyncio task cancels the trio task, and `CancelledError` is raised only after
        the trio task has finished unwinding. If the bridge stops while `fn` runs,
        raises `InternalError`.
        """
        token = self._live_token()
        call: _Call[T] = _Call(fn, args, asyncio.get_running_loop().create_future())
        try:
            token.run_sync_soon(self._spawn_call, call)
        except trio.RunFinishedError:  # ended on its own, `_done` not resolved yet
            raise InternalError("the trio bridge is not running") from None
        try:
            await asyncio.shield(call.finished)
        except asyncio.CancelledError:
            if not call.finished.done():
                # Trio settles every call (a run ending settles its calls with an error);
                # a cancel reaching a call that has just ended is a no-op.
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(call.scope.cancel, "asyncio caller cancelled")
            await _wait_ignoring_cancel(call.finished)
            raise
        error, call.error = call.error, None
        if error is not None:
            raise error
        return cast(T, call.value)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start `fn(*args)` as a background trio task owned by the root nursery.

        Safe to call from any thread. `stop()` cancels the task. As in any trio nursery,
        an exception escaping the task ends the whole trio run: it is logged at once and
        raised (as `InternalError`) by `stop()`.
        """
        try:
            self._live_token().run_sync_soon(self._spawn_background, fn, args)
        except trio.RunFinishedError:
            raise InternalError("the trio bridge is not running") from None

    async def to_asyncio(self, coro: Coroutine[Any, Any, T]) -> T:
        """From trio code: run `coro` as an asyncio task on the host loop; return its result.

        Cancelling the trio caller cancels the asyncio task, and the trio caller resumes
        only once that task has finished. If the task is cancelled from the asyncio side
        instead, raises `InternalError`.
        """
        loop = self._loop
        if loop is None or self._done is None or self._done.done() or self._stopping:
            coro.close()
            raise InternalError("TrioBridge.to_asyncio() called while the bridge is not running")
        if not self.in_trio_thread():
            coro.close()
            raise InternalError("TrioBridge.to_asyncio() called from another trio run")
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        held: list[asyncio.Task[T]] = []

        def wake(_task: asyncio.Task[T]) -> None:  # on the loop
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(finished.set)

        def begin() -> None:  # on the loop
            task = loop.create_task(coro)
            held.append(task)
            task.add_done_callback(wake)

        def cancel() -> None:  # on the loop, after begin (call_soon_threadsafe is FIFO)
            held[0].cancel()

        try:
            loop.call_soon_threadsafe(begin)
        except RuntimeError as exc:  # the loop closed
            coro.close()
            raise InternalError("the asyncio loop is closed") from exc
        try:
            await finished.wait()
        finally:
            if not finished.is_set():  # the trio caller is being cancelled
                call_on_loop(loop, cancel)
                with trio.CancelScope(shield=True):
                    await finished.wait()
                task = held[0]
                if not task.cancelled() and (late := task.exception()) is not None:
                    # Retrieved so asyncio does not log "never retrieved"; trio's
                    # Cancelled is what propagates from here.
                    log.debug("asyncio task failed while being cancelled", exc_info=late)
        task = held[0]
        if task.cancelled():
            raise InternalError("the asyncio task behind to_asyncio() was cancelled")
        return task.result()

    async def stop(self) -> None:
        """Cancel every trio task and wait until the trio run has finished.

        Idempotent, and a no-op on a bridge that never started. A clean stop raises
        nothing; if the trio run had failed (e.g. a background task raised), the first
        `stop()` raises `InternalError` from that failure.
        """
        if self._done is None:
            return
        if not self._stopping:
            self._stopping = True
            if not self._done.done() and self._token is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    self._token.run_sync_soon(self._root_scope.cancel, "TrioBridge.stop()")
        await asyncio.shield(self._done)
        if self._thread is not None:
            # Its last act was to resolve `_done`: what is left of it is returning.
            self._thread.join()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise InternalError(f"the trio run failed: {failure!r}") from failure

    # --- trio side ----------------------------------------------------------------

    def _thread_main(self) -> None:
        """The trio thread: the whole trio run, then tell the loop it has ended."""
        failure: BaseException | None = None
        try:
            trio.run(self._trio_main)
        except BaseException as exc:  # kept for stop() to raise; nothing is retried
            failure = exc
        assert self._loop is not None
        call_on_loop(self._loop, self._on_trio_done, failure)

    async def _trio_main(self) -> None:
        """The trio run's main task: hold the root nursery open until cancelled."""
        self._token = trio.lowlevel.current_trio_token()
        if self._stopping:  # stop() came before the token it would have cancelled with
            self._root_scope.cancel("TrioBridge.stop()")
        with self._root_scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                assert self._ready is not None  # set by start() before the thread starts
                resolve_soon(self._ready)
                try:
                    await trio.sleep_forever()
                finally:
                    # The nursery closes to new tasks as soon as this body exits.
                    self._nursery = None

    def _spawn_call(self, call: _Call[Any]) -> None:
        """(trio, via run_sync_soon) Start one `run()` call; must not raise."""
        if self._nursery is None:
            call.settle(error=InternalError("the trio bridge stopped before the call started"))
            return
        self._nursery.start_soon(self._run_call, call, name=call.fn)

    async def _run_call(self, call: _Call[Any]) -> None:
        try:
            with call.scope:
                call.settle(value=await call.fn(*call.args))
        except Exception as exc:  # the caller's own error: handed to it, not handled here
            call.settle(error=exc)
        except BaseException:  # the root scope is cancelled (stop) or trio is dying
            call.settle(error=InternalError("the trio bridge stopped while the call ran"))
            raise
        finally:
            # Only reached unsettled when call.scope swallowed its own cancellation.
            call.settle(error=InternalError("the call was cancelled by its caller"))

    def _spawn_background(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        """(trio, via run_sync_soon) Start one `start_soon()` task; must not raise."""
        if self._nursery is None:
            log.warning("trio bridge is stopping; background task %r was not started", fn)
            return
        # Through a wrapper so that a bad `fn` (not async) fails as a task, not inside
        # run_sync_soon, where trio would turn it into a TrioInternalError.
        self._nursery.start_soon(_await_call, fn, args, name=fn)

    def _on_trio_done(self, failure: BaseException | None) -> None:
        """(loop) The trio thread has ended: remember a failure, wake stop()."""
        if failure is not None:
            self._failure = failure
            log.error("the trio run failed", exc_info=failure)
        assert self._done is not None
        _resolve(self._done)

    def _live_token(self) -> trio.lowlevel.TrioToken:
        if not self.running or self._token is None:
            raise InternalError("the trio bridge is not running")
        return self._token


async def _await_call(fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
    await fn(*args)


async def _wait_ignoring_cancel(future: asyncio.Future[None]) -> None:
    """Wait for `future` even if the waiting task is cancelled again meanwhile."""
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(future)
