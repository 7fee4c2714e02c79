"""Pipeline benchmark: per-token decode time of one model split over 1, 2 and 3 nodes.

The embedded model (SmolLM2-135M, 30 layers) is served three ways, all up at once, every
node a `swarmd run` subprocess on 127.0.0.1 with `--torch-threads 1`:

1. one node holding layers [0:30] (route `local`, no network);
2. two nodes, [0:15] and [15:30];
3. three nodes, [0:10], [10:20] and [20:30].

The first node starts a new swarm, the others join with `--bootstrap` its multiaddr; each
node is ready once it prints `swarmd: serving ...`, and the swarm once the first node's
`GET /v1/models` says `swarm.routable` or `swarm.complete`. Requests go to the first node
(the stage-0 holder, which coordinates): greedy (`temperature: 0`), non-streamed chat
completions with `--max-tokens` tokens. A warm-up request each, then `--runs` rounds; in
each, every setup in turn (the order rotated each round) runs one timed pair. A small
shared machine's speed drifts over minutes by more than a hop costs, and with the setups
run one after the other that drift went into their differences (the hop figure moved
1.5-3.0 ms within an hour); within a round it moves all of them alike. A timed pair:

- a prefill probe, the same prompt with `max_tokens: 1`: its `swarm.segments[i].ms` are
  the stages' compute for the prefill alone;
- the full request: `swarm.timing.decode_ms` over `usage.completion_tokens` = T.

Per run (every figure in ms, the medians over the runs are reported):

    ms/token           = decode_ms / (T - 1)
    compute/token      = (sum(segments.ms) - sum(probe segments.ms)) / (T - 1)
    overhead/token     = ms/token - compute/token

`segments.ms` totals each stage's forward passes over the whole request, prefill
included, and the T - 1 decode steps are what `decode_ms` times; subtracting the probe's
prefill compute leaves the decode steps' compute. overhead/token is therefore everything
in a decode step that is not a forward pass: the coordinator's step, sampling, the worker
hand-off and, with more than one node, the activations' and the token's trips over
libp2p. (The simpler `ms/token - sum(segments.ms) / T` spreads the prefill over the
tokens; it is printed too, as `naive`.) The figure of the result:

    hop_overhead_ms = median over the rounds of
                      (overhead/token(three) - overhead/token(one)) / 2

the non-compute time each added node (hop) adds to a token (each round's figure is
printed too). `--baseline DIR` (another checkout, e.g. a `git worktree` of an older
commit) runs that checkout's three setups too, in the same rounds, and prints each
round's difference between the two, and their median. On the 2-core box a round's
difference still moves by up to 1 ms either way (an A/A run, the same code both sides:
rounds -1.07 to +1.43, a median of 5 rounds -0.32), so a change of a few tenths needs
tens of rounds. For reference the script also prints the same of the setups' medians,
`(three_ms - one_ms) / 2`, the raw difference per added node, and the figure per
network transfer: the route is a ring (stage 0 -> ... -> last stage -> back to the
coordinator), so a token crosses N links on N >= 2 nodes and none on one node, and
`(overhead(three) - overhead(one)) / 3` is the cost of one transfer.

Only one stage computes at a time (one request, one token in flight), so the nodes take
turns rather than compete, but every node's event loops (asyncio, trio, libp2p) wake on
each token. The script measures, from /proc, the CPU the nodes and other processes use
during each timed request and says so when they need more cores than the machine has
(a 2-core box has no spare core for three nodes). Before each timed run it waits, up to
`--quiet-timeout` s, until other processes use under `--quiet-cores` cores.
Then the links stop being loopback's (issue 17). Two nodes, [0:15] and [15:30], each
behind a fault proxy of its own (tests/faultproxy.py; each announces its proxy with
`--announce-addr`, so every byte between them crosses one proxy), for each one-way delay of
`--delays` (0, 10, 40 and 100 ms, no jitter): ms per token of the same reply, and the
time to first token of a prompt of about `--long-prompt-tokens` (2,000) tokens, against
the first setup's one node on the same prompt. Before the delays, the swarm is left
alone for `--cold-wait` seconds (60) and the next request's `sched_ms` is the cold
planning time (the holders view is refreshed in the background, so it walks no DHT).
The last line is

    RESULT one_ms=<ms> two_ms=<ms> three_ms=<ms> hop_overhead_ms=<ms>
        ttft_40ms_over_one=<r> tpot_40ms_ms=<ms> sched_cold_ms=<ms>

(one line). Usage: .venv/bin/python bench/pipeline.py [--cache-dir DIR] [--runs N]
[--max-tokens N] [--delays 0,10,40,100] [--long-prompt-tokens N] [--cold-wait S]
[--baseline DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import platformdirs
from procstat import free_port, machine_busy_s, process_busy_s

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ of this checkout
from tests.faultproxy import FaultProxy

NUM_LAYERS = 30
BASE = "@base"  # the names of the `--baseline` checkout's setups end so
CONFIGS: dict[str, list[tuple[int, int]]] = {
    "one": [(0, 30)],
    "two": [(0, 15), (15, 30)],
    "three": [(0, 10), (10, 20), (20, 30)],
}
# Greedy SmolLM2-135M-Instruct writes well past 128 tokens of plain prose for this prompt
# without an end-of-sequence token (the same prompt as bench/single_node.py).
PROMPT = "Write a long story about a dragon who learns to bake bread. Make it at least 500 words."
MESSAGES = [{"role": "user", "content": PROMPT}]
LINE_TOKENS = 17  # about what one line of the long prompt takes


def long_messages(tokens: int) -> list[dict[str, str]]:
    """A prompt of about `tokens` tokens: a text to summarise, line by line. Each call's
    starts with a tag of its own: the same prompt again would be a prefix-cache hit
    (README, "Prefix reuse") and time next to no prefill."""
    lines = " ".join(
        f"Line {i}: the harbour lights were lit at dusk and the boats came home."
        for i in range(max(1, tokens // LINE_TOKENS))
    )
    tag = f"[{uuid.uuid4().hex[:8]}]"
    return [{"role": "user", "content": f"{tag} Summarise this text in one sentence. {lines}"}]


STOP_TIMEOUT_S = 20.0
READY_PREFIX = "swarmd: serving "
P2P_PREFIX = "swarmd: p2p listening on "


class BenchError(Exception):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(platformdirs.user_cache_dir("swarmd")),
        help="swarmd's converted-models cache (default: the user cache, as swarmd uses)",
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs per setup (median)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per reply")
    parser.add_argument(
        "--port-base",
        type=int,
        default=0,
        help="the setups' nodes take BASE, BASE+1, ... in turn (API, then p2p); 0 = free ports",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=180.0, help="seconds for a node to be ready"
    )
    parser.add_argument(
        "--swarm-timeout",
        type=float,
        default=60.0,
        help="seconds for the first node to see every layer (and answer the warm-up)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds for one request"
    )
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=0.3,
        help="a timed run starts once other processes use fewer cores than this",
    )
    parser.add_argument(
        "--quiet-timeout",
        type=float,
        default=20.0,
        help="longest wait for a quiet machine before each timed run (0 = do not wait)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout (a git worktree of an older commit): its three setups run in "
        "the same rounds, and the report compares the two round by round",
    )
    parser.add_argument(
        "--keep-logs", type=Path, default=None, help="copy the nodes' logs into this folder"
    )
    parser.add_argument(
        "--delays",
        default="0,10,40,100",
        help="one-way link delays (ms) of the two proxied nodes; empty: skip that part",
    )
    parser.add_argument(
        "--long-prompt-tokens", type=int, default=2000, help="about this many prompt tokens"
    )
    parser.add_argument(
        "--cold-wait", type=float, default=60.0, help="quiet seconds before the cold request"
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.max_tokens < 2:
        parser.error("--runs must be >= 1 and --max-tokens >= 2")
    ports = 24 if args.baseline is not None else 12
    if args.port_base and not 1024 <= args.port_base <= 65535 - ports:
        parser.error(f"--port-base must leave room for {ports} ports below 65536")
    if args.baseline is not None and not (args.baseline / "swarmd" / "__main__.py").is_file():
        parser.error(f"--baseline {args.baseline} is not a swarmd checkout")
    return args


# --- CPU use, from /proc ---------------------------------------------------------------


@dataclass(frozen=True)
class CpuSample:
    wall: float
    machine: float | None
    nodes: tuple[float, ...]
    own: float


def cpu_sample(pids: list[int]) -> CpuSample:
    return CpuSample(
        time.monotonic(),
        machine_busy_s(),
        tuple(process_busy_s(p) for p in pids),
        process_busy_s(os.getpid()),
    )


@dataclass(frozen=True)
class CpuUse:
    """Cores used between two samples: by each node, and by everything else."""

    nodes: tuple[float, ...]
    foreign: float | None  # processes other than the nodes and this script

    @property
    def total_nodes(self) -> float:
        return sum(self.nodes)


def cpu_between(before: CpuSample, after: CpuSample) -> CpuUse:
    wall = max(after.wall - before.wall, 1e-9)
    nodes = tuple((b - a) / wall for a, b in zip(before.nodes, after.nodes, strict=True))
    foreign = None
    if before.machine is not None and after.machine is not None:
        busy = (after.machine - before.machine) / wall
        foreign = max(0.0, busy - sum(nodes) - (after.own - before.own) / wall)
    return CpuUse(nodes, foreign)


def wait_quiet(pids: list[int], quiet_cores: float, timeout_s: float) -> None:
    """Wait (up to `timeout_s`) until processes other than ours use under `quiet_cores`."""
    if timeout_s <= 0 or machine_busy_s() is None:
        return
    deadline = time.monotonic() + timeout_s
    warned = False
    while True:
        before = cpu_sample(pids)
        time.sleep(0.5)  # the measuring window
        foreign = cpu_between(before, cpu_sample(pids)).foreign or 0.0
        if foreign < quiet_cores:
            return
        if time.monotonic() >= deadline:
            print(f"  other processes still use {foreign:.2f} cores; running anyway", flush=True)
            return
        if not warned:
            print(f"  waiting for a quiet machine (others use {foreign:.2f} cores)", flush=True)
            warned = True


# --- the nodes -------------------------------------------------------------------------


class NodeProcess:
    """One `swarmd run` subprocess; `stop()` always ends it (SIGTERM, wait, SIGKILL)."""

    def __init__(
        self,
        name: str,
        layers: tuple[int, int],
        ports: tuple[int, int],
        cache_dir: Path,
        work_dir: Path,
        bootstrap: str | None,
        extra: tuple[str, ...] = (),
        source: Path | None = None,
    ) -> None:
        self.name = name
        self.layers = layers
        self.port, self.p2p_port = ports
        self.url = f"http://127.0.0.1:{self.port}"
        self.multiaddr = ""
        self.log_path = work_dir / f"{name}.log"
        self._stdout_lines: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        data_dir = work_dir / f"{name}-data"
        data_dir.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "swarmd",
            "run",
            "--port",
            str(self.port),
            "--p2p-port",
            str(self.p2p_port),
            "--layers",
            f"{layers[0]}:{layers[1]}",
            "--cache-dir",
            str(cache_dir),
            "--data-dir",
            str(data_dir),
            "--torch-threads",
            "1",
        ]
        if bootstrap:
            cmd += ["--bootstrap", bootstrap]
        cmd += extra
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if source is not None:  # another checkout's swarmd (`-m` looks in the cwd first)
            env["PYTHONPATH"] = str(source)
        self._log: IO[bytes] = self.log_path.open("wb")
        try:
            self.proc: subprocess.Popen[str] = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
                env=env,
                cwd=source,
            )
        except OSError:
            self._log.close()
            raise
        # A thread reads stdout for the node's lifetime: the node never blocks on a full
        # pipe, and waiting for a line is a queue get with a timeout.
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_serving(self, timeout_s: float) -> None:
        """Read stdout until the `serving` line (keeping the p2p multiaddr on the way)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(
                    f"node {self.name} was not serving within {timeout_s:g} s\n" + self.log_tail()
                )
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise BenchError(
                    f"node {self.name} exited (rc {self.proc.wait()}) before serving\n"
                    + self.log_tail()
                )
            if line.startswith(P2P_PREFIX):
                addr = line[len(P2P_PREFIX) :].strip()
                if not self.multiaddr or addr.startswith("/ip4/127.0.0.1/"):
                    self.multiaddr = addr
            elif line.startswith(READY_PREFIX):
                break
        if not self.multiaddr:
            raise BenchError(f"node {self.name} printed no p2p multiaddr")

    def _read_stdout(self) -> None:
        """The reader thread: every stdout line into the queue (None at EOF), for good."""
        assert self.proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for raw in self.proc.stdout:
                line = raw.rstrip("\n")
                self._stdout_lines.append(line)
                self._lines.put(line)
        self._lines.put(None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        text = ""
        with contextlib.suppress(OSError):
            self._log.flush()
            text = self.log_path.read_text(errors="replace")
        out = [f"--- node {self.name} stdout ---", *self._stdout_lines[-lines:]]
        out += [f"--- node {self.name} stderr (last {lines} lines) ---"]
        out += text.splitlines()[-lines:]
        return "\n".join(out)

    def grep_log(self, needle: str) -> list[str]:
        with contextlib.suppress(OSError):
            return [
                line
                for line in self.log_path.read_text(errors="replace").splitlines()
                if needle in line
            ]
        return []

    def terminate(self) -> None:
        """Send SIGTERM (once running); `stop()` then waits for the exit."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL on timeout; then close the pipe and the log."""
        self.terminate()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"  warning: node {self.name} ignored SIGTERM; killing it", flush=True)
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()
        self._log.close()


