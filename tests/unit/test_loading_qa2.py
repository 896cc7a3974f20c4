"""Checkpoint tensors the model has no place for, judged as vLLM's ``load_weights`` judges them.

vLLM (``vllm/model_executor/models/deepseek_v2.py``, ``mixtral.py``, ``qwen3_moe.py``) walks the
checkpoint's names and, for each: skips ``rotary_emb.inv_freq``; skips DeepSeek's speculative
(MTP) layers, ``model.layers.{num_hidden_layers + i}.*`` for i < ``num_nextn_predict_layers``
(``get_spec_layer_idx_from_weight_name``); skips a routed expert another rank hosts; and otherwise
looks the name up in ``params_dict[name]``, a ``KeyError`` for any name without a parameter, a
layer past those counts included. ``moe.loader.load_weights`` does the same, with one line naming
the tensor, its layer and the config values instead of a KeyError, before any weight is written.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe.config import ModelConfig
from moe.loader import LoadError, UnexpectedTensorError, load_state_dict, load_weights
from moe.model import MoEModel
from moe.tiny import ARCHITECTURES, write_tiny_checkpoint


def _edit(path: Path, *, add: dict[str, torch.Tensor] | None = None, **config) -> Path:
    """Add tensors to ``path``'s model.safetensors and replace config.json fields, in place."""
    if add:
        tensors = load_file(path / "model.safetensors")
        save_file({**tensors, **add}, path / "model.safetensors")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **config}))
    return path


