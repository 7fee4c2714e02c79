"""`LeanStage`: decoder layers [start, end) of a model, run by the engine's own forward.

One forward runs a chunk of tokens of each of several sequences through the stage (decode
steps and prompt chunks of different sessions together): the embeddings on the first
stage, then each layer, then on the last stage the final norm and the head for each row's
last position. The matrices see all rows' tokens at once; attention runs per row over its
own cache, with its own positions, so no row is padded to another's length.

Per layer (Llama family): RMSNorm -> one fused q/k/v matmul -> (Qwen3: q/k norms) ->
rotary from a table on q and k together -> K/V written into the session's buffer ->
attention with grouped-query heads over the cached positions (`attention`: a position
gets the same bits in any chunk, batch or thread count) -> o matmul -> residual;
RMSNorm -> one fused gate/up matmul -> SiLU(gate) * up -> down -> residual. Gemma 3
adds its norms after attention and MLP, (1 + w) norm weights (folded in at load), GeGLU,
a sliding window on most layers and embeddings scaled by sqrt(hidden).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmd.engine import native
from swarmd.engine.arch import SLIDING, ArchSpec
from swarmd.engine.attention import QueryGroup, chunk_queries, one_query, plan_chunk
from swarmd.engine.kv import KVCache, KVPool
from swarmd.engine.linear import Matrix, Projection, quantized_kernel
from swarmd.engine.rope import RopeTable
from swarmd.engine.scripted import DecodeLoop
from swarmd.engine.ties import settle_near_ties
from swarmd.errors import InternalError, ModelLoadError
from swarmd.model.layers import LayerRange
from swarmd.model.rows import Row

ACT = torch.float32  # the residual stream, norms, attention and the KV cache
_EMPTY = torch.empty(0)  # attend's new keys when the cache holds them already


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: Projection  # -> q [M, heads*D], k [M, kv*D], v [M, kv*D]
    o: Projection
    mlp_norm: torch.Tensor  # [H] (Gemma: pre_feedforward_layernorm)
    gate_up: Projection  # -> gate [M, I], up [M, I]
    down: Projection
    kind: str  # FULL or SLIDING
    q_norm: torch.Tensor | None = None  # [D] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [H] (Gemma 3)
    post_mlp_norm: torch.Tensor | None = None


class Embedding:
    """Token ids -> rows in the activations' dtype, from a float table, int8 rows, or rows
    decoded from a GGUF file on demand (`rows`: the table stays in the file)."""

    def __init__(
        self,
        table: torch.Tensor | None,
        scale: torch.Tensor | None,
        multiplier: float,
        rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.table = table  # [V, H] float, or int8 with `scale` [V] (shared with a tied head)
        self.scale = scale  # float32 [V] for an int8 table
        self.multiplier = multiplier  # Gemma: sqrt(hidden)
        self.blocked = False  # the table is a tied Int8Dot head's (native.block_int8 layout)
        self.rows = rows  # ids [...] -> float32 [..., H], read from the file

    def share_blocked(self, blocked: torch.Tensor) -> None:
        """Read rows from a tied head's blocked copy of the int8 table (one copy held)."""
        self.table, self.blocked = blocked, True

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            rows = self.rows(ids).to(ACT)
        elif self.blocked:
            rows = native.int8_rows(self.table, ids).to(ACT)  # [B, T, H]
        else:
            rows = F.embedding(ids, self.table).to(ACT)
        if self.scale is not None:
            rows = rows * self.scale[ids].unsqueeze(-1)
        return rows if self.multiplier == 1.0 else rows * self.multiplier


