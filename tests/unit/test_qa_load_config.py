"""QA of getting a config into a run: settings a run would silently ignore are refused."""

from __future__ import annotations

import json

import pytest

from launch.config import RuntimeConfig
from launch.generate import main as generate_main


def _checkpoint_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    return tmp_path


def test_model_overrides_refused_for_a_run(tmp_path):
    cfg = RuntimeConfig.from_dict({"model": str(_checkpoint_dir(tmp_path)),
                                   "model_overrides": {"num_hidden_layers": 1, "hidden_size": 32}})
    with pytest.raises(ValueError, match=r"model_overrides \(hidden_size, num_hidden_layers\) only reshape"):
        cfg.check_model_path()


def test_model_path_without_overrides_still_checked(tmp_path):
    assert RuntimeConfig.from_dict({"model": str(_checkpoint_dir(tmp_path))}).check_model_path() == tmp_path


def test_generate_refuses_model_overrides_before_loading(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    model = _checkpoint_dir(tmp_path / "ckpt")
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n')
    rc = generate_main(["--model", str(model), "--input", str(src), "--output", str(tmp_path / "out.jsonl"),
                        "--set", "model_overrides.hidden_size=32"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: model_overrides (hidden_size)") and "\n" not in err
    assert not (tmp_path / "out.jsonl").exists()


def _qwen3_yarn(**rope):
    from moe.config import ModelConfig

    raw = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 32,
           "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
           "max_position_embeddings": 40960}
    if rope:
        raw["rope_scaling"] = {"rope_type": "yarn", **rope}
    return ModelConfig.from_hf(raw)


def test_yarn_extends_the_max_model_len_limit_as_vllm():
    # Qwen3's YaRN recipe: rope_scaling factor 4 over 32768, max_position_embeddings left at 40960
    model = _qwen3_yarn(factor=4.0, original_max_position_embeddings=32768)
    assert model.max_model_len_limit == 131072
    RuntimeConfig.from_dict({"model": "m", "engine": {"max_model_len": 131072}}).validate_for_model(model)
    with pytest.raises(ValueError, match=r"max_model_len=131073 > the model's context length 131072 "
                       r"\(max_position_embeddings 40960, YaRN 32768 x 4\)"):
        RuntimeConfig.from_dict({"model": "m", "engine": {"max_model_len": 131073}}).validate_for_model(model)


def test_without_yarn_the_limit_is_max_position_embeddings():
    model = _qwen3_yarn()
    assert model.max_model_len_limit == 40960
    with pytest.raises(ValueError, match=r"max_model_len=40961 > the model's max_position_embeddings 40960$"):
        RuntimeConfig.from_dict({"model": "m", "engine": {"max_model_len": 40961}}).validate_for_model(model)
