"""A trainable full-sequence MoE language model whose weights are a Hugging Face checkpoint.

Shape legend: B sequences, S positions, T = B*S tokens, D hidden, H heads, V vocab,
E routed experts, K top-k, I expert intermediate.

The serving model (``moe.model``) is inference-only (paged KV cache, no autograd); this one
runs causal attention over whole sequences so it can be trained, and reuses the serving
code for everything whose numerics must agree with the checkpoint's meaning: the config
(``moe.config.ModelConfig``), the routers (``moe.router.Router``: softmax/sigmoid scores,
groups, e_score_correction_bias, renormalisation, routed scaling), RMSNorm, dense MLPs and
rotary embeddings. ``hf_state_dict()`` names every tensor as the family's checkpoint does,
so ``moe.tiny.save_checkpoint`` writes it and transformers and the engine load it.

Routed experts are stacked (``w13`` [E, 2I, D] = gate rows then up rows, ``w_down`` [E, D, I]) and split
into per-expert tensors on save. Each forward records, per MoE layer, how many tokens each
expert received (``last_expert_counts`` [L_moe, E]); the trainer uses it for DeepSeek-V3's
bias update and for its load report.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moe.config import ModelConfig
from moe.layers import DenseMLP, RMSNorm
from moe.layers.rope import RotaryEmbedding, apply_rotary
from moe.router import Router

_LATENT_NORM_EPS = 1e-6  # transformers builds the MLA latent norms with the default eps


class _MLA(nn.Module):
    """DeepSeek multi-head latent attention, naive (expanded) form. x: [B, S, D] -> [B, S, D]."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        d, h = c.hidden_size, c.num_attention_heads
        self.h, self.nope, self.rope, self.v_dim, self.c_kv = h, c.qk_nope_head_dim, c.qk_rope_head_dim, \
            c.v_head_dim, c.kv_lora_rank
        self.scale, self.interleave, self.q_lora = c.softmax_scale, c.rope_interleave, c.q_lora_rank
        qk, bias = self.nope + self.rope, c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.c_kv + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.c_kv, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.c_kv, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        t = b * s
        x = x.reshape(t, -1)
        q = self.q_proj(x) if self.q_lora is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.h, self.nope + self.rope)
        q = torch.cat((q[..., : self.nope], apply_rotary(q[..., self.nope:], cos, sin, self.interleave)), dim=-1)
        latent = self.kv_a_proj_with_mqa(x)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent[:, : self.c_kv])).view(t, self.h, self.nope + self.v_dim)
        k_pe = apply_rotary(latent[:, None, self.c_kv:], cos, sin, self.interleave).expand(t, self.h, self.rope)
        k = torch.cat((kv[..., : self.nope], k_pe), dim=-1)
        v = kv[..., self.nope:]
        q, k, v = (z.view(b, s, self.h, -1).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [B, H, S, Vd]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.h * self.v_dim))


