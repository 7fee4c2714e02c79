"""`LeanStage`: decoder layers [start, end) of a model, run by the engine's own forward.

One forward runs a chunk of tokens of a batch of sequences through the stage: the
embeddings on the first stage, then each layer, then on the last stage the final norm and
the head for each row's last position. Shapes carry the batch dimension ([B, T, H]) so
sessions can share a forward; today B is 1.

Per layer (Llama family): RMSNorm -> one fused q/k/v matmul -> (Qwen3: q/k norms) ->
rotary from a table on q and k together -> K/V written into the session's buffer ->
scaled_dot_product_attention with grouped-query heads over the cached positions -> o
matmul -> residual; RMSNorm -> one fused gate/up matmul -> SiLU(gate) * up -> down ->
residual. Gemma 3 adds its norms after attention and MLP, (1 + w) norm weights (folded in
at load), GeGLU, a sliding window on most layers and embeddings scaled by sqrt(hidden).
A one-token decode step builds no mask: it attends to every cached position (or the
window's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmd.engine.arch import SLIDING, ArchSpec
from swarmd.engine.kv import KVCache
from swarmd.engine.linear import Matrix, Projection
from swarmd.engine.rope import RopeTable
from swarmd.errors import InternalError, ModelLoadError
from swarmd.model.layers import LayerRange

ACT = torch.float32  # the residual stream, norms, attention and the KV cache


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
    """Token ids -> float32 rows, from a float table or int8 rows."""

    def __init__(self, table: torch.Tensor, scale: torch.Tensor | None, multiplier: float) -> None:
        self.table = table  # [V, H] float, or int8 with `scale` [V] (shared with a tied head)
        self.scale = scale  # float32 [V] for an int8 table
        self.multiplier = multiplier  # Gemma: sqrt(hidden)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.table).to(ACT)  # [B, T, H]
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

    @property
    def is_first(self) -> bool:
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        return self.head is not None

    @property
    def weight_formats(self) -> set[str]:
        formats: set[str] = set()
        for block in self.blocks:
            for proj in (block.qkv, block.o, block.gate_up, block.down):
                formats |= proj.formats
        return formats

    def new_cache(self, max_length: int) -> KVCache:
        spec = self.spec
        return KVCache(len(self.blocks), spec.kv_heads, spec.head_dim, ACT, max_length)

    def view(self, layers: LayerRange) -> LeanStage:
        """Layers [start, end) of this stage as a stage of their own, sharing the weights."""
        held = self.layers_range
        if layers == held:
            return self
        lo, hi = layers.offsets_in(held)
        last = layers.is_last(self.num_model_layers)
        return LeanStage(
            self.spec,
            layers,
            self.dtype,
            self.blocks[lo:hi],
            self.embed if layers.is_first() else None,
            self.norm if last else None,
            self.head if last else None,
            self.ropes,
        )

    @torch.inference_mode()
    def forward(
        self,
        inputs: torch.Tensor,
        cache: KVCache,
        alone: bool = False,
        all_positions: bool = False,
    ) -> torch.Tensor:
        """Run one chunk of tokens through this stage.

        inputs: [B, T] token ids on the first stage, else [B, T, H] hidden states.
        Returns [B, T, H] float32 hidden states, or on the last stage [B, V] float32
        logits of the chunk's final position ([B, T, V] with `all_positions`, for scoring
        a text).

        `alone`: each position attends as a one-token step would. Attention over a chunk of
        queries rounds differently from one query at a time (SDPA's kernels block the work
        differently), and every other op here gives a row the same bits whatever the
        chunk; so a chunk run `alone` is bit for bit the one-token steps it replays.
        """
        if self.embed is not None:
            hidden = self.embed(inputs)
        else:
            hidden = inputs if inputs.dtype == ACT else inputs.to(ACT)
        batch, count = int(hidden.shape[0]), int(hidden.shape[1])
        start = cache.length
        end = start + count
        if end > cache.max_length:
            raise InternalError(f"{end} positions exceed the cache's {cache.max_length}")
        cache.reserve(end)
        step = _Step(self.spec, self.ropes, start, count)
        x = hidden.reshape(batch * count, self.hidden_size)  # [M, H], M = B * T
        for index, block in enumerate(self.blocks):
            x = self._layer(block, index, x, batch, count, cache, step, alone)
        cache.length = end
        if self.head is None or self.norm is None:
            return x.view(batch, count, self.hidden_size)
        rows = x if all_positions else x.view(batch, count, self.hidden_size)[:, -1, :]
        normed = self._rms(rows.contiguous(), self.norm).to(self.dtype)  # [B or M, H]
        logits = self.head(normed).float()  # [B, V] or [M, V]
        if all_positions:
            logits = logits.view(batch, count, -1)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    __call__ = forward

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.spec.eps)

    def _layer(
        self,
        block: LayerWeights,
        index: int,
        x: torch.Tensor,  # [M, H] float32, the residual stream
        batch: int,
        count: int,
        cache: KVCache,
        step: _Step,
        alone: bool,
    ) -> torch.Tensor:
        spec = self.spec
        heads, kv_heads, head_dim = spec.heads, spec.kv_heads, spec.head_dim
        mm = self.dtype  # what the matrix kernels read
        h = self._rms(x, block.attn_norm).to(mm)
        cos, sin = step.rope[block.kind]
        fused = block.qkv.fused(h, ACT) if block.q_norm is None else None
        if fused is not None:
            # q and k side by side: one rotary pass over both.
            qk = fused[:, : self._q_size + self._kv_size].view(
                batch, count, heads + kv_heads, head_dim
            )
            qk = _rotate(qk, cos, sin)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
            v = fused[:, self._q_size + self._kv_size :]
        else:
            q, k, v = block.qkv(h, ACT)
            q = q.view(batch, count, heads, head_dim)
            k = k.view(batch, count, kv_heads, head_dim)
            if block.q_norm is not None and block.k_norm is not None:
                q = self._rms(q, block.q_norm)
                k = self._rms(k, block.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q = q.transpose(1, 2)  # [B, heads, T, D]
        k = k.transpose(1, 2)  # [B, kv, T, D]
        v = v.reshape(batch, count, kv_heads, head_dim).transpose(1, 2)
        first, mask = step.masks(block.kind)
        keys, values = cache.write_and_read(index, k, v, step.start, first)  # [B, kv, L, D]
        gqa = heads != kv_heads
        if alone and count > 1:
            rows = []
            for t in range(count):  # as the one-token step at position start + t attended
                lo, hi = step.window_of(block.kind, step.start + t)
                rows.append(
                    F.scaled_dot_product_attention(
                        q[:, :, t : t + 1],
                        keys[:, :, lo - first : hi - first],
                        values[:, :, lo - first : hi - first],
                        scale=spec.attn_scale,
                        enable_gqa=gqa,
                    )
                )
            attn = torch.cat(rows, dim=2)  # [B, heads, T, D]
        else:
            attn = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None and count > 1,
                scale=spec.attn_scale,
                enable_gqa=gqa,
            )  # [B, heads, T, D]
        attn = attn.transpose(1, 2).reshape(batch * count, heads * head_dim).to(mm)
        out = block.o.single(attn)  # [M, H]
        if block.post_attn_norm is not None:
            out = self._rms(out.to(ACT), block.post_attn_norm)
        x = x + out
        gate, up = block.gate_up(self._rms(x, block.mlp_norm).to(mm))  # [M, I] x2
        act = F.silu(gate) if spec.activation == "silu" else F.gelu(gate, approximate="tanh")
        down = block.down.single(act * up)
        if block.post_mlp_norm is not None:
            down = self._rms(down.to(ACT), block.post_mlp_norm)
        return x + down


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, T, heads, D]: x * cos + rotate_half(x) * sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class _Step:
    """What every layer of one forward shares: the rotary rows and attention masks."""

    def __init__(self, spec: ArchSpec, ropes: dict[str, RopeTable], start: int, count: int) -> None:
        self.start = start
        self.rope = {}
        for kind, table in ropes.items():
            table.ensure(start + count)
            self.rope[kind] = table.rows(start, count)
        self._masks = _Masks(spec, start, count)
        self.masks = self._masks.for_kind
        self._window = spec.sliding_window

    def window_of(self, kind: str, position: int) -> tuple[int, int]:
        """[first, end) of the cached positions a one-token step at `position` reads."""
        if kind == SLIDING and self._window is not None:
            return max(0, position + 1 - self._window), position + 1
        return 0, position + 1


class _Masks:
    """The attention masks one forward needs, built once per layer kind.

    A one-token step needs none: its query may see every cached position (a sliding
    layer only reads the window's). A chunk starting at position 0 of a full-attention
    layer uses SDPA's own causal mask.
    """

    def __init__(self, spec: ArchSpec, start: int, count: int) -> None:
        self.window = spec.sliding_window
        self.start = start
        self.count = count
        self._built: dict[str, tuple[int, torch.Tensor | None]] = {}

    def for_kind(self, kind: str) -> tuple[int, torch.Tensor | None]:
        """(first cached position to read, mask or None) for a layer of `kind`."""
        built = self._built.get(kind)
        if built is None:
            built = self._built[kind] = self._build(kind)
        return built

    def _build(self, kind: str) -> tuple[int, torch.Tensor | None]:
        end = self.start + self.count
        window = self.window if kind == SLIDING else None
        first = 0 if window is None else max(0, end - self.count - window + 1)
        if self.count == 1:
            return first, None
        if window is None and self.start == 0:
            return 0, None  # is_causal
        q_pos = torch.arange(self.start, end)[:, None]  # [T, 1]
        k_pos = torch.arange(first, end)[None, :]  # [1, L]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window  # transformers' sliding rule: q - k < window
        return first, allowed
