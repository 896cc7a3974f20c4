"""ModelConfig.from_hf: real published configs (sizes, KV bytes), family layer rules, errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moe.config import ModelConfig
from moe.model import MoEModel

DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=1,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
    first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
    max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"),
    quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                             weight_block_size=[128, 128]),
)
DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
    num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=False, scoring_func="softmax",
    max_position_embeddings=163840, rope_theta=10000, bos_token_id=100000, eos_token_id=100001,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707, mscale_all_dim=0.707,
                      original_max_position_embeddings=4096, type="yarn"),
)
MIXTRAL_8X7B = dict(
    architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, hidden_act="silu", torch_dtype="bfloat16",
)
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
    use_sliding_window=False, sliding_window=None, eos_token_id=151645, bos_token_id=151643,
)


def test_deepseek_v3_real_config() -> None:
    cfg = ModelConfig.from_hf(DEEPSEEK_V3)  # block-wise fp8 weights: dequantized at load
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        ModelConfig.from_hf(dict(DEEPSEEK_V3, quantization_config=dict(quant_method="gptq", bits=4)))
    assert cfg.attention == "mla" and cfg.kv_entry_shape == (576,)
    assert cfg.kv_bytes_per_token(2) == 70_272 and cfg.kv_bytes_per_token(1) == 35_136
    assert cfg.moe_layer_ids == tuple(range(3, 61)) and not cfg.is_moe_layer(2)
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts, cfg.num_shared_experts) == (8, 4, 256, 1)
    assert cfg.rope_interleave and cfg.rope_scaling.factor == 40 and cfg.softmax_scale == pytest.approx(0.1352, abs=1e-4)
    assert cfg.eos_token_ids == (1,) and cfg.dtype == "bfloat16" and cfg.head_dim == 192
    assert cfg.num_parameters() == pytest.approx(671e9, rel=2e-3)
    assert cfg.unsupported == ()


def test_mixtral_8x7b_real_config() -> None:
    cfg = ModelConfig.from_hf(MIXTRAL_8X7B)
    assert cfg.kv_bytes_per_token(2) == 131_072 and cfg.kv_entry_shape == (2, 8, 128)
    assert cfg.num_parameters() == 46_702_792_704
    assert cfg.moe_layer_ids == tuple(range(32)) and cfg.norm_topk_prob and cfg.rope_theta == 1e6
    assert cfg.moe_intermediate_size == 14336 and cfg.num_shared_experts == 0


def test_deepseek_v2_lite_and_qwen3_real_configs() -> None:
    lite = ModelConfig.from_hf(DEEPSEEK_V2_LITE)
    assert lite.q_lora_rank is None and lite.topk_method == "greedy" and lite.moe_layer_ids[0] == 1
    assert lite.num_parameters() == pytest.approx(15.7e9, rel=1e-2)
    assert lite.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    qwen = ModelConfig.from_hf(QWEN3_30B_A3B)
    assert qwen.head_dim == 128 and qwen.qk_norm and qwen.norm_topk_prob
    assert qwen.num_parameters() == pytest.approx(30.5e9, rel=5e-3)
    assert qwen.kv_bytes_per_token(2) == 48 * 2 * 4 * 128 * 2


def test_qwen3_dense_layer_rules() -> None:
    cfg = ModelConfig.from_hf(dict(QWEN3_30B_A3B, num_hidden_layers=8, mlp_only_layers=[0, 5], decoder_sparse_step=2))
    assert cfg.moe_layer_ids == (1, 3, 7)


def test_deepseek_moe_layer_freq() -> None:
    cfg = ModelConfig.from_hf(dict(DEEPSEEK_V2_LITE, num_hidden_layers=8, first_k_dense_replace=2, moe_layer_freq=2))
    assert cfg.moe_layer_ids == (2, 4, 6)
    differs = cfg.transformers_differs()  # transformers would give layers 2-7 experts: another model
    assert differs is not None and differs.startswith("moe_layer_freq=2: transformers ignores it")
    assert ModelConfig.from_hf(DEEPSEEK_V2_LITE).transformers_differs() is None
    assert ModelConfig.from_hf(MIXTRAL_8X7B).transformers_differs() is None


@pytest.mark.parametrize("change,match", [
    (dict(architectures=["LlamaForCausalLM"]), "unsupported architecture"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(sliding_window=0), "sliding_window"),  # a window is honoured; a non-positive one is not
    (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "rope type 'dynamic'"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e6)), "rope type 'longrope'"),
])
def test_unimplemented_values_raise_naming_them(change: dict, match: str) -> None:
    raw = dict(MIXTRAL_8X7B, **change)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(raw)
    if "architectures" not in change:
        assert ModelConfig.from_hf(raw, strict=False).unsupported


@pytest.mark.parametrize("change,match", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"),
])
def test_deepseek_v3_routing_variants_not_in_reference_raise(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(dict(DEEPSEEK_V3, quantization_config=None, **change))


def test_invalid_shapes_raise() -> None:
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_hf(dict(DEEPSEEK_V3, quantization_config=None, n_group=7))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf(dict(MIXTRAL_8X7B, num_experts_per_tok=9))
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        ModelConfig.from_hf({k: v for k, v in MIXTRAL_8X7B.items() if k != "hidden_size"})


def test_num_experts_per_tok_left_out_takes_transformers_default_and_swish_is_silu() -> None:
    """transformers' config classes default top-k (Mixtral 2, DeepSeek-V3 and Qwen3-MoE 8) and map
    hidden_act "swish" to SiLU; a sizes field (here the expert count) stays required."""
    def without(raw: dict, key: str) -> dict:
        return {k: v for k, v in raw.items() if k != key}

    v3 = dict(DEEPSEEK_V3, quantization_config=None)
    assert ModelConfig.from_hf(without(MIXTRAL_8X7B, "num_experts_per_tok")).num_experts_per_tok == 2
    assert ModelConfig.from_hf(without(v3, "num_experts_per_tok")).num_experts_per_tok == 8
    assert ModelConfig.from_hf(without(QWEN3_30B_A3B, "num_experts_per_tok")).num_experts_per_tok == 8
    with pytest.raises(ValueError, match="missing required field 'num_experts_per_tok'"):  # transformers: None
        ModelConfig.from_hf(without(DEEPSEEK_V2_LITE, "num_experts_per_tok"))
    with pytest.raises(ValueError, match="missing required field 'num_local_experts'"):
        ModelConfig.from_hf(without(MIXTRAL_8X7B, "num_local_experts"))
    assert ModelConfig.from_hf(dict(MIXTRAL_8X7B, hidden_act="swish")).hidden_act == "silu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf(dict(MIXTRAL_8X7B, hidden_act="gelu"))


def test_rope_pairs_are_checked_where_rope_turns_them() -> None:
    """MLA ropes only its qk_rope_head_dim part: an odd nope part (odd q/k head size) is a valid model,
    as transformers runs it; GQA ropes the whole head."""
    odd_nope = ModelConfig.from_hf(dict(DEEPSEEK_V2_LITE, qk_nope_head_dim=127))
    assert (odd_nope.head_dim, odd_nope.qk_rope_head_dim) == (191, 64)
    with pytest.raises(ValueError, match="qk_rope_head_dim 63 is odd: rotary dims must be even"):
        ModelConfig.from_hf(dict(DEEPSEEK_V2_LITE, qk_rope_head_dim=63))
    with pytest.raises(ValueError, match="head_dim 127 is odd: rotary dims must be even"):
        ModelConfig.from_hf(dict(QWEN3_30B_A3B, head_dim=127))


@pytest.mark.parametrize(("top", "kind"), [([1, 2], "a list"), ("x", "a string"), (7, "a number"), (None, "null")])
def test_config_json_that_is_not_an_object_is_named(tmp_path: Path, top: object, kind: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(top))
    for arg in (path, tmp_path):
        with pytest.raises(ValueError) as e:
            ModelConfig.from_hf(arg)
        assert str(e.value) == f"{path} is not a model config.json: expected a JSON object, got {kind}"


@pytest.mark.parametrize("base", [MIXTRAL_8X7B, QWEN3_30B_A3B, DEEPSEEK_V2_LITE], ids=["mixtral", "qwen3", "v2"])
def test_zero_heads_is_the_positive_error_not_a_division(base: dict) -> None:
    raw = {k: v for k, v in base.items() if k != "head_dim"}  # head_dim derived from hidden_size / heads
    with pytest.raises(ValueError, match=r"^num_attention_heads must be positive, got 0$"):
        ModelConfig.from_hf(dict(raw, num_attention_heads=0))


def test_a_single_architecture_string_is_a_one_element_list() -> None:
    assert ModelConfig.from_hf(dict(MIXTRAL_8X7B, architectures="MixtralForCausalLM")) == \
        ModelConfig.from_hf(MIXTRAL_8X7B)
    with pytest.raises(ValueError, match="'architectures' must be a list of class names, got 5"):
        ModelConfig.from_hf(dict(MIXTRAL_8X7B, architectures=5))


@pytest.mark.parametrize(("change", "message"), [
    (dict(hidden_size="abc"), "config field 'hidden_size' must be an integer, got 'abc'"),
    (dict(num_hidden_layers=2.5), "config field 'num_hidden_layers' must be an integer, got 2.5"),
    (dict(num_hidden_layers=True), "config field 'num_hidden_layers' must be an integer, got True"),
    (dict(num_local_experts="8"), "config field 'num_local_experts' must be an integer, got '8'"),
    (dict(head_dim=[128]), "config field 'head_dim' must be an integer, got [128]"),
    (dict(eos_token_id=[2, "x"]), "config field 'eos_token_id' must be an integer, got 'x'"),
    (dict(rms_norm_eps="tiny"), "config field 'rms_norm_eps' must be a number, got 'tiny'"),
])
def test_integer_fields_are_checked_and_named(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(dict(MIXTRAL_8X7B, **change))
    assert str(e.value) == message


def test_integral_floats_are_integers() -> None:
    cfg = ModelConfig.from_hf(dict(MIXTRAL_8X7B, num_hidden_layers=32.0, hidden_size=4096.0))
    assert cfg == ModelConfig.from_hf(MIXTRAL_8X7B) and type(cfg.num_hidden_layers) is int


def test_frozen_and_reads_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg == ModelConfig.from_hf(MIXTRAL_8X7B)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_hf(tmp_path / "missing")


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe"])
def test_tiny_checkpoints_agree_with_transformers(hf_checkpoints: dict[str, Path], family: str) -> None:
    import transformers

    path = hf_checkpoints[family]
    cfg = ModelConfig.from_hf(path)
    hf = transformers.AutoConfig.from_pretrained(path)
    assert cfg.architecture == family and cfg.num_hidden_layers == hf.num_hidden_layers
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    hf_moe = transformers.AutoModelForCausalLM.from_config(hf)
    expected = tuple(i for i, layer in enumerate(hf_moe.model.layers) if hasattr(layer.mlp, "experts"))
    assert cfg.moe_layer_ids == expected
    model = MoEModel(cfg, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


FAMILIES = {"deepseek_v3": DEEPSEEK_V3, "deepseek_v2": DEEPSEEK_V2_LITE, "mixtral": MIXTRAL_8X7B,
            "qwen3_moe": dict(QWEN3_30B_A3B, use_sliding_window=True)}
OUR_NAMES = {"n_shared_experts": "num_shared_experts"}


@pytest.mark.parametrize(("family", "key"), [
    ("deepseek_v3", "n_shared_experts"), ("deepseek_v3", "n_group"), ("deepseek_v3", "topk_group"),
    ("deepseek_v3", "q_lora_rank"), ("deepseek_v3", "max_position_embeddings"),
    ("deepseek_v2", "n_shared_experts"), ("deepseek_v2", "q_lora_rank"), ("deepseek_v2", "max_position_embeddings"),
    ("mixtral", "num_key_value_heads"), ("mixtral", "max_position_embeddings"),
    ("qwen3_moe", "max_position_embeddings"), ("qwen3_moe", "sliding_window"),
])
def test_a_field_left_out_takes_transformers_default(tmp_path: Path, family: str, key: str) -> None:
    """The checkpoint was shaped by transformers' defaults: a DeepSeek-V3 config without
    n_shared_experts has one shared expert (it was read as none, silently dropping its weights)."""
    import transformers

    raw = {k: v for k, v in FAMILIES[family].items() if k != key}
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, model_type=family)))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_hf(raw, strict=False)
    assert getattr(ours, OUR_NAMES.get(key, key)) == getattr(hf, key)


def test_null_keeps_its_meaning_where_transformers_gives_one() -> None:
    """null q_lora_rank is V2-Lite's "no q compression"; null kv heads is one per query head."""
    assert ModelConfig.from_hf(DEEPSEEK_V2_LITE).q_lora_rank is None
    assert ModelConfig.from_hf(dict(MIXTRAL_8X7B, num_key_value_heads=None)).num_key_value_heads == 32


