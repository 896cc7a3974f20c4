"""parallel.costmodel: each operator against a hand calculation, and the pieces composed."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from launch.core.kv_sizing import compute_kv_sizing
from moe.config import ModelConfig
from parallel.costmodel import (
    Deployment,
    Hardware,
    build_rank_load,
    compute_rank_load,
    kv_capacity_tokens,
    predict_point,
    synthetic_expert_load,
    weight_bytes_per_rank,
)
from parallel.costmodel.hardware import interpolate_loglog
from parallel.costmodel.ops import allreduce_seconds, attention_core_cost, gemm_cost
from parallel.costmodel.step import _dispatch_seconds

V3 = ModelConfig.from_hf("deepseek-ai/DeepSeek-V3", strict=False)
MIXTRAL = ModelConfig.from_hf("mistralai/Mixtral-8x7B-v0.1", strict=False)


def toy_hw(**kw) -> Hardware:
    base = dict(name="toy", flops={"bfloat16": 1e12, "fp8": 2e12}, memory_bandwidth=1e11, memory_bytes=80e9,
                gpus_per_node=8, intra_node_bandwidth=1e9, inter_node_bandwidth=1e8, intra_node_latency_s=0.0,
                inter_node_latency_s=0.0, gemm_efficiency=0.5, attention_efficiency=0.5, memory_efficiency=1.0,
                network_efficiency=1.0)
    base.update(kw)
    return Hardware.from_dict(base)


def test_gemm_time_is_the_roofline_of_flops_and_bytes():
    hw = toy_hw()
    big = gemm_cost(hw, 1024, 2048, 4096, dtype="bfloat16", weight_bytes=2, act_bytes=2)
    assert big.flops == 2 * 1024 * 2048 * 4096
    assert big.seconds == pytest.approx(2 * 1024 * 2048 * 4096 / 5e11)  # compute-bound: peak x 0.5
    assert big.is_compute_bound
    one = gemm_cost(hw, 1, 2048, 4096, dtype="bfloat16", weight_bytes=2, act_bytes=2)
    assert one.bytes == 2048 * 4096 * 2 + (4096 + 2048) * 2
    assert one.seconds == pytest.approx(one.bytes / 1e11)  # one row: reading the weight bounds it
    assert not one.is_compute_bound
    assert gemm_cost(hw, 1024, 2048, 4096, dtype="fp8", weight_bytes=1, act_bytes=2).compute_s == \
        pytest.approx(big.compute_s / 2)


def test_measured_gemm_table_replaces_peak_times_efficiency():
    hw = toy_hw(gemm_rates={"bfloat16": [[1, 1e9], [100, 1e11]]})
    assert hw.gemm_rate("bfloat16", 1) == 1e9
    assert hw.gemm_rate("bfloat16", 10) == pytest.approx(1e10)  # log-log between the points
    assert hw.gemm_rate("bfloat16", 1000) == 1e11  # beyond the table: the last rate
    assert hw.gemm_rate("fp8", 10) == 1e12  # no table for fp8: peak x efficiency


def test_mla_decode_attention_reads_the_latent_once_per_cached_token():
    hw = toy_hw()
    batch, ctx = 2, 1000
    cost = attention_core_cost(hw, V3, 1, query_tokens=batch, attended_pairs=batch * ctx, kv_read_tokens=batch * ctx,
                               dtype="bfloat16", kv_bytes=1, decode=True)
    assert cost.bytes == batch * ctx * 576 * 1 + batch * 128 * (576 + 512) * 2
    assert cost.flops == 2 * 128 * (576 + 512) * batch * ctx
    gqa = attention_core_cost(hw, MIXTRAL, 2, query_tokens=1, attended_pairs=ctx, kv_read_tokens=ctx,
                              dtype="bfloat16", kv_bytes=2, decode=True)
    assert gqa.bytes == ctx * (2 * 4 * 128) * 2 + 16 * 256 * 2  # TP2 holds 4 of Mixtral's 8 KV heads


def test_dispatch_bytes_follow_deduplicated_destinations():
    hw = toy_hw()
    dep = Deployment(dp=8, ep=8, dtype="bfloat16")
    src = 100
    distinct = 8 * (1 - (7 / 8) ** 2)  # Mixtral top-2 over 8 ranks: 1.875 destination ranks per token
    rows = src * distinct * 7 / 8  # minus the share that stays on the rank
    busiest = np.array([8 * src * 2 / 8])  # uniform: each rank receives its 1/8 of the routed rows
    disp, comb = _dispatch_seconds(MIXTRAL, dep, hw, src, busiest)
    counts = 8 * 8 / 1e9  # the split sizes: one int64 per rank
    assert disp[0] == pytest.approx(counts + rows * (4096 * 2 + 2 * 12) / 1e9)
    assert comb[0] == pytest.approx(rows * 4096 * 2 / 1e9)


def test_inter_node_dispatch_is_deduplicated_per_node_and_node_limited():
    hw = toy_hw()
    dep = Deployment(dp=32, ep=32, num_nodes=4, dtype="bfloat16", dispatch_dtype="fp8")
    src = 1000
    disp, _ = _dispatch_seconds(V3, dep, hw, src, np.array([src * 8.0]))
    # V3 routes each token to at most topk_group = 4 groups; 4 nodes -> 3 remote nodes at most
    remote_nodes = 3 * (1 - (3 / 4) ** 4)
    # the NIC (1e8 B/s) bounds it; the split-size exchange (256 B) is within the tolerance
    assert disp[0] == pytest.approx(src * remote_nodes * (7168 + 8 * 12) / 1e8, rel=1e-4)


def test_allreduce_is_the_ring_formula_or_the_measured_table():
    hw = toy_hw(intra_node_latency_s=1e-5)
    assert allreduce_seconds(hw, 1e6, 4, inter_node=False) == pytest.approx(2 * 3 / 4 * 1e6 / 1e9 + 6e-5)
    assert allreduce_seconds(hw, 1e6, 1, inter_node=False) == 0.0
    measured = toy_hw(collectives={"allreduce:2": [[1e3, 1e-4], [1e6, 1e-2]]})
    assert allreduce_seconds(measured, 1e6, 2, inter_node=False) == pytest.approx(1e-2)
    assert allreduce_seconds(measured, 1e6, 4, inter_node=False) == pytest.approx(1e-2 * (6 / 4) / (2 / 2))


def test_interpolation_is_exact_at_points_and_linear_past_the_end():
    table = ((1.0, 2.0), (100.0, 200.0))
    assert interpolate_loglog(table, 1.0) == 2.0
    assert interpolate_loglog(table, 10.0) == pytest.approx(20.0)
    assert interpolate_loglog(table, 1000.0) == pytest.approx(2000.0)
    assert interpolate_loglog(table, 0.1) == 2.0


def test_kv_capacity_matches_kvcalc_and_counts_only_local_expert_slots():
    dep = Deployment(dtype="bfloat16")
    weights = weight_bytes_per_rank(MIXTRAL, dep)
    assert weights == pytest.approx(MIXTRAL.num_parameters() * 2, rel=1e-4)  # norms aside, all of it
    sizing = compute_kv_sizing(MIXTRAL, memory_bytes=int(141e9), weight_bytes_per_rank=weights)
    assert kv_capacity_tokens(MIXTRAL, dep, int(141e9)) == sizing.max_num_tokens
    ep144 = Deployment(dp=144, ep=144, num_nodes=18, num_redundant_experts=32, weight_dtype="fp8")
    ep72 = Deployment(dp=72, ep=72, num_nodes=9, num_redundant_experts=32, weight_dtype="fp8")
    expert = 3 * 7168 * 2048  # fp8: one byte per weight
    assert weight_bytes_per_rank(V3, ep72) - weight_bytes_per_rank(V3, ep144) == 58 * (4 - 2) * expert
    assert Deployment(kv_capacity_tokens=123).kv_capacity_tokens == 123
    assert kv_capacity_tokens(V3, Deployment(kv_capacity_tokens=123), 1) == 123
    assert kv_capacity_tokens(V3, Deployment(), int(80e9)) == 0  # 671B parameters do not fit one rank


def test_eplb_placement_lowers_the_busiest_rank_on_a_skewed_load():
    load = synthetic_expert_load(4, 64, skew=1.0, seed=1)
    assert load.shape == (4, 64) and np.allclose(load.sum(1), 1.0)
    plain = compute_rank_load(load, 64, 8, enable_eplb=False)
    balanced = compute_rank_load(load, 72, 8, enable_eplb=True)
    assert plain.rank_share.shape == (4, 8) and np.allclose(plain.rank_share.sum(1), 1.0)
    assert balanced.balancedness > plain.balancedness
    assert balanced.rank_share.max(1).mean() < plain.rank_share.max(1).mean()


def test_imbalance_and_eplb_show_up_in_the_decode_step():
    load = synthetic_expert_load(len(V3.moe_layer_ids), 256, skew=1.0)
    common = dict(dp=32, ep=32, num_nodes=4, weight_dtype="fp8", kv_cache_dtype="fp8", max_num_seqs=256)
    hw = toy_hw(flops={"bfloat16": 9.89e14, "fp8": 1.979e15}, memory_bandwidth=3.35e12,
                intra_node_bandwidth=4.5e11, inter_node_bandwidth=5e10)
    off = predict_point(V3, Deployment(**common), hw, batch_size=128, kv_len=2000, expert_load=load)
    on = predict_point(V3, Deployment(**common, num_redundant_experts=32, enable_eplb=True), hw, batch_size=128,
                       kv_len=2000, expert_load=load)
    assert on.balancedness > off.balancedness
    assert on.decode_breakdown["routed_experts"] < off.decode_breakdown["routed_experts"]
    assert on.decode_step_ms < off.decode_step_ms


def test_breakdown_sums_to_the_step_and_overlap_hides_communication():
    hw = toy_hw(flops={"bfloat16": 9.89e14, "fp8": 1.979e15}, memory_bandwidth=3.35e12, intra_node_bandwidth=4.5e11,
                inter_node_bandwidth=5e10, kernel_overhead_s=5e-6, step_overhead_s=1e-3)
    dep = Deployment(dp=32, ep=32, num_nodes=4, num_redundant_experts=32, enable_eplb=True, weight_dtype="fp8",
                     kv_cache_dtype="fp8", dispatch_dtype="fp8", max_num_batched_tokens=8192)
    plain = predict_point(V3, dep, hw, batch_size=64, kv_len=4000)
    tbo = predict_point(V3, Deployment(**{**dep.__dict__, "enable_two_batch_overlap": True}), hw, batch_size=64,
                        kv_len=4000)
    for p in (plain, tbo):
        assert sum(p.decode_breakdown.values()) == pytest.approx(p.decode_step_ms)
        assert sum(p.prefill_breakdown.values()) == pytest.approx(p.prefill_step_ms)
    assert "overlap_hidden" not in plain.prefill_breakdown
    assert tbo.prefill_breakdown["overlap_hidden"] < 0
    assert tbo.prefill_step_ms < plain.prefill_step_ms  # prefill: big halves, communication hidden
    assert plain.decode_breakdown["step_overhead"] == pytest.approx(1.0)


def test_kv_capacity_caps_the_batch():
    hw = toy_hw(memory_bytes=40e9)
    dep = Deployment(weight_dtype="bfloat16", max_num_seqs=512)
    small = ModelConfig.from_hf("deepseek-ai/DeepSeek-V2-Lite", strict=False)
    cap = kv_capacity_tokens(small, dep, int(hw.memory_bytes))
    assert cap == (int(40e9 * 0.9) - weight_bytes_per_rank(small, dep)) // small.kv_bytes_per_token(2)
    p = predict_point(small, dep, hw, batch_size=512, kv_len=4000)
    assert p.batch_size == cap // 4000 < 512
    assert p.batch_limited_by == "kv_capacity"
    assert predict_point(small, dep, hw, batch_size=8, kv_len=4000).batch_limited_by is None


def test_capacity_factor_drops_rows_of_hot_experts():
    load = synthetic_expert_load(len(V3.moe_layer_ids), 256, skew=1.2)
    hw = toy_hw(flops={"bfloat16": 9.89e14, "fp8": 1.979e15}, memory_bandwidth=3.35e12)
    dropless = Deployment(dp=32, ep=32, num_nodes=4, weight_dtype="fp8", kv_cache_dtype="fp8", max_num_seqs=512)
    capped = Deployment(**{**dropless.__dict__, "capacity_factor": 1.0})
    a = predict_point(V3, dropless, hw, batch_size=256, kv_len=1000, expert_load=load)
    b = predict_point(V3, capped, hw, batch_size=256, kv_len=1000, expert_load=load)
    assert a.dropped_fraction == 0.0 < b.dropped_fraction < 1.0
    assert b.decode_breakdown["routed_experts"] < a.decode_breakdown["routed_experts"]


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="do not split over ep=8"):
        Deployment(dp=8, ep=8, num_redundant_experts=3).num_slots(256)
    with pytest.raises(ValueError, match="unknown hardware key"):
        Hardware.from_dict({"name": "x", "flops": {"bf16": 1.0}, "memory_bandwidth": 1, "memory_bytes": 1, "bogus": 1})
    with pytest.raises(ValueError, match="expert_load must be"):
        build_rank_load(V3, Deployment(dp=8, ep=8), expert_load=np.ones((3, 7)))
    with pytest.raises(ValueError, match="batch_size"):
        predict_point(V3, Deployment(dp=8, ep=8), toy_hw(), batch_size=0, kv_len=10)
    assert math.isfinite(toy_hw().gemm_rate("float32", 5))


def test_tensor_parallel_pays_an_all_reduce_per_layer_and_an_all_gather_per_moe_layer():
    hw = toy_hw(intra_node_latency_s=0.0)
    dep = Deployment(tp=2, dp=1, dtype="bfloat16", weight_dtype="fp8", kv_cache_dtype="fp8", max_num_seqs=64)
    small = ModelConfig.from_hf("deepseek-ai/DeepSeek-V2-Lite", strict=False)  # 27 layers, the first dense
    p = predict_point(small, dep, hw, batch_size=16, kv_len=100)
    vector = 16 * 2048 * 2  # [T, D] bf16
    all_reduce = 2 * 1 / 2 * vector / 1e9
    all_gather = 1 / 2 * vector / 1e9
    assert p.decode_breakdown["tp_collectives"] == pytest.approx((27 * all_reduce + 26 * all_gather) * 1e3)


def test_a_sliding_window_caps_the_keys_attended_and_read():
    from dataclasses import replace

    from parallel.costmodel.step import decode_work, prefill_work

    assert decode_work(4, 1000, 64).attended_pairs == decode_work(4, 64).attended_pairs == 4 * 64
    assert decode_work(4, 30, 64) == decode_work(4, 30)  # a context inside the window: all of it
    # 10 new tokens after a 5-token prefix, window 8: positions 6..15 see 6, 7, 8, 8, ... keys
    work = prefill_work(10, 15, 5, 8)
    assert work.attended_pairs == 6 + 7 + 8 * 8 and work.kv_read_tokens == 5
    assert prefill_work(10, 15, 5, 4).attended_pairs == 10 * 4 and prefill_work(10, 15, 5, 4).kv_read_tokens == 3
    assert prefill_work(10, 15, 5, 100) == prefill_work(10, 15, 5)
    windowed = replace(MIXTRAL, sliding_window=256)
    dep, hw = Deployment(), toy_hw(memory_bytes=400e9)  # room for Mixtral's bf16 weights and 8 x 8k tokens
    full = predict_point(MIXTRAL, dep, hw, batch_size=8, kv_len=8192)
    capped = predict_point(windowed, dep, hw, batch_size=8, kv_len=8192)
    assert capped.decode_breakdown["attention_core"] < full.decode_breakdown["attention_core"] / 10
    assert predict_point(windowed, dep, hw, batch_size=8, kv_len=200).decode_step_ms == \
        predict_point(MIXTRAL, dep, hw, batch_size=8, kv_len=200).decode_step_ms


@pytest.mark.parametrize("fields, kinds, extra_ms", [
    ({}, (), 0.0),
    ({"tp": 2}, ("tp",), 3.0),
    ({"dp": 2, "ep": 2}, ("ep",), 2.0),
    ({"dp": 2}, ("dp",), 1.0),
    ({"tp": 2, "dp": 2, "ep": 4}, ("tp", "ep"), 3.0),  # the larger of the kinds it is
    ({"tp": 2, "dp": 2}, ("tp", "dp"), 3.0),
])
def test_each_kind_of_multi_rank_instance_pays_its_own_step_overhead(fields, kinds, extra_ms):
    """``simulate calibrate --ray-ranks`` times TP, EP and DP instances apart: TP pays host work
    around its collectives in every layer, DP replicas only the round trip."""
    dep = Deployment(**fields, dtype="bfloat16")
    assert dep.multi_rank_kinds == kinds
    measured = toy_hw(step_overhead_s=1e-3, multi_rank_step_overhead_s=5e-3,
                      multi_rank_overheads={"tp": 3e-3, "ep": 2e-3, "dp": 1e-3})
    small = ModelConfig.from_hf("deepseek-ai/DeepSeek-V2-Lite", strict=False)
    p = predict_point(small, dep, measured, batch_size=8, kv_len=100)
    assert p.decode_breakdown["step_overhead"] == pytest.approx(1.0 + extra_ms)
    # a file from before the kinds were timed apart: every multi-rank instance pays the one figure
    older = toy_hw(step_overhead_s=1e-3, multi_rank_step_overhead_s=5e-3)
    assert predict_point(small, dep, older, batch_size=8, kv_len=100).decode_breakdown["step_overhead"] == \
        pytest.approx(1.0 + (5.0 if kinds else 0.0))
    partial = toy_hw(multi_rank_step_overhead_s=5e-3, multi_rank_overheads={"ep": 2e-3})
    assert partial.multi_rank_overhead(("dp",)) == 5e-3 and partial.multi_rank_overhead(("ep",)) == 2e-3


def test_a_rank_count_timed_apart_pays_its_own_figure():
    """``--ray-ranks 2 4`` writes "tp:2" and "tp:4" beside "tp" (the widest's): a two-rank point pays
    the two-rank figure, a count not timed falls back to the kind's plain figure, then the global one."""
    small = ModelConfig.from_hf("deepseek-ai/DeepSeek-V2-Lite", strict=False)
    hw = toy_hw(step_overhead_s=1e-3, multi_rank_step_overhead_s=9e-3,
                multi_rank_overheads={"tp:2": 1e-3, "tp:4": 4e-3, "tp": 4e-3, "ep:2": 2e-3})
    for fields, extra_ms in (({"tp": 2}, 1.0), ({"tp": 4}, 4.0), ({"tp": 8}, 4.0), ({"tp": 2, "dp": 2}, 9.0),
                             ({"dp": 2, "ep": 2}, 2.0), ({"dp": 4, "ep": 4}, 9.0), ({"tp": 2, "dp": 2, "ep": 4}, 9.0)):
        p = predict_point(small, Deployment(**fields, dtype="bfloat16"), hw, batch_size=8, kv_len=100)
        assert p.decode_breakdown["step_overhead"] == pytest.approx(1.0 + extra_ms), fields
    assert hw.multi_rank_overhead(("tp",)) == 4e-3 and hw.multi_rank_overhead(("tp",), 2) == 1e-3
    assert Hardware.from_dict(hw.to_dict()).multi_rank_overheads == hw.multi_rank_overheads


@pytest.mark.parametrize("value, message", [
    ({"pp": 1e-3}, "multi_rank_overheads key 'pp' must be one of tp, ep, dp"),
    ({"tp:1": 1e-3}, "multi_rank_overheads key 'tp:1' must be one of tp, ep, dp, or one of them and a rank count"),
    ({"tp:two": 1e-3}, "multi_rank_overheads key 'tp:two' must be one of"),
    ({"pp:2": 1e-3}, "multi_rank_overheads key 'pp:2' must be one of"),
    ({"tp": -1e-3}, "multi_rank_overheads.tp must be >= 0"),
    ({"tp:4": -1e-3}, "multi_rank_overheads.tp:4 must be >= 0"),
    ({"tp": "soon"}, "hardware key multi_rank_overheads.tp: 'soon' is not a number"),
    ([1e-3], "expected a mapping of tp / ep / dp (or tp:N ...) to seconds"),
])
def test_bad_multi_rank_overheads_name_the_key(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        toy_hw(multi_rank_overheads=value)
    assert toy_hw(multi_rank_overheads={"dp": "1e-3"}).multi_rank_overheads == {"dp": 1e-3}  # YAML 1.1 strings


@pytest.mark.parametrize("change, message", [
    ({"flops": {"bfloat16": 1e12, "fp8": math.nan}}, "hardware key flops.fp8: nan is not a finite number"),
    ({"memory_bandwidth": math.nan}, "hardware key memory_bandwidth: nan is not a finite number"),
    ({"memory_bandwidth": math.inf}, "hardware key memory_bandwidth: inf is not a finite number"),
    ({"memory_bytes": math.inf}, "hardware key memory_bytes: inf is not a finite number"),
    ({"memory_bytes": 80.5e0}, "hardware key memory_bytes: 80.5 is not a whole number"),
    ({"gpus_per_node": math.nan}, "hardware key gpus_per_node: nan is not a finite number"),
    ({"step_overhead_s": math.inf}, "hardware key step_overhead_s: inf is not a finite number"),
    ({"gemm_rates": {"bfloat16": [[1, 1e12], [64, math.nan]]}}, "gemm_rates.bfloat16: need non-empty (size, value) "
                                                                "pairs with positive finite numbers"),
])
def test_a_hardware_file_of_nan_or_inf_is_refused_naming_the_key(change, message):
    """YAML reads .nan and .inf as floats: each is one error naming the key, not NaN step times later."""
    with pytest.raises(ValueError, match=re.escape(message)):
        toy_hw(**change)
    assert toy_hw(memory_bytes="80e9", gpus_per_node=4.0).memory_bytes == 80_000_000_000
