"""The MoE feed-forward in one CPU op (moe.kernels.moe_ffn) against MoELayer's op-by-op kernel path:
bit-equal outputs and slot load, and the cases where it must step aside."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe import kernels
from moe.capacity import CapacityConfig
from moe.config import ModelConfig
from moe.loader import load_weights
from moe.model import MoEModel
from moe.moe_layer import MoELayer


def _moe_layer(path: Path, dtype: torch.dtype) -> MoELayer:
    model = MoEModel(ModelConfig.from_hf(path), dtype=dtype)
    load_weights(model, path, dtype=dtype)
    return next(model.moe_layers())


def _both_paths(layer: MoELayer, x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(output, slot load) with the fused op, then op by op, from a zeroed slot load."""
    results = []
    for fused in (True, False):
        layer.use_fused_ffn = fused
        layer.slot_load.zero_()
        with torch.no_grad():
            out = layer(x)
        results.append((out, layer.slot_load.clone()))
    layer.use_fused_ffn = True
    return tuple(results)


@pytest.fixture
def ffn_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    bind = kernels.moe_ffn_op

    def spy(*bound, **kwargs) -> Callable[..., torch.Tensor]:  # records the rows of every call of the bound op
        run = bind(*bound, **kwargs)

        def call(x: torch.Tensor, *args) -> torch.Tensor:
            calls.append(tuple(x.shape))
            return run(x, *args)

        return call

    monkeypatch.setattr(kernels, "moe_ffn_op", spy)
    return calls


