"""The router's selection as one CPU op (moe.kernels.route_topk) against the PyTorch ops."""

from __future__ import annotations

import pytest
import torch

from moe import kernels
from moe.config import ModelConfig
from moe.router import Router

BASE = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=32, hidden_size=24, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=32, moe_intermediate_size=8, kv_lora_rank=8,
            qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, q_lora_rank=None, first_k_dense_replace=0)
CASES = {  # name -> config overrides
    "noaux_tc": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, topk_method="noaux_tc",
                     scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    "noaux_tc_one_group": dict(n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
                               topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=False),
    "group_limited_greedy": dict(architectures=["DeepseekV2ForCausalLM"], n_routed_experts=16, num_experts_per_tok=3,
                                 n_group=4, topk_group=2, topk_method="group_limited_greedy", scoring_func="softmax",
                                 norm_topk_prob=False, routed_scaling_factor=16.0),
    # every group kept: the PyTorch path skips the group mask (the op still runs its group step)
    "noaux_tc_all_groups": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=4,
                                topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True),
    "group_limited_all_groups": dict(architectures=["DeepseekV2ForCausalLM"], n_routed_experts=16,
                                     num_experts_per_tok=3, n_group=4, topk_group=4,
                                     topk_method="group_limited_greedy", scoring_func="softmax", norm_topk_prob=False),
    "softmax_greedy_norm": dict(architectures=["DeepseekV2ForCausalLM"], n_routed_experts=6, num_experts_per_tok=2,
                                topk_method="greedy", scoring_func="softmax", norm_topk_prob=True),
}


def _router(case: str) -> Router:
    router = Router(ModelConfig.from_hf({**BASE, **CASES[case]}))
    gen = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(router.weight.shape, generator=gen)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.data = torch.randn(router.num_experts, generator=gen) * 0.3
    return router


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_op_picks_the_pytorch_experts_highest_first(kernel_isas: list[str], case: str,
                                                         dtype: torch.dtype) -> None:
    router = _router(case)
    x = torch.randn(50, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert router._kernel_applies(x)
    ids, w, _ = router.route(x)
    router.use_kernel = False
    ref_ids, ref_w, selection = router.route(x, with_scores=True)
    assert ids.shape == ref_ids.shape == (50, router.top_k) and ids.dtype == torch.int64 and w.dtype == torch.float32
    mine, ref = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(mine.values, ref.values)
    torch.testing.assert_close(w.gather(1, mine.indices), ref_w.gather(1, ref.indices), atol=1e-6, rtol=1e-5)
    picked = selection.gather(1, ids)  # [T, K] selection scores in the op's order
    assert (picked[:, :-1] >= picked[:, 1:]).all()  # highest first


def test_route_op_is_skipped_where_scores_are_asked_for_or_autograd_runs(kernel_isas: list[str]) -> None:
    router = _router("noaux_tc")
    x = torch.randn(4, 24)
    ids, _, scores = router.route(x, with_scores=True)  # capacity rerouting wants [T, E] scores
    assert scores is not None and scores.shape == (4, 16)
    assert not router._kernel_applies(torch.randn(4, 24, requires_grad=True))
    assert not router._kernel_applies(x.half())  # the logits op takes float32 or bfloat16 rows
    assert router.route(x[:0])[0].shape == (0, 4)


@pytest.mark.parametrize("experts", [6, 64, 600])  # vector keys (one lane short, eight vectors), scalar keys
def test_route_op_breaks_ties_to_the_lower_expert(kernel_isas: list[str], experts: int) -> None:
    g = torch.Generator().manual_seed(8)
    logits = torch.randint(-2, 3, (40, experts), generator=g).float()  # five values: ties everywhere
    want = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :5]  # equal: lower id first
    for name in kernel_isas:
        kernels.select_isa(name)
        ids, _ = kernels.route_topk(logits, None, sigmoid=False, method=0, n_group=1, topk_group=1, top_k=5,
                                    norm_topk_prob=False, scaling=1.0)
        assert torch.equal(ids, want), name
        if experts % 8 == 0:  # exp8's lanes need not keep a NaN logit NaN; std::exp (E < 8) does
            continue
        # NaN scores rank below every number: never picked while numbers are left
        nan_row = logits.clone()
        nan_row[:, ::2] = float("nan")
        ids, _ = kernels.route_topk(nan_row, torch.zeros(experts), sigmoid=True, method=2, n_group=1, topk_group=1,
                                    top_k=3, norm_topk_prob=False, scaling=1.0)
        odd = torch.sort(logits[:, 1::2], dim=-1, descending=True, stable=True).indices[:, :3] * 2 + 1
        assert torch.equal(ids, odd), name
    kernels.select_isa("auto")


