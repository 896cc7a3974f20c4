"""Path values written with ``~`` and the accepted ``--dtype`` / ``--kv-cache-dtype`` spellings, alike
from a ``--config`` YAML file, ``--set``, flags and ``LLM(...)`` keywords."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from launch.config import DTYPE_ALIASES, DTYPES, KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES, RuntimeConfig
from launch.config_args import FlagParser, add_runtime_args, runtime_config_from_args
from launch.config_schema import ConfigError

HOME = os.path.expanduser("~")


def _cfg(argv: list[str]) -> RuntimeConfig:
    return runtime_config_from_args(add_runtime_args(argparse.ArgumentParser()).parse_args(argv))


def _yaml(tmp_path: Path, text: str) -> str:
    (tmp_path / "run.yaml").write_text(text)
    return str(tmp_path / "run.yaml")


def test_tilde_paths_in_a_yaml_file_are_expanded(tmp_path: Path) -> None:
    """``model: ~/ckpt`` reads as the string "~/ckpt" (a bare ``~`` is YAML's null): every path-typed key
    (model, generation_config, the expert-distribution paths) gets the home directory, flat or nested."""
    path = _yaml(tmp_path, "model: ~/ckpt\nengine: {generation_config: ~/gen}\n"
                           "server: {expert_distribution_dir: ~/dist, init_expert_location: ~/place.json}\n")
    cfg = _cfg(["--config", path])
    assert cfg.model == f"{HOME}/ckpt"
    assert cfg.engine.generation_config == f"{HOME}/gen"
    assert cfg.server.expert_distribution_dir == f"{HOME}/dist"
    assert cfg.server.init_expert_location == f"{HOME}/place.json"
    flat = _yaml(tmp_path, "model: ~/ckpt\nexpert-distribution-dir: ~/dist\n")
    assert _cfg(["--config", flat]).server.expert_distribution_dir == f"{HOME}/dist"


def test_tilde_paths_from_flags_and_set_match_the_file(tmp_path: Path) -> None:
    """``--model=~/ckpt`` reaches us unexpanded (the shell expands ``~`` only at the start of a word):
    flags and ``--set`` expand it as the file does; other strings and non-path keys are left alone."""
    cfg = _cfg(["--model=~/ckpt", "--set", "server.expert_distribution_dir=~/dist", "--served-model-name", "~/x"])
    assert cfg.model == f"{HOME}/ckpt" and cfg.server.expert_distribution_dir == f"{HOME}/dist"
    assert cfg.server.served_model_name == "~/x"  # a name, not a path
    assert _cfg(["--model", "deepseek-ai/DeepSeek-V3"]).model == "deepseek-ai/DeepSeek-V3"
    assert _cfg(["--model", "ckpt/~x"]).model == "ckpt/~x"  # only a leading ~ is the home directory
    assert RuntimeConfig.from_dict({"model": "~/ckpt"}).model == f"{HOME}/ckpt"


def test_a_bare_tilde_model_in_yaml_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing required config key 'model'"):
        _cfg(["--config", _yaml(tmp_path, "model: ~\n")])


@pytest.mark.parametrize("flag, choices, aliases", [
    ("--dtype", DTYPES, DTYPE_ALIASES),
    ("--kv-cache-dtype", KV_CACHE_DTYPES, KV_CACHE_DTYPE_ALIASES),
])
def test_a_bad_dtype_flag_lists_exactly_the_accepted_spellings(flag: str, choices, aliases, capsys) -> None:
    """Every spelling the flag takes (ours and vLLM's: half, float, fp8_e4m3) is listed, and each listed one
    is taken."""
    accepted = (*choices, *aliases)
    parser = add_runtime_args(FlagParser(prog="p"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--model", "m", flag, "bf16"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    listed = line.split("(choose from ", 1)[1].split(")", 1)[0]
    assert listed == ", ".join(repr(c) for c in accepted), line
    for spelling in accepted:
        cfg = _cfg(["--model", "m", flag, spelling])
        got = cfg.engine.dtype if flag == "--dtype" else cfg.engine.kv_cache_dtype
        assert got == aliases.get(spelling, spelling)


def test_a_bad_flat_dtype_in_a_config_file_lists_the_accepted_spellings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(["--config", _yaml(tmp_path, "model: m\ndtype: fp16\n")])
    assert str(e.value).endswith("dtype: invalid choice: 'fp16' (choose from 'auto', 'bfloat16', 'float32', "
                                 "'float16', 'half', 'float')")


def test_a_config_from_a_pipe_is_read_once(tmp_path: Path) -> None:
    """``--config /dev/stdin`` or ``<(...)``: a pipe gives its text once, and a benchmark resolves its
    config twice (``fill_unset``, then ``runtime_config_from_args``); both see the pipe's keys."""
    from launch.config_args import fill_unset

    read_end, write_end = os.pipe()  # /dev/fd/N: what a shell's <(...) passes
    os.write(write_end, b"model: /ckpt\nmax_num_seqs: 3\ndtype: float32\n")
    os.close(write_end)
    fifo = f"/dev/fd/{read_end}"
    args = add_runtime_args(argparse.ArgumentParser()).parse_args(["--config", fifo])
    fill_unset(args, {"dtype": "bfloat16", "max_model_len": 64})  # the file's dtype wins over the default
    cfg = runtime_config_from_args(args)
    assert (cfg.model, cfg.engine.max_num_seqs, cfg.engine.dtype, cfg.engine.max_model_len) == (
        "/ckpt", 3, "float32", 64)
    os.close(read_end)
    with pytest.raises(ConfigError, match="does not exist"):
        _cfg(["--config", str(tmp_path / "none.yaml")])
