"""Layers against transformers' own functions: RMSNorm, RoPE/YaRN, routers; MoELayer placement;
paged attention (batched decode == per-sequence); tensor-parallel shards sum to the full output."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from transformers.models.mixtral import modeling_mixtral as hf_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3

from moe.capacity import CapacityConfig, compute_capacity
from moe.config import ModelConfig, RopeScaling
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.layers import DenseMLP, GQAAttention, RMSNorm, RotaryEmbedding, apply_rotary, compute_inv_freq
from moe.moe_layer import MoELayer, choose_replicas, compute_placement_tables
from moe.router import Router

V3_BASE = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
               intermediate_size=64, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
               n_group=4, topk_group=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               q_lora_rank=None, first_k_dense_replace=1, max_position_embeddings=1024)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _ours(hf_config: transformers.PreTrainedConfig) -> ModelConfig:
    d = hf_config.to_dict()
    d["architectures"] = [type(hf_config).__name__.replace("Config", "ForCausalLM")]
    return ModelConfig.from_hf(d)


def test_rmsnorm_matches_hf_in_bf16() -> None:
    x = torch.randn(5, 24).to(torch.bfloat16) * 3
    ref = hf_v3.DeepseekV3RMSNorm(24, eps=1e-5).to(torch.bfloat16)
    ref.weight.data = torch.randn(24).to(torch.bfloat16)
    ours = RMSNorm(24, 1e-5, torch.bfloat16)
    ours.weight.data.copy_(ref.weight.data)
    out = ours(x)
    assert out.shape == (5, 24) and out.dtype == torch.bfloat16
    assert torch.equal(out, ref(x))


@pytest.mark.parametrize("factor,mscale,mscale_all_dim,beta_fast", [(4.0, 0.8, 1.0, 32), (40.0, 1.0, 1.0, 16),
                                                                    (2.5, None, None, 32)])
def test_yarn_inv_freq_and_attention_factor_match_hf(factor, mscale, mscale_all_dim, beta_fast) -> None:
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=factor, original_max_position_embeddings=128,
                beta_fast=beta_fast, beta_slow=1)
    if mscale is not None:
        rope.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    hf_cfg = transformers.DeepseekV3Config(**V3_BASE, rope_parameters=rope)
    ref_inv, ref_att = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    cfg = _ours(hf_cfg)
    inv, att = compute_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    assert inv.shape == (cfg.qk_rope_head_dim // 2,)
    assert torch.allclose(inv, ref_inv, rtol=1e-6) and att == pytest.approx(ref_att)
    # the MLA softmax scale carries mscale(factor, mscale_all_dim)^2 like transformers
    ref_scale = hf_v3.DeepseekV3Attention(hf_cfg, 0).scaling
    assert cfg.softmax_scale == pytest.approx(ref_scale)


def test_legacy_rope_scaling_equals_rope_parameters() -> None:
    yarn = dict(factor=8.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1, mscale=1.0,
                mscale_all_dim=0.7)
    legacy = dict(V3_BASE, architectures=["DeepseekV3ForCausalLM"], rope_theta=5000.0,
                  rope_scaling=dict(yarn, type="yarn"), torch_dtype="bfloat16")
    new = dict(V3_BASE, architectures=["DeepseekV3ForCausalLM"],
               rope_parameters=dict(yarn, rope_type="yarn", rope_theta=5000.0), dtype="bfloat16")
    a, b = ModelConfig.from_hf(legacy), ModelConfig.from_hf(new)
    assert a == b and a.rope_theta == 5000.0 and a.dtype == "bfloat16" and a.rope_scaling.factor == 8.0


def test_rotary_layouts_match_hf() -> None:
    q, k = torch.randn(6, 3, 8), torch.randn(6, 1, 8)
    pos = torch.arange(10, 16)
    rot = RotaryEmbedding(8, 10000.0)
    cos, sin = rot(pos)
    assert cos.shape == (6, 4)
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    # half-split layout (Mixtral, Qwen3, V3 with rope_interleave=False)
    ref_q, ref_k = hf_v3.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos, full_sin)
    assert torch.allclose(apply_rotary(q, cos, sin, False), ref_q[0].transpose(0, 1), atol=1e-6)
    # interleaved layout, transformers' DeepSeek-V3 formulation (same output order)
    ref_q, ref_k = hf_v3.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                          full_cos, full_sin)
    assert torch.allclose(apply_rotary(q, cos, sin, True), ref_q[0].transpose(0, 1), atol=1e-6)
    # V2's complex formulation yields interleaved output: same q.k
    freqs_cis = torch.polar(torch.ones(6, 4), pos[:, None].float() * rot.inv_freq)
    v2_q, v2_k = hf_v2.apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis[None])
    ours_dot = torch.einsum("thd,tgd->thg", apply_rotary(q, cos, sin, True), apply_rotary(k, cos, sin, True))
    ref_dot = torch.einsum("hd,gd->hg", v2_q[0, :, 0], v2_k[0, :, 0])
    assert torch.allclose(ours_dot[0], ref_dot, atol=1e-5)


@pytest.mark.parametrize("dim,scaled", [(32, True), (64, False), (6, False)])
def test_rotary_tables_equal_computing_per_position(dim: int, scaled: bool) -> None:
    """cos/sin are rows of tables over positions [0, P), bit-equal to computing them for the
    step's positions at any batch size; the tables grow past a position, or past a wrong
    max_position, and are remade when inv_freq changes."""
    scaling = RopeScaling(factor=8.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    rot = RotaryEmbedding(dim, 10000.0, scaling if scaled else None)
    gen = torch.Generator().manual_seed(0)
    for num in (1, 2, 3, 17, 32, 33):
        pos = torch.randint(0, 3000, (num,), generator=gen)
        cos, sin = rot(pos)
        ref_cos, ref_sin = rot.compute(pos)
        assert cos.shape == sin.shape == (num, dim // 2) and cos.dtype == torch.float32
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert rot._tables[0].shape[0] == 4096
    far = torch.tensor([70000, 3])
    assert torch.equal(rot(far, max_position=10)[0], rot.compute(far)[0])  # past the hint: grown
    assert rot._tables[0].shape[0] == 131072
    assert torch.equal(rot(torch.tensor([-2, 5]))[1], rot.compute(torch.tensor([-2, 5]))[1])
    rot.inv_freq.mul_(0.5)
    pos = torch.tensor([1, 2999])
    assert torch.equal(rot(pos)[0], rot.compute(pos)[0])


def _check_router(ours: Router, ref_ids: torch.Tensor, ref_w: torch.Tensor, x: torch.Tensor) -> None:
    """Both of our paths (the fused CPU op, where it builds, and the PyTorch ops) pick HF's experts
    with HF's weights."""
    for use_kernel in (True, False):
        ours.use_kernel = use_kernel
        ids, w = ours(x)
        assert ids.shape == ref_ids.shape and ids.dtype == torch.int64 and w.dtype == torch.float32
        o1, o2 = ids.sort(-1), ref_ids.sort(-1)
        assert torch.equal(o1.values, o2.values), use_kernel
        assert torch.allclose(w.gather(1, o1.indices), ref_w.float().gather(1, o2.indices), atol=1e-6), use_kernel


