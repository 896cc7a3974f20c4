"""launch.generation_config: requests' default sampling parameters from generation_config.json,
as vLLM's --generation-config / --override-generation-config take them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from launch.config import EngineConfig
from launch.config_args import add_runtime_args, runtime_config_from_args
from launch.generation_config import GenerationConfigError, default_sampling_fields, describe_defaults


def _write(folder: Path, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


def test_auto_reads_the_six_sampling_keys_and_nothing_else(tmp_path: Path) -> None:
    model = _write(tmp_path / "m", {"bos_token_id": 0, "eos_token_id": [1, 2], "do_sample": True, "temperature": 0.6,
                                    "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
                                    "max_new_tokens": 512, "max_length": 100, "typical_p": 0.5})
    assert default_sampling_fields(model) == {"repetition_penalty": 1.05, "temperature": 0.6, "top_k": 20,
                                              "top_p": 0.95, "min_p": 0.0, "max_tokens": 512}
    assert default_sampling_fields(model, "vllm") == {}
    line = describe_defaults(default_sampling_fields(model))
    assert line.startswith("default sampling parameters from the model's generation config: repetition_penalty=1.05")
    assert describe_defaults({}) == ""


def test_missing_file_or_null_values_set_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert default_sampling_fields(tmp_path / "empty") == {}
    assert default_sampling_fields(_write(tmp_path / "n", {"temperature": None, "do_sample": False})) == {}


def test_a_directory_and_overrides(tmp_path: Path) -> None:
    model = _write(tmp_path / "m", {"temperature": 0.6, "top_k": 20})
    other = _write(tmp_path / "other", {"top_p": 0.5})
    assert default_sampling_fields(model, str(other)) == {"top_p": 0.5}
    assert default_sampling_fields(model, overrides={"temperature": 0.2, "max_new_tokens": 8}) == {
        "temperature": 0.2, "top_k": 20, "max_tokens": 8}
    assert default_sampling_fields(model, "vllm", overrides={"top_k": 5}) == {"top_k": 5}


@pytest.mark.parametrize(("setup", "match"), [
    (lambda d: default_sampling_fields(_write(d / "m", {"temperature": "hot"})), r"generation_config.json: temperature "
                                                                                  r"must be a number, got \"hot\""),
    (lambda d: default_sampling_fields(_write(d / "m", {"top_k": 2.5})), "top_k must be an integer, got 2.5"),
    (lambda d: default_sampling_fields(_write(d / "m", {"top_p": True})), "top_p must be a number, got true"),
    (lambda d: default_sampling_fields(_write(d / "m", [1, 2])), "must hold a JSON object, found list"),
    (lambda d: default_sampling_fields(d, str(d / "nowhere")), "is not 'auto', 'vllm' or a directory"),
    (lambda d: default_sampling_fields(d, str(d)), "has no generation_config.json"),
    (lambda d: default_sampling_fields(d, overrides={"temp": 1}), "override_generation_config: unknown key 'temp'"),
    (lambda d: default_sampling_fields(d, overrides={"max_new_tokens": "8"}),
     "override_generation_config: max_new_tokens must be an integer"),
])
def test_bad_generation_configs_raise_one_line(tmp_path: Path, setup, match: str) -> None:
    with pytest.raises(GenerationConfigError, match=match) as err:
        setup(tmp_path)
    assert "\n" not in str(err.value)


def test_unreadable_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match=r"generation_config.json: not a readable JSON file"):
        default_sampling_fields(tmp_path)


def test_flags_reach_the_engine_config() -> None:
    parser = add_runtime_args(argparse.ArgumentParser(), server=False)
    cfg = runtime_config_from_args(parser.parse_args(
        ["--model", "m", "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}']))
    assert cfg.engine.generation_config == "vllm"
    assert cfg.engine.override_generation_config == {"temperature": 0.5}
    assert EngineConfig().generation_config == "auto" and EngineConfig().override_generation_config == {}
    with pytest.raises(ValueError, match="override_generation_config: unknown key 'temp'"):
        EngineConfig(override_generation_config={"temp": 1.0})
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--override-generation-config", "[1]"])


@pytest.mark.parametrize(("value", "message"), [
    ('{"temperature": "hot"}', 'temperature must be a number, got "hot"'),
    ('{"temp": 1.0}', "unknown key 'temp'"),
    ("[1]", "must be a JSON object"),
])
def test_override_flag_is_refused_at_parse_naming_the_flag(capsys, value: str, message: str) -> None:
    from launch.config_args import FlagParser
    parser = add_runtime_args(FlagParser(prog="python -m launch generate"), server=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--override-generation-config", value])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: argument --override-generation-config: "), err
    assert message in err and "override_generation_config:" not in err, err


def test_a_vllm_flat_config_file_takes_the_generation_and_tool_keys(tmp_path: Path) -> None:
    path = tmp_path / "vllm.yaml"
    path.write_text("model: m\ngeneration-config: vllm\noverride-generation-config: {temperature: 0.3}\n"
                    "enable-auto-tool-choice: true\ntool-call-parser: hermes\n")
    parser = add_runtime_args(argparse.ArgumentParser())
    cfg = runtime_config_from_args(parser.parse_args(["--config", str(path)]))
    assert (cfg.engine.generation_config, cfg.engine.override_generation_config) == ("vllm", {"temperature": 0.3})
    assert (cfg.server.enable_auto_tool_choice, cfg.server.tool_call_parser) == (True, "hermes")
