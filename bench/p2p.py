"""Swarm-layer benchmark: libp2p stream round trips against plain TCP, and DHT lookups.

One run measures, on 127.0.0.1:

1. libp2p: the round trip of a 2 KB message (2048 random bytes in a swarmd frame) over
   one open stream between two swarmd hosts (Noise + yamux, built by `open_host`). The
   echo side runs in a child process (this script with `--serve libp2p`), and both ends
   run trio as a node does: in a thread of its own beside an asyncio loop (`TrioBridge`).
2. asyncio TCP: the same round trip with 2048 bytes behind a 4-byte length prefix over a
   plain asyncio stream (TCP_NODELAY, asyncio's default), echo server in a child process.
3. DHT: `Discovery.holders("bench-model")` from a fresh node, in swarms of 5 and of 20
   nodes in this process. Every node of the swarm announces one signed record (its own
   layer range); the fresh node bootstraps from one of them, then looks up all holders.
   Each lookup must return exactly the announced nodes and ranges, or the run fails.

Round trips: a warm-up, then `--round-trips` timed ones, one at a time, each timed on the
client with perf_counter from the write to the whole echo read. Lookups: `--lookups`
timed, back to back; the first (cold: no record cached yet) is shown apart.
Children are told to stop by closing their stdin (they also stop if this process dies);
readiness is a line on their stdout, awaited with a deadline. The last line is

    RESULT libp2p_rtt_ms=<ms> tcp_rtt_ms=<ms> ratio=<r> lookup5_ms=<ms> lookup20_ms=<ms>

(medians; ratio = libp2p / tcp). Other processes on the machine skew every figure: the
load average at the start is printed. libp2p's warnings in this process are counted by
phase and kind and listed in the report instead of being printed one by one.

Usage: .venv/bin/python bench/p2p.py [--round-trips N] [--warmup N] [--lookups N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import selectors
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from swarmd.dht.discovery import Discovery, open_discovery
from swarmd.dht.records import NodeRecord
from swarmd.errors import StreamClosedError
from swarmd.net.bridge import TrioBridge
from swarmd.net.frames import FrameStream
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity

ECHO_PROTOCOL = "/swarmd/bench/echo/1"
MESSAGE_BYTES = 2048
MODEL_ID = "bench-model"
T = TypeVar("T")
NUM_LAYERS = 30
RECORD_TTL_S = 600.0
READY_TIMEOUT_S = 30.0  # a child prints its address (libp2p's import alone takes ~1 s)
CHILD_STOP_TIMEOUT_S = 15.0  # a child exits after its stdin closes
RTT_PHASE_TIMEOUT_S = 60.0
RECV_TIMEOUT_S = 10.0  # one echo
SWARM_PHASE_TIMEOUT_S = 90.0  # build, bootstrap, announce, look up, one swarm
LOOKUP_TIMEOUT_S = 30.0  # one `holders` (it gives up by itself after about 25 s)
SWARM_SIZES = (5, 20)
READY_PREFIX = "READY "
_PEER_ID_RE = re.compile(r"12D3KooW[1-9A-HJ-NP-Za-km-z]+")


class LogCounter(logging.Handler):
    """Counts libp2p's log records of WARNING and above by phase and kind; the report
    lists the counts. Without it each would reach stderr (libp2p's logger has no handler
    and does not propagate, so logging's last resort prints it), many lines apiece."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.phase = "start"
        self.counts: Counter[tuple[str, str]] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        first_line = _PEER_ID_RE.sub("<peer>", message.split("\n", 1)[0])
        kind = " ".join(first_line.split()[:5])
        self.counts[(self.phase, f"{record.levelname} {kind}")] += 1

    def summary(self) -> list[str]:
        return [f"  {phase}: {n} x {kind}" for (phase, kind), n in sorted(self.counts.items())]


LOG_COUNTS = LogCounter()


class BenchError(RuntimeError):
    """A check of this benchmark failed (a child, an echo, a lookup's holders)."""


def bench_errors(exc: BaseException) -> list[BenchError]:
    """The BenchErrors in `exc`, looking inside (nested) exception groups."""
    if isinstance(exc, BenchError):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in bench_errors(inner)]
    return []


