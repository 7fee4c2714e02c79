"""Models bigger than the CPU caches: swarmd against llama.cpp's llama-server on the same
random-weight GGUF, the same threads, in alternating rounds.

For each shape (Llama 1B, 3B, 8B) and kind (Q4_0: every matrix Q4_0, the head Q6_K, as
llama.cpp writes it; Q4_K_M: Q4_K with attn_v, ffn_down and the head Q6_K), it writes the
file once into `--dir` (tests/gguf_files.py: random blocks, never a download), measures
the machine's read bandwidth (a 1 GB float32 sum on the same threads, best of 5), then
runs each server in rounds (order swapped each round; this VM's bandwidth drifts 2x in an
hour, so one run each would lie) and prints per server and round:

- start: process start until /health answers (the first swarmd start of a new file also
  reads the header once: reported apart as `first`);
- memory while serving: VmRSS, split into anonymous and file pages (a mapped file's pages
  the kernel can drop), and the peak (VmHWM);
- prefill tok/s (a 200-token prompt, one token) and decode tok/s (a 49-token prompt, 64
  greedy tokens), each as the server reports it (swarmd: `server-timing` ttft/decode;
  llama-server: its `timings`);
- bytes of weights read per token (every matrix but the embedding table, which a token
  reads one row of), and decode as a fraction of bandwidth / bytes: the limit.

With `--half` a swarmd node of the first half of the layers is also started alone: its
start and memory beside the whole node's.

    .venv/bin/python bench/big_model.py --shapes 8b --kinds Q4_0 --rounds 3

llama-server comes from `make bench-deps` / bench/build_llama_server.sh (.venv/bin);
without it only swarmd runs. The last line is
`RESULT <shape>-<kind> decode_ratio=... prefill_ratio=... start_ratio=...` per model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from procstat import free_port, stop, wait_healthy  # noqa: E402

from tests.gguf_files import SHAPES, write_llama_gguf  # noqa: E402

KINDS = {
    "Q4_0": ({"output.weight": "Q6_K"}, "Q4_0"),
    "Q4_K_M": (
        {"output.weight": "Q6_K", "attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K"},
        "Q4_K",
    ),
}
SILENCE = tuple(range(17))  # SmolLM2's special tokens: a random head never ends early
TEXT = "the swarm of old machines answers every question about rivers and bread"
WORDS = TEXT.split(" ")


@dataclass
class Run:
    server: str
    start_s: float
    rss_mb: float
    anon_mb: float
    file_mb: float
    peak_mb: float
    prefill_tok_s: float
    decode_tok_s: float
    tokens: list[int] = field(default_factory=list)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1b,3b,8b", help=f"of {','.join(SHAPES)}")
    parser.add_argument("--kinds", default="Q4_0,Q4_K_M", help=f"of {','.join(KINDS)}")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "swarmd-big")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--half", action="store_true", help="also a node of half the layers")
    parser.add_argument("--llama", type=Path, default=REPO / ".venv" / "bin" / "llama-server")
    parser.add_argument("--no-llama", action="store_true")
    return parser.parse_args()


def model_file(folder: Path, shape: str, kind: str) -> Path:
    path = folder / f"llama-{shape}-{kind.lower()}.gguf"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        types, default = KINDS[kind]
        started = time.monotonic()
        partial = path.with_suffix(".partial")
        write_llama_gguf(partial, SHAPES[shape], types, default, silence=SILENCE)
        partial.rename(path)
        print(
            f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in "
            f"{time.monotonic() - started:.0f} s",
            flush=True,
        )
    return path


def read_bandwidth_gbs(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(1 << 28)  # 1 GiB of float32
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def weight_bytes_per_token(path: Path) -> int:
    from gguf import GGUFReader

    return sum(
        int(t.n_bytes) for t in GGUFReader(str(path)).tensors if t.name != "token_embd.weight"
    )


def _status_mb(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(rest.split()[0]) / 1024
    return out


def _post(port: int, body: dict[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=900) as response:
        return json.loads(response.read()), dict(response.headers)


def _timing(headers: dict[str, str], name: str) -> float:
    for part in headers.get("server-timing", headers.get("Server-Timing", "")).split(","):
        key, _, value = part.strip().partition(";dur=")
        if key == name:
            return float(value) / 1000.0
    raise KeyError(name)


def start(
    server: str, path: Path, args: argparse.Namespace, work: Path, layers: str = ""
) -> tuple[subprocess.Popen[bytes], int, float]:
    port = free_port()
    if server == "llama.cpp":
        cmd = [
            str(args.llama),
            "-m",
            str(path),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "-t",
            str(args.threads),
            "-c",
            "2048",
            "-np",
            "1",
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "swarmd",
            "run",
            "--model",
            str(path),
            "--port",
            str(port),
            "--p2p-port",
            str(free_port()),
            "--data-dir",
            str(work / "data"),
            "--cache-dir",
            str(work / "cache"),
            "--torch-threads",
            str(args.threads),
        ]
        if layers:
            cmd += ["--layers", layers]
    log = (work / f"{server}.log").open("ab")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_healthy(port, proc)
    return proc, port, time.monotonic() - started


def measure(server: str, path: Path, args: argparse.Namespace, work: Path) -> Run:
    proc, port, start_s = start(server, path, args, work)
    try:
        long_prompt = " ".join(WORDS[i % len(WORDS)] for i in range(200))
        short_prompt = " ".join(WORDS[i % len(WORDS)] for i in range(49))
        base = {"model": path.stem.lower(), "temperature": 0, "seed": 1}
        _post(port, {**base, "prompt": "warm up", "max_tokens": 2})
        body, headers = _post(port, {**base, "prompt": long_prompt, "max_tokens": 1})
        prompt_tokens = int(body["usage"]["prompt_tokens"])  # type: ignore[index]
        if server == "llama.cpp":
            prefill = float(body["timings"]["prompt_per_second"])  # type: ignore[index]
        else:
            prefill = prompt_tokens / _timing(headers, "ttft")
        body, headers = _post(port, {**base, "prompt": short_prompt, "max_tokens": args.tokens})
        tokens = int(body["usage"]["completion_tokens"])  # type: ignore[index]
        if server == "llama.cpp":
            decode = float(body["timings"]["predicted_per_second"])  # type: ignore[index]
        else:
            decode = (tokens - 1) / _timing(headers, "decode")
        mem = _status_mb(proc.pid)
    finally:
        stop(proc)
    return Run(
        server,
        start_s,
        mem["VmRSS"],
        mem.get("RssAnon", 0),
        mem.get("RssFile", 0),
        mem["VmHWM"],
        prefill,
        decode,
        [tokens],
    )


def main() -> None:
    args = parse_args()
    servers = ["swarmd"]
    if not args.no_llama and args.llama.exists():
        servers.append("llama.cpp")
    elif not args.no_llama:
        print(f"no {args.llama}: swarmd alone (make bench-deps builds llama-server)")
    bandwidth = read_bandwidth_gbs(args.threads)
    print(f"read bandwidth: {bandwidth:.1f} GB/s ({args.threads} threads, 1 GiB sum, best of 5)")
    results = []
    for shape in args.shapes.split(","):
        for kind in args.kinds.split(","):
            path = model_file(args.dir, shape, kind)
            read = weight_bytes_per_token(path)
            work = Path(tempfile.mkdtemp(prefix="big-"))
            first = start("swarmd", path, args, work)
            stop(first[0])
            print(
                f"\n{path.name}: {path.stat().st_size / 1e9:.2f} GB, {read / 1e9:.2f} GB of "
                f"weights read per token (limit {bandwidth * 1e9 / read:.2f} tok/s); swarmd's "
                f"first start (the header read once) {first[2]:.1f} s",
                flush=True,
            )
            runs: list[Run] = []
            for r in range(args.rounds):
                for server in servers if r % 2 == 0 else servers[::-1]:
                    run = measure(server, path, args, work)
                    runs.append(run)
                    print(
                        f"  round {r + 1} {server:9s} start {run.start_s:5.1f} s  rss "
                        f"{run.rss_mb:6.0f} MB (anon {run.anon_mb:.0f}, file {run.file_mb:.0f}, "
                        f"peak {run.peak_mb:.0f})  prefill {run.prefill_tok_s:6.1f} tok/s  "
                        f"decode {run.decode_tok_s:5.2f} tok/s "
                        f"({run.decode_tok_s * read / 1e9 / bandwidth:.2f} of the limit)",
                        flush=True,
                    )
            if args.half:
                layers = SHAPES[shape].layers
                proc, _, start_s = start("swarmd", path, args, work, f"0:{layers // 2}")
                mem = _status_mb(proc.pid)
                stop(proc)
                print(
                    f"  half node 0:{layers // 2}: start {start_s:.1f} s, rss "
                    f"{mem['VmRSS']:.0f} MB (anon {mem.get('RssAnon', 0):.0f}), peak "
                    f"{mem['VmHWM']:.0f} MB",
                    flush=True,
                )
            results.append((f"{shape}-{kind}", runs))
    for name, runs in results:
        ours = [r for r in runs if r.server == "swarmd"]
        theirs = [r for r in runs if r.server == "llama.cpp"]
        if not theirs:
            continue

        def ratio(attr: str, ours: list[Run] = ours, theirs: list[Run] = theirs) -> float:
            return statistics.median(getattr(r, attr) for r in ours) / statistics.median(
                getattr(r, attr) for r in theirs
            )

        print(
            f"RESULT {name} decode_ratio={ratio('decode_tok_s'):.2f} "
            f"prefill_ratio={ratio('prefill_tok_s'):.2f} start_ratio={ratio('start_s'):.2f}"
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
