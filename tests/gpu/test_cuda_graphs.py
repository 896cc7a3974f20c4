"""CUDA graphs of the decode step on a GPU: the engine decodes on them by default, with the greedy
tokens of ``--enforce-eager`` and transformers' (fp32), a replay never waits on the device, and the
model's sync-free ops stay sync-free. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [{"prompt_token_ids": [3, 5, 7, 11, 13, 17, 19][: n]} for n in range(1, 8)]


def _generate(path, **kwargs) -> tuple[list[list[int]], object]:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # block size 4: the 7 prompts' contexts (1-47 tokens) cross block buckets 4, 8 and 16
    with LLM(str(path), dtype="float32", block_size=4, **kwargs) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        return outs, llm.engine.executor.worker.decode_graphs


@pytest.mark.parametrize("case", ["deepseek_v3", "mixtral"])
def test_graph_decode_equals_eager_and_transformers(hf_checkpoints, case: str):
    path = hf_checkpoints[case]
    graphed, graphs = _generate(path)
    assert graphs is not None and graphs.disabled is None and graphs.captures >= 3, graphs and graphs.disabled
    eager, none = _generate(path, enforce_eager=True)
    assert none is None
    assert graphed == eager
    from tests.oracles import hf_greedy

    assert graphed == hf_greedy(path, [p["prompt_token_ids"] for p in PROMPTS], 40)


def test_a_replay_never_waits_on_the_device(hf_checkpoints):
    with LLM(str(hf_checkpoints["deepseek_v3"]), dtype="bfloat16") as llm:
        llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        worker = llm.engine.executor.worker
        graphs = worker.decode_graphs
        assert graphs is not None and graphs.captures >= 1
        batch, blocks = next(iter(graphs.graphs))
        ctx = [5] * batch
        with torch.inference_mode():
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                logits = graphs.run([1] * batch, [4] * batch, ctx, [[0, 1]] * batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert logits is not None and logits.shape[0] == batch and graphs.captures == len(graphs.graphs)


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
