"""The stage engine against plain transformers and llama.cpp, in one run, same file, same cores.

Phases (each in its own process, `--threads` torch/llama.cpp threads, default 2):

1. transformers-fp32: `generate` on the embedded GGUF dequantized to float32 (what
   `--weights fp32` converts it to), timed by a streamer;
2. swarmd fp32 / int8 / int4: a `swarmd run` subprocess (`--weights fp32 --dtype float32`,
   `--weights int8`, and the default, int4), streamed `/v1/chat/completions`;
3. llama.cpp: llama-cpp-python's own engine on the same GGUF, streamed in-process (no HTTP
   in between, so a stricter baseline than any server), when the optional `bench` extra
   is installed (`make bench-deps`).

Per phase: decode tok/s of a greedy 128-token reply ((tokens - 1) / first-to-last token
time), TTFT of that reply, prefill tok/s of a ~500-token prompt (prompt tokens / time to
its first token; each run's prompt starts with a new line so no server can reuse a cached
prefix), and the server's peak RSS (VmHWM) after its runs; medians of `--runs`. The swarmd
nodes run with `prefix_cache_tokens` 0 (`--prefix-cache-tokens`): no prompt here continues
an earlier one, so a kept conversation is never reused and would only add its KV (46 KB a
token for the embedded model in float32, 8 MB a 128-token reply) to every later peak, up
to the node's prefix budget; the int4 node's RSS after each reply shows that growth when
the cache is on. Ends with

    RESULT int4_over_llamacpp=<r> int4_over_fp32=<r> prefill_over_llamacpp=<r> rss_mb=<MB>

(rss_mb: the int4 node's peak after its 128-token replies). Nothing else should run on
the machine meanwhile.

Usage: .venv/bin/python bench/engine.py [--cache-dir DIR] [--runs 3] [--threads 2]
       [--phases swarmd-int4,llama.cpp] [--prefix-cache-tokens 0]
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs
from procstat import free_port

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Write a long story about a dragon who learns to bake bread. Make it at least 500 words."
PREFILL_LINE = "The harbour lights were lit at dusk and the fishing boats came home one by one."
PREFILL_LINES = 28  # about 500 tokens


@dataclass
class Phase:
    name: str
    decode_tok_s: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    prefill_tok_s: list[float] = field(default_factory=list)
    rss_mb: float | None = None  # peak after the 128-token replies
    rss_after_prefill_mb: float | None = None  # peak after the ~500-token prompts too
    rss_each_mb: list[float] = field(default_factory=list)  # RSS after each timed reply
    note: str = ""

    def median(self, values: list[float]) -> float | None:
        return statistics.median(values) if values else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(platformdirs.user_cache_dir("swarmd"))
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="the swarmd nodes' prefix_cache_tokens (-1: a node's default, an eighth of its "
        "KV budget); 0: keep no finished conversation, none is ever continued here",
    )
    parser.add_argument(
        "--phases", default="", help="comma-separated phase names to run (default: all)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # transformers phase, in a child
    return parser.parse_args()


def story_prompt(run: int) -> str:
    # A new first line each run: no server may reuse a cached prompt.
    return f"Story number {run}. {PROMPT}"


def prefill_prompt(run: int) -> str:
    lines = [f"Note {run}: read the following and summarise it in one sentence."]
    lines += [f"{i}. {PREFILL_LINE}" for i in range(PREFILL_LINES)]
    return "\n".join(lines)


# --- a streaming OpenAI client ----------------------------------------------------------


def stream_chat(
    port: int, model: str, prompt: str, max_tokens: int
) -> tuple[float, list[float], int]:
    """(seconds to the first content chunk, arrival times of content chunks, prompt tokens)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    arrivals: list[float] = []
    prompt_tokens = 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line.endswith("[DONE]"):
            continue
        event = json.loads(line[5:])
        for choice in event.get("choices") or []:
            if choice.get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
        usage = event.get("usage")
        if usage:
            prompt_tokens = int(usage.get("prompt_tokens") or 0)
    conn.close()
    if not arrivals:
        raise RuntimeError("no content came back")
    return arrivals[0] - started, arrivals, prompt_tokens


def measure_server(
    phase: Phase, port: int, model: str, args: argparse.Namespace, pid: int, counts: list[int]
) -> None:
    """`counts`: the prompt tokens of each prefill prompt (the same tokenizer and template)."""
    stream_chat(port, model, story_prompt(-1), 8)  # warm-up
    for run in range(args.runs):
        ttft, arrivals, _ = stream_chat(port, model, story_prompt(run), args.max_tokens)
        phase.ttft_ms.append(ttft * 1000)
        if len(arrivals) > 1:
            phase.decode_tok_s.append((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))
        rss = rss_mb(pid)
        if rss is not None:
            phase.rss_each_mb.append(rss)
    phase.rss_mb = peak_rss_mb(pid)
    for run in range(args.runs):
        ttft, _, _ = stream_chat(port, model, prefill_prompt(run), 1)
        phase.prefill_tok_s.append(counts[run] / ttft)
    phase.rss_after_prefill_mb = peak_rss_mb(pid)


