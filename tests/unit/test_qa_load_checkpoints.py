"""QA of checkpoint loading: user mistakes in a Hugging Face checkpoint fail with one clear
error naming the file and tensor, never load silently wrong."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe.config import ModelConfig
from moe.experts import Experts
from moe.loader import CheckpointFormatError, load_experts, load_weights
from moe.model import MoEModel
from moe.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = write_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("qa_load") / "single", shard_bytes=None)
    return ModelConfig.from_hf(path), path


def build_target(config):
    model = MoEModel(config, dtype=torch.float32)
    for tensor in model.state_dict().values():  # defined values (the model allocates uninitialised)
        if tensor.is_floating_point():
            tensor.fill_(0.25)
    return model


def _with(src, dst, cast):
    """Copy a single-file checkpoint, casting the tensors ``cast`` picks (name -> dtype or None)."""
    tensors = load_file(src / "model.safetensors")
    tensors = {k: v.to(cast(k)) if cast(k) is not None else v for k, v in tensors.items()}
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_int8_expert_weights_refused_not_cast(mixtral, tmp_path):
    config, path = mixtral
    bad = _with(path, tmp_path / "int8", lambda k: torch.int8 if ".experts." in k else None)
    target = build_target(config)
    before = {n: t.clone() for n, t in target.state_dict().items()}
    with pytest.raises(CheckpointFormatError, match=r"int8.*model\.safetensors: tensor '.*experts\.\d+\.w1\.weight' "
                       r"has dtype I8, but '.*experts\.w13' is float32"):
        load_weights(target, bad)
    for name, t in target.state_dict().items():  # refused before any write
        assert torch.equal(t, before[name]), name


def test_integer_dense_weight_refused(mixtral, tmp_path):
    config, path = mixtral
    bad = _with(path, tmp_path / "i64", lambda k: torch.int64 if k.endswith("input_layernorm.weight") else None)
    with pytest.raises(CheckpointFormatError, match=r"'model\.layers\.0\.input_layernorm\.weight' has dtype I64"):
        load_weights(build_target(config), bad)


def test_load_experts_refuses_integer_source(mixtral, tmp_path):
    config, path = mixtral
    bad = _with(path, tmp_path / "u8", lambda k: torch.uint8 if ".experts." in k else None)
    target = build_target(config)
    experts = next(m for m in target.modules() if isinstance(m, Experts))
    name = next(n for n, m in target.named_modules() if m is experts)
    with pytest.raises(CheckpointFormatError, match="has dtype U8"):
        load_experts(bad, experts, name)


def test_float_checkpoint_of_other_precision_still_loads(mixtral, tmp_path):
    config, path = mixtral
    ok = _with(path, tmp_path / "bf16", lambda k: torch.bfloat16)
    report = load_weights(build_target(config), ok)
    assert "model.layers.0.mlp.experts.w13" in report.loaded


def _stored_dtypes(directory) -> set[str]:
    from safetensors import safe_open

    out = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            out |= {handle.get_slice(k).get_dtype() for k in handle.keys()}
    return out


def test_make_tiny_torch_dtype_override_is_the_stored_dtype(tmp_path):
    import json

    from launch.tiny_checkpoint import make_tiny_checkpoint

    out = make_tiny_checkpoint("mixtral", tmp_path / "bf16", config_overrides={"torch_dtype": "bfloat16"})
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert _stored_dtypes(out) == {"BF16"}


def test_make_tiny_refuses_a_torch_dtype_it_cannot_store(tmp_path, capsys):
    from launch.tiny_checkpoint import main

    rc = main(["--arch", "mixtral", "--out", str(tmp_path / "fp8"), "--override", "torch_dtype=float8_e4m3fn"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "config override 'torch_dtype' must be one of" in err and "\n" not in err
    assert not (tmp_path / "fp8").exists()


def test_unindexed_shards_with_one_missing_name_the_shard(tmp_path):
    from moe.loader import Checkpoint, CheckpointNotFoundError

    for i in (1, 3):
        save_file({f"t{i}": torch.zeros(2)}, tmp_path / f"model-{i:05d}-of-00003.safetensors")
    with pytest.raises(CheckpointNotFoundError, match=r"shard 'model-00002-of-00003\.safetensors' does not exist "
                       r"\(2 of 3 shards of 'model' here, and no model\.safetensors\.index\.json\)"):
        Checkpoint(tmp_path)


def test_unindexed_complete_shards_still_open(tmp_path):
    from moe.loader import Checkpoint

    for i in (1, 2):
        save_file({f"t{i}": torch.zeros(2)}, tmp_path / f"model-{i:05d}-of-00002.safetensors")
    save_file({"other": torch.zeros(1)}, tmp_path / "extra.safetensors")
    with Checkpoint(tmp_path) as ckpt:
        assert sorted(ckpt.keys()) == ["other", "t1", "t2"]


@pytest.mark.parametrize(("stored", "canonical"), [("embed_tokens.weight", "model.embed_tokens.weight"),
                                                   ("model.lm_head.weight", "lm_head.weight")])
def test_missing_tensor_under_another_prefix_says_so(tmp_path, stored, canonical):
    from moe.loader import MissingTensorError, load_state_dict

    save_file({stored: torch.zeros(4, 2)}, tmp_path / "model.safetensors")
    with pytest.raises(MissingTensorError, match=rf"tensor '{canonical}' not found; .*; the checkpoint has "
                       rf"'{stored}': its names carry another prefix"):
        load_state_dict(tmp_path, {canonical: (4, 2)})
