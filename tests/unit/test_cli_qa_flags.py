"""The vLLM-style flags of ``serve`` / ``generate`` / ``config`` / ``demo``, as a ``vllm serve`` user
types them: each does what vLLM's does, or is refused in one line naming it, before anything starts."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from launch.config import RuntimeConfig
from launch.config_args import add_runtime_args, runtime_config_from_args
from launch.config_schema import ConfigError


def _args(argv: list[str]) -> RuntimeConfig:
    return runtime_config_from_args(add_runtime_args(argparse.ArgumentParser()).parse_args(argv))


@pytest.fixture
def never_serve(monkeypatch: pytest.MonkeyPatch) -> dict:
    """``launch.serve.serve`` replaced: records its arguments instead of loading weights and serving."""
    import launch.serve as serve_module

    seen: dict = {}

    async def record(cfg, **kwargs):
        seen.update(cfg=cfg, **kwargs)

    monkeypatch.setattr(serve_module, "serve", record)
    return seen


def test_vllm_dtype_spellings_are_taken() -> None:
    assert _args(["--model", "m", "--dtype", "half"]).engine.dtype == "float16"
    assert _args(["--model", "m", "--dtype", "float"]).engine.dtype == "float32"
    assert _args(["--model", "m", "--kv-cache-dtype", "fp8_e4m3"]).engine.kv_cache_dtype == "fp8"
    assert _args(["--model", "m", "--num-gpu-blocks-override", "64"]).engine.num_kv_blocks == 64
    with pytest.raises(SystemExit):
        _args(["--model", "m", "--dtype", "fp16"])


def test_served_model_name_takes_one_name_or_several() -> None:
    assert _args(["--model", "m", "--served-model-name", "tiny"]).server.served_model_name == "tiny"
    assert _args(["--model", "m", "--served-model-name", "a", "b"]).served_model_names == ("a", "b")
    with pytest.raises(ConfigError, match="served_model_name is empty"):  # not quietly the model path
        _args(["--model", "m", "--served-model-name", " "])


def test_use_async_eplb_is_refused_not_ignored() -> None:
    base = ["--model", "m", "-dp", "2", "--enable-expert-parallel", "--enable-eplb"]
    assert _args(base + ["--eplb-config", '{"use_async": false}']).balancer.use_async is False
    with pytest.raises(ConfigError, match="use_async=true .* is not implemented"):
        _args(base + ["--eplb-config", '{"use_async": true}'])


def test_eplb_config_without_eplb_is_refused_not_ignored() -> None:
    with pytest.raises(ConfigError, match="--eplb-config does nothing without --enable-eplb"):
        _args(["--model", "m", "--eplb-config", '{"window_size": 10}'])


def test_compatibility_flags_are_taken_and_change_nothing() -> None:
    from launch.serve import build_parser, config_from_args

    plain = config_from_args(build_parser().parse_args(["--model", "m"]))
    compat = config_from_args(build_parser().parse_args(["--model", "m", "--trust-remote-code",
                                                         "--disable-log-requests", "--disable-log-stats"]))
    assert compat == plain


def test_chat_template_is_a_serve_flag_and_a_flat_config_key(tmp_path: Path) -> None:
    from launch.serve import build_parser, config_from_args

    path = tmp_path / "vllm.yaml"
    path.write_text("model: ck\nchat-template: /some/template.jinja\ndisable-log-stats: true\n")
    assert config_from_args(build_parser().parse_args(["--config", str(path)])).server.chat_template == \
        "/some/template.jinja"
    assert config_from_args(build_parser().parse_args(["--config", str(path), "--chat-template", "{{ x }}"])
                            ).server.chat_template == "{{ x }}"  # the flag wins over the file


def test_a_vllm_flat_config_file_works_and_flags_still_win(tmp_path: Path) -> None:
    """vLLM's --config files hold flag names (``-`` or ``_``); file < --set < flags as for ours."""
    path = tmp_path / "vllm.yaml"
    path.write_text("model: ck\ntensor-parallel-size: 2\ndata_parallel_size: 2\nenable-expert-parallel: true\n"
                    "enable-eplb: true\neplb-config: {window_size: 100, num_redundant_experts: 4}\nport: 8123\n"
                    "served-model-name: [tiny]\ndtype: half\ntrust-remote-code: true\nmax-num-seqs: 8\n"
                    "engine: {block_size: 32}\n")
    cfg = _args(["--config", str(path)])
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.data_parallel_size) == (2, 2)
    assert cfg.parallel.enable_expert_parallel and cfg.balancer.enable_eplb
    assert (cfg.balancer.window_size, cfg.balancer.num_redundant_experts) == (100, 4)
    assert (cfg.server.port, cfg.server.served_model_name) == (8123, "tiny")
    assert (cfg.engine.dtype, cfg.engine.max_num_seqs, cfg.engine.block_size) == ("float16", 8, 32)
    cfg = _args(["--config", str(path), "--set", "engine.max_num_seqs=3", "--port", "9", "-tp", "1"])
    assert (cfg.engine.max_num_seqs, cfg.server.port, cfg.parallel.tensor_parallel_size) == (3, 9, 1)
    path.write_text("model: ck\nparallel: {data_parallel_size: 4}\ndata-parallel-size: 2\n")
    with pytest.raises(ConfigError, match="'data-parallel-size: 2' and 'parallel.data_parallel_size: 4'"):
        _args(["--config", str(path)])
    path.write_text("model: ck\nmax-num-seqz: 2\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'max-num-seqz' \(did you mean 'max_num_seqs'\?\)"):
        _args(["--config", str(path)])


