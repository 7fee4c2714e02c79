"""Rotary position embeddings from a table, built once and grown when positions pass it.

The frequencies are transformers' (default, linear and llama3 scaling, and llama.cpp's
per-frequency factors of Llama 3 GGUFs); cos and sin are computed in float32 exactly as
transformers computes them per step, then cast to the activations' dtype.
"""

from __future__ import annotations

import math

import torch

from swarmd.engine.arch import RopeSpec

_MIN_POSITIONS = 256


def inverse_frequencies(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32, as transformers' rope init functions give them."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (spec.theta**steps)
    if spec.kind == "linear":
        inv_freq = inv_freq / spec.factor
    elif spec.kind == "llama3":
        inv_freq = _llama3(inv_freq, spec)
    if spec.freq_factors:
        factors = torch.tensor(spec.freq_factors, dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"{factors.numel()} rope factors for {inv_freq.numel()} frequencies")
        inv_freq = inv_freq / factors
    return inv_freq


def _llama3(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    old = spec.original_max_positions
    low_wavelen = old / spec.low_freq_factor
    high_wavelen = old / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RopeTable:
    """cos and sin for positions [0, n) of one layer type, in the activations' dtype."""

    def __init__(self, spec: RopeSpec, head_dim: int, dtype: torch.dtype) -> None:
        self.inv_freq = inverse_frequencies(spec, head_dim)
        self.dtype = dtype
        self.half = head_dim // 2
        self.cos = torch.empty(0, head_dim, dtype=dtype)
        self.sin_signed = torch.empty(0, head_dim, dtype=dtype)

    def ensure(self, positions: int) -> None:
        if positions <= self.cos.shape[0]:
            return
        size = max(_MIN_POSITIONS, 1 << math.ceil(math.log2(positions)))
        # A one-column matmul, as transformers' rotary forward: bit-equal angles.
        pos = torch.arange(size, dtype=torch.float32)[:, None]  # [P, 1]
        freqs = pos @ self.inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos().to(self.dtype)
        sin = emb.sin()
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_low, sin_high]
        sin[:, : self.half] = -sin[:, : self.half]
        self.sin_signed = sin.to(self.dtype)

    def rows(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, D] for positions start..start+count (ensured first)."""
        return (
            self.cos[start : start + count, None, :],
            self.sin_signed[start : start + count, None, :],
        )
