"""Checkpoint tensor names per model family, mapped to the runtime's canonical names.

The canonical names are those of ``docs/contracts.md`` (the DeepSeek / Qwen Hugging
Face names, with routed experts stacked as ``mlp.experts.w13 [P, 2I, D]`` and
``mlp.experts.w2 [P, D, I]``). Per family, a canonical tensor may live under:

- DeepSeek-V2/V3, Qwen3-MoE: the same name; experts one tensor per expert,
  ``model.layers.N.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight``
  (``gate [I, D]``, ``up [I, D]``, ``down [D, I]``).
- Mixtral: ``block_sparse_moe`` instead of ``mlp`` for the router and experts;
  experts ``block_sparse_moe.experts.E.{w1 (gate), w3 (up), w2 (down)}.weight``.
- Fused experts (any family; what transformers 5.x holds in memory, and what e.g.
  Qwen3-VL-MoE checkpoints store): ``<moe>.experts.gate_up_proj`` and
  ``<moe>.experts.down_proj``, gate rows before up rows. Two layouts, told apart by
  shape (see ``plan.fused_is_transposed``): transformers 5.x ``[E, 2I, D]`` / ``[E, D, I]``,
  and transposed ``[E, D, 2I]`` / ``[E, I, D]`` (Qwen3-VL-MoE, Llama-4 style).

Every family also accepts the canonical name itself (a Mixtral state dict saved from
transformers' in-memory model uses ``mlp.gate.weight``). Unknown families try all forms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

GATE_UP, DOWN = "w13", "w2"  # canonical leaf names of the stacked expert tensors


@dataclass(frozen=True)
class NameScheme:
    """Where one family keeps its MoE tensors in a checkpoint, in lookup order."""

    family: str
    moe_blocks: tuple[str, ...]  # checkpoint name of the MoE block inside a layer
    expert_projs: tuple[tuple[str, str, str], ...]  # per-expert (gate, up, down) leaf names


_HF_PROJS = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_PROJS = ("w1", "w3", "w2")
SCHEMES: dict[str, NameScheme] = {
    "deepseek_v3": NameScheme("deepseek_v3", ("mlp",), (_HF_PROJS,)),
    "deepseek_v2": NameScheme("deepseek_v2", ("mlp",), (_HF_PROJS,)),
    "qwen3_moe": NameScheme("qwen3_moe", ("mlp",), (_HF_PROJS,)),
    "mixtral": NameScheme("mixtral", ("block_sparse_moe", "mlp"), (_MIXTRAL_PROJS, _HF_PROJS)),
    "generic": NameScheme("generic", ("mlp", "block_sparse_moe"), (_HF_PROJS, _MIXTRAL_PROJS)),
}
_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}

_ROUTER_RE = re.compile(r"^(?P<layer>.+\.layers\.\d+)\.mlp\.gate\.(?P<leaf>weight|e_score_correction_bias)$")
_EXPERTS_RE = re.compile(r"^(?P<layer>.+\.layers\.\d+)\.mlp\.experts$")
_CKPT_EXPERT_RE = re.compile(
    r"^(?P<block>.+)\.experts\.(?:(?P<expert>\d+)\.(?:gate_proj|up_proj|down_proj|w1|w2|w3)\.weight"
    r"|gate_up_proj|down_proj)(?:_scale_inv)?$"
)
SCALE_INV_SUFFIX = "_scale_inv"  # fp8 weights: X.weight -> X.weight_scale_inv, fused experts.down_proj -> ..._scale_inv
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.")
_IGNORED_RE = re.compile(r"(?:^|\.)rotary_emb\.(?:inv_freq|cos_cached|sin_cached)$")


def detect_scheme(config: dict[str, Any]) -> NameScheme:
    """The family's scheme from config.json's ``model_type`` (else ``architectures``);
    ``generic`` when neither names a supported family (or there is no config)."""
    family = config.get("model_type")
    if family not in SCHEMES:
        archs = config.get("architectures") or []
        family = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), "generic")
    return SCHEMES[family]


def dense_candidates(canonical: str, scheme: NameScheme) -> list[str]:
    """Checkpoint names that may hold the non-expert tensor ``canonical``, best first."""
    m = _ROUTER_RE.match(canonical)
    if not m:
        return [canonical]
    names = [f"{m['layer']}.{block}.gate.{m['leaf']}" for block in scheme.moe_blocks]
    return names if canonical in names else [*names, canonical]


def expert_blocks(experts_module: str, scheme: NameScheme) -> list[str]:
    """Checkpoint MoE-block prefixes for the canonical experts module
    (``model.layers.3.mlp.experts`` -> ``model.layers.3.mlp`` / ``...block_sparse_moe``)."""
    m = _EXPERTS_RE.match(experts_module)
    if not m:
        return [experts_module.removesuffix(".experts")]
    return [f"{m['layer']}.{block}" for block in scheme.moe_blocks]


def per_expert_names(block: str, expert: int, projs: tuple[str, str, str]) -> tuple[str, str, str]:
    """(gate, up, down) checkpoint names of one logical expert in one MoE block."""
    return tuple(f"{block}.experts.{expert}.{p}.weight" for p in projs)  # type: ignore[return-value]


def fused_names(block: str) -> tuple[str, str]:
    """(gate_up, down) checkpoint names of fused expert tensors in one MoE block."""
    return f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj"


def scale_inv_name(key: str) -> str:
    """The checkpoint name of the fp8 tensor ``key``'s block scales (``X.weight`` -> ``X.weight_scale_inv``)."""
    return key + SCALE_INV_SUFFIX


def expert_block_of(key: str) -> str | None:
    """The MoE block prefix if ``key`` is a routed-expert tensor (per-expert or fused, or the fp8
    scales of one), else None."""
    m = _CKPT_EXPERT_RE.match(key)
    return m["block"] if m else None


def layer_of(key: str) -> int | None:
    """The decoder-layer index of a ``model.layers.N.*`` (or ``layers.N.*``) tensor, else None."""
    m = _LAYER_RE.match(key)
    return int(m["layer"]) if m else None


def is_rotary_cache(key: str) -> bool:
    """A rotary-embedding cache some checkpoints carry (``...rotary_emb.inv_freq``): recomputed at
    run time, never read (vLLM skips these names too)."""
    return _IGNORED_RE.search(key) is not None


def num_mtp_layers(config: dict[str, Any]) -> int:
    """config.json's ``num_nextn_predict_layers`` (DeepSeek-V3: 1): the multi-token-prediction layers
    a checkpoint stores as ``model.layers.{num_hidden_layers + i}.*``; 0 when absent or not an int."""
    value = config.get("num_nextn_predict_layers")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
