"""Decode attention read straight from the paged cache (moe.kernels.mla_decode for MLA's latent,
gqa_decode for grouped-query k/v) against the gather + sdpa path, alone and inside the model."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from moe import kernels
from moe.config import ModelConfig
from moe.experts import Experts
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.layers.gqa import GQAAttention
from moe.layers.mla import MLAAttention
from moe.layers.norm import RMSNorm
from moe.layers.paged import sdpa
from moe.layers.rope import RotaryEmbedding
from moe.loader import load_weights
from moe.model import MoEModel
from moe.router import Router
from tests.unit.test_model_vs_hf import greedy_generate


def _reference(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, value_dim: int,
               scale: float) -> torch.Tensor:
    """Gather each sequence's blocks, mask past its length, run sdpa with the latent as key and value."""
    b, _, width = q.shape
    size = pool.shape[1]
    nb = -(-int(lens.max()) // size)
    cache = pool.index_select(0, tables[:, :nb].reshape(-1)).view(b, nb * size, width)[:, None]
    mask = torch.arange(nb * size)[None] < lens[:, None]  # [B, L]
    return sdpa(q[:, :, None], cache, cache, mask[:, None, None], scale)[:, :, 0, :value_dim]


def _random_batch(seed: int, b: int, h: int, q_width: int, pool_shape: tuple[int, ...], dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random pool (MLA [N, S, W]; GQA [N, 2, S, Hkv, hd]), block tables [B, 6] of scattered blocks,
    context lengths [B] (the first sequence fills its last block) and queries [B, H, q_width]."""
    gen = torch.Generator().manual_seed(seed)
    n, size, nb = pool_shape[0], pool_shape[2 if len(pool_shape) == 5 else 1], 6
    pool = torch.randn(*pool_shape, generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(n, generator=gen)[:nb] for _ in range(b)])
    lens = torch.randint(1, nb * size + 1, (b,), generator=gen)
    lens[0] = nb * size
    return pool, tables, lens, torch.randn(b, h, q_width, generator=gen).to(dtype)


# (sequences, heads, value width C, rope width R, block size, pool blocks): DeepSeek-like widths, then
# widths that are no multiple of any vector length, more heads than one vector's 16 lanes with an odd
# key width (C + R = 25), items of three lane chunks (16 + 16 + 8 heads at one or two threads), then
# a single head, column and block; then widths the AMX tiles take (key 96, values 64) with 40 heads
# (three query blocks, the last part full) over blocks of 5 tokens (value pairs across two blocks);
# DeepSeek-V3's widths; last, sequences of up to 384 tokens in blocks of 64 (past the 128 tokens a
# bf16 value pass on the lanes takes at a time, and past the fp32 rows kept for both passes)
CASES = [(3, 16, 256, 32, 16, 40), (5, 7, 20, 6, 4, 30), (2, 20, 21, 4, 4, 30), (4, 40, 20, 6, 4, 30),
         (1, 1, 3, 1, 2, 9), (3, 40, 64, 32, 5, 30), (2, 16, 512, 64, 32, 14), (2, 16, 256, 32, 64, 14)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_equals_gather_and_sdpa(kernel_isas: list[str], case: tuple[int, ...], dtype: torch.dtype) -> None:
    b, h, c, r, size, n = case
    pool, tables, lens, q = _random_batch(sum(case), b, h, c + r, (n, size, c + r), dtype)  # pool [N, S, C + R]
    want = _reference(q, pool, tables, lens, c, 0.3)
    for name in kernel_isas:
        kernels.select_isa(name)
        got = kernels.mla_decode(q, pool, tables, lens, c, 0.3)
        assert got.shape == (b, h, c) and got.dtype == dtype
        # fp32: summation order only; bf16: a score or probability may round to the other
        # neighbour, one bf16 ulp (2^-8 relative) of one term
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item(), name
    kernels.select_isa("auto")


@pytest.mark.parametrize("width", [288, 576])  # DeepSeek's latent + rope widths, small and V3
def test_mla_decode_strided_tiles_give_the_bits_of_row_pointers(kernel_isas: list[str], width: int) -> None:
    """The dot path's score tiles read a block's rows at a fixed stride where the block holds 16k tokens
    (StridedRows), else one row pointer each (tiles of 12): the same tokens in blocks of 16 and of 8
    give the same bits where every tile has 8 rows or more either way (one partial sum per token)."""
    if "avx512bf16" not in kernel_isas:
        pytest.skip("no AVX512-BF16 dot path on this CPU")
    gen = torch.Generator().manual_seed(width)
    lens = torch.tensor([48, 140, 200, 1000])
    b, heads = len(lens), 16
    keys = [(torch.randn(int(n), width, generator=gen) / 4).to(torch.bfloat16) for n in lens]
    q = (torch.randn(b, heads, width, generator=gen) / 4).to(torch.bfloat16)

    def paged(size: int) -> tuple[torch.Tensor, torch.Tensor]:  # the rows in shuffled blocks of `size`
        nb = -(-int(lens.max()) // size)
        order = torch.randperm(b * nb, generator=gen)
        pool = torch.zeros(b * nb, size, width, dtype=torch.bfloat16)
        for s, rows in enumerate(keys):
            padded = torch.cat([rows, rows.new_zeros(nb * size - len(rows), width)])
            pool[order[s * nb:(s + 1) * nb]] = padded.view(nb, size, width)
        return pool, order.view(b, nb)

    kernels.select_isa("avx512bf16")
    try:
        got = {size: kernels.mla_decode(q, *paged(size), lens, width * 8 // 9, 0.1) for size in (16, 64, 8)}
    finally:
        kernels.select_isa("auto")
    assert got[16].shape == (b, heads, width * 8 // 9)
    assert torch.equal(got[16], got[8]) and torch.equal(got[64], got[8])


def test_mla_decode_long_and_short_contexts_in_one_batch(kernel_isas: list[str]) -> None:
    # bf16 sequences whose fp32 rows fit 256 KiB are converted once for both passes, longer ones
    # block by block: a batch holding both (300 and 50 tokens of width 288) takes both routes
    gen = torch.Generator().manual_seed(5)
    pool = torch.randn(48, 16, 288, generator=gen).to(torch.bfloat16)
    tables = torch.stack([torch.randperm(48, generator=gen)[:20] for _ in range(2)])
    lens = torch.tensor([300, 50])
    q = torch.randn(2, 16, 288, generator=gen).to(torch.bfloat16)
    want = _reference(q, pool, tables, lens, 256, 0.1)
    for name in kernel_isas:
        kernels.select_isa(name)
        got = kernels.mla_decode(q, pool, tables, lens, 256, 0.1)
        assert got.shape == (2, 16, 256)
        assert (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item(), name
    kernels.select_isa("auto")


def test_decode_attention_asks_are_probed_kept_and_give_the_same_bits(kernel_isas: list[str],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture,
                                                                      tmp_path: Path) -> None:
    """How the dot path's decode attention asks for its key rows (into L1 two tiles ahead, or into L2
    eight) is the CPU's, measured on rows in DRAM: the probe's faster mode where it beats the default
    by TILE_MIN_GAIN, kept beside the build, ``$MOE_ATTENTION_ASKS`` over it; MLA and GQA decode give
    the same bits in both."""
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.delenv(kernels.ATTENTION_ASKS_ENV, raising=False)
    saved = tmp_path / kernels.PROBES_FILE
    before = int(torch.ops.moe_kernels.attention_asks())
    dot = kernels.isa() == "avx512bf16"
    try:
        gain = kernels.agree_attention_asks()  # probed here: the cache folder is new
        mode = int(torch.ops.moe_kernels.attention_asks())
        if dot:
            seconds = json.loads(saved.read_text())["attention_asks_seconds"]
            assert len(seconds) == 2 and all(0 < t < 1 for t in seconds)
            assert gain == seconds[0] / seconds[mode] and (mode == 0 or gain >= kernels.TILE_MIN_GAIN)
            assert kernels.attention_asks_text() == kernels.ATTENTION_ASKS[mode]
        else:  # another path runs decode attention: nothing probed, nothing kept
            assert not saved.exists() and gain == 1.0 and mode == 0 and kernels.attention_asks_text() is None

        def probed(times: list[float]) -> int:
            saved.write_text(json.dumps({"cpu": kernels.cpu_signature(), "attention_asks_seconds": times}))
            kernels.agree_attention_asks()  # the saved probe, not a new one
            return int(torch.ops.moe_kernels.attention_asks())

        assert probed([1.0, 0.5]) == 1
        assert probed([1.0, 0.97]) == 0  # within 5 %: the default stays
        assert probed([0.5, 1.0]) == 0
        probed([1.0, 0.0])  # not a probe: probed again where the dot path runs
        assert json.loads(saved.read_text())["attention_asks_seconds"] != [1.0, 0.0] or not dot
        monkeypatch.setenv(kernels.ATTENTION_ASKS_ENV, "1")
        assert probed([0.5, 1.0]) == 1
        monkeypatch.setenv(kernels.ATTENTION_ASKS_ENV, "sometimes")
        with caplog.at_level(logging.WARNING, logger="moe.kernels"):
            assert probed([1.0, 0.5]) == 1
        assert "MOE_ATTENTION_ASKS='sometimes' not used (expected 0, 1 or auto)" in caplog.text
        monkeypatch.setenv(kernels.ATTENTION_ASKS_ENV, " 1 ")
        assert probed([0.5, 1.0]) == 1
        caplog.clear()
        for value in ("", "Auto"):  # empty: as unset
            monkeypatch.setenv(kernels.ATTENTION_ASKS_ENV, value)
            with caplog.at_level(logging.WARNING, logger="moe.kernels"):
                assert probed([1.0, 0.5]) == 1 and probed([0.5, 1.0]) == 0
        assert "not used" not in caplog.text
        with pytest.raises(RuntimeError, match="attention ask mode 2 is not 0 .into L1. or 1 .into L2."):
            torch.ops.moe_kernels.set_attention_asks(2)

        gen = torch.Generator().manual_seed(7)
        pool = torch.randn(48, 16, 288, generator=gen).to(torch.bfloat16)
        tables = torch.stack([torch.randperm(48, generator=gen)[:20] for _ in range(3)])
        lens = torch.tensor([300, 50, 17])
        q = torch.randn(3, 16, 288, generator=gen).to(torch.bfloat16)
        kv = torch.randn(48, 2, 16, 2, 64, generator=gen).to(torch.bfloat16)  # GQA: 2 kv heads of 64
        gq = torch.randn(3, 8, 64, generator=gen).to(torch.bfloat16)
        for name in kernel_isas:
            kernels.select_isa(name)
            outs = []
            for asks in kernels.ATTENTION_ASKS:
                torch.ops.moe_kernels.set_attention_asks(asks)
                outs.append((kernels.mla_decode(q, pool, tables, lens, 256, 0.1),
                             kernels.gqa_decode(gq, kv, tables, lens, 0.125)))
            assert outs[0][0].shape == (3, 16, 256) and outs[0][1].shape == (3, 8, 64)
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), name
    finally:
        torch.ops.moe_kernels.set_attention_asks(before)
        kernels.select_isa("auto")


def test_mla_decode_spreads_heads_over_threads_at_batch_one(kernel_isas: list[str]) -> None:
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(8, 4, 40, generator=gen)
    tables, lens = torch.tensor([[3, 1, 6]]), torch.tensor([11])
    q = torch.randn(1, 10, 40, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 3):  # 3 threads: items of 4, 4 and 2 of the 10 heads (the lanes: one item a thread)
            torch.set_num_threads(n)
            results.append(kernels.mla_decode(q, pool, tables, lens, 32, 0.2))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    assert (results[0] - _reference(q, pool, tables, lens, 32, 0.2)).abs().max().item() < 1e-5


@pytest.mark.parametrize("width", [80, 96])  # 96 = 64 + 32: the sizes the AMX tiles take (dk % 32 == 0)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_at_batch_one_is_the_same_for_any_thread_count(kernel_isas: list[str], dtype: torch.dtype,
                                                                  width: int) -> None:
    """One thread keeps 16 query heads in one item on the lanes (the dot path's and the FMA path's:
    one score pass) where more threads split them (2 threads: two items of 8, 3: items of 6, 6 and
    4): the same bits either way, on every ISA and dtype."""
    gen = torch.Generator().manual_seed(2)
    pool = (torch.randn(12, 16, width, generator=gen) * 0.3).to(dtype)
    tables, lens = torch.tensor([[3, 1, 6, 9, 0, 11, 2, 5, 4]]), torch.tensor([134])
    q = (torch.randn(1, 16, width, generator=gen) * 0.3).to(dtype)
    threads = torch.get_num_threads()
    try:
        for name in kernel_isas:
            kernels.select_isa(name)
            results = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                results.append(kernels.mla_decode(q, pool, tables, lens, 64, 0.1))
            assert results[0].shape == (1, 16, 64) and results[0].dtype == dtype
            assert all(torch.equal(results[0], r) for r in results[1:]), name
    finally:
        torch.set_num_threads(threads)
        kernels.select_isa("auto")


@pytest.mark.parametrize(("lens", "table", "message"), [
    ([0], [[0, 1]], "context length 0"),
    ([9], [[0, 1]], "context length 9"),
    ([5], [[0, 7]], "block id 7"),
])
def test_mla_decode_rejects_lengths_and_blocks_outside_the_cache(kernel_isas: list[str], lens: list[int],
                                                                 table: list[list[int]], message: str) -> None:
    pool, q = torch.zeros(4, 4, 8), torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match=message):
        kernels.mla_decode(q, pool, torch.tensor(table), torch.tensor(lens), 6, 1.0)


def assert_same_generation(got: tuple[list, list], want: tuple[list, list], tolerance: float = 1e-4) -> None:
    """Two ``greedy_generate`` results (tokens, per-step logits): the same tokens, logits within tolerance."""
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert (torch.stack(a) - torch.stack(b)).abs().max().item() < tolerance


def _model(path: Path, dtype: torch.dtype = torch.float32) -> MoEModel:
    model = MoEModel(ModelConfig.from_hf(path), dtype=dtype)
    load_weights(model, path, dtype=dtype)
    return model


@pytest.mark.parametrize(("family", "op"), [("deepseek_v2", "mla_decode"), ("deepseek_v3", "mla_decode"),
                                          ("mixtral", "gqa_decode"), ("qwen3_moe", "gqa_decode"),
                                          ("mixtral_top1_tied_mqa", "gqa_decode")])
def test_model_decodes_the_same_with_the_paged_kernel(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                                      family: str, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(hf_checkpoints[family])
    for layer in model.model.layers:  # op by op (the whole-attention ops call the decode kernels in C++)
        layer.self_attn.use_fused_decode = False
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14]]
    calls = []
    decode = getattr(kernels, op)
    monkeypatch.setattr(kernels, op, lambda q, *a: calls.append(q.shape[0]) or decode(q, *a))
    # chunk=3: steps mix prefill chunks (gather path) with decode rows (paged kernel)
    tokens_kernel, logits_kernel = greedy_generate(model, prompts, 6, chunk=3)
    full = [layer for layer in model.model.layers if getattr(layer.self_attn, "sliding_window", None) is None]
    # the kernel served every decode row of the full-attention layers, mixed steps too; windowed ones gather
    assert bool(calls) == bool(full) and (not calls or max(calls) == len(prompts))
    for layer in model.model.layers:
        layer.self_attn.use_paged_kernel = False
    assert_same_generation((tokens_kernel, logits_kernel), greedy_generate(model, prompts, 6, chunk=3))


def test_paged_kernel_serves_only_caches_it_can_read(kernel_isas: list[str], hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"])
    attn = model.model.layers[0].self_attn
    cfg = model.config
    q = torch.zeros(2, attn.num_heads, attn.nope + attn.rope)
    assert attn._paged_decode_applies(q, PagedKVCache(cfg, 4, 4, torch.float32).layer(0))
    assert attn._paged_decode_applies(q, PagedKVCache(cfg, 4, 4, torch.float32, "fp8").layer(0))  # converted
    assert not attn._paged_decode_applies(q, PagedKVCache(cfg, 4, 4, torch.bfloat16).layer(0))
    attn.absorb_decode = False
    assert not attn._paged_decode_applies(q, PagedKVCache(cfg, 4, 4, torch.float32).layer(0))


def test_paged_kernel_output_shape_in_a_mixed_step(kernel_isas: list[str], hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    attn, cfg = model.model.layers[0].self_attn, model.config
    cache = PagedKVCache(cfg, 8, 4, torch.bfloat16)
    meta = AttentionMetadata.build([1, 3, 1], [5, 3, 2], [[1, 2], [3], [4]], 4)  # decode, prefill, decode
    x = torch.randn(5, cfg.hidden_size).to(torch.bfloat16)
    cos, sin = torch.ones(5, attn.rope // 2), torch.zeros(5, attn.rope // 2)
    with torch.no_grad():
        got = attn(x, cos, sin, meta, cache.layer(0))
        attn.use_paged_kernel = False
        want = attn(x, cos, sin, meta, cache.layer(0))
    assert got.shape == (5, cfg.hidden_size) and got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_norm_and_cache_write_in_one_op_equal_the_pytorch_ops(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                                                   dtype: torch.dtype, interleave: bool) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], dtype)
    attn, cfg = model.model.layers[0].self_attn, model.config
    attn.interleave = interleave
    meta = AttentionMetadata.build([1, 3, 1], [5, 3, 2], [[1, 2], [3], [4]], 4)  # decode, prefill, decode
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    cos, sin = model.model.rotary(torch.tensor([4, 0, 1, 2, 1]))
    caches, outputs = [], []
    for fused in (True, False):
        attn.use_fused_rope_cache = fused
        cache = PagedKVCache(cfg, 8, 4, dtype)
        assert attn._fused_rope_cache_applies(torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=dtype),
                                              cache.layer(0)) == fused
        with torch.no_grad():
            outputs.append(attn(x, cos, sin, meta, cache.layer(0)))
        caches.append(cache.pools[0])
    assert outputs[0].shape == (5, cfg.hidden_size) and caches[0].shape == (8, 4, attn.kv_lora_rank + attn.rope)
    # the same entries in the same slots (fp32: up to the norm's summation order)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert (caches[0].float() - caches[1].float()).abs().max().item() <= tol * caches[1].float().abs().max().item()
    assert caches[0][0].abs().sum() == 0 and caches[0][1, :3].abs().sum() == 0  # untouched slots stay zero
    assert (outputs[0].float() - outputs[1].float()).abs().max().item() <= 4 * tol * outputs[1].float().abs().max()


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])  # q_proj; q_a_proj + norm + q_b_proj
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_whole_decode_attention_op_is_bit_equal_to_the_op_by_op_path(
        kernel_isas: list[str], hf_checkpoints: dict[str, Path], family: str, dtype: torch.dtype, bias: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.from_hf(hf_checkpoints[family])
    torch.manual_seed(3)
    attn = MLAAttention(dataclasses.replace(cfg, attention_bias=bias), dtype)  # random weights, biases
    for p in attn.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32).to(dtype) * 0.1)
    assert (attn.o_proj.bias is not None) == bias and (attn.q_lora_rank is None) == (family == "deepseek_v2")
    steps = [([1, 1, 1], [5, 3, 2]), ([1, 3, 1], [6, 3, 3])]  # decode rows only; then a mixed step
    start_shape = (8, 4, attn.kv_lora_rank + attn.rope)
    calls, results = _fused_and_op_by_op(attn, cfg, dtype, steps, start_shape, cfg.rope_interleave,
                                         "mla_decode_attention_op", kernel_isas, monkeypatch)
    # the fused op served the all-decode step only (once per ISA), never the mixed one
    assert calls == [torch.Size([3, cfg.hidden_size])] * len(kernel_isas)
    for isa in kernel_isas:
        (outs_on, pool_on), (outs_off, pool_off) = results[isa, True], results[isa, False]
        assert outs_on[0].shape == (3, cfg.hidden_size) and outs_on[0].dtype == dtype
        assert all(torch.equal(a, b) for a, b in zip(outs_on, outs_off)), isa
        assert torch.equal(pool_on, pool_off), isa


def _fused_and_op_by_op(attn: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype,
                        steps: list[tuple[list[int], list[int]]], start_shape: tuple[int, ...], interleave: bool,
                        op_name: str, kernel_isas: list[str], monkeypatch: pytest.MonkeyPatch,
                        kv_cache_dtype: str = "auto", kv_scale: float = 1.0
                        ) -> tuple[list[torch.Size], dict[tuple[str, bool], tuple[list[torch.Tensor], torch.Tensor]]]:
    """Runs ``steps`` ((query_lens, context_lens) over three sequences) through ``attn`` with its
    whole-attention op on and off, on every ISA, from one random cache of ``start_shape`` (an fp8
    cache: those entries quantized, at scale ``kv_scale``). Returns (the row shapes of every call of
    the bound ``kernels.<op_name>``, {(isa, fused): (each step's output, the final pool)})."""
    calls: list[torch.Size] = []
    bind = getattr(kernels, op_name)

    def spy(*bound):  # records the rows of every call of the bound op
        run = bind(*bound)
        return lambda x, *a: calls.append(x.shape) or run(x, *a)

    monkeypatch.setattr(kernels, op_name, spy)
    rotary = RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, interleave)
    gen = torch.Generator().manual_seed(4)
    start = torch.randn(*start_shape, generator=gen).to(dtype)  # earlier tokens' entries
    xs = [torch.randn(sum(q), cfg.hidden_size, generator=gen).to(dtype) for q, _ in steps]
    results = {}
    for isa in kernel_isas:
        kernels.select_isa(isa)
        for fused in (True, False):
            attn.use_fused_decode = fused
            cache = PagedKVCache(cfg, 8, 4, dtype, kv_cache_dtype)
            cache.pools[0].copy_(start)
            cache.layer(0).set_scale(kv_scale)
            outs = []
            for (query_lens, context_lens), x in zip(steps, xs):
                meta = AttentionMetadata.build(query_lens, context_lens, [[1, 2], [3], [4, 5]], 4)
                positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
                cos, sin = rotary(positions)
                with torch.no_grad():
                    outs.append(attn(x, cos, sin, meta, cache.layer(0)))
            results[isa, fused] = (outs, cache.pools[0].clone())
    kernels.select_isa("auto")
    assert not torch.equal(results[kernel_isas[0], True][1], start.to(cache.pools[0].dtype))  # entries written
    return calls, results


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "mixtral_top1_tied_mqa"])  # GQA, q/k norms + bias, MQA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [False, True])
def test_whole_gqa_decode_attention_op_is_bit_equal_to_the_op_by_op_path(
        kernel_isas: list[str], hf_checkpoints: dict[str, Path], family: str, dtype: torch.dtype, interleave: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.from_hf(hf_checkpoints[family])
    torch.manual_seed(5)
    attn = GQAAttention(cfg, dtype)
    for p in attn.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32).to(dtype) * 0.1 + (1.0 if p.dim() == 1 and
                     p.shape[0] == attn.head_dim else 0.0))
    attn.interleave = interleave
    assert (attn.q_norm is not None) == (family == "qwen3_moe") and (attn.o_proj.bias is not None) == cfg.attention_bias
    steps = [([1, 1, 1], [5, 3, 2]), ([1, 3, 1], [6, 3, 3]), ([1, 1, 1], [7, 4, 4])]  # decode; mixed; decode
    start_shape = (8, 2, 4, attn.num_kv_heads, attn.head_dim)  # [N, 2, S, Hkv, hd]
    calls, results = _fused_and_op_by_op(attn, cfg, dtype, steps, start_shape, interleave,
                                         "gqa_decode_attention_op", kernel_isas, monkeypatch)
    # the fused op served the all-decode steps only (twice per ISA), never the mixed one
    assert calls == [torch.Size([3, cfg.hidden_size])] * 2 * len(kernel_isas)
    for isa in kernel_isas:
        (outs_on, pool_on), (outs_off, pool_off) = results[isa, True], results[isa, False]
        assert [o.shape for o in outs_on] == [(3, cfg.hidden_size), (5, cfg.hidden_size), (3, cfg.hidden_size)]
        assert outs_on[0].dtype == dtype
        assert all(torch.equal(a, b) for a, b in zip(outs_on, outs_off)), isa
        assert torch.equal(pool_on, pool_off), isa


