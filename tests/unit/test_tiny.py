"""moe.tiny writes checkpoints that Hugging Face transformers loads as its own."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from moe.tiny import (
    ARCHITECTURES,
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    build_tiny_config,
    compute_checkpoint_shapes,
    count_parameters,
    write_tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")


def _read_all(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            out |= {k: sf.get_tensor(k) for k in sf.keys()}
    return out


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_dir(request, tmp_path_factory):
    return write_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=3)


def test_transformers_loads_without_missing_or_unexpected_keys(tiny_dir):
    torch.manual_seed(0)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert model.config.model_type == cfg["model_type"]
    assert type(model).__name__ == cfg["architectures"][0]
    # Loaded values are the stored ones (nothing re-initialised).
    stored = _read_all(tiny_dir)
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    ids = torch.randint(0, cfg["vocab_size"], (2, 7))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 7, cfg["vocab_size"])
    assert torch.isfinite(logits).all()
    # Not degenerate: logits spread and differ between positions.
    assert logits.std() > 0.3
    assert not torch.allclose(logits[0, 0], logits[0, 1])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_names_and_shapes_match_transformers_save_pretrained(arch, tmp_path):
    cfg = build_tiny_config(arch)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert compute_checkpoint_shapes(cfg) == theirs


def test_family_specific_names():
    v3 = compute_checkpoint_shapes(build_tiny_config("deepseek_v3"))
    assert "model.layers.0.mlp.gate_proj.weight" in v3  # dense first layer
    assert v3["model.layers.1.mlp.gate.e_score_correction_bias"] == (8,)
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in v3
    assert v3["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert v3["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (32 + 8, 64)
    v2 = compute_checkpoint_shapes(build_tiny_config("deepseek_v2"))
    assert "model.layers.0.self_attn.q_proj.weight" in v2  # q_lora_rank null
    assert not any("e_score_correction_bias" in k for k in v2)
    mix = compute_checkpoint_shapes(build_tiny_config("mixtral"))
    assert mix["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == (64, 96)
    qw = compute_checkpoint_shapes(build_tiny_config("qwen3_moe"))
    assert qw["model.layers.1.self_attn.q_proj.weight"] == (4 * 32, 64)  # head_dim != D / H
    assert qw["model.layers.1.self_attn.k_norm.weight"] == (32,)


def test_config_fields_and_token_ids():
    for arch in ARCHITECTURES:
        cfg = build_tiny_config(arch, vocab_size=600)
        assert cfg["vocab_size"] == 600
        assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
        assert cfg["num_hidden_layers"] in (2, 3)
    v3 = build_tiny_config("deepseek_v3")
    assert v3["rope_scaling"]["type"] == "yarn"
    assert v3["first_k_dense_replace"] == 1 and v3["n_routed_experts"] == 8


def test_small_deepseek_v3_is_a_benchmark_sized_model():
    cfg = build_tiny_config("deepseek_v3", size="small")
    n = count_parameters(cfg)
    assert 0.2e9 <= n <= 1.0e9, n
    assert cfg["hidden_size"] == 1024 and cfg["n_routed_experts"] == 64
    assert cfg["num_experts_per_tok"] == 6 and cfg["n_shared_experts"] == 1
    assert 8 <= cfg["num_hidden_layers"] <= 12 and cfg["kv_lora_rank"] > 0
    assert cfg["torch_dtype"] == "bfloat16"
    for arch in ARCHITECTURES:
        assert 0.2e9 <= count_parameters(build_tiny_config(arch, size="small")) <= 1.0e9


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = _read_all(write_tiny_checkpoint("mixtral", tmp_path / "a", seed=1))
    b = _read_all(write_tiny_checkpoint("mixtral", tmp_path / "b", seed=1))
    c = _read_all(write_tiny_checkpoint("mixtral", tmp_path / "c", seed=2))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_sharded_checkpoint_has_complete_index_and_loads(tmp_path):
    out = write_tiny_checkpoint("deepseek_v3", tmp_path, shard_bytes=200_000, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shapes = compute_checkpoint_shapes(build_tiny_config("deepseek_v3"))
    assert set(index["weight_map"]) == set(shapes)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    assert not (out / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == 2 * sum(math.prod(s) for s in shapes.values())
    tensors = _read_all(out)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}


def test_routers_are_skewed_so_load_is_non_uniform(tmp_path):
    stored = _read_all(write_tiny_checkpoint("qwen3_moe", tmp_path))
    gate = stored["model.layers.1.mlp.gate.weight"]  # [E, D]
    x = torch.randn(4096, gate.shape[1], generator=torch.Generator().manual_seed(0))
    topk = torch.topk(x @ gate.t(), k=2, dim=-1).indices  # [T, K]
    load = torch.bincount(topk.flatten(), minlength=gate.shape[0]).float()
    assert load.max() / load.mean() > 1.3


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'llama'"):
        write_tiny_checkpoint("llama", tmp_path)
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        build_tiny_config("mixtral", size="huge")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_config("mixtral", vocab_size=1)


def test_router_skew_zero_keeps_the_weights_and_skew_touches_only_routers(tmp_path):
    plain = _read_all(write_tiny_checkpoint("deepseek_v3", tmp_path / "a", seed=5))
    same = _read_all(write_tiny_checkpoint("deepseek_v3", tmp_path / "b", seed=5, router_skew=0.0))
    skewed = _read_all(write_tiny_checkpoint("deepseek_v3", tmp_path / "c", seed=5, router_skew=3.0))
    assert all(torch.equal(plain[k], same[k]) for k in plain)
    changed = {k for k in plain if not torch.equal(plain[k], skewed[k])}
    assert changed == {k for k in plain if k.endswith((".mlp.gate.weight", "e_score_correction_bias"))}


def test_router_skew_ranks_experts_per_layer(tmp_path):
    from moe.tiny import apply_router_skew

    w = torch.ones(8, 16)
    a = apply_router_skew("model.layers.1.mlp.gate.weight", w, 2.0, seed=0)
    b = apply_router_skew("model.layers.2.mlp.gate.weight", w, 2.0, seed=0)
    scale_a = a[:, 0]
    # ranked scales exp(-S * j / (E - 1)), j = 0..E-1: hottest 1.0, coldest exp(-2)
    assert sorted(scale_a.tolist(), reverse=True) == pytest.approx([math.exp(-2.0 * j / 7) for j in range(8)])
    assert not torch.equal(scale_a.argsort(), b[:, 0].argsort())  # another order in another layer
    bias = apply_router_skew("model.layers.1.mlp.gate.e_score_correction_bias", torch.zeros(8), 2.0, seed=0)
    assert torch.equal(bias.argsort(), scale_a.argsort())  # the same experts are hot in both
    assert float(bias.max()) == pytest.approx(0.2) and float(bias.min()) == pytest.approx(-0.2)
    assert torch.equal(apply_router_skew("model.layers.1.mlp.gate.weight", w, 0.0, seed=0), w)


def test_router_skew_concentrates_routing(tmp_path):
    """Top-k selection over random hidden states: the skewed router sends most picks to few experts."""
    from moe.tiny import apply_router_skew

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=gen)
    w = torch.randn(8, 64, generator=gen) / 8
    bias = torch.zeros(8)
    name = "model.layers.1.mlp.gate."

    def top2_share(weight, b):
        scores = torch.sigmoid(x @ weight.T) + b  # DeepSeek-V3 selection: scores + correction bias
        counts = torch.bincount(scores.topk(2, dim=1).indices.flatten(), minlength=8).float()
        return float(counts.sort(descending=True).values[:2].sum() / counts.sum())

    flat = top2_share(w, bias)
    skewed = top2_share(apply_router_skew(name + "weight", w, 3.0, 0),
                        apply_router_skew(name + "e_score_correction_bias", bias, 3.0, 0))
    assert flat < 0.4 and skewed > 0.7


def test_config_overrides_shape_the_checkpoint(tmp_path):
    out = write_tiny_checkpoint("mixtral", tmp_path / "m", config_overrides={"hidden_size": 96,
                                                                             "num_local_experts": 4})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 96 and cfg["num_local_experts"] == 4
    tensors = _read_all(out)
    assert tuple(tensors["model.layers.0.block_sparse_moe.gate.weight"].shape) == (4, 96)
    with pytest.raises(ValueError, match="'hiden_size' is not a field"):
        write_tiny_checkpoint("mixtral", tmp_path / "x", config_overrides={"hiden_size": 96})
    with pytest.raises(ValueError, match="router_skew must be >= 0"):
        write_tiny_checkpoint("mixtral", tmp_path / "y", router_skew=-1.0)


def test_make_tiny_override_flags(tmp_path, capsys):
    from launch.tiny_checkpoint import main, parse_config_override

    assert parse_config_override("hidden_size=256") == ("hidden_size", 256)
    assert parse_config_override("rope_scaling=null") == ("rope_scaling", None)
    assert parse_config_override("hidden_act=gelu") == ("hidden_act", "gelu")
    for bad, needle in (["--override", "hidden_size"], "--override expects KEY=VALUE"), \
            (["--override", "vocab_size=100"], "'vocab_size' is not allowed"):
        assert main(["--arch", "mixtral", "--out", str(tmp_path / "t"), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0]


@pytest.mark.parametrize("arch,override,message", [
    ("deepseek_v3", "hidden_size=abc", "config override 'hidden_size' must be a non-negative integer, got \"abc\""),
    ("mixtral", "num_local_experts=abc",
     "config override 'num_local_experts' must be a non-negative integer, got \"abc\""),
    ("deepseek_v3", "hidden_size=-64", "config override 'hidden_size' must be a non-negative integer, got -64"),
    ("deepseek_v3", "hidden_size=1.5", "config override 'hidden_size' must be a non-negative integer, got 1.5"),
    ("deepseek_v3", "q_lora_rank=abc",
     "config override 'q_lora_rank' must be a non-negative integer or null, got \"abc\""),
    ("deepseek_v3", "norm_topk_prob=1", "config override 'norm_topk_prob' must be true or false, got 1"),
    ("deepseek_v3", "hidden_size=0",
     "config override hidden_size=0 gives an invalid deepseek_v3 config: hidden_size must be positive, got 0"),
    ("deepseek_v3", "num_hidden_layers=0", "config override num_hidden_layers=0 gives an invalid deepseek_v3 "
                                           "config: num_hidden_layers must be positive, got 0"),
    ("deepseek_v3", "n_routed_experts=0", "config override n_routed_experts=0 gives an invalid deepseek_v3 "
                                          "config: num_experts must be positive, got 0"),
    ("deepseek_v3", "num_experts_per_tok=100", "config override num_experts_per_tok=100 gives an invalid "
                                               "deepseek_v3 config: num_experts_per_tok 100 > num_experts 8"),
    ("deepseek_v3", "intermediate_size=0", "config override intermediate_size=0 gives an invalid deepseek_v3 "
     "config: tensor model.layers.0.mlp.gate_proj.weight would have the empty shape [0, 64]"),
    ("mixtral", "max_position_embeddings=0", "config override max_position_embeddings=0 gives an invalid "
                                             "mixtral config: max_position_embeddings must be positive"),
])
def test_make_tiny_refuses_bad_overrides_and_leaves_no_folder(arch, override, message, tmp_path, capsys):
    from launch.tiny_checkpoint import main

    out = tmp_path / "new" / "ckpt"
    assert main(["--arch", arch, "--out", str(out), "--override", override]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"error: {message}" and "parameters" not in captured.out
    assert list(tmp_path.iterdir()) == []
    existing = tmp_path / "existing"  # a folder that was there before is kept, and stays as it was
    existing.mkdir()
    assert main(["--arch", arch, "--out", str(existing), "--override", override]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert existing.is_dir() and list(existing.iterdir()) == []


def test_make_tiny_bad_out(tmp_path, capsys, monkeypatch):
    from launch import tiny_checkpoint
    from launch.tiny_checkpoint import main

    afile = tmp_path / "afile"
    afile.write_text("keep me")
    monkeypatch.chdir(tmp_path)
    for out, message in (("", "--out: an empty path"),
                         (str(afile), f"--out: {afile} exists and is not a directory"),
                         (f"{afile}/sub", f"--out: {afile} is not a directory")):
        assert main(["--arch", "mixtral", "--out", out]) == 2
        assert capsys.readouterr().err.strip() == f"error: {message}"
    assert afile.read_text() == "keep me" and [p.name for p in tmp_path.iterdir()] == ["afile"]

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # A failure while writing removes the folders this run created, never one that existed before.
    monkeypatch.setattr(tiny_checkpoint, "write_tokenizer", disk_full)
    assert main(["--arch", "mixtral", "--out", str(tmp_path / "a" / "b")]) == 2
    assert capsys.readouterr().err.strip() == "error: [Errno 28] No space left on device"
    assert not (tmp_path / "a").exists()
    assert main(["--arch", "mixtral", "--out", str(tmp_path)]) == 2
    assert afile.read_text() == "keep me"


def test_make_tiny_nullable_override_is_accepted(tmp_path):
    from launch.tiny_checkpoint import make_tiny_checkpoint
    from moe.config import ModelConfig

    out = make_tiny_checkpoint("deepseek_v3", tmp_path / "v2lite", config_overrides={"q_lora_rank": None})
    assert ModelConfig.from_hf(out).q_lora_rank is None
