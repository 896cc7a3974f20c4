"""KV sizing (kvcalc) on the real DeepSeek-V3 and Mixtral-8x7B config.json values."""

from __future__ import annotations

import json

import pytest

from launch.core.kv_sizing import compute_kv_sizing, parse_memory
from moe.config import ModelConfig

GiB = 1024**3

V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
 "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
 "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
 "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
 "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
 "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
 "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
 "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
 "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False,
 "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
 "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1}
MIX = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
 "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
 "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
 "hidden_act": "silu", "torch_dtype": "bfloat16", "router_aux_loss_coef": 0.02, "output_router_logits": False}


@pytest.fixture(scope="module")
def v3() -> ModelConfig:
    return ModelConfig.from_hf(V3)  # block-wise fp8 weights: the loader dequantizes them


@pytest.fixture(scope="module")
def mixtral() -> ModelConfig:
    return ModelConfig.from_hf(MIX, strict=False)


def test_deepseek_v3_mla_bytes_per_token(v3):
    bf16 = compute_kv_sizing(v3, memory_bytes="141GB", dtype_bytes=2, weight_dtype_bytes=1, tensor_parallel_size=8)
    assert bf16.kv_bytes_per_token == 70_272  # 61 layers x (512 + 64) x 2 B
    assert bf16.kv_bytes_per_token_per_rank == 70_272  # the latent is replicated on every TP rank
    assert bf16.mha_bytes_per_token == 61 * 128 * (128 + 64 + 128) * 2  # ~4.8 MiB as full MHA
    assert bf16.mha_bytes_per_token / 2**20 == pytest.approx(4.77, abs=0.01)
    assert bf16.savings_vs_mha == pytest.approx(71.1, abs=0.1)
    fp8 = compute_kv_sizing(v3, memory_bytes="141GB", kv_cache_dtype="fp8", weight_dtype_bytes=1,
                            tensor_parallel_size=8)
    assert fp8.kv_bytes_per_token == 35_136
    assert fp8.max_num_tokens == pytest.approx(2 * bf16.max_num_tokens, abs=1)


def test_mixtral_gqa_bytes_per_token_split_by_tp(mixtral):
    sizes = {tp: compute_kv_sizing(mixtral, memory_bytes="141GiB", tensor_parallel_size=tp) for tp in (1, 2, 8, 16)}
    assert sizes[1].kv_bytes_per_token == 131_072  # 2 x 32 layers x 8 heads x 128 x 2 B
    assert sizes[1].mha_bytes_per_token == 2 * 32 * 32 * 128 * 2
    assert [sizes[tp].kv_bytes_per_token_per_rank for tp in (1, 2, 8, 16)] == [131_072, 65_536, 16_384, 16_384]
    with pytest.raises(ValueError, match="divide or be a multiple"):
        compute_kv_sizing(mixtral, memory_bytes="80GiB", tensor_parallel_size=3)


def test_budget_tokens_blocks_and_concurrency(mixtral):
    s = compute_kv_sizing(mixtral, memory_bytes="80GiB", memory_utilization=0.9, max_model_len=32768,
                          tensor_parallel_size=2, reserved_bytes="1GiB")
    weights = -(-mixtral.num_parameters() * 2 // 2)
    assert s.weight_bytes_per_rank == weights
    assert 46e9 < weights < 47.5e9  # 46.7B parameters, bf16, split over 2 ranks
    budget = int(0.9 * 80 * GiB) - weights - GiB
    assert s.kv_budget_bytes == budget
    assert s.max_num_tokens == budget // 65_536
    assert s.num_blocks(16) == s.max_num_tokens // 16
    assert s.max_concurrency == pytest.approx(s.max_num_tokens / 32768)
    with pytest.raises(ValueError, match="block_size"):
        s.num_blocks(0)


def test_weights_that_do_not_fit_raise(v3):
    with pytest.raises(ValueError, match="no room for the KV cache"):
        compute_kv_sizing(v3, memory_bytes="141GB", dtype_bytes=2)  # 671B params in bf16 on one GPU
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        compute_kv_sizing(v3, memory_bytes="1TiB", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="memory_utilization"):
        compute_kv_sizing(v3, memory_bytes="1TiB", memory_utilization=1.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * GiB), ("80 GB", 80 * 10**9), ("80G", 80 * GiB), ("512MiB", 512 * 2**20),
     ("1.5TiB", int(1.5 * 2**40)), ("4096", 4096), (1024, 1024), ("2kb", 2000),
     ("80e9", 80 * 10**9), ("1.41E11", 141 * 10**9)],  # configs/hardware spells bytes so
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "80XB", "-1GiB", "eighty", True])
def test_parse_memory_rejects(bad):
    with pytest.raises(ValueError, match="memory"):
        parse_memory(bad)