# group_limited_greedy + 2 shared; noaux_tc (sigmoid, bias) + 1 shared; softmax greedy, no shared
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_ffn_is_bit_equal_to_the_op_by_op_path(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                                   family: str, dtype: torch.dtype,
                                                   ffn_calls: list[tuple[int, ...]]) -> None:
    layer = _moe_layer(hf_checkpoints[family], dtype)
    d = layer.experts.w13.shape[-1]
    for isa in kernel_isas:
        kernels.select_isa(isa)
        for rows in (1, 7, 33):
            x = torch.randn(rows, d, generator=torch.Generator().manual_seed(rows)).to(dtype)
            (out, load), (want, want_load) = _both_paths(layer, x)
            assert out.shape == (rows, d) and out.dtype == dtype
            assert torch.equal(out, want), (isa, rows)
            assert torch.equal(load, want_load) and load.sum().item() == rows * layer.top_k
    kernels.select_isa("auto")
    assert ffn_calls == [(rows, d) for _ in kernel_isas for rows in (1, 7, 33)]


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_ffn_is_bit_equal_at_prefill_size(kernel_isas: list[str], hf_checkpoints: dict[str, Path], family: str,
                                              dtype: torch.dtype) -> None:
    """Past 2^16 output elements the op adds the routed sums (rows padded in memory) and the shared
    expert in one pass into x's dtype (on the bf16 dot tiles, in the shared expert's down projection:
    DotKernelsOf::down_final): still the op-by-op path's bits, on every instruction set."""
    layer = _moe_layer(hf_checkpoints[family], dtype)
    d = layer.experts.w13.shape[-1]
    rows = (1 << 16) // d + 3
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    try:
        for isa in kernel_isas:
            kernels.select_isa(isa)
            (out, load), (want, want_load) = _both_paths(layer, x)
            assert out.shape == (rows, d) and out.dtype == dtype and out.is_contiguous()
            assert torch.equal(out, want), isa
            assert torch.equal(load, want_load)
    finally:
        kernels.select_isa("auto")


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_ffn_output_past_the_padding_is_contiguous(kernel_isas: list[str], dtype: torch.dtype,
                                                       shared: bool) -> None:
    """Past 2^16 output elements the routed sums lie in padded rows; the op's output is still a
    contiguous [T, D] tensor (not a view of them), equal to the routed experts' op plus the shared
    expert rounded once, with and without shared experts and in x's own dtype too (fp32)."""
    slots, hidden, inter, tokens, top_k = 8, 64, 32, (1 << 16) // 64 + 5, 2
    gen = torch.Generator().manual_seed(3)
    w13 = (torch.randn(slots, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(slots, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    gate = torch.randn(slots, hidden, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    packed = kernels.pack_experts(w13, w2)
    sh = kernels.pack_experts(w13[:1].clone(), w2[:1].clone()) if shared else None
    run = kernels.moe_ffn_op(gate, None, sigmoid=False, method=0, n_group=1, topk_group=1, top_k=top_k,
                             norm_topk_prob=True, scaling=1.0, packed=packed, shared=sh)
    load = torch.zeros(slots, dtype=torch.int64)
    out = run(x, torch.arange(slots).unsqueeze(1), torch.ones(slots, dtype=torch.int64), 0, load)
    assert out.shape == (tokens, hidden) and out.dtype == dtype and out.is_contiguous()
    ids, weights = kernels.route_topk(kernels.router_logits(x, gate), None, sigmoid=False, method=0, n_group=1,
                                      topk_group=1, top_k=top_k, norm_topk_prob=True, scaling=1.0)
    want = kernels.experts_forward_topk(x, ids, weights, packed)  # [T, D] fp32
    if shared:
        want = want + kernels.experts_forward(x, [tokens], sh).float()
    assert torch.equal(out, want.to(dtype))
    assert int(load.sum()) == tokens * top_k


@pytest.mark.parametrize("rank", [0, 1])
def test_moe_ffn_spreads_replicas_like_choose_replicas(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                                       rank: int, ffn_calls: list[tuple[int, ...]]) -> None:
    cfg = ModelConfig.from_hf(hf_checkpoints["deepseek_v3"])
    base = _moe_layer(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    phy2log = torch.cat((torch.arange(cfg.num_experts), torch.tensor([3, 3, 5, 0])))  # 3 has three copies
    layer = MoELayer(cfg, base.layer_id, dtype=torch.bfloat16, local_slots=phy2log.tolist())
    layer.gate.load_state_dict(base.gate.state_dict())
    layer.shared_experts.load_state_dict(base.shared_experts.state_dict())
    layer.experts.w13.data.copy_(base.experts.w13.data[phy2log])
    layer.experts.w2.data.copy_(base.experts.w2.data[phy2log])
    layer.set_placement(phy2log, num_ranks=1, rank=0)
    layer.rank = rank  # the replica offset choose_replicas takes
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    (out, load), (want, want_load) = _both_paths(layer, x)
    assert ffn_calls == [(40, cfg.hidden_size)]
    assert torch.equal(out, want) and torch.equal(load, want_load)
    assert load.shape == (cfg.num_experts + 4,) and load[[3, cfg.num_experts, cfg.num_experts + 1]].min() > 0


def test_moe_ffn_with_no_rows(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                              ffn_calls: list[tuple[int, ...]]) -> None:
    layer = _moe_layer(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    d = layer.experts.w13.shape[-1]
    (out, load), (want, _) = _both_paths(layer, torch.zeros(0, d, dtype=torch.bfloat16))
    assert out.shape == want.shape == (0, d) and load.sum().item() == 0 and ffn_calls == [(0, d)]


def test_moe_ffn_steps_aside_where_an_op_would_not_run_its_kernel(kernel_isas: list[str],
                                                                  hf_checkpoints: dict[str, Path]) -> None:
    layer = _moe_layer(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    x = torch.zeros(4, layer.experts.w13.shape[-1], dtype=torch.bfloat16)
    assert layer._fused_ffn_weights(x) is not None
    assert layer._fused_ffn_weights(x.float()) is None  # rows in another dtype than the experts
    # the same without a shared expert to refuse them: the routed experts must (Mixtral)
    plain = _moe_layer(hf_checkpoints["mixtral"], torch.bfloat16)
    y = torch.zeros(4, plain.experts.w13.shape[-1], dtype=torch.bfloat16)
    assert plain._fused_ffn_weights(y) is not None and plain._fused_ffn_weights(y.float()) is None
    # padded rows (count_rows) must count nothing in slot_load; the op counts every row
    layer.set_count_rows(torch.tensor([1, 1, 0, 0]))
    assert layer._fused_ffn_weights(x) is None
    layer.set_count_rows(None)
    for module, attr in ((layer.gate, "use_kernel"), (layer.experts, "fused_topk")):
        setattr(module, attr, False)
        assert layer._fused_ffn_weights(x) is None
        setattr(module, attr, True)
    layer.capacity = CapacityConfig(1.0, policy="score")  # a capacity kept by router score stays op by op
    assert layer._fused_ffn_weights(x) is None
    layer.capacity = CapacityConfig(1.0)  # dropped in token order: in the op
    assert layer._fused_ffn_weights(x) is not None
    layer.capacity = None

    class Remote:  # any dispatcher other than the local one (EP over ranks)
        rank, num_ranks = 0, 2

    local = layer.dispatcher
    layer.dispatcher = Remote()
    assert layer._fused_ffn_weights(x) is None
    layer.dispatcher = local
    assert layer._fused_ffn_weights(x) is not None


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_ffn_enforces_a_local_capacity_like_the_op_by_op_path(kernel_isas: list[str],
                                                                  hf_checkpoints: dict[str, Path], family: str,
                                                                  dtype: torch.dtype,
                                                                  ffn_calls: list[tuple[int, ...]]) -> None:
    """A capacity factor that drops in token order (policy position, overflow drop) stays in the one
    op: the same bits, slot load (demand, before the drops) and dropped count as op by op, where the
    drops themselves are moe.capacity.apply_capacity's."""
    layer = _moe_layer(hf_checkpoints[family], dtype)
    d = layer.experts.w13.shape[-1]
    layer.capacity = CapacityConfig(0.5)
    for isa in kernel_isas:
        kernels.select_isa(isa)
        for rows in (1, 7, 33):
            x = torch.randn(rows, d, generator=torch.Generator().manual_seed(rows)).to(dtype)
            counts = []
            for fused in (True, False):
                layer.counters["dropped"] = 0
                layer.use_fused_ffn = fused
                layer.slot_load.zero_()
                with torch.no_grad():
                    out = layer(x)
                counts.append((out, layer.slot_load.clone(), layer.counters["dropped"]))
            (out, load, dropped), (want, want_load, want_dropped) = counts
            assert torch.equal(out, want) and torch.equal(load, want_load), (isa, rows)
            assert dropped == want_dropped and load.sum().item() == rows * layer.top_k
            assert (dropped > 0) == (rows > 1)  # C = ceil(T / E * 0.5 * K): one row fits, 7 rows overflow
    kernels.select_isa("auto")
    assert ffn_calls == [(rows, d) for _ in kernel_isas for rows in (1, 7, 33)]
    layer.use_fused_ffn = True
    for other in (CapacityConfig(0.5, policy="score"), CapacityConfig(0.5, overflow="reroute"),
                  CapacityConfig(0.5, renormalize=True)):
        layer.capacity = other  # the other settings stay op by op
        assert layer._fused_ffn_weights(x) is None


@pytest.mark.parametrize("min_capacity", [0, 3])
def test_capacity_drop_is_apply_capacity_in_token_order(kernel_isas: list[str], min_capacity: int) -> None:
    from moe.capacity import apply_capacity, apply_slot_limits, compute_capacity

    gen = torch.Generator().manual_seed(min_capacity)
    for tokens, top_k, slots in ((1, 2, 8), (40, 2, 8), (64, 6, 20), (0, 2, 4)):
        ids = torch.stack([torch.randperm(slots, generator=gen)[:top_k] for _ in range(tokens)]
                          or [torch.zeros(0, top_k, dtype=torch.int64)]).reshape(tokens, top_k)
        ids[torch.rand(ids.shape, generator=gen) < 0.1] = -1  # already dropped upstream (a global cap)
        weights = torch.rand(ids.shape, generator=gen).to(torch.bfloat16)
        limit = compute_capacity(tokens, slots, top_k, 0.7, min_capacity)
        want = apply_capacity(ids, weights, slots, 0.7, min_capacity=min_capacity)
        got_ids, got_w, dropped = kernels.capacity_drop(ids, weights, slots, limit)
        assert got_ids.shape == got_w.shape == (tokens, top_k) and got_w.dtype == torch.float32
        assert torch.equal(got_ids, want.topk_ids) and torch.equal(got_w, want.topk_weights)
        assert dropped == want.stats.dropped and (tokens < 40 or dropped > 0)
        # the global scope's per-slot shares (``compute_global_limits``): apply_slot_limits' values
        shares = torch.randint(0, 4, (slots,), generator=gen)
        want = apply_slot_limits(ids, weights, shares)
        got_ids, got_w, dropped = kernels.capacity_drop(ids, weights, slots, 0, shares)
        assert torch.equal(got_ids, want.topk_ids) and torch.equal(got_w, want.topk_weights)
        assert dropped == want.stats.dropped
    with pytest.raises(RuntimeError, match="slot id 9 outside 8 slots"):
        kernels.capacity_drop(torch.tensor([[9, 0]]), torch.ones(1, 2), 8, 1)
    with pytest.raises(RuntimeError, match=r"limits must be \[num_slots\] int64"):
        kernels.capacity_drop(torch.tensor([[1, 0]]), torch.ones(1, 2), 8, 1, torch.ones(3, dtype=torch.int64))
