"""KV-cache sizing (kvcalc): how many tokens' KV fit on one rank after the weights.

Per token, over all layers L:
- GQA caches K and V for each KV head: ``2 * L * Hkv * head_dim`` values; tensor
  parallelism splits the KV heads, so a TP rank holds ``max(1, Hkv / tp)`` of them
  (heads are replicated when tp > Hkv).
- MLA caches one latent ``kv_lora_rank + qk_rope_head_dim`` wide per layer, shared by
  all heads: it cannot be split by heads, so every TP rank holds all of it.
- ``mha_bytes_per_token`` is what full multi-head attention would cache for the same
  model (``L * H * (qk head dim + v head dim)``), the yardstick MLA and GQA save against.

Weights: ``weight_bytes_per_rank`` when the caller passes it. ``kvcalc`` and ``simulate``
always do, through ``launch.hardware.compute_layout_kv_sizing`` (the rank's share under its
TP/EP layout, ``parallel.costmodel.weight_bytes_per_rank``), so the two report one capacity.
Without it, all weights are split evenly over TP ranks (``num_parameters() * bytes / tp``),
a lower bound: the runtime keeps every routed expert on each TP rank unless experts are
spread by EP. Activations are not modelled; pass ``reserved_bytes`` for them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Protocol

_KV_DTYPE_BYTES = {"fp8": 1.0, "fp8_e4m3": 1.0}
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
# the most bytes a memory size may name: beyond it no int64 holds it and no machine has it ("1e400" reads
# as inf, "1e300" as a 300-digit integer)
_MAX_MEMORY_BYTES = 2**63
_MEMORY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class NoKVRoomError(ValueError):
    """The weights (and reserved memory) leave no room for the KV cache in the memory budget."""


class KVConfig(Protocol):
    """The fields of ``moe.config.ModelConfig`` sizing reads."""

    attention: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int

    def kv_bytes_per_token(self, dtype_bytes: int | float) -> int: ...

    def num_parameters(self) -> int: ...


@dataclass(frozen=True)
class KVSizing:
    """Sizes are per TP rank unless named otherwise; ``max_num_tokens`` counts tokens."""

    kv_cache_dtype: str
    kv_dtype_bytes: float
    kv_bytes_per_token: int  # whole model (tp = 1)
    kv_bytes_per_token_per_rank: int
    mha_bytes_per_token: int  # full multi-head attention equivalent, whole model
    weight_bytes_per_rank: int
    memory_bytes: int
    memory_utilization: float
    reserved_bytes: int
    kv_budget_bytes: int
    max_num_tokens: int
    max_model_len: int
    max_concurrency: float  # sequences of max_model_len tokens that fit at once
    tensor_parallel_size: int

    def num_blocks(self, block_size: int) -> int:
        """KV blocks of ``block_size`` tokens that fit in the budget."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        return self.max_num_tokens // block_size

    @property
    def savings_vs_mha(self) -> float:
        """How many times smaller than full multi-head attention's cache (whole model)."""
        return self.mha_bytes_per_token / self.kv_bytes_per_token


