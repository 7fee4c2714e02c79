"""A fault-injecting TCP proxy for tests and benchmarks: real networks on one machine.

    proxy = FaultProxy(target_port=node_p2p_port).start()   # listens on 127.0.0.1:proxy.port
    proxy.shape(delay_ms=40, jitter_ms=5)                   # each direction, every connection
    proxy.shape(rate_mbit=10)                               # a bandwidth cap per direction
    proxy.black_hole()                                      # nothing flows; the sockets stay open
    proxy.heal()                                            # it flows again (held bytes first)
    proxy.reset()                                           # every connection torn with a RST
    proxy.stop()

A node behind a proxy announces the proxy's address (`--announce-addr`), so its peers
dial it there. A connection the node itself dialed goes through the proxy of the peer it
dialed, so faults that must cut a whole node also name it by pid: `black_hole(pid=...)`
and `reset(pid=...)` on any proxy act on the connections that process opened through it
(found from /proc: the client end's port belongs to one of its sockets).

How the faults behave, per direction of each connection:
- delay and jitter: each piece read at time t is written at t + delay + U(-jitter,
  +jitter), never before the piece read before it (TCP keeps order);
- rate: the direction is a link of that many bits per second shared by every connection
  of the proxy: a piece waits for the link to be free and takes len/rate on it;
- black hole: nothing is read or written, so the sender's kernel buffers fill and it
  blocks, and the receiver sees nothing, as behind a dead router (new connections are
  taken but never joined to the target); heal() lets the held bytes through;
- reset: both sockets closed with SO_LINGER 0 (a RST each way).

It runs an asyncio loop in a thread of its own; every method is safe from any thread.
Linux only (the pid lookup reads /proc).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

READ_BYTES = 64 * 1024


@dataclass
class _Direction:
    """One direction of the proxy's link, shared by its connections."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    rate_bps: float = 0.0  # bytes per second; 0 = no cap
    free_at: float = 0.0  # monotonic time the capped link is free again


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    client_pid: int | None = None
    flowing: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = (target_host, target_port)
        self._want_port = port
        self.port = 0
        self._up = _Direction()  # client -> target
        self._down = _Direction()  # target -> client
        self._holed = False  # the whole proxy black-holed
        self._holed_pids: set[int] = set()
        self._conns: set[_Conn] = set()
        self._accepting: set[asyncio.Task[Any]] = set()  # connections not joined yet
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._rng = random.Random(0)
        self.accepted = 0  # connections taken so far

    # --- life -----------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def addr(self) -> str:
        """The proxy's multiaddr without a peer id (what a node behind it announces)."""
        return f"/ip4/127.0.0.1/tcp/{self.port}"

    # --- faults -----------------------------------------------------------------------

    def shape(
        self,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        rate_mbit: float | None = None,
        direction: str = "both",
    ) -> None:
        """Set delay, jitter or bandwidth (None: unchanged; 0: off) of one direction
        ("up": towards the target, "down", or "both"), from now on."""

        def apply() -> None:
            for d in self._directions(direction):
                if delay_ms is not None:
                    d.delay_s = delay_ms / 1000.0
                if jitter_ms is not None:
                    d.jitter_s = jitter_ms / 1000.0
                if rate_mbit is not None:
                    d.rate_bps = rate_mbit * 1e6 / 8.0

        self._loop.call_soon_threadsafe(apply)

    def black_hole(self, pid: int | None = None) -> None:
        """Stop every byte (of the connections `pid` opened through this proxy, if given)."""

        def apply() -> None:
            if pid is None:
                self._holed = True
            else:
                self._holed_pids.add(pid)
            for conn in self._conns:
                if not self._flows(conn):
                    conn.flowing.clear()

        self._call_sync(apply)

    def heal(self) -> None:
        """Undo every black hole: held bytes flow, new connections join their target."""

        def apply() -> None:
            self._holed = False
            self._holed_pids.clear()
            for conn in self._conns:
                conn.flowing.set()

        self._call_sync(apply)

    def reset(self, pid: int | None = None) -> int:
        """Tear every connection (that `pid` opened, if given) with a RST; how many."""

        def apply() -> int:
            torn = [c for c in self._conns if pid is None or c.client_pid == pid]
            for conn in torn:
                self._abort(conn)
            return len(torn)

        return self._call_sync(apply)

    def connections(self) -> list[int | None]:
        """The client pid of each open connection (None: not one of the pids asked about)."""
        return self._call_sync(lambda: [c.client_pid for c in self._conns])

    # --- inside the loop ----------------------------------------------------------------

    def _directions(self, which: str) -> list[_Direction]:
        if which not in ("up", "down", "both"):
            raise ValueError(f"direction must be up, down or both, not {which!r}")
        return {"up": [self._up], "down": [self._down], "both": [self._up, self._down]}[which]

    def _flows(self, conn: _Conn) -> bool:
        return not self._holed and conn.client_pid not in self._holed_pids

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self._want_port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        # A connection still being accepted (its owner's pid looked up) is in no conn
        # yet: cancelled here, it closes its socket itself. Every task is awaited, so
        # none is left pending on the loop, nor a socket to a later test's GC.
        tasks = list(self._accepting)
        for conn in list(self._conns):
            tasks += conn.tasks
            self._abort(conn)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._accepting.add(task)
        try:
            await self._join(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        finally:
            self._accepting.discard(task)

    async def _join(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        conn = _Conn(writer)
        peer = writer.get_extra_info("peername")
        # Whose connection this is (a fault may name a node by pid); off the loop's thread.
        conn.client_pid = await asyncio.to_thread(_pid_of_port, peer[1]) if peer else None
        self._conns.add(conn)
        if self._flows(conn):
            conn.flowing.set()
        try:
            await conn.flowing.wait()  # a black hole takes the connection, joins nothing
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self._abort(conn)
            return
        conn.server = target_writer
        conn.tasks = [
            asyncio.create_task(self._pump(conn, reader, target_writer, self._up)),
            asyncio.create_task(self._pump(conn, target_reader, writer, self._down)),
        ]

    async def _pump(
        self,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        way: _Direction,
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._deliver(conn, queue, writer))
        last_at = 0.0
        try:
            while True:
                await conn.flowing.wait()
                data = await reader.read(READ_BYTES)
                if not data:
                    break
                now = time.monotonic()
                jitter = self._rng.uniform(-way.jitter_s, way.jitter_s) if way.jitter_s else 0.0
                at = max(last_at, now + max(0.0, way.delay_s + jitter))
                if way.rate_bps > 0:
                    start = max(at, way.free_at)
                    way.free_at = start + len(data) / way.rate_bps
                    at = way.free_at
                last_at = at
                queue.put_nowait((at, data))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            queue.put_nowait((0.0, b""))  # the end: written after what came before
            with contextlib.suppress(Exception):
                await sender

    async def _deliver(
        self, conn: _Conn, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                at, data = await queue.get()
                if not data:
                    with contextlib.suppress(OSError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await conn.flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            self._abort(conn)

    def _abort(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        for writer in (conn.client, conn.server):
            if writer is None:
                continue
            sock = writer.get_extra_info("socket")
            with contextlib.suppress(OSError):
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        conn.flowing.set()  # let blocked pumps see the closed sockets and end
        for task in conn.tasks:
            task.cancel()

    # --- crossing into the loop -----------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def _call_sync(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return self._call(run())


def _pid_of_port(port: int, pids: Iterable[int] | None = None) -> int | None:
    """The process that owns the local TCP port `port` on 127.0.0.1 (None: not found)."""
    inode = _inode_of_port(port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in pids if pids is not None else _all_pids():
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    if os.readlink(fd_dir / fd) == target:
                        return int(pid)
        except OSError:
            continue
    return None


def _inode_of_port(port: int) -> int | None:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local = parts[1]
            if int(local.rsplit(":", 1)[1], 16) == port:
                return int(parts[9])
    return None


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]
