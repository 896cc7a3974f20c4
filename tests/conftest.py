"""Shared fixtures: tiny random Hugging Face checkpoints written with ``save_pretrained``.

``hf_checkpoints`` (session-scoped) maps a case name to a directory holding a checkpoint of
one family, built from transformers' own config classes with the features each family's
math depends on: V2-Lite style MLA (q_lora_rank null) with group-limited routing, V3 with
YaRN + interleaved rope + noaux_tc grouped routing + a bias, Mixtral GQA, Qwen3 q/k norms
with dense layers via ``mlp_only_layers`` / ``decoder_sparse_step`` and tied embeddings.
Weights are re-drawn larger than transformers' init so that routing and logits are decisive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

COMMON: dict[str, Any] = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                              rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=None)

HF_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v2": ("DeepseekV2Config", dict(
        COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, q_lora_rank=None,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5, rope_theta=10000.0,
    )),
    "deepseek_v3": ("DeepseekV3Config", dict(
        COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             beta_fast=32, beta_slow=1, mscale=0.8, mscale_all_dim=1.0),
    )),
    "mixtral": ("MixtralConfig", dict(
        COMMON, num_hidden_layers=2, intermediate_size=96, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0, rms_norm_eps=1e-5,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        COMMON, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
        head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
        decoder_sparse_step=1, tie_word_embeddings=True, attention_bias=True, rope_theta=10000.0,
    )),
}


# Held-out style variants of the same families: other routing sizes, layouts and rope settings.
HF_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v3_top1_halfsplit_bias": ("deepseek_v3", dict(  # an odd nope part: q/k heads of 23
        rope_interleave=False, num_experts_per_tok=1, n_group=1, topk_group=1, norm_topk_prob=False,
        attention_bias=True, qk_nope_head_dim=15)),
    "deepseek_v2_yarn_greedy_qlora": ("deepseek_v2", dict(
        topk_method="greedy", n_group=None, topk_group=None, q_lora_rank=16, first_k_dense_replace=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32,
                             mscale=0.707, mscale_all_dim=0.707))),
    "mixtral_top1_tied_mqa": ("mixtral", dict(
        num_experts_per_tok=1, tie_word_embeddings=True, num_key_value_heads=1, head_dim=None)),
    "qwen3_moe_norm_sparse_step2": ("qwen3_moe", dict(
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[], attention_bias=False,
        tie_word_embeddings=False)),
}
for _name, (_base, _change) in HF_VARIANTS.items():
    HF_CASES[_name] = (HF_CASES[_base][0], {**HF_CASES[_base][1], **_change})


def _redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights ~ N(0, 1/fan_in) (embeddings N(0, 1)), norms 1 + N(0, 0.1^2), biases N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def write_hf_checkpoint(case: str, out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Build ``case`` (config fields replaced by ``overrides``) with transformers, redraw its
    weights, ``save_pretrained`` it (fp32)."""
    import transformers

    cls_name, kwargs = HF_CASES[case]
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw_weights(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# Folders whose every test runs a whole engine, spawns ranks or a Ray cluster: `-m "not slow"` skips
# them (the inner loop); unit tests that take seconds carry @pytest.mark.slow themselves.
SLOW_FOLDERS = ("dist", "engine", "ray", "server", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(root).parts
        if parts and parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """case name -> directory of a tiny random save_pretrained checkpoint (fp32)."""
    root = tmp_path_factory.mktemp("hf_ckpt")
    return {case: write_hf_checkpoint(case, root / case, seed=i) for i, case in enumerate(HF_CASES)}


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random tiny DeepSeek-V3-style checkpoint of ``make-tiny`` (seed 0, fp32, no tokenizer)."""
    from moe.tiny import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny") / "dsv3"
    write_tiny_checkpoint("deepseek_v3", path, size="tiny", seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_ckpt_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make-tiny --arch deepseek_v3``: the same kind of checkpoint with its trained BPE tokenizer."""
    from launch.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("tiny_tok") / "tiny-v3")


@pytest.fixture(scope="session")
def kernel_isas() -> list[str]:
    """The CPU kernels (moe.kernels) built once per session; the instruction sets to test: every
    one this CPU runs (generic always). Skips where the extension cannot build."""
    from moe import kernels

    if not kernels.is_available():
        pytest.skip("the CPU expert kernel could not be built here")
    kernels.select_isa("auto")
    return kernels.supported_isas()
