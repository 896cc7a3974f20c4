"""Bad values of the layout/capacity flags and Ctrl-C, as a ``generate`` / ``serve`` user meets them:
a non-finite capacity factor is refused in one line (NaN compared false everywhere and ran
silently dropless; inf ran as if capacity-bounded), and Ctrl-C ends a command with one line and
status 130 instead of a KeyboardInterrupt traceback; a ``-tp`` that cannot split the dense MLP
layers' intermediate columns is refused from the config, before Ray starts (it failed in every
worker's setup, exit 1, after the cluster came up)."""

from __future__ import annotations

import argparse
import math

import pytest

from launch.config import MoEConfig, ParallelConfig, RuntimeConfig
from launch.config_args import add_runtime_args, runtime_config_from_args
from launch.config_schema import ConfigError
from moe.capacity import CapacityConfig
from moe.config import ModelConfig
from moe.tiny import build_tiny_config


def _model(arch: str, **fields) -> ModelConfig:
    return ModelConfig.from_hf({**build_tiny_config(arch), **fields})


@pytest.mark.parametrize("cf", [math.nan, math.inf, -math.inf])
def test_non_finite_capacity_factor_is_refused(cf: float) -> None:
    with pytest.raises(ValueError, match=r"capacity_factor must be a finite number"):
        CapacityConfig(capacity_factor=cf)
    with pytest.raises(ValueError, match=r"capacity_factor must be a finite number"):
        MoEConfig(capacity_factor=cf)


@pytest.mark.parametrize("flag", ["nan", "inf", "--capacity-factor=-inf"])
def test_capacity_factor_flag_non_finite_is_a_config_error(flag: str) -> None:
    argv = ["--model", "m", flag] if flag.startswith("--") else ["--model", "m", "--capacity-factor", flag]
    args = add_runtime_args(argparse.ArgumentParser()).parse_args(argv)
    with pytest.raises(ConfigError, match=r"moe: capacity_factor must be a finite number"):
        runtime_config_from_args(args)


def test_finite_capacity_factors_still_work() -> None:
    assert not CapacityConfig(capacity_factor=-1.0).enabled  # <= 0: dropless, as documented
    assert CapacityConfig(capacity_factor=1.25).enabled


@pytest.fixture
def interrupted_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    import launch.generate

    def interrupt(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch.generate, "main", interrupt)
    monkeypatch.delenv("MOE_TRACEBACK", raising=False)


def test_ctrl_c_is_one_line_and_status_130(interrupted_generate, capsys: pytest.CaptureFixture) -> None:
    from launch.cli import main

    assert main(["generate", "--model", "m", "--input", "i", "--output", "o"]) == 130  # 128 + SIGINT
    err = capsys.readouterr().err
    assert err == "interrupted\n"


def test_ctrl_c_traceback_on_request(interrupted_generate, monkeypatch: pytest.MonkeyPatch) -> None:
    from launch.cli import main

    monkeypatch.setenv("MOE_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        main(["generate", "--model", "m", "--input", "i", "--output", "o"])


@pytest.mark.parametrize("arch,fields", [
    ("deepseek_v3", {"intermediate_size": 90}),  # first_k_dense_replace=1: layer 0 is dense
    ("qwen3_moe", {"intermediate_size": 90, "mlp_only_layers": [0]}),
])
def test_tp_must_divide_the_dense_mlp_before_ray(arch: str, fields: dict) -> None:
    model = _model(arch, **fields)
    assert model.moe_layer_ids != tuple(range(model.num_hidden_layers))  # has a dense layer
    assert model.tensor_parallel_problem(2) is None
    assert "does not divide intermediate_size 90 of the dense MLP layers" in model.tensor_parallel_problem(4)
    config = RuntimeConfig(model="m", parallel=ParallelConfig(tensor_parallel_size=4))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide intermediate_size 90"):
        config.validate_for_model(model)


@pytest.mark.parametrize("arch,fields", [
    ("mixtral", {"intermediate_size": 90}),  # every layer MoE: experts are not split by TP
    ("qwen3_moe", {"intermediate_size": 90, "mlp_only_layers": []}),
    ("deepseek_v3", {"moe_intermediate_size": 30}),  # routed and shared experts: TP splits tokens
])
def test_tp_ignores_intermediate_sizes_it_does_not_split(arch: str, fields: dict) -> None:
    assert _model(arch, **fields).tensor_parallel_problem(4) is None