def _kvcalc_error(capsys, *argv: str) -> str:
    """kvcalc's stderr for bad input: one line, exit code 2, no traceback."""
    from launch.kvcalc import main as kvcalc

    assert kvcalc(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err.rstrip("\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["-ep", "0"], "expert_parallel_size must be >= 1, got 0"),
    (["-ep", "-4"], "expert_parallel_size must be >= 1, got -4"),
    (["-tp", "0"], "tensor_parallel_size must be >= 1, got 0"),
    (["-tp", "3"], "tensor_parallel_size 3 does not divide num_attention_heads 128"),  # MLA splits heads too
    (["--num-redundant-experts", "-1", "-ep", "8"], "num_redundant_experts must be >= 0, got -1"),
    (["--num-redundant-experts", "32"], "num_redundant_experts 32 needs expert parallelism (-ep N, N > 1): redundant "
                                        "slots are the balancer's replicas spread over the EP ranks"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1], got 0.0"),
    # fp8 weights, as its quantization_config says (kvcalc used to count them in bf16: 1.22 TiB)
    ([], "no room for the KV cache: the weights take 626.97 GiB per rank (tp=1) of 0.9 x 80.00 GiB = 72.00 GiB "
         "usable; KV needs 70,272 B per token (all layers) on top"),
])
def test_kvcalc_bad_sizes_are_one_line_exit_2(capsys, argv, message):
    assert _kvcalc_error(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--memory", "80GiB", *argv) == \
        f"error: kvcalc deepseek-ai/DeepSeek-V3: {message}"


def test_kvcalc_tp_must_divide_the_heads_for_gqa_too(capsys):
    assert _kvcalc_error(capsys, "--model", "mistralai/Mixtral-8x7B-v0.1", "-tp", "3") == \
        "error: kvcalc mistralai/Mixtral-8x7B-v0.1: tensor_parallel_size 3 does not divide num_attention_heads 32"


@pytest.mark.parametrize(("top", "kind"), [([1, 2], "a list"), ("DeepseekV3ForCausalLM", "a string")])
def test_kvcalc_config_json_that_is_not_an_object(tmp_path, capsys, top, kind):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(top))
    assert _kvcalc_error(capsys, "--model", str(path)) == \
        f"error: kvcalc {path}: {path} is not a model config.json: expected a JSON object, got {kind}"


@pytest.mark.parametrize(("change", "message"), [
    ({"num_attention_heads": 0}, "num_attention_heads must be positive, got 0"),
    ({"hidden_size": "abc"}, "config field 'hidden_size' must be an integer, got 'abc'"),
    ({"num_hidden_layers": 2.5}, "config field 'num_hidden_layers' must be an integer, got 2.5"),
])
def test_kvcalc_bad_config_fields(tmp_path, capsys, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MIX, **change}))
    assert _kvcalc_error(capsys, "--model", str(path)) == f"error: kvcalc {path}: {message}"


def test_kvcalc_accepts_an_architectures_string(tmp_path, capsys):
    from launch.kvcalc import main as kvcalc

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**V3, "architectures": "DeepseekV3ForCausalLM"}))
    assert kvcalc(["--model", str(path), "--memory", "141GiB", "-tp", "16", "-ep", "16", "--weight-dtype", "fp8",
                   "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["architecture"] == "deepseek_v3" and out["kv_bytes_per_token"] == 70_272


def test_kvcalc_prints_small_models_in_units_that_show_them(tiny_ckpt, capsys):
    """A tiny checkpoint's parameters, weights and a small budget read in K / MiB, not '0.00B' / '0.00 GiB'."""
    from launch.kvcalc import main as kvcalc

    assert kvcalc(["--model", str(tiny_ckpt), "--memory", "4MiB"]) == 0
    out = capsys.readouterr().out
    assert "K parameters" in out and "0.00B" not in out and "0.00 GiB" not in out
    lines = {line.split(":")[0]: line for line in out.splitlines()}
    assert lines["weights per rank"].endswith((" MiB", " KiB")) and lines["KV budget per rank"].endswith((" MiB", " KiB"))
    assert kvcalc(["--model", "mistralai/Mixtral-8x7B-v0.1", "-tp", "4", "-ep", "4"]) == 0
    out = capsys.readouterr().out
    assert "46.70B parameters" in out and "weights per rank: 22.12 GiB" in out
