"""bench quantization: bad flags and texts get one line naming the problem (exit 2) before any model
loads; a tiny run end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

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


def test_a_tiny_run_scores_every_text(tiny_ckpt_with_tokenizer, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text(Path(bench_quantization.DATA_DIR, "essays.txt").read_text()[:400])
    out = tmp_path / "q.json"
    assert bench_quantization.main(["--model", str(tiny_ckpt_with_tokenizer), "--dtype", "float32",
                                    "--max-tokens", "32", "--texts", str(text), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"short.txt", "all"}
    assert set(results["all"]) == {"float32", "float32+int8"} and results["all"]["float32"]["tokens"] > 0
