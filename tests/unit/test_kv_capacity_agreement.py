"""``kvcalc`` and ``simulate`` report one KV capacity for one model, hardware and layout.

Both CLIs are run on the same runtime config (models x layouts x hardware) and must agree on
the tokens, and the blocks, one rank holds, or both refuse the layout for want of room. The
matrix covers what used to differ: fp8 weights from ``quantization_config`` (simulate read it,
kvcalc did not), routed experts under TP without EP (kvcalc split them over TP, the runtime
and simulate keep all of them on every rank), the compute dtype "auto" of a float32
checkpoint (kvcalc took bfloat16), ``model_overrides`` (kvcalc ignored them), and the
hardware's memory (kvcalc's own "80GiB" against the h100 spec's 80e9 bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launch.hardware import load_hardware
from launch.kvcalc import main as kvcalc
from launch.simulate import main as simulate

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "launch/data/models/tiny-dsv3")

MODELS = {  # name: (model, model_overrides, engine.kv_cache_dtype)
    "deepseek-v3-fp8": ("deepseek-ai/DeepSeek-V3", {}, "fp8"),  # quantization_config fp8: 1 B weights
    "deepseek-v3-bf16": ("deepseek-ai/DeepSeek-V3", {"quantization_config": None}, "fp8"),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", {}, "auto"),  # MLA, bf16 cache
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", {}, "auto"),  # GQA 8 KV heads
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", {}, "fp8"),  # GQA 4 KV heads: replicated at TP8
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", {}, "auto"),
    "tiny-dsv3-float32": (TINY, {}, "auto"),  # engine.dtype auto -> the checkpoint's float32
}
LAYOUTS = {  # name: (tp, dp, enable_expert_parallel, num_nodes, num_redundant_experts)
    "tp1": (1, 1, False, 1, 0),
    "tp4": (4, 1, False, 1, 0),  # experts not spread: every rank holds all of them
    "tp8": (8, 1, False, 1, 0),  # Qwen3: 4 KV heads replicated over 8 ranks
    "dp8": (1, 8, False, 1, 0),
    "dp8-ep8": (1, 8, True, 1, 0),
    "tp2-dp4-ep8": (2, 4, True, 1, 0),
    "dp8-ep8-2nodes-redundant": (1, 8, True, 2, 8),
}
HARDWARE = ("h100", "h200")
MATRIX = [(m, la, hw) for m in MODELS for la in LAYOUTS for hw in HARDWARE
          if (m, la) != ("tiny-dsv3-float32", "tp8")]  # its 4 attention heads do not split over 8


def _runtime_config(tmp_path: Path, model: str, layout: str, engine: dict | None = None) -> Path:
    name, overrides, kv_dtype = MODELS[model]
    tp, dp, ep, nodes, redundant = LAYOUTS[layout]
    cfg = {"model": name, "model_overrides": overrides,
           "parallel": {"tensor_parallel_size": tp, "data_parallel_size": dp, "enable_expert_parallel": ep,
                        "num_nodes": nodes},
           "balancer": {"enable_eplb": redundant > 0, "num_redundant_experts": redundant},
           "engine": {"dtype": "auto", "kv_cache_dtype": kv_dtype, "max_model_len": 256, "block_size": 16,
                      **(engine or {})}}
    path = tmp_path / f"{model}-{layout}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _kvcalc(capsys, *argv: str) -> dict | str:
    """kvcalc's JSON report, or its one-line error."""
    rc = kvcalc([*argv, "--json"])
    out = capsys.readouterr()
    return json.loads(out.out) if rc == 0 else out.err.strip()


def _simulate(capsys, tmp_path: Path, config: Path, hardware: str) -> dict | str:
    """simulate's JSON report, or its one-line error."""
    report = tmp_path / "simulate.json"
    rc = simulate(["--config", str(config), "--hardware", hardware, "--input-len", "100", "--output-len", "10",
                   "--json", str(report)])
    out = capsys.readouterr()
    return json.loads(report.read_text()) if rc == 0 else out.err.strip()