@pytest.mark.parametrize("norm,top_k,groups", [(True, 4, (4, 2)), (False, 1, (2, 1)), (True, 2, (1, 1))])
def test_deepseek_v3_router_matches_hf(norm: bool, top_k: int, groups: tuple[int, int]) -> None:
    hf_cfg = transformers.DeepseekV3Config(**dict(V3_BASE, num_experts_per_tok=top_k, norm_topk_prob=norm,
                                                  n_group=groups[0], topk_group=groups[1]), routed_scaling_factor=1.7)
    ref = hf_v3.DeepseekV3TopkRouter(hf_cfg)
    torch.nn.init.normal_(ref.weight)
    ref.e_score_correction_bias.normal_(0, 0.5)
    ours = Router(_ours(hf_cfg))
    ours.weight.data.copy_(ref.weight.data)
    ours.e_score_correction_bias.data.copy_(ref.e_score_correction_bias)
    x = torch.randn(40, 32)
    _, ref_w, ref_ids = ref(x)
    _check_router(ours, ref_ids, ref_w, x)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router_matches_hf(method: str) -> None:
    hf_cfg = transformers.DeepseekV2Config(**dict(V3_BASE, num_experts_per_tok=3), topk_method=method,
                                           routed_scaling_factor=16.0)
    ref = hf_v2.DeepseekV2TopkRouter(hf_cfg)
    torch.nn.init.normal_(ref.weight)
    ours = Router(_ours(hf_cfg))
    ours.weight.data.copy_(ref.weight.data)
    x = torch.randn(40, 32)
    _, ref_w, ref_ids = ref(x)
    _check_router(ours, ref_ids, ref_w, x)


