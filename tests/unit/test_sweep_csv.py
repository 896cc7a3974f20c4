"""results.csv carries every column a results row has: ``prediction_note`` (why a point has no prediction)."""

from __future__ import annotations

import csv

from launch.sweep import runner
from tests.unit.test_sweep_runner import fake_run, sweep_base_args


def test_a_point_without_a_prediction_says_why_in_the_csv(tmp_path, monkeypatch):
    def uncovered(config, run, row, hardware):
        raise ValueError("the cost model does not cover this layout\nmore detail")

    monkeypatch.setattr(runner, "run_point", fake_run)
    monkeypatch.setattr(runner, "predict_row", uncovered)
    assert runner.main([*sweep_base_args(tmp_path), "engine.max_num_seqs=[2]"]) == 0
    with (tmp_path / "out" / "results.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["prediction_note"] == "the cost model does not cover this layout"
    assert row["predicted_step_ms"] == ""
