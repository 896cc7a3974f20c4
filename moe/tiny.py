"""Random-weight checkpoints in the exact Hugging Face layout of each MoE family.

``write_tiny_checkpoint`` writes ``config.json``, ``generation_config.json`` and
safetensors weights (one file, or shards plus ``model.safetensors.index.json``)
that ``transformers.AutoModelForCausalLM.from_pretrained`` loads without missing
or unexpected keys. The tokenizer files are written by ``launch`` (this package
may import only torch, safetensors, numpy and the standard library); the vocab
size here must then equal the tokenizer's, and the special-token ids are fixed:
``BOS_TOKEN_ID`` = 0, ``EOS_TOKEN_ID`` = 1.

Sizes: ``tiny`` is for tests (hidden 64, 8 routed experts, 2-3 layers, a dense
first layer where the family has one); ``small`` is a benchmark model of a few
hundred million parameters (hidden 1024, 64 routed experts top-6 for DeepSeek).

Tensor names are the families' checkpoint names: per-expert
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` (DeepSeek, Qwen3),
``model.layers.N.block_sparse_moe.experts.E.w1/w2/w3.weight`` (Mixtral),
``mlp.gate.e_score_correction_bias`` (DeepSeek-V3), ``mlp.shared_experts.*``.

Init: linear weights ``[out, in]`` ~ N(0, 1/in) so activations keep unit scale at
any width; embeddings ~ N(0, 1); norm weights 1 + N(0, 0.05^2). Router rows are
scaled per expert by exp(N(0, 0.5^2)), so some experts are selected much more
often than others (non-uniform routing for balancer tests); DeepSeek-V3's
``e_score_correction_bias`` ~ N(0, 0.05^2).

Router skew (``router_skew`` S > 0, default 0 = the init above, unchanged): each MoE
layer draws its own order of the experts, and the router row of the expert ranked j-th
(0 = hottest) is scaled by exp(-S * j / (E - 1)); a larger-norm row wins the top-k far
more often, so a few experts take most tokens, and which ones differs by layer. On
DeepSeek-V3 the ``e_score_correction_bias`` of the ranked experts also gets
+S * 0.1 * (1 - 2 j / (E - 1)), which the selection adds to the sigmoid scores.
``config_overrides`` replace config.json fields before the shapes are derived (a wider
hidden size, more experts, fewer layers): the weights follow the overridden config.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

ARCHITECTURES = ("deepseek_v3", "deepseek_v2", "mixtral", "qwen3_moe")
SIZES = ("tiny", "small")
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
DEFAULT_VOCAB_SIZE = {"tiny": 512, "small": 1024}
# "small" is sharded so the multi-file (index.json) loading path is exercised.
DEFAULT_SHARD_BYTES = {"tiny": None, "small": 256 * 1024**2}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Width/depth per size; each family's builder picks what it uses.
_DIMS = {
    "tiny": dict(
        hidden=64, heads=4, kv_heads=2, layers=3, dense_inter=128, moe_inter=32, experts=8, top_k=2,
        q_lora=48, kv_lora=32, nope=16, rope=8, v=16, head_dim=32, n_group=2, topk_group=1,
        max_pos=2048, orig_max_pos=512, mixtral_layers=2, mixtral_inter=96, mixtral_experts=8,
    ),
    "small": dict(
        hidden=1024, heads=16, kv_heads=4, layers=10, dense_inter=2816, moe_inter=256, experts=64,
        top_k=6, q_lora=512, kv_lora=256, nope=64, rope=32, v=64, head_dim=64, n_group=8, topk_group=4,
        max_pos=32768, orig_max_pos=4096, mixtral_layers=8, mixtral_inter=2048, mixtral_experts=8,
    ),
}


def _common(vocab_size: int, dtype: torch.dtype, d: dict) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": d["hidden"],
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "max_position_embeddings": d["max_pos"],
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "tie_word_embeddings": False,
        "use_cache": True,
        "attention_dropout": 0.0,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def _yarn(d: dict) -> dict:
    factor = d["max_pos"] / d["orig_max_pos"]
    return {
        "type": "yarn", "factor": factor, "original_max_position_embeddings": d["orig_max_pos"],
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    }


def _deepseek_config(arch: str, d: dict, common: dict) -> dict:
    v3 = arch == "deepseek_v3"
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": arch,
        **common,
        "num_key_value_heads": d["heads"],
        "intermediate_size": d["dense_inter"],
        "moe_intermediate_size": d["moe_inter"],
        "n_routed_experts": d["experts"],
        "n_shared_experts": 1 if v3 else 2,
        "num_experts_per_tok": d["top_k"],
        "n_group": d["n_group"],
        "topk_group": d["topk_group"],
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy",
        "scoring_func": "sigmoid" if v3 else "softmax",
        "routed_scaling_factor": 2.5 if v3 else 1.0,
        "norm_topk_prob": v3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "ep_size": 1,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        # DeepSeek-V2-Lite style (no q compression) for V2, so both MLA query paths exist.
        "q_lora_rank": d["q_lora"] if v3 else None,
        "kv_lora_rank": d["kv_lora"],
        "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": d["rope"],
        "v_head_dim": d["v"],
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": _yarn(d),
        "pretraining_tp": 1,
    }
    if v3:
        cfg["num_nextn_predict_layers"] = 0  # no MTP weights are written
    return cfg


def _mixtral_config(d: dict, common: dict) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **common,
        "num_hidden_layers": d["mixtral_layers"],
        "num_key_value_heads": d["kv_heads"],
        "intermediate_size": d["mixtral_inter"],
        "num_local_experts": d["mixtral_experts"],
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "output_router_logits": False,
        "sliding_window": None,
    }


def _qwen3_moe_config(d: dict, common: dict) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **common,
        "num_key_value_heads": d["kv_heads"],
        "head_dim": d["head_dim"],  # != hidden / heads, as in Qwen3-30B-A3B
        "intermediate_size": d["dense_inter"],
        "moe_intermediate_size": d["moe_inter"],
        "num_experts": d["experts"],
        "num_experts_per_tok": d["top_k"],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],  # one dense layer, so the dense path is exercised
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": d["layers"],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }


def build_tiny_config(
    arch: str, *, size: str = "tiny", vocab_size: int | None = None, dtype: torch.dtype | None = None,
    dims: Mapping[str, int] | None = None,
) -> dict:
    """The ``config.json`` dict (Hugging Face format of ``arch``) for a tiny or small model.

    vocab_size defaults to ``DEFAULT_VOCAB_SIZE[size]``; dtype (stored weights) defaults to
    float32 for tiny, bfloat16 for small. ``dims`` replaces entries of the size's width/depth
    table (keys of ``_DIMS[size]``: hidden, layers, experts, top_k, n_group, ...).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    vocab_size = DEFAULT_VOCAB_SIZE[size] if vocab_size is None else vocab_size
    if vocab_size <= EOS_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {EOS_TOKEN_ID}, got {vocab_size}")
    dtype = dtype or (torch.float32 if size == "tiny" else torch.bfloat16)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {list(_DTYPE_NAMES)}")
    unknown = sorted(set(dims or {}) - set(_DIMS[size]))
    if unknown:
        raise ValueError(f"unknown dims {unknown}; expected keys of {sorted(_DIMS[size])}")
    d = {**_DIMS[size], **(dims or {})}
    common = _common(vocab_size, dtype, d)
    if arch in ("deepseek_v3", "deepseek_v2"):
        return _deepseek_config(arch, d, common)
    if arch == "mixtral":
        return _mixtral_config(d, common)
    return _qwen3_moe_config(d, common)


