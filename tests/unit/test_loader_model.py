"""moe.loader into the real MoEModel: every canonical tensor of a rank's shard (a subset of
experts with a replica) equals transformers' weights, and a full model consumes every
tensor of a checkpoint written by moe.tiny (no unexpected leftovers)."""

from __future__ import annotations

import pytest
import torch

from moe.config import ModelConfig
from moe.loader import load_weights
from moe.model import MoEModel
from moe.tiny import write_tiny_checkpoint
from tests.unit.loader_support import NEXP, build_hf_model, save_hf

FAMILIES = ["deepseek_v3", "deepseek_v2", "mixtral", "qwen3_moe"]
LOCAL = [2, 0, 2]  # this rank's slots: logical experts 2 (twice: a replica) and 0


def _oracle(hf, name: str, slot_to_logical: torch.Tensor) -> torch.Tensor:
    sd = hf.state_dict()
    if name.endswith("experts.w13"):
        return sd[name.replace("experts.w13", "experts.gate_up_proj")][slot_to_logical]
    if name.endswith("experts.w2"):
        return sd[name.replace("experts.w2", "experts.down_proj")][slot_to_logical]
    return sd[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_model_shard_matches_transformers(family, dtype, tmp_path):
    hf = build_hf_model(family, seed=11)
    path = save_hf(hf, tmp_path / family, sharded=True)
    model = MoEModel(ModelConfig.from_hf(path), dtype=dtype, local_slots=LOCAL)
    report = load_weights(model, path, dtype=dtype)
    sd = model.state_dict()
    assert set(report.loaded) == set(sd) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    experts = {f"model.layers.{layer.layer_id}.mlp.experts": layer.experts for layer in model.moe_layers()}
    for name, tensor in sd.items():
        p2l = experts[name.rsplit(".", 1)[0]].slot_to_logical if ".experts.w" in name else None
        want = _oracle(hf, name, p2l)
        assert tensor.shape == want.shape, name
        torch.testing.assert_close(tensor, want.to(tensor.dtype), rtol=0, atol=0, msg=name)
    assert report.unexpected == []
    assert report.skipped_experts == 3 * (NEXP - len(set(LOCAL))) * len(experts)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_model_consumes_every_tiny_checkpoint_tensor(family, tmp_path):
    path = write_tiny_checkpoint(family, tmp_path / family, shard_bytes=64 * 1024)
    model = MoEModel(ModelConfig.from_hf(path), dtype=torch.float32)
    report = load_weights(model, path, dtype=torch.float32)
    assert report.unexpected == [] and report.skipped_experts == 0
    assert len(report.files) == len(list(path.glob("*.safetensors")))
    assert all(t.abs().sum() > 0 for n, t in model.state_dict().items() if "bias" not in n), "a tensor stayed zero"
