"""moe.loader error paths: every bad checkpoint fails with a LoadError naming the file
and tensor, before any model weight is written."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe.loader import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    LoadError,
    MissingTensorError,
    TensorRequest,
    TensorShapeError,
    load_state_dict,
    load_weights,
)
from tests.unit.loader_support import HID, INTER, build_hf_model, build_target, save_hf, write_config

SLOTS = {0: [3, 1, 3], 1: [2, 0]}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    hf = build_hf_model("mixtral", seed=3)
    root = tmp_path_factory.mktemp("err")
    return hf, save_hf(hf, root / "single"), save_hf(hf, root / "sharded", sharded=True)


def _rewrite(src: Path, dst: Path, drop: str = "", replace: dict[str, torch.Tensor] | None = None) -> Path:
    """Copy a single-file checkpoint, dropping or replacing tensors."""
    tensors = load_file(src / "model.safetensors")
    tensors.pop(drop, None)
    tensors.update(replace or {})
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def _snapshot(target) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in target.state_dict().items()}


def _assert_untouched(target, before: dict[str, torch.Tensor]) -> None:
    for name, t in target.state_dict().items():
        assert torch.equal(t, before[name]), f"{name} was written before the error"


def test_path_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nowhere") as info:
        load_state_dict(tmp_path / "nowhere", {})
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, LoadError)


def test_directory_without_safetensors(tmp_path):
    write_config(tmp_path, model_type="mixtral")
    with pytest.raises(CheckpointNotFoundError, match="no safetensors weights"):
        load_state_dict(tmp_path, {})


class _Boom:
    """Unpickling this creates a marker file: proves the loader never unpickles."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "consolidated.pt"])
def test_pickle_weights_refused_never_unpickled(tmp_path, name):
    marker = tmp_path / "unpickled"
    (tmp_path / name).write_bytes(pickle.dumps(_Boom(str(marker))))
    for path in (tmp_path, tmp_path / name):
        with pytest.raises(CheckpointFormatError, match=f"{name}.*refused.*[Cc]onvert.*safetensors") as info:
            load_state_dict(path, {})
        assert isinstance(info.value, ValueError)
    assert not marker.exists()


def test_not_a_weight_file(tmp_path):
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(CheckpointFormatError, match="weights.txt.*not a safetensors"):
        load_state_dict(tmp_path / "weights.txt", {})


def test_missing_router_names_canonical_and_checkpoint_names(mixtral, tmp_path):
    hf, single, _ = mixtral
    path = _rewrite(single, tmp_path / "ck", drop="model.layers.1.block_sparse_moe.gate.weight")
    target = build_target(hf, SLOTS)
    before = _snapshot(target)
    with pytest.raises(MissingTensorError) as info:
        load_weights(target, path, strict=False)
    msg = str(info.value)
    assert "'model.layers.1.mlp.gate.weight'" in msg and "'model.layers.1.block_sparse_moe.gate.weight'" in msg
    assert str(path) in msg and info.value.canonical == "model.layers.1.mlp.gate.weight"
    _assert_untouched(target, before)


def test_missing_hosted_expert_fails_unhosted_does_not(mixtral, tmp_path):
    hf, single, _ = mixtral
    hosted = _rewrite(single, tmp_path / "a", drop="model.layers.1.block_sparse_moe.experts.2.w3.weight")
    target = build_target(hf, SLOTS)
    before = _snapshot(target)
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.experts\.w13 \(logical expert 2\).*experts\.2\.w3"):
        load_weights(target, hosted, strict=False)
    _assert_untouched(target, before)
    unhosted = _rewrite(single, tmp_path / "b", drop="model.layers.1.block_sparse_moe.experts.3.w3.weight")
    load_weights(target, unhosted, strict=False)  # layer 1 hosts experts 2 and 0 only: expert 3 is never needed
    assert bool((target.model.layers[1].mlp.experts.w13 != 0).all())


def test_wrong_shape_names_tensor_expected_and_found(mixtral, tmp_path):
    hf, single, _ = mixtral
    path = _rewrite(single, tmp_path / "ck", replace={"model.layers.0.input_layernorm.weight": torch.ones(HID + 1)})
    target = build_target(hf, SLOTS)
    before = _snapshot(target)
    with pytest.raises(TensorShapeError) as info:
        load_weights(target, path, strict=False)
    assert "model.layers.0.input_layernorm.weight" in str(info.value)
    assert f"expected [{HID}], found [{HID + 1}]" in str(info.value)
    assert (info.value.expected, info.value.found) == ((HID,), (HID + 1,))
    _assert_untouched(target, before)
    bad_expert = _rewrite(
        single, tmp_path / "ex", replace={"model.layers.0.block_sparse_moe.experts.1.w2.weight": torch.ones(HID, 3)}
    )
    with pytest.raises(TensorShapeError, match=rf"logical expert 1.*experts\.1\.w2.*expected \[{HID}, {INTER}\], found \[{HID}, 3\]"):
        load_weights(target, bad_expert, strict=False)


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_shard_names_the_file(mixtral, tmp_path, damage):
    hf, _, sharded = mixtral
    path = tmp_path / "ck"
    shutil.copytree(sharded, path)
    shard = sorted(path.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-7] if damage == "truncate" else b"\xff" * 8 + data[8:])
    target = build_target(hf, SLOTS)
    before = _snapshot(target)
    with pytest.raises(CheckpointFormatError, match=f"{shard.name}: corrupt or truncated"):
        load_weights(target, path, strict=False)
    _assert_untouched(target, before)