def peak_rss_mb(pid: int) -> float | None:
    return _status_mb(pid, "VmHWM:")


def rss_mb(pid: int) -> float | None:
    """Resident now (what a kept conversation adds stays in it; a reply's own KV does not)."""
    return _status_mb(pid, "VmRSS:")


def _status_mb(pid: int, key: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def wait_http(port: int, path: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no answer on :{port}{path} in {timeout_s:g} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


# --- phases -----------------------------------------------------------------------------


def swarmd_phase(
    name: str, flags: list[str], args: argparse.Namespace, workdir: Path, counts: list[int]
) -> Phase:
    phase = Phase(name)
    port = free_port()
    cmd = [sys.executable, "-m", "swarmd", "run", "--port", str(port), "--p2p-port", "0"]
    cmd += ["--data-dir", str(workdir / name), "--cache-dir", str(args.cache_dir)]
    cmd += ["--torch-threads", str(args.threads), *flags]
    log = (workdir / f"{name}.log").open("wb")
    env = {**os.environ, "SWARMD_PREFIX_CACHE_TOKENS": str(args.prefix_cache_tokens)}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        wait_http(port, "/health", proc, 600)
        health = json.loads(_get(port, "/health"))
        model = health["models"][0]
        phase.note = f"{model['weights']} weights, {model['dtype']}, {model['backend']}"
        measure_server(phase, port, model["id"], args, proc.pid, counts)
    finally:
        stop(proc)
        log.close()
    return phase


def llamacpp_phase(args: argparse.Namespace) -> Phase:
    """llama.cpp's own engine (llama-cpp-python, in a child process, no HTTP in between: a
    stricter baseline than a server; llama-cpp-python's Python server measured slower)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return Phase("llama.cpp", note="not installed (make bench-deps builds it, ~10 min)")
    data = _child(args, "llamacpp")
    note = f"llama-cpp-python {data['version']}, in-process, same GGUF"
    return _child_phase("llama.cpp", data, note)


def llamacpp_child(args: argparse.Namespace) -> None:
    import llama_cpp

    from swarmd.model.source import embedded_gguf_path

    llm = llama_cpp.Llama(
        str(embedded_gguf_path()),
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=4096,
        verbose=False,
    )

    def run(prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
        messages = [{"role": "user", "content": prompt}]
        started = time.perf_counter()
        arrivals = []
        for chunk in llm.create_chat_completion(
            messages, max_tokens=max_tokens, temperature=0, stream=True
        ):
            if chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
        return arrivals[0] - started, arrivals, 0

    _child_runs(args, run, {"version": llama_cpp.__version__})


def _child_phase(name: str, data: dict[str, Any], note: str) -> Phase:
    return Phase(
        name,
        decode_tok_s=data["decode"],
        ttft_ms=data["ttft"],
        prefill_tok_s=data["prefill"],
        rss_mb=data["rss"],
        rss_after_prefill_mb=data["rss_after_prefill"],
        note=note,
    )


def _child(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, "--cache-dir", str(args.cache_dir)]
    cmd += ["--runs", str(args.runs), "--threads", str(args.threads)]
    cmd += ["--max-tokens", str(args.max_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _child_runs(args: argparse.Namespace, run: Any, extra: dict[str, Any]) -> None:
    """The timed runs of an in-process phase; prints its figures as one JSON line."""
    counts = prompt_counts(args.cache_dir, args.runs)
    decode, ttft, prefill = [], [], []
    run(story_prompt(-1), 8)
    for i in range(args.runs):
        first, arrivals, _ = run(story_prompt(i), args.max_tokens)
        ttft.append(first * 1000)
        decode.append((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))
    rss = peak_rss_mb(os.getpid())
    for i in range(args.runs):
        first, _, _ = run(prefill_prompt(i), 1)
        prefill.append(counts[i] / first)
    result = {"decode": decode, "ttft": ttft, "prefill": prefill, "rss": rss, **extra}
    print(json.dumps({**result, "rss_after_prefill": peak_rss_mb(os.getpid())}))


def transformers_phase(args: argparse.Namespace) -> Phase:
    """Run in a child process: its peak RSS is then the transformers run's alone."""
    return _child_phase("transformers-fp32", _child(args, "transformers"), "generate(), float32")


def transformers_child(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from swarmd.model.source import EMBEDDED_MODEL_ID, resolve_folder

    class Clock(BaseStreamer):  # type: ignore[misc]
        """When each new token comes out (the first `put` is the prompt)."""

        def __init__(self) -> None:
            self.calls: list[float] = []

        def put(self, value: Any) -> None:
            self.calls.append(time.perf_counter())

        def end(self) -> None:
            pass

    # generate() runs on this thread, the one that loaded the model: no second OpenMP team.
    torch.set_num_threads(args.threads)
    folder = resolve_folder(EMBEDDED_MODEL_ID, args.cache_dir, "fp32").model_dir
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def run(prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        clock = Clock()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                **inputs,
                max_new_tokens=max_tokens,
                do_sample=False,
                streamer=clock,
                pad_token_id=tokenizer.eos_token_id,
            )
        arrivals = clock.calls[1:]
        return arrivals[0] - started, arrivals, int(inputs["input_ids"].shape[1])

    _child_runs(args, run, {})


def prompt_counts(cache_dir: Path, runs: int) -> list[int]:
    """Tokens of each prefill prompt, as the embedded model's tokenizer and chat template
    make them (llama.cpp's stream reports no usage; it renders the same template)."""
    from swarmd.model.source import EMBEDDED_MODEL_ID, resolve_folder
    from swarmd.model.text import ChatMessage, TextCodec

    codec = TextCodec.load(resolve_folder(EMBEDDED_MODEL_ID, cache_dir).model_dir)
    return [len(codec.chat_prompt([ChatMessage("user", prefill_prompt(r))])) for r in range(runs)]


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    return conn.getresponse().read()


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    args = parse_args()
    if args.child:
        {"transformers": transformers_child, "llamacpp": llamacpp_child}[args.child](args)
        return
    sys.path.insert(0, str(REPO))
    from swarmd.model.source import embedded_gguf_path

    gguf = embedded_gguf_path()
    workdir = Path(tempfile.mkdtemp(prefix="swarmd-bench-engine-"))
    counts = prompt_counts(args.cache_dir, args.runs)
    fp32_flags = ["--weights", "fp32", "--dtype", "float32"]
    runners: dict[str, Callable[[], Phase]] = {
        "transformers-fp32": lambda: transformers_phase(args),
        "swarmd-fp32": lambda: swarmd_phase("swarmd-fp32", fp32_flags, args, workdir, counts),
        "swarmd-int8": lambda: swarmd_phase(
            "swarmd-int8", ["--weights", "int8"], args, workdir, counts
        ),
        "swarmd-int4": lambda: swarmd_phase("swarmd-int4", [], args, workdir, counts),
        "llama.cpp": lambda: llamacpp_phase(args),
    }
    wanted = set(args.phases.split(",")) if args.phases else set(runners)
    unknown = wanted - set(runners)
    if unknown:
        raise SystemExit(f"unknown phase(s) {sorted(unknown)}; known: {', '.join(runners)}")
    # A phase left out is shown as skipped: the RESULT ratios that need it print "-".
    phases = [
        run() if name in wanted else Phase(name, note="skipped") for name, run in runners.items()
    ]
    print(
        f"\n{gguf.name}, {args.threads} threads, {args.max_tokens}-token greedy replies, "
        f"medians of {args.runs}"
    )
    header = ("phase", "decode tok/s", "TTFT ms", "prefill tok/s", "RSS MB", "+prefill")
    print(
        f"{header[0]:<18} {header[1]:>12} {header[2]:>8} {header[3]:>13} {header[4]:>7} "
        f"{header[5]:>8}  notes"
    )
    for p in phases:
        print(
            f"{p.name:<18} {_fmt(p.median(p.decode_tok_s)):>12} {_fmt(p.median(p.ttft_ms), 0):>8} "
            f"{_fmt(p.median(p.prefill_tok_s), 0):>13} {_fmt(p.rss_mb, 0):>7} "
            f"{_fmt(p.rss_after_prefill_mb, 0):>8}  {p.note}"
        )
    print(
        f"(RSS: peak after the {args.max_tokens}-token replies; +prefill: after the "
        f"{min(counts)}-{max(counts)}-token prompts too)"
    )
    by = {p.name: p for p in phases}
    int4, fp32, cpp = by["swarmd-int4"], by["swarmd-fp32"], by["llama.cpp"]
    each = ", ".join(f"{v:.0f}" for v in int4.rss_each_mb)
    print(
        f"swarmd-int4 RSS MB after each reply: {each} "
        f"(prefix_cache_tokens {args.prefix_cache_tokens})"
    )

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"

    decode = ratio(int4.median(int4.decode_tok_s), cpp.median(cpp.decode_tok_s))
    over_fp32 = ratio(int4.median(int4.decode_tok_s), fp32.median(fp32.decode_tok_s))
    prefill = ratio(int4.median(int4.prefill_tok_s), cpp.median(cpp.prefill_tok_s))
    print(
        f"RESULT int4_over_llamacpp={decode} int4_over_fp32={over_fp32} "
        f"prefill_over_llamacpp={prefill} rss_mb={_fmt(int4.rss_mb, 0)}"
    )


if __name__ == "__main__":
    main()
