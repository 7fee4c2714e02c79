"""Single-node benchmark: plain transformers `generate` against the swarmd API.

One run measures the same greedy chat prompt twice, one phase after the other, both
with the same number of torch threads:

1. plain transformers: `AutoModelForCausalLM.generate` on the model converted to float32,
   with a streamer that records when each new token comes out;
2. the API: a `swarmd run --weights fp32 --dtype float32` subprocess (the exact path, the
   same numbers as phase 1; bench/engine.py compares the formats) on a free port, streamed
   `/v1/chat/completions` (temperature 0), timed on the client as the chunks arrive.

TTFT is the time from the call (or the request) to the first token (the first content
chunk); decode tok/s is (tokens - 1) / (time from the first token to the last). Each
phase has a warm-up, then the median of `--runs` runs is reported. The last line is

    RESULT api_over_plain_decode=<ratio> ttft_overhead_ms=<ms>

Other processes on the machine skew every figure (a 2-core box has no spare core), so
before each timed run the script waits (up to `--quiet-timeout` s) until processes other
than itself and its node use under `--quiet-cores` cores, measures that foreign CPU use
during each run from /proc, and flags contended runs in the report.

Usage: .venv/bin/python bench/single_node.py [--cache-dir DIR] [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs
from procstat import free_port, machine_busy_s, process_busy_s

# Greedy SmolLM2-135M-Instruct writes well past 128 tokens of plain English prose for
# this prompt without an end-of-sequence token (swarmd has no `ignore_eos`), and plain
# prose detokenizes to one streamed chunk per token.
PROMPT = "Write a long story about a dragon who learns to bake bread. Make it at least 500 words."
MESSAGES = [{"role": "user", "content": PROMPT}]
TARGET_DECODE_RATIO = 0.9
TARGET_TTFT_OVERHEAD_MS = 30.0


@dataclass(frozen=True)
class RunTiming:
    ttft_s: float
    tokens: int
    decode_s: float  # first token to last token
    chunks: int = 0  # API only: content chunks received
    foreign_cores: float | None = None  # CPU used by other processes during the run
    request_id: str = ""  # API only: the node's x-swarm-request-id (matches its DIAG line)

    @property
    def decode_tok_s(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass(frozen=True)
class PhaseResult:
    name: str
    runs: list[RunTiming]
    tokens: list[int]  # the generated token ids of the warm-up run
    prompt_ids: list[int]

    @property
    def ttft_ms(self) -> float:
        return statistics.median(r.ttft_s for r in self.runs) * 1000.0

    @property
    def decode_tok_s(self) -> float:
        return statistics.median(r.decode_tok_s for r in self.runs)

    @property
    def max_foreign_cores(self) -> float | None:
        values = [r.foreign_cores for r in self.runs if r.foreign_cores is not None]
        return max(values) if values else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(platformdirs.user_cache_dir("swarmd")),
        help="swarmd's converted-models cache (default: the user cache, as swarmd uses)",
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs per phase (median)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per reply")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in both phases")
    parser.add_argument(
        "--startup-timeout", type=float, default=180.0, help="seconds for the node to be ready"
    )
    parser.add_argument(
        "--node-log", type=Path, default=None, help="keep the node's stdout/stderr in this file"
    )
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=0.15,
        help="a run starts once other processes use fewer cores than this",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=0,
        help="timed runs per phase at most, retrying contended ones (default: 3 x --runs)",
    )
    parser.add_argument(
        "--quiet-timeout",
        type=float,
        default=120.0,
        help="longest wait for a quiet machine before each run (0 = do not wait)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.max_tokens < 2 or args.threads < 1:
        parser.error("--runs must be >= 1, --max-tokens >= 2 and --threads >= 1")
    return args


def model_folder(cache_dir: Path) -> Path:
    """The converted Hugging Face folder of the embedded model (converted once if needed)."""
    from swarmd.model.source import EMBEDDED_MODEL_ID, resolve_folder

    return resolve_folder(EMBEDDED_MODEL_ID, cache_dir, "fp32").model_dir


# --- CPU used by other processes --------------------------------------------------------


class CpuMeter:
    """CPU time the whole machine spent busy, minus this script's and its node's (/proc)."""

    def __init__(self, quiet_cores: float, quiet_timeout_s: float, attempts: int) -> None:
        self.pids = [os.getpid()]
        self.quiet_cores = quiet_cores
        self.quiet_timeout_s = quiet_timeout_s
        self.attempts = attempts
        self.available = machine_busy_s() is not None

    def snapshot(self) -> tuple[float, float]:
        """(monotonic seconds, foreign busy CPU seconds so far)."""
        busy = machine_busy_s() or 0.0
        own = sum(process_busy_s(pid) for pid in self.pids)
        return time.monotonic(), busy - own

    def cores_between(self, before: tuple[float, float], after: tuple[float, float]) -> float:
        wall = after[0] - before[0]
        return max(0.0, (after[1] - before[1]) / wall) if wall > 0 else 0.0

    def is_quiet(self, timing: RunTiming) -> bool:
        return timing.foreign_cores is None or timing.foreign_cores < self.quiet_cores

    def max_attempts(self, runs: int) -> int:
        return max(runs, self.attempts)

    def enough(self, timings: list[RunTiming], runs: int) -> bool:
        return sum(self.is_quiet(t) for t in timings) >= runs

    def keep(self, timings: list[RunTiming], runs: int) -> list[RunTiming]:
        """The first `runs` quiet runs, or failing that the `runs` least contended."""
        quiet = [t for t in timings if self.is_quiet(t)]
        if len(quiet) >= runs:
            return quiet[:runs]
        return sorted(timings, key=lambda t: t.foreign_cores or 0.0)[:runs]

    def wait_quiet(self) -> float | None:
        """Wait until other processes use under `quiet_cores`; returns their last figure."""
        if not self.available or self.quiet_timeout_s <= 0:
            return None
        deadline = time.monotonic() + self.quiet_timeout_s
        warned = False
        while True:
            before = self.snapshot()
            time.sleep(0.5)
            cores = self.cores_between(before, self.snapshot())
            if cores < self.quiet_cores:
                return cores
            if time.monotonic() >= deadline:
                print(
                    f"  WARNING: other processes still use {cores:.2f} cores; running anyway",
                    flush=True,
                )
                return cores
            if not warned:
                print(
                    f"  waiting for a quiet machine (other processes use {cores:.2f} cores)",
                    flush=True,
                )
                warned = True


# --- phase 1: plain transformers -----------------------------------------------------


def _prompt_tensor(tokenizer: Any) -> Any:
    import torch

    encoded = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt"
    )
    if not torch.is_tensor(encoded):  # transformers 5 returns a BatchEncoding
        encoded = encoded["input_ids"]
    return encoded  # [1, P]


def run_plain(
    model_dir: Path, threads: int, runs: int, max_tokens: int, meter: CpuMeter
) -> PhaseResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        """Records the time each new token leaves `generate` (the first put is the prompt)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value: Any) -> None:
            now = time.perf_counter()
            if not self._prompt_seen:
                self._prompt_seen = True
                return
            self.times.extend([now] * int(value.numel()))

        def end(self) -> None:
            pass

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    input_ids = _prompt_tensor(tokenizer)
    attention_mask = torch.ones_like(input_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def once() -> tuple[RunTiming, list[int]]:
        clock = TokenClock()
        cpu_before = meter.snapshot()
        started = time.perf_counter()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad_id,
            streamer=clock,
        )
        new = out[0, input_ids.shape[1] :].tolist()
        if len(clock.times) != len(new) or len(new) != max_tokens:
            raise RuntimeError(f"plain generate returned {len(new)} tokens, not {max_tokens}")
        foreign = meter.cores_between(cpu_before, meter.snapshot()) if meter.available else None
        first, last = clock.times[0], clock.times[-1]
        timing = RunTiming(first - started, len(new), last - first, foreign_cores=foreign)
        return timing, new

    _, tokens = once()  # warm-up
    timings: list[RunTiming] = []
    for i in range(meter.max_attempts(runs)):
        meter.wait_quiet()
        timing, _ = once()
        timings.append(timing)
        print(f"  plain run {i + 1}: {_describe(timing, meter)}", flush=True)
        if meter.enough(timings, runs):
            break
    timings = meter.keep(timings, runs)
    prompt_ids = input_ids[0].tolist()
    return PhaseResult("plain", timings, tokens, prompt_ids)


