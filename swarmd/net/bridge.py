"""The one crossing between asyncio (the process's main loop) and trio (py-libp2p).

aiohttp, signals and shutdown live on asyncio; py-libp2p is built on trio. Instead of a
second thread, trio runs as a *guest* on the asyncio loop (`trio.lowlevel.start_guest_run`):
both loops share the main thread, and trio only borrows a worker thread to wait for I/O.
No other module of swarmd imports both libraries (DESIGN.md section 1).

    bridge = TrioBridge()
    await bridge.start()
    peers = await bridge.run(host_get_peers, host)      # asyncio -> trio, with its result
    bridge.start_soon(serve_protocol, host)             # background trio task
    ... inside trio code: value = await bridge.to_asyncio(some_coroutine())
    await bridge.stop()

Rules the bridge keeps:

- Trio objects (nurseries, cancel scopes) are touched only from trio code: the asyncio
  side reaches trio through `TrioToken.run_sync_soon`, which also wakes trio's I/O wait.
- Every trio task belongs to the root nursery; a call made with `run()` is cancelled with
  its asyncio caller, and the caller sees `CancelledError` only once the trio side has
  finished unwinding, so no trio task outlives the code that asked for it.
- `stop()` cancels the root scope and waits for trio's `done_callback`, so the trio run
  has finished before the asyncio loop closes (trio's docs require it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import types
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import trio

from swarmd.errors import InternalError

if TYPE_CHECKING:
    import outcome

__all__ = ["TrioBridge"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class _Call(Generic[T]):
    """One `TrioBridge.run` call: what to run in trio and where its result lands.

    `finished` is an asyncio future that only the trio side resolves, once the call has
    completely unwound. The cancel scope is created here on the asyncio side (a scope is a
    plain object until entered) but only ever cancelled from trio code.
    """

    fn: Callable[..., Awaitable[T]]
    args: tuple[Any, ...]
    finished: asyncio.Future[None]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    value: T | None = None
    error: BaseException | None = None

    def settle(self, value: T | None = None, error: BaseException | None = None) -> None:
        """Record the call's result; the first settle wins (later ones are no-ops)."""
        if self.finished.done():
            return
        self.value, self.error = value, error
        # Trio code runs on the asyncio loop's thread (guest ticks are loop callbacks),
        # so resolving an asyncio future directly from trio is safe.
        self.finished.set_result(None)


class TrioBridge:
    """A trio guest run on the running asyncio loop, with calls in both directions.

    A bridge runs once: `start()`, any number of calls, `stop()`. It is also an async
    context manager (`async with TrioBridge() as bridge:`).
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
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
        """Start trio as a guest on this asyncio loop; return once it accepts calls.

        If the trio run dies before it is ready, raises `InternalError` from the cause.
        """
        if self._loop is not None:
            raise InternalError("TrioBridge.start() was called twice; a bridge runs once")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._ready = loop.create_future()
        self._done = loop.create_future()
        try:
            with _sigint_left_to_host():
                trio.lowlevel.start_guest_run(
                    self._trio_main,
                    run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                    run_sync_soon_not_threadsafe=loop.call_soon,
                    host_uses_signal_set_wakeup_fd=True,
                    done_callback=self._on_trio_done,
                )
        except RuntimeError as exc:  # a trio run already lives in this thread
            self._done.set_result(None)
            raise InternalError(f"cannot start the trio guest run: {exc}") from exc
        # Documented: once start_guest_run returns, sync trio calls work from the host.
        self._token = trio.lowlevel.current_trio_token()
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
        token.run_sync_soon(self._spawn_call, call)
        try:
            await asyncio.shield(call.finished)
        except asyncio.CancelledError:
            if not call.finished.done():  # then trio is still running: it settles every call
                token.run_sync_soon(call.scope.cancel, "asyncio caller cancelled")
            await _wait_ignoring_cancel(call.finished)
            raise
        error, call.error = call.error, None
        if error is not None:
            raise error
        return cast(T, call.value)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start `fn(*args)` as a background trio task owned by the root nursery.

        Safe to call from the loop (and from any thread). `stop()` cancels the task. As in
        any trio nursery, an exception escaping the task ends the whole trio run: it is
        logged at once and raised (as `InternalError`) by `stop()`.
        """
        self._live_token().run_sync_soon(self._spawn_background, fn, args)

    async def to_asyncio(self, coro: Coroutine[Any, Any, T]) -> T:
        """From trio code: run `coro` as an asyncio task on the host loop; return its result.

        Cancelling the trio caller cancels the asyncio task, and the trio caller resumes
        only once that task has finished. If the task is cancelled from the asyncio side
        instead, raises `InternalError`.
        """
        loop = self._loop
        if loop is None or self._done is None or self._done.done():
            coro.close()
            raise InternalError("TrioBridge.to_asyncio() called while the bridge is not running")
        token = trio.lowlevel.current_trio_token()
        if token is not self._token:
            coro.close()
            raise InternalError("TrioBridge.to_asyncio() called from another trio run")
        finished = trio.Event()
        task = loop.create_task(coro)
        # Done callbacks run on the loop, outside trio: go back in through the token,
        # which also wakes trio if it is blocked waiting for I/O.
        task.add_done_callback(lambda _task: token.run_sync_soon(finished.set))
        try:
            await finished.wait()
        finally:
            if not finished.is_set():  # the trio caller is being cancelled
                task.cancel()
                with trio.CancelScope(shield=True):
                    await finished.wait()
                if not task.cancelled() and (late := task.exception()) is not None:
                    # Retrieved so asyncio does not log "never retrieved"; trio's
                    # Cancelled is what propagates from here.
                    log.debug("asyncio task failed while being cancelled", exc_info=late)
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
                self._token.run_sync_soon(self._root_scope.cancel, "TrioBridge.stop()")
        await asyncio.shield(self._done)
        failure, self._failure = self._failure, None
        if failure is not None:
            raise InternalError(f"the trio run failed: {failure!r}") from failure

    # --- trio side ----------------------------------------------------------------

    async def _trio_main(self) -> None:
        """The guest run's main task: hold the root nursery open until cancelled."""
        with self._root_scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                assert self._ready is not None  # set by start() before the run begins
                self._ready.set_result(None)
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

    def _on_trio_done(self, run_outcome: outcome.Outcome[None]) -> None:
        """trio's done_callback (on the loop): remember a failure, wake stop()."""
        try:
            run_outcome.unwrap()
        except BaseException as exc:  # kept for stop() to raise; nothing is retried
            self._failure = exc
            log.error("the trio run failed", exc_info=exc)
        assert self._done is not None
        self._done.set_result(None)

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


def _default_int_stand_in(signum: int, frame: types.FrameType | None) -> None:
    signal.default_int_handler(signum, frame)


@contextlib.contextmanager
def _sigint_left_to_host() -> Iterator[None]:
    """Keep trio's guest run from taking over SIGINT.

    A trio run installs its own SIGINT handler when it finds Python's default one,
    guest runs included; Ctrl-C would then become a KeyboardInterrupt inside trio's
    root task instead of reaching asyncio, which owns signals here. Trio checks for
    `signal.default_int_handler` by identity, so an equivalent stand-in during
    `start_guest_run` makes it leave SIGINT alone; the default is put back afterwards.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, _default_int_stand_in)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is _default_int_stand_in:
            signal.signal(signal.SIGINT, signal.default_int_handler)