def _assert_same_capacity(k: dict | str, s: dict | str) -> None:
    if isinstance(k, str) or isinstance(s, str):  # a refusal: both, in the same words
        assert isinstance(k, str) and "no room for the KV cache: the weights take" in k, (k, s)
        assert isinstance(s, str) and k[k.index("no room"):] in s, (k, s)
        return
    # whole blocks, as the engine allocates them; kvcalc's max_num_tokens is the budget before rounding
    assert k["kv_capacity_tokens"] == s["kv_capacity_tokens"] == k["num_blocks"] * k["block_size"]
    assert k["num_blocks"] == s["kv_blocks"] == s["kv_capacity_tokens"] // s["block_size"]
    assert 0 <= k["max_num_tokens"] - k["kv_capacity_tokens"] < k["block_size"]


@pytest.mark.parametrize(("model", "layout", "hardware"), MATRIX)
def test_kvcalc_and_simulate_size_the_same_kv_cache(tmp_path, capsys, model, layout, hardware):
    """kvcalc is given the hardware's memory_bytes as --memory (a flag it has always taken)."""
    config = _runtime_config(tmp_path, model, layout)
    memory = str(load_hardware(hardware).memory_bytes)
    _assert_same_capacity(_kvcalc(capsys, "--model", str(config), "--memory", memory),
                          _simulate(capsys, tmp_path, config, hardware))


