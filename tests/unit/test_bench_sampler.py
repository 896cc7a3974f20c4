"""bench sampler: the table, the kept-set check, the JSON and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from launch.bench import sampler as bench_sampler
from launch.core.sampling_params import SamplingParams

torch.set_num_threads(1)


def test_main_times_both_samplers_and_checks_their_kept_sets(tmp_path, capsys):
    out = tmp_path / "sampler.json"
    rc = bench_sampler.main(["--batch", "4", "--vocab", "64", "700", "--settings", "greedy", "top-k-top-p-seeded",
                             "top-p", "--min-seconds", "0.01", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "sort/ours" in printed and "kept sets" in printed
    r = json.loads(out.read_text())
    assert [(row["vocab"], row["setting"]) for row in r["rows"]] == [
        (v, s) for v in (64, 700) for s in ("greedy", "top-k-top-p-seeded", "top-p")]
    for row in r["rows"]:
        assert row["ours_ms"] > 0 and row["sort_ms"] > 0
        assert row["rows_differing"] == row["max_tokens_differing"] == 0  # small V: no fp32 drift
        assert abs(row["speedup"] - row["sort_ms"] / row["ours_ms"]) < 1e-9


def test_sort_sampler_draws_from_the_filtered_rows_and_honours_seeds():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)).expand(300, 50).contiguous()
    params = [SamplingParams(top_k=3, seed=7)] * 150 + [SamplingParams(temperature=0.0)] * 150
    out = bench_sampler.SortSampler(0)(logits, params, [0] * 300)
    assert set(out[:150].tolist()) == {out[0].item()}  # one seed, one output index: one draw
    assert out[0].item() in logits[0].topk(3).indices.tolist()
    assert (out[150:] == logits[0].argmax()).all()


def test_main_rejects_bad_input(capsys):
    assert bench_sampler.main(["--settings", "nucleus"]) == 2
    assert "unknown --settings nucleus" in capsys.readouterr().err
    assert bench_sampler.main(["--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err


@pytest.mark.parametrize("flags,line", [
    (["--logit-scale", "nan"], "error: --logit-scale must be a finite number > 0, got nan"),
    (["--logit-scale", "inf"], "error: --logit-scale must be a finite number > 0, got inf"),
    (["--logit-scale", "0"], "error: --logit-scale must be a finite number > 0, got 0.0"),
    (["--min-seconds", "nan"], "error: --min-seconds must be a finite number >= 0, got nan"),
    (["--min-seconds", "-1"], "error: --min-seconds must be a finite number >= 0, got -1.0"),
    (["--batch", "0"], "error: --batch must be >= 1, got 0"),
    (["--num-threads", "0"], "error: --num-threads must be >= 1, got 0"),
    (["--vocab", "64", "1"], "error: --vocab sizes must be >= 2, got 1"),
])
def test_each_bad_flag_gets_its_own_line(monkeypatch, capsys, flags, line):
    monkeypatch.setattr(bench_sampler, "measure", _refuse)
    assert bench_sampler.main(flags) == 2
    assert capsys.readouterr().err == line + "\n"


def test_sizes_beyond_the_memory_available_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench_sampler, "measure", _refuse)
    monkeypatch.setattr("moe.kv_cache.available_memory_bytes", lambda: 8 * 2**30)
    assert bench_sampler.main(["--batch", "100000", "--vocab", "1000", "1000000"]) == 2
    assert capsys.readouterr().err == (
        "error: --batch 100000 x --vocab 1000000: float32 logits of 372.53 GiB, about 6332.99 GiB with the samplers' "
        "temporaries, exceed the 8.00 GiB of memory available (MemAvailable): lower --batch or --vocab\n")
    # greedy alone holds fewer temporaries: 5 x 1.2 GiB of logits fit in 8 GiB, 17 x do not
    assert bench_sampler.check_args(bench_sampler.build_parser().parse_args(
        ["--batch", "1280", "--vocab", "262144", "--settings", "greedy"])) is None
    assert "exceed the 8.00 GiB" in bench_sampler.check_args(bench_sampler.build_parser().parse_args(
        ["--batch", "1280", "--vocab", "262144", "--settings", "greedy", "top-p"]))


@pytest.mark.parametrize("setting", ["temperature", "seeded", "min-p", "top-p"])
def test_tokens_whose_probability_underflows_to_zero_are_not_differences(setting):
    # at scale 30 most of a row's float32 probabilities are exactly 0: ours drops them, the sort
    # keeps them finite, and neither can ever draw them
    row = bench_sampler.measure(32, 16, setting, min_seconds=0.0, logit_scale=30.0)
    assert row["rows_differing"] == row["max_tokens_differing"] == 0


def test_drawable_is_probability_above_zero():
    filtered = torch.tensor([[0.0, -200.0, float("-inf"), -1.0]])
    assert bench_sampler.drawable(filtered).tolist() == [[True, False, False, True]]


def test_a_failing_kept_set_check_says_why(monkeypatch, capsys):
    def differ(batch, vocab, setting, **kwargs):
        return {"batch": batch, "vocab": vocab, "setting": setting, "ours_ms": 1.0, "sort_ms": 2.0, "speedup": 2.0,
                "rows_differing": 3 if setting == "top-p" else 1, "max_tokens_differing": 4 if setting == "top-p" else 1}

    monkeypatch.setattr(bench_sampler, "measure", differ)
    assert bench_sampler.main(["--vocab", "64", "--settings", "top-p", "min-p"]) == 1
    assert capsys.readouterr().err == ("error: the two filters' kept sets differ by more than one token: "
                                       "top-p at vocab 64 (3 rows, <= 4 tokens)\n")
    assert bench_sampler.main(["--vocab", "64", "--settings", "min-p"]) == 0  # one token: top-p's fp32 drift
    assert capsys.readouterr().err == ""


def test_unwritable_json_is_refused_before_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_sampler, "measure", _refuse)
    regular = tmp_path / "file"
    regular.write_text("x")
    for path, problem in [(tmp_path, f"{tmp_path} is a directory"),
                          (regular / "out.json", f"{regular} is not a directory"), ("", "an empty path")]:
        assert bench_sampler.main(["--json", str(path)]) == 2
        assert capsys.readouterr().err == f"error: --json: {problem}\n"


def test_json_parent_folders_are_made(tmp_path):
    out = tmp_path / "new" / "dir" / "sampler.json"
    assert bench_sampler.main(["--batch", "2", "--vocab", "16", "--settings", "greedy", "--min-seconds", "0",
                               "--json", str(out)]) == 0
    assert [row["setting"] for row in json.loads(out.read_text())["rows"]] == ["greedy"]


def _refuse(*args, **kwargs):
    raise AssertionError("the benchmark ran for bad input")
