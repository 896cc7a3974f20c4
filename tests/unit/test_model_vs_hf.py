"""MoEModel against Hugging Face transformers on tiny random save_pretrained checkpoints (fp32).

For each family: logits on the prompt and on every decode step within 1e-4 of transformers'
forward over the same tokens, and 32 greedy tokens identical to transformers' ``generate``,
for a batch of prompts of different lengths driven through PagedKVCache + AttentionMetadata
(one mixed prefill batch, and a chunked-prefill schedule mixing chunks with decodes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.loader import load_weights
from moe.model import MoEModel
from tests.conftest import HF_VARIANTS

FAMILIES = ["deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe"]
PROMPT_LENS = [5, 12, 1, 9]
NEW_TOKENS = 32
BLOCK_SIZE = 4
TOL = 1e-4


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def greedy_generate(model: MoEModel, prompts: list[list[int]], new_tokens: int, chunk: int | None = None,
                    kv_cache_dtype: str = "auto") -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy decoding over the paged cache. chunk=None prefills every prompt in one step;
    otherwise prompts are fed ``chunk`` tokens per step, so prefill chunks and decodes mix.
    Returns (generated ids per sequence, logits [V] per generated token per sequence)."""
    cfg = model.config
    blocks_per_seq = -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE)
    cache = PagedKVCache(cfg, blocks_per_seq * len(prompts) + 1, BLOCK_SIZE, torch.float32, kv_cache_dtype)
    # interleave block ids across sequences so tables are not contiguous
    tables = [[1 + b + len(prompts) * i for i in range(blocks_per_seq)] for b in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens already in the cache
    out: list[list[int]] = [[] for _ in prompts]
    logits_out: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(o) < new_tokens for o in out):
        active = [b for b in range(len(seqs)) if len(out[b]) < new_tokens]
        qlens = [min(len(seqs[b]) - done[b], chunk or len(seqs[b])) for b in active]
        ids = torch.tensor([t for b, q in zip(active, qlens) for t in seqs[b][done[b] : done[b] + q]])
        pos = torch.tensor([p for b, q in zip(active, qlens) for p in range(done[b], done[b] + q)])
        ctx = [done[b] + q for b, q in zip(active, qlens)]
        meta = AttentionMetadata.build(qlens, ctx, [tables[b] for b in active], BLOCK_SIZE)
        with torch.no_grad():
            hidden = model(ids, pos, meta, cache)
            assert hidden.shape == (len(ids), cfg.hidden_size)
            logits = model.compute_logits(hidden[meta.logits_indices()])
        assert logits.shape == (len(active), cfg.vocab_size) and logits.dtype == torch.float32
        for row, (b, c) in enumerate(zip(active, ctx)):
            done[b] = c
            if c == len(seqs[b]):  # prompt fully cached: this row predicts the next token
                tok = int(logits[row].argmax())
                seqs[b].append(tok)
                out[b].append(tok)
                logits_out[b].append(logits[row])
    return out, logits_out


@pytest.fixture(scope="module")
def loaded(hf_checkpoints: dict[str, Path]) -> dict[str, tuple[object, MoEModel]]:
    import transformers

    models = {}
    for fam in FAMILIES:
        path = hf_checkpoints[fam]
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
        hf.generation_config.eos_token_id = None
        model = MoEModel(ModelConfig.from_hf(path), dtype=torch.float32)
        load_weights(model, path, dtype=torch.float32)
        models[fam] = (hf, model)
    return models


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_and_decode_logits_match_hf(loaded: dict, family: str) -> None:
    hf, model = loaded[family]
    prompts = _prompts(model.config.vocab_size)
    tokens, logits = greedy_generate(model, prompts, NEW_TOKENS)
    for prompt, toks, steps in zip(prompts, tokens, logits):
        full = torch.tensor([prompt + toks[:-1]])
        with torch.no_grad():
            ref = hf(full).logits[0, len(prompt) - 1 :]  # [NEW_TOKENS, V]: prompt's last + each decode step
        mine = torch.stack(steps)
        assert mine.shape == ref.shape
        assert (mine - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_hf_generate(loaded: dict, family: str) -> None:
    hf, model = loaded[family]
    prompts = _prompts(model.config.vocab_size, seed=1)
    mine, _ = greedy_generate(model, prompts, NEW_TOKENS)
    # one left-padded batch through transformers' generate (pad id 0, masked out)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert ref.shape == (len(prompts), width + NEW_TOKENS)
    assert mine == ref[:, width:].tolist()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_chunked_prefill_mixed_batches_match_one_shot(loaded: dict, family: str) -> None:
    _, model = loaded[family]
    prompts = _prompts(model.config.vocab_size, seed=2)
    one_shot, ref_logits = greedy_generate(model, prompts, 8)
    chunked, logits = greedy_generate(model, prompts, 8, chunk=3)
    assert chunked == one_shot
    for a, b in zip(logits, ref_logits):
        assert (torch.stack(a) - torch.stack(b)).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_serving_path_close_to_fp32(hf_checkpoints: dict[str, Path], loaded: dict, family: str) -> None:
    _, ref_model = loaded[family]
    model = MoEModel(ref_model.config, dtype=torch.bfloat16)
    load_weights(model, hf_checkpoints[family], dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompts = _prompts(model.config.vocab_size, seed=3)
    _, ref = greedy_generate(ref_model, prompts, 1)
    _, got = greedy_generate(model, prompts, 2)  # prefill + one absorbed/batched decode step in bf16
    for a, b in zip(ref, got):
        assert (a[0] - b[0]).abs().max().item() < 0.1 * a[0].abs().max().item()


def test_empty_batch_still_runs_every_layer(loaded: dict) -> None:
    _, model = loaded["deepseek_v3"]
    cache = PagedKVCache(model.config, 2, BLOCK_SIZE, torch.float32)
    meta = AttentionMetadata.build([], [], [], BLOCK_SIZE)
    calls = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: calls.append(out.shape)) for m in model.moe_layers()]
    with torch.no_grad():
        hidden = model(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), meta, cache)
    for h in hooks:
        h.remove()
    assert hidden.shape == (0, model.config.hidden_size)
    assert calls == [(0, model.config.hidden_size)] * len(model.config.moe_layer_ids)