class _GQA(nn.Module):
    """Grouped-query attention (Mixtral; Qwen3 with per-head q/k RMSNorm). x: [B, S, D] -> [B, S, D]."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        d, self.h, self.hkv, self.hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(d, self.h * self.hd, bias=bias)
        self.k_proj = nn.Linear(d, self.hkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(d, self.hkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.h * self.hd, d, bias=False)
        self.qk_norm = c.qk_norm
        if c.qk_norm:
            self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.scale, self.interleave = c.softmax_scale, c.rope_interleave

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        t = b * s
        x = x.reshape(t, -1)
        q = self.q_proj(x).view(t, self.h, self.hd)
        k = self.k_proj(x).view(t, self.hkv, self.hd)
        v = self.v_proj(x).view(t, self.hkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin, self.interleave), apply_rotary(k, cos, sin, self.interleave)
        q, k, v = (z.view(b, s, -1, self.hd).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.h * self.hd))


class _MoE(nn.Module):
    """Router + stacked SwiGLU experts (+ DeepSeek shared experts). x: [B, S, D] -> [B, S, D]."""

    def __init__(self, c: ModelConfig, layer_id: int) -> None:
        super().__init__()
        e, d, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate = Router(c)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d))  # [gate; up] rows: one GEMM per expert
        self.w_down = nn.Parameter(torch.empty(e, d, i))
        self.shared_experts = DenseMLP(d, i * c.num_shared_experts) if c.num_shared_experts else None
        self.counts = torch.zeros(e, dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        ids, weights = self.gate(x)  # [T, K] int64, [T, K] float32
        flat = ids.reshape(-1)
        self.counts = torch.bincount(flat, minlength=self.w13.shape[0])
        order = flat.argsort(stable=True)
        token = torch.arange(x.shape[0]).repeat_interleave(ids.shape[1])[order]  # [T*K] sorted by expert
        xs = x[token]
        inter = self.w_down.shape[2]
        ys = []
        for e, part in enumerate(xs.split(self.counts.tolist())):
            if part.shape[0]:
                gate_up = part @ self.w13[e].T  # [n, 2I]
                ys.append((F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ self.w_down[e].T)
        y = torch.cat(ys) * weights.reshape(-1)[order, None].to(x.dtype)  # [T*K, D]
        out = torch.zeros_like(x).index_add(0, token, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class _Layer(nn.Module):
    def __init__(self, c: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _MLA(c) if c.attention == "mla" else _GQA(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp: nn.Module = _MoE(c, layer_id) if c.is_moe_layer(layer_id) else DenseMLP(
            c.hidden_size, c.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class TrainableMoE(nn.Module):
    """ids [B, S] int64 -> logits [B, S, V] float32; one decoder of the config's family."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.rotary = RotaryEmbedding(config.rope_dim, config.rope_theta, config.rope_scaling,
                                      config.rope_interleave)
        for p in self.parameters():
            p.requires_grad_(True)
        for m in self.moe_layers():  # trained by the bias update, not by gradients
            if m.gate.e_score_correction_bias is not None:
                m.gate.e_score_correction_bias.requires_grad_(False)

    def moe_layers(self) -> list[_MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, _MoE)]

    @property
    def last_expert_counts(self) -> torch.Tensor:
        """[L_moe, E] int64: tokens routed to each expert in the last forward (K per token)."""
        return torch.stack([m.counts for m in self.moe_layers()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        cos, sin = self.rotary(torch.arange(s).repeat(b))  # [T, R/2] each
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, head).float()

    @torch.no_grad()
    def init_weights_(self, seed: int) -> None:
        """Linear weights ~ N(0, 1/in), residual output projections also / sqrt(2 L); embeddings
        N(0, 1); norms 1; routers N(0, 1/D); biases and e_score_correction_bias 0."""
        gen = torch.Generator().manual_seed(seed)
        depth = 1.0 / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif p.dim() == 1 or name.endswith("e_score_correction_bias"):
                p.zero_()
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                scale = depth if name.endswith(("o_proj.weight", "down_proj.weight", "w_down")) else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(fan_in))
        if self.config.tie_word_embeddings:
            self.embed_tokens.weight.mul_(1.0 / math.sqrt(self.config.hidden_size))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor under its checkpoint name (``model.layers.N...``, ``lm_head.weight``)."""
        mixtral = self.config.architecture == "mixtral"
        out: dict[str, torch.Tensor] = {}
        for name, t in self.state_dict().items():
            if name.startswith("lm_head."):
                out[name] = t
                continue
            if name.endswith((".mlp.w13", ".mlp.w_down")):
                continue
            key = f"model.{name}"
            if mixtral:
                key = key.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            out[key] = t
        for idx, layer in enumerate(self.layers):
            if not isinstance(layer.mlp, _MoE):
                continue
            m = layer.mlp
            base = f"model.layers.{idx}.block_sparse_moe" if mixtral else f"model.layers.{idx}.mlp"
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            inter = m.w_down.shape[2]
            for e in range(m.w13.shape[0]):
                gate, up = m.w13[e, :inter], m.w13[e, inter:]
                for n, w in zip(names, (gate, up, m.w_down[e])):
                    out[f"{base}.experts.{e}.{n}.weight"] = w.detach().clone()
        return out

    @torch.no_grad()
    def load_hf_state_dict_(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of ``hf_state_dict``: copy checkpoint tensors (names as stored) into this
        model; raises KeyError naming a missing tensor."""
        mixtral = self.config.architecture == "mixtral"
        for name, p in self.state_dict().items():
            if name.endswith((".mlp.w13", ".mlp.w_down")):
                continue
            key = name if name.startswith("lm_head.") else f"model.{name}"
            if mixtral:
                key = key.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            p.copy_(tensors[key])
        for idx, layer in enumerate(self.layers):
            if isinstance(layer.mlp, _MoE):
                m = layer.mlp
                base = f"model.layers.{idx}.block_sparse_moe" if mixtral else f"model.layers.{idx}.mlp"
                names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
                inter = m.w_down.shape[2]
                for e in range(m.w13.shape[0]):
                    m.w13[e, :inter].copy_(tensors[f"{base}.experts.{e}.{names[0]}.weight"])
                    m.w13[e, inter:].copy_(tensors[f"{base}.experts.{e}.{names[1]}.weight"])
                    m.w_down[e].copy_(tensors[f"{base}.experts.{e}.{names[2]}.weight"])


def load_trained(path: str | Path) -> TrainableMoE:
    """A ``TrainableMoE`` holding the checkpoint at ``path`` (one safetensors file or shards)."""
    from safetensors.torch import load_file

    directory = Path(path)
    model = TrainableMoE(ModelConfig.from_hf(directory))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(str(f))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    model.load_hf_state_dict_({k: v.float() for k, v in tensors.items()})
    return model.eval()