# --- HTTP ------------------------------------------------------------------------------


def http_json(
    url: str, body: dict[str, Any] | None, timeout_s: float
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, headers); an HTTP error status is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"} if data else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"raw": raw.decode(errors="replace")}
        return exc.code, parsed, dict(exc.headers)


def wait_routable(first: NodeProcess, nodes: list[NodeProcess], timeout_s: float) -> str:
    """Poll the first node's /v1/models until it sees every layer; return the model id."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    last: Any = None
    while True:
        for node in nodes:
            if not node.alive():
                raise BenchError(f"node {node.name} exited (rc {node.proc.returncode})\n")
        with contextlib.suppress(OSError, ValueError):
            status, body, _ = http_json(first.url + "/v1/models", None, 5.0)
            if status == 200 and body.get("data"):
                model = body["data"][0]
                swarm = model.get("swarm", {})
                last = swarm.get("coverage")
                if swarm.get("routable") or swarm.get("complete"):
                    return str(model["id"])
        if time.monotonic() > deadline:
            raise BenchError(
                f"the first node did not see every layer within {timeout_s:g} s "
                f"(coverage {last})\n" + "\n".join(n.log_tail() for n in nodes)
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


# --- one setup -------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    route: str
    nodes: list[str]
    tokens: int
    finish: str | None
    decode_ms: float
    ttft_ms: float
    segments_ms: list[float]
    request_id: str
    sched_ms: float = 0.0
    prompt_tokens: int = 0

    @property
    def compute_ms(self) -> float:
        return sum(self.segments_ms)


@dataclass(frozen=True)
class RunResult:
    reply: Reply
    prefill_compute_ms: float  # sum of the probe's segments.ms
    cpu: CpuUse
    wall_s: float

    @property
    def ms_per_token(self) -> float:
        return self.reply.decode_ms / (self.reply.tokens - 1)

    @property
    def compute_per_token(self) -> float:
        return (self.reply.compute_ms - self.prefill_compute_ms) / (self.reply.tokens - 1)

    @property
    def overhead_per_token(self) -> float:
        return self.ms_per_token - self.compute_per_token

    @property
    def naive_overhead_per_token(self) -> float:
        return self.ms_per_token - self.reply.compute_ms / self.reply.tokens


@dataclass
class SetupResult:
    name: str
    layers: list[tuple[int, int]]
    runs: list[RunResult] = field(default_factory=list)
    ready_s: float = 0.0
    idle_cpu: CpuUse | None = None
    long_ttft_ms: list[float] = field(default_factory=list)  # the long prompt's (one only)
    long_prompt_tokens: int = 0

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs)


def chat(
    url: str,
    model_id: str,
    max_tokens: int,
    timeout_s: float,
    nodes: list[NodeProcess],
    messages: list[dict[str, str]] = MESSAGES,
) -> Reply:
    body = {
        "model": model_id,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": False,
    }
    status, reply, headers = http_json(url + "/v1/chat/completions", body, timeout_s)
    if status != 200:
        request_id = headers.get("x-swarm-request-id", "")
        lines = [line for n in nodes for line in n.grep_log(request_id)] if request_id else []
        raise BenchError(
            f"the request answered {status}: {json.dumps(reply)[:600]}\n"
            + "\n".join(lines or [n.log_tail() for n in nodes])
        )
    swarm = reply.get("swarm") or {}
    timing = swarm.get("timing") or {}
    segments = swarm.get("segments") or []
    if any(s.get("ms") is None for s in segments) or timing.get("decode_ms") is None:
        raise BenchError(f"the reply lacks timings: {json.dumps(swarm)[:600]}")
    choice = (reply.get("choices") or [{}])[0]
    return Reply(
        route=str(swarm.get("route")),
        nodes=list(swarm.get("nodes") or []),
        tokens=int(reply["usage"]["completion_tokens"]),
        finish=choice.get("finish_reason"),
        decode_ms=float(timing["decode_ms"]),
        ttft_ms=float(timing.get("ttft_ms") or 0.0),
        segments_ms=[float(s["ms"]) for s in segments],
        request_id=headers.get("x-swarm-request-id", ""),
        sched_ms=float(timing.get("sched_ms") or 0.0),
        prompt_tokens=int(reply["usage"]["prompt_tokens"]),
    )


def check_route(reply: Reply, layers: list[tuple[int, int]]) -> None:
    want = "local" if len(layers) == 1 else "distributed"
    if reply.route != want or len(reply.segments_ms) != len(layers):
        raise BenchError(
            f"expected a {want} route over {len(layers)} segments, got route={reply.route} "
            f"with {len(reply.segments_ms)} segments (nodes {reply.nodes})"
        )


def warm_up(
    url: str, model_id: str, args: argparse.Namespace, nodes: list[NodeProcess], deadline: float
) -> Reply:
    """The first request; retried while the route is not ready yet (503) until `deadline`."""
    while True:
        try:
            return chat(url, model_id, args.max_tokens, args.request_timeout, nodes)
        except BenchError as exc:
            if " answered 503" not in str(exc) or time.monotonic() > deadline:
                raise
            print(f"  warm-up answered 503, retrying: {str(exc).splitlines()[0][:200]}")
            time.sleep(0.5)


@dataclass
class Setup:
    """One setup's nodes, up for the whole timed part; `stop()` ends them."""

    result: SetupResult
    nodes: list[NodeProcess]
    model_id: str
    work_dir: Path
    keep_logs: Path | None

    @property
    def first(self) -> NodeProcess:
        return self.nodes[0]

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes]

    def stop(self) -> None:
        # SIGTERM to every node first, so that none spends its shutdown dialing a peer
        # that has already gone.
        for node in self.nodes:
            node.terminate()
        for node in self.nodes:
            node.stop()
        if self.keep_logs is not None:
            self.keep_logs.mkdir(parents=True, exist_ok=True)
            for node in self.nodes:
                with contextlib.suppress(OSError):
                    shutil.copy(node.log_path, self.keep_logs / node.log_path.name)
        shutil.rmtree(self.work_dir, ignore_errors=True)


