"""On a CUDA machine the same engine runs the shard on the GPU: greedy tokens equal transformers'
(fp32), for every model family. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v2", "mixtral", "qwen3_moe"])
def test_gpu_greedy_equals_transformers(hf_checkpoints, case: str):
    path = hf_checkpoints[case]
    prompts = [{"prompt_token_ids": [3, 5, 7, 11, 13][: n]} for n in range(1, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), dtype="float32") as llm:
        assert llm.engine.executor.worker.device.type == "cuda"
        gpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    from tests.oracles import hf_greedy

    assert gpu == hf_greedy(path, [p["prompt_token_ids"] for p in prompts], 12)
