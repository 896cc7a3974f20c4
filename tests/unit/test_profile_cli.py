"""``python -m launch profile report|run`` end to end: the report folder on disk (summary.json
against an independent computation, PNGs, a page with no network references) and a short
recorded run on a ``make-tiny`` checkpoint whose workload switches kind midway."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from launch import cli
from tests.unit.profile_dumps import (
    oracle_balancedness,
    oracle_hot,
    oracle_identity_rank_load,
    skewed_counts,
    write_sglang_per_pass,
    write_sglang_stat,
)

FIGURES = {"load_heatmap.png", "rank_load.png", "balancedness_layers.png", "balancedness_time.png",
           "hot_experts.png", "expert_share_time.png", "hot_set_churn.png", "what_if.png"}


def _check_page(out) -> str:
    page = (out / "index.html").read_text()
    for name in FIGURES:
        assert (out / name).stat().st_size > 2000, name
        assert f"src='{name}'" in page
    assert not re.search(r"(src|href)=['\"]?(https?:|//)", page), "the page must not reach the network"
    assert "<script" not in page
    return page


@pytest.mark.slow
def test_report_from_sglang_stat_and_per_pass_dumps(tmp_path, capsys):
    count = skewed_counts(30, 4, 8, seed=7)
    stat = write_sglang_stat(tmp_path / "stat.pt", count, empty_tail=5)
    out = tmp_path / "report"
    assert cli.main(["profile", "report", str(stat), "--out", str(out), "--ep", "2", "4", "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    load = count.sum(0)
    per_layer, overall = oracle_balancedness(oracle_identity_rank_load(load, 2))
    assert (summary["steps"], summary["num_layers"], summary["num_experts"]) == (30, 4, 8)
    assert summary["overall_balancedness"] == pytest.approx(overall, rel=1e-12)
    assert [x["balancedness"] for x in summary["layers"]] == pytest.approx(per_layer, rel=1e-12)
    ids, shares = oracle_hot(load)
    assert [x["hot_experts"] for x in summary["layers"]] == ids
    assert [x["load_share"] for x in summary["layers"]] == [pytest.approx(s, rel=1e-12) for s in shares]
    assert {(r["ep"], r["policy"]) for r in summary["what_if"]} == {(e, p) for e in (2, 4)
                                                                      for p in ("global", "hierarchical")}
    page = _check_page(out)
    assert f"{overall:.3f}" in page and "--num-redundant-experts" in page

    phy2log = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]] * 4)
    physical = np.random.default_rng(3).integers(0, 30, size=(25, 4, 10))
    per_pass = write_sglang_per_pass(tmp_path / "pp.pt", physical, phy2log, 0, list(range(25)))
    out2 = tmp_path / "report2"
    assert cli.main(["profile", "report", str(per_pass), "--out", str(out2), "--recorded-ep", "2",
                     "--no-progress"]) == 0
    summary = json.loads((out2 / "summary.json").read_text())
    assert summary["recorded_ep"] == 2 and summary["steps"] == 25
    want = oracle_balancedness(physical.sum(0).reshape(4, 2, 5).sum(-1))[1]
    assert summary["overall_balancedness"] == pytest.approx(want, rel=1e-12)
    _check_page(out2)


def test_profile_run_rejects_an_unknown_workload_in_one_line(tmp_path, capsys):
    pytest.importorskip("launch.workloads")
    rc = cli.main(["profile", "run", "--model", str(tmp_path), "--workload", "no-such-kind", "--out",
                   str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no-such-kind" in err


@pytest.mark.parametrize("flags,message", [
    (["--ep", "2", "3"], "--ep 3 does not divide the 8 experts of {model} (each EP rank holds the same number)"),
    (["--recorded-ep", "5"], "--recorded-ep 5 does not divide the 8 experts of {model} "
                             "(each EP rank holds the same number)"),
])
def test_profile_run_refuses_an_ep_size_that_does_not_divide_the_experts_before_running(
        flags, message, tiny_ckpt, tmp_path, capsys, monkeypatch):
    import launch.profile.runner

    monkeypatch.setattr(launch.profile.runner, "run_and_report", lambda *a, **k: pytest.fail("the workload ran"))
    rc = cli.main(["profile", "run", "--model", str(tiny_ckpt), "--workload", "prose", "--out",
                   str(tmp_path / "r"), *flags])
    captured = capsys.readouterr()
    assert rc == 2 and captured.err == f"error: {message.format(model=tiny_ckpt)}\n"
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_profile_run_on_a_tiny_checkpoint_shows_the_workload_switch(tmp_path, capsys):
    pytest.importorskip("launch.workloads")
    model = tmp_path / "tiny"
    assert cli.main(["make-tiny", "--arch", "deepseek_v3", "--out", str(model)]) == 0
    (tmp_path / "words.txt").write_text("the cat sat on the mat\nan essay about rivers and the sea\n")
    (tmp_path / "digits.txt").write_text("1, 2, 3, 5, 8, 13, 21\n| a | b |\n| 3 | 4 |\n")
    out = tmp_path / "profile"
    rc = cli.main(["profile", "run", "--model", str(model), "--workload",
                   f"{tmp_path / 'words.txt'}+{tmp_path / 'digits.txt'}", "--steps", "24", "--max-tokens", "4",
                   "--max-num-seqs", "2", "--capacity-factor", "0.5", "--out", str(out), "--ep", "2",
                   "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["num_layers"] == 2 and summary["num_experts"] == 8
    assert [(p["start"], p["end"]) for p in summary["phases"]] == [(0, 12), (12, 24)]
    assert summary["sources"][0]["format"] == "moe-serve" and summary["run"]["eplb"] == "off"
    assert summary["layers"][0]["model_layer"] == 1  # first_k_dense_replace = 1
    assert sum(x["tokens"] for x in summary["layers"]) > 0
    drops = summary["drops"]  # capacity factor 0.5: every layer drops some assignments
    assert drops["total"] > 0 and all(0 < f < 1 for f in drops["fraction_per_layer"])
    assert (out / "drops.png").stat().st_size > 2000
    dumps = list(out.glob("expert_distribution_*.safetensors"))
    assert len(dumps) == 1
    page = _check_page(out)
    assert "words.txt" in page and "digits.txt" in page
    # The dump reads back on its own with the same numbers, layer ids and what-if groups (the dump
    # records the model's n_group and MoE layer ids).
    again = tmp_path / "again"
    assert cli.main(["profile", "report", str(dumps[0]), "--out", str(again), "--ep", "2", "--no-progress"]) == 0
    redrawn = json.loads((again / "summary.json").read_text())
    assert redrawn["overall_balancedness"] == pytest.approx(summary["overall_balancedness"], rel=1e-12)
    assert redrawn["layers"] == summary["layers"] and redrawn["what_if"] == summary["what_if"]
    umask = os.umask(0)
    os.umask(umask)
    assert dumps[0].stat().st_mode & 0o777 == 0o666 & ~umask  # as the report's files, not safetensors' 0600
    # A second run into the same folder leaves its own dump only: `profile report DIR/expert_distribution_*`
    # would otherwise join two runs.
    capsys.readouterr()
    assert cli.main(["profile", "run", "--model", str(model), "--workload", str(tmp_path / "words.txt"), "--steps",
                     "4", "--max-tokens", "4", "--out", str(out), "--no-progress"]) == 0
    again_dumps = list(out.glob("expert_distribution_*.safetensors"))
    assert len(again_dumps) == 1 and again_dumps != dumps
    assert "removed 1 dump(s) of an earlier run" in capsys.readouterr().err


def test_an_empty_what_if_table_is_warned_of(tmp_path, capsys):
    """--ep 2 --redundant 1 3 over 8 experts: 9 and 11 slots split over no 2 ranks, so the grid
    draws nothing; the report is still written, with one warning line naming why."""
    counts = tmp_path / "c.npy"
    np.save(counts, skewed_counts(6, 2, 8, seed=1))
    assert cli.main(["profile", "report", str(counts), "--out", str(tmp_path / "a"), "--ep", "2",
                     "--redundant", "1", "3", "--no-progress"]) == 0
    err = capsys.readouterr().err.strip()
    assert err == ("warning: the what-if table is empty: 1 point(s) skipped, e.g. EP 2: redundant [1, 3] do not "
                   "give a slot count divisible by 2")
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["what_if"] == []
    assert cli.main(["profile", "report", str(counts), "--out", str(tmp_path / "b"), "--ep", "2",
                     "--redundant", "0", "2", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