def start_setup(
    name: str,
    layers: list[tuple[int, int]],
    args: argparse.Namespace,
    ports: list[int],
    source: Path | None = None,
) -> Setup:
    """Start a setup's nodes, wait for its route and answer the warm-up."""
    spec = " ".join(f"[{a}:{b}]" for a, b in layers)
    print(f"\n{name}: {len(layers)} node(s) {spec}", flush=True)
    setup = Setup(
        SetupResult(name, layers),
        [],
        "",
        Path(tempfile.mkdtemp(prefix=f"swarmd-pipeline-{name}-")),
        args.keep_logs,
    )
    try:
        started = time.monotonic()
        for i, rng in enumerate(layers):
            bootstrap = setup.nodes[0].multiaddr if setup.nodes else None
            node = NodeProcess(
                f"{name}{i}",
                rng,
                (ports[2 * i], ports[2 * i + 1]),
                args.cache_dir,
                setup.work_dir,
                bootstrap,
                source=source,
            )
            setup.nodes.append(node)
            node.wait_serving(args.startup_timeout)
            print(
                f"  node {node.name} pid {node.pid} layers {rng[0]}:{rng[1]} serving at "
                f"{node.url} after {time.monotonic() - started:.1f} s",
                flush=True,
            )
        setup.model_id = wait_routable(setup.first, setup.nodes, args.swarm_timeout)
        deadline = time.monotonic() + args.swarm_timeout
        warm = warm_up(setup.first.url, setup.model_id, args, setup.nodes, deadline)
        check_route(warm, layers)
        setup.result.ready_s = time.monotonic() - started
        print(
            f"  swarm ready after {setup.result.ready_s:.1f} s; warm-up: route {warm.route} "
            f"via {','.join(warm.nodes)}, {warm.tokens} tokens, "
            f"{warm.decode_ms / max(warm.tokens - 1, 1):.2f} ms/token",
            flush=True,
        )
        if warm.tokens < args.max_tokens:
            print(f"  note: the reply stopped at {warm.tokens} tokens ({warm.finish})")
        before = cpu_sample(setup.pids)
        time.sleep(1.0)  # one second with no request: what the idle nodes use
        setup.result.idle_cpu = cpu_between(before, cpu_sample(setup.pids))
    except BaseException:
        report_dead(setup)
        setup.stop()
        raise
    return setup


