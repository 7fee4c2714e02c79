"""Grammar libraries for constrained decoding, measured on this CPU: llguidance and xgrammar.

For each library, with the embedded SmolLM2 tokenizer (its `tokenizer.json`, read with the
`tokenizers` library as swarmd does; no transformers tokenizer):

- import: the seconds and resident memory `import <library>` adds (a fresh interpreter);
- tokenizer: the seconds to build the library's tokenizer info from the tokenizer;
- compile: the milliseconds to compile each schema below (plus json_object and one
  Hermes-style tool call grammar) into a ready matcher, and the first mask after it
  (llguidance builds its lexer lazily, so part of its work lands there);
- per token: over a generation of up to `--tokens` tokens per grammar from seeded random
  logits, the time to fill the bitmask, to apply it to a [V] float32 logits tensor (one
  shared unpack for both, so the libraries' own kernels do not differ), and to accept the
  drawn token: mean and p99 in microseconds.

Both libraries get the same JSON layout: compact with `", "` and `": "` separators, no
free whitespace. Ends with

    RESULT llg_mask_mean_us=<f> llg_mask_p99_us=<f> xgr_mask_mean_us=<f> xgr_mask_p99_us=<f>
           llg_compile_ms=<median> xgr_compile_ms=<median>

(one line). Takes well under 3 minutes.

Usage: .venv/bin/python bench/grammar_libs.py [--cache-dir DIR] [--tokens 200]
       [--libs llguidance,xgrammar] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import platformdirs
import torch
from tokenizers import Tokenizer

SEPARATORS = (", ", ": ")

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "member"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 20},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["id", "address"],
            }
        },
        "required": ["user"],
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "level": {"enum": [1, 2, 3, None]},
        },
        "required": ["color", "size", "level"],
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["lat", "lon", "score"],
    },
    "optional_keys": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 16},
            "subtitle": {"type": "string", "maxLength": 16},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["title"],
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            "date": {"type": "string", "format": "date"},
        },
        "required": ["code", "hex", "date"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 6},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    "any_of_refs": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "properties": {
            "shape": {"enum": ["circle", "segment"]},
            "at": {"$ref": "#/$defs/point"},
            "radius": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}]},
        },
        "required": ["shape", "at", "radius"],
    },
    "wide": {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": ["string", "integer", "boolean"], "maxLength": 6}
            for i in range(12)
        },
        "required": [f"field_{i}" for i in range(12)],
    },
}

TOOL = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}


def closed(schema: Any) -> Any:
    """additionalProperties: false wherever an object lists properties (as swarmd does)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass
class Timings:
    tokenizer_s: float = 0.0
    compile_ms: dict[str, float] = field(default_factory=dict)
    first_mask_ms: dict[str, float] = field(default_factory=dict)
    fill_us: list[float] = field(default_factory=list)
    apply_us: list[float] = field(default_factory=list)
    accept_us: list[float] = field(default_factory=list)
    total_us: list[float] = field(default_factory=list)
    warm_total_us: list[float] = field(default_factory=list)  # a grammar used before
    tokens: dict[str, int] = field(default_factory=dict)
    finished: dict[str, bool] = field(default_factory=dict)


# Row b: the logits bias of the 8 tokens whose bits are byte b (as swarmd/model/grammar.py).
BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0.0),
    np.float32(-np.inf),
).astype(np.float32)


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor, width: int) -> torch.Tensor:
    """logits: [V] float32; words: [ceil(N/32)] int32, bit i%32 of word i//32 = token i."""
    raw = words.numpy().astype("<i4", copy=False).view(np.uint8)
    return logits + torch.from_numpy(np.take(BYTE_BIAS, raw, axis=0).reshape(-1)[:width])


def draw(logits: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


class Library:
    name = ""

    def build(self, tokenizer: Tokenizer, width: int, eos: list[int]) -> None: ...
    def compile(self, kind: str, schema: Any) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, words: torch.Tensor) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...
    def done(self, matcher: Any) -> bool: ...


