"""Where a token's time goes on a two-node ring: every step of it stamped, both nodes.

`bench/pipeline.py` gives a hop's overhead as one figure per run, and on a small shared
machine that figure moves by more than most changes to the hop (issue 17, item 7). This
benchmark takes the hop apart instead. Two `swarmd run` nodes on 127.0.0.1 hold a model's
layers [0:h] and [h:N] (`--torch-threads 1` each); each runs with wrappers around the
functions a token passes through, which stamp `time.monotonic()` (one clock for every
process on the machine) into memory:

    coordinator: DistributedChain.step (asyncio) -> Ring._send_step / _receive (trio)
    both nodes:  the stage service's next frame, wire.parse_step, TorchWorker.submit,
                 the worker's take of the job, its forward (_run_steps),
                 FrameStream.send and FrameStream.recv

After a warm-up, `--requests` greedy requests of `--max-tokens` tokens are timed; then
the stamps of both nodes are merged, cut into tokens where each token reaches the
coordinator (`Ring._receive` returns), and the median of every segment between two
consecutive stamps is printed, e.g.

    0.456 ms  A fs.send< -> B fs.recv step

(A: the coordinator and first stage, B: the second). The forwards are the compute; every
other segment is the hop's. The model: the embedded one by default, or `--tiny`, a
random 4-layer Llama of hidden 64 (compute about nothing, so what is left is overhead).
The last line is

    RESULT token_ms=<ms> compute_ms=<ms> overhead_ms=<ms>

(medians per token over the timed requests). The wrappers add a few microseconds per
stamp. `--libp2p` stamps inside py-libp2p too (net stream, yamux, Noise and TCP, each
way): on this box a frame's write there took about 0.3 ms and its read 0.25 ms, spread
over a dozen layers of 10-90 us each, with no single one to remove.
Usage: .venv/bin/python bench/hop_timeline.py [--tiny] [--libp2p] [--cache-dir DIR]
       [--requests 5] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import platformdirs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

_STAMPS: list[tuple[float, str]] = []
LIBP2P_ENV = "SWARMD_HOP_TIMELINE_LIBP2P"  # set for the nodes by `--libp2p`


def _stamp(tag: str) -> None:
    _STAMPS.append((time.monotonic(), tag))


# --- in a node: the wrappers ------------------------------------------------------------


def _around_async(owner: Any, name: str, tag: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        _stamp(tag + ">")
        try:
            return await original(*args, **kwargs)
        finally:
            _stamp(tag + "<")

    setattr(owner, name, wrapped)


def _around_sync(owner: Any, name: str, tag: str, after_only: bool = False) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not after_only:
            _stamp(tag + ">")
        try:
            return original(*args, **kwargs)
        finally:
            _stamp(tag + "<")

    setattr(owner, name, wrapped)


def _libp2p_layers() -> None:
    """Stamps inside py-libp2p too (`--libp2p`): each layer a frame passes on its way
    out (net stream, yamux stream, yamux frame, Noise, TCP) and in."""
    from libp2p.io import trio as libp2p_trio
    from libp2p.network.stream import net_stream
    from libp2p.security import secure_session
    from libp2p.security.noise import io as noise_io
    from libp2p.stream_muxer.yamux import yamux

    _around_async(net_stream.NetStream, "write", "ns.write")
    _around_async(yamux.YamuxStream, "write", "ys.write")
    _around_async(yamux.Yamux, "_write_frame", "y.wframe")
    _around_async(noise_io.BaseNoiseMsgReadWriter, "write_msg", "noise.w")
    _around_async(libp2p_trio.TrioTCPStream, "write", "tcp.w")
    _around_async(libp2p_trio.TrioTCPStream, "read", "tcp.r")
    _around_async(noise_io.BaseNoiseMsgReadWriter, "read_msg", "noise.r")
    _around_async(secure_session.SecureSession, "read", "ss.r")
    _around_async(yamux.YamuxStream, "read", "ys.read")
    _around_async(net_stream.NetStream, "read", "ns.read")


def run_node(argv: list[str], stamps_path: Path) -> None:
    """`swarmd run ARGV` with the wrappers in; SIGUSR1 writes the stamps so far (and
    clears them)."""
    from swarmd.model import worker
    from swarmd.net import frames
    from swarmd.pipeline import distributed, ring, stage_service, wire

    _around_async(distributed.DistributedChain, "step", "chain.step")
    _around_async(ring.Ring, "_send_step", "ring.send")
    _around_async(ring.Ring, "_receive", "ring.recv")
    _around_async(stage_service, "_next", "svc.next")
    _around_sync(wire, "parse_step", "parse")
    _around_sync(worker.TorchWorker, "submit", "submit", after_only=True)
    _around_sync(worker.TorchWorker, "_next", "worker.take", after_only=True)
    _around_sync(worker.TorchWorker, "_run_steps", "forward")
    _around_async(frames.FrameStream, "send", "fs.send")
    _around_async(frames.FrameStream, "recv", "fs.recv")
    if os.environ.get(LIBP2P_ENV):
        _libp2p_layers()

    def write(*_: object) -> None:
        taken = list(_STAMPS)
        _STAMPS.clear()
        stamps_path.write_text("".join(f"{t:.6f} {tag}\n" for t, tag in taken))

    signal.signal(signal.SIGUSR1, write)
    from swarmd.cli import app

    sys.argv = ["swarmd", *argv]
    app()


# --- the driver -------------------------------------------------------------------------


def tiny_model(out: Path, tokenizer_from: Path) -> Path:
    from tests.conftest import build_tiny_llama

    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        build_tiny_llama(out, tokenizer_from, 4)
    return out


def request(port: int, model: str, max_tokens: int) -> float:
    """ms per decoded token of one greedy request, from its own timing."""
    import http.client

    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    reply = json.loads(conn.getresponse().read())
    conn.close()
    tokens = reply["usage"]["completion_tokens"]
    return float(reply["swarm"]["timing"]["decode_ms"]) / max(1, tokens - 1)


def segments(
    stamp_files: list[tuple[str, Path]],
) -> tuple[dict[str, list[float]], list[float], list[float]]:
    """Every segment's durations (ms) over the tokens, each token's total, and each
    token's compute (its forwards on every node, whatever stamps fell between)."""
    merged: list[tuple[float, str]] = []
    for who, path in stamp_files:
        for line in path.read_text().splitlines():
            t, tag = line.split(" ", 1)
            merged.append((float(t), f"{who} {tag}"))
    merged.sort()
    # A token's cycle starts where the coordinator has the last token in hand: a point
    # every token passes, whichever thread then sends the next step.
    starts = [i for i, (_, tag) in enumerate(merged) if tag == "A ring.recv<"]
    parts: dict[str, list[float]] = {}
    totals: list[float] = []
    computes: list[float] = []
    for a, b in itertools.pairwise(starts):
        token = merged[a : b + 1]
        for (t0, tag0), (t1, tag1) in itertools.pairwise(token):
            parts.setdefault(f"{tag0} -> {tag1}", []).append((t1 - t0) * 1000)
        totals.append((token[-1][0] - token[0][0]) * 1000)
        began: dict[str, float] = {}
        compute = 0.0
        for t, tag in token:
            who, what = tag.split(" ", 1)
            if what == "forward>":
                began[who] = t
            elif what == "forward<" and who in began:
                compute += (t - began.pop(who)) * 1000
        computes.append(compute)
    return parts, totals, computes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    default_cache = Path(platformdirs.user_cache_dir("swarmd"))
    parser.add_argument("--cache-dir", type=Path, default=default_cache)
    parser.add_argument("--tiny", action="store_true", help="a random 4-layer model: no compute")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--libp2p",
        action="store_true",
        help="stamp inside py-libp2p too: each layer of a frame's write and read",
    )
    parser.add_argument("--node", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node:  # a child: STAMPS_PATH then the swarmd arguments
        run_node(args.node[1:], Path(args.node[0]))
        return

    import concurrency

    from swarmd.model.source import EMBEDDED_MODEL_ID, resolve_folder

    workdir = Path(tempfile.mkdtemp(prefix="hop-timeline-"))
    if args.libp2p:
        os.environ[LIBP2P_ENV] = "1"  # the nodes inherit it
    smollm = resolve_folder(EMBEDDED_MODEL_ID, args.cache_dir).model_dir
    model_args: list[str] = []
    split = ("0:15", "15:30")
    if args.tiny:
        model_args = ["--model", str(tiny_model(args.cache_dir / "hop-timeline-tiny", smollm))]
        split = ("0:2", "2:4")
    stamps = {who: workdir / f"stamps-{who}.txt" for who in ("A", "B")}
    nodes: list[concurrency.Node] = []
    try:
        for who, layers in zip(("A", "B"), split, strict=True):
            extra = [*model_args, "--layers", layers, "--torch-threads", "1"]
            if nodes:
                extra += ["--bootstrap", nodes[0].p2p_addrs[0]]
            program = [sys.executable, str(Path(__file__).resolve()), "--node", str(stamps[who])]
            node_args = argparse.Namespace(cache_dir=args.cache_dir)
            nodes.append(concurrency.Node(node_args, workdir, who, extra, program))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            entry = nodes[0].get("/v1/models")["data"][0]
            if entry["swarm"]["routable"] and len(entry["swarm"]["holders"]) >= 2:
                break
            time.sleep(0.5)
        for _ in range(2):
            request(nodes[0].port, nodes[0].model, args.max_tokens)
        for node in nodes:  # the warm-up's stamps are written and dropped
            os.kill(node.proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
        port, model = nodes[0].port, nodes[0].model
        per_token = [request(port, model, args.max_tokens) for _ in range(args.requests)]
        for path in stamps.values():
            path.unlink(missing_ok=True)
        for node in nodes:
            os.kill(node.proc.pid, signal.SIGUSR1)
        wait_until = time.monotonic() + 10
        while not all(p.exists() for p in stamps.values()) and time.monotonic() < wait_until:
            time.sleep(0.1)
    finally:
        for node in nodes:
            node.stop()
    parts, totals, computes = segments([(who, path) for who, path in stamps.items()])
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"ms per token by the replies' own timing: {', '.join(f'{x:.2f}' for x in per_token)}")
    print(f"segments of {len(totals)} tokens, medians (A: coordinator + first stage, B: second):")
    common = {k: v for k, v in parts.items() if len(v) > len(totals) // 2}
    for name, values in common.items():
        print(f"  {statistics.median(values):7.3f} ms  n={len(values):4d}  {name}")
    token, compute = statistics.median(totals), statistics.median(computes)
    overhead = statistics.median(t - c for t, c in zip(totals, computes, strict=True))
    print(f"RESULT token_ms={token:.2f} compute_ms={compute:.2f} overhead_ms={overhead:.2f}")


if __name__ == "__main__":
    main()
