"""train-tiny: the trainable model is the checkpoint's model, training moves the routers,
and what it writes loads back token-exact in the engine and in transformers."""

from __future__ import annotations

import json

import pytest
import torch

from launch.training.corpus import CORPUS_KINDS, TokenWindows, load_corpus
from launch.training.model import TrainableMoE
from launch.training.report import compute_balancedness
from launch.training.train import (
    TRAIN_ARCHITECTURES,
    TrainArgs,
    apply_bias_update_,
    build_train_config,
    learning_rate,
    main,
    train,
)
from moe.config import ModelConfig
from moe.tiny import compute_checkpoint_shapes, count_parameters, save_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread avoids OpenMP barrier stalls on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(arch: str, seed: int = 0) -> TrainableMoE:
    model = TrainableMoE(ModelConfig.from_hf(build_train_config(arch)))
    model.init_weights_(seed)
    return model


def hf_uncached_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' full forward over the whole sequence for every new token (no KV cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf_model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", TRAIN_ARCHITECTURES)
def test_train_configs_are_a_few_million_parameters(arch: str) -> None:
    cfg = build_train_config(arch)
    assert 1_000_000 < count_parameters(cfg) < 5_000_000
    model = _model(arch)
    hf = model.hf_state_dict()
    shapes = compute_checkpoint_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in hf.items()} == shapes
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("arch", TRAIN_ARCHITECTURES)
def test_trainable_logits_equal_transformers(arch: str, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    model = _model(arch, seed=1)
    with torch.no_grad():
        for m in model.moe_layers():
            if m.gate.e_score_correction_bias is not None:
                m.gate.e_score_correction_bias.copy_(0.1 * torch.randn(m.gate.e_score_correction_bias.shape))
    save_checkpoint(build_train_config(arch), model.hf_state_dict(), tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(2, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, ref = model(ids), hf(ids).logits
    assert mine.shape == ref.shape == (2, 33, 512)
    assert (mine - ref).abs().max() < 1e-4
    counts = model.last_expert_counts
    cfg = model.config
    assert counts.shape == (len(cfg.moe_layer_ids), cfg.num_experts)
    assert (counts.sum(-1) == 2 * 33 * cfg.num_experts_per_tok).all()


def test_bias_update_moves_toward_balance() -> None:
    model = _model("deepseek_v3")
    ids = torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids)
    counts = model.last_expert_counts.float()
    apply_bias_update_(model, 0.01)
    for m, c in zip(model.moe_layers(), counts):
        bias = m.gate.e_score_correction_bias
        assert not bias.requires_grad
        assert torch.equal(bias, 0.01 * torch.sign(c.mean() - c))


def test_gradients_reach_routers_but_not_the_bias() -> None:
    model = _model("deepseek_v3")
    ids = torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 512), ids[:, 1:].reshape(-1)).backward()
    for m in model.moe_layers():
        assert m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0
        assert m.gate.e_score_correction_bias.grad is None


def test_balancedness_and_schedule() -> None:
    counts = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [8, 0, 0, 0, 0, 0, 0, 0], [0] * 8])
    assert compute_balancedness(counts, 4) == [1.0, 0.25, 1.0]
    assert compute_balancedness(counts, 8)[1] == pytest.approx(1 / 8)
    args = TrainArgs(arch="mixtral", out="x", lr=1.0, warmup_steps=10)
    assert learning_rate(args, 0.0, 0) == pytest.approx(0.1)
    assert learning_rate(args, 0.0, 10) == pytest.approx(1.0)
    assert learning_rate(args, 1.0, 99) == pytest.approx(0.1)