@pytest.mark.parametrize(("family", "projection", "norm"), [("deepseek_v3", "o_proj", "q_a_layernorm"),
                                                            ("qwen3_moe", "v_proj", "k_norm")])
def test_whole_decode_attention_op_steps_aside_when_an_op_would_not_run_its_kernel(
        kernel_isas: list[str], hf_checkpoints: dict[str, Path], family: str, projection: str, norm: str) -> None:
    model = _model(hf_checkpoints[family], torch.bfloat16)
    attn, cfg = model.model.layers[0].self_attn, model.config
    x = torch.zeros(2, cfg.hidden_size, dtype=torch.bfloat16)
    view = PagedKVCache(cfg, 4, 4, torch.bfloat16).layer(0)
    assert attn.fused_decode_op(x, view) is not None
    assert attn.fused_decode_op(x, PagedKVCache(cfg, 4, 4, torch.bfloat16, "fp8").layer(0)) is not None
    # an fp8 cache whose scale its first write still has to calibrate: the op-by-op path writes it
    calibrating = PagedKVCache(cfg, 4, 4, torch.bfloat16, "fp8", calculate_kv_scales=True).layer(0)
    assert attn.fused_decode_op(x, calibrating) is None
    calibrating.write(torch.tensor([0]), torch.ones(1, *calibrating.cache.entry_shape))
    assert calibrating.scale_settled and attn.fused_decode_op(x, calibrating) is not None
    assert attn.fused_decode_op(x.float(), view) is None  # input in another dtype than the weights
    for module in (getattr(attn, projection), getattr(attn, norm)):  # pinned to PyTorch's op
        module.use_kernel = False
        assert attn.fused_decode_op(x, view) is None
        module.use_kernel = True
    if isinstance(attn, GQAAttention):  # a windowed layer has the op: it checks each step's contexts
        attn.sliding_window = 8  # against the window (tests/unit/test_sliding_window.py)
        assert attn.fused_decode_op(x, view) is not None
        attn.sliding_window = None
    attn.use_paged_kernel = False
    assert attn.fused_decode_op(x, view) is None


