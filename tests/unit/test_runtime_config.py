"""launch.config: strict loading, overrides, flags, and every file in configs/."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

from launch.config import (
    ConfigError,
    EngineConfig,
    ParallelConfig,
    RuntimeConfig,
    load_runtime_config,
)
from launch.config_args import add_runtime_args, runtime_config_from_args
from moe.config import ModelConfig
from moe.tiny import build_tiny_config, write_tiny_checkpoint
from tests.unit.hf_reference_configs import PRESET_MODELS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ALL_YAML = sorted(CONFIGS.glob("*.yaml"))
TINY_V3 = ModelConfig.from_hf(build_tiny_config("deepseek_v3"))
REPO = CONFIGS.parent
SHIPPED_MODEL = "launch/data/models/tiny-dsv3"


# configs/sweep-ep2-skew.yaml's checkpoint: make-tiny deepseek_v3 with these --override values
SKEWED_V3 = ModelConfig.from_hf({**build_tiny_config("deepseek_v3"), "hidden_size": 512,
                                 "moe_intermediate_size": 1024, "intermediate_size": 1024})


def _model_for(cfg: RuntimeConfig) -> ModelConfig:
    if cfg.model == SHIPPED_MODEL:
        return ModelConfig.from_hf(REPO / SHIPPED_MODEL)
    if "tiny-deepseek-v3" in cfg.model:
        return TINY_V3
    if cfg.model.endswith("skewed-dsv3"):
        return SKEWED_V3
    shipped = ModelConfig.from_hf(cfg.model, strict=False)  # released models resolve offline by name
    if cfg.model in PRESET_MODELS:
        assert shipped == ModelConfig.from_hf(PRESET_MODELS[cfg.model], strict=False)
    return shipped


def test_the_named_configs_exist():
    names = {p.name for p in ALL_YAML}
    assert {"tiny.yaml", "demo.yaml", "mixtral-8x7b-ep8.yaml", "deepseek-v3-prefill-ep32.yaml",
            "deepseek-v3-decode-ep144.yaml"} <= names


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.name)
def test_every_config_file_loads_and_fits_its_model(path):
    cfg = load_runtime_config(path)
    cfg.validate_for_model(_model_for(cfg))  # layout arithmetic against the model's sizes
    layout = cfg.parallel.layout()
    assert layout.world_size == cfg.parallel.world_size
    # Every key in the file survived (nothing silently defaulted): dump == file content.
    raw = yaml.safe_load(path.read_text())
    dumped = cfg.to_dict()
    for section, values in raw.items():
        if isinstance(values, dict):
            for k, v in values.items():
                assert dumped[section][k] == v, f"{path.name}: {section}.{k}"
    assert load_runtime_config(base=yaml.safe_load(cfg.to_yaml())) == cfg


def test_deepseek_presets_match_published_deployments():
    prefill = load_runtime_config(CONFIGS / "deepseek-v3-prefill-ep32.yaml")
    decode = load_runtime_config(CONFIGS / "deepseek-v3-decode-ep144.yaml")
    v3 = _model_for(prefill)
    for cfg, ep, nodes, slots_per_rank in ((prefill, 32, 4, 9), (decode, 144, 18, 2)):
        layout = cfg.parallel.layout()
        assert (layout.ep_size, layout.num_nodes, layout.ranks_per_node) == (ep, nodes, 8)
        assert cfg.balancer.num_redundant_experts == 32
        assert cfg.balancer.num_physical_experts(v3.num_experts) == slots_per_rank * ep
        assert cfg.engine.kv_cache_dtype == "fp8"
    mixtral = load_runtime_config(CONFIGS / "mixtral-8x7b-ep8.yaml")
    assert mixtral.balancer.num_physical_experts(8) // mixtral.parallel.expert_parallel_size == 2


def test_demo_config_rebalances_quickly_on_four_ep_ranks():
    demo = load_runtime_config(CONFIGS / "demo.yaml")
    assert demo.model == SHIPPED_MODEL  # the trained checkpoint, shipped in the repository
    p, b = demo.parallel, demo.balancer
    assert (p.tensor_parallel_size, p.data_parallel_size, p.enable_expert_parallel) == (1, 4, True)
    assert p.dispatch_backend == "alltoall"
    assert b.enable_eplb and b.num_redundant_experts > 0
    assert b.resolved_trigger == "forecast" and b.check_interval <= 50
    model = _model_for(demo)
    assert (model.num_experts + b.num_redundant_experts) % 4 == 0
    demo.validate_for_model(model)


def test_unknown_keys_name_the_dotted_key_and_suggest():
    with pytest.raises(ConfigError, match=r"'engine\.max_num_seq'.*did you mean 'engine\.max_num_seqs'"):
        RuntimeConfig.from_dict({"model": "m", "engine": {"max_num_seq": 4}})
    with pytest.raises(ConfigError, match=r"unknown config key 'block_size'.*'engine\.block_size'"):
        RuntimeConfig.from_dict({"model": "m", "block_size": 4})
    with pytest.raises(ConfigError, match=r"'balancer\.windows_size'.*'balancer\.window_size'"):
        RuntimeConfig.from_dict({"model": "m", "balancer": {"windows_size": 4}})
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'") as e:
        RuntimeConfig.from_dict({"model": "m", "zzz": 1})
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize(
    "data, match",
    [
        ({"engine": {"block_size": "16"}}, r"engine\.block_size: expected int, found str '16'"),
        ({"engine": {"block_size": True}}, r"engine\.block_size: expected int, found bool"),
        ({"engine": {"max_model_len": 1.5}}, r"engine\.max_model_len: expected int or null, found float"),
        ({"parallel": {"enable_expert_parallel": "yes"}}, r"parallel\.enable_expert_parallel: expected bool"),
        ({"server": 8000}, r"server: expected a mapping, found int"),
        ({"model_overrides": [1]}, r"model_overrides: expected mapping"),
        ({"model": 3}, r"model: expected str, found int"),
    ],
)
def test_wrong_types_name_key_expected_and_found(data, match):
    with pytest.raises(ConfigError, match=match):
        RuntimeConfig.from_dict({"model": "m", **data})


@pytest.mark.parametrize(
    "data, match",
    [
        ({"engine": {"dtype": "fp32"}}, "dtype must be one of"),
        ({"engine": {"kv_cache_dtype": "int4"}}, "kv_cache_dtype must be one of"),
        ({"engine": {"memory_utilization": 0.0}}, r"memory_utilization \(--gpu-memory-utilization, .*\) must be in \(0, 1\]"),
        ({"engine": {"memory_utilization": 1.5}}, r"memory_utilization \(--gpu-memory-utilization, .*\) must be in \(0, 1\]"),
        ({"engine": {"max_num_seqs": 0}}, "max_num_seqs must be >= 1"),
        ({"engine": {"memory": "8XB"}}, "unknown memory unit"),
        ({"engine": {"enable_chunked_prefill": False, "max_model_len": 4096, "max_num_batched_tokens": 2048}},
         "without chunked prefill"),
        ({"parallel": {"data_parallel_size": 3, "num_nodes": 2}}, "not divisible by num_nodes=2"),
        ({"parallel": {"placement_strategy": "pack"}}, "placement_strategy must be one of"),
        ({"parallel": {"all2all_backend": "deepep"}}, "all2all_backend must be one of"),
        ({"moe": {"capacity_scope": "node"}}, "capacity_scope"),
        ({"moe": {"capacity_overflow": "spill"}}, "capacity_overflow"),
        ({"balancer": {"enable_eplb": True}}, "needs parallel.enable_expert_parallel"),
        ({"balancer": {"num_redundant_experts": 4}}, "needs balancer.enable_eplb"),
        ({"server": {"port": 70000}}, "port must be in"),
        ({"model": ""}, "model must name"),
        ({"engine": {"max_cudagraph_capture_size": 0}}, "max_cudagraph_capture_size must be >= 1"),
    ],
)
def test_post_init_validation(data, match):
    with pytest.raises(ConfigError, match=match):
        RuntimeConfig.from_dict({"model": "m", **data})


def test_missing_model_and_frozen():
    with pytest.raises(ConfigError, match="missing required config key 'model'"):
        RuntimeConfig.from_dict({"engine": {}})
    cfg = RuntimeConfig.from_dict({"model": "m", "model_overrides": {"num_hidden_layers": 2}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine.block_size = 4  # type: ignore[misc]
    assert cfg.model_overrides == {"num_hidden_layers": 2}
    assert cfg.served_model_name == "m"


def test_float_fields_accept_ints_and_scientific_strings():
    cfg = RuntimeConfig.from_dict({"model": "m", "moe": {"capacity_factor": "1e-1"},
                                   "engine": {"memory_utilization": 1}})
    assert cfg.moe.capacity_factor == 0.1 and isinstance(cfg.engine.memory_utilization, float)


def test_set_overrides_parse_yaml_values():
    cfg = load_runtime_config(CONFIGS / "demo.yaml", overrides=[
        "engine.max_num_seqs=3", "engine.max_model_len=null", "server.api_key=secret",
        "model_overrides.num_hidden_layers=2", "balancer.log_balancedness=false",
    ])
    assert cfg.engine.max_num_seqs == 3 and cfg.engine.max_model_len is None
    assert cfg.server.api_key == "secret" and cfg.model_overrides == {"num_hidden_layers": 2}
    assert cfg.balancer.log_balancedness is False
    assert cfg.parallel.data_parallel_size == 4  # untouched file value kept
    with pytest.raises(ConfigError, match="expects key.sub=value"):
        load_runtime_config(CONFIGS / "demo.yaml", overrides=["engine.max_num_seqs"])
    with pytest.raises(ConfigError, match="'model' is not a section"):
        load_runtime_config(CONFIGS / "demo.yaml", overrides=["model.x=1"])
    with pytest.raises(ConfigError, match=r"'engine\.max_num_seq'"):
        load_runtime_config(CONFIGS / "demo.yaml", overrides=["engine.max_num_seq=1"])


def test_bad_files_raise_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_runtime_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml: top level must be a mapping"):
        load_runtime_config(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError) as bad:
        load_runtime_config(tmp_path / "bad.yaml")
    # one line: the file, where, what (not PyYAML's several lines naming "<unicode string>")
    assert str(bad.value) == (f"{tmp_path / 'bad.yaml'}:2:1: invalid YAML: expected ',' or ']', but got "
                              "'<stream end>' (while parsing a flow sequence)")
    (tmp_path / "dup.yaml").write_text("engine:\n  max_num_seqs: 4\n  max_num_seqs: 8\n")
    with pytest.raises(ConfigError) as dup:
        load_runtime_config(tmp_path / "dup.yaml")
    assert str(dup.value) == f"{tmp_path / 'dup.yaml'}:3:3: invalid YAML: key 'max_num_seqs' is given twice"
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        load_runtime_config(tmp_path)


def test_a_bad_hardware_file_is_one_line_naming_where(tmp_path):
    from launch.hardware import load_hardware

    (tmp_path / "hw.yaml").write_text("name: x\nflops: {bf16: 1e15\n")
    with pytest.raises(ValueError) as yaml_error:
        load_hardware(tmp_path / "hw.yaml")
    assert str(yaml_error.value).startswith(f"{tmp_path / 'hw.yaml'}:3:1: invalid YAML: expected ',' or '}}'")
    assert "\n" not in str(yaml_error.value)
    (tmp_path / "hw.json").write_text('{"name": "x",\n "flops": }')
    with pytest.raises(ValueError, match=r"hw.json:2:11: not JSON: Expecting value$"):
        load_hardware(tmp_path / "hw.json")


def _args(argv: list[str]) -> RuntimeConfig:
    parser = add_runtime_args(argparse.ArgumentParser())
    return runtime_config_from_args(parser.parse_args(argv))


def test_flags_override_set_which_overrides_file_which_overrides_defaults():
    demo = str(CONFIGS / "demo.yaml")
    assert _args(["--config", demo]).engine.max_num_seqs == 16  # file
    assert _args(["--config", demo, "--set", "engine.max_num_seqs=3"]).engine.max_num_seqs == 3
    cfg = _args(["--config", demo, "--set", "engine.max_num_seqs=3", "--max-num-seqs", "5"])
    assert cfg.engine.max_num_seqs == 5
    assert cfg.engine.block_size == 16 and cfg.engine.num_kv_blocks is None
    cfg = _args(["--model", "ck", "-tp", "2", "-dp", "2", "--enable-expert-parallel", "--no-enable-prefix-caching",
                 "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "fp8", "--dtype", "float32",
                 "--all2all-backend", "allgather_reducescatter", "--capacity-factor", "1.25", "--seed", "7"])
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.data_parallel_size) == (2, 2)
    assert cfg.parallel.expert_parallel_size == 4 and cfg.parallel.dispatch_backend == "allgather"
    assert cfg.engine.enable_prefix_caching is False and cfg.engine.memory_utilization == 0.5
    assert (cfg.engine.kv_cache_dtype, cfg.engine.dtype, cfg.engine.seed) == ("fp8", "float32", 7)
    assert cfg.moe.capacity_factor == 1.25
    assert _args(["--model", "ck"]) == RuntimeConfig(model="ck")  # no flag given: all defaults


def test_cuda_graph_flags():
    assert _args(["--model", "ck"]).engine.cudagraph_max_batch == 0  # off by default
    on = ["--model", "ck", "--cuda-graphs"]
    assert _args(on).engine.cudagraph_max_batch == 256  # min(max_num_seqs 256, 256)
    assert _args(on + ["--max-num-seqs", "12"]).engine.cudagraph_max_batch == 12
    cfg = _args(on + ["--max-cudagraph-capture-size", "64"])
    assert cfg.engine.max_cudagraph_capture_size == 64 and cfg.engine.cudagraph_max_batch == 64
    assert _args(on + ["--max-cudagraph-capture-size", "512", "--max-num-seqs", "300"]).engine.cudagraph_max_batch == 300
    cfg = _args(on + ["--enforce-eager"])  # vLLM's flag wins
    assert cfg.engine.enforce_eager is True and cfg.engine.cudagraph_max_batch == 0
    assert _args(on + ["--no-cuda-graphs"]).engine.cudagraph_max_batch == 0


def test_eplb_config_json_is_strict_and_flags_win():
    base = ["--model", "ck", "--enable-expert-parallel", "-dp", "4", "--enable-eplb"]
    cfg = _args(base + ["--eplb-config", '{"window_size": 50, "step_interval": 100, "num_redundant_experts": 4}',
                        "--num-redundant-experts", "8"])
    assert (cfg.balancer.window_size, cfg.balancer.step_interval) == (50, 100)
    assert cfg.balancer.num_redundant_experts == 8
    with pytest.raises(ConfigError, match=r"unknown --eplb-config key 'window'.*'window_size'"):
        _args(base + ["--eplb-config", '{"window": 50}'])
    with pytest.raises(ConfigError, match="not valid JSON"):
        _args(base + ["--eplb-config", "{window_size: 50}"])
    with pytest.raises(ConfigError, match="must be a JSON object"):
        _args(base + ["--eplb-config", "[1]"])
    with pytest.raises(ConfigError, match=r"balancer\.window_size: expected int, found str"):
        _args(base + ["--eplb-config", '{"window_size": "50"}'])


def test_unknown_flag_and_missing_model_error():
    parser = add_runtime_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "x", "--max-num-seq", "4", "--bogus"])
    with pytest.raises(ConfigError, match="--model"):
        runtime_config_from_args(parser.parse_args([]))


def test_model_path_checked_only_on_request(tmp_path):
    preset = load_runtime_config(CONFIGS / "deepseek-v3-prefill-ep32.yaml")  # not on disk: loads fine
    with pytest.raises(FileNotFoundError, match="DeepSeek-V3.*no such directory"):
        preset.check_model_path()
    ck = write_tiny_checkpoint("deepseek_v3", tmp_path / "ck")
    assert RuntimeConfig(model=str(ck)).check_model_path() == ck


def test_validate_for_model_reports_layout_problems():
    demo = load_runtime_config(CONFIGS / "demo.yaml")
    with pytest.raises(ValueError, match="not divisible by ep_size=4"):
        load_runtime_config(CONFIGS / "demo.yaml", overrides=["balancer.num_redundant_experts=3"]).validate_for_model(
            TINY_V3)
    with pytest.raises(ValueError, match="does not divide num_attention_heads"):
        dataclasses.replace(demo, parallel=ParallelConfig(tensor_parallel_size=3, enable_expert_parallel=True)
                            ).validate_for_model(TINY_V3)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        dataclasses.replace(demo, engine=EngineConfig(max_model_len=10**6)).validate_for_model(TINY_V3)


def test_the_engine_seed_is_an_int64_generator_seed_and_dp_ranks_wrap_within_it():
    from launch.core.sampler import Sampler, rank_seed

    assert EngineConfig(seed=2**63 - 1).seed == 2**63 - 1
    for bad in (-1, 2**63, 2**64):
        with pytest.raises(ValueError, match=rf"^seed must be in \[0, 2\*\*63 - 1\], got {bad}$"):
            EngineConfig(seed=bad)
    # DP rank r samples with seed + r, wrapping: every rank of an accepted seed gets a generator seed
    assert [rank_seed(7, r) for r in range(3)] == [7, 8, 9]
    assert [rank_seed(2**63 - 1, r) for r in range(3)] == [2**63 - 1, 0, 1]
    for r in range(3):
        Sampler(seed=rank_seed(2**63 - 2, r))


def test_vllm_value_spellings_are_taken_wherever_the_value_comes_from(tmp_path):
    # the flags took dtype half / float and kv_cache_dtype fp8_e4m3; --set and a nested file refused them
    assert (_args(["--model", "ck", "--dtype", "half"]).engine.dtype,
            _args(["--model", "ck", "--set", "engine.dtype=half"]).engine.dtype,
            _args(["--model", "ck", "--set", "engine.dtype=float"]).engine.dtype) == ("float16", "float16", "float32")
    assert _args(["--model", "ck", "--set", "engine.kv_cache_dtype=fp8_e4m3"]).engine.kv_cache_dtype == "fp8"
    nested = tmp_path / "nested.yaml"
    nested.write_text("model: ck\nengine: {dtype: half, kv_cache_dtype: fp8_e4m3}\n")
    engine = load_runtime_config(nested).engine
    assert (engine.dtype, engine.kv_cache_dtype) == ("float16", "fp8")
    assert EngineConfig(dtype="float") == EngineConfig(dtype="float32")
    from launch.llm import build_runtime_config  # LLM(dtype="half", ...) as vLLM spells it

    engine = build_runtime_config("ck", {"dtype": "half", "kv_cache_dtype": "fp8_e4m3"}).engine
    assert (engine.dtype, engine.kv_cache_dtype) == ("float16", "fp8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="double")
