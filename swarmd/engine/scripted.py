"""`DecodeLoop`: the layer loop of a decode forward (every row one token) as TorchScript.

Why: a decode step of a small model is mostly per-op overhead, not arithmetic. A layer
runs about 40 ops (norms, casts, rotary, cache writes, views, attention, four matmuls);
from Python each costs 3-5 us of interpreter and dispatch before its kernel starts. The
same ops run by TorchScript's interpreter cost about a third of that: the embedded model's
30 layers went from 15.0 to 11.1 ms a token (2 threads, medians of 600 interleaved calls;
README "Speed"). It runs the very aten ops `LeanStage._layer` runs, in the same order, on
the same inputs, so its outputs and caches are bit for bit eager's (tests compare them for
every family and weight format).

The graph executor's optimizations are switched off for each call: no fusion, no shape
specialization, no profiling runs, so a step never takes another kernel than eager's and
the first calls are as fast as the rest.

`torch.jit.script` is deprecated in torch 2.x (still in 2.13 and 2.14, the versions this
project allows): should scripting fail, `DecodeLoop.build` returns None and the stage runs
its eager loop.

Only the layers run here; embeddings, the head and prompt chunks (which build masks) stay
in `stage.py`.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from swarmd.dtypes import INT4_GROUP
from swarmd.engine import native
from swarmd.engine.attention import BLOCK, MIN_ROWS, attend_rows
from swarmd.engine.linear import Blocks, Dense, Int4, Int4Dot, Int8, Int8Dot, Matrix, Projection

if TYPE_CHECKING:
    from swarmd.engine.arch import ArchSpec
    from swarmd.engine.kv import KVCache
    from swarmd.engine.stage import LayerWeights

log = logging.getLogger(__name__)

# `_matmul` spells them as literals: TorchScript reads no globals
_DENSE, _INT8, _INT4, _INT4_DOT, _INT8_DOT, _BLOCKS = 0, 1, 2, 3, 4, 5
if (BLOCK, MIN_ROWS) != (64, 4):  # `_decode_layers` spells them as literals too
    raise ImportError("scripted.py's attention literals differ from attention.py's")
_NONE = torch.empty(0)  # "absent" for an optional tensor (a real one is never empty)

# One matrix: (kind, weight or values or packed, scale (empty for dense), bias or _NONE,
# filler rows for a short input (dense) or the zeros (Int4Dot), an int: the fewest rows a
# dense kernel takes, int4's group size, or the block kernel's qtype code)
MatrixArgs = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]


def _matmul(m: MatrixArgs, x: torch.Tensor) -> torch.Tensor:
    """`linear.Dense`, `Int8`, `Int4`, `Int4Dot`, `Int8Dot` and `Blocks` `__call__`, op
    for op."""
    kind, a, b, bias, filler, n = m
    if kind != 0:  # quantized: the kernel's product, then the bias
        if kind == 5:  # _BLOCKS
            out = torch.ops.swarmd_blocks.q_mm(x, a, n)
        elif kind == 3:  # _INT4_DOT
            out = torch.ops.swarmd.int4_bf16_mm(x, a, b, filler)
        elif kind == 4:  # _INT8_DOT
            out = torch.ops.swarmd.int8_bf16_mm(x, a, b)
        elif kind == 2:  # _INT4
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, a, n, b)
        else:  # _INT8
            out = torch.ops.aten._weight_int8pack_mm(x, a, b)
        return out if bias.numel() == 0 else out.add_(bias)
    cast = x.dtype != a.dtype
    y = x.to(a.dtype) if cast else x
    rows = y.shape[0]
    b_opt = None if bias.numel() == 0 else bias
    if rows >= n:
        out = F.linear(y, a, b_opt)
    else:
        padded = torch.cat([y, filler.narrow(0, 0, n - rows)])
        out = F.linear(padded, a, b_opt).narrow(0, 0, rows)
    return out.to(x.dtype) if cast else out


def _project(
    groups: list[MatrixArgs],
    x: torch.Tensor,
    out_dtype: Optional[torch.dtype],  # noqa: UP045
) -> torch.Tensor:
    """`Projection.__call__` with every output side by side ([M, sum of N]); `out_dtype`
    None keeps each group's own dtype."""
    outs: list[torch.Tensor] = []
    for m in groups:
        out = _matmul(m, x)
        if out_dtype is not None and out.dtype != out_dtype:
            out = out.to(out_dtype)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def _attend_group(
    layer: torch.Tensor,  # a page's layer [2, slots, kv, cap, D]
    span: list[int],  # [lowest slot, slots to the highest, width, ...]
    fresh: torch.Tensor,  # [2, rows, kv, D]: the rows' new keys and values
    scaled: torch.Tensor,  # [slots, kv, 4, D]: each slot's scaled queries (zeros: no row)
    writes: torch.Tensor,  # where `fresh` goes in `layer` flat
    mask: torch.Tensor,  # [slots, 1, width]
) -> torch.Tensor:
    """The attention of a group of rows (`one_query` of each): [slots, kv, 4, D]."""
    lo, count, width = span[0], span[1], span[2]
    kv_heads, head_dim = layer.shape[2], layer.shape[4]
    layer.view(-1, head_dim).index_copy_(0, writes, fresh.reshape(-1, head_dim))
    keys = layer[0].narrow(0, lo, count).narrow(2, 0, width)
    values = layer[1].narrow(0, lo, count).narrow(2, 0, width)
    keys = keys.reshape(count * kv_heads, width, head_dim)
    values = values.reshape(count * kv_heads, width, head_dim)
    scores = torch.bmm(scaled.reshape(count * kv_heads, -1, head_dim), keys.transpose(1, 2))
    scores.view(count, -1, width).masked_fill_(mask, float("-inf"))
    got = torch.bmm(torch.softmax(scores, dim=-1), values)
    return got.view(count, kv_heads, -1, head_dim)


