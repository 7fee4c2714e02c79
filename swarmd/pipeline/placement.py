"""Layer placement for `--layers auto`: which layer range a joining node should serve.

Pure: no I/O, no torch. The caller reads what the swarm holds from the DHT and what each
layer weighs from the model, and logs `Placement.reason`.

The algorithm, in three steps:

1. **Target.** Count the holders of every layer (`coverage`). If some layers are served
   by nobody, the target is the largest such gap (`gaps`): by layer count, then by bytes,
   then the lowest start. A first node sees the whole model as one gap. If every layer is
   served, the target is the longest run with the fewest holders, so that redundancy
   goes where a single departure would hurt most.
2. **Size.** If the target fits the memory budget, take all of it. If not, the target has
   to be shared by several nodes; assume they have budgets like this one and find the
   smallest number of parts n for which an even split (`split_largest_remainder` with
   equal weights) puts every part within the budget. Layers differ in bytes (layer 0
   carries the embeddings, the last the LM head), so the byte lower bound for n is only
   where the search starts.
3. **Take the first part.** Nodes join one at a time and each one only sees what is
   already served. Taking the part at the start of the target leaves the rest as one
   contiguous gap, which the next node (seeing it as the largest gap) splits the same way
   and continues from. Taking a middle part would cut the gap in two and the swarm would
   end up with fragments smaller than a budget, that is, with more nodes than needed.

A layer that alone exceeds the budget cannot be served here: if it is the first layer of
the target, that is a `ConfigError`; if it comes later, the target is cut just before it
and a node with a larger budget has to bring that layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from swarmd.errors import ConfigError
from swarmd.model.layers import LayerRange


@dataclass(frozen=True)
class Placement:
    layers: LayerRange
    reason: str  # one human sentence for the log: what was chosen and why


def coverage(num_layers: int, held: Iterable[LayerRange]) -> list[int]:
    """How many holders serve each layer; ranges are clipped to [0, num_layers)."""
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    counts = [0] * num_layers
    for span in held:
        for i in range(max(span.start, 0), min(span.end, num_layers)):
            counts[i] += 1
    return counts


def gaps(counts: Sequence[int]) -> list[LayerRange]:
    """The maximal runs of layers that nobody serves, in order."""
    return _runs(counts, 0)


def split_largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """Apportion `total` integer units over `weights` by the largest-remainder method.

    Each share gets the floor of its quota total*w/sum(w); the units left over go one each
    to the largest fractional parts, ties to the lower index. The sum is always `total`.
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if not weights:
        raise ValueError("weights must not be empty")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    # Exact arithmetic: with floats, a quota such as 3.0 can come out as 2.999... and
    # steal a unit from a share whose remainder truly is larger.
    exact = [Fraction(w) for w in weights]
    weight_sum = sum(exact, Fraction(0))
    if weight_sum == 0:
        raise ValueError("weights must not all be zero")
    quotas = [total * w / weight_sum for w in exact]
    shares = [math.floor(q) for q in quotas]
    left = total - sum(shares)
    # sorted() is stable, so equal remainders keep index order: ties go to the lower index.
    by_remainder = sorted(range(len(quotas)), key=lambda i: quotas[i] - shares[i], reverse=True)
    for i in by_remainder[:left]:
        shares[i] += 1
    return shares


def choose_layers(
    num_layers: int,
    layer_bytes: Sequence[int],
    held: Iterable[LayerRange],
    budget_bytes: int,
) -> Placement:
    """Pick the layer range a joining node should serve (see the module docstring).

    `layer_bytes[i]` is what layer i needs, embeddings folded into layer 0 and the final
    norm + LM head into the last layer; `held` are the ranges other nodes already serve.
    Raises ConfigError when the budget cannot hold even the first layer of the target.
    """
    _check_inputs(num_layers, layer_bytes, budget_bytes)
    counts = coverage(num_layers, held)
    target, why_target = _pick_target(counts, layer_bytes)
    usable, why_cut = _cut_before_heavy_layer(target, layer_bytes, budget_bytes)
    sizes = _split_to_fit(usable, layer_bytes, budget_bytes)
    chosen = LayerRange(usable.start, usable.start + sizes[0])

    budget = f"a budget of {_format_bytes(budget_bytes)}"
    if len(sizes) == 1:
        how = f"{budget} holds all of it"
    else:
        parts = "+".join(str(s) for s in sizes)
        how = (
            f"{budget} does not hold it, so it is split over {len(sizes)} budgets like this"
            f" one (largest remainder: {parts} layers); taking the first part, layers"
            f" {chosen} ({_format_bytes(_bytes_of(chosen, layer_bytes))})"
        )
    return Placement(chosen, "; ".join([why_target, *why_cut, how]))


