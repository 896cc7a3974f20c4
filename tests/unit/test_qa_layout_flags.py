"""Layout tools on odd input: flags one form of ``simulate`` would ignore, KV blocks that do not
fit beside the weights, EP sizes no runtime layout has (kvcalc), calibrate flags checked
before anything is measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import calibrate as calibrate_module
from launch.kvcalc import main as kvcalc
from launch.simulate import main as simulate

ROOT = Path(__file__).resolve().parents[2]
SEARCH = ["--search", "--model", "mistralai/Mixtral-8x7B-v0.1", "--cluster", "1x8xH100", "--no-progress"]
CONFIG = ["--config", str(ROOT / "configs/mixtral-8x7b-ep8.yaml"), "--hardware", "h100"]


def _one_line_error(capsys) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


@pytest.mark.parametrize(("extra", "message"), [
    (["--batch-size", "4"], "--batch-size applies only to a --config prediction; the search finds the largest batch"),
    (["--kv-len", "100"], "--kv-len applies only to a --config prediction; the search decodes at input + output / 2"),
    (["--expert-load", "/no/such/load.npy"], "--expert-load applies only to a --config prediction; the search "
                                             "takes a synthetic --load-skew"),
    (["--hardware", "h200"], "--hardware applies only to a --config prediction; the hardware is the last part of "
                             "--cluster"),
    (["--set", "engine.max_num_seqs=4"], "--set applies only to a --config prediction"),
    (["--two-batch-overlap"], "--two-batch-overlap applies only to a --config prediction; the search tries"),
    (["--config", "configs/mixtral-8x7b-ep8.yaml"], "--config applies only to a --config prediction; give the "
                                                    "runtime config as --model"),
])
def test_search_refuses_flags_it_would_ignore(capsys, extra, message):
    assert simulate([*SEARCH, *extra]) == 2
    assert _one_line_error(capsys).startswith(f"error: simulate: {message}")


@pytest.mark.parametrize(("extra", "message"), [
    (["--cluster", "1x8xH100"], "--cluster applies only to a --search"),
    (["--slo", "tpot_ms=50"], "--slo applies only to a --search"),
    (["--top", "3"], "--top applies only to a --search"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype applies only to a --search; the config's is "
                                  "engine.kv_cache_dtype: --set engine.kv_cache_dtype=fp8"),
])
def test_config_prediction_refuses_search_flags(capsys, extra, message):
    assert simulate([*CONFIG, *extra]) == 2
    assert _one_line_error(capsys) == f"error: simulate: {message}"


def test_search_defaults_still_apply_when_the_flags_are_left_out(capsys):
    assert simulate([*SEARCH, "--slo", "tpot_ms=50"]) == 0
    out = capsys.readouterr().out
    assert out.count(" output tok/s per GPU ") == 5  # --top 5
    assert simulate([*SEARCH, "--slo", "tpot_ms=50", "--kv-cache-dtype", "auto", "--top", "1"]) == 0
    assert capsys.readouterr().out.count(" output tok/s per GPU ") == 1


def test_fixed_kv_blocks_next_to_weights_that_do_not_fit_are_refused(capsys):
    """tiny.yaml fixes num_kv_blocks (1,024 tokens): DeepSeek-V3's 671B fp8 weights on one H100
    rank leave no room for them, whatever the sequence length."""
    argv = ["--config", str(ROOT / "configs/tiny.yaml"), "--hardware", "h100", "--model", "deepseek-ai/DeepSeek-V3",
            "--input-len", "100", "--output-len", "10"]
    assert simulate(argv) == 2
    line = _one_line_error(capsys)
    assert line.startswith("error: simulate: TP1 DP1 EP1 1 node(s) on H100: the weights take 630.42 GiB per rank "
                           "and engine.num_kv_blocks holds ")
    assert "over the 0.9 x 74.51 GiB = 67.06 GiB usable" in line


def test_fixed_kv_blocks_that_fit_still_predict(capsys):
    argv = ["--config", str(ROOT / "configs/tiny.yaml"), "--hardware", "h100", "--model", "Qwen/Qwen3-30B-A3B",
            "--input-len", "100", "--output-len", "10", "--set", "parallel.data_parallel_size=8",
            "--set", "parallel.enable_expert_parallel=true"]
    assert simulate(argv) == 0
    assert "KV capacity per rank: 1,024 tokens" in capsys.readouterr().out


@pytest.mark.parametrize(("ep", "tp", "nearest"), [("2", "4", "4"), ("3", "2", "2 or 4"), ("6", "4", "4 or 8")])
def test_kvcalc_ep_must_be_a_multiple_of_tp(capsys, ep, tp, nearest):
    """The runtime spreads experts over all tp x dp ranks: -ep 2 -tp 4 has no layout (it used to
    report weights for 2 EP ranks of 4 TP ranks), -ep 3 -tp 2 named a world size never given."""
    assert kvcalc(["--model", "mistralai/Mixtral-8x7B-v0.1", "-ep", ep, "-tp", tp]) == 2
    assert _one_line_error(capsys) == (
        f"error: kvcalc mistralai/Mixtral-8x7B-v0.1: expert_parallel_size {ep} is not a multiple of "
        f"tensor_parallel_size {tp}: experts are spread over all tp x dp ranks, so ep is tp x dp (the nearest: "
        f"{nearest})")


def test_kvcalc_ep_over_tp_ranks_counts_dp_groups(capsys):
    """-ep 8 -tp 2: 4 DP groups of 2 TP ranks, each rank with 1 of the 8 experts and half the dense weights."""
    assert kvcalc(["--model", "mistralai/Mixtral-8x7B-v0.1", "-ep", "8", "-tp", "2", "--json"]) == 0
    import json

    from moe.config import ModelConfig
    from parallel.costmodel import Deployment, weight_bytes_per_rank

    report = json.loads(capsys.readouterr().out)
    cfg = ModelConfig.from_hf("mistralai/Mixtral-8x7B-v0.1", strict=False)
    assert report["weight_bytes_per_rank"] == weight_bytes_per_rank(cfg, Deployment(tp=2, dp=4, ep=8))


@pytest.fixture
def no_measuring(monkeypatch):
    def measured(**kwargs):
        raise AssertionError("calibrate measured before refusing a bad flag")

    monkeypatch.setattr(calibrate_module, "calibrate", measured)


@pytest.mark.parametrize(("argv", "message"), [
    (["--dtypes", "float32,fp64"], "--dtypes: unknown dtype(s) ['fp64']; expected a comma-separated list of float32, "
                                   "bfloat16, float16"),
    (["--model", "/no/such/checkpoint"], "--model /no/such/checkpoint does not exist: expected a checkpoint "
                                         "directory (config.json and *.safetensors)"),
    (["--model", "deepseek-ai/DeepSeek-V3"], "--model deepseek-ai/DeepSeek-V3 does not exist: expected a checkpoint "
                                             "directory"),
])
def test_calibrate_refuses_bad_dtypes_and_models_before_measuring(tmp_path, capsys, no_measuring, argv, message):
    out = tmp_path / "hw.yaml"
    assert calibrate_module.main(["--out", str(out), "--nprocs", "", *argv]) == 2
    assert _one_line_error(capsys).startswith(f"error: simulate calibrate: {message}")
    assert not out.exists()


def test_calibrate_refuses_a_model_dir_without_weights(tmp_path, capsys, no_measuring):
    """A config.json alone (here Mixtral-8x7B's) cannot be timed: the engine would build the model."""
    model = tmp_path / "mixtral"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "configs/models/mixtral-8x7b.json").read_text())
    assert calibrate_module.main(["--out", str(tmp_path / "hw.yaml"), "--model", str(model)]) == 2
    assert _one_line_error(capsys).startswith(f"error: simulate calibrate: --model {model}: no *.safetensors weights")


@pytest.mark.parametrize(("argv", "message"), [
    ([*CONFIG, "--input-len", "100000"], "--input-len 100,000 + --output-len 500 = 100,500 tokens per sequence exceed "
                                         "engine.max_model_len 32,768"),
    ([*CONFIG, "--kv-len", "40000"], "--kv-len 40,000 exceeds engine.max_model_len 32,768"),
    (["--search", "--model", "deepseek-ai/DeepSeek-V3", "--cluster", "1x8xH100", "--input-len", "200000"],
     "--input-len 200,000 + --output-len 500 = 200,500 tokens per sequence exceed the model's "
     "max_position_embeddings 163,840"),
    (["--search", "--model", str(ROOT / "configs/mixtral-8x7b-ep8.yaml"), "--cluster", "1x8xH100", "--input-len",
      "40000"], "--input-len 40,000 + --output-len 500 = 40,500 tokens per sequence exceed engine.max_model_len 32,768"),
])
def test_sequences_longer_than_the_engine_takes_are_refused(capsys, argv, message):
    """A 100k-token prompt on a max_model_len 32k config used to be predicted (batch 3 at 100,250 context)."""
    assert simulate(argv) == 2
    assert _one_line_error(capsys) == f"error: simulate: {message}"