def _with_mtp_layer(path: Path) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's MTP layer as its checkpoints store it: a copy of the last decoder layer at index
    num_hidden_layers, plus enorm / hnorm / eh_proj / shared_head."""
    tensors = load_file(path / "model.safetensors")
    last = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    prefix = f"model.layers.{last - 1}."
    mtp = {f"model.layers.{last}." + k.removeprefix(prefix): v.clone() for k, v in tensors.items()
           if k.startswith(prefix)}
    hidden = tensors["model.norm.weight"].shape[0]
    mtp.update({f"model.layers.{last}.enorm.weight": torch.ones(hidden),
                f"model.layers.{last}.hnorm.weight": torch.ones(hidden),
                f"model.layers.{last}.eh_proj.weight": torch.zeros(hidden, 2 * hidden),
                f"model.layers.{last}.shared_head.norm.weight": torch.ones(hidden)})
    return mtp


def _model(path: Path) -> MoEModel:
    model = MoEModel(ModelConfig.from_hf(path), dtype=torch.float32)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(7.0)  # a sentinel: a refused checkpoint must leave every tensor as it was
    return model


def _untouched(model: MoEModel) -> bool:
    return all(bool((t == 7.0).all()) for t in model.state_dict().values())


@pytest.fixture
def ds3(tmp_path: Path) -> Path:
    return write_tiny_checkpoint("deepseek_v3", tmp_path / "ds3")


def test_mtp_layers_are_skipped_and_logged_once(ds3: Path, caplog) -> None:
    """vLLM skips the num_nextn_predict_layers MTP layers when not decoding speculatively: so does the
    loader, saying once (info) how many it skipped."""
    _edit(ds3, add=_with_mtp_layer(ds3), num_nextn_predict_layers=1)
    model = MoEModel(ModelConfig.from_hf(ds3), dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="moe.loader"):
        report = load_weights(model, ds3, dtype=torch.float32)
    assert report.num_mtp_layers_skipped == 1 and report.unexpected == []
    assert any(k.startswith("model.layers.3.") for k in report.ignored)
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and "skipped 1 multi-token-prediction layer(s)" in lines[0], lines
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "moe.loader")


def test_a_layer_past_num_hidden_layers_is_refused_naming_layer_and_config(ds3: Path) -> None:
    """A checkpoint layer at num_hidden_layers with no num_nextn_predict_layers to cover it (an MTP
    checkpoint whose config lost the field): vLLM raises KeyError for its names; here one line names
    the layer index and the config value, and no weight is written."""
    _edit(ds3, add=_with_mtp_layer(ds3))  # tiny config: num_nextn_predict_layers=0
    model = _model(ds3)
    with pytest.raises(UnexpectedTensorError) as e:
        load_weights(model, ds3, dtype=torch.float32)
    msg = str(e.value)
    assert "\n" not in msg and "decoder layer 3" in msg and "num_hidden_layers=3" in msg, msg
    assert _untouched(model)
    err = pickle.loads(pickle.dumps(e.value))  # a rank's error crosses Ray to the driver
    assert isinstance(err, LoadError) and str(err) == msg


def test_a_config_with_num_hidden_layers_edited_down_is_refused(ds3: Path) -> None:
    """num_hidden_layers edited from 3 to 2: the checkpoint's layer 2 would be silently dropped (a
    truncated model that still generates); refused, naming layer 2 and num_hidden_layers=2."""
    _edit(ds3, num_hidden_layers=2)
    model = _model(ds3)
    with pytest.raises(UnexpectedTensorError, match=r"decoder layer 2, but config.json has num_hidden_layers=2"):
        load_weights(model, ds3, dtype=torch.float32)
    assert _untouched(model)


def test_a_layer_past_the_mtp_layers_is_refused(ds3: Path) -> None:
    """num_nextn_predict_layers=1 covers layer 3 only: a layer 4 names both config values."""
    mtp = _with_mtp_layer(ds3)
    extra = {k.replace("model.layers.3.", "model.layers.4."): v.clone() for k, v in mtp.items()}
    _edit(ds3, add={**mtp, **extra}, num_nextn_predict_layers=1)
    with pytest.raises(UnexpectedTensorError) as e:
        load_weights(_model(ds3), ds3, dtype=torch.float32)
    msg = str(e.value)
    assert "decoder layer 4" in msg and "num_hidden_layers=3 + num_nextn_predict_layers=1" in msg, msg


def test_an_unknown_tensor_is_refused_and_rotary_caches_are_not(ds3: Path) -> None:
    """vLLM: ``params_dict[name]`` raises KeyError for a name with no parameter, and ``rotary_emb.inv_freq``
    is skipped by name. Same here: the unknown name is one line naming it; the rotary cache is ignored."""
    _edit(ds3, add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    report = load_weights(MoEModel(ModelConfig.from_hf(ds3), dtype=torch.float32), ds3, dtype=torch.float32)
    assert report.ignored == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    _edit(ds3, add={"model.layers.0.self_attn.mystery.weight": torch.ones(4)})
    model = _model(ds3)
    with pytest.raises(UnexpectedTensorError, match=r"1 checkpoint tensor\(s\) that no part of the model reads: "
                                                    r"'model.layers.0.self_attn.mystery.weight'"):
        load_weights(model, ds3, dtype=torch.float32)
    assert _untouched(model)
    report = load_weights(model, ds3, dtype=torch.float32, strict=False)  # a partial model lists them instead
    assert report.unexpected == ["model.layers.0.self_attn.mystery.weight"]


def test_load_state_dict_reports_past_layers_as_unexpected(ds3: Path) -> None:
    """load_state_dict reads a chosen subset, so leftovers are reported, not refused; a layer past the
    counts is unexpected (not quietly ignored as an MTP layer)."""
    _edit(ds3, add=_with_mtp_layer(ds3))
    _, report = load_state_dict(ds3, {"model.norm.weight": (ModelConfig.from_hf(ds3).hidden_size,)})
    assert "model.layers.3.eh_proj.weight" in report.unexpected
    assert report.num_mtp_layers_skipped == 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_make_tiny_checkpoint_loads_strictly(arch: str, tmp_path: Path) -> None:
    """The checkpoints ``python -m launch make-tiny`` writes (sharded too) carry nothing the model does
    not read."""
    from launch.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(arch, tmp_path / arch)
    report = load_weights(MoEModel(ModelConfig.from_hf(path), dtype=torch.float32), path, dtype=torch.float32)
    assert report.unexpected == [] and report.num_mtp_layers_skipped == 0
