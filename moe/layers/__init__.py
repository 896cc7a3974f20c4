"""Model layers: RMSNorm, RoPE (default / YaRN), GQA and MLA attention, dense SwiGLU MLP."""

from moe.layers.gqa import GQAAttention
from moe.layers.linear import Linear
from moe.layers.mla import MLAAttention
from moe.layers.mlp import DenseMLP, shard_linear_
from moe.layers.norm import RMSNorm
from moe.layers.paged import paged_attention, sdpa
from moe.layers.rope import RotaryEmbedding, apply_rotary, compute_inv_freq

__all__ = [
    "DenseMLP", "GQAAttention", "Linear", "MLAAttention", "RMSNorm", "RotaryEmbedding", "apply_rotary",
    "compute_inv_freq", "paged_attention", "sdpa", "shard_linear_",
]
