"""Rotary position embedding: default and YaRN, half-split or interleaved-pair layout.

Shape legend: T tokens, H heads, R rotary dim (even).

Half-split (Llama/Mixtral/Qwen, DeepSeek-V3 with ``rope_interleave=False``) rotates
(x[i], x[i + R/2]); interleaved (DeepSeek V2/V3 checkpoints) rotates (x[2i], x[2i+1]).
The interleaved output is written de-interleaved (evens then odds), as transformers'
DeepSeek-V3 does: q and k get the same permutation, so q.k is unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe.config import RopeScaling, yarn_get_mscale


def compute_inv_freq(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [R/2] float32, attention_factor): cos/sin are scaled by the factor."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    factor = scaling.factor
    att = scaling.attention_factor
    if att is None:
        if scaling.mscale and scaling.mscale_all_dim:
            att = yarn_get_mscale(factor, scaling.mscale) / yarn_get_mscale(factor, scaling.mscale_all_dim)
        else:
            att = yarn_get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = scaling.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(att)


class RotaryEmbedding(nn.Module):
    """cos/sin tables from positions, and their application to q/k."""

    def __init__(self, dim: int, theta: float, scaling: RopeScaling | None = None, interleave: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.interleave = interleave
        inv_freq, self.attention_factor = compute_inv_freq(dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # (cos [P, R/2], sin [P, R/2], inv_freq's (data_ptr, _version, device) they were made from)
        self._tables: tuple[torch.Tensor, torch.Tensor, tuple] | None = None

    def forward(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; max_position: the largest of them when the caller knows it (a decode
        step's longest context - 1), else read from positions. Returns cos, sin: [T, R/2] float32
        (attention factor applied). On CPU: rows of ``compute``'s tables of positions [0, P), which
        are bit-equal to ``compute(positions)`` (each element depends on its position alone), for two
        index_selects a step instead of six elementwise ops; elsewhere ``compute(positions)``."""
        if (positions.dim() != 1 or positions.numel() == 0 or positions.is_floating_point()
                or positions.device.type != "cpu"):  # elsewhere a position past the tables is no IndexError
            return self.compute(positions)
        if max_position is None:
            max_position = int(positions.max())
        cos, sin = self._table(max_position + 1)
        try:
            return cos.index_select(0, positions), sin.index_select(0, positions)
        except IndexError:  # a position past the caller's max_position, or a negative one
            if int(positions.min()) < 0:
                return self.compute(positions)
            cos, sin = self._table(int(positions.max()) + 1)
            return cos.index_select(0, positions), sin.index_select(0, positions)

    def compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64. Returns cos, sin: [T, R/2] float32 (attention factor applied), computed."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def _table(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, R/2] for positions [0, P), P >= need (a power of two, so a growing context
        rebuilds them a logarithmic number of times), remade when inv_freq changes or moves."""
        inv = self.inv_freq
        made_from = (inv.data_ptr(), inv._version, inv.device)
        tables = self._tables
        if tables is None or tables[0].shape[0] < need or tables[2] != made_from:
            size = max(256, 1 << (need - 1).bit_length())
            cos, sin = self.compute(torch.arange(size, device=inv.device))
            tables = self._tables = (cos, sin, made_from)
        return tables[0], tables[1]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, R]; cos, sin: [T, R/2]. Returns rotated x [T, H, R] in x's dtype."""
        return apply_rotary(x, cos, sin, self.interleave)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x: [T, H, R]; cos, sin: [T, R/2] float32. Rotation in float32, result in x's dtype."""
    h = x.float()
    if interleave:
        x1, x2 = h[..., 0::2], h[..., 1::2]
    else:
        half = h.shape[-1] // 2
        x1, x2 = h[..., :half], h[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
