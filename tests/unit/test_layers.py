"""The package's imports go one way: each layer uses only the layers below it.

    errors, dtypes, config, untrusted < model (+ engine) < net < dht < pipeline, transfer
        < acquire, api, client, held < node < cli

Imports under `if TYPE_CHECKING:` are annotations, not dependencies, and are not counted;
imports inside functions are (they run).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "swarmd"

RANKS: dict[str, int] = {
    "swarmd": 0,  # the package itself: __version__
    "errors": 0,
    "dtypes": 0,
    "config": 0,
    "untrusted": 0,  # typed readers of what peers send, for every layer's decoders
    "model": 1,
    "engine": 1,  # the model's own kernels: one layer with it
    "net": 2,
    "dht": 3,
    "pipeline": 4,
    "transfer": 4,
    "acquire": 5,
    "api": 5,
    "client": 5,
    "held": 5,  # a model a node holds: the torch side, under the node
    "node": 6,
    "cli": 7,
    "__main__": 7,
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return "swarmd" if len(parts) == 1 else parts[1]


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for sub in ast.walk(child):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_lines(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "swarmd":  # `from swarmd import x`: x may be a subpackage
                found += [(node.lineno, f"swarmd.{alias.name}") for alias in node.names]
            elif node.module.startswith("swarmd."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("swarmd.")]
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_module_has_a_layer() -> None:
    for path in PACKAGE.rglob("*.py"):
        assert layer_of(module_name(path)) in RANKS, path


def test_imports_only_go_down() -> None:
    upward: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = layer_of(module_name(path))
        for line, target in imports_of(path):
            there = layer_of(target)
            if there in RANKS and RANKS[there] > RANKS[here]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here}) -> {target}")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "from swarmd.node import Node\n"
        "if TYPE_CHECKING:\n"
        "    from swarmd.cli import app\n"
        "def f():\n"
        "    import swarmd.api.app\n"
    )
    assert imports_of(sample) == [(2, "swarmd.node"), (6, "swarmd.api.app")]