def test_serve_takes_the_model_first_as_vllm_serve_does(tiny_ckpt: Path, never_serve: dict) -> None:
    from launch.serve import main

    assert main([str(tiny_ckpt), "--port", "0", "--uvicorn-log-level", "warning"]) == 0
    assert never_serve["cfg"].model == str(tiny_ckpt) and never_serve["log_level"] == "warning"


def test_serve_refuses_two_different_models(tiny_ckpt: Path, never_serve: dict, capsys) -> None:
    from launch.serve import main

    assert main([str(tiny_ckpt), "--model", "/elsewhere", "--port", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: the model is given twice") and never_serve == {}


@pytest.mark.parametrize("argv, message", [
    (["--trust-remote-codes"], "error: unrecognized arguments: --trust-remote-codes"),
    (["--tokenizer", "x"], "error: unrecognized arguments: --tokenizer"),
    (["--dtype", "fp16"], "error: argument --dtype: invalid choice: 'fp16'"),
    (["--all2all-backend", "deepep_low_latency"], "error: argument --all2all-backend: invalid choice"),
])
def test_a_bad_flag_is_one_line_naming_it(argv: list[str], message: str, capsys) -> None:
    from launch.serve import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "m", *argv])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(message), line


def test_no_chunked_prefill_with_a_long_model_is_refused_before_loading(tiny_ckpt: Path, tmp_path: Path,
                                                                        never_serve: dict, capsys) -> None:
    """Without chunked prefill a prompt must fit one step; with max_model_len unset the model's length
    counts (vLLM checks it at start-up), not only an explicit --max-model-len."""
    from launch.serve import main

    raw = json.loads((tiny_ckpt / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 16384}))
    assert main(["--model", str(tmp_path), "--port", "0", "--no-enable-chunked-prefill"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: max_num_batched_tokens (8192) < max_model_len (16384, the model's "
                           "max_position_embeddings) without chunked prefill")
    assert never_serve == {}


def test_generate_has_no_server_flags(tiny_ckpt: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """``generate`` runs no server: --port, --api-key ... would do nothing, so they are unknown flags."""
    import launch.llm
    from launch.generate import main

    def never(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(launch.llm, "LLM", never)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n')
    for flag, value in (("--port", "9"), ("--api-key", "k"), ("--served-model-name", "x"), ("--host", "0.0.0.0")):
        with pytest.raises(SystemExit):
            main(["--model", str(tiny_ckpt), "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                  flag, value])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: unrecognized arguments: {flag}"), line


def test_every_serve_flag_says_what_it_does() -> None:
    from launch.serve import build_parser

    quiet = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and not a.help]
    assert quiet == []


def test_demo_warns_of_a_reachable_server_without_an_api_key(never_serve: dict, caplog) -> None:
    from launch import demo

    with caplog.at_level(logging.WARNING):
        assert demo.main(["--port", "0", "--set", "server.host=0.0.0.0"]) == 0
    assert "listening on 0.0.0.0 without --api-key" in caplog.text


def test_eplb_config_and_a_flag_that_disagree_are_refused_not_overridden() -> None:
    """``--eplb-config`` holds balancer keys that have their own flags; the flag used to win silently."""
    base = ["--model", "m", "-dp", "2", "--enable-expert-parallel", "--enable-eplb"]
    with pytest.raises(ConfigError, match="--eplb-config sets enable_eplb to false but --enable-eplb gives true"):
        _args(base + ["--eplb-config", '{"enable_eplb": false}'])
    assert _args(base + ["--eplb-config", '{"enable_eplb": true}']).balancer.enable_eplb
    # vLLM's own key: its deprecated flag wins there (test_eplb_config_json_is_strict_and_flags_win)
    flag = _args(base + ["--num-redundant-experts", "2", "--eplb-config", '{"num_redundant_experts": 4}'])
    assert flag.balancer.num_redundant_experts == 2


def test_llm_eplb_config_and_a_keyword_that_disagree_are_refused() -> None:
    from launch.llm import build_runtime_config

    kwargs = dict(data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="eplb_config sets enable_eplb=False but enable_eplb=True is also given"):
        build_runtime_config("m", {**kwargs, "enable_eplb": True, "eplb_config": {"enable_eplb": False}})
    agreed = build_runtime_config("m", {**kwargs, "enable_eplb": True, "eplb_config": {"enable_eplb": True}})
    assert agreed.balancer.enable_eplb
    vllm = build_runtime_config("m", {**kwargs, "enable_eplb": True, "num_redundant_experts": 2,
                                      "eplb_config": {"num_redundant_experts": 4}})
    assert vllm.balancer.num_redundant_experts == 2


def test_quantization_takes_vllms_experts_int8_and_says_what_fp8_checkpoints_need(capsys) -> None:
    from launch.config import EngineConfig

    assert _args(["--model", "m", "-q", "experts_int8"]).engine.quantization == "int8"
    assert EngineConfig(quantization="experts_int8").quantization == "int8"
    parser = add_runtime_args(argparse.ArgumentParser(prog="p"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--quantization", "fp8"])
    assert "a checkpoint whose quantization_config is fp8 (DeepSeek-V3's format) loads without this flag" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="loads without this flag"):
        EngineConfig(quantization="fp8")


def test_serve_log_levels_from_a_vllm_config_file(tiny_ckpt: Path, never_serve: dict, tmp_path: Path,
                                                  capsys) -> None:
    """vLLM's --config takes every flag: log-level and uvicorn-log-level too (they were unknown keys)."""
    from launch.serve import main

    path = tmp_path / "serve.yaml"
    path.write_text("log-level: warning\nuvicorn-log-level: error\n")
    root = logging.getLogger()
    level = root.level
    try:
        assert main([str(tiny_ckpt), "--port", "0", "--config", str(path)]) == 0
        assert never_serve["log_level"] == "error" and root.level == logging.WARNING
        assert main([str(tiny_ckpt), "--port", "0", "--config", str(path), "--uvicorn-log-level", "debug"]) == 0
        assert never_serve["log_level"] == "debug"  # the flag wins over the file
        path.write_text("log-level: loud\n")
        assert main([str(tiny_ckpt), "--port", "0", "--config", str(path)]) == 2
        assert "log_level must be one of" in capsys.readouterr().err
    finally:
        root.setLevel(level)


def test_max_model_len_takes_vllms_human_readable_spellings(tmp_path: Path, capsys) -> None:
    for text, want in (("2048", 2048), ("1k", 1000), ("25.6k", 25600), ("32K", 32768), ("1M", 1048576)):
        assert _args(["--model", "m", "--max-model-len", text]).engine.max_model_len == want, text
    parser = add_runtime_args(argparse.ArgumentParser(prog="p"))
    for bad, message in (("1.5K", "binary suffixes take whole numbers (1.5k is decimal)"), ("k", "invalid int"),
                         ("\u00b2", "invalid int")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "m", "--max-model-len", bad])
        assert message in capsys.readouterr().err
    path = tmp_path / "v.yaml"
    path.write_text("model: ck\nmax-model-len: 4K\n")
    assert _args(["--config", str(path)]).engine.max_model_len == 4096
    path.write_text("model: ck\nmax-model-len: 4.5K\n")
    with pytest.raises(ConfigError, match="max-model-len: invalid int value: '4.5K'"):
        _args(["--config", str(path)])