def report_dead(setup: Setup) -> None:
    for node in setup.nodes:
        if not node.alive():
            print(f"  node {node.name} exited with rc {node.proc.returncode}")


def timed_run(setup: Setup, args: argparse.Namespace) -> RunResult:
    """A prefill probe, then the timed request; the run is added to the setup's result."""
    layers, nodes = setup.result.layers, setup.nodes
    wait_quiet(setup.pids, args.quiet_cores, args.quiet_timeout)
    probe = chat(setup.first.url, setup.model_id, 1, args.request_timeout, nodes)
    check_route(probe, layers)
    before = cpu_sample(setup.pids)
    reply = chat(setup.first.url, setup.model_id, args.max_tokens, args.request_timeout, nodes)
    after = cpu_sample(setup.pids)
    check_route(reply, layers)
    if reply.tokens < 2:
        raise BenchError(f"only {reply.tokens} token(s) came back")
    run = RunResult(reply, probe.compute_ms, cpu_between(before, after), after.wall - before.wall)
    setup.result.runs.append(run)
    return run


def run_setups(args: argparse.Namespace) -> list[SetupResult]:
    """Every setup up at once, then `--runs` rounds of one timed run each, in turn (the
    order rotated each round): the box's speed drifts over minutes, and a drift then
    moves every setup's figures of a round alike instead of one setup's against the
    others'."""
    with contextlib.ExitStack() as stack:
        setups: list[Setup] = []
        taken = 0
        sources: list[tuple[str, Path | None]] = [("", None)]
        if args.baseline is not None:
            sources.append((BASE, args.baseline.resolve()))
        for suffix, source in sources:
            for name, layers in CONFIGS.items():
                ports = pick_ports(args, 2 * len(layers), taken)
                setup = start_setup(name + suffix, layers, args, ports, source)
                stack.callback(setup.stop)
                setups.append(setup)
                taken += 2 * len(layers)
        try:
            print(f"\n{args.runs} rounds, one timed run of each setup a round", flush=True)
            for i in range(args.runs):
                for setup in setups[i % len(setups) :] + setups[: i % len(setups)]:
                    run = timed_run(setup, args)
                    print(
                        f"  round {i + 1} {setup.result.name}: {describe(run, args.quiet_cores)}",
                        flush=True,
                    )
            one = setups[0]
            if args.delays:
                for _ in range(args.runs):  # the yardstick of the links' TTFT below
                    wait_quiet(one.pids, args.quiet_cores, args.quiet_timeout)
                    probe = long_probe(one.first.url, one.model_id, args, one.nodes)
                    one.result.long_ttft_ms.append(probe.ttft_ms)
                    one.result.long_prompt_tokens = probe.prompt_tokens
                print(
                    f"  one: a {one.result.long_prompt_tokens}-token prompt: TTFT "
                    f"{', '.join(f'{t:.0f}' for t in one.result.long_ttft_ms)} ms",
                    flush=True,
                )
        except BaseException:
            for setup in setups:
                report_dead(setup)
            raise
        return [s.result for s in setups]


