"""vLLM's ``VLLM_API_KEY``: ``vllm serve`` without ``--api-key`` guards its API with this environment
variable (vllm/entrypoints/openai/api_server.py: ``args.api_key or envs.VLLM_API_KEY``). The server once
ignored it and served everyone, with no warning on loopback."""

from __future__ import annotations

import json

from launch.serve import build_parser, config_from_args, exposure_warning


def _args(tmp_path, *flags: str):
    (tmp_path / "config.json").write_text(json.dumps({}))
    return build_parser().parse_args(["--model", str(tmp_path), *flags])


def test_vllm_api_key_is_the_key_without_the_flag(tmp_path):
    cfg = config_from_args(_args(tmp_path), environ={"VLLM_API_KEY": "from-env"})
    assert cfg.server.api_key == "from-env"
    assert exposure_warning(config_from_args(_args(tmp_path, "--host", "0.0.0.0"),
                                             environ={"VLLM_API_KEY": "from-env"})) is None


def test_the_flag_wins_over_vllm_api_key(tmp_path):
    cfg = config_from_args(_args(tmp_path, "--api-key", "flag"), environ={"VLLM_API_KEY": "from-env"})
    assert cfg.server.api_key == "flag"


def test_an_empty_or_absent_vllm_api_key_means_no_key(tmp_path):
    assert config_from_args(_args(tmp_path), environ={"VLLM_API_KEY": ""}).server.api_key is None
    assert config_from_args(_args(tmp_path), environ={}).server.api_key is None


def test_main_reads_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert config_from_args(_args(tmp_path)).server.api_key == "from-env"