# --- phase 2: the swarmd API ---------------------------------------------------------


def swarmd_command() -> list[str]:
    beside = Path(sys.executable).parent / "swarmd"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("swarmd")
    if found:
        return [found]
    return [sys.executable, "-c", "from swarmd.cli import app; app()"]


class NodeProcess:
    """A `swarmd run` subprocess; always stopped by `stop()` (terminate, wait, kill)."""

    def __init__(self, cache_dir: Path, threads: int, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._data_dir = tempfile.TemporaryDirectory(prefix="swarmd-bench-data-")
        cmd = [
            *swarmd_command(),
            "run",
            "--port",
            str(self.port),
            "--cache-dir",
            str(cache_dir),
            "--data-dir",
            self._data_dir.name,
            "--torch-threads",
            str(threads),
            # The same weights and kernels as the plain phase: this measures the API's cost.
            "--weights",
            "fp32",
            "--dtype",
            "float32",
        ]
        self._log = log_path.open("wb")
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        except OSError:
            self._log.close()
            self._data_dir.cleanup()
            raise

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        self._data_dir.cleanup()


async def wait_ready(session: Any, node: NodeProcess, timeout_s: float) -> str:
    """Poll /health until the node answers; return its model id."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        if node.proc.poll() is not None:
            raise RuntimeError(
                f"swarmd exited with code {node.proc.returncode} before it was ready:\n"
                + node.log_tail()
            )
        try:
            async with session.get(
                node.url + "/health", timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                if resp.status == 200:
                    body = await resp.json()
                    if body.get("status") == "ok":
                        return str(body["models"][0]["id"])
        except (aiohttp.ClientError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"swarmd was not ready within {timeout_s:g} s:\n" + node.log_tail())
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.5)


async def stream_once(
    session: Any,
    url: str,
    model_id: str,
    max_tokens: int,
    meter: CpuMeter,
    token_ids: bool = False,
) -> tuple[RunTiming, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": model_id,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if token_ids:
        body["return_token_ids"] = True
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    arrivals: list[float] = []
    extra: dict[str, Any] = {"text": []}
    usage: dict[str, Any] | None = None
    finish: str | None = None
    done = False
    cpu_before = meter.snapshot()
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", data=payload, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"API answered {resp.status}: {await resp.text()}")
        request_id = resp.headers.get("x-swarm-request-id", "")
        async for raw in resp.content:
            now = time.perf_counter()
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"API error mid-stream: {chunk['error']}")
            if "prompt_token_ids" in chunk:
                extra["prompt_token_ids"] = chunk["prompt_token_ids"]
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    arrivals.append(now)
                    extra["text"].append(content)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                if "token_ids" in choice:
                    extra["token_ids"] = choice["token_ids"]
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    if usage is None:
        raise RuntimeError("no usage chunk came back (stream_options.include_usage)")
    tokens = int(usage["completion_tokens"])
    if tokens != max_tokens or finish != "length":
        raise RuntimeError(
            f"the API returned {tokens} tokens (finish_reason={finish}), not {max_tokens}: "
            "the prompt must not reach end-of-sequence within max_tokens"
        )
    if len(arrivals) < 2:
        raise RuntimeError(f"only {len(arrivals)} content chunks came back")
    extra["usage"] = usage
    foreign = meter.cores_between(cpu_before, meter.snapshot()) if meter.available else None
    first, last = arrivals[0], arrivals[-1]
    timing = RunTiming(first - started, tokens, last - first, len(arrivals), foreign, request_id)
    return timing, extra


async def run_api_async(
    node: NodeProcess, args: argparse.Namespace, meter: CpuMeter
) -> PhaseResult:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.monotonic()
        model_id = await wait_ready(session, node, args.startup_timeout)
        print(f"  node ready at {node.url} in {time.monotonic() - started:.1f} s", flush=True)
        url, tokens = node.url, args.max_tokens
        _, warm = await stream_once(session, url, model_id, tokens, meter, token_ids=True)
        timings: list[RunTiming] = []
        for i in range(meter.max_attempts(args.runs)):
            await asyncio.to_thread(meter.wait_quiet)
            timing, _ = await stream_once(session, url, model_id, tokens, meter)
            timings.append(timing)
            print(f"  api run {i + 1}: {_describe(timing, meter)}", flush=True)
            if meter.enough(timings, args.runs):
                break
        timings = meter.keep(timings, args.runs)
    return PhaseResult(
        "api", timings, list(warm.get("token_ids", [])), list(warm.get("prompt_token_ids", []))
    )


def run_api(args: argparse.Namespace, log_path: Path, meter: CpuMeter) -> PhaseResult:
    node = NodeProcess(args.cache_dir, args.threads, log_path)
    meter.pids.append(node.proc.pid)
    try:
        return asyncio.run(run_api_async(node, args, meter))
    finally:
        meter.pids.remove(node.proc.pid)
        node.stop()


def server_diag(log_path: Path, runs: list[RunTiming]) -> dict[str, float]:
    """Medians of the node's DIAG fields (logged to stderr) over the counted requests."""
    wanted = {t.request_id for t in runs}
    timed: list[dict[str, str]] = []
    with contextlib.suppress(OSError):
        for line in log_path.read_text(errors="replace").splitlines():
            if "DIAG: request complete" in line:
                fields = line.split("DIAG: request complete", 1)[1].split()
                record = dict(f.split("=", 1) for f in fields if "=" in f)
                if record.get("request_id") in wanted:
                    timed.append(record)
    for record in timed:
        # Time in the node outside the stage's forward passes (request handling, the
        # worker hand-off, detokenizing, SSE writes), per generated token.
        with contextlib.suppress(KeyError, ValueError, ZeroDivisionError):
            busy = float(record["ttft_ms"]) + float(record["decode_ms"])
            outside = (busy - float(record["seg0_ms"])) / int(record["tokens"])
            record["outside_forward_ms_per_token"] = str(outside)
    out: dict[str, float] = {}
    keys = ("ttft_ms", "tok_per_sec", "tpot_ms", "seg0_ms", "outside_forward_ms_per_token")
    for key in keys:
        values = [float(r[key]) for r in timed if key in r]
        if values:
            out[key] = statistics.median(values)
    return out


# --- report --------------------------------------------------------------------------


def _describe(t: RunTiming, meter: CpuMeter) -> str:
    chunks = f", {t.chunks} chunks" if t.chunks else ""
    foreign = "" if t.foreign_cores is None else f", other processes {t.foreign_cores:.2f} cores"
    if not meter.is_quiet(t):
        foreign += "; contended, not counted unless no quiet run is left"
    return (
        f"ttft {t.ttft_s * 1000:.1f} ms, decode {t.decode_tok_s:.2f} tok/s "
        f"({t.tokens} tokens{chunks}{foreign})"
    )


def report(
    plain: PhaseResult, api: PhaseResult, diag: dict[str, float], threads: int, quiet: float
) -> None:
    ratio = api.decode_tok_s / plain.decode_tok_s
    overhead = api.ttft_ms - plain.ttft_ms
    same_prompt = plain.prompt_ids == api.prompt_ids if api.prompt_ids else None
    same_tokens = plain.tokens == api.tokens if api.tokens else None
    print()
    print(f"single node, {plain.runs[0].tokens} tokens, {threads} torch threads, medians")
    print(f"{'':24}{'plain':>10}{'api':>10}{'api vs plain':>16}{'target':>10}")
    print(
        f"{'TTFT ms':24}{plain.ttft_ms:>10.1f}{api.ttft_ms:>10.1f}"
        f"{overhead:>+16.1f}{'<= +' + format(TARGET_TTFT_OVERHEAD_MS, 'g'):>10}"
    )
    print(
        f"{'decode tok/s':24}{plain.decode_tok_s:>10.2f}{api.decode_tok_s:>10.2f}"
        f"{ratio:>16.3f}{'>= ' + format(TARGET_DECODE_RATIO, 'g'):>10}"
    )
    plain_tpot, api_tpot = 1000 / plain.decode_tok_s, 1000 / api.decode_tok_s
    print(
        f"{'decode ms/token':24}{plain_tpot:>10.2f}{api_tpot:>10.2f}{api_tpot - plain_tpot:>+16.2f}"
    )
    if diag:
        fields = ", ".join(f"{k} {v:.2f}" for k, v in diag.items())
        print(f"node DIAG (server side): {fields}")
    print(
        f"prompt tokens {len(plain.prompt_ids)}; same prompt ids: {_yn(same_prompt)}; "
        f"same greedy tokens: {_yn(same_tokens)}"
    )
    foreign = [v for v in (plain.max_foreign_cores, api.max_foreign_cores) if v is not None]
    if foreign:
        worst = max(foreign)
        note = "" if worst < quiet else f"  WARNING: contended (>= {quiet:g}), figures unreliable"
        print(f"most CPU other processes used during a counted run: {worst:.2f} cores{note}")
    verdict = (
        "meets"
        if ratio >= TARGET_DECODE_RATIO and overhead <= TARGET_TTFT_OVERHEAD_MS
        else "misses"
    )
    print(f"the API {verdict} the targets")
    print(f"RESULT api_over_plain_decode={ratio:.3f} ttft_overhead_ms={overhead:.1f}", flush=True)


def _yn(value: bool | None) -> str:
    return "unchecked" if value is None else ("yes" if value else "NO")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _bench(args)
    except RuntimeError as exc:
        print(f"bench: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1


def _bench(args: argparse.Namespace) -> int:
    meter = CpuMeter(args.quiet_cores, args.quiet_timeout, args.max_attempts or 3 * args.runs)
    model_dir = model_folder(args.cache_dir)
    print(f"model folder: {model_dir}")
    print("phase 1: plain transformers generate", flush=True)
    plain = run_plain(model_dir, args.threads, args.runs, args.max_tokens, meter)
    gc.collect()  # the plain model is gone before the node starts
    print("phase 2: swarmd API (streamed /v1/chat/completions)", flush=True)
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-") as scratch:
        log_path = args.node_log or Path(scratch) / "node.log"
        api = run_api(args, log_path, meter)
        diag = server_diag(log_path, api.runs)
    report(plain, api, diag, args.threads, args.quiet_cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