def _format_bytes(n: int) -> str:
    """Decimal units, one decimal: 57.2 MB, 3.0 GB; plain bytes below 1 kB."""
    if n < 1000:
        return f"{n} B"
    value, units = n / 1000, ["kB", "MB", "GB", "TB"]
    # 999.95 and up would print as "1000.0": move to the next unit instead.
    while value >= 999.95 and len(units) > 1:
        value /= 1000
        units.pop(0)
    return f"{value:.1f} {units[0]}"


def _check_inputs(num_layers: int, layer_bytes: Sequence[int], budget_bytes: int) -> None:
    # ValueError, not ConfigError: these come from the caller's code, not from the user.
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if len(layer_bytes) != num_layers:
        raise ValueError(f"layer_bytes has {len(layer_bytes)} entries for {num_layers} layers")
    if any(b < 0 for b in layer_bytes):
        raise ValueError("layer_bytes must all be >= 0")
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")


def _runs(counts: Sequence[int], value: int) -> list[LayerRange]:
    """The maximal runs of layers whose count equals `value`, in order."""
    runs: list[LayerRange] = []
    start: int | None = None
    for i, c in enumerate([*counts, None]):  # the sentinel closes a run at the end
        if c == value and start is None:
            start = i
        elif c != value and start is not None:
            runs.append(LayerRange(start, i))
            start = None
    return runs


def _bytes_of(span: LayerRange, layer_bytes: Sequence[int]) -> int:
    return sum(layer_bytes[span.start : span.end])


def _pick_target(counts: Sequence[int], layer_bytes: Sequence[int]) -> tuple[LayerRange, str]:
    """The range to serve before sizing, and the clause of the reason that explains it."""
    holes = gaps(counts)
    if holes:
        # Largest first; among equals the heavier one (it needs more of the swarm's
        # memory, so it is the harder to fill later), then the lowest start.
        target = min(holes, key=lambda g: (-g.size, -_bytes_of(g, layer_bytes), g.start))
        size = f"{target.size} layers, {_format_bytes(_bytes_of(target, layer_bytes))}"
        if target.size == len(counts):
            return target, f"no node serves any of the model's layers 0:{len(counts)} ({size})"
        which = "the only gap" if len(holes) == 1 else f"the largest of {len(holes)} gaps"
        return target, f"layers {target} are served by nobody ({which}, {size})"

    fewest = min(counts)
    target = min(_runs(counts, fewest), key=lambda r: (-r.size, r.start))
    size = f"{target.size} layers, {_format_bytes(_bytes_of(target, layer_bytes))}"
    return target, (
        f"every layer is served; layers {target} have the fewest holders ({fewest}), {size}"
    )


def _cut_before_heavy_layer(
    target: LayerRange, layer_bytes: Sequence[int], budget_bytes: int
) -> tuple[LayerRange, list[str]]:
    """The target up to its first layer that alone exceeds the budget.

    No split over budgets like this one can serve such a layer, so this node places what
    comes before it and leaves that layer to a node with more memory.
    """
    heavy = next(
        (i for i in range(target.start, target.end) if layer_bytes[i] > budget_bytes), None
    )
    if heavy is None:
        return target, []
    need, budget = _format_bytes(layer_bytes[heavy]), _format_bytes(budget_bytes)
    if heavy == target.start:
        raise ConfigError(
            f"Layer {heavy} alone needs {need}, more than this node's memory budget of"
            f" {budget}: it cannot serve any of layers {target}. Give it more memory, or"
            " serve a smaller or more quantized model"
        )
    usable = LayerRange(target.start, heavy)
    return usable, [
        f"layer {heavy} alone needs {need}, more than the budget, so only layers {usable} are"
        f" considered ({usable.size} layers, {_format_bytes(_bytes_of(usable, layer_bytes))})"
    ]


def _split_to_fit(span: LayerRange, layer_bytes: Sequence[int], budget_bytes: int) -> list[int]:
    """Layer counts of the fewest even parts of `span` that each fit the budget.

    Every layer of `span` fits on its own (see _cut_before_heavy_layer), so one layer per
    part always works and the search ends.
    """
    # No fewer parts than the bytes require; more may be needed when the heavy layers
    # bunch up in one part.
    start_n = max(1, -(-_bytes_of(span, layer_bytes) // budget_bytes))  # ceil, in integers
    for n in range(start_n, span.size + 1):
        sizes = split_largest_remainder(span.size, [1.0] * n)
        if _parts_fit(span.start, sizes, layer_bytes, budget_bytes):
            return sizes
    raise AssertionError(f"unreachable: one layer per part fits ({span}, {budget_bytes} B)")


def _parts_fit(start: int, sizes: Sequence[int], layer_bytes: Sequence[int], budget: int) -> bool:
    for size in sizes:
        if sum(layer_bytes[start : start + size]) > budget:
            return False
        start += size
    return True
