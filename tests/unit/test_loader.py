"""moe.loader against tiny random Hugging Face checkpoints (transformers save_pretrained)
and hand-written fused-expert checkpoints."""

from __future__ import annotations

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from moe import loader
from moe.loader import LoadReport, TensorRequest, load_experts, load_state_dict, load_weights
from moe.loading.plan import fused_is_transposed
from tests.unit.loader_support import (
    HID,
    INTER,
    NEXP,
    VOCAB,
    RecordingOpen,
    build_hf_model,
    build_target,
    expected_tensors,
    is_moe_layer,
    save_hf,
    write_config,
)

FAMILIES = ["deepseek_v3", "deepseek_v2", "mixtral", "qwen3_moe"]
SLOTS = {0: [3, 1, 3], 1: [2, 0]}  # layer -> logical expert per local slot; expert 3 replicated


@pytest.fixture(scope="module")
def hf_models():
    return {family: build_hf_model(family, seed=k) for k, family in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def checkpoints(hf_models, tmp_path_factory):
    """(family, sharded) -> checkpoint directory."""
    root = tmp_path_factory.mktemp("ckpts")
    return {
        (f, sharded): save_hf(m, root / f"{f}-{int(sharded)}", sharded)
        for f, m in hf_models.items()
        for sharded in (False, True)
    }


def _moe_layers(hf) -> list[int]:
    return [i for i, layer in enumerate(hf.model.layers) if is_moe_layer(layer)]


def _assert_matches(target, expected: dict[str, torch.Tensor], dtype=torch.float32) -> None:
    sd = target.state_dict()
    assert set(sd) == set(expected)
    for name, want in expected.items():
        assert sd[name].shape == want.shape, name
        assert sd[name].dtype == (torch.float32 if name.endswith("correction_bias") else dtype), name
        torch.testing.assert_close(sd[name], want.to(sd[name].dtype), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_load_weights_matches_transformers(family, sharded, hf_models, checkpoints):
    hf = hf_models[family]
    target = build_target(hf, SLOTS)
    report = load_weights(target, checkpoints[family, sharded], strict=False)
    _assert_matches(target, expected_tensors(hf, SLOTS))
    assert isinstance(report, LoadReport) and report.family == family
    assert len(report.files) == (1 if not sharded else len(list(checkpoints[family, sharded].glob("*.safetensors"))))
    assert set(report.loaded) == set(target.state_dict())
    # per MoE layer: (E - distinct hosted experts) x 3 per-expert tensors were left unread
    moe = _moe_layers(hf)
    assert report.skipped_experts == sum(3 * (NEXP - len(set(SLOTS[i]))) for i in moe)
    assert "model.norm.weight" in report.unexpected  # the target has no final norm
    assert not any(".experts." in k for k in report.unexpected)
    assert not report.tied_lm_head


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_reads_only_hosted_experts_and_opens_each_shard_once(family, hf_models, checkpoints, monkeypatch):
    rec = RecordingOpen(loader.Checkpoint.__init__.__globals__["safe_open"])
    monkeypatch.setattr("moe.loading.checkpoint.safe_open", rec)
    path = checkpoints[family, True]
    target = build_target(hf_models[family], SLOTS)
    report = load_weights(target, path, strict=False)
    shards = sorted(str(p) for p in path.glob("*.safetensors"))
    assert sorted(rec.opened) == shards  # each shard opened exactly once
    keys = rec.keys_read()
    assert len(keys) == len(set(keys)) == report.num_reads  # nothing read twice, replicas included
    projs = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    hosted = {
        f"model.layers.{i}.{block}.experts.{e}.{p}.weight"
        for i in _moe_layers(hf_models[family])
        for e in set(SLOTS[i])
        for p in projs
    }
    assert {k for k in keys if ".experts." in k} == hosted


def _write_fused(hf, out, family: str, transposed: bool) -> None:
    """The transformers in-memory state dict as one safetensors file: fused experts."""
    tensors = {}
    for k, v in hf.state_dict().items():
        if transposed and k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            v = v.transpose(1, 2)
        tensors[k] = v.contiguous()
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    hf.config.to_json_file(out / "config.json")
    assert family in (out / "config.json").read_text()


@pytest.mark.parametrize("transposed", [False, True], ids=["E2ID", "ED2I"])
@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_fused_expert_checkpoint(family, transposed, hf_models, tmp_path, monkeypatch):
    hf = hf_models[family]
    _write_fused(hf, tmp_path / "fused", family, transposed)
    rec = RecordingOpen(loader.Checkpoint.__init__.__globals__["safe_open"])
    monkeypatch.setattr("moe.loading.checkpoint.safe_open", rec)
    target = build_target(hf, SLOTS)
    report = load_weights(target, tmp_path / "fused", strict=False)
    _assert_matches(target, expected_tensors(hf, SLOTS))
    fused_reads = sorted((k, i) for k, i in rec.reads if k.endswith(("gate_up_proj", "down_proj")))
    want = sorted(
        (f"model.layers.{i}.mlp.experts.{leaf}", e)
        for i in _moe_layers(hf)
        for e in set(SLOTS[i])
        for leaf in ("gate_up_proj", "down_proj")
    )
    assert fused_reads == want  # one expert row per hosted expert, never the whole [E, ...] tensor
    assert report.skipped_experts == 0 and not any(".experts." in k for k in report.unexpected)


def test_fused_layout_detection():
    inter, hidden = 4, 16
    assert fused_is_transposed((NEXP, 8, 16), (NEXP, 16, 4), inter, hidden) is False  # [E, 2I, D], [E, D, I]
    assert fused_is_transposed((NEXP, 16, 8), (NEXP, 4, 16), inter, hidden) is True  # [E, D, 2I], [E, I, D]
    assert fused_is_transposed((NEXP, 16, 8), None, inter, hidden) is True
    assert fused_is_transposed(None, (NEXP, 16, 4), inter, hidden) is False
    # 2I == D (as in the fixtures above): gate_up alone is ambiguous; down_proj decides
    assert fused_is_transposed((NEXP, 8, 8), (NEXP, 4, 8), 4, 8) is True
    assert fused_is_transposed((NEXP, 8, 8), (NEXP, 8, 4), 4, 8) is False
    assert fused_is_transposed((NEXP, 8, 8), None, 4, 8) is False  # documented default: transformers layout
    assert fused_is_transposed((NEXP, 8, 16), (NEXP, 4, 16), inter, hidden) is None  # mixed layouts
    assert fused_is_transposed((NEXP, 3, 5), None, inter, hidden) is None
    assert fused_is_transposed((8, 16), None, inter, hidden) is None  # not 3-D


def test_tied_embeddings(tmp_path):
    hf = build_hf_model("qwen3_moe", seed=7, tie_word_embeddings=True)
    path = save_hf(hf, tmp_path / "tied")
    assert "lm_head.weight" not in safetensors.safe_open(path / "model.safetensors", "pt").keys()
    untied = build_target(hf, SLOTS)
    report = load_weights(untied, path, strict=False)
    assert report.tied_lm_head
    torch.testing.assert_close(untied.lm_head.weight, hf.model.embed_tokens.weight, rtol=0, atol=0)
    tied = build_target(hf, SLOTS, tie=True)
    load_weights(tied, path, strict=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    torch.testing.assert_close(tied.lm_head.weight, hf.model.embed_tokens.weight, rtol=0, atol=0)
    # a tied model with an untied checkpoint whose lm_head differs: the head is untied and loaded, as
    # transformers loads it (test_a_tied_config_with_a_different_lm_head_in_the_checkpoint_loads_it_untied)
    untied_hf = build_hf_model("qwen3_moe", seed=8)
    report = load_weights(tied, save_hf(untied_hf, tmp_path / "untied"), strict=False)
    assert "lm_head.weight" in report.loaded and not report.tied_lm_head
    torch.testing.assert_close(tied.lm_head.weight, untied_hf.lm_head.weight, rtol=0, atol=0)


def test_dtype_conversion(hf_models, checkpoints):
    hf = hf_models["deepseek_v3"]
    target = build_target(hf, SLOTS, dtype=torch.bfloat16)
    load_weights(target, checkpoints["deepseek_v3", False], dtype=torch.bfloat16, strict=False)
    _assert_matches(target, expected_tensors(hf, SLOTS), dtype=torch.bfloat16)
    half = build_target(hf, SLOTS, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16.*bfloat16"):
        load_weights(half, checkpoints["deepseek_v3", False], dtype=torch.bfloat16, strict=False)


def test_load_state_dict_without_a_model(hf_models, checkpoints):
    hf = hf_models["mixtral"]
    path = checkpoints["mixtral", True]
    want = expected_tensors(hf, SLOTS)
    out, report = load_state_dict(path, {"model.layers.1.mlp.gate.weight": (NEXP, HID)}, dtype=torch.bfloat16)
    assert out["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert out["model.layers.1.mlp.gate.weight"].shape == (NEXP, HID)
    torch.testing.assert_close(out["model.layers.1.mlp.gate.weight"], want["model.layers.1.mlp.gate.weight"].bfloat16())
    reqs = [
        TensorRequest("model.layers.0.mlp.experts.w13", (3, 2 * INTER, HID), tuple(SLOTS[0])),
        TensorRequest("model.layers.0.mlp.experts.w2", (3, HID, INTER), tuple(SLOTS[0])),
    ]
    out, report = load_state_dict(path, reqs)
    assert out["model.layers.0.mlp.experts.w13"].dtype == torch.float32  # checkpoint dtype
    for r in reqs:
        assert out[r.name].shape == r.shape
        torch.testing.assert_close(out[r.name], want[r.name], rtol=0, atol=0)
    assert report.num_reads == 3 * len(set(SLOTS[0]))
    # a rank that hosts no expert of a layer: [0, 2I, D], nothing read
    empty = TensorRequest("model.layers.1.mlp.experts.w13", (0, 2 * INTER, HID), ())
    out, report = load_state_dict(path, [empty])
    assert out[empty.name].shape == (0, 2 * INTER, HID) and report.num_reads == 0


def test_load_experts_reloads_only_given_slots(hf_models, checkpoints, monkeypatch):
    hf = hf_models["qwen3_moe"]
    target = build_target(hf, SLOTS)
    load_weights(target, checkpoints["qwen3_moe", True], strict=False)
    experts = target.model.layers[1].mlp.experts
    before_w13 = experts.w13.clone()
    experts.slot_to_logical.copy_(torch.tensor([3, 1]))  # slot 0: 2 -> 3 (migration); slot 1: 0 -> 1
    rec = RecordingOpen(loader.Checkpoint.__init__.__globals__["safe_open"])
    monkeypatch.setattr("moe.loading.checkpoint.safe_open", rec)
    with loader.Checkpoint(checkpoints["qwen3_moe", True]) as ckpt:
        load_experts(ckpt, target.model.layers[0].mlp.experts, "model.layers.0.mlp.experts")  # counted apart
        rec.reads.clear()
        report = load_experts(ckpt, experts, "model.layers.1.mlp.experts", slots=[0])
    fused = hf.state_dict()
    torch.testing.assert_close(experts.w13[0], fused["model.layers.1.mlp.experts.gate_up_proj"][3], rtol=0, atol=0)
    torch.testing.assert_close(experts.w2[0], fused["model.layers.1.mlp.experts.down_proj"][3], rtol=0, atol=0)
    torch.testing.assert_close(experts.w13[1], before_w13[1], rtol=0, atol=0)  # slot 1 untouched
    assert sorted(rec.keys_read()) == sorted(
        f"model.layers.1.mlp.experts.3.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
    )
    assert report.loaded == ["model.layers.1.mlp.experts.w13", "model.layers.1.mlp.experts.w2"]
    assert report.num_reads == 3 and report.num_bytes_read == 3 * INTER * HID * 4


def test_leftovers_are_classified(tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    w = torch.randn(4, 4)
    save_file(
        {
            "model.embed_tokens.weight": w,
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2),
            "model.layers.3.eh_proj.weight": w.clone(),  # past num_hidden_layers: DeepSeek-V3 MTP
            "model.layers.0.mlp.experts.1.gate_proj.weight": w.clone(),  # a layer the request has no experts of
            "mystery.weight": w.clone(),
        },
        out / "model.safetensors",
    )
    write_config(out, model_type="deepseek_v3", num_hidden_layers=3, num_nextn_predict_layers=1)
    got, report = load_state_dict(out, {"model.embed_tokens.weight": (4, 4)})
    torch.testing.assert_close(got["model.embed_tokens.weight"], w, rtol=0, atol=0)
    assert sorted(report.ignored) == ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.3.eh_proj.weight"]
    assert sorted(report.unexpected) == ["model.layers.0.mlp.experts.1.gate_proj.weight", "mystery.weight"]
    assert report.skipped_experts == 0


def test_a_tied_config_with_a_different_lm_head_in_the_checkpoint_loads_it_untied(tmp_path, caplog):
    """transformers (the reference) leaves lm_head untied when the checkpoint's lm_head.weight differs
    from the embedding whatever tie_word_embeddings says; an equal copy keeps the tie."""
    import transformers as tf
    from safetensors.torch import load_file

    hf = build_hf_model("qwen3_moe", seed=7, tie_word_embeddings=True)
    path = save_hf(hf, tmp_path / "tied")
    tensors = load_file(path / "model.safetensors")
    head = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file({**tensors, "lm_head.weight": head}, path / "model.safetensors", metadata={"format": "pt"})

    target = build_target(hf, SLOTS, tie=True)
    with caplog.at_level("WARNING", logger="moe.loader"):
        report = load_weights(target, path, strict=False)
    assert not report.tied_lm_head and "loading both untied, as transformers does" in caplog.text
    assert target.lm_head.weight is not target.model.embed_tokens.weight
    torch.testing.assert_close(target.lm_head.weight, head, rtol=0, atol=0)
    torch.testing.assert_close(target.model.embed_tokens.weight, tensors["model.embed_tokens.weight"], rtol=0, atol=0)
    reference = tf.AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(reference.lm_head.weight, head, rtol=0, atol=0)

    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, path / "model.safetensors",
              metadata={"format": "pt"})
    same = build_target(hf, SLOTS, tie=True)
    report = load_weights(same, path, strict=False)
    assert report.tied_lm_head and "lm_head.weight" in report.ignored
    assert same.lm_head.weight is same.model.embed_tokens.weight


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_no_shared_experts_loads_and_generates_as_transformers(family, tmp_path):
    """n_shared_experts=0: transformers saves the shared MLP with no elements (gate_proj [0, D]) and
    runs it; those tensors are ignored, not unexpected."""
    from tests.oracles import hf_greedy, make_prompts, run

    hf = build_hf_model(family, seed=3, n_shared_experts=0)
    path = save_hf(hf, tmp_path / family)
    empty = [k for k in safetensors.safe_open(path / "model.safetensors", "pt").keys() if "shared_experts" in k]
    assert empty, "transformers no longer saves the empty shared MLP: this test checks nothing"
    prompts = make_prompts(0, 3, VOCAB)
    assert run(path, prompts, n=6) == hf_greedy(path, prompts, 6)