@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_softmax_routers_match_hf(family: str, norm: bool) -> None:
    common = dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  num_experts_per_tok=2, intermediate_size=16)
    if family == "mixtral":
        hf_cfg = transformers.MixtralConfig(**common, num_local_experts=6)
        ref = hf_mixtral.MixtralTopKRouter(hf_cfg)
    else:
        hf_cfg = transformers.Qwen3MoeConfig(**common, num_experts=6, norm_topk_prob=norm, moe_intermediate_size=8)
        ref = hf_qwen3.Qwen3MoeTopKRouter(hf_cfg)
    torch.nn.init.normal_(ref.weight)
    ours = Router(_ours(hf_cfg))
    ours.weight.data.copy_(ref.weight.data)
    x = torch.randn(30, 32)
    _, ref_w, ref_ids = ref(x)
    _check_router(ours, ref_ids, ref_w, x)
    assert torch.allclose(ours(x)[1].sum(-1), torch.ones(30)) == norm


def test_placement_tables_and_even_replica_spread() -> None:
    phy2log = torch.tensor([0, 1, 2, 3, 1, 1, 0])  # expert 1 has 3 copies, expert 0 two
    log2phy, logcnt = compute_placement_tables(phy2log, 4)
    assert logcnt.tolist() == [2, 3, 1, 1]
    assert log2phy.tolist() == [[0, 6, -1], [1, 4, 5], [2, -1, -1], [3, -1, -1]]
    ids = torch.tensor([[1, 0], [1, 2], [1, 0], [1, 3], [1, 0], [1, 0], [1, 0]])
    slots = choose_replicas(ids, log2phy, logcnt, rank=0)
    assert torch.equal(phy2log[slots], ids)  # every slot holds the chosen expert
    assert torch.bincount(slots[:, 0], minlength=7)[[1, 4, 5]].tolist() == [3, 2, 2]
    assert torch.bincount(slots[:, 1], minlength=7)[[0, 6]].tolist() == [3, 2]
    shifted = choose_replicas(ids, log2phy, logcnt, rank=1)
    assert not torch.equal(shifted, slots) and torch.equal(phy2log[shifted], ids)
    with pytest.raises(ValueError, match="no physical slot"):
        compute_placement_tables(torch.tensor([0, 0, 2, 3]), 4)


def test_a_rank_holding_a_copy_sends_its_decode_tokens_to_it() -> None:
    """16 experts, 2 EP ranks, 48 redundant slots (each expert's copies in slots e, e+16 on rank 0 and
    e+32, e+48 on rank 1). In slot order both ranks' first assignment of an expert went to rank 0's
    copies, and a decode step (one assignment per expert per rank) loaded the ranks 2912 : 288 where
    the balancer models an even split; ordered by rank, each rank uses its own copy."""
    num_experts, num_ranks = 16, 2
    phy2log = torch.arange(64) % num_experts
    log2phy, logcnt = compute_placement_tables(phy2log, num_experts, num_ranks)
    assert log2phy[0].tolist() == [0, 32, 16, 48] and logcnt.tolist() == [4] * num_experts
    assert compute_placement_tables(phy2log, num_experts)[0][0].tolist() == [0, 16, 32, 48]  # one rank: slot order
    gen = torch.Generator().manual_seed(0)
    rank_load = torch.zeros(num_ranks)
    for _ in range(200):
        for rank in range(num_ranks):
            ids = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(4)])  # 4 tokens, top-2
            slots = choose_replicas(ids, log2phy, logcnt, rank)
            assert torch.equal(phy2log[slots], ids)
            first = torch.tensor([ids.flatten()[:i].tolist().count(e) == 0 for i, e in enumerate(ids.flatten())])
            assert (slots.flatten()[first] // 32 == rank).all()  # an expert's first assignment stays on its rank
            rank_load += torch.bincount(slots.flatten() // 32, minlength=num_ranks)
    assert rank_load.mean() / rank_load.max() > 0.95
    # copies on ranks 1 and 3 of 4: rank 1's first assignment goes to its own copy, rank 3's to its own
    phy2log = torch.tensor([0, 1, 2, 0, 3, 4, 5, 0])  # 8 slots, 2 a rank: expert 0 on ranks 0, 1, 3
    log2phy, logcnt = compute_placement_tables(phy2log, 6, 4)
    assert log2phy[0].tolist() == [0, 3, 7]  # positions 0, 1, 2: ranks 0 (and 3), 1, then the rest


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_choose_slots_is_choose_replicas_and_the_count_in_one_pass(kernel_isas: list[str], rank: int) -> None:
    """``kernels.choose_slots`` (the EP layer's CPU path): choose_replicas' slots and bincount's
    slot load, added in place, for replicated and single-copy placements and an empty batch; an
    expert id outside the table is refused, naming it."""
    from moe import kernels
    from moe.experts import count_ids

    gen = torch.Generator().manual_seed(rank)
    for phy2log in (torch.tensor([0, 1, 2, 3, 1, 1, 0]), torch.arange(4)):
        log2phy, logcnt = compute_placement_tables(phy2log, 4)
        for tokens in (0, 1, 37):
            ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)] or [torch.empty(0, 2)])
            ids = ids.reshape(tokens, 2).long()
            load = torch.arange(phy2log.numel(), dtype=torch.int64)  # counts already there are kept
            want_load = load + count_ids(choose_replicas(ids, log2phy, logcnt, rank).reshape(-1), phy2log.numel())
            slots = kernels.choose_slots(ids, log2phy, logcnt, rank, load)
            assert slots.shape == (tokens, 2) and slots.dtype == torch.int64
            assert torch.equal(slots, choose_replicas(ids, log2phy, logcnt, rank)) and torch.equal(load, want_load)
    with pytest.raises(RuntimeError, match="expert id 4 outside 4 experts"):
        kernels.choose_slots(torch.tensor([[4, 0]]), log2phy, logcnt, 0, torch.zeros(4, dtype=torch.int64))