def long_probe(
    url: str, model_id: str, args: argparse.Namespace, nodes: list[NodeProcess]
) -> Reply:
    messages = long_messages(args.long_prompt_tokens)
    return chat(url, model_id, 1, args.request_timeout, nodes, messages)


# --- the same two stages over slower links ----------------------------------------------


@dataclass
class WanRow:
    delay_ms: float
    ms_per_token: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)


@dataclass
class WanResult:
    rows: list[WanRow] = field(default_factory=list)
    sched_cold_ms: float = 0.0


def run_wan(args: argparse.Namespace, ports: list[int]) -> WanResult:
    """Two stages, each behind a fault proxy: per delay, ms per token and a long TTFT."""
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    result = WanResult()
    layers = CONFIGS["two"]
    print(f"\nlinks: 2 nodes [0:15] [15:30], each behind a proxy; one-way delays {delays} ms")
    nodes: list[NodeProcess] = []
    proxies: list[FaultProxy] = []
    with tempfile.TemporaryDirectory(prefix="swarmd-pipeline-wan-") as tmp:
        try:
            for i, rng in enumerate(layers):
                proxy = FaultProxy(ports[2 * i + 1]).start()
                proxies.append(proxy)
                boot = None
                if nodes:  # the first node, through its proxy
                    boot = f"{proxies[0].addr}/p2p/{nodes[0].multiaddr.rsplit('/p2p/', 1)[1]}"
                node = NodeProcess(
                    f"wan{i}",
                    rng,
                    (ports[2 * i], ports[2 * i + 1]),
                    args.cache_dir,
                    Path(tmp),
                    boot,
                    ("--announce-addr", proxy.addr),
                )
                nodes.append(node)
                node.wait_serving(args.startup_timeout)
            first = nodes[0]
            model_id = wait_routable(first, nodes, args.swarm_timeout)
            warm_up(first.url, model_id, args, nodes, time.monotonic() + args.swarm_timeout)
            if args.cold_wait > 0:
                print(f"  quiet for {args.cold_wait:g} s, then one request", flush=True)
                time.sleep(args.cold_wait)
                cold = chat(first.url, model_id, 2, args.request_timeout, nodes)
                result.sched_cold_ms = cold.sched_ms
                print(f"  cold request: sched_ms {cold.sched_ms:.2f}", flush=True)
            pids = [n.pid for n in nodes]
            for delay in delays:
                for proxy in proxies:
                    proxy.shape(delay_ms=delay, jitter_ms=0)
                row = WanRow(delay)
                chat(first.url, model_id, 4, args.request_timeout, nodes)  # links settled
                for _ in range(args.runs):
                    wait_quiet(pids, args.quiet_cores, args.quiet_timeout)
                    reply = chat(first.url, model_id, args.max_tokens, args.request_timeout, nodes)
                    check_route(reply, layers)
                    row.ms_per_token.append(reply.decode_ms / (reply.tokens - 1))
                    row.ttft_ms.append(long_probe(first.url, model_id, args, nodes).ttft_ms)
                result.rows.append(row)
                print(
                    f"  {delay:g} ms each way: {statistics.median(row.ms_per_token):.2f} ms/token, "
                    f"long-prompt TTFT {statistics.median(row.ttft_ms):.0f} ms",
                    flush=True,
                )
        finally:
            for node in nodes:
                node.terminate()
            for node in nodes:
                node.stop()
            for proxy in proxies:
                proxy.stop()
    return result