class Llguidance(Library):
    name = "llguidance"

    def build(self, tokenizer: Tokenizer, width: int, eos: list[int]) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=width, eos_token=eos)

    def _options(self, schema: dict[str, Any]) -> dict[str, Any]:
        options = {
            "whitespace_flexible": False,
            "item_separator": SEPARATORS[0],
            "key_separator": SEPARATORS[1],
        }
        return {"x-guidance": options, **schema}

    def compile(self, kind: str, schema: Any) -> Any:
        llm = self.llg.LLMatcher
        if kind == "tool":
            name = json.dumps(json.dumps(TOOL["name"]))[1:-1]
            args = json.dumps(self._options(closed(TOOL["parameters"])))
            lark = (
                "start: call\n"
                f'call: "<tool_call>\\n{{\\"name\\": {name}, \\"arguments\\": " args'
                ' "}\\n</tool_call>"\n'
                f"args: %json {args}\n"
            )
            grammar = llm.grammar_from_lark(lark)
        else:
            grammar = llm.grammar_from_json_schema(self._options(closed(schema)))
        matcher = llm(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, words: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


class Xgrammar(Library):
    name = "xgrammar"

    def build(self, tokenizer: Tokenizer, width: int, eos: list[int]) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo
        meta = info._detect_metadata_from_hf(tokenizer.to_str())
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        encoded = [""] * width
        for token, idx in vocab.items():
            if idx < width:
                encoded[idx] = token
        self.info = info(
            encoded,
            meta["vocab_type"],
            vocab_size=width,
            stop_token_ids=eos,
            add_prefix_space=meta["add_prefix_space"],
        )
        # No compile cache: each grammar is compiled once here anyway.
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, schema: Any) -> Any:
        xgr = self.xgr
        kw = {"any_whitespace": False, "separators": SEPARATORS, "strict_mode": True}
        if kind == "tool":
            st = xgr.StructuralTag.model_validate(
                {
                    "type": "structural_tag",
                    "format": {
                        "type": "tag",
                        "begin": f'<tool_call>\n{{"name": "{TOOL["name"]}", "arguments": ',
                        # Its JSON here has no layout option but a whitespace bound
                        # (unbounded by default: random logits emit blanks forever).
                        "content": {
                            "type": "json_schema",
                            "json_schema": TOOL["parameters"],
                            "max_whitespace_cnt": 1,
                        },
                        "end": "}\n</tool_call>",
                    },
                }
            )
            compiled = self.compiler.compile_structural_tag(st)
        else:
            # strict_mode closes objects as `closed` does for llguidance; json_object's
            # {"type": "object"} stays open (strict would allow only {}).
            kw["strict_mode"] = "properties" in schema
            compiled = self.compiler.compile_json_schema(json.dumps(schema), **kw)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, words: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(words.view(1, -1))

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


def measure(lib: Library, tokenizer: Tokenizer, width: int, eos: list[int], tokens: int) -> Timings:
    t = Timings()
    started = time.perf_counter()
    lib.build(tokenizer, width, eos)
    t.tokenizer_s = time.perf_counter() - started
    grammars: list[tuple[str, str, Any]] = [("json_object", "schema", {"type": "object"})]
    grammars += [(name, "schema", s) for name, s in SCHEMAS.items()]
    grammars.append(("tool_call", "tool", None))
    for name, kind, schema in grammars:
        started = time.perf_counter()
        compiled = lib.compile(kind, schema)
        matcher = lib.matcher(compiled)
        t.compile_ms[name] = (time.perf_counter() - started) * 1e3
        generate(lib, t, name, matcher, width, tokens, seed=1234, warm=False)
        # A second reply under the same compiled grammar (swarmd caches compiled grammars):
        # llguidance builds its lexer lazily, and the copies share what it built.
        generate(lib, t, name, lib.matcher(compiled), width, tokens, seed=4321, warm=True)
    return t


