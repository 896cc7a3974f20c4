"""The fused CPU expert kernel and int8 experts through the whole engine: greedy tokens equal
to the PyTorch expert path (fp32), int8 switched on by the vLLM-named option."""

from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from launch.config import EngineConfig
from launch.config_args import add_runtime_args, runtime_config_from_args
from moe import kernels
from tests.engine.test_engine_fidelity import make_prompts


def _greedy(llm: LLM, prompts: list[list[int]], use_kernel: bool) -> list[list[int]]:
    for layer in llm.engine.executor.worker.model.moe_layers():
        layer.experts.use_kernel = use_kernel
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_kernel_gives_the_pytorch_paths_greedy_tokens(hf_checkpoints, quantization):
    if not kernels.is_available():
        pytest.skip("the CPU expert kernel could not be built here")
    prompts = make_prompts(3, 5, 96)
    with LLM(str(hf_checkpoints["deepseek_v3"]), dtype="float32", quantization=quantization) as llm:
        experts = next(llm.engine.executor.worker.model.moe_layers()).experts
        assert experts.quantization == quantization
        fused = _greedy(llm, prompts, True)
        assert experts.packed_weights() is not None
        assert experts.packed_weights().quantized == (quantization == "int8")
        plain = _greedy(llm, prompts, False)
    assert fused == plain
    assert all(len(t) == 12 for t in fused)


def test_quantization_option_is_opt_in_and_validated():
    assert EngineConfig().quantization is None
    assert EngineConfig(quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="'fp8' is not implemented"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    import argparse

    parser = add_runtime_args(argparse.ArgumentParser(), server=False)
    config = runtime_config_from_args(parser.parse_args(["--model", "m", "--quantization", "int8"]))
    assert config.engine.quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp4"])


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "overrides"), [
    ("deepseek_v3", {"moe_intermediate_size": 36, "intermediate_size": 100}),
    ("mixtral", {"intermediate_size": 92}),
])
def test_an_intermediate_size_off_the_block_runs_the_kernel_with_the_same_tokens(tmp_path, arch, overrides):
    """Routed, shared and dense MLP widths that are not multiples of 8 are packed zero-padded: the
    kernel serves them, with the PyTorch path's greedy tokens (fp32)."""
    if not kernels.is_available():
        pytest.skip("the CPU expert kernel could not be built here")
    from moe.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(arch, tmp_path / arch, seed=3, config_overrides=overrides)
    prompts = make_prompts(3, 5, 96)
    with LLM(str(path), dtype="float32") as llm:
        experts = next(llm.engine.executor.worker.model.moe_layers()).experts
        fused = _greedy(llm, prompts, True)
        packed = experts.packed_weights()
        assert packed is not None and packed.w2p.shape[2] % 8 == 0 and packed.w2p.shape[2] > experts.w2.shape[2]
        plain = _greedy(llm, prompts, False)
    assert fused == plain
    assert all(len(t) == 12 for t in fused)
