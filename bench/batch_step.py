"""What a batched decode step costs inside one stage: the ceiling of batching on this machine.

`bench/concurrency.py` times streams through the HTTP API. This one times the engine alone,
in one process: the embedded model (or `--model`) with B sessions, each holding a
`--context`-token prompt, and B one-token greedy steps run as one batch
(`StageRuntime.step_many`, what the torch worker runs); the contexts grow by a token a
step, alike at every level. For each B it also times, with
inputs of B rows, the two parts of a step whose cost batching does not divide:

- matrices: every layer matrix of the stage (q/k/v, o, gate/up, down) called once;
- head: the output matrix over the vocabulary;

and gives the rest (attention over each row's cache, norms, rotary, sampling, per-op
overhead) as the difference. The levels run in turns (`--rounds`), so a slow minute of a
shared box lands on all of them. Ends with

    RESULT step1_ms=<ms> step8_ms=<ms> ceiling8=<r> matrices8_over_1=<r> head8_over_1=<r>

ceiling8 = 8 * step1 / step8: the tokens per second of 8 sessions over one's if nothing but
the forward cost anything, an upper bound on `concurrency.py`'s scaling8 on one node (its
figures add HTTP, tokenizing and the prompts' prefill). matrices8_over_1 and head8_over_1
show where the bound comes from: torch's int4 and int8 CPU kernels work in blocks of 4
rows, so 8 rows cost about twice 4.

With `--spread N` session i's prompt is `--context` + i x N tokens: sessions of mixed
lengths, as real traffic has (they read different spans of keys, so a step attends them
in several groups: engine/kv.py).

Usage: .venv/bin/python bench/batch_step.py [--cache-dir DIR] [--model ID]
       [--levels 1,2,4,8,16] [--context 128] [--spread 0] [--rounds 5] [--steps 20]
       [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import platformdirs
import torch

from swarmd.engine.stage import LeanStage
from swarmd.model.loader import load_model
from swarmd.model.runtime import StageRuntime, StepRequest
from swarmd.model.sampling import SamplingParams
from swarmd.model.source import resolve_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(platformdirs.user_cache_dir("swarmd"))
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--levels", default="1,2,4,8,16")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens a session")
    parser.add_argument(
        "--spread", type=int, default=0, help="tokens more for each next session's prompt"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps a level a round")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def timed(fn: Callable[[], object], count: int) -> list[float]:
    out = []
    for _ in range(count):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


class Level:
    """B sessions on one runtime; every level's contexts grow alike, round by round."""

    def __init__(
        self, stage: LeanStage, batch: int, context: int, grows: int, spread: int = 0
    ) -> None:
        self.batch = batch
        self.ids = [f"b{batch}-{i}" for i in range(batch)]
        self.runtime = StageRuntime(stage, max_sessions=batch)
        generator = torch.Generator().manual_seed(batch)
        for i, sid in enumerate(self.ids):
            length = context + i * spread  # session i: `spread` tokens more than i - 1
            self.runtime.open(sid, length + grows + 1, SamplingParams(temperature=0.0))
            prompt = torch.randint(100, 20000, (1, length), generator=generator)
            self.runtime.step_many([StepRequest(sid, prompt, True)])
        self.step_ms: list[float] = []
        self.matrices_ms: list[float] = []
        self.head_ms: list[float] = []
        hidden = stage.hidden_size
        self._x = torch.randn(batch, hidden).to(stage.dtype)
        self._inner = {
            k: torch.randn(batch, k).to(stage.dtype)
            for k in {stage.spec.heads * stage.spec.head_dim, stage.spec.intermediate}
        }
        self._stage = stage

    def step(self) -> None:
        self.runtime.step_many(
            [StepRequest(sid, torch.tensor([[1000 + i]]), True) for i, sid in enumerate(self.ids)]
        )

    def matrices(self) -> None:
        spec = self._stage.spec
        o_in, down_in = spec.heads * spec.head_dim, spec.intermediate
        for block in self._stage.blocks:
            for projection, x in (
                (block.qkv, self._x),
                (block.o, self._inner[o_in]),
                (block.gate_up, self._x),
                (block.down, self._inner[down_in]),
            ):
                for matrix, _ in projection.groups:
                    matrix(x)

    def head(self) -> None:
        assert self._stage.head is not None
        self._stage.head(self._x)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(v) for v in args.levels.split(",") if v]
    source = resolve_model(args.model, args.cache_dir)
    stage = load_model(source, None).stage
    if not isinstance(stage, LeanStage) or stage.head is None:
        raise SystemExit(f"{args.model} does not load on the swarmd engine")
    print(
        f"{args.model}: {stage.weight_formats} weights, {stage.dtype} activations, "
        f"{args.threads} threads, contexts of {args.context} tokens (+{args.spread} a "
        f"session) growing by {args.rounds * (args.steps + 1)}",
        flush=True,
    )
    grows = args.rounds * (args.steps + 1)
    runs = {b: Level(stage, b, args.context, grows, args.spread) for b in levels}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for level in runs.values():
                level.step()  # warm this level's caches after the others ran
                level.step_ms += timed(level.step, args.steps)
                level.matrices_ms += timed(level.matrices, 3)
                level.head_ms += timed(level.head, 3)
    print(f"{'B':>3} {'step ms':>8} {'per row':>8} {'tok/s':>7} {'matrices':>9} {'head':>6} rest")
    med: dict[int, tuple[float, float, float]] = {}
    for b, level in runs.items():
        step = statistics.median(level.step_ms)
        mats = statistics.median(level.matrices_ms)
        head = statistics.median(level.head_ms)
        med[b] = (step, mats, head)
        rest = step - mats - head
        print(
            f"{b:>3} {step:>8.2f} {step / b:>8.2f} {b * 1000 / step:>7.1f} {mats:>9.2f} "
            f"{head:>6.2f} {rest:.2f}"
        )
    if 1 in med and 8 in med:
        (s1, m1, h1), (s8, m8, h8) = med[1], med[8]
        print(
            f"RESULT step1_ms={s1:.2f} step8_ms={s8:.2f} ceiling8={8 * s1 / s8:.2f} "
            f"matrices8_over_1={m8 / m1:.2f} head8_over_1={h8 / h1:.2f}"
        )


if __name__ == "__main__":
    main()
