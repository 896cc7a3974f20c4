"""Model configuration: one normalised, frozen view of a Hugging Face MoE config.

``ModelConfig.from_hf`` reads ``config.json`` (a file, a checkpoint dir, a dict, or a released
model's name resolved offline by ``moe.model_catalog``) of MixtralForCausalLM,
DeepseekV2ForCausalLM, DeepseekV3ForCausalLM or Qwen3MoeForCausalLM and keeps every
field that changes the math, under one set of names. Field values the runtime does not
implement raise ``ValueError`` naming the field, unless ``strict=False`` (sizing only); of
``quantization_config`` only block-wise fp8 weights are accepted (``fp8_weights``: the loader
dequantizes them into the compute dtype).

Semantics follow Hugging Face transformers (the numerical oracle):
- DeepSeek-V3 routing is sigmoid + ``noaux_tc`` (bias for selection only, grouped);
  DeepSeek-V2 is softmax with ``greedy`` or ``group_limited_greedy`` and, like
  transformers, never renormalises; Mixtral always renormalises; Qwen3-MoE only when
  ``norm_topk_prob``.
- MLA ``head_dim`` here is the q/k head size ``qk_nope_head_dim + qk_rope_head_dim``
  (the Hugging Face field of that name holds the rope dim).
- ``rope_scaling`` (legacy) and ``rope_parameters`` (transformers 5) are both read.
- ``sliding_window`` (GQA only): Mixtral applies it to every layer whenever it is set;
  Qwen3-MoE only when ``use_sliding_window``, then to every layer (transformers 5.24's
  Qwen3-MoE reads neither ``max_window_layers`` nor ``layer_types``, so neither do we).
- A field the config.json leaves out takes transformers' default for the family
  (``_HF_DEFAULTS``; e.g. DeepSeek-V3's ``n_shared_experts`` 1, ``n_group`` 8, ``topk_group`` 4,
  Mixtral's ``num_experts_per_tok`` 2), since the checkpoint was shaped by those; the fields that
  give the weights' own sizes (``hidden_size``, ``vocab_size``, layer and head counts, intermediate
  sizes, expert counts, MLA's head and latent dims) are required instead: a default there only
  turns into a tensor-shape error at load. Booleans must be JSON booleans. ``hidden_act`` "swish"
  is transformers' other name for "silu".
- One exception: DeepSeek's ``moe_layer_freq`` (dense every layer ``i % freq != 0``) is
  applied as DeepSeek's code and vLLM do; transformers ignores it. Released checkpoints use 1.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from moe.json_object import parse_json_object
from moe.model_catalog import find_model_config, known_model_names

ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MODEL_TYPES = {v: v for v in ARCHITECTURES.values()}
_DEFAULT_THETA = {"mixtral": 1_000_000.0}
# transformers' defaults (its config classes' __init__) for fields a config.json may leave out
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"max_position_embeddings": 4096, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
                    "q_lora_rank": 1536, "num_experts_per_tok": 8},
    "deepseek_v2": {"max_position_embeddings": 2048, "n_shared_experts": 2, "q_lora_rank": 1536},
    "mixtral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "sliding_window": 4096,
                  "num_experts_per_tok": 8},
}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (the only scaled rope implemented). None fields take transformers' defaults."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Normalised model configuration (see module docstring). Validated, never mutated."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention: str
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: str | None = None
    sliding_window: int | None = None
    unsupported: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.architecture not in _MODEL_TYPES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {sorted(_MODEL_TYPES)}")
        if self.attention not in ("mla", "gqa"):
            raise ValueError(f"attention must be 'mla' or 'gqa', got {self.attention!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} > num_experts {self.num_experts}")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"MLA needs a positive {name}, got {getattr(self, name)}")
        # rope turns pairs of dims: MLA's rope part (its nope part may be odd), or a GQA head's whole dim
        rotary = ("qk_rope_head_dim", self.qk_rope_head_dim) if self.attention == "mla" else ("head_dim", self.head_dim)
        if rotary[1] % 2:
            raise ValueError(f"{rotary[0]} {rotary[1]} is odd: rotary dims must be even")
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by n_group {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.topk_method == "noaux_tc" and self.num_experts // self.n_group < 2:
            raise ValueError("noaux_tc needs at least 2 experts per group (group score = top-2 sum)")
        if self.moe_layer_freq < 1 or self.decoder_sparse_step < 1:
            raise ValueError(f"moe_layer_freq and decoder_sparse_step must be >= 1, got {self.moe_layer_freq} "
                             f"and {self.decoder_sparse_step}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.moe_layer_ids:
            raise ValueError(f"no MoE layer: {self._dense_layer_fields()} leave all {self.num_hidden_layers} "
                             "layers dense, and this runtime serves mixture-of-experts models")
        if self.sliding_window is not None and (self.attention != "gqa" or self.sliding_window <= 0):
            raise ValueError(f"sliding_window {self.sliding_window} needs GQA attention and a positive size")

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict[str, Any], strict: bool = True) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` (a file, a checkpoint dir, or its dict).

        strict=False tolerates unimplemented fields (recorded in ``unsupported``) for sizing.
        """
        raw = _read_raw(path_or_dict)
        arch = _architecture_of(raw)
        problems: list[str] = []
        kwargs = _common_fields(raw, arch, problems)
        if arch in ("deepseek_v2", "deepseek_v3"):
            kwargs.update(_deepseek_fields(raw, arch, problems))
        elif arch == "mixtral":
            kwargs.update(_mixtral_fields(raw, problems))
        else:
            kwargs.update(_qwen3_fields(raw, problems))
        if problems and strict:
            raise ValueError(f"unsupported {arch} config: " + "; ".join(problems))
        return cls(architecture=arch, unsupported=tuple(problems), **kwargs)

    # ---- derived quantities -------------------------------------------------------------

    def is_moe_layer(self, i: int) -> bool:
        """True when decoder layer ``i`` has a routed-expert FFN (else a dense MLP)."""
        if not 0 <= i < self.num_hidden_layers:
            raise ValueError(f"layer {i} out of range [0, {self.num_hidden_layers})")
        if self.architecture in ("deepseek_v2", "deepseek_v3"):
            return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0
        if self.architecture == "qwen3_moe":
            return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        return True

    def transformers_differs(self) -> str | None:
        """Where transformers' own model of this checkpoint is a different model from ours (so a
        comparison of tokens or logits with it measures that, not rounding), in one line; else None.
        The one case: DeepSeek's ``moe_layer_freq`` > 1, which transformers ignores."""
        if self.architecture in ("deepseek_v2", "deepseek_v3") and self.moe_layer_freq != 1:
            return (f"moe_layer_freq={self.moe_layer_freq}: transformers ignores it and gives every layer from "
                    f"first_k_dense_replace={self.first_k_dense_replace} on routed experts; ours keeps layers "
                    f"i % {self.moe_layer_freq} != 0 dense, as DeepSeek's code and vLLM do, so the two run different "
                    "models")
        return None

    def layer_sliding_window(self, i: int) -> int | None:
        """Decoder layer ``i``'s attention window w (query p sees keys p - w < k <= p), or
        None for full causal attention. Both GQA families window every layer alike."""
        if not 0 <= i < self.num_hidden_layers:
            raise ValueError(f"layer {i} out of range [0, {self.num_hidden_layers})")
        return self.sliding_window

    def tensor_parallel_problem(self, tp: int) -> str | None:
        """Why the attention heads cannot be split over ``tp`` ranks (naming the numbers), or None:
        ``tp`` must divide the query heads and, for GQA, divide the kv heads or be a multiple of them
        (each rank then holds a copy of its query heads' kv head, vLLM's rule). The dense MLP layers
        split their intermediate columns too, so ``tp`` must divide ``intermediate_size`` when the
        model has any (routed and shared experts are not split: TP ranks split their tokens)."""
        if self.num_attention_heads % tp:
            return f"tensor_parallel_size={tp} does not divide num_attention_heads {self.num_attention_heads}"
        if self.attention == "gqa" and self.num_key_value_heads % tp and tp % self.num_key_value_heads:
            return (f"tensor_parallel_size={tp} must divide or be a multiple of num_key_value_heads "
                    f"{self.num_key_value_heads}")
        if self.intermediate_size % tp and len(self.moe_layer_ids) < self.num_hidden_layers:
            return (f"tensor_parallel_size={tp} does not divide intermediate_size {self.intermediate_size} "
                    f"of the dense MLP layers ({self._dense_layer_fields()})")
        return None

    def _dense_layer_fields(self) -> str:
        """The fields that make layers dense, with their values (for messages)."""
        if self.architecture in ("deepseek_v2", "deepseek_v3"):
            return f"first_k_dense_replace={self.first_k_dense_replace}, moe_layer_freq={self.moe_layer_freq}"
        if self.architecture == "qwen3_moe":
            return f"mlp_only_layers={list(self.mlp_only_layers)}, decoder_sparse_step={self.decoder_sparse_step}"
        return "the config's fields"

    @property
    def max_model_len_limit(self) -> int:
        """The longest context (prompt + output) the model supports: max_position_embeddings, or with
        YaRN original_max_position_embeddings x factor when that is larger, as vLLM derives it (Qwen3's
        YaRN recipe adds rope_scaling factor 4 over 32768 and leaves max_position_embeddings at 40960)."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        extended = int(self.rope_scaling.original_max_position_embeddings * self.rope_scaling.factor)
        return max(self.max_position_embeddings, extended)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def kv_entry_shape(self) -> tuple[int, ...]:
        """Per token per layer: MLA (kv_lora_rank + qk_rope_head_dim,), GQA (2, Hkv, head_dim)."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim,)
        return (2, self.num_key_value_heads, self.head_dim)

    def kv_bytes_per_token(self, dtype_bytes: int | float) -> int:
        """KV-cache bytes per token over all layers at ``dtype_bytes`` per element."""
        return int(math.prod(self.kv_entry_shape) * self.num_hidden_layers * dtype_bytes)

    @property
    def softmax_scale(self) -> float:
        """Attention softmax scale, with the MLA YaRN mscale^2 correction."""
        if self.attention == "gqa":
            return self.head_dim ** -0.5
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def num_parameters(self) -> int:
        """Total parameter count (all routed experts, embeddings, lm_head unless tied)."""
        d = self.hidden_size
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        for i in range(self.num_hidden_layers):
            total += 2 * d + self._attention_parameters()
            if self.is_moe_layer(i):
                total += self.num_experts * (3 * d * self.moe_intermediate_size + d)
                total += 3 * d * self.moe_intermediate_size * self.num_shared_experts
                total += self.num_experts if self.topk_method == "noaux_tc" else 0
            else:
                total += 3 * d * self.intermediate_size
        return total

    def _attention_parameters(self, tp: int = 1) -> int:
        """One layer's attention parameters, or with ``tp`` > 1 those tensor-parallel rank 0 holds
        (``shard_for_tp``: query / output heads and GQA's kv heads split, a kv head replicated once tp
        passes their count, MLA's latent projections and norms whole, the row-parallel bias on rank 0)."""
        d, h = self.hidden_size, self.num_attention_heads // tp
        b = 1 if self.attention_bias else 0
        if self.attention == "gqa":
            q, kv = h * self.head_dim, max(1, self.num_key_value_heads // tp) * self.head_dim
            n = d * q + 2 * d * kv + q * d + b * (q + 2 * kv + d)
            return n + (2 * self.head_dim if self.qk_norm else 0)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            n = d * h * qk
        else:
            n = d * self.q_lora_rank + b * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk
        lat = self.kv_lora_rank + self.qk_rope_head_dim
        n += d * lat + b * lat + self.kv_lora_rank
        n += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return n + h * self.v_head_dim * d + b * d


# ---- parsing helpers --------------------------------------------------------------------


_JSON_TYPES = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _read_raw(path_or_dict: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    return read_config_json(path_or_dict)


def read_config_json(path_or_name: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` dict of a checkpoint dir, a config.json file or a shipped model's
    name; ValueError saying what was expected when it is none of these."""
    path = os.fspath(path_or_name)
    if not os.path.exists(path):
        shipped = find_model_config(path)
        if shipped is not None:
            return shipped
        raise ValueError(f"no config.json at {path!r}, and it names none of the shipped model configs "
                         f"({', '.join(known_model_names())})")
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no config.json at {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a model config.json: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    return parse_json_object(
        text, ValueError,
        lambda e: (f"{path} is not a model config.json (JSON: {e}); expected a checkpoint directory, "
                   "its config.json, or a model name such as deepseek-ai/DeepSeek-V3"),
        lambda raw: (f"{path} is not a model config.json: expected a JSON object, "
                     f"got {_JSON_TYPES.get(type(raw), type(raw).__name__)}"))


# model_type values released checkpoints pair with a family's architecture besides the family's own:
# Kimi K2 is a DeepseekV3ForCausalLM with model_type "kimi_k2".
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def _check_model_type_agrees(model_type: Any, architecture: str) -> None:
    """ValueError naming both when config.json's ``model_type`` names another family than its
    ``architectures`` entry (``llama`` with ``DeepseekV3ForCausalLM``): transformers builds the config
    from model_type and the checkpoint loader picks its tensor names from it, while the model is
    built from architectures, so one of them is wrong. An absent model_type is fine."""
    if model_type is None:
        return
    family = ARCHITECTURES[architecture]
    if model_type == family or _MODEL_TYPE_ALIASES.get(model_type) == family:
        return
    raise ValueError(f"config.json contradicts itself: model_type {model_type!r} but architectures "
                     f"{architecture!r} (whose model_type is {family!r}); fix one of them")


def _architecture_of(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config field 'architectures' must be a list of class names, got {archs!r}")
    for a in archs:
        if a in ARCHITECTURES:
            _check_model_type_agrees(raw.get("model_type"), a)
            return ARCHITECTURES[a]
    if archs:
        raise ValueError(f"unsupported architecture {archs!r}; supported: {sorted(ARCHITECTURES)}")
    model_type = raw.get("model_type")
    if model_type in _MODEL_TYPES:
        return model_type
    raise ValueError(f"unsupported model_type {model_type!r} (no 'architectures'); supported: "
                     f"{sorted(_MODEL_TYPES)}")


def _as_int(name: str, value: Any) -> int:
    """``value`` of config field ``name`` as an int (an integral float is accepted, a bool is not)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"config field {name!r} must be an integer, got {value!r}")


def _as_float(name: str, value: Any) -> float:
    """``value`` of config field ``name`` as a float (a bool or a string is not a number)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"config field {name!r} must be a number, got {value!r}")


_REQUIRED: Any = object()


def _int(raw: dict[str, Any], key: str, *aliases: str, default: Any = _REQUIRED) -> Any:
    """The first present (non-null) of ``key`` and its aliases (transformers renames some on
    save) as an int; ``default`` when none is, or the missing-field error when there is none."""
    for k in (key, *aliases):
        if raw.get(k) is not None:
            return _as_int(k, raw[k])
    if default is _REQUIRED:
        raise ValueError(f"config is missing required field {key!r}")
    return default


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    """Config field ``key`` as a JSON boolean (``default`` when absent or null); the string
    ``"false"`` is truthy in Python, so anything but a boolean is an error, as in transformers."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config field {key!r} must be true or false, got {value!r}")
    return value


def _default(arch: str, key: str, fallback: Any = _REQUIRED) -> Any:
    """transformers' default for ``key`` in family ``arch`` (``_HF_DEFAULTS``), else ``fallback``."""
    return _HF_DEFAULTS[arch].get(key, fallback)


def _int_or_default(raw: dict[str, Any], arch: str, key: str, null: Any) -> Any:
    """Config field ``key`` as an int; ``null`` when it is null; transformers' default for the
    family when it is absent (``null`` where transformers has none)."""
    return _int(raw, key, default=null) if key in raw else _default(arch, key, null)


def _rope_fields(raw: dict[str, Any], arch: str, problems: list[str]) -> dict[str, Any]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a mapping, got {params!r}")
    theta = _as_float("rope_theta", params.get("rope_theta", raw.get("rope_theta", _DEFAULT_THETA.get(arch, 10000.0))))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    scaling = None
    if rope_type == "yarn":
        factor = params.get("factor")
        orig = _as_int("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", raw.get("max_position_embeddings")))
        if orig <= 0:
            raise ValueError(f"rope original_max_position_embeddings must be positive, got {orig}")
        if factor is None:
            factor = _int(raw, "max_position_embeddings") / orig
        extra = {k: params[k] for k in _YARN_KEYS[2:] if params.get(k) is not None}
        # transformers treats missing/zero betas as the defaults (``or 32`` / ``or 1``)
        extra["beta_fast"] = float(extra.get("beta_fast") or 32.0)
        extra["beta_slow"] = float(extra.get("beta_slow") or 1.0)
        scaling = RopeScaling(factor=_as_float("factor", factor), original_max_position_embeddings=orig, **extra)
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r} (only 'default' and 'yarn' are implemented)")
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        problems.append("partial_rotary_factor != 1")
    return {"rope_theta": theta, "rope_scaling": scaling}


@dataclass(frozen=True)
class Fp8Weights:
    """A checkpoint's block-wise fp8 weights: each float8_e4m3fn ``X.weight [out, in]`` has a float
    ``X.weight_scale_inv [ceil(out / rows), ceil(in / cols)]`` (fused experts: ``[E, ...]`` both),
    and the weight is ``w.float() * scale_inv`` with each scale over its block (the last ones partial).

    block_size: (rows, cols) of a block; None: one scale per tensor (``[1, 1]`` or a scalar).
    """

    block_size: tuple[int, int] | None


def fp8_weights(raw: dict[str, Any]) -> Fp8Weights | None:
    """The fp8 weight format of config.json's ``quantization_config`` (DeepSeek-V3's
    ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
    [128, 128]}``); None when there is no quantization_config. ValueError, one line naming the method, for any other quantization (gptq, awq,
    compressed-tensors, fp8 with static activation scales, ...): the loader dequantizes fp8 weights
    into the compute dtype and nothing else."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config must be a mapping, got {quant!r}")
    method = quant.get("quant_method", "?")
    refused = f"quantization_config (quant_method {method!r}"
    if method != "fp8":
        raise ValueError(f"{refused}) is not supported: only block-wise fp8 weights (quant_method 'fp8') are "
                         "dequantized at load; dequantize the checkpoint to bf16 first")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{refused}, fmt {quant['fmt']!r}) is not supported: only fmt 'e4m3' fp8 weights are")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{refused}, activation_scheme {quant['activation_scheme']!r}) is not supported: only "
                         "'dynamic' (weight scales, no input scales) is dequantized at load")
    block = quant.get("weight_block_size")
    if block is None:
        return Fp8Weights(None)
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config weight_block_size must be two positive integers or null, got {block!r}")
    return Fp8Weights((int(block[0]), int(block[1])))


def _common_fields(raw: dict[str, Any], arch: str, problems: list[str]) -> dict[str, Any]:
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(_as_int("eos_token_id", e) for e in (eos if isinstance(eos, list) else [eos]))
    act = raw.get("hidden_act", "silu")
    if act == "swish":  # transformers' ACT2FN maps both names to SiLU
        act = "silu"
    if act != "silu":
        problems.append(f"hidden_act {act!r} (only 'silu' is implemented)")
    try:
        fp8_weights(raw)
    except ValueError as e:
        problems.append(str(e))
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    out = dict(
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=_int(raw, "hidden_size"),
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        num_attention_heads=_int(raw, "num_attention_heads"),
        max_position_embeddings=_int(raw, "max_position_embeddings", default=_default(arch, "max_position_embeddings")),
        rms_norm_eps=_as_float("rms_norm_eps", raw.get("rms_norm_eps", 1e-5 if arch == "mixtral" else 1e-6)),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
        hidden_act=act,
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        dtype=None if dtype is None else str(dtype).replace("torch.", ""),
    )
    out.update(_rope_fields(raw, arch, problems))
    return out


def _deepseek_fields(raw: dict[str, Any], arch: str, problems: list[str]) -> dict[str, Any]:
    heads = _int(raw, "num_attention_heads")
    v3 = arch == "deepseek_v3"
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if v3 and (scoring, method) != ("sigmoid", "noaux_tc"):
        problems.append(f"deepseek_v3 routing scoring_func={scoring!r} topk_method={method!r} "
                        "(only sigmoid + noaux_tc)")
    if not v3 and (scoring != "softmax" or method not in ("greedy", "group_limited_greedy")):
        problems.append(f"deepseek_v2 routing scoring_func={scoring!r} topk_method={method!r} "
                        "(only softmax + greedy / group_limited_greedy)")
    grouped = method in ("noaux_tc", "group_limited_greedy")
    if raw.get("mlp_bias"):
        problems.append("mlp_bias=True is not implemented")
    nope, rope = _int(raw, "qk_nope_head_dim"), _int(raw, "qk_rope_head_dim")
    return dict(
        attention="mla",
        num_key_value_heads=heads,
        head_dim=nope + rope,
        # absent: transformers' 1536; null: no q compression (V2-Lite's checkpoints say so)
        q_lora_rank=_int_or_default(raw, arch, "q_lora_rank", None),
        kv_lora_rank=_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=_int(raw, "v_head_dim"),
        intermediate_size=_int(raw, "intermediate_size"),
        moe_intermediate_size=_int(raw, "moe_intermediate_size"),
        num_experts=_int(raw, "n_routed_experts", "num_local_experts", "num_experts"),
        num_experts_per_tok=_int(raw, "num_experts_per_tok", default=_default(arch, "num_experts_per_tok")),
        num_shared_experts=_int_or_default(raw, arch, "n_shared_experts", 0),
        n_group=(_int_or_default(raw, arch, "n_group", 1) or 1) if grouped else 1,
        topk_group=(_int_or_default(raw, arch, "topk_group", 1) or 1) if grouped else 1,
        scoring_func=scoring,
        topk_method=method,
        # transformers' DeepseekV2 router never renormalises the top-k weights
        norm_topk_prob=_bool(raw, "norm_topk_prob", True) if v3 else False,
        routed_scaling_factor=_as_float("routed_scaling_factor", raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        first_k_dense_replace=_int(raw, "first_k_dense_replace", default=3 if v3 else 0),
        moe_layer_freq=_int(raw, "moe_layer_freq", default=1),
        # V3's interleave is a flag; V2's checkpoints are always in the interleaved-pair layout
        rope_interleave=_bool(raw, "rope_interleave", True) if v3 else True,
        attention_bias=_bool(raw, "attention_bias", False),
    )


def _sliding_window(raw: dict[str, Any], arch: str, enabled: bool, problems: list[str]) -> int | None:
    """The window transformers applies (None when off or null; absent: the family's default);
    a bad value is a problem."""
    window = raw.get("sliding_window", _default(arch, "sliding_window", None))
    if not enabled or window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        problems.append(f"sliding_window={window!r} must be a positive integer or null")
        return None
    return window


def _gqa_common(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    heads = _int(raw, "num_attention_heads")
    # heads <= 0: leave head_dim 0 for __post_init__ to name num_attention_heads
    derived = _int(raw, "hidden_size") // heads if heads > 0 else 0
    return dict(
        attention="gqa",
        # absent: transformers' default; null (or 0): one kv head per query head, as transformers
        num_key_value_heads=_int_or_default(raw, arch, "num_key_value_heads", 0) or heads,
        head_dim=_int(raw, "head_dim", default=0) or derived,
        num_experts_per_tok=_int(raw, "num_experts_per_tok", default=_default(arch, "num_experts_per_tok")),
    )


def _mixtral_fields(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    inter = _int(raw, "intermediate_size")
    out = _gqa_common(raw, "mixtral")
    out.update(intermediate_size=inter, moe_intermediate_size=inter,
               num_experts=_int(raw, "num_local_experts", "num_experts"), norm_topk_prob=True,
               sliding_window=_sliding_window(raw, "mixtral", True, problems))
    return out


def _qwen3_fields(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    out = _gqa_common(raw, "qwen3_moe")
    out.update(
        intermediate_size=_int(raw, "intermediate_size"),
        moe_intermediate_size=_int(raw, "moe_intermediate_size"),
        num_experts=_int(raw, "num_experts", "num_local_experts"),
        norm_topk_prob=_bool(raw, "norm_topk_prob", False),
        mlp_only_layers=_mlp_only_layers(raw),
        decoder_sparse_step=_int(raw, "decoder_sparse_step", default=1),
        qk_norm=True,
        attention_bias=_bool(raw, "attention_bias", False),
        sliding_window=_sliding_window(raw, "qwen3_moe", _bool(raw, "use_sliding_window", False), problems),
    )
    return out


def _mlp_only_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    layers = raw.get("mlp_only_layers") or ()
    if not isinstance(layers, list | tuple):
        raise ValueError(f"config field 'mlp_only_layers' must be a list of layer indices, got {layers!r}")
    return tuple(_as_int("mlp_only_layers", i) for i in layers)