@pytest.mark.parametrize("case", sorted(HF_VARIANTS))
def test_variant_configs_logits_match_hf(hf_checkpoints: dict[str, Path], case: str) -> None:
    import transformers

    path = hf_checkpoints[case]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model = MoEModel(ModelConfig.from_hf(path), dtype=torch.float32)
    load_weights(model, path, dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size, seed=4)[:2]
    tokens, logits = greedy_generate(model, prompts, 8)
    for prompt, toks, steps in zip(prompts, tokens, logits):
        with torch.no_grad():
            ref = hf.eval()(torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1 :]
        assert (torch.stack(steps) - ref).abs().max().item() <= TOL


def test_local_slots_host_only_named_experts(hf_checkpoints: dict[str, Path], loaded: dict) -> None:
    _, full = loaded["deepseek_v3"]
    cfg = full.config
    first, second = cfg.moe_layer_ids[:2]
    model = MoEModel(cfg, dtype=torch.float32, local_slots={first: [5, 2, 5], second: [0]})
    load_weights(model, hf_checkpoints["deepseek_v3"], dtype=torch.float32)
    layers = list(model.moe_layers())
    full_layers = list(full.moe_layers())
    assert layers[0].experts.w13.shape == (3, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert torch.equal(layers[0].experts.w13, full_layers[0].experts.w13[[5, 2, 5]])
    assert torch.equal(layers[1].experts.w2, full_layers[1].experts.w2[[0]])
    assert layers[0].experts.slot_to_logical.tolist() == [5, 2, 5]


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_tensor_parallel_shards_match_full_model(hf_checkpoints: dict[str, Path], loaded: dict, family: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two TP shards run in lock-step threads; all_reduce is simulated by summing in-process."""
    import threading

    import moe.model

    _, full = loaded[family]
    cfg = full.config
    barrier, slots = threading.Barrier(2, timeout=60), {}

    def fake_all_reduce(t: torch.Tensor, group: object = None) -> None:
        slots[threading.get_ident()] = t.clone()
        barrier.wait()
        total = sum(slots.values())
        barrier.wait()
        t.copy_(total)

    monkeypatch.setattr(moe.model.dist, "all_reduce", fake_all_reduce)
    ids, pos = torch.tensor([7, 8, 9, 10, 11]), torch.arange(5)
    steps = [(AttentionMetadata.build([4], [4], [[0, 1]], BLOCK_SIZE), ids[:4], pos[:4]),
             (AttentionMetadata.build([1], [5], [[0, 1]], BLOCK_SIZE), ids[4:], pos[4:])]

    def run(model: MoEModel, tp_size: int) -> list[torch.Tensor]:
        cache = PagedKVCache(cfg, 2, BLOCK_SIZE, torch.float32, tp_size=tp_size)
        with torch.no_grad():
            return [model.compute_logits(model(i, p, m, cache)) for m, i, p in steps]

    expected = run(full, 1)
    results: dict[int, list[torch.Tensor]] = {}

    def shard_main(rank: int) -> None:
        shard = MoEModel(cfg, dtype=torch.float32, tp_rank=rank, tp_size=2)
        load_weights(shard, hf_checkpoints[family], dtype=torch.float32)
        shard.shard_for_tp()
        results[rank] = run(shard, 2)

    threads = [threading.Thread(target=shard_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == [0, 1]
    for rank in range(2):
        for got, want in zip(results[rank], expected):
            assert (got - want).abs().max().item() <= TOL