def test_gqa_decode_attention_op_refuses_a_cache_of_another_shape(kernel_isas: list[str]) -> None:
    x = torch.zeros(1, 8)
    w = kernels.pack_linear(torch.zeros(8, 8)).wp
    run = kernels.gqa_decode_attention_op((w, w, w, w), (None,) * 4, None, (0.0, 0.0), (2, 2, 4, 8), False, 1.0)
    cos, sin, lens, tables = torch.ones(1, 2), torch.zeros(1, 2), torch.tensor([1]), torch.tensor([[0]])
    with pytest.raises(RuntimeError, match=r"contiguous \[N, 2, S, 2, 4\]"):
        run(x, cos, sin, torch.zeros(2, 2, 4, 1, 4), torch.tensor([0]), tables, lens)
    with pytest.raises(RuntimeError, match=r"contiguous \[N, 2, S, 2, 4\]"):  # the layout before keys and values split
        run(x, cos, sin, torch.zeros(2, 4, 2, 2, 4), torch.tensor([0]), tables, lens)
    with pytest.raises(RuntimeError, match="slot 8 outside the pool of 8"):
        run(x, cos, sin, torch.zeros(2, 2, 4, 2, 4), torch.tensor([8]), tables, lens)


def test_rope_cache_op_refuses_slots_outside_the_pool(kernel_isas: list[str]) -> None:
    q, latent, pool = torch.zeros(1, 2, 6), torch.zeros(1, 10), torch.zeros(2, 4, 10)
    cos, sin = torch.ones(1, 2), torch.zeros(1, 2)
    with pytest.raises(RuntimeError, match="slot 8 outside the pool of 8"):
        kernels.mla_rope_cache(q, latent, torch.ones(6), 1e-6, cos, sin, False, pool, torch.tensor([8]))


