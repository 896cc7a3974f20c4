"""Released models by name, offline (configs/models), and kvcalc on names and runtime configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.kvcalc import main as kvcalc
from moe.config import ModelConfig
from moe.model_catalog import find_model_config, known_model_names

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Public parameter counts (billions) of the released checkpoints.
PARAMS_B = {
    "deepseek-ai/DeepSeek-V3": 671.0, "deepseek-ai/DeepSeek-R1": 671.0, "deepseek-ai/DeepSeek-V2": 235.7,
    "deepseek-ai/DeepSeek-V2-Lite": 15.7, "mistralai/Mixtral-8x7B-v0.1": 46.7, "mistralai/Mixtral-8x22B-v0.1": 140.6,
    "Qwen/Qwen3-30B-A3B": 30.5, "Qwen/Qwen3-235B-A22B": 235.1,
}


def test_every_shipped_model_is_listed_and_sized():
    assert sorted(PARAMS_B) == known_model_names()
    for name, billions in PARAMS_B.items():
        cfg = ModelConfig.from_hf(name, strict=False)
        assert cfg.num_parameters() / 1e9 == pytest.approx(billions, abs=0.06), name


@pytest.mark.parametrize("spelling", ["deepseek-ai/DeepSeek-V3", "DeepSeek-V3", "deepseek-v3", "DEEPSEEK-V3",
                                      "deepseek-ai/DeepSeek-V3-Base"])
def test_names_resolve_case_insensitively(spelling):
    assert find_model_config(spelling)["_name_or_path"] == "deepseek-ai/DeepSeek-V3"


def test_architecture_numbers_match_the_public_configs():
    v3 = ModelConfig.from_hf("deepseek-ai/DeepSeek-V3", strict=False)
    assert (v3.hidden_size, v3.num_hidden_layers, v3.num_experts, v3.num_experts_per_tok, v3.kv_lora_rank) == \
        (7168, 61, 256, 8, 512)
    assert v3.kv_bytes_per_token(2) == 70_272 and v3.kv_bytes_per_token(1) == 35_136
    lite = ModelConfig.from_hf("deepseek-ai/DeepSeek-V2-Lite", strict=False)
    assert lite.q_lora_rank is None and lite.num_experts == 64 and lite.first_k_dense_replace == 1
    mixtral = ModelConfig.from_hf("mistralai/Mixtral-8x7B-Instruct-v0.1", strict=False)
    assert mixtral.kv_bytes_per_token(2) == 131_072
    qwen = ModelConfig.from_hf("Qwen/Qwen3-235B-A22B", strict=False)
    assert (qwen.num_hidden_layers, qwen.num_experts, qwen.moe_intermediate_size, qwen.num_key_value_heads) == \
        (94, 128, 1536, 4)


def test_unknown_name_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="deepseek-ai/DeepSeek-V3"):
        ModelConfig.from_hf("acme/NotAModel")


def test_kvcalc_accepts_a_runtime_config(capsys):
    assert kvcalc(["--model", str(CONFIGS / "deepseek-v3-decode-ep144.yaml"), "--weight-dtype", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "deepseek-ai/DeepSeek-V3"
    assert out["expert_parallel_size"] == 144 and out["kv_cache_dtype"] == "fp8" and out["block_size"] == 64
    assert out["kv_bytes_per_token"] == 35_136
    # the rank holds 2 of the 288 routed slots: 58 MoE layers x 2 x 3 x 7168 x 2048 fp8 bytes of experts
    assert 20 * 2**30 < out["weight_bytes_per_rank"] < 25 * 2**30
    assert out["max_num_tokens"] == out["kv_budget_bytes"] // 35_136


def test_kvcalc_flags_override_the_runtime_config(capsys):
    assert kvcalc(["--model", str(CONFIGS / "deepseek-v3-decode-ep144.yaml"), "--weight-dtype", "fp8",
                   "--kv-cache-dtype", "auto", "--block-size", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 70_272 and out["block_size"] == 16


@pytest.mark.parametrize("path", ["README.md", "configs/hardware/h100.yaml"])
def test_kvcalc_names_what_it_expected_for_other_files(capsys, path):
    root = Path(__file__).resolve().parents[2]
    assert kvcalc(["--model", str(root / path)]) == 2
    err = capsys.readouterr().err
    assert "expected a checkpoint directory, its config.json, a runtime config YAML" in err
    assert "Traceback" not in err


def test_config_command_checks_presets_against_the_shipped_model(capsys):
    from launch.config_args import main as config_main

    path = str(CONFIGS / "deepseek-v3-decode-ep144.yaml")
    assert config_main(["--config", path]) == 0
    capsys.readouterr()
    assert config_main(["--config", path, "--set", "balancer.num_redundant_experts=31"]) == 2
    assert "287 slots is not divisible by ep_size=144" in capsys.readouterr().err