def parse_memory(value: str | int | float) -> int:
    """Bytes from ``"80GiB"``, ``"80GB"`` (powers of 1000), ``"80G"`` (binary), ``"512MiB"``,
    ``"1.5TiB"`` or a plain number of bytes (``"80e9"``, as ``configs/hardware`` writes it)."""
    if isinstance(value, bool):
        raise ValueError(f"memory size must be a number or a string like '80GiB', got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        m = _MEMORY_RE.match(str(value))
        if m is None:
            raise ValueError(f"cannot parse memory size {value!r}: expected e.g. '80GiB', '512MB' or bytes")
        number, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown memory unit {unit!r} in {value!r}: use B, KiB/MiB/GiB/TiB, KB/MB/GB/TB or K/M/G/T")
    if math.isnan(number):
        raise ValueError(f"memory size {value!r} is not a number")
    if number < 0:
        raise ValueError(f"memory size must be non-negative, got {value!r}")
    num_bytes = number * _UNITS[unit]
    if not math.isfinite(num_bytes) or num_bytes > _MAX_MEMORY_BYTES:
        raise ValueError(f"memory size {value!r} is not a finite size (at most 2**63 bytes, 8 EiB)")
    return int(num_bytes)


def format_memory(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit that keeps it >= 1 (``'1.25 GiB'``, ``'512.00 KiB'``,
    ``'480 B'``), the way ``parse_memory`` reads it back."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def compute_kv_sizing(
    config: KVConfig,
    *,
    memory_bytes: int | str,
    kv_cache_dtype: str = "auto",
    dtype_bytes: float = 2,
    weight_dtype_bytes: float | None = None,
    memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    reserved_bytes: int | str = 0,
    weight_bytes_per_rank: int | None = None,
) -> KVSizing:
    """Size the KV cache of one TP rank holding ``memory_bytes`` of accelerator memory.

    dtype_bytes: bytes per element of the model dtype (bf16: 2); ``kv_cache_dtype="auto"``
    caches in that dtype, ``"fp8"`` in 1 byte. weight_dtype_bytes defaults to dtype_bytes.
    weight_bytes_per_rank: the rank's weights when the caller knows better than
    ``num_parameters() x bytes / tp`` (expert parallelism: ``parallel.costmodel``).
    Raises NoKVRoomError (a ValueError) when the weights leave no room for KV.
    """
    memory, reserved = parse_memory(memory_bytes), parse_memory(reserved_bytes)
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes}")
    if kv_cache_dtype == "auto":
        kv_bytes = float(dtype_bytes)
    elif kv_cache_dtype in _KV_DTYPE_BYTES:
        kv_bytes = _KV_DTYPE_BYTES[kv_cache_dtype]
    else:
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    max_len = config.max_position_embeddings if max_model_len is None else max_model_len
    if max_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_len}")

    per_token = config.kv_bytes_per_token(kv_bytes)
    per_rank = _kv_bytes_per_rank(config, per_token, tp)
    if weight_bytes_per_rank is None:
        weights = math.ceil(config.num_parameters() * (weight_dtype_bytes or dtype_bytes) / tp)
    else:
        weights = int(weight_bytes_per_rank)
    budget = int(memory * memory_utilization) - weights - reserved
    if budget <= 0:
        held = f" and {format_memory(reserved)} reserved" if reserved else ""
        raise NoKVRoomError(
            f"no room for the KV cache: the weights take {format_memory(weights)} per rank (tp={tp}){held} of "
            f"{memory_utilization:g} x {format_memory(memory)} = {format_memory(memory * memory_utilization)} "
            f"usable; KV needs {per_token:,} B per token (all layers) on top"
        )
    max_tokens = budget // per_rank
    return KVSizing(
        kv_cache_dtype=kv_cache_dtype, kv_dtype_bytes=kv_bytes, kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_rank=per_rank, mha_bytes_per_token=_mha_bytes_per_token(config, kv_bytes),
        weight_bytes_per_rank=weights, memory_bytes=memory, memory_utilization=memory_utilization,
        reserved_bytes=reserved, kv_budget_bytes=budget, max_num_tokens=max_tokens, max_model_len=max_len,
        max_concurrency=max_tokens / max_len, tensor_parallel_size=tp,
    )


def _kv_bytes_per_rank(config: KVConfig, per_token: int, tp: int) -> int:
    if config.attention == "mla":
        return per_token  # the latent is shared by all heads: replicated on every TP rank
    h_kv = config.num_key_value_heads
    if h_kv % tp and tp % h_kv:
        raise ValueError(f"tensor_parallel_size {tp} must divide or be a multiple of num_key_value_heads {h_kv}")
    heads_per_rank = max(1, h_kv // tp)
    return per_token * heads_per_rank // h_kv


def _mha_bytes_per_token(config: KVConfig, kv_bytes: float) -> int:
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    if config.attention == "mla":
        width = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    else:
        width = 2 * config.head_dim
    return int(layers * heads * width * kv_bytes)
