"""float16 on the CPU: it works, and the engine says once that it runs off the CPU kernels."""

from __future__ import annotations

import logging

import pytest
import torch

from launch import LLM, SamplingParams
from launch.engine import CPU_FLOAT16_WARNING


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for CPU runs")
def test_float16_on_the_cpu_warns_once_and_still_generates(tiny_ckpt, caplog: pytest.LogCaptureFixture) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="launch.engine"):
        with LLM(str(tiny_ckpt), dtype="half") as llm:  # vLLM's spelling of float16
            assert llm.engine.dtype == "float16"
            out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    assert len(out[0].outputs[0].token_ids) == 4
    assert [r.getMessage() for r in caplog.records].count(CPU_FLOAT16_WARNING) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="launch.engine"):
        with LLM(str(tiny_ckpt), dtype="bfloat16") as llm:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    assert CPU_FLOAT16_WARNING not in [r.getMessage() for r in caplog.records]