def describe(run: RunResult, quiet_cores: float) -> str:
    r = run.reply
    cpu = "/".join(f"{c:.2f}" for c in run.cpu.nodes)
    foreign = "" if run.cpu.foreign is None else f", other processes {run.cpu.foreign:.2f}"
    if run.cpu.foreign is not None and run.cpu.foreign >= quiet_cores:
        foreign += " (contended)"
    return (
        f"{r.tokens} tokens, {run.ms_per_token:.2f} ms/token = compute "
        f"{run.compute_per_token:.2f} + overhead {run.overhead_per_token:.2f} "
        f"(naive {run.naive_overhead_per_token:.2f}); segments "
        f"{'/'.join(f'{s:.0f}' for s in r.segments_ms)} ms, prefill compute "
        f"{run.prefill_compute_ms:.1f} ms; cores: nodes {cpu}{foreign}"
    )


# --- report ----------------------------------------------------------------------------


def contention_notes(results: list[SetupResult], quiet_cores: float) -> list[str]:
    cores = os.cpu_count() or 1
    notes = []
    for res in results:
        nodes = max(r.cpu.total_nodes for r in res.runs)
        foreign = [r.cpu.foreign for r in res.runs if r.cpu.foreign is not None]
        idle = res.idle_cpu.total_nodes if res.idle_cpu else float("nan")
        line = (
            f"  {res.name}: {len(res.layers)} node process(es) used at most {nodes:.2f} cores "
            f"together during a request ({idle:.2f} idle)"
        )
        if foreign:
            line += f", other processes up to {max(foreign):.2f}"
        if nodes > cores - 0.25:
            line += f"; CONTENDED: the node processes fought for the {cores} cores"
        elif foreign and max(foreign) >= quiet_cores and nodes + max(foreign) > cores - 0.25:
            line += (
                f"; CONTENDED by other processes ({nodes + max(foreign):.2f} of {cores} cores "
                "busy): these figures are inflated"
            )
        elif len(res.layers) > cores:
            line += (
                f"; {len(res.layers)} processes on {cores} cores, but they took turns (one "
                "stage computes at a time), so they did not fight"
            )
        notes.append(line)
    return notes