def _mlp_shapes(prefix: str, hidden: int, inter: int, names: tuple[str, str, str]) -> dict:
    gate, up, down = names
    return {
        f"{prefix}.{gate}.weight": (inter, hidden),
        f"{prefix}.{up}.weight": (inter, hidden),
        f"{prefix}.{down}.weight": (hidden, inter),
    }


def _mla_shapes(p: str, c: dict) -> dict:
    h, d = c["num_attention_heads"], c["hidden_size"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out: dict[str, tuple[int, ...]] = {}
    if c["q_lora_rank"] is None:
        out[f"{p}.q_proj.weight"] = (h * qk, d)
    else:
        out[f"{p}.q_a_proj.weight"] = (c["q_lora_rank"], d)
        out[f"{p}.q_a_layernorm.weight"] = (c["q_lora_rank"],)
        out[f"{p}.q_b_proj.weight"] = (h * qk, c["q_lora_rank"])
    out[f"{p}.kv_a_proj_with_mqa.weight"] = (c["kv_lora_rank"] + c["qk_rope_head_dim"], d)
    out[f"{p}.kv_a_layernorm.weight"] = (c["kv_lora_rank"],)
    out[f"{p}.kv_b_proj.weight"] = (h * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
    out[f"{p}.o_proj.weight"] = (d, h * c["v_head_dim"])
    return out


def _gqa_shapes(p: str, c: dict) -> dict:
    d, h, hkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or d // h
    out = {
        f"{p}.q_proj.weight": (h * hd, d),
        f"{p}.k_proj.weight": (hkv * hd, d),
        f"{p}.v_proj.weight": (hkv * hd, d),
        f"{p}.o_proj.weight": (d, h * hd),
    }
    if c["model_type"] == "qwen3_moe":
        out[f"{p}.q_norm.weight"] = (hd,)
        out[f"{p}.k_norm.weight"] = (hd,)
    return out


def _ffn_shapes(p: str, c: dict, layer: int) -> dict:
    d, mt = c["hidden_size"], c["model_type"]
    swiglu = ("gate_proj", "up_proj", "down_proj")
    if mt == "mixtral":
        e, inter = c["num_local_experts"], c["intermediate_size"]
        out = {f"{p}.block_sparse_moe.gate.weight": (e, d)}
        for i in range(e):
            out |= _mlp_shapes(f"{p}.block_sparse_moe.experts.{i}", d, inter, ("w1", "w3", "w2"))
        return out
    if mt == "qwen3_moe":
        dense = layer in c["mlp_only_layers"] or (layer + 1) % c["decoder_sparse_step"] != 0
        e = c["num_experts"]
    else:
        dense = layer < c["first_k_dense_replace"] or layer % c["moe_layer_freq"] != 0
        e = c["n_routed_experts"]
    if dense:
        return _mlp_shapes(f"{p}.mlp", d, c["intermediate_size"], swiglu)
    inter = c["moe_intermediate_size"]
    out = {f"{p}.mlp.gate.weight": (e, d)}
    if mt == "deepseek_v3":
        out[f"{p}.mlp.gate.e_score_correction_bias"] = (e,)
    for i in range(e):
        out |= _mlp_shapes(f"{p}.mlp.experts.{i}", d, inter, swiglu)
    if mt.startswith("deepseek") and c["n_shared_experts"]:
        out |= _mlp_shapes(f"{p}.mlp.shared_experts", d, inter * c["n_shared_experts"], swiglu)
    return out


def compute_checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint described by ``config`` (a config.json dict)
    mapped to its shape, in file order (embedding, layers 0..L-1, final norm, lm_head)."""
    d, v = config["hidden_size"], config["vocab_size"]
    mla = config["model_type"].startswith("deepseek")
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out[f"{p}.input_layernorm.weight"] = (d,)
        out |= _mla_shapes(f"{p}.self_attn", config) if mla else _gqa_shapes(f"{p}.self_attn", config)
        out[f"{p}.post_attention_layernorm.weight"] = (d,)
        out |= _ffn_shapes(p, config, layer)
    out["model.norm.weight"] = (d,)
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, d)
    return out


def count_parameters(config: dict) -> int:
    """Total parameter count of the checkpoint described by ``config``."""
    return sum(math.prod(s) for s in compute_checkpoint_shapes(config).values())


def _init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=gen) * 0.05
    if len(shape) == 1:  # RMSNorm weights
        return 1.0 + torch.randn(shape, generator=gen) * 0.05
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    if name.endswith(".gate.weight"):  # router [E, D]: per-expert scale -> skewed load
        w *= torch.exp(0.5 * torch.randn(shape[0], 1, generator=gen))
    return w


def _skew_order(name: str, num_experts: int, seed: int) -> torch.Tensor:
    """rank [E] float: 0 for the layer's hottest expert .. 1 for its coldest (a per-layer
    permutation drawn from (seed, layer), independent of the weights' own random stream)."""
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 0
    gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + layer)
    order = torch.randperm(num_experts, generator=gen)
    rank = torch.empty(num_experts)
    rank[order] = torch.arange(num_experts, dtype=torch.float32) / max(num_experts - 1, 1)
    return rank


def apply_router_skew(name: str, tensor: torch.Tensor, skew: float, seed: int) -> torch.Tensor:
    """Skew one router tensor (see the module docstring); other tensors pass through.

    tensor: a router weight [E, D] (``*.gate.weight``) or DeepSeek-V3's
    ``e_score_correction_bias`` [E]. Returns a tensor of the same shape.
    """
    if skew <= 0:
        return tensor
    if name.endswith(".gate.weight") and tensor.dim() == 2:
        rank = _skew_order(name, tensor.shape[0], seed)
        return tensor * torch.exp(-skew * rank)[:, None]
    if name.endswith("e_score_correction_bias"):
        rank = _skew_order(name, tensor.shape[0], seed)
        return tensor + skew * 0.1 * (1 - 2 * rank)
    return tensor


def _shard_plan(shapes: dict, elem_bytes: int, shard_bytes: int | None) -> list[list[str]]:
    if shard_bytes is None:
        return [list(shapes)]
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * elem_bytes
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _iter_shards(
    shapes: dict, plan: list[list[str]], dtype: torch.dtype, seed: int, router_skew: float = 0.0
) -> Iterator[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for names in plan:
        yield {n: apply_router_skew(n, _init_tensor(n, shapes[n], gen), router_skew, seed).to(dtype).contiguous()
               for n in names}


def _write_files(
    config: dict, out: Path, plan: list[list[str]], shards: Iterator[dict[str, torch.Tensor]], elem: int
) -> int:
    """Write the safetensors files of ``plan`` (one dict per shard from ``shards``), the index
    when sharded, config.json and generation_config.json. Returns the number of files."""
    n = len(plan)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    for fname, tensors in zip(files, shards):
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map |= {name: fname for name in tensors}
    if n > 1:
        total = sum(math.prod(s) for s in compute_checkpoint_shapes(config).values()) * elem
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen_cfg = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return n


def _config_dtype(config: dict) -> torch.dtype:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    by_name = {v: k for k, v in _DTYPE_NAMES.items()}
    if name not in by_name:
        raise ValueError(f"unsupported checkpoint dtype {name!r}; expected one of {sorted(by_name)}")
    return by_name[name]


def save_checkpoint(
    config: dict, tensors: Mapping[str, torch.Tensor], out_dir: str | Path, *, shard_bytes: int | None = None
) -> Path:
    """Write given weights in the same layout as ``write_tiny_checkpoint`` (trained models).

    config: a ``build_tiny_config`` dict; its dtype (``torch_dtype``) is the stored dtype.
    tensors: exactly the names and shapes of ``compute_checkpoint_shapes(config)`` (any float
    dtype; cast on write). Raises ValueError naming a missing, unexpected or misshapen tensor.
    """
    shapes = compute_checkpoint_shapes(config)
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise ValueError(f"checkpoint tensors do not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, config wants {shape}")
    dtype = _config_dtype(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    elem = torch.empty((), dtype=dtype).element_size()
    plan = _shard_plan(shapes, elem, shard_bytes)
    shards = ({n: tensors[n].detach().to("cpu", dtype).contiguous() for n in names} for names in plan)
    _write_files(config, out, plan, shards, elem)
    return out


def write_tiny_checkpoint(
    arch: str,
    out_dir: str | Path,
    *,
    size: str = "tiny",
    seed: int = 0,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
    shard_bytes: int | None | str = "auto",
    log: Callable[[str], None] | None = None,
    router_skew: float = 0.0,
    config_overrides: dict | None = None,
) -> Path:
    """Write config.json, generation_config.json and random safetensors weights to out_dir.

    arch: one of ``ARCHITECTURES``; size: "tiny" | "small"; seed: weights are a pure
    function of (arch, size, seed, vocab_size, dtype). shard_bytes: "auto" (unsharded for
    tiny, 256 MiB shards for small), None (one file) or a byte budget per shard; sharded
    output has ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
    router_skew: >= 0, how strongly routers prefer a few experts per layer (0: as before).
    config_overrides: config.json fields to replace (``build_tiny_config`` then these).
    Returns: the checkpoint directory. The tokenizer is not written here (see launch).
    """
    if not router_skew >= 0:
        raise ValueError(f"router_skew must be >= 0, got {router_skew}")
    config = build_tiny_config(arch, size=size, vocab_size=vocab_size, dtype=dtype)
    unknown = sorted(set(config_overrides or {}) - set(config))
    if unknown:
        raise ValueError(f"config override {unknown[0]!r} is not a field of the {arch} config.json; "
                         f"fields: {sorted(config)}")
    config.update(config_overrides or {})
    dtype = dtype or (torch.float32 if size == "tiny" else torch.bfloat16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = compute_checkpoint_shapes(config)
    if shard_bytes == "auto":
        shard_bytes = DEFAULT_SHARD_BYTES[size]
    elem = torch.empty((), dtype=dtype).element_size()
    plan = _shard_plan(shapes, elem, shard_bytes)  # type: ignore[arg-type]
    n = _write_files(config, out, plan, _iter_shards(shapes, plan, dtype, seed, router_skew), elem)
    if log is not None:
        log(f"wrote {arch} {size} checkpoint to {out}: {count_parameters(config):,} parameters, {n} file(s)")
    return out
