"""Helpers for the loader tests: tiny random Hugging Face MoE checkpoints, a minimal
target module with the canonical names, and a safe_open that records every read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe.experts import Experts

HID, INTER, NEXP, VOCAB, NLAYERS = 16, 8, 4, 64, 2  # hidden, expert intermediate, experts, vocab, layers


def hf_config(family: str, **overrides: Any):
    """A tiny transformers config of one family (2 layers, 4 experts, hidden 16, expert intermediate 8)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HID, num_hidden_layers=NLAYERS, num_attention_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2)  # fmt: skip
    if family in ("deepseek_v3", "deepseek_v2"):
        mla = dict(intermediate_size=32, moe_intermediate_size=INTER, num_key_value_heads=2, n_routed_experts=NEXP,
                   n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8, qk_nope_head_dim=4,
                   qk_rope_head_dim=4, v_head_dim=4)  # fmt: skip
        if family == "deepseek_v3":
            cfg = tf.DeepseekV3Config(**common, **mla, n_group=2, topk_group=1, q_lora_rank=8)
        else:
            cfg = tf.DeepseekV2Config(**common, **mla, q_lora_rank=None)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=INTER, num_key_value_heads=1, num_local_experts=NEXP)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=32, moe_intermediate_size=INTER, num_key_value_heads=1,
                                head_dim=8, num_experts=NEXP)  # fmt: skip
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build_hf_model(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A random transformers CausalLM of ``family``; every weight is non-trivial."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(family, **overrides))
    with torch.no_grad():
        for p in model.parameters():  # init leaves norms at 1 and biases at 0: make them distinct
            p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b))
    return model


def save_hf(model: nn.Module, out: Path, sharded: bool = False) -> Path:
    model.save_pretrained(out, max_shard_size="4KB" if sharded else "50GB")
    return out


def is_moe_layer(hf_layer: nn.Module) -> bool:
    return hasattr(hf_layer.mlp, "experts")


class _Norm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)


def _linear(i: int, o: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(i, o, bias=False, dtype=dtype).requires_grad_(False)


def build_target(hf: nn.Module, slots: dict[int, list[int]], dtype=torch.float32, tie=False) -> nn.Module:
    """A minimal module with canonical names mirroring ``hf``: embed, per layer
    input_layernorm + self_attn.o_proj + mlp (MoE: gate [+ bias] + Experts holding the
    logical experts ``slots[layer]``; dense: gate/up/down_proj), lm_head (tied if ``tie``)."""
    target = nn.Module()
    target.model = nn.Module()
    target.model.embed_tokens = nn.Embedding(VOCAB, HID, dtype=dtype).requires_grad_(False)
    target.model.layers = nn.ModuleList()
    for i, hf_layer in enumerate(hf.model.layers):
        layer = nn.Module()
        layer.input_layernorm = _Norm(HID, dtype)
        layer.self_attn = nn.Module()
        layer.self_attn.o_proj = _linear(hf_layer.self_attn.o_proj.in_features, HID, dtype)
        layer.mlp = nn.Module()
        if is_moe_layer(hf_layer):
            layer.mlp.gate = nn.Module()
            layer.mlp.gate.weight = nn.Parameter(torch.zeros(NEXP, HID, dtype=dtype), requires_grad=False)
            if hasattr(hf_layer.mlp.gate, "e_score_correction_bias"):
                layer.mlp.gate.register_buffer("e_score_correction_bias", torch.zeros(NEXP, dtype=torch.float32))
            p2l = torch.tensor(slots[i], dtype=torch.int64)
            layer.mlp.experts = Experts(len(slots[i]), HID, INTER, p2l, dtype=dtype)
            layer.mlp.experts.w13.zero_()
            layer.mlp.experts.w2.zero_()
        else:
            inter = hf_layer.mlp.gate_proj.out_features
            layer.mlp.gate_proj, layer.mlp.up_proj = _linear(HID, inter, dtype), _linear(HID, inter, dtype)
            layer.mlp.down_proj = _linear(inter, HID, dtype)
        target.model.layers.append(layer)
    target.lm_head = _linear(HID, VOCAB, dtype)
    if tie:
        target.lm_head.weight = target.model.embed_tokens.weight
    return target


def expected_tensors(hf: nn.Module, slots: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """The oracle: canonical name -> value, from transformers' in-memory model (whose
    experts are fused ``gate_up_proj [E, 2I, D]``, gate rows first, ``down_proj [E, D, I]``)."""
    sd = hf.state_dict()
    out = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i, hf_layer in enumerate(hf.model.layers):
        pre = f"model.layers.{i}"
        out[f"{pre}.input_layernorm.weight"] = sd[f"{pre}.input_layernorm.weight"]
        out[f"{pre}.self_attn.o_proj.weight"] = sd[f"{pre}.self_attn.o_proj.weight"]
        if not is_moe_layer(hf_layer):
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{pre}.mlp.{p}.weight"] = sd[f"{pre}.mlp.{p}.weight"]
            continue
        out[f"{pre}.mlp.gate.weight"] = sd[f"{pre}.mlp.gate.weight"]
        if f"{pre}.mlp.gate.e_score_correction_bias" in sd:
            out[f"{pre}.mlp.gate.e_score_correction_bias"] = sd[f"{pre}.mlp.gate.e_score_correction_bias"]
        idx = torch.tensor(slots[i])
        out[f"{pre}.mlp.experts.w13"] = sd[f"{pre}.mlp.experts.gate_up_proj"][idx]
        out[f"{pre}.mlp.experts.w2"] = sd[f"{pre}.mlp.experts.down_proj"][idx]
    return out


def write_config(out: Path, **fields: Any) -> None:
    (out / "config.json").write_text(json.dumps(fields))


class RecordingOpen:
    """Stands in for ``safe_open``: records every file opened and every data read as
    ``(key, index)`` (index None for a whole tensor, else the slice index)."""

    def __init__(self, real) -> None:
        self.real = real
        self.opened: list[str] = []
        self.reads: list[tuple[str, Any]] = []

    def __call__(self, filename, framework, device="cpu"):
        self.opened.append(str(filename))
        return _Handle(self.real(filename, framework=framework, device=device), self.reads)

    def keys_read(self) -> list[str]:
        return [k for k, _ in self.reads]


class _Handle:
    def __init__(self, handle, reads) -> None:
        self.h, self.reads = handle, reads

    def __enter__(self):
        self.h.__enter__()
        return self

    def __exit__(self, *exc):
        return self.h.__exit__(*exc)

    def keys(self):
        return self.h.keys()

    def get_tensor(self, key):
        self.reads.append((key, None))
        return self.h.get_tensor(key)

    def get_slice(self, key):
        return _Slice(self.h.get_slice(key), key, self.reads)


class _Slice:
    def __init__(self, sl, key, reads) -> None:
        self.sl, self.key, self.reads = sl, key, reads

    def get_shape(self):
        return self.sl.get_shape()

    def get_dtype(self):
        return self.sl.get_dtype()

    def __getitem__(self, index):
        self.reads.append((self.key, index))
        return self.sl[index]
