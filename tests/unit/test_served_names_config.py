"""``--served-model-name`` takes several names, as vLLM's: the flag, a vLLM flat config file, our
nested YAML and ``--set`` all give ``ServerConfig.served_model_name`` one name or a list, and
``RuntimeConfig.served_model_names`` reads it as a tuple whose first name is the primary one."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from launch.config import RuntimeConfig, ServerConfig, load_runtime_config
from launch.config_args import add_runtime_args, runtime_config_from_args
from launch.config_schema import ConfigError


def _args(argv: list[str]) -> RuntimeConfig:
    return runtime_config_from_args(add_runtime_args(argparse.ArgumentParser()).parse_args(argv))


def test_the_flag_takes_several_names_in_order() -> None:
    cfg = _args(["--model", "/ckpt/m", "--served-model-name", "a", "b", "c"])
    assert cfg.server.served_model_name == ["a", "b", "c"]
    assert cfg.served_model_names == ("a", "b", "c")
    assert cfg.served_model_name == "a"  # the primary name: metrics label, logs, the demo's curl


def test_one_name_and_no_name_read_as_before() -> None:
    one = _args(["--model", "/ckpt/m", "--served-model-name", "tiny"])
    assert (one.server.served_model_name, one.served_model_names, one.served_model_name) == ("tiny", ("tiny",), "tiny")
    none = _args(["--model", "/ckpt/m"])
    assert (none.server.served_model_name, none.served_model_names) == (None, ("/ckpt/m",))


def test_a_vllm_flat_config_file_takes_a_list(tmp_path: Path) -> None:
    path = tmp_path / "vllm.yaml"
    path.write_text("model: ck\nserved-model-name: [a, b]\n")
    assert _args(["--config", str(path)]).served_model_names == ("a", "b")
    assert _args(["--config", str(path), "--served-model-name", "c"]).served_model_names == ("c",)  # flags win


def test_our_yaml_and_set_take_a_name_or_a_list(tmp_path: Path) -> None:
    path = tmp_path / "ours.yaml"
    path.write_text("model: ck\nserver: {served_model_name: [a, b]}\n")
    assert load_runtime_config(path).served_model_names == ("a", "b")
    assert load_runtime_config(path, overrides=["server.served_model_name=x"]).served_model_names == ("x",)
    assert load_runtime_config(path, overrides=["server.served_model_name=[x, y]"]).served_model_names == ("x", "y")
    assert _args(["--model", "ck", "--set", "server.served_model_name=x"]).served_model_names == ("x",)


def test_a_list_survives_the_printed_yaml() -> None:
    cfg = _args(["--model", "ck", "--served-model-name", "a", "b"])
    again = RuntimeConfig.from_dict(yaml.safe_load(cfg.to_yaml()))  # what `python -m launch config` prints
    assert again == cfg and again.served_model_names == ("a", "b")


@pytest.mark.parametrize("value,message", [
    ([], "served_model_name is an empty list"),
    (["a", " "], "served_model_name is empty"),
    (["a", "b", "a"], "served_model_name lists 'a' twice"),
    (["a", 3], "each name must be a string, found int 3"),
    (3, "must be a name or a list of names, found int 3"),
    ({"a": 1}, "must be a name or a list of names, found dict"),
])
def test_bad_names_are_refused_naming_the_key(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(served_model_name=value)
    with pytest.raises(ConfigError, match=f"^server: .*{message}"):
        RuntimeConfig.from_dict({"model": "ck", "server": {"served_model_name": value}})


def test_several_flag_names_with_a_repeat_are_refused() -> None:
    with pytest.raises(ConfigError, match="served_model_name lists 'b' twice"):
        _args(["--model", "ck", "--served-model-name", "a", "b", "b"])