def _scaled(q: torch.Tensor, kv_heads: int, group: int, scale: float) -> torch.Tensor:
    """q [B, 1, heads, D] -> [B, kv, R, D]: `attention.scaled_heads` of each row (its heads
    sharing a KV head padded to attention.MIN_ROWS rows), the shapes `one_query` uses, so
    the same bits."""
    scaled = q.reshape(q.shape[0], kv_heads, group, q.shape[-1]) * scale
    if group < 4:  # attention.MIN_ROWS
        scaled = F.pad(scaled, [0, 0, 0, 4 - group])
    return scaled


def _decode_layers(
    x: torch.Tensor,  # [B, H] float32: each row's one token
    norms: list[list[torch.Tensor]],  # per layer: attn, mlp, q, k, post-attn, post-mlp
    mats: list[list[MatrixArgs]],  # per layer: qkv groups, o, gate/up groups, down
    counts: list[list[int]],  # per layer: qkv groups, gate/up groups, kind index, gate size
    cos: list[torch.Tensor],  # per kind: [B, 1, 1, D]
    sin: list[torch.Tensor],
    caches: list[torch.Tensor],  # per row: its KV slot [layers, 2, 1, kv, cap, D]
    starts: list[int],  # per row: the position its token takes
    firsts: list[list[int]],  # per row, per kind: the first position it sees
    pooled: list[bool],  # per kind: every row sees its cache from the start
    pages: list[torch.Tensor],  # per group of rows (a page, a span): its page
    # [layers, 2, slots, kv, cap, D]
    # per group: [lowest slot of its rows, slots to the highest, width, its first row,
    # its rows] (its rows are consecutive, in slot order: `_Pages.order`)
    spans: list[list[int]],
    offsets: list[torch.Tensor],  # per group: each of those rows' slot less the lowest
    writes: list[torch.Tensor],  # per group: where its rows' keys, then values, go in a layer
    masks: list[torch.Tensor],  # per group: [slots, 1, width], True past each row's position
    native_attend: bool,  # attention on attend.cpp (every row; `pooled` and groups unused)
    mm: torch.dtype,  # the matrices' activation dtype
    act: torch.dtype,  # the residual stream's
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
    gelu: bool,
) -> torch.Tensor:
    batch = x.shape[0]
    hidden = x.shape[1]
    q_size = heads * head_dim
    kv_size = kv_heads * head_dim
    group = heads // kv_heads
    # Per row, per layer: keys [kv, cap, D], the same transposed [kv, D, cap], values
    # (only for kinds some row sees through a window: those attend row by row).
    keys_of: list[list[torch.Tensor]] = []
    keys_t_of: list[list[torch.Tensor]] = []
    values_of: list[list[torch.Tensor]] = []
    # for attend: each row's own cache, and the positions it sees on each kind of layer
    rows = list(range(batch))
    his = [start + 1 for start in starts]
    los = [[row[kind] for row in firsts] for kind in range(len(cos))]
    if not native_attend and not all(pooled):
        for r in range(batch):
            buffer = caches[r].select(2, 0)  # [layers, 2, kv, cap, D]
            keys_all = buffer.select(1, 0)
            keys_of.append(keys_all.unbind(0))
            keys_t_of.append(keys_all.transpose(2, 3).unbind(0))
            values_of.append(buffer.select(1, 1).unbind(0))
    for i in range(len(mats)):
        norm = norms[i]
        mat = mats[i]
        nq = counts[i][0]
        ng = counts[i][1]
        kind = counts[i][2]
        h = F.rms_norm(x, [hidden], norm[0], eps).to(mm)
        qkv = _project(mat[0:nq], h, act)
        if nq == 1 and norm[2].numel() == 0:  # eager's fused path: q and k rotated at once
            qk = qkv[:, : q_size + kv_size].view(batch, 1, heads + kv_heads, head_dim)
            qk = _rotate(qk, cos[kind], sin[kind])
            q = qk[:, :, :heads]
            k = qk[:, :, heads:]
        else:
            q = qkv[:, :q_size].view(batch, 1, heads, head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(batch, 1, kv_heads, head_dim)
            if norm[2].numel() != 0 and norm[3].numel() != 0:
                q = F.rms_norm(q, [head_dim], norm[2], eps)
                k = F.rms_norm(k, [head_dim], norm[3], eps)
            q = _rotate(q, cos[kind], sin[kind])
            k = _rotate(k, cos[kind], sin[kind])
        v = qkv[:, q_size + kv_size :].reshape(batch, 1, kv_heads, head_dim)
        if native_attend:  # each row over its own cache, its key and value written first
            fresh = torch.stack([k, v]).view(2, batch, kv_heads, head_dim)
            q_rows = q.reshape(batch, heads, head_dim)
            got = torch.ops.swarmd.attend(q_rows, fresh, caches, i, rows, los[kind], his, scale)
            attn = got.view(batch, heads * head_dim)
        elif pooled[kind]:
            # The rows of a page that read the same span are one matmul over the page's
            # slots from the lowest to the highest of them (a slot between them that is
            # not in this step, or reads another span, computes what nobody reads).
            # The rows come grouped (`_Pages.order`): a group is rows [first, first + n).
            fresh = torch.stack([k, v]).view(2, batch, kv_heads, head_dim)
            scaled = _scaled(q, kv_heads, group, scale)
            outs4: list[torch.Tensor] = []
            for g in range(len(pages)):
                first = spans[g][3]
                n = spans[g][4]
                q_g = scaled.narrow(0, first, n)
                if spans[g][1] != n:  # slots between its rows: zeros stand in for them
                    q_g = torch.zeros(spans[g][1], kv_heads, 4, head_dim, dtype=scaled.dtype)
                    q_g.index_copy_(0, offsets[g], scaled.narrow(0, first, n))
                got = _attend_group(
                    pages[g][i], spans[g], fresh.narrow(1, first, n), q_g, writes[g], masks[g]
                )
                outs4.append(got if spans[g][1] == n else got.index_select(0, offsets[g]))
            attn4 = outs4[0] if len(outs4) == 1 else torch.cat(outs4)
            attn = attn4.narrow(2, 0, group).reshape(batch, heads * head_dim)
        else:
            scaled_rows = _scaled(q, kv_heads, group, scale).unbind(0)
            k_rows = k.transpose(1, 2).unbind(0)  # [kv, 1, D] each
            v_rows = v.transpose(1, 2).unbind(0)
            outs: list[torch.Tensor] = []
            for r in range(batch):
                start = starts[r]
                lo = firsts[r][kind]
                keys = keys_of[r][i]
                values = values_of[r][i]
                keys.narrow(1, start, 1).copy_(k_rows[r])
                values.narrow(1, start, 1).copy_(v_rows[r])
                first = lo // 64 * 64  # attention.span
                width = (start + 1 - first + 63) // 64 * 64
                got = attend_rows(
                    scaled_rows[r],
                    keys_t_of[r][i].narrow(2, first, width),
                    values.narrow(1, first, width),
                    lo - first,
                    start + 1 - first,
                )
                outs.append(got.narrow(1, 0, group))
            attn = torch.stack(outs).view(batch, heads * head_dim)
        out = _matmul(mat[nq], attn.to(mm))
        if norm[4].numel() != 0:
            out = F.rms_norm(out.to(act), [hidden], norm[4], eps)
        x = x + out
        h = F.rms_norm(x, [hidden], norm[1], eps).to(mm)
        gate_up = _project(mat[nq + 1 : nq + 1 + ng], h, None)
        size = counts[i][3]
        gate = gate_up[:, :size]
        up = gate_up[:, size:]
        a = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        down = _matmul(mat[nq + 1 + ng], a * up)
        if norm[5].numel() != 0:
            down = F.rms_norm(down.to(act), [hidden], norm[5], eps)
        x = x + down
    return x


_scripted: torch.jit.ScriptFunction | None = None
_script_failed = False


def _script() -> torch.jit.ScriptFunction | None:
    """The scripted loop, built once per process (about a second); None if it cannot be."""
    global _scripted, _script_failed
    if _scripted is None and not _script_failed:
        native.ops()  # settles which kernels run, and registers the ops' names
        native.blocks_op()
        try:
            with warnings.catch_warnings():
                # Deprecated, not gone (module docstring): the warning says nothing here.
                warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated")
                _scripted = torch.jit.script(_decode_layers)
        except Exception as exc:  # any failure of TorchScript: the eager loop serves
            _script_failed = True
            log.warning("TorchScript is unavailable (%s): decode steps run eagerly", exc)
    return _scripted


def _matrix_args(m: Matrix) -> MatrixArgs | None:
    if isinstance(m, Blocks):
        return (_BLOCKS, m.data, _NONE, _NONE if m.bias is None else m.bias, _NONE, m.code)
    if isinstance(m, Int4):
        bias = _NONE if m.bias is None else m.bias
        return (_INT4, m.packed, m.scale_zero, bias, _NONE, INT4_GROUP)
    if isinstance(m, Int4Dot):
        bias = _NONE if m.bias is None else m.bias
        return (_INT4_DOT, m.packed, m.scale, bias, m.zero, INT4_GROUP)
    if isinstance(m, Int8Dot):
        return (_INT8_DOT, m.packed, m.scale, _NONE if m.bias is None else m.bias, _NONE, 1)
    if isinstance(m, Int8):
        return (_INT8, m.values, m.scale, _NONE if m.bias is None else m.bias, _NONE, 1)
    if isinstance(m, Dense):
        bias = _NONE if m.bias is None else m.bias
        return (_DENSE, m.weight, _NONE, bias, m._filler, m.min_rows)
    return None  # a matrix of another kind: the eager loop runs it


def _groups(projection: Projection) -> list[MatrixArgs] | None:
    out = [_matrix_args(m) for m, _ in projection.groups]
    return None if any(a is None for a in out) else [a for a in out if a is not None]


class DecodeLoop:
    """The scripted loop bound to one stage's layers (it holds references, no copies)."""

    def __init__(
        self,
        fn: torch.jit.ScriptFunction,
        norms: list[list[torch.Tensor]],
        mats: list[list[MatrixArgs]],
        counts: list[list[int]],
        shape: tuple[int, int, int, float, float, bool],
        mm: torch.dtype,
        act: torch.dtype,
        native_attend: bool = False,
    ) -> None:
        self._fn = fn
        self._native_attend = native_attend
        self._norms = norms
        self._mats = mats
        self._counts = counts
        self._shape = shape  # heads, kv heads, head dim, eps, attention scale, GeGLU
        self._mm = mm
        self._act = act

    @classmethod
    def build(
        cls,
        blocks: list[LayerWeights],
        kinds: list[str],
        spec: ArchSpec,
        mm: torch.dtype,
        act: torch.dtype,
        native_attend: bool = False,
    ) -> DecodeLoop | None:
        """The loop for these layers; None where a layer holds what it does not run.
        `native_attend`: attention on attend.cpp (as the stage's other forwards)."""
        fn = _script()
        if fn is None:
            return None
        norms, mats, counts = [], [], []
        for block in blocks:
            qkv, gate_up = _groups(block.qkv), _groups(block.gate_up)
            o, down = _groups(block.o), _groups(block.down)
            if qkv is None or gate_up is None or o is None or down is None:
                return None
            optional = (block.q_norm, block.k_norm, block.post_attn_norm, block.post_mlp_norm)
            norms.append([block.attn_norm, block.mlp_norm, *(_or_none(t) for t in optional)])
            mats.append([*qkv, o[0], *gate_up, down[0]])
            gate_size = block.gate_up.sizes[0]
            counts.append([len(qkv), len(gate_up), kinds.index(block.kind), gate_size])
        gelu = spec.activation != "silu"
        shape = (spec.heads, spec.kv_heads, spec.head_dim, spec.eps, spec.attn_scale, gelu)
        return cls(fn, norms, mats, counts, shape, mm, act, native_attend)

    def __call__(
        self,
        x: torch.Tensor,  # [B, H]
        cos: list[torch.Tensor],  # per kind (the order `build` was given): [B, 1, 1, D]
        sin: list[torch.Tensor],
        caches: list[KVCache],  # per row
        starts: list[int],
        firsts: list[list[int]],  # per row, per kind
    ) -> torch.Tensor:
        kv_heads = self._shape[1]
        # One row alone takes the row-by-row ops: fewer of them (the same bits).
        several = len(caches) > 1
        pooled = [
            several and not self._native_attend and all(row[kind] == 0 for row in firsts)
            for kind in range(len(cos))
        ]
        pages = _Pages(caches, starts, kv_heads) if any(pooled) else _Pages([], [], kv_heads)
        order = pages.order
        index = None
        if order is not None:  # each group's rows side by side (a row's bits never move)
            index = torch.tensor(order)
            x = x.index_select(0, index)
            cos = [c.index_select(0, index) for c in cos]
            sin = [s.index_select(0, index) for s in sin]
            caches = [caches[r] for r in order]
            starts = [starts[r] for r in order]
            firsts = [firsts[r] for r in order]
        out = self._layers(x, cos, sin, caches, starts, firsts, pooled, pages)
        return out if index is None else out.index_select(0, index.argsort())

    def _layers(
        self,
        x: torch.Tensor,
        cos: list[torch.Tensor],
        sin: list[torch.Tensor],
        caches: list[KVCache],
        starts: list[int],
        firsts: list[list[int]],
        pooled: list[bool],
        pages: _Pages,
    ) -> torch.Tensor:
        heads, kv_heads, head_dim, eps, scale, gelu = self._shape
        with torch.jit.optimized_execution(False):
            return self._fn(
                x,
                self._norms,
                self._mats,
                self._counts,
                cos,
                sin,
                [c.buffer for c in caches],
                starts,
                firsts,
                pooled,
                pages.tensors,
                pages.spans,
                pages.offsets,
                pages.writes,
                pages.masks,
                self._native_attend,
                self._mm,
                self._act,
                heads,
                kv_heads,
                head_dim,
                eps,
                scale,
                gelu,
            )


class _Pages:
    """The rows of a decode step by the KV page their caches sit in and the span they
    read (`attention.span` from position 0): what `_decode_layers` needs to attend each
    group's rows as one matmul per layer. `order`: the rows grouped, each group in slot
    order (None: as they came); the groups' fields follow it."""

    def __init__(self, caches: list[KVCache], starts: list[int], kv_heads: int) -> None:
        groups: dict[tuple[int, int], list[int]] = {}
        for r, cache in enumerate(caches):
            width = -(-(starts[r] + 1) // BLOCK) * BLOCK
            groups.setdefault((id(cache.page), width), []).append(r)
        order = [r for rows in groups.values() for r in sorted(rows, key=lambda r: caches[r].slot)]
        self.order = None if order == list(range(len(caches))) else order
        self.tensors: list[torch.Tensor] = []
        self.spans: list[list[int]] = []
        self.offsets: list[torch.Tensor] = []
        self.writes: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        first = 0
        for (_, width), unsorted in groups.items():
            rows = sorted(unsorted, key=lambda r: caches[r].slot)
            page = caches[rows[0]].page
            assert page is not None  # (a step reserves its cache first)
            slots = torch.tensor([caches[r].slot for r in rows])
            lo = int(slots[0])
            count = int(slots[-1]) - lo + 1
            _, _, total, _, capacity, _ = page.tensor.shape
            at = torch.tensor([starts[r] for r in rows])
            ends = torch.full((count,), width)  # a slot not in this group: no mask
            ends[slots - lo] = at + 1
            # A layer's [2, slots, kv, cap, D] flat: keys then values of each row's heads.
            heads = torch.arange(kv_heads)
            base = ((slots[:, None] * kv_heads + heads) * capacity + at[:, None]).flatten()
            self.tensors.append(page.tensor)
            self.spans.append([lo, count, width, first, len(rows)])
            self.offsets.append(slots - lo)
            self.writes.append(torch.cat([base, base + total * kv_heads * capacity]))
            self.masks.append((torch.arange(width) >= ends[:, None])[:, None, :])
            first += len(rows)


def _or_none(t: torch.Tensor | None) -> torch.Tensor:
    return _NONE if t is None else t