def test_index_pointing_at_missing_shard(mixtral, tmp_path):
    _, _, sharded = mixtral
    path = tmp_path / "ck"
    shutil.copytree(sharded, path)
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointNotFoundError, match=f"model.safetensors.index.json: shard '{shard.name}'"):
        load_state_dict(path, {})


def test_index_inconsistent_with_shards(mixtral, tmp_path):
    _, _, sharded = mixtral
    path = tmp_path / "ck"
    shutil.copytree(sharded, path)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = next(s for s in shards if s != index["weight_map"]["model.norm.weight"])
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match="model.norm.weight.*does not hold it"):
        load_state_dict(path, {})
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match="'../elsewhere.safetensors', not a .safetensors file name in the index's"):
        load_state_dict(path, {})
    index_path.write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="index.json: cannot read the safetensors index"):
        load_state_dict(path, {})
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointFormatError, match="no 'weight_map'"):
        load_state_dict(path, {})


def test_duplicate_tensor_across_unindexed_files(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "part1.safetensors")
    save_file({"a": torch.zeros(2)}, tmp_path / "part2.safetensors")
    with pytest.raises(CheckpointFormatError, match="'a' appears in both .*part1.* and .*part2"):
        load_state_dict(tmp_path, {"a": (2,)})


def test_a_stale_copy_in_another_shard_loses_to_the_index(tmp_path, caplog):
    """transformers reads the shard the index names; a copy left in another shard is stale. Without
    an index (or one naming neither file) the two copies stay ambiguous: an error."""
    save_file({"a": torch.ones(2), "b": torch.ones(1)}, tmp_path / "part1.safetensors")
    save_file({"a": torch.zeros(2)}, tmp_path / "part2.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "part2.safetensors", "b": "part1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level("WARNING", logger="moe.loading.checkpoint"):
        state, _ = load_state_dict(tmp_path, {"a": (2,), "b": (1,)})
    assert torch.equal(state["a"], torch.zeros(2)) and "reading part2.safetensors" in caplog.text
    index["weight_map"]["a"] = "part1.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(load_state_dict(tmp_path, {"a": (2,), "b": (1,)})[0]["a"], torch.ones(2))


def test_quantized_dtype_refused(tmp_path):
    save_file({"w": torch.ones(2, 2).to(torch.float8_e4m3fn)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointFormatError, match="'w' has dtype F8_E4M3, but config.json has no fp8 quantization"):
        load_state_dict(tmp_path, {"w": (2, 2)})


def test_fused_tensor_errors(tmp_path):
    gate_up, down = torch.randn(4, 2 * INTER, HID), torch.randn(4, HID, INTER)
    prefix = "model.layers.0.mlp.experts"
    for name, down_t in (("good", down), ("bad", down[:, :, :3].contiguous())):  # bad: wrong I
        (tmp_path / name).mkdir()
        save_file({f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down_t},
                  tmp_path / name / "model.safetensors")  # fmt: skip
        write_config(tmp_path / name, model_type="deepseek_v3", num_hidden_layers=1)
    w13 = TensorRequest(f"{prefix}.w13", (2, 2 * INTER, HID), (1, 3))
    out, _ = load_state_dict(tmp_path / "good", [w13])
    torch.testing.assert_close(out[w13.name], gate_up[[1, 3]], rtol=0, atol=0)
    with pytest.raises(MissingTensorError, match=r"logical expert 5.*gate_up_proj\[5\] \(holds 4 experts\)"):
        load_state_dict(tmp_path / "good", [TensorRequest(w13.name, w13.shape, (1, 5))])
    w2 = TensorRequest(f"{prefix}.w2", (2, HID, INTER), (1, 3))
    with pytest.raises(TensorShapeError, match=rf"experts.w2 \(checkpoint '{prefix}.down_proj'\): expected \[4, {HID}, {INTER}\], found \[4, {HID}, 3\]"):
        load_state_dict(tmp_path / "bad", [w2])


def test_bad_expert_requests(tmp_path):
    save_file({"x": torch.ones(1)}, tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.experts.w13"
    with pytest.raises(ValueError, match="slot 3 is out of range"):
        load_state_dict(tmp_path, [TensorRequest(name, (2, 2 * INTER, HID), (0, 1), slots=(3,))])
    with pytest.raises(ValueError, match="2 slots"):
        load_state_dict(tmp_path, [TensorRequest(name, (3, 2 * INTER, HID), (0, 1))])


def test_errors_with_fields_pickle_whole():
    """A rank's load error crosses Ray to the driver by pickling: the class, its fields and its
    message (rewritten by the executor to name the rank) survive."""
    shape = TensorShapeError("a.weight", "model.a.weight", (4, 2), (4, 3), "/ck/model.safetensors")
    shape.args = ("worker rank 1: " + str(shape),)
    back = pickle.loads(pickle.dumps(shape))
    assert type(back) is TensorShapeError and str(back) == str(shape)
    assert (back.canonical, back.key, back.expected, back.found) == ("a.weight", "model.a.weight", (4, 2), (4, 3))
    missing = pickle.loads(pickle.dumps(MissingTensorError("b", ["x", "y"], "/ck")))
    assert type(missing) is MissingTensorError and missing.tried == ["x", "y"]
    assert str(missing) == "/ck: tensor 'b' not found; looked for checkpoint name(s) 'x', 'y'"
