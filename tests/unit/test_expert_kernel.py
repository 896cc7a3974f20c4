"""moe/kernels: the fused CPU expert kernel against the PyTorch reference path.

The first test to need the extension compiles it (tens of seconds on a fresh cache, then
cached on disk); those tests are marked slow. Shapes cover rows per expert 0, 1, few and
many, slots nobody routes to, bf16 and fp32, and every instruction set this CPU runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe import kernels
from moe.experts import Experts, grouped_expert_forward


def _weights(slots: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(slots, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(slots, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return w13, w2


COUNTS = {
    "decode_one_row": [0, 1, 0, 1, 1, 0, 0, 1],
    "few_rows_and_empty": [0, 2, 3, 0, 5, 1, 0, 4],
    "many_rows": [40, 0, 17, 33, 0, 0, 64, 9],
    "all_empty_but_one": [0, 0, 0, 0, 0, 0, 0, 7],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(COUNTS))
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_reference(kernel_isas: list[str], case: str, dtype: torch.dtype, tol: float) -> None:
    counts = COUNTS[case]
    hidden, inter = 48, 40  # 3 down blocks, 5 gate/up blocks
    w13, w2 = _weights(len(counts), hidden, inter, dtype, seed=len(case))
    gen = torch.Generator().manual_seed(1)
    n = sum(counts)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    rw = torch.rand(n, generator=gen)
    want = grouped_expert_forward(x.double(), counts, w13.double(), w2.double(), rw.double())  # [N, D]
    packed = kernels.pack_experts(w13, w2)
    padded = kernels.padded_inter(inter, kernels.inter_multiple(dtype))  # 40, or 64 for bf16 on AMX
    assert packed.w13p.shape == (len(counts), padded // 8, hidden, 16)
    assert packed.w2p.shape == (len(counts), hidden // 16, padded, 16)
    for isa in kernel_isas:
        kernels.select_isa(isa)
        got = kernels.experts_forward(x, counts, packed, rw)
        assert got.shape == (n, hidden) and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        got32 = kernels.experts_forward(x, counts, packed, rw, out_fp32=True)
        assert got32.dtype == torch.float32
        torch.testing.assert_close(got32.double(), want, atol=tol, rtol=tol)
        unweighted = kernels.experts_forward(x, counts, packed)
        torch.testing.assert_close(unweighted.double() * rw.double()[:, None], want, atol=tol, rtol=tol)
    kernels.select_isa("auto")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_claiming_items_give_the_one_thread_result(kernel_isas: list[str], dtype: torch.dtype) -> None:
    """Work items of very unequal cost (one expert with most rows, panels of 96 rows, empty
    slots) claimed by 1, 2 and 3 threads: the same bits, every row written once."""
    counts = [300, 0, 1, 7, 0, 2, 96, 0, 5, 1, 0, 0, 3, 190, 0, 1]
    hidden, inter = 64, 48
    w13, w2 = _weights(len(counts), hidden, inter, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    n = sum(counts)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    rw = torch.rand(n, generator=gen)
    packed = kernels.pack_experts(w13, w2)
    threads = torch.get_num_threads()
    try:
        for isa in kernel_isas:
            kernels.select_isa(isa)
            torch.set_num_threads(1)
            want = kernels.experts_forward(x, counts, packed, rw)
            assert want.shape == (n, hidden) and torch.isfinite(want.float()).all()
            for num in (2, 3):
                torch.set_num_threads(num)
                got = kernels.experts_forward(x, counts, packed, rw)
                assert torch.equal(got, want), (isa, num)
    finally:
        torch.set_num_threads(threads)
        kernels.select_isa("auto")


@pytest.mark.slow
def test_kernel_with_no_rows_returns_empty(kernel_isas: list[str]) -> None:
    w13, w2 = _weights(4, 32, 16, torch.float32, seed=0)
    out = kernels.experts_forward(torch.empty(0, 32), [0, 0, 0, 0], kernels.pack_experts(w13, w2))
    assert out.shape == (0, 32)


@pytest.mark.slow
def test_kernel_rejects_bad_counts(kernel_isas: list[str]) -> None:
    w13, w2 = _weights(2, 16, 8, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="counts sum to 3"):
        kernels.experts_forward(torch.randn(4, 16), [1, 2], kernels.pack_experts(w13, w2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_unpack_to_the_weights(dtype: torch.dtype) -> None:
    """w13p block b holds gate channels 8b..8b+7 then the same up channels; w2p block b output
    channels 16b..16b+15: unpacking each block gives those rows of w13 / w2 back."""
    slots, hidden, inter = 3, 32, 16
    w13, w2 = _weights(slots, hidden, inter, dtype, seed=2)
    packed = kernels.pack_experts(w13, w2, multiple=8)
    up = kernels.unpack_blocks(packed.w13p)  # [P, I/8, 16, D]
    assert torch.equal(up[:, :, :8].reshape(slots, inter, hidden), w13[:, :inter])
    assert torch.equal(up[:, :, 8:].reshape(slots, inter, hidden), w13[:, inter:])
    assert torch.equal(kernels.unpack_blocks(packed.w2p).reshape(slots, hidden, inter), w2)


def test_int8_quantize_dequantize_is_within_half_a_step() -> None:
    w = torch.randn(3, 24, 40)
    w[1, 5] = 0.0  # an all-zero channel keeps scale 1 and dequantizes to exact zeros
    q, scale = kernels.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (3, 24)
    assert int(q.abs().max()) == 127
    back = kernels.dequantize_int8(q, scale)
    assert torch.all((back - w).abs() <= scale[..., None] / 2 + 1e-7)
    assert torch.equal(back[1, 5], torch.zeros(40))
    # the largest magnitude of each channel is represented exactly (up to fp32 rounding)
    torch.testing.assert_close(back.abs().amax(-1), w.abs().amax(-1).where(scale != 1, back.abs().amax(-1)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_equals_reference_on_dequantized_weights(kernel_isas: list[str], dtype: torch.dtype) -> None:
    counts = [3, 0, 1, 12, 30]  # 30 rows: three two-block tiles, the second prefetching ahead
    w13, w2 = _weights(len(counts), 32, 24, dtype, seed=5)
    x = torch.randn(sum(counts), 32).to(dtype)
    rw = torch.rand(sum(counts))
    q13, s13 = kernels.quantize_int8(w13)
    q2, s2 = kernels.quantize_int8(w2)
    want = grouped_expert_forward(x.double(), counts, kernels.dequantize_int8(q13, s13, torch.float64),
                                  kernels.dequantize_int8(q2, s2, torch.float64), rw.double())
    packed = kernels.pack_experts(w13, w2, "int8")
    assert packed.quantized and packed.w13p.dtype == torch.int8
    assert kernels.pack_experts(w13, w2, "int8", multiple=8).nbytes() < kernels.pack_experts(
        w13.float(), w2.float()).nbytes() / 3
    for isa in kernel_isas:
        kernels.select_isa(isa)
        got = kernels.experts_forward(x, counts, packed, rw, out_fp32=True)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    kernels.select_isa("auto")


def _module(dtype: torch.dtype, quantization: str | None = None) -> Experts:
    e = Experts(6, 32, 16, dtype=dtype, quantization=quantization)
    w13, w2 = _weights(6, 32, 16, dtype, seed=3)
    e.w13.data.copy_(w13)
    e.w2.data.copy_(w2)
    return e


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_op_from_router_output_equals_grouping_first(kernel_isas: list[str], dtype: torch.dtype,
                                                         quantization: str | None) -> None:
    experts = _module(dtype, quantization)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 32, generator=gen).to(dtype)
    ids = torch.randint(-1, 5, (20, 3), generator=gen)  # slot 5 unused, some assignments dropped
    ids[3] = -1  # a token with no kept assignment gets zeros
    w = torch.rand(20, 3, generator=gen)
    for name in kernel_isas:
        kernels.select_isa(name)
        experts.fused_topk = True
        assert experts._fused_packed(x, ids, w) is not None
        got = experts(x, ids, w)
        experts.fused_topk = False
        want = experts(x, ids, w)  # compute_local_routing + experts_forward + index_add_
        assert got.shape == (20, 32) and got.dtype == torch.float32
        assert torch.equal(got, want), name  # same arithmetic in the same order
        assert not got[3].any()
    kernels.select_isa("auto")
    experts.fused_topk = True
    assert experts(x[:0], ids[:0], w[:0]).shape == (0, 32)
    assert not experts(x, torch.full_like(ids, -1), w).any()


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_received_rows_in_one_op_equal_the_tensor_ops(kernel_isas: list[str], dtype: torch.dtype,
                                                     quantization: str | None) -> None:
    """An expert-parallel rank's experts over the rows it received (``Experts.forward_rows_fused``:
    its slots on the wire, physical, localized in the op; the rows read where they lie in the receive
    buffer) give ``forward_rows``' tensor ops' bits: each weighted row rounded to the wire dtype, the
    rows of one received row summed in fp32 in k order and rounded once (bf16: ties away from zero,
    as embedding_bag rounds). Rows with no local slot come back zero; 120 rows x 3 on one slot in
    bf16 sum many ties."""
    from parallel.dispatch.plan import localize_slots, pack_rows, plan_from_mask, unpack_rows

    experts = _module(dtype, quantization)  # 6 local slots: rank 1 of 3 hosts physical slots 6-11
    gen = torch.Generator().manual_seed(7)
    for rows, k in ((20, 3), (1, 1), (120, 8)):
        x = torch.randn(rows, 32, generator=gen).to(dtype)
        slots = torch.randint(-1, 18, (rows, k), generator=gen)
        slots[0] = torch.where(torch.arange(k) % 2 == 0, 3, -1)  # nothing hosted here: zeros
        w = torch.rand(rows, k, generator=gen)
        plan = plan_from_mask(torch.ones(1, rows, dtype=torch.bool))
        rx, rslots, rweights = unpack_rows(pack_rows(x, slots, w, plan), 32, k, dtype)  # strided views
        assert rx.stride(0) > 32 and rslots.dtype == torch.int32
        for name in kernel_isas:
            kernels.select_isa(name)
            experts.fused_topk = True
            got = experts.forward_rows_fused(rx, rslots, rweights, first_slot=6)
            assert got is not None and got.shape == (rows, 32) and got.dtype == dtype and got.is_contiguous()
            experts.fused_topk = False
            want = experts.forward_rows(rx.contiguous(), localize_slots(rslots, 1, 6), rweights)
            assert torch.equal(got, want), (name, rows, k)
            assert not got[0].any()
            experts.fused_topk = True
            local = localize_slots(slots, 1, 6)
            assert torch.equal(experts.forward_rows(x, local, w), want)  # local ids, first_slot 0
    kernels.select_isa("auto")
    assert experts.forward_rows_fused(x[:0], slots[:0], w[:0]).shape == (0, 32)
    assert not experts.forward_rows_fused(x, torch.full_like(slots, -1), w).any()
    experts.fused_topk = False
    assert experts.forward_rows_fused(x, slots, w) is None


@given(rows=st.integers(0, 48), top_k=st.integers(1, 8), num_local=st.integers(1, 6), rank=st.integers(0, 3),
       hidden=st.sampled_from([16, 48]), inter=st.sampled_from([8, 40]), bf16=st.booleans(),
       int8=st.booleans(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_received_rows_op_over_random_routings(kernel_isas: list[str], rows: int, top_k: int, num_local: int,
                                              rank: int, hidden: int, inter: int, bf16: bool, int8: bool,
                                              seed: int) -> None:
    """``forward_rows_fused`` over the wire's views against the tensor ops on the localized slots, for
    any rows, top-k, slots per rank, rank, widths, dtype and int8 experts: the same bits."""
    from parallel.dispatch.plan import localize_slots, pack_rows, plan_from_mask, unpack_rows

    dtype = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    experts = Experts(num_local, hidden, inter, dtype=dtype, quantization="int8" if int8 else None)
    experts.w13.data.copy_(torch.randn(experts.w13.shape, generator=gen) * 0.3)
    experts.w2.data.copy_(torch.randn(experts.w2.shape, generator=gen) * 0.3)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    slots = torch.randint(-1, 4 * num_local, (rows, top_k), generator=gen)
    w = torch.rand(rows, top_k, generator=gen)
    rx, rslots, rweights = unpack_rows(pack_rows(x, slots, w, plan_from_mask(torch.ones(1, rows, dtype=torch.bool))),
                                       hidden, top_k, dtype)
    got = experts.forward_rows_fused(rx, rslots, rweights, rank * num_local)
    experts.fused_topk = False
    want = experts.forward_rows(rx.contiguous(), localize_slots(rslots, rank, num_local), rweights)
    assert got is not None and got.shape == want.shape == (rows, hidden) and got.dtype == dtype
    assert torch.equal(got, want)


def test_received_rows_of_prefill_size_go_to_the_library_gemms(kernel_isas: list[str], monkeypatch) -> None:
    """Where ``grouped`` gives prefill-size groups to the library GEMMs, the one op steps aside (None),
    judged on the rows per busy slot as ``grouped`` judges them; int8 weights stay in the op."""
    experts = _module(torch.float32)
    monkeypatch.setattr(kernels, "LIBRARY_GEMM_MIN_ROWS", 8)
    x = torch.randn(16, 32)
    two_slots = torch.tensor([[0], [1]]).repeat(8, 1)  # 16 rows on 2 busy slots: 8 each
    assert kernels.prefers_library_experts(torch.float32, 8)
    assert experts.forward_rows_fused(x, two_slots, torch.ones(16, 1)) is None
    spread = torch.arange(16).remainder(6).unsqueeze(1)  # 16 rows on 6 slots: 2.7 each
    assert experts.forward_rows_fused(x, spread, torch.ones(16, 1)) is not None
    quantized = _module(torch.float32, "int8")
    assert quantized.forward_rows_fused(x, two_slots, torch.ones(16, 1)) is not None


@pytest.mark.parametrize("tokens", [120, 700])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("skewed", [False, True])
def test_one_op_adds_rows_into_tokens_in_slot_order_on_every_thread_count(kernel_isas: list[str],
                                                                         threads: int, tokens: int,
                                                                         skewed: bool) -> None:
    """The down projection adds each row straight into its token's output row; with two threads each
    owns a range of column blocks (D 96: three block pairs), and every element still sums its rows in
    slot order, bit-equal to writing the rows out and adding them afterwards. 700 tokens (over 2^16
    output elements) take the padded output rows, copied out contiguously, and (2100 rows, bf16 on
    the dot tiles) gate/up's panels gathered as it reaches them; skewed routing leaves one slot 4
    rows (a panel of single-block items beside panels of block pairs)."""
    experts = Experts(6, 96, 32, dtype=torch.bfloat16)
    w13, w2 = _weights(6, 96, 32, torch.bfloat16, seed=5)
    experts.w13.data.copy_(w13)
    experts.w2.data.copy_(w2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, 96, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(tokens)])  # tokens / 2 rows per slot
    if skewed:  # slot 5 only for tokens 6-9
        ids = torch.stack([torch.randperm(5, generator=gen)[:3] for _ in range(tokens)])
        ids[6:10, 0] = 5
    ids[5] = -1  # no kept assignment: zeros
    w = torch.rand(tokens, 3, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name in kernel_isas:
            kernels.select_isa(name)
            experts.fused_topk = True
            got = experts(x, ids, w)
            experts.fused_topk = False
            want = experts(x, ids, w)
            assert got.shape == (tokens, 96) and got.is_contiguous()
            assert torch.equal(got, want), name
            assert not got[5].any()
            experts.fused_topk = True
            none_kept = experts(x, torch.full_like(ids, -1), w)
            assert none_kept.shape == (tokens, 96) and none_kept.is_contiguous() and not none_kept.any()
    finally:
        torch.set_num_threads(before)
        kernels.select_isa("auto")
        experts.fused_topk = True


def test_one_op_from_router_output_rejects_slots_it_does_not_host(kernel_isas: list[str]) -> None:
    packed = _module(torch.float32).packed_weights()
    with pytest.raises(RuntimeError, match="slot id 6 outside the 6 local slots"):
        kernels.experts_forward_topk(torch.zeros(2, 32), torch.tensor([[0, 6], [1, 2]]), torch.ones(2, 2), packed)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_experts_module_kernel_equals_pytorch_path(kernel_isas: list[str], quantization: str | None) -> None:
    experts = _module(torch.float32, quantization)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 32, generator=gen)
    ids = torch.randint(-1, 5, (20, 3), generator=gen)  # slot 5 unused, some dropped
    w = torch.rand(20, 3, generator=gen)
    assert experts.packed_weights() is not None
    fused, fused_rows = experts(x, ids, w), experts.forward_rows(x, ids, w)
    experts.use_kernel = False
    assert experts.packed_weights() is None
    plain, plain_rows = experts(x, ids, w), experts.forward_rows(x, ids, w)
    assert fused.shape == plain.shape == (20, 32)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_rows, plain_rows, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_packed_copy_follows_in_place_weight_writes(kernel_isas: list[str]) -> None:
    """Migration and reloads write w13/w2 in place: the kernel must see the new weights."""
    experts = _module(torch.float32)
    x, ids, w = torch.randn(4, 32), torch.tensor([[0, 1]] * 4), torch.ones(4, 2)
    before = experts(x, ids, w)
    first = experts.packed_weights()
    assert experts.packed_weights() is first  # cached while the weights are unchanged
    experts.w13[0].copy_(experts.w13[2])  # what parallel.migration does
    experts.w2[0].copy_(experts.w2[2])
    assert experts.packed_weights() is not first
    after = experts(x, ids, w)
    experts.use_kernel = False
    torch.testing.assert_close(after, experts(x, ids, w), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before, after)


def test_fallback_when_the_extension_cannot_build(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler(verbose: bool = False) -> None:
        raise OSError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(kernels, "build", no_compiler)
    kernels.is_available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="moe.kernels"):
            assert kernels.is_available() is False
        assert len(caplog.records) == 1 and "PyTorch path" in caplog.records[0].getMessage()
        experts = _module(torch.float32)
        assert experts.packed_weights() is None
        x, ids, w = torch.randn(5, 32), torch.tensor([[0, 3]] * 5), torch.rand(5, 2)
        want = torch.zeros(5, 32)
        for k in range(2):
            want += w[:, k:k + 1] * grouped_expert_forward(x, [5], experts.w13[ids[0, k]:ids[0, k] + 1],
                                                           experts.w2[ids[0, k]:ids[0, k] + 1])
        torch.testing.assert_close(experts(x, ids, w), want, atol=1e-5, rtol=1e-5)
    finally:
        kernels.is_available.cache_clear()


COMPILER_FAILURE = """Error building extension 'moe_kernels_cpu': [1/2] c++ -c experts_cpu.cpp -o experts_cpu.o
FAILED: experts_cpu.o
/src/moe/kernels/experts_cpu.cpp:249:24: warning: AVX vector return without AVX enabled changes the ABI [-Wpsabi]
/src/moe/kernels/amx_body.h:407:21: error: 'undefined_symbol' was not declared in this scope
/src/moe/kernels/amx_body.h:409:1: error: expected ';' before '}' token
ninja: build stopped: subcommand failed.
"""


def test_a_failed_build_is_named_by_the_compilers_first_error() -> None:
    assert kernels.build_failure(RuntimeError(COMPILER_FAILURE)) == (
        "/src/moe/kernels/amx_body.h:407:21: error: 'undefined_symbol' was not declared in this scope")
    assembler = "Error building extension\n/tmp/ccX.s: Assembler messages:\n/src/amx_body.h:111: Error: bad register name\n"
    assert kernels.build_failure(RuntimeError(assembler)) == "/src/amx_body.h:111: Error: bad register name"
    no_compiler = "error: command 'c++' failed: No such file or directory"
    assert kernels.build_failure(OSError(no_compiler)) == no_compiler  # no compiler output: the last line
    assert kernels.build_failure(OSError()) == "OSError"


def test_build_kernels_prints_the_compilers_error_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from launch import build_kernels

    def failing(verbose: bool = False) -> None:
        raise RuntimeError(COMPILER_FAILURE)

    monkeypatch.setattr(kernels, "build", failing)
    assert build_kernels.main([]) == 1
    err = capsys.readouterr().err
    assert err == ("error: building the CPU expert kernel failed: /src/moe/kernels/amx_body.h:407:21: error: "
                   "'undefined_symbol' was not declared in this scope\n")


def test_build_kernels_says_the_isa_and_how_the_dot_tiles_stream(kernel_isas: list[str],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from launch import build_kernels

    assert build_kernels.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("moe kernels: ") and out.count("\n") == 1 and f"(isa {kernels.isa()}" in out
    if kernels.isa() in kernels.DOT_ISAS:  # each class's modes with their probed speed over the default's
        assert re.search(r"weight streams \[one row: pairs [a-zA-Z 2+]+ \(\d\.\d\dx\), blocks [a-zA-Z 2]+ \(\d\.\d\dx\); "
                         r"two rows: .*; 3-4 rows: .*; 5\+ rows: .*\]", out), out
    else:
        assert "weight streams" not in out
    if kernels.isa() == "avx512bf16":  # the dot path's decode attention: how it asks for its rows
        assert re.search(r", decode attention asks into L[12], [28] tiles ahead \(\d\.\d\dx the default's speed\)", out)
    else:
        assert "decode attention asks" not in out


def test_build_kernels_warns_of_a_bad_variable_once(kernel_isas: list[str]) -> None:
    """A process settles its instruction set and modes once (``kernels.settled``): build-kernels says a
    variable it does not use once, and names a measured dot rate a forced instruction set leaves unused."""
    env = {**os.environ, "MOE_KERNEL_ISA": "bogus", "MOE_ATTENTION_ASKS": "2"}
    r = subprocess.run([sys.executable, "-m", "launch", "build-kernels"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("MOE_KERNEL_ISA='bogus' not used") == 1, r.stderr
    assert r.stderr.count("MOE_ATTENTION_ASKS='2' not used") == 1, r.stderr  # said on every instruction set
    r = subprocess.run([sys.executable, "-m", "launch", "build-kernels"], capture_output=True, text=True,
                       env={**os.environ, "MOE_KERNEL_ISA": "generic"}, timeout=300)
    assert r.returncode == 0 and "(isa generic" in r.stdout, r.stderr
    if "bf16 dot product at" in r.stdout:
        assert "(not used: isa generic has no dot tiles)" in r.stdout


def test_kernel_can_be_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_CPU_KERNEL", "0")
    kernels.is_available.cache_clear()
    try:
        assert kernels.is_available() is False
        assert kernels.tile_modes_text() is None and kernels.attention_asks_text() is None  # no kernel
        assert _module(torch.float32).packed_weights() is None
    finally:
        kernels.is_available.cache_clear()
        monkeypatch.delenv("MOE_CPU_KERNEL")
        kernels.is_available()  # loaded again now: a later test may point cache_dir elsewhere


def test_shapes_the_kernel_does_not_take_use_pytorch() -> None:
    odd = Experts(2, 12, 7, dtype=torch.float32)  # D % 16 != 0
    assert not kernels.can_pack(odd.w13, odd.w2)
    assert odd.packed_weights() is None
    assert not kernels.can_pack(torch.empty(2, 16, 16, dtype=torch.float16), torch.empty(2, 16, 8))


@pytest.mark.slow
@pytest.mark.parametrize("inter", [4, 12, 36, 250])
@pytest.mark.parametrize(("dtype", "quantization", "tol"),
                         [(torch.float32, None, 2e-5), (torch.bfloat16, None, 2e-2), (torch.bfloat16, "int8", 2e-2)])
def test_an_intermediate_size_off_the_block_is_padded_and_runs_the_kernel(
        kernel_isas: list[str], inter: int, dtype: torch.dtype, quantization: str | None, tol: float) -> None:
    """I % 8 != 0: the packed copy holds I zero-padded to a multiple of 8 (of 32 for bf16 on AMX), and
    the kernel's rows match the reference on the unpadded weights (int8: on the dequantized weights)."""
    counts = [3, 0, 40, 1]
    hidden, multiple = 32, kernels.inter_multiple(dtype)
    padded = -(-inter // multiple) * multiple
    w13, w2 = _weights(len(counts), hidden, inter, dtype, seed=inter)
    assert kernels.can_pack(w13, w2) and kernels.padded_inter(inter, multiple) == padded
    packed = kernels.pack_experts(w13, w2, quantization)
    assert packed.w13p.shape == (len(counts), padded // 8, hidden, 16)
    assert packed.w2p.shape == (len(counts), hidden // 16, padded, 16)
    if quantization:
        (q13, s13), (q2, s2) = kernels.quantize_int8(w13), kernels.quantize_int8(w2)
        w13, w2 = kernels.dequantize_int8(q13, s13, dtype), kernels.dequantize_int8(q2, s2, dtype)
        assert packed.s13.shape == (len(counts), padded // 8, 16) and packed.s2.shape == (len(counts), hidden // 16, 16)
    gen = torch.Generator().manual_seed(2)
    n = sum(counts)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    rw = torch.rand(n, generator=gen)
    want = grouped_expert_forward(x.double(), counts, w13.double(), w2.double(), rw.double())  # [N, D]
    try:
        for isa in kernel_isas:
            kernels.select_isa(isa)
            got = kernels.experts_forward(x, counts, packed, rw)
            assert got.shape == (n, hidden) and got.dtype == dtype
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    finally:
        kernels.select_isa("auto")
    module = Experts(len(counts), hidden, inter, dtype=dtype)
    assert module.packed_weights() is not None  # the module takes the kernel too


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        Experts(2, 16, 8, quantization="fp4")


@pytest.mark.slow
def test_dense_mlp_runs_the_kernel_and_matches_its_linears(kernel_isas: list[str]) -> None:
    from moe.layers.mlp import DenseMLP

    mlp = DenseMLP(32, 24, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    x = torch.randn(5, 32, generator=gen)
    want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert mlp._packed_weights(x) is not None
    torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)
    mlp.shard_for_tp(1, 3)  # new (sharded) weights: the packed copy follows them
    got = mlp(x)
    assert got.shape == (5, 32)
    torch.testing.assert_close(got, mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)),
                               atol=1e-5, rtol=1e-5)
    big = torch.randn(kernels.LIBRARY_GEMM_MIN_ROWS, 32)
    assert mlp._packed_weights(big) is None  # fp32 prefill-size: the library GEMM


def test_trainable_layers_keep_their_gradients(kernel_isas: list[str]) -> None:
    """The kernels have no backward: under autograd (training reuses DenseMLP) the PyTorch
    path runs, so gradients reach the weights and the input as with plain linears."""
    from moe.layers.mlp import DenseMLP

    mlp = DenseMLP(32, 24, torch.float32).requires_grad_(True)
    x = torch.randn(5, 32, requires_grad=True)
    assert mlp._packed_weights(x) is None
    mlp(x).square().sum().backward()
    want = [p.grad.clone() for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)]
    x_grad = x.grad.clone()
    mlp.zero_grad()
    x.grad = None
    plain = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    plain.square().sum().backward()
    for got, p in zip(want, (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)):
        torch.testing.assert_close(got, p.grad)
    torch.testing.assert_close(x_grad, x.grad)
    with torch.no_grad():  # inference on the same module: the kernel again
        assert mlp._packed_weights(x) is not None


def test_compiling_leaves_the_build_flags_and_cache_key_as_they_were(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path) -> None:
    """cpp_extension appends to the flag lists it is given; a second build in the process must
    still find the first one's cache folder (a new key compiled and loaded the library twice,
    and the second registration of the op namespace aborted the process)."""
    from torch.utils import cpp_extension

    seen: dict = {}

    def fake_load(**kwargs) -> None:
        kwargs["extra_cflags"].append("-fPIC")
        kwargs["extra_ldflags"].append("-shared")
        seen.update(kwargs)

    monkeypatch.setenv("MOE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    before = kernels.cache_dir()
    assert kernels.build() == before
    assert "-fopenmp" in seen["extra_cflags"] and "-fopenmp" in seen["extra_ldflags"]
    assert kernels.cache_dir() == before and "-fPIC" not in kernels.CFLAGS


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path) -> None:
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    kernels._remove_stale_lock(lock)
    assert lock.exists()  # someone may be compiling right now
    old = time.time() - kernels.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    kernels._remove_stale_lock(lock)
    assert not lock.exists()
    kernels._remove_stale_lock(lock)  # nothing there: fine


@pytest.mark.slow
def test_a_finished_build_loads_without_the_build_lock() -> None:
    """A rank killed while loading left torch's baton file behind once and every later load
    waited on it forever: a finished build must load without touching the lock."""
    import subprocess
    import sys

    if not kernels.is_available():
        pytest.skip("the extension cannot be built here")
    lock = kernels.cache_dir() / "lock"
    lock.touch()  # as a killed process leaves it
    try:
        code = "from moe import kernels; kernels.build(); import torch; print(hasattr(torch.ops.moe_kernels, 'experts_forward'))"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
    finally:
        lock.unlink(missing_ok=True)


def test_isa_from_environment(kernel_isas: list[str], monkeypatch: pytest.MonkeyPatch,
                              caplog: pytest.LogCaptureFixture) -> None:
    """MOE_KERNEL_ISA picks the instruction set for the process; a bad name keeps the fastest."""
    best = kernels.select_isa("auto")
    try:
        monkeypatch.setenv("MOE_KERNEL_ISA", "generic")
        assert kernels.select_isa_from_env() == "generic" == kernels.isa()
        monkeypatch.setenv("MOE_KERNEL_ISA", "avx9000")
        with caplog.at_level(logging.WARNING, logger="moe.kernels"):
            assert kernels.select_isa_from_env() == best
        assert "MOE_KERNEL_ISA='avx9000' not used (unknown ISA 'avx9000'" in caplog.text
        monkeypatch.delenv("MOE_KERNEL_ISA")
        assert kernels.select_isa_from_env() == best
        # as written in a shell: any case, spaces around, empty for the default
        monkeypatch.setenv("MOE_KERNEL_ISA", " Generic ")
        assert kernels.select_isa_from_env() == "generic"
        caplog.clear()
        for value in ("", "  ", "AUTO"):
            monkeypatch.setenv("MOE_KERNEL_ISA", value)
            with caplog.at_level(logging.WARNING, logger="moe.kernels"):
                assert kernels.select_isa_from_env() == best
        assert "not used" not in caplog.text
    finally:
        kernels.select_isa("auto")


def test_tile_modes_are_probed_kept_and_give_the_same_bits(kernel_isas: list[str], monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture, tmp_path) -> None:
    """How dot tiles stream their weights (with or without prefetches, into L1 or L2, a block pair side
    by side or one block after the other) is the CPU's, measured for each class of row counts, block
    pairs and single blocks apart: the probe's fastest mode where it beats the default by
    TILE_MIN_GAIN, kept beside the build, the class's variable over it; linears and experts give the
    same bits in every mode at every row count."""
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    for _, _, env in kernels.TILE_ROW_CLASSES:
        monkeypatch.delenv(env, raising=False)
    saved = tmp_path / kernels.PROBES_FILE
    classes = [rows for rows, _, _ in kernels.TILE_ROW_CLASSES]
    assert classes == [1, 2, 4, 8]
    before = {(rows, nb): kernels.tile_mode(rows, nb) for rows in classes for nb in (1, 2)}
    pairs, blocks = len(kernels.TILE_PAIR_MODES), len(kernels.TILE_BLOCK_MODES)
    try:
        gains = kernels.agree_tile_modes()  # probed here: the cache folder is new
        probes = json.loads(saved.read_text())
        assert list(gains) == classes
        for rows in classes:
            seconds = probes[f"tile_seconds_{rows}"]
            if "avx512bf16" in kernel_isas:
                assert len(seconds) == pairs + blocks and all(0 < t < 1 for t in seconds)
                for nb, part, modes, gain in ((2, seconds[:pairs], list(kernels.TILE_PAIR_MODES), gains[rows][0]),
                                              (1, seconds[pairs:], list(kernels.TILE_BLOCK_MODES), gains[rows][1])):
                    mode = kernels.tile_mode(rows, nb)
                    assert gain == part[modes.index(kernels.TILE_PREFETCH)] / part[modes.index(mode)] and gain >= 1.0
                    assert mode == kernels.TILE_PREFETCH or gain >= kernels.TILE_MIN_GAIN
                    assert part[modes.index(mode)] == min(part) or mode == kernels.TILE_PREFETCH
            else:
                assert seconds == [] and gains[rows] == (1.0, 1.0)
                assert kernels.tile_mode(rows, 1) == kernels.tile_mode(rows, 2) == kernels.TILE_PREFETCH
        # a class's mode covers its row counts: 3 and 4 rows, 5 to 12 and more
        assert kernels.tile_mode(3, 1) == kernels.tile_mode(4, 1) and kernels.tile_mode(12, 2) == kernels.tile_mode(5, 2)

        def probed(times: list[float]) -> tuple[int, int]:  # the 3-4-row class's (pair, block) modes
            saved.write_text(json.dumps({"cpu": kernels.cpu_signature(),
                                         **{f"tile_seconds_{rows}": [1.0] * (pairs + blocks) for rows in classes},
                                         "tile_seconds_4": times}))
            kernels.agree_tile_modes()  # the saved probes, not new ones
            return kernels.tile_mode(3, 2), kernels.tile_mode(3, 1)

        # pair modes 0, 1, 2, 3, 5, 7 then block modes 0, 1, 5
        assert probed([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7]) == (2, 5)
        assert probed([0.98, 1.0, 1.0, 0.99, 1.0, 1.0, 0.97, 1.0, 1.0]) == (1, 1)  # within 5 %: the defaults
        assert probed([1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 0.5, 1.0, 1.0]) == (7, 0)
        # a broken probe, an earlier one of other modes, times that are no times: probed again
        for broken in ([1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0] * 4, [float("nan")] * 9, [10**400] * 9,
                       [1e30] * 9):
            probed(broken)
            again = json.loads(saved.read_text())["tile_seconds_4"]
            assert len(again) == (pairs + blocks if "avx512bf16" in kernel_isas else 0) and again != broken
        monkeypatch.setenv("MOE_FEW_ROWS_MODE", "7")
        assert probed([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7]) == (7, 5)  # single blocks: its prefetch
        if kernels.isa() in kernels.DOT_ISAS:
            assert ("3-4 rows: pairs one stream + L2 prefetch, blocks L2 prefetch (set by MOE_FEW_ROWS_MODE);"
                    in kernels.tile_modes_text())
        monkeypatch.setenv("MOE_FEW_ROWS_MODE", "sometimes")
        with caplog.at_level(logging.WARNING, logger="moe.kernels"):
            assert probed([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7]) == (2, 5)
        assert "MOE_FEW_ROWS_MODE='sometimes' not used (expected one of 0, 1, 2, 3, 5, 7 or auto)" in caplog.text
        monkeypatch.setenv("MOE_FEW_ROWS_MODE", " 7 ")
        assert probed([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7]) == (7, 5)
        caplog.clear()
        for value in ("", "AUTO"):  # empty: as unset
            monkeypatch.setenv("MOE_FEW_ROWS_MODE", value)
            with caplog.at_level(logging.WARNING, logger="moe.kernels"):
                assert probed([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7]) == (2, 5)
        assert "not used" not in caplog.text
        monkeypatch.delenv("MOE_FEW_ROWS_MODE")
        with pytest.raises(RuntimeError, match="tile mode 4 is not one of 0, 1, 2, 3, 5, 7"):
            torch.ops.moe_kernels.set_tile_mode(1, 2, 4)
        with pytest.raises(RuntimeError, match="tile blocks must be 1 .single blocks. or 2 .block pairs., not 3"):
            torch.ops.moe_kernels.set_tile_mode(1, 3, 1)
        with pytest.raises(RuntimeError, match="tile rows must be positive, not 0"):
            torch.ops.moe_kernels.tile_mode(0, 2)
        with pytest.raises(RuntimeError, match="single blocks take tile mode 0, 1 or 5, not 7"):
            torch.ops.moe_kernels.set_tile_mode(1, 1, 7)
        with pytest.raises(RuntimeError, match="takes 1-12 rows"):
            torch.ops.moe_kernels.tile_mode_seconds(13, 1 << 20)

        g = torch.Generator().manual_seed(5)
        w = (torch.randn(96, 1040, generator=g) / 30).bfloat16()  # 6 column blocks, K not a multiple of 32
        w13, w2 = _weights(4, 64, 40, torch.bfloat16, seed=6)
        rows = torch.randn(4, 64, generator=g).bfloat16()
        kernels.select_isa("generic")
        assert kernels.tile_modes_text() is None  # no dot tiles: the modes change nothing
        for isa in [i for i in kernel_isas if i in kernels.DOT_ISAS]:
            kernels.select_isa(isa)
            packed, experts = kernels.pack_linear(w), kernels.pack_experts(w13, w2)
            for n in (1, 2, 3, 5, 8, 12, 13, 16):  # experts: single blocks below 16 rows, block pairs from 16
                x = torch.randn(n, 1040, generator=g).bfloat16()
                expert_rows = torch.randn(4 * n, 64, generator=g).bfloat16()
                outs = []
                for mode in kernels.TILE_PAIR_MODES:
                    for c in classes:
                        torch.ops.moe_kernels.set_tile_mode(c, 2, mode)
                        torch.ops.moe_kernels.set_tile_mode(c, 1, mode & ~kernels.TILE_ONE_STREAM)
                    outs.append((kernels.linear_forward(x, packed),
                                 kernels.experts_forward(expert_rows, [n] * 4, experts)))
                assert outs[0][0].shape == (n, 96) and outs[0][1].shape == (4 * n, 64)
                for lin, exp in outs[1:]:
                    assert torch.equal(lin, outs[0][0]) and torch.equal(exp, outs[0][1])
            assert "3-4 rows: pairs one stream + L2 prefetch, blocks L2 prefetch;" in kernels.tile_modes_text()
    finally:
        for (rows, nb), mode in before.items():
            torch.ops.moe_kernels.set_tile_mode(rows, nb, mode)
        kernels.select_isa("auto")
    assert kernels.prefers_library_gemm(torch.bfloat16, rows) is False


def test_every_process_on_a_cpu_takes_the_first_probe(kernel_isas: list[str], monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path) -> None:
    """The probed rate is kept beside the build, keyed by the CPU: a later process (a Ray worker of
    the same machine) picks its tiles by that rate, not by a probe of its own that could land on
    the other side of 1.0; another CPU's entry is replaced, and an unwritable cache is no error."""
    probed = kernels.bf16_dot_rate()
    modes = {(rows, nb): kernels.tile_mode(rows, nb) for rows, _, _ in kernels.TILE_ROW_CLASSES for nb in (1, 2)}
    has_dot = "avx512bf16" in kernel_isas
    saved = tmp_path / kernels.PROBES_FILE
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    try:
        assert kernels.agree_bf16_dot_rate() == probed  # first process: probes and writes
        assert json.loads(saved.read_text()) == {"cpu": kernels.cpu_signature(), "rate": probed}
        tiles = {f"tile_seconds_{rows}": [1.0] * 9 for rows, _, _ in kernels.TILE_ROW_CLASSES}
        saved.write_text(json.dumps({"cpu": kernels.cpu_signature(), "rate": probed, **tiles,
                                     "tile_seconds_1": [1.0, 2.0, 1.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]}))
        assert kernels.agree_tile_modes()[1] == (2.0, 1.0)  # the other probes kept beside it
        assert kernels.tile_mode(1, 2) == 0 and kernels.tile_mode(1, 1) == kernels.TILE_PREFETCH
        assert json.loads(saved.read_text())["rate"] == probed

        for bad in (float("nan"), 10**400, "fast"):  # not a rate: probed again
            saved.write_text(json.dumps({"cpu": kernels.cpu_signature(), "rate": bad}))
            assert kernels.agree_bf16_dot_rate() == probed
            assert json.loads(saved.read_text())["rate"] == probed
        saved.write_text(json.dumps({"cpu": kernels.cpu_signature(), "rate": 3.0}))
        assert kernels.agree_bf16_dot_rate() == (3.0 if has_dot else 0.0)
        assert kernels.bf16_dot_rate() == (3.0 if has_dot else 0.0)
        assert kernels.select_isa("auto") == ("amx" if "amx" in kernel_isas else "avx512bf16" if has_dot
                                              else kernel_isas[-1])

        torch.ops.moe_kernels.set_bf16_dot_rate(-1.0)  # forget: the next use probes again
        saved.write_text(json.dumps({"cpu": "another cpu", "rate": 3.0}))
        rate = kernels.agree_bf16_dot_rate()
        assert (0.1 < rate < 10.0) if has_dot else rate == 0.0
        assert json.loads(saved.read_text())["cpu"] == kernels.cpu_signature()

        (tmp_path / "a_file").write_text("")
        monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path / "a_file" / "below")
        assert kernels.agree_bf16_dot_rate() == rate
    finally:
        torch.ops.moe_kernels.set_bf16_dot_rate(probed)
        for (rows, nb), mode in modes.items():
            torch.ops.moe_kernels.set_tile_mode(rows, nb, mode)
        kernels.select_isa("auto")


