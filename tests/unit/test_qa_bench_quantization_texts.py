"""bench quantization: every --texts file keeps its own results (and its tokens in "all"), even when
two files share a name; one file named twice is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

from launch.bench import quantization as bench_quantization


def test_texts_sharing_a_file_name_keep_their_own_results(tiny_ckpt_with_tokenizer, tmp_path, capsys):
    essays = Path(bench_quantization.DATA_DIR, "essays.txt").read_text()
    a, b = tmp_path / "a" / "x.txt", tmp_path / "b" / "x.txt"
    for path, text in ((a, essays[:300]), (b, essays[300:500])):
        path.parent.mkdir()
        path.write_text(text)
    out = tmp_path / "q.json"
    assert bench_quantization.main(["--model", str(tiny_ckpt_with_tokenizer), "--dtype", "float32",
                                    "--max-tokens", "32", "--texts", str(a), str(b), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {str(a), str(b), "all"}
    tokens = [results[str(p)]["float32"]["tokens"] for p in (a, b)]
    assert min(tokens) > 0 and results["all"]["float32"]["tokens"] == sum(tokens)
    assert f"{a} " in capsys.readouterr().out


def test_one_file_named_twice_is_refused(tiny_ckpt_with_tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_quantization, "build_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    text = tmp_path / "t.txt"
    text.write_text("some words to score here")
    monkeypatch.chdir(tmp_path)
    assert bench_quantization.main(["--model", str(tiny_ckpt_with_tokenizer), "--texts", str(text), "t.txt"]) == 2
    assert capsys.readouterr().err == f"error: --texts names one file twice: {text} and t.txt\n"


def test_text_labels_are_names_unless_two_share_one() -> None:
    texts = [Path("a/x.txt"), Path("b/x.txt"), Path("c/y.txt")]
    assert bench_quantization.text_labels(texts) == ["a/x.txt", "b/x.txt", "y.txt"]