def report(results: list[SetupResult], wan: WanResult | None, args: argparse.Namespace) -> None:
    by = {r.name: r for r in results}
    print()
    print(
        f"decode, {args.max_tokens} tokens, 1 torch thread per node, medians of {args.runs} "
        f"runs (ms per token)"
    )
    print(
        f"  {'setup':<7}{'nodes':>6}{'ms/token':>10}{'compute':>9}{'overhead':>10}"
        f"{'naive ovh':>11}{'vs one':>8}"
    )
    one_ms = by["one"].median("ms_per_token")
    for res in results:
        ms_tok = res.median("ms_per_token")
        print(
            f"  {res.name:<7}{len(res.layers):>6}{ms_tok:>10.2f}"
            f"{res.median('compute_per_token'):>9.2f}{res.median('overhead_per_token'):>10.2f}"
            f"{res.median('naive_overhead_per_token'):>11.2f}{ms_tok - one_ms:>+8.2f}"
        )
    ovh = {name: by[name].median("overhead_per_token") for name in CONFIGS}
    ms_tok = {name: by[name].median("ms_per_token") for name in CONFIGS}
    hops = round_hops(by)
    hop = statistics.median(hops)
    print()
    print(
        f"hop overhead (overhead(three) - overhead(one)) / 2, median of the rounds = "
        f"{hop:.2f} ms/token (rounds: {', '.join(f'{h:.2f}' for h in hops)})"
    )
    print(
        f"  the same of the setups' medians                       = "
        f"{(ovh['three'] - ovh['one']) / 2:.2f} ms/token"
    )
    print(
        f"  per added node from two: overhead(two) - overhead(one)  = "
        f"{ovh['two'] - ovh['one']:.2f} ms/token"
    )
    print(
        f"  raw (three_ms - one_ms) / 2                             = "
        f"{(ms_tok['three'] - ms_tok['one']) / 2:.2f} ms/token"
    )
    print(
        f"  per network transfer (ring: 3 links on three nodes, 0 on one): "
        f"(overhead(three) - overhead(one)) / 3 = {(ovh['three'] - ovh['one']) / 3:.2f} ms"
    )
    if args.baseline is not None:
        compare_baseline(by, hops, args.baseline)
    print()
    print(f"CPU ({os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} at the end):")
    for line in contention_notes(results, args.quiet_cores):
        print(line)
    extra = ""
    if wan is not None and wan.rows:
        one_ttft = statistics.median(by["one"].long_ttft_ms)
        print()
        print(
            f"two stages over delayed links (a {by['one'].long_prompt_tokens}-token prompt; one "
            f"node's TTFT {one_ttft:.0f} ms; round trip = 2 x delay):"
        )
        print(f"  {'delay ms':>9}{'ms/token':>10}{'TTFT ms':>9}{'TTFT - one':>12}{'in RTTs':>9}")
        by_delay = {}
        for row in wan.rows:
            ttft = statistics.median(row.ttft_ms)
            rtts = (ttft - one_ttft) / (2 * row.delay_ms) if row.delay_ms else float("nan")
            by_delay[row.delay_ms] = (statistics.median(row.ms_per_token), ttft)
            print(
                f"  {row.delay_ms:>9g}{by_delay[row.delay_ms][0]:>10.2f}{ttft:>9.0f}"
                f"{ttft - one_ttft:>+12.0f}{rtts:>9.2f}"
            )
        tpot40, ttft40 = by_delay.get(40.0, (float("nan"), float("nan")))
        extra = (
            f" ttft_40ms_over_one={ttft40 / one_ttft:.2f} tpot_40ms_ms={tpot40:.2f}"
            f" sched_cold_ms={wan.sched_cold_ms:.2f}"
        )
    print(
        f"RESULT one_ms={ms_tok['one']:.2f} two_ms={ms_tok['two']:.2f} "
        f"three_ms={ms_tok['three']:.2f} hop_overhead_ms={hop:.2f}{extra}"
    )