@pytest.mark.parametrize("tokens", [40, 700])
def test_int8_experts_with_many_rows_run_the_bf16_tiles_on_their_dequantized_values(kernel_isas: list[str],
                                                                                  tokens: int) -> None:
    """bf16 rows meeting int8 experts at >= 16 rows per slot (prefill sizes) take the dot tiles through
    the experts' bf16 values: bit-equal to the bf16 kernel on ``dequantize_int8``'s bf16 weights, from
    the router's output (700 tokens: panels gathered as gate/up goes) and grouped. With fewer rows the
    FMA tiles keep them: the same bits as the FMA-only instruction set."""
    dot_isas = [isa for isa in kernel_isas if isa in ("amx", "avx512bf16")]
    if not dot_isas:
        pytest.skip("no bf16 dot tiles on this CPU")
    slots, hidden, inter, top_k = 6, 96, 32, 3
    w13, w2 = _weights(slots, hidden, inter, torch.bfloat16, seed=7)
    q13, s13 = kernels.quantize_int8(w13)
    q2, s2 = kernels.quantize_int8(w2)
    dequantized = kernels.pack_experts(kernels.dequantize_int8(q13, s13, torch.bfloat16),
                                       kernels.dequantize_int8(q2, s2, torch.bfloat16))
    packed = kernels.pack_experts(w13, w2, "int8")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(slots, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    counts = [tokens * top_k // slots] * slots
    rows = torch.randn(sum(counts), hidden, generator=gen).to(torch.bfloat16)
    rw = torch.rand(sum(counts), generator=gen)
    few = x[:8], ids[:8], w[:8]  # 24 rows over 6 slots: 4 each
    threads = torch.get_num_threads()
    for isa in dot_isas:
        kernels.select_isa(isa)
        got = kernels.experts_forward_topk(x, ids, w, packed)
        assert got.shape == (tokens, hidden) and got.dtype == torch.float32
        assert torch.equal(got, kernels.experts_forward_topk(x, ids, w, dequantized)), isa
        torch.set_num_threads(2)  # each thread its own scratch copies: the same bits
        try:
            assert torch.equal(got, kernels.experts_forward_topk(x, ids, w, packed)), isa
        finally:
            torch.set_num_threads(threads)
        grouped = kernels.experts_forward(rows, counts, packed, rw, out_fp32=True)
        assert torch.equal(grouped, kernels.experts_forward(rows, counts, dequantized, rw, out_fp32=True)), isa
        small = kernels.experts_forward_topk(*few, packed)
        kernels.select_isa("avx512")
        assert torch.equal(small, kernels.experts_forward_topk(*few, packed)), isa
        assert not torch.equal(small, kernels.experts_forward_topk(*few, dequantized))  # not the dot tiles' bits
    kernels.select_isa("auto")
