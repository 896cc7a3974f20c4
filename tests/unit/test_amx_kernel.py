"""moe/kernels on AMX: the bf16 x bf16 ops' products on tdpbf16ps tiles (amx_body.h).

Shapes put K (the hidden size for gate/up, the intermediate size for down) on multiples of 32, where
the tiles run, and off them, where the vdpbf16ps tiles take over; row counts sit on both sides of
the 16-row tile and the 32-row pass. The tests that run the tiles skip on CPUs without AMX (or where
the OS refuses its tile state); the routing between kernel and library GEMM is checked everywhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe import kernels
from moe.experts import Experts, grouped_expert_forward
from tests.unit.test_expert_kernel import _weights

COUNTS = [0, 1, 15, 16, 17, 0, 31, 32, 33, 100]


@pytest.fixture
def amx(kernel_isas: list[str]):
    if "amx" not in kernel_isas:
        pytest.skip("no AMX tiles on this CPU (or the OS refuses their state)")
    kernels.select_isa("amx")
    yield
    kernels.select_isa("auto")


@pytest.mark.slow
@pytest.mark.parametrize(("hidden", "inter"), [(64, 96), (96, 40), (48, 64)])
def test_amx_experts_match_reference(amx, hidden: int, inter: int) -> None:
    """Both phases on the tiles (64, 96), gate/up only (96, 40: down's K = 40, packed unpadded),
    down only (48, 64): within bf16 rounding of a float64 reference, grouped and from the router's
    output."""
    w13, w2 = _weights(len(COUNTS), hidden, inter, torch.bfloat16, seed=hidden + inter)
    gen = torch.Generator().manual_seed(5)
    n = sum(COUNTS)
    x = torch.randn(n, hidden, generator=gen).bfloat16()
    rw = torch.rand(n, generator=gen)
    packed = kernels.pack_experts(w13, w2, multiple=8)  # I 40 stays 40: down on the dot tiles
    assert packed.w2p.shape[2] == inter
    want = grouped_expert_forward(x.double(), COUNTS, w13.double(), w2.double(), rw.double())  # [N, D]
    got = kernels.experts_forward(x, COUNTS, packed, rw, out_fp32=True)
    assert got.shape == (n, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    got16 = kernels.experts_forward(x, COUNTS, packed, rw)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.double(), want, atol=2e-2, rtol=2e-2)

    # from the router's output: T tokens x 2 slots, summed per token in fp32
    tokens = 70
    slots = torch.stack([torch.randperm(len(COUNTS), generator=gen)[:2] for _ in range(tokens)])  # [T, 2]
    weights = torch.rand(tokens, 2, generator=gen)
    xt = torch.randn(tokens, hidden, generator=gen).bfloat16()
    out = kernels.experts_forward_topk(xt, slots, weights, packed)  # [T, D] fp32
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    for k in range(2):
        for t in range(tokens):
            s = int(slots[t, k])
            counts = [0] * len(COUNTS)
            counts[s] = 1
            ref[t] += grouped_expert_forward(xt[t:t + 1].double(), counts, w13.double(), w2.double(),
                                             weights[t:t + 1, k].double())[0]
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def _assert_rows_alone_give(want: torch.Tensor, x: torch.Tensor, rw: torch.Tensor,
                            packed: kernels.PackedExperts, every_row: bool = False) -> None:
    """The first, middle and last row (``every_row``: each row) of each slot in ``COUNTS``, run alone
    in its expert (a 1-row call), give the same bits as in ``want`` [N, D] (the call over all N rows)."""
    start = 0
    for slot, rows in enumerate(COUNTS):
        for r in (range(rows) if every_row else (0, rows // 2, rows - 1)) if rows else ():
            alone = [0] * len(COUNTS)
            alone[slot] = 1
            row = start + r
            got = kernels.experts_forward(x[row:row + 1], alone, packed, rw[row:row + 1], out_fp32=True)
            assert torch.equal(got[0], want[row]), (slot, r)
        start += rows


def _assert_rows_keep_their_bits(scale: float) -> None:
    """A row's outputs are the same bits alone in its expert (a 1-row call) as among 100 rows, and on
    1, 2 or 3 threads, with the inputs scaled by ``scale``."""
    hidden, inter = 64, 96
    w13, w2 = _weights(len(COUNTS), hidden, inter, torch.bfloat16, seed=9)
    gen = torch.Generator().manual_seed(6)
    n = sum(COUNTS)
    x = (torch.randn(n, hidden, generator=gen) * scale).bfloat16()
    if scale > 1:
        gates = torch.einsum("nh,eih->nei", x.float(), w13[:, :inter].float())  # [N, E, I]: every expert's
        assert gates.abs().max() > 88
    rw = torch.rand(n, generator=gen)
    packed = kernels.pack_experts(w13, w2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = kernels.experts_forward(x, COUNTS, packed, rw, out_fp32=True)
        assert want.shape == (n, hidden)
        _assert_rows_alone_give(want, x, rw, packed, every_row=True)
        for num in (2, 3):
            torch.set_num_threads(num)
            assert torch.equal(kernels.experts_forward(x, COUNTS, packed, rw, out_fp32=True), want), num
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1.0, 400.0])
def test_amx_row_values_do_not_depend_on_the_rows_beside_them_or_the_threads(amx, scale: float) -> None:
    """The tiles keep one order of sums per row. A lone row's gate/up block goes through the 8-lane
    SwiGLU, a block pair of many rows through the 16-lane one (the same bits); inputs scaled by 400
    put gate values past e^x's clamps (|g| > 88)."""
    _assert_rows_keep_their_bits(scale)


@pytest.mark.slow
@pytest.mark.parametrize("inter", [40, 264])
def test_amx_pads_an_intermediate_size_off_32_so_rows_keep_their_values_alone(amx, inter: int) -> None:
    """bf16 experts whose I is not a multiple of 32 are packed with I zero-padded to one on AMX: the
    down projection then runs on the tiles too, so a row's outputs are the same bits alone in its
    expert as among the others (on the dot tiles they differed by up to 2.4e-7)."""
    hidden = 64
    w13, w2 = _weights(len(COUNTS), hidden, inter, torch.bfloat16, seed=inter)
    assert kernels.inter_multiple(torch.bfloat16) == 32 and kernels.inter_multiple(torch.float32) == 8
    packed = kernels.pack_experts(w13, w2)
    assert packed.w2p.shape == (len(COUNTS), hidden // 16, -(-inter // 32) * 32, 16)
    gen = torch.Generator().manual_seed(7)
    n = sum(COUNTS)
    x = torch.randn(n, hidden, generator=gen).bfloat16()
    rw = torch.rand(n, generator=gen)
    want = kernels.experts_forward(x, COUNTS, packed, rw, out_fp32=True)
    ref = grouped_expert_forward(x.double(), COUNTS, w13.double(), w2.double(), rw.double())  # [N, D]
    torch.testing.assert_close(want.double(), ref, atol=2e-2, rtol=2e-2)
    _assert_rows_alone_give(want, x, rw, packed)


@pytest.mark.slow
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_reads_strided_rows(amx, bias: bool) -> None:
    """linear_forward on a permuted view (rows 3 heads apart, no copy) equals the contiguous copy's
    bits and F.linear within bf16 rounding; 40 output columns leave a part-filled last block."""
    heads, rows, k, c = 3, 37, 64, 40
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, heads, k, generator=gen).bfloat16().transpose(0, 1)  # [H, N, K] view
    w = (torch.randn(heads, c, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(heads, c, generator=gen) if bias else torch.empty(0)
    packed = kernels.pack_linear(w)
    got = torch.ops.moe_kernels.linear_forward(x, packed.wp, b, c, True)  # [H, N, C] fp32
    assert got.shape == (heads, rows, c) and got.dtype == torch.float32
    assert torch.equal(got, torch.ops.moe_kernels.linear_forward(x.contiguous(), packed.wp, b, c, True))
    for h in range(heads):
        want = F.linear(x[h].double(), w[h].double(), b[h].double() if bias else None)
        torch.testing.assert_close(got[h].double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_amx_experts_larger_than_l2_match_reference_and_rows_alone(amx) -> None:
    """Experts whose packed gate/up weight is over 2 MB (D 256, I 2080: 2.1 MB) take panels of 192
    rows on AMX: grouped rows within bf16 rounding of a float64 reference, rows on both sides of the
    96- and 192-row panel edges the same bits as computed alone, and the one op from the router's
    output (1200 rows: gathered panels) the bits of grouping first."""
    hidden, inter, counts = 256, 2080, [250, 0, 130]
    w13, w2 = _weights(3, hidden, inter, torch.bfloat16, seed=21)
    assert w13[0].numel() * 2 > 2 << 20
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(sum(counts), hidden, generator=gen).bfloat16()
    rw = torch.rand(sum(counts), generator=gen)
    packed = kernels.pack_experts(w13, w2)
    got = kernels.experts_forward(x, counts, packed, rw, out_fp32=True)  # [N, D]
    assert got.shape == (sum(counts), hidden) and got.dtype == torch.float32
    want = grouped_expert_forward(x.double(), counts, w13.double(), w2.double(), rw.double())
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    for row in (0, 95, 96, 191, 192, 249, 250, 379):
        alone = [1, 0, 0] if row < 250 else [0, 0, 1]
        one = kernels.experts_forward(x[row:row + 1], alone, packed, rw[row:row + 1], out_fp32=True)
        assert torch.equal(one[0], got[row]), row

    experts = Experts(3, hidden, inter, dtype=torch.bfloat16)
    experts.w13.data.copy_(w13)
    experts.w2.data.copy_(w2)
    tokens = 600
    xt = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(tokens)])  # [T, 2]
    weights = torch.rand(tokens, 2, generator=gen)
    experts.fused_topk = True
    fused = experts(xt, ids, weights)
    experts.fused_topk = False
    grouped = experts(xt, ids, weights)  # compute_local_routing + experts_forward + index_add_
    assert fused.shape == (tokens, hidden) and torch.equal(fused, grouped)


@pytest.mark.slow
def test_amx_tiles_survive_another_library_changing_the_tile_state(amx) -> None:
    """oneDNN's bf16 GEMMs load their own tile configuration on this thread between two calls; the
    kernel's results stay the same bits (every call checks the configuration it needs)."""
    w13, w2 = _weights(len(COUNTS), 64, 96, torch.bfloat16, seed=11)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(sum(COUNTS), 64, generator=gen).bfloat16()
    packed = kernels.pack_experts(w13, w2)
    want = kernels.experts_forward(x, COUNTS, packed, out_fp32=True)
    a = torch.randn(300, 520, generator=gen).bfloat16()
    for shape in ((300, 7), (300, 520)):
        torch.matmul(a, torch.randn(520, shape[1], generator=gen).bfloat16())  # oneDNN: AMX where it can
        assert torch.equal(kernels.experts_forward(x, COUNTS, packed, out_fp32=True), want)


def test_bf16_experts_stay_on_the_kernel_on_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """On AMX the kernel's bf16 experts out-run PyTorch's per-expert GEMMs at every row count, so
    prefill-size groups stay on the kernel; linears and fp32 keep the library GEMM from its
    threshold, and other instruction sets follow ``prefers_library_gemm``."""
    rows = kernels.LIBRARY_GEMM_MIN_ROWS
    monkeypatch.setattr(kernels, "has_fast_bf16_gemm", lambda: True)
    monkeypatch.setattr(kernels, "has_amx_bf16", lambda: True)
    monkeypatch.setattr(kernels, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "isa", lambda: "amx")
    assert kernels.prefers_library_gemm(torch.bfloat16, rows) is True
    assert kernels.prefers_library_experts(torch.bfloat16, rows) is False
    assert kernels.prefers_library_experts(torch.bfloat16, 8 * rows) is False
    assert kernels.prefers_library_experts(torch.float32, rows) is True
    assert kernels.prefers_library_experts(torch.bfloat16, rows - 1) is False
    monkeypatch.setattr(kernels, "isa", lambda: "avx512bf16")
    assert kernels.prefers_library_experts(torch.bfloat16, rows) is True