def test_moe_layer_replicated_placement_same_output_and_slot_load() -> None:
    cfg = _ours(transformers.DeepseekV3Config(**V3_BASE, n_shared_experts=1))
    layer = MoELayer(cfg, 1, dtype=torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(9, 32)
    expected = layer(x)
    assert expected.shape == (9, 32) and layer.slot_load.sum().item() == 9 * cfg.num_experts_per_tok
    phy2log = torch.cat((torch.arange(16), torch.tensor([3, 3, 7, 0])))
    replicated = MoELayer(cfg, 1, dtype=torch.float32, local_slots=phy2log.tolist())
    replicated.gate.load_state_dict(layer.gate.state_dict())
    replicated.shared_experts.load_state_dict(layer.shared_experts.state_dict())
    replicated.experts.w13.data.copy_(layer.experts.w13.data[phy2log])
    replicated.experts.w2.data.copy_(layer.experts.w2.data[phy2log])
    replicated.set_placement(phy2log, num_ranks=1, rank=0)
    assert replicated.slot_load.shape == (20,)
    assert torch.allclose(replicated(x), expected, atol=1e-5)
    assert replicated.slot_load.sum().item() == 9 * cfg.num_experts_per_tok
    empty = replicated(torch.zeros(0, 32))
    assert empty.shape == (0, 32)


def test_moe_layer_capacity_counts_drops() -> None:
    cfg = _ours(transformers.DeepseekV3Config(**V3_BASE))
    layer = MoELayer(cfg, 1, dtype=torch.float32, capacity=CapacityConfig(0.25))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    out = layer(torch.randn(32, 32))
    assert out.shape == (32, 32)
    demand = layer.slot_load  # [P] assignments requested per slot (capacity does not change demand)
    assert demand.sum().item() == 32 * cfg.num_experts_per_tok
    capacity = compute_capacity(32, cfg.num_experts, cfg.num_experts_per_tok, 0.25)
    assert layer.counters["dropped"] == int((demand - capacity).clamp(min=0).sum()) > 0


def test_metadata_build_and_logits_indices() -> None:
    meta = AttentionMetadata.build([3, 1, 2], [3, 6, 4], [[5], [2, 7], [1]], 4)
    assert meta.slot_mapping.tolist() == [20, 21, 22, 29, 6, 7]
    assert meta.block_tables.tolist() == [[5, 0], [2, 7], [1, 0]]
    assert meta.logits_indices().tolist() == [2, 3, 5]
    assert meta.decode_seq_ids() == [1] and meta.prefill_seq_ids() == [0, 2]
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[0, 1]], 4)
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([3], [2], [[0]], 4)


