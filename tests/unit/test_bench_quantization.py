"""bench quantization: bad flags and texts get one line naming the problem (exit 2) before any model
loads; a tiny run end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from launch.bench import quantization as bench_quantization


@pytest.fixture
def no_models(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for bad input")

    monkeypatch.setattr(bench_quantization, "build_model", refuse)


@pytest.mark.parametrize("value", ["0", "-1", "1"])
def test_max_tokens_below_two_names_the_flag(tiny_ckpt_with_tokenizer, no_models, capsys, value):
    assert bench_quantization.main(["--model", str(tiny_ckpt_with_tokenizer), "--max-tokens", value]) == 2
    assert capsys.readouterr().err == (f"error: --max-tokens must be >= 2 (a window scores each token after the "
                                       f"first), got {value}\n")


def test_max_tokens_beyond_the_models_positions(tiny_ckpt_with_tokenizer, no_models, capsys):
    assert bench_quantization.main(["--model", str(tiny_ckpt_with_tokenizer), "--max-tokens", "5000"]) == 2
    assert capsys.readouterr().err == "error: --max-tokens 5000 exceeds the model's max_position_embeddings (2048)\n"


def test_model_problems_are_named(tiny_ckpt_with_tokenizer, tmp_path, no_models, capsys):
    no_tokenizer = tmp_path / "no-tok"
    shutil.copytree(tiny_ckpt_with_tokenizer, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "missing", "no such directory"), (tmp_path / "empty", "has no config.json"),
             (no_tokenizer, "has no tokenizer.json")]
    for model, problem in cases:
        assert bench_quantization.main(["--model", str(model)]) == 2
        sep = ":" if problem.startswith("no such") else ""
        assert capsys.readouterr().err == f"error: --model {model}{sep} {problem}\n"


def test_bad_texts_are_named(tiny_ckpt_with_tokenizer, tmp_path, no_models, capsys):
    empty, binary, blank = tmp_path / "EMPTY.jsonl", tmp_path / "blob.bin", tmp_path / "blank.txt"
    empty.write_bytes(b"")
    binary.write_bytes(b"ok\x89PNG\x00\xff")
    blank.write_text(" \n\n")
    cases = [(empty, f"error: --texts {empty} is empty: nothing to score"),
             (binary, f"error: --texts {binary} is not UTF-8 text (byte 0x89 at offset 2)"),
             (blank, f"error: --texts {blank} is empty: nothing to score"),
             (tmp_path / "nope.txt", f"error: --texts {tmp_path / 'nope.txt'}: no such file"),
             (tmp_path, f"error: --texts {tmp_path}: is a directory, not a file")]
    for text, line in cases:
        assert bench_quantization.main(["--model", str(tiny_ckpt_with_tokenizer), "--texts", str(text)]) == 2
        assert capsys.readouterr().err == line + "\n"


def test_token_ids_beyond_the_vocabulary_are_named(tiny_ckpt_with_tokenizer, tmp_path, no_models, capsys):
    model = tmp_path / "small-vocab"
    shutil.copytree(tiny_ckpt_with_tokenizer, model)
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 40  # the tokenizer's byte-level ids reach well past 40
    (model / "config.json").write_text(json.dumps(config))
    text = tmp_path / "t.txt"
    text.write_text("hello world, the quick brown fox")
    assert bench_quantization.main(["--model", str(model), "--texts", str(text)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model {model}: its tokenizer gives token id ")
    assert err.endswith(f" (in {text}) but config.json's vocab_size is 40: tokenizer and checkpoint do not match\n")
    assert int(err.split("token id ")[1].split()[0]) >= 40


def test_check_token_ids_names_the_largest_id():
    ids = {Path("a.txt"): [1, 7], Path("b.txt"): [3, 12, 2]}
    bench_quantization.check_token_ids("m", ids, 13)  # ids < 13 fit
    with pytest.raises(ValueError, match=r"^--model m: its tokenizer gives token id 12 \(in b.txt\) but config.json's "
                                         r"vocab_size is 12"):
        bench_quantization.check_token_ids("m", ids, 12)


def test_unwritable_json_is_refused_before_any_model_loads(tiny_ckpt_with_tokenizer, tmp_path, no_models, capsys):
    regular = tmp_path / "file"
    regular.write_text("x")
    for path, problem in [(tmp_path, f"{tmp_path} is a directory"), (regular / "q.json", f"{regular} is not a directory"),
                          ("", "an empty path")]:
        assert bench_quantization.main(["--model", str(tiny_ckpt_with_tokenizer), "--json", str(path)]) == 2
        assert capsys.readouterr().err == f"error: --json: {problem}\n"


def test_a_tiny_run_scores_every_text(tiny_ckpt_with_tokenizer, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text(Path(bench_quantization.DATA_DIR, "essays.txt").read_text()[:400])
    out = tmp_path / "missing" / "q.json"  # its parent folder is made
    assert bench_quantization.main(["--model", str(tiny_ckpt_with_tokenizer), "--dtype", "float32",
                                    "--max-tokens", "32", "--texts", str(text), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"short.txt", "all"}
    assert set(results["all"]) == {"float32", "float32+int8"} and results["all"]["float32"]["tokens"] > 0


def test_transformers_runs_beside_ours(tiny_ckpt_with_tokenizer, tmp_path, capsys):
    """--transformers adds the model's definition (transformers' uncached forward): in float32 it
    picks every next token ours does, and with --dtype bfloat16 every run is also set against
    our float32 run."""
    text = tmp_path / "short.txt"
    text.write_text(Path(bench_quantization.DATA_DIR, "essays.txt").read_text()[:600])
    out = tmp_path / "q.json"
    common = ["--model", str(tiny_ckpt_with_tokenizer), "--max-tokens", "48", "--texts", str(text), "--transformers"]
    assert bench_quantization.main([*common, "--dtype", "float32", "--json", str(out)]) == 0
    (head,) = [line for line in capsys.readouterr().out.splitlines() if "top-1 agree" in line]
    assert head.endswith("top-1 agree vs float32") and head.count("vs float32") == 1  # one column, not two alike
    runs = json.loads(out.read_text())["results"]["all"]
    assert list(runs) == ["float32", "float32+int8", "transformers float32"]
    assert runs["transformers float32"]["top1_agreement"] == 1.0
    assert runs["transformers float32"]["perplexity"] == pytest.approx(runs["float32"]["perplexity"], rel=1e-4)
    assert bench_quantization.main([*common, "--dtype", "bfloat16", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["results"]["all"]
    assert list(runs) == ["bfloat16", "bfloat16+int8", "float32", "transformers bfloat16", "transformers float32"]
    assert runs["float32"]["top1_agreement_float32"] == 1.0
    assert runs["transformers float32"]["top1_agreement_float32"] == 1.0
    assert all(0.0 < r["top1_agreement_float32"] <= 1.0 for r in runs.values())
    assert "vs float32" in capsys.readouterr().out


def test_a_checkpoint_transformers_cannot_load_is_one_line(monkeypatch):
    """transformers' fp8 loader raises ImportError (it wants accelerate) or RuntimeError on a CPU; both
    are the one-line ValueError, not a traceback after our models were built."""
    import transformers

    for exc in (ImportError("Loading an FP8 quantized model requires accelerate (`pip install accelerate`)\nmore"),
                RuntimeError("No GPU or XPU found. A GPU or XPU is needed for FP8 quantization.")):
        def refuse(*args, exc=exc, **kwargs):
            raise exc

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
        with pytest.raises(ValueError, match=r"^--transformers: transformers cannot load /ck: ") as err:
            bench_quantization.build_transformers("/ck", torch.float32)
        assert "\n" not in str(err.value)
