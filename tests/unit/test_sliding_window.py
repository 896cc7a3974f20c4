"""Sliding-window attention (Mixtral ``sliding_window``, Qwen3-MoE ``use_sliding_window``)
against transformers 5.24 on tiny random save_pretrained checkpoints (fp32).

Prompts (20-30 tokens) are longer than the window (6) and 16 tokens are decoded, so every
step attends across the window edge: logits within 1e-4 of transformers' forward on the
prompt and every decode step (one-shot and 3-token chunked prefill over 4-token blocks), and
greedy tokens through ``launch.LLM`` (8-token step budget: chunked prefill through the paged
cache, prefix caching) identical to transformers' ``generate``. The Qwen3 cases also set
``max_window_layers`` / ``layer_types``, which transformers 5.24's Qwen3-MoE attention ignores
(every layer is windowed); matching its logits checks that we ignore them too.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.layers.paged import paged_attention, sdpa
from moe.loader import load_weights
from moe.model import MoEModel
from tests.conftest import HF_CASES, write_hf_checkpoint
from tests.oracles import hf_greedy
from tests.unit.test_model_vs_hf import greedy_generate

WINDOW = 6
NEW_TOKENS = 16
TOL = 1e-4
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", dict(sliding_window=WINDOW)),
    "qwen3_moe": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # transformers' cached generate breaks on this one (its cache keeps full layers the
    # all-sliding mask does not fit), so it is checked on logits only
    "qwen3_moe_layer_types": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                layer_types=["full_attention", "sliding_attention", "full_attention"])),
}
GENERATE_CASES = ["mixtral", "qwen3_moe"]


def _write(case: str, out_dir: Path, seed: int) -> Path:
    base, change = CASES[case]
    return write_hf_checkpoint(base, out_dir, seed, **change)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("swa_ckpt")
    return {case: _write(case, root / case, seed=10 + i) for i, case in enumerate(CASES)}


def _prompts(seed: int, num: int, vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(20, 31))] for _ in range(num)]


def _hf(path: Path) -> Any:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf.generation_config.eos_token_id = None
    return hf.eval()


def _ours(path: Path, config: ModelConfig | None = None) -> MoEModel:
    model = MoEModel(config or ModelConfig.from_hf(path), dtype=torch.float32)
    load_weights(model, path, dtype=torch.float32)
    return model


# ---- config ------------------------------------------------------------------------------


def test_config_reads_window_per_family(checkpoints: dict[str, Path]) -> None:
    for case in CASES:
        cfg = ModelConfig.from_hf(checkpoints[case])
        assert cfg.sliding_window == WINDOW
        assert [cfg.layer_sliding_window(i) for i in range(cfg.num_hidden_layers)] == [WINDOW] * cfg.num_hidden_layers
    raw = dict(HF_CASES["qwen3_moe"][1], architectures=["Qwen3MoeForCausalLM"], sliding_window=WINDOW)
    assert ModelConfig.from_hf(dict(raw, use_sliding_window=False)).sliding_window is None
    assert ModelConfig.from_hf(dict(raw, use_sliding_window=True, sliding_window=None)).sliding_window is None
    mixtral = dict(HF_CASES["mixtral"][1], architectures=["MixtralForCausalLM"])
    assert ModelConfig.from_hf(dict(mixtral, sliding_window=None)).layer_sliding_window(1) is None
    with pytest.raises(ValueError, match="layer 2 out of range"):
        ModelConfig.from_hf(mixtral).layer_sliding_window(2)


@pytest.mark.parametrize("bad", [0, -4, 2.5, "6", True])
def test_bad_window_values_raise_naming_the_field(bad: object) -> None:
    raw = dict(HF_CASES["mixtral"][1], architectures=["MixtralForCausalLM"], sliding_window=bad)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf(raw)
    lenient = ModelConfig.from_hf(raw, strict=False)
    assert lenient.sliding_window is None and any("sliding_window" in p for p in lenient.unsupported)


def test_window_on_mla_or_non_positive_is_rejected(checkpoints: dict[str, Path]) -> None:
    cfg = ModelConfig.from_hf(checkpoints["mixtral"])
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(cfg, sliding_window=0)
    mla = ModelConfig.from_hf(dict(HF_CASES["deepseek_v2"][1], architectures=["DeepseekV2ForCausalLM"]))
    with pytest.raises(ValueError, match="sliding_window 4 needs GQA"):
        dataclasses.replace(mla, sliding_window=4)


# ---- paged attention masks ---------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 6, 64])
def test_paged_masks_match_dense_reference(window: int) -> None:
    """Mixed step: two decodes and two prefill chunks (one after a cached prefix), scattered
    block tables; each row equals dense attention over keys p - window < k <= p."""
    torch.manual_seed(window)
    cfg = ModelConfig.from_hf(dict(HF_CASES["mixtral"][1], architectures=["MixtralForCausalLM"]))
    size, heads, kv_heads, hd = 4, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qlens, ctxs = [1, 5, 1, 7], [13, 17, 3, 7]
    nblocks = 1 + sum(-(-c // size) for c in ctxs)
    ids = torch.randperm(nblocks - 1).add(1).tolist()
    tables, full = [], []
    for c in ctxs:
        n = -(-c // size)
        tables.append(ids[:n])
        ids = ids[n:]
        full.append(torch.randn(c, 2, kv_heads, hd))
    view = PagedKVCache(cfg, nblocks, size, torch.float32).layer(0)
    for table, kv in zip(tables, full):
        view.write(torch.tensor([table[p // size] * size + p % size for p in range(len(kv))]), kv)
    meta = AttentionMetadata.build(qlens, ctxs, tables, size)
    q = torch.randn(sum(qlens), heads, hd)

    def attend(qb: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return sdpa(qb, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), mask, hd ** -0.5)

    out = paged_attention(q, meta, view, hd, attend, attend, sliding_window=window)
    assert out.shape == (sum(qlens), heads, hd)
    row = 0
    for qlen, c, kv in zip(qlens, ctxs, full):
        pos = torch.arange(c - qlen, c)[:, None]
        keys = torch.arange(c)[None, :]
        mask = (keys <= pos) & (keys > pos - window)
        ref = attend(q[row : row + qlen].transpose(0, 1)[None], kv[None], mask[None, None])[0].transpose(0, 1)
        torch.testing.assert_close(out[row : row + qlen], ref, rtol=1e-5, atol=1e-5)
        row += qlen
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        paged_attention(q, meta, view, hd, attend, attend, sliding_window=0)


# ---- end to end against transformers -----------------------------------------------------


@pytest.mark.parametrize("case,chunk", [(c, k) for c in GENERATE_CASES for k in (None, 3)]
                         + [("qwen3_moe_layer_types", 3)])
def test_prompt_and_decode_logits_match_hf(checkpoints: dict[str, Path], case: str, chunk: int | None) -> None:
    path = checkpoints[case]
    hf, model = _hf(path), _ours(path)
    prompts = _prompts(1, 3)
    tokens, logits = greedy_generate(model, prompts, NEW_TOKENS, chunk=chunk)
    full_attention = _ours(path, dataclasses.replace(model.config, sliding_window=None))
    _, unwindowed = greedy_generate(full_attention, prompts, 1)
    for prompt, toks, steps, plain in zip(prompts, tokens, logits, unwindowed):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1 :]  # [NEW_TOKENS, V]
        mine = torch.stack(steps)
        assert mine.shape == ref.shape == (NEW_TOKENS, model.config.vocab_size)
        assert (mine - ref).abs().max().item() <= TOL
        assert (plain[0] - mine[0]).abs().max().item() > 1e-2  # the window changes the math here


@pytest.mark.slow
@pytest.mark.parametrize("case", GENERATE_CASES)
def test_llm_chunked_prefill_greedy_matches_hf_generate(checkpoints: dict[str, Path], case: str) -> None:
    from launch import LLM, SamplingParams

    path = checkpoints[case]
    prompts = _prompts(2, 4)
    prompts.append(prompts[0][:17] + prompts[1][:9])  # shares a 4-block prefix with prompts[0]
    oracle = hf_greedy(path, prompts, NEW_TOKENS, attn_implementation="eager")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=True,
             enable_prefix_caching=True, max_model_len=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [NEW_TOKENS] * len(prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == oracle


def test_decode_runs_the_fused_kernels_while_every_context_fits_the_window(tmp_path: Path, monkeypatch) -> None:
    """A window of 24 over 18-22-token prompts and 12 decoded tokens: the first decode steps see every
    key (contexts within the window) and run the fused attention op and the paged decode kernel; the
    later ones cross the window edge and run op by op. Logits match transformers' throughout."""
    from moe import kernels
    from moe.layers.gqa import GQAAttention

    if not kernels.is_available():
        pytest.skip("the CPU kernels could not be built here")
    window, new_tokens = 24, 12
    path = write_hf_checkpoint("mixtral", tmp_path / "wide", 21, sliding_window=window)
    hf, model = _hf(path), _ours(path)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 96) for _ in range(n)] for n in (18, 20, 22)]
    fused_calls, op_by_op = [0], []
    build = kernels.gqa_decode_attention_op

    def counting(*args: Any, **kw: Any) -> Any:
        run = build(*args, **kw)

        def counted(*a: Any) -> torch.Tensor:
            fused_calls[0] += 1
            return run(*a)
        return counted

    forward_ops = GQAAttention._forward_ops

    def logged(self: GQAAttention, x: torch.Tensor, cos, sin, meta: AttentionMetadata, cache) -> torch.Tensor:
        if len(meta.query_lens_list) == x.shape[0]:  # a step of decode rows only
            op_by_op.append(max(meta.context_lens_list))
        return forward_ops(self, x, cos, sin, meta, cache)

    monkeypatch.setattr(kernels, "gqa_decode_attention_op", counting)
    monkeypatch.setattr(GQAAttention, "_forward_ops", logged)
    tokens, logits = greedy_generate(model, prompts, new_tokens)
    layers = model.config.num_hidden_layers
    assert fused_calls[0] > 0 and fused_calls[0] % layers == 0  # whole steps on the op
    assert op_by_op and min(op_by_op) > window  # op by op only past the window edge
    for prompt, toks, steps in zip(prompts, tokens, logits):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1 :]
        assert (torch.stack(steps) - ref).abs().max().item() <= TOL
