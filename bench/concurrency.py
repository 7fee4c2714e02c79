"""Many users at once: 1, 2, 4, 8 and 16 concurrent streams on one node, on a two-stage
swarm, and on llama.cpp's server, in one run on the same machine.

Phases (each a server in its own process group, started and stopped here):

1. one: a `swarmd run` node holding the whole embedded model (`--torch-threads T`);
2. two: two `swarmd run` nodes, layers [0:15] and [15:30], `--torch-threads` T/2 each
   (they share the cores), requests to the first;
3. llama.cpp: llama-cpp-python's OpenAI server on the same GGUF with T threads, when the
   optional `bench` extra is installed (`make bench-deps`). It serves one request at a
   time (queued, not interrupted: `--interrupt_requests False`), so its total stays about
   its one-stream rate;
4. llama-server: llama.cpp's own C++ server, which batches sessions (`-np 16`, continuous
   batching), with T threads on the same GGUF, when built (`bench/build_llama_server.sh`
   builds it from the llama.cpp that the `bench` extra's sdist carries, into
   `.venv/bin/llama-server`; or `--llama-server PATH`).

At each level N, N streamed greedy chat completions start together (different prompts,
`--max-tokens` tokens each). Per level: total tok/s (every content chunk of every stream
over the wall time from the first request to the last `[DONE]`), the median per-stream
decode tok/s ((chunks - 1) / first-to-last chunk), the median TTFT, and errors. Ends with

    RESULT scaling8_one=<r> scaling8_two=<r> agg8_over_llamacpp=<r>

scaling8: total tok/s at 8 streams over the total at 1 (the target is >= 3); agg8: the
one-node total at 8 streams over llama.cpp's at 8 (llama-server's where it ran, else
llama-cpp-python's). Nothing else should run meanwhile.

Each level runs `--repeat` times (3) with the same prompts; the run with the median
total stands for the level (this machine's speed moves by a third from minute to minute).

Usage: .venv/bin/python bench/concurrency.py [--cache-dir DIR] [--threads 2]
       [--levels 1,2,4,8,16] [--max-tokens 64] [--repeat 3]
       [--phases one,two,llama.cpp,llama-server] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs
from procstat import free_port

REPO = Path(__file__).resolve().parent.parent
READY = re.compile(r"swarmd: serving (\S+) .* at http://127\.0\.0\.1:(\d+)/v1")
TOPICS = ["the sea", "mountains", "a lighthouse", "bread", "trains", "owls", "rain", "maps"]


@dataclass
class Level:
    streams: int
    total_tok_s: float = 0.0
    per_stream_tok_s: float = 0.0
    ttft_ms: float = 0.0
    errors: int = 0


@dataclass
class Phase:
    name: str
    note: str = ""
    levels: list[Level] = field(default_factory=list)

    def total(self, streams: int) -> float | None:
        for level in self.levels:
            if level.streams == streams and level.errors == 0:
                return level.total_tok_s
        return None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    default_cache = Path(platformdirs.user_cache_dir("swarmd"))
    parser.add_argument("--cache-dir", type=Path, default=default_cache)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--levels", default="1,2,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per level; the median total is reported"
    )
    parser.add_argument("--phases", default="one,two,llama.cpp,llama-server", help="which to run")
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=REPO / ".venv" / "bin" / "llama-server",
        help="llama.cpp's server binary (bench/build_llama_server.sh)",
    )
    return parser.parse_args()


def prompt(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return f"Write {3 + i % 5} sentences about {topic}. Number {i}."


def stream(port: int, model: str, text: str, max_tokens: int) -> tuple[float, list[float]]:
    """(seconds to the first content chunk, content chunk arrival times); raises on error."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    started = time.perf_counter()
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    arrivals: list[float] = []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line.endswith("[DONE]"):
            continue
        event = json.loads(line[5:])
        if "error" in event:
            raise RuntimeError(str(event["error"])[:200])
        for choice in event.get("choices") or []:
            if choice.get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
    conn.close()
    if not arrivals:
        raise RuntimeError("no content came back")
    return arrivals[0] - started, arrivals