def test_decode_metadata_matches_the_general_build() -> None:
    # one new token per sequence takes the plain-Python slot path; the tensor path must agree
    from moe.kv_cache import _token_slots

    rng = random.Random(0)
    for block_size in (1, 4, 16):
        lens = [1, block_size, block_size + 1, 2 * block_size, rng.randrange(1, 200), rng.randrange(1, 200)]
        tables = [rng.sample(range(500), -(-c // block_size) + rng.randrange(3)) for c in lens]
        meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size)
        slots, starts = _token_slots([1] * len(lens), lens, meta.block_tables, block_size)
        assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.shape == (len(lens),)
        assert meta.slot_mapping.tolist() == slots.tolist()
        assert meta.slot_mapping.tolist() == [t[(c - 1) // block_size] * block_size + (c - 1) % block_size
                                              for t, c in zip(tables, lens, strict=True)]
        assert list(meta.query_start_loc_list) == starts == list(range(len(lens) + 1))
        assert meta.logits_indices().tolist() == list(range(len(lens)))
    empty = AttentionMetadata.build([], [], [], 16)
    assert empty.slot_mapping.shape == (0,) and empty.query_start_loc.tolist() == [0] and empty.num_tokens == 0


def _gqa_setup(bias: bool) -> tuple[ModelConfig, GQAAttention]:
    hf_cfg = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=8, attention_bias=bias)
    cfg = _ours(hf_cfg)
    attn = GQAAttention(cfg, torch.float32)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return cfg, attn


def test_gqa_cached_prefix_and_batched_decode_equal_one_shot_prefill_and_tp_shards_sum() -> None:
    cfg, attn = _gqa_setup(bias=True)
    rot = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
    xs = [torch.randn(n, 32) for n in (2, 5, 3)]  # three sequences' token inputs
    tables = [[0], [1, 2, 5], [3, 4]]  # block size 2

    def two_steps(module: GQAAttention, tp: int = 1) -> torch.Tensor:
        """Step 1 caches prefixes of seq1 (4 tokens) and seq2 (2); step 2 = seq0 prefill of 2 tokens +
        one decode token each for seq1 and seq2. Returns step 2's output [4, 32]."""
        cache = PagedKVCache(cfg, 8, 2, torch.float32, tp_size=tp)
        meta1 = AttentionMetadata.build([4, 2], [4, 2], tables[1:], 2)
        cos, sin = rot(torch.tensor([0, 1, 2, 3, 0, 1]))
        with torch.no_grad():
            module(torch.cat((xs[1][:4], xs[2][:2])), cos, sin, meta1, cache.layer(0))
        meta2 = AttentionMetadata.build([2, 1, 1], [2, 5, 3], tables, 2)
        cos, sin = rot(torch.tensor([0, 1, 4, 2]))
        with torch.no_grad():
            return module(torch.cat((xs[0], xs[1][4:], xs[2][2:])), cos, sin, meta2, cache.layer(0))

    out = two_steps(attn)
    assert out.shape == (4, 32)
    for row, (b, n) in zip((1, 2, 3), ((0, 2), (1, 5), (2, 3))):  # one-shot prefill of each sequence
        cache = PagedKVCache(cfg, 8, 2, torch.float32)
        cos, sin = rot(torch.arange(n))
        with torch.no_grad():
            ref = attn(xs[b], cos, sin, AttentionMetadata.build([n], [n], [tables[b]], 2), cache.layer(0))
        assert torch.allclose(out[row], ref[-1], atol=1e-5)
    parts = []
    for rank in range(2):
        shard = copy.deepcopy(attn)
        shard.shard_for_tp(rank, 2)
        assert shard.num_heads == 2 and shard.num_kv_heads == 1
        parts.append(two_steps(shard, tp=2))
    assert torch.allclose(parts[0] + parts[1], out, atol=1e-5)
    # four ranks over the 2 kv heads (vLLM's rule): one query head each, its kv head replicated on two ranks
    parts = []
    for rank in range(4):
        shard = copy.deepcopy(attn)
        shard.shard_for_tp(rank, 4)
        assert shard.num_heads == 1 and shard.num_kv_heads == 1
        kv_head = rank // 2
        hd = attn.head_dim
        assert torch.equal(shard.k_proj.weight, attn.k_proj.weight[kv_head * hd:(kv_head + 1) * hd])
        parts.append(two_steps(shard, tp=4))
    assert torch.allclose(sum(parts), out, atol=1e-5)
    with pytest.raises(ValueError, match="tp_size 3 must divide num_heads 4"):
        copy.deepcopy(attn).shard_for_tp(0, 3)


def test_dense_mlp_tp_shards_sum() -> None:
    mlp = DenseMLP(32, 48)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 32)
    full = mlp(x)
    parts = []
    for rank in range(3):
        shard = copy.deepcopy(mlp)
        shard.shard_for_tp(rank, 3)
        assert shard.gate_proj.weight.shape == (16, 32) and shard.down_proj.weight.shape == (32, 16)
        parts.append(shard(x))
    assert torch.allclose(sum(parts), full, atol=1e-5)