def generate(
    lib: Library,
    t: Timings,
    name: str,
    matcher: Any,
    width: int,
    tokens: int,
    seed: int,
    warm: bool,
) -> None:
    words = torch.zeros((width + 31) // 32, dtype=torch.int32)
    generator = torch.Generator().manual_seed(seed)
    count = 0
    while count < tokens and not lib.done(matcher):
        logits = torch.randn(width, generator=generator)
        a = time.perf_counter()
        lib.fill(matcher, words)
        b = time.perf_counter()
        masked = apply_bitmask(logits, words, width)
        c = time.perf_counter()
        token = draw(masked, generator)
        d = time.perf_counter()
        if not lib.accept(matcher, token):
            raise RuntimeError(f"{lib.name} refused its own token {token} in {name}")
        e = time.perf_counter()
        total = (b - a + c - b + e - d) * 1e6
        if warm:
            t.warm_total_us.append(total)
        elif count == 0:  # reported apart: llguidance builds lazily
            t.first_mask_ms[name] = (b - a) * 1e3
        else:
            t.fill_us.append((b - a) * 1e6)
            t.apply_us.append((c - b) * 1e6)
            t.accept_us.append((e - d) * 1e6)
            t.total_us.append(total)
        count += 1
    if not warm:
        t.tokens[name] = count
        t.finished[name] = lib.done(matcher)


def import_cost(module: str) -> tuple[float, float]:
    """(seconds, MiB of resident memory) that `import module` adds to a fresh interpreter."""
    code = (
        "import time, torch, tokenizers, numpy\n"
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "r0 = rss()\n"
        "t0 = time.perf_counter()\n"
        f"import {module}\n"
        "t1 = time.perf_counter()\n"
        "print(t1 - t0, (rss() - r0) / 2**20)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, mib = out.stdout.split()
    return float(seconds), float(mib)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def report(lib: str, t: Timings, imported: tuple[float, float]) -> dict[str, float]:
    print(f"\n== {lib}")
    print(f"import: {imported[0]:.2f} s, +{imported[1]:.0f} MiB resident")
    print(f"tokenizer info: {t.tokenizer_s:.2f} s")
    print(f"{'grammar':<18}{'compile ms':>12}{'1st mask ms':>13}{'tokens':>8}  finished")
    for name, ms in t.compile_ms.items():
        first = t.first_mask_ms.get(name, 0.0)
        print(f"{name:<18}{ms:>12.2f}{first:>13.2f}{t.tokens[name]:>8}  {t.finished[name]}")
    print(f"per token over {len(t.total_us)} tokens, first reply of each grammar (us): mean / p99")
    for label, values in (
        ("fill bitmask", t.fill_us),
        ("apply to [V]", t.apply_us),
        ("accept", t.accept_us),
        ("total", t.total_us),
        ("total, warm", t.warm_total_us),
    ):
        print(f"  {label:<14}{statistics.fmean(values):>9.1f} {p99(values):>9.1f}")
    print(f"  (warm: a second reply under each grammar, {len(t.warm_total_us)} tokens)")
    return {
        "mask_mean_us": statistics.fmean(t.total_us),
        "mask_p99_us": p99(t.total_us),
        "warm_p99_us": p99(t.warm_total_us),
        "compile_ms": statistics.median(t.compile_ms.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(platformdirs.user_cache_dir("swarmd"))
    )
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--libs", default="llguidance,xgrammar")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (apply, draw)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from swarmd.model.source import EMBEDDED_MODEL_ID, resolve_folder
    from swarmd.model.text import TextCodec

    model_dir = resolve_folder(EMBEDDED_MODEL_ID, args.cache_dir).model_dir
    codec = TextCodec.load(model_dir)
    width = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    eos = sorted(codec.eos_ids)
    print(f"tokenizer {model_dir / 'tokenizer.json'}: logits width {width}, eos {eos}")
    libraries: dict[str, Callable[[], Library]] = {
        "llguidance": Llguidance,
        "xgrammar": Xgrammar,
    }
    short = {"llguidance": "llg", "xgrammar": "xgr"}
    result: list[str] = []
    for name in args.libs.split(","):
        imported = import_cost(name)
        timings = measure(libraries[name](), codec.tokenizer, width, eos, args.tokens)
        figures = report(name, timings, imported)
        result += [f"{short[name]}_{k}={v:.2f}" for k, v in figures.items()]
    print("\nRESULT " + " ".join(result))


if __name__ == "__main__":
    main()
