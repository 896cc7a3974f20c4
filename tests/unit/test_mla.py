"""MLA: weight-absorbed decode equals the naive path; the latent cache layout; fp8 KV; TP heads."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.layers import MLAAttention
from moe.loader import load_weights
from moe.model import MoEModel
from tests.unit.test_model_vs_hf import greedy_generate


def _model(path: Path) -> MoEModel:
    model = MoEModel(ModelConfig.from_hf(path), dtype=torch.float32)
    load_weights(model, path, dtype=torch.float32)
    return model


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_absorbed_decode_equals_naive(hf_checkpoints: dict[str, Path], family: str) -> None:
    model = _model(hf_checkpoints[family])
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12]]
    tokens_abs, logits_abs = greedy_generate(model, prompts, 6)
    for layer in model.model.layers:
        layer.self_attn.absorb_decode = False
    tokens_naive, logits_naive = greedy_generate(model, prompts, 6)
    assert tokens_abs == tokens_naive
    for a, b in zip(logits_abs, logits_naive):
        assert (torch.stack(a) - torch.stack(b)).abs().max().item() < 1e-4


def test_latent_cache_holds_only_ckv_and_kpe(hf_checkpoints: dict[str, Path]) -> None:
    cfg = ModelConfig.from_hf(hf_checkpoints["deepseek_v3"])
    cache = PagedKVCache(cfg, num_blocks=3, block_size=4, dtype=torch.float32)
    assert cfg.kv_entry_shape == (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
    assert len(cache.pools) == cfg.num_hidden_layers
    assert cache.pools[0].shape == (3, 4, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    model = _model(hf_checkpoints["deepseek_v3"])
    meta = AttentionMetadata.build([3], [3], [[2]], 4)
    with torch.no_grad():
        model(torch.tensor([3, 4, 5]), torch.arange(3), meta, cache)
    pool = cache.pools[0]
    assert pool[2, :3].abs().sum() > 0 and pool[2, 3].abs().sum() == 0 and pool[:2].abs().sum() == 0
    # the stored latent is [kv_a_layernorm(c_kv) | rotated k_pe] of the layer input
    attn = model.model.layers[0].self_attn
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([3, 4, 5])))
    with torch.no_grad():
        c_kv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[:, : cfg.kv_lora_rank])
    assert torch.allclose(pool[2, :3, : cfg.kv_lora_rank], c_kv, atol=1e-6)


def test_fp8_kv_roundtrip_close() -> None:
    cfg = ModelConfig.from_hf(dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=32, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=None, first_k_dense_replace=0))
    cache = PagedKVCache(cfg, num_blocks=4, block_size=4, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    assert cache.pools[1].dtype == torch.float8_e4m3fn
    entries = torch.randn(6, 20, generator=torch.Generator().manual_seed(0)) * 3
    view = cache.layer(1)
    slots = torch.tensor([4, 5, 6, 7, 8, 9])
    view.write(slots, entries)
    got = view.gather(torch.tensor([[1, 2]]))[0, :6]
    assert got.dtype == torch.bfloat16 and got.shape == (6, 20)
    rel = (got.float() - entries).abs() / entries.abs().max()
    assert 0 < rel.max().item() <= 1 / 16  # e4m3: half an ulp is 2^-4 of the value's binade
    assert cache.scales.tolist() == [1.0, 1.0]
    # large entries: a calibrated scale keeps them in range; without one they would clip at 448
    big = entries * 1000
    calibrated = PagedKVCache(cfg, num_blocks=4, block_size=4, dtype=torch.float32, kv_cache_dtype="fp8",
                              calculate_kv_scales=True)
    calibrated.layer(0).write(slots, big)
    got = calibrated.layer(0).gather(torch.tensor([[1, 2]]))[0, :6]
    assert calibrated.scales[0].item() == pytest.approx(big.abs().max().item() / 224)
    assert ((got - big).abs() / big.abs().max()).max().item() <= 1 / 16
    cache.layer(0).write(slots, big)
    assert cache.layer(0).gather(torch.tensor([[1, 2]]))[0, :6].abs().max().item() <= 448


def test_fp8_kv_model_stays_close(hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    _, ref = greedy_generate(model, prompts, 1)
    _, fp8 = greedy_generate(model, prompts, 1, kv_cache_dtype="fp8")
    for a, b in zip(ref, fp8):  # prompt logits (attention read the dequantised latent); not bit-equal
        assert 0 < (a[0] - b[0]).abs().max().item() < 0.15 * a[0].abs().max().item()


def test_mla_tp_shards_sum_to_full(hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["deepseek_v2"])
    full = model.model.layers[1].self_attn
    x = torch.randn(7, model.config.hidden_size)
    cos, sin = model.model.rotary(torch.arange(7))

    def run(attn: MLAAttention) -> torch.Tensor:
        cache = PagedKVCache(model.config, 4, 4, torch.float32)
        meta = AttentionMetadata.build([5, 1, 1], [5, 4, 3], [[0, 1], [2], [3]], 4)
        with torch.no_grad():
            return attn(x, cos, sin, meta, cache.layer(1))

    expected = run(full)
    parts = []
    for rank in range(2):
        shard = copy.deepcopy(full)
        shard.shard_for_tp(rank, 2)
        assert shard.num_heads == full.num_heads // 2
        assert shard.kv_b_proj.weight.shape[0] == full.kv_b_proj.weight.shape[0] // 2
        parts.append(run(shard))
    assert torch.allclose(parts[0] + parts[1], expected, atol=1e-5)


def test_yarn_softmax_scale_deepseek_v3() -> None:
    cfg = ModelConfig.from_hf(dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=32, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=8, max_position_embeddings=163840,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0)))
    assert cfg.softmax_scale == pytest.approx(0.1352, abs=1e-4)
