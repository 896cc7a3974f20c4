"""The model's generation config as requests' default sampling parameters (vLLM's
``--generation-config auto``): ``LLM.generate`` without params, ``generate``'s input lines, the
``vllm`` mode and overrides, bad values refused before any weights load; ``LLM()`` takes vLLM's
value spellings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from launch.core import SamplingParams
from launch.generate import main
from launch.llm import LLM, build_runtime_config


def _copy_with(src: Path, dst: Path, **fields: object) -> Path:
    """A copy of the checkpoint ``src`` whose generation_config.json also holds ``fields``."""
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**data, **fields}))
    return dst


@pytest.fixture
def recommended(tiny_ckpt_with_tokenizer: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint with a model maker's recommended sampling (greedy, 3 tokens at most)."""
    return _copy_with(tiny_ckpt_with_tokenizer, tmp_path / "recommended", temperature=0.0, top_k=20,
                      max_new_tokens=3, do_sample=True)


def test_generate_without_params_samples_with_the_generation_config(recommended: Path) -> None:
    with LLM(str(recommended), dtype="float32") as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 20, 3)
        out = llm.generate(["The expert"])[0].outputs[0]
        assert len(out.token_ids) <= 3
        greedy = llm.generate(["The expert"], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
        assert out.token_ids == greedy.token_ids
        # params given explicitly are the caller's: no cap from the generation config
        assert len(llm.generate(["The expert"], SamplingParams(temperature=0.0, max_tokens=6,
                                                                ignore_eos=True))[0].outputs[0].token_ids) == 6


def test_vllm_mode_and_overrides(recommended: Path) -> None:
    with LLM(str(recommended), dtype="float32", generation_config="vllm",
             override_generation_config={"max_new_tokens": 2}) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (1.0, -1, 2)
        assert llm.engine.default_sampling == {"max_tokens": 2}


@pytest.mark.parametrize(("fields", "overrides", "match"), [
    ({"temperature": -1.0}, {}, r"generation config .*generation_config.json: temperature must be"),
    ({"top_p": "high"}, {}, r"generation_config.json: top_p must be a number"),
    ({}, {"repetition_penalty": 0.0}, r"generation config override_generation_config: repetition_penalty must be"),
])
def test_a_bad_generation_config_is_refused_before_loading(tiny_ckpt_with_tokenizer: Path, tmp_path: Path,
                                                           monkeypatch, fields, overrides, match) -> None:
    from launch.engine import LLMEngine, check_runtime_config

    model = _copy_with(tiny_ckpt_with_tokenizer, tmp_path / "bad", **fields)
    config = build_runtime_config(str(model), {"override_generation_config": overrides})
    with pytest.raises(ValueError, match=match):
        check_runtime_config(config)
    monkeypatch.setattr(LLMEngine, "_new_allocators", lambda self: pytest.fail("the engine was built"))
    with pytest.raises(ValueError, match=match):
        LLM(config=config)


def test_llm_takes_vllm_value_spellings() -> None:
    config = build_runtime_config("m", {"dtype": "half", "kv_cache_dtype": "fp8_e4m3", "trust_remote_code": True})
    assert (config.engine.dtype, config.engine.kv_cache_dtype) == ("float16", "fp8")
    with pytest.raises(TypeError, match="trust_remote_code must be a bool"):
        build_runtime_config("m", {"trust_remote_code": "yes"})


def test_generate_lines_take_the_generation_config_then_their_own_fields(recommended: Path, tmp_path: Path,
                                                                        capsys) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "The expert"}) + "\n"
                   + json.dumps({"prompt": "The expert", "max_tokens": 5, "ignore_eos": True,
                                 "prompt_logprobs": 1}) + "\n")
    dst = tmp_path / "out.jsonl"
    assert main(["--model", str(recommended), "--input", str(src), "--output", str(dst), "--dtype", "float32"]) == 0
    first, second = (json.loads(line) for line in dst.read_text().splitlines())
    assert len(first["token_ids"]) <= 3 and "prompt_logprobs" not in first
    assert len(second["token_ids"]) == 5
    scored = second["prompt_logprobs"]
    assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] == []
    assert all(isinstance(lp, float) and lp <= 0 for lp in scored["token_logprobs"][1:])
    assert all(len(top) == 1 for top in scored["top_logprobs"][1:])
    assert len(scored["token_logprobs"]) >= 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # refused at parse, before the engine starts
        main(["--model", str(recommended), "--input", str(src), "--output", str(tmp_path / "o2.jsonl"),
              "--override-generation-config", '{"temperature": "hot"}'])
    assert exit_info.value.code == 2
    assert "argument --override-generation-config: temperature must be a number" in capsys.readouterr().err
