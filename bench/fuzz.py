"""Fuzz every decoder of untrusted input: only its documented errors, fast, small.

Targets (each fed `--iterations` inputs, default 100,000):

    frames        FrameDecoder.feed (split in three reads)             FrameError
    stage-wire    decode_body + the stage parser its `t` names         MalformedFrameError,
                  (parse_open / parse_step / parse_token / ...)        StageRefusedError
    records       decode_record                                        RecordError
    manifest      parse_manifest                                       ManifestError
    file-rpc      a request frame through FileServer's handlers        SwarmError (sent back
                                                                       to the caller typed)
    rpc-reply     a reply frame through rpc._unwrap + files._bin       RemoteError,
                                                                       MalformedFrameError
    api-json      parse_body + validate + check_supported (chat and    RequestError
                  completions requests)

An input is one of: a valid seed with byte mutations (bit flips, truncation, splices,
inserted or deleted runs, length fields set to edge values), a seed decoded and changed
as a structure (a field replaced by a random value, removed, added, a list grown past its
limit) and encoded again, or a random msgpack / JSON value. The run is deterministic
for a `--seed`.

A finding is any other exception (printed with its input in hex), an input slower than
`--max-ms` (timed again twice: the fastest of three counts, so a scheduler hiccup is
not one), or a sampled input whose decode allocates more than `--max-input-mib`
(tracemalloc, every `--sample`th input). Per target it prints inputs, errors by type,
the slowest input and the largest sampled peak; the exit status is 1 on any finding.

Usage: .venv/bin/python bench/fuzz.py [--iterations N] [--seed S] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import inspect
import json
import math
import random
import resource
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import torch
import trio

from swarmd.api.schemas import ChatCompletionRequest, CompletionRequest, parse_body, validate
from swarmd.dht.records import NodeRecord, decode_record, sign_record
from swarmd.errors import (
    FrameError,
    MalformedFrameError,
    ManifestError,
    RecordError,
    RemoteError,
    RequestError,
    StageRefusedError,
    SwarmError,
)
from swarmd.model.layers import LayerRange
from swarmd.model.manifest import MIN_CHUNK_BYTES, FileEntry, Manifest, ShardEntry, parse_manifest
from swarmd.model.sampling import SamplingParams
from swarmd.net.frames import FRAME_HEADER_BYTES, FrameDecoder, decode_body
from swarmd.net.identity import Identity
from swarmd.net.rpc import _unwrap
from swarmd.pipeline import wire
from swarmd.transfer.files import FileServer, FileServeSettings, _bin

MAX_FRAME_BYTES = 1 << 16  # fuzz inputs stay small: the budget tests cover 16 MiB frames
NOW = 1_700_000_000.0
ME = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
PEERS = [f"12D3KooW{c * 44}" for c in "BCDEFGHJKLMNPQRS"]
COORD = "12D3KooWCOORDCOORDCOORDCOORDCOORDCOORDCOORDCOORDCO"
HIDDEN = 8
VOCAB = 100
LIMITS = wire.StageLimits(ME, "m", LayerRange(0, 20), 30, HIDDEN, VOCAB, 512)
EDGE_INTS = (0, 1, -1, 2, 127, 128, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1)
EDGE_INTS += (2**32, 2**53, 2**63 - 1, -(2**63), 2**64 - 1, VOCAB, VOCAB - 1, 30, 20)


@dataclasses.dataclass
class Target:
    name: str
    seeds: list[Any]  # valid inputs, as objects
    encode: Callable[[Any], bytes]
    run: Callable[[bytes], object]  # may return an awaitable (run under trio)
    allowed: tuple[type[BaseException], ...]
    text: bool = False  # JSON text rather than msgpack


@dataclasses.dataclass
class Figures:
    inputs: int = 0
    errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    slowest_ms: float = 0.0
    slowest_input: bytes = b""
    peak_bytes: int = 0  # largest tracemalloc peak of one sampled input
    findings: list[str] = dataclasses.field(default_factory=list)


# --- inputs -------------------------------------------------------------------------------


def random_scalar(rng: random.Random) -> Any:
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice(EDGE_INTS) * rng.choice((1, -1) if rng.random() < 0.2 else (1,))
    if kind == 1:
        return rng.randint(-(2**70), 2**70) >> rng.randrange(70)
    if kind == 2:
        return rng.choice((0.0, -0.0, 1.5, -1.0, 1e308, 5e-324, math.inf, -math.inf, math.nan))
    if kind == 3:
        return rng.random() * 10 ** rng.randint(-5, 12)
    if kind == 4:
        return rng.choice((True, False, None))
    if kind == 5:
        return (
            "".join(
                chr(rng.choice((rng.randrange(32, 127), rng.randrange(0x110000))))
                for _ in range(rng.randrange(12))
            )
            .encode("utf-8", "surrogatepass")
            .decode("utf-8", "replace")
        )
    if kind == 6:
        return rng.choice((ME, COORD, *PEERS[:3], "m", "open", "step", "", "x" * 600, "\n\x00"))
    if kind == 7:
        return rng.randbytes(rng.choice((0, 1, 3, 4, 8, 12, 64, 128, rng.randrange(3000))))
    if kind == 8:
        return rng.choice(("/ip4/1.2.3.4/tcp/1/p2p/" + ME, "ab" * 32, "llama", "bf16"))
    return rng.randrange(-5, 300)


def random_object(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 5 or roll < 0.55:
        return random_scalar(rng)
    if rng.random() < 0.05:  # a long container, of scalars only (nested, it would explode)
        size = rng.randrange(5000)
        pool = [random_scalar(rng) for _ in range(7)]
        if roll < 0.78:
            return [pool[i % 7] for i in range(size)]
        return {f"k{i}": pool[i % 7] for i in range(size)}
    size = rng.choice((0, 1, 2, 3, 5, 8))
    if roll < 0.78:
        return [random_object(rng, depth + 1) for _ in range(size)]
    return {_random_key(rng): random_object(rng, depth + 1) for _ in range(size)}


def _random_key(rng: random.Random) -> Any:
    if rng.random() < 0.95:
        return rng.choice(("t", "n", "sid", "route", "ok", "error", "model", "x", "", "type"))
    return random_scalar(rng)


def mutate_object(rng: random.Random, obj: Any, seeds: list[Any]) -> Any:
    """A deep copy of `obj` with one to three changes at random places in its tree."""
    obj = copy.deepcopy(obj)
    for _ in range(rng.randint(1, 3)):
        obj = _mutate_at(rng, obj, seeds, depth=0)
    return obj


def _mutate_at(rng: random.Random, node: Any, seeds: list[Any], depth: int) -> Any:
    children: list[Any] = list(node) if isinstance(node, dict) else []
    if isinstance(node, list):
        children = list(range(len(node)))
    if children and rng.random() < 0.7 and depth < 6:  # go deeper
        key = rng.choice(children)
        node[key] = _mutate_at(rng, node[key], seeds, depth + 1)
        return node
    roll = rng.random()
    if roll < 0.35:
        return random_object(rng, depth)
    if roll < 0.45 and isinstance(node, int) and not isinstance(node, bool):
        return rng.choice((node + 1, node - 1, -node, node * 2**32, float(node), str(node)))
    times = rng.choice((2, 17, 65, 300, 1100))  # past every list's limit
    # Grown only while the result stays under a frame: three of them must not make gigabytes.
    if roll < 0.55 and isinstance(node, list) and node and _fits(node, MAX_FRAME_BYTES // times):
        return node * times
    if roll < 0.65 and isinstance(node, dict) and node:
        del node[rng.choice(children)]
        return node
    if roll < 0.75 and isinstance(node, dict):
        node[_random_key(rng)] = random_object(rng, depth + 1)
        return node
    if roll < 0.8 and isinstance(node, str | bytes) and len(node) * times < MAX_FRAME_BYTES:
        return node * times
    if roll < 0.85 and isinstance(node, str):
        return node.encode()
    if roll < 0.9:
        return copy.deepcopy(rng.choice(seeds))  # a whole valid frame where a field was
    return random_scalar(rng)


def mutate_bytes(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        op = rng.randrange(9)
        at = rng.randrange(len(buf) + 1)
        if op == 0 and buf:  # bit flip
            at = min(at, len(buf) - 1)
            buf[at] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:  # an interesting byte (msgpack type bytes among them)
            at = min(at, len(buf) - 1)
            buf[at] = rng.choice((0x00, 0xFF, 0x7F, 0x80, 0xC1, 0xC7, 0xD4, 0xDC, 0xDD, 0xDF, 0xDB))
        elif op == 2:  # truncation
            del buf[at:]
        elif op == 3:  # splice with another input
            other = rng.choice(others)
            start = rng.randrange(len(other) + 1)
            buf[at:] = other[start:]
        elif op == 4:  # inserted random bytes
            buf[at:at] = rng.randbytes(rng.randrange(1, 16))
        elif op == 5:  # deleted run
            del buf[at : at + rng.randrange(1, 64)]
        elif op == 6:  # a length field (or any number) set to an edge value
            width = rng.choice((1, 2, 4))
            value = rng.choice((0, 1, 2**width * 8 - 1, 2 ** (8 * width) - 1, len(buf)))
            buf[at : at + width] = (value % 2 ** (8 * width)).to_bytes(width, "big")
        elif op == 7 and buf:  # a run repeated
            end = min(len(buf), at + rng.randrange(1, 32))
            buf[at:at] = buf[at:end] * rng.randrange(2, 40)
        elif op == 8:  # text-level edits for JSON: a quote, a brace, a bracket
            buf[at:at] = rng.choice((b'"', b"{", b"}", b"[", b"]", b",", b":", b"\\u", b"1e999"))
    return bytes(buf[: 4 * MAX_FRAME_BYTES])


def _fits(obj: Any, budget: int) -> bool:
    """Whether `obj` encodes to about `budget` bytes or fewer."""
    return _left(obj, budget) >= 0


def _left(obj: Any, budget: int) -> int:
    if isinstance(obj, str | bytes):
        return budget - len(obj) - 1
    budget -= 1
    if isinstance(obj, dict):
        obj = [x for pair in obj.items() for x in pair]
    if isinstance(obj, list):
        for item in obj:
            budget = _left(item, budget)
            if budget < 0:
                break
    return budget


def make_input(rng: random.Random, target: Target, encoded: list[bytes]) -> bytes:
    roll = rng.random()
    if roll < 0.45:
        return mutate_bytes(rng, rng.choice(encoded), encoded)
    try:
        if roll < 0.85:
            obj = mutate_object(rng, rng.choice(target.seeds), target.seeds)
        else:
            obj = random_object(rng)
        return target.encode(obj)
    except (TypeError, ValueError, OverflowError, MalformedFrameError):
        return rng.choice(encoded)  # not encodable (an int over 64 bits, a non-str JSON key)


# --- targets ------------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _frame(obj: Any) -> bytes:
    """Frames back to back (a list: several), with no size check: too large is an input."""
    bodies = [_pack(o) for o in (obj if isinstance(obj, list) else [obj])]
    return b"".join(len(b).to_bytes(FRAME_HEADER_BYTES, "big") + b for b in bodies)


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def wire_seeds() -> list[dict[str, Any]]:
    hops = [
        wire.RouteHop(ME, 0, 20),
        *(wire.RouteHop(p, 20 + i, 21 + i) for i, p in enumerate(PEERS[:10])),
    ]
    addrs = {p: (f"/ip4/10.0.0.{i}/tcp/4001/p2p/{p}",) for i, p in enumerate(PEERS[:10])}
    req = wire.OpenRequest(
        sid="sess-01",
        hop=0,
        route=tuple(hops),
        addrs={**addrs, COORD: (f"/ip4/10.0.0.99/tcp/4001/p2p/{COORD}",)},
        coordinator=COORD,
        model_id="m",
        max_length=256,
        sampling=SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            logit_bias={3: -100.0, 17: 2.5},
            seed=7,
        ),
        history=tuple(range(VOCAB)) * 3,
    )
    hidden = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(0))
    return [
        wire.open_frame(req),
        wire.step_frame(0, True, torch.tensor([[1, 2, 3]]), [], 0),
        wire.step_frame(4, True, hidden, [1.5, 2.0], 10),
        wire.step_frame(5, False, hidden.to(torch.bfloat16), [1.0], 0, alone=True),
        wire.token_frame(4, 42, [1.5, 2.0, 3.0], 96),
        wire.token_frame(5, None, [1.0], 0),
        wire.fail_frame(PEERS[1], "next stage lost", "lost"),
        wire.ret_frame("sess-01"),
        dict(wire.END_FRAME),
    ]


def run_wire(data: bytes) -> object:
    frame = decode_body(data)
    kind = wire.frame_type(frame)
    n = frame.get("n") if type(frame.get("n")) is int else 0
    if kind == "open":
        return wire.parse_open(frame, LIMITS)
    if kind == "step":
        return wire.parse_step(frame, n, "ids" in frame, LIMITS, torch.float32)
    if kind == "tok":
        return wire.parse_token(frame, n, VOCAB, want=len(data) % 2 == 0)
    if kind == "fail":
        return wire.parse_fail(frame)
    if kind == "ret":
        return wire.parse_ret(frame)
    return None


def run_frames(data: bytes) -> object:
    decoder = FrameDecoder(MAX_FRAME_BYTES, MAX_FRAME_BYTES + FRAME_HEADER_BYTES + 1024)
    a, b = len(data) // 3, 2 * len(data) // 3
    frames = decoder.feed(data[:a]) + decoder.feed(data[a:b]) + decoder.feed(data[b:])
    if not all(isinstance(f, dict) for f in frames):
        raise AssertionError("a frame that is not a dict")
    return frames


def record_target() -> Target:
    identity = Identity.from_seed(bytes(range(32)))
    record = NodeRecord(
        peer_id=identity.peer_id,
        model_id="smollm2-135m-instruct",
        model_hash="ab" * 32,
        layer_start=0,
        layer_end=15,
        num_layers=30,
        dtype="float16",
        weights="fp32",
        free_kv_tokens=8192,
        kv_budget_tokens=8192,
        throughput_tps=42.5,
        state="ready",
        addrs=("/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4001"),
        api_url="http://127.0.0.1:8800",
        version="0.1.0",
        expires_at=NOW + 60.0,
    )
    seeds = [msgpack.unpackb(sign_record(identity, record))]
    seeds.append(msgpack.unpackb(sign_record(identity, dataclasses.replace(record, addrs=()))))
    return Target("records", seeds, _pack, lambda data: decode_record(data, NOW), (RecordError,))


def _file_entry(name: str, data: bytes) -> FileEntry:
    import hashlib

    chunks = tuple(
        hashlib.sha256(data[at : at + MIN_CHUNK_BYTES]).hexdigest()
        for at in range(0, len(data), MIN_CHUNK_BYTES)
    )
    return FileEntry(name, len(data), hashlib.sha256(data).hexdigest(), chunks)


def make_manifest(folder: Path) -> Manifest:
    """A manifest of small files written into `folder` (served by the file-rpc target)."""
    rng = random.Random(1)
    entries: list[FileEntry] = []
    for name, size in (("tokenizer.json", 70_000), ("a.safetensors", 1000), ("b.bin", 0)):
        data = rng.randbytes(size)
        (folder / name).write_bytes(data)
        entries.append(_file_entry(name, data))
    shard = entries.pop(1)
    shards = (ShardEntry(shard.file, shard.bytes, shard.sha256, shard.chunks, 0, 4),)
    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64}
    return Manifest(
        "tiny", "llama", config, 4, "bfloat16", "bf16", MIN_CHUNK_BYTES, tuple(entries), shards
    )


def manifest_target(manifest: Manifest) -> Target:
    seed = json.loads(manifest.to_json())
    return Target("manifest", [seed], _json, parse_manifest, (ManifestError,), text=True)


def file_rpc_target(manifest: Manifest, folder: Path) -> Target:
    # The files count as verified; the shard is hashed the first time it is asked for.
    server = FileServer(folder, manifest, list(manifest.files), FileServeSettings(max_transfers=2))
    cid = manifest.content_id

    async def run(data: bytes) -> object:
        request = decode_body(data)
        method, args = request.get("method"), request.get("args")
        # rpc.RpcService._dispatch's own check, then the handler it would call.
        if not isinstance(method, str) or not isinstance(args, dict) or len(request) != 2:
            return None
        peer = "12D3KooWfuzz" + str(len(data) % 3)
        if method == "manifest":
            return await server.rpc_manifest(peer, args)
        if method == "file_chunk":
            return await server.rpc_file_chunk(peer, args)
        return None

    seeds = [
        {"method": "manifest", "args": {"model": cid}},
        {"method": "file_chunk", "args": {"model": cid, "file": "tokenizer.json", "index": 1}},
        {"method": "file_chunk", "args": {"model": cid, "file": "a.safetensors", "index": 0}},
        {"method": "file_chunk", "args": {"model": cid, "file": "b.bin", "index": 0}},
    ]
    return Target("file-rpc", seeds, _pack, run, (SwarmError,))


def run_rpc_reply(data: bytes) -> object:
    reply = decode_body(data)
    result = _unwrap(ME, "file_chunk", reply)
    return _bin(result, "data", ME)


def api_seeds() -> list[dict[str, Any]]:
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "max_tokens": 16,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["\n", "END"],
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {"5": -100, "17": 3.5},
    }
    completion = {"model": "m", "prompt": "Once", "max_tokens": 8, "echo": False, "n": 1}
    return [chat, completion, {"model": "m", "prompt": [1, 2, 3]}]


def run_api(data: bytes) -> object:
    body = parse_body(data)
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    req = validate(model, body)
    req.check_supported()
    req.stop_list()
    req.logit_bias_ids(VOCAB)
    if isinstance(req, ChatCompletionRequest):
        return [m.to_chat() for m in req.messages], req.token_limit()
    return req.token_limit()


def all_targets(folder: Path) -> list[Target]:
    manifest = make_manifest(folder)
    stage = wire_seeds()
    replies: list[Any] = [
        {"ok": {"data": b"\x00" * 100}},
        {"ok": {"manifest": manifest.to_json()}},
        {"error": {"type": "OverloadedError", "message": "busy"}},
    ]
    return [
        Target("frames", [stage[:3], stage[4:], stage[0]], _frame, run_frames, (FrameError,)),
        Target("stage-wire", stage, _pack, run_wire, (MalformedFrameError, StageRefusedError)),
        record_target(),
        manifest_target(manifest),
        file_rpc_target(manifest, folder),
        Target("rpc-reply", replies, _pack, run_rpc_reply, (RemoteError, MalformedFrameError)),
        Target("api-json", api_seeds(), _json, run_api, (RequestError,), text=True),
    ]


# --- the run ------------------------------------------------------------------------------


async def _call(target: Target, data: bytes) -> None:
    result = target.run(data)
    if inspect.isawaitable(result):
        await result


async def _timed(target: Target, data: bytes) -> tuple[float, BaseException | None]:
    started = time.perf_counter()
    try:
        await _call(target, data)
    except Exception as exc:  # judged by the caller: allowed or a finding
        return (time.perf_counter() - started) * 1e3, exc
    return (time.perf_counter() - started) * 1e3, None


def _describe(data: bytes, limit: int = 4096) -> str:
    shown = data[:limit].hex()
    return shown + (f"... ({len(data)} bytes)" if len(data) > limit else f" ({len(data)} bytes)")


async def fuzz_target(
    target: Target,
    iterations: int,
    seed: int,
    *,
    max_ms: float = 100.0,
    max_input_bytes: int = 64 << 20,
    sample: int = 32,
) -> Figures:
    """Feed `target` `iterations` inputs; the figures, findings among them."""
    rng = random.Random(f"{seed}:{target.name}")
    encoded = [target.encode(s) for s in target.seeds]
    figures = Figures()
    for i in range(iterations):
        data = make_input(rng, target, encoded)
        measure = i % sample == 0
        if measure:
            tracemalloc.start()
        elapsed_ms, exc = await _timed(target, data)
        if measure:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            figures.peak_bytes = max(figures.peak_bytes, peak)
            if peak > max_input_bytes:
                figures.findings.append(f"{peak} bytes allocated for input {_describe(data)}")
        figures.inputs += 1
        if exc is None:
            figures.errors["(accepted)"] += 1
        elif isinstance(exc, target.allowed):
            figures.errors[type(exc).__name__] += 1
        else:
            where = "".join(traceback.format_exception(exc)[-3:]).strip()
            figures.findings.append(
                f"{type(exc).__name__}: {str(exc)[:300]}\n    input {_describe(data)}\n{where}"
            )
        if elapsed_ms > max_ms:  # again twice: only if it is slow every time
            elapsed_ms = min(elapsed_ms, *[(await _timed(target, data))[0] for _ in range(2)])
            if elapsed_ms > max_ms:
                figures.findings.append(f"{elapsed_ms:.0f} ms for input {_describe(data)}")
        if elapsed_ms > figures.slowest_ms:
            figures.slowest_ms, figures.slowest_input = elapsed_ms, data
    return figures


def run_all(
    iterations: int, seed: int, only: list[str] | None = None, **limits: Any
) -> Iterator[tuple[str, Figures, float]]:
    """(target name, figures, seconds) of each target in turn."""
    with tempfile.TemporaryDirectory(prefix="swarmd-fuzz-") as folder:
        for target in all_targets(Path(folder)):
            if only and target.name not in only:
                continue
            started = time.perf_counter()
            figures = trio.run(_fuzz_one, target, iterations, seed, limits)
            yield target.name, figures, time.perf_counter() - started


async def _fuzz_one(target: Target, iterations: int, seed: int, limits: dict[str, Any]) -> Figures:
    return await fuzz_target(target, iterations, seed, **limits)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100_000, help="inputs per decoder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="target names (default: all)")
    parser.add_argument("--max-ms", type=float, default=100.0)
    parser.add_argument("--max-input-mib", type=float, default=64.0)
    parser.add_argument("--sample", type=int, default=32, help="trace memory of every Nth input")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rss_before = _peak_rss_mib()
    limits = {
        "max_ms": args.max_ms,
        "max_input_bytes": int(args.max_input_mib * 2**20),
        "sample": args.sample,
    }
    results: dict[str, Figures] = {}
    for name, fig, seconds in run_all(args.iterations, args.seed, args.only, **limits):
        results[name] = fig
        errors = ", ".join(f"{k} {v}" for k, v in fig.errors.most_common())
        print(
            f"{name:11s} {fig.inputs} inputs in {seconds:.1f} s; slowest {fig.slowest_ms:.1f} ms;"
            f" peak {fig.peak_bytes / 2**20:.2f} MiB/input; findings {len(fig.findings)}\n"
            f"    {errors}\n    slowest input: {_describe(fig.slowest_input, 48)}",
            flush=True,
        )
        for finding in fig.findings[:20]:
            print(f"  FINDING [{name}] {finding}", flush=True)
    findings = sum(len(f.findings) for f in results.values())
    print(
        f"{sum(f.inputs for f in results.values())} inputs in {time.perf_counter() - started:.0f}"
        f" s, seed {args.seed}; peak RSS {_peak_rss_mib():.0f} MiB (from {rss_before:.0f});"
        f" {findings} findings"
    )
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