@pytest.mark.parametrize("model", ["deepseek-v3-fp8", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_kvcalc_default_memory_is_the_h100_spec_simulate_reads(tmp_path, capsys, model):
    """kvcalc without --memory / --hardware used to size 80 GiB (85.9e9 B); simulate --hardware h100
    reads the spec's memory_bytes (80e9 B). Both now read the spec."""
    config = _runtime_config(tmp_path, model, "dp8-ep8")
    _assert_same_capacity(_kvcalc(capsys, "--model", str(config)), _simulate(capsys, tmp_path, config, "h100"))


@pytest.mark.parametrize("hardware", HARDWARE)
def test_kvcalc_hardware_flag_is_simulates_hardware(tmp_path, capsys, hardware):
    config = _runtime_config(tmp_path, "qwen3-30b-a3b", "tp2-dp4-ep8")
    _assert_same_capacity(_kvcalc(capsys, "--model", str(config), "--hardware", hardware),
                          _simulate(capsys, tmp_path, config, hardware))


@pytest.mark.parametrize("memory", ["80GiB", "80GB", "96e9"])
def test_engine_memory_and_utilization_are_read_by_both(tmp_path, capsys, memory):
    """A config's engine.memory (a unit string) and memory_utilization win over the hardware's, in both."""
    config = _runtime_config(tmp_path, "mixtral-8x7b", "dp8-ep8", {"memory": memory, "memory_utilization": 0.8})
    k = _kvcalc(capsys, "--model", str(config))
    _assert_same_capacity(k, _simulate(capsys, tmp_path, config, "h100"))
    assert k["memory_utilization"] == 0.8


def test_kvcalc_reads_fp8_weights_from_quantization_config(capsys):
    """DeepSeek-V3's released checkpoint is fp8 (quantization_config): 1 B per weight unless told otherwise."""
    fp8 = _kvcalc(capsys, "--model", "deepseek-ai/DeepSeek-V3", "-ep", "8", "--hardware", "h200")
    bf16 = _kvcalc(capsys, "--model", "deepseek-ai/DeepSeek-V3", "-ep", "8", "--hardware", "h200",
                   "--weight-dtype", "bfloat16")
    assert fp8["weight_dtype"] == "fp8" and isinstance(bf16, str) and "no room for the KV cache" in bf16


@pytest.mark.parametrize("layout", ["tp1", "dp8", "dp8-ep8", "tp2-dp4-ep8", "dp8-ep8-2nodes-redundant"])
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_the_engine_allocates_the_blocks_kvcalc_reports(tmp_path, capsys, layout, dtype):
    """The engine's KV blocks per rank (``compute_num_kv_blocks``, before its max_num_seqs cap) are
    kvcalc's for the same config: it used to split every weight over TP and ignore expert
    parallelism (a rank of dp8-ep8 then counted all 64 routed experts where it holds 8)."""
    from launch.config import load_runtime_config
    from launch.engine import compute_num_kv_blocks
    from moe.config import ModelConfig

    engine = {"memory": "32MiB", "max_num_seqs": 4096, "dtype": dtype}
    config = _runtime_config(tmp_path, "tiny-dsv3-float32", layout, engine)
    k = _kvcalc(capsys, "--model", str(config))
    runtime = load_runtime_config(str(config))
    blocks = compute_num_kv_blocks(runtime, ModelConfig.from_hf(TINY, strict=False), 256)
    assert blocks == k["num_blocks"] > 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_weight_bytes_per_rank_are_a_sharded_models_bytes(tmp_path, arch, tp, ep):
    """The capacity's weights are what a rank of this runtime holds: a model built with the rank's
    expert slots and sharded over TP (``shard_for_tp``), every parameter and persistent buffer
    counted. The cost model used to split embeddings, lm_head and shared experts over TP, which
    this runtime keeps whole on every rank (KV blocks the memory could not hold)."""
    import torch

    from moe.config import ModelConfig
    from moe.model import MoEModel
    from moe.tiny import write_tiny_checkpoint
    from parallel.costmodel import Deployment, weight_bytes_per_rank

    write_tiny_checkpoint(arch, tmp_path / arch, size="tiny", seed=0)
    cfg = ModelConfig.from_hf(tmp_path / arch)
    slots = [e for e in range(cfg.num_experts) if e % ep == 0]  # rank 0's share: E / ep slots
    model = MoEModel(cfg, dtype=torch.bfloat16, local_slots=slots if ep > 1 else None)
    model.shard_for_tp(0, tp)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert weight_bytes_per_rank(cfg, Deployment(tp=tp, dp=ep // tp if ep >= tp else 1, ep=ep)) == held


def test_the_engine_refuses_a_block_size_not_one_block_of_which_fits_as_kvcalc_does(tmp_path, capsys):
    """A block size whose one block the budget cannot hold beside the weights: the engine's plan is
    refused in kvcalc's words (it planned one block over the budget before)."""
    from launch.config import RuntimeConfig
    from launch.engine import check_runtime_config
    from launch.workloads import SHIPPED_MODEL

    config = RuntimeConfig.from_dict({"model": str(SHIPPED_MODEL), "engine": {"memory": "512MiB",
                                                                              "block_size": 1_000_000}})
    with pytest.raises(ValueError, match=r"^no room for one KV block: a block of 1,000,000 tokens takes") as e:
        check_runtime_config(config)
    assert kvcalc(["--model", str(SHIPPED_MODEL), "--memory", "512MiB", "--block-size", "1000000"]) == 2
    assert str(e.value) in capsys.readouterr().err


def test_a_statistics_window_the_host_cannot_hold_is_refused_before_anything_starts(capsys):
    """balancer.window_size keeps window x L x (8 P + 4 E) bytes on the driver: over half the host's
    memory it is a one-line error from `launch config` and the engine's plan (serve crashed with an
    allocator traceback after Ray had started), after the weights' own check; a window that fits passes."""
    from launch.config import RuntimeConfig, window_memory_problem
    from launch.config_args import main as config_main
    from launch.workloads import SHIPPED_MODEL

    assert window_memory_problem(1000, 58, 256, 288, host_bytes=64 * 2**30) is None  # DeepSeek-V3: 193 MB
    problem = window_memory_problem(10**6, 58, 256, 288, host_bytes=64 * 2**30)
    assert problem.startswith("balancer.window_size=1,000,000 keeps 179.8 GiB of routing statistics")
    assert problem.endswith("over half of this host's 64.0 GiB: at most 178,007 steps")
    assert window_memory_problem(10**12, 0, 8, 8, host_bytes=2**30) is None  # no MoE layers: no window
    flags = ["--model", str(SHIPPED_MODEL), "-dp", "2", "--enable-expert-parallel", "--enable-eplb"]
    assert config_main([*flags, "--eplb-config", '{"window_size": 99999999999}']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "balancer.window_size=99,999,999,999 keeps" in err
    from launch.engine import check_runtime_config

    too_long = {"model": str(SHIPPED_MODEL), "engine": {"memory": "512MiB"}, "balancer": {"window_size": 10**11}}
    with pytest.raises(ValueError, match=r"^balancer.window_size=100,000,000,000 keeps"):
        check_runtime_config(RuntimeConfig.from_dict(too_long))  # serve's and generate's plan, before Ray
    check_runtime_config(RuntimeConfig.from_dict({**too_long, "balancer": {"window_size": 5000}}))
