"""Prefill attention read straight from the paged cache (moe.kernels.gqa_prefill for grouped-query
k/v, mla_prefill for MLA's expanded keys and values) against the per-sequence masked sdpa path,
alone and inside the model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moe import kernels
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.layers.paged import sdpa
from tests.unit.test_mla_kernel import _model, assert_same_generation
from tests.unit.test_model_vs_hf import greedy_generate


def _masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                 scale: float) -> torch.Tensor:
    """q: [Lq, H, dk], the last Lq positions of a context of L keys k: [L, Hk, dk], v: [L, Hk, dv].
    Returns [Lq, H, dv]: the reference path's masked sdpa."""
    lq, length = q.shape[0], k.shape[0]
    kpos, qpos = torch.arange(length)[None, :], torch.arange(length - lq, length)[:, None]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    out = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask[None, None], scale)
    return out[0].transpose(0, 1)


def _scattered_tables(gen: torch.Generator, lens: list[int], size: int, blocks: int) -> torch.Tensor:
    """[B, nb] tables of distinct blocks drawn at random from ``blocks`` (zero past each sequence's)."""
    counts = [-(-n // size) for n in lens]
    perm = torch.randperm(blocks, generator=gen)
    tables = torch.zeros(len(lens), max(counts), dtype=torch.int64)
    used = 0
    for b, n in enumerate(counts):
        tables[b, :n] = perm[used : used + n]
        used += n
    return tables


def _batch(lens: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(context length, new rows) per sequence -> context_lens [B], query_starts [B + 1], rows T."""
    starts = [0]
    for _, rows in lens:
        starts.append(starts[-1] + rows)
    return torch.tensor([c for c, _ in lens]), torch.tensor(starts), starts[-1]


# (context length, new rows) per sequence: a whole prompt, a chunk after a cached prefix, one row
# (a decode row given as a prefill of one), a chunk ending mid-block, a short chunk after a long prefix
SEQS = [(37, 37), (50, 13), (1, 1), (70, 64), (9, 2)]
# (query heads, kv heads, head dim, block size, sliding window): GQA groups of 4, a window shorter
# than a block, MHA with a width no vector length divides, one kv head for all, an odd block size
# (token pairs across blocks) with a head dim of five 32-value steps
GQA_CASES = [(8, 2, 64, 16, None), (6, 3, 32, 4, 5), (16, 16, 40, 16, None), (4, 1, 24, 8, 20),
             (4, 2, 160, 7, None)]


@pytest.mark.parametrize("case", GQA_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_prefill_matches_the_masked_sdpa_on_every_isa(kernel_isas: list[str], case: tuple, dtype: torch.dtype
                                                          ) -> None:
    h, hkv, hd, size, window = case
    gen = torch.Generator().manual_seed(hd)
    lens, starts, rows = _batch(SEQS)
    pool = torch.randn(64, 2, size, hkv, hd, generator=gen).to(dtype)
    tables = _scattered_tables(gen, lens.tolist(), size, 64)
    q = torch.randn(rows, h, hd, generator=gen).to(dtype)
    scale = 1 / math.sqrt(hd)
    for name in kernel_isas:
        kernels.select_isa(name)
        out = kernels.gqa_prefill(q, pool, tables, lens, starts, scale, window)
        assert out.shape == (rows, h, hd) and out.dtype == dtype
        for b, (ctx, _) in enumerate(SEQS):
            kv = pool[tables[b, : -(-ctx // size)]].transpose(0, 1).reshape(2, -1, hkv, hd)[:, :ctx]  # k, v
            want = _masked_sdpa(q[starts[b] : starts[b + 1]], kv[0], kv[1], window, scale).float()
            got = out[starts[b] : starts[b + 1]].float()
            # fp32: the order of the sums; bf16: an output rounded the other way (one bf16 ulp)
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * want.abs().max().item()
            assert (got - want).abs().max().item() <= tol, (name, b)
    kernels.select_isa("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_prefill_matches_the_masked_sdpa_on_every_isa(kernel_isas: list[str], dtype: torch.dtype) -> None:
    h, dk, dv, size = 16, 96, 64, 16  # DeepSeek's per-head key (64 + 32 rope) and value widths
    gen = torch.Generator().manual_seed(1)
    lens, starts, rows = _batch(SEQS)
    kv = torch.randn(40, size, h, dk + dv, generator=gen).to(dtype)
    tables = _scattered_tables(gen, lens.tolist(), size, 40)
    q = torch.randn(rows, h, dk, generator=gen).to(dtype)
    for name in kernel_isas:
        kernels.select_isa(name)
        out = kernels.mla_prefill(q, kv, tables, lens, starts, dv, 0.1)
        assert out.shape == (rows, h, dv) and out.dtype == dtype
        for b, (ctx, _) in enumerate(SEQS):
            seq = kv[tables[b, : -(-ctx // size)]].reshape(-1, h, dk + dv)[:ctx]
            want = _masked_sdpa(q[starts[b] : starts[b + 1]], seq[..., :dk], seq[..., dk:], None, 0.1).float()
            got = out[starts[b] : starts[b + 1]].float()
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * want.abs().max().item()
            assert (got - want).abs().max().item() <= tol, (name, b)
    kernels.select_isa("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_prefill_reads_a_rope_key_shared_by_the_heads(kernel_isas: list[str], dtype: torch.dtype) -> None:
    """k_pe [N, S, R]: every head's key is its own first dk - R columns, then the shared R: the same
    values as kv holding a copy of k_pe in each head's key."""
    h, nope, rope, dv, size = 8, 64, 32, 64, 16
    gen = torch.Generator().manual_seed(2)
    lens, starts, rows = _batch(SEQS)
    own = torch.randn(40, size, h, nope + dv, generator=gen).to(dtype)
    k_pe = torch.randn(40, size, rope, generator=gen).to(dtype)
    copied = torch.cat((own[..., :nope], k_pe[:, :, None].expand(40, size, h, rope), own[..., nope:]), dim=-1)
    tables = _scattered_tables(gen, lens.tolist(), size, 40)
    q = torch.randn(rows, h, nope + rope, generator=gen).to(dtype)
    for name in kernel_isas:
        kernels.select_isa(name)
        got = kernels.mla_prefill(q, own, tables, lens, starts, dv, 0.1, k_pe=k_pe)
        assert got.shape == (rows, h, dv) and got.dtype == dtype
        assert torch.equal(got, kernels.mla_prefill(q, copied, tables, lens, starts, dv, 0.1)), name
    with pytest.raises(RuntimeError, match=r"k_pe must be empty or \[N, S, R\]"):
        kernels.mla_prefill(q, own, tables, lens, starts, dv, 0.1, k_pe=k_pe[:20])
    with pytest.raises(RuntimeError, match="does not hold 8 heads of 64 \\+ 64 columns"):
        kernels.mla_prefill(q, copied, tables, lens, starts, dv, 0.1, k_pe=k_pe)
    kernels.select_isa("auto")


@pytest.mark.parametrize(("lens", "starts", "table", "message"), [
    ([3], [0, 4], [[0]], "has 4 new rows and context length 3"),
    ([4], [0, 2, 4], [[0]], "one block table, context length and query start per sequence"),
    ([4], [1, 4], [[0]], "query_starts must run from 0 to the 4 rows"),
    ([9], [0, 4], [[0, 1, 2]], "block id 2 outside the pool of 2"),
    ([9], [0, 4], [[0, 1]], r"context length 9 \(need 1 <= rows <= context length <= 8\)"),
])
def test_prefill_rejects_rows_lengths_and_blocks_that_do_not_fit(kernel_isas: list[str], lens: list[int],
                                                                  starts: list[int], table: list[list[int]],
                                                                  message: str) -> None:
    pool, q = torch.zeros(2, 2, 4, 1, 8), torch.zeros(4, 2, 8)
    with pytest.raises(RuntimeError, match=message):
        kernels.gqa_prefill(q, pool, torch.tensor(table), torch.tensor(lens), torch.tensor(starts), 1.0)


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_layer_serves_a_mixed_step_the_same_with_the_prefill_kernel(
        kernel_isas: list[str], hf_checkpoints: dict[str, Path], family: str, dtype: torch.dtype) -> None:
    model = _model(hf_checkpoints[family], dtype)
    attn, cfg = model.model.layers[0].self_attn, model.config
    # decode, a whole prompt, decode, a chunk after 5 cached tokens (block size 4)
    meta = AttentionMetadata.build([1, 6, 1, 3], [5, 6, 2, 8], [[1, 2], [3, 4], [5], [6, 7]], 4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, cfg.hidden_size, generator=gen).to(dtype)
    width = getattr(attn, "rope", None) or attn.head_dim
    pos = torch.tensor([4, 0, 1, 2, 3, 4, 5, 1, 5, 6, 7], dtype=torch.float32)[:, None]
    freqs = pos * torch.rand(1, width // 2, generator=gen)
    outs = []
    for on in (True, False):
        cache = PagedKVCache(cfg, 8, 4, dtype)
        prefix = torch.randn(cache.layer(0).pool.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        cache.layer(0).pool.copy_(prefix)  # the cached tokens the steps' rows attend to
        attn.use_prefill_kernel = on
        with torch.no_grad():
            outs.append(attn(x, freqs.cos(), freqs.sin(), meta, cache.layer(0)).float())
    got, want = outs
    assert got.shape == (11, cfg.hidden_size)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe", "mixtral_top1_tied_mqa"])
def test_model_generates_the_same_with_the_prefill_kernel(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                                          family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(hf_checkpoints[family])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14]]
    op = "mla_prefill" if family.startswith("deepseek") else "gqa_prefill"
    calls = []
    prefill = getattr(kernels, op)
    monkeypatch.setattr(kernels, op, lambda q, *a, **k: calls.append(q.shape[0]) or prefill(q, *a, **k))
    # chunk=3: prompts arrive in chunks after cached ones, beside other sequences' decode rows
    tokens_kernel, logits_kernel = greedy_generate(model, prompts, 6, chunk=3)
    assert calls and max(calls) > 1
    for layer in model.model.layers:
        layer.self_attn.use_prefill_kernel = False
    assert_same_generation((tokens_kernel, logits_kernel), greedy_generate(model, prompts, 6, chunk=3))


@pytest.mark.parametrize(("window", "hd"), [(None, 64), (40, 64), (None, 24), (40, 40)])
def test_a_rows_values_do_not_depend_on_the_chunk_or_batch_it_comes_in(kernel_isas: list[str],
                                                                       window: int | None, hd: int) -> None:
    """A prompt's rows prefilled whole, as a later chunk after cached rows, or beside another
    sequence: the same bits (a row's sums do not depend on the query tile it lands in). Head
    sizes 24 and 40 end in a partial 16-lane vector, whose columns sum one by one."""
    size, hkv, h, length = 16, 2, 4, 150
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        pool = torch.randn(20, 2, size, hkv, hd, generator=gen).to(dtype)
        table = torch.randperm(20, generator=gen)[:10][None]
        q = torch.randn(length, h, hd, generator=gen).to(dtype)

        def prefill(rows: torch.Tensor, tables: torch.Tensor, lens: list[int], starts: list[int],
                    pool: torch.Tensor = pool) -> torch.Tensor:
            return kernels.gqa_prefill(rows, pool, tables, torch.tensor(lens), torch.tensor(starts), 0.125, window)

        for name in kernel_isas:
            kernels.select_isa(name)
            whole = prefill(q, table, [length], [0, length])
            for split in (1, 17, 37, 100, 149):
                chunk = prefill(q[split:], table, [length], [0, length - split])
                assert torch.equal(chunk, whole[split:]), (name, dtype, split)
            two = prefill(torch.cat([q[:30], q[37:]]), torch.cat([table, table]), [30, length],
                          [0, 30, 30 + length - 37])
            assert torch.equal(two[30:], whole[37:]), (name, dtype)
            assert torch.equal(two[:30], prefill(q[:30], table, [30], [0, 30])), (name, dtype)
    kernels.select_isa("auto")


@pytest.mark.parametrize("case", GQA_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_prefill_on_an_fp8_cache_gives_the_bits_of_its_dequantized_cache(kernel_isas: list[str], case: tuple,
                                                                             dtype: torch.dtype) -> None:
    h, hkv, hd, size, window = case
    gen = torch.Generator().manual_seed(hd + 1)
    lens, starts, rows = _batch(SEQS)
    fp8 = (torch.randn(64, 2, size, hkv, hd, generator=gen) * 3).to(torch.float8_e4m3fn)
    dequantized = (fp8.float() * torch.tensor(0.37)).to(dtype)  # as KVLayerView.gather
    tables = _scattered_tables(gen, lens.tolist(), size, 64)
    q = torch.randn(rows, h, hd, generator=gen).to(dtype)
    for name in kernel_isas:
        kernels.select_isa(name)
        got = kernels.gqa_prefill(q, fp8, tables, lens, starts, 0.2, window, kv_scale=0.37)
        assert got.shape == (rows, h, hd) and got.dtype == dtype
        assert torch.equal(got, kernels.gqa_prefill(q, dequantized, tables, lens, starts, 0.2, window)), name
    kernels.select_isa("auto")