# --- child processes: the echo servers ---------------------------------------------------


def serve_libp2p() -> None:
    """Echo every frame on ECHO_PROTOCOL until stdin closes."""

    async def echo(stream: FrameStream) -> None:
        while True:
            try:
                frame = await stream.recv(timeout_s=float("inf"))
            except StreamClosedError:
                return  # the client closed the stream
            await stream.send(frame)

    async def main() -> None:
        async with open_host(Identity.generate(), 0) as host:
            host.set_handler(ECHO_PROTOCOL, echo)
            announce_ready(host.addrs[0])
            await wait_stdin_closed_trio()

    run_as_a_node_does(main)


def serve_tcp() -> None:
    """Echo every length-prefixed message until stdin closes."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(4)
                body = await reader.readexactly(int.from_bytes(header, "big"))
                writer.write(header + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            announce_ready(f"127.0.0.1:{port}")
            await wait_stdin_closed_asyncio()

    asyncio.run(main())


def run_as_a_node_does(main: Callable[[], Awaitable[T]]) -> T:
    """`trio.run(main)`, but with trio where a node has it: in its own thread, beside the
    asyncio loop of the main thread (swarmd/net/bridge.py)."""

    async def loop() -> T:
        async with TrioBridge() as bridge:
            return await bridge.run(main)

    return asyncio.run(loop())


def announce_ready(address: str) -> None:
    sys.stdout.write(f"{READY_PREFIX}{address}\n")
    sys.stdout.flush()


async def wait_stdin_closed_trio() -> None:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stdin:
        while await stdin.receive_some():
            pass


async def wait_stdin_closed_asyncio() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    )
    try:
        while await reader.read(4096):
            pass
    finally:
        transport.close()


@contextlib.contextmanager
def echo_child(kind: str) -> Iterator[str]:
    """Start `--serve kind`; yield the address it printed; stop it on exit."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield read_ready_line(proc, kind)
    finally:
        stop_child(proc, kind)


def read_ready_line(proc: subprocess.Popen[str], kind: str) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"the {kind} echo child was not ready in {READY_TIMEOUT_S} s")
            if not selector.select(left):
                continue
            line = proc.stdout.readline()  # the child writes whole lines, flushed
            if not line:
                raise BenchError(
                    f"the {kind} echo child exited before it was ready (rc {proc.wait()})"
                )
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX) :].strip()


def stop_child(proc: subprocess.Popen[str], kind: str) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        rc = proc.wait(CHILD_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"warning: the {kind} echo child did not stop in time; killing it", file=sys.stderr)
        proc.kill()
        rc = proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    if rc != 0:
        print(f"warning: the {kind} echo child exited with rc {rc}", file=sys.stderr)


# --- 1. libp2p round trips ----------------------------------------------------------------


def libp2p_round_trips(child_addr: str, warmup: int, count: int) -> list[float]:
    async def main() -> list[float]:
        payload = os.urandom(MESSAGE_BYTES)
        frame: dict[str, Any] = {"d": payload}
        with trio.fail_after(RTT_PHASE_TIMEOUT_S):
            async with open_host(Identity.generate(), 0) as host:
                peer_id = await host.connect(child_addr)
                async with await host.open_stream(peer_id, ECHO_PROTOCOL) as stream:
                    times: list[float] = []
                    for i in range(warmup + count):
                        t0 = time.perf_counter()
                        await stream.send(frame)
                        reply = await stream.recv(RECV_TIMEOUT_S)
                        elapsed = time.perf_counter() - t0
                        if reply.get("d") != payload:
                            raise BenchError("the libp2p echo differs from the message sent")
                        if i >= warmup:
                            times.append(elapsed)
                    return times

    return run_as_a_node_does(main)


# --- 2. asyncio TCP round trips ------------------------------------------------------------