def test_set_fused_ops_switches_every_fused_op_and_keeps_the_tokens(kernel_isas: list[str],
                                                                    hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14]]
    tokens_on, logits_on = greedy_generate(model, prompts, 5, chunk=3)
    toggled = model.set_fused_ops(False)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    routers = [m for m in model.modules() if isinstance(m, Router)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    attns = [layer.self_attn for layer in model.model.layers]
    moe_layers = list(model.moe_layers())
    assert routers and experts and toggled == len(norms) + len(routers) + len(experts) + len(attns) + len(moe_layers)
    assert not any(m.use_fused_ffn for m in moe_layers)
    assert not any(m.use_kernel for m in norms + routers) and not any(e.fused_topk for e in experts)
    assert not any(a.use_paged_kernel or a.use_fused_rope_cache or a.use_fused_decode for a in attns)
    tokens_off, logits_off = greedy_generate(model, prompts, 5, chunk=3)
    assert tokens_on == tokens_off
    for a, b in zip(logits_on, logits_off):
        assert (torch.stack(a) - torch.stack(b)).abs().max().item() < 1e-4
    assert model.set_fused_ops(True) == toggled and all(a.use_paged_kernel for a in attns)


def _gqa_reference(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [B, H, hd] against each sequence's blocks of pool [N, 2, S, Hkv, hd] by gather and sdpa."""
    b, size = q.shape[0], pool.shape[2]
    nb = -(-int(lens.max()) // size)
    kv = pool.index_select(0, tables[:, :nb].reshape(-1)).view(b, nb, 2, size, *pool.shape[3:])
    mask = torch.arange(nb * size)[None] < lens[:, None]
    k, v = (kv[:, :, i].reshape(b, nb * size, *pool.shape[3:]).transpose(1, 2) for i in (0, 1))  # [B, Hkv, L, hd]
    return sdpa(q[:, :, None], k, v, mask[:, None, None], scale)[:, :, 0]


# (sequences, query heads, kv heads, head dim, block size, pool blocks): GQA, MHA with a head dim no
# multiple of a vector, groups of 17 query heads (over one vector's 16 lanes) with an odd head dim,
# MQA with a tiny one
GQA_CASES = [(3, 8, 2, 64, 16, 40), (2, 6, 6, 20, 4, 30), (2, 34, 2, 15, 4, 30), (4, 4, 1, 8, 2, 20),
             (3, 16, 2, 64, 16, 40), (2, 24, 1, 32, 5, 30),  # these two: 8 and 24 heads a kv head (AMX tiles)
             (2, 4, 4, 64, 16, 30), (2, 8, 4, 32, 8, 30),  # the dot path's groups of 1 and 2 lanes a head
             (3, 6, 3, 24, 5, 40),  # kv-head items over blocks of 5 tokens
             (2, 9, 3, 21, 4, 30)]  # the row path reading bf16 rows in place, past its last whole vector


@pytest.mark.parametrize("case", GQA_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_decode_equals_gather_and_sdpa(kernel_isas: list[str], case: tuple[int, ...], dtype: torch.dtype) -> None:
    b, h, hkv, hd, size, n = case
    pool, tables, lens, q = _random_batch(sum(case), b, h, hd, (n, 2, size, hkv, hd), dtype)
    want = _gqa_reference(q, pool, tables, lens, 0.2)
    for name in kernel_isas:
        kernels.select_isa(name)
        got = kernels.gqa_decode(q, pool, tables, lens, 0.2)
        assert got.shape == (b, h, hd) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item(), name
    kernels.select_isa("auto")


@pytest.mark.parametrize("op", ["mla", "gqa"])
def test_bf16_decode_on_amx_runs_the_tiles_where_they_apply(kernel_isas: list[str], op: str) -> None:
    """On AMX, bf16 decode of 8+ query heads a kv head with tile-sized widths runs on the tiles. Their
    sums differ from the FMA path's only in order (both close to sdpa: tested above), but tdpbf16ps reads
    denormal bf16 inputs as zero: a denormal query element (2^-130) against a huge key element (2^127)
    adds 1/8 to token 0's score on the FMA path and nothing on the tiles, which tells the paths apart.
    With 4 heads a kv head the FMA path runs: the avx512 instruction set's bits."""
    if "amx" not in kernel_isas:
        pytest.skip("no AMX here")

    def run(isa: str, heads: int) -> torch.Tensor:
        kernels.select_isa(isa)
        if op == "mla":  # one kv head; the huge element in the rope part (no value column)
            pool, tables, lens, q = _random_batch(1, 4, heads, 96, (30, 16, 96), torch.bfloat16)
            col = 64
        else:  # two kv heads
            pool, tables, lens, q = _random_batch(1, 4, heads, 64, (30, 2, 16, 2, 64), torch.bfloat16)
            col = 0
        q[:, :, col] = 2.0 ** -130
        token0 = (tables[:, 0], 0) if op == "mla" else (tables[:, 0], 0, 0)  # every sequence's token 0 (key)
        key = pool[token0]
        key[..., col] = 2.0 ** 127
        pool[token0] = key
        return kernels.mla_decode(q, pool, tables, lens, 64, 1.0) if op == "mla" else kernels.gqa_decode(
            q, pool, tables, lens, 1.0)

    try:
        tiles, fma = run("amx", 16), run("avx512", 16)
        assert torch.isfinite(tiles).all() and (tiles.float() - fma.float()).abs().max().item() > 1e-3
        assert torch.equal(run("amx", 4 if op == "mla" else 8), run("avx512", 4 if op == "mla" else 8))
    finally:
        kernels.select_isa("auto")


@pytest.mark.parametrize("case", [(16, 4, 64), (8, 8, 32), (32, 8, 128), (12, 4, 64), (6, 6, 20), (16, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_decode_gives_a_sequence_the_same_bits_however_its_kv_heads_are_split(
        kernel_isas: list[str], case: tuple[int, int, int], dtype: torch.dtype) -> None:
    """A sequence's output does not depend on the batch around it or on the threads: at batch 1 and
    two threads the dot path's small groups and the FMA path split a sequence's kv heads over two
    items, at batch 3 they stay in one. (query heads, kv heads, head dim): 4, 1, 4, 3, 1 and 8 query
    heads a kv head."""
    h, hkv, hd = case
    pool, tables, lens, q = _random_batch(h + hd, 3, h, hd, (40, 2, 16, hkv, hd), dtype)
    threads = torch.get_num_threads()
    try:
        for name in kernel_isas:
            kernels.select_isa(name)
            torch.set_num_threads(1)
            batch = kernels.gqa_decode(q, pool, tables, lens, 0.125)
            assert batch.shape == (3, h, hd)
            torch.set_num_threads(2)
            for b in range(3):
                alone = kernels.gqa_decode(q[b:b + 1], pool, tables[b:b + 1], lens[b:b + 1], 0.125)
                assert torch.equal(alone[0], batch[b]), (name, b)
    finally:
        torch.set_num_threads(threads)
        kernels.select_isa("auto")


@pytest.mark.parametrize("case", [(16, 4, 64), (32, 4, 32), (24, 3, 40), (6, 6, 20), (34, 2, 15)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_decode_fma_items_of_all_kv_heads_give_the_bits_of_one_kv_head_at_a_time(
        kernel_isas: list[str], case: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The FMA path takes all of a sequence's kv heads in one item (each block's rows read once for
    all of them); each kv head's query heads still run the one-kv-head item's tiles in its order. So
    the op over Hkv kv heads equals the op over each kv head's slice of the cache, bit for bit.
    (query heads, kv heads, head dim): 4 heads a kv head (the row path on AVX-512; on AVX2, two kv
    heads a vector's 8 lanes), 8 (two kv heads a vector's 16 lanes on AVX-512; 3 kv heads: one pair
    and one kv head alone), MHA, and 17 heads of an odd head dim (two lane chunks on AVX2). fp32 on
    every instruction set; bf16 where it runs the FMA path."""
    h, hkv, hd = case
    rep = h // hkv
    pool, tables, lens, q = _random_batch(h * hd, 3, h, hd, (40, 2, 16, hkv, hd), dtype)
    fma = ["avx512", "avx2", "generic"]
    try:
        for name in [n for n in kernel_isas if dtype == torch.float32 or n in fma]:
            kernels.select_isa(name)
            whole = kernels.gqa_decode(q, pool, tables, lens, 0.125)
            assert whole.shape == (3, h, hd)
            for g in range(hkv):
                heads = slice(g * rep, (g + 1) * rep)
                one = kernels.gqa_decode(q[:, heads].contiguous(), pool[:, :, :, g:g + 1].contiguous(), tables,
                                         lens, 0.125)
                assert torch.equal(one, whole[:, heads]), (name, g)
    finally:
        kernels.select_isa("auto")


def test_gqa_decode_rejects_heads_that_do_not_share_kv_heads(kernel_isas: list[str]) -> None:
    pool = torch.zeros(2, 2, 4, 3, 8)
    with pytest.raises(RuntimeError, match="4 query heads do not share 3 kv heads"):
        kernels.gqa_decode(torch.zeros(1, 4, 8), pool, torch.tensor([[0]]), torch.tensor([2]), 1.0)


@pytest.mark.parametrize("rope_dim", [6, 32, 34, 64, 66])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_in_vectors_are_bit_equal_to_apply_rotary(kernel_isas: list[str], rope_dim: int,
                                                           dtype: torch.dtype) -> None:
    """The rope op rotates 16 pairs at a time and the rest one by one: the same bits as
    apply_rotary for both layouts, every width (with and without a tail) and inf and signed zeros
    (NaN where it has NaN: the op writes NaN as 0x7fc0, whatever its sign)."""
    from moe.layers.rope import apply_rotary

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
        nan = want.isnan()
        return (torch.equal(got.isnan(), nan)
                and torch.equal(got[~nan].contiguous().view(bits), want[~nan].contiguous().view(bits)))

    gen = torch.Generator().manual_seed(rope_dim)
    T, H, nope, C = 3, 5, 4, 8
    q = torch.randn(T, H, nope + rope_dim, generator=gen) * 4
    latent = torch.randn(T, C + rope_dim, generator=gen) * 4
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38])
    q[1, 2, nope:nope + 6], latent[2, C:C + 6] = special, special
    q, latent = q.to(dtype), latent.to(dtype)
    cos, sin = torch.randn(T, rope_dim // 2, generator=gen), torch.randn(T, rope_dim // 2, generator=gen)
    for name in kernel_isas:
        kernels.select_isa(name)
        for interleave in (False, True):
            pool = torch.zeros(4, 4, C + rope_dim, dtype=dtype)
            out = kernels.mla_rope_cache(q, latent, torch.ones(C, dtype=dtype), 1e-6, cos, sin, interleave, pool,
                                         torch.tensor([3, 9, 14]))
            assert out.shape == q.shape and out.dtype == dtype
            want_q = apply_rotary(q[..., nope:], cos, sin, interleave)
            want_k = apply_rotary(latent[:, None, C:], cos, sin, interleave)[:, 0]
            assert same(out[..., nope:], want_q) and want_q.isnan().any(), name
            assert torch.equal(out[..., :nope], q[..., :nope])
            written = pool.view(-1, C + rope_dim)[torch.tensor([3, 9, 14]), C:]
            assert same(written, want_k), name
    kernels.select_isa("auto")


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "mixtral_top1_tied_mqa"])  # MLA; GQA with norms; MQA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_decode_attention_ops_on_an_fp8_cache_are_bit_equal_to_the_op_by_op_path(
        kernel_isas: list[str], hf_checkpoints: dict[str, Path], family: str, dtype: torch.dtype,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused ops quantize their entries into an fp8 cache as ``KVLayerView.write`` does (the final
    pools equal, byte for byte) and read it as the paged decode kernel does, at a scale that is no
    power of two."""
    cfg = ModelConfig.from_hf(hf_checkpoints[family])
    torch.manual_seed(6)
    mla = cfg.attention == "mla"
    attn = MLAAttention(cfg, dtype) if mla else GQAAttention(cfg, dtype)
    for p in attn.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32).to(dtype) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    steps = [([1, 1, 1], [5, 3, 2]), ([1, 3, 1], [6, 3, 3]), ([1, 1, 1], [7, 4, 4])]
    start_shape = (8, 4, attn.kv_lora_rank + attn.rope) if mla else (8, 2, 4, attn.num_kv_heads, attn.head_dim)
    op = "mla_decode_attention_op" if mla else "gqa_decode_attention_op"
    calls, results = _fused_and_op_by_op(attn, cfg, dtype, steps, start_shape, cfg.rope_interleave, op, kernel_isas,
                                         monkeypatch, kv_cache_dtype="fp8", kv_scale=0.37)
    assert calls == [torch.Size([3, cfg.hidden_size])] * 2 * len(kernel_isas)
    for isa in kernel_isas:
        (outs_on, pool_on), (outs_off, pool_off) = results[isa, True], results[isa, False]
        assert pool_on.dtype == torch.float8_e4m3fn and outs_on[0].shape == (3, cfg.hidden_size)
        assert all(torch.equal(a, b) for a, b in zip(outs_on, outs_off)), isa
        assert torch.equal(pool_on.view(torch.uint8), pool_off.view(torch.uint8)), isa


def _fp8_pool(pool: torch.Tensor, seed: int) -> torch.Tensor:
    """Random fp8 (e4m3) bytes in ``pool``'s shape: every finite code, subnormals and both zeros
    among them (the two NaN codes stepped down to the largest finite ones)."""
    codes = torch.randint(0, 256, pool.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


# one sequence: at two threads its kv heads split into two items (4 into 2 + 2, 3 into 2 + 1), each
# converting only its own kv heads' keys and values on the FMA path
GQA_ONE_SEQUENCE_CASES = [(1, 8, 4, 64, 16, 40), (1, 6, 3, 24, 5, 40)]
# head dims past the 256 columns the FMA path converts an fp8 row's pairs in (4 heads a kv head pair
# kv heads on AVX2, 8 on AVX-512): two chunks, the second partial
FP8_WIDE_HEAD_CASES = [(2, 8, 2, 300, 4, 12), (2, 16, 2, 300, 4, 12)]

# scales: 1 and a typical calibrated one; subnormal (fp32) and zero; products past fp32's range (inf);
# one whose 2^8 multiple overflows (the F16C conversion declines it for the tables); powers of two, whose
# bf16 products are exact (no rounding: 2^-117 to 2^119), and the two just outside that range
FP8_SCALES = [1.0, 0.37, 2.5e-3, 1e-40, 0.0, 1e36, 3e36, 0.25, 2.0**-117, 2.0**-118, 2.0**119, 2.0**120]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequantize_gives_torch_bits_for_every_code(kernel_isas: list[str], dtype: torch.dtype) -> None:
    """The kernels' fp8 conversion (what the decode ops read an fp8 cache through, and
    ``KVLayerView.gather``) gives the bits of ``(x.float() * scale).to(dtype)`` for all 256 codes
    (both zeros, subnormals; NaN for the NaNs) at every scale, on every ISA, at one and two threads: a
    length that is no multiple of 16 leaves a tail, and two threads' chunks split the rest."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(520)[:-29]  # 133,091 bytes: past a chunk of 2^16
    x = codes.view(torch.float8_e4m3fn).view(7, -1)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    nan = codes.view(7, -1) & 0x7F == 0x7F  # NaNs' bits aside (PyTorch's vector and scalar bf16 NaNs differ)
    threads = torch.get_num_threads()
    try:
        for scale in FP8_SCALES:
            want = (x.float() * torch.tensor(scale)).to(dtype)
            for name in kernel_isas:
                kernels.select_isa(name)
                for n_threads in (1, 2):
                    torch.set_num_threads(n_threads)
                    got = kernels.fp8_dequantize(x, scale, dtype)
                    assert got.shape == x.shape == (7, 19_013) and got.dtype == dtype
                    assert torch.equal(got.isnan(), nan) and torch.equal(got.view(bits)[~nan], want.view(bits)[~nan]), (
                        name, n_threads, scale)
            # a strided view converts as its contiguous copy
            strided = kernels.fp8_dequantize(x[:, ::3], scale, dtype)
            assert torch.equal(strided.view(bits)[~nan[:, ::3]], want[:, ::3].view(bits)[~nan[:, ::3]])
    finally:
        torch.set_num_threads(threads)
        kernels.select_isa("auto")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.fp8_dequantize(x, 1.0, torch.float16)


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_scale", [1.0, 0.37])
def test_decode_on_an_fp8_cache_gives_the_bits_of_its_dequantized_cache(
        kernel_isas: list[str], kind: str, dtype: torch.dtype, kv_scale: float) -> None:
    """Every decode path (MLA; GQA groups, kv-head items, MQA) over an fp8 pool gives exactly what it
    gives over the pool dequantized as ``KVLayerView.gather`` does (fp8 x scale in fp32, rounded to
    q's dtype), at one and two threads: sequences converted into the thread's scratch, or on the FMA
    path's GQA items each block's rows as the item reads them (two threads splitting one sequence's kv
    heads; heads wider than one conversion chunk)."""
    threads = torch.get_num_threads()
    cases = CASES if kind == "mla" else GQA_CASES + GQA_ONE_SEQUENCE_CASES + FP8_WIDE_HEAD_CASES
    try:
        for case in cases:
            if kind == "mla":
                b, h, c, r, size, n = case
                pool, tables, lens, q = _random_batch(sum(case), b, h, c + r, (n, size, c + r), dtype)
            else:
                b, h, hkv, hd, size, n = case
                pool, tables, lens, q = _random_batch(sum(case), b, h, hd, (n, 2, size, hkv, hd), dtype)
            fp8 = _fp8_pool(pool, sum(case))
            dequantized = (fp8.float() * torch.tensor(kv_scale)).to(dtype)
            for name in kernel_isas:
                kernels.select_isa(name)
                for n_threads in (1, 2):
                    torch.set_num_threads(n_threads)
                    if kind == "mla":
                        got = kernels.mla_decode(q, fp8, tables, lens, c, 0.3, kv_scale)
                        want = kernels.mla_decode(q, dequantized, tables, lens, c, 0.3)
                    else:
                        got = kernels.gqa_decode(q, fp8, tables, lens, 0.2, kv_scale)
                        want = kernels.gqa_decode(q, dequantized, tables, lens, 0.2)
                    assert got.shape == want.shape == (b, h, want.shape[2]) and got.dtype == dtype
                    assert torch.equal(got, want), (name, n_threads, case)
    finally:
        torch.set_num_threads(threads)
        kernels.select_isa("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_scale", [1.0, 0.37])
def test_decode_on_an_fp8_cache_with_nan_codes_gives_nan_where_its_dequantized_cache_does(
        kernel_isas: list[str], dtype: torch.dtype, kv_scale: float) -> None:
    """NaN codes (0x7F, 0xFF) in an fp8 pool make NaNs where the op over the dequantized pool makes
    them (a key's: its kv head's heads; a value's: their column) and nowhere else, the other values'
    bits unchanged."""
    b, h, hkv, hd, size, n = 3, 8, 2, 40, 4, 30
    pool, _, lens, q = _random_batch(7, b, h, hd, (n, 2, size, hkv, hd), dtype)
    tables = torch.randperm(n, generator=torch.Generator().manual_seed(7))[:b * 6].view(b, 6)  # no block shared
    codes = _fp8_pool(pool, 7).view(torch.uint8).clone()
    codes[tables[0, 0], 0, 1, 1, 5] = 0x7F  # sequence 0's token 1: kv head 1's key
    codes[tables[2, 0], 1, 0, 0, 39] = 0xFF  # sequence 2's token 0: kv head 0's value (a row's tail)
    fp8 = codes.view(torch.float8_e4m3fn)
    dequantized = (fp8.float() * torch.tensor(kv_scale)).to(dtype)
    threads = torch.get_num_threads()
    try:
        for name in kernel_isas:
            kernels.select_isa(name)
            want = kernels.gqa_decode(q, dequantized, tables, lens, 0.2)
            nan = want.isnan()
            assert nan[0, 4:].all() and nan[2, :4, 39].all() and not nan[1].any()  # a key: whole heads
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                got = kernels.gqa_decode(q, fp8, tables, lens, 0.2, kv_scale)
                assert got.shape == want.shape and torch.equal(got.isnan(), nan), (name, n_threads)
                assert torch.equal(got[~nan], want[~nan]), (name, n_threads)
    finally:
        torch.set_num_threads(threads)
        kernels.select_isa("auto")


# (query heads, kv heads, head dim, block size, context lengths): rows of 1 KB and 512 B in bf16, so
# that the rings hold 256, 512 and 480 tokens (256 KiB of rows; a multiple of the block size and 32):
# sequences longer than that go through one, the others whole (256 and 257: at the edge)
LONG_FP8_CASES = [(16, 4, 64, 16, (700, 37, 256, 257, 1003)), (8, 2, 64, 8, (1300, 2001)),
                  (8, 4, 32, 48, (1, 1450))]


@pytest.mark.parametrize("case", LONG_FP8_CASES)
def test_long_sequences_on_an_fp8_cache_go_through_a_ring_with_the_same_bits(
        kernel_isas: list[str], case: tuple) -> None:
    """GQA decode on bf16 queries over an fp8 pool whose sequences are longer than a ring: they are
    converted chunk by chunk into it (keys before the score pass reaches them, values before the
    value pass), and give the bits of the op over the dequantized pool, at one thread and at two
    (where one sequence's kv heads are split between the threads)."""
    h, hkv, hd, size, lens = case
    gen = torch.Generator().manual_seed(sum(lens))
    blocks = [(n + size - 1) // size for n in lens]
    n, nb = sum(blocks) + 3, max(blocks)
    perm = torch.randperm(n, generator=gen)
    tables = torch.zeros(len(lens), nb, dtype=torch.long)
    start = 0
    for i, k in enumerate(blocks):  # scattered blocks, no two sequences sharing one
        tables[i, :k] = perm[start:start + k]
        start += k
    fp8 = _fp8_pool(torch.empty(n, 2, size, hkv, hd), sum(lens))
    q = torch.randn(len(lens), h, hd, generator=gen).to(torch.bfloat16)
    context = torch.tensor(lens)
    threads = torch.get_num_threads()
    try:
        for kv_scale in (1.0, 0.37):
            dequantized = (fp8.float() * torch.tensor(kv_scale)).to(torch.bfloat16)
            for name in kernel_isas:
                kernels.select_isa(name)
                for n_threads in (1, 2):
                    torch.set_num_threads(n_threads)
                    got = kernels.gqa_decode(q, fp8, tables, context, 0.125, kv_scale)
                    want = kernels.gqa_decode(q, dequantized, tables, context, 0.125)
                    assert got.shape == want.shape == (len(lens), h, hd) and got.dtype == torch.bfloat16
                    assert torch.equal(got, want), (name, n_threads, kv_scale)
                    for i in range(len(lens)):  # each sequence alone: the ring is sized by the longest
                        alone = kernels.gqa_decode(q[i:i + 1], fp8, tables[i:i + 1], context[i:i + 1], 0.125,
                                                   kv_scale)
                        assert torch.equal(alone[0], want[i]), (name, n_threads, kv_scale, i)
    finally:
        torch.set_num_threads(threads)
        kernels.select_isa("auto")


@pytest.mark.parametrize(("family", "op"), [("deepseek_v3", "mla_decode"), ("qwen3_moe", "gqa_decode"),
                                          ("qwen3_moe", "gqa_prefill")])
def test_model_on_an_fp8_cache_decodes_the_same_with_the_kernels(hf_checkpoints: dict[str, Path], family: str,
                                                                  op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 KV cache goes through the CPU attention kernels (the op-by-op and the whole-attention
    paths) and decodes as the gather-and-sdpa path does over the same cache: the same tokens, and
    logits within what one fp8 code of a cache entry moves them. (The kernels' sums match sdpa's to
    ~1e-7, not to the bit, and a later layer's entry that close to an fp8 rounding boundary is
    written one code apart, 1/16 of its value: 0.022 on the AVX2 Zen 3, nothing on Zen 4. The ops
    themselves are bit-checked against the dequantized cache above.)"""
    if not kernels.is_available():
        pytest.skip("the CPU expert kernel could not be built here")
    model = _model(hf_checkpoints[family])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14]]
    pools = []
    call = getattr(kernels, op)
    monkeypatch.setattr(kernels, op, lambda q, pool, *a, **k: pools.append(pool.dtype) or call(q, pool, *a, **k))
    with_kernels = greedy_generate(model, prompts, 6, chunk=3, kv_cache_dtype="fp8")
    assert pools and set(pools) == {torch.float8_e4m3fn}
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.use_paged_kernel = attn.use_prefill_kernel = attn.use_fused_decode = False
    assert_same_generation(with_kernels, greedy_generate(model, prompts, 6, chunk=3, kv_cache_dtype="fp8"),
                           tolerance=0.05)
