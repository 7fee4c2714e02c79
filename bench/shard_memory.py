"""Peak memory of loading one layer range of a sharded model, against the whole model.

Shards the embedded model in three (into --out, once; int4 with an int8 table, the GGUF's
own format), then loads each range in a fresh process as a node does, runs one forward
pass, and prints its peak RSS (ru_maxrss), beside a process that only imports what
loading needs (the floor every node pays: Python, torch, swarmd's model code).

    .venv/bin/python bench/shard_memory.py --cache-dir /tmp/sw/cache --out /tmp/sw/smol3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import platformdirs

PROBE = """
import resource, sys, time
from swarmd.model.loader import load_model
from swarmd.model.source import resolve_model
layers = sys.argv[2]
started = time.monotonic()
if layers != "none":
    import torch
    from swarmd.model.memory import keep_large_blocks_returnable, release_free_heap

    keep_large_blocks_returnable()  # as a node loads (swarmd/node.py)
    source = resolve_model(sys.argv[1], sys.argv[1])
    model = load_model(source, layers)
    release_free_heap()
    stage = model.stage
    # The engine reads every weight into memory at load (no memory map); one forward pass
    # adds what a step needs.
    hidden = torch.zeros(1, 4, stage.hidden_size)
    inputs = torch.tensor([[1, 2, 3, 4]]) if stage.is_first else hidden
    stage(inputs, stage.new_cache(8))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, time.monotonic() - started)
"""


def peak_mb(shards: Path, layers: str) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(shards), layers],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(platformdirs.user_cache_dir("swarmd")),
        help="swarmd's converted-models cache (default: the user cache, as swarmd uses)",
    )
    parser.add_argument(
        "--out", type=Path, help="shard folder, made once (default: a new temporary folder)"
    )
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="swarmd-shards-")) / "smol3"
    if not (args.out / "manifest.json").exists():
        started = time.monotonic()
        subprocess.run(
            [
                *(sys.executable, "-m", "swarmd", "shard", "smollm2-135m-instruct"),
                *("--stages", "3", "--out", str(args.out), "--cache-dir", str(args.cache_dir)),
            ],
            check=True,
        )
        print(f"sharded in {time.monotonic() - started:.1f} s")
    results: dict[str, float] = {}
    for layers in ("none", "0:10", "10:20", "20:30", "0:30"):
        runs = [peak_mb(args.out, layers) for _ in range(args.runs)]
        peak = min(r[0] for r in runs)
        load_s = min(r[1] for r in runs)
        results[layers] = peak
        print(f"layers {layers:>5}: peak RSS {peak:7.1f} MB, load {load_s:.2f} s")
    floor = results["none"]
    print(
        "RESULT "
        + " ".join(f"l{k.replace(':', '_')}_mb={v:.1f}" for k, v in results.items() if k != "none")
        + f" floor_mb={floor:.1f}"
    )


if __name__ == "__main__":
    main()