def run_level(port: int, model: str, streams: int, max_tokens: int, offset: int) -> Level:
    results: list[tuple[float, list[float]] | None] = [None] * streams
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            results[i] = stream(port, model, prompt(offset + i), max_tokens)
        except Exception as exc:  # counted and shown, the level goes on
            errors.append(str(exc))

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    done = [r for r in results if r is not None]
    level = Level(streams, errors=len(errors))
    if errors:
        print(f"  {streams} streams: {len(errors)} errors, e.g. {errors[0]}", flush=True)
    if done:
        level.total_tok_s = sum(len(a) for _, a in done) / wall
        rates = [(len(a) - 1) / (a[-1] - a[0]) for _, a in done if len(a) > 1 and a[-1] > a[0]]
        level.per_stream_tok_s = statistics.median(rates) if rates else 0.0
        level.ttft_ms = statistics.median(ttft for ttft, _ in done) * 1000
    return level


def measure(phase: Phase, port: int, model: str, args: argparse.Namespace) -> None:
    stream(port, model, "Hello.", 8)  # warm-up
    for i, streams in enumerate(int(n) for n in args.levels.split(",")):
        runs = [
            run_level(port, model, streams, args.max_tokens, offset=i * 100)
            for _ in range(max(1, args.repeat))
        ]
        # This box's speed swings from minute to minute: the run of median total stands
        # for the level, and an error in any run counts.
        level = sorted(runs, key=lambda r: r.total_tok_s)[len(runs) // 2]
        level.errors = sum(r.errors for r in runs)
        phase.levels.append(level)
        print(
            f"  {phase.name}: {streams:>2} streams {level.total_tok_s:7.1f} tok/s total, "
            f"{level.per_stream_tok_s:5.1f} per stream, TTFT {level.ttft_ms:6.0f} ms",
            flush=True,
        )


# --- servers ----------------------------------------------------------------------------


class Node:
    def __init__(
        self,
        args: argparse.Namespace,
        workdir: Path,
        name: str,
        extra: list[str],
        program: list[str] | None = None,  # what runs `swarmd ARGS` (another bench's wrapper)
    ):
        self.log_path = workdir / f"{name}.log"
        cmd = program or [sys.executable, "-m", "swarmd"]
        cmd = [*cmd, "run", "--port", "0", "--p2p-port", "0"]
        cmd += ["--data-dir", str(workdir / name), "--cache-dir", str(args.cache_dir), *extra]
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True
        )
        self.model = ""
        self.port = 0
        self.p2p_addrs: list[str] = []
        deadline = time.monotonic() + 600
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{name} exited: see {self.log_path}")
            if line.startswith("swarmd: p2p listening on "):
                self.p2p_addrs.append(line.strip().removeprefix("swarmd: p2p listening on "))
            match = READY.search(line)
            if match:
                self.model, self.port = match.group(1), int(match.group(2))
                break
        else:
            raise TimeoutError(f"{name} not ready")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())

    def stop(self) -> None:
        stop_group(self.proc)
        self.log.close()


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def one_node_phase(args: argparse.Namespace, workdir: Path) -> Phase:
    phase = Phase("one", f"one node, {args.threads} threads")
    node = Node(args, workdir, "one", ["--torch-threads", str(args.threads)])
    try:
        measure(phase, node.port, node.model, args)
    finally:
        node.stop()
    return phase