def test_corpus_windows_start_with_bos_and_cover_every_kind(tmp_path) -> None:
    from launch.tiny_checkpoint import train_tokenizer, write_tokenizer
    from launch.tokenizer import Tokenizer

    write_tokenizer(tmp_path, train_tokenizer(512), model_max_length=2048)
    tok = Tokenizer.from_dir(tmp_path)
    windows = TokenWindows(tok, load_corpus())
    assert set(windows.num_tokens()) == set(CORPUS_KINDS)
    assert min(windows.num_tokens().values()) > 5000
    ids, kinds = windows.sample(torch.Generator().manual_seed(0), 8, 64)
    assert ids.shape == (8, 65) and ids.dtype == torch.int64
    assert (ids[:, 0] == tok.bos_token_id).all() and (ids[:, 1:] != tok.bos_token_id).all()
    assert sorted(set(kinds)) == sorted(CORPUS_KINDS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arch", "deepseek_v3", "--out", "x", "--steps", "0"], "--steps must be >= 1"),
        (["--arch", "deepseek_v3", "--out", "x", "--minutes", "-1"], "--minutes must be > 0"),
        (["--arch", "deepseek_v3", "--out", "x", "--minutes", "nan"], "--minutes must be > 0"),
        (["--arch", "deepseek_v3", "--out", "x", "--lr", "nan"], "--lr must be a finite number > 0"),
        (["--arch", "deepseek_v3", "--out", "x", "--lr", "inf"], "--lr must be a finite number > 0"),
        (["--arch", "deepseek_v3", "--out", "x", "--bias-update-rate", "nan"], "--bias-update-rate must be"),
        (["--arch", "deepseek_v3", "--out", "x", "--threads", "0"], "--threads must be >= 1"),
        (["--arch", "deepseek_v3", "--out", "x", "--threads", "-2"], "--threads must be >= 1"),
        (["--arch", "mixtral", "--out", "x", "--bias-update-rate", "0.1"],
         "--bias-update-rate moves DeepSeek-V3's e_score_correction_bias; --arch mixtral routes without one"),
        (["--arch", "qwen3_moe", "--out", "x", "--bias-update-rate", "0.0005"], "--arch qwen3_moe routes without one"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_bias_rate_is_a_deepseek_v3_setting() -> None:
    """Routers without a correction bias take no rate: the default passes (and is not recorded as used),
    any other is refused; DeepSeek-V3 takes any finite rate >= 0."""
    assert TrainArgs(arch="mixtral", out="x").bias_update_rate == 5e-4
    assert TrainArgs(arch="mixtral", out="x", bias_update_rate=0.0).bias_update_rate == 0.0
    with pytest.raises(ValueError, match="--arch mixtral routes without one"):
        TrainArgs(arch="mixtral", out="x", bias_update_rate=0.1)
    assert TrainArgs(arch="deepseek_v3", out="x", bias_update_rate=0.1).bias_update_rate == 0.1


def _listing(root) -> dict[str, str]:
    """Every path under root (hidden ones too) -> its text ("" for a folder)."""
    return {str(p.relative_to(root)): "" if p.is_dir() else p.read_text() for p in sorted(root.rglob("*"))}


def test_a_too_long_seq_len_fails_before_writing_anything(tmp_path, capsys) -> None:
    """The QA case: --seq-len longer than a corpus text is a one-line error, and neither a new
    --out (nor its parents) nor an existing one gets a half checkpoint."""
    existing = tmp_path / "old"
    existing.mkdir()
    (existing / "config.json").write_text("an earlier checkpoint's config")
    (existing / "notes.txt").write_text("mine")
    before = _listing(tmp_path)
    for out in (tmp_path / "new" / "ckpt", existing):
        argv = ["--arch", "mixtral", "--out", str(out), "--steps", "1", "--threads", "1", "--seq-len", "100000"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "fewer than seq_len 100000" in err
        assert _listing(tmp_path) == before


def test_an_out_that_cannot_be_a_folder_fails_before_training(tmp_path, capsys, monkeypatch) -> None:
    """A dangling symbolic link or a file in the way: a one-line error before the first step
    (it used to train the whole run, then fail moving the files)."""
    import launch.training.train as train_module

    def no_step(*args):
        raise AssertionError("trained")

    monkeypatch.setattr(train_module, "_step", no_step)
    (tmp_path / "link").symlink_to(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    for out, message in ((tmp_path / "link", "is a symbolic link to a folder that does not exist"),
                         (tmp_path / "file" / "ckpt", "is not a directory")):
        assert main(["--arch", "mixtral", "--out", str(out), "--steps", "1", "--threads", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out {out}") and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link"]


def test_a_run_failing_mid_training_leaves_out_as_it_was(tmp_path, capsys, monkeypatch) -> None:
    """A step that raises after the progress bar started: --out keeps exactly what it held,
    no staging folder is left, and the error starts its own line after the bar."""
    import launch.training.train as train_module

    calls = []

    def failing_step(model, opt, ids):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom")
        return 1.0

    monkeypatch.setattr(train_module, "_step", failing_step)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("an earlier checkpoint's config")
    before = _listing(tmp_path)
    argv = ["--arch", "mixtral", "--out", str(out), "--steps", "3", "--batch-size", "1", "--seq-len", "8",
            "--threads", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "train-tiny mixtral" in err and err.splitlines()[-1] == "error: boom"
    assert _listing(tmp_path) == before


def test_save_checkpoint_names_a_wrong_tensor(tmp_path) -> None:
    cfg = build_train_config("mixtral")
    tensors = _model("mixtral").hf_state_dict()
    tensors["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model.norm.weight: shape \(3,\)"):
        save_checkpoint(cfg, tensors, tmp_path)
    del tensors["model.norm.weight"]
    with pytest.raises(ValueError, match="missing \\['model.norm.weight'\\]"):
        save_checkpoint(cfg, tensors, tmp_path)


@pytest.mark.slow
def test_a_short_run_writes_a_checkpoint_the_engine_and_transformers_agree_on(tmp_path) -> None:
    """A few DeepSeek-V3 steps: sigmoid + groups + a nonzero trained bias, saved and loaded back;
    the engine's greedy tokens equal transformers' uncached greedy tokens."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from launch import LLM, SamplingParams
    from launch.tokenizer import Tokenizer
    from launch.workloads import load_workload

    out = tmp_path / "ckpt"
    args = TrainArgs(arch="deepseek_v3", out=str(out), steps=4, batch_size=4, seq_len=32, warmup_steps=2,
                     bias_update_rate=0.01, threads=1)
    summary = train(args, progress=False, report_prompts=2)
    assert summary["steps_run"] == 4
    assert json.loads((out / "training.json").read_text())["routing"]["kinds"].keys() == {
        "prose", "code", "tables", "french"}
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["scoring_func"], cfg["topk_method"], cfg["n_group"]) == ("sigmoid", "noaux_tc", 4)
    weights = load_file(str(out / "model.safetensors"))
    biases = [v for k, v in weights.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == len(ModelConfig.from_hf(cfg).moe_layer_ids)
    assert all(b.abs().max() > 0 for b in biases)

    tok = Tokenizer.from_dir(out)
    prompts = [tok.encode(p) for name in ("prose", "code", "tables") for p in load_workload(name)[:1]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(out), dtype="float32") as llm:
        ours = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert ours == [hf_uncached_greedy(hf, p, 8) for p in prompts]


@pytest.mark.slow
def test_minutes_stops_early_after_at_least_one_step(tmp_path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    args = TrainArgs(arch="mixtral", out=str(tmp_path / "m"), steps=1000, minutes=1e-6, batch_size=1, seq_len=8,
                     threads=1)
    summary = train(args, progress=False, report_prompts=1)
    assert summary["steps_run"] == 1
    assert "--minutes 1e-06" in summary["command"]
    assert (tmp_path / "m" / "model.safetensors").is_file()
    # the finished files moved in beside what was there; the staging folder is gone
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "notes.txt", "tokenizer.json",
        "tokenizer_config.json", "training.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