def round_hops(by: dict[str, SetupResult], suffix: str = "") -> list[float]:
    """Each round's own hop overhead: its setups ran within seconds of each other."""
    ones, threes = by["one" + suffix].runs, by["three" + suffix].runs
    return [
        (three.overhead_per_token - one.overhead_per_token) / 2
        for one, three in zip(ones, threes, strict=True)
    ]


def compare_baseline(by: dict[str, SetupResult], hops: list[float], baseline: Path) -> None:
    """This checkout against `--baseline`, round by round (the same rounds ran both)."""
    base_hops = round_hops(by, BASE)
    diffs = [h - b for h, b in zip(hops, base_hops, strict=True)]
    print()
    print(f"against the baseline {baseline} (this checkout - baseline, each round's own):")
    print(
        f"  hop overhead: baseline {statistics.median(base_hops):.2f} ms/token; difference "
        f"median {statistics.median(diffs):+.2f} (rounds: {', '.join(f'{d:+.2f}' for d in diffs)})"
    )
    for name in CONFIGS:
        runs = zip(by[name].runs, by[name + BASE].runs, strict=True)
        pairs = [
            (a.overhead_per_token - b.overhead_per_token, a.ms_per_token - b.ms_per_token)
            for a, b in runs
        ]
        print(
            f"  {name:<6} overhead/token {statistics.median(p[0] for p in pairs):+.2f} ms, "
            f"ms/token {statistics.median(p[1] for p in pairs):+.2f} ms "
            f"(overhead rounds: {', '.join(f'{p[0]:+.2f}' for p in pairs)})"
        )


def pick_ports(args: argparse.Namespace, count: int, skip: int = 0) -> list[int]:
    """`count` ports: from `--port-base` past the `skip` ones taken before, else free ones."""
    if args.port_base:
        return [args.port_base + skip + i for i in range(count)]
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _on_terminate(signum: int, frame: Any) -> None:
    """SIGTERM/SIGHUP to this script: unwind, so that the `finally` stops the nodes."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a second one must not cut the cleanup short
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_terminate)
    load = os.getloadavg()
    print(
        f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"cache {args.cache_dir}; nodes on 127.0.0.1, --torch-threads 1 each",
        flush=True,
    )
    if (os.cpu_count() or 1) < 3:
        print(
            f"note: {os.cpu_count()} cores for up to 3 node processes plus this client; "
            "see the CPU lines at the end",
            flush=True,
        )
    results: list[SetupResult]
    wan: WanResult | None = None
    try:
        results = run_setups(args)
        if args.delays:
            wan = run_wan(args, pick_ports(args, 4))
    except BenchError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    report(results, wan, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