@pytest.mark.parametrize("key", ["tie_word_embeddings", "norm_topk_prob", "use_sliding_window", "attention_bias"])
@pytest.mark.parametrize("value", ["false", 0, 1, "yes"])
def test_booleans_must_be_json_booleans(key: str, value: object) -> None:
    """The string "false" is truthy: it tied the lm head, renormalised, windowed; now refused."""
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(dict(QWEN3_30B_A3B, **{key: value}))
    assert str(e.value) == f"config field {key!r} must be true or false, got {value!r}"
    absent = {k: v for k, v in QWEN3_30B_A3B.items() if k != key}
    assert ModelConfig.from_hf(dict(QWEN3_30B_A3B, **{key: None})) == ModelConfig.from_hf(absent)


@pytest.mark.parametrize(("raw", "match"), [
    (dict(MIXTRAL_8X7B, rms_norm_eps=-1), "rms_norm_eps must be positive, got -1"),
    (dict(MIXTRAL_8X7B, rms_norm_eps=0), "rms_norm_eps must be positive"),
    (dict(QWEN3_30B_A3B, decoder_sparse_step=0), "decoder_sparse_step must be >= 1, got 1 and 0"),
    (dict(DEEPSEEK_V2_LITE, moe_layer_freq=0), "must be >= 1, got 0 and 1"),
    (dict(DEEPSEEK_V2_LITE, num_hidden_layers=3, first_k_dense_replace=3),
     r"no MoE layer: first_k_dense_replace=3, moe_layer_freq=1 leave all 3 layers dense"),
    (dict(QWEN3_30B_A3B, num_hidden_layers=2, mlp_only_layers=[0, 1]),
     r"no MoE layer: mlp_only_layers=\[0, 1\], decoder_sparse_step=1 leave all 2 layers"),
])
def test_values_transformers_would_compute_nonsense_or_crash_on(raw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(raw)