class LeanStage:
    def __init__(
        self,
        spec: ArchSpec,
        layers: LayerRange,
        dtype: torch.dtype,
        blocks: list[LayerWeights],
        embed: Embedding | None,
        norm: torch.Tensor | None,
        head: Matrix | None,
        ropes: dict[str, RopeTable],
    ) -> None:
        if len(blocks) != layers.size:
            raise ModelLoadError(f"{len(blocks)} layers loaded for range {layers}")
        self.spec = spec
        self.layers_range = layers
        self.num_model_layers = spec.num_layers
        self.hidden_size = spec.hidden
        self.vocab_size = spec.vocab
        self.dtype = dtype
        self.blocks = blocks
        self.embed = embed
        self.norm = norm
        self.head = head
        self.ropes = ropes
        self._q_size = spec.heads * spec.head_dim
        self._kv_size = spec.kv_heads * spec.head_dim
        # Decode forwards (every row one token) run their layers as TorchScript (built on
        # the first); False runs them eagerly, the reference the scripted loop equals.
        self.scripted_decode = True
        self._kinds = list(ropes)
        self._decode_loop: DecodeLoop | None = None
        self._decode_loop_built = False
        # Attention on swarmd's kernel (attend.cpp) where it loaded, for prompt chunks and
        # decode steps alike (a position's bits must not depend on which path computed it),
        # else torch's ops (attention.py).
        self.native_attention = native.attend_fits(spec.head_dim)
        # Every cache of this stage: sessions of one capacity share a page (kv.py).
        self._kv_pool = KVPool(len(blocks), spec.kv_heads, spec.head_dim, ACT)

    @property
    def is_first(self) -> bool:
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        return self.head is not None

    @property
    def weight_formats(self) -> set[str]:
        return {fmt for proj in self._projections() for fmt in proj.formats}

    @property
    def quantized_kernels(self) -> str:
        """Whose kernels the quantized matrices run ("swarmd", "torch", both joined by
        "+"), or "none" where every matrix is a float one."""
        kinds = {kind for proj in self._projections() for kind in proj.kernels}
        if self.head is not None and (kind := quantized_kernel(self.head)):
            kinds.add(kind)
        return "+".join(sorted(kinds)) or "none"

    def _projections(self) -> Iterator[Projection]:
        for block in self.blocks:
            yield from (block.qkv, block.o, block.gate_up, block.down)

    def new_cache(self, max_length: int) -> KVCache:
        spec = self.spec
        blocks = len(self.blocks)
        return KVCache(blocks, spec.kv_heads, spec.head_dim, ACT, max_length, self._kv_pool)

    def fork_cache(self, cache: KVCache, length: int, max_length: int) -> KVCache | None:
        """A copy of `cache`'s first `length` positions for another session."""
        return cache.fork(length, max_length)

    def view(self, layers: LayerRange) -> LeanStage:
        """Layers [start, end) of this stage as a stage of their own, sharing the weights."""
        held = self.layers_range
        if layers == held:
            return self
        lo, hi = layers.offsets_in(held)
        last = layers.is_last(self.num_model_layers)
        view = LeanStage(
            self.spec,
            layers,
            self.dtype,
            self.blocks[lo:hi],
            self.embed if layers.is_first() else None,
            self.norm if last else None,
            self.head if last else None,
            self.ropes,
        )
        view.scripted_decode = self.scripted_decode
        view.native_attention = self.native_attention
        return view

    @torch.inference_mode()
    def forward(
        self,
        inputs: torch.Tensor,
        cache: KVCache,
        all_positions: bool = False,
    ) -> torch.Tensor:
        """Run one chunk of one sequence through this stage (`forward_many` of one row).

        inputs: [1, T] token ids on the first stage, else [1, T, H] hidden states.
        Returns [1, T, H] float32 hidden states, or on the last stage [1, V] float32
        logits of the chunk's final position ([1, T, V] with `all_positions`, for scoring
        a text).
        """
        if int(inputs.shape[0]) != 1:
            raise InternalError("forward() takes one sequence; forward_many() takes several")
        return self.forward_many([Row(inputs, cache)], all_positions)[0]

    __call__ = forward

    @torch.inference_mode()
    def forward_many(self, rows: list[Row], all_positions: bool = False) -> list[torch.Tensor]:
        """Run a chunk of each of several sequences (each with its own cache) as one forward.

        The matrices see every row's tokens at once ([M, H], M the sum of the chunks);
        attention runs per row over that row's own cache, exactly as it would alone. The
        quantized kernels give each row of a matmul the same bits whatever the other rows
        (measured), and so do the bf16 ones, with a lone row run as two where oneDNN
        rounds one row otherwise (`linear.rows_for_one_kernel`); so a batched row is bit
        for bit the row run alone.

        Attention gives each position the bits of a one-token step at that position
        (`attention`), and every other op here gives a row the same bits whatever the
        chunk; so however a sequence is cut into chunks (a prompt, a reply's steps, a
        failover's replay, a reused prefix), each position ends with the same bits.
        """
        parts = [self._begin(row) for row in rows]
        offset = 0
        for part in parts:
            part.offset, offset = offset, offset + part.count
        x = torch.cat([p.hidden for p in parts]) if len(parts) > 1 else parts[0].hidden
        # Every row one token (steady decoding): the rotary rows of all of them at once.
        decodes = None
        one_token = all(p.count == 1 for p in parts)
        if one_token:
            positions = torch.tensor([p.start for p in parts])
            decodes = {
                kind: (
                    table.cos[positions, None, None, :],
                    table.sin_signed[positions, None, None, :],
                )
                for kind, table in self.ropes.items()
            }  # [B, 1, 1, D] each
        loop = self._scripted_loop() if one_token else None
        if loop is not None and decodes is not None:
            x = loop(
                x,
                [decodes[kind][0] for kind in self._kinds],
                [decodes[kind][1] for kind in self._kinds],
                [p.cache for p in parts],
                [p.start for p in parts],
                [[p.step.window_of(kind, p.start)[0] for kind in self._kinds] for p in parts],
            )
        else:
            for index, block in enumerate(self.blocks):
                x = self._layer(block, index, x, parts, decodes)
        for part in parts:
            part.cache.length = part.start + part.count
        if self.head is None or self.norm is None:
            return [x[p.offset : p.offset + p.count].view(1, p.count, -1) for p in parts]
        if all_positions:
            if len(parts) != 1:
                raise InternalError("all_positions scores one sequence")
            return [self._logits(x).view(1, parts[0].count, -1)]
        last = [p.offset + p.count - 1 for p in parts]
        rows_x = x[last[0] : last[0] + 1] if len(last) == 1 else x[torch.tensor(last)]
        logits = self._logits(rows_x.contiguous())  # [B, V]
        return [logits[i : i + 1] for i in range(len(parts))]

    def _scripted_loop(self) -> DecodeLoop | None:
        if not self.scripted_decode:
            return None
        if not self._decode_loop_built:
            self._decode_loop_built = True
            self._decode_loop = DecodeLoop.build(
                self.blocks, self._kinds, self.spec, self.dtype, ACT, self.native_attention
            )
        return self._decode_loop

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        assert self.head is not None and self.norm is not None
        normed = self._rms(rows, self.norm)
        logits = self.head(normed.to(self.dtype)).float()
        settle_near_ties(logits, normed, self.head)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _begin(self, row: Row) -> _Part:
        inputs, cache = row.inputs, row.cache
        if self.embed is not None:
            hidden = self.embed(inputs)
        else:
            hidden = inputs if inputs.dtype == ACT else inputs.to(ACT)
        count = int(hidden.shape[1])
        start = cache.length
        end = start + count
        if end > cache.max_length:
            raise InternalError(f"{end} positions exceed the cache's {cache.max_length}")
        cache.reserve(end)
        return _Part(
            hidden.reshape(count, self.hidden_size),
            cache,
            start,
            count,
            _Step(self.spec, self.ropes, start, count),
        )

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.spec.eps)

    def _layer(
        self,
        block: LayerWeights,
        index: int,
        x: torch.Tensor,  # [M, H] float32, the residual stream of every row
        parts: list[_Part],
        decodes: dict[str, tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> torch.Tensor:
        mm = self.dtype  # what the matrix kernels read
        h = self._rms(x, block.attn_norm).to(mm)
        fused = block.qkv.fused(h, ACT) if block.q_norm is None else None
        if fused is not None:
            q_all = k_all = v_all = fused
        else:
            q_all, k_all, v_all = block.qkv(h, ACT)
        if len(parts) > 1 and decodes is not None:
            attn = self._attend_decodes(block, index, parts, decodes, fused, q_all, k_all, v_all)
        else:
            outs = [self._attend(block, index, p, fused, q_all, k_all, v_all) for p in parts]
            attn = torch.cat(outs) if len(outs) > 1 else outs[0]
        out = block.o.single(attn.to(mm))  # [M, H]
        if block.post_attn_norm is not None:
            out = self._rms(out.to(ACT), block.post_attn_norm)
        x = x + out
        gate, up = block.gate_up(self._rms(x, block.mlp_norm).to(mm))  # [M, I] x2
        spec = self.spec
        act = F.silu(gate) if spec.activation == "silu" else F.gelu(gate, approximate="tanh")
        down = block.down.single(act * up)
        if block.post_mlp_norm is not None:
            down = self._rms(down.to(ACT), block.post_mlp_norm)
        return x + down

    def _rotated_qkv(
        self,
        block: LayerWeights,
        rows: slice,
        batch: int,
        count: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fused: torch.Tensor | None,
        q_all: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normed, rotated) and v of `rows` of [M, ...] as [batch, heads, count, D]."""
        spec = self.spec
        heads, kv_heads, head_dim = spec.heads, spec.kv_heads, spec.head_dim
        if fused is not None:
            picked = fused[rows]
            # q and k side by side: one rotary pass over both.
            qk = picked[:, : self._q_size + self._kv_size].view(
                batch, count, heads + kv_heads, head_dim
            )
            qk = _rotate(qk, cos, sin)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
            v = picked[:, self._q_size + self._kv_size :]
        else:
            q = q_all[rows].view(batch, count, heads, head_dim)
            k = k_all[rows].view(batch, count, kv_heads, head_dim)
            v = v_all[rows]
            if block.q_norm is not None and block.k_norm is not None:
                q = self._rms(q, block.q_norm)
                k = self._rms(k, block.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        v = v.reshape(batch, count, kv_heads, head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend_decodes(
        self,
        block: LayerWeights,
        index: int,
        parts: list[_Part],
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        fused: torch.Tensor | None,
        q_all: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of B one-token rows, each over its own cache: [B, heads * D].

        The same ops as `_attend` on each row (elementwise rotary, `one_query` per row), so
        the same bits; only the rotary runs over all rows at once."""
        spec = self.spec
        heads, head_dim = spec.heads, spec.head_dim
        batch = len(parts)
        cos, sin = rope[block.kind]
        rows = slice(0, batch)
        q, k, v = self._rotated_qkv(block, rows, batch, 1, cos, sin, fused, q_all, k_all, v_all)
        if self.native_attention:
            return native.attend(
                q[:, :, 0],
                torch.stack([k[:, :, 0], v[:, :, 0]]),
                [p.cache.buffer for p in parts],
                index,
                list(range(batch)),
                [p.step.window_of(block.kind, p.start)[0] for p in parts],
                [p.start + 1 for p in parts],
                spec.attn_scale,
            ).view(batch, heads * head_dim)
        outs = []
        for i, part in enumerate(parts):
            keys, values = part.cache.write_and_read(index, k[i], v[i], part.start)
            seen = part.step.window_of(block.kind, part.start)
            outs.append(one_query(q[i, :, 0], keys, values, *seen, spec.attn_scale))
        return torch.cat(outs).view(batch, heads * head_dim)

    def _attend(
        self,
        block: LayerWeights,
        index: int,
        part: _Part,
        fused: torch.Tensor | None,
        q_all: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
    ) -> torch.Tensor:
        """One row's attention over its own cache: [T, heads * D]."""
        spec = self.spec
        heads, head_dim = spec.heads, spec.head_dim
        lo, count, step = part.offset, part.count, part.step
        cos, sin = step.rope[block.kind]
        rows = slice(lo, lo + count)
        q, k, v = self._rotated_qkv(block, rows, 1, count, cos, sin, fused, q_all, k_all, v_all)
        keys, values = part.cache.write_and_read(index, k[0], v[0], step.start)
        if self.native_attention:
            lo, hi = step.bounds(block.kind)
            attn = native.attend(
                q[0].transpose(0, 1),
                _EMPTY,
                [part.cache.buffer],
                index,
                [0] * count,
                lo,
                hi,
                spec.attn_scale,
            )
            return attn.reshape(count, heads * head_dim)
        if count == 1:
            seen = step.window_of(block.kind, step.start)
            return one_query(q[0, :, 0], keys, values, *seen, spec.attn_scale).view(1, -1)
        plan = step.plan(block.kind)
        attn = chunk_queries(q[0].transpose(0, 1), keys, values, plan, spec.attn_scale)
        return attn.reshape(count, heads * head_dim)


@dataclass
class _Part:
    """A row inside one forward: where its tokens sit in [M, H] and its positions."""

    hidden: torch.Tensor  # [T, H] float32, before the first layer
    cache: KVCache
    start: int  # its first position
    count: int
    step: _Step
    offset: int = 0  # its first row in [M, H]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, T, heads, D]: x * cos + rotate_half(x) * sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class _Step:
    """What every layer of one row's forward shares: the rotary rows and attention plans."""

    def __init__(self, spec: ArchSpec, ropes: dict[str, RopeTable], start: int, count: int) -> None:
        self.start = start
        self.count = count
        self.rope = {}
        for kind, table in ropes.items():
            table.ensure(start + count)
            self.rope[kind] = table.rows(start, count)
        self._window = spec.sliding_window
        self._group = spec.heads // spec.kv_heads
        self._plans: dict[str, list[QueryGroup]] = {}
        self._bounds: dict[str, tuple[list[int], list[int]]] = {}

    def bounds(self, kind: str) -> tuple[list[int], list[int]]:
        """Each position's window on layers of `kind`: ([lo per position], [hi ...])."""
        got = self._bounds.get(kind)
        if got is None:
            windows = self._windows(kind)
            got = self._bounds[kind] = ([w[0] for w in windows], [w[1] for w in windows])
        return got

    def plan(self, kind: str) -> list[QueryGroup]:
        """How the chunk attends on layers of `kind` (`attention.plan_chunk`), built once
        for all of them."""
        plan = self._plans.get(kind)
        if plan is None:
            plan = self._plans[kind] = plan_chunk(self._windows(kind), self._group)
        return plan

    def _windows(self, kind: str) -> list[tuple[int, int]]:
        return [self.window_of(kind, self.start + t) for t in range(self.count)]

    def window_of(self, kind: str, position: int) -> tuple[int, int]:
        """[first, end) of the cached positions a one-token step at `position` reads."""
        if kind == SLIDING and self._window is not None:
            return max(0, position + 1 - self._window), position + 1
        return 0, position + 1