def _grouped_reference(sel: torch.Tensor, method: int, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    """The group step and top-k as route_topk documents them, one token at a time in Python: group
    score = the max (method 1) or the sum of the two largest (method 2); the best topk_group groups,
    ties to the lower group; the rest masked (0 or -inf); the top_k, ties to the lower expert."""
    ids = []
    for row in sel.tolist():
        per = len(row) // n_group
        groups = [row[g * per:(g + 1) * per] for g in range(n_group)]
        score = [max(v) if method == 1 else sum(sorted(v, reverse=True)[:2]) for v in groups]
        kept = sorted(range(n_group), key=lambda g: (-score[g], g))[:topk_group]
        fill = 0.0 if method == 1 else float("-inf")
        masked = [v if e // per in kept else fill for e, v in enumerate(row)]
        ids.append(sorted(range(len(row)), key=lambda e: (-masked[e], e))[:top_k])
    return torch.tensor(ids)


@pytest.mark.parametrize(("experts", "n_group", "topk_group"), [(64, 8, 4), (12, 3, 1), (20, 5, 3), (32, 8, 7)])
@pytest.mark.parametrize("method", [1, 2])
def test_route_op_breaks_group_ties_to_the_lower_group(kernel_isas: list[str], experts: int, n_group: int,
                                                       topk_group: int, method: int) -> None:
    # five logit values: equal group scores and equal experts everywhere. Sums of two sigmoids of 0 to 4
    # are equal only for equal pairs (-2 to 2 would give s(-x) + s(x) = s(0) + s(0), equal exactly but not
    # in every implementation's rounding), and the bias is left out for the same reason.
    g = torch.Generator().manual_seed(experts + method)
    logits = torch.randint(0, 5, (200, experts), generator=g).float()
    bias = torch.zeros(experts) if method == 2 else None
    top_k = min(6, topk_group * experts // n_group)
    for name in kernel_isas:
        kernels.select_isa(name)
        ids, _ = kernels.route_topk(logits, bias, sigmoid=method == 2, method=method, n_group=n_group,
                                    topk_group=topk_group, top_k=top_k, norm_topk_prob=False, scaling=1.0)
        scores = logits.sigmoid() if method == 2 else logits.softmax(-1)  # equal logits: equal scores in both
        sel = scores + bias if bias is not None else scores
        assert ids.shape == (200, top_k)
        assert torch.equal(ids, _grouped_reference(sel, method, n_group, topk_group, top_k)), name
    kernels.select_isa("auto")


@pytest.mark.parametrize("experts", [16, 64, 130])  # the max in lanes (E >= 16), a scalar tail at 130
def test_route_op_softmax_subtracts_the_row_max(kernel_isas: list[str], experts: int) -> None:
    # e^(l - m) overflows (a max taken too low) or underflows to nothing (a max started from 0 on an
    # all-negative row) unless m is the row's max: rows shifted by +-100, and rows with one logit 200
    # above the rest at every position (each lane, the tail)
    g = torch.Generator().manual_seed(experts)
    shifted = torch.randn(2 * experts, experts, generator=g) * 3
    shifted[0::2] += 100
    shifted[1::2] -= 100
    spiked = torch.randn(experts, experts, generator=g) * 3 - 100
    spiked[torch.arange(experts), torch.arange(experts)] += 200
    want = torch.softmax(shifted.double(), -1).topk(4, dim=-1)
    route = dict(sigmoid=False, method=0, n_group=1, topk_group=1, top_k=4, norm_topk_prob=False, scaling=1.0)
    for name in kernel_isas:
        kernels.select_isa(name)
        ids, w = kernels.route_topk(shifted, None, **route)
        assert torch.equal(ids, want.indices), name
        torch.testing.assert_close(w.double(), want.values, rtol=1e-5, atol=1e-7)
        ids, w = kernels.route_topk(spiked, None, **route)  # the rest underflow to 0 beside the spike
        assert torch.equal(ids[:, 0], torch.arange(experts)), name
        assert torch.isfinite(w).all() and torch.equal(w[:, 0], torch.ones(experts)), name
    kernels.select_isa("auto")


def test_route_op_rejects_impossible_groupings(kernel_isas: list[str]) -> None:
    logits, bias = torch.zeros(2, 6), torch.zeros(6)
    with pytest.raises(RuntimeError, match="do not split into 4 groups"):
        kernels.route_topk(logits, bias, sigmoid=True, method=2, n_group=4, topk_group=2, top_k=2,
                           norm_topk_prob=True, scaling=1.0)
    with pytest.raises(RuntimeError, match="top_k 7 outside"):
        kernels.route_topk(logits, None, sigmoid=False, method=0, n_group=1, topk_group=1, top_k=7,
                           norm_topk_prob=True, scaling=1.0)


@pytest.mark.parametrize("shape", [(1, 64, 1024), (37, 64, 1024), (6, 14, 40), (130, 8, 19), (300, 9, 2056)])  # (T, E, D)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_are_the_fp32_product(kernel_isas: list[str], shape: tuple[int, int, int],
                                            dtype: torch.dtype) -> None:
    T, E, D = shape
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(T, D, generator=g).to(dtype), torch.randn(E, D, generator=g)
    want = torch.nn.functional.linear(x.float(), w).double()
    for name in kernel_isas:
        kernels.select_isa(name)
        got = kernels.router_logits(x, w)
        assert got.shape == (T, E) and got.dtype == torch.float32, name
        # another summation order than the library GEMM's: fp32 rounding of a D-term sum
        assert ((got.double() - want).abs() <= 1e-6 * D * (x.float().abs() @ w.abs().T).double()).all(), name
        if kernels.router_split_applies(dtype, D):  # bf16 rows on AMX: the weight's parts, given or made
            assert torch.equal(got, kernels.router_logits(x, w, kernels.router_split(w))), name
        elif dtype == torch.bfloat16:  # rows widened as they are read: the bits of the widened rows' logits
            assert torch.equal(got, kernels.router_logits(x.float(), w)), name
    kernels.select_isa("auto")


@pytest.mark.parametrize("shape", [(64, 1024), (14, 40), (3, 2)])  # (E, D)
def test_router_split_parts_sum_to_the_weight(kernel_isas: list[str], shape: tuple[int, int]) -> None:
    E, D = shape
    g = torch.Generator().manual_seed(5)
    w = torch.randn(E, D, generator=g) * torch.logspace(-30, 30, D).float()  # tiny to huge values
    parts = kernels.router_split(w)
    nb = (E + 15) // 16
    assert parts.shape == (3, nb, D // 2, 16, 2) and parts.dtype == torch.bfloat16  # every part needed
    rows = parts.double().permute(0, 1, 3, 2, 4).reshape(3, nb * 16, D)  # [3, E padded, D]
    assert torch.equal(rows.sum(0)[:E], w.double())  # exactly the weight
    assert torch.equal(rows[0, :E], w.bfloat16().double())  # part 0: the weight rounded to bf16
    assert (rows[:, E:] == 0).all()
    with pytest.raises(RuntimeError, match="needs an even D"):
        kernels.router_split(torch.zeros(4, 7))


def test_router_split_leaves_out_zero_parts(kernel_isas: list[str]) -> None:
    g = torch.Generator().manual_seed(7)
    E, D = 40, 256
    w = torch.randn(E, D, generator=g)
    exact = w.bfloat16().float()  # a router read from a bf16 checkpoint
    two = exact + (w - exact).bfloat16().float() * (torch.arange(D) % 3 == 0)  # a second part in some columns
    full = kernels.router_split(w)
    for weight, count in ((exact, 1), (two, 2), (w, 3)):
        parts = kernels.router_split(weight)
        assert parts.shape == (count, 3, D // 2, 16, 2), count
        rows = parts.double().permute(0, 1, 3, 2, 4).reshape(count, 48, D)
        assert torch.equal(rows.sum(0)[:E], weight.double()), count
    assert torch.equal(kernels.router_split(exact)[0], full[0])  # part 0 is bf16(weight) either way
    if "amx" not in kernel_isas:
        return
    kernels.select_isa("amx")
    try:
        x = torch.randn(300, D, generator=g).bfloat16()
        for weight in (exact, two):
            parts = kernels.router_split(weight)
            padded = torch.cat([parts, torch.zeros(3 - parts.shape[0], *parts.shape[1:], dtype=parts.dtype)])
            got = kernels.router_logits(x, weight, parts)
            # the zero parts' products add exact zeros: the same bits as three parts
            assert torch.equal(got, kernels.router_logits(x, weight, padded))
            assert torch.equal(got, kernels.router_logits(x, weight))
            assert torch.allclose(got.double(), x.double() @ weight.double().T, rtol=0, atol=1e-4)
    finally:
        kernels.select_isa("auto")


def test_router_logits_on_the_weight_parts(kernel_isas: list[str]) -> None:
    if "amx" not in kernel_isas:
        pytest.skip("the weight's bf16 parts are read on AMX only")
    kernels.select_isa("amx")
    try:
        assert kernels.router_split_applies(torch.bfloat16, 1024)
        assert not kernels.router_split_applies(torch.float32, 1024)
        assert not kernels.router_split_applies(torch.bfloat16, 40)  # D not a multiple of 32: the FMA kernel
        g = torch.Generator().manual_seed(6)
        E, D = 70, 256  # five expert blocks, the last one partly past E
        w = torch.randn(E, D, generator=g)
        parts = kernels.router_split(w)
        # a row with one nonzero power of two picks a column of the weight: every other product is zero,
        # so each logit is part 0 + part 1 + part 2 of w[e, k], exactly w[e, k] scaled
        for k, value in ((0, 1.0), (31, -0.5), (32, 4.0), (D - 1, 2.0 ** -20)):
            x = torch.zeros(3, D, dtype=torch.bfloat16)
            x[1, k] = value
            got = kernels.router_logits(x, w, parts)
            assert got.shape == (3, E) and got.dtype == torch.float32
            assert torch.equal(got[1], w[:, k] * value) and (got[[0, 2]] == 0).all(), k
        x = torch.randn(77, D, generator=g).bfloat16()
        got = kernels.router_logits(x, w, parts)
        want = x.double() @ w.double().T
        # one accumulator per logit over the 3 D exact products: fp32 rounding of that sum
        assert ((got.double() - want).abs() <= 3 * D * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)).all()
        assert torch.equal(got, kernels.router_logits(x, w))  # parts made in the call: the same bits
        with pytest.raises(RuntimeError, match="must be router_split"):
            kernels.router_logits(x, w, parts[:, :1].contiguous())
    finally:
        kernels.select_isa("auto")


def test_router_logits_of_a_row_do_not_depend_on_its_batch(kernel_isas: list[str]) -> None:
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(300, 1024, generator=g).to(torch.bfloat16), torch.randn(64, 1024, generator=g)
    threads = torch.get_num_threads()
    for name in kernel_isas:
        kernels.select_isa(name)
        whole = kernels.router_logits(x, w)
        for rows in (slice(0, 1), slice(5, 6), slice(3, 10), slice(250, 300)):  # alone, in small and odd batches
            assert torch.equal(kernels.router_logits(x[rows], w), whole[rows]), (name, rows)
        try:
            torch.set_num_threads(2)  # 300 rows: split over threads
            assert torch.equal(kernels.router_logits(x, w), whole), name
        finally:
            torch.set_num_threads(threads)
    kernels.select_isa("auto")


def test_router_logits_op_rejects_mismatched_inputs(kernel_isas: list[str]) -> None:
    with pytest.raises(RuntimeError, match="w \\[E, D\\]"):
        kernels.router_logits(torch.zeros(2, 8), torch.zeros(4, 6))
    with pytest.raises(RuntimeError, match="router weight must be float32"):
        kernels.router_logits(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.bfloat16))


def test_router_keeps_the_weight_parts_until_the_weight_changes(kernel_isas: list[str]) -> None:
    if "amx" not in kernel_isas:
        pytest.skip("the weight's bf16 parts are read on AMX only")
    router = Router(ModelConfig.from_hf({**BASE, **CASES["noaux_tc"], "hidden_size": 64}))  # D: 2 x 32
    gen = torch.Generator().manual_seed(7)
    router.weight.data = torch.randn(router.weight.shape, generator=gen)
    x = torch.randn(40, 64, generator=gen).bfloat16()
    kernels.select_isa("amx")
    try:
        parts = router.logits_parts(x)
        assert parts is router.logits_parts(x)  # made once
        assert torch.equal(parts, kernels.router_split(router.weight))
        assert router.logits_parts(x.float()) is None  # fp32 rows: the FMA kernel
        ids, weights, _ = router.route(x)
        router.use_kernel = False
        ref_ids, ref_weights, _ = router.route(x)
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)  # the PyTorch path's experts
        router.use_kernel = True
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen))  # in place: a new version
        fresh = router.logits_parts(x)
        assert fresh is not parts and torch.equal(fresh, kernels.router_split(router.weight))
        want = kernels.route_topk(kernels.router_logits(x, router.weight), **router.selection_args())
        got = router.route(x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        kernels.select_isa("avx512")
        assert router.logits_parts(x) is None
    finally:
        kernels.select_isa("auto")