def two_stage_phase(args: argparse.Namespace, workdir: Path) -> Phase:
    half = str(max(1, args.threads // 2))
    phase = Phase("two", f"[0:15] + [15:30], {half} thread(s) each")
    a = Node(args, workdir, "stage-a", ["--layers", "0:15", "--torch-threads", half])
    nodes = [a]
    try:
        joining = ["--layers", "15:30", "--torch-threads", half, "--bootstrap", a.p2p_addrs[0]]
        nodes.append(Node(args, workdir, "stage-b", joining))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            entry = a.get("/v1/models")["data"][0]
            if entry["swarm"]["routable"] and len(entry["swarm"]["holders"]) >= 2:
                break
            time.sleep(0.5)
        measure(phase, a.port, a.model, args)
    finally:
        for node in nodes:
            node.stop()
    return phase


def llamacpp_phase(args: argparse.Namespace, workdir: Path) -> Phase:
    if importlib.util.find_spec("llama_cpp") is None:
        return Phase("llama.cpp", "not installed (make bench-deps builds it, ~10 min)")
    import llama_cpp

    from swarmd.model.source import embedded_gguf_path

    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(embedded_gguf_path())]
    cmd += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
    cmd += ["--n_ctx", "4096", "--port", str(port), "--host", "127.0.0.1"]
    # By default a new request interrupts the one streaming: queue them instead.
    cmd += ["--interrupt_requests", "False"]
    phase = Phase("llama.cpp", f"llama-cpp-python {llama_cpp.__version__} server, same GGUF")
    return serve_and_measure(phase, cmd, port, args, workdir / "llamacpp.log")


def llama_server_phase(args: argparse.Namespace, workdir: Path) -> Phase:
    binary = args.llama_server
    if not binary.exists():
        return Phase("llama-server", f"no {binary} (bench/build_llama_server.sh builds it)")
    from swarmd.model.source import embedded_gguf_path

    port = free_port()
    slots = max(int(n) for n in args.levels.split(","))
    cmd = [str(binary), "--model", str(embedded_gguf_path()), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-t", str(args.threads), "-tb", str(args.threads)]
    # A slot per stream, each with room for a prompt and its reply.
    cmd += ["-np", str(slots), "-c", str(slots * 1024), "--no-webui"]
    phase = Phase("llama-server", f"llama.cpp's llama-server -np {slots}, same GGUF")
    return serve_and_measure(phase, cmd, port, args, workdir / "llama-server.log")


def serve_and_measure(
    phase: Phase, cmd: list[str], port: int, args: argparse.Namespace, log_path: Path
) -> Phase:
    """Start an OpenAI server (`cmd`, listening on `port`), measure it, stop it."""
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
    try:
        model = wait_for_openai_server(port, phase.name)
        measure(phase, port, model, args)
    finally:
        stop_group(proc)
        log.close()
    return phase


def wait_for_openai_server(port: int, name: str) -> str:
    """The model id an OpenAI server on `port` serves, once it answers (2 minutes)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models")
            response = conn.getresponse()
            if response.status == 200:
                return str(json.loads(response.read())["data"][0]["id"])
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{name} did not start")


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    workdir = Path(tempfile.mkdtemp(prefix="swarmd-bench-concurrency-"))
    runs = {
        "one": one_node_phase,
        "two": two_stage_phase,
        "llama.cpp": llamacpp_phase,
        "llama-server": llama_server_phase,
    }
    wanted = args.phases.split(",")
    phases = [
        runs[name](args, workdir) if name in wanted else Phase(name, "not run") for name in runs
    ]
    print(f"\n{args.max_tokens}-token greedy streams, {args.threads} threads in all")
    print(
        f"{'phase':<12} {'streams':>7} {'total tok/s':>11} {'per stream':>10} {'TTFT ms':>8} errors"
    )
    for p in phases:
        if not p.levels:
            print(f"{p.name:<12} {p.note}")
        for lv in p.levels:
            print(
                f"{p.name:<12} {lv.streams:>7} {lv.total_tok_s:>11.1f} "
                f"{lv.per_stream_tok_s:>10.1f} {lv.ttft_ms:>8.0f} {lv.errors:>6}"
            )
    by = {p.name: p for p in phases}

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}"

    one, two = by["one"], by["two"]
    cpp = by["llama-server"].total(8) or by["llama.cpp"].total(8)
    print(
        f"RESULT scaling8_one={ratio(one.total(8), one.total(1))} "
        f"scaling8_two={ratio(two.total(8), two.total(1))} "
        f"agg8_over_llamacpp={ratio(one.total(8), cpp)}"
    )


if __name__ == "__main__":
    main()
