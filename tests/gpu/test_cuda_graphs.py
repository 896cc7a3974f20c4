"""CUDA graphs of the decode step on a GPU: the engine decodes on them with --cuda-graphs (bf16), each
replayed step gives the eager step's logits and KV entries, a replay never waits on the device, and
the op-by-op MoE layer never does either. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from launch import LLM, SamplingParams
from moe.cuda_graphs import DecodeGraphs, not_capturable
from tests.unit.test_cuda_graphs import _model, _Run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [{"prompt_token_ids": [3, 5, 7, 11, 13, 17, 19][: n]} for n in range(1, 8)]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "mixtral", "qwen3_moe"])
def test_replayed_steps_equal_eager_steps(hf_checkpoints, family: str):
    """bf16, the same inputs on both sides (the eager run's tokens forced into the graph run):
    logits within bf16 rounding, KV entries likewise, slot loads equal; batches 3 -> 2 -> 1 over a
    block-bucket edge."""
    model = _model(hf_checkpoints[family], torch.bfloat16, "cuda")
    assert not_capturable(model) is None
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [10, 11, 12], [13, 14, 15, 16, 17]]
    eager = _Run(model, prompts, blocks_per_seq=8)
    graphed = _Run(copy.deepcopy(model), prompts, blocks_per_seq=8)
    graphed.seqs = [list(s) for s in eager.seqs]
    graphed.graphs = DecodeGraphs(graphed.model, graphed.cache, scratch_block=graphed.scratch, max_batch=8,
                                  max_blocks=8, capture_after=1)
    assert graphed.graphs.backend.name == "cuda"
    for run in (eager, graphed):
        for layer in run.model.moe_layers():
            layer.slot_load.zero_()
    for active in [[0, 1, 2]] * 4 + [[1, 2]] * 3 + [[2]] * 2:
        a = eager.decode(active)
        b = graphed.decode(active, forced=[eager.seqs[i][-1] for i in active])
        torch.testing.assert_close(b, a, rtol=3e-2, atol=3e-2)
    assert graphed.graphs.disabled is None and sorted(graphed.graphs.graphs) == [(1, 4), (2, 4), (4, 4), (4, 8)]
    for pa, pb in zip(eager.cache.pools, graphed.cache.pools):
        torch.testing.assert_close(pb[: graphed.scratch].float(), pa[: graphed.scratch].float(), rtol=3e-2, atol=3e-2)
    for la, lb in zip(eager.model.moe_layers(), graphed.model.moe_layers()):
        assert torch.equal(la.slot_load, lb.slot_load) and int(la.slot_load.sum()) > 0


def test_the_engine_decodes_on_graphs_in_bf16_only(hf_checkpoints):
    path = str(hf_checkpoints["deepseek_v3"])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(path, dtype="bfloat16", block_size=4, cuda_graphs=True) as llm:
        outs = llm.generate(PROMPTS, params)
        graphs = llm.engine.executor.worker.decode_graphs
        assert graphs is not None and graphs.disabled is None, graphs and graphs.disabled
        assert graphs.captures >= 2  # contexts of 2-47 tokens over 4-token blocks: several buckets
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    # fp32 experts read their row counts back: never recorded; vLLM's flag wins; off by default
    for kwargs in ({"dtype": "float32", "cuda_graphs": True}, {"dtype": "bfloat16", "cuda_graphs": True,
                                                               "enforce_eager": True}, {"dtype": "bfloat16"}):
        with LLM(path, **kwargs) as llm:
            assert llm.engine.executor.worker.decode_graphs is None, kwargs


def test_a_replay_never_waits_on_the_device(hf_checkpoints):
    with LLM(str(hf_checkpoints["deepseek_v3"]), dtype="bfloat16", cuda_graphs=True) as llm:
        llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        graphs = llm.engine.executor.worker.decode_graphs
        assert graphs is not None and graphs.captures >= 1
        batch, blocks = next(iter(graphs.graphs))
        with torch.inference_mode():
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                logits = graphs.run([1] * batch, [4] * batch, [5] * batch, [[0, 1]] * batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert logits is not None and logits.shape[0] == batch and graphs.captures == len(graphs.graphs)


def test_a_replay_that_samples_some_rows_never_waits_on_the_device(hf_checkpoints):
    """A graph step whose row 0 is a one-token prefill chunk short of its prompt's end (samples
    nothing): the sampled rows' logits, picked without a host wait, equal the full replay's rows."""
    from launch.core.batch import BatchSpec, ScheduledSequence

    with LLM(str(hf_checkpoints["deepseek_v3"]), dtype="bfloat16", cuda_graphs=True) as llm:
        llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        worker = llm.engine.executor.worker
        graphs = worker.decode_graphs
        assert graphs is not None and graphs.captures >= 1
        n = max(b for b, _ in graphs.graphs)
        assert n >= 2, sorted(graphs.graphs)
        params = SamplingParams(temperature=0.0)
        seqs = tuple(ScheduledSequence(f"r{i}", i, i, (3 + i,), (4,), 4, (1 + i,), i > 0, params, 0)
                     for i in range(n))
        batch = BatchSpec(dp_rank=0, block_size=worker.spec.block_size, seqs=seqs)
        with torch.inference_mode():
            whole = graphs.run(batch.input_ids, batch.positions, batch.context_lens, batch.block_tables).clone()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                picked = worker._graph_logits(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert picked is not None and picked.shape == (len(seqs) - 1, whole.shape[1])
        torch.testing.assert_close(picked, whole[1:])


def test_a_prefill_step_never_waits_on_the_device(hf_checkpoints):
    """A step of prefill chunks of several lengths (grouped attention calls and one alone) and a
    decode row, op by op: its metadata in one asynchronous copy, nothing read back."""
    from moe.kv_cache import AttentionMetadata, PagedKVCache

    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16, "cuda")
    cache = PagedKVCache(model.config, 100, 4, torch.bfloat16, device="cuda")
    qlens, ctxs = [1, 9, 10, 11, 40], [4, 9, 10, 11, 40]
    tables = [[1 + 16 * i + j for j in range(-(-c // 4))] for i, c in enumerate(ctxs)]
    with torch.inference_mode():
        meta = AttentionMetadata.build(qlens, ctxs, tables, 4, device="cuda")
        ids = torch.randint(0, model.config.vocab_size, (sum(qlens),), device="cuda")
        pos = torch.cat([torch.arange(c - q, c) for q, c in zip(qlens, ctxs)]).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hidden = model(ids, pos, meta, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert hidden.shape == (sum(qlens), model.config.hidden_size) and torch.isfinite(hidden.float()).all()


def test_the_eager_moe_layer_never_waits_on_the_device(hf_checkpoints):
    """The op-by-op MoE forward (router, replicas, slot load, grouped experts) reads nothing back."""
    from moe.config import ModelConfig
    from moe.moe_layer import MoELayer

    config = ModelConfig.from_hf(hf_checkpoints["deepseek_v3"])
    layer = MoELayer(config, config.moe_layer_ids[0], dtype=torch.bfloat16).cuda()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(7, config.hidden_size, dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        layer(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = layer(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.shape == x.shape and int(layer.slot_load.sum()) == 2 * 7 * config.num_experts_per_tok