def tcp_round_trips(child_addr: str, warmup: int, count: int) -> list[float]:
    host, port = child_addr.rsplit(":", 1)

    async def main() -> list[float]:
        payload = os.urandom(MESSAGE_BYTES)
        message = len(payload).to_bytes(4, "big") + payload
        async with asyncio.timeout(RTT_PHASE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                times: list[float] = []
                for i in range(warmup + count):
                    t0 = time.perf_counter()
                    writer.write(message)
                    await writer.drain()
                    header = await reader.readexactly(4)
                    body = await reader.readexactly(int.from_bytes(header, "big"))
                    elapsed = time.perf_counter() - t0
                    if body != payload:
                        raise BenchError("the TCP echo differs from the message sent")
                    if i >= warmup:
                        times.append(elapsed)
                return times
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()

    return asyncio.run(main())


# --- 3. DHT lookups -----------------------------------------------------------------------


@dataclass
class SwarmNode:
    identity: Identity
    host: P2PHost
    disc: Discovery


@dataclass
class LookupResult:
    nodes: int
    bootstrap_s: float  # start the hosts, each but the first bootstraps from the first
    announce_s: float  # every node announces its record, one after another
    join_s: float  # the fresh node's bootstrap
    lookups_s: list[float]


def layer_range(index: int, nodes: int) -> tuple[int, int]:
    return index * NUM_LAYERS // nodes, (index + 1) * NUM_LAYERS // nodes


def bench_record(node: SwarmNode, start: int, end: int) -> NodeRecord:
    return NodeRecord(
        peer_id=node.identity.peer_id,
        model_id=MODEL_ID,
        model_hash="",
        layer_start=start,
        layer_end=end,
        num_layers=NUM_LAYERS,
        dtype="float16",
        weights="fp32",
        free_kv_tokens=4096,
        kv_budget_tokens=4096,
        throughput_tps=10.0,
        state="ready",
        addrs=tuple(node.host.addrs),
        api_url="",
        version="bench",
        expires_at=time.time() + RECORD_TTL_S,
    )


async def start_node(stack: AsyncExitStack) -> SwarmNode:
    identity = Identity.generate()
    host = await stack.enter_async_context(open_host(identity, 0))
    disc = await stack.enter_async_context(open_discovery(host))
    return SwarmNode(identity, host, disc)


async def measure_lookups(nodes: int, lookups: int) -> LookupResult:
    LOG_COUNTS.phase = f"dht{nodes} setup"
    with trio.fail_after(SWARM_PHASE_TIMEOUT_S):
        async with AsyncExitStack() as stack:
            t0 = time.perf_counter()
            swarm = [await start_node(stack) for _ in range(nodes)]
            first_addrs = swarm[0].host.addrs
            for node in swarm[1:]:
                await node.disc.bootstrap(first_addrs)
            bootstrap_s = time.perf_counter() - t0
            # One after another: 20 announces at once are no faster on 2 cores, and their
            # crossing dials make libp2p log ~80 "failed to open stream" warnings.
            t0 = time.perf_counter()
            expected: dict[str, tuple[int, int]] = {}
            for index, node in enumerate(swarm):
                start, end = layer_range(index, nodes)
                expected[node.identity.peer_id] = (start, end)
                await node.disc.announce(node.identity, bench_record(node, start, end))
            announce_s = time.perf_counter() - t0

            # The fresh node knows only the last node of the swarm.
            fresh = await start_node(stack)
            t0 = time.perf_counter()
            await fresh.disc.bootstrap(swarm[-1].host.addrs)
            join_s = time.perf_counter() - t0

            times: list[float] = []
            LOG_COUNTS.phase = f"dht{nodes} lookups"
            for attempt in range(lookups):
                t0 = time.perf_counter()
                with trio.fail_after(LOOKUP_TIMEOUT_S):
                    found = await fresh.disc.holders(MODEL_ID)
                times.append(time.perf_counter() - t0)
                got = {r.peer_id: (r.layer_start, r.layer_end) for r in found}
                if len(found) != nodes or got != expected:
                    missing = sorted(p[-8:] for p in expected.keys() - got.keys())
                    extra = sorted(p[-8:] for p in got.keys() - expected.keys())
                    wrong = sorted(
                        p[-8:] for p in expected.keys() & got.keys() if got[p] != expected[p]
                    )
                    raise BenchError(
                        f"lookup {attempt + 1} in the {nodes}-node swarm found {len(found)} "
                        f"holders, {nodes} announced (missing {missing}, unexpected {extra}, "
                        f"wrong layer ranges {wrong})"
                    )
            LOG_COUNTS.phase = f"dht{nodes} teardown"
            return LookupResult(nodes, bootstrap_s, announce_s, join_s, times)


def dht_lookups(lookups: int) -> list[LookupResult]:
    async def main() -> list[LookupResult]:
        return [await measure_lookups(n, lookups) for n in SWARM_SIZES]

    return trio.run(main)


# --- report -------------------------------------------------------------------------------


def ms(seconds: float) -> float:
    return seconds * 1000.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rtt_row(name: str, times: list[float]) -> str:
    return (
        f"{name:<36}{ms(statistics.median(times)):>8.3f} {ms(percentile(times, 0.1)):>8.3f} "
        f"{ms(percentile(times, 0.9)):>8.3f} {ms(min(times)):>8.3f} {ms(max(times)):>8.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trips", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--lookups", type=int, default=5)
    parser.add_argument("--serve", choices=("libp2p", "tcp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "libp2p":
        serve_libp2p()
        return 0
    if args.serve == "tcp":
        serve_tcp()
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("libp2p").addHandler(LOG_COUNTS)
    try:
        run_bench(args)
    except BaseException as exc:
        failures = bench_errors(exc)
        if not failures:
            raise
        for failure in failures:
            print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    return 0


def run_bench(args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(
        f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        "echo servers in a child process, DHT swarms in this process",
        flush=True,
    )
    started = time.perf_counter()
    LOG_COUNTS.phase = "libp2p rtt"
    with echo_child("libp2p") as addr:
        libp2p_times = libp2p_round_trips(addr, args.warmup, args.round_trips)
    LOG_COUNTS.phase = "tcp rtt"
    with echo_child("tcp") as addr:
        tcp_times = tcp_round_trips(addr, args.warmup, args.round_trips)
    lookup_results = dht_lookups(args.lookups)

    libp2p_ms = ms(statistics.median(libp2p_times))
    tcp_ms = ms(statistics.median(tcp_times))
    print()
    print(
        f"{f'2 KB round trip, {args.round_trips} timed (ms)':<36}"
        f"{'median':>8} {'p10':>8} {'p90':>8} {'min':>8} {'max':>8}"
    )
    print(rtt_row("libp2p stream, Noise+yamux, 2 proc", libp2p_times))
    print(rtt_row("asyncio TCP, 2 processes", tcp_times))
    print(f"ratio libp2p / TCP (medians): {libp2p_ms / tcp_ms:.1f}")
    print()
    print(f"DHT holders({MODEL_ID!r}) by a fresh node, {args.lookups} lookups back to back")
    print(
        f"  {'nodes':>5} {'bootstrap_s':>11} {'announce_s':>10} {'join_ms':>7} "
        f"{'cold_ms':>7} {'median_ms':>9} {'min_ms':>6} {'max_ms':>6}"
    )
    for r in lookup_results:
        print(
            f"  {r.nodes:>5} {r.bootstrap_s:>11.1f} {r.announce_s:>10.1f} {ms(r.join_s):>7.0f} "
            f"{ms(r.lookups_s[0]):>7.0f} {ms(statistics.median(r.lookups_s)):>9.0f} "
            f"{ms(min(r.lookups_s)):>6.0f} {ms(max(r.lookups_s)):>6.0f}"
        )
    print("  (cold = the first lookup; every lookup found exactly the announced holders)")
    warnings = LOG_COUNTS.summary()
    print(f"libp2p log records (WARNING+) in this process: {sum(LOG_COUNTS.counts.values())}")
    for line in warnings:
        print(line)
    print(f"total run {time.perf_counter() - started:.0f} s")
    by_size = {r.nodes: ms(statistics.median(r.lookups_s)) for r in lookup_results}
    print(
        f"RESULT libp2p_rtt_ms={libp2p_ms:.3f} tcp_rtt_ms={tcp_ms:.3f} "
        f"ratio={libp2p_ms / tcp_ms:.1f} lookup5_ms={by_size[5]:.0f} lookup20_ms={by_size[20]:.0f}"
    )


if __name__ == "__main__":
    sys.exit(main())
