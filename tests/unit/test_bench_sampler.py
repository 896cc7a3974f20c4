"""bench sampler: the table, the kept-set check, the JSON and bad input."""

from __future__ import annotations

import json

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
